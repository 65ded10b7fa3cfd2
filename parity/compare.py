"""Compare two tensors, and two traces node by node, against dtype-aware tolerances.

A node passes when every element satisfies ``|ours - ref| <= atol + rtol * |ref|`` (the
``torch.isclose`` rule). Metrics are computed in float64 so they do not add error of their own.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from .pair import NodeSpec
from .trace import Trace

OK, MISMATCH, SHAPE, MISSING, NONFINITE = "ok", "mismatch", "shape", "missing", "nonfinite"

#: Default (atol, rtol) per compute dtype. fp32: two implementations of the same math differ by
#: reduction order only (~1e-6 after a few layers); bf16 keeps 8 bits of mantissa, so one
#: rounding of a unit-scale value is ~4e-3 and chained layers compound it.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@dataclass
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
    hint: str = ""
    detail: str = ""
    #: ||ours - ref|| / ||ref|| (cosine is blind to scale; this is not)
    rel_l2: float | None = None
    #: smallest atol that passes with this rtol, and smallest rtol that passes with this atol
    atol_needed: float | None = None
    rtol_needed: float | None = None
    #: where atol/rtol came from: "default:<dtype>", "run", "pattern:<glob>" or "calibrated"
    tol_source: str = ""

    @property
    def passed(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("shape_ours", "shape_ref"):
            d[key] = list(d[key]) if d[key] is not None else None
        return d

    def line(self) -> str:
        """One line for logs, JUnit and error messages."""
        if self.max_abs is None or self.status == NONFINITE:
            return f"{self.name}: {self.status} ({self.detail})"
        return (
            f"{self.name}: {self.status} max_abs={self.max_abs:.3g} mean_abs={self.mean_abs:.3g} "
            f"cosine={self.cosine:.6f} (atol={self.atol:g}, rtol={self.rtol:g})"
        )


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Default ``(atol, rtol)`` for a compute dtype; float32's for dtypes not in the table."""
    return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])


def tolerance_for(
    name: str,
    dtype: torch.dtype,
    atol: float | None = None,
    rtol: float | None = None,
    per_node: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[float, float]:
    """Resolve a node's tolerance: the first matching ``per_node`` glob pattern wins, then the
    run-wide ``atol``/``rtol``, then the dtype default."""
    return tolerance_with_source(name, dtype, atol, rtol, per_node)[:2]


def tolerance_with_source(
    name, dtype, atol=None, rtol=None, per_node=None, calibrated=None
) -> tuple[float, float, str]:
    """:func:`tolerance_for` plus where the values came from (``pattern:<glob>``, ``calibrated``,
    ``run``, ``default:<dtype>``). Precedence: pattern, calibrated, run-wide, default."""
    for pattern, tol in (per_node or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return float(tol[0]), float(tol[1]), f"pattern:{pattern}"
    if calibrated and name in calibrated:
        return float(calibrated[name][0]), float(calibrated[name][1]), "calibrated"
    d_atol, d_rtol = default_tolerance(dtype)
    source = "run" if atol is not None or rtol is not None else f"default:{str(dtype).replace('torch.', '')}"
    return (d_atol if atol is None else atol, d_rtol if rtol is None else rtol, source)


def tensor_metrics(ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> dict:
    """Compare two same-shaped tensors.

    Returns ``status`` (``ok``, ``mismatch`` or ``nonfinite``), ``max_abs``, ``mean_abs``,
    ``max_rel`` (max of ``|a-b| / |b|`` over elements with ``b != 0``), ``cosine`` of the
    flattened tensors, ``rel_l2`` (``||a-b|| / ||b||``), ``atol_needed`` (smallest atol that
    passes with this rtol), ``rtol_needed`` (smallest rtol that passes with this atol; inf when an
    element with ``b == 0`` exceeds atol) and, for non-finite values, ``detail`` naming the first
    position; a non-finite node gets ``max_abs`` inf and NaN agreement numbers (written as null).
    """
    a, b = ours.detach().to(torch.float64), ref.detach().to(torch.float64)
    finite = torch.isfinite(a) & torch.isfinite(b)
    detail = ""
    status = OK
    if not bool(finite.all()):
        status = NONFINITE
        first = tuple(int(i) for i in (~finite).nonzero()[0])
        side = "ours" if not bool(torch.isfinite(a[first])) else "reference"
        both = int((~torch.isfinite(a) & ~torch.isfinite(b)).sum())
        detail = (
            f"first non-finite value at index {first} ({side}); "
            f"{int((~torch.isfinite(a)).sum())} in ours, {int((~torch.isfinite(b)).sum())} in reference, "
            f"{both} in both"
        )
    a, b = a[finite], b[finite]
    if status == NONFINITE:  # agreement numbers over the finite part would read as a match
        inf, nan = math.inf, math.nan
        return dict(status=status, max_abs=inf, mean_abs=nan, max_rel=inf, cosine=nan, detail=detail,
                    rel_l2=nan, atol_needed=inf, rtol_needed=inf)
    if a.numel() == 0:
        nan = math.nan
        return dict(status=status, max_abs=nan, mean_abs=nan, max_rel=nan, cosine=nan, detail=detail,
                    rel_l2=nan, atol_needed=nan, rtol_needed=nan)
    diff = (a - b).abs()
    nonzero = b != 0
    max_rel = float((diff[nonzero] / b[nonzero].abs()).max()) if bool(nonzero.any()) else 0.0
    na, nb = a.norm(), b.norm()
    if float(na) == 0 and float(nb) == 0:
        cosine = 1.0
    elif float(na) == 0 or float(nb) == 0:
        cosine = 0.0
    else:
        cosine = max(-1.0, min(1.0, float((a @ b) / (na * nb))))
    if status == OK and bool((diff > atol + rtol * b.abs()).any()):
        status = MISMATCH
    excess = diff - atol
    over = excess > 0
    if not bool(over.any()):
        rtol_needed = 0.0
    elif bool((b[over] == 0).any()):
        rtol_needed = math.inf
    else:
        rtol_needed = float((excess[over] / b[over].abs()).max())
    return dict(
        status=status,
        max_abs=float(diff.max()),
        mean_abs=float(diff.mean()),
        max_rel=max_rel,
        cosine=cosine,
        detail=detail,
        rel_l2=float((a - b).norm() / nb) if float(nb) > 0 else (0.0 if float((a - b).norm()) == 0 else math.inf),
        atol_needed=max(0.0, float((diff - rtol * b.abs()).max())),
        rtol_needed=rtol_needed,
    )


def compare_traces(
    ours: Trace,
    reference: Trace,
    nodes: Sequence[NodeSpec],
    dtype: torch.dtype,
    atol: float | None = None,
    rtol: float | None = None,
    per_node: Mapping[str, tuple[float, float]] | None = None,
    calibrated: Mapping[str, tuple[float, float]] | None = None,
) -> list[NodeResult]:
    """One NodeResult per node, in the reference's execution order.

    Nodes the reference never produced come last, as ``missing``: a node that cannot be compared
    is reported, never counted as agreeing.
    """
    by_name = {n.name: n for n in nodes}
    order = [name for name in reference.order if name in by_name]
    order += [n.name for n in nodes if n.name not in reference.tensors]
    results = []
    for index, name in enumerate(order):
        spec = by_name[name]
        n_atol, n_rtol, source = tolerance_with_source(name, dtype, atol, rtol, per_node, calibrated)
        ref_t, our_t = reference.tensors.get(name), ours.tensors.get(name)
        base = dict(name=name, index=index, layer=spec.layer, kind=spec.kind, atol=n_atol, rtol=n_rtol, tol_source=source)
        shapes = dict(
            shape_ours=tuple(our_t.shape) if our_t is not None else None,
            shape_ref=tuple(ref_t.shape) if ref_t is not None else None,
            dtype=str(ref_t.dtype if ref_t is not None else our_t.dtype if our_t is not None else "").replace(
                "torch.", ""
            )
            or None,
        )
        empty = dict(max_abs=None, mean_abs=None, max_rel=None, cosine=None)
        if ref_t is None or our_t is None:
            side = "reference" if ref_t is None else "ours"
            where = spec.name if ref_t is None else spec.ours
            results.append(
                NodeResult(**base, **shapes, **empty, status=MISSING, detail=f"{side} produced no tensor at {where}")
            )
        elif ref_t.shape != our_t.shape:
            detail = f"ours {tuple(our_t.shape)} vs reference {tuple(ref_t.shape)}"
            results.append(NodeResult(**base, **shapes, **empty, status=SHAPE, detail=detail))
        else:
            results.append(NodeResult(**base, **shapes, **tensor_metrics(our_t, ref_t, n_atol, n_rtol)))
    return results


def first_mismatch(results: Sequence[NodeResult]) -> NodeResult | None:
    """The earliest node in execution order whose status is not ``ok``, or None if all agree."""
    return next((r for r in results if not r.passed), None)
