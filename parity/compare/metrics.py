"""The metrics of one node: ``|ours - ref|`` element by element against ``atol + rtol * |ref|`` (the
``torch.isclose`` rule), computed chunk by chunk in reused buffers, every sum in float64."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

OK, MISMATCH, SHAPE, MISSING, NONFINITE, UNTAPPED = "ok", "mismatch", "shape", "missing", "nonfinite", "untapped"
CHOICE = "choice"
STATUSES = (OK, MISMATCH, CHOICE, NONFINITE, SHAPE, MISSING, UNTAPPED)
#: elements per chunk when comparing (4 MiB of float32 per buffer): few enough torch calls per node
#: that a machine whose cores are busy with other work does not make each call wait its turn
CHUNK = 1 << 20


@dataclass(frozen=True)
class Metrics:
    """How one node's two tensors compare (see :func:`tensor_metrics`). A metric that does not apply
    (a choice node has no ``max_abs``) is None; a non-finite node has ``max_abs`` inf and NaN
    agreement numbers."""

    status: str
    max_abs: float | None = None
    mean_abs: float | None = None
    max_rel: float | None = None
    cosine: float | None = None
    detail: str = ""
    #: ||ours - ref|| / ||ref|| (cosine is blind to scale; this is not)
    rel_l2: float | None = None
    #: smallest atol that passes with this rtol, and smallest rtol that passes with this atol
    atol_needed: float | None = None
    rtol_needed: float | None = None

    def fields(self) -> dict:
        """The metrics by name (as :class:`~parity.compare.results.NodeResult` holds them)."""
        return dataclasses.asdict(self)


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


def tensor_metrics(ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> Metrics:
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
    may also be a spilled tensor (:class:`parity.record.store.SpilledTensor`), read chunk by chunk.
    """
    work = torch.float64 if torch.float64 in (ours.dtype, ref.dtype) else torch.float32
    n = ours.numel()
    if n == 0:
        nan = math.nan
        return Metrics(
            status=OK,
            max_abs=nan,
            mean_abs=nan,
            max_rel=nan,
            cosine=nan,
            detail="",
            rel_l2=nan,
            atol_needed=nan,
            rtol_needed=nan,
        )
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
            return Metrics(
                status=NONFINITE,
                max_abs=inf,
                mean_abs=nan,
                max_rel=inf,
                cosine=nan,
                detail=_nonfinite_detail(ours.detach(), whole.detach(), tuple(ours.shape)),
                rel_l2=nan,
                atol_needed=inf,
                rtol_needed=inf,
            )
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
    return Metrics(
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


def _agrees(detail: str) -> Metrics:
    return Metrics(
        status=OK,
        max_abs=0.0,
        mean_abs=0.0,
        max_rel=0.0,
        cosine=1.0,
        detail=detail,
        rel_l2=0.0,
        atol_needed=0.0,
        rtol_needed=0.0,
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


def choice_result(
    our_t: torch.Tensor, ref_t: torch.Tensor, scores: torch.Tensor | None, ordered: bool = True
) -> Metrics:
    """Metrics of an integer node: exact equality (``ok``) or ``choice`` with the rows and margins.
    ``ordered`` False: rows choosing the same values in another order agree (a top-k's order, judged only
    where the check is bit-exact)."""
    if torch.equal(our_t, ref_t):
        return _agrees("")
    found = choice_margins(our_t, ref_t, scores)
    rows = found["rows"]
    if not ordered and len(found["same_set"]) == len(rows):
        return _agrees(
            f"the same choices in another order in {len(rows)} of {found['total']} rows (top-k's order is not "
            "judged within tolerances; the weights are compared choice by choice)"
        )
    detail = f"{len(rows)} of {found['total']} rows choose differently (rows {', '.join(map(str, rows[:8]))}{', ...' if len(rows) > 8 else ''})"
    if found["same_set"]:
        detail += f"; {len(found['same_set'])} of them the same values in another order"
    if found["margins"]:
        margins = found["margins"]
        detail += f"; the reference's margin between its last chosen and first unchosen score there: {min(margins):.3g}..{max(margins):.3g}"
    return Metrics(status=CHOICE, detail=detail)
