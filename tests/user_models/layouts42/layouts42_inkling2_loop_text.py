"""Hand-written plain-PyTorch port of Inkling-2 Loop (Inkling2LoopForCausalLM, model type inkling2_loop_text).

Architecture as this port implements it (no RoPE: positions enter through a relative-position bias and a
log scaling only):
- embedding: e = RMSNorm(E[ids]) * g_emb (a normed embedding); untied head of `unpadded_vocab_size` rows,
  logits = c * tanh((W_head RMSNorm_final(x)) / c) (final softcap c).
- "attention residuals" (depth attention): the stream keeps a list of block states (the input of every layer
  whose index is a multiple of n_layers_per_attn_res_block). A learned query q (per use) attends over
  S = unweighted-RMSNorm([block states..., current]) with logits S.q / sqrt(H) and returns sum softmax * S.
  Each layer uses it for its attention input (sliding: 1 query, full: 3 queries for q / k / v inputs; none in
  layer 0) and for its MLP input; the model uses it once more before the final norm.
- layer, for input h:  a = conv_post_attn(Attn(...));  if the layer is a block boundary the block states get h
  and the residual restarts at a, else residual = h + a;  out = residual + conv_post_mlp(MoE(RMSNorm(DA_mlp)))
- attention (sliding: window W, rel. extent W; full: causal, rel. extent rel_extent, log scaling):
  q = clip(W_q x * s_q) [* tau(pos) in full layers], tau = 1 + alpha log(max((pos + 1) / n_floor, 1));
  k = clip(conv(W_k x_k)); v = RMSNorm_unweighted(conv(W_v x_v)); clip = scale each head vector down to
  norm `qk_l2_clip_threshold`; sliding layers: static depthwise causal conv of K taps with the identity
  residual, divided by sqrt(K + 1); full layers: a dynamic conv whose taps are static + per-token per-kv-head
  taps projected from x_k (x_v), residual, divided by sqrt(2K + 1);  relative bias: states
  r = clip_rel(W_r x * s_r) [* tau] per head, bias(q, k) = (r_q @ P)[q - k] for 0 <= q - k < extent, else 0;
  per-token per-head sink logits W_sink x join the softmax (probability mass only, no value);
  o = W_o (attn * sigmoid(W_gate x)).  Padding tokens are zeroed before every short conv.
- MoE: sigmoid router with a selection-only correction bias, top-k weights renormalised and scaled by
  route_scale; experts: gate/up, act = softcap(g, c_g) * sigmoid(g) * softcap(u, c_u), down.
- loop: layers [loop_start, loop_end) run loop_num_passes times; each pass after the first restarts from the
  pre-loop hidden / block states and every loop layer mixes "messages" (depth attention of a per-layer (4, H)
  query over the previous pass's block states after its first one and its last hidden state) into its
  q / k / v / MLP inputs with a gate (1 - tanh(W_f z)) * x + tanh(W_m z) * m, z = W_d [rms(x); rms(m)].

Weight layout, baseline (BUG == ""): own names (`emb`, `blocks.{i}`, `mix`, `moe`, ...); every projection stored
transposed (in, out) and applied as x @ W; the four projections of the query input fused into one `w_qgsr`
= [q | out-gate | sink | relative] (H, ...); all conv taps stored (channels, K) in lag order (column j weights
the token j steps back: the static convs' taps are flipped relative to Conv1d's) and applied by left pad +
shifted sum; experts split into `w_gate` / `w_up` (E, H, I) and `w_down` (E, I, H), evaluated per token on
the gathered top-k weights; router (H, E); message gates with the forget / message projections fused (r, 2H).
Variants (CLEAN), each a correct port:
- ink_folded_gains: every RMSNorm gain folded into the next projections' input rows (layer input norms into
  q / gate / sink / relative / k / v / dynamic-tap projections, MLP norm into router and expert gate / up, final
  norm into the head); the embedding table stored already normed (RMSNorm * g_emb per row); the clip scales
  s_q and s_r folded into the q / relative projection columns.
- ink_conv1d_folded_residual: static short convs as nn.Conv1d (HF (C, 1, K) tap order) whose taps absorb the
  identity residual and the 1/sqrt(K + 1) output scale; dynamic convs with the identity folded into the
  current-token static tap and 1/sqrt(2K + 1) folded into static taps and the tap projection.
- ink_sdpa_sink_column: attention through F.scaled_dot_product_attention with the relative bias and a boolean
  mask merged into a float mask, the sinks as an extra all-zero key / value column whose mask entry is the
  sink logit.
- ink_dense_experts_interleaved: expert gate / up stored interleaved (E, H, 2I) = [g0, u0, g1, u1, ...], all
  experts evaluated densely with einsum and combined with a dense (tokens, E) routing matrix; top-k by argsort.
- ink_heads_einsum: q / gate / k / v / o / relative / sink / tap weights with a separate heads axis
  ((heads, head_dim, hidden)) used with einsum; the relative bias built with a one-hot distance tensor
  instead of a gather.
- ink_unrolled_shared: the loop unrolled into a flat schedule (`steps`, a ModuleList that holds the looped
  blocks several times, weights shared); message queries in a ParameterList; block states in a Python list.
- ink_stacked_functional: one functional forward over an nn.ParameterDict of per-kind stacked tensors
  (sliding / full attention weights stacked per type, MoE / norms / convs stacked over all layers, message
  gates stacked per loop layer), Transformers' (out, in) orientation and F.linear, experts looped.
- ink_tables_mask_positions: positions taken from the attention mask (cumsum) when none are given; the log
  scale tau, the causal / sliding masks and the relative-distance index precomputed as buffers over
  max_position_embeddings; the relative bias gathered from a projection with an extra all-zero column that
  every out-of-range distance points to; masks applied additively (0 / -inf).
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
    "ink_folded_gains",  # RMSNorm gains folded into the next projections, normed embedding table, clip scales folded
    "ink_conv1d_folded_residual",  # nn.Conv1d short convs with the residual and output scale folded into the taps
    "ink_sdpa_sink_column",  # SDPA with bias + bool mask as float mask and the sink as an extra zero key/value
    "ink_dense_experts_interleaved",  # interleaved gate/up (E, H, 2I), dense all-expert einsum, argsort top-k
    "ink_heads_einsum",  # (heads, head_dim, hidden) weights with einsum, one-hot relative-distance bias
    "ink_unrolled_shared",  # loop unrolled into a flat ModuleList of shared blocks, ParameterList message queries
    "ink_stacked_functional",  # functional forward over a ParameterDict of per-kind stacked (n_layers, ...) tensors
    "ink_tables_mask_positions",  # mask-derived positions, precomputed tau / mask / distance-index buffers
]

DA_EPS = 1e-6  # the depth attention's unweighted RMSNorm keeps its default eps


# ----------------------------------------------------------------------------------------------- helpers
def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _clip(x, thr):
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (thr / (n + 1e-6)).clamp(max=1.0)


def _softcap(x, c):
    return torch.tanh(x / c) * c


def _depth_attn(query, states):
    """query (nq, H); states: list of (b, t, H). Returns (b, t, nq, H)."""
    s = _rms(torch.stack(states, dim=-2), DA_EPS)
    w = torch.softmax(torch.einsum("btnh,qh->btqn", s, query) / math.sqrt(s.shape[-1]), dim=-1)
    return torch.einsum("btqn,btnh->btqh", w, s)


def _lag_conv(xm, w_lag):
    """Causal depthwise conv: out[t] = sum_j w_lag[:, j] * xm[t - j] (zeros before the start)."""
    k, t = w_lag.shape[-1], xm.shape[1]
    xp = F.pad(xm, (0, 0, k - 1, 0))
    out = xp[:, k - 1 : k - 1 + t] * w_lag[:, 0]
    for j in range(1, k):
        out = out + xp[:, k - 1 - j : k - 1 - j + t] * w_lag[:, j]
    return out


def _masked(x, mask2d):
    return x if mask2d is None else x * mask2d[:, :, None].to(x.dtype)


def _tau(pos, alpha, floor):
    return 1.0 + alpha * torch.log(((pos + 1).float() / floor).clamp(min=1.0))


def _gather_rel_bias(rel_logits, dist, extent):
    """rel_logits (b, h, t, extent), dist (t, t) = q - k."""
    b, h = rel_logits.shape[:2]
    idx = dist.clamp(0, extent - 1).expand(b, h, -1, -1)
    bias = rel_logits.gather(-1, idx)
    return bias.masked_fill((dist < 0) | (dist >= extent), 0.0)


def _eager_sink_attention(q, k, v, bias, sinks, keep):
    """q (b, Hq, t, d); k / v (b, Hkv, t, d); bias (b, Hq, t, t); sinks (b, Hq, t); keep (b, 1, t, t) bool."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(torch.cat([s, sinks[..., None]], dim=-1), dim=-1)[..., :-1]
    return p @ v


def _sdpa_sink_attention(q, k, v, bias, sinks, keep):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    zero = q.new_zeros(*k.shape[:2], 1, k.shape[-1])
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    mask = torch.cat([bias.masked_fill(~keep, float("-inf")), sinks[..., None]], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _msg_gate(x, m, w_down_t, w_fm_t, eps):
    z = torch.cat([_rms(x, eps), _rms(m, eps)], dim=-1) @ w_down_t
    f, g = torch.tanh(z @ w_fm_t).chunk(2, dim=-1)
    return (1 - f) * x + g * m


class _Cfg:
    """The handful of hyper-parameters the port needs, read once from the Transformers config."""

    def __init__(self, c):
        self.H = c.hidden_size
        self.eps = c.rms_norm_eps
        self.K = c.conv_kernel_size
        self.E = c.n_routed_experts
        self.topk = c.num_experts_per_tok
        self.route_scale = c.route_scale
        self.cg, self.cu, self.cf = c.mlp_gate_softcap, c.mlp_up_softcap, c.final_logit_softcapping
        self.thr_qk, self.thr_rel = c.qk_l2_clip_threshold, c.rel_l2_clip_threshold
        self.alpha, self.floor = c.log_scaling_alpha, c.log_scaling_n_floor
        self.block = c.n_layers_per_attn_res_block
        self.ls, self.le, self.passes = c.loop_layer_index_start, c.loop_layer_index_end, c.loop_num_passes
        self.n_layers = c.num_hidden_layers
        self.sliding = [t == "hybrid_sliding" for t in c.layer_types]
        self.window = c.sliding_window_size
        self.dr = c.d_rel
        self.max_pos = c.max_position_embeddings
        self.I = c.moe_intermediate_size

    def dims(self, sliding):
        """(query heads, kv heads, head dim, relative extent) of a layer type."""
        if sliding:
            return self.nq_s, self.nkv_s, self.hd_s, self.window
        return self.nq_f, self.nkv_f, self.hd_f, self.rel_extent


def _cfg(c):
    cfg = _Cfg(c)
    cfg.nq_s, cfg.nkv_s, cfg.hd_s = c.swa_num_attention_heads, c.swa_num_key_value_heads, c.swa_head_dim
    cfg.nq_f, cfg.nkv_f, cfg.hd_f = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    cfg.rel_extent = c.rel_extent
    return cfg


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


# ------------------------------------------------------------------------------------------ module tree
class Mixer(nn.Module):
    """One attention layer (sliding or full) in the port's own layout."""

    def __init__(self, sd, pre, cfg, sliding, variant, gains):
        super().__init__()
        self.cfg, self.sliding, self.variant = cfg, sliding, variant
        nq, nkv, d, ext = cfg.dims(sliding)
        self.nq, self.nkv, self.d, self.ext = nq, nkv, d, ext
        K, dr = cfg.K, cfg.dr
        g_q, g_k, g_v = gains  # input-norm gains to fold (ink_folded_gains) or None
        a = pre + "self_attn."
        wq = sd[a + "q_proj.linear.weight"].float()
        wg = sd[a + "o_proj.gate_proj.weight"].float()
        ws = sd[a + "sink_proj.weight"].float()
        wr = sd[a + "relative_position_bias.linear.weight"].float()
        s_q = sd[a + "q_proj.norm.scale"].float()
        s_r = sd[a + "relative_position_bias.norm.scale"].float()
        wk = sd[a + "k_proj.linear.weight"].float()
        wv = sd[a + "v_proj.linear.weight"].float()
        wo = sd[a + "o_proj.linear.weight"].float()
        proj = sd[a + "relative_position_bias.proj"].float()  # (d_rel, extent)
        if sliding:  # static taps, Conv1d order (last tap = current token)
            ck = sd[a + "k_proj.sconv.conv1d.weight"].float()[:, 0]
            cv = sd[a + "v_proj.sconv.conv1d.weight"].float()[:, 0]
        else:  # static taps (K, C) in lag order, tap projections (nkv * K, H)
            ck = sd[a + "k_proj.sconv.static_weight"].float()
            cv = sd[a + "v_proj.sconv.static_weight"].float()
            dk = sd[a + "k_proj.sconv.weight_proj.weight"].float()
            dv = sd[a + "v_proj.sconv.weight_proj.weight"].float()
        if variant == "ink_folded_gains":
            wq = wq * s_q.reshape(-1, 1)
            wr = wr * s_r.reshape(-1, 1)
            wq, wg, ws, wr = (w * g_q for w in (wq, wg, ws, wr))
            wk, wv = wk * g_k, wv * g_v
            if not sliding:
                dk, dv = dk * g_k, dv * g_v
        else:
            self.s_q = _p(s_q)
            self.s_r = _p(s_r)
        # ----- conv taps
        if sliding:
            if variant == "ink_conv1d_folded_residual":
                self.conv_k = self._conv1d(ck, K)
                self.conv_v = self._conv1d(cv, K)
            else:
                self.c_k = _p(ck.flip(-1))  # (C, K) lag order
                self.c_v = _p(cv.flip(-1))
        else:
            ck, cv = ck.t(), cv.t()  # (C, K) lag order
            if variant == "ink_conv1d_folded_residual":
                r = 1.0 / math.sqrt(2 * K + 1)
                ck, cv = ck.clone(), cv.clone()
                ck[:, 0] += 1.0
                cv[:, 0] += 1.0
                ck, cv, dk, dv = ck * r, cv * r, dk * r, dv * r
            if variant == "ink_heads_einsum":
                self.c_k = _p(ck.reshape(nkv, d, K))
                self.c_v = _p(cv.reshape(nkv, d, K))
                self.w_dk = _p(dk.reshape(nkv, K, -1))
                self.w_dv = _p(dv.reshape(nkv, K, -1))
            else:
                self.c_k, self.c_v = _p(ck), _p(cv)
                self.w_dk, self.w_dv = _p(dk.t()), _p(dv.t())
        # ----- projections
        if variant == "ink_heads_einsum":
            self.wq = _p(wq.reshape(nq, d, -1))
            self.wg = _p(wg.reshape(nq, d, -1))
            self.wsink = _p(ws)
            self.wrel = _p(wr.reshape(nq, dr, -1))
            self.wk = _p(wk.reshape(nkv, d, -1))
            self.wv = _p(wv.reshape(nkv, d, -1))
            self.wo = _p(wo.t().reshape(nq, d, -1))
        else:
            self.w_qgsr = _p(torch.cat([wq, wg, ws, wr], dim=0).t())
            self.wk_t, self.wv_t, self.wo_t = _p(wk.t()), _p(wv.t()), _p(wo.t())
        if variant == "ink_tables_mask_positions":  # zero column at index `extent` for out-of-range distances
            self.rel_p = _p(torch.cat([proj, proj.new_zeros(dr, 1)], dim=1))
        else:
            self.rel_p = _p(proj)

    @staticmethod
    def _conv1d(w, K):
        conv = nn.Conv1d(w.shape[0], w.shape[0], K, groups=w.shape[0], bias=False)
        w = w.clone()
        w[:, -1] += 1.0
        conv.weight = _p((w / math.sqrt(K + 1))[:, None, :])
        return conv

    # the static (sliding) short conv of k / v
    def _static(self, x, mask2d, which):
        K = self.cfg.K
        xm = _masked(x, mask2d)
        if self.variant == "ink_conv1d_folded_residual":
            conv = self.conv_k if which == "k" else self.conv_v
            return conv(F.pad(xm.transpose(1, 2), (K - 1, 0))).transpose(1, 2)
        w = self.c_k if which == "k" else self.c_v
        return (_lag_conv(xm, w) + x) / math.sqrt(K + 1)

    # the dynamic (full) short conv of k / v, taps from the projection input x_in
    def _dynamic(self, x, x_in, mask2d, which):
        K, (b, t, _) = self.cfg.K, x.shape
        xm = _masked(x, mask2d)
        if self.variant == "ink_heads_einsum":
            c = self.c_k if which == "k" else self.c_v  # (nkv, d, K)
            wd = self.w_dk if which == "k" else self.w_dv  # (nkv, K, H)
            taps = c + torch.einsum("bth,nkh->btnk", x_in, wd)[:, :, :, None, :]  # (b, t, nkv, d, K)
            win = F.pad(xm, (0, 0, K - 1, 0)).unfold(1, K, 1).flip(-1)  # (b, t, C, K) lag order
            out = (win.reshape(b, t, self.nkv, self.d, K) * taps).sum(-1).reshape(b, t, -1)
        else:
            c = self.c_k if which == "k" else self.c_v  # (C, K)
            wd = self.w_dk if which == "k" else self.w_dv  # (H, nkv * K)
            dyn = (x_in @ wd).reshape(b, t, self.nkv, K)
            xp = F.pad(xm, (0, 0, K - 1, 0))
            out = 0
            for j in range(K):
                tap = c[:, j] + dyn[..., j].repeat_interleave(self.d, dim=-1)
                out = out + xp[:, K - 1 - j : K - 1 - j + t] * tap
        if self.variant == "ink_conv1d_folded_residual":
            return out
        return (out + x) / math.sqrt(2 * K + 1)

    def _rel_bias(self, r, ctx):
        """r (b, t, nq, d_rel) -> bias (b, nq, t, t)."""
        t = r.shape[1]
        if self.variant == "ink_tables_mask_positions":
            logits = (r @ self.rel_p).transpose(1, 2)  # (b, nq, t, ext + 1)
            idx = ctx["rel_index_" + ("s" if self.sliding else "f")][:t, :t]
            return logits.gather(-1, idx.expand(*logits.shape[:2], -1, -1))
        logits = (r @ self.rel_p).transpose(1, 2)
        dist = ctx["dist"]
        if self.variant == "ink_heads_einsum":
            onehot = F.one_hot(dist.clamp(0, self.ext - 1), self.ext).to(logits.dtype)
            onehot = onehot * ((dist >= 0) & (dist < self.ext))[..., None].to(logits.dtype)
            return torch.einsum("bhqe,qke->bhqk", logits, onehot)
        return _gather_rel_bias(logits, dist, self.ext)

    def forward(self, xq, xk, xv, ctx):
        cfg = self.cfg
        b, t, _ = xq.shape
        nq, nkv, d = self.nq, self.nkv, self.d
        if self.variant == "ink_heads_einsum":
            q = torch.einsum("bth,ndh->btnd", xq, self.wq)
            gate = torch.einsum("bth,ndh->btnd", xq, self.wg).reshape(b, t, -1)
            sinks = xq @ self.wsink.t()
            r = torch.einsum("bth,ndh->btnd", xq, self.wrel)
            k = torch.einsum("bth,ndh->btnd", xk, self.wk).reshape(b, t, -1)
            v = torch.einsum("bth,ndh->btnd", xv, self.wv).reshape(b, t, -1)
        else:
            y = xq @ self.w_qgsr
            q, gate, sinks, r = y.split([nq * d, nq * d, nq, nq * cfg.dr], dim=-1)
            q, r = q.reshape(b, t, nq, d), r.reshape(b, t, nq, cfg.dr)
            k, v = xk @ self.wk_t, xv @ self.wv_t
        if self.variant != "ink_folded_gains":
            q, r = q * self.s_q, r * self.s_r
        q, r = _clip(q, cfg.thr_qk), _clip(r, cfg.thr_rel)
        if not self.sliding:
            tau = ctx["tau"][:, :, None, None]
            q, r = q * tau, r * tau
        if self.sliding:
            k = self._static(k, ctx["mask2d"], "k")
            v = self._static(v, ctx["mask2d"], "v")
        else:
            k = self._dynamic(k, xk, ctx["mask2d"], "k")
            v = self._dynamic(v, xv, ctx["mask2d"], "v")
        k = _clip(k.reshape(b, t, nkv, d), cfg.thr_qk)
        v = _rms(v.reshape(b, t, nkv, d), cfg.eps)
        bias = self._rel_bias(r, ctx)
        keep = ctx["keep_s" if self.sliding else "keep_f"]
        attend = _sdpa_sink_attention if self.variant == "ink_sdpa_sink_column" else _eager_sink_attention
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, sinks.transpose(1, 2), keep)
        o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
        if self.variant == "ink_heads_einsum":
            return torch.einsum("btnd,ndh->bth", o.reshape(b, t, nq, d), self.wo)
        return o @ self.wo_t


class MoE(nn.Module):
    def __init__(self, sd, pre, cfg, variant, gain):
        super().__init__()
        self.cfg, self.variant = cfg, variant
        wr = sd[pre + "mlp.gate.weight"].float()  # (E, H)
        gu = sd[pre + "mlp.experts.gate_up_proj"].float()  # (E, 2I, H)
        down = sd[pre + "mlp.experts.down_proj"].float()  # (E, H, I)
        if gain is not None:
            wr = wr * gain
            gu = gu * gain
        self.router_t = _p(wr.t())
        self.bias = _p(sd[pre + "mlp.gate.e_score_correction_bias"].float())
        g, u = gu.chunk(2, dim=1)
        if variant == "ink_dense_experts_interleaved":
            self.w_gu = _p(torch.stack([g, u], dim=2).reshape(cfg.E, -1, cfg.H).transpose(1, 2))  # (E, H, 2I)
        else:
            self.w_gate, self.w_up = _p(g.transpose(1, 2)), _p(u.transpose(1, 2))  # (E, H, I)
        self.w_down = _p(down.transpose(1, 2))  # (E, I, H)

    def forward(self, x):
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, cfg.H)
        s = torch.sigmoid(x @ self.router_t)
        if self.variant == "ink_dense_experts_interleaved":
            idx = torch.argsort(s + self.bias, dim=-1, descending=True)[:, : cfg.topk]
        else:
            idx = torch.topk(s + self.bias, cfg.topk, dim=-1).indices
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.route_scale
        if self.variant == "ink_dense_experts_interleaved":
            gu = torch.einsum("nh,ehj->nej", x, self.w_gu)
            g, u = gu[..., 0::2], gu[..., 1::2]
            act = _softcap(g, cfg.cg) * torch.sigmoid(g) * _softcap(u, cfg.cu)
            y = torch.einsum("nei,eih->neh", act, self.w_down)
            route = torch.zeros_like(s).scatter(1, idx, w)
            return torch.einsum("ne,neh->nh", route, y).reshape(shape)
        g = torch.einsum("nh,nkhi->nki", x, self.w_gate[idx])
        u = torch.einsum("nh,nkhi->nki", x, self.w_up[idx])
        act = _softcap(g, cfg.cg) * torch.sigmoid(g) * _softcap(u, cfg.cu)
        y = torch.einsum("nki,nkih->nkh", act, self.w_down[idx])
        return (y * w[..., None]).sum(1).reshape(shape)


class MsgGate(nn.Module):
    def __init__(self, sd, pre, eps):
        super().__init__()
        self.eps = eps
        self.w_down_t = _p(sd[pre + "down_proj.weight"].float().t())
        self.w_fm_t = _p(
            torch.cat([sd[pre + "forget_gate_proj.weight"], sd[pre + "message_gate_proj.weight"]]).float().t()
        )

    def forward(self, x, m):
        return _msg_gate(x, m, self.w_down_t, self.w_fm_t, self.eps)


class Block(nn.Module):
    def __init__(self, sd, i, cfg, variant):
        super().__init__()
        pre = f"model.layers.{i}."
        self.cfg, self.variant, self.idx = cfg, variant, i
        self.sliding = cfg.sliding[i]
        self.boundary = i % cfg.block == 0
        self.is_loop = cfg.ls <= i < cfg.le
        fold = variant == "ink_folded_gains"
        if self.sliding:
            names = ["input_layernorm"]
        else:
            names = ["q_input_layernorm", "k_input_layernorm", "v_input_layernorm"]
        gains = [sd[pre + n + ".weight"].float() for n in names]
        post = sd[pre + "post_attention_layernorm.weight"].float()
        if fold:
            self.in_gains = None
            self.post_gain = None
        else:
            self.in_gains = nn.ParameterList([_p(g) for g in gains])
            self.post_gain = _p(post)
        mix_gains = (gains * 3)[:3] if self.sliding else gains
        self.mix = Mixer(sd, pre, cfg, self.sliding, variant, mix_gains if fold else (None, None, None))
        self.moe = MoE(sd, pre, cfg, variant, post if fold else None)
        q = sd.get(pre + "attention_input.query")
        self.attn_q = None if q is None else _p(q.reshape(-1, cfg.H))
        self.mlp_q = _p(sd[pre + "mlp_input.query"].reshape(1, cfg.H))
        K = cfg.K
        for name in ("post_attention_convolution", "post_mlp_convolution"):
            w = sd[pre + name + ".conv1d.weight"].float()[:, 0]  # (C, K), Conv1d order
            if variant == "ink_conv1d_folded_residual":
                setattr(self, name.replace("convolution", "conv"), Mixer._conv1d(w, K))
            else:
                setattr(self, name.replace("convolution", "conv"), _p(w.flip(-1)))
        if self.is_loop:
            self.msg = nn.ModuleDict(
                {k: MsgGate(sd, pre + f"{k}_message_gate.", cfg.eps) for k in ("q", "k", "v", "mlp")}
            )

    def _norm(self, x, j):
        x = _rms(x, self.cfg.eps)
        return x if self.in_gains is None else x * self.in_gains[j]

    def _conv(self, x, which, mask2d):
        w = getattr(self, which)
        K = self.cfg.K
        xm = _masked(x, mask2d)
        if isinstance(w, nn.Conv1d):
            return w(F.pad(xm.transpose(1, 2), (K - 1, 0))).transpose(1, 2)
        return (_lag_conv(xm, w) + x) / math.sqrt(K + 1)

    def forward(self, h, block_states, msgs, ctx):
        block_res = h
        if self.sliding:
            x = h if self.attn_q is None else _depth_attn(self.attn_q, block_states + [h])[..., 0, :]
            if msgs is None:
                xq = xk = xv = self._norm(x, 0)
            else:
                xq = self._norm(self.msg["q"](x, msgs[..., 0, :]), 0)
                xk = self._norm(self.msg["k"](x, msgs[..., 1, :]), 0)
                xv = self._norm(self.msg["v"](x, msgs[..., 2, :]), 0)
        else:
            if self.attn_q is None:
                aq = ak = av = h
            else:
                aq, ak, av = _depth_attn(self.attn_q, block_states + [h]).unbind(-2)
            if msgs is not None:
                aq = self.msg["q"](aq, msgs[..., 0, :])
                ak = self.msg["k"](ak, msgs[..., 1, :])
                av = self.msg["v"](av, msgs[..., 2, :])
            xq, xk, xv = self._norm(aq, 0), self._norm(ak, 1), self._norm(av, 2)
        a = self._conv(self.mix(xq, xk, xv, ctx), "post_attention_conv", ctx["mask2d"])
        if self.boundary:
            block_states = block_states + [block_res]
            res = a
        else:
            res = block_res + a
        m = _depth_attn(self.mlp_q, block_states + [res])[..., 0, :]
        if msgs is not None:
            m = self.msg["mlp"](m, msgs[..., 3, :])
        m = _rms(m, self.cfg.eps)
        if self.post_gain is not None:
            m = m * self.post_gain
        return res + self._conv(self.moe(m), "post_mlp_conv", ctx["mask2d"])


def _keep_masks(mask2d, t, window, device):
    i = torch.arange(t, device=device)
    dist = i[:, None] - i[None, :]
    causal = dist >= 0
    pad = torch.ones(1, 1, 1, t, dtype=torch.bool, device=device) if mask2d is None else mask2d.bool()[:, None, None, :]
    return dist, causal & pad, causal & (dist < window) & pad


class InklingLoopLM(nn.Module):
    def __init__(self, sd, cfg, variant):
        super().__init__()
        self.cfg, self.variant = cfg, variant
        emb = sd["model.embed_tokens.weight"].float()
        g_emb = sd["model.embed_tokens.embed_norm.weight"].float()
        final = sd["model.norm.weight"].float()
        head = sd["lm_head.weight"].float()
        if variant == "ink_folded_gains":
            self.emb = _p(_rms(emb, cfg.eps) * g_emb)  # the normed embedding, one row per token
            self.emb_gain = None
            self.final_gain = None
            self.head_t = _p((head * final).t())
        else:
            self.emb = _p(emb)
            self.emb_gain = _p(g_emb)
            self.final_gain = _p(final)
            self.head_t = _p(head.t())
        self.blocks = nn.ModuleList([Block(sd, i, cfg, variant) for i in range(cfg.n_layers)])
        self.final_q = _p(sd["model.final_input.query"].reshape(1, cfg.H))
        mq = sd["model.message_input.query"].float()  # (n_loop, 4, H)
        if variant == "ink_unrolled_shared":
            self.msg_q = nn.ParameterList([_p(q) for q in mq])
            loop = list(range(cfg.ls, cfg.le))
            order = list(range(cfg.ls)) + loop * cfg.passes + list(range(cfg.le, cfg.n_layers))
            self.steps = nn.ModuleList([self.blocks[i] for i in order])
            self.schedule = (
                [(None, None)] * cfg.ls
                + [(p, j) for p in range(cfg.passes) for j in range(len(loop))]
                + [(None, None)] * (cfg.n_layers - cfg.le)
            )
        else:
            self.msg_q = _p(mq)
        if variant == "ink_tables_mask_positions":
            pos = torch.arange(cfg.max_pos)
            self.register_buffer("tau_table", _tau(pos, cfg.alpha, cfg.floor), persistent=False)
            dist = pos[:, None] - pos[None, :]
            self.register_buffer("causal_table", dist >= 0, persistent=False)
            self.register_buffer("window_table", (dist >= 0) & (dist < cfg.window), persistent=False)
            for tag, ext in (("s", cfg.window), ("f", cfg.rel_extent)):
                idx = torch.where((dist >= 0) & (dist < ext), dist, torch.full_like(dist, ext))
                self.register_buffer("rel_index_" + tag, idx, persistent=False)

    def _context(self, input_ids, attention_mask, position_ids):
        cfg = self.cfg
        b, t = input_ids.shape
        dev = input_ids.device
        mask2d = None if attention_mask is None else attention_mask.to(torch.float32)
        if self.variant == "ink_tables_mask_positions":
            if position_ids is None:
                if attention_mask is None:
                    position_ids = torch.arange(t, device=dev)[None].expand(b, t)
                else:
                    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            pad = torch.ones(b, t, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
            pad = pad[:, None, None, :]
            ctx = {
                "tau": self.tau_table[position_ids],
                "keep_f": self.causal_table[:t, :t] & pad,
                "keep_s": self.window_table[:t, :t] & pad,
                "rel_index_s": self.rel_index_s,
                "rel_index_f": self.rel_index_f,
            }
        else:
            if position_ids is None:
                position_ids = torch.arange(t, device=dev)[None]
            dist, keep_f, keep_s = _keep_masks(mask2d, t, cfg.window, dev)
            ctx = {"tau": _tau(position_ids, cfg.alpha, cfg.floor), "keep_f": keep_f, "keep_s": keep_s, "dist": dist}
        ctx["mask2d"] = mask2d
        return ctx

    def hidden(self, input_ids, attention_mask=None, position_ids=None):
        cfg = self.cfg
        ctx = self._context(input_ids, attention_mask, position_ids)
        h = self.emb[input_ids]
        if self.emb_gain is not None:
            h = _rms(h, cfg.eps) * self.emb_gain
        states = []
        if self.variant == "ink_unrolled_shared":
            pre_h = pre_states = prev_h = prev_states = None
            for blk, (p, j) in zip(self.steps, self.schedule):
                msgs = None
                if p is not None and j == 0:
                    if p == 0:
                        pre_h, pre_states = h, list(states)
                    else:
                        prev_h, prev_states = h, states[len(pre_states) + 1 :]
                        h, states = pre_h, list(pre_states)
                if p is not None and p > 0:
                    msgs = _depth_attn(self.msg_q[j], prev_states + [prev_h])
                new_h = blk(h, states, msgs, ctx)
                if blk.boundary:
                    states.append(h)
                h = new_h
        else:

            def run(i, h, states, msgs=None):
                new_h = self.blocks[i](h, states, msgs, ctx)
                return new_h, (states + [h] if self.blocks[i].boundary else states)

            for i in range(cfg.ls):
                h, states = run(i, h, states)
            pre_h, pre_states = h, states
            for i in range(cfg.ls, cfg.le):
                h, states = run(i, h, states)
            for _ in range(1, cfg.passes):
                prev_states, prev_h = states[len(pre_states) + 1 :], h
                h, states = pre_h, pre_states
                for j, i in enumerate(range(cfg.ls, cfg.le)):
                    msgs = _depth_attn(self.msg_q[j], prev_states + [prev_h])
                    h, states = run(i, h, states, msgs)
            for i in range(cfg.le, cfg.n_layers):
                h, states = run(i, h, states)
        h = _depth_attn(self.final_q, states + [h])[..., 0, :]
        h = _rms(h, cfg.eps)
        return h if self.final_gain is None else h * self.final_gain

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        logits = self.hidden(input_ids, attention_mask, position_ids) @ self.head_t
        return _softcap(logits, self.cfg.cf).float()


# ------------------------------------------------------------------------------- stacked functional port
class InklingLoopFunctional(nn.Module):
    """ink_stacked_functional: every weight in one ParameterDict, stacked per kind; one forward function."""

    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        L = cfg.n_layers
        swa = [i for i in range(L) if cfg.sliding[i]]
        full = [i for i in range(L) if not cfg.sliding[i]]
        loop = list(range(cfg.ls, cfg.le))
        self.slot = {i: (swa.index(i) if cfg.sliding[i] else full.index(i)) for i in range(L)}
        P = {}

        def stack(names, idx):
            return torch.stack([sd[f"model.layers.{i}.{names}"].float() for i in idx])

        P["embed"] = sd["model.embed_tokens.weight"]
        P["embed_norm"] = sd["model.embed_tokens.embed_norm.weight"]
        P["final_norm"] = sd["model.norm.weight"]
        P["final_query"] = sd["model.final_input.query"]
        P["message_query"] = sd["model.message_input.query"]
        P["lm_head"] = sd["lm_head.weight"]
        for tag, idx in (("swa", swa), ("full", full)):
            for name, key in (
                ("wq", "self_attn.q_proj.linear.weight"),
                ("q_scale", "self_attn.q_proj.norm.scale"),
                ("wk", "self_attn.k_proj.linear.weight"),
                ("wv", "self_attn.v_proj.linear.weight"),
                ("wgate", "self_attn.o_proj.gate_proj.weight"),
                ("wo", "self_attn.o_proj.linear.weight"),
                ("wsink", "self_attn.sink_proj.weight"),
                ("wrel", "self_attn.relative_position_bias.linear.weight"),
                ("rel_scale", "self_attn.relative_position_bias.norm.scale"),
                ("rel_proj", "self_attn.relative_position_bias.proj"),
            ):
                P[f"{tag}_{name}"] = stack(key, idx)
        P["swa_conv_k"] = stack("self_attn.k_proj.sconv.conv1d.weight", swa)
        P["swa_conv_v"] = stack("self_attn.v_proj.sconv.conv1d.weight", swa)
        P["swa_norm"] = stack("input_layernorm.weight", swa)
        P["full_static_k"] = stack("self_attn.k_proj.sconv.static_weight", full)
        P["full_static_v"] = stack("self_attn.v_proj.sconv.static_weight", full)
        P["full_tapproj_k"] = stack("self_attn.k_proj.sconv.weight_proj.weight", full)
        P["full_tapproj_v"] = stack("self_attn.v_proj.sconv.weight_proj.weight", full)
        P["full_norms"] = torch.stack(
            [torch.stack([sd[f"model.layers.{i}.{n}_input_layernorm.weight"] for n in "qkv"]) for i in full]
        )
        # attention-input queries padded to 3 rows (sliding layers use row 0, layer 0 has none)
        aq = torch.zeros(L, 3, cfg.H)
        for i in range(L):
            q = sd.get(f"model.layers.{i}.attention_input.query")
            if q is not None:
                q = q.reshape(-1, cfg.H)
                aq[i, : q.shape[0]] = q
        P["attn_query"] = aq
        P["mlp_query"] = stack("mlp_input.query", range(L))
        P["post_norm"] = stack("post_attention_layernorm.weight", range(L))
        P["router"] = stack("mlp.gate.weight", range(L))
        P["router_bias"] = stack("mlp.gate.e_score_correction_bias", range(L))
        P["experts_gate_up"] = stack("mlp.experts.gate_up_proj", range(L))
        P["experts_down"] = stack("mlp.experts.down_proj", range(L))
        P["convs"] = torch.stack(
            [stack(f"{n}.conv1d.weight", range(L)) for n in ("post_attention_convolution", "post_mlp_convolution")],
            dim=1,
        )  # (L, 2, C, 1, K)
        for part in ("down_proj", "forget_gate_proj", "message_gate_proj"):
            P["msg_" + part] = torch.stack(
                [
                    torch.stack(
                        [sd[f"model.layers.{i}.{g}_message_gate.{part}.weight"] for g in ("q", "k", "v", "mlp")]
                    )
                    for i in loop
                ]
            )
        self.P = nn.ParameterDict({k: _p(v) for k, v in P.items()})

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return _functional_forward(self.P, self.cfg, self.slot, input_ids, attention_mask, position_ids)


def _functional_forward(P, cfg, slot, input_ids, attention_mask, position_ids):
    b, t = input_ids.shape
    dev = input_ids.device
    K, eps = cfg.K, cfg.eps
    mask2d = None if attention_mask is None else attention_mask.float()
    if position_ids is None:
        position_ids = torch.arange(t, device=dev)[None]
    tau = _tau(position_ids, cfg.alpha, cfg.floor)[:, :, None, None]
    dist, keep_f, keep_s = _keep_masks(mask2d, t, cfg.window, dev)

    def conv1d(x, w):  # w (C, 1, K), Conv1d order, with the identity residual
        xm = _masked(x, mask2d).transpose(1, 2)
        y = F.conv1d(F.pad(xm, (K - 1, 0)), w, groups=w.shape[0]).transpose(1, 2)
        return (y + x) / math.sqrt(K + 1)

    def dyn_conv(x, x_in, static, tap_proj, nkv, d):
        xm = _masked(x, mask2d)
        taps = static.t().reshape(nkv, d, K) + F.linear(x_in, tap_proj).reshape(b, t, nkv, 1, K)
        win = F.pad(xm, (0, 0, K - 1, 0)).unfold(1, K, 1).flip(-1).reshape(b, t, nkv, d, K)
        return ((win * taps).sum(-1).reshape(b, t, -1) + x) / math.sqrt(2 * K + 1)

    def attention(i, xq, xk, xv):
        sl = cfg.sliding[i]
        tag, s = ("swa" if sl else "full"), slot[i]
        nq, nkv, d, ext = cfg.dims(sl)
        W = {k[len(tag) + 1 :]: v[s] for k, v in P.items() if k.startswith(tag + "_")}
        q = _clip(F.linear(xq, W["wq"]).reshape(b, t, nq, d) * W["q_scale"], cfg.thr_qk)
        r = _clip(F.linear(xq, W["wrel"]).reshape(b, t, nq, cfg.dr) * W["rel_scale"], cfg.thr_rel)
        if not sl:
            q, r = q * tau, r * tau
        k, v = F.linear(xk, W["wk"]), F.linear(xv, W["wv"])
        if sl:
            k, v = conv1d(k, W["conv_k"]), conv1d(v, W["conv_v"])
        else:
            k = dyn_conv(k, xk, W["static_k"], W["tapproj_k"], nkv, d)
            v = dyn_conv(v, xv, W["static_v"], W["tapproj_v"], nkv, d)
        k = _clip(k.reshape(b, t, nkv, d), cfg.thr_qk)
        v = _rms(v.reshape(b, t, nkv, d), eps)
        bias = _gather_rel_bias((r @ W["rel_proj"]).transpose(1, 2), dist, ext)
        sinks = F.linear(xq, W["wsink"]).transpose(1, 2)
        o = _eager_sink_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, sinks, keep_s if sl else keep_f
        )
        o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(F.linear(xq, W["wgate"]))
        return F.linear(o, W["wo"])

    def moe(i, x):
        xf = x.reshape(-1, cfg.H)
        s = torch.sigmoid(F.linear(xf, P["router"][i]))
        idx = torch.topk(s + P["router_bias"][i], cfg.topk, dim=-1).indices
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.route_scale
        out = torch.zeros_like(xf)
        for e in range(cfg.E):
            tok, kk = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            g, u = F.linear(xf[tok], P["experts_gate_up"][i, e]).chunk(2, dim=-1)
            y = F.linear(_softcap(g, cfg.cg) * torch.sigmoid(g) * _softcap(u, cfg.cu), P["experts_down"][i, e])
            out.index_add_(0, tok, y * w[tok, kk, None])
        return out.reshape(x.shape)

    def gate(i, which, x, m):
        j = i - cfg.ls
        z = F.linear(torch.cat([_rms(x, eps), _rms(m, eps)], dim=-1), P["msg_down_proj"][j, which])
        f = torch.tanh(F.linear(z, P["msg_forget_gate_proj"][j, which]))
        g = torch.tanh(F.linear(z, P["msg_message_gate_proj"][j, which]))
        return (1 - f) * x + g * m

    def layer(i, h, states, msgs):
        sl = cfg.sliding[i]
        nqa = 1 if sl else 3
        if i == 0:
            a = [h] * nqa
        else:
            a = list(_depth_attn(P["attn_query"][i, :nqa], states + [h]).unbind(-2))
        if sl:
            a = a * 3
            norms = [P["swa_norm"][slot[i]]] * 3
        else:
            norms = list(P["full_norms"][slot[i]])
        if msgs is not None:
            a = [gate(i, j, a[j], msgs[..., j, :]) for j in range(3)]
        xq, xk, xv = (_rms(a[j], eps) * norms[j] for j in range(3))
        att = conv1d(attention(i, xq, xk, xv), P["convs"][i, 0])
        if i % cfg.block == 0:
            states = states + [h]
            res = att
        else:
            res = h + att
        m = _depth_attn(P["mlp_query"][i][None], states + [res])[..., 0, :]
        if msgs is not None:
            m = gate(i, 3, m, msgs[..., 3, :])
        out = conv1d(moe(i, _rms(m, eps) * P["post_norm"][i]), P["convs"][i, 1])
        return res + out, states

    h = _rms(F.embedding(input_ids, P["embed"]), eps) * P["embed_norm"]
    states = []
    for i in range(cfg.ls):
        h, states = layer(i, h, states, None)
    pre_h, pre_states = h, states
    for i in range(cfg.ls, cfg.le):
        h, states = layer(i, h, states, None)
    for _ in range(1, cfg.passes):
        prev_states, prev_h = states[len(pre_states) + 1 :], h
        h, states = pre_h, pre_states
        for i in range(cfg.ls, cfg.le):
            msgs = _depth_attn(P["message_query"][i - cfg.ls], prev_states + [prev_h])
            h, states = layer(i, h, states, msgs)
    for i in range(cfg.le, cfg.n_layers):
        h, states = layer(i, h, states, None)
    h = _rms(_depth_attn(P["final_query"][None], states + [h])[..., 0, :], eps) * P["final_norm"]
    return _softcap(F.linear(h, P["lm_head"]), cfg.cf).float()


def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN:
        raise ValueError(f"unknown variant {variant!r}")
    sd = {k: v for k, v in state_dict.items()}
    cfg = _cfg(config)
    if variant == "ink_stacked_functional":
        return InklingLoopFunctional(sd, cfg).eval()
    return InklingLoopLM(sd, cfg, variant).eval()
