"""The compare step as a pure function of (ours, reference, tolerance)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.compare.metrics import tensor_metrics
from parity.compare.results import compare_traces, first_mismatch
from parity.compare.tolerances import DEFAULT_TOLERANCES, Tolerances, tolerance_for
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3)


def rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=50, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000))
def test_identical_tensors_pass_exactly(shape, seed):
    t = rand(shape, seed)
    m = tensor_metrics(t, t.clone(), atol=0.0, rtol=0.0)
    assert m.status == "ok" and m.max_abs == 0 and m.mean_abs == 0
    assert m.cosine == pytest.approx(1.0) or float(t.norm()) == 0


@settings(max_examples=50, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), eps=st.floats(1e-3, 1.0))
def test_a_perturbation_past_atol_is_a_mismatch_and_max_abs_is_exact(shape, seed, eps):
    ref = rand(shape, seed).double()  # float64, so adding eps is exact enough to assert max_abs
    ours = ref.clone()
    ours.view(-1)[-1] += eps
    m = tensor_metrics(ours, ref, atol=eps / 2, rtol=0.0)
    assert m.status == "mismatch"
    assert m.max_abs == pytest.approx(eps, rel=1e-5)
    assert tensor_metrics(ours, ref, atol=eps * 1.01, rtol=0.0).status == "ok"


def test_rtol_scales_with_the_reference_magnitude():
    ref = torch.tensor([1000.0, 1.0])
    ours = torch.tensor([1000.5, 1.0])
    assert tensor_metrics(ours, ref, atol=0.0, rtol=1e-3).status == "ok"
    assert tensor_metrics(ours, ref, atol=0.0, rtol=1e-4).status == "mismatch"


def test_cosine_is_blind_to_scale_but_max_rel_is_not():
    ref = torch.tensor([1.0, -2.0, 3.0])
    m = tensor_metrics(ref * 1.5, ref, atol=1e-6, rtol=1e-6)
    assert m.cosine == pytest.approx(1.0) and m.max_rel == pytest.approx(0.5)
    assert m.status == "mismatch"


def test_first_nan_is_its_own_status_with_its_position():
    ref = torch.zeros(2, 3)
    ours = ref.clone()
    ours[1, 2] = math.nan
    m = tensor_metrics(ours, ref, 1e-4, 1e-4)
    assert m.status == "nonfinite" and "(1, 2) (ours)" in m.detail
    assert m.max_abs == math.inf and math.isnan(m.cosine)  # never reads as a match


def test_tolerance_resolution_order():
    assert tolerance_for("lm_head", torch.bfloat16) == DEFAULT_TOLERANCES[torch.bfloat16]
    assert tolerance_for("lm_head", torch.float32, atol=1e-2) == (1e-2, DEFAULT_TOLERANCES[torch.float32][1])
    per = {"model.layers.*.self_attn.probs": (0.5, 0.0)}
    assert tolerance_for("model.layers.3.self_attn.probs", torch.float32, 1e-2, 1e-2, per) == (0.5, 0.0)


def test_compare_traces_follows_reference_order_and_flags_missing_and_shape():
    nodes = [NodeSpec("b", "b"), NodeSpec("a", "a"), NodeSpec("c", "c"), NodeSpec("d", "d")]
    ref, ours = Trace(), Trace()
    for name in ["a", "b", "c"]:  # reference executes a, b, c; never produces d
        ref.add(name, torch.ones(2))
    ours.add("a", torch.ones(2))
    ours.add("b", torch.ones(3))
    results = compare_traces(ours, ref, nodes, Tolerances(torch.float32))
    assert [(r.name, r.status) for r in results] == [("a", "ok"), ("b", "shape"), ("c", "missing"), ("d", "missing")]
    assert first_mismatch(results).name == "b"
    assert first_mismatch(results[:1]) is None


def test_a_node_the_reference_never_produced_is_placed_inside_its_own_block():
    """A Mamba's conv1d whose weight the reference reads in a function (the module never runs) is listed with
    its mixer, before the mixer's first node, not after the MLP the layer's module list declares before it."""
    names = ["l0.mlp.up", "l0.mlp.down", "l0.mamba.conv1d", "l0.mamba.in_proj", "l0.mamba.out_proj", "l1.norm"]
    ref, ours = Trace(), Trace()
    for name in ["l0.mamba.in_proj", "l0.mamba.out_proj", "l0.mlp.up", "l0.mlp.down", "l1.norm"]:
        ref.add(name, torch.ones(2))  # execution order: the mixer, then the MLP
        ours.add(name, torch.ones(2))
    results = compare_traces(ours, ref, [NodeSpec(n, n) for n in names], Tolerances(torch.float32))
    assert [r.name for r in results] == [
        "l0.mamba.conv1d", "l0.mamba.in_proj", "l0.mamba.out_proj", "l0.mlp.up", "l0.mlp.down", "l1.norm"
    ]  # fmt: skip


def test_scores_masked_on_both_sides_with_different_fills_agree():
    """Scores recorded after the causal mask on both sides, one filled with float32's lowest (a port cast to
    float32), the other with float64's (the reference's float64 run) or -inf: the positions both mask agree, a
    position only one side masks still fails, as does a real score off."""
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    scores = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = Trace()
    ref.add("a.scores", scores.masked_fill(causal, torch.finfo(torch.float64).min))
    spec = [NodeSpec("a.scores", "a.scores", kind="scores")]

    def judged(ours: torch.Tensor) -> str:
        trace = Trace()
        trace.add("a.scores", ours)
        return compare_traces(trace, ref, spec, Tolerances(torch.float32))[0].status

    ours = scores.float()
    assert judged(ours.masked_fill(causal, torch.finfo(torch.float32).min)) == "ok"
    assert judged(ours.masked_fill(causal, float("-inf"))) == "ok"
    assert judged(ours.masked_fill(causal.triu(2), torch.finfo(torch.float32).min)) == "mismatch"  # a key unmasked
    off = ours.masked_fill(causal, torch.finfo(torch.float32).min)
    off[0, 0, 3, 0] += 1.0
    assert judged(off) == "mismatch"
