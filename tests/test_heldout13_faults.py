"""A thirteenth held-back set: EXAONE 4, DiffLlama and JetMoE user models by a helper who never read ``parity/``.

``tests/user_models/heldout13/``: an EXAONE 4 (QK norms, sliding and global layers with RoPE on the
sliding ones only, llama3-scaled RoPE, norms after the sub-layers), a DiffLlama (differential attention:
two softmax maps over halves of the values, ``o1 - lambda o2`` per head pair with lambda re-parameterised
from four vectors and ``lambda_init`` per layer, an RMS norm without a weight, ``1 - lambda_init``) and a
JetMoE (a mixture of attention heads whose q and o projections are experts a router picks, and a MoE MLP),
each written as functions over its own parameters. 36 bugs of kinds none of the twelve sets before held.

Its first measure (2026-12-03, eighth session, with the twelfth set's fixes and nothing fitted to this
set): 25 of 34 correct runs passed (q/k norm weights permuted with their rows refused; a norm's output
packed without padding, heads first; DiffLlama's lambda folded into a constant refused; JetMoE's stacked
experts compared in the reference's dispatch order); 9 of 36 hints named the cause, 2 a wrong one, about
20 none (DiffLlama's combination between the context and o_proj, JetMoE's attention experts). The fixes by
kind are asserted below; what stays open is said where it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout13"))

import heldout13_diffllama
import heldout13_exaone4
import heldout13_jetmoe

MODELS = {"exaone4": heldout13_exaone4, "diffllama": heldout13_diffllama, "jetmoe": heldout13_jetmoe}


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helper's weights: norm weights around 1, DiffLlama's lambda vectors of half scale, biases ~0.3,
    token embeddings with a per-row scale, matrices of unit gain."""
    for name, p in model.named_parameters():
        parts = name.lower().split(".")
        if parts[-1] == "weight" and "norm" in parts[-2]:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
        elif "lambda_" in parts[-1]:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 + torch.rand(p.shape[0], 1, generator=gen)))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    specs = {
        "exaone4": T.Exaone4Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512, sliding_window=6,
            sliding_window_pattern=3,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "diffllama": T.DiffLlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128, lambda_std_dev=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "jetmoe": T.JetMoeConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    }  # fmt: skip
    return heldout_support.save_checkpoints(tmp_path_factory.mktemp("heldout13"), specs, randomise, 3000, 5321)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("exaone4", "rope_interleaved_permuted", False),
    ("jetmoe", "dense_gather", False),
    ("diffllama", "lambda_folded", False),
]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN)


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """EXAONE 4's q/k rows and their per-head norm weights permuted at load (rotate-every-two RoPE); JetMoE's
    attention experts computed densely (its stacked experts' module output, in the reference's dispatch
    order, is not compared; the block's output is); DiffLlama's lambda folded at load into one Python number
    per layer (exp(q1 . k1) - exp(q2 . k2) + lambda_init): no parameter holds the four lambda vectors, each
    changes the logits when perturbed (parity.user.derived)."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    """And the rest: a norm's output packed without padding, heads first (varlen); SDPA; V doubled; the
    sub-layer norm in functions; grouped GQA; JetMoE's expert loop."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


NAMED = [
    ("exaone4", "ex_spurious_qk_permute_at_load", False, "model.layers.0.self_attn.q_norm", "weight_permutation",
     "likely a permutation of weight rows before q_norm"),
    ("exaone4", "ex_varlen_pack_without_doc_mask", True, "model.layers.0.self_attn.probs", "padding",
     "likely rows attending across the batch in ours"),
    ("exaone4", "ex_rope_on_global_layers", False, "model.layers.2.self_attn.q_rot", "rope_unexpected",
     "this full_attention layer is NoPE, ours rotates it"),
    ("exaone4", "ex_layer_pattern_zero_based", False, "model.layers.0.self_attn.q_rot", "rope_missing",
     "this sliding_attention layer rotates in the reference while its full_attention layers do not"),
    ("exaone4", "ex_window_on_global_layers", False, "model.layers.2.self_attn.probs", "sliding_window",
     "ours attends with a window of 6, the reference with full causal attention"),
    ("exaone4", "ex_qk_norm_after_rope", False, "model.layers.0.self_attn.q_norm", "norm_placement",
     "ours' q_norm reads its input after RoPE"),
    ("exaone4", "ex_qk_norm_over_flat_heads", False, "model.layers.0.self_attn.q_rot", "norm_kind",
     "the q_norm's statistic over every head's features together in ours"),
    ("exaone4", "ex_llama3_rope_scaling_ignored", False, "model.layers.0.self_attn.q_rot", "rope_scaling",
     "no llama3 scaling"),
    ("exaone4", "ex_llama3_low_high_factor_swapped", False, "model.layers.0.self_attn.q_rot", "rope_scaling",
     "llama3 scaling with low_freq_factor and high_freq_factor exchanged"),  # a generic band before set 25
    ("exaone4", "ex_post_attn_norm_before_o_proj", False, "model.layers.0.self_attn.o_proj", "norm_placement",
     "ours applies model.layers.0.post_attention_layernorm here, where the reference runs it elsewhere"),
    ("exaone4", "ex_qk_norm_scale_dropped", False, "model.layers.0.self_attn.scores", "attention_scale",
     "ours scales q k^T by 1 (= 1 (no scale))"),
    ("diffllama", "dl_lambda_init_layer_from_one", False, "model.layers.0.self_attn.o_proj", "differential_attention",
     "ours takes lambda_init of layer index + 1"),
    ("diffllama", "dl_lambda_init_constant", False, "model.layers.0.self_attn.o_proj", "differential_attention",
     "ours takes lambda_init as a constant 0.8"),
    ("diffllama", "dl_output_scale_missing", False, "model.layers.0.self_attn.o_proj", "scale",
     "times 1.25 at every position"),
    ("diffllama", "dl_lambda_init_not_added", False, "model.layers.0.self_attn.o_proj", "differential_attention",
     "ours leaves lambda_init (0.2) out of lambda"),
    ("diffllama", "dl_subln_over_head_dim", False, "model.layers.0.self_attn.o_proj", "differential_attention",
     "the norm taken over each head_dim (16) alone"),
    ("diffllama", "dl_pairs_adjacent_heads", False, "model.layers.0.self_attn.o_proj", "differential_attention",
     "heads paired as neighbours (2i, 2i + 1)"),
    ("diffllama", "dl_scale_from_value_width", False, "model.layers.0.self_attn.scores", "attention_scale",
     "ours scales q k^T by 0.176777"),
    # JetMoE's MoE computed in functions nothing taps: the one change to Transformers' code that agrees with ours
    ("jetmoe", "jm_moe_gate_sigmoid", False, "model.layers.1.input_layernorm", "one_change",
     "likely sigmoid in place of softmax at modeling_jetmoe.py:185"),
]  # fmt: skip
#: located, the hint naming the component only (what it says is true; the cause is not named): lambda of
#: another value without its reading, the combination between context and o_proj, JetMoE's attention experts
#: computed in functions nothing aligns (their stacked weights' outputs are in the reference's dispatch order)
COMPONENT = [
    ("exaone4", "ex_window_keeps_first_token", False, "model.layers.0.self_attn.probs", "sliding_window",
     "the sliding window size or mask"),
    ("diffllama", "dl_lambda_sum_of_exp", False, "model.layers.0.self_attn.o_proj", "differential_attention",
     "ours' lambda is 0.30003 where the reference's is -1.5099"),
    ("diffllama", "dl_lambda_params_sorted_zip", False, "model.layers.0.self_attn.o_proj", "differential_attention",
     "ours' lambda is 0.71328 where the reference's is -1.5099"),
    ("diffllama", "dl_merge_restores_head_order", False, "model.layers.0.self_attn.o_proj", "context_to_output",
     "the context agrees, the projection's input does not"),
    ("diffllama", "dl_diff_on_scores", False, "model.layers.0.self_attn.o_proj", "attention_internals",
     "the difference is inside that attention"),
    ("diffllama", "dl_second_map_no_padding", True, "model.layers.0.self_attn.o_proj", "one_change",
     "the mask's padding left out (the causal part alone: padding keys read) at modeling_diffllama.py"),
    ("jetmoe", "jm_moa_gate_on_query", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_moa_reduce_gates_missing", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_moa_map_scatter_by_token", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_moa_reduce_without_sorted_gather", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_expert_weight_reshape_not_transpose", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_batch_index_div_num_experts", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_rope_on_sorted_rows", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_moa_in_out_linear_swapped", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_gates_not_sorted", False, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
    ("jetmoe", "jm_slots_folded_into_batch", True, "model.layers.0.post_attention_layernorm", "untapped_block",
     "likely inside model.layers.0.self_attention.experts"),
]  # fmt: skip
FAST = {"ex_qk_norm_over_flat_heads", "dl_lambda_init_not_added", "dl_subln_over_head_dim", "jm_gates_not_sorted"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(COMPONENT, FAST), indirect=["bug"])
def test_a_bug_is_located_with_a_hint_naming_its_component(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)
