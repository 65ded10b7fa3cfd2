"""A fifty-fifth held-back set: Pegasus's decoder as a causal LM (PegasusForCausalLM: a sinusoid position table called
with the input's shape, so every slot numbered whatever ``position_ids`` say, a scaled embedding, pre-norm layers, q
scaled inside the attention), X-MOD as a causal LM (RoBERTa-style post-norm layers with a bottleneck adapter per
language after each feed-forward, its own norm, the default language's run when no ``lang_ids`` are given) and BLT
(BltForCausalLM without its patcher: a local encoder over the bytes with hash n-gram embeddings, a global transformer
over the patches, a local decoder, cross-attention between bytes and patches, three stacks each of its own width,
heads and RoPE theta) user models by helpers who never read ``parity/`` (``tests/user_models/heldout55/``, 42 bugs,
five correct variants per family).

Measured first in the thirty-third session (2026-12-07) on f672d03 (sets 52 to 54 fitted, nothing of this set):
correct runs 36 of 36, bugs named 22 of 42 (52%), 7 wrong causes: X-MOD's adapters read with their biases missing
past layer 0 (a stacked (layers, languages, bottleneck) bias given one node: two head bugs reported at layer 1's
adapter), the default language's adapter run otherwise named "a layout or head-count difference", a norm weight
reused named a swap; Pegasus's broadcast position table ``(seq, hidden)`` against ours' per-row one named a layout
difference in padded runs; BLT's facts took the top-level config's four layers and theta 500000 and located none of
its three stacks' nodes in a layer. Fitted, by kind:

- a stacked bias's cells over two stacking axes (layer, language) each their slab's bias (``stages._stacked_biases``);
- one of several parallel modules (per-language adapters, experts) run on rows by one side and on none by the other:
  the module chosen otherwise, named with the one the other side ran (``detectors._chosen_otherwise``);
- a norm's weight read twice (its second read standing for a norm never read): named as reused, not as swapped
  (``norms._reused_weight``); a swap's hint names the call order too;
- a reference node holding one value broadcast over the batch compared with ours' rows (``results._broadcast_row``);
  a position table read at ``(seq, hidden)`` read for its rows and shifts (``rope.position_table_offset``);
- a table called with a shape (Pegasus's and RoFormer's sinusoids) keeps its weight for the diagnosis (hooks);
- the first node past the lookups (mBART's ``layernorm_embedding``) reads its position term as rows of the
  reference's learned table (``embeddings._table_rows``); an inline RoPE (RoFormer's) recomputed from its table
  (``attention_refit.inline_attention``);
- q_proj's bias scaled otherwise than its weight (``rope.bias_scaled_apart``);
- models of several stacks of layers (BLT's): one numbering across them, each layer's facts its own stack's
  (``ArchFacts.stacks``, ``layer_path``); a stack over another sequence numbers its own RoPE positions, and the
  positions a rotation was made at are read back from it (``rope_fit._read_positions``);
- any table read at integer ids is a lookup (BLT's hash embedding), a hash n-gram embedding's ids read against its
  formula's forms (``embeddings._hash_reading``), a table's later call read for a per-call offset
  (``later_calls._rows_on_call``);
- a node's input floored at zero (a max-pool counting its zero start), an input cut into slots with a stride, the
  values read from a norm's input, a q/k norm applied after its projection (``elementwise.input_floored_at_zero``,
  ``wiring.input_slots_strided``, ``wiring._values_past_the_norm``, ``norms.norm_past_projection``).

After: correct runs 36 of 36, bugs named 40 of 42 (95%), no wrong cause. Left, asserted at their node only
(``LOCATED``): BLT's cross-attention mask tiled over its ``cross_attn_k`` slots (named as rows reshaped over heads
and queries: only the final patch's rows weigh two keys or more, too few to read the slots' order) and its byte
padding mask applied to the global transformer (named as a mask hiding whole rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout55"))

import heldout55_blt
import heldout55_pegasus
import heldout55_xmod

MODELS = {"pegasus": heldout55_pegasus, "xmod": heldout55_xmod, "blt": heldout55_blt}
STACK = dict(max_position_embeddings=256, rope_theta=10000.0, hidden_size_global=128, cross_attn_k=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "pegasus": dict(
            num_key_value_heads=None, d_model=64, decoder_layers=4, encoder_layers=1, decoder_attention_heads=4,
            encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128, activation_function="relu",
            scale_embedding=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_layerdrop=0.0,
            tie_word_embeddings=True, is_decoder=True, is_encoder_decoder=False,
        ),
        "xmod": dict(
            num_key_value_heads=None, is_decoder=True, intermediate_size=128, type_vocab_size=1, hidden_act="gelu",
            layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pre_norm=False,
            adapter_reduction_factor=4, adapter_layer_norm=True, adapter_reuse_layer_norm=False,
            ln_before_adapter=True, languages=["en_XX", "de_DE"], default_language="de_DE", tie_word_embeddings=True,
        ),
        "blt": dict(
            num_key_value_heads=None, patch_in_forward=False, max_patch_length=None,
            encoder_hash_byte_group_size=[3, 4], encoder_hash_byte_group_vocab=500,
            encoder_hash_byte_group_nb_functions=1, cross_attn_k=2,
            encoder_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                vocab_size=256, **STACK),
            decoder_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                vocab_size=256, **STACK),
            global_config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                               max_position_embeddings=256, rope_theta=10000.0),
            tie_word_embeddings=False,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout55"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("pegasus", "", True),  # every slot numbered, padding too, as Pegasus's decoder does
    ("xmod", "adapter_onehot_mix", False),  # every language's adapter on every token, mixed one-hot
    ("blt", "pool_identity", True),  # each byte its own patch: the pooling written as the byte states
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


PEGASUS = "model.decoder.layers.0"
XMOD = "roberta.encoder.layer.0"
ENCODER = "model.local_encoder"
NAMED = [
    ("pegasus", "scale_after_pos_add", False, f"{PEGASUS}.self_attn_layer_norm", "position_offset",
     "the sum (token + position) scaled where only the token embedding is"),
    ("pegasus", "scale_field_misread", False, f"{PEGASUS}.self_attn_layer_norm", "scale",
     "model.decoder.embed_tokens weighted 0.125x in ours; matches 1 / sqrt(hidden_size=64)"),
    ("pegasus", "bart_pos_offset", False, "model.decoder.embed_positions", "position_offset",
     "ours at position p equals the reference at position p + 2"),
    ("pegasus", "use_given_position_ids", True, "model.decoder.embed_positions", "position_offset",
     "its table called with the input's shape alone (Pegasus's decoder numbers every slot)"),
    ("pegasus", "pos_table_deinterleaved", False, "model.decoder.embed_positions", "weight_permutation",
     "ours[j] = reference[0, 2, 4, 6"),
    ("pegasus", "tied_head_prescaled", False, "model.decoder.embed_tokens", "scale", "sqrt(hidden_size=64)"),
    ("pegasus", "bart_post_norm", False, f"{PEGASUS}.self_attn_layer_norm", "norm_placement", "post-norm"),
    ("pegasus", "q_bias_unscaled", False, f"{PEGASUS}.self_attn.q_rot", "bias",
     "q_proj's bias scaled otherwise than its weight in ours: ours' q_rot is the reference's times scaling"),
    ("pegasus", "scale_by_dmodel", False, f"{PEGASUS}.self_attn.scores", "attention_scale", "1/sqrt(hidden_size=64)"),
    ("pegasus", "head_split_interleaved", False, f"{PEGASUS}.self_attn.q_rot", "qkv_layout", "(head_dim, heads)"),
    ("pegasus", "ln_unbiased_var", False, f"{PEGASUS}.self_attn_layer_norm", "norm_kind", "unbiased variance"),
    ("pegasus", "gelu_act_hardcoded", False, f"{PEGASUS}.fc2", "activation", "ours equals gelu"),
    ("pegasus", "pad_mask_query_axis", True, f"{PEGASUS}.self_attn.probs", "padding", "padding keys"),
    ("pegasus", "softmax_bf16", False, f"{PEGASUS}.self_attn.probs", "precision", "bfloat16"),
    ("xmod", "pos_pad_idx_hardcoded", False, "roberta.embeddings.position_embeddings", "position_offset",
     "positions off by +1 in ours"),
    ("xmod", "given_positions_offset", True, "roberta.embeddings.position_embeddings", "position_offset",
     "positions off by +1 in ours"),
    ("xmod", "type_emb_skipped", False, "roberta.embeddings.LayerNorm", "missing",
     "roberta.embeddings.token_type_embeddings skipped in ours"),
    ("xmod", "default_lang_first", False, f"{XMOD}.output.adapter_modules.en_XX.dense1", "routing",
     f"the reference runs {XMOD}.output.adapter_modules.de_DE.dense1 there, which ours runs on no row"),
    ("xmod", "adapter_residual_before_ln", False, f"{XMOD}.output.LayerNorm", "residual",
     "the residual taken from the normalised input"),
    ("xmod", "adapter_uses_output_ln", False, f"{XMOD}.output.adapter_layer_norm", "wrong_module",
     "ours normalises with LayerNorm's weight at both places and never reads adapter_layer_norm's own"),
    ("xmod", "output_ln_before_adapter", False, f"{XMOD}.output.adapter_layer_norm", "swapped_weights",
     "or the two norms called in each other's order"),
    ("xmod", "ffn_residual_pre_ln", False, f"{XMOD}.output.adapter_layer_norm", "residual",
     "the residual taken from the normalised input"),
    ("xmod", "adapter_act_relu", False, f"{XMOD}.output.adapter_modules.de_DE.dense2", "activation",
     "ours equals relu"),
    ("xmod", "head_ln_before_gelu", False, "lm_head.layer_norm", "norm_placement",
     "ours normalises dense's output before the gelu activation"),
    ("xmod", "decoder_bias_dropped", False, "lm_head.decoder", "bias", "ours adds none at lm_head.decoder"),
    ("xmod", "no_causal_mask", False, f"{XMOD}.attention.output.dense", "causal_mask", "no causal mask"),
    ("xmod", "pad_mask_query_axis", True, f"{XMOD}.attention.output.dense", "padding", "padding keys left unmasked"),
    ("xmod", "ln_unbiased_var", False, "roberta.embeddings.LayerNorm", "norm_kind", "unbiased variance"),
    ("blt", "rope_half_split", False, f"{ENCODER}.layers.0.self_attn.q_rot", "rope_pairing", "half-split"),
    ("blt", "rope_theta_top_level", False, f"{ENCODER}.layers.0.self_attn.q_rot", "rope_theta",
     "theta 500000, cos/sin scaled by 1 (this layer's RoPE: 1) (the config: theta 10000)"),
    ("blt", "hash_powers_reversed", False, "model.encoder_hash_tok_embedding", "token_ids",
     "the powers of the prime reversed"),
    ("blt", "hash_unsigned_mod", False, "model.encoder_hash_tok_embedding", "token_ids",
     "the wrapped 64-bit sum read as unsigned"),
    ("blt", "hash_no_table_offset", False, "model.encoder_hash_tok_embedding (call 2)", "token_ids",
     "call 2 offset by -500 in ours"),
    ("blt", "patch_reduce_include_self", False, f"{ENCODER}.patch_embedding_projection", "activation",
     "input floored at zero in ours"),
    ("blt", "patch_proj_strided_split", False, f"{ENCODER}.cross_attn_layers.0.q_norm", "qkv_layout",
     "cut into 2 slots per row with a stride in ours"),
    ("blt", "cross_v_unnormed", False, f"{ENCODER}.cross_attn_layers.0.context", "swapped_roles",
     "v_proj of k_norm's input"),
    ("blt", "cross_scale_global_dim", False, "model.local_decoder.cross_attn_layers.0.scores", "attention_scale",
     "ours scales q k^T by 0.176777"),
    ("blt", "decoder_cross_first_layer_only", False, "model.local_decoder.layers.1.input_layernorm", "one_change",
     "inside model.local_decoder.cross_attn_layers.1"),
    ("blt", "cross_qnorm_after_proj", False, f"{ENCODER}.cross_attn_layers.0.q_norm", "norm_placement",
     "q_norm applied after q_proj in ours"),
    ("blt", "global_positions_from_bytes", True, "model.global_transformer.layers.0.self_attn.q_rot",
     "position_offset", "it rotates batch row 0 at positions 1, 1, 1, 1, 1, 0"),
]  # fmt: skip
FAST = {"default_lang_first", "adapter_uses_output_ln", "use_given_position_ids", "hash_powers_reversed"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


def test_blt_layers_are_numbered_across_its_three_stacks(checkpoints):
    """BLT's local encoder, global transformer and local decoder: one numbering, each layer its own stack's width and
    RoPE theta (the sub-configs'), and every layer's path found again from its index."""
    from parity.model.derive import derive_facts

    ref = heldout_support.reference_model(checkpoints["blt"])
    facts = derive_facts(ref.config, ref)
    assert [layer.head_dim for layer in facts.layers] == [16, 32, 32, 16, 16]
    assert {layer.rope.theta for layer in facts.layers if layer.rope} == {10000.0}
    assert facts.locate("model.global_transformer.layers.1.self_attn.q_rot") == (2, "q_rot")
    assert facts.locate("model.local_decoder.layers.0.mlp") == (3, "mlp")
    assert [facts.layer_path(i) for i in (0, 1, 4)] == [
        "model.local_encoder.layers.0",
        "model.global_transformer.layers.0",
        "model.local_decoder.layers.1",
    ]


def test_a_reference_running_another_default_language_is_named(checkpoints, monkeypatch):
    """X-MOD's reference run with its first language's adapters (en_XX, as lang_ids of zeros; ours correct, the
    config's default de_DE): the adapter chosen otherwise named on the reference's side."""
    from transformers.models.xmod import modeling_xmod

    forward = modeling_xmod.XmodModel.forward

    def first_language(self, input_ids=None, **kwargs):
        return forward(
            self, input_ids=input_ids, **{**kwargs, "lang_ids": torch.zeros(len(input_ids), dtype=torch.long)}
        )

    monkeypatch.setattr(modeling_xmod.XmodModel, "forward", first_language)
    ref = heldout_support.reference_model(checkpoints["xmod"])
    bad = heldout_support.first_mismatch(MODELS, "xmod", ref)
    assert bad.hint is not None and bad.hint.kind == "routing", bad
    assert bad.name == f"{XMOD}.output.adapter_modules.de_DE.dense1", bad
    assert f"the reference runs {XMOD}.output.adapter_modules.en_XX.dense1 there, which ours runs on no row" in str(
        bad.hint
    )


def test_a_reference_pooling_over_its_zeros_is_named(checkpoints):
    """BLT's reference pooling its patches with the zeros it starts from counted (``include_self=True``; ours
    correct): the projection's input floored at zero on the reference's side."""
    ref = heldout_support.reference_model(checkpoints["blt"])
    encoder = ref.model.local_encoder

    def pooled(hidden_states, max_num_patches, patch_ids):
        index = patch_ids.unsqueeze(-1).expand(-1, -1, hidden_states.shape[-1])
        zeros = hidden_states.new_zeros(hidden_states.shape[0], max_num_patches, hidden_states.shape[-1])
        return zeros.scatter_reduce(1, index, hidden_states, reduce="amax", include_self=True)

    encoder.patch_reduce = pooled
    bad = heldout_support.first_mismatch(MODELS, "blt", ref)
    assert bad.name == f"{ENCODER}.patch_embedding_projection" and bad.hint.kind == "activation", bad
    assert "floored at zero in the reference" in bad.hint.text


def test_a_reference_hashing_with_the_powers_reversed_is_named(checkpoints, monkeypatch):
    """BLT's reference hashing each byte window with the prime's powers reversed (ours correct): named at the hash
    embedding on the reference's side."""
    from transformers.models.blt import modeling_blt

    def reversed_powers(token_tensor, prime: int = 1000000007):
        powers = torch.tensor(prime, dtype=torch.int64) ** torch.arange(token_tensor.shape[-1]).flip(0)
        return (token_tensor * powers).sum(-1)

    monkeypatch.setattr(modeling_blt, "rolling_polynomial_hash", reversed_powers)
    ref = heldout_support.reference_model(checkpoints["blt"])
    bad = heldout_support.first_mismatch(MODELS, "blt", ref)
    assert bad.name == "model.encoder_hash_tok_embedding" and bad.hint.kind == "token_ids", bad
    assert "computed otherwise in the reference" in bad.hint.text and "powers of the prime reversed" in bad.hint.text


#: located at their node, with no hint that names the cause (see the module docstring)
LOCATED = [
    ("blt", "cross_mask_tiled", False, f"{ENCODER}.cross_attn_layers.0.probs"),
    ("blt", "global_padding_mask", True, "model.global_transformer.layers.0.self_attn.probs"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded", "node"), LOCATED, indirect=["bug"], ids=str)
def test_a_bug_not_yet_named_is_still_located(model, bug, padded, node, checkpoints):
    heldout_support.assert_located_only(MODELS, checkpoints, model, padded, node)
