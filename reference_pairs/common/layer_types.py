"""Layer-type patterns of hybrid models: sliding-window or linear-attention layers between full-attention ones."""

from __future__ import annotations

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


def every_nth_full(n_layers: int, period: int, other: str = SLIDING) -> list[str]:
    """Every ``period``-th layer full attention, the rest ``other``: sliding window (OLMo 3 and Cohere 2
    use 4) or linear attention (Qwen3.5: ``full_attention_interval`` 4).

    With fewer than ``period`` layers the last one is made full, so a truncated shape config still
    has both layer types to compare.
    """
    types = [FULL if (i + 1) % period == 0 else other for i in range(n_layers)]
    if FULL not in types and n_layers > 1:
        types[-1] = FULL
    return types
