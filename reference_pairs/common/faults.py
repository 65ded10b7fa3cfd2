"""Fault injections shared by families (GQA head expansion, norm swaps...). Each mutates one pair's
own objects only; see :class:`parity.faults.Fault`."""

from __future__ import annotations

import torch
from torch import nn

from parity.pair import Pair

from .norms import RMSNorm


def expand_kv_with_repeat(pair: Pair) -> None:
    """K/V heads tiled ``[K0, K1, K0, K1]`` (``repeat``) instead of ``[K0, K0, K1, K1]`` (onnx #7274)."""
    for block in pair.ours.blocks:
        att = block.att
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
        block.att.mask_scores = lambda scores, allowed: scores.masked_fill(~allowed, float("-inf"))


#: the padded batch F10 needs: rows after the first start with 5 padding tokens
LEFT_PADDED = (("batch_size", 3), ("left_pad", 5))
