"""Hand-written plain-PyTorch port of Qwen3-Next (Qwen3NextForCausalLM): a hybrid of Gated DeltaNet linear
attention and gated full attention, with a sparse MoE (plus a gated shared expert) or a dense MLP per layer.

Architecture as this port implements it:
- token embedding (no scaling), untied LM head; every RMSNorm of the residual stream and q/k norms use the
  zero-centred gain (1 + w); final norm likewise.
- layer i (config.layer_types[i]), pre-norm:  h = h + Mixer(Norm(h));  h = h + FFN(Norm(h)).
- linear_attention (Gated DeltaNet): the layer input is zeroed at padding positions; one projection gives, per key
  head group, [q (dk) | k (dk) | v (r dv) | z (r dv)] (r = value heads per key head) and another [b (r) | a (r)];
  q|k|v (channel order: all q, all k, all v) go through a causal depthwise conv (kernel K, no bias) and SiLU;
  q, k are L2-normalised (eps 1e-6 inside the rsqrt), q scaled by dk^-0.5; key head j // r serves value head j;
  beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (log decay); per value head, with state S (dk, dv):
      S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = S^T q_t
  then a gated RMSNorm per value head: rms(o) * w * silu(z) (plain gain w), and out_proj.
- full_attention: q_proj gives per head [q (d) | gate (d)]; q_norm / k_norm (1 + w) per head over d; partial RoPE
  on the first d * partial_rotary_factor dims (rotate-half); GQA; scale d^-0.5; causal + padding mask; output
  multiplied by sigmoid(gate) before o_proj.
- FFN: sparse MoE (softmax router over all experts, top-k, renormalised; SwiGLU experts) plus a shared SwiGLU
  expert scaled by sigmoid(shared_expert_gate x); or a dense SwiGLU MLP for mlp_only_layers.
- positions: position_ids if given, else 0..T-1.

Layouts (BUG selects one; every one is a correct port):
- baseline "": own module tree (embed / layers[i].mixer / layers[i].ffn / head_t); norm gains stored as the
  effective (1 + w); all matrices transposed and applied as x @ W; the linear-attention projection de-interleaved
  into a contiguous conv-order [Q | K | V] matrix plus separate z, beta and alpha matrices; conv weight stored
  (channels, kernel) and applied by left padding + unfold + sum; A stored as -exp(A_log); token-by-token
  delta-rule recurrence; q and its output gate split into two matrices; experts (E, H, 2I) / (E, I, H) run
  densely with a (tokens, E) combine matrix; explicit softmax attention with an additive float mask.
- q3n_chunked_delta: the delta rule in chunks of 8 (WY / UT form: a unit-lower-triangular solve inside a chunk,
  the (dk, dv) state carried between chunks).
- q3n_state_transposed: recurrent state kept as S^T (dv, dk) and updated as S^T <- a S^T (I - b k k^T) + b v k^T,
  o = S^T q; key heads mapped to value heads by an index gather; conv as F.conv1d on an explicitly left-padded
  input.
- q3n_grouped_conv_layout: Transformers' per-key-head grouped projection kept as is ((out, in) nn.Linear); the conv
  weights permuted into that grouped channel order so the conv runs on the projection output without any
  re-ordering; conv as an nn.Conv1d module (padding K - 1, then trimmed).
- q3n_norm_folded: every (1 + w) gain of the residual stream folded into the next matrices (input norm -> mixer
  projections, post-attention norm -> router / experts / shared expert / shared gate / dense MLP, final norm ->
  head); the gated-norm gain folded into out_proj's columns; the attention scale folded into the q_norm gain.
- q3n_heads_einsum_complex_rope: full attention with (heads, head_dim, hidden) weights ([q, gate] as
  (heads, 2, head_dim, hidden)) applied by einsum; Meta-style permutation of the rotary rows of q/k (interleaved
  pairs), q/k norm gains permuted to match, RoPE as complex multiplication; boolean mask via masked_fill.
- q3n_gather_router_fused_shared: router and shared-expert gate fused into one (H, E + 1) matrix; experts chosen on
  the logits and weighted by a softmax over the chosen logits; expert gate/up interleaved per channel and the
  chosen experts' weights gathered per token.
- q3n_sdpa_tables_maskpos: scaled_dot_product_attention with a boolean mask and enable_gqa; cos/sin tables for the
  whole max length as buffers; positions derived from the attention mask; linear-attention padding zeroed on the
  projection outputs instead of the input (exact: the projections have no bias).
- q3n_functional_stacked: one functional forward over a plain dict of tensors, each kind's weights stacked over the
  layers of that kind ((n_linear, ...), (n_full, ...), (n_moe, ...)); the delta rule fully parallel (a single
  chunk spanning the whole sequence); a separate LM head module.
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
    "q3n_chunked_delta",  # delta rule in chunks of 8 (UT transform + carried state)
    "q3n_state_transposed",  # state as S^T (dv, dk), head map by gather, conv via F.conv1d on padded input
    "q3n_grouped_conv_layout",  # HF grouped qkvz kept; conv weights permuted to that channel order; nn.Conv1d
    "q3n_norm_folded",  # (1 + w) gains folded into next matrices, gated-norm gain into out_proj, scale into q_norm
    "q3n_heads_einsum_complex_rope",  # (heads, 2, d, H) q|gate einsum, Meta row permutation + complex RoPE
    "q3n_gather_router_fused_shared",  # router + shared gate fused (H, E+1), softmax over chosen logits, gather
    "q3n_sdpa_tables_maskpos",  # SDPA bool mask + enable_gqa, cos/sin tables, positions from mask, mask on proj
    "q3n_functional_stacked",  # plain dict, weights stacked per layer kind, fully parallel delta rule, head module
]


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _l2n(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope_half(x, cos, sin, r):
    cos, sin = cos[:, None], sin[:, None]
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat((xr * cos + _rotate_half(xr) * sin, xp), dim=-1)


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


class _Cfg:
    def __init__(self, config):
        self.H = config.hidden_size
        self.nq = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.d = config.head_dim
        self.r = int(self.d * config.rope_parameters.get("partial_rotary_factor", 1.0))
        self.theta = config.rope_parameters["rope_theta"]
        self.L = config.num_hidden_layers
        self.types = list(config.layer_types)
        self.E = config.num_experts
        self.k = config.num_experts_per_tok
        self.norm_topk = config.norm_topk_prob
        self.eps = config.rms_norm_eps
        self.maxpos = config.max_position_embeddings
        self.nk = config.linear_num_key_heads
        self.nv = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.rep_v = self.nv // self.nk
        self.K = config.linear_conv_kernel_dim
        self.moe = [
            (i not in config.mlp_only_layers) and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
            for i in range(self.L)
        ]

    def inv_freq(self):
        return 1.0 / (self.theta ** (torch.arange(0, self.r, 2, dtype=torch.float) / self.r))


def _get(sd, i, name):
    return sd[f"model.layers.{i}.{name}"].float()


def _split_linear(sd, i, c):
    """Transformers' grouped in_proj_qkvz / in_proj_ba -> flat (out, in) Wq, Wk, Wv, Wz, Wb, Wa (head order)."""
    w = _get(sd, i, "linear_attn.in_proj_qkvz.weight").view(c.nk, 2 * c.dk + 2 * c.rep_v * c.dv, c.H)
    wq, wk, wv, wz = w.split([c.dk, c.dk, c.rep_v * c.dv, c.rep_v * c.dv], dim=1)
    ba = _get(sd, i, "linear_attn.in_proj_ba.weight").view(c.nk, 2 * c.rep_v, c.H)
    wb, wa = ba.split([c.rep_v, c.rep_v], dim=1)
    return [x.reshape(-1, c.H) for x in (wq, wk, wv, wz, wb, wa)]


# ----------------------------------------------------------------------------------------------------------------
# gated delta rule: recurrent, transposed-state and chunked (UT) forms; all take (b, t, nv, .) tensors
# ----------------------------------------------------------------------------------------------------------------


def _delta_recurrent(q, k, v, g, beta):
    b, t, n, dk = k.shape
    S = q.new_zeros(b, n, dk, v.shape[-1])
    out = []
    for i in range(t):
        S = S * g[:, i].exp()[..., None, None]
        mem = torch.einsum("bnk,bnkv->bnv", k[:, i], S)
        delta = (v[:, i] - mem) * beta[:, i, :, None]
        S = S + k[:, i, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bnk,bnkv->bnv", q[:, i], S))
    return torch.stack(out, 1)


def _delta_transposed(q, k, v, g, beta):
    b, t, n, dk = k.shape
    St = q.new_zeros(b, n, v.shape[-1], dk)  # S^T: (dv, dk)
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    out = []
    for i in range(t):
        kt, bt = k[:, i], beta[:, i, :, None, None]
        St = g[:, i].exp()[..., None, None] * St @ (eye - bt * kt[..., :, None] * kt[..., None, :])
        St = St + bt * v[:, i, :, :, None] * kt[..., None, :]
        out.append((St @ q[:, i, :, :, None])[..., 0])
    return torch.stack(out, 1)


def _delta_chunked(q, k, v, g, beta, chunk):
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    S = q.new_zeros(b, n, dk, dv)
    outs = []
    for s in range(0, t, chunk):
        qc, kc, vc = (x[:, s : s + chunk].transpose(1, 2) for x in (q, k, v))  # (b, n, C, .)
        gc, bc = g[:, s : s + chunk].transpose(1, 2), beta[:, s : s + chunk].transpose(1, 2)  # (b, n, C)
        C = gc.shape[-1]
        G = gc.cumsum(-1)
        diff = G[..., :, None] - G[..., None, :]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = diff.masked_fill(~lower, float("-inf")).exp()  # exp(G_t - G_j), j <= t
        strict = decay.masked_fill(torch.eye(C, dtype=torch.bool, device=q.device), 0.0)
        A = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * strict + torch.eye(C, dtype=q.dtype, device=q.device)
        rhs = bc[..., None] * vc - (bc * G.exp())[..., None] * (kc @ S)
        U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        o = G.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ U
        S = G[..., -1:, None].exp() * S + (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ U
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, 1)


def _conv_unfold(x, w):
    """x (b, t, C), w (C, K): causal depthwise conv by left padding + unfold."""
    K = w.shape[-1]
    return (F.pad(x, (0, 0, K - 1, 0)).unfold(1, K, 1) * w).sum(-1)


# ----------------------------------------------------------------------------------------------------------------
# module-based port
# ----------------------------------------------------------------------------------------------------------------


class GatedDeltaMixer(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        wq, wk, wv, wz, wb, wa = _split_linear(sd, i, c)
        conv = _get(sd, i, "linear_attn.conv1d.weight")[:, 0]  # (C, K), channel order [q | k | v]
        w_out = _get(sd, i, "linear_attn.out_proj.weight")
        gnorm = _get(sd, i, "linear_attn.norm.weight")
        if v == "q3n_norm_folded":
            s = 1.0 + _get(sd, i, "input_layernorm.weight")
            wq, wk, wv, wz, wb, wa = (x * s for x in (wq, wk, wv, wz, wb, wa))
            w_out = w_out * gnorm.repeat(c.nv)
        else:
            self.gnorm = nn.Parameter(gnorm.clone())
        self.neg_A = nn.Parameter(-_get(sd, i, "linear_attn.A_log").exp())
        self.dt_bias = nn.Parameter(_get(sd, i, "linear_attn.dt_bias").clone())
        if v == "q3n_grouped_conv_layout":
            self.in_proj_qkvz = nn.Linear(c.H, 2 * (c.nk * c.dk) + 2 * c.nv * c.dv, bias=False)
            self.in_proj_qkvz.weight.data.copy_(_get(sd, i, "linear_attn.in_proj_qkvz.weight"))
            self.in_proj_ba = nn.Linear(c.H, 2 * c.nv, bias=False)
            self.in_proj_ba.weight.data.copy_(_get(sd, i, "linear_attn.in_proj_ba.weight"))
            kd, gv = c.nk * c.dk, c.rep_v * c.dv
            rows = []
            for gi in range(c.nk):
                rows += list(range(gi * c.dk, (gi + 1) * c.dk))
                rows += list(range(kd + gi * c.dk, kd + (gi + 1) * c.dk))
                rows += list(range(2 * kd + gi * gv, 2 * kd + (gi + 1) * gv))
            C = conv.shape[0]
            self.conv1d = nn.Conv1d(C, C, c.K, groups=C, padding=c.K - 1, bias=False)
            self.conv1d.weight.data.copy_(conv[rows][:, None])
            self.out_proj = nn.Linear(c.nv * c.dv, c.H, bias=False)
            self.out_proj.weight.data.copy_(w_out)
        else:
            self.w_qkv = nn.Parameter(torch.cat([wq, wk, wv], 0).t().contiguous())
            self.w_z = nn.Parameter(wz.t().contiguous())
            self.w_beta = nn.Parameter(wb.t().contiguous())
            self.w_alpha = nn.Parameter(wa.t().contiguous())
            self.conv_w = nn.Parameter(conv.clone())
            self.w_out = nn.Parameter(w_out.t().contiguous())
            if v == "q3n_state_transposed":
                self.register_buffer("head_of_value", torch.arange(c.nv) // c.rep_v, persistent=False)

    def forward(self, x, mask):
        c, v = self.c, self.v
        b, t, _ = x.shape
        if mask is not None and v != "q3n_sdpa_tables_maskpos":
            x = x * mask[:, :, None].to(x.dtype)
        if v == "q3n_grouped_conv_layout":
            mixed = self.in_proj_qkvz(x).view(b, t, c.nk, -1)
            gv = c.rep_v * c.dv
            qkv, z = mixed.split([2 * c.dk + gv, gv], dim=-1)
            ba = self.in_proj_ba(x).view(b, t, c.nk, 2 * c.rep_v)
            beta_raw, alpha = (y.reshape(b, t, c.nv) for y in ba.split([c.rep_v, c.rep_v], -1))
            qkv = F.silu(self.conv1d(qkv.reshape(b, t, -1).transpose(1, 2))[..., :t]).transpose(1, 2)
            q, k, val = qkv.view(b, t, c.nk, -1).split([c.dk, c.dk, gv], dim=-1)
            val = val.reshape(b, t, c.nv, c.dv)
            z = z.reshape(b, t, c.nv, c.dv)
        else:
            qkv, z = x @ self.w_qkv, x @ self.w_z
            beta_raw, alpha = x @ self.w_beta, x @ self.w_alpha
            if mask is not None and v == "q3n_sdpa_tables_maskpos":
                qkv = qkv * mask[:, :, None].to(x.dtype)
            if v == "q3n_state_transposed":
                qkv = F.conv1d(
                    F.pad(qkv.transpose(1, 2), (c.K - 1, 0)), self.conv_w[:, None], groups=qkv.shape[-1]
                ).transpose(1, 2)
            else:
                qkv = _conv_unfold(qkv, self.conv_w)
            qkv = F.silu(qkv)
            q, k, val = qkv.split([c.nk * c.dk, c.nk * c.dk, c.nv * c.dv], dim=-1)
            q, k = q.view(b, t, c.nk, c.dk), k.view(b, t, c.nk, c.dk)
            val, z = val.view(b, t, c.nv, c.dv), z.view(b, t, c.nv, c.dv)
        q = _l2n(q) * c.dk**-0.5
        k = _l2n(k)
        if v == "q3n_state_transposed":
            q, k = q[:, :, self.head_of_value], k[:, :, self.head_of_value]
        else:
            q, k = q.repeat_interleave(c.rep_v, 2), k.repeat_interleave(c.rep_v, 2)
        beta = torch.sigmoid(beta_raw)
        g = self.neg_A * F.softplus(alpha + self.dt_bias)
        if v == "q3n_chunked_delta":
            o = _delta_chunked(q, k, val, g, beta, 8)
        elif v == "q3n_state_transposed":
            o = _delta_transposed(q, k, val, g, beta)
        else:
            o = _delta_recurrent(q, k, val, g, beta)
        o = _rms(o, c.eps)
        if v != "q3n_norm_folded":
            o = o * self.gnorm
        o = (o * F.silu(z)).reshape(b, t, -1)
        if v == "q3n_grouped_conv_layout":
            return self.out_proj(o)
        return o @ self.w_out


class GatedAttention(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        d, r = c.d, c.r
        wqg = _get(sd, i, "self_attn.q_proj.weight").view(c.nq, 2, d, c.H)
        wk, wv = _get(sd, i, "self_attn.k_proj.weight"), _get(sd, i, "self_attn.v_proj.weight")
        wo = _get(sd, i, "self_attn.o_proj.weight")
        sq = 1.0 + _get(sd, i, "self_attn.q_norm.weight")
        sk = 1.0 + _get(sd, i, "self_attn.k_norm.weight")
        if v == "q3n_norm_folded":
            s = 1.0 + _get(sd, i, "input_layernorm.weight")
            wqg, wk, wv = wqg * s, wk * s, wv * s
            sq = sq * d**-0.5
        if v == "q3n_heads_einsum_complex_rope":
            half = r // 2
            perm = torch.tensor([j for p in range(half) for j in (p, p + half)] + list(range(r, d)))
            wq_h = wqg[:, 0][:, perm]
            self.w_q_gate = nn.Parameter(torch.stack((wq_h, wqg[:, 1]), 1).contiguous())  # (nq, 2, d, H)
            self.w_k = nn.Parameter(wk.view(c.nkv, d, c.H)[:, perm].contiguous())
            self.w_v = nn.Parameter(wv.view(c.nkv, d, c.H).clone())
            self.w_o = nn.Parameter(wo.view(c.H, c.nq, d).permute(1, 2, 0).contiguous())
            sq, sk = sq[perm], sk[perm]
            freqs = torch.outer(torch.arange(c.maxpos, dtype=torch.float), c.inv_freq())
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        else:
            self.w_q = nn.Parameter(wqg[:, 0].reshape(-1, c.H).t().contiguous())
            self.w_gate = nn.Parameter(wqg[:, 1].reshape(-1, c.H).t().contiguous())
            self.w_k = nn.Parameter(wk.t().contiguous())
            self.w_v = nn.Parameter(wv.t().contiguous())
            self.w_o = nn.Parameter(wo.t().contiguous())
        self.q_scale = nn.Parameter(sq.clone())
        self.k_scale = nn.Parameter(sk.clone())
        if v == "q3n_sdpa_tables_maskpos":
            freqs = torch.outer(torch.arange(c.maxpos, dtype=torch.float), c.inv_freq())
            emb = torch.cat((freqs, freqs), -1)
            self.register_buffer("cos_cached", emb.cos(), persistent=False)
            self.register_buffer("sin_cached", emb.sin(), persistent=False)
        elif v != "q3n_heads_einsum_complex_rope":
            self.register_buffer("inv_freq", c.inv_freq(), persistent=False)

    def forward(self, x, pos, keep):
        c, v, d, r = self.c, self.v, self.c.d, self.c.r
        b, t, _ = x.shape
        if v == "q3n_heads_einsum_complex_rope":
            qg = torch.einsum("bth,nsdh->bsntd", x, self.w_q_gate)
            q, gate = qg[:, 0], qg[:, 1]  # (b, nq, t, d)
            k = torch.einsum("bth,ndh->bntd", x, self.w_k)
            val = torch.einsum("bth,ndh->bntd", x, self.w_v)
            q, k = _rms(q, c.eps) * self.q_scale, _rms(k, c.eps) * self.k_scale
            fc = self.freqs_cis[pos][:, None]

            def rot(z):
                zc = torch.view_as_complex(z[..., :r].reshape(*z.shape[:-1], r // 2, 2).contiguous())
                return torch.cat((torch.view_as_real(zc * fc).flatten(-2), z[..., r:]), -1)

            q, k = rot(q), rot(k)
            rep = c.nq // c.nkv
            k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
            s = torch.einsum("bnqd,bnkd->bnqk", q, k) / math.sqrt(d)
            p = s.masked_fill(~keep, float("-inf")).softmax(-1)
            o = torch.einsum("bnqk,bnkd->bnqd", p, val) * torch.sigmoid(gate)
            return torch.einsum("bntd,ndh->bth", o, self.w_o)
        q = (x @ self.w_q).view(b, t, c.nq, d)
        gate = x @ self.w_gate
        k = (x @ self.w_k).view(b, t, c.nkv, d)
        val = (x @ self.w_v).view(b, t, c.nkv, d).transpose(1, 2)
        q = (_rms(q, c.eps) * self.q_scale).transpose(1, 2)
        k = (_rms(k, c.eps) * self.k_scale).transpose(1, 2)
        if v == "q3n_sdpa_tables_maskpos":
            cos, sin = self.cos_cached[pos], self.sin_cached[pos]
        else:
            freqs = pos[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos(), emb.sin()
        q, k = _rope_half(q, cos, sin, r), _rope_half(k, cos, sin, r)
        if v == "q3n_sdpa_tables_maskpos":
            o = F.scaled_dot_product_attention(q, k, val, attn_mask=keep, enable_gqa=True)
        else:
            rep = c.nq // c.nkv
            k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
            s = q @ k.transpose(-1, -2)
            if v != "q3n_norm_folded":
                s = s * d**-0.5
            s = s + torch.zeros_like(s).masked_fill(~keep, torch.finfo(s.dtype).min)
            o = s.softmax(-1) @ val
        o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
        return o @ self.w_o


class SparseMoE(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        wr = _get(sd, i, "mlp.gate.weight")
        gu, dn = _get(sd, i, "mlp.experts.gate_up_proj"), _get(sd, i, "mlp.experts.down_proj")
        sg, su = _get(sd, i, "mlp.shared_expert.gate_proj.weight"), _get(sd, i, "mlp.shared_expert.up_proj.weight")
        sdn = _get(sd, i, "mlp.shared_expert.down_proj.weight")
        sgate = _get(sd, i, "mlp.shared_expert_gate.weight")
        if v == "q3n_norm_folded":
            s = 1.0 + _get(sd, i, "post_attention_layernorm.weight")
            wr, gu, sg, su, sgate = wr * s, gu * s, sg * s, su * s, sgate * s
        if v == "q3n_gather_router_fused_shared":
            self.w_route = nn.Parameter(torch.cat([wr, sgate], 0).t().contiguous())  # (H, E + 1)
            gate, up = gu.chunk(2, dim=1)
            gu = torch.stack((gate, up), 2).reshape(gu.shape)  # g0, u0, g1, u1, ...
        else:
            self.w_router = nn.Parameter(wr.t().contiguous())
            self.w_shared_gate = nn.Parameter(sgate.t().contiguous())
        self.w_gate_up = nn.Parameter(gu.transpose(1, 2).contiguous())  # (E, H, 2I)
        self.w_down = nn.Parameter(dn.transpose(1, 2).contiguous())  # (E, I, H)
        self.w_shared_gu = nn.Parameter(torch.cat([sg, su], 0).t().contiguous())  # (H, 2 Is)
        self.w_shared_down = nn.Parameter(sdn.t().contiguous())

    def forward(self, x):
        c, v = self.c, self.v
        shape = x.shape
        x = x.reshape(-1, c.H)
        sg, su = (x @ self.w_shared_gu).chunk(2, -1)
        shared = (F.silu(sg) * su) @ self.w_shared_down
        if v == "q3n_gather_router_fused_shared":
            logits, gate_logit = (x @ self.w_route).split([c.E, 1], -1)
            top = logits.topk(c.k, dim=-1)
            idx = top.indices
            w = top.values.softmax(-1) if c.norm_topk else logits.softmax(-1).gather(1, idx)
            gu = torch.einsum("th,tkhf->tkf", x, self.w_gate_up[idx])
            hdn = F.silu(gu[..., 0::2]) * gu[..., 1::2]
            y = (torch.einsum("tki,tkih->tkh", hdn, self.w_down[idx]) * w[..., None]).sum(1)
            return (y + torch.sigmoid(gate_logit) * shared).view(shape)
        probs = (x @ self.w_router).float().softmax(-1)
        w, idx = probs.topk(c.k, dim=-1)
        if c.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        comb = torch.zeros_like(probs).scatter(1, idx, w).to(x.dtype)
        gate, up = torch.einsum("th,ehf->etf", x, self.w_gate_up).chunk(2, -1)
        y = torch.einsum("te,eth->th", comb, torch.einsum("eti,eih->eth", F.silu(gate) * up, self.w_down))
        return (y + torch.sigmoid(x @ self.w_shared_gate) * shared).view(shape)


class DenseMLP(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        g, u = _get(sd, i, "mlp.gate_proj.weight"), _get(sd, i, "mlp.up_proj.weight")
        if v == "q3n_norm_folded":
            s = 1.0 + _get(sd, i, "post_attention_layernorm.weight")
            g, u = g * s, u * s
        self.w_gate_up = nn.Parameter(torch.cat([g, u], 0).t().contiguous())
        self.w_down = nn.Parameter(_get(sd, i, "mlp.down_proj.weight").t().contiguous())

    def forward(self, x):
        g, u = (x @ self.w_gate_up).chunk(2, -1)
        return (F.silu(g) * u) @ self.w_down


class Layer(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        self.kind = c.types[i]
        self.mixer = GatedDeltaMixer(sd, i, c, v) if self.kind == "linear_attention" else GatedAttention(sd, i, c, v)
        self.ffn = SparseMoE(sd, i, c, v) if c.moe[i] else DenseMLP(sd, i, c, v)
        if v != "q3n_norm_folded":
            self.mix_scale = nn.Parameter(1.0 + _get(sd, i, "input_layernorm.weight"))
            self.ffn_scale = nn.Parameter(1.0 + _get(sd, i, "post_attention_layernorm.weight"))

    def forward(self, h, pos, keep, mask):
        c = self.c
        folded = self.v == "q3n_norm_folded"
        x = _rms(h, c.eps) if folded else _rms(h, c.eps) * self.mix_scale
        h = h + (self.mixer(x, mask) if self.kind == "linear_attention" else self.mixer(x, pos, keep))
        x = _rms(h, c.eps) if folded else _rms(h, c.eps) * self.ffn_scale
        return h + self.ffn(x)


class Qwen3NextPort(nn.Module):
    def __init__(self, sd, config, v):
        super().__init__()
        c = self.c = _Cfg(config)
        self.v = v
        self.embed = nn.Parameter(sd["model.embed_tokens.weight"].float().clone())
        self.layers = nn.ModuleList([Layer(sd, i, c, v) for i in range(c.L)])
        head = sd["lm_head.weight"].float()
        s = 1.0 + sd["model.norm.weight"].float()
        if v == "q3n_norm_folded":
            head = head * s
        else:
            self.final_scale = nn.Parameter(s)
        self.head_t = nn.Parameter(head.t().contiguous())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c, v = self.c, self.v
        b, t = input_ids.shape
        pos = _positions(input_ids, attention_mask, position_ids, from_mask=v == "q3n_sdpa_tables_maskpos")
        keep = _keep_mask(attention_mask, b, t, input_ids.device)
        h = self.embed[input_ids]
        for layer in self.layers:
            h = layer(h, pos, keep, attention_mask)
        h = _rms(h, c.eps)
        if v != "q3n_norm_folded":
            h = h * self.final_scale
        return (h @ self.head_t).float()


# ----------------------------------------------------------------------------------------------------------------
# functional port: plain dict, weights stacked per layer kind
# ----------------------------------------------------------------------------------------------------------------


def _stack(sd, c, layers, name, f=lambda w: w):
    return torch.stack([f(_get(sd, i, name)) for i in layers]).contiguous()


def _functional_params(sd, c):
    lin = [i for i in range(c.L) if c.types[i] == "linear_attention"]
    full = [i for i in range(c.L) if c.types[i] == "full_attention"]
    moe = [i for i in range(c.L) if c.moe[i]]
    dense = [i for i in range(c.L) if not c.moe[i]]
    p = {"embed": sd["model.embed_tokens.weight"].float(), "final_norm": 1.0 + sd["model.norm.weight"].float()}
    p["attn_norm"] = _stack(sd, c, range(c.L), "input_layernorm.weight", lambda w: 1.0 + w)
    p["ffn_norm"] = _stack(sd, c, range(c.L), "post_attention_layernorm.weight", lambda w: 1.0 + w)
    split = [_split_linear(sd, i, c) for i in lin]
    p["lin.wqkv"] = torch.stack([torch.cat(s[:3], 0) for s in split])  # (n_lin, Cconv, H)
    p["lin.wz"] = torch.stack([s[3] for s in split])
    p["lin.wba"] = torch.stack([torch.cat(s[4:], 0) for s in split])  # (n_lin, 2 nv, H) [b | a]
    p["lin.conv"] = _stack(sd, c, lin, "linear_attn.conv1d.weight", lambda w: w[:, 0])
    p["lin.A_log"] = _stack(sd, c, lin, "linear_attn.A_log")
    p["lin.dt_bias"] = _stack(sd, c, lin, "linear_attn.dt_bias")
    p["lin.norm"] = _stack(sd, c, lin, "linear_attn.norm.weight")
    p["lin.out"] = _stack(sd, c, lin, "linear_attn.out_proj.weight")
    p["full.wq"] = _stack(sd, c, full, "self_attn.q_proj.weight")  # (n_full, nq * 2d, H), per head [q | gate]
    p["full.wk"] = _stack(sd, c, full, "self_attn.k_proj.weight")
    p["full.wv"] = _stack(sd, c, full, "self_attn.v_proj.weight")
    p["full.wo"] = _stack(sd, c, full, "self_attn.o_proj.weight")
    p["full.q_norm"] = _stack(sd, c, full, "self_attn.q_norm.weight", lambda w: 1.0 + w)
    p["full.k_norm"] = _stack(sd, c, full, "self_attn.k_norm.weight", lambda w: 1.0 + w)
    p["moe.router"] = _stack(sd, c, moe, "mlp.gate.weight")
    p["moe.w13"] = _stack(sd, c, moe, "mlp.experts.gate_up_proj")
    p["moe.w2"] = _stack(sd, c, moe, "mlp.experts.down_proj")
    p["moe.shared_w1"] = _stack(sd, c, moe, "mlp.shared_expert.gate_proj.weight")
    p["moe.shared_w3"] = _stack(sd, c, moe, "mlp.shared_expert.up_proj.weight")
    p["moe.shared_w2"] = _stack(sd, c, moe, "mlp.shared_expert.down_proj.weight")
    p["moe.shared_gate"] = _stack(sd, c, moe, "mlp.shared_expert_gate.weight")
    p["mlp.w1"] = _stack(sd, c, dense, "mlp.gate_proj.weight")
    p["mlp.w3"] = _stack(sd, c, dense, "mlp.up_proj.weight")
    p["mlp.w2"] = _stack(sd, c, dense, "mlp.down_proj.weight")
    p["inv_freq"] = c.inv_freq()
    return p


def _functional_backbone(p, c, input_ids, attention_mask, position_ids):
    b, t = input_ids.shape
    d, r = c.d, c.r
    pos = _positions(input_ids, attention_mask, position_ids)
    keep = _keep_mask(attention_mask, b, t, input_ids.device)
    freqs = pos[..., None].float() * p["inv_freq"]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    h = F.embedding(input_ids, p["embed"])
    n = {"linear_attention": 0, "full_attention": 0, "moe": 0, "dense": 0}
    for i in range(c.L):
        x = _rms(h, c.eps) * p["attn_norm"][i]
        if c.types[i] == "linear_attention":
            j = n["linear_attention"]
            if attention_mask is not None:
                x = x * attention_mask[:, :, None].to(x.dtype)
            qkv = F.silu(_conv_unfold(F.linear(x, p["lin.wqkv"][j]), p["lin.conv"][j]))
            q, k, val = qkv.split([c.nk * c.dk, c.nk * c.dk, c.nv * c.dv], -1)
            q = (_l2n(q.view(b, t, c.nk, c.dk)) * c.dk**-0.5).repeat_interleave(c.rep_v, 2)
            k = _l2n(k.view(b, t, c.nk, c.dk)).repeat_interleave(c.rep_v, 2)
            val = val.view(b, t, c.nv, c.dv)
            braw, a = F.linear(x, p["lin.wba"][j]).split([c.nv, c.nv], -1)
            g = -p["lin.A_log"][j].exp() * F.softplus(a + p["lin.dt_bias"][j])
            o = _delta_chunked(q, k, val, g, torch.sigmoid(braw), chunk=t)  # one chunk: fully parallel
            z = F.linear(x, p["lin.wz"][j]).view(b, t, c.nv, c.dv)
            o = (_rms(o, c.eps) * p["lin.norm"][j] * F.silu(z)).reshape(b, t, -1)
            h = h + F.linear(o, p["lin.out"][j])
        else:
            j = n["full_attention"]
            qg = F.linear(x, p["full.wq"][j]).view(b, t, c.nq, 2 * d)
            q, gate = qg.chunk(2, -1)
            q = (_rms(q, c.eps) * p["full.q_norm"][j]).transpose(1, 2)
            k = (_rms(F.linear(x, p["full.wk"][j]).view(b, t, c.nkv, d), c.eps) * p["full.k_norm"][j]).transpose(1, 2)
            val = F.linear(x, p["full.wv"][j]).view(b, t, c.nkv, d).transpose(1, 2)
            q, k = _rope_half(q, cos, sin, r), _rope_half(k, cos, sin, r)
            rep = c.nq // c.nkv
            k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
            att = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~keep, float("-inf")).softmax(-1)
            o = (att @ val).transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate.reshape(b, t, -1))
            h = h + F.linear(o, p["full.wo"][j])
        n[c.types[i]] += 1
        x = (_rms(h, c.eps) * p["ffn_norm"][i]).reshape(-1, c.H)
        if c.moe[i]:
            j = n["moe"]
            n["moe"] += 1
            probs = F.linear(x, p["moe.router"][j]).softmax(-1)
            w, idx = probs.topk(c.k, -1)
            if c.norm_topk:
                w = w / w.sum(-1, keepdim=True)
            y = torch.zeros_like(x)
            for e in range(c.E):
                tok, slot = torch.where(idx == e)
                if tok.numel():
                    gt, up = F.linear(x[tok], p["moe.w13"][j, e]).chunk(2, -1)
                    y.index_add_(0, tok, F.linear(F.silu(gt) * up, p["moe.w2"][j, e]) * w[tok, slot, None])
            sh = F.linear(
                F.silu(F.linear(x, p["moe.shared_w1"][j])) * F.linear(x, p["moe.shared_w3"][j]), p["moe.shared_w2"][j]
            )
            y = y + torch.sigmoid(F.linear(x, p["moe.shared_gate"][j])) * sh
        else:
            j = n["dense"]
            n["dense"] += 1
            y = F.linear(F.silu(F.linear(x, p["mlp.w1"][j])) * F.linear(x, p["mlp.w3"][j]), p["mlp.w2"][j])
        h = h + y.view(b, t, c.H)
    return _rms(h, c.eps) * p["final_norm"]


class LMHead(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = nn.Parameter(w.clone())

    def forward(self, h):
        return F.linear(h, self.weight)


class FunctionalPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.c = _Cfg(config)
        self.tensors = _functional_params(sd, self.c)
        self.lm_head = LMHead(sd["lm_head.weight"].float())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = _functional_backbone(self.tensors, self.c, input_ids, attention_mask, position_ids)
        return self.lm_head(h).float()


def build(state_dict, config):
    v = BUG
    with torch.no_grad():
        model = (
            FunctionalPort(state_dict, config)
            if v == "q3n_functional_stacked"
            else Qwen3NextPort(state_dict, config, v)
        )
    return model.eval()
