"""A from-scratch PyTorch port of Qwen2 (decoder-only causal LM), plain torch only.

Architecture (as implemented here)
----------------------------------
Sizes from the config: V = vocab_size, H = hidden_size, L = num_hidden_layers, nq = num_attention_heads,
nkv = num_key_value_heads, d = head_dim (= H // nq unless config.head_dim), I = intermediate_size,
g = nq // nkv (query heads per key/value head), W = sliding_window, eps = rms_norm_eps.

    x_0 = E[input_ids]                                             (B, S, H)
    for each layer l:
        h      = RMSNorm(x; a_l)                 RMSNorm(x; w) = w * x / sqrt(mean(x^2, -1) + eps)
        [q|k|v] = h @ Wqkv_l + bqkv_l             q: (B, S, nq, d), k, v: (B, S, nkv, d)  (biases on q, k, v)
        q, k   = RoPE(q, pos), RoPE(k, pos)       NeoX / "rotate-half" RoPE on the full head dim:
                                                  theta_i = rope_theta ** (-2i / d), i < d/2,
                                                  angle = pos * theta_i, duplicated over both halves,
                                                  x' = x * cos + rotate_half(x) * sin,
                                                  rotate_half([x1, x2]) = [-x2, x1]
        key/value head j serves query heads j*g .. j*g + g - 1 (repeat-interleave)
        s      = q k^T / sqrt(d) + mask_l         mask_l (B, 1, S, S): 0 where allowed, finfo.min elsewhere;
                                                  allowed(b, i, j) = j <= i and attention_mask[b, j] != 0,
                                                  and, on a sliding layer, j > i - W (W keys incl. itself)
        o      = softmax(s, -1) v -> (B, S, nq * d), heads merged in order
        x      = x + o @ Wo_l                     (no output bias)
        h      = RMSNorm(x; m_l)
        [gt|up] = h @ Wgu_l                       (B, S, 2I)
        x      = x + (silu(gt) * up) @ Wdown_l
    logits = RMSNorm(x; f) @ E^T                  (tied embeddings; an untied head is used if given)

Sliding layers: layer l uses the window when config.use_sliding_window and l >= config.max_window_layers
(the first max_window_layers layers use full attention); config.layer_types, when given, is what decides.
Positions: position_ids when given, else 0 .. S-1 for every row.

Weight layout (differs from Transformers' module tree)
------------------------------------------------------
    embed       (V, H)                    token embedding, also the (tied) output matrix
    head_t      (H, V) or absent          only when the checkpoint has an untied lm_head (stored in -> out)
    wqkv        (L, H, (nq + 2 nkv) d)    stacked, transposed (in -> out), fused [q | k | v] columns
    bqkv        (L, (nq + 2 nkv) d)       fused [q | k | v] biases
    wo          (L, nq d, H)              transposed o_proj
    w_gate_up   (L, H, 2 I)               transposed, fused [gate | up] columns
    w_down      (L, I, H)                 transposed down_proj
    norms       (L, 2, H)                 [:, 0] input_layernorm, [:, 1] post_attention_layernorm
    final_norm  (H,)
    inv_freq    (d/2,) buffer             RoPE inverse frequencies
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qkv_bias_after_rope",  # q/k biases are added after RoPE rotates q/k instead of before (bias fused in the wrong place)
    "window_layers_inverted",  # max_window_layers misread: the FIRST max_window_layers layers get the sliding window
    "window_off_by_one",  # sliding-window test j >= i - W keeps W + 1 keys instead of W
    "rope_theta_default",  # rope_theta looked up as config.rope_theta (gone in v5), falls back to 10000 instead of rope_parameters'
    "rope_interleaved",  # GPT-J style RoPE (rotates adjacent pairs 2i, 2i+1) instead of Qwen2's NeoX rotate-half
    "norm_weight_plus_one",  # RMSNorm scales by (1 + w) as in Gemma, Qwen2 scales by w
    "gqa_repeat_tiled",  # kv heads tiled (query head h uses kv head h % nkv) instead of repeat-interleaved (h // g)
    "scale_by_hidden",  # attention scores scaled by 1/sqrt(hidden_size) instead of 1/sqrt(head_dim)
    "sliding_mask_drops_padding",  # sliding layers' mask built from causal + window only, the padding mask left out
    "pad_mask_on_queries",  # padding mask broadcast along the query axis instead of the key axis
    "gate_up_swapped",  # fused [gate | up] halves read in the wrong order: silu applied to up_proj
    "embed_scaled",  # token embeddings multiplied by sqrt(hidden_size) (Gemma habit), Qwen2 does not scale
    "attn_merge_no_transpose",  # (B, nq, S, d) attention output reshaped to (B, S, nq*d) without moving heads back
    "rope_angles_bf16",  # RoPE angles pos * inv_freq computed in bfloat16 before cos/sin (precision cast in the wrong place)
]

PADDING_ONLY = ["sliding_mask_drops_padding", "pad_mask_on_queries"]

CLEAN = [
    "rope_complex",  # RoPE as complex multiplication of (x[:d/2] + i x[d/2:]) by exp(i * angle)
    "sdpa",  # attention through F.scaled_dot_product_attention with the same additive mask, kv heads expanded
    "window_by_positions",  # sliding window tested on position_ids differences (equal to index differences on real tokens)
    "online_softmax",  # attention over key blocks with a running max / running sum (flash-attention style loop)
    "rms_via_norm",  # RMSNorm as x / sqrt(||x||_2^2 / H + eps) with torch.linalg.vector_norm
]


def _rms_norm(x, w, eps):
    bug = BUG
    if bug == "rms_via_norm":
        n = torch.linalg.vector_norm(x, ord=2, dim=-1, keepdim=True)
        y = x / torch.sqrt(n * n / x.shape[-1] + eps)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if bug == "norm_weight_plus_one":
        return (1.0 + w) * y
    return w * y


def _rope_angles(inv_freq, positions):
    """positions (B, S) -> angles (B, S, d/2)."""
    if BUG == "rope_angles_bf16":
        return (positions.to(torch.bfloat16)[..., None] * inv_freq.to(torch.bfloat16)).float()
    return positions.float()[..., None] * inv_freq.float()


def _apply_rope(x, ang):
    """x (B, heads, S, d), ang (B, S, d/2)."""
    bug = BUG
    half = x.shape[-1] // 2
    ang = ang[:, None]  # (B, 1, S, d/2)
    if bug == "rope_interleaved":
        cos, sin = ang.cos(), ang.sin()
        xe, xo = x[..., 0::2], x[..., 1::2]
        return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2)
    if bug == "rope_complex":
        z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(ang), ang)
        return torch.cat((z.real, z.imag), dim=-1)
    cos = torch.cat((ang, ang), dim=-1).cos()
    sin = torch.cat((ang, ang), dim=-1).sin()
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _attend(q, k, v, mask, scale):
    """q (B, nq, S, d), k/v (B, nq, S, d) already expanded, mask additive (B, 1, S, S)."""
    bug = BUG
    if bug == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if bug == "online_softmax":
        B, Hn, S, D = q.shape
        m = torch.full((B, Hn, S, 1), -float("inf"), dtype=q.dtype)
        den = torch.zeros((B, Hn, S, 1), dtype=q.dtype)
        acc = torch.zeros((B, Hn, S, D), dtype=q.dtype)
        block = 5
        for s0 in range(0, S, block):
            kb, vb = k[:, :, s0 : s0 + block], v[:, :, s0 : s0 + block]
            sc = q @ kb.transpose(-1, -2) * scale + mask[..., s0 : s0 + block]
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            corr = torch.exp(m - m_new)
            p = torch.exp(sc - m_new)
            den = den * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ vb
            m = m_new
        return acc / den
    s = q @ k.transpose(-1, -2) * scale + mask
    return torch.softmax(s, dim=-1) @ v


class Qwen2Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.V = config.vocab_size
        self.H = config.hidden_size
        self.L = config.num_hidden_layers
        self.nq = config.num_attention_heads
        self.nkv = config.num_key_value_heads or self.nq
        self.d = getattr(config, "head_dim", None) or self.H // self.nq
        self.I = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.config = config
        rp = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        window = config.sliding_window if getattr(config, "use_sliding_window", False) else None
        self.window = window
        self.max_window_layers = getattr(config, "max_window_layers", self.L)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            layer_types = [
                "sliding_attention" if window is not None and i >= self.max_window_layers else "full_attention"
                for i in range(self.L)
            ]
        self.sliding = [t == "sliding_attention" for t in layer_types]

        qkv = (self.nq + 2 * self.nkv) * self.d
        self.embed = nn.Parameter(torch.zeros(self.V, self.H))
        self.head_t = None
        self.wqkv = nn.Parameter(torch.zeros(self.L, self.H, qkv))
        self.bqkv = nn.Parameter(torch.zeros(self.L, qkv))
        self.wo = nn.Parameter(torch.zeros(self.L, self.nq * self.d, self.H))
        self.w_gate_up = nn.Parameter(torch.zeros(self.L, self.H, 2 * self.I))
        self.w_down = nn.Parameter(torch.zeros(self.L, self.I, self.H))
        self.norms = nn.Parameter(torch.ones(self.L, 2, self.H))
        self.final_norm = nn.Parameter(torch.ones(self.H))
        self.register_buffer("inv_freq", self._inv_freq(self.rope_theta), persistent=False)

    def _inv_freq(self, theta):
        return 1.0 / (theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)).float()

    def _masks(self, attention_mask, positions, B, S, device):
        """Additive masks (B, 1, S, S) for full and sliding layers."""
        bug = BUG
        i = torch.arange(S, device=device)
        allowed = (i[None, :] <= i[:, None])[None].expand(B, S, S)  # [b, q, k]
        if attention_mask is not None:
            pad = attention_mask.to(torch.bool)
            if bug == "pad_mask_on_queries":
                allowed = allowed & pad[:, :, None]
            else:
                allowed = allowed & pad[:, None, :]
        causal_only = (i[None, :] <= i[:, None])[None].expand(B, S, S)
        W = self.window
        full_sl = allowed
        if W is not None:
            if bug == "window_by_positions":
                pq, pk = positions[:, :, None], positions[:, None, :]
                inwin = pk > pq - W
            elif bug == "window_off_by_one":
                inwin = (i[None, :] >= i[:, None] - W)[None]
            else:
                inwin = (i[None, :] > i[:, None] - W)[None]
            full_sl = (causal_only if bug == "sliding_mask_drops_padding" else allowed) & inwin
        neg = torch.finfo(torch.float32).min
        zero = torch.zeros((), dtype=torch.float32, device=device)
        to_add = lambda a: torch.where(a, zero, neg)[:, None]  # noqa: E731
        return to_add(allowed), to_add(full_sl)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = BUG
        B, S = input_ids.shape
        dev = input_ids.device
        x = self.embed[input_ids]
        if bug == "embed_scaled":
            x = x * math.sqrt(self.H)

        if position_ids is None:
            positions = torch.arange(S, device=dev)[None].expand(B, S)
        else:
            positions = position_ids.to(dev).expand(B, S)
        inv_freq = self.inv_freq
        if bug == "rope_theta_default":
            inv_freq = self._inv_freq(10000.0)
        ang = _rope_angles(inv_freq, positions)

        full_mask, slide_mask = self._masks(attention_mask, positions, B, S, dev)
        sliding = self.sliding
        if bug == "window_layers_inverted" and self.window is not None:
            sliding = [l < self.max_window_layers for l in range(self.L)]

        nq, nkv, d, g = self.nq, self.nkv, self.d, self.nq // self.nkv
        scale = 1.0 / math.sqrt(self.H if bug == "scale_by_hidden" else d)
        for l in range(self.L):
            h = _rms_norm(x, self.norms[l, 0], self.eps)
            if bug == "qkv_bias_after_rope":
                qkv = h @ self.wqkv[l]
            else:
                qkv = h @ self.wqkv[l] + self.bqkv[l]
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            q = q.view(B, S, nq, d).transpose(1, 2)
            k = k.view(B, S, nkv, d).transpose(1, 2)
            v = v.view(B, S, nkv, d).transpose(1, 2)
            if bug == "qkv_bias_after_rope":
                bq, bk, bv = self.bqkv[l].split([nq * d, nkv * d, nkv * d])
                q = _apply_rope(q, ang) + bq.view(nq, 1, d)
                k = _apply_rope(k, ang) + bk.view(nkv, 1, d)
                v = v + bv.view(nkv, 1, d)
            else:
                q = _apply_rope(q, ang)
                k = _apply_rope(k, ang)
            if bug == "gqa_repeat_tiled":
                k = k.repeat(1, g, 1, 1)
                v = v.repeat(1, g, 1, 1)
            else:
                k = k.repeat_interleave(g, dim=1)
                v = v.repeat_interleave(g, dim=1)
            o = _attend(q, k, v, slide_mask if sliding[l] else full_mask, scale)  # (B, nq, S, d)
            if bug == "attn_merge_no_transpose":
                o = o.reshape(B, S, nq * d)
            else:
                o = o.transpose(1, 2).reshape(B, S, nq * d)
            x = x + o @ self.wo[l]

            h = _rms_norm(x, self.norms[l, 1], self.eps)
            gu = h @ self.w_gate_up[l]
            if bug == "gate_up_swapped":
                up, gate = gu.split([self.I, self.I], dim=-1)
            else:
                gate, up = gu.split([self.I, self.I], dim=-1)
            x = x + (F.silu(gate) * up) @ self.w_down[l]

        x = _rms_norm(x, self.final_norm, self.eps)
        if self.head_t is not None:
            return x @ self.head_t
        return x @ self.embed.t()


def build(state_dict, config) -> nn.Module:
    sd = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state_dict.items()}
    m = Qwen2Port(config)
    L = m.L
    with torch.no_grad():
        m.embed.copy_(sd["embed_tokens.weight"].float())
        tied = getattr(config, "tie_word_embeddings", False)
        if not tied and "lm_head.weight" in sd:
            m.head_t = nn.Parameter(sd["lm_head.weight"].float().t().contiguous())
        for l in range(L):
            p = f"layers.{l}."
            a = p + "self_attn."
            m.wqkv[l].copy_(torch.cat([sd[a + n + "_proj.weight"] for n in ("q", "k", "v")], dim=0).float().t())
            m.bqkv[l].copy_(torch.cat([sd[a + n + "_proj.bias"] for n in ("q", "k", "v")], dim=0).float())
            m.wo[l].copy_(sd[a + "o_proj.weight"].float().t())
            mp = p + "mlp."
            m.w_gate_up[l].copy_(torch.cat([sd[mp + "gate_proj.weight"], sd[mp + "up_proj.weight"]], dim=0).float().t())
            m.w_down[l].copy_(sd[mp + "down_proj.weight"].float().t())
            m.norms[l, 0].copy_(sd[p + "input_layernorm.weight"].float())
            m.norms[l, 1].copy_(sd[p + "post_attention_layernorm.weight"].float())
        m.final_norm.copy_(sd["norm.weight"].float())
    return m.float().eval()
