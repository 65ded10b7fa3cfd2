"""Hand-written plain-PyTorch port of LFM2-MoE (Lfm2MoeForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; output head tied to the embedding table (config.tie_word_embeddings);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps) (eps = config.norm_eps), two pre-norms per block:
        h = h + Mixer(RMS_op(h));  h = h + FFN(RMS_ffn(h))
  * hybrid stack: config.layer_types[i] is "conv" (gated short convolution) or "full_attention";
  * short-conv mixer ("conv" layers), no biases (config.conv_bias is False here):
        n = RMS_op(h), with padded positions ZEROED (attention_mask) before the input projection;
        [B | C | x] = in_proj(n);  u = B * x;
        z[t] = sum_{j=0}^{L-1} k_j * u[t - j]   (depthwise CAUSAL conv, L = config.conv_L_cache taps, zeros before t=0;
                                                 HF's Conv1d weight[:, 0, L-1-j] is the tap for lag j);
        out = out_proj(C * z);
  - attention mixer: GQA, head_dim = hidden / heads, scores scaled by head_dim**-0.5, no biases;
    * per-head RMSNorm on queries and keys (q_layernorm / k_layernorm, weight (head_dim,)) BEFORE RoPE;
    RoPE in the half-split (rotate_half) form over the full head_dim, theta = rope_parameters["rope_theta"];
  * FFN kind per layer: a dense SwiGLU (width intermediate_size) for i < config.num_dense_layers, else the MoE:
      s = sigmoid(router(x)) (no softmax); top-k experts chosen on s + expert_bias (a buffer), mixing weights are the
      UNBIASED s of the chosen experts, renormalised w / (sum w + 1e-6) (norm_topk_prob), then x routed_scaling_factor;
      experts are SwiGLU of width moe_intermediate_size; no shared expert;
  * the final RMSNorm is HF's `model.embedding_norm`: applied AFTER the last layer (not to the embeddings), then the head;
  - padding: HF-style 0/1 attention_mask masks keys in attention (float32-min fill) and zeroes the conv inputs at
    padded positions; positions 0..S-1 when position_ids are absent.

Weight layout of this port (own names, (in, out) matrices applied as x @ w):
  emb (V, H); head (H, V); out_norm.g (H,);
  blocks[i].mix_norm.g / ffn_norm.g (H,);
  conv blocks: w_b, w_c, w_x (H, H) (the three thirds of HF in_proj, split); taps (L, H), row j = tap for lag j
      (time-REVERSED w.r.t. HF's conv weight); w_out (H, H);
  attention blocks: wq (H, nh * hd); wkv (H, nkv * 2 * hd) with columns per kv head j: [k_j | v_j];
      q_gain / k_gain (hd,); wo (nh * hd, H);
  dense FFN: w1 / w3 (H, I), w2 (I, H);
  MoE: router (H, E); ebias (E,); w_gate / w_up (E, H, I'), w_down (E, I', H)  (HF's packed gate_up_proj split).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "lm_conv_taps_reversed",  # HF Conv1d weight copied as lag-major taps without flipping time: tap j reads u[t-(L-1-j)]
    "lm_conv_same_padding",  # conv written as nn.Conv1d(padding="same"): centred window, sees the next token
    "lm_conv_gates_swapped",  # in_proj thirds read as [C | B | x]: B and C gates exchanged (C before the conv)
    "lm_conv_pad_not_zeroed",  # padded positions not zeroed before in_proj: pad embeddings leak into the conv window
    "lm_final_norm_at_embedding",  # `embedding_norm` taken literally: normalises the embeddings, no final norm
    "lm_qk_norm_full_width",  # q/k layernorm computed over the whole nh*hd projection instead of per head
    "lm_router_softmax",  # Mixtral/Qwen template: softmax router probabilities instead of sigmoid
    "lm_expert_bias_in_weights",  # mixing weights gathered from the bias-corrected scores s + expert_bias
    "lm_expert_bias_ignored",  # top-k chosen on the raw sigmoid scores: expert_bias never used
    "lm_topk_not_renormalised",  # norm_topk_prob ignored: chosen sigmoid scores used as-is
    "lm_expert_gate_up_swapped",  # HF experts.gate_up_proj split as [up | gate]: silu applied to the up branch
    "lm_rope_interleaved_pairs",  # RoPE rotates adjacent pairs (GPT-J style) instead of the half-split form
    "lm_gqa_tiled_heads",  # kv heads expanded with repeat (tile): q head h reads kv head h % nkv, not h // groups
]
PADDING_ONLY = {"lm_conv_pad_not_zeroed"}
CLEAN = [
    "conv_toeplitz",  # short conv as a banded (S, S, H) Toeplitz tensor contracted with einsum
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of explicit softmax
    "experts_dense",  # every expert run on every token, combined with a dense (T, E) weight matrix
    "norm_gain_folded",  # op/ffn/final RMSNorm gains folded into the rows of the following weights at load
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


class RMS(nn.Module):
    def __init__(self, w, eps, gainless=False):
        super().__init__()
        self.g = None if gainless else _P(w)
        self.eps = eps

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if self.g is None else y * self.g


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, hd/2)"""
    cos, sin = cos[:, None], sin[:, None]
    if _bug() == "lm_rope_interleaved_pairs":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class ShortConv(nn.Module):
    def __init__(self, sd, p, cfg, gain):
        super().__init__()
        b = _bug()
        self.pre = p
        H = cfg.hidden_size
        if cfg.conv_bias:
            raise NotImplementedError("conv_bias")
        w_in = sd[p + "in_proj.weight"].float()  # (3H, H) rows [B | C | x]
        wb, wc, wx = w_in[:H], w_in[H : 2 * H], w_in[2 * H :]
        if b == "lm_conv_gates_swapped":
            wb, wc = wc, wb
        wb, wc, wx = wb.t(), wc.t(), wx.t()
        if gain is not None:
            wb, wc, wx = gain[:, None] * wb, gain[:, None] * wc, gain[:, None] * wx
        self.w_b, self.w_c, self.w_x = _P(wb), _P(wc), _P(wx)
        k = sd[p + "conv.weight"].float()[:, 0, :]  # (H, L), last column = current token
        taps = k.t() if b == "lm_conv_taps_reversed" else k.flip(-1).t()  # (L, H) lag-major
        self.taps = _P(taps)
        self.L = taps.shape[0]
        self.w_out = _P(sd[p + "out_proj.weight"].float().t())

    def forward(self, n, keep):
        b = _bug()
        if b != "lm_conv_pad_not_zeroed":
            n = n * keep[..., None].to(n.dtype)
        u = (n @ self.w_b) * (n @ self.w_x)  # (B, S, H)
        S = u.shape[1]
        if b == "conv_toeplitz":
            t = torch.arange(S)
            lag = t[:, None] - t[None, :]
            band = (lag >= 0) & (lag < self.L)
            M = self.taps[lag.clamp(0, self.L - 1)] * band[..., None]  # (S, S, H)
            z = torch.einsum("tsh,bsh->bth", M, u)
        else:
            shift0 = (self.L - 1) // 2 if b == "lm_conv_same_padding" else 0
            z = torch.zeros_like(u)
            for j in range(self.L):
                d = j - shift0  # read u[t - d]
                if d >= 0:
                    z[:, d:] += self.taps[j] * u[:, : S - d]
                else:
                    z[:, : S + d] += self.taps[j] * u[:, -d:]
        out = ((n @ self.w_c) * z) @ self.w_out
        _rec(self.pre.rstrip("."), out)
        return out


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, gain):
        super().__init__()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.eps = cfg.norm_eps
        wq = sd[p + "q_proj.weight"].float().t()
        wk = sd[p + "k_proj.weight"].float().t().reshape(-1, self.nkv, 1, self.hd)
        wv = sd[p + "v_proj.weight"].float().t().reshape(-1, self.nkv, 1, self.hd)
        wkv = torch.cat((wk, wv), 2).reshape(wq.shape[0], -1)
        if gain is not None:
            wq, wkv = gain[:, None] * wq, gain[:, None] * wkv
        self.wq, self.wkv = _P(wq), _P(wkv)
        self.q_gain = _P(sd[p + "q_layernorm.weight"])
        self.k_gain = _P(sd[p + "k_layernorm.weight"])
        self.wo = _P(sd[p + "out_proj.weight"].float().t())
        self.scale = self.hd**-0.5

    def _qk_norm(self, x, g):
        """x (B, S, n, hd)"""
        if _bug() == "lm_qk_norm_full_width":
            B, S, n, hd = x.shape
            x = x.reshape(B, S, n * hd)
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return y.view(B, S, n, hd) * g
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * g

    def forward(self, n, allowed, cos, sin):
        b = _bug()
        B, S, _ = n.shape
        q = (n @ self.wq).view(B, S, self.nh, self.hd)
        kv = (n @ self.wkv).view(B, S, self.nkv, 2, self.hd)
        k, v = kv[..., 0, :], kv[..., 1, :]
        q = self._qk_norm(q, self.q_gain).transpose(1, 2)
        k = self._qk_norm(k, self.k_gain).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        g = self.nh // self.nkv
        if b == "lm_gqa_tiled_heads":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if b == "sdpa_attention":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.wo
        _rec(self.pre.rstrip("."), out)
        return out


class DenseFFN(nn.Module):
    def __init__(self, sd, p, gain):
        super().__init__()
        self.pre = p
        w1, w3 = sd[p + "w1.weight"].float().t(), sd[p + "w3.weight"].float().t()
        if gain is not None:
            w1, w3 = gain[:, None] * w1, gain[:, None] * w3
        self.w1, self.w3 = _P(w1), _P(w3)
        self.w2 = _P(sd[p + "w2.weight"].float().t())

    def forward(self, x):
        out = (F.silu(x @ self.w1) * (x @ self.w3)) @ self.w2
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg, gain):
        super().__init__()
        b = _bug()
        self.pre = p
        self.k = cfg.num_experts_per_tok
        self.E = cfg.num_experts
        self.norm_topk = cfg.norm_topk_prob
        self.rsf = cfg.routed_scaling_factor
        router = sd[p + "gate.weight"].float().t()  # (H, E)
        if cfg.use_expert_bias:
            ebias = sd[p + "expert_bias"].float()
        else:
            ebias = None
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H) rows [gate | up]
        I = gu.shape[1] // 2  # noqa: E741
        gate, up = gu[:, :I], gu[:, I:]
        if b == "lm_expert_gate_up_swapped":
            gate, up = up, gate
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)  # (E, H, I)
        if gain is not None:
            router = gain[:, None] * router
            gate, up = gain[:, None] * gate, gain[:, None] * up
        self.router = _P(router)
        self.ebias = None if ebias is None else _P(ebias)
        self.w_gate, self.w_up = _P(gate), _P(up)
        self.w_down = _P(sd[p + "experts.down_proj"].float().transpose(1, 2))  # (E, I, H)

    def _expert(self, x, e):
        return (F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t @ self.router
        s = torch.softmax(logits, -1) if b == "lm_router_softmax" else torch.sigmoid(logits)
        if self.ebias is not None and b != "lm_expert_bias_ignored":
            choice = s + self.ebias
        else:
            choice = s
        idx = torch.topk(choice, self.k, -1).indices
        w = (choice if b == "lm_expert_bias_in_weights" else s).gather(1, idx)
        if self.norm_topk and b != "lm_topk_not_renormalised":
            w = w / (w.sum(-1, keepdim=True) + 1e-6)
        w = w * self.rsf
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


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        fold = _bug() == "norm_gain_folded"
        g_op = sd[p + "operator_norm.weight"].float()
        g_ffn = sd[p + "ffn_norm.weight"].float()
        self.mix_norm = RMS(g_op, cfg.norm_eps, gainless=fold)
        self.ffn_norm = RMS(g_ffn, cfg.norm_eps, gainless=fold)
        self.is_conv = cfg.layer_types[i] == "conv"
        if self.is_conv:
            self.mixer = ShortConv(sd, p + "conv.", cfg, g_op if fold else None)
        else:
            self.mixer = Attention(sd, p + "self_attn.", cfg, g_op if fold else None)
        if i < cfg.num_dense_layers:
            self.ffn = DenseFFN(sd, p + "feed_forward.", g_ffn if fold else None)
        else:
            self.ffn = MoE(sd, p + "feed_forward.", cfg, g_ffn if fold else None)

    def forward(self, h, keep, allowed, cos, sin):
        n = self.mix_norm(h)
        if self.is_conv:
            h = h + self.mixer(n, keep)
        else:
            h = h + self.mixer(n, allowed, cos, sin)
        h = h + self.ffn(self.ffn_norm(h))
        _rec(self.pre.rstrip("."), h)
        return h


class Lfm2MoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.emb = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        head = head.float().t()
        g_final = sd["model.embedding_norm.weight"].float()
        fold = b == "norm_gain_folded"
        if fold:
            head = g_final[:, None] * head
        self.head = _P(head)
        self.out_norm = RMS(g_final, cfg.norm_eps, gainless=fold)
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        theta = float(rp["rope_theta"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        allowed = causal & keep[:, None, None, :]
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        if b == "lm_final_norm_at_embedding":
            h = self.out_norm(h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            h = blk(h, keep, allowed, cos, sin)
        if b != "lm_final_norm_at_embedding":
            h = self.out_norm(h)
        if b != "norm_gain_folded":
            _rec("model.norm", h)
            _rec("model.embedding_norm", h)
        logits = h @ self.head
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
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.emb.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Lfm2MoePort(state_dict, config).eval()
