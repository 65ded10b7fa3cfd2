"""litgpt 0.5.13 (``litgpt.model.GPT``, loaded by litgpt's own HF converters) through parity.check_model:
every family litgpt and parity both implement passes; a swapped gate/up in the conversion is located
at the MLP's down_proj with the ``swapped_roles`` hint. Glue: tests/libraries/glue_litgpt.py."""

import pytest
from _libcheck import assert_clean, assert_located, make_reference, require, tiny_config

pytestmark = pytest.mark.libs

# (family, tiny-config overrides): tied heads as released (Llama 3.2, Qwen3-0.6B) and untied
CASES = [
    ("llama2", {}),
    ("llama3", {}),
    ("llama3", {"tie_word_embeddings": False}),
    ("mistral", {}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
    ("qwen3_moe", {}),
    ("gemma3", {}),
    ("olmo3", {}),
]


@pytest.fixture(scope="module")
def glue():
    require("litgpt")
    import glue_litgpt

    return glue_litgpt


def layers(model):
    return model.transformer.h


@pytest.mark.parametrize(
    ("family", "overrides"), CASES, ids=[f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in CASES]
)
def test_litgpt_model_passes(glue, tmp_path, family, overrides):
    ref = make_reference(tiny_config(family, **overrides), tmp_path / "ref")
    # mistral's window (5) binds within 20 tokens: litgpt's sliding window is compared, not skipped
    assert_clean(getattr(glue, f"build_{family}"), ref, layers, seq_len=20 if family == "mistral" else 16)


def test_litgpt_gate_up_swapped_in_conversion(glue, tmp_path):
    """A conversion that reads up_proj into litgpt's fc_1 (the SiLU input) and gate_proj into fc_2."""

    def build(state_dict, hf):
        sd = dict(state_dict)
        gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
        sd[gate], sd[up] = state_dict[up], state_dict[gate]
        return glue.build_llama2(sd, hf)

    ref = make_reference(tiny_config("llama2"), tmp_path / "ref")
    result = assert_located(build, ref, layers, "model.layers.1.mlp.down_proj", "swapped_roles")
    assert "gate_proj" in result.first_mismatch.hint.text and "up_proj" in result.first_mismatch.hint.text
