"""Sarvam-MoE (Transformers' ``Glm4MoeForCausalLM``, model_type ``sarvam_moe``) ported by hand to plain PyTorch,
in a baseline layout and eight other (correct) layouts.

Architecture, as this port implements it
========================================
Notation: D hidden size, V vocab, L layers, nH query heads, nKV key/value heads (rep = nH / nKV queries share
one key/value head), Hd head dim, R = int(Hd * partial_rotary_factor) rotary dims (R/2 frequencies), E routed
experts, K experts per token, G expert groups (n = E / G experts each), TG groups kept per token, Im the
width of one expert, I the width of the dense MLP.

* embedding: h0 = Emb[ids]                                                              (no scaling)
* RMSNorm(x; g) = g * x / sqrt(mean(x^2) + eps)                                         (gain multiplies)
* each of the L pre-norm decoder layers:
      a = RMSNorm(h; g_in);  h = h + Attn(a);  m = RMSNorm(h; g_post);  h = h + FFN(m)
  FFN is a SwiGLU MLP  W_down (silu(W_gate m) * (W_up m))  for layers < first_k_dense_replace, else the MoE.
* attention: q = W_q a + b_q, k = W_k a + b_k, v = W_v a + b_v (biases when attention_bias), split into heads of
  Hd; with use_qk_norm each q and k head vector is RMS-normalised over its Hd dims with its own gain (q_norm /
  k_norm, shared by all heads) BEFORE RoPE.  RoPE ("neox" / rotate-half pairing) rotates only the first R dims
  of each head: for i < R/2, the pair (x_i, x_{i+R/2}) turns by angle pos * theta^(-2i/R):
      x_i' = x_i cos - x_{i+R/2} sin,   x_{i+R/2}' = x_{i+R/2} cos + x_i sin,   dims R..Hd-1 pass unchanged.
  Scores q.k / sqrt(Hd), causal over the sequence index, padding keys (attention_mask == 0) excluded, softmax,
  weighted sum of v, heads concatenated, o = W_o ctx (no bias).  Query head j reads key/value head j // rep.
* MoE (sigmoid, bias-corrected, group-limited router, DeepSeek-V3 style):
      s = sigmoid(W_r m)                       (E scores, router has no bias)
      c = s + e_score_correction_bias          (used for the CHOICE only)
      group score = sum of the two largest c in each of the G groups; keep the TG best groups;
      choose the K largest c among experts of kept groups;
      weights w_k = s_k / (sum_k s_k + 1e-20) (norm_topk_prob) * routed_scaling_factor   (from s, not c)
      MoE(m) = sum_k w_k Expert_{e_k}(m) + Shared(m),   Expert_e(m) = Wd_e (silu(Wg_e m) * (Wu_e m))
  Shared is a SwiGLU MLP of width Im * n_shared_experts, always on, weight 1.
* logits = W_head RMSNorm(h_L; g_final)   (lm_head untied in this config; tied falls back to the embedding).
* positions: the given position_ids (0..S-1 when absent) drive RoPE only; the mask is causal over the index.
  Query rows that are padding (nothing to attend to) are kept finite (a finite mask value or self-attention on
  the diagonal); their outputs are never used.

``build`` reads ``BUG`` to pick the layout; every model's ``forward`` reads ``BUG`` again and refuses to run if it
no longer names the layout the model was built for.

Transformers' state-dict names read by ``build``: model.embed_tokens.weight, model.layers.N.{input_layernorm,
post_attention_layernorm}.weight, .self_attn.{q,k,v}_proj.{weight,bias}, .self_attn.o_proj.weight,
.self_attn.{q,k}_norm.weight, .mlp.{gate,up,down}_proj.weight (dense), .mlp.gate.weight,
.mlp.gate.e_score_correction_bias, .mlp.experts.gate_up_proj (E, 2Im, D; gate rows first),
.mlp.experts.down_proj (E, D, Im), .mlp.shared_experts.{gate,up,down}_proj.weight, model.norm.weight,
lm_head.weight.

Layouts (``BUG`` selects one at build and at call time)
======================================================
"" (baseline) ``SarvamPort``: a module tree of my own names: ``embed``, ``blocks[i].{norm_attn, attn, norm_ffn,
    ffn}``, attn = ``query/key/value/out`` nn.Linear + ``q_norm/k_norm`` gains; dense ffn = ``gate/up/down``
    Linear; MoE ffn = ``router_weight`` (E,D), ``router_bias`` buffer, ``expert_gate_up`` (E,2Im,D),
    ``expert_down`` (E,D,Im), ``shared`` (gate/up/down).  RoPE from inv_freq each call, cos/sin duplicated over the
    R dims, rotate_half; eager attention with key/value heads expanded to nH and an additive finfo.min mask;
    router by masked top-k; experts in a loop over experts, tokens found with nonzero, index_add back.
"fused_sdpa_tables": ``tok_emb``, ``blocks[i]``: ``wqkv`` one Linear with rows [q; k; v] (and fused bias),
    ``q_gain/k_gain``, ``proj``; dense ffn and shared expert ``w_gate_up`` one Linear [gate; up] + ``w_down``;
    experts TRANSPOSED and stacked ``experts_in`` (E,D,2Im), ``experts_out`` (E,Im,D).  RoPE from precomputed
    cos/sin tables (max_positions, R) gathered by position id; attention by F.scaled_dot_product_attention with a
    boolean mask and kv heads repeat_interleave'd; every expert run densely on every token with batched bmm,
    mixed by a dense (T,E) combine matrix scattered from the routing.
"meta_complex_sorted": Meta-Llama names ``tok_embeddings``, ``layers[i].{attention_norm, attention.{wq,wk,wv,wo,
    q_norm,k_norm}, ffn_norm, feed_forward}``; the rotary rows of every q/k head (weights, biases and the q/k
    norm gains) PERMUTED at load so that rotary pairs are adjacent (interleaved convention); RoPE as complex
    multiplication (view_as_complex * polar(1, angle)); attention in (B,S,H,Hd) with -inf masking; routed
    experts as a ModuleList of Mixtral-style FeedForward(w1 gate, w3 up, w2 down); router picks the kept groups
    then top-k among their experts gathered by index; tokens sorted by expert (argsort, bincount, split), each
    expert run on its contiguous slice, results scattered back.
"gguf_functional_gather": no module tree: one functional forward over a flat dict of llama.cpp/GGUF-named tensors
    (token_embd, blk.N.attn_norm/attn_q/attn_k/attn_v/attn_output/attn_q_norm/attn_k_norm/ffn_norm/
    ffn_gate_inp/exp_probs_b/ffn_{gate,up,down}_exps/ffn_{gate,up,down}_shexp, output_norm, output), every matrix
    stored TRANSPOSED (in, out) and applied as x @ W, experts as separate gate/up/down stacks.  RoPE as an
    explicit 2-D rotation of the two halves with half-size cos/sin; attention by einsum with grouped-query
    broadcasting (B,S,KV,rep,Hd) and no repeat; router by full sorts (sort / argsort); experts by gathering
    each (token, slot)'s expert matrices and a batched matmul per assignment.
"flax_scan_gshard": a JAX/Flax port: parameters STACKED over layers (attention kernels (L,D,N,Hd), out kernel
    (L,N,Hd,D), norms (L,D)) with dense and MoE layers in two stacks ((Ld,...), (Lm,E,D,Im), ...), RMSNorm scales
    stored ZERO-CENTRED (g - 1, applied as 1 + scale), router and lm_head as (D,E) / (D,V) kernels; the layer loop
    slices the stacks like a scan.  RoPE by the timescale formula (pos / theta^(2i/R)); attention by an
    online (flash-style, running max/denominator) softmax over key chunks; router builds dense selections by
    top-k thresholds; experts by GShard dispatch/combine einsums with capacity = tokens (nothing dropped).
"megatron_tp_ep": a Megatron-Core port run sequence-first [S,B,D]: ``decoder.layers[i].self_attention.linear_qkv``
    holds the input RMSNorm gain (``layer_norm_weight``, fused norm+linear) and the qkv weight per kv GROUP
    interleaved ([q heads of group g; k_g; v_g] ...), split over 2 tensor-parallel ranks; ``linear_proj`` split
    by input columns (row-parallel, partial sums added = all-reduce); dense MLP ``linear_fc1`` [gate_r; up_r]
    per rank + ``linear_fc2`` row-parallel; MoE ``router.weight``/``router.expert_bias``; routed experts held per
    expert-parallel rank as grouped-GEMM ``weight1`` (D, El*2Im) / ``weight2`` (El*Im, D); tokens permuted by
    expert and un-permuted with probabilities.  Attention by baddbmm(alpha = 1/sqrt(Hd)) with -10000 masking.
"folded_perhead_rotmat": an inference-engine load with every gain FOLDED: g_in into q/k/v, g_post into router,
    dense, shared and expert gate/up, 1/sqrt(Hd) into the q_norm gain, routed_scaling_factor into expert down
    matrices, g_final into the lm_head; norms carry no weights.  q/k/v held PER HEAD (N,Hd,D), o per head
    (N,D,Hd); attention in a loop over query heads, summing per-head output projections; RoPE as per-position
    2x2-block rotation MATRICES (B,S,R,R) applied by einsum; gate/up INTERLEAVED column-wise in transposed
    (D,2I) matrices; router by iterative argmax; experts in a loop over the experts that were hit.
"shared_as_expert_pertoken": GPT-2-like names ``wte``, ``h[i].{ln_1, attn.{c_q, c_kv, c_proj, q_ln, k_ln}, ln_2,
    mlp}``, k and v fused per kv head ([k_0; v_0; k_1; v_1] rows), MLP ``c_fc`` fused [up; gate] (reversed),
    norms by F.rms_norm; RoPE with full-head cos/sin (1 / 0 on the pass-through dims) so one formula covers the
    partial rotary; attention by SDPA with a float additive mask and enable_gqa; the shared expert APPENDED to
    the routed experts as expert(s) E.. with fixed weight 1 (split in Im-wide pieces when n_shared > 1); MoE
    evaluated token by token, slot by slot (notebook style).
"vllm_varlen_blocks": a vLLM-like engine: the left-padded batch is PACKED into one stream of real tokens (cu_seqlens),
    attention per sequence with SDPA(is_causal=True, enable_gqa) and no mask tensor, a vLLM cos_sin_cache
    (max_positions, R) = [cos | sin] indexed by position, fused add+RMSNorm carrying the residual separately,
    transposed ``qkv_proj_t``/``o_proj_t``/``gate_up_t`` matrices applied with addmm/mm, experts as ``w13``
    (E,2Im,D)/``w2`` (E,D,Im) run by a block-aligned grouped GEMM (assignments sorted by expert, padded to blocks
    of 4 with a dummy token, one bmm over blocks); logits scattered back to (B,S,V) (zeros at padding).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

CLEAN = [
    "fused_sdpa_tables",  # fused qkv / gate_up, rope cos-sin tables, SDPA, all experts run densely
    "meta_complex_sorted",  # Meta names, rows permuted to interleaved pairs, complex RoPE, experts sorted by expert
    "gguf_functional_gather",  # flat GGUF-named dict of transposed tensors, einsum GQA, per-assignment weight gather
    "flax_scan_gshard",  # layer-stacked JAX kernels, (1+scale) norms, online softmax, GShard dispatch/combine
    "megatron_tp_ep",  # sequence-first, per-group qkv split over TP ranks, fused norm, EP grouped GEMM
    "folded_perhead_rotmat",  # all gains/scales folded, per-head weights & loop, rotation matrices, interleaved glu
    "shared_as_expert_pertoken",  # GPT-2 names, fused kv, shared expert appended as always-on expert, per-token MoE
    "vllm_varlen_blocks",  # packed varlen tokens, cos_sin_cache, fused add+norm, block-aligned grouped GEMM
]
BUGS = []
PADDING_ONLY = []


# ----------------------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------------------
class _HP:
    """The hyper-parameters the port reads from the Transformers config object."""

    def __init__(self, c):
        self.D = c.hidden_size
        self.V = c.vocab_size
        self.L = c.num_hidden_layers
        self.nH = c.num_attention_heads
        self.nKV = c.num_key_value_heads
        self.Hd = getattr(c, "head_dim", None) or self.D // self.nH
        self.rep = self.nH // self.nKV
        self.I = c.intermediate_size
        self.Im = c.moe_intermediate_size
        self.nS = getattr(c, "n_shared_experts", 0) or 0
        self.E = c.n_routed_experts
        self.K = c.num_experts_per_tok
        self.G = getattr(c, "n_group", 1) or 1
        self.TG = getattr(c, "topk_group", 1) or 1
        self.rsf = float(getattr(c, "routed_scaling_factor", 1.0))
        self.norm_topk = bool(getattr(c, "norm_topk_prob", True))
        self.first_dense = getattr(c, "first_k_dense_replace", 0)
        self.qk_norm = bool(getattr(c, "use_qk_norm", False))
        self.attn_bias = bool(getattr(c, "attention_bias", False))
        self.eps = float(c.rms_norm_eps)
        self.max_pos = c.max_position_embeddings
        rp = dict(getattr(c, "rope_parameters", None) or {})
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rp.get('rope_type')!r}")
        self.theta = float(rp.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        prf = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
        self.R = int(self.Hd * prf)
        self.half = self.R // 2
        if getattr(c, "hidden_act", "silu") != "silu":
            raise NotImplementedError(c.hidden_act)
        self.scale = self.Hd**-0.5

    def is_moe(self, i):
        return i >= self.first_dense

    def inv_freq(self):
        return 1.0 / (self.theta ** (torch.arange(0, self.R, 2, dtype=torch.float32) / self.R))


def _p(t):
    return nn.Parameter(t.detach().clone().float(), requires_grad=False)


def _head_weight(sd):
    return sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]


class _Port(nn.Module):
    """Shared entry point: normalises the inputs, then runs the layout this model was built for."""

    layout = ""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        layout = BUG
        if layout != self.layout:
            raise ValueError(f"this model was built for layout {self.layout!r}, BUG is now {layout!r}")
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=dev).unsqueeze(0).expand(B, S)
        position_ids = position_ids.to(dev).long().expand(B, S)
        if attention_mask is None:
            valid = torch.ones(B, S, dtype=torch.bool, device=dev)
        else:
            valid = attention_mask.to(dev) != 0
        return self._logits(input_ids, valid, position_ids)


def _causal(S, device):
    i = torch.arange(S, device=device)
    return i[None, :] <= i[:, None]  # [query, key]


# ================================================================================================================
# baseline
# ================================================================================================================
class _Gain(nn.Module):
    def __init__(self, g, eps):
        super().__init__()
        self.gain = _p(g)
        self.eps = eps

    def forward(self, x):
        return self.gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _linear(w, b=None):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    lin.weight = _p(w)
    if b is not None:
        lin.bias = _p(b)
    return lin


def _rotate_half_partial(x, cos, sin, R):
    xr, xp = x[..., :R], x[..., R:]
    h = R // 2
    turned = torch.cat((-xr[..., h:], xr[..., :h]), dim=-1)
    return torch.cat((xr * cos + turned * sin, xp), dim=-1)


class _BaseAttention(nn.Module):
    def __init__(self, sd, p, hp):
        super().__init__()
        self.hp = hp
        b = hp.attn_bias
        self.query = _linear(sd[p + "q_proj.weight"], sd[p + "q_proj.bias"] if b else None)
        self.key = _linear(sd[p + "k_proj.weight"], sd[p + "k_proj.bias"] if b else None)
        self.value = _linear(sd[p + "v_proj.weight"], sd[p + "v_proj.bias"] if b else None)
        self.out = _linear(sd[p + "o_proj.weight"])
        if hp.qk_norm:
            self.q_norm = _Gain(sd[p + "q_norm.weight"], hp.eps)
            self.k_norm = _Gain(sd[p + "k_norm.weight"], hp.eps)

    def forward(self, x, cos, sin, additive):
        hp = self.hp
        B, S, _ = x.shape
        q = self.query(x).view(B, S, hp.nH, hp.Hd)
        k = self.key(x).view(B, S, hp.nKV, hp.Hd)
        v = self.value(x).view(B, S, hp.nKV, hp.Hd)
        if hp.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = _rotate_half_partial(q, cos, sin, hp.R)
        k = _rotate_half_partial(k, cos, sin, hp.R)
        k = k[:, :, None].expand(B, hp.nKV, hp.rep, S, hp.Hd).reshape(B, hp.nH, S, hp.Hd)
        v = v[:, :, None].expand(B, hp.nKV, hp.rep, S, hp.Hd).reshape(B, hp.nH, S, hp.Hd)
        scores = torch.matmul(q, k.transpose(-1, -2)) * hp.scale + additive
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, hp.nH * hp.Hd)
        return self.out(ctx)


class _BaseMLP(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.gate = _linear(sd[p + "gate_proj.weight"])
        self.up = _linear(sd[p + "up_proj.weight"])
        self.down = _linear(sd[p + "down_proj.weight"])

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _BaseMoE(nn.Module):
    def __init__(self, sd, p, hp):
        super().__init__()
        self.hp = hp
        self.router_weight = _p(sd[p + "gate.weight"])
        self.register_buffer("router_bias", sd[p + "gate.e_score_correction_bias"].detach().clone().float())
        self.expert_gate_up = _p(sd[p + "experts.gate_up_proj"])
        self.expert_down = _p(sd[p + "experts.down_proj"])
        self.shared = _BaseMLP(sd, p + "shared_experts.") if hp.nS > 0 else None

    def route(self, x):
        hp = self.hp
        T = x.shape[0]
        scores = torch.sigmoid(x @ self.router_weight.t())
        choice = scores + self.router_bias
        n = hp.E // hp.G
        group_score = choice.view(T, hp.G, n).topk(2, dim=-1).values.sum(-1)
        kept = group_score.topk(hp.TG, dim=-1).indices
        group_ok = torch.zeros(T, hp.G, dtype=torch.bool, device=x.device).scatter_(1, kept, True)
        expert_ok = group_ok.unsqueeze(-1).expand(T, hp.G, n).reshape(T, hp.E)
        idx = choice.masked_fill(~expert_ok, float("-inf")).topk(hp.K, dim=-1).indices
        w = scores.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * hp.rsf

    def forward(self, x):
        hp = self.hp
        shape = x.shape
        flat = x.reshape(-1, hp.D)
        idx, w = self.route(flat)
        out = torch.zeros_like(flat)
        for e in range(hp.E):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = (flat[tok] @ self.expert_gate_up[e].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.expert_down[e].t()
            out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
        out = out.view(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class _BaseBlock(nn.Module):
    def __init__(self, sd, i, hp):
        super().__init__()
        p = f"model.layers.{i}."
        self.norm_attn = _Gain(sd[p + "input_layernorm.weight"], hp.eps)
        self.attn = _BaseAttention(sd, p + "self_attn.", hp)
        self.norm_ffn = _Gain(sd[p + "post_attention_layernorm.weight"], hp.eps)
        self.ffn = _BaseMoE(sd, p + "mlp.", hp) if hp.is_moe(i) else _BaseMLP(sd, p + "mlp.")

    def forward(self, h, cos, sin, additive):
        h = h + self.attn(self.norm_attn(h), cos, sin, additive)
        return h + self.ffn(self.norm_ffn(h))


class SarvamPort(_Port):
    layout = ""

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        self.embed = nn.Embedding(hp.V, hp.D)
        self.embed.weight = _p(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([_BaseBlock(sd, i, hp) for i in range(hp.L)])
        self.final_norm = _Gain(sd["model.norm.weight"], hp.eps)
        self.unembed = _linear(_head_weight(sd))
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def _logits(self, ids, valid, pos):
        B, S = ids.shape
        h = self.embed(ids)
        ang = pos[..., None].float() * self.inv_freq
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        keep = _causal(S, ids.device)[None] & valid[:, None, :]
        additive = torch.zeros(B, 1, S, S, device=ids.device)
        additive = additive.masked_fill(~keep[:, None], torch.finfo(torch.float32).min)
        for blk in self.blocks:
            h = blk(h, cos, sin, additive)
        return self.unembed(self.final_norm(h))


# ================================================================================================================
# fused_sdpa_tables
# ================================================================================================================
class _FusedGLU(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.w_gate_up = _linear(torch.cat((gate, up), 0))
        self.w_down = _linear(down)

    def forward(self, x):
        g, u = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(g) * u)


class _FusedDenseExperts(nn.Module):
    def __init__(self, sd, p, hp):
        super().__init__()
        self.hp = hp
        self.router_w = _p(sd[p + "gate.weight"])
        self.register_buffer("router_b", sd[p + "gate.e_score_correction_bias"].detach().clone().float())
        self.experts_in = _p(sd[p + "experts.gate_up_proj"].transpose(1, 2))  # (E, D, 2Im)
        self.experts_out = _p(sd[p + "experts.down_proj"].transpose(1, 2))  # (E, Im, D)
        q = p + "shared_experts."
        self.shared = (
            _FusedGLU(sd[q + "gate_proj.weight"], sd[q + "up_proj.weight"], sd[q + "down_proj.weight"])
            if hp.nS > 0
            else None
        )

    def combine_matrix(self, x):
        hp = self.hp
        T = x.shape[0]
        s = torch.sigmoid(F.linear(x, self.router_w))
        biased = s + self.router_b
        n = hp.E // hp.G
        gscore = biased.unflatten(-1, (hp.G, n)).topk(2, dim=-1).values.sum(-1)
        gsel = gscore.topk(hp.TG, dim=-1).indices
        allowed = F.one_hot(gsel, hp.G).sum(1).bool().repeat_interleave(n, dim=-1)
        idx = biased.masked_fill(~allowed, float("-inf")).topk(hp.K, dim=-1).indices
        w = s.gather(-1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return torch.zeros(T, hp.E, device=x.device).scatter(1, idx, w * hp.rsf)

    def forward(self, x):
        hp = self.hp
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        combine = self.combine_matrix(flat)
        h = torch.bmm(flat.unsqueeze(0).expand(hp.E, -1, -1), self.experts_in)
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(g) * u, self.experts_out)  # (E, T, D)
        out = torch.einsum("etd,te->td", y, combine).view(B, S, D)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class _FusedBlock(nn.Module):
    def __init__(self, sd, i, hp):
        super().__init__()
        self.hp = hp
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.norm1_g = _p(sd[p + "input_layernorm.weight"])
        self.norm2_g = _p(sd[p + "post_attention_layernorm.weight"])
        w = torch.cat([sd[a + n + "_proj.weight"] for n in "qkv"], 0)
        b = torch.cat([sd[a + n + "_proj.bias"] for n in "qkv"], 0) if hp.attn_bias else None
        self.wqkv = _linear(w, b)
        self.proj = _linear(sd[a + "o_proj.weight"])
        if hp.qk_norm:
            self.q_gain = _p(sd[a + "q_norm.weight"])
            self.k_gain = _p(sd[a + "k_norm.weight"])
        m = p + "mlp."
        if hp.is_moe(i):
            self.ffn = _FusedDenseExperts(sd, m, hp)
        else:
            self.ffn = _FusedGLU(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])

    def _rms(self, x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hp.eps) * g

    def forward(self, h, cos, sin, mask):
        hp = self.hp
        B, S, _ = h.shape
        qkv = self.wqkv(self._rms(h, self.norm1_g))
        q, k, v = qkv.split([hp.nH * hp.Hd, hp.nKV * hp.Hd, hp.nKV * hp.Hd], dim=-1)
        q = q.view(B, S, hp.nH, hp.Hd)
        k = k.view(B, S, hp.nKV, hp.Hd)
        if hp.qk_norm:
            q, k = self._rms(q, self.q_gain), self._rms(k, self.k_gain)
        q = _rotate_half_partial(q.transpose(1, 2), cos, sin, hp.R)
        k = _rotate_half_partial(k.transpose(1, 2), cos, sin, hp.R).repeat_interleave(hp.rep, dim=1)
        v = v.view(B, S, hp.nKV, hp.Hd).transpose(1, 2).repeat_interleave(hp.rep, dim=1)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(ctx.transpose(1, 2).reshape(B, S, -1))
        return h + self.ffn(self._rms(h, self.norm2_g))


class FusedSdpaTables(_Port):
    layout = "fused_sdpa_tables"

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        self.tok_emb = _p(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([_FusedBlock(sd, i, hp) for i in range(hp.L)])
        self.norm_f = _p(sd["model.norm.weight"])
        self.head = _linear(_head_weight(sd))
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)
        cos, sin = self._table(torch.arange(hp.max_pos))
        self.register_buffer("cos_tab", cos, persistent=False)
        self.register_buffer("sin_tab", sin, persistent=False)

    def _table(self, positions):
        ang = positions.float()[..., None] * self.inv_freq
        ang = torch.cat((ang, ang), dim=-1)
        return ang.cos(), ang.sin()

    def _logits(self, ids, valid, pos):
        B, S = ids.shape
        if int(pos.max()) < self.cos_tab.shape[0] and int(pos.min()) >= 0:
            cos, sin = self.cos_tab[pos], self.sin_tab[pos]
        else:
            cos, sin = self._table(pos)
        cos, sin = cos[:, None], sin[:, None]
        eye = torch.eye(S, dtype=torch.bool, device=ids.device)
        mask = ((_causal(S, ids.device)[None] & valid[:, None, :]) | eye)[:, None]
        h = F.embedding(ids, self.tok_emb)
        for blk in self.blocks:
            h = blk(h, cos, sin, mask)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.hp.eps) * self.norm_f
        return self.head(h)


# ================================================================================================================
# meta_complex_sorted
# ================================================================================================================
def _interleave_perm(hp):
    """Within one head: new row j takes old row perm[j]; rotary pairs (i, i + R/2) become (2i, 2i + 1)."""
    h = hp.half
    perm = []
    for i in range(h):
        perm += [i, i + h]
    return torch.tensor(perm + list(range(hp.R, hp.Hd)))


def _permute_heads(t, n_heads, perm):
    """Permute the per-head rows of a (n_heads*Hd, ...) weight or (n_heads*Hd,) bias."""
    Hd = perm.numel()
    shaped = t.reshape(n_heads, Hd, *t.shape[1:])
    return shaped[:, perm].reshape(t.shape)


class _FeedForward(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.w1 = _linear(gate)
        self.w3 = _linear(up)
        self.w2 = _linear(down)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _MetaAttention(nn.Module):
    def __init__(self, sd, a, hp):
        super().__init__()
        self.hp = hp
        perm = _interleave_perm(hp)
        bq = _permute_heads(sd[a + "q_proj.bias"], hp.nH, perm) if hp.attn_bias else None
        bk = _permute_heads(sd[a + "k_proj.bias"], hp.nKV, perm) if hp.attn_bias else None
        self.wq = _linear(_permute_heads(sd[a + "q_proj.weight"], hp.nH, perm), bq)
        self.wk = _linear(_permute_heads(sd[a + "k_proj.weight"], hp.nKV, perm), bk)
        self.wv = _linear(sd[a + "v_proj.weight"], sd[a + "v_proj.bias"] if hp.attn_bias else None)
        self.wo = _linear(sd[a + "o_proj.weight"])
        if hp.qk_norm:
            self.q_norm = _Gain(sd[a + "q_norm.weight"][perm], hp.eps)
            self.k_norm = _Gain(sd[a + "k_norm.weight"][perm], hp.eps)

    def _rope(self, x, cis):  # x (B,S,H,Hd), cis (B,S,R/2) complex
        R = self.hp.R
        xc = torch.view_as_complex(x[..., :R].float().reshape(*x.shape[:-1], R // 2, 2).contiguous())
        xr = torch.view_as_real(xc * cis[:, :, None, :]).flatten(-2)
        return torch.cat((xr, x[..., R:]), dim=-1)

    def forward(self, x, cis, keep):
        hp = self.hp
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, hp.nH, hp.Hd)
        k = self.wk(x).view(B, S, hp.nKV, hp.Hd)
        v = self.wv(x).view(B, S, hp.nKV, hp.Hd)
        if hp.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, cis), self._rope(k, cis)
        k = k.repeat_interleave(hp.rep, dim=2)
        v = v.repeat_interleave(hp.rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hp.Hd)
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(probs, v).transpose(1, 2).contiguous().view(B, S, -1)
        return self.wo(out)


class _MetaMoE(nn.Module):
    def __init__(self, sd, p, hp):
        super().__init__()
        self.hp = hp
        self.gate = _linear(sd[p + "gate.weight"])
        self.register_buffer("gate_bias", sd[p + "gate.e_score_correction_bias"].detach().clone().float())
        gu, dn = sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"]
        self.experts = nn.ModuleList([_FeedForward(gu[e, : hp.Im], gu[e, hp.Im :], dn[e]) for e in range(hp.E)])
        s = p + "shared_experts."
        self.shared_expert = (
            _FeedForward(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"])
            if hp.nS > 0
            else None
        )

    def _route(self, x):
        hp = self.hp
        T = x.shape[0]
        probs = self.gate(x).sigmoid()
        biased = probs + self.gate_bias
        n = hp.E // hp.G
        gscore = biased.view(T, hp.G, n).topk(2, dim=-1).values.sum(-1)
        gsel = gscore.topk(hp.TG, dim=-1).indices  # (T, TG)
        cand = (gsel.unsqueeze(-1) * n + torch.arange(n, device=x.device)).reshape(T, hp.TG * n)
        pick = biased.gather(1, cand).topk(hp.K, dim=-1).indices
        idx = cand.gather(1, pick)
        w = probs.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * hp.rsf

    def forward(self, x):
        hp = self.hp
        B, S, D = x.shape
        flat = x.view(-1, D)
        idx, w = self._route(flat)
        flat_e = idx.view(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=hp.E).tolist()
        tokens = order // hp.K
        pieces = torch.split(flat[tokens], counts)
        outs = [self.experts[e](chunk) for e, chunk in enumerate(pieces) if chunk.shape[0] > 0]
        ys = torch.cat(outs, 0) * w.view(-1)[order].unsqueeze(-1)
        y = torch.zeros_like(flat).index_add_(0, tokens, ys).view(B, S, D)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return y


class _MetaLayer(nn.Module):
    def __init__(self, sd, i, hp):
        super().__init__()
        p = f"model.layers.{i}."
        self.attention_norm = _Gain(sd[p + "input_layernorm.weight"], hp.eps)
        self.attention = _MetaAttention(sd, p + "self_attn.", hp)
        self.ffn_norm = _Gain(sd[p + "post_attention_layernorm.weight"], hp.eps)
        m = p + "mlp."
        if hp.is_moe(i):
            self.feed_forward = _MetaMoE(sd, m, hp)
        else:
            self.feed_forward = _FeedForward(
                sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"]
            )

    def forward(self, x, cis, keep):
        h = x + self.attention(self.attention_norm(x), cis, keep)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaComplexSorted(_Port):
    layout = "meta_complex_sorted"

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        self.tok_embeddings = nn.Embedding(hp.V, hp.D)
        self.tok_embeddings.weight = _p(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_MetaLayer(sd, i, hp) for i in range(hp.L)])
        self.norm = _Gain(sd["model.norm.weight"], hp.eps)
        self.output = _linear(_head_weight(sd))
        self.register_buffer("freqs", hp.inv_freq(), persistent=False)

    def _logits(self, ids, valid, pos):
        S = ids.shape[1]
        angles = pos.float()[..., None] * self.freqs
        cis = torch.polar(torch.ones_like(angles), angles)
        keep = (_causal(S, ids.device)[None] & valid[:, None, :]) | torch.eye(S, dtype=torch.bool, device=ids.device)
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h, cis, keep)
        return self.output(self.norm(h))


# ================================================================================================================
# gguf_functional_gather
# ================================================================================================================
def _gguf_tensors(sd, hp):
    """Transformers' state dict -> llama.cpp/GGUF names, every matrix transposed to (in, out)."""
    t = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    t["output.weight"] = _head_weight(sd).t()
    for i in range(hp.L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a = p + "self_attn."
        t[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        t[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for src, dst in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            t[b + dst + ".weight"] = sd[a + src + "_proj.weight"].t()
            if hp.attn_bias:
                t[b + dst + ".bias"] = sd[a + src + "_proj.bias"]
        t[b + "attn_output.weight"] = sd[a + "o_proj.weight"].t()
        if hp.qk_norm:
            t[b + "attn_q_norm.weight"] = sd[a + "q_norm.weight"]
            t[b + "attn_k_norm.weight"] = sd[a + "k_norm.weight"]
        m = p + "mlp."
        if hp.is_moe(i):
            t[b + "ffn_gate_inp.weight"] = sd[m + "gate.weight"].t()
            t[b + "exp_probs_b.bias"] = sd[m + "gate.e_score_correction_bias"]
            gu = sd[m + "experts.gate_up_proj"]
            t[b + "ffn_gate_exps.weight"] = gu[:, : hp.Im].transpose(1, 2)  # (E, D, Im)
            t[b + "ffn_up_exps.weight"] = gu[:, hp.Im :].transpose(1, 2)
            t[b + "ffn_down_exps.weight"] = sd[m + "experts.down_proj"].transpose(1, 2)  # (E, Im, D)
            if hp.nS > 0:
                for n in ("gate", "up", "down"):
                    t[b + f"ffn_{n}_shexp.weight"] = sd[m + f"shared_experts.{n}_proj.weight"].t()
        else:
            for n in ("gate", "up", "down"):
                t[b + f"ffn_{n}.weight"] = sd[m + f"{n}_proj.weight"].t()
    return {k: v.detach().clone().float().contiguous() for k, v in t.items()}


def _gguf_rms(x, w, eps):
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * w


def _gguf_rope(x, cos, sin, R):  # x (B,S,H,Hd); cos/sin (B,S,1,R/2)
    h = R // 2
    x1, x2, rest = x[..., :h], x[..., h:R], x[..., R:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def _gguf_route(t, b, x, hp):
    T = x.shape[0]
    probs = torch.sigmoid(x @ t[b + "ffn_gate_inp.weight"])
    sel = probs + t[b + "exp_probs_b.bias"]
    n = hp.E // hp.G
    srt = torch.sort(sel.view(T, hp.G, n), dim=-1, descending=True).values
    gscore = srt[..., 0] + srt[..., 1]
    best_groups = torch.argsort(gscore, dim=-1, descending=True)[:, : hp.TG]
    gmask = torch.zeros(T, hp.G, dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
    emask = gmask[:, :, None].expand(T, hp.G, n).reshape(T, hp.E)
    idx = torch.argsort(sel.masked_fill(~emask, float("-inf")), dim=-1, descending=True)[:, : hp.K]
    w = torch.gather(probs, 1, idx)
    if hp.norm_topk:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * hp.rsf


def _gguf_moe(t, b, x, hp):
    T, D = x.shape
    idx, w = _gguf_route(t, b, x, hp)
    e = idx.reshape(-1)  # assignment a = token * K + slot
    xa = x.repeat_interleave(hp.K, dim=0).unsqueeze(1)  # (TK, 1, D)
    g = torch.bmm(xa, t[b + "ffn_gate_exps.weight"][e])
    u = torch.bmm(xa, t[b + "ffn_up_exps.weight"][e])
    y = torch.bmm(F.silu(g) * u, t[b + "ffn_down_exps.weight"][e]).squeeze(1)  # (TK, D)
    out = (y * w.reshape(-1, 1)).view(T, hp.K, D).sum(1)
    if hp.nS > 0:
        out = (
            out
            + (F.silu(x @ t[b + "ffn_gate_shexp.weight"]) * (x @ t[b + "ffn_up_shexp.weight"]))
            @ t[b + "ffn_down_shexp.weight"]
        )
    return out


def _gguf_forward(t, hp, ids, valid, pos):
    B, S = ids.shape
    x = t["token_embd.weight"][ids]
    ang = pos.float().unsqueeze(-1) * (1.0 / hp.theta ** (torch.arange(0, hp.R, 2, device=ids.device).float() / hp.R))
    cos, sin = torch.cos(ang)[:, :, None], torch.sin(ang)[:, :, None]
    keep = _causal(S, ids.device)[None] & valid[:, None, :]  # (B, Sq, Sk)
    keep = keep | torch.eye(S, dtype=torch.bool, device=ids.device)
    neg = torch.finfo(torch.float32).min
    for i in range(hp.L):
        b = f"blk.{i}."
        cur = _gguf_rms(x, t[b + "attn_norm.weight"], hp.eps)
        q, k, v = (cur @ t[b + n + ".weight"] for n in ("attn_q", "attn_k", "attn_v"))
        if hp.attn_bias:
            q, k, v = q + t[b + "attn_q.bias"], k + t[b + "attn_k.bias"], v + t[b + "attn_v.bias"]
        q = q.view(B, S, hp.nH, hp.Hd)
        k = k.view(B, S, hp.nKV, hp.Hd)
        v = v.view(B, S, hp.nKV, hp.Hd)
        if hp.qk_norm:
            q = _gguf_rms(q, t[b + "attn_q_norm.weight"], hp.eps)
            k = _gguf_rms(k, t[b + "attn_k_norm.weight"], hp.eps)
        q, k = _gguf_rope(q, cos, sin, hp.R), _gguf_rope(k, cos, sin, hp.R)
        qg = q.view(B, S, hp.nKV, hp.rep, hp.Hd)
        kq = torch.einsum("bqgrd,bkgd->bgrqk", qg, k) * hp.scale
        kq = kq.masked_fill(~keep[:, None, None], neg)
        kq = torch.softmax(kq, dim=-1)
        ctx = torch.einsum("bgrqk,bkgd->bqgrd", kq, v).reshape(B, S, hp.nH * hp.Hd)
        x = x + ctx @ t[b + "attn_output.weight"]
        cur = _gguf_rms(x, t[b + "ffn_norm.weight"], hp.eps)
        if hp.is_moe(i):
            x = x + _gguf_moe(t, b, cur.reshape(B * S, hp.D), hp).view(B, S, hp.D)
        else:
            x = x + (F.silu(cur @ t[b + "ffn_gate.weight"]) * (cur @ t[b + "ffn_up.weight"])) @ t[b + "ffn_down.weight"]
    x = _gguf_rms(x, t["output_norm.weight"], hp.eps)
    return x @ t["output.weight"]


class GgufFunctional(_Port):
    layout = "gguf_functional_gather"

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        for name, tensor in _gguf_tensors(sd, hp).items():
            self.register_buffer(name.replace(".", "__"), tensor)

    def _logits(self, ids, valid, pos):
        flat = {n.replace("__", "."): b for n, b in self.named_buffers()}
        return _gguf_forward(flat, self.hp, ids, valid, pos)


# ================================================================================================================
# flax_scan_gshard
# ================================================================================================================
class _Params(nn.Module):
    """A bag of (stacked) parameters, Flax style."""

    def __init__(self, **tensors):
        super().__init__()
        for k, v in tensors.items():
            setattr(self, k, _p(v))


def _flax_norm(x, scale, eps):
    var = torch.mean(torch.square(x), dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * (1.0 + scale)


class FlaxScanGShard(_Port):
    layout = "flax_scan_gshard"
    CHUNK = 8

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        L = range(hp.L)
        ly = lambda i: f"model.layers.{i}."  # noqa: E731
        at = lambda i, n: sd[ly(i) + "self_attn." + n]  # noqa: E731
        self.embedder = _Params(input_embedding=sd["model.embed_tokens.weight"])
        attn = dict(
            q_kernel=torch.stack([at(i, "q_proj.weight").t().reshape(hp.D, hp.nH, hp.Hd) for i in L]),
            k_kernel=torch.stack([at(i, "k_proj.weight").t().reshape(hp.D, hp.nKV, hp.Hd) for i in L]),
            v_kernel=torch.stack([at(i, "v_proj.weight").t().reshape(hp.D, hp.nKV, hp.Hd) for i in L]),
            out_kernel=torch.stack([at(i, "o_proj.weight").t().reshape(hp.nH, hp.Hd, hp.D) for i in L]),
            pre_attention_norm_scale=torch.stack([sd[ly(i) + "input_layernorm.weight"] - 1.0 for i in L]),
            pre_ffw_norm_scale=torch.stack([sd[ly(i) + "post_attention_layernorm.weight"] - 1.0 for i in L]),
        )
        if hp.attn_bias:
            attn["q_bias"] = torch.stack([at(i, "q_proj.bias").reshape(hp.nH, hp.Hd) for i in L])
            attn["k_bias"] = torch.stack([at(i, "k_proj.bias").reshape(hp.nKV, hp.Hd) for i in L])
            attn["v_bias"] = torch.stack([at(i, "v_proj.bias").reshape(hp.nKV, hp.Hd) for i in L])
        if hp.qk_norm:
            attn["query_norm_scale"] = torch.stack([at(i, "q_norm.weight") - 1.0 for i in L])
            attn["key_norm_scale"] = torch.stack([at(i, "k_norm.weight") - 1.0 for i in L])
        self.layers = _Params(**attn)
        dense = [i for i in L if not hp.is_moe(i)]
        moe = [i for i in L if hp.is_moe(i)]
        self.slot = {i: (dense.index(i) if i in dense else moe.index(i)) for i in L}
        ml = lambda i, n: sd[ly(i) + "mlp." + n]  # noqa: E731
        if dense:
            self.dense_mlp = _Params(
                wi_0=torch.stack([ml(i, "gate_proj.weight").t() for i in dense]),
                wi_1=torch.stack([ml(i, "up_proj.weight").t() for i in dense]),
                wo=torch.stack([ml(i, "down_proj.weight").t() for i in dense]),
            )
        if moe:
            gu = [ml(i, "experts.gate_up_proj") for i in moe]
            kw = dict(
                router_kernel=torch.stack([ml(i, "gate.weight").t() for i in moe]),
                router_bias=torch.stack([ml(i, "gate.e_score_correction_bias") for i in moe]),
                wi_0=torch.stack([g[:, : hp.Im].transpose(1, 2) for g in gu]),  # (Lm, E, D, Im)
                wi_1=torch.stack([g[:, hp.Im :].transpose(1, 2) for g in gu]),
                wo=torch.stack([ml(i, "experts.down_proj").transpose(1, 2) for i in moe]),  # (Lm, E, Im, D)
            )
            if hp.nS > 0:
                kw.update(
                    shared_wi_0=torch.stack([ml(i, "shared_experts.gate_proj.weight").t() for i in moe]),
                    shared_wi_1=torch.stack([ml(i, "shared_experts.up_proj.weight").t() for i in moe]),
                    shared_wo=torch.stack([ml(i, "shared_experts.down_proj.weight").t() for i in moe]),
                )
            self.moe_mlp = _Params(**kw)
        self.final_norm = _Params(scale=sd["model.norm.weight"] - 1.0)
        self.unembed = _Params(kernel=_head_weight(sd).t())

    # -- pieces ------------------------------------------------------------------------------------------------
    def _sin_cos(self, pos):
        hp = self.hp
        fraction = 2.0 * torch.arange(hp.half, device=pos.device, dtype=torch.float32) / hp.R
        timescale = hp.theta**fraction
        sinusoid = pos.float()[..., None] / timescale  # (B, T, R/2)
        return torch.sin(sinusoid)[:, :, None], torch.cos(sinusoid)[:, :, None]

    def _rope(self, x, sin, cos):
        R, h = self.hp.R, self.hp.half
        first, second = x[..., :h], x[..., h:R]
        return torch.cat([first * cos - second * sin, second * cos + first * sin, x[..., R:]], dim=-1)

    def _attention(self, l, x, sin, cos, keep):
        hp, P = self.hp, self.layers
        B, T, _ = x.shape
        q = torch.einsum("btd,dnh->btnh", x, P.q_kernel[l])
        k = torch.einsum("btd,dnh->btnh", x, P.k_kernel[l])
        v = torch.einsum("btd,dnh->btnh", x, P.v_kernel[l])
        if hp.attn_bias:
            q, k, v = q + P.q_bias[l], k + P.k_bias[l], v + P.v_bias[l]
        if hp.qk_norm:
            q = _flax_norm(q, P.query_norm_scale[l], hp.eps)
            k = _flax_norm(k, P.key_norm_scale[l], hp.eps)
        q = self._rope(q, sin, cos) * hp.scale
        k = self._rope(k, sin, cos)
        q = q.reshape(B, T, hp.nKV, hp.rep, hp.Hd)
        m = torch.full((B, T, hp.nKV, hp.rep), float("-inf"), device=x.device)
        den = torch.zeros(B, T, hp.nKV, hp.rep, device=x.device)
        acc = torch.zeros(B, T, hp.nKV, hp.rep, hp.Hd, device=x.device)
        for c0 in range(0, T, self.CHUNK):
            c1 = min(T, c0 + self.CHUNK)
            logits = torch.einsum("btgrh,bcgh->btgrc", q, k[:, c0:c1])
            logits = torch.where(keep[:, :, None, None, c0:c1], logits, torch.tensor(-1e30, device=x.device))
            m_new = torch.maximum(m, logits.amax(-1))
            correction = torch.exp(m - m_new)
            p = torch.exp(logits - m_new[..., None])
            den = den * correction + p.sum(-1)
            acc = acc * correction[..., None] + torch.einsum("btgrc,bcgh->btgrh", p, v[:, c0:c1])
            m = m_new
        enc = (acc / den[..., None]).reshape(B, T, hp.nH, hp.Hd)
        return torch.einsum("btnh,nhd->btd", enc, P.out_kernel[l])

    def _select(self, j, x):
        """Dense (T, E) combine weights from top-k thresholds."""
        hp, P = self.hp, self.moe_mlp
        T = x.shape[0]
        scores = torch.sigmoid(x @ P.router_kernel[j])
        biased = scores + P.router_bias[j]
        n = hp.E // hp.G
        gscore = biased.reshape(T, hp.G, n).topk(2, dim=-1).values.sum(-1)
        gkeep = gscore >= gscore.topk(hp.TG, dim=-1).values[:, -1:]
        biased = torch.where(gkeep.repeat_interleave(n, dim=1), biased, torch.tensor(float("-inf")))
        chosen = biased >= biased.topk(hp.K, dim=-1).values[:, -1:]
        w = torch.where(chosen, scores, torch.zeros_like(scores))
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return chosen, w * hp.rsf

    def _moe(self, j, x):
        hp, P = self.hp, self.moe_mlp
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        N = tokens.shape[0]
        chosen, weights = self._select(j, tokens)
        # GShard: position of each token in its expert's buffer, capacity = N (no token dropped)
        position = (torch.cumsum(chosen.long(), dim=0) - 1) * chosen.long()
        dispatch = F.one_hot(position, N).float() * chosen[..., None].float()  # (N, E, C)
        combine = dispatch * weights[..., None]
        expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)
        h0 = torch.einsum("ecd,edi->eci", expert_in, P.wi_0[j])
        h1 = torch.einsum("ecd,edi->eci", expert_in, P.wi_1[j])
        expert_out = torch.einsum("eci,eid->ecd", F.silu(h0) * h1, P.wo[j])
        out = torch.einsum("tec,ecd->td", combine, expert_out)
        if hp.nS > 0:
            out = out + (F.silu(tokens @ P.shared_wi_0[j]) * (tokens @ P.shared_wi_1[j])) @ P.shared_wo[j]
        return out.reshape(B, T, D)

    def _dense(self, j, x):
        P = self.dense_mlp
        return (F.silu(x @ P.wi_0[j]) * (x @ P.wi_1[j])) @ P.wo[j]

    def _logits(self, ids, valid, pos):
        hp = self.hp
        T = ids.shape[1]
        x = self.embedder.input_embedding[ids]
        sin, cos = self._sin_cos(pos)
        keep = _causal(T, ids.device)[None] & valid[:, None, :]
        for l in range(hp.L):  # a scan over the stacked layer axis
            y = _flax_norm(x, self.layers.pre_attention_norm_scale[l], hp.eps)
            x = x + self._attention(l, y, sin, cos, keep)
            y = _flax_norm(x, self.layers.pre_ffw_norm_scale[l], hp.eps)
            x = x + (self._moe(self.slot[l], y) if hp.is_moe(l) else self._dense(self.slot[l], y))
        x = _flax_norm(x, self.final_norm.scale, hp.eps)
        return x @ self.unembed.kernel


# ================================================================================================================
# megatron_tp_ep
# ================================================================================================================
class _Shards(nn.Module):
    """A tensor-parallel (or expert-parallel) weight split across ranks: ``weight_shards[r]``."""

    def __init__(self, shards, layer_norm_weight=None, bias_shards=None):
        super().__init__()
        self.weight_shards = nn.ParameterList([_p(s) for s in shards])
        if bias_shards is not None:
            self.bias_shards = nn.ParameterList([_p(s) for s in bias_shards])
        if layer_norm_weight is not None:
            self.layer_norm_weight = _p(layer_norm_weight)


def _mg_rms(x, w, eps):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


def _mg_mlp_shards(gate, up, down, tp, norm_w=None):
    """Column-parallel fc1 ([gate_r; up_r] per rank) and row-parallel fc2."""
    fc1 = _Shards([torch.cat((g, u), 0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))], layer_norm_weight=norm_w)
    fc2 = _Shards(list(down.chunk(tp, 1)))
    return fc1, fc2


class _MgMLP(nn.Module):
    def __init__(self, gate, up, down, tp, norm_w=None):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = _mg_mlp_shards(gate, up, down, tp, norm_w)

    def forward(self, x):  # x already normed
        out = 0
        for w1, w2 in zip(self.linear_fc1.weight_shards, self.linear_fc2.weight_shards):
            g, u = torch.chunk(F.linear(x, w1), 2, dim=-1)
            out = out + F.linear(F.silu(g) * u, w2)  # all-reduce of the row-parallel partial sums
        return out


class _MgAttention(nn.Module):
    def __init__(self, sd, p, hp, tp):
        super().__init__()
        self.hp, self.tp = hp, tp
        a = p + "self_attn."
        Hd, rep = hp.Hd, hp.rep
        wq = sd[a + "q_proj.weight"].view(hp.nKV, rep * Hd, hp.D)
        wk = sd[a + "k_proj.weight"].view(hp.nKV, Hd, hp.D)
        wv = sd[a + "v_proj.weight"].view(hp.nKV, Hd, hp.D)
        w = torch.cat((wq, wk, wv), 1)  # (groups, (rep+2)*Hd, D): per-group interleaved
        shards = [s.reshape(-1, hp.D) for s in w.chunk(tp, 0)]
        bshards = None
        if hp.attn_bias:
            b = torch.cat(
                (
                    sd[a + "q_proj.bias"].view(hp.nKV, rep * Hd),
                    sd[a + "k_proj.bias"].view(hp.nKV, Hd),
                    sd[a + "v_proj.bias"].view(hp.nKV, Hd),
                ),
                1,
            )
            bshards = [s.reshape(-1) for s in b.chunk(tp, 0)]
        self.linear_qkv = _Shards(shards, layer_norm_weight=sd[p + "input_layernorm.weight"], bias_shards=bshards)
        self.linear_proj = _Shards(list(sd[a + "o_proj.weight"].chunk(tp, 1)))
        if hp.qk_norm:
            self.q_layernorm = _Params(weight=sd[a + "q_norm.weight"])
            self.k_layernorm = _Params(weight=sd[a + "k_norm.weight"])

    @staticmethod
    def _rope(t, emb, R):  # t [s, b, n, d]; emb [s, b, 1, R]
        rot, rest = t[..., :R], t[..., R:]
        x1, x2 = torch.chunk(rot, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return torch.cat((rot * emb.cos() + rotated * emb.sin(), rest), dim=-1)

    def forward(self, hidden, emb, masked_out):
        hp = self.hp
        S, B, _ = hidden.shape
        ln = _mg_rms(hidden, self.linear_qkv.layer_norm_weight, hp.eps)
        out = 0
        for r in range(self.tp):
            mixed = F.linear(ln, self.linear_qkv.weight_shards[r])
            if hp.attn_bias:
                mixed = mixed + self.linear_qkv.bias_shards[r]
            groups = mixed.shape[-1] // ((hp.rep + 2) * hp.Hd)
            mixed = mixed.view(S, B, groups, (hp.rep + 2) * hp.Hd)
            q, k, v = torch.split(mixed, [hp.rep * hp.Hd, hp.Hd, hp.Hd], dim=3)
            q = q.reshape(S, B, groups * hp.rep, hp.Hd)
            if hp.qk_norm:
                q = _mg_rms(q, self.q_layernorm.weight, hp.eps)
                k = _mg_rms(k, self.k_layernorm.weight, hp.eps)
            q, k = self._rope(q, emb, hp.R), self._rope(k, emb, hp.R)
            n = groups * hp.rep
            k = k.repeat_interleave(hp.rep, dim=2)
            v = v.repeat_interleave(hp.rep, dim=2)
            qb = q.permute(1, 2, 0, 3).reshape(B * n, S, hp.Hd)
            kb = k.permute(1, 2, 0, 3).reshape(B * n, S, hp.Hd)
            vb = v.permute(1, 2, 0, 3).reshape(B * n, S, hp.Hd)
            scores = torch.baddbmm(
                torch.empty(B * n, S, S, device=hidden.device), qb, kb.transpose(1, 2), beta=0.0, alpha=hp.scale
            )
            scores = scores.view(B, n, S, S).masked_fill(masked_out, -10000.0)
            probs = torch.softmax(scores, dim=-1)
            ctx = torch.bmm(probs.view(B * n, S, S), vb).view(B, n, S, hp.Hd)
            ctx = ctx.permute(2, 0, 1, 3).reshape(S, B, n * hp.Hd)
            out = out + F.linear(ctx, self.linear_proj.weight_shards[r])  # row-parallel partial sum
        return out


class _MgRouter(nn.Module):
    def __init__(self, w, bias, hp):
        super().__init__()
        self.hp = hp
        self.weight = _p(w)
        self.register_buffer("expert_bias", bias.detach().clone().float())

    def forward(self, tokens):
        """-> probs (T, E) dense, routing_map (T, E) bool."""
        hp = self.hp
        T = tokens.shape[0]
        logits = F.linear(tokens.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        for_routing = scores + self.expert_bias
        n = hp.E // hp.G
        group_scores = for_routing.view(T, hp.G, n).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=hp.TG, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, hp.G, n).reshape(T, hp.E)
        masked = for_routing.masked_fill(~score_mask.bool(), float("-inf"))
        top_indices = torch.topk(masked, k=hp.K, dim=-1)[1]
        top_scores = torch.gather(scores, 1, top_indices)
        if hp.norm_topk:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * hp.rsf
        probs = torch.zeros_like(logits).scatter(1, top_indices, top_scores)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
        return probs, routing_map


class _MgGroupedMLP(nn.Module):
    """One expert-parallel rank's local experts as grouped-GEMM weights."""

    def __init__(self, gu, dn, hp):
        super().__init__()
        self.hp = hp
        self.num_local = gu.shape[0]
        self.weight1 = _p(torch.cat([gu[e].t() for e in range(self.num_local)], 1))  # (D, El*2Im)
        self.weight2 = _p(torch.cat([dn[e].t() for e in range(self.num_local)], 0))  # (El*Im, D)

    def forward(self, permuted, tokens_per_expert):
        Im = self.hp.Im
        outs = []
        for le, chunk in enumerate(torch.split(permuted, tokens_per_expert)):
            if chunk.shape[0] == 0:
                continue
            h = chunk @ self.weight1[:, le * 2 * Im : (le + 1) * 2 * Im]
            g, u = torch.chunk(h, 2, dim=-1)
            outs.append((F.silu(g) * u) @ self.weight2[le * Im : (le + 1) * Im])
        return torch.cat(outs, 0) if outs else permuted.new_zeros(0, self.hp.D)


class _MgMoE(nn.Module):
    def __init__(self, sd, p, hp, tp, ep):
        super().__init__()
        self.hp, self.ep = hp, ep
        m = p + "mlp."
        self.router = _MgRouter(sd[m + "gate.weight"], sd[m + "gate.e_score_correction_bias"], hp)
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        self.experts = nn.ModuleList([_MgGroupedMLP(g, d, hp) for g, d in zip(gu.chunk(ep, 0), dn.chunk(ep, 0))])
        s = m + "shared_experts."
        self.shared_experts = (
            _MgMLP(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"], tp)
            if hp.nS > 0
            else None
        )

    def forward(self, x):  # x [S, B, D] normed
        hp = self.hp
        shape = x.shape
        tokens = x.reshape(-1, hp.D)
        probs, routing_map = self.router(tokens)
        out = torch.zeros_like(tokens)
        El = hp.E // self.ep
        for rank, grouped in enumerate(self.experts):
            local_map = routing_map[:, rank * El : (rank + 1) * El].t()  # (El, T)
            local_probs = probs[:, rank * El : (rank + 1) * El].t()
            tokens_per_expert = local_map.sum(1).tolist()
            expert_of, token_of = local_map.nonzero(as_tuple=True)  # sorted by local expert
            permuted = tokens.index_select(0, token_of)
            y = grouped(permuted, tokens_per_expert)
            y = y * local_probs[expert_of, token_of].unsqueeze(-1)
            out = out.index_add(0, token_of, y)  # un-permute (all-to-all back) and combine
        out = out.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class _MgLayer(nn.Module):
    def __init__(self, sd, i, hp, tp, ep):
        super().__init__()
        self.hp = hp
        p = f"model.layers.{i}."
        self.self_attention = _MgAttention(sd, p, hp, tp)
        if hp.is_moe(i):
            self.pre_mlp_layernorm = _Params(weight=sd[p + "post_attention_layernorm.weight"])
            self.mlp = _MgMoE(sd, p, hp, tp, ep)
        else:
            m = p + "mlp."
            self.mlp = _MgMLP(
                sd[m + "gate_proj.weight"],
                sd[m + "up_proj.weight"],
                sd[m + "down_proj.weight"],
                tp,
                norm_w=sd[p + "post_attention_layernorm.weight"],
            )

    def forward(self, h, emb, masked_out):
        h = h + self.self_attention(h, emb, masked_out)
        if isinstance(self.mlp, _MgMoE):
            return h + self.mlp(_mg_rms(h, self.pre_mlp_layernorm.weight, self.hp.eps))
        return h + self.mlp(_mg_rms(h, self.mlp.linear_fc1.layer_norm_weight, self.hp.eps))


class _MgDecoder(nn.Module):
    def __init__(self, sd, hp, tp, ep):
        super().__init__()
        self.layers = nn.ModuleList([_MgLayer(sd, i, hp, tp, ep) for i in range(hp.L)])
        self.final_layernorm = _Params(weight=sd["model.norm.weight"])


class MegatronTpEp(_Port):
    layout = "megatron_tp_ep"

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        tp = 2 if hp.nKV % 2 == 0 and hp.I % 2 == 0 and (hp.Im * max(hp.nS, 1)) % 2 == 0 else 1
        ep = 2 if hp.E % 2 == 0 else 1
        self.tp, self.ep = tp, ep
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(hp.V, hp.D)
        self.embedding.word_embeddings.weight = _p(sd["model.embed_tokens.weight"])
        self.decoder = _MgDecoder(sd, hp, tp, ep)
        self.output_layer = _Params(weight=_head_weight(sd))
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def _logits(self, ids, valid, pos):
        hp = self.hp
        B, S = ids.shape
        h = self.embedding.word_embeddings(ids).transpose(0, 1).contiguous()  # [S, B, D]
        freqs = pos.t().float()[..., None] * self.inv_freq  # [S, B, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        masked_out = ~(_causal(S, ids.device)[None] & valid[:, None, :])[:, None]  # [B, 1, S, S], True = drop
        for layer in self.decoder.layers:
            h = layer(h, emb, masked_out)
        h = _mg_rms(h, self.decoder.final_layernorm.weight, hp.eps)
        logits = F.linear(h, self.output_layer.weight)  # [S, B, V]
        return logits.transpose(0, 1).contiguous()


# ================================================================================================================
# folded_perhead_rotmat
# ================================================================================================================
def _unit_rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _interleave_cols(gate, up):
    """(out, in) gate and up -> (in, 2*out) with columns [g0, u0, g1, u1, ...]."""
    return torch.stack((gate.t(), up.t()), dim=-1).reshape(gate.shape[1], -1)


class _FoldedGLU(nn.Module):
    def __init__(self, gate, up, down, gain):
        super().__init__()
        self.w_in = _p(_interleave_cols(gate * gain, up * gain))  # (D, 2I), input gain folded
        self.w_out = _p(down.t())  # (I, D)

    def forward(self, x):  # x unit-normalised
        h = x @ self.w_in
        return (F.silu(h[..., 0::2]) * h[..., 1::2]) @ self.w_out


class _FoldedMoE(nn.Module):
    def __init__(self, sd, m, gain, hp):
        super().__init__()
        self.hp = hp
        self.router = _p(sd[m + "gate.weight"] * gain)
        self.register_buffer("choice_bias", sd[m + "gate.e_score_correction_bias"].detach().clone().float())
        gu = sd[m + "experts.gate_up_proj"]
        self.w_in = _p(
            torch.stack([_interleave_cols(gu[e, : hp.Im] * gain, gu[e, hp.Im :] * gain) for e in range(hp.E)])
        )
        self.w_out = _p(sd[m + "experts.down_proj"].transpose(1, 2) * hp.rsf)  # routed scale folded
        s = m + "shared_experts."
        self.shared = (
            _FoldedGLU(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"], gain)
            if hp.nS > 0
            else None
        )

    def _route(self, x):
        hp = self.hp
        T = x.shape[0]
        s = torch.sigmoid(x @ self.router.t())
        c = s + self.choice_bias
        n = hp.E // hp.G
        cg = c.view(T, hp.G, n)
        first = cg.max(-1)
        second = cg.scatter(-1, first.indices[..., None], float("-inf")).max(-1).values
        gscore = first.values + second
        gkeep = torch.zeros(T, hp.G, dtype=torch.bool, device=x.device)
        for _ in range(hp.TG):  # iterative argmax over groups
            g = gscore.masked_fill(gkeep, float("-inf")).argmax(-1)
            gkeep[torch.arange(T), g] = True
        c = c.masked_fill(~gkeep.repeat_interleave(n, dim=1), float("-inf"))
        picks = []
        for _ in range(hp.K):  # iterative argmax over experts
            e = c.argmax(-1)
            picks.append(e)
            c = c.scatter(1, e[:, None], float("-inf"))
        idx = torch.stack(picks, dim=1)
        w = s.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w

    def forward(self, x):
        hp = self.hp
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        idx, w = self._route(flat)
        out = torch.zeros_like(flat)
        for e in torch.unique(idx).tolist():
            hit = idx == e  # (T, K)
            rows = hit.any(-1).nonzero().squeeze(-1)
            h = flat[rows] @ self.w_in[e]
            y = (F.silu(h[..., 0::2]) * h[..., 1::2]) @ self.w_out[e]
            out[rows] += y * (w * hit).sum(-1)[rows, None]
        out = out.view(B, S, D)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class _FoldedLayer(nn.Module):
    def __init__(self, sd, i, hp):
        super().__init__()
        self.hp = hp
        p = f"model.layers.{i}."
        a = p + "self_attn."
        g_in = sd[p + "input_layernorm.weight"]
        g_post = sd[p + "post_attention_layernorm.weight"]
        self.q_heads = _p((sd[a + "q_proj.weight"] * g_in).view(hp.nH, hp.Hd, hp.D))
        self.k_heads = _p((sd[a + "k_proj.weight"] * g_in).view(hp.nKV, hp.Hd, hp.D))
        self.v_heads = _p((sd[a + "v_proj.weight"] * g_in).view(hp.nKV, hp.Hd, hp.D))
        self.o_heads = _p(sd[a + "o_proj.weight"].view(hp.D, hp.nH, hp.Hd).permute(1, 0, 2))  # (N, D, Hd)
        zeros = lambda n: torch.zeros(n, hp.Hd)  # noqa: E731
        self.q_head_bias = _p(sd[a + "q_proj.bias"].view(hp.nH, hp.Hd) if hp.attn_bias else zeros(hp.nH))
        self.k_head_bias = _p(sd[a + "k_proj.bias"].view(hp.nKV, hp.Hd) if hp.attn_bias else zeros(hp.nKV))
        self.v_head_bias = _p(sd[a + "v_proj.bias"].view(hp.nKV, hp.Hd) if hp.attn_bias else zeros(hp.nKV))
        if hp.qk_norm:  # softmax scale folded into the query norm gain
            self.q_gain = _p(sd[a + "q_norm.weight"] * hp.scale)
            self.k_gain = _p(sd[a + "k_norm.weight"])
        else:  # ... or into the query projection (RoPE is linear)
            self.q_heads.data.mul_(hp.scale)
            self.q_head_bias.data.mul_(hp.scale)
        m = p + "mlp."
        if hp.is_moe(i):
            self.mlp = _FoldedMoE(sd, m, g_post, hp)
        else:
            self.mlp = _FoldedGLU(
                sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"], g_post
            )

    def forward(self, h, rot, keep):
        hp = self.hp
        x = _unit_rms(h, hp.eps)
        R = hp.R

        def rope(t):
            return torch.cat((torch.einsum("bsij,bsj->bsi", rot, t[..., :R]), t[..., R:]), dim=-1)

        keys, values = [], []
        for g in range(hp.nKV):
            k = x @ self.k_heads[g].t() + self.k_head_bias[g]
            if hp.qk_norm:
                k = _unit_rms(k, hp.eps) * self.k_gain
            keys.append(rope(k))
            values.append(x @ self.v_heads[g].t() + self.v_head_bias[g])
        out = torch.zeros_like(h)
        for n in range(hp.nH):
            q = x @ self.q_heads[n].t() + self.q_head_bias[n]
            if hp.qk_norm:
                q = _unit_rms(q, hp.eps) * self.q_gain
            q = rope(q)
            g = n // hp.rep
            att = (q @ keys[g].transpose(-1, -2)).masked_fill(~keep, float("-inf")).softmax(-1)
            out = out + (att @ values[g]) @ self.o_heads[n].t()
        h = h + out
        return h + self.mlp(_unit_rms(h, hp.eps))


class FoldedPerHeadRotmat(_Port):
    layout = "folded_perhead_rotmat"

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        self.embedding = _p(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_FoldedLayer(sd, i, hp) for i in range(hp.L)])
        self.lm_head = _p(_head_weight(sd) * sd["model.norm.weight"])  # final norm gain folded
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def _rotation(self, pos):
        hp = self.hp
        ang = pos.float()[..., None] * self.inv_freq  # (B, S, R/2)
        c, s = ang.cos(), ang.sin()
        B, S = pos.shape
        rot = torch.zeros(B, S, hp.R, hp.R, device=pos.device)
        i = torch.arange(hp.half, device=pos.device)
        rot[:, :, i, i] = c
        rot[:, :, i, i + hp.half] = -s
        rot[:, :, i + hp.half, i] = s
        rot[:, :, i + hp.half, i + hp.half] = c
        return rot

    def _logits(self, ids, valid, pos):
        S = ids.shape[1]
        rot = self._rotation(pos)
        keep = (_causal(S, ids.device)[None] & valid[:, None, :]) | torch.eye(S, dtype=torch.bool, device=ids.device)
        h = self.embedding[ids]
        for layer in self.layers:
            h = layer(h, rot, keep)
        return _unit_rms(h, self.hp.eps) @ self.lm_head.t()


# ================================================================================================================
# shared_as_expert_pertoken
# ================================================================================================================
class _G2Attention(nn.Module):
    def __init__(self, sd, a, hp):
        super().__init__()
        self.hp = hp
        b = hp.attn_bias
        self.c_q = _linear(sd[a + "q_proj.weight"], sd[a + "q_proj.bias"] if b else None)
        wk = sd[a + "k_proj.weight"].view(hp.nKV, 1, hp.Hd, hp.D)
        wv = sd[a + "v_proj.weight"].view(hp.nKV, 1, hp.Hd, hp.D)
        wkv = torch.cat((wk, wv), 1).reshape(2 * hp.nKV * hp.Hd, hp.D)  # [k_0; v_0; k_1; v_1; ...]
        bkv = None
        if b:
            bk = sd[a + "k_proj.bias"].view(hp.nKV, 1, hp.Hd)
            bv = sd[a + "v_proj.bias"].view(hp.nKV, 1, hp.Hd)
            bkv = torch.cat((bk, bv), 1).reshape(-1)
        self.c_kv = _linear(wkv, bkv)
        self.c_proj = _linear(sd[a + "o_proj.weight"])
        if hp.qk_norm:
            self.q_ln = _Params(weight=sd[a + "q_norm.weight"])
            self.k_ln = _Params(weight=sd[a + "k_norm.weight"])

    def forward(self, x, cos_full, sin_full, bias_mask):
        hp = self.hp
        B, S, _ = x.shape
        q = self.c_q(x).view(B, S, hp.nH, hp.Hd)
        kv = self.c_kv(x).view(B, S, hp.nKV, 2, hp.Hd)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        if hp.qk_norm:
            q = F.rms_norm(q, (hp.Hd,), self.q_ln.weight, hp.eps)
            k = F.rms_norm(k, (hp.Hd,), self.k_ln.weight, hp.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        R, h = hp.R, hp.half

        def rope(t):  # one formula for the whole head: cos 1 / sin 0 on pass-through dims
            turned = torch.cat((-t[..., h:R], t[..., :h], t[..., R:]), dim=-1)
            return t * cos_full + turned * sin_full

        y = F.scaled_dot_product_attention(
            rope(q), rope(k), v.transpose(1, 2), attn_mask=bias_mask, enable_gqa=True, scale=hp.scale
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, S, hp.nH * hp.Hd))


class _G2MLP(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.c_fc = _linear(torch.cat((up, gate), 0))  # [up; gate]
        self.c_proj = _linear(down)

    def forward(self, x):
        u, g = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(g) * u)


class _G2MoE(nn.Module):
    def __init__(self, sd, m, hp):
        super().__init__()
        self.hp = hp
        self.router = _linear(sd[m + "gate.weight"])
        self.register_buffer("router_bias", sd[m + "gate.e_score_correction_bias"].detach().clone().float())
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        fc = [torch.cat((gu[e, hp.Im :], gu[e, : hp.Im]), 0) for e in range(hp.E)]  # [up; gate]
        proj = [dn[e] for e in range(hp.E)]
        s = m + "shared_experts."
        if hp.nS > 0:  # the shared MLP, cut into n_shared Im-wide always-on experts
            sg, su, sdn = sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"]
            for j in range(hp.nS):
                cols = slice(j * hp.Im, (j + 1) * hp.Im)
                fc.append(torch.cat((su[cols], sg[cols]), 0))
                proj.append(sdn[:, cols])
        self.experts_fc = _p(torch.stack(fc))  # (E + nS, 2Im, D)
        self.experts_proj = _p(torch.stack(proj))  # (E + nS, D, Im)

    def _route(self, x):
        hp = self.hp
        T = x.shape[0]
        probs = torch.sigmoid(self.router(x))
        ranked = probs + self.router_bias
        n = hp.E // hp.G
        top2 = ranked.view(T, hp.G, n).topk(2, dim=-1).values
        gsel = (top2[..., 0] + top2[..., 1]).topk(hp.TG, dim=-1).indices
        allowed = torch.zeros(T, hp.G, device=x.device).scatter(1, gsel, 1.0).repeat_interleave(n, dim=1)
        idx = torch.where(allowed > 0, ranked, torch.full_like(ranked, float("-inf"))).topk(hp.K, dim=-1).indices
        w = probs.gather(1, idx)
        if hp.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * hp.rsf
        # append the shared expert(s): fixed ids E.., weight 1
        shared_ids = torch.arange(hp.E, hp.E + hp.nS, device=x.device).expand(T, hp.nS)
        return torch.cat((idx, shared_ids), 1), torch.cat((w, torch.ones(T, hp.nS, device=x.device)), 1)

    def forward(self, x):
        hp = self.hp
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        idx, w = self._route(flat)
        rows = []
        for t in range(flat.shape[0]):  # token by token, slot by slot
            acc = torch.zeros(D, device=x.device)
            for slot in range(idx.shape[1]):
                e = int(idx[t, slot])
                u, g = (self.experts_fc[e] @ flat[t]).chunk(2)
                acc = acc + w[t, slot] * (self.experts_proj[e] @ (F.silu(g) * u))
            rows.append(acc)
        return torch.stack(rows).view(B, S, D)


class _G2Block(nn.Module):
    def __init__(self, sd, i, hp):
        super().__init__()
        self.hp = hp
        p = f"model.layers.{i}."
        self.ln_1 = _Params(weight=sd[p + "input_layernorm.weight"])
        self.attn = _G2Attention(sd, p + "self_attn.", hp)
        self.ln_2 = _Params(weight=sd[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        self.mlp = (
            _G2MoE(sd, m, hp)
            if hp.is_moe(i)
            else _G2MLP(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])
        )

    def forward(self, h, cos_full, sin_full, bias_mask):
        D = self.hp.D
        h = h + self.attn(F.rms_norm(h, (D,), self.ln_1.weight, self.hp.eps), cos_full, sin_full, bias_mask)
        return h + self.mlp(F.rms_norm(h, (D,), self.ln_2.weight, self.hp.eps))


class SharedAsExpertPerToken(_Port):
    layout = "shared_as_expert_pertoken"

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        self.wte = nn.Embedding(hp.V, hp.D)
        self.wte.weight = _p(sd["model.embed_tokens.weight"])
        self.h = nn.ModuleList([_G2Block(sd, i, hp) for i in range(hp.L)])
        self.ln_f = _Params(weight=sd["model.norm.weight"])
        self.lm_head = _linear(_head_weight(sd))
        self.register_buffer("inv_freq", hp.inv_freq(), persistent=False)

    def _logits(self, ids, valid, pos):
        hp = self.hp
        B, S = ids.shape
        ang = pos.float()[..., None] * self.inv_freq
        pad = hp.Hd - hp.R
        cos_full = torch.cat((ang.cos(), ang.cos(), ang.new_ones(B, S, pad)), -1)[:, None]
        sin_full = torch.cat((ang.sin(), ang.sin(), ang.new_zeros(B, S, pad)), -1)[:, None]
        keep = (_causal(S, ids.device)[None] & valid[:, None, :]) | torch.eye(S, dtype=torch.bool, device=ids.device)
        bias_mask = torch.zeros(B, 1, S, S, device=ids.device).masked_fill(~keep[:, None], float("-inf"))
        h = self.wte(ids)
        for blk in self.h:
            h = blk(h, cos_full, sin_full, bias_mask)
        return self.lm_head(F.rms_norm(h, (hp.D,), self.ln_f.weight, hp.eps))


# ================================================================================================================
# vllm_varlen_blocks
# ================================================================================================================
def _fused_add_rms(x, residual, w, eps):
    """vLLM's fused_add_rms_norm: residual <- x + residual; x <- RMSNorm(residual) * w."""
    residual = x if residual is None else x + residual
    return residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + eps) * w, residual


class _VLayer(nn.Module):
    BLOCK = 4

    def __init__(self, sd, i, hp):
        super().__init__()
        self.hp = hp
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.ln_in = _p(sd[p + "input_layernorm.weight"])
        self.ln_post = _p(sd[p + "post_attention_layernorm.weight"])
        self.qkv_proj_t = _p(torch.cat([sd[a + n + "_proj.weight"] for n in "qkv"], 0).t())
        qkv_out = (hp.nH + 2 * hp.nKV) * hp.Hd
        self.qkv_bias = _p(
            torch.cat([sd[a + n + "_proj.bias"] for n in "qkv"], 0) if hp.attn_bias else torch.zeros(qkv_out)
        )
        self.o_proj_t = _p(sd[a + "o_proj.weight"].t())
        if hp.qk_norm:
            self.q_norm_w = _p(sd[a + "q_norm.weight"])
            self.k_norm_w = _p(sd[a + "k_norm.weight"])
        m = p + "mlp."
        self.moe = hp.is_moe(i)
        if self.moe:
            self.router_t = _p(sd[m + "gate.weight"].t())
            self.register_buffer("e_bias", sd[m + "gate.e_score_correction_bias"].detach().clone().float())
            self.w13 = _p(sd[m + "experts.gate_up_proj"])  # (E, 2Im, D)
            self.w2 = _p(sd[m + "experts.down_proj"])  # (E, D, Im)
            s = m + "shared_experts."
            if hp.nS > 0:
                self.shared_gate_up_t = _p(torch.cat((sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]), 0).t())
                self.shared_down_t = _p(sd[s + "down_proj.weight"].t())
        else:
            self.gate_up_t = _p(torch.cat((sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]), 0).t())
            self.down_t = _p(sd[m + "down_proj.weight"].t())

    @staticmethod
    def _silu_and_mul(x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def _rope_neox(self, x, cos_sin):  # x (T, H, Hd); cos_sin (T, R) = [cos | sin]
        hp = self.hp
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        rot = x[..., : hp.R]
        x1, x2 = rot[..., : hp.half], rot[..., hp.half :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., hp.R :]), dim=-1)

    def attention(self, x, cos_sin, cu_seqlens):
        hp = self.hp
        T = x.shape[0]
        qkv = torch.addmm(self.qkv_bias, x, self.qkv_proj_t)
        q, k, v = qkv.split([hp.nH * hp.Hd, hp.nKV * hp.Hd, hp.nKV * hp.Hd], dim=-1)
        q = q.view(T, hp.nH, hp.Hd)
        k = k.view(T, hp.nKV, hp.Hd)
        v = v.view(T, hp.nKV, hp.Hd)
        if hp.qk_norm:
            q = F.rms_norm(q, (hp.Hd,), self.q_norm_w, hp.eps)
            k = F.rms_norm(k, (hp.Hd,), self.k_norm_w, hp.eps)
        q, k = self._rope_neox(q, cos_sin), self._rope_neox(k, cos_sin)
        out = torch.empty(T, hp.nH, hp.Hd, device=x.device)
        bounds = cu_seqlens.tolist()
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            if s1 == s0:
                continue
            qs, ks, vs = (t[s0:s1].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            out[s0:s1] = o[0].transpose(0, 1)
        return torch.mm(out.reshape(T, -1), self.o_proj_t)

    def _grouped_topk(self, x):
        hp = self.hp
        T = x.shape[0]
        scores = torch.sigmoid(torch.mm(x, self.router_t))
        original = scores
        scores = scores + self.e_bias.unsqueeze(0)
        n = hp.E // hp.G
        group_scores = scores.view(T, hp.G, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=hp.TG, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, hp.G, n).reshape(T, -1)
        tmp = scores.masked_fill(~score_mask.bool(), float("-inf"))
        topk_ids = torch.topk(tmp, k=hp.K, dim=-1, sorted=False)[1]
        topk_weights = original.gather(1, topk_ids)
        if hp.norm_topk:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weights * hp.rsf, topk_ids

    def fused_moe(self, x):
        hp, BLOCK = self.hp, self.BLOCK
        T, D = x.shape
        topk_w, topk_ids = self._grouped_topk(x)
        flat_e = topk_ids.reshape(-1)
        flat_w = topk_w.reshape(-1)
        flat_t = torch.arange(T, device=x.device).repeat_interleave(hp.K)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=hp.E).tolist()
        sorted_tok, sorted_w, block_expert = [], [], []
        start = 0
        for e, c in enumerate(counts):  # moe_align_block_size
            if c == 0:
                continue
            seg = order[start : start + c]
            start += c
            padded = -(-c // BLOCK) * BLOCK
            sorted_tok.append(torch.cat((flat_t[seg], torch.full((padded - c,), T, device=x.device))))
            sorted_w.append(torch.cat((flat_w[seg], torch.zeros(padded - c, device=x.device))))
            block_expert += [e] * (padded // BLOCK)
        tok = torch.cat(sorted_tok)
        wts = torch.cat(sorted_w)
        blocks = torch.tensor(block_expert, device=x.device)
        x_pad = torch.cat((x, x.new_zeros(1, D)), 0)
        xb = x_pad[tok].view(-1, BLOCK, D)
        h = torch.bmm(xb, self.w13[blocks].transpose(1, 2))
        y = torch.bmm(self._silu_and_mul(h), self.w2[blocks].transpose(1, 2)).reshape(-1, D)
        out = torch.zeros(T + 1, D, device=x.device).index_add_(0, tok, y * wts[:, None])[:T]
        if hp.nS > 0:
            out = out + torch.mm(self._silu_and_mul(torch.mm(x, self.shared_gate_up_t)), self.shared_down_t)
        return out

    def mlp(self, x):
        if self.moe:
            return self.fused_moe(x)
        return torch.mm(self._silu_and_mul(torch.mm(x, self.gate_up_t)), self.down_t)


class VllmVarlenBlocks(_Port):
    layout = "vllm_varlen_blocks"

    def __init__(self, sd, hp):
        super().__init__()
        self.hp = hp
        self.embed = _p(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_VLayer(sd, i, hp) for i in range(hp.L)])
        self.ln_final = _p(sd["model.norm.weight"])
        self.lm_head_t = _p(_head_weight(sd).t())
        inv = hp.inv_freq()
        self.register_buffer("inv_freq", inv, persistent=False)
        freqs = torch.arange(hp.max_pos, dtype=torch.float32)[:, None] * inv
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def _logits(self, ids, valid, pos):
        hp = self.hp
        B, S = ids.shape
        lens = valid.sum(1)
        cu_seqlens = torch.cat((lens.new_zeros(1), lens.cumsum(0)))
        flat_ids, flat_pos = ids[valid], pos[valid]  # packed stream of real tokens
        if flat_pos.numel() and int(flat_pos.max()) < self.cos_sin_cache.shape[0] and int(flat_pos.min()) >= 0:
            cos_sin = self.cos_sin_cache[flat_pos]
        else:
            f = flat_pos.float()[:, None] * self.inv_freq
            cos_sin = torch.cat((f.cos(), f.sin()), dim=-1)
        x = F.embedding(flat_ids, self.embed)
        residual = None
        for layer in self.layers:
            x, residual = _fused_add_rms(x, residual, layer.ln_in, hp.eps)
            x = layer.attention(x, cos_sin, cu_seqlens)
            x, residual = _fused_add_rms(x, residual, layer.ln_post, hp.eps)
            x = layer.mlp(x)
        x, _ = _fused_add_rms(x, residual, self.ln_final, hp.eps)
        logits = torch.mm(x, self.lm_head_t)
        out = logits.new_zeros(B, S, hp.V)
        out[valid] = logits
        return out


# ================================================================================================================
_LAYOUTS = {
    "": SarvamPort,
    "fused_sdpa_tables": FusedSdpaTables,
    "meta_complex_sorted": MetaComplexSorted,
    "gguf_functional_gather": GgufFunctional,
    "flax_scan_gshard": FlaxScanGShard,
    "megatron_tp_ep": MegatronTpEp,
    "folded_perhead_rotmat": FoldedPerHeadRotmat,
    "shared_as_expert_pertoken": SharedAsExpertPerToken,
    "vllm_varlen_blocks": VllmVarlenBlocks,
}


def build(state_dict, config) -> nn.Module:
    layout = BUG
    if layout not in _LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {sorted(_LAYOUTS)}")
    hp = _HP(config)
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = _LAYOUTS[layout](sd, hp)
    return model.float().eval()
