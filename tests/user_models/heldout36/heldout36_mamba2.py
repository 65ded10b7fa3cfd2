"""Hand-written plain-PyTorch port of Mamba-2 (Mamba2ForCausalLM): an attention-free stack of SSD mixers.

Architecture as this port implements it (all float32):
- h = E[ids] (no scaling).  Position ids are accepted and ignored (the model has no positions).
- block i, pre-norm:  h = h + Mixer(RMS(h) * g_i)  with RMS(v) = v / sqrt(mean(v^2) + eps), eps =
  config.layer_norm_epsilon (the residual is the un-normed h).
- Mixer(u), u of width H, I = expand * H = nh * P (nh heads of P channels), G groups of B/C, N state size:
    u <- u * mask                                          (padding positions zeroed; skipped without a mask)
    [z | xBC | dt_raw] = u W_in^T + b_in                   widths I | I + 2 G N | nh
    xBC <- silu(causal depthwise conv1d(xBC, kernel K, taps over t-K+1..t) + b_conv)
    xBC <- xBC * mask
    [x | B | C] = xBC                                      widths I | G N | G N; head h reads group h // (nh / G)
    dt = clamp(softplus(dt_raw + dt_bias), lo, hi)         (lo, hi) = config.time_step_limit
    A = -exp(A_log)                                        (one scalar per head)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T              (per head, S of shape (P, N), S_0 = 0)
    y_t = S_t C_t + D x_t                                  (the D skip uses the raw, un-discretised x)
    y <- GroupRMS(y * silu(z)) * g_mix                      (gate BEFORE the norm; RMS over each of the G groups
                                                            of I / G channels, eps = config.layer_norm_epsilon)
    out = y W_out^T + b_out
  The biases of in_proj / out_proj exist when config.use_bias, the conv bias when config.use_conv_bias.
- logits = RMS(h) * g_f  W_head^T  (untied head unless config.tie_word_embeddings).
- The baseline scan is the sequential recurrence above; the CLEAN variants compute the same thing as a
  chunked SSD (chunks of 8), as one quadratic "attention-like" SSD, with the conv as a sum of shifted copies,
  with one fused input projection, or with the pre-norm weights folded into the following projections.

Weight layout of this port (own names, converted in `build`):
- tok_emb (V, H); head_w (V, H) (the embedding itself when tied); final_norm.scale (H,).
- blocks[i].prenorm.scale (H,)
- blocks[i].mix.proj: wz_t (H, I) = the z rows of in_proj, transposed; wxbc (I + 2GN, H); wdt (nh, H);
  bz / bxbc / bdt the matching slices of in_proj.bias (zeros without a bias): in_proj is split at load.
- blocks[i].mix.conv: taps (K, C) = conv1d.weight[:, 0, :] transposed (tap 0 = oldest token); bias (C,).
- blocks[i].mix.heads (3, nh): rows [dt_bias, A = -exp(A_log) (precomputed at load), D].
- blocks[i].mix.gnorm.scale (I,)
- blocks[i].mix.out: w_t (I, H) = out_proj.weight transposed; b (H,).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "norm_is_layernorm",  # the shared pre-norm (blocks and final) subtracts the mean (LayerNorm) instead of RMSNorm
    "inproj_split_xbc_first",  # fused in_proj split at load as [xBC | z | dt] instead of [z | xBC | dt]
    "conv_trim_wrong_end",  # conv padded by K-1 on the left but the LAST L outputs kept: reads x[t..t+K-1] (future)
    "conv_taps_reversed",  # conv weight converted to (K, C) with the tap order flipped (newest tap on oldest token)
    "a_log_exp_missing",  # A precomputed at load as -A_log instead of -exp(A_log)
    "dt_bias_after_softplus",  # dt = softplus(dt_raw) + dt_bias instead of softplus(dt_raw + dt_bias)
    "bc_groups_tiled",  # B/C groups expanded to heads with repeat (head h -> group h % G) not repeat_interleave
    "d_skip_discretized",  # the D skip added as D * (dt * x) (the discretised input) instead of D * x
    "gate_after_norm",  # gated norm as GroupRMS(y) * silu(z) (norm_before_gate=True) instead of GroupRMS(y * silu(z))
    "gated_norm_ungrouped",  # gated RMSNorm over all I channels at once instead of per group of I / n_groups
    "out_proj_bias_dropped",  # use_bias applied to in_proj only: out_proj's bias never loaded (zero)
    "residual_from_normed",  # the residual added to the block's normed input instead of its raw input
    "head_tied",  # logits from the embedding matrix although tie_word_embeddings is False (lm_head ignored)
    "pad_mask_post_conv_skipped",  # padding mask applied to the mixer input only, not to xBC after the conv
]
PADDING_ONLY = {"pad_mask_post_conv_skipped"}
CLEAN = [
    "ssd_chunked",  # SSD in chunks of 8: quadratic form inside a chunk, a carried (P, N) state between chunks
    "ssd_quadratic",  # one quadratic SSD over the whole sequence: y = (C B^T o exp(segsum(dt A))) (dt x)
    "conv_shift_sum",  # causal conv as an explicit sum of K shifted, tap-weighted copies instead of F.conv1d
    "fused_in_proj",  # the split in_proj weights re-fused into one matmul, then split (z, xBC, dt)
    "norm_weight_folded",  # pre-norm weights folded into in_proj / head at load (W * g), the norms left unweighted
]


class RMS(nn.Module):
    def __init__(self, scale, eps):
        super().__init__()
        self.scale = nn.Parameter(scale.clone().float())
        self.eps = eps

    def forward(self, v):
        if BUG == "norm_is_layernorm":
            v = v - v.mean(-1, keepdim=True)
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class GatedGroupRMS(nn.Module):
    def __init__(self, scale, groups, eps):
        super().__init__()
        self.scale = nn.Parameter(scale.clone().float())
        self.groups = groups
        self.eps = eps

    def forward(self, y, z):
        groups = 1 if BUG == "gated_norm_ungrouped" else self.groups
        if BUG != "gate_after_norm":
            y = y * F.silu(z)
        *lead, width = y.shape
        g = y.reshape(*lead, groups, width // groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        y = g.reshape(*lead, width)
        if BUG == "gate_after_norm":
            y = y * F.silu(z)
        return y * self.scale


class InProj(nn.Module):
    def __init__(self, weight, bias, sizes):
        super().__init__()
        wz, wxbc, wdt = _split_zxbcdt(weight, sizes)
        bz, bxbc, bdt = _split_zxbcdt(bias, sizes)
        self.wz_t = nn.Parameter(wz.t().contiguous())
        self.wxbc = nn.Parameter(wxbc.contiguous())
        self.wdt = nn.Parameter(wdt.contiguous())
        self.bz = nn.Parameter(bz.clone())
        self.bxbc = nn.Parameter(bxbc.clone())
        self.bdt = nn.Parameter(bdt.clone())
        self.sizes = sizes

    def forward(self, u):
        if BUG == "fused_in_proj":
            w = torch.cat([self.wz_t.t(), self.wxbc, self.wdt], 0)
            b = torch.cat([self.bz, self.bxbc, self.bdt], 0)
            return F.linear(u, w, b).split(list(self.sizes), -1)
        return u @ self.wz_t + self.bz, F.linear(u, self.wxbc, self.bxbc), F.linear(u, self.wdt, self.bdt)


def _split_zxbcdt(t, sizes):
    """in_proj rows (or bias entries) split into z, xBC, dt."""
    i, c, nh = sizes
    if BUG == "inproj_split_xbc_first":
        xbc, z, dt = t.split([c, i, nh], 0)
        return z, xbc, dt
    return t.split([i, c, nh], 0)


class CausalConv(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        taps = weight[:, 0, :].t()  # (K, C), tap 0 multiplies the oldest token of the window
        if BUG == "conv_taps_reversed":
            taps = taps.flip(0)
        self.taps = nn.Parameter(taps.contiguous().float())
        self.bias = nn.Parameter(bias.clone().float())

    def forward(self, v):  # v (b, L, C)
        k, length = self.taps.shape[0], v.shape[1]
        if BUG == "conv_shift_sum":
            padded = F.pad(v, (0, 0, k - 1, 0))
            out = sum(padded[:, j : j + length] * self.taps[j] for j in range(k))
            return F.silu(out + self.bias)
        out = F.conv1d(v.transpose(1, 2), self.taps.t()[:, None, :], self.bias, padding=k - 1, groups=v.shape[-1])
        out = out[..., -length:] if BUG == "conv_trim_wrong_end" else out[..., :length]
        return F.silu(out.transpose(1, 2))


class OutProj(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.w_t = nn.Parameter(weight.t().contiguous().float())
        self.b = nn.Parameter(bias.clone().float())

    def forward(self, y):
        return y @ self.w_t + self.b


def _segsum(a):
    """a (..., L) -> (..., L, L): [t, s] = a[s+1] + ... + a[t] for s <= t, -inf above the diagonal."""
    length = a.shape[-1]
    x = a[..., None].expand(*a.shape, length)  # [..., t, s] = a[t]
    x = x.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool), -1), 0.0)
    x = torch.cumsum(x, -2)
    return x.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool)), -math.inf)


def _scan_sequential(x, dt, a, b, c):
    """x (b, L, h, p), dt (b, L, h), a (h,), b / c (b, L, h, n) -> y (b, L, h, p) (no D)."""
    state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], b.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * a)[..., None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]))
    return torch.stack(ys, 1)


def _scan_quadratic(x, dt, a, b, c):
    decay = torch.exp(_segsum((dt * a).transpose(1, 2)))  # (b, h, t, s)
    scores = torch.einsum("bthn,bshn->bhts", c, b) * decay
    return torch.einsum("bhts,bshp->bthp", scores, x * dt[..., None])


def _scan_chunked(x, dt, a, b, c, q=8):
    bsz, length, heads, p = x.shape
    state = x.new_zeros(bsz, heads, p, b.shape[-1])
    ys = []
    for s0 in range(0, length, q):
        xs, dts, bs, cs = x[:, s0 : s0 + q], dt[:, s0 : s0 + q], b[:, s0 : s0 + q], c[:, s0 : s0 + q]
        la = (dts * a).transpose(1, 2)  # (b, h, l)
        cum = torch.cumsum(la, -1)
        y = _scan_quadratic(xs, dts, a, bs, cs)
        y = y + torch.einsum("blhn,bhpn->blhp", cs, state) * torch.exp(cum).transpose(1, 2)[..., None]
        w = torch.exp(cum[..., -1:] - cum).transpose(1, 2)  # (b, l, h): decay from each step to the chunk end
        state = state * torch.exp(cum[..., -1])[..., None, None] + torch.einsum(
            "blhn,blhp->bhpn", bs * w[..., None], xs * dts[..., None]
        )
        ys.append(y)
    return torch.cat(ys, 1)


class Mixer(nn.Module):
    def __init__(self, sd, p, config):
        super().__init__()
        self.nh, self.hd = config.num_heads, config.head_dim
        self.inter = config.num_heads * config.head_dim
        self.groups, self.n = config.n_groups, config.state_size
        conv_dim = self.inter + 2 * self.groups * self.n
        sizes = (self.inter, conv_dim, self.nh)
        w_in = sd[p + "in_proj.weight"].float()
        b_in = sd.get(p + "in_proj.bias")
        b_in = torch.zeros(w_in.shape[0]) if b_in is None else b_in.float()
        self.proj = InProj(w_in, b_in, sizes)
        b_conv = sd.get(p + "conv1d.bias")
        self.conv = CausalConv(sd[p + "conv1d.weight"].float(), torch.zeros(conv_dim) if b_conv is None else b_conv)
        a_log = sd[p + "A_log"].float()
        a = -a_log if BUG == "a_log_exp_missing" else -torch.exp(a_log)
        self.heads = nn.Parameter(torch.stack([sd[p + "dt_bias"].float(), a, sd[p + "D"].float()]))
        self.gnorm = GatedGroupRMS(sd[p + "norm.weight"], self.groups, config.layer_norm_epsilon)
        b_out = sd.get(p + "out_proj.bias")
        w_out = sd[p + "out_proj.weight"].float()
        if b_out is None or BUG == "out_proj_bias_dropped":
            b_out = torch.zeros(w_out.shape[0])
        self.out = OutProj(w_out, b_out)
        self.dt_lo, self.dt_hi = (float(v) for v in config.time_step_limit)

    def forward(self, u, mask):
        bsz, length, _ = u.shape
        if mask is not None:
            u = u * mask[..., None]
        z, xbc, dt_raw = self.proj(u)
        xbc = self.conv(xbc)
        if mask is not None and BUG != "pad_mask_post_conv_skipped":
            xbc = xbc * mask[..., None]
        x, b, c = xbc.split([self.inter, self.groups * self.n, self.groups * self.n], -1)
        dt_bias, a, d = self.heads
        if BUG == "dt_bias_after_softplus":
            dt = F.softplus(dt_raw) + dt_bias
        else:
            dt = F.softplus(dt_raw + dt_bias)
        dt = dt.clamp(self.dt_lo, self.dt_hi)
        x = x.reshape(bsz, length, self.nh, self.hd)
        b = b.reshape(bsz, length, self.groups, self.n)
        c = c.reshape(bsz, length, self.groups, self.n)
        rep = self.nh // self.groups
        if BUG == "bc_groups_tiled":
            b, c = b.repeat(1, 1, rep, 1), c.repeat(1, 1, rep, 1)
        else:
            b, c = b.repeat_interleave(rep, 2), c.repeat_interleave(rep, 2)
        scan = {"ssd_chunked": _scan_chunked, "ssd_quadratic": _scan_quadratic}.get(BUG, _scan_sequential)
        y = scan(x, dt, a, b, c)
        skip_in = x * dt[..., None] if BUG == "d_skip_discretized" else x
        y = y + d[:, None] * skip_in
        y = self.gnorm(y.reshape(bsz, length, self.inter), z)
        return self.out(y)


class Block(nn.Module):
    def __init__(self, sd, p, config):
        super().__init__()
        self.prenorm = RMS(sd[p + "norm.weight"], config.layer_norm_epsilon)
        self.mix = Mixer(sd, p + "mixer.", config)

    def forward(self, h, mask):
        normed = self.prenorm(h)
        out = self.mix(normed, mask)
        return (normed if BUG == "residual_from_normed" else h) + out


class Mamba2Port(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.tok_emb = nn.Parameter(sd["backbone.embeddings.weight"].float().clone())
        self.blocks = nn.ModuleList(Block(sd, f"backbone.layers.{i}.", config) for i in range(config.num_hidden_layers))
        self.final_norm = RMS(sd["backbone.norm_f.weight"], config.layer_norm_epsilon)
        tied = config.tie_word_embeddings or "lm_head.weight" not in sd or BUG == "head_tied"
        self.head_w = nn.Parameter((self.tok_emb.data if tied else sd["lm_head.weight"].float()).clone())
        if BUG == "norm_weight_folded":
            self._fold_norm_weights()

    @torch.no_grad()
    def _fold_norm_weights(self):
        for blk in self.blocks:
            g = blk.prenorm.scale.data.clone()
            blk.mix.proj.wz_t.mul_(g[:, None])
            blk.mix.proj.wxbc.mul_(g)
            blk.mix.proj.wdt.mul_(g)
            blk.prenorm.scale.fill_(1.0)
        self.head_w.mul_(self.final_norm.scale.data)
        self.final_norm.scale.fill_(1.0)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        mask = None
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            mask = attention_mask.to(torch.float32)
        h = F.embedding(input_ids, self.tok_emb)
        for blk in self.blocks:
            h = blk(h, mask)
        return F.linear(self.final_norm(h), self.head_w)


def build(state_dict, config):
    return Mamba2Port(state_dict, config).eval()
