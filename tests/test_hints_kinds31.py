"""Hints the thirty-first held-back set prompted, each read with the fault on ours and on the reference (the user
models that first showed them, ``tests/test_heldout31_faults.py``, run the fault on ours only): chunked attention's
blocks counted with the padding, a query temperature by position, RoPE skipped at a layer (with a NoPE layer's
temperature), an L2 norm where an RMS norm was meant."""

from __future__ import annotations

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.evidence import Evidence
from parity.diagnose.masks import chunk_phase
from parity.diagnose.rope import rope_skipped
from parity.diagnose.scales import constant_ratio, position_scale
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
STEM = "model.layers.0.self_attn"
HEADS, HEAD_DIM, SEQ = 4, 8, 12


def _facts():
    from transformers import LlamaConfig

    return derive_facts(
        LlamaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2
        )
    )


def _evidence(name, faulty, correct, side, ref_trace=None, mask=None, positions=None) -> Evidence:
    """The evidence at ``name`` with the faulty tensor on ``side`` and the correct one on the other."""
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    facts = _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ref_trace = ref_trace if ref_trace is not None else Trace()
    ref_trace.tensors[name] = ref
    return Evidence(result, ours, ref, Trace(tensors={name: ours}), ref_trace, facts, positions, mask)


def _chunked(lead: torch.Tensor, block: int, from_real_start: bool) -> torch.Tensor:
    """Probabilities ``(batch, 1, seq, seq)`` of chunked causal attention (uniform over each query's keys), each
    row's blocks counted from its first real token or from index 0, padding keys masked."""
    i = torch.arange(SEQ)
    probs = []
    for n in lead.tolist():
        start = n if from_real_start else 0
        chunk = torch.div(i - start, block, rounding_mode="floor")
        seen = (i[None, :] <= i[:, None]) & (chunk[None, :] == chunk[:, None]) & (i[None, :] >= n)
        seen[:n] = i[None, :] == i[:n, None]  # padding queries: themselves (not judged)
        probs.append(seen.double() / seen.double().sum(-1, keepdim=True))
    return torch.stack(probs)[:, None]


@pytest.mark.parametrize("side", SIDES)
def test_chunked_attention_blocks_counted_with_the_padding(side):
    """Llama 4's chunks start at each row's first real token; a port counting them from the padded row's index 0
    sees other keys in a left-padded row (and the same ones in a full row)."""
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    lead = torch.tensor([3, 0])
    right, wrong = _chunked(lead, 4, True), _chunked(lead, 4, False)
    hint = chunk_phase(_evidence(f"{STEM}.probs", wrong, right, side, mask=mask))
    assert hint is not None and hint.kind == "padding", hint
    other = "the reference" if side == "ours" else "ours"
    assert hint.evidence == {"from_first_real_token": other, "block": 4}
    assert chunk_phase(_evidence(f"{STEM}.probs", right, right.clone(), side, mask=mask)) is None


def _q(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("side", SIDES)
def test_a_query_temperature_by_position(side):
    """One factor per position over every head and dim of q (Llama 4's attn_temperature_tuning on a NoPE layer)
    applied by one side only: a temperature by position, not a normalisation or RoPE frequencies."""
    positions = torch.arange(SEQ)[None]
    temperature = 1 + 0.5 * torch.log1p(torch.floor((positions + 1) / 4))
    q = _q()
    hint = position_scale(_evidence(f"{STEM}.q_rot", q * temperature[:, None, :, None], q, side, positions=positions))
    assert hint is not None and hint.kind == "scale" and "a query scale by position" in hint.text, hint
    assert position_scale(_evidence(f"{STEM}.q_rot", q * 2, q, side, positions=positions)) is None  # one factor


@pytest.mark.parametrize("side", SIDES)
def test_an_l2_norm_where_an_rms_norm_was_meant(side):
    """Llama 4's weight-free "L2Norm" is an RMS norm; F.normalize gives each head unit L2 length, sqrt(head_dim)
    smaller."""
    q = _q(1)
    rms = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    l2 = torch.nn.functional.normalize(q, dim=-1)
    hint = constant_ratio(_evidence(f"{STEM}.q_rot", l2, rms, side))
    assert hint is not None and hint.kind == "norm_kind", hint
    assert hint.evidence["unit_l2"] == side and "differ by sqrt(head_dim=8)" in hint.text


def _rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (theta 10000) of ``x`` ``(batch, heads, seq, head_dim)``."""
    inv = 10000.0 ** -(torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    angles = positions[0].double()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]], -1)
    return x * cos + half * sin


@pytest.mark.parametrize("side", SIDES)
def test_rope_skipped_at_a_layer_with_a_nope_temperature(side):
    """A layer pattern read inverted (Llama 4's no_rope_layers: 1 = RoPE): one side's q comes out unrotated and
    scaled by a temperature per position, the other's rotated."""
    positions = torch.arange(SEQ)[None]
    x = _q(2).double()
    trace = Trace(tensors={f"{STEM}.q_proj": x.transpose(1, 2).flatten(2)})
    temperature = 1 + 0.5 * torch.log1p(torch.floor((positions.double() + 1) / 4))
    skipped = x * temperature[:, None, :, None]
    hint = rope_skipped(_evidence(f"{STEM}.q_rot", skipped, _rotated(x, positions), side, trace, positions=positions))
    assert hint is not None and hint.kind == ("rope_missing" if side == "ours" else "rope_unexpected"), hint
    assert hint.evidence == {"side": side, "per_position_factor": True}
    assert f"RoPE skipped in {side} at this layer" in hint.text
