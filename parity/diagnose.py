"""Typed hints from the pattern of a failing node's error.

Each detector is a small function of one :class:`Evidence` (the failing node, both tensors, both
traces, the architecture's facts) returning a :class:`~parity.hints.Hint` or None; :func:`diagnose`
tries them in order, from the most specific evidence (an exact match with something else) to the
most general (a pattern). A detector stays silent unless its evidence clearly exceeds the noise the
node itself shows: no hint is better than a wrong one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .analysis import HEAD_MAJOR, HEAD_MERGED
from .compare import CHOICE, MISSING, NONFINITE, SHAPE, NodeResult, choice_margins
from .facts import ArchFacts
from .hints import Hint
from .pair import NodeSpec
from .trace import Trace

#: relative residual below which an explanation "reproduces" a tensor
EXPLAINS = 1e-3


@dataclass(frozen=True)
class Evidence:
    """What a detector may look at: the failing node, its two tensors and everything traced."""

    result: NodeResult
    ours: torch.Tensor | None
    ref: torch.Tensor | None
    ours_trace: Trace
    ref_trace: Trace
    facts: ArchFacts
    #: the position of every token, ``(batch, seq)`` (what RoPE rotates by)
    positions: torch.Tensor | None = None
    #: ``(batch, seq)`` 1 for real tokens, 0 for padding, when the run is padded
    attention_mask: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return self.result.kind

    @property
    def name(self) -> str:
        return self.result.name

    def close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Equal within this node's tolerance (and a little slack when the tolerance is exact)."""
        atol = max(self.result.atol, 1e-6 * float(b.abs().max()) if b.numel() else 0.0)
        return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=self.result.rtol))

    @property
    def noise(self) -> float:
        """The node's tolerance at its largest reference value: errors below it are noise."""
        return self.result.atol + self.result.rtol * float(self.ref.abs().max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / nb if nb > 0 else math.inf


def _fmt_list(xs, n=6) -> str:
    xs = list(xs)
    body = ", ".join(str(x) for x in xs[:n])
    return body + (", ..." if len(xs) > n else "")


# --- exact matches with something else ---------------------------------------------------------


def sibling_match(e: Evidence) -> Hint | None:
    """Ours reproduces another reference node of the same layer (gate vs up, k vs v)."""
    prefix = e.name.rsplit(".", 1)[0]
    for name, tensor in e.ref_trace.tensors.items():
        if name != e.name and name.startswith(prefix) and tensor.shape == e.ours.shape and e.close(e.ours, tensor):
            return Hint(
                "swapped_weights",
                f"likely swapped or misassigned weights: ours matches the reference's {name} instead",
                {"matches": name},
            )
    return None


def transposed_weight(e: Evidence) -> Hint | None:
    """A linear node whose output equals the reference's input times the transposed weight."""
    x = e.ref_trace.inputs.get(e.name)
    weight = e.ref_trace.weights.get(e.name)
    if x is None or weight is None or weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
        return None
    xs = e.ours_trace.inputs.get(e.name)
    if xs is None or not e.close(xs, x):
        return None  # the input already differs: not this node's own fault
    y = torch.nn.functional.linear(x.double(), weight.double().T)
    bias = e.ref_trace.biases.get(e.name)
    if bias is not None:
        y = y + bias.double()
    if _rel(e.ours, y) < EXPLAINS:
        return Hint(
            "transposed_weight",
            f"likely a transposed weight: ours equals the reference's input times the transposed {e.kind} "
            f"weight (a Conv1D-style or transposed load; residual {_rel(e.ours, y):.1e})",
            {"residual": _rel(e.ours, y)},
        )
    return None


def _heads(t: torch.Tensor, kind: str, head_dim: int | None) -> torch.Tensor | None:
    """(heads, rest...) view of an attention node, or None."""
    if kind in HEAD_MAJOR and t.dim() == 4:
        return t.transpose(0, 1)
    if kind in HEAD_MERGED and head_dim and t.dim() == 3 and t.shape[-1] % head_dim == 0 and t.shape[-1] > head_dim:
        return t.unflatten(-1, (-1, head_dim)).movedim(-2, 0)
    return None


def head_mapping(e: Evidence) -> Hint | None:
    """Some heads agree and others do not, or ours' heads are the reference's in another order."""
    head_dim = e.facts.layer(e.result.layer).head_dim if e.facts.layer(e.result.layer) else e.facts.head_dim
    a, b = _heads(e.ours, e.kind, head_dim), _heads(e.ref, e.kind, head_dim)
    if a is None or a.shape[0] < 2:
        return None
    n = a.shape[0]
    same = [i for i in range(n) if e.close(a[i], b[i])]
    moved = {i: j for i in range(n) if i not in same for j in range(n) if j != i and e.close(a[i], b[j])}
    if not moved and (not same or len(same) == n):
        return None  # no head equals another: nothing here says "mapping"
    gqa = e.facts.num_kv_heads != e.facts.num_heads
    cause = (
        "GQA head mapping (K/V heads expanded with repeat instead of repeat_interleave, or grouped wrongly)"
        if gqa else "a head permutation in the weights or the head split"
    )
    parts = [f"heads {_fmt_list(same)} agree" if same else "no head agrees in place"]
    if moved:
        parts.append("ours " + ", ".join(f"head {i} = reference head {j}" for i, j in list(moved.items())[:6]))
    differ = [i for i in range(n) if i not in same]
    parts.append(f"heads {_fmt_list(differ)} differ")
    return Hint("head_mapping", f"likely {cause}: " + "; ".join(parts),
                {"agree": same, "moved": {str(k): v for k, v in moved.items()}, "differ": differ})


def last_dim_permutation(e: Evidence) -> Hint | None:
    """Same values, other order along the last axis: a row permutation of a weight (RoPE layout
    permutation with a wrong head count, half-split vs interleaved Q/K rows). The identity is never
    a permutation."""
    ours, ref = e.ours, e.ref
    if ours.dim() < 2 or ours.shape[-1] < 4:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if not torch.allclose(a.sort(-1).values, b.sort(-1).values, atol=max(e.result.atol, 1e-12), rtol=e.result.rtol):
        return None
    perm = [int((b[0] - a[0, j]).abs().argmin()) for j in range(a.shape[-1])]
    moved = [j for j, k in enumerate(perm) if j != k]
    if not moved or len(set(perm)) != len(perm):
        return None
    if _rel(a, b[:, perm]) > EXPLAINS:  # ours[..., j] = reference[..., perm[j]] on every token
        return None
    evidence: dict = {"permutation": perm[:64], "moved": len(moved)}
    within = ""
    head_dim = e.facts.head_dim
    if e.kind in HEAD_MERGED and head_dim and ours.shape[-1] % head_dim == 0:
        crossing = sum(1 for j, k in enumerate(perm) if j // head_dim != k // head_dim)
        evidence["crosses_heads"] = crossing
        within = (
            "; every element stays in its head (a permutation within heads, as a RoPE un-permute with the "
            "wrong head count gives)" if crossing == 0 else f"; {crossing} positions cross head boundaries"
        )
    return Hint(
        "weight_permutation",
        f"likely a permutation of weight rows: same values per token, other order along the last axis "
        f"(ours[j] = reference[{_fmt_list(perm, 8)}]){within}",
        evidence,
    )


def rounding_order(e: Evidence) -> Hint | None:
    """Every difference within two units in the last place of the node's dtype: the same formula
    rounded in another order (cast before or after a multiply, fused or separate operations)."""
    dtype = e.ref.dtype
    if not dtype.is_floating_point:
        return None
    a, b = e.ours.double(), e.ref.double()
    diff = (a - b).abs()
    if not bool((diff > 0).any()):
        return None
    mantissa = -round(math.log2(torch.finfo(dtype).eps))  # explicit mantissa bits: 23 float32, 7 bfloat16
    magnitude = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.pow(2.0, torch.floor(torch.log2(magnitude)) - mantissa)
    units = diff / ulp
    worst = float(units.max())
    if worst > 2.0:
        return None
    count = int((diff > 0).sum())
    return Hint(
        "rounding_order",
        f"likely a rounding-order difference: {count} of {diff.numel()} elements differ, none by more than "
        f"{worst:.0f} unit(s) in the last place of {str(dtype).replace('torch.', '')} (the same formula with a cast "
        "before instead of after a multiply, or ops fused differently); the reference's order is the one the "
        "checkpoint was trained with",
        {"elements": count, "max_ulps": worst},
    )


def _ms(x: torch.Tensor, centered: bool) -> torch.Tensor:
    x = x.double()
    if centered:
        x = x - x.mean(-1, keepdim=True)
    return x.pow(2).mean(-1)


def norm_eps(e: Evidence) -> Hint | None:
    """A norm whose inputs agree, and whose ours/ref ratio is constant over channels but varies per
    token with the token's mean square: another eps (or eps outside the square root)."""
    if "norm" not in e.kind or e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if x_ref.shape != e.ref.shape or not e.close(x_ours, x_ref):
        return None
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    keep = b.abs() > 1e-3 * b.abs().amax(-1, keepdim=True)
    ratio = torch.where(keep, a / b.where(keep, torch.ones_like(b)), torch.nan)
    r = ratio.nanmean(-1)
    spread = ((ratio - r[:, None]).abs().nan_to_num(0.0).amax(-1) / r.abs()).max()
    if not bool(torch.isfinite(r).all()) or float(spread) > 1e-3 or float((r - 1).abs().max()) < 1e-4:
        return None  # not a per-token factor, or no factor at all
    centered = e.facts.norm_kind == "layernorm"
    ms = _ms(x_ref, centered).flatten()
    r2 = r.pow(2)
    # r^2 = (ms + eps_ref) / (ms + eps_ours)  <=>  r^2 * eps_ours - eps_ref = ms * (1 - r^2): least squares,
    # each token's equation divided by its ms + eps so large-RMS tokens (where eps is invisible) add no noise
    weight = 1.0 / (ms + (e.facts.norm_eps or 1e-6))
    design = torch.stack([r2, -torch.ones_like(r2)], 1) * weight[:, None]
    solution = torch.linalg.lstsq(design, (ms * (1 - r2) * weight)[:, None]).solution.flatten()
    eps_ours, eps_ref = float(solution[0]), float(solution[1])
    predicted = ((ms + eps_ref) / (ms + eps_ours)).sqrt()
    if min(eps_ours, eps_ref) >= -1e-12 and float(((predicted - r).abs() / r).max()) < 1e-3:
        return Hint(
            "norm_eps",
            f"likely the norm's eps: ours / reference varies per token with the token's mean square (ratio "
            f"{float(r.min()):.4g}..{float(r.max()):.4g}), as eps {eps_ours:.3g} in ours and {eps_ref:.3g} in the reference "
            f"give (the config says {e.facts.norm_eps:g})",
            {"eps_ours": eps_ours, "eps_reference": eps_ref, "config_eps": e.facts.norm_eps},
        )
    eps = e.facts.norm_eps or 0.0
    outside = ((ms + eps).sqrt() / r - ms.sqrt())  # ours = x / (sqrt(ms) + eps'): one eps' for every token
    if float(outside.std()) <= 1e-3 * max(float(outside.abs().mean()), 1e-30):
        return Hint(
            "norm_eps",
            f"likely eps outside the square root: ours behaves like x / (sqrt(mean(x^2)) + {float(outside.mean()):.3g}), "
            f"the reference like x / sqrt(mean(x^2) + {eps:g})",
            {"eps_outside": float(outside.mean()), "config_eps": eps},
        )
    return None


def _qk_agree(e: Evidence) -> bool:
    stem = e.name.rsplit(".", 1)[0]
    for kind in ("q_rot", "k_rot"):
        a, b = e.ours_trace.tensors.get(f"{stem}.{kind}"), e.ref_trace.tensors.get(f"{stem}.{kind}")
        if a is None or b is None or a.shape != b.shape or not e.close(a, b):
            return False
    return True


def softmax_temperature(e: Evidence) -> Hint | None:
    """Attention probabilities that are the reference's scores times one constant, softmaxed: the
    attention scale (softmax temperature), with q and k agreeing."""
    if e.kind != "probs" or not _qk_agree(e):
        return None
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    if scores is None or scores.shape != e.ref.shape:
        return None
    p_o, p_r, s = e.ours.double(), e.ref.double(), scores.double()
    keep = (p_o > 1e-6) & (p_r > 1e-6)
    # log p_o - log p_r = (c - 1) s - const per row: c from the slope over kept entries
    d = (p_o.log() - p_r.log()).where(keep, torch.zeros_like(p_o))
    n = keep.sum(-1, keepdim=True).clamp_min(1)
    s_c = (s.where(keep, torch.zeros_like(s)) - (s * keep).sum(-1, keepdim=True) / n) * keep
    d_c = (d - d.sum(-1, keepdim=True) / n) * keep
    denom = float(s_c.pow(2).sum())
    if denom == 0:
        return None
    slope = float((s_c * d_c).sum()) / denom
    if abs(slope) < 1e-3 or float((d_c - slope * s_c).pow(2).sum()) > 1e-6 * float(d_c.pow(2).sum()) + 1e-18:
        return None
    c = 1 + slope
    return Hint(
        "attention_scale",
        f"likely the attention scale (softmax temperature): q and k agree, and ours' probabilities are the "
        f"softmax of the reference's scores times {c:.6g}",
        {"factor": c},
    )


# --- scales --------------------------------------------------------------------------------------


def constant_ratio(e: Evidence) -> Hint | None:
    """ours / reference is one constant everywhere: a missing or extra scale (named when it equals
    a known constant of the architecture)."""
    a, b = e.ours.double().flatten(), e.ref.double().flatten()
    keep = b.abs() > 1e-3 * b.abs().max()
    if int(keep.sum()) < 4:
        return None
    ratio = a[keep] / b[keep]
    mean = float(ratio.mean())
    if abs(mean) < 1e-12 or float(ratio.std()) / abs(mean) > 1e-3:
        return None
    # the ratio must stand out from the node's own noise, not be a rounding drift (F20)
    if abs(mean - 1) * float(b.abs().max()) <= 10 * e.noise or abs(mean - 1) < 1e-3:
        return None
    r = max(mean, 1 / mean)  # compare magnitudes >= 1, whichever side carries the extra factor
    bigger = "ours / reference" if mean > 1 else "reference / ours"
    matched = [
        (name, value) for name, value in e.facts.named_constants().items()
        if value > 0 and abs(r / max(value, 1 / value) - 1) < 1e-3
    ]
    known = ""
    kind = "attention_scale" if e.kind == "scores" and _qk_agree(e) else "scale"
    if e.kind == "logits" and e.facts.logit_scale not in (None, 1.0):
        return Hint("logit_scale", f"likely logit_scale: the logits differ by one factor, ours / reference = {mean:.6g} "
                    f"(the reference's logit_scale is {e.facts.logit_scale:g})", {"ratio": mean})
    if matched and kind == "scale":
        name, value = matched[0]
        known = f"; matches {bigger} = {name} ({max(value, 1 / value):.6g})"
        if "attention factor" in name:
            kind = "rope_attention_factor"
        elif name == "logit_scale":
            kind = "logit_scale"
    if kind == "attention_scale":
        named = f"; matches {matched[0][0]}" if matched else ""
        return Hint(kind, f"likely the attention scale (softmax temperature): q and k agree, the pre-softmax scores "
                    f"differ by one factor, ours / reference = {mean:.6g}{named}", {"ratio": mean, "matches": matched[0][0] if matched else None})
    return Hint(
        kind,
        f"likely a missing or extra scale: ours / reference = {mean:.6g} at every position including 0 "
        f"(reference / ours = {1 / mean:.6g}){known}",
        {"ratio": mean, "matches": matched[0][0] if matched else None},
    )


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
        {"ours_sums_to_one": ours_one, "reference_sums_to_one": ref_one,
         "ratio_min": float(per_row.min()), "ratio_max": float(per_row.max())},
    )


def expert_weights(e: Evidence) -> Hint | None:
    """One expert's output explained by the reference's experts under another weight assignment:
    another expert's weights (experts indexed in another order), or this expert with its fused gate
    and up halves swapped."""
    record = e.ref_trace.extras.get(e.name)
    if record is None or not hasattr(record, "output") or len(record.rows) == 0:
        return None
    ours = e.ours.double()[record.rows]
    if not bool(torch.isfinite(ours).all()):
        return None
    halves = record.output(record.index, swap_halves=True)
    if halves is None:
        return None
    if _rel(ours, halves) < EXPLAINS:
        return Hint(
            "swapped_weights",
            f"likely the fused gate/up projection split the wrong way round: ours equals the reference's expert "
            f"{record.index} with its gate and up halves swapped (residual {_rel(ours, halves):.1e})",
            {"expert": record.index, "residual": _rel(ours, halves)},
        )
    for j in range(record.num_experts):
        if j == record.index:
            continue
        other = record.output(j)
        if other is not None and _rel(ours, other) < EXPLAINS:
            return Hint(
                "expert_mapping",
                f"likely experts indexed in another order: ours' expert {record.index} computes with the reference's "
                f"expert {j} weights on its {len(record.rows)} token{'s' if len(record.rows) != 1 else ''} "
                f"(residual {_rel(ours, other):.1e})",
                {"expert": record.index, "matches": j, "tokens": len(record.rows)},
            )
    return None


def choice(e: Evidence, spec: NodeSpec | None) -> Hint:
    """A different choice at an integer node (top-k experts): where, whether it is the same set in
    another order, and how near a tie the reference's scores were there."""
    scores = e.ref_trace.tensors.get(spec.chosen_from) if spec is not None and spec.chosen_from else None
    found = choice_margins(e.ours, e.ref, scores)
    rows = found["rows"]
    where = f"rows {_fmt_list(rows, 8)}"
    if e.positions is not None and e.positions.numel() == found["total"]:
        batch, seq = e.positions.shape
        where = "tokens " + _fmt_list([f"(row {r // seq}, position {r % seq})" for r in rows], 6)
    evidence: dict = {"rows": rows[:64], "same_set": found["same_set"][:64]}
    if found["same_set"] and len(found["same_set"]) == len(rows):
        return Hint("routing", f"likely the same experts chosen in another order (top-k sorted differently) at {where}; "
                    "the combined output is unaffected unless the order is used", evidence)
    text = f"likely a different expert choice at {where} ({len(rows)} of {found['total']} tokens)"
    margins = found["margins"]
    if margins:
        evidence["margins"] = margins[:64]
        s = scores.detach().double()
        floor = 8 * float(torch.finfo(scores.dtype).eps) * float(s.abs().max()) if scores.is_floating_point() else 0.0
        near = [m for m in margins if m <= floor]
        if len(near) == len(margins):
            text += (f": the reference's scores there are near-ties (margin {max(margins):.2g} between its last chosen and "
                     f"first unchosen expert, within rounding): a numerical accident upstream decides, not a routing bug")
        else:
            text += (f": the reference's margin between its last chosen and first unchosen score there is "
                     f"{min(margins):.3g}..{max(margins):.3g}, not a near-tie: the router scores or the top-k differ")
    return Hint("routing", text, evidence)


def channel_ratio(e: Evidence) -> Hint | None:
    """ours / reference constant over tokens for each channel, different across channels."""
    ours, ref = e.ours, e.ref
    if ours.dim() < 2 or ours.shape[-1] < 2:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if a.shape[0] < 2 or bool((b.abs() < 1e-6).any()):
        return None
    ratio = a / b
    spread = float((ratio.std(0) / ratio.mean(0).abs().clamp_min(1e-12)).max())
    if spread > 1e-3:
        return None
    per_channel = ratio.mean(0)
    if float((per_channel - 1).abs().max()) < 1e-3:
        return None
    return Hint(
        "channel_scale",
        "likely a per-channel weight difference (a norm weight used as w instead of 1 + w, or a wrong norm "
        f"weight): ours / reference is constant over tokens per channel, e.g. "
        f"{_fmt_list(f'{v:.4g}' for v in per_channel[:4].tolist())}",
        {"per_channel": per_channel[:16].tolist()},
    )


# --- norms ---------------------------------------------------------------------------------------


def _normalisers(x: torch.Tensor, head_dim: int | None, eps: float = 0.0) -> dict[str, torch.Tensor]:
    """``x`` normalised each way a norm might (``eps``: the architecture's norm eps)."""
    x = x.double()
    centered = x - x.mean(-1, keepdim=True)
    out = {
        "RMSNorm over the last axis": x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
        "LayerNorm (mean-subtracting)": centered / (centered.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
    }
    if head_dim and x.shape[-1] % head_dim == 0 and x.shape[-1] > head_dim:
        h = x.unflatten(-1, (-1, head_dim))
        out["RMSNorm per head"] = (h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()).flatten(-2)
    if head_dim and x.dim() >= 3 and x.shape[-1] == head_dim and x.shape[-2] > 1:  # (..., heads, head_dim)
        out["RMSNorm over the whole projection"] = x / (x.pow(2).mean((-2, -1), keepdim=True) + eps).sqrt()
    return out


def _explained_by(y: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str | None:
    """The candidate n with y ~= n * w for a per-channel w (least squares), if any."""
    y = y.double().flatten(0, -2)
    for name, n in candidates.items():
        n = n.flatten(0, -2)
        w = (y * n).sum(0) / n.pow(2).sum(0).clamp_min(1e-30)
        if _rel(n * w, y) < EXPLAINS:
            return name
    return None


def norm_kind(e: Evidence) -> Hint | None:
    """A norm node whose output is explained by another normaliser than the reference's."""
    if "norm" not in e.kind or e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if not e.close(x_ours, x_ref):
        return None  # the input already differs: not this norm's own fault
    candidates = _normalisers(x_ref, e.facts.head_dim, e.facts.norm_eps or 0.0)
    ours_is, ref_is = _explained_by(e.ours, candidates), _explained_by(e.ref, candidates)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    evidence = ""
    if "LayerNorm" in ref_is or "LayerNorm" in ours_is:
        means = x_ref.double().mean(-1).flatten()
        evidence = f"; the difference tracks each token's mean (input means {_fmt_list(f'{m:.3g}' for m in means[:4].tolist())}): mean subtraction"
    if any(w in label for w in ("per head", "whole projection") for label in (ours_is, ref_is)):
        evidence = "; per-head vs whole-projection Q/K norm"
    return Hint("norm_kind", f"likely the wrong norm: ours behaves like {ours_is}, the reference like {ref_is}{evidence}",
                {"ours": ours_is, "reference": ref_is})


def norm_placement(e: Evidence) -> Hint | None:
    """A projection whose input is the reference's input after a norm (pre-norm vs post-norm)."""
    if e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if x_ref.shape != x_ours.shape or e.close(x_ours, x_ref):
        return None
    ours_is = _explained_by(x_ours, _normalisers(x_ref, None, e.facts.norm_eps or 0.0))
    if ours_is is not None:
        return Hint(
            "norm_placement",
            f"likely norm placement: the input of {e.kind} in ours equals the reference's input after a "
            f"{ours_is} (pre-norm vs post-norm)",
            {"normaliser": ours_is},
        )
    return None


def _layer_node(e: Evidence, layer: int, kind: str) -> torch.Tensor | None:
    """The reference's tensor of the node of that kind in that layer, if traced."""
    for name, tensor in e.ref_trace.tensors.items():
        if e.facts.locate(name) == (layer, kind):
            return tensor
    return None


def _residual_into(e: Evidence, layer: int) -> torch.Tensor | None:
    """The reference's residual stream entering ``layer``: the previous layer's output, or the
    (scaled) token embedding before layer 0."""
    if layer > 0:
        return _layer_node(e, layer - 1, "layer")
    x = e.ref_trace.tensors.get(e.facts.embed_module)
    return x * e.facts.embed_scale if x is not None and e.facts.embed_scale else x


def block_layout(e: Evidence) -> Hint | None:
    """The MLP branch reads the residual after attention on one side and the layer's input on the
    other: a parallel block (``x + attn(N(x)) + mlp(N(x))``) run sequentially, or the reverse."""
    if e.result.layer is None or not (e.kind.endswith("@input") or "norm" in e.kind):
        return None
    x, attn = _residual_into(e, e.result.layer), _layer_node(e, e.result.layer, "o_proj")
    if x is None or attn is None or x.shape != e.ref.shape or attn.shape != x.shape:
        return None
    candidates = {
        "the residual after attention (sequential block)": x.double() + attn.double(),
        "the layer's input (parallel block)": x.double(),
    }

    def explained(y: torch.Tensor) -> str | None:
        for label, u in candidates.items():
            if _rel(y, u) < EXPLAINS or _explained_by(y, _normalisers(u, None, e.facts.norm_eps or 0.0)) is not None:
                return label
        return None

    ours_is, ref_is = explained(e.ours), explained(e.ref)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    return Hint(
        "block_layout",
        f"likely the block layout: the {e.kind} of ours is computed from {ours_is}, the reference's from {ref_is}",
        {"ours": ours_is, "reference": ref_is},
    )


# --- positions -----------------------------------------------------------------------------------


def _seq_axis(kind: str) -> int:
    return 2 if kind in HEAD_MAJOR else 1


def _by_position(ours: torch.Tensor, ref: torch.Tensor, axis: int) -> torch.Tensor:
    diff = (ours.double() - ref.double()).abs().movedim(axis, 0)
    return diff.reshape(diff.shape[0], -1).amax(dim=1)


def _pre_rope(e: Evidence, n_heads: int) -> torch.Tensor | None:
    """The reference's q (or k) before RoPE as (batch, heads, seq, head_dim), from the q_norm/q_proj node
    (a per-head norm's output is ``(batch, seq, heads, head_dim)``: Transformers normalises after the
    head split and transposes after the norm, Qwen3 and Gemma 3 alike)."""
    stem = e.name.rsplit(".", 1)[0]
    letter = e.kind[0]
    head_dim = e.ref.shape[-1]
    seq = e.ref.shape[2] if e.ref.dim() == 4 else None
    for kind in (f"{letter}_norm", f"{letter}_proj"):
        t = e.ref_trace.tensors.get(f"{stem}.{kind}")
        if t is None:
            continue
        if t.dim() == 3 and t.shape[-1] == n_heads * head_dim:
            return t.unflatten(-1, (n_heads, head_dim)).transpose(1, 2)
        if t.dim() == 4 and kind.endswith("_norm") and t.shape[1:3] == (seq, n_heads):
            return t.transpose(1, 2)
        if t.dim() == 4 and t.shape[1] == n_heads:
            return t
    return None


def _pairing(rotated: torch.Tensor, x: torch.Tensor) -> str | None:
    """Which RoPE pairing ``rotated`` preserves (pair norms equal to the input's, up to one scale)."""
    d = x.shape[-1]
    layouts = {
        "half-split (i, i + d/2)": (torch.arange(d // 2), torch.arange(d // 2) + d // 2),
        "interleaved (2i, 2i + 1)": (torch.arange(0, d, 2), torch.arange(1, d, 2)),
    }
    for name, (i, j) in layouts.items():
        rn = rotated.double()[..., i].pow(2) + rotated.double()[..., j].pow(2)
        xn = x.double()[..., i].pow(2) + x.double()[..., j].pow(2)
        keep = xn > 1e-6 * xn.max()
        ratio = rn[keep] / xn[keep]
        if ratio.numel() and float(ratio.std()) / float(ratio.mean()) < 1e-4:
            return name
    return None


def rope_fit(e: Evidence) -> Hint | None:
    """Read ours' rotation back (angles and amplitude per frequency and position) and name the RoPE
    that reproduces it: another layer type's, the unscaled one, another theta, shifted positions."""
    from .rope_fit import identify

    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    layer = e.facts.layer(e.result.layer)
    x = _pre_rope(e, e.ours.shape[1])
    if layer is None or x is None or x.shape != e.ours.shape or e.positions.shape != (e.ours.shape[0], e.ours.shape[2]):
        return None
    ropes = {t: e.facts.rope_of_type(t) for t in sorted(set(e.facts.layer_types))}
    tol = 1e-2 if e.ours.dtype in (torch.bfloat16, torch.float16) else 1e-4
    fit = identify(x, e.ours, layer, ropes, e.positions, tol, e.attention_mask, e.facts.max_position_embeddings)
    if fit is None:
        return None
    own = layer.rope.attention_factor if layer.rope is not None else 1.0
    amp = f"cos/sin scaled by {fit.amplitude:.6g} (the reference: {own:.6g})"
    evidence = {"ours": fit.label, "amplitude": fit.amplitude, "reference_amplitude": own, "layer_type": layer.layer_type}
    if fit.offsets:
        pads = [0] * len(fit.offsets) if e.attention_mask is None else [int(n) for n in (e.attention_mask == 0).sum(1)]
        same = list(fit.offsets) == pads
        because = ("each row's offset equals its pad count: ours counts positions 0..S-1 over the padding, the "
                   "reference (as generation does) from each row's first real token") if same else "positions are shifted"
        return Hint(
            "position_offset",
            f"likely positions not derived from the attention mask: ours rotates each batch row by this layer's RoPE "
            f"at its position + {list(fit.offsets)} (pad counts {pads}); {because}",
            {**evidence, "offsets": list(fit.offsets), "pad_counts": pads},
        )
    if fit.label.startswith("this layer's RoPE"):
        if abs(fit.amplitude / own - 1) < 1e-3:
            return None  # ours is this layer's RoPE: the error is not in the rotation
        named = [(n, v) for n, v in e.facts.named_constants().items() if "attention factor" in n and abs(fit.amplitude / own / v - 1) < 1e-3]
        detail = f" ({named[0][0]})" if named else ""
        return Hint("rope_attention_factor",
                    f"likely the RoPE attention factor: ours rotates with this layer's frequencies but {amp}{detail}", evidence)
    if fit.label.startswith("the RoPE of") and layer.rope is None:
        return Hint(
            "rope_unexpected",
            f"likely RoPE where the reference applies none: this {layer.layer_type} layer is NoPE in the reference, "
            f"ours rotates it with {fit.label}, {amp}",
            evidence,
        )
    if fit.label.startswith("the RoPE of"):
        return Hint(
            "rope_layer_type",
            f"likely RoPE per layer type: this {layer.layer_type} layer of ours uses {fit.label}, {amp}; "
            "in Transformers 5 each layer type has its own rope_parameters (e.g. YaRN on full_attention only)",
            evidence,
        )
    if fit.label.startswith("the unscaled RoPE"):
        return Hint("rope_scaling", f"likely the RoPE scaling is not applied: ours rotates with {fit.label}, {amp}", evidence)
    return Hint("rope_theta", f"likely a different rope theta: ours rotates like {fit.label}, {amp} (the reference: theta "
                f"{layer.rope.theta:g})", evidence)


def rope_pattern(e: Evidence) -> Hint | None:
    """Position 0 agrees and the error grows with position: RoPE (frequencies, scaling, pairing, offset)."""
    ours, ref = e.ours, e.ref
    # Only where RoPE acts: after attention, position 0 agrees trivially (it sees one key).
    if e.kind not in ("q_rot", "k_rot") or ours.dim() != 4 or ours.shape[2] < 3:
        return None
    per_pos = _by_position(ours, ref, 2)
    tol = e.noise
    if float(per_pos[0]) > tol or float(per_pos.max()) <= tol:
        return None
    numbers = (
        f"position 0 agrees (error {float(per_pos[0]):.2g}), later positions differ "
        f"(pos 1: {float(per_pos[1]):.3g}, pos {len(per_pos) - 1}: {float(per_pos[-1]):.3g})"
    )
    evidence = {"position_0": float(per_pos[0]), "last_position": float(per_pos[-1])}
    x = _pre_rope(e, ours.shape[1])
    ref_pairs = None
    if x is not None and x.shape == ours.shape:
        if e.close(ref, x):
            return Hint("rope_unexpected",
                        f"likely RoPE where the reference applies no rotation (a NoPE layer): the reference's {e.kind} is its unrotated input; {numbers}",
                        evidence)
        if e.close(ours, x):
            return Hint("rope_missing", f"likely a missing RoPE: ours applies no rotation here, the reference does; {numbers}", evidence)
        ours_pairs, ref_pairs = _pairing(ours, x), _pairing(ref, x)
        if ours_pairs and ref_pairs and ours_pairs != ref_pairs:
            return Hint("rope_pairing", f"likely RoPE pairing layout: ours rotates {ours_pairs} pairs, the reference {ref_pairs}; {numbers}",
                        {**evidence, "ours": ours_pairs, "reference": ref_pairs})
    d = ours.shape[-1]
    by_dim = (ours.double() - ref.double()).abs().amax(dim=(0, 1, 2))
    if ref_pairs is not None and ref_pairs.startswith("interleaved"):
        freq_err = torch.maximum(by_dim[0::2], by_dim[1::2])  # frequency i rotates dims 2i, 2i + 1
    else:
        freq_err = torch.maximum(by_dim[: d // 2], by_dim[d // 2 :])  # frequency i rotates dims i, i + d/2
    bad = (freq_err > tol).nonzero().flatten().tolist()
    layer = e.facts.layer(e.result.layer)
    rope_type = layer.rope.rope_type if layer is not None and layer.rope is not None else None
    precision = _frequency_precision(e, x, ref_pairs) if x is not None and x.shape == ours.shape else None
    if precision is not None:
        return Hint(
            "rope_frequencies",
            f"likely RoPE frequencies off in their last bits: ours' rotation angles differ from the reference's by "
            f"{precision:.2g} relative (bfloat16 rounding is 4e-3): inverse frequencies computed or rounded in a lower "
            f"precision than the reference's float32; {numbers}",
            {**evidence, "relative": precision},
        )
    # a band: the highest and the lowest frequency agree, the error sits between (a YaRN / llama3 ramp)
    if bad and bad[0] > 0 and bad[-1] < d // 2 - 1:
        band = f" (a {rope_type} correction range / ramp band: rounding or clamping)" if rope_type in ("yarn", "llama3") else ""
        return Hint(
            "rope_band",
            f"likely RoPE frequencies{band}: error confined to a band of rotary frequencies "
            f"{_fmt_list(bad)} of {d // 2}; {numbers}",
            {**evidence, "band": bad},
        )
    return Hint("rope_frequencies", f"likely RoPE frequencies, scaling or offset: {numbers}", evidence)


def _frequency_precision(e: Evidence, x: torch.Tensor, pairing: str | None) -> float | None:
    """The largest relative difference of ours' rotation angles from the reference's, when every
    frequency is off by under 1% (a precision problem, not a different formula), else None."""
    from .rope_fit import rotation

    layer = e.facts.layer(e.result.layer)
    if layer is None or layer.rope is None or e.positions is None:
        return None
    interleaved = pairing is not None and pairing.startswith("interleaved")
    ours_r, _ = rotation(x, e.ours, interleaved, layer.rope.rotary_dim)
    ref_r, weight = rotation(x, e.ref, interleaved, layer.rope.rotary_dim)
    last = int(e.positions[0].argmax())
    angle_ref = ref_r[0, last].angle().abs()
    delta = (ours_r[0, last] / ref_r[0, last]).angle().abs()
    keep = (angle_ref > 1e-3) & (angle_ref < 3.0) & (weight[0, last] > 0)  # unwrapped angles only
    if not bool(keep.any()) or not bool((delta[keep] > 0).any()):
        return None
    relative = float((delta[keep] / angle_ref[keep]).max())
    return relative if relative < 1e-2 else None


def _window_of(probs: torch.Tensor, valid: torch.Tensor | None) -> int | None:
    """The attention window ``probs`` ``(b, h, q, k)`` keeps: the longest span from a query back to
    the earliest key it gives any weight (None: every query sees all earlier keys). Padded rows are
    skipped (their keys are masked by padding, not by a window)."""
    seen = probs.abs() > 0
    if valid is not None:
        seen = seen[valid.bool().all(-1)]
    if seen.numel() == 0:
        return None
    q = torch.arange(seen.shape[-2])[:, None]
    k = torch.arange(seen.shape[-1])[None, :]
    span = torch.where(seen, q - k + 1, torch.zeros_like(q - k)).amax(dim=-1)  # (..., q)
    full = (span == q.flatten() + 1).all()
    return None if bool(full) else int(span.amax())


def window_pattern(e: Evidence) -> Hint | None:
    """Only the query positions from some point up to the window on differ: the first position
    that can see a key the window decides about (the smaller of ours' and the reference's window)."""
    if e.kind not in ("probs", "context", "scores"):
        return None
    if e.kind == "probs" and e.ours.dim() == 4:
        ours_w, ref_w = _window_of(e.ours, e.attention_mask), _window_of(e.ref, e.attention_mask)
        if ours_w != ref_w:
            show = lambda w: "full causal attention" if w is None else f"a window of {w}"  # noqa: E731
            return Hint(
                "sliding_window",
                f"likely the sliding window size or mask: ours attends with {show(ours_w)}, the reference with "
                f"{show(ref_w)} (read from which keys get any weight)",
                {"ours": ours_w, "reference": ref_w},
            )
    layer = e.facts.layer(e.result.layer)
    window = (layer.window if layer is not None else None) or e.facts.sliding_window
    axis = _seq_axis(e.kind)
    if not window or e.ours.dim() <= axis or e.ours.shape[axis] <= window:
        return None
    per_pos = _by_position(e.ours, e.ref, axis)
    bad = (per_pos > e.noise).nonzero().flatten().tolist()
    if bad and 1 <= min(bad) <= window:
        mine = layer.window if layer is not None else None
        ref = f"the reference's window here is {mine}" if mine else "the reference attends to every earlier key here"
        return Hint(
            "sliding_window",
            f"likely the sliding window size or mask: positions < {bad[0]} agree, positions {bad[0]}..{bad[-1]} "
            f"differ (max error {float(per_pos.max()):.3g}); {ref}",
            {"window": mine, "first_bad_position": bad[0]},
        )
    return None


def untied_head(e: Evidence) -> Hint | None:
    """Everything before the output agrees but the logits are uncorrelated: an unloaded or untied head."""
    if e.kind not in (e.facts.head_module.rsplit(".", 1)[-1], "logits") or e.result.cosine is None or abs(e.result.cosine) > 0.3:
        return None
    tied = " (the config ties it to the embedding)" if e.facts.tie_word_embeddings else ""
    return Hint(
        "untied_head",
        f"likely an output head that was never loaded or tied{tied}: every hidden node before it agrees, "
        f"the logits are uncorrelated (cosine {e.result.cosine:.3f})",
        {"cosine": e.result.cosine},
    )


def nonfinite(e: Evidence) -> Hint:
    result = e.result
    if e.ours is None or e.ref is None:
        return Hint("nonfinite", f"non-finite values appear first here: {result.detail}")
    bad = ~torch.isfinite(e.ours) | ~torch.isfinite(e.ref)
    axis = _seq_axis(e.kind)
    where, evidence = [], {}
    if bad.dim() > axis:
        rows = bad.movedim(axis, 0).flatten(1).any(1).nonzero().flatten().tolist()
        where.append(f"positions {_fmt_list(rows, 10)}")
        evidence["positions"] = rows[:64]
    if bad.dim() > 1:
        batch = bad.flatten(1).any(1).nonzero().flatten().tolist()
        where.append(f"batch rows {_fmt_list(batch)}")
        evidence["batch_rows"] = batch
    return Hint("nonfinite", f"non-finite values appear first here: {result.detail}; at {', '.join(where)} (masked or padded rows?)",
                evidence)


#: detectors tried in order on a node that has both tensors of one shape
DETECTORS: tuple[Callable[[Evidence], Hint | None], ...] = (
    sibling_match,
    untied_head,
    transposed_weight,
    expert_weights,
    rounding_order,
    norm_eps,
    norm_kind,
    block_layout,
    norm_placement,
    constant_ratio,
    row_normalisation,
    last_dim_permutation,
    head_mapping,
    softmax_temperature,
    window_pattern,
    rope_fit,
    rope_pattern,
    channel_ratio,
)


def diagnose(result: NodeResult, ours_trace: Trace, ref_trace: Trace, facts: ArchFacts,
             positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             spec: NodeSpec | None = None) -> Hint | None:
    """A likely cause for a failing node, with its evidence; None if no pattern is recognised.
    ``positions``: ``(batch, seq)`` token positions of the run and ``attention_mask`` its padding
    (RoPE hints need them); ``spec``: the node's NodeSpec (which scores a choice was made from)."""
    if result.status == MISSING:
        return Hint("missing", f"likely a node-map or tap problem: {result.detail}")
    if result.status == SHAPE:
        return Hint("shape", f"likely a layout or head-count difference: {result.detail}")
    e = Evidence(result, ours_trace.tensors.get(result.name), ref_trace.tensors.get(result.name), ours_trace, ref_trace,
                 facts, positions, attention_mask)
    if result.status == NONFINITE:
        return nonfinite(e)
    if result.status == CHOICE:
        return choice(e, spec)
    if e.ours is None or e.ref is None or e.ours.shape != e.ref.shape:
        return None
    for detect in DETECTORS:
        hint = detect(e)
        if hint is not None:
            return hint
    return None
