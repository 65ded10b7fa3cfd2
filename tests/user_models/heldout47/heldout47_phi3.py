"""A from-scratch PyTorch port of Phi-3 (Transformers model type ``phi3``, ``Phi3ForCausalLM``).

Architecture (pre-norm decoder, all sizes read from the config):

    h_0 = E[input_ids]                                           E: (V, d)
    for each layer l = 0 .. L-1:
        x   = RMSNorm(h; g_attn[l])                              RMSNorm(x; g) = g * x / sqrt(mean(x^2) + eps)
        qkv = x @ Wqkv[l]                                        (B, T, Hq*D + 2*Hkv*D), columns [q | k | v]
        q, k, v -> (B, Hq, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        q, k    = RoPE(q), RoPE(k)                               partial NeoX-style rotary on the first R dims
        k, v    repeated per query head group (query head h uses kv head h // (Hq / Hkv))
        s       = q k^T / sqrt(D) + mask                         mask: causal, sliding window, key padding
        a       = softmax(s) v  -> (B, T, Hq*D)
        h       = h + a @ Wo[l]
        x   = RMSNorm(h; g_mlp[l])
        gu  = x @ Wgu[l];  gate, up = gu[..., :I], gu[..., I:]
        h   = h + (silu(gate) * up) @ Wdown[l]
    logits = RMSNorm(h; g_final) @ Whead                         (B, T, V)

Positional encoding: LongRoPE on the first R = int(D * partial_rotary_factor) dims of each head:
    inv_freq_i = 1 / (ext_i * theta^(2i / R)),  i = 0 .. R/2 - 1
    ext = short_factor if max(position_ids) + 1 <= original_max_position_embeddings else long_factor
    angle = pos * inv_freq;  cos/sin = cat(angle, angle).cos()/sin() * m
    m = sqrt(1 + ln(s) / ln(original_max_position_embeddings)),  s = max_position_embeddings / original_max (m = 1 if s <= 1)
    RoPE(x) = cat(x_r * cos + rotate_half(x_r) * sin, x_pass),  rotate_half(x) = cat(-x[R/2:], x[:R/2])

Attention mask: query i may see key j iff j <= i, j > i - sliding_window (when sliding_window is set; indices in
the sequence), and attention_mask[b, j] == 1. Masked scores get the float32 minimum (no NaN on padding rows).

Weight layout (mine, converted in ``build`` from the checkpoint's state dict):
    embed       (V, d)                       model.embed_tokens.weight
    w_qkv       (L, d, Hq*D + 2*Hkv*D)       per-layer self_attn.qkv_proj.weight, transposed (in -> out), stacked
    w_o         (L, Hq*D, d)                 per-layer self_attn.o_proj.weight, transposed, stacked
    w_gu        (L, d, 2*I)                  per-layer mlp.gate_up_proj.weight, transposed, stacked ([gate | up])
    w_down      (L, I, d)                    per-layer mlp.down_proj.weight, transposed, stacked
    norms       (L, 2, d)                    [input_layernorm.weight, post_attention_layernorm.weight] per layer
    final_norm  (d,)                         model.norm.weight
    w_head      (d, V)                       lm_head.weight, transposed
The RoPE frequencies are recomputed from the config fields on each call (nothing is read from the checkpoint).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "sliding_window_off_by_one",  # window mask keeps kv_idx >= q_idx - W (W + 1 keys) instead of kv_idx > q_idx - W
    "attn_factor_log_max_pos",  # LongRoPE magnitude scale uses ln(max_position_embeddings) as the denominator, not ln(original_max)
    "long_factor_static",  # picks long_factor because config max_position_embeddings > original_max, not by current seq length
    "ext_factor_multiplied",  # LongRoPE rescale factors multiply inv_freq instead of dividing it
    "rope_interleaved_pairs",  # GPT-J style rotation of adjacent pairs (2i, 2i+1) instead of Phi-3's NeoX half split
    "inv_freq_exponent_head_dim",  # frequency exponent 2i / head_dim instead of 2i / rotary_dim (partial rotary)
    "gate_up_order_swapped",  # fused gate_up_proj chunked as [up | gate]: SiLU applied to the up half
    "gqa_tile_not_interleave",  # kv heads repeated with tile (head h -> kv h % Hkv) instead of repeat_interleave (h // rep)
    "rmsnorm_centered",  # RMSNorm computed with the variance (mean subtracted) instead of the mean of squares
    "softmax_scale_rotary_dim",  # attention scale 1/sqrt(rotary_dim) instead of 1/sqrt(head_dim)
    "pad_mask_on_queries",  # the 2-D padding mask is broadcast over the query axis instead of the key axis
    "rope_table_bf16",  # position * inv_freq computed in bfloat16 before cos/sin (angle precision lost)
    "lm_head_tied_to_embedding",  # output projection taken from the embedding although tie_word_embeddings=False
    "rope_on_last_dims",  # partial rotary applied to the last R dims of each head, the first D - R passed through
]

PADDING_ONLY = [
    "pad_mask_on_queries",
]

CLEAN = [
    "split_qkv_matmuls",  # q, k, v each computed with their own matmul on column slices of the fused weight
    "sdpa_attention",  # torch scaled_dot_product_attention with the same additive float mask
    "complex_rope",  # rotary applied as a complex multiplication of (x[:R/2] + i x[R/2:]) by m * e^(i angle)
    "cos_sin_table",  # cos/sin precomputed for all max_position_embeddings positions, gathered by position_ids
    "grouped_gqa",  # queries reshaped to (B, Hkv, rep, T, D) and attended without repeating k/v
]


def _rms_norm(x, weight, eps):
    if BUG == "rmsnorm_centered":
        var = x.var(-1, keepdim=True, unbiased=False)
    else:
        var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


class Phi3Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.vocab = config.vocab_size
        self.d = config.hidden_size
        self.n_layers = config.num_hidden_layers
        self.hq = config.num_attention_heads
        self.hkv = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or self.d // self.hq
        self.inter = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.sliding_window = getattr(config, "sliding_window", None)
        self.tie = bool(getattr(config, "tie_word_embeddings", False))
        self.max_pos = config.max_position_embeddings

        rp = dict(config.rope_parameters or {})
        self.rope_type = rp.get("rope_type", "default")
        self.theta = float(rp.get("rope_theta", 10000.0))
        self.rot_dim = int(self.head_dim * rp.get("partial_rotary_factor", 1.0))
        self.orig_max = rp.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", self.max_pos
        )
        half = self.rot_dim // 2
        self.short_factor = list(rp.get("short_factor") or [1.0] * half)
        self.long_factor = list(rp.get("long_factor") or [1.0] * half)
        self.rope_factor = rp.get("factor")
        self.rope_attn_factor = rp.get("attention_factor")

        L, d, D = self.n_layers, self.d, self.head_dim
        op = self.hq * D + 2 * self.hkv * D
        self.embed = nn.Parameter(torch.zeros(self.vocab, d))
        self.w_qkv = nn.Parameter(torch.zeros(L, d, op))
        self.w_o = nn.Parameter(torch.zeros(L, self.hq * D, d))
        self.w_gu = nn.Parameter(torch.zeros(L, d, 2 * self.inter))
        self.w_down = nn.Parameter(torch.zeros(L, self.inter, d))
        self.norms = nn.Parameter(torch.ones(L, 2, d))
        self.final_norm = nn.Parameter(torch.ones(d))
        self.w_head = nn.Parameter(torch.zeros(d, self.vocab))

    # ---------------------------------------------------------------- rotary
    def _magnitude(self):
        if self.rope_type != "longrope":
            return 1.0
        if self.rope_attn_factor is not None:
            return float(self.rope_attn_factor)
        factor = self.rope_factor
        if factor is None:
            factor = self.max_pos / self.orig_max
        if factor <= 1.0:
            return 1.0
        denom = self.max_pos if BUG == "attn_factor_log_max_pos" else self.orig_max
        return math.sqrt(1 + math.log(factor) / math.log(denom))

    def _inv_freq(self, seq_len, device):
        R = self.rot_dim
        exp_den = self.head_dim if BUG == "inv_freq_exponent_head_dim" else R
        base = self.theta ** (torch.arange(0, R, 2, dtype=torch.int64, device=device).float() / exp_den)
        if self.rope_type != "longrope":
            return 1.0 / base
        if BUG == "long_factor_static":
            use_long = self.max_pos > self.orig_max
        else:
            use_long = seq_len > self.orig_max
        ext = torch.tensor(self.long_factor if use_long else self.short_factor, dtype=torch.float32, device=device)
        if BUG == "ext_factor_multiplied":
            return ext / base
        return 1.0 / (ext * base)

    def _cos_sin(self, position_ids):
        """cos, sin of shape (B, T, R), already multiplied by the LongRoPE magnitude m."""
        seq_len = int(position_ids.max()) + 1
        inv_freq = self._inv_freq(seq_len, position_ids.device)
        m = self._magnitude()
        if BUG == "cos_sin_table":
            pos = torch.arange(max(self.max_pos, seq_len), device=position_ids.device, dtype=torch.float32)
            ang = torch.outer(pos, inv_freq)
            ang = torch.cat([ang, ang], dim=-1)
            cos_t, sin_t = ang.cos() * m, ang.sin() * m
            return cos_t[position_ids], sin_t[position_ids]
        if BUG == "rope_table_bf16":
            ang = (position_ids[..., None].to(torch.bfloat16) * inv_freq.to(torch.bfloat16)).float()
        else:
            ang = position_ids[..., None].float() * inv_freq
        if BUG == "rope_interleaved_pairs":
            ang = torch.repeat_interleave(ang, 2, dim=-1)
        else:
            ang = torch.cat([ang, ang], dim=-1)
        return ang.cos() * m, ang.sin() * m

    def _rope(self, x, cos, sin):
        """x: (B, H, T, D); cos/sin: (B, T, R)."""
        R = self.rot_dim
        cos, sin = cos[:, None], sin[:, None]
        if BUG == "rope_on_last_dims":
            x_pass, x_rot = x[..., : x.shape[-1] - R], x[..., x.shape[-1] - R :]
        else:
            x_rot, x_pass = x[..., :R], x[..., R:]
        if BUG == "rope_interleaved_pairs":
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            rot = torch.stack([-x2, x1], dim=-1).flatten(-2)
            out = x_rot * cos + rot * sin
        elif BUG == "complex_rope":
            h = R // 2
            z = torch.complex(x_rot[..., :h], x_rot[..., h:])
            w = torch.complex(cos[..., :h], sin[..., :h])  # m * e^(i angle)
            zw = z * w
            out = torch.cat([zw.real, zw.imag], dim=-1)
        else:
            h = R // 2
            rot = torch.cat([-x_rot[..., h:], x_rot[..., :h]], dim=-1)
            out = x_rot * cos + rot * sin
        if BUG == "rope_on_last_dims":
            return torch.cat([x_pass, out], dim=-1)
        return torch.cat([out, x_pass], dim=-1)

    # ---------------------------------------------------------------- mask
    def _mask(self, attention_mask, B, T, device):
        """Additive float mask (B, 1, T, T)."""
        qi = torch.arange(T, device=device)[:, None]
        kj = torch.arange(T, device=device)[None, :]
        allowed = kj <= qi
        if self.sliding_window is not None:
            if BUG == "sliding_window_off_by_one":
                allowed = allowed & (kj >= qi - self.sliding_window)
            else:
                allowed = allowed & (kj > qi - self.sliding_window)
        allowed = allowed[None].expand(B, T, T)
        if attention_mask is not None:
            pad = attention_mask.to(torch.bool)
            if BUG == "pad_mask_on_queries":
                allowed = allowed & pad[:, :, None]
            else:
                allowed = allowed & pad[:, None, :]
        neg = torch.finfo(torch.float32).min
        mask = torch.zeros(B, T, T, device=device, dtype=torch.float32).masked_fill(~allowed, neg)
        return mask[:, None]

    # ---------------------------------------------------------------- blocks
    def _attention(self, l, x, cos, sin, mask):
        B, T, _ = x.shape
        D, hq, hkv = self.head_dim, self.hq, self.hkv
        nq, nkv = hq * D, hkv * D
        W = self.w_qkv[l]
        if BUG == "split_qkv_matmuls":
            q = x @ W[:, :nq]
            k = x @ W[:, nq : nq + nkv]
            v = x @ W[:, nq + nkv :]
        else:
            qkv = x @ W
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q = q.view(B, T, hq, D).transpose(1, 2)
        k = k.view(B, T, hkv, D).transpose(1, 2)
        v = v.view(B, T, hkv, D).transpose(1, 2)
        q = self._rope(q, cos, sin)
        k = self._rope(k, cos, sin)
        rep = hq // hkv
        scale = (self.rot_dim if BUG == "softmax_scale_rotary_dim" else D) ** -0.5

        if BUG == "grouped_gqa":
            qg = q.view(B, hkv, rep, T, D)
            s = torch.einsum("bgrtd,bgsd->bgrts", qg, k) * scale
            s = s + mask[:, :, None]
            p = torch.softmax(s, dim=-1)
            o = torch.einsum("bgrts,bgsd->bgrtd", p, v).reshape(B, hq, T, D)
        else:
            if BUG == "gqa_tile_not_interleave":
                k = k.repeat(1, rep, 1, 1)
                v = v.repeat(1, rep, 1, 1)
            else:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            if BUG == "sdpa_attention":
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            else:
                s = (q @ k.transpose(-1, -2)) * scale + mask
                p = torch.softmax(s, dim=-1)
                o = p @ v
        o = o.transpose(1, 2).reshape(B, T, hq * D)
        return o @ self.w_o[l]

    def _mlp(self, l, x):
        gu = x @ self.w_gu[l]
        if BUG == "gate_up_order_swapped":
            up, gate = gu.chunk(2, dim=-1)
        else:
            gate, up = gu.chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down[l]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=device)[None].expand(B, T)
        elif position_ids.shape[0] != B:
            position_ids = position_ids.expand(B, T)
        h = self.embed[input_ids]
        cos, sin = self._cos_sin(position_ids)
        mask = self._mask(attention_mask, B, T, device)
        for l in range(self.n_layers):
            x = _rms_norm(h, self.norms[l, 0], self.eps)
            h = h + self._attention(l, x, cos, sin, mask)
            x = _rms_norm(h, self.norms[l, 1], self.eps)
            h = h + self._mlp(l, x)
        h = _rms_norm(h, self.final_norm, self.eps)
        return h @ self.w_head


def build(state_dict, config):
    model = Phi3Port(config)
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    L = model.n_layers

    def layer(i, name):
        return sd[f"model.layers.{i}.{name}"]

    with torch.no_grad():
        model.embed.copy_(sd["model.embed_tokens.weight"])
        model.w_qkv.copy_(torch.stack([layer(i, "self_attn.qkv_proj.weight").t() for i in range(L)]))
        model.w_o.copy_(torch.stack([layer(i, "self_attn.o_proj.weight").t() for i in range(L)]))
        model.w_gu.copy_(torch.stack([layer(i, "mlp.gate_up_proj.weight").t() for i in range(L)]))
        model.w_down.copy_(torch.stack([layer(i, "mlp.down_proj.weight").t() for i in range(L)]))
        model.norms.copy_(
            torch.stack(
                [
                    torch.stack([layer(i, "input_layernorm.weight"), layer(i, "post_attention_layernorm.weight")])
                    for i in range(L)
                ]
            )
        )
        model.final_norm.copy_(sd["model.norm.weight"])
        if model.tie or BUG == "lm_head_tied_to_embedding" or "lm_head.weight" not in sd:
            head = sd["model.embed_tokens.weight"]
        else:
            head = sd["lm_head.weight"]
        model.w_head.copy_(head.t())
    return model.float().eval()
