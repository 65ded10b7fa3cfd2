"""`parity gate`: the committed baseline passes; loader regressions fail with the right message;
the baseline changes only when asked."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

import reference_pairs.llama3 as llama3
import reference_pairs.llama3.loader as llama3_loader
import reference_pairs.olmo3 as olmo3
import reference_pairs.olmo3.loader as olmo3_loader
from parity.cli import main
from parity.gate import choose_families, run_gate
from parity.registry import families

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "parity-baseline.json"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def baseline(tmp_path):
    """A copy of the committed baseline, so a test can never rewrite the real one."""
    copy = tmp_path / "parity-baseline.json"
    shutil.copy(BASELINE, copy)
    return copy


def problems(outcome) -> list[str]:
    return [f"{c.case.id}: {p}" for c in outcome.cases for p in c.problems]


def test_committed_baseline_passes_for_every_family():
    before = digest(BASELINE)
    outcome = run_gate(BASELINE)
    assert outcome.passed, problems(outcome)
    assert {c.case.family for c in outcome.cases} == set(families())
    assert {c.case.source for c in outcome.cases} == {"config", "checkpoint", "checkpoint-sharded"}
    assert digest(BASELINE) == before


def test_loader_dropping_a_key_fails(baseline, monkeypatch, replace_table):
    template = {k: v for k, v in olmo3_loader.WEIGHT_MAP.items() if "k_norm" not in k}
    replace_table(olmo3_loader.WEIGHT_MAP, template)
    outcome = run_gate(baseline, ["olmo3"])
    assert not outcome.passed
    assert all(not c.passed for c in outcome.cases)
    msg = outcome.cases[0].problems[0]
    assert "LoaderError" in msg and "unused checkpoint keys: model.layers.0.self_attn.k_norm.weight" in msg
    assert "never written: blocks.0.att.k_norm.weight" in msg


def test_loader_swapping_two_same_shaped_tensors_fails(baseline, monkeypatch, replace_table):
    template = dict(olmo3_loader.WEIGHT_MAP)
    q, k = "model.layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"
    template["model.layers.{i}.self_attn.v_proj.weight"], template["model.layers.{i}.self_attn.k_proj.weight"] = (
        template["model.layers.{i}.self_attn.k_proj.weight"], template["model.layers.{i}.self_attn.v_proj.weight"]
    )
    assert q in template and k in template
    replace_table(olmo3_loader.WEIGHT_MAP, template)
    outcome = run_gate(baseline, ["olmo3"])
    assert all(not c.passed for c in outcome.cases)
    msg = outcome.cases[0].problems[0]
    assert msg.startswith("model.layers.0.self_attn.k_proj: mismatch")
    assert "ours matches the reference's model.layers.0.self_attn.v_proj" in msg


def test_loader_copying_the_tied_head_fails_on_coverage(baseline, monkeypatch):
    from torch import nn

    real = llama3_loader.load_weights_into_llama3

    def copying(model, cfg, state_dict):
        loaded = real(model, cfg, state_dict)
        model.out_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone(), requires_grad=False)
        return loaded

    monkeypatch.setattr("reference_pairs.llama3.FAMILY", dataclasses.replace(llama3.FAMILY, load=copying))
    outcome = run_gate(baseline, ["llama3"])
    assert all(not c.passed for c in outcome.cases)
    gaps = outcome.cases[0].problems
    assert "loader coverage: model.embed_tokens.weight consumed 2 times: tok_emb.weight, out_head.weight" in gaps
    assert any("tied weights lm_head.weight and model.embed_tokens.weight are not the same Parameter" in g for g in gaps)


def test_loader_transposing_a_square_matrix_fails(baseline, monkeypatch):
    real = olmo3_loader.load_weights_into_olmo3

    def transposing(model, cfg, state_dict):
        sd = dict(state_dict)
        sd["model.layers.1.self_attn.o_proj.weight"] = sd["model.layers.1.self_attn.o_proj.weight"].T
        return real(model, cfg, sd)

    monkeypatch.setattr("reference_pairs.olmo3.FAMILY", dataclasses.replace(olmo3.FAMILY, load=transposing))
    outcome = run_gate(baseline, ["olmo3"])
    assert all(not c.passed for c in outcome.cases)
    case = outcome.cases[0]
    assert case.problems[0].startswith("model.layers.1.self_attn.o_proj: mismatch")
    assert "model.layers.1.self_attn.o_proj.weight: transposed into blocks.1.att.out_proj.weight" in case.result.coverage.conversions


def test_an_unrelated_loader_change_passes(baseline, monkeypatch, replace_table):
    """Reordering the weight map changes the code, not the result."""
    replace_table(olmo3_loader.WEIGHT_MAP, dict(reversed(list(olmo3_loader.WEIGHT_MAP.items()))))
    before = digest(baseline)
    assert run_gate(baseline, ["olmo3"]).passed
    assert digest(baseline) == before


def test_error_growing_past_its_budget_fails_the_gate(baseline, monkeypatch):
    """A change too small for the float32 tolerances: our pairs are bit-exact, so it fails the gate
    at its node, and every later node also grew past its budget."""
    from reference_pairs.olmo3 import model as olmo3_model

    real_block = olmo3_model.transformer_block

    def looser_eps(cfg, layer_type):
        block = real_block(cfg, layer_type)
        block.post_feedforward_layernorm.eps = 3e-6  # reference: 1e-6
        return block

    monkeypatch.setattr(olmo3_model, "transformer_block", looser_eps)
    outcome = run_gate(baseline, ["olmo3"])
    case = outcome.cases[0]
    bad = case.result.first_mismatch
    assert bad.name == "model.layers.0.post_feedforward_layernorm" and bad.tol_source == "exact"
    assert bad.max_abs < 1e-4  # within the float32 defaults: only exactness sees it
    assert any("grew past its budget" in p for p in case.problems)


def test_baseline_changes_only_when_asked(baseline, capsys):
    data = json.loads(baseline.read_text())
    data["cases"]["olmo3/tiny/config"]["nodes"]["lm_head"] = 123.0  # a stale entry
    baseline.write_text(json.dumps(data))
    before = digest(baseline)
    assert main(["gate", "--family", "olmo3", "--baseline", str(baseline), "--no-reports"]) == 0
    assert digest(baseline) == before
    assert main(["gate", "--family", "olmo3", "--baseline", str(baseline), "--no-reports", "--update-baseline"]) == 0
    assert json.loads(baseline.read_text())["cases"]["olmo3/tiny/config"]["nodes"]["lm_head"] == 0.0
    assert "baseline written" in capsys.readouterr().out


def test_update_refuses_to_record_a_failing_state(baseline, monkeypatch, capsys, replace_table):
    template = {k: v for k, v in olmo3_loader.WEIGHT_MAP.items() if "k_norm" not in k}
    replace_table(olmo3_loader.WEIGHT_MAP, template)
    before = digest(baseline)
    assert main(["gate", "--family", "olmo3", "--baseline", str(baseline), "--update-baseline"]) == 2
    assert "not updating the baseline" in capsys.readouterr().err
    assert digest(baseline) == before


def test_missing_baseline_entry_fails(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"version": 1, "cases": {}}))
    outcome = run_gate(empty, ["llama3"])
    assert not outcome.passed and "no baseline for llama3/tiny/config" in outcome.cases[0].problems[0]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("[]", "has version 'list'"),
        ('{"version": 1}', 'has no "cases" object'),
        ('{"version": 1, "cases": {"a/b/c": {"nodes": {"lm_head": -1}}}}', "node lm_head has -1"),
        ('{"version": 1, "cases": {"a/b/c": {"nodes": {"lm_head": "abc"}}}}', "node lm_head has 'abc'"),
    ],
)
def test_bad_baseline_is_bad_input(tmp_path, capsys, content, message):
    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    assert main(["gate", "--family", "llama3", "--baseline", str(path), "--no-reports"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_changed_since_chooses_families_and_says_why():
    known = families()
    assert choose_families(["reference_pairs/llama3/loader.py", "README.md"], known) == (
        ["llama3"], ["llama3: reference_pairs/llama3/loader.py changed"]
    )
    chosen, why = choose_families(["parity/compare.py"], known)
    assert chosen == sorted(known) and "shared code changed (parity/compare.py)" in why[0]
    assert choose_families(["reference_pairs/common/rope.py"], known)[0] == sorted(known)
    assert choose_families(["docs/x.md"], known) == ([], ["no family or engine file changed (1 other paths)"])


def test_changed_since_on_the_command_line(tmp_path, capsys):
    assert main(["gate", "--changed-since", "no-such-ref-xyz", "--no-reports"]) == 2
    assert "no-such-ref-xyz" in capsys.readouterr().err


def test_gate_writes_junit_and_html_reports(tmp_path):
    assert main(["gate", "--family", "tiny_aya", "--report-dir", str(tmp_path)]) == 0
    (folder,) = tmp_path.iterdir()
    junit = (folder / "junit.xml").read_text()
    assert junit.count("<testcase") == 3 and 'failures="0"' in junit
    assert len(list(folder.glob("*.html"))) == 3
    assert json.loads((folder / "summary.json").read_text())["passed"] is True


def test_config_coverage_hole_fails_the_gate(baseline, monkeypatch):
    """If the CI configs stopped exercising YaRN, the gate must say so (the YaRN bug that once slipped)."""
    import dataclasses

    from parity import registry

    real = registry.families()
    olmo = dataclasses.replace(real["olmo3"], ci_configs=("tiny", "mha"))
    monkeypatch.setattr("parity.gate.all_families", lambda: {**real, "olmo3": olmo})
    outcome = run_gate(baseline, ["olmo3"])
    assert not outcome.passed
    assert outcome.config_holes == [
        "olmo3: 7b-shape uses yarn RoPE on full_attention, which no CI config (tiny, mha) exercises",
        "olmo3: 32b-shape uses yarn RoPE on full_attention, which no CI config (tiny, mha) exercises",
    ]
