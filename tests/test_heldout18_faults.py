"""An eighteenth held-back set: Arcee, HunYuan MoE and Seed-OSS user models by a helper who never read ``parity/``.

``tests/user_models/heldout18/``: an Arcee (a non-gated ReLU² MLP, YaRN whose attention factor the port takes
as its square on the softmax scale instead of on cos and sin), a HunYuan MoE (per-head q/k norms after RoPE,
a fixed NTK alpha, a softmax router with a per-layer ``moe_topk`` list, a shared MLP, q/k/v held as one
grouped ``(hidden, kv_heads, group + 2, head_dim)`` tensor) and a Seed-OSS (q/k/v and output biases, head_dim
32 beside hidden/heads 16, theta 1e7), each over its own parameter names and layouts. 38 bugs, five correct
variants per family.

Measured at the end of the eleventh session (2026-12-03) with the seventeenth set's fixes (277904c) and
nothing fitted to this set: 16 of 36 correct runs passed (every HunYuan MoE run raised: ``derive_facts`` read
``moe_topk``'s list as one number; four Arcee variants failed at ``q_rot`` by YaRN's attention factor, which
they take on the scores); of the bugs, 12 of 38 named the cause (32%), 2 were refused naming the tensor, 13
HunYuan runs crashed, the rest named the component, nothing, or (Arcee's, behind the false ``q_rot``) a wrong
cause. Fixed so far, by kind: a per-layer ``num_experts_per_tok`` list in the facts; a product keeping more than one
head axis apart (``bsh,hjtd->bjtsd`` over HunYuan's grouped q/k/v) read through its rows; q/k after RoPE
judged through their product (a mismatch there followed by agreeing scores is untapped, and the stream keeps
the failure after it). Then 30 of 36 correct runs pass (strict xfails: the shared MLP stacked as one more
expert fails a shape at the router; q/k rows permuted at load for a complex RoPE are not read back in Arcee
and HunYuan, though Seed-OSS's are). Not yet: the bugs' hints (HunYuan's six MoE bugs land on the layer
with none); the next session fits them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout18"))

import heldout18_arcee
import heldout18_hunyuan_v1_moe
import heldout18_seed_oss

MODELS = {"arcee": heldout18_arcee, "hunyuan_v1_moe": heldout18_hunyuan_v1_moe, "seed_oss": heldout18_seed_oss}


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helper's weights: norm weights around 1, other vectors (biases) ~0.3, token embeddings of unit
    scale, other matrices of unit gain (one draw per parameter, scaled after)."""
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=gen)
        if p.dim() == 1:
            r = 1.0 + 0.5 * r if "norm" in name else 0.3 * r
        elif "embed_tokens" not in name:
            r = r / math.sqrt(p.shape[-1])
        p.copy_(r)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs = {
        "arcee": dict(
            intermediate_size=96, hidden_act="relu2", rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}),
        "hunyuan_v1_moe": dict(
            intermediate_size=48, head_dim=16, hidden_act="silu", rms_norm_eps=1e-5, num_experts=6,
            moe_topk=[2, 2, 1, 3], tie_word_embeddings=True,
            rope_parameters={"rope_type": "dynamic", "alpha": 4.0, "factor": 1.0, "rope_theta": 10000.0}),
        "seed_oss": dict(
            intermediate_size=96, head_dim=32, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=True,
            attention_out_bias=True, attention_dropout=0.0, residual_dropout=0.0, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7}),
    }  # fmt: skip
    specs = {name: AutoConfig.for_model(name, **common, **kw) for name, kw in kwargs.items()}
    return heldout_support.save_checkpoints(tmp_path_factory.mktemp("heldout18"), specs, randomise, 1000, 1234)


bug = heldout_support.bug_fixture(MODELS)

#: known false failures, not fitted yet: the shared MLP stacked as one more expert (a router of E + 1 rows) fails a
#: shape at the router; q/k rows permuted at load for a complex-number RoPE fail at q_rot/k_rot (cosine ~0.1:
#: the permutation is not read back) in Arcee (beside YaRN's factor on the scores) and HunYuan (grouped q/k/v)
KNOWN_FALSE = frozenset(
    {("hunyuan_v1_moe", "shared_as_extra_expert"), ("hunyuan_v1_moe", "rope_complex"), ("arcee", "rope_complex")}
)
CLEAN = [
    ("arcee", "", False),
    ("arcee", "varlen_unpad", True),
    ("hunyuan_v1_moe", "", False),
    ("seed_oss", "sdpa_gqa", True),
]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN, KNOWN_FALSE)


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """Arcee takes YaRN's attention factor squared on its softmax scale: q_rot and k_rot differ from the
    reference's by the factor, the scores agree, and the check passes. HunYuan MoE's q/k/v come out of one
    einsum as ``(batch, kv_heads, group + 2, seq, head_dim)``."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


def test_the_q_k_difference_a_port_takes_on_the_scores_is_untapped_with_its_reason(checkpoints):
    res = heldout_support.check(MODELS, checkpoints, "arcee")
    q_rot = next(r for r in res.nodes if r.name == "model.layers.0.self_attn.q_rot")
    assert q_rot.status == "untapped" and "q and k are read only through their product" in q_rot.detail, q_rot


NAMED = [
    ("arcee", "ar_relu_not_squared", False, "model.layers.0.mlp.down_proj", "activation",
     "ours equals relu of the reference's model.layers.0.mlp.up_proj, the reference relu squared"),
    ("arcee", "ar_yarn_mscale_dropped", False, "model.layers.0.self_attn.q_rot", "rope_attention_factor",
     "ours takes no factor (1), the reference YaRN's default 0.1 ln(4) + 1 (1.13863)"),
]  # fmt: skip


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, set()), indirect=["bug"])
def test_a_bug_behind_the_moved_factor_is_located(model, bug, padded, node, kind, says, checkpoints):
    """After a q_rot/k_rot mismatch the scores forgive, the next failure is the first, with its tensors kept
    for the hint (the ReLU² at down_proj); a factor dropped outright still fails at q_rot, named."""
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


def test_a_per_layer_experts_per_token_list_is_read_per_layer():
    from transformers import AutoConfig

    from parity.model.derive import derive_facts

    config = AutoConfig.for_model(
        "hunyuan_v1_moe", vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, intermediate_size=48, head_dim=16, num_experts=6, moe_topk=[2, 2, 1, 3],
    )  # fmt: skip
    facts = derive_facts(config)
    assert [layer.experts_per_token for layer in facts.layers] == [2, 2, 1, 3]
    assert all(layer.num_experts == 6 for layer in facts.layers)
