"""A thirty-sixth held-back set: Mamba-2, Beam and HyperCLOVA X user models by helpers who never read ``parity/``
(``tests/user_models/heldout36/``, 42 bugs, five correct variants per family).

First measure in the twenty-first session (2026-12-05), on the twentieth session's code, nothing fitted: correct runs
12 of 36 (every Mamba-2 run failed at in_proj: ours cuts it into z, kept transposed, and xBC and dt, kept as views of
the checkpoint's rows, and only one part was read; every HyperCLOVA X run but one failed at post_norm1: its four norm
gains stacked as rows of one tensor were given to the nodes in the order Transformers registers them, not the order
they run; one Mamba-2 variant refused for folding its norms into weights it holds as views, editing the reference's);
21 of 42 bugs named (50%), 16 wrong causes (11 of them Mamba-2's false in_proj shape). Fitted after, by kind: a block of
whole rows kept as a view counted with the rows copied beside it, its bias slice matched to it; a parameter serving
several nodes gives its reads, and the inputs they read, to those nodes in the reference's execution order; a fused
bias sliced per part (``x @ W[:, a:b] + b[a:b]``) waits for its slice; a decoder layer is ours' highest module holding
that layer alone; a build editing the state dict's tensors in place is run again on copies; a MoE block that scales
its experts' sum (``routed_scaling_factor``) read at the node after it, a group-limited router without shared experts
judged by its own forms; the earliest standing failure kept while earlier ones may be taken back (a bias folded in
every layer); per-layer-type RoPE parameters with a NoPE type marked None; a per-head vector tiled across the
features; a norm over the residual sum with a scaled branch (either side); two unequal parts of a split read in the
other order; a multiplier applied inverted named as such. After: 32 of 36 correct runs pass (two known false failures:
Beam's residual accumulated unscaled with each norm's eps scaled to match, a power of sqrt(n) apart node by node;
Mamba-2 with its norms folded into the next weights, a convention coverage does not read); 40 of 42 bugs name the
cause (95%; three by refusing the tensor never loaded); no wrong cause seen. Then a parameter added to an
activation's input added to its output instead (``softplus(dt) + dt_bias``, one change to the reference's code): 41 of
42 (set 34's Lara Mini alike). Unnamed: Mamba-2's D skip folded into the scan.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout36"))

import heldout36_beam
import heldout36_hyperclovax
import heldout36_mamba2

MODELS = {"mamba2": heldout36_mamba2, "beam": heldout36_beam, "hyperclovax": heldout36_hyperclovax}
TYPES = {"mamba2": "mamba2", "beam": "beam", "hyperclovax": "hyperclovax"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    kwargs = {
        "mamba2": dict(
            num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2, conv_kernel=4, chunk_size=10,
            use_bias=True, use_conv_bias=True, hidden_act="silu", time_step_limit=(0.1, 2.0),
            layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=False,
        ),
        "beam": dict(
            head_dim=32, intermediate_size=96, moe_intermediate_size=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "dense"], sliding_window=7,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                             "full_attention": None},
            attention_bias=True, rms_norm_eps=1e-5, num_experts=12, n_group=3, topk_group=2, num_experts_per_tok=3,
            norm_topk_prob=True, routed_scaling_factor=1.7, final_logit_softcapping=4.0, tie_word_embeddings=False,
            hidden_act="silu",
        ),
        "hyperclovax": dict(
            intermediate_size=96, head_dim=32, hidden_act="silu", rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, attention_bias=True, mlp_bias=True,
            tie_word_embeddings=False, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.125,
            logits_scaling=0.5, use_post_norm=True,
        ),
    }  # fmt: skip
    root = tmp_path_factory.mktemp("heldout36")
    out = {}
    for name, kw in kwargs.items():  # each family seeded alone, as its helper verified it
        spec = {name: AutoConfig.for_model(TYPES[name], **{**heldout_support.COMMON, **kw})}
        out.update(heldout_support.save_checkpoints(root, spec, heldout_support.randomise_with_expert_bias, 1000, 1234))
    return out


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [("mamba2", "", False), ("beam", "", True), ("hyperclovax", "", False)]
#: known false failures, strict xfails: none. (Beam's residual accumulated unscaled, each norm's eps scaled by the
#: depth to match, equal at the logits and a factor sqrt(n) apart at every layer's output, was one until the
#: twenty-ninth session: the logits now arbitrate such gross internal differences, each node named in a note.)
KNOWN_FALSE: frozenset[tuple[str, str]] = frozenset()


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """Mamba-2's in_proj cut into a transposed copy and two views of its rows; Beam's four norm gains and q/k
    norm gains stacked, its per-head gate bias folded into a fused bias; HyperCLOVA X's four norm gains stacked and
    read in the order the layer runs them."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN, KNOWN_FALSE), indirect=["bug"]
)
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


MIXER_NORM = "backbone.layers.0.mixer.norm"
NAMED = [
    ("mamba2", "norm_is_layernorm", False, "backbone.layers.0.norm", "norm_kind",
     "ours behaves like LayerNorm (mean-subtracting), the reference like RMSNorm"),
    ("mamba2", "inproj_split_xbc_first", False, MIXER_NORM, "one_change",
     "parts 0 and 1 of this split (sizes 128 and 192) read in the other order from the fused tensor"),
    ("mamba2", "conv_trim_wrong_end", False, MIXER_NORM, "one_change", "a causal window read from the wrong side"),
    ("mamba2", "conv_taps_reversed", False, MIXER_NORM, "one_change", "the conv's kernel read in reverse"),
    ("mamba2", "a_log_exp_missing", False, MIXER_NORM, "one_change", "exp left out"),
    ("mamba2", "d_skip_discretized", False, MIXER_NORM, "one_change",
     "the selective scan with its state read with the skip on the discretised input (D dt x), not D x"),
    ("mamba2", "dt_bias_after_softplus", False, MIXER_NORM, "one_change",
     "backbone.layers.0.mixer.dt_bias added after the softplus instead of to its input (softplus(x) + b for"),
    ("mamba2", "bc_groups_tiled", False, MIXER_NORM, "one_change",
     "repeat_interleave by 4 replaced by whole-block repeats"),
    ("mamba2", "gate_after_norm", False, MIXER_NORM, "one_change", "gate applied after its normalisation"),
    ("mamba2", "gated_norm_ungrouped", False, MIXER_NORM, "one_change",
     "the mean over the last two axes together in place of the last"),
    ("mamba2", "residual_from_normed", False, "backbone.layers.0", "residual",
     "the residual taken from another point, e.g. the normed input"),
    ("mamba2", "pad_mask_post_conv_skipped", True, MIXER_NORM, "one_change",
     "the broadcast factor of shape (2, 24, 1) left out (a mask or a scale)"),
    ("hyperclovax", "logits_scaling_divided", False, "logits", "scale",
     "1 / the config's logits_scaling squared (0.25) (4) (one side divides by it where the other multiplies)"),
    ("hyperclovax", "embedding_multiplier_skipped", False, "model.layers.0.input_layernorm", "scale",
     "matches 1 / the config's embedding_multiplier (3)"),
    ("hyperclovax", "residual_multiplier_on_skip", False, "model.layers.0.post_attention_layernorm", "residual",
     "ours computes 0.4 x + 1 f(x), the reference 1 x + 0.4 f(x)"),
    ("hyperclovax", "attention_scale_head_dim", False, "model.layers.0.self_attn.scores", "attention_scale",
     "the reference by 0.125 (= the config's attention_multiplier (0.125)"),
    ("hyperclovax", "post_norm_on_residual_sum", False, "model.layers.0.post_norm1", "norm_placement",
     "ours' post_norm1 normalises the sum after the residual add (1 x model.layers.0.input_layernorm@input + 0.4 x"),
    ("hyperclovax", "post_norms_swapped", False, "model.layers.0.post_norm1", "swapped_weights",
     "ours applies post_norm1's weight where the reference runs post_norm2 and post_norm2's where it runs post_norm1"),
    ("hyperclovax", "rmsnorm_gemma_offset", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("hyperclovax", "rope_interleaved", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("hyperclovax", "gqa_heads_tiled", False, "model.layers.0.self_attn.scores", "head_mapping",
     "K/V heads expanded with repeat instead of repeat_interleave"),
    ("hyperclovax", "qkv_split_kv_swapped", False, "model.layers.0.self_attn.k_rot", "swapped_roles",
     "ours' k_rot is the reference's v_proj rotated"),
    ("hyperclovax", "causal_mask_one_ahead", False, "model.layers.0.self_attn.probs", "causal_mask",
     "so a query reads the future"),
    ("hyperclovax", "padding_mask_ignored", True, "model.layers.0.self_attn.probs", "padding",
     "ours gives weight to 380 earlier padding keys the other side masks"),
    ("hyperclovax", "rope_angles_bf16", False, "model.layers.0.self_attn.q_rot", "rope_frequencies",
     "(bfloat16 rounding is 4e-3)"),
    ("beam", "beam_residual_scales_swapped", False, "model.layers.0", "residual",
     "ours computes 0.5773503 x + 0.8164966 f(x), the reference 0.8164966 x + 0.5773503 f(x)"),
    ("beam", "beam_window_off_by_one", False, "model.layers.0.self_attn.probs", "sliding_window",
     "ours attends with a window of 8, the reference with a window of 7"),
    ("beam", "beam_rope_on_full_layers", False, "model.layers.1.self_attn.q_rot", "rope_unexpected",
     "this full_attention layer is NoPE, ours rotates it with the RoPE of sliding_attention layers"),
    ("beam", "beam_qk_norm_after_rope", False, "model.layers.0.self_attn.q_norm", "norm_placement",
     "ours' q_norm reads its input after RoPE"),
    ("beam", "beam_gate_bias_tiled", False, "model.layers.0.self_attn.gate_proj", "bias",
     "4 values tiled across its 128 features (feature j reads value j % 4)"),
    ("beam", "beam_router_weights_with_bias", False, "model.layers.1.post_feedforward_layernorm", "routing_weights",
     "the correction bias kept in the weights (sigmoid + e_score_correction_bias, not only in the choice) in ours"),
    ("beam", "beam_group_score_top1", False, "model.layers.1.post_feedforward_layernorm", "routing_weights",
     "experts chosen with each group scored by its best expert (max), not its two best summed in ours"),
    ("beam", "beam_expert_gate_up_swapped", False, "model.layers.1.post_feedforward_layernorm", "swapped_weights",
     "the chosen experts computed with gate_up_proj's halves swapped"),
    ("beam", "beam_post_attn_norm_as_pre_ffn", False, "model.layers.0.post_attention_layernorm", "swapped_weights",
     "ours applies post_attention_layernorm's weight where the reference runs pre_feedforward_layernorm"),
    ("beam", "beam_rmsnorm_one_plus", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("beam", "beam_scaling_from_hidden", False, "model.layers.0.self_attn.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(hidden_size/num_attention_heads=16))"),
    ("beam", "beam_softcap_no_divide", False, "logits", "softcap", "ours' logits are 4 * tanh(x) (x not divided"),
    ("beam", "beam_nope_scale_log", False, "model.layers.1.self_attn.q_rot", "scale",
     "a query scale by position (an attention temperature)"),
    ("beam", "beam_pad_mask_ignored_sliding", True, "model.layers.0.self_attn.probs", "padding",
     "ours gives weight to 80 earlier padding keys the other side masks"),
]  # fmt: skip
FAST = {"inproj_split_xbc_first", "post_norm_on_residual_sum", "beam_router_weights_with_bias", "beam_gate_bias_tiled"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.parametrize(
    ("model", "bug", "says"),
    [
        ("mamba2", "out_proj_bias_dropped", "backbone.layers.0.mixer.out_proj.bias"),
        ("mamba2", "head_tied", "lm_head.weight"),
        ("hyperclovax", "lm_head_tied", "lm_head.weight"),
    ],
    indirect=["bug"],
)
def test_a_tensor_the_loader_never_loads_is_refused_by_name(model, bug, says, checkpoints):
    heldout_support.assert_refused(MODELS, checkpoints, model, says)


def test_parts_of_one_fused_tensor_are_not_reported_as_one_tensor_held_twice(checkpoints):
    """Mamba-2's in_proj held as three parts (z copied transposed, xBC and dt as views): a refusal for another
    tensor does not list them as parameters holding one reference tensor twice."""
    import parity

    heldout36_mamba2.BUG = "head_tied"
    try:
        with pytest.raises(parity.ParityError) as raised:
            heldout_support.check(MODELS, checkpoints, "mamba2")
    finally:
        heldout36_mamba2.BUG = ""
    message = str(raised.value)
    assert "head_w holds backbone.embeddings.weight, as tok_emb does" in message
    assert "in_proj.weight, as" not in message
