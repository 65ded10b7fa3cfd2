"""OLMo 3 decoder-only LM with a preallocated KV cache, written for generation (gpt-fast style).

Layout (our names, not Transformers'):

    Olmo3LM
      tok_emb                      nn.Embedding
      blocks[i]: Block             post-norm: x = x + attn_norm(attn(x)); x = x + ffn_norm(ffn(x))
        attn: Attention            wq wk wv wo, q_norm / k_norm over the whole projection (before the head split)
        attn_norm: RMSNorm
        ffn: SwiGLU                w1 (gate), w3 (up), w2 (down)
        ffn_norm: RMSNorm
      norm: RMSNorm
      output: nn.Linear            tied to tok_emb when the config says so
      ropes[kind]: Rotary          one per layer kind, each with its own theta

Cache (``model.new_cache()`` -> ``KVCache``): one slot object per layer, buffers allocated on first use
(batch, kv_heads, capacity, head_dim):

    FlatKV   full-attention layers, ``max_len`` slots; token t lives in slot t.
    RingKV   sliding layers, ``window`` slots; token t lives in slot t % window. A single-token decode
             writes first and then reads the last ``window`` tokens in order; a chunk reads the last
             ``window - 1`` old tokens, appends the chunk, then stores the chunk's tail in the ring.

``KVCache.pos`` is the number of tokens (padding included) fed so far: the sequence index of the
next token, which drives the causal / sliding masks. RoPE angles come from ``position_ids`` instead,
so a left-padded row can count only its real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import parity
from parity.run.decode import CacheProtocol

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass
class Olmo3Args:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    window: int | None
    layer_kinds: tuple
    rope_theta: dict  # layer kind -> theta
    tie_embeddings: bool
    qkv_bias: bool
    max_seq_len: int

    @classmethod
    def from_hf(cls, cfg) -> Olmo3Args:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"only SiLU MLPs are implemented, got {cfg.hidden_act!r}")
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        kinds = tuple(cfg.layer_types or [FULL] * cfg.num_hidden_layers)
        rope = cfg.rope_parameters or {}
        if "rope_type" in rope or "rope_theta" in rope:  # one flat dict for every kind
            rope = {kind: rope for kind in set(kinds)}
        theta = {}
        for kind in set(kinds):
            params = rope.get(kind) or {}
            rtype = params.get("rope_type", params.get("type", "default"))
            if rtype != "default":
                raise NotImplementedError(
                    f"RoPE type {rtype!r} on {kind} layers is not implemented here (only default RoPE; "
                    "YaRN and other scaled variants are refused)"
                )
            theta[kind] = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        return cls(
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=cfg.num_key_value_heads or n_heads,
            head_dim=head_dim,
            ffn_dim=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            norm_eps=cfg.rms_norm_eps,
            window=cfg.sliding_window,
            layer_kinds=kinds,
            rope_theta=theta,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)),
            max_seq_len=min(int(getattr(cfg, "max_position_embeddings", 4096) or 4096), 4096),
        )


# ----------------------------------------------------------------------------------------------- cache


class FlatKV:
    """Full-attention layer: token t in slot t of a (batch, kv_heads, max_len, head_dim) buffer."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k = self.v = None
        self.length = 0

    def _alloc(self, like: torch.Tensor):
        if self.k is None:
            b, h, _, d = like.shape
            self.k = like.new_zeros(b, h, self.max_len, d)
            self.v = like.new_zeros(b, h, self.max_len, d)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int):
        self._alloc(k)
        stop = start + k.shape[2]
        if stop > self.max_len:
            raise RuntimeError(f"KV cache full: {stop} tokens > max_len {self.max_len}")
        self.k[:, :, start:stop] = k
        self.v[:, :, start:stop] = v
        self.length = stop
        return self.k[:, :, :stop], self.v[:, :, :stop]

    def ordered(self):
        if self.k is None:
            return None, None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


class RingKV:
    """Sliding layer: ``window`` slots, token t in slot t % window (a rotating buffer)."""

    def __init__(self, window: int):
        self.window = window
        self.k = self.v = None
        self.length = 0  # tokens written so far (the ring holds the last min(length, window))

    def _alloc(self, like: torch.Tensor):
        if self.k is None:
            b, h, _, d = like.shape
            self.k = like.new_zeros(b, h, self.window, d)
            self.v = like.new_zeros(b, h, self.window, d)

    def _slots(self, first: int, stop: int) -> torch.Tensor:
        """Ring slots of sequence indices first..stop-1, oldest first."""
        return torch.arange(first, stop, device=self.k.device) % self.window

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int):
        self._alloc(k)
        n, w = k.shape[2], self.window
        if n == 1:  # decode step: overwrite the oldest slot, then read the ring back in order
            slot = start % w
            self.k[:, :, slot] = k[:, :, 0]
            self.v[:, :, slot] = v[:, :, 0]
            self.length = start + 1
            order = self._slots(max(0, self.length - w), self.length)
            return self.k[:, :, order], self.v[:, :, order]
        # prefill chunk: the chunk may be longer than the ring, so attend over (old tail + chunk) first
        order = self._slots(max(0, start - (w - 1)), start)
        keys = torch.cat([self.k[:, :, order], k], dim=2)
        vals = torch.cat([self.v[:, :, order], v], dim=2)
        keep = min(n, w)
        dst = self._slots(start + n - keep, start + n)
        self.k.index_copy_(2, dst, k[:, :, n - keep :])
        self.v.index_copy_(2, dst, v[:, :, n - keep :])
        self.length = start + n
        return keys, vals

    def ordered(self, last: int | None = None):
        """The last ``last`` tokens held (default: all held), oldest first."""
        if self.k is None:
            return None, None
        held = min(self.length, self.window if last is None else last)
        order = self._slots(self.length - held, self.length)
        return self.k[:, :, order], self.v[:, :, order]


class KVCache:
    def __init__(self, args: Olmo3Args, max_len: int):
        self.layers = [RingKV(args.window) if kind == SLIDING else FlatKV(max_len) for kind in args.layer_kinds]
        self.pos = 0  # tokens fed so far, padding included


# ----------------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class Rotary(nn.Module):
    """Default RoPE, half-split pairing (dim i with dim i + head_dim/2)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor):
        """positions (batch, n) -> cos, sin (batch, 1, n, head_dim/2) in float32."""
        exps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta**exps)
        angles = positions.float()[..., None] * inv_freq
        return angles.cos()[:, None], angles.sin()[:, None]


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: Olmo3Args, kind: str):
        super().__init__()
        self.kind = kind
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, q_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(q_dim, args.dim, bias=args.qkv_bias)
        self.q_norm = RMSNorm(q_dim, args.norm_eps)
        self.k_norm = RMSNorm(kv_dim, args.norm_eps)

    def forward(self, x, cos, sin, mask, kv=None, start: int = 0):
        bsz, n, _ = x.shape
        q = self.q_norm(self.wq(x)).view(bsz, n, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_norm(self.wk(x)).view(bsz, n, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(bsz, n, self.n_kv, self.hd).transpose(1, 2)
        q = parity.tap(rope_rotate(q, cos, sin), "q_rot")
        k = rope_rotate(k, cos, sin)
        if kv is not None:
            k, v = kv.update(k, v, start)
        k = parity.tap(k, "k_rot")  # (batch, kv_heads, L, hd), oldest first
        L, g = k.shape[2], self.n_heads // self.n_kv
        # GQA without copying K/V: group the query heads under their kv head
        qg = q.reshape(bsz, self.n_kv, g, n, self.hd)
        scores = (qg @ k.unsqueeze(2).transpose(-1, -2)) * self.scale
        scores = scores.reshape(bsz, self.n_heads, n, L) + mask
        probs = parity.tap(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), "probs")
        out = probs.reshape(bsz, self.n_kv, g, n, L) @ v.unsqueeze(2)
        out = out.reshape(bsz, self.n_heads, n, self.hd).transpose(1, 2).reshape(bsz, n, -1)
        return self.wo(out)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: Olmo3Args, kind: str):
        super().__init__()
        self.kind = kind
        self.attn = Attention(args, kind)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = SwiGLU(args.dim, args.ffn_dim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, mask, kv=None, start: int = 0):
        x = x + self.attn_norm(self.attn(x, cos, sin, mask, kv, start))
        return x + self.ffn_norm(self.ffn(x))


class Olmo3LM(nn.Module):
    def __init__(self, args: Olmo3Args):
        super().__init__()
        self.args = args
        self.tok_emb = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(Block(args, kind) for kind in args.layer_kinds)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.ropes = nn.ModuleDict(
            {k: Rotary(args.head_dim, args.rope_theta[k]) for k in sorted(set(args.layer_kinds))}
        )

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache(self.args, max_len or self.args.max_seq_len)

    def _mask(self, kind, start, n, pad, bsz, dtype, device):
        """Additive mask (batch|1, 1, n, L) over the keys this layer kind reads: sequence indices first..start+n-1."""
        window = self.args.window if kind == SLIDING else None
        first = max(0, start - (window - 1)) if window else 0
        qi = torch.arange(start, start + n, device=device)[:, None]
        ki = torch.arange(first, start + n, device=device)[None, :]
        ok = ki <= qi
        if window:
            ok = ok & (ki > qi - window)
        ok = ok[None, None]
        if pad is not None:
            ok = ok & pad[:, first : start + n].bool()[:, None, None, :]
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(ok, zero, torch.finfo(dtype).min)

    def forward(self, idx, attention_mask=None, position_ids=None, cache: KVCache | None = None):
        """idx (batch, n) new tokens -> logits (batch, n, vocab).

        attention_mask: (batch, tokens so far incl. these) with 0 on padding, or None.
        position_ids: RoPE positions of the new tokens (batch, n); default cache.pos + arange(n).
        """
        bsz, n = idx.shape
        start = cache.pos if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + n, device=idx.device)[None].expand(bsz, n)
        elif position_ids.dim() == 1:
            position_ids = position_ids[None].expand(bsz, n)
        if attention_mask is not None and attention_mask.shape[-1] != start + n:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens, expected {start + n}")
        x = self.tok_emb(idx)
        rope = {kind: rot(position_ids) for kind, rot in self.ropes.items()}
        masks = {kind: self._mask(kind, start, n, attention_mask, bsz, x.dtype, x.device) for kind in self.ropes}
        for i, block in enumerate(self.blocks):
            cos, sin = rope[block.kind]
            kv = cache.layers[i] if cache is not None else None
            x = block(x, cos, sin, masks[block.kind], kv, start)
        if cache is not None:
            cache.pos = start + n
        return self.output(self.norm(x))


# ----------------------------------------------------------------------------------------------- loading

_BLOCK_RENAMES = {
    "self_attn.q_proj": "attn.wq",
    "self_attn.k_proj": "attn.wk",
    "self_attn.v_proj": "attn.wv",
    "self_attn.o_proj": "attn.wo",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "post_attention_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn.w1",
    "mlp.up_proj": "ffn.w3",
    "mlp.down_proj": "ffn.w2",
    "post_feedforward_layernorm": "ffn_norm",
}


def _our_name(hf_key: str) -> str | None:
    if hf_key == "model.embed_tokens.weight":
        return "tok_emb.weight"
    if hf_key == "model.norm.weight":
        return "norm.weight"
    if hf_key == "lm_head.weight":
        return "output.weight"
    if hf_key.startswith("model.layers."):
        i, rest = hf_key[len("model.layers.") :].split(".", 1)
        module, leaf = rest.rsplit(".", 1)
        if module in _BLOCK_RENAMES:
            return f"blocks.{i}.{_BLOCK_RENAMES[module]}.{leaf}"
    return None


def build(state_dict, hf_config) -> nn.Module:
    args = Olmo3Args.from_hf(hf_config)
    with torch.device("meta"):
        model = Olmo3LM(args)
    ours = {}
    for key, tensor in state_dict.items():
        name = _our_name(key)
        if name is None:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            raise KeyError(f"unexpected checkpoint key {key!r}")
        if name == "output.weight" and args.tie_embeddings:
            continue
        ours[name] = tensor
    if args.tie_embeddings:
        ours["output.weight"] = ours["tok_emb.weight"]
    model.load_state_dict(ours, strict=True, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_emb.weight
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------- parity


def _cached_layers(cache: KVCache):
    out = []
    for layer in cache.layers:
        if isinstance(layer, RingKV):
            out.append(layer.ordered(last=layer.window - 1))  # what Transformers' sliding layer keeps
        else:
            out.append(layer.ordered())
    return out


def cache_protocol() -> CacheProtocol:
    return CacheProtocol(
        new_cache=lambda model: model.new_cache(),
        forward=lambda model, ids, mask, pos, cache: model(ids, attention_mask=mask, position_ids=pos, cache=cache),
        layers=_cached_layers,
    )
