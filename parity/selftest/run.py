"""``parity selftest <family>``: inject every known fault into a fresh pair and check that parity
names the right node, in chained and in isolated mode, with the right class of hint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import parity.build
from parity.model.family import Family
from parity.run.check import check
from parity.selftest.faults import Fault, in_scope

if TYPE_CHECKING:
    from parity.compare.results import NodeResult


@dataclass
class SelftestRow:
    fault: Fault
    chained: str | None
    isolated: str | None
    isolated_failing: list[str]
    hint: str
    hint_kind: str | None
    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems


def run_fault(family: Family, fault: Fault) -> SelftestRow:
    """Build a fresh pair, check it is clean, inject ``fault`` and judge what parity reports."""
    pair = parity.build.build_pair(family, config=fault.config, **dict(fault.overrides))
    problems = []
    kwargs = dict(fault.check_kwargs)
    control = check(pair, **kwargs)
    if not control.passed:
        problems.append(f"control pair already fails at {cast('NodeResult', control.first_mismatch).name}")
    fault.inject(pair)
    # a KV-cache run is chained only; so is a training check (its nodes are the chained run's gradients)
    decode = "decode" in kwargs or bool(kwargs.get("backward")) or bool(kwargs.get("causality"))
    res = check(pair, mode="chained" if decode else "both", **kwargs)
    chained, isolated = res.first_mismatch, res.first_isolated_mismatch
    # mode "both" fills res.isolated
    failing = [n.name for n in cast("tuple[NodeResult, ...]", res.isolated) if n.failed] if not decode else []
    if chained is None or chained.name != fault.expected:
        problems.append(f"chained: expected {fault.expected}, found {chained.name if chained else 'no mismatch'}")
    if not decode and (isolated is None or isolated.name != fault.isolated_expected):
        problems.append(
            f"isolated: expected {fault.isolated_expected}, found {isolated.name if isolated else 'no mismatch'}"
        )
    outside = [n for n in failing if not in_scope(n, fault.isolated_scope)]
    if outside:
        problems.append(f"isolated: {len(outside)} failing nodes outside {fault.isolated_scope}, first {outside[0]}")
    hint = chained.hint if chained is not None else None
    kind = hint.kind if hint is not None else None
    if kind != fault.hint:
        problems.append(f"hint kind: expected {fault.hint}, found {kind or 'no hint'}")
    return SelftestRow(
        fault,
        chained.name if chained else None,
        isolated.name if isolated else None,
        failing,
        hint.text if hint is not None else "",
        kind,
        problems,
    )
