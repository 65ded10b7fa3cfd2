"""Compare two tensors, and two traces node by node, against dtype-aware tolerances.

A node passes when every element satisfies ``|ours - ref| <= atol + rtol * |ref|`` (the
``torch.isclose`` rule). An integer node (the experts a router chose) is compared exactly: a
different choice is its own status, ``choice``, with the rows that differ and, when the node says
which scores it was chosen from, the reference's margin there (a near-tie is a numerical accident,
a wide margin a real difference upstream). Metrics are computed chunk by chunk (a bounded working set, however large
the node), differences in the inputs' precision (float32 for float32 and lower, float64 for
float64) and every sum accumulated in float64, so the metrics add no error of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from parity.compare.layouts import cosine, match_layout
from parity.compare.metrics import (
    CHOICE,
    MISMATCH,
    MISSING,
    NONFINITE,
    OK,
    SHAPE,
    UNTAPPED,
    Metrics,
    choice_result,
    tensor_metrics,
)
from parity.compare.padding import unpacked, without_padding
from parity.compare.tolerances import Tolerances
from parity.model.pair import LOGITS, NodeSpec
from parity.record.hf_capture import EXPERT_NODE, OUTPUT_PROJECTIONS
from parity.record.hooks import ABSORBED, FUNCTIONS
from parity.record.routing import CHOICES, WEIGHTS
from parity.record.trace import Trace, one_thread

if TYPE_CHECKING:  # a hint is diagnose's output; comparing only carries it
    from parity.diagnose.hints import Hint

#: what a node's tensor of ours is passed as (a tensor, or None when ours has none)
_Ours = TypeVar("_Ours", bound="torch.Tensor | None")


@dataclass(frozen=True)
class NodeResult:
    """The comparison of one node. Absent metrics (missing node, shape mismatch) are None."""

    name: str
    index: int
    status: str
    layer: int | None
    kind: str
    shape_ours: tuple[int, ...] | None
    shape_ref: tuple[int, ...] | None
    dtype: str | None
    max_abs: float | None
    mean_abs: float | None
    max_rel: float | None
    cosine: float | None
    atol: float
    rtol: float
    hint: Hint | None = None
    detail: str = ""
    #: ||ours - ref|| / ||ref|| (cosine is blind to scale; this is not)
    rel_l2: float | None = None
    #: smallest atol that passes with this rtol, and smallest rtol that passes with this atol
    atol_needed: float | None = None
    rtol_needed: float | None = None
    #: where atol/rtol came from: "default:<dtype>", "run", "pattern:<glob>", "calibrated" or "exact"
    tol_source: str = ""

    @property
    def passed(self) -> bool:
        """True when the node agrees. An ``untapped`` node (a user model without that tap) is
        neither a pass nor a failure: it is not part of the verdict (see :attr:`judged`)."""
        return self.status == OK

    @property
    def judged(self) -> bool:
        return self.status != UNTAPPED

    @property
    def failed(self) -> bool:
        """Judged and not ok (an ``untapped`` node never fails)."""
        return self.judged and not self.passed

    @property
    def differs(self) -> bool:
        """Any difference at all (the first divergence of a pair that is bit-exact when correct)."""
        return self.judged and (self.status != OK or bool(self.max_abs))

    @property
    def hint_text(self) -> str:
        return self.hint.text if self.hint is not None else ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("shape_ours", "shape_ref"):
            d[key] = list(d[key]) if d[key] is not None else None
        d["hint"] = self.hint_text
        d["hint_kind"] = self.hint.kind if self.hint is not None else None
        d["hint_evidence"] = dict(self.hint.evidence) if self.hint is not None else None
        return d

    def line(self) -> str:
        """One line for logs, JUnit and error messages."""
        if self.max_abs is None or self.status in (NONFINITE, CHOICE):
            return f"{self.name}: {self.status} ({self.detail})"
        return (
            f"{self.name}: {self.status} max_abs={self.max_abs:.3g} mean_abs={self.mean_abs:.3g} "
            f"cosine={self.cosine:.6f} (atol={self.atol:g}, rtol={self.rtol:g})"
        )


def _first_along(ref: torch.Tensor, axis: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``ref``'s first entry along ``axis``, in ``shape``."""
    return ref.narrow(axis, 0, 1).reshape(shape)


def _every(ref: torch.Tensor, step: int) -> torch.Tensor:
    """Every ``step``-th row of ``ref`` (each sequence's first of tokens flattened over the batch)."""
    return ref[::step]


def _routed_rows(
    name: str, our_t: torch.Tensor, ref_t, padding: torch.Tensor | None
) -> tuple[torch.Tensor, str] | None:
    """An expert's output of ours on the tokens routed to it alone ``(n, hidden)``, no routing read to place them
    (a port with no module for its MoE block gathers ``x[chosen == e]`` in functions): put on the tokens the
    reference routes to that expert, in token order (the reference's node is zero on the others), when it routes
    as many; with ``padding``, the reference's real tokens among them when ours skips the padding. ``(ours on
    every token, how)``, or None when the counts differ (the routing differs: a failure, read by shape)."""
    if not EXPERT_NODE.search(name) or our_t.dim() != 2 or not our_t.is_floating_point():
        return None
    ref = ref_t if isinstance(ref_t, torch.Tensor) else ref_t.load()
    if ref.dim() != 2 or ref.shape[1] != our_t.shape[1] or our_t.shape[0] >= ref.shape[0]:
        return None
    routed = ref.ne(0).any(-1)
    padded = padding is not None and padding.numel() == ref.shape[0]

    def placed(rows: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """``mine`` on ``rows``, zero elsewhere, the reference's values at the padding (not judged)."""
        out = ref.new_zeros(ref.shape, dtype=mine.dtype)
        out[rows] = mine.to(out.device)
        if padding is not None and padded:
            out = torch.where(padding.flatten()[:, None].to(out.device), ref.to(out.dtype), out)
        return out

    ways = [(routed, "the tokens the reference routes to this expert")]
    if padding is not None and padded:
        ways.append((routed & ~padding.flatten().to(routed.device), "the real tokens the reference routes to it"))
    for rows, which in ways:
        if int(rows.sum()) == our_t.shape[0]:
            return placed(rows, our_t), (
                f"ours' {our_t.shape[0]} rows put on {which}, in token order (ours runs it on those alone)"
            )
    if padding is not None and padded and int(padding.any(-1).sum()) == 1:
        # ours routes some padding tokens the reference does not (their states are no one's): with one row padded,
        # on the left, the rows ours has beyond the reference's real ones are that row's, before its real tokens
        real = routed & ~padding.flatten().to(routed.device)
        extra = our_t.shape[0] - int(real.sum())
        row = int(padding.any(-1).nonzero()[0])
        seq = padding.shape[1]
        before = int(real[: row * seq].sum())
        if 0 < extra <= int(padding[row].sum()):
            return placed(real, torch.cat([our_t[:before], our_t[before + extra :]])), (
                f"ours' {our_t.shape[0]} rows put on the real tokens the reference routes to this expert, in token "
                f"order, past the {extra} padding tokens ours routes to it too (ours runs it on those alone)"
            )
    return None


def _one_position(
    name: str, our_t: torch.Tensor, ref_t, atol: float, rtol: float, padding: torch.Tensor | None = None
) -> Metrics | None:
    """Ours holds one position of the reference's node (its sequence axis dropped, or of size 1; a router's
    ``(batch * seq, experts)`` one row per sequence) and agrees with the reference's first: a model run one token
    per call inside its forward (a decode loop, llama2.c's ``forward(token, pos)``), its first call recorded; not
    judged beyond it. An expert's node (its first call is the first token routed to it, in no fixed place) is not
    judged at all. ``padding``: ``(batch, seq)``, True at padding: a row whose first position is padding is not
    judged. None for any other shape difference, one differing at the first position too (a shape difference:
    the diagnosis reads it)."""
    shape = tuple(ref_t.shape)
    firsts: list[tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = []
    for axis, size in enumerate(shape[:-1]):  # the last axis holds features (a router's k): never the positions
        dropped, kept = shape[:axis] + shape[axis + 1 :], shape[:axis] + (1,) + shape[axis + 1 :]
        if size >= 2 and tuple(our_t.shape) in (dropped, kept):
            firsts.append((axis, size, partial(_first_along, axis=axis, shape=tuple(our_t.shape))))
    if padding is not None and padding.dim() == 2 and shape and shape[0] == padding.numel() > padding.shape[0]:
        seq = padding.shape[1]  # tokens flattened over the batch: each sequence's first is every seq-th row
        if tuple(our_t.shape) == (padding.shape[0], *shape[1:]):
            firsts.append((0, seq, partial(_every, step=seq)))
    ref = ref_t if isinstance(ref_t, torch.Tensor) or not firsts else ref_t.load()  # a spilled node, read once
    for axis, size, pick in firsts:
        first = pick(ref)
        if first.is_floating_point() != our_t.is_floating_point():
            continue
        held = f"ours holds one position of {size} (axis {axis}): a forward run one token per call (a decode loop)"
        if EXPERT_NODE.search(name):
            return Metrics(status=UNTAPPED, detail=f"{held}; an expert's first call is no fixed position: not judged")
        mine = our_t
        if padding is not None and padding.dim() == 2 and our_t.dim() and our_t.shape[0] == padding.shape[0]:
            real = ~padding[:, 0].to(our_t.device)  # rows whose first position is a real token
            mine, first = our_t[real], first[real]
        agrees = mine.numel() == 0 or (
            tensor_metrics(mine, first, atol, rtol).status == OK
            if first.is_floating_point()
            else torch.equal(mine.sort(-1).values, first.sort(-1).values)  # a router's choices, a set per row
        )
        if agrees:
            return Metrics(
                status=UNTAPPED,
                detail=f"{held}, its first call recorded, which agrees with the reference's first; not judged beyond it",
            )
    return None


def compare_node(
    spec: NodeSpec,
    index: int,
    our_t,
    ref_t,
    tolerances: Tolerances,
    untapped: bool = False,
    scores=None,
    padding: torch.Tensor | None = None,
    choices: tuple | None = None,
    tokens: tuple[int, int] | None = None,
) -> NodeResult:
    """One node's NodeResult. ``untapped``: ours has no tap for it (a user model): not judged.
    ``scores``: for an integer node, the reference's tensor of ``spec.chosen_from``. ``padding``:
    ``(batch, seq)``, True at padding positions, which are then not judged (:mod:`parity.compare.padding`).
    ``choices``: for a router's weights, ``(ours' chosen experts, the reference's)``: each side's weights
    are put in the order of its experts' indices first (top-k's order is no part of the routing). ``tokens``: the
    run's ``(batch, seq)`` (:func:`token_shape`), for :func:`in_reference_layout`."""
    atol, rtol, source = tolerances.for_node(spec.name)
    # a bit-exact check judges top-k's order (it decides the experts' summation order); a check within
    # tolerances judges the choices as sets, and the weights choice by choice
    ordered = tolerances.exact
    if choices is not None and spec.kind == WEIGHTS and not ordered:
        ref_t = ref_t.load() if ref_t is not None and not isinstance(ref_t, torch.Tensor) else ref_t  # (tokens, k)
        mine, theirs = by_choice(our_t, choices[0]), by_choice(ref_t, choices[1])
        if mine is not our_t and theirs is not ref_t:  # both in their experts' order, or neither
            our_t, ref_t = mine, theirs
    our_t, layout = in_reference_layout(spec, our_t, ref_t, padding, tokens)
    if untapped and our_t is None:
        if spec.ours.startswith("unaligned:"):
            detail = "not aligned: " + spec.ours[len("unaligned:") :]
        elif spec.ours.startswith("param:"):
            param = spec.ours[len("param:") :]
            detail = f"no product in ours read {param} (or a copy of it) while the forward ran"
            if isinstance(ref_t, torch.Tensor) and not bool(ref_t.any()):
                detail += (
                    " (the reference's value is all zeros: nothing ran there either, e.g. an expert given no token)"
                )
            else:
                detail += ": tap its result"
        else:
            module = spec.ours[len("tap:") :].rsplit(".", 1)[0]
            detail = f"no tap in ours: add parity.tap(tensor, {spec.name.rsplit('.', 1)[-1]!r}) in {module}'s forward"
        metrics = Metrics(status=UNTAPPED, detail=detail)
    elif ref_t is None or our_t is None:
        side = "reference" if ref_t is None else "ours"
        where = spec.name if ref_t is None else spec.ours
        if not where:  # the root: what forward returned held no tensor
            where = "the value its forward returns (no tensor, nor a tuple, list or dict holding one first)"
        metrics = Metrics(status=MISSING, detail=f"{side} produced no tensor at {where}")
    elif ref_t.shape != our_t.shape and (one := _one_position(spec.name, our_t, ref_t, atol, rtol, padding)):
        metrics = one
    elif ref_t.shape != our_t.shape and (routed := _routed_rows(spec.name, our_t, ref_t, padding)) is not None:
        our_t, how = routed
        metrics = tensor_metrics(our_t, ref_t, atol, rtol)
        metrics = replace(metrics, detail="; ".join(d for d in (metrics.detail, how) if d))
    elif ref_t.shape != our_t.shape:
        metrics = Metrics(status=SHAPE, detail=f"ours {tuple(our_t.shape)} vs reference {tuple(ref_t.shape)}")
    elif not ref_t.is_floating_point() and not our_t.is_floating_point():
        ref_t = ref_t if isinstance(ref_t, torch.Tensor) else ref_t.load()  # a spilled integer node: small
        metrics = choice_result(our_t, ref_t, scores, ordered)
    else:
        metrics = tensor_metrics(our_t, ref_t, atol, rtol)
        masked = metrics.max_abs is not None and metrics.max_abs >= MASKED
        if metrics.status in (MISMATCH, NONFINITE) and spec.kind == "scores" and masked:
            our_t, metrics = _masked_alike(our_t, ref_t, atol, rtol, metrics)
        if metrics.status == MISMATCH and padding is not None and bool(padding.any()):
            metrics = replace(metrics, cosine=_real_cosine(spec.kind, our_t, ref_t, padding))
    dtype = ref_t.dtype if ref_t is not None else our_t.dtype if our_t is not None else None
    if layout:
        metrics = replace(metrics, detail="; ".join(d for d in (metrics.detail, f"compared as {layout}") if d))
    return NodeResult(
        name=spec.name,
        index=index,
        status=metrics.status,
        layer=spec.layer,
        kind=spec.kind,
        shape_ours=tuple(our_t.shape) if our_t is not None else None,
        shape_ref=tuple(ref_t.shape) if ref_t is not None else None,
        dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
        max_abs=metrics.max_abs,
        mean_abs=metrics.mean_abs,
        max_rel=metrics.max_rel,
        cosine=metrics.cosine,
        atol=atol,
        rtol=rtol,
        detail=metrics.detail,
        rel_l2=metrics.rel_l2,
        atol_needed=metrics.atol_needed,
        rtol_needed=metrics.rtol_needed,
        tol_source=source,
    )


def _real_cosine(kind: str, ours: torch.Tensor, ref, padding: torch.Tensor) -> float | None:
    """The cosine of ``ours`` and ``ref`` over the real tokens only (padding positions zeroed on both sides): ours
    holds the reference's values at the padding once compared, which would pull a ratio of one constant (a scale
    folded into a gain) away from 1."""
    ref = ref if isinstance(ref, torch.Tensor) else ref.load()
    a = without_padding(kind, ours.double(), torch.zeros((), dtype=torch.float64).expand(ours.shape), padding)
    b = without_padding(kind, ref.double(), torch.zeros((), dtype=torch.float64).expand(ref.shape), padding)
    na, nb = float(a.norm()), float(b.norm())
    if not (na > 0 and nb > 0):
        return None if na != nb else 1.0
    return max(-1.0, min(1.0, float((a * b).sum()) / (na * nb)))


#: a value not read yet (None is a reading: no such constant)
_UNREAD = object()


def _post_head_scale(store, names) -> float | None:
    """The one constant ``c`` (not 1) the reference's logits are its head's output times (Falcon-H1's
    ``lm_head_multiplier``, Cohere's ``logit_scale``), its head the node among ``names`` of the logits' shape;
    None when there is none."""
    logits = store.get(LOGITS)
    logits = logits if logits is None or isinstance(logits, torch.Tensor) else logits.load()
    for name in names:
        head = store.get(name) if name != LOGITS else None
        head = head if head is None or isinstance(head, torch.Tensor) else head.load()
        if logits is None or head is None or head.shape != logits.shape or not head.is_floating_point():
            continue
        r, lg = head.double().flatten(), logits.double().flatten()
        c = float((r * lg).sum() / r.pow(2).sum().clamp_min(1e-300))
        if abs(c - 1) > 1e-6 and (lg - c * r).norm() <= 1e-5 * lg.norm():
            return c
    return None


def _agrees_at_start(t, ref, padding: torch.Tensor | None) -> bool:
    """Whether ``t`` (a rotated q or k ``(batch, heads, seq, head_dim)`` in the reference's layout) equals the
    reference at each row's first real token (left padding skipped), where RoPE turns nothing."""
    if not isinstance(t, torch.Tensor) or not isinstance(ref, torch.Tensor) or t.shape != ref.shape or t.dim() != 4:
        return False
    b, s = t.shape[0], t.shape[2]
    first = torch.zeros(b, dtype=torch.long)
    if padding is not None and tuple(padding.shape) == (b, s):
        first = (~padding.bool()).int().argmax(-1)
    rows = torch.arange(b)
    a, r = t[rows, :, first].double(), ref[rows, :, first].double()
    return bool((a - r).norm() <= 1e-3 * r.norm().clamp_min(1e-30))


#: a score at or below minus this is a mask's fill (-inf, a dtype's lowest, -1e30...), not a value a softmax weighs
MASKED = 1e30


def _masked_alike(ours: torch.Tensor, ref, atol: float, rtol: float, metrics: Metrics) -> tuple[torch.Tensor, Metrics]:
    """Scores masked after ``q k^T`` on both sides with different fills (float32's lowest in ours, float64's in the
    reference's float64 run; -inf against ``finfo.min``): the positions both mask taken as equal, the rest compared.
    Any position one side masks and the other does not still differs by at least :data:`MASKED`."""
    ref = ref if isinstance(ref, torch.Tensor) else ref.load()
    both = (ours <= -MASKED) & (ref <= -MASKED)
    if not bool(both.any()):
        return ours, metrics
    wide = torch.promote_types(ours.dtype, ref.dtype)  # float64's lowest has no float32 value
    alike = torch.where(both, ref.to(wide), ours.to(wide))
    again = tensor_metrics(alike, ref, atol, rtol)
    note = "positions masked on both sides (fills of -inf or a dtype's lowest) taken as equal"
    return alike, replace(again, detail="; ".join(d for d in (again.detail, note) if d))


def _without_sink_column(kind: str, ours: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """Ours' attention probabilities (scores) with one key column more than the reference's: an attention sink
    kept as an extra key (GPT-OSS's sinks, a "softmax over [scores | sink]" whose sink column a port keeps, with a
    zero value row) that the reference drops after the softmax. ``(ours without it, how)``: the column at either
    end, the closer of the two to the reference; None when the shapes differ otherwise."""
    if kind not in ("probs", "scores") or ours.dim() != ref.dim() or ours.shape[:-1] != ref.shape[:-1]:
        return None
    if ours.shape[-1] != ref.shape[-1] + 1:
        return None
    ends = {"last": ours[..., :-1], "first": ours[..., 1:]}
    end = min(ends, key=lambda e: float((ends[e].double() - ref.double()).abs().nan_to_num(float("inf")).max()))
    return ends[end], f"ours without its {end} key column (an attention sink kept as an extra key)"


def _repeated_heads(ours: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """Ours' keys or values after GQA's expansion (each KV head repeated for its query heads) where the reference
    records them before it: one axis ``g`` times the reference's, its ``g`` copies exactly equal, interleaved
    (``repeat_interleave``) or tiled (``repeat``). ``(ours with one copy each, how)``; None otherwise. Which
    query head reads which copy is judged at the scores."""
    if ours.dim() != ref.dim() or ours.dim() < 3:
        return None
    axes = [a for a in range(ours.dim()) if ours.shape[a] != ref.shape[a]]
    if len(axes) != 1:
        return None
    axis = axes[0]
    n, m = ref.shape[axis], ours.shape[axis]
    if n < 1 or m % n or m == n:
        return None
    g = m // n
    for grouped, taken, how in ((ours.unflatten(axis, (n, g)), axis + 1, "repeat_interleave"),
                                (ours.unflatten(axis, (g, n)), axis, "repeat")):  # fmt: skip
        first = grouped.narrow(taken, 0, 1)
        if torch.equal(grouped, first.expand_as(grouped)):
            return first.squeeze(taken), f"ours' heads {g} copies of each of the reference's ({how}: GQA expanded)"
    return None


def _without_sink_key(kind: str, ours: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """Ours' keys with one all-zero key more than the reference's along the token axis (an attention sink kept as an
    extra key, its score set by the mask), at either end, dropped; GQA's expansion of the rest read back too
    (:func:`_repeated_heads`). ``(ours without it, how)``; None otherwise."""
    if kind != "k_rot" or ours.dim() != ref.dim() or ours.dim() < 3:
        return None
    for axis in (a for a in range(ours.dim()) if ours.shape[a] == ref.shape[a] + 1):
        n = ours.shape[axis]
        for end, kept, dropped in (("last", (0, n - 1), n - 1), ("first", (1, n - 1), 0)):
            if bool(ours.narrow(axis, dropped, 1).any()):
                continue
            rest = ours.narrow(axis, *kept)
            how = f"ours without its {end} key (all zeros: an attention sink kept as an extra key)"
            if rest.shape == ref.shape:
                return rest, how
            repeated = _repeated_heads(rest, ref)
            if repeated is not None:
                return repeated[0], f"{how}; {repeated[1]}"
    return None


def _sequence_first(ours, padding: torch.Tensor | None) -> torch.Tensor | None:
    """Ours' ``(tokens, ...)`` read as flattened ``(seq, batch)`` and put back ``(batch, seq)`` order, for a batch of
    several rows (``padding``'s ``(batch, seq)``); None where that cannot be (one row, another token count)."""
    if not isinstance(ours, torch.Tensor) or padding is None or padding.dim() != 2 or ours.dim() < 2:
        return None
    batch, seq = padding.shape
    if batch < 2 or ours.shape[0] != batch * seq:
        return None
    return ours.reshape(seq, batch, *ours.shape[1:]).transpose(0, 1).reshape(ours.shape)


def _read_in_functions(spec: NodeSpec) -> bool:
    """Whether ours' value of the node is an op parity read in ours' functions (a parameter's product, an attention
    internal): one such op may compute a part of the node (a module's hook gives its whole output). An expert's
    product holds the rows of the tokens routed to it, not a part of its features (:func:`_routed_rows` places
    them)."""
    return spec.ours.startswith(("param:", f"tap:{FUNCTIONS}")) and not EXPERT_NODE.search(spec.name)


def _part_of_reference(
    ours: torch.Tensor, ref: torch.Tensor, tokens: tuple[int, int] | None
) -> tuple[torch.Tensor, str] | None:
    """Ours holding one part of the reference's tensor along its heads' or features' axis (a port computing heads one
    at a time, or one tensor-parallel rank's heads, read on its first call): the reference's tensor with that part put
    in ours' place, the part whose layout (:func:`match_layout`) is closest to ours, when it is close (cosine over
    0.5, padding positions included); the rest the reference's own values, not judged here (the nodes after it read
    every part). ``(that tensor, how)``; None otherwise. Never a part of the tokens (the batch, and with ``tokens``, the run's
    ``(batch, seq)``, an axis of ``seq`` or ``batch * seq``): a decode step's one token is no part of the heads."""
    if not ours.is_floating_point() or not ours.numel() or ours.numel() >= ref.numel() or ref.numel() % ours.numel():
        return None
    parts = ref.numel() // ours.numel()
    best: tuple[float, int, int, int, torch.Tensor] | None = None
    token_sizes = () if tokens is None else (tokens[1], tokens[0] * tokens[1])
    for axis in range(1, ref.dim()):
        if ref.shape[axis] in token_sizes:
            continue
        n = ref.shape[axis]
        if n % parts:
            continue
        size = n // parts
        for start in range(0, n, size):
            part = ref.narrow(axis, start, size)
            moved = ours if ours.shape == part.shape else (match_layout(ours, part) or (None, ""))[0]
            if moved is None:
                continue
            # scored on the values both hold (a mask's -inf or float32 min on both sides is no evidence)
            real = torch.isfinite(moved) & (moved.abs() < 1e30)
            if not torch.equal(real, torch.isfinite(part) & (part.abs() < 1e30)) or not bool(real.any()):
                continue
            score = cosine(moved[real], part[real])
            if best is None or score > best[0]:
                best = (score, axis, start, size, moved)
    if best is None or best[0] < 0.5:  # (padding positions' values, never judged, count here)
        return None
    _, axis, start, size, moved = best
    whole = ref.clone()
    whole.narrow(axis, start, size).copy_(moved.to(whole.dtype))
    return whole, (
        f"ours computes it in parts ({start}:{start + size} of {ref.shape[axis]} along the reference's axis {axis}: "
        "one head at a time, or one tensor-parallel rank's): that part compared, the rest not judged here"
    )


def in_reference_layout(
    spec: NodeSpec, ours: _Ours, ref, padding: torch.Tensor | None = None, tokens: tuple[int, int] | None = None
) -> tuple[_Ours | torch.Tensor, str]:
    """``(ours, how)``: ours in the reference's layout when the node may be (``spec.match_layout``)
    and only the layout differs (:func:`parity.compare.layouts.match_layout`), else as it is, ``""``.
    With ``padding`` (True at padding positions), ours holding the real tokens alone is unpacked,
    and ours' padding positions take the reference's values: they are not judged. ``tokens``: the run's
    ``(batch, seq)``, which axes hold tokens (:func:`_part_of_reference`)."""
    if ours is None or ref is None or not isinstance(ours, torch.Tensor):
        return ours, ""
    how, moved = "", cast(torch.Tensor, ours)
    if spec.match_layout and tuple(ours.shape) != tuple(ref.shape):
        full = ref if isinstance(ref, torch.Tensor) else ref.load()
        found = match_layout(ours, full) if ours.numel() == full.numel() else None
        if found is not None:
            moved, how = found
        elif (sunk := _without_sink_column(spec.kind, moved, full)) is not None:
            moved, how = sunk
        elif (repeated := _repeated_heads(moved, full)) is not None:
            moved, how = repeated
        elif (sunk_key := _without_sink_key(spec.kind, moved, full)) is not None:
            moved, how = sunk_key
        elif _read_in_functions(spec) and (part := _part_of_reference(moved, full, tokens)) is not None:
            moved, how = part
        elif padding is not None and (packed := unpacked(spec.kind, moved, full, padding)) is not None:
            moved, how = packed, "the real tokens packed into one sequence (padding skipped)"
        elif (row := _broadcast_row(moved, full, padding)) is not None:
            moved, how = row
            return moved, how  # (its padding already the reference's: one row of the batch, compared alone)
    if padding is not None and tuple(moved.shape) == tuple(ref.shape) and moved.dtype != torch.bool:
        # (expert choices too: a router's choice at a padding token is as unspecified as its scores)
        moved = without_padding(spec.kind, moved, ref if isinstance(ref, torch.Tensor) else ref.load(), padding)
    return moved, how


def _broadcast_row(
    ours: torch.Tensor, ref: torch.Tensor, padding: torch.Tensor | None
) -> tuple[torch.Tensor, str] | None:
    """Ours ``(batch, *ref.shape)`` where the reference's node holds one value broadcast over the batch (Pegasus's
    sinusoid positions ``(seq, hidden)``, added to every row): ours' row farthest from it, its padding positions
    (``padding`` ``(batch, seq)``, True there) the reference's, not judged; None unless the shapes say so."""
    if ours.dim() == ref.dim() and ref.dim() >= 2 and ref.shape[0] == 1 < ours.shape[0]:
        # a batch of one broadcast over the run's rows (PLBart's positions, (1, seq, hidden)): its one row
        row = _broadcast_row(ours, ref[0], padding)
        return None if row is None else (row[0][None], row[1])
    if ours.dim() != ref.dim() + 1 or tuple(ours.shape[1:]) != tuple(ref.shape) or not ours.is_floating_point():
        return None
    rows = ours.detach().clone()
    if padding is not None and tuple(padding.shape) == tuple(ours.shape[:2]) and ref.dim() >= 1:
        pad = padding.to(torch.bool)
        for i in range(rows.shape[0]):
            rows[i][pad[i]] = ref[pad[i]].to(rows.dtype)
    gaps = [float((r.double() - ref.double()).abs().max()) if r.numel() else 0.0 for r in rows]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return rows[worst], (
        f"the reference's node holds one value broadcast over the batch, ours one per row ({rows.shape[0]} rows): "
        f"compared at row {worst}, the farthest from it"
    )


def node_order(reference, nodes: Sequence[NodeSpec], ours_order: Sequence[str] = ()) -> list[str]:
    """Node names in the reference's execution order. A node the reference never produced goes where
    it ran in ours (``ours_order``: ours' nodes in the order ours produced them), right after the
    nearest earlier node the reference produced, so a module the reference skipped is reported where
    it would have run, not after the logits; one neither produced goes after its nearest predecessor
    in the node list within its own block where it has one (a Mamba's conv1d, whose weight the reference reads in
    a function, after its in_proj: not after the MLP the layer's module list declares before the mixer)."""
    names = {n.name for n in nodes}
    order = [name for name in reference.order if name in names]
    unplaced = [n.name for n in nodes if n.name not in reference.tensors]
    ran = [name for name in ours_order if name in names]
    for sequence, by_block in ((ran, False), ([n.name for n in nodes], True)):
        position = {name: i for i, name in enumerate(sequence)}
        for name in [u for u in unplaced if u in position]:
            # an attention internal the reference computes unread stays after its predecessor in the list
            inside = by_block and name.rsplit(".", 1)[-1] not in CAPTURED
            before = [
                (_shared_prefix(name, other) if inside else 0, position[other], k)
                for k, other in enumerate(order)
                if other in position and position[other] < position[name]
            ]
            after = [
                (_shared_prefix(name, other), -position[other], k)
                for k, other in enumerate(order)
                if inside and other in position and position[other] > position[name]
            ]
            if after and max(after)[0] > (max(before)[0] if before else 0):  # its block's first node follows it
                order.insert(max(after)[2], name)
            else:
                order.insert(max(before)[2] + 1 if before else 0, name)
            unplaced.remove(name)
    return order


def _shared_prefix(a: str, b: str) -> int:
    """How many leading dotted parts two node names share, short of their own last ones."""
    n = 0
    for x, y in zip(a.split(".")[:-1], b.split(".")[:-1], strict=False):
        if x != y:
            break
        n += 1
    return n


def by_choice(weights, chosen):
    """A router's ``weights`` (``(..., k)``) with each row in the order of its ``chosen`` experts' indices
    (same number of rows); as they are when either is missing or they do not fit."""
    if not isinstance(weights, torch.Tensor) or not isinstance(chosen, torch.Tensor) or chosen.is_floating_point():
        return weights
    if weights.numel() != chosen.numel() or not weights.numel() or weights.shape[-1] != chosen.shape[-1]:
        return weights
    order = chosen.reshape(-1, chosen.shape[-1]).argsort(dim=-1, stable=True).to(weights.device)
    return weights.reshape(order.shape).gather(-1, order).reshape(weights.shape)


def choices_of(spec: NodeSpec, ours: Mapping, reference: Mapping) -> tuple | None:
    """For a router's weights node, ``(ours' chosen experts, the reference's)`` (its block's choices node)."""
    if spec.kind != WEIGHTS or not spec.name.endswith(WEIGHTS):
        return None
    chosen = spec.name[: -len(WEIGHTS)] + CHOICES
    return ours.get(chosen), reference.get(chosen)


def token_shape(nodes: Sequence[NodeSpec], store) -> tuple[int, int] | None:
    """The run's ``(batch, seq)``: the reference's embedding output's ``(batch, seq, hidden)`` in ``store`` (a trace's
    tensors), else its logits'; None when it holds neither so."""
    names = [n.name for n in nodes if n.kind == "embed_tokens"] + [LOGITS]
    for name in names:
        t = store.lazy(name) if hasattr(store, "lazy") else store.get(name)
        if t is not None and t.dim() == 3:
            return int(t.shape[0]), int(t.shape[1])
    return None


def compare_traces(
    ours,
    reference,
    nodes: Sequence[NodeSpec],
    tolerances: Tolerances,
    untapped: frozenset[str] = frozenset(),
    padding: torch.Tensor | None = None,
) -> list[NodeResult]:
    """One NodeResult per node, in the reference's execution order.

    Nodes the reference never produced are ``missing``, placed where the node list puts them: a node
    that cannot be compared is reported, never counted as agreeing. A node ``ours`` already compared while it ran
    (:class:`NodeStream`, in ``ours.results``) is taken from there.
    """
    by_name = {n.name: n for n in nodes}
    done = getattr(ours, "results", {})
    tokens = token_shape(nodes, reference.tensors)
    with one_thread():
        results = [
            done[name]
            if name in done
            else compare_node(
                by_name[name],
                index,
                ours.tensors.get(name),
                reference.tensors.get(name),
                tolerances,
                name in untapped,
                reference.tensors.get(by_name[name].chosen_from) if by_name[name].chosen_from else None,
                padding,
                choices_of(by_name[name], ours.tensors, reference.tensors),
                tokens,
            )
            for index, name in enumerate(node_order(reference, nodes, list(getattr(ours, "calls", {}))))
        ]
    calls = getattr(ours, "calls", {})
    results = [_never_produced(_input_of_functional(r, calls), reference) for r in results]
    absorbed = getattr(ours, "extras", {}).get(ABSORBED)
    if absorbed:
        results = [_absorbed(r, absorbed) for r in results]
    results = _sinks_after_softmax(results, ours, reference)
    # a node compared while ours ran was numbered before ours placed the nodes the reference lacks
    return [r if r.index == i else replace(r, index=i) for i, r in enumerate(results)]


#: the attention nodes parity reads inside an attention's computation (not modules of the reference)
CAPTURED = ("q_rot", "k_rot", "scores", "probs", "context")


#: reference ``Trace.extras`` key: the nodes whose module holds only weights tied to another module's (Zamba2's
#: shared blocks repeated across layers, each use with its own adapters): a copy the reference may never run
TIED_COPIES = "tied_copies"
#: reference ``Trace.extras`` key: the nodes whose module's weight the code of the module holding it reads in a
#: function (``self.dt_proj.weight @ x``): a module the reference may never call
WEIGHT_READ = "weight_read"


def _never_produced(result: NodeResult, reference) -> NodeResult:
    """An attention node read inside the computation (q after RoPE, the scores) that the reference never
    produced while its block ran: the reference computes it in a way parity does not read (BLOOM's
    ``baddbmm`` adding ALiBi to the scores), not a module the reference skipped. Not judged; the
    nodes after it are. So too a module whose weights are all tied to another's that the reference never ran
    (:data:`TIED_COPIES`): ours' module holding those weights runs for the other; and one whose weight its parent
    reads in a function instead of calling it (:data:`WEIGHT_READ`)."""
    if result.status != MISSING or result.shape_ref is not None:
        return result
    if result.name in getattr(reference, "extras", {}).get(WEIGHT_READ, ()):
        return replace(
            result,
            status=UNTAPPED,
            detail="the reference never calls this module: its code reads the module's weight in a function "
            "(Jamba's self.dt_proj.weight @ x, its bias added later), so there is no output to compare; not "
            "judged, the nodes after it are",
        )
    if result.name in getattr(reference, "extras", {}).get(TIED_COPIES, ()):
        return replace(
            result,
            status=UNTAPPED,
            detail="the reference never ran this module, whose weights are all tied to another module's (a shared "
            "block used again with other adapters): ours' module holding them runs for that other one; not judged",
        )
    if result.kind not in CAPTURED:
        return result
    stem = result.name.rsplit(".", 1)[0]
    if not any(name.startswith(stem + ".") for name in reference.tensors):
        return result  # nothing of the block ran on the reference: a block it skipped, reported as missing
    return replace(
        result,
        status=UNTAPPED,
        detail=f"the reference computes {result.kind} inside its attention where parity does not read it (its own "
        "product, e.g. baddbmm with ALiBi): not judged; the nodes after it are",
    )


#: ``Trace.extras`` key: node -> its result judged as ours times the reference's row sums (an attention sink
#: ours applies after its softmax, :func:`rescaled_by_sink`), taken when the block's output projection agrees
SINK_RESCALED = "sink_rescaled"


def rescaled_by_sink(
    result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, mass: torch.Tensor | None
) -> tuple[NodeResult | None, torch.Tensor | None]:
    """``(result judged otherwise, row sums)``: a failing ``probs`` node of ours whose rows sum to 1, each the
    reference's row divided by its sum, where the reference's rows sum to less than 1 (an attention sink,
    GPT-OSS's); or the ``context`` after it, divided per head and query by those sums (``mass``, the
    reference's row sums of the block's probabilities): ours leaves the sink out of its softmax and rescales
    its output by the sink's share after (``out * sigmoid(lse - sink)``, as kernels with sinks do). The
    result agrees when ours times the row sums does; ``(None, mass)`` otherwise."""
    if result.status == OK or tuple(ours.shape) != tuple(ref.shape) or not ours.is_floating_point():
        return None, mass
    if not isinstance(ref, torch.Tensor):  # a spilled reference tensor: read (one failing node's)
        ref = ref.load()
    if result.kind == "probs" and ref.dim() == 4:
        rows = ref.double().sum(-1, keepdim=True)
        real = (rows > 0.5) & (rows < 1 - 1e-5)
        if not bool(real.any()) or not bool(((ours.double().sum(-1, keepdim=True) - 1).abs()[real] < 1e-4).all()):
            return None, None
        mass, value = rows, ours.double() * rows
    elif result.kind == "context" and mass is not None and ours.shape[-1] % mass.shape[1] == 0:
        per_query = mass.squeeze(-1).transpose(1, 2)[..., None]  # (batch, queries, heads, 1)
        value = (ours.double().unflatten(-1, (mass.shape[1], -1)) * per_query).flatten(-2)
    else:
        return None, mass
    metrics = tensor_metrics(value, ref.double(), result.atol, result.rtol)
    if metrics.status != OK:
        return None, mass
    return replace(
        result,
        status=OK,
        max_abs=metrics.max_abs,
        mean_abs=metrics.mean_abs,
        max_rel=metrics.max_rel,
        cosine=metrics.cosine,
        detail="compared as ours times the reference's row sums: ours leaves the attention sink out of its softmax "
        "and rescales its output by the sink's share after (its output projection agrees)",
    ), mass


def _sinks_after_softmax(results: list[NodeResult], ours, reference) -> list[NodeResult]:
    """The nodes :func:`rescaled_by_sink` judged otherwise (while ours ran, or here from the kept tensors),
    taken where the block's output projection agrees; a sink missing or wrong fails it, and the nodes keep
    their failure."""
    fixed = dict(getattr(ours, "extras", {}).get(SINK_RESCALED, {}))
    mass: dict[str, torch.Tensor | None] = {}
    for r in results:
        stem = r.name.rsplit(".", 1)[0]
        o, ref = ours.tensors.get(r.name), reference.tensors.get(r.name)
        if r.name not in fixed and r.kind in ("probs", "context") and isinstance(o, torch.Tensor) and ref is not None:
            judged, mass[stem] = rescaled_by_sink(r, o, ref, mass.get(stem))
            if judged is not None:
                fixed[r.name] = judged
    if not fixed:
        return results
    by_name = {r.name: r for r in results}

    def output_agrees(name: str) -> bool:
        stem = name.rsplit(".", 1)[0]
        output = next((by_name[f"{stem}.{n}"] for n in OUTPUT_PROJECTIONS if f"{stem}.{n}" in by_name), None)
        return output is not None and output.status == OK

    return [fixed[r.name] if r.name in fixed and output_agrees(r.name) else r for r in results]


def _absorbed(result: NodeResult, absorbed: Mapping[str, str]) -> NodeResult:
    """A node of a projection ours absorbed into another product (its weight read along its output
    features: MLA's ``q @ W_UK``), or an attention internal of its block: ours never computes it, so it
    is untapped with the reason (:data:`~parity.record.hooks.ABSORBED`), whatever ours recorded there."""
    module = result.name.partition("[")[0]
    why = absorbed.get(module)
    if why is None and result.kind in CAPTURED:
        stem = result.name.rsplit(".", 1)[0]
        held = next((m for m in absorbed if m.rsplit(".", 1)[0] == stem), None)
        if held is not None:
            why = (
                f"ours attends with {held.rsplit('.', 1)[-1]}'s weight absorbed (its q and k live in another "
                "space), so this internal is not computed as the reference's: not judged; the nodes after it are"
            )
    if why is None:
        return result
    return replace(result, status=UNTAPPED, detail=why, max_abs=None, mean_abs=None, max_rel=None, cosine=None)


def _input_of_functional(result: NodeResult, calls: Mapping[str, int]) -> NodeResult:
    """A module's input node that ours never produced while ours did produce the module's output: ours
    applies that module's weight in a function (``F.linear(x, self.out.weight)``, ``x @ W.T``), so
    nothing hooks its input. Not judged (a module that is called records both): the output is."""
    module, _, what = result.name.partition("@")
    if result.status != MISSING or what != "input" or result.shape_ref is None or not calls.get(module):
        return result
    return replace(
        result,
        status=UNTAPPED,
        detail=f"ours applies {module}'s weight in a function, not by calling its module: its input is not "
        "recorded; its output is compared",
    )


def moved_constant(r: NodeResult) -> bool:
    """A ``q_rot``/``k_rot`` mismatch in the direction of the reference (ours about c x reference, a positive
    constant: cosine over 0.99, padding positions a model running each row alone leaves at zero included):
    what a user's model gives when it takes a constant of the reference's q and k (RoPE's attention factor)
    on the scores instead (judged there: ``stages.read_through_scores``). A tap read in another layout is not
    (its cosine is far lower): it stays a failure that names the layout."""
    return r.status == MISMATCH and r.kind in QK_KINDS and r.cosine is not None and r.cosine > 0.99


#: the nodes of q and k before their product: a constant taken on the scores instead moves through all of them
#: (the softmax scale folded into the q norm's gain)
QK_KINDS = ("q_norm", "k_norm", "q_rot", "k_rot")


#: trace extras key: the ``router.weights`` nodes that differ from the reference's by one constant while their MoE
#: block's output is judged after them (:meth:`NodeStream.__call__`): the constant (routed_scaling_factor) moved
#: between the weights and the block's output, which judges it
WEIGHTS_MOVED = "routing_weights_moved"


def moved_weights(r: NodeResult) -> bool:
    """Top-k routing weights that are the reference's times one constant (cosine 1 to rounding): what a port
    gives that applies a scale of the reference's weights (routed_scaling_factor) to the experts' output."""
    return r.status == MISMATCH and r.kind == WEIGHTS and r.cosine is not None and r.cosine > 1 - 1e-6


#: trace extras key: the attention blocks (stems) whose scores agree in some heads after a q_rot/k_rot mismatch
#: by a constant (:meth:`NodeStream.__call__`): the constant is moved to the scores, a scores failure is another bug
QK_MOVED = "qk_moved_to_scores"
#: trace extra: nodes whose value ours recorded at another step than the one its next node reads (that node
#: agrees): taken back from the failures after the forward (``stages.recorded_elsewhere``)
RECORDED_ELSEWHERE = "recorded_elsewhere"


def agreeing_heads(spec: NodeSpec, ours: torch.Tensor, ref, tolerances: Tolerances, padding) -> list[int]:
    """The heads (axis 1 of ``(batch, heads, queries, keys)`` scores in the reference's layout) in which ours'
    scores pass against the reference's; empty for another shape."""
    if ref is None or ours.dim() != 4 or tuple(ours.shape) != tuple(ref.shape):
        return []
    return [
        h
        for h in range(ours.shape[1])
        if compare_node(spec, 0, ours[:, h : h + 1], ref[:, h : h + 1], tolerances, False, None, padding).passed
    ]


class NodeStream:
    """A trace sink that compares each node of ours with the stored reference as ours produces it.

    The result goes to ``trace.results`` and ours' tensor is dropped at once, except what a report
    of the first failure needs: the earliest failing node (in the reference's order) with its
    module input (held by reference until the node is judged, copied only if it fails), and the
    ``context`` nodes (by kind, e.g. ``q_rot``) of its stem (the part of the name before the last
    dot) produced before it. While nothing has failed, the context nodes of the
    latest stem are held, since a later node of that stem may still fail. ``watch``: ``{node: f(ours,
    ref)}`` run on a node as it is compared (same shapes; ``ref`` may be a spilled tensor), its value
    kept in ``trace.watched``; under the key ``"*"``, run on every node, its values kept in
    ``trace.watched["*"]`` by node. ``qk_through_scores``, ``keep_layer``: see the attributes.
    """

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        reference,
        tolerances: Tolerances,
        untapped: frozenset[str] = frozenset(),
        context: Sequence[str] = (),
        watch: Mapping | None = None,
        padding: torch.Tensor | None = None,
        qk_through_scores: bool = False,
        provisional: frozenset[str] = frozenset(),
        keep_layer: bool = False,
        reads_another: Callable[[str, str, torch.Tensor], bool] | None = None,
    ):
        self.specs = {n.name: n for n in nodes}
        #: keep ours' next failure in the first failure's layer and that layer's output as well, when they fail (a
        #: user's model: where the search for one change to the reference's code reads ours,
        #: :func:`parity.run.stages.one_change_inside`)
        self.keep_layer = keep_layer
        #: ``reads_another(node, next_node, ours)``: whether the reference's ``next_node`` (which agrees) reads
        #: something else than ours' recorded value of ``node`` (the first failure just before it): that value
        #: was recorded at another step, the failure is taken back (``stages.reads_another_value``)
        self.reads_another = reads_another
        self._previous: str | None = None
        #: the latest node judged, when it failed, with ours' value as compared (held until the next node)
        self._last_failure: tuple[NodeResult, torch.Tensor] | None = None
        #: blocks whose failures a pass after the forward may take back (values folded between their nodes at
        #: load: ``stages.folded_differences``): while the first failure is in one, the earliest failure outside
        #: that block is kept as well, to be the first if that one is taken back
        self.provisional = provisional
        self.second: NodeResult | None = None
        self.second_keep: set[str] = set()
        #: the earliest failure no pass may take back, kept while the first and the runner-up both may be (a bias
        #: folded the same way in every layer's attention: each layer's block taken back, this one is the first)
        self.standing: NodeResult | None = None
        self.standing_keep: set[str] = set()
        #: the next failure after the first in its layer, and that layer's output, when they fail (ours' tensors
        #: held)
        self.layer_keep: set[str] = set()
        #: a q_rot/k_rot failure whose block's scores then agree is not the first failure (a user's model may
        #: take a constant on the scores that the reference takes on q and k: ``stages.read_through_scores``)
        self.qk_through_scores = qk_through_scores
        #: ``(batch, seq)``, True at padding positions not judged (:mod:`parity.compare.padding`)
        self.padding = padding
        self.index = {name: i for i, name in enumerate(node_order(reference, nodes))}
        #: the run's ``(batch, seq)``: which axes of a node hold tokens (:func:`in_reference_layout`)
        self.tokens = token_shape(nodes, reference.tensors)
        last_layer = max((self.index.get(n.name, -1) for n in nodes if n.layer is not None), default=-1)
        #: the nodes after the last layer's (the final norm, the head): a constant the reference applies to its
        #: logits ours may apply to any of them (folded into the final norm's gain)
        self._after_layers = frozenset(
            n.name for n in nodes if n.layer is None and self.index.get(n.name, -1) > last_layer
        )
        self._head_factor: object = _UNREAD  # the reference's logits over its head's output (_post_head_scale)
        self.reference, self.tolerances, self.untapped = reference, tolerances, untapped
        self.context = frozenset(context)
        self.watch = dict(watch or {})
        self.trace: Trace = None  # type: ignore[assignment]  # set by attach(), before any node arrives
        self.first: NodeResult | None = None
        #: names of ours' tensors held: the first failure and its context, and the latest stem's context
        self.failure_keep: set[str] = set()
        self.stem_keep: set[str] = set()
        #: per attention block, the reference's row sums of its probabilities (:func:`rescaled_by_sink`)
        self._sink_mass: dict[str, torch.Tensor | None] = {}
        #: ours' chosen experts per router, for the weights compared after them
        self._chosen: dict[str, torch.Tensor] = {}

    def attach(self, trace) -> None:
        trace.sink, trace.defer_inputs, self.trace = self, True, trace

    def __call__(self, name: str, tensor: torch.Tensor) -> bool:
        spec = self.specs.get(name)
        if spec is None:
            return False
        ours = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
        store = self.reference.tensors
        ref = store.lazy(name) if hasattr(store, "lazy") else store.get(name)  # a spilled node is read, not mapped
        scores = store.get(spec.chosen_from) if spec.chosen_from and not ours.is_floating_point() else None
        moved, layout = in_reference_layout(spec, ours, ref, self.padding, self.tokens)
        if spec.kind == CHOICES:  # kept (a small integer tensor) for the weights after it, compared choice by choice
            self._chosen[name] = ours
        choices = choices_of(spec, self._chosen, store) if spec.kind == WEIGHTS else None
        result = compare_node(
            spec,
            self.index[name],
            ours,
            ref,
            self.tolerances,
            name in self.untapped,
            scores,
            self.padding,
            choices,
            self.tokens,
        )
        alternative, take = (getattr(spec.transform, a, None) for a in ("alternative", "take_alternative"))
        other = alternative(ours) if result.failed and ref is not None and alternative is not None else None
        if other is not None and take is not None:  # a layout the weights could not settle (a rope tail's order)
            again = compare_node(
                spec, self.index[name], other, ref, self.tolerances, False, None, self.padding, None, self.tokens
            )
            if again.passed:
                result, ours = replace(again, detail=f"compared with {take()}"), other
                moved, layout = in_reference_layout(spec, ours, ref, self.padding, self.tokens)
                layout = layout or "alternative"
            elif _agrees_at_start(other, ref, self.padding) and not _agrees_at_start(ours, ref, self.padding):
                # neither order agrees (a RoPE that differs), but only the reference's order agrees at each row's
                # first token, where RoPE turns nothing: the order is the reference's, the mismatch the rotation's
                result, ours = replace(again, detail=f"compared with {take()}"), other
                moved, layout = in_reference_layout(spec, ours, ref, self.padding, self.tokens)
                layout = layout or "alternative"
        flipped = _sequence_first(ours, self.padding) if result.failed and ref is not None else None
        if flipped is not None:  # tokens flattened (seq, batch) where the reference flattens (batch, seq)
            again = compare_node(
                spec, self.index[name], flipped, ref, self.tolerances, False, scores, self.padding, choices, self.tokens
            )
            if again.passed:
                how = "ours' tokens flattened sequence first ((seq, batch), Megatron's layout), read batch first"
                result, ours = replace(again, detail="; ".join(d for d in (again.detail, how) if d)), flipped
                moved, layout = in_reference_layout(spec, ours, ref, self.padding, self.tokens)
        after = result.failed and ref is not None and name != LOGITS and name in self._after_layers
        if after and self._head_factor is _UNREAD:  # read once per run, at the first failure after the layers
            self._head_factor = _post_head_scale(store, sorted(self._after_layers))
        factor = cast("float | None", self._head_factor) if after else None
        if factor is not None and isinstance(ours, torch.Tensor) and ours.is_floating_point():
            # ours applies here the scale the reference applies after its head
            again = compare_node(
                spec,
                self.index[name],
                ours / factor,
                ref,
                self.tolerances,
                False,
                None,
                self.padding,
                None,
                self.tokens,
            )
            if again.passed:
                how = (
                    f"compared divided by {factor:.6g}: ours applies here the scale the reference applies to its "
                    "head's output after it (its logits are the head's times that), which the logits judge"
                )
                result = replace(again, detail="; ".join(d for d in (again.detail, how) if d))
        # an internal the reference computes where parity does not read it is no failure, here already (the
        # results after the forward say so too): the failure after it is the first, and is kept
        result = _never_produced(result, self.reference) if ref is None else result
        if spec.kind in ("probs", "context") and result.status != OK and ref is not None:
            stem = name.rsplit(".", 1)[0]
            judged, self._sink_mass[stem] = rescaled_by_sink(result, ours, ref, self._sink_mass.get(stem))
            if judged is not None:  # taken after the forward if the block's output projection agrees
                cast(dict, self.trace.extras.setdefault(SINK_RESCALED, {}))[name] = judged
        self.trace.results[name] = result
        layout = layout or ("padding" if moved is not ours else "")  # padding not judged: kept as compared
        if layout:  # what is kept of ours (for a report, a hint) is kept in the reference's layout
            self.trace.keep(name, moved)
            ours = moved
        if name in self.watch and ref is not None and ref.shape == ours.shape:
            self.trace.watched[name] = self.watch[name](ours, ref)
        every = self.watch.get("*")  # a function of every node: kept in trace.watched["*"][name]
        if every is not None and ref is not None and ref.shape == ours.shape:
            self.trace.watched.setdefault("*", {})[name] = every(ours, ref)
        stem = name.rsplit(".", 1)[0]
        previous, self._previous = self._previous, name if result.status != UNTAPPED else self._previous
        held, self._last_failure = self._last_failure, None
        if result.failed and result.status == MISMATCH and self.reads_another is not None:
            self._last_failure = (result, moved)
        first = self.first
        if (
            self.reads_another is not None
            and result.passed
            and held is not None
            and held[0] is not first
            and first is not None
            and self._taken_back_with(first) is not None
            and held[0].name == previous
            and held[0].layer is not None
            and held[0].layer == result.layer
            and self.reads_another(held[0].name, name, held[1])
        ):  # a failure after a first one a pass after the forward may take back (an attention internal read in
            # ours' functions) recorded at another step as well: noted for the results
            cast(set, self.trace.extras.setdefault(RECORDED_ELSEWHERE, set())).add(held[0].name)
        if (
            self.reads_another is not None
            and result.passed
            and first is not None
            and first.name == previous
            and first.layer is not None
            and first.layer == result.layer
            and first.status == MISMATCH
            and first.name in self.trace.tensors
            and self.reads_another(first.name, name, self.trace.tensors[first.name])
        ):
            cast(set, self.trace.extras.setdefault(RECORDED_ELSEWHERE, set())).add(first.name)
            old, self.first, self.failure_keep = self.failure_keep, None, set()
            self._release(old)
            first = None
        if (
            self.qk_through_scores
            and spec.kind == "scores"
            and first is not None
            and moved_constant(first)
            and first.name.rsplit(".", 1)[0] == stem
            and (result.passed or agreeing_heads(spec, ours, ref, self.tolerances, self.padding))
        ):  # q and k differed, their product agrees (in some heads at least: a GQA mapping wrong besides): the
            # constant is moved to the scores, and the failure after q and k (these scores, or later) is the first
            self._read_through(QK_MOVED, stem)
        weights = first if first is not None and moved_weights(first) else None
        block = weights.name[: -len(WEIGHTS) - 1] if weights is not None else None
        if weights is not None and name in (block, f"{block}.experts") and result.status != UNTAPPED:
            # the block's output, judged after its weights differed by one constant: it decides (a scale moved)
            self._read_through(WEIGHTS_MOVED, weights.name)
        del ref, scores
        if spec.kind in self.context:
            old, self.stem_keep = self.stem_keep, {n for n in self.stem_keep if n.rsplit(".", 1)[0] == stem} | {name}
            self._release(old - self.stem_keep)
        if result.failed and (self.first is None or result.index < self.first.index):
            self.first = result
            self._kept("failure_keep", name, stem)
            return bool(layout)  # kept: the trace stores it (in the reference's layout, stored already)
        if (
            result.failed
            and self.first is not None
            and self._taken_back_with(self.first) is not None
            and self._taken_back_with(result) != self._taken_back_with(self.first)
            and (self._block_of(self.first.name) is not None or result.kind not in CAPTURED)
            and (self.second is None or result.index < self.second.index)
        ):  # the runner-up, kept with its context in case the first failure is taken back
            self.second = result
            self._kept("second_keep", name, stem)
            return bool(layout)
        if (
            result.failed
            and self.first is not None
            and self.second is not None
            and self._taken_back_with(self.first) is not None
            and self._taken_back_with(self.second) is not None
            and self._taken_back_with(result) is None
            and (self.standing is None or result.index < self.standing.index)
        ):
            self.standing = result
            self._kept("standing_keep", name, stem)
            return bool(layout)
        if (
            self.keep_layer
            and result.failed
            and self.first is not None
            and result.layer is not None
            and result.layer == self.first.layer
            and (
                not any(self.specs[n].kind == "layer" for n in self.layer_keep)
                if spec.kind == "layer"
                else all(self.specs[n].kind in (*CAPTURED, "layer") for n in self.layer_keep)
            )
        ):  # the next failure in the first's layer (up to one a module outputs: not a captured attention
            # internal), and the layer's output: where a search for the first's cause reads ours
            # (stages.one_change_inside)
            self.layer_keep.add(name)
            self.trace.drop_input(name)
            return bool(layout)
        self.trace.drop_input(name)
        if layout:
            if name not in self.stem_keep and name in self.trace.tensors:
                del self.trace.tensors[name]
            return True
        return name not in self.stem_keep  # a context node is kept (stored by the trace)

    def _read_through(self, key: str, moved: str) -> None:
        """The first failure is read through a later node (a constant moved there): ``moved`` is noted in the
        trace's extras under ``key`` for the results after the forward, and the failure is no longer the first."""
        cast(set, self.trace.extras.setdefault(key, set())).add(moved)
        old, self.first, self.failure_keep = self.failure_keep, None, set()
        self._release(old)

    def retract(self, name: str) -> None:
        """Forget ``name``'s comparison (:meth:`Trace.retract`): a failure it was is no longer the first
        (a failing node produced earlier with a later index than it is not brought back)."""
        if self.first is not None and self.first.name == name:
            old, self.first = self.failure_keep, None
            self.failure_keep = set()
            self._release(old - {name})
        self.trace.watched.pop(name, None)
        every = self.trace.watched.get("*")
        if every is not None:
            every.pop(name, None)

    def finish(self) -> None:
        """After the forward: drop the context nodes no failure needs, and stop consuming."""
        old, self.stem_keep = self.stem_keep, set()
        self._release(old)
        self.trace.sink, self.trace.defer_inputs = None, False
        self.trace.pending.clear()

    def _taken_back_with(self, r: NodeResult) -> str | None:
        """What a pass after the forward may take ``r``'s failure back with: its provisional block, or the
        attention block of an internal parity read in ours' functions (``stages.misread_internals``); None for a
        failure that stands."""
        block = self._block_of(r.name)
        spec = self.specs.get(r.name)
        if (
            block is None
            and r.kind in CAPTURED
            and spec is not None
            and spec.ours.removeprefix("tap:").startswith(FUNCTIONS)
        ):
            return r.name.rsplit(".", 1)[0]
        return block

    def _block_of(self, name: str) -> str | None:
        """The provisional block ``name`` is in, or None."""
        return next((b for b in self.provisional if name == b or name.startswith(b + ".")), None)

    def _kept(self, role: str, name: str, stem: str) -> None:
        """Keep failure ``name`` with its attention block's context (``stem``'s nodes held) as the names of ``role``
        (``failure_keep``, ``second_keep``, ``standing_keep``), releasing those it held before that nothing else
        holds. Its input, held by reference since the module's pre-hook, is copied now."""
        old = getattr(self, role)
        setattr(self, role, {name} | {n for n in self.stem_keep if n.rsplit(".", 1)[0] == stem})
        self._release(old - getattr(self, role))
        self.trace.keep_input(name)

    def _release(self, names: set[str]) -> None:
        """Drop ours' tensors (and kept inputs) of ``names`` that nothing holds any more."""
        for name in names:
            if (
                name in self.failure_keep
                or name in self.stem_keep
                or name in self.second_keep
                or name in self.standing_keep
                or name in self.layer_keep
            ):
                continue
            if name in self.trace.tensors:
                del self.trace.tensors[name]
            self.trace.drop_input(name)


def first_mismatch(results: Sequence[NodeResult]) -> NodeResult | None:
    """The earliest judged node in execution order whose status is not ``ok``, or None if all agree."""
    return next((r for r in results if r.judged and not r.passed), None)


def first_divergence(results: Sequence[NodeResult]) -> NodeResult | None:
    """The earliest node with any difference at all (max_abs > 0 or a failing status), or None
    when the two traces are bit-identical on every judged node."""
    return next((r for r in results if r.differs), None)
