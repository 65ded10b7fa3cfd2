"""A from-scratch PyTorch port of Salesforce CTRL (Transformers' ``CTRLLMHeadModel``).

Architecture (d = n_embd, H = n_head, hd = d / H, L = n_layer, F = dff, V = vocab_size, T = seq len)
--------------------------------------------------------------------------------------------------
* Sinusoidal position table (fixed, not learned), ``P`` of shape (n_positions, d), CTRL's
  *concatenated* layout (not the interleaved one of "Attention is all you need"):
      r_j      = 10000 ** (-2j / d)                       j = 0 .. d/2 - 1
      P[p, j]        = sin(p * r_j)                       first half of the columns
      P[p, d/2 + j]  = cos(p * r_j)                       second half of the columns
  (Transformers computes the angle with i over all d columns and rate 10000^(-2*(i//2)/d), then takes the
  even columns for the sines and the odd columns for the cosines; both halves therefore use the same r_j.)
* Input:  x0 = E[ids] * sqrt(d) + P[position_ids]          (position_ids default: 0 .. T-1)
* L pre-LayerNorm blocks (both block norms eps = 1e-6, biased variance):
      a   = LN1(x)
      q,k,v = a @ Wq + bq, a @ Wk + bk, a @ Wv + bv        each (B, T, d) -> (B, H, T, hd)
      s   = q k^T / sqrt(hd)  + mask                       mask: causal (key j <= query i) and
                                                           key padding (attention_mask[b, j] == 0 masked)
      o   = softmax(s) v  -> (B, T, d) ;  x = x + o @ Wo + bo
      f   = relu(LN2(x) @ W1 + b1) @ W2 + b2 ;  x = x + f
* Final LayerNorm (eps = config.layer_norm_epsilon), then logits = x @ E^T + b_head
  (the LM head's weight is tied to the token embedding E; its bias is its own parameter).

Weight layout (this port's own; converted from the checkpoint in ``build``)
--------------------------------------------------------------------------
All matrices are stored *in -> out* (transposed w.r.t. nn.Linear) and stacked over layers:
    tok_emb    (V, d)            transformer.w.weight (also the LM head's matrix)
    head_bias  (V,)              lm_head.bias
    qkv_w      (L, d, 3d)        [Wq^T | Wk^T | Wv^T] fused along the output axis
    qkv_b      (L, 3d)           [bq | bk | bv]
    out_w      (L, d, d)         dense.weight^T
    out_b      (L, d)
    ff1_w      (L, d, F)         ffn.0.weight^T          ff1_b (L, F)
    ff2_w      (L, F, d)         ffn.2.weight^T          ff2_b (L, d)
    ln_w, ln_b (L, 2, d)         [layernorm1, layernorm2] stacked on axis 1
    lnf_w, lnf_b (d,)            transformer.layernorm
    pe_table   (n_positions, d)  buffer, the sinusoid table above
``BUG`` (module global, read at call time in build / forward / helpers) selects a faulty or an
equivalent variant.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "pe_interleaved",  # position table laid out sin/cos interleaved (Vaswani) instead of CTRL's [sin | cos] halves
    "pe_rate_no_floor",  # angle rate 10000^(-i/d) per column instead of 10000^(-2*(i//2)/d): cos half gets odd exponents
    "emb_scale_after_pos",  # sqrt(d) multiplies (embedding + position) instead of the token embedding alone
    "attn_scale_dmodel",  # scores scaled by 1/sqrt(n_embd) instead of 1/sqrt(head_dim)
    "ln_unbiased_var",  # hand-written LayerNorm uses torch.var's default unbiased (n-1) variance
    "lm_head_no_bias",  # tied LM head takes E^T only and drops lm_head.bias (the checkpoint's only head tensor)
    "positions_ignored",  # given position_ids ignored, arange(T) used: left-padded rows get shifted positions
    "pad_mask_query_axis",  # padding mask broadcast over the query axis ([:, None, :, None]) instead of the key axis
    "ffn_gelu",  # feed-forward activation GELU (GPT-2 habit) instead of CTRL's ReLU
    "head_split_layout",  # (B,T,d) viewed straight as (B,H,T,hd) instead of (B,T,H,hd).transpose(1,2)
    "post_norm",  # original-Transformer post-LN (x = LN(x + sublayer(x))) instead of CTRL's pre-LN blocks
    "causal_off_by_one",  # causal mask triu(diagonal=2): each query also sees the next token
    "dense_not_transposed",  # loader forgets to transpose the (square) attention output projection
    "residual_from_normed",  # attention residual added to LN1(x) instead of the block input x
]

PADDING_ONLY = ["positions_ignored", "pad_mask_query_axis"]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask instead of the explicit softmax
    "pe_on_the_fly",  # sinusoids computed from position_ids at call time instead of the precomputed table
    "torch_layer_norm",  # F.layer_norm instead of the hand-written mean / biased-variance LayerNorm
    "scale_folded_into_q",  # 1/sqrt(hd) folded into the q weights and bias at build time, scores unscaled
]


def _bug():
    return BUG


def sinusoid_table(n_pos: int, d: int, positions: torch.Tensor = None) -> torch.Tensor:
    """CTRL's [sin | cos] position table (n_pos, d), or the rows at ``positions`` (any shape) when given."""
    bug = _bug()
    if positions is None:
        pos = torch.arange(n_pos, dtype=torch.float32)
    else:
        pos = positions.to(torch.float32)
    if bug == "pe_rate_no_floor":
        i = torch.arange(d, dtype=torch.float32)
        rates = 1.0 / torch.pow(10000.0, i / d)
        ang = pos.unsqueeze(-1) * rates
        return torch.cat([torch.sin(ang[..., 0::2]), torch.cos(ang[..., 1::2])], dim=-1)
    j = torch.arange(d // 2, dtype=torch.float32)
    rates = 1.0 / torch.pow(10000.0, (2.0 * j) / d)
    ang = pos.unsqueeze(-1) * rates  # (..., d/2)
    if bug == "pe_interleaved":
        return torch.stack([torch.sin(ang), torch.cos(ang)], dim=-1).flatten(-2)
    return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)


def layer_norm(x, w, b, eps):
    bug = _bug()
    if bug == "torch_layer_norm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    mu = x.mean(-1, keepdim=True)
    if bug == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + eps) * w + b


class CtrlPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, L, Fd, V = config.n_embd, config.n_layer, config.dff, config.vocab_size
        self.d, self.L, self.H = d, L, config.n_head
        self.hd = d // self.H
        self.n_pos = config.n_positions
        self.block_eps = 1e-6  # CTRL's block norms are hard-wired to 1e-6
        self.final_eps = config.layer_norm_epsilon
        self.q_prescaled = False
        self.tok_emb = nn.Parameter(torch.zeros(V, d))
        self.head_bias = nn.Parameter(torch.zeros(V))
        self.qkv_w = nn.Parameter(torch.zeros(L, d, 3 * d))
        self.qkv_b = nn.Parameter(torch.zeros(L, 3 * d))
        self.out_w = nn.Parameter(torch.zeros(L, d, d))
        self.out_b = nn.Parameter(torch.zeros(L, d))
        self.ff1_w = nn.Parameter(torch.zeros(L, d, Fd))
        self.ff1_b = nn.Parameter(torch.zeros(L, Fd))
        self.ff2_w = nn.Parameter(torch.zeros(L, Fd, d))
        self.ff2_b = nn.Parameter(torch.zeros(L, d))
        self.ln_w = nn.Parameter(torch.ones(L, 2, d))
        self.ln_b = nn.Parameter(torch.zeros(L, 2, d))
        self.lnf_w = nn.Parameter(torch.ones(d))
        self.lnf_b = nn.Parameter(torch.zeros(d))
        self.register_buffer("pe_table", sinusoid_table(self.n_pos, d), persistent=False)

    # ------------------------------------------------------------------ attention
    def _allowed(self, B, T, attention_mask, device):
        """Boolean (B, 1, T, T): True where query i may attend to key j."""
        bug = _bug()
        diag = 2 if bug == "causal_off_by_one" else 1
        causal = ~torch.triu(torch.ones(T, T, dtype=torch.bool, device=device), diagonal=diag)
        allowed = causal[None, None].expand(B, 1, T, T)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if bug == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return allowed

    def _heads(self, t):
        B, T, _ = t.shape
        if _bug() == "head_split_layout":
            return t.reshape(B, self.H, T, self.hd)
        return t.view(B, T, self.H, self.hd).transpose(1, 2)

    def _attention(self, a, l, allowed):
        bug = _bug()
        B, T, d = a.shape
        if bug == "split_qkv":
            w, b = self.qkv_w[l], self.qkv_b[l]
            q = a @ w[:, :d] + b[:d]
            k = a @ w[:, d : 2 * d] + b[d : 2 * d]
            v = a @ w[:, 2 * d :] + b[2 * d :]
        else:
            q, k, v = (a @ self.qkv_w[l] + self.qkv_b[l]).split(d, dim=-1)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if self.q_prescaled:
            scale = 1.0
        elif bug == "attn_scale_dmodel":
            scale = 1.0 / math.sqrt(self.d)
        else:
            scale = 1.0 / math.sqrt(self.hd)
        if bug == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            o = torch.softmax(s, dim=-1) @ v
        o = o.transpose(1, 2).reshape(B, T, d)
        return o @ self.out_w[l] + self.out_b[l]

    def _ffn(self, x, l):
        h = x @ self.ff1_w[l] + self.ff1_b[l]
        h = F.gelu(h) if _bug() == "ffn_gelu" else F.relu(h)
        return h @ self.ff2_w[l] + self.ff2_b[l]

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        device = input_ids.device
        if position_ids is None or bug == "positions_ignored":
            position_ids = torch.arange(T, device=device)[None].expand(B, T)
        if bug == "pe_on_the_fly":
            pe = sinusoid_table(self.n_pos, self.d, position_ids)
        else:
            pe = self.pe_table[position_ids]
        emb = self.tok_emb[input_ids]
        if bug == "emb_scale_after_pos":
            x = (emb + pe) * math.sqrt(self.d)
        else:
            x = emb * math.sqrt(self.d) + pe

        allowed = self._allowed(B, T, attention_mask, device)
        eps = self.block_eps
        for l in range(self.L):
            w1, b1 = self.ln_w[l, 0], self.ln_b[l, 0]
            w2, b2 = self.ln_w[l, 1], self.ln_b[l, 1]
            if bug == "post_norm":
                x = layer_norm(x + self._attention(x, l, allowed), w1, b1, eps)
                x = layer_norm(x + self._ffn(x, l), w2, b2, eps)
                continue
            a = layer_norm(x, w1, b1, eps)
            base = a if bug == "residual_from_normed" else x
            x = base + self._attention(a, l, allowed)
            x = x + self._ffn(layer_norm(x, w2, b2, eps), l)
        x = layer_norm(x, self.lnf_w, self.lnf_b, self.final_eps)
        logits = x @ self.tok_emb.t()
        if bug != "lm_head_no_bias":
            logits = logits + self.head_bias
        return logits


@torch.no_grad()
def build(state_dict, config) -> nn.Module:
    bug = _bug()
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    m = CtrlPort(config)
    L, d = m.L, m.d
    m.tok_emb.copy_(sd["transformer.w.weight"])
    m.head_bias.copy_(sd["lm_head.bias"])
    for l in range(L):
        p = f"transformer.h.{l}."
        att = p + "multi_head_attention."
        wq, wk, wv = (sd[att + n + ".weight"] for n in ("Wq", "Wk", "Wv"))
        bq, bk, bv = (sd[att + n + ".bias"] for n in ("Wq", "Wk", "Wv"))
        if bug == "scale_folded_into_q":
            s = 1.0 / math.sqrt(m.hd)
            wq, bq = wq * s, bq * s
        m.qkv_w[l].copy_(torch.cat([wq.t(), wk.t(), wv.t()], dim=1))
        m.qkv_b[l].copy_(torch.cat([bq, bk, bv]))
        dense = sd[att + "dense.weight"]
        m.out_w[l].copy_(dense if bug == "dense_not_transposed" else dense.t())
        m.out_b[l].copy_(sd[att + "dense.bias"])
        m.ff1_w[l].copy_(sd[p + "ffn.0.weight"].t())
        m.ff1_b[l].copy_(sd[p + "ffn.0.bias"])
        m.ff2_w[l].copy_(sd[p + "ffn.2.weight"].t())
        m.ff2_b[l].copy_(sd[p + "ffn.2.bias"])
        for i, n in enumerate(("layernorm1", "layernorm2")):
            m.ln_w[l, i].copy_(sd[p + n + ".weight"])
            m.ln_b[l, i].copy_(sd[p + n + ".bias"])
    m.lnf_w.copy_(sd["transformer.layernorm.weight"])
    m.lnf_b.copy_(sd["transformer.layernorm.bias"])
    m.q_prescaled = bug == "scale_folded_into_q"
    m.pe_table = sinusoid_table(m.n_pos, d)
    return m.float().eval()
