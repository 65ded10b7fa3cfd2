"""From-scratch Cohere (Command-R style) causal LM, written to learn the architecture.

Block: one LayerNorm (no bias, fp32) feeding attention and a SwiGLU MLP in parallel,
both added to the residual. RoPE rotates *interleaved* (even, odd) pairs. Logits are
multiplied by config.logit_scale; the output head is tied to the embedding.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "rope_neox_halves",
    "rope_cat_freqs",
    "rope_theta_10k",
    "rope_k_missing",
    "logit_scale_missing",
    "sequential_residual",
    "ln_rmsnorm",
    "ln_eps_1e6",
    "ln_unbiased_var",
    "ln_weight_plus_one",
    "gqa_tile",
    "softmax_over_queries",
    "attn_scale_hidden",
    "mlp_gate_up_swapped",
    "causal_peek_next",
    "pad_mask_on_queries",
]
PADDING_ONLY = ["pad_mask_on_queries"]
CLEAN = ["clean_rope_complex", "clean_logsumexp_softmax"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


class CohereNorm(nn.Module):
    """LayerNorm with a weight but no bias, always evaluated in float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        in_dtype = x.dtype
        x = x.float()
        eps = 1e-6 if BUG == "ln_eps_1e6" else self.eps
        if BUG == "ln_rmsnorm":
            centred = x
            var = x.pow(2).mean(-1, keepdim=True)
        elif BUG == "ln_unbiased_var":
            centred = x - x.mean(-1, keepdim=True)
            var = x.var(-1, keepdim=True)  # torch default: unbiased (N-1)
        else:
            centred = x - x.mean(-1, keepdim=True)
            var = centred.pow(2).mean(-1, keepdim=True)
        y = centred * torch.rsqrt(var + eps)
        w = self.weight.float()
        if BUG == "ln_weight_plus_one":
            w = 1.0 + w
        return (w * y).to(in_dtype)


def rope_tables(position_ids, head_dim, theta):
    """Returns (ang, cos, sin): ang (B, T, hd/2); cos/sin (B, T, hd) laid out per interleaved pair."""
    if BUG == "rope_theta_10k":
        theta = 10000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = position_ids[..., None].float() * inv_freq  # (B, T, hd/2)
    if BUG in ("rope_neox_halves", "rope_cat_freqs"):
        full = torch.cat([ang, ang], dim=-1)
    else:
        full = torch.repeat_interleave(ang, 2, dim=-1)
    return ang, full.cos(), full.sin()


def apply_rope(x, rope):
    """x: (B, H, T, hd). Pairs are (x[2i], x[2i+1])."""
    ang, cos, sin = rope
    if BUG == "clean_rope_complex":
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        rot = torch.polar(torch.ones_like(ang), ang)[:, None]
        return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)
    if BUG == "rope_neox_halves":
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    else:
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack([-odd, even], dim=-1).flatten(-2)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden = cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x, rope, mask, name):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        _rec(name + ".q_proj", q)
        _rec(name + ".k_proj", k)
        _rec(name + ".v_proj", v)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q = apply_rope(q, rope)
        if BUG != "rope_k_missing":
            k = apply_rope(k, rope)
        groups = self.n_heads // self.n_kv
        if BUG == "gqa_tile":
            k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
        else:
            k = torch.repeat_interleave(k, groups, dim=1)
            v = torch.repeat_interleave(v, groups, dim=1)
        denom = self.hidden if BUG == "attn_scale_hidden" else self.head_dim
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(denom)
        scores = scores + mask
        if BUG == "clean_logsumexp_softmax":
            probs = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
        else:
            axis = -2 if BUG == "softmax_over_queries" else -1
            shifted = scores - scores.amax(dim=axis, keepdim=True)
            e = torch.exp(shifted)
            probs = e / e.sum(dim=axis, keepdim=True)
        out = torch.matmul(probs, v)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        out = self.o_proj(out)
        _rec(name + ".o_proj", out)
        _rec(name, out)
        return out


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, name):
        g, u = self.gate_proj(x), self.up_proj(x)
        _rec(name + ".gate_proj", g)
        _rec(name + ".up_proj", u)
        if BUG == "mlp_gate_up_swapped":
            h = F.silu(u) * g
        else:
            h = F.silu(g) * u
        out = self.down_proj(h)
        _rec(name + ".down_proj", out)
        _rec(name, out)
        return out


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = CohereNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, rope, mask, name):
        h = self.input_layernorm(x)
        _rec(name + ".input_layernorm", h)
        a = self.self_attn(h, rope, mask, name + ".self_attn")
        if BUG == "sequential_residual":
            x = x + a
            m = self.mlp(self.input_layernorm(x), name + ".mlp")
            out = x + m
        elif BUG == "clean_logsumexp_softmax":
            m = self.mlp(h, name + ".mlp")
            out = (x + m) + a
        else:
            m = self.mlp(h, name + ".mlp")
            out = x + a + m
        _rec(name, out)
        return out


def make_mask(attention_mask, B, T, dtype):
    idx = torch.arange(T)
    if BUG == "causal_peek_next":
        allowed = idx[None, :] <= idx[:, None] + 1
    else:
        allowed = idx[None, :] <= idx[:, None]  # key <= query
    allowed = allowed[None, None].expand(B, 1, T, T)
    if attention_mask is not None:
        keep = attention_mask.bool()
        if BUG == "pad_mask_on_queries":
            allowed = allowed & keep[:, None, :, None]
        else:
            allowed = allowed & keep[:, None, None, :]
    mask = torch.zeros(B, 1, T, T, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class CohereLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = CohereNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logit_scale = cfg.logit_scale
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.theta = cfg.rope_parameters["rope_theta"]

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        x = self.embed_tokens(input_ids)
        _rec("model.embed_tokens", x)
        rope = rope_tables(position_ids, self.head_dim, self.theta)
        _rec("model.rotary_emb", rope[1])
        mask = make_mask(attention_mask, B, T, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, mask, f"model.layers.{i}")
        x = self.norm(x)
        _rec("model.norm", x)
        logits = self.lm_head(x)
        _rec("lm_head", logits)
        if BUG != "logit_scale_missing":
            logits = logits * self.logit_scale
        return logits


def build(state_dict, config):
    model = CohereLM(config)
    sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if getattr(config, "tie_word_embeddings", True) or "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    own = {}
    for k, v in sd.items():
        own[k[len("model.") :] if k.startswith("model.") else k] = v
    model.load_state_dict(own, strict=True)
    return model.eval()
