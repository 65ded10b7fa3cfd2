"""A tenth held-back set: MPT, GPT-BigCode and Persimmon user models by a helper who never read ``parity/``.

``tests/user_models/heldout10/``: an MPT (ALiBi, a fused Wqkv clamped by ``clip_qkv``, LayerNorms without
bias), a GPT-BigCode (StarCoder 1: one K/V head, ``c_attn`` laid [q; k; v], learned positions) and a
Persimmon (partial rotary over half of each head, a LayerNorm per head on q and k, squared ReLU), each
keeping its weights as plain tensors in nested dicts (``self.p = {"L0": {"qkv": W, ...}}``) read by
functions. 40 bugs of kinds none of the nine sets before held.

Its first measure (2026-12-02, sixth session, with the ninth set's changes and nothing fitted to this set):
every run refused (weights in nested dicts were no parameters: ``adopt_plain_tensors`` read one level).
With that one fix, and still no hint fitted: 22 of 24 correct runs passed (BigCode's fused ``c_attn``
copy kept beside its q/k/v views was taken for q's part); hints: 27 of 40 named the cause (68%), 4 the
component, 3 a wrong cause (MQA keys scrambled read as a head split wrong on the reference; a position
table sliced from its end read as the table skipped; another layer's bias read as none), 6 none.
The fixes by kind are asserted below.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout10"))

import heldout10_bigcode
import heldout10_mpt
import heldout10_persimmon

MODELS = {"mpt": heldout10_mpt, "bigcode": heldout10_bigcode, "persimmon": heldout10_persimmon}
EMBEDDINGS = ("wte.weight", "wpe.weight", "embed_tokens.weight")


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helper's weights: embeddings 0.2 N(0, 1) with a per-row scale exp(0.5 N(0, 1)), biases ~0.1,
    norm weights around 1, matrices of unit gain."""
    for name, p in model.named_parameters():
        if name.endswith(EMBEDDINGS):
            p.copy_(
                0.2 * torch.randn(p.shape, generator=gen) * torch.exp(0.5 * torch.randn(p.shape[0], 1, generator=gen))
            )
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    specs = {
        "mpt": (T.MptForCausalLM, T.MptConfig(
            vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, expansion_ratio=4, no_bias=True,
            attn_config={"clip_qkv": 2.5, "alibi": True, "alibi_bias_max": 8}, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, use_cache=False)),
        "bigcode": (T.GPTBigCodeForCausalLM, T.GPTBigCodeConfig(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64,
            activation_function="gelu_pytorch_tanh", multi_query=True, attn_pdrop=0.0, embd_pdrop=0.0,
            resid_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)),
        "persimmon": (T.PersimmonForCausalLM, T.PersimmonConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, partial_rotary_factor=0.5, qk_layernorm=True, hidden_act="relu2",
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)),
    }  # fmt: skip
    root, out = tmp_path_factory.mktemp("heldout10"), {}
    for i, (name, (cls, config)) in enumerate(specs.items()):
        torch.manual_seed(1000 + i)
        model = cls(config).eval()
        randomise(model, torch.Generator().manual_seed(2000 + i))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


bug = heldout_support.bug_fixture(MODELS)


def check(model: str, checkpoints, padded: bool = False, mode: str = "chained"):
    return heldout_support.check(MODELS, checkpoints, model, padded, mode)


def _passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


CLEAN = [("mpt", "", False), ("bigcode", "fused_c_attn", False), ("persimmon", "", True)]
CLEAN_SLOW = [
    (m, b, p)
    for m, variants in {
        "mpt": ("", "sdpa", "split_qkv", "alibi_relative"),
        "bigcode": ("", "sdpa_expand_kv", "mqa_flat_bmm", "fused_c_attn"),
        "persimmon": ("", "sdpa", "complex_rope", "split_qkv"),
    }.items()
    for b in variants
    for p in (False, True)
    if (m, b, p) not in CLEAN
]


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """Weights kept as plain tensors in nested dicts are adopted as parameters; a fused copy kept beside
    the views cut out of it is neither view's weight: each passes."""
    _passes(model, bug, padded, checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"], ids=str)
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    _passes(model, bug, padded, checkpoints)


NAMED = [
    ("mpt", "alibi_slopes_head_dim", False, "transformer.blocks.0.attn.probs", "alibi", "= 8 / head_dim (16)"),
    ("mpt", "alibi_reorder_always", False, "transformer.blocks.0.attn.probs", "alibi",
     "the standard slopes in another head order"),
    ("mpt", "alibi_int_slopes", False, "transformer.blocks.0.attn.probs", "alibi", "ours with no ALiBi"),
    ("mpt", "clip_on_input", False, "transformer.blocks.0.attn.Wqkv", "clamp",
     "clip_qkv (2.5) applied to the projection's input instead of its output"),
    ("bigcode", "wpe_from_end", False, "transformer.wpe", "position_offset", "row id + 40"),
    ("bigcode", "mqa_value_from_key_slice", False, "transformer.h.0.attn.context", "swapped_roles",
     "the probabilities times the keys (k_rot)"),
    ("persimmon", "loader_qkv_bias_prev_layer", False, "model.layers.0.self_attn.query_key_value", "bias",
     "ours adds model.layers.1.self_attn.query_key_value's bias at model.layers.0"),
    ("persimmon", "fused_qkv_3_inner", False, "model.layers.0.self_attn.q_layernorm", "qkv_layout",
     "(heads, head_dim, 3)"),
    ("persimmon", "partial_rotary_last_dims", False, "model.layers.0.self_attn.q_rot", "rope_partial",
     "ours rotates 8 of 16 dims (8, 9"),
    # named in the seventh session (the sixth left them without a hint or with the component only)
    ("bigcode", "mqa_repeat_interleave_features", False, "transformer.h.0.attn.k_rot", "head_mapping",
     "repeat_interleave(4, dim=-1)"),
    ("bigcode", "mqa_flat_query_view", False, "transformer.h.0.attn.probs", "head_mapping",
     "flattened as (queries, heads) rows for one matmul and viewed back as (heads, queries)"),
    ("bigcode", "right_pad_mask_assumed", True, "transformer.h.0.attn.probs", "padding", "built for right padding"),
    ("bigcode", "causal_diag_off_by_one", False, "transformer.h.0.attn.probs", "causal_mask",
     "hides each query's own key"),
    ("mpt", "pad_mask_query_axis", True, "transformer.blocks.0.attn.probs", "padding",
     "laid along the queries instead of the keys"),
    ("persimmon", "relu2_fp16", False, "model.layers.0.mlp.dense_4h_to_h", "precision",
     "dense_4h_to_h's input (the activation or op before it"),
    ("persimmon", "v_layernorm_applied", False, "model.layers.0.self_attn.context", "swapped_roles",
     "the values through k_layernorm"),
]  # fmt: skip
FAST = {"alibi_reorder_always", "wpe_from_end", "loader_qkv_bias_prev_layer", "mqa_flat_query_view", "relu2_fp16"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


@pytest.mark.parametrize("bug", ["mqa_repeat_interleave_features"], indirect=True)
def test_keys_of_one_head_are_never_read_as_a_head_split_on_the_reference(bug, checkpoints):
    """MQA's single K/V head scrambled in ours when expanded to the query heads: with one head the two
    head-split views are one tensor, so no hint may name the reference's head split (a wrong cause once)."""
    res = check("bigcode", checkpoints)
    bad = res.first_mismatch
    assert bad is not None and bad.name == "transformer.h.0.attn.k_rot", res.verdict()
    assert bad.hint is None or "in the reference" not in str(bad.hint), bad.hint
