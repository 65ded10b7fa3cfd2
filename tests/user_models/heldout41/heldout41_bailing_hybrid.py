"""Hand-written plain-PyTorch port of Ling 3 / Bailing-hybrid (BailingHybridForCausalLM): a hybrid of Kimi Delta
Attention (KDA, linear attention with a per-channel gated delta rule) and gated Multi-head Latent Attention (MLA),
with DeepSeek-V3-style sigmoid MoE (group-limited routing, score-correction bias, shared experts).

Architecture as this port implements it (everything float32):
- x = embedding(ids) (no scaling); untied head; logits = W_head RMSNorm_final(x).
- RMSNorm(x) = w * x / sqrt(mean(x^2) + eps), computed in float32; eps = config.rms_norm_eps for the block and final
  norms, but 1e-6 (the module default) for MLA's two latent norms (q_a_layernorm, kv_a_layernorm).
- block i, pre-norm:  x = x + Mixer_i(RMSNorm_a(x));  x = x + FFN_i(RMSNorm_f(x)).
  Mixer_i is MLA when config.layer_types[i] == "full_attention" ((i + 1) % layer_group_size == 0), else KDA.
  FFN_i is a dense SwiGLU MLP when config.mlp_layer_types[i] == "dense" (i < first_k_dense_replace), else the MoE.
- KDA (d = head_dim, h = heads, D = h d):
    x is multiplied by the 2D padding mask first (padding rows become 0, so they never reach the conv or the state);
    [q | k | v] = silu(causal_depthwise_conv_K(x W_qkv)), conv taps w[c, j] applied to x[t - (K - 1) + j];
    g = kda_lower_bound * sigmoid(exp(A_log)_h * (x W_f + dt_bias))   (safe gate; else -exp(A_log) softplus(.)),
      a log-decay per head and per key channel;  beta = sigmoid(x W_b) per head;
    q, k l2-normalised over d as x / sqrt(sum x^2 + 1e-6); q *= d^-1/2;
    S_t = exp(g_t) (.) S_{t-1} (rows = key channels);  delta_t = beta_t (v_t - S_t^T k_t);  S_t += k_t delta_t^T;
    o_t = S_t^T q_t  (S_0 = 0);
    out = W_o [ RMSNorm_d(o) * o_norm_w * sigmoid(x W_g) ]  (the gated norm is per head, over d, eps rms_norm_eps).
- MLA (r_q = q_lora_rank, r = kv_lora_rank, n = qk_nope_head_dim, p = qk_rope_head_dim, e = v_head_dim):
    q = W_qb RMSNorm_1e-6(W_qa x + b_qa), per head [q_nope (n) | q_pe (p)];
    c = RMSNorm_1e-6(W_dkv x + b_dkv) (r),  k_pe = W_kr x + b_kr (p, one for all heads);
    per head  k_nope = W_uk c,  v = W_uv c   (kv_b_proj rows are per head [n key rows | e value rows]);
    RoPE on q_pe, k_pe with INTERLEAVED pairs (x_2i, x_2i+1) rotated by angle pos * inv_freq_i, output laid out as
      [all rotated first members | all rotated second members]; cos and sin multiplied by the YaRN attention factor
      mscale(f, mscale) / mscale(f, mscale_all_dim), mscale(f, m) = 0.1 m ln f + 1; inv_freq by YaRN's ramp;
    score = [q_nope | q_pe] . [k_nope | k_pe] * (n + p)^-1/2 * mscale(f, mscale_all_dim)^2, causal + padding mask,
    softmax in float32; o_h = sum p v;  o_h *= sigmoid(W_gate x)_h (one gate per head);  out = W_o [o_1..o_h] + b_o.
- MoE: s = sigmoid(W_router x) (float32);  choice = s + e_score_correction_bias;
    group score = sum of the top-2 choice scores of each of n_group groups; keep topk_group groups;
    top-k experts on choice (other groups -inf); weights = s at those experts, / (sum + 1e-20) if norm_topk_prob,
    * routed_scaling_factor;  out = sum_k w_k W_down_k (silu(W_gate_k x) * W_up_k x) + SharedMLP(x)
    (shared MLP: SwiGLU with moe_intermediate_size * n_shared_experts).
- Positions: position_ids if given, else 0..T-1; the attention mask is 1/0 per (batch, token), left padding.

Weight layout of this port (own names; differences from Transformers made at load):
- tok_emb (V, H); head_t (H, V) = lm_head transposed; final_norm (H,).
- blocks[i].norms (2, H): rows [pre-mixer norm, pre-FFN norm] stacked.
- KDA mixer `blocks[i].mix`: w_qkv (H, 3D) = [q | k | v] fused and transposed; conv_w (3D, K);
    w_fgb (H, 2D + h) = [forget f_proj | output gate g_proj | beta b_proj] fused and transposed;
    dt_bias (h, d); decay_rate (h,) = exp(A_log) precomputed; onorm_w (d,); w_out (D, H) transposed.
- MLA mixer `blocks[i].mix`: w_qa (H, r_q) transposed, b_qa; qa_norm (r_q,); w_qb (r_q, h (n + p)) transposed;
    w_kva (H, r + p) transposed and b_kva split into w_dkv/b_dkv (latent) and w_kr/b_kr (rope key);
    kv_norm (r,); w_uk (h, n, r) and w_uv (h, e, r) split from kv_b_proj; w_hgate (H, h) transposed;
    w_out (h e, H) transposed, b_out.
- Dense FFN `blocks[i].ffn`: w_gu (H, 2I) = [gate | up] fused and transposed; w_down (I, H) transposed.
- MoE `blocks[i].ffn`: router (E, H) and e_bias (E,) kept in a dict `route` (ParameterDict);
    w_gate, w_up (E, H, I) split from the fused gate_up_proj and transposed; w_down (E, I, H) transposed;
    shared expert w_sgu (H, 2 I_s) fused and transposed, w_sdown (I_s, H) transposed.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_neox_halves",  # MLA RoPE rotates halves (x[:p/2], x[p/2:]) NeoX-style instead of DeepSeek's interleaved pairs
    "mla_mscale_once",  # softmax scale (n + p)^-1/2 times the YaRN mscale(f, mscale_all_dim) once instead of squared
    "mla_kv_b_split_global",  # kv_b_proj split as [all heads' k_nope rows | all heads' v rows] instead of per head
    "mla_gate_tiled",  # per-head output gate widened with .repeat (tiled over heads) instead of repeat_interleave
    "mla_kv_norm_skipped",  # kv_a_layernorm never applied to the compressed latent c before the up-projection
    "kda_safe_gate_ignored",  # forget gate always -exp(A_log) * softplus(f + dt_bias) (Kimi's), kda_safe_gate ignored
    "kda_readout_before_update",  # o_t read from the decayed state before the delta-rule write of token t
    "kda_gated_norm_swish",  # gated output norm uses silu(gate) (FLA's default swish) instead of sigmoid(gate)
    "conv_taps_reversed",  # short-conv kernel flipped at load (taps applied to x[t - j] instead of x[t - (K-1) + j])
    "router_bias_in_weights",  # combine weights gathered from s + e_score_correction_bias instead of the raw s
    "routed_scale_before_norm",  # routed_scaling_factor applied before the top-k renormalisation (so it cancels)
    "group_score_max",  # expert-group score = max of the group (DeepSeek-V2) instead of the sum of its top-2
    "expert_gate_up_swapped",  # fused experts gate_up_proj split as [up | gate] instead of [gate | up]
    "kda_pad_not_zeroed",  # KDA input not multiplied by the padding mask: padding enters the conv and the state
]
PADDING_ONLY = ["kda_pad_not_zeroed"]
CLEAN = [
    "kda_chunked",  # delta rule in chunks of 8: triangular solve for the deltas inside a chunk, state carried across
    "mla_absorbed",  # W_uk absorbed into the query and W_uv applied after attention: attention over the latent c
    "rope_half_layout",  # q_b / k_pe rope rows permuted at load to [evens | odds], then a rotate-half RoPE
    "moe_dense_dispatch",  # every expert run on every token, combined with a dense (tokens, E) weight matrix
    "conv_shift_sum",  # causal depthwise conv as a sum of K shifted copies instead of F.conv1d
]


def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _yarn_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope_tables(config):
    """(inv_freq (p/2,), cos/sin factor, extra softmax factor) for default or YaRN rope."""
    rp = dict(config.rope_parameters or {})
    base = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = config.qk_rope_head_dim
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos, 1.0, 1.0
    assert kind == "yarn", kind
    f = rp["factor"]
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    att = rp.get("attention_factor")
    if att is None:
        att = _yarn_mscale(f, mscale) / _yarn_mscale(f, mscale_all) if (mscale and mscale_all) else _yarn_mscale(f)
    orig = rp["original_max_position_embeddings"]
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr(fast), corr(slow)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    inv = (1.0 / (f * pos)) * (1 - keep) + (1.0 / pos) * keep
    soft = 1.0
    if mscale_all:
        m = _yarn_mscale(f, mscale_all)
        soft = m if BUG == "mla_mscale_once" else m * m
    return inv, float(att), soft


class KDAMixer(nn.Module):
    def __init__(self, sd, pre, config):
        super().__init__()
        self.h, self.d = config.num_attention_heads, config.linear_head_dim
        self.K = config.short_conv_kernel_size
        self.eps = config.rms_norm_eps
        self.safe, self.lower = config.kda_safe_gate, float(config.kda_lower_bound)
        self.w_qkv = _p(torch.cat([sd[pre + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")], 0).t())
        conv = sd[pre + "conv1d.weight"][:, 0, :]
        self.conv_w = _p(conv.flip(-1) if BUG == "conv_taps_reversed" else conv)
        self.w_fgb = _p(
            torch.cat(
                [sd[pre + "forget_gate.f_proj.weight"], sd[pre + "g_proj.weight"], sd[pre + "b_proj.weight"]], 0
            ).t()
        )
        self.dt_bias = _p(sd[pre + "forget_gate.dt_bias"].view(self.h, self.d))
        self.decay_rate = _p(sd[pre + "forget_gate.A_log"].float().exp())
        self.onorm_w = _p(sd[pre + "o_norm.weight"])
        self.w_out = _p(sd[pre + "o_proj.weight"].t())

    def forward(self, x, mask):
        B, T, _ = x.shape
        h, d = self.h, self.d
        if mask is not None and BUG != "kda_pad_not_zeroed":
            x = x * mask[:, :, None].to(x.dtype)
        qkv = x @ self.w_qkv
        if BUG == "conv_shift_sum":
            xp = F.pad(qkv, (0, 0, self.K - 1, 0))
            qkv = sum(xp[:, j : j + T] * self.conv_w[:, j] for j in range(self.K))
        else:
            xp = F.pad(qkv.transpose(1, 2), (self.K - 1, 0))
            qkv = F.conv1d(xp, self.conv_w.unsqueeze(1), groups=qkv.shape[-1]).transpose(1, 2)
        qkv = F.silu(qkv)
        q, k, v = [t.reshape(B, T, h, d) for t in qkv.split(h * d, dim=-1)]
        fgb = x @ self.w_fgb
        f, gate, b = fgb.split([h * d, h * d, h], dim=-1)
        f = f.view(B, T, h, d) + self.dt_bias
        A = self.decay_rate.view(1, 1, h, 1)
        if self.safe and BUG != "kda_safe_gate_ignored":
            g = self.lower * torch.sigmoid(A * f)
        else:
            g = -A * F.softplus(f)
        beta = torch.sigmoid(b)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q * d**-0.5
        if BUG == "kda_chunked":
            o = self.chunked(q, k, v, g, beta)
        else:
            o = self.scan(q, k, v, g, beta)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.onorm_w
        gate = gate.view(B, T, h, d)
        o = o * (F.silu(gate) if BUG == "kda_gated_norm_swish" else torch.sigmoid(gate))
        return o.reshape(B, T, h * d) @ self.w_out

    @staticmethod
    def scan(q, k, v, g, beta):
        B, T, h, d = q.shape
        S = q.new_zeros(B, h, d, v.shape[-1])
        outs = []
        for t in range(T):
            S = S * g[:, t].exp()[..., None]
            if BUG == "kda_readout_before_update":
                outs.append((S * q[:, t, :, :, None]).sum(-2))
            mem = (S * k[:, t, :, :, None]).sum(-2)
            delta = (v[:, t] - mem) * beta[:, t, :, None]
            S = S + k[:, t, :, :, None] * delta[:, :, None, :]
            if BUG != "kda_readout_before_update":
                outs.append((S * q[:, t, :, :, None]).sum(-2))
        return torch.stack(outs, 1)

    @staticmethod
    def chunked(q, k, v, g, beta, C=8):
        """Exact chunked form: inside a chunk with cumulative log-decay G_t and entering state S0,
        (I + A) Delta = diag(beta) (V - (e^G (.) K) S0),  A_tj = beta_t sum_c k_t k_j e^(G_t - G_j) (j < t);
        o_t = S0^T (e^G_t (.) q_t) + sum_{j<=t} (q_t . e^(G_t - G_j) (.) k_j) delta_j."""
        B, T, h, d = q.shape
        e = v.shape[-1]
        q, k, v, g = [t.transpose(1, 2) for t in (q, k, v, g)]  # (B, h, T, .)
        beta = beta.transpose(1, 2)
        S = q.new_zeros(B, h, d, e)
        outs = []
        for s in range(0, T, C):
            qc, kc, vc, bc = q[:, :, s : s + C], k[:, :, s : s + C], v[:, :, s : s + C], beta[:, :, s : s + C]
            G = g[:, :, s : s + C].cumsum(2)
            n = qc.shape[2]
            diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # (B, h, t, j, d)
            low = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
            lowd = torch.tril(torch.ones(n, n, dtype=torch.bool), 0)
            dec = diff.masked_fill(~lowd[..., None], float("-inf")).exp()
            kk = (kc[:, :, :, None, :] * kc[:, :, None, :, :] * dec).sum(-1)
            A = (bc[..., None] * kk).masked_fill(~low, 0.0) + torch.eye(n)
            rhs = bc[..., None] * (vc - (G.exp() * kc) @ S)
            delta = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
            qk = (qc[:, :, :, None, :] * kc[:, :, None, :, :] * dec).sum(-1)
            outs.append((G.exp() * qc) @ S + qk @ delta)
            last = G[:, :, -1:, :]
            S = last.transpose(-1, -2).exp() * S + ((last - G).exp() * kc).transpose(-1, -2) @ delta
        return torch.cat(outs, 2).transpose(1, 2)


class MLAMixer(nn.Module):
    def __init__(self, sd, pre, config):
        super().__init__()
        self.h = config.num_attention_heads
        self.n, self.pdim, self.e = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.r = config.kv_lora_rank
        h, n, p, e, r = self.h, self.n, self.pdim, self.e, self.r
        self.w_qa = _p(sd[pre + "q_a_proj.weight"].t())
        self.b_qa = _p(sd.get(pre + "q_a_proj.bias", torch.zeros(config.q_lora_rank)))
        self.qa_norm = _p(sd[pre + "q_a_layernorm.weight"])
        qb = sd[pre + "q_b_proj.weight"].view(h, n + p, -1)
        kva = sd[pre + "kv_a_proj_with_mqa.weight"]
        kvab = sd.get(pre + "kv_a_proj_with_mqa.bias", torch.zeros(r + p))
        kr, kr_b = kva[r:], kvab[r:]
        if BUG == "rope_half_layout":  # de-interleave the rope rows: [x0, x2, ..., x1, x3, ...]
            perm = torch.cat([torch.arange(0, p, 2), torch.arange(1, p, 2)])
            qb = torch.cat([qb[:, :n], qb[:, n:][:, perm]], 1)
            kr, kr_b = kr[perm], kr_b[perm]
        self.w_qb = _p(qb.reshape(h * (n + p), -1).t())
        self.w_dkv, self.b_dkv = _p(kva[:r].t()), _p(kvab[:r])
        self.w_kr, self.b_kr = _p(kr.t()), _p(kr_b)
        self.kv_norm = _p(sd[pre + "kv_a_layernorm.weight"])
        kvb = sd[pre + "kv_b_proj.weight"]
        if BUG == "mla_kv_b_split_global":
            self.w_uk = _p(kvb[: h * n].view(h, n, r))
            self.w_uv = _p(kvb[h * n :].view(h, e, r))
        else:
            kvb = kvb.view(h, n + e, r)
            self.w_uk, self.w_uv = _p(kvb[:, :n]), _p(kvb[:, n:])
        self.w_hgate = _p(sd[pre + "g_proj.weight"].t())
        self.w_out = _p(sd[pre + "o_proj.weight"].t())
        self.b_out = _p(sd.get(pre + "o_proj.bias", torch.zeros(config.hidden_size)))
        inv, self.att_factor, soft = _rope_tables(config)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale = (n + p) ** -0.5 * soft

    def rope(self, x, pos):  # x (B, heads, T, p), pos (B, T)
        ang = pos[:, None, :, None].float() * self.inv_freq  # (B, 1, T, p/2)
        cos, sin = ang.cos() * self.att_factor, ang.sin() * self.att_factor
        if BUG in ("rope_neox_halves", "rope_half_layout"):
            a, b = x.chunk(2, dim=-1)
        else:
            a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, x, mask, pos):
        B, T, _ = x.shape
        h, n, p, e = self.h, self.n, self.pdim, self.e
        eps = 1e-6
        q = _rms(x @ self.w_qa + self.b_qa, self.qa_norm, eps) @ self.w_qb
        q = q.view(B, T, h, n + p).transpose(1, 2)
        q_nope, q_pe = q[..., :n], q[..., n:]
        c = x @ self.w_dkv + self.b_dkv
        if BUG != "mla_kv_norm_skipped":
            c = _rms(c, self.kv_norm, eps)
        k_pe = (x @ self.w_kr + self.b_kr)[:, None]  # (B, 1, T, p)
        q_pe, k_pe = self.rope(q_pe, pos), self.rope(k_pe, pos)
        if BUG == "mla_absorbed":
            q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope, self.w_uk)
            scores = torch.einsum("bhtr,bsr->bhts", q_lat, c) + q_pe @ k_pe.transpose(-1, -2)
        else:
            k_nope = torch.einsum("hnr,bsr->bhsn", self.w_uk, c)
            scores = q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)
        scores = scores * self.scale
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        if mask is not None:
            allowed = allowed & mask[:, None, None, :].bool()
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1)
        if BUG == "mla_absorbed":
            o = torch.einsum("her,bhtr->bhte", self.w_uv, probs @ c[:, None])
        else:
            v = torch.einsum("her,bsr->bhse", self.w_uv, c)
            o = probs @ v
        o = o.transpose(1, 2).reshape(B, T, h * e)
        gate = torch.sigmoid(x @ self.w_hgate)  # (B, T, h)
        gate = gate.repeat(1, 1, e) if BUG == "mla_gate_tiled" else gate.repeat_interleave(e, dim=-1)
        return (o * gate) @ self.w_out + self.b_out


class DenseFFN(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.w_gu = _p(torch.cat([gate, up], 0).t())
        self.w_down = _p(down.t())

    def forward(self, x):
        a, b = (x @ self.w_gu).chunk(2, dim=-1)
        return (F.silu(a) * b) @ self.w_down


class MoEFFN(nn.Module):
    def __init__(self, sd, pre, config):
        super().__init__()
        self.E, self.k = config.num_local_experts, config.num_experts_per_tok
        self.groups, self.topk_group = config.n_group, config.topk_group
        self.norm_topk, self.rsf = config.norm_topk_prob, float(config.routed_scaling_factor)
        self.route = nn.ParameterDict(
            {"w": _p(sd[pre + "gate.weight"]), "bias": _p(sd[pre + "gate.e_score_correction_bias"])}
        )
        gu = sd[pre + "experts.gate_up_proj"]  # (E, 2I, H)
        gate, up = gu.chunk(2, dim=1)
        if BUG == "expert_gate_up_swapped":
            gate, up = up, gate
        self.w_gate, self.w_up = _p(gate.transpose(1, 2)), _p(up.transpose(1, 2))
        self.w_down = _p(sd[pre + "experts.down_proj"].transpose(1, 2))
        self.shared = DenseFFN(
            sd[pre + "shared_experts.gate_proj.weight"],
            sd[pre + "shared_experts.up_proj.weight"],
            sd[pre + "shared_experts.down_proj.weight"],
        )

    def routing(self, x):  # x (N, H) -> (idx (N, k), weights (N, k))
        s = torch.sigmoid(x.float() @ self.route["w"].t())
        choice = s + self.route["bias"]
        N = x.shape[0]
        grouped = choice.view(N, self.groups, -1)
        if BUG == "group_score_max":
            gscore = grouped.max(-1).values
        else:
            gscore = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(self.topk_group, dim=-1).indices, 1.0)
        keep = keep[:, :, None].expand_as(grouped).reshape(N, -1)
        idx = choice.masked_fill(keep == 0, float("-inf")).topk(self.k, dim=-1).indices
        w = (choice if BUG == "router_bias_in_weights" else s).gather(1, idx)
        if BUG == "routed_scale_before_norm":
            w = w * self.rsf
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if BUG != "routed_scale_before_norm":
            w = w * self.rsf
        return idx, w

    def forward(self, x):
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        idx, w = self.routing(flat)
        if BUG == "moe_dense_dispatch":
            dense = torch.zeros(flat.shape[0], self.E).scatter_(1, idx, w)
            hid = F.silu(torch.einsum("nh,ehi->eni", flat, self.w_gate)) * torch.einsum("nh,ehi->eni", flat, self.w_up)
            ys = torch.einsum("eni,eih->enh", hid, self.w_down)
            out = torch.einsum("ne,enh->nh", dense, ys)
        else:
            out = torch.zeros_like(flat)
            for e in range(self.E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                xe = flat[tok]
                ye = (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
                out.index_add_(0, tok, ye * w[tok, slot, None])
        return out.view(B, T, H) + self.shared(x)


class Block(nn.Module):
    def __init__(self, sd, i, config):
        super().__init__()
        pre = f"model.layers.{i}."
        self.norms = _p(torch.stack([sd[pre + "input_layernorm.weight"], sd[pre + "post_attention_layernorm.weight"]]))
        self.eps = config.rms_norm_eps
        self.full = config.layer_types[i] == "full_attention"
        self.mix = MLAMixer(sd, pre + "self_attn.", config) if self.full else KDAMixer(sd, pre + "self_attn.", config)
        if config.mlp_layer_types[i] == "sparse":
            self.ffn = MoEFFN(sd, pre + "mlp.", config)
        else:
            self.ffn = DenseFFN(*(sd[pre + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))

    def forward(self, x, mask, pos):
        y = _rms(x, self.norms[0], self.eps)
        x = x + (self.mix(y, mask, pos) if self.full else self.mix(y, mask))
        return x + self.ffn(_rms(x, self.norms[1], self.eps))


class LingHybridLM(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.tok_emb = _p(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([Block(sd, i, config) for i in range(config.num_hidden_layers)])
        self.final_norm = _p(sd["model.norm.weight"])
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        self.head_t = _p(head.t())
        self.eps = config.rms_norm_eps

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        x = self.tok_emb[input_ids]
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        mask = None
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            mask = attention_mask
        for blk in self.blocks:
            x = blk(x, mask, position_ids)
        return _rms(x, self.final_norm, self.eps) @ self.head_t


def build(state_dict, config):
    return LingHybridLM(state_dict, config).eval()
