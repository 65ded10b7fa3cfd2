"""Hand-written plain-PyTorch port of Gemma 3 text (Gemma3ForCausalLM) in several weight / compute layouts.

Architecture as this port implements it:
- token embedding multiplied by sqrt(hidden_size); head tied to the (unscaled) embedding; final RMSNorm; logits
  soft-capped: cap * tanh(logits / cap) with cap = config.final_logit_softcapping (when set).
- Gemma RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w) in float32 (the checkpoint stores w, zero-centred).
- block (sandwich norms):  h = h + RMS_post_attn(Attn(RMS_in(h)));  h = h + RMS_post_ffw(MLP(RMS_pre_ffw(h))).
- Attn: q = W_q x, k = W_k x, v = W_v x (n_heads / n_kv_heads, head_dim from the config, GQA); per-head Gemma
  RMSNorm on q and k (q_norm / k_norm); RoPE (half-split pairing) whose theta depends on the layer type (local
  "sliding_attention": config.rope_parameters["sliding_attention"], global "full_attention": its own theta and
  linear scaling factor: inv_freq / factor); scores = q k^T * query_pre_attn_scalar^-0.5 (no attention-logit
  soft-cap in Gemma 3: Transformers ignores config.attn_logit_softcapping), causal, and on local layers only keys
  with q_index - k_index < config.sliding_window; out = W_o o.
- MLP (GeGLU): W_down (gelu_tanh(W_gate x) * W_up x).
- attention_mask (batch, seq) 1/0 masks padded keys; position_ids default to 0..T-1.

Weight / compute layout per variant (BUG selects one; all of them are correct):
- "" (baseline): google/gemma_pytorch module tree and names (embedder, model.layers[i].{self_attn.{qkv_proj,
  query_norm, key_norm, o_proj}, mlp.{gate_proj, up_proj, down_proj}, input_layernorm, post_attention_layernorm,
  pre_feedforward_layernorm, post_feedforward_layernorm}, model.norm); q/k/v fused in `qkv_proj` [q | k | v];
  RoPE as a complex multiplication of the (x[i], x[i + d/2]) pairs with per-layer-type complex `freqs_cis`
  buffers (local / global) precomputed for max_position_embeddings; query multiplied by the scaling before the
  matmul; the embedding normalizer sqrt(H) applied at run time; the head reuses `embedder.weight`; additive mask
  with -2.3819763e38.
- gemma3_gguf_plus_one: llama.cpp / GGUF names (token_embd, blk[i]{attn_norm, attn_q, attn_k, attn_v,
  attn_q_norm, attn_k_norm, attn_output, post_attention_norm, ffn_norm, ffn_gate, ffn_up, ffn_down,
  post_ffw_norm}, output_norm) in ModuleDicts; every RMSNorm gain stored as 1 + w (convert_hf_to_gguf adds the
  one) and applied as a plain multiply; NEOX-mode RoPE with on-the-fly angles; -inf mask with each query's
  own position always kept (no NaN on padded rows).
- gemma3_embed_folded: embedding table pre-multiplied by sqrt(H); a separate head module holding the unscaled
  table with the final norm's (1 + w) folded in (and applying the logit soft-cap); the pre-norm gains
  (input_layernorm, pre_feedforward_layernorm) folded as (1 + w) into the columns of q/k/v and gate/up; the
  backbone returns the last hidden states before the final norm's gain.
- gemma3_jax_einsum: google-deepmind/gemma (JAX/Flax) parameter layout: q_einsum (N, D, H),
  kv_einsum (2, K, D, H), attn_vec_einsum (N, H, D), gating_einsum (2, F, D) [gate; up], linear (F, D), all
  applied by einsum; RMSNorm `scale` params (zero-centred, 1 + scale); RoPE with the linear factor applied to the
  positions (pos / factor) and timescale = theta^(2i/d); queries scaled after RoPE; GQA by a (B, T, K, G, H) view.
- gemma3_stacked_local_global: every layer's weights stacked per kind (n_layers, out, in) in a ParameterDict;
  the four sandwich norm gains of a layer in one (n_layers, 4, H) tensor [in, post_attn, pre_ffw, post_ffw];
  cos/sin tables (max_pos, head_dim / 2) precomputed per layer type in a buffer of shape (2, 2, max_pos, d/2)
  [local / global][cos / sin]; layer types from a boolean `is_global` buffer.
- gemma3_meta_complex_rope: q/k rows permuted to Meta's interleaved order, q_norm / k_norm gains permuted the
  same way, RoPE as a complex multiplication of adjacent pairs (view_as_complex), separate wq / wk / wv.
- gemma3_transposed_interleaved: every matrix stored (in, out) as raw Parameters and applied as x @ W; gate and
  up fused and column-interleaved [g0, u0, g1, u1, ...] split by [..., 0::2] / [..., 1::2]; GQA by
  repeat_interleave; boolean masks with torch.where.
- gemma3_functional_scaled_qnorm: one functional forward over a flat ParameterDict; every norm gain stored as
  1 + w; the attention scaling query_pre_attn_scalar^-0.5 folded into the q_norm gain ((1 + w) * scaling), so
  the score is a bare q . k; positions computed from the attention mask (cumsum) when position_ids is None;
  attention by blockwise online softmax over key blocks of 8.
- gemma3_chunked_queries_moduledict: ModuleDict containers throughout (blocks keyed "layer{i}", projections
  keyed q/k/v/o, the four sandwich norms keyed attn_in / attn_out / ffn_in / ffn_out); attention computed for
  query chunks of 8 at a time; the sliding window tested on position_ids differences (same as indices on real
  tokens); embedding scale as a 0-d buffer; the RoPE inv_freq of each layer type kept as a frozen
  (requires_grad=False) nn.Parameter in a ParameterDict.
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
    "gemma3_gguf_plus_one",  # llama.cpp names, norm gains stored as 1 + w, NEOX RoPE on the fly
    "gemma3_embed_folded",  # sqrt(H) folded into the table, pre-norm gains folded into q/k/v and gate/up, head module
    "gemma3_jax_einsum",  # google-deepmind/gemma JAX einsum layouts (q_einsum, kv_einsum, gating_einsum, ...)
    "gemma3_stacked_local_global",  # (n_layers, ...) stacked weights, (L, 4, H) sandwich gains, rope table buffer
    "gemma3_meta_complex_rope",  # Meta row order for q/k (+ q/k-norm gains permuted), adjacent-pair complex RoPE
    "gemma3_transposed_interleaved",  # (in, out) matrices as x @ W, gate/up fused column-interleaved
    "gemma3_functional_scaled_qnorm",  # functional dict forward, (1 + w) gains, scaling folded into q_norm, online softmax
    "gemma3_chunked_queries_moduledict",  # query chunks of 8, ModuleDict tree, window from positions, inv_freq as frozen Parameters
]


# ----------------------------------------------------------------------------------------------- shared helpers

K_MASK = -2.3819763e38


def _dims(config):
    nh = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or config.hidden_size // nh
    return nh, nkv, hd


def _layer_types(config):
    return list(config.layer_types)


def _rope_cfg(config, layer_type):
    """(theta, linear factor) of a layer type."""
    rp = (getattr(config, "rope_parameters", None) or {}).get(layer_type) or {}
    theta = rp.get("rope_theta", 10000.0 if layer_type == "sliding_attention" else 1000000.0)
    factor = rp.get("factor", 1.0) if rp.get("rope_type", "default") == "linear" else 1.0
    return theta, factor


def _inv_freq(config, layer_type, hd):
    theta, factor = _rope_cfg(config, layer_type)
    return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)) / factor


def _attn_cap(config):
    """Gemma 3 has no attention-logit soft-capping (Gemma 2 had; Gemma 3 uses q/k norms instead): Transformers'
    Gemma3Attention never hands config.attn_logit_softcapping to the attention, so neither does this port.  The
    soft-cap code paths below (shared with Gemma 2-style code) therefore always see None."""
    return None


def _window(config, layer_type):
    return config.sliding_window if layer_type == "sliding_attention" else None


def _rms(x, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _softcap(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def _positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)


def _allowed(attention_mask, b, t, window, device):
    i = torch.arange(t, device=device)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok = ok & (i[:, None] - i[None, :] < window)
    ok = ok[None, None].expand(b, 1, t, t)
    if attention_mask is not None:
        ok = ok & attention_mask.bool()[:, None, None, :]
    return ok


def _rope_halves(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _to_meta_rows(w, n_heads, hd):
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, hd // 2, *rest).transpose(1, 2).reshape(n_heads * hd, *rest).contiguous()


def _to_meta_gain(g):
    hd = g.shape[0]
    return g.reshape(2, hd // 2).t().reshape(hd).contiguous()


def _head_weight(sd, config):
    if getattr(config, "tie_word_embeddings", True) or "lm_head.weight" not in sd:
        return sd["model.embed_tokens.weight"]
    return sd["lm_head.weight"]


def _linear(w, b=None):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous())


class GemmaRMSNorm(nn.Module):
    """Stores the zero-centred w, applies (1 + w) (gemma_pytorch's add_unit_offset=True)."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = _p(weight)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.eps) * (1 + self.weight)


class ScaleNorm(nn.Module):
    """Stores the effective gain (already 1 + w, or folded), applies a plain multiply."""

    def __init__(self, gain, eps):
        super().__init__()
        self.weight = _p(gain)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.eps) * self.weight


# --------------------------------------------------------------------------------- gemma_pytorch (baseline)


def _apply_rotary_emb_halves(x, freqs_cis):
    """gemma_pytorch: complex numbers from the (x[i], x[i + d/2]) pairs.  x (b, h, t, d), freqs_cis (b, 1, t, d/2)."""
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis)
    return torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2).reshape(x.shape)


class GemmaAttention(nn.Module):
    def __init__(self, sd, pre, config, layer_type):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd = _dims(config)
        self.q_size, self.kv_size = nh * hd, nkv * hd
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.attn_logit_softcapping = _attn_cap(config)
        self.attn_type = layer_type
        self.qkv_proj = _linear(torch.cat([sd[f"{pre}{n}_proj.weight"] for n in "qkv"]))
        self.o_proj = _linear(sd[pre + "o_proj.weight"])
        self.query_norm = GemmaRMSNorm(sd[pre + "q_norm.weight"], config.rms_norm_eps)
        self.key_norm = GemmaRMSNorm(sd[pre + "k_norm.weight"], config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, mask):
        b, t, _ = hidden_states.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        xq, xk, xv = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = self.query_norm(xq.view(b, t, nh, hd)).transpose(1, 2)
        xk = self.key_norm(xk.view(b, t, nkv, hd)).transpose(1, 2)
        xv = xv.view(b, t, nkv, hd).transpose(1, 2)
        xq = _apply_rotary_emb_halves(xq, freqs_cis)
        xk = _apply_rotary_emb_halves(xk, freqs_cis)
        key = torch.repeat_interleave(xk, nh // nkv, dim=1)
        value = torch.repeat_interleave(xv, nh // nkv, dim=1)
        q = xq * self.scaling
        scores = torch.matmul(q, key.transpose(2, 3))
        if self.attn_logit_softcapping is not None:
            scores = scores / self.attn_logit_softcapping
            scores = torch.tanh(scores)
            scores = scores * self.attn_logit_softcapping
        scores = F.softmax((scores + mask).float(), dim=-1)
        output = torch.matmul(scores, value).transpose(1, 2).reshape(b, t, nh * hd)
        return self.o_proj(output)


class GemmaMLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.gate_proj = _linear(sd[pre + "gate_proj.weight"])
        self.up_proj = _linear(sd[pre + "up_proj.weight"])
        self.down_proj = _linear(sd[pre + "down_proj.weight"])

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, sd, i, config, layer_type):
        super().__init__()
        pre = f"model.layers.{i}."
        eps = config.rms_norm_eps
        self.attn_type = layer_type
        self.self_attn = GemmaAttention(sd, pre + "self_attn.", config, layer_type)
        self.mlp = GemmaMLP(sd, pre + "mlp.")
        self.input_layernorm = GemmaRMSNorm(sd[pre + "input_layernorm.weight"], eps)
        self.post_attention_layernorm = GemmaRMSNorm(sd[pre + "post_attention_layernorm.weight"], eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(sd[pre + "pre_feedforward_layernorm.weight"], eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(sd[pre + "post_feedforward_layernorm.weight"], eps)

    def forward(self, hidden_states, freqs_cis, mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, freqs_cis, mask)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + hidden_states


class GemmaModel(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.layers = nn.ModuleList(Gemma2DecoderLayer(sd, i, config, ty) for i, ty in enumerate(_layer_types(config)))
        self.norm = GemmaRMSNorm(sd["model.norm.weight"], config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, masks):
        for layer in self.layers:
            hidden_states = layer(hidden_states, freqs_cis[layer.attn_type], masks[layer.attn_type])
        return self.norm(hidden_states)


class GemmaForCausalLM(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.config = config
        self.embedder = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.model = GemmaModel(sd, config)
        n = config.max_position_embeddings
        for ty, name in (("sliding_attention", "local_freqs_cis"), ("full_attention", "global_freqs_cis")):
            freqs = torch.outer(torch.arange(n).float(), _inv_freq(config, ty, hd))
            self.register_buffer(name, torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        self.separate_head = not getattr(config, "tie_word_embeddings", True)
        if self.separate_head:
            self.lm_head = _linear(_head_weight(sd, config))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = _positions(input_ids, position_ids)
        freqs_cis = {
            "sliding_attention": self.local_freqs_cis[pos][:, None],
            "full_attention": self.global_freqs_cis[pos][:, None],
        }
        masks = {}
        for ty in ("sliding_attention", "full_attention"):
            ok = _allowed(attention_mask, b, t, _window(self.config, ty), input_ids.device)
            masks[ty] = torch.zeros(ok.shape, device=input_ids.device).masked_fill(~ok, K_MASK)
        hidden_states = self.embedder(input_ids)
        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer
        hidden_states = self.model(hidden_states, freqs_cis, masks)
        head = self.lm_head.weight if self.separate_head else self.embedder.weight
        logits = torch.matmul(hidden_states, head.t())
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# ------------------------------------------------------------------------------------- llama.cpp GGUF (+1)


class GGUFGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.eps = eps = config.rms_norm_eps
        self.n_embd = config.hidden_size
        self.f_attn_scale = config.query_pre_attn_scalar**-0.5
        self.attn_soft_cap = _attn_cap(config)
        self.final_soft_cap = config.final_logit_softcapping
        self.types = _layer_types(config)
        self.windows = [_window(config, ty) for ty in self.types]
        self.token_embd = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.blk = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            pre = f"model.layers.{i}."
            d = nn.ModuleDict()
            d["attn_norm"] = ScaleNorm(1 + sd[pre + "input_layernorm.weight"], eps)
            for ours, hf in (
                ("attn_q", "q_proj"),
                ("attn_k", "k_proj"),
                ("attn_v", "v_proj"),
                ("attn_output", "o_proj"),
            ):
                d[ours] = _linear(sd[f"{pre}self_attn.{hf}.weight"])
            d["attn_q_norm"] = ScaleNorm(1 + sd[pre + "self_attn.q_norm.weight"], eps)
            d["attn_k_norm"] = ScaleNorm(1 + sd[pre + "self_attn.k_norm.weight"], eps)
            d["post_attention_norm"] = ScaleNorm(1 + sd[pre + "post_attention_layernorm.weight"], eps)
            d["ffn_norm"] = ScaleNorm(1 + sd[pre + "pre_feedforward_layernorm.weight"], eps)
            for ours, hf in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                d[ours] = _linear(sd[f"{pre}mlp.{hf}.weight"])
            d["post_ffw_norm"] = ScaleNorm(1 + sd[pre + "post_feedforward_layernorm.weight"], eps)
            self.blk.append(d)
        self.output_norm = ScaleNorm(1 + sd["model.norm.weight"], eps)
        self.output = _linear(_head_weight(sd, config))
        self.register_buffer("freq_local", _inv_freq(config, "sliding_attention", hd), persistent=False)
        self.register_buffer("freq_global", _inv_freq(config, "full_attention", hd), persistent=False)

    def rope_neox(self, x, pos, freqs):
        theta = pos[..., None].float() * freqs
        return _rope_halves(x, theta.cos()[:, :, None], theta.sin()[:, :, None])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        pos = _positions(input_ids, position_ids)
        cur = self.token_embd(input_ids) * math.sqrt(self.n_embd)
        for d, ty, win in zip(self.blk, self.types, self.windows):
            freqs = self.freq_local if ty == "sliding_attention" else self.freq_global
            x = d["attn_norm"](cur)
            q = self.rope_neox(d["attn_q_norm"](d["attn_q"](x).view(b, t, nh, hd)), pos, freqs)
            k = self.rope_neox(d["attn_k_norm"](d["attn_k"](x).view(b, t, nkv, hd)), pos, freqs)
            v = d["attn_v"](x).view(b, t, nkv, hd)
            q = q.transpose(1, 2) * self.f_attn_scale
            k = k.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
            v = v.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
            kq = _softcap(q @ k.transpose(-1, -2), self.attn_soft_cap)
            kq_mask = _allowed(attention_mask, b, t, win, cur.device) | torch.eye(
                t, dtype=torch.bool, device=cur.device
            )
            kq = torch.softmax(kq.masked_fill(~kq_mask, float("-inf")), dim=-1)  # padded rows keep their diagonal
            attn = d["attn_output"]((kq @ v).transpose(1, 2).reshape(b, t, nh * hd))
            cur = cur + d["post_attention_norm"](attn)
            x = d["ffn_norm"](cur)
            ffn = d["ffn_down"](F.gelu(d["ffn_gate"](x), approximate="tanh") * d["ffn_up"](x))
            cur = cur + d["post_ffw_norm"](ffn)
        return _softcap(self.output(self.output_norm(cur)), self.final_soft_cap)


# -------------------------------------------------------------------------------------------- embed folded


class FoldedBlock(nn.Module):
    def __init__(self, sd, i, config, layer_type):
        super().__init__()
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        self.nh, self.nkv, self.hd = _dims(config)
        self.eps = eps = config.rms_norm_eps
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.cap = _attn_cap(config)
        self.window = _window(config, layer_type)
        self.layer_type = layer_type
        g_in = 1 + sd[pre + "input_layernorm.weight"]
        g_pre = 1 + sd[pre + "pre_feedforward_layernorm.weight"]
        self.q = _linear(sd[a + "q_proj.weight"] * g_in[None, :])
        self.k = _linear(sd[a + "k_proj.weight"] * g_in[None, :])
        self.v = _linear(sd[a + "v_proj.weight"] * g_in[None, :])
        self.o = _linear(sd[a + "o_proj.weight"])
        self.q_norm = GemmaRMSNorm(sd[a + "q_norm.weight"], eps)
        self.k_norm = GemmaRMSNorm(sd[a + "k_norm.weight"], eps)
        self.attn_out_norm = GemmaRMSNorm(sd[pre + "post_attention_layernorm.weight"], eps)
        self.gate = _linear(sd[pre + "mlp.gate_proj.weight"] * g_pre[None, :])
        self.up = _linear(sd[pre + "mlp.up_proj.weight"] * g_pre[None, :])
        self.down = _linear(sd[pre + "mlp.down_proj.weight"])
        self.mlp_out_norm = GemmaRMSNorm(sd[pre + "post_feedforward_layernorm.weight"], eps)

    def forward(self, h, cos, sin, attention_mask):
        b, t, _ = h.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = _rms(h, self.eps)  # gain folded into q/k/v
        q = _rope_halves(self.q_norm(self.q(x).view(b, t, nh, hd)), cos, sin).transpose(1, 2)
        k = _rope_halves(self.k_norm(self.k(x).view(b, t, nkv, hd)), cos, sin).transpose(1, 2)
        v = self.v(x).view(b, t, nkv, hd).transpose(1, 2)
        k = k[:, :, None].expand(b, nkv, nh // nkv, t, hd).reshape(b, nh, t, hd)
        v = v[:, :, None].expand(b, nkv, nh // nkv, t, hd).reshape(b, nh, t, hd)
        s = _softcap(q @ k.transpose(-1, -2) * self.scaling, self.cap)
        s = s.masked_fill(~_allowed(attention_mask, b, t, self.window, h.device), torch.finfo(s.dtype).min)
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
        h = h + self.attn_out_norm(self.o(o))
        x = _rms(h, self.eps)  # gain folded into gate/up
        return h + self.mlp_out_norm(self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x)))


class FoldedBackbone(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.eps = config.rms_norm_eps
        scaled = sd["model.embed_tokens.weight"] * torch.tensor(config.hidden_size**0.5)
        self.embed_scaled = nn.Embedding.from_pretrained(scaled.float().clone(), freeze=False)
        self.blocks = nn.ModuleList(FoldedBlock(sd, i, config, ty) for i, ty in enumerate(_layer_types(config)))
        for ty, name in (("sliding_attention", "inv_freq_local"), ("full_attention", "inv_freq_global")):
            self.register_buffer(name, _inv_freq(config, ty, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids).float()
        rope = {}
        for ty, inv in (("sliding_attention", self.inv_freq_local), ("full_attention", self.inv_freq_global)):
            ang = pos[..., None] * inv
            rope[ty] = (ang.cos()[:, :, None], ang.sin()[:, :, None])
        h = self.embed_scaled(input_ids)
        for blk in self.blocks:
            h = blk(h, *rope[blk.layer_type], attention_mask)
        return _rms(h, self.eps)  # final gain folded into the head


class SoftcappedHead(nn.Module):
    def __init__(self, weight, cap):
        super().__init__()
        self.weight = _p(weight)
        self.cap = cap

    def forward(self, h):
        return _softcap(F.linear(h, self.weight), self.cap)


class FoldedGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.backbone = FoldedBackbone(sd, config)
        g_final = 1 + sd["model.norm.weight"]
        self.head = SoftcappedHead(_head_weight(sd, config) * g_final[None, :], config.final_logit_softcapping)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.backbone(input_ids, attention_mask, position_ids))


# -------------------------------------------------------------------------------------------- JAX einsums


class JaxRMSNorm(nn.Module):
    def __init__(self, scale, eps):
        super().__init__()
        self.scale = _p(scale)
        self.eps = eps

    def forward(self, x):
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        return normed * (1 + self.scale)


def _jax_rope(inputs, positions, base_frequency, scale_factor):
    """gemma JAX apply_rope: inputs (B, T, N, H), positions (B, T)."""
    head_dim = inputs.shape[-1]
    fraction = 2 * torch.arange(0, head_dim // 2).float() / head_dim
    timescale = base_frequency**fraction
    sinusoid_inp = positions[..., None].float() / timescale[None, None, :]
    sinusoid_inp = sinusoid_inp[..., None, :]
    sinusoid_inp = sinusoid_inp / scale_factor
    sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
    first_half, second_half = torch.split(inputs, head_dim // 2, dim=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return torch.cat([first_part, second_part], dim=-1)


class JaxAttention(nn.Module):
    def __init__(self, sd, pre, config, layer_type):
        super().__init__()
        nh, nkv, hd = _dims(config)
        D = config.hidden_size
        self.query_pre_attn_norm = config.query_pre_attn_scalar**-0.5
        self.attn_logits_soft_cap = _attn_cap(config)
        self.window = _window(config, layer_type)
        self.base_frequency, self.scale_factor = _rope_cfg(config, layer_type)
        self.q_einsum = _p(sd[pre + "q_proj.weight"].reshape(nh, hd, D).transpose(1, 2))  # (N, D, H)
        k = sd[pre + "k_proj.weight"].reshape(nkv, hd, D).transpose(1, 2)
        v = sd[pre + "v_proj.weight"].reshape(nkv, hd, D).transpose(1, 2)
        self.kv_einsum = _p(torch.stack([k, v]))  # (2, K, D, H)
        self.attn_vec_einsum = _p(sd[pre + "o_proj.weight"].t().reshape(nh, hd, D))  # (N, H, D)
        self._query_norm = JaxRMSNorm(sd[pre + "q_norm.weight"], config.rms_norm_eps)
        self._key_norm = JaxRMSNorm(sd[pre + "k_norm.weight"], config.rms_norm_eps)

    def forward(self, x, segment_pos, attention_mask):
        B, T, _ = x.shape
        query_proj = torch.einsum("BTD,NDH->BTNH", x, self.q_einsum)
        key_proj, value_proj = torch.einsum("BSD,CKDH->CBSKH", x, self.kv_einsum).unbind(0)
        query_proj = self._query_norm(query_proj)
        key_proj = self._key_norm(key_proj)
        query_proj = _jax_rope(query_proj, segment_pos, self.base_frequency, self.scale_factor)
        query_scaled = query_proj * self.query_pre_attn_norm
        key_proj = _jax_rope(key_proj, segment_pos, self.base_frequency, self.scale_factor)
        N, K, H = query_scaled.shape[2], key_proj.shape[2], query_scaled.shape[3]
        query_scaled = query_scaled.reshape(B, T, K, N // K, H)
        logits = torch.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj).reshape(B, T, N, T)
        if self.attn_logits_soft_cap is not None:
            logits = torch.tanh(logits / self.attn_logits_soft_cap) * self.attn_logits_soft_cap
        mask = _allowed(attention_mask, B, T, self.window, x.device)[:, 0]  # (B, T, S)
        padded_logits = torch.where(mask[:, :, None, :], logits, torch.tensor(K_MASK))
        probs = torch.softmax(padded_logits, dim=-1).reshape(B, T, K, N // K, T)
        encoded = torch.einsum("BTKGS,BSKH->BTKGH", probs, value_proj).reshape(B, T, N, H)
        return torch.einsum("BTNH,NHD->BTD", encoded, self.attn_vec_einsum)


class JaxFeedForward(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.gating_einsum = _p(torch.stack([sd[pre + "gate_proj.weight"], sd[pre + "up_proj.weight"]]))  # (2, F, D)
        self.linear = _p(sd[pre + "down_proj.weight"].t())  # (F, D)

    def forward(self, x):
        gate = torch.einsum("...D,NFD->...NF", x, self.gating_einsum)
        activations = F.gelu(gate[..., 0, :], approximate="tanh") * gate[..., 1, :]
        return torch.einsum("...F,FD->...D", activations, self.linear)


class JaxBlock(nn.Module):
    def __init__(self, sd, i, config, layer_type):
        super().__init__()
        pre = f"model.layers.{i}."
        eps = config.rms_norm_eps
        self.pre_attention_norm = JaxRMSNorm(sd[pre + "input_layernorm.weight"], eps)
        self.attn = JaxAttention(sd, pre + "self_attn.", config, layer_type)
        self.post_attention_norm = JaxRMSNorm(sd[pre + "post_attention_layernorm.weight"], eps)
        self.pre_ffw_norm = JaxRMSNorm(sd[pre + "pre_feedforward_layernorm.weight"], eps)
        self.mlp = JaxFeedForward(sd, pre + "mlp.")
        self.post_ffw_norm = JaxRMSNorm(sd[pre + "post_feedforward_layernorm.weight"], eps)

    def forward(self, x, segment_pos, attention_mask):
        inputs_normalized = self.pre_attention_norm(x)
        attn_output = self.post_attention_norm(self.attn(inputs_normalized, segment_pos, attention_mask))
        attn_output = attn_output + x
        outputs = self.post_ffw_norm(self.mlp(self.pre_ffw_norm(attn_output)))
        return outputs + attn_output


class JaxGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.final_logit_softcap = config.final_logit_softcapping
        self.input_embedding_table = _p(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(JaxBlock(sd, i, config, ty) for i, ty in enumerate(_layer_types(config)))
        self.final_norm = JaxRMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.tied = getattr(config, "tie_word_embeddings", True)
        if not self.tied:
            self.output_table = _p(_head_weight(sd, config))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        x = self.input_embedding_table[input_ids] * math.sqrt(self.embed_dim)
        segment_pos = _positions(input_ids, position_ids)
        for layer in self.layers:
            x = layer(x, segment_pos, attention_mask)
        x = self.final_norm(x)
        logits = x @ (self.input_embedding_table if self.tied else self.output_table).T
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits


# ----------------------------------------------------------------------------------- stacked, local / global


class StackedGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.L = L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.attn_cap, self.final_cap = _attn_cap(config), config.final_logit_softcapping
        self.embed_scale = config.hidden_size**0.5
        types = _layer_types(config)
        self.window = config.sliding_window

        def st(name):
            return torch.stack([sd[f"model.layers.{i}.{name}"] for i in range(L)])

        self.w = nn.ParameterDict()
        self.w["wq"], self.w["wk"], self.w["wv"] = (_p(st(f"self_attn.{n}_proj.weight")) for n in "qkv")
        self.w["wo"] = _p(st("self_attn.o_proj.weight"))
        self.w["q_norm"] = _p(st("self_attn.q_norm.weight"))
        self.w["k_norm"] = _p(st("self_attn.k_norm.weight"))
        self.w["w_gate"], self.w["w_up"], self.w["w_down"] = (
            _p(st(f"mlp.{n}_proj.weight")) for n in ("gate", "up", "down")
        )
        self.w["norms"] = _p(
            torch.stack(
                [
                    st("input_layernorm.weight"),
                    st("post_attention_layernorm.weight"),
                    st("pre_feedforward_layernorm.weight"),
                    st("post_feedforward_layernorm.weight"),
                ],
                dim=1,
            )
        )  # (L, 4, H)
        self.embedding = _p(sd["model.embed_tokens.weight"])
        self.final_norm = _p(sd["model.norm.weight"])
        self.unembedding = _p(_head_weight(sd, config))
        self.register_buffer("is_global", torch.tensor([ty == "full_attention" for ty in types]), persistent=False)
        n = config.max_position_embeddings
        tables = []
        for ty in ("sliding_attention", "full_attention"):
            ang = torch.outer(torch.arange(n).float(), _inv_freq(config, ty, hd))
            tables.append(torch.stack([ang.cos(), ang.sin()]))
        self.register_buffer("rope_table", torch.stack(tables), persistent=False)  # (2, 2, max_pos, d/2)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        pos = _positions(input_ids, position_ids)
        masks = [
            _allowed(attention_mask, b, t, self.window, input_ids.device),
            _allowed(attention_mask, b, t, None, input_ids.device),
        ]
        W = self.w
        h = self.embedding[input_ids] * self.embed_scale
        for i in range(self.L):
            g = int(self.is_global[i])
            cos, sin = self.rope_table[g, 0][pos][:, :, None], self.rope_table[g, 1][pos][:, :, None]
            gains = 1 + W["norms"][i]
            x = _rms(h, self.eps) * gains[0]
            q = F.linear(x, W["wq"][i]).view(b, t, nh, hd)
            k = F.linear(x, W["wk"][i]).view(b, t, nkv, hd)
            v = F.linear(x, W["wv"][i]).view(b, t, nkv, hd).transpose(1, 2)
            q = _rope_halves(_rms(q, self.eps) * (1 + W["q_norm"][i]), cos, sin).transpose(1, 2)
            k = _rope_halves(_rms(k, self.eps) * (1 + W["k_norm"][i]), cos, sin).transpose(1, 2)
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            s = _softcap(torch.matmul(q, k.transpose(-1, -2)) * self.scaling, self.attn_cap)
            s = s.masked_fill(~masks[g], torch.finfo(s.dtype).min)
            o = torch.matmul(s.softmax(-1), v).transpose(1, 2).reshape(b, t, nh * hd)
            h = h + _rms(F.linear(o, W["wo"][i]), self.eps) * gains[1]
            x = _rms(h, self.eps) * gains[2]
            y = F.linear(
                F.gelu(F.linear(x, W["w_gate"][i]), approximate="tanh") * F.linear(x, W["w_up"][i]), W["w_down"][i]
            )
            h = h + _rms(y, self.eps) * gains[3]
        h = _rms(h, self.eps) * (1 + self.final_norm)
        return _softcap(F.linear(h, self.unembedding), self.final_cap)


# ------------------------------------------------------------------------------- Meta rows, complex RoPE


class MetaAttention(nn.Module):
    def __init__(self, sd, pre, config, layer_type):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.cap = _attn_cap(config)
        self.window = _window(config, layer_type)
        self.layer_type = layer_type
        self.wq = _linear(_to_meta_rows(sd[pre + "q_proj.weight"], nh, hd))
        self.wk = _linear(_to_meta_rows(sd[pre + "k_proj.weight"], nkv, hd))
        self.wv = _linear(sd[pre + "v_proj.weight"])
        self.wo = _linear(sd[pre + "o_proj.weight"])
        self.q_norm = GemmaRMSNorm(_to_meta_gain(sd[pre + "q_norm.weight"]), config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(_to_meta_gain(sd[pre + "k_norm.weight"]), config.rms_norm_eps)

    def forward(self, x, freqs_cis, attention_mask):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        xq = self.q_norm(self.wq(x).view(b, t, nh, hd))
        xk = self.k_norm(self.wk(x).view(b, t, nkv, hd))
        xv = self.wv(x).view(b, t, nkv, hd)
        xq = torch.view_as_real(torch.view_as_complex(xq.float().reshape(b, t, nh, -1, 2)) * freqs_cis).flatten(3)
        xk = torch.view_as_real(torch.view_as_complex(xk.float().reshape(b, t, nkv, -1, 2)) * freqs_cis).flatten(3)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        xk = xk.repeat_interleave(nh // nkv, dim=1)
        xv = xv.repeat_interleave(nh // nkv, dim=1)
        scores = _softcap(torch.matmul(xq, xk.transpose(2, 3)) * self.scale, self.cap)
        ok = _allowed(attention_mask, b, t, self.window, x.device)
        scores = scores + torch.zeros_like(scores[:, :1]).masked_fill(~ok, K_MASK)
        return self.wo(torch.matmul(scores.softmax(-1), xv).transpose(1, 2).reshape(b, t, nh * hd))


class MetaBlock(nn.Module):
    def __init__(self, sd, i, config, layer_type):
        super().__init__()
        pre = f"model.layers.{i}."
        eps = config.rms_norm_eps
        self.layer_type = layer_type
        self.attention_norm = GemmaRMSNorm(sd[pre + "input_layernorm.weight"], eps)
        self.attention = MetaAttention(sd, pre + "self_attn.", config, layer_type)
        self.attention_out_norm = GemmaRMSNorm(sd[pre + "post_attention_layernorm.weight"], eps)
        self.ffn_norm = GemmaRMSNorm(sd[pre + "pre_feedforward_layernorm.weight"], eps)
        self.w1 = _linear(sd[pre + "mlp.gate_proj.weight"])
        self.w3 = _linear(sd[pre + "mlp.up_proj.weight"])
        self.w2 = _linear(sd[pre + "mlp.down_proj.weight"])
        self.ffn_out_norm = GemmaRMSNorm(sd[pre + "post_feedforward_layernorm.weight"], eps)

    def forward(self, h, freqs_cis, attention_mask):
        h = h + self.attention_out_norm(self.attention(self.attention_norm(h), freqs_cis, attention_mask))
        x = self.ffn_norm(h)
        return h + self.ffn_out_norm(self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x)))


class MetaGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.embed_scale = config.hidden_size**0.5
        self.final_cap = config.final_logit_softcapping
        self.tok_embeddings = nn.Embedding.from_pretrained(
            sd["model.embed_tokens.weight"].float().clone(), freeze=False
        )
        self.layers = nn.ModuleList(MetaBlock(sd, i, config, ty) for i, ty in enumerate(_layer_types(config)))
        self.norm = GemmaRMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.output = _linear(_head_weight(sd, config))
        n = config.max_position_embeddings
        for ty, name in (("sliding_attention", "freqs_cis_local"), ("full_attention", "freqs_cis_global")):
            freqs = torch.outer(torch.arange(n).float(), _inv_freq(config, ty, hd))
            self.register_buffer(name, torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        fc = {
            "sliding_attention": self.freqs_cis_local[pos][:, :, None],
            "full_attention": self.freqs_cis_global[pos][:, :, None],
        }
        h = self.tok_embeddings(input_ids) * self.embed_scale
        for layer in self.layers:
            h = layer(h, fc[layer.layer_type], attention_mask)
        return _softcap(self.output(self.norm(h)), self.final_cap)


# ------------------------------------------------------------------------------ transposed, interleaved GeGLU


class XWGemmaLayer(nn.Module):
    def __init__(self, sd, i, config, layer_type):
        super().__init__()
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        self.nh, self.nkv, self.hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.cap = _attn_cap(config)
        self.window = _window(config, layer_type)
        self.layer_type = layer_type
        self.ln_in = _p(sd[pre + "input_layernorm.weight"])
        self.ln_post_attn = _p(sd[pre + "post_attention_layernorm.weight"])
        self.ln_pre_mlp = _p(sd[pre + "pre_feedforward_layernorm.weight"])
        self.ln_post_mlp = _p(sd[pre + "post_feedforward_layernorm.weight"])
        self.wq, self.wk, self.wv = (_p(sd[f"{a}{n}_proj.weight"].t()) for n in "qkv")
        self.wo = _p(sd[a + "o_proj.weight"].t())
        self.q_ln, self.k_ln = _p(sd[a + "q_norm.weight"]), _p(sd[a + "k_norm.weight"])
        g, u = sd[pre + "mlp.gate_proj.weight"].t(), sd[pre + "mlp.up_proj.weight"].t()  # (H, I)
        self.w_gate_up = _p(torch.stack([g, u], dim=-1).reshape(g.shape[0], -1))  # (H, 2I) interleaved columns
        self.w_down = _p(sd[pre + "mlp.down_proj.weight"].t())

    def norm(self, x, w):
        return _rms(x, self.eps) * (1.0 + w)

    def forward(self, h, cos, sin, attention_mask):
        b, t, _ = h.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = self.norm(h, self.ln_in)
        q = _rope_halves(self.norm((x @ self.wq).view(b, t, nh, hd), self.q_ln), cos, sin).transpose(1, 2)
        k = _rope_halves(self.norm((x @ self.wk).view(b, t, nkv, hd), self.k_ln), cos, sin).transpose(1, 2)
        v = (x @ self.wv).view(b, t, nkv, hd).transpose(1, 2)
        k = torch.repeat_interleave(k, nh // nkv, dim=1)
        v = torch.repeat_interleave(v, nh // nkv, dim=1)
        s = _softcap((q @ k.transpose(-1, -2)) * self.scaling, self.cap)
        s = torch.where(_allowed(attention_mask, b, t, self.window, h.device), s, torch.finfo(s.dtype).min)
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
        h = h + self.norm(o @ self.wo, self.ln_post_attn)
        gu = self.norm(h, self.ln_pre_mlp) @ self.w_gate_up
        y = (F.gelu(gu[..., 0::2], approximate="tanh") * gu[..., 1::2]) @ self.w_down
        return h + self.norm(y, self.ln_post_mlp)


class XWGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.normalizer = config.hidden_size**0.5
        self.final_cap = config.final_logit_softcapping
        self.wte = _p(sd["model.embed_tokens.weight"])
        self.h = nn.ModuleList(XWGemmaLayer(sd, i, config, ty) for i, ty in enumerate(_layer_types(config)))
        self.ln_f = _p(sd["model.norm.weight"])
        self.w_unembed = _p(_head_weight(sd, config).t())  # (H, V)
        self.inv_freq = {ty: _inv_freq(config, ty, hd) for ty in ("sliding_attention", "full_attention")}

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids).float()
        rope = {}
        for ty, inv in self.inv_freq.items():
            ang = pos[..., None] * inv.to(pos.device)
            rope[ty] = (ang.cos()[:, :, None], ang.sin()[:, :, None])
        h = self.wte[input_ids] * self.normalizer
        for layer in self.h:
            h = layer(h, *rope[layer.layer_type], attention_mask)
        logits = (_rms(h, self.eps) * (1.0 + self.ln_f)) @ self.w_unembed
        return _softcap(logits, self.final_cap)


# ------------------------------------------------------------------------- functional, scale in q_norm gain


def gemma3_forward(p, cfg, input_ids, attention_mask=None, position_ids=None):
    b, t = input_ids.shape
    nh, nkv, hd, eps, cap = cfg["nh"], cfg["nkv"], cfg["hd"], cfg["eps"], cfg["attn_cap"]
    if position_ids is None:
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        else:
            position_ids = torch.arange(t, device=input_ids.device)[None].expand(b, t)
    pos = position_ids.float()

    def norm(x, gain):
        return _rms(x, eps) * gain

    h = F.embedding(input_ids, p["embed"]) * cfg["normalizer"]
    for i, ty in enumerate(cfg["types"]):
        ang = pos[..., None] * p["inv_freq_" + ("local" if ty == "sliding_attention" else "global")]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # (b, 1, t, d/2)
        x = norm(h, p[f"l{i}_in"])
        q = norm(F.linear(x, p[f"l{i}_wq"]).view(b, t, nh, hd), p[f"l{i}_q_gain"]).transpose(1, 2)
        k = norm(F.linear(x, p[f"l{i}_wk"]).view(b, t, nkv, hd), p[f"l{i}_k_gain"]).transpose(1, 2)
        v = F.linear(x, p[f"l{i}_wv"]).view(b, t, nkv, hd).transpose(1, 2)
        q, k = _rope_halves(q, cos, sin), _rope_halves(k, cos, sin)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        allowed = _allowed(attention_mask, b, t, cfg["window"] if ty == "sliding_attention" else None, h.device)
        neg = torch.finfo(q.dtype).min
        run_max = torch.full((b, nh, t, 1), neg, device=h.device)
        run_sum = torch.zeros((b, nh, t, 1), device=h.device)
        acc = torch.zeros_like(q)
        for s0 in range(0, t, 8):
            s = q @ k[:, :, s0 : s0 + 8].transpose(-1, -2)  # scaling (and 1 / cap, if any) already in q's gain
            s = s if cap is None else torch.tanh(s) * cap
            s = s.masked_fill(~allowed[..., s0 : s0 + 8], neg)
            new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
            e = torch.exp(s - new_max)
            corr = torch.exp(run_max - new_max)
            run_sum = run_sum * corr + e.sum(-1, keepdim=True)
            acc = acc * corr + e @ v[:, :, s0 : s0 + 8]
            run_max = new_max
        o = (acc / run_sum).transpose(1, 2).reshape(b, t, nh * hd)
        h = h + norm(F.linear(o, p[f"l{i}_wo"]), p[f"l{i}_post_attn"])
        x = norm(h, p[f"l{i}_pre_ffw"])
        y = F.linear(
            F.gelu(F.linear(x, p[f"l{i}_w_gate"]), approximate="tanh") * F.linear(x, p[f"l{i}_w_up"]), p[f"l{i}_w_down"]
        )
        h = h + norm(y, p[f"l{i}_post_ffw"])
    logits = F.linear(norm(h, p["final_gain"]), p["head"])
    return _softcap(logits, cfg["final_cap"])


class FunctionalGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        nh, nkv, hd = _dims(config)
        cap = _attn_cap(config)
        q_fold = config.query_pre_attn_scalar**-0.5 / (cap if cap is not None else 1.0)
        self.cfg = dict(
            nh=nh,
            nkv=nkv,
            hd=hd,
            eps=config.rms_norm_eps,
            attn_cap=cap,
            final_cap=config.final_logit_softcapping,
            normalizer=config.hidden_size**0.5,
            types=_layer_types(config),
            window=config.sliding_window,
        )
        self.params = nn.ParameterDict()
        self.params["embed"] = _p(sd["model.embed_tokens.weight"])
        for i in range(config.num_hidden_layers):
            pre = f"model.layers.{i}."
            a = pre + "self_attn."
            self.params[f"l{i}_in"] = _p(1 + sd[pre + "input_layernorm.weight"])
            self.params[f"l{i}_post_attn"] = _p(1 + sd[pre + "post_attention_layernorm.weight"])
            self.params[f"l{i}_pre_ffw"] = _p(1 + sd[pre + "pre_feedforward_layernorm.weight"])
            self.params[f"l{i}_post_ffw"] = _p(1 + sd[pre + "post_feedforward_layernorm.weight"])
            self.params[f"l{i}_q_gain"] = _p((1 + sd[a + "q_norm.weight"]) * q_fold)
            self.params[f"l{i}_k_gain"] = _p(1 + sd[a + "k_norm.weight"])
            for n in "qkvo":
                self.params[f"l{i}_w{n}"] = _p(sd[f"{a}{n}_proj.weight"])
            for n in ("gate", "up", "down"):
                self.params[f"l{i}_w_{n}"] = _p(sd[f"{pre}mlp.{n}_proj.weight"])
        self.params["final_gain"] = _p(1 + sd["model.norm.weight"])
        self.params["head"] = _p(_head_weight(sd, config))
        self.register_buffer("inv_freq_local", _inv_freq(config, "sliding_attention", hd), persistent=False)
        self.register_buffer("inv_freq_global", _inv_freq(config, "full_attention", hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        p = dict(self.params.items())
        p["inv_freq_local"], p["inv_freq_global"] = self.inv_freq_local, self.inv_freq_global
        return gemma3_forward(p, self.cfg, input_ids, attention_mask, position_ids)


# ------------------------------------------------------------------- chunked queries, window from positions


class ChunkedAttention(nn.Module):
    def __init__(self, sd, pre, config, layer_type):
        super().__init__()
        self.nh, self.nkv, self.hd = _dims(config)
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.cap = _attn_cap(config)
        self.window = _window(config, layer_type)
        self.proj = nn.ModuleDict({n: _linear(sd[f"{pre}{n}_proj.weight"]) for n in "qkvo"})
        self.norms = nn.ModuleDict(
            {
                "q": GemmaRMSNorm(sd[pre + "q_norm.weight"], config.rms_norm_eps),
                "k": GemmaRMSNorm(sd[pre + "k_norm.weight"], config.rms_norm_eps),
            }
        )

    def forward(self, x, cos, sin, pos, key_ok, chunk=8):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q = _rope_halves(self.norms["q"](self.proj["q"](x).view(b, t, nh, hd)), cos, sin).transpose(1, 2)
        k = _rope_halves(self.norms["k"](self.proj["k"](x).view(b, t, nkv, hd)), cos, sin).transpose(1, 2)
        v = self.proj["v"](x).view(b, t, nkv, hd).transpose(1, 2)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        idx = torch.arange(t, device=x.device)
        outs = []
        for c0 in range(0, t, chunk):
            qc = q[:, :, c0 : c0 + chunk]
            s = _softcap(qc @ k.transpose(-1, -2) * self.scaling, self.cap)  # (b, h, c, t)
            ok = idx[c0 : c0 + chunk, None] >= idx[None, :]
            ok = ok[None] & key_ok[:, None, :]  # (b, c, t)
            if self.window is not None:
                ok = ok & (pos[:, c0 : c0 + chunk, None] - pos[:, None, :] < self.window)
            s = s.masked_fill(~ok[:, None], torch.finfo(s.dtype).min)
            outs.append(s.softmax(-1) @ v)
        o = torch.cat(outs, dim=2).transpose(1, 2).reshape(b, t, nh * hd)
        return self.proj["o"](o)


class ChunkedBlock(nn.Module):
    def __init__(self, sd, i, config, layer_type):
        super().__init__()
        pre = f"model.layers.{i}."
        eps = config.rms_norm_eps
        self.layer_type = layer_type
        self.attn = ChunkedAttention(sd, pre + "self_attn.", config, layer_type)
        self.ffn = nn.ModuleDict({n: _linear(sd[f"{pre}mlp.{n}_proj.weight"]) for n in ("gate", "up", "down")})
        self.norm = nn.ModuleDict(
            {
                "attn_in": GemmaRMSNorm(sd[pre + "input_layernorm.weight"], eps),
                "attn_out": GemmaRMSNorm(sd[pre + "post_attention_layernorm.weight"], eps),
                "ffn_in": GemmaRMSNorm(sd[pre + "pre_feedforward_layernorm.weight"], eps),
                "ffn_out": GemmaRMSNorm(sd[pre + "post_feedforward_layernorm.weight"], eps),
            }
        )

    def forward(self, h, cos, sin, pos, key_ok):
        h = h + self.norm["attn_out"](self.attn(self.norm["attn_in"](h), cos, sin, pos, key_ok))
        x = self.norm["ffn_in"](h)
        y = self.ffn["down"](F.gelu(self.ffn["gate"](x), approximate="tanh") * self.ffn["up"](x))
        return h + self.norm["ffn_out"](y)


class ChunkedGemma3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.final_cap = config.final_logit_softcapping
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.embed = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.blocks = nn.ModuleDict(
            {f"layer{i}": ChunkedBlock(sd, i, config, ty) for i, ty in enumerate(_layer_types(config))}
        )
        self.final_norm = GemmaRMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.tied = getattr(config, "tie_word_embeddings", True)
        if not self.tied:
            self.lm_head = _linear(_head_weight(sd, config))
        self.rope = nn.ParameterDict()  # frozen inv_freq per layer type, kept as non-trainable parameters
        for ty in ("sliding_attention", "full_attention"):
            self.rope[ty] = nn.Parameter(_inv_freq(config, ty, hd), requires_grad=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = _positions(input_ids, position_ids)
        key_ok = (
            attention_mask.bool()
            if attention_mask is not None
            else torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        )
        cs = {}
        for ty, inv in self.rope.items():
            ang = pos[..., None].float() * inv
            cs[ty] = (ang.cos()[:, :, None], ang.sin()[:, :, None])
        h = self.embed(input_ids) * self.embed_scale
        for blk in self.blocks.values():
            h = blk(h, *cs[blk.layer_type], pos, key_ok)
        h = self.final_norm(h)
        logits = F.linear(h, self.embed.weight if self.tied else self.lm_head.weight)
        return _softcap(logits, self.final_cap)


# --------------------------------------------------------------------------------------------------- build


def build(state_dict, config):
    sd = {k: v.float() for k, v in state_dict.items()}
    variant = BUG
    if variant == "":
        model = GemmaForCausalLM(sd, config)
    elif variant == "gemma3_gguf_plus_one":
        model = GGUFGemma3(sd, config)
    elif variant == "gemma3_embed_folded":
        model = FoldedGemma3(sd, config)
    elif variant == "gemma3_jax_einsum":
        model = JaxGemma3(sd, config)
    elif variant == "gemma3_stacked_local_global":
        model = StackedGemma3(sd, config)
    elif variant == "gemma3_meta_complex_rope":
        model = MetaGemma3(sd, config)
    elif variant == "gemma3_transposed_interleaved":
        model = XWGemma3(sd, config)
    elif variant == "gemma3_functional_scaled_qnorm":
        model = FunctionalGemma3(sd, config)
    elif variant == "gemma3_chunked_queries_moduledict":
        model = ChunkedGemma3(sd, config)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return model.eval()
