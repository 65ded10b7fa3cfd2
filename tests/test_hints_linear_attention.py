"""The hints added with linear attention, on synthetic traces: each names its pattern, and stays
silent on the patterns other detectors own (no hint is better than a wrong one)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from parity.compare import Tolerances, compare_traces, first_mismatch
from parity.diagnose import diagnose
from parity.facts import FULL, LINEAR, ArchFacts, LayerFacts
from parity.pair import NodeSpec, annotate
from parity.trace import Trace

FACTS = ArchFacts(
    model_type="synthetic", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
    num_kv_heads=2, head_dim=4, chunk_size=8,
    layers=tuple(LayerFacts(i, t, None, None, 4, 2, 0.5) for i, t in enumerate((LINEAR, FULL))),
)
GEN = torch.Generator().manual_seed(0)


def hint(ours: dict, ref: dict, batch: int = 2, seq: int = 12):
    """The hint of the first failing node; ``ours``/``ref``: node name -> tensor, in execution order."""
    nodes = annotate([NodeSpec(name, name) for name in ref], FACTS)
    t_ours, t_ref = Trace(), Trace()
    for name in ref:
        t_ref.add(name, ref[name])
        t_ours.add(name, ours.get(name, ref[name]))
    results = compare_traces(t_ours, t_ref, nodes, Tolerances(torch.float32, exact=True))
    bad = first_mismatch(results)
    positions = torch.arange(seq).expand(batch, seq)
    return diagnose(bad, t_ours, t_ref, FACTS, positions, None)


def test_a_shifted_sequence_is_named_with_its_shift():
    x = torch.randn(2, 12, 6, generator=GEN)
    ours = torch.cat([x[:, 3:], torch.zeros(2, 3, 6)], dim=1)  # ours[t] = ref[t + 3]
    h = hint({"model.layers.0.linear_attn.conv_out": ours}, {"model.layers.0.linear_attn.conv_out": x})
    assert h.kind == "sequence_shift" and h.evidence["shift"] == 3


def test_no_shift_is_read_into_a_node_without_a_sequence_axis():
    state = torch.randn(2, 2, 12, 4, generator=GEN)  # (batch, heads, d_k, d_v): axis 2 is not the sequence
    ours = torch.cat([state[:, 1:], state[:, :1]], dim=1)  # heads rotated: ours[h] = ref[h + 1]
    h = hint({"model.layers.0.linear_attn.recurrent_state": ours}, {"model.layers.0.linear_attn.recurrent_state": state})
    assert h is None or h.kind != "sequence_shift"


def test_errors_from_a_chunk_boundary_on_are_the_carried_state():
    x = torch.randn(2, 12, 2, 4, generator=GEN)
    ours = x.clone()
    ours[:, 8:] += 0.1
    h = hint({"model.layers.0.linear_attn.delta_out": ours}, {"model.layers.0.linear_attn.delta_out": x})
    assert h.kind == "chunk_boundary" and h.evidence == {"chunk_size": 8, "first_bad_position": 8}
    ours = x.clone()
    ours[:, 7:] += 0.1  # starts inside a chunk: not the boundary
    h = hint({"model.layers.0.linear_attn.delta_out": ours}, {"model.layers.0.linear_attn.delta_out": x})
    assert h is None or h.kind != "chunk_boundary"


def test_a_missing_l2_norm_is_a_row_scale_naming_the_unit_side():
    raw = torch.randn(2, 12, 2, 4, generator=GEN)
    normed = raw / raw.norm(dim=-1, keepdim=True)
    h = hint({"model.layers.0.linear_attn.q_l2norm": raw}, {"model.layers.0.linear_attn.q_l2norm": normed})
    assert h.kind == "row_scale" and "reference's rows have unit L2 length" in h.text
    # a per-channel factor is not a row scale
    w = torch.linspace(0.5, 2.0, 4)
    h = hint({"model.layers.0.linear_attn.q_l2norm": normed * w}, {"model.layers.0.linear_attn.q_l2norm": normed})
    assert h.kind == "channel_scale"


def test_a_swapped_activation_is_named_from_its_input():
    b = torch.randn(2, 12, 3, generator=GEN) * 2
    ref = {"model.layers.0.linear_attn.in_proj_b": b, "model.layers.0.linear_attn.beta": torch.sigmoid(b)}
    h = hint({"model.layers.0.linear_attn.beta": F.softplus(b)}, ref)
    assert h.kind == "activation" and h.evidence == {
        "ours": "softplus", "reference": "sigmoid", "input": "model.layers.0.linear_attn.in_proj_b"}


def test_an_affine_change_is_not_an_activation():
    b = torch.randn(2, 12, 3, generator=GEN)
    h = hint({"model.layers.0.linear_attn.beta": torch.sigmoid(b) + 0.25}, {"model.layers.0.linear_attn.beta": torch.sigmoid(b)})
    assert h is None or h.kind != "activation"
