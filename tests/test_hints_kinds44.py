"""Hints the forty-fourth held-back set prompted, each read with the fault on ours and on the reference (the user
models that first showed them, ``tests/test_heldout44_faults.py``, run the fault on ours only): a cos/sin table
rounded to bfloat16, the Llama 4 query scale applied to the keys or taken at each token's index, top-k weights
renormalised before a routed scale, a q/k norm after RoPE read from its output, and a rotation whose candidates
rotate alike."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.evidence import Evidence
from parity.diagnose.moe import row_normalisation
from parity.diagnose.rope import rope_precision
from parity.diagnose.scales import position_scale
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
STEM = "model.layers.0.self_attn"
HEADS, KV, HEAD_DIM, SEQ = 4, 2, 16, 24
BETA, SPAN = 0.1, 8


def _facts():
    from transformers import Ministral3Config

    return derive_facts(
        Ministral3Config(
            vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV,
            head_dim=HEAD_DIM, intermediate_size=32, max_position_embeddings=256,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                             "original_max_position_embeddings": SPAN, "max_position_embeddings": 256,
                             "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": BETA},
        )
    )  # fmt: skip


def _evidence(name, faulty, correct, side, ref_trace=None, positions=None, mask=None, rope_input=None) -> Evidence:
    """The evidence at ``name`` with the faulty tensor on ``side`` and the correct one on the other."""
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    facts = _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ref_trace = ref_trace if ref_trace is not None else Trace()
    ref_trace.tensors[name] = ref
    return Evidence(
        result, ours, ref, Trace(tensors={name: ours}), ref_trace, facts, positions, mask, rope_input=rope_input
    )


def _rotated(x: torch.Tensor, positions: torch.Tensor, low: torch.dtype | None = None) -> torch.Tensor:
    """``x`` ``(batch, heads, seq, head_dim)`` rotated as Transformers does with this layer's YaRN RoPE (float32
    angles, cos/sin times its attention factor), the table rounded through ``low`` where given."""
    rope = _facts().layers[0].rope
    inv = torch.tensor(rope.inv_freq, dtype=torch.float32)
    angle = positions.float()[:, None, :, None] * inv
    angle = torch.cat((angle, angle), -1)
    cos, sin = angle.cos() * rope.attention_factor, angle.sin() * rope.attention_factor
    if low is not None:
        cos, sin = cos.to(low).float(), sin.to(low).float()
    half = torch.cat((-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]), -1)
    return x * cos + half * sin


def _llama4(positions: torch.Tensor) -> torch.Tensor:
    """The Llama 4 query scale by position ``(batch, 1, seq, 1)``."""
    return (1 + BETA * torch.log1p(torch.floor(positions.double() / SPAN)))[:, None, :, None].float()


@pytest.mark.parametrize("side", SIDES)
def test_a_rope_table_rounded_to_bfloat16(side):
    """Ministral 3's cos/sin (YaRN's attention factor inside) built or cached in bfloat16 and used with float32
    q: every position differs a little, position 0 too; the rounded table named on its side, up to the Llama 4
    query scale by position both sides apply after it."""
    positions = torch.arange(SEQ)[None]
    x = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    exact, low = (
        _rotated(x, positions) * _llama4(positions),
        _rotated(x, positions, torch.bfloat16) * _llama4(positions),
    )
    hint = rope_precision(_evidence(f"{STEM}.q_rot", low, exact, side, positions=positions, rope_input=x))
    assert hint is not None and hint.kind == "rope_precision", hint
    assert f"the RoPE's cos/sin table rounded to bfloat16 in {side}" in hint.text
    wrong = _rotated(x, positions) * 1.01  # another difference than the table's rounding
    assert rope_precision(_evidence(f"{STEM}.q_rot", wrong, exact, side, positions=positions, rope_input=x)) is None


@pytest.mark.parametrize("side", SIDES)
def test_the_llama4_query_scale_applied_to_the_keys(side):
    """The Llama 4 query scale by position multiplied into the keys as well: at k, one factor per position that is
    that scale, named on its side; a factor per position of another form says nothing here."""
    positions = torch.arange(SEQ)[None]
    k = torch.randn(1, KV, SEQ, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    hint = position_scale(_evidence(f"{STEM}.k_rot", k * _llama4(positions), k, side, positions=positions))
    assert hint is not None and hint.kind == "scale", hint
    assert f"applied to the keys as well in {side}" in hint.text
    other = 1 + 0.3 * positions[:, None, :, None].float() / SEQ
    assert position_scale(_evidence(f"{STEM}.k_rot", k * other, k, side, positions=positions)) is None


@pytest.mark.parametrize("side", SIDES)
def test_the_llama4_query_scale_at_each_tokens_index(side):
    """A left-padded row: the Llama 4 query scale taken at each token's index (arange(seq)) where the reference
    takes its position id; the padding positions not judged."""
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    index = torch.arange(SEQ)[None].expand(2, SEQ)
    q = torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    faulty, correct = q * _llama4(index), q * _llama4(positions)
    faulty[0, :, :5] = 7.0  # what a side computes at the padding is its own business
    hint = position_scale(_evidence(f"{STEM}.q_rot", faulty, correct, side, positions=positions, mask=mask))
    assert hint is not None and hint.kind == "scale", hint
    assert f"{side} applies the Llama 4 query scale at each token's index in its row (arange(seq))" in hint.text


@pytest.mark.parametrize("side", SIDES)
def test_top_k_weights_renormalised_before_a_routed_scale(side):
    """DeepSeek's routed_scaling_factor after the top-k weights: one side renormalises them first, so its rows sum
    to the scale (1.5), the other's to less; named with the scale the rows sum to."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(SEQ, 8, generator=g), -1).topk(3, -1).values
    scaled, renormalised = probs * 1.5, probs / probs.sum(-1, keepdim=True) * 1.5
    e = _evidence("model.layers.1.mlp.router.weights", renormalised, scaled, side)
    e = replace(e, facts=replace(e.facts, extra_constants={"the config's routed_scaling_factor (1.5)": 1.5}))
    hint = row_normalisation(e)
    assert hint is not None and hint.kind == "renormalisation", hint
    assert f"{side} sums to 1.5 (1 times a scale after it; matches the config's routed_scaling_factor (1.5))" in (
        hint.text
    )
