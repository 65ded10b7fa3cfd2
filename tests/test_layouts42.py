"""Correct ports in unusual layouts, third set (``tests/user_models/layouts42/``): six newer families written by
helpers who never read ``parity/`` (Apertus 1.5's xIELU and llama3 RoPE, DeepSeek-V2's MLA and group-limited routing,
Ministral 3's YaRN with Llama 4's query scaling, Inkling-2's looped layers with attention residuals, Qwen3.5-MoE's
gated delta rule and experts, Gemma 4's unified text model with K = V layers and shared KV), in as many realistic
layouts as they could find (Megatron's grouped q/k/v, absorbed MLA, sorted expert dispatch, shared experts fused as
always-on experts, the recurrent-depth loop unrolled with shared weights, conv taps kept in lag order, an attention
sink as an extra zero key, the embedding scale folded into a tied table, every norm folded into its projections,
...), eight variants per family besides its baseline, each within 1e-4 of Transformers at the logits.

Measured first in the twenty-sixth session (2026-12-06), before any fit to it: 77 of 108 runs passed (linear 44 of
54, hybrid 33 of 54). The others were false failures of kinds fitted then: an MLA query read in ours' functions whose
shape matched the probabilities' (head dim 24 = 24 tokens) taken for q_rot while o_proj agreed (internals read
inside a module of ours are now judged as those read in functions are); the later passes of a looped block judged
within the first pass's rounding (each call now has the reference's own rounding at that call); conv taps held
reversed (lag order); a derived-at-load probe that gave up past 64 unused keys (now bounded by time); keys of a
GQA attention compared after their expansion, and with an attention sink kept as an extra all-zero key; a tied
head reading an embedding table scaled at load (the fold handed on to the head's input).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "layouts42"))

import layouts42_apertus1p5_text
import layouts42_deepseek_v2
import layouts42_gemma4_unified_text
import layouts42_inkling2_loop_text
import layouts42_ministral3
import layouts42_qwen3_5_moe_text

MODELS = {
    "apertus1p5_text": layouts42_apertus1p5_text,
    "deepseek_v2": layouts42_deepseek_v2,
    "ministral3": layouts42_ministral3,
    "inkling2_loop_text": layouts42_inkling2_loop_text,
    "qwen3_5_moe_text": layouts42_qwen3_5_moe_text,
    "gemma4_unified_text": layouts42_gemma4_unified_text,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    linear = {
        "apertus1p5_text": dict(
            intermediate_size=128,
            attention_bias=True,
            output_vocab_size=200,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
        ),
        "deepseek_v2": dict(
            num_key_value_heads=4,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            attention_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
        ),
        "ministral3": dict(
            head_dim=32,
            intermediate_size=128,
            sliding_window=16,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 8,
                "max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        ),
    }
    hybrid = {
        "inkling2_loop_text": dict(
            unpadded_vocab_size=250, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=1,
            swa_head_dim=8, sliding_window_size=8, d_rel=4, rel_extent=12, log_scaling_n_floor=4,
            log_scaling_alpha=0.5, num_hidden_layers=8, layer_types=["hybrid_sliding", "hybrid"] * 4,
            conv_kernel_size=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, route_scale=2.5,
            qk_l2_clip_threshold=1.5, rel_l2_clip_threshold=0.6, n_layers_per_attn_res_block=2,
            mlp_gate_softcap=1.5, mlp_up_softcap=2.0, final_logit_softcapping=4.0, loop_layer_index_start=2,
            loop_layer_index_end=6, loop_num_passes=3, loop_gate_rank=8,
        ),
        "qwen3_5_moe_text": dict(
            head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
            num_experts_per_tok=2,
        ),
        "gemma4_unified_text": dict(
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            intermediate_size=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=10.0,
        ),
    }  # fmt: skip
    root = tmp_path_factory.mktemp("layouts42")
    out = {}
    for group in (linear, hybrid):  # each group seeded together, as its helper verified it
        specs = {name: AutoConfig.for_model(name, **{**heldout_support.COMMON, **kw}) for name, kw in group.items()}
        out.update(
            heldout_support.save_checkpoints(root, specs, heldout_support.randomise_with_expert_bias, 1000, 1234)
        )
    return out


bug = heldout_support.bug_fixture(MODELS)

#: one variant per kind fitted, in the default run (the rest are slow)
FAST = [
    ("deepseek_v2", "", False),  # an MLA query of the probabilities' shape read in ours' functions
    ("inkling2_loop_text", "", False),  # a loop's later passes judged within their own rounding
    ("inkling2_loop_text", "ink_sdpa_sink_column", False),  # a sink kept as an extra zero key, GQA expanded
    ("gemma4_unified_text", "gemma_scaled_table_tied_head", False),  # a tied head reading a scaled table
]

#: known false failures, strict xfails: none (sliding and full layers' weights stacked per layer type, read by one
#: functional forward, was one until the twenty-ninth session: its misread internals are arbitrated by the logits)
KNOWN_FALSE: frozenset[tuple[str, str]] = frozenset()


@pytest.mark.parametrize(("model", "bug", "padded"), FAST, indirect=["bug"], ids=str)
def test_a_correct_port_in_an_unusual_layout_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "bug", "padded"), heldout_support.clean_cases(MODELS, FAST, KNOWN_FALSE), indirect=["bug"]
)
def test_every_layout_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)
