"""A from-scratch PyTorch port of Gemma 2 (decoder-only causal LM), float32.

Architecture (B batch, S sequence, H hidden, nh query heads, nkv key/value heads, d head_dim, I ffn size, L layers)
---------------------------------------------------------------------------------------------------------------
  x0      = E[ids] * sqrt(H)                                   (B, S, H); the scale is NOT folded into E (E is tied)
  RMSNorm(x; g) = x * rsqrt(mean(x^2, -1) + eps) * g,  with g = 1 + w   (Gemma's offset weight w of the checkpoint)
  per layer l:
      h  = RMSNorm(x; g_in)
      q, k, v = h @ Wqkv  split into  (nh*d, nkv*d, nkv*d)    -> (B, heads, S, d)
      RoPE ("half split", NeoX style): theta_i = base^(-2i/d), i < d/2, angle = pos * theta_i;
            x' = x * cos + rotate_half(x) * sin,  rotate_half([a, b]) = [-b, a]
      scores = (q k^T) * query_pre_attn_scalar^-0.5           (B, nh, S, S), query head j uses kv head j // (nh/nkv)
      scores = c_a * tanh(scores / c_a)                         c_a = attn_logit_softcapping (before the mask)
      scores += mask: causal (kv <= q), key padding (attention_mask == 0 masked), and on the layers that
                config.layer_types calls "sliding_attention" also  q - kv < sliding_window
      a  = softmax(scores) v  -> (B, S, nh*d) @ Wo              (nh*d, H)
      x  = x + RMSNorm(a; g_post_attn)
      h  = RMSNorm(x; g_pre_ffn)
      [gate | up] = h @ Wgu  (H, 2I);   f = gelu_tanh(gate) * up  @ Wdown  (I, H)
      x  = x + RMSNorm(f; g_post_ffn)
  out     = RMSNorm(x; g_final) @ E^T                           (tied head)
  logits  = c_f * tanh(out / c_f)                              c_f = final_logit_softcapping

Weight layout (all matrices stored transposed, in -> out; all layers stacked on a leading L axis)
-------------------------------------------------------------------------------------------------
  embed        (V, H)                       model.embed_tokens.weight (also the LM head, tied)
  wqkv         (L, H, (nh + 2 nkv) d)       [q_proj.weight^T | k_proj.weight^T | v_proj.weight^T]
  wo           (L, nh d, H)                 o_proj.weight^T
  wgu          (L, H, 2 I)                  [gate_proj.weight^T | up_proj.weight^T]
  wdown        (L, I, H)                    down_proj.weight^T
  gains        (L, 4, H)                    1 + w of [input_layernorm, post_attention_layernorm,
                                                      pre_feedforward_layernorm, post_feedforward_layernorm]
  final_gain   (H,)                         1 + model.norm.weight
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "norm_no_plus_one",  # loader stores the checkpoint's RMSNorm weight w as the gain instead of Gemma's (1 + w)
    "embed_scale_tied",  # sqrt(hidden) embedding scale folded into the embedding table, which also scales the tied LM head
    "attn_scale_head_dim",  # attention scaled by head_dim**-0.5 instead of query_pre_attn_scalar**-0.5
    "scale_after_softcap",  # attention soft-capping applied to the raw q.k, the query_pre_attn_scalar scale only after it
    "final_softcap_attn_field",  # final logit soft-capping reads attn_logit_softcapping instead of final_logit_softcapping
    "sliding_window_off_by_one",  # sliding mask keeps q - kv <= window (window + 1 keys) instead of q - kv < window
    "sliding_layer_parity",  # sliding window put on odd layers (i % 2 == 1) instead of config.layer_types' even ones
    "sliding_mask_no_padding",  # the sliding-window layers' mask is built from causality only, key padding dropped
    "gelu_exact",  # hidden_activation gelu_pytorch_tanh computed as the exact erf GELU
    "llama_norm_names",  # Llama naming: post_attention_layernorm used as the pre-FFN norm and pre_feedforward_layernorm after attention
    "rope_interleaved",  # RoPE rotates interleaved pairs (2i, 2i+1) (GPT-J style) instead of the half-split pairs (i, i + d/2)
    "gqa_tile",  # GQA maps query head j to kv head j % nkv instead of j // (nh / nkv)
    "gate_up_order",  # fused gate/up matrix split in the wrong order: GELU applied to the up projection
    "rope_freq_exponent",  # RoPE inverse frequencies base^(-i/d) over i < d/2 instead of base^(-2i/d)
]

PADDING_ONLY = ["sliding_mask_no_padding"]

CLEAN = [
    "split_qkv",  # three separate matmuls on column slices of the fused QKV matrix instead of one fused matmul
    "repeat_kv",  # K/V heads repeat_interleave'd to nh heads instead of the grouped (nkv, group) einsum
    "rope_complex",  # RoPE as a complex multiplication (a + i b) * exp(i angle) on the half-split pairs
    "softcap_sigmoid",  # soft-capping via tanh(z) = 2 sigmoid(2z) - 1
    "mask_bool_where",  # boolean mask applied with torch.where(min float) instead of an additive float mask
]


def _rms(x, gain, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def _softcap(x, cap):
    if BUG == "softcap_sigmoid":
        return cap * (2.0 * torch.sigmoid(2.0 * x / cap) - 1.0)
    return cap * torch.tanh(x / cap)


def _gelu_tanh(x):
    if BUG == "gelu_exact":
        return F.gelu(x)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _rope(x, pos, inv_freq):
    """x (B, heads, S, d), pos (B, S) -> x rotated."""
    d = x.shape[-1]
    half = d // 2
    ang = pos[:, None, :, None].float() * inv_freq  # (B, 1, S, d/2)
    cos, sin = ang.cos(), ang.sin()
    if BUG == "rope_interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        ra, rb = a * cos - b * sin, a * sin + b * cos
        return torch.stack((ra, rb), -1).flatten(-2)
    a, b = x[..., :half], x[..., half:]
    if BUG == "rope_complex":
        z = torch.complex(a.contiguous(), b.contiguous()) * torch.polar(torch.ones_like(ang), ang)
        return torch.cat((z.real, z.imag), -1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)


class Gemma2Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.H = config.hidden_size
        self.nh = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or self.H // self.nh
        self.I = config.intermediate_size
        self.L = config.num_hidden_layers
        self.V = config.vocab_size
        self.eps = config.rms_norm_eps
        self.window = config.sliding_window
        self.layer_types = list(config.layer_types)
        self.qpas = config.query_pre_attn_scalar
        self.attn_cap = config.attn_logit_softcapping
        self.final_cap = config.final_logit_softcapping
        rope = getattr(config, "rope_parameters", None) or {}
        self.theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        L, H, d = self.L, self.H, self.d
        self.embed = nn.Parameter(torch.zeros(self.V, H))
        self.wqkv = nn.Parameter(torch.zeros(L, H, (self.nh + 2 * self.nkv) * d))
        self.wo = nn.Parameter(torch.zeros(L, self.nh * d, H))
        self.wgu = nn.Parameter(torch.zeros(L, H, 2 * self.I))
        self.wdown = nn.Parameter(torch.zeros(L, self.I, H))
        self.gains = nn.Parameter(torch.ones(L, 4, H))
        self.final_gain = nn.Parameter(torch.ones(H))

    def _inv_freq(self):
        d = self.d
        if BUG == "rope_freq_exponent":
            e = torch.arange(0, d // 2, dtype=torch.float32) / d
        else:
            e = torch.arange(0, d, 2, dtype=torch.float32) / d
        return 1.0 / (self.theta**e)

    def _is_sliding(self, i):
        if BUG == "sliding_layer_parity":
            return i % 2 == 1
        return self.layer_types[i] == "sliding_attention"

    def _masks(self, attention_mask, B, S, device):
        """Boolean 'may attend' masks (B, 1, S, S) for full and sliding layers."""
        qi = torch.arange(S, device=device)[:, None]
        ki = torch.arange(S, device=device)[None, :]
        causal = ki <= qi
        if BUG == "sliding_window_off_by_one":
            win = causal & (qi - ki <= self.window)
        else:
            win = causal & (qi - ki < self.window)
        if attention_mask is None:
            keep = torch.ones(B, S, dtype=torch.bool, device=device)
        else:
            keep = attention_mask.bool()
        full = causal[None, None] & keep[:, None, None, :]
        if BUG == "sliding_mask_no_padding":
            sliding = win[None, None].expand(B, 1, S, S)
        else:
            sliding = win[None, None] & keep[:, None, None, :]
        return full, sliding

    def _attention(self, i, h, pos, inv_freq, allowed):
        B, S, _ = h.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        w = self.wqkv[i]
        if BUG == "split_qkv":
            q = h @ w[:, : nh * d]
            k = h @ w[:, nh * d : (nh + nkv) * d]
            v = h @ w[:, (nh + nkv) * d :]
        else:
            q, k, v = (h @ w).split((nh * d, nkv * d, nkv * d), -1)
        q = q.view(B, S, nh, d).transpose(1, 2)
        k = k.view(B, S, nkv, d).transpose(1, 2)
        v = v.view(B, S, nkv, d).transpose(1, 2)
        q = _rope(q, pos, inv_freq)
        k = _rope(k, pos, inv_freq)
        scale = d**-0.5 if BUG == "attn_scale_head_dim" else self.qpas**-0.5
        g = nh // nkv
        if BUG == "gqa_tile":
            k = k.repeat(1, g, 1, 1)
            v = v.repeat(1, g, 1, 1)
            s = q @ k.transpose(-1, -2)
        elif BUG == "repeat_kv":
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
            s = q @ k.transpose(-1, -2)
        else:
            s = torch.einsum("bkgqd,bksd->bkgqs", q.view(B, nkv, g, S, d), k).reshape(B, nh, S, S)
        neg = torch.finfo(s.dtype).min
        if BUG == "scale_after_softcap":
            s = _softcap(s, self.attn_cap) * scale if self.attn_cap is not None else s * scale
        else:
            s = s * scale
            if self.attn_cap is not None:
                s = _softcap(s, self.attn_cap)
        if BUG == "mask_bool_where":
            s = torch.where(allowed, s, torch.full_like(s, neg))
        else:
            s = s + torch.zeros_like(s).masked_fill(~allowed, neg)
        p = torch.softmax(s, dim=-1)
        if BUG in ("gqa_tile", "repeat_kv"):
            o = p @ v
        else:
            o = torch.einsum("bkgqs,bksd->bkgqd", p.view(B, nkv, g, S, S), v).reshape(B, nh, S, d)
        o = o.transpose(1, 2).reshape(B, S, nh * d)
        return o @ self.wo[i]

    def _mlp(self, i, h):
        gu = h @ self.wgu[i]
        if BUG == "gate_up_order":
            up, gate = gu.chunk(2, -1)
        else:
            gate, up = gu.chunk(2, -1)
        return (_gelu_tanh(gate) * up) @ self.wdown[i]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None].expand(B, S)
        x = self.embed[input_ids]
        if BUG != "embed_scale_tied":  # that variant folded the scale into the table at build time
            x = x * torch.tensor(self.H**0.5, dtype=x.dtype)
        inv_freq = self._inv_freq().to(dev)
        full, sliding = self._masks(attention_mask, B, S, dev)
        for i in range(self.L):
            g = self.gains[i]
            h = _rms(x, g[0], self.eps)
            a = self._attention(i, h, position_ids, inv_freq, sliding if self._is_sliding(i) else full)
            x = x + _rms(a, g[1], self.eps)
            h = _rms(x, g[2], self.eps)
            x = x + _rms(self._mlp(i, h), g[3], self.eps)
        x = _rms(x, self.final_gain, self.eps)
        logits = x @ self.embed.t()
        cap = self.attn_cap if BUG == "final_softcap_attn_field" else self.final_cap
        if cap is not None:
            logits = _softcap(logits, cap)
        return logits


@torch.no_grad()
def build(state_dict, config):
    sd = {k: v.float() for k, v in state_dict.items()}
    m = Gemma2Port(config)
    p = "model.layers.{}."
    offset = 0.0 if BUG == "norm_no_plus_one" else 1.0
    norm_names = [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ]
    if BUG == "llama_norm_names":
        norm_names[1], norm_names[2] = norm_names[2], norm_names[1]
    for i in range(m.L):
        pre = p.format(i)
        m.wqkv[i].copy_(
            torch.cat(
                [sd[pre + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")],
                0,
            ).t()
        )
        m.wo[i].copy_(sd[pre + "self_attn.o_proj.weight"].t())
        m.wgu[i].copy_(torch.cat([sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]], 0).t())
        m.wdown[i].copy_(sd[pre + "mlp.down_proj.weight"].t())
        for j, n in enumerate(norm_names):
            m.gains[i, j].copy_(offset + sd[pre + n + ".weight"])
    m.final_gain.copy_(offset + sd["model.norm.weight"])
    emb = sd["model.embed_tokens.weight"]
    if BUG == "embed_scale_tied":
        emb = emb * config.hidden_size**0.5
    m.embed.copy_(emb)
    return m.float().eval()
