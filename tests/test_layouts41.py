"""Correct ports in unusual layouts, second set (``tests/user_models/layouts41/``): six newer families written by
helpers who never read ``parity/`` (Qwen3.5's and Qwen3-Next's gated delta rule, LFM2's short convolution,
GPT-OSS's sinks and clamped experts, Falcon-H1's muP multipliers and Mamba-2 mixer, MiniMax-M2's biased routing),
in as many realistic layouts as they could find (the delta rule chunked, transposed or fully parallel, FLA's split
convolutions, Megatron's grouped fused q/k/v, OpenAI's reference GPT-OSS, every muP multiplier folded into the
weights, stacked per-layer weights read by one functional forward, a tied head module holding the embedding's
parameter, ...), eight variants per family besides its baseline, each within 1e-4 of Transformers at the logits.

Measured first in the twenty-fifth session (2026-12-06), before any fit to it: 47 of 54 variants passed (94 of 108
runs). The others were false failures of kinds fitted then: an attention sink kept as an extra key column of the
probabilities; a tied head module holding the embedding's parameter; the router and the shared expert's gate fused
into one weight (a one-row linear's weight is a product's row, not a vector); per-layer router biases stacked in a
buffer; a gated norm computed in functions (its gate multiplies after the weight); an expert run on its routed
tokens with no module for its MoE block (rows put on the tokens the reference routes); a head module applying the
multiplier the reference applies after its head (Falcon-H1's ``lm_head_multiplier``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "layouts41"))

import layouts41_falcon_h1
import layouts41_gpt_oss
import layouts41_lfm2
import layouts41_minimax_m2
import layouts41_qwen3_5_text
import layouts41_qwen3_next

MODELS = {
    "qwen3_5_text": layouts41_qwen3_5_text,
    "lfm2": layouts41_lfm2,
    "gpt_oss": layouts41_gpt_oss,
    "qwen3_next": layouts41_qwen3_next,
    "falcon_h1": layouts41_falcon_h1,
    "minimax_m2": layouts41_minimax_m2,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    linear = {
        "qwen3_5_text": dict(
            intermediate_size=96,
            head_dim=32,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        "lfm2": dict(
            intermediate_size=160,
            block_multiple_of=32,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            conv_L_cache=3,
            conv_bias=True,
            full_attn_idxs=[1, 3],
            norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        "gpt_oss": dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=2.0,
            tie_word_embeddings=False,
        ),
    }
    hybrid = {
        "qwen3_next": dict(
            head_dim=16, partial_rotary_factor=0.5, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[2], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
            rms_norm_eps=1e-6,
        ),
        "falcon_h1": dict(
            intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
            mamba_d_conv=4, mamba_chunk_size=8, mamba_conv_bias=True, mamba_proj_bias=True, mamba_rms_norm=True,
            mamba_norm_before_gate=False, time_step_limit=(0.05, 1.5), projectors_bias=True, attention_bias=True,
            mlp_bias=True, embedding_multiplier=1.5, lm_head_multiplier=0.8, mlp_multipliers=[0.9, 1.2],
            key_multiplier=0.7, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
            ssm_multipliers=[1.2, 0.8, 0.9, 1.1, 0.7], ssm_in_multiplier=1.3, ssm_out_multiplier=0.6,
            rms_norm_eps=1e-5,
        ),
        "minimax_m2": dict(
            head_dim=16, rotary_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            rms_norm_eps=1e-6,
        ),
    }  # fmt: skip
    root = tmp_path_factory.mktemp("layouts41")
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
    ("gpt_oss", "oss_bool_mask_fullsoftmax_router", False),
    ("lfm2", "lfm2_recurrent_conv", False),
    ("qwen3_next", "q3n_gather_router_fused_shared", False),
    ("minimax_m2", "mm_functional_dict", True),
    ("falcon_h1", "fh1_functional_stacked", False),
]

#: known false failures, strict xfails (none now: MiniMax-M2's functional dict, unpadded, failed for part of the
#: twenty-seventh session: an expert's routed rows were compared as a part of its features)
KNOWN_FALSE: frozenset[str] = frozenset()


@pytest.mark.parametrize(("model", "bug", "padded"), FAST, indirect=["bug"], ids=str)
def test_a_correct_port_in_an_unusual_layout_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "bug", "padded"), heldout_support.clean_cases(MODELS, FAST, KNOWN_FALSE), indirect=["bug"]
)
def test_every_layout_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)
