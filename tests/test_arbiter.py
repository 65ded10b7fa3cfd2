"""The logits as arbiter of a user's model's internal differences (``parity.compare.arbiter``): a gross difference
at an internal node while what the model returns agrees is a value parity misread, not a fault, and is not judged;
a small one, a user's own tap, or any difference while the logits differ stays a failure."""

from __future__ import annotations

import pytest

from parity.compare.arbiter import ARBITRATED, arbitrated_like, arbitrated_note, output_arbitrates
from parity.compare.metrics import MISMATCH, OK, SHAPE, UNTAPPED
from parity.compare.results import NodeResult, first_mismatch


def node(name: str, i: int, status: str, rel: float | None = None, shape=(1, 4, 8)) -> NodeResult:
    return NodeResult(
        name, i, status, 0, name.rsplit(".", 1)[-1], shape, shape, "float64",
        None if status == SHAPE else (rel or 0.0), 0.0, 0.0, 1.0, 1e-10, 0.0, rel_l2=rel,
    )  # fmt: skip


def run(internal: NodeResult, logits_status: str = OK, logits_rel: float = 1e-15) -> list[NodeResult]:
    return [
        node("model.layers.0.self_attn.q_proj", 0, OK, 0.0),
        internal,
        node("model.layers.0.mlp.down_proj", 2, OK, 0.0),
        node("logits", 3, logits_status, logits_rel),
    ]


@pytest.mark.parametrize(
    "internal",
    [
        node("model.layers.0.self_attn.q_rot", 1, SHAPE),  # read in another shape (RoPE as re/im projections)
        node("model.layers.0.self_attn.q_rot", 1, MISMATCH, 0.4),  # another product of the block read
    ],
    ids=["shape", "gross"],
)
def test_a_gross_internal_difference_while_the_logits_agree_is_not_judged(internal):
    out = output_arbitrates(run(internal))
    assert first_mismatch(out) is None
    assert out[1].status == UNTAPPED and out[1].detail.startswith(ARBITRATED)
    assert "tap the node with parity.tap" in out[1].detail
    assert arbitrated_note(out).startswith("1 node of ours differ") and "model.layers.0.self_attn.q_rot" in (
        arbitrated_note(out) or ""
    )


def test_a_small_internal_difference_stays_a_failure():
    """An eps or a cast: a real fault too small to cross the logits' tolerance is still reported."""
    small = node("model.layers.0.input_layernorm", 1, MISMATCH, 1e-5)
    assert first_mismatch(output_arbitrates(run(small))) is small


@pytest.mark.parametrize(("status", "rel"), [(MISMATCH, 0.2), (OK, 1e-3)], ids=["logits differ", "logits loose"])
def test_nothing_is_arbitrated_unless_the_logits_agree_closely(status, rel):
    gross = node("model.layers.0.self_attn.q_rot", 1, MISMATCH, 0.4)
    assert first_mismatch(output_arbitrates(run(gross, status, rel))) is gross


def test_a_users_own_tap_is_judged_as_declared():
    tapped = node("model.layers.0.self_attn.q_rot", 1, MISMATCH, 0.4)
    out = output_arbitrates(run(tapped), declared=frozenset({tapped.name}))
    assert first_mismatch(out) is tapped


def test_the_isolated_run_follows_the_chained_runs_arbitration():
    chained = output_arbitrates(run(node("model.layers.0.self_attn.q_rot", 1, SHAPE)))
    isolated = run(node("model.layers.0.self_attn.q_rot", 1, SHAPE))
    out = arbitrated_like(isolated, chained)
    assert first_mismatch(out) is None and out[1].detail == chained[1].detail
