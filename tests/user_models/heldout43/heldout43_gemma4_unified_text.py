"""Hand-written PyTorch port of Gemma 4 "unified" text decoder (HF ``Gemma4UnifiedForCausalLM``,
model_type ``gemma4_unified_text``), written from the maths, no ``transformers`` import.

Architecture as implemented here
--------------------------------
Notation: B batch, S sequence, D = hidden_size, H = num_attention_heads, L = num_hidden_layers.
Every layer has a *type*, ``config.layer_types[l]`` in {"sliding_attention", "full_attention"}:

* sliding layers: head dim ``d = head_dim``, ``Hk = num_key_value_heads`` key/value heads, separate K and V
  projections, keys may only look back ``sliding_window`` tokens (``i - W < j <= i``, indices in the row).
* full layers: head dim ``d = global_head_dim``, ``Hk = num_global_key_value_heads`` when
  ``attention_k_eq_v`` (else ``num_key_value_heads``); with ``attention_k_eq_v`` there is NO value projection:
  the values are the raw key projection (before k-norm and RoPE), normalised by a gain-free RMSNorm.
  Plain causal mask ``j <= i``.

Embedding:  ``h0 = E[ids] * sqrt(D)``  (E is (V, D); the scale is the float32 constant sqrt(D)).

RMSNorm (every norm of this model):  ``rms(x; g) = x * (mean(x^2, -1) + eps)^(-1/2) * g``
-- the gain multiplies DIRECTLY (no ``1 + g`` offset as in Gemma 1-3); eps = ``rms_norm_eps``;
``rms(x)`` without gain for the value norm.

Decoder layer l (sandwich norms, four gains per layer)::

    a   = rms(x; g_in)
    q   = rope(rms(a Wq -> (B,S,H,d); g_q))                    per-head q-norm, then RoPE
    k   = rope(rms(a Wk -> (B,S,Hk,d); g_k))                   (producer layers only)
    v   = rms(a Wv -> (B,S,Hk,d))   or rms(a Wk ...) (k_eq_v)   gain-free value norm
    o   = softmax(q k^T * 1.0 + mask) v                         scale is 1.0 (q/k are RMS-normalised)
          GQA: query head h reads kv head h // (H / Hk)  (repeat_interleave)
    x   = x + rms(o Wo; g_post_attn)
    x   = x + rms(W_down(gelu_tanh(a2 W_gate) * (a2 W_up)); g_post_ffn),   a2 = rms(x; g_pre_ffn)
    x   = x * layer_scalar                                      (a per-layer scalar buffer, 1 here)

KV sharing (``num_kv_shared_layers = n``): the last n layers compute NO keys/values; a layer l >= L - n of
type t attends over the keys/values (already normed and rotated) produced by the last layer < L - n of the
same type t (here layer 2 reuses layer 0's, layer 3 reuses layer 1's). The query is still the consumer's own
(own q projection, q-norm and RoPE at its own positions).
``use_double_wide_mlp``: those KV-consuming layers have an MLP of width ``2 * intermediate_size``.

RoPE (rotate-half pairing: dim i pairs with dim i + d/2, angles ``pos * inv_freq[i]``, i < d/2)::

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)

* sliding layers: "default" RoPE, ``inv_freq[i] = theta_s^(-2i/d)``, theta_s = 10_000.
* full layers: "proportional" RoPE, ``r = int(partial_rotary_factor * d // 2)`` rotated frequencies,
  ``inv_freq[i] = theta_f^(-2i/d)`` for i < r (denominator is the FULL head dim d), 0 for i >= r, so the
  rotated dims are {0..r-1} U {d/2..d/2+r-1} and the rest pass through; theta_f = 1_000_000.
  (here d = 32, r = 4.)
Positions are ``position_ids`` when given (left padding: counted over real tokens), else 0..S-1.

Masks: additive, 0 where allowed and float32 min elsewhere (never -inf: fully-masked padding query rows
become uniform instead of NaN). Allowed = causal (index j <= i) AND key not padding (attention_mask[b, j] == 1)
AND, on sliding layers, j > i - sliding_window. Text-only input: no bidirectional (vision) blocks.

Head: ``y = rms(x_L; g_final)``, ``logits = y E^T`` (tied to the embedding), then final-logit softcapping
``c * tanh(logits / c)`` with c = ``final_logit_softcapping``.

Weight layout of this port (own names; converted in ``build``)
----------------------------------------------------------------
``Gemma4Port``:
  ``embedding``           (V, D)      token table (also the output head, tied)
  ``final_gain``          (D,)
  ``blocks[l]`` (``PortBlock``):
     ``w_qkv``            (D, Nq + Nk [+ Nv])  TRANSPOSED fused projection: columns [q | k | v];
                           k_eq_v full layers have [q | k]; KV-consuming layers only [q]
     ``w_o``              (H*d, D)    transposed output projection
     ``w_ffn_in``         (D, 2*I_l)  transposed fused [gate | up]
     ``w_ffn_out``        (I_l, D)    transposed down projection
     ``gains``            (4, D)      stacked [input, post_attention, pre_feedforward, post_feedforward]
     ``head_gains``       (2, d) = [q_norm, k_norm] gains   (1, d) = [q_norm] on KV-consuming layers
     ``layer_scalar``     (1,) buffer
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "norm_plus_one",  # every RMSNorm scales by (1 + g), the Gemma 1-3 convention, instead of g
    "attn_scale_rsqrt",  # attention logits scaled by d**-0.5 although Gemma 4 uses scale 1.0 (qk-norm)
    "v_uses_k_norm",  # k_eq_v values taken after k_norm (with the k gain) instead of the gain-free v-norm
    "rope_rot_denominator",  # proportional RoPE exponents divided by the rotated dim 2r instead of the head dim d
    "rope_partial_contiguous",  # partial RoPE rotates the first 2r dims (pairs i, i+r) instead of {0..r-1}U{d/2..}
    "rope_single_theta",  # full-attention layers use the sliding layers' rope_theta (10k) instead of 1M
    "window_off_by_one",  # sliding window admits j >= i - W (W + 1 keys) instead of j > i - W
    "gate_up_swapped",  # fused [gate|up] split in the wrong order: gelu applied to the up half
    "no_embed_scale",  # embeddings not multiplied by sqrt(hidden_size)
    "post_attn_norm_after_residual",  # post-attention norm applied to (x + attn) instead of attn alone
    "gqa_tiled",  # kv heads tiled (h % Hk) instead of repeat_interleave (h // (H/Hk))
    "kv_share_weights",  # KV-shared layers re-project their OWN input with the producer's K/V weights
    "sliding_no_pad_mask",  # padding mask dropped on sliding-window layers (only causal+window)
    "pad_mask_on_queries",  # padding mask broadcast over the query axis instead of the key axis
]
PADDING_ONLY = ["sliding_no_pad_mask", "pad_mask_on_queries"]
CLEAN = [
    "rope_complex",  # RoPE as complex multiplication of (x_i + i x_{i+d/2}) by exp(i pos f)
    "sdpa",  # torch scaled_dot_product_attention with the same additive mask and scale=1
    "online_softmax",  # attention over key blocks of 5 with a running max / running sum (flash-style)
    "fold_norm_gains",  # input / pre-FFN norm gains folded into the rows of w_qkv / w_ffn_in at build time
    "fold_embed_scale",  # sqrt(D) folded into a separate input embedding table; the head keeps the raw table
]


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
def rms_norm(x, gain, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if gain is None:
        return y
    if BUG == "norm_plus_one":
        return y * (1.0 + gain)
    return y * gain


def inverse_frequencies(layer_type, head_dim, rope_params, fallback_params):
    """inv_freq of length head_dim // 2 (zeros where a proportional RoPE leaves dims un-rotated)."""
    params = rope_params
    if BUG == "rope_single_theta" and layer_type == "full_attention":
        params = dict(params, rope_theta=fallback_params["rope_theta"])
    theta = float(params["rope_theta"])
    half = head_dim // 2
    if params.get("rope_type", "default") == "proportional":
        r = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        denom = 2 * r if BUG == "rope_rot_denominator" else head_dim
        rot = theta ** (-torch.arange(0, r, dtype=torch.float64) * 2.0 / denom)
        inv = torch.cat([rot, torch.zeros(half - r, dtype=torch.float64)])
        return inv.float(), r
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / head_dim)
    return inv.float(), half


def apply_rope(x, angles, n_rot):
    """x: (B, S, h, d); angles: (B, S, d/2) = pos * inv_freq. Rotate-half pairing (i, i + d/2)."""
    d = x.shape[-1]
    half = d // 2
    if BUG == "rope_partial_contiguous" and n_rot < half:
        # rotate the first 2r dims as one block (pairs i, i + r), pass the rest
        xr, rest = x[..., : 2 * n_rot], x[..., 2 * n_rot :]
        a = angles[..., :n_rot].unsqueeze(2)
        c, s = a.cos(), a.sin()
        x1, x2 = xr[..., :n_rot], xr[..., n_rot:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    a = angles.unsqueeze(2)
    if BUG == "rope_complex":
        z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(a), a)
        return torch.cat([z.real, z.imag], dim=-1)
    c, s = a.cos(), a.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def expand_kv(t, n_rep):
    """(B, Hk, S, d) -> (B, Hk * n_rep, S, d)."""
    if n_rep == 1:
        return t
    if BUG == "gqa_tiled":
        return t.repeat(1, n_rep, 1, 1)
    return t.repeat_interleave(n_rep, dim=1)


def attention(q, k, v, mask, scale):
    """q (B,H,S,d), k/v (B,H,S,d) after GQA expansion, mask additive (B,1,S,S)."""
    if BUG == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if BUG == "online_softmax":
        S = k.shape[-2]
        m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        l = torch.zeros(q.shape[:-1], dtype=q.dtype)
        acc = torch.zeros_like(q)
        for j0 in range(0, S, 5):
            j1 = min(S, j0 + 5)
            s = q @ k[..., j0:j1, :].transpose(-1, -2) * scale + mask[..., j0:j1]
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new.unsqueeze(-1))
            corr = torch.exp(m - m_new)
            l = l * corr + p.sum(-1)
            acc = acc * corr.unsqueeze(-1) + p @ v[..., j0:j1, :]
            m = m_new
        return acc / l.unsqueeze(-1)
    w = q @ k.transpose(-1, -2) * scale + mask
    w = torch.softmax(w, dim=-1)
    return w @ v


# ----------------------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------------------
class PortBlock(nn.Module):
    def __init__(
        self, layer_type, n_heads, n_kv, head_dim, k_eq_v, produces_kv, source, ffn_width, hidden, eps, sliding_window
    ):
        super().__init__()
        self.layer_type = layer_type
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.k_eq_v = k_eq_v
        self.produces_kv = produces_kv
        self.source = source  # index of the layer whose K/V this one reads (itself if it produces)
        self.eps = eps
        self.sliding_window = sliding_window if layer_type == "sliding_attention" else None
        n_q = n_heads * head_dim
        n_k = n_kv * head_dim
        width = n_q + ((n_k if k_eq_v else 2 * n_k) if produces_kv else 0)
        self.w_qkv = nn.Parameter(torch.zeros(hidden, width))
        self.w_o = nn.Parameter(torch.zeros(n_q, hidden))
        self.w_ffn_in = nn.Parameter(torch.zeros(hidden, 2 * ffn_width))
        self.w_ffn_out = nn.Parameter(torch.zeros(ffn_width, hidden))
        self.gains = nn.Parameter(torch.ones(4, hidden))
        self.head_gains = nn.Parameter(torch.ones(2 if produces_kv else 1, head_dim))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.ffn_width = ffn_width

    def project_kv(self, a, angles, n_rot):
        """Keys/values of this (producer) layer from normed input a: returns (B, Hk, S, d) each."""
        B, S, _ = a.shape
        n_q = self.n_heads * self.head_dim
        n_k = self.n_kv * self.head_dim
        kv = a @ self.w_qkv[:, n_q:]
        k_raw = kv[..., :n_k].view(B, S, self.n_kv, self.head_dim)
        if self.k_eq_v:
            v_raw = k_raw
        else:
            v_raw = kv[..., n_k:].view(B, S, self.n_kv, self.head_dim)
        k = rms_norm(k_raw, self.head_gains[1], self.eps)
        if BUG == "v_uses_k_norm" and self.k_eq_v:
            v = k
        else:
            v = rms_norm(v_raw, None, self.eps)
        k = apply_rope(k, angles, n_rot)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, angles, n_rot, mask, shared, blocks):
        B, S, _ = x.shape
        g_in, g_post_attn, g_pre_ffn, g_post_ffn = self.gains
        a = rms_norm(x, g_in, self.eps)
        n_q = self.n_heads * self.head_dim
        q = (a @ self.w_qkv[:, :n_q]).view(B, S, self.n_heads, self.head_dim)
        q = apply_rope(rms_norm(q, self.head_gains[0], self.eps), angles, n_rot).transpose(1, 2)
        if self.produces_kv:
            k, v = self.project_kv(a, angles, n_rot)
            shared[self.layer_type] = (k, v)
        elif BUG == "kv_share_weights":
            k, v = blocks[self.source].project_kv(a, angles, n_rot)
        else:
            k, v = shared[self.layer_type]
        n_rep = self.n_heads // k.shape[1]
        scale = self.head_dim**-0.5 if BUG == "attn_scale_rsqrt" else 1.0
        o = attention(q, expand_kv(k, n_rep), expand_kv(v, n_rep), mask, scale)
        o = o.transpose(1, 2).reshape(B, S, n_q) @ self.w_o
        if BUG == "post_attn_norm_after_residual":
            x = rms_norm(x + o, g_post_attn, self.eps)
        else:
            x = x + rms_norm(o, g_post_attn, self.eps)

        a2 = rms_norm(x, g_pre_ffn, self.eps)
        gu = a2 @ self.w_ffn_in
        if BUG == "gate_up_swapped":
            up, gate = gu.split(self.ffn_width, dim=-1)
        else:
            gate, up = gu.split(self.ffn_width, dim=-1)
        m = (F.gelu(gate, approximate="tanh") * up) @ self.w_ffn_out
        x = x + rms_norm(m, g_post_ffn, self.eps)
        return x * self.layer_scalar


class Gemma4Port(nn.Module):
    def __init__(self, config, ffn_widths, kv_heads_by_type, head_dim_by_type):
        super().__init__()
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.layer_types = list(config.layer_types)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.rope_params = config.rope_parameters
        self.head_dim_by_type = head_dim_by_type
        L = config.num_hidden_layers
        n_shared = getattr(config, "num_kv_shared_layers", 0) or 0
        first_shared = L - n_shared
        last_of_type = {}
        for i in range(first_shared):
            last_of_type[self.layer_types[i]] = i
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
        blocks = []
        for i, t in enumerate(self.layer_types):
            produces = i < first_shared
            blocks.append(
                PortBlock(
                    t,
                    config.num_attention_heads,
                    kv_heads_by_type[t],
                    head_dim_by_type[t],
                    k_eq_v and t == "full_attention",
                    produces,
                    i if produces else last_of_type[t],
                    ffn_widths[i],
                    config.hidden_size,
                    config.rms_norm_eps,
                    config.sliding_window,
                )
            )
        self.blocks = nn.ModuleList(blocks)
        self.embedding = nn.Parameter(torch.zeros(config.vocab_size, config.hidden_size))
        self.final_gain = nn.Parameter(torch.ones(config.hidden_size))
        self.embed_in = None  # set by build for the folded-scale variant
        self.head = None  # an untied output matrix (V, D) when the checkpoint has one

    def _rope_angles(self, position_ids):
        out = {}
        for t in set(self.layer_types):
            inv, n_rot = inverse_frequencies(
                t, self.head_dim_by_type[t], self.rope_params[t], self.rope_params["sliding_attention"]
            )
            out[t] = (position_ids.float().unsqueeze(-1) * inv, n_rot)
        return out

    def _masks(self, B, S, attention_mask):
        i = torch.arange(S).view(S, 1)
        j = torch.arange(S).view(1, S)
        causal = (j <= i).view(1, 1, S, S).expand(B, 1, S, S)
        if attention_mask is None:
            pad = torch.ones(B, S, dtype=torch.bool)
        else:
            pad = attention_mask.bool()
        if BUG == "pad_mask_on_queries":
            pad_b = pad.view(B, 1, S, 1)
        else:
            pad_b = pad.view(B, 1, 1, S)
        masks = {}
        for t in set(self.layer_types):
            allowed = causal & pad_b
            if t == "sliding_attention":
                W = self.blocks[self.layer_types.index(t)].sliding_window
                win = (j >= i - W) if BUG == "window_off_by_one" else (j > i - W)
                allowed = causal & win.view(1, 1, S, S)
                if BUG != "sliding_no_pad_mask":
                    allowed = allowed & pad_b
            neg = torch.finfo(torch.float32).min
            masks[t] = torch.zeros(B, 1, S, S).masked_fill(~allowed, neg)
        return masks

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
        if self.embed_in is not None:
            x = self.embed_in[input_ids]
        else:
            x = self.embedding[input_ids]
            if BUG != "no_embed_scale":
                x = x * torch.tensor(math.sqrt(self.hidden), dtype=torch.float32)
        angles = self._rope_angles(position_ids)
        masks = self._masks(B, S, attention_mask)
        shared = {}
        for blk in self.blocks:
            ang, n_rot = angles[blk.layer_type]
            x = blk(x, ang, n_rot, masks[blk.layer_type], shared, self.blocks)
        y = rms_norm(x, self.final_gain, self.eps)
        logits = y @ (self.embedding if self.head is None else self.head).t()
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


# ----------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------
def _strip(sd):
    out = {}
    for k, v in sd.items():
        out[k[len("model.") :] if k.startswith("model.") else k] = v
    return out


def build(state_dict, config):
    sd = {k: v.float() for k, v in _strip(state_dict).items()}
    L = config.num_hidden_layers
    # head_dim / num_key_value_heads differ per layer type (the config holds them per layer), so read them
    # off the weights of the first KV-producing layer of each type
    head_dim_by_type, kv_heads_by_type = {}, {}
    for i, t in enumerate(config.layer_types):
        kp = sd.get(f"layers.{i}.self_attn.k_proj.weight")
        if t in head_dim_by_type or kp is None:
            continue
        d = sd[f"layers.{i}.self_attn.q_norm.weight"].shape[0]
        head_dim_by_type[t] = d
        kv_heads_by_type[t] = kp.shape[0] // d
    ffn_widths = [sd[f"layers.{i}.mlp.gate_proj.weight"].shape[0] for i in range(L)]
    model = Gemma4Port(config, ffn_widths, kv_heads_by_type, head_dim_by_type)
    with torch.no_grad():
        model.embedding.copy_(sd["embed_tokens.weight"])
        model.final_gain.copy_(sd["norm.weight"])
        head = sd.get("lm_head.weight")
        if (
            head is not None
            and not getattr(config, "tie_word_embeddings", True)
            and not torch.equal(head, sd["embed_tokens.weight"])
        ):
            model.head = nn.Parameter(head.clone())
        for i, blk in enumerate(model.blocks):
            p = f"layers.{i}."
            mats = [sd[p + "self_attn.q_proj.weight"]]
            gains = [sd[p + "self_attn.q_norm.weight"]]
            if blk.produces_kv:
                mats.append(sd[p + "self_attn.k_proj.weight"])
                if not blk.k_eq_v:
                    mats.append(sd[p + "self_attn.v_proj.weight"])
                gains.append(sd[p + "self_attn.k_norm.weight"])
            w_qkv = torch.cat(mats, 0).t().contiguous()
            w_in = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], 0).t().contiguous()
            g = torch.stack(
                [
                    sd[p + n + ".weight"]
                    for n in (
                        "input_layernorm",
                        "post_attention_layernorm",
                        "pre_feedforward_layernorm",
                        "post_feedforward_layernorm",
                    )
                ]
            )
            if BUG == "fold_norm_gains":
                w_qkv = w_qkv * g[0].unsqueeze(1)
                w_in = w_in * g[2].unsqueeze(1)
                g[0] = 1.0
                g[2] = 1.0
            blk.w_qkv.copy_(w_qkv)
            blk.w_o.copy_(sd[p + "self_attn.o_proj.weight"].t())
            blk.w_ffn_in.copy_(w_in)
            blk.w_ffn_out.copy_(sd[p + "mlp.down_proj.weight"].t())
            blk.gains.copy_(g)
            blk.head_gains.copy_(torch.stack(gains))
            if p + "layer_scalar" in sd:
                blk.layer_scalar.copy_(sd[p + "layer_scalar"].reshape(1))
        if BUG == "fold_embed_scale":
            model.embed_in = nn.Parameter(sd["embed_tokens.weight"] * math.sqrt(config.hidden_size))
    return model.float().eval()
