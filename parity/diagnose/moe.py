"""Detectors of mixtures of experts: an expert computing with another's weights or on another expert's
tokens, top-k weights renormalised on one side only or formed without a softmax, a router choosing
otherwise (with the reference's margin)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch

from parity.compare.metrics import UNTAPPED, choice_margins
from parity.diagnose.evidence import EXPLAINS, Evidence, constant_named, fmt_list, reads_stream, rel, whose
from parity.diagnose.hints import Hint
from parity.model.pair import NodeSpec
from parity.record.routing import CHOICES
from parity.util.rounding import rounded

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
    if e.kind == "router.weights":  # each side lists its top k in its own order (sorted or not): by value
        a, b = a.sort(-1).values, b.sort(-1).values
    ratio = a / b
    per_row = ratio.mean(-1)
    if float((ratio.std(-1) / per_row.abs()).max()) > 1e-3 or float(per_row.std() / per_row.abs().mean()) < 1e-3:
        return None  # not one factor per row, or one factor everywhere (constant_ratio's case)
    tol = max(1e-3, 4 * float(torch.finfo(e.ref.dtype).eps))

    def total(t: torch.Tensor) -> float | None:
        """The one sum every row has (1, or a scale after the normalisation: DeepSeek's routed_scaling_factor)."""
        sums = t.sum(-1)
        c = float(sums.mean())
        return c if c > 0 and bool(((sums - c).abs() < tol * c).all()) else None

    ours_total, ref_total = total(a), total(b)
    if (ours_total is None) == (ref_total is None):
        return None
    side, other = ("ours", "the reference") if ours_total is not None else ("the reference", "ours")
    c = cast(float, ours_total if ours_total is not None else ref_total)
    sums = "1" if abs(c - 1) < tol else f"{c:.6g} (1 times a scale after it{constant_named(e, c)})"
    return Hint(
        "renormalisation",
        f"likely a normalisation over the last axis on one side only: {side} sums to {sums} in every row, {other} "
        f"does not, and ours / reference is one factor per row ({float(per_row.min()):.4g}.."
        f"{float(per_row.max()):.4g}); for top-k routing weights: renormalised over the chosen experts where the "
        "config says not, or the reverse (norm_topk_prob)",
        {
            "ours_sums_to_one": ours_total is not None and abs(ours_total - 1) < tol,
            "reference_sums_to_one": ref_total is not None and abs(ref_total - 1) < tol,
            "row_sum": c,
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


def experts_sum(e: Evidence) -> Hint | None:
    """The experts' weighted sum (``mlp.experts``) of a block whose experts ours holds stacked (no node of
    ours per expert), read against the reference's per-expert outputs ``E_e``, its routing weights ``W``
    and choices ``I``: ours leaves one expert out (a loop that stops one short), ours combines the right
    experts' outputs with other weights (weights flattened in another order), or ours' experts compute
    with their fused gate/up rows read another way (halves swapped, interleaved pairs)."""
    if e.kind != "experts" or e.ours.numel() != e.ref.numel():
        return None
    block = e.name.rpartition(".")[0]
    weights = e.ref_trace.tensors.get(f"{block}.router.weights")
    chosen = e.ref_trace.tensors.get(f"{block}.router.experts")
    if weights is None or chosen is None or chosen.dim() != 2 or weights.shape != chosen.shape:
        return None
    tokens, k = chosen.shape
    n = int(chosen.max()) + 1
    ref = e.ref.double().reshape(tokens, -1)
    ours = e.ours.double().reshape(tokens, -1)
    outputs = [t for x in range(n) if (t := e.ref_trace.tensors.get(f"{e.name}.{x}")) is not None]
    if len(outputs) != n or any(o.shape != ref.shape for o in outputs) or not bool(torch.isfinite(ours).all()):
        return None
    w, idx = weights.double(), chosen.long()
    parts = torch.stack([o.double() for o in outputs])[idx, torch.arange(tokens)[:, None]]  # (tokens, k, hidden)
    if rel(ref, (w[..., None] * parts).sum(1)) >= EXPLAINS:
        return None  # the reference's sum is not what its per-expert nodes say
    for x in range(n):
        if rel(ours, (w * (idx != x))[..., None].mul(parts).sum(1)) < EXPLAINS:
            return Hint(
                "expert_missing",
                f"likely expert {x} left out in ours: its output equals the reference's weighted sum without expert "
                f"{x}'s share on the {int((idx == x).any(-1).sum())} tokens routed to it (a loop over experts that "
                "stops one short, or the index taken for a sentinel)",
                {"expert": x},
            )
    # ours as the chosen experts' outputs, combined per token with weights of its own (least squares)
    solved = torch.linalg.lstsq(parts.transpose(1, 2), ours[..., None]).solution[..., 0]  # (tokens, k)
    if rel(ours, (solved[..., None] * parts).sum(1)) < EXPLAINS:
        layouts = {"the (tokens, k) weights transposed before they are flattened": w.t().reshape(tokens, k)}
        how = next((label for label, v in layouts.items() if rel(solved, v) < 1e-4), None)
        kept = w.abs() > 1e-6
        c = float((solved[kept] / w[kept]).median()) if bool(kept.any()) else 1.0
        shown = fmt_list([f"({', '.join(f'{v:.3g}' for v in row)})" for row in solved[:3].tolist()], 3)
        theirs = fmt_list([f"({', '.join(f'{v:.3g}' for v in row)})" for row in w[:3].tolist()], 3)
        if how is None and abs(c - 1) > 1e-3 and rel(solved, c * w) < 1e-4:  # one factor on every weight
            return Hint(
                "routing_weights",
                f"likely a scale of the routing weights on one side only: ours sums the right experts' outputs with "
                f"the reference's weights times {c:.6g} at every token{constant_named(e, c)} (tokens 0-2: {shown}; "
                f"the reference's {theirs})",
                {"ours_weights": solved[:8].tolist(), "factor": c},
            )
        return Hint(
            "routing_weights",
            f"likely the routing weights applied to the wrong experts or tokens: ours sums the right experts' outputs "
            f"with other weights (tokens 0-2: {shown}; the reference's {theirs})" + (f": {how}" if how else ""),
            {"ours_weights": solved[:8].tolist(), "how": how},
        )
    found = [e.ref_trace.extras.get(f"{e.name}.{x}") for x in range(n)]
    if any(r is None or not hasattr(r, "output") for r in found):
        return None
    evidence = cast("list[ExpertEvidence]", found)  # what hf_capture leaves for each expert node
    for label, kw in (
        ("their fused gate/up rows split the other way round (up first)", {"swap_halves": True}),
        (
            "their fused gate/up rows read as interleaved pairs (gate = rows 0::2, up = rows 1::2)",
            {"interleaved": True},
        ),
        (
            "their down projection (hidden, intermediate) reshaped to (intermediate, hidden) where it is transposed "
            "(.view instead of .transpose)",
            {"down_viewed": True},
        ),
    ):
        other = torch.zeros_like(ours)
        for x, r in enumerate(evidence):
            y = r.output(x, **kw)
            if y is None:
                break
            share = (w * (idx == x)).sum(-1)[r.rows]
            other[r.rows] += share[:, None] * y
        else:
            if rel(ours, other) < EXPLAINS:
                return Hint(
                    "swapped_weights",
                    f"likely the experts' weights read in another layout: ours equals the reference's experts with {label}",
                    {"layout": label},
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
    batch = e.positions.shape[0] if e.positions is not None and e.positions.numel() == found["total"] else 1
    order = getattr(spec.transform, "to_reference", ()) if spec is not None else ()
    other = _chosen_otherwise(e.ours, e.ref, scores, batch) or _group_limited_otherwise(e, scores, order)
    if other is not None:
        side, how = other
        text += f"; {side} chooses {how}"
        evidence["chosen_by"] = how
        evidence["side"] = side
    return Hint("routing", text, evidence)


def experts_per_token(result, facts) -> Hint | None:
    """A MoE layer's chosen experts ``(tokens, k)`` with another ``k`` on one side: the number of experts per
    token read for another layer (a per-layer list, HunYuan's ``moe_topk``, taken as one number or at another
    index) or from another config field. The side whose k is not the config's for this layer is named."""
    if result.kind != CHOICES or not result.shape_ours or not result.shape_ref or result.layer is None:
        return None
    ours, ref = result.shape_ours, result.shape_ref
    if len(ours) != len(ref) or ours[:-1] != ref[:-1]:
        return None
    layer = facts.layer(result.layer)
    config_k = layer.experts_per_token if layer is not None else 0
    side, k = ("ours", ours[-1]) if ref[-1] == config_k else ("the reference", ref[-1])
    per_layer = [each.experts_per_token for each in facts.layers if each.sparse]
    which = [each.index for each in facts.layers if each.sparse and each.experts_per_token == k]
    text = (
        f"likely the number of experts per token in {side}: at layer {result.layer} ours chooses {ours[-1]}, the "
        f"reference {ref[-1]}, where the config sets {config_k}"
    )
    if len(set(per_layer)) > 1:
        text += f" (one per layer: {per_layer})" + (f"; {k} is layer {fmt_list(which, 4)}'s" if which else "")
    return Hint("experts_per_token", text, {"side": side, "ours": ours[-1], "reference": ref[-1], "config": config_k})


def _chosen_otherwise(
    ours: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor | None, batch: int = 1
) -> tuple[str, str] | None:
    """``(side, how)``: how one side's choices ``(tokens, k)`` follow from the router logits ``(tokens,
    experts)`` when not by their top-k over the experts (a softmax over the tokens, ``dim=0``, first, or over
    each of ``batch`` rows' positions, ``dim=1`` of ``(batch, seq, experts)``; the lowest k), the other side's
    being that top-k."""
    if scores is None or scores.dim() != 2 or ours.dim() != 2 or ours.shape[0] != scores.shape[0]:
        return None
    s, k = scores.detach().double(), ours.shape[-1]
    ways = {
        "by a softmax over the tokens (dim=0) instead of over the experts (dim=-1)": torch.softmax(s, 0).topk(k, -1),
        "the k lowest scores (topk with largest=False)": s.topk(k, -1, largest=False),
    }
    if batch > 1 and s.shape[0] % batch == 0:
        ways["by a softmax over each row's positions (dim=1 of (batch, seq, experts)) instead of over the experts"] = (
            torch.softmax(s.view(batch, -1, s.shape[-1]), 1).flatten(0, 1).topk(k, -1)
        )
    usual = s.topk(k, -1).indices.sort(-1).values
    for side, by_rule, other in (("ours", ref, ours), ("the reference", ours, ref)):
        if by_rule.shape != usual.shape or not torch.equal(by_rule.long().sort(-1).values, usual):
            continue
        mine = other.long().sort(-1).values
        for label, picked in ways.items():
            if torch.equal(picked.indices.sort(-1).values, mine):
                return side, label
    return None


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def _router_scoring(routing: Mapping[str, float]) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """``(scores of the logits, its name)`` of a router choosing on scores plus a correction bias: a sigmoid
    (DeepSeek V3's), or a softmax over the experts where the facts say so (``softmax_scores``: ERNIE 4.5's
    ``Ernie4_5_MoeTopKRouter``, its ``moe_statics`` the bias)."""
    return (_softmax, "softmax") if routing.get("softmax_scores") else (torch.sigmoid, "sigmoid")


def _group_limited_choices(
    e: Evidence, gate: str, logits: torch.Tensor, k: int, order: tuple[int, ...] = ()
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """``(the rule's choice, {departure: choice})``, each ``(tokens, k)`` expert indices a group-limited sigmoid
    router (see :func:`_group_limited_otherwise`) makes from ``logits`` ``(tokens, experts)``: the config's rule,
    and each of the ports' usual departures alone; ``gate``: the router's path prefix (its correction bias's).
    None where the router has neither groups nor a correction bias."""
    routing = e.facts.routing
    groups, kept = int(routing.get("n_group", 0) or 0), int(routing.get("topk_group", 0) or 0)
    if logits is None or logits.dim() != 2 or (groups and logits.shape[-1] % groups):
        return None
    bias = next(
        (b for n, b in e.ref_trace.biases.items() if n.startswith(gate) and b.numel() == logits.shape[-1]), None
    )
    if not groups and bias is None:
        return None  # neither groups nor a correction bias: no such router
    x = logits.detach().double()
    b = bias.double() if bias is not None else torch.zeros(x.shape[-1], dtype=torch.float64)

    def best_two(g: torch.Tensor) -> torch.Tensor:
        return g.topk(2, -1).values.sum(-1)

    def best_one(g: torch.Tensor) -> torch.Tensor:
        return g.amax(-1)

    # DeepSeek V3 scores a group by the sum of its best two experts, DeepSeek V2's group_limited_greedy by its best
    best_words = {best_one: "its best expert (max)", best_two: "the sum of its best two"}
    own_score = best_one if routing.get("group_max") else best_two
    own_words = best_words[own_score]

    def pick(
        scores: torch.Tensor,
        group_score=own_score,
        limited: bool = bool(groups),
        strided: bool = False,
        n_kept: int = kept,
    ):
        if not limited:
            return scores.topk(k, -1).indices
        cut = scores.unflatten(-1, (-1, groups)).transpose(-1, -2) if strided else scores.unflatten(-1, (groups, -1))
        best = group_score(cut).topk(n_kept, -1).indices
        keep = torch.zeros(scores.shape[0], groups, dtype=torch.bool).scatter(1, best, True)
        per = scores.shape[-1] // groups
        keep = keep.repeat(1, per) if strided else keep.repeat_interleave(per, -1)
        return scores.masked_fill(~keep, float("-inf")).topk(k, -1).indices

    score, word = _router_scoring(routing)
    other_score, other_word = (torch.sigmoid, "a sigmoid") if word == "softmax" else (_softmax, "a softmax")
    sig = score(x)
    second = best_two if own_score is best_one else best_one
    grouped = {
        f"with each group scored by {best_words[second]} instead of {own_words}": pick(sig + b, second),
        f"with each group scored by the sum of all its experts instead of {own_words}": pick(
            sig + b, lambda g: g.sum(-1)
        ),
        "with the groups taken strided (expert e in group e % n_group) where each group is a contiguous block of "
        "n_experts / n_group experts": pick(sig + b, strided=True),
        **{
            f"with the best {n} groups kept ({field}) where topk_group keeps {kept}": pick(sig + b, n_kept=n)
            for n, field in _group_counts(k, groups, kept)
        },
        "with no group limit (the top k over every expert, n_group and topk_group ignored)": pick(
            sig + b, limited=False
        ),
    }
    ways = {
        **(grouped if groups else {}),
        "without e_score_correction_bias added to the scores": pick(sig),
        f"from {other_word} over the experts instead of a {word}": pick(other_score(x) + b),
        f"with e_score_correction_bias added to the router logits before the {word} (not to its scores)": pick(
            score(x + b)
        ),
    }
    if order and bias is not None and len(order) == x.shape[-1]:
        unmoved = torch.empty_like(b)
        unmoved[list(order)] = b  # ours' expert i (the reference's order[i]) read the checkpoint's bias i
        ways["with e_score_correction_bias left in the checkpoint's order while its experts (and router rows) are "
             "reordered: each expert reads another expert's bias"] = pick(sig + unmoved)  # fmt: skip

    return pick(sig + b), ways


def _group_limited_otherwise(
    e: Evidence, logits: torch.Tensor | None, order: tuple[int, ...] = ()
) -> tuple[str, str] | None:
    """``(side, how)``: how one side's choices follow from the router logits under a group-limited sigmoid
    router (DeepSeek V3's ``DeepseekV3MoE.route_tokens_to_experts``, GLM-4.5's ``Glm4MoeTopkRouter``; a softmax
    where :func:`_router_scoring` says; without groups, one with a correction bias alone, MiniMax-M3's: the group
    departures left out): the
    scores ``sigmoid(logits) + e_score_correction_bias``, each group scored by the sum of its best two, the
    ``topk_group`` best groups kept, the top k of their experts. Tries the ports' usual departures, each
    alone; None unless the config's rule gives one side's choices and exactly one departure the other's.
    The logits are the reference's (the router's linear agreed before its choice did); ``order``: ours' expert i
    is the reference's ``order[i]`` (ours stacks its experts in another order), whose correction bias ours may
    have left unpermuted."""
    if logits is None or logits.dim() != 2 or e.ours.dim() != 2:
        return None
    k = e.ours.shape[-1]
    choices = _group_limited_choices(e, e.name[: -len(CHOICES)], logits, k, order)
    if choices is None:
        return None
    rule, ways = choices
    ours, ref = e.ours.reshape(-1, k), e.ref.reshape(-1, k)
    for side, by_rule, other in (("ours", ref, ours), ("the reference", ours, ref)):
        if _same_choice(rule, by_rule):
            found = [label for label, chosen in ways.items() if _same_choice(chosen, other)]
            if len(found) > 2 or not found:
                return None
            # two departures that choose alike in this config (groups scored by their best expert choose as no group
            # limit does when k <= topk_group): both named, neither preferred
            how = found[0] if len(found) == 1 else f"{found[0]}, or equally here {found[1]} (the two choose alike)"
            return side, how
    return None


#: the top-k routing weights as a router may form them from its logits, by name
_FORMULAS = (
    ("the router's raw logits at the chosen experts (no softmax)", False, False),
    ("the router's raw logits at the chosen experts renormalised by their sum (no softmax)", False, True),
    ("a softmax over all experts, not renormalised over the chosen", True, False),
    ("a softmax over all experts, renormalised over the chosen (a softmax over the chosen k alone)", True, True),
)


def _router_scores(e: Evidence) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference's router logits ``(tokens, experts)`` and chosen experts ``(tokens, k)`` beside a
    ``router.weights`` node: its sibling ``router.experts``, and the node it says it chose from (or,
    failing that, the one node of the block holding a score per expert for every token)."""
    prefix = e.name[: -len("router.weights")]
    chosen = e.ref_trace.tensors.get(prefix + "router.experts")
    if chosen is None or chosen.is_floating_point():
        return None
    chosen = chosen.reshape(-1, chosen.shape[-1])
    experts = e.facts.layer(e.result.layer)
    width = experts.num_experts if experts is not None else 0
    logits = [
        t
        for name in e.ref_trace.tensors
        if name.startswith(prefix.rsplit(".", 2)[0]) and not name.startswith(prefix + "router.")
        if (t := e.ref_trace.tensors.get(name)) is not None and t.is_floating_point() and t.shape[-1] == width
        if t.numel() == chosen.shape[0] * width
    ]
    distinct = [
        t for i, t in enumerate(logits) if not any(torch.equal(t.reshape(-1), u.reshape(-1)) for u in logits[:i])
    ]
    # (one tensor under two nodes: HunYuan's gate returns its linear wg's logits)
    return (distinct[0].reshape(-1, width), chosen) if len(distinct) == 1 else None


def routing_weights(e: Evidence) -> Hint | None:
    """Top-k routing weights formed from the router's logits by another formula than the reference's:
    raw logits where it takes a softmax (renormalised or not)."""
    if e.kind != "router.weights" or e.ours.dim() < 2:
        return None
    found = _router_scores(e)
    if found is None:
        return None
    logits, chosen = found
    ours, ref = e.ours.double().reshape(chosen.shape), e.ref.double().reshape(chosen.shape)
    gate = e.name[: -len(".router.weights")] + "."
    bias = next(
        (b for n, b in e.ref_trace.biases.items() if n.startswith(gate) and b.numel() == logits.shape[-1]), None
    )
    forms = _routing_forms(logits.double(), chosen, e.facts.routing, bias)
    # the choices agree as sets (their node passed): each row's weights compared in value order, whatever
    # order each side's top-k listed its experts in
    ours, ref = ours.sort(-1).values, ref.sort(-1).values
    forms = {text: w.sort(-1).values for text, w in forms.items()}
    reference = next((t for t, w in forms.items() if rel(ref, w) < EXPLAINS), None)
    matched = next((t for t, w in forms.items() if rel(ours, w) < EXPLAINS and t != reference), None)
    if matched is None or reference is None or ("softmax over all" in matched and "softmax over all" in reference):
        return None  # a renormalisation on one side only is row_normalisation's
    return Hint(
        "routing_weights",
        f"likely the routing weights formed otherwise from the router's logits: ours equals {matched}, the "
        f"reference {reference} (residual {rel(ours, forms[matched]):.1e})",
        {"ours": matched, "reference": reference},
    )


def expert_tokens(e: Evidence) -> Hint | None:
    """One expert of ours (aligned by the weights it holds) runs on the tokens the router sends to another
    expert: experts indexed in another order in ours than the weights say (two experts swapped)."""
    if e.kind != "expert" or e.ours.dim() != 2:
        return None
    records = {
        int(name.rsplit(".", 1)[1]): record
        for name, record in e.ref_trace.extras.items()
        if name.rsplit(".", 1)[0] == e.name.rsplit(".", 1)[0] and hasattr(record, "rows")
    }
    index = int(e.name.rsplit(".", 1)[1])
    ran = e.ours.abs().sum(-1).nonzero().flatten()
    if index not in records or not len(ran) or torch.equal(ran, records[index].rows):
        return None
    other = next((j for j, r in records.items() if j != index and torch.equal(ran, r.rows)), None)
    if other is None:
        return None
    checked = _with_weights_of(records[other], index, e.ours.double()[ran])
    return Hint(
        "expert_mapping",
        f"likely experts indexed in another order: ours computes with expert {index}'s output projection on the "
        f"{len(ran)} token{'s' if len(ran) != 1 else ''} the router sends to expert {other}{checked}",
        {"expert": index, "runs_on_tokens_of": other, "tokens": len(ran)},
    )


def _with_weights_of(record, index: int, ours: torch.Tensor) -> str:
    """What ours' values say, computed from the reference's expert weights on ``record``'s tokens."""
    for gate_up, down, text in ((index, index, ""), (record.index, index, f"expert {record.index}'s gate/up and ")):
        value = _expert_output(record, gate_up, down)
        if value is not None and rel(ours, value) < EXPLAINS:
            what = f"{text}expert {index}'s {'weights' if not text else 'down projection'}"
            return f" (its values are the reference's {what} on those tokens, residual {rel(ours, value):.1e})"
    return ""


def _expert_output(record, gate_up: int, down: int) -> torch.Tensor | None:
    """A reference expert computed with expert ``gate_up``'s gate/up and expert ``down``'s down projection
    on ``record``'s tokens, float64 (Transformers' default fused layout only)."""
    m = record.module
    if getattr(m, "is_transposed", False) or not getattr(m, "is_concatenated", True) or getattr(m, "has_bias", False):
        return None
    gate, up = m.gate_up_proj[gate_up].detach().double().chunk(2, dim=0)
    x = record.x[record.rows].double()
    return torch.nn.functional.linear(m.act_fn(x @ gate.T) * (x @ up.T), m.down_proj[down].detach().double())


def _routing_forms(
    logits: torch.Tensor, chosen: torch.Tensor, routing: Mapping[str, float] | None = None, bias=None
) -> dict[str, torch.Tensor]:
    """The top-k routing weights ``(tokens, k)`` a port may form from the router's logits at the chosen
    experts: each of :data:`_FORMULAS`, a sigmoid, and the softmax's weights rounded through bfloat16; for a
    group-limited sigmoid router (``routing``: DeepSeek V3's constants, ``bias`` its correction bias), its
    weights with and without the renormalisation, the scaling factor and the bias."""
    picked = logits.gather(-1, chosen)
    forms = _sigmoid_router_forms(logits, chosen, routing or {}, bias)
    forms.update(_sparsemixer_forms(logits, chosen, routing or {}))
    probs = torch.softmax(logits, -1).gather(-1, chosen)
    for text, softmax, renormalised in _FORMULAS:
        w = probs if softmax else picked
        forms[text] = w / w.sum(-1, keepdim=True) if renormalised else w
    forms["a sigmoid of the router's logits (not a softmax)"] = torch.sigmoid(picked)
    forms["a sigmoid of the router's logits, renormalised over the chosen"] = torch.sigmoid(picked) / torch.sigmoid(
        picked
    ).sum(-1, keepdim=True)
    forms["the softmax's weights rounded through bfloat16"] = rounded(probs.double(), torch.bfloat16)
    forms["no weights (the chosen experts' outputs summed)"] = torch.ones_like(picked)
    return forms


def _sigmoid_router_forms(logits: torch.Tensor, chosen: torch.Tensor, routing: Mapping[str, float], bias) -> dict:
    """DeepSeek V3's routing weights (``DeepseekV3MoE.route_tokens_to_experts``: the sigmoid scores at the
    chosen experts, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``; a softmax's where
    :func:`_router_scoring` says, ERNIE 4.5's) and the ports' usual departures from it, by name; empty for a
    router without that factor."""
    scale = routing.get("routed_scaling_factor")
    if not scale:
        return {}
    score, word = _router_scoring(routing)
    s = score(logits).gather(-1, chosen)
    norm = bool(routing.get("norm_topk_prob", 1))
    both = "renormalised over the chosen" if norm else "not renormalised"
    times = f", times routed_scaling_factor ({scale:g})" if scale != 1 else ""
    forms = {f"the {word} scores at the chosen, {both}{times}": (s / s.sum(-1, keepdim=True) if norm else s) * scale}
    if scale != 1:
        forms[f"the {word} scores at the chosen, {both}, without routed_scaling_factor ({scale:g})"] = (
            s / s.sum(-1, keepdim=True) if norm else s
        )
    other = "not renormalised (norm_topk_prob ignored)" if norm else "renormalised (norm_topk_prob is false)"
    forms[f"the {word} scores at the chosen, {other}{times}"] = (s if norm else s / s.sum(-1, keepdim=True)) * scale
    groups, kept_groups = int(routing.get("n_group", 1) or 1), int(routing.get("topk_group", 1) or 1)
    experts = logits.shape[-1]
    if word == "softmax" and 1 < kept_groups < groups and experts % groups == 0:
        # the groups not kept masked on the logits before the softmax (which then renormalises over the kept
        # groups' experts), where the reference takes the softmax over every expert and masks after it
        member = chosen.div(experts // groups, rounding_mode="floor")
        group_of = torch.arange(experts, device=logits.device).div(experts // groups, rounding_mode="floor")
        held = (group_of[None, :] == member[..., None]).any(-2)  # the chosen's groups (tokens, experts)
        best = logits.view(*logits.shape[:-1], groups, -1).amax(-1).topk(kept_groups, -1).indices  # max per group
        top = (group_of[None, :] == best[..., None]).any(-2)
        keep = torch.where(held.view(-1, experts).sum(-1, keepdim=True) == kept_groups * (experts // groups), held, top)
        masked = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1).gather(-1, chosen)
        forms[
            f"the softmax over the kept groups' experts alone (the other groups masked on the logits before the "
            f"softmax, not after it: it renormalises over the {kept_groups} of {groups} groups kept){times}"
        ] = masked * scale
    first_zero = int(routing.get("zero_experts_from", 0) or 0)
    if first_zero and bool((chosen >= first_zero).any()):  # LongCat-Flash's zero-compute (identity) experts
        kept = s / s.sum(-1, keepdim=True) if norm else s
        forms[
            f"the {word} scores at the chosen, {both}{times}, the zero-compute experts' weights left out (0 for a "
            f"chosen expert past the {first_zero} routed ones)"
        ] = kept.masked_fill(chosen >= first_zero, 0.0) * scale
    if bias is not None:
        biased = s + bias.double().to(s.device).flatten()[chosen]
        forms[
            f"the biased scores ({word} plus e_score_correction_bias, which only the choice reads) at the chosen, "
            f"{both}{times}"
        ] = (biased / biased.sum(-1, keepdim=True) if norm else biased) * scale
    return forms


def _sparsemixer(logits: torch.Tensor, threshold: float, first_in_second: bool = False) -> torch.Tensor:
    """SparseMixer's top-2 weights at inference (PhiMoE's ``sparsemixer``, arXiv 2409.12136), ``(tokens, 2)``:
    the best expert's share of a softmax over the experts whose logit is within ``threshold`` of it (relative:
    ``(best - s) / max(|s|, best)``), then the same for the second best with the first removed (kept when
    ``first_in_second``, a port's slip)."""
    s = logits.double()
    weights = []
    rest = s
    for slot in range(2):
        best, at = rest.max(-1, keepdim=True)
        far = (best - s) / s.abs().clamp(min=best) > threshold
        base = s if slot == 0 or first_in_second else rest
        weights.append(torch.softmax(base.masked_fill(far, float("-inf")), -1).gather(-1, at))
        rest = rest.scatter(-1, at, float("-inf"))
    return torch.cat(weights, -1)


def _sparsemixer_forms(logits: torch.Tensor, chosen: torch.Tensor, routing: Mapping[str, float]) -> dict:
    """SparseMixer's weights (``routing["sparsemixer_eps"]``, PhiMoE's router_jitter_noise) at the chosen
    experts, and the ports' usual departures from it, by name; empty for another router. Its own choice is the
    two best logits, in that order: a row whose chosen experts are another pair gets the form's weights anyway
    (compared as sets of values by the callers)."""
    eps = routing.get("sparsemixer_eps")
    if eps is None or chosen.shape[-1] != 2:
        return {}
    own = f"SparseMixer's weights (each of the two best experts' softmax share over the logits within 2 * jitter_eps ({2 * eps:g}) of it, the second's without the first)"
    weights = _sparsemixer(logits, 2 * eps)
    return {
        own: weights,
        f"SparseMixer's weights with the threshold jitter_eps ({eps:g}), not 2 * jitter_eps": _sparsemixer(logits, eps),
        "SparseMixer's weights with the first expert left in the second one's softmax": _sparsemixer(
            logits, 2 * eps, first_in_second=True
        ),
        "SparseMixer's weights renormalised over the two chosen (they are not: each is its own softmax share)": (
            weights / weights.sum(-1, keepdim=True)
        ),
    }


#: a MoE block's router node under the block: Mixtral's and DeepSeek's ``gate``, GPT-OSS's and DBRX's ``router``
ROUTER_NODES = ("gate", "router")


def _combination_forms(
    e: Evidence, base: str, logits: torch.Tensor, chosen: torch.Tensor, y: torch.Tensor, record
) -> dict[str, torch.Tensor]:
    """The MoE block's output ``(tokens, hidden)`` as a port may combine the reference's experts otherwise
    (``y``: every expert on every token, ``(experts, tokens, hidden)``): another k, the k least likely, the
    weights normalised by their L2 norm, every expert weighted by the first slot's weight, outputs assigned
    where they are summed (the last expert in expert order wins), only experts ``0..k-1`` run, the experts'
    output bias added unweighted, the weights taken from the router's logits without its bias, and (an
    experts class with GPT-OSS's clamped SwiGLU) the activation written otherwise."""
    tokens, k = chosen.shape
    experts = y.shape[0]
    rows = torch.arange(tokens)
    weights = e.ref_trace.tensors.get(f"{base}.router.weights")
    w = (
        weights.double().reshape(tokens, k)
        if weights is not None and weights.numel() == tokens * k
        else torch.softmax(logits.gather(-1, chosen), -1)
    )

    def combine(index: torch.Tensor, weight: torch.Tensor, outputs: torch.Tensor = y) -> torch.Tensor:
        return (weight.T[..., None] * outputs[index.T, rows[None, :]]).sum(0)

    forms: dict[str, torch.Tensor] = {}
    for other in range(1, experts + 1):
        if other != k:
            top = logits.topk(other, dim=-1)
            forms[
                f"the top {other} experts, weighted by a softmax over them (k = {other} where the config's is {k})"
            ] = combine(top.indices, torch.softmax(top.values, -1))
    low = logits.topk(k, dim=-1, largest=False)
    forms["the k least likely experts (a top-k taken in ascending order: argsort without descending=True)"] = combine(
        low.indices, torch.softmax(low.values, -1)
    )
    probs = torch.softmax(logits, -1).gather(-1, chosen)
    forms[
        "the softmax's weights at the chosen experts divided by their L2 norm (torch.norm's default p=2, not p=1)"
    ] = combine(chosen, probs / probs.norm(dim=-1, keepdim=True))
    forms["every chosen expert weighted by the first slot's weight"] = combine(chosen, w[:, :1].expand(tokens, k))
    # the chosen ids sorted (to group tokens by expert), their weights left in the top-k's order
    forms[
        "the chosen experts sorted by id while their weights keep the top-k's order (each weight applied to "
        "another expert: sort the weights with the ids)"
    ] = combine(chosen.sort(-1).values, w)
    last = chosen.argmax(-1, keepdim=True)
    forms[
        "only the last chosen expert of each token (in expert order) kept: outputs assigned (out[idx] = y) where "
        "they are summed (index_add_)"
    ] = combine(chosen.gather(-1, last), w.gather(-1, last))
    forms[f"only experts 0..{k - 1} run (a loop over range(top_k) where range(num_experts) is meant)"] = combine(
        chosen, w * (chosen < k)
    )
    forms.update(_dispatch_forms(chosen, w, y))
    bias = getattr(record.module, "down_proj_bias", None)
    if isinstance(bias, torch.Tensor) and tuple(bias.shape) == (experts, y.shape[-1]):
        b = bias.detach().double()[chosen]  # (tokens, k, hidden)
        forms["each expert's output bias added unweighted (after the routing weight, not before)"] = (
            combine(chosen, w) - (w[..., None] * b).sum(1) + b.sum(1)
        )
    router_bias = next((t for n in ROUTER_NODES if (t := e.ref_trace.biases.get(f"{base}.{n}")) is not None), None)
    if router_bias is not None and router_bias.numel() == experts:
        unbiased = (logits - router_bias.double()).gather(-1, chosen)
        forms["weights from the router's logits without its bias (the bias used for the choice alone)"] = combine(
            chosen, torch.softmax(unbiased, -1)
        )
    for text, gate in _gate_variants(record.module).items():
        outputs = _with_override(record, "_apply_gate", gate, tokens)
        if outputs is not None:
            forms[f"the chosen experts' outputs with {text}"] = combine(chosen, w, outputs)
    fused_bias = getattr(record.module, "gate_up_proj_bias", None)
    if callable(getattr(record.module, "_apply_gate", None)) and isinstance(fused_bias, torch.Tensor):
        # gate/up interleaved in the weights (GPT-OSS): the bias cut in halves instead, read back interleaved
        halves = fused_bias.detach().unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        outputs = _with_override(record, "gate_up_proj_bias", torch.nn.Parameter(halves, requires_grad=False), tokens)
        if outputs is not None:
            forms[
                "the chosen experts' outputs with the gate/up bias cut in halves where its weights (and the bias) "
                "interleave gate and up"
            ] = combine(chosen, w, outputs)
    return forms


def _dispatch_forms(chosen: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block's output when each expert's tokens are dispatched otherwise: an expert fed the first ``n``
    tokens of the batch (``x[:n]``) where its ``n`` routed tokens are meant (listed token by token, or slot by
    slot), or only the first ``ceil(tokens * k / experts)`` of its tokens kept (a capacity factor of 1 that
    drops the rest, where Transformers is dropless)."""
    tokens, k = chosen.shape
    experts = y.shape[0]
    if k > 1 and bool((chosen.sort(-1).values.diff(dim=-1) == 0).any()):
        return {}  # a token given one expert twice (DeepSeek V4's hash routing): more slots than rows per expert
    capacity = math.ceil(tokens * k / experts)
    sliced = {"token by token": torch.zeros_like(y[0]), "slot by slot": torch.zeros_like(y[0])}
    dropped = torch.zeros_like(y[0])
    for j in range(experts):
        token, slot = torch.where(chosen == j)  # token-major
        weight = w[token, slot, None]
        sliced["token by token"].index_add_(0, token, weight * y[j, : len(token)])
        order = torch.argsort(slot * tokens + token)  # slot-major, as Transformers' loop lists them
        sliced["slot by slot"].index_add_(0, token[order], weight[order] * y[j, : len(token)])
        kept = token[:capacity]
        dropped.index_add_(0, kept, weight[:capacity] * y[j, kept])
    forms = {
        f"each expert fed the batch's first n tokens (x[:n]) where its n routed tokens (listed {how}) are meant": t
        for how, t in sliced.items()
    }
    forms[
        f"each expert's tokens past its capacity ceil(tokens * k / experts) = {capacity} dropped (a capacity factor "
        "of 1; Transformers' experts are dropless)"
    ] = dropped
    return forms


def _gate_variants(module) -> dict:
    """GPT-OSS's clamped SwiGLU (``_apply_gate``: gate clamped from above, up clamped both ways, ``(up + 1) *
    gate * sigmoid(alpha * gate)``) written otherwise, for an experts class that has one; else {}."""
    limit, alpha = getattr(module, "limit", None), getattr(module, "alpha", None)
    if not callable(getattr(module, "_apply_gate", None)) or limit is None or alpha is None:
        return {}

    def halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gate_up[..., ::2], gate_up[..., 1::2]

    def both_sides(gate_up):
        gate, up = halves(gate_up)
        gate, up = gate.clamp(-limit, limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    def no_plus_one(gate_up):
        gate, up = halves(gate_up)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return up * gate * torch.sigmoid(gate * alpha)

    def clamp_after(gate_up):
        gate, up = halves(gate_up)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha)).clamp(max=limit)

    return {
        "the gate clamped on both sides (only from above in the reference's SwiGLU)": both_sides,
        "the SwiGLU's (up + 1) written as up (the + 1 dropped)": no_plus_one,
        "the gate's clamp applied after its activation (not before)": clamp_after,
    }


def _gate_up_swapped(record, tokens: int) -> torch.Tensor | None:
    """Every expert on every token ``(experts, tokens, hidden)`` with the fused ``gate_up_proj`` ``(experts,
    2 * intermediate, hidden)`` split the other way round (Mixtral's, PhiMoE's, Qwen3-MoE's experts: ``gate, up
    = linear(x, gate_up_proj[e]).chunk(2, -1)``); None for another layout (GPT-OSS's interleaved halves)."""
    gate_up = getattr(record.module, "gate_up_proj", None)
    interleaved = (
        getattr(record.module, "limit", None) is not None and getattr(record.module, "alpha", None) is not None
    )
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3 or gate_up.shape[1] % 2 or interleaved:
        return None
    gate, up = gate_up.detach().chunk(2, dim=1)
    return _with_override(
        record, "gate_up_proj", torch.nn.Parameter(torch.cat((up, gate), 1), requires_grad=False), tokens
    )


def _with_override(record, attribute: str, value, tokens: int) -> torch.Tensor | None:
    """Every expert of the reference on every token ``(experts, tokens, hidden)`` with the experts module's
    ``attribute`` (a method, ``_apply_gate``, or a parameter) replaced by ``value`` for the call, restored
    after."""
    module = record.module
    everyone = replace(record, rows=torch.arange(tokens))
    parameters = getattr(module, "_parameters", {})
    held = parameters.get(attribute) if attribute in parameters else None
    if held is not None:
        parameters[attribute] = value
    else:
        setattr(module, attribute, value)
    try:
        outputs = [everyone.output(j) for j in range(record.num_experts)]
    finally:
        if held is not None:
            parameters[attribute] = held
        else:
            delattr(module, attribute)
    return None if any(o is None for o in outputs) else torch.stack(outputs)


def _block_differs(e: Evidence, base: str, side: str) -> Hint:
    """The MoE block ``base`` (computed in functions nothing in ours taps) differs where the stream continues,
    and no routing formula or combination reproduces ``side``'s output: the block is the component."""
    from parity.diagnose.residual import input_terms  # (residual reads the norms this module's callers hold)

    # the node's input read as a sum of the reference's nodes first: the stream added before a norm after the block
    # (its residual moved) is no fault of the experts
    specific = input_terms(e)
    if specific is not None and specific.kind in ("norm_placement", "residual"):
        return specific
    router = next((r for n in ROUTER_NODES if (r := e.ours_trace.results.get(f"{base}.{n}")) is not None), None)
    agrees = router is not None and router.status == "ok"
    return Hint(
        "moe_block",
        f"likely the MoE block {base}: its output, read where the stream continues (the experts computed in "
        f"functions nothing taps), differs"
        + (" while its router's logits agree" if agrees else "")
        + f", and no routing formula or combination of the reference's experts reproduces {whose(side)}: the "
        "experts themselves (their activation, their weights' layout, the tokens each one reads) or how their "
        "outputs are put back",
        {"block": base, "side": side, "router_agrees": agrees},
    )


def _grouped_choice(
    choice: torch.Tensor, k: int, groups: int, topk_group: int, by: str, ranked: torch.Tensor | None = None
) -> torch.Tensor:
    """The experts a group-limited router picks (``(tokens, k)``, DeepSeek V3's ``get_topk_indices``): the
    ``topk_group`` groups of highest score (``by``: "top2" the sum of each group's two best, "max" its
    best) over ``ranked`` (by default ``choice``), then the top ``k`` of ``choice`` within them."""
    t, n = choice.shape
    grouped = (choice if ranked is None else ranked).view(t, groups, n // groups)
    score = grouped.topk(2, dim=-1).values.sum(-1) if by == "top2" else grouped.amax(-1)
    keep = torch.zeros_like(score).scatter_(1, score.topk(topk_group, dim=-1).indices, 1.0)
    mask = keep[:, :, None].expand_as(grouped).reshape(t, n)
    return choice.masked_fill(mask == 0, 0.0).topk(k, dim=-1).indices


def _group_counts(k: int, groups: int, topk_group: int) -> list[tuple[int, str]]:
    """The group counts a port may keep in place of ``topk_group``, with where each comes from:
    ``num_experts_per_tok`` (the two top-k fields confused), half of ``n_group``, one group; only those that
    limit the choice otherwise (fewer than every group, not topk_group itself), each once."""
    counts: dict[int, str] = {}
    for kept, field in ((k, "num_experts_per_tok"), (groups // 2, "half of n_group"), (1, "one group")):
        if 0 < kept < groups and kept != topk_group:
            counts.setdefault(kept, field)
    return list(counts.items())


def _grouped_forms(e: Evidence, base: str, logits: torch.Tensor, chosen: torch.Tensor, y: torch.Tensor):
    """The block's output ``(tokens, hidden)`` (routed experts plus the shared ones) under each way a port
    of DeepSeek V3's router may go wrong: the correction bias left in the weights, the group score from
    another statistic or without the bias, no group limit, the scaling applied before the renormalisation
    or to the shared experts too, weights from a separate top-k. Empty without the reference's shared
    experts' output; the bias's own forms only where the router has a correction bias."""
    r = e.facts.routing
    shared = _shared_output(e, base)
    bias = next((b for n in ROUTER_NODES if (b := e.ref_trace.biases.get(f"{base}.{n}")) is not None), None)
    tokens, k = chosen.shape
    if shared is not None and shared.numel() != tokens * y.shape[-1]:
        return {}
    alone = shared is None  # no shared experts (Beam's): the forms of the experts' sum, before any scaling factor
    shared = (
        torch.zeros(tokens, y.shape[-1], dtype=torch.float64) if shared is None else shared.double().reshape(tokens, -1)
    )
    rsf = 1.0 if alone else float(r.get("routed_scaling_factor", 1.0))
    groups, topk_group = int(r["n_group"]), int(r.get("topk_group", 1))
    score, word = _router_scoring(r)
    s = score(logits)
    choice = s + bias.double().flatten() if bias is not None else s  # Mistral 4's router has no correction bias

    def routed(picked: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (w.T[..., None] * y[picked.T, torch.arange(tokens)[None, :]]).sum(0)

    def normed(picked: torch.Tensor, scores: torch.Tensor = s) -> torch.Tensor:
        w = scores.gather(-1, picked)
        return w / w.sum(-1, keepdim=True) if r.get("norm_topk_prob", 1.0) else w

    choices = [
        ("experts chosen with each group scored by its best expert (max), not its two best summed",
         _grouped_choice(choice, k, groups, topk_group, "max")),
        *(
            [("experts chosen with the groups ranked on the scores without the correction bias",
              _grouped_choice(choice, k, groups, topk_group, "top2", ranked=s))]
            if bias is not None
            else []
        ),
        *(
            (f"experts chosen from the best {kept} groups ({field}) where topk_group keeps {topk_group}",
             _grouped_choice(choice, k, groups, kept, "top2"))
            for kept, field in _group_counts(k, groups, topk_group)
        ),
        ("experts chosen over every group (the group limit not applied)", choice.topk(k, dim=-1).indices),
    ]  # fmt: skip
    rule = _grouped_choice(choice, k, groups, topk_group, "top2")
    departed = not r.get("group_max") and not _same_choice(rule, chosen)  # (DeepSeek V2 scores groups by max)
    if departed and any(_same_choice(picked, chosen) for _, picked in choices):
        chosen = rule  # the reference itself chose by one of the departures: the config's rule is the base
    forms = {"Transformers' routing": routed(chosen, normed(chosen) * rsf) + shared}
    if not alone:
        forms["the routed experts alone (the shared experts' output not added)"] = routed(chosen, normed(chosen) * rsf)
    if bias is not None:
        forms[f"the correction bias kept in the weights ({word} + e_score_correction_bias, not only in the choice)"] = (
            routed(chosen, normed(chosen, choice) * rsf) + shared
        )
    if rsf != 1:
        unscaled = routed(chosen, normed(chosen)) + shared
        forms["routed_scaling_factor not applied (applied before the renormalisation, which cancels it)"] = unscaled
        forms["routed_scaling_factor applied to the routed and the shared experts' sum"] = unscaled * rsf
    separate = s.topk(k, dim=-1).values
    forms["weights from a separate top-k of the raw scores, paired by rank with the chosen experts"] = (
        routed(chosen, separate / separate.sum(-1, keepdim=True) * rsf) + shared
    )
    for label, picked in choices:
        forms[label] = routed(picked, normed(picked) * rsf) + shared
    return forms


def _same_choice(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two ``(tokens, k)`` expert choices pick the same experts for every token (in any order)."""
    return a.shape == b.shape and torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


def routed_in_block(e: Evidence) -> Hint | None:
    """A MoE block's own node (it holds shared experts, GLM-4.5's and DeepSeek's, added ungated) where ours
    computes its routed experts in functions beside them, so no experts node of ours was judged: ours'
    routed sum read as the block's output minus the shared experts' output (their node agrees), then judged
    as the experts' sum is (:func:`experts_sum`)."""
    experts = f"{e.name}.experts"
    if not _untapped(e, experts):
        return None
    shared = _shared_node(e, e.name)
    judged = e.ours_trace.results.get(shared) if shared is not None else None
    if shared is None or judged is None or not judged.passed:
        return None
    theirs = e.ref_trace.tensors[shared].double()
    if theirs.numel() != e.ours.numel():
        return None
    routed = e.ours.double() - theirs.reshape(e.ours.shape)
    sub = replace(
        e, ours=routed, ref=e.ref_trace.tensors[experts], result=replace(e.result, name=experts, kind="experts")
    )
    hint = experts_sum(sub)
    if hint is None:
        return None
    return replace(
        hint, text=f"{hint.text} (ours' routed experts read as the block's output minus its shared experts')"
    )


def _routed_forms(e: Evidence, base: str) -> dict[str, torch.Tensor] | None:
    """The MoE block ``base``'s routed output ``(tokens, hidden)`` under each formula and combination a port may
    use, from the reference's router logits, choices and experts (every expert run on every token): a sigmoid
    for a softmax, the top-k renormalised or not, another k, weights on the experts' input, a transposed down
    projection, gate/up swapped; DeepSeek's group-limited router's own forms (its shared experts included).
    None where the reference's block holds no router logits, choices or experts' records."""
    block = f"{base}.experts"
    chosen = e.ref_trace.tensors.get(f"{base}.router.experts")
    logits = next(
        (t for n in ROUTER_NODES if (t := e.ref_trace.tensors.get(f"{base}.{n}")) is not None and t.dim() == 2),
        None,
    )
    records = [r for n, r in e.ref_trace.extras.items() if n.rsplit(".", 1)[0] == block and hasattr(r, "output")]
    if logits is None or chosen is None or not records or logits.dim() != 2 or chosen.shape[0] != logits.shape[0]:
        return None
    record = cast("ExpertEvidence", records[0])
    tokens = logits.shape[0]
    everyone = replace(record, rows=torch.arange(tokens))
    outputs = [everyone.output(j) for j in range(record.num_experts)]
    if any(y is None for y in outputs):
        return None
    y = torch.stack(cast(list[torch.Tensor], outputs))  # (experts, tokens, hidden): every expert on every token
    picked = y[chosen.T, torch.arange(tokens)[None, :]]  # (k, tokens, hidden)
    routing = _routing_forms(logits.double(), chosen, e.facts.routing)
    forms = {
        f"the chosen experts' outputs weighted by {text}": (w.T[..., None] * picked).sum(0)
        for text, w in routing.items()
    }
    forms.update(_combination_forms(e, base, logits.double(), chosen, y, record))
    weights = e.ref_trace.tensors.get(f"{base}.router.weights")
    if weights is not None and weights.shape == chosen.shape:  # the weight on the expert's input (Llama 4's)
        on_input = torch.zeros_like(forms[next(iter(forms))])
        for slot in range(chosen.shape[1]):
            scaled = record.x * weights[:, slot : slot + 1].to(record.x.dtype)
            each = replace(record, x=scaled, rows=torch.arange(tokens))
            ys = torch.stack([cast(torch.Tensor, each.output(j)) for j in range(record.num_experts)])
            on_input = on_input + ys[chosen[:, slot], torch.arange(tokens)]
        forms["the chosen experts run on their input times the routing weight (x * w), not weighted after"] = on_input
    transposed = [everyone.output(j, down_transposed=True) for j in range(record.num_experts)]
    if all(t is not None for t in transposed):  # a square down projection reshaped where it needed a transpose
        yt = torch.stack(cast(list[torch.Tensor], transposed))[chosen.T, torch.arange(tokens)[None, :]]
        w = routing[_FORMULAS[2][0]]
        forms[
            "the chosen experts computed with each down_proj transposed (a square weight reshaped where it needs a transpose)"
        ] = (w.T[..., None] * yt).sum(0)
    halves = _gate_up_swapped(record, tokens)
    if halves is not None and weights is not None and weights.shape == chosen.shape:
        forms[
            "the chosen experts computed with gate_up_proj's halves swapped (up first: the activation on the up half)"
        ] = (weights.double().T[..., None] * halves.double()[chosen.T, torch.arange(tokens)[None, :]]).sum(0)
    shared = _shared_output(e, base)
    if e.facts.routing.get("n_group"):  # DeepSeek's group-limited sigmoid router, its shared experts added
        grouped = _grouped_forms(e, base, logits.double(), chosen, y.double())
        if shared is not None:
            return grouped or None
        # no shared experts (LFM2-MoE's one-group router, Beam's): the generic forms, each formula's weights as they
        # are, and the group-limited router's own departures (the experts' sum, as Transformers' routing gives it)
        forms.update({text: f for text, f in grouped.items() if text != "Transformers' routing"})
    if shared is None or shared.numel() != tokens * y.shape[-1]:
        return forms
    # an ungated shared MLP beside the experts (HunYuan-MoE's shared_mlp): the block's output is their sum
    shared = shared.double().reshape(tokens, -1)
    routed = forms[f"the chosen experts' outputs weighted by {_routing_text(routing, chosen, weights)}"]
    with_shared = {f"{text}, plus the shared MLP's output": f + shared for text, f in forms.items()}
    # Cohere2-MoE's shared_expert_combination_strategy "average": (routed + shared) / 2, each form too
    with_shared.update(
        {f"{text}, averaged with the shared MLP's output": (f + shared) / 2 for text, f in forms.items()}
    )
    with_shared["the routed experts alone (the shared MLP's output not added)"] = routed
    with_shared["the shared MLP's output alone (the routed experts not added)"] = shared
    return with_shared


def _routing_text(forms: dict[str, torch.Tensor], chosen: torch.Tensor, weights: torch.Tensor | None) -> str:
    """The name, among the routing ``forms`` (:func:`_routing_forms`), of the reference's own routing weights
    (its ``router.weights``), else the softmax renormalised over the chosen."""
    if weights is not None and weights.shape == chosen.shape:
        ref = weights.double().sort(-1).values
        found = next((t for t, w in forms.items() if rel(ref, w.sort(-1).values) < EXPLAINS), None)
        if found is not None:
            return found
    return _FORMULAS[3][0]


#: where a MoE block's ungated shared MLP (or shared experts) leaves its output
_SHARED_NODES = (
    "shared_experts",
    "shared_experts.down_proj",
    "shared_expert.down_proj",
    "shared_mlp.down_proj",
    "shared_mlp",
)


def _shared_node(e: Evidence, base: str) -> str | None:
    """The reference's node holding the output of the MoE block ``base``'s shared MLP, when it has one and no
    gate on it (Qwen2-MoE's gated shared expert is not a plain sum: :func:`shared_expert` reads it)."""
    if any(n.startswith(f"{base}.shared_expert_gate") for n in e.ref_trace.tensors):
        return None
    return next((f"{base}.{n}" for n in _SHARED_NODES if f"{base}.{n}" in e.ref_trace.tensors), None)


def _shared_output(e: Evidence, base: str) -> torch.Tensor | None:
    """The reference's output of the MoE block ``base``'s ungated shared MLP (:func:`_shared_node`)."""
    node = _shared_node(e, base)
    return e.ref_trace.tensors.get(node) if node is not None else None


def _judge_forms(
    e: Evidence, base: str, forms: dict, ours: torch.Tensor, ref: torch.Tensor, where: str, component: bool = True
) -> Hint | None:
    """Which of ``forms`` ours' and the reference's block outputs ``(tokens, hidden)`` are; a hint when they
    are two different ones, or (:func:`_block_differs`, with ``component``) when one side is a known form and
    the other none."""

    def form_of(t: torch.Tensor) -> str | None:
        return next((text for text, f in forms.items() if rel(t, f) < 1e-4), None)

    ours_is, ref_is = form_of(ours), form_of(ref)
    if component and (ours_is is None) != (ref_is is None) and float((ours - ref).abs().max()) > e.noise:
        return _block_differs(e, base, "ours" if ours_is is None else "the reference")
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    both = ours_is + ref_is
    kind, what = (
        ("transposed_weight", "experts' weights")
        if "transposed" in both
        else ("swapped_weights", "experts' weights")
        if "halves swapped" in both
        else ("shared_expert", "shared MLP")
        if "shared MLP's output alone" in both
        or "shared MLP's output not added" in both
        or ("averaged with" in ours_is) != ("averaged with" in ref_is)
        else ("activation", "experts' activation")
        if "SwiGLU" in both or "clamp" in both
        else ("bias", "experts' bias")
        if "bias added unweighted" in both or "bias cut in halves" in both
        else ("routing_weights", "routing")
    )
    return Hint(
        kind,
        f"likely the {what} of {base}: its output, {where}, is {ours_is} in ours, {ref_is} in the reference",
        {"ours": ours_is, "reference": ref_is, "block": base},
    )


def moe_output(e: Evidence) -> Hint | None:
    """A mixture of experts whose router and experts ours does not expose (a port's loop over experts in
    plain functions): its output is read from the first point of the residual stream after it, ours'
    minus the stream the block added to, and matched against the reference's experts weighted by each
    formula a port may use (:func:`_routed_forms`), with the reference's own router logits and choices;
    either side."""
    from parity.diagnose.residual import stream_around

    around = stream_around(e)
    if around is None:
        return None
    at, (block, _), (_, point) = around
    stream, x_ours, x_ref = point.double(), at.ours, at.ref
    if ".shared_experts" in block:  # the shared experts ran last: the block is the MoE they belong to
        block = block.split(".shared_experts", 1)[0] + ".experts"
    elif f"{block}.experts" in e.ref_trace.tensors:  # the MoE block's own node (it holds a shared expert too)
        block += ".experts"
    if not block.endswith(".experts") or e.ours_trace.results.get(block) is not None:
        return None  # ours' block was compared itself: its own detectors read it there
    base = block.rsplit(".", 1)[0]
    forms = _routed_forms(e, base)
    if not forms:
        return None
    tokens = next(iter(forms.values())).shape[0]
    ours_branch = (x_ours.double() - stream).reshape(tokens, -1)
    ref_branch = (x_ref.double() - stream).reshape(tokens, -1)
    hint = _judge_forms(
        e,
        base,
        forms,
        ours_branch,
        ref_branch,
        "read where the stream continues (the experts computed in functions nothing taps)",
    )
    if hint is not None and hint.kind == "moe_block":  # no routing form: the two terms weighted otherwise?
        return combination_scale(e) or hint
    return hint


def experts_at_stream(e: Evidence) -> Hint | None:
    """A MoE block whose router ours exposes and whose experts it computes untapped (GraniteMoeShared's MoE
    module of ours holds the router and the experts' weights), read at the first point of the residual stream
    after it: every branch node before agrees, so the two streams differ by ``c (ours' experts - the
    reference's)``, ``c`` the factor the branch carries (Granite's residual_multiplier, 1 elsewhere). The
    reference's experts node is one of the block's forms (:func:`_routed_forms`); the form whose difference
    from it ours' stream shows, at one constant ``c > 0``, is ours'. Either side."""
    if e.result.layer is None or not reads_stream(e.kind) or e.ours.shape != e.ref.shape:
        return None
    prefix = f"{e.facts.layer_path(e.result.layer)}."
    block = next(
        (
            n for n, t in e.ref_trace.tensors.items()
            if n.startswith(prefix) and n.endswith(".experts") and t.numel() == e.ref.numel() and _untapped(e, n)
        ),
        None,
    )  # fmt: skip
    if block is None:
        return None
    base = block.rsplit(".", 1)[0]
    forms = _routed_forms(e, base)
    if not forms:
        return None
    tokens = next(iter(forms.values())).shape[0]
    ref_experts = e.ref_trace.tensors[block].double().reshape(tokens, -1)
    moved = (e.ours.double() - e.ref.double()).reshape(tokens, -1)
    for form in forms.values():
        delta = form - ref_experts
        scale = float((moved * delta).sum() / delta.pow(2).sum().clamp_min(1e-300))
        if scale > 0 and float(delta.abs().max()) > e.noise and rel(moved, scale * delta) < 1e-4:
            hint = _judge_forms(
                e, base, forms, ref_experts + moved / scale, ref_experts,
                "read where the stream continues (its experts computed untapped"
                + (f", the branch carrying them times {scale:.6g})" if abs(scale - 1) > 1e-6 else ")"),
                component=False,
            )  # fmt: skip
            if hint is not None:
                return hint
    return None


def _untapped(e: Evidence, name: str) -> bool:
    judged = e.ours_trace.results.get(name)
    return name in e.ref_trace.tensors and (judged is None or judged.status == UNTAPPED)


def _factor_of(experts: torch.Tensor, x: torch.Tensor) -> float | None:
    """``c`` when ``x`` is ``c * experts`` (1.0 when equal; the rounding of one float product allowed), else None."""
    a, b = experts.reshape(-1), x.reshape(-1)
    if torch.equal(a, b):
        return 1.0
    a, b = a.double(), b.double()
    c = float((a * b).sum() / a.pow(2).sum().clamp_min(1e-300))
    tiny = torch.finfo(x.dtype).eps * 4 if x.is_floating_point() else 0.0
    return c if c != 0 and float((b - c * a).abs().max()) <= tiny * float(b.abs().max()) else None


def _agreeing_shared_output(e: Evidence, prefix: str, x_ref: torch.Tensor) -> torch.Tensor | None:
    """The output of the shared expert of the block at ``prefix`` (its module's node, else its down projection's)
    where both sides agree on it, of ``x_ref``'s size; None where the block has none traced or it differs."""
    for n, t in e.ref_trace.tensors.items():
        leaf = n[len(prefix) :] if n.startswith(prefix) else ""
        if not leaf.startswith("shared_expert") or t.numel() != x_ref.numel():
            continue
        if "." in leaf and not leaf.endswith(("down_proj", "w2", "c_proj")):
            continue
        result = e.ours_trace.results.get(n)
        if result is not None and result.passed:
            return t
    return None


def experts_read_after(e: Evidence) -> Hint | None:
    """The experts' sum of a MoE block nothing of ours taps (ours' router and experts one module, no shared
    MLP: FlexOlmo's), read at the input of the node after it (a post-norm, ``post_feedforward_layernorm``)
    and judged as the experts' node is (:func:`experts_sum`, then the block's forms)."""
    if e.result.layer is None:
        return None
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.numel() != x_ref.numel():
        return None
    prefix = f"{e.name.rsplit('.', 1)[0]}."
    whole = x_ours, x_ref  # the block's output before the norm: the forms with a shared expert are of it
    shared = _agreeing_shared_output(e, prefix, x_ref)
    if shared is not None:  # the shared expert's output added before the norm (A.X-K1's): taken off both sides
        x_ours = (x_ours.double() - shared.double().reshape(x_ours.shape)).to(x_ours.dtype)
        x_ref = (x_ref.double() - shared.double().reshape(x_ref.shape)).to(x_ref.dtype)
    found = next(
        (
            (n, c)
            for n, t in e.ref_trace.tensors.items()
            if n.startswith(prefix) and n.endswith(".experts") and t.numel() == x_ref.numel() and _untapped(e, n)
            and (c := _factor_of(t, x_ref)) is not None
        ),
        None,
    )  # fmt: skip
    if found is None:
        return None
    block, factor = found
    ref = e.ref_trace.tensors[block]
    # the block may scale its experts' sum before returning it (Beam's and DeepSeek's routed_scaling_factor):
    # ours' sum is read through the same factor
    ours = (x_ours.double() / factor).to(x_ours.dtype) if factor != 1.0 else x_ours
    sub = replace(e, ours=ours.reshape(ref.shape), ref=ref, result=replace(e.result, name=block, kind="experts"))
    # the block's own forms first: one that names how the weights were formed (the correction bias kept in them)
    # says more than the experts' sum read alone (the right experts, other weights)
    hint = None
    forms = _routed_forms(sub, block.rsplit(".", 1)[0])
    if forms:
        tokens = next(iter(forms.values())).shape[0]
        # a shared expert beside the experts: the forms are of the block's whole output (routed plus shared)
        judged = (whole[0], whole[1]) if shared is not None else (sub.ours, ref)
        hint = _judge_forms(
            sub, block.rsplit(".", 1)[0], forms, judged[0].double().reshape(tokens, -1),
            judged[1].double().reshape(tokens, -1), "read at the input of the node after it", component=False,
        )  # fmt: skip
    hint = hint or experts_sum(sub)
    if hint is None:
        return None
    return replace(hint, text=f"{hint.text} (read at {e.kind}'s input: {block}, which nothing of ours taps)")


def moe_block(e: Evidence) -> Hint | None:
    """A MoE block's own node (ours' block a module, its experts computed in functions nothing taps: HunYuan-
    MoE's shared MLP beside them) matched against the reference's experts and shared MLP combined by each
    formula a port may use (:func:`_routed_forms`); either side."""
    if not _untapped(e, f"{e.name}.experts"):
        return None
    forms = _routed_forms(e, e.name)
    if not forms:
        return None
    tokens = next(iter(forms.values())).shape[0]
    if e.ours.numel() != e.ref.numel() or e.ref.numel() % tokens:
        return None
    ours, ref = e.ours.double().reshape(tokens, -1), e.ref.double().reshape(tokens, -1)
    # no component-level answer here: the detectors after it (routed_in_block) read the block otherwise
    return _judge_forms(
        e, e.name, forms, ours, ref, "where the experts are computed in functions nothing taps", component=False
    )


def _shared_forms(r: torch.Tensor, sh: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """A MoE block's output from its routed experts' sum ``r``, its shared expert's output ``sh`` (both
    ``(tokens, hidden)``) and the shared expert's gate logit ``g`` ``(tokens, 1)``, in each way a port may
    combine them (Qwen2-MoE: ``r + sigmoid(g) * sh``, ``modeling_qwen2_moe.Qwen2MoeSparseMoeBlock``)."""
    s = torch.sigmoid(g)
    return {
        "routed + sigmoid(gate) * shared": r + s * sh,
        "routed + shared (the shared expert's gate left out)": r + sh,
        "sigmoid(gate) * (routed + shared) (the gate scales the routed experts too)": s * (r + sh),
        "routed + gate * shared (the gate's sigmoid left out)": r + g * sh,
        "sigmoid(gate) * routed + shared (the gate on the routed experts instead)": s * r + sh,
        "routed + (1 - sigmoid(gate)) * shared": r + (1 - s) * sh,
        "routed alone (the shared expert left out)": r,
    }


def combination_scale(e: Evidence) -> Hint | None:
    """A MoE block's output as ``a routed + b shared`` on both sides (the routed experts' sum and the shared
    expert's output: their reference nodes, before it), with other coefficients: the routed scaling factor
    applied to the sum where the reference scales the routed part alone (``c (routed + shared)`` against
    ``c routed + shared``, DeepSeek-V3's and Step's blocks), or to the shared expert instead; each coefficient
    named by the config constant it equals. At the block's node, or (ours computes the block in functions
    nothing taps) read where the stream continues after it. Either side."""
    from parity.diagnose.residual import stream_around

    if f"{e.name}.experts" in e.ref_trace.tensors:
        return _combination(e, e.name, e.ours, e.ref)
    around = stream_around(e)
    if around is None:
        return None
    at, (block, _), (_, point) = around
    base = block.split(".shared_expert", 1)[0] if ".shared_expert" in block else block.removesuffix(".experts")
    if f"{base}.experts" not in e.ref_trace.tensors or e.ours_trace.results.get(base) is not None:
        return None  # no MoE block before this point, or ours' block was compared itself: read there
    stream = point.double()
    hint = _combination(e, base, at.ours.double() - stream, at.ref.double() - stream)
    if hint is None:
        return None
    return Hint(hint.kind, f"{hint.text} (read where the stream continues: ours computes the block in functions)",
                hint.evidence)  # fmt: skip


def _combination(e: Evidence, base: str, ours_value: torch.Tensor, ref_value: torch.Tensor) -> Hint | None:
    """:func:`combination_scale`'s fit of the block ``base``'s output, ``ours_value`` and ``ref_value``."""
    from parity.diagnose.residual import coefficients, constant_words

    shared = next(
        (n for n in (f"{base}.{s}{d}" for s in ("shared_experts", "shared_expert") for d in ("", ".down_proj"))
         if n in e.ref_trace.tensors),
        None,
    )  # fmt: skip
    r, sh = e.ref_trace.tensors.get(f"{base}.experts"), e.ref_trace.tensors.get(shared) if shared else None
    n = ref_value.numel()
    if r is None or sh is None or r.numel() != n or sh.numel() != n or ours_value.numel() != n:
        return None
    if any(getattr(e.ours_trace.results.get(k), "failed", False) for k in (f"{base}.experts", shared)):
        return None
    x, f = r.double().reshape(ref_value.shape), sh.double().reshape(ref_value.shape)
    ours = coefficients(ours_value.reshape(ref_value.shape), x, f, EXPLAINS)
    ref = coefficients(ref_value, x, f, EXPLAINS)
    if ours is None or ref is None or max(abs(o - t) / max(abs(t), 1e-12) for o, t in zip(ours, ref)) < 1e-6:
        return None
    if min(abs(c) for c in (*ours, *ref)) < 1e-3:
        return None  # a term missing: the shared expert or the routed experts left out, read by other detectors
    differ = [
        f"{which}'s coefficient {o:.7g}{constant_words(e, o)} in ours, {t:.7g}{constant_words(e, t)} in the reference"
        for which, o, t in (("the routed sum", ours[0], ref[0]), ("the shared expert", ours[1], ref[1]))
        if abs(o - t) > 1e-6 * max(abs(t), 1e-12)
    ]
    return Hint(
        "moe_combination",
        f"likely the MoE block's combination: ours computes {ours[0]:.7g} routed + {ours[1]:.7g} shared, the "
        f"reference {ref[0]:.7g} routed + {ref[1]:.7g} shared, with routed = {base}.experts and shared = {shared} "
        f"({'; '.join(differ)}): a scale applied to the other term, or to their sum",
        {"ours": list(ours), "reference": list(ref), "shared": shared},
    )


def shared_expert(e: Evidence) -> Hint | None:
    """A MoE block's output where its routed experts' sum, its shared expert and the shared expert's gate
    agree on both sides (their nodes come before it), combined by another formula: read from the three
    nodes' reference tensors against each form of :func:`_shared_forms`, either side."""
    # the shared expert's output: its own node, else its last projection's (an MLP container is no node)
    names = [f"{e.name}.experts", f"{e.name}.shared_expert", f"{e.name}.shared_expert_gate"]
    if names[1] not in e.ref_trace.tensors:
        names[1] += ".down_proj"
    r, sh, g = (e.ref_trace.tensors.get(n) for n in names)
    if r is None or sh is None or g is None or g.numel() * r.shape[-1] != r.numel() or sh.numel() != r.numel():
        return None
    if any(getattr(e.ours_trace.results.get(n), "failed", False) for n in names):
        return None
    tokens = g.numel()
    forms = _shared_forms(
        r.double().reshape(tokens, -1), sh.double().reshape(tokens, -1), g.double().reshape(tokens, 1)
    )
    ours, ref = e.ours.double().reshape(tokens, -1), e.ref.double().reshape(tokens, -1)
    ours_is = next((t for t, f in forms.items() if rel(ours, f) < EXPLAINS), None)
    ref_is = next((t for t, f in forms.items() if rel(ref, f) < EXPLAINS), None)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    return Hint(
        "shared_expert",
        f"likely the shared expert combined otherwise with the routed experts: ours computes {ours_is}, the "
        f"reference {ref_is} (the routed sum, the shared expert and its gate agree)",
        {"ours": ours_is, "reference": ref_is},
    )


def expert_rows(result, ref_trace, facts) -> Hint | None:
    """A node inside one expert (``...experts.<e>...`` or a module the experts run per expert, Muse Spark's
    ``experts.post_expert_norm``) holding another number of tokens on each side, the features alike: ours runs it
    once over every token (after the experts' outputs are combined) where the reference runs it per expert on the
    tokens routed there; or the expert received other tokens (the router chose otherwise upstream)."""
    ours, ref = result.shape_ours, result.shape_ref
    if not ours or not ref or len(ours) != 2 or len(ref) != 2 or ours[1] != ref[1] or ours[0] == ref[0]:
        return None
    if ".experts." not in f".{result.name}.":
        return None
    embedding = ref_trace.tensors.get(facts.embed_module)  # (batch, seq, hidden): every token of the run
    tokens = math.prod(embedding.shape[:-1]) if isinstance(embedding, torch.Tensor) and embedding.dim() >= 2 else None
    leaf = result.name.rsplit(".", 1)[-1]
    if tokens is not None and ours[0] == tokens > ref[0]:
        return Hint(
            "expert_rows",
            f"likely {leaf} applied once to the experts' combined output in ours: it runs over all {tokens} tokens, "
            f"where the reference runs it inside each expert on the tokens routed to it ({ref[0]} here), before the "
            "routing weights and the sum",
            {"ours_rows": ours[0], "reference_rows": ref[0], "tokens": tokens},
        )
    return Hint(
        "expert_rows",
        f"likely the routing chose other experts upstream: this expert's {leaf} gets {ours[0]} token(s) in ours, "
        f"{ref[0]} in the reference (the router's logits, their scale or bias, or its top-k read otherwise: its "
        "choices are the first to differ)",
        {"ours_rows": ours[0], "reference_rows": ref[0]},
    )
