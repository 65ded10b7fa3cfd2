"""The CI gate: every family's CI cases, judged by their checks and against a committed baseline.

A case is one family, one CI config, one source of weights and one compute dtype: ``config``
(seeded random weights), ``checkpoint`` (a single-file ``save_pretrained`` fixture written for the
run, in that dtype) or ``checkpoint-sharded`` (the same, sharded); ``float32`` (default tolerances)
or ``bfloat16`` (tolerances calibrated on the reference's own bf16 error, ``check(calibrate=True)``,
so a family whose bf16 error is real still passes when it is no worse than the reference's own).

A case fails on a failing node, a loader-coverage gap or a build error, and on any node whose error
grew past its budget in the baseline (``parity-baseline.json``, rewritten only by
``--update-baseline`` from a passing run). The budget rule (:class:`Budget`)::

    mean_abs > max(2 x baseline mean_abs, floor)  or  max_abs > max(4 x baseline max_abs, floor)
    floor = 1% of the dtype's default atol (float32 1e-6, bfloat16 5e-4)

A family also fails when a feature of one of its real configs is exercised by none of its CI
configs (:func:`config_holes`).

The gate runs as pytest tests (:mod:`parity.gate.pytest_gate`, delivered by the pytest plugin); this
module is the part that knows no pytest: which families a project has, which cases to run, running
and judging one case (:meth:`GateRun.evaluate`), the baseline, the gate's report folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import parity.build
from parity.gate.baseline import (
    BUDGET,
    baseline_versions,
    budget_excess,
    empty_baseline,
    read_baseline,
    write_baseline,
)
from parity.gate.cases import DTYPES, SOURCES, Case, CaseResult
from parity.gate.project import Project, choose_families, config_holes
from parity.model.family import Family
from parity.util.errors import ParityError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def plan(family_names: Iterable[str], families: dict[str, Family]) -> list[Case]:
    return [Case(f, c, s, d) for f in family_names for c in families[f].ci_configs for s in SOURCES for d in DTYPES]


class GateRun:
    """One run of the gate: the cases chosen, the baseline, a temporary folder for checkpoint
    fixtures, and each case's outcome once :meth:`evaluate` ran it.

    Build it with :meth:`prepare`; :mod:`parity.gate.pytest_gate` evaluates each case as a test; call
    :meth:`finish` (writes the baseline when updating) and :meth:`close` at the end.
    """

    def __init__(
        self,
        project: Project,
        names: list[str],
        cases: list[Case],
        selection: list[str],
        baseline_path: Path,
        baseline: dict,
        update: bool,
    ):
        self.project = project
        self.names = names
        self.cases = cases
        self.selection = selection
        self.baseline_path = baseline_path
        self.baseline = baseline
        self.update = update
        self.outcomes: dict[str, CaseResult] = {}
        self.holes: dict[str, list[str]] = {}
        self.on_case: Callable[[Case], None] | None = None
        self._workdir: Path | None = None
        self._fixtures: dict[tuple, Path] = {}
        recorded = baseline.get("versions") or {}
        self.version_notes = [
            f"baseline recorded with {tool} {recorded[tool]}, running {now}: the reference may have changed"
            for tool, now in (baseline_versions().items() if cases else ())
            if recorded.get(tool) not in (None, now)
        ]

    @classmethod
    def prepare(
        cls,
        root: str | Path = ".",
        baseline: str | Path | None = None,
        families: list[str] | None = None,
        changed: list[str] | None = None,
        update: bool = False,
    ) -> GateRun:
        """Choose the cases: ``families`` (default: the project's), narrowed by ``changed`` (paths
        relative to ``root``, e.g. what a commit touches) when given. The project is the nearest
        folder from ``root`` up that holds a pyproject.toml. Reads the baseline when there is anything
        to judge. Raises ParityError (unknown family, no family at all, bad baseline)."""
        start = Path(root).resolve()
        top = next((p for p in (start, *start.parents) if (p / "pyproject.toml").is_file()), start)
        project = Project.load(top)
        if changed is not None:
            changed = [Path(os.path.relpath(os.path.normpath(start / p), top)).as_posix() for p in changed]
        names = list(dict.fromkeys(families or []))
        for name in names:
            project.family(name)
        if not names:
            names = sorted(project.families)
            if not names:
                raise ParityError(
                    f"no parity family is defined in {project.root}: declare yours under "
                    '[project.entry-points."parity.pairs"] in pyproject.toml, or name an installed one with --family'
                    + (f" ({', '.join(sorted(project.installed))})" if project.installed else "")
                )
        known = {n: project.family(n) for n in names}
        baseline_path = Path(baseline).expanduser() if baseline is not None else project.baseline
        if not baseline_path.is_absolute():
            baseline_path = project.root / baseline_path if baseline is None else Path.cwd() / baseline_path
        if changed is not None:
            names, selection = choose_families(
                changed, {n: project.folders.get(n, ()) for n in names}, project.shared(baseline_path)
            )
        else:
            selection = [f"families: {', '.join(names)}" + ("" if families else " (all of this project)")]
        cases = plan(names, known)
        if update and cases:
            _require_writable(baseline_path)  # before the gate runs, not after it
        data = read_baseline(baseline_path, missing_ok=update) if cases else empty_baseline()
        return cls(project, names, cases, selection, baseline_path, data, update)

    # -- one case

    def _checkpoint(self, case: Case, family: Family, dtype) -> Path:
        """The case's ``save_pretrained`` fixture (seed 1, in the case's dtype), written once."""
        from parity.util.files import short_name, temporary_folder

        key = (case.family, case.config, case.source, case.dtype)
        if key not in self._fixtures:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # save_pretrained's bars would bury the summary
            if self._workdir is None:
                self._workdir = temporary_folder("parity-gate-")
            source = parity.build.build_pair(family, config=case.config, seed=1, dtype=dtype)
            directory = self._workdir / short_name(case.id.replace("/", "_"))
            sharded: dict[str, Any] = {"max_shard_size": "20KB"} if case.source.endswith("sharded") else {}
            cast("PreTrainedModel", source.reference).save_pretrained(directory, **sharded)
            self._fixtures[key] = directory
        return self._fixtures[key]

    def evaluate(self, case: Case) -> CaseResult:
        """Build the case's pair, check it, judge it against the baseline (unless updating)."""
        import torch

        from parity.run.check import check

        if self.on_case is not None:
            self.on_case(case)
        family = self.project.family(case.family)
        dtype = getattr(torch, case.dtype)
        try:
            if case.source == "config":
                pair = parity.build.build_pair(family, config=case.config, dtype=dtype)
            else:
                pair = parity.build.build_pair(family, checkpoint=self._checkpoint(case, family, dtype), dtype=dtype)
            result = check(pair, calibrate=dtype != torch.float32)
        except ParityError as e:
            outcome = CaseResult(case, None, [f"{type(e).__name__}: {e}"])
        else:
            problems = []
            bad = result.first_mismatch
            if bad is not None:
                problems.append(bad.line() + (f" (hint: {bad.hint.text})" if bad.hint is not None else ""))
            if result.coverage is not None and not result.coverage.ok:
                problems += [f"loader coverage: {gap}" for gap in result.coverage.gaps]
            outcome = CaseResult(case, result, problems)
            if not self.update:
                recorded = self.baseline["cases"].get(case.id)
                if recorded is None:
                    outcome.problems.append(
                        f"no baseline for {case.id} in {self.baseline_path.name}: run "
                        "`parity gate --update-baseline` and commit it"
                    )
                else:
                    outcome.excess, entry_problems = budget_excess(result, recorded["nodes"], case.dtype)
                    outcome.problems += entry_problems
        self.outcomes[case.id] = outcome
        return outcome

    def config_holes(self, name: str) -> list[str]:
        self.holes[name] = config_holes(self.project.family(name))
        return self.holes[name]

    # -- the end

    @property
    def passed(self) -> bool:
        return (
            len(self.outcomes) == len(self.cases)
            and all(o.passed for o in self.outcomes.values())
            and not any(self.holes.values())
        )

    def finish(self) -> bool:
        """With ``update``: write the baseline for the families run, only if every case ran and passes
        its checks and no config hole is open. Returns whether it was written; raises ParityError
        saying why not."""
        if not self.update or not self.cases:
            return False
        failing = [o.case.id for o in self.outcomes.values() if not o.passed]
        failing += [h for hs in self.holes.values() for h in hs]
        missing = len(self.cases) - len(self.outcomes)
        if failing or missing:
            more = f"; {missing} case(s) did not run" if missing else ""
            raise ParityError(
                f"not updating the baseline: {len(failing)} case(s) fail ({'; '.join(failing[:3])}){more}"
            )
        write_baseline(self.baseline_path, self.baseline, self.outcomes.values(), self.names)
        return True

    def close(self) -> None:
        """Remove the temporary checkpoint fixtures."""
        from parity.util.files import discard

        if self._workdir is not None:
            discard(self._workdir)
            self._workdir = None
            self._fixtures.clear()

    def summary(self) -> dict:
        return {
            "passed": self.passed,
            "selection": self.selection,
            "baseline": str(self.baseline_path),
            "budget": BUDGET.describe(),
            "config_holes": [h for hs in self.holes.values() for h in hs],
            "version_notes": self.version_notes,
            "cases": [o.to_dict() for o in self.outcomes.values()],
        }


def _require_writable(path: Path) -> None:
    """``--update-baseline`` will write ``path`` (a new file beside it, renamed over it): refuse now,
    naming it, when that cannot be done, rather than after every case has run."""
    if path.is_dir():
        raise ParityError(f"--update-baseline: the baseline {path} is a folder, not a file")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK):
        raise ParityError(
            f"--update-baseline: the baseline {path} cannot be written ({folder} is read-only or not writable); "
            "nothing was run"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise ParityError(f"--update-baseline: the baseline {path} is read-only; nothing was run")


def write_reports(run: GateRun, staging: Path) -> None:
    """Into a gate report folder: summary.json (every case's every problem) and a report.html per
    failing case that was checked (junit.xml is pytest's own, written there by ``parity gate``)."""
    from parity.util.files import atomic_write, short_name

    summary = run.summary()
    for entry, outcome in zip(summary["cases"], run.outcomes.values()):
        if outcome.result is not None and not outcome.passed:
            name = short_name(outcome.case.id.replace("/", "__")) + ".html"
            outcome.result.write_html(staging / name)
            entry["report"] = name
    atomic_write(staging / "summary.json", json.dumps(summary, indent=2) + "\n")


def gate_module_path() -> Path:
    """The file of :mod:`parity.gate.pytest_gate` (what ``parity gate`` hands to pytest)."""
    return Path(__file__).with_name("pytest_gate.py")
