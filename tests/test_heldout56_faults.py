"""A fifty-sixth held-back set: Reformer with local attention (ReformerModelWithLMHead: axial position embeddings,
reversible two-stream layers, chunked attention looking one chunk back, a final norm over both streams), XLM as a
causal LM (XLMWithLMHeadModel: post-norm layers kept in separate lists, language embeddings, a tied prediction layer)
and BigBird with full attention as a causal LM (BigBirdForCausalLM: BERT-style layers, rescaled embeddings, a pooler
beside the LM head) user models by helpers who never read ``parity/`` (``tests/user_models/heldout56/``, 42 bugs, five
correct variants per family).

Measured first in the thirty-third session (2026-12-07) on df0894b (sets 52 to 55 fitted, nothing of this set):
correct runs 12 of 36 (every Reformer and BigBird run refused: Reformer's ``lm_head.bias``, a parameter its head
holds and never adds, and BigBird's pooler, computed beside the LM head and never read by it, were required of ours),
bugs named 4 of 42 (10%), 37 wrong causes (28 refusals; 8 XLM attention bugs named as "the values ours computes at
load" from q and k, where ours folds the softmax scale into its fused q weights; a language embedding added named as
skipped). Fitted, by kind: reference tensors whose moving changes none of a probe's logits are required of no
parameter of ours, and a note says which (``check_model._outside_the_logits``).

Thirty-fourth session: XLM's ``out_lin`` is an output projection; its padding mask built with
``expand_as(scores)`` no longer taken for a step of the scores; its attention's projections keep their inputs and
biases (modules of a ModuleList beside the layers); so its attention scale, causal mask, head split and the query's
bias left unscaled are named: 23 of 42 after (XLM 8 of 14); its language embedding added is located with no hint (no
longer named as skipped: the reference never ran it); the one wrong cause left is BigBird's prescaled head.

After (thirty-third session): correct runs 36 of 36, bugs named 19 of 42 (45%): BigBird 12 of 14, Reformer 3 of 14 (its chunked attention
computes inline with no internals parity reads, nine bugs located at the attention output with no hint), XLM 4 of 14.
Wrong causes left: XLM's eight attention bugs still named as its load-time fold (XLM's layers are parallel lists,
``attentions.N`` beside ``ffns.N``, and its output projection ``out_lin`` is no attention block parity knows, so no
attention fit runs there) and its language embedding; BigBird's head prescaled by sqrt(hidden) named as a bias.
Asserted at their node only (``LOCATED``), the hint not asserted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout56"))

import heldout56_big_bird
import heldout56_reformer
import heldout56_xlm

MODELS = {"reformer": heldout56_reformer, "xlm": heldout56_xlm, "big_bird": heldout56_big_bird}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "reformer": dict(
            num_key_value_heads=None, attention_head_size=16, attn_layers=["local", "local", "local", "local"],
            axial_pos_embds=True, axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32], feed_forward_size=128,
            local_attn_chunk_length=8, local_num_chunks_before=1, local_num_chunks_after=0, hidden_act="gelu",
            hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
            is_decoder=True, tie_word_embeddings=False,
        ),
        "xlm": dict(
            num_key_value_heads=None, emb_dim=64, n_layers=4, n_heads=4, causal=True, sinusoidal_embeddings=False,
            n_langs=2, use_lang_emb=True, gelu_activation=True, dropout=0.0, attention_dropout=0.0,
            layer_norm_eps=1e-12, pad_index=0, tie_word_embeddings=True,
        ),
        "big_bird": dict(
            num_key_value_heads=None, is_decoder=True, attention_type="original_full", intermediate_size=128,
            type_vocab_size=2, hidden_act="gelu_new", layer_norm_eps=1e-12, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, rescale_embeddings=True, use_bias=True, tie_word_embeddings=True,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout56"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("reformer", "", False),  # lm_head.bias, which its head never adds, left out of ours
    ("big_bird", "", True),  # the pooler, beside the LM head, left out of ours
    ("xlm", "scale_scores", False),
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.parametrize(("model", "held"), [("reformer", "lm_head.bias"), ("big_bird", "bert.pooler.weight")])
def test_tensors_the_logits_never_depend_on_are_required_of_no_one(model, held, checkpoints):
    """Reformer's ``lm_head.bias`` (its head adds ``lm_head.decoder.bias``) and BigBird's pooler (computed beside the
    LM head): moving them changes no logit, so a port holding none passes, and the notes say so."""
    res = heldout_support.check(MODELS, checkpoints, model)
    assert res.passed, res.verdict()
    note = next(n for n in res.notes if "never depend on in this config" in n)
    assert held in note


BERT = "bert.encoder.layer.0"
REFORMER = "reformer.encoder.layers.0"
NAMED = [
    ("big_bird", "no_embed_rescale", False, "bert.embeddings.LayerNorm", "scale",
     "the reference's 8 x word_embeddings"),
    ("big_bird", "attn_scale_inverted", False, f"{BERT}.attention.output.dense", "attention_scale",
     "with the scores times 16; ours scales q k^T by 4"),
    ("big_bird", "gelu_sigmoid_approx", False, f"{BERT}.output.dense", "activation", "ours equals quick_gelu"),
    ("big_bird", "ln_unbiased_var", False, "bert.embeddings.LayerNorm", "norm_kind", "unbiased variance"),
    ("big_bird", "norm_before_residual", False, f"{BERT}.attention.output.LayerNorm", "residual",
     "the residual x not added"),
    ("big_bird", "ffn_residual_layer_input", False, f"{BERT}.output.LayerNorm", "residual",
     "the residual taken from another point of the stream"),
    ("big_bird", "causal_diag_off_by_one", False, f"{BERT}.attention.output.dense", "one_change",
     "the mask's diagonal masked as well"),
    ("big_bird", "pad_mask_on_queries", True, f"{BERT}.attention.output.dense", "one_change",
     "the mask's padding left out"),
    ("big_bird", "ignore_position_ids", True, "bert.embeddings.position_embeddings", "position_offset",
     "positions not derived from the attention mask in ours"),
    ("big_bird", "o_proj_not_transposed", False, f"{BERT}.attention.output.LayerNorm", "one_change",
     "dense.weight read transposed"),
    ("big_bird", "lm_bias_dropped", False, "cls.predictions.decoder", "bias", "ours adds none at cls.predictions.decoder"),
    ("big_bird", "head_act_after_norm", False, "cls.predictions.transform.LayerNorm", "norm_placement",
     "ours normalises dense's output before the gelu activation"),
    ("reformer", "double_scale", False, f"{REFORMER}.attention.output.dense", "one_change", "the divisor 4 applied twice"),
    ("reformer", "final_concat_order", False, "reformer.encoder.layer_norm", "concat_order",
     "two parts concatenated in the other order"),
    ("xlm", "gelu_sigmoid", False, "transformer.ffns.0.lin2", "activation", "ours equals quick_gelu"),
    ("xlm", "no_pred_bias", False, "pred_layer.proj", "bias", "ours adds none at pred_layer.proj"),
    ("xlm", "pos_offset", False, "transformer.position_embeddings", "position_offset", "positions off by +1 in ours"),
    ("xlm", "ln_unbiased_var", False, "transformer.layer_norm_emb", "norm_kind", "unbiased variance"),
    ("xlm", "attn_scale_emb_dim", False, "transformer.attentions.0.out_lin", "attention_scale",
     "ours scales q k^T by 0.125 (= 1/sqrt(hidden_size=64)), the reference by 0.25"),
    ("xlm", "non_causal", False, "transformer.attentions.0.out_lin", "causal_mask", "recomputed with no causal mask"),
    ("xlm", "q_bias_unscaled", False, "transformer.attentions.0.out_lin", "bias", "q = 0.25 * (x W) + b"),
    ("xlm", "head_split_axis", False, "transformer.attentions.0.out_lin", "head_layout",
     "the heads split without moving their axis in ours"),
]  # fmt: skip
FAST = {"attn_scale_inverted", "final_concat_order", "no_pred_bias"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.slow
def test_a_loader_reading_the_unused_bias_is_refused_with_its_name(checkpoints):
    """Reformer's loader taking ``lm_head.bias`` (which its head never adds) for the bias it adds: the bias its
    logits depend on, ``lm_head.decoder.bias``, held by nothing, refused by name."""
    heldout56_reformer.BUG = "lm_head_bias_wrong"
    try:
        heldout_support.assert_refused(MODELS, checkpoints, "reformer", "lm_head.decoder.bias")
    finally:
        heldout56_reformer.BUG = ""


#: located at their node, with no hint that names the cause, or (XLM's attention, BigBird's prescaled head) a wrong
#: one (see the module docstring)
LOCATED = [
    ("big_bird", "tied_head_rescaled", False, "cls.predictions.decoder"),
    ("big_bird", "head_split_transposed", False, f"{BERT}.attention.output.dense"),
    ("reformer", "axial_flatten_order", False, f"{REFORMER}.attention.layer_norm"),
    ("reformer", "position_ids_ignored", True, f"{REFORMER}.attention.layer_norm"),
    ("reformer", "mask_not_looked_back", True, f"{REFORMER}.attention.output.dense"),
    ("reformer", "lookback_wrong_direction", False, f"{REFORMER}.attention.output.dense"),
    ("reformer", "chunk_len_from_lsh", False, f"{REFORMER}.attention.output.dense"),
    ("reformer", "causal_strict", False, f"{REFORMER}.attention.output.dense"),
    ("reformer", "first_chunk_wraparound", False, f"{REFORMER}.attention.output.dense"),
    ("reformer", "shared_qk", False, f"{REFORMER}.attention.output.dense"),
    ("reformer", "ffn_reads_old_stream", False, f"{REFORMER}.feed_forward.layer_norm"),
    ("reformer", "final_norm_per_stream", False, "reformer.encoder.layer_norm"),
    ("reformer", "mask_value_zero", False, f"{REFORMER}.attention.output.dense"),
    ("xlm", "default_lang_emb", False, "transformer.layer_norm_emb"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded", "node"), LOCATED, indirect=["bug"], ids=str)
def test_a_bug_not_yet_named_is_still_located(model, bug, padded, node, checkpoints):
    heldout_support.assert_located_only(MODELS, checkpoints, model, padded, node)
