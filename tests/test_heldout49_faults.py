"""A forty-ninth held-back set: Qwen2 (q/k/v biases, sliding-window layers from max_window_layers, tied embeddings),
OLMo 2 (q/k norms over the whole projection, post-norms inside each branch) and Phi (a parallel block, partial rotary,
LayerNorms and biases, a fused q/k/v, an output head with a bias) user models by helpers who never read ``parity/``
(``tests/user_models/heldout49/``, 42 bugs, five correct variants per family). The ports keep their weights stacked
per layer, most transposed; OLMo 2's q and k gains side by side in one row per layer.

Measured first in the thirtieth session (2026-12-07) on the tree that had fitted the forty-eighth set, before any fit
to this one: correct runs 36 of 36, bugs named 41 of 42 (98%), no wrong cause. The one not named: OLMo 2's square
o_proj weights stacked as stored, ``(layers, out, in)``, where its other weights are transposed, read as "values
computed at load" (a stack of matrices as stored was traced to no checkpoint tensor). Fitted by kind: matrices
stacked with their last axis kept are rows of the checkpoint's. Most of this set's bug kinds are kinds earlier sets
already held (the helpers' bugs are the field's common ones): the first measure says the hints hold on popular
families, not that new kinds are named.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout49"))

import heldout49_olmo2
import heldout49_phi
import heldout49_qwen2

MODELS = {"qwen2": heldout49_qwen2, "olmo2": heldout49_olmo2, "phi": heldout49_phi}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "qwen2": dict(
            intermediate_size=128, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=True,
            sliding_window=8, max_window_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        "olmo2": dict(
            intermediate_size=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        "phi": dict(
            num_key_value_heads=4, intermediate_size=128, hidden_act="gelu_new", layer_norm_eps=1e-5,
            qk_layernorm=False, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout49"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("qwen2", "window_by_positions", True),  # the window read from position differences
    ("olmo2", "", True),  # q and k gains side by side in one row per layer, norms over the whole projection
    ("phi", "mlp_chunked", False),  # the MLP over chunks of the intermediate size, fc2's partial products summed
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


ATTN = "model.layers.0.self_attn"
Q = f"{ATTN}.q_rot"
NAMED = [
    ("qwen2", "qkv_bias_after_rope", False, f"{ATTN}.q_proj", "bias", "a query or key bias added after RoPE"),
    ("qwen2", "window_layers_inverted", False, f"{ATTN}.probs", "sliding_window",
     "this is a full_attention layer in the config, and ours attends as its sliding_attention layers do"),
    ("qwen2", "window_off_by_one", False, "model.layers.2.self_attn.probs", "sliding_window",
     "ours attends with a window of 9, the reference with a window of 8"),
    ("qwen2", "rope_theta_default", False, Q, "rope_theta", "ours rotates like default RoPE with theta 10000"),
    ("qwen2", "rope_interleaved", False, Q, "rope_pairing", "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("qwen2", "norm_weight_plus_one", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("qwen2", "gqa_repeat_tiled", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("qwen2", "scale_by_hidden", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.125 (= 1/sqrt(hidden_size=64))"),
    ("qwen2", "sliding_mask_drops_padding", True, "model.layers.2.self_attn.probs", "padding",
     "ours gives weight to 100 earlier padding keys the other side masks"),
    ("qwen2", "pad_mask_on_queries", True, f"{ATTN}.probs", "padding", "laid along the queries"),
    ("qwen2", "gate_up_swapped", False, "model.layers.0.mlp.down_proj", "swapped_roles",
     "ours applies the activation (silu) to up_proj's output"),
    ("qwen2", "embed_scaled", False, "model.layers.0.input_layernorm", "scale", "matches sqrt(hidden_size=64)"),
    ("qwen2", "attn_merge_no_transpose", False, f"{ATTN}.o_proj", "head_layout", "without moving the heads axis"),
    ("qwen2", "rope_angles_bf16", False, Q, "rope_frequencies", "RoPE frequencies off in their last bits"),
    ("olmo2", "qk_norm_per_head", False, f"{ATTN}.q_norm", "norm_kind",
     "ours normalises by one RMS per head (4 heads of 16: a per-head norm where the norm spans the whole projection)"),
    ("olmo2", "qk_norm_after_rope", False, f"{ATTN}.q_norm", "norm_placement", "ours' q_norm reads its input after RoPE"),
    ("olmo2", "norm_after_residual", False, "model.layers.0.post_attention_layernorm", "norm_placement",
     "normalises the sum after the residual add"),
    ("olmo2", "rope_interleaved", False, Q, "rope_pairing", "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("olmo2", "rope_theta_default", False, Q, "rope_theta", "ours rotates like default RoPE with theta 10000"),
    ("olmo2", "double_scale", False, f"{ATTN}.scores", "attention_scale", "1/sqrt(head_dim=16) applied twice"),
    ("olmo2", "gqa_tile", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("olmo2", "gate_up_swapped", False, "model.layers.0.mlp.down_proj", "swapped_roles",
     "ours applies the activation (silu) to up_proj's output"),
    ("olmo2", "mask_added_raw", True, f"{ATTN}.probs", "padding",
     "a 0/1 attention_mask added to the scores as it is, where the padding needs a large negative"),
    ("olmo2", "lm_head_tied", False, "logits", "untied_head", "its logits are lm_head's input times model.embed_tokens"),
    ("olmo2", "norm_weight_plus_one", False, f"{ATTN}.q_norm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("olmo2", "causal_diag_offset", False, f"{ATTN}.probs", "causal_mask", "so a query reads the future"),
    ("olmo2", "o_proj_not_transposed", False, "model.layers.0.post_attention_layernorm", "one_change",
     "model.layers.0.self_attn.o_proj.weight read transposed (a square weight's last two axes swapped at load)"),
    ("olmo2", "post_norms_swapped", False, "model.layers.0.post_attention_layernorm", "swapped_weights",
     "the weights of post_feedforward_layernorm and post_attention_layernorm loaded into each other's places"),
    ("phi", "rope_freq_head_dim", False, Q, "rope_frequencies",
     "whose exponents divide by head_dim (16), not by the rotary dims (8)"),
    ("phi", "rope_interleaved", False, Q, "rope_pairing", "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("phi", "rope_angle_bf16", False, Q, "rope_frequencies", "RoPE frequencies off in their last bits"),
    ("phi", "scale_rotary_dim", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.353553 (= 1/sqrt(rotary_dim=8))"),
    ("phi", "sequential_block", False, "model.layers.0.mlp.fc1", "block_layout",
     "the input of fc1 of ours is computed from the residual after attention (sequential block), the reference's "
     "from the layer's input (parallel block)"),
    ("phi", "gelu_quick", False, "model.layers.0.mlp.fc2", "activation", "ours equals quick_gelu of the reference's"),
    ("phi", "ln_unbiased_var", False, "model.layers.0.input_layernorm", "norm_kind",
     "ours normalises by the unbiased variance"),
    ("phi", "lm_head_no_bias", False, "lm_head", "bias", "ours adds none at lm_head"),
    ("phi", "tie_embeddings", False, "logits", "untied_head", "its logits are lm_head's input times model.embed_tokens"),
    ("phi", "qkv_unpack_per_head", False, Q, "qkv_layout",
     "read per head (heads, 3, head_dim): GPT-NeoX / BLOOM, in the reference stacked [q; k; v]"),
    ("phi", "merge_heads_no_transpose", False, f"{ATTN}.dense", "head_layout",
     "ours' dense input is the context (batch, heads, seq, head_dim) reshaped"),
    ("phi", "causal_off_by_one", False, f"{ATTN}.probs", "causal_mask", "so a query reads the future"),
    ("phi", "dense_not_transposed", False, "model.layers.1.input_layernorm", "one_change",
     "model.layers.0.self_attn.dense.weight read transposed"),
    ("phi", "pad_mask_query_axis", True, f"{ATTN}.probs", "padding", "laid along the queries"),
]  # fmt: skip
FAST = {"o_proj_not_transposed", "mask_added_raw", "window_layers_inverted", "qkv_unpack_per_head"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)
