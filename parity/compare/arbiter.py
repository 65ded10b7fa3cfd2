"""What the model returns arbitrates between a fault and a misread internal.

A user's model is aligned to the reference's nodes from the outside (its modules, its functions, its weights'
layout). Where a model computes a node in a form parity does not undo (every norm folded into the next product
with 1/rms applied after it, RoPE as separate real and imaginary projections, a latent attention whose key/value
up-projection is folded into the query and output weights, weights stacked per layer type read by one functional
forward), the value parity reads there is another product of ours, and it differs grossly from the reference's.
A fault that large would reach the logits; when ours' returned logits agree closely in the chained run (ours ran
on its own), the model is not wrong there: parity read the wrong value. Those nodes are not judged (untapped, the
reason in their detail) instead of failing a correct model at a false node.

Only gross differences are arbitrated: another shape, or ``||ours - ref|| / ||ref||`` of at least
:data:`NODE_REL` while the logits' own is at most :data:`OUTPUT_REL`. A small difference (an eps, a cast) stays a
failure even where the logits agree within their tolerance: it may be a real fault too small to cross the
logits' tolerance. A node the user tapped is never arbitrated: the tap's claim is the user's, judged as made.
Isolated runs are never arbitrated (their logits are computed from the reference's inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from parity.compare.metrics import MISMATCH, SHAPE, UNTAPPED
from parity.compare.results import NodeResult
from parity.model.pair import LOGITS

#: the logits agree at least this closely (relative L2 norm of the difference) for internals to be arbitrated
OUTPUT_REL = 1e-4
#: an internal differs at least this much (relative L2) or has another shape: far more than the logits allow
NODE_REL = 1e-2
#: the start of an arbitrated node's detail (the notes count them by it)
ARBITRATED = "differs while the logits agree"


def gross(r: NodeResult) -> bool:
    """A failure no fault could leave the logits agreeing after: another shape, or a relative difference of
    at least :data:`NODE_REL`."""
    if r.status == SHAPE:
        return True
    return r.status == MISMATCH and r.rel_l2 is not None and r.rel_l2 >= NODE_REL


def output_arbitrates(results: Sequence[NodeResult], declared: frozenset[str] = frozenset()) -> list[NodeResult]:
    """``results`` (a chained run of a user's model, in execution order) with each gross internal failure
    untapped when the ``logits`` node (what ours' forward returned) agrees within its tolerance and within
    :data:`OUTPUT_REL`; unchanged otherwise. ``declared``: nodes the user tapped (``parity.tap``): their claim
    is judged, not arbitrated (a tap in another layout than it says fails with the hint naming the fix)."""
    out = list(results)
    logits = next((r for r in out if r.name == LOGITS), None)
    if logits is None or not logits.passed or logits.rel_l2 is None or logits.rel_l2 > OUTPUT_REL:
        return out
    for i, r in enumerate(out):
        if r.name == LOGITS or r.name in declared or not r.failed or not gross(r):
            continue
        how = "another shape" if r.status == SHAPE else f"relative difference {r.rel_l2:.3g}"
        out[i] = replace(
            r,
            status=UNTAPPED,
            detail=f"{ARBITRATED} (theirs {logits.rel_l2:.2g} relative, this node's {how}): what parity read in "
            "ours here is another value than this node's (a folded or rearranged computation); not judged: tap the "
            f"node with parity.tap or map it with node_map to judge it{'; ' + r.detail if r.detail else ''}",
        )
    return out


def is_arbitrated(r: NodeResult) -> bool:
    """Whether the logits arbitrated ``r`` (:func:`output_arbitrates`)."""
    return r.status == UNTAPPED and r.detail.startswith(ARBITRATED)


def arbitrated_like(isolated: Sequence[NodeResult], chained: Sequence[NodeResult]) -> list[NodeResult]:
    """The isolated run's failures at the nodes the chained run's logits arbitrated (:func:`output_arbitrates`),
    untapped with the same reason: the same misread value, whichever inputs fed it."""
    reasons = {r.name: r.detail for r in chained if is_arbitrated(r)}
    return [
        replace(r, status=UNTAPPED, detail=reasons[r.name]) if r.failed and r.name in reasons else r for r in isolated
    ]


def arbitrated_note(results: Sequence[NodeResult]) -> str | None:
    """One line naming the nodes the logits arbitrated, or None."""
    names = [r.name for r in results if is_arbitrated(r)]
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"{len(names)} node{'s' if len(names) != 1 else ''} of ours differ grossly while the logits agree: {shown}; "
        "parity read another value of ours there (not judged); tap them with parity.tap to judge them"
    )
