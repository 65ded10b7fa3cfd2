"""A fiftieth held-back set: Mamba (a selective scan with a causal depthwise conv, no attention and no attention heads
in its config), Falcon's new decoder (a parallel block with two LayerNorms, grouped keys and values in a fused
query_key_value laid per KV group, RoPE) and MPT (ALiBi, clip_qkv, LayerNorms without bias) user models by helpers who
never read ``parity/`` (``tests/user_models/heldout50/``, 42 bugs, five correct variants per family). The ports keep
their weights stacked per layer and transposed; Falcon's fused q/k/v split at load into stacked q, k and v weights.

Measured first in the thirtieth session (2026-12-07) on the tree that had fitted the forty-ninth set, before any fit
to this one: correct runs 24 of 36, bugs named 19 of 42 (45%), no wrong cause. Every Mamba run was refused ("num_attention_heads is
0"): a config naming no attention heads at all was read as zero heads. Fitted: such a config is attention-free (an
explicit 0 is still refused). Then Mamba: 12 of 12 correct runs, 9 of 14 bugs named; the set 28 of 42 (67%). Also
fitted: a projection reading a part of a fused output (Mamba's x_proj reading in_proj's x before the conv): 29 of 42.

Fitted in the thirty-first session: parts of per-layer fused tensors stacked (Falcon's query_key_value split at load
into q, k and v weights, each stacked per layer and kept input-major, ``(layers, hidden, heads * head_dim)``) are a
layout the loader coverage traces (``coverage._stacked_parts``), so the attention's internals are tapped: 13 of
Falcon's 14 bugs named (its residual taken after the norm is still generic), the set 37 of 42.

Left, asserted here at their node only (``LOCATED``): Mamba's x_proj split order, dt clamp and stale residual, and its
conv weights reshaped (layers, taps, channels) where they need a transpose (a stack of reshaped keys is traced to
none); Falcon's residual taken after the norm.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout50"))

import heldout50_falcon
import heldout50_mamba
import heldout50_mpt

MODELS = {"mamba": heldout50_mamba, "falcon": heldout50_falcon, "mpt": heldout50_mpt}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "mamba": dict(
            num_key_value_heads=None, num_attention_heads=None, state_size=8, expand=2, conv_kernel=4,
            time_step_rank=8, use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, residual_in_fp32=True,
            tie_word_embeddings=True,
        ),
        "falcon": dict(
            num_key_value_heads=None, num_kv_heads=2, new_decoder_architecture=True, multi_query=False,
            parallel_attn=True, num_ln_in_parallel_attn=2, bias=False, alibi=False, ffn_hidden_size=128,
            activation="gelu", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "mpt": dict(
            num_key_value_heads=None, d_model=64, n_heads=4, n_layers=4, max_seq_len=256, expansion_ratio=2,
            no_bias=True, attn_config={"clip_qkv": 2.0, "alibi": True, "alibi_bias_max": 8}, layer_norm_epsilon=1e-5,
            use_cache=False,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout50"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("mamba", "", True),  # no attention heads in its config: checked, not refused
    ("falcon", "fold_ln", False),  # the LayerNorms' gains and biases folded into the projections after them
    ("mpt", "alibi_relative", True),  # ALiBi as -m (i - j) from the positions, a shift per row the softmax ignores
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


MIXER = "backbone.layers.0.mixer"
ATTN = "transformer.blocks.0.attn"
FALCON = "transformer.h.0.self_attention"
NAMED = [
    ("mamba", "a_missing_exp", False, f"{MIXER}.out_proj", "one_change", "exp left out"),
    ("mamba", "dt_bias_after_softplus", False, f"{MIXER}.out_proj", "one_change",
     "dt_proj.bias added after the softplus instead of to its input"),
    ("mamba", "conv_wrong_trim", False, f"{MIXER}.x_proj", "sequence_shift",
     "a causal convolution padded on the wrong side reads the future"),
    ("mamba", "gate_sigmoid", False, f"{MIXER}.out_proj", "one_change", "sigmoid in place of silu"),
    ("mamba", "d_skip_after_gate", False, f"{MIXER}.out_proj", "one_change",
     "the skip D x added after the output gate silu(z), not before it"),
    ("mamba", "norm_mean_centered", False, "backbone.layers.0.norm", "norm_kind",
     "ours behaves like LayerNorm (mean-subtracting), the reference like RMSNorm"),
    ("mamba", "scan_output_before_update", False, f"{MIXER}.out_proj", "one_change",
     "its state read for the output C h before this step's write"),
    ("mamba", "zoh_discretize_b", False, f"{MIXER}.out_proj", "one_change",
     "B discretised by zero-order hold, not Mamba's dt B"),
    ("mamba", "mask_post_conv_missing", True, f"{MIXER}.out_proj", "one_change",
     "the broadcast factor of shape (2, 24, 1) left out (a mask or a scale)"),
    ("mamba", "xproj_pre_conv", False, f"{MIXER}.x_proj", "projection_input",
     "its input is the reference's backbone.layers.0.mixer.in_proj[0:128]"),
    ("falcon", "single_ln_parallel", False, "transformer.h.0.ln_mlp", "swapped_weights",
     "ours matches the reference's transformer.h.0.ln_attn instead"),
    ("falcon", "rope_interleaved", False, f"{FALCON}.q_rot", "rope_pairing", "ours rotates interleaved (2i, 2i + 1)"),
    ("falcon", "qkv_split_blocked", False, f"{FALCON}.q_rot", "qkv_layout",
     "read stacked [q; k; v], in the reference per KV group (kv_heads, group + 2, head_dim)"),
    ("falcon", "kv_head_tile", False, f"{FALCON}.k_rot", "head_mapping", "ours head 1 = reference head 3"),
    ("falcon", "ln_attn_mlp_swapped", False, f"{FALCON}.query_key_value[rows 0, 1, 2, 3, ...]", "projection_input",
     "its input is the reference's transformer.h.0.ln_mlp"),
    ("falcon", "rope_dim_hidden", False, f"{FALCON}.q_rot", "rope_frequencies",
     "ours rotates with theta^(-2i / 64) (hidden_size)"),
    ("falcon", "scale_no_sqrt", False, f"{FALCON}.scores", "attention_scale",
     "ours scales q k^T by 0.0625 (= 1/head_dim"),
    ("falcon", "pad_mask_axis", True, f"{FALCON}.probs", "padding", "laid along the queries"),
    ("falcon", "causal_diag_off_by_one", False, f"{FALCON}.probs", "causal_mask",
     "ours gives the key at the query's own position no weight"),
    ("falcon", "alibi_is_not_none", False, f"{FALCON}.q_rot", "rope_missing", "ours applies no rotation here"),
    ("falcon", "ln_unbiased_var", False, "transformer.h.0.ln_attn", "norm_kind",
     "ours normalises by the unbiased variance"),
    ("falcon", "merge_heads_no_transpose", False, f"{FALCON}.dense", "head_layout",
     "ours' dense input is the context (batch, heads, seq, head_dim) reshaped"),
    ("falcon", "sequential_block", False, "transformer.h.0.ln_mlp", "block_layout",
     "the ln_mlp of ours is computed from the residual after attention (sequential block)"),
    ("mpt", "scale_hidden_size", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.125 (= 1/sqrt(hidden_size=64))"),
    ("mpt", "alibi_slope_offbyone", False, f"{ATTN}.probs", "alibi", "ours with the exponents counted from 0"),
    ("mpt", "alibi_before_scale", False, f"{ATTN}.probs", "alibi",
     "ours with the standard slopes times 0.25 (the bias scaled with the scores)"),
    ("mpt", "clip_qkv_ignored", False, f"{ATTN}.q_rot", "clamp",
     "its q_rot is the other side's clamped to [-2, 2]"),
    ("mpt", "qkv_head_interleaved", False, f"{ATTN}.q_rot", "qkv_layout",
     "read per head (heads, 3, head_dim): GPT-NeoX / BLOOM, in the reference stacked [q; k; v]"),
    ("mpt", "causal_excludes_diag", False, f"{ATTN}.probs", "causal_mask",
     "ours gives the key at the query's own position no weight"),
    ("mpt", "rmsnorm", False, "transformer.blocks.0.norm_1", "norm_kind",
     "ours behaves like RMSNorm over the last axis, the reference like LayerNorm"),
    ("mpt", "gelu_tanh", False, "transformer.blocks.0.ffn.down_proj", "activation",
     "ours equals gelu_new (tanh approximation, op by op)"),
    ("mpt", "mlp_stale_residual", False, "transformer.blocks.1.norm_1", "residual",
     "transformer.blocks.0.attn.out_proj missing in ours"),
    ("mpt", "out_proj_untransposed", False, "transformer.blocks.0.norm_2", "one_change",
     "transformer.blocks.0.attn.out_proj.weight read transposed"),
    ("mpt", "merge_heads_no_transpose", False, f"{ATTN}.out_proj", "head_layout", "without moving the heads axis"),
    ("mpt", "layernorm_bf16", False, "transformer.blocks.0.norm_1", "precision", "computed in bfloat16 in ours"),
    ("mpt", "pad_mask_query_axis", True, f"{ATTN}.probs", "padding", "laid along the queries"),
    ("mpt", "pad_mask_right_aligned", True, f"{ATTN}.probs", "padding", "the mask built for right padding"),
]  # fmt: skip
FAST = {"a_missing_exp", "sequential_block", "alibi_before_scale", "scale_no_sqrt"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


#: located at their node, with no hint that names the cause (the next session's work: see the module docstring)
LOCATED = [
    ("mamba", "xproj_split_order", False, f"{MIXER}.out_proj"),
    ("mamba", "conv_weight_reshape", False, f"{MIXER}.x_proj"),
    ("mamba", "residual_after_norm", False, "backbone.layers.1.norm"),
    ("mamba", "dt_clamped_init_range", False, f"{MIXER}.out_proj"),
    ("falcon", "residual_after_norm", False, "transformer.h.1.ln_attn"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded", "node"), LOCATED, indirect=["bug"], ids=str)
def test_a_bug_not_yet_named_is_still_located(model, bug, padded, node, checkpoints):
    assert not heldout_support.independent_max_diff(MODELS[model], checkpoints[model], padded) <= 1e-6
    res = heldout_support.check(MODELS, checkpoints, model, padded)
    assert res.first_mismatch is not None and res.first_mismatch.name == node, res.verdict()
