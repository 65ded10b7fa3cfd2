"""A forty-third held-back set: Apertus 1.5 (its text model: xIELU with learned scalars, per-head q/k norms, llama3
RoPE, an output head narrower than the vocabulary), Gemma 4 unified (its text model: K = V full layers, shared-KV
layers, proportional RoPE, sandwich norms, a double-wide MLP, soft-capped logits) and Aria (its text model: a MoE with
shared experts on every layer) user models by helpers who never read ``parity/`` (``tests/user_models/heldout43/``,
42 bugs, five correct variants per family).

Measured first in the twenty-seventh session (2026-12-06), before any fit to it: correct runs 32 of 36, bugs named 28
of 42 (67%), 9 wrong causes. The kinds fitted then: per-layer gains stacked as ``(layers, 2, hidden)`` and q/k/v
biases fused then stacked as ``(layers, q + k + v)`` (read as derived at load, so every attention bug of Apertus
failed first at q_proj as a missing bias); a shared-KV layer running an earlier layer's projection again (its slice
read twice taken for the two halves of one product, and that layer's attention read as the earlier one's); a zero
accumulator starting a sum of partial products; a MoE's combination read where the stream continues; a
per-channel ratio that is a norm weight of the layer; xIELU's ``exp`` in place of ``expm1``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout43"))

import heldout43_apertus1p5_text
import heldout43_aria_text
import heldout43_gemma4_unified_text

MODELS = {
    "apertus1p5_text": heldout43_apertus1p5_text,
    "gemma4_unified_text": heldout43_gemma4_unified_text,
    "aria_text": heldout43_aria_text,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "apertus1p5_text": dict(
            intermediate_size=128, attention_bias=True, output_vocab_size=200, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "original_max_position_embeddings": 64, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        ),
        "gemma4_unified_text": dict(
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            intermediate_size=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=10.0,
        ),
        "aria_text": dict(
            intermediate_size=32, moe_num_experts=8, moe_topk=2, moe_num_shared_experts=2, attention_bias=True,
            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            tie_word_embeddings=False,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout43"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("apertus1p5_text", "fold_norm_gains", False),  # gains stacked (layers, 2, hidden), folded at load
    ("gemma4_unified_text", "", True),
    ("aria_text", "shared_split_sum", False),  # the shared MLP as two halves, a zero accumulator summing them
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
AFTER_MOE = "model.layers.1.input_layernorm"  # Aria's MoE computed in functions: read where the stream continues
NAMED = [
    ("apertus1p5_text", "xielu_no_softplus", False, f"{MLP}.down_proj", "activation",
     "a_p = alpha_p (raw: softplus not applied)"),
    ("apertus1p5_text", "xielu_alpha_n_no_beta", False, f"{MLP}.down_proj", "activation",
     "a_n = softplus(alpha_n) (beta not added)"),
    ("apertus1p5_text", "xielu_exp_not_expm1", False, f"{MLP}.down_proj", "activation",
     "negative constant = a_n (exp(x) in place of expm1(x)"),
    ("apertus1p5_text", "qk_norm_after_rope", False, f"{ATTN}.q_norm", "norm_placement",
     "ours' q_norm reads its input after RoPE"),
    ("apertus1p5_text", "qk_norm_full_width", False, f"{ATTN}.q_rot", "norm_kind",
     "the q_norm's statistic over every head's features together in ours"),
    ("apertus1p5_text", "rope_interleaved", False, f"{ATTN}.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("apertus1p5_text", "rope_no_llama3", False, f"{ATTN}.q_rot", "rope_scaling", "no llama3 scaling"),
    ("apertus1p5_text", "llama3_smooth_swapped", False, f"{ATTN}.q_rot", "rope_scaling",
     "its medium band blended the wrong way round"),
    ("apertus1p5_text", "gqa_tiled", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("apertus1p5_text", "attn_no_scale", False, f"{ATTN}.scores", "attention_scale", "ours scales q k^T by 1"),
    ("apertus1p5_text", "norm_gain_offset", False, "model.layers.0.attention_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("apertus1p5_text", "residual_from_normed", False, "model.layers.0.feedforward_layernorm", "residual",
     "to the reference's model.layers.0.attention_layernorm instead of the stream"),
    ("apertus1p5_text", "head_tied_to_embedding", False, "logits", "missing",
     "lm_head skipped in ours, or computed from another tensor than its weight"),
    ("apertus1p5_text", "pad_mask_ignored", True, f"{ATTN}.probs", "padding", "earlier padding keys"),
    ("gemma4_unified_text", "norm_plus_one", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("gemma4_unified_text", "attn_scale_rsqrt", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(head_dim=16)), the reference by 1"),
    ("gemma4_unified_text", "v_uses_k_norm", False, "model.layers.1.self_attn.context", "channel_scale",
     "model.layers.1.self_attn.k_norm's weight applied here by ours alone"),
    ("gemma4_unified_text", "rope_rot_denominator", False, "model.layers.1.self_attn.q_rot", "rope_frequencies",
     "the inverse frequencies over another width"),
    ("gemma4_unified_text", "rope_partial_contiguous", False, "model.layers.1.self_attn.q_rot", "rope_partial",
     "ours rotates 8 of 32 dims (0, 1, 2, 3, 4, 5, 6, 7)"),
    ("gemma4_unified_text", "rope_single_theta", False, "model.layers.1.self_attn.q_rot", "rope_theta",
     "theta 10000"),
    ("gemma4_unified_text", "window_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 9, the reference with a window of 8"),
    ("gemma4_unified_text", "gate_up_swapped", False, f"{MLP}.down_proj", "swapped_roles",
     "to up_proj's output and multiplies by gate_proj's"),
    ("gemma4_unified_text", "no_embed_scale", False, "model.embed_tokens", "scale", "the embedding scale (8)"),
    ("gemma4_unified_text", "post_attn_norm_after_residual", False, "model.layers.0.post_attention_layernorm",
     "norm_placement", "normalises the sum after the residual add"),
    ("gemma4_unified_text", "gqa_tiled", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("gemma4_unified_text", "kv_share_weights", False, "model.layers.2.self_attn.k_rot", "kv_sharing",
     "layer 2 reads the keys and values of layer 0 in the reference"),
    ("gemma4_unified_text", "sliding_no_pad_mask", True, f"{ATTN}.probs", "padding", "earlier padding keys"),
    ("gemma4_unified_text", "pad_mask_on_queries", True, f"{ATTN}.probs", "padding", "laid along the queries"),
    ("aria_text", "router_full_softmax", False, AFTER_MOE, "routing_weights",
     "weighted by a softmax over all experts, not renormalised over the chosen"),
    ("aria_text", "router_prenorm_input", False, f"{MLP}.router", "projection_input",
     "model.layers.0.post_attention_layernorm skipped in ours"),
    ("aria_text", "gate_up_swapped", False, AFTER_MOE, "one_change", "parts 0 and 1 of this chunk (of 2) swapped"),
    ("aria_text", "gate_up_linear_layout", False, AFTER_MOE, "moe_block", "their weights' layout"),
    ("aria_text", "shared_expert_mean", False, AFTER_MOE, "moe_combination",
     "ours computes 1 routed + 0.5 shared, the reference 1 routed + 1 shared"),
    ("aria_text", "rope_interleaved", False, f"{ATTN}.q_rot", "rope_pairing", "ours rotates interleaved (2i, 2i + 1)"),
    ("aria_text", "rope_theta_default", False, f"{ATTN}.q_rot", "rope_theta", "(the config: theta 500)"),
    ("aria_text", "attn_scale_headdim", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.0625 (= 1/head_dim"),
    ("aria_text", "gqa_tile", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("aria_text", "qkv_split_kv_swapped", False, f"{ATTN}.k_rot", "swapped_roles",
     "ours' k_rot is the reference's v_proj rotated"),
    ("aria_text", "rmsnorm_offset", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("aria_text", "residual_from_normed", False, "model.layers.0.post_attention_layernorm", "residual",
     "to the reference's model.layers.0.input_layernorm instead of the stream"),
    ("aria_text", "pad_mask_queries", True, f"{ATTN}.probs", "padding", "laid along the queries"),
    ("aria_text", "pad_mask_additive_01", True, f"{ATTN}.probs", "padding", "the mask added as a small shift"),
]  # fmt: skip
FAST = {"qk_norm_full_width", "kv_share_weights", "v_uses_k_norm", "shared_expert_mean", "xielu_exp_not_expm1"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def test_a_reference_halving_its_shared_experts_is_named(checkpoints):
    """Aria's MoE block with its shared experts' output halved in the reference: the combination read where the
    stream continues (ours computes the block in functions), the reference's coefficients named."""
    ref = heldout_support.reference_model(checkpoints["aria_text"])

    def halved(self, hidden_states):  # AriaTextMoELayer.forward, the shared experts' output halved
        shape = hidden_states.shape
        flat = hidden_states.view(-1, shape[-1])
        _, weights, chosen = self.router(flat)
        return self.experts(flat, chosen, weights).view(shape) + 0.5 * self.shared_experts(hidden_states)

    for layer in ref.model.layers:
        layer.mlp.forward = types.MethodType(halved, layer.mlp)
    bad = heldout_support.first_mismatch(MODELS, "aria_text", ref)
    assert bad.name == AFTER_MOE and bad.hint.kind == "moe_combination", bad
    assert "ours computes 1 routed + 1 shared, the reference 1 routed + 0.5 shared" in bad.hint.text


def test_a_reference_normalising_its_values_with_the_key_norm_is_named(checkpoints):
    """Gemma 4's K = V layer whose values the reference normalises with k_norm (its weight included) where ours,
    as Transformers, applies v_norm (no weight): the per-channel ratio named as that weight, the reference's."""
    ref = heldout_support.reference_model(checkpoints["gemma4_unified_text"])
    attention = ref.model.layers[1].self_attn
    attention.v_norm.forward = attention.k_norm.forward
    bad = heldout_support.first_mismatch(MODELS, "gemma4_unified_text", ref)
    assert bad.name == "model.layers.1.self_attn.context" and bad.hint.kind == "channel_scale", bad
    assert "model.layers.1.self_attn.k_norm's weight applied here by the reference alone" in bad.hint.text


def test_a_reference_xielu_with_exp_is_named(checkpoints):
    """Apertus' xIELU computed with exp in place of expm1 in the reference: the negative branch's constant named,
    the reference's side."""
    import torch

    ref = heldout_support.reference_model(checkpoints["apertus1p5_text"])

    def with_exp(self, x):  # XIELUActivation's python form, exp for expm1
        alpha_p = torch.nn.functional.softplus(self.alpha_p)
        alpha_n = self.beta + torch.nn.functional.softplus(self.alpha_n)
        negative = (torch.exp(torch.clamp_max(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, alpha_p * x * x + self.beta * x, negative)

    for layer in ref.model.layers:
        layer.mlp.act_fn.forward = types.MethodType(with_exp, layer.mlp.act_fn)
    bad = heldout_support.first_mismatch(MODELS, "apertus1p5_text", ref)
    assert bad.name == f"{MLP}.down_proj" and bad.hint.kind == "activation", bad
    assert "in the reference" in bad.hint.text and "exp(x) in place of expm1(x)" in bad.hint.text
