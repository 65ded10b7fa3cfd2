"""What comparing another runtime needs beyond names: nodes a runtime cannot produce, per-node
tolerances, padding left out of judgement, a warning for tolerances too loose to see a bug, float16
traces, `parity trace show`, and the family a checkpoint is recorded as. The dumps here are the
trace's own tensors (a perfect runtime), changed where a test says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from parity import golden
from parity.cli import main
from parity.golden.dumps import write_dump_info


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("t") / "trace"
    golden.record("llama3:tiny", path, calibrate=True, save_weights=True)
    return path


def perfect(trace: Path, out: Path, drop=(), change=None) -> Path:
    """The trace's own tensors as a dump, without ``drop``; ``change(name, tensor)`` may edit one."""
    tensors = golden.read_trace(trace).reference_trace().tensors
    out.mkdir()
    kept = {}
    for name in tensors:
        if name in drop:
            continue
        t = tensors[name].clone()
        kept[name] = change(name, t) if change else t
    save_file(kept, out / "dump.safetensors")
    return out


def test_nodes_a_runtime_cannot_produce_are_untapped_not_failures(trace, tmp_path, capsys):
    fused = [n for n in golden.read_trace(trace).names if n.endswith((".scores", ".probs"))]
    dump = perfect(trace, tmp_path / "dump", drop=fused)
    missing = golden.compare_dump(trace, dump)
    assert not missing.passed and missing.first_mismatch.status == "missing"
    write_dump_info(
        dump, runtime="fused 1.0", unavailable={"*.scores": "fused attention", "*.probs": "fused attention"}
    )
    result = golden.compare_dump(trace, dump)
    assert result.passed and result.counts == {"ok": 32, "untapped": 4}
    assert result.verdict() == "PASS: all 32 nodes agree within tolerance (4 of 36 reference nodes untapped)"
    probs = next(n for n in result.nodes if n.name == "model.layers.0.self_attn.probs")
    assert probs.detail == "the runtime does not produce it: fused attention"
    assert "4 node(s) the runtime does not produce are untapped, not judged (4: fused attention)" in result.notes
    # a name map can say it too, for a runtime whose dump one does not control
    (dump / "parity-dump.json").unlink()
    name_map = tmp_path / "map.json"
    name_map.write_text(json.dumps({"@unavailable": {"model.layers.*.self_attn.[sp]*": "flash attention"}}))
    assert (
        main(["compare", str(trace), "--dump", str(dump), "--name-map", str(name_map), "--report-dir", str(tmp_path)])
        == 0
    )
    assert "(4 of 36 reference nodes untapped)" in " ".join(capsys.readouterr().out.split())


def test_per_node_tolerances_on_the_command_line(trace, tmp_path, capsys):
    def off(name, t):
        return t + 1e-3 if name.endswith("self_attn.scores") else t

    dump = perfect(trace, tmp_path / "dump", change=off)
    args = ["compare", str(trace), "--dump", str(dump), "--report-dir", str(tmp_path)]
    assert main(args) == 1
    capsys.readouterr()
    assert main([*args, "--tolerance", "*.self_attn.scores=2e-3,0"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main([*args, "--tolerance", "scores=1e-3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--tolerance 'scores=1e-3' must be PATTERN=ATOL,RTOL" in err


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("p") / "trace"
    golden.record("llama3:tiny", path, calibrate=True, batch_size=2, left_pad=5)
    return path


def test_padding_is_not_judged_where_the_trace_holds_a_mask(padded, tmp_path, capsys):
    mask = golden.read_trace(padded).inputs()["attention_mask"]
    assert int((mask == 0).sum()) == 5

    def garbage_at_padding(name, t):  # a runtime that never computed the padding positions
        kind_axis = 2 if name.endswith((".q_rot", ".k_rot", ".scores", ".probs")) else 1
        if t.dim() > kind_axis and t.shape[kind_axis] == mask.shape[1]:
            t.narrow(0, 0, 1).narrow(kind_axis, 0, 5).fill_(7.0)
        return t

    dump = perfect(padded, tmp_path / "dump", change=garbage_at_padding)
    result = golden.compare_dump(padded, dump)
    assert result.passed, result.verdict()
    assert any(
        n.startswith("padding: 5 of 32 token positions are padding (row 0: 5) and were not judged")
        for n in result.notes
    )
    assert not golden.compare_dump(padded, dump, ignore_padding=False).passed
    args = ["compare", str(padded), "--dump", str(dump), "--report-dir", str(tmp_path)]
    assert main([*args, "--judge-padding"]) == 1
    capsys.readouterr()


def test_ignore_padding_on_a_trace_without_padding_is_refused(trace, tmp_path, capsys):
    dump = perfect(trace, tmp_path / "dump")
    assert main(["compare", str(trace), "--dump", str(dump), "--ignore-padding", "--report-dir", str(tmp_path)]) == 2
    assert "the trace holds no padding" in capsys.readouterr().err


def test_calibrated_bfloat16_tolerances_too_loose_to_see_a_bug_are_said(tmp_path):
    bf16 = tmp_path / "bf16"
    golden.record("llama3:tiny", bf16, dtype=torch.bfloat16, calibrate=True)
    result = golden.compare_dump(bf16, perfect(bf16, tmp_path / "dump"))
    loose = [n for n in result.notes if n.startswith("loose tolerances:")]
    assert result.passed and len(loose) == 1
    assert "of their RMS" in loose[0] and "record a float32 trace" in loose[0]


def test_a_float32_trace_has_no_loose_tolerance_note(trace, tmp_path):
    result = golden.compare_dump(trace, perfect(trace, tmp_path / "dump"))
    assert result.passed and not [n for n in result.notes if n.startswith("loose tolerances:")]


def test_record_float16_and_compare_it(tmp_path, capsys):
    out = tmp_path / "f16"
    assert main(["record", "llama3:tiny", "--out", str(out), "--dtype", "float16", "--calibrate"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["probe"]["dtype"] == "float16" and {n["dtype"] for n in manifest["nodes"]} == {"float16"}
    assert golden.compare_dump(out, perfect(out, tmp_path / "dump")).passed


def test_trace_show_lists_what_a_dump_must_match(trace, capsys):
    assert main(["trace", "show", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "(batch, heads, seq, head_dim)" in out and "(batch, kv_heads, seq, head_dim)" in out
    assert "input_ids (1, 16) int64" in out and "calibrated per node" in out
    assert main(["trace", "show", str(trace), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    nodes = {n["name"]: n for n in shown["nodes"]}
    assert nodes["model.layers.0.self_attn.k_proj"]["layout"] == "(batch, seq, kv_heads*head_dim)"
    assert nodes["model.layers.0.self_attn.scores"]["layout"] == "(batch, heads, seq, seq)"
    assert nodes["lm_head"]["layout"] == "(batch, seq, vocab)" and nodes["lm_head"]["dtype"] == "float32"


def test_a_llama_3_2_checkpoint_is_recorded_as_llama3(trace, tmp_path):
    """Llama 2 and Llama 3 share model_type llama; the config's named choices (llama3 RoPE) decide."""
    recorded = golden.record(trace / "weights", tmp_path / "again")
    assert recorded.manifest["reference"]["family"] == "llama3"
