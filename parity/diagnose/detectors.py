"""The detectors in the order they are tried, most specific evidence first (an exact match with
something else), most general last (a pattern), and :func:`diagnose`, which returns the first hint."""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.compare.metrics import CHOICE, MISSING, NONFINITE, SHAPE
from parity.compare.results import NodeResult
from parity.diagnose.cache import cached_state, chunk_boundary, conv_context, state_not_carried
from parity.diagnose.elementwise import activation, activation_function, nonfinite, rounding_order, soft_capping
from parity.diagnose.evidence import Evidence
from parity.diagnose.hints import Hint
from parity.diagnose.masks import future_keys, padding, sequence_shift, window_pattern
from parity.diagnose.moe import choice, expert_weights, row_normalisation
from parity.diagnose.norms import block_layout, norm_eps, norm_kind, norm_placement, norm_weight_offset
from parity.diagnose.rope import position_table_offset, rope_fit, rope_partial, rope_pattern
from parity.diagnose.scales import channel_ratio, constant_ratio, row_scale, softmax_temperature
from parity.diagnose.wiring import (
    gate_up_roles,
    head_mapping,
    kv_sharing,
    last_dim_permutation,
    other_layer,
    sibling_match,
    tap_layout,
    transposed_weight,
    untied_head,
)
from parity.model.facts import ArchFacts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

#: detectors tried in order on a node that has both tensors of one shape
DETECTORS: tuple[Callable[[Evidence], Hint | None], ...] = (
    tap_layout,
    kv_sharing,
    sibling_match,
    gate_up_roles,
    other_layer,
    untied_head,
    transposed_weight,
    expert_weights,
    rounding_order,
    padding,
    cached_state,
    conv_context,
    state_not_carried,
    activation_function,
    soft_capping,
    norm_eps,
    norm_weight_offset,
    norm_kind,
    block_layout,
    norm_placement,
    constant_ratio,
    row_normalisation,
    last_dim_permutation,
    position_table_offset,
    head_mapping,
    sequence_shift,
    softmax_temperature,
    future_keys,
    window_pattern,
    chunk_boundary,
    rope_partial,
    rope_fit,
    rope_pattern,
    channel_ratio,
    row_scale,
    activation,
)


def diagnose(
    result: NodeResult,
    ours_trace: Trace,
    ref_trace: Trace,
    facts: ArchFacts,
    positions: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    spec: NodeSpec | None = None,
) -> Hint | None:
    """A likely cause for a failing node, with its evidence; None if no pattern is recognised.
    ``positions``: ``(batch, seq)`` token positions of the run and ``attention_mask`` its padding
    (RoPE hints need them); ``spec``: the node's NodeSpec (which scores a choice was made from)."""
    if result.status == MISSING:
        return Hint("missing", f"likely a node-map or tap problem: {result.detail}")
    if result.status == SHAPE:
        return Hint("shape", f"likely a layout or head-count difference: {result.detail}")
    ours, ref = ours_trace.tensors.get(result.name), ref_trace.tensors.get(result.name)
    if ours is None or ref is None:  # a node compared as it ran and not kept: its metrics stand, no hint
        return (
            Hint("nonfinite", f"non-finite values appear first here: {result.detail}")
            if result.status == NONFINITE
            else None
        )
    e = Evidence(result, ours, ref, ours_trace, ref_trace, facts, positions, attention_mask)
    if result.status == NONFINITE:
        return nonfinite(e)
    if result.status == CHOICE:
        return choice(e, spec)
    if e.ours.shape != e.ref.shape or not e.ref.is_floating_point():
        return None
    for detect in DETECTORS:
        hint = detect(e)
        if hint is not None:
            return hint
    return None
