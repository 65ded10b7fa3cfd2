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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    common = heldout_support.COMMON
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
    return heldout_support.save_checkpoints(
        tmp_path_factory.mktemp("heldout18"), specs, heldout_support.randomise, 1000, 1234
    )


bug = heldout_support.bug_fixture(MODELS)

CLEAN = [
    ("arcee", "", False),
    ("arcee", "varlen_unpad", True),
    ("hunyuan_v1_moe", "", False),
    ("seed_oss", "sdpa_gqa", True),
    ("hunyuan_v1_moe", "shared_as_extra_expert", False),
    ("arcee", "rope_complex", True),
]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN)


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
    ("arcee", "ar_yarn_orig_ctx_from_max_pos", False, "model.layers.0.self_attn.q_rot", "rope_band",
     "YaRN with its correction range computed from max_position_embeddings (256), not "
     "original_max_position_embeddings (64)"),
    ("arcee", "ar_yarn_no_truncate", False, "model.layers.0.self_attn.q_rot", "rope_band",
     "YaRN with its correction range's bounds left unrounded (truncate is true: floor and ceil them)"),
    ("arcee", "ar_yarn_factor_multiplies", False, "model.layers.0.self_attn.q_rot", "rope_scaling",
     "YaRN with its interpolated frequencies multiplied by the factor 4 where they are divided by it"),
    ("arcee", "ar_rope_interleaved", False, "model.layers.0.self_attn.q_rot", "rope_pairing",
     "ours rotates interleaved (2i, 2i + 1) pairs"),
    ("arcee", "ar_gqa_kv_tiled", False, "model.layers.0.self_attn.scores", "head_mapping", "heads 1, 2 differ"),
    ("hunyuan_v1_moe", "hy_router_no_renorm", False, "model.layers.0.mlp.router.weights", "renormalisation",
     "the reference sums to 1 in every row, ours does not"),
    ("hunyuan_v1_moe", "hy_router_sigmoid", False, "model.layers.0.mlp.router.weights", "routing_weights",
     "ours equals a sigmoid of the router's logits, renormalised over the chosen"),
    ("hunyuan_v1_moe", "hy_router_softmax_seq_dim", False, "model.layers.0.mlp.router.experts", "routing",
     "ours chooses by a softmax over the tokens (dim=0) instead of over the experts"),
    ("hunyuan_v1_moe", "hy_topk_first_layer_for_all", False, "model.layers.2.mlp.router.experts",
     "experts_per_token", "in ours: at layer 2 ours chooses 2, the reference 1, where the config sets 1"),
    ("hunyuan_v1_moe", "hy_shared_mlp_dropped", False, "model.layers.0.mlp", "shared_expert",
     "the routed experts alone (the shared MLP's output not added) in ours"),
    ("hunyuan_v1_moe", "hy_expert_gate_up_swapped", False, "model.layers.0.mlp", "swapped_weights",
     "the chosen experts computed with gate_up_proj's halves swapped (up first: the activation on the up half), "
     "plus the shared MLP's output in ours"),
]  # fmt: skip
FAST = {"ar_gqa_kv_tiled", "ar_yarn_no_truncate", "hy_topk_first_layer_for_all", "hy_shared_mlp_dropped"}


@pytest.mark.parametrize(heldout_support.LOCATED, heldout_support.located_cases(NAMED, FAST), indirect=["bug"])
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    """After a q_rot/k_rot mismatch the scores forgive (in some heads at least: a GQA mapping wrong besides),
    the next failure is the first, with its tensors kept for the hint (the ReLU² at down_proj); a factor
    dropped outright still fails at q_rot, named. HunYuan's router is a ``...Gate`` returning its choice."""
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)


# --- the same kinds with the fault in the reference (a patched Transformers model, ours correct)


def test_a_shared_mlp_the_reference_leaves_out_names_the_reference(checkpoints):
    import types

    import parity

    ref = heldout_support.reference_model(checkpoints["hunyuan_v1_moe"])

    def routed_only(self, hidden_states):  # HunYuanMoEV1Moe.forward with its shared MLP run, not added
        shape = hidden_states.shape
        self.shared_mlp(hidden_states)
        _, weights, chosen = self.gate(hidden_states.view(-1, shape[-1]))
        return self.experts(hidden_states.view(-1, shape[-1]), chosen, weights).view(*shape)

    for layer in ref.model.layers:
        layer.mlp.forward = types.MethodType(routed_only, layer.mlp)
    bad = parity.check_model(heldout18_hunyuan_v1_moe.build, reference=ref, seq_len=24).first_mismatch
    assert bad.name == "model.layers.0.mlp" and bad.hint.kind == "shared_expert", bad
    assert "the routed experts alone (the shared MLP's output not added) in the reference" in bad.hint.text


def test_a_reference_choosing_another_number_of_experts_is_named(checkpoints):
    import parity

    ref = heldout_support.reference_model(checkpoints["hunyuan_v1_moe"])
    ref.model.layers[2].mlp.gate.top_k = 3
    bad = parity.check_model(heldout18_hunyuan_v1_moe.build, reference=ref, seq_len=24).first_mismatch
    assert bad.name == "model.layers.2.mlp.router.experts" and bad.hint.kind == "experts_per_token", bad
    assert "in the reference: at layer 2 ours chooses 1, the reference 3, where the config sets 1" in bad.hint.text
    assert "3 is layer 3's" in bad.hint.text


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


def test_yarn_bounds_unrounded_in_the_reference_name_the_reference_behind_the_moved_factor(checkpoints):
    """Ours takes YaRN's attention factor on the scores (its q_rot differs by that scale alone); the
    reference's frequencies are YaRN's with ``truncate`` false: the reference's rotation is named."""
    import parity
    from parity.model.derive import derive_facts

    ref = heldout_support.reference_model(checkpoints["arcee"])
    layer = derive_facts(ref.config).layers[0]
    unrounded = layer.rope.with_parameters({"truncate": False}, layer.head_dim, ref.config.max_position_embeddings)
    ref.model.rotary_emb.inv_freq = torch.tensor(unrounded, dtype=torch.float32)
    bad = parity.check_model(heldout18_arcee.build, reference=ref, seq_len=24).first_mismatch
    assert bad.name == "model.layers.0.self_attn.q_rot" and bad.hint.kind == "rope_band", bad
    assert "the reference rotates like YaRN with its correction range's bounds left unrounded" in bad.hint.text
