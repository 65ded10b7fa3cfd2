"""Mistral fault catalogue for ``parity selftest mistral``: the sliding window (one too wide, or a
Llama port that has none) and shared/cases F07, F10. Each fault changes our modules only."""

from __future__ import annotations

from parity.selftest.faults import Fault

from ..common.faults import f07_repeat_kv, f10_masked_neg_inf

ATT = "model.layers.{}.self_attn"


def _window_plus_one(pair):
    """Each query sees one key more than ``sliding_window`` allows (``i - j <= window``, not ``<``)."""
    for block in pair.ours.blocks:
        block.att.sliding_window += 1


def _no_window(pair):
    """A Llama port run on Mistral: full causal attention on every layer."""
    for block in pair.ours.blocks:
        block.att.sliding_window = None


FAULTS = (
    Fault(
        "window-off-by-one",
        "sliding window one key too wide on every layer",
        "tiny",
        _window_plus_one,
        f"{ATT.format(0)}.probs",
        "sliding_window",
        scope=f"{ATT.format('*')}.probs",
        source="transformers #29623, vllm #3385",
    ),
    Fault(
        "no-window",
        "no sliding window: full causal attention (Mistral run as a Llama)",
        "tiny",
        _no_window,
        f"{ATT.format(0)}.probs",
        "sliding_window",
        scope=f"{ATT.format('*')}.probs",
    ),
    f07_repeat_kv(ATT),
    f10_masked_neg_inf(ATT),
)
