"""Hand-written plain-PyTorch port of MiniMax-M2 (MiniMaxM2ForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block:
        h = h + Attn(RMS_in(h));  h = h + MoE(RMS_post(h))
  - attention: GQA (num_key_value_heads < num_attention_heads, kv head of query head h = h // groups), no biases;
    * head_dim is taken from config.head_dim (24 here), NOT hidden_size / heads (16 here); scores * head_dim**-0.5;
    * q/k RMSNorm over the WHOLE projection (q: nh * head_dim wide, k: nkv * head_dim wide, one statistic per token
      for all heads together, eps = rms_norm_eps), applied right after the projections and BEFORE RoPE;
    * partial RoPE: only the first rotary_dim = head_dim * partial_rotary_factor channels of each head are rotated
      (12 of 24 here; config `rotary_dim` is turned into rope_parameters["partial_rotary_factor"]), rotate_half
      (half-split) pairing inside those channels, default frequencies over rotary_dim,
      theta = rope_parameters["rope_theta"] (5e6 here); the remaining channels pass through;
  * every layer is a sparse MoE (no dense layers, no shared expert):
      s = sigmoid(router(x)) (float32); top-k (num_experts_per_tok) chosen on s + e_score_correction_bias (a buffer);
      mixing weights are the UNBIASED s of the chosen experts renormalised w / sum w (no epsilon, no scaling factor);
      experts are SwiGLU of width config.intermediate_size (HF's packed gate_up_proj rows are [gate | up]);
  - final RMSNorm, then the head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (own names):
  tok (V, H); lm (V, H) (F.linear layout); g_final (H,);
  layers[i].g_attn / g_moe (H,);
  attn.wqkv (H, (nh + 2 nkv) * hd): (in, out), applied as x @ w, columns [q | k | v] (q_proj/k_proj/v_proj fused);
      q_gain (nh * hd,); k_gain (nkv * hd,); wo (H, nh * hd) (F.linear layout);
  moe: experts are stored in REVERSED order (port expert j = HF expert E - 1 - j) and the router rows and the
      score-correction bias are reversed with them: router (E, H) F.linear layout; bias (E,);
      w_gu (E, H, I, 2): (in, out) with gate and up INTERLEAVED on the last axis ([..., 0] = gate, [..., 1] = up);
      w_down (E, I, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "mm_qk_norm_per_head",  # Qwen3 template: q/k RMSNorm statistic taken per head instead of over the whole projection
    "mm_qk_norm_after_rope",  # q/k norms applied after RoPE (the per-channel gains then hit rotated channels)
    "mm_rotary_full_head",  # partial_rotary_factor ignored: RoPE over all head_dim channels, frequencies over head_dim
    "mm_rotary_freqs_over_head_dim",  # rotary_dim channels rotated, but inv_freq exponents divided by head_dim
    "mm_scale_hidden_over_heads",  # softmax scale from hidden_size / heads (16) instead of config.head_dim (24)
    "mm_router_softmax",  # Mixtral template: softmax router probabilities instead of sigmoid
    "mm_score_bias_in_weights",  # mixing weights gathered from the bias-corrected scores s + bias instead of s
    "mm_score_bias_not_reversed",  # experts/router reversed at load but e_score_correction_bias left in HF order
    "mm_topk_not_renormalised",  # chosen sigmoid scores used as-is, not divided by their sum
    "mm_expert_gate_up_swapped",  # HF gate_up_proj halves interleaved as (up, gate): silu applied to the up branch
    "mm_gqa_tiled_heads",  # kv heads expanded with repeat (tile): q head h reads kv head h % nkv, not h // groups
    "mm_rope_theta_default",  # theta falls back to 10000 instead of rope_parameters["rope_theta"] (5e6)
    "mm_mask_on_query_axis",  # padding applied on the query axis of the mask instead of the key axis
]
PADDING_ONLY = {"mm_mask_on_query_axis"}
CLEAN = [
    "rope_complex",  # rotary channels permuted at load to adjacent pairs (q/k columns and q/k gains); complex multiply
    "scale_in_q_gain",  # softmax scale head_dim**-0.5 folded into the q-norm gain at load, scores unscaled
    "qk_norm_head_stats",  # whole-projection RMS computed as the mean of per-head mean squares
    "experts_dense",  # every expert run on every token, combined with a dense (T, E) weight matrix
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


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _to_pairs(rot):
    """index list: new channel 2i <- old i, new 2i + 1 <- old i + rot/2 (half-split -> adjacent pairs)"""
    h = rot // 2
    return torch.stack((torch.arange(h), torch.arange(h) + h), -1).flatten()


def _rope(x, cos, sin, rot):
    """x (B, n, S, hd); cos/sin (B, S, rot/2); rotates the first `rot` channels"""
    cos, sin = cos[:, None], sin[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    if _bug() == "rope_complex":
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], -1, 2).contiguous())
        xr = torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    else:
        h = rot // 2
        x1, x2 = xr[..., :h], xr[..., h:]
        xr = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    return torch.cat((xr, xp), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, rot):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.rot = rot
        self.eps = cfg.rms_norm_eps
        wq = sd[p + "q_proj.weight"].float()  # (nh * hd, H)
        wk = sd[p + "k_proj.weight"].float()
        wv = sd[p + "v_proj.weight"].float()
        gq = sd[p + "q_norm.weight"].float()
        gk = sd[p + "k_norm.weight"].float()
        if b == "rope_complex":
            # permute the rotary channels of every head (rows of q/k and the matching gains) to adjacent pairs
            idx = torch.cat((_to_pairs(rot), torch.arange(rot, self.hd)))
            wq = wq.view(self.nh, self.hd, -1)[:, idx].reshape(wq.shape)
            gq = gq.view(self.nh, self.hd)[:, idx].reshape(-1)
            wk = wk.view(self.nkv, self.hd, -1)[:, idx].reshape(wk.shape)
            gk = gk.view(self.nkv, self.hd)[:, idx].reshape(-1)
        self.scale = self.hd**-0.5
        if b == "mm_scale_hidden_over_heads":
            self.scale = (cfg.hidden_size // self.nh) ** -0.5
        if b == "scale_in_q_gain":
            gq = gq * self.scale
            self.scale = 1.0
        self.wqkv = _P(torch.cat((wq, wk, wv), 0).t())
        self.q_gain, self.k_gain = _P(gq), _P(gk)
        self.wo = _P(sd[p + "o_proj.weight"])

    def _qk_norm(self, x, g, n):
        """x (B, S, n * hd)"""
        b = _bug()
        B, S, _ = x.shape
        if b == "mm_qk_norm_per_head":
            xh = x.view(B, S, n, self.hd)
            y = xh * torch.rsqrt(xh.pow(2).mean(-1, keepdim=True) + self.eps)
            return y.reshape(B, S, -1) * g
        if b == "qk_norm_head_stats":
            ms = x.view(B, S, n, self.hd).pow(2).mean(-1).mean(-1, keepdim=True)
            return g * (x * torch.rsqrt(ms + self.eps))
        return _rms(x, g, self.eps)

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        dq, dk = self.nh * self.hd, self.nkv * self.hd
        q, k, v = (x @ self.wqkv).split((dq, dk, dk), -1)
        if b != "mm_qk_norm_after_rope":
            q = self._qk_norm(q, self.q_gain, self.nh)
            k = self._qk_norm(k, self.k_gain, self.nkv)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin, self.rot), _rope(k, cos, sin, self.rot)
        if b == "mm_qk_norm_after_rope":
            q = self._qk_norm(q.transpose(1, 2).reshape(B, S, -1), self.q_gain, self.nh)
            k = self._qk_norm(k.transpose(1, 2).reshape(B, S, -1), self.k_gain, self.nkv)
            q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
            k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        g = self.nh // self.nkv
        if b == "mm_gqa_tiled_heads":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = torch.softmax(s, -1) @ v
        out = F.linear(ctx.transpose(1, 2).reshape(B, S, -1), self.wo)
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.E = cfg.num_local_experts
        self.k = cfg.num_experts_per_tok
        rev = torch.arange(self.E - 1, -1, -1)
        self.router = _P(sd[p + "gate.weight"].float()[rev])  # (E, H)
        bias = sd[p + "e_score_correction_bias"].float()
        self.bias = _P(bias if b == "mm_score_bias_not_reversed" else bias[rev])
        gu = sd[p + "experts.gate_up_proj"].float()[rev]  # (E, 2I, H) rows [gate | up]
        I = gu.shape[1] // 2  # noqa: E741
        gate, up = gu[:, :I].transpose(1, 2), gu[:, I:].transpose(1, 2)  # (E, H, I)
        if b == "mm_expert_gate_up_swapped":
            gate, up = up, gate
        self.w_gu = _P(torch.stack((gate, up), -1))  # (E, H, I, 2)
        self.w_down = _P(sd[p + "experts.down_proj"].float()[rev].transpose(1, 2))  # (E, I, H)

    def _expert(self, x, e):
        gu = torch.einsum("th,hic->tic", x, self.w_gu[e])
        return (F.silu(gu[..., 0]) * gu[..., 1]) @ self.w_down[e]

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = F.linear(t, self.router).float()
        s = torch.softmax(logits, -1) if b == "mm_router_softmax" else torch.sigmoid(logits)
        choice = s + self.bias
        idx = torch.topk(choice, self.k, -1).indices
        w = (choice if b == "mm_score_bias_in_weights" else s).gather(1, idx)
        if b != "mm_topk_not_renormalised":
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        if b == "experts_dense":
            dense = w.new_zeros(t.shape[0], self.E).scatter(1, idx, w)
            for e in range(self.E):
                out = out + dense[:, e : e + 1] * self._expert(t, e)
        else:
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel():
                    out.index_add_(0, tok, self._expert(t[tok], e) * w[tok, slot, None])
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i, rot):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.g_attn = _P(sd[p + "input_layernorm.weight"])
        self.g_moe = _P(sd[p + "post_attention_layernorm.weight"])
        self.attn = Attention(sd, p + "self_attn.", cfg, rot)
        self.moe = MoE(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, cos, sin):
        h = h + self.attn(_rms(h, self.g_attn, self.eps), allowed, cos, sin)
        h = h + self.moe(_rms(h, self.g_moe, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class MiniMaxM2Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        self.lm = _P(head)
        self.g_final = _P(sd["model.norm.weight"])
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rot = int(hd * rp.get("partial_rotary_factor", 1.0))
        denom = rot
        if b == "mm_rotary_full_head":
            rot = denom = hd
        elif b == "mm_rotary_freqs_over_head_dim":
            denom = hd
        theta = 10000.0 if b == "mm_rope_theta_default" else float(rp["rope_theta"])
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / denom))
        self.layers = nn.ModuleList(Layer(sd, cfg, i, rot) for i in range(cfg.num_hidden_layers))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if _bug() == "mm_mask_on_query_axis":
            allowed = causal & keep[:, None, :, None]
        else:
            allowed = causal & keep[:, None, None, :]
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for layer in self.layers:
            h = layer(h, allowed, cos, sin)
        h = _rms(h, self.g_final, self.cfg.rms_norm_eps)
        _rec("model.norm", h)
        logits = F.linear(h, self.lm)
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
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return MiniMaxM2Port(state_dict, config).eval()
