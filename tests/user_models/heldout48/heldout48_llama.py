"""A from-scratch PyTorch port of Llama (Llama 3.1-style RoPE scaling) as a causal LM.

Architecture (d = hidden_size, H = num_attention_heads, K = num_key_value_heads, G = H / K,
D = head_dim (read from config, may differ from d / H), I = intermediate_size, L = layers):

    x_0 = E[ids]                                               (B, T, d)
    for each layer l:
        h   = RMSNorm(x; a_l)          RMSNorm(x; w) = w * x / sqrt(mean(x^2, -1) + eps)
        q, k, v = h Wq, h Wk, h Wv                             (B, H|K|K, T, D)
        q, k = RoPE(q, pos), RoPE(k, pos)
        k, v repeated G times per KV head (query head j uses KV head j // G)
        s   = q k^T / sqrt(D) + mask   (mask: causal AND key is not padding; -inf ~ finfo.min)
        o   = softmax(s, -1) v, heads concatenated -> (B, T, H*D), then Wo
        x   = x + o
        h   = RMSNorm(x; f_l)
        x   = x + (silu(h Wg) * (h Wu)) Wd
    logits = RMSNorm(x; n) E^T          (tie_word_embeddings; else a separate head)

RoPE ("llama3" type): base frequencies inv_f_i = theta^(-2i/D), i < D/2, then per frequency with
wavelength w = 2 pi / inv_f:  w < L_orig / high_ff: kept;  w > L_orig / low_ff: divided by `factor`;
otherwise smoothed: (1 - s) inv_f / factor + s inv_f, s = (L_orig / w - low_ff) / (high_ff - low_ff).
Rotation angle of pair i at position p: p * inv_f_i.  The rotation here rotates ADJACENT pairs
(dims 2i, 2i+1), Meta's original ("interleaved") convention; the q/k projection rows are therefore
permuted at load from Transformers' half-split layout (dims i, i + D/2) to interleaved order.  The
dot product q.k is invariant under that common permutation, so the scores are unchanged.

Weight layout (my own; all matrices stored transposed, in -> out, stacked over layers):
    tok_emb   (V, d)                    token embeddings (also the output head when tied)
    wqkv      (L, d, (H + 2K) D)        fused [q | k | v] columns; q and k columns per head in
                                        interleaved RoPE order
    bqkv      (L, (H + 2K) D)           only with attention_bias
    wo        (L, H D, d)               (bo (L, d) only with attention_bias)
    w13       (L, d, 2 I)               fused [gate | up]   (b13 (L, 2I) with mlp_bias)
    w2        (L, I, d)                 down                (b2 (L, d) with mlp_bias)
    norms     (L, 2, d)                 [attention-norm, ffn-norm] weights
    norm_f    (d,)                      final norm weight
    w_out     (d, V)                    only when the head is not tied
    inv_freq  buffer (D/2,)             the scaled RoPE frequencies
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "llama3_scaling_ignored",  # rope_type "llama3" ignored: plain theta^(-2i/D) frequencies, no factor/smoothing
    "llama3_smooth_inverted",  # medium band interpolates backwards: s*inv/factor + (1-s)*inv
    "rope_unpermuted_qk",  # q/k rows not permuted to interleaved order at load, yet RoPE rotates adjacent pairs
    "gqa_tile_not_interleave",  # KV heads expanded with .repeat (tile: head j -> j % K) instead of repeat_interleave
    "scale_from_hidden_size",  # softmax scale 1/sqrt(hidden_size // num_heads) instead of 1/sqrt(config.head_dim)
    "norm_one_plus_weight",  # Gemma-style RMSNorm scale (1 + w) instead of w
    "gate_up_split_swapped",  # fused [gate | up] chunked as [up | gate]: SiLU applied to the up projection
    "embed_scaled_sqrt_hidden",  # embeddings multiplied by sqrt(hidden_size) (Gemma's normaliser) before layer 0
    "causal_diag_masked",  # causal mask built with triu(diagonal=0): a token may not attend to itself
    "residual_from_normed",  # attention residual taken after input RMSNorm (x = norm(x) + attn) instead of before
    "attn_out_no_transpose",  # attention output (B,H,T,D) reshaped to (B,T,H*D) without moving heads back
    "pad_mask_on_queries",  # padding mask broadcast on the query axis (B,1,T,1) instead of the key axis
    "norm_keys_swapped",  # loader stacks post_attention_layernorm as the attention norm and vice versa
    "hidden_act_ignored",  # config.hidden_act ("silu") ignored, MLP gate uses tanh-GELU
]

PADDING_ONLY = [
    "pad_mask_on_queries",
]

CLEAN = [
    "rope_complex",  # RoPE as complex multiplication (view_as_complex(q pairs) * polar(1, p*inv_freq))
    "sdpa",  # attention through F.scaled_dot_product_attention with an additive float mask
    "gqa_grouped",  # GQA without expanding K/V: queries reshaped (B, K, G, T, D), einsum per KV group
    "online_softmax",  # attention over key blocks of 8 with a running max / sum (flash-style rescaling)
    "rms_via_vector_norm",  # RMSNorm as x * rsqrt(||x||_2^2 / d + eps) via torch.linalg.vector_norm
]


# ----------------------------------------------------------------------------- helpers


def _rope_inv_freq(config) -> torch.Tensor:
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if BUG == "llama3_scaling_ignored":
        rope_type = "default"
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_ff = float(params["low_freq_factor"])
        high_ff = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wl, high_wl = old_len / low_ff, old_len / high_ff
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        s = (old_len / wl - low_ff) / (high_ff - low_ff)
        if BUG == "llama3_smooth_inverted":
            smooth = s * scaled / factor + (1 - s) * scaled
        else:
            smooth = (1 - s) * scaled / factor + s * scaled
        medium = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(medium, smooth, scaled)
    elif rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r}")
    return inv


def _to_interleaved(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Rows (out features) of a q/k projection from half-split to interleaved RoPE order, per head."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if BUG == "rms_via_vector_norm":
        ss = torch.linalg.vector_norm(x, ord=2, dim=-1, keepdim=True) ** 2 / x.shape[-1]
        y = x * torch.rsqrt(ss + eps)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if BUG == "norm_one_plus_weight":
        return (1.0 + w) * y
    return w * y


def _rope(x: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, D) in interleaved order; ang (B, T, D/2) angles."""
    if BUG == "rope_complex":
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        rot = torch.polar(torch.ones_like(ang), ang)[:, None]
        return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    if BUG == "gqa_tile_not_interleave":
        return t.repeat(1, groups, 1, 1)
    return t.repeat_interleave(groups, dim=1)


def _attend(q, k, v, allowed, scale, groups):
    """q (B,H,T,D), k/v (B,K,S,D), allowed bool (B,1,T,S) -> (B,H,T,D)."""
    neg = torch.finfo(q.dtype).min
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, neg)
    if BUG == "gqa_grouped":
        b, h, t, d = q.shape
        kv = k.shape[1]
        qg = q.reshape(b, kv, groups, t, d)
        s = torch.einsum("bkgtd,bksd->bkgts", qg, k) * scale + bias[:, :, None]
        p = torch.softmax(s, dim=-1)
        return torch.einsum("bkgts,bksd->bkgtd", p, v).reshape(b, h, t, d)
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    if BUG == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    if BUG == "online_softmax":
        block = 8
        m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros_like(q)
        for j in range(0, k.shape[2], block):
            s = q @ k[:, :, j : j + block].transpose(-1, -2) * scale + bias[..., j : j + block]
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            corr = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            denom = denom * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v[:, :, j : j + block]
            m = m_new
        return acc / denom
    s = q @ k.transpose(-1, -2) * scale + bias
    return torch.softmax(s, dim=-1) @ v


# ----------------------------------------------------------------------------- model


class LlamaPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.d = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or self.d // self.n_heads
        self.n_layers = config.num_hidden_layers
        self.inter = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.vocab = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.act = getattr(config, "hidden_act", "silu")
        L, d, D, H, K, I = self.n_layers, self.d, self.head_dim, self.n_heads, self.n_kv, self.inter
        qkv = (H + 2 * K) * D
        self.tok_emb = nn.Parameter(torch.zeros(self.vocab, d))
        self.wqkv = nn.Parameter(torch.zeros(L, d, qkv))
        self.wo = nn.Parameter(torch.zeros(L, H * D, d))
        self.w13 = nn.Parameter(torch.zeros(L, d, 2 * I))
        self.w2 = nn.Parameter(torch.zeros(L, I, d))
        self.norms = nn.Parameter(torch.ones(L, 2, d))
        self.norm_f = nn.Parameter(torch.ones(d))
        self.bqkv = nn.Parameter(torch.zeros(L, qkv)) if getattr(config, "attention_bias", False) else None
        self.bo = nn.Parameter(torch.zeros(L, d)) if getattr(config, "attention_bias", False) else None
        self.b13 = nn.Parameter(torch.zeros(L, 2 * I)) if getattr(config, "mlp_bias", False) else None
        self.b2 = nn.Parameter(torch.zeros(L, d)) if getattr(config, "mlp_bias", False) else None
        self.w_out = None if self.tied else nn.Parameter(torch.zeros(d, self.vocab))

    # ---- pieces
    def _mask(self, input_ids, attention_mask):
        b, t = input_ids.shape
        dev = input_ids.device
        i = torch.arange(t, device=dev)
        if BUG == "causal_diag_masked":
            causal = ~torch.ones(t, t, dtype=torch.bool, device=dev).triu(0)
        else:
            causal = i[None, :] <= i[:, None]  # key index <= query index
        allowed = causal[None, None].expand(b, 1, t, t)
        if attention_mask is not None:
            pad = attention_mask.to(torch.bool)
            if BUG == "pad_mask_on_queries":
                allowed = allowed & pad[:, None, :, None]
            else:
                allowed = allowed & pad[:, None, None, :]
        return allowed

    def _mlp(self, h, l):
        gu = h @ self.w13[l]
        if self.b13 is not None:
            gu = gu + self.b13[l]
        if BUG == "gate_up_split_swapped":
            up, gate = gu.chunk(2, dim=-1)
        else:
            gate, up = gu.chunk(2, dim=-1)
        if BUG == "hidden_act_ignored":
            a = F.gelu(gate, approximate="tanh")
        elif self.act == "silu":
            a = F.silu(gate)
        elif self.act in ("gelu", "gelu_pytorch_tanh"):
            a = F.gelu(gate, approximate="none" if self.act == "gelu" else "tanh")
        else:
            raise NotImplementedError(self.act)
        out = (a * up) @ self.w2[l]
        if self.b2 is not None:
            out = out + self.b2[l]
        return out

    def _attn(self, h, l, ang, allowed):
        b, t, _ = h.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        qkv = h @ self.wqkv[l]
        if self.bqkv is not None:
            qkv = qkv + self.bqkv[l]
        q, k, v = qkv.split([H * D, K * D, K * D], dim=-1)
        q = q.view(b, t, H, D).transpose(1, 2)
        k = k.view(b, t, K, D).transpose(1, 2)
        v = v.view(b, t, K, D).transpose(1, 2)
        q, k = _rope(q, ang), _rope(k, ang)
        if BUG == "scale_from_hidden_size":
            scale = (self.d // H) ** -0.5
        else:
            scale = D**-0.5
        o = _attend(q, k, v, allowed, scale, H // K)  # (B, H, T, D)
        if BUG == "attn_out_no_transpose":
            o = o.reshape(b, t, H * D)
        else:
            o = o.transpose(1, 2).reshape(b, t, H * D)
        o = o @ self.wo[l]
        if self.bo is not None:
            o = o + self.bo[l]
        return o

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        x = self.tok_emb[input_ids]
        if BUG == "embed_scaled_sqrt_hidden":
            x = x * (self.d**0.5)
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        inv_freq = _rope_inv_freq(self.config).to(x.device)  # recomputed so BUG applies at call time
        ang = position_ids.to(torch.float32)[..., None] * inv_freq  # (B, T, D/2)
        allowed = self._mask(input_ids, attention_mask)
        for l in range(self.n_layers):
            h = _rms_norm(x, self.norms[l, 0], self.eps)
            if BUG == "residual_from_normed":
                x = h
            x = x + self._attn(h, l, ang, allowed)
            h = _rms_norm(x, self.norms[l, 1], self.eps)
            x = x + self._mlp(h, l)
        x = _rms_norm(x, self.norm_f, self.eps)
        head = self.tok_emb.t() if self.w_out is None else self.w_out
        return x @ head


# ----------------------------------------------------------------------------- loading


def build(state_dict, config) -> nn.Module:
    model = LlamaPort(config)
    sd = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state_dict.items()}
    H, K, D, L = model.n_heads, model.n_kv, model.head_dim, model.n_layers
    permute = BUG != "rope_unpermuted_qk"

    def qk(w, n):  # HF (out, ...) -> interleaved RoPE row order
        return _to_interleaved(w, n, D) if permute else w

    with torch.no_grad():
        model.tok_emb.copy_(sd["embed_tokens.weight"].float())
        model.norm_f.copy_(sd["norm.weight"].float())
        for l in range(L):
            p = f"layers.{l}."
            wq = qk(sd[p + "self_attn.q_proj.weight"].float(), H)
            wk = qk(sd[p + "self_attn.k_proj.weight"].float(), K)
            wv = sd[p + "self_attn.v_proj.weight"].float()
            model.wqkv[l].copy_(torch.cat([wq, wk, wv], 0).t())
            model.wo[l].copy_(sd[p + "self_attn.o_proj.weight"].float().t())
            if model.bqkv is not None:
                bq = qk(sd[p + "self_attn.q_proj.bias"].float(), H)
                bk = qk(sd[p + "self_attn.k_proj.bias"].float(), K)
                model.bqkv[l].copy_(torch.cat([bq, bk, sd[p + "self_attn.v_proj.bias"].float()]))
                model.bo[l].copy_(sd[p + "self_attn.o_proj.bias"].float())
            wg = sd[p + "mlp.gate_proj.weight"].float()
            wu = sd[p + "mlp.up_proj.weight"].float()
            model.w13[l].copy_(torch.cat([wg, wu], 0).t())
            model.w2[l].copy_(sd[p + "mlp.down_proj.weight"].float().t())
            if model.b13 is not None:
                model.b13[l].copy_(torch.cat([sd[p + "mlp.gate_proj.bias"], sd[p + "mlp.up_proj.bias"]]).float())
                model.b2[l].copy_(sd[p + "mlp.down_proj.bias"].float())
            a_norm = sd[p + "input_layernorm.weight"].float()
            f_norm = sd[p + "post_attention_layernorm.weight"].float()
            if BUG == "norm_keys_swapped":
                a_norm, f_norm = f_norm, a_norm
            model.norms[l, 0].copy_(a_norm)
            model.norms[l, 1].copy_(f_norm)
        if model.w_out is not None:
            model.w_out.copy_(sd.get("lm_head.weight", sd["embed_tokens.weight"]).float().t())
    return model.float().eval()
