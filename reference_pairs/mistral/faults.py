"""Mistral fault catalogue for ``parity selftest mistral``: the sliding window (one too wide, or a
Llama port that has none) and shared/cases F07, F10. Each fault changes our modules only."""

from __future__ import annotations

from parity.faults import Fault

from ..common.faults import LEFT_PADDED, expand_kv_with_repeat, mask_with_neg_inf

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
    Fault("window-off-by-one", "sliding window one key too wide on every layer", "tiny", _window_plus_one,
          f"{ATT.format(0)}.probs", "sliding_window", scope=f"{ATT.format('*')}.probs"),
    Fault("no-window", "no sliding window: full causal attention (Mistral run as a Llama)", "tiny", _no_window,
          f"{ATT.format(0)}.probs", "sliding_window", scope=f"{ATT.format('*')}.probs"),
    Fault("F07", "K/V heads expanded with repeat instead of repeat_interleave", "tiny", expand_kv_with_repeat,
          f"{ATT.format(0)}.scores", "head_mapping", scope=ATT.format("*"), source="onnx #7274"),
    Fault("F10", "masked scores filled with -inf: fully masked (left-pad) query rows give NaN", "tiny",
          mask_with_neg_inf, f"{ATT.format(0)}.probs", "nonfinite", scope=f"{ATT.format('*')}.probs",
          source="unsloth #9848", check_kwargs=LEFT_PADDED),
)
