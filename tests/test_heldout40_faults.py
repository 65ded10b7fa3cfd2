"""A fortieth held-back set: Gemma 3n (its text model), Gemma 4 (its text model) and dots.3-note (its text model)
user models by helpers who never read ``parity/`` (``tests/user_models/heldout40/``, 42 bugs, five correct
variants per family).

First measure in the twenty-fourth session (2026-12-06), after the layout ports' fits (``tests/test_layouts40.py``),
nothing fitted to set 40: correct runs 0 of 36 (Gemma 3n's per-layer ``intermediate_size`` list refused as a config
error; dots.3-note's heterogeneous config raised inside parity; Gemma 4's eight stacked norm gains, read in another
order than the reference runs them and three of them no node of its own, put later reads on the wrong nodes: a false
norm placement); 6 of 42 bugs named (14%), 8 wrong causes (7 behind that false placement, and Gemma 4's value norm
left out read as moved across a product). Fitted after, by kind: count fields given per layer, heterogeneous configs
read per layer, stacked norm gains read by row, a module returning fewer features than the fused rows it holds is
no node, a tied head computed from the embedding module's table, a product over a column slice of a node's weight
joined with the others, a weightless norm left out. After: 36 of 36 correct runs, 30 of 42 bugs named, no wrong
cause seen. Named in the twenty-fifth session: dots.3-note's rope key norm skipped (a norm of the failing node's own
block whose weight ours never read), per-head gate tiled (the output gate's forms read where ours' context is not), sliding
window (the attention recomputed under other masks where ours runs a fused kernel) and RoPE theta at its sliding
layers (the rope tail's order settled at the first token, where RoPE turns nothing): 34 of 42. Unnamed: Gemma 3n's
per-layer table clamped or unpacked transposed, LAuReL's residual unnormed and the sparsity's unbiased std; Gemma 4's
K = V from the normed key, per-expert scale by slot and PLE unpacked transposed; dots.3-note's mask laid on the
queries (the padding keys' values are no real query's: the recomputation cannot read them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout40"))

import heldout40_dots3_note_text
import heldout40_gemma3n_text
import heldout40_gemma4_text

MODELS = {
    "gemma3n_text": heldout40_gemma3n_text,
    "gemma4_text": heldout40_gemma4_text,
    "dots3_note_text": heldout40_dots3_note_text,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    kwargs = {
        "gemma3n_text": dict(
            head_dim=16, intermediate_size=[128, 96, 128, 96],
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            sliding_window=8, num_kv_shared_layers=2,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
            hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, laurel_rank=8, altup_num_inputs=4,
            altup_active_idx=0, altup_correct_scale=True, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
            final_logit_softcapping=10.0, attention_bias=True, hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6, tie_word_embeddings=True,
        ),
        "gemma4_text": dict(
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            attention_bias=True, intermediate_size=96, hidden_activation="gelu_pytorch_tanh",
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True,
            num_experts=4, top_k_experts=2, moe_intermediate_size=32, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=256, final_logit_softcapping=15.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {
                    "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                    "factor": 2.0,
                },
            },
        ),
        "dots3_note_text": dict(
            num_key_value_heads=4, use_dsa=None,
            layer_types=["indexed_attention", "sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=6, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, head_dim=32, attention_bias=True, swa_num_attention_heads=2, swa_num_key_value_heads=2,
            swa_q_lora_rank=24, swa_kv_lora_rank=20, swa_head_dim=32, swa_qk_nope_head_dim=16, swa_v_head_dim=16,
            rope_theta=10000.0, swa_rope_theta=500.0, index_topk=8, index_n_heads=8, index_head_dim=16,
            intermediate_size=96, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            n_shared_experts=2, shared_experts_intermediate_size=24, rms_norm_eps=1e-2, tie_word_embeddings=False,
        ),
    }  # fmt: skip
    root = tmp_path_factory.mktemp("heldout40")
    out = {}
    for name, kw in kwargs.items():  # each family seeded alone, as its helper verified it
        spec = {name: AutoConfig.for_model(name, **{**heldout_support.COMMON, **kw})}
        out.update(heldout_support.save_checkpoints(root, spec, heldout_support.randomise_with_expert_bias, 1000, 1234))
    return out


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [("gemma3n_text", "", False), ("gemma4_text", "", True), ("dots3_note_text", "", False)]
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
NAMED = [
    ("gemma3n_text", "rmsnorm_one_plus_weight", False, "model.per_layer_projection_norm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("gemma3n_text", "attn_scale_head_dim", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(head_dim=16)), the reference by 1"),
    ("gemma3n_text", "v_norm_skipped", False, f"{ATTN}.context", "one_change",
     "model.layers.0.self_attn.v_norm's normalisation left out (its input handed on as it is)"),
    ("gemma3n_text", "rope_local_theta_global", False, f"{ATTN}.q_rot", "rope_theta",
     "ours rotates like default RoPE with theta 1e+06 (the theta of full_attention layers)"),
    ("gemma3n_text", "sliding_window_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 9, the reference with a window of 8"),
    ("gemma3n_text", "kv_share_previous_layer", False, "model.layers.2.self_attn.k_rot", "layer_offset",
     "ours equals the reference's model.layers.1.self_attn.k_rot (layer 1, not 2)"),
    ("gemma3n_text", "altup_coefs_transposed", False, "model.layers.0.altup.prediction_coefs", "weight_permutation",
     "ours[j] = reference[0, 4, 8, 12, 1, 5, 9, 13, ...]"),
    ("gemma3n_text", "altup_router_scale_rsqrt", False, "model.layers.0.altup.modality_router", "scale",
     "ours' input to it is the reference's times 8 at every position"),
    ("gemma3n_text", "head_scaled_embedding", False, "logits", "softcap",
     "ours' logits are 10 * tanh(8 x / 10) (x scaled by 8 = the embedding scale before the cap)"),
    ("gemma3n_text", "sliding_mask_no_padding", True, f"{ATTN}.probs", "padding",
     "ours gives weight to 100 earlier padding keys the other side masks"),
    ("gemma4_text", "norm_one_plus_weight", False, "model.per_layer_projection_norm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("gemma4_text", "attn_scale_inv_sqrt_d", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(head_dim=16)), the reference by 1"),
    ("gemma4_text", "v_norm_skipped", False, f"{ATTN}.context", "one_change",
     "model.layers.0.self_attn.v_norm's normalisation left out (its input handed on as it is)"),
    ("gemma4_text", "rope_partial_ignored", False, "model.layers.1.self_attn.q_rot", "rope_partial",
     "the reference rotates 8 of 32 dims (0, 1, 2, 3, 16, 17, 18, 19) of each head"),
    ("gemma4_text", "sliding_window_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 9, the reference with a window of 8"),
    ("gemma4_text", "gqa_tiled_heads", False, f"{ATTN}.scores", "head_mapping",
     "K/V heads expanded with repeat instead of repeat_interleave"),
    ("gemma4_text", "final_softcap_skipped", False, "logits", "softcap",
     "ours' logits are x (no cap), the reference's 15 * tanh(x / 15)"),
    ("gemma4_text", "experts_gate_up_swapped", False, "model.layers.0.post_feedforward_layernorm", "one_change",
     "parts 0 and 1 of this chunk (of 2) swapped"),
    ("gemma4_text", "tied_head_prescaled", False, "logits", "softcap",
     "ours' logits are 15 * tanh(8 x / 15) (x scaled by 8 = the embedding scale before the cap)"),
    ("gemma4_text", "gelu_exact", False, "model.layers.0.mlp.down_proj", "activation",
     "act = gelu (exact, erf), the reference's with gelu_new (tanh approximation"),
    ("gemma4_text", "sliding_pad_mask_dropped", True, f"{ATTN}.probs", "padding",
     "ours gives weight to 100 earlier padding keys the other side masks"),
    ("dots3_note_text", "rope_half_split", False, f"{ATTN}.q_rot", "rope_pairing",
     "ours rotates half-split (i, i + d/2) pairs, the reference interleaved (2i, 2i + 1)"),
    ("dots3_note_text", "q_lora_scale_missing", False, f"{ATTN}.q_b_proj", "scale",
     "ours' input to it is the reference's times 0.707107 at every position"),
    ("dots3_note_text", "scale_uses_head_dim", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.176777, the reference by 0.204124 (= 1/sqrt(head_dim=24))"),
    ("dots3_note_text", "kv_b_split_blockwise", False, f"{ATTN}.k_rot", "qkv_layout",
     "kv_b_proj's output cut as whole blocks in ours"),
    ("dots3_note_text", "router_softmax", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses from a softmax over the experts instead of a sigmoid"),
    ("dots3_note_text", "router_bias_in_weights", False, "model.layers.1.mlp.router.weights", "routing_weights",
     "ours equals the biased scores (sigmoid plus e_score_correction_bias, which only the choice reads)"),
    ("dots3_note_text", "shared_expert_scaled", False, "model.layers.1.mlp", "routing_weights",
     "routed_scaling_factor applied to the routed and the shared experts' sum in ours"),
    ("dots3_note_text", "indexer_k_rmsnorm", False, f"{ATTN}.indexer.k_norm", "norm_kind",
     "ours behaves like RMSNorm over the last axis, the reference like LayerNorm"),
    ("dots3_note_text", "indexer_topk_ignores_padding", True, f"{ATTN}.o_proj", "one_change",
     "the mask's padding left out (the causal part alone: padding keys read)"),
    # named since the twenty-fifth session
    ("dots3_note_text", "sliding_window_off_by_one", False, "model.layers.1.self_attn.o_proj", "sliding_window",
     "recomputed with a window of 7 keys where the reference keeps 6"),
    ("dots3_note_text", "swa_rope_theta_global", False, "model.layers.1.self_attn.q_rot", "rope_theta",
     "ours rotates like default RoPE with theta 10000"),
    ("dots3_note_text", "gate_heads_tiled", False, f"{ATTN}.o_proj", "head_mapping",
     "the gate tiled over the channels (channel c reads head c % 4's"),
    ("dots3_note_text", "k_rope_norm_skipped", False, f"{ATTN}.k_rot", "missing",
     "model.layers.0.self_attn.k_rope_only_layernorm skipped in ours"),
]  # fmt: skip
FAST = {"v_norm_skipped", "swa_rope_theta_global", "gate_heads_tiled", "k_rope_norm_skipped"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)
