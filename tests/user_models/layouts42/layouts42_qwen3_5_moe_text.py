"""Hand-written plain-PyTorch port of Qwen3.5-MoE's text model (Qwen3_5MoeForCausalLM, model type qwen3_5_moe_text).

Architecture as this port implements it:
- token embedding (no scale), untied head; every RMSNorm of the stream / heads is zero-centred: gain (1 + w).
- layer: h = h + Mixer(RMSNorm(h)); h = h + MoE(RMSNorm(h)); the mixer is, per config.layer_types,
  * linear_attention, a Gated DeltaNet: padding rows zeroed; [q | k | v] = W_qkv x through a causal depthwise
    conv (K taps, no bias) and SiLU; z = W_z x; beta = sigmoid(W_b x); decay g = -exp(A_log) softplus(W_a x + dt_bias);
    q, k L2-normalised per head (x rsqrt(sum x^2 + 1e-6)), q scaled by d_k^-1/2; each q/k head serves
    n_v / n_k consecutive value heads; state S (d_k, d_v) per value head:
    S <- e^g S;  S <- S + beta k (v - S^T k)^T;  o = S^T q;  out = W_o (RMSNorm(o) * w * silu(z)) per value head.
  * full_attention: q_proj gives per head [q_h | gate_h] (2 head_dim rows per head); q / k RMSNorm (1 + w) per
    head; RoPE (rotate-half) on the first partial_rotary_factor * head_dim dims; GQA causal softmax attention,
    scale head_dim^-1/2; out = W_o (attn * sigmoid(gate)).
- MoE: softmax router over all experts, top-k, weights renormalised; experts silu(gate) * up -> down; plus a
  shared expert (own intermediate size) scaled by sigmoid(w_sg . x).
Weight layout, baseline (BUG == ""): own names (`tok`, `layers.{i}.mixer` / `.ffn`, ...); every projection stored
transposed (in, out) and applied as x @ W; the per-head interleaved q_proj split into separate `wq` and `wgate`;
RMSNorm gains stored as the full gain 1 + w; conv taps (channels, K) in lag order (column j weights the token
j steps back); experts split into w_gate / w_up (E, H, I) and w_down (E, I, H), evaluated per token on
gathered top-k weights; the delta rule evaluated as a token-by-token recurrent scan.
Variants (CLEAN), each a correct port:
- qwen_chunked_delta: the delta rule in chunks of 8 tokens (UT transform by a unit-triangular solve, state
  carried between chunks); b / a projections fused into one [b | a] matrix.
- qwen_next_grouped_qkvz: Qwen3-Next's original checkpoint layout: one in_proj_qkvz grouped per key head
  [q_h | k_h | v of its value heads | z of its value heads] and one in_proj_ba grouped per key head,
  un-grouped at run time.
- qwen_meta_rope_complex: Meta-style permutation of the rotary rows of q / k (and of the q / k norm gains) so
  that rotary pairs are adjacent, RoPE as a complex multiplication; q_proj kept per-head interleaved [q_h | gate_h].
- qwen_sdpa_tables_head_module: cos / sin tables over max_position_embeddings as buffers, positions from the
  attention mask when none are given, F.scaled_dot_product_attention with a boolean mask, and the model split
  into a backbone returning the last hidden states and a separate head module.
- qwen_grouped_gemm_router: router and shared-expert gate fused into one (H, E + 1) projection, top-k taken on
  the logits then softmax over the k chosen logits; experts fused gate|up (E, H, 2I); token/expert pairs
  sorted by expert and run per expert group (grouped-GEMM style); shared expert gate|up fused.
- qwen_folded_gains_einsum: every (1 + w) stream-norm gain folded into the next projections (mixer inputs,
  router, experts, shared expert and its gate, head); attention weights with a heads axis
  ((heads, head_dim, hidden)) applied with einsum.
- qwen_stacked_layers: weights stacked per kind into (n_layers_of_kind, ...) tensors in nn.ParameterDicts,
  Transformers' (out, in) orientation with F.linear, experts in a loop over experts.
- qwen_ssm_style: SSM-style storage: A = -exp(A_log) precomputed, the conv as an nn.Conv1d module (HF tap
  order), value heads grouped under their key head ((n_k, n_v / n_k) axes) instead of repeating q / k.
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
    "qwen_chunked_delta",  # chunked delta rule (UT transform, chunks of 8), fused [b | a] projection
    "qwen_next_grouped_qkvz",  # Qwen3-Next per-key-head grouped in_proj_qkvz / in_proj_ba, un-grouped at run time
    "qwen_meta_rope_complex",  # Meta-permuted rotary rows of q/k (and norm gains), complex-multiplication RoPE
    "qwen_sdpa_tables_head_module",  # cos/sin buffers, mask-derived positions, SDPA bool mask, separate head module
    "qwen_grouped_gemm_router",  # (H, E+1) router+shared gate, top-k on logits, sorted grouped-GEMM experts
    "qwen_folded_gains_einsum",  # (1 + w) gains folded into next projections, (heads, head_dim, hidden) einsum
    "qwen_stacked_layers",  # per-kind stacked (n_layers, ...) ParameterDicts, F.linear, expert loop
    "qwen_ssm_style",  # A = -exp(A_log) stored, nn.Conv1d module, value heads grouped under key heads
]


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _l2n(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _rot_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _rope_half(x, cos, sin):
    """x (b, t, n, d); cos / sin (b, t, rot) over the first rot dims (rotate-half pairing)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    xr = xr * cos[:, :, None] + _rot_half(xr) * sin[:, :, None]
    return torch.cat([xr, xp], dim=-1)


def _masked(x, mask2d):
    return x if mask2d is None else x * mask2d[:, :, None].to(x.dtype)


def _lag_conv(x, w_lag):
    k, t = w_lag.shape[-1], x.shape[1]
    xp = F.pad(x, (0, 0, k - 1, 0))
    out = xp[:, k - 1 : k - 1 + t] * w_lag[:, 0]
    for j in range(1, k):
        out = out + xp[:, k - 1 - j : k - 1 - j + t] * w_lag[:, j]
    return out


# ---------------------------------------------------------------------------------- gated delta rule
def _delta_recurrent(q, k, v, g, beta):
    """q, k (b, t, n, dk) (already repeated to the value heads), v (b, t, n, dv), g / beta (b, t, n)."""
    b, t, n, dk = k.shape
    S = q.new_zeros(b, n, dk, v.shape[-1])
    out = []
    for i in range(t):
        S = S * g[:, i].exp()[..., None, None]
        kv = torch.einsum("bnkv,bnk->bnv", S, k[:, i])
        delta = (v[:, i] - kv) * beta[:, i, :, None]
        S = S + k[:, i, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bnkv,bnk->bnv", S, q[:, i]))
    return torch.stack(out, dim=1)


def _delta_chunked(q, k, v, g, beta, chunk=8):
    """Same maths by chunks: inside a chunk with cumulative log decay G and state S0 at its start,
    (I + A) U = beta (V - e^G K S0), A[t, s] = beta_t e^{G_t - G_s} k_t.k_s (s < t);
    O = e^G Q S0 + (Q K^T * e^{G_t - G_s}, s <= t) U;  S = e^{G_C} S0 + sum_s e^{G_C - G_s} k_s u_s^T."""
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (b, n, t, d)
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # (b, n, t)
    S = q.new_zeros(b, n, dk, dv)
    outs = []
    for s0 in range(0, t, chunk):
        sl = slice(s0, min(s0 + chunk, t))
        qc, kc, vc, gc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
        c = kc.shape[2]
        G = gc.cumsum(-1)
        diff = G[..., :, None] - G[..., None, :]
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()
        strict = decay * (~torch.eye(c, dtype=torch.bool, device=q.device))
        A = bc[..., None] * (kc @ kc.transpose(-1, -2)) * strict
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ S))
        eye = torch.eye(c, device=q.device).expand_as(A)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        outs.append(G.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ U)
        S = G[..., -1:, None].exp() * S + (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ U
    return torch.cat(outs, dim=2).transpose(1, 2)


class GatedDeltaNet(nn.Module):
    def __init__(self, sd, pre, c, variant, gain):
        super().__init__()
        self.variant = variant
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.K, self.eps = c.linear_conv_kernel_dim, c.rms_norm_eps
        a = pre + "linear_attn."
        w_qkv = sd[a + "in_proj_qkv.weight"].float()
        w_z = sd[a + "in_proj_z.weight"].float()
        w_b = sd[a + "in_proj_b.weight"].float()
        w_a = sd[a + "in_proj_a.weight"].float()
        if gain is not None:  # qwen_folded_gains_einsum: the input norm's 1 + w
            w_qkv, w_z, w_b, w_a = (w * gain for w in (w_qkv, w_z, w_b, w_a))
        conv = sd[a + "conv1d.weight"].float()[:, 0]  # (C, K), Conv1d order
        r = self.nv // self.nk
        if variant == "qwen_next_grouped_qkvz":
            kd = self.nk * self.dk
            wq, wk, wv = w_qkv.split([kd, kd, self.nv * self.dv])
            groups = []
            for h in range(self.nk):
                groups += [
                    wq[h * self.dk : (h + 1) * self.dk],
                    wk[h * self.dk : (h + 1) * self.dk],
                    wv[h * r * self.dv : (h + 1) * r * self.dv],
                    w_z[h * r * self.dv : (h + 1) * r * self.dv],
                ]
            self.in_proj_qkvz = _p(torch.cat(groups).t())
            ba = [torch.cat([w_b[h * r : (h + 1) * r], w_a[h * r : (h + 1) * r]]) for h in range(self.nk)]
            self.in_proj_ba = _p(torch.cat(ba).t())
        else:
            self.w_qkv_t, self.w_z_t = _p(w_qkv.t()), _p(w_z.t())
            if variant == "qwen_chunked_delta":
                self.w_ba_t = _p(torch.cat([w_b, w_a]).t())
            else:
                self.w_b_t, self.w_a_t = _p(w_b.t()), _p(w_a.t())
        if variant == "qwen_ssm_style":
            self.conv = nn.Conv1d(
                conv.shape[0], conv.shape[0], self.K, groups=conv.shape[0], padding=self.K - 1, bias=False
            )
            self.conv.weight = _p(conv[:, None, :])
            self.register_buffer("neg_A", -sd[a + "A_log"].float().exp())
        else:
            self.conv_w = _p(conv.flip(-1))
            self.A_log = _p(sd[a + "A_log"])
        self.dt_bias = _p(sd[a + "dt_bias"])
        self.norm_w = _p(sd[a + "norm.weight"])
        self.w_out_t = _p(sd[a + "out_proj.weight"].float().t())

    def forward(self, x, ctx):
        b, t, _ = x.shape
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        r = nv // nk
        x = _masked(x, ctx["mask2d"])
        if self.variant == "qwen_next_grouped_qkvz":
            y = (x @ self.in_proj_qkvz).reshape(b, t, nk, 2 * dk + 2 * r * dv)
            q, k, v, z = y.split([dk, dk, r * dv, r * dv], dim=-1)
            qkv = torch.cat([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], dim=-1)
            z = z.reshape(b, t, nv, dv)
            bb, aa = (x @ self.in_proj_ba).reshape(b, t, nk, 2 * r).split([r, r], dim=-1)
            bb, aa = bb.reshape(b, t, nv), aa.reshape(b, t, nv)
        else:
            qkv = x @ self.w_qkv_t
            z = (x @ self.w_z_t).reshape(b, t, nv, dv)
            if self.variant == "qwen_chunked_delta":
                bb, aa = (x @ self.w_ba_t).split([nv, nv], dim=-1)
            else:
                bb, aa = x @ self.w_b_t, x @ self.w_a_t
        if self.variant == "qwen_ssm_style":
            qkv = self.conv(qkv.transpose(1, 2))[..., :t].transpose(1, 2)
        else:
            qkv = _lag_conv(qkv, self.conv_w)
        qkv = F.silu(qkv)
        q, k, v = qkv.split([nk * dk, nk * dk, nv * dv], dim=-1)
        q = _l2n(q.reshape(b, t, nk, dk)) / math.sqrt(dk)
        k = _l2n(k.reshape(b, t, nk, dk))
        v = v.reshape(b, t, nv, dv)
        beta = torch.sigmoid(bb)
        if self.variant == "qwen_ssm_style":
            g = self.neg_A * F.softplus(aa + self.dt_bias)
            o = self._grouped_scan(q, k, v.reshape(b, t, nk, r, dv), g.reshape(b, t, nk, r), beta.reshape(b, t, nk, r))
            o = o.reshape(b, t, nv, dv)
        else:
            g = -self.A_log.exp() * F.softplus(aa + self.dt_bias)
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
            scan = _delta_chunked if self.variant == "qwen_chunked_delta" else _delta_recurrent
            o = scan(q, k, v, g, beta)
        o = _rms(o, self.eps) * self.norm_w * F.silu(z)
        return o.reshape(b, t, -1) @ self.w_out_t

    @staticmethod
    def _grouped_scan(q, k, v, g, beta):
        """q, k (b, t, nk, dk); v (b, t, nk, r, dv); g / beta (b, t, nk, r): each key head's state holds r value heads."""
        b, t, nk, dk = k.shape
        S = q.new_zeros(b, nk, v.shape[3], dk, v.shape[-1])
        out = []
        for i in range(t):
            S = S * g[:, i].exp()[..., None, None]
            kv = torch.einsum("bhrkv,bhk->bhrv", S, k[:, i])
            delta = (v[:, i] - kv) * beta[:, i, ..., None]
            S = S + torch.einsum("bhk,bhrv->bhrkv", k[:, i], delta)
            out.append(torch.einsum("bhrkv,bhk->bhrv", S, q[:, i]))
        return torch.stack(out, dim=1)


class Attention(nn.Module):
    def __init__(self, sd, pre, c, variant, gain):
        super().__init__()
        self.variant = variant
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.rot = int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))
        a = pre + "self_attn."
        nh, hd = self.nh, self.hd
        wqg = sd[a + "q_proj.weight"].float()  # (nh * 2hd, H): per head [q_h | gate_h]
        wk, wv = sd[a + "k_proj.weight"].float(), sd[a + "v_proj.weight"].float()
        wo = sd[a + "o_proj.weight"].float()
        gq = 1.0 + sd[a + "q_norm.weight"].float()
        gk = 1.0 + sd[a + "k_norm.weight"].float()
        if gain is not None:
            wqg, wk, wv = wqg * gain, wk * gain, wv * gain
        if variant == "qwen_meta_rope_complex":
            h = self.rot // 2
            perm = torch.arange(hd)
            perm[: self.rot] = torch.stack([torch.arange(h), torch.arange(h) + h], dim=1).reshape(-1)
            wqg = wqg.reshape(nh, 2, hd, -1)
            wqg = torch.stack([wqg[:, 0, perm], wqg[:, 1]], dim=1)  # gate rows untouched
            self.wqg_t = _p(wqg.reshape(nh * 2 * hd, -1).t())
            self.wk_t = _p(wk.reshape(self.nkv, hd, -1)[:, perm].reshape(self.nkv * hd, -1).t())
            gq, gk = gq[perm], gk[perm]
        else:
            wq, wg = wqg.reshape(nh, 2, hd, -1).unbind(1)
            if variant == "qwen_folded_gains_einsum":
                self.wq, self.wgate = _p(wq), _p(wg)  # (nh, hd, H)
                self.wk = _p(wk.reshape(self.nkv, hd, -1))
                self.wv = _p(wv.reshape(self.nkv, hd, -1))
                self.wo = _p(wo.t().reshape(nh, hd, -1))
            else:
                self.wq_t = _p(wq.reshape(nh * hd, -1).t())
                self.wgate_t = _p(wg.reshape(nh * hd, -1).t())
                self.wk_t = _p(wk.t())
        if variant != "qwen_folded_gains_einsum":
            self.wv_t, self.wo_t = _p(wv.t()), _p(wo.t())
        self.q_gain, self.k_gain = _p(gq), _p(gk)

    def forward(self, x, ctx):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if self.variant == "qwen_meta_rope_complex":
            q, gate = (x @ self.wqg_t).reshape(b, t, nh, 2, hd).unbind(3)
            gate = gate.reshape(b, t, -1)
            k = (x @ self.wk_t).reshape(b, t, nkv, hd)
        elif self.variant == "qwen_folded_gains_einsum":
            q = torch.einsum("bth,ndh->btnd", x, self.wq)
            gate = torch.einsum("bth,ndh->btnd", x, self.wgate).reshape(b, t, -1)
            k = torch.einsum("bth,ndh->btnd", x, self.wk)
        else:
            q = (x @ self.wq_t).reshape(b, t, nh, hd)
            gate = x @ self.wgate_t
            k = (x @ self.wk_t).reshape(b, t, nkv, hd)
        if self.variant == "qwen_folded_gains_einsum":
            v = torch.einsum("bth,ndh->btnd", x, self.wv)
        else:
            v = (x @ self.wv_t).reshape(b, t, nkv, hd)
        q = _rms(q, self.eps) * self.q_gain
        k = _rms(k, self.eps) * self.k_gain
        if self.variant == "qwen_meta_rope_complex":
            rot = self.rot
            f = ctx["freqs_cis"][:, :, None]  # (b, t, 1, rot / 2) complex

            def rope(x):
                xr = torch.view_as_complex(x[..., :rot].reshape(*x.shape[:-1], rot // 2, 2).contiguous())
                return torch.cat([torch.view_as_real(xr * f).flatten(-2), x[..., rot:]], dim=-1)

            q, k = rope(q), rope(k)
        else:
            q, k = _rope_half(q, ctx["cos"], ctx["sin"]), _rope_half(k, ctx["cos"], ctx["sin"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = nh // nkv
        if self.variant == "qwen_sdpa_tables_head_module":
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx["keep"])
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hd) + ctx["additive"]
            o = torch.softmax(s, dim=-1) @ v
        o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
        if self.variant == "qwen_folded_gains_einsum":
            return torch.einsum("btnd,ndh->bth", o.reshape(b, t, nh, hd), self.wo)
        return o @ self.wo_t


class SparseMoE(nn.Module):
    def __init__(self, sd, pre, c, variant, gain):
        super().__init__()
        self.variant = variant
        self.E, self.k = c.num_experts, c.num_experts_per_tok
        m = pre + "mlp."
        wr = sd[m + "gate.weight"].float()
        gu = sd[m + "experts.gate_up_proj"].float()  # (E, 2I, H)
        down = sd[m + "experts.down_proj"].float()  # (E, H, I)
        sg = sd[m + "shared_expert.gate_proj.weight"].float()
        su = sd[m + "shared_expert.up_proj.weight"].float()
        sdn = sd[m + "shared_expert.down_proj.weight"].float()
        sgate = sd[m + "shared_expert_gate.weight"].float()  # (1, H)
        if gain is not None:
            wr, gu, sg, su, sgate = (w * gain for w in (wr, gu, sg, su, sgate))
        if variant == "qwen_grouped_gemm_router":
            self.router_t = _p(torch.cat([wr, sgate]).t())  # (H, E + 1), last column = shared-expert gate
            self.w_gate_up = _p(gu.transpose(1, 2))  # (E, H, 2I) = [gate | up]
            self.shared_gate_up_t = _p(torch.cat([sg, su]).t())
        else:
            self.router_t = _p(wr.t())
            g, u = gu.chunk(2, dim=1)
            self.w_gate, self.w_up = _p(g.transpose(1, 2)), _p(u.transpose(1, 2))
            self.shared_gate_t, self.shared_up_t = _p(sg.t()), _p(su.t())
            self.shared_score = _p(sgate[0])
        self.w_down = _p(down.transpose(1, 2))  # (E, I, H)
        self.shared_down_t = _p(sdn.t())

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.variant == "qwen_grouped_gemm_router":
            logits = x @ self.router_t
            logits, shared_logit = logits[:, : self.E], logits[:, self.E :]
            top, idx = torch.topk(logits, self.k, dim=-1)
            w = torch.softmax(top, dim=-1)
            flat_e = idx.reshape(-1)
            order = torch.argsort(flat_e, stable=True)
            tok = order // self.k
            counts = torch.bincount(flat_e, minlength=self.E).tolist()
            xs = x[tok]
            ys = []
            for e, chunk in enumerate(xs.split(counts)):
                if chunk.shape[0] == 0:
                    continue
                gg, uu = (chunk @ self.w_gate_up[e]).chunk(2, dim=-1)
                ys.append((F.silu(gg) * uu) @ self.w_down[e])
            ys = torch.cat(ys) * w.reshape(-1)[order, None]
            out = torch.zeros_like(x).index_add_(0, tok, ys)
            sg, su = (x @ self.shared_gate_up_t).chunk(2, dim=-1)
            shared = (F.silu(sg) * su) @ self.shared_down_t
            return (out + torch.sigmoid(shared_logit) * shared).reshape(shape)
        probs = torch.softmax(x @ self.router_t, dim=-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        gg = torch.einsum("nh,nkhi->nki", x, self.w_gate[idx])
        uu = torch.einsum("nh,nkhi->nki", x, self.w_up[idx])
        y = torch.einsum("nki,nkih->nkh", F.silu(gg) * uu, self.w_down[idx])
        out = (y * w[..., None]).sum(1)
        shared = (F.silu(x @ self.shared_gate_t) * (x @ self.shared_up_t)) @ self.shared_down_t
        return (out + torch.sigmoid(x @ self.shared_score)[:, None] * shared).reshape(shape)


class Layer(nn.Module):
    def __init__(self, sd, i, c, variant):
        super().__init__()
        pre = f"model.layers.{i}."
        self.eps = c.rms_norm_eps
        g_in = 1.0 + sd[pre + "input_layernorm.weight"].float()
        g_post = 1.0 + sd[pre + "post_attention_layernorm.weight"].float()
        fold = variant == "qwen_folded_gains_einsum"
        self.g_in = None if fold else _p(g_in)
        self.g_post = None if fold else _p(g_post)
        self.linear = c.layer_types[i] == "linear_attention"
        mixer = GatedDeltaNet if self.linear else Attention
        self.mixer = mixer(sd, pre, c, variant, g_in if fold else None)
        self.ffn = SparseMoE(sd, pre, c, variant, g_post if fold else None)

    def forward(self, h, ctx):
        x = _rms(h, self.eps)
        h = h + self.mixer(x if self.g_in is None else x * self.g_in, ctx)
        x = _rms(h, self.eps)
        return h + self.ffn(x if self.g_post is None else x * self.g_post)


def _inv_freq(c):
    rot = int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))
    theta = c.rope_parameters["rope_theta"]
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))


class Backbone(nn.Module):
    def __init__(self, sd, c, variant):
        super().__init__()
        self.variant, self.eps = variant, c.rms_norm_eps
        self.tok = _p(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([Layer(sd, i, c, variant) for i in range(c.num_hidden_layers)])
        self.g_final = None if variant == "qwen_folded_gains_einsum" else _p(1.0 + sd["model.norm.weight"].float())
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)
        if variant == "qwen_sdpa_tables_head_module":
            ang = torch.arange(c.max_position_embeddings, dtype=torch.float)[:, None] * self.inv_freq
            emb = torch.cat([ang, ang], dim=-1)
            self.register_buffer("cos_table", emb.cos(), persistent=False)
            self.register_buffer("sin_table", emb.sin(), persistent=False)

    def context(self, input_ids, attention_mask, position_ids):
        b, t = input_ids.shape
        dev = input_ids.device
        ctx = {"mask2d": None if attention_mask is None else attention_mask.float()}
        pad = torch.ones(b, t, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        keep = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None, None] & pad[:, None, None, :]
        if self.variant == "qwen_sdpa_tables_head_module":
            if position_ids is None:
                if attention_mask is None:
                    position_ids = torch.arange(t, device=dev)[None].expand(b, t)
                else:
                    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            ctx["cos"], ctx["sin"] = self.cos_table[position_ids], self.sin_table[position_ids]
            # a query with nothing to attend to (left padding) attends to itself: no all-False row, no NaN
            ctx["keep"] = keep | torch.eye(t, dtype=torch.bool, device=dev)
            return ctx
        if position_ids is None:
            position_ids = torch.arange(t, device=dev)[None]
        ang = position_ids[..., None].float() * self.inv_freq
        if self.variant == "qwen_meta_rope_complex":
            ctx["freqs_cis"] = torch.polar(torch.ones_like(ang), ang)
        else:
            emb = torch.cat([ang, ang], dim=-1)
            ctx["cos"], ctx["sin"] = emb.cos(), emb.sin()
        ctx["additive"] = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        return ctx

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        ctx = self.context(input_ids, attention_mask, position_ids)
        h = self.tok[input_ids]
        for layer in self.layers:
            h = layer(h, ctx)
        h = _rms(h, self.eps)
        return h if self.g_final is None else h * self.g_final


class LMHead(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight_t = _p(w.t())

    def forward(self, h):
        return h @ self.weight_t


class QwenMoeLM(nn.Module):
    def __init__(self, sd, c, variant):
        super().__init__()
        self.variant = variant
        head = sd["lm_head.weight"].float()
        if variant == "qwen_folded_gains_einsum":
            head = head * (1.0 + sd["model.norm.weight"].float())
        if variant == "qwen_sdpa_tables_head_module":
            self.backbone = Backbone(sd, c, variant)
            self.head = LMHead(head)
        else:
            self.model = Backbone(sd, c, variant)
            self.head_t = _p(head.t())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if self.variant == "qwen_sdpa_tables_head_module":
            return self.head(self.backbone(input_ids, attention_mask, position_ids)).float()
        return (self.model(input_ids, attention_mask, position_ids) @ self.head_t).float()


# ----------------------------------------------------------------------------------- stacked-layer port
class QwenMoeStacked(nn.Module):
    """qwen_stacked_layers: per-kind stacked tensors, HF (out, in) orientation, F.linear everywhere."""

    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        L = c.num_hidden_layers
        self.lin = [i for i in range(L) if c.layer_types[i] == "linear_attention"]
        self.att = [i for i in range(L) if c.layer_types[i] != "linear_attention"]

        def stack(key, idx):
            return torch.stack([sd[f"model.layers.{i}.{key}"].float() for i in idx])

        gdn = {
            k: stack("linear_attn." + k, self.lin)
            for k in (
                "in_proj_qkv.weight",
                "in_proj_z.weight",
                "in_proj_b.weight",
                "in_proj_a.weight",
                "conv1d.weight",
                "A_log",
                "dt_bias",
                "norm.weight",
                "out_proj.weight",
            )
        }
        self.gdn = nn.ParameterDict({k.replace(".weight", "").replace(".", "_"): _p(v) for k, v in gdn.items()})
        att = {
            k: stack("self_attn." + k, self.att)
            for k in (
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "o_proj.weight",
                "q_norm.weight",
                "k_norm.weight",
            )
        }
        self.attn = nn.ParameterDict({k.replace(".weight", ""): _p(v) for k, v in att.items()})
        moe = {
            k: stack("mlp." + k, range(L))
            for k in (
                "gate.weight",
                "experts.gate_up_proj",
                "experts.down_proj",
                "shared_expert.gate_proj.weight",
                "shared_expert.up_proj.weight",
                "shared_expert.down_proj.weight",
                "shared_expert_gate.weight",
            )
        }
        self.moe = nn.ParameterDict({k.replace(".weight", "").replace(".", "_"): _p(v) for k, v in moe.items()})
        self.norms = _p(
            torch.stack(
                [stack("input_layernorm.weight", range(L)), stack("post_attention_layernorm.weight", range(L))], 1
            )
        )  # (L, 2, H), zero-centred as stored
        self.embed = _p(sd["model.embed_tokens.weight"])
        self.final_norm = _p(sd["model.norm.weight"])
        self.lm_head = _p(sd["lm_head.weight"])
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)

    def _norm(self, x, w):
        return _rms(x, self.c.rms_norm_eps) * (1.0 + w)

    def _gdn(self, j, x, mask2d):
        c, P = self.c, self.gdn
        b, t, _ = x.shape
        nk, nv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        K = c.linear_conv_kernel_dim
        x = _masked(x, mask2d)
        qkv = F.linear(x, P["in_proj_qkv"][j]).transpose(1, 2)
        qkv = F.silu(F.conv1d(F.pad(qkv, (K - 1, 0)), P["conv1d"][j], groups=qkv.shape[1])).transpose(1, 2)
        q, k, v = qkv.split([nk * dk, nk * dk, nv * dv], dim=-1)
        r = nv // nk
        q = (_l2n(q.reshape(b, t, nk, dk)) / math.sqrt(dk)).repeat_interleave(r, dim=2)
        k = _l2n(k.reshape(b, t, nk, dk)).repeat_interleave(r, dim=2)
        v = v.reshape(b, t, nv, dv)
        beta = torch.sigmoid(F.linear(x, P["in_proj_b"][j]))
        g = -P["A_log"][j].exp() * F.softplus(F.linear(x, P["in_proj_a"][j]) + P["dt_bias"][j])
        o = _delta_recurrent(q, k, v, g, beta)
        z = F.linear(x, P["in_proj_z"][j]).reshape(b, t, nv, dv)
        o = _rms(o, c.rms_norm_eps) * P["norm"][j] * F.silu(z)
        return F.linear(o.reshape(b, t, -1), P["out_proj"][j])

    def _attn(self, j, x, cos, sin, additive):
        c, P = self.c, self.attn
        b, t, _ = x.shape
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, gate = F.linear(x, P["q_proj"][j]).reshape(b, t, nh, 2 * hd).chunk(2, dim=-1)
        q = self._norm(q, P["q_norm"][j])
        k = self._norm(F.linear(x, P["k_proj"][j]).reshape(b, t, nkv, hd), P["k_norm"][j])
        v = F.linear(x, P["v_proj"][j]).reshape(b, t, nkv, hd)
        q, k = _rope_half(q, cos, sin).transpose(1, 2), _rope_half(k, cos, sin).transpose(1, 2)
        rep = nh // nkv
        k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(b, nh, t, hd)
        v = v.transpose(1, 2)[:, :, None].expand(-1, -1, rep, -1, -1).reshape(b, nh, t, hd)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + additive, dim=-1)
        o = (p @ v).transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate.reshape(b, t, -1))
        return F.linear(o, P["o_proj"][j])

    def _moe(self, i, x):
        c, P = self.c, self.moe
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(F.linear(x, P["gate"][i]), dim=-1)
        w, idx = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(c.num_experts):
            tok, kk = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            g, u = F.linear(x[tok], P["experts_gate_up_proj"][i, e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, P["experts_down_proj"][i, e]) * w[tok, kk, None])
        shared = F.linear(
            F.silu(F.linear(x, P["shared_expert_gate_proj"][i])) * F.linear(x, P["shared_expert_up_proj"][i]),
            P["shared_expert_down_proj"][i],
        )
        return (out + torch.sigmoid(F.linear(x, P["shared_expert_gate"][i])) * shared).reshape(shape)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        mask2d = None if attention_mask is None else attention_mask.float()
        if position_ids is None:
            position_ids = torch.arange(t)[None]
        ang = position_ids[..., None].float() * self.inv_freq
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask.bool()[:, None, None, :]
        additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        h = F.embedding(input_ids, self.embed)
        for i in range(self.c.num_hidden_layers):
            x = self._norm(h, self.norms[i, 0])
            if i in self.lin:
                h = h + self._gdn(self.lin.index(i), x, mask2d)
            else:
                h = h + self._attn(self.att.index(i), x, cos, sin, additive)
            h = h + self._moe(i, self._norm(h, self.norms[i, 1]))
        return F.linear(self._norm(h, self.final_norm), self.lm_head).float()


def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN:
        raise ValueError(f"unknown variant {variant!r}")
    sd = dict(state_dict)
    if variant == "qwen_stacked_layers":
        return QwenMoeStacked(sd, config).eval()
    return QwenMoeLM(sd, config, variant).eval()
