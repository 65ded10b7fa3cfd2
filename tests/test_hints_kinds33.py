"""Hints the thirty-third held-back set prompted, each read with the fault on ours and on the reference (the user
models that first showed them, ``tests/test_heldout33_faults.py``, run the fault on ours only): a weight-free RMSNorm's
eps read at the projection after it, a looped block's count of runs before a node, two looped blocks run in the other
order, a relative position bias read otherwise past its extent; and a detector that raises gives no hint rather than
failing the check."""

from __future__ import annotations

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose import detectors
from parity.diagnose.alibi import relative_bias
from parity.diagnose.evidence import Evidence
from parity.diagnose.norms import weightless_norm_eps
from parity.diagnose.order import loop_count
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
NODE = "model.layers.0.self_attn.q_proj"
EPS = 1e-2


def _facts():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=EPS)
    return derive_facts(config)


def _evidence(ours_trace: Trace, ref_trace: Trace, name: str = NODE) -> Evidence:
    ours, ref = ours_trace.tensors[name], ref_trace.tensors[name]
    facts = _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    return Evidence(result, ours, ref, ours_trace, ref_trace, facts, None, None)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("side", SIDES)
def test_a_weight_free_norm_s_eps_is_read_at_the_projection_after_it_on_either_side(side):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 10, 32, generator=g, dtype=torch.float64) * torch.linspace(0.05, 2, 10)[None, :, None]
    weight = torch.randn(32, 32, generator=g, dtype=torch.float64)
    right, wrong = _rms(x, EPS), _rms(x, 1e-6)
    ours_in, ref_in = (wrong, right) if side == "ours" else (right, wrong)
    ours = Trace(tensors={NODE: ours_in @ weight.T}, inputs={NODE: ours_in})
    ref = Trace(tensors={NODE: ref_in @ weight.T}, inputs={NODE: ref_in})
    hint = weightless_norm_eps(_evidence(ours, ref))
    assert hint is not None and hint.kind == "norm_eps", hint
    assert hint.evidence["side"] == side and abs(hint.evidence["eps"] / 1e-6 - 1) < 0.05, hint
    # one factor per token that no eps explains (a scale growing with the token's index): no hint
    scaled = Trace(tensors={NODE: right @ weight.T}, inputs={NODE: right * torch.linspace(1, 2, 10)[None, :, None]})
    assert weightless_norm_eps(_evidence(scaled, Trace(tensors=ref.tensors, inputs={NODE: right}))) is None


def _looped(low_steps: int, high_first: bool = False) -> Trace:
    """A trace of HRM-like cycles: each cycle runs the low stack ``low_steps`` times then the high stack once."""
    parts = ("q_proj", "k_proj", "v_proj", "o_proj")  # two layers of four nodes: a looped block's worth
    low = [f"model.L_module.layers.{i}.{m}" for i in range(2) for m in parts]
    high = [f"model.H_module.layers.{i}.{m}" for i in range(2) for m in parts]
    first, second = (high, low) if high_first else (low, high)
    sequence = (first * low_steps + second) * 2
    trace = Trace(tensors={n: torch.ones(1, 4, 8) for n in low + high})
    trace.sequence = sequence
    trace.calls = {n: sequence.count(n) for n in low + high}
    return trace


@pytest.mark.parametrize("side", SIDES)
def test_a_loop_s_count_before_a_node_is_named_on_either_side(side):
    faulty, correct = _looped(3), _looped(2)
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    ours.tensors[HIGH] = ours.tensors[HIGH] * 2  # the high stack's first call differs after the low stack's runs
    hint = loop_count(_evidence(ours, ref, HIGH))
    mine, theirs = (3, 2) if side == "ours" else (2, 3)
    assert hint is not None and hint.kind == "loop_count", hint
    assert (hint.evidence["ours_calls"], hint.evidence["reference_calls"]) == (mine, theirs)
    assert "model.L_module.layers (8 nodes)" in hint.text
    assert loop_count(_evidence(_looped(2), _looped(2), HIGH)) is None  # the same count: no hint


HIGH = "model.H_module.layers.0.q_proj"


@pytest.mark.parametrize("side", SIDES)
def test_two_looped_blocks_run_in_the_other_order_are_named_on_either_side(side):
    faulty, correct = _looped(2, high_first=True), _looped(2)
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    low = "model.L_module.layers.0.q_proj"
    ours.tensors[low] = ours.tensors[low] * 2
    hint = loop_count(_evidence(ours, ref, low))
    assert hint is not None
    if side == "ours":  # ours ran the high stack before the low stack's first call; the reference had not
        assert hint.kind == "execution_order" and "ours runs model.H_module.layers (8 nodes) before" in hint.text
    else:  # the reference ran the high stack first: ours ran it fewer times before the low stack's first call
        assert hint.kind == "loop_count" and hint.evidence["ours_calls"] == 0


def test_a_detector_that_raises_gives_no_hint_unless_strict(monkeypatch):
    def broken(e):
        raise RuntimeError("a model this detector was not written for")

    monkeypatch.setattr(detectors, "DETECTORS", (broken,))
    ours = Trace(tensors={NODE: torch.ones(1, 4, 8)})
    ref = Trace(tensors={NODE: torch.zeros(1, 4, 8)})
    e = _evidence(ours, ref)
    monkeypatch.setenv(detectors.STRICT, "0")
    assert detectors.diagnose(e.result, ours, ref, e.facts) is None
    monkeypatch.setenv(detectors.STRICT, "1")
    with pytest.raises(RuntimeError, match="not written for"):
        detectors.diagnose(e.result, ours, ref, e.facts)


def _probs_with_bias(scores: torch.Tensor, extent: int, past: str) -> torch.Tensor:
    """Causal probabilities of ``scores`` plus a relative bias per head and distance (a table of ``extent`` entries),
    what lies past the extent zero or the table's last entry (``past``)."""
    _, h, q, _ = scores.shape
    table = torch.linspace(-1, 1, h * extent, dtype=torch.float64).reshape(h, extent)
    distance = (torch.arange(q)[:, None] - torch.arange(q)[None, :]).clamp_min(0)
    inside = table[:, distance.clamp_max(extent - 1)]
    bias = inside if past == "clamped" else torch.where(distance < extent, inside, torch.zeros_like(inside))
    bias = bias - bias[:, :1, :1]  # distance 0 adds the same on both sides
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    return torch.softmax((scores + bias).masked_fill(~causal, float("-inf")), -1)


@pytest.mark.parametrize("side", SIDES)
def test_a_relative_bias_read_past_its_extent_is_named_on_either_side(side):
    name = "model.layers.0.self_attn.probs"
    scores = torch.randn(1, 2, 12, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    faulty, correct = _probs_with_bias(scores, 5, "clamped"), _probs_with_bias(scores, 5, "zero")
    ours_p, ref_p = (faulty, correct) if side == "ours" else (correct, faulty)
    stem = "model.layers.0.self_attn"
    ours, ref = Trace(tensors={name: ours_p}), Trace(tensors={name: ref_p, f"{stem}.scores": scores})
    e = _evidence(ours, ref, name)
    e = Evidence(e.result, e.ours, e.ref, ours, ref, e.facts, torch.arange(12)[None], None)
    hint = relative_bias(e)
    assert hint is not None and hint.kind == "position_bias", hint
    assert hint.evidence["from_distance"] == 5 and "depends on the head and the query-key distance alone" in hint.text
    same = Evidence(e.result, e.ref, e.ref, ref, ref, e.facts, torch.arange(12)[None], None)
    assert relative_bias(same) is None
