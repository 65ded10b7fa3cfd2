"""A twenty-first held-back set: Helium, GraniteMoeShared and EXAONE-MoE user models by a helper who never read
``parity/``; measured once, at the end of the twelfth session, and not fitted yet.

``tests/user_models/heldout21/``: a Helium (biases on q/k/v and the MLP, interleaved RoPE), a GraniteMoeShared
(embedding, attention and residual multipliers, logits_scaling, a shared MLP beside the experts, q/k/v as einsum
tensors read out of one stacked ``(hidden, 2, kv_heads, head_dim)`` weight by slicing) and an EXAONE-MoE
(DeepSeek V3's group-limited sigmoid router with a correction bias, a shared expert, a dense first layer,
sliding layers with RoPE and full layers without). 39 bugs, five correct variants per family.

First measure on e089aa4 (sets 18 to 20 fitted, nothing fitted to this set): 22 of 36 correct runs passed
(every GraniteMoeShared run raised inside parity; EXAONE-MoE's routed_scaling_factor folded into its experts
failed: its router's constants were not in the facts); of the bugs, 15 of 39 named the cause (38%), 6 were
refused naming the tensor, 12 crashed (GraniteMoeShared), 6 named the component or nothing, none a wrong
cause. Fixed since: EXAONE-MoE's routing constants in the facts (DeepSeek V3's rule). Open (the strict xfail
below): the slices ``wkv[:, 0]`` and ``wkv[:, 1]`` of GraniteMoeShared's stacked K/V weight are both followed
as ``k_proj`` and the per-row transform then indexes a ``head_dim``-wide axis.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout21"))

import heldout21_exaone_moe
import heldout21_granitemoeshared
import heldout21_helium

MODELS = {
    "helium": heldout21_helium,
    "granitemoeshared": heldout21_granitemoeshared,
    "exaone_moe": heldout21_exaone_moe,
}


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
        "helium": dict(intermediate_size=96, head_dim=16, attention_bias=True, mlp_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
        "granitemoeshared": dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
                                 shared_intermediate_size=40, embedding_multiplier=6.0, attention_multiplier=0.15,
                                 residual_multiplier=0.4, logits_scaling=3.0),
        "exaone_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                           num_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True, first_k_dense_replace=1, sliding_window=8, sliding_window_pattern=2),
    }  # fmt: skip
    specs = {name: AutoConfig.for_model(name, **common, **kw) for name, kw in kwargs.items()}
    return heldout_support.save_checkpoints(
        tmp_path_factory.mktemp("heldout21"), specs, heldout_support.randomise, 1000, 1234
    )


bug = heldout_support.bug_fixture(MODELS)

#: a known false failure, not fitted yet (see the module docstring)
KNOWN_FALSE = frozenset({("granitemoeshared", v) for v in ("", *heldout21_granitemoeshared.CLEAN)})
CLEAN = [("exaone_moe", "routed_scale_folded", False), ("helium", "", True)]
CLEAN_SLOW = heldout_support.clean_cases(MODELS, CLEAN, KNOWN_FALSE)


@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN, indirect=["bug"], ids=str)
def test_a_correct_model_passes(model, bug, padded, checkpoints):
    """EXAONE-MoE's routed_scaling_factor folded into its experts' down projections: read through the
    router's constants (the facts' DeepSeek V3 rule)."""
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "padded"), CLEAN_SLOW, indirect=["bug"])
def test_every_correct_variant_passes(model, bug, padded, checkpoints):
    heldout_support.assert_passes(MODELS, checkpoints, model, padded)


NAMED = [
    ("exaone_moe", "em_router_softmax", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses from a softmax over the experts instead of a sigmoid"),
    ("exaone_moe", "em_weights_from_biased_scores", False, "model.layers.1.mlp.router.weights", "routing_weights",
     "ours equals the biased scores"),
    ("exaone_moe", "em_group_limit_ignored", False, "model.layers.1.mlp.router.experts", "routing",
     "ours chooses with no group limit"),
    ("exaone_moe", "em_routed_scaling_dropped", False, "model.layers.1.mlp", "routing_weights",
     "routed_scaling_factor not applied"),
]  # fmt: skip


@pytest.mark.parametrize(
    heldout_support.LOCATED, heldout_support.located_cases(NAMED, {"em_router_softmax"}), indirect=["bug"]
)
def test_a_bug_is_located_with_the_hint_that_names_it(model, bug, padded, node, kind, says, checkpoints):
    heldout_support.assert_located(MODELS, checkpoints, model, padded, node, kind, says)
