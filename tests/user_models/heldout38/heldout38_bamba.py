"""Hand-written plain-PyTorch port of IBM's Bamba (BambaForCausalLM): a hybrid of Mamba-2 mixers and
full-attention layers, each followed by a SwiGLU MLP.

Architecture as this port implements it (all float32):
- token embedding (no scaling); untied head; final RMSNorm (eps = config.rms_norm_eps) before the head.
- RMSNorm(x) = w * (x * rsqrt(mean(x**2) + eps)), weight applied after the normalisation.
- layer i, pre-norm, its kind from config.attn_layer_indices (listed: attention, else Mamba-2 mixer):
      h = h + Mixer_or_Attn(RMSNorm_1(h));  h = h + MLP(RMSNorm_2(h))
- MLP: down(silu(gate(x) + b_g) * (up(x) + b_u)) + b_d  (biases when config.mlp_bias).
- Mamba-2 mixer (I = expand * H channels, nh heads of hd = I / nh, G groups of B/C, N state size, K taps):
      x <- x * mask                              (padding positions zeroed, only when a 2-D mask is given)
      [z | xBC | dt] = in_proj(x)                (widths I, I + 2 G N, nh; bias when config.mamba_proj_bias)
      xBC <- silu(causal depthwise conv(xBC) + conv_bias)   (K - 1 zeros on the left)
      xBC <- xBC * mask                          (padding zeroed again after the conv)
      [x | B | C] = xBC                          (widths I, G N, G N); head h reads group h // (nh / G)
      dt <- clamp(softplus(dt + dt_bias), time_step_limit[0], time_step_limit[1])
      A = -exp(A_log) (per head)
      state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T        (state (hd, N) per head, zero at t = -1)
      y_t = state_t C_t + D x_t                                  (D skip on the un-discretised x)
      y <- w_n * GroupRMSNorm(y * silu(z))       (gate BEFORE the norm, RMS per group of I / G channels,
                                                  eps = config.rms_norm_eps)
      out = out_proj(y)
- attention (GQA, eager): q, k, v projections (bias when config.attention_bias); partial RoPE (Bamba forces
  partial_rotary_factor 0.5) on the first rd = head_dim / 2 channels of each head, NeoX rotate-half style,
  inv_freq = theta ** (-arange(0, rd, 2) / rd), angle = position * inv_freq; the other channels pass through;
  scores = q k^T * head_dim ** -0.5 + causal/padding mask (dtype min), softmax, @ v, o_proj.
  Positions: position_ids if given, else 0..L-1.
Weight layout of this port (own names):
- tok (V, H); out_norm (H,); head_t (H, V) = lm_head transposed.
- every block `blocks[i]`: norms (2, H) stacked [pre-mixer; pre-MLP]; w_gu (H, 2F) = [gate | up] fused and
  transposed, b_gu (2F,); w_dn (F, H) transposed, b_dn (H,).
- Mamba block: in_proj split at load into w_z (H, I), w_xbc (H, I + 2GN), w_dt (H, nh) (transposed) with
  b_z / b_xbc / b_dt; taps (K, I + 2GN) = conv weight transposed, tap_b; ssm ParameterDict
  {A = -exp(A_log) (precomputed), D, dt_bias}; gnorm (I,); w_out (I, H) transposed, b_out.
- attention block: w_qkv (H, (nq + 2 nkv) hd) = [q | k | v] fused and transposed, b_qkv; w_o (nq hd, H), b_o.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "a_log_no_exp",  # A converted at load as -A_log: the exp of A_log is missing
    "dt_softplus_missing",  # dt = dt_proj + dt_bias used raw (then clamped): no softplus
    "dt_limit_ignored",  # config.time_step_limit never read: dt is not clamped to [0.2, 1.5]
    "xbc_bc_swapped",  # conv output split as [x | C | B] instead of [x | B | C]
    "conv_tail_slice",  # conv padded K - 1 on both sides and the LAST L outputs kept: output t reads x[t..t+K-1]
    "norm_before_gate",  # gated RMSNorm normalises y first and multiplies by silu(z) after (norm_before_gate=True)
    "gated_norm_ungrouped",  # gated RMSNorm takes one RMS over all I channels instead of one per B/C group
    "bc_groups_tiled",  # head h reads B/C group h % G (tiled) instead of h // (nh / G) (repeat_interleave)
    "d_skip_after_dt",  # D skip added on the discretised input D * dt * x instead of D * x
    "ssm_input_decayed",  # state update order: state_t = exp(dt A) (state_{t-1} + dt x B^T): new input decayed too
    "rope_full_dim",  # partial_rotary_factor ignored: RoPE over the whole head_dim (inv_freq over head_dim)
    "attn_scale_rotary_dim",  # attention scale rotary_dim ** -0.5 (the rotated width) instead of head_dim ** -0.5
    "residual_after_norm",  # mixer residual taken after input norm: h = RMSNorm_1(h) + mixer(RMSNorm_1(h))
    "mamba_mask_after_conv_skipped",  # padding zeroed before in_proj only, not after the conv (bias leaks in state)
]
PADDING_ONLY = ["mamba_mask_after_conv_skipped"]
CLEAN = [
    "ssd_chunked",  # SSD chunked scan (config.mamba_chunk_size): intra-chunk quadratic form plus a carried state
    "ssd_quadratic",  # whole sequence as one masked "attention": y = (exp(segsum(dt A)) * C B^T) (dt x) + D x
    "conv_shift_sum",  # depthwise causal conv as a sum of K shifted, tap-weighted copies instead of F.conv1d
    "rope_complex",  # RoPE as a complex product of (x_i + i x_{i + rd/2}) with e^{i angle}
    "attn_sdpa",  # attention through F.scaled_dot_product_attention with the same additive mask
]


def _lin(x, w_t, b):
    y = x @ w_t
    return y if b is None else y + b


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _vec(sd, name):
    t = sd.get(name)
    return None if t is None else t.detach().clone().float()


def _param(t):
    return None if t is None else nn.Parameter(t.contiguous(), requires_grad=False)


def _decoder_layer(blk, h, mix):
    """Shared by both layer kinds: pre-norm residual around the mixer / attention, then around the MLP."""
    hn = _rms(h, blk.norms[0], blk.eps)
    h = (hn if BUG == "residual_after_norm" else h) + mix(hn)
    return h + blk.mlp(_rms(h, blk.norms[1], blk.eps))


class MLP(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        g, u = sd[p + "gate_proj.weight"].float(), sd[p + "up_proj.weight"].float()
        self.ffn = g.shape[0]
        self.w_gu = _param(torch.cat([g, u], 0).t())
        bg, bu = _vec(sd, p + "gate_proj.bias"), _vec(sd, p + "up_proj.bias")
        self.b_gu = _param(None if bg is None else torch.cat([bg, bu]))
        self.w_dn = _param(sd[p + "down_proj.weight"].float().t())
        self.b_dn = _param(_vec(sd, p + "down_proj.bias"))

    def forward(self, x):
        gu = _lin(x, self.w_gu, self.b_gu)
        g, u = gu.split(self.ffn, dim=-1)
        return _lin(F.silu(g) * u, self.w_dn, self.b_dn)


class MambaBlock(nn.Module):
    def __init__(self, sd, i, cfg):
        super().__init__()
        p = f"model.layers.{i}."
        m = p + "mamba."
        self.eps = cfg.rms_norm_eps
        self.nh = cfg.mamba_n_heads
        self.hd = cfg.mamba_d_head
        self.groups = cfg.mamba_n_groups
        self.N = cfg.mamba_d_state
        self.inner = int(cfg.mamba_expand * cfg.hidden_size)
        self.chunk = cfg.mamba_chunk_size
        lim = cfg.time_step_limit
        self.dt_lo, self.dt_hi = (0.0, float("inf")) if lim is None else (float(lim[0]), float(lim[1]))
        self.norms = _param(torch.stack([sd[p + "input_layernorm.weight"], sd[p + "pre_ff_layernorm.weight"]]).float())
        conv_dim = self.inner + 2 * self.groups * self.N
        w_in = sd[m + "in_proj.weight"].float()
        b_in = _vec(sd, m + "in_proj.bias")
        widths = [self.inner, conv_dim, self.nh]
        wz, wxbc, wdt = w_in.split(widths, 0)
        self.w_z, self.w_xbc, self.w_dt = _param(wz.t()), _param(wxbc.t()), _param(wdt.t())
        if b_in is None:
            self.b_z = self.b_xbc = self.b_dt = None
        else:
            bz, bxbc, bdt = b_in.split(widths)
            self.b_z, self.b_xbc, self.b_dt = _param(bz), _param(bxbc), _param(bdt)
        self.taps = _param(sd[m + "conv1d.weight"].float()[:, 0, :].t())  # (K, conv_dim)
        self.tap_b = _param(_vec(sd, m + "conv1d.bias"))
        a_log = sd[m + "A_log"].float()
        A = -a_log if BUG == "a_log_no_exp" else -torch.exp(a_log)
        self.ssm = nn.ParameterDict(
            {"A": _param(A), "D": _param(_vec(sd, m + "D")), "dt_bias": _param(_vec(sd, m + "dt_bias"))}
        )
        self.gnorm = _param(_vec(sd, m + "norm.weight"))
        self.w_out = _param(sd[m + "out_proj.weight"].float().t())
        self.b_out = _param(_vec(sd, m + "out_proj.bias"))
        self.mlp = MLP(sd, p + "feed_forward.")

    # --- pieces -------------------------------------------------------------------------------------------
    def conv(self, xbc):
        L = xbc.shape[1]
        K, C = self.taps.shape
        if BUG == "conv_tail_slice":
            w = self.taps.t().unsqueeze(1)
            out = F.conv1d(xbc.transpose(1, 2), w, self.tap_b, padding=K - 1, groups=C)[..., -L:]
            return out.transpose(1, 2)
        if BUG == "conv_shift_sum":
            out = 0
            for j in range(K):
                s = K - 1 - j  # tap j reads x[t - s]
                out = out + self.taps[j] * F.pad(xbc, (0, 0, s, 0))[:, :L]
            return out if self.tap_b is None else out + self.tap_b
        w = self.taps.t().unsqueeze(1)  # (C, 1, K)
        out = F.conv1d(F.pad(xbc.transpose(1, 2), (K - 1, 0)), w, self.tap_b, groups=C)
        return out.transpose(1, 2)

    def heads_of_groups(self, t):  # (b, L, G, N) -> (b, L, nh, N)
        rep = self.nh // self.groups
        if BUG == "bc_groups_tiled":
            return t.repeat(1, 1, rep, 1)
        return t.repeat_interleave(rep, dim=2)

    @staticmethod
    def segsum(a):  # a (b, l, h) -> (b, l, l, h) with [t, s] = sum_{s < r <= t} a_r, -inf above the diagonal
        l = a.shape[1]
        x = a[:, :, None, :].expand(-1, l, l, -1)  # [t, s] = a_t
        below = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a.device), -1)[None, :, :, None]
        x = x.masked_fill(~below, 0.0).cumsum(1)
        keep = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a.device))[None, :, :, None]
        return x.masked_fill(~keep, float("-inf"))

    def scan(self, x, dt, Bh, Ch):
        """x (b, L, nh, hd), dt (b, L, nh), Bh / Ch (b, L, nh, N) -> y (b, L, nh, hd) without the D skip."""
        b, L = x.shape[:2]
        A = self.ssm["A"]
        a = dt * A  # log decay per step
        xdt = x * dt[..., None]
        if BUG == "ssd_quadratic":
            w = torch.einsum("bthn,bshn->btsh", Ch, Bh) * torch.exp(self.segsum(a))
            return torch.einsum("btsh,bshp->bthp", w, xdt)
        if BUG == "ssd_chunked":
            state = x.new_zeros(b, self.nh, self.hd, self.N)
            ys = []
            for c0 in range(0, L, self.chunk):
                sl = slice(c0, min(c0 + self.chunk, L))
                a_c, x_c, B_c, C_c = a[:, sl], xdt[:, sl], Bh[:, sl], Ch[:, sl]
                w = torch.einsum("bthn,bshn->btsh", C_c, B_c) * torch.exp(self.segsum(a_c))
                y_diag = torch.einsum("btsh,bshp->bthp", w, x_c)
                cs = a_c.cumsum(1)
                y_off = torch.einsum("bthn,bhpn->bthp", C_c, state) * torch.exp(cs)[..., None]
                ys.append(y_diag + y_off)
                to_end = torch.exp(cs[:, -1:] - cs)
                state = state * torch.exp(cs[:, -1])[..., None, None] + torch.einsum(
                    "bshn,bsh,bshp->bhpn", B_c, to_end, x_c
                )
            return torch.cat(ys, 1)
        state = x.new_zeros(b, self.nh, self.hd, self.N)
        ys = []
        for t in range(L):
            dA = torch.exp(a[:, t])[..., None, None]
            dBx = xdt[:, t, :, :, None] * Bh[:, t, :, None, :]
            if BUG == "ssm_input_decayed":
                state = (state + dBx) * dA
            else:
                state = state * dA + dBx
            ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
        return torch.stack(ys, 1)

    def gated_norm(self, y, z):
        groups = 1 if BUG == "gated_norm_ungrouped" else self.groups
        if BUG == "norm_before_gate":
            yg = y.view(*y.shape[:-1], groups, -1)
            yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.gnorm * yg.flatten(-2) * F.silu(z)
        y = y * F.silu(z)
        yg = y.view(*y.shape[:-1], groups, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.gnorm * yg.flatten(-2)

    def mixer(self, h, mask):
        b, L, _ = h.shape
        if mask is not None:
            h = h * mask[..., None]
        z = _lin(h, self.w_z, self.b_z)
        xbc = F.silu(self.conv(_lin(h, self.w_xbc, self.b_xbc)))
        if mask is not None and BUG != "mamba_mask_after_conv_skipped":
            xbc = xbc * mask[..., None]
        gn = self.groups * self.N
        if BUG == "xbc_bc_swapped":
            x, C, Bm = xbc.split([self.inner, gn, gn], dim=-1)
        else:
            x, Bm, C = xbc.split([self.inner, gn, gn], dim=-1)
        dt = _lin(h, self.w_dt, self.b_dt) + self.ssm["dt_bias"]
        if BUG != "dt_softplus_missing":
            dt = F.softplus(dt)
        if BUG != "dt_limit_ignored":
            dt = dt.clamp(min=self.dt_lo, max=self.dt_hi)
        x = x.reshape(b, L, self.nh, self.hd)
        Bh = self.heads_of_groups(Bm.reshape(b, L, self.groups, self.N))
        Ch = self.heads_of_groups(C.reshape(b, L, self.groups, self.N))
        y = self.scan(x, dt, Bh, Ch)
        skip_in = x * dt[..., None] if BUG == "d_skip_after_dt" else x
        y = y + self.ssm["D"][:, None] * skip_in
        y = self.gated_norm(y.reshape(b, L, self.inner), z)
        return _lin(y, self.w_out, self.b_out)

    def forward(self, h, ctx):
        return _decoder_layer(self, h, lambda x: self.mixer(x, ctx["mask"]))


class AttnBlock(nn.Module):
    def __init__(self, sd, i, cfg):
        super().__init__()
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.eps = cfg.rms_norm_eps
        self.nq = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.norms = _param(torch.stack([sd[p + "input_layernorm.weight"], sd[p + "pre_ff_layernorm.weight"]]).float())
        ws = [sd[a + n + "_proj.weight"].float() for n in ("q", "k", "v")]
        self.w_qkv = _param(torch.cat(ws, 0).t())
        bs = [_vec(sd, a + n + "_proj.bias") for n in ("q", "k", "v")]
        self.b_qkv = _param(None if bs[0] is None else torch.cat(bs))
        self.w_o = _param(sd[a + "o_proj.weight"].float().t())
        self.b_o = _param(_vec(sd, a + "o_proj.bias"))
        self.mlp = MLP(sd, p + "feed_forward.")

    @staticmethod
    def rope(x, ctx):
        rd = ctx["rot_dim"]
        xr, xp = x[..., :rd], x[..., rd:]
        if BUG == "rope_complex":
            half = rd // 2
            xc = torch.complex(xr[..., :half], xr[..., half:])
            yc = xc * torch.polar(torch.ones_like(ctx["angle"]), ctx["angle"])[:, None]
            xr = torch.cat([yc.real, yc.imag], -1)
        else:
            cos, sin = ctx["cos"][:, None], ctx["sin"][:, None]
            x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
            xr = xr * cos + torch.cat([-x2, x1], -1) * sin
        return torch.cat([xr, xp], -1)

    def attn(self, h, ctx):
        b, L, _ = h.shape
        qkv = _lin(h, self.w_qkv, self.b_qkv)
        q, k, v = qkv.split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(b, L, self.nq, self.hd).transpose(1, 2)
        k = k.view(b, L, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, L, self.nkv, self.hd).transpose(1, 2)
        q, k = self.rope(q, ctx), self.rope(k, ctx)
        rep = self.nq // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = 1.0 / math.sqrt(ctx["rot_dim"] if BUG == "attn_scale_rotary_dim" else self.hd)
        if BUG == "attn_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx["bias"], scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale + ctx["bias"]
            o = torch.softmax(s, dim=-1) @ v
        o = o.transpose(1, 2).reshape(b, L, self.nq * self.hd)
        return _lin(o, self.w_o, self.b_o)

    def forward(self, h, ctx):
        return _decoder_layer(self, h, lambda x: self.attn(x, ctx))


class BambaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.tok = _param(sd["model.embed_tokens.weight"].float())
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        self.head_t = _param(head.float().t())
        self.out_norm = _param(_vec(sd, "model.final_layernorm.weight"))
        attn_idx = set(cfg.attn_layer_indices or [])
        self.blocks = nn.ModuleList(
            AttnBlock(sd, i, cfg) if i in attn_idx else MambaBlock(sd, i, cfg) for i in range(cfg.num_hidden_layers)
        )
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rp = cfg.rope_parameters or {}
        self.theta = float(rp.get("rope_theta", 10000.0))
        self.rot_frac = float(rp.get("partial_rotary_factor", 1.0))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, L = input_ids.shape
        h = self.tok[input_ids]
        if position_ids is None:
            position_ids = torch.arange(L, device=input_ids.device)[None].expand(b, L)
        rd = self.hd if BUG == "rope_full_dim" else int(self.hd * self.rot_frac)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        angle = position_ids.float()[..., None] * inv_freq  # (b, L, rd / 2)
        emb = torch.cat([angle, angle], -1)
        allowed = torch.tril(torch.ones(L, L, dtype=torch.bool, device=h.device))[None]
        mask = None
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
            mask = attention_mask.to(h.dtype)
        bias = torch.zeros(allowed.shape, dtype=h.dtype).masked_fill(~allowed, torch.finfo(h.dtype).min)[:, None]
        ctx = {"mask": mask, "bias": bias, "rot_dim": rd, "angle": angle, "cos": emb.cos(), "sin": emb.sin()}
        for blk in self.blocks:
            h = blk(h, ctx)
        return _rms(h, self.out_norm, self.eps) @ self.head_t


def build(state_dict, config) -> nn.Module:
    return BambaPort(state_dict, config).eval()
