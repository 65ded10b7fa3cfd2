"""The hints added with linear attention, on synthetic traces: each names its pattern, and stays
silent on the patterns other detectors own (no hint is better than a wrong one). Also the hints of
a decode check's calls continuing a linear-attention layer's cache (``stepN/`` nodes, N > 0): the
conv's cached inputs, the recurrent state not carried, padding in a continued chunk."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.nn import functional as F

from parity.compare.results import compare_traces, first_mismatch
from parity.compare.tolerances import Tolerances
from parity.diagnose.detectors import diagnose
from parity.diagnose.elementwise import activation
from parity.diagnose.evidence import Evidence
from parity.model.facts import FULL, LINEAR, ArchFacts, LayerFacts
from parity.model.pair import NodeSpec, annotate
from parity.record.trace import Trace
from reference_pairs.common.linear_attention import l2norm, recurrent_gated_delta_rule

FACTS = ArchFacts(
    model_type="synthetic",
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=4,
    chunk_size=8,
    layers=tuple(LayerFacts(i, t, None, None, 4, 2, 0.5) for i, t in enumerate((LINEAR, FULL))),
)
GEN = torch.Generator().manual_seed(0)


#: the same with a short conv of kernel 4 (a call continuing a cache reads the previous call's last 3 inputs)
CONV_FACTS = replace(FACTS, conv_kernel=4)


def hint(
    ours: dict,
    ref: dict,
    batch: int = 2,
    seq: int = 12,
    facts: ArchFacts = FACTS,
    attention_mask=None,
    kinds: dict | None = None,
):
    """The hint of the first failing node; ``ours``/``ref``: node name -> tensor, in execution order;
    ``kinds``: node name -> kind where the name does not say it (a decode check's cache parts)."""
    nodes = annotate([NodeSpec(name, name, kind=(kinds or {}).get(name, "")) for name in ref], facts)
    t_ours, t_ref = Trace(), Trace()
    for name in ref:
        t_ref.add(name, ref[name])
        t_ours.add(name, ours.get(name, ref[name]))
    results = compare_traces(t_ours, t_ref, nodes, Tolerances(torch.float32, exact=True))
    bad = first_mismatch(results)
    positions = torch.arange(seq).expand(batch, seq)
    return diagnose(bad, t_ours, t_ref, facts, positions, attention_mask)


def test_a_shifted_sequence_is_named_with_its_shift():
    x = torch.randn(2, 12, 6, generator=GEN)
    ours = torch.cat([x[:, 3:], torch.zeros(2, 3, 6)], dim=1)  # ours[t] = ref[t + 3]
    h = hint({"model.layers.0.linear_attn.conv_out": ours}, {"model.layers.0.linear_attn.conv_out": x})
    assert h.kind == "sequence_shift" and h.evidence["shift"] == 3


def test_no_shift_is_read_into_a_node_without_a_sequence_axis():
    state = torch.randn(2, 2, 12, 4, generator=GEN)  # (batch, heads, d_k, d_v): axis 2 is not the sequence
    ours = torch.cat([state[:, 1:], state[:, :1]], dim=1)  # heads rotated: ours[h] = ref[h + 1]
    h = hint(
        {"model.layers.0.linear_attn.recurrent_state": ours}, {"model.layers.0.linear_attn.recurrent_state": state}
    )
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
        "ours": "softplus",
        "reference": "sigmoid",
        "input": "model.layers.0.linear_attn.in_proj_b",
    }


def test_an_affine_change_is_not_an_activation():
    b = torch.randn(2, 12, 3, generator=GEN)
    h = hint(
        {"model.layers.0.linear_attn.beta": torch.sigmoid(b) + 0.25},
        {"model.layers.0.linear_attn.beta": torch.sigmoid(b)},
    )
    assert h is None or h.kind != "activation"


# --- calls continuing a linear-attention layer's cache (decode checks) ------------------------------


def test_only_the_first_kernel_minus_one_positions_of_a_continued_call_are_the_conv_state():
    x = torch.randn(2, 6, 8, generator=GEN)
    ours = x.clone()
    ours[:, :3] += 0.1  # the outputs whose window reaches into the previous call's inputs
    h = hint(
        {"step2/model.layers.0.linear_attn.conv_out": ours},
        {"step2/model.layers.0.linear_attn.conv_out": x},
        seq=6,
        facts=CONV_FACTS,
    )
    assert h.kind == "conv_state" and h.evidence == {"conv_kernel": 4, "positions": [0, 1, 2], "step": 2}
    # the first call of a sequence has no cached inputs; an error reaching position 3 is not the cache's
    for name, bad in (
        ("step0/model.layers.0.linear_attn.conv_out", 3),
        ("step2/model.layers.0.linear_attn.conv_out", 4),
    ):
        ours = x.clone()
        ours[:, :bad] += 0.1
        h = hint({name: ours}, {name: x}, seq=6, facts=CONV_FACTS)
        assert h is None or h.kind != "conv_state", (name, h)
    # nor on a full-attention layer's node
    ours = x.clone()
    ours[:, :3] += 0.1
    h = hint(
        {"step2/model.layers.1.self_attn.o_proj": ours},
        {"step2/model.layers.1.self_attn.o_proj": x},
        seq=6,
        facts=CONV_FACTS,
    )
    assert h is None or h.kind != "conv_state"


def test_a_cached_conv_state_shifted_or_never_stored_is_named():
    name, kinds = (
        "step0/model.layers.0.linear_attn.cache.conv_state",
        {"step0/model.layers.0.linear_attn.cache.conv_state": "cache.conv_state"},
    )
    ref = torch.randn(2, 8, 4, generator=GEN)  # (batch, channels, K)
    older = torch.cat(
        [torch.randn(2, 8, 1, generator=GEN), ref[..., :-1]], dim=-1
    )  # slot j holds the reference's j - 1
    h = hint({name: older}, {name: ref}, facts=CONV_FACTS, kinds=kinds)
    assert h.kind == "conv_state" and h.evidence == {"shift": 1, "held": 4} and "1 token older" in h.text
    newer = torch.cat([ref[..., 2:], torch.randn(2, 8, 2, generator=GEN)], dim=-1)
    h = hint({name: newer}, {name: ref}, facts=CONV_FACTS, kinds=kinds)
    assert h.kind == "conv_state" and h.evidence == {"shift": -2, "held": 4} and "2 tokens newer" in h.text
    h = hint({name: torch.zeros_like(ref)}, {name: ref}, facts=CONV_FACTS, kinds=kinds)
    assert h.kind == "conv_state" and h.evidence["shift"] is None and "never stored" in h.text
    h = hint({name: ref * 1.5}, {name: ref}, facts=CONV_FACTS, kinds=kinds)
    assert h is None or h.kind != "conv_state"


def test_a_recurrent_state_stored_as_zeros_is_not_carried():
    name = "step0/model.layers.0.linear_attn.cache.recurrent_state"
    ref = torch.randn(2, 2, 4, 4, generator=GEN)
    h = hint({name: torch.zeros_like(ref)}, {name: ref}, facts=CONV_FACTS, kinds={name: "cache.recurrent_state"})
    assert h.kind == "state_not_carried" and "never stored" in h.text
    h = hint({name: ref + 0.1}, {name: ref}, facts=CONV_FACTS, kinds={name: "cache.recurrent_state"})
    assert h is None or h.kind != "state_not_carried"


def _rule_inputs(b=2, s=5, h=2, d_k=4, d_v=4):
    """What the reference traces of one call: L2-normalised q, k ``(b, s, h, d_k)``, the conv output
    whose last ``h * d_v`` channels are v, g and beta ``(b, s, h)``."""
    q, k = (l2norm(torch.randn(b, s, h, d_k, generator=GEN)) for _ in range(2))
    mixed = torch.randn(b, s, 2 * h * d_k + h * d_v, generator=GEN)
    g, beta = -torch.rand(b, s, h, generator=GEN), torch.rand(b, s, h, generator=GEN)
    return q, k, mixed, g, beta


def _rule(q, k, mixed, g, beta, state):
    b, s, h, _ = q.shape
    v = mixed[..., -h * 4 :].reshape(b, s, h, 4)
    o, _ = recurrent_gated_delta_rule(
        *(t.transpose(1, 2) for t in (q, k, v)), g.transpose(1, 2), beta.transpose(1, 2), state
    )
    return o.transpose(1, 2)  # (b, s, h, d_v): the layout of delta_out


def test_a_continued_call_computed_from_a_zero_state_is_the_state_not_carried():
    q, k, mixed, g, beta = _rule_inputs()
    stem = "step1/model.layers.0.linear_attn"
    inputs = {
        f"{stem}.q_l2norm": q,
        f"{stem}.k_l2norm": k,
        f"{stem}.conv_out": mixed,
        f"{stem}.g": g,
        f"{stem}.beta": beta,
    }
    carried = _rule(q, k, mixed, g, beta, torch.randn(2, 2, 4, 4, generator=GEN))
    from_zero = _rule(q, k, mixed, g, beta, None)
    h = hint({f"{stem}.delta_out": from_zero}, {**inputs, f"{stem}.delta_out": carried}, seq=5, facts=CONV_FACTS)
    assert h.kind == "state_not_carried" and h.evidence["step"] == 1 and h.evidence["ours_vs_zero_start"] < 1e-6
    # another error in the same call is not a zero state; and a sequence's first call starts from zeros anyway
    h = hint({f"{stem}.delta_out": carried * 1.1}, {**inputs, f"{stem}.delta_out": carried}, seq=5, facts=CONV_FACTS)
    assert h is None or h.kind != "state_not_carried"
    first = {name.replace("step1/", "step0/"): t for name, t in inputs.items()}
    h = hint(
        {"step0/model.layers.0.linear_attn.delta_out": from_zero},
        {**first, "step0/model.layers.0.linear_attn.delta_out": carried},
        seq=5,
        facts=CONV_FACTS,
    )
    assert h is None or h.kind != "state_not_carried"


def test_only_padding_differing_in_a_continued_chunk_is_padding():
    x = torch.randn(2, 4, 6, generator=GEN)
    mask = torch.ones(2, 4, dtype=torch.long)
    mask[1, :2] = 0  # row 1 starts with two padding tokens
    ref = x.clone()
    ref[1, :2] = 0  # the reference zeroes its padding
    name = "step1/model.layers.0.linear_attn.in_proj_qkv"
    h = hint({name: x}, {name: ref}, seq=4, facts=CONV_FACTS, attention_mask=mask)
    assert h.kind == "padding" and h.evidence == {
        "batch_rows": [1],
        "positions": [0, 1],
        "reference_zero": True,
        "step": 1,
    }
    ours = x.clone()
    ours[0, 3] += 1.0  # a real token differs too: not (only) padding
    h = hint({name: ours}, {name: ref}, seq=4, facts=CONV_FACTS, attention_mask=mask)
    assert h is None or h.kind != "padding"
    h = hint({name: x}, {name: ref}, seq=4, facts=CONV_FACTS, attention_mask=None)  # no padding in the run
    assert h is None or h.kind != "padding"


def _rounding_evidence(atol: float | None, bend: float = 0.0):
    """F14 grown through a few layers, bf16: per channel ours and the reference are two roundings of
    one monotone function of the input (several ulps apart); ``bend`` adds a real curve (a tanh)."""
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(4, 16, 32, generator=gen)
    w = (1 + 0.1 * torch.randn(32, generator=gen)).bfloat16()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
    ref = normed.bfloat16() * w
    ours = (normed * w.float() * (1 + 3e-3) + bend * torch.tanh(3 * normed)).bfloat16()
    name = "model.layers.0.post_attention_layernorm@input"
    nodes = annotate([NodeSpec(name, name)], FACTS)
    t_ours, t_ref = Trace(), Trace()
    t_ours.add(name, ours)
    t_ref.add(name, ref)
    tol = Tolerances(torch.bfloat16, exact=True) if atol is None else Tolerances(torch.bfloat16, atol, 0.0)
    bad = compare_traces(t_ours, t_ref, nodes, tol)[0]
    return bad, Evidence(bad, ours, ref, t_ours, t_ref, FACTS)


def test_rounding_is_not_an_activation_under_any_tolerance():
    """Rounding is monotone too; a bend of a few ulps is noise, not another function (F14, F20). The
    same node with a bend well above the noise is still an activation."""
    for atol in (None, 5e-3, 1e-2):
        bad, e = _rounding_evidence(atol)
        assert bad.status == "mismatch" and bad.max_abs > 1e-2, (atol, bad)
        assert activation(e) is None, atol
    bad, e = _rounding_evidence(1e-2, bend=0.5)
    assert bad.status == "mismatch" and activation(e).kind == "activation"
