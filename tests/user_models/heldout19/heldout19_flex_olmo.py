"""Hand-written plain-PyTorch port of FlexOlmo (FlexOlmoForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding (no scaling); separate untied output head;
  * * OLMo-2-style reordered norms: NO pre-norms; each sublayer's OUTPUT is RMS-normalised before it is added to
    the residual stream:
        h = h + RMS_attn(Attn(h));  h = h + RMS_ffn(MoE(h));  final RMSNorm before the head
    (RMSNorm y = x / sqrt(mean(x^2) + eps) * w, eps = rms_norm_eps);
  * attention: GQA, head_dim = hidden / heads, no biases, scores = q.k / sqrt(head_dim);
  * * QK-norm over the WHOLE projection: q (width nh*hd) and k (width nkv*hd) are RMS-normalised across all heads
    at once (gains of size nh*hd / nkv*hd), before splitting into heads and before RoPE;
  * RoPE in the half-split (rotate_half / NeoX) form over the full head_dim, theta = rope_parameters["rope_theta"]
    (500000 by default);
  * * every layer's FFN is a sparse MoE without shared experts: router logits = x Wr, probabilities =
    softmax over ALL experts (float32), top-k (num_experts_per_tok) experts, combine weights are the chosen
    softmax probabilities NOT renormalised (norm_topk_prob False; note that any per-token rescaling of the MoE
    output is cancelled by the following RMSNorm anyway); each expert is a SwiGLU MLP of width intermediate_size;
  * padding: HF-style attention_mask masks keys (float32 min fill); positions from position_ids
    (0..S-1 when absent, also for left-padded rows, as HF does).

Weight layout of this port (OLMo-core-like names, fused QKV, [gate | up] packed stacked experts):
  embeddings (V, H); lm_head_w (V, H); lm_head_norm (H,);
  blocks[i].attention.w_qkv ((nh + 2*nkv) * hd, H) (nn.Linear orientation, rows [Q | K | V]);
  blocks[i].attention.q_norm (nh*hd,); blocks[i].attention.k_norm (nkv*hd,); blocks[i].attention.w_out (H, nh*hd);
  blocks[i].attention_norm (H,) (applied to the attention output); blocks[i].feed_forward_norm (H,);
  blocks[i].moe.router (H, E) ("x @ W");
  blocks[i].moe.w_gate_up (E, H, 2*I) with [..., :I] = gate, [..., I:] = up; blocks[i].moe.w_down (E, I, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "fo_qk_norm_per_head",  # q/k RMSNorm computed per head (Qwen3 habit) instead of over the whole projection
    "fo_qk_norm_after_rope",  # q/k norm applied after RoPE instead of before
    "fo_pre_norm",  # Llama pre-norm: the norms applied to the sublayer input instead of its output
    "fo_norm_outside_residual",  # classic post-LN: norm(h + f(h)) instead of h + norm(f(h))
    "fo_final_norm_skipped",  # final model.norm dropped ("the sublayers are already normalised")
    "fo_down_proj_view_not_transpose",  # HF experts.down_proj (E, H, I) reshaped with .view(E, I, H) instead of transposed
    "fo_router_sigmoid",  # independent sigmoid router scores instead of a softmax over all experts
    "fo_expert_outputs_unweighted",  # chosen experts' outputs summed without the router weights
    "fo_gate_up_swapped",  # HF gate_up_proj halves taken as [up | gate]: SiLU applied to the up branch
    "fo_rope_theta_default",  # rope theta hard-coded to 10000 instead of rope_parameters["rope_theta"] (500000)
    "fo_gqa_tiled",  # KV heads expanded with repeat (tile) instead of repeat_interleave
    "fo_lm_head_tied",  # output head tied to the embedding table although tie_word_embeddings is False
    "fo_pad_mask_query_axis",  # padding mask broadcast on the query axis instead of the key axis
]
PADDING_ONLY = {"fo_pad_mask_query_axis"}
CLEAN = [
    "sdpa_gqa",  # F.scaled_dot_product_attention with a boolean mask and enable_gqa=True
    "experts_dense_einsum",  # every expert run on every token with einsums, combined with a dense (T, E) weight
    "topk_on_logits",  # top-k taken on the raw logits, weights exp(l - logsumexp(l)) for the chosen ones
    "rope_complex",  # q/k head channels (and the q/k norm gains) permuted at load; RoPE as a complex multiply
    "varlen_unpad",  # each row's real tokens run alone with their own position_ids, logits scattered back
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _pairs_order(hd):
    """channel order that puts half-split pair (i, i + hd/2) at (2i, 2i+1)"""
    idx = []
    for i in range(hd // 2):
        idx += [i, hd // 2 + i]
    return torch.tensor(idx)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, ang):
    """x (B, heads, S, hd); ang (B, S, hd/2)"""
    if _bug() == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    emb = torch.cat((ang, ang), -1)[:, None]
    h = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * emb.sin()


class Attention(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        H = cfg.hidden_size
        q = sd[p + "q_proj.weight"].float()
        k = sd[p + "k_proj.weight"].float()
        v = sd[p + "v_proj.weight"].float()
        qg = sd[p + "q_norm.weight"].float()
        kg = sd[p + "k_norm.weight"].float()
        if b == "rope_complex":
            order = _pairs_order(self.hd)
            q = q.view(self.nh, self.hd, H)[:, order].reshape(-1, H)
            k = k.view(self.nkv, self.hd, H)[:, order].reshape(-1, H)
            qg = qg.view(self.nh, self.hd)[:, order].reshape(-1)
            kg = kg.view(self.nkv, self.hd)[:, order].reshape(-1)
        self.w_qkv = _P(torch.cat((q, k, v), 0))
        self.q_norm = _P(qg)
        self.k_norm = _P(kg)
        self.w_out = _P(sd[p + "o_proj.weight"])
        self.eps = cfg.rms_norm_eps
        self.scale = self.hd**-0.5

    def _qk_norm(self, x, w, heads):
        if _bug() == "fo_qk_norm_per_head":
            shp = x.shape
            return _rms(x.reshape(*shp[:-1], heads, self.hd), w.view(heads, self.hd), self.eps).reshape(shp)
        return _rms(x, w, self.eps)

    def forward(self, x, allowed, ang):
        b = _bug()
        B, S, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q, k, v = F.linear(x, self.w_qkv).split((nq, nk, nk), -1)
        if b != "rope_complex":
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        if b != "fo_qk_norm_after_rope":
            q, k = self._qk_norm(q, self.q_norm, self.nh), self._qk_norm(k, self.k_norm, self.nkv)
            if b != "rope_complex":
                _rec(self.pre + "q_norm", q)
                _rec(self.pre + "k_norm", k)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, ang), _rope(k, ang)
        if b == "fo_qk_norm_after_rope":
            q = _rms(q.transpose(1, 2).reshape(B, S, nq), self.q_norm, self.eps).view(B, S, self.nh, -1).transpose(1, 2)
            k = (
                _rms(k.transpose(1, 2).reshape(B, S, nk), self.k_norm, self.eps)
                .view(B, S, self.nkv, -1)
                .transpose(1, 2)
            )
        g = self.nh // self.nkv
        if b == "sdpa_gqa":
            eye = torch.eye(S, dtype=torch.bool)[None, None]
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | eye, scale=self.scale, enable_gqa=True)
        else:
            if b == "fo_gqa_tiled":
                k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            else:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = F.linear(ctx.transpose(1, 2).reshape(B, S, nq), self.w_out)
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        self.E, self.k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk = cfg.norm_topk_prob
        self.router = _P(sd[p + "gate.weight"].float().t())
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        self.inter = gu.shape[1] // 2
        if b == "fo_gate_up_swapped":
            gu = torch.cat((gu[:, self.inter :], gu[:, : self.inter]), 1)
        self.w_gate_up = _P(gu.transpose(1, 2))  # (E, H, 2I)
        dp = sd[p + "experts.down_proj"].float()  # (E, H, I)
        if b == "fo_down_proj_view_not_transpose":
            self.w_down = _P(dp.reshape(dp.shape[0], dp.shape[2], dp.shape[1]))
        else:
            self.w_down = _P(dp.transpose(1, 2))  # (E, I, H)

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t.float() @ self.router
        if b == "topk_on_logits":
            top_l, idx = logits.topk(self.k, -1)
            w = torch.exp(top_l - torch.logsumexp(logits, -1, keepdim=True))
        else:
            probs = torch.sigmoid(logits) if b == "fo_router_sigmoid" else torch.softmax(logits, -1)
            w, idx = probs.topk(self.k, -1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        if b == "fo_expert_outputs_unweighted":
            w = torch.ones_like(w)
        n = self.inter
        if b == "experts_dense_einsum":
            dense_w = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)
            gu = torch.einsum("th,ehj->etj", t, self.w_gate_up)
            y = torch.einsum("eti,eih->eth", F.silu(gu[..., :n]) * gu[..., n:], self.w_down)
            out = torch.einsum("eth,te->th", y, dense_w)
        else:
            out = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                gu = t[tok] @ self.w_gate_up[e]
                ye = (F.silu(gu[:, :n]) * gu[:, n:]) @ self.w_down[e]
                out.index_add_(0, tok, ye * w[tok, slot, None])
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.attention = Attention(sd, p + "self_attn.", cfg)
        self.attention_norm = _P(sd[p + "post_attention_layernorm.weight"])
        self.moe = MoE(sd, p + "mlp.", cfg)
        self.feed_forward_norm = _P(sd[p + "post_feedforward_layernorm.weight"])
        self.eps = cfg.rms_norm_eps

    def forward(self, h, allowed, ang):
        b = _bug()
        if b == "fo_pre_norm":
            h = h + self.attention(_rms(h, self.attention_norm, self.eps), allowed, ang)
            h = h + self.moe(_rms(h, self.feed_forward_norm, self.eps))
        elif b == "fo_norm_outside_residual":
            h = _rms(h + self.attention(h, allowed, ang), self.attention_norm, self.eps)
            h = _rms(h + self.moe(h), self.feed_forward_norm, self.eps)
        else:
            a = _rms(self.attention(h, allowed, ang), self.attention_norm, self.eps)
            _rec(self.pre + "post_attention_layernorm", a)
            h = h + a
            m = _rms(self.moe(h), self.feed_forward_norm, self.eps)
            _rec(self.pre + "post_feedforward_layernorm", m)
            h = h + m
        _rec(self.pre.rstrip("."), h)
        return h


class FlexOlmoPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.embeddings = _P(sd["model.embed_tokens.weight"])
        tied = cfg.tie_word_embeddings or b == "fo_lm_head_tied" or "lm_head.weight" not in sd
        self.lm_head_w = _P(sd["model.embed_tokens.weight" if tied else "lm_head.weight"])
        self.lm_head_norm = _P(sd["model.norm.weight"])
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        theta = 10000.0 if b == "fo_rope_theta_default" else float(rp["rope_theta"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        causal = (ki <= qi)[None, None]
        if b == "fo_pad_mask_query_axis":
            allowed = causal & keep[:, None, :, None]
        else:
            allowed = causal & keep[:, None, None, :]
        ang = pos[..., None].float() * self.inv_freq
        h = self.embeddings[input_ids]
        _rec("model.embed_tokens", h)
        for blk in self.blocks:
            h = blk(h, allowed, ang)
        if b != "fo_final_norm_skipped":
            h = _rms(h, self.lm_head_norm, self.cfg.rms_norm_eps)
            _rec("model.norm", h)
        logits = h @ self.lm_head_w.t()
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None]
        position_ids = position_ids.expand(B, S)
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.cfg.vocab_size)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return FlexOlmoPort(state_dict, config).eval()
