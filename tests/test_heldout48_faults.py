"""A forty-eighth held-back set: Llama (Llama 3's RoPE scaling, a head_dim the hidden size does not give, tied
embeddings, q/k rows permuted at load for interleaved RoPE), Gemma 2 (attention and final logit soft-caps,
query_pre_attn_scalar, sliding and full layers, four ``1 + w`` norms per layer) and StableLM (a parallel block,
partial rotary, per-head q/k LayerNorms, q/k/v biases) user models by helpers who never read ``parity/``
(``tests/user_models/heldout48/``, 42 bugs, five correct variants per family). The ports keep their weights stacked
per layer and transposed, Gemma's four gains of each layer as ``1 + w`` rows of one ``(layers, 4, hidden)`` table.

Measured first in the thirtieth session (2026-12-07) on the tree that had fitted the forty-seventh set, before any
fit to this one: correct runs 36 of 36, bugs named 37 of 42 (88%), 3 wrong causes: StableLM's q/k norm applied after
RoPE read as partial rotary over the whole head, its q/k norm's unbiased variance as a RoPE attention factor (the
pass-through dims carried the same factor), Gemma 2's soft-cap taken before the scale as a plain attention scale of
0.05. Not named: Gemma 2's norms swapped in a table of ``1 + w`` gains (the table read as no checkpoint tensor), a
fused q/k/v cut per head read before a q/k norm. Each fitted by kind.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout48"))

import heldout48_gemma2
import heldout48_llama
import heldout48_stablelm

MODELS = {"llama": heldout48_llama, "gemma2": heldout48_gemma2, "stablelm": heldout48_stablelm}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "llama": dict(
            head_dim=24, intermediate_size=128, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False,
            mlp_bias=False,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
            },
        ),
        "gemma2": dict(
            head_dim=16, intermediate_size=128, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
            final_logit_softcapping=10.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "stablelm": dict(
            num_key_value_heads=4, intermediate_size=128, qk_layernorm=True, use_parallel_residual=True,
            use_qkv_bias=True, layer_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout48"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("llama", "online_softmax", True),  # attention over key blocks with a running max and sum
    ("gemma2", "", True),  # the four gains of each layer kept as 1 + w rows of one table
    ("stablelm", "fused_out_proj", False),  # the parallel block's two output projections as one matmul
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


def test_gains_kept_as_one_plus_w_in_one_table_are_judged_in_every_layer(checkpoints):
    """Gemma 2's four norms of each layer held as ``1 + w`` rows of one ``(layers, 4, hidden)`` table: each norm
    compared in every layer, not left untapped as a table holding no checkpoint tensor."""
    res = heldout_support.check(MODELS, checkpoints, "gemma2")
    norms = [r for r in res.nodes if r.name.endswith("layernorm") and ".layers." in r.name]
    assert res.passed and len(norms) == 16 and all(r.status == "ok" for r in norms), res.verdict()


ATTN = "model.layers.0.self_attn"
Q = f"{ATTN}.q_rot"
NAMED = [
    ("llama", "llama3_scaling_ignored", False, Q, "rope_scaling", "the unscaled RoPE (theta 500000, no llama3 scaling)"),
    ("llama", "llama3_smooth_inverted", False, Q, "rope_scaling", "its medium band blended the wrong way round"),
    ("llama", "rope_unpermuted_qk", False, Q, "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs with the table's frequencies repeated per pair"),
    ("llama", "gqa_tile_not_interleave", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("llama", "scale_from_hidden_size", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(hidden_size/num_attention_heads=16)), the reference by 0.204124"),
    ("llama", "norm_one_plus_weight", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by 1 + w, the reference by w"),
    ("llama", "gate_up_split_swapped", False, "model.layers.0.mlp.down_proj", "swapped_roles",
     "ours applies the activation (silu) to up_proj's output"),
    ("llama", "embed_scaled_sqrt_hidden", False, "model.layers.0.input_layernorm", "scale",
     "ours' input to it is the reference's times 8 at every position; matches sqrt(hidden_size=64)"),
    ("llama", "causal_diag_masked", False, f"{ATTN}.probs", "causal_mask",
     "ours gives the key at the query's own position no weight"),
    ("llama", "residual_from_normed", False, "model.layers.0.post_attention_layernorm", "residual",
     "the residual taken from another point"),
    ("llama", "attn_out_no_transpose", False, f"{ATTN}.o_proj", "head_layout", "without moving the heads axis"),
    ("llama", "pad_mask_on_queries", True, f"{ATTN}.probs", "padding", "laid along the queries"),
    ("llama", "norm_keys_swapped", False, "model.layers.0.input_layernorm", "swapped_weights",
     "the weights of post_attention_layernorm and input_layernorm loaded into each other's places"),
    ("llama", "hidden_act_ignored", False, "model.layers.0.mlp.down_proj", "activation",
     "act = gelu_new (tanh approximation, op by op), the reference's with silu"),
    ("gemma2", "norm_no_plus_one", False, "model.layers.0.input_layernorm", "norm_weight_offset",
     "ours multiplies by w, the reference by 1 + w"),
    ("gemma2", "embed_scale_tied", False, "logits", "softcap",
     "ours' logits are 10 * tanh(8 x / 10) (x scaled by 8 = the embedding scale before the cap)"),
    ("gemma2", "attn_scale_head_dim", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.25 (= 1/sqrt(head_dim=16)), the reference by 0.176777 (= 1/sqrt(query_pre_attn_scalar=32))"),
    ("gemma2", "scale_after_softcap", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.05 (= 1/attn_logit_softcapping (1/20): the soft-cap's tanh(x / cap) taken on the "
     "unscaled q k^T, the attention scale applied after it)"),
    ("gemma2", "final_softcap_attn_field", False, "logits", "softcap",
     "ours' logits are 20 * tanh(x / 20), the reference's 10 * tanh(x / 10)"),
    ("gemma2", "sliding_window_off_by_one", False, f"{ATTN}.probs", "sliding_window",
     "ours attends with a window of 9, the reference with a window of 8"),
    ("gemma2", "sliding_layer_parity", False, f"{ATTN}.probs", "sliding_window",
     "ours attends as its full_attention layers do: the layer pattern"),
    ("gemma2", "sliding_mask_no_padding", True, f"{ATTN}.probs", "padding",
     "ours gives weight to 100 earlier padding keys the other side masks"),
    ("gemma2", "gelu_exact", False, "model.layers.0.mlp.down_proj", "activation",
     "act = gelu (exact, erf), the reference's with gelu_new (tanh approximation"),
    ("gemma2", "llama_norm_names", False, "model.layers.0.post_attention_layernorm", "swapped_weights",
     "the weights of pre_feedforward_layernorm and post_attention_layernorm loaded into each other's places"),
    ("gemma2", "rope_interleaved", False, Q, "rope_pairing", "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("gemma2", "gqa_tile", False, f"{ATTN}.scores", "head_mapping", "repeat instead of repeat_interleave"),
    ("gemma2", "gate_up_order", False, "model.layers.0.mlp.down_proj", "swapped_roles",
     "ours applies the activation (gelu_new (tanh approximation, op by op)) to up_proj's output"),
    ("gemma2", "rope_freq_exponent", False, Q, "rope_frequencies", "whose exponent's arange lost its step of 2"),
    ("stablelm", "rope_interleaved", False, Q, "rope_pairing", "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("stablelm", "rope_freq_head_dim", False, Q, "rope_frequencies",
     "whose exponents divide by head_dim (16), not by the rotary dims (4)"),
    ("stablelm", "rope_tail_slice", False, Q, "rope_partial",
     "the reference rotates 4 of 16 dims (0, 1, 2, 3) of each head and leaves the rest as they are, ours rotates 4 of "
     "16 dims (12, 13, 14, 15)"),
    ("stablelm", "qk_norm_after_rope", False, Q, "norm_placement",
     "ours' q_rot is the reference's q norm applied after RoPE"),
    ("stablelm", "qk_norm_shared_weight", False, f"{ATTN}.q_layernorm.norms.0", "shape",
     "a per-head module shared across heads"),
    ("stablelm", "qk_norm_unbiased_var", False, Q, "scale",
     "ours / reference = 0.968246 at every position including 0"),
    ("stablelm", "sequential_residual", False, "model.layers.0.mlp.gate_proj", "block_layout",
     "the input of gate_proj of ours is computed from the residual after attention (sequential block), the "
     "reference's from the layer's input (parallel block)"),
    ("stablelm", "residual_after_norm", False, "model.layers.0", "residual", "the residual taken from another point"),
    ("stablelm", "act_gelu", False, "model.layers.0.mlp.down_proj", "activation",
     "act = gelu (exact, erf), the reference's with silu"),
    ("stablelm", "scale_rotary_dim", False, f"{ATTN}.scores", "attention_scale",
     "ours scales q k^T by 0.5 (= 1/sqrt(rotary_dim=4))"),
    ("stablelm", "qkv_split_neox", False, Q, "qkv_layout",
     "q in ours is the projections' output (fused or not) read per head (heads, 3, head_dim): GPT-NeoX / BLOOM, in "
     "the reference stacked [q; k; v]"),
    ("stablelm", "lm_head_tied", False, "logits", "untied_head", "its logits are lm_head's input times model.embed_tokens"),
    ("stablelm", "ln_bias_dropped", False, "model.layers.0.input_layernorm", "bias",
     "ours adds none at model.layers.0.input_layernorm"),
    ("stablelm", "pad_mask_query_axis", True, f"{ATTN}.probs", "padding", "laid along the queries"),
]  # fmt: skip
FAST = {"qk_norm_after_rope", "qk_norm_unbiased_var", "scale_after_softcap", "llama_norm_names", "qkv_split_neox"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


def test_the_unbiased_variance_factor_is_named_where_it_is_in_the_reference(checkpoints):
    """StableLM's q norms in the reference dividing their variance by N - 1 (ours correct): the factor on all of
    q, its pass-through dims too, named as a norm's unbiased variance, not RoPE's cos/sin factor."""
    ref = heldout_support.reference_model(checkpoints["stablelm"])

    def unbiased(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred / (x.var(-1, keepdim=True) + self.eps).sqrt() * self.weight

    for norm in ref.model.layers[0].self_attn.q_layernorm.norms:
        norm.forward = types.MethodType(unbiased, norm)
    bad = heldout_support.first_mismatch(MODELS, "stablelm", ref)
    assert bad.name == Q and bad.hint.kind == "scale", bad
    assert "sqrt((head_dim - 1) / head_dim) = sqrt(15/16) (a norm's variance taken unbiased" in bad.hint.text


def test_a_reference_scaling_its_scores_by_the_soft_caps_inverse_is_named(checkpoints):
    """Gemma 2's reference scaling q k^T by 1 / attn_logit_softcapping (ours correct): the scale read on the
    reference's side with the same source."""
    ref = heldout_support.reference_model(checkpoints["gemma2"])
    ref.model.layers[0].self_attn.scaling = 1 / 20
    bad = heldout_support.first_mismatch(MODELS, "gemma2", ref)
    assert bad.name == f"{ATTN}.scores" and bad.hint.kind == "attention_scale", bad
    assert "the reference by 0.05 (= 1/attn_logit_softcapping (1/20)" in bad.hint.text
