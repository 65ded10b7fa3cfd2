"""A thirty-fifth held-back set: Qwen4-Exp (its text model), DeepSeek V3.2 and RWKV user models by helpers who never
read ``parity/`` (``tests/user_models/heldout35/``, 42 bugs, five correct variants per family).

First measure in the twentieth session (2026-12-05), on the nineteenth session's code plus the comparison of later
calls (nothing else fitted): correct runs 12 of 36 (every RWKV run refused: Transformers' RwkvModel divides its output
weights in place on its first forward, which parity took for ours editing shared weights; every Qwen4-Exp run failed
at layer 1's q_proj: its per-head [query | gate] rows are held by two parameters of ours, the queries fused with k
and v); 13 of 42 bugs named (31%), 10 wrong causes (DeepSeek V3.2's latent attention always reorders its rope rows
from interleaved pairs, which parity read from the config alone, so q_rot and k_rot differed on every run and four
indexer faults were read as a weight permutation; Qwen4-Exp's grouped norm gains kept (streams, hidden) were read as
values computed at load). Fitted after, by kind: a reference that rewrites its own weights on its first forward is
run once before the pair is built, ours built from the checkpoint's tensors (:mod:`parity.build.settle`); a tensor
whose rows ours holds partly fused with other tensors' rows and partly in a parameter of their own (``fused part``);
a vector stacked as a row of one parameter (a LayerNorm's ``[weight; bias]``, RWKV's mixes), and a norm's vector kept
``1 + w`` in another shape, read as the vectors they are; a latent attention that always rotates interleaved rope
rows read from its code; an EOS the reference's forward acts on placed in the random inputs; a norm over several
hidden-size streams read per stream or over all of them; a norm's eps the module hard-codes (1e-6) tried beside the
config's; a token shift read wrong (RWKV's time_mix: the next token, no neighbour, the mix inverted); a node both
sides run in a loop, ours another number of times, named as the loop's iterations; a reference given with a setting
changed on an instance (a padding, a group size set to None) copied for the float64 run, not rebuilt from its class.
After: 34 of 36 correct runs pass (the two left: RWKV with its rescaling folded into each LayerNorm's eps, equal at
the logits but not node by node, a known false failure); 31 of 42 bugs name the cause (four by refusing or naming the
tensor never loaded); no wrong cause seen (``qsa_tail_dropped`` reads as a mask hiding every key of the first
queries, which is what dropping the trailing block does to them, under the padding kind). Then (twenty-second session) a grouped norm gain read in the float64 pass too, where the
weights are known by name only: the sigmoid router is named; an additive mask's padding left out (the indexer's) by
the one-change search; RWKV's key and value mixes read by each other's weights named as the key reading the value's
input (34 of 42). Twenty-fourth session: the indexer's key norm applied to each key before the block's mean pools
them, named as a module applied before a reduction (the false shape before).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout35"))

import heldout35_deepseek_v32
import heldout35_qwen4_exp
import heldout35_rwkv

MODELS = {"qwen4_exp": heldout35_qwen4_exp, "deepseek_v32": heldout35_deepseek_v32, "rwkv": heldout35_rwkv}
TYPES = {"qwen4_exp": "qwen4_exp_text", "deepseek_v32": "deepseek_v32", "rwkv": "rwkv"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    common = heldout_support.COMMON
    kwargs = {
        "qwen4_exp": dict(
            layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
            head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
            rms_norm_eps=1e-5, hidden_act="silu", linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=3, output_gate_type="sigmoid",
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=True, hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=32,
            ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=97,
            make_ngram_vocab_size_divisible_by=16, seed=4321, split_ngram_parts=1, indexer_n_heads=2,
            indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=6, indexer_compress_ratio=3, eos_token_id=144,
        ),
        "deepseek_v32": dict(
            num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                             "mscale_all_dim": 0.8},
            rms_norm_eps=1e-2, index_topk=8, index_n_heads=8, index_head_dim=16,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"], first_k_dense_replace=1, intermediate_size=96,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, n_shared_experts=2, moe_intermediate_size=16, hidden_act="silu",
            tie_word_embeddings=False,
        ),
        "rwkv": dict(intermediate_size=96, layer_norm_epsilon=1e-3, rescale_every=2, tie_word_embeddings=False),
    }  # fmt: skip
    specs = {name: AutoConfig.for_model(TYPES[name], **{**common, **kw}) for name, kw in kwargs.items()}
    return heldout_support.save_checkpoints(
        tmp_path_factory.mktemp("heldout35"), specs, heldout_support.randomise_with_expert_bias, 1000, 1234
    )


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [("qwen4_exp", "", False), ("deepseek_v32", "", False), ("rwkv", "", True)]
#: RWKV with its rescaling replaced by each LayerNorm's eps scaled to match: the stream differs from the reference's by
#: a power of two at every node a later LayerNorm cancels (a port equal at the logits, not node by node)
KNOWN_FALSE: frozenset[tuple[str, str]] = frozenset()


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """Qwen4-Exp's q_proj rows held by two parameters (queries fused with k and v, gates apart) and its grouped
    norms' gains kept (streams, hidden); DeepSeek V3.2's rope rows interleaved whatever its config says; RWKV's
    reference rescaling its own weights on its first forward, its LayerNorms' weight and bias stacked."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN, KNOWN_FALSE), indirect=["bug"]
)
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


GDN_NORM = "model.layers.0.linear_attn.norm"
NAMED = [
    ("qwen4_exp", "gdn_heads_tiled", False, GDN_NORM, "one_change", "replaced by whole-block repeats (tiled"),
    ("qwen4_exp", "gdn_gate_act_hidden_act", False, GDN_NORM, "one_change", "silu in place of sigmoid"),
    ("qwen4_exp", "gdn_gated_norm_offset", False, GDN_NORM, "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("qwen4_exp", "attn_q_gate_halves", False, "model.layers.1.self_attn.q_norm", "one_change",
     "this fused output read as 2 whole blocks (every head's part j together)"),
    ("qwen4_exp", "qsa_blocks_absolute", True, "model.layers.1.self_attn.indexer.k_layernorm", "loop_count",
     "ours runs it 41 times in this forward, the reference 39"),
    ("qwen4_exp", "qsa_knorm_before_pool", False, "model.layers.1.self_attn.indexer.k_layernorm", "reduction_order",
     "ours applies it to each of the 3 vectors along axis 1 (output (1, 3, 12)) and takes their mean after"),
    ("qwen4_exp", "hc_norm_ungrouped", False, "model.layers.0.attn_hyper_connection.hc_norm", "norm_kind",
     "ours behaves like RMSNorm over the last axis, the reference like RMSNorm per stream (3 groups of hidden_size"),
    ("qwen4_exp", "moe_sigmoid_router", False, "model.layers.1.attn_hyper_connection.hc_norm", "one_change",
     "sigmoid in place of softmax"),
    ("qwen4_exp", "ple_conv_undilated", False, "model.layers.0.attn_hyper_connection.hc_norm", "one_change",
     "the conv's dilation 1 in place of 3 (each output reads its nearest steps)"),
    ("qwen4_exp", "ple_no_eos_reset", False, "model.layers.0.ple.ple_embedding.ngram_embedding", "one_change",
     "`position_in_segment = positions.unsqueeze(0) - segment_start`"),
    ("deepseek_v32", "mla_kv_b_global_split", False, "model.layers.0.self_attn.k_rot", "qkv_layout",
     "the per-head layout read as [all k_nope | all v]"),
    ("deepseek_v32", "mla_mscale_wrong_field", False, "model.layers.0.self_attn.scores", "attention_scale",
     "ours scales q k^T by 0.264642, the reference by 0.251911"),
    ("deepseek_v32", "latent_norm_config_eps", False, "model.layers.0.self_attn.q_a_layernorm", "norm_eps",
     "as eps 0.01 in ours and 1e-06 in the reference give"),
    ("deepseek_v32", "yarn_no_attention_factor", False, "model.layers.0.self_attn.q_rot", "scale",
     "(= 1 / the yarn attention factor"),
    ("deepseek_v32", "indexer_k_rmsnorm", False, "model.layers.0.self_attn.indexer.k_norm", "norm_kind",
     "ours behaves like RMSNorm over the last axis, the reference like LayerNorm"),
    ("deepseek_v32", "indexer_no_relu", False, "model.layers.0.self_attn.o_proj", "one_change", "relu left out"),
    ("deepseek_v32", "indexer_q_from_raw_latent", False, "model.layers.0.self_attn.indexer.wq_b", "projection_input",
     "model.layers.0.self_attn.q_a_layernorm skipped in ours"),
    ("deepseek_v32", "indexer_topk_before_mask", False, "model.layers.0.self_attn.o_proj", "one_change",
     "`index_scores = index_scores + attention_mask`"),
    ("deepseek_v32", "indexer_rope_interleaved", False, "model.layers.0.self_attn.o_proj", "one_change",
     "RoPE's pairs read interleaved (2i, 2i + 1) in place of half-split (i, i + d/2)"),
    ("deepseek_v32", "indexer_causal_only", True, "model.layers.0.self_attn.o_proj", "one_change",
     "the mask's padding left out (the causal part alone"),
    ("deepseek_v32", "router_weights_biased", False, "model.layers.2.input_layernorm", "routing_weights",
     "the correction bias kept in the weights"),
    ("deepseek_v32", "router_group_max", False, "model.layers.2.input_layernorm", "routing_weights",
     "each group scored by its best expert (max)"),
    ("deepseek_v32", "moe_scale_on_shared", False, "model.layers.2.input_layernorm", "routing_weights",
     "routed_scaling_factor applied to the routed and the shared experts' sum in ours"),
    ("rwkv", "rwkv_decay_no_exp", False, "rwkv.blocks.0.attention.output", "one_change", "exp left out"),
    ("rwkv", "rwkv_bonus_skipped", False, "rwkv.blocks.0.attention.output", "one_change",
     "rwkv.blocks.0.attention.time_first (offset) left out"),
    ("rwkv", "rwkv_state_before_output", False, "rwkv.blocks.0.attention.output", "one_change",
     "the WKV recurrence with its state written with this step's e^{k_t} v_t before it is read for the output"),
    ("rwkv", "rwkv_rescale_weights_only", False, "rwkv.blocks.2.ln1", "scale",
     "ours' input to it is the reference's times 2 at every position; matches the hidden states' halving every "
     "config.rescale_every (2) layers"),
    ("rwkv", "rwkv_shift_future", False, "rwkv.blocks.0.attention.key", "token_shift",
     "ours mixes each token with the next one"),
    ("rwkv", "rwkv_mix_inverted", False, "rwkv.blocks.0.attention.key", "token_shift",
     "the mix read inverted, 1 - mix for mix"),
    ("rwkv", "rwkv_ffn_relu_unsquared", False, "rwkv.blocks.0.feed_forward.value", "activation",
     "ours equals relu of the reference's rwkv.blocks.0.feed_forward.key, the reference relu squared"),
    ("rwkv", "rwkv_ffn_shift_zero", False, "rwkv.blocks.0.feed_forward.key", "token_shift",
     "ours mixes in no neighbour"),
    ("rwkv", "rwkv_kv_split_swapped", False, "rwkv.blocks.0.attention.key", "projection_input",
     "its input is the reference's rwkv.blocks.0.attention.value@input"),
    ("rwkv", "rwkv_pre_ln_skipped", False, "rwkv.blocks.0.ln1", "missing", "rwkv.blocks.0.pre_ln skipped in ours"),
    ("rwkv", "rwkv_ln_out_eps_config", False, "rwkv.ln_out", "norm_eps",
     "as eps 0.001 in ours and 1e-05 in the reference give"),
]  # fmt: skip
FAST = {"hc_norm_ungrouped", "indexer_k_rmsnorm", "rwkv_mix_inverted", "moe_sigmoid_router"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.parametrize(
    ("model", "bug", "says"),
    [
        ("qwen4_exp", "ple_hash_seed_layer_idx", "model.layers.2.ple.ple_embedding.layer_multipliers"),
        ("deepseek_v32", "experts_gate_up_interleaved", "model.layers.1.mlp.experts.gate_up_proj"),
        ("rwkv", "rwkv_value_mix_from_key", "rwkv.blocks.0.attention.time_mix_value"),
        ("rwkv", "rwkv_head_tied", "head.weight"),
    ],
    indirect=["bug"],
)
def test_a_tensor_the_loader_never_loads_is_refused_by_name(model, bug, says, checkpoints):
    heldout_support.assert_refused(MODELS, checkpoints, model, says)


def test_a_token_shift_taken_the_wrong_way_in_the_reference_is_named(checkpoints):
    """The fault in the reference: its first block's time-mix shift reads the next token. The reference's side is
    named; a correct port agrees everywhere before it."""
    ref = heldout_support.reference_model(checkpoints["rwkv"])
    ref.rwkv.blocks[0].attention.time_shift = nn.ZeroPad2d((0, 0, -1, 1))
    bad = heldout_support.first_mismatch(MODELS, "rwkv", ref)
    assert bad.name == "rwkv.blocks.0.attention.key" and bad.hint.kind == "token_shift", bad
    assert "the reference mixes each token with the next one" in bad.hint.text


def test_a_stream_norm_taken_over_every_stream_in_the_reference_is_named(checkpoints):
    """The fault in the reference: its first hyper-connection norms all streams at once (no group size). The
    reference's side is named."""
    ref = heldout_support.reference_model(checkpoints["qwen4_exp"])
    ref.model.layers[0].attn_hyper_connection.hc_norm.group_size = None
    bad = heldout_support.first_mismatch(MODELS, "qwen4_exp", ref)
    assert bad.name == "model.layers.0.attn_hyper_connection.hc_norm" and bad.hint.kind == "norm_kind", bad
    assert "ours behaves like RMSNorm per stream (3 groups of hidden_size 64), the reference like RMSNorm over" in (
        bad.hint.text
    )
