"""A fifty-eighth held-back set: BlenderbotSmall's decoder as a causal LM (BlenderbotSmallForCausalLM: the embedding
norm over the tokens alone, the positions added after it, post-norm layers), ERNIE as a causal LM (ErnieForCausalLM:
word, position, token-type and task-type embeddings, BERT-style layers, an untied head) and Llama 4's text model
(Llama4ForCausalLM: RoPE by adjacent pairs with NoPE layers between, an L2 norm of q and k, chunked attention, the
NoPE layers' attention temperature, a MoE every other layer whose router scales the experts' input) user models by
helpers who never read ``parity/`` (``tests/user_models/heldout58/``, 42 bugs, five correct variants per family).

Measured first in the thirty-fourth session (2026-12-07) on 239729a (set 57 fitted, nothing of this set): correct
runs 36 of 36, bugs named 21 of 42 (50%), 16 wrong causes. Most of them two capture gaps each of which put a false
first node before every bug of a family: BlenderbotSmall's port splits its fused q/k/v product and adds each bias
slice after the split (q_proj recorded without its bias: "ours adds none"), ERNIE's keeps its token-type and
task-type tables stacked in one parameter (each lookup cut as if the table's rows were output features: a shape
difference at task_type_embeddings). Besides: Llama 4's temperature applied to the keys named as RoPE, an
attention_mask passed as token_type_ids named as the causal mask.

Fitted, by kind: a product waiting for its bias, split along its output features, its pieces' biases joined
(``functional._piece_read``); a product cast before its bias carries the wait over (a bfloat16 head); a lookup of a
row-stacked table is the node whose rows the ids read, its rows as they are (``hooks._record_param``); a key scale
by position named as such (``scales.position_scale``); the attention_mask read as another input when it moves the
last token (``positions.all_ones_mask_result``, kind ``argument_slot``); the positions added before the first node
past the lookups on one side (``embeddings.positions_added_before``); a held bfloat16 input read by the precision
detector (``elementwise._fits_in``).

After: correct runs 36 of 36, bugs named 40 of 42 (95%), no wrong cause; Llama 4's two routing bugs located at the
layer after its MoE block, unnamed (``LOCATED``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout58"))
import heldout58_blenderbot_small
import heldout58_ernie
import heldout58_llama4_text

MODELS = {
    "blenderbot-small": heldout58_blenderbot_small,
    "ernie": heldout58_ernie,
    "llama4_text": heldout58_llama4_text,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "blenderbot-small": dict(
            num_key_value_heads=None, d_model=64, decoder_layers=4, decoder_attention_heads=4, decoder_ffn_dim=128,
            encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, activation_function="gelu",
            scale_embedding=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            decoder_start_token_id=1, tie_word_embeddings=True,
        ),
        "ernie": dict(
            num_key_value_heads=None, intermediate_size=128, is_decoder=True, type_vocab_size=2,
            task_type_vocab_size=3, use_task_id=True, hidden_act="gelu", layer_norm_eps=1e-12,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=False,
        ),
        "llama4_text": dict(
            head_dim=16, intermediate_size=96, intermediate_size_mlp=128, num_local_experts=4,
            num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=8,
            use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, rope_theta=10000.0,
            rms_norm_eps=1e-5, hidden_act="silu", attention_dropout=0.0, tie_word_embeddings=False,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout58"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("blenderbot-small", "", False),  # q, k and v biases added to the split pieces of one fused product
    ("ernie", "", True),  # token-type and task-type tables stacked in one parameter
    ("llama4_text", "rope_complex", False),
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


B = "model.decoder.layers.0"
E = "ernie.encoder.layer.0"
L0, L1 = "model.layers.0", "model.layers.1"
ALL_ONES = "logits (with an all-ones attention_mask)"
NAMED = [
    ("blenderbot-small", "norm_after_positions", False, "model.decoder.layernorm_embedding", "norm_placement",
     "the positions added before layernorm_embedding in ours"),
    ("blenderbot-small", "scale_after_norm", False, f"{B}.self_attn.q_proj", "scale",
     "model.decoder.layernorm_embedding weighted 8x in ours"),
    ("blenderbot-small", "bart_position_offset", False, "model.decoder.embed_positions", "position_offset",
     "positions off by 2"),
    ("blenderbot-small", "use_position_ids", True, "model.decoder.embed_positions", "position_offset",
     "position_ids ignored"),
    ("blenderbot-small", "scale_full_dim", False, f"{B}.self_attn.scores", "attention_scale",
     "ours scales q k^T by 0.125"),
    ("blenderbot-small", "fold_scale_weight_only", False, f"{B}.self_attn.out_proj", "bias", "q = 0.25 * (x W) + b"),
    ("blenderbot-small", "prenorm_layers", False, f"{B}.self_attn.q_proj", "norm_placement",
     "ours before the sub-block"),
    ("blenderbot-small", "gelu_tanh", False, f"{B}.fc2", "activation", "gelu_new (tanh approximation"),
    ("blenderbot-small", "padmask_on_queries", True, f"{B}.self_attn.probs", "padding", "earlier padding keys"),
    ("blenderbot-small", "causal_diag", False, f"{B}.self_attn.probs", "causal_mask", "hides each query's own key"),
    ("blenderbot-small", "qkv_concat_order", False, f"{B}.self_attn.q_rot", "swapped_roles",
     "ours uses as the query what the reference uses as the key"),
    ("blenderbot-small", "ffn_residual_prenorm", False, f"{B}.final_layer_norm", "residual",
     f"add f(x) = {B}.fc2 to another x"),
    ("blenderbot-small", "encoder_attn_norm_applied", False, f"{B}.encoder_attn_layer_norm", "missing",
     f"the reference never ran {B}.encoder_attn_layer_norm in this forward, ours did"),
    ("blenderbot-small", "t5_tied_rescale", False, "lm_head", "scale", "1 / sqrt(hidden_size=64)"),
    ("ernie", "ln_unbiased_var", False, "ernie.embeddings.LayerNorm", "norm_kind", "unbiased variance"),
    ("ernie", "gelu_fast_approx", False, f"{E}.output.dense", "activation", "ours equals quick_gelu"),
    ("ernie", "task_id_flag_misread", False, "ernie.embeddings.LayerNorm", "one_change",
     "embeddings += task_type_embeddings"),
    ("ernie", "roberta_position_offset", False, "ernie.embeddings.position_embeddings", "position_offset",
     "positions off by +1 in ours"),
    ("ernie", "position_ids_ignored", True, "ernie.embeddings.position_embeddings", "position_offset",
     "position_ids ignored"),
    ("ernie", "pad_mask_query_axis", True, f"{E}.attention.output.dense", "padding", "the padding keys left unmasked"),
    ("ernie", "causal_diag_leak", False, f"{E}.attention.output.dense", "causal_mask", "the causal mask one key wider"),
    ("ernie", "head_ln_before_act", False, "cls.predictions.transform.LayerNorm", "norm_placement",
     "ours normalises dense's output before the gelu activation"),
    ("ernie", "lm_head_bf16", False, "cls.predictions.decoder", "precision", "bfloat16 precision in ours"),
    ("ernie", "mask_replaces_causal", False, ALL_ONES, "causal_mask",
     "the causal triangle built only when no mask is given"),
    ("ernie", "attn_out_not_transposed", False, f"{E}.attention.output.LayerNorm", "one_change",
     "attention.output.dense.weight read transposed"),
    ("ernie", "mask_as_token_type", False, ALL_ONES, "argument_slot", "the attention_mask read as another input"),
    ("llama4_text", "rope_half_split", False, f"{L0}.self_attn.q_rot", "rope_pairing", "ours rotates half-split"),
    ("llama4_text", "no_rope_flag_inverted", False, f"{L0}.self_attn.q_rot", "rope_missing",
     "RoPE skipped in ours at this layer"),
    ("llama4_text", "qk_norm_on_nope", False, f"{L1}.self_attn.q_rot", "row_scale",
     "a per-vector normalisation applied on one side only"),
    ("llama4_text", "qk_norm_true_l2", False, f"{L0}.self_attn.q_rot", "norm_kind", "unit L2 length"),
    ("llama4_text", "temp_off_by_one", False, f"{L1}.self_attn.q_rot", "scale", "a query scale by position"),
    ("llama4_text", "temp_scales_k_too", False, f"{L1}.self_attn.k_rot", "scale", "a scale by position on the keys"),
    ("llama4_text", "chunk_as_sliding_window", False, f"{L0}.self_attn.probs", "sliding_window",
     "block-local attention"),
    ("llama4_text", "chunk_ignores_left_padding", True, f"{L0}.self_attn.probs", "padding",
     "the chunk boundaries counted with or without the padding"),
    ("llama4_text", "full_mask_drops_padding", True, f"{L1}.self_attn.probs", "padding", "earlier padding keys"),
    ("llama4_text", "gqa_tiled_heads", False, f"{L0}.self_attn.scores", "head_mapping", "GQA head mapping"),
    ("llama4_text", "gate_up_halves_swapped", False, "model.layers.2.input_layernorm", "one_change",
     "parts 0 and 1 of this chunk (of 2) swapped"),
    ("llama4_text", "rope_angles_bf16", False, f"{L0}.self_attn.q_rot", "rope_frequencies", "bfloat16 rounding"),
]  # fmt: skip
FAST = {"norm_after_positions", "causal_diag", "ln_unbiased_var", "lm_head_bf16", "mask_as_token_type"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


REFUSED = [
    ("ernie", "decoder_bias_from_cls", "cls.predictions.decoder.bias"),
    ("ernie", "output_ln_name_collision", f"{E}.attention.output.LayerNorm.bias"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "says"), REFUSED, indirect=["bug"], ids=str)
def test_a_bug_that_leaves_a_tensor_unloaded_is_refused_with_its_name(model, bug, says, checkpoints):
    """The head's bias taken from the stale ``cls.predictions.bias``, one LayerNorm loaded from another's tensors:
    each leaves a checkpoint tensor the logits depend on in no parameter, refused by name."""
    heldout_support.assert_refused(MODELS, checkpoints, model, says)


#: located at their node, no hint naming the cause: Llama 4's MoE block computed in functions, its routing otherwise
LOCATED = [
    ("llama4_text", "router_softmax", False, "model.layers.2.input_layernorm"),
    ("llama4_text", "score_on_expert_output", False, "model.layers.2.input_layernorm"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded", "node"), LOCATED, indirect=["bug"], ids=str)
def test_a_bug_not_yet_named_is_still_located(model, bug, padded, node, checkpoints):
    heldout_support.assert_located_only(MODELS, checkpoints, model, padded, node)
