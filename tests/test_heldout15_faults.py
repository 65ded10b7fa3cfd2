"""A fifteenth held-back set: HunYuan dense, ERNIE 4.5 and GraniteMoE user models by a helper who never read ``parity/``.

``tests/user_models/heldout15/``: a HunYuan dense v1 (per-head query/key RMS norms applied after RoPE, RoPE
with a fixed NTK alpha, head_dim 24 beside hidden/heads 16, biases on q/k/v/o), an ERNIE 4.5 (interleaved
RoPE pairs, a bias on every projection, a tied head) and a GraniteMoE (embedding, attention and residual
multipliers, logits_scaling, a top-2 router over stacked experts with a square down projection), each over
its own parameter names and layouts. 36 bugs, five correct variants per family.

Its first measure (2026-12-03, ninth session, with the fourteenth set's fixes and nothing fitted to this
set): 17 of 36 correct runs passed (every ERNIE run failed a shape at ``embed_tokens``: a tied table held at
the model's root aligned as the model's output; GraniteMoE's embedding multiplier and residual multiplier
folded into the weights, and its router compared at a padding token; HunYuan's key gain folded into the
query's); 13 of 36 hints named the cause, 3 loader bugs were refused naming it, 14 a wrong node or cause
(11 of them ERNIE's false shape at ``embed_tokens``), 5 none, 1 passed (``hy_positions_from_mask``: positions derived from the mask when none are
given, which parity accepts by design: a generation loop passes them). The fixes by kind are asserted below.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout15"))

import heldout15_ernie4_5
import heldout15_granitemoe
import heldout15_hunyuan_v1_dense

MODELS = {
    "hunyuan_v1_dense": heldout15_hunyuan_v1_dense,
    "ernie4_5": heldout15_ernie4_5,
    "granitemoe": heldout15_granitemoe,
}


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helper's weights: norm weights around 1, biases ~0.3, token embeddings with a per-row scale, a
    router of twice the gain, other matrices of unit gain."""
    for name, p in model.named_parameters():
        parts = name.lower().split(".")
        if parts[-1] == "weight" and "norm" in parts[-2]:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 + torch.rand(p.shape[0], 1, generator=gen)))
        elif name.endswith("router.weight"):
            p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    specs = {
        "hunyuan_v1_dense": T.HunYuanDenseV1Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5, attention_bias=True, max_position_embeddings=256,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 100.0, "factor": 1.0},
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "ernie4_5": T.Ernie4_5Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5, use_bias=True, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "granitemoe": T.GraniteMoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256, embedding_multiplier=4.0,
            attention_multiplier=0.0625, residual_multiplier=0.5, logits_scaling=4.0, num_local_experts=8,
            num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    }  # fmt: skip
    return heldout_support.save_checkpoints(tmp_path_factory.mktemp("heldout15"), specs, randomise, 5000, 8511)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("ernie4_5", "", False),
    ("hunyuan_v1_dense", "key_gain_folded_into_query", False),
    ("granitemoe", "multipliers_folded", False),
    ("granitemoe", "residual_multiplier_folded", True),
    ("granitemoe", "sdpa", True),
]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN)


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """ERNIE: its tied table at the model's root, read by indexing (the embedding) and by a product (the head).
    HunYuan: the key norm's gain and the softmax scale folded into the query's gain (the block's inner nodes
    differ by design, its output agrees). GraniteMoE: the embedding multiplier folded into a copy of the
    table, 1 / logits_scaling into the head and attention_multiplier into q; residual_multiplier folded into
    o_proj and every expert's down projection (stacked, transposed); SDPA, its router's choice at a padding
    token not judged."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


def test_a_fold_that_moves_values_between_nodes_is_said_not_judged(checkpoints):
    """HunYuan's folded key gain: q_rot and k_rot (after the norms, which ours holds no tensor of) differ from
    the reference's by design; they are untapped with the reason, and the scores after them agree."""
    heldout15_hunyuan_v1_dense.BUG = "key_gain_folded_into_query"
    try:
        res = heldout_support.check(MODELS, checkpoints, "hunyuan_v1_dense")
    finally:
        heldout15_hunyuan_v1_dense.BUG = ""
    nodes = {r.name: r for r in res.nodes}
    folded = nodes["model.layers.0.self_attn.q_rot"]
    assert folded.status == "untapped" and "computed at load from" in folded.detail, folded
    assert nodes["model.layers.0.self_attn.scores"].status == "ok"


NAMED = [
    ("hunyuan_v1_dense", "hy_qk_norm_before_rope", False, "model.layers.0.self_attn.query_layernorm",
     "norm_placement", "ours' query_layernorm reads q before RoPE"),
    ("hunyuan_v1_dense", "hy_ntk_alpha_ignored", False, "model.layers.0.self_attn.query_layernorm", "rope_scaling",
     "NTK alpha 100 left out"),
    ("hunyuan_v1_dense", "hy_ntk_alpha_base_linear", False, "model.layers.0.self_attn.query_layernorm", "rope_theta",
     "the exponent d / (d - 2) left out"),
    ("hunyuan_v1_dense", "hy_ntk_alpha_dim_from_hidden", False, "model.layers.0.self_attn.query_layernorm",
     "rope_theta", "with d = hidden_size / num_heads (16), not the rotary dims (24)"),
    ("hunyuan_v1_dense", "hy_qk_norm_across_heads", False, "model.layers.0.self_attn.q_rot", "norm_kind",
     "statistic over every head's features together in ours"),
    ("hunyuan_v1_dense", "hy_rope_interleaved_pairs", False, "model.layers.0.self_attn.query_layernorm",
     "rope_pairing", "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("hunyuan_v1_dense", "hy_gqa_tiled_heads", False, "model.layers.0.self_attn.scores", "head_mapping",
     "repeat instead of repeat_interleave"),
    ("hunyuan_v1_dense", "hy_scale_from_hidden_heads", False, "model.layers.0.self_attn.scores", "attention_scale",
     "ours / reference = 1.22474"),
    ("hunyuan_v1_dense", "hy_block_norms_swapped", False, "model.layers.0.input_layernorm", "swapped_weights",
     "loaded into each other's places"),
    ("ernie4_5", "er_rope_half_split", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "ours rotates half-split (i, i + d/2) pairs"),
    ("ernie4_5", "er_rope_tables_catted", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "with the table's frequencies concatenated cat(f, f)"),
    ("ernie4_5", "er_rope_theta_template_default", False, "model.layers.0.self_attn.q_rot", "rope_theta",
     "ours rotates like default RoPE with theta 10000"),
    ("ernie4_5", "er_rope_dim_from_hidden", False, "model.layers.0.self_attn.q_rot", "rope_frequencies",
     "exponents divide by hidden_size / num_heads (16)"),
    ("ernie4_5", "er_embed_scaled_sqrt_hidden", False, "model.layers.0.input_layernorm", "scale",
     "matches sqrt(hidden_size=64)"),
    ("ernie4_5", "er_norm_gain_plus_one", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w"),
    ("ernie4_5", "er_residual_from_normed", False, "model.layers.0.post_attention_layernorm", "residual",
     "it adds f(x) = model.layers.0.self_attn.o_proj to the reference's model.layers.0.input_layernorm"),
    ("ernie4_5", "er_causal_dropped_with_mask", False, "logits (with an all-ones attention_mask)", "causal_mask",
     "the causal triangle built only when no mask is given"),
    ("granitemoe", "gm_logits_scaling_multiplied", False, "logits", "scale", "the config's logits_scaling squared"),
    ("granitemoe", "gm_attention_scale_sqrt_head_dim", False, "model.layers.0.self_attn.scores", "attention_scale",
     "the reference by 0.0625 (= the config's attention_multiplier"),
    ("granitemoe", "gm_attention_multiplier_and_sqrt", False, "model.layers.0.self_attn.scores", "attention_scale",
     "ours / reference = 0.25"),
    ("granitemoe", "gm_residual_multiplier_on_skip", False, "model.layers.0.post_attention_layernorm", "residual",
     "ours computes 0.5 x + 1 f(x), the reference 1 x + 0.5 f(x)"),
    ("granitemoe", "gm_residual_multiplier_attn_only", False, "model.layers.0", "residual",
     "matches the config's residual_multiplier (0.5)"),
    ("granitemoe", "gm_router_softmax_before_topk", False, "model.layers.0.block_sparse_moe.router.weights",
     "renormalisation", "the reference sums to 1 in every row, ours does not"),
    ("granitemoe", "gm_gate_up_halves_swapped", False, "model.layers.0.block_sparse_moe.experts", "swapped_weights",
     "split the other way round (up first)"),
    ("granitemoe", "gm_gate_up_rows_interleaved", False, "model.layers.0.block_sparse_moe.experts", "swapped_weights",
     "read as interleaved pairs"),
    ("granitemoe", "gm_expert_down_untransposed", False, "model.layers.0.block_sparse_moe.experts", "swapped_weights",
     "their down projection (hidden, intermediate) reshaped"),
    ("granitemoe", "gm_router_reads_residual", False, "model.layers.0.block_sparse_moe.router", "projection_input",
     "post_attention_layernorm skipped in ours"),
    ("granitemoe", "gm_sdpa_is_causal_ignores_padding", True, "model.layers.0.self_attn.probs", "padding",
     "padding keys the other side masks"),
]  # fmt: skip
#: left out: ``er_gate_bias_after_act`` (gate_proj's bias added after the SiLU) fails at down_proj with no hint.
#: located, the hint naming the component only (true, the cause not named): a q/k row permutation at load read
#: as RoPE frequencies; the embedding multiplier folded into the tied table seen at the logits as a factor
#: several config fields equal (4); a gate bias after the activation unread; NaN from -inf masks on padding
#: query rows seen where it first reaches a real token
COMPONENT = [
    ("ernie4_5", "er_llama_conversion_permute", False, "model.layers.0.self_attn.q_rot", "rope_frequencies",
     "position 0 agrees"),
    ("granitemoe", "gm_embed_multiplier_into_tied_head", False, "logits", "scale",
     "or the config's embedding_multiplier (4)"),
    ("ernie4_5", "er_inf_masks_nan_pad_rows", True, "model.layers.1.self_attn.probs", "nonfinite",
     "non-finite values appear first here"),
]  # fmt: skip
REFUSED = [
    ("hunyuan_v1_dense", "hy_key_norm_from_query_gain", "model.layers.0.self_attn.key_layernorm.weight"),
    ("hunyuan_v1_dense", "hy_o_proj_bias_dropped", "model.layers.0.self_attn.o_proj.bias"),
    ("ernie4_5", "er_qkv_bias_only", "model.layers.0.mlp.down_proj.bias"),
]
FAST = {
    "hy_ntk_alpha_base_linear",
    "hy_rope_interleaved_pairs",
    "er_causal_dropped_with_mask",
    "er_rope_theta_template_default",
}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.slow
@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(COMPONENT, set()), indirect=["bug"])
def test_a_bug_is_located_with_a_hint_naming_its_component(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "says"), REFUSED, indirect=["bug"])
def test_a_loader_bug_is_refused_naming_the_tensor(model, bug, says, checkpoints):
    heldout_support.assert_refused(MODELS, checkpoints, model, says)
