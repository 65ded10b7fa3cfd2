"""llama.cpp through the adapter (parity/runtimes/llama_cpp.py).

The default tests compare recorded eval-callback output of the real llama.cpp (tests/fixtures/llama_cpp,
README there: llama-cpp-python 0.3.36 built from source) with traces recorded here: clean dumps pass
with their untapped nodes said, injected bugs are located with their hint. Writing a GGUF needs only the
``gguf`` package. The live tests (slow) run llama-cpp-python when it is installed and skip otherwise:
building it from its sdist takes about 45 minutes, so CI does not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from parity import golden
from parity.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "llama_cpp"


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    """The traces the fixtures were recorded against: FAMILY:tiny, calibrated, weights saved."""
    out = {}
    for family in ("llama3", "qwen3", "olmo3"):
        path = tmp_path_factory.mktemp(family) / "trace"
        golden.record(f"{family}:tiny", path, calibrate=True, save_weights=True)
        out[family] = path
    return out


@pytest.mark.parametrize(
    ("family", "fixture", "judged", "untapped"),
    [("llama3", "llama3-tiny", 35, 1), ("qwen3", "qwen3-tiny", 54, 4), ("olmo3", "olmo3-tiny", 71, 5)],
)
def test_recorded_llama_cpp_output_passes_through_its_name_map(traces, family, fixture, judged, untapped):
    result = golden.compare_dump(traces[family], FIXTURES / fixture)
    assert result.passed, result.verdict()
    assert result.verdict() == (
        f"PASS: all {judged} nodes agree within tolerance ({untapped} of {judged + untapped} reference nodes untapped)"
    )
    by_name = {n.name: n for n in result.nodes}
    assert by_name["logits"].status == "untapped"  # lm_head (result_output) stands for what llama.cpp returns
    if family != "llama3":  # qwen3's and olmo2's graphs give o_proj's output no name: unavailable, not missing
        o_proj = by_name["model.layers.0.self_attn.o_proj"]
        assert o_proj.status == "untapped" and "gives o_proj's output no name" in o_proj.detail
    assert any(n.startswith("runtime: llama.cpp through llama-cpp-python 0.3.36") for n in result.notes)


@pytest.mark.parametrize(
    ("family", "fixture", "node", "hint"),
    [
        ("llama3", "llama3-tiny-rope-theta-10000", "model.layers.0.self_attn.q_rot", "rope_theta"),
        ("olmo3", "olmo3-tiny-window-8", "model.layers.0.self_attn.probs", "sliding_window"),
        ("qwen3", "qwen3-tiny-eps-1e-5", "model.layers.0.input_layernorm", "norm_eps"),
    ],
)
def test_recorded_llama_cpp_bugs_are_located_with_their_hint(traces, family, fixture, node, hint):
    bad = golden.compare_dump(traces[family], FIXTURES / fixture).first_mismatch
    assert (bad.name, bad.hint.kind) == (node, hint)


def test_the_cli_compares_a_llama_cpp_dump_with_no_name_map_given(traces, tmp_path, capsys):
    """The map travels in the dump's parity-dump.json: the user's glue is the two commands."""
    args = ["compare", str(traces["olmo3"]), "--dump", str(FIXTURES / "olmo3-tiny"), "--report-dir", str(tmp_path)]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "PASS: all 71 nodes agree" in out and "gives o_proj's output no name" in out


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="the gguf package is not installed")
def test_a_checkpoint_becomes_a_float32_gguf_llama_cpp_reads(traces, tmp_path):
    import gguf
    from safetensors.numpy import load_file

    from parity.runtimes.llama_cpp import write_gguf

    weights = traces["llama3"] / "weights"
    path, arch = write_gguf(weights, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(path))
    assert arch == "llama" and bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode() == "none"
    tensors = {t.name: t for t in reader.tensors}
    assert "rope_freqs.weight" in tensors  # Llama 3's frequency scaling, as llama.cpp reads it
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    hf = load_file(weights / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    q = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(hf.shape)
    heads, head_dim = 4, 16
    # each head's rows interleaved: row 2j is dimension j, row 2j+1 is dimension j + head_dim / 2
    back = q.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(back, hf) and not np.array_equal(q, hf)


def _live() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


live = pytest.mark.skipif(
    not _live(), reason="llama-cpp-python is not installed (pip install 'parity[llama-cpp]': a ~45 min build)"
)


@pytest.mark.slow
@live
@pytest.mark.parametrize("family", ["llama3", "qwen3", "olmo3"])
def test_live_llama_cpp_passes_clean(traces, tmp_path, family):
    from parity.runtimes import llama_cpp

    out = llama_cpp.dump(traces[family] / "weights", traces[family], tmp_path / "dump")
    assert golden.compare_dump(traces[family], out).passed


@pytest.mark.slow
@live
def test_live_llama_cpp_cli_locates_an_injected_rope_base(traces, tmp_path, capsys):
    rope = '{"rope_type": "default", "rope_theta": 10000.0}'
    trace, dump = str(traces["qwen3"]), str(tmp_path / "dump")
    assert (
        main(
            [
                "dump",
                "llama-cpp",
                f"{trace}/weights",
                "--trace",
                trace,
                "--out",
                dump,
                "--set",
                f"rope_parameters={rope}",
            ]
        )
        == 0
    )
    assert main(["compare", trace, "--dump", dump, "--report-dir", str(tmp_path / "r")]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "hint (rope_theta)" in out and "model.layers.0.self_attn.q_rot" in out


@pytest.mark.slow
@live
def test_live_llama_cpp_flash_attention_marks_scores_and_probs_unavailable(traces, tmp_path):
    from parity.runtimes import llama_cpp

    out = llama_cpp.dump(traces["llama3"] / "weights", traces["llama3"], tmp_path / "dump", flash_attn=True)
    result = golden.compare_dump(traces["llama3"], out)
    by_name = {n.name: n for n in result.nodes}
    assert by_name["model.layers.0.self_attn.probs"].status == "untapped"
    # ggml_flash_attn_ext's F16 K and V: the first difference is at context
    assert result.first_mismatch.name == "model.layers.0.self_attn.context"


def test_without_llama_cpp_the_adapter_says_which_extra_installs_it(monkeypatch, traces, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    trace = str(traces["llama3"])
    assert main(["dump", "llama-cpp", f"{trace}/weights", "--trace", trace, "--out", str(tmp_path / "d")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "pip install 'parity[llama-cpp]'" in err and not (tmp_path / "d").exists()
