"""OLMo (OLMo 1) causal LM, ported by hand to plain PyTorch (reference: Transformers'
OlmoForCausalLM).

What it covers: a pre-norm decoder whose LayerNorms have no parameters at all (mean and
variance only, eps 1e-5, float32), bias-free q/k/v/o projections whose outputs are clamped to
[-clip_qkv, clip_qkv] right after the projection (before the head split and RoPE), half-split
("rotate_half") RoPE with config.rope_parameters["rope_theta"], scores scaled by
head_dim**-0.5, a SwiGLU MLP silu(gate) * up, a final non-parametric LayerNorm and an untied
lm_head.

Conventions
- All weights live as nn.Parameters directly on one module, OlmoFlat, named by layer:
  wte, lm_out, and per layer i: L{i}_q L{i}_k L{i}_v L{i}_o L{i}_gate L{i}_up L{i}_down (or the
  fused L{i}_qkv / L{i}_ff of the fused convention). The forward pass is written as plain
  functions (layer_norm, rope, attention, swiglu, decoder_layer) that take the module and index
  its parameters. build(state_dict, config) maps a Transformers OlmoForCausalLM state dict
  (in-memory names) onto these names with a regular expression and copies the tensors.
- forward(input_ids, attention_mask=None, position_ids=None) -> logits (batch, seq, vocab).
  attention_mask is (batch, seq), 0 for pads (left padding supported); position_ids are used
  as given (the verifier passes cumsum(mask) - 1 with pads set to 1); when None they are
  derived the same way from attention_mask, or arange(seq) without one.
- Additive attention mask, 0 where allowed and finfo(float32).min elsewhere; softmax in float32.
- Everything runs in float32.

Variants (module global BUG): "" is the plain port, CLEAN other correct conventions, BUGS single
mistakes, PADDING_ONLY the bugs that only show with a left-padded row. REC, when a dict, receives
intermediate tensors under the matching Transformers module names (verifier only; q/k/v are
recorded as the projections give them, before clamping).
"""

import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "clip_not_applied",  # config.clip_qkv ignored: q/k/v never clamped
    "clip_after_rope",  # q and k clamped after RoPE instead of straight after the projection
    "clip_qk_only",  # only q and k clamped (read as "QK clipping"); v left unclamped
    "clip_upper_only",  # clamp(max=clip_qkv) without the lower bound
    "layernorm_as_rmsnorm",  # non-parametric LayerNorm written as RMSNorm (no mean subtraction)
    "layernorm_unbiased_var",  # hand-written LayerNorm uses torch.var's default unbiased (n-1) estimate
    "fused_mlp_chunk_order",  # fused ff weight stacked [gate; up] but split OLMo-style as (x, gate)
    "head_tied_to_embedding",  # logits from wte (OLMo-1B weight_tying habit); this checkpoint is untied
    "sdpa_ignores_padding",  # SDPA with is_causal=True and the padding mask dropped
    "qkv_split_per_head",  # fused qkv split per head (NeoX layout) although OLMo stacks [q; k; v]
    "merge_heads_no_transpose",  # (b, h, s, d) reshaped to (b, s, h*d) without transposing first
    "rope_inverse_rotation",  # rotate_half written as cat(x2, -x1): rotates the other way
    "residual_from_normed",  # residual taken after input LayerNorm instead of before it
    "parallel_block",  # MLP reads the normed block input (parallel block) instead of x + attn
    "attn_dropout_eval",  # F.dropout(p=config.attention_dropout) on the probabilities, training defaults to True
]
PADDING_ONLY = {"sdpa_ignores_padding"}
CLEAN = [
    "fused_qkv_ff",  # q/k/v and up/gate fused as in the original OLMo code; clamp on the fused output
    "ln_affine_ones",  # parametric LayerNorm with weight 1 and bias 0 (F.layer_norm), same function
    "sdpa",  # SDPA (math kernel) with the additive mask
]

LN_EPS = 1e-5


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


def layer_norm(m, x):
    xf = x.float()
    if BUG == "ln_affine_ones":
        return F.layer_norm(xf, (xf.shape[-1],), m.ln_one, m.ln_zero, LN_EPS).to(x.dtype)
    if BUG == "layernorm_as_rmsnorm":
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + LN_EPS)).to(x.dtype)
    mu = xf.mean(-1, keepdim=True)
    if BUG == "layernorm_unbiased_var":
        var = xf.var(-1, keepdim=True)
    else:
        var = (xf - mu).pow(2).mean(-1, keepdim=True)
    return ((xf - mu) * torch.rsqrt(var + LN_EPS)).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    if BUG == "rope_inverse_rotation":
        return torch.cat((x[..., h:], -x[..., :h]), dim=-1)
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x, cos, sin):
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def clip(t, c):
    if c is None or BUG == "clip_not_applied":
        return t
    if BUG == "clip_upper_only":
        return t.clamp(max=c)
    return t.clamp(-c, c)


def project_qkv(m, i, x):
    """q, k, v for layer i, clamped to [-clip_qkv, clip_qkv] straight after the projection."""
    d = m.cfg.hidden_size
    c = m.cfg.clip_qkv
    if hasattr(m, f"L{i}_qkv"):
        qkv = x @ getattr(m, f"L{i}_qkv").T
        if BUG == "qkv_split_per_head":
            b, s, _ = qkv.shape
            parts = qkv.view(b, s, m.n_heads, 3 * m.head_dim).chunk(3, dim=-1)
            q, k, v = (p.reshape(b, s, d) for p in parts)
        else:
            q, k, v = qkv.split(d, dim=-1)
    else:
        q = x @ getattr(m, f"L{i}_q").T
        k = x @ getattr(m, f"L{i}_k").T
        v = x @ getattr(m, f"L{i}_v").T
    _rec(f"model.layers.{i}.self_attn.q_proj", q)
    _rec(f"model.layers.{i}.self_attn.k_proj", k)
    _rec(f"model.layers.{i}.self_attn.v_proj", v)
    if BUG == "fused_qkv_ff":
        return clip(qkv, c).split(d, dim=-1)  # OLMo clamps the fused output once
    if BUG == "clip_after_rope":
        return q, k, clip(v, c)  # q and k are clamped later, after RoPE
    if BUG == "clip_qk_only":
        return clip(q, c), clip(k, c), v
    return clip(q, c), clip(k, c), clip(v, c)


def attention(m, i, x, cos, sin, mask):
    b, s, _ = x.shape
    q, k, v = project_qkv(m, i, x)
    q = q.view(b, s, m.n_heads, m.head_dim).transpose(1, 2)
    k = k.view(b, s, m.n_kv, m.head_dim).transpose(1, 2)
    v = v.view(b, s, m.n_kv, m.head_dim).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    if BUG == "clip_after_rope":
        q, k = clip(q, m.cfg.clip_qkv), clip(k, m.cfg.clip_qkv)
    if m.n_kv != m.n_heads:
        k = k.repeat_interleave(m.n_heads // m.n_kv, dim=1)
        v = v.repeat_interleave(m.n_heads // m.n_kv, dim=1)
    if BUG == "sdpa_ignores_padding":
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif BUG == "sdpa":
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        scores = (q @ k.transpose(-1, -2)) * m.head_dim**-0.5 + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if BUG == "attn_dropout_eval":
            probs = F.dropout(probs, p=m.cfg.attention_dropout)
        ctx = probs @ v
    if BUG == "merge_heads_no_transpose":
        ctx = ctx.reshape(b, s, -1)
    else:
        ctx = ctx.transpose(1, 2).reshape(b, s, -1)
    out = ctx @ getattr(m, f"L{i}_o").T
    _rec(f"model.layers.{i}.self_attn.o_proj", out)
    _rec(f"model.layers.{i}.self_attn", out)
    return out


def swiglu(m, i, x):
    n = f"model.layers.{i}.mlp"
    if BUG in ("fused_qkv_ff", "fused_mlp_chunk_order"):
        h, g = (x @ getattr(m, f"L{i}_ff").T).chunk(2, dim=-1)  # OLMo: x, x_gate = ff.chunk(2)
    else:
        g = x @ getattr(m, f"L{i}_gate").T
        h = x @ getattr(m, f"L{i}_up").T
    _rec(n + ".gate_proj", g)
    _rec(n + ".up_proj", h)
    a = F.silu(g)
    _rec(n + ".act_fn", a)
    out = (a * h) @ getattr(m, f"L{i}_down").T
    _rec(n + ".down_proj", out)
    _rec(n, out)
    return out


def decoder_layer(m, i, x, cos, sin, mask):
    n = f"model.layers.{i}"
    h = layer_norm(m, x)
    _rec(n + ".input_layernorm", h)
    if BUG == "residual_from_normed":
        x = h
    a = attention(m, i, h, cos, sin, mask)
    if BUG == "parallel_block":
        _rec(n + ".post_attention_layernorm", h)
        x = x + a + swiglu(m, i, h)
    else:
        x = x + a
        h2 = layer_norm(m, x)
        _rec(n + ".post_attention_layernorm", h2)
        x = x + swiglu(m, i, h2)
    _rec(n, x)
    return x


class OlmoFlat(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, ff, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = d // self.n_heads
        kv = self.n_kv * self.head_dim
        self.wte = nn.Parameter(torch.empty(v, d))
        self.lm_out = nn.Parameter(torch.empty(v, d))
        fused_attn = BUG in ("fused_qkv_ff", "qkv_split_per_head")
        fused_ff = BUG in ("fused_qkv_ff", "fused_mlp_chunk_order")
        for i in range(cfg.num_hidden_layers):
            shapes = {"o": (d, d), "down": (d, ff)}
            shapes.update({"qkv": (d + 2 * kv, d)} if fused_attn else {"q": (d, d), "k": (kv, d), "v": (kv, d)})
            shapes.update({"ff": (2 * ff, d)} if fused_ff else {"gate": (ff, d), "up": (ff, d)})
            for nm, shape in shapes.items():
                self.register_parameter(f"L{i}_{nm}", nn.Parameter(torch.empty(shape)))
        if BUG == "ln_affine_ones":
            self.ln_one = nn.Parameter(torch.ones(d))
            self.ln_zero = nn.Parameter(torch.zeros(d))
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, s = input_ids.shape
        dev = input_ids.device
        x = F.embedding(input_ids, self.wte)
        _rec("model.embed_tokens", x)
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(s, device=dev)[None].expand(b, s)
            else:
                position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        _rec("model.rotary_emb", cos)

        allowed = torch.ones(s, s, dtype=torch.bool, device=dev).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(allowed.shape, device=dev).masked_fill(~allowed, torch.finfo(torch.float32).min)

        for i in range(self.cfg.num_hidden_layers):
            x = decoder_layer(self, i, x, cos, sin, mask)
        x = layer_norm(self, x)
        _rec("model.norm", x)
        head = self.wte if BUG == "head_tied_to_embedding" else self.lm_out
        logits = x @ head.T
        _rec("lm_head", logits)
        return logits


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.weight")


def build(state_dict, config):
    m = OlmoFlat(config)
    own = {}
    for key, t in state_dict.items():
        if key == "model.embed_tokens.weight":
            own["wte"] = t
        elif key == "lm_head.weight":
            own["lm_out"] = t
        else:
            i, _, proj = _LAYER_KEY.fullmatch(key).groups()
            own[f"L{i}_{proj}"] = t
    for i in range(config.num_hidden_layers):
        if hasattr(m, f"L{i}_qkv"):
            own[f"L{i}_qkv"] = torch.cat([own.pop(f"L{i}_{p}") for p in ("q", "k", "v")], dim=0)
        if hasattr(m, f"L{i}_ff"):
            order = ("gate", "up") if BUG == "fused_mlp_chunk_order" else ("up", "gate")
            own[f"L{i}_ff"] = torch.cat([own.pop(f"L{i}_{p}") for p in order], dim=0)
    with torch.no_grad():
        params = dict(m.named_parameters())
        for name, t in own.items():
            params[name].copy_(t)
    return m.eval()
