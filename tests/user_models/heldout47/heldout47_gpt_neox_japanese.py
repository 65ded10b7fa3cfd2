"""A hand-written PyTorch port of GPT-NeoX-Japanese (``GPTNeoXJapaneseForCausalLM``), float32, no cache.

Architecture (B batch, S sequence, H hidden, nh heads, d = H / nh head size, r = int(d * partial_rotary_factor)
rotary dims, I = H * intermediate_multiple_size, L layers, V vocab):

    x_0 = E[input_ids]                                              (B, S, H)
    for each layer l (sequential residual, pre-LayerNorm):
        a   = LN(x; g1_l, b1_l)                  LN(x) = (x - mean) / sqrt(var_biased + eps) * g + b
        q, k, v = split(a @ Wqkv_l)              each (B, nh, S, d)
        q[..., :r], k[..., :r] = RoPE(.)         NeoX "rotate half" RoPE on the first r dims only:
                                                 inv_freq_j = theta ** (-2j / r), j < r/2
                                                 ang = pos * inv_freq, cos/sin = cat(ang, ang)
                                                 x_rot = x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1]
        p   = softmax(q k^T / sqrt(d) + mask)    mask: causal, and key padding (0 in attention_mask),
                                                 additive finfo.min (a fully masked row becomes uniform)
        o   = merge_heads(p v) @ Wo_l + bo_l     bo_l = 0 except for the LAST layer (its ``dense_bias``)
        x   = x + o
        x   = x + gelu_erf(LN(x; g2_l, b2_l) @ W1_l) @ W2_l
    logits = LN(x; gf, bf) @ E^T                 (tied head; a separate embed_out is used when not tied)

Weight layout (mine, not Transformers'): all per-layer tensors are STACKED over layers, matrices stored
transposed (in -> out), and the fused QKV columns re-ordered from the checkpoint's per-head interleaving
[head, (q, k, v), d] to blocks [q heads | k heads | v heads]:

    wte      (V, H)             token embedding (also the head when tied)
    head     (V, H)             only when the embeddings are not tied
    ln       (L, 2, 2, H)       [layer, {input_ln, post_attention_ln}, {weight, bias}]
    ln_f     (2, H)             final LayerNorm {weight, bias}
    w_qkv    (L, H, 3H)         in -> out, columns [q (nh*d) | k (nh*d) | v (nh*d)], head-major inside each block
    w_o      (L, H, H)          in -> out
    b_o      (L, H)             attention output bias, zeros except the last layer
    w_in     (L, H, I)          MLP up (dense_h_to_4h), in -> out
    w_out    (L, I, H)          MLP down (dense_4h_to_h), in -> out
    inv_freq (r/2,)             buffer
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qkv_split_blocked",  # loader: treats fused query_key_value rows as [Q|K|V] blocks, not per-head interleaved (h, 3, d)
    "rope_interleaved",  # RoPE rotates adjacent pairs (GPT-J rotate_every_two) instead of NeoX rotate_half
    "rope_freq_head_dim",  # inv_freq exponent divides by the full head size d instead of the rotary dims r
    "rope_bf16_angles",  # positions * inv_freq computed in bfloat16 (the cast placed before the product)
    "score_scale_rotary",  # attention scores scaled by 1/sqrt(rotary_ndims) instead of 1/sqrt(head_size)
    "dense_bias_dropped",  # loader looks for attention.dense.bias, silently skips the last layer's dense_bias
    "parallel_residual",  # GPT-NeoX's use_parallel_residual carried over: x + attn(ln1 x) + mlp(ln2 x)
    "ln_unbiased_var",  # hand-written LayerNorm uses torch.var's unbiased (N-1) variance
    "gelu_quick",  # hidden_act "gelu" mapped to quick_gelu x*sigmoid(1.702x) instead of exact erf GELU
    "pad_mask_query_axis",  # padding mask broadcast over the query axis (B,1,S,1) instead of the key axis
    "causal_diag_masked",  # causal mask built with triu(diagonal=0): a token cannot attend to itself
    "merge_heads_no_permute",  # (B, nh, S, d) output reshaped to (B, S, H) without moving heads after seq
    "softmax_query_axis",  # attention softmax taken over the query axis (dim=-2) instead of the keys
    "residual_from_ln",  # residual branch taken from the LayerNorm output (Bloom post-LN residual) not its input
]

PADDING_ONLY = ["pad_mask_query_axis"]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on column slices of the fused weight
    "rope_complex",  # RoPE as complex multiplication of (x1 + i x2) by exp(i * angle)
    "rope_table",  # cos/sin precomputed for max_position_embeddings and gathered by position_ids
    "sdpa",  # F.scaled_dot_product_attention with the same additive float mask
    "layernorm_functional",  # F.layer_norm instead of the hand-written mean / biased variance
]


def _bug():
    return BUG


def _layer_norm(x, w, b, eps):
    bug = _bug()
    if bug == "layernorm_functional":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    if bug == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (xc * xc).mean(-1, keepdim=True)
    return xc * torch.rsqrt(var + eps) * w + b


def _gelu(x):
    if _bug() == "gelu_quick":
        return x * torch.sigmoid(1.702 * x)
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_every_two(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class NeoXJapanesePort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.vocab = config.vocab_size
        self.hidden = config.hidden_size
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.head_size = self.hidden // self.n_heads
        rope = dict(config.rope_parameters or {})
        self.theta = float(rope.get("rope_theta", 10000.0))
        self.rotary_factor = float(rope.get("partial_rotary_factor", 1.0))
        self.rot = int(self.head_size * self.rotary_factor)
        self.inter = int(self.hidden * config.intermediate_multiple_size)
        self.eps = config.layer_norm_eps
        self.max_pos = config.max_position_embeddings
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        L, H, I, V = self.n_layers, self.hidden, self.inter, self.vocab

        self.wte = nn.Parameter(torch.zeros(V, H))
        self.head = None if self.tied else nn.Parameter(torch.zeros(V, H))
        self.ln = nn.Parameter(torch.zeros(L, 2, 2, H))
        self.ln_f = nn.Parameter(torch.zeros(2, H))
        self.w_qkv = nn.Parameter(torch.zeros(L, H, 3 * H))
        self.w_o = nn.Parameter(torch.zeros(L, H, H))
        self.b_o = nn.Parameter(torch.zeros(L, H))
        self.w_in = nn.Parameter(torch.zeros(L, H, I))
        self.w_out = nn.Parameter(torch.zeros(L, I, H))

    # ---------------------------------------------------------------- rotary
    def _inv_freq(self):
        denom = self.head_size if _bug() == "rope_freq_head_dim" else self.rot
        return 1.0 / (self.theta ** (torch.arange(0, self.rot, 2, dtype=torch.float32) / denom))

    def _cos_sin(self, position_ids, device):
        inv_freq = self._inv_freq().to(device)
        bug = _bug()
        if bug == "rope_table":
            t = torch.arange(self.max_pos, dtype=torch.float32, device=device)
            ang = torch.outer(t, inv_freq)
            ang = torch.cat((ang, ang), dim=-1)
            cos_t, sin_t = ang.cos(), ang.sin()
            return cos_t[position_ids], sin_t[position_ids]
        if bug == "rope_bf16_angles":
            ang = (position_ids.to(torch.bfloat16)[..., None] * inv_freq.to(torch.bfloat16)).float()
        else:
            ang = position_ids[..., None].float() * inv_freq
        ang = torch.cat((ang, ang), dim=-1)  # (B, S, r)
        return ang.cos(), ang.sin()

    def _apply_rope(self, x, cos, sin):
        # x: (B, nh, S, d); cos/sin: (B, S, r)
        r = self.rot
        x_rot, x_pass = x[..., :r], x[..., r:]
        cos = cos[:, None]
        sin = sin[:, None]
        bug = _bug()
        if bug == "rope_complex":
            h = r // 2
            z = torch.complex(x_rot[..., :h], x_rot[..., h:])
            w = torch.complex(cos[..., :h], sin[..., :h])
            zr = z * w
            x_rot = torch.cat((zr.real, zr.imag), dim=-1)
        elif bug == "rope_interleaved":
            x_rot = x_rot * cos + _rotate_every_two(x_rot) * sin
        else:
            x_rot = x_rot * cos + _rotate_half(x_rot) * sin
        return torch.cat((x_rot, x_pass), dim=-1)

    # ---------------------------------------------------------------- mask
    def _mask(self, attention_mask, B, S, device):
        bug = _bug()
        neg = torch.finfo(torch.float32).min
        diag = 0 if bug == "causal_diag_masked" else 1
        blocked = torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), diagonal=diag)
        blocked = blocked[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            pad = attention_mask.to(device) == 0
            if bug == "pad_mask_query_axis":
                blocked = blocked | pad[:, None, :, None]
            else:
                blocked = blocked | pad[:, None, None, :]
        return torch.zeros(B, 1, S, S, device=device).masked_fill(blocked, neg)

    # ---------------------------------------------------------------- attention
    def _attention(self, a, l, cos, sin, mask):
        B, S, H = a.shape
        nh, d = self.n_heads, self.head_size
        bug = _bug()
        if bug == "split_qkv":
            w = self.w_qkv[l]
            q = a @ w[:, :H]
            k = a @ w[:, H : 2 * H]
            v = a @ w[:, 2 * H :]
        else:
            q, k, v = (a @ self.w_qkv[l]).split(H, dim=-1)
        q, k, v = (t.view(B, S, nh, d).transpose(1, 2) for t in (q, k, v))
        q = self._apply_rope(q, cos, sin)
        k = self._apply_rope(k, cos, sin)

        if bug == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))
        else:
            scale_dim = self.rot if bug == "score_scale_rotary" else d
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(scale_dim) + mask
            p = torch.softmax(scores, dim=-2 if bug == "softmax_query_axis" else -1)
            o = p @ v  # (B, nh, S, d)
        if bug == "merge_heads_no_permute":
            o = o.reshape(B, S, H)
        else:
            o = o.transpose(1, 2).reshape(B, S, H)
        return o @ self.w_o[l] + self.b_o[l]

    def _mlp(self, h, l):
        return _gelu(h @ self.w_in[l]) @ self.w_out[l]

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=device)[None].expand(B, S)
        elif position_ids.shape[0] != B:
            position_ids = position_ids.expand(B, S)
        cos, sin = self._cos_sin(position_ids, device)
        mask = self._mask(attention_mask, B, S, device)

        x = self.wte[input_ids]
        bug = _bug()
        for l in range(self.n_layers):
            ln1, ln2 = self.ln[l, 0], self.ln[l, 1]
            a = _layer_norm(x, ln1[0], ln1[1], self.eps)
            attn = self._attention(a, l, cos, sin, mask)
            if bug == "parallel_residual":
                x = x + attn + self._mlp(_layer_norm(x, ln2[0], ln2[1], self.eps), l)
                continue
            x = (a if bug == "residual_from_ln" else x) + attn
            x = x + self._mlp(_layer_norm(x, ln2[0], ln2[1], self.eps), l)
        x = _layer_norm(x, self.ln_f[0], self.ln_f[1], self.eps)
        head = self.wte if self.head is None else self.head
        return x @ head.t()


def build(state_dict, config) -> nn.Module:
    bug = _bug()
    model = NeoXJapanesePort(config)
    p = "gpt_neox_japanese."
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    L, H, nh, d = model.n_layers, model.hidden, model.n_heads, model.head_size
    with torch.no_grad():
        model.wte.copy_(sd[p + "embed_in.weight"])
        if model.head is not None:
            model.head.copy_(sd.get("embed_out.weight", sd[p + "embed_in.weight"]))
        model.ln_f[0].copy_(sd[p + "final_layer_norm.weight"])
        model.ln_f[1].copy_(sd[p + "final_layer_norm.bias"])
        for l in range(L):
            q = f"{p}layers.{l}."
            model.ln[l, 0, 0].copy_(sd[q + "input_layernorm.weight"])
            model.ln[l, 0, 1].copy_(sd[q + "input_layernorm.bias"])
            model.ln[l, 1, 0].copy_(sd[q + "post_attention_layernorm.weight"])
            model.ln[l, 1, 1].copy_(sd[q + "post_attention_layernorm.bias"])
            w = sd[q + "attention.query_key_value.weight"]  # (3H, H) out x in, rows (head, {q,k,v}, d)
            if bug == "qkv_split_blocked":
                w = w.view(3, nh, d, H)
            else:
                w = w.view(nh, 3, d, H).transpose(0, 1)  # -> ({q,k,v}, head, d, H)
            model.w_qkv[l].copy_(w.reshape(3 * H, H).t())
            model.w_o[l].copy_(sd[q + "attention.dense.weight"].t())
            bias_key = q + ("attention.dense.bias" if bug == "dense_bias_dropped" else "attention.dense_bias")
            if bias_key in sd:
                model.b_o[l].copy_(sd[bias_key])
            model.w_in[l].copy_(sd[q + "mlp.dense_h_to_4h.weight"].t())
            model.w_out[l].copy_(sd[q + "mlp.dense_4h_to_h.weight"].t())
    return model.float().eval()
