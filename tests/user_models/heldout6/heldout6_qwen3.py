"""Qwen3 causal LM written from scratch: weights live in a plain dict, layers are functions.

build(state_dict, config) -> module; module(input_ids, attention_mask=None, position_ids=None) -> logits
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "rope_freq_dim_from_hidden",  # RoPE inv_freq exponent divided by hidden/heads (16), not config.head_dim (32)
    "rope_angles_bf16",  # position * inv_freq computed in bfloat16
    "qnorm_uses_knorm_weight",  # q_norm applied with the k_norm weight
    "knorm_applied_to_v",  # k_norm also applied to the value heads
    "rmsnorm_eps_outside_sqrt",  # x / (sqrt(mean(x^2)) + eps)
    "rmsnorm_mean_over_tokens",  # mean(x^2) over the sequence axis instead of the hidden axis
    "norm_weights_swapped",  # input_layernorm / post_attention_layernorm weights exchanged
    "v_from_k_proj",  # value computed with k_proj weight (key-string typo)
    "layers_read_layer0",  # every layer reads layer 0 weights (f-string index bug)
    "einsum_scores_transposed",  # einsum output 'bhkq' instead of 'bhqk'
    "head_merge_dim_major",  # heads merged as (head_dim, heads) instead of (heads, head_dim)
    "hidden_act_gelu",  # config.hidden_act ignored, gelu used in the MLP
    "final_norm_skipped",  # model.norm not applied before lm_head
    "pad_mask_after_softmax",  # padding applied by zeroing probs after softmax (no renormalisation)
    "pad_mask_first_row_only",  # key padding mask taken from batch row 0 for every row
]
PADDING_ONLY = {"pad_mask_after_softmax", "pad_mask_first_row_only"}
CLEAN = ["clean_fused_qkv", "clean_complex_rope"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


def rms_norm(x, w, eps):
    dt = x.dtype
    xf = x.float()
    if BUG == "rmsnorm_eps_outside_sqrt":
        y = xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)
    else:
        axis = 1 if BUG == "rmsnorm_mean_over_tokens" else -1
        y = xf * torch.rsqrt(xf.pow(2).mean(axis, keepdim=True) + eps)
    return w * y.to(dt)


def rope_tables(position_ids, head_dim, theta, hidden, n_heads):
    denom = (hidden // n_heads) if BUG == "rope_freq_dim_from_hidden" else head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / denom))
    if BUG == "rope_angles_bf16":
        ang = (position_ids[..., None].to(torch.bfloat16) * inv_freq.to(torch.bfloat16)).float()
    else:
        ang = position_ids[..., None].float() * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x, cos, sin):
    # x (B,H,T,D), cos/sin (B,T,D)
    cos, sin = cos[:, None], sin[:, None]
    if BUG == "clean_complex_rope":
        h = x.shape[-1] // 2
        z = torch.view_as_complex(torch.stack([x[..., :h], x[..., h:]], -1).contiguous())
        rot = torch.complex(cos[..., :h], sin[..., :h])
        r = torch.view_as_real(z * rot)
        return torch.cat([r[..., 0], r[..., 1]], dim=-1)
    return x * cos + rotate_half(x) * sin


class Qwen3Port(nn.Module):
    def __init__(self, state_dict, config):
        super().__init__()
        self.cfg = config
        self.w = {k: v.detach().clone().float() for k, v in state_dict.items()}
        rp = getattr(config, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def _attn(self, i, h, cos, sin, allowed, key_mask):
        W, cfg = self.w, self.cfg
        B, T, _ = h.shape
        nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim
        name = f"model.layers.{i}.self_attn."
        src = f"model.layers.{0 if BUG == 'layers_read_layer0' else i}.self_attn."
        if BUG == "clean_fused_qkv":
            wqkv = torch.cat([W[src + "q_proj.weight"], W[src + "k_proj.weight"], W[src + "v_proj.weight"]], 0)
            q, k, v = F.linear(h, wqkv).split([nh * D, nkv * D, nkv * D], dim=-1)
        else:
            q = F.linear(h, W[src + "q_proj.weight"])
            k = F.linear(h, W[src + "k_proj.weight"])
            v = F.linear(h, W[src + ("k_proj.weight" if BUG == "v_from_k_proj" else "v_proj.weight")])
        _rec(name + "q_proj", q)
        _rec(name + "k_proj", k)
        _rec(name + "v_proj", v)
        q = q.view(B, T, nh, D)
        k = k.view(B, T, nkv, D)
        v = v.view(B, T, nkv, D)
        qn_w = W[src + ("k_norm.weight" if BUG == "qnorm_uses_knorm_weight" else "q_norm.weight")]
        q = rms_norm(q, qn_w, cfg.rms_norm_eps)
        k = rms_norm(k, W[src + "k_norm.weight"], cfg.rms_norm_eps)
        if BUG == "knorm_applied_to_v":
            v = rms_norm(v, W[src + "k_norm.weight"], cfg.rms_norm_eps)
        _rec(name + "q_norm", q)
        _rec(name + "k_norm", k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out_sub = "bhkq" if BUG == "einsum_scores_transposed" else "bhqk"
        scores = torch.einsum(f"bhqd,bhkd->{out_sub}", q, k) * D**-0.5
        neg = torch.finfo(scores.dtype).min
        if BUG == "pad_mask_after_softmax" and key_mask is not None:
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            probs = torch.softmax(scores.masked_fill(~causal, neg).float(), dim=-1).to(q.dtype)
            probs = probs * key_mask[:, None, None, :].to(probs.dtype)
        else:
            probs = torch.softmax(scores.masked_fill(~allowed, neg).float(), dim=-1).to(q.dtype)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        if BUG == "head_merge_dim_major":
            out = out.permute(0, 2, 3, 1).reshape(B, T, nh * D)
        else:
            out = out.transpose(1, 2).reshape(B, T, nh * D)
        o = F.linear(out, W[src + "o_proj.weight"])
        _rec(name + "o_proj", o)
        _rec(name[:-1], o)
        return o

    def _mlp(self, i, h):
        W = self.w
        name = f"model.layers.{i}.mlp."
        src = f"model.layers.{0 if BUG == 'layers_read_layer0' else i}.mlp."
        g = F.linear(h, W[src + "gate_proj.weight"])
        u = F.linear(h, W[src + "up_proj.weight"])
        _rec(name + "gate_proj", g)
        _rec(name + "up_proj", u)
        a = F.gelu(g) if BUG == "hidden_act_gelu" else F.silu(g)
        _rec(name + "act_fn", a)
        d = F.linear(a * u, W[src + "down_proj.weight"])
        _rec(name + "down_proj", d)
        _rec(name[:-1], d)
        return d

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        W, cfg = self.w, self.cfg
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        x = F.embedding(input_ids, W["model.embed_tokens.weight"])
        _rec("model.embed_tokens", x)
        cos, sin = rope_tables(position_ids, self.head_dim, self.theta, cfg.hidden_size, cfg.num_attention_heads)
        _rec("model.rotary_emb", cos)
        allowed = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None, None]
        key_mask = None
        if attention_mask is not None:
            key_mask = attention_mask.bool()
            if BUG == "pad_mask_first_row_only":
                key_mask = key_mask[:1].expand(B, T)
            allowed = allowed & key_mask[:, None, None, :]
        eps = cfg.rms_norm_eps
        for i in range(cfg.num_hidden_layers):
            src = f"model.layers.{0 if BUG == 'layers_read_layer0' else i}."
            ln1, ln2 = src + "input_layernorm.weight", src + "post_attention_layernorm.weight"
            if BUG == "norm_weights_swapped":
                ln1, ln2 = ln2, ln1
            h = rms_norm(x, W[ln1], eps)
            _rec(f"model.layers.{i}.input_layernorm", h)
            x = x + self._attn(i, h, cos, sin, allowed, key_mask)
            h = rms_norm(x, W[ln2], eps)
            _rec(f"model.layers.{i}.post_attention_layernorm", h)
            x = x + self._mlp(i, h)
            _rec(f"model.layers.{i}", x)
        if BUG != "final_norm_skipped":
            x = rms_norm(x, W["model.norm.weight"], eps)
        _rec("model.norm", x)
        logits = F.linear(x, W["lm_head.weight"])
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    return Qwen3Port(state_dict, config).eval()
