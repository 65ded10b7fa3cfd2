"""The gate's cases: one family, one CI config, one source of weights (``config``, ``checkpoint`` or
``checkpoint-sharded``) and one compute dtype, and what running one gave (:class:`CaseResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from parity.report.result import CheckResult

SOURCES = ("config", "checkpoint", "checkpoint-sharded")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Excess:
    """One node statistic past its budget."""

    node: str
    stat: str
    now: float
    limit: float
    before: float

    def line(self) -> str:
        return f"{self.node}: {self.stat} {self.now:.3g} > budget {self.limit:.3g} (baseline {self.before:.3g})"


# --- cases and their outcomes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    family: str
    config: str
    source: str
    dtype: str = "float32"

    @property
    def id(self) -> str:
        return f"{self.family}/{self.config}/{self.source}/{self.dtype}"


@dataclass
class CaseResult:
    """A case's check result (None if the pair could not be built), its problems (one line each:
    build error, first failing node, loader-coverage gaps, baseline entries), and the node
    statistics past their budget."""

    case: Case
    result: CheckResult | None
    problems: list[str] = field(default_factory=list)
    excess: list[Excess] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and not self.excess

    def lines(self) -> list[str]:
        """Every problem, one line each (the report's list)."""
        return self.problems + [e.line() for e in self.excess]

    def summary(self) -> list[str]:
        """One line: the first problem (and how many more), else the budget (first node, count)."""
        nodes = len({e.node for e in self.excess})
        if self.problems:
            more = [f"{len(self.problems) - 1} more problem(s)"] if len(self.problems) > 1 else []
            more += [f"{nodes} node(s) past their budget"] if nodes else []
            return [self.problems[0] + (f" [+{', '.join(more)}]" if more else "")]
        if self.excess:
            return [f"{nodes} node(s) past their budget, first {self.excess[0].line()}"]
        return []

    def to_dict(self) -> dict:
        out = {
            "case": self.case.id,
            "passed": self.passed,
            "problems": self.problems,
            "over_budget": [vars(e) for e in self.excess],
        }
        if self.result is not None:
            stats = [n for n in self.result.nodes if n.max_abs is not None]
            out.update(
                nodes=len(self.result.nodes),
                # stats have max_abs; mean_abs comes with it
                max_abs=max((cast(float, n.max_abs) for n in stats), default=None),
                mean_abs=max((cast(float, n.mean_abs) for n in stats), default=None),
            )
        return out
