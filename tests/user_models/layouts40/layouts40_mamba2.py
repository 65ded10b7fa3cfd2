"""Hand-written plain-PyTorch port of Mamba-2 (Mamba2ForCausalLM), every variant a CORRECT port.

Architecture as this port implements it (I = expand * hidden = heads * head_dim, G = n_groups, N = state_size):
- token embedding; head tied to it (tie_word_embeddings) or lm_head; final RMSNorm norm_f (layer_norm_epsilon).
- block i, pre-norm residual: h = h + Mixer(RMS(h)).
- Mixer (Transformers' eager path):
    x <- x * mask (padding tokens zeroed when an attention mask is given)
    [z (I) | xBC (I + 2 G N) | dt (heads)] = W_in x + b_in
    xBC <- silu(causal depthwise conv1d(xBC) + b_conv) (kernel conv_kernel, left zero padding), then * mask
    [x (I) | B (G N) | C (G N)] = xBC;  head h uses group h // (heads / G)
    dt <- clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log) (one per head)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T  (state (head_dim, N) per head, S_0 = 0);  y_t = S_t C_t + D x_t
    y <- RMSNorm_grouped(y * silu(z)) (G groups of I / G, weight g, eps layer_norm_epsilon);  out = W_out y + b_out
- attention_mask (1/0, left padding) handled exactly as above; position_ids accepted and ignored.

Layout variants (BUG selects one; "" is the baseline):
- "" (baseline): own module tree; in_proj split at load into separate transposed (in, out) matrices and biases
  for z, x, B, C, dt (x @ W); conv weight as (channels, kernel) applied by pad + unfold + sum; A stored
  precomputed as -exp(A_log); sequential recurrence over time.
- mamba2_ssd_chunked: in_proj kept fused, transposed, HF order; the chunked SSD algorithm of mamba_ssm's
  ssd_minimal with chunk length 5 (not the config's 8; the sequence padded at the end); conv by F.conv1d(groups);
  A_log kept raw and exponentiated at call.
- mamba2_quadratic_dual: the fully parallel "SSD as masked attention" form over the whole sequence:
  y = ((C B^T) o exp(segsum(dt A))) (dt x) + D x; conv as K shifted copies weighted by the taps.
- mamba2_step_cache: the sequence fed one token at a time, with a rolling conv state (B, channels, K) and an SSM
  state (B, heads, head_dim, N) (mamba_ssm's step / selective_state_update); conv weight as (channels, K) used by
  einsum; in_proj as nn.Linear.
- mamba2_heads_axis: heads / groups as separate weight axes: W_x, W_z (heads, head_dim, hidden), W_B, W_C
  (G, N, hidden), W_dt (heads, hidden), conv taps (heads, head_dim, K) / (G, N, K), gated-norm weight
  (G, I / G), W_out (heads, head_dim, hidden); einsum everywhere, groups broadcast (h = g * r + j) instead of
  repeated.
- mamba2_folded_gains: block-norm gain folded into in_proj's columns, gated-norm gain folded into out_proj's
  columns, final-norm gain folded into a separate head matrix, dt_bias folded into in_proj's dt bias; weightless
  norms; chunked SSD with the config's chunk size.
- mamba2_stacked_functional: every weight kind stacked over layers ((L, ...)) and stored as buffers (no
  parameters: an inference-only port), one functional forward; the recurrence by a parallel Hillis-Steele
  associative scan over (decay, input) pairs (as mamba.py's pscan).
- mamba2_tied_backbone_head: a Backbone (nn.ModuleDict containers) returning the final-normed hidden states and a
  separate head that reuses the embedding matrix (tied); conv taps stored time-reversed (tap 0 = current token);
  D expanded per channel (I,) (Mamba-1 style).
- mamba2_split_conv_kc: in_proj as three nn.Linear (z, xBC, dt); three separate depthwise convs for x, B and C with
  weights in (K, channels) layout (llama.cpp's ssm_conv order), run by F.conv1d on a channel-first view; the
  recurrence keeps the state transposed (N, head_dim).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = []
PADDING_ONLY = []
CLEAN = [
    "mamba2_ssd_chunked",  # fused transposed in_proj, mamba_ssm ssd_minimal chunked scan with chunk 5
    "mamba2_quadratic_dual",  # fully parallel masked-attention form of SSD, conv as shifted copies
    "mamba2_step_cache",  # token-by-token step with rolling conv state + SSM state (mamba_ssm step)
    "mamba2_heads_axis",  # (heads, head_dim, hidden) / (G, N, hidden) weights with einsum, grouped gated norm
    "mamba2_folded_gains",  # norm gains folded into in_proj / out_proj / head, dt_bias folded into in_proj bias
    "mamba2_stacked_functional",  # (L, ...) stacked weights as buffers, functional forward, Hillis-Steele scan
    "mamba2_tied_backbone_head",  # backbone + head reusing the embedding, time-reversed taps, per-channel D
    "mamba2_split_conv_kc",  # three in_proj Linears, separate x/B/C convs in (K, C) layout, transposed state
]


# ----------------------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------------------


def _conf(config):
    H = config.hidden_size
    I = int(config.expand * H)
    nh, hd = config.num_heads, config.head_dim
    assert nh * hd == I
    lim = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    return dict(
        V=config.vocab_size,
        H=H,
        I=I,
        nh=nh,
        hd=hd,
        G=config.n_groups,
        N=config.state_size,
        K=config.conv_kernel,
        L=config.num_hidden_layers,
        eps=config.layer_norm_epsilon,
        chunk=config.chunk_size,
        dt_min=float(lim[0]),
        dt_max=float(lim[1]),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        bias=bool(config.use_bias),
        conv_bias=bool(config.use_conv_bias),
        conv_dim=I + 2 * config.n_groups * config.state_size,
    )


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _linear(w, b=None):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    lin.weight = _P(w)
    if b is not None:
        lin.bias = _P(b)
    return lin


def _rms(x, g, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if g is None else g * y


def _gated_rms(y, z, g, groups, eps):
    y = y.float() * F.silu(z.float())
    shp = y.shape
    yg = y.view(*shp[:-1], groups, shp[-1] // groups)
    yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + eps)
    y = yg.view(shp)
    return y if g is None else g * y


def _dt(raw, dt_bias, c):
    dt = F.softplus(raw + dt_bias) if dt_bias is not None else F.softplus(raw)
    return dt.clamp(c["dt_min"], c["dt_max"])


def _split_in(c):
    return [c["I"], c["I"], c["G"] * c["N"], c["G"] * c["N"], c["nh"]]  # z, x, B, C, dt


def _mix(sd, i, name):
    return sd[f"backbone.layers.{i}.mixer.{name}"]


def _in_parts(sd, i, c):
    """in_proj weight rows / bias split into z, x, B, C, dt (HF order)."""
    w = _mix(sd, i, "in_proj.weight").split(_split_in(c), 0)
    b = _mix(sd, i, "in_proj.bias").split(_split_in(c), 0) if c["bias"] else [None] * 5
    return w, b


def _conv_wb(sd, i, c):
    w = _mix(sd, i, "conv1d.weight")[:, 0]  # (channels, K)
    b = _mix(sd, i, "conv1d.bias") if c["conv_bias"] else torch.zeros(w.shape[0])
    return w, b


def _head(sd):
    return sd["lm_head.weight"] if "lm_head.weight" in sd else sd["backbone.embeddings.weight"]


def _mask3(attention_mask):
    return None if attention_mask is None else attention_mask.to(torch.float32)[:, :, None]


def _segsum(x):
    """x (..., T) -> (..., T, T) with out[i, j] = sum_{j < r <= i} x[r] for j <= i, -inf above the diagonal."""
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)  # x[..., r, j] = x[r]
    x = x.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril(0), float("-inf"))


def _ssd_chunked(X, A, B, C, block):
    """mamba_ssm's ssd_minimal_discrete.  X (b, l, h, p) and A (b, l, h) already times dt; B / C (b, l, h, n)."""
    b, l = X.shape[:2]
    pad = (block - l % block) % block
    if pad:
        X, A, B, C = [F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (X, A, B, C)]
    nc = X.shape[1] // block
    X, A, B, C = [t.reshape(b, nc, block, *t.shape[2:]) for t in (X, A, B, C)]
    A = A.permute(0, 3, 1, 2)  # (b, h, c, l)
    A_cumsum = torch.cumsum(A, dim=-1)
    Lmat = torch.exp(_segsum(A))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, Lmat, X)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(b, nc * block, *Y_diag.shape[3:])[:, :l]


# ----------------------------------------------------------------------------------------------------------------
# baseline
# ----------------------------------------------------------------------------------------------------------------


class _Mixer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        (wz, wx, wB, wC, wdt), (bz, bx, bB, bC, bdt) = _in_parts(sd, i, c)
        for n, w, b in (("z", wz, bz), ("x", wx, bx), ("B", wB, bB), ("C", wC, bC), ("dt", wdt, bdt)):
            setattr(self, f"w_{n}", _P(w.t()))  # (hidden, out)
            setattr(self, f"b_{n}", _P(b if b is not None else torch.zeros(w.shape[0])))
        cw, cb = _conv_wb(sd, i, c)
        self.conv_w, self.conv_b = _P(cw), _P(cb)  # (channels, K), (channels,)
        self.dt_bias = _P(_mix(sd, i, "dt_bias"))
        self.A = _P(-torch.exp(_mix(sd, i, "A_log").float()))  # precomputed
        self.D = _P(_mix(sd, i, "D"))
        self.norm_w = _P(_mix(sd, i, "norm.weight"))
        self.w_out = _P(_mix(sd, i, "out_proj.weight").t())
        self.b_out = _P(_mix(sd, i, "out_proj.bias") if c["bias"] else torch.zeros(c["H"]))

    def conv(self, u):  # u (B, T, channels)
        K = self.c["K"]
        win = F.pad(u, (0, 0, K - 1, 0)).unfold(1, K, 1)  # (B, T, channels, K): taps oldest .. current
        return (win * self.conv_w).sum(-1) + self.conv_b

    def forward(self, u, m):
        c = self.c
        Bsz, T, _ = u.shape
        if m is not None:
            u = u * m
        z = u @ self.w_z + self.b_z
        xBC = torch.cat([u @ self.w_x + self.b_x, u @ self.w_B + self.b_B, u @ self.w_C + self.b_C], -1)
        dt = _dt(u @ self.w_dt + self.b_dt, self.dt_bias, c)  # (B, T, nh)
        xBC = F.silu(self.conv(xBC))
        if m is not None:
            xBC = xBC * m
        x, Bm, Cm = xBC.split([c["I"], c["G"] * c["N"], c["G"] * c["N"]], -1)
        x = x.view(Bsz, T, c["nh"], c["hd"])
        r = c["nh"] // c["G"]
        Bm = Bm.view(Bsz, T, c["G"], c["N"]).repeat_interleave(r, 2)  # (B, T, nh, N)
        Cm = Cm.view(Bsz, T, c["G"], c["N"]).repeat_interleave(r, 2)
        S = u.new_zeros(Bsz, c["nh"], c["hd"], c["N"])
        ys = []
        for t in range(T):
            dA = torch.exp(dt[:, t] * self.A)  # (B, nh)
            S = S * dA[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * Bm[:, t, :, None, :]
            ys.append(torch.einsum("bhpn,bhn->bhp", S, Cm[:, t]))
        y = torch.stack(ys, 1) + x * self.D[:, None]
        y = _gated_rms(y.reshape(Bsz, T, c["I"]), z, self.norm_w, c["G"], c["eps"])
        return y @ self.w_out + self.b_out


class _Layer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.norm_w = _P(sd[f"backbone.layers.{i}.norm.weight"])
        self.mixer = _Mixer(sd, c, i)

    def forward(self, h, m):
        return h + self.mixer(_rms(h, self.norm_w, self.c["eps"]), m)


class Mamba2Baseline(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.emb = _P(sd["backbone.embeddings.weight"])
        self.layers = nn.ModuleList([_Layer(sd, c, i) for i in range(c["L"])])
        self.norm_f = _P(sd["backbone.norm_f.weight"])
        self.head_t = _P(_head(sd).t())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        m = _mask3(attention_mask)
        h = self.emb[input_ids]
        for layer in self.layers:
            h = layer(h, m)
        return (_rms(h, self.norm_f, self.c["eps"]) @ self.head_t).float()


# ----------------------------------------------------------------------------------------------------------------
# mamba2_ssd_chunked
# ----------------------------------------------------------------------------------------------------------------


class _ChunkMixer(nn.Module):
    block = 5

    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.in_proj_t = _P(_mix(sd, i, "in_proj.weight").t())  # (hidden, z | x | B | C | dt)
        self.in_bias = _P(_mix(sd, i, "in_proj.bias") if c["bias"] else torch.zeros(self.in_proj_t.shape[1]))
        self.conv_weight = _P(_mix(sd, i, "conv1d.weight"))  # (channels, 1, K)
        self.conv_bias = _P(_conv_wb(sd, i, c)[1])
        self.dt_bias = _P(_mix(sd, i, "dt_bias"))
        self.A_log = _P(_mix(sd, i, "A_log"))
        self.D = _P(_mix(sd, i, "D"))
        self.gate_norm = _P(_mix(sd, i, "norm.weight"))
        self.out_proj_t = _P(_mix(sd, i, "out_proj.weight").t())
        self.out_bias = _P(_mix(sd, i, "out_proj.bias") if c["bias"] else torch.zeros(c["H"]))

    def scan(self, x, dt, A, Bm, Cm):
        c = self.c
        r = c["nh"] // c["G"]
        Bm, Cm = Bm.repeat_interleave(r, 2), Cm.repeat_interleave(r, 2)
        return _ssd_chunked(x * dt[..., None], A * dt, Bm, Cm, self.block)

    def forward(self, u, m):
        c = self.c
        Bsz, T, _ = u.shape
        if m is not None:
            u = u * m
        zxbcdt = u @ self.in_proj_t + self.in_bias
        z, xBC, dt = zxbcdt.split([c["I"], c["conv_dim"], c["nh"]], -1)
        xBC = F.conv1d(xBC.transpose(1, 2), self.conv_weight, self.conv_bias, padding=c["K"] - 1, groups=c["conv_dim"])
        xBC = F.silu(xBC[..., :T].transpose(1, 2))
        if m is not None:
            xBC = xBC * m
        x, Bm, Cm = xBC.split([c["I"], c["G"] * c["N"], c["G"] * c["N"]], -1)
        x = x.reshape(Bsz, T, c["nh"], c["hd"])
        A = -torch.exp(self.A_log)
        dt = _dt(dt, self.dt_bias, c)
        y = self.scan(x, dt, A, Bm.view(Bsz, T, c["G"], c["N"]), Cm.view(Bsz, T, c["G"], c["N"]))
        y = y + x * self.D[:, None]
        y = _gated_rms(y.reshape(Bsz, T, -1), z, self.gate_norm, c["G"], c["eps"])
        return y @ self.out_proj_t + self.out_bias


class _ChunkBlock(nn.Module):
    mixer_cls = _ChunkMixer

    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.norm = _P(sd[f"backbone.layers.{i}.norm.weight"])
        self.mixer = self.mixer_cls(sd, c, i)

    def forward(self, h, m):
        return h + self.mixer(_rms(h, self.norm, self.c["eps"]), m)


class Mamba2Chunked(nn.Module):
    block_cls = _ChunkBlock

    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embeddings = nn.Embedding(c["V"], c["H"], _weight=_P(sd["backbone.embeddings.weight"]))
        self.blocks = nn.ModuleList([self.block_cls(sd, c, i) for i in range(c["L"])])
        self.norm_f = _P(sd["backbone.norm_f.weight"])
        self.lm_head = _linear(_head(sd))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        m = _mask3(attention_mask)
        h = self.embeddings(input_ids)
        for blk in self.blocks:
            h = blk(h, m)
        return self.lm_head(_rms(h, self.norm_f, self.c["eps"])).float()


# ----------------------------------------------------------------------------------------------------------------
# mamba2_quadratic_dual
# ----------------------------------------------------------------------------------------------------------------


class _DualMixer(_ChunkMixer):
    def __init__(self, sd, c, i):
        super().__init__(sd, c, i)
        del self.conv_weight
        self.conv_taps = _P(_mix(sd, i, "conv1d.weight")[:, 0].t())  # (K, channels), row K-1 = current token

    def forward(self, u, m):
        c = self.c
        Bsz, T, _ = u.shape
        if m is not None:
            u = u * m
        z, xBC, dt = (u @ self.in_proj_t + self.in_bias).split([c["I"], c["conv_dim"], c["nh"]], -1)
        K = c["K"]
        conv = self.conv_bias + sum(
            F.pad(xBC, (0, 0, K - 1 - k, 0))[:, :T] * self.conv_taps[k] for k in range(K)
        )  # tap k looks K-1-k tokens back
        xBC = F.silu(conv)
        if m is not None:
            xBC = xBC * m
        x, Bm, Cm = xBC.split([c["I"], c["G"] * c["N"], c["G"] * c["N"]], -1)
        x = x.reshape(Bsz, T, c["nh"], c["hd"])
        Bm = Bm.view(Bsz, T, c["G"], c["N"])
        Cm = Cm.view(Bsz, T, c["G"], c["N"])
        dt = _dt(dt, self.dt_bias, c)  # (B, T, nh)
        A = -torch.exp(self.A_log)
        r = c["nh"] // c["G"]
        Lmat = torch.exp(_segsum((dt * A).transpose(1, 2)))  # (B, nh, T, T): decay from s to t
        CB = torch.einsum("btgn,bsgn->bgts", Cm, Bm).repeat_interleave(r, 1)  # (B, nh, T, T)
        y = torch.einsum("bhts,bshp->bthp", CB * Lmat, x * dt[..., None]) + x * self.D[:, None]
        y = _gated_rms(y.reshape(Bsz, T, -1), z, self.gate_norm, c["G"], c["eps"])
        return y @ self.out_proj_t + self.out_bias


class _DualBlock(_ChunkBlock):
    mixer_cls = _DualMixer


class Mamba2Dual(Mamba2Chunked):
    block_cls = _DualBlock


# ----------------------------------------------------------------------------------------------------------------
# mamba2_step_cache
# ----------------------------------------------------------------------------------------------------------------


class _StepMixer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.in_proj = _linear(_mix(sd, i, "in_proj.weight"), _mix(sd, i, "in_proj.bias") if c["bias"] else None)
        cw, cb = _conv_wb(sd, i, c)
        self.conv_w = _P(cw)  # (channels, K)
        self.conv_b = _P(cb)
        self.dt_bias = _P(_mix(sd, i, "dt_bias"))
        self.A_log = _P(_mix(sd, i, "A_log"))
        self.D = _P(_mix(sd, i, "D"))
        self.norm_weight = _P(_mix(sd, i, "norm.weight"))
        self.out_proj = _linear(_mix(sd, i, "out_proj.weight"), _mix(sd, i, "out_proj.bias") if c["bias"] else None)

    def step(self, u, m, conv_state, ssm_state):
        """u (B, hidden) one token; m (B, 1) or None; states updated in place."""
        c = self.c
        if m is not None:
            u = u * m
        z, xBC, dt = self.in_proj(u).split([c["I"], c["conv_dim"], c["nh"]], -1)
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = xBC
        xBC = F.silu(torch.einsum("bck,ck->bc", conv_state, self.conv_w) + self.conv_b)
        if m is not None:
            xBC = xBC * m
        x, Bm, Cm = xBC.split([c["I"], c["G"] * c["N"], c["G"] * c["N"]], -1)
        Bsz = u.shape[0]
        x = x.view(Bsz, c["nh"], c["hd"])
        r = c["nh"] // c["G"]
        Bm = Bm.view(Bsz, c["G"], 1, c["N"]).expand(Bsz, c["G"], r, c["N"]).reshape(Bsz, c["nh"], c["N"])
        Cm = Cm.view(Bsz, c["G"], 1, c["N"]).expand(Bsz, c["G"], r, c["N"]).reshape(Bsz, c["nh"], c["N"])
        dt = _dt(dt, self.dt_bias, c)  # (B, nh)
        dA = torch.exp(dt * -torch.exp(self.A_log))
        ssm_state.copy_(ssm_state * dA[..., None, None] + (dt[..., None] * x)[..., None] * Bm[:, :, None, :])
        y = torch.bmm(ssm_state.view(Bsz * c["nh"], c["hd"], c["N"]), Cm.reshape(Bsz * c["nh"], c["N"], 1))
        y = y.view(Bsz, c["nh"], c["hd"]) + x * self.D[:, None]
        y = _gated_rms(y.reshape(Bsz, -1), z, self.norm_weight, c["G"], c["eps"])
        return self.out_proj(y)


class _StepBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.norm = _P(sd[f"backbone.layers.{i}.norm.weight"])
        self.mixer = _StepMixer(sd, c, i)


class Mamba2Step(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embedding = nn.Embedding(c["V"], c["H"], _weight=_P(sd["backbone.embeddings.weight"]))
        self.layers = nn.ModuleList([_StepBlock(sd, c, i) for i in range(c["L"])])
        self.norm_f = _P(sd["backbone.norm_f.weight"])
        self.lm_head = _linear(_head(sd))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        Bsz, T = input_ids.shape
        m = _mask3(attention_mask)
        h0 = self.norm_f
        states = [
            (h0.new_zeros(Bsz, c["conv_dim"], c["K"]), h0.new_zeros(Bsz, c["nh"], c["hd"], c["N"])) for _ in self.layers
        ]
        out = []
        for t in range(T):
            h = self.embedding(input_ids[:, t])
            mt = None if m is None else m[:, t]
            for layer, (cs, ss) in zip(self.layers, states):
                h = h + layer.mixer.step(_rms(h, layer.norm, c["eps"]), mt, cs, ss)
            out.append(self.lm_head(_rms(h, self.norm_f, c["eps"])))
        return torch.stack(out, 1).float()


# ----------------------------------------------------------------------------------------------------------------
# mamba2_heads_axis
# ----------------------------------------------------------------------------------------------------------------


class _HeadsMixer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        nh, hd, G, N, H = c["nh"], c["hd"], c["G"], c["N"], c["H"]
        (wz, wx, wB, wC, wdt), (bz, bx, bB, bC, bdt) = _in_parts(sd, i, c)
        zero = torch.zeros
        self.W_z, self.b_z = _P(wz.view(nh, hd, H)), _P(bz.view(nh, hd) if bz is not None else zero(nh, hd))
        self.W_x, self.b_x = _P(wx.view(nh, hd, H)), _P(bx.view(nh, hd) if bx is not None else zero(nh, hd))
        self.W_B, self.b_B = _P(wB.view(G, N, H)), _P(bB.view(G, N) if bB is not None else zero(G, N))
        self.W_C, self.b_C = _P(wC.view(G, N, H)), _P(bC.view(G, N) if bC is not None else zero(G, N))
        self.W_dt, self.b_dt = _P(wdt), _P(bdt if bdt is not None else zero(nh))
        cw, cb = _conv_wb(sd, i, c)
        I, GN = c["I"], G * N
        self.conv_x, self.conv_x_b = _P(cw[:I].view(nh, hd, -1)), _P(cb[:I].view(nh, hd))
        self.conv_B, self.conv_B_b = _P(cw[I : I + GN].view(G, N, -1)), _P(cb[I : I + GN].view(G, N))
        self.conv_C, self.conv_C_b = _P(cw[I + GN :].view(G, N, -1)), _P(cb[I + GN :].view(G, N))
        self.dt_bias = _P(_mix(sd, i, "dt_bias"))
        self.A = _P(-torch.exp(_mix(sd, i, "A_log")))
        self.D = _P(_mix(sd, i, "D"))
        self.norm_g = _P(_mix(sd, i, "norm.weight").view(G, -1))  # (G, I / G)
        self.W_out = _P(_mix(sd, i, "out_proj.weight").view(H, nh, hd).permute(1, 2, 0))  # (heads, head_dim, hidden)
        self.b_out = _P(_mix(sd, i, "out_proj.bias") if c["bias"] else zero(H))

    def _conv(self, u, w, b):  # u (B, T, a, d), w (a, d, K)
        K = self.c["K"]
        T = u.shape[1]
        up = F.pad(u, (0, 0, 0, 0, K - 1, 0))
        return torch.stack([up[:, k : k + T] for k in range(K)], -1).mul(w).sum(-1) + b

    def forward(self, u, m):
        c = self.c
        Bsz, T, _ = u.shape
        G, r = c["G"], c["nh"] // c["G"]
        if m is not None:
            u = u * m
        z = torch.einsum("bth,nph->btnp", u, self.W_z) + self.b_z
        x = torch.einsum("bth,nph->btnp", u, self.W_x) + self.b_x
        Bm = torch.einsum("bth,gnh->btgn", u, self.W_B) + self.b_B
        Cm = torch.einsum("bth,gnh->btgn", u, self.W_C) + self.b_C
        dt = _dt(torch.einsum("bth,nh->btn", u, self.W_dt) + self.b_dt, self.dt_bias, c)
        x = F.silu(self._conv(x, self.conv_x, self.conv_x_b))
        Bm = F.silu(self._conv(Bm, self.conv_B, self.conv_B_b))
        Cm = F.silu(self._conv(Cm, self.conv_C, self.conv_C_b))
        if m is not None:
            x, Bm, Cm = x * m[..., None], Bm * m[..., None], Cm * m[..., None]
        xg = x.view(Bsz, T, G, r, c["hd"])
        dtg = dt.view(Bsz, T, G, r)
        Ag = self.A.view(G, r)
        S = u.new_zeros(Bsz, G, r, c["hd"], c["N"])
        ys = []
        for t in range(T):
            S = S * torch.exp(dtg[:, t] * Ag)[..., None, None] + torch.einsum(
                "bgr,bgrp,bgn->bgrpn", dtg[:, t], xg[:, t], Bm[:, t]
            )
            ys.append(torch.einsum("bgrpn,bgn->bgrp", S, Cm[:, t]))
        y = torch.stack(ys, 1).reshape(Bsz, T, c["nh"], c["hd"]) + x * self.D[:, None]
        yz = y.reshape(Bsz, T, G, -1) * F.silu(z.reshape(Bsz, T, G, -1))
        yz = yz * torch.rsqrt(yz.pow(2).mean(-1, keepdim=True) + c["eps"]) * self.norm_g
        return torch.einsum("btnp,nph->bth", yz.view(Bsz, T, c["nh"], c["hd"]), self.W_out) + self.b_out


class _HeadsLayer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.pre_norm = _P(sd[f"backbone.layers.{i}.norm.weight"])
        self.ssm = _HeadsMixer(sd, c, i)

    def forward(self, h, m):
        return h + self.ssm(_rms(h, self.pre_norm, self.c["eps"]), m)


class Mamba2Heads(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.tok = _P(sd["backbone.embeddings.weight"])
        self.stack = nn.ModuleList([_HeadsLayer(sd, c, i) for i in range(c["L"])])
        self.out_norm = _P(sd["backbone.norm_f.weight"])
        self.unembed = _P(_head(sd).t())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        m = _mask3(attention_mask)
        h = F.embedding(input_ids, self.tok)
        for layer in self.stack:
            h = layer(h, m)
        return torch.einsum("bth,hv->btv", _rms(h, self.out_norm, self.c["eps"]), self.unembed).float()


# ----------------------------------------------------------------------------------------------------------------
# mamba2_folded_gains
# ----------------------------------------------------------------------------------------------------------------


class _FoldedMixer(_ChunkMixer):
    def __init__(self, sd, c, i):
        super().__init__(sd, c, i)
        self.block = c["chunk"]
        g_in = sd[f"backbone.layers.{i}.norm.weight"]
        with torch.no_grad():
            self.in_proj_t.mul_(g_in[:, None])  # (hidden, out): block norm gain on the input rows
            self.in_bias[-c["nh"] :] += self.dt_bias  # dt_bias folded into the dt rows' bias
            self.out_proj_t.mul_(self.gate_norm[:, None])  # gated-norm gain on out_proj's input rows
        del self.dt_bias, self.gate_norm

    def forward(self, u, m):
        c = self.c
        Bsz, T, _ = u.shape
        if m is not None:
            u = u * m
        z, xBC, dt = (u @ self.in_proj_t + self.in_bias).split([c["I"], c["conv_dim"], c["nh"]], -1)
        xBC = F.conv1d(xBC.transpose(1, 2), self.conv_weight, self.conv_bias, padding=c["K"] - 1, groups=c["conv_dim"])
        xBC = F.silu(xBC[..., :T].transpose(1, 2))
        if m is not None:
            xBC = xBC * m
        x, Bm, Cm = xBC.split([c["I"], c["G"] * c["N"], c["G"] * c["N"]], -1)
        x = x.reshape(Bsz, T, c["nh"], c["hd"])
        dt = _dt(dt, None, c)
        y = self.scan(x, dt, -torch.exp(self.A_log), Bm.view(Bsz, T, c["G"], -1), Cm.view(Bsz, T, c["G"], -1))
        y = y + x * self.D[:, None]
        y = _gated_rms(y.reshape(Bsz, T, -1), z, None, c["G"], c["eps"])
        return y @ self.out_proj_t + self.out_bias


class _FoldedBlock(_ChunkBlock):
    mixer_cls = _FoldedMixer

    def __init__(self, sd, c, i):
        super().__init__(sd, c, i)
        del self.norm

    def forward(self, h, m):
        return h + self.mixer(_rms(h, None, self.c["eps"]), m)


class Mamba2Folded(Mamba2Chunked):
    block_cls = _FoldedBlock

    def __init__(self, sd, c):
        super().__init__(sd, c)
        self.lm_head = _linear(_head(sd) * sd["backbone.norm_f.weight"][None, :])  # separate (untied) folded head
        del self.norm_f

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        m = _mask3(attention_mask)
        h = self.embeddings(input_ids)
        for blk in self.blocks:
            h = blk(h, m)
        return self.lm_head(_rms(h, None, self.c["eps"])).float()


# ----------------------------------------------------------------------------------------------------------------
# mamba2_stacked_functional
# ----------------------------------------------------------------------------------------------------------------


def _pscan(a, b):
    """Hillis-Steele inclusive scan of S_t = a_t S_{t-1} + b_t along dim 1. a (B, T, h), b (B, T, h, p, n)."""
    T = a.shape[1]
    d = 1
    while d < T:
        a_prev = F.pad(a, (0, 0, d, 0), value=1.0)[:, :T]
        b_prev = F.pad(b, (0, 0, 0, 0, 0, 0, d, 0))[:, :T]
        b = b + a[..., None, None] * b_prev
        a = a * a_prev
        d *= 2
    return b


def _stacked_forward(W, c, input_ids, attention_mask):
    Bsz, T = input_ids.shape
    I, G, N, nh, hd, K, eps = c["I"], c["G"], c["N"], c["nh"], c["hd"], c["K"], c["eps"]
    m = _mask3(attention_mask)
    h = F.embedding(input_ids, W["embed"])
    r = nh // G
    for l in range(c["L"]):
        u = _rms(h, W["norm"][l], eps)
        if m is not None:
            u = u * m
        z, xBC, dt = F.linear(u, W["in_w"][l], W["in_b"][l]).split([I, c["conv_dim"], nh], -1)
        xBC = F.pad(xBC.transpose(1, 2), (K - 1, 0))
        xBC = F.conv1d(xBC, W["conv_w"][l][:, None], W["conv_b"][l], groups=c["conv_dim"])
        xBC = F.silu(xBC.transpose(1, 2))
        if m is not None:
            xBC = xBC * m
        x, Bm, Cm = xBC.split([I, G * N, G * N], -1)
        x = x.view(Bsz, T, nh, hd)
        Bm = Bm.view(Bsz, T, G, N).repeat_interleave(r, 2)
        Cm = Cm.view(Bsz, T, G, N).repeat_interleave(r, 2)
        dt = _dt(dt, W["dt_bias"][l], c)
        a = torch.exp(dt * -torch.exp(W["A_log"][l]))  # (B, T, nh)
        b = (dt[..., None] * x)[..., None] * Bm[:, :, :, None, :]  # (B, T, nh, hd, N)
        S = _pscan(a, b)
        y = torch.einsum("bthpn,bthn->bthp", S, Cm) + x * W["D"][l][:, None]
        y = _gated_rms(y.reshape(Bsz, T, I), z, W["gnorm"][l], G, eps)
        h = h + F.linear(y, W["out_w"][l], W["out_b"][l])
    return F.linear(_rms(h, W["norm_f"], eps), W["head"]).float()


class Mamba2Stacked(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        L = c["L"]

        def st(name, default=None):
            return torch.stack([sd.get(f"backbone.layers.{i}.{name}", default) for i in range(L)])

        zeros_in = torch.zeros(c["I"] + c["conv_dim"] + c["nh"])
        kinds = {
            "norm": st("norm.weight"),
            "in_w": st("mixer.in_proj.weight"),
            "in_b": st("mixer.in_proj.bias", zeros_in),
            "conv_w": st("mixer.conv1d.weight")[:, :, 0],  # (L, channels, K)
            "conv_b": st("mixer.conv1d.bias", torch.zeros(c["conv_dim"])),
            "dt_bias": st("mixer.dt_bias"),
            "A_log": st("mixer.A_log"),
            "D": st("mixer.D"),
            "gnorm": st("mixer.norm.weight"),
            "out_w": st("mixer.out_proj.weight"),
            "out_b": st("mixer.out_proj.bias", torch.zeros(c["H"])),
            "embed": sd["backbone.embeddings.weight"],
            "norm_f": sd["backbone.norm_f.weight"],
            "head": _head(sd),
        }
        self.kinds = list(kinds)
        for n, t in kinds.items():
            self.register_buffer(n, t.float().clone().contiguous())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        W = {n: getattr(self, n) for n in self.kinds}
        return _stacked_forward(W, self.c, input_ids, attention_mask)


# ----------------------------------------------------------------------------------------------------------------
# mamba2_tied_backbone_head
# ----------------------------------------------------------------------------------------------------------------


class _TiedMixer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.proj = nn.ModuleDict(
            {
                "in": _linear(_mix(sd, i, "in_proj.weight"), _mix(sd, i, "in_proj.bias") if c["bias"] else None),
                "out": _linear(_mix(sd, i, "out_proj.weight"), _mix(sd, i, "out_proj.bias") if c["bias"] else None),
            }
        )
        cw, cb = _conv_wb(sd, i, c)
        self.ssm = nn.ParameterDict(
            {
                "conv_rev": _P(cw.flip(-1)),  # (channels, K), tap 0 = current token
                "conv_bias": _P(cb),
                "dt_bias": _P(_mix(sd, i, "dt_bias")),
                "A_log": _P(_mix(sd, i, "A_log")),
                "D_chan": _P(_mix(sd, i, "D").repeat_interleave(c["hd"])),  # (I,) per channel
                "norm": _P(_mix(sd, i, "norm.weight")),
            }
        )

    def forward(self, u, m):
        c, p = self.c, self.ssm
        Bsz, T, _ = u.shape
        if m is not None:
            u = u * m
        z, xBC, dt = self.proj["in"](u).split([c["I"], c["conv_dim"], c["nh"]], -1)
        conv = p["conv_bias"] + xBC * p["conv_rev"][:, 0]
        for k in range(1, c["K"]):
            conv = conv + F.pad(xBC, (0, 0, k, 0))[:, :T] * p["conv_rev"][:, k]  # k tokens back
        xBC = F.silu(conv)
        if m is not None:
            xBC = xBC * m
        xf, Bm, Cm = xBC.split([c["I"], c["G"] * c["N"], c["G"] * c["N"]], -1)
        x = xf.view(Bsz, T, c["nh"], c["hd"])
        r = c["nh"] // c["G"]
        Bm = Bm.view(Bsz, T, c["G"], c["N"]).repeat_interleave(r, 2)
        Cm = Cm.view(Bsz, T, c["G"], c["N"]).repeat_interleave(r, 2)
        dt = _dt(dt, p["dt_bias"], c)
        A = -torch.exp(p["A_log"])
        S = x.new_zeros(Bsz, c["nh"], c["hd"], c["N"])
        ys = []
        for t in range(T):
            S = torch.exp(dt[:, t] * A)[..., None, None] * S + torch.einsum(
                "bh,bhp,bhn->bhpn", dt[:, t], x[:, t], Bm[:, t]
            )
            ys.append(torch.einsum("bhpn,bhn->bhp", S, Cm[:, t]))
        y = torch.stack(ys, 1).reshape(Bsz, T, c["I"]) + xf * p["D_chan"]
        return self.proj["out"](_gated_rms(y, z, p["norm"], c["G"], c["eps"]))


class _TiedBackbone(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embedding = nn.Embedding(c["V"], c["H"], _weight=_P(sd["backbone.embeddings.weight"]))
        self.layers = nn.ModuleDict(
            {
                f"block{i}": nn.ModuleDict(
                    {
                        "norm": _RMSNorm(sd[f"backbone.layers.{i}.norm.weight"], c["eps"]),
                        "mixer": _TiedMixer(sd, c, i),
                    }
                )
                for i in range(c["L"])
            }
        )
        self.final_norm = _RMSNorm(sd["backbone.norm_f.weight"], c["eps"])

    def forward(self, input_ids, attention_mask=None):
        m = _mask3(attention_mask)
        h = self.embedding(input_ids)
        for blk in self.layers.values():
            h = h + blk["mixer"](blk["norm"](h), m)
        return self.final_norm(h)


class _RMSNorm(nn.Module):
    def __init__(self, g, eps):
        super().__init__()
        self.weight = _P(g)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


class _TiedHead(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding  # the backbone's nn.Embedding, shared

    def forward(self, h):
        return F.linear(h, self.embedding.weight).float()


class Mamba2TiedBackboneHead(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.backbone = _TiedBackbone(sd, c)
        if c["tied"]:
            self.head = _TiedHead(self.backbone.embedding)
        else:
            self.head = _TiedHead(nn.Embedding(c["V"], c["H"], _weight=_P(_head(sd))))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.backbone(input_ids, attention_mask))


# ----------------------------------------------------------------------------------------------------------------
# mamba2_split_conv_kc
# ----------------------------------------------------------------------------------------------------------------


class _SplitMixer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        w = _mix(sd, i, "in_proj.weight").split([c["I"], c["conv_dim"], c["nh"]], 0)
        b = _mix(sd, i, "in_proj.bias").split([c["I"], c["conv_dim"], c["nh"]], 0) if c["bias"] else [None] * 3
        self.z_proj, self.xbc_proj, self.dt_proj = _linear(w[0], b[0]), _linear(w[1], b[1]), _linear(w[2], b[2])
        cw, cb = _conv_wb(sd, i, c)
        sizes = [c["I"], c["G"] * c["N"], c["G"] * c["N"]]
        self.conv_kc = nn.ParameterList([_P(t.t()) for t in cw.split(sizes, 0)])  # x, B, C: (K, channels)
        self.conv_bias = nn.ParameterList([_P(t) for t in cb.split(sizes, 0)])
        self.dt_bias = _P(_mix(sd, i, "dt_bias"))
        self.A_log = _P(_mix(sd, i, "A_log"))
        self.D = _P(_mix(sd, i, "D"))
        self.norm = _RMSNormGated(_mix(sd, i, "norm.weight"), c["G"], c["eps"])
        self.out_proj = _linear(_mix(sd, i, "out_proj.weight"), _mix(sd, i, "out_proj.bias") if c["bias"] else None)

    def _conv(self, u, w_kc, b):  # u (B, T, C), w_kc (K, C)
        K, C = w_kc.shape
        y = F.conv1d(F.pad(u.transpose(1, 2), (K - 1, 0)), w_kc.t().unsqueeze(1), b, groups=C)
        return F.silu(y).transpose(1, 2)

    def forward(self, u, m):
        c = self.c
        Bsz, T, _ = u.shape
        if m is not None:
            u = u * m
        z, dt = self.z_proj(u), self.dt_proj(u)
        xs, Bs, Cs = self.xbc_proj(u).split([c["I"], c["G"] * c["N"], c["G"] * c["N"]], -1)
        x, Bm, Cm = (self._conv(t, w, b) for t, w, b in zip((xs, Bs, Cs), self.conv_kc, self.conv_bias))
        if m is not None:
            x, Bm, Cm = x * m, Bm * m, Cm * m
        x = x.view(Bsz, T, c["nh"], c["hd"])
        r = c["nh"] // c["G"]
        Bm = Bm.view(Bsz, T, c["G"], c["N"]).repeat_interleave(r, 2)
        Cm = Cm.view(Bsz, T, c["G"], c["N"]).repeat_interleave(r, 2)
        dt = _dt(dt, self.dt_bias, c)
        A = -torch.exp(self.A_log)
        St = u.new_zeros(Bsz, c["nh"], c["N"], c["hd"])  # transposed state (N, head_dim)
        ys = []
        for t in range(T):
            St = St * torch.exp(dt[:, t] * A)[:, :, None, None] + Bm[:, t, :, :, None] * (
                dt[:, t, :, None] * x[:, t]
            ).unsqueeze(2)
            ys.append((Cm[:, t, :, None, :] @ St).squeeze(2))  # (B, nh, hd)
        y = torch.stack(ys, 1) + x * self.D[:, None]
        return self.out_proj(self.norm(y.reshape(Bsz, T, -1), z))


class _RMSNormGated(nn.Module):
    def __init__(self, g, groups, eps):
        super().__init__()
        self.weight = _P(g)
        self.groups, self.eps = groups, eps

    def forward(self, y, z):
        return _gated_rms(y, z, self.weight, self.groups, self.eps)


class _SplitBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.norm = _RMSNorm(sd[f"backbone.layers.{i}.norm.weight"], c["eps"])
        self.mixer = _SplitMixer(sd, c, i)

    def forward(self, h, m):
        return h + self.mixer(self.norm(h), m)


class Mamba2SplitConv(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.embeddings = nn.Embedding(c["V"], c["H"], _weight=_P(sd["backbone.embeddings.weight"]))
        self.layers = nn.ModuleList([_SplitBlock(sd, c, i) for i in range(c["L"])])
        self.norm_f = _RMSNorm(sd["backbone.norm_f.weight"], c["eps"])
        self.lm_head = _linear(_head(sd))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        m = _mask3(attention_mask)
        h = self.embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, m)
        return self.lm_head(self.norm_f(h)).float()


# ----------------------------------------------------------------------------------------------------------------


_VARIANTS = {
    "": Mamba2Baseline,
    "mamba2_ssd_chunked": Mamba2Chunked,
    "mamba2_quadratic_dual": Mamba2Dual,
    "mamba2_step_cache": Mamba2Step,
    "mamba2_heads_axis": Mamba2Heads,
    "mamba2_folded_gains": Mamba2Folded,
    "mamba2_stacked_functional": Mamba2Stacked,
    "mamba2_tied_backbone_head": Mamba2TiedBackboneHead,
    "mamba2_split_conv_kc": Mamba2SplitConv,
}


def build(state_dict, config):
    if BUG not in _VARIANTS:
        raise ValueError(f"unknown layout variant {BUG!r}")
    c = _conf(config)
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    with torch.no_grad():
        model = _VARIANTS[BUG](sd, c)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
