"""From-scratch PyTorch port of a phi-2 style causal LM (PhiForCausalLM weights).

Conventions of this port
------------------------
* One ``ParallelBlock`` per layer: a single LayerNorm (with bias) feeds BOTH the
  attention branch and the MLP branch, and the block returns
  ``x + attn(ln(x)) + mlp(ln(x))`` (GPT-J style parallel residual).
* Attention: separate ``wq/wk/wv`` Linears with bias (or one fused ``wqkv`` in the
  ``fused_qkv`` variant), output projection ``wo`` with bias.  Partial rotary
  embedding: only the first ``rotary_dim = head_dim * partial_rotary_factor``
  channels of each head are rotated, NeoX "rotate-half" pairing (i, i + rotary_dim/2),
  the remaining channels pass through unchanged.
* MLP: ``up`` (fc1) -> gelu (tanh approximation, i.e. gelu_new) -> ``down`` (fc2).
* Final LayerNorm ``ln_out`` and an untied ``head`` Linear WITH bias.
* Call: ``module(input_ids, attention_mask=None, position_ids=None)`` -> logits
  (batch, seq, vocab).  Left padding: ``attention_mask`` is (batch, seq) with 0 on
  pads, ``position_ids`` are supplied by the caller.

``BUG`` (environment variable) selects a variant: "" is the reference port, names in
``CLEAN`` are equivalent alternative implementations, names in ``BUGS`` inject one
mistake each.  When ``REC`` is a dict the forward pass stores intermediate tensors
in it under the Hugging Face module names (used by the verifier only).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "rope_freq_headdim",  # inv_freq exponent divided by head_dim instead of rotary_dim
    "rotate_tail",  # rotary applied to the LAST rotary_dim channels of each head instead of the first
    "pass_dropped",  # q/k replaced by their rotated slice: pass-through channels silently dropped from q.k
    "full_rotary",  # partial_rotary_factor ignored: rotary over the whole head_dim (llama template)
    "scale_rotary_dim",  # softmax scale 1/sqrt(rotary_dim) instead of 1/sqrt(head_dim)
    "sequential_block",  # parallel block made sequential: MLP reads ln(x + attn) instead of ln(x)
    "mlp_unnormed",  # MLP branch fed the raw residual stream instead of the shared layernorm output
    "residual_twice",  # residual added in both branches: (x + attn) + (x + mlp)
    "lm_head_bias_dropped",  # lm_head built without bias, lm_head.bias never loaded
    "dense_bias_dropped",  # attention output projection (dense) built bias=False, dense.bias ignored
    "ln_no_center",  # LayerNorm written RMS-style: mean never subtracted (bias kept)
    "tied_head",  # lm_head taken from embed_tokens (tying assumed) although tie_word_embeddings=False
    "fused_kv_swapped",  # fused qkv weight stacked as [q, v, k] by the loader but split as q, k, v
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
    "assumes_right_padding",  # key mask built from lengths as arange < len (right padding assumed)
]
PADDING_ONLY = {"pad_mask_query_axis", "assumes_right_padding"}
CLEAN = [
    "fused_qkv",  # one fused qkv Linear, split after the matmul
    "sdpa",  # torch scaled_dot_product_attention with an additive mask
    "complex_rope",  # rotary slice rotated as complex numbers (real=first half, imag=second half)
]


def _rec(name, value):
    if isinstance(REC, dict):
        if isinstance(value, tuple):
            REC[name] = tuple(v.detach().clone() for v in value)
        else:
            REC[name] = value.detach().clone()


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class Norm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        if BUG == "ln_no_center":
            var = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(var + self.eps) * self.weight + self.bias
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = xc.pow(2).mean(-1, keepdim=True)
        return xc * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Rotary(nn.Module):
    """Produces (cos, sin) of width rotary_dim for the given positions."""

    def __init__(self, head_dim, rotary_dim, theta):
        super().__init__()
        self.rotary_dim = rotary_dim
        denom = head_dim if BUG == "rope_freq_headdim" else rotary_dim
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / denom))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, pos):
        ang = pos[..., None].float() * self.inv_freq
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()


def _rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rope(x, cos, sin):
    # x: (B, nh, T, r); cos/sin: (B, T, r)
    cos = cos[:, None]
    sin = sin[:, None]
    if BUG == "complex_rope":
        h = x.shape[-1] // 2
        z = torch.complex(x[..., :h].contiguous(), x[..., h:].contiguous())
        rot = torch.complex(cos[..., :h], sin[..., :h])
        z = z * rot
        return torch.cat([z.real, z.imag], dim=-1)
    return x * cos + _rot_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg, rotary_dim):
        super().__init__()
        d = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.hd = d // self.nh
        self.rd = rotary_dim
        self.fused = BUG in ("fused_qkv", "fused_kv_swapped")
        if self.fused:
            self.wqkv = nn.Linear(d, 3 * d)
        else:
            self.wq = nn.Linear(d, d)
            self.wk = nn.Linear(d, d)
            self.wv = nn.Linear(d, d)
        self.wo = nn.Linear(d, d, bias=(BUG != "dense_bias_dropped"))
        self.scale = 1.0 / math.sqrt(self.rd if BUG == "scale_rotary_dim" else self.hd)

    def _heads(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.nh, self.hd).transpose(1, 2)

    def forward(self, x, cos, sin, bias, pfx):
        B, T, d = x.shape
        if self.fused:
            q, k, v = self.wqkv(x).split(d, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        _rec(pfx + ".q_proj", q)
        _rec(pfx + ".k_proj", k)
        _rec(pfx + ".v_proj", v)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)

        r = self.rd
        if BUG == "rotate_tail":
            q = torch.cat([_rope(q[..., -r:], cos, sin), q[..., :-r]], dim=-1)
            k = torch.cat([_rope(k[..., -r:], cos, sin), k[..., :-r]], dim=-1)
        elif BUG == "pass_dropped":
            q = _rope(q[..., :r], cos, sin)
            k = _rope(k[..., :r], cos, sin)
        else:
            q = torch.cat([_rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)
            k = torch.cat([_rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)

        if BUG == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)
        else:
            att = (q @ k.transpose(-1, -2)) * self.scale + bias
            att = torch.softmax(att.float(), dim=-1).to(q.dtype)
            o = att @ v
        o = o.transpose(1, 2).reshape(B, T, d)
        o = self.wo(o)
        _rec(pfx + ".dense", o)
        _rec(pfx, o)
        return o


class FeedForward(nn.Module):
    def __init__(self, d, inner):
        super().__init__()
        self.up = nn.Linear(d, inner)
        self.down = nn.Linear(inner, d)

    def forward(self, x, pfx):
        h = self.up(x)
        _rec(pfx + ".fc1", h)
        h = _gelu_tanh(h)
        _rec(pfx + ".activation_fn", h)
        h = self.down(h)
        _rec(pfx + ".fc2", h)
        _rec(pfx, h)
        return h


class ParallelBlock(nn.Module):
    def __init__(self, cfg, rotary_dim):
        super().__init__()
        self.ln = Norm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attn = Attention(cfg, rotary_dim)
        self.ffn = FeedForward(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, bias, pfx):
        h = self.ln(x)
        _rec(pfx + ".input_layernorm", h)
        a = self.attn(h, cos, sin, bias, pfx + ".self_attn")
        if BUG == "sequential_block":
            x = x + a
            m = self.ffn(self.ln(x), pfx + ".mlp")
            out = x + m
        elif BUG == "mlp_unnormed":
            out = x + a + self.ffn(x, pfx + ".mlp")
        elif BUG == "residual_twice":
            m = self.ffn(h, pfx + ".mlp")
            out = (x + a) + (x + m)
        else:
            out = x + a + self.ffn(h, pfx + ".mlp")
        _rec(pfx, out)
        return out


class PhiPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        rp = cfg.rope_parameters
        hd = cfg.hidden_size // cfg.num_attention_heads
        if BUG == "full_rotary":
            rd = hd
        else:
            rd = int(hd * rp.get("partial_rotary_factor", 1.0))
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(hd, rd, rp["rope_theta"])
        self.blocks = nn.ModuleList([ParallelBlock(cfg, rd) for _ in range(cfg.num_hidden_layers)])
        self.ln_out = Norm(cfg.hidden_size, cfg.layer_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=(BUG != "lm_head_bias_dropped"))

    def _bias(self, attention_mask, B, T, dtype, device):
        neg = torch.finfo(dtype).min
        allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
        if attention_mask is not None:
            am = attention_mask.bool()
            if BUG == "assumes_right_padding":
                lengths = am.sum(-1)
                am = torch.arange(T, device=device)[None, :] < lengths[:, None]
            if BUG == "pad_mask_query_axis":
                allowed = allowed & am[:, None, :, None]
            else:
                allowed = allowed & am[:, None, None, :]
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return bias.masked_fill(~allowed, neg)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        x = self.tok(input_ids)
        _rec("model.embed_tokens", x)
        cos, sin = self.rotary(position_ids)
        _rec("model.rotary_emb", (cos, sin))
        bias = self._bias(attention_mask, B, T, x.dtype, x.device)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, bias, f"model.layers.{i}")
        x = self.ln_out(x)
        _rec("model.final_layernorm", x)
        logits = self.head(x)
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    """Create the port and copy the Hugging Face phi weights into it."""
    model = PhiPort(config)
    sd = {k: v.float() for k, v in state_dict.items()}
    own = {}
    own["tok.weight"] = sd["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        src = f"model.layers.{i}."
        dst = f"blocks.{i}."
        own[dst + "ln.weight"] = sd[src + "input_layernorm.weight"]
        own[dst + "ln.bias"] = sd[src + "input_layernorm.bias"]
        if model.blocks[i].attn.fused:
            names = ["q_proj", "k_proj", "v_proj"]
            if BUG == "fused_kv_swapped":
                names = ["q_proj", "v_proj", "k_proj"]
            own[dst + "attn.wqkv.weight"] = torch.cat([sd[src + f"self_attn.{n}.weight"] for n in names], 0)
            own[dst + "attn.wqkv.bias"] = torch.cat([sd[src + f"self_attn.{n}.bias"] for n in names], 0)
        else:
            for mine, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
                own[dst + f"attn.{mine}.weight"] = sd[src + f"self_attn.{theirs}.weight"]
                own[dst + f"attn.{mine}.bias"] = sd[src + f"self_attn.{theirs}.bias"]
        own[dst + "attn.wo.weight"] = sd[src + "self_attn.dense.weight"]
        if BUG != "dense_bias_dropped":
            own[dst + "attn.wo.bias"] = sd[src + "self_attn.dense.bias"]
        own[dst + "ffn.up.weight"] = sd[src + "mlp.fc1.weight"]
        own[dst + "ffn.up.bias"] = sd[src + "mlp.fc1.bias"]
        own[dst + "ffn.down.weight"] = sd[src + "mlp.fc2.weight"]
        own[dst + "ffn.down.bias"] = sd[src + "mlp.fc2.bias"]
    own["ln_out.weight"] = sd["model.final_layernorm.weight"]
    own["ln_out.bias"] = sd["model.final_layernorm.bias"]
    if BUG == "tied_head":
        own["head.weight"] = sd["model.embed_tokens.weight"]
    else:
        own["head.weight"] = sd["lm_head.weight"]
    if BUG != "lm_head_bias_dropped":
        own["head.bias"] = sd["lm_head.bias"]
    missing, unexpected = model.load_state_dict(own, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()
