"""Layer-type patterns of hybrid sliding-window / full-attention models."""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"


def every_nth_full(n_layers: int, period: int) -> list[str]:
    """Every ``period``-th layer full attention, the rest sliding window (OLMo 3 and Cohere 2 use 4).

    With fewer than ``period`` layers the last one is made full, so a truncated shape config still
    has both layer types to compare.
    """
    types = [FULL if (i + 1) % period == 0 else SLIDING for i in range(n_layers)]
    if FULL not in types and n_layers > 1:
        types[-1] = FULL
    return types
