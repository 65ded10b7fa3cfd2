"""An eleventh held-back set: DeepSeek V3, CodeGen and XGLM user models by a helper who never read ``parity/``.

``tests/user_models/heldout11/``: a DeepSeek V3 (multi-head latent attention: q through a low-rank
``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` kept per head input-major, keys and values from a
compressed latent, RoPE on each head's tail from checkpoint rows laid as interleaved pairs; a group-limited
sigmoid router with a correction bias, routed scaling and shared experts), a CodeGen (``qkv_proj`` in
``mp_num`` model-parallel blocks of ``[q; v; k]``, rotate-every-two RoPE on the first ``rotary_dim`` dims,
a parallel block) and an XGLM (fairseq's sinusoidal positions at position + 2, the embedding scaled by
sqrt(d_model)), each written as functions over its own parameters. 41 bugs of kinds none of the ten sets
before held.

Its first measure (2026-12-03, seventh session, with the tenth set's fixes and nothing fitted to this set):
14 of 30 correct runs passed (every DeepSeek run refused: q_b_proj held per head input-major; XGLM's
scaled embedding aligned to its first layer's input, which also holds the sinusoids; a q weight scaled and
transposed, a fused q/k/v kept input-major refused); 3 of 41 hints named the cause. The fixes by kind are
asserted below.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout11"))

import heldout11_codegen
import heldout11_deepseek
import heldout11_xglm

MODELS = {"deepseek": heldout11_deepseek, "codegen": heldout11_codegen, "xglm": heldout11_xglm}


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helper's weights: norm weights around 1, biases ~0.1, token embeddings with a per-row scale,
    matrices of unit gain, and a random correction bias for DeepSeek's router."""
    for name, p in model.named_parameters():
        lower = name.lower()
        if ("norm" in lower or ".ln_" in lower or lower.startswith("ln_")) and lower.endswith("weight"):
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name or name.endswith("wte.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 + torch.rand(p.shape[0], 1, generator=gen)))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    specs = {
        "deepseek": T.DeepseekV3Config(
            vocab_size=256, hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            moe_intermediate_size=32, intermediate_size=128, n_shared_experts=1, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "codegen": T.CodeGenConfig(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, n_ctx=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "xglm": T.XGLMConfig(
            vocab_size=256, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, max_position_embeddings=64,
            scale_embedding=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0),
    }  # fmt: skip
    root, out = tmp_path_factory.mktemp("heldout11"), {}
    for i, (name, config) in enumerate(specs.items()):
        torch.manual_seed(1000 + i)
        model = T.AutoModelForCausalLM.from_config(config).float().eval()
        randomise(model, torch.Generator().manual_seed(1234 + i))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


bug = heldout_support.bug_fixture(MODELS)


def _passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


CLEAN = [("codegen", "fused_mp_runtime", False), ("deepseek", "absorbed", False)]
CLEAN_SLOW = [
    pytest.param(m, b, p, id=f"{m}-{b or 'baseline'}-{'padded' if p else 'unpadded'}")
    for m, variants in {
        "deepseek": ("", "sdpa", "absorbed", "rope_halfsplit_repack", "moe_dense_dispatch"),
        "codegen": ("", "sdpa", "fused_mp_runtime", "rope_halfsplit_repack", "rope_rotation_matrix"),
        "xglm": ("", "sdpa", "q_scale_folded", "fused_qkv_repack", "sinusoid_on_the_fly"),
    }.items()
    for b in variants
    for p in (False, True)
    if (m, b, p) not in CLEAN
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """CodeGen's fused q/k/v split into its model-parallel blocks at run time passes; so does DeepSeek's
    weight-absorbed MLA (``q_nope @ W_UK`` against the compressed keys: kv_b_proj's weight read along its
    output features), its kv_b_proj and attention internals untapped with the reason, o_proj judged."""
    _passes(model, bug, padded, checkpoints)


@pytest.mark.parametrize("bug", ["absorbed"], indirect=True)
def test_an_absorbed_projection_is_untapped_with_its_reason(bug, checkpoints):
    """Weight-absorbed MLA computes no kv_b_proj output and attends in the latent space: those nodes are
    untapped (not failed, not compared) with the reason, and the block's o_proj is compared and agrees."""
    res = heldout_support.check(MODELS, checkpoints, "deepseek")
    by_name = {r.name: r for r in res.nodes}
    stem = "model.layers.0.self_attn"
    absorbed = [r for n, r in by_name.items() if n.startswith(f"{stem}.kv_b_proj")]
    assert len(absorbed) == 2 and all(r.status == "untapped" and "absorbed" in r.detail for r in absorbed)
    for kind in ("q_rot", "k_rot", "scores", "probs", "context"):
        assert by_name[f"{stem}.{kind}"].status == "untapped", by_name[f"{stem}.{kind}"]
    assert by_name[f"{stem}.o_proj"].status == "ok" and by_name[f"{stem}.q_b_proj[rows 0, 1, 2, 3, ...]"].status == "ok"


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    """q_b_proj held per head input-major (rows of each head's part, another axis last); DeepSeek's q/k
    tails rotated on the checkpoint's interleaved pairs; a scaled embedding read by a lookup before
    sinusoids are added; a q weight scaled by head_dim ** -0.5 and transposed; a fused q/k/v kept
    input-major with its fused bias; CodeGen's q/k rows permuted to halves at load (each head's dims order
    read from the rows of the fused model-parallel tensor ours' q and k hold)."""
    _passes(model, bug, padded, checkpoints)


NAMED = [
    ("deepseek", "mla_q_a_norm_skipped", False, "model.layers.0.self_attn.q_b_proj[rows 0, 1, 2, 3, ...]",
     "projection_input",
     "model.layers.0.self_attn.q_a_layernorm skipped in ours"),
    ("deepseek", "mla_scale_from_nope_dim", False, "model.layers.0.self_attn.scores", "attention_scale",
     "1/sqrt(head_dim=24)"),
    ("deepseek", "mla_qk_concat_order_mismatch", False, "model.layers.0.self_attn.q_rot", "qkv_layout",
     "q's parts concatenated in the other order in ours"),
    ("deepseek", "mla_absorbed_scale_from_latent_dim", False, "model.layers.0.self_attn.o_proj", "attention_scale",
     "ours scales q k^T by 0.158114"),
    ("deepseek", "mla_absorbed_unnormed_latent", False, "model.layers.0.self_attn.o_proj", "one_change",
     "reading model.layers.0.self_attn.kv_a_layernorm's input (the value before its normalisation) in place of its "
     "output"),
    ("deepseek", "mla_kv_norm_over_rope", False, "model.layers.0.self_attn.kv_a_layernorm", "norm_kind",
     "the RMS over all of model.layers.0.self_attn.kv_a_proj_with_mqa's output (40 features"),
    ("deepseek", "mla_v_pad_slice_wrong_end", False, "model.layers.0.self_attn.context", "shape",
     "ours' first 16 are the reference's and the other 8 are zeros (the values zero-padded"),
    ("deepseek", "moe_bias_in_weights", False, "model.layers.2.input_layernorm", "routing_weights",
     "the correction bias kept in the weights"),
    ("deepseek", "moe_group_score_max", False, "model.layers.2.input_layernorm", "routing_weights",
     "each group scored by its best expert (max)"),
    ("deepseek", "moe_group_select_without_bias", False, "model.layers.2.input_layernorm", "routing_weights",
     "the groups ranked on the scores without the correction bias"),
    ("deepseek", "moe_group_mask_not_assigned", False, "model.layers.2.input_layernorm", "routing_weights",
     "the group limit not applied"),
    ("deepseek", "moe_scale_before_norm", False, "model.layers.2.input_layernorm", "routing_weights",
     "routed_scaling_factor not applied"),
    ("deepseek", "moe_scaling_on_shared", False, "model.layers.2.input_layernorm", "routing_weights",
     "applied to the routed and the shared experts' sum"),
    ("deepseek", "moe_weights_from_separate_topk", False, "model.layers.2.input_layernorm", "routing_weights",
     "a separate top-k of the raw scores"),
    ("codegen", "cg_mp_num_8", False, "transformer.h.0.attn.q_rot", "qkv_layout", "(CodeGen's mp_num = 8)"),
    ("codegen", "cg_qvk_split_without_mp_blocks", False, "transformer.h.0.attn.q_rot", "qkv_layout",
     "in 4 model-parallel blocks, each [q; v; k] (CodeGen's mp_num = 4)"),
    ("codegen", "cg_rotary_before_head_split", False, "transformer.h.0.attn.q_rot", "rope_partial",
     "head(s) 1, 2, 3 come out unrotated"),
    ("codegen", "cg_qk_rope_positions_split", True, "logits (without position_ids)", "position_offset",
     "q and k rotated at positions derived two ways"),
    ("codegen", "cg_scale_attn_inverted", False, "transformer.h.0.attn.scores", "attention_scale",
     "ours scales q k^T by 4"),
    ("codegen", "cg_mlp_double_ln", False, "transformer.h.0.mlp.fc_in", "norm_placement", "the norm applied twice"),
    ("codegen", "cg_k_pass_from_q", False, "transformer.h.0.attn.k_rot", "swapped_roles",
     "the pass-through dims of k taken from q in ours"),
    ("codegen", "cg_inv_freq_missing_step", False, "transformer.h.0.attn.q_rot", "rope_frequencies",
     "the exponent's arange without its step of 2"),
    ("codegen", "cg_rope_q_applied_twice", False, "transformer.h.0.attn.q_rot", "rope_rotation",
     "RoPE applied twice in ours"),
    ("codegen", "cg_out_proj_shards_averaged", False, "transformer.h.0.attn.out_proj", "partial_read",
     "takes their mean where they are summed (ours / reference = 1/4)"),
    ("codegen", "cg_act_after_fc_out", False, "transformer.h.0.mlp.fc_out", "activation",
     "the activation skipped before fc_out in ours"),
    ("xglm", "xg_sinusoid_cos_first", False, "model.layers.0.self_attn_layer_norm", "position_offset",
     "its halves laid cos|sin where the reference lays them sin|cos"),
    ("xglm", "xg_sinusoid_half_dim_denominator", False, "model.layers.0.self_attn_layer_norm", "position_offset",
     "log(10000) / half_dim (tensor2tensor)"),
    ("xglm", "xg_sinusoid_precedence", False, "model.layers.0.self_attn_layer_norm", "position_offset",
     "the parentheses of log(10000) / (half_dim - 1) lost"),
    ("xglm", "xg_sinusoid_freq_index_from_one", False, "model.layers.0.self_attn_layer_norm", "position_offset",
     "the frequency index counted from 1"),
    ("xglm", "xg_padding_row_after_offset", False, "model.layers.0.self_attn_layer_norm", "position_offset",
     "no position embedding at position(s) 1"),
    ("xglm", "xg_pos_table_indexed_by_token_ids", False, "model.layers.0.self_attn_layer_norm", "position_offset",
     "the table read at the token ids"),
    ("xglm", "xg_embed_scale_after_pos_add", False, "model.layers.0.self_attn_layer_norm", "position_offset",
     "the positions times 8 = the embedding scale"),
    ("xglm", "xg_q_scale_folded_weight_not_bias", False, "model.layers.0.self_attn.q_proj", "bias",
     "a scale folded into the weight at load and not into the bias"),
    ("xglm", "xg_scaling_on_v_copy_paste", False, "model.layers.0.self_attn.context", "scale",
     "the values scaled by the attention scale in ours"),
    ("xglm", "xg_kv_from_unnormed_residual", False, "model.layers.0.self_attn.k_proj", "projection_input",
     "model.layers.0.self_attn_layer_norm@input"),
    ("xglm", "xg_stale_residual_for_ffn", False, "model.layers.1.self_attn_layer_norm", "residual",
     "model.layers.0.self_attn.out_proj missing in ours"),
    ("xglm", "xg_act_relu_fairseq_default", False, "model.layers.0.fc2", "activation", "relu of the reference's"),
]  # fmt: skip
FAST = {"cg_mp_num_8", "xg_sinusoid_cos_first"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)
