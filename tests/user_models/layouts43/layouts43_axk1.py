"""A hand-written PyTorch port of A.X-K1 (Transformers' ``AXK1ForCausalLM``, model_type ``axk1``), in a baseline
layout and eight other, equivalent layouts.  Nothing here imports ``transformers``: ``build`` reads the config
object's attributes and the checkpoint's tensors (Transformers' parameter names) and re-lays them out.

Architecture (as this port implements it)
-----------------------------------------
Notation: d = hidden_size, H = num_attention_heads, r_q = q_lora_rank, r_kv = kv_lora_rank, dn = qk_nope_head_dim,
dr = qk_rope_head_dim, dv = v_head_dim, E = n_routed_experts, k = num_experts_per_tok, G = n_group,
g = topk_group, rsf = routed_scaling_factor.

    RMS(x; w, eps) = w * x / sqrt(mean(x^2) + eps)            (eps = rms_norm_eps for the block norms, the final
                                                               norm and the MoE output norm; a fixed 1e-6 for the
                                                               two latent norms inside attention)
    x_0 = Embed[ids]
    per layer l:
        h   = RMS(x; w_in)
        # multi-head latent attention (DeepSeek-V3 MLA, always with a query LoRA)
        c_q = RMS(W_qa h; w_qn, 1e-6)                           W_qa: (r_q, d)
        q   = W_qb c_q  -> per head [q_nope (dn) | q_rope (dr)] W_qb: (H*(dn+dr), r_q)
        [c_kv | k_rope] = W_kva h                               W_kva: (r_kv+dr, d), k_rope shared by all heads
        c_kv = RMS(c_kv; w_kvn, 1e-6)
        kv  = W_kvb c_kv -> per head [k_nope (dn) | v (dv)]    W_kvb: (H*(dn+dv), r_kv)
        RoPE on q_rope and k_rope, *interleaved* pairs (x[2j], x[2j+1]) rotated by pos * theta^(-2j/dr)
            (if config.rope_interleave is False the checkpoint holds half-split pairs (x[j], x[j+dr/2]); the loader
             permutes those rows into the interleaved convention, so every layout below sees interleaved pairs)
        score_h(i,j) = (q_nope.k_nope + q_rope.k_rope) / sqrt(dn+dr), causal, padded keys masked
            (a query row always sees itself, so a padding row never becomes all-masked / NaN)
        x  += W_o concat_h(softmax(score_h) v_h)               W_o: (d, H*dv)
        h   = RMS(x; w_post)
        dense layer (mlp_layer_types[l] == "dense"):  x += W_d (silu(W_g h) * W_u h)        (intermediate_size)
        sparse layer: DeepSeek-V3 MoE + an output RMSNorm (A.X-K1's addition):
            s = sigmoid(W_r h)  (E,);  c = s + b  (b = e_score_correction_bias, for the choice only)
            group score = sum of the two largest c in each of G groups of E/G experts; keep the g best groups
            experts = the k largest c among the kept groups;  weight_e = s_e / (sum of chosen s + 1e-20) * rsf
            y = sum_chosen weight_e * Expert_e(h) + Shared(h)      (SwiGLU experts of moe_intermediate_size; the
                                                                    shared one of moe_intermediate_size*n_shared)
            x += RMS(y; w_moe_out)
    logits = W_lm RMS(x; w_final)

Layouts (``BUG`` selects one at build time; the forward is the one of the layout that was built)
------------------------------------------------------------------------------------------------
""  (baseline)   A module tree of my own (``LatentAttention``, ``SwiGLU``, ``GroupRouter``, ``SparseMoE``,
    ``Block``, ``AXK1Port``); every matrix kept (out, in) as in the checkpoint; RoPE on even/odd slices with cos/sin
    computed each call from an ``inv_freq`` buffer, the pairs stacked back in place; eager attention with an additive
    finfo.min mask; experts stacked (E, 2I, d) [gate; up] and (E, d, I), run in a loop over the experts that were hit.

"ds_ref_absorb"  DeepSeek's reference-inference layout: names ``wq_a/q_norm/wq_b/wkv_a/kv_norm/wkv_b/wo``,
    ``attn_norm/ffn_norm``, ``w1/w2/w3``, ``head``; norms via ``F.rms_norm``; RoPE as complex multiplication with
    a precomputed ``freqs_cis`` table (interleaved pairs are the natural complex pairs); MLA in "absorb" mode: the
    query's nope part is pushed through wkv_b's key half into the r_kv latent, scores are taken against the latent
    c_kv directly, the attention output stays latent and goes through wkv_b's value half afterwards; a ``Gate`` that
    masks unselected groups with a bool mask; routed experts as a ModuleList of per-expert (w1, w2, w3) modules,
    visited by ``bincount``.

"gguf_flat"  One functional forward over a flat ParameterDict with llama.cpp/GGUF names (``blk_N_attn_q_a``,
    ``attn_k_b``, ``ffn_gate_exps``, ``exp_probs_b`` ...); wkv_b split into ``attn_k_b`` (H, r_kv, dn, stored
    transposed per head) and ``attn_v_b`` (H, dv, r_kv); RoPE from precomputed cos/sin tables on adjacent pairs;
    ``F.scaled_dot_product_attention`` with a bool mask; router picks groups by pairwise "how many groups beat me"
    ranking and experts by argsort; experts run ggml ``mul_mat_id``-style: token slots sorted by expert, one matmul
    per contiguous segment, scattered back with ``index_add``.

"flax_scan"  A JAX/Flax port: kernels transposed to (in, out), parameters stacked per layer (attention over all
    layers, dense MLP over dense layers, MoE over sparse layers) and indexed as a scan would; q_a and kv_a fused in
    one down-kernel; q_b / kv_b kernels shaped (r, H, head); rope columns permuted at load to the half-split
    (rotate_half) convention, cos/sin = cat(freqs, freqs); attention as einsums with ``where`` masking; groups kept by
    a k-th-largest threshold; MoE as GShard dispatch/combine tensors (token, expert, capacity) and einsums; the
    final norm gain folded into the (d, V) logits kernel.

"megatron_te"  Megatron-Core / TransformerEngine names and fusions: ``linear_qkv_down_proj`` (q_a and kv_a fused)
    is a LayerNormLinear that carries input_layernorm's gain as ``layer_norm_weight``, ``linear_q_up_proj`` and
    ``linear_kv_up_proj`` carry the latent norms' gains the same way, the dense ``linear_fc1`` = [gate; up] carries
    the post-attention norm; GPT-J style rotate-every-two RoPE with repeat_interleaved cos/sin; flash-style online
    softmax over key chunks; a dense ``routing_map`` / ``probs`` (N, E) router; GroupedMLP ``weight1`` (E, d, 2I) and
    ``weight2`` (E, I, d) run densely for every expert, combined by the dense probs.

"folded_rotmat"  Every RMSNorm gain folded into the matrix that follows it at load (input norm -> q_a, kv_a; latent
    norms -> q_b, kv_b; post-attention norm -> router, experts, shared expert, dense MLP; final norm -> lm_head), the
    softmax scale folded into q_b too; the 1/rms is applied as a per-token scalar after the matmul ("deferred
    normalisation"); RoPE as precomputed per-position block-diagonal 2x2 rotation matrices applied by einsum; SDPA
    with an additive float mask and scale 1; the router restricted to candidate experts gathered from the kept
    groups; the shared expert split into n_shared extra experts of weight 1 stacked after the routed ones, all run by
    one per-expert loop.

"tp2_ep2"  A simulated 2-way tensor/expert-parallel shard layout (vLLM/Megatron style): vocab-parallel embedding
    and lm_head halves; ``fused_qkv_a_proj_with_mqa`` replicated; q_b / kv_b column-parallel and o_proj row-parallel
    by heads, per-rank partial outputs summed (all-reduce); dense ``gate_up_proj`` merged-column shards; routed
    experts ``w13_weight`` / ``w2_weight`` split by expert over 2 EP ranks; shared expert TP-sharded; RoPE rows
    permuted to the neox half-split convention with a ``cos_sin_cache`` buffer; attention by ``baddbmm`` over
    (batch*heads).  Falls back to 1 rank when a size is odd.

"per_head_reim"  A notebook/research layout split per head: q_nope, k_up, v_up and o-columns held per head in
    ParameterLists; RoPE held as separate "real" and "imaginary" projections (even / odd rope rows of q_b and of
    kv_a) rotated as complex numbers written out by hand; a Python loop over heads with log-sum-exp softmax; the
    embedding as one-hot @ table; dense and shared gate/up interleaved row by row [g0, u0, g1, u1, ...]; a router
    that picks groups and experts by repeated argmax; routed experts transposed (E, d, I) / (E, I, d) and run per
    token-slot by gathering each slot's expert matrices and ``bmm``.

"mqa_latent"  MLA fully absorbed at load (FlashMLA's MQA form): input norm folded into a fused down projection,
    q_b's nope rows premultiplied by wkv_b's key half into per-head (r_kv, r_q) latent-query matrices (latent norm
    gains folded in), wkv_b's value half premultiplied into o_proj as per-head (d, r_kv) matrices; attention is
    multi-query over one shared key [c_kv | k_rope] and value c_kv via SDPA with ``enable_gqa`` (``is_causal`` when
    nothing is padded); RoPE by ``torch.polar`` complex numbers computed on the fly; experts ``w13`` (E, d, 2I)
    transposed, run as a padded batched GEMM over (E, capacity, d) buffers.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

CLEAN = [
    "ds_ref_absorb",  # DeepSeek reference names, complex freqs_cis, absorbed latent-space MLA, per-expert ModuleList
    "gguf_flat",  # functional forward over a flat GGUF-named dict, k_b/v_b split, SDPA, expert-sorted dispatch
    "flax_scan",  # (in,out) kernels stacked per layer, fused down kernel, rotate_half rows, GShard dispatch MoE
    "megatron_te",  # norm gains inside LayerNormLinear, rotate-every-two RoPE, online softmax, dense all-expert MoE
    "folded_rotmat",  # all norm gains + softmax scale folded, deferred 1/rms, rotation-matrix RoPE, shared = extra experts
    "tp2_ep2",  # simulated 2-rank TP/EP shards summed, vocab-parallel embed/head, neox cos_sin_cache, baddbmm
    "per_head_reim",  # per-head ParameterLists, RoPE as real/imag projections, head loop, interleaved gate/up, gather+bmm
    "mqa_latent",  # MLA absorbed at load into MQA over the latent (SDPA enable_gqa), polar RoPE, padded grouped GEMM
]
BUGS = []
PADDING_ONLY = []


# ----------------------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------------------
class _HP:
    """The hyper-parameters this port needs, read from the Transformers config object."""

    def __init__(self, c):
        self.V = c.vocab_size
        self.d = c.hidden_size
        self.L = c.num_hidden_layers
        self.H = c.num_attention_heads
        self.qr = c.q_lora_rank
        self.kr = c.kv_lora_rank
        self.dn = c.qk_nope_head_dim
        self.dr = c.qk_rope_head_dim
        self.dv = c.v_head_dim
        self.I = c.intermediate_size
        self.Im = c.moe_intermediate_size
        self.E = c.n_routed_experts
        self.K = c.num_experts_per_tok
        self.S = c.n_shared_experts
        self.Is = self.Im * self.S
        self.G = c.n_group
        self.TG = c.topk_group
        self.gs = self.E // self.G
        self.rsf = float(c.routed_scaling_factor)
        self.norm_topk = bool(getattr(c, "norm_topk_prob", True))
        self.eps = float(c.rms_norm_eps)
        self.lat_eps = 1e-6  # the latent norms inside attention use their default eps, not rms_norm_eps
        self.kinds = list(c.mlp_layer_types)
        self.interleave = bool(getattr(c, "rope_interleave", True))
        self.max_pos = int(c.max_position_embeddings)
        rp = getattr(c, "rope_parameters", None) or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError("only the default RoPE is ported")
        self.theta = float(rp.get("rope_theta", 10000.0))
        if getattr(c, "hidden_act", "silu") != "silu":
            raise NotImplementedError("only SiLU experts are ported")
        if getattr(c, "attention_bias", False):
            raise NotImplementedError("attention biases are not ported")
        self.scale = (self.dn + self.dr) ** -0.5
        self.tie = bool(getattr(c, "tie_word_embeddings", False))

    def inv_freq(self):
        return 1.0 / (self.theta ** (torch.arange(0, self.dr, 2, dtype=torch.float32) / self.dr))


def _canon(sd, hp):
    """float32 copies under Transformers' names, lm_head resolved, rope rows in the interleaved-pair convention."""
    t = {k: v.detach().to(torch.float32).clone() for k, v in sd.items()}
    if "lm_head.weight" not in t or hp.tie:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    for i in range(hp.L):
        key = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if hp.kinds[i] == "sparse" and key not in t:
            t[key] = torch.zeros(hp.E)
    if not hp.interleave:  # half-split pairs (j, j+dr/2) -> interleaved pairs (2j, 2j+1)
        half = hp.dr // 2
        perm = torch.stack([torch.arange(half), torch.arange(half) + half], -1).flatten()
        for i in range(hp.L):
            p = f"model.layers.{i}.self_attn."
            w = t[p + "q_b_proj.weight"].view(hp.H, hp.dn + hp.dr, hp.qr)
            w[:, hp.dn :] = w[:, hp.dn :][:, perm].clone()
            w = t[p + "kv_a_proj_with_mqa.weight"]
            w[hp.kr :] = w[hp.kr :][perm].clone()
    return t


def _P(tensor):
    return nn.Parameter(tensor.contiguous(), requires_grad=False)


def _positions(ids, position_ids):
    B, T = ids.shape
    if position_ids is None:
        return torch.arange(T, device=ids.device).unsqueeze(0).expand(B, T)
    return position_ids.to(ids.device).long().expand(B, T)


def _key_ok(ids, attention_mask):
    if attention_mask is None:
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    return attention_mask.to(ids.device).bool()


def _allowed(key_ok):
    """(B, T, T) bool: causal, real keys only, and always the query itself."""
    T = key_ok.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=key_ok.device).tril()
    return (causal[None] & key_ok[:, None, :]) | torch.eye(T, dtype=torch.bool, device=key_ok.device)[None]


def _layer(i):
    return f"model.layers.{i}."


# ----------------------------------------------------------------------------------------------------------------
# baseline: a module tree
# ----------------------------------------------------------------------------------------------------------------
class Proj(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = _P(w)

    def forward(self, x):
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.weight = _P(w)
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rope_even_odd(x, cos, sin):
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.stack((xe * cos - xo * sin, xo * cos + xe * sin), -1).flatten(-2)


class LatentAttention(nn.Module):
    def __init__(self, t, p, hp):
        super().__init__()
        self.hp = hp
        self.q_down = Proj(t[p + "q_a_proj.weight"])
        self.q_norm = RMSNorm(t[p + "q_a_layernorm.weight"], hp.lat_eps)
        self.q_up = Proj(t[p + "q_b_proj.weight"])
        self.kv_down = Proj(t[p + "kv_a_proj_with_mqa.weight"])
        self.kv_norm = RMSNorm(t[p + "kv_a_layernorm.weight"], hp.lat_eps)
        self.kv_up = Proj(t[p + "kv_b_proj.weight"])
        self.out = Proj(t[p + "o_proj.weight"])

    def forward(self, x, cos, sin, bias):
        hp = self.hp
        B, T, _ = x.shape
        q = self.q_up(self.q_norm(self.q_down(x))).view(B, T, hp.H, hp.dn + hp.dr).transpose(1, 2)
        q_nope, q_pe = q.split([hp.dn, hp.dr], -1)
        lat, k_pe = self.kv_down(x).split([hp.kr, hp.dr], -1)
        kv = self.kv_up(self.kv_norm(lat)).view(B, T, hp.H, hp.dn + hp.dv).transpose(1, 2)
        k_nope, v = kv.split([hp.dn, hp.dv], -1)
        c, s = cos[:, None], sin[:, None]
        q_pe = _rope_even_odd(q_pe, c, s)
        k_pe = _rope_even_odd(k_pe[:, None], c, s)
        q = torch.cat([q_nope, q_pe], -1)
        k = torch.cat([k_nope, k_pe.expand(B, hp.H, T, hp.dr)], -1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * hp.scale + bias
        probs = torch.softmax(scores, -1)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, hp.H * hp.dv)
        return self.out(o)


class SwiGLU(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate = Proj(gate)
        self.up = Proj(up)
        self.down = Proj(down)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GroupRouter(nn.Module):
    def __init__(self, w, b, hp):
        super().__init__()
        self.hp = hp
        self.weight = _P(w)
        self.register_buffer("score_bias", b.clone())

    def forward(self, x):
        hp = self.hp
        N = x.shape[0]
        s = torch.sigmoid(F.linear(x, self.weight))
        choice = s + self.score_bias
        grp = choice.view(N, hp.G, hp.gs).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(grp, dtype=torch.bool).scatter_(1, grp.topk(hp.TG, -1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(hp.gs, 1), float("-inf"))
        idx = choice.topk(hp.K, -1).indices
        w = s.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * hp.rsf


class SparseMoE(nn.Module):
    def __init__(self, t, p, hp):
        super().__init__()
        self.hp = hp
        self.router = GroupRouter(t[p + "gate.weight"], t[p + "gate.e_score_correction_bias"], hp)
        self.expert_gate_up = _P(t[p + "experts.gate_up_proj"])  # (E, 2I, d): [gate; up]
        self.expert_down = _P(t[p + "experts.down_proj"])  # (E, d, I)
        self.shared = SwiGLU(
            t[p + "shared_experts.gate_proj.weight"],
            t[p + "shared_experts.up_proj.weight"],
            t[p + "shared_experts.down_proj.weight"],
        )
        self.out_norm = RMSNorm(t[p + "post_mlp_layernorm.weight"], hp.eps)

    def forward(self, x):
        hp = self.hp
        xf = x.reshape(-1, hp.d)
        idx, w = self.router(xf)
        y = torch.zeros_like(xf)
        for e in range(hp.E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            g, u = F.linear(xf[tok], self.expert_gate_up[e]).chunk(2, -1)
            out = F.linear(F.silu(g) * u, self.expert_down[e]) * w[tok, slot, None]
            y.index_add_(0, tok, out)
        y = y.view_as(x) + self.shared(x)
        return self.out_norm(y)


class Block(nn.Module):
    def __init__(self, t, i, hp):
        super().__init__()
        p = _layer(i)
        self.attn_norm = RMSNorm(t[p + "input_layernorm.weight"], hp.eps)
        self.attn = LatentAttention(t, p + "self_attn.", hp)
        self.mlp_norm = RMSNorm(t[p + "post_attention_layernorm.weight"], hp.eps)
        if hp.kinds[i] == "sparse":
            self.mlp = SparseMoE(t, p + "mlp.", hp)
        else:
            self.mlp = SwiGLU(t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"], t[p + "mlp.down_proj.weight"])

    def forward(self, x, cos, sin, bias):
        x = x + self.attn(self.attn_norm(x), cos, sin, bias)
        return x + self.mlp(self.mlp_norm(x))


class AXK1Port(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        self.embed = _P(t["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([Block(t, i, hp) for i in range(hp.L)])
        self.final_norm = RMSNorm(t["model.norm.weight"], hp.eps)
        self.lm_head = _P(t["lm_head.weight"])
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        allowed = _allowed(_key_ok(input_ids, attention_mask))
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        x = F.embedding(input_ids, self.embed)
        for blk in self.blocks:
            x = blk(x, cos, sin, bias)
        return F.linear(self.final_norm(x), self.lm_head)


def _build_baseline(t, hp):
    return AXK1Port(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# ds_ref_absorb: DeepSeek reference-inference names, complex freqs_cis, absorbed MLA, per-expert modules
# ----------------------------------------------------------------------------------------------------------------
def _freqs_cis(hp, pos_limit):
    t = torch.arange(pos_limit, dtype=torch.float32)
    freqs = torch.outer(t, hp.inv_freq())
    return torch.polar(torch.ones_like(freqs), freqs)


def _ds_rotary(x, freqs_cis):
    """x (B, T, h, dr) with interleaved pairs; freqs_cis (B, T, dr/2) complex."""
    xc = torch.view_as_complex(x.contiguous().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[:, :, None]).flatten(3)


class _DSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.weight = _P(w)
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _DSMLA(nn.Module):
    def __init__(self, t, p, hp):
        super().__init__()
        self.hp = hp
        self.wq_a = Proj(t[p + "q_a_proj.weight"])
        self.q_norm = _DSNorm(t[p + "q_a_layernorm.weight"], hp.lat_eps)
        self.wq_b = Proj(t[p + "q_b_proj.weight"])
        self.wkv_a = Proj(t[p + "kv_a_proj_with_mqa.weight"])
        self.kv_norm = _DSNorm(t[p + "kv_a_layernorm.weight"], hp.lat_eps)
        self.wkv_b = Proj(t[p + "kv_b_proj.weight"])
        self.wo = Proj(t[p + "o_proj.weight"])

    def forward(self, x, freqs_cis, mask):
        hp = self.hp
        B, S, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, S, hp.H, hp.dn + hp.dr)
        q_nope, q_pe = q.split([hp.dn, hp.dr], -1)
        q_pe = _ds_rotary(q_pe, freqs_cis)
        kv, k_pe = self.wkv_a(x).split([hp.kr, hp.dr], -1)
        k_pe = _ds_rotary(k_pe.unsqueeze(2), freqs_cis).squeeze(2)
        kv = self.kv_norm(kv)
        wkv_b = self.wkv_b.weight.view(hp.H, hp.dn + hp.dv, hp.kr)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : hp.dn])
        scores = torch.einsum("bshc,btc->bsht", q_lat, kv) + torch.einsum("bshr,btr->bsht", q_pe, k_pe)
        scores = scores * hp.scale + mask.unsqueeze(2)
        scores = scores.softmax(-1)
        o = torch.einsum("bsht,btc->bshc", scores, kv)
        o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, -hp.dv :])
        return self.wo(o.flatten(2))


class _DSExpert(nn.Module):
    def __init__(self, w1, w2, w3):
        super().__init__()
        self.w1 = Proj(w1)
        self.w2 = Proj(w2)
        self.w3 = Proj(w3)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _DSGate(nn.Module):
    def __init__(self, w, b, hp):
        super().__init__()
        self.hp = hp
        self.weight = _P(w)
        self.register_buffer("bias", b.clone())

    def forward(self, x):
        hp = self.hp
        N = x.shape[0]
        scores = F.linear(x, self.weight).sigmoid()
        original_scores = scores
        scores = scores + self.bias
        group_scores = scores.view(N, hp.G, -1).topk(2, dim=-1)[0].sum(dim=-1)
        indices = group_scores.topk(hp.TG, dim=-1)[1]
        mask = torch.ones(N, hp.G, dtype=torch.bool).scatter_(1, indices, False)
        scores = scores.view(N, hp.G, -1).masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, hp.K, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        if hp.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * hp.rsf, indices


class _DSMoE(nn.Module):
    def __init__(self, t, p, hp):
        super().__init__()
        self.hp = hp
        self.gate = _DSGate(t[p + "gate.weight"], t[p + "gate.e_score_correction_bias"], hp)
        gu, dw = t[p + "experts.gate_up_proj"], t[p + "experts.down_proj"]
        self.experts = nn.ModuleList([_DSExpert(gu[e, : hp.Im], dw[e], gu[e, hp.Im :]) for e in range(hp.E)])
        self.shared_experts = _DSExpert(
            t[p + "shared_experts.gate_proj.weight"],
            t[p + "shared_experts.down_proj.weight"],
            t[p + "shared_experts.up_proj.weight"],
        )
        self.post_norm = _DSNorm(t[p + "post_mlp_layernorm.weight"], hp.eps)

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, self.hp.d)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.hp.E).tolist()
        for i in range(self.hp.E):
            if counts[i] == 0:
                continue
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        return self.post_norm(y + z).view(shape)


class _DSBlock(nn.Module):
    def __init__(self, t, i, hp):
        super().__init__()
        p = _layer(i)
        self.attn_norm = _DSNorm(t[p + "input_layernorm.weight"], hp.eps)
        self.attn = _DSMLA(t, p + "self_attn.", hp)
        self.ffn_norm = _DSNorm(t[p + "post_attention_layernorm.weight"], hp.eps)
        if hp.kinds[i] == "sparse":
            self.ffn = _DSMoE(t, p + "mlp.", hp)
        else:
            self.ffn = _DSExpert(
                t[p + "mlp.gate_proj.weight"], t[p + "mlp.down_proj.weight"], t[p + "mlp.up_proj.weight"]
            )

    def forward(self, x, freqs_cis, mask):
        x = x + self.attn(self.attn_norm(x), freqs_cis, mask)
        return x + self.ffn(self.ffn_norm(x))


class _DSTransformer(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        self.embed = _P(t["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_DSBlock(t, i, hp) for i in range(hp.L)])
        self.norm = _DSNorm(t["model.norm.weight"], hp.eps)
        self.head = Proj(t["lm_head.weight"])
        self.register_buffer("freqs_cis", _freqs_cis(hp, hp.max_pos), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        table = self.freqs_cis
        if int(pos.max()) >= table.shape[0]:
            table = _freqs_cis(self.hp, int(pos.max()) + 1)
        freqs_cis = table[pos]
        allowed = _allowed(_key_ok(input_ids, attention_mask))
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        h = F.embedding(input_ids, self.embed)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.head(self.norm(h))


def _build_ds_ref_absorb(t, hp):
    return _DSTransformer(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# gguf_flat: one functional forward over a flat, GGUF-named dict
# ----------------------------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _gg_rope(x, cos, sin):
    """ggml "normal" rope: adjacent pairs. x (B, T, h, dr); cos/sin (B, T, dr/2)."""
    xp = x.reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    c, s = cos[:, :, None], sin[:, :, None]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)


class _GGUFModel(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        self.w = nn.ParameterDict()
        put = self._put
        put("token_embd.weight", t["model.embed_tokens.weight"])
        put("output_norm.weight", t["model.norm.weight"])
        put("output.weight", t["lm_head.weight"])
        for i in range(hp.L):
            p, b = _layer(i), f"blk.{i}."
            a = p + "self_attn."
            put(b + "attn_norm.weight", t[p + "input_layernorm.weight"])
            put(b + "attn_q_a.weight", t[a + "q_a_proj.weight"])
            put(b + "attn_q_a_norm.weight", t[a + "q_a_layernorm.weight"])
            put(b + "attn_q_b.weight", t[a + "q_b_proj.weight"])
            put(b + "attn_kv_a_mqa.weight", t[a + "kv_a_proj_with_mqa.weight"])
            put(b + "attn_kv_a_norm.weight", t[a + "kv_a_layernorm.weight"])
            kvb = t[a + "kv_b_proj.weight"].view(hp.H, hp.dn + hp.dv, hp.kr)
            put(b + "attn_k_b.weight", kvb[:, : hp.dn].transpose(1, 2))  # (H, r_kv, dn)
            put(b + "attn_v_b.weight", kvb[:, hp.dn :])  # (H, dv, r_kv)
            put(b + "attn_output.weight", t[a + "o_proj.weight"])
            put(b + "ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
            m = p + "mlp."
            if hp.kinds[i] == "sparse":
                put(b + "ffn_gate_inp.weight", t[m + "gate.weight"])
                put(b + "exp_probs_b.bias", t[m + "gate.e_score_correction_bias"])
                gu = t[m + "experts.gate_up_proj"]
                put(b + "ffn_gate_exps.weight", gu[:, : hp.Im])
                put(b + "ffn_up_exps.weight", gu[:, hp.Im :])
                put(b + "ffn_down_exps.weight", t[m + "experts.down_proj"])
                put(b + "ffn_gate_shexp.weight", t[m + "shared_experts.gate_proj.weight"])
                put(b + "ffn_up_shexp.weight", t[m + "shared_experts.up_proj.weight"])
                put(b + "ffn_down_shexp.weight", t[m + "shared_experts.down_proj.weight"])
                put(b + "ffn_post_norm.weight", t[m + "post_mlp_layernorm.weight"])
            else:
                put(b + "ffn_gate.weight", t[m + "gate_proj.weight"])
                put(b + "ffn_up.weight", t[m + "up_proj.weight"])
                put(b + "ffn_down.weight", t[m + "down_proj.weight"])
        ang = torch.outer(torch.arange(hp.max_pos, dtype=torch.float32), hp.inv_freq())
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)

    def _put(self, name, tensor):
        self.w[name.replace(".", "_")] = _P(tensor)

    def W(self, name):
        return self.w[name.replace(".", "_")]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hp, W = self.hp, self.W
        B, T = input_ids.shape
        pos = _positions(input_ids, position_ids)
        if int(pos.max()) < self.rope_cos.shape[0]:
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        else:
            ang = pos[..., None].float() * hp.inv_freq()
            cos, sin = ang.cos(), ang.sin()
        allowed = _allowed(_key_ok(input_ids, attention_mask))[:, None]
        x = F.embedding(input_ids, W("token_embd.weight"))
        for i in range(hp.L):
            b = f"blk.{i}."
            h = _rms(x, W(b + "attn_norm.weight"), hp.eps)
            cq = _rms(F.linear(h, W(b + "attn_q_a.weight")), W(b + "attn_q_a_norm.weight"), hp.lat_eps)
            q = F.linear(cq, W(b + "attn_q_b.weight")).view(B, T, hp.H, hp.dn + hp.dr)
            q_nope, q_pe = q.split([hp.dn, hp.dr], -1)
            c, k_pe = F.linear(h, W(b + "attn_kv_a_mqa.weight")).split([hp.kr, hp.dr], -1)
            c = _rms(c, W(b + "attn_kv_a_norm.weight"), hp.lat_eps)
            q_pe = _gg_rope(q_pe, cos, sin)
            k_pe = _gg_rope(k_pe[:, :, None], cos, sin)
            k_nope = torch.einsum("btc,hcd->bhtd", c, W(b + "attn_k_b.weight"))
            v = torch.einsum("btc,hvc->bhtv", c, W(b + "attn_v_b.weight"))
            q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
            k = torch.cat([k_nope, k_pe.transpose(1, 2).expand(B, hp.H, T, hp.dr)], -1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=hp.scale)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, hp.H * hp.dv), W(b + "attn_output.weight"))
            h = _rms(x, W(b + "ffn_norm.weight"), hp.eps)
            if hp.kinds[i] == "sparse":
                x = x + self._moe(h, b)
            else:
                act = F.silu(F.linear(h, W(b + "ffn_gate.weight"))) * F.linear(h, W(b + "ffn_up.weight"))
                x = x + F.linear(act, W(b + "ffn_down.weight"))
        return F.linear(_rms(x, W("output_norm.weight"), hp.eps), W("output.weight"))

    def _moe(self, h, b):
        hp, W = self.hp, self.W
        xf = h.reshape(-1, hp.d)
        N = xf.shape[0]
        probs = torch.sigmoid(F.linear(xf, W(b + "ffn_gate_inp.weight")))
        sel = probs + W(b + "exp_probs_b.bias")
        gsc = sel.view(N, hp.G, hp.gs).sort(-1, descending=True).values[..., :2].sum(-1)
        beaten_by = (gsc[:, None, :] > gsc[:, :, None]).sum(-1)  # [n, g]: groups scoring above g
        keep = (beaten_by < hp.TG).repeat_interleave(hp.gs, -1)
        sel = sel.masked_fill(~keep, float("-inf"))
        idx = sel.argsort(-1, descending=True)[:, : hp.K]
        wts = probs.gather(1, idx)
        if hp.norm_topk:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * hp.rsf
        # mul_mat_id: token slots sorted by expert, one matmul per segment
        flat_e = idx.reshape(-1)
        order = flat_e.argsort(stable=True)
        tok = order // hp.K
        ws = wts.reshape(-1)[order]
        xs = xf[tok]
        counts = torch.bincount(flat_e, minlength=hp.E).tolist()
        gate, up, down = W(b + "ffn_gate_exps.weight"), W(b + "ffn_up_exps.weight"), W(b + "ffn_down_exps.weight")
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = xs[start : start + n]
            outs.append(F.linear(F.silu(F.linear(seg, gate[e])) * F.linear(seg, up[e]), down[e]))
            start += n
        ys = torch.cat(outs) * ws[:, None]
        y = torch.zeros_like(xf).index_add_(0, tok, ys)
        sh = F.silu(F.linear(xf, W(b + "ffn_gate_shexp.weight"))) * F.linear(xf, W(b + "ffn_up_shexp.weight"))
        y = y + F.linear(sh, W(b + "ffn_down_shexp.weight"))
        return _rms(y, W(b + "ffn_post_norm.weight"), hp.eps).view_as(h)


def _build_gguf_flat(t, hp):
    return _GGUFModel(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# flax_scan: (in, out) kernels stacked per layer, rotate_half rows, GShard dispatch MoE
# ----------------------------------------------------------------------------------------------------------------
def _stack(tensors, tail):
    return torch.stack(tensors) if tensors else torch.zeros((0, *tail))


def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class _FlaxLM(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        half = hp.dr // 2
        i2h = torch.cat([torch.arange(0, hp.dr, 2), torch.arange(1, hp.dr, 2)])  # interleaved -> half-split
        self.embedding = _P(t["model.embed_tokens.weight"])
        attn_norm, wd, qn, wq, kvn, wkv, wo, mlp_norm = [], [], [], [], [], [], [], []
        dense_wi, dense_wo = [], []
        rk, rb, mwi, mwo, swi, swo, pms = [], [], [], [], [], [], []
        self.slot = []
        for i in range(hp.L):
            p = _layer(i)
            a = p + "self_attn."
            attn_norm.append(t[p + "input_layernorm.weight"])
            kva = t[a + "kv_a_proj_with_mqa.weight"].clone()
            kva[hp.kr :] = kva[hp.kr :][i2h]
            wd.append(torch.cat([t[a + "q_a_proj.weight"], kva], 0).t())  # (d, r_q + r_kv + dr)
            qn.append(t[a + "q_a_layernorm.weight"])
            qb = t[a + "q_b_proj.weight"].view(hp.H, hp.dn + hp.dr, hp.qr).clone()
            qb[:, hp.dn :] = qb[:, hp.dn :][:, i2h]
            wq.append(qb.permute(2, 0, 1))  # (r_q, H, dn+dr)
            kvn.append(t[a + "kv_a_layernorm.weight"])
            wkv.append(t[a + "kv_b_proj.weight"].view(hp.H, hp.dn + hp.dv, hp.kr).permute(2, 0, 1))  # (r_kv, H, .)
            wo.append(t[a + "o_proj.weight"].t().reshape(hp.H, hp.dv, hp.d))
            mlp_norm.append(t[p + "post_attention_layernorm.weight"])
            m = p + "mlp."
            if hp.kinds[i] == "sparse":
                self.slot.append(("moe", len(rk)))
                rk.append(t[m + "gate.weight"].t())
                rb.append(t[m + "gate.e_score_correction_bias"])
                gu = t[m + "experts.gate_up_proj"].view(hp.E, 2, hp.Im, hp.d)
                mwi.append(gu.permute(0, 3, 1, 2))  # (E, d, 2, I)
                mwo.append(t[m + "experts.down_proj"].transpose(1, 2))  # (E, I, d)
                sg, su = t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"]
                swi.append(torch.stack([sg.t(), su.t()], 1))  # (d, 2, Is)
                swo.append(t[m + "shared_experts.down_proj.weight"].t())
                pms.append(t[m + "post_mlp_layernorm.weight"])
            else:
                self.slot.append(("dense", len(dense_wi)))
                dense_wi.append(torch.stack([t[m + "gate_proj.weight"].t(), t[m + "up_proj.weight"].t()], 1))
                dense_wo.append(t[m + "down_proj.weight"].t())
        self.attn_norm_scale = _P(torch.stack(attn_norm))
        self.down_kernel = _P(torch.stack(wd))
        self.q_norm_scale = _P(torch.stack(qn))
        self.q_up_kernel = _P(torch.stack(wq))
        self.kv_norm_scale = _P(torch.stack(kvn))
        self.kv_up_kernel = _P(torch.stack(wkv))
        self.out_kernel = _P(torch.stack(wo))
        self.mlp_norm_scale = _P(torch.stack(mlp_norm))
        self.dense_wi = _P(_stack(dense_wi, (hp.d, 2, hp.I)))
        self.dense_wo = _P(_stack(dense_wo, (hp.I, hp.d)))
        self.router_kernel = _P(_stack(rk, (hp.d, hp.E)))
        self.register_buffer("router_bias", _stack(rb, (hp.E,)))
        self.moe_wi = _P(_stack(mwi, (hp.E, hp.d, 2, hp.Im)))
        self.moe_wo = _P(_stack(mwo, (hp.E, hp.Im, hp.d)))
        self.shared_wi = _P(_stack(swi, (hp.d, 2, hp.Is)))
        self.shared_wo = _P(_stack(swo, (hp.Is, hp.d)))
        self.post_moe_scale = _P(_stack(pms, (hp.d,)))
        self.lm_kernel = _P((t["lm_head.weight"] * t["model.norm.weight"][None, :]).t())  # final gain folded
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    @staticmethod
    def _norm(x, scale, eps):
        return x * torch.rsqrt(torch.mean(x * x, -1, keepdim=True) + eps) * scale

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hp = self.hp
        B, T = input_ids.shape
        pos = _positions(input_ids, position_ids)
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos()[:, :, None], emb.sin()[:, :, None]
        allowed = _allowed(_key_ok(input_ids, attention_mask))[:, None]
        x = self.embedding[input_ids]
        for l in range(hp.L):
            h = self._norm(x, self.attn_norm_scale[l], hp.eps)
            cq, c, k_pe = (h @ self.down_kernel[l]).split([hp.qr, hp.kr, hp.dr], -1)
            cq = self._norm(cq, self.q_norm_scale[l], hp.lat_eps)
            c = self._norm(c, self.kv_norm_scale[l], hp.lat_eps)
            q = torch.einsum("btr,rhk->bthk", cq, self.q_up_kernel[l])
            q_nope, q_pe = q.split([hp.dn, hp.dr], -1)
            q_pe = q_pe * cos + _rotate_half(q_pe) * sin
            k_pe = k_pe * cos[:, :, 0] + _rotate_half(k_pe) * sin[:, :, 0]
            kv = torch.einsum("btc,chk->bthk", c, self.kv_up_kernel[l])
            k_nope, v = kv.split([hp.dn, hp.dv], -1)
            s = torch.einsum("bqhd,bkhd->bhqk", q_nope, k_nope) + torch.einsum("bqhr,bkr->bhqk", q_pe, k_pe)
            s = torch.where(allowed, s * hp.scale, torch.tensor(float("-inf")))
            p = torch.softmax(s, -1)
            o = torch.einsum("bhqk,bkhv->bqhv", p, v)
            x = x + torch.einsum("bqhv,hvd->bqd", o, self.out_kernel[l])
            h = self._norm(x, self.mlp_norm_scale[l], hp.eps)
            kind, j = self.slot[l]
            if kind == "dense":
                hi = torch.einsum("btd,dkf->btkf", h, self.dense_wi[j])
                x = x + torch.einsum("btf,fd->btd", F.silu(hi[..., 0, :]) * hi[..., 1, :], self.dense_wo[j])
            else:
                x = x + self._moe(h, j)
        h = x * torch.rsqrt(torch.mean(x * x, -1, keepdim=True) + hp.eps)
        return torch.einsum("btd,dv->btv", h, self.lm_kernel)

    def _moe(self, h, j):
        hp = self.hp
        xf = h.reshape(-1, hp.d)
        N = xf.shape[0]
        probs = torch.sigmoid(xf @ self.router_kernel[j])
        sel = probs + self.router_bias[j]
        gsc = sel.view(N, hp.G, hp.gs).topk(2, -1).values.sum(-1)
        kth = gsc.sort(-1, descending=True).values[:, hp.TG - 1 : hp.TG]
        gkeep = (gsc >= kth).repeat_interleave(hp.gs, -1)
        sel = sel.masked_fill(~gkeep, float("-inf"))
        idx = sel.topk(hp.K, -1).indices
        w = probs.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * hp.rsf
        gates = torch.zeros(N, hp.E).scatter(1, idx, w)  # (t, e)
        chosen = torch.zeros(N, hp.E).scatter(1, idx, 1.0)
        slot = ((torch.cumsum(chosen, 0) - 1) * chosen).long()  # place of a token in its expert's buffer
        cap = int(chosen.sum(0).max().item())
        dispatch = F.one_hot(slot, cap).float() * chosen[..., None]  # (t, e, c)
        combine = dispatch * gates[..., None]
        ex_in = torch.einsum("tec,td->ecd", dispatch, xf)
        hi = torch.einsum("ecd,edkf->eckf", ex_in, self.moe_wi[j])
        ex_out = torch.einsum("ecf,efd->ecd", F.silu(hi[..., 0, :]) * hi[..., 1, :], self.moe_wo[j])
        y = torch.einsum("tec,ecd->td", combine, ex_out)
        shi = torch.einsum("td,dkf->tkf", xf, self.shared_wi[j])
        y = y + (F.silu(shi[:, 0]) * shi[:, 1]) @ self.shared_wo[j]
        return self._norm(y, self.post_moe_scale[j], hp.eps).view_as(h)


def _build_flax_scan(t, hp):
    return _FlaxLM(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# megatron_te: LayerNormLinear fusions, rotate-every-two RoPE, online softmax, dense all-expert MoE
# ----------------------------------------------------------------------------------------------------------------
class _LayerNormLinear(nn.Module):
    """TransformerEngine-style: the RMSNorm gain lives with the linear that follows it."""

    def __init__(self, w, ln_w, eps):
        super().__init__()
        self.weight = _P(w)
        self.layer_norm_weight = _P(ln_w)
        self.eps = eps

    def forward(self, x):
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return F.linear(xn * self.layer_norm_weight, self.weight)


def _rotate_every_two(x):
    return torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)


def _online_softmax_attention(q, k, v, allowed, chunk=8):
    """q, k (B, H, T, D) (q pre-scaled), v (B, H, T, Dv), allowed (B, 1, T, T); flash-style over key chunks."""
    B, H, T, _ = q.shape
    m = torch.full((B, H, T, 1), float("-inf"))
    l = torch.zeros(B, H, T, 1)
    acc = torch.zeros(B, H, T, v.shape[-1])
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        sc = torch.matmul(q, k[:, :, s0:s1].transpose(-1, -2))
        sc = sc.masked_fill(~allowed[..., s0:s1], float("-inf"))
        m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - m_safe)
        corr = torch.exp(m - m_safe)
        l = l * corr + p.sum(-1, keepdim=True)
        acc = acc * corr + torch.matmul(p, v[:, :, s0:s1])
        m = m_new
    return acc / l


class _MegatronMLA(nn.Module):
    def __init__(self, t, p, hp):
        super().__init__()
        self.hp = hp
        a = p + "self_attn."
        self.linear_qkv_down_proj = _LayerNormLinear(
            torch.cat([t[a + "q_a_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]], 0),
            t[p + "input_layernorm.weight"],
            hp.eps,
        )
        self.linear_q_up_proj = _LayerNormLinear(t[a + "q_b_proj.weight"], t[a + "q_a_layernorm.weight"], hp.lat_eps)
        self.linear_kv_up_proj = _LayerNormLinear(t[a + "kv_b_proj.weight"], t[a + "kv_a_layernorm.weight"], hp.lat_eps)
        self.linear_proj = Proj(t[a + "o_proj.weight"])

    def forward(self, x, cos, sin, allowed):
        hp = self.hp
        B, T, _ = x.shape
        cq, c, k_pe = self.linear_qkv_down_proj(x).split([hp.qr, hp.kr, hp.dr], -1)
        q = self.linear_q_up_proj(cq).view(B, T, hp.H, hp.dn + hp.dr).transpose(1, 2)
        kv = self.linear_kv_up_proj(c).view(B, T, hp.H, hp.dn + hp.dv).transpose(1, 2)
        q_nope, q_pe = q.split([hp.dn, hp.dr], -1)
        k_nope, v = kv.split([hp.dn, hp.dv], -1)
        q_pe = q_pe * cos + _rotate_every_two(q_pe) * sin
        k_pe = (k_pe * cos[:, 0] + _rotate_every_two(k_pe) * sin[:, 0])[:, None]
        q = torch.cat([q_nope, q_pe], -1) * hp.scale
        k = torch.cat([k_nope, k_pe.expand(B, hp.H, T, hp.dr)], -1)
        o = _online_softmax_attention(q, k, v, allowed)
        return self.linear_proj(o.transpose(1, 2).reshape(B, T, hp.H * hp.dv))


class _MegatronDenseMLP(nn.Module):
    def __init__(self, t, p, hp):
        super().__init__()
        m = p + "mlp."
        self.linear_fc1 = _LayerNormLinear(
            torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]], 0),
            t[p + "post_attention_layernorm.weight"],
            hp.eps,
        )
        self.linear_fc2 = Proj(t[m + "down_proj.weight"])

    def forward(self, x):
        g, u = self.linear_fc1(x).chunk(2, -1)
        return self.linear_fc2(F.silu(g) * u)


class _MegatronRouter(nn.Module):
    def __init__(self, w, b, hp):
        super().__init__()
        self.hp = hp
        self.weight = _P(w)
        self.register_buffer("expert_bias", b.clone())

    def forward(self, x):
        """(probs, routing_map): dense (N, E) combine weights and bool choice."""
        hp = self.hp
        N = x.shape[0]
        scores = torch.sigmoid(F.linear(x, self.weight))
        sel = scores + self.expert_bias
        group_scores = sel.view(N, hp.G, hp.gs).topk(2, -1).values.sum(-1)
        group_idx = group_scores.topk(hp.TG, -1).indices
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0).bool()
        score_mask = group_mask.unsqueeze(-1).expand(N, hp.G, hp.gs).reshape(N, hp.E)
        sel = sel.masked_fill(~score_mask, float("-inf"))
        top = sel.topk(hp.K, -1).indices
        routing_map = torch.zeros(N, hp.E, dtype=torch.bool).scatter(1, top, True)
        probs = scores * routing_map
        if hp.norm_topk:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        return probs * hp.rsf, routing_map


class _MegatronMoE(nn.Module):
    def __init__(self, t, p, hp):
        super().__init__()
        self.hp = hp
        m = p + "mlp."
        self.pre_mlp_layernorm = RMSNorm(t[p + "post_attention_layernorm.weight"], hp.eps)
        self.router = _MegatronRouter(t[m + "gate.weight"], t[m + "gate.e_score_correction_bias"], hp)
        self.weight1 = _P(t[m + "experts.gate_up_proj"].transpose(1, 2))  # (E, d, 2I): [gate | up]
        self.weight2 = _P(t[m + "experts.down_proj"].transpose(1, 2))  # (E, I, d)
        self.shared_fc1 = Proj(
            torch.cat([t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"]], 0)
        )
        self.shared_fc2 = Proj(t[m + "shared_experts.down_proj.weight"])
        self.post_mlp_layernorm = RMSNorm(t[m + "post_mlp_layernorm.weight"], hp.eps)

    def forward(self, x):
        hp = self.hp
        h = self.pre_mlp_layernorm(x)
        xf = h.reshape(-1, hp.d)
        probs, _ = self.router(xf)
        h1 = torch.einsum("nd,edf->enf", xf, self.weight1)
        g, u = h1.chunk(2, -1)
        out = torch.einsum("enf,efd->end", F.silu(g) * u, self.weight2)
        y = torch.einsum("ne,end->nd", probs, out)
        sg, su = self.shared_fc1(xf).chunk(2, -1)
        y = y + self.shared_fc2(F.silu(sg) * su)
        return self.post_mlp_layernorm(y).view_as(x)


class _MegatronLayer(nn.Module):
    def __init__(self, t, i, hp):
        super().__init__()
        p = _layer(i)
        self.self_attention = _MegatronMLA(t, p, hp)
        self.mlp = _MegatronMoE(t, p, hp) if hp.kinds[i] == "sparse" else _MegatronDenseMLP(t, p, hp)

    def forward(self, x, cos, sin, allowed):
        x = x + self.self_attention(x, cos, sin, allowed)
        return x + self.mlp(x)


class _MegatronGPT(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        self.embedding = nn.Module()
        self.embedding.word_embeddings = Proj(t["model.embed_tokens.weight"])
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_MegatronLayer(t, i, hp) for i in range(hp.L)])
        self.decoder.final_layernorm = RMSNorm(t["model.norm.weight"], hp.eps)
        self.output_layer = Proj(t["lm_head.weight"])
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        freqs = (pos[..., None].float() * self.inv_freq).repeat_interleave(2, -1)
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]  # (B, 1, T, dr)
        allowed = _allowed(_key_ok(input_ids, attention_mask))[:, None]
        x = F.embedding(input_ids, self.embedding.word_embeddings.weight)
        for layer in self.decoder.layers:
            x = layer(x, cos, sin, allowed)
        return self.output_layer(self.decoder.final_layernorm(x))


def _build_megatron_te(t, hp):
    return _MegatronGPT(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# folded_rotmat: gains folded, deferred 1/rms, rotation-matrix RoPE, shared expert as extra experts
# ----------------------------------------------------------------------------------------------------------------
def _inv_rms(x, eps):
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotation_matrices(hp, pos):
    """(..., dr, dr) block-diagonal rotations acting on interleaved pairs."""
    ang = pos[..., None].float() * hp.inv_freq()
    c, s = ang.cos(), ang.sin()
    R = torch.zeros(*pos.shape, hp.dr, hp.dr)
    ev, od = torch.arange(0, hp.dr, 2), torch.arange(1, hp.dr, 2)
    R[..., ev, ev] = c
    R[..., ev, od] = -s
    R[..., od, ev] = s
    R[..., od, od] = c
    return R


class _FoldedLayer(nn.Module):
    def __init__(self, t, i, hp):
        super().__init__()
        self.hp = hp
        p = _layer(i)
        a = p + "self_attn."
        g_in = t[p + "input_layernorm.weight"][None, :]
        self.q_down = _P(t[a + "q_a_proj.weight"] * g_in)
        self.kv_down = _P(t[a + "kv_a_proj_with_mqa.weight"] * g_in)
        self.q_up = _P(t[a + "q_b_proj.weight"] * t[a + "q_a_layernorm.weight"][None, :] * hp.scale)
        self.kv_up = _P(t[a + "kv_b_proj.weight"] * t[a + "kv_a_layernorm.weight"][None, :])
        self.out = _P(t[a + "o_proj.weight"])
        g_post = t[p + "post_attention_layernorm.weight"][None, :]
        m = p + "mlp."
        self.sparse = hp.kinds[i] == "sparse"
        if self.sparse:
            self.router = _P(t[m + "gate.weight"] * g_post)
            self.register_buffer("router_bias", t[m + "gate.e_score_correction_bias"].clone())
            gu = t[m + "experts.gate_up_proj"]
            gate, up, down = [gu[:, : hp.Im]], [gu[:, hp.Im :]], [t[m + "experts.down_proj"]]
            sg, su = t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"]
            sd = t[m + "shared_experts.down_proj.weight"]
            gate.append(sg.view(hp.S, hp.Im, hp.d))
            up.append(su.view(hp.S, hp.Im, hp.d))
            down.append(sd.view(hp.d, hp.S, hp.Im).transpose(0, 1))
            self.w_gate = _P(torch.cat(gate) * g_post[None])  # (E + S, I, d)
            self.w_up = _P(torch.cat(up) * g_post[None])
            self.w_down = _P(torch.cat(down))  # (E + S, d, I)
            self.moe_out_gain = _P(t[m + "post_mlp_layernorm.weight"])
        else:
            self.ffn_gate = _P(t[m + "gate_proj.weight"] * g_post)
            self.ffn_up = _P(t[m + "up_proj.weight"] * g_post)
            self.ffn_down = _P(t[m + "down_proj.weight"])

    def forward(self, x, R, mask):
        hp = self.hp
        B, T, _ = x.shape
        r = _inv_rms(x, hp.eps)
        cq = F.linear(x, self.q_down) * r
        q = (F.linear(cq, self.q_up) * _inv_rms(cq, hp.lat_eps)).view(B, T, hp.H, hp.dn + hp.dr)
        c, k_pe = (F.linear(x, self.kv_down) * r).split([hp.kr, hp.dr], -1)
        kv = (F.linear(c, self.kv_up) * _inv_rms(c, hp.lat_eps)).view(B, T, hp.H, hp.dn + hp.dv)
        q_nope, q_pe = q.split([hp.dn, hp.dr], -1)
        k_nope, v = kv.split([hp.dn, hp.dv], -1)
        q_pe = torch.einsum("bted,bthd->bthe", R, q_pe)
        k_pe = torch.einsum("bted,btd->bte", R, k_pe)
        qh = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
        kh = torch.cat([k_nope, k_pe[:, :, None].expand(B, T, hp.H, hp.dr)], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, v.transpose(1, 2), attn_mask=mask, scale=1.0)
        x = x + F.linear(o.transpose(1, 2).reshape(B, T, hp.H * hp.dv), self.out)
        r = _inv_rms(x, hp.eps)
        if not self.sparse:
            act = F.silu(F.linear(x, self.ffn_gate) * r) * (F.linear(x, self.ffn_up) * r)
            return x + F.linear(act, self.ffn_down)
        return x + self._moe(x * r)

    def _moe(self, xn):
        hp = self.hp
        xf = xn.reshape(-1, hp.d)
        N = xf.shape[0]
        s = torch.sigmoid(F.linear(xf, self.router))
        sel = (s + self.router_bias).view(N, hp.G, hp.gs)
        gsc = sel.topk(2, -1).values.sum(-1)
        gidx = gsc.topk(hp.TG, -1).indices  # (N, TG)
        cand = sel.gather(1, gidx[..., None].expand(N, hp.TG, hp.gs)).flatten(1)  # candidates of kept groups
        cand_id = (gidx[..., None] * hp.gs + torch.arange(hp.gs)).flatten(1)
        pick = cand.topk(hp.K, -1).indices
        idx = cand_id.gather(1, pick)
        w = s.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * hp.rsf
        idx_all = torch.cat([idx, (hp.E + torch.arange(hp.S)).expand(N, hp.S)], 1)
        w_all = torch.cat([w, torch.ones(N, hp.S)], 1)
        y = torch.zeros_like(xf)
        for e in range(hp.E + hp.S):
            tok, slot = torch.where(idx_all == e)
            if tok.numel() == 0:
                continue
            xe = xf[tok]
            out = F.linear(F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e]), self.w_down[e])
            y.index_add_(0, tok, out * w_all[tok, slot, None])
        return (y * _inv_rms(y, hp.eps) * self.moe_out_gain).view_as(xn)


class _FoldedLM(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        self.tok_emb = _P(t["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_FoldedLayer(t, i, hp) for i in range(hp.L)])
        self.head = _P(t["lm_head.weight"] * t["model.norm.weight"][None, :])
        self.register_buffer("rot", _rotation_matrices(hp, torch.arange(hp.max_pos)), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hp = self.hp
        pos = _positions(input_ids, position_ids)
        R = self.rot[pos] if int(pos.max()) < self.rot.shape[0] else _rotation_matrices(hp, pos)
        allowed = _allowed(_key_ok(input_ids, attention_mask))
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]
        x = F.embedding(input_ids, self.tok_emb)
        for layer in self.layers:
            x = layer(x, R, mask)
        return F.linear(x, self.head) * _inv_rms(x, hp.eps)


def _build_folded_rotmat(t, hp):
    return _FoldedLM(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# tp2_ep2: simulated tensor/expert-parallel shards, partial sums added
# ----------------------------------------------------------------------------------------------------------------
def _tp_degree(hp):
    ok = all(n % 2 == 0 for n in (hp.H, hp.I, hp.E, hp.Is, hp.V))
    return 2 if ok else 1


def _neox_rows(hp):
    return torch.cat([torch.arange(0, hp.dr, 2), torch.arange(1, hp.dr, 2)])


class _TPAttnShard(nn.Module):
    def __init__(self, q_b, kv_b, o):
        super().__init__()
        self.q_b_proj = _P(q_b)
        self.kv_b_proj = _P(kv_b)
        self.o_proj = _P(o)


class _TPLayer(nn.Module):
    def __init__(self, t, i, hp, tp):
        super().__init__()
        self.hp, self.tp = hp, tp
        p = _layer(i)
        a = p + "self_attn."
        nx = _neox_rows(hp)
        self.input_layernorm = _P(t[p + "input_layernorm.weight"])
        kva = t[a + "kv_a_proj_with_mqa.weight"].clone()
        kva[hp.kr :] = kva[hp.kr :][nx]
        self.fused_qkv_a_proj_with_mqa = _P(torch.cat([t[a + "q_a_proj.weight"], kva], 0))
        self.q_a_layernorm = _P(t[a + "q_a_layernorm.weight"])
        self.kv_a_layernorm = _P(t[a + "kv_a_layernorm.weight"])
        qb = t[a + "q_b_proj.weight"].view(hp.H, hp.dn + hp.dr, hp.qr).clone()
        qb[:, hp.dn :] = qb[:, hp.dn :][:, nx]
        kvb = t[a + "kv_b_proj.weight"].view(hp.H, hp.dn + hp.dv, hp.kr)
        o = t[a + "o_proj.weight"].view(hp.d, hp.H, hp.dv)
        hr = hp.H // tp
        self.attn_ranks = nn.ModuleList(
            [
                _TPAttnShard(
                    qb[r * hr : (r + 1) * hr].reshape(-1, hp.qr),
                    kvb[r * hr : (r + 1) * hr].reshape(-1, hp.kr),
                    o[:, r * hr : (r + 1) * hr].reshape(hp.d, -1),
                )
                for r in range(tp)
            ]
        )
        self.post_attention_layernorm = _P(t[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        self.sparse = hp.kinds[i] == "sparse"
        if self.sparse:
            self.gate = _P(t[m + "gate.weight"])
            self.register_buffer("e_score_correction_bias", t[m + "gate.e_score_correction_bias"].clone())
            er = hp.E // tp
            self.w13_weight = nn.ParameterList(
                [_P(t[m + "experts.gate_up_proj"][r * er : (r + 1) * er]) for r in range(tp)]
            )
            self.w2_weight = nn.ParameterList(
                [_P(t[m + "experts.down_proj"][r * er : (r + 1) * er]) for r in range(tp)]
            )
            sg, su = t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"]
            sdn = t[m + "shared_experts.down_proj.weight"]
            self.shared_gate_up = nn.ParameterList()
            self.shared_down = nn.ParameterList()
            isr = hp.Is // tp
            for r in range(tp):
                sl = slice(r * isr, (r + 1) * isr)
                self.shared_gate_up.append(_P(torch.cat([sg[sl], su[sl]], 0)))
                self.shared_down.append(_P(sdn[:, sl]))
            self.post_mlp_layernorm = _P(t[m + "post_mlp_layernorm.weight"])
        else:
            ir = hp.I // tp
            g, u, dn = t[m + "gate_proj.weight"], t[m + "up_proj.weight"], t[m + "down_proj.weight"]
            self.gate_up_proj = nn.ParameterList(
                [_P(torch.cat([g[r * ir : (r + 1) * ir], u[r * ir : (r + 1) * ir]], 0)) for r in range(tp)]
            )
            self.down_proj = nn.ParameterList([_P(dn[:, r * ir : (r + 1) * ir]) for r in range(tp)])

    def forward(self, x, cos, sin, bias):
        hp = self.hp
        B, T, _ = x.shape
        h = _rms(x, self.input_layernorm, hp.eps)
        cq, c, k_pe = F.linear(h, self.fused_qkv_a_proj_with_mqa).split([hp.qr, hp.kr, hp.dr], -1)
        cq = _rms(cq, self.q_a_layernorm, hp.lat_eps)
        c = _rms(c, self.kv_a_layernorm, hp.lat_eps)
        half = hp.dr // 2
        k1, k2 = k_pe[..., :half], k_pe[..., half:]
        k_pe = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1)  # (B, T, dr)
        partial = []
        for shard in self.attn_ranks:  # each rank: its heads, then its slice of o_proj
            q = F.linear(cq, shard.q_b_proj).view(B, T, -1, hp.dn + hp.dr)
            hr = q.shape[2]
            q_nope, q_pe = q.split([hp.dn, hp.dr], -1)
            q1, q2 = q_pe[..., :half], q_pe[..., half:]
            c4, s4 = cos[:, :, None], sin[:, :, None]
            q_pe = torch.cat([q1 * c4 - q2 * s4, q2 * c4 + q1 * s4], -1)
            kv = F.linear(c, shard.kv_b_proj).view(B, T, hr, hp.dn + hp.dv)
            k_nope, v = kv.split([hp.dn, hp.dv], -1)
            qq = torch.cat([q_nope, q_pe], -1).permute(0, 2, 1, 3).reshape(B * hr, T, -1)
            kk = (
                torch.cat([k_nope, k_pe[:, :, None].expand(B, T, hr, hp.dr)], -1)
                .permute(0, 2, 1, 3)
                .reshape(B * hr, T, -1)
            )
            vv = v.permute(0, 2, 1, 3).reshape(B * hr, T, hp.dv)
            bb = bias[:, None].expand(B, hr, T, T).reshape(B * hr, T, T)
            sc = torch.baddbmm(bb, qq, kk.transpose(1, 2), alpha=hp.scale)
            o = torch.bmm(torch.softmax(sc, -1), vv).view(B, hr, T, hp.dv).permute(0, 2, 1, 3).reshape(B, T, -1)
            partial.append(F.linear(o, shard.o_proj))
        x = x + sum(partial)  # all-reduce
        h = _rms(x, self.post_attention_layernorm, hp.eps)
        if not self.sparse:
            parts = []
            for gu, dn in zip(self.gate_up_proj, self.down_proj):
                g, u = F.linear(h, gu).chunk(2, -1)
                parts.append(F.linear(F.silu(g) * u, dn))
            return x + sum(parts)
        return x + self._moe(h)

    def _moe(self, h):
        hp = self.hp
        xf = h.reshape(-1, hp.d)
        N = xf.shape[0]
        s = torch.sigmoid(F.linear(xf, self.gate))
        sel = s + self.e_score_correction_bias
        gsc = sel.view(N, hp.G, hp.gs).topk(2, -1, sorted=True).values.sum(-1)
        gsel = gsc.argsort(-1, descending=True)[:, : hp.TG]
        gmask = torch.zeros(N, hp.G).scatter_(1, gsel, 1.0)
        sel = torch.where(gmask.repeat_interleave(hp.gs, -1) > 0, sel, torch.full_like(sel, float("-inf")))
        idx = sel.topk(hp.K, -1, sorted=True).indices
        w = s.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * hp.rsf
        partial = []
        for r, (w13, w2) in enumerate(zip(self.w13_weight, self.w2_weight)):  # expert-parallel ranks
            er = w13.shape[0]
            y = torch.zeros_like(xf)
            for el in range(er):
                tok, slot = torch.where(idx == r * er + el)
                if tok.numel() == 0:
                    continue
                g, u = F.linear(xf[tok], w13[el]).chunk(2, -1)
                y.index_add_(0, tok, F.linear(F.silu(g) * u, w2[el]) * w[tok, slot, None])
            partial.append(y)
        for gu, dn in zip(self.shared_gate_up, self.shared_down):  # tensor-parallel shared expert
            g, u = F.linear(xf, gu).chunk(2, -1)
            partial.append(F.linear(F.silu(g) * u, dn))
        y = sum(partial)
        return _rms(y, self.post_mlp_layernorm, hp.eps).view_as(h)


class _TPModel(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        tp = _tp_degree(hp)
        self.tp = tp
        vr = hp.V // tp
        emb, head = t["model.embed_tokens.weight"], t["lm_head.weight"]
        self.embed_shards = nn.ParameterList([_P(emb[r * vr : (r + 1) * vr]) for r in range(tp)])
        self.layers = nn.ModuleList([_TPLayer(t, i, hp, tp) for i in range(hp.L)])
        self.norm = _P(t["model.norm.weight"])
        self.lm_head_shards = nn.ParameterList([_P(head[r * vr : (r + 1) * vr]) for r in range(tp)])
        ang = torch.outer(torch.arange(hp.max_pos, dtype=torch.float32), hp.inv_freq())
        self.register_buffer("cos_sin_cache", torch.cat([ang.cos(), ang.sin()], -1), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hp = self.hp
        pos = _positions(input_ids, position_ids)
        if int(pos.max()) < self.cos_sin_cache.shape[0]:
            cs = self.cos_sin_cache[pos]
        else:
            ang = pos[..., None].float() * hp.inv_freq()
            cs = torch.cat([ang.cos(), ang.sin()], -1)
        cos, sin = cs.chunk(2, -1)
        allowed = _allowed(_key_ok(input_ids, attention_mask))
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        x = 0
        for r, shard in enumerate(self.embed_shards):  # vocab-parallel embedding
            local = input_ids - r * shard.shape[0]
            inside = (local >= 0) & (local < shard.shape[0])
            x = x + F.embedding(local.clamp(0, shard.shape[0] - 1), shard) * inside[..., None]
        for layer in self.layers:
            x = layer(x, cos, sin, bias)
        h = _rms(x, self.norm, hp.eps)
        return torch.cat([F.linear(h, shard) for shard in self.lm_head_shards], -1)


def _build_tp2_ep2(t, hp):
    return _TPModel(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# per_head_reim: per-head parameters, RoPE as real/imag projections, head loop, gather+bmm experts
# ----------------------------------------------------------------------------------------------------------------
def _rms_div(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _interleave_rows(a, b):
    return torch.stack([a, b], 1).reshape(-1, a.shape[-1])


class _HeadLayer(nn.Module):
    def __init__(self, t, i, hp):
        super().__init__()
        self.hp = hp
        p = _layer(i)
        a = p + "self_attn."
        self.norm_attn = _P(t[p + "input_layernorm.weight"])
        self.w_qa = _P(t[a + "q_a_proj.weight"])
        self.norm_qa = _P(t[a + "q_a_layernorm.weight"])
        qb = t[a + "q_b_proj.weight"].view(hp.H, hp.dn + hp.dr, hp.qr)
        self.q_nope = nn.ParameterList([_P(qb[h, : hp.dn]) for h in range(hp.H)])
        self.q_re = nn.ParameterList([_P(qb[h, hp.dn :: 2]) for h in range(hp.H)])
        self.q_im = nn.ParameterList([_P(qb[h, hp.dn + 1 :: 2]) for h in range(hp.H)])
        kva = t[a + "kv_a_proj_with_mqa.weight"]
        self.w_kva = _P(kva[: hp.kr])
        self.k_re = _P(kva[hp.kr :: 2])
        self.k_im = _P(kva[hp.kr + 1 :: 2])
        self.norm_kva = _P(t[a + "kv_a_layernorm.weight"])
        kvb = t[a + "kv_b_proj.weight"].view(hp.H, hp.dn + hp.dv, hp.kr)
        self.k_up = nn.ParameterList([_P(kvb[h, : hp.dn]) for h in range(hp.H)])
        self.v_up = nn.ParameterList([_P(kvb[h, hp.dn :]) for h in range(hp.H)])
        o = t[a + "o_proj.weight"].view(hp.d, hp.H, hp.dv)
        self.o_head = nn.ParameterList([_P(o[:, h]) for h in range(hp.H)])
        self.norm_ffn = _P(t[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        self.sparse = hp.kinds[i] == "sparse"
        if self.sparse:
            self.router_w = _P(t[m + "gate.weight"])
            self.register_buffer("router_b", t[m + "gate.e_score_correction_bias"].clone())
            gu = t[m + "experts.gate_up_proj"]
            self.gate_t = _P(gu[:, : hp.Im].transpose(1, 2))  # (E, d, I)
            self.up_t = _P(gu[:, hp.Im :].transpose(1, 2))
            self.down_t = _P(t[m + "experts.down_proj"].transpose(1, 2))  # (E, I, d)
            self.sh_gu = _P(
                _interleave_rows(t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"])
            )
            self.sh_down = _P(t[m + "shared_experts.down_proj.weight"])
            self.norm_moe_out = _P(t[m + "post_mlp_layernorm.weight"])
        else:
            self.w_gu = _P(_interleave_rows(t[m + "gate_proj.weight"], t[m + "up_proj.weight"]))
            self.w_down = _P(t[m + "down_proj.weight"])

    @staticmethod
    def _swiglu_interleaved(h, w_gu, w_down):
        gu = (h @ w_gu.t()).view(*h.shape[:-1], -1, 2)
        return (F.silu(gu[..., 0]) * gu[..., 1]) @ w_down.t()

    def forward(self, x, cos, sin, allowed):
        hp = self.hp
        h = _rms_div(x, self.norm_attn, hp.eps)
        cq = _rms_div(h @ self.w_qa.t(), self.norm_qa, hp.lat_eps)
        c = _rms_div(h @ self.w_kva.t(), self.norm_kva, hp.lat_eps)
        kre, kim = h @ self.k_re.t(), h @ self.k_im.t()
        kre, kim = kre * cos - kim * sin, kre * sin + kim * cos
        att = 0
        for hd in range(hp.H):
            qn = cq @ self.q_nope[hd].t()
            qre, qim = cq @ self.q_re[hd].t(), cq @ self.q_im[hd].t()
            qre, qim = qre * cos - qim * sin, qre * sin + qim * cos
            kn = c @ self.k_up[hd].t()
            v = c @ self.v_up[hd].t()
            s = qn @ kn.transpose(-1, -2) + qre @ kre.transpose(-1, -2) + qim @ kim.transpose(-1, -2)
            s = (s * hp.scale).masked_fill(~allowed, float("-inf"))
            pr = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
            att = att + (pr @ v) @ self.o_head[hd].t()
        x = x + att
        h = _rms_div(x, self.norm_ffn, hp.eps)
        if not self.sparse:
            return x + self._swiglu_interleaved(h, self.w_gu, self.w_down)
        return x + self._moe(h)

    def _moe(self, h):
        hp = self.hp
        xf = h.reshape(-1, hp.d)
        N = xf.shape[0]
        rows = torch.arange(N)
        probs = torch.sigmoid(xf @ self.router_w.t())
        sel = probs + self.router_b
        grp = sel.view(N, hp.G, hp.gs)
        m1, a1 = grp.max(-1)
        m2 = grp.scatter(-1, a1[..., None], float("-inf")).max(-1).values
        gsc = (m1 + m2).clone()
        keep = torch.zeros(N, hp.G, dtype=torch.bool)
        for _ in range(hp.TG):
            a = gsc.argmax(-1)
            keep[rows, a] = True
            gsc[rows, a] = float("-inf")
        cand = sel.masked_fill(~keep.repeat_interleave(hp.gs, -1), float("-inf"))
        picks = []
        for _ in range(hp.K):
            a = cand.argmax(-1)
            picks.append(a)
            cand = cand.clone()
            cand[rows, a] = float("-inf")
        idx = torch.stack(picks, -1)
        w = probs.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * hp.rsf
        flat = idx.reshape(-1)
        xs = xf.repeat_interleave(hp.K, 0)[:, None]  # (N*K, 1, d)
        a = F.silu(torch.bmm(xs, self.gate_t[flat])) * torch.bmm(xs, self.up_t[flat])
        out = torch.bmm(a, self.down_t[flat]).view(N, hp.K, hp.d)
        y = (out * w[..., None]).sum(1) + self._swiglu_interleaved(xf, self.sh_gu, self.sh_down)
        return _rms_div(y, self.norm_moe_out, hp.eps).view_as(h)


class _HeadLM(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        self.emb = _P(t["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_HeadLayer(t, i, hp) for i in range(hp.L)])
        self.norm_out = _P(t["model.norm.weight"])
        self.unembed = _P(t["lm_head.weight"].t())  # (d, V)
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hp = self.hp
        pos = _positions(input_ids, position_ids)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()  # (B, T, dr/2)
        allowed = _allowed(_key_ok(input_ids, attention_mask))
        x = F.one_hot(input_ids, hp.V).float() @ self.emb
        for layer in self.layers:
            x = layer(x, cos, sin, allowed)
        return _rms_div(x, self.norm_out, hp.eps) @ self.unembed


def _build_per_head_reim(t, hp):
    return _HeadLM(t, hp)


# ----------------------------------------------------------------------------------------------------------------
# mqa_latent: MLA absorbed at load into MQA over the latent, polar RoPE, padded grouped-GEMM experts
# ----------------------------------------------------------------------------------------------------------------
def _polar_rope(x, pos, inv_freq):
    """x (..., T, dr) interleaved pairs; pos broadcastable to (..., T)."""
    ang = pos[..., None].float() * inv_freq
    rot = torch.polar(torch.ones_like(ang), ang)
    xc = torch.view_as_complex(x.contiguous().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rot).flatten(-2)


class _MQALayer(nn.Module):
    def __init__(self, t, i, hp):
        super().__init__()
        self.hp = hp
        p = _layer(i)
        a = p + "self_attn."
        g_in = t[p + "input_layernorm.weight"][None, :]
        self.w_down = _P(torch.cat([t[a + "q_a_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]], 0) * g_in)
        qb = t[a + "q_b_proj.weight"].view(hp.H, hp.dn + hp.dr, hp.qr) * t[a + "q_a_layernorm.weight"]
        kvb = t[a + "kv_b_proj.weight"].view(hp.H, hp.dn + hp.dv, hp.kr) * t[a + "kv_a_layernorm.weight"]
        w_uk, w_uv = kvb[:, : hp.dn], kvb[:, hp.dn :]
        self.wq_latent = _P(torch.einsum("hdc,hdr->hcr", w_uk, qb[:, : hp.dn]))  # (H, r_kv, r_q)
        self.wq_rope = _P(qb[:, hp.dn :])  # (H, dr, r_q)
        o = t[a + "o_proj.weight"].view(hp.d, hp.H, hp.dv)
        self.wo_latent = _P(torch.einsum("dhv,hvc->hdc", o, w_uv))  # (H, d, r_kv)
        self.mlp_norm = _P(t[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        self.sparse = hp.kinds[i] == "sparse"
        if self.sparse:
            self.gate_w = _P(t[m + "gate.weight"])
            self.register_buffer("gate_b", t[m + "gate.e_score_correction_bias"].clone())
            self.w13 = _P(t[m + "experts.gate_up_proj"].transpose(1, 2))  # (E, d, 2I)
            self.w2 = _P(t[m + "experts.down_proj"].transpose(1, 2))  # (E, I, d)
            self.shared = SwiGLU(
                t[m + "shared_experts.gate_proj.weight"],
                t[m + "shared_experts.up_proj.weight"],
                t[m + "shared_experts.down_proj.weight"],
            )
            self.out_norm = _P(t[m + "post_mlp_layernorm.weight"])
        else:
            self.mlp = SwiGLU(t[m + "gate_proj.weight"], t[m + "up_proj.weight"], t[m + "down_proj.weight"])

    def forward(self, x, pos, inv_freq, mask):
        hp = self.hp
        B, T, _ = x.shape
        xn = x * _inv_rms(x, hp.eps)
        cq, c, k_pe = F.linear(xn, self.w_down).split([hp.qr, hp.kr, hp.dr], -1)
        cq = cq * _inv_rms(cq, hp.lat_eps)
        c = c * _inv_rms(c, hp.lat_eps)
        q_lat = torch.einsum("btr,hcr->bhtc", cq, self.wq_latent)
        q_pe = _polar_rope(torch.einsum("btr,hpr->bhtp", cq, self.wq_rope), pos[:, None], inv_freq)
        k_pe = _polar_rope(k_pe, pos, inv_freq)
        q = torch.cat([q_lat, q_pe], -1)  # (B, H, T, r_kv + dr)
        k = torch.cat([c, k_pe], -1)[:, None]  # (B, 1, T, r_kv + dr): one shared key head
        v = c[:, None]  # (B, 1, T, r_kv): the latent itself is the value
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hp.scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hp.scale, enable_gqa=True)
        x = x + torch.einsum("bhtc,hdc->btd", o, self.wo_latent)
        h = _rms(x, self.mlp_norm, hp.eps)
        if not self.sparse:
            return x + self.mlp(h)
        return x + self._moe(h)

    def _moe(self, h):
        hp = self.hp
        xf = h.reshape(-1, hp.d)
        N = xf.shape[0]
        s = torch.sigmoid(F.linear(xf, self.gate_w))
        sel = s + self.gate_b
        gsc = sel.view(N, hp.G, hp.gs).topk(2, -1).values.sum(-1)
        gi = gsc.topk(hp.TG, -1).indices
        keep = torch.zeros(N, hp.G, dtype=torch.bool).scatter(1, gi, True)
        sel = sel.view(N, hp.G, hp.gs).masked_fill(~keep[..., None], float("-inf")).view(N, hp.E)
        idx = sel.topk(hp.K, -1).indices
        w = s.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * hp.rsf
        flat_e = idx.reshape(-1)
        order = flat_e.argsort(stable=True)
        e_sorted = flat_e[order]
        tok_sorted = order // hp.K
        w_sorted = w.reshape(-1)[order]
        counts = torch.bincount(flat_e, minlength=hp.E)
        offsets = torch.cumsum(counts, 0) - counts
        row = torch.arange(flat_e.numel()) - offsets[e_sorted]
        cap = int(counts.max().item())
        buf = torch.zeros(hp.E, cap, hp.d)
        buf[e_sorted, row] = xf[tok_sorted]
        g, u = torch.bmm(buf, self.w13).chunk(2, -1)
        res = torch.bmm(F.silu(g) * u, self.w2)  # (E, cap, d)
        y = torch.zeros_like(xf).index_add_(0, tok_sorted, res[e_sorted, row] * w_sorted[:, None])
        y = y + self.shared(xf)
        return _rms(y, self.out_norm, hp.eps).view_as(h)


class _MQALM(nn.Module):
    def __init__(self, t, hp):
        super().__init__()
        self.hp = hp
        self.embed_tokens = _P(t["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_MQALayer(t, i, hp) for i in range(hp.L)])
        self.final_norm = _P(t["model.norm.weight"])
        self.lm_head = _P(t["lm_head.weight"])
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hp = self.hp
        pos = _positions(input_ids, position_ids)
        key_ok = _key_ok(input_ids, attention_mask)
        mask = None if bool(key_ok.all()) else _allowed(key_ok)[:, None]
        x = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, pos, self.inv_freq, mask)
        return F.linear(_rms(x, self.final_norm, hp.eps), self.lm_head)


def _build_mqa_latent(t, hp):
    return _MQALM(t, hp)


# ----------------------------------------------------------------------------------------------------------------
_BUILDERS = {
    "": _build_baseline,
    "ds_ref_absorb": _build_ds_ref_absorb,
    "gguf_flat": _build_gguf_flat,
    "flax_scan": _build_flax_scan,
    "megatron_te": _build_megatron_te,
    "folded_rotmat": _build_folded_rotmat,
    "tp2_ep2": _build_tp2_ep2,
    "per_head_reim": _build_per_head_reim,
    "mqa_latent": _build_mqa_latent,
}


def build(state_dict, config):
    """The port in the layout named by the module global ``BUG`` (read now), eval mode, float32."""
    layout = BUG
    if layout not in _BUILDERS:
        raise ValueError(f"unknown layout {layout!r}")
    hp = _HP(config)
    t = _canon(state_dict, hp)
    with torch.no_grad():
        model = _BUILDERS[layout](t, hp)
    model.layout = layout
    return model.float().eval()
