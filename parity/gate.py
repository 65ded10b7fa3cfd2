"""The CI gate: run every family's CI cases, fail on any failing node, loader-coverage gap, config
coverage hole, or node whose error grew past the budget recorded in a committed baseline.

A case is one family, one CI config, one source of weights: ``config`` (seeded random weights),
``checkpoint`` (a single-file ``save_pretrained`` fixture written for the run) or
``checkpoint-sharded`` (the same, sharded). The baseline (``parity-baseline.json``) records each
case's per-node max_abs and the tool versions; it is rewritten only by ``--update-baseline``.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .check import check, versions
from .errors import ParityError
from .family import Family
from .registry import families as all_families
from .result import CheckResult

SOURCES = ("config", "checkpoint", "checkpoint-sharded")
BASELINE_VERSION = 1
#: a node fails the gate when max_abs > max(GROWTH * baseline max_abs, FLOOR)
GROWTH, FLOOR = 2.0, 1e-6
#: any change under these paths runs every family
ENGINE_PATHS = ("parity/", "reference_pairs/common/", "pyproject.toml", "parity-baseline.json")


@dataclass(frozen=True)
class Case:
    family: str
    config: str
    source: str

    @property
    def id(self) -> str:
        return f"{self.family}/{self.config}/{self.source}"


@dataclass
class CaseResult:
    case: Case
    result: CheckResult | None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class GateOutcome:
    cases: list[CaseResult]
    config_holes: list[str]
    selection: list[str]
    version_notes: list[str] = field(default_factory=list)
    baseline_updated: bool = False

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases) and not self.config_holes


# --- choosing families from a diff -------------------------------------------------------------------


def choose_families(changed: list[str], known: dict[str, Family]) -> tuple[list[str], list[str]]:
    """Families to run for a list of changed paths, with one reason line each."""
    engine = [p for p in changed if p.startswith(ENGINE_PATHS)]
    if engine:
        return sorted(known), [f"all families: shared code changed ({', '.join(engine[:5])}{', ...' if len(engine) > 5 else ''})"]
    chosen, reasons = [], []
    for name, fam in sorted(known.items()):
        hits = [p for p in changed if p.startswith(fam.folder)]
        if hits:
            chosen.append(name)
            reasons.append(f"{name}: {', '.join(hits[:5])}{', ...' if len(hits) > 5 else ''} changed")
    if not chosen:
        reasons.append(f"no family or engine file changed ({len(changed)} other paths)")
    return chosen, reasons


def changed_since(ref: str, cwd: str | Path = ".") -> list[str]:
    """Paths changed between ``ref`` and the working tree (committed or not), plus untracked files.
    Raises ParityError if ``ref`` is not a git revision here."""
    def git(*args):
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
        if proc.returncode:
            raise ParityError(f"git {' '.join(args)} failed: {proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else proc.returncode}")
        return [line for line in proc.stdout.splitlines() if line]

    git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    return sorted(set(git("diff", "--name-only", ref, "--") + git("ls-files", "--others", "--exclude-standard")))


# --- config coverage ----------------------------------------------------------------------------------


def config_features(family: Family, name: str) -> set[str]:
    """What a built-in config exercises, read from the facts of its Transformers config (head sharing,
    layer types, RoPE type per layer type, soft-caps, logit scale, Q/K norm, tying, biases) plus
    the family's own ``features``."""
    from .build import to_reference_config
    from .facts import derive_facts

    cfg = family.configs[name](None)
    hf_config = to_reference_config(family, cfg)
    facts = derive_facts(hf_config)
    kv, heads = facts.num_kv_heads, facts.num_heads
    feats = {"MQA" if kv == 1 else "MHA" if kv == heads else "GQA"}
    for layer_type in set(facts.layer_types):
        rope = facts.rope_of_type(layer_type)
        feats.add(f"{layer_type} layers")
        feats.add(f"{'no' if rope is None else rope.rope_type} RoPE on {layer_type}"
                  + (" (interleaved)" if rope is not None and rope.interleaved else "")
                  + (" (partial)" if rope is not None and rope.rotary_dim < facts.head_dim else ""))
    feats.add("tied head" if facts.tie_word_embeddings else "untied head")
    for label, value in (("logit scale", facts.logit_scale), ("final soft-cap", facts.final_softcap),
                         ("attention soft-cap", facts.attn_softcap), ("embedding scale", facts.embed_scale)):
        if value not in (None, 1.0):
            feats.add(label)
    if facts.qk_norm:
        feats.add(f"Q/K norm per {facts.qk_norm}")
    if getattr(hf_config, "attention_bias", False):
        feats.add("attention bias")
    return feats | family.config_features(name)


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


def read_baseline(path: str | Path, missing_ok: bool = False) -> dict:
    """The baseline file (an empty one if it does not exist and ``missing_ok``).

    Raises ParityError if it is missing, not JSON, of another version, or holds anything but
    non-negative numbers per case and node.
    """
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return {"version": BASELINE_VERSION, "versions": {}, "cases": {}}
        raise ParityError(f"baseline {path} does not exist (create it with `parity gate --update-baseline --baseline {path}`)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParityError(f"baseline {path} is not valid JSON: {getattr(e, 'msg', e)}") from None
    if not isinstance(data, dict) or data.get("version") != BASELINE_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise ParityError(f"baseline {path} has version {found!r}, expected {BASELINE_VERSION}")
    if not isinstance(data.get("cases"), dict):
        raise ParityError(f"baseline {path} has no \"cases\" object")
    for case, entry in data["cases"].items():
        nodes = entry.get("nodes") if isinstance(entry, dict) else None
        if not isinstance(nodes, dict):
            raise ParityError(f"baseline {path}: case {case} has no \"nodes\" object")
        for name, value in nodes.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ParityError(f"baseline {path}: {case} node {name} has {value!r}, expected a number >= 0")
    return data


def baseline_problems(case: Case, result: CheckResult, baseline: dict) -> list[str]:
    recorded = baseline["cases"].get(case.id)
    if recorded is None:
        return [f"no baseline for {case.id}: run `parity gate --update-baseline` and commit parity-baseline.json"]
    growth, floor = baseline.get("growth", GROWTH), baseline.get("floor", FLOOR)
    problems = []
    now = {n.name: n.max_abs for n in result.nodes}
    new = [name for name in now if name not in recorded["nodes"]]
    if new:
        problems.append(f"{len(new)} node(s) not in the baseline ({', '.join(new[:3])}): review and run --update-baseline")
    for name, before in recorded["nodes"].items():
        if name not in now:
            problems.append(f"{name} is in the baseline but no longer compared")
            continue
        budget = max(growth * before, floor)
        if now[name] is not None and now[name] > budget:
            problems.append(f"{name}: max_abs {now[name]:.3g} grew past its budget {budget:.3g} (baseline {before:.3g})")
    return problems


def write_baseline(path: str | Path, baseline: dict, outcomes: list[CaseResult]) -> None:
    from .report.atomic import atomic_write

    cases = dict(baseline.get("cases", {}))
    for c in outcomes:
        cases[c.case.id] = {"nodes": {n.name: n.max_abs for n in c.result.nodes}}
    data = {"version": BASELINE_VERSION, "versions": versions(), "growth": GROWTH, "floor": FLOOR,
            "cases": dict(sorted(cases.items()))}
    atomic_write(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


# --- running ------------------------------------------------------------------------------------------


def plan(family_names: list[str], known: dict[str, Family]) -> list[Case]:
    return [Case(f, c, s) for f in family_names for c in known[f].ci_configs for s in SOURCES]


def run_case(case: Case, family: Family, workdir: Path) -> CaseResult:
    """Build the case's pair (writing its checkpoint fixture first if needed) and check it."""
    try:
        if case.source == "config":
            pair = family.build_pair(config=case.config)
        else:
            source = family.build_pair(config=case.config, seed=1)
            directory = workdir / case.id.replace("/", "_")
            source.reference.save_pretrained(directory, **({"max_shard_size": "20KB"} if case.source.endswith("sharded") else {}))
            del source
            pair = family.build_pair(checkpoint=directory)
        result = check(pair)
    except ParityError as e:
        return CaseResult(case, None, [f"{type(e).__name__}: {e}"])
    problems = []
    if result.first_mismatch is not None:
        problems.append(result.first_mismatch.line() + (f" — hint: {result.first_mismatch.hint}" if result.first_mismatch.hint is not None else ""))
    if result.coverage is not None and not result.coverage.ok:
        problems += [f"loader coverage: {gap}" for gap in result.coverage.gaps]
    return CaseResult(case, result, problems)


def run_gate(
    baseline_path: str | Path = "parity-baseline.json",
    family_names: list[str] | None = None,
    update_baseline: bool = False,
    changed: list[str] | None = None,
    progress=None,
) -> GateOutcome:
    """Run the gate. ``family_names`` restricts it; ``changed`` (paths) picks families from a diff.

    With ``update_baseline`` the baseline is rewritten for the families run, and only if every case
    passes its checks (a failing state is never recorded as the budget). Raises ParityError for an
    unknown family or an unreadable baseline.
    """
    known = all_families()
    family_names = list(dict.fromkeys(family_names or [])) or None  # --family twice runs it once
    unknown = [f for f in family_names or [] if f not in known]
    if unknown:
        raise ParityError(f"unknown family {', '.join(unknown)}; known families: {', '.join(known)}")
    if changed is not None:
        names, selection = choose_families(changed, {k: v for k, v in known.items() if not family_names or k in family_names})
    else:
        names = sorted(family_names or known)
        selection = [f"families: {', '.join(names)}" + (" (all)" if not family_names else "")]
    baseline = read_baseline(baseline_path, missing_ok=update_baseline)
    version_notes = []
    recorded = baseline.get("versions") or {}
    for tool, now in versions().items():
        if recorded.get(tool) not in (None, now):
            version_notes.append(f"baseline recorded with {tool} {recorded[tool]}, running {now}: the reference may have changed")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bars would bury the summary
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="parity-gate-") as tmp:
        for case in plan(names, known):
            if progress is not None:
                progress(case)
            outcome = run_case(case, known[case.family], Path(tmp))
            if outcome.result is not None and not update_baseline:
                outcome.problems += baseline_problems(case, outcome.result, baseline)
            outcomes.append(outcome)
    holes = [h for name in names for h in config_holes(known[name])]
    gate = GateOutcome(outcomes, holes, selection, version_notes)
    if update_baseline and outcomes:
        if not gate.passed:
            failing = [c.case.id for c in outcomes if not c.passed] + holes
            raise ParityError(f"not updating the baseline: {len(failing)} case(s) fail ({'; '.join(failing[:3])})")
        write_baseline(baseline_path, baseline, outcomes)
        gate.baseline_updated = True
    return gate


# --- reports ------------------------------------------------------------------------------------------


def junit_xml(outcome: GateOutcome) -> str:
    """One test case per family/config/source; the failure message is the case's first problem."""
    import xml.etree.ElementTree as ET

    from .report.junit import xml_text

    suite = ET.Element("testsuite", name="parity-gate", tests=str(len(outcome.cases) + len(outcome.config_holes)))
    failures = 0
    for c in outcome.cases:
        case = ET.SubElement(suite, "testcase", classname=f"parity.gate.{c.case.family}", name=f"{c.case.config}/{c.case.source}",
                             time=str((c.result.meta.get("seconds", 0) if c.result else 0)))
        if not c.passed:
            failures += 1
            failure = ET.SubElement(case, "failure", message=xml_text(c.problems[0]), type="parity")
            failure.text = xml_text("\n".join(c.problems))
    for hole in outcome.config_holes:
        failures += 1
        case = ET.SubElement(suite, "testcase", classname="parity.gate.config_coverage", name=hole.split(":")[0])
        ET.SubElement(case, "failure", message=xml_text(hole), type="config-coverage").text = xml_text(hole)
    suite.set("failures", str(failures))
    tree = ET.ElementTree(suite)
    ET.indent(tree)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def write_reports(outcome: GateOutcome, parent: str | Path) -> Path:
    """``<parent>/gate-<time>/``: junit.xml, summary.json and one report.html per checked case."""
    import shutil

    from .report.atomic import atomic_write, publish_folder, run_stem, staging_folder

    parent = Path(parent)
    staging = staging_folder(parent)
    try:
        atomic_write(staging / "junit.xml", junit_xml(outcome))
        summary = {
            "passed": outcome.passed,
            "selection": outcome.selection,
            "config_holes": outcome.config_holes,
            "version_notes": outcome.version_notes,
            "cases": [{"case": c.case.id, "passed": c.passed, "problems": c.problems} for c in outcome.cases],
        }
        atomic_write(staging / "summary.json", json.dumps(summary, indent=2) + "\n")
        for c in outcome.cases:
            if c.result is not None:
                c.result.write_html(staging / f"{c.case.id.replace('/', '__')}.html")
        return publish_folder(staging, parent, run_stem("gate", "all").replace("gate-all", "gate"))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
