"""Hand-written plain-PyTorch port of Llama (LlamaForCausalLM), Llama-3.1 flavour, in several weight layouts.

Architecture as this port implements it:
- token embedding (no scaling); L pre-norm decoder blocks; final RMSNorm; head (untied unless
  config.tie_word_embeddings).
- RMSNorm: x * rsqrt(mean(x^2) + eps) * g, computed in float32.
- block:  h = h + Attn(RMS_1(h));  h = h + MLP(RMS_2(h)).
- Attn: q = W_q x + b_q, k = W_k x + b_k, v = W_v x + b_v (biases when config.attention_bias), n_heads query heads,
  n_kv_heads key/value heads (GQA, query head n reads kv head n // (n_heads / n_kv_heads)); RoPE on q and k;
  causal softmax(q k^T / sqrt(head_dim)) v; out = W_o o + b_o.
- RoPE: inv_freq_i = theta^(-2i/d), rescaled per config.rope_parameters (llama3: long wavelengths divided by
  `factor`, the band in between smoothly interpolated; linear: all divided by `factor`); angle = position * inv_freq.
- MLP (SwiGLU): W_down (silu(W_gate x + b_gate) * (W_up x + b_up)) + b_down (biases when config.mlp_bias).
- attention_mask (batch, seq) 1/0 masks padded keys; position_ids default to 0..T-1.

Weight / compute layout per variant (BUG selects one; all of them are correct):
- "" (baseline): Meta reference-code module tree and names (tok_embeddings, layers[i].attention.{wqkv, wo},
  attention_norm, ffn_norm, feed_forward.{w1 (gate), w3 (up), w2 (down)}, norm, output); q/k/v fused into one
  `wqkv` Linear in [q | k | v] row order; RoPE cos/sin tables (max_position_embeddings, head_dim / 2) precomputed
  as buffers and gathered by position, applied to the two halves (HF's half-split pairing); explicit softmax with an
  additive float mask (finfo.min); GQA by repeat_interleave of k/v.
- llama_meta_complex_rope: separate wq/wk/wv; the rows of wq/wk (and their biases) permuted back to Meta's
  original interleaved layout (pair (2i, 2i+1) per head) and RoPE applied as a complex multiplication with a
  precomputed complex `freqs_cis` buffer (view_as_complex), as in Meta's llama reference code.
- llama_transposed_xw: every matrix stored transposed as a raw nn.Parameter (in, out) and applied as x @ W + b
  (Flax/JAX kernel convention); embedding a raw Parameter indexed by ids; head (hidden, vocab).
- llama_heads_einsum: q/k/v weights as (heads, head_dim, hidden), biases (heads, head_dim), o as
  (heads, head_dim, hidden), all applied by einsum; GQA by grouping the query heads (b, kv, group, t, d) against
  the un-repeated k/v; RoPE angles computed on the fly from an inv_freq buffer.
- llama_gqa_grouped_qkv: fused qkv in Megatron / GPT-NeoX GQA layout: per kv head j the rows
  [q heads of group j | k_j | v_j]; gate/up fused in one `w13` Linear as [gate | up] (vLLM's gate_up_proj +
  SiluAndMul chunk).
- llama_stacked_folded: every layer's weights stacked as one tensor per kind (n_layers, out, in) in a
  ParameterDict indexed in a loop; the RMSNorm gains folded into the columns of the next projections
  (attention_norm -> wqkv, ffn_norm -> w1/w3, final norm -> head), so the norms carry no weight; the attention
  scale 1/sqrt(head_dim) folded into the q rows (weight and bias) of wqkv.
- llama_functional_dict: one functional forward reading a flat ParameterDict of tensors ("l{i}_wq", ...);
  F.embedding / F.linear; attention by F.scaled_dot_product_attention(enable_gqa=True) with a boolean mask;
  positions computed from the attention mask (cumsum) when no position_ids are given.
- llama_gguf: llama.cpp / GGUF tensor names (token_embd, blk[i]{attn_norm, attn_q, attn_k, attn_v, attn_output,
  ffn_norm, ffn_gate, ffn_up, ffn_down}, output_norm, output) in ModuleDicts; q/k rows in Meta's interleaved
  order (as convert_hf_to_gguf.py permutes them) with "normal"-mode RoPE on adjacent pairs in real arithmetic;
  the llama3 scaling stored as llama.cpp's `rope_freqs` factors (angle = pos * base_inv_freq / rope_freqs).
- llama_backbone_head_sdpa: a backbone module returning the final-normed last hidden states and a separate head
  module; gate/up fused row-interleaved [g0, u0, g1, u1, ...] and split by [..., 0::2] / [..., 1::2];
  F.scaled_dot_product_attention with an additive float mask and HF-style expand/reshape GQA; cos/sin recomputed
  inside every attention layer from an inv_freq buffer.
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
    "llama_meta_complex_rope",  # Meta row order for wq/wk + RoPE by complex multiplication with freqs_cis
    "llama_transposed_xw",  # all matrices stored (in, out) as raw Parameters, applied as x @ W + b
    "llama_heads_einsum",  # (heads, head_dim, hidden) weights + einsum, grouped-query scores without repeat
    "llama_gqa_grouped_qkv",  # fused qkv per kv group [q_g.. | k | v] (Megatron/NeoX) + fused [gate | up] w13
    "llama_stacked_folded",  # (n_layers, ...) stacked weights; norm gains and 1/sqrt(d) folded into projections
    "llama_functional_dict",  # functional forward over a flat ParameterDict, SDPA(enable_gqa) + bool mask
    "llama_gguf",  # llama.cpp names, Meta row order + adjacent-pair RoPE, llama3 scaling as rope_freqs factors
    "llama_backbone_head_sdpa",  # backbone -> last hidden, separate head; gate/up row-interleaved; SDPA
]


# ----------------------------------------------------------------------------------------------- shared helpers


def _dims(config):
    nh = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or config.hidden_size // nh
    return nh, nkv, hd


def _rope_params(config):
    rp = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in rp:
        rp["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rp.setdefault("rope_type", "default")
    return rp


def _base_inv_freq(config, hd):
    rp = _rope_params(config)
    return 1.0 / (rp["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))


def _inv_freq(config, hd):
    """The (scaled) RoPE inverse frequencies: default, linear or llama3 (Llama 3.1's wavelength bands)."""
    rp = _rope_params(config)
    inv = _base_inv_freq(config, hd)
    kind = rp["rope_type"]
    if kind == "linear":
        return inv / rp["factor"]
    if kind == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled)
    return inv


def _rms(x, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _default_positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)


def _allowed(attention_mask, b, t, device):
    """(b, 1, t, t) boolean: causal and key not padding."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None, None]
    if attention_mask is None:
        return causal.expand(b, 1, t, t)
    return causal & attention_mask.bool()[:, None, None, :]


def _additive(attention_mask, b, t, device):
    ok = _allowed(attention_mask, b, t, device)
    return torch.zeros(ok.shape, device=device).masked_fill(~ok, torch.finfo(torch.float32).min)


def _rope_halves(x, cos, sin):
    """HF pairing: element i with element i + d/2.  x (b, t, h, d); cos/sin (b, t, 1, d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _to_meta_rows(w, n_heads, hd):
    """HF's half-split q/k rows -> Meta's interleaved rows (inverse of convert_llama_weights_to_hf's permute)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, hd // 2, *rest).transpose(1, 2).reshape(n_heads * hd, *rest).contiguous()


def _get(sd, name):
    return sd.get(name)


def _head_weight(sd, config):
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in sd:
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


class RMSNorm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight = _p(weight)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.eps) * self.weight


# ------------------------------------------------------------------ Meta-style tree (baseline, complex, grouped)


class Attention(nn.Module):
    def __init__(self, sd, pre, config, mode):
        super().__init__()
        self.nh, self.nkv, self.hd = _dims(config)
        self.mode = mode
        q, k, v = (sd[f"{pre}self_attn.{n}_proj.weight"] for n in "qkv")
        bq, bk, bv = (_get(sd, f"{pre}self_attn.{n}_proj.bias") for n in "qkv")
        has_b = bq is not None
        if mode == "complex":
            self.wq = _linear(
                _to_meta_rows(q, self.nh, self.hd), _to_meta_rows(bq, self.nh, self.hd) if has_b else None
            )
            self.wk = _linear(
                _to_meta_rows(k, self.nkv, self.hd), _to_meta_rows(bk, self.nkv, self.hd) if has_b else None
            )
            self.wv = _linear(v, bv)
        elif mode == "grouped":
            g = self.nh // self.nkv

            def group(wq_, wk_, wv_):
                per = [
                    wq_.reshape(self.nkv, g * self.hd, *wq_.shape[1:]),
                    wk_.reshape(self.nkv, self.hd, *wk_.shape[1:]),
                    wv_.reshape(self.nkv, self.hd, *wv_.shape[1:]),
                ]
                return torch.cat(per, dim=1).reshape(-1, *wq_.shape[1:])

            self.wqkv = _linear(group(q, k, v), group(bq, bk, bv) if has_b else None)
        else:
            self.wqkv = _linear(torch.cat([q, k, v]), torch.cat([bq, bk, bv]) if has_b else None)
        self.wo = _linear(sd[f"{pre}self_attn.o_proj.weight"], _get(sd, f"{pre}self_attn.o_proj.bias"))

    def forward(self, x, rope, mask):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if self.mode == "complex":
            q = self.wq(x).view(b, t, nh, hd)
            k = self.wk(x).view(b, t, nkv, hd)
            v = self.wv(x).view(b, t, nkv, hd)
            freqs_cis = rope[:, :, None, :]  # (b, t, 1, d/2) complex
            q = torch.view_as_real(torch.view_as_complex(q.float().reshape(b, t, nh, hd // 2, 2)) * freqs_cis).flatten(
                3
            )
            k = torch.view_as_real(torch.view_as_complex(k.float().reshape(b, t, nkv, hd // 2, 2)) * freqs_cis).flatten(
                3
            )
        else:
            y = self.wqkv(x)
            if self.mode == "grouped":
                g = nh // nkv
                y = y.view(b, t, nkv, (g + 2) * hd)
                q, k, v = y.split([g * hd, hd, hd], dim=-1)
                q = q.reshape(b, t, nh, hd)
            else:
                q, k, v = y.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
                q = q.view(b, t, nh, hd)
                k = k.view(b, t, nkv, hd)
                v = v.view(b, t, nkv, hd)
            cos, sin = rope
            q = _rope_halves(q, cos, sin)
            k = _rope_halves(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd) + mask
        out = scores.softmax(dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, t, nh * hd))


class FeedForward(nn.Module):
    def __init__(self, sd, pre, fused):
        super().__init__()
        g, u, d = (sd[f"{pre}mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        bg, bu, bd = (_get(sd, f"{pre}mlp.{n}_proj.bias") for n in ("gate", "up", "down"))
        self.fused = fused
        if fused:
            self.w13 = _linear(torch.cat([g, u]), torch.cat([bg, bu]) if bg is not None else None)
        else:
            self.w1 = _linear(g, bg)
            self.w3 = _linear(u, bu)
        self.w2 = _linear(d, bd)

    def forward(self, x):
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, sd, i, config, mode):
        super().__init__()
        pre = f"model.layers.{i}."
        eps = config.rms_norm_eps
        self.attention_norm = RMSNorm(sd[pre + "input_layernorm.weight"], eps)
        self.attention = Attention(sd, pre, config, mode)
        self.ffn_norm = RMSNorm(sd[pre + "post_attention_layernorm.weight"], eps)
        self.feed_forward = FeedForward(sd, pre, fused=(mode == "grouped"))

    def forward(self, h, rope, mask):
        h = h + self.attention(self.attention_norm(h), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, sd, config, mode):
        super().__init__()
        nh, nkv, hd = _dims(config)
        self.mode = mode
        self.tok_embeddings = nn.Embedding.from_pretrained(
            sd["model.embed_tokens.weight"].float().clone(), freeze=False
        )
        self.layers = nn.ModuleList(TransformerBlock(sd, i, config, mode) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.output = _linear(_head_weight(sd, config))
        angles = torch.outer(torch.arange(config.max_position_embeddings).float(), _inv_freq(config, hd))
        if mode == "complex":
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        else:
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = _default_positions(input_ids, position_ids)
        if self.mode == "complex":
            rope = self.freqs_cis[pos]
        else:
            rope = (self.rope_cos[pos][:, :, None, :], self.rope_sin[pos][:, :, None, :])
        mask = _additive(attention_mask, b, t, input_ids.device)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.output(self.norm(h)).float()


# ------------------------------------------------------------------------------------------- transposed x @ W


class XWBlock(nn.Module):
    def __init__(self, sd, i, config):
        super().__init__()
        pre = f"model.layers.{i}."
        self.nh, self.nkv, self.hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.ln_attn = _p(sd[pre + "input_layernorm.weight"])
        self.ln_mlp = _p(sd[pre + "post_attention_layernorm.weight"])
        self.kernels = nn.ParameterDict()
        self.biases = nn.ParameterDict()
        for short, name in (
            ("q", "self_attn.q_proj"),
            ("k", "self_attn.k_proj"),
            ("v", "self_attn.v_proj"),
            ("o", "self_attn.o_proj"),
            ("gate", "mlp.gate_proj"),
            ("up", "mlp.up_proj"),
            ("down", "mlp.down_proj"),
        ):
            self.kernels[short] = _p(sd[f"{pre}{name}.weight"].t())
            bias = _get(sd, f"{pre}{name}.bias")
            if bias is not None:
                self.biases[short] = _p(bias)

    def dense(self, x, short):
        y = x @ self.kernels[short]
        return y + self.biases[short] if short in self.biases else y

    def forward(self, h, cos, sin, mask):
        b, t, _ = h.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = _rms(h, self.eps) * self.ln_attn
        q = _rope_halves(self.dense(x, "q").view(b, t, nh, hd), cos, sin).transpose(1, 2)
        k = _rope_halves(self.dense(x, "k").view(b, t, nkv, hd), cos, sin).transpose(1, 2)
        v = self.dense(x, "v").view(b, t, nkv, hd).transpose(1, 2)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) * hd**-0.5 + mask, dim=-1)
        h = h + self.dense((att @ v).transpose(1, 2).reshape(b, t, nh * hd), "o")
        x = _rms(h, self.eps) * self.ln_mlp
        return h + self.dense(F.silu(self.dense(x, "gate")) * self.dense(x, "up"), "down")


class XWLlama(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.embedding = _p(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList(XWBlock(sd, i, config) for i in range(config.num_hidden_layers))
        self.ln_f = _p(sd["model.norm.weight"])
        self.unembed = _p(_head_weight(sd, config).t())  # (hidden, vocab)
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = _default_positions(input_ids, position_ids)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        mask = _additive(attention_mask, b, t, input_ids.device)
        h = self.embedding[input_ids]
        for blk in self.blocks:
            h = blk(h, cos, sin, mask)
        return (_rms(h, self.eps) * self.ln_f) @ self.unembed


# --------------------------------------------------------------------------------------------- heads + einsum


class EinsumAttention(nn.Module):
    def __init__(self, sd, pre, config):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        H = config.hidden_size
        self.q = _p(sd[pre + "q_proj.weight"].reshape(nh, hd, H))
        self.k = _p(sd[pre + "k_proj.weight"].reshape(nkv, hd, H))
        self.v = _p(sd[pre + "v_proj.weight"].reshape(nkv, hd, H))
        self.o = _p(sd[pre + "o_proj.weight"].t().reshape(nh, hd, H))
        self.has_bias = _get(sd, pre + "q_proj.bias") is not None
        if self.has_bias:
            self.q_bias = _p(sd[pre + "q_proj.bias"].reshape(nh, hd))
            self.k_bias = _p(sd[pre + "k_proj.bias"].reshape(nkv, hd))
            self.v_bias = _p(sd[pre + "v_proj.bias"].reshape(nkv, hd))
        ob = _get(sd, pre + "o_proj.bias")
        self.o_bias = _p(ob) if ob is not None else None

    def forward(self, x, cos, sin, allowed):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q = torch.einsum("bth,ndh->btnd", x, self.q)
        k = torch.einsum("bth,ndh->btnd", x, self.k)
        v = torch.einsum("bth,ndh->btnd", x, self.v)
        if self.has_bias:
            q, k, v = q + self.q_bias, k + self.k_bias, v + self.v_bias
        q, k = _rope_halves(q, cos, sin), _rope_halves(k, cos, sin)
        q = q.view(b, t, nkv, nh // nkv, hd)
        scores = torch.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(~allowed[:, :, None], torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1)
        out = torch.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, nh, hd)
        y = torch.einsum("btnd,ndh->bth", out, self.o)
        return y + self.o_bias if self.o_bias is not None else y


class EinsumMLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.gate = _linear(sd[pre + "gate_proj.weight"], _get(sd, pre + "gate_proj.bias"))
        self.up = _linear(sd[pre + "up_proj.weight"], _get(sd, pre + "up_proj.bias"))
        self.down = _linear(sd[pre + "down_proj.weight"], _get(sd, pre + "down_proj.bias"))

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class EinsumBlock(nn.Module):
    def __init__(self, sd, i, config):
        super().__init__()
        pre = f"model.layers.{i}."
        self.pre_attn_norm = RMSNorm(sd[pre + "input_layernorm.weight"], config.rms_norm_eps)
        self.attn = EinsumAttention(sd, pre + "self_attn.", config)
        self.pre_mlp_norm = RMSNorm(sd[pre + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.mlp = EinsumMLP(sd, pre + "mlp.")

    def forward(self, h, cos, sin, allowed):
        h = h + self.attn(self.pre_attn_norm(h), cos, sin, allowed)
        return h + self.mlp(self.pre_mlp_norm(h))


class EinsumLlama(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.embed = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.blocks = nn.ModuleList(EinsumBlock(sd, i, config) for i in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.lm_head = _linear(_head_weight(sd, config))
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = _default_positions(input_ids, position_ids)
        ang = torch.einsum("bt,f->btf", pos.float(), self.inv_freq)
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        allowed = _allowed(attention_mask, b, t, input_ids.device)
        h = self.embed(input_ids)
        for blk in self.blocks:
            h = blk(h, cos, sin, allowed)
        return self.lm_head(self.final_norm(h))


# ------------------------------------------------------------------------------- stacked layers, folded gains


class StackedLlama(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.n_layers = L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        scale = hd**-0.5
        lay = [f"model.layers.{i}." for i in range(L)]

        def w(i, name):
            return sd[lay[i] + name]

        def b(i, name):
            t = _get(sd, lay[i] + name)
            return t

        wqkv, bqkv, w13, b13 = [], [], [], []
        for i in range(L):
            g_attn = w(i, "input_layernorm.weight")
            g_mlp = w(i, "post_attention_layernorm.weight")
            q = w(i, "self_attn.q_proj.weight") * scale
            k, v = w(i, "self_attn.k_proj.weight"), w(i, "self_attn.v_proj.weight")
            wqkv.append(torch.cat([q, k, v]) * g_attn[None, :])
            if b(i, "self_attn.q_proj.bias") is not None:
                bqkv.append(
                    torch.cat(
                        [
                            b(i, "self_attn.q_proj.bias") * scale,
                            b(i, "self_attn.k_proj.bias"),
                            b(i, "self_attn.v_proj.bias"),
                        ]
                    )
                )
            w13.append(torch.cat([w(i, "mlp.gate_proj.weight"), w(i, "mlp.up_proj.weight")]) * g_mlp[None, :])
            if b(i, "mlp.gate_proj.bias") is not None:
                b13.append(torch.cat([b(i, "mlp.gate_proj.bias"), b(i, "mlp.up_proj.bias")]))
        self.stack = nn.ParameterDict()
        self.stack["wqkv"] = _p(torch.stack(wqkv))
        self.stack["wo"] = _p(torch.stack([w(i, "self_attn.o_proj.weight") for i in range(L)]))
        self.stack["w13"] = _p(torch.stack(w13))
        self.stack["w2"] = _p(torch.stack([w(i, "mlp.down_proj.weight") for i in range(L)]))
        if bqkv:
            self.stack["bqkv"] = _p(torch.stack(bqkv))
        if b(0, "self_attn.o_proj.bias") is not None:
            self.stack["bo"] = _p(torch.stack([b(i, "self_attn.o_proj.bias") for i in range(L)]))
        if b13:
            self.stack["b13"] = _p(torch.stack(b13))
        if b(0, "mlp.down_proj.bias") is not None:
            self.stack["b2"] = _p(torch.stack([b(i, "mlp.down_proj.bias") for i in range(L)]))
        self.wte = _p(sd["model.embed_tokens.weight"])
        self.head = _p(_head_weight(sd, config) * sd["model.norm.weight"][None, :])
        angles = torch.outer(torch.arange(config.max_position_embeddings).float(), _inv_freq(config, hd))
        self.register_buffer("cos_cached", angles.cos(), persistent=False)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)

    def _bias(self, name, i):
        return self.stack[name][i] if name in self.stack else None

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        pos = _default_positions(input_ids, position_ids)
        cos, sin = self.cos_cached[pos][:, :, None], self.sin_cached[pos][:, :, None]
        mask = _additive(attention_mask, b, t, input_ids.device)
        h = F.embedding(input_ids, self.wte)
        for i in range(self.n_layers):
            y = F.linear(_rms(h, self.eps), self.stack["wqkv"][i], self._bias("bqkv", i))
            q, k, v = y.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = _rope_halves(q.view(b, t, nh, hd), cos, sin).transpose(1, 2)
            k = _rope_halves(k.view(b, t, nkv, hd), cos, sin).transpose(1, 2)
            v = v.view(b, t, nkv, hd).transpose(1, 2)
            k = k[:, :, None].expand(b, nkv, nh // nkv, t, hd).reshape(b, nh, t, hd)
            v = v[:, :, None].expand(b, nkv, nh // nkv, t, hd).reshape(b, nh, t, hd)
            att = torch.softmax(q @ k.transpose(-1, -2) + mask, dim=-1)  # scale already in wq
            o = (att @ v).transpose(1, 2).reshape(b, t, nh * hd)
            h = h + F.linear(o, self.stack["wo"][i], self._bias("bo", i))
            gate, up = F.linear(_rms(h, self.eps), self.stack["w13"][i], self._bias("b13", i)).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, self.stack["w2"][i], self._bias("b2", i))
        return F.linear(_rms(h, self.eps), self.head)


# ----------------------------------------------------------------------------------------- functional (dict)


def llama_forward(p, cfg, input_ids, attention_mask=None, position_ids=None):
    """Whole model as one function over a flat dict of tensors."""
    b, t = input_ids.shape
    nh, nkv, hd, eps = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["eps"]
    if position_ids is None:
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        else:
            position_ids = torch.arange(t, device=input_ids.device)[None].expand(b, t)
    ang = position_ids[..., None].float() * p["inv_freq"]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # (b, 1, t, d/2)

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    allowed = _allowed(attention_mask, b, t, input_ids.device)
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=input_ids.device)  # padded queries see themselves
    h = F.embedding(input_ids, p["embed"])
    for i in range(cfg["n_layers"]):

        def lin(x, name):
            return F.linear(x, p[f"l{i}_{name}_w"], p[f"l{i}_{name}_b"] if f"l{i}_{name}_b" in p else None)

        x = F.rms_norm(h, (h.shape[-1],), p[f"l{i}_attn_norm"], eps)
        q = rope(lin(x, "wq").view(b, t, nh, hd).transpose(1, 2))
        k = rope(lin(x, "wk").view(b, t, nkv, hd).transpose(1, 2))
        v = lin(x, "wv").view(b, t, nkv, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        h = h + lin(o.transpose(1, 2).reshape(b, t, nh * hd), "wo")
        x = F.rms_norm(h, (h.shape[-1],), p[f"l{i}_mlp_norm"], eps)
        h = h + lin(F.silu(lin(x, "w1")) * lin(x, "w3"), "w2")
    h = F.rms_norm(h, (h.shape[-1],), p["norm"], eps)
    return F.linear(h, p["output"])


class FunctionalLlama(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        nh, nkv, hd = _dims(config)
        self.cfg = dict(
            n_heads=nh, n_kv_heads=nkv, head_dim=hd, eps=config.rms_norm_eps, n_layers=config.num_hidden_layers
        )
        self.params = nn.ParameterDict()
        self.params["embed"] = _p(sd["model.embed_tokens.weight"])
        names = {
            "wq": "self_attn.q_proj",
            "wk": "self_attn.k_proj",
            "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj",
            "w1": "mlp.gate_proj",
            "w3": "mlp.up_proj",
            "w2": "mlp.down_proj",
        }
        for i in range(config.num_hidden_layers):
            pre = f"model.layers.{i}."
            self.params[f"l{i}_attn_norm"] = _p(sd[pre + "input_layernorm.weight"])
            self.params[f"l{i}_mlp_norm"] = _p(sd[pre + "post_attention_layernorm.weight"])
            for short, hf in names.items():
                self.params[f"l{i}_{short}_w"] = _p(sd[f"{pre}{hf}.weight"])
                if _get(sd, f"{pre}{hf}.bias") is not None:
                    self.params[f"l{i}_{short}_b"] = _p(sd[f"{pre}{hf}.bias"])
        self.params["norm"] = _p(sd["model.norm.weight"])
        self.params["output"] = _p(_head_weight(sd, config))
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        p = dict(self.params.items())
        p["inv_freq"] = self.inv_freq
        return llama_forward(p, self.cfg, input_ids, attention_mask, position_ids)


# ---------------------------------------------------------------------------------------------- llama.cpp GGUF


class GGUFLlama(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.token_embd = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.blk = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            pre = f"model.layers.{i}."
            bq, bk = _get(sd, pre + "self_attn.q_proj.bias"), _get(sd, pre + "self_attn.k_proj.bias")
            d = nn.ModuleDict()
            d["attn_norm"] = RMSNorm(sd[pre + "input_layernorm.weight"], self.eps)
            d["attn_q"] = _linear(
                _to_meta_rows(sd[pre + "self_attn.q_proj.weight"], nh, hd),
                _to_meta_rows(bq, nh, hd) if bq is not None else None,
            )
            d["attn_k"] = _linear(
                _to_meta_rows(sd[pre + "self_attn.k_proj.weight"], nkv, hd),
                _to_meta_rows(bk, nkv, hd) if bk is not None else None,
            )
            d["attn_v"] = _linear(sd[pre + "self_attn.v_proj.weight"], _get(sd, pre + "self_attn.v_proj.bias"))
            d["attn_output"] = _linear(sd[pre + "self_attn.o_proj.weight"], _get(sd, pre + "self_attn.o_proj.bias"))
            d["ffn_norm"] = RMSNorm(sd[pre + "post_attention_layernorm.weight"], self.eps)
            d["ffn_gate"] = _linear(sd[pre + "mlp.gate_proj.weight"], _get(sd, pre + "mlp.gate_proj.bias"))
            d["ffn_up"] = _linear(sd[pre + "mlp.up_proj.weight"], _get(sd, pre + "mlp.up_proj.bias"))
            d["ffn_down"] = _linear(sd[pre + "mlp.down_proj.weight"], _get(sd, pre + "mlp.down_proj.bias"))
            self.blk.append(d)
        self.output_norm = RMSNorm(sd["model.norm.weight"], self.eps)
        self.output = _linear(_head_weight(sd, config))
        base = _base_inv_freq(config, hd)
        self.register_buffer("base_inv_freq", base, persistent=False)
        self.register_buffer("rope_freqs", base / _inv_freq(config, hd))  # llama.cpp's per-frequency divisors

    def rope_norm(self, x, cos, sin):
        """ggml "normal" RoPE: rotate adjacent pairs (x[2i], x[2i+1])."""
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        pos = _default_positions(input_ids, position_ids)
        theta = pos[..., None].float() * (self.base_inv_freq / self.rope_freqs)
        cos, sin = theta.cos()[:, :, None], theta.sin()[:, :, None]
        kq_mask = _additive(attention_mask, b, t, input_ids.device)
        cur = self.token_embd(input_ids)
        for d in self.blk:
            x = d["attn_norm"](cur)
            q = self.rope_norm(d["attn_q"](x).view(b, t, nh, hd), cos, sin).transpose(1, 2)
            k = self.rope_norm(d["attn_k"](x).view(b, t, nkv, hd), cos, sin).transpose(1, 2)
            v = d["attn_v"](x).view(b, t, nkv, hd).transpose(1, 2)
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            kq = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + kq_mask, dim=-1)
            cur = cur + d["attn_output"]((kq @ v).transpose(1, 2).reshape(b, t, nh * hd))
            x = d["ffn_norm"](cur)
            cur = cur + d["ffn_down"](F.silu(d["ffn_gate"](x)) * d["ffn_up"](x))
        return self.output(self.output_norm(cur))


# -------------------------------------------------------------------------------- backbone + separate head


class InterleavedMLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        g, u = sd[pre + "gate_proj.weight"], sd[pre + "up_proj.weight"]
        bg, bu = _get(sd, pre + "gate_proj.bias"), _get(sd, pre + "up_proj.bias")
        self.gate_up = _linear(
            torch.stack([g, u], dim=1).reshape(-1, g.shape[1]),
            torch.stack([bg, bu], dim=1).reshape(-1) if bg is not None else None,
        )
        self.down = _linear(sd[pre + "down_proj.weight"], _get(sd, pre + "down_proj.bias"))

    def forward(self, x):
        gu = self.gate_up(x)
        return self.down(F.silu(gu[..., 0::2]) * gu[..., 1::2])


class SdpaAttention(nn.Module):
    def __init__(self, sd, pre, config):
        super().__init__()
        self.nh, self.nkv, self.hd = _dims(config)
        self.q_proj = _linear(sd[pre + "q_proj.weight"], _get(sd, pre + "q_proj.bias"))
        self.k_proj = _linear(sd[pre + "k_proj.weight"], _get(sd, pre + "k_proj.bias"))
        self.v_proj = _linear(sd[pre + "v_proj.weight"], _get(sd, pre + "v_proj.bias"))
        self.out_proj = _linear(sd[pre + "o_proj.weight"], _get(sd, pre + "o_proj.bias"))
        self.register_buffer("inv_freq", _inv_freq(config, self.hd), persistent=False)

    def forward(self, x, pos, mask):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        ang = pos[..., None].float() * self.inv_freq
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]

        def rot(z):
            return torch.cat((-z[..., hd // 2 :], z[..., : hd // 2]), dim=-1)

        q = self.q_proj(x).view(b, t, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        g = nh // nkv
        k = k[:, :, None].expand(b, nkv, g, t, hd).reshape(b, nh, t, hd)
        v = v[:, :, None].expand(b, nkv, g, t, hd).reshape(b, nh, t, hd)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, nh * hd))


class BackboneLayer(nn.Module):
    def __init__(self, sd, i, config):
        super().__init__()
        pre = f"model.layers.{i}."
        self.norm1 = RMSNorm(sd[pre + "input_layernorm.weight"], config.rms_norm_eps)
        self.attn = SdpaAttention(sd, pre + "self_attn.", config)
        self.norm2 = RMSNorm(sd[pre + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.ffn = InterleavedMLP(sd, pre + "mlp.")

    def forward(self, h, pos, mask):
        h = h + self.attn(self.norm1(h), pos, mask)
        return h + self.ffn(self.norm2(h))


class LlamaBackbone(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.wte = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.h = nn.ModuleList(BackboneLayer(sd, i, config) for i in range(config.num_hidden_layers))
        self.ln_f = RMSNorm(sd["model.norm.weight"], config.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = _default_positions(input_ids, position_ids)
        mask = _additive(attention_mask, b, t, input_ids.device)
        h = self.wte(input_ids)
        for layer in self.h:
            h = layer(h, pos, mask)
        return self.ln_f(h)


class LlamaWithHead(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.backbone = LlamaBackbone(sd, config)
        self.head = _linear(_head_weight(sd, config))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.backbone(input_ids, attention_mask, position_ids))


# --------------------------------------------------------------------------------------------------- build


def build(state_dict, config):
    sd = {k: v.float() for k, v in state_dict.items()}
    variant = BUG
    if variant == "":
        model = Transformer(sd, config, "halves")
    elif variant == "llama_meta_complex_rope":
        model = Transformer(sd, config, "complex")
    elif variant == "llama_gqa_grouped_qkv":
        model = Transformer(sd, config, "grouped")
    elif variant == "llama_transposed_xw":
        model = XWLlama(sd, config)
    elif variant == "llama_heads_einsum":
        model = EinsumLlama(sd, config)
    elif variant == "llama_stacked_folded":
        model = StackedLlama(sd, config)
    elif variant == "llama_functional_dict":
        model = FunctionalLlama(sd, config)
    elif variant == "llama_gguf":
        model = GGUFLlama(sd, config)
    elif variant == "llama_backbone_head_sdpa":
        model = LlamaWithHead(sd, config)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return model.eval()
