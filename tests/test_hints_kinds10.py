"""Hints the tenth held-back set prompted, each read with the fault on ours and on the reference (the
user models that first showed them, ``tests/test_heldout10_faults.py``, run the fault on ours only):
a causal mask that hides each query's own key, a padding mask built for right padding, a padding mask
laid along the queries, attention rows moved by a (queries, heads) flattening viewed back the other
way, a shared key head expanded with ``repeat_interleave`` over its features, an activation with no
node of its own computed in float16, and values taken through the block's key norm when q/k/v come
from one fused per-head projection."""

from __future__ import annotations

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.elementwise import precision
from parity.diagnose.evidence import Evidence
from parity.diagnose.masks import future_keys, masked_keys
from parity.diagnose.wiring import attention_rows_moved, last_dim_permutation, values_source
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
STEM = "model.layers.0.self_attn"
NEG = torch.finfo(torch.float32).min


def _facts(**kw):
    from transformers import PersimmonConfig

    config = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128)
    return derive_facts(PersimmonConfig(**{**config, **kw}))


def _evidence(name, faulty, correct, side, ours_trace=None, ref_trace=None, mask=None, facts=None) -> Evidence:
    """The evidence at ``name`` with the faulty tensor on ``side`` and the correct one on the other."""
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    facts = facts or _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ref_trace = ref_trace if ref_trace is not None else Trace(tensors={name: ref})
    return Evidence(result, ours, ref, ours_trace or Trace(tensors={name: ours}), ref_trace, facts, None, mask)


def _softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(~allowed, NEG), dim=-1)


def _scores(b=2, h=4, t=10, seed=0) -> torch.Tensor:
    return torch.randn(b, h, t, t, generator=torch.Generator().manual_seed(seed))


CAUSAL = torch.ones(10, 10, dtype=torch.bool).tril()


@pytest.mark.parametrize("side", SIDES)
def test_a_causal_mask_that_hides_each_querys_own_key(side):
    """``k < q`` where ``k <= q`` is meant: from the second query on the key at the query's own position
    gets no weight, the first query (no key left) spreads its weight evenly. Once read as "a mask that
    hides every key of some queries"."""
    s = _scores()
    correct = _softmax(s, CAUSAL)
    faulty = _softmax(s, CAUSAL.tril(-1))
    hint = future_keys(_evidence(f"{STEM}.probs", faulty, correct, side))
    assert hint is not None and hint.kind == "causal_mask", hint
    assert f"the causal mask in {side} hides each query's own key" in hint.text, hint
    assert hint.evidence["side"] == side


LEFT = torch.ones(2, 10, dtype=torch.long)
LEFT[0, :3] = 0  # three pads on the left of row 0


def _padded(allowed_keys: torch.Tensor, queries_masked: bool = False) -> torch.Tensor:
    """Probabilities over ``_scores()`` with the causal mask and ``allowed_keys`` ``(batch, keys)``; with
    ``queries_masked`` the padding mask laid along the queries instead (the padding queries' rows)."""
    real = LEFT.bool()
    if queries_masked:
        allowed = CAUSAL[None, None] & real[:, None, :, None]
    else:
        allowed = CAUSAL[None, None] & allowed_keys[:, None, None, :] & real[:, None, :, None]
    return _softmax(_scores(), allowed)


@pytest.mark.parametrize("side", SIDES)
def test_a_padding_mask_built_for_right_padding(side):
    """The mask rebuilt from lengths as if the padding were on the right: each padded row masks its last
    keys, as many as it has padding, and sees its real padding. Once named as "not applied" first."""
    correct = _padded(LEFT.bool())
    right = torch.ones(2, 10, dtype=torch.bool)
    right[0, -3:] = False
    hint = masked_keys(_evidence(f"{STEM}.probs", _padded(right), correct, side, mask=LEFT))
    assert hint is not None and hint.kind == "padding", hint
    assert f"the padding mask in {side}" in hint.text and "built for right padding" in hint.text, hint


@pytest.mark.parametrize("side", SIDES)
def test_a_padding_mask_laid_along_the_queries_is_told_from_one_not_applied(side):
    """Broadcast as ``(batch, 1, seq, 1)``: the padding queries' rows are masked whole, as the other side's
    are, while the real queries see the padding keys. A mask not applied at all leaves those rows a
    plain causal softmax: named as not applied."""
    correct = _padded(LEFT.bool())
    traces = {"ours_trace": Trace(tensors={f"{STEM}.scores": _scores()}), "ref_trace": Trace(tensors={})}
    if side != "ours":
        traces = {"ours_trace": Trace(tensors={}), "ref_trace": traces["ours_trace"]}
    for faulty, says in (
        (_padded(LEFT.bool(), True), "the mask laid along the queries instead of the keys"),
        (_softmax(_scores(), CAUSAL[None, None].expand(2, 4, 10, 10)), "the mask not applied"),
    ):
        hint = masked_keys(_evidence(f"{STEM}.probs", faulty, correct, side, mask=LEFT, **traces))
        assert hint is not None and hint.kind == "padding", hint
        assert says in hint.text and ("not applied" in says) == ("not applied" in hint.text), hint


@pytest.mark.parametrize("side", SIDES)
def test_attention_rows_flattened_as_queries_by_heads_and_viewed_back_as_heads_by_queries(side):
    """StarCoder's multi-query trick: the queries flattened to (queries * heads) rows for one matmul
    against the shared keys, the scores viewed back as (heads, queries) instead of (queries, heads),
    then masked and normalised. Each row is the softmax of the other side's scores of another (head,
    query) pair, read against that side's unmasked scores."""
    s = _scores()
    b, h, t, _ = s.shape
    correct = _softmax(s, CAUSAL)
    flat = s.transpose(1, 2).reshape(b, t * h, t)  # rows ordered (query, head)
    faulty = _softmax(flat.view(b, h, t, t), CAUSAL)
    scores = Trace(tensors={f"{STEM}.scores": s, f"{STEM}.probs": correct})
    traces = {"ref_trace": scores} if side == "ours" else {"ours_trace": scores}
    hint = attention_rows_moved(_evidence(f"{STEM}.probs", faulty, correct, side, **traces))
    assert hint is not None and hint.kind == "head_mapping", hint
    assert f"the attention rows reshaped in {side}" in hint.text, hint
    assert "flattened as (queries, heads) rows for one matmul and viewed back as (heads, queries)" in hint.text
    assert attention_rows_moved(_evidence(f"{STEM}.probs", correct, correct, side, **traces)) is None


@pytest.mark.parametrize("side", SIDES)
def test_a_shared_key_head_expanded_over_its_features(side):
    """``k.repeat_interleave(heads, dim=-1).view(..., heads, head_dim)``: each feature of a head reads the
    shared head's feature ``j // heads``. Once read as "heads split wrongly in the reference"."""
    k = torch.randn(1, 1, 10, 16, generator=torch.Generator().manual_seed(1))
    faulty = k[..., torch.arange(16) // 4]
    hint = last_dim_permutation(_evidence(f"{STEM}.k_rot", faulty, k, side))
    assert hint is not None and hint.kind == "head_mapping", hint
    assert f"features gathered along the wrong axis in {side}" in hint.text, hint
    assert "repeat_interleave(4, dim=-1)" in hint.text and hint.evidence["repeats"] == 4, hint


@pytest.mark.parametrize("side", SIDES)
def test_an_activation_without_a_node_computed_in_float16(side):
    """Persimmon's squared ReLU computed in float16 between two projections (no module of its own): the
    down projection's input holds float16 numbers only."""
    x = torch.randn(1, 10, 128, generator=torch.Generator().manual_seed(2))
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) / 128**0.5
    correct_in = torch.relu(x) ** 2
    faulty_in = (torch.relu(x.half()) ** 2).float()
    name = "model.layers.0.mlp.dense_4h_to_h"
    inputs = {"ours": faulty_in, "the reference": correct_in} if side == "ours" else {
        "ours": correct_in, "the reference": faulty_in}  # fmt: skip
    e = _evidence(
        name,
        faulty_in @ w.T,
        correct_in @ w.T,
        side,
        ours_trace=Trace(inputs={name: inputs["ours"]}),
        ref_trace=Trace(inputs={name: inputs["the reference"]}),
    )
    hint = precision(e)
    assert hint is not None and hint.kind == "precision", hint
    assert f"float16 precision in {side}" in hint.text and "input" in hint.text, hint
    assert hint.evidence["at"] == "input", hint


@pytest.mark.parametrize("side", SIDES)
def test_values_through_the_key_norm_from_a_fused_per_head_projection(side):
    """Persimmon's ``k_layernorm`` applied to v too, where q/k/v come from one ``query_key_value`` laid
    per head ``(heads, 3, head_dim)``: the values are cut from the fused output in the layout whose
    values give the reference's own context, then normed as the candidate."""
    facts = _facts(qk_layernorm=True)
    g = torch.Generator().manual_seed(4)
    b, h, t, d = 1, 4, 10, 16
    fused = torch.randn(b, t, h * 3 * d, generator=g)
    v = fused.view(b, t, h, 3, d)[..., 2, :].transpose(1, 2)  # (b, h, t, d)
    probs = _softmax(torch.randn(b, h, t, t, generator=g), CAUSAL)
    w, bias = 1 + 0.5 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    normed = torch.nn.functional.layer_norm(v, (d,), w, bias, facts.norm_eps or 1e-5)
    merge = lambda c: c.transpose(1, 2).reshape(b, t, h * d)
    correct, faulty = merge(probs @ v), merge(probs @ normed)
    ours_ctx, ref_ctx = (faulty, correct) if side == "ours" else (correct, faulty)
    ref_trace = Trace(
        tensors={f"{STEM}.query_key_value": fused, f"{STEM}.probs": probs, f"{STEM}.context": ref_ctx},
        weights={f"{STEM}.k_layernorm": w},
        biases={f"{STEM}.k_layernorm": bias},
    )
    ours_trace = Trace(tensors={f"{STEM}.context": ours_ctx})
    e = _evidence(f"{STEM}.context", faulty, correct, side, ours_trace=ours_trace, ref_trace=ref_trace, facts=facts)
    hint = values_source(e)
    assert hint is not None and hint.kind == "swapped_roles", hint
    assert f"the values taken from another tensor in {side}" in hint.text, hint
    assert hint.evidence["values"] == "the values through k_layernorm", hint


@pytest.mark.parametrize("side", SIDES)
def test_rope_on_some_heads_only_is_named_with_the_heads_left_unrotated(side):
    """CodeGen's rotary dims cut from the merged (heads * head_dim) features before the split: head 0 turns,
    the others come out as q went in (the eleventh set; once read as a head permutation)."""
    from parity.diagnose.rope import heads_unrotated

    g = torch.Generator().manual_seed(5)
    b, h, t, d = 1, 4, 10, 16
    x = torch.randn(b, h, t, d, generator=g)
    angle = torch.arange(t, dtype=torch.float32)[None, None, :, None]
    rotated = torch.cat([x[..., ::2] * angle.cos() - x[..., 1::2] * angle.sin(), x[..., 1::2]], -1)
    faulty = torch.cat([rotated[:, :1], x[:, 1:]], 1)
    name = f"{STEM}.q_rot"
    q_proj = x.transpose(1, 2).reshape(b, t, h * d)
    ours, ref = (faulty, rotated) if side == "ours" else (rotated, faulty)
    facts = _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    e = Evidence(
        result, ours, ref, Trace(tensors={name: ours}), Trace(tensors={f"{STEM}.q_proj": q_proj, name: ref}), facts,
        torch.arange(t)[None],
    )  # fmt: skip
    hint = heads_unrotated(e)
    assert hint is not None and hint.kind == "rope_partial", hint
    assert f"RoPE applied to only some heads in {side}: head(s) 1, 2, 3 come out unrotated" in hint.text, hint
