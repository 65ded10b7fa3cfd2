"""A from-scratch PyTorch port of Qwen3.5-MoE's text model (``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``).

Architecture (as implemented here; D = hidden_size, T = sequence length)
-----------------------------------------------------------------------
x0 = E[input_ids]                                                     (B, T, D)
for each layer l (type from ``config.layer_types``):
    h = x + Mixer_l(RMSNorm1(x))        Mixer = GatedDeltaNet ("linear_attention") or GatedAttention ("full_attention")
    x = h + MoE_l(RMSNorm2(h))
logits = RMSNorm_f(x) @ W_head                                         (B, T, V)

RMSNorm (zero-centred weight): y = x / sqrt(mean(x^2) + eps) * (1 + w), eps = rms_norm_eps.

Gated full attention (H = num_attention_heads, Hkv = num_key_value_heads, d = head_dim):
    [q_h | g_h] per head = x W_qg (the projection is laid out head by head, each head 2d wide: d query, d gate)
    k, v = x W_k, x W_v                                                 (Hkv heads of d)
    q, k = RMSNorm_d(q) * (1 + w_q), RMSNorm_d(k) * (1 + w_k)           (per head, over d)
    partial RoPE (rotate-half / NeoX style) on the first r = int(d * partial_rotary_factor) dims only:
        inv_freq_i = theta^(-2i / r), angle = pos * inv_freq, cos/sin duplicated to r dims.
        (The text-only M-RoPE uses the same position for T/H/W, so it reduces to plain 1-D RoPE.)
    a = softmax(q k^T / sqrt(d) + causal/padding mask) v               (GQA: query head h uses kv head h // (H/Hkv))
    out = (a * sigmoid(g)) W_o

Gated DeltaNet (nk = linear_num_key_heads, nv = linear_num_value_heads, dk, dv = linear_key/value_head_dim):
    x is zeroed at padding positions (attention_mask == 0) first.
    [q | k | v] = x W_qkv (2 nk dk + nv dv channels) -> causal depthwise conv1d (kernel K, left pad K-1) -> SiLU
    z = x W_z (nv dv), b = x W_b (nv), a = x W_a (nv)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)    (log decay, <= 0)
    q, k = l2norm(q), l2norm(k) (over dk, eps 1e-6 inside rsqrt); q *= dk^-1/2
    key heads are shared by nv/nk consecutive value heads (repeat_interleave).
    recurrence per value head, S in R^{dk x dv}, S_0 = 0:
        S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
    o = RMSNorm_dv(o) * w_norm * silu(z)     (gated norm: PLAIN weight, not 1 + w; norm before gate)
    out = o W_out

Sparse MoE (E = num_experts, k = num_experts_per_tok):
    p = softmax(x W_router); top-k of p, renormalised to sum 1
    routed = sum_{e in top-k} p_e * down_e(silu(gate_e(x)) * up_e(x))
    shared = sigmoid(x w_sg) * down_s(silu(gate_s(x)) * up_s(x))
    out = routed + shared

Weight layout (mine, converted from the checkpoint in ``build``); every matrix is stored (in -> out):
    tok_emb                 (V, D)
    head                    (D, V)                   lm_head.weight^T (embedding^T when tied)
    final_gain              (D,)                     1 + model.norm.weight   (offset folded in)
    blocks[l].gain1/gain2   (D,)                     1 + input_layernorm / post_attention_layernorm weight
    attention mixer:
        w_in   (D, H*2d + 2*Hkv*d)   columns [q_proj (head-interleaved q|gate, as in the checkpoint) | k | v]
        q_gain, k_gain (d,)          1 + q_norm / k_norm weight
        w_out  (H*d, D)
    delta-net mixer:
        w_in   (D, 2 nk dk + 2 nv dv + 2 nv)  columns [q | k | v | z | b | a]
        taps   (2 nk dk + nv dv, K)           conv1d.weight squeezed
        a_log, dt_bias (nv,)
        norm_w (dv,)                           plain weight
        w_out  (nv dv, D)
    moe:
        w_route  (D, E + 1)   columns [router logits for E experts | shared-expert gate logit]
        w_gu     (E, D, 2I)   per expert [gate | up]
        w_down   (E, I, D)
        w_sgu    (D, 2Is)     shared expert [gate | up]
        w_sdown  (Is, D)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "attn_gate_split",  # q_proj output split as [all queries | all gates] instead of per head [q_h | gate_h]
    "rope_full_rotary",  # ignores partial_rotary_factor: rotates all head_dim dims with inv_freq over head_dim
    "qk_norm_after_rope",  # q/k RMSNorm (with its per-dim weight) applied after RoPE instead of before
    "pad_mask_on_queries",  # full-attention padding mask broadcast over the query axis instead of the key axis
    "kv_head_tiled",  # delta-net key heads expanded to value heads by tiling (repeat) instead of repeat_interleave
    "conv_taps_reversed",  # causal conv1d applied with its kernel taps in reversed time order
    "dt_bias_outside_softplus",  # decay uses softplus(a) + dt_bias instead of softplus(a + dt_bias)
    "decay_after_update",  # recurrence decays the state after the delta update instead of before reading it
    "delta_q_unscaled",  # delta-rule query not scaled by linear_key_head_dim ** -0.5
    "gated_norm_unit_offset",  # delta-net gated RMSNorm uses (1 + w) like the other norms; it uses plain w
    "mask_after_conv",  # delta-net padding zeroed after the causal conv, not before in_proj: pads leak into conv windows
    "no_topk_renorm",  # top-k routing probabilities not renormalised to sum to 1
    "experts_up_gate_swapped",  # stacked expert gate_up halves read as [up | gate]
    "shared_expert_ungated",  # shared expert output added without its sigmoid(shared_expert_gate) factor
]

PADDING_ONLY = ["pad_mask_on_queries", "mask_after_conv"]

CLEAN = [
    "topk_softmax",  # softmax over the k selected router logits (equals renormalised top-k of the full softmax)
    "chunked_delta",  # delta rule in chunked (UT-transform, triangular solve) form, chunk 16, instead of per token
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of explicit softmax
    "conv_shift_sum",  # depthwise causal conv as a sum of time-shifted inputs times taps instead of F.conv1d
    "dense_experts",  # every expert on every token, combined by a dense (tokens, experts) weight matrix
]


def _bug() -> str:
    return globals()["BUG"]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _l2n(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _rot_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.H = cfg.num_attention_heads
        self.Hkv = cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rp = getattr(cfg, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.partial = float(rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
        D = cfg.hidden_size
        self.w_in = nn.Parameter(torch.zeros(D, self.H * 2 * self.d + 2 * self.Hkv * self.d))
        self.q_gain = nn.Parameter(torch.ones(self.d))
        self.k_gain = nn.Parameter(torch.ones(self.d))
        self.w_out = nn.Parameter(torch.zeros(self.H * self.d, D))

    def _rope(self, x, pos):
        # x (B, H, T, d); pos (B, T)
        bug = _bug()
        rot = self.d if bug == "rope_full_rotary" else int(self.d * self.partial)
        inv = 1.0 / (self.theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=x.device) / rot))
        ang = pos.to(torch.float32)[..., None] * inv  # (B, T, rot/2)
        ang = torch.cat((ang, ang), dim=-1)[:, None]  # (B, 1, T, rot)
        xr, xp = x[..., :rot], x[..., rot:]
        xr = xr * ang.cos() + _rot_half(xr) * ang.sin()
        return torch.cat((xr, xp), dim=-1)

    def forward(self, x, pos, mask2d):
        bug = _bug()
        B, T, _ = x.shape
        H, Hkv, d = self.H, self.Hkv, self.d
        proj = x @ self.w_in
        qg, k, v = proj.split([H * 2 * d, Hkv * d, Hkv * d], dim=-1)
        if bug == "attn_gate_split":
            q, g = qg.chunk(2, dim=-1)
            q = q.reshape(B, T, H, d)
        else:
            q, g = qg.view(B, T, H, 2 * d).chunk(2, dim=-1)
        g = g.reshape(B, T, H * d)
        k = k.view(B, T, Hkv, d)
        v = v.view(B, T, Hkv, d).transpose(1, 2)

        if bug == "qk_norm_after_rope":
            q = self._rope(_rms(q, self.eps).transpose(1, 2), pos) * self.q_gain
            k = self._rope(_rms(k, self.eps).transpose(1, 2), pos) * self.k_gain
        else:
            q = self._rope((_rms(q, self.eps) * self.q_gain).transpose(1, 2), pos)
            k = self._rope((_rms(k, self.eps) * self.k_gain).transpose(1, 2), pos)

        rep = H // Hkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)

        idx = torch.arange(T, device=x.device)
        allowed = (idx[None, :] <= idx[:, None])[None, None]  # (1, 1, T, T)
        if mask2d is not None:
            if bug == "pad_mask_on_queries":
                allowed = allowed & mask2d.bool()[:, None, :, None]
            else:
                allowed = allowed & mask2d.bool()[:, None, None, :]
        scale = d**-0.5
        if bug == "sdpa_attention":
            # fully masked (padding) query rows may see themselves so they stay finite
            allowed = allowed | torch.eye(T, dtype=torch.bool, device=x.device)[None, None]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s + torch.where(allowed, 0.0, torch.finfo(s.dtype).min)
            a = torch.softmax(s, dim=-1) @ v
        a = a.transpose(1, 2).reshape(B, T, H * d)
        a = a * torch.sigmoid(g)
        return a @ self.w_out


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.K = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.kd, self.vd = self.nk * self.dk, self.nv * self.dv
        self.cdim = 2 * self.kd + self.vd
        self.w_in = nn.Parameter(torch.zeros(D, self.cdim + self.vd + 2 * self.nv))
        self.taps = nn.Parameter(torch.zeros(self.cdim, self.K))
        self.a_log = nn.Parameter(torch.zeros(self.nv))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.norm_w = nn.Parameter(torch.ones(self.dv))
        self.w_out = nn.Parameter(torch.zeros(self.vd, D))

    def _conv(self, u):
        # u (B, T, C) -> causal depthwise conv over T, then SiLU
        bug = _bug()
        taps = self.taps.flip(-1) if bug == "conv_taps_reversed" else self.taps
        T = u.shape[1]
        if bug == "conv_shift_sum":
            out = torch.zeros_like(u)
            for j in range(self.K):
                shift = self.K - 1 - j  # tap j multiplies x[t - shift]
                if shift >= T:
                    continue
                out[:, shift:] = out[:, shift:] + u[:, : T - shift] * taps[:, j]
        else:
            y = F.conv1d(F.pad(u.transpose(1, 2), (self.K - 1, 0)), taps[:, None, :], groups=self.cdim)
            out = y.transpose(1, 2)
        return F.silu(out)

    @staticmethod
    def _recurrent(q, k, v, g, beta):
        # q, k (B, h, T, dk); v (B, h, T, dv); g, beta (B, h, T)
        bug = _bug()
        B, h, T, dk = k.shape
        S = q.new_zeros(B, h, dk, v.shape[-1])
        outs = []
        for t in range(T):
            kt, vt, qt = k[:, :, t], v[:, :, t], q[:, :, t]
            dec = g[:, :, t].exp()[..., None, None]
            bt = beta[:, :, t][..., None]
            if bug == "decay_after_update":
                u = bt * (vt - (S * kt[..., None]).sum(-2))
                S = (S + kt[..., None] * u[..., None, :]) * dec
            else:
                S = S * dec
                u = bt * (vt - (S * kt[..., None]).sum(-2))
                S = S + kt[..., None] * u[..., None, :]
            outs.append((S * qt[..., None]).sum(-2))
        return torch.stack(outs, dim=2)

    @staticmethod
    def _chunked(q, k, v, g, beta, C=16):
        # Chunked form: within a chunk with cumulative log decay G and start state S0,
        #   (I + A) U = beta V - (beta e^G K) S0,  A[t, s] = beta_t e^{G_t - G_s} k_t.k_s (s < t)
        #   o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t.k_s) u_s
        #   S_end = e^{G_C} S0 + sum_s e^{G_C - G_s} k_s u_s^T
        B, h, T, dk = k.shape
        dv = v.shape[-1]
        pad = (C - T % C) % C
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
        n = (T + pad) // C
        q, k, v = (x.reshape(B, h, n, C, x.shape[-1]) for x in (q, k, v))
        g, beta = (x.reshape(B, h, n, C) for x in (g, beta))
        G = g.cumsum(-1)
        diff = G[..., :, None] - G[..., None, :]  # (.., C, C): G_t - G_s
        lower_strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
        dec_strict = torch.where(lower_strict, diff, float("-inf")).exp()
        dec_incl = torch.where(lower, diff, float("-inf")).exp()
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        S = q.new_zeros(B, h, dk, dv)
        outs = []
        for i in range(n):
            qi, ki, vi, bi, Gi = q[:, :, i], k[:, :, i], v[:, :, i], beta[:, :, i], G[:, :, i]
            A = bi[..., None] * (ki @ ki.transpose(-1, -2)) * dec_strict[:, :, i]
            rhs = bi[..., None] * vi - (bi * Gi.exp())[..., None] * (ki @ S)
            U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
            o = Gi.exp()[..., None] * (qi @ S) + ((qi @ ki.transpose(-1, -2)) * dec_incl[:, :, i]) @ U
            outs.append(o)
            tail = (Gi[..., -1:] - Gi).exp()[..., None]  # e^{G_C - G_s}
            S = Gi[..., -1].exp()[..., None, None] * S + (ki * tail).transpose(-1, -2) @ U
        out = torch.stack(outs, dim=2).reshape(B, h, n * C, dv)
        return out[:, :, :T]

    def forward(self, x, pos, mask2d):
        bug = _bug()
        B, T, _ = x.shape
        if mask2d is not None and bug != "mask_after_conv":
            x = x * mask2d[:, :, None].to(x.dtype)
        proj = x @ self.w_in
        mixed, z, b, a = proj.split([self.cdim, self.vd, self.nv, self.nv], dim=-1)
        mixed = self._conv(mixed)
        if mask2d is not None and bug == "mask_after_conv":
            mixed = mixed * mask2d[:, :, None].to(mixed.dtype)
        q, k, v = mixed.split([self.kd, self.kd, self.vd], dim=-1)
        q = q.reshape(B, T, self.nk, self.dk)
        k = k.reshape(B, T, self.nk, self.dk)
        v = v.reshape(B, T, self.nv, self.dv)

        beta = torch.sigmoid(b)
        if bug == "dt_bias_outside_softplus":
            g = -self.a_log.exp() * (F.softplus(a) + self.dt_bias)
        else:
            g = -self.a_log.exp() * F.softplus(a + self.dt_bias)

        q, k = _l2n(q), _l2n(k)
        if bug != "delta_q_unscaled":
            q = q * self.dk**-0.5
        rep = self.nv // self.nk
        if rep > 1:
            if bug == "kv_head_tiled":
                q, k = q.repeat(1, 1, rep, 1), k.repeat(1, 1, rep, 1)
            else:
                q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
        if bug == "chunked_delta":
            o = self._chunked(q, k, v, g, beta)
        else:
            o = self._recurrent(q, k, v, g, beta)
        o = o.transpose(1, 2)  # (B, T, nv, dv)

        w = self.norm_w + 1.0 if bug == "gated_norm_unit_offset" else self.norm_w
        z = z.view(B, T, self.nv, self.dv)
        o = _rms(o, self.eps) * w * F.silu(z)
        return o.reshape(B, T, self.vd) @ self.w_out


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.E, self.k = cfg.num_experts, cfg.num_experts_per_tok
        I, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        self.I, self.Is = I, Is
        self.w_route = nn.Parameter(torch.zeros(D, self.E + 1))
        self.w_gu = nn.Parameter(torch.zeros(self.E, D, 2 * I))
        self.w_down = nn.Parameter(torch.zeros(self.E, I, D))
        self.w_sgu = nn.Parameter(torch.zeros(D, 2 * Is))
        self.w_sdown = nn.Parameter(torch.zeros(Is, D))

    def _expert(self, x, e):
        h = x @ self.w_gu[e]
        if _bug() == "experts_up_gate_swapped":
            up, gate = h.chunk(2, dim=-1)
        else:
            gate, up = h.chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down[e]

    def forward(self, x):
        bug = _bug()
        B, T, D = x.shape
        xf = x.reshape(-1, D)
        logits_all = xf @ self.w_route
        logits, shared_logit = logits_all[:, : self.E], logits_all[:, self.E :]

        if bug == "topk_softmax":
            top_logit, idx = logits.topk(self.k, dim=-1)
            wts = torch.softmax(top_logit, dim=-1)
        else:
            p = torch.softmax(logits, dim=-1)
            wts, idx = p.topk(self.k, dim=-1)
            if bug != "no_topk_renorm":
                wts = wts / wts.sum(-1, keepdim=True)

        out = torch.zeros_like(xf)
        if bug == "dense_experts":
            dense = torch.zeros(xf.shape[0], self.E, dtype=xf.dtype, device=xf.device).scatter(1, idx, wts)
            for e in range(self.E):
                out = out + dense[:, e : e + 1] * self._expert(xf, e)
        else:
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                y = self._expert(xf[tok], e) * wts[tok, slot, None]
                out.index_add_(0, tok, y)

        gate, up = (xf @ self.w_sgu).chunk(2, dim=-1)
        shared = (F.silu(gate) * up) @ self.w_sdown
        if bug != "shared_expert_ungated":
            shared = torch.sigmoid(shared_logit) * shared
        return (out + shared).reshape(B, T, D)


class Block(nn.Module):
    def __init__(self, cfg, kind):
        super().__init__()
        self.kind = kind
        self.eps = cfg.rms_norm_eps
        self.gain1 = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gain2 = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mixer = GatedDeltaNet(cfg) if kind == "linear_attention" else GatedAttention(cfg)
        self.moe = SparseMoE(cfg)

    def forward(self, x, pos, mask2d):
        x = x + self.mixer(_rms(x, self.eps) * self.gain1, pos, mask2d)
        return x + self.moe(_rms(x, self.eps) * self.gain2)


class Qwen35MoeLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.tok_emb = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.blocks = nn.ModuleList([Block(cfg, kind) for kind in cfg.layer_types[: cfg.num_hidden_layers]])
        self.final_gain = nn.Parameter(torch.ones(cfg.hidden_size))
        self.head = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.vocab_size))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        x = self.tok_emb[input_ids]
        if position_ids is None:
            pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        else:
            pos = position_ids
        for blk in self.blocks:
            x = blk(x, pos, attention_mask)
        return (_rms(x, self.eps) * self.final_gain) @ self.head


@torch.no_grad()
def build(state_dict, config) -> nn.Module:
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    model = Qwen35MoeLM(config)
    model.tok_emb.copy_(sd["model.embed_tokens.weight"])
    head = sd.get("lm_head.weight")
    if head is None or getattr(config, "tie_word_embeddings", False):
        head = sd["model.embed_tokens.weight"]
    model.head.copy_(head.t())
    model.final_gain.copy_(1.0 + sd["model.norm.weight"])
    for i, blk in enumerate(model.blocks):
        p = f"model.layers.{i}."
        blk.gain1.copy_(1.0 + sd[p + "input_layernorm.weight"])
        blk.gain2.copy_(1.0 + sd[p + "post_attention_layernorm.weight"])
        m = blk.mixer
        if blk.kind == "linear_attention":
            a = p + "linear_attn."
            m.w_in.copy_(
                torch.cat(
                    [
                        sd[a + n]
                        for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
                    ],
                    dim=0,
                ).t()
            )
            m.taps.copy_(sd[a + "conv1d.weight"].reshape(m.cdim, m.K))
            m.a_log.copy_(sd[a + "A_log"])
            m.dt_bias.copy_(sd[a + "dt_bias"])
            m.norm_w.copy_(sd[a + "norm.weight"])
            m.w_out.copy_(sd[a + "out_proj.weight"].t())
        else:
            a = p + "self_attn."
            m.w_in.copy_(
                torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]], dim=0).t()
            )
            m.q_gain.copy_(1.0 + sd[a + "q_norm.weight"])
            m.k_gain.copy_(1.0 + sd[a + "k_norm.weight"])
            m.w_out.copy_(sd[a + "o_proj.weight"].t())
        e = blk.moe
        f = p + "mlp."
        e.w_route.copy_(torch.cat([sd[f + "gate.weight"], sd[f + "shared_expert_gate.weight"]], dim=0).t())
        e.w_gu.copy_(sd[f + "experts.gate_up_proj"].transpose(1, 2))
        e.w_down.copy_(sd[f + "experts.down_proj"].transpose(1, 2))
        e.w_sgu.copy_(
            torch.cat([sd[f + "shared_expert.gate_proj.weight"], sd[f + "shared_expert.up_proj.weight"]], dim=0).t()
        )
        e.w_sdown.copy_(sd[f + "shared_expert.down_proj.weight"].t())
    return model.float().eval()
