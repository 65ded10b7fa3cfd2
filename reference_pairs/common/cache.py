"""A cache for the from-scratch models: per layer, what generation keeps between calls. An attention
layer keeps its keys after RoPE and its values; a linear-attention layer keeps a state instead.

Semantics of Transformers 5's ``DynamicCache`` (``DynamicLayer`` / ``DynamicSlidingWindowLayer``):
a layer's new keys are appended to what it holds and attention reads the whole (past + new); a full
layer then keeps everything, a sliding layer keeps only the last ``window - 1`` tokens (all any later
query can see: itself plus ``window - 1`` earlier keys), also when a chunk of several tokens arrives
at once. Each layer counts the tokens it has seen, so the attention knows the sequence index of its
queries and of the keys it reads (masks are built from indices, not from positions: a left-padded
row's positions start later than its indices).

A ``linear_attention`` layer (Gated DeltaNet) holds what ``LinearAttentionLayer`` holds: the last
``K`` inputs of its short causal convolution (``K`` the kernel: the next output reads ``K - 1`` of
them) and the delta rule's recurrent state ``S``, both replaced after every call
(:class:`LinearAttentionCacheLayer`). Its length never grows.
"""

from __future__ import annotations

import torch

from .layer_types import LINEAR


class CacheLayer:
    """One layer's cache. ``keys``/``values``: ``(batch, kv_heads, held, head_dim)`` or None before the
    first update; ``window``: the layer's sliding window (None: full attention); ``seen``: tokens seen."""

    def __init__(self, window: int | None = None):
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.seen = 0

    @property
    def held(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add this step's ``keys``/``values`` ``(batch, kv_heads, new, head_dim)``; return the keys and
        values attention reads now (past + new) and the sequence index of the first of them."""
        first = self.seen - self.held  # the sequence index of the oldest key held
        self.seen += keys.shape[-2]
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        self.keep(keys, values)
        return keys, values, first

    def keep(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """What the layer holds after a step: everything, or a sliding layer's last ``window - 1`` tokens
        (an overridable method: a fault injection replaces it)."""
        if self.window is not None:
            n = min(keys.shape[-2], self.window - 1)
            keys, values = keys[:, :, keys.shape[-2] - n :], values[:, :, values.shape[-2] - n :]
        self.keys, self.values = keys, values


class LinearAttentionCacheLayer:
    """One linear-attention layer's cache: ``conv_state`` ``(batch, channels, K)``, the last ``K``
    inputs of the short conv (zeros on the left while fewer have been seen), and ``recurrent_state``
    ``(batch, v_heads, d_k, d_v)`` float32, the delta rule's ``S`` after the last token; both None
    before the first call. ``seen``: tokens seen (the layer has no keys: ``keys``/``values`` stay None)."""

    keys = values = None

    def __init__(self):
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.seen = 0

    def update(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, tokens: int) -> None:
        """Replace the state with the one after this call's ``tokens`` tokens."""
        self.conv_state, self.recurrent_state = conv_state, recurrent_state
        self.seen += tokens


class KVCache:
    """Every layer's cache; ``layers[i]`` is layer ``i``'s: a :class:`CacheLayer` with that layer's
    window, or a :class:`LinearAttentionCacheLayer` where ``layer_types[i]`` is ``linear_attention``."""

    def __init__(self, windows, layer_types=None):
        layer_types = list(layer_types) if layer_types is not None else [None] * len(windows)
        self.layers = [
            LinearAttentionCacheLayer() if t == LINEAR else CacheLayer(w) for w, t in zip(windows, layer_types)
        ]

    @property
    def seen(self) -> int:
        return self.layers[0].seen if self.layers else 0
