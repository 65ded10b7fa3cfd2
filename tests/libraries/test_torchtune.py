"""torchtune 0.6.1 (builders + ``hf_to_tune``) through parity.check_model: every family torchtune and parity
both implement passes (Qwen2, which parity has no family for, too: check_model takes any checkpoint);
torchtune's Mistral, which has no sliding window, is flagged at the first attention whose window binds
and passes where it does not; a k_proj left in HF row order (``hf_to_tune``'s permutation skipped) is
located at k_rot with the ``rope_pairing`` hint. Glue: tests/libraries/glue_torchtune.py."""

import pytest
import torch
from _libcheck import assert_clean, assert_located, make_reference, require, tiny_config

pytestmark = pytest.mark.libs

# (family, tiny-config overrides); mistral with sliding_window None (as v0.2/v0.3) and with a window
# longer than the checked sequence: neither binds
CASES = [
    ("llama2", {}),
    ("llama3", {}),
    ("llama3", {"tie_word_embeddings": False}),
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 64}),
    ("qwen2", {}),
]


@pytest.fixture(scope="module")
def glue():
    require("torchtune")
    import glue_torchtune

    return glue_torchtune


def layers(model):
    return model.layers


@pytest.mark.parametrize(
    ("family", "overrides"), CASES, ids=[f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in CASES]
)
def test_torchtune_model_passes(glue, tmp_path, family, overrides):
    ref = make_reference(tiny_config(family, **overrides), tmp_path / "ref")
    assert_clean(getattr(glue, f"build_{family}"), ref, layers, seq_len=20)


def test_torchtune_mistral_without_sliding_window_is_flagged(glue, tmp_path):
    """Mistral 7B v0.1 attends within a window of 4096 tokens; torchtune attends to all: a real
    disagreement once the sequence is longer than the window (here 5, 20 tokens)."""
    ref = make_reference(tiny_config("mistral", sliding_window=5), tmp_path / "ref")
    result = assert_located(
        glue.build_mistral, ref, layers, "model.layers.0.self_attn.probs", "sliding_window", seq_len=20
    )
    assert "full causal attention" in result.first_mismatch.hint.text


def test_torchtune_k_proj_not_permuted_for_interleaved_rope(glue, tmp_path):
    """A converter that copies layer 0's k_proj as stored by HF (half-split RoPE rows) into torchtune,
    which rotates adjacent pairs: hf_to_tune's permutation skipped for one tensor."""

    def build(state_dict, hf):
        model = glue.build_llama2(state_dict, hf)
        model.layers[0].attn.k_proj.weight = torch.nn.Parameter(state_dict["model.layers.0.self_attn.k_proj.weight"])
        return model

    ref = make_reference(tiny_config("llama2"), tmp_path / "ref")
    assert_located(build, ref, layers, "model.layers.0.self_attn.k_rot", "rope_pairing")
