"""Golden traces: `parity record` writes the reference once (a versioned format with a schema), and
`parity compare` judges another runtime's dump, or a live model, against it as `parity check` would.

The second runtime is tests/runtimes/numpy_llama.py, a NumPy forward of Llama written from the
formulas, fed the weights the trace saved; it must pass clean and its injected faults must be
located at the right node with a hint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from parity import golden as traces
from parity.cli import main
from parity.report.tables import result_schema

RUNTIMES = Path(__file__).parent / "runtimes"
NAME_MAP = RUNTIMES / "numpy_llama_names.json"
USER_MODELS = Path(__file__).parent / "user_models"


def _runtime():
    spec = importlib.util.spec_from_file_location("numpy_llama", RUNTIMES / "numpy_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


numpy_llama = _runtime()


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """llama3:tiny recorded with calibrated tolerances and its weights saved (for the NumPy runtime)."""
    out = tmp_path_factory.mktemp("golden") / "trace"
    assert main(["record", "llama3:tiny", "--out", str(out), "--calibrate", "--save-weights"]) == 0
    return out


def dump_of(trace: Path, out: Path, *extra: str) -> Path:
    """The NumPy runtime's dump of ``trace``'s inputs, with the weights the trace saved."""
    assert (
        numpy_llama.main(
            [
                "--weights",
                str(trace / "weights"),
                "--inputs",
                str(trace / "inputs.safetensors"),
                "--out",
                str(out),
                *extra,
            ]
        )
        == 0
    )
    return out


def compare(tmp_path, *args: str) -> int:
    return main(["compare", *args, "--report-dir", str(tmp_path / "reports")])


def only_report(tmp_path) -> Path:
    (folder,) = [p for p in (tmp_path / "reports").iterdir() if not p.name.startswith(".")]
    return folder


def rewrite_manifest(trace: Path, edit) -> None:
    manifest = json.loads((trace / "manifest.json").read_text())
    edit(manifest)
    (trace / "manifest.json").write_text(json.dumps(manifest))


# --- the format ----------------------------------------------------------------------------------------


def test_trace_is_versioned_schema_valid_and_readable_without_parity(golden):
    manifest = json.loads((golden / "manifest.json").read_text())
    jsonschema.validate(manifest, traces.trace_schema())
    assert (manifest["format"], manifest["version"], manifest["kind"]) == ("parity-trace", traces.VERSION, "tensors")
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["versions"]["transformers"].startswith("5.")
    assert manifest["reference"]["class"] == "LlamaForCausalLM" and manifest["tolerances"]["calibrated"] is True
    for entry in manifest["files"]:  # every file is what the manifest says it is
        assert hashlib.sha256((golden / entry["name"]).read_bytes()).hexdigest() == entry["sha256"]
    # plain safetensors and JSON: keys are node names, in the reference's execution order
    from safetensors.numpy import load_file

    tensors = {}
    for f in sorted(golden.glob("nodes-*.safetensors")):
        tensors.update(load_file(f))
    names = [n["name"] for n in manifest["nodes"]]
    assert names[0] == "model.embed_tokens" and names[-2:] == ["lm_head", "logits"]
    assert names.index("model.layers.0.self_attn.q_rot") < names.index("model.layers.0.self_attn.probs")
    # the node tensors, and what the hint detectors read beside them (module inputs and weights of
    # norms and projections: `parity compare` gives the hints `check` gives), each listed per node
    diagnosis = {f"{n['name']}::{part}" for n in manifest["nodes"] for part in n.get("diagnosis", ())}
    assert set(tensors) == set(names) | diagnosis
    assert "model.layers.0.input_layernorm::input" in diagnosis and "model.norm::weight" in diagnosis
    for n in manifest["nodes"]:
        assert list(tensors[n["name"]].shape) == n["shape"] and n["atol"] > 0 and n["tol_source"] == "calibrated"
    assert tensors["model.layers.0.self_attn.q_rot"].shape == (1, 4, 16, 16)  # (batch, heads, seq, head_dim)
    inputs = load_file(golden / "inputs.safetensors")
    assert inputs["input_ids"].shape == (1, 16) and (inputs["position_ids"] == np.arange(16)).all()
    assert json.loads((golden / "config.json").read_text())["model_type"] == "llama"


def test_trace_holds_what_parity_check_traces(golden):
    """The same nodes, the same bits, as the reference trace of `parity check llama3`."""
    from parity.run.plan import plan
    from parity.run.stages import trace_reference
    from reference_pairs.llama3 import build_pair

    pair = build_pair("tiny")
    expected = trace_reference(pair, plan(pair))
    stored = traces.read_trace(golden).reference_trace()
    assert stored.order == expected.order
    for name, tensor in expected.tensors.items():
        assert torch.equal(stored.tensors[name], tensor), name


def test_shards_are_cut_by_size_and_read_back(tmp_path):
    out = tmp_path / "sharded"
    assert main(["record", "llama3:tiny", "--out", str(out), "--shard-size", "20KB"]) == 0
    shards = sorted(p.name for p in out.glob("nodes-*.safetensors"))
    assert len(shards) > 3 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    manifest = json.loads((out / "manifest.json").read_text())
    assert {n["file"] for n in manifest["nodes"]} == set(shards)
    for shard in shards:  # at most 20 KB of tensor data, or one node alone
        held = [n for n in manifest["nodes"] if n["file"] == shard]
        assert len(held) == 1 or sum(4 * np.prod(n["shape"]) for n in held) <= 20_000
    stored = traces.read_trace(out).reference_trace()
    assert list(stored.tensors) == [n["name"] for n in manifest["nodes"]]


# --- a second runtime ----------------------------------------------------------------------------------


def test_numpy_runtime_passes_clean_through_the_cli(golden, tmp_path, capsys):
    """The runtime runs as its own program (NumPy only); its .npy dump agrees with every node."""
    dump = tmp_path / "dump"
    subprocess.run(
        [
            sys.executable,
            str(RUNTIMES / "numpy_llama.py"),
            "--weights",
            str(golden / "weights"),
            "--inputs",
            str(golden / "inputs.safetensors"),
            "--out",
            str(dump),
        ],
        check=True,
        timeout=120,
    )
    assert len(list(dump.glob("*.npy"))) == 35
    assert compare(tmp_path, str(golden), "--dump", str(dump)) == 0
    out = capsys.readouterr().out
    assert "PASS: all 35 nodes agree within tolerance" in out and "isolated mode is not possible from a dump" in out
    folder = only_report(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["nodes.csv", "report.html", "result.json"]
    result = json.loads((folder / "result.json").read_text())
    jsonschema.validate(result, result_schema())
    assert result["passed"] and result["meta"]["compared"] == "dump" and result["meta"]["trace"]["stale"] is False


@pytest.mark.parametrize(
    ("fault", "node", "hint"),
    [
        ("rope-interleaved", "model.layers.0.self_attn.q_rot", "rope_pairing"),
        ("rope-unscaled", "model.layers.0.self_attn.q_rot", "rope_scaling"),
        ("gate-up-swapped", "model.layers.1.mlp.gate_proj", "swapped_weights"),
    ],
)
def test_numpy_runtime_fault_is_located_with_a_hint(golden, tmp_path, capsys, fault, node, hint):
    dump = dump_of(golden, tmp_path / "dump", "--fault", fault)
    assert compare(tmp_path, str(golden), "--dump", str(dump), "--format", "json") == 1
    out = capsys.readouterr().out
    assert "first mismatch at node" in out and f"{node}: mismatch" in out and f"hint ({hint})" in out
    result = json.loads((only_report(tmp_path) / "result.json").read_text())
    assert result["first_mismatch"]["name"] == node and result["first_mismatch"]["hint_kind"] == hint
    assert result["profile"]["node"] == node and result["logits"]["node"] == "lm_head"


def test_runtime_names_and_layouts_through_a_name_map(golden, tmp_path, capsys):
    """One .safetensors file, the runtime's own names, no batch axis, (seq, heads, head_dim) heads."""
    dump = dump_of(golden, tmp_path / "dump", "--names", "runtime")
    assert compare(tmp_path, str(golden), "--dump", str(dump), "--name-map", str(NAME_MAP)) == 0
    assert "PASS: all 35 nodes agree" in capsys.readouterr().out
    # without the map nothing matches: every node is missing, and the note names the runtime's keys
    result = traces.compare_dump(golden, dump)
    assert result.counts == {"missing": 36}  # the 35 the dump could hold, and logits (its head absent too)
    assert any("35 dump tensor(s) match no node" in n and "--name-map" in n for n in result.notes)
    assert result.first_mismatch.hint.kind == "missing" and "name-map" in result.first_mismatch.hint.text


def test_a_node_missing_from_the_dump_is_reported_as_such(golden, tmp_path):
    dump = dump_of(golden, tmp_path / "dump")
    (dump / "model.layers.1.self_attn.probs.npy").unlink()
    result = traces.compare_dump(golden, dump)
    bad = result.first_mismatch
    assert bad.name == "model.layers.1.self_attn.probs" and bad.status == "missing"
    assert "model.layers.1.self_attn.probs.npy" in bad.detail
    assert [n.name for n in result.nodes if n.failed] == [bad.name]
    assert result.nodes[-1].name == "logits" and result.nodes[-1].status == "untapped"  # lm_head stands for it


def test_a_name_map_entry_names_the_runtime_key_a_missing_node_was_looked_for(golden, tmp_path):
    dump = dump_of(golden, tmp_path / "dump", "--names", "runtime")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(dump / "dump.safetensors")
    del tensors["kq_softmax-1"]
    save_file(tensors, dump / "dump.safetensors")
    bad = traces.compare_dump(golden, dump, NAME_MAP).first_mismatch
    assert bad.name == "model.layers.1.self_attn.probs" and "'kq_softmax-1'" in bad.detail


# --- a live PyTorch model ------------------------------------------------------------------------------


def test_compare_ours_aligns_a_live_model_to_the_trace(golden, tmp_path, capsys):
    spec = f"{USER_MODELS / 'litgpt_llama.py'}:build"
    assert compare(tmp_path, str(golden), "--ours", spec, "--mode", "both") == 0
    out = capsys.readouterr().out
    assert "loader coverage:" in out and "isolated: every node agrees on its own" in out
    # the litgpt model taps no probs/scores/context: they are read from its scaled_dot_product_attention call
    assert "untapped" not in out and "PASS" in out


def test_compare_ours_locates_a_fault_in_isolated_mode(golden, monkeypatch):
    sys.path.insert(0, str(USER_MODELS))
    try:
        import litgpt_llama
    finally:
        sys.path.remove(str(USER_MODELS))
    monkeypatch.setattr(litgpt_llama, "llama3_adjust_inv_freq", lambda inv_freq, adj: inv_freq)
    res = traces.compare_model(golden, litgpt_llama.build, mode="both")
    assert res.first_mismatch.name == "model.layers.0.self_attn.q_rot"
    assert res.first_isolated_mismatch.name == "model.layers.0.self_attn.q_rot"
    assert res.first_mismatch.hint.kind == "rope_scaling"


# --- stale references ----------------------------------------------------------------------------------


def test_a_trace_of_other_versions_is_flagged_stale_in_the_terminal_and_the_report(golden, tmp_path, capsys):
    stale = tmp_path / "stale"
    shutil.copytree(golden, stale)
    rewrite_manifest(stale, lambda m: m["versions"].update(transformers="4.57.1"))
    dump = dump_of(stale, tmp_path / "dump")
    assert compare(tmp_path, str(stale), "--dump", str(dump)) == 0
    out = capsys.readouterr().out
    assert "stale reference:" in out and "transformers 4.57.1 (installed: 5." in " ".join(out.split())
    folder = only_report(tmp_path)
    result = json.loads((folder / "result.json").read_text())
    assert result["meta"]["trace"]["stale"] is True and result["meta"]["versions"]["transformers"] == "4.57.1"
    assert any(n.startswith("stale reference:") and "parity record --verify" in n for n in result["notes"])
    assert "stale reference: this trace was recorded with transformers 4.57.1" in (folder / "report.html").read_text()
    # the same trace, not flagged, with the versions it was recorded with
    assert traces.read_trace(golden).stale() == []


def test_verify_says_whether_the_installed_versions_reproduce_the_trace(golden, tmp_path, capsys):
    assert main(["record", "--verify", str(golden), "--report-dir", str(tmp_path / "reports")]) == 0
    out = capsys.readouterr().out
    assert "reproduces: every node bit for bit" in out and f"re-run with torch {torch.__version__}" in out


def test_verify_finds_a_reference_that_computes_differently_now(golden, tmp_path, monkeypatch, capsys):
    """What an upgrade that changes the math looks like: Llama's RMSNorm output off by 0.1%."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRMSNorm.forward
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", lambda self, x: original(self, x) * (1 + 1e-3))
    assert main(["record", "--verify", str(golden), "--report-dir", str(tmp_path / "reports"), "--format", "json"]) == 1
    out = capsys.readouterr().out
    assert "does not reproduce" in out and "model.layers.0.input_layernorm: mismatch" in out


# --- summaries -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def summaries(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("summaries") / "trace"
    assert (
        main(
            [
                "record",
                "llama3:tiny",
                "--out",
                str(out),
                "--summaries",
                "--sample",
                "64",
                "--save-weights",
                "--seq-len",
                "48",
                "--layers",
                "4",
            ]
        )
        == 0
    )
    return out


def test_summaries_stay_small_and_the_schema_accepts_them(summaries, tmp_path):
    whole = tmp_path / "whole"
    assert main(["record", "llama3:tiny", "--out", str(whole), "--seq-len", "48", "--layers", "4"]) == 0
    manifest = json.loads((summaries / "manifest.json").read_text())
    jsonschema.validate(manifest, traces.trace_schema())
    size = lambda folder: sum(p.stat().st_size for p in folder.glob("nodes-*.safetensors"))
    assert size(summaries) * 5 < size(whole)
    probs = next(n for n in manifest["nodes"] if n["name"] == "model.layers.0.self_attn.probs")
    assert probs["stats"]["numel"] == 4 * 48 * 48 and probs["stats"]["max"] <= 1.0


def test_summaries_pass_a_clean_dump_and_fail_a_faulty_one(summaries, tmp_path):
    clean = traces.compare_dump(summaries, dump_of(summaries, tmp_path / "clean"))
    assert clean.passed, clean.verdict()
    assert any("judged on summaries" in n for n in clean.notes)
    faulty = traces.compare_dump(summaries, dump_of(summaries, tmp_path / "faulty", "--fault", "gate-up-swapped"))
    bad = faulty.first_mismatch
    assert bad.name == "model.layers.3.mlp.gate_proj" and "past what agreement allows" in bad.detail
    assert bad.hint is None  # hints read whole tensors


def test_summaries_prove_a_failure_from_statistics_alone(summaries, tmp_path):
    """An error spread over one token position: sampled elements may miss it, its position's norm does not."""
    dump = dump_of(summaries, tmp_path / "dump")
    x = np.load(dump / "model.layers.2.mlp.down_proj.npy")
    x[0, 7] *= 1.01
    np.save(dump / "model.layers.2.mlp.down_proj.npy", x)
    bad = traces.compare_dump(summaries, dump).first_mismatch
    assert bad.name == "model.layers.2.mlp.down_proj" and "token positions (position 7)" in bad.detail


def test_verify_of_a_summaries_trace(summaries):
    res = traces.verify(summaries)
    assert res.passed and res.first_divergence is None


# --- other sources -------------------------------------------------------------------------------------


def test_record_a_checkpoint_with_padding_and_verify_it_after_it_moved(tmp_path, checkpoint_of, capsys):
    from reference_pairs.olmo3 import build_pair

    ckpt = checkpoint_of(build_pair("tiny"))
    out = tmp_path / "trace"
    assert main(["record", "--reference", str(ckpt), "--out", str(out), "--batch", "2", "--left-pad", "3"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weights"]["source"] == "checkpoint" and len(manifest["weights"]["checkpoint_sha256"]) == 64
    assert manifest["reference"]["family"] == "olmo3" and manifest["probe"]["left_pad"] == [3, 0]
    trace = traces.read_trace(out)
    assert trace.inputs()["attention_mask"][0, :3].tolist() == [0, 0, 0]
    moved = tmp_path / "moved"
    ckpt.rename(moved)
    with pytest.raises(traces.TraceError, match="pass its folder with --checkpoint"):
        traces.verify(trace)
    assert main(["record", "--verify", str(out), "--checkpoint", str(moved), "--report-dir", str(tmp_path / "r")]) == 0
    other = checkpoint_of(build_pair("tiny", seed=1))
    capsys.readouterr()
    assert main(["record", "--verify", str(out), "--checkpoint", str(other)]) == 2
    assert "not the same weights" in capsys.readouterr().err


# --- bad input: one line, exit 2 -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["record", "llama3:tiny"], "--out TRACE_DIR is required"),
        (["record", "llama3:tiny", "--reference", "x.json", "--out", "o"], "not both"),
        (["record", "llama3:tiny", "--out", "o", "--sample", "8"], "--sample goes with --summaries"),
        (["record", "llama3:tiny", "--out", "o", "--summaries", "--calibrate"], "--calibrate needs whole tensors"),
        (["record", "llama3:tiny", "--out", "o", "--left-pad", "2"], "needs --batch 2 or more"),
        (["record", "llama3:tiny", "--out", "o", "--shard-size", "big"], "shard size 'big'"),
        (["record", "llama3:tiny", "--out", "o", "--checkpoint", "c"], "--checkpoint goes with --verify"),
        (["record", "--verify", "t", "--layers", "2"], "--layers does not apply"),
        (["record", "nosuch:tiny", "--out", "o"], "unknown family 'nosuch'"),
        (["compare", "t"], "--dump DIR"),
        (["compare", "t", "--dump", "d", "--mode", "isolated"], "not possible from a dump"),
        (["compare", "t", "--dump", "d", "--node-map", "m.json"], "--node-map goes with --ours"),
        (["compare", "t", "--ours", "m.py:build", "--name-map", "n.json"], "--name-map goes with --dump"),
        (["compare", "nowhere", "--dump", "d"], "trace folder nowhere does not exist"),
    ],
)
def test_bad_options_are_one_line_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in " ".join(err.split()) and len(err.splitlines()) <= 2, err


def test_bad_traces_dumps_and_name_maps_are_one_line_exit_2(golden, tmp_path, capsys):
    def refused(args, message):
        assert compare(tmp_path, *args) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert message in err, err

    dump = dump_of(golden, tmp_path / "dump")
    newer = tmp_path / "newer"
    shutil.copytree(golden, newer)
    rewrite_manifest(newer, lambda m: m.update(version=traces.VERSION + 1))
    refused(
        [str(newer), "--dump", str(dump)], f"trace format version {traces.VERSION + 1}, newer than this parity reads"
    )
    changed = tmp_path / "changed"
    shutil.copytree(golden, changed)
    shard = next(changed.glob("nodes-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)
    refused([str(changed), "--dump", str(dump)], "does not match the sha256 in manifest.json")
    refused([str(golden), "--dump", str(tmp_path / "none")], "--dump")
    (tmp_path / "empty").mkdir()
    refused([str(golden), "--dump", str(tmp_path / "empty")], "holds no .safetensors or .npy files")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    np.save(pickled / "model.norm.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    refused([str(golden), "--dump", str(pickled)], "pickled objects are never loaded")
    bad_map = tmp_path / "map.json"
    bad_map.write_text('{"Qrope-{i}": {"node": "model.layers.{i}.self_attn.q_rot", "permute": [0, 0, 1]}}')
    refused(
        [str(golden), "--dump", str(dump), "--name-map", str(bad_map)], "permute [0, 0, 1] is not an order of the axes"
    )
    bad_map.write_text("[1, 2]")
    refused([str(golden), "--dump", str(dump), "--name-map", str(bad_map)], "must hold a JSON object")
    assert not (tmp_path / "reports").exists() or not list((tmp_path / "reports").iterdir())


def test_an_existing_trace_is_never_overwritten(golden, capsys):
    before = (golden / "manifest.json").read_bytes()
    assert main(["record", "llama3:tiny", "--out", str(golden)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (golden / "manifest.json").read_bytes() == before
