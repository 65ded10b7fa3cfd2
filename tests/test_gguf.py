"""GGUF checkpoints (``--checkpoint model.gguf``): read through Transformers' GGUF loader, refused in one
line when they cannot be checked; the decode run's window note. Small float32 GGUFs written here (the
real, quantized Gemma 3 270M is in tests/test_real_weights.py, slow)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import parity
from parity.build.builder import build_pair
from parity.build.gguf import float32_config_notes, gguf_file
from parity.util.errors import CheckpointError

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="the gguf package is not installed")


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    """A tiny Llama 2 pair's checkpoint as a float32 GGUF, its rms_norm_eps 1e-6 (stored as float32)."""
    from parity.runtimes.llama_cpp import write_gguf
    from reference_pairs.llama2 import FAMILY

    folder = tmp_path_factory.mktemp("gguf")
    build_pair(FAMILY, "tiny").reference.save_pretrained(folder / "hf")
    (folder / "only").mkdir()
    path, _ = write_gguf(folder / "hf", folder / "only" / "tiny.gguf", config_changes={"rms_norm_eps": 1e-6})
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True)


@needs_gguf
def test_a_gguf_checkpoint_is_checked_from_one_dequantized_copy_and_names_its_float32_config(llama_gguf):
    from reference_pairs.llama2 import FAMILY

    for checkpoint in (llama_gguf, llama_gguf.parent):  # the file, or the folder holding it
        pair = build_pair(FAMILY, checkpoint=checkpoint)
        result = parity.check(pair)
        assert result.passed and len(result.nodes) > 30
        # one copy: every parameter of ours is a tensor of the reference (same storage)
        ref = {p.untyped_storage().data_ptr() for p in pair.reference.parameters()}
        assert all(p.untyped_storage().data_ptr() in ref for p in pair.ours.parameters())
        eps = pair.reference.config.rms_norm_eps
        assert eps == float(np.float32(1e-6)) and eps != 1e-6
        note = next(n for n in result.notes if "rms_norm_eps" in n)
        assert "9.999999974752427e-07" in note and "float32 rounding of 1e-06" in note
        assert any(c.startswith("GGUF tiny.gguf (") and "dequantized to float32" in c for c in pair.loading.conversions)


@needs_gguf
def test_a_gguf_of_another_family_is_refused_in_one_line(llama_gguf):
    from reference_pairs.qwen3 import FAMILY

    with pytest.raises(CheckpointError, match=r"GGUF of architecture 'llama', expected 'qwen3'"):
        build_pair(FAMILY, checkpoint=llama_gguf)
    out = _cli("check", "qwen3", "--checkpoint", str(llama_gguf))
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "architecture 'llama', expected 'qwen3'" in lines[0], out.stderr


@needs_gguf
def test_a_quantization_type_transformers_cannot_dequantize_is_refused_naming_it(tmp_path):
    import gguf

    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    _block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    writer.add_tensor(
        "token_embd.weight", np.zeros((4, nbytes), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = _cli("check", "llama2", "--checkpoint", str(path))
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert "quantization type Transformers' GGUF loader cannot dequantize: Q8_K" in lines[0]
    assert "token_embd.weight" in lines[0]


def test_a_folder_of_several_ggufs_or_a_file_that_is_not_one(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\): pass the one"):
        gguf_file(tmp_path)
    assert gguf_file(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "config.json").write_text("{}")
    assert gguf_file(tmp_path) is None  # a Transformers-format folder: the safetensors reader's
    if importlib.util.find_spec("gguf") is not None:
        bad = tmp_path / "x" / "bad.gguf"
        bad.parent.mkdir()
        bad.write_bytes(b"not a gguf at all, just text")
        out = _cli("check", "llama2", "--checkpoint", str(bad))
        assert out.returncode == 2 and "does not start with the GGUF magic bytes" in out.stderr


def test_float32_config_values_are_named_and_exact_ones_are_not():
    config = {
        "rms_norm_eps": float(np.float32(1e-6)),
        "rope_theta": 10000.0,
        "rope": {"factor": float(np.float32(0.1))},
    }
    notes = float32_config_notes(config)
    assert len(notes) == 2
    assert notes[0].startswith("config rms_norm_eps is 9.999999974752427e-07") and "rounding of 1e-06" in notes[0]
    assert notes[1].startswith("config rope.factor is") and "rounding of 0.1 " in notes[1]
    assert float32_config_notes({"rms_norm_eps": 1e-6, "initializer_range": 0.02}) == []  # float64 values: none


def test_a_decode_crossing_the_window_does_not_say_it_is_not_exercised():
    from reference_pairs.gemma3 import build_pair as gemma3

    pair = gemma3("tiny", n_layers=2, sliding_window=16)
    crossing = parity.check(pair, decode="12x8")  # 20 tokens > window 16, the prefill (12) alone is not
    assert crossing.passed
    assert not any("window" in n and ("not exceed" in n or "not past" in n) for n in crossing.notes), crossing.notes
    inside = parity.check(pair, decode="8x4")
    note = next(n for n in inside.notes if "sliding window" in n)
    assert "decode plan 8x4 reaches 12 tokens, not past the sliding window (16)" in note
    assert "--decode 13x4" in note and "--seq-len" not in note


def test_the_memory_guard_sizes_a_decode_by_its_widest_call_not_its_prefill(monkeypatch):
    from parity.run import memory
    from parity.run.options import DecodePlan
    from parity.util import resources
    from reference_pairs.gemma3 import build_pair as gemma3

    pair = gemma3("tiny", n_layers=2)
    facts = pair.facts
    short, long = (memory.decode_bytes(facts, 1, DecodePlan(12, n).schedule(), 4) for n in (8, 400))
    assert long > short  # the context reached, not the prefill, sets it
    prefill_only = memory.check_footprint(facts, 1, 12, 4, resources.TRACE_MEMORY).memory
    assert long > prefill_only
    monkeypatch.setattr(resources, "available_bytes", lambda: int(long / resources.BUDGET) - 1)
    assert parity.check(pair, seq_len=12).passed  # the prompt alone fits
    with pytest.raises(parity.ParityError, match=r"decoding 1 x 412 tokens \(decode plan 12x400\) needs about"):
        parity.check(pair, decode="12x400")
