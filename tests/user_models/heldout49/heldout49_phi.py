"""A from-scratch PyTorch port of Phi (Phi-1 / Phi-1.5 / Phi-2 style causal LM).

Architecture (as implemented here)
----------------------------------
Notation: B batch, S sequence, D = hidden_size, H = num_attention_heads, Hkv = num_key_value_heads,
hd = head_dim = D // H, r = rotary_ndims = int(hd * partial_rotary_factor), I = intermediate_size, V = vocab.

    h_0 = E[input_ids]                                             (B, S, D)
    for each layer l (parallel attention + MLP block, ONE shared LayerNorm):
        x      = LayerNorm(h; w_l, b_l, eps=layer_norm_eps)        (biased LayerNorm, population variance)
        q,k,v  = x @ Wqkv_l + bqkv_l, split as [q | k | v] each head-major (H*hd | Hkv*hd | Hkv*hd)
        partial RoPE (NeoX / rotate-half style) on the first r dims of each q/k head only:
            inv_freq_i = theta ** (-2i / r), i = 0 .. r/2-1           (denominator is r, not hd)
            angle(p, i) = p * inv_freq_i  (float32)
            for x_rot = [x1 | x2] (r/2 each): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
            the remaining hd - r dims pass through unchanged
        attn   = softmax(q k^T / sqrt(hd) + causal/padding mask) v    (scale uses the full head dim)
        a      = merge_heads(attn) @ Wo_l + bo_l
        m      = gelu_new(x @ W1_l + b1_l) @ W2_l + b2_l              (gelu_new = tanh approximation)
        h      = h + a + m                                         (attention and MLP both read x)
    logits = LayerNorm_f(h) @ Whead + bhead                        (lm_head has a bias; not tied)

Masks: key j is visible to query i iff j <= i and attention_mask[b, j] == 1; masked scores get the
float32 minimum (fully masked padding rows then give finite garbage that is never compared).

Weight layout (differs from Transformers' module tree)
------------------------------------------------------
All per-layer weights are STACKED along a leading layer axis L, and all matrices are stored
TRANSPOSED (in -> out), so that y = x @ W + b:
    tok_emb   (V, D)
    ln_w, ln_b              (L, D)                 input_layernorm
    wqkv      (L, D, (H + 2 Hkv) * hd)            fused [q_proj | k_proj | v_proj]^T
    bqkv      (L, (H + 2 Hkv) * hd)
    wo        (L, H*hd, D), bo (L, D)             self_attn.dense^T
    w1        (L, D, I),   b1 (L, I)              mlp.fc1^T
    w2        (L, I, D),   b2 (L, D)              mlp.fc2^T
    qln_w/qln_b/kln_w/kln_b (L, hd)               only when config.qk_layernorm
    lnf_w, lnf_b            (D,)                   final_layernorm
    head_w    (D, V), head_b (V,)                 lm_head^T
    buffer inv_freq (r/2,), buffer cos_table/sin_table (max_position_embeddings, r/2)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_freq_head_dim",  # partial RoPE: inv_freq exponent divided by the full head_dim instead of the rotary dim r
    "rope_interleaved",  # RoPE rotates adjacent pairs (GPT-J / llama.cpp NORM) instead of Phi's rotate-half (NEOX)
    "rope_angle_bf16",  # the rotary angle position * inv_freq is computed in bfloat16 (cast placed too early)
    "scale_rotary_dim",  # attention scale 1/sqrt(rotary_ndims) instead of 1/sqrt(head_dim)
    "sequential_block",  # MLP reads LayerNorm(h + attn) (GPT-2-style sequential) instead of the parallel shared x
    "gelu_quick",  # hidden_act "gelu_new" mapped to quick_gelu x*sigmoid(1.702x) instead of the tanh approximation
    "ln_unbiased_var",  # LayerNorm variance with Bessel's correction (torch.var default unbiased=True)
    "lm_head_no_bias",  # lm_head bias dropped (ported from a bias-free Llama template)
    "tie_embeddings",  # output projection tied to the token embedding although tie_word_embeddings=False
    "qkv_unpack_per_head",  # fused QKV output split as per-head [H, 3, hd] (original Wqkv order confusion) not [3, H, hd]
    "merge_heads_no_transpose",  # attention output (B,H,S,hd) reshaped to (B,S,H*hd) without moving the head axis
    "causal_off_by_one",  # causal mask lets query i also see key i+1 (diagonal off by one)
    "dense_not_transposed",  # loader: square attention dense weight copied without the in->out transpose
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
]

PADDING_ONLY = [
    "pad_mask_query_axis",
]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with an additive float mask instead of explicit softmax
    "rope_complex",  # RoPE as complex multiplication of (x1 + i x2) by exp(i angle) from a precomputed table
    "layernorm_functional",  # F.layer_norm instead of the hand-written mean / variance LayerNorm
    "mlp_chunked",  # MLP evaluated in chunks of the intermediate dim, fc2 partial products summed
]


def _bug():
    return BUG


def _gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _layer_norm(x, w, b, eps):
    bug = _bug()
    if bug == "layernorm_functional":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    mu = x.mean(-1, keepdim=True)
    xc = x - mu
    if bug == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (xc * xc).mean(-1, keepdim=True)
    return xc * torch.rsqrt(var + eps) * w + b


class PhiPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.D = config.hidden_size
        self.H = config.num_attention_heads
        self.Hkv = getattr(config, "num_key_value_heads", None) or self.H
        self.hd = getattr(config, "head_dim", None) or self.D // self.H
        rp = getattr(config, "rope_parameters", None) or {}
        self.prf = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.5))
        self.theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        self.r = int(self.hd * self.prf)
        self.L = config.num_hidden_layers
        self.I = config.intermediate_size
        self.V = config.vocab_size
        self.eps = config.layer_norm_eps
        self.qk_ln = bool(getattr(config, "qk_layernorm", False))
        self.max_pos = config.max_position_embeddings
        L, D, I, V, hd = self.L, self.D, self.I, self.V, self.hd
        nqkv = (self.H + 2 * self.Hkv) * hd
        self.tok_emb = nn.Parameter(torch.zeros(V, D))
        self.ln_w = nn.Parameter(torch.ones(L, D))
        self.ln_b = nn.Parameter(torch.zeros(L, D))
        self.wqkv = nn.Parameter(torch.zeros(L, D, nqkv))
        self.bqkv = nn.Parameter(torch.zeros(L, nqkv))
        self.wo = nn.Parameter(torch.zeros(L, self.H * hd, D))
        self.bo = nn.Parameter(torch.zeros(L, D))
        self.w1 = nn.Parameter(torch.zeros(L, D, I))
        self.b1 = nn.Parameter(torch.zeros(L, I))
        self.w2 = nn.Parameter(torch.zeros(L, I, D))
        self.b2 = nn.Parameter(torch.zeros(L, D))
        if self.qk_ln:
            self.qln_w = nn.Parameter(torch.ones(L, hd))
            self.qln_b = nn.Parameter(torch.zeros(L, hd))
            self.kln_w = nn.Parameter(torch.ones(L, hd))
            self.kln_b = nn.Parameter(torch.zeros(L, hd))
        self.lnf_w = nn.Parameter(torch.ones(D))
        self.lnf_b = nn.Parameter(torch.zeros(D))
        self.head_w = nn.Parameter(torch.zeros(D, V))
        self.head_b = nn.Parameter(torch.zeros(V))
        inv = 1.0 / (self.theta ** (torch.arange(0, self.r, 2, dtype=torch.float32) / self.r))
        self.register_buffer("inv_freq", inv, persistent=False)
        pos = torch.arange(self.max_pos, dtype=torch.float32)
        ang = pos[:, None] * inv[None, :]
        self.register_buffer("cos_table", ang.cos(), persistent=False)
        self.register_buffer("sin_table", ang.sin(), persistent=False)

    # ---------------------------------------------------------------- rotary
    def _angles(self, position_ids):
        """(B, S, r/2) rotary angles."""
        bug = _bug()
        inv = self.inv_freq
        if bug == "rope_freq_head_dim":
            inv = 1.0 / (self.theta ** (torch.arange(0, self.r, 2, dtype=torch.float32) / self.hd))
        if bug == "rope_angle_bf16":
            return (position_ids[..., None].to(torch.bfloat16) * inv.to(torch.bfloat16)).float()
        return position_ids[..., None].float() * inv

    def _rope(self, x, position_ids):
        """x: (B, h, S, hd); rotates the first r dims of every head (NeoX rotate-half pairing)."""
        bug = _bug()
        r = self.r
        if r == 0:
            return x
        xr, xp = x[..., :r], x[..., r:]
        half = r // 2
        if bug == "rope_complex":
            cos = self.cos_table[position_ids][:, None]  # (B,1,S,r/2)
            sin = self.sin_table[position_ids][:, None]
            z = torch.complex(xr[..., :half].contiguous(), xr[..., half:].contiguous())
            rot = z * torch.complex(cos, sin)
            out = torch.cat((rot.real, rot.imag), dim=-1)
            return torch.cat((out, xp), dim=-1)
        ang = self._angles(position_ids)[:, None]  # (B,1,S,r/2)
        cos, sin = ang.cos(), ang.sin()
        if bug == "rope_interleaved":
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
            return torch.cat((out, xp), dim=-1)
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out, xp), dim=-1)

    # ---------------------------------------------------------------- mask
    def _mask(self, attention_mask, B, S, device):
        """Additive float32 mask (B, 1, S, S)."""
        bug = _bug()
        neg = torch.finfo(torch.float32).min
        i = torch.arange(S, device=device)
        if bug == "causal_off_by_one":
            allowed = i[None, :] <= i[:, None] + 1
        else:
            allowed = i[None, :] <= i[:, None]
        allowed = allowed[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            am = attention_mask.to(device=device).bool()
            if bug == "pad_mask_query_axis":
                allowed = allowed & am[:, None, :, None]
            else:
                allowed = allowed & am[:, None, None, :]
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return torch.where(allowed, zero, torch.full((), neg, device=device))

    # ---------------------------------------------------------------- blocks
    def _attention(self, l, x, position_ids, mask):
        bug = _bug()
        B, S, _ = x.shape
        H, Hkv, hd = self.H, self.Hkv, self.hd
        nq, nk = H * hd, Hkv * hd
        if bug == "split_qkv":
            W, b = self.wqkv[l], self.bqkv[l]
            q = x @ W[:, :nq] + b[:nq]
            k = x @ W[:, nq : nq + nk] + b[nq : nq + nk]
            v = x @ W[:, nq + nk :] + b[nq + nk :]
        elif bug == "qkv_unpack_per_head" and H == Hkv:
            qkv = (x @ self.wqkv[l] + self.bqkv[l]).view(B, S, H, 3, hd)
            q, k, v = (qkv[..., j, :].reshape(B, S, nq) for j in range(3))
        else:
            qkv = x @ self.wqkv[l] + self.bqkv[l]
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]
        q = q.view(B, S, H, hd).transpose(1, 2)
        k = k.view(B, S, Hkv, hd).transpose(1, 2)
        v = v.view(B, S, Hkv, hd).transpose(1, 2)
        if self.qk_ln:
            q = _layer_norm(q, self.qln_w[l], self.qln_b[l], self.eps)
            k = _layer_norm(k, self.kln_w[l], self.kln_b[l], self.eps)
        q = self._rope(q, position_ids)
        k = self._rope(k, position_ids)
        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        scale = (self.r if bug == "scale_rotary_dim" else hd) ** -0.5
        if bug == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale + mask
            p = torch.softmax(s, dim=-1)
            o = p @ v  # (B,H,S,hd)
        if bug == "merge_heads_no_transpose":
            o = o.reshape(B, S, H * hd)
        else:
            o = o.transpose(1, 2).reshape(B, S, H * hd)
        return o @ self.wo[l] + self.bo[l]

    def _mlp(self, l, x):
        bug = _bug()
        act = (lambda t: t * torch.sigmoid(1.702 * t)) if bug == "gelu_quick" else _gelu_new
        if bug == "mlp_chunked":
            out = self.b2[l].expand(*x.shape[:-1], self.D).clone()
            step = max(1, self.I // 4)
            for s0 in range(0, self.I, step):
                h = act(x @ self.w1[l][:, s0 : s0 + step] + self.b1[l][s0 : s0 + step])
                out = out + h @ self.w2[l][s0 : s0 + step]
            return out
        return act(x @ self.w1[l] + self.b1[l]) @ self.w2[l] + self.b2[l]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None].expand(B, S)
        elif position_ids.shape[0] != B:
            position_ids = position_ids.expand(B, S)
        mask = self._mask(attention_mask, B, S, dev)
        h = self.tok_emb[input_ids]
        for l in range(self.L):
            x = _layer_norm(h, self.ln_w[l], self.ln_b[l], self.eps)
            a = self._attention(l, x, position_ids, mask)
            if bug == "sequential_block":
                h = h + a
                h = h + self._mlp(l, _layer_norm(h, self.ln_w[l], self.ln_b[l], self.eps))
            else:
                h = h + a + self._mlp(l, x)
        h = _layer_norm(h, self.lnf_w, self.lnf_b, self.eps)
        W = self.tok_emb.t() if bug == "tie_embeddings" else self.head_w
        logits = h @ W
        if bug != "lm_head_no_bias":
            logits = logits + self.head_b
        return logits


def build(state_dict, config):
    bug = _bug()
    sd = {k: v.float() for k, v in state_dict.items()}
    m = PhiPort(config)
    pre = "model."

    def layer(l, name):
        return sd[f"{pre}layers.{l}.{name}"]

    with torch.no_grad():
        m.tok_emb.copy_(sd[pre + "embed_tokens.weight"])
        for l in range(m.L):
            m.ln_w[l].copy_(layer(l, "input_layernorm.weight"))
            m.ln_b[l].copy_(layer(l, "input_layernorm.bias"))
            wq, wk, wv = (layer(l, f"self_attn.{p}_proj.weight") for p in "qkv")
            bq, bk, bv = (layer(l, f"self_attn.{p}_proj.bias") for p in "qkv")
            m.wqkv[l].copy_(torch.cat((wq, wk, wv), dim=0).t())
            m.bqkv[l].copy_(torch.cat((bq, bk, bv), dim=0))
            wd = layer(l, "self_attn.dense.weight")
            if bug == "dense_not_transposed" and wd.shape[0] == wd.shape[1]:
                m.wo[l].copy_(wd)
            else:
                m.wo[l].copy_(wd.t())
            m.bo[l].copy_(layer(l, "self_attn.dense.bias"))
            m.w1[l].copy_(layer(l, "mlp.fc1.weight").t())
            m.b1[l].copy_(layer(l, "mlp.fc1.bias"))
            m.w2[l].copy_(layer(l, "mlp.fc2.weight").t())
            m.b2[l].copy_(layer(l, "mlp.fc2.bias"))
            if m.qk_ln:
                m.qln_w[l].copy_(layer(l, "self_attn.q_layernorm.weight"))
                m.qln_b[l].copy_(layer(l, "self_attn.q_layernorm.bias"))
                m.kln_w[l].copy_(layer(l, "self_attn.k_layernorm.weight"))
                m.kln_b[l].copy_(layer(l, "self_attn.k_layernorm.bias"))
        m.lnf_w.copy_(sd[pre + "final_layernorm.weight"])
        m.lnf_b.copy_(sd[pre + "final_layernorm.bias"])
        head = sd.get("lm_head.weight", sd[pre + "embed_tokens.weight"])
        m.head_w.copy_(head.t())
        if "lm_head.bias" in sd:
            m.head_b.copy_(sd["lm_head.bias"])
    return m.float().eval()
