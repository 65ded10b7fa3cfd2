"""A hand-written PyTorch port of GLM-4 (Transformers' ``GlmForCausalLM``, model_type ``glm``) in nine layouts.

Architecture (as this port implements it)
-----------------------------------------
Notation: V vocab, C hidden size, L layers, H query heads, G key/value heads (GQA, rep = H / G), D head_dim,
I intermediate size, R = int(D * partial_rotary_factor) rotary dims (R/2 frequencies), eps = rms_norm_eps.

    x_0      = E[ids]                                             (token embedding, E: V x C)
    for each layer l:
        a    = rms(x) * g_attn           rms(x) = x / sqrt(mean(x^2) + eps)
        q    = a Wq^T + bq   (H heads of D)      k = a Wk^T + bk  (G heads)      v = a Wv^T + bv  (G heads)
        q, k = rope(q, p), rope(k, p)                               (p: the token's position id)
        o_h  = softmax(q_h k_{h//rep}^T / sqrt(D) + mask) v_{h//rep}    (query head h reads kv head h // rep)
        x    = x + concat_h(o_h) Wo^T                               (o_proj: no bias)
        m    = rms(x) * g_mlp
        [gt | up] = m Wgu^T                                         (one fused matrix, gate rows first)
        x    = x + (silu(gt) * up) Wdown^T
    logits   = (rms(x) * g_final) Wlm^T                             (lm_head untied unless the config ties it)

RoPE (GLM's convention): only the first R dims of each head rotate, the other D - R pass through. Pairs are
*interleaved*: dims (2i, 2i+1), i < R/2, rotate by the angle p * theta^(-2i/R):
    y[2i]   = x[2i] cos - x[2i+1] sin
    y[2i+1] = x[2i] sin + x[2i+1] cos
Mask: causal by sequence index (not by position id), and a key is visible only if attention_mask marks it 1
(left padding). Query rows that see nothing (leading padding) are kept finite (never NaN), since their values
feed later layers' keys/values at masked slots only.

Layouts (``BUG`` selects one, read at call time in ``build``)
------------------------------------------------------------
"" (baseline) - ``GlmPort``: a module tree of my own (``tok``, ``blocks[i].ln1/attn/ln2/ffn``, ``ln_f``,
    ``head``). Separate q/k/v ``nn.Linear`` with bias, fused ``w_gate_up`` linear split by ``chunk``. RoPE from
    cos/sin recomputed per call, interleaved to D-length and combined with a rotate-every-two. Eager attention:
    kv heads repeated to H, additive float32-min mask, softmax.

"vllm_fused" - inference-engine style (vLLM): one ``qkv_proj`` (rows q|k|v, biases concatenated), ``gate_proj``
    and ``up_proj`` kept *separate* (un-fused at load), norms written as fused add-RMSNorm that carries the
    residual stream between calls (``h, res = norm(h, res)``), RoPE from a precomputed ``cos_sin_cache``
    buffer (max_pos x R, cos half | sin half) indexed by position and applied GPT-J style on even/odd lanes,
    attention through ``F.scaled_dot_product_attention`` with a boolean mask and ``enable_gqa`` (no repeat).

"meta_complex_folded" - research-repo style (Meta llama reference names ``tok_embeddings``, ``layers[i].attention
    .wq/wk/wv/wo``, ``feed_forward.w1/w3/w2``, ``output``): every RMSNorm gain folded at load into the columns of
    the matrices that read it (attention norm -> wq/wk/wv, mlp norm -> w1/w3, final norm -> output), so the
    norms carry no weights; RoPE as complex multiplication by a precomputed ``freqs_cis`` table (pairs viewed as
    complex numbers); grouped-query attention by einsum broadcasting q as (G, rep) against the G kv heads.

"flax_neox" - a port from JAX/Flax: a nested parameter pytree (``embedder/input_embedding``,
    ``layer_i/attn/q_einsum/w`` of shape (C, H, D), ``kv_einsum/w`` (2, C, G, D), ``attn_vec_einsum/w`` (H, D, C),
    ``mlp/gating_einsum/w`` (2, C, I), ``mlp/linear/w`` (I, C), ``*_norm/scale``, ``unembed`` (C, V)): every
    matrix transposed to (in, out) and used by einsum. Q/K head dims permuted at load so that the rotary pairs
    become *half-split* (evens then odds, NeoX rotate_half); attention is a blocked online (flash-style) softmax
    over key chunks of 8.

"gguf_functional" - llama.cpp style: a flat dict of tensors under GGUF names (``token_embd``,
    ``blk.i.attn_norm/attn_q/attn_k/attn_v/attn_output/ffn_norm/ffn_gate/ffn_up/ffn_down``, ``output_norm``,
    ``output``) and one functional forward (no submodules). Gate and up stored separately, angles computed on
    the fly as p * theta_scale^i (ggml's rope), attention through SDPA with an additive float mask after
    ``repeat_interleave`` of the kv heads.

"stacked_scan" - training-framework style (a scanned stack): every per-layer tensor stacked along a leading
    layer axis (``wq`` (L, H, D, C), ``wk``/``wv`` (L, G, D, C), ``wo`` (L, C, H, D), norms (L, 2, C)), query
    weight and bias pre-multiplied by 1/sqrt(D) (the softmax scale folded into q, RoPE being linear), gate/up
    rows *interleaved* (g0, u0, g1, u1, ...) in one (L, 2I, C) tensor, RoPE from precomputed cos/sin tables
    applied with a rotate-every-two, attention by einsum with kv heads expanded.

"megatron_seqfirst" - Megatron-core style: activations sequence-first (S, B, C); ``linear_qkv`` with its
    input RMSNorm gain held inside the module (TE's LayerNormLinear) and rows grouped *per kv group*
    ([q heads of group g | k_g | v_g] for each g); Q/K head dims permuted so the D - R pass-through dims come
    first and the rotary dims last, half-split; scores by ``baddbmm`` over (B*H) with Megatron's -10000 fill;
    ``linear_fc1`` (gate|up, with its norm gain inside) and ``linear_fc2``; ``final_layernorm``, ``output_layer``.

"tp2_sharded" - tensor-parallel emulation with 2 ranks in one process: vocab-parallel embedding (each rank
    holds half the vocab, masked lookup, sums "all-reduced"), each rank holds one kv group (its rep query
    heads, its k/v head, its column slice of o_proj), column-parallel gate/up and row-parallel down slices of
    the MLP, partial outputs summed; norms via ``F.rms_norm``; RoPE as explicit 2x2 rotation matrices (a
    block-diagonal R x R matrix per position) applied by einsum; softmax written as exp(s - max) / sum;
    vocab-parallel lm_head gathered by concatenation.

"notebook_perhead" - notebook style: one small ``nn.Linear`` per query head and per kv head
    (``heads_q[h]``, ``heads_k[g]``, ``heads_v[g]``, each D x C with bias) and a Python loop over heads;
    RoPE with Flax/T5-style timescales (angle = p / theta^(2i/R)) on even/odd lanes; RMSNorm written as
    x / sqrt(sum(x^2)/C + eps); SiLU written as x * sigmoid(x); softmax as exp(s - logsumexp(s)); a finite
    -1e9 mask from comparing index grids.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

CLEAN = [
    "vllm_fused",  # fused qkv, separate gate/up, fused add-RMSNorm, cos_sin_cache, SDPA bool mask + enable_gqa
    "meta_complex_folded",  # llama-ref names, norm gains folded into next matrices, complex RoPE, GQA einsum
    "flax_neox",  # nested (in, out) pytree + einsum, q/k rows permuted to half-split RoPE, online-softmax blocks
    "gguf_functional",  # flat GGUF-named dict, one functional forward, ggml rope angles, SDPA float mask
    "stacked_scan",  # per-layer tensors stacked, softmax scale folded into q, interleaved gate/up rows
    "megatron_seqfirst",  # (S,B,C), per-group qkv rows, norm gain in linear, pass dims first, baddbmm -1e4
    "tp2_sharded",  # 2-rank tensor parallel emulation, vocab-parallel embed/head, rotation-matrix RoPE
    "notebook_perhead",  # per-head nn.Linear modules and loops, timescale RoPE, logsumexp softmax
]
BUGS = []
PADDING_ONLY = []


# ----------------------------------------------------------------------------------------------------------
# shared config reading
# ----------------------------------------------------------------------------------------------------------
class Dims:
    def __init__(self, config):
        self.V = config.vocab_size
        self.C = config.hidden_size
        self.L = config.num_hidden_layers
        self.H = config.num_attention_heads
        self.G = config.num_key_value_heads or config.num_attention_heads
        self.D = getattr(config, "head_dim", None) or self.C // self.H
        self.rep = self.H // self.G
        self.I = config.intermediate_size
        self.eps = config.rms_norm_eps
        rp = getattr(config, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        prf = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.5))
        self.R = int(self.D * prf)
        rope_type = rp.get("rope_type", "default")
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r}")
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {act!r}")
        self.max_pos = config.max_position_embeddings
        self.tied = bool(getattr(config, "tie_word_embeddings", False))


def _lm_head(sd):
    return sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]


def _hf(sd, i, name):
    return sd[f"model.layers.{i}.{name}"]


def _defaults(input_ids, attention_mask, position_ids):
    B, S = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    elif position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0).expand(B, S)
    if attention_mask is None:
        attention_mask = torch.ones(B, S, dtype=torch.long, device=input_ids.device)
    return attention_mask, position_ids


# ----------------------------------------------------------------------------------------------------------
# baseline
# ----------------------------------------------------------------------------------------------------------
class RMS(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.weight = nn.Parameter(w.clone())
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _lin(w, b=None):
    m = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        m.weight.copy_(w)
        if b is not None:
            m.bias.copy_(b)
    return m


def _every_two(x):
    # (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)


class BaseAttn(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.d = d
        self.wq = _lin(_hf(sd, i, "self_attn.q_proj.weight"), sd.get(f"model.layers.{i}.self_attn.q_proj.bias"))
        self.wk = _lin(_hf(sd, i, "self_attn.k_proj.weight"), sd.get(f"model.layers.{i}.self_attn.k_proj.bias"))
        self.wv = _lin(_hf(sd, i, "self_attn.v_proj.weight"), sd.get(f"model.layers.{i}.self_attn.v_proj.bias"))
        self.wo = _lin(_hf(sd, i, "self_attn.o_proj.weight"), sd.get(f"model.layers.{i}.self_attn.o_proj.bias"))

    def rope(self, x, cos, sin):
        R = self.d.R
        r, keep = x[..., :R], x[..., R:]
        return torch.cat((r * cos + _every_two(r) * sin, keep), -1)

    def forward(self, x, cos, sin, bias):
        d = self.d
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, d.H, d.D).transpose(1, 2)
        k = self.wk(x).view(B, S, d.G, d.D).transpose(1, 2)
        v = self.wv(x).view(B, S, d.G, d.D).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        k = k[:, :, None].expand(B, d.G, d.rep, S, d.D).reshape(B, d.H, S, d.D)
        v = v[:, :, None].expand(B, d.G, d.rep, S, d.D).reshape(B, d.H, S, d.D)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d.D) + bias
        o = torch.softmax(s, -1) @ v
        return self.wo(o.transpose(1, 2).reshape(B, S, d.H * d.D))


class BaseFFN(nn.Module):
    def __init__(self, sd, i):
        super().__init__()
        self.w_gate_up = _lin(_hf(sd, i, "mlp.gate_up_proj.weight"))
        self.w_down = _lin(_hf(sd, i, "mlp.down_proj.weight"))

    def forward(self, x):
        g, u = self.w_gate_up(x).chunk(2, -1)
        return self.w_down(F.silu(g) * u)


class BaseBlock(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.ln1 = RMS(_hf(sd, i, "input_layernorm.weight"), d.eps)
        self.attn = BaseAttn(d, sd, i)
        self.ln2 = RMS(_hf(sd, i, "post_attention_layernorm.weight"), d.eps)
        self.ffn = BaseFFN(sd, i)

    def forward(self, x, cos, sin, bias):
        x = x + self.attn(self.ln1(x), cos, sin, bias)
        return x + self.ffn(self.ln2(x))


class GlmPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = d = Dims(config)
        self.tok = nn.Embedding(d.V, d.C)
        with torch.no_grad():
            self.tok.weight.copy_(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList(BaseBlock(d, sd, i) for i in range(d.L))
        self.ln_f = RMS(sd["model.norm.weight"], d.eps)
        self.head = _lin(_lm_head(sd))
        self.register_buffer("inv_freq", 1.0 / d.theta ** (torch.arange(0, d.R, 2).float() / d.R), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        d = self.d
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        B, S = input_ids.shape
        ang = pos[..., None].float() * self.inv_freq  # (B, S, R/2)
        cos = ang.cos().repeat_interleave(2, -1)[:, None]  # (B, 1, S, R)
        sin = ang.sin().repeat_interleave(2, -1)[:, None]
        causal = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril()
        ok = causal[None] & mask.bool()[:, None, :]
        bias = torch.zeros(B, 1, S, S).masked_fill(~ok[:, None], torch.finfo(torch.float32).min)
        x = self.tok(input_ids)
        for blk in self.blocks:
            x = blk(x, cos, sin, bias)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------------------------------------
# vllm_fused
# ----------------------------------------------------------------------------------------------------------
class FusedAddRMSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.weight = nn.Parameter(w.clone())
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        residual = x
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.variance_epsilon) * self.weight, residual


class VRotary(nn.Module):
    """cos_sin_cache: (max_pos, R) = [cos(angles) | sin(angles)], GPT-J (non-NeoX) application."""

    def __init__(self, d):
        super().__init__()
        self.rot, self.base = d.R, d.theta
        self.register_buffer("cos_sin_cache", self._table(d.max_pos), persistent=False)

    def _table(self, n):
        inv = 1.0 / (self.base ** (torch.arange(0, self.rot, 2, dtype=torch.float) / self.rot))
        t = torch.arange(n, dtype=torch.float)
        f = torch.einsum("i,j->ij", t, inv)
        return torch.cat((f.cos(), f.sin()), dim=-1)

    def forward(self, positions, q, k):
        need = int(positions.max()) + 1
        if need > self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = self._table(need)
        cs = self.cos_sin_cache[positions]  # (B, S, R)
        cos, sin = cs.chunk(2, dim=-1)  # (B, S, R/2)
        cos, sin = cos[:, :, None], sin[:, :, None]

        def apply(x):  # x: (B, S, n, D)
            rot, rest = x[..., : self.rot], x[..., self.rot :]
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            return torch.cat((torch.stack((o1, o2), dim=-1).flatten(-2), rest), dim=-1)

        return apply(q), apply(k)


class VAttention(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.d = d
        self.q_size, self.kv_size = d.H * d.D, d.G * d.D
        w = torch.cat([_hf(sd, i, f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
        b = torch.cat([_hf(sd, i, f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
        self.qkv_proj = _lin(w, b)
        self.o_proj = _lin(_hf(sd, i, "self_attn.o_proj.weight"))
        self.rotary_emb = VRotary(d)

    def forward(self, positions, h, allowed):
        d = self.d
        B, S, _ = h.shape
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q.view(B, S, d.H, d.D), k.view(B, S, d.G, d.D))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.view(B, S, d.G, d.D).transpose(1, 2),
            attn_mask=allowed,
            enable_gqa=True,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.q_size))


class VMLP(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        g, u = _hf(sd, i, "mlp.gate_up_proj.weight").split([d.I, d.I], 0)
        self.gate_proj = _lin(g)
        self.up_proj = _lin(u)
        self.down_proj = _lin(_hf(sd, i, "mlp.down_proj.weight"))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VDecoderLayer(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.input_layernorm = FusedAddRMSNorm(_hf(sd, i, "input_layernorm.weight"), d.eps)
        self.self_attn = VAttention(d, sd, i)
        self.post_attention_layernorm = FusedAddRMSNorm(_hf(sd, i, "post_attention_layernorm.weight"), d.eps)
        self.mlp = VMLP(d, sd, i)

    def forward(self, positions, h, residual, allowed):
        h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, allowed)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class VllmGlm(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = d = Dims(config)
        self.embed_tokens = nn.Embedding(d.V, d.C)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(VDecoderLayer(d, sd, i) for i in range(d.L))
        self.norm = FusedAddRMSNorm(sd["model.norm.weight"], d.eps)
        self.lm_head = _lin(_lm_head(sd))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        S = input_ids.shape[1]
        idx = torch.arange(S, device=input_ids.device)
        eye = idx[:, None] == idx[None, :]
        allowed = (idx[None, :] <= idx[:, None])[None] & (mask.bool()[:, None, :] | eye[None])
        allowed = allowed[:, None]  # (B, 1, S, S); the diagonal keeps pad rows finite
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(pos, h, residual, allowed)
        h, _ = self.norm(h, residual)
        return self.lm_head(h)


# ----------------------------------------------------------------------------------------------------------
# meta_complex_folded
# ----------------------------------------------------------------------------------------------------------
def _unit_rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class MAttention(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.d = d
        g = _hf(sd, i, "input_layernorm.weight")
        self.wq = _lin(_hf(sd, i, "self_attn.q_proj.weight") * g, _hf(sd, i, "self_attn.q_proj.bias"))
        self.wk = _lin(_hf(sd, i, "self_attn.k_proj.weight") * g, _hf(sd, i, "self_attn.k_proj.bias"))
        self.wv = _lin(_hf(sd, i, "self_attn.v_proj.weight") * g, _hf(sd, i, "self_attn.v_proj.bias"))
        self.wo = _lin(_hf(sd, i, "self_attn.o_proj.weight"))

    @staticmethod
    def _rot(x, fc, R):
        xr = torch.view_as_complex(x[..., :R].float().reshape(*x.shape[:-1], R // 2, 2).contiguous())
        y = torch.view_as_real(xr * fc).flatten(-2)
        return torch.cat((y, x[..., R:]), -1)

    def forward(self, x, freqs_cis, add_mask):
        d = self.d
        B, S, _ = x.shape
        xq = self.wq(x).view(B, S, d.G, d.rep, d.D)
        xk = self.wk(x).view(B, S, d.G, d.D)
        xv = self.wv(x).view(B, S, d.G, d.D)
        xq = self._rot(xq, freqs_cis[:, :, None, None], d.R)
        xk = self._rot(xk, freqs_cis[:, :, None], d.R)
        scores = torch.einsum("bqgrd,bkgd->bgrqk", xq, xk) * d.D**-0.5
        scores = scores + add_mask[:, None, None]
        p = F.softmax(scores.float(), dim=-1)
        out = torch.einsum("bgrqk,bkgd->bqgrd", p, xv).reshape(B, S, d.H * d.D)
        return self.wo(out)


class MFeedForward(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        g = _hf(sd, i, "post_attention_layernorm.weight")
        w1, w3 = _hf(sd, i, "mlp.gate_up_proj.weight").split([d.I, d.I], 0)
        self.w1 = _lin(w1 * g)
        self.w3 = _lin(w3 * g)
        self.w2 = _lin(_hf(sd, i, "mlp.down_proj.weight"))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MBlock(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.eps = d.eps
        self.attention = MAttention(d, sd, i)
        self.feed_forward = MFeedForward(d, sd, i)

    def forward(self, x, freqs_cis, add_mask):
        h = x + self.attention(_unit_rms(x, self.eps), freqs_cis, add_mask)
        return h + self.feed_forward(_unit_rms(h, self.eps))


class MetaGlm(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = d = Dims(config)
        self.tok_embeddings = nn.Embedding(d.V, d.C)
        with torch.no_grad():
            self.tok_embeddings.weight.copy_(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(MBlock(d, sd, i) for i in range(d.L))
        self.output = _lin(_lm_head(sd) * sd["model.norm.weight"])
        freqs = 1.0 / (d.theta ** (torch.arange(0, d.R, 2)[: d.R // 2].float() / d.R))
        t = torch.arange(max(d.max_pos, 1) * 2, dtype=torch.float32)
        self.register_buffer(
            "freqs_cis", torch.polar(torch.ones(len(t), len(freqs)), torch.outer(t, freqs)), persistent=False
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        B, S = input_ids.shape
        fc = self.freqs_cis[pos]  # (B, S, R/2) complex
        add = torch.full((S, S), float("-inf")).triu(1)
        add = add[None].expand(B, S, S).clone()
        add = add.masked_fill(~mask.bool()[:, None, :], float("-inf"))
        # a query row with no visible key (leading padding) sees itself, so that nothing becomes NaN
        dead = torch.isinf(add).all(-1)
        add = torch.where(dead[..., None] & torch.eye(S, dtype=torch.bool)[None], torch.zeros(()), add)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, fc, add)
        return self.output(_unit_rms(h, self.d.eps))


# ----------------------------------------------------------------------------------------------------------
# flax_neox
# ----------------------------------------------------------------------------------------------------------
def _half_split_perm(D, R):
    """Within one head: rotary evens, rotary odds, then the pass-through dims."""
    return torch.cat((torch.arange(0, R, 2), torch.arange(1, R, 2), torch.arange(R, D)))


class FlaxGlm(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = d = Dims(config)
        perm = _half_split_perm(d.D, d.R)
        p = {"embedder": {"input_embedding": sd["model.embed_tokens.weight"].clone()}}
        for i in range(d.L):
            wq = _hf(sd, i, "self_attn.q_proj.weight").view(d.H, d.D, d.C)[:, perm]
            bq = _hf(sd, i, "self_attn.q_proj.bias").view(d.H, d.D)[:, perm]
            wk = _hf(sd, i, "self_attn.k_proj.weight").view(d.G, d.D, d.C)[:, perm]
            bk = _hf(sd, i, "self_attn.k_proj.bias").view(d.G, d.D)[:, perm]
            wv = _hf(sd, i, "self_attn.v_proj.weight").view(d.G, d.D, d.C)
            bv = _hf(sd, i, "self_attn.v_proj.bias").view(d.G, d.D)
            wo = _hf(sd, i, "self_attn.o_proj.weight")  # (C, H*D)
            gu = _hf(sd, i, "mlp.gate_up_proj.weight").view(2, d.I, d.C)
            p[f"layer_{i}"] = {
                "pre_attention_norm": {"scale": _hf(sd, i, "input_layernorm.weight").clone()},
                "attn": {
                    "q_einsum": {"w": wq.permute(2, 0, 1).contiguous(), "b": bq.contiguous()},
                    "kv_einsum": {
                        "w": torch.stack((wk, wv)).permute(0, 3, 1, 2).contiguous(),
                        "b": torch.stack((bk, bv)).contiguous(),
                    },
                    "attn_vec_einsum": {"w": wo.t().reshape(d.H, d.D, d.C).contiguous()},
                },
                "pre_ffw_norm": {"scale": _hf(sd, i, "post_attention_layernorm.weight").clone()},
                "mlp": {
                    "gating_einsum": {"w": gu.transpose(1, 2).contiguous()},  # (2, C, I)
                    "linear": {"w": _hf(sd, i, "mlp.down_proj.weight").t().contiguous()},  # (I, C)
                },
            }
        p["final_norm"] = {"scale": sd["model.norm.weight"].clone()}
        p["unembed"] = _lm_head(sd).t().contiguous()
        self.params = p
        self._holder = nn.ParameterDict()
        self._register(p, "")
        self.block = 8

    def _register(self, tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                self._register(v, f"{prefix}{k}__")
            else:
                param = nn.Parameter(v)
                self._holder[f"{prefix}{k}"] = param

    def _leaf(self, *path):
        return self._holder["__".join(path)]

    def _norm(self, x, scale):
        var = (x * x).mean(-1, keepdims=True)
        return x * torch.rsqrt(var + self.d.eps) * scale

    def _rope(self, x, sin, cos):  # x (B, T, N, D), half-split rotary lanes first
        R = self.d.R
        x1, x2, rest = x[..., : R // 2], x[..., R // 2 : R], x[..., R:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), -1)

    def _attend(self, q, k, v, ok):
        """Blocked online softmax. q (B,T,H,D), k/v (B,T,G,D), ok (B,T,T) bool."""
        d = self.d
        B, T = q.shape[:2]
        q = q.reshape(B, T, d.G, d.rep, d.D) * d.D**-0.5
        m = torch.full((B, T, d.G, d.rep), float("-inf"))
        l = torch.zeros(B, T, d.G, d.rep)
        acc = torch.zeros(B, T, d.G, d.rep, d.D)
        neg = torch.finfo(torch.float32).min
        for s0 in range(0, T, self.block):
            kb, vb = k[:, s0 : s0 + self.block], v[:, s0 : s0 + self.block]
            s = torch.einsum("btgrd,bsgd->btgrs", q, kb)
            s = s.masked_fill(~ok[:, :, None, None, s0 : s0 + self.block], neg)
            m_new = torch.maximum(m, s.amax(-1))
            corr = torch.exp(m - m_new)
            pexp = torch.exp(s - m_new[..., None])
            l = l * corr + pexp.sum(-1)
            acc = acc * corr[..., None] + torch.einsum("btgrs,bsgd->btgrd", pexp, vb)
            m = m_new
        return (acc / l[..., None]).reshape(B, T, d.H, d.D)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        d = self.d
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        B, T = input_ids.shape
        frac = 2 * torch.arange(d.R // 2, dtype=torch.float32) / d.R
        ang = pos[..., None].float() / (d.theta**frac)  # (B, T, R/2)
        sin, cos = ang.sin()[:, :, None], ang.cos()[:, :, None]
        t = torch.arange(T)
        ok = (t[None, :] <= t[:, None])[None] & mask.bool()[:, None, :]
        x = self._leaf("embedder", "input_embedding")[input_ids]
        for i in range(d.L):
            ly = f"layer_{i}"
            a = self._norm(x, self._leaf(ly, "pre_attention_norm", "scale"))
            q = torch.einsum("btc,chd->bthd", a, self._leaf(ly, "attn", "q_einsum", "w")) + self._leaf(
                ly, "attn", "q_einsum", "b"
            )
            kv = (
                torch.einsum("btc,scgd->sbtgd", a, self._leaf(ly, "attn", "kv_einsum", "w"))
                + self._leaf(ly, "attn", "kv_einsum", "b")[:, None, None]
            )
            k, v = kv[0], kv[1]
            q, k = self._rope(q, sin, cos), self._rope(k, sin, cos)
            o = self._attend(q, k, v, ok)
            x = x + torch.einsum("bthd,hdc->btc", o, self._leaf(ly, "attn", "attn_vec_einsum", "w"))
            f = self._norm(x, self._leaf(ly, "pre_ffw_norm", "scale"))
            gu = torch.einsum("btc,sci->sbti", f, self._leaf(ly, "mlp", "gating_einsum", "w"))
            x = x + (F.silu(gu[0]) * gu[1]) @ self._leaf(ly, "mlp", "linear", "w")
        x = self._norm(x, self._leaf("final_norm", "scale"))
        return x @ self._leaf("unembed")


# ----------------------------------------------------------------------------------------------------------
# gguf_functional
# ----------------------------------------------------------------------------------------------------------
def _to_gguf(sd, d):
    g = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(d.L):
        b = f"blk.{i}."
        g[b + "attn_norm.weight"] = _hf(sd, i, "input_layernorm.weight")
        for n in "qkv":
            g[b + f"attn_{n}.weight"] = _hf(sd, i, f"self_attn.{n}_proj.weight")
            g[b + f"attn_{n}.bias"] = _hf(sd, i, f"self_attn.{n}_proj.bias")
        g[b + "attn_output.weight"] = _hf(sd, i, "self_attn.o_proj.weight")
        g[b + "ffn_norm.weight"] = _hf(sd, i, "post_attention_layernorm.weight")
        gate, up = _hf(sd, i, "mlp.gate_up_proj.weight").split([d.I, d.I], 0)
        g[b + "ffn_gate.weight"], g[b + "ffn_up.weight"] = gate, up
        g[b + "ffn_down.weight"] = _hf(sd, i, "mlp.down_proj.weight")
    g["output_norm.weight"] = sd["model.norm.weight"]
    g["output.weight"] = _lm_head(sd)
    return {k: v.detach().clone().contiguous() for k, v in g.items()}


def gguf_forward(t, hp, input_ids, attention_mask=None, position_ids=None):
    mask, pos = _defaults(input_ids, attention_mask, position_ids)
    B, S = input_ids.shape
    H, G, D, R, eps = hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["n_rot"], hp["eps"]

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    theta_scale = hp["freq_base"] ** (-2.0 / R)
    i = torch.arange(R // 2, dtype=torch.float32)
    theta = pos[..., None].float() * theta_scale**i  # (B, S, R/2)
    c, s = torch.cos(theta)[:, None], torch.sin(theta)[:, None]  # (B, 1, S, R/2)

    def rope(x):  # (B, n, S, D); ggml "normal" mode: adjacent lanes
        x0, x1 = x[..., 0:R:2], x[..., 1:R:2]
        y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).reshape(*x.shape[:-1], R)
        return torch.cat((y, x[..., R:]), -1)

    kq_mask = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None].repeat(B, 1, 1)
    kq_mask = kq_mask.masked_fill(mask[:, None, :] == 0, torch.finfo(torch.float32).min)[:, None]

    cur = t["token_embd.weight"][input_ids]
    for il in range(hp["n_layer"]):
        b = f"blk.{il}."
        inp = cur
        cur = rms(cur, t[b + "attn_norm.weight"])
        Q = F.linear(cur, t[b + "attn_q.weight"], t[b + "attn_q.bias"]).view(B, S, H, D).permute(0, 2, 1, 3)
        K = F.linear(cur, t[b + "attn_k.weight"], t[b + "attn_k.bias"]).view(B, S, G, D).permute(0, 2, 1, 3)
        V = F.linear(cur, t[b + "attn_v.weight"], t[b + "attn_v.bias"]).view(B, S, G, D).permute(0, 2, 1, 3)
        Q, K = rope(Q), rope(K)
        K = K.repeat_interleave(H // G, dim=1)
        V = V.repeat_interleave(H // G, dim=1)
        kqv = F.scaled_dot_product_attention(Q, K, V, attn_mask=kq_mask, scale=1.0 / math.sqrt(D))
        cur = F.linear(kqv.permute(0, 2, 1, 3).reshape(B, S, H * D), t[b + "attn_output.weight"])
        ffn_inp = cur + inp
        cur = rms(ffn_inp, t[b + "ffn_norm.weight"])
        cur = F.silu(F.linear(cur, t[b + "ffn_gate.weight"])) * F.linear(cur, t[b + "ffn_up.weight"])
        cur = F.linear(cur, t[b + "ffn_down.weight"]) + ffn_inp
    cur = rms(cur, t["output_norm.weight"])
    return F.linear(cur, t["output.weight"])


class GgufGlm(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        d = Dims(config)
        # the flat GGUF dict; its tensors also registered (dots -> "%") so that .to()/.float() reach them
        self.gguf = nn.ParameterDict({k.replace(".", "%"): nn.Parameter(v) for k, v in _to_gguf(sd, d).items()})
        self.hparams = dict(
            n_head=d.H, n_head_kv=d.G, head_dim=d.D, n_rot=d.R, eps=d.eps, n_layer=d.L, freq_base=d.theta
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        tensors = {k.replace("%", "."): v for k, v in self.gguf.items()}
        return gguf_forward(tensors, self.hparams, input_ids, attention_mask, position_ids)


# ----------------------------------------------------------------------------------------------------------
# stacked_scan
# ----------------------------------------------------------------------------------------------------------
class StackedGlm(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = d = Dims(config)
        L, H, G, D, C, I = d.L, d.H, d.G, d.D, d.C, d.I
        sc = D**-0.5

        def stk(fn):
            return nn.Parameter(torch.stack([fn(i) for i in range(L)]).contiguous())

        self.embedding = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.wq = stk(lambda i: _hf(sd, i, "self_attn.q_proj.weight").view(H, D, C) * sc)
        self.bq = stk(lambda i: _hf(sd, i, "self_attn.q_proj.bias").view(H, D) * sc)
        self.wk = stk(lambda i: _hf(sd, i, "self_attn.k_proj.weight").view(G, D, C))
        self.bk = stk(lambda i: _hf(sd, i, "self_attn.k_proj.bias").view(G, D))
        self.wv = stk(lambda i: _hf(sd, i, "self_attn.v_proj.weight").view(G, D, C))
        self.bv = stk(lambda i: _hf(sd, i, "self_attn.v_proj.bias").view(G, D))
        self.wo = stk(lambda i: _hf(sd, i, "self_attn.o_proj.weight").view(C, H, D))
        self.norms = stk(
            lambda i: torch.stack((_hf(sd, i, "input_layernorm.weight"), _hf(sd, i, "post_attention_layernorm.weight")))
        )
        self.w_in = stk(lambda i: _hf(sd, i, "mlp.gate_up_proj.weight").view(2, I, C).transpose(0, 1).reshape(2 * I, C))
        self.w_out = stk(lambda i: _hf(sd, i, "mlp.down_proj.weight"))
        self.final_norm = nn.Parameter(sd["model.norm.weight"].clone())
        self.unembed = nn.Parameter(_lm_head(sd).clone())
        inv = 1.0 / d.theta ** (torch.arange(0, d.R, 2, dtype=torch.float64) / d.R)
        ang = torch.arange(d.max_pos, dtype=torch.float64)[:, None] * inv[None]
        self.register_buffer("cos_t", ang.cos().float().repeat_interleave(2, -1), persistent=False)
        self.register_buffer("sin_t", ang.sin().float().repeat_interleave(2, -1), persistent=False)

    def _norm(self, x, w):
        return x * (x.square().mean(-1, keepdim=True) + self.d.eps).rsqrt() * w

    def _layer(self, x, l, cos, sin, bias):
        d = self.d
        B, S, _ = x.shape
        a = self._norm(x, self.norms[l, 0])
        q = torch.einsum("bsc,hdc->bhsd", a, self.wq[l]) + self.bq[l][None, :, None]
        k = torch.einsum("bsc,gdc->bgsd", a, self.wk[l]) + self.bk[l][None, :, None]
        v = torch.einsum("bsc,gdc->bgsd", a, self.wv[l]) + self.bv[l][None, :, None]
        R = d.R
        q = torch.cat((q[..., :R] * cos + _every_two(q[..., :R]) * sin, q[..., R:]), -1)
        k = torch.cat((k[..., :R] * cos + _every_two(k[..., :R]) * sin, k[..., R:]), -1)
        k = k.repeat_interleave(d.rep, 1)
        v = v.repeat_interleave(d.rep, 1)
        w = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) + bias, -1)
        o = torch.einsum("bhqk,bhkd->bqhd", w, v)
        x = x + torch.einsum("bqhd,chd->bqc", o, self.wo[l])
        f = self._norm(x, self.norms[l, 1])
        gu = (f @ self.w_in[l].t()).unflatten(-1, (d.I, 2))
        return x + (F.silu(gu[..., 0]) * gu[..., 1]) @ self.w_out[l].t()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        B, S = input_ids.shape
        cos, sin = self.cos_t[pos][:, None], self.sin_t[pos][:, None]
        vis = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & (mask[:, None, :] > 0)
        bias = torch.where(vis, 0.0, -1e30)[:, None]
        x = F.embedding(input_ids, self.embedding)
        for l in range(self.d.L):
            x = self._layer(x, l, cos, sin, bias)
        return self._norm(x, self.final_norm) @ self.unembed.t()


# ----------------------------------------------------------------------------------------------------------
# megatron_seqfirst
# ----------------------------------------------------------------------------------------------------------
class LayerNormLinear(nn.Module):
    """TE-style: RMSNorm (its gain held here) followed by a linear layer."""

    def __init__(self, norm_w, w, b, eps):
        super().__init__()
        self.layer_norm_weight = nn.Parameter(norm_w.clone())
        self.weight = nn.Parameter(w.clone())
        self.bias = nn.Parameter(b.clone()) if b is not None else None
        self.eps = eps

    def forward(self, x):
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.layer_norm_weight
        return F.linear(n, self.weight, self.bias)


class MegSelfAttention(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.d = d
        perm = torch.cat((torch.arange(d.R, d.D), torch.arange(0, d.R, 2), torch.arange(1, d.R, 2)))
        wq = _hf(sd, i, "self_attn.q_proj.weight").view(d.G, d.rep, d.D, d.C)[:, :, perm]
        bq = _hf(sd, i, "self_attn.q_proj.bias").view(d.G, d.rep, d.D)[:, :, perm]
        wk = _hf(sd, i, "self_attn.k_proj.weight").view(d.G, 1, d.D, d.C)[:, :, perm]
        bk = _hf(sd, i, "self_attn.k_proj.bias").view(d.G, 1, d.D)[:, :, perm]
        wv = _hf(sd, i, "self_attn.v_proj.weight").view(d.G, 1, d.D, d.C)
        bv = _hf(sd, i, "self_attn.v_proj.bias").view(d.G, 1, d.D)
        w = torch.cat((wq, wk, wv), 1).reshape(-1, d.C)
        b = torch.cat((bq, bk, bv), 1).reshape(-1)
        self.linear_qkv = LayerNormLinear(_hf(sd, i, "input_layernorm.weight"), w, b, d.eps)
        self.linear_proj = _lin(_hf(sd, i, "self_attn.o_proj.weight"))

    def _rope(self, t, cos, sin):  # t (S, B, n, D): [pass | rot evens | rot odds]
        d = self.d
        P = d.D - d.R
        keep, rot = t[..., :P], t[..., P:]
        x1, x2 = rot[..., : d.R // 2], rot[..., d.R // 2 :]
        rot = torch.cat((x1, x2), -1) * cos + torch.cat((-x2, x1), -1) * sin
        return torch.cat((keep, rot), -1)

    def forward(self, h, cos, sin, mask):
        d = self.d
        S, B, _ = h.shape
        mixed = self.linear_qkv(h).view(S, B, d.G, d.rep + 2, d.D)
        q = mixed[:, :, :, : d.rep].reshape(S, B, d.H, d.D)
        k = mixed[:, :, :, d.rep]
        v = mixed[:, :, :, d.rep + 1]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        k = k[:, :, :, None].expand(S, B, d.G, d.rep, d.D).reshape(S, B, d.H, d.D)
        v = v[:, :, :, None].expand(S, B, d.G, d.rep, d.D).reshape(S, B, d.H, d.D)
        qb = q.reshape(S, B * d.H, d.D).transpose(0, 1)
        kb = k.reshape(S, B * d.H, d.D).transpose(0, 1)
        vb = v.reshape(S, B * d.H, d.D).transpose(0, 1)
        scores = torch.baddbmm(torch.empty(B * d.H, S, S), qb, kb.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(d.D))
        scores = scores.view(B, d.H, S, S).masked_fill(mask, -10000.0)
        probs = torch.softmax(scores, -1).view(B * d.H, S, S)
        ctx = torch.bmm(probs, vb).transpose(0, 1).reshape(S, B, d.H * d.D)
        return self.linear_proj(ctx)


class MegMLP(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.linear_fc1 = LayerNormLinear(
            _hf(sd, i, "post_attention_layernorm.weight"), _hf(sd, i, "mlp.gate_up_proj.weight"), None, d.eps
        )
        self.linear_fc2 = _lin(_hf(sd, i, "mlp.down_proj.weight"))

    def forward(self, h):
        a, b = torch.chunk(self.linear_fc1(h), 2, dim=-1)
        return self.linear_fc2(F.silu(a) * b)


class MegLayer(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.self_attention = MegSelfAttention(d, sd, i)
        self.mlp = MegMLP(d, sd, i)

    def forward(self, h, cos, sin, mask):
        h = h + self.self_attention(h, cos, sin, mask)
        return h + self.mlp(h)


class MegatronGlm(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = d = Dims(config)
        self.word_embeddings = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.layers = nn.ModuleList(MegLayer(d, sd, i) for i in range(d.L))
        self.final_layernorm = RMS(sd["model.norm.weight"], d.eps)
        self.output_layer = nn.Parameter(_lm_head(sd).clone())
        self.register_buffer("inv_freq", 1.0 / (d.theta ** (torch.arange(0, d.R, 2).float() / d.R)), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        B, S = input_ids.shape
        freqs = pos.t()[..., None].float() * self.inv_freq  # (S, B, R/2)
        emb = torch.cat((freqs, freqs), -1)[:, :, None]  # (S, B, 1, R)
        cos, sin = emb.cos(), emb.sin()
        # True = masked (Megatron convention)
        m = torch.ones(S, S, dtype=torch.bool).triu(1)[None] | (mask == 0)[:, None, :]
        m = m[:, None]  # (B, 1, S, S)
        h = self.word_embeddings[input_ids.t()]  # (S, B, C)
        for layer in self.layers:
            h = layer(h, cos, sin, m)
        h = self.final_layernorm(h)
        logits = torch.matmul(h, self.output_layer.t())  # (S, B, V)
        return logits.transpose(0, 1).contiguous()


# ----------------------------------------------------------------------------------------------------------
# tp2_sharded
# ----------------------------------------------------------------------------------------------------------
class TPRank(nn.Module):
    """One rank's slice of one layer: kv groups g in its range, MLP columns in its range."""

    def __init__(self, d, sd, i, rank, world):
        super().__init__()
        self.d = d
        gpr = d.G // world
        g0 = rank * gpr
        hq = slice(g0 * d.rep * d.D, (g0 + gpr) * d.rep * d.D)
        hk = slice(g0 * d.D, (g0 + gpr) * d.D)
        self.n_q, self.n_kv = gpr * d.rep, gpr
        self.q = _lin(_hf(sd, i, "self_attn.q_proj.weight")[hq], _hf(sd, i, "self_attn.q_proj.bias")[hq])
        self.k = _lin(_hf(sd, i, "self_attn.k_proj.weight")[hk], _hf(sd, i, "self_attn.k_proj.bias")[hk])
        self.v = _lin(_hf(sd, i, "self_attn.v_proj.weight")[hk], _hf(sd, i, "self_attn.v_proj.bias")[hk])
        self.o_row = nn.Parameter(_hf(sd, i, "self_attn.o_proj.weight")[:, hq].clone())
        ipr = d.I // world
        cols = slice(rank * ipr, (rank + 1) * ipr)
        gate, up = _hf(sd, i, "mlp.gate_up_proj.weight").split([d.I, d.I], 0)
        self.gate_col = nn.Parameter(gate[cols].clone())
        self.up_col = nn.Parameter(up[cols].clone())
        self.down_row = nn.Parameter(_hf(sd, i, "mlp.down_proj.weight")[:, cols].clone())

    def attn_partial(self, x, rot, allowed):
        d = self.d
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.n_q, d.D)
        k = self.k(x).view(B, S, self.n_kv, d.D)
        v = self.v(x).view(B, S, self.n_kv, d.D)
        R = d.R
        q = torch.cat((torch.einsum("bsoi,bshi->bsho", rot, q[..., :R]), q[..., R:]), -1)
        k = torch.cat((torch.einsum("bsoi,bshi->bsho", rot, k[..., :R]), k[..., R:]), -1)
        k = k.repeat_interleave(d.rep, 2)
        v = v.repeat_interleave(d.rep, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d.D)
        s = torch.where(allowed[:, None], s, torch.tensor(-3.0e38))
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        p = e / e.sum(-1, keepdim=True)
        o = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, S, self.n_q * d.D)
        return o @ self.o_row.t()

    def mlp_partial(self, x):
        return (F.silu(x @ self.gate_col.t()) * (x @ self.up_col.t())) @ self.down_row.t()


class TPLayer(nn.Module):
    def __init__(self, d, sd, i, world):
        super().__init__()
        self.eps = d.eps
        self.attn_norm = nn.Parameter(_hf(sd, i, "input_layernorm.weight").clone())
        self.mlp_norm = nn.Parameter(_hf(sd, i, "post_attention_layernorm.weight").clone())
        self.ranks = nn.ModuleList(TPRank(d, sd, i, r, world) for r in range(world))

    def forward(self, x, rot, allowed):
        a = F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.eps)
        x = x + sum(r.attn_partial(a, rot, allowed) for r in self.ranks)  # all-reduce
        m = F.rms_norm(x, (x.shape[-1],), self.mlp_norm, self.eps)
        return x + sum(r.mlp_partial(m) for r in self.ranks)  # all-reduce


class TPGlm(nn.Module):
    def __init__(self, sd, config, world=2):
        super().__init__()
        self.d = d = Dims(config)
        if d.G % world or d.I % world or d.V % world:
            world = 1
        self.world = world
        vpr = d.V // world
        emb, head = sd["model.embed_tokens.weight"], _lm_head(sd)
        self.vocab_start = [r * vpr for r in range(world)]
        self.emb_shards = nn.ParameterList(nn.Parameter(emb[s : s + vpr].clone()) for s in self.vocab_start)
        self.head_shards = nn.ParameterList(nn.Parameter(head[s : s + vpr].clone()) for s in self.vocab_start)
        self.vpr = vpr
        self.layers = nn.ModuleList(TPLayer(d, sd, i, world) for i in range(d.L))
        self.final_norm = nn.Parameter(sd["model.norm.weight"].clone())
        self.register_buffer(
            "inv_freq", d.theta ** (-torch.arange(0, d.R, 2, dtype=torch.float32) / d.R), persistent=False
        )

    def _rotation(self, pos):
        """(B, S, R, R) block-diagonal 2x2 rotations acting on interleaved pairs."""
        R = self.d.R
        ang = pos[..., None].float() * self.inv_freq
        c, s = ang.cos(), ang.sin()
        M = torch.zeros(*pos.shape, R, R)
        ev = torch.arange(0, R, 2)
        M[..., ev, ev] = c
        M[..., ev, ev + 1] = -s
        M[..., ev + 1, ev] = s
        M[..., ev + 1, ev + 1] = c
        return M

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        B, S = input_ids.shape
        x = 0
        for s0, shard in zip(self.vocab_start, self.emb_shards):
            local = input_ids - s0
            inside = (local >= 0) & (local < self.vpr)
            x = x + shard[local.clamp(0, self.vpr - 1)] * inside[..., None]
        rot = self._rotation(pos)
        i = torch.arange(S)
        allowed = (i[:, None] >= i[None, :])[None] & mask.bool()[:, None, :]
        for layer in self.layers:
            x = layer(x, rot, allowed)
        x = F.rms_norm(x, (x.shape[-1],), self.final_norm, self.d.eps)
        return torch.cat([x @ w.t() for w in self.head_shards], -1)  # all-gather


# ----------------------------------------------------------------------------------------------------------
# notebook_perhead
# ----------------------------------------------------------------------------------------------------------
class NBLayer(nn.Module):
    def __init__(self, d, sd, i):
        super().__init__()
        self.d = d
        D = d.D
        wq, bq = _hf(sd, i, "self_attn.q_proj.weight"), _hf(sd, i, "self_attn.q_proj.bias")
        wk, bk = _hf(sd, i, "self_attn.k_proj.weight"), _hf(sd, i, "self_attn.k_proj.bias")
        wv, bv = _hf(sd, i, "self_attn.v_proj.weight"), _hf(sd, i, "self_attn.v_proj.bias")
        self.heads_q = nn.ModuleList(_lin(wq[h * D : (h + 1) * D], bq[h * D : (h + 1) * D]) for h in range(d.H))
        self.heads_k = nn.ModuleList(_lin(wk[g * D : (g + 1) * D], bk[g * D : (g + 1) * D]) for g in range(d.G))
        self.heads_v = nn.ModuleList(_lin(wv[g * D : (g + 1) * D], bv[g * D : (g + 1) * D]) for g in range(d.G))
        self.out = _lin(_hf(sd, i, "self_attn.o_proj.weight"))
        self.norm1 = nn.Parameter(_hf(sd, i, "input_layernorm.weight").clone())
        self.norm2 = nn.Parameter(_hf(sd, i, "post_attention_layernorm.weight").clone())
        gate, up = _hf(sd, i, "mlp.gate_up_proj.weight").split([d.I, d.I], 0)
        self.fc_gate, self.fc_up = _lin(gate), _lin(up)
        self.fc_out = _lin(_hf(sd, i, "mlp.down_proj.weight"))

    def norm(self, x, w):
        return w * x / torch.sqrt((x**2).sum(-1, keepdim=True) / x.shape[-1] + self.d.eps)

    def rope(self, x, sin, cos):
        R = self.d.R
        out = x.clone()
        ev, od = x[..., 0:R:2], x[..., 1:R:2]
        out[..., 0:R:2] = ev * cos - od * sin
        out[..., 1:R:2] = od * cos + ev * sin
        return out

    def forward(self, x, sin, cos, neg):
        d = self.d
        a = self.norm(x, self.norm1)
        keys = [self.rope(self.heads_k[g](a), sin, cos) for g in range(d.G)]
        vals = [self.heads_v[g](a) for g in range(d.G)]
        outs = []
        for h in range(d.H):
            q = self.rope(self.heads_q[h](a), sin, cos)
            g = h // d.rep
            s = q @ keys[g].transpose(-1, -2) / math.sqrt(d.D) + neg
            p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
            outs.append(p @ vals[g])
        x = x + self.out(torch.cat(outs, -1))
        m = self.norm(x, self.norm2)
        g = self.fc_gate(m)
        return x + self.fc_out(g * torch.sigmoid(g) * self.fc_up(m))


class NotebookGlm(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = d = Dims(config)
        self.wte = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].clone(), freeze=False)
        self.layers = nn.ModuleList(NBLayer(d, sd, i) for i in range(d.L))
        self.norm_f = nn.Parameter(sd["model.norm.weight"].clone())
        self.lm_head = _lin(_lm_head(sd))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        d = self.d
        mask, pos = _defaults(input_ids, attention_mask, position_ids)
        B, S = input_ids.shape
        timescale = d.theta ** (torch.arange(d.R // 2, dtype=torch.float32) * 2 / d.R)
        sinusoid = pos.float()[..., None] / timescale
        sin, cos = torch.sin(sinusoid), torch.cos(sinusoid)  # (B, S, R/2)
        qi = torch.arange(S).view(S, 1)
        ki = torch.arange(S).view(1, S)
        keep = (ki <= qi).unsqueeze(0) & (mask.unsqueeze(1) == 1)
        neg = (~keep).float() * -1e9
        x = self.wte(input_ids)
        for layer in self.layers:
            x = layer(x, sin, cos, neg)
        x = self.norm_f * x / torch.sqrt((x**2).sum(-1, keepdim=True) / d.C + d.eps)
        return self.lm_head(x)


# ----------------------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------------------
_LAYOUTS = {
    "": GlmPort,
    "vllm_fused": VllmGlm,
    "meta_complex_folded": MetaGlm,
    "flax_neox": FlaxGlm,
    "gguf_functional": GgufGlm,
    "stacked_scan": StackedGlm,
    "megatron_seqfirst": MegatronGlm,
    "tp2_sharded": TPGlm,
    "notebook_perhead": NotebookGlm,
}


def build(state_dict, config) -> nn.Module:
    layout = BUG
    if layout not in _LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    with torch.no_grad():
        model = _LAYOUTS[layout](sd, config)
    model.layout = layout
    return model.float().eval()
