"""A forty-second held-back set: Granite-SWA (Granite's multipliers, per-layer RoPE bases with a NoPE layer,
sliding windows and attention sinks as a gate), MiniMax-M3 (its text model: a lightning indexer choosing key blocks,
partial RoPE, Gemma-style norms, a SwiGLU-OAI MLP and sigmoid routing) and Step 3.7 (its text model inside the
composite model: per-layer-type head counts and RoPE, a per-head output gate, clamped SwiGLU experts) user models
by helpers who never read ``parity/`` (``tests/user_models/heldout42/``, 42 bugs, five correct variants per family).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout42"))

import heldout42_granite_swa
import heldout42_minimax_m3_vl_text
import heldout42_step3p7

MODELS = {
    "granite_swa": heldout42_granite_swa,
    "minimax_m3_vl_text": heldout42_minimax_m3_vl_text,
    "step3p7": heldout42_step3p7,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    common = dict(heldout_support.COMMON)
    configs = {
        "granite_swa": AutoConfig.for_model(
            "granite_swa", **common,
            intermediate_size=96, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            layer_rope_theta=[1000.0, 0, 50000.0, 1000.0],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            embedding_multiplier=4.0, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5,
            attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True,
        ),
        "minimax_m3_vl_text": AutoConfig.for_model(
            "minimax_m3_vl_text", **common,
            head_dim=24, rotary_dim=12,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
            layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=48, num_local_experts=8,
            num_experts_per_tok=2, routed_scaling_factor=2.5, swiglu_alpha=1.702, swiglu_limit=2.0, index_n_heads=2,
            index_head_dim=16, index_block_size=4, index_topk_blocks=3, index_local_blocks=2, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        "step3p7": AutoConfig.for_model(
            "step3p7",
            text_config=dict(
                common,
                head_dim=24, num_sliding_attention_heads=8,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=6,
                rope_theta=[10000.0, 100.0, 100.0, 10000.0], partial_rotary_factors=[0.5, 1.0, 1.0, 0.5],
                query_pre_attn_scalar=40, intermediate_size=96, moe_intermediate_size=32, share_expert_dim=48,
                n_routed_experts=8, num_experts_per_tok=3, moe_router_scaling_factor=2.5,
                swiglu_limits=[None, 1.0, 0.0, 1.5], swiglu_limits_shared=[1.5, 0.0, 2.0, 1.25], attention_bias=True,
                mlp_bias=True, rms_norm_eps=1e-3, tie_word_embeddings=False,
            ),
            vision_config=dict(
                hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14, mlp_ratio=2.0
            ),
            tie_word_embeddings=False,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout42"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("granite_swa", "", False),
    ("minimax_m3_vl_text", "", True),
    ("step3p7", "", False),
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
STEP = "model.language_model.layers"
NAMED = [
    ("granite_swa", "emb_mult_missing", False, "model.layers.0.input_layernorm", "scale",
     "matches 1 / the config's embedding_multiplier (4)"),
    ("granite_swa", "logits_scale_inverted", False, "logits", "scale",
     "the config's logits_scaling squared (6.25) (6.25) (one side divides by it where the other multiplies)"),
    ("granite_swa", "attn_scale_doubled", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.05 (= the config's attention_multiplier (0.2) / sqrt(head_dim=16))"),
    ("granite_swa", "residual_mult_whole_sum", False, "model.layers.0.post_attention_layernorm", "residual",
     "ours computes 0.6 x + 0.6 f(x), the reference 1 x + 0.6 f(x)"),
    ("granite_swa", "sink_sign_flipped", False, f"{ATTN}.context", "one_change", "sigmoid of the negated input"),
    ("granite_swa", "sink_lse_unmasked", False, f"{ATTN}.context", "one_change",
     "logsumexp reading the output of modeling_granite_swa.py:105"),
    ("granite_swa", "swa_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 6, the reference with a window of 5"),
    ("granite_swa", "layer_types_default_pattern", False, f"{ATTN}.probs", "sliding_window",
     "the layer pattern (config.layer_types, or the rule deriving it) read otherwise"),
    ("granite_swa", "nope_theta_zero_as_default", False, "model.layers.1.self_attn.q_rot", "rope_unexpected",
     "this full_attention layer is NoPE (layer_rope_theta marks it so), ours rotates it"),
    ("granite_swa", "rope_interleaved", False, f"{ATTN}.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("granite_swa", "gqa_tiled", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("granite_swa", "qkv_split_kv_swapped", False, f"{ATTN}.k_rot", "swapped_roles",
     "ours' k_rot is the reference's v_proj rotated"),
    ("granite_swa", "norm_weight_plus_one", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("granite_swa", "pad_mask_ignored", True, f"{ATTN}.probs", "padding", "ours gives weight to 40 earlier padding keys"),
    ("minimax_m3_vl_text", "qk_norm_across_heads", False, f"{ATTN}.q_norm", "norm_kind",
     "ours behaves like RMSNorm over the whole projection, the reference like RMSNorm over the last axis (per head)"),
    ("minimax_m3_vl_text", "final_norm_no_offset", False, "model.norm", "norm_weight_offset",
     "ours multiplies by w, the reference by 1 + w"),
    ("minimax_m3_vl_text", "rope_full_head", False, f"{ATTN}.q_rot", "rope_partial",
     "the reference rotates 12 of 24 dims"),
    ("minimax_m3_vl_text", "attn_scale_from_hidden", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(hidden_size/num_attention_heads=16))"),
    ("minimax_m3_vl_text", "glu_alpha_from_hidden_act", False, "model.layers.0.mlp.down_proj", "one_change",
     "the factor 1.702 left out"),
    ("minimax_m3_vl_text", "experts_up_no_offset", False, "model.layers.1.mlp.experts", "one_change",
     "the offset 1 left out"),
    ("minimax_m3_vl_text", "router_softmax", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses from a softmax over the experts instead of a sigmoid"),
    ("minimax_m3_vl_text", "router_bias_in_weights", False, "model.layers.1.mlp.router.weights", "one_change",
     "gather reading the output of modeling_minimax_m3_vl.py:248"),
    ("minimax_m3_vl_text", "routed_scale_after_shared", False, "model.layers.1.mlp", "moe_combination",
     "ours computes 2.5 routed + 2.5 shared, the reference 2.5 routed + 1 shared"),
    ("minimax_m3_vl_text", "indexer_local_off_by_one", False, "model.layers.1.self_attn.probs", "sparse_selection",
     "the keys model.layers.1.self_attn.indexer's key selection keeps"),
    ("minimax_m3_vl_text", "indexer_heads_tiled", False, "model.layers.1.self_attn.probs", "head_mapping",
     "repeat instead of repeat_interleave"),
    ("minimax_m3_vl_text", "indexer_no_future_mask", False, "model.layers.1.self_attn.probs", "sparse_selection",
     "ours reads 0 earlier keys the reference masks, the reference 96 ours masks"),
    ("step3p7", "norm_no_offset", False, f"{STEP}.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by w, the reference by 1 + w"),
    ("step3p7", "qk_norm_across_heads", False, f"{STEP}.0.self_attn.q_norm", "norm_kind",
     "ours behaves like RMSNorm over the whole projection, the reference like RMSNorm over the last axis (per head)"),
    ("step3p7", "attn_scale_head_dim", False, f"{STEP}.0.self_attn.scores", "attention_scale",
     "ours scales q k^T by 0.204124 (= 1/sqrt(head_dim=24)), the reference by 0.158114"),
    ("step3p7", "gqa_tiled", False, f"{STEP}.0.self_attn.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("step3p7", "window_off_by_one", False, f"{STEP}.1.self_attn.probs", "sliding_window",
     "ours attends with a window of 7, the reference with a window of 6"),
    ("step3p7", "rope_partial_ignored", False, f"{STEP}.0.self_attn.q_rot", "rope_partial",
     "the reference rotates 12 of 24 dims"),
    ("step3p7", "gate_on_residual", False, f"{STEP}.0.self_attn.o_proj", "one_change",
     "linear reading the layer's input (the residual stream before its norm) in place of its own"),
    ("step3p7", "router_softmax", False, f"{STEP}.1", "one_change", "softmax over the last axis in place of sigmoid"),
    ("step3p7", "router_bias_in_weights", False, f"{STEP}.1", "one_change",
     "gather reading the output of modeling_step3p7.py:590"),
    ("step3p7", "routed_scale_on_shared", False, f"{STEP}.1", "moe_combination",
     "ours computes 2.5 routed + 2.5 shared, the reference 2.5 routed + 1 shared"),
    ("step3p7", "gate_up_swapped", False, f"{STEP}.1", "one_change", "parts 0 and 1 of this chunk (of 2) swapped"),
    ("step3p7", "swiglu_limit_zero_clamps", False, f"{STEP}.1.mlp.shared_experts.down_proj", "one_change",
     "clamp's infinite bound (no clamp) taken as 0"),
    ("step3p7", "sliding_pad_mask_dropped", True, f"{STEP}.1.self_attn.probs", "padding",
     "ours gives weight to 120 earlier padding keys"),
]  # fmt: skip
FAST = {"norm_weight_plus_one", "routed_scale_after_shared", "window_off_by_one", "sink_lse_unmasked"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.parametrize(
    ("model", "bug", "says"),
    [
        ("minimax_m3_vl_text", "experts_gate_up_interleaved",
         "the fused tensor read as interleaved pairs where the checkpoint stacks its two halves"),
        ("step3p7", "head_tied", "lm_head.weight"),
    ],
)  # fmt: skip
def test_a_loader_mistake_is_refused_by_name(model, bug, says, checkpoints):
    """A port that reads a fused gate/up as interleaved pairs, or ties an untied head to the embedding, is refused
    before any run, the checkpoint's tensor it never holds named (with the layout it read instead)."""
    MODELS[model].BUG = bug
    try:
        heldout_support.assert_refused(MODELS, checkpoints, model, says)
    finally:
        MODELS[model].BUG = ""


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def test_a_reference_scaling_its_shared_expert_too_is_named(checkpoints):
    """MiniMax-M3's MoE block with the routed scaling factor applied to routed + shared in the reference: the
    block's combination, the reference's coefficients named."""
    import types

    ref = heldout_support.reference_model(checkpoints["minimax_m3_vl_text"])

    def scaled_sum(self, hidden_states):  # MiniMaxM3VLSparseMoeBlock.forward, the scale applied to the sum
        shape = hidden_states.shape
        flat = hidden_states.view(-1, shape[-1])
        shared = self.shared_experts(flat)
        _, weights, chosen = self.gate(flat)
        return ((self.experts(flat, chosen, weights) + shared) * self.routed_scaling_factor).reshape(shape)

    for layer in ref.model.layers:
        if hasattr(layer.mlp, "shared_experts"):
            layer.mlp.forward = types.MethodType(scaled_sum, layer.mlp)
    bad = heldout_support.first_mismatch(MODELS, "minimax_m3_vl_text", ref)
    assert bad.name == "model.layers.1.mlp" and bad.hint.kind == "moe_combination", bad
    assert "ours computes 2.5 routed + 1 shared, the reference 2.5 routed + 2.5 shared" in bad.hint.text


def test_a_reference_keeping_other_key_blocks_is_named(checkpoints):
    """MiniMax-M3's lightning indexer keeping one local block, not two, in the reference: the attention's kept keys
    differ with holes on both sides, named as the indexer's selection (not a sliding window)."""
    ref = heldout_support.reference_model(checkpoints["minimax_m3_vl_text"])
    for layer in ref.model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.local_blocks = 1
    bad = heldout_support.first_mismatch(MODELS, "minimax_m3_vl_text", ref)
    assert bad.name == "model.layers.1.self_attn.probs" and bad.hint.kind == "sparse_selection", bad
    assert "the keys model.layers.1.self_attn.indexer's key selection keeps" in bad.hint.text
