"""Hints the fourteenth held-back set prompted, each read with the fault on ours and on the reference (the user
models that first showed them, ``tests/test_heldout14_faults.py``, run the fault on ours only): a shared
expert combined otherwise with the routed experts, tokens written back to the wrong positions after the
padding was dropped, routing weights taken as a sigmoid, a theta a template hard-codes under a llama3
scaling."""

from __future__ import annotations

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.evidence import Evidence
from parity.diagnose.masks import tokens_moved
from parity.diagnose.moe import routing_weights, shared_expert
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.routing import WEIGHTS
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
BLOCK = "model.layers.1.mlp"


def _facts():
    from transformers import Qwen2MoeConfig

    return derive_facts(
        Qwen2MoeConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
            intermediate_size=32,
        )
    )  # fmt: skip


def _evidence(name, faulty, correct, side, ref_trace=None, mask=None):
    """The evidence at ``name`` with the faulty tensor on ``side`` and the correct one on the other."""
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    facts = _facts()
    layer, kind = facts.locate(name)
    kind = WEIGHTS if name.endswith(WEIGHTS) else kind  # as the reference's MoE nodes name it
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ref_trace = ref_trace if ref_trace is not None else Trace()
    ref_trace.tensors[name] = ref
    return Evidence(result, ours, ref, Trace(tensors={name: ours}), ref_trace, facts, None, mask)


@pytest.mark.parametrize("side", SIDES)
def test_a_shared_expert_left_ungated(side):
    """Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` to the routed experts' sum; a port
    that adds the shared expert ungated is read from the three nodes before the block. Once no hint."""
    g = torch.Generator().manual_seed(0)
    routed, shared, gate = (
        torch.randn(12, 16, generator=g),
        torch.randn(12, 16, generator=g),
        torch.randn(12, 1, generator=g),
    )
    trace = Trace(
        tensors={
            f"{BLOCK}.experts": routed,
            f"{BLOCK}.shared_expert.down_proj": shared.reshape(1, 12, 16),
            f"{BLOCK}.shared_expert_gate": gate,
        }
    )
    correct = (routed + torch.sigmoid(gate) * shared).reshape(1, 12, 16)
    faulty = (routed + shared).reshape(1, 12, 16)
    hint = shared_expert(_evidence(BLOCK, faulty, correct, side, trace))
    assert hint is not None and hint.kind == "shared_expert", hint
    wrong, right = "routed + shared (the shared expert's gate left out)", "routed + sigmoid(gate) * shared"
    assert hint.evidence == (
        {"ours": wrong, "reference": right} if side == "ours" else {"ours": right, "reference": wrong}
    )


@pytest.mark.parametrize("side", SIDES)
def test_tokens_written_back_at_the_front_after_the_padding_was_dropped(side):
    """A block run on the real tokens alone (padding dropped), its results written to the first n flat rows
    instead of the real tokens' rows. Once no hint."""
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    correct = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    real = mask.flatten().bool()
    faulty = torch.zeros(16, 16)
    faulty[: int(real.sum())] = correct.reshape(16, 16)[real]
    hint = tokens_moved(_evidence(BLOCK, faulty.reshape(2, 8, 16), correct, side, mask=mask))
    assert hint is not None and hint.kind == "padding", hint
    assert hint.evidence["side"] == side and hint.evidence["at_front"], hint
    assert "written back at the front" in str(hint)


def test_tokens_that_differ_without_moving_are_no_placement():
    """Most real tokens differ and match no other token: a couple of look-alikes do not make a placement."""
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    g = torch.Generator().manual_seed(2)
    correct = torch.randn(2, 8, 16, generator=g)
    faulty = correct + torch.randn(2, 8, 16, generator=g)
    faulty[1, 7] = correct[1, 6]
    assert tokens_moved(_evidence(BLOCK, faulty, correct, "ours", mask=mask)) is None


@pytest.mark.parametrize("side", SIDES)
def test_routing_weights_taken_as_a_sigmoid(side):
    """DeepSeek-V3's sigmoid habit in a softmax router: the top-k weights read against the router's logits.
    Once no hint (the sigmoid forms were read only where the router was not a node)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 4, generator=g) * 2
    chosen = logits.topk(2, -1).indices
    correct = torch.softmax(logits, -1).gather(-1, chosen)
    faulty = torch.sigmoid(logits.gather(-1, chosen))
    trace = Trace(tensors={f"{BLOCK}.gate": logits, f"{BLOCK}.router.experts": chosen})
    hint = routing_weights(_evidence(f"{BLOCK}.router.weights", faulty, correct, side, trace))
    assert hint is not None and hint.kind == "routing_weights", hint
    sigmoid = "a sigmoid of the router's logits (not a softmax)"
    assert (hint.evidence["ours"] == sigmoid) == (side == "ours")
    assert (hint.evidence["reference"] == sigmoid) == (side != "ours")
