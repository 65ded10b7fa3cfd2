"""A from-scratch PyTorch port of DeepSeek-V3 (Transformers model type ``deepseek_v3``), float32, no cache.

Architecture (sizes read from the config; D = hidden_size, H = num_attention_heads)
-----------------------------------------------------------------------------------
x_0 = E[input_ids]                                                   (B, S, D)
for each layer l:
    h   = x + MLA(RMSNorm(x; g_in))
    x'  = h + FFN_l(RMSNorm(h; g_post))      FFN_l = dense SwiGLU for l < first_k_dense_replace, else MoE
logits = RMSNorm(x_L; g_out) @ W_head                                 (B, S, V)

RMSNorm(x; g) = g * x / sqrt(mean(x^2) + eps)   (eps = rms_norm_eps for the block norms; the two latent norms
q_a / kv_a use Transformers' default 1e-6).

Multi-head latent attention (MLA), dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, dq = dn + dr:
    [c_q | c_kv | k_r] = x @ W_a                       c_q: q_lora_rank, c_kv: kv_lora_rank, k_r: dr (one head)
    q      = RMSNorm(c_q) @ W_qb                       (B, S, H, dq) = [q_nope (dn) | q_rope (dr)]
    c_kv   = RMSNorm(c_kv)
    k_nope = c_kv @ W_uk[h]  (dn),   v = c_kv @ W_uv[h]  (dv)         per head
    q_rope, k_r: RoPE with interleaved pairs (x0,x1),(x2,x3),... (rope_interleave=True), pair i turned by
                 angle pos * inv_freq[i]; cos/sin multiplied by YaRN's attention factor
                 mscale(factor, mscale) / mscale(factor, mscale_all_dim)   (here 1.0)
    k      = [k_nope | k_r broadcast over heads]
    score  = q . k * softmax_scale + mask,   softmax_scale = dq^-0.5 * mscale(factor, mscale_all_dim)^2
             with mscale(s, m) = 0.1 * m * ln(s) + 1 (s > 1)
    out    = sum_h softmax(score) v  @ W_o[h]
    mask: causal, and keys at padding (attention_mask == 0) masked (additive finfo.min).

YaRN inverse frequencies (dim = dr, base = rope_theta, L0 = original_max_position_embeddings):
    extrap_i = base^(-2i/dim), interp_i = extrap_i / factor
    corr(r)  = dim * ln(L0 / (2 pi r)) / (2 ln base);  low = max(floor(corr(beta_fast)), 0),
    high = min(ceil(corr(beta_slow)), dim - 1);  ramp_i = clamp((i - low) / (high - low), 0, 1)
    inv_freq_i = interp_i * ramp_i + extrap_i * (1 - ramp_i)

MoE (E = n_routed_experts, K = num_experts_per_tok, G = n_group):
    s      = sigmoid(x @ W_router)                     (N, E) affinities, float32
    c      = s + e_score_correction_bias               used for the CHOICE only
    group score = sum of the top-2 c in each of the G contiguous groups; keep topk_group groups
    idx    = top-K of c over the kept groups
    w      = s[idx] / (sum s[idx] + 1e-20)  (norm_topk_prob)  * routed_scaling_factor
    y      = sum_k w_k * SwiGLU_{idx_k}(x) + SwiGLU_shared(x)
    SwiGLU(x) = (silu(x @ W1) * (x @ W3)) @ W2

Weight layout (all matrices stored in -> out, i.e. transposed from nn.Linear)
------------------------------------------------------------------------------
    tok_emb                 (V, D)
    head                    (D, V)          lm_head.weight.T
    out_norm                (D,)
    blocks[l].g_in, g_post  (D,)
    blocks[l].w_a           (D, q_lora + kv_lora + dr)   fused q_a_proj | kv_a_proj_with_mqa
      (or, without q_lora_rank, w_a = kv_a only and w_q (D, H, dq))
    blocks[l].g_q, g_kv     (q_lora,), (kv_lora,)
    blocks[l].w_qb          (q_lora, H, dq)
    blocks[l].w_uk          (H, kv_lora, dn)  key up-projection (kv_b_proj split per head)
    blocks[l].w_uv          (H, kv_lora, dv)  value up-projection
    blocks[l].w_o           (H, dv, D)
    dense block:  w13 (D, 2I) = [gate | up],  w2 (I, D)
    MoE block:    w_router (D, E), router_bias (E,), e_w1 / e_w3 (E, D, I_moe), e_w2 (E, I_moe, D),
                  s_w13 (D, 2 I_sh) = [gate | up], s_w2 (I_sh, D)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "mscale_once",  # softmax scale multiplied by the YaRN mscale(factor, mscale_all_dim) once, not squared
    "yarn_no_truncate",  # YaRN correction range left fractional (no floor/ceil), so the ramp is wrong
    "yarn_attn_factor",  # cos/sin scaled by mscale(factor) instead of mscale(f, mscale)/mscale(f, mscale_all_dim)
    "rope_not_interleaved",  # rope_interleave ignored: rotate_half applied to interleaved (x0,x1) pairs
    "kv_split_order",  # compressed kv split as [k_rope | latent] instead of [latent | k_rope]
    "kv_b_head_axis",  # kv_b_proj out dim unpacked as (dn+dv, H) instead of (H, dn+dv) at load time
    "router_softmax",  # expert affinities by softmax (DeepSeek-V2 style) instead of sigmoid
    "bias_in_weights",  # combine weights gathered from the bias-corrected scores instead of the raw ones
    "group_score_max",  # group score = max affinity of the group instead of sum of its top-2
    "scale_then_norm",  # routed_scaling_factor applied before top-k normalisation (it cancels out)
    "topk_group_misread",  # keeps num_experts_per_tok groups instead of topk_group
    "expert_gate_up_interleaved",  # fused experts.gate_up_proj split as even/odd rows instead of halves
    "positions_first_row",  # rope angles built from position_ids[0] only and broadcast to every row of the batch
    "pad_mask_queries",  # padding mask applied along the query axis instead of the key axis
]

PADDING_ONLY = ["positions_first_row", "pad_mask_queries"]

CLEAN = [
    "absorbed_mla",  # weight-absorbed MLA: q_nope folded through W_uk, attention over the kv latent, W_uv after
    "rope_deinterleave_weights",  # rope columns of W_qb / W_a permuted at load, then rotate_half rope
    "rope_complex",  # rope as complex multiplication by polar(attn_factor, angle) (DeepSeek reference style)
    "dense_moe",  # every expert run on every token, combined with a dense (N, E) scattered weight matrix
    "sdpa",  # F.scaled_dot_product_attention with the explicit scale and an additive mask
]


# --------------------------------------------------------------------------- helpers


def _rms(x, g, eps):
    x32 = x.float()
    return g * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _get_mscale(scale, m=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * m * math.log(scale) + 1.0


def _rope_params(config):
    """(inv_freq (dr/2,), cos/sin attention factor, softmax scale)."""
    rp = dict(config.rope_parameters or {})
    dim = config.qk_rope_head_dim
    base = rp.get("rope_theta", 10000.0)
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    scale = qk_dim**-0.5
    rope_type = rp.get("rope_type", "default")
    extrap = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope_type == "default":
        return extrap, 1.0, scale
    if rope_type != "yarn":
        raise NotImplementedError(rope_type)
    factor = rp.get("factor")
    l0 = rp["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / l0
    mscale = rp.get("mscale")
    mscale_all_dim = rp.get("mscale_all_dim")
    attn_factor = rp.get("attention_factor")
    if attn_factor is None:
        if BUG == "yarn_attn_factor":
            attn_factor = _get_mscale(factor)
        elif mscale and mscale_all_dim:
            attn_factor = _get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim)
        else:
            attn_factor = _get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr(rot):
        return dim * math.log(l0 / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if rp.get("truncate", True) and BUG != "yarn_no_truncate":
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    interp = extrap / factor
    inv_freq = interp * ramp + extrap * (1 - ramp)
    if rp.get("mscale_all_dim"):
        m = _get_mscale(factor, rp["mscale_all_dim"])
        scale = scale * m if BUG == "mscale_once" else scale * m * m
    return inv_freq, float(attn_factor), scale


def _rope(x, angles, factor, layout):
    """x (..., S, dr) with angles (B, S, dr/2) broadcast over the head axis (x is (B, H, S, dr))."""
    cos = torch.cos(angles)[:, None] * factor
    sin = torch.sin(angles)[:, None] * factor
    if layout == "half" or BUG == "rope_not_interleaved":
        # rotate_half layout: pair i is (x_i, x_{i + dr/2})
        c = torch.cat([cos, cos], -1)
        s = torch.cat([sin, sin], -1)
        x1, x2 = x.chunk(2, -1)
        return x * c + torch.cat([-x2, x1], -1) * s
    if BUG == "rope_complex":
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        rot = torch.polar(torch.full_like(angles, factor), angles)[:, None]
        return torch.view_as_real(xc * rot).flatten(-2)
    # interleaved layout, result kept interleaved
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.stack([xe * cos - xo * sin, xo * cos + xe * sin], -1).flatten(-2)


class _Block(nn.Module):
    pass


class DeepseekV3Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cfg = config
        self.H = config.num_attention_heads
        self.dn = config.qk_nope_head_dim
        self.dr = config.qk_rope_head_dim
        self.dv = config.v_head_dim
        self.q_lora = config.q_lora_rank
        self.kv_lora = config.kv_lora_rank
        self.eps = config.rms_norm_eps
        self.rope_layout = "interleaved"
        self.blocks = nn.ModuleList()

    # ------------------------------------------------------------------ attention
    def _attention(self, blk, x, angles, allowed, attn_factor, scale):
        B, S, _ = x.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        a = x @ blk.w_a
        if self.q_lora is not None:
            c_q, a = a.split([self.q_lora, a.shape[-1] - self.q_lora], -1)
            q = torch.einsum("bsr,rhd->bhsd", _rms(c_q, blk.g_q, 1e-6), blk.w_qb)
        else:
            q = torch.einsum("bsd,dhe->bhse", x, blk.w_q)
        if BUG == "kv_split_order":
            k_r, c_kv = a.split([dr, self.kv_lora], -1)
        else:
            c_kv, k_r = a.split([self.kv_lora, dr], -1)
        c_kv = _rms(c_kv, blk.g_kv, 1e-6)  # (B, S, kv_lora)
        q_nope, q_rope = q.split([dn, dr], -1)
        q_rope = _rope(q_rope, angles, attn_factor, self.rope_layout)
        k_r = _rope(k_r[:, None], angles, attn_factor, self.rope_layout)  # (B, 1, S, dr)

        neg = torch.finfo(torch.float32).min
        add_mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, neg)

        if BUG == "absorbed_mla":
            q_lat = torch.einsum("bhsn,hcn->bhsc", q_nope, blk.w_uk)  # (B, H, S, kv_lora)
            scores = torch.einsum("bhsc,btc->bhst", q_lat, c_kv) + q_rope @ k_r.transpose(-1, -2)
            p = torch.softmax(scores * scale + add_mask, -1)
            o_lat = torch.einsum("bhst,btc->bhsc", p, c_kv)
            o = torch.einsum("bhsc,hcv->bhsv", o_lat, blk.w_uv)
        else:
            k_nope = torch.einsum("btc,hcn->bhtn", c_kv, blk.w_uk)
            v = torch.einsum("btc,hcv->bhtv", c_kv, blk.w_uv)
            k = torch.cat([k_nope, k_r.expand(B, H, S, dr)], -1)
            qq = torch.cat([q_nope, q_rope], -1)
            if BUG == "sdpa":
                o = F.scaled_dot_product_attention(qq, k, v, attn_mask=add_mask, scale=scale)
            else:
                scores = qq @ k.transpose(-1, -2) * scale + add_mask
                o = torch.softmax(scores, -1) @ v
        return torch.einsum("bhsv,hvd->bsd", o, blk.w_o)

    # ------------------------------------------------------------------ feed-forward
    @staticmethod
    def _swiglu(x, w13, w2):
        g, u = (x @ w13).chunk(2, -1)
        return (F.silu(g) * u) @ w2

    def _route(self, blk, x):
        cfg = self.cfg
        E, K, G = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
        logits = x.float() @ blk.w_router.float()
        scores = torch.softmax(logits, -1) if BUG == "router_softmax" else torch.sigmoid(logits)
        choice = scores + blk.router_bias
        grouped = choice.view(-1, G, E // G)
        if BUG == "group_score_max":
            gscore = grouped.max(-1).values
        else:
            gscore = grouped.topk(min(2, E // G), -1).values.sum(-1)
        n_keep = K if BUG == "topk_group_misread" else cfg.topk_group
        keep = gscore.topk(n_keep, -1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter(1, keep, True)
        emask = gmask[:, :, None].expand(-1, G, E // G).reshape(-1, E)
        idx = choice.masked_fill(~emask, float("-inf")).topk(K, -1).indices
        w = (choice if BUG == "bias_in_weights" else scores).gather(1, idx)
        if BUG == "scale_then_norm":
            w = w * cfg.routed_scaling_factor
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if BUG != "scale_then_norm":
            w = w * cfg.routed_scaling_factor
        return idx, w

    def _moe(self, blk, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self._route(blk, x)
        E = blk.e_w1.shape[0]
        if BUG == "dense_moe":
            dense_w = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter_add(1, idx, w.to(x.dtype))
            h = F.silu(torch.einsum("nd,edi->eni", x, blk.e_w1)) * torch.einsum("nd,edi->eni", x, blk.e_w3)
            y = torch.einsum("eni,eid->end", h, blk.e_w2)
            out = torch.einsum("end,ne->nd", y, dense_w)
        else:
            out = torch.zeros_like(x)
            for e in range(E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel() == 0:
                    continue
                xe = x[tok]
                ye = (F.silu(xe @ blk.e_w1[e]) * (xe @ blk.e_w3[e])) @ blk.e_w2[e]
                out.index_add_(0, tok, ye * w[tok, slot, None])
        out = out + self._swiglu(x, blk.s_w13, blk.s_w2)
        return out.view(shape)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        inv_freq, attn_factor, scale = _rope_params(self.cfg)
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        elif BUG == "positions_first_row":
            position_ids = position_ids[:1].expand(B, S)
        angles = position_ids.float()[..., None] * inv_freq  # (B, S, dr/2)

        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            valid = attention_mask.bool()
            if BUG == "pad_mask_queries":
                allowed = allowed & valid[:, None, :, None]
            else:
                allowed = allowed & valid[:, None, None, :]

        x = self.tok_emb[input_ids]
        for blk in self.blocks:
            x = x + self._attention(blk, _rms(x, blk.g_in, self.eps), angles, allowed, attn_factor, scale)
            h = _rms(x, blk.g_post, self.eps)
            x = x + (self._moe(blk, h) if blk.is_moe else self._swiglu(h, blk.w13, blk.w2))
        return _rms(x, self.out_norm, self.eps) @ self.head


# --------------------------------------------------------------------------- loading


def _deinterleave_perm(dr):
    return torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])


def build(state_dict, config):
    sd = {k: v.float() for k, v in state_dict.items()}
    m = DeepseekV3Port(config)
    H, dn, dr, dv = m.H, m.dn, m.dr, m.dv
    dq = dn + dr
    P = nn.Parameter
    deint = BUG == "rope_deinterleave_weights"
    if deint:
        m.rope_layout = "half"
    perm = _deinterleave_perm(dr)

    m.tok_emb = P(sd["model.embed_tokens.weight"])
    m.head = P(sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).t().contiguous())
    m.out_norm = P(sd["model.norm.weight"])
    if getattr(config, "attention_bias", False):
        raise NotImplementedError("attention_bias")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        blk = _Block()
        blk.g_in = P(sd[p + "input_layernorm.weight"])
        blk.g_post = P(sd[p + "post_attention_layernorm.weight"])

        kv_a = sd[a + "kv_a_proj_with_mqa.weight"]  # (kv_lora + dr, D)
        if deint:
            kv_a = torch.cat([kv_a[: m.kv_lora], kv_a[m.kv_lora :][perm]], 0)
        if m.q_lora is not None:
            blk.w_a = P(torch.cat([sd[a + "q_a_proj.weight"], kv_a], 0).t().contiguous())
            blk.g_q = P(sd[a + "q_a_layernorm.weight"])
            wqb = sd[a + "q_b_proj.weight"].view(H, dq, m.q_lora)
            if deint:
                wqb = torch.cat([wqb[:, :dn], wqb[:, dn:][:, perm]], 1)
            blk.w_qb = P(wqb.permute(2, 0, 1).contiguous())  # (q_lora, H, dq)
        else:
            blk.w_a = P(kv_a.t().contiguous())
            wq = sd[a + "q_proj.weight"].view(H, dq, -1)
            if deint:
                wq = torch.cat([wq[:, :dn], wq[:, dn:][:, perm]], 1)
            blk.w_q = P(wq.permute(2, 0, 1).contiguous())  # (D, H, dq)
        blk.g_kv = P(sd[a + "kv_a_layernorm.weight"])
        kvb = sd[a + "kv_b_proj.weight"]  # (H * (dn + dv), kv_lora)
        if BUG == "kv_b_head_axis":
            kvb = kvb.view(dn + dv, H, m.kv_lora).transpose(0, 1)
        else:
            kvb = kvb.view(H, dn + dv, m.kv_lora)
        blk.w_uk = P(kvb[:, :dn].transpose(1, 2).contiguous())  # (H, kv_lora, dn)
        blk.w_uv = P(kvb[:, dn:].transpose(1, 2).contiguous())  # (H, kv_lora, dv)
        blk.w_o = P(sd[a + "o_proj.weight"].t().reshape(H, dv, -1).contiguous())  # (H, dv, D)

        if p + "mlp.gate.weight" in sd:
            blk.is_moe = True
            blk.w_router = P(sd[p + "mlp.gate.weight"].t().contiguous())
            blk.register_buffer("router_bias", sd[p + "mlp.gate.e_score_correction_bias"].clone())
            gu = sd[p + "mlp.experts.gate_up_proj"]  # (E, 2 I, D)
            inter = gu.shape[1] // 2
            if BUG == "expert_gate_up_interleaved":
                gate, up = gu[:, 0::2], gu[:, 1::2]
            else:
                gate, up = gu[:, :inter], gu[:, inter:]
            blk.e_w1 = P(gate.transpose(1, 2).contiguous())
            blk.e_w3 = P(up.transpose(1, 2).contiguous())
            blk.e_w2 = P(sd[p + "mlp.experts.down_proj"].transpose(1, 2).contiguous())
            s = p + "mlp.shared_experts."
            blk.s_w13 = P(torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]], 0).t().contiguous())
            blk.s_w2 = P(sd[s + "down_proj.weight"].t().contiguous())
        else:
            blk.is_moe = False
            blk.w13 = P(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], 0).t().contiguous())
            blk.w2 = P(sd[p + "mlp.down_proj.weight"].t().contiguous())
        m.blocks.append(blk)
    return m.float().eval()
