"""Hand-written plain-PyTorch port of Qwen3.5 (text only, Qwen3_5ForCausalLM): a hybrid of Gated DeltaNet
linear-attention layers and gated full-attention layers.

Architecture as this port implements it:
- token embedding (no scaling); untied LM head; every RMSNorm outside the linear attention is zero-centred:
  rms(x) * (1 + w) (eps = config.rms_norm_eps), including the per-head q/k norms and the final norm.
- block i (pre-norm): h = h + Mixer(norm1(h)); h = h + SwiGLU(norm2(h)), down(silu(gate x) * up x).
  The mixer is config.layer_types[i]: "linear_attention" (Gated DeltaNet) or "full_attention".
- Gated DeltaNet (nk key heads of dk, nv value heads of dv, r = nv / nk):
  the input rows of padding tokens are zeroed (x * mask), then
  [q | k | v] = x Wqkv (q, k: nk*dk each, v: nv*dv), z = x Wz (nv*dv), b = x Wb (nv), a = x Wa (nv);
  [q | k | v] goes through a causal depthwise conv (kernel K, no bias, left zero padding) and SiLU;
  q, k are L2-normalised per head (x * rsqrt(sum x^2 + 1e-6)), repeated r times (key head j // r serves value
  head j), q scaled by dk^-1/2; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (log decay);
  delta rule per value head: S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - k_t^T e^{g_t} S_{t-1}))^T, o_t = q_t^T S_t
  (S: dk x dv, zero start); out = Wout (rms(o) * w_norm * silu(z)) per value head (this gated norm's gain is
  NOT zero-centred).
- full attention: q_proj gives per head [q_h (hd) | gate_h (hd)]; q, k get the per-head (1 + w) RMSNorm, then
  partial RoPE (rotary dim = hd * partial_rotary_factor, rotate-half pairs (i, i + rot/2), theta from config);
  GQA (kv head j serves query heads j*G .. j*G+G-1), causal softmax(q k^T / sqrt(hd)) with key padding masked;
  out = Wo ((attn) * sigmoid(gate)).
- positions: position_ids, else 0..T-1 (variants marked below derive them from the attention mask instead).

Layout of the baseline (BUG == ""), own names, all matrices stored TRANSPOSED (in, out) and applied as x @ W:
- tok_emb (V, H); head_t (H, V); norm gains stored as g = 1 + w (precomputed) for norm1/norm2/q/k/final norm.
- DeltaNet mixer: w_qkv_t, w_z_t, w_b_t, w_a_t; conv_w (C, K) (the (C, 1, K) conv weight squeezed) applied by
  left zero padding + a sum of K shifted slices; neg_A = -exp(A_log) precomputed; dt_bias; out_norm_g; w_out_t;
  the delta rule as a plain token-by-token recurrence (Transformers runs a chunked form).
- attention mixer: q_proj split at load into w_q_t and w_gate_t (heads contiguous); w_k_t, w_v_t, w_o_t;
  explicit softmax with an additive float mask (finfo.min), RoPE cos/sin computed on the fly.
- MLP: w_gate_t, w_up_t, w_down_t.

Variants (CLEAN, each a correct port):
- q35_chunked_delta: the delta rule in chunks of 8 (WY form: a unit lower-triangular solve per chunk, the state
  carried between chunks, zero-padded tail); cos/sin tables for all max_position_embeddings positions precomputed
  as buffers and gathered by position.
- q35_next_grouped_inproj: Qwen3-Next's original projection layout: one in_proj_qkvz (out, in) grouped per key
  head [q_h | k_h | v_(r heads) | z_(r heads)] and one in_proj_ba grouped per key head [b_(r) | a_(r)], regrouped
  at run time; A kept as A_log (exp at run time); nn.Linear-style (out, in) weights with F.linear.
- q35_fla_split_conv: flash-linear-attention's layer layout: separate q/k/v/g(z)/b/a nn.Linear projections in an
  nn.ModuleDict and three separate depthwise nn.Conv1d modules (q_conv1d, k_conv1d, v_conv1d, weight
  (C, 1, K), padding K - 1, trimmed), gated output norm "o_norm" with the raw gain; raw (w) norm weights with the
  1 + w added at run time.
- q35_meta_complex_rope: attention heads as a separate weight axis (wq (nh, hd, H), wk/wv (nkv, hd, H),
  wo (H, nh, hd)) with einsum; Meta-style q/k row permutation of the rotary dims to interleaved pairs (q/k norm
  gains permuted alike) and RoPE as complex multiplication with a precomputed freqs_cis buffer.
- q35_folded_gains: every norm gain folded into the next projection (norm1 into the DeltaNet in-projections and
  q/gate/k/v, norm2 into gate/up, the final norm into the head, the gated norm's gain into out_proj's columns);
  the attention scale 1/sqrt(hd) folded into the q-norm gain.
- q35_stacked_functional: weights stacked per kind (DeltaNet layers (n_lin, ...), attention layers (n_att, ...),
  MLP and norms (L, ...)) in an nn.ParameterDict and one functional forward reading that dict; gate/up fused
  into one (H, 2I) matrix; q_proj kept in Transformers' per-head [q | gate] interleaved order (transposed).
- q35_sdpa_fused_qkv: attention projections fused in a non-HF order [k | v | q | gate] (out, in);
  F.scaled_dot_product_attention with a boolean mask (padding rows keep their diagonal); MLP gate/up fused
  row-interleaved [g0, u0, g1, u1, ...]; positions from the attention mask (cumsum - 1) when none are given.
- q35_parallel_delta: the delta rule fully parallel over the whole sequence (one triangular solve, decays from a
  segment-sum matrix); the conv by unfold over (B, C, T); A stored as exp(A_log) (positive rate); a backbone
  returning the last (normed) hidden states and a separate LM-head module.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = []
PADDING_ONLY = []
CLEAN = [
    "q35_chunked_delta",  # chunked WY delta rule (chunk 8, carried state) + cos/sin buffers for all positions
    "q35_next_grouped_inproj",  # Qwen3-Next in_proj_qkvz / in_proj_ba grouped per key head, (out, in) F.linear
    "q35_fla_split_conv",  # fla-style separate q/k/v/z/b/a Linears + three nn.Conv1d short convs, ModuleDict
    "q35_meta_complex_rope",  # heads as a weight axis (einsum), Meta q/k permutation, complex-number partial RoPE
    "q35_folded_gains",  # all norm gains folded into the next projections, attention scale into the q-norm gain
    "q35_stacked_functional",  # per-kind stacked (n_layers, ...) tensors, one functional forward, fused gate/up
    "q35_sdpa_fused_qkv",  # fused [k|v|q|gate] (out, in), SDPA + bool mask, interleaved gate/up, mask positions
    "q35_parallel_delta",  # whole-sequence parallel delta rule, unfold conv, A = exp(A_log), backbone + head module
]


# ----------------------------------------------------------------------------------------------- helpers
def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _l2(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _conv_pad_sum(x, w):
    """x (B, T, C), w (C, K): causal depthwise conv, out[t] = sum_k w[:, k] x[t - K + 1 + k]."""
    K, T = w.shape[1], x.shape[1]
    xp = F.pad(x, (0, 0, K - 1, 0))
    return sum(xp[:, k : k + T] * w[:, k] for k in range(K))


def _conv_unfold(x, w):
    """The same conv by unfold over (B, C, T)."""
    K = w.shape[1]
    xc = F.pad(x.transpose(1, 2), (K - 1, 0))  # (B, C, T + K - 1)
    win = xc.unfold(-1, K, 1)  # (B, C, T, K)
    return torch.einsum("bctk,ck->btc", win, w)


def _delta_recurrent(q, k, v, g, beta):
    """q, k (B, N, T, dk), v (B, N, T, dv), g, beta (B, N, T) -> (B, N, T, dv)."""
    B, N, T, dk = k.shape
    S = q.new_zeros(B, N, dk, v.shape[-1])
    out = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        mem = torch.einsum("bnk,bnkv->bnv", kt, S)
        delta = (v[:, :, t] - mem) * beta[:, :, t, None]
        S = S + kt[..., :, None] * delta[..., None, :]
        out.append(torch.einsum("bnk,bnkv->bnv", q[:, :, t], S))
    return torch.stack(out, 2)


def _delta_chunked(q, k, v, g, beta, chunk=8):
    """Chunked (WY) delta rule: per chunk (I + A) U = beta (V - e^gamma K S0), A_tj = beta_t e^{gamma_t - gamma_j}
    k_t.k_j (j < t); o = e^gamma Q S0 + (Q K^T o D) U; S <- e^{gamma_C} S0 + (K e^{gamma_C - gamma})^T U."""
    B, N, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    S = q.new_zeros(B, N, dk, dv)
    outs = []
    for c in range(n):
        sl = slice(c * chunk, (c + 1) * chunk)
        qc, kc, vc, gc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
        gam = gc.cumsum(-1)
        D = (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")).exp()
        A = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * D).tril(-1)
        rhs = bc[..., None] * (vc - gam.exp()[..., None] * (kc @ S))
        U = torch.linalg.solve_triangular(A + eye, rhs, upper=False)
        outs.append(gam.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * D) @ U)
        S = (
            gam[..., -1].exp()[..., None, None] * S
            + (kc * (gam[..., -1:] - gam).exp()[..., None]).transpose(-1, -2) @ U
        )
    return torch.cat(outs, 2)[:, :, :T]


def _segsum(x):
    """x (..., T) -> (..., T, T) with out[t, j] = sum_{j < i <= t} x_i (t >= j), -inf above the diagonal."""
    T = x.shape[-1]
    xx = x[..., None].expand(*x.shape, T)  # [..., i, j] = x_i
    low = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1)
    ss = xx.masked_fill(~low, 0).cumsum(-2)
    return ss.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril(), float("-inf"))


def _delta_parallel(q, k, v, g, beta):
    """The whole sequence as one block (zero initial state): (I + A) U = beta V, O = (Q K^T o D) U."""
    T = k.shape[2]
    D = _segsum(g).exp()
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * D).tril(-1)
    eye = torch.eye(T, dtype=q.dtype, device=q.device)
    U = torch.linalg.solve_triangular(A + eye, beta[..., None] * v, upper=False)
    return ((q @ k.transpose(-1, -2)) * D) @ U


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def _rope_partial(x, cos, sin):
    """x (B, n, T, hd); cos/sin (B, 1, T, rot) in [f, f] halves."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + _rotate_half(xr) * sin, xp), -1)


def _inv_freq(config):
    rp = config.rope_parameters
    hd = config.head_dim
    rot = int(hd * rp.get("partial_rotary_factor", 1.0))
    return 1.0 / (rp["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))


def _additive_mask(mask, T, dtype, device):
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    allowed = causal[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def _bool_mask(mask, T, device):
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
        allowed = allowed | torch.eye(T, dtype=torch.bool, device=device)  # padding rows keep themselves
    return allowed


def _attend(q, k, v, add_mask, scale):
    """explicit softmax, q (B, nh, T, hd), k/v (B, nkv, T, hd)."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, 1)
    v = v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale + add_mask
    return s.softmax(-1) @ v


# ------------------------------------------------------------------------------------------------ modules
class _Dims:
    def __init__(self, c):
        self.H = c.hidden_size
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rot = int(self.hd * c.rope_parameters.get("partial_rotary_factor", 1.0))
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.r = self.nv // self.nk
        self.kd, self.vd = self.nk * self.dk, self.nv * self.dv
        self.K = c.linear_conv_kernel_dim
        self.eps = c.rms_norm_eps
        self.types = list(c.layer_types)
        self.L = c.num_hidden_layers
        self.max_pos = c.max_position_embeddings


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


class DeltaMixer(nn.Module):
    def __init__(self, sd, pre, d, variant, fold=None):
        super().__init__()
        self.d, self.variant = d, variant
        W = lambda n: sd[pre + n].float()  # noqa: E731
        conv = W("conv1d.weight").squeeze(1)  # (C, K)
        if variant == "q35_next_grouped_inproj":
            q, k, v = W("in_proj_qkv.weight").split([d.kd, d.kd, d.vd])
            z, b, a = W("in_proj_z.weight"), W("in_proj_b.weight"), W("in_proj_a.weight")
            rows, ba = [], []
            for h in range(d.nk):
                rows += [q[h * d.dk : (h + 1) * d.dk], k[h * d.dk : (h + 1) * d.dk]]
                rows += [v[h * d.r * d.dv : (h + 1) * d.r * d.dv], z[h * d.r * d.dv : (h + 1) * d.r * d.dv]]
                ba += [b[h * d.r : (h + 1) * d.r], a[h * d.r : (h + 1) * d.r]]
            self.in_proj_qkvz = _p(torch.cat(rows))
            self.in_proj_ba = _p(torch.cat(ba))
            self.conv_w = _p(conv)
            self.A_log = _p(W("A_log"))
            self.dt_bias = _p(W("dt_bias"))
            self.norm_w = _p(W("norm.weight"))
            self.out_proj = _p(W("out_proj.weight"))
            return
        if variant == "q35_fla_split_conv":
            qkv = W("in_proj_qkv.weight")
            lin = {}
            for name, w in (
                ("q_proj", qkv[: d.kd]),
                ("k_proj", qkv[d.kd : 2 * d.kd]),
                ("v_proj", qkv[2 * d.kd :]),
                ("g_proj", W("in_proj_z.weight")),
                ("b_proj", W("in_proj_b.weight")),
                ("a_proj", W("in_proj_a.weight")),
            ):
                m = nn.Linear(w.shape[1], w.shape[0], bias=False)
                m.weight = _p(w)
                lin[name] = m
            lin["o_proj"] = nn.Linear(d.vd, d.H, bias=False)
            lin["o_proj"].weight = _p(W("out_proj.weight"))
            self.proj = nn.ModuleDict(lin)
            convs = {}
            for name, sl in (
                ("q_conv1d", slice(0, d.kd)),
                ("k_conv1d", slice(d.kd, 2 * d.kd)),
                ("v_conv1d", slice(2 * d.kd, None)),
            ):
                w = conv[sl]
                m = nn.Conv1d(w.shape[0], w.shape[0], d.K, groups=w.shape[0], padding=d.K - 1, bias=False)
                m.weight = _p(w[:, None, :])
                convs[name] = m
            self.convs = nn.ModuleDict(convs)
            self.A_log = _p(W("A_log"))
            self.dt_bias = _p(W("dt_bias"))
            self.o_norm = _p(W("norm.weight"))
            return
        wqkv, wz, wb, wa = (W(n + ".weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        wout = W("out_proj.weight")
        gn = W("norm.weight")
        if fold is not None:  # fold the block's input-norm gain (1 + w) into the in-projections' input columns
            wqkv, wz, wb, wa = (w * fold for w in (wqkv, wz, wb, wa))
            wout = wout * gn.repeat(d.nv)[None, :]  # gated norm gain into out_proj's columns
            gn = torch.ones_like(gn)
        self.w_qkv_t, self.w_z_t, self.w_b_t, self.w_a_t = (_p(w.t()) for w in (wqkv, wz, wb, wa))
        self.conv_w = _p(conv)
        if variant == "q35_parallel_delta":
            self.A = _p(W("A_log").exp())
        else:
            self.neg_A = _p(-W("A_log").exp())
        self.dt_bias = _p(W("dt_bias"))
        if fold is None:
            self.out_norm_g = _p(gn)
        self.w_out_t = _p(wout.t())

    def forward(self, x, mask):
        d, V = self.d, self.variant
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        B, T, _ = x.shape
        if V == "q35_next_grouped_inproj":
            qkvz = F.linear(x, self.in_proj_qkvz).view(B, T, d.nk, -1)
            q, k, v, z = qkvz.split([d.dk, d.dk, d.r * d.dv, d.r * d.dv], -1)
            b, a = F.linear(x, self.in_proj_ba).view(B, T, d.nk, 2 * d.r).split([d.r, d.r], -1)
            mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1)
            mixed = F.silu(_conv_pad_sum(mixed, self.conv_w))
            q, k, v = mixed.split([d.kd, d.kd, d.vd], -1)
            z, b, a = z.reshape(B, T, d.nv, d.dv), b.reshape(B, T, d.nv), a.reshape(B, T, d.nv)
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        elif V == "q35_fla_split_conv":
            P, C = self.proj, self.convs

            def short_conv(m, y):
                return F.silu(m(y.transpose(1, 2))[..., :T]).transpose(1, 2)

            q = short_conv(C["q_conv1d"], P["q_proj"](x))
            k = short_conv(C["k_conv1d"], P["k_proj"](x))
            v = short_conv(C["v_conv1d"], P["v_proj"](x))
            z = P["g_proj"](x).view(B, T, d.nv, d.dv)
            b, a = P["b_proj"](x), P["a_proj"](x)
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        else:
            mixed = x @ self.w_qkv_t
            if V == "q35_parallel_delta":
                mixed = F.silu(_conv_unfold(mixed, self.conv_w))
            else:
                mixed = F.silu(_conv_pad_sum(mixed, self.conv_w))
            q, k, v = mixed.split([d.kd, d.kd, d.vd], -1)
            z = (x @ self.w_z_t).view(B, T, d.nv, d.dv)
            b, a = x @ self.w_b_t, x @ self.w_a_t
            if V == "q35_parallel_delta":
                g = -self.A * F.softplus(a + self.dt_bias)
            else:
                g = self.neg_A * F.softplus(a + self.dt_bias)
        beta = b.sigmoid()
        q = _l2(q.reshape(B, T, d.nk, d.dk)).repeat_interleave(d.r, 2) * d.dk**-0.5
        k = _l2(k.reshape(B, T, d.nk, d.dk)).repeat_interleave(d.r, 2)
        v = v.reshape(B, T, d.nv, d.dv)
        args = [t.transpose(1, 2) for t in (q, k, v)] + [g.transpose(1, 2), beta.transpose(1, 2)]
        if V == "q35_chunked_delta":
            o = _delta_chunked(*args, chunk=8)
        elif V == "q35_parallel_delta":
            o = _delta_parallel(*args)
        else:
            o = _delta_recurrent(*args)
        o = o.transpose(1, 2)  # (B, T, nv, dv)
        if V == "q35_next_grouped_inproj":
            o = _rms(o, d.eps) * self.norm_w * F.silu(z)
            return F.linear(o.reshape(B, T, -1), self.out_proj)
        if V == "q35_fla_split_conv":
            o = _rms(o, d.eps) * self.o_norm * F.silu(z)
            return self.proj["o_proj"](o.reshape(B, T, -1))
        o = _rms(o, d.eps) * F.silu(z)
        if hasattr(self, "out_norm_g"):
            o = o * self.out_norm_g
        return o.reshape(B, T, -1) @ self.w_out_t


def _meta_perm(hd, rot):
    """rows of one head: rotary half-split pairs (i, i + rot/2) -> interleaved (2i, 2i + 1); the rest unchanged."""
    idx = []
    for i in range(rot // 2):
        idx += [i, i + rot // 2]
    return torch.tensor(idx + list(range(rot, hd)))


class AttnMixer(nn.Module):
    def __init__(self, sd, pre, d, variant, fold=None):
        super().__init__()
        self.d, self.variant = d, variant
        W = lambda n: sd[pre + n].float()  # noqa: E731
        qg = W("q_proj.weight").view(d.nh, 2, d.hd, d.H)  # per head [q | gate]
        wq, wgate = qg[:, 0].reshape(-1, d.H), qg[:, 1].reshape(-1, d.H)
        wk, wv, wo = W("k_proj.weight"), W("v_proj.weight"), W("o_proj.weight")
        qn, kn = 1.0 + W("q_norm.weight"), 1.0 + W("k_norm.weight")
        if variant == "q35_meta_complex_rope":
            perm = _meta_perm(d.hd, d.rot)
            self.wq = _p(wq.view(d.nh, d.hd, d.H)[:, perm])
            self.wgate = _p(wgate.view(d.nh, d.hd, d.H))
            self.wk = _p(wk.view(d.nkv, d.hd, d.H)[:, perm])
            self.wv = _p(wv.view(d.nkv, d.hd, d.H))
            self.wo = _p(wo.view(d.H, d.nh, d.hd))
            self.q_gain, self.k_gain = _p(qn[perm]), _p(kn[perm])
            return
        if variant == "q35_sdpa_fused_qkv":
            self.w_kvqg = _p(torch.cat([wk, wv, wq, wgate]))
            self.w_o = _p(wo)
            self.q_gain, self.k_gain = _p(qn), _p(kn)
            return
        if fold is not None:
            wq, wgate, wk, wv = (w * fold for w in (wq, wgate, wk, wv))
            qn = qn * d.hd**-0.5  # attention scale folded into the q-norm gain
        self.w_q_t, self.w_gate_t, self.w_k_t, self.w_v_t = (_p(w.t()) for w in (wq, wgate, wk, wv))
        self.w_o_t = _p(wo.t())
        self.q_gain, self.k_gain = _p(qn), _p(kn)
        self.scale = 1.0 if fold is not None else d.hd**-0.5

    def forward(self, x, rope, masks):
        d, V = self.d, self.variant
        B, T, _ = x.shape
        if V == "q35_meta_complex_rope":
            q = torch.einsum("bth,ndh->bntd", x, self.wq)
            gate = torch.einsum("bth,ndh->btnd", x, self.wgate).reshape(B, T, -1)
            k = torch.einsum("bth,ndh->bntd", x, self.wk)
            v = torch.einsum("bth,ndh->bntd", x, self.wv)
            q, k = _rms(q, d.eps) * self.q_gain, _rms(k, d.eps) * self.k_gain
            fc = rope[:, None]  # (B, 1, T, rot/2) complex

            def rot(t):
                tr = torch.view_as_complex(t[..., : d.rot].reshape(*t.shape[:-1], -1, 2).contiguous())
                return torch.cat([torch.view_as_real(tr * fc).flatten(-2), t[..., d.rot :]], -1)

            o = _attend(rot(q), rot(k), v, masks["add"], d.hd**-0.5)
            o = o.transpose(1, 2) * torch.sigmoid(gate).view(B, T, d.nh, d.hd)
            return torch.einsum("btnd,hnd->bth", o, self.wo)
        cos, sin = rope
        if V == "q35_sdpa_fused_qkv":
            k, v, q, gate = F.linear(x, self.w_kvqg).split([d.nkv * d.hd, d.nkv * d.hd, d.nh * d.hd, d.nh * d.hd], -1)
        else:
            q, gate, k, v = x @ self.w_q_t, x @ self.w_gate_t, x @ self.w_k_t, x @ self.w_v_t
        q = (_rms(q.view(B, T, d.nh, d.hd), d.eps) * self.q_gain).transpose(1, 2)
        k = (_rms(k.view(B, T, d.nkv, d.hd), d.eps) * self.k_gain).transpose(1, 2)
        v = v.view(B, T, d.nkv, d.hd).transpose(1, 2)
        q, k = _rope_partial(q, cos, sin), _rope_partial(k, cos, sin)
        if V == "q35_sdpa_fused_qkv":
            G = d.nh // d.nkv
            o = F.scaled_dot_product_attention(
                q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=masks["bool"]
            )
        else:
            o = _attend(q, k, v, masks["add"], self.scale)
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
        if V == "q35_sdpa_fused_qkv":
            return F.linear(o, self.w_o)
        return o @ self.w_o_t


class Block(nn.Module):
    def __init__(self, sd, i, d, variant):
        super().__init__()
        pre = f"model.layers.{i}."
        self.kind = d.types[i]
        self.variant = variant
        self.d = d
        g1 = 1.0 + sd[pre + "input_layernorm.weight"].float()
        g2 = 1.0 + sd[pre + "post_attention_layernorm.weight"].float()
        folded = variant == "q35_folded_gains"
        if self.kind == "linear_attention":
            self.mixer = DeltaMixer(sd, pre + "linear_attn.", d, variant, fold=g1 if folded else None)
        else:
            self.mixer = AttnMixer(sd, pre + "self_attn.", d, variant, fold=g1 if folded else None)
        wg, wu, wd = (sd[pre + f"mlp.{n}_proj.weight"].float() for n in ("gate", "up", "down"))
        if variant == "q35_fla_split_conv":
            self.norm1_w = _p(sd[pre + "input_layernorm.weight"])  # raw w, 1 + w at run time
            self.norm2_w = _p(sd[pre + "post_attention_layernorm.weight"])
        elif not folded:
            self.norm1_g, self.norm2_g = _p(g1), _p(g2)
        else:
            wg, wu = wg * g2, wu * g2
        if variant == "q35_sdpa_fused_qkv":
            self.w_gu_il = _p(torch.stack([wg, wu], 1).reshape(-1, d.H))  # rows g0, u0, g1, u1, ...
            self.w_down = _p(wd)
        else:
            self.w_gate_t, self.w_up_t, self.w_down_t = _p(wg.t()), _p(wu.t()), _p(wd.t())

    def _norm(self, x, which):
        if self.variant == "q35_fla_split_conv":
            return _rms(x, self.d.eps) * (1.0 + getattr(self, f"norm{which}_w"))
        if self.variant == "q35_folded_gains":
            return _rms(x, self.d.eps)
        return _rms(x, self.d.eps) * getattr(self, f"norm{which}_g")

    def forward(self, h, rope, masks, mask):
        x = self._norm(h, 1)
        if self.kind == "linear_attention":
            h = h + self.mixer(x, mask)
        else:
            h = h + self.mixer(x, rope, masks)
        x = self._norm(h, 2)
        if self.variant == "q35_sdpa_fused_qkv":
            gu = F.linear(x, self.w_gu_il).view(*x.shape[:-1], -1, 2)
            return h + F.linear(F.silu(gu[..., 0]) * gu[..., 1], self.w_down)
        return h + (F.silu(x @ self.w_gate_t) * (x @ self.w_up_t)) @ self.w_down_t


class Qwen35Port(nn.Module):
    """Baseline and most variants: embedding, a ModuleList of blocks, final norm, transposed head."""

    def __init__(self, sd, config, variant):
        super().__init__()
        d = self.d = _Dims(config)
        self.variant = variant
        self.tok_emb = _p(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([Block(sd, i, d, variant) for i in range(d.L)])
        gf = 1.0 + sd["model.norm.weight"].float()
        head = sd["lm_head.weight"].float()
        if variant == "q35_folded_gains":
            head = head * gf
        else:
            self.norm_g = _p(gf)
        self.head_t = _p(head.t())
        inv = _inv_freq(config)
        self.register_buffer("inv_freq", inv, persistent=False)
        if variant in ("q35_chunked_delta", "q35_meta_complex_rope"):
            ang = torch.arange(d.max_pos, dtype=torch.float)[:, None] * inv[None]
            if variant == "q35_meta_complex_rope":
                self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)
            else:
                emb = torch.cat([ang, ang], -1)
                self.register_buffer("cos_table", emb.cos(), persistent=False)
                self.register_buffer("sin_table", emb.sin(), persistent=False)

    def _positions(self, ids, attention_mask, position_ids):
        B, T = ids.shape
        if position_ids is not None:
            return position_ids
        if self.variant == "q35_sdpa_fused_qkv" and attention_mask is not None:
            return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return torch.arange(T, device=ids.device)[None].expand(B, T)

    def _rope(self, pos):
        if self.variant == "q35_meta_complex_rope":
            return self.freqs_cis[pos]
        if self.variant == "q35_chunked_delta":
            return self.cos_table[pos][:, None], self.sin_table[pos][:, None]
        ang = pos[..., None].float() * self.inv_freq
        emb = torch.cat([ang, ang], -1)
        return emb.cos()[:, None], emb.sin()[:, None]

    def hidden(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        pos = self._positions(input_ids, attention_mask, position_ids)
        rope = self._rope(pos)
        masks = {
            "add": _additive_mask(attention_mask, T, torch.float32, input_ids.device),
            "bool": _bool_mask(attention_mask, T, input_ids.device),
        }
        h = F.embedding(input_ids, self.tok_emb)
        for blk in self.blocks:
            h = blk(h, rope, masks, attention_mask)
        h = _rms(h, self.d.eps)
        return h if self.variant == "q35_folded_gains" else h * self.norm_g

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return (self.hidden(input_ids, attention_mask, position_ids) @ self.head_t).float()


class Backbone(Qwen35Port):
    """q35_parallel_delta: returns only the final normed hidden states; the head lives in LMHead."""

    def __init__(self, sd, config, variant):
        super().__init__(sd, config, variant)
        del self.head_t

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.hidden(input_ids, attention_mask, position_ids)


class LMHead(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = _p(weight)

    def forward(self, h):
        return F.linear(h, self.weight)


class Qwen35WithHead(nn.Module):
    def __init__(self, sd, config, variant):
        super().__init__()
        self.backbone = Backbone(sd, config, variant)
        self.lm_head = LMHead(sd["lm_head.weight"].float())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.lm_head(self.backbone(input_ids, attention_mask, position_ids)).float()


# --------------------------------------------------------------------------- stacked functional variant
def _stack_weights(sd, d):
    lin = [i for i, t in enumerate(d.types) if t == "linear_attention"]
    att = [i for i, t in enumerate(d.types) if t != "linear_attention"]
    L = lambda i, n: sd[f"model.layers.{i}.{n}"].float()  # noqa: E731
    W = {
        "emb": sd["model.embed_tokens.weight"].float(),
        "head_t": sd["lm_head.weight"].float().t(),
        "final_w": sd["model.norm.weight"].float(),
        "norm1_w": torch.stack([L(i, "input_layernorm.weight") for i in range(d.L)]),
        "norm2_w": torch.stack([L(i, "post_attention_layernorm.weight") for i in range(d.L)]),
        "w_gu_t": torch.stack(
            [torch.cat([L(i, "mlp.gate_proj.weight"), L(i, "mlp.up_proj.weight")]).t() for i in range(d.L)]
        ),
        "w_down_t": torch.stack([L(i, "mlp.down_proj.weight").t() for i in range(d.L)]),
    }
    if lin:
        for key, n in (
            ("dn_qkv_t", "in_proj_qkv"),
            ("dn_z_t", "in_proj_z"),
            ("dn_b_t", "in_proj_b"),
            ("dn_a_t", "in_proj_a"),
            ("dn_out_t", "out_proj"),
        ):
            W[key] = torch.stack([L(i, f"linear_attn.{n}.weight").t() for i in lin])
        W["dn_conv"] = torch.stack([L(i, "linear_attn.conv1d.weight").squeeze(1) for i in lin])
        W["dn_A_log"] = torch.stack([L(i, "linear_attn.A_log") for i in lin])
        W["dn_dt_bias"] = torch.stack([L(i, "linear_attn.dt_bias") for i in lin])
        W["dn_norm"] = torch.stack([L(i, "linear_attn.norm.weight") for i in lin])
    if att:
        for key, n in (("at_qg_t", "q_proj"), ("at_k_t", "k_proj"), ("at_v_t", "v_proj"), ("at_o_t", "o_proj")):
            W[key] = torch.stack([L(i, f"self_attn.{n}.weight").t() for i in att])
        W["at_qn"] = torch.stack([L(i, "self_attn.q_norm.weight") for i in att])
        W["at_kn"] = torch.stack([L(i, "self_attn.k_norm.weight") for i in att])
    return W


def _functional_forward(W, d, inv_freq, ids, attention_mask, position_ids):
    B, T = ids.shape
    pos = position_ids if position_ids is not None else torch.arange(T, device=ids.device)[None].expand(B, T)
    ang = pos[..., None].float() * inv_freq
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    add = _additive_mask(attention_mask, T, torch.float32, ids.device)
    h = W["emb"][ids]
    li = ai = 0
    for i, kind in enumerate(d.types):
        x = _rms(h, d.eps) * (1.0 + W["norm1_w"][i])
        if kind == "linear_attention":
            if attention_mask is not None:
                x = x * attention_mask[..., None].to(x.dtype)
            mixed = F.silu(_conv_pad_sum(x @ W["dn_qkv_t"][li], W["dn_conv"][li]))
            q, k, v = mixed.split([d.kd, d.kd, d.vd], -1)
            z = (x @ W["dn_z_t"][li]).view(B, T, d.nv, d.dv)
            beta = (x @ W["dn_b_t"][li]).sigmoid()
            g = -W["dn_A_log"][li].exp() * F.softplus(x @ W["dn_a_t"][li] + W["dn_dt_bias"][li])
            q = _l2(q.view(B, T, d.nk, d.dk)).repeat_interleave(d.r, 2) * d.dk**-0.5
            k = _l2(k.view(B, T, d.nk, d.dk)).repeat_interleave(d.r, 2)
            v = v.view(B, T, d.nv, d.dv)
            o = _delta_recurrent(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2)
            )
            o = _rms(o.transpose(1, 2), d.eps) * W["dn_norm"][li] * F.silu(z)
            h = h + o.reshape(B, T, -1) @ W["dn_out_t"][li]
            li += 1
        else:
            qg = (x @ W["at_qg_t"][ai]).view(B, T, d.nh, 2 * d.hd)
            q, gate = qg[..., : d.hd], qg[..., d.hd :].reshape(B, T, -1)
            q = (_rms(q, d.eps) * (1.0 + W["at_qn"][ai])).transpose(1, 2)
            k = (_rms((x @ W["at_k_t"][ai]).view(B, T, d.nkv, d.hd), d.eps) * (1.0 + W["at_kn"][ai])).transpose(1, 2)
            v = (x @ W["at_v_t"][ai]).view(B, T, d.nkv, d.hd).transpose(1, 2)
            o = _attend(_rope_partial(q, cos, sin), _rope_partial(k, cos, sin), v, add, d.hd**-0.5)
            h = h + (o.transpose(1, 2).reshape(B, T, -1) * gate.sigmoid()) @ W["at_o_t"][ai]
            ai += 1
        x = _rms(h, d.eps) * (1.0 + W["norm2_w"][i])
        gt, up = (x @ W["w_gu_t"][i]).chunk(2, -1)
        h = h + (F.silu(gt) * up) @ W["w_down_t"][i]
    h = _rms(h, d.eps) * (1.0 + W["final_w"])
    return h @ W["head_t"]


class Qwen35Functional(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = _Dims(config)
        self.weights = nn.ParameterDict({k: _p(v) for k, v in _stack_weights(sd, self.d).items()})
        self.register_buffer("inv_freq", _inv_freq(config), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        W = dict(self.weights.items())
        return _functional_forward(W, self.d, self.inv_freq, input_ids, attention_mask, position_ids).float()


def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN:
        raise ValueError(f"unknown layout variant {variant!r}")
    sd = {k: v.float() for k, v in state_dict.items()}
    if variant == "q35_stacked_functional":
        model = Qwen35Functional(sd, config)
    elif variant == "q35_parallel_delta":
        model = Qwen35WithHead(sd, config, variant)
    else:
        model = Qwen35Port(sd, config, variant)
    return model.eval()
