"""Hand-written plain-PyTorch port of Qwen3 (Qwen3ForCausalLM, dense) in several weight / compute layouts.

Architecture as this port implements it:
- token embedding (no scaling); L pre-norm decoder blocks; final RMSNorm; head tied to the embedding when
  config.tie_word_embeddings (as in the checkpoint used here).
- RMSNorm: x * rsqrt(mean(x^2) + eps) * g in float32 (eps = config.rms_norm_eps everywhere).
- block:  h = h + Attn(RMS_1(h));  h = h + MLP(RMS_2(h)).
- Attn: q = W_q x + b_q (n_heads * head_dim, head_dim from the config, not hidden / heads), k, v likewise with
  n_kv_heads (GQA); per-head RMSNorm on q and on k over head_dim (q_norm / k_norm gains, shape (head_dim,)),
  then RoPE (half-split pairing, theta from config.rope_parameters); causal softmax(q k^T / sqrt(head_dim)) v,
  restricted on the layers whose config.layer_types entry is "sliding_attention" to keys with
  q_index - k_index < config.sliding_window; out = W_o o (+ b_o).
- MLP (SwiGLU, no biases): W_down (silu(W_gate x) * W_up x).
- attention_mask (batch, seq) 1/0 masks padded keys; position_ids default to 0..T-1.

Weight / compute layout per variant (BUG selects one; all of them are correct):
- "" (baseline): litgpt module tree and names (transformer.wte, transformer.h[i].{norm_1, attn.{qkv, norm_q,
  norm_k, proj}, norm_2, mlp.{fc_1 (gate), fc_2 (up), proj (down)}}, transformer.ln_f, lm_head); q/k/v fused in
  one `qkv` Linear in [q | k | v] row order; the head is the embedding Parameter itself (one shared tensor);
  RoPE cos/sin caches (max_position_embeddings, head_dim) (duplicated halves) as buffers; a precomputed boolean
  causal `mask_cache` buffer (max_pos, max_pos) sliced per call; explicit softmax, masked by finfo.min.
- qwen3_qkv_per_group: like the baseline but `qkv` in litgpt's older per-query-group layout: for each kv head j
  the rows [q heads of group j | k_j | v_j], split after a (b, t, n_kv, group + 2, head_dim) view.
- qwen3_transposed_kv_fused: separate q and one fused `wkv` [k | v]; all matrices stored transposed (in, out)
  as raw Parameters and applied as x @ W + b; head is the transposed embedding (hidden, vocab), a copy.
- qwen3_scale_in_qnorm: attention scale 1/sqrt(head_dim) folded into the q_norm gain; SDPA called with
  scale=1.0 and a boolean mask; the sliding window built from position_ids differences (same thing on real
  tokens); GQA by repeat_interleave.
- qwen3_heads_einsum: q/k/v as (heads, head_dim, hidden) with (heads, head_dim) biases, o as
  (heads, head_dim, hidden), einsum everywhere; GQA by grouping query heads (b, kv, group, t, d); RoPE angles
  on the fly from an inv_freq buffer.
- qwen3_vllm_fused_residual: vLLM's Qwen3 layout: qkv_proj [q | k | v], gate_up_proj [gate | up] with
  SiluAndMul (silu(x[:d]) * x[d:]), rotary `cos_sin_cache` (max_pos, head_dim) = [cos | sin] halves indexed by
  flattened positions; all linears on flattened (num_tokens, hidden) tokens; fused add + RMSNorm: every norm
  takes (x, residual) and returns (normed, new residual), layers return (hidden, residual) un-summed.
- qwen3_stacked_folded: every layer's weights stacked per kind (n_layers, in, out) (transposed) in a
  ParameterDict; input / post-attention RMSNorm gains folded into the rows of the fused qkv / gate-up kernels,
  the final norm gain folded into a separate (untied) head copy; a per-layer `is_sliding` buffer.
- qwen3_meta_complex_rope: q/k rows (and biases) permuted to Meta's interleaved order and the q_norm / k_norm
  gains permuted the same way (RMS over head_dim is permutation-invariant); RoPE as complex multiplication with
  a precomputed complex freqs_cis buffer.
- qwen3_online_softmax: a backbone returning the last hidden states and a separate tied head module; attention
  computed FlashAttention-style over key blocks of 4 with a running max / running sum (online softmax); qk-norm
  by F.rms_norm.
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
    "qwen3_qkv_per_group",  # litgpt's older qkv layout: per kv group [q_g.. | k | v] rows
    "qwen3_transposed_kv_fused",  # q + fused [k | v]; every matrix (in, out) applied as x @ W + b
    "qwen3_scale_in_qnorm",  # 1/sqrt(head_dim) folded into the q_norm gain; SDPA(scale=1), window from positions
    "qwen3_heads_einsum",  # (heads, head_dim, hidden) weights + einsum, grouped-query scores without repeat
    "qwen3_vllm_fused_residual",  # vLLM: qkv_proj, gate_up_proj, cos_sin_cache, fused add+RMSNorm residual
    "qwen3_stacked_folded",  # (n_layers, in, out) stacked kernels, RMSNorm gains folded into the kernels
    "qwen3_meta_complex_rope",  # Meta row order for q/k (+ q/k-norm gains permuted) + complex RoPE
    "qwen3_online_softmax",  # blockwise online-softmax attention; backbone + separate tied head module
]


# ----------------------------------------------------------------------------------------------- shared helpers


def _dims(config):
    nh = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or config.hidden_size // nh
    return nh, nkv, hd


def _inv_freq(config, hd):
    rp = dict(getattr(config, "rope_parameters", None) or {})
    theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if rp.get("rope_type", "default") == "linear":
        inv = inv / rp["factor"]
    return inv


def _windows(config):
    """Per layer: the sliding window (int) or None for full attention."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [config.sliding_window if ty == "sliding_attention" else None for ty in types]


def _rms(x, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)


def _allowed(attention_mask, b, t, window, device):
    """(b, 1, t, t) boolean: causal, inside the window (by index), key not padding."""
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


def _cat_opt(ts):
    return None if any(t is None for t in ts) else torch.cat(ts)


class RMSNorm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight = _p(weight)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.eps) * self.weight


# ------------------------------------------------------------------------------------- litgpt tree (baseline)


class CausalSelfAttention(nn.Module):
    def __init__(self, sd, pre, config, window, per_group):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.window = window
        self.per_group = per_group
        q, k, v = (sd[f"{pre}{n}_proj.weight"] for n in "qkv")
        bq, bk, bv = (sd.get(f"{pre}{n}_proj.bias") for n in "qkv")
        if per_group:
            g = nh // nkv

            def group(a, b_, c):
                return torch.cat(
                    [
                        a.reshape(nkv, g * hd, *a.shape[1:]),
                        b_.reshape(nkv, hd, *b_.shape[1:]),
                        c.reshape(nkv, hd, *c.shape[1:]),
                    ],
                    dim=1,
                ).reshape(-1, *a.shape[1:])

            self.qkv = _linear(group(q, k, v), group(bq, bk, bv) if bq is not None else None)
        else:
            self.qkv = _linear(torch.cat([q, k, v]), _cat_opt([bq, bk, bv]))
        self.norm_q = RMSNorm(sd[pre + "q_norm.weight"], config.rms_norm_eps)
        self.norm_k = RMSNorm(sd[pre + "k_norm.weight"], config.rms_norm_eps)
        self.proj = _linear(sd[pre + "o_proj.weight"], sd.get(pre + "o_proj.bias"))

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        qkv = self.qkv(x)
        if self.per_group:
            qkv = qkv.view(b, t, nkv, nh // nkv + 2, hd)
            q, k, v = qkv.split([nh // nkv, 1, 1], dim=3)
            q, k, v = q.reshape(b, t, nh, hd), k.reshape(b, t, nkv, hd), v.reshape(b, t, nkv, hd)
        else:
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k, v = q.view(b, t, nh, hd), k.view(b, t, nkv, hd), v.view(b, t, nkv, hd)
        q = self.norm_q(q).transpose(1, 2)
        k = self.norm_k(k).transpose(1, 2)
        v = v.transpose(1, 2)

        def apply_rope(z):
            rotated = torch.cat((-z[..., hd // 2 :], z[..., : hd // 2]), dim=-1)
            return z * cos + rotated * sin

        q, k = apply_rope(q), apply_rope(k)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~mask, torch.finfo(att.dtype).min)
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, nh * hd))


class LLaMAMLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.fc_1 = _linear(sd[pre + "gate_proj.weight"], sd.get(pre + "gate_proj.bias"))
        self.fc_2 = _linear(sd[pre + "up_proj.weight"], sd.get(pre + "up_proj.bias"))
        self.proj = _linear(sd[pre + "down_proj.weight"], sd.get(pre + "down_proj.bias"))

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, sd, i, config, window, per_group):
        super().__init__()
        pre = f"model.layers.{i}."
        self.window = window
        self.norm_1 = RMSNorm(sd[pre + "input_layernorm.weight"], config.rms_norm_eps)
        self.attn = CausalSelfAttention(sd, pre + "self_attn.", config, window, per_group)
        self.norm_2 = RMSNorm(sd[pre + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.mlp = LLaMAMLP(sd, pre + "mlp.")

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm_1(x), cos, sin, mask)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, sd, config, per_group=False):
        super().__init__()
        _, _, hd = _dims(config)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False),
                h=nn.ModuleList(Block(sd, i, config, w, per_group) for i, w in enumerate(_windows(config))),
                ln_f=RMSNorm(sd["model.norm.weight"], config.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.transformer.wte.weight
        else:
            with torch.no_grad():
                self.lm_head.weight.copy_(_head_weight(sd, config))
        n = config.max_position_embeddings
        freqs = torch.outer(torch.arange(n).float(), _inv_freq(config, hd))
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.register_buffer("mask_cache", torch.ones(n, n, dtype=torch.bool).tril(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = _positions(input_ids, position_ids)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (b, 1, t, d)
        causal = self.mask_cache[:t, :t][None, None]
        if attention_mask is not None:
            causal = causal & attention_mask.bool()[:, None, None, :]
        i = torch.arange(t, device=input_ids.device)
        x = self.transformer.wte(input_ids)
        for block in self.transformer.h:
            mask = causal
            if block.window is not None:
                mask = mask & (i[:, None] - i[None, :] < block.window)
            x = block(x, cos, sin, mask)
        return self.lm_head(self.transformer.ln_f(x))


# ------------------------------------------------------------------------------------- transposed, kv fused


class XWLayer(nn.Module):
    def __init__(self, sd, i, config, window):
        super().__init__()
        pre = f"model.layers.{i}."
        self.nh, self.nkv, self.hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.window = window
        a = pre + "self_attn."
        self.ln1 = _p(sd[pre + "input_layernorm.weight"])
        self.wq = _p(sd[a + "q_proj.weight"].t())
        self.wkv = _p(torch.cat([sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]).t())
        self.bq = _p(sd[a + "q_proj.bias"]) if a + "q_proj.bias" in sd else None
        self.bkv = _p(torch.cat([sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]])) if a + "k_proj.bias" in sd else None
        self.gq = _p(sd[a + "q_norm.weight"])
        self.gk = _p(sd[a + "k_norm.weight"])
        self.wo = _p(sd[a + "o_proj.weight"].t())
        self.bo = _p(sd[a + "o_proj.bias"]) if a + "o_proj.bias" in sd else None
        self.ln2 = _p(sd[pre + "post_attention_layernorm.weight"])
        self.w_gate = _p(sd[pre + "mlp.gate_proj.weight"].t())
        self.w_up = _p(sd[pre + "mlp.up_proj.weight"].t())
        self.w_down = _p(sd[pre + "mlp.down_proj.weight"].t())

    @staticmethod
    def _aff(x, w, b):
        y = x @ w
        return y if b is None else y + b

    def forward(self, h, cos, sin, attention_mask):
        b, t, _ = h.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = _rms(h, self.eps) * self.ln1
        q = self._aff(x, self.wq, self.bq).view(b, t, nh, hd)
        k, v = self._aff(x, self.wkv, self.bkv).view(b, t, 2, nkv, hd).unbind(2)
        q = _rope_halves(_rms(q, self.eps) * self.gq, cos, sin).transpose(1, 2)
        k = _rope_halves(_rms(k, self.eps) * self.gk, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(hd)
        s = s.masked_fill(~_allowed(attention_mask, b, t, self.window, h.device), torch.finfo(s.dtype).min)
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
        h = h + self._aff(o, self.wo, self.bo)
        x = _rms(h, self.eps) * self.ln2
        return h + (F.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down


class XWQwen3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.embedding = _p(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(XWLayer(sd, i, config, w) for i, w in enumerate(_windows(config)))
        self.final_ln = _p(sd["model.norm.weight"])
        self.unembedding = _p(_head_weight(sd, config).t())
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        h = self.embedding[input_ids]
        for layer in self.layers:
            h = layer(h, cos, sin, attention_mask)
        return (_rms(h, self.eps) * self.final_ln) @ self.unembedding


# --------------------------------------------------------------------------------- scale folded into q_norm


class ScaledQNormAttention(nn.Module):
    def __init__(self, sd, pre, config, window):
        super().__init__()
        self.nh, self.nkv, self.hd = _dims(config)
        self.window = window
        self.eps = config.rms_norm_eps
        self.q_proj = _linear(sd[pre + "q_proj.weight"], sd.get(pre + "q_proj.bias"))
        self.k_proj = _linear(sd[pre + "k_proj.weight"], sd.get(pre + "k_proj.bias"))
        self.v_proj = _linear(sd[pre + "v_proj.weight"], sd.get(pre + "v_proj.bias"))
        self.o_proj = _linear(sd[pre + "o_proj.weight"], sd.get(pre + "o_proj.bias"))
        self.q_norm_scaled = _p(sd[pre + "q_norm.weight"] * self.hd**-0.5)
        self.k_norm = _p(sd[pre + "k_norm.weight"])

    def forward(self, x, cos, sin, pos, attention_mask):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q = F.rms_norm(self.q_proj(x).view(b, t, nh, hd), (hd,), self.q_norm_scaled, self.eps)
        k = F.rms_norm(self.k_proj(x).view(b, t, nkv, hd), (hd,), self.k_norm, self.eps)
        v = self.v_proj(x).view(b, t, nkv, hd)
        q = _rope_halves(q, cos, sin).transpose(1, 2)
        k = _rope_halves(k, cos, sin).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = v.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        dist = pos[:, :, None] - pos[:, None, :]  # (b, t, t) query minus key position
        idx = torch.arange(t, device=x.device)
        ok = idx[None, :, None] >= idx[None, None, :]
        if self.window is not None:
            ok = ok & (dist < self.window)
        if attention_mask is not None:
            ok = ok & attention_mask.bool()[:, None, :]
        ok = ok | torch.eye(t, dtype=torch.bool, device=x.device)  # keep padded query rows finite
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=ok[:, None], scale=1.0)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, nh * hd))


class ScaledQNormLayer(nn.Module):
    def __init__(self, sd, i, config, window):
        super().__init__()
        pre = f"model.layers.{i}."
        self.input_norm = RMSNorm(sd[pre + "input_layernorm.weight"], config.rms_norm_eps)
        self.attention = ScaledQNormAttention(sd, pre + "self_attn.", config, window)
        self.mlp_norm = RMSNorm(sd[pre + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.gate = _linear(sd[pre + "mlp.gate_proj.weight"])
        self.up = _linear(sd[pre + "mlp.up_proj.weight"])
        self.down = _linear(sd[pre + "mlp.down_proj.weight"])

    def forward(self, h, cos, sin, pos, attention_mask):
        h = h + self.attention(self.input_norm(h), cos, sin, pos, attention_mask)
        x = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class ScaledQNormQwen3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.embed = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.layers = nn.ModuleList(ScaledQNormLayer(sd, i, config, w) for i, w in enumerate(_windows(config)))
        self.norm = RMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.head = _linear(_head_weight(sd, config))
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, pos, attention_mask)
        return self.head(self.norm(h))


# ---------------------------------------------------------------------------------------------- heads + einsum


class EinsumLayer(nn.Module):
    def __init__(self, sd, i, config, window):
        super().__init__()
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        H = config.hidden_size
        self.eps = config.rms_norm_eps
        self.window = window
        self.attn_norm = _p(sd[pre + "input_layernorm.weight"])
        self.w_q = _p(sd[a + "q_proj.weight"].reshape(nh, hd, H))
        self.w_k = _p(sd[a + "k_proj.weight"].reshape(nkv, hd, H))
        self.w_v = _p(sd[a + "v_proj.weight"].reshape(nkv, hd, H))
        self.b_q = _p(sd[a + "q_proj.bias"].reshape(nh, hd)) if a + "q_proj.bias" in sd else None
        self.b_k = _p(sd[a + "k_proj.bias"].reshape(nkv, hd)) if a + "k_proj.bias" in sd else None
        self.b_v = _p(sd[a + "v_proj.bias"].reshape(nkv, hd)) if a + "v_proj.bias" in sd else None
        self.w_o = _p(sd[a + "o_proj.weight"].t().reshape(nh, hd, H))
        self.b_o = _p(sd[a + "o_proj.bias"]) if a + "o_proj.bias" in sd else None
        self.q_scale = _p(sd[a + "q_norm.weight"])
        self.k_scale = _p(sd[a + "k_norm.weight"])
        self.mlp_norm = _p(sd[pre + "post_attention_layernorm.weight"])
        self.w_gate = _p(sd[pre + "mlp.gate_proj.weight"])
        self.w_up = _p(sd[pre + "mlp.up_proj.weight"])
        self.w_down = _p(sd[pre + "mlp.down_proj.weight"])

    def forward(self, h, cos, sin, attention_mask):
        b, t, _ = h.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = _rms(h, self.eps) * self.attn_norm
        q = torch.einsum("bth,ndh->btnd", x, self.w_q)
        k = torch.einsum("bth,ndh->btnd", x, self.w_k)
        v = torch.einsum("bth,ndh->btnd", x, self.w_v)
        if self.b_q is not None:
            q, k, v = q + self.b_q, k + self.b_k, v + self.b_v
        q = _rope_halves(_rms(q, self.eps) * self.q_scale, cos, sin).view(b, t, nkv, nh // nkv, hd)
        k = _rope_halves(_rms(k, self.eps) * self.k_scale, cos, sin)
        s = torch.einsum("bqkgd,bskd->bkgqs", q, k) * hd**-0.5
        ok = _allowed(attention_mask, b, t, self.window, h.device)[:, :, None]  # (b, 1, 1, t, t)
        s = s.masked_fill(~ok, torch.finfo(s.dtype).min)
        o = torch.einsum("bkgqs,bskd->bqkgd", s.softmax(-1), v).reshape(b, t, nh, hd)
        y = torch.einsum("btnd,ndh->bth", o, self.w_o)
        h = h + (y if self.b_o is None else y + self.b_o)
        x = _rms(h, self.eps) * self.mlp_norm
        gate = torch.einsum("bth,fh->btf", x, self.w_gate)
        up = torch.einsum("bth,fh->btf", x, self.w_up)
        return h + torch.einsum("btf,hf->bth", F.silu(gate) * up, self.w_down)


class EinsumQwen3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.tok_emb = _p(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(EinsumLayer(sd, i, config, w) for i, w in enumerate(_windows(config)))
        self.out_norm = _p(sd["model.norm.weight"])
        self.tied = getattr(config, "tie_word_embeddings", False)
        if not self.tied:
            self.out_emb = _p(_head_weight(sd, config))
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        ang = torch.einsum("bt,f->btf", pos.float(), self.inv_freq)
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        h = self.tok_emb[input_ids]
        for layer in self.layers:
            h = layer(h, cos, sin, attention_mask)
        h = _rms(h, self.eps) * self.out_norm
        return torch.einsum("bth,vh->btv", h, self.tok_emb if self.tied else self.out_emb)


# ------------------------------------------------------------------------------- vLLM, fused add + RMSNorm


class FusedAddRMSNorm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight = _p(weight)
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        residual = x
        return _rms(x, self.variance_epsilon) * self.weight, residual


class VllmAttention(nn.Module):
    def __init__(self, sd, pre, config, window):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd = _dims(config)
        self.q_size, self.kv_size = nh * hd, nkv * hd
        self.scaling = hd**-0.5
        self.window = window
        q, k, v = (sd[f"{pre}{n}_proj.weight"] for n in "qkv")
        self.qkv_proj = _linear(torch.cat([q, k, v]), _cat_opt([sd.get(f"{pre}{n}_proj.bias") for n in "qkv"]))
        self.o_proj = _linear(sd[pre + "o_proj.weight"], sd.get(pre + "o_proj.bias"))
        self.q_norm = RMSNorm(sd[pre + "q_norm.weight"], config.rms_norm_eps)
        self.k_norm = RMSNorm(sd[pre + "k_norm.weight"], config.rms_norm_eps)

    def forward(self, positions, hidden_states, cos_sin_cache, shape, attention_mask):
        b, t = shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states)  # (num_tokens, q + 2 kv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, nh, hd))
        k = self.k_norm(k.view(-1, nkv, hd))
        cos_sin = cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        q = _rope_halves(q, cos[:, None], sin[:, None])
        k = _rope_halves(k, cos[:, None], sin[:, None])
        q = q.view(b, t, nh, hd).transpose(1, 2)
        k = k.view(b, t, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = v.view(b, t, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        s = s.masked_fill(~_allowed(attention_mask, b, t, self.window, q.device), torch.finfo(s.dtype).min)
        o = torch.matmul(s.softmax(-1), v).transpose(1, 2).reshape(b * t, nh * hd)
        return self.o_proj(o)


class VllmMLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.gate_up_proj = _linear(torch.cat([sd[pre + "gate_proj.weight"], sd[pre + "up_proj.weight"]]))
        self.down_proj = _linear(sd[pre + "down_proj.weight"])

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        d = gate_up.shape[-1] // 2
        return self.down_proj(F.silu(gate_up[..., :d]) * gate_up[..., d:])


class VllmDecoderLayer(nn.Module):
    def __init__(self, sd, i, config, window):
        super().__init__()
        pre = f"model.layers.{i}."
        self.self_attn = VllmAttention(sd, pre + "self_attn.", config, window)
        self.mlp = VllmMLP(sd, pre + "mlp.")
        self.input_layernorm = FusedAddRMSNorm(sd[pre + "input_layernorm.weight"], config.rms_norm_eps)
        self.post_attention_layernorm = FusedAddRMSNorm(
            sd[pre + "post_attention_layernorm.weight"], config.rms_norm_eps
        )

    def forward(self, positions, hidden_states, residual, cos_sin_cache, shape, attention_mask):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, cos_sin_cache, shape, attention_mask)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class VllmQwen3Model(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.embed_tokens = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.layers = nn.ModuleList(VllmDecoderLayer(sd, i, config, w) for i, w in enumerate(_windows(config)))
        self.norm = FusedAddRMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        freqs = torch.einsum("i,j->ij", torch.arange(config.max_position_embeddings).float(), _inv_freq(config, hd))
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, input_ids, positions, attention_mask):
        b, t = input_ids.shape
        hidden_states = self.embed_tokens(input_ids.reshape(-1))
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(
                positions.reshape(-1), hidden_states, residual, self.cos_sin_cache, (b, t), attention_mask
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class VllmQwen3ForCausalLM(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.model = VllmQwen3Model(sd, config)
        self.tied = getattr(config, "tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = _linear(_head_weight(sd, config))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        h = self.model(input_ids, _positions(input_ids, position_ids), attention_mask)
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(h, w).view(b, t, -1)


# --------------------------------------------------------------------------------- stacked, folded RMS gains


class StackedQwen3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.n_layer = L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        lay = [f"model.layers.{i}." for i in range(L)]

        def t(i, n):
            return sd[lay[i] + n]

        qkv, qkv_b, o, o_b, gu, down, qn, kn = [], [], [], [], [], [], [], []
        for i in range(L):
            g1, g2 = t(i, "input_layernorm.weight"), t(i, "post_attention_layernorm.weight")
            w = torch.cat([t(i, f"self_attn.{n}_proj.weight") for n in "qkv"]).t() * g1[:, None]
            qkv.append(w)
            if lay[i] + "self_attn.q_proj.bias" in sd:
                qkv_b.append(torch.cat([t(i, f"self_attn.{n}_proj.bias") for n in "qkv"]))
            o.append(t(i, "self_attn.o_proj.weight").t())
            if lay[i] + "self_attn.o_proj.bias" in sd:
                o_b.append(t(i, "self_attn.o_proj.bias"))
            gu.append(torch.cat([t(i, "mlp.gate_proj.weight"), t(i, "mlp.up_proj.weight")]).t() * g2[:, None])
            down.append(t(i, "mlp.down_proj.weight").t())
            qn.append(t(i, "self_attn.q_norm.weight"))
            kn.append(t(i, "self_attn.k_norm.weight"))
        self.weights = nn.ParameterDict()
        self.weights["qkv"] = _p(torch.stack(qkv))  # (L, hidden, q + 2 kv)
        self.weights["o"] = _p(torch.stack(o))  # (L, q, hidden)
        self.weights["gate_up"] = _p(torch.stack(gu))  # (L, hidden, 2 * inter)
        self.weights["down"] = _p(torch.stack(down))  # (L, inter, hidden)
        self.weights["q_norm"] = _p(torch.stack(qn))
        self.weights["k_norm"] = _p(torch.stack(kn))
        if qkv_b:
            self.weights["qkv_bias"] = _p(torch.stack(qkv_b))
        if o_b:
            self.weights["o_bias"] = _p(torch.stack(o_b))
        self.embedding = _p(sd["model.embed_tokens.weight"])
        self.head = _p((_head_weight(sd, config) * sd["model.norm.weight"][None, :]).t())  # (hidden, vocab)
        wins = _windows(config)
        self.register_buffer("is_sliding", torch.tensor([w is not None for w in wins]), persistent=False)
        self.window = next((w for w in wins if w is not None), 0)
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        pos = _positions(input_ids, position_ids)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        full = _allowed(attention_mask, b, t, None, input_ids.device)
        local = _allowed(attention_mask, b, t, self.window, input_ids.device) if self.window else full
        W = self.weights
        h = self.embedding[input_ids]
        for i in range(self.n_layer):
            y = _rms(h, self.eps) @ W["qkv"][i]
            if "qkv_bias" in W:
                y = y + W["qkv_bias"][i]
            q, k, v = y.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = _rope_halves(_rms(q.view(b, t, nh, hd), self.eps) * W["q_norm"][i], cos, sin).transpose(1, 2)
            k = _rope_halves(_rms(k.view(b, t, nkv, hd), self.eps) * W["k_norm"][i], cos, sin).transpose(1, 2)
            v = v.view(b, t, nkv, hd).transpose(1, 2)
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            s = q @ k.transpose(-1, -2) / math.sqrt(hd)
            ok = local if bool(self.is_sliding[i]) else full
            s = s.masked_fill(~ok, torch.finfo(s.dtype).min)
            a = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd) @ W["o"][i]
            h = h + (a + W["o_bias"][i] if "o_bias" in W else a)
            gate, up = (_rms(h, self.eps) @ W["gate_up"][i]).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ W["down"][i]
        return _rms(h, self.eps) @ self.head


# ------------------------------------------------------------------------------------ Meta rows, complex RoPE


class ComplexAttention(nn.Module):
    def __init__(self, sd, pre, config, window):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd = _dims(config)
        self.window = window
        bq, bk = sd.get(pre + "q_proj.bias"), sd.get(pre + "k_proj.bias")
        self.wq = _linear(
            _to_meta_rows(sd[pre + "q_proj.weight"], nh, hd), _to_meta_rows(bq, nh, hd) if bq is not None else None
        )
        self.wk = _linear(
            _to_meta_rows(sd[pre + "k_proj.weight"], nkv, hd), _to_meta_rows(bk, nkv, hd) if bk is not None else None
        )
        self.wv = _linear(sd[pre + "v_proj.weight"], sd.get(pre + "v_proj.bias"))
        self.wo = _linear(sd[pre + "o_proj.weight"], sd.get(pre + "o_proj.bias"))
        self.q_norm = RMSNorm(_to_meta_gain(sd[pre + "q_norm.weight"]), config.rms_norm_eps)
        self.k_norm = RMSNorm(_to_meta_gain(sd[pre + "k_norm.weight"]), config.rms_norm_eps)

    def forward(self, x, freqs_cis, attention_mask):
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        xq = self.q_norm(self.wq(x).view(b, t, nh, hd))
        xk = self.k_norm(self.wk(x).view(b, t, nkv, hd))
        xv = self.wv(x).view(b, t, nkv, hd)
        xq_ = torch.view_as_complex(xq.float().reshape(b, t, nh, hd // 2, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(b, t, nkv, hd // 2, 2))
        xq = torch.view_as_real(xq_ * freqs_cis).flatten(3).transpose(1, 2)
        xk = torch.view_as_real(xk_ * freqs_cis).flatten(3).transpose(1, 2)
        keys = xk.repeat_interleave(nh // nkv, dim=1)
        values = xv.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(hd)
        add = torch.zeros(b, 1, t, t, device=x.device).masked_fill(
            ~_allowed(attention_mask, b, t, self.window, x.device), float("-inf")
        )
        add = add.masked_fill(
            torch.eye(t, dtype=torch.bool, device=x.device), 0.0
        )  # padded queries keep themselves: no NaN
        scores = F.softmax(scores + add, dim=-1)
        return self.wo(torch.matmul(scores, values).transpose(1, 2).reshape(b, t, nh * hd))


class ComplexBlock(nn.Module):
    def __init__(self, sd, i, config, window):
        super().__init__()
        pre = f"model.layers.{i}."
        self.attention_norm = RMSNorm(sd[pre + "input_layernorm.weight"], config.rms_norm_eps)
        self.attention = ComplexAttention(sd, pre + "self_attn.", config, window)
        self.ffn_norm = RMSNorm(sd[pre + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.w1 = _linear(sd[pre + "mlp.gate_proj.weight"])
        self.w3 = _linear(sd[pre + "mlp.up_proj.weight"])
        self.w2 = _linear(sd[pre + "mlp.down_proj.weight"])

    def forward(self, h, freqs_cis, attention_mask):
        h = h + self.attention(self.attention_norm(h), freqs_cis, attention_mask)
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class ComplexQwen3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.tok_embeddings = nn.Embedding.from_pretrained(
            sd["model.embed_tokens.weight"].float().clone(), freeze=False
        )
        self.layers = nn.ModuleList(ComplexBlock(sd, i, config, w) for i, w in enumerate(_windows(config)))
        self.norm = RMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.output = _linear(_head_weight(sd, config))
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), _inv_freq(config, hd))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        freqs_cis = self.freqs_cis[pos][:, :, None, :]
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, freqs_cis, attention_mask)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------- online softmax, separate head


def _online_softmax_attention(q, k, v, allowed, scale, block=4):
    """q (b, h, t, d), k/v (b, h, s, d), allowed (b, 1, t, s): softmax(q k^T * scale) v, one key block at a time."""
    neg = torch.finfo(q.dtype).min
    m = torch.full(q.shape[:-1] + (1,), neg, device=q.device)
    denom = torch.zeros(q.shape[:-1] + (1,), device=q.device)
    acc = torch.zeros_like(q)
    for start in range(0, k.shape[2], block):
        kb, vb = k[:, :, start : start + block], v[:, :, start : start + block]
        s = (q @ kb.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[..., start : start + block], neg)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        corr = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        denom = denom * corr + p.sum(-1, keepdim=True)
        acc = acc * corr + p @ vb
        m = m_new
    return acc / denom


class FlashStyleLayer(nn.Module):
    def __init__(self, sd, i, config, window):
        super().__init__()
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        self.nh, self.nkv, self.hd = _dims(config)
        self.eps = config.rms_norm_eps
        self.window = window
        self.ln_1 = RMSNorm(sd[pre + "input_layernorm.weight"], self.eps)
        self.c_q = _linear(sd[a + "q_proj.weight"], sd.get(a + "q_proj.bias"))
        self.c_k = _linear(sd[a + "k_proj.weight"], sd.get(a + "k_proj.bias"))
        self.c_v = _linear(sd[a + "v_proj.weight"], sd.get(a + "v_proj.bias"))
        self.q_ln = _p(sd[a + "q_norm.weight"])
        self.k_ln = _p(sd[a + "k_norm.weight"])
        self.c_proj = _linear(sd[a + "o_proj.weight"], sd.get(a + "o_proj.bias"))
        self.ln_2 = RMSNorm(sd[pre + "post_attention_layernorm.weight"], self.eps)
        self.c_gate = _linear(sd[pre + "mlp.gate_proj.weight"])
        self.c_fc = _linear(sd[pre + "mlp.up_proj.weight"])
        self.c_down = _linear(sd[pre + "mlp.down_proj.weight"])

    def forward(self, h, cos, sin, attention_mask):
        b, t, _ = h.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = self.ln_1(h)
        q = F.rms_norm(self.c_q(x).view(b, t, nh, hd), (hd,), self.q_ln, self.eps)
        k = F.rms_norm(self.c_k(x).view(b, t, nkv, hd), (hd,), self.k_ln, self.eps)
        v = self.c_v(x).view(b, t, nkv, hd)
        q = _rope_halves(q, cos, sin).transpose(1, 2)
        k = _rope_halves(k, cos, sin).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = v.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        ok = _allowed(attention_mask, b, t, self.window, h.device)
        o = _online_softmax_attention(q, k, v, ok, hd**-0.5)
        h = h + self.c_proj(o.transpose(1, 2).reshape(b, t, nh * hd))
        x = self.ln_2(h)
        return h + self.c_down(F.silu(self.c_gate(x)) * self.c_fc(x))


class FlashStyleBackbone(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        _, _, hd = _dims(config)
        self.wte = nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"].float().clone(), freeze=False)
        self.h = nn.ModuleList(FlashStyleLayer(sd, i, config, w) for i, w in enumerate(_windows(config)))
        self.ln_f = RMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        self.register_buffer("inv_freq", _inv_freq(config, hd), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        pos = _positions(input_ids, position_ids)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        h = self.wte(input_ids)
        for layer in self.h:
            h = layer(h, cos, sin, attention_mask)
        return self.ln_f(h)


class TiedHead(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding  # shares the embedding module (and its weight)

    def forward(self, h):
        return h @ self.embedding.weight.t()


class FlashStyleQwen3(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.backbone = FlashStyleBackbone(sd, config)
        if getattr(config, "tie_word_embeddings", False):
            self.head = TiedHead(self.backbone.wte)
        else:
            self.head = _linear(_head_weight(sd, config))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.backbone(input_ids, attention_mask, position_ids))


# --------------------------------------------------------------------------------------------------- build


def build(state_dict, config):
    sd = {k: v.float() for k, v in state_dict.items()}
    variant = BUG
    if variant == "":
        model = GPT(sd, config)
    elif variant == "qwen3_qkv_per_group":
        model = GPT(sd, config, per_group=True)
    elif variant == "qwen3_transposed_kv_fused":
        model = XWQwen3(sd, config)
    elif variant == "qwen3_scale_in_qnorm":
        model = ScaledQNormQwen3(sd, config)
    elif variant == "qwen3_heads_einsum":
        model = EinsumQwen3(sd, config)
    elif variant == "qwen3_vllm_fused_residual":
        model = VllmQwen3ForCausalLM(sd, config)
    elif variant == "qwen3_stacked_folded":
        model = StackedQwen3(sd, config)
    elif variant == "qwen3_meta_complex_rope":
        model = ComplexQwen3(sd, config)
    elif variant == "qwen3_online_softmax":
        model = FlashStyleQwen3(sd, config)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return model.eval()
