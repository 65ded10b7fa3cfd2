"""Which ``(atol, rtol)`` a node is judged with: a node pattern, exact (0, 0), calibrated, the run's,
or the compute dtype's default."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

#: Default (atol, rtol) per compute dtype. fp32: two implementations of the same math differ by
#: reduction order only (~1e-6 after a few layers); bf16 keeps 8 bits of mantissa, so one
#: rounding of a unit-scale value is ~4e-3 and chained layers compound it.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


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
    #: what ``calibrated`` is, for reports: "calibrated" (10x the reference's own error) or "semantic"
    calibrated_source: str = "calibrated"

    def for_node(self, name: str) -> tuple[float, float, str]:
        """``(atol, rtol, source)`` for one node."""
        for pattern, tol in self.per_node.items():
            if fnmatch.fnmatchcase(name, pattern):
                return float(tol[0]), float(tol[1]), f"pattern:{pattern}"
        if self.exact:
            return 0.0, 0.0, "exact"
        if self.calibrated and name in self.calibrated:
            return float(self.calibrated[name][0]), float(self.calibrated[name][1]), self.calibrated_source
        d_atol, d_rtol = default_tolerance(self.dtype)
        source = (
            "run"
            if self.atol is not None or self.rtol is not None
            else f"default:{str(self.dtype).replace('torch.', '')}"
        )
        return (d_atol if self.atol is None else self.atol, d_rtol if self.rtol is None else self.rtol, source)


def tolerance_for(name: str, dtype: torch.dtype, atol=None, rtol=None, per_node=None) -> tuple[float, float]:
    """Resolve a node's tolerance (see :class:`Tolerances`)."""
    return Tolerances(dtype, atol, rtol, dict(per_node or {})).for_node(name)[:2]
