"""Detectors of mixtures of experts: an expert computing with another's weights, top-k weights
renormalised on one side only, a router choosing otherwise (with the reference's margin)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from parity.compare.metrics import choice_margins
from parity.diagnose.evidence import EXPLAINS, Evidence, fmt_list, rel
from parity.diagnose.hints import Hint
from parity.model.pair import NodeSpec

if TYPE_CHECKING:
    from parity.record.hf_capture import ExpertEvidence


def row_normalisation(e: Evidence) -> Hint | None:
    """ours / reference is one factor per row (over the last axis), different across rows, and one
    side's rows sum to 1: a normalisation over the last axis on one side only (top-k routing weights
    renormalised, or not, against ``norm_topk_prob``)."""
    if e.ours.dim() < 2 or e.ours.shape[-1] < 2 or not e.ref.is_floating_point():
        return None
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    if a.shape[0] < 2 or bool((b.abs() < 1e-12).any()):
        return None
    ratio = a / b
    per_row = ratio.mean(-1)
    if float((ratio.std(-1) / per_row.abs()).max()) > 1e-3 or float(per_row.std() / per_row.abs().mean()) < 1e-3:
        return None  # not one factor per row, or one factor everywhere (constant_ratio's case)
    tol = max(1e-3, 4 * float(torch.finfo(e.ref.dtype).eps))
    ours_one, ref_one = bool(((a.sum(-1) - 1).abs() < tol).all()), bool(((b.sum(-1) - 1).abs() < tol).all())
    if ours_one == ref_one:
        return None
    side, other = ("ours", "the reference") if ours_one else ("the reference", "ours")
    return Hint(
        "renormalisation",
        f"likely a normalisation over the last axis on one side only: {side} sums to 1 in every row, {other} does "
        f"not, and ours / reference is one factor per row ({float(per_row.min()):.4g}..{float(per_row.max()):.4g}); "
        "for top-k routing weights: renormalised over the chosen experts where the config says not, or the reverse "
        "(norm_topk_prob)",
        {
            "ours_sums_to_one": ours_one,
            "reference_sums_to_one": ref_one,
            "ratio_min": float(per_row.min()),
            "ratio_max": float(per_row.max()),
        },
    )


def expert_weights(e: Evidence) -> Hint | None:
    """One expert's output explained by the reference's experts under another weight assignment:
    another expert's weights (experts indexed in another order), or this expert with its fused gate
    and up halves swapped."""
    record = cast("ExpertEvidence | None", e.ref_trace.extras.get(e.name))  # what hf_capture leaves there
    if record is None or not hasattr(record, "output") or len(record.rows) == 0:
        return None
    ours = e.ours.double()[record.rows]
    if not bool(torch.isfinite(ours).all()):
        return None
    halves = record.output(record.index, swap_halves=True)
    if halves is None:
        return None
    if rel(ours, halves) < EXPLAINS:
        return Hint(
            "swapped_weights",
            f"likely the fused gate/up projection split the wrong way round: ours equals the reference's expert "
            f"{record.index} with its gate and up halves swapped (residual {rel(ours, halves):.1e})",
            {"expert": record.index, "residual": rel(ours, halves)},
        )
    for j in range(record.num_experts):
        if j == record.index:
            continue
        other = record.output(j)
        if other is not None and rel(ours, other) < EXPLAINS:
            return Hint(
                "expert_mapping",
                f"likely experts indexed in another order: ours' expert {record.index} computes with the reference's "
                f"expert {j} weights on its {len(record.rows)} token{'s' if len(record.rows) != 1 else ''} "
                f"(residual {rel(ours, other):.1e})",
                {"expert": record.index, "matches": j, "tokens": len(record.rows)},
            )
    return None


def choice(e: Evidence, spec: NodeSpec | None) -> Hint:
    """A different choice at an integer node (top-k experts): where, whether it is the same set in
    another order, and how near a tie the reference's scores were there."""
    scores = e.ref_trace.tensors.get(spec.chosen_from) if spec is not None and spec.chosen_from else None
    found = choice_margins(e.ours, e.ref, scores)
    rows = found["rows"]
    where = f"rows {fmt_list(rows, 8)}"
    if e.positions is not None and e.positions.numel() == found["total"]:
        seq = e.positions.shape[1]
        where = "tokens " + fmt_list([f"(row {r // seq}, position {r % seq})" for r in rows], 6)
    evidence: dict = {"rows": rows[:64], "same_set": found["same_set"][:64]}
    if found["same_set"] and len(found["same_set"]) == len(rows):
        return Hint(
            "routing",
            f"likely the same experts chosen in another order (top-k sorted differently) at {where}; "
            "the combined output is unaffected unless the order is used",
            evidence,
        )
    text = f"likely a different expert choice at {where} ({len(rows)} of {found['total']} tokens)"
    margins = found["margins"]
    if margins:
        evidence["margins"] = margins[:64]
        assert scores is not None  # margins come from the reference's scores
        s = scores.detach().double()
        floor = 8 * float(torch.finfo(scores.dtype).eps) * float(s.abs().max()) if scores.is_floating_point() else 0.0
        near = [m for m in margins if m <= floor]
        if len(near) == len(margins):
            text += (
                f": the reference's scores there are near-ties (margin {max(margins):.2g} between its last chosen and "
                f"first unchosen expert, within rounding): a numerical accident upstream decides, not a routing bug"
            )
        else:
            text += (
                f": the reference's margin between its last chosen and first unchosen score there is "
                f"{min(margins):.3g}..{max(margins):.3g}, not a near-tie: the router scores or the top-k differ"
            )
    return Hint("routing", text, evidence)
