"""Hand-written plain-PyTorch port of DeepSeek-V2 (DeepseekV2ForCausalLM): MLA attention + DeepSeekMoE.

Architecture as this port implements it:
- token embedding (no scaling); L pre-norm blocks; final RMSNorm (config.rms_norm_eps); untied LM head.
- block: h = h + MLA(RMSNorm(h)); h = h + FFN(RMSNorm(h)); the first `first_k_dense_replace` blocks use a dense SwiGLU
  FFN (intermediate_size), the others a MoE.
- MLA (multi-head latent attention), nh heads, per head a query/key of nope + rope dims and a value of v_head_dim:
  q LoRA: c_q = RMSNorm_1e-6(x W_qa + b_qa) (gain q_a_layernorm), q = c_q W_qb (per head [nope | rope]) (without a q
  LoRA: q = x W_q);  kv_a_proj_with_mqa: [c_kv | k_rope] = x W_kva + b_kva; c = RMSNorm_1e-6(c_kv) (gain
  kv_a_layernorm); kv_b_proj: per head [k_nope | v] = c W_kvb; k_rope is one head shared by all heads.
  RoPE on q_rope and k_rope only, in the INTERLEAVED convention (pairs (2i, 2i+1), as Transformers' complex
  `apply_rotary_emb`), with YaRN frequencies; YaRN's attention factor (mscale(f, mscale) / mscale(f, mscale_all_dim))
  multiplies the rotation of both q_rope and k_rope. score = (q_nope.k_nope + q_rope.k_rope) * s with
  s = (nope + rope)^-1/2 * mscale(f, mscale_all_dim)^2; causal + padding mask; o_proj (with bias if attention_bias).
- MoE: router logits = x W_r^T (float32), p = softmax; "greedy": top-k of p; "group_limited_greedy": groups of
  E / n_group experts scored by their max p, the top `topk_group` groups kept, others' p set to 0, then top-k.
  weights = p_topk * routed_scaling_factor (no renormalisation). Experts: SwiGLU, down(silu(gate x) * up x);
  plus the shared experts, one SwiGLU of n_shared_experts * moe_intermediate_size, on every token.
- positions: `position_ids`, else 0..S-1. Padding queries may see themselves only (their outputs are never used).

Layouts (BUG selects one; every one is a correct port):
- "" (baseline): MLA paper names, every matrix TRANSPOSED (x @ W): w_dq (H, rq), w_uq (rq, nh, nope) and w_qr
  (rq, nh, rope) split out of q_b_proj; kv_a_proj_with_mqa split into w_dkv (H, r) and w_kr (H, rope) with their
  biases; kv_b_proj split per head into w_uk (nh, nope, r) and w_uv (nh, v, r), applied by einsum; RoPE as
  rotate-every-two (GPT-J) with real cos/sin tables for all positions, YaRN's attention factor folded into the
  tables, the softmax scale precomputed; experts as 3-D tensors (E, H, I) gate / up and (E, I, H) down, computed by a
  per-token gather of the chosen experts' weights; router weight transposed (H, E); dense FFN transposed.
- ds_absorbed_mla: W_uk absorbed into the query (q_lat = q_nope W_uk, scores against the latent c directly), the
  attention output taken in latent space and W_uv applied afterwards (DeepSeek's "absorb" inference); RoPE as a
  complex multiplication by a precomputed complex `freqs_cis` buffer.
- ds_rotate_half_rope: nn.Linear (out x in) weights as in the checkpoint but the rope rows of q_b_proj and of
  kv_a_proj_with_mqa de-interleaved at load so that RoPE is the rotate-half (NeoX) form; keys built by concatenating
  [k_nope, k_rope] and a plain multi-head attention on the 24-dim heads.
- ds_dense_moe_einsum: every expert run on every token by einsum over a fused (E, H, 2I) [gate | up] tensor and mixed
  by a dense (tokens, E) weight matrix; router chosen on the logits (groups by max logit, top-k of masked logits,
  weight = exp(logit - logsumexp)).
- ds_sorted_dispatch: tokens sorted by expert (argsort), each expert run on its contiguous segment, results
  index_add'ed back; experts fused as (E, 2I, H) [up | gate] (out x in); group mask applied with -inf.
- ds_stacked_layers: attention weights stacked over all layers ((L, ...)), expert weights stacked over the MoE layers
  ((L_moe, E, ...)), indexed in a loop.
- ds_folded_scales: every RMSNorm gain folded into the next projection(s) (input norm into w_dq / w_dkv / w_kr,
  q_a norm into w_uq / w_qr, kv_a norm into w_uk / w_uv, post-attention norm into router / experts / shared / dense,
  final norm into the head); softmax scale folded into w_uq and scale * attention_factor^2 into w_qr.
- ds_functional_sdpa: one functional forward over a flat ParameterDict (checkpoint out x in layouts), SDPA with a
  boolean mask, positions recomputed from the attention mask, experts in a per-expert loop.
- ds_fused_shared_experts: the shared experts split into n_shared_experts experts of moe_intermediate_size and
  appended to the routed ones (always chosen, weight 1), gate / up INTERLEAVED column by column ([g0, u0, g1, ...]) in
  one (E + n_shared, H, 2I) tensor.
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
    "ds_absorbed_mla",  # W_uk absorbed into the query, attention in latent space, W_uv after; complex freqs_cis RoPE
    "ds_rotate_half_rope",  # out x in weights with the rope rows de-interleaved at load; rotate-half RoPE; concat keys
    "ds_dense_moe_einsum",  # all experts on all tokens via einsum, dense mixing matrix; router chosen on logits
    "ds_sorted_dispatch",  # tokens sorted by expert, contiguous segments, index_add back; (E, 2I, H) [up | gate]
    "ds_stacked_layers",  # (L, ...) attention tensors and (L_moe, E, ...) expert tensors indexed in a loop
    "ds_folded_scales",  # RMSNorm gains folded into next projections; softmax scale / YaRN factor folded into q
    "ds_functional_sdpa",  # functional forward over a flat ParameterDict; SDPA, bool mask, positions from the mask
    "ds_fused_shared_experts",  # shared experts appended as always-on experts; gate/up interleaved per column
]


# --------------------------------------------------------------------------------------------------- helpers
def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope_setup(config, dim):
    """(inv_freq, attention_factor, softmax_scale_multiplier) for default or YaRN RoPE."""
    rp = dict(config.rope_parameters or {})
    base = rp.get("rope_theta", 10000.0)
    kind = rp.get("rope_type", "default")
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv, 1.0, 1.0
    assert kind == "yarn", kind
    factor = rp.get("factor") or config.max_position_embeddings / rp["original_max_position_embeddings"]
    old = rp["original_max_position_embeddings"]
    ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
    af = rp.get("attention_factor")
    if af is None:
        af = _mscale(factor, ms) / _mscale(factor, msa) if (ms and msa) else _mscale(factor)
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr(rot):
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr(fast), corr(slow)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    mult = _mscale(rp["factor"], msa) ** 2 if msa else 1.0
    return inv, float(af), mult


def _positions(input_ids, position_ids):
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    return position_ids


def _keep(attention_mask, s, device):
    """bool (b or 1, 1, s, s): key j visible to query i (causal, not padding); a query always sees itself."""
    idx = torch.arange(s, device=device)
    keep = (idx[None, :] <= idx[:, None])[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.bool()[:, None, None, :]
    return keep | torch.eye(s, dtype=torch.bool, device=device)


def _additive(keep):
    return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, torch.finfo(torch.float32).min)


def _rope_every_two(x, cos, sin):
    """Interleaved RoPE with real arithmetic; x (..., s, heads, d), cos/sin (b, s, 1, d/2)."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Cfg:
    def __init__(self, sd, config):
        self.H = config.hidden_size
        self.nh = config.num_attention_heads
        self.L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.rq = config.q_lora_rank
        self.r = config.kv_lora_rank
        self.nope, self.rope, self.vd = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.max_pos = config.max_position_embeddings
        self.k_dense = config.first_k_dense_replace
        self.E = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.method = config.topk_method
        self.G, self.TG = config.n_group, config.topk_group
        self.rsf = config.routed_scaling_factor
        self.n_shared = config.n_shared_experts
        self.inv_freq, self.af, mult = _rope_setup(config, self.rope)
        self.scale = (self.nope + self.rope) ** -0.5 * mult


def _g(sd, name, i=None):
    return sd[name if i is None else f"model.layers.{i}.{name}"].detach().float().clone()


def _opt(sd, name, i, rows):
    key = f"model.layers.{i}.{name}"
    return _g(sd, key) if key in sd else torch.zeros(rows)


def _head(sd):
    return _g(sd, "lm_head.weight") if "lm_head.weight" in sd else _g(sd, "model.embed_tokens.weight")


def _mla_weights(sd, c, i):
    """The checkpoint's MLA tensors split the MLA-paper way (out x in, per head)."""
    nh, nope, rope, vd, H = c.nh, c.nope, c.rope, c.vd, c.H
    w = {}
    if c.rq is not None:
        w["dq"] = _g(sd, "self_attn.q_a_proj.weight", i)  # (rq, H)
        w["b_dq"] = _opt(sd, "self_attn.q_a_proj.bias", i, c.rq)
        w["g_q"] = _g(sd, "self_attn.q_a_layernorm.weight", i)
        qb = _g(sd, "self_attn.q_b_proj.weight", i).view(nh, nope + rope, c.rq)
    else:
        qb = _g(sd, "self_attn.q_proj.weight", i).view(nh, nope + rope, H)
    w["uq"], w["qr"] = qb[:, :nope], qb[:, nope:]  # (nh, nope, in), (nh, rope, in)
    kva = _g(sd, "self_attn.kv_a_proj_with_mqa.weight", i)
    bkva = _opt(sd, "self_attn.kv_a_proj_with_mqa.bias", i, c.r + rope)
    w["dkv"], w["kr"], w["b_dkv"], w["b_kr"] = kva[: c.r], kva[c.r :], bkva[: c.r], bkva[c.r :]
    w["g_kv"] = _g(sd, "self_attn.kv_a_layernorm.weight", i)
    kvb = _g(sd, "self_attn.kv_b_proj.weight", i).view(nh, nope + vd, c.r)
    w["uk"], w["uv"] = kvb[:, :nope], kvb[:, nope:]  # (nh, nope, r), (nh, vd, r)
    w["o"] = _g(sd, "self_attn.o_proj.weight", i)  # (H, nh vd)
    w["b_o"] = _opt(sd, "self_attn.o_proj.bias", i, H)
    w["g_in"] = _g(sd, "input_layernorm.weight", i)
    w["g_post"] = _g(sd, "post_attention_layernorm.weight", i)
    return w


def _moe_weights(sd, c, i):
    p = f"model.layers.{i}.mlp."
    gu = _g(sd, p + "experts.gate_up_proj")  # (E, 2I, H)
    I = gu.shape[1] // 2
    return dict(
        router=_g(sd, p + "gate.weight"),  # (E, H)
        gate=gu[:, :I],  # (E, I, H)
        up=gu[:, I:],
        down=_g(sd, p + "experts.down_proj"),  # (E, H, I)
        s_gate=_g(sd, p + "shared_experts.gate_proj.weight"),
        s_up=_g(sd, p + "shared_experts.up_proj.weight"),
        s_down=_g(sd, p + "shared_experts.down_proj.weight"),
    )


def _dense_weights(sd, i):
    p = f"model.layers.{i}.mlp."
    return {n: _g(sd, p + f"{n}_proj.weight") for n in ("gate", "up", "down")}


def _route(logits, c, exact_from_logits=False, neg_inf_mask=False):
    """(T, E) float32 router logits -> (indices (T, k), weights (T, k)) as DeepSeek-V2 chooses them."""
    T = logits.shape[0]
    if exact_from_logits:
        base = logits
    else:
        base = logits.softmax(-1)
    if c.method == "group_limited_greedy":
        grp = base.view(T, c.G, -1).amax(-1)
        top_groups = grp.topk(c.TG, dim=-1).indices
        gmask = torch.zeros_like(grp, dtype=torch.bool).scatter(1, top_groups, True)
        gmask = gmask[:, :, None].expand(T, c.G, c.E // c.G).reshape(T, c.E)
        fill = float("-inf") if (exact_from_logits or neg_inf_mask) else 0.0
        base = base.masked_fill(~gmask, fill)
    vals, idx = base.topk(c.top_k, dim=-1)
    if exact_from_logits:
        vals = torch.exp(vals - logits.logsumexp(-1, keepdim=True))
    return idx, vals * c.rsf


def _swiglu_t(x, wg, wu, wd):
    """Transposed SwiGLU: x @ (H, I) weights."""
    return (F.silu(x @ wg) * (x @ wu)) @ wd


# ------------------------------------------------------------------------------------ module-tree ports
class MLA(nn.Module):
    def __init__(self, w, c, variant):
        super().__init__()
        self.c, self.v = c, variant
        nh, nope, rope = c.nh, c.nope, c.rope
        if variant == "ds_rotate_half_rope":
            perm = torch.arange(rope).view(rope // 2, 2).t().reshape(-1)  # interleaved -> halves
            qb = torch.cat([w["uq"], w["qr"][:, perm]], 1).reshape(nh * (nope + rope), -1)
            if c.rq is not None:
                self.q_a = nn.Parameter(w["dq"])
                self.q_a_bias = nn.Parameter(w["b_dq"])
                self.q_a_norm = nn.Parameter(w["g_q"])
            self.q_b = nn.Parameter(qb)
            self.kv_a = nn.Parameter(torch.cat([w["dkv"], w["kr"][perm]], 0))
            self.kv_a_bias = nn.Parameter(torch.cat([w["b_dkv"], w["b_kr"][perm]]))
            self.kv_a_norm = nn.Parameter(w["g_kv"])
            self.kv_b = nn.Parameter(torch.cat([w["uk"], w["uv"]], 1).reshape(-1, c.r))
            self.o = nn.Parameter(w["o"])
            self.o_bias = nn.Parameter(w["b_o"])
            return
        uq, qr, uk, uv = w["uq"], w["qr"], w["uk"], w["uv"]
        dq, dkv, kr = w.get("dq"), w["dkv"], w["kr"]
        if variant == "ds_folded_scales":
            g = w["g_in"]
            if dq is not None:
                dq = dq * g
                uq, qr = uq * w["g_q"], qr * w["g_q"]
            else:
                uq, qr = uq * g, qr * g
            dkv, kr = dkv * g, kr * g
            uk, uv = uk * w["g_kv"], uv * w["g_kv"]
            uq, qr = uq * c.scale, qr * (c.scale * c.af**2)
        if dq is not None:
            self.w_dq = nn.Parameter(dq.t().contiguous())  # (H, rq)
            self.b_dq = nn.Parameter(w["b_dq"])
            if variant != "ds_folded_scales":
                self.g_q = nn.Parameter(w["g_q"])
        self.w_uq = nn.Parameter(uq.permute(2, 0, 1).contiguous())  # (in, nh, nope)
        self.w_qr = nn.Parameter(qr.permute(2, 0, 1).contiguous())  # (in, nh, rope)
        self.w_dkv = nn.Parameter(dkv.t().contiguous())  # (H, r)
        self.b_dkv = nn.Parameter(w["b_dkv"])
        self.w_kr = nn.Parameter(kr.t().contiguous())  # (H, rope)
        self.b_kr = nn.Parameter(w["b_kr"])
        if variant != "ds_folded_scales":
            self.g_kv = nn.Parameter(w["g_kv"])
        self.w_uk = nn.Parameter(uk.contiguous())  # (nh, nope, r)
        self.w_uv = nn.Parameter(uv.contiguous())  # (nh, vd, r)
        self.w_o = nn.Parameter(w["o"].t().contiguous())  # (nh vd, H)
        self.b_o = nn.Parameter(w["b_o"])

    def forward(self, x, rope, keep):
        c, v = self.c, self.v
        b, s, _ = x.shape
        nh, nope, rd, vd = c.nh, c.nope, c.rope, c.vd
        if v == "ds_rotate_half_rope":
            cq = x
            if c.rq is not None:
                cq = _rms(F.linear(x, self.q_a, self.q_a_bias), 1e-6) * self.q_a_norm
            q = F.linear(cq, self.q_b).view(b, s, nh, nope + rd)
            q_nope, q_pe = q.split([nope, rd], -1)
            c_kv, k_pe = F.linear(x, self.kv_a, self.kv_a_bias).split([c.r, rd], -1)
            kv = F.linear(_rms(c_kv, 1e-6) * self.kv_a_norm, self.kv_b).view(b, s, nh, nope + vd)
            k_nope, val = kv.split([nope, vd], -1)
            cos, sin = rope
            q_pe = q_pe * cos + _rotate_half(q_pe) * sin
            k_pe = k_pe[:, :, None] * cos + _rotate_half(k_pe[:, :, None]) * sin
            qh = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
            kh = torch.cat([k_nope, k_pe.expand(b, s, nh, rd)], -1).transpose(1, 2)
            att = (qh @ kh.transpose(-1, -2)) * c.scale + _additive(keep)
            o = (att.softmax(-1) @ val.transpose(1, 2)).transpose(1, 2).reshape(b, s, nh * vd)
            return F.linear(o, self.o, self.o_bias)
        folded = v == "ds_folded_scales"
        if c.rq is not None:
            cq = x @ self.w_dq + self.b_dq
            cq = _rms(cq, 1e-6) if folded else _rms(cq, 1e-6) * self.g_q
        else:
            cq = x
        q_nope = torch.einsum("bsr,rnd->bsnd", cq, self.w_uq)
        q_pe = torch.einsum("bsr,rnd->bsnd", cq, self.w_qr)
        lat = _rms(x @ self.w_dkv + self.b_dkv, 1e-6)
        if not folded:
            lat = lat * self.g_kv
        k_pe = (x @ self.w_kr + self.b_kr)[:, :, None]  # (b, s, 1, rope)
        if v == "ds_absorbed_mla":
            fc = rope[:, :, None]
            q_pe = torch.view_as_real(torch.view_as_complex(q_pe.unflatten(-1, (-1, 2)).contiguous()) * fc).flatten(-2)
            k_pe = torch.view_as_real(torch.view_as_complex(k_pe.unflatten(-1, (-1, 2)).contiguous()) * fc).flatten(-2)
            q_lat = torch.einsum("bsnd,ndr->bsnr", q_nope, self.w_uk)
            scores = torch.einsum("bqnr,bkr->bnqk", q_lat, lat) + torch.einsum("bqnd,bkd->bnqk", q_pe, k_pe[:, :, 0])
            p = (scores * c.scale + _additive(keep)).softmax(-1)
            o_lat = torch.einsum("bnqk,bkr->bqnr", p, lat)
            o = torch.einsum("bqnr,ndr->bqnd", o_lat, self.w_uv)
        else:
            cos, sin = rope
            q_pe, k_pe = _rope_every_two(q_pe, cos, sin), _rope_every_two(k_pe, cos, sin)
            k_nope = torch.einsum("bsr,ndr->bsnd", lat, self.w_uk)
            val = torch.einsum("bsr,ndr->bsnd", lat, self.w_uv)
            scores = torch.einsum("bqnd,bknd->bnqk", q_nope, k_nope) + torch.einsum(
                "bqnd,bkd->bnqk", q_pe, k_pe[:, :, 0]
            )
            if not folded:
                scores = scores * c.scale
            p = (scores + _additive(keep)).softmax(-1)
            o = torch.einsum("bnqk,bknd->bqnd", p, val)
        return o.reshape(b, s, nh * vd) @ self.w_o + self.b_o


class DenseFFN(nn.Module):
    def __init__(self, w, g_post, variant):
        super().__init__()
        f = g_post if variant == "ds_folded_scales" else 1.0
        self.w_gate = nn.Parameter((w["gate"] * f).t().contiguous())
        self.w_up = nn.Parameter((w["up"] * f).t().contiguous())
        self.w_down = nn.Parameter(w["down"].t().contiguous())

    def forward(self, x):
        return _swiglu_t(x, self.w_gate, self.w_up, self.w_down)


class MoE(nn.Module):
    def __init__(self, w, c, g_post, variant):
        super().__init__()
        self.c, self.v = c, variant
        f = g_post if variant == "ds_folded_scales" else torch.ones(c.H)
        router, gate, up, down = w["router"] * f, w["gate"] * f, w["up"] * f, w["down"]
        s_gate, s_up, s_down = w["s_gate"] * f, w["s_up"] * f, w["s_down"]
        I = gate.shape[1]
        if variant == "ds_sorted_dispatch":
            self.router = nn.Parameter(router)
            self.w31 = nn.Parameter(torch.cat([up, gate], 1))  # (E, 2I, H) [up | gate]
            self.w2 = nn.Parameter(down)  # (E, H, I)
        elif variant == "ds_dense_moe_einsum":
            self.router = nn.Parameter(router.t().contiguous())
            self.w13 = nn.Parameter(torch.cat([gate, up], 1).transpose(1, 2).contiguous())  # (E, H, 2I)
            self.w2 = nn.Parameter(down.transpose(1, 2).contiguous())  # (E, I, H)
        elif variant == "ds_fused_shared_experts":
            ns = c.n_shared
            sg, su = s_gate.view(ns, I, c.H), s_up.view(ns, I, c.H)
            sdn = s_down.view(c.H, ns, I).transpose(0, 1)  # (ns, H, I)
            g_all, u_all = torch.cat([gate, sg]), torch.cat([up, su])  # (E + ns, I, H)
            inter = torch.stack([g_all, u_all], 2).reshape(c.E + ns, 2 * I, c.H)  # rows g0, u0, g1, u1, ...
            self.router = nn.Parameter(router.t().contiguous())  # (H, E)
            self.w13 = nn.Parameter(inter.transpose(1, 2).contiguous())  # (E + ns, H, 2I) interleaved
            self.w2 = nn.Parameter(torch.cat([down, sdn]).transpose(1, 2).contiguous())  # (E + ns, I, H)
            return
        else:
            self.router = nn.Parameter(router.t().contiguous())  # (H, E)
            self.w_gate = nn.Parameter(gate.transpose(1, 2).contiguous())  # (E, H, I)
            self.w_up = nn.Parameter(up.transpose(1, 2).contiguous())
            self.w_down = nn.Parameter(down.transpose(1, 2).contiguous())  # (E, I, H)
        self.s_gate = nn.Parameter(s_gate.t().contiguous())
        self.s_up = nn.Parameter(s_up.t().contiguous())
        self.s_down = nn.Parameter(s_down.t().contiguous())

    def forward(self, x):
        c, v = self.c, self.v
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T = x.shape[0]
        if v == "ds_sorted_dispatch":
            logits = F.linear(x.float(), self.router.float())
            idx, wts = _route(logits, c, neg_inf_mask=True)
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)
            tok = order // c.top_k
            counts = torch.bincount(flat, minlength=c.E).tolist()
            xs, ws = x[tok], wts.reshape(-1)[order]
            out = torch.zeros_like(x)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    seg = xs[start : start + n]
                    u, g = F.linear(seg, self.w31[e]).chunk(2, -1)
                    y = F.linear(F.silu(g) * u, self.w2[e]) * ws[start : start + n, None]
                    out.index_add_(0, tok[start : start + n], y)
                start += n
        elif v == "ds_dense_moe_einsum":
            logits = x.float() @ self.router.float()
            idx, wts = _route(logits, c, exact_from_logits=True)
            mix = torch.zeros(T, c.E, dtype=x.dtype, device=x.device).scatter(1, idx, wts)
            g, u = torch.einsum("th,ehi->tei", x, self.w13).chunk(2, -1)
            y = torch.einsum("tei,eih->teh", F.silu(g) * u, self.w2)
            out = torch.einsum("teh,te->th", y, mix)
        elif v == "ds_fused_shared_experts":
            logits = x.float() @ self.router.float()
            idx, wts = _route(logits, c)
            shared = torch.arange(c.E, c.E + c.n_shared, device=x.device).expand(T, -1)
            idx = torch.cat([idx, shared], 1)
            wts = torch.cat([wts, torch.ones(T, c.n_shared, dtype=wts.dtype, device=x.device)], 1)
            gu = torch.einsum("th,tkhi->tki", x, self.w13[idx])
            h = F.silu(gu[..., 0::2]) * gu[..., 1::2]
            y = torch.einsum("tki,tkih->tkh", h, self.w2[idx])
            return (y * wts[..., None]).sum(1).view(shape)
        else:
            logits = x.float() @ self.router.float()
            idx, wts = _route(logits, c)
            g = torch.einsum("th,tkhi->tki", x, self.w_gate[idx])
            u = torch.einsum("th,tkhi->tki", x, self.w_up[idx])
            y = torch.einsum("tki,tkih->tkh", F.silu(g) * u, self.w_down[idx])
            out = (y * wts[..., None]).sum(1)
        return (out + _swiglu_t(x, self.s_gate, self.s_up, self.s_down)).view(shape)


class Block(nn.Module):
    def __init__(self, sd, c, i, variant):
        super().__init__()
        self.c, self.v = c, variant
        w = _mla_weights(sd, c, i)
        self.attn = MLA(w, c, variant)
        if variant != "ds_folded_scales":
            self.attn_norm = nn.Parameter(w["g_in"])
            self.ffn_norm = nn.Parameter(w["g_post"])
        if i < c.k_dense:
            self.ffn = DenseFFN(_dense_weights(sd, i), w["g_post"], variant)
        else:
            self.ffn = MoE(_moe_weights(sd, c, i), c, w["g_post"], variant)

    def forward(self, h, rope, keep):
        eps = self.c.eps
        folded = self.v == "ds_folded_scales"
        x = _rms(h, eps) if folded else _rms(h, eps) * self.attn_norm
        h = h + self.attn(x, rope, keep)
        x = _rms(h, eps) if folded else _rms(h, eps) * self.ffn_norm
        return h + self.ffn(x)


class DeepseekV2Port(nn.Module):
    def __init__(self, sd, config, variant):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        self.v = variant
        self.tok_emb = nn.Parameter(_g(sd, "model.embed_tokens.weight"))
        self.blocks = nn.ModuleList([Block(sd, c, i, variant) for i in range(c.L)])
        gn, head = _g(sd, "model.norm.weight"), _head(sd)
        if variant == "ds_folded_scales":
            head = head * gn
        else:
            self.norm_f = nn.Parameter(gn)
        self.w_head = nn.Parameter(head.t().contiguous())
        freqs = torch.outer(torch.arange(c.max_pos, dtype=torch.float32), c.inv_freq)
        if variant == "ds_absorbed_mla":
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs) * c.af, persistent=False)
        elif variant == "ds_rotate_half_rope":
            emb = torch.cat([freqs, freqs], -1)
            self.register_buffer("cos_t", emb.cos() * c.af, persistent=False)
            self.register_buffer("sin_t", emb.sin() * c.af, persistent=False)
        else:
            af = 1.0 if variant == "ds_folded_scales" else c.af  # folded into w_qr instead
            self.register_buffer("cos_t", freqs.cos() * af, persistent=False)
            self.register_buffer("sin_t", freqs.sin() * af, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        s = input_ids.shape[1]
        pos = _positions(input_ids, position_ids)
        if self.v == "ds_absorbed_mla":
            rope = self.freqs_cis[pos]
        else:
            rope = (self.cos_t[pos][:, :, None], self.sin_t[pos][:, :, None])
        keep = _keep(attention_mask, s, input_ids.device)
        h = self.tok_emb[input_ids]
        for blk in self.blocks:
            h = blk(h, rope, keep)
        h = _rms(h, self.c.eps)
        if self.v != "ds_folded_scales":
            h = h * self.norm_f
        return (h @ self.w_head).float()


# ------------------------------------------------------------------------------------ stacked layers
class DeepseekV2Stacked(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        assert c.rq is not None, "this layout stores the q LoRA"
        ws = [_mla_weights(sd, c, i) for i in range(c.L)]
        st = lambda k, f=lambda t: t: nn.Parameter(torch.stack([f(w[k]) for w in ws]).contiguous())
        self.emb = nn.Parameter(_g(sd, "model.embed_tokens.weight"))
        self.g_in, self.g_post = st("g_in"), st("g_post")
        self.W_dq, self.b_dq, self.g_q = st("dq", lambda t: t.t()), st("b_dq"), st("g_q")
        self.W_uq = st("uq", lambda t: t.permute(2, 0, 1))  # (L, rq, nh, nope)
        self.W_qr = st("qr", lambda t: t.permute(2, 0, 1))
        self.W_dkv, self.b_dkv, self.g_kv = st("dkv", lambda t: t.t()), st("b_dkv"), st("g_kv")
        self.W_kr, self.b_kr = st("kr", lambda t: t.t()), st("b_kr")
        self.W_uk, self.W_uv = st("uk"), st("uv")
        self.W_o, self.b_o = st("o", lambda t: t.t()), st("b_o")
        self.n_dense = c.k_dense
        dense = [_dense_weights(sd, i) for i in range(c.k_dense)]
        if dense:
            self.D_gate = nn.Parameter(torch.stack([d["gate"].t() for d in dense]).contiguous())
            self.D_up = nn.Parameter(torch.stack([d["up"].t() for d in dense]).contiguous())
            self.D_down = nn.Parameter(torch.stack([d["down"].t() for d in dense]).contiguous())
        moe = [_moe_weights(sd, c, i) for i in range(c.k_dense, c.L)]
        if moe:
            self.M_router = nn.Parameter(torch.stack([m["router"].t() for m in moe]).contiguous())  # (Lm, H, E)
            self.M_gate = nn.Parameter(torch.stack([m["gate"].transpose(1, 2) for m in moe]).contiguous())
            self.M_up = nn.Parameter(torch.stack([m["up"].transpose(1, 2) for m in moe]).contiguous())
            self.M_down = nn.Parameter(torch.stack([m["down"].transpose(1, 2) for m in moe]).contiguous())
            self.S_gate = nn.Parameter(torch.stack([m["s_gate"].t() for m in moe]).contiguous())
            self.S_up = nn.Parameter(torch.stack([m["s_up"].t() for m in moe]).contiguous())
            self.S_down = nn.Parameter(torch.stack([m["s_down"].t() for m in moe]).contiguous())
        self.norm_f = nn.Parameter(_g(sd, "model.norm.weight"))
        self.head = nn.Parameter(_head(sd).t().contiguous())
        freqs = torch.outer(torch.arange(c.max_pos, dtype=torch.float32), c.inv_freq)
        self.register_buffer("cos_t", freqs.cos() * c.af, persistent=False)
        self.register_buffer("sin_t", freqs.sin() * c.af, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        b, s = input_ids.shape
        nh, vd = c.nh, c.vd
        pos = _positions(input_ids, position_ids)
        cos, sin = self.cos_t[pos][:, :, None], self.sin_t[pos][:, :, None]
        add = _additive(_keep(attention_mask, s, input_ids.device))
        h = self.emb[input_ids]
        for i in range(c.L):
            x = _rms(h, c.eps) * self.g_in[i]
            cq = _rms(x @ self.W_dq[i] + self.b_dq[i], 1e-6) * self.g_q[i]
            q_nope = torch.einsum("bsr,rnd->bsnd", cq, self.W_uq[i])
            q_pe = _rope_every_two(torch.einsum("bsr,rnd->bsnd", cq, self.W_qr[i]), cos, sin)
            lat = _rms(x @ self.W_dkv[i] + self.b_dkv[i], 1e-6) * self.g_kv[i]
            k_pe = _rope_every_two((x @ self.W_kr[i] + self.b_kr[i])[:, :, None], cos, sin)[:, :, 0]
            k_nope = torch.einsum("bsr,ndr->bsnd", lat, self.W_uk[i])
            val = torch.einsum("bsr,ndr->bsnd", lat, self.W_uv[i])
            sc = torch.einsum("bqnd,bknd->bnqk", q_nope, k_nope) + torch.einsum("bqnd,bkd->bnqk", q_pe, k_pe)
            p = (sc * c.scale + add).softmax(-1)
            o = torch.einsum("bnqk,bknd->bqnd", p, val).reshape(b, s, nh * vd)
            h = h + o @ self.W_o[i] + self.b_o[i]
            x = _rms(h, c.eps) * self.g_post[i]
            if i < self.n_dense:
                h = h + _swiglu_t(x, self.D_gate[i], self.D_up[i], self.D_down[i])
                continue
            j = i - self.n_dense
            xt = x.reshape(-1, c.H)
            idx, wts = _route(xt.float() @ self.M_router[j].float(), c)
            g = torch.einsum("th,tkhi->tki", xt, self.M_gate[j][idx])
            u = torch.einsum("th,tkhi->tki", xt, self.M_up[j][idx])
            y = (torch.einsum("tki,tkih->tkh", F.silu(g) * u, self.M_down[j][idx]) * wts[..., None]).sum(1)
            y = y + _swiglu_t(xt, self.S_gate[j], self.S_up[j], self.S_down[j])
            h = h + y.view(b, s, -1)
        return ((_rms(h, c.eps) * self.norm_f) @ self.head).float()


# ------------------------------------------------------------------------------------ functional port
def deepseek_v2_forward(P, c, input_ids, attention_mask=None, position_ids=None):
    """One functional forward over a flat dict holding the checkpoint's out x in tensors."""
    b, s = input_ids.shape
    nh, nope, rd, vd = c.nh, c.nope, c.rope, c.vd
    am = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)  # positions from the mask, ignoring position_ids
    ang = pos.float()[..., None] * P["inv_freq"]
    cos, sin = (ang.cos() * c.af)[:, :, None], (ang.sin() * c.af)[:, :, None]
    keep = _keep(attention_mask, s, input_ids.device)
    h = F.embedding(input_ids, P["embed"])
    for i in range(c.L):
        p = f"l{i}_"
        x = _rms(h, c.eps) * P[p + "attn_norm"]
        if c.rq is not None:
            cq = _rms(F.linear(x, P[p + "q_a"], P[p + "q_a_b"]), 1e-6) * P[p + "q_a_norm"]
        else:
            cq = x
        q = F.linear(cq, P[p + "q_b"]).view(b, s, nh, nope + rd)
        q_nope, q_pe = q.split([nope, rd], -1)
        c_kv, k_pe = F.linear(x, P[p + "kv_a"], P[p + "kv_a_b"]).split([c.r, rd], -1)
        kv = F.linear(_rms(c_kv, 1e-6) * P[p + "kv_a_norm"], P[p + "kv_b"]).view(b, s, nh, nope + vd)
        k_nope, val = kv.split([nope, vd], -1)
        q_pe = _rope_every_two(q_pe, cos, sin)
        k_pe = _rope_every_two(k_pe[:, :, None], cos, sin).expand(b, s, nh, rd)
        qh = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
        kh = torch.cat([k_nope, k_pe], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, val.transpose(1, 2), attn_mask=keep, scale=c.scale)
        h = h + F.linear(o.transpose(1, 2).reshape(b, s, nh * vd), P[p + "o"], P[p + "o_b"])
        x = _rms(h, c.eps) * P[p + "ffn_norm"]
        if i < c.k_dense:
            h = h + F.linear(F.silu(F.linear(x, P[p + "gate"])) * F.linear(x, P[p + "up"]), P[p + "down"])
            continue
        xt = x.reshape(-1, c.H)
        idx, wts = _route(F.linear(xt.float(), P[p + "router"].float()), c)
        y = torch.zeros_like(xt)
        for e in range(c.E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            g, u = F.linear(xt[tok], P[p + "experts_gate_up"][e]).chunk(2, -1)
            y.index_add_(0, tok, F.linear(F.silu(g) * u, P[p + "experts_down"][e]) * wts[tok, slot, None])
        y = y + F.linear(F.silu(F.linear(xt, P[p + "s_gate"])) * F.linear(xt, P[p + "s_up"]), P[p + "s_down"])
        h = h + y.view(b, s, -1)
    return F.linear(_rms(h, c.eps) * P["norm"], P["lm_head"]).float()


class DeepseekV2Functional(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        P = {"embed": _g(sd, "model.embed_tokens.weight"), "norm": _g(sd, "model.norm.weight"), "lm_head": _head(sd)}
        for i in range(c.L):
            p, a = f"l{i}_", f"model.layers.{i}."
            P[p + "attn_norm"] = _g(sd, "input_layernorm.weight", i)
            P[p + "ffn_norm"] = _g(sd, "post_attention_layernorm.weight", i)
            if c.rq is not None:
                P[p + "q_a"] = _g(sd, "self_attn.q_a_proj.weight", i)
                P[p + "q_a_b"] = _opt(sd, "self_attn.q_a_proj.bias", i, c.rq)
                P[p + "q_a_norm"] = _g(sd, "self_attn.q_a_layernorm.weight", i)
                P[p + "q_b"] = _g(sd, "self_attn.q_b_proj.weight", i)
            else:
                P[p + "q_b"] = _g(sd, "self_attn.q_proj.weight", i)
            P[p + "kv_a"] = _g(sd, "self_attn.kv_a_proj_with_mqa.weight", i)
            P[p + "kv_a_b"] = _opt(sd, "self_attn.kv_a_proj_with_mqa.bias", i, c.r + c.rope)
            P[p + "kv_a_norm"] = _g(sd, "self_attn.kv_a_layernorm.weight", i)
            P[p + "kv_b"] = _g(sd, "self_attn.kv_b_proj.weight", i)
            P[p + "o"] = _g(sd, "self_attn.o_proj.weight", i)
            P[p + "o_b"] = _opt(sd, "self_attn.o_proj.bias", i, c.H)
            if i < c.k_dense:
                for n in ("gate", "up", "down"):
                    P[p + n] = _g(sd, f"mlp.{n}_proj.weight", i)
            else:
                P[p + "router"] = _g(sd, a + "mlp.gate.weight")
                P[p + "experts_gate_up"] = _g(sd, a + "mlp.experts.gate_up_proj")
                P[p + "experts_down"] = _g(sd, a + "mlp.experts.down_proj")
                for n in ("gate", "up", "down"):
                    P[p + "s_" + n] = _g(sd, f"mlp.shared_experts.{n}_proj.weight", i)
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in P.items()})
        self.register_buffer("inv_freq", c.inv_freq, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        P = dict(self.params.items())
        P["inv_freq"] = self.inv_freq
        return deepseek_v2_forward(P, self.c, input_ids, attention_mask, position_ids)


# ------------------------------------------------------------------------------------ entry point
def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN and variant not in BUGS:
        raise ValueError(f"unknown layout variant {variant!r}")
    with torch.no_grad():
        if variant == "ds_stacked_layers":
            model = DeepseekV2Stacked(state_dict, config)
        elif variant == "ds_functional_sdpa":
            model = DeepseekV2Functional(state_dict, config)
        else:
            model = DeepseekV2Port(state_dict, config, variant)
    return model.eval()
