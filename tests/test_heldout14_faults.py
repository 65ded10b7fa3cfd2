"""A fourteenth held-back set: Cohere 2, Apertus and Qwen2-MoE user models by a helper who never read ``parity/``.

``tests/user_models/heldout14/``: a Cohere 2 (one LayerNorm feeding attention and MLP in parallel, sliding
layers with interleaved RoPE and a NoPE global layer, logit_scale, tied head), an Apertus (xIELU activation
with learned alpha_p / alpha_n, QK RMS norms, llama3-scaled RoPE with theta 1.2e7, a non-gated MLP) and a
Qwen2-MoE (q/k/v biases, sliding and full layers, YaRN, a top-2 router without renormalisation beside a
shared expert gated by sigmoid(shared_expert_gate(x)), a dense layer), each over its own parameter names
and layouts. 37 bugs of kinds the sets before did not hold, and five correct variants per family.

Its first measure (2026-12-03, ninth session, with the thirteenth set's fixes and nothing fitted to this
set): 7 of 30 correct runs passed (every Apertus run refused for xIELU's ``eps`` buffer held as a number;
every Qwen2-MoE run failed a shape at ``shared_expert_gate``, its (1, hidden) weight kept flat and aligned
as if it were a norm; a logit_scale folded into the tied head refused; a model running each padded row
alone failed a shape); 15 of 37 hints named the cause (all twelve Cohere 2 bugs), 12 were refused, 8 named
none or a wrong cause. The fixes by kind are asserted below; what stays open is said where it is.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout14"))

import heldout14_apertus
import heldout14_cohere2
import heldout14_qwen2_moe

MODELS = {"cohere2": heldout14_cohere2, "apertus": heldout14_apertus, "qwen2_moe": heldout14_qwen2_moe}


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helper's weights: norm weights around 1, xIELU's coefficients softplus(alpha_p) near 0.8 and
    beta + softplus(alpha_n) near 0.8, biases ~0.3, token embeddings with a per-row scale, a router of
    twice the gain (well-separated choices), other matrices of unit gain."""
    for name, p in model.named_parameters():
        parts = name.lower().split(".")
        if parts[-1] == "weight" and "norm" in parts[-2]:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
        elif parts[-1] == "alpha_p":
            p.copy_(math.log(math.expm1(0.8)) + 0.4 * torch.randn(p.shape, generator=gen))
        elif parts[-1] == "alpha_n":
            p.copy_(math.log(math.expm1(0.3)) + 0.4 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 + torch.rand(p.shape[0], 1, generator=gen)))
        elif name.endswith("mlp.gate.weight"):
            p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    specs = {
        "cohere2": T.Cohere2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, layer_norm_eps=1e-5, logit_scale=0.25, max_position_embeddings=256,
            sliding_window=6, sliding_window_pattern=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "apertus": T.ApertusConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="xielu", max_position_embeddings=512,
            rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "qwen2_moe": T.Qwen2MoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256, use_sliding_window=True,
            sliding_window=7, max_window_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
            qkv_bias=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64},
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    }  # fmt: skip
    return heldout_support.save_checkpoints(tmp_path_factory.mktemp("heldout14"), specs, randomise, 4000, 7411)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("apertus", "", False),
    ("qwen2_moe", "", False),
    ("cohere2", "logit_scale_folded", False),
    ("cohere2", "varlen_unpad", True),
]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN)


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """Apertus: xIELU's ``eps`` (a scalar buffer the reference registers) held as a number. Qwen2-MoE: the
    shared expert gate's (1, hidden) weight kept flat and read in a function, its routed experts held
    stacked by one module (their weighted sum a node). Cohere 2: logit_scale folded into a transposed copy
    of the tied head; each padded row run alone on its real tokens (every node assembled per row)."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    """And the rest: SDPA; a fused parallel in-projection; RoPE rows permuted to half-split; xIELU folded;
    complex RoPE; dense and sorted expert dispatch; fused q/k/v biases; padding dropped before the experts."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


def test_the_per_row_model_is_judged_at_every_node(checkpoints):
    """The varlen Cohere 2 (each row run alone) is not passed by leaving its nodes out: they are compared."""
    heldout14_cohere2.BUG = "varlen_unpad"
    try:
        res = heldout_support.check(MODELS, checkpoints, "cohere2", padded=True)
    finally:
        heldout14_cohere2.BUG = ""
    assert res.passed, res.verdict()
    judged = {r.name for r in res.nodes if r.status == "ok"}
    assert {"model.layers.0.self_attn.probs", "model.layers.3.mlp.down_proj", "model.layers.0"} <= judged


NAMED = [
    ("cohere2", "co_rope_half_split", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "ours rotates half-split (i, i + d/2) pairs"),
    ("cohere2", "co_rope_freqs_catted", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs with the table's frequencies concatenated"),
    ("cohere2", "co_rope_on_global_layers", False, "model.layers.3.self_attn.q_rot", "rope_unexpected",
     "this full_attention layer is NoPE"),
    ("cohere2", "co_rope_on_global_only", False, "model.layers.0.self_attn.q_rot", "rope_missing",
     "ours applies no rotation here"),
    ("cohere2", "co_gemma2_alternating_layers", False, "model.layers.1.self_attn.q_rot", "rope_missing",
     "ours applies no rotation here"),
    ("cohere2", "co_window_inclusive", False, "model.layers.0.self_attn.probs", "sliding_window",
     "ours attends with a window of 7, the reference with a window of 6"),
    ("cohere2", "co_window_on_global_layers", False, "model.layers.3.self_attn.probs", "sliding_window",
     "ours attends with a window of 6, the reference with full causal attention"),
    ("cohere2", "co_sliding_mask_drops_padding", True, "model.layers.0.self_attn.probs", "padding",
     "padding keys the other side masks"),
    ("cohere2", "co_rmsnorm_template", False, "model.layers.0.input_layernorm", "norm_kind",
     "ours behaves like RMSNorm"),
    ("cohere2", "co_sequential_residual", False, "model.layers.0.mlp@input", "block_layout",
     "(sequential block)"),
    ("cohere2", "co_logit_scale_missing", False, "logits", "logit_scale", "ours / reference = 4"),
    ("cohere2", "co_gate_up_swapped_at_fuse", False, "model.layers.0.mlp.down_proj", "swapped_roles",
     "ours applies the activation (silu) to up_proj's output"),
    ("apertus", "ap_qk_norm_after_rope", False, "model.layers.0.self_attn.q_norm", "norm_placement",
     "ours' q_norm reads its input after RoPE"),
    ("apertus", "ap_llama3_scaling_ignored", False, "model.layers.0.self_attn.q_rot", "rope_scaling",
     "no llama3 scaling"),
    ("apertus", "ap_llama3_smooth_inverted", False, "model.layers.0.self_attn.q_rot", "rope_band",
     "a llama3 correction range / ramp band"),
    ("apertus", "ap_rope_theta_template_default", False, "model.layers.0.self_attn.q_rot", "rope_theta",
     "ours rotates like llama3 RoPE with theta 10000"),
    ("apertus", "ap_norms_swapped", False, "model.layers.0.attention_layernorm", "swapped_weights",
     "feedforward_layernorm and attention_layernorm loaded into each other's places"),
    ("apertus", "ap_padding_mask_on_queries", True, "model.layers.0.self_attn.probs", "padding",
     "padding keys the other side masks"),
    ("qwen2_moe", "qm_norm_topk_forced", False, "model.layers.0.mlp.router.weights", "renormalisation",
     "renormalised over the chosen experts"),
    ("qwen2_moe", "qm_router_sigmoid", False, "model.layers.0.mlp.router.weights", "routing_weights",
     "ours equals a sigmoid of the router's logits (not a softmax)"),
    ("qwen2_moe", "qm_shared_expert_ungated", False, "model.layers.0.mlp", "shared_expert",
     "ours computes routed + shared (the shared expert's gate left out)"),
    ("qwen2_moe", "qm_shared_gate_scales_routed", False, "model.layers.0.mlp", "shared_expert",
     "ours computes sigmoid(gate) * (routed + shared)"),
    ("qwen2_moe", "qm_shared_gate_on_output", False, "model.layers.0.mlp.shared_expert_gate", "projection_input",
     "its input is the reference's model.layers.0.mlp.shared_expert.down_proj"),
    ("qwen2_moe", "qm_down_proj_viewed", False, "model.layers.0.mlp.experts", "swapped_weights",
     "(.view instead of .transpose)"),
    ("qwen2_moe", "qm_yarn_mscale_once", False, "model.layers.0.self_attn.q_rot", "rope_attention_factor",
     "ours takes no factor (1)"),
    ("qwen2_moe", "qm_yarn_ramp_inverted", False, "model.layers.0.self_attn.q_rot", "rope_scaling",
     "its ramp the wrong way round"),
    ("qwen2_moe", "qm_max_window_layers_old_rule", False, "model.layers.0.self_attn.probs", "sliding_window",
     "ours attends with full causal attention, the reference with a window of 7"),
    ("qwen2_moe", "qm_pad_drop_scatter_misaligned", True, "model.layers.0.mlp", "padding",
     "written back at the front"),
    ("apertus", "ap_xielu_no_softplus", False, "model.layers.0.mlp.down_proj", "activation",
     "ours with a_p = alpha_p (raw: softplus not applied) (the formula: softplus(alpha_p)); a_n = alpha_n (raw, beta "
     "not added)"),
    ("apertus", "ap_xielu_alpha_n_without_beta", False, "model.layers.0.mlp.down_proj", "activation",
     "ours with a_n = softplus(alpha_n) (beta not added)"),
    ("apertus", "ap_xielu_negative_missing_linear", False, "model.layers.0.mlp.down_proj", "activation",
     "ours with negative x term = beta (the - x term dropped: an ELU-style branch)"),
    ("apertus", "ap_xielu_alphas_sorted_swap", False, "model.layers.0.mlp.down_proj", "activation",
     "ours with a_p = softplus(alpha_n) (alpha_n's: the two exchanged)"),
]  # fmt: skip
#: located, the hint naming the component only (true, the cause not named): a q/k bias added after RoPE (ours'
#: q_proj has none; whether it comes later is not read). xIELU written otherwise was here until the fifteenth
#: session, which reads its coefficients back (``parity.diagnose.learned_activation``): now in NAMED
COMPONENT = [
    ("qwen2_moe", "qm_qk_bias_after_rope", False, "model.layers.0.self_attn.q_proj", "bias",
     "ours adds none at model.layers.0.self_attn.q_proj"),
]  # fmt: skip
#: loader bugs refused as bad input, the message naming the tensor never loaded and what holds its place
REFUSED = [
    (
        "apertus",
        "ap_k_norm_from_q_norm",
        "k_gain holds model.layers.0.self_attn.q_norm.weight, as blocks.0.attn.q_gain does",
    ),
    ("apertus", "ap_head_tied_to_embedding", "reference tensor(s) lm_head.weight are in no parameter"),
    ("qwen2_moe", "qm_qkv_bias_dropped", "model.layers.0.self_attn.k_proj.bias"),
    (
        "qwen2_moe",
        "qm_gate_up_read_interleaved",
        "read as interleaved pairs where the checkpoint stacks its two halves",
    ),
]
FAST = {
    "qm_shared_expert_ungated",
    "qm_pad_drop_scatter_misaligned",
    "ap_rope_theta_template_default",
    "qm_router_sigmoid",
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
