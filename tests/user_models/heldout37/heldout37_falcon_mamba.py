"""Hand-written plain-PyTorch port of Falcon Mamba (FalconMambaForCausalLM): Mamba-1 blocks with the extra
weightless RMS norms on the selective parameters B, C and dt. No attention, no positions.

Architecture as this port implements it (float32 throughout; I = expand * H, N = state_size, R = time_step_rank,
K = conv_kernel):
- h = emb[ids] (no scaling). Untied head unless config.tie_word_embeddings.
- rms(x, w, eps) = w * x / sqrt(mean(x**2, last axis) + eps)   (block norms and the final norm, eps =
  config.layer_norm_epsilon);  wrms(x, eps) = the same without a weight (the B / C / dt norms, eps =
  config.mixer_rms_eps).
- block i (pre-norm, residual from the un-normed stream):  h = h + Mixer_i(rms(h, g_i)).
- Mixer on u (B, L, H), m = attention mask (B, L) of 1/0 or None:
    u = u * m                                    (padding rows zeroed BEFORE the input projection)
    [x | z] = u W_in + b_in                      (x, z: (B, L, I); x first, gate z second)
    x = silu(causal_depthwise_conv(x) + b_conv)  conv[t, c] = sum_{j<K} k[j, c] x[t - (K-1) + j, c]
                                                 (zeros before t = 0, k[K-1] multiplies the current token)
    x = x * m                                    (padding rows zeroed again AFTER the conv)
    dt_r = x W_dtr (R),  B = x W_B (N),  C = x W_C (N)
    dt_r, B, C = wrms(dt_r), wrms(B), wrms(C)    (each over its own last axis, FalconMamba's addition)
    dt = softplus(dt_r W_dt + b_dt)              (dt bias added once, before the softplus; dt: (B, L, I))
    A = -exp(A_log)                              (I, N), precomputed at load
    s_t = exp(dt_t * A) * s_{t-1} + (dt_t * x_t) B_t     (zero-order hold on A, Euler on B; s_{-1} = 0)
    y_t = s_t C_t + D * x_t                      (state updated with token t before it is read)
    y = y * silu(z)
    out = y W_out + b_out
- final: logits = rms(h, g_f) W_head^T.
- padded rows: the two mask multiplications keep padding tokens out of the conv and the scan (the padding
  positions still get an in_proj bias into the conv window, as Transformers does). position_ids are ignored.

Weight layout of this port (own names, all set at load):
- `tok_emb` (V, H); `head_t` (H, V) = lm_head.weight transposed (or the embedding's transpose when tied);
- `gains` (L + 1, H): the L block norm weights and the final norm weight stacked (row L = final);
- per block `blocks[i]` (own module `Mamba1Block`):
    `w_in` (H, 2I) = in_proj.weight transposed ([x | z] columns); `b_in` (2I,);
    `taps` (K, I) = conv1d.weight[:, 0, :] transposed (row j = tap j);
    `chan` (3, I) = stacked per-channel vectors, rows [conv bias, dt bias, D];
    `w_sel` dict of own tensors: `dt_in` (I, R), `bc_in` (I, 2N) = x_proj.weight split at R and transposed
      (columns of bc_in: [B | C]);
    `w_dt` (R, I) = dt_proj.weight transposed;  `A` (I, N) = -exp(A_log);
    `w_out` (I, H) = out_proj.weight transposed; `b_out` (H,).
- `_TAP` (module global, default None): when set to a dict, forward stores intermediates under Transformers'
  module names without `backbone.` (used by where.py only; no effect on the computation).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
_TAP = None  # debugging aid: a dict here collects named intermediates during forward (None: off)

BUGS = [
    "fm_bcdt_norms_missing",  # Mamba-1 mixer reused as is: the weightless RMS norms on dt, B and C are not applied
    "fm_dt_norm_after_proj",  # dt RMS norm applied to dt_proj's output (over the I channels, the size HF builds
    #                           dt_layernorm with) instead of to the rank-R time step before dt_proj
    "fm_bc_norm_seq_axis",  # B and C normalised over the sequence axis (of the scan's (B, N, L) layout) not over N
    "fm_mixer_eps_from_ln",  # B / C / dt norms built with config.layer_norm_epsilon instead of config.mixer_rms_eps
    "fm_A_no_exp",  # A precomputed at load as -A_log: the exp of the stored log is forgotten
    "fm_dt_bias_twice",  # dt_proj applied as a full Linear (with bias) AND its bias added again before the softplus
    "fm_B_not_discretized",  # input term of the scan uses B_t x_t without the step dt_t (only A is discretised)
    "fm_scan_read_before_update",  # y_t read from the state before token t is added (y_t = s_{t-1} C_t)
    "fm_conv_taps_flipped",  # conv1d weight taps reversed along time at load (k[0] put on the current token)
    "fm_in_proj_gate_first",  # fused in_proj output split as [z | x] instead of [x | z]
    "fm_D_skip_after_gate",  # D * x added after the silu(z) gate instead of before it
    "fm_residual_from_normed",  # block residual taken from the normed stream: h = rms(h) + Mixer(rms(h))
    "fm_head_tied",  # head taken as the embedding transposed although config.tie_word_embeddings is False
    "fm_pad_conv_unmasked",  # padding mask applied before in_proj only: the conv output at padding positions
    #                          (in_proj / conv biases through silu) is not zeroed again and enters the scan
]
PADDING_ONLY = ["fm_pad_conv_unmasked"]
CLEAN = [
    "fm_chunked_scan",  # scan in chunks of 8: within a chunk a masked exp(cumsum(dt A)) matrix, state carried
    "fm_doubling_scan",  # Hillis-Steele log-step associative scan of (a, b) pairs, (a1, b1) o (a2, b2) = (a1 a2, a2 b1 + b2)
    "fm_conv_shift_sum",  # depthwise causal conv as a sum of K shifted copies times their taps (no F.conv1d)
    "fm_gain_folded_in_proj",  # block norm gain folded into the in_proj rows at call time: (g * n) W = n (g[:, None] W)
    "fm_split_in_proj",  # fused in_proj applied as two matmuls (x columns, z columns) instead of one
]


def _tap(name, value):
    if _TAP is not None:
        _TAP[name] = value.detach().clone()


def _rms(x, eps, weight=None):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else weight * y


class Mamba1Block(nn.Module):
    def __init__(self, p, config, gain_row):
        super().__init__()
        H, I, N = config.hidden_size, config.intermediate_size, config.state_size
        R, K = int(config.time_step_rank), config.conv_kernel
        self.I, self.N, self.R, self.K = I, N, R, K
        self.mixer_eps = config.mixer_rms_eps
        self.ln_eps = config.layer_norm_epsilon
        self.gain_row = gain_row
        self.w_in = nn.Parameter(p["in_proj.weight"].t().contiguous())
        self.b_in = nn.Parameter(p["in_proj.bias"].clone())
        taps = p["conv1d.weight"][:, 0, :].t().contiguous()  # (K, I)
        if BUG == "fm_conv_taps_flipped":
            taps = taps.flip(0).contiguous()
        self.taps = nn.Parameter(taps)
        self.chan = nn.Parameter(torch.stack([p["conv1d.bias"], p["dt_proj.bias"], p["D"]]))
        xw = p["x_proj.weight"]  # (R + 2N, I)
        self.w_sel = nn.ParameterDict(
            {"dt_in": nn.Parameter(xw[:R].t().contiguous()), "bc_in": nn.Parameter(xw[R:].t().contiguous())}
        )
        self.w_dt = nn.Parameter(p["dt_proj.weight"].t().contiguous())
        A = -p["A_log"].float() if BUG == "fm_A_no_exp" else -torch.exp(p["A_log"].float())
        self.A = nn.Parameter(A)
        self.w_out = nn.Parameter(p["out_proj.weight"].t().contiguous())
        self.b_out = nn.Parameter(p["out_proj.bias"].clone())

    # --- pieces -------------------------------------------------------------------------------------------
    def conv(self, x):
        """x (B, L, I) -> causal depthwise conv + bias (before the activation)."""
        K, L = self.K, x.shape[1]
        b_conv = self.chan[0]
        if BUG == "fm_conv_shift_sum":
            xp = F.pad(x, (0, 0, K - 1, 0))
            out = sum(self.taps[j] * xp[:, j : j + L] for j in range(K))
            return out + b_conv
        w = self.taps.t().unsqueeze(1)  # (I, 1, K)
        out = F.conv1d(x.transpose(1, 2), w, b_conv, padding=K - 1, groups=self.I)[:, :, :L]
        return out.transpose(1, 2)

    def scan(self, dtA, dBx, C):
        """dtA = dt * A, dBx (B, L, I, N), C (B, L, N) -> y (B, L, I) = sum_n s_t C_t."""
        Bsz, L, I, N = dtA.shape
        dA = torch.exp(dtA)
        if BUG == "fm_chunked_scan":
            T = 8
            s = dA.new_zeros(Bsz, I, N)
            ys = []
            for c0 in range(0, L, T):
                la = dtA[:, c0 : c0 + T]  # (B, T, I, N)
                u = dBx[:, c0 : c0 + T]
                cs = la.cumsum(1)  # (B, T, I, N)
                Tc = la.shape[1]
                seg = cs[:, :, None] - cs[:, None, :]  # (B, t, s, I, N): sum_{r=s+1..t}
                tri = torch.ones(Tc, Tc, dtype=torch.bool).tril()[None, :, :, None, None]
                w = torch.where(tri, torch.exp(torch.where(tri, seg, torch.zeros_like(seg))), torch.zeros_like(seg))
                states = (w * u[:, None]).sum(2) + torch.exp(cs) * s[:, None]  # (B, T, I, N)
                ys.append((states * C[:, c0 : c0 + T, None, :]).sum(-1))
                s = states[:, -1]
            return torch.cat(ys, 1)
        if BUG == "fm_doubling_scan":
            a, b = dA, dBx
            k = 1
            while k < L:
                a_prev = F.pad(a[:, :-k], (0, 0, 0, 0, k, 0), value=1.0)
                b_prev = F.pad(b[:, :-k], (0, 0, 0, 0, k, 0), value=0.0)
                a, b = a_prev * a, a * b_prev + b
                k *= 2
            return (b * C[:, :, None, :]).sum(-1)
        s = dA.new_zeros(Bsz, I, N)
        ys = []
        for t in range(L):
            if BUG == "fm_scan_read_before_update":
                ys.append(torch.matmul(s, C[:, t, :, None])[..., 0])
                s = dA[:, t] * s + dBx[:, t]
            else:
                s = dA[:, t] * s + dBx[:, t]
                ys.append(torch.matmul(s, C[:, t, :, None])[..., 0])
        return torch.stack(ys, 1)

    # --- forward ------------------------------------------------------------------------------------------
    def forward(self, h, gains, mask):
        I, N, R = self.I, self.N, self.R
        g = gains[self.gain_row]
        if BUG == "fm_gain_folded_in_proj":
            u = _rms(h, self.ln_eps)
        else:
            u = _rms(h, self.ln_eps, g)
        _tap(f"layers.{self.gain_row}.norm", u)
        residual = u if BUG == "fm_residual_from_normed" else h
        if mask is not None:
            u = u * mask[:, :, None]
        if BUG == "fm_gain_folded_in_proj":
            xz = u @ (g[:, None] * self.w_in) + self.b_in
        elif BUG == "fm_split_in_proj":
            xz = torch.cat([u @ self.w_in[:, :I], u @ self.w_in[:, I:]], -1) + self.b_in
        else:
            xz = u @ self.w_in + self.b_in
        _tap(f"layers.{self.gain_row}.mixer.in_proj", xz)
        if BUG == "fm_in_proj_gate_first":
            z, x = xz[..., :I], xz[..., I:]
        else:
            x, z = xz[..., :I], xz[..., I:]
        x = F.silu(self.conv(x))
        if mask is not None and BUG != "fm_pad_conv_unmasked":
            x = x * mask[:, :, None]

        dt_r = x @ self.w_sel["dt_in"]
        bc = x @ self.w_sel["bc_in"]
        Bm, Cm = bc[..., :N], bc[..., N:]
        _tap(f"layers.{self.gain_row}.mixer.x_proj", torch.cat([dt_r, bc], -1))
        eps = self.ln_eps if BUG == "fm_mixer_eps_from_ln" else self.mixer_eps
        if BUG not in ("fm_bcdt_norms_missing", "fm_dt_norm_after_proj"):
            dt_r = _rms(dt_r, eps)
        if BUG == "fm_bc_norm_seq_axis":
            Bm = _rms(Bm.transpose(1, 2), eps).transpose(1, 2)
            Cm = _rms(Cm.transpose(1, 2), eps).transpose(1, 2)
        elif BUG != "fm_bcdt_norms_missing":
            Bm, Cm = _rms(Bm, eps), _rms(Cm, eps)
        _tap(f"layers.{self.gain_row}.mixer.dt_layernorm", dt_r)
        _tap(f"layers.{self.gain_row}.mixer.b_layernorm", Bm)
        _tap(f"layers.{self.gain_row}.mixer.c_layernorm", Cm)
        dt = dt_r @ self.w_dt
        if BUG == "fm_dt_norm_after_proj":
            dt = _rms(dt, eps)
        if BUG == "fm_dt_bias_twice":
            dt = dt + self.chan[1]
        dt = F.softplus(dt + self.chan[1])

        dtA = dt[..., None] * self.A  # (B, L, I, N)
        if BUG == "fm_B_not_discretized":
            dBx = Bm[:, :, None, :] * x[..., None]
        else:
            dBx = (dt * x)[..., None] * Bm[:, :, None, :]
        y = self.scan(dtA, dBx, Cm)
        D = self.chan[2]
        if BUG == "fm_D_skip_after_gate":
            y = y * F.silu(z) + D * x
        else:
            y = (y + D * x) * F.silu(z)
        out = y @ self.w_out + self.b_out
        _tap(f"layers.{self.gain_row}.mixer.out_proj", out)
        _tap(f"layers.{self.gain_row}.mixer", out)
        h = residual + out
        _tap(f"layers.{self.gain_row}", h)
        return h


class FalconMambaPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        L = config.num_hidden_layers
        pre = "backbone."
        self.eps = config.layer_norm_epsilon
        self.tok_emb = nn.Parameter(sd[pre + "embeddings.weight"].float().clone())
        self.gains = nn.Parameter(
            torch.stack([sd[f"{pre}layers.{i}.norm.weight"] for i in range(L)] + [sd[pre + "norm_f.weight"]]).float()
        )
        blocks = []
        for i in range(L):
            lp = f"{pre}layers.{i}.mixer."
            p = {k[len(lp) :]: v.float() for k, v in sd.items() if k.startswith(lp)}
            blocks.append(Mamba1Block(p, config, i))
        self.blocks = nn.ModuleList(blocks)
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in sd
        head = sd[pre + "embeddings.weight"] if (tied or BUG == "fm_head_tied") else sd["lm_head.weight"]
        self.head_t = nn.Parameter(head.float().t().contiguous())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.tok_emb[input_ids]
        _tap("embeddings", h)
        mask = None if attention_mask is None else attention_mask.to(h.dtype)
        for blk in self.blocks:
            h = blk(h, self.gains, mask)
        h = _rms(h, self.eps, self.gains[-1])
        _tap("norm_f", h)
        logits = h @ self.head_t
        _tap("lm_head", logits)
        return logits


def build(state_dict, config):
    return FalconMambaPort(state_dict, config).eval()
