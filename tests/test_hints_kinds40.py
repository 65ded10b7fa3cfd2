"""Hints and readings the fortieth measure's session prompted, each read with the fault on ours and on the
reference: a module applied to each vector before a reduction the other side applies first (set 35's indexer key
norm applied to every key of a block before the block's mean pools them)."""

from __future__ import annotations

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.detectors import diagnose
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _shape_hint(name: str, ours: tuple, ref: tuple):
    """diagnose() on a node whose (output, input) pairs have other shapes on each side."""
    result = compare_node(NodeSpec(name, name), 0, ours[0], ref[0], Tolerances())
    traces = [Trace(tensors={name: out}, inputs={name: inp}) for out, inp in (ours, ref)]
    from transformers import LlamaConfig

    facts = derive_facts(LlamaConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=4))
    return diagnose(result, traces[0], traces[1], facts)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("how", ["mean", "sum"])
def test_a_norm_applied_before_a_pooling_reduction_is_named(side, how):
    """Keys of 3 blocks of 4 tokens, (3, 4, 12): one side normalises each key and pools after, (3, 4, 12) -> its
    norm node holds (3, 4, 12); the other pools first and normalises the pooled key, (3, 12)."""
    gain = 1 + 0.1 * _randn(12, seed=1)
    keys = _randn(3, 4, 12, seed=2)
    reduce = torch.mean if how == "mean" else torch.sum
    pooled = reduce(keys, dim=1)
    first = (torch.nn.functional.rms_norm(keys, (12,), gain, 1e-6), keys)
    after = (torch.nn.functional.rms_norm(pooled, (12,), gain, 1e-6), pooled)
    name = "model.layers.1.self_attn.indexer.k_layernorm"
    ours, ref = (first, after) if side == "ours" else (after, first)
    hint = _shape_hint(name, ours, ref)
    assert hint is not None and hint.kind == "reduction_order", hint
    assert f"{side} applies it to each of the 4 vectors along axis 1" in hint.text, hint
    assert hint.evidence["reduction"] == how


def test_an_extra_axis_that_is_not_a_reduction_stays_a_shape_difference():
    """One side holds an axis more but its input reduced over it is not the other's input (another layout):
    no order is claimed."""
    keys = _randn(3, 4, 12, seed=2)
    other = _randn(3, 12, seed=3)
    hint = _shape_hint("model.layers.1.self_attn.indexer.k_layernorm", (keys, keys), (other, other))
    assert hint is not None and hint.kind == "shape", hint


def _one_position_result(name: str, ours: torch.Tensor, ref: torch.Tensor):
    return compare_node(NodeSpec(name, name), 0, ours, ref, Tolerances())


def test_a_node_run_one_token_per_call_is_judged_at_its_first_position_only():
    """A forward looping over the tokens (llama2.c's ``forward(token, pos)`` called per position) records each
    node's first call: one position of the reference's 6. Agreeing there: not judged beyond (untapped, said
    so); differing there: a shape difference, as before; an expert's first call (the first token routed to it)
    is no fixed position: not judged."""
    ref = _randn(1, 6, 8, seed=4)
    agrees = _one_position_result("model.layers.0", ref[:, 0], ref)
    assert agrees.status == "untapped" and "ours holds one position of 6 (axis 1)" in agrees.detail, agrees
    kept = _one_position_result("model.layers.0", ref[:, :1].clone(), ref)
    assert kept.status == "untapped", kept
    differs = _one_position_result("model.layers.0", ref[:, 0] + 1, ref)  # the diagnosis reads the shape
    assert differs.status == "shape", differs
    expert = _one_position_result("model.layers.0.mlp.experts.3", ref[0, 2:3] + 1, ref[0])
    assert expert.status == "untapped" and "an expert's first call is no fixed position" in expert.detail, expert
    other = _one_position_result("model.layers.0", ref[:, :2], ref)  # two positions: a shape difference as before
    assert other.status == "shape", other
