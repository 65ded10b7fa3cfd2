"""TransformerLens 3.9 (``HookedTransformer``, TL's own config mapping and weight conversion, unprocessed
load) through parity.check_model: every family TL and parity both implement passes; an attention scale
of 1/d_head instead of 1/sqrt(d_head) is located at the scores with the ``attention_scale`` hint; TL's
processed weights (folded norms, centred writing weights: ``HookedTransformer.from_pretrained``'s default)
are refused in one message that names the unprocessed load. Glue: tests/libraries/glue_transformer_lens.py."""

import pytest
from _libcheck import assert_clean, assert_located, check, make_reference, require, tiny_config

import parity

pytestmark = pytest.mark.libs

CASES = [
    ("gpt2", {}),
    ("llama2", {}),
    ("llama3", {}),
    ("llama3", {"tie_word_embeddings": False}),
    ("mistral", {}),
    ("qwen3", {}),
    ("olmo3", {}),
    ("gemma3", {}),
]


@pytest.fixture(scope="module")
def glue():
    require("transformer_lens")
    import glue_transformer_lens

    return glue_transformer_lens


def layers(model):
    return model.blocks


def build_of(glue, family):
    return getattr(glue, f"build_{family}", glue.build)


@pytest.mark.parametrize(
    ("family", "overrides"), CASES, ids=[f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in CASES]
)
def test_transformer_lens_model_passes(glue, tmp_path, family, overrides):
    ref = make_reference(tiny_config(family, **overrides), tmp_path / "ref")
    # mistral's window (5) binds within 20 tokens: TL's local attention is compared, not skipped
    assert_clean(build_of(glue, family), ref, layers, seq_len=20 if family == "mistral" else 16)


def test_transformer_lens_attention_scale(glue, tmp_path):
    """Layer 1 divides the scores by d_head instead of sqrt(d_head)."""

    def build(state_dict, hf):
        model = glue.build(state_dict, hf)
        model.blocks[1].attn.attn_scale = float(model.cfg.d_head)
        return model

    ref = make_reference(tiny_config("llama3"), tmp_path / "ref")
    assert_located(build, ref, layers, "model.layers.1.self_attn.scores", "attention_scale")


# from_pretrained's default processing, and each of its two weight rewrites alone
PROCESSING = [
    {"fold_ln": True, "center_writing_weights": True, "center_unembed": True},
    {"fold_ln": True},
    {"center_writing_weights": True},
]


@pytest.mark.parametrize("processing", PROCESSING, ids=["from_pretrained", "fold_ln", "center_writing_weights"])
def test_processed_weights_are_refused_with_the_unprocessed_load_named(glue, tmp_path, processing):
    """Folding the norm weights into the next projections (fold_ln) or centring the writing weights
    computes the same logits (up to a constant per position with center_unembed), from tensors that are
    no layout of the reference's: the refusal names the load parity needs, in one line."""
    ref = make_reference(tiny_config("gpt2"), tmp_path / "ref")
    with pytest.raises(parity.ParityError) as err:
        check(lambda state_dict, hf: glue.build(state_dict, hf, **processing), ref)
    message = str(err.value)
    assert "TransformerLens" in message and "from_pretrained_no_processing" in message, message
    assert "fold_ln=False, center_writing_weights=False" in message and "\n" not in message
