"""A hand-written PyTorch port of StableLM (``StableLmForCausalLM``), plain torch only.

Architecture (as implemented here)
----------------------------------
Sizes: D = hidden_size, H = num_attention_heads, Hkv = num_key_value_heads, hd = D // H,
I = intermediate_size, V = vocab_size, R = int(hd * partial_rotary_factor) (the rotary width, even).

    x_0 = E[input_ids]                                              (B, S, D)
    for every layer l:
        h      = LayerNorm(x; ln_w, ln_b, eps)                      (affine LayerNorm with bias)
        q|k|v  = h @ Wqkv + bqkv                                    (fused in -> out projection, [q | k | v])
        q, k   -> (B, H, S, hd), (B, Hkv, S, hd); v likewise
        q, k   = per-head LayerNorm over hd (no bias), weight qn_w[h] / kn_w[h]   (when qk_layernorm)
        RoPE (GPT-NeoX "rotate half") on the FIRST R dims of each head only, the rest passes through:
            inv_freq_j = theta ** (-2j / R), j = 0 .. R/2 - 1;  ang = pos * inv_freq;  cos/sin = cat(ang, ang)
            x_rot' = x_rot * cos + rotate_half(x_rot) * sin,  rotate_half([a, b]) = [-b, a]
        attn   = softmax(q k^T * hd^-0.5 + M) v                     (M: causal + key padding, additive dtype-min)
        a      = concat_heads(attn) @ Wo                             (no bias)
        mlp(z) = (silu(z @ Wg) * (z @ Wu)) @ Wd
        use_parallel_residual:   x = x + a + mlp(h)                  (both branches read the same LayerNorm)
        else:                    x = x + a;  x = x + mlp(LayerNorm2(x))
    logits = LayerNorm(x; norm_w, norm_b) @ Whead                   (untied unless tie_word_embeddings)

Weight layout (mine, converted from the checkpoint in ``build``)
----------------------------------------------------------------
``model.embed``      (V, D)                token embeddings
``model.blocks[l]``  a ``Block`` holding, all matrices stored transposed (in -> out):
    ``ln``    (2, D)               input LayerNorm [weight; bias] stacked
    ``ln2``   (2, D)               post-attention LayerNorm (only when not use_parallel_residual)
    ``wqkv``  (D, (H + 2 Hkv) hd)  fused [q | k | v] projection;  ``bqkv`` ((H + 2 Hkv) hd) fused bias (zeros if none)
    ``qk_norm`` (H + Hkv, hd)      per-head q-norm weights (rows 0..H-1) then k-norm weights
    ``wo``    (D, D)               output projection
    ``wgu``   (D, 2 I)             fused [gate | up]
    ``wd``    (I, D)               down projection
``model.final_ln``   (2, D)        final LayerNorm [weight; bias]
``model.head``       (D, V)        LM head, transposed
``model.rope_inv_freq`` (R/2,), ``model.cos_table`` / ``model.sin_table`` (max_pos, R) non-persistent buffers
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_interleaved",  # RoPE rotates adjacent pairs (GPT-J style) instead of NeoX rotate_half on the rotary slice
    "rope_freq_head_dim",  # inv_freq exponent divided by the full head_dim instead of the rotary width R
    "rope_tail_slice",  # partial rotary applied to the LAST R dims of each head instead of the first R
    "qk_norm_after_rope",  # per-head q/k LayerNorm applied after RoPE instead of before it
    "qk_norm_shared_weight",  # per-head q/k norm weights collapsed: head 0's weight used for every head
    "qk_norm_unbiased_var",  # q/k LayerNorm variance via torch.var (unbiased, N-1) instead of the biased mean
    "sequential_residual",  # use_parallel_residual ignored: MLP reads LayerNorm(x + attn) (GPT-NeoX sequential)
    "residual_after_norm",  # parallel residual adds the normalised h instead of the raw x as the skip path
    "act_gelu",  # MLP activation taken as GELU (GPT-NeoX / StableLM-alpha heritage) instead of config hidden_act silu
    "scale_rotary_dim",  # attention scaled by R**-0.5 (rotary width) instead of head_dim**-0.5
    "qkv_split_neox",  # fused qkv output split GPT-NeoX style, per head interleaved (H, 3, hd), not [q | k | v]
    "lm_head_tied",  # tie_word_embeddings=False ignored: logits computed with the embedding matrix
    "ln_bias_dropped",  # decoder input LayerNorm applied without its bias (RMS/LLaMA-template port)
    "pad_mask_query_axis",  # padding mask broadcast over query rows instead of key columns
]

PADDING_ONLY = [
    "pad_mask_query_axis",
]

CLEAN = [
    "split_qkv",  # separate q, k, v matmuls on column slices of the fused weight instead of one fused matmul
    "rope_complex",  # RoPE as complex multiplication (x_i + i x_{i+R/2}) * e^{i ang} instead of rotate_half
    "rope_table",  # cos/sin read from a table precomputed in build, indexed by position_ids
    "qk_norm_loop",  # per-head q/k norm as a loop of F.layer_norm per head instead of the batched formula
    "fused_out_proj",  # parallel residual: [attn | act] @ [Wo; Wd] as one matmul instead of two summed matmuls
]


def _layer_norm(x, wb, eps, bias=True):
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1] if bias else None, eps)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, ang, rot, cos=None, sin=None):
    """x: (B, h, S, hd); ang: (B, S, R/2) angles. Rotates R dims of every head."""
    if BUG == "rope_tail_slice":
        x_pass, x_rot = x[..., : x.shape[-1] - rot], x[..., x.shape[-1] - rot :]
    else:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
    a = ang[:, None]  # (B, 1, S, R/2)
    if BUG == "rope_interleaved":
        pairs = x_rot.reshape(*x_rot.shape[:-1], rot // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        c, s = a.cos(), a.sin()
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    elif BUG == "rope_complex":
        half = rot // 2
        z = torch.complex(x_rot[..., :half].contiguous(), x_rot[..., half:].contiguous())
        z = z * torch.polar(torch.ones_like(a), a)
        out = torch.cat((z.real, z.imag), dim=-1)
    else:
        if cos is None:
            emb = torch.cat((a, a), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        out = x_rot * cos + _rotate_half(x_rot) * sin
    if BUG == "rope_tail_slice":
        return torch.cat((x_pass, out), dim=-1)
    return torch.cat((out, x_pass), dim=-1)


def _head_norm(x, w, eps):
    """Per-head LayerNorm over hd, no bias. x: (B, h, S, hd); w: (h, hd)."""
    if BUG == "qk_norm_shared_weight":
        w = w[:1].expand_as(w)
    if BUG == "qk_norm_loop":
        return torch.cat(
            [F.layer_norm(x[:, i : i + 1], (x.shape[-1],), w[i], None, eps) for i in range(x.shape[1])], dim=1
        )
    mu = x.mean(-1, keepdim=True)
    if BUG == "qk_norm_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + eps) * w[None, :, None, :]


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, H, Hkv, hd, I = cfg["D"], cfg["H"], cfg["Hkv"], cfg["hd"], cfg["I"]
        self.cfg = cfg
        self.ln = nn.Parameter(torch.empty(2, D))
        self.ln2 = nn.Parameter(torch.empty(2, D)) if not cfg["parallel"] else None
        self.wqkv = nn.Parameter(torch.empty(D, (H + 2 * Hkv) * hd))
        self.bqkv = nn.Parameter(torch.zeros((H + 2 * Hkv) * hd))
        self.qk_norm = nn.Parameter(torch.ones(H + Hkv, hd)) if cfg["qk_ln"] else None
        self.wo = nn.Parameter(torch.empty(H * hd, D))
        self.wgu = nn.Parameter(torch.empty(D, 2 * I))
        self.wd = nn.Parameter(torch.empty(I, D))

    def _mlp_act(self, z):
        I = self.cfg["I"]
        gu = z @ self.wgu
        g, u = gu[..., :I], gu[..., I:]
        if BUG == "act_gelu":
            g = F.gelu(g)
        else:
            g = self.cfg["act"](g)
        return g * u

    def forward(self, x, ang, mask, cos, sin):
        c = self.cfg
        B, S, D = x.shape
        H, Hkv, hd, rot, eps = c["H"], c["Hkv"], c["hd"], c["rot"], c["eps"]
        h = _layer_norm(x, self.ln, eps, bias=BUG != "ln_bias_dropped")

        nq, nk = H * hd, Hkv * hd
        if BUG == "split_qkv":
            q = h @ self.wqkv[:, :nq] + self.bqkv[:nq]
            k = h @ self.wqkv[:, nq : nq + nk] + self.bqkv[nq : nq + nk]
            v = h @ self.wqkv[:, nq + nk :] + self.bqkv[nq + nk :]
        elif BUG == "qkv_split_neox":
            qkv = (h @ self.wqkv + self.bqkv).view(B, S, H, 3, hd)
            q, k, v = qkv[..., 0, :].flatten(-2), qkv[..., 1, :].flatten(-2), qkv[..., 2, :].flatten(-2)
        else:
            qkv = h @ self.wqkv + self.bqkv
            q, k, v = qkv.split([nq, nk, nk], dim=-1)
        q = q.view(B, S, H, hd).transpose(1, 2)
        k = k.view(B, S, Hkv, hd).transpose(1, 2)
        v = v.view(B, S, Hkv, hd).transpose(1, 2)

        if self.qk_norm is not None and BUG != "qk_norm_after_rope":
            q = _head_norm(q, self.qk_norm[:H], eps)
            k = _head_norm(k, self.qk_norm[H:], eps)
        q = _rope(q, ang, rot, cos, sin)
        k = _rope(k, ang, rot, cos, sin)
        if self.qk_norm is not None and BUG == "qk_norm_after_rope":
            q = _head_norm(q, self.qk_norm[:H], eps)
            k = _head_norm(k, self.qk_norm[H:], eps)

        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        scale = (rot if BUG == "scale_rotary_dim" else hd) ** -0.5
        scores = (q @ k.transpose(-1, -2)) * scale + mask
        o = torch.softmax(scores, dim=-1) @ v  # (B, H, S, hd)
        o = o.transpose(1, 2).reshape(B, S, H * hd)

        if c["parallel"] and BUG == "fused_out_proj":
            act = self._mlp_act(h)
            return x + torch.cat((o, act), dim=-1) @ torch.cat((self.wo, self.wd), dim=0)
        a = o @ self.wo
        if c["parallel"] and BUG != "sequential_residual":
            skip = h if BUG == "residual_after_norm" else x
            return skip + a + self._mlp_act(h) @ self.wd
        x = x + a
        ln2 = self.ln2 if self.ln2 is not None else self.ln
        return x + self._mlp_act(_layer_norm(x, ln2, eps)) @ self.wd


class StableLmPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        hd = D // H
        rp = getattr(config, "rope_parameters", None) or {}
        prf = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.25))
        theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        act_name = getattr(config, "hidden_act", "silu")
        acts = {
            "silu": F.silu,
            "swish": F.silu,
            "gelu": F.gelu,
            "relu": F.relu,
            "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
        }
        self.cfg = dict(
            D=D,
            H=H,
            Hkv=config.num_key_value_heads,
            hd=hd,
            I=config.intermediate_size,
            rot=int(hd * prf),
            theta=float(theta),
            eps=config.layer_norm_eps,
            parallel=bool(getattr(config, "use_parallel_residual", False)),
            qk_ln=bool(getattr(config, "qk_layernorm", False)),
            act=acts[act_name],
        )
        self.V = config.vocab_size
        self.embed = nn.Parameter(torch.empty(config.vocab_size, D))
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(config.num_hidden_layers))
        self.final_ln = nn.Parameter(torch.empty(2, D))
        self.head = nn.Parameter(torch.empty(D, config.vocab_size))
        rot = self.cfg["rot"]
        inv = 1.0 / (self.cfg["theta"] ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        self.register_buffer("rope_inv_freq", inv, persistent=False)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        ang = pos[:, None] * inv[None]
        emb = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def _inv_freq(self):
        if BUG == "rope_freq_head_dim":
            rot, hd = self.cfg["rot"], self.cfg["hd"]
            return 1.0 / (self.cfg["theta"] ** (torch.arange(0, rot, 2, dtype=torch.float32) / hd))
        return self.rope_inv_freq

    def _mask(self, attention_mask, B, S, dtype, device):
        neg = torch.finfo(dtype).min
        causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
        allowed = causal[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if BUG == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return torch.zeros(B, 1, S, S, dtype=dtype, device=device).masked_fill(~allowed, neg)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        x = self.embed[input_ids]
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        ang = position_ids[..., None].float() * self._inv_freq()[None, None]  # (B, S, R/2)
        cos = sin = None
        if BUG == "rope_table":
            cos = self.cos_table[position_ids][:, None]
            sin = self.sin_table[position_ids][:, None]
        mask = self._mask(attention_mask, B, S, x.dtype, x.device)
        for blk in self.blocks:
            x = blk(x, ang, mask, cos, sin)
        x = _layer_norm(x, self.final_ln, self.cfg["eps"])
        head = self.embed.t() if BUG == "lm_head_tied" else self.head
        return x @ head


def build(state_dict, config) -> nn.Module:
    model = StableLmPort(config)
    sd = {k: v.float() for k, v in state_dict.items()}
    c = model.cfg
    H, Hkv = c["H"], c["Hkv"]
    p = "model."
    with torch.no_grad():
        model.embed.copy_(sd[p + "embed_tokens.weight"])
        model.final_ln.copy_(torch.stack([sd[p + "norm.weight"], sd[p + "norm.bias"]]))
        head = sd.get("lm_head.weight", sd[p + "embed_tokens.weight"])
        if getattr(config, "tie_word_embeddings", False):
            head = sd[p + "embed_tokens.weight"]
        model.head.copy_(head.t())
        for i, blk in enumerate(model.blocks):
            lp = f"{p}layers.{i}."
            blk.ln.copy_(torch.stack([sd[lp + "input_layernorm.weight"], sd[lp + "input_layernorm.bias"]]))
            if blk.ln2 is not None:
                blk.ln2.copy_(
                    torch.stack([sd[lp + "post_attention_layernorm.weight"], sd[lp + "post_attention_layernorm.bias"]])
                )
            a = lp + "self_attn."
            blk.wqkv.copy_(torch.cat([sd[a + n + "_proj.weight"] for n in "qkv"], dim=0).t())
            if a + "q_proj.bias" in sd:
                blk.bqkv.copy_(torch.cat([sd[a + n + "_proj.bias"] for n in "qkv"]))
            if blk.qk_norm is not None:
                qn = [sd[f"{a}q_layernorm.norms.{j}.weight"] for j in range(H)]
                kn = [sd[f"{a}k_layernorm.norms.{j}.weight"] for j in range(Hkv)]
                blk.qk_norm.copy_(torch.stack(qn + kn))
            blk.wo.copy_(sd[a + "o_proj.weight"].t())
            m = lp + "mlp."
            blk.wgu.copy_(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]], dim=0).t())
            blk.wd.copy_(sd[m + "down_proj.weight"].t())
    return model.float().eval()
