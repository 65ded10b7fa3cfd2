"""Fault injections shared by families (GQA head expansion, norm swaps...). Each mutates one pair's
own objects only; see :class:`parity.selftest.faults.Fault`."""

from __future__ import annotations

import torch
from torch import nn

from parity.model.pair import Pair
from parity.selftest.faults import Fault

from .norms import RMSNorm


def to_half_split_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved q/k rows (RoPE pairs ``2i, 2i + 1``) -> Transformers' half-split rows (``i,
    i + d/2``), grouping rows in ``n_heads`` heads: the permute of ``convert_llama_weights_to_hf.py``."""
    out, d_in = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(out, d_in)


def to_interleaved_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_half_split_rows`: Transformers' q/k rows back in Meta's layout."""
    out, d_in = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, d_in).transpose(1, 2).reshape(out, d_in)


def expand_kv_with_repeat(pair: Pair) -> None:
    """K/V heads tiled ``[K0, K1, K0, K1]`` (``repeat``) instead of ``[K0, K0, K1, K1]`` (onnx #7274)."""
    for block in pair.ours.blocks:
        att = block.att
        if hasattr(att, "expand_kv"):  # softmax attention layers only (not a linear-attention layer)
            att.expand_kv = lambda t, g=att.group_size: t.repeat(1, g, 1, 1)


class PerHeadRMSNorm(nn.Module):
    """A whole-projection RMSNorm's weight applied per head: each head normalised on its own."""

    def __init__(self, whole: RMSNorm, head_dim: int):
        super().__init__()
        self.weight, self.eps, self.head_dim = whole.weight, whole.eps, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.float().unflatten(-1, (-1, self.head_dim))
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * heads.flatten(-2)).to(x.dtype)


class WholeProjectionRMSNorm(nn.Module):
    """A per-head RMSNorm's weight applied after normalising every head of a token together (the
    whole projection, OLMo's way) instead of each head on its own: input ``(..., heads, head_dim)``."""

    def __init__(self, per_head: RMSNorm):
        super().__init__()
        self.weight, self.eps, self.cast_first = per_head.weight, per_head.eps, per_head.cast_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean((-2, -1), keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype) if self.cast_first else (self.weight * normed).to(x.dtype)


def rms_instead_of(norm: nn.Module) -> RMSNorm:
    """An RMSNorm with ``norm``'s weight and eps (a LayerNorm re-implemented without mean subtraction)."""
    replacement = RMSNorm(norm.weight.shape[0], eps=norm.eps)
    replacement.weight = norm.weight
    return replacement


def untie_head(pair: Pair) -> None:
    """The output head as its own, never loaded Parameter (tinygrad #13796)."""
    head = pair.ours.out_head
    gen = torch.Generator().manual_seed(1234)
    fresh = torch.randn(head.weight.shape, generator=gen) * head.weight.shape[1] ** -0.5
    head.weight = nn.Parameter(fresh.to(head.weight.dtype), requires_grad=False)


def mask_with_neg_inf(pair: Pair) -> None:
    """Masked scores filled with -inf: a query row with no real key (left padding) becomes NaN (unsloth #9848)."""
    for block in pair.ours.blocks:
        if hasattr(block.att, "mask_scores"):
            block.att.mask_scores = lambda scores, allowed: scores.masked_fill(~allowed, float("-inf"))


#: the padded batch F10 needs: rows after the first start with 5 padding tokens
LEFT_PADDED = (("batch_size", 3), ("left_pad", 5))


# --- catalogue entries every family with that part has (one per handed case) -------------------------


def f07_repeat_kv(attention: str, config: str = "tiny", layer: int | str = 0, scope: str = "*") -> Fault:
    """F07: K/V heads tiled instead of repeat-interleaved, first seen at ``attention``'s ``scores``
    (``attention`` a template with ``{}`` for the layer: ``model.layers.{}.self_attn``)."""
    return Fault(
        "F07",
        "K/V heads expanded with repeat instead of repeat_interleave",
        config,
        expand_kv_with_repeat,
        f"{attention.format(layer)}.scores",
        "head_mapping",
        scope=attention.format(scope),
        source="onnx #7274",
    )


def f08_untied_head(config: str = "tiny", why: str = "") -> Fault:
    """F08: the output head its own Parameter, never loaded or tied (``why``: what the family's real
    models do, said in the description)."""
    return Fault(
        "F08",
        "output head its own Parameter, never loaded or tied" + (f" ({why})" if why else ""),
        config,
        untie_head,
        "lm_head",
        "untied_head",
        source="tinygrad #13796",
    )


def f10_masked_neg_inf(attention: str, config: str = "tiny", layer: int | str = 0, scope: str = "*") -> Fault:
    """F10: masked scores filled with -inf, so a left-padded row with no real key gives NaN at
    ``attention``'s ``probs`` (a padded batch)."""
    return Fault(
        "F10",
        "masked scores filled with -inf: fully masked (left-pad) query rows give NaN",
        config,
        mask_with_neg_inf,
        f"{attention.format(layer)}.probs",
        "nonfinite",
        scope=f"{attention.format(scope)}.probs",
        source="unsloth #9848",
        check_kwargs=LEFT_PADDED,
    )


# --- KV-cache faults (decode checks) ----------------------------------------------------------------


def _patch_new_cache(pair: Pair, patch_layer) -> None:
    """Make ``pair.ours.new_cache()`` hand out caches whose layers ``patch_layer(i, layer)`` altered."""
    make = pair.ours.new_cache

    def new_cache():
        cache = make()
        for i, layer in enumerate(cache.layers):
            patch_layer(i, layer)
        return cache

    pair.ours.new_cache = new_cache


def sliding_cache_trimmed_as_if_one_token(pair: Pair) -> None:
    """A sliding layer's cache keeps ``window - 1`` plus ``S - 1`` tokens when ``S`` arrive at once: the
    trim is computed as if one token had come (mlx-lm #1914)."""

    def patch(i, layer):
        if layer.window is None:
            return

        def update(keys, values, layer=layer):
            arriving = keys.shape[-2]
            first = layer.seen - layer.held
            layer.seen += arriving
            if layer.keys is not None:
                keys, values = torch.cat([layer.keys, keys], -2), torch.cat([layer.values, values], -2)
            n = min(keys.shape[-2], layer.window - 1 + arriving - 1)
            layer.keys, layer.values = keys[:, :, keys.shape[-2] - n :], values[:, :, values.shape[-2] - n :]
            return keys, values, first

        layer.update = update

    _patch_new_cache(pair, patch)


def cached_positions_off_by_one(first_layer: int):
    """From layer ``first_layer`` up, once the cache holds tokens, RoPE rotates the new tokens one
    position too far (a position counter read after an earlier layer advanced it)."""

    def inject(pair: Pair) -> None:
        model = pair.ours
        tables = model.rope_tables

        for block in list(model.blocks)[first_layer:]:
            forward = block.forward

            def shifted(x, cos=None, sin=None, padding_mask=None, cache=None, _forward=forward, _block=block):
                if cache is not None and cache.seen > 0 and cos is not None:
                    positions = model._parity_positions + 1
                    cos, sin = tables(positions, x.device, cos.dtype)[_block.layer_type]
                return _forward(x, cos, sin, padding_mask, cache)

            block.forward = shifted

        def remember(module, args, kwargs):
            ids = args[0] if args else kwargs["input_ids"]
            cache = kwargs.get("cache")
            positions = kwargs.get("position_ids")
            if positions is None:
                start = cache.seen if cache is not None else 0
                positions = torch.arange(start, start + ids.shape[1])
            model._parity_positions = positions

        model.register_forward_pre_hook(remember, with_kwargs=True)

    return inject


def cached_mask_sees_one_ahead(pair: Pair) -> None:
    """With a cache, each query of a chunk may also see the next key of its chunk (a decode-time mask
    built one slot wide)."""
    for block in pair.ours.blocks:
        att = block.att
        masked = att.mask_scores

        def mask_scores(scores, allowed, _masked=masked):
            if scores.shape[-1] > scores.shape[-2]:  # keys from earlier steps: a cached step
                allowed = allowed | torch.nn.functional.pad(allowed, (1, 0))[..., :-1]
            return _masked(scores, allowed)

        att.mask_scores = mask_scores


#: the decode schedule the cached faults run on: prefill 12 in chunks of 4, then 4 decode steps
DECODE = (("decode", "12:4x4"),)
