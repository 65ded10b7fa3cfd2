"""A from-scratch PyTorch port of Ministral 3 (Transformers model type ``ministral3``, text-only causal LM).

Architecture (as implemented here)
----------------------------------
Sizes from the config: V = vocab_size, H = hidden_size, L = num_hidden_layers, nh = num_attention_heads,
nkv = num_key_value_heads, hd = head_dim (NOT H // nh: Ministral 3 sets it explicitly), I = intermediate_size,
W = sliding_window, eps = rms_norm_eps, rep = nh // nkv.

    x_0 = E[input_ids]                                                  (B, S, H)
    for each layer l:
        h   = RMSNorm(x; g_attn)        RMSNorm(x; g) = g * x / sqrt(mean(x^2, -1) + eps)
        q   = h Wq  -> (B, nh,  S, hd);  k = h Wk, v = h Wv -> (B, nkv, S, hd)
        q,k = RoPE(q, pos), RoPE(k, pos)          "rotate-half" (NeoX) convention, cos/sin multiplied by the
                                                  YaRN attention factor m = 0.1 * ln(factor) + 1
        q   = q * s(pos),  s(p) = 1 + beta * ln(1 + floor(p / original_max_position_embeddings))
                                                  (Llama-4 style position-dependent query scaling,
                                                   beta = rope_parameters["llama_4_scaling_beta"])
        k,v repeated rep times per kv head (head j of q uses kv head j // rep)
        A   = softmax(q k^T / sqrt(hd) + M)       M: causal AND sliding window (q - W < k <= q, by index)
                                                  AND key not padding; disallowed = finfo(float32).min
        x   = x + (A v) Wo                         (B, S, nh*hd) -> (B, S, H)
        h   = RMSNorm(x; g_mlp)
        x   = x + (silu(h Wg) * (h Wu)) Wd
    logits = RMSNorm(x; g_final) E^T                (tied embeddings; the checkpoint's lm_head.weight)

RoPE (YaRN): dim = hd, base = rope_theta, f = factor, Lo = original_max_position_embeddings.
    pos_freq_i = base^(2i/dim), i < dim/2;   extrap_i = 1/pos_freq_i,  interp_i = 1/(f * pos_freq_i)
    corr(r)  = dim * ln(Lo / (2 pi r)) / (2 ln base)
    low = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)), dim - 1)
    ramp_i = clamp((i - low) / (high - low), 0, 1);  e_i = 1 - ramp_i
    inv_freq_i = interp_i * (1 - e_i) + extrap_i * e_i
    cos/sin(p) = cos/sin(p * [inv_freq, inv_freq]) * m                 (B, S, hd)

Weight layout (mine, converted from the checkpoint in ``build``)
----------------------------------------------------------------
All projection matrices are stored TRANSPOSED (in -> out, ``y = x @ W``) and STACKED over layers:
    tok_emb      (V, H)                         model.embed_tokens.weight
    qkv_w        (L, H, (nh + 2 nkv) * hd)      [q_proj | k_proj | v_proj] fused along the output axis
    o_w          (L, nh * hd, H)                o_proj
    gate_up_w    (L, H, 2 I)                    [gate_proj | up_proj] fused along the output axis
    down_w       (L, I, H)                      down_proj
    norm_w       (L, 2, H)                      [input_layernorm | post_attention_layernorm]
    final_norm_w (H,)                           model.norm.weight
    head_w       (H, V)                         lm_head.weight transposed (tied: equals tok_emb^T)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "yarn_beta_swapped",  # YaRN correction range computed with beta_fast/beta_slow swapped: wrong dims interpolated
    "yarn_no_mscale",  # YaRN attention factor 0.1*ln(factor)+1 never multiplied into cos/sin
    "rope_theta_default",  # base read from config.rope_theta (absent in v5 configs) -> falls back to 10000, not rope_parameters' 1e6
    "rope_interleaved",  # GPT-J interleaved-pair rotation on HF's (already permuted) rotate-half q/k layout
    "rope_table_bf16",  # cos/sin table built/cached in bfloat16 while the model runs in float32
    "llama4_scale_max_pos",  # Llama-4 query scale divides positions by max_position_embeddings instead of original_max_position_embeddings
    "llama4_scale_no_floor",  # Llama-4 query scale uses ln(1 + p/Lo) without the floor (continuous instead of stepwise)
    "llama4_scale_on_keys",  # Llama-4 position scale applied to keys as well as queries
    "llama4_scale_arange",  # Llama-4 query scale computed from arange(seq) instead of the given position_ids
    "sliding_window_off_by_one",  # sliding window keeps k >= q - W (W+1 keys) instead of k > q - W
    "gqa_repeat_tile",  # kv heads tiled (repeat) instead of interleaved: q head j uses kv head j % nkv, not j // rep
    "softmax_scale_hidden",  # softmax scale 1/sqrt(hidden_size // num_heads) instead of 1/sqrt(head_dim)
    "swiglu_swapped",  # SiLU applied to up_proj instead of gate_proj (w1/w3 confusion)
    "rmsnorm_gemma_offset",  # RMSNorm scales by (1 + weight) as in Gemma instead of weight
]

PADDING_ONLY = [
    "llama4_scale_arange",
]

CLEAN = [
    "llama4_scale_pre_rope",  # Llama-4 query scale applied before RoPE (a per-position scalar commutes with the rotation)
    "sdpa_attention",  # F.scaled_dot_product_attention with the same additive float mask instead of manual softmax
    "complex_rope",  # RoPE as a complex multiplication of (x1 + i x2) by m * exp(i p w) instead of rotate_half
    "gqa_grouped_einsum",  # GQA by grouping query heads per kv head (einsum) instead of materialising repeated kv
    "norm_weight_folded",  # RMSNorm gains folded into the following projection weights at load time
]


# ---------------------------------------------------------------------------------------------- rope
def _rope_params(config):
    """inv_freq (hd/2,) float32 and the attention factor for cos/sin, from config.rope_parameters."""
    rp = dict(getattr(config, "rope_parameters", None) or {})
    dim = config.head_dim or config.hidden_size // config.num_attention_heads
    if BUG == "rope_theta_default":
        base = getattr(config, "rope_theta", None) or 10000.0
    else:
        base = rp.get("rope_theta", 10000.0)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope_type != "yarn":
        return 1.0 / pos_freqs, 1.0

    factor = rp["factor"]
    orig = rp["original_max_position_embeddings"]
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rp.get("attention_factor")
    if attn_factor is None:
        if mscale and mscale_all_dim:
            attn_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attn_factor = get_mscale(factor)
    if BUG == "yarn_no_mscale":
        attn_factor = 1.0

    beta_fast = rp.get("beta_fast") or 32.0
    beta_slow = rp.get("beta_slow") or 1.0
    if BUG == "yarn_beta_swapped":
        beta_fast, beta_slow = beta_slow, beta_fast

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap_w = 1.0 - ramp
    inv_extrap = 1.0 / pos_freqs
    inv_interp = 1.0 / (factor * pos_freqs)
    inv_freq = inv_interp * (1.0 - extrap_w) + inv_extrap * extrap_w
    return inv_freq, float(attn_factor)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _apply_rope(x, freqs, attn_factor):
    """x (B, n, S, hd); freqs (B', S, hd/2) angles p * inv_freq."""
    if BUG == "complex_rope":
        h = x.shape[-1] // 2
        xc = torch.complex(x[..., :h], x[..., h:])
        rot = torch.polar(torch.full_like(freqs, attn_factor), freqs).unsqueeze(1)
        y = xc * rot
        return torch.cat((y.real, y.imag), dim=-1)
    if BUG == "rope_interleaved":
        emb = freqs.repeat_interleave(2, dim=-1)
        cos, sin = (emb.cos() * attn_factor).unsqueeze(1), (emb.sin() * attn_factor).unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return x * cos + rot * sin
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * attn_factor, emb.sin() * attn_factor
    if BUG == "rope_table_bf16":
        cos, sin = cos.to(torch.bfloat16).float(), sin.to(torch.bfloat16).float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _llama4_scale(pos, config):
    """(B', S) positions -> (B', 1, S, 1) multiplicative query scale."""
    rp = config.rope_parameters
    beta = rp.get("llama_4_scaling_beta")
    if beta is None:
        return None
    if BUG == "llama4_scale_max_pos":
        denom = rp.get("max_position_embeddings", config.max_position_embeddings)
    else:
        denom = rp["original_max_position_embeddings"]
    ratio = pos.float() / denom
    if BUG != "llama4_scale_no_floor":
        ratio = torch.floor(ratio)
    return (1.0 + beta * torch.log(1.0 + ratio))[:, None, :, None]


# ---------------------------------------------------------------------------------------------- model
class Ministral3Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.V, self.H = config.vocab_size, config.hidden_size
        self.L = config.num_hidden_layers
        self.nh, self.nkv = config.num_attention_heads, config.num_key_value_heads
        self.hd = config.head_dim or self.H // self.nh
        self.I = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.window = getattr(config, "sliding_window", None)
        qkv = (self.nh + 2 * self.nkv) * self.hd
        self.tok_emb = nn.Parameter(torch.zeros(self.V, self.H))
        self.qkv_w = nn.Parameter(torch.zeros(self.L, self.H, qkv))
        self.o_w = nn.Parameter(torch.zeros(self.L, self.nh * self.hd, self.H))
        self.gate_up_w = nn.Parameter(torch.zeros(self.L, self.H, 2 * self.I))
        self.down_w = nn.Parameter(torch.zeros(self.L, self.I, self.H))
        self.norm_w = nn.Parameter(torch.ones(self.L, 2, self.H))
        self.final_norm_w = nn.Parameter(torch.ones(self.H))
        self.head_w = nn.Parameter(torch.zeros(self.H, self.V))

    def _norm(self, x, w):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if BUG == "rmsnorm_gemma_offset":
            return (1.0 + w) * y
        return w * y

    def _mask(self, B, S, attention_mask, device):
        i = torch.arange(S, device=device)
        q, k = i[:, None], i[None, :]
        allowed = k <= q
        if self.window is not None:
            if BUG == "sliding_window_off_by_one":
                allowed = allowed & (k >= q - self.window)
            else:
                allowed = allowed & (k > q - self.window)
        allowed = allowed[None].expand(B, S, S)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        neg = torch.finfo(torch.float32).min
        return torch.zeros(B, 1, S, S, device=device).masked_fill(~allowed[:, None], neg)

    def _attend(self, q, k, v, mask):
        """q (B, nh, S, hd), k/v (B, nkv, S, hd), mask (B, 1, S, S) additive."""
        rep = self.nh // self.nkv
        if BUG == "softmax_scale_hidden":
            scale = (self.H // self.nh) ** -0.5
        else:
            scale = self.hd**-0.5
        if BUG == "gqa_grouped_einsum":
            B, _, S, D = q.shape
            qg = q.view(B, self.nkv, rep, S, D)
            s = torch.einsum("bgrqd,bgkd->bgrqk", qg, k) * scale + mask[:, :, None]
            p = torch.softmax(s, dim=-1)
            return torch.einsum("bgrqk,bgkd->bgrqd", p, v).reshape(B, self.nh, S, D)
        if BUG == "gqa_repeat_tile":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if BUG == "sdpa_attention":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        s = torch.matmul(q, k.transpose(-1, -2)) * scale + mask
        p = torch.softmax(s, dim=-1)
        return torch.matmul(p, v)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None]
        inv_freq, attn_factor = _rope_params(self.config)
        freqs = position_ids.float()[..., None] * inv_freq.to(dev)[None, None]  # (B', S, hd/2)
        scale_pos = torch.arange(S, device=dev)[None] if BUG == "llama4_scale_arange" else position_ids
        q_scale = _llama4_scale(scale_pos, self.config)
        mask = self._mask(B, S, attention_mask, dev)
        nq, nk = self.nh * self.hd, self.nkv * self.hd

        x = self.tok_emb[input_ids]
        for l in range(self.L):
            h = self._norm(x, self.norm_w[l, 0])
            qkv = h @ self.qkv_w[l]
            q = qkv[..., :nq].view(B, S, self.nh, self.hd).transpose(1, 2)
            k = qkv[..., nq : nq + nk].view(B, S, self.nkv, self.hd).transpose(1, 2)
            v = qkv[..., nq + nk :].view(B, S, self.nkv, self.hd).transpose(1, 2)
            if q_scale is not None and BUG == "llama4_scale_pre_rope":
                q = q * q_scale
            q = _apply_rope(q, freqs, attn_factor)
            k = _apply_rope(k, freqs, attn_factor)
            if q_scale is not None and BUG != "llama4_scale_pre_rope":
                q = q * q_scale
                if BUG == "llama4_scale_on_keys":
                    k = k * q_scale
            o = self._attend(q, k, v, mask)
            x = x + o.transpose(1, 2).reshape(B, S, nq) @ self.o_w[l]
            h = self._norm(x, self.norm_w[l, 1])
            gu = h @ self.gate_up_w[l]
            g, u = gu[..., : self.I], gu[..., self.I :]
            if BUG == "swiglu_swapped":
                g, u = u, g
            x = x + (F.silu(g) * u) @ self.down_w[l]
        x = self._norm(x, self.final_norm_w)
        return x @ self.head_w


# ---------------------------------------------------------------------------------------------- loading
def build(state_dict, config):
    sd = {k: v.float() for k, v in state_dict.items()}
    model = Ministral3Port(config)
    L = model.L
    pre = "model.layers.{}."
    with torch.no_grad():
        model.tok_emb.copy_(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or getattr(config, "tie_word_embeddings", False):
            head = sd["model.embed_tokens.weight"]
        model.head_w.copy_(head.t())
        for l in range(L):
            p = pre.format(l)
            wq = sd[p + "self_attn.q_proj.weight"]
            wk = sd[p + "self_attn.k_proj.weight"]
            wv = sd[p + "self_attn.v_proj.weight"]
            model.qkv_w[l].copy_(torch.cat([wq, wk, wv], dim=0).t())
            model.o_w[l].copy_(sd[p + "self_attn.o_proj.weight"].t())
            model.gate_up_w[l].copy_(
                torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], dim=0).t()
            )
            model.down_w[l].copy_(sd[p + "mlp.down_proj.weight"].t())
            model.norm_w[l, 0].copy_(sd[p + "input_layernorm.weight"])
            model.norm_w[l, 1].copy_(sd[p + "post_attention_layernorm.weight"])
        model.final_norm_w.copy_(sd["model.norm.weight"])
        if BUG == "norm_weight_folded":
            # RMSNorm(x; g) W = (x / rms(x)) (diag(g) W): scale the input rows of the next matrix, unit gains
            model.qkv_w.mul_(model.norm_w[:, 0, :, None])
            model.gate_up_w.mul_(model.norm_w[:, 1, :, None])
            model.head_w.mul_(model.final_norm_w[:, None])
            model.norm_w.fill_(1.0)
            model.final_norm_w.fill_(1.0)
    return model.float().eval()
