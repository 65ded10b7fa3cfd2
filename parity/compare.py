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

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .hints import Hint
from .pair import NodeSpec
from .trace import one_thread

OK, MISMATCH, SHAPE, MISSING, NONFINITE, UNTAPPED = "ok", "mismatch", "shape", "missing", "nonfinite", "untapped"
CHOICE = "choice"
STATUSES = (OK, MISMATCH, CHOICE, NONFINITE, SHAPE, MISSING, UNTAPPED)

#: Default (atol, rtol) per compute dtype. fp32: two implementations of the same math differ by
#: reduction order only (~1e-6 after a few layers); bf16 keeps 8 bits of mantissa, so one
#: rounding of a unit-scale value is ~4e-3 and chained layers compound it.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}
#: elements per chunk when comparing (4 MiB of float32 per buffer): few enough torch calls per node
#: that a machine whose cores are busy with other work does not make each call wait its turn
CHUNK = 1 << 20


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


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Default ``(atol, rtol)`` for a compute dtype; float32's for dtypes not in the table."""
    return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])


@dataclass(frozen=True)
class Tolerances:
    """How each node's ``(atol, rtol)`` is chosen. Precedence: a matching ``per_node`` glob pattern,
    then ``exact`` (0, 0), then ``calibrated`` (per node), then the run-wide ``atol``/``rtol``, then
    the dtype default."""

    dtype: torch.dtype = torch.float32
    atol: float | None = None
    rtol: float | None = None
    per_node: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    calibrated: Mapping[str, tuple[float, float]] | None = None
    exact: bool = False

    def for_node(self, name: str) -> tuple[float, float, str]:
        """``(atol, rtol, source)`` for one node."""
        for pattern, tol in self.per_node.items():
            if fnmatch.fnmatchcase(name, pattern):
                return float(tol[0]), float(tol[1]), f"pattern:{pattern}"
        if self.exact:
            return 0.0, 0.0, "exact"
        if self.calibrated and name in self.calibrated:
            return float(self.calibrated[name][0]), float(self.calibrated[name][1]), "calibrated"
        d_atol, d_rtol = default_tolerance(self.dtype)
        source = "run" if self.atol is not None or self.rtol is not None else f"default:{str(self.dtype).replace('torch.', '')}"
        return (d_atol if self.atol is None else self.atol, d_rtol if self.rtol is None else self.rtol, source)


def tolerance_for(name: str, dtype: torch.dtype, atol=None, rtol=None, per_node=None) -> tuple[float, float]:
    """Resolve a node's tolerance (see :class:`Tolerances`)."""
    return Tolerances(dtype, atol, rtol, dict(per_node or {})).for_node(name)[:2]


def _nonfinite_detail(a: torch.Tensor, b: torch.Tensor, shape) -> str:
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    bad = ~(fa & fb)
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()
    side = "ours" if not bool(fa.reshape(-1)[flat]) else "reference"
    n_a, n_b = int((~fa).sum()), int((~fb).sum())
    both = int((~fa & ~fb).sum())
    return f"first non-finite value at index {index} ({side}); {n_a} in ours, {n_b} in reference, {both} in both"


class _Work:
    """Scratch buffers for :func:`tensor_metrics`, reused from chunk to chunk (a fresh tensor per op
    would cost more in page faults than the arithmetic)."""

    def __init__(self, n: int, dtype: torch.dtype):
        self.d, self.babs, self.tmp, self.e = (torch.empty(n, dtype=dtype) for _ in range(4))
        self.a = self.b = None  # casts of a lower-precision input, made when needed

    def cast(self, which: str, x: torch.Tensor) -> torch.Tensor:
        buf = getattr(self, which)
        if buf is None:
            buf = torch.empty(self.d.numel(), dtype=self.d.dtype)
            setattr(self, which, buf)
        return buf[: x.numel()].copy_(x)


def _sum(x: torch.Tensor) -> float:
    """Sum of one chunk, accumulated in float64 (the caller adds the chunks' sums in float64)."""
    return float(x.sum(dtype=torch.float64))


def chunks(x, n: int):
    """1-D slices of ``x`` of at most ``n`` elements: a tensor's views, or a spilled tensor's reads."""
    if isinstance(x, torch.Tensor):
        flat = x.detach().reshape(-1)
        for start in range(0, flat.numel(), n):
            yield flat[start : start + n]
    else:
        yield from x.chunks(n)


def tensor_metrics(ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> dict:
    """Compare two same-shaped tensors.

    Returns ``status`` (``ok``, ``mismatch`` or ``nonfinite``), ``max_abs``, ``mean_abs``,
    ``max_rel`` (max of ``|a-b| / |b|`` over elements with ``b != 0``), ``cosine`` of the
    flattened tensors, ``rel_l2`` (``||a-b|| / ||b||``), ``atol_needed`` (smallest atol that
    passes with this rtol), ``rtol_needed`` (smallest rtol that passes with this atol; inf when an
    element with ``b == 0`` exceeds atol) and, for non-finite values, ``detail`` naming the first
    position; a non-finite node gets ``max_abs`` inf and NaN agreement numbers (written as null).

    One chunk of :data:`CHUNK` elements at a time, in preallocated buffers (no copy of the whole
    tensor, no mask indexing). The status, ``max_abs``, ``max_rel`` and the two ``*_needed`` are
    exact (maxima of per-element values computed in the inputs' precision); the sums behind
    ``mean_abs``, ``cosine`` and ``rel_l2`` are products in the inputs' precision summed in float64.
    A chunk whose two sides are bitwise equal (a correct port's usual node) costs one comparison,
    one product and one sum. ``ref``
    may also be a spilled tensor (:class:`parity.trace.SpilledTensor`), read chunk by chunk.
    """
    work = torch.float64 if torch.float64 in (ours.dtype, ref.dtype) else torch.float32
    n = ours.numel()
    if n == 0:
        nan = math.nan
        return dict(status=OK, max_abs=nan, mean_abs=nan, max_rel=nan, cosine=nan, detail="",
                    rel_l2=nan, atol_needed=nan, rtol_needed=nan)
    w = _Work(min(n, CHUNK), work)
    max_abs = max_rel = atol_needed = rtol_needed = 0.0
    sum_abs = dot = na2 = nb2 = nd2 = 0.0
    failed = False
    for a, b in zip(chunks(ours, CHUNK), chunks(ref, CHUNK)):
        m = a.numel()
        a = a if a.dtype == work else w.cast("a", a)
        b = b if b.dtype == work else w.cast("b", b)
        d, babs, tmp, e = w.d[:m], w.babs[:m], w.tmp[:m], w.e[:m]
        if torch.equal(a, b):  # NaN is never equal: non-finite chunks take the long way
            # the dot product and both norms are one sum here, the same one the long way takes
            squares = _sum(torch.mul(a, a, out=w.tmp[:m]))
            if math.isfinite(squares):  # every element finite: no difference to account for
                dot, na2, nb2 = dot + squares, na2 + squares, nb2 + squares
                continue
        torch.sub(a, b, out=d).abs_()
        chunk_max = float(d.max())
        if not math.isfinite(chunk_max) and not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
            inf, nan = math.inf, math.nan
            whole = ref if isinstance(ref, torch.Tensor) else ref.load()
            return dict(status=NONFINITE, max_abs=inf, mean_abs=nan, max_rel=inf, cosine=nan,
                        detail=_nonfinite_detail(ours.detach(), whole.detach(), tuple(ours.shape)),
                        rel_l2=nan, atol_needed=inf, rtol_needed=inf)
        max_abs = max(max_abs, chunk_max)
        sum_abs += _sum(d)
        nd2 += _sum(torch.mul(d, d, out=tmp))
        dot += _sum(torch.mul(a, b, out=tmp))
        na2 += _sum(torch.mul(a, a, out=tmp))
        torch.abs(b, out=babs)
        nb2 += _sum(torch.mul(babs, babs, out=tmp))
        rel = float(torch.div(d, babs, out=tmp).max())
        if not math.isfinite(rel):  # elements with b == 0 are left out (0/0, x/0)
            rel = float(tmp.masked_fill_(babs == 0, 0.0).max())
        max_rel = max(max_rel, rel)
        allowed = torch.mul(babs, rtol, out=tmp)
        over_rtol = float(torch.sub(d, allowed, out=e).max())
        atol_needed = max(atol_needed, over_rtol)
        if not failed and not over_rtol <= 0:  # some |a-b| > rtol|b|: does any pass atol + rtol|b| too?
            bound = allowed.add_(atol)
            excess = float(torch.sub(d, bound, out=e).max())
            failed = excess > 0 if not math.isnan(excess) else bool(torch.gt(d, bound).any())
        if chunk_max > atol and rtol_needed != math.inf:
            # (|a-b| - atol) / |b| over the elements past atol; x/0 -> inf, 0/0 (not past atol) -> 0
            ratio = torch.sub(d, atol, out=e).clamp_min_(0.0).div_(babs).nan_to_num_(nan=0.0, posinf=math.inf)
            rtol_needed = max(rtol_needed, float(ratio.max()))
    # torch's square root, not math.sqrt: the two can differ in the last bit, and parity's numbers
    # have always been torch's
    na, nb, nd = (float(torch.tensor(x, dtype=torch.float64).sqrt()) for x in (na2, nb2, nd2))
    if na == 0 and nb == 0:
        cosine = 1.0
    elif na == 0 or nb == 0:
        cosine = 0.0
    else:
        cosine = max(-1.0, min(1.0, dot / (na * nb)))
    return dict(
        status=MISMATCH if failed else OK,
        max_abs=max_abs,
        mean_abs=sum_abs / n,
        max_rel=max_rel,
        cosine=cosine,
        detail="",
        rel_l2=nd / nb if nb > 0 else (0.0 if nd == 0 else math.inf),
        atol_needed=max(0.0, atol_needed),
        rtol_needed=rtol_needed,
    )


def choice_margins(ours: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor | None) -> dict:
    """Where two integer tensors of one shape (top-k choices, ``(..., k)``) differ.

    Returns ``rows`` (flat indices of the rows, all leading dims flattened, that differ),
    ``same_set`` (rows choosing the same values in another order) and, given the reference's
    ``scores`` the choice was made from (``(..., n)``, same leading dims), ``margins``: per differing
    row, the reference's gap between its k-th and (k+1)-th largest score (how near a tie it was).
    """
    a, b = ours.reshape(-1, ours.shape[-1] if ours.dim() else 1), ref.reshape(-1, ref.shape[-1] if ref.dim() else 1)
    rows = (a != b).any(-1).nonzero().flatten()
    same_set = [int(r) for r in rows if torch.equal(a[r].sort().values, b[r].sort().values)]
    margins = None
    if scores is not None and scores.dim() >= 1 and scores.numel() // scores.shape[-1] == a.shape[0]:
        s = scores.detach().double().reshape(a.shape[0], -1)
        k = b.shape[-1]
        if s.shape[-1] > k:
            top = s.topk(k + 1, dim=-1).values
            margins = [float(top[r, k - 1] - top[r, k]) for r in rows]
    return {"rows": [int(r) for r in rows], "same_set": same_set, "margins": margins, "total": a.shape[0]}


def _choice_result(our_t: torch.Tensor, ref_t: torch.Tensor, scores: torch.Tensor | None) -> dict:
    """Metrics of an integer node: exact equality (``ok``) or ``choice`` with the rows and margins."""
    if torch.equal(our_t, ref_t):
        return dict(status=OK, max_abs=0.0, mean_abs=0.0, max_rel=0.0, cosine=1.0, detail="", rel_l2=0.0,
                    atol_needed=0.0, rtol_needed=0.0)
    found = choice_margins(our_t, ref_t, scores)
    rows = found["rows"]
    detail = f"{len(rows)} of {found['total']} rows choose differently (rows {', '.join(map(str, rows[:8]))}{', ...' if len(rows) > 8 else ''})"
    if found["same_set"]:
        detail += f"; {len(found['same_set'])} of them the same values in another order"
    if found["margins"]:
        margins = found["margins"]
        detail += f"; the reference's margin between its last chosen and first unchosen score there: {min(margins):.3g}..{max(margins):.3g}"
    empty = dict(max_abs=None, mean_abs=None, max_rel=None, cosine=None)
    return dict(status=CHOICE, detail=detail, **empty)


def compare_node(
    spec: NodeSpec, index: int, our_t, ref_t, tolerances: Tolerances, untapped: bool = False, scores=None
) -> NodeResult:
    """One node's NodeResult. ``untapped``: ours has no tap for it (a user model): not judged.
    ``scores``: for an integer node, the reference's tensor of ``spec.chosen_from``."""
    n_atol, n_rtol, source = tolerances.for_node(spec.name)
    base = dict(name=spec.name, index=index, layer=spec.layer, kind=spec.kind, atol=n_atol, rtol=n_rtol, tol_source=source)
    dtype = ref_t.dtype if ref_t is not None else our_t.dtype if our_t is not None else None
    shapes = dict(
        shape_ours=tuple(our_t.shape) if our_t is not None else None,
        shape_ref=tuple(ref_t.shape) if ref_t is not None else None,
        dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
    )
    empty = dict(max_abs=None, mean_abs=None, max_rel=None, cosine=None)
    if untapped and our_t is None:
        if spec.ours.startswith("unaligned:"):
            detail = "not aligned: " + spec.ours[len("unaligned:"):]
        else:
            detail = f"no tap in ours: add parity.tap(tensor, {spec.name.rsplit('.', 1)[-1]!r}) in {spec.ours[len('tap:'):].rsplit('.', 1)[0]}'s forward"
        return NodeResult(**base, **shapes, **empty, status=UNTAPPED, detail=detail)
    if ref_t is None or our_t is None:
        side = "reference" if ref_t is None else "ours"
        where = spec.name if ref_t is None else spec.ours
        return NodeResult(**base, **shapes, **empty, status=MISSING, detail=f"{side} produced no tensor at {where}")
    if ref_t.shape != our_t.shape:
        return NodeResult(**base, **shapes, **empty, status=SHAPE,
                          detail=f"ours {tuple(our_t.shape)} vs reference {tuple(ref_t.shape)}")
    if not ref_t.is_floating_point() and not our_t.is_floating_point():
        ref_t = ref_t if isinstance(ref_t, torch.Tensor) else ref_t.load()  # a spilled integer node: small
        return NodeResult(**base, **shapes, **_choice_result(our_t, ref_t, scores))
    return NodeResult(**base, **shapes, **tensor_metrics(our_t, ref_t, n_atol, n_rtol))


def node_order(reference, nodes: Sequence[NodeSpec]) -> list[str]:
    """Node names in the reference's execution order, then the nodes it never produced."""
    names = {n.name for n in nodes}
    order = [name for name in reference.order if name in names]
    return order + [n.name for n in nodes if n.name not in reference.tensors]


def compare_traces(ours, reference, nodes: Sequence[NodeSpec], tolerances: Tolerances, untapped: frozenset[str] = frozenset()) -> list[NodeResult]:
    """One NodeResult per node, in the reference's execution order.

    Nodes the reference never produced come last, as ``missing``: a node that cannot be compared
    is reported, never counted as agreeing. A node ``ours`` already compared while it ran
    (:class:`NodeStream`, in ``ours.results``) is taken from there.
    """
    by_name = {n.name: n for n in nodes}
    done = getattr(ours, "results", {})
    with one_thread():
        return [
            done[name] if name in done else
            compare_node(by_name[name], index, ours.tensors.get(name), reference.tensors.get(name), tolerances, name in untapped,
                         reference.tensors.get(by_name[name].chosen_from) if by_name[name].chosen_from else None)
            for index, name in enumerate(node_order(reference, nodes))
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
    kept in ``trace.watched``.
    """

    def __init__(self, nodes: Sequence[NodeSpec], reference, tolerances: Tolerances,
                 untapped: frozenset[str] = frozenset(), context: Sequence[str] = (), watch: Mapping | None = None):
        self.specs = {n.name: n for n in nodes}
        self.index = {name: i for i, name in enumerate(node_order(reference, nodes))}
        self.reference, self.tolerances, self.untapped = reference, tolerances, untapped
        self.context = frozenset(context)
        self.watch = dict(watch or {})
        self.trace = None
        self.first: NodeResult | None = None
        #: names of ours' tensors held: the first failure and its context, and the latest stem's context
        self.failure_keep: set[str] = set()
        self.stem_keep: set[str] = set()

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
        result = compare_node(spec, self.index[name], ours, ref, self.tolerances, name in self.untapped, scores)
        self.trace.results[name] = result
        if name in self.watch and ref is not None and ref.shape == ours.shape:
            self.trace.watched[name] = self.watch[name](ours, ref)
        del ref, scores
        stem = name.rsplit(".", 1)[0]
        if spec.kind in self.context:
            old, self.stem_keep = self.stem_keep, {n for n in self.stem_keep if n.rsplit(".", 1)[0] == stem} | {name}
            self._release(old - self.stem_keep)
        if result.failed and (self.first is None or result.index < self.first.index):
            old, self.first = self.failure_keep, result
            self.failure_keep = {name} | {n for n in self.stem_keep if n.rsplit(".", 1)[0] == stem}
            self._release(old - self.failure_keep)
            self.trace.keep_input(name)  # held by reference since the module's pre-hook: copied now
            return False  # kept: the trace stores it
        self.trace.drop_input(name)
        return name not in self.stem_keep  # a context node is kept (stored by the trace)

    def finish(self) -> None:
        """After the forward: drop the context nodes no failure needs, and stop consuming."""
        old, self.stem_keep = self.stem_keep, set()
        self._release(old)
        self.trace.sink, self.trace.defer_inputs = None, False
        self.trace.pending.clear()

    def _release(self, names: set[str]) -> None:
        """Drop ours' tensors (and kept inputs) of ``names`` that nothing holds any more."""
        for name in names:
            if name in self.failure_keep or name in self.stem_keep:
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
