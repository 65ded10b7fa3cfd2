"""A from-scratch PyTorch port of DeepSeek-V2 (``deepseek_v2``): MLA attention with YaRN RoPE, and a
DeepSeek-MoE feed-forward with group-limited greedy routing and shared experts.

Architecture (B batch, S sequence, D hidden, H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim,
dv = v_head_dim, Rq = q_lora_rank, Rkv = kv_lora_rank, E routed experts, k = num_experts_per_tok)

  x = embed[input_ids]                                                         (B, S, D)
  per layer l:
    h   = x + Attn(RMSNorm(x; g_attn))
    x   = h + FFN(RMSNorm(h; g_ffn))          FFN = dense SwiGLU for l < first_k_dense_replace, else MoE
  logits = RMSNorm(x; g_final) @ W_head                                         (B, S, V)

  RMSNorm(x; g) = g * x / sqrt(mean(x^2) + eps)   (eps = rms_norm_eps for the block norms, 1e-6 for the
  two low-rank norms inside attention)

  MLA attention, for normed input u (B, S, D):
    [q_lat | c_raw | k_r] = u @ W_a + b_a          widths Rq, Rkv, dr   (q_a and kv_a_with_mqa fused)
    q        = RMSNorm(q_lat; g_q) @ W_qb          per head [q_nope (dn) | q_rope (dr)]
    c        = RMSNorm(c_raw; g_kv)                the latent, shared by all heads   (B, S, Rkv)
    k_nope_h = c @ W_uk[h]   (Rkv -> dn),  v_h = c @ W_uv[h]   (Rkv -> dv)
    k_rope   = k_r, ONE rope key shared by every head (MQA-style)
    RoPE on q_rope and k_rope with INTERLEAVED pairs (2i, 2i+1):
        (a, b) -> (a cos t - b sin t, a sin t + b cos t),   t = pos * inv_freq[i],  i < dr/2
      cos/sin multiplied by the YaRN attention factor
        mscale(f, mscale) / mscale(f, mscale_all_dim),   mscale(f, m) = 0.1 m ln f + 1  (1 if f <= 1)
      inv_freq = YaRN blend of base^(-2i/dr) (extrapolation) and base^(-2i/dr)/f (interpolation), with the
      linear ramp between floor(low) and ceil(high) of the correction range (beta_fast, beta_slow,
      original_max_position_embeddings), dim = qk_rope_head_dim.
    score_h = (q_nope_h . k_nope_h + q_rope_h . k_rope) * scale,
        scale = (dn + dr)^-0.5 * mscale(f, mscale_all_dim)^2
    causal + key padding mask (masked with the dtype minimum), softmax over keys
    out = sum_h (P_h @ v_h) @ W_o[h] + b_o

  MoE (tokens t, normed input u):
    p = softmax(u @ W_router)                                     (T, E), float32
    group score = max of p over each of n_group CONTIGUOUS groups of E/n_group experts; keep the
    topk_group best groups, zero p elsewhere; pick the top k experts of the masked p;
    weights w = p[chosen] * routed_scaling_factor  (NOT renormalised: norm_topk_prob is False)
    y = sum_j w_j * SwiGLU_e_j(u) + SharedSwiGLU(u)
    SwiGLU(u) = (silu(u @ Wg) * (u @ Wu)) @ Wd

Weight layout (mine, converted in ``build``; all matrices stored in -> out):
  embed         (V, D)
  layers[l].attn:
    w_a   (D, Rq + Rkv + dr)   fused [q_a_proj | kv_a_proj_with_mqa], transposed;  b_a (Rq + Rkv + dr)
    g_q (Rq), g_kv (Rkv)
    w_qb  (Rq, H, dn + dr)     q_b_proj per head
    w_uk  (H, Rkv, dn)         the key half of kv_b_proj, per head
    w_uv  (H, Rkv, dv)         the value half of kv_b_proj, per head
    w_o   (H, dv, D)           o_proj per head;  b_o (D)
  layers[l].ffn (dense):  w_gu (D, 2 I) = [gate | up],  w_d (I, D)
  layers[l].ffn (MoE):    w_router (D, E); w_gu (E, D, 2 Im) = [gate | up]; w_d (E, Im, D);
                          shared w_sgu (D, 2 Is) = [gate | up], shared w_sd (Is, D)
  g_attn, g_ffn per layer; g_final (D); w_head (D, V)
  rope: inv_freq (dr/2) and the cos/sin attention factor, computed in build from the config.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_neox_halves",  # RoPE rotates (first half, second half) pairs (NeoX rotate_half) instead of DeepSeek's interleaved (even, odd) pairs
    "softmax_scale_no_mscale",  # softmax scale is (dn+dr)^-0.5 only, missing the YaRN mscale(factor, mscale_all_dim)^2 correction
    "rope_attn_factor_plain",  # YaRN cos/sin factor taken as 0.1*ln(factor)+1, ignoring the mscale / mscale_all_dim ratio
    "yarn_ramp_untruncated",  # YaRN correction range not floored/ceiled before the ramp, so the extrapolation/interpolation blend is off
    "rope_dim_from_hidden",  # RoPE frequencies built for dim = hidden_size // num_heads instead of qk_rope_head_dim
    "kv_b_blocked_split",  # kv_b_proj rows split as [all heads' k_nope | all heads' v] instead of per head [k_nope_h | v_h]
    "topk_renorm",  # top-k routing weights renormalised to sum 1 (as if norm_topk_prob) before routed_scaling_factor
    "routed_scale_includes_shared",  # routed_scaling_factor applied after adding the shared experts, scaling them too
    "expert_groups_strided",  # expert groups taken strided (expert e in group e % n_group) instead of contiguous blocks
    "router_mask_before_softmax",  # disallowed groups masked on the logits before the softmax, renormalising the kept experts' probabilities
    "expert_gate_up_swapped",  # fused expert gate_up_proj read as [up | gate] instead of [gate | up]
    "kv_a_bias_dropped",  # attention_bias honoured for q_a_proj and o_proj but kv_a_proj_with_mqa's bias not loaded
    "shared_on_residual",  # shared experts fed the pre-norm residual stream (HF's `residuals` name misread) instead of the normed input
    "mask_added_raw",  # the 0/1 padding mask added to the scores as-is instead of as 0/-inf (shows only with padding)
]

PADDING_ONLY = ["mask_added_raw"]

CLEAN = [
    "absorbed_mla",  # weight-absorbed MLA: q_nope mapped into the latent by W_uk, scores and values taken on the latent, W_uv after
    "rope_deinterleave",  # q_rope/k_rope permuted to [even | odd] then NeoX rotate_half; same permutation on q and k leaves dot products unchanged
    "sdpa_attention",  # F.scaled_dot_product_attention on concatenated [nope | rope] q/k with an additive mask and explicit scale
    "moe_dense_einsum",  # every expert run on every token, combined with a dense (T, E) weight matrix (zeros where unrouted)
    "rope_table",  # cos/sin precomputed for all max_position_embeddings positions, gathered by position id
]


def _bug():
    return BUG


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mscale(f, m=1.0):
    return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0


def _rope_params(config):
    """inv_freq (dim/2,), the cos/sin attention factor, and the softmax mscale^2."""
    bug = _bug()
    rp = dict(config.rope_parameters or {})
    base = float(rp.get("rope_theta", 10000.0))
    dim = config.qk_rope_head_dim
    if bug == "rope_dim_from_hidden":
        dim = config.hidden_size // config.num_attention_heads
    idx = torch.arange(0, dim, 2, dtype=torch.float32)
    pos_freqs = base ** (idx / dim)
    rtype = rp.get("rope_type", "default")
    if rtype != "yarn":
        inv = 1.0 / pos_freqs
        return inv[: config.qk_rope_head_dim // 2], 1.0, 1.0
    f = rp.get("factor")
    omax = rp.get("original_max_position_embeddings", config.max_position_embeddings)
    if f is None:
        f = config.max_position_embeddings / omax
    ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
    af = rp.get("attention_factor")
    if af is None:
        if ms and ms_all and bug != "rope_attn_factor_plain":
            af = _mscale(f, ms) / _mscale(f, ms_all)
        else:
            af = _mscale(f)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True) and bug != "yarn_ramp_untruncated":
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrap = 1.0 - ramp
    inv = (1.0 / (f * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrap
    sm = 1.0
    if ms_all:
        sm = _mscale(f, ms_all) ** 2
    return inv[: config.qk_rope_head_dim // 2], float(af), float(sm)


class MLA(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.H = cfg.num_attention_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rq = cfg.q_lora_rank
        self.rkv = cfg.kv_lora_rank
        D = cfg.hidden_size
        width = (self.rq or 0) + self.rkv + self.dr
        self.w_a = nn.Parameter(torch.zeros(D, width))
        self.b_a = nn.Parameter(torch.zeros(width))
        self.g_q = nn.Parameter(torch.ones(self.rq)) if self.rq else None
        self.g_kv = nn.Parameter(torch.ones(self.rkv))
        self.w_qb = nn.Parameter(torch.zeros(self.rq or D, self.H, self.dn + self.dr))
        self.w_uk = nn.Parameter(torch.zeros(self.H, self.rkv, self.dn))
        self.w_uv = nn.Parameter(torch.zeros(self.H, self.rkv, self.dv))
        self.w_o = nn.Parameter(torch.zeros(self.H, self.dv, D))
        self.b_o = nn.Parameter(torch.zeros(D))

    def forward(self, u, cos, sin, allowed, pad, scale):
        bug = _bug()
        B, S, _ = u.shape
        a = u @ self.w_a + self.b_a
        if self.rq:
            q_lat, c_raw, k_r = a.split([self.rq, self.rkv, self.dr], -1)
            q_in = _rms(q_lat, self.g_q, 1e-6)
        else:
            c_raw, k_r = a[..., : self.rkv], a[..., self.rkv :]
            q_in = u
        q = torch.einsum("bsr,rhd->bhsd", q_in, self.w_qb)
        q_nope, q_rope = q.split([self.dn, self.dr], -1)
        c = _rms(c_raw, self.g_kv, 1e-6)  # (B, S, Rkv)
        k_rope = k_r[:, None]  # (B, 1, S, dr)
        q_rope = _rope(q_rope, cos, sin)
        k_rope = _rope(k_rope, cos, sin)

        if bug == "sdpa_attention":
            k_nope = torch.einsum("bsr,hrd->bhsd", c, self.w_uk)
            v = torch.einsum("bsr,hrd->bhsd", c, self.w_uv)
            qq = torch.cat([q_nope, q_rope], -1)
            kk = torch.cat([k_nope, k_rope.expand(-1, self.H, -1, -1)], -1)
            bias = torch.zeros(allowed.shape, dtype=u.dtype).masked_fill(~allowed, torch.finfo(u.dtype).min)
            o = F.scaled_dot_product_attention(qq, kk, v, attn_mask=bias, scale=scale)
        elif bug == "absorbed_mla":
            q_lat_k = torch.einsum("bhsd,hrd->bhsr", q_nope, self.w_uk)  # q in latent space
            s = torch.einsum("bhsr,btr->bhst", q_lat_k, c) + q_rope @ k_rope.transpose(-1, -2)
            s = (s * scale).masked_fill(~allowed, torch.finfo(s.dtype).min)
            p = s.softmax(-1)
            o_lat = torch.einsum("bhst,btr->bhsr", p, c)
            o = torch.einsum("bhsr,hrd->bhsd", o_lat, self.w_uv)
        else:
            k_nope = torch.einsum("bsr,hrd->bhsd", c, self.w_uk)
            v = torch.einsum("bsr,hrd->bhsd", c, self.w_uv)
            s = q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)
            s = s * scale
            if bug == "mask_added_raw" and pad is not None:
                s = s + pad[:, None, None, :].to(s.dtype)
                causal = torch.ones(S, S, dtype=torch.bool).tril()
                s = s.masked_fill(~causal, torch.finfo(s.dtype).min)
            else:
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            p = s.softmax(-1)
            o = p @ v  # (B, H, S, dv)
        return torch.einsum("bhsd,hdo->bso", o, self.w_o) + self.b_o


def _rope(x, cos, sin):
    """x (..., S, dr) interleaved pairs; cos/sin (B, S, dr/2), already times the attention factor."""
    cos, sin = cos[:, None], sin[:, None]
    bug = _bug()
    if bug == "rope_neox_halves":
        a, b = x.chunk(2, -1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    if bug == "rope_deinterleave":
        # permute to [even | odd], then the NeoX form; q and k get the same permutation
        x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        c2, s2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        a, b = x.chunk(2, -1)
        rot = torch.cat([-b, a], -1)
        return x * c2 + rot * s2
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


class DenseFFN(nn.Module):
    def __init__(self, D, inter):
        super().__init__()
        self.inter = inter
        self.w_gu = nn.Parameter(torch.zeros(D, 2 * inter))
        self.w_d = nn.Parameter(torch.zeros(inter, D))

    def forward(self, u, resid=None):
        g, up = (u @ self.w_gu).split(self.inter, -1)
        return (F.silu(g) * up) @ self.w_d


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, E, Im = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.E, self.Im, self.k = E, Im, cfg.num_experts_per_tok
        self.method = cfg.topk_method
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.rsf = cfg.routed_scaling_factor
        self.norm_topk = bool(getattr(cfg, "norm_topk_prob", False))
        self.w_router = nn.Parameter(torch.zeros(D, E))
        self.w_gu = nn.Parameter(torch.zeros(E, D, 2 * Im))
        self.w_d = nn.Parameter(torch.zeros(E, Im, D))
        self.shared = DenseFFN(D, Im * cfg.n_shared_experts)

    def route(self, x):
        bug = _bug()
        logits = x.float() @ self.w_router.float()
        p = logits.softmax(-1)
        T, E = p.shape
        if self.method == "group_limited_greedy":
            G = self.n_group
            if bug == "expert_groups_strided":
                gs = p.view(T, E // G, G).max(1).values
            else:
                gs = p.view(T, G, E // G).max(-1).values
            gidx = gs.topk(self.topk_group, -1).indices
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0).bool()
            if bug == "expert_groups_strided":
                emask = gmask[:, None, :].expand(T, E // G, G).reshape(T, E)
            else:
                emask = gmask[:, :, None].expand(T, G, E // G).reshape(T, E)
            if bug == "router_mask_before_softmax":
                p = logits.masked_fill(~emask, float("-inf")).softmax(-1)
            else:
                p = p.masked_fill(~emask, 0.0)
        w, idx = p.topk(self.k, -1)
        if self.norm_topk or bug == "topk_renorm":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.rsf
        return w, idx

    def forward(self, u, resid=None):
        bug = _bug()
        shp = u.shape
        x = u.reshape(-1, shp[-1])
        w, idx = self.route(x)
        T = x.shape[0]
        if bug == "moe_dense_einsum":
            dense = torch.zeros(T, self.E, dtype=x.dtype).scatter_add_(1, idx, w.to(x.dtype))
            gu = torch.einsum("td,edf->etf", x, self.w_gu)
            g, up = gu.split(self.Im, -1)
            h = torch.einsum("eti,eid->etd", F.silu(g) * up, self.w_d)
            y = torch.einsum("te,etd->td", dense, h)
        else:
            y = torch.zeros_like(x)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                g, up = (x[tok] @ self.w_gu[e]).split(self.Im, -1)
                out = (F.silu(g) * up) @ self.w_d[e]
                y.index_add_(0, tok, out * w[tok, slot, None].to(x.dtype))
        y = y.view(shp)
        s_in = resid if (bug == "shared_on_residual" and resid is not None) else u
        if bug == "routed_scale_includes_shared":
            return (y / self.rsf + self.shared(s_in)) * self.rsf
        return y + self.shared(s_in)


class Layer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        D = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.g_attn = nn.Parameter(torch.ones(D))
        self.g_ffn = nn.Parameter(torch.ones(D))
        self.attn = MLA(cfg)
        if i >= cfg.first_k_dense_replace:
            self.ffn = MoE(cfg)
        else:
            self.ffn = DenseFFN(D, cfg.intermediate_size)

    def forward(self, x, cos, sin, allowed, pad, scale):
        x = x + self.attn(_rms(x, self.g_attn, self.eps), cos, sin, allowed, pad, scale)
        return x + self.ffn(_rms(x, self.g_ffn, self.eps), resid=x)


class DeepseekV2Port(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = nn.Parameter(torch.zeros(V, D))
        self.layers = nn.ModuleList([Layer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.g_final = nn.Parameter(torch.ones(D))
        self.w_head = nn.Parameter(torch.zeros(D, V))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        cfg = self.cfg
        B, S = input_ids.shape
        x = self.embed[input_ids]
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        inv, af, sm = _rope_params(cfg)
        if bug == "rope_table":
            n = max(cfg.max_position_embeddings, int(position_ids.max()) + 1)
            ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
            ct, st = ang.cos() * af, ang.sin() * af
            cos, sin = ct[position_ids], st[position_ids]
        else:
            ang = position_ids[..., None].float() * inv
            cos, sin = ang.cos() * af, ang.sin() * af
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        if bug != "softmax_scale_no_mscale":
            scale = scale * sm
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal[None, None].expand(B, 1, S, S)
        pad = None
        if attention_mask is not None:
            pad = attention_mask.bool()
            allowed = allowed & pad[:, None, None, :]
        for layer in self.layers:
            x = layer(x, cos, sin, allowed, pad, scale)
        return _rms(x, self.g_final, cfg.rms_norm_eps) @ self.w_head


@torch.no_grad()
def build(state_dict, config):
    bug = _bug()
    sd = {k: v.float() for k, v in state_dict.items()}
    m = DeepseekV2Port(config)
    H, dn, dr, dv = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    rkv = config.kv_lora_rank
    m.embed.copy_(sd["model.embed_tokens.weight"])
    m.g_final.copy_(sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    m.w_head.copy_(head.t())
    for i, L in enumerate(m.layers):
        p = f"model.layers.{i}."
        L.g_attn.copy_(sd[p + "input_layernorm.weight"])
        L.g_ffn.copy_(sd[p + "post_attention_layernorm.weight"])
        A = L.attn
        a = p + "self_attn."
        kv_w = sd[a + "kv_a_proj_with_mqa.weight"]
        kv_b = sd.get(a + "kv_a_proj_with_mqa.bias", torch.zeros(kv_w.shape[0]))
        if bug == "kv_a_bias_dropped":
            kv_b = torch.zeros_like(kv_b)
        if config.q_lora_rank:
            q_w = sd[a + "q_a_proj.weight"]
            q_b = sd.get(a + "q_a_proj.bias", torch.zeros(q_w.shape[0]))
            A.w_a.copy_(torch.cat([q_w, kv_w], 0).t())
            A.b_a.copy_(torch.cat([q_b, kv_b], 0))
            A.g_q.copy_(sd[a + "q_a_layernorm.weight"])
            qb = sd[a + "q_b_proj.weight"]
        else:
            A.w_a.copy_(kv_w.t())
            A.b_a.copy_(kv_b)
            qb = sd[a + "q_proj.weight"]
        A.w_qb.copy_(qb.view(H, dn + dr, -1).permute(2, 0, 1))
        A.g_kv.copy_(sd[a + "kv_a_layernorm.weight"])
        kvb = sd[a + "kv_b_proj.weight"]  # (H*(dn+dv), Rkv)
        if bug == "kv_b_blocked_split":
            uk, uv = kvb[: H * dn].view(H, dn, rkv), kvb[H * dn :].view(H, dv, rkv)
        else:
            per = kvb.view(H, dn + dv, rkv)
            uk, uv = per[:, :dn], per[:, dn:]
        A.w_uk.copy_(uk.transpose(1, 2))
        A.w_uv.copy_(uv.transpose(1, 2))
        A.w_o.copy_(sd[a + "o_proj.weight"].t().reshape(H, dv, -1))
        if a + "o_proj.bias" in sd:
            A.b_o.copy_(sd[a + "o_proj.bias"])
        f = p + "mlp."
        if isinstance(L.ffn, MoE):
            Fm = L.ffn
            Fm.w_router.copy_(sd[f + "gate.weight"].t())
            gu = sd[f + "experts.gate_up_proj"]  # (E, 2Im, D) = [gate; up]
            if bug == "expert_gate_up_swapped":
                gu = torch.cat([gu[:, Fm.Im :], gu[:, : Fm.Im]], 1)
            Fm.w_gu.copy_(gu.transpose(1, 2))
            Fm.w_d.copy_(sd[f + "experts.down_proj"].transpose(1, 2))
            s = f + "shared_experts."
            Fm.shared.w_gu.copy_(torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]], 0).t())
            Fm.shared.w_d.copy_(sd[s + "down_proj.weight"].t())
        else:
            L.ffn.w_gu.copy_(torch.cat([sd[f + "gate_proj.weight"], sd[f + "up_proj.weight"]], 0).t())
            L.ffn.w_d.copy_(sd[f + "down_proj.weight"].t())
    return m.float().eval()
