"""Hand-written plain-PyTorch port of Falcon-H1 (FalconH1ForCausalLM): every layer runs a Mamba-2 mixer and GQA
attention in parallel on the same normed input, then a SwiGLU MLP; muP multipliers throughout.

Architecture as this port implements it:
- embeddings scaled by embedding_multiplier; untied LM head, logits scaled by lm_head_multiplier; RMSNorms
  (plain gain w) before the mixers, before the MLP and at the end.
- layer: x = RMSNorm(h);  h = h + ssm_out_multiplier * Mamba2(x) + attention_out_multiplier * Attn(
  attention_in_multiplier * x);  h = h + MLP(RMSNorm(h)).
- Mamba2 (n_heads heads of head_dim p, n_groups groups of d_state N, conv kernel K): the input is zeroed at padding
  positions and multiplied by ssm_in_multiplier; in_proj (with bias) gives [z (I) | x (I) | B (G N) | C (G N) |
  dt (n_heads)], each part multiplied by its muP multiplier (ssm_multipliers, the "mup vector"); x|B|C go through
  a causal depthwise conv (with bias) and SiLU and are zeroed again at padding positions; dt = clamp(softplus(dt +
  dt_bias), time_step_limit); A = -exp(A_log); head h uses group h // (n_heads / G); per head, state S (p, N):
      S <- exp(dt A) S + dt x B^T;  y = S C + D x
  then gated RMSNorm (norm_before_gate False): rms over each group of I / G channels of (y * silu(z)), times w;
  out_proj (with bias).
- Attn: q/k/v/o with biases; k multiplied by key_multiplier; full RoPE (rotate-half); scale d^-0.5; causal +
  padding mask.
- MLP: down(up(x) * silu(gate_multiplier * gate(x))) * down_multiplier (biases on all three).
- positions: position_ids if given, else 0..T-1.

Layouts (BUG selects one; every one is a correct port):
- baseline "": own module tree (embed / layers[i].ssm / layers[i].attn / layers[i].mlp / head_t); every matrix
  transposed (x @ W); q|k|v fused into one transposed matrix with one fused bias; gate|up fused; the mup vector
  kept as a buffer multiplying in_proj's output; conv weight stored (channels, kernel) applied by left padding +
  unfold + sum; A stored as -exp(A_log); token-by-token scan with the state (b, heads, p, N), groups expanded by
  repeat_interleave; explicit softmax attention with an additive float mask.
- fh1_mup_folded: every muP multiplier folded into the weights (embedding table, in_proj rows (mup vector) and
  columns (ssm_in), out_proj, q/k/v (attention_in, key_multiplier on k's weight and bias), o, gate, down, head).
- fh1_chunked_ssd: SSD scan in chunks of 8 (intra-chunk masked C B^T form, the state carried between chunks).
- fh1_parallel_ssd: fully parallel (quadratic) SSD: Y = (exp(segsum(dt A)) * C B^T) (dt x) over the whole sequence.
- fh1_norm_folded: RMSNorm gains folded into the next matrices (input norm -> in_proj and q/k/v, pre-FF norm ->
  gate/up, final -> head; gated-norm gain -> out_proj's columns).
- fh1_split_projections: in_proj split into separate z / x / B / C / dt nn.Linear modules ((out, in) orientation,
  each with its bias) and the conv into separate depthwise nn.Conv1d modules for x, B and C; the mup vector as five
  scalars, one per projection.
- fh1_heads_einsum_meta_rope: attention as (heads, head_dim, hidden) weights with (heads, head_dim) biases via
  einsum, Meta-style q/k row permutation (interleaved pairs) with complex RoPE from a precomputed freqs_cis buffer,
  boolean masked_fill; SSM state kept as (b, heads, N, p) and groups broadcast as (G, heads per group) without
  repeating B / C.
- fh1_sdpa_tables_maskpos: scaled_dot_product_attention with a boolean mask and enable_gqa; cos/sin tables for the
  whole max length as buffers; positions derived from the attention mask; conv as F.conv1d with padding K - 1.
- fh1_functional_stacked: one functional forward over a plain dict of tensors stacked over layers ((n_layers, ...)
  per kind), a separate LM head module.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = []
PADDING_ONLY = []
CLEAN = [
    "fh1_mup_folded",  # all muP multipliers folded into the weights (embedding, in_proj, out_proj, q/k/v/o, MLP, head)
    "fh1_chunked_ssd",  # SSD scan in chunks of 8 with carried state
    "fh1_parallel_ssd",  # fully parallel quadratic SSD over the whole sequence
    "fh1_norm_folded",  # RMSNorm gains folded into next matrices, gated-norm gain into out_proj
    "fh1_split_projections",  # z/x/B/C/dt separate Linears + separate Conv1d modules, mup as 5 scalars
    "fh1_heads_einsum_meta_rope",  # (heads, d, H) einsum + Meta permutation + complex RoPE; SSM state (N, p)
    "fh1_sdpa_tables_maskpos",  # SDPA bool mask + enable_gqa, cos/sin tables, positions from the mask, F.conv1d
    "fh1_functional_stacked",  # plain dict of (n_layers, ...) stacked tensors, functional forward, head module
]


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x, cos, sin):
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _positions(ids, attention_mask, position_ids, from_mask=False):
    b, t = ids.shape
    if from_mask and attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if position_ids is not None:
        return position_ids
    return torch.arange(t, device=ids.device)[None].expand(b, t)


def _keep_mask(attention_mask, b, t, device):
    """(b, 1, t, t) bool: causal, key not padding; a query always sees itself (padding rows stay finite)."""
    keep = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None].expand(b, t, t)
    if attention_mask is not None:
        keep = keep & (attention_mask.bool()[:, None, :] | torch.eye(t, dtype=torch.bool, device=device))
    return keep[:, None]


def _pad_zero(x, mask):
    return x if mask is None else x * mask[:, :, None].to(x.dtype)


class _Cfg:
    def __init__(self, config):
        self.H = config.hidden_size
        self.nq = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or self.H // self.nq
        self.theta = config.rope_parameters["rope_theta"]
        self.L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.maxpos = config.max_position_embeddings
        self.I = config.mamba_d_ssm if config.mamba_d_ssm is not None else int(config.mamba_expand * self.H)
        self.nh = config.mamba_n_heads
        self.p = config.mamba_d_head
        self.G = config.mamba_n_groups
        self.N = config.mamba_d_state
        self.K = config.mamba_d_conv
        self.gated_norm = config.mamba_rms_norm
        self.norm_before_gate = config.mamba_norm_before_gate
        lim = config.time_step_limit
        self.dt_min, self.dt_max = (lim[0], lim[1]) if lim is not None else (0.0, float("inf"))
        self.emb_mult = config.embedding_multiplier
        self.head_mult = config.lm_head_multiplier
        self.gate_mult, self.down_mult = config.mlp_multipliers
        self.key_mult = config.key_multiplier
        self.attn_in, self.attn_out = config.attention_in_multiplier, config.attention_out_multiplier
        self.ssm_mults = list(config.ssm_multipliers)
        self.ssm_in, self.ssm_out = config.ssm_in_multiplier, config.ssm_out_multiplier
        self.split = [self.I, self.I, self.G * self.N, self.G * self.N, self.nh]  # z, x, B, C, dt

    def inv_freq(self):
        return 1.0 / (self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float) / self.d))

    def mup_vector(self):
        return torch.cat([torch.full((n,), float(m)) for n, m in zip(self.split, self.ssm_mults)])


def _get(sd, i, name):
    return sd[f"model.layers.{i}.{name}"].float()


# ----------------------------------------------------------------------------------------------------------------
# SSD scans: x (b, t, nh, p) already times dt, a = dt * A (b, t, nh), B / C per head (b, t, nh, N)
# ----------------------------------------------------------------------------------------------------------------


def _scan_recurrent(xdt, a, B, C):
    b, t, nh, p = xdt.shape
    S = xdt.new_zeros(b, nh, p, B.shape[-1])
    ys = []
    for i in range(t):
        S = S * a[:, i].exp()[..., None, None] + xdt[:, i, :, :, None] * B[:, i, :, None, :]
        ys.append((S @ C[:, i, :, :, None])[..., 0])
    return torch.stack(ys, 1)


def _segsum(a):
    """a (..., T) -> (..., T, T): sum_{j < i <= t} a_i for j <= t, -inf above the diagonal."""
    T = a.shape[-1]
    cs = a.cumsum(-1)
    seg = cs[..., :, None] - cs[..., None, :]
    return seg.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def _scan_chunked(xdt, a, B, C, chunk):
    b, t, nh, p = xdt.shape
    S = xdt.new_zeros(b, nh, B.shape[-1], p)  # (N, p)
    ys = []
    for s in range(0, t, chunk):
        xc = xdt[:, s : s + chunk].transpose(1, 2)  # (b, nh, c, p)
        ac = a[:, s : s + chunk].transpose(1, 2)  # (b, nh, c)
        Bc, Cc = B[:, s : s + chunk].transpose(1, 2), C[:, s : s + chunk].transpose(1, 2)  # (b, nh, c, N)
        Acum = ac.cumsum(-1)
        y = ((Cc @ Bc.transpose(-1, -2)) * _segsum(ac).exp()) @ xc + Acum.exp()[..., None] * (Cc @ S)
        S = Acum[..., -1:, None].exp() * S + (Bc * (Acum[..., -1:] - Acum).exp()[..., None]).transpose(-1, -2) @ xc
        ys.append(y.transpose(1, 2))
    return torch.cat(ys, 1)


def _scan_parallel(xdt, a, B, C):
    L = _segsum(a.transpose(1, 2)).exp()  # (b, nh, t, t)
    scores = torch.einsum("bthn,bshn->bhts", C, B) * L
    return torch.einsum("bhts,bshp->bthp", scores, xdt)


def _conv_unfold(x, w, bias):
    K = w.shape[-1]
    return (F.pad(x, (0, 0, K - 1, 0)).unfold(1, K, 1) * w).sum(-1) + bias


# ----------------------------------------------------------------------------------------------------------------
# module-based port
# ----------------------------------------------------------------------------------------------------------------


class Mamba2Mixer(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        w_in, b_in = _get(sd, i, "mamba.in_proj.weight"), _get(sd, i, "mamba.in_proj.bias")
        conv_w, conv_b = _get(sd, i, "mamba.conv1d.weight")[:, 0], _get(sd, i, "mamba.conv1d.bias")
        w_out, b_out = _get(sd, i, "mamba.out_proj.weight"), _get(sd, i, "mamba.out_proj.bias")
        gn = _get(sd, i, "mamba.norm.weight") if c.gated_norm else None
        if v == "fh1_mup_folded":
            mup = c.mup_vector()
            w_in, b_in = w_in * mup[:, None] * c.ssm_in, b_in * mup
            w_out, b_out = w_out * c.ssm_out, b_out * c.ssm_out
        if v == "fh1_norm_folded":
            w_in = w_in * _get(sd, i, "input_layernorm.weight")
            if gn is not None:
                w_out, gn = w_out * gn, None
        if gn is not None:
            self.gnorm = nn.Parameter(gn.clone())
        self.neg_A = nn.Parameter(-_get(sd, i, "mamba.A_log").exp())
        self.D = nn.Parameter(_get(sd, i, "mamba.D").clone())
        self.dt_bias = nn.Parameter(_get(sd, i, "mamba.dt_bias").clone())
        if v == "fh1_split_projections":
            names = ["z_proj", "x_proj", "B_proj", "C_proj", "dt_proj"]
            for name, w, bb in zip(names, w_in.split(c.split, 0), b_in.split(c.split, 0)):
                lin = nn.Linear(c.H, w.shape[0])
                lin.weight.data.copy_(w)
                lin.bias.data.copy_(bb)
                setattr(self, name, lin)
            self.mup = list(c.ssm_mults)
            for name, w, bb in zip(
                ["conv_x", "conv_B", "conv_C"], conv_w.split(c.split[1:4]), conv_b.split(c.split[1:4])
            ):
                conv = nn.Conv1d(w.shape[0], w.shape[0], c.K, groups=w.shape[0], padding=c.K - 1)
                conv.weight.data.copy_(w[:, None])
                conv.bias.data.copy_(bb)
                setattr(self, name, conv)
            self.out_proj = nn.Linear(c.I, c.H)
            self.out_proj.weight.data.copy_(w_out)
            self.out_proj.bias.data.copy_(b_out)
        else:
            self.w_in = nn.Parameter(w_in.t().contiguous())
            self.b_in = nn.Parameter(b_in.clone())
            self.conv_w = nn.Parameter(conv_w.clone())
            self.conv_b = nn.Parameter(conv_b.clone())
            self.w_out = nn.Parameter(w_out.t().contiguous())
            self.b_out = nn.Parameter(b_out.clone())
            if v != "fh1_mup_folded":
                self.register_buffer("mup_vector", c.mup_vector(), persistent=False)

    def forward(self, x, mask):
        c, v = self.c, self.v
        b, t, _ = x.shape
        x = _pad_zero(x, mask)
        if v == "fh1_split_projections":
            x = x * c.ssm_in
            z = self.z_proj(x) * self.mup[0]
            parts = [self.x_proj(x) * self.mup[1], self.B_proj(x) * self.mup[2], self.C_proj(x) * self.mup[3]]
            dt = self.dt_proj(x) * self.mup[4]
            convs = (self.conv_x, self.conv_B, self.conv_C)
            xs, B, C = (F.silu(m(u.transpose(1, 2))[..., :t].transpose(1, 2)) for m, u in zip(convs, parts))
            xs, B, C = (_pad_zero(u, mask) for u in (xs, B, C))
        else:
            if v != "fh1_mup_folded":
                x = x * c.ssm_in
            proj = x @ self.w_in + self.b_in
            if v != "fh1_mup_folded":
                proj = proj * self.mup_vector
            z, xbc, dt = proj.split([c.I, c.I + 2 * c.G * c.N, c.nh], -1)
            if v == "fh1_sdpa_tables_maskpos":
                xbc = F.conv1d(
                    xbc.transpose(1, 2), self.conv_w[:, None], self.conv_b, padding=c.K - 1, groups=xbc.shape[-1]
                )
                xbc = xbc[..., :t].transpose(1, 2)
            else:
                xbc = _conv_unfold(xbc, self.conv_w, self.conv_b)
            xbc = _pad_zero(F.silu(xbc), mask)
            xs, B, C = xbc.split([c.I, c.G * c.N, c.G * c.N], -1)
        dt = F.softplus(dt + self.dt_bias).clamp(c.dt_min, c.dt_max)  # (b, t, nh)
        xs = xs.view(b, t, c.nh, c.p)
        a = dt * self.neg_A
        xdt = xs * dt[..., None]
        hpg = c.nh // c.G
        if v == "fh1_heads_einsum_meta_rope":
            xg = xdt.view(b, t, c.G, hpg, c.p)
            ag = a.view(b, t, c.G, hpg)
            Bg, Cg = B.view(b, t, c.G, c.N), C.view(b, t, c.G, c.N)
            S = xs.new_zeros(b, c.G, hpg, c.N, c.p)
            ys = []
            for i in range(t):
                S = S * ag[:, i].exp()[..., None, None] + Bg[:, i, :, None, :, None] * xg[:, i, :, :, None, :]
                ys.append(torch.einsum("bgn,bghnp->bghp", Cg[:, i], S))
            y = torch.stack(ys, 1).reshape(b, t, c.nh, c.p)
        else:
            Bh = B.view(b, t, c.G, c.N).repeat_interleave(hpg, 2)
            Ch = C.view(b, t, c.G, c.N).repeat_interleave(hpg, 2)
            if v == "fh1_chunked_ssd":
                y = _scan_chunked(xdt, a, Bh, Ch, 8)
            elif v == "fh1_parallel_ssd":
                y = _scan_parallel(xdt, a, Bh, Ch)
            else:
                y = _scan_recurrent(xdt, a, Bh, Ch)
        y = (y + xs * self.D[:, None]).reshape(b, t, c.I)
        y = _gated_norm(y, z, getattr(self, "gnorm", None), c)
        if v == "fh1_split_projections":
            out = self.out_proj(y)
        else:
            out = y @ self.w_out + self.b_out
        return out if v == "fh1_mup_folded" else out * c.ssm_out


def _gated_norm(y, z, w, c):
    if not c.gated_norm:
        return y * F.silu(z)
    b, t, _ = y.shape
    if not c.norm_before_gate:
        y = y * F.silu(z)
    y = _rms(y.view(b, t, c.G, -1), c.eps).view(b, t, -1)
    if w is not None:
        y = y * w
    if c.norm_before_gate:
        y = y * F.silu(z)
    return y


class Attention(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        d = c.d
        wq, bq = _get(sd, i, "self_attn.q_proj.weight"), _get(sd, i, "self_attn.q_proj.bias")
        wk, bk = _get(sd, i, "self_attn.k_proj.weight"), _get(sd, i, "self_attn.k_proj.bias")
        wv, bv = _get(sd, i, "self_attn.v_proj.weight"), _get(sd, i, "self_attn.v_proj.bias")
        wo, bo = _get(sd, i, "self_attn.o_proj.weight"), _get(sd, i, "self_attn.o_proj.bias")
        if v == "fh1_mup_folded":
            wq, wv = wq * c.attn_in, wv * c.attn_in
            wk, bk = wk * (c.attn_in * c.key_mult), bk * c.key_mult
            wo, bo = wo * c.attn_out, bo * c.attn_out
        if v == "fh1_norm_folded":
            g = _get(sd, i, "input_layernorm.weight")
            wq, wk, wv = wq * g, wk * g, wv * g
        if v == "fh1_heads_einsum_meta_rope":
            half = d // 2
            perm = torch.tensor([j for p in range(half) for j in (p, p + half)])
            self.wq = nn.Parameter(wq.view(c.nq, d, c.H)[:, perm].contiguous())
            self.bq = nn.Parameter(bq.view(c.nq, d)[:, perm].contiguous())
            self.wk = nn.Parameter(wk.view(c.nkv, d, c.H)[:, perm].contiguous())
            self.bk = nn.Parameter(bk.view(c.nkv, d)[:, perm].contiguous())
            self.wv = nn.Parameter(wv.view(c.nkv, d, c.H).clone())
            self.bv = nn.Parameter(bv.view(c.nkv, d).clone())
            self.wo = nn.Parameter(wo.view(c.H, c.nq, d).permute(1, 2, 0).contiguous())
            self.bo = nn.Parameter(bo.clone())
            freqs = torch.outer(torch.arange(c.maxpos, dtype=torch.float), c.inv_freq())
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        else:
            self.w_qkv = nn.Parameter(torch.cat([wq, wk, wv], 0).t().contiguous())
            self.b_qkv = nn.Parameter(torch.cat([bq, bk, bv], 0))
            self.w_o = nn.Parameter(wo.t().contiguous())
            self.b_o = nn.Parameter(bo.clone())
            if v == "fh1_sdpa_tables_maskpos":
                freqs = torch.outer(torch.arange(c.maxpos, dtype=torch.float), c.inv_freq())
                emb = torch.cat((freqs, freqs), -1)
                self.register_buffer("cos_cached", emb.cos(), persistent=False)
                self.register_buffer("sin_cached", emb.sin(), persistent=False)
            else:
                self.register_buffer("inv_freq", c.inv_freq(), persistent=False)

    def forward(self, x, pos, keep):
        c, v, d = self.c, self.v, self.c.d
        b, t, _ = x.shape
        folded = v == "fh1_mup_folded"
        if not folded:
            x = x * c.attn_in
        rep = c.nq // c.nkv
        if v == "fh1_heads_einsum_meta_rope":
            q = torch.einsum("bth,ndh->bntd", x, self.wq) + self.bq[:, None]
            k = (torch.einsum("bth,ndh->bntd", x, self.wk) + self.bk[:, None]) * c.key_mult
            val = torch.einsum("bth,ndh->bntd", x, self.wv) + self.bv[:, None]
            fc = self.freqs_cis[pos][:, None]

            def rot(u):
                uc = torch.view_as_complex(u.reshape(*u.shape[:-1], d // 2, 2).contiguous())
                return torch.view_as_real(uc * fc).flatten(-2)

            q, k = rot(q), rot(k)
            k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
            s = torch.einsum("bnqd,bnkd->bnqk", q, k) / math.sqrt(d)
            p = s.masked_fill(~keep, float("-inf")).softmax(-1)
            out = torch.einsum("bntd,ndh->bth", torch.einsum("bnqk,bnkd->bnqd", p, val), self.wo) + self.bo
            return out * c.attn_out
        q, k, val = (x @ self.w_qkv + self.b_qkv).split([c.nq * d, c.nkv * d, c.nkv * d], -1)
        q = q.view(b, t, c.nq, d).transpose(1, 2)
        k = k.view(b, t, c.nkv, d).transpose(1, 2)
        val = val.view(b, t, c.nkv, d).transpose(1, 2)
        if not folded:
            k = k * c.key_mult
        if v == "fh1_sdpa_tables_maskpos":
            cos, sin = self.cos_cached[pos], self.sin_cached[pos]
        else:
            freqs = pos[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos(), emb.sin()
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if v == "fh1_sdpa_tables_maskpos":
            o = F.scaled_dot_product_attention(q, k, val, attn_mask=keep, enable_gqa=True)
        else:
            k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
            s = (q @ k.transpose(-1, -2)) * d**-0.5
            s = s + torch.zeros_like(s).masked_fill(~keep, torch.finfo(s.dtype).min)
            o = s.softmax(-1) @ val
        out = o.transpose(1, 2).reshape(b, t, -1) @ self.w_o + self.b_o
        return out if folded else out * c.attn_out


class MLP(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        wg, bg = _get(sd, i, "feed_forward.gate_proj.weight"), _get(sd, i, "feed_forward.gate_proj.bias")
        wu, bu = _get(sd, i, "feed_forward.up_proj.weight"), _get(sd, i, "feed_forward.up_proj.bias")
        wd, bd = _get(sd, i, "feed_forward.down_proj.weight"), _get(sd, i, "feed_forward.down_proj.bias")
        if v == "fh1_mup_folded":
            wg, bg = wg * c.gate_mult, bg * c.gate_mult
            wd, bd = wd * c.down_mult, bd * c.down_mult
        if v == "fh1_norm_folded":
            g = _get(sd, i, "pre_ff_layernorm.weight")
            wg, wu = wg * g, wu * g
        self.w_gate_up = nn.Parameter(torch.cat([wg, wu], 0).t().contiguous())
        self.b_gate_up = nn.Parameter(torch.cat([bg, bu], 0))
        self.w_down = nn.Parameter(wd.t().contiguous())
        self.b_down = nn.Parameter(bd.clone())

    def forward(self, x):
        c = self.c
        g, u = (x @ self.w_gate_up + self.b_gate_up).chunk(2, -1)
        if self.v == "fh1_mup_folded":
            return (u * F.silu(g)) @ self.w_down + self.b_down
        return ((u * F.silu(g * c.gate_mult)) @ self.w_down + self.b_down) * c.down_mult


class HybridLayer(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        self.ssm = Mamba2Mixer(sd, i, c, v)
        self.attn = Attention(sd, i, c, v)
        self.mlp = MLP(sd, i, c, v)
        if v != "fh1_norm_folded":
            self.norm_in = nn.Parameter(_get(sd, i, "input_layernorm.weight").clone())
            self.norm_ff = nn.Parameter(_get(sd, i, "pre_ff_layernorm.weight").clone())

    def forward(self, h, pos, keep, mask):
        c = self.c
        folded = self.v == "fh1_norm_folded"
        x = _rms(h, c.eps) if folded else _rms(h, c.eps) * self.norm_in
        h = h + self.ssm(x, mask) + self.attn(x, pos, keep)
        x = _rms(h, c.eps) if folded else _rms(h, c.eps) * self.norm_ff
        return h + self.mlp(x)


class FalconH1Port(nn.Module):
    def __init__(self, sd, config, v):
        super().__init__()
        c = self.c = _Cfg(config)
        self.v = v
        emb = sd["model.embed_tokens.weight"].float()
        head = sd["lm_head.weight"].float()
        gf = sd["model.final_layernorm.weight"].float()
        if v == "fh1_mup_folded":
            emb, head = emb * c.emb_mult, head * c.head_mult
        if v == "fh1_norm_folded":
            head = head * gf
        else:
            self.final_norm = nn.Parameter(gf.clone())
        self.embed = nn.Parameter(emb.clone())
        self.layers = nn.ModuleList([HybridLayer(sd, i, c, v) for i in range(c.L)])
        self.head_t = nn.Parameter(head.t().contiguous())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c, v = self.c, self.v
        b, t = input_ids.shape
        pos = _positions(input_ids, attention_mask, position_ids, from_mask=v == "fh1_sdpa_tables_maskpos")
        keep = _keep_mask(attention_mask, b, t, input_ids.device)
        h = self.embed[input_ids]
        if v != "fh1_mup_folded":
            h = h * c.emb_mult
        for layer in self.layers:
            h = layer(h, pos, keep, attention_mask)
        h = _rms(h, c.eps)
        if v != "fh1_norm_folded":
            h = h * self.final_norm
        logits = h @ self.head_t
        return (logits if v == "fh1_mup_folded" else logits * c.head_mult).float()


# ----------------------------------------------------------------------------------------------------------------
# functional port: plain dict of (n_layers, ...) stacked tensors
# ----------------------------------------------------------------------------------------------------------------


def _functional_params(sd, c):
    def stack(name):
        return torch.stack([_get(sd, i, name) for i in range(c.L)]).contiguous()

    p = {"tok_embeddings": sd["model.embed_tokens.weight"].float(), "norm": sd["model.final_layernorm.weight"].float()}
    for mine, theirs in {
        "attention_norm": "input_layernorm.weight",
        "ffn_norm": "pre_ff_layernorm.weight",
        "ssm.in_w": "mamba.in_proj.weight",
        "ssm.in_b": "mamba.in_proj.bias",
        "ssm.out_w": "mamba.out_proj.weight",
        "ssm.out_b": "mamba.out_proj.bias",
        "ssm.A_log": "mamba.A_log",
        "ssm.D": "mamba.D",
        "ssm.dt_bias": "mamba.dt_bias",
        "attn.wq": "self_attn.q_proj.weight",
        "attn.bq": "self_attn.q_proj.bias",
        "attn.wk": "self_attn.k_proj.weight",
        "attn.bk": "self_attn.k_proj.bias",
        "attn.wv": "self_attn.v_proj.weight",
        "attn.bv": "self_attn.v_proj.bias",
        "attn.wo": "self_attn.o_proj.weight",
        "attn.bo": "self_attn.o_proj.bias",
        "ffn.w1": "feed_forward.gate_proj.weight",
        "ffn.b1": "feed_forward.gate_proj.bias",
        "ffn.w3": "feed_forward.up_proj.weight",
        "ffn.b3": "feed_forward.up_proj.bias",
        "ffn.w2": "feed_forward.down_proj.weight",
        "ffn.b2": "feed_forward.down_proj.bias",
    }.items():
        p[mine] = stack(theirs)
    p["ssm.conv_w"] = stack("mamba.conv1d.weight")  # (L, C, 1, K)
    p["ssm.conv_b"] = stack("mamba.conv1d.bias")
    if c.gated_norm:
        p["ssm.norm"] = stack("mamba.norm.weight")
    p["ssm.mup"] = c.mup_vector()
    p["inv_freq"] = c.inv_freq()
    return p


def _functional_backbone(p, c, input_ids, attention_mask, position_ids):
    b, t = input_ids.shape
    d = c.d
    pos = _positions(input_ids, attention_mask, position_ids)
    keep = _keep_mask(attention_mask, b, t, input_ids.device)
    freqs = pos[..., None].float() * p["inv_freq"]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    hpg = c.nh // c.G
    h = F.embedding(input_ids, p["tok_embeddings"]) * c.emb_mult
    for i in range(c.L):
        x = _rms(h, c.eps) * p["attention_norm"][i]
        # mamba-2
        u = _pad_zero(x, attention_mask) * c.ssm_in
        proj = F.linear(u, p["ssm.in_w"][i], p["ssm.in_b"][i]) * p["ssm.mup"]
        z, xbc, dt = proj.split([c.I, c.I + 2 * c.G * c.N, c.nh], -1)
        xbc = F.conv1d(
            xbc.transpose(1, 2), p["ssm.conv_w"][i], p["ssm.conv_b"][i], padding=c.K - 1, groups=xbc.shape[-1]
        )
        xbc = _pad_zero(F.silu(xbc[..., :t].transpose(1, 2)), attention_mask)
        xs, B, C = xbc.split([c.I, c.G * c.N, c.G * c.N], -1)
        dt = F.softplus(dt + p["ssm.dt_bias"][i]).clamp(c.dt_min, c.dt_max)
        xs = xs.view(b, t, c.nh, c.p)
        y = _scan_recurrent(
            xs * dt[..., None],
            dt * -p["ssm.A_log"][i].exp(),
            B.view(b, t, c.G, c.N).repeat_interleave(hpg, 2),
            C.view(b, t, c.G, c.N).repeat_interleave(hpg, 2),
        )
        y = (y + xs * p["ssm.D"][i][:, None]).reshape(b, t, c.I)
        y = _gated_norm(y, z, p["ssm.norm"][i] if c.gated_norm else None, c)
        m = F.linear(y, p["ssm.out_w"][i], p["ssm.out_b"][i]) * c.ssm_out
        # attention
        xa = x * c.attn_in
        q = F.linear(xa, p["attn.wq"][i], p["attn.bq"][i]).view(b, t, c.nq, d).transpose(1, 2)
        k = F.linear(xa, p["attn.wk"][i], p["attn.bk"][i]).view(b, t, c.nkv, d).transpose(1, 2) * c.key_mult
        val = F.linear(xa, p["attn.wv"][i], p["attn.bv"][i]).view(b, t, c.nkv, d).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = c.nq // c.nkv
        k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
        att = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~keep, float("-inf")).softmax(-1)
        o = (att @ val).transpose(1, 2).reshape(b, t, -1)
        a = F.linear(o, p["attn.wo"][i], p["attn.bo"][i]) * c.attn_out
        h = h + m + a
        x = _rms(h, c.eps) * p["ffn_norm"][i]
        g = F.linear(x, p["ffn.w1"][i], p["ffn.b1"][i]) * c.gate_mult
        hdn = F.linear(x, p["ffn.w3"][i], p["ffn.b3"][i]) * F.silu(g)
        h = h + F.linear(hdn, p["ffn.w2"][i], p["ffn.b2"][i]) * c.down_mult
    return _rms(h, c.eps) * p["norm"]


class LMHead(nn.Module):
    def __init__(self, w, mult):
        super().__init__()
        self.output = nn.Parameter(w.clone())
        self.mult = mult

    def forward(self, h):
        return F.linear(h, self.output) * self.mult


class FunctionalPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.c = _Cfg(config)
        self.weights = _functional_params(sd, self.c)
        self.head = LMHead(sd["lm_head.weight"].float(), self.c.head_mult)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = _functional_backbone(self.weights, self.c, input_ids, attention_mask, position_ids)
        return self.head(h).float()


def build(state_dict, config):
    v = BUG
    with torch.no_grad():
        model = (
            FunctionalPort(state_dict, config) if v == "fh1_functional_stacked" else FalconH1Port(state_dict, config, v)
        )
    return model.eval()
