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

The gate runs as pytest tests (:mod:`parity.pytest_gate`, delivered by the pytest plugin); this
module is the part that knows no pytest: which families a project has, which cases to run, running
and judging one case (:meth:`GateRun.evaluate`), the baseline, the gate's report folder.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ParityError
from .family import Family

SOURCES = ("config", "checkpoint", "checkpoint-sharded")
DTYPES = ("float32", "bfloat16")
BASELINE_VERSION = 2
DEFAULT_BASELINE = "parity-baseline.json"
#: what a project's pyproject.toml may set under [tool.parity]
SETTINGS = ("baseline", "pythonpath", "shared")


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

        from .compare import DEFAULT_TOLERANCES

        return float(f"{self.floor_fraction * DEFAULT_TOLERANCES[getattr(torch, dtype)][0]:.6g}")

    def limit(self, stat: str, before: float, dtype: str) -> float:
        return max(dict(self.growth)[stat] * before, self.floor(dtype))

    def describe(self) -> dict:
        return {"growth": dict(self.growth), "floor": {d: self.floor(d) for d in DTYPES},
                "floor_fraction_of_atol": self.floor_fraction}


BUDGET = Budget()


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
    result: object | None
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
        out = {"case": self.case.id, "passed": self.passed, "problems": self.problems,
               "over_budget": [vars(e) for e in self.excess]}
        if self.result is not None:
            stats = [n for n in self.result.nodes if n.max_abs is not None]
            out.update(nodes=len(self.result.nodes), max_abs=max((n.max_abs for n in stats), default=None),
                       mean_abs=max((n.mean_abs for n in stats), default=None))
        return out


# --- the project: its families, settings, and which files belong to which family -------------------------


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ParityError(f"{path} cannot be read: {e}") from None


def _module_file(obj) -> Path | None:
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


@dataclass
class Project:
    """A repository that defines parity families: ``root`` (its pyproject.toml's folder, or the
    folder the gate runs in), its families, and its [tool.parity] settings."""

    root: Path
    families: dict[str, Family]
    installed: dict[str, Family]
    settings: dict
    folders: dict[str, tuple[str, ...]]

    @classmethod
    def load(cls, root: str | Path = ".") -> Project:
        """Read ``root/pyproject.toml``: families declared under [project.entry-points."parity.pairs"]
        are imported from the working tree (``root`` and [tool.parity] ``pythonpath`` go first on
        sys.path), so the gate tests the code being committed, not an installed copy. Installed
        families whose code lies under ``root`` belong to the project too."""
        from importlib import import_module

        from .registry import family_names, get_family

        root = Path(root).resolve()
        data = _toml(root / "pyproject.toml") if (root / "pyproject.toml").is_file() else {}
        settings = dict(data.get("tool", {}).get("parity", {}))
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ParityError(f"{root / 'pyproject.toml'}: unknown [tool.parity] setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
        for key, value in settings.items():
            ok = isinstance(value, str) if key == "baseline" else isinstance(value, list) and all(isinstance(v, str) for v in value)
            if not ok:
                raise ParityError(f"{root / 'pyproject.toml'}: [tool.parity] {key} must be {'a path' if key == 'baseline' else 'a list of paths'}, got {value!r}")
        for path in reversed([root, *(root / p for p in settings.get("pythonpath", []))]):
            if str(path) in sys.path:
                sys.path.remove(str(path))
            sys.path.insert(0, str(path))
        declared = data.get("project", {}).get("entry-points", {}).get("parity.pairs", {})
        families, entry_files = {}, {}
        for name, target in declared.items():
            module_name, _, attr = str(target).partition(":")
            try:
                obj = import_module(module_name)
                for part in attr.split(".") if attr else []:
                    obj = getattr(obj, part)
            except Exception as e:  # an import error in a family is the project's bad input
                raise ParityError(f"family {name} ({target}, pyproject.toml) cannot be imported: {type(e).__name__}: {e}") from None
            if not isinstance(obj, Family):
                raise ParityError(f"family {name} ({target}, pyproject.toml) is not a parity.Family")
            families[name] = obj
            entry_files[name] = Path(sys.modules[module_name].__file__).resolve()
        installed = {}
        for name in family_names():
            try:
                installed[name] = get_family(name)
            except ParityError:
                continue  # a broken family of another package is not this project's concern
        for name, fam in installed.items():
            if name not in families and (_module_file(fam.model_class) or root.parent).is_relative_to(root):
                families[name] = fam
        folders = {}
        for name, fam in families.items():
            files = [_module_file(fam.model_class), _module_file(fam.load) if fam.load else None, entry_files.get(name)]
            folders[name] = tuple(sorted({f.parent.relative_to(root).as_posix() + "/" for f in files
                                          if f is not None and f.is_relative_to(root)}))
        return cls(root, families, installed, settings, folders)

    @property
    def baseline(self) -> Path:
        return self.root / self.settings.get("baseline", DEFAULT_BASELINE)

    def shared(self, baseline: Path) -> tuple[str, ...]:
        """Paths whose change runs every family: pyproject.toml, the baseline, [tool.parity] ``shared``."""
        try:
            rel = Path(baseline).resolve().relative_to(self.root).as_posix()
        except ValueError:
            rel = None
        folders = [p if p.endswith("/") or not (self.root / p).is_dir() else p + "/" for p in self.settings.get("shared", [])]
        return tuple(p for p in ("pyproject.toml", rel, *folders) if p)

    def family(self, name: str) -> Family:
        fam = self.families.get(name) or self.installed.get(name)
        if fam is None:
            known = sorted(set(self.families) | set(self.installed))
            raise ParityError(f"unknown family {name}; known families: {', '.join(known) or 'none'}")
        return fam


def choose_families(changed: Iterable[str], folders: dict[str, tuple[str, ...]], shared: Iterable[str]) -> tuple[list[str], list[str]]:
    """Families to run for a list of changed paths (relative to the project root), with one reason
    line each: a shared path runs all, a family's folder runs that family."""
    changed = sorted({Path(p).as_posix().removeprefix("./") for p in changed})
    shared = tuple(shared)
    hits = [p for p in changed if any(p == s or (s.endswith("/") and p.startswith(s)) for s in shared)]
    if hits:
        return sorted(folders), [f"all families: shared code changed ({', '.join(hits[:5])}{', ...' if len(hits) > 5 else ''})"]
    chosen, reasons = [], []
    for name, dirs in sorted(folders.items()):
        mine = [p for p in changed if p.startswith(dirs)] if dirs else []
        if mine:
            chosen.append(name)
            reasons.append(f"{name}: {', '.join(mine[:5])}{', ...' if len(mine) > 5 else ''} changed")
    if not chosen:
        reasons.append(f"no family or shared file changed ({len(changed)} other path(s))")
    return chosen, reasons


def changed_since(ref: str, cwd: str | Path = ".") -> list[str]:
    """Paths changed between ``ref`` and the working tree (committed or not), plus untracked files,
    relative to the repository's top. Raises ParityError (one line) if ``ref`` is not a commit here."""
    def git(*args) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
        except FileNotFoundError:
            raise ParityError("--changed-since needs git, which is not installed") from None

    if git("rev-parse", "--git-dir").returncode:
        raise ParityError(f"--changed-since {ref}: {Path(cwd).resolve()} is not in a git repository")
    if git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode:
        raise ParityError(f"--changed-since {ref}: no such commit in this repository (a branch, tag or commit; "
                          "in CI fetch the history, e.g. actions/checkout with fetch-depth: 0)")
    diff = git("diff", "--name-only", "--relative", ref, "--")
    untracked = git("ls-files", "--others", "--exclude-standard")
    if diff.returncode or untracked.returncode:
        reason = (diff.stderr or untracked.stderr).strip().splitlines()
        raise ParityError(f"--changed-since {ref}: git cannot list the changes ({reason[0] if reason else 'no reason given'})")
    return sorted({line for line in (diff.stdout + untracked.stdout).splitlines() if line})


# --- config coverage ----------------------------------------------------------------------------------


def config_features(family: Family, name: str) -> set[str]:
    """What a built-in config exercises, read from the facts of its Transformers config (head sharing,
    layer types, RoPE type per layer type, soft-caps, logit scale, Q/K norm, tying, biases, the
    facts' named ``features``) plus the family's own ``features``."""
    from .build import to_reference_config
    from .facts import derive_facts

    cfg = family.configs[name](None)
    hf_config = to_reference_config(family, cfg)
    facts = derive_facts(hf_config)
    kv, heads = facts.num_kv_heads, facts.num_heads
    feats = {"MQA" if kv == 1 else "MHA" if kv == heads else "GQA"}
    for layer_type in set(facts.layer_types):
        rope = facts.rope_of_type(layer_type)
        head_dim = next(layer.head_dim for layer in facts.layers if layer.layer_type == layer_type)
        feats.add(f"{layer_type} layers")
        feats.add(f"{'no' if rope is None else rope.rope_type} RoPE on {layer_type}"
                  + (" (interleaved)" if rope is not None and rope.interleaved else "")
                  + (" (partial)" if rope is not None and rope.rotary_dim < head_dim else ""))
    feats.add("tied head" if facts.tie_word_embeddings else "untied head")
    for label, value in (("logit scale", facts.logit_scale), ("final soft-cap", facts.final_softcap),
                         ("attention soft-cap", facts.attn_softcap), ("embedding scale", facts.embed_scale)):
        if value not in (None, 1.0):
            feats.add(label)
    if facts.qk_norm:
        feats.add(f"Q/K norm per {facts.qk_norm}")
    sparse = {layer.sparse for layer in facts.layers}
    if True in sparse:
        feats.add("mixture-of-experts feed-forward")
    if sparse == {True, False}:
        feats.add("dense and mixture-of-experts layers")
    if getattr(hf_config, "attention_bias", False):
        feats.add("attention bias")
    return feats | set(facts.features) | family.config_features(name)


def config_holes(family: Family) -> list[str]:
    """Features a real config uses that no CI config exercises (one line per real config)."""
    covered = set().union(*(config_features(family, c) for c in family.ci_configs))
    holes = []
    for real in family.real_configs:
        missing = sorted(config_features(family, real) - covered)
        if missing:
            holes.append(f"{family.name}: {real} uses {', '.join(missing)}, which no CI config ({', '.join(family.ci_configs)}) exercises")
    return holes


# --- baseline -----------------------------------------------------------------------------------------


def _versions() -> dict:
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
        raise ParityError(f"baseline {path} does not exist: create it with `parity gate --update-baseline --baseline {path}` "
                          "and commit it (or point --baseline / [tool.parity] baseline at yours)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParityError(f"baseline {path} is not valid JSON ({getattr(e, 'msg', None) or e}): {redo}") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(type(data), "null")
        raise ParityError(f"baseline {path} holds {kind}, not the JSON object a parity baseline is: {redo}")
    version = data.get("version")
    if version != BASELINE_VERSION and missing_ok:
        return empty_baseline()
    if version != BASELINE_VERSION:
        what = "has no \"version\"" if version is None else f"has version {version!r}"
        raise ParityError(f"baseline {path} {what}; this parity reads version {BASELINE_VERSION}: {redo}")
    if not isinstance(data.get("cases"), dict):
        raise ParityError(f"baseline {path} has no \"cases\" object: {redo}")
    for case, entry in data["cases"].items():
        nodes = entry.get("nodes") if isinstance(entry, dict) else None
        if not isinstance(nodes, dict):
            raise ParityError(f"baseline {path}: case {case} has no \"nodes\" object")
        for name, value in nodes.items():
            stats = value if isinstance(value, dict) else {}
            for stat in ("max_abs", "mean_abs"):
                v = stats.get(stat)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                    raise ParityError(f"baseline {path}: {case} node {name} has {stat} {v!r}, expected a finite number >= 0")
    return data


def budget_excess(result, recorded: dict, dtype: str, budget: Budget = BUDGET) -> tuple[list[Excess], list[str]]:
    """Node statistics past their budget, and the problems with the entry itself (nodes new to it,
    nodes no longer compared)."""
    now = {n.name: n for n in result.nodes}
    problems = []
    new = [name for name in now if name not in recorded]
    if new:
        problems.append(f"{len(new)} node(s) not in the baseline ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''}): "
                        "review and run `parity gate --update-baseline`")
    gone = [name for name in recorded if name not in now]
    if gone:
        problems.append(f"{len(gone)} baseline node(s) no longer compared ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''})")
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
        lines.append(f"  {json.dumps(case)}: {{\"nodes\": {{")
        nodes = list(entry["nodes"].items())
        for j, (name, stats) in enumerate(nodes):
            lines.append(f"   {json.dumps(name)}: {json.dumps(stats)}" + ("," if j < len(nodes) - 1 else ""))
        lines.append("  }}" + ("," if i < len(cases) - 1 else ""))
    return "\n".join(lines + [" }", "}"]) + "\n"


def write_baseline(path: str | Path, baseline: dict, outcomes: Iterable[CaseResult], families_run: Iterable[str]) -> None:
    """Record every case of ``outcomes``; entries of the families run that no case produced any more
    are dropped; other families' entries are kept."""
    from .report.atomic import atomic_write

    run = set(families_run)
    cases = {k: v for k, v in baseline.get("cases", {}).items() if k.split("/")[0] not in run}
    for c in outcomes:
        cases[c.case.id] = {"nodes": {n.name: {"max_abs": n.max_abs, "mean_abs": n.mean_abs} for n in c.result.nodes
                                      if n.max_abs is not None}}
    data = {"version": BASELINE_VERSION, "versions": _versions(), "budget": BUDGET.describe(), "cases": dict(sorted(cases.items()))}
    atomic_write(path, _baseline_text(data))


# --- a run of the gate ----------------------------------------------------------------------------------


def plan(family_names: Iterable[str], families: dict[str, Family]) -> list[Case]:
    return [Case(f, c, s, d) for f in family_names for c in families[f].ci_configs for s in SOURCES for d in DTYPES]


class GateRun:
    """One run of the gate: the cases chosen, the baseline, a temporary folder for checkpoint
    fixtures, and each case's outcome once :meth:`evaluate` ran it.

    Build it with :meth:`prepare`; :mod:`parity.pytest_gate` evaluates each case as a test; call
    :meth:`finish` (writes the baseline when updating) and :meth:`close` at the end.
    """

    def __init__(self, project: Project, names: list[str], cases: list[Case], selection: list[str],
                 baseline_path: Path, baseline: dict, update: bool):
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
            for tool, now in (_versions().items() if cases else ()) if recorded.get(tool) not in (None, now)
        ]

    @classmethod
    def prepare(cls, root: str | Path = ".", baseline: str | Path | None = None, families: list[str] | None = None,
                changed: list[str] | None = None, update: bool = False) -> GateRun:
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
                    "[project.entry-points.\"parity.pairs\"] in pyproject.toml, or name an installed one with --family"
                    + (f" ({', '.join(sorted(project.installed))})" if project.installed else "")
                )
        known = {n: project.family(n) for n in names}
        baseline_path = Path(baseline).expanduser() if baseline is not None else project.baseline
        if not baseline_path.is_absolute():
            baseline_path = project.root / baseline_path if baseline is None else Path.cwd() / baseline_path
        if changed is not None:
            names, selection = choose_families(changed, {n: project.folders.get(n, ()) for n in names}, project.shared(baseline_path))
        else:
            selection = [f"families: {', '.join(names)}" + ("" if families else " (all of this project)")]
        cases = plan(names, known)
        data = read_baseline(baseline_path, missing_ok=update) if cases else empty_baseline()
        return cls(project, names, cases, selection, baseline_path, data, update)

    # -- one case

    def _checkpoint(self, case: Case, family: Family, dtype) -> Path:
        """The case's ``save_pretrained`` fixture (seed 1, in the case's dtype), written once."""
        from .report.atomic import short_name, temporary_folder

        key = (case.family, case.config, case.source, case.dtype)
        if key not in self._fixtures:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # save_pretrained's bars would bury the summary
            if self._workdir is None:
                self._workdir = temporary_folder("parity-gate-")
            source = family.build_pair(config=case.config, seed=1, dtype=dtype)
            directory = self._workdir / short_name(case.id.replace("/", "_"))
            sharded = {"max_shard_size": "20KB"} if case.source.endswith("sharded") else {}
            source.reference.save_pretrained(directory, **sharded)
            self._fixtures[key] = directory
        return self._fixtures[key]

    def evaluate(self, case: Case) -> CaseResult:
        """Build the case's pair, check it, judge it against the baseline (unless updating)."""
        import torch

        from .check import check

        if self.on_case is not None:
            self.on_case(case)
        family = self.project.family(case.family)
        dtype = getattr(torch, case.dtype)
        try:
            if case.source == "config":
                pair = family.build_pair(config=case.config, dtype=dtype)
            else:
                pair = family.build_pair(checkpoint=self._checkpoint(case, family, dtype), dtype=dtype)
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
                    outcome.problems.append(f"no baseline for {case.id} in {self.baseline_path.name}: run "
                                            "`parity gate --update-baseline` and commit it")
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
        return (len(self.outcomes) == len(self.cases) and all(o.passed for o in self.outcomes.values())
                and not any(self.holes.values()))

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
            raise ParityError(f"not updating the baseline: {len(failing)} case(s) fail ({'; '.join(failing[:3])}){more}")
        write_baseline(self.baseline_path, self.baseline, self.outcomes.values(), self.names)
        return True

    def close(self) -> None:
        """Remove the temporary checkpoint fixtures."""
        from .report.atomic import discard

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


def write_reports(run: GateRun, staging: Path) -> None:
    """Into a gate report folder: summary.json (every case's every problem) and a report.html per
    failing case that was checked (junit.xml is pytest's own, written there by ``parity gate``)."""
    from .report.atomic import atomic_write, short_name

    summary = run.summary()
    for entry, outcome in zip(summary["cases"], run.outcomes.values()):
        if outcome.result is not None and not outcome.passed:
            name = short_name(outcome.case.id.replace("/", "__")) + ".html"
            outcome.result.write_html(staging / name)
            entry["report"] = name
    atomic_write(staging / "summary.json", json.dumps(summary, indent=2) + "\n")


def gate_module_path() -> Path:
    """The file of :mod:`parity.pytest_gate` (what ``parity gate`` hands to pytest)."""
    return Path(__file__).with_name("pytest_gate.py")
