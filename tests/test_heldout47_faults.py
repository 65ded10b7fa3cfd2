"""A forty-seventh held-back set: DeepSeek-V3 (latent attention with interleaved RoPE rows and YaRN, a group-limited
sigmoid router with a correction bias, routed_scaling_factor), GPT-NeoX-Japanese (a fused per-head q/k/v, partial
rotary, the attention's bias added beside its projection, tied embeddings) and Phi-3 (LongRoPE with short and long
factors and its attention factor, partial rotary, a sliding window, fused qkv and gate/up) user models by helpers who
never read ``parity/`` (``tests/user_models/heldout47/``, 42 bugs, five correct variants per family). The ports keep
their weights stacked per layer and transposed (in -> out), DeepSeek's kv_b_proj split per head into its key and
value up-projections.

Measured first in the thirtieth session (2026-12-07) on the tree that had fitted the forty-sixth set, before any fit
to this one: correct runs 36 of 36, bugs named 27 of 42 (64%). Phi-3's LongRoPE bugs went unread (the reference's
input to RoPE was not found: at position 0 its rotated dims carry LongRoPE's cos/sin factor), a partial rotary's
interleaved pairs with a table for halves read as "frequencies", a RMSNorm normalising by the variance, heads merged
without the transpose before NeoX's ``dense``, a parallel block read as "the add's second term left out" (its
``dense_bias`` beside the projection), MLA's kv_b_proj unpacked (dims, heads), one row's positions over a padded MLA
batch, a group count from num_experts_per_tok read as "no group limit". Each fitted by kind; the reference-side tests
below put the same kinds in a patched Transformers model.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout47"))

import heldout47_deepseek_v3
import heldout47_gpt_neox_japanese
import heldout47_phi3

MODELS = {
    "deepseek_v3": heldout47_deepseek_v3,
    "gpt_neox_japanese": heldout47_gpt_neox_japanese,
    "phi3": heldout47_phi3,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "deepseek_v3": dict(
            num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True, rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            },
        ),
        "gpt_neox_japanese": dict(
            num_key_value_heads=None, intermediate_multiple_size=2, hidden_act="gelu", layer_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            tie_word_embeddings=True,
        ),
        "phi3": dict(
            intermediate_size=128, original_max_position_embeddings=64, sliding_window=16, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
            },
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout47"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("deepseek_v3", "absorbed_mla", True),  # q_nope folded through the key up-projection, attention over the latent
    ("gpt_neox_japanese", "", True),  # the fused per-head q/k/v reordered into [q | k | v] blocks at load
    ("phi3", "complex_rope", False),  # LongRoPE as a complex product, its attention factor in the modulus
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
NEOX = "gpt_neox_japanese.layers.0"
ROUTED = "model.layers.2.input_layernorm"
NAMED = [
    ("deepseek_v3", "mscale_once", False, f"{ATTN}.scores", "attention_scale",
     "times the YaRN softmax mscale once (not squared)"),
    ("deepseek_v3", "yarn_no_truncate", False, Q, "rope_band", "its correction range's bounds left unrounded"),
    ("deepseek_v3", "yarn_attn_factor", False, Q, "scale", "the default YaRN attention factor 0.1 ln(4) + 1"),
    ("deepseek_v3", "rope_not_interleaved", False, Q, "rope_pairing",
     "ours rotates half-split (i, i + d/2) pairs, the reference interleaved (2i, 2i + 1)"),
    ("deepseek_v3", "kv_split_order", False, f"{ATTN}.kv_a_layernorm", "qkv_layout",
     "ours' kv_a_layernorm reads its columns [8:40], the reference's [0:32] of 40"),
    ("deepseek_v3", "kv_b_head_axis", False, f"{ATTN}.k_rot", "qkv_layout",
     "kv_b_proj's output (or weight rows) unpacked with the axes the other way round in ours: as (28, heads)"),
    ("deepseek_v3", "router_softmax", False, ROUTED, "one_change", "softmax over the last axis in place of sigmoid"),
    ("deepseek_v3", "bias_in_weights", False, ROUTED, "routing_weights", "the correction bias kept in the weights"),
    ("deepseek_v3", "group_score_max", False, ROUTED, "routing_weights",
     "each group scored by its best expert (max), not its two best summed in ours"),
    ("deepseek_v3", "scale_then_norm", False, ROUTED, "routing_weights", "routed_scaling_factor not applied"),
    ("deepseek_v3", "topk_group_misread", False, ROUTED, "routing_weights",
     "experts chosen from the best 3 groups (num_experts_per_tok) where topk_group keeps 2 in ours"),
    ("deepseek_v3", "positions_first_row", True, Q, "position_offset",
     "ours rotates batch row(s) 1 at the positions of row(s) 0"),
    ("deepseek_v3", "pad_mask_queries", True, f"{ATTN}.o_proj", "one_change", "the mask's padding left out"),
    ("gpt_neox_japanese", "qkv_split_blocked", False, f"{NEOX}.attention.q_rot", "qkv_layout",
     "read stacked [q; k; v], in the reference per head (heads, 3, head_dim)"),
    ("gpt_neox_japanese", "rope_interleaved", False, f"{NEOX}.attention.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs with the table's frequencies concatenated cat(f, f), the reference "
     "half-split (i, i + d/2) pairs with them concatenated cat(f, f) (a table laid out for the other pairing"),
    ("gpt_neox_japanese", "rope_freq_head_dim", False, f"{NEOX}.attention.q_rot", "rope_frequencies",
     "whose exponents divide by head_dim (16), not by the rotary dims (8)"),
    ("gpt_neox_japanese", "rope_bf16_angles", False, f"{NEOX}.attention.q_rot", "rope_frequencies",
     "RoPE frequencies off in their last bits"),
    ("gpt_neox_japanese", "score_scale_rotary", False, f"{NEOX}.attention.scores", "attention_scale",
     "ours scales q k^T by 0.353553 (= 1/sqrt(rotary_dim=8))"),
    ("gpt_neox_japanese", "parallel_residual", False, f"{NEOX}.post_attention_layernorm", "block_layout",
     "ours is computed from the layer's input (parallel block), the reference's from the residual after attention"),
    ("gpt_neox_japanese", "ln_unbiased_var", False, f"{NEOX}.input_layernorm", "norm_kind",
     "ours normalises by the unbiased variance"),
    ("gpt_neox_japanese", "gelu_quick", False, f"{NEOX}.mlp.dense_4h_to_h", "activation",
     "ours equals quick_gelu of the reference's"),
    ("gpt_neox_japanese", "pad_mask_query_axis", True, f"{NEOX}.attention.probs", "padding", "laid along the queries"),
    ("gpt_neox_japanese", "causal_diag_masked", False, f"{NEOX}.attention.probs", "causal_mask",
     "ours gives the key at the query's own position no weight"),
    ("gpt_neox_japanese", "merge_heads_no_permute", False, f"{NEOX}.attention.dense", "head_layout",
     "ours' dense input is the context (batch, heads, seq, head_dim) reshaped to (batch, seq, heads * head_dim) "
     "without moving the heads axis"),
    ("gpt_neox_japanese", "softmax_query_axis", False, f"{NEOX}.attention.probs", "softmax_axis",
     "sum to 1 over the queries"),
    ("gpt_neox_japanese", "residual_from_ln", False, f"{NEOX}.post_attention_layernorm", "residual",
     "the residual taken from another point"),
    ("phi3", "sliding_window_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 17, the reference with a window of 16"),
    ("phi3", "attn_factor_log_max_pos", False, Q, "rope_attention_factor",
     "ours takes LongRoPE's sqrt(1 + ln(4) / ln(max_position_embeddings 256)), the reference LongRoPE's "
     "sqrt(1 + ln(4) / ln(original_max_position_embeddings 64))"),
    ("phi3", "long_factor_static", False, Q, "rope_scaling",
     "ours rotates like LongRoPE with long_factor (the frequencies divided by its factors) where the config takes "
     "the other list"),
    ("phi3", "ext_factor_multiplied", False, Q, "rope_scaling",
     "LongRoPE with its short_factor multiplying the frequencies (inv_freq * factor) where LongRoPE divides them"),
    ("phi3", "rope_interleaved_pairs", False, Q, "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs with the table's frequencies repeated per pair"),
    ("phi3", "inv_freq_exponent_head_dim", False, Q, "rope_scaling",
     "LongRoPE whose exponents divide by head_dim (16), not by the rotary dims (12)"),
    ("phi3", "gate_up_order_swapped", False, "model.layers.0.mlp.down_proj", "swapped_weights",
     "ours reads its output as halves the other way round [up; gate]"),
    ("phi3", "gqa_tile_not_interleave", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("phi3", "rmsnorm_centered", False, "model.layers.0.input_layernorm", "norm_kind",
     "ours normalises by the variance for the mean of squares (x / sqrt(var(x) + eps)"),
    ("phi3", "softmax_scale_rotary_dim", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.288675 (= 1/sqrt(rotary_dim=12)"),
    ("phi3", "pad_mask_on_queries", True, f"{ATTN}.probs", "padding", "laid along the queries"),
    ("phi3", "rope_table_bf16", False, Q, "rope_frequencies", "RoPE frequencies off in their last bits"),
    ("phi3", "rope_on_last_dims", False, Q, "rope_partial",
     "the reference rotates 12 of 16 dims (0, 1, 2, 3, 4, 5, 6, 7, ...) of each head and leaves the rest as they are, "
     "ours rotates 12 of 16 dims (4, 5, 6, 7, 8, 9, 10, 11, ...)"),
]  # fmt: skip
FAST = {"attn_factor_log_max_pos", "rope_interleaved", "rmsnorm_centered", "kv_b_head_axis", "merge_heads_no_permute"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


REFUSED = [
    ("gpt_neox_japanese", "dense_bias_dropped", "gpt_neox_japanese.layers.3.attention.dense_bias"),
    ("phi3", "lm_head_tied_to_embedding", "w_head holds model.embed_tokens.weight, as embed does"),
    ("deepseek_v3", "expert_gate_up_interleaved",
     "it holds every other slice of model.layers.1.mlp.experts.gate_up_proj along axis 1"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "bug", "says"), REFUSED)
def test_a_weight_never_loaded_is_refused_by_name(model, bug, says, checkpoints):
    """NeoX-Japanese's last layer's dense_bias skipped; Phi-3's head taken from the embedding (tie_word_embeddings is
    false); DeepSeek's fused experts' gate/up read as interleaved rows: refused before any run, with what holds the
    tensor's place."""
    MODELS[model].BUG = bug
    try:
        heldout_support.assert_refused(MODELS, checkpoints, model, says)
    finally:
        MODELS[model].BUG = ""


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def _phi3_rotary(ref):
    return ref.model.rotary_emb


def test_a_reference_taking_longropes_long_factors_is_named(checkpoints):
    """Phi-3's reference rotating with long_factor on a sequence that fits original_max_position_embeddings."""
    ref = heldout_support.reference_model(checkpoints["phi3"])
    rotary = _phi3_rotary(ref)
    long = torch.tensor(ref.config.rope_parameters["long_factor"])
    base = 1.0 / (10000.0 ** (torch.arange(0, 12, 2).float() / 12))
    for name in ("inv_freq", "original_inv_freq"):
        setattr(rotary, name, base / long)
    bad = heldout_support.first_mismatch(MODELS, "phi3", ref)
    assert bad.name == Q and bad.hint.kind == "rope_scaling", bad
    assert "the reference rotates like LongRoPE with long_factor" in bad.hint.text


def test_a_reference_taking_longropes_factor_from_max_positions_is_named(checkpoints):
    """Phi-3's reference with LongRoPE's attention factor over ln(max_position_embeddings)."""
    ref = heldout_support.reference_model(checkpoints["phi3"])
    _phi3_rotary(ref).attention_scaling = math.sqrt(1 + math.log(4) / math.log(256))
    bad = heldout_support.first_mismatch(MODELS, "phi3", ref)
    assert bad.name == Q and bad.hint.kind == "rope_attention_factor", bad
    assert "the reference takes LongRoPE's sqrt(1 + ln(4) / ln(max_position_embeddings 256))" in bad.hint.text


def test_a_reference_rms_norm_dividing_by_the_variance_is_named(checkpoints):
    """Phi-3's first norm in the reference: x / sqrt(var(x) + eps), the mean subtracted in the statistic only."""
    ref = heldout_support.reference_model(checkpoints["phi3"])
    norm = ref.model.layers[0].input_layernorm

    def by_variance(self, x):  # a method: the float64 run's copy of the model calls it with its own weight
        return self.weight * x / (x.var(-1, unbiased=False, keepdim=True) + self.variance_epsilon).sqrt()

    norm.forward = types.MethodType(by_variance, norm)
    bad = heldout_support.first_mismatch(MODELS, "phi3", ref)
    assert bad.name == "model.layers.0.input_layernorm" and bad.hint.kind == "norm_kind", bad
    assert "the reference by the variance for the mean of squares" in bad.hint.text


def test_a_reference_running_a_parallel_block_is_named(checkpoints):
    """GPT-NeoX-Japanese's last layer in the reference as a parallel block, x + (attn(N1(x)) + dense_bias) +
    mlp(N2(x)): its attention's bias (the last layer's only) added beside the projection, so the stream after
    attention is no node's sum."""
    ref = heldout_support.reference_model(checkpoints["gpt_neox_japanese"])
    layer = ref.gpt_neox_japanese.layers[3]

    def parallel(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        attn, weights, bias = self.attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
        return hidden_states + attn + bias + self.mlp(self.post_attention_layernorm(hidden_states)), weights

    layer.forward = types.MethodType(parallel, layer)
    bad = heldout_support.first_mismatch(MODELS, "gpt_neox_japanese", ref)
    assert bad.name == "gpt_neox_japanese.layers.3.post_attention_layernorm" and bad.hint.kind == "block_layout", bad
    assert "the reference's from the layer's input (parallel block)" in bad.hint.text


def test_a_reference_rotating_pairs_with_a_table_for_halves_is_named(checkpoints, monkeypatch):
    """GPT-NeoX-Japanese's reference turning interleaved pairs with its cat(f, f) table (rotate_every_two)."""
    from transformers.models.gpt_neox_japanese import modeling_gpt_neox_japanese as neox

    def every_two(x):
        return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)

    monkeypatch.setattr(neox, "rotate_half", every_two)
    ref = heldout_support.reference_model(checkpoints["gpt_neox_japanese"])
    bad = heldout_support.first_mismatch(MODELS, "gpt_neox_japanese", ref)
    assert bad.name == f"{NEOX}.attention.q_rot" and bad.hint.kind == "rope_pairing", bad
    assert "the reference interleaved (2i, 2i + 1) pairs with them concatenated cat(f, f)" in bad.hint.text


def test_a_reference_keeping_another_group_count_is_named(checkpoints):
    """DeepSeek-V3's reference routers keeping num_experts_per_tok groups where topk_group says 2."""
    ref = heldout_support.reference_model(checkpoints["deepseek_v3"])
    for layer in ref.model.layers[1:]:
        layer.mlp.gate.topk_group = 3
    bad = heldout_support.first_mismatch(MODELS, "deepseek_v3", ref)
    assert bad.name == ROUTED and bad.hint.kind == "routing_weights", bad
    assert "experts chosen from the best 3 groups (num_experts_per_tok) where topk_group keeps 2" in bad.hint.text
