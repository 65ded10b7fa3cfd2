"""Shared pieces of the held-out user models. BUG names the single injected bug (None: clean)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import parity

BUG = None  # set by run_all.py
SUMORDER = False  # clean variant that sums in another order (split matmuls, einsum, sum/d)


def bug(name):
    return name == BUG


def lin(x, w):
    """x @ w.T; in SUMORDER mode as two half-K products added (same formula, other rounding)."""
    if SUMORDER and w.shape[1] % 2 == 0:
        k = w.shape[1] // 2
        return x[..., :k] @ w[:, :k].T + x[..., k:] @ w[:, k:].T
    return x @ w.T


def rms(x, w, eps, one_plus=False, weight_first=False):
    """Llama order: cast to f32, normalise, cast back, times w. Gemma: (1+w) in f32, cast last."""
    dt = x.dtype
    h = x.float()
    if bug("ln_not_rms"):
        h = h - h.mean(-1, keepdim=True)
    ms = (h.pow(2).sum(-1, keepdim=True) / h.shape[-1]) if SUMORDER else h.pow(2).mean(-1, keepdim=True)
    if bug("eps_outside_sqrt"):
        h = h / (ms.sqrt() + eps)
    else:
        h = h * torch.rsqrt(ms + eps)
    if one_plus:
        wf = w.float() if bug("gemma_w_not_1pw") else (1.0 + w.float())
        return (h * wf).to(dt)
    if bug("llama_1pw"):  # Gemma habit in a Llama port
        return (1 + w) * h.to(dt)
    if bug("norm_in_bf16_weight_first") or weight_first:
        return (h * w.float()).to(dt)
    return w * h.to(dt)


def rope_tables(positions, dim, theta, dtype, rot_dim=None):
    rot_dim = rot_dim or dim
    if bug("rope_freq_exponent"):  # 1/theta^(i/d), i = 0..d/2-1, instead of 1/theta^(2i/d)
        inv = 1.0 / (theta ** (torch.arange(0, rot_dim // 2, dtype=torch.int64).float() / rot_dim))
    else:
        inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    f = positions.float()[..., None] * inv  # (b, t, rot/2)
    if bug("rope_interleaved"):
        emb = torch.repeat_interleave(f, 2, dim=-1)
    else:
        emb = torch.cat([f, f], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rot_half(x):
    if bug("rope_interleaved"):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([-x2, x1], -1).flatten(-2)
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    if bug("rope_sign"):
        return torch.cat([b, -a], -1)
    return torch.cat([-b, a], -1)


def apply_rope(x, cos, sin):
    """x (b, h, t, d); cos/sin (b, t, rot)."""
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    if r < x.shape[-1]:
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat([xr * cos + rot_half(xr) * sin, xp], -1)
    return x * cos + rot_half(x) * sin


def expand_kv(k, n_rep):
    if n_rep == 1:
        return k
    if bug("gqa_tile"):
        return k.repeat(1, n_rep, 1, 1)  # heads [0,1,0,1] instead of [0,0,1,1]
    return k.repeat_interleave(n_rep, dim=1)


def attention(q, k, v, scale, window=None, softcap=None, training=False):
    """q (b,h,t,d), k/v (b,kvh,t,d) -> context (b,t,h*d). Taps scores/probs/context."""
    b, h, t, d = q.shape
    n_rep = h // k.shape[1]
    if bug("clean_sdpa"):  # same formula through torch's fused SDPA (other summation order; no score/prob taps)
        c = F.scaled_dot_product_attention(
            q, expand_kv(k, n_rep), expand_kv(v, n_rep), is_causal=window is None, scale=scale
        )
        c = parity.tap(c, "context")
        return c.transpose(1, 2).reshape(b, t, h * d)
    k, v = expand_kv(k, n_rep), expand_kv(v, n_rep)
    if SUMORDER:
        s = torch.einsum("bhqd,bhkd->bhqk", q * scale, k)
    else:
        s = (q @ k.transpose(-1, -2)) * scale
    s = parity.tap(s, "scores")
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = (j <= i + 1) if bug("causal_off_by_one") else (j <= i)
    if bug("causal_missing"):
        allowed = torch.ones_like(allowed)
    if window is not None:
        if bug("window_off_by_one"):
            allowed &= j >= i - window
        elif not bug("window_missing"):
            allowed &= j > i - window
    s = s.masked_fill(~allowed, float("-inf"))
    if bug("softmax_bf16"):
        p = torch.softmax(s, dim=-1)
    elif bug("softmax_wrong_axis"):
        p = torch.softmax(s.masked_fill(~allowed, -1e9), dim=-2, dtype=torch.float32).to(q.dtype)
    else:
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    if bug("attn_dropout_on"):
        p = F.dropout(p, 0.1, training=True)
    p = parity.tap(p, "probs")
    c = p @ v
    c = parity.tap(c, "context")
    if bug("head_merge_no_transpose"):
        return c.reshape(b, t, h * d)
    return c.transpose(1, 2).reshape(b, t, h * d)


class Lin(nn.Linear):
    """nn.Linear whose weight is assigned by the loader; SUMORDER: half-K products added."""

    def __init__(self, w, bias=None):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(w) if not isinstance(w, nn.Parameter) else w
        self.bias = None if bias is None else nn.Parameter(bias)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x):
        y = lin(x, self.weight)
        return y if self.bias is None else y + self.bias
