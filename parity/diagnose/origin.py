"""The origin of a chained failure: where an error that fails downstream actually starts.

In chained mode errors compound, so the first node past tolerance can lie far downstream of the
node that went wrong (a one-ulp rounding difference in a bf16 norm fails only at the logits). The
origin is the earliest node whose *own* error (isolated mode: fed the reference's input) stands out
above the noise the reference itself has against a float64 copy of itself: ``own > FACTOR x noise``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from parity.compare.results import NodeResult

#: an own error this many times the reference's float64 noise stands out
FACTOR = 4.0
#: below this, an own error is zero in every dtype that matters (exactly representable nodes)
TINY = 1e-12


def find_origin(
    chained: Sequence[NodeResult], isolated: Sequence[NodeResult], noise: Mapping[str, float]
) -> tuple[NodeResult | None, str]:
    """``(origin node of the isolated run, one sentence)``; ``(None, "")`` when the first chained
    mismatch is its own origin; ``(None, why)`` when no node's own error stands out (the downstream
    mismatch is compounded rounding). ``noise``: node -> max |reference - reference in float64| on
    the same inputs."""
    bad = next((r for r in chained if r.failed), None)
    if bad is None or bad.status != "mismatch":
        return None, ""  # a shape, a missing node, a non-finite value or another choice is no rounding's doing
    loudest: tuple[float, NodeResult | None] = (0.0, None)
    node: NodeResult | None
    for node in isolated:
        if node.index > bad.index:
            break  # only a node at or before the first mismatch can be where it starts
        own = node.max_abs
        if not node.judged or own is None or own <= TINY:
            continue
        floor = noise.get(node.name)
        if floor is None:
            continue
        loudest = max(loudest, (own / max(floor, TINY), node), key=lambda t: t[0])
        if own > FACTOR * max(floor, TINY):
            if node.name == bad.name:
                return None, ""
            reason = (
                f"{node.name} is where the error starts: on its own (fed the reference's input) it differs by "
                f"{own:.3g}, {own / max(floor, TINY):.3g}x the reference's own rounding noise there ({floor:.3g}, "
                f"against float64); the first node past tolerance, {bad.name}, is downstream of it"
            )
            return node, reason
    ratio, node = loudest
    if node is None:
        return None, ""
    return None, (
        f"no node's own error stands out above the reference's own rounding noise (the largest, at {node.name}, is "
        f"{ratio:.2g}x it): {bad.name} fails from roundings compounding through the layers; the first divergence "
        "shows where they start"
    )
