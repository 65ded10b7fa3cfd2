"""A nineteenth held-back set: BitNet, dots.llm1 and FlexOlmo user models by a helper who never read ``parity/``.

``tests/user_models/heldout19/``: a BitNet (sub-norms inside attention and the MLP, a ReLU² GLU, q/k/v fused,
gate/up packed), a dots.llm1 (DeepSeek-V3's group-limited sigmoid router with a correction bias and
routed_scaling_factor, a shared expert, a dense first layer, q/k norms, sliding-window layers; q, k and v as
einsum tensors, K and V stacked in one ``(hidden, 2, kv_heads, head_dim)`` weight) and a FlexOlmo (OLMo-2's
post-norms around each sub-layer, q/k norms over the whole projection, a softmax router over stacked experts),
each over its own parameter names and layouts. 39 bugs, five correct variants per family.

First measure at the start of the twelfth session (2026-12-03), on a snapshot of c87fb6f with nothing fitted
to this set: 18 of 36 correct runs passed (every dots.llm1 run raised inside parity: its ``bsh,hcnd->cbsnd``
product, the stack axis first, was read as if the batch led; BitNet's sub-norm gains folded into the next
weights raised the same way in the float64 run; the complex-RoPE variants of BitNet and FlexOlmo failed at
``k_rot``: k's rows permuted at load inside a fused q/k/v were not read back); of the bugs, 18 of 39 named
the cause (46%), 3 were refused naming the cause (the head tied to the embedding twice, gate/up read as
interleaved pairs), 12 crashed, 2 named a wrong cause (BitNet's sub-norm moved onto the activation alone read
as another activation; FlexOlmo's experts summed unweighted read as a clamp). Fitted since, by kind (see the
tests below): 36 of 36 correct runs pass and 36 of 39 bugs are named, the other 3 refused naming the cause.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout19"))

import heldout19_bitnet
import heldout19_dots1
import heldout19_flex_olmo

MODELS = {"bitnet": heldout19_bitnet, "dots1": heldout19_dots1, "flex_olmo": heldout19_flex_olmo}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    common = heldout_support.COMMON
    kwargs = {
        "bitnet": dict(intermediate_size=96),
        "dots1": dict(
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, sliding_window=8, max_window_layers=2),
        "flex_olmo": dict(intermediate_size=96, num_experts=6, num_experts_per_tok=2),
    }  # fmt: skip
    specs = {name: AutoConfig.for_model(name, **common, **kw) for name, kw in kwargs.items()}
    return heldout_support.save_checkpoints(
        tmp_path_factory.mktemp("heldout19"), specs, heldout_support.randomise, 1000, 1234
    )


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("bitnet", "subnorm_gain_folded", False),
    ("dots1", "", True),
    ("dots1", "rope_complex", False),
    ("flex_olmo", "rope_complex", True),
]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN)


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """dots.llm1 computes K and V as one ``bsh,hcnd->cbsnd`` product (the stack axis leads, the batch second)
    and q as ``bsh,hnd->bsnd`` (heads kept apart), read as ``(batch, seq, features)``; its complex RoPE holds
    q/k's rows permuted per head, as FlexOlmo's do inside one fused q/k/v weight."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


NAMED = [
    ("bitnet", "bn_relu2_as_silu", False, "model.layers.0.mlp.ffn_sub_norm", "activation",
     "input is silu(gate) * up in ours, relu squared(gate) * up in the reference"),
    ("bitnet", "bn_relu_not_squared", False, "model.layers.0.mlp.ffn_sub_norm", "activation",
     "input is relu(gate) * up in ours, relu squared(gate) * up in the reference"),
    ("bitnet", "bn_ffn_subnorm_on_gate", False, "model.layers.0.mlp.ffn_sub_norm", "activation",
     "relu squared(gate) alone (the product with up_proj taken after ffn_sub_norm, or dropped) in ours"),
    ("bitnet", "bn_attn_subnorm_dropped", False, "model.layers.0.self_attn.attn_sub_norm", "missing",
     "ours never ran layers.0.attention.attn_sub_norm"),
    ("bitnet", "bn_attn_subnorm_after_o", False, "model.layers.0.self_attn.attn_sub_norm", "norm_placement",
     "ours runs attn_sub_norm after o_proj"),
    ("bitnet", "bn_rope_theta_default", False, "model.layers.0.self_attn.q_rot", "rope_theta", "theta 10000"),
    ("bitnet", "bn_rope_interleaved", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("bitnet", "bn_gqa_tiled", False, "model.layers.0.self_attn.scores", "head_mapping", "heads 1, 2 differ"),
    ("bitnet", "bn_qkv_split_order", False, "model.layers.0.self_attn.k_rot", "swapped_roles",
     "ours' k_rot is the reference's v_proj rotated"),
    ("bitnet", "bn_weight_ternary", False, "model.layers.0.self_attn.attn_sub_norm", "derived_at_load",
     "ours' layers.0.attention.wqkv (computed from model.layers.0.self_attn.k_proj.weight, "
     "model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.v_proj.weight) holds only 3 distinct values"),
    ("bitnet", "bn_act_quant_int8", False, "model.layers.0.self_attn.q_proj", "quantisation",
     "activation quantisation in ours: q_proj's input is the other side's rounded to int8 levels per token"),
    ("bitnet", "bn_pad_mask_dropped", True, "model.layers.0.self_attn.probs", "padding", "the mask not applied"),
    ("dots1", "d1_router_softmax", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses from a softmax over the experts instead of a sigmoid"),
    ("dots1", "d1_bias_in_weights", False, "model.layers.1.mlp.router.weights", "routing_weights",
     "ours equals the biased scores (sigmoid plus e_score_correction_bias, which only the choice reads)"),
    ("dots1", "d1_bias_ignored", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses without e_score_correction_bias added to the scores"),
    ("dots1", "d1_group_score_max", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses with each group scored by its best expert (max)"),
    ("dots1", "d1_group_limit_ignored", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses with no group limit"),
    ("dots1", "d1_topk_not_normalized", False, "model.layers.1.mlp.router.weights", "routing_weights",
     "ours equals the sigmoid scores at the chosen, not renormalised (norm_topk_prob ignored)"),
    ("dots1", "d1_scale_before_norm", False, "model.layers.1.mlp", "routing_weights",
     "routed_scaling_factor not applied (applied before the renormalisation, which cancels it) in ours"),
    ("dots1", "d1_shared_scaled", False, "model.layers.1.mlp", "routing_weights",
     "routed_scaling_factor applied to the routed and the shared experts' sum in ours"),
    ("dots1", "d1_qk_norm_after_rope", False, "model.layers.0.self_attn.q_norm", "norm_placement",
     "ours' q_norm reads its input after RoPE"),
    ("dots1", "d1_sliding_layers_inverted", False, "model.layers.0.self_attn.probs", "sliding_window",
     "ours attends with a window of 8, the reference with full causal attention"),
    ("dots1", "d1_window_off_by_one", False, "model.layers.2.self_attn.probs", "sliding_window",
     "ours attends with a window of 9, the reference with a window of 8"),
    ("dots1", "d1_sliding_pad_mask_dropped", True, "model.layers.2.self_attn.probs", "padding",
     "the mask not applied"),
    ("flex_olmo", "fo_qk_norm_per_head", False, "model.layers.0.self_attn.q_norm", "norm_kind",
     "ours normalises by one RMS per head"),
    ("flex_olmo", "fo_qk_norm_after_rope", False, "model.layers.0.self_attn.q_norm", "norm_placement",
     "ours' q_norm reads its input after RoPE"),
    ("flex_olmo", "fo_pre_norm", False, "model.layers.0.self_attn.q_proj", "norm_placement",
     "the input of q_proj in ours equals the reference's input after a RMSNorm"),
    ("flex_olmo", "fo_norm_outside_residual", False, "model.layers.0.post_attention_layernorm", "norm_placement",
     "normalises the sum after the residual add"),
    ("flex_olmo", "fo_final_norm_skipped", False, "lm_head", "norm_skipped", "model.norm skipped in ours"),
    ("flex_olmo", "fo_down_proj_view_not_transpose", False, "model.layers.0.post_feedforward_layernorm",
     "swapped_weights", "reshaped to (intermediate, hidden) where it is transposed (.view instead of .transpose)"),
    ("flex_olmo", "fo_router_sigmoid", False, "model.layers.0.mlp.router.weights", "routing_weights",
     "ours equals a sigmoid of the router's logits (not a softmax)"),
    ("flex_olmo", "fo_expert_outputs_unweighted", False, "model.layers.0.mlp.router.weights", "routing_weights",
     "ours equals no weights (the chosen experts' outputs summed)"),
    ("flex_olmo", "fo_gate_up_swapped", False, "model.layers.0.post_feedforward_layernorm", "swapped_weights",
     "the chosen experts computed with gate_up_proj's halves swapped (up first"),
    ("flex_olmo", "fo_rope_theta_default", False, "model.layers.0.self_attn.q_rot", "rope_theta", "theta 10000"),
    ("flex_olmo", "fo_gqa_tiled", False, "model.layers.0.self_attn.scores", "head_mapping", "heads 1, 2 differ"),
    ("flex_olmo", "fo_pad_mask_query_axis", True, "model.layers.0.self_attn.probs", "padding",
     "laid along the queries instead of the keys"),
]  # fmt: skip
REFUSED = [
    ("bitnet", "bn_lm_head_tied", "output holds model.embed_tokens.weight, as tok_embeddings does"),
    ("dots1", "d1_gate_up_interleaved", "read as interleaved pairs where the checkpoint stacks its two halves"),
    ("flex_olmo", "fo_lm_head_tied", "lm_head_w holds model.embed_tokens.weight, as embeddings does"),
]
FAST = {
    "bn_ffn_subnorm_on_gate",
    "bn_weight_ternary",
    "bn_act_quant_int8",
    "d1_shared_scaled",
    "d1_scale_before_norm",
    "fo_down_proj_view_not_transpose",
    "fo_expert_outputs_unweighted",
}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "says"), REFUSED, indirect=["bug"])
def test_a_loader_bug_is_refused_naming_the_tensor(model, bug, says, checkpoints):
    heldout_support.assert_refused(MODELS, checkpoints, model, says)


@pytest.mark.parametrize("bug", ["d1_shared_scaled"], indirect=True)
def test_routing_weights_a_constant_apart_are_judged_at_the_block_output(bug, checkpoints):
    """routed_scaling_factor applied to the experts' output instead of the weights: the weights differ by one
    constant and are untapped with the reason, the block's output decides (here it fails: the factor also
    scales the shared expert)."""
    res = heldout_support.check(MODELS, checkpoints, "dots1")
    weights = next(r for r in res.nodes if r.name == "model.layers.1.mlp.router.weights")
    assert weights.status == "untapped" and "judged at the block's output" in weights.detail, weights
    assert res.first_mismatch.name == "model.layers.1.mlp", res.verdict()


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def test_another_glu_activation_in_the_reference_names_the_reference(checkpoints):
    ref = heldout_support.reference_model(checkpoints["bitnet"])
    for layer in ref.model.layers:
        layer.mlp.act_fn = torch.nn.SiLU()
    bad = heldout_support.first_mismatch(MODELS, "bitnet", ref)
    assert bad.name == "model.layers.0.mlp.ffn_sub_norm" and bad.hint.kind == "activation", bad
    assert "relu squared(gate) * up in ours, silu(gate) * up in the reference" in bad.hint.text


def test_activations_quantised_in_the_reference_name_the_reference(checkpoints):
    ref = heldout_support.reference_model(checkpoints["bitnet"])

    def quantised(module, args):
        x = args[0]
        scale = 127.0 / x.abs().amax(-1, keepdim=True).clamp(min=1e-5)
        return ((x * scale).round().clamp(-128, 127) / scale,)

    for layer in ref.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.register_forward_pre_hook(quantised)
    bad = heldout_support.first_mismatch(MODELS, "bitnet", ref)
    assert bad.name == "model.layers.0.self_attn.q_proj" and bad.hint.kind == "quantisation", bad
    assert "activation quantisation in the reference" in bad.hint.text


def test_routed_scaling_factor_on_the_shared_expert_too_in_the_reference_names_the_reference(checkpoints):
    ref = heldout_support.reference_model(checkpoints["dots1"])

    def scaled_sum(self, hidden_states):  # Dots1MoE.forward with the factor moved onto the whole sum
        shape, rsf = hidden_states.shape, self.gate.routed_scaling_factor
        _, weights, chosen = self.gate(hidden_states)
        routed = self.experts(hidden_states.view(-1, shape[-1]), chosen, weights / rsf).view(*shape)
        return (routed + self.shared_experts(hidden_states)) * rsf

    for layer in ref.model.layers[1:]:
        layer.mlp.forward = types.MethodType(scaled_sum, layer.mlp)
    bad = heldout_support.first_mismatch(MODELS, "dots1", ref)
    assert bad.name == "model.layers.1.mlp" and bad.hint.kind == "routing_weights", bad
    assert "routed_scaling_factor applied to the routed and the shared experts' sum in the reference" in bad.hint.text
