"""A forty-first held-back set: Bailing-hybrid (Kimi delta attention interleaved with MLA, grouped MoE), Inkling-2
(its text model: sliding and full layers with their own head counts, short convolutions, a relative position bias,
attention residuals over blocks of layers) and Cohere Compass (its text model: a parallel block with LayerNorm,
YaRN on the sliding layers, no RoPE on the full ones) user models by helpers who never read ``parity/``
(``tests/user_models/heldout41/``, 42 bugs, five correct variants per family).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout41"))

import heldout41_bailing_hybrid
import heldout41_cohere_compass_text
import heldout41_inkling2_text

MODELS = {
    "bailing_hybrid": heldout41_bailing_hybrid,
    "inkling2_text": heldout41_inkling2_text,
    "cohere_compass_text": heldout41_cohere_compass_text,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    kwargs = {
        "bailing_hybrid": dict(
            # MLA expands K/V per head, and the reference's eager attention repeats them again: heads must equal
            num_key_value_heads=4, head_dim=16, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=12,
            kv_lora_rank=24, q_lora_rank=20, attention_bias=True, rope_theta=10000.0,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                mscale_all_dim=0.5, beta_fast=32, beta_slow=1,
            ),
            intermediate_size=96, moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
            layer_group_size=2, short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-3.0, rms_norm_eps=1e-5,
            hidden_act="silu", tie_word_embeddings=False, num_mtp_layers=0,
        ),
        "inkling2_text": dict(
            unpadded_vocab_size=250, head_dim=16, swa_num_attention_heads=6, swa_num_key_value_heads=2,
            swa_head_dim=8, sliding_window_size=7, d_rel=4, rel_extent=10, log_scaling_n_floor=6,
            log_scaling_alpha=0.5, layer_types=["hybrid_sliding", "hybrid", "hybrid", "hybrid_sliding"],
            rms_norm_eps=1e-2, conv_kernel_size=3, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, route_scale=2.5, qk_l2_clip_threshold=2.0, rel_l2_clip_threshold=1.0,
            n_layers_per_attn_res_block=2, mlp_gate_softcap=1.5, mlp_up_softcap=2.0, final_logit_softcapping=2.5,
            scoring_func="sigmoid", tie_word_embeddings=False,
        ),
        "cohere_compass_text": dict(
            intermediate_size=128, hidden_act="silu",
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            sliding_window=6,
            rope_parameters={
                "sliding_attention": {
                    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                },
                "full_attention": None,
            },
            attention_bias=True, layer_norm_eps=1e-2, logit_scale=0.25, tie_word_embeddings=True,
        ),
    }  # fmt: skip
    root = tmp_path_factory.mktemp("heldout41")
    out = {}
    for name, kw in kwargs.items():  # each family seeded alone, as its helper verified it
        spec = {name: AutoConfig.for_model(name, **{**heldout_support.COMMON, **kw})}
        out.update(heldout_support.save_checkpoints(root, spec, heldout_support.randomise_with_expert_bias, 1000, 1234))
    return out


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("bailing_hybrid", "", False),
    ("inkling2_text", "", True),
    ("cohere_compass_text", "", False),
    ("cohere_compass_text", "cc_clean_logit_scale_in_norm", True),  # the logit scale folded into the final norm
]
KNOWN_FALSE: frozenset[tuple[str, str]] = frozenset()


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN, KNOWN_FALSE), indirect=["bug"]
)
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


ATTN = "model.layers.0.self_attn"
MLA = "model.layers.1.self_attn"
NAMED = [
    ("bailing_hybrid", "rope_neox_halves", False, f"{MLA}.q_rot", "rope_pairing",
     "ours rotates half-split (i, i + d/2) pairs, the reference interleaved (2i, 2i + 1)"),
    ("bailing_hybrid", "mla_mscale_once", False, f"{MLA}.scores", "attention_scale",
     "the YaRN softmax mscale once (not squared)"),
    ("bailing_hybrid", "mla_kv_b_split_global", False, f"{MLA}.k_rot", "qkv_layout",
     "kv_b_proj's output cut as whole blocks in ours"),
    ("bailing_hybrid", "mla_gate_tiled", False, f"{MLA}.o_proj", "head_mapping",
     "the gate tiled over the channels"),
    ("bailing_hybrid", "mla_kv_norm_skipped", False, f"{MLA}.kv_b_proj[rows 0, 1, 2, 3, ...]", "projection_input",
     "kv_a_layernorm skipped in ours"),
    ("bailing_hybrid", "kda_safe_gate_ignored", False, f"{ATTN}.o_norm", "one_change",
     "safe_gate = False (config.kda_safe_gate read as False"),
    ("bailing_hybrid", "kda_readout_before_update", False, f"{ATTN}.o_norm", "one_change",
     "triu with diagonal=0 in place of 1"),
    ("bailing_hybrid", "kda_gated_norm_swish", False, f"{ATTN}.o_norm", "one_change", "silu in place of sigmoid"),
    ("bailing_hybrid", "conv_taps_reversed", False, f"{ATTN}.o_norm", "one_change", "the conv's kernel read in reverse"),
    ("bailing_hybrid", "router_bias_in_weights", False, "model.layers.1.mlp.router.weights", "routing_weights",
     "ours equals the biased scores"),
    ("bailing_hybrid", "routed_scale_before_norm", False, "model.layers.1.mlp", "routing_weights",
     "routed_scaling_factor not applied (applied before the renormalisation"),
    ("bailing_hybrid", "expert_gate_up_swapped", False, "model.layers.1.mlp", "swapped_weights",
     "fused gate/up rows split the other way round"),
    ("bailing_hybrid", "kda_pad_not_zeroed", True, f"{ATTN}.o_norm", "one_change",
     "the broadcast factor of shape (2, 24, 1) left out"),
    ("inkling2_text", "conv_taps_unflipped", False, f"{ATTN}.o_proj.linear", "one_change",
     "the conv's kernel read in reverse"),
    ("inkling2_text", "dconv_scale_static_constant", False, "model.layers.1.self_attn.k_rot", "scale",
     "a scale on k_rot's values before a per-row cap"),
    ("inkling2_text", "full_kv_inputs_swapped", False, "model.layers.1.k_input_layernorm", "swapped_weights",
     "or the two modules fed each other's inputs"),
    ("inkling2_text", "swa_scaling_full_head_dim", False, f"{ATTN}.o_proj.linear", "one_change",
     "taken as 1 / sqrt(head_dim = 16) = 0.25"),
    ("inkling2_text", "swiglu_sigmoid_of_capped_gate", False, "model.layers.0", "one_change",
     "sigmoid reading the output of modeling_inkling2.py"),
    ("inkling2_text", "router_weights_with_bias", False, "model.layers.0.mlp.router.weights", "one_change",
     "gather reading the output of"),
    ("inkling2_text", "conv_padding_unmasked", True, f"{ATTN}.o_proj.linear", "one_change",
     "the broadcast factor of shape (2, 24, 1) left out"),
    ("inkling2_text", "logscale_from_index", True, "model.layers.1.self_attn.q_rot", "scale",
     "the position index it reads"),
    ("inkling2_text", "attnres_values_unnormed", False, "model.layers.0.post_attention_layernorm", "one_change",
     "reading model.layers.0.mlp_input.norm's input (the value before its normalisation) in place of its output"),
    ("inkling2_text", "final_attnres_skipped", False, "model.norm", "one_change",
     "model.final_input left out (its input handed on as it is)"),
    ("cohere_compass_text", "cc_sequential_block", False, "model.layers.0.mlp.gate_proj", "block_layout",
     "the residual after attention (sequential block), the reference's from the layer's input (parallel block)"),
    ("cohere_compass_text", "cc_rmsnorm", False, "model.layers.0.input_layernorm", "norm_kind",
     "ours behaves like RMSNorm"),
    ("cohere_compass_text", "cc_rope_interleaved", False, f"{ATTN}.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("cohere_compass_text", "cc_rope_on_nope_layers", False, "model.layers.1.self_attn.q_rot", "rope_unexpected",
     "this full_attention layer is NoPE"),
    ("cohere_compass_text", "cc_yarn_factor_dropped", False, f"{ATTN}.q_rot", "rope_attention_factor",
     "ours takes no factor (1)"),
    ("cohere_compass_text", "cc_logit_scale_dropped", False, "logits", "logit_scale",
     "the reference's logit_scale is 0.25"),
    ("cohere_compass_text", "cc_window_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 7, the reference with a window of 6"),
    ("cohere_compass_text", "cc_legacy_layer_pattern", False, "model.layers.1.self_attn.q_rot", "rope_unexpected",
     "ours rotates it with the RoPE of sliding_attention layers"),
    ("cohere_compass_text", "cc_gqa_tiled", False, f"{ATTN}.scores", "head_mapping",
     "repeat instead of repeat_interleave"),
    ("cohere_compass_text", "cc_ln_eps_hardcoded", False, "model.layers.0.input_layernorm", "norm_eps",
     "eps 1e-05 in ours and 0.01 in the reference"),
    ("cohere_compass_text", "cc_gate_up_swapped", False, "model.layers.0.mlp.down_proj", "swapped_roles",
     "ours applies the activation (silu) to up_proj's output"),
    ("cohere_compass_text", "cc_rope_angles_bf16", False, f"{ATTN}.q_rot", "rope_frequencies", "bfloat16 rounding"),
    ("cohere_compass_text", "cc_pad_mask_ignored", True, f"{ATTN}.probs", "padding",
     "ours gives weight to 60 earlier padding keys"),
]  # fmt: skip
FAST = {"kda_safe_gate_ignored", "cc_sequential_block", "dconv_scale_static_constant", "full_kv_inputs_swapped"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


def test_attention_biases_dropped_are_refused_by_name(checkpoints):
    """A port that never loads the attention biases (``cc_attn_bias_dropped``) is refused before any run, the
    checkpoint's bias tensors named as held by no parameter of ours."""
    MODELS["cohere_compass_text"].BUG = "cc_attn_bias_dropped"
    try:
        heldout_support.assert_refused(
            MODELS, checkpoints, "cohere_compass_text", "model.layers.0.self_attn.k_proj.bias"
        )
    finally:
        MODELS["cohere_compass_text"].BUG = ""
