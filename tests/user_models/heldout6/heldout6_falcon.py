"""Falcon (old decoder architecture, multi-query, parallel attention, RoPE) written from scratch.

The fused query_key_value projection is ONE nn.Linear; q / k / v are split with our own view.
Attention uses F.scaled_dot_product_attention (is_causal when unpadded, boolean mask otherwise).
build(state_dict, config) -> module; module(input_ids, attention_mask=None, position_ids=None) -> logits
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "fused_view_dim_major",  # fused qkv viewed as (head_dim, heads+2) instead of (heads+2, head_dim)
    "kv_at_front",  # k/v slots taken from the front of the fused output (layout confusion)
    "rotary_on_fused_incl_value",  # RoPE applied to the whole fused view, so the value slot is rotated too
    "rope_exponent_floor_div",  # inv_freq exponent uses // -> every frequency is 1
    "rope_cos_sin_swapped",  # x*sin + rotate_half(x)*cos
    "sdpa_without_head_transpose",  # fast path passes (B,T,H,D) to SDPA; MQA broadcasting hides the shape error
    "sdpa_in_half",  # attention computed in float16
    "sdpa_dropout_in_eval",  # dropout_p=config.attention_dropout passed to SDPA in eval
    "dense_weight_transposed",  # attention dense weight used transposed (Conv1D habit)
    "sequential_instead_of_parallel",  # MLP applied to ln(x + attn) as in a sequential block
    "ln_bias_dropped",  # config.bias=False taken to mean LayerNorms have no bias
    "ln_weight_bias_swapped",  # input_layernorm weight and bias loaded into each other's slot
    "sdpa_bool_mask_inverted",  # padded path: bool mask uses True = masked (key_padding_mask convention)
    "pad_path_drops_causal",  # padded path: explicit mask has padding only, no causal part
    "k_rope_uses_cache_positions",  # keys rotated with arange positions, queries with position_ids
]
PADDING_ONLY = {"sdpa_bool_mask_inverted", "pad_path_drops_causal", "k_rope_uses_cache_positions"}
CLEAN = ["clean_separate_linears", "clean_float_mask_always"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


def rope_cos_sin(position_ids, dim, theta):
    if BUG == "rope_exponent_floor_div":
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2) // dim).float())
    else:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    ang = position_ids[..., None].float() * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, cos, sin):
    # x (B,T,h,D), cos/sin (B,T,D)
    cos, sin = cos[:, :, None], sin[:, :, None]
    if BUG == "rope_cos_sin_swapped":
        return x * sin + rotate_half(x) * cos
    return x * cos + rotate_half(x) * sin


def ln(mod, x, name):
    if BUG == "ln_bias_dropped":
        y = F.layer_norm(x, mod.normalized_shape, mod.weight, None, mod.eps)
    elif BUG == "ln_weight_bias_swapped" and name.endswith("input_layernorm"):
        y = F.layer_norm(x, mod.normalized_shape, mod.bias, mod.weight, mod.eps)
    else:
        y = mod(x)
    _rec(name, y)
    return y


class SelfAttention(nn.Module):
    def __init__(self, cfg, name):
        super().__init__()
        self.name = name
        self.H = cfg.num_attention_heads
        self.D = cfg.hidden_size // self.H
        self.drop = cfg.attention_dropout
        rp = getattr(cfg, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.query_key_value = nn.Linear(cfg.hidden_size, (self.H + 2) * self.D, bias=cfg.bias)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x, position_ids, attention_mask):
        B, T, _ = x.shape
        H, D = self.H, self.D
        fused = self.query_key_value(x)
        _rec(self.name + ".query_key_value", fused)
        cos, sin = rope_cos_sin(position_ids, D, self.theta)
        if BUG == "clean_separate_linears":
            W = self.query_key_value.weight
            q = F.linear(x, W[: H * D]).view(B, T, H, D)
            k = F.linear(x, W[H * D : H * D + D]).view(B, T, 1, D)
            v = F.linear(x, W[H * D + D :]).view(B, T, 1, D)
        else:
            if BUG == "fused_view_dim_major":
                f = fused.view(B, T, D, H + 2).transpose(-1, -2)
            else:
                f = fused.view(B, T, H + 2, D)
            if BUG == "rotary_on_fused_incl_value":
                f = rope(f, cos, sin)
            if BUG == "kv_at_front":
                k, v, q = f[:, :, 0:1], f[:, :, 1:2], f[:, :, 2:]
            else:
                q, k, v = f[:, :, :H], f[:, :, H : H + 1], f[:, :, H + 1 :]
        if BUG != "rotary_on_fused_incl_value":
            q = rope(q, cos, sin)
            if BUG == "k_rope_uses_cache_positions":
                ar = torch.arange(T, device=x.device)[None].expand(B, T)
                kc, ks = rope_cos_sin(ar, D, self.theta)
                k = rope(k, kc, ks)
            else:
                k = rope(k, cos, sin)
        dropout_p = self.drop if BUG == "sdpa_dropout_in_eval" else 0.0
        if BUG == "clean_separate_linears":
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).expand(B, H, T, D), v.transpose(1, 2).expand(B, H, T, D)
            s = qh @ kh.transpose(-1, -2) / math.sqrt(D)
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, None, :]
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            o = torch.softmax(s, dim=-1) @ vh
        elif BUG == "clean_float_mask_always":
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, None, :]
            fmask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2).repeat(1, H, 1, 1),
                v.transpose(1, 2).repeat(1, H, 1, 1),
                attn_mask=fmask,
            )
        elif attention_mask is None:
            if BUG == "sdpa_without_head_transpose":
                qh, kh, vh = q, k, v
            else:
                qh, kh, vh = (
                    q.transpose(1, 2),
                    k.transpose(1, 2).expand(B, H, T, D),
                    v.transpose(1, 2).expand(B, H, T, D),
                )
            if BUG == "sdpa_in_half":
                o = F.scaled_dot_product_attention(qh.half(), kh.half(), vh.half(), is_causal=True).float()
            else:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, dropout_p=dropout_p)
            if BUG == "sdpa_without_head_transpose":
                o = o.transpose(1, 2)
        else:
            keys = attention_mask.bool()[:, None, None, :]
            if BUG == "pad_path_drops_causal":
                allowed = keys
            else:
                allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None] & keys
            if BUG == "sdpa_bool_mask_inverted":
                allowed = ~allowed
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).expand(B, H, T, D), v.transpose(1, 2).expand(B, H, T, D)
            if BUG == "sdpa_in_half":
                o = F.scaled_dot_product_attention(qh.half(), kh.half(), vh.half(), attn_mask=allowed).float()
            else:
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, dropout_p=dropout_p)
        o = o.transpose(1, 2).reshape(B, T, H * D)
        if BUG == "dense_weight_transposed":
            o = F.linear(o, self.dense.weight.t(), self.dense.bias)
        else:
            o = self.dense(o)
        _rec(self.name + ".dense", o)
        _rec(self.name, o)
        return o


class MLP(nn.Module):
    def __init__(self, cfg, name):
        super().__init__()
        self.name = name
        ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, ffn, bias=cfg.bias)
        self.dense_4h_to_h = nn.Linear(ffn, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x):
        h = self.dense_h_to_4h(x)
        _rec(self.name + ".dense_h_to_4h", h)
        h = F.gelu(h)
        _rec(self.name + ".act", h)
        h = self.dense_4h_to_h(h)
        _rec(self.name + ".dense_4h_to_h", h)
        _rec(self.name, h)
        return h


class Layer(nn.Module):
    def __init__(self, cfg, name):
        super().__init__()
        self.name = name
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        self.self_attention = SelfAttention(cfg, name + ".self_attention")
        self.mlp = MLP(cfg, name + ".mlp")

    def forward(self, x, position_ids, attention_mask):
        residual = x
        h = ln(self.input_layernorm, x, self.name + ".input_layernorm")
        a = self.self_attention(h, position_ids, attention_mask)
        if BUG == "sequential_instead_of_parallel":
            x1 = residual + a
            out = x1 + self.mlp(self.input_layernorm(x1))
        else:
            out = self.mlp(h) + a + residual
        _rec(self.name, out)
        return out


class FalconPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert not cfg.new_decoder_architecture and cfg.multi_query and cfg.parallel_attn and not cfg.alibi
        self.transformer = nn.Module()
        self.transformer.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.transformer.h = nn.ModuleList([Layer(cfg, f"transformer.h.{i}") for i in range(cfg.num_hidden_layers)])
        self.transformer.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        x = self.transformer.word_embeddings(input_ids)
        _rec("transformer.word_embeddings", x)
        if REC is not None:  # HF's rotary_emb returns (cos, sin), each (B, T, head_dim)
            a0 = self.transformer.h[0].self_attention
            _rec("transformer.rotary_emb", rope_cos_sin(position_ids, a0.D, a0.theta)[0])
        for layer in self.transformer.h:
            x = layer(x, position_ids, attention_mask)
        x = ln(self.transformer.ln_f, x, "transformer.ln_f")
        logits = self.lm_head(x)
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    m = FalconPort(config)
    sd = dict(state_dict)
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["transformer.word_embeddings.weight"]
    m.load_state_dict(sd, strict=True)
    return m.eval()
