"""Hand-written plain-PyTorch port of Lara Mini (LaraMiniForCausalLM), a hybrid of gated delta net and attention.

Architecture as this port implements it:
- token embedding (no scaling), lm_head tied to it by default (the port reads `lm_head.weight`, which is the
  embedding when tied); final RMSNorm. Every RMSNorm is gain * x / rms(x) (plain gain, not Qwen3-Next's 1 + gain),
  eps = config.rms_norm_eps, computed in float32.
- decoder layer, pre-norm: h = h + Mixer(RMSNorm(h)); h = h + MoE(RMSNorm(h)). The mixer of layer i is chosen by
  config.layer_types[i]:
  * "linear_attention": gated delta net. Padding positions are zeroed first (so they never enter the state).
    One projection gives [q | k | v | z | b | a]; q, k, v (2 Dk + Dv channels) go through a causal depthwise
    conv (kernel linear_conv_kernel_dim, no bias) and SiLU. nk key heads of size dk, nv value heads of size dv,
    nv / nk consecutive value heads share one key head. q, k are L2-normalised per head (eps 1e-6 inside the
    rsqrt), q is scaled by dk ** -0.5. beta = sigmoid(b), log decay g = -exp(A_log) * softplus(a + dt_bias).
    Per value head, with state S (dk, dv) starting at zero: S <- exp(g_t) S; u = beta_t (v_t - S^T k_t);
    S <- S + k_t u^T; o_t = S^T q_t. The output goes through a gated RMSNorm over dv: w * rms_norm(o) * silu(z)
    (norm first, then the gate), then out_proj.
  * "sliding_attention": GQA attention with per-head RMSNorm on q and k (over head_dim, before RoPE), rotate-half
    RoPE over the full head_dim (theta from config.rope_parameters), causal with a window: query i sees keys j
    with i - window < j <= i (window = config.sliding_window tokens, the query included).
  * "full_attention": the same attention, causal over all keys, with NO positional encoding (NoPE).
  Attention scale head_dim ** -0.5, no biases (attention_bias False), masked scores set to finfo.min.
- MoE (every layer): router softmax over num_experts (float32), top num_experts_per_tok, renormalised when
  norm_topk_prob; routed SwiGLU experts (moe_intermediate_size) weighted by those probabilities, plus an
  UNGATED shared SwiGLU expert (shared_expert_intermediate_size) always added in full.
Weight layout of this port (own names, all matrices stored input-major, x @ W):
- emb (V, H); head (H, V) = lm_head.weight transposed; out_gain (H,).
- blocks[i]: n_mix / n_ffn (H,) norm gains; then by kind
  * delta net: w_in (H, 2 Dk + 2 Dv + 2 nv) = [qkv | z | b | a] fused; conv (2 Dk + Dv, kernel);
    decay_rate (nv,) = exp(A_log); dt_bias (nv,); o_gain (dv,); w_out (Dv, H).
  * attention: w_qkv (H, (nq + 2 nkv) hd) fused; q_gain / k_gain (hd,); w_o (nq hd, H).
  * MoE: w_router (H, E); w_gu (E, H, 2 I) = per-expert [gate | up]; w_dn (E, I, H);
    s_gu (H, 2 Is) = shared [gate | up]; s_dn (Is, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "lara_full_attn_rope",  # RoPE also applied in the "full_attention" layers, which are NoPE in Lara
    "lara_norm_one_plus",  # decoder / final RMSNorms scale by (1 + gain) as Qwen3-Next's do, not by the gain
    "lara_partial_rotary",  # RoPE on the first quarter of head_dim only (Qwen3-Next's partial_rotary_factor 0.25)
    "lara_window_off_by_one",  # sliding window lets query i see key i - window too (window + 1 keys)
    "lara_gva_tiled",  # delta net value head h reads key head h % nk (tiled) instead of h // (nv / nk)
    "lara_decay_no_exp",  # log decay g = -A_log * softplus(a + dt_bias): A_log used as A, its exp missing
    "lara_dt_bias_outside",  # log decay g = -A * (softplus(a) + dt_bias): dt_bias added after the softplus
    "lara_error_before_decay",  # delta rule error read from the undecayed state (S <- g S + k u^T, u from old S)
    "lara_conv_no_silu",  # SiLU after the causal depthwise conv of q, k, v dropped
    "lara_gate_before_norm",  # gated norm as rms_norm(o * silu(z)) * w: the gate applied before the norm
    "lara_beta_alpha_swapped",  # in_proj_b / in_proj_a rows swapped when fusing the input projection at load
    "lara_topk_no_renorm",  # norm_topk_prob ignored: top-k softmax probabilities used without renormalising
    "lara_gate_up_swapped",  # routed experts' fused gate_up_proj halves read as [up | gate] at load
    "lara_gdn_pad_leak",  # padding positions not zeroed before the delta net: pad tokens enter conv and state
]
PADDING_ONLY = {"lara_gdn_pad_leak"}
CLEAN = [
    "lara_sdpa",  # attention through F.scaled_dot_product_attention with a float additive mask
    "lara_gdn_parallel",  # delta rule in closed form: triangular solve for the written values, then masked q.k
    "lara_dense_experts",  # every expert on every token, combined through a dense (N, E) routing weight matrix
    "lara_router_topk_softmax",  # top-k taken on the router logits, softmax over the k chosen logits
    "lara_complex_rope",  # RoPE as complex multiplication of (x_i, x_{i + hd/2}) pairs
]


def _rms(x, g, eps, one_plus=False):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (1.0 + g) * y if one_plus else g * y


def _l2n(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class LaraMiniPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.eps = cfg.rms_norm_eps
        self.kinds = list(cfg.layer_types)
        # attention
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nq
        self.theta = cfg.rope_parameters["rope_theta"]
        self.window = cfg.sliding_window
        # delta net
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kconv = cfg.linear_conv_kernel_dim
        # MoE
        self.E, self.topk, self.renorm = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob

        self.emb = nn.Parameter(g("model.embed_tokens.weight"))
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        self.head = nn.Parameter(head.detach().clone().float().t().contiguous())
        self.out_gain = nn.Parameter(g("model.norm.weight"))
        self.blocks = nn.ModuleList()
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}."
            B = nn.Module()
            B.n_mix = nn.Parameter(g(p + "input_layernorm.weight"))
            B.n_ffn = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            if kind == "linear_attention":
                a = p + "linear_attn."
                b_rows, a_rows = g(a + "in_proj_b.weight"), g(a + "in_proj_a.weight")
                if BUG == "lara_beta_alpha_swapped":
                    b_rows, a_rows = a_rows, b_rows
                w_in = torch.cat([g(a + "in_proj_qkv.weight"), g(a + "in_proj_z.weight"), b_rows, a_rows], 0)
                B.w_in = nn.Parameter(w_in.t().contiguous())
                B.conv = nn.Parameter(g(a + "conv1d.weight")[:, 0, :].contiguous())
                a_log = g(a + "A_log")
                B.decay_rate = nn.Parameter(a_log if BUG == "lara_decay_no_exp" else a_log.exp())
                B.dt_bias = nn.Parameter(g(a + "dt_bias"))
                B.o_gain = nn.Parameter(g(a + "norm.weight"))
                B.w_out = nn.Parameter(g(a + "out_proj.weight").t().contiguous())
            else:
                a = p + "self_attn."
                w_qkv = torch.cat([g(a + f"{n}_proj.weight") for n in "qkv"], 0)
                B.w_qkv = nn.Parameter(w_qkv.t().contiguous())
                B.q_gain = nn.Parameter(g(a + "q_norm.weight"))
                B.k_gain = nn.Parameter(g(a + "k_norm.weight"))
                B.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            m = p + "mlp."
            B.w_router = nn.Parameter(g(m + "gate.weight").t().contiguous())
            gu = g(m + "experts.gate_up_proj")  # (E, 2I, H), rows [gate | up]
            if BUG == "lara_gate_up_swapped":
                gu = torch.cat(gu.chunk(2, 1)[::-1], 1)
            B.w_gu = nn.Parameter(gu.transpose(1, 2).contiguous())
            B.w_dn = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous())
            s = m + "shared_expert."
            B.s_gu = nn.Parameter(torch.cat([g(s + "gate_proj.weight"), g(s + "up_proj.weight")], 0).t().contiguous())
            B.s_dn = nn.Parameter(g(s + "down_proj.weight").t().contiguous())
            self.blocks.append(B)

    # ---- rotary ----
    def _rope(self, x, pos):  # x (B, h, S, hd), pos (B, S)
        rot = self.hd // 4 if BUG == "lara_partial_rotary" else self.hd
        half = rot // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        ang = (pos[..., None].float() * inv)[:, None]  # (B, 1, S, rot/2)
        xr, rest = x[..., :rot], x[..., rot:]
        x1, x2 = xr[..., :half], xr[..., half:]
        if BUG == "lara_complex_rope":
            z = torch.complex(x1, x2) * torch.polar(torch.ones_like(ang), ang)
            out = torch.cat((z.real, z.imag), -1)
        else:
            c, s = ang.cos(), ang.sin()
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        return torch.cat((out, rest), -1)

    # ---- softmax attention (sliding with RoPE, full without) ----
    def _attention(self, L, x, pos, keep, kind):
        Bn, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q, k, v = (x @ L.w_qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        q = _rms(q.view(Bn, S, nq, hd), L.q_gain, self.eps).transpose(1, 2)
        k = _rms(k.view(Bn, S, nkv, hd), L.k_gain, self.eps).transpose(1, 2)
        v = v.view(Bn, S, nkv, hd).transpose(1, 2)
        if kind == "sliding_attention" or BUG == "lara_full_attn_rope":
            q, k = self._rope(q, pos), self._rope(k, pos)
        allowed = keep
        if kind == "sliding_attention":
            i = torch.arange(S)
            reach = self.window + 1 if BUG == "lara_window_off_by_one" else self.window
            allowed = allowed & ((i[:, None] - i[None, :]) < reach)[None]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if BUG == "lara_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=hd**-0.5)
        else:
            o = ((q @ k.transpose(-1, -2)) * hd**-0.5 + bias).softmax(-1) @ v
        return o.transpose(1, 2).reshape(Bn, S, nq * hd) @ L.w_o

    # ---- gated delta net ----
    def _delta_scan(self, q, k, v, beta, g):  # q, k (B, h, S, dk); v (B, h, S, dv); beta, g (B, h, S)
        Bn, h, S, _ = q.shape
        if BUG == "lara_gdn_parallel":
            c = g.cumsum(-1)
            lower = torch.ones(S, S, dtype=torch.bool).tril()
            gap = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (B, h, S, S)
            strict = (k @ k.transpose(-1, -2)) * gap * beta[..., None]
            strict = strict.masked_fill(lower.logical_not() | torch.eye(S, dtype=torch.bool), 0.0)
            system = torch.eye(S) + strict
            u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
            return ((q @ k.transpose(-1, -2)) * gap) @ u
        state = torch.zeros(Bn, h, self.dk, self.dv)
        outs = []
        for t in range(S):
            kt, vt, qt = k[:, :, t], v[:, :, t], q[:, :, t]
            gamma = g[:, :, t].exp()[..., None, None]
            if BUG == "lara_error_before_decay":
                u = beta[:, :, t, None] * (vt - torch.einsum("bhkv,bhk->bhv", state, kt))
                state = gamma * state + kt[..., None] * u[..., None, :]
            else:
                state = gamma * state
                u = beta[:, :, t, None] * (vt - torch.einsum("bhkv,bhk->bhv", state, kt))
                state = state + kt[..., None] * u[..., None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", state, qt))
        return torch.stack(outs, 2)

    def _delta_net(self, L, x, mask):
        Bn, S, _ = x.shape
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        if BUG != "lara_gdn_pad_leak":
            x = x * mask[..., None]
        qkv, z, b, a = (x @ L.w_in).split([2 * nk * dk + nv * dv, nv * dv, nv, nv], -1)
        qkv = F.pad(qkv.transpose(1, 2), (self.kconv - 1, 0))
        qkv = F.conv1d(qkv, L.conv[:, None, :], groups=qkv.shape[1]).transpose(1, 2)
        if BUG != "lara_conv_no_silu":
            qkv = F.silu(qkv)
        q, k, v = qkv.split([nk * dk, nk * dk, nv * dv], -1)
        q, k = q.view(Bn, S, nk, dk), k.view(Bn, S, nk, dk)
        rep = nv // nk
        if BUG == "lara_gva_tiled":
            q, k = q.repeat(1, 1, rep, 1), k.repeat(1, 1, rep, 1)
        else:
            q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        q = _l2n(q.transpose(1, 2)) * dk**-0.5
        k = _l2n(k.transpose(1, 2))
        v = v.view(Bn, S, nv, dv).transpose(1, 2)
        beta = b.sigmoid().transpose(1, 2)
        if BUG == "lara_dt_bias_outside":
            g = -L.decay_rate * (F.softplus(a) + L.dt_bias)
        else:
            g = -L.decay_rate * F.softplus(a + L.dt_bias)
        o = self._delta_scan(q, k, v, beta, g.transpose(1, 2)).transpose(1, 2)  # (B, S, nv, dv)
        z = z.view(Bn, S, nv, dv)
        if BUG == "lara_gate_before_norm":
            o = _rms(o * F.silu(z), L.o_gain, self.eps)
        else:
            o = _rms(o, L.o_gain, self.eps) * F.silu(z)
        return o.reshape(Bn, S, nv * dv) @ L.w_out

    # ---- MoE with the ungated shared expert ----
    def _moe(self, L, x):
        Bn, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t.float() @ L.w_router
        if BUG == "lara_router_topk_softmax":
            top, idx = logits.topk(self.topk, -1)
            w = top.softmax(-1)
        else:
            w, idx = logits.softmax(-1).topk(self.topk, -1)
            if self.renorm and BUG != "lara_topk_no_renorm":
                w = w / w.sum(-1, keepdim=True)
        if BUG == "lara_dense_experts":
            dense = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)  # (N, E)
            gt, up = torch.einsum("nh,ehf->enf", t, L.w_gu).chunk(2, -1)
            each = torch.einsum("enf,efh->enh", F.silu(gt) * up, L.w_dn)
            routed = torch.einsum("ne,enh->nh", dense, each)
        else:
            routed = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                gt, up = (t[tok] @ L.w_gu[e]).chunk(2, -1)
                routed.index_add_(0, tok, ((F.silu(gt) * up) @ L.w_dn[e]) * w[tok, slot, None])
        gt, up = (t @ L.s_gu).chunk(2, -1)
        shared = (F.silu(gt) * up) @ L.s_dn
        return (routed + shared).view(Bn, S, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        Bn, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(Bn, S)
        if attention_mask is None:
            attention_mask = torch.ones(Bn, S, dtype=torch.long)
        mask = attention_mask.float()
        keep = torch.ones(S, S, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
        one_plus = BUG == "lara_norm_one_plus"
        h = self.emb[input_ids]
        for L, kind in zip(self.blocks, self.kinds):
            x = _rms(h, L.n_mix, self.eps, one_plus)
            if kind == "linear_attention":
                h = h + self._delta_net(L, x, mask)
            else:
                h = h + self._attention(L, x, position_ids, keep, kind)
            h = h + self._moe(L, _rms(h, L.n_ffn, self.eps, one_plus))
        return _rms(h, self.out_gain, self.eps, one_plus) @ self.head


def build(state_dict, config):
    return LaraMiniPort(state_dict, config).eval()
