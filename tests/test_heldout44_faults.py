"""A forty-fourth held-back set: Ministral 3 (YaRN with a Llama 4 query scale by position, a sliding window, a
head wider than hidden_size / num_heads), DeepSeek V2 (multi-head latent attention with YaRN and interleaved rope
pairs, a softmax router limited to groups scored by their best expert, shared experts, routed_scaling_factor) and
Qwen3.5-MoE (its text model: Gated DeltaNet layers, gated attention with partial rotary, a MoE with a gated shared
expert) user models by helpers who never read ``parity/`` (``tests/user_models/heldout44/``, 42 bugs, five correct
variants per family).

Measured first in the twenty-eighth session (2026-12-07), before any fit to it: correct runs 36 of 36, bugs named 32
of 42 (76%), 3 wrong causes (Ministral 3's YaRN betas swapped read as "no scaling, cos/sin scaled by 1"; its Llama 4
query scale applied to the keys read as a RoPE attention factor; that scale taken at each token's index in a padded
row read as a scale before an L2 clip). The kinds fitted then: a rotation read with its rows' lengths rescaled says
nothing of its cos/sin scale, and candidates rotating alike are named together; the Llama 4 query scale on the keys,
at the token's index, over max_position_embeddings; DeepSeek V2's router a softmax whose groups score by their best
expert, its rope pairs interleaved; top-k weights renormalised before a routed scale; groups masked before the softmax;
groups taken strided; a q/k norm after RoPE read from its output where its input is unread; the delta rule's query
scale named; a cos/sin table rounded to bfloat16; a scaled RoPE's frequencies over hidden_size / num_heads.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout44"))

import heldout44_deepseek_v2
import heldout44_ministral3
import heldout44_qwen3_5_moe_text

MODELS = {
    "ministral3": heldout44_ministral3,
    "deepseek_v2": heldout44_deepseek_v2,
    "qwen3_5_moe_text": heldout44_qwen3_5_moe_text,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "ministral3": dict(
            head_dim=32, intermediate_size=128, sliding_window=16, tie_word_embeddings=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 32.0,
                             "original_max_position_embeddings": 8, "max_position_embeddings": 256,
                             "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.1},
        ),
        "deepseek_v2": dict(
            num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1, topk_method="group_limited_greedy",
            n_group=4, topk_group=2, routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=48,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, attention_bias=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 0.707},
        ),
        "qwen3_5_moe_text": dict(
            head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
            num_experts_per_tok=2,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout44"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("ministral3", "llama4_scale_pre_rope", True),  # the query scale by position applied before RoPE
    ("deepseek_v2", "absorbed_mla", False),  # weight-absorbed latent attention (scores and values on the latent)
    ("qwen3_5_moe_text", "chunked_delta", False),  # the delta rule in chunks of 16, a triangular solve each
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
MOE = "model.layers.1.mlp"  # DeepSeek V2's first layer is dense (first_k_dense_replace)
DELTA = "model.layers.0.linear_attn.norm"  # Qwen3.5's DeltaNet computed in functions: read at its gated norm
NAMED = [
    ("ministral3", "yarn_beta_swapped", False, Q, "rope_scaling",
     "the same frequencies here as YaRN with its correction range from beta_fast and beta_slow swapped"),
    ("ministral3", "yarn_no_mscale", False, Q, "rope_attention_factor",
     "the default YaRN attention factor 0.1 ln(32) + 1"),
    ("ministral3", "rope_theta_default", False, Q, "rope_theta", "theta 10000"),
    ("ministral3", "rope_interleaved", False, Q, "rope_pairing", "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("ministral3", "rope_table_bf16", False, Q, "rope_precision",
     "the RoPE's cos/sin table rounded to bfloat16 in ours"),
    ("ministral3", "llama4_scale_max_pos", False, Q, "scale",
     "the Llama 4 query scale over max_position_embeddings (256), not original_max_position_embeddings (8)"),
    ("ministral3", "llama4_scale_no_floor", False, Q, "scale", "the Llama 4 query scale without its floor"),
    ("ministral3", "llama4_scale_on_keys", False, f"{ATTN}.k_rot", "scale",
     "applied to the keys as well in ours: it scales the queries alone"),
    ("ministral3", "llama4_scale_arange", True, Q, "scale",
     "the Llama 4 query scale at each token's index in its row (arange(seq)), not at its position id"),
    ("ministral3", "sliding_window_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 17, the reference with a window of 16"),
    ("ministral3", "gqa_repeat_tile", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("ministral3", "softmax_scale_hidden", False, f"{ATTN}.scores", "attention_scale",
     "(= 1/sqrt(hidden_size/num_attention_heads=16)), the reference by 0.176777 (= 1/sqrt(head_dim=32))"),
    ("ministral3", "swiglu_swapped", False, "model.layers.0.mlp.down_proj", "swapped_roles",
     "ours applies the activation (silu) to up_proj's output"),
    ("ministral3", "rmsnorm_gemma_offset", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("deepseek_v2", "rope_neox_halves", False, Q, "rope_pairing",
     "ours rotates half-split (i, i + d/2) pairs, the reference interleaved (2i, 2i + 1)"),
    ("deepseek_v2", "softmax_scale_no_mscale", False, f"{ATTN}.scores", "attention_scale",
     "the reference by 0.246098 (= 1/sqrt(head_dim=24) times the YaRN softmax mscale (1.09801) squared)"),
    ("deepseek_v2", "rope_attn_factor_plain", False, Q, "scale",
     "times 1.09801 (= YaRN's softmax mscale 0.1 mscale_all_dim ln(factor) + 1) on the 8 rotated dims"),
    ("deepseek_v2", "yarn_ramp_untruncated", False, Q, "rope_band",
     "YaRN with its correction range's bounds left unrounded"),
    ("deepseek_v2", "rope_dim_from_hidden", False, Q, "rope_frequencies",
     "yarn frequencies computed over hidden_size / num_heads (16 dims) and cut to its first 4"),
    ("deepseek_v2", "kv_b_blocked_split", False, f"{ATTN}.k_rot", "qkv_layout",
     "the per-head layout read as [all k_nope | all v]"),
    ("deepseek_v2", "topk_renorm", False, f"{MOE}.router.weights", "routing_weights",
     "ours equals the softmax scores at the chosen, renormalised (norm_topk_prob is false)"),
    ("deepseek_v2", "routed_scale_includes_shared", False, MOE, "routing_weights",
     "routed_scaling_factor applied to the routed and the shared experts' sum in ours"),
    ("deepseek_v2", "expert_groups_strided", False, f"{MOE}.router.experts", "routing",
     "ours chooses with the groups taken strided (expert e in group e % n_group)"),
    ("deepseek_v2", "router_mask_before_softmax", False, f"{MOE}.router.weights", "routing_weights",
     "ours equals the softmax over the kept groups' experts alone (the other groups masked on the logits before"),
    ("deepseek_v2", "expert_gate_up_swapped", False, MOE, "swapped_weights",
     "their fused gate/up rows split the other way round (up first)"),
    ("deepseek_v2", "shared_on_residual", False, f"{MOE}.shared_experts.gate_proj", "projection_input",
     "model.layers.1.post_attention_layernorm skipped in ours"),
    ("deepseek_v2", "mask_added_raw", True, f"{ATTN}.probs", "padding", "the mask added as a small shift"),
    ("qwen3_5_moe_text", "attn_gate_split", False, "model.layers.1.self_attn.q_norm", "qkv_layout",
     "a query and its gate fused per head read as two blocks"),
    ("qwen3_5_moe_text", "rope_full_rotary", False, "model.layers.1.self_attn.q_rot", "rope_partial",
     "the reference rotates 4 of 16 dims (0, 1, 2, 3) of each head"),
    ("qwen3_5_moe_text", "qk_norm_after_rope", False, "model.layers.1.self_attn.q_norm", "norm_placement",
     "ours' q_norm reads its input after RoPE"),
    ("qwen3_5_moe_text", "pad_mask_on_queries", True, "model.layers.1.self_attn.probs", "padding",
     "laid along the queries"),
    ("qwen3_5_moe_text", "kv_head_tiled", False, DELTA, "one_change",
     "repeat_interleave by 2 replaced by whole-block repeats"),
    ("qwen3_5_moe_text", "conv_taps_reversed", False, DELTA, "one_change", "the conv's kernel read in reverse"),
    ("qwen3_5_moe_text", "dt_bias_outside_softplus", False, DELTA, "one_change",
     "dt_bias added after the softplus instead of to its input"),
    ("qwen3_5_moe_text", "decay_after_update", False, DELTA, "one_change",
     "the state decayed after the update"),
    ("qwen3_5_moe_text", "delta_q_unscaled", False, DELTA, "scale",
     "matches 1 / the delta rule's query scale 1 / sqrt(linear_key_head_dim=8)"),
    ("qwen3_5_moe_text", "gated_norm_unit_offset", False, DELTA, "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("qwen3_5_moe_text", "mask_after_conv", True, DELTA, "untapped_block", "tap its internals (parity.tap)"),
    ("qwen3_5_moe_text", "no_topk_renorm", False, "model.layers.0.mlp.router.weights", "renormalisation",
     "the reference sums to 1 in every row, ours does not"),
    ("qwen3_5_moe_text", "experts_up_gate_swapped", False, "model.layers.0.mlp", "one_change",
     "parts 0 and 1 of this chunk (of 2) swapped"),
    ("qwen3_5_moe_text", "shared_expert_ungated", False, "model.layers.0.mlp", "shared_expert",
     "ours computes routed + shared (the shared expert's gate left out)"),
]  # fmt: skip
FAST = {"llama4_scale_on_keys", "rope_table_bf16", "router_mask_before_softmax", "qk_norm_after_rope"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


def test_a_bias_left_unloaded_is_refused_by_name(checkpoints):
    """DeepSeek V2's kv_a_proj_with_mqa bias never loaded (the port honours attention_bias for q_a_proj and o_proj
    alone): refused before any run, the checkpoint's tensors it never holds named."""
    MODELS["deepseek_v2"].BUG = "kv_a_bias_dropped"
    try:
        heldout_support.assert_refused(MODELS, checkpoints, "deepseek_v2", "self_attn.kv_a_proj_with_mqa.bias")
    finally:
        MODELS["deepseek_v2"].BUG = ""


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def test_a_reference_masking_its_groups_before_the_softmax_is_named(checkpoints):
    """DeepSeek V2's router masking the groups it does not keep on the logits before its softmax in the reference
    (the kept experts' weights renormalised over them): the reference's form named, ours' the config's."""
    import torch

    ref = heldout_support.reference_model(checkpoints["deepseek_v2"])

    def masked_first(self, hidden_states):  # DeepseekV2TopkRouter.forward, the groups masked on the logits
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
        per = self.num_experts // self.num_group
        groups = logits.softmax(-1).view(-1, self.num_group, per).amax(-1).topk(self.topk_group, -1).indices
        keep = torch.zeros(logits.shape[0], self.num_group, dtype=torch.bool).scatter(1, groups, True)
        scores = logits.masked_fill(~keep.repeat_interleave(per, -1), float("-inf")).softmax(-1)
        weights, chosen = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return logits, weights * self.routed_scaling_factor, chosen

    for layer in ref.model.layers[1:]:
        layer.mlp.gate.forward = types.MethodType(masked_first, layer.mlp.gate)
    bad = heldout_support.first_mismatch(MODELS, "deepseek_v2", ref)
    assert bad.name == f"{MOE}.router.weights" and bad.hint.kind == "routing_weights", bad
    assert "the reference the softmax over the kept groups' experts alone" in bad.hint.text


def test_a_reference_scaling_its_keys_by_position_is_named(checkpoints, monkeypatch):
    """Ministral 3's Llama 4 query scale applied to the rotated keys as well in the reference (its RoPE's keys times
    the scale at each position): named on the reference's side."""
    import torch
    from transformers.models.ministral3 import modeling_ministral3

    ref = heldout_support.reference_model(checkpoints["ministral3"])
    beta = ref.config.rope_parameters["llama_4_scaling_beta"]
    span = ref.config.rope_parameters["original_max_position_embeddings"]
    rotate = modeling_ministral3.apply_rotary_pos_emb

    def keys_scaled(q, k, cos, sin, *args, **kwargs):  # (batch, kv_heads, seq, head_dim); positions 0..seq-1
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        positions = torch.arange(k.shape[2], dtype=k.dtype)
        return q, k * (1 + beta * torch.log1p(torch.floor(positions / span)))[:, None]

    monkeypatch.setattr(modeling_ministral3, "apply_rotary_pos_emb", keys_scaled)
    bad = heldout_support.first_mismatch(MODELS, "ministral3", ref)
    assert bad.name == f"{ATTN}.k_rot" and bad.hint.kind == "scale", bad
    assert "applied to the keys as well in the reference" in bad.hint.text
