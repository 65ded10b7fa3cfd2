"""llms-from-scratch 1.0.19 (the code of "Build a Large Language Model (From Scratch)", loaded by the book's own
loaders) through parity.check_model: GPT-2 (ch04), Llama 3.2 (llama3.py), Qwen3 and Qwen3-MoE (qwen3.py) pass;
Llama 3's RoPE built without its frequency scaling is located at q_rot with the ``rope_scaling`` hint.
Glue: tests/libraries/glue_llms_from_scratch.py."""

import pytest
from _libcheck import assert_clean, assert_located, make_reference, require, tiny_config

pytestmark = pytest.mark.libs

CASES = [
    ("gpt2", {}),
    ("llama3", {}),
    ("llama3", {"tie_word_embeddings": False}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
    ("qwen3_moe", {}),
]


@pytest.fixture(scope="module")
def glue():
    require("llms_from_scratch")
    import glue_llms_from_scratch

    return glue_llms_from_scratch


def layers(model):
    return model.trf_blocks


@pytest.mark.parametrize(
    ("family", "overrides"), CASES, ids=[f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in CASES]
)
def test_llms_from_scratch_model_passes(glue, tmp_path, family, overrides):
    ref = make_reference(tiny_config(family, **overrides), tmp_path / "ref")
    assert_clean(getattr(glue, f"build_{family}"), ref, layers)


def test_llms_from_scratch_llama3_rope_without_frequency_scaling(glue, tmp_path, monkeypatch):
    """The book's compute_rope_params called without its freq_config (Llama 3's wavelength-dependent
    scaling), as a port from its Llama 2 chapter would; the original context (64) lies within the
    checked sequence's reach so the logits move."""
    import llms_from_scratch.llama3 as book

    unscaled = book.compute_rope_params
    monkeypatch.setattr(book, "compute_rope_params", lambda *a, **kw: unscaled(*a, **{**kw, "freq_config": None}))
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)  # fmt: skip
    ref = make_reference(tiny_config("llama3", max_position_embeddings=128, rope_parameters=rope), tmp_path / "ref")
    result = assert_located(glue.build_llama3, ref, layers, "model.layers.0.self_attn.q_rot", "rope_scaling")
    assert "no llama3 scaling" in result.first_mismatch.hint.text
