"""A seventeenth held-back set: PhiMoE, nanochat and LFM2 user models by a helper who never read ``parity/``.

``tests/user_models/heldout17/``: a PhiMoE (LayerNorms with biases, an output head with a bias, LongRoPE
with its attention factor, a sliding window, SparseMixer top-2 routing over stacked experts, q/k/v held as
einsum tensors), a nanochat (weight-free RMSNorms, one of them on the token embeddings, RoPE turning the
other way from Llama's, a weight-free per-head q/k norm after RoPE, squared ReLU, a final soft-cap) and an
LFM2 (gated short-convolution layers beside attention layers, per-head q/k norms with gains, SwiGLU with
w1/w2/w3), each over its own parameter names and layouts. 39 bugs, five correct variants per family.

Its first measure (2026-12-03, eleventh session, with the sixteenth set's fixes and nothing fitted to this
set, Transformers 5.25.0): 36 of 36 correct runs passed; 18 of 39 hints named the cause, 3 loader bugs were
refused naming the tensor, 1 named a wrong cause (nanochat's q/k norm missing read as RoPE turned the other
way: the reference's own direction), 17 named the component or nothing (LFM2's five conv forms and its
padding at ``out_proj`` with no hint, its w1/w3 swap; SparseMixer's weights at an untapped block; nanochat's
RoPE direction and pairing, its embedding norm; LongRoPE's factor list). The fixes by kind are asserted below.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import parity
from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout17"))

import heldout17_lfm2
import heldout17_nanochat
import heldout17_phimoe

MODELS = {"phimoe": heldout17_phimoe, "nanochat": heldout17_nanochat, "lfm2": heldout17_lfm2}


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helper's weights: norm weights around 1, other vectors (biases) ~0.3, token embeddings of unit
    scale, other matrices of unit gain."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.copy_(
                1.0 + 0.5 * torch.randn(p.shape, generator=gen)
                if "norm" in name
                else 0.3 * torch.randn(p.shape, generator=gen)
            )
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    common = heldout_support.COMMON
    specs = {
        "phimoe": T.PhimoeConfig(
            **common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
            attention_bias=True, lm_head_bias=True, sliding_window=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0, 1.05, 1.15, 1.3, 1.6, 2.0, 2.6, 3.4],
                "long_factor": [1.0, 1.3, 1.9, 2.8, 4.0, 6.0, 9.0, 14.0],
                "short_mscale": 1.25, "long_mscale": 1.5, "original_max_position_embeddings": 64,
            }),
        "nanochat": T.NanoChatConfig(
            **common, intermediate_size=128, hidden_act="relu2", attention_bias=True, final_logit_softcapping=10.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # untied: a head tied to a unit-scale table gives logits ~40, whose float32 noise nears the 1e-4 bar
        "lfm2": T.Lfm2Config(
            **common, intermediate_size=96, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5,
            block_multiple_of=32, full_attn_idxs=[1, 2], conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    }  # fmt: skip
    return heldout_support.save_checkpoints(tmp_path_factory.mktemp("heldout17"), specs, randomise, 1000, 1234)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("lfm2", "conv_as_shifts", True),
    ("lfm2", "bx_swapped", False),
    ("nanochat", "rope_negated_angle", False),
    ("nanochat", "qk_norm_before_rope", True),
    ("phimoe", "dense_experts", False),
]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN)


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """LFM2's conv written as shifted copies (no op of ours reads its taps as one conv), B and X swapped at load
    (their product is symmetric); nanochat's rotation as Llama's with negated angles, its weight-free q/k norm
    before RoPE; PhiMoE's experts run densely on every token."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


SPARSEMIXER = "SparseMixer's weights (each of the two best experts' softmax share over the logits within 2 * jitter_eps"
CONV = "likely the gated short conv written otherwise: ours computes out_proj's input as"

NAMED = [
    ("lfm2", "lf_embedding_norm_at_input", False, "model.layers.0.operator_norm", "norm_placement",
     "the input of operator_norm in ours equals the reference's input after a RMSNorm"),
    ("lfm2", "lf_conv_kernel_flipped", False, "model.layers.0.conv.out_proj", "short_conv", f"{CONV} the taps reversed"),
    ("lfm2", "lf_conv_tail_slice", False, "model.layers.0.conv.out_proj", "short_conv",
     f"{CONV} the current and the NEXT L - 1 tokens"),
    ("lfm2", "lf_in_proj_chunk_order", False, "model.layers.0.conv.out_proj", "short_conv",
     f"{CONV} the output gate read from X's chunk and the conv's input from C's"),
    ("lfm2", "lf_output_gate_before_conv", False, "model.layers.0.conv.out_proj", "short_conv",
     f"{CONV} both gates before the conv, conv(C * B * X)"),
    ("lfm2", "lf_conv_silu", False, "model.layers.0.conv.out_proj", "short_conv", f"{CONV} a SiLU after the conv"),
    ("lfm2", "lf_qk_norm_after_rope", False, "model.layers.1.self_attn.q_layernorm", "norm_placement",
     "ours' q_layernorm reads its input after RoPE"),
    ("lfm2", "lf_qk_norm_over_hidden", False, "model.layers.1.self_attn.q_rot", "norm_kind",
     "statistic over every head's features together in ours"),
    ("lfm2", "lf_w1_w3_swapped", False, "model.layers.0.feed_forward.w2", "swapped_roles",
     "w1 and w3 agree on both sides, but ours applies the activation (silu) to w3's output"),
    ("lfm2", "lf_rmsnorm_gemma_offset", False, "model.layers.0.operator_norm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("lfm2", "lf_rope_interleaved", False, "model.layers.1.self_attn.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("lfm2", "lf_conv_pad_not_zeroed", True, "model.layers.0.conv.out_proj", "short_conv",
     "padding reaching the short conv: only the first 2 real tokens after the padding differ"),
    ("lfm2", "lf_attn_pad_mask_dropped", True, "model.layers.1.self_attn.probs", "padding", "the mask not applied"),
    ("nanochat", "nc_rope_llama_sign", False, "model.layers.0.self_attn.q_rot", "rope_rotation",
     "the reference applies this layer's RoPE frequencies with the rotation reversed"),
    ("nanochat", "nc_rope_interleaved", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs, the reference half-split"),
    ("nanochat", "nc_embed_norm_missing", False, "model.layers.0.self_attn.q_proj", "norm_skipped",
     "the norm of the token embeddings (RMSNorm without weights, before the first layer, nanochat's) not applied in ours"),
    ("nanochat", "nc_relu_not_squared", False, "model.layers.0.mlp.fc2", "activation", "the reference relu squared"),
    ("nanochat", "nc_layernorm_not_rms", False, "model.layers.0.self_attn.q_proj", "norm_kind",
     "normalised by LayerNorm ((x - mean) / sqrt(var + eps)), the reference's the layer's stream normalised by RMSNorm"),
    ("nanochat", "nc_qk_norm_missing", False, "model.layers.0.self_attn.q_rot", "norm_skipped",
     "the per-head q norm (q_norm, RMS over each head's features) skipped in ours"),
    ("nanochat", "nc_qk_norm_across_heads", False, "model.layers.0.self_attn.q_rot", "norm_kind",
     "statistic over every head's features together in ours"),
    ("nanochat", "nc_gqa_tiled", False, "model.layers.0.self_attn.scores", "head_mapping",
     "repeat instead of repeat_interleave"),
    ("nanochat", "nc_softcap_no_rescale", False, "logits", "softcap", "tanh(x / 10) (not multiplied back by the cap)"),
    ("nanochat", "nc_softcap_hardcoded_15", False, "logits", "softcap",
     "ours' logits are 15 * tanh(x / 15), the reference's 10 * tanh(x / 10)"),
    ("nanochat", "nc_pad_mask_dropped", True, "model.layers.0.self_attn.probs", "padding", "the mask not applied"),
    ("phimoe", "pm_layernorm_as_rmsnorm", False, "model.layers.0.input_layernorm", "norm_kind",
     "ours behaves like RMSNorm over the last axis, the reference like LayerNorm"),
    ("phimoe", "pm_mixtral_routing", False, "model.layers.0.mlp.router.weights", "routing_weights",
     f"ours equals a softmax over all experts, renormalised over the chosen (a softmax over the chosen k alone), the "
     f"reference {SPARSEMIXER}"),
    ("phimoe", "pm_jitter_eps_not_doubled", False, "model.layers.0", "routing_weights",
     "SparseMixer's weights with the threshold jitter_eps (0.1), not 2 * jitter_eps in ours"),
    ("phimoe", "pm_top2_keeps_top1", False, "model.layers.0", "routing_weights",
     "SparseMixer's weights with the first expert left in the second one's softmax in ours"),
    ("phimoe", "pm_top2_weights_renormalised", False, "model.layers.0", "routing_weights",
     "SparseMixer's weights renormalised over the two chosen (they are not: each is its own softmax share) in ours"),
    ("phimoe", "pm_gate_up_swapped", False, "model.layers.0", "swapped_weights",
     "the chosen experts computed with gate_up_proj's halves swapped (up first: the activation on the up half) in ours"),
    ("phimoe", "pm_mscale_ignored", False, "model.layers.0.self_attn.q_rot", "rope_attention_factor",
     "ours takes no factor (1), the reference LongRoPE's sqrt(1 + ln(4) / ln(original_max_position_embeddings 64))"),
    ("phimoe", "pm_mscale_on_q_only", False, "model.layers.0.self_attn.k_rot", "rope_attention_factor",
     "ours takes no factor (1), the reference LongRoPE's sqrt(1 + ln(4) / ln(original_max_position_embeddings 64))"),
    ("phimoe", "pm_rope_long_factor", False, "model.layers.0.self_attn.q_rot", "rope_scaling",
     "ours rotates like LongRoPE with long_factor (the frequencies divided by its factors) where the config takes "
     "the other list"),
    ("phimoe", "pm_sliding_window_ignored", False, "model.layers.0.self_attn.probs", "sliding_window",
     "ours attends with full causal attention, the reference with a window of 16"),
    ("phimoe", "pm_window_off_by_one", False, "model.layers.0.self_attn.probs", "sliding_window",
     "ours attends with a window of 17, the reference with a window of 16"),
    ("phimoe", "pm_pad_mask_dropped", True, "model.layers.0.self_attn.probs", "padding", "the mask not applied"),
]  # fmt: skip
REFUSED = [
    ("nanochat", "nc_attn_bias_dropped", "model.layers.0.self_attn.k_proj.bias"),
    ("nanochat", "nc_tied_head", "lm_head.weight"),
    ("phimoe", "pm_lm_head_bias_dropped", "lm_head.bias"),
]
FAST = {
    "lf_conv_kernel_flipped",
    "lf_conv_pad_not_zeroed",
    "lf_w1_w3_swapped",
    "nc_rope_llama_sign",
    "nc_qk_norm_missing",
    "nc_embed_norm_missing",
    "pm_jitter_eps_not_doubled",
    "pm_gate_up_swapped",
    "pm_rope_long_factor",
}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "says"), REFUSED, indirect=["bug"])
def test_a_loader_bug_is_refused_naming_the_tensor(model, bug, says, checkpoints):
    heldout_support.assert_refused(MODELS, checkpoints, model, says)


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def reference(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()


def first_mismatch(model: str, ref, **kwargs):
    res = parity.check_model(MODELS[model].build, reference=ref, seq_len=24, **kwargs)
    assert res.first_mismatch is not None, res.verdict()
    return res.first_mismatch


def test_a_short_conv_with_reversed_taps_in_the_reference_names_the_reference(checkpoints, monkeypatch):
    """LFM2's ``causal_conv1d_fn`` convolving with its taps reversed: the reference is the side off the form."""
    from transformers.models.lfm2 import modeling_lfm2 as hf

    def reversed_taps(x, weight, bias=None, activation=None, **kwargs):
        taps = weight.shape[-1]
        out = torch.nn.functional.conv1d(x, weight.flip(-1)[:, None], bias, padding=taps - 1, groups=x.shape[1])
        return out[..., : x.shape[-1]]

    monkeypatch.setattr(hf, "causal_conv1d_fn", reversed_taps)
    bad = first_mismatch("lfm2", reference(checkpoints["lfm2"]))
    assert bad.name == "model.layers.0.conv.out_proj" and bad.hint.kind == "short_conv", bad
    assert "the reference computes out_proj's input as the taps reversed" in bad.hint.text
    assert bad.hint.evidence["side"] == "the reference"


def test_padding_reaching_the_reference_s_short_conv_is_named(checkpoints, monkeypatch):
    """LFM2 without ``apply_mask_to_padding_states`` in the reference: the same positional pattern, found from
    out_proj's inputs alone."""
    from transformers.models.lfm2 import modeling_lfm2 as hf

    monkeypatch.setattr(hf, "apply_mask_to_padding_states", lambda hidden_states, attention_mask: hidden_states)
    bad = first_mismatch("lfm2", reference(checkpoints["lfm2"]), batch_size=2, left_pad=5)
    assert bad.name == "model.layers.0.conv.out_proj" and bad.hint.kind == "short_conv", bad
    assert "only the first 2 real tokens after the padding differ" in bad.hint.text


def nanochat_without_embedding_norm(checkpoint: Path):
    """nanochat's reference without its weight-free norm on the embeddings: its one ``norm`` module (run on the
    embeddings, then after the last layer) made the identity, the final norm applied by a hook on the model."""
    ref = reference(checkpoint)
    final = ref.model.norm
    ref.model.norm = torch.nn.Identity()

    def final_norm(module, args, output):
        output.last_hidden_state = final(output.last_hidden_state)
        return output

    ref.model.register_forward_hook(final_norm)
    return ref


def test_a_reference_given_altered_is_copied_for_the_float64_run_not_rebuilt(checkpoints):
    """A float64 twin built from the class would normalise the embeddings again: its difference to the float32
    reference (the fault itself) would be taken for the reference's own rounding, and the check would pass. The
    altered model is copied instead, said in a note, and the fault fails."""
    res = parity.check_model(
        MODELS["nanochat"].build, reference=nanochat_without_embedding_norm(checkpoints["nanochat"]), seq_len=24
    )
    assert not res.passed and res.first_mismatch.name == "model.layers.0.mlp.fc1", res.verdict()
    assert any("the reference given is not its class as built (model has forward hooks)" in n for n in res.notes), (
        res.notes
    )


def test_the_embedding_norm_missing_in_the_reference_names_the_reference(checkpoints):
    """Bit-exact, the eps-sized difference at layer 0's first projection is judged (a copied float64 twin keeps
    float32 tables, so the default run's tolerances there are wider and the first node is the MLP's)."""
    bad = first_mismatch("nanochat", nanochat_without_embedding_norm(checkpoints["nanochat"]), exact=True)
    assert bad.name == "model.layers.0.self_attn.q_proj" and bad.hint.kind == "norm_skipped", bad
    assert "norm of the token embeddings" in bad.hint.text and bad.hint.evidence["side"] == "the reference"


def test_a_per_head_q_norm_skipped_in_the_reference_names_the_reference(checkpoints):
    ref = reference(checkpoints["nanochat"])
    for layer in ref.model.layers:
        layer.self_attn.q_norm.forward = types.MethodType(lambda self, x: x, layer.self_attn.q_norm)
    bad = first_mismatch("nanochat", ref)
    assert bad.name == "model.layers.0.self_attn.q_rot" and bad.hint.kind == "norm_skipped", bad
    assert "skipped in the reference" in bad.hint.text


def test_sparsemixer_weights_renormalised_in_the_reference_name_both_forms(checkpoints, monkeypatch):
    """PhiMoE's ``sparsemixer`` with its two weights renormalised in the reference: ours holds SparseMixer's own."""
    from transformers.models.phimoe import modeling_phimoe as hf

    sparsemixer = hf.sparsemixer

    def renormalised(scores, jitter_eps, training, top_k=2):
        weights, chosen = sparsemixer(scores, jitter_eps, training, top_k)
        return weights / weights.sum(-1, keepdim=True), chosen

    monkeypatch.setattr(hf, "sparsemixer", renormalised)
    bad = first_mismatch("phimoe", reference(checkpoints["phimoe"]))
    assert bad.hint is not None and bad.hint.kind == "routing_weights", bad
    assert "renormalised over the two chosen" in bad.hint.evidence["reference"], bad.hint
    assert bad.hint.evidence["ours"].startswith("the chosen experts' outputs weighted by " + SPARSEMIXER), bad.hint
