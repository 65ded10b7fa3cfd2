"""Summaries of a node: statistics, a seeded sample of elements and per-position norms instead of its
tensor, so a golden trace of a deep model stays small (``parity record --summaries``).

Per node: ``numel``, ``nonfinite``, ``mean``, ``mean_abs``, ``rms``, ``min``, ``max``, ``max_abs``
(float64, over the finite elements), :data:`DEFAULT_SAMPLE` elements at indices drawn with
:data:`SAMPLE_SEED`, and the L2 norm of every token position's elements (the position axis is 2
for ``(batch, heads, seq, ...)`` attention nodes, else 1).

What a comparison can conclude from them. If every element satisfied ``|ours - ref| <= atol + rtol
* |ref|``, then

* ``|mean_o - mean_r| <= atol + rtol * mean_abs_r`` (the mean of the differences is at most their mean);
* ``|rms_o - rms_r| <= atol + rtol * rms_r`` (Minkowski);
* ``|max_o - max_r|``, ``|min_o - min_r|`` and ``|max_abs_o - max_abs_r|`` are at most ``atol + rtol * max_abs_r``;
* for every position ``p`` of ``n_p`` elements, ``| ||o_p|| - ||r_p|| | <= sqrt(n_p) atol + rtol ||r_p||``
  (the triangle inequality).

So a statistic past its bound, or a sampled element past its tolerance, *proves* the node fails. A
node whose statistics and sample agree is only *consistent* with passing: an error confined to a
fraction ``f`` of the elements escapes a sample of ``k`` with probability about ``exp(-f k)`` and can
stay below every statistic's bound; a rotation (RoPE) keeps every position's norm. Metrics over the
sample are estimates and ``max_abs`` is a lower bound (the largest of the sample's and of what each
statistic's difference implies); there are no hints (they read whole tensors), no error profile and
no logits effect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from parity.compare.metrics import MISMATCH, NONFINITE, OK, tensor_metrics
from parity.compare.results import NodeResult
from parity.compare.tolerances import Tolerances
from parity.diagnose.profile import HEAD_MAJOR
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

#: elements sampled per node, and the seed that picks them
DEFAULT_SAMPLE = 1024
SAMPLE_SEED = 0
STATISTICS = ("numel", "nonfinite", "mean", "mean_abs", "rms", "min", "max", "max_abs")
#: relative slack on a statistic's bound: float64 sums taken in another order
SLACK = 1e-9


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def position_axis(kind: str, ndim: int) -> int | None:
    """The token-position axis of a node: 2 for ``(batch, heads, seq, ...)`` attention nodes, else 1;
    None below 2 axes."""
    if ndim < 2:
        return None
    return 2 if kind in HEAD_MAJOR and ndim == 4 else 1


def sample_index(numel: int, k: int, seed: int = SAMPLE_SEED) -> torch.Tensor:
    """``k`` flat indices drawn with ``seed``, sorted (every index when ``numel <= k``; past 2^22 elements
    drawn with repeats, which are dropped)."""
    if numel <= k:
        return torch.arange(numel, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    if numel <= 1 << 22:  # without repeats while a permutation is cheap
        return torch.randperm(numel, generator=gen)[:k].sort().values
    return torch.randint(0, numel, (k,), generator=gen, dtype=torch.int64).unique()


@dataclass(frozen=True)
class Summary:
    """A node's statistics instead of its tensor (see the module docstring)."""

    shape: tuple[int, ...]
    dtype: str
    stats: Mapping[str, float]
    sample_index: torch.Tensor
    sample: torch.Tensor
    position_norm: torch.Tensor | None


def summarise(
    tensor: torch.Tensor, kind: str, sample: int = DEFAULT_SAMPLE, index: torch.Tensor | None = None
) -> Summary:
    """The :class:`Summary` of one node's tensor; ``index`` fixes the sampled elements (those of the
    summary it will be compared with)."""
    flat = tensor.detach().reshape(-1)
    x = flat.double()
    finite = torch.isfinite(x)
    good = x[finite] if not bool(finite.all()) else x
    n = good.numel()
    stats = {
        "numel": int(flat.numel()),
        "nonfinite": int(flat.numel() - n),
        "mean": float(good.mean()) if n else math.nan,
        "mean_abs": float(good.abs().mean()) if n else math.nan,
        "rms": float(good.pow(2).mean().sqrt()) if n else math.nan,
        "min": float(good.min()) if n else math.nan,
        "max": float(good.max()) if n else math.nan,
        "max_abs": float(good.abs().max()) if n else math.nan,
    }
    if index is None:
        index = sample_index(flat.numel(), sample)
    axis = position_axis(kind, tensor.dim())
    norm = None
    if axis is not None:
        moved = tensor.detach().double().movedim(axis, 1)
        norm = moved.reshape(moved.shape[0], moved.shape[1], -1).norm(dim=-1)
    return Summary(tuple(tensor.shape), _dtype_name(tensor.dtype), stats, index, flat[index].clone(), norm)


class _Discard(dict):
    """A dict that keeps nothing (a summaries recording keeps no module inputs for diagnosis)."""

    def __setitem__(self, key, value):
        pass


class SummaryTrace(Trace):
    """A Trace that keeps each node's :class:`Summary` and drops its tensor right away, so recording a
    deep model holds one node at a time. ``kinds``: node name -> kind (the position axis);
    ``indices``: sampled elements to use per node (those of a stored summary)."""

    def __init__(
        self, kinds: Mapping[str, str], sample: int = DEFAULT_SAMPLE, indices: Mapping[str, torch.Tensor] | None = None
    ):
        super().__init__()
        self.kinds, self.sample, self.indices = dict(kinds), sample, dict(indices or {})
        self.summaries: dict[str, Summary] = {}
        self.inputs = _Discard()

    def add(self, name: str, value, transform=None) -> None:
        if name in self.summaries:
            self.calls[name] = self.calls.get(name, 0) + 1
            return
        super().add(name, value, transform)
        tensor = self.tensors.pop(name, None)
        if tensor is not None:
            index = self.indices.get(name)
            if index is not None and (not index.numel() or int(index.max()) >= tensor.numel()):
                index = None  # another size: the shape check reports it
            self.summaries[name] = summarise(tensor, self.kinds.get(name, ""), self.sample, index)

    @property
    def order(self) -> list[str]:
        return list(self.summaries)


def _within(a: float, b: float, allowed: float) -> bool:
    return abs(a - b) <= allowed + SLACK * max(abs(a), abs(b))


def compare_summary(spec: NodeSpec, index: int, ours: Summary, ref: Summary, tolerances: Tolerances) -> NodeResult:
    """Judge one node from summaries (ours may be a whole tensor's summary taken at the reference's
    sampled indices). A sampled element past its tolerance or a statistic past the bound that
    element-wise agreement implies makes the node fail (see the module docstring)."""
    atol, rtol, source = tolerances.for_node(spec.name)
    base: dict[str, Any] = dict(
        name=spec.name,
        index=index,
        layer=spec.layer,
        kind=spec.kind,
        atol=atol,
        rtol=rtol,
        tol_source=source,
        shape_ours=ours.shape,
        shape_ref=ref.shape,
        dtype=ref.dtype,
    )
    if ours.shape != ref.shape:
        return NodeResult(
            **base,
            status="shape",
            max_abs=None,
            mean_abs=None,
            max_rel=None,
            cosine=None,
            detail=f"ours {ours.shape} vs reference {ref.shape}",
        )
    n = ref.stats["numel"]
    where = f"judged on summaries: {ref.sample.numel()} of {n} elements sampled"
    m = tensor_metrics(ours.sample, ref.sample, atol, rtol)
    if m.status == NONFINITE or ours.stats["nonfinite"] or ref.stats["nonfinite"]:
        detail = f"{ours.stats['nonfinite']} non-finite values in ours, {ref.stats['nonfinite']} in the reference" + (
            f"; in the sample: {m.detail}" if m.detail else ""
        )
        inf, nan = math.inf, math.nan
        return NodeResult(
            **base,
            status=NONFINITE,
            max_abs=inf,
            mean_abs=nan,
            max_rel=inf,
            cosine=nan,
            detail=f"{detail} ({where})",
            rel_l2=nan,
            atol_needed=inf,
            rtol_needed=inf,
        )
    o, r = ours.stats, ref.stats
    # tensor_metrics sets max_abs and atol_needed
    violated, lower, needed = [], [cast(float, m.max_abs)], [cast(float, m.atol_needed)]
    for stat, scale in (
        ("mean", "mean_abs"),
        ("rms", "rms"),
        ("min", "max_abs"),
        ("max", "max_abs"),
        ("max_abs", "max_abs"),
    ):
        diff = abs(o[stat] - r[stat])
        lower.append(diff)
        needed.append(diff - rtol * r[scale])
        if not _within(o[stat], r[stat], atol + rtol * r[scale]):
            violated.append(f"{stat} {o[stat]:.6g} vs {r[stat]:.6g}")
    if (
        ours.position_norm is not None
        and ref.position_norm is not None
        and ours.position_norm.shape == ref.position_norm.shape
    ):
        per_position = n // max(ref.position_norm.numel(), 1)
        root = math.sqrt(per_position)
        a, b = ours.position_norm, ref.position_norm
        diffs = (a - b).abs()
        allowed = root * atol + rtol * b + SLACK * torch.maximum(a.abs(), b.abs())
        lower.append(float(diffs.max()) / root if diffs.numel() else 0.0)
        needed.append(float(((diffs - rtol * b) / root).max()) if diffs.numel() else 0.0)
        bad = (diffs > allowed).nonzero().tolist()
        if bad:
            shown = ", ".join(f"{p}" if a.shape[0] == 1 else f"{row}:{p}" for row, p in bad[:8])
            shown += ", ..." if len(bad) > 8 else ""
            label = "position" if a.shape[0] == 1 else "row:position"
            violated.append(f"the norm of {len(bad)} of {b.numel()} token positions ({label} {shown})")
    status = MISMATCH if violated or m.status == MISMATCH else OK
    detail = where + (f"; past what agreement allows: {'; '.join(violated)}" if violated else "")
    return NodeResult(
        **base,
        status=status,
        max_abs=max(lower),
        mean_abs=m.mean_abs,
        max_rel=m.max_rel,
        cosine=m.cosine,
        detail=detail,
        rel_l2=m.rel_l2,
        atol_needed=max(0.0, *needed),
        rtol_needed=m.rtol_needed,
    )
