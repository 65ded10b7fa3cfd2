"""A fifty-third held-back set: RoFormer as a causal LM (BERT's split attention computed inline, no attention
interface: rotary sinusoids applied to q, k and v by a static method, an embedding projection), A.X-K1 (MLA with a
query LoRA rank, YaRN with mscale, interleaved rotary rows, a group-limited sigmoid router with a shared expert and a
norm on the block's output) and XLM-RoBERTa-XL as a causal LM (pre-norm blocks, positions from padding_idx + 1 with
pad_token_id 1) user models by helpers who never read ``parity/`` (``tests/user_models/heldout53/``, 42 bugs, five
correct variants per family).

Measured first in the thirty-second session (2026-12-07) on d8a07c6 (set 52 fitted, nothing of this set): correct
runs 36 of 36, bugs named 28 of 42 (67%), no wrong cause. RoFormer's attention bugs went unnamed (9: its internals
are no nodes, and the search for one change looked in the output projection's own module only). Fitted, by kind:

- the one-change search around an output projection whose attention is a sibling module (``stages._attention_around``:
  BERT's, RoFormer's ``attention.self`` beside ``attention.output``); a softmax scale taken from the model's width
  (``hidden_size``, ``n_embd``...) as well as a ``*dim*`` field; heads split strided on q, k and v and merged back
  alike, their views up to a function's length apart, tried as one change (a run's key holds its words);
- a skip connection reading another point of the stream (the layer's input where the attention block's output was
  meant, a norm's output where its input was: one term for a sum), either side; the residual added before a norm
  after the block (A.X-K1's ``post_mlp_layernorm`` moved past the add), either side, read before the MoE block is
  blamed;
- a lookup table never read beside others that agree (a token-type row skipped before the first layer's norm);
- a MoE block whose output a norm reads with a shared expert added: the shared expert's agreeing output taken off,
  the group-limited router's forms judged on the whole (groups scored by their best expert, the correction bias
  kept in the weights, the scaling factor cancelled by the renormalisation).

After: correct runs 36 of 36, bugs named 39 of 42 (93%), no wrong cause. RoFormer's rotary pairs read half-split and
its positions counted from 1 (its rotation is a static method of its own signature, its sinusoid table no node of
ours) named in the thirty-third session (41 of 42): its inline attention recomputed with its own table's RoPE, then
with the other pairing or shifted positions (``attention_refit.inline_attention``). Left, asserted at its node only
(``LOCATED``): A.X-K1's ``kv_a_proj_with_mqa`` output split ``[k_rope | latent]`` where ours also holds the rotary
rows reordered (no contiguous cut of the reference's output).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout53"))

import heldout53_axk1
import heldout53_roformer
import heldout53_xlm_roberta_xl

MODELS = {"roformer": heldout53_roformer, "axk1": heldout53_axk1, "xlm-roberta-xl": heldout53_xlm_roberta_xl}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    configs = {
        "roformer": dict(
            num_key_value_heads=None, embedding_size=32, is_decoder=True, intermediate_size=128, type_vocab_size=1,
            hidden_act="gelu", layer_norm_eps=1e-12, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            rotary_value=True, tie_word_embeddings=True,
        ),
        "axk1": dict(
            num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0},
            tie_word_embeddings=False,
        ),
        "xlm-roberta-xl": dict(
            num_key_value_heads=None, is_decoder=True, intermediate_size=128, max_position_embeddings=300,
            type_vocab_size=1, hidden_act="gelu", layer_norm_eps=1e-5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            tie_word_embeddings=True,
        ),
    }  # fmt: skip
    return heldout_support.save_each_alone(tmp_path_factory.mktemp("heldout53"), configs)


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("roformer", "complex_rope", False),  # rotary as a complex product, its attention inline in the reference
    ("axk1", "mla_absorbed", True),  # MLA absorbed, a shared expert and a norm on the block's output
    ("xlm-roberta-xl", "", True),  # positions from padding_idx + 1 = 2 in a padded batch
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), heldout_support.clean_cases(MODELS, CLEAN), indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


ROFORMER = "roformer.encoder.layer.0"
XLM = "roberta.encoder.layer.0"
AXK1 = "model.layers.0.self_attn"
MOE = "model.layers.1.mlp"
NAMED = [
    ("roformer", "rope_value_skipped", False, f"{ROFORMER}.attention.output.dense", "one_change",
     "rotary_value = False"),
    ("roformer", "rope_sin_cos_swapped", False, f"{ROFORMER}.attention.output.dense", "one_change",
     "parts 0 and 1 of this chunk (of 2) swapped"),
    ("roformer", "attn_scale_hidden", False, f"{ROFORMER}.attention.output.dense", "attention_scale",
     "ours scales q k^T by 0.125 (= 1/sqrt(hidden_size=64)), the reference by 0.25 (= 1/sqrt(head_dim=16))"),
    ("roformer", "ln_unbiased_var", False, "roformer.embeddings.LayerNorm", "norm_kind",
     "ours normalises by the unbiased variance"),
    ("roformer", "ffn_residual_block_input", False, f"{ROFORMER}.output.LayerNorm", "residual",
     f"roformer.embeddings_project in ours where the reference adds {ROFORMER}.attention.output.LayerNorm"),
    ("roformer", "pre_norm", False, f"{ROFORMER}.attention.self.query", "norm_placement", "post-norm"),
    ("roformer", "token_type_dropped", False, "roformer.embeddings.LayerNorm", "missing",
     "roformer.embeddings.token_type_embeddings skipped in ours"),
    ("roformer", "head_ln_before_act", False, "cls.predictions.transform.LayerNorm", "norm_placement",
     "ours normalises dense's output before the gelu activation"),
    ("roformer", "lm_bias_dropped", False, "cls.predictions.decoder", "bias", "ours adds none at cls.predictions.decoder"),
    ("roformer", "bidirectional", False, f"{ROFORMER}.attention.output.dense", "one_change",
     "`attention_scores = attention_scores + attention_mask`"),
    ("roformer", "pad_mask_query_axis", True, f"{ROFORMER}.attention.output.dense", "one_change",
     "the mask's padding left out"),
    ("roformer", "heads_transposed", False, f"{ROFORMER}.attention.output.dense", "one_change",
     "the last axis split with the heads strided"),
    ("xlm-roberta-xl", "pos_offset_zero", False, "roberta.embeddings.position_embeddings", "position_offset",
     "positions off by -2 in ours"),
    ("xlm-roberta-xl", "ignore_position_ids", True, "roberta.embeddings.position_embeddings", "position_offset",
     "positions not derived from the attention mask in ours"),
    ("xlm-roberta-xl", "no_type_embedding", False, f"{XLM}.attention.self_attn_layer_norm", "missing",
     "roberta.embeddings.token_type_embeddings skipped in ours"),
    ("xlm-roberta-xl", "final_ln_at_embeddings", False, f"{XLM}.attention.self_attn_layer_norm", "norm_placement",
     "equals the reference's input after a LayerNorm"),
    ("xlm-roberta-xl", "attn_scale_hidden", False, f"{XLM}.attention.output.dense", "attention_scale",
     "the reference's attention with its scores times 0.5"),
    ("xlm-roberta-xl", "head_split_transposed", False, f"{XLM}.attention.output.dense", "one_change",
     "the last axis split with the heads strided"),
    ("xlm-roberta-xl", "qkv_fuse_order", False, f"{XLM}.attention.output.dense", "one_change",
     "attention.self.key.weight and roberta.encoder.layer.0.attention.self.value.weight swapped"),
    ("xlm-roberta-xl", "causal_peek_next", False, f"{XLM}.attention.output.dense", "causal_mask",
     "the causal mask one key wider"),
    ("xlm-roberta-xl", "no_pad_mask", True, f"{XLM}.attention.output.dense", "padding",
     "the padding keys left unmasked"),
    ("xlm-roberta-xl", "softmax_bf16", False, f"{XLM}.attention.output.dense", "precision", "bfloat16"),
    ("xlm-roberta-xl", "ffn_residual_normed", False, "roberta.encoder.layer.1.attention.self_attn_layer_norm",
     "residual", f"{XLM}.LayerNorm in ours where the reference adds"),
    ("xlm-roberta-xl", "ln_unbiased_var", False, f"{XLM}.attention.self_attn_layer_norm", "norm_kind",
     "ours normalises by the unbiased variance"),
    ("xlm-roberta-xl", "head_ln_before_gelu", False, "lm_head.layer_norm", "norm_placement",
     "ours normalises dense's output before the gelu activation"),
    ("xlm-roberta-xl", "no_head_bias", False, "lm_head.decoder", "bias", "ours adds none at lm_head.decoder"),
    ("axk1", "rope_not_deinterleaved", False, f"{AXK1}.q_rot", "rope_pairing", "ours rotates half-split"),
    ("axk1", "mscale_once", False, f"{AXK1}.scores", "attention_scale", "the YaRN softmax mscale once"),
    ("axk1", "yarn_no_truncate", False, f"{AXK1}.q_rot", "rope_band", "its correction range's bounds left unrounded"),
    ("axk1", "rope_dim_qk_head_dim", False, f"{AXK1}.q_rot", "rope_frequencies", "position 0 agrees"),
    ("axk1", "kv_b_split_layout", False, f"{AXK1}.k_rot", "qkv_layout", "kv_b_proj's output cut as whole blocks"),
    ("axk1", "post_mlp_norm_after_residual", False, f"{MOE}.post_mlp_layernorm", "norm_placement",
     "the residual added before post_mlp_layernorm in ours"),
    ("axk1", "router_weights_with_bias", False, f"{MOE}.post_mlp_layernorm", "routing_weights",
     "the correction bias kept in the weights"),
    ("axk1", "group_score_max", False, f"{MOE}.post_mlp_layernorm", "routing_weights",
     "each group scored by its best expert (max)"),
    ("axk1", "scaling_before_norm", False, f"{MOE}.post_mlp_layernorm", "routing_weights",
     "routed_scaling_factor not applied"),
    ("axk1", "softmax_router", False, f"{MOE}.post_mlp_layernorm", "one_change", "softmax over the last axis"),
    ("axk1", "expert_gate_up_swap", False, f"{MOE}.post_mlp_layernorm", "swapped_weights",
     "fused gate/up rows split the other way round"),
    ("axk1", "yarn_attn_factor_ignores_mscale", False, f"{AXK1}.q_rot", "scale",
     "a factor that reaches only the rotated dims"),
    ("axk1", "pad_mask_query_axis", True, f"{AXK1}.o_proj", "one_change", "the mask's padding left out"),
    ("roformer", "rope_neox_halves", False, f"{ROFORMER}.attention.output.dense", "rope_pairing",
     "RoPE's pairs taken as halves (i, i + d/2: GPT-NeoX's rotate_half) where the reference rotates adjacent pairs"),
    ("roformer", "rope_pos_from_one", False, f"{ROFORMER}.attention.output.dense", "position_offset",
     "RoPE's positions +1 (counted from 1, the reference's from 0)"),
]  # fmt: skip
FAST = {"heads_transposed", "ffn_residual_block_input", "no_type_embedding", "group_score_max"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


def test_a_reference_whose_ffn_residual_reads_the_layer_input_is_named(checkpoints):
    """RoFormer's reference layer 0 adding its FFN's output to the layer's input where the attention block's output
    belongs (ours correct): the skip connection reading another point of the stream, named on the reference's
    side."""
    ref = heldout_support.reference_model(checkpoints["roformer"])
    layer = ref.roformer.encoder.layer[0]

    def keep_input(module, args):
        object.__setattr__(module.output, "layer_input", args[0])  # outside the registry: a copy keeps its own

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + self.layer_input)

    layer.register_forward_pre_hook(keep_input)
    layer.output.forward = types.MethodType(forward, layer.output)
    bad = heldout_support.first_mismatch(MODELS, "roformer", ref)
    assert bad.name == f"{ROFORMER}.output.LayerNorm" and bad.hint.kind == "residual", bad
    assert bad.hint.evidence == {
        "ours": [f"{ROFORMER}.attention.output.LayerNorm"],
        "reference": ["roformer.embeddings_project"],
    }, bad.hint


#: located at their node, with no hint that names the cause (see the module docstring)
LOCATED = [
    ("axk1", "kv_a_split_order", False, f"{AXK1}.kv_a_layernorm"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded", "node"), LOCATED, indirect=["bug"], ids=str)
def test_a_bug_not_yet_named_is_still_located(model, bug, padded, node, checkpoints):
    heldout_support.assert_located_only(MODELS, checkpoints, model, padded, node)
