"""The gate's baseline (``parity-baseline.json``): each case's node statistics from a passing run, the
budget a later run may not exceed, and its writing (only from a passing run, atomically)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from parity.gate.cases import DTYPES, CaseResult, Excess
from parity.util.errors import ParityError

BASELINE_VERSION = 2
DEFAULT_BASELINE = "parity-baseline.json"


# --- the budget -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """Per node and dtype: a statistic may grow by ``growth[stat]`` over its baseline, and never
    fails below ``floor_fraction`` x the dtype's default atol.

    Why these numbers: ``mean_abs`` averages thousands of elements, so a change that only moves
    roundings around leaves it within ~1.5x (measured on a bf16 pair with real error: reordering the
    attention scale moved node mean_abs by 0.81-1.43x); ``max_abs`` is one element, and one more
    rounding step doubles it (the same change: 0.5-2.0x), hence 4x. The floor is what a pair that is
    bit-exact today may drift to: 1% of the atol that the check itself allows, i.e. float32 1e-6
    (about 16 roundings of a unit-scale value, the reduction-order noise of another kernel; a wrong
    norm eps 3e-6 for 1e-6 gives 4e-5) and bfloat16 5e-4 (less than the step between neighbouring
    bf16 numbers from 1/8 up, 2^-10: a bf16 pair that is bit-exact today must stay so).
    """

    growth: tuple[tuple[str, float], ...] = (("max_abs", 4.0), ("mean_abs", 2.0))
    floor_fraction: float = 0.01

    def floor(self, dtype: str) -> float:
        import torch

        from parity.compare.tolerances import DEFAULT_TOLERANCES

        return float(f"{self.floor_fraction * DEFAULT_TOLERANCES[getattr(torch, dtype)][0]:.6g}")

    def limit(self, stat: str, before: float, dtype: str) -> float:
        return max(dict(self.growth)[stat] * before, self.floor(dtype))

    def describe(self) -> dict:
        return {
            "growth": dict(self.growth),
            "floor": {d: self.floor(d) for d in DTYPES},
            "floor_fraction_of_atol": self.floor_fraction,
        }


BUDGET = Budget()


# --- baseline -----------------------------------------------------------------------------------------


def baseline_versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def empty_baseline() -> dict:
    return {"version": BASELINE_VERSION, "versions": {}, "cases": {}}


def read_baseline(path: str | Path, missing_ok: bool = False) -> dict:
    """The baseline file (an empty one if it does not exist, or is of another version, and
    ``missing_ok``: what ``--update-baseline`` starts from).

    Raises ParityError (one line) if it is missing, not JSON, not an object, of another version, or
    holds anything but ``{"max_abs": x, "mean_abs": y}`` with finite x, y >= 0 per case and node.
    """
    path = Path(path)
    redo = f"rewrite it with `parity gate --update-baseline --baseline {path}`"
    if not path.exists():
        if missing_ok:
            return empty_baseline()
        raise ParityError(
            f"baseline {path} does not exist: create it with `parity gate --update-baseline --baseline {path}` "
            "and commit it (or point --baseline / [tool.parity] baseline at yours)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParityError(f"baseline {path} is not valid JSON ({getattr(e, 'msg', None) or e}): {redo}") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
            type(data), "null"
        )
        raise ParityError(f"baseline {path} holds {kind}, not the JSON object a parity baseline is: {redo}")
    version = data.get("version")
    if version != BASELINE_VERSION and missing_ok:
        return empty_baseline()
    if version != BASELINE_VERSION:
        what = 'has no "version"' if version is None else f"has version {version!r}"
        raise ParityError(f"baseline {path} {what}; this parity reads version {BASELINE_VERSION}: {redo}")
    if not isinstance(data.get("cases"), dict):
        raise ParityError(f'baseline {path} has no "cases" object: {redo}')
    for case, entry in data["cases"].items():
        nodes = entry.get("nodes") if isinstance(entry, dict) else None
        if not isinstance(nodes, dict):
            raise ParityError(f'baseline {path}: case {case} has no "nodes" object')
        for name, value in nodes.items():
            stats = value if isinstance(value, dict) else {}
            for stat in ("max_abs", "mean_abs"):
                v = stats.get(stat)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                    raise ParityError(
                        f"baseline {path}: {case} node {name} has {stat} {v!r}, expected a finite number >= 0"
                    )
    return data


def budget_excess(result, recorded: dict, dtype: str, budget: Budget = BUDGET) -> tuple[list[Excess], list[str]]:
    """Node statistics past their budget, and the problems with the entry itself (nodes new to it,
    nodes no longer compared)."""
    now = {n.name: n for n in result.nodes}
    problems = []
    new = [name for name in now if name not in recorded]
    if new:
        problems.append(
            f"{len(new)} node(s) not in the baseline ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''}): "
            "review and run `parity gate --update-baseline`"
        )
    gone = [name for name in recorded if name not in now]
    if gone:
        problems.append(
            f"{len(gone)} baseline node(s) no longer compared ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''})"
        )
    excess = []
    for name, before in recorded.items():
        node = now.get(name)
        if node is None:
            continue
        for stat, _ in budget.growth:
            value = getattr(node, stat)
            limit = budget.limit(stat, before[stat], dtype)
            if value is not None and value > limit:
                excess.append(Excess(name, stat, value, limit, before[stat]))
    return excess, problems


def _baseline_text(data: dict) -> str:
    """JSON with one line per node, so a diff of the baseline shows which nodes moved."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "cases": {']
    cases = list(data["cases"].items())
    for i, (case, entry) in enumerate(cases):
        lines.append(f'  {json.dumps(case)}: {{"nodes": {{')
        nodes = list(entry["nodes"].items())
        for j, (name, stats) in enumerate(nodes):
            lines.append(f"   {json.dumps(name)}: {json.dumps(stats)}" + ("," if j < len(nodes) - 1 else ""))
        lines.append("  }}" + ("," if i < len(cases) - 1 else ""))
    return "\n".join(lines + [" }", "}"]) + "\n"


def write_baseline(
    path: str | Path, baseline: dict, outcomes: Iterable[CaseResult], families_run: Iterable[str]
) -> None:
    """Record every case of ``outcomes``; entries of the families run that no case produced any more
    are dropped; other families' entries are kept."""
    from parity.util.files import atomic_write

    run = set(families_run)
    cases = {k: v for k, v in baseline.get("cases", {}).items() if k.split("/")[0] not in run}
    for c in outcomes:
        assert c.result is not None  # a recorded case passed, so it was checked (one that was not has a problem)
        cases[c.case.id] = {
            "nodes": {
                n.name: {"max_abs": n.max_abs, "mean_abs": n.mean_abs} for n in c.result.nodes if n.max_abs is not None
            }
        }
    data = {
        "version": BASELINE_VERSION,
        "versions": baseline_versions(),
        "budget": BUDGET.describe(),
        "cases": dict(sorted(cases.items())),
    }
    text = _baseline_text(data)
    try:
        atomic_write(path, text)
    except OSError as e:  # a full disk or a read-only folder: the old baseline stays as it was
        from parity.util.files import cannot_write

        raise cannot_write(e, f"the baseline {path}", Path(path).parent, len(text.encode()) + 4096) from None
