"""`parity gate`: loader regressions fail with the right message in every source and dtype; the
budget means something (float32 and bfloat16, a family with real bf16 error); the baseline changes
only when asked; families are chosen from changed paths; output stays short.

The gate over every family against the committed baseline is not here: it runs as the tests of
parity/pytest_gate.py in every plain `pytest` run of this repository (pyproject.toml sets
parity_gate = true).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import reference_pairs.llama3 as llama3
import reference_pairs.llama3.loader as llama3_loader
import reference_pairs.olmo3 as olmo3
import reference_pairs.olmo3.loader as olmo3_loader
from parity.cli import main
from parity.gate.baseline import BUDGET, read_baseline, write_baseline
from parity.gate.project import Project, choose_families
from parity.gate.run import DTYPES, SOURCES, GateRun
from parity.model.registry import families
from reference_pairs.common import norms as layers

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "parity-baseline.json"
#: gate cases of the llama3 family (every CI config, from every source, in every dtype)
LLAMA3_CASES = len(llama3.FAMILY.ci_configs) * len(SOURCES) * len(DTYPES)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def baseline(tmp_path):
    """A copy of the committed baseline, so a test can never rewrite the real one."""
    copy = tmp_path / "parity-baseline.json"
    shutil.copy(BASELINE, copy)
    return copy


def gate(baseline, family, config="tiny", sources=SOURCES, dtypes=DTYPES, update=False):
    """Run and judge the cases of one CI config of ``family`` (what each gate test does)."""
    run = GateRun.prepare(ROOT, baseline, [family], update=update)
    try:
        return [run.evaluate(c) for c in run.cases if c.config == config and c.source in sources and c.dtype in dtypes]
    finally:
        run.close()


def test_the_committed_baseline_covers_every_case_with_both_dtypes():
    data = read_baseline(BASELINE)
    run = GateRun.prepare(ROOT, BASELINE)
    assert {c.id for c in run.cases} == set(data["cases"])
    assert {c.dtype for c in run.cases} == {"float32", "bfloat16"}
    assert {c.source for c in run.cases} == set(SOURCES)
    assert {c.family for c in run.cases} == set(families())


def test_loader_dropping_a_key_fails(baseline, replace_table):
    template = {k: v for k, v in olmo3_loader.WEIGHT_MAP.items() if "k_norm" not in k}
    replace_table(olmo3_loader.WEIGHT_MAP, template)
    outcomes = gate(baseline, "olmo3")
    assert len(outcomes) == 6 and all(not c.passed for c in outcomes)
    msg = outcomes[0].problems[0]
    assert "LoaderError" in msg and "unused checkpoint keys: model.layers.0.self_attn.k_norm.weight" in msg
    assert "never written: blocks.0.att.k_norm.weight" in msg


def test_loader_swapping_two_same_shaped_tensors_fails(baseline, replace_table):
    template = dict(olmo3_loader.WEIGHT_MAP)
    template["model.layers.{i}.self_attn.v_proj.weight"], template["model.layers.{i}.self_attn.k_proj.weight"] = (
        template["model.layers.{i}.self_attn.k_proj.weight"],
        template["model.layers.{i}.self_attn.v_proj.weight"],
    )
    replace_table(olmo3_loader.WEIGHT_MAP, template)
    outcomes = gate(baseline, "olmo3")
    assert len(outcomes) == 6 and all(not c.passed for c in outcomes)
    for outcome in outcomes:  # float32 by the default tolerance, bfloat16 by the calibrated one
        assert outcome.problems[0].startswith("model.layers.0.self_attn.k_proj: mismatch"), outcome.case.id
    assert "ours matches the reference's model.layers.0.self_attn.v_proj" in outcomes[0].problems[0]


def test_loader_copying_the_tied_head_fails_on_coverage(baseline, monkeypatch):
    from torch import nn

    real = llama3_loader.load_weights_into_llama3

    def copying(model, cfg, state_dict):
        loaded = real(model, cfg, state_dict)
        model.out_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone(), requires_grad=False)
        return loaded

    monkeypatch.setattr("reference_pairs.llama3.FAMILY", dataclasses.replace(llama3.FAMILY, load=copying))
    outcomes = gate(baseline, "llama3")
    assert all(not c.passed for c in outcomes)
    gaps = outcomes[0].problems
    assert "loader coverage: model.embed_tokens.weight consumed 2 times: tok_emb.weight, out_head.weight" in gaps
    assert any(
        "tied weights lm_head.weight and model.embed_tokens.weight are not the same Parameter" in g for g in gaps
    )


def test_loader_transposing_a_square_matrix_fails(baseline, monkeypatch):
    real = olmo3_loader.load_weights_into_olmo3

    def transposing(model, cfg, state_dict):
        sd = dict(state_dict)
        sd["model.layers.1.self_attn.o_proj.weight"] = sd["model.layers.1.self_attn.o_proj.weight"].T
        return real(model, cfg, sd)

    monkeypatch.setattr("reference_pairs.olmo3.FAMILY", dataclasses.replace(olmo3.FAMILY, load=transposing))
    outcomes = gate(baseline, "olmo3")
    assert all(not c.passed for c in outcomes)
    for outcome in outcomes:
        assert outcome.problems[0].startswith("model.layers.1.self_attn.o_proj: mismatch"), outcome.case.id
    conversions = outcomes[0].result.coverage.conversions
    assert "model.layers.1.self_attn.o_proj.weight: transposed into blocks.1.att.out_proj.weight" in conversions


def test_an_unrelated_loader_change_passes(baseline, replace_table):
    """Reordering the weight map changes the code, not the result."""
    replace_table(olmo3_loader.WEIGHT_MAP, dict(reversed(list(olmo3_loader.WEIGHT_MAP.items()))))
    before = digest(baseline)
    assert all(c.passed for c in gate(baseline, "olmo3"))
    assert digest(baseline) == before


def test_error_growing_past_its_budget_fails_though_within_tolerance(baseline, monkeypatch):
    """A wrong norm eps stays inside the float32 atol/rtol, but our pairs are bit-exact: it fails at
    its node and takes float32 nodes past the 1e-6 floor of a bit-exact baseline."""
    from reference_pairs.olmo3 import model as olmo3_model

    real_block = olmo3_model.transformer_block

    def looser_eps(cfg, layer_type):
        block = real_block(cfg, layer_type)
        block.post_feedforward_layernorm.eps = 3e-6  # reference: 1e-6
        return block

    monkeypatch.setattr(olmo3_model, "transformer_block", looser_eps)
    outcomes = {c.case.dtype: c for c in gate(baseline, "olmo3", sources=("config",))}
    fp32 = outcomes["float32"]
    bad = fp32.result.first_mismatch
    assert bad.name == "model.layers.0.post_feedforward_layernorm" and bad.tol_source == "exact"
    assert bad.max_abs < 1e-4  # within the float32 defaults: only exactness and the budget see it
    assert fp32.excess and fp32.excess[0].limit == 1e-6 and fp32.excess[0].before == 0.0


def _cast_first(self, x):
    """RMSNorm that casts to the activation dtype before the weight (Llama's order): a user's
    family whose bf16 error against OLMo 3's reference is real, not zero."""
    x32 = x.float()
    return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)


def _cast_first_div(self, x):
    """The same formula through 1/sqrt instead of rsqrt: moves roundings, not the error level."""
    x32 = x.float()
    return self.weight * (x32 / torch.sqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)


def _in_bf16(self, x):
    """The norm computed in bf16 throughout: a real regression in bf16 accuracy."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps))


def test_budget_for_a_family_with_real_bf16_error(tmp_path, monkeypatch):
    """bf16 cases are checked against calibrated tolerances, so a family with real bf16 error passes;
    its baseline then holds that error, a change that only moves roundings stays within budget, and a
    regression that the calibrated tolerance would let through does not."""
    path = tmp_path / "baseline.json"
    monkeypatch.setattr(layers.RMSNorm, "forward", _cast_first)
    (recorded,) = gate(path, "olmo3", sources=("config",), dtypes=("bfloat16",), update=True)
    assert (
        recorded.passed and max(n.mean_abs for n in recorded.result.nodes) > 1e-3
    )  # real error, calibrated check passes
    write_baseline(path, {}, [recorded], ["olmo3"])

    monkeypatch.setattr(layers.RMSNorm, "forward", _cast_first_div)
    (benign,) = gate(path, "olmo3", sources=("config",), dtypes=("bfloat16",))
    assert benign.passed, benign.lines()

    monkeypatch.setattr(layers.RMSNorm, "forward", _in_bf16)
    (worse,) = gate(path, "olmo3", sources=("config",), dtypes=("bfloat16",))
    assert worse.result.first_mismatch is None and not worse.problems
    assert worse.excess and {e.stat for e in worse.excess} == {"mean_abs"}


def test_budget_rule_numbers():
    assert BUDGET.floor("float32") == 1e-6 and BUDGET.floor("bfloat16") == 5e-4
    assert BUDGET.limit("max_abs", 0.01, "bfloat16") == 0.04 and BUDGET.limit("mean_abs", 0.01, "bfloat16") == 0.02
    assert BUDGET.limit("max_abs", 1e-8, "float32") == 1e-6
    assert read_baseline(BASELINE)["budget"] == BUDGET.describe()


@pytest.mark.slow  # a subprocess run of pytest/git (10-30 s): in .ci/run's `pytest -m slow`
def test_baseline_changes_only_when_asked(baseline, capsys):
    data = json.loads(baseline.read_text())
    data["cases"]["llama3/tiny/config/float32"]["nodes"]["lm_head"] = {"max_abs": 123.0, "mean_abs": 1.0}  # stale
    baseline.write_text(json.dumps(data))
    before = digest(baseline)
    assert main(["gate", "--family", "llama3", "--baseline", str(baseline), "--no-reports"]) == 0
    assert digest(baseline) == before
    assert main(["gate", "--family", "llama3", "--baseline", str(baseline), "--no-reports", "--update-baseline"]) == 0
    rewritten = read_baseline(baseline)
    assert rewritten["cases"]["llama3/tiny/config/float32"]["nodes"]["lm_head"] == {"max_abs": 0.0, "mean_abs": 0.0}
    assert rewritten["cases"]["olmo3/tiny/config/float32"] == data["cases"]["olmo3/tiny/config/float32"]  # others kept
    assert "baseline written" in capsys.readouterr().out


def test_update_refuses_to_record_a_failing_state(baseline, capsys, replace_table):
    template = {k: v for k, v in llama3_loader.WEIGHT_MAP.items() if "k_proj" not in k}
    replace_table(llama3_loader.WEIGHT_MAP, template)
    before = digest(baseline)
    assert main(["gate", "--family", "llama3", "--baseline", str(baseline), "--update-baseline", "--no-reports"]) == 2
    assert f"not updating the baseline: {LLAMA3_CASES} case(s) fail" in capsys.readouterr().err
    assert digest(baseline) == before


def test_missing_baseline_entry_fails(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"version": 2, "cases": {}}))
    (outcome,) = gate(empty, "llama3", sources=("config",), dtypes=("float32",))
    assert not outcome.passed and outcome.problems[0].startswith(
        "no baseline for llama3/tiny/config/float32 in empty.json"
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist: create it with `parity gate --update-baseline --baseline"),
        (
            "[]",
            "holds an array, not the JSON object a parity baseline is: rewrite it with `parity gate --update-baseline",
        ),
        ('{"version": 1, "cases": {}}', "has version 1; this parity reads version 2: rewrite it with"),
        ("{not json", "is not valid JSON"),
        ('{"version": 2}', 'has no "cases" object'),
        (
            '{"version": 2, "cases": {"a/b/c/d": {"nodes": {"lm_head": {"max_abs": -1, "mean_abs": 0}}}}}',
            "node lm_head has max_abs -1",
        ),
        ('{"version": 2, "cases": {"a/b/c/d": {"nodes": {"lm_head": 0.0}}}}', "node lm_head has max_abs None"),
    ],
)
def test_bad_baseline_is_bad_input(tmp_path, capsys, content, message):
    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    assert main(["gate", "--family", "llama3", "--baseline", str(path), "--no-reports"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_changed_paths_choose_families_and_say_why():
    project = Project.load(ROOT)
    shared = project.shared(BASELINE)
    assert choose_families(["reference_pairs/olmo3/loader.py", "README.md"], project.folders, shared) == (
        ["olmo3"],
        ["olmo3: reference_pairs/olmo3/loader.py changed"],
    )
    # llama2 and mistral are data on the llama3 family's model and loader: its folder runs all three
    chosen, why = choose_families(["reference_pairs/llama3/loader.py"], project.folders, shared)
    assert chosen == ["llama2", "llama3", "mistral"] and "llama3: reference_pairs/llama3/loader.py changed" in why
    assert choose_families(["reference_pairs/mistral/faults.py"], project.folders, shared)[0] == ["mistral"]
    chosen, why = choose_families(["parity/compare.py"], project.folders, shared)
    assert chosen == sorted(project.folders) and "shared code changed (parity/compare.py)" in why[0]
    assert {"llama3", "olmo3", "tiny_aya"} <= set(chosen)
    assert choose_families(["reference_pairs/common/rope.py"], project.folders, shared)[0] == chosen
    assert choose_families(["parity-baseline.json"], project.folders, shared)[0] == chosen
    assert choose_families(["docs/x.md"], project.folders, shared) == (
        [],
        ["no family or shared file changed (1 other path(s))"],
    )


def test_paths_on_the_command_line_pick_families(capsys):
    """What the pre-commit hook passes: the files being committed."""
    assert main(["gate", "README.md", "docs/notes.md"]) == 0
    out = capsys.readouterr().out
    assert "no family or shared file changed (2 other path(s))" in out and "gate: nothing to check" in out
    assert main(["gate", "README.md", "--changed-since", "HEAD"]) == 2
    assert "give changed PATHs or --changed-since, not both" in capsys.readouterr().err


def test_no_reports_with_a_report_dir_is_refused_before_anything_runs(capsys, tmp_path):
    assert main(["gate", "--no-reports", "--report-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "parity: error: --no-reports writes no report folder: drop --report-dir, or drop --no-reports"
    assert not (tmp_path / "r").exists()


def test_changed_since_a_missing_ref_is_one_line_in_cli_words(capsys):
    assert main(["gate", "--changed-since", "no-such-ref-xyz", "--no-reports"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "parity: error: --changed-since no-such-ref-xyz: no such commit in this repository (a branch, tag "
        "or commit; in CI fetch the history, e.g. actions/checkout with fetch-depth: 0)"
    )


@pytest.mark.slow  # a subprocess run of pytest/git (10-30 s): in .ci/run's `pytest -m slow`
def test_gate_reports_junit_from_pytest_and_one_line_per_failing_case(tmp_path, capsys, monkeypatch):
    """A loader fault in llama3: junit.xml is pytest's (one test case per case, one per family's config
    coverage), summary.json holds every problem, an HTML report per failing case, and the console
    says each failing case in one or two lines (not one line per node)."""
    template = dict(llama3_loader.WEIGHT_MAP)
    gate_key, up_key = "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"
    template[gate_key], template[up_key] = template[up_key], template[gate_key]
    for key, value in template.items():
        monkeypatch.setitem(llama3_loader.WEIGHT_MAP, key, value)
    capsys.readouterr()
    assert main(["gate", "--family", "llama3", "--report-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    failing = [line for line in out.splitlines() if line.startswith("llama3/tiny")]
    n = LLAMA3_CASES
    assert len(failing) == n and all("model.layers.0.mlp.gate_proj: mismatch" in line for line in failing), out
    assert f"gate: 0 of {n} cases pass, {n} failure(s)" in out
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("gate-") and f"reports: {folder}" in out
    junit = (folder / "junit.xml").read_text()
    assert 'name="parity-gate"' in junit and junit.count("<testcase") == n + 1 and f'failures="{n}"' in junit
    assert 'name="test_gate[llama3/tiny/checkpoint-sharded/bfloat16]"' in junit
    assert 'name="test_config_coverage[llama3]"' in junit
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["passed"] is False and len(summary["cases"]) == n
    assert all(c["report"].endswith(".html") and (folder / c["report"]).is_file() for c in summary["cases"])
    assert len(list(folder.glob("*.html"))) == n


def test_budget_summary_is_one_line_per_case_and_the_report_has_every_node(tmp_path, capsys, monkeypatch):
    from reference_pairs.olmo3 import model as olmo3_model

    real_block = olmo3_model.transformer_block

    def looser_eps(cfg, layer_type):
        block = real_block(cfg, layer_type)
        block.post_feedforward_layernorm.eps = 3e-6
        return block

    monkeypatch.setattr(olmo3_model, "transformer_block", looser_eps)
    run = GateRun.prepare(ROOT, BASELINE, ["olmo3"])
    try:
        outcome = run.evaluate(next(c for c in run.cases if c.id == "olmo3/tiny/config/float32"))
    finally:
        run.close()
    nodes = {e.node for e in outcome.excess}
    assert len(nodes) > 10  # many nodes moved...
    (line,) = outcome.summary()  # ...one line says so
    # the pair is bit-exact, so the line leads with the first mismatch and counts the rest
    assert line.startswith("model.layers.0.post_feedforward_layernorm: mismatch")
    assert line.endswith(f"[+{len(nodes)} node(s) past their budget]")
    # the full list (the mismatch, then every excess) goes to the report
    assert (
        len(outcome.lines()) == 1 + len(outcome.excess)
        and outcome.to_dict()["over_budget"][0]["node"] == outcome.excess[0].node
    )


def test_config_coverage_hole_fails_the_gate(baseline, monkeypatch):
    """If the CI configs stopped exercising YaRN, the gate must say so (the YaRN bug that once slipped)."""
    monkeypatch.setattr("reference_pairs.olmo3.FAMILY", dataclasses.replace(olmo3.FAMILY, ci_configs=("tiny", "mha")))
    run = GateRun.prepare(ROOT, baseline, ["olmo3"])
    assert run.config_holes("olmo3") == [
        "olmo3: 7b-shape uses yarn RoPE on full_attention, which no CI config (tiny, mha) exercises",
        "olmo3: 32b-shape uses yarn RoPE on full_attention, which no CI config (tiny, mha) exercises",
    ]
    assert not run.passed


def test_pytest_options_run_and_update_the_gate(tmp_path, capsys, monkeypatch):
    """`pytest --parity-gate ...` is the gate: its cases are the session's tests, and
    --parity-gate-update-baseline writes the baseline at the end of a passing session."""
    from parity.gate.run import gate_module_path

    monkeypatch.setenv("PYTEST_ADDOPTS", "-x")  # a CI's own options reach a plain pytest run
    path = tmp_path / "b.json"
    argv = [
        str(gate_module_path()),
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pyproject.toml"),
        "-p",
        "no:cacheprovider",
        "--parity-no-reports",
        "--parity-gate",
        "--parity-gate-family",
        "llama3",
        "--parity-gate-baseline",
        str(path),
    ]
    assert pytest.main([*argv, "--parity-gate-update-baseline"]) == pytest.ExitCode.OK
    out = capsys.readouterr().out
    assert f"{LLAMA3_CASES + 1} passed" in out and f"parity gate: baseline written: {path}" in out
    assert sorted(read_baseline(path)["cases"]) == sorted(
        c for c in read_baseline(BASELINE)["cases"] if c.startswith("llama3/")
    )
    path.write_text(path.read_text().replace('"max_abs": 0.0', '"max_abs": -1.0', 1))
    assert pytest.main(argv) == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: parity gate: baseline" in capsys.readouterr().err


def test_parity_gate_ignores_pytest_addopts(monkeypatch, capsys):
    monkeypatch.setenv("PYTEST_ADDOPTS", "-q --no-such-option")
    assert main(["gate", "reference_pairs/tiny_aya/configs.py", "--no-reports"]) == 0
    assert "gate: 6 of 6 cases pass" in capsys.readouterr().out


def test_paths_from_a_subfolder_are_the_projects(monkeypatch, capsys):
    monkeypatch.chdir(ROOT / "reference_pairs")
    run = GateRun.prepare(".", changed=["olmo3/loader.py"])
    assert run.project.root == ROOT and run.names == ["olmo3"]
    assert run.selection == ["olmo3: reference_pairs/olmo3/loader.py changed"]


@pytest.mark.parametrize(
    "table, message",
    [
        (
            "[tool.parity]\nbaselin = 'x.json'\n",
            "unknown [tool.parity] setting(s) baselin; known: baseline, pythonpath, shared",
        ),
        ("[tool.parity]\nshared = 'src/common'\n", "[tool.parity] shared must be a list of paths, got 'src/common'"),
        ("[tool.parity\n", "pyproject.toml cannot be read"),
    ],
)
def test_bad_tool_parity_settings_are_one_line(tmp_path, monkeypatch, capsys, table, message):
    (tmp_path / "pyproject.toml").write_text(table)
    monkeypatch.chdir(tmp_path)
    assert main(["gate", "--no-reports"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
