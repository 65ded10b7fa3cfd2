"""MLX (mlx-lm, CPU) through the adapter (parity/runtimes/mlx.py): a clean run of each tiny checkpoint
passes with mlx-lm's fused attention (scores and probs untapped), and a RoPE base, a window and an eps
changed for the run are each located with their hint. The live tests (slow) skip when mlx is not
installed (pip install 'parity[mlx]': on Linux the mlx-cpu wheels)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from parity import golden
from parity.cli import main
from parity.runtimes.mlx import model_config

HAVE_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
live = pytest.mark.skipif(not HAVE_MLX, reason="mlx and mlx-lm are not installed (pip install 'parity[mlx]')")


def test_transformers_5_rope_parameters_are_given_as_mlx_lm_reads_them():
    config = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0}}
    extra, notes = model_config(config)
    assert extra == {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}
    assert "not Transformers 5's rope_parameters" in notes[0]
    per_type = {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    extra, notes = model_config(per_type, {"rms_norm_eps": 1e-5})
    assert extra == {"rope_theta": 1e6, "rms_norm_eps": 1e-5} and "differs per layer type" in notes[0]
    assert "config changed for this run: rms_norm_eps = 1e-05" in notes[-1]
    assert model_config({"rope_theta": 1e4}) == ({}, [])  # an older config: mlx-lm reads it as it is


def test_without_mlx_the_adapter_says_which_extra_installs_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "mlx", None)
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    trace = tmp_path / "t"
    golden.record("llama3:tiny", trace, seq_len=4)
    assert main(["dump", "mlx", str(trace), "--trace", str(trace), "--out", str(tmp_path / "d")]) == 2
    assert "pip install 'parity[mlx]'" in " ".join(capsys.readouterr().err.split())


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in ("llama3", "qwen3", "olmo3"):
        path = tmp_path_factory.mktemp(family) / "trace"
        golden.record(f"{family}:tiny", path, calibrate=True, save_weights=True)
        out[family] = path
    return out


@pytest.mark.slow
@live
@pytest.mark.parametrize(("family", "judged", "untapped"), [("llama3", 31, 5), ("qwen3", 51, 7), ("olmo3", 68, 8)])
def test_mlx_passes_clean_with_its_fused_attention(traces, tmp_path, family, judged, untapped):
    from parity.runtimes import mlx

    out = mlx.dump(traces[family] / "weights", traces[family], tmp_path / "dump")
    result = golden.compare_dump(traces[family], out)
    assert result.verdict() == (
        f"PASS: all {judged} nodes agree within tolerance ({untapped} of {judged + untapped} reference nodes untapped)"
    )
    probs = next(n for n in result.nodes if n.name == "model.layers.0.self_attn.probs")
    assert probs.status == "untapped" and "mx.fast.scaled_dot_product_attention" in probs.detail


@pytest.mark.slow
@live
@pytest.mark.parametrize(
    ("family", "change", "node", "hint"),
    [
        ("llama3", "rope_theta=10000", "model.layers.0.self_attn.q_rot", "rope_theta"),
        ("olmo3", "sliding_window=8", "model.layers.0.self_attn.context", "sliding_window"),
        ("qwen3", "rms_norm_eps=1e-5", "model.layers.0.input_layernorm", "norm_eps"),
    ],
)
def test_mlx_bugs_are_located_with_their_hint_through_the_cli(traces, tmp_path, capsys, family, change, node, hint):
    trace, dump = str(traces[family]), str(tmp_path / "dump")
    assert main(["dump", "mlx", f"{trace}/weights", "--trace", trace, "--out", dump, "--set", change]) == 0
    assert main(["compare", trace, "--dump", dump, "--report-dir", str(tmp_path / "r")]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"hint ({hint})" in out and "first mismatch at node" in out and node in out


@pytest.mark.slow
@live
def test_mlx_runs_a_padded_batch_row_by_row_and_padding_is_not_judged(tmp_path):
    from parity.runtimes import mlx

    trace = tmp_path / "trace"
    golden.record("llama3:tiny", trace, calibrate=True, save_weights=True, batch_size=2, left_pad=5)
    result = golden.compare_dump(trace, mlx.dump(trace / "weights", trace, tmp_path / "dump"))
    assert result.passed, result.verdict()
    assert any(n.startswith("padding: 5 of 32 token positions are padding") for n in result.notes)
