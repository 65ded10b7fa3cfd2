"""A ninth held-back set: GPT-Neo, BLOOM and OLMoE user models by a helper who never read ``parity/``.

``tests/user_models/heldout9/``: a GPT-Neo (learned positions, global and local attention layers with a
window of 8, no score scaling) whose weights are kept input-major in flat per-layer dicts and whose
attention is functions; a BLOOM (ALiBi, an embedding LayerNorm, the fused per-head ``query_key_value``
cut at load into q/k/v views, biases added outside the products) and an OLMoE (8 experts, top-2, QK
norms over the whole projection, the experts stacked input-major in 3-D parameters of a
``ParameterDict`` and looped over in functions). 44 bugs of kinds none of the eight sets before held.

Its first measure (2026-12-02, sixth session, with the eighth set's remaining kinds fixed and nothing
fitted to this set): 3 of 12 correct variants passed (every OLMoE run refused: square experts kept
``(experts, in, out)`` were no layout parity knew; BLOOM's q/k/v cut per head out of the fused weight
and stored transposed held "no checkpoint tensor", and the reference's ALiBi scores, one ``baddbmm``,
were never read; GPT-Neo's per-head output projection, ``einsum("bnsh,nhd->bnsd")`` then a sum over the
heads, was recorded before the sum); hints: 12 of 44 named the cause, 1 the component, 13 a wrong cause
(11 of them BLOOM's "query_key_value skipped"), 3 none, 15 refused. The fixes by kind are asserted
below, each with the model that first showed it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import parity
from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout9"))

import heldout9_bloom
import heldout9_gptneo
import heldout9_olmoe

MODELS = {"gptneo": heldout9_gptneo, "bloom": heldout9_bloom, "olmoe": heldout9_olmoe}


@torch.no_grad()
def randomise(model, seed: int) -> None:
    """The helper's weights: embeddings 0.2 N(0, 1) with a per-row scale exp(0.5 N(0, 1)), biases ~0.1,
    norm weights around 1, matrices (and stacked experts) of unit gain over their last axis."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() == 2 and ("embed" in name or name.endswith(("wte.weight", "wpe.weight"))):
            p.copy_(0.2 * torch.randn(p.shape, generator=g) * torch.exp(0.5 * torch.randn(p.shape[0], 1, generator=g)))
        elif p.dim() == 1 and name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    specs = {
        "gptneo": (
            T.GPTNeoForCausalLM,
            T.GPTNeoConfig(
                vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                window_size=8, intermediate_size=128, max_position_embeddings=64, activation_function="gelu_new",
                layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True,
            ),
        ),
        "bloom": (
            T.BloomForCausalLM,
            T.BloomConfig(
                vocab_size=256, hidden_size=64, n_layer=2, n_head=4, layer_norm_epsilon=1e-5, pretraining_tp=2,
                slow_but_exact=False, apply_residual_connection_post_layernorm=False, bos_token_id=0,
                eos_token_id=0, pad_token_id=3, tie_word_embeddings=True,
            ),
        ),
        "olmoe": (
            T.OlmoeForCausalLM,
            T.OlmoeConfig(
                vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rms_norm_eps=1e-5, pad_token_id=1, bos_token_id=None, eos_token_id=0, tie_word_embeddings=False,
            ),
        ),
    }  # fmt: skip
    root, out = tmp_path_factory.mktemp("heldout9"), {}
    for i, (name, (cls, config)) in enumerate(specs.items()):
        torch.manual_seed(1000 + i)
        model = cls(config).eval()
        randomise(model, 1234 + i)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


bug = heldout_support.bug_fixture(MODELS)


def check(model: str, checkpoints, padded: bool = False, mode: str = "chained"):
    return heldout_support.check(MODELS, checkpoints, model, padded, mode)


def _passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


CLEAN = [("gptneo", "head_einsum", False), ("bloom", "", False), ("olmoe", "sdpa", True)]
CLEAN_SLOW = [
    (m, b, p)
    for m, variants in {
        "gptneo": ("", "sdpa", "fused_qkv", "head_einsum"),
        "bloom": ("", "sdpa", "fused_runtime_split", "relative_alibi"),
        "olmoe": ("", "sdpa", "dense_experts", "complex_rope"),
    }.items()
    for b in variants
    for p in (False, True)
    if (m, b, p) not in CLEAN
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """GPT-Neo's output projection per head (an einsum keeping the head axis, then summed: the sum is the
    node), BLOOM's q/k/v cut per head out of the fused weight and stored input-major beside the fused copy
    (its biases views of one tensor), with ALiBi read out of the reference's ``baddbmm``; OLMoE's square
    experts stacked input-major in a ``ParameterDict``, its router logits flattened to (tokens, experts)
    under padding: each passes."""
    _passes(model, bug, padded, checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"], ids=str)
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    _passes(model, bug, padded, checkpoints)


NAMED = [
    ("gptneo", "local_global_order", False, "transformer.h.0.attn.attention.probs", "sliding_window",
     "ours attends with a window of 8"),
    ("gptneo", "local_blocked", False, "transformer.h.1.attn.attention.probs", "sliding_window",
     "block-local attention"),
    ("gptneo", "window_hardcoded_256", False, "transformer.h.1.attn.attention.probs", "sliding_window",
     "the reference with a window of 8"),
    ("gptneo", "scaled_scores", False, "transformer.h.0.attn.attention.scores", "attention_scale",
     "ours / reference = 0.25"),
    ("gptneo", "scores_half", False, "transformer.h.0.attn.attention.q_rot", "precision", "float16"),
    ("gptneo", "mask_fill_zero", False, "transformer.h.0.attn.attention.probs", "causal_mask", "finite fill value 0"),
    ("gptneo", "softmax_dim_queries", False, "transformer.h.0.attn.attention.probs", "softmax_axis", "over the queries"),
    ("gptneo", "split_heads_dim_order", False, "transformer.h.0.attn.attention.q_rot", "qkv_layout",
     "(head_dim, heads), the heads the fast axis"),
    ("gptneo", "out_bias_per_head", False, "transformer.h.0.attn.attention.out_proj", "bias", "once per head"),
    ("gptneo", "positions_ignore_given", True, "transformer.wpe", "position_offset", "position_ids ignored"),
    ("gptneo", "tied_head_rescale", False, "logits", "scale", "sqrt(hidden_size=64)"),
    ("bloom", "alibi_sign", False, "transformer.h.0.self_attention.probs", "alibi", "the sign flipped"),
    ("bloom", "alibi_slopes_reversed", False, "transformer.h.0.self_attention.probs", "alibi",
     "reversed over the heads"),
    ("bloom", "alibi_slopes_from_zero", False, "transformer.h.0.self_attention.probs", "alibi", "counted from 0"),
    ("bloom", "alibi_scaled", False, "transformer.h.0.self_attention.probs", "alibi", "standard slopes times 0.25"),
    ("bloom", "alibi_on_query_axis", False, "transformer.h.0.self_attention.probs", "alibi", "ours with no ALiBi"),
    ("bloom", "alibi_first_row_mask", True, "transformer.h.0.self_attention.probs", "alibi",
     "key positions of batch row 0"),
    ("bloom", "alibi_batch_interleave", True, "transformer.h.0.self_attention.probs", "alibi",
     "other slopes per batch row"),
    ("bloom", "qkv_split_flat", False, "transformer.h.0.self_attention.q_rot", "qkv_layout",
     "read stacked [q; k; v], in the reference per head (heads, 3, head_dim)"),
    ("bloom", "word_emb_ln_skipped", False, "transformer.h.0.input_layernorm", "missing",
     "transformer.word_embeddings_layernorm skipped in ours"),
    ("bloom", "residual_post_ln", False, "transformer.h.0.post_attention_layernorm", "residual",
     "to the reference's transformer.h.0.input_layernorm instead of the stream"),
    ("bloom", "bias_gelu_order", False, "transformer.h.0.mlp.dense_4h_to_h", "activation",
     "the bias added after the activation"),
    ("bloom", "rowparallel_bias_per_shard", False, "transformer.h.0.self_attention.dense", "bias", "bias twice"),
    ("bloom", "probs_bf16", False, "transformer.h.0.self_attention.probs", "precision", "bfloat16"),
    ("bloom", "ln_swap_loader", False, "transformer.h.0.input_layernorm", "swapped_weights",
     "loaded into each other's places"),
    ("olmoe", "qk_norm_per_head", False, "model.layers.0.self_attn.q_norm", "norm_kind", "one RMS per head"),
    ("olmoe", "qk_norm_after_rope", False, "model.layers.0.self_attn.q_norm", "norm_placement", "after RoPE"),
    ("olmoe", "rope_partial", False, "model.layers.0.self_attn.q_rot", "rope_partial", "ours rotates 4 of 16 dims"),
    ("olmoe", "rope_dim_hidden", False, "model.layers.0.self_attn.q_rot", "rope_frequencies",
     "theta^(-2i / 64) (hidden_size)"),
    ("olmoe", "rope_positions_row0", True, "model.layers.0.self_attn.q_rot", "position_offset",
     "at the positions of row(s) 0"),
    ("olmoe", "pad_mask_after_softmax", True, "model.layers.0.self_attn.probs", "padding", "after the softmax"),
    ("olmoe", "router_on_residual", False, "model.layers.0.mlp.gate", "projection_input",
     "post_attention_layernorm@input"),
    ("olmoe", "router_sigmoid", False, "model.layers.1.input_layernorm", "routing_weights",
     "weighted by a sigmoid of the router's logits (not a softmax) in ours"),
    ("olmoe", "norm_topk_prob_applied", False, "model.layers.1.input_layernorm", "routing_weights",
     "renormalised over the chosen (a softmax over the chosen k alone) in ours"),
    ("olmoe", "routing_weights_bf16", False, "model.layers.1.input_layernorm", "routing_weights",
     "rounded through bfloat16 in ours"),
    ("olmoe", "route_weight_on_input", False, "model.layers.1.input_layernorm", "routing_weights",
     "their input times the routing weight (x * w), not weighted after in ours"),
    ("olmoe", "experts_reshape_not_transpose", False, "model.layers.1.input_layernorm", "transposed_weight",
     "each down_proj transposed"),
    # named in the seventh session: the q bias a view of the flat qkv bias ours aligned to nothing (its add
    # is recorded with the product now), the mask laid along the queries told from one not applied
    ("bloom", "qkv_bias_split_flat", False, "transformer.h.0.self_attention.query_key_value[rows 0, 1, 2, 3, ...]",
     "bias", "ours adds elements [0:64] of transformer.h.0.self_attention.query_key_value's bias"),
    ("gptneo", "pad_mask_query_axis", True, "transformer.h.0.attn.attention.probs", "padding",
     "laid along the queries instead of the keys"),
]  # fmt: skip
FAST = {
    "local_blocked", "split_heads_dim_order", "out_bias_per_head", "alibi_sign", "qkv_split_flat", "bias_gelu_order",
    "router_sigmoid",
}  # fmt: skip


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


REFUSED = [
    ("gptneo", "ln2_loaded_from_ln1", "transformer.h.0.ln_2.bias"),
    ("gptneo", "ln_f_not_loaded", "transformer.ln_f.bias"),
    ("olmoe", "gate_up_interleaved", "read as interleaved pairs where the checkpoint stacks its two halves"),
    ("olmoe", "experts_shared_across_layers", "model.layers.1.mlp.experts.down_proj"),
    ("olmoe", "final_norm_suffix_match", "model.norm.weight"),
]


@pytest.mark.parametrize(
    ("model", "bug", "says"),
    [pytest.param(*case, marks=[] if case[1] == "gate_up_interleaved" else [pytest.mark.slow]) for case in REFUSED],
    indirect=["bug"],
    ids=str,
)
def test_a_loader_mistake_is_refused_naming_what_was_not_loaded(model, bug, says, checkpoints):
    """A loader that leaves a reference tensor out (a copy-paste reads ln_1 twice, a prefix misses ln_f,
    one layer's experts reused for the next, a suffix match takes the wrong norm) or reads a fused tensor
    as interleaved pairs: the check refuses in one line that names the tensor (and, for the interleaved
    read, how ours holds it)."""
    with pytest.raises(parity.ParityError) as refused:
        check(model, checkpoints)
    assert says in str(refused.value), refused.value
