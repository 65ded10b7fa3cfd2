"""Llama 3 in the layout of Meta's reference implementation (``llama/model.py``).

Convention:
    * module names: ``tok_embeddings``, ``layers.{i}.attention.{wq,wk,wv,wo}``,
      ``layers.{i}.feed_forward.{w1,w2,w3}`` (w1 gate, w3 up, w2 down),
      ``layers.{i}.attention_norm`` / ``ffn_norm``, ``norm``, ``output``; every norm's
      parameter is called ``weight``.
    * q/k weights in Meta's interleaved RoPE layout: inside each head, output rows come in
      adjacent (real, imaginary) pairs.  Transformers' checkpoint stores them half-split (all
      real parts, then all imaginary parts), as ``convert_llama_weights_to_hf.permute`` wrote
      them; ``build`` undoes that permutation row by row.
    * RoPE through complex numbers: ``torch.polar`` angles, ``view_as_complex`` on adjacent
      pairs, computed in float32 and cast back, as Meta does.
    * Llama 3 frequency scaling (``rope_type == "llama3"``) applied to the inverse frequencies.
    * Attention written out: ``q @ k^T / sqrt(d)``, additive causal mask, float32 softmax.

Bugs (``BUG = "<name>"`` before calling ``build``; exactly one at a time):
    "rope_theta"   RoPE base 10000 instead of the config's ``rope_theta``.
    "no_scaling"   the Llama 3 frequency scaling is skipped (plain RoPE frequencies).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BUG = None
BUGS = ("rope_theta", "no_scaling")


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, or None
    max_seq_len: int
    tie_embeddings: bool


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def apply_scaling(freqs: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, smooth between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=freqs.dtype, device=freqs.device)


def precompute_freqs_cis(dim: int, end: int, theta: float, scaling: dict | None):
    """(end, dim // 2) complex64 rotations e^{i * t * freq_j}."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if scaling is not None:
        freqs = apply_scaling(freqs, scaling)
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    """xq, xk: (bsz, seqlen, heads, head_dim) with adjacent (re, im) pairs."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]  # broadcast over batch and heads
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bs, slen, n_kv_heads, hd) -> (bs, slen, n_kv_heads * n_rep, hd), each kv head repeated in place."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
    return x.reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)

        keys = repeat_kv(xk, self.n_rep).transpose(1, 2)  # (bs, heads, slen, hd)
        values = repeat_kv(xv, self.n_rep).transpose(1, 2)
        xq = xq.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # (bs, heads, slen, hd)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(params) for _ in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        if params.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.freqs_cis = precompute_freqs_cis(
            params.head_dim, params.max_seq_len * 2, params.rope_theta, params.rope_scaling
        )

    def _mask(self, seqlen, attention_mask, dtype, device):
        """Additive (bs or 1, 1, seqlen, seqlen) mask: 0 where a query may look, -inf elsewhere."""
        allowed = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.to(device).bool()[:, None, None, :]
        mask = torch.full(allowed.shape, float("-inf"), device=device)
        mask = mask.masked_fill(allowed, 0.0)
        # a query that sees no key at all (a padding row) gets a uniform row instead of NaN
        mask = mask.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
        return mask.to(dtype)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        if self.freqs_cis.shape[0] < seqlen:
            p = self.params
            self.freqs_cis = precompute_freqs_cis(p.head_dim, seqlen * 2, p.rope_theta, p.rope_scaling)
        freqs_cis = self.freqs_cis[:seqlen].to(h.device)
        mask = self._mask(seqlen, attention_mask, h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        h = self.norm(h)
        return self.output(h)


# ---------------------------------------------------------------- HF -> Meta conversion


def args_from_hf(cfg) -> ModelArgs:
    n_heads = cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    scaling = None
    if rope_type == "llama3" and BUG != "no_scaling":
        scaling = {
            k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        }
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if BUG == "rope_theta":
        theta = 10000.0
    return ModelArgs(
        dim=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=cfg.num_key_value_heads or n_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        hidden_dim=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        norm_eps=cfg.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=cfg.max_position_embeddings,
        tie_embeddings=bool(cfg.tie_word_embeddings),
    )


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of convert_llama_weights_to_hf's permute: half-split rows -> adjacent pairs per head."""
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def convert_hf_state_dict(sd: dict, args: ModelArgs) -> dict:
    out = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"],
    }
    for i in range(args.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attention.wq.weight"] = unpermute(sd[src + "self_attn.q_proj.weight"], args.n_heads)
        out[dst + "attention.wk.weight"] = unpermute(sd[src + "self_attn.k_proj.weight"], args.n_kv_heads)
        out[dst + "attention.wv.weight"] = sd[src + "self_attn.v_proj.weight"]
        out[dst + "attention.wo.weight"] = sd[src + "self_attn.o_proj.weight"]
        out[dst + "feed_forward.w1.weight"] = sd[src + "mlp.gate_proj.weight"]
        out[dst + "feed_forward.w2.weight"] = sd[src + "mlp.down_proj.weight"]
        out[dst + "feed_forward.w3.weight"] = sd[src + "mlp.up_proj.weight"]
        out[dst + "attention_norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "ffn_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
    return out


def build(state_dict: dict, hf_config) -> nn.Module:
    """Build a Meta-layout Transformer from a Transformers Llama state dict and config."""
    if BUG is not None and BUG not in BUGS:
        raise ValueError(f"unknown BUG {BUG!r}; one of {BUGS}")
    args = args_from_hf(hf_config)
    dtype = state_dict["model.embed_tokens.weight"].dtype
    device = state_dict["model.embed_tokens.weight"].device
    model = Transformer(args).to(dtype=dtype)
    model.load_state_dict(convert_hf_state_dict(state_dict, args), strict=True)
    if args.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    return model.to(device).eval()
