"""A from-scratch PyTorch port of OLMo 3 (``Olmo3ForCausalLM``), float32, no cache.

Architecture (sizes read from the config; D = hidden_size, H = num_attention_heads, K = num_key_value_heads,
d = head_dim (config.head_dim or D // H), F = intermediate_size, L = num_hidden_layers, V = vocab_size):

    x_0 = E[input_ids]                                            (B, S, D)
    for layer l (type t_l = config.layer_types[l], "sliding_attention" or "full_attention"):
        a   = Attn_l(x)                                           # see below
        x   = x + RMSNorm(a; g_attn_out[l])                       # OLMo-2/3 "post-sublayer" norm on the branch
        m   = W_down[l] (silu(W_gate[l] x) * (W_up[l] x))
        x   = x + RMSNorm(m; g_ffn_out[l])
    logits = RMSNorm(x; g_final) @ U                              (B, S, V)

    RMSNorm(v; g) = g * v / sqrt(mean(v^2 over the last axis) + rms_norm_eps)

    Attn_l(x):
        q = RMSNorm(x Wq; g_q)   over the WHOLE H*d projection (not per head)
        k = RMSNorm(x Wk; g_k)   over the WHOLE K*d projection
        v = x Wv
        split into heads (q: H heads, k/v: K heads of d), RoPE on q and k (NeoX half-split rotation):
            rot(u) = u * cos(p * f) + rotate_half(u) * sin(p * f),  rotate_half([u1, u2]) = [-u2, u1]
            cos/sin are multiplied by the layer type's attention factor (1 for default RoPE, YaRN's
            attention_factor otherwise), so q.k carries attention_factor^2.
        f: the layer type's inverse frequencies, from config.rope_parameters[t_l]:
            default: f_i = theta^(-2i/d), i = 0 .. d/2-1
            yarn:    f_i = f_i^interp * ramp_i + f_i^extrap * (1 - ramp_i), f^extrap = theta^(-2i/d),
                     f^interp = f^extrap / factor, ramp_i = clamp((i - lo) / (hi - lo), 0, 1),
                     lo/hi = floor/ceil of d*ln(orig_max_pos / (beta * 2 pi)) / (2 ln theta) for
                     beta = beta_fast / beta_slow, clipped to [0, d-1].
        GQA: query head h uses kv head h // (H / K).
        scores = q k^T / sqrt(d), masked: causal (kv <= q), left padding (kv is a real token), and on
        sliding layers kv > q - sliding_window (a window of sliding_window tokens, self included).
        out = softmax(scores) v, heads concatenated, times Wo.

Weight layout (my own; matrices stored transposed, in -> out, stacked over layers):
    tok_emb      (V, D)                  the token embedding
    wqkv         (L, D, (H + 2K) d)      [Wq | Wk | Wv] fused along the output axis
    wo           (L, H d, D)
    qk_norm      (L, (H + K) d)          [g_q | g_k]
    attn_out_norm(L, D)                  post_attention_layernorm
    w_gate_up    (L, D, 2F)              [W_gate | W_up]
    w_down       (L, F, D)
    ffn_out_norm (L, D)                  post_feedforward_layernorm
    final_norm   (D,)
    unembed      (D, V)                  lm_head, transposed (untied: tie_word_embeddings is False)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qk_norm_per_head",  # q/k RMSNorm statistics taken per head (over d) instead of over the whole H*d / K*d projection
    "qk_norm_after_rope",  # q/k RMSNorm applied after RoPE instead of right after the projection (the gains don't commute with the rotation)
    "norm_after_residual_add",  # classic post-LN x = norm(x + f(x)) instead of OLMo's x = x + norm(f(x))
    "sliding_window_off_by_one",  # sliding mask keeps kv >= q - window (window + 1 tokens) instead of kv > q - window
    "yarn_on_sliding_layers",  # the full-attention layers' YaRN rope_parameters used for the sliding layers too
    "yarn_original_ctx",  # YaRN correction range computed from max_position_embeddings instead of original_max_position_embeddings
    "yarn_mscale_once",  # YaRN attention_factor folded into the softmax scale once, instead of into cos/sin (factor^2 on q.k)
    "gqa_tiled_heads",  # GQA kv heads tiled (query head h -> kv head h % K) instead of repeated (h // (H/K))
    "rope_interleaved",  # RoPE rotates adjacent pairs (2i, 2i+1) (GPT-J style) instead of the half-split (NeoX) pairs (i, i + d/2)
    "gate_up_swapped",  # fused gate_up split in the wrong order: silu applied to the up projection, gate used linearly
    "sliding_mask_no_padding",  # sliding-window layers' mask built from the window alone, the padding mask only ANDed on full layers
    "tied_lm_head",  # tie_word_embeddings misread: logits computed with the token embedding instead of the separate lm_head
    "full_layer_off_by_one",  # layer types from the every-4th-layer default with an off-by-one (i % 4 == 0) instead of config.layer_types
    "rope_freq_exponent",  # inverse frequencies theta^(-i/d) (i = 0..d/2-1) instead of theta^(-2i/d): the exponent's factor 2 dropped
]

PADDING_ONLY = ["sliding_mask_no_padding"]

CLEAN = [
    "sdpa",  # attention through F.scaled_dot_product_attention with an additive float mask instead of explicit softmax
    "gqa_einsum",  # GQA by grouping query heads (K, H/K) and an einsum against the un-repeated kv heads
    "rope_complex",  # RoPE as a complex multiplication of (u1 + i u2) by exp(i p f), half-split pairs
    "rope_table",  # cos/sin looked up from a precomputed table over 0..max_position-1 instead of computed per position
    "rmsnorm_linalg",  # RMSNorm as v * sqrt(n) / sqrt(||v||^2 + n eps) with torch.linalg.vector_norm
]


# ----------------------------------------------------------------------------------------------- helpers


def _rms_norm(v, g, eps):
    if BUG == "rmsnorm_linalg":
        n = v.shape[-1]
        sq = torch.linalg.vector_norm(v, dim=-1, keepdim=True) ** 2
        return g * (v * math.sqrt(n) / torch.sqrt(sq + n * eps))
    return g * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))


def _layer_type(config, i):
    if BUG == "full_layer_off_by_one":
        return "full_attention" if i % 4 == 0 else "sliding_attention"
    return config.layer_types[i]


def _rope_params(config, layer_type):
    rp = config.rope_parameters
    if BUG == "yarn_on_sliding_layers":
        layer_type = "full_attention"
    if isinstance(rp, dict) and layer_type in rp:
        return rp[layer_type]
    return rp


def _inv_freq(config, layer_type, d):
    """(d/2,) inverse frequencies and the cos/sin attention factor of ``layer_type``."""
    p = _rope_params(config, layer_type)
    base = float(p["rope_theta"])
    if BUG == "rope_freq_exponent":
        expo = torch.arange(d // 2, dtype=torch.float32) / d
    else:
        expo = torch.arange(0, d, 2, dtype=torch.float32) / d
    extrap = 1.0 / (base**expo)
    rtype = p.get("rope_type", "default")
    if rtype == "default":
        return extrap, 1.0
    if rtype != "yarn":
        raise NotImplementedError(rtype)
    factor = float(p["factor"])
    orig = p.get("original_max_position_embeddings") or config.max_position_embeddings
    if BUG == "yarn_original_ctx":
        orig = config.max_position_embeddings
    attn = p.get("attention_factor")
    if attn is None:

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def corr_dim(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    interp = extrap / factor
    inv = interp * ramp + extrap * (1 - ramp)
    return inv, float(attn)


def _cos_sin(config, layer_type, d, positions):
    """cos, sin of shape (B or 1, S, d/2) (already times the attention factor, unless it goes elsewhere)."""
    inv, attn = _inv_freq(config, layer_type, d)
    if BUG == "rope_table":
        n = max(config.max_position_embeddings, int(positions.max()) + 1)
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
        cos_t, sin_t = ang.cos(), ang.sin()
        cos, sin = cos_t[positions], sin_t[positions]
    else:
        ang = positions[..., None].float() * inv
        cos, sin = ang.cos(), ang.sin()
    if BUG == "yarn_mscale_once":
        return cos, sin, attn  # the factor goes to the softmax scale instead
    return cos * attn, sin * attn, 1.0


def _rope(u, cos, sin):
    """u: (B, S, n, d); cos/sin: (B|1, S, d/2)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = u.shape[-1] // 2
    if BUG == "rope_interleaved":
        u1, u2 = u[..., 0::2], u[..., 1::2]
        r1, r2 = u1 * cos - u2 * sin, u2 * cos + u1 * sin
        return torch.stack((r1, r2), dim=-1).flatten(-2)
    u1, u2 = u[..., :half], u[..., half:]
    if BUG == "rope_complex":
        z = torch.complex(u1, u2) * torch.complex(cos, sin)
        return torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((u1 * cos - u2 * sin, u2 * cos + u1 * sin), dim=-1)


# ----------------------------------------------------------------------------------------------- model


class Olmo3Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.H = config.num_attention_heads
        self.K = config.num_key_value_heads or self.H
        self.d = getattr(config, "head_dim", None) or D // self.H
        self.Fi = config.intermediate_size
        self.L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        V, L, H, K, d, Fi = config.vocab_size, self.L, self.H, self.K, self.d, self.Fi
        self.tok_emb = nn.Parameter(torch.zeros(V, D))
        self.wqkv = nn.Parameter(torch.zeros(L, D, (H + 2 * K) * d))
        self.wo = nn.Parameter(torch.zeros(L, H * d, D))
        self.qk_norm = nn.Parameter(torch.ones(L, (H + K) * d))
        self.attn_out_norm = nn.Parameter(torch.ones(L, D))
        self.w_gate_up = nn.Parameter(torch.zeros(L, D, 2 * Fi))
        self.w_down = nn.Parameter(torch.zeros(L, Fi, D))
        self.ffn_out_norm = nn.Parameter(torch.ones(L, D))
        self.final_norm = nn.Parameter(torch.ones(D))
        self.unembed = nn.Parameter(torch.zeros(D, V))

    # --- masks: (B, S, S) bool, True = may attend
    def _mask(self, keep_pad, S, sliding):
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        allow = j <= i
        if sliding:
            W = self.config.sliding_window
            if BUG == "sliding_window_off_by_one":
                allow = allow & (j >= i - W)
            else:
                allow = allow & (j > i - W)
            if BUG == "sliding_mask_no_padding":
                return allow[None].expand(keep_pad.shape[0], S, S)
        return allow[None] & keep_pad[:, None, :]

    def _attention(self, l, x, cos, sin, extra_scale, mask):
        B, S, _ = x.shape
        H, K, d = self.H, self.K, self.d
        qkv = x @ self.wqkv[l]
        q, k, v = qkv.split([H * d, K * d, K * d], dim=-1)
        gq, gk = self.qk_norm[l].split([H * d, K * d])
        if BUG == "qk_norm_per_head":
            q = _rms_norm(q.view(B, S, H, d), gq.view(H, d), self.eps).reshape(B, S, H * d)
            k = _rms_norm(k.view(B, S, K, d), gk.view(K, d), self.eps).reshape(B, S, K * d)
        elif BUG != "qk_norm_after_rope":
            q = _rms_norm(q, gq, self.eps)
            k = _rms_norm(k, gk, self.eps)
        q = _rope(q.view(B, S, H, d), cos, sin)
        k = _rope(k.view(B, S, K, d), cos, sin)
        if BUG == "qk_norm_after_rope":
            q = _rms_norm(q.reshape(B, S, H * d), gq, self.eps).view(B, S, H, d)
            k = _rms_norm(k.reshape(B, S, K * d), gk, self.eps).view(B, S, K, d)
        v = v.view(B, S, K, d)
        scale = extra_scale / math.sqrt(d)
        neg = torch.finfo(x.dtype).min
        R = H // K
        if BUG == "gqa_einsum":
            qg = q.view(B, S, K, R, d)
            s = torch.einsum("bikrd,bjkd->bkrij", qg, k) * scale
            s = s.masked_fill(~mask[:, None, None], neg)
            p = s.softmax(-1)
            o = torch.einsum("bkrij,bjkd->bikrd", p, v).reshape(B, S, H * d)
            return o @ self.wo[l]
        qh = q.transpose(1, 2)  # (B, H, S, d)
        if BUG == "gqa_tiled_heads":
            kh = k.transpose(1, 2).repeat(1, R, 1, 1)
            vh = v.transpose(1, 2).repeat(1, R, 1, 1)
        else:
            kh = k.transpose(1, 2).repeat_interleave(R, dim=1)
            vh = v.transpose(1, 2).repeat_interleave(R, dim=1)
        if BUG == "sdpa":
            add = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, neg)[:, None]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=add, scale=scale)
        else:
            s = (qh @ kh.transpose(-1, -2)) * scale
            s = s.masked_fill(~mask[:, None], neg)
            o = s.softmax(-1) @ vh
        o = o.transpose(1, 2).reshape(B, S, H * d)
        return o @ self.wo[l]

    def _mlp(self, l, x):
        gu = x @ self.w_gate_up[l]
        gate, up = gu.split([self.Fi, self.Fi], dim=-1)
        if BUG == "gate_up_swapped":
            gate, up = up, gate
        return (F.silu(gate) * up) @ self.w_down[l]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        cfg = self.config
        B, S = input_ids.shape
        x = self.tok_emb[input_ids]
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            keep_pad = torch.ones(B, S, dtype=torch.bool)
        else:
            keep_pad = attention_mask.bool()
        types = [_layer_type(cfg, l) for l in range(self.L)]
        ropes, masks = {}, {}
        for t in set(types):
            ropes[t] = _cos_sin(cfg, t, self.d, position_ids)
            masks[t] = self._mask(keep_pad, S, t == "sliding_attention")
        for l in range(self.L):
            t = types[l]
            cos, sin, extra = ropes[t]
            a = self._attention(l, x, cos, sin, extra, masks[t])
            if BUG == "norm_after_residual_add":
                x = _rms_norm(x + a, self.attn_out_norm[l], self.eps)
                x = _rms_norm(x + self._mlp(l, x), self.ffn_out_norm[l], self.eps)
            else:
                x = x + _rms_norm(a, self.attn_out_norm[l], self.eps)
                x = x + _rms_norm(self._mlp(l, x), self.ffn_out_norm[l], self.eps)
        x = _rms_norm(x, self.final_norm, self.eps)
        if BUG == "tied_lm_head":
            return x @ self.tok_emb.t()
        return x @ self.unembed


def build(state_dict, config):
    """Convert a Transformers Olmo3ForCausalLM state dict to this layout."""
    m = Olmo3Port(config)
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    L = m.L

    def lay(i, name):
        return sd[f"model.layers.{i}.{name}"]

    with torch.no_grad():
        m.tok_emb.copy_(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or getattr(config, "tie_word_embeddings", False):
            head = sd["model.embed_tokens.weight"]
        m.unembed.copy_(head.t())
        m.final_norm.copy_(sd["model.norm.weight"])
        for i in range(L):
            m.wqkv[i].copy_(
                torch.cat(
                    [
                        lay(i, "self_attn.q_proj.weight"),
                        lay(i, "self_attn.k_proj.weight"),
                        lay(i, "self_attn.v_proj.weight"),
                    ],
                    dim=0,
                ).t()
            )
            m.wo[i].copy_(lay(i, "self_attn.o_proj.weight").t())
            m.qk_norm[i].copy_(torch.cat([lay(i, "self_attn.q_norm.weight"), lay(i, "self_attn.k_norm.weight")]))
            m.attn_out_norm[i].copy_(lay(i, "post_attention_layernorm.weight"))
            m.w_gate_up[i].copy_(torch.cat([lay(i, "mlp.gate_proj.weight"), lay(i, "mlp.up_proj.weight")], dim=0).t())
            m.w_down[i].copy_(lay(i, "mlp.down_proj.weight").t())
            m.ffn_out_norm[i].copy_(lay(i, "post_feedforward_layernorm.weight"))
    return m.float().eval()
