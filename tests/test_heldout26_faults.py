"""A twenty-sixth held-back set, measured first, then fitted: Qwen3-Next, MiMo-V2-Flash and GLM-5-Next user models by a
helper who never read ``parity/`` (``tests/user_models/heldout26/``, 39 bugs, five correct variants per family).

First measure in the fifteenth session (2026-12-04), on the code with set 25 fitted, nothing fitted to this set:
every MiMo-V2-Flash correct run failed at its sliding layers' k_rot (Transformers doubles num_key_value_heads
there in code; parity took the config's count), every GLM-5-Next run was refused (no text-only causal LM: its
``Glm5NextForConditionalGeneration`` was not found; past that, its MLA with qk_rope_head_dim 0 fails the facts'
head_dim check: still open, so GLM-5-Next is not in these tests), and Qwen3-Next's 12 correct runs passed; 5 of
39 bugs were named (13%), 8 with a wrong cause. Fitted after, by kind: each layer's KV heads read from its
``k_proj``, a composite model's ``...ForConditionalGeneration`` taken as the causal LM, a value computed at load
one suspect of several in a block with other untapped tensors, a query and its gate fused per head, top-k weights
compared by value, the values' width in the attention scale, two alike router departures named together. Of the
26 Qwen3-Next and MiMo bugs, 14 named the cause, 11 the component, 1 was refused naming the tensor; in the
sixteenth session the one-change search (:mod:`parity.diagnose.one_change`) named 7 of the 8 Gated DeltaNet
bugs that were component-only: 21 name the cause, 4 the component.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout26"))

import heldout26_mimo_v2_flash
import heldout26_qwen3_next

MODELS = {"qwen3_next": heldout26_qwen3_next, "mimo_v2_flash": heldout26_mimo_v2_flash}
#: the independent check's bound: Qwen3-Next's Gated DeltaNet (a chunked recurrence in Transformers, a per-token
#: one or chunks of another size in a port) drifts in float32 by up to 6.9e-5 between Transformers' own padded
#: and unpadded runs (the helper's measure), 1.1e-4 against this port
WITHIN = {"qwen3_next": 3e-4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    common = heldout_support.COMMON
    kwargs = {
        "qwen3_next": dict(head_dim=24, intermediate_size=96, moe_intermediate_size=16,
                           shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2], linear_conv_kernel_dim=4,
                           linear_key_head_dim=16, linear_value_head_dim=12, linear_num_key_heads=2,
                           linear_num_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5}),
        "mimo_v2_flash": dict(head_dim=24, v_head_dim=16, intermediate_size=96, moe_intermediate_size=16,
                              n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.0, sliding_window=6, attention_value_scale=0.707,
                              rms_norm_eps=1e-5, tie_word_embeddings=False,
                              layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                           "full_attention"],
                              mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000000.0,
                                                                  "partial_rotary_factor": 0.334},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.334}}),
    }  # fmt: skip
    specs = {name: AutoConfig.for_model(name, **{**common, **kw}) for name, kw in kwargs.items()}
    return heldout_support.save_checkpoints(
        tmp_path_factory.mktemp("heldout26"), specs, heldout_support.randomise_with_expert_bias, 1000, 1234
    )


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [("mimo_v2_flash", "", True), ("qwen3_next", "", False)]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """MiMo-V2-Flash, whose sliding layers hold twice the config's KV heads, padded; Qwen3-Next's hybrid of Gated
    DeltaNet and gated full attention."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded, WITHIN.get(model, 1e-4))


#: known false failures: none (MiMo's rows run apart with their own positions, varlen_unpad padded, pass since the
#: twenty-sixth session: ours' keys compared after GQA's expansion)
KNOWN_FALSE: set[str] = set()
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN, frozenset(KNOWN_FALSE))


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded, WITHIN.get(model, 1e-4))


NAMED = [
    ("qwen3_next", "qn_norm_plain_gain", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by w, the reference by 1 + w"),
    ("qwen3_next", "qn_attn_gate_blocked_split", False, "model.layers.1.self_attn.q_norm", "qkv_layout",
     "ours' q_norm reads its columns [0:96], the reference's each head's [0:24] of its 48"),
    ("qwen3_next", "qn_rope_full_head_dim", False, "model.layers.1.self_attn.q_rot", "rope_partial",
     "ours rotates 24 of 24 dims"),
    ("qwen3_next", "qn_shared_expert_ungated", False, "model.layers.0.mlp", "shared_expert",
     "ours computes routed + shared (the shared expert's gate left out)"),
    ("qwen3_next", "qn_topk_no_renorm", False, "model.layers.0.mlp.router.weights", "renormalisation",
     "the reference sums to 1 in every row, ours does not"),
    ("mimo_v2_flash", "mi_v_scale_missing", False, "model.layers.0.self_attn.o_proj", "scale",
     "matches 1 / the config's attention_value_scale (0.707)"),
    ("mimo_v2_flash", "mi_rope_single_theta", False, "model.layers.1.self_attn.q_rot", "rope_theta",
     "theta 5e+06 (the theta of full_attention layers)"),
    ("mimo_v2_flash", "mi_rope_partial_ignored", False, "model.layers.0.self_attn.q_rot", "rope_partial",
     "the reference rotates 8 of 24 dims"),
    ("mimo_v2_flash", "mi_router_softmax", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses from a softmax over the experts instead of a sigmoid"),
    ("mimo_v2_flash", "mi_router_bias_in_weights", False, "model.layers.1.mlp.router.weights", "routing_weights",
     "ours equals the biased scores"),
    ("mimo_v2_flash", "mi_group_score_max", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses with each group scored by its best expert (max) instead of the sum of its best two, or equally "
     "here with no group limit"),
    ("mimo_v2_flash", "mi_scaling_factor_dropped", False, "model.layers.1.mlp.router.weights", "scale",
     "matches reference / ours = the config's routed_scaling_factor (2)"),
    ("mimo_v2_flash", "mi_scale_v_head_dim", False, "model.layers.0.self_attn.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(v_head_dim=16)"),
    ("mimo_v2_flash", "mi_experts_gate_up_swapped", False, "model.layers.1", "swapped_weights",
     "gate_up_proj's halves swapped (up first"),
    # inside the Gated DeltaNet ours computes untapped: the one change to Transformers' code that agrees with ours
    ("qwen3_next", "qn_gva_tiled_heads", False, "model.layers.0.linear_attn.norm", "one_change",
     "repeat_interleave by 2 replaced by whole-block repeats"),
    ("qwen3_next", "qn_conv_not_causal", False, "model.layers.0.linear_attn.norm", "one_change",
     "slice [:24] taken from the other end ([3:] of 27"),
    ("qwen3_next", "qn_conv_no_silu", False, "model.layers.0.linear_attn.norm", "one_change",
     "likely silu left out at activations.py:103"),
    ("qwen3_next", "qn_decay_A_log_not_exp", False, "model.layers.0.linear_attn.norm", "one_change",
     "likely exp left out at modeling_qwen3_next.py:727 (`g = -self.A_log.float().exp()"),
    ("qwen3_next", "qn_no_qk_l2norm", False, "model.layers.0.linear_attn.norm", "one_change",
     "the reciprocal square root left out (a normalisation skipped) at modeling_qwen3_next.py:366"),
    ("qwen3_next", "qn_gated_norm_sigmoid", False, "model.layers.0.linear_attn.norm", "one_change",
     "sigmoid in place of silu"),
    ("qwen3_next", "qn_pad_state_leak", True, "model.layers.0.linear_attn.norm", "one_change",
     "the broadcast factor of shape (2, 24, 1) left out (a mask or a scale) at modeling_qwen3_next.py:314"),
    # named since the twenty-fifth session: the attention refitted under other masks (with its sinks)
    ("mimo_v2_flash", "mi_window_off_by_one", False, "model.layers.1.self_attn.o_proj", "sliding_window",
     "recomputed with a window of 7 keys where the reference keeps 6"),
]  # fmt: skip
#: located, the hint naming the component only (true; the cause not named): Qwen3-Next's Gated DeltaNet where no
#: one change to Transformers' code explains ours (a flat split of in_proj_qkvz; A_log computed at load is one
#: suspect among its conv and dt_bias, not the cause), and
#: MiMo's sliding attention with sinks (its probabilities untapped in ours)
COMPONENT = [
    *(
        ("qwen3_next", b, b == "qn_pad_state_leak", "model.layers.0.linear_attn.norm", "untapped_block",
         "likely inside model.layers.0.linear_attn")
        for b in ("qn_qkvz_flat_split",)
    ),
    ("mimo_v2_flash", "mi_swa_mask_ignores_padding", True, "model.layers.1.self_attn.o_proj", "untapped_block",
     "likely inside model.layers.1.self_attn"),
    ("mimo_v2_flash", "mi_swa_group_from_config", False, "model.layers.1.self_attn.k_rot", "head_mapping",
     "ours head 1 = reference head 0"),
]  # fmt: skip
FAST = {"qn_attn_gate_blocked_split", "qn_topk_no_renorm", "mi_scale_v_head_dim", "qn_conv_no_silu"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(COMPONENT, FAST), indirect=["bug"])
def test_a_bug_is_located_with_a_hint_naming_its_component(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["mi_sink_dropped"], indirect=True)
def test_a_loader_bug_is_refused_naming_the_tensor(bug, checkpoints):
    heldout_support.assert_refused(MODELS, checkpoints, "mimo_v2_flash", "model.layers.1.self_attn.sinks")


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def test_top_k_weights_left_unnormalised_in_the_reference_names_the_reference(checkpoints):
    """The reference's router with norm_topk_prob off, listing its top k in its own order: compared by value."""
    ref = heldout_support.reference_model(checkpoints["qwen3_next"])
    for layer in ref.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "norm_topk_prob"):
            gate.norm_topk_prob = False
    bad = heldout_support.first_mismatch(MODELS, "qwen3_next", ref)
    assert bad.name == "model.layers.0.mlp.router.weights" and bad.hint.kind == "renormalisation", bad
    assert "ours sums to 1 in every row, the reference does not" in bad.hint.text


def test_a_gated_norm_gating_with_sigmoid_in_the_reference_is_named_by_one_change_to_its_code(checkpoints):
    """The fault on the reference's side (its Gated DeltaNet's output norm gates with sigmoid, ours with SiLU):
    ours' Gated DeltaNet is computed untapped, and the one change to the reference's code that makes the two agree
    is named with its source line (here the change undoes the reference's fault)."""
    ref = heldout_support.reference_model(checkpoints["qwen3_next"])
    for layer in ref.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.norm.activation = "sigmoid"
    bad = heldout_support.first_mismatch(MODELS, "qwen3_next", ref)
    assert bad.name == "model.layers.0.linear_attn.norm" and bad.hint.kind == "one_change", bad
    assert "silu in place of sigmoid" in bad.hint.text and "modeling_qwen3_next.py:73" in bad.hint.text, bad.hint


def test_an_attention_scale_over_the_values_width_in_the_reference_names_the_reference(checkpoints):
    ref = heldout_support.reference_model(checkpoints["mimo_v2_flash"])
    for layer in ref.model.layers:
        layer.self_attn.scaling = 16**-0.5
    bad = heldout_support.first_mismatch(MODELS, "mimo_v2_flash", ref)
    assert bad.name == "model.layers.0.self_attn.scores" and bad.hint.kind == "attention_scale", bad
    assert "the reference by 0.25 (= 1/sqrt(v_head_dim=16)" in bad.hint.text
