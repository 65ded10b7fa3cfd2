"""Hints from the pattern of a failing node's error. A hint says "likely" and shows its numbers;
it never changes the measured status."""

from __future__ import annotations

import torch

from .analysis import HEAD_MAJOR
from .compare import MISSING, NONFINITE, SHAPE, NodeResult
from .pair import Pair
from .trace import Trace


def _seq_axis(kind: str) -> int:
    return 2 if kind in HEAD_MAJOR else 1


def _error_by_position(ours: torch.Tensor, ref: torch.Tensor, axis: int) -> torch.Tensor:
    diff = (ours.double() - ref.double()).abs().movedim(axis, 0)
    return diff.reshape(diff.shape[0], -1).amax(dim=1)


def _constant_ratio(ours: torch.Tensor, ref: torch.Tensor) -> float | None:
    a, b = ours.double().flatten(), ref.double().flatten()
    keep = b.abs() > 1e-3 * b.abs().max()
    if int(keep.sum()) < 4:
        return None
    ratio = a[keep] / b[keep]
    mean = float(ratio.mean())
    if abs(mean) < 1e-12 or abs(mean - 1) < 1e-6:
        return None
    return mean if float(ratio.std()) / abs(mean) < 1e-3 else None


def _sibling_match(result: NodeResult, ours: torch.Tensor, ref_trace: Trace) -> str | None:
    """Name of another reference node of the same layer and shape that ours reproduces."""
    prefix = result.name.rsplit(".", 1)[0]
    for name, tensor in ref_trace.tensors.items():
        if name == result.name or not name.startswith(prefix) or tensor.shape != ours.shape:
            continue
        if torch.allclose(ours.double(), tensor.double(), atol=result.atol, rtol=result.rtol):
            return name
    return None


def diagnose(result: NodeResult, ours_trace: Trace, ref_trace: Trace, pair: Pair) -> str:
    """A likely cause for the first failing node, with its evidence; "" if no pattern is recognised."""
    if result.status == MISSING:
        return f"likely a node-map or tap problem: {result.detail}"
    if result.status == SHAPE:
        return f"likely a layout or head-count difference: {result.detail}"
    if result.status == NONFINITE:
        return f"non-finite values appear first here: {result.detail}"
    ours, ref = ours_trace.tensors[result.name], ref_trace.tensors[result.name]
    sibling = _sibling_match(result, ours, ref_trace)
    if sibling:
        return f"likely swapped or misassigned weights: ours matches the reference's {sibling} instead"
    ratio = _constant_ratio(ours, ref)
    if ratio is not None:
        return (
            f"likely a missing or extra scale: ours / reference = {ratio:.6g} everywhere, "
            f"reference / ours = {1 / ratio:.6g} (square roots {abs(ratio) ** 0.5:.6g}, {abs(1 / ratio) ** 0.5:.6g})"
        )
    axis = _seq_axis(result.kind)
    if ours.dim() > axis and ours.shape[axis] > 2:
        per_pos = _error_by_position(ours, ref, axis)
        tol = result.atol + result.rtol * float(ref.abs().max())
        bad = (per_pos > tol).nonzero().flatten().tolist()
        window = pair.cfg.get("sliding_window")
        if bad and window and result.kind == "probs" and min(bad) >= window:
            return (
                f"likely the sliding window size or mask: positions < {window} agree, "
                f"positions {bad[0]}..{bad[-1]} differ (max error {float(per_pos.max()):.3g})"
            )
        if bad and float(per_pos[0]) <= tol and float(per_pos[-1]) > float(per_pos[1]):
            return (
                f"likely RoPE frequencies, scaling or offset: position 0 agrees (error {float(per_pos[0]):.2g}), "
                f"error grows with position (pos 1: {float(per_pos[1]):.3g}, pos {len(per_pos) - 1}: "
                f"{float(per_pos[-1]):.3g})"
            )
    return ""
