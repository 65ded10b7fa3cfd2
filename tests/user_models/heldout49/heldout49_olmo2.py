"""A hand-written PyTorch port of OLMo 2 (Transformers ``olmo2`` / ``Olmo2ForCausalLM``).

Architecture (as implemented here)
----------------------------------
Sizes read from the config: V = vocab_size, H = hidden_size, L = num_hidden_layers,
nh = num_attention_heads, nkv = num_key_value_heads, hd = head_dim (or H // nh), I = intermediate_size,
eps = rms_norm_eps, theta = rope_parameters["rope_theta"].

    x_0 = E[input_ids]                                            (B, S, H)
    for each layer l:
        # attention, with OLMo 2's "reordered" norm: no input norm, the norm is applied to the
        # sub-layer's OUTPUT, inside the residual branch
        q = x W_q        (B, S, nh*hd)      k = x W_k   (B, S, nkv*hd)      v = x W_v   (B, S, nkv*hd)
        q = RMSNorm_q(q)  k = RMSNorm_k(k)     # QK-norm over the WHOLE projection (nh*hd / nkv*hd wide),
                                               # before splitting into heads and before RoPE
        q, k -> (B, heads, S, hd); RoPE (NeoX "rotate half" pairing: dim i with dim i + hd/2),
              inv_freq_i = theta^(-2i/hd), angle = position * inv_freq_i
        GQA: query head h reads kv head h // (nh/nkv)
        a = softmax(q k^T / sqrt(hd) + mask) v   mask: causal, plus padding keys (attention_mask == 0)
        x = x + RMSNorm_postattn(a W_o)
        # MLP (SwiGLU)
        m = (silu(x W_gate) * (x W_up)) W_down
        x = x + RMSNorm_postffn(m)
    logits = RMSNorm_final(x) W_head          (untied: tie_word_embeddings is False)   (B, S, V)

    RMSNorm(x) = w * x * rsqrt(mean(x^2, -1) + eps)      (weight multiplies directly, no 1 + w offset)

Weight layout (this port's own; converted from the checkpoint in ``build``)
--------------------------------------------------------------------------
All matrices are stored transposed ("in -> out", used as ``x @ W``) and stacked over layers:

    embed       (V, H)                     model.embed_tokens.weight
    wqkv        (L, H, (nh + 2 nkv) hd)    [q_proj | k_proj | v_proj].T fused along the output axis
    wo          (L, nh hd, H)              o_proj.T
    qk_norm     (L, nh hd + nkv hd)        [q_norm.weight | k_norm.weight]
    w13         (L, H, 2 I)                [gate_proj | up_proj].T fused along the output axis
    w2          (L, I, H)                  down_proj.T
    post_norm   (L, 2, H)                  [post_attention_layernorm, post_feedforward_layernorm]
    final_norm  (H,)                       model.norm.weight
    head        (H, V)                     lm_head.weight.T

``BUG`` (read at call time) selects a variant: "" is the correct port, names in ``CLEAN`` are equivalent
reformulations, names in ``BUGS`` are realistic porting mistakes.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qk_norm_per_head",  # QK-norm applied per head over hd (OLMo 3 / Qwen 3 style) instead of over the whole nh*hd projection
    "qk_norm_after_rope",  # QK-norm applied after RoPE instead of before (its per-channel weight does not commute with the rotation)
    "norm_after_residual",  # post-norm applied to (residual + sublayer) like the original post-LN transformer, not inside the branch
    "rope_interleaved",  # RoPE rotates adjacent pairs (2i, 2i+1) GPT-J style instead of NeoX rotate-half pairs (i, i + hd/2)
    "rope_theta_default",  # theta read as getattr(config, "rope_theta", 10000); transformers 5 keeps it in rope_parameters (500000)
    "double_scale",  # q pre-scaled by hd**-0.5 and the attention kernel scales by hd**-0.5 again
    "gqa_tile",  # kv heads expanded with repeat (tile: h -> h % nkv) instead of repeat_interleave (h -> h // groups)
    "gate_up_swapped",  # loader fuses [up | gate] but forward reads the first half as gate (silu on the up projection)
    "mask_added_raw",  # the 0/1 attention_mask is added to the scores as-is instead of as a -inf bias on padding keys
    "lm_head_tied",  # output projection assumed tied to the embedding (OLMo 1 style), ignoring tie_word_embeddings=False
    "norm_weight_plus_one",  # RMSNorm computes (1 + w) * x_hat (Gemma convention) though OLMo 2 stores the full weight
    "causal_diag_offset",  # causal mask built with triu(diagonal=2): each token also sees the next one (off by one)
    "o_proj_not_transposed",  # o_proj weight (square H x H here) stored without the transpose this layout needs
    "post_norms_swapped",  # loader maps post_attention_layernorm -> ffn post-norm and post_feedforward_layernorm -> attn post-norm
]

PADDING_ONLY = ["mask_added_raw"]

CLEAN = [
    "split_qkv",  # q, k, v from three separate matmuls on column slices of the fused weight
    "sdpa",  # attention via F.scaled_dot_product_attention with the same additive float mask
    "rope_complex",  # RoPE as a complex multiply of (x_i + i x_{i+hd/2}) by exp(i * angle)
    "gqa_grouped",  # GQA by grouping query heads per kv head (einsum), no kv repetition
    "rope_table",  # cos/sin precomputed for all max_position_embeddings positions, gathered by position_ids
]


def _bug():
    return BUG


def _rms_norm(x, w, eps):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if _bug() == "norm_weight_plus_one":
        return (1.0 + w) * y
    return w * y


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Olmo2Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.V = config.vocab_size
        self.H = config.hidden_size
        self.L = config.num_hidden_layers
        self.nh = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.hd = getattr(config, "head_dim", None) or self.H // self.nh
        self.I = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.max_pos = config.max_position_embeddings
        qd, kd = self.nh * self.hd, self.nkv * self.hd
        self.qd, self.kd = qd, kd
        self.embed = nn.Parameter(torch.zeros(self.V, self.H))
        self.wqkv = nn.Parameter(torch.zeros(self.L, self.H, qd + 2 * kd))
        self.wo = nn.Parameter(torch.zeros(self.L, qd, self.H))
        self.qk_norm = nn.Parameter(torch.zeros(self.L, qd + kd))
        self.w13 = nn.Parameter(torch.zeros(self.L, self.H, 2 * self.I))
        self.w2 = nn.Parameter(torch.zeros(self.L, self.I, self.H))
        self.post_norm = nn.Parameter(torch.zeros(self.L, 2, self.H))
        self.final_norm = nn.Parameter(torch.zeros(self.H))
        self.head = nn.Parameter(torch.zeros(self.H, self.V))

    # ---------------------------------------------------------------- RoPE
    def _theta(self):
        if _bug() == "rope_theta_default":
            return float(getattr(self.config, "rope_theta", 10000.0))
        rp = getattr(self.config, "rope_parameters", None) or {}
        return float(rp.get("rope_theta", 10000.0))

    def _inv_freq(self, device):
        hd = self.hd
        return 1.0 / (self._theta() ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))

    def _cos_sin(self, position_ids, device):
        inv_freq = self._inv_freq(device)
        if _bug() == "rope_table":
            t = torch.arange(self.max_pos, dtype=torch.float32, device=device)
            table = t[:, None] * inv_freq[None, :]  # (max_pos, hd/2)
            ang = table[position_ids]  # (B, S, hd/2)
        else:
            ang = position_ids[..., None].float() * inv_freq  # (B, S, hd/2)
        return ang

    def _rope(self, x, ang):
        """x: (B, heads, S, hd), ang: (B, S, hd/2)."""
        b = _bug()
        ang = ang[:, None]  # (B, 1, S, hd/2)
        if b == "rope_interleaved":
            cos, sin = ang.cos(), ang.sin()
            x1, x2 = x[..., 0::2], x[..., 1::2]
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            return torch.stack((o1, o2), dim=-1).flatten(-2)
        if b == "rope_complex":
            half = x.shape[-1] // 2
            z = torch.complex(x[..., :half].contiguous(), x[..., half:].contiguous())
            r = z * torch.polar(torch.ones_like(ang), ang)
            return torch.cat((r.real, r.imag), dim=-1)
        emb = torch.cat((ang, ang), dim=-1)
        return x * emb.cos() + _rotate_half(x) * emb.sin()

    # ---------------------------------------------------------------- mask
    def _mask(self, attention_mask, B, S, device):
        """Additive float mask (B, 1, S, S)."""
        b = _bug()
        neg = torch.finfo(torch.float32).min
        i = torch.arange(S, device=device)
        if b == "causal_diag_offset":
            allowed = i[None, :] <= i[:, None] + 1
        else:
            allowed = i[None, :] <= i[:, None]
        bias = torch.zeros(S, S, device=device).masked_fill(~allowed, neg)
        bias = bias[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            am = attention_mask.to(device)
            if b == "mask_added_raw":
                bias = bias + am[:, None, None, :].float()
            else:
                pad = am[:, None, None, :] == 0
                bias = bias.masked_fill(pad, neg)
        return bias

    # ---------------------------------------------------------------- attention
    def _attention(self, x, l, ang, bias):
        b = _bug()
        B, S, _ = x.shape
        qd, kd, hd, nh, nkv = self.qd, self.kd, self.hd, self.nh, self.nkv
        w = self.wqkv[l]
        if b == "split_qkv":
            q = x @ w[:, :qd]
            k = x @ w[:, qd : qd + kd]
            v = x @ w[:, qd + kd :]
        else:
            q, k, v = (x @ w).split([qd, kd, kd], dim=-1)
        qw, kw = self.qk_norm[l, :qd], self.qk_norm[l, qd:]

        def heads(t, n):
            return t.view(B, S, n, hd).transpose(1, 2)

        if b == "qk_norm_after_rope":
            q = self._rope(heads(q, nh), ang).transpose(1, 2).reshape(B, S, qd)
            k = self._rope(heads(k, nkv), ang).transpose(1, 2).reshape(B, S, kd)
            q = heads(_rms_norm(q, qw, self.eps), nh)
            k = heads(_rms_norm(k, kw, self.eps), nkv)
        else:
            if b == "qk_norm_per_head":
                q = _rms_norm(q.view(B, S, nh, hd), qw.view(nh, hd), self.eps).reshape(B, S, qd)
                k = _rms_norm(k.view(B, S, nkv, hd), kw.view(nkv, hd), self.eps).reshape(B, S, kd)
            else:
                q = _rms_norm(q, qw, self.eps)
                k = _rms_norm(k, kw, self.eps)
            q = self._rope(heads(q, nh), ang)
            k = self._rope(heads(k, nkv), ang)
        v = heads(v, nkv)

        groups = nh // nkv
        scale = hd**-0.5
        if b == "gqa_grouped":
            qg = q.view(B, nkv, groups, S, hd)
            s = torch.einsum("bkgqd,bktd->bkgqt", qg, k) * scale
            s = s + bias[:, :, None]
            p = torch.softmax(s, dim=-1)
            o = torch.einsum("bkgqt,bktd->bkgqd", p, v).reshape(B, nh, S, hd)
        else:
            if b == "gqa_tile":
                k = k.repeat(1, groups, 1, 1)
                v = v.repeat(1, groups, 1, 1)
            else:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            if b == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            elif b == "double_scale":
                o = F.scaled_dot_product_attention(q * scale, k, v, attn_mask=bias)
            else:
                s = (q @ k.transpose(-1, -2)) * scale + bias
                p = torch.softmax(s, dim=-1)
                o = p @ v
        o = o.transpose(1, 2).reshape(B, S, qd)
        return o @ self.wo[l]

    def _mlp(self, x, l):
        gate, up = (x @ self.w13[l]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w2[l]

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=device)[None].expand(B, S)
        ang = self._cos_sin(position_ids, device)
        bias = self._mask(attention_mask, B, S, device)
        x = self.embed[input_ids]
        for l in range(self.L):
            pa, pf = self.post_norm[l, 0], self.post_norm[l, 1]
            h = self._attention(x, l, ang, bias)
            if b == "norm_after_residual":
                x = _rms_norm(x + h, pa, self.eps)
            else:
                x = x + _rms_norm(h, pa, self.eps)
            h = self._mlp(x, l)
            if b == "norm_after_residual":
                x = _rms_norm(x + h, pf, self.eps)
            else:
                x = x + _rms_norm(h, pf, self.eps)
        x = _rms_norm(x, self.final_norm, self.eps)
        head = self.embed.t() if b == "lm_head_tied" else self.head
        return x @ head


def build(state_dict, config):
    b = _bug()
    model = Olmo2Port(config)
    sd = {k: v.float() for k, v in state_dict.items()}
    L = model.L

    def lay(l, name):
        return sd[f"model.layers.{l}.{name}"]

    with torch.no_grad():
        model.embed.copy_(sd["model.embed_tokens.weight"])
        model.final_norm.copy_(sd["model.norm.weight"])
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        model.head.copy_(head.t())
        for l in range(L):
            q, k, v = (lay(l, f"self_attn.{n}_proj.weight") for n in "qkv")
            model.wqkv[l].copy_(torch.cat([q, k, v], dim=0).t())
            o = lay(l, "self_attn.o_proj.weight")
            model.wo[l].copy_(o if b == "o_proj_not_transposed" else o.t())
            model.qk_norm[l].copy_(torch.cat([lay(l, "self_attn.q_norm.weight"), lay(l, "self_attn.k_norm.weight")]))
            gate, up = lay(l, "mlp.gate_proj.weight"), lay(l, "mlp.up_proj.weight")
            fused = [up, gate] if b == "gate_up_swapped" else [gate, up]
            model.w13[l].copy_(torch.cat(fused, dim=0).t())
            model.w2[l].copy_(lay(l, "mlp.down_proj.weight").t())
            pa = lay(l, "post_attention_layernorm.weight")
            pf = lay(l, "post_feedforward_layernorm.weight")
            if b == "post_norms_swapped":
                pa, pf = pf, pa
            model.post_norm[l, 0].copy_(pa)
            model.post_norm[l, 1].copy_(pf)
    return model.float().eval()
