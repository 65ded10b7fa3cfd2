"""Hints and readings the thirty-ninth held-back set prompted (``tests/test_heldout39_faults.py`` runs the user
models, faults on ours), each read with the fault on ours and on the reference: a latent up-projection's per-head
``[k_nope | v]`` cut as two whole blocks; a sliding layer attended as the config's full layers (the layer pattern
read otherwise); the routing weights scaled by one factor on one side."""

from __future__ import annotations

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.evidence import Evidence
from parity.diagnose.latent import latent_split
from parity.diagnose.masks import window_pattern
from parity.diagnose.moe import experts_sum
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
SEQ = 10


def _evidence(name, ours, ref, facts, ref_trace=None, **extra) -> Evidence:
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ref_trace = ref_trace if ref_trace is not None else Trace()
    ref_trace.tensors[name] = ref
    return Evidence(result, ours, ref, Trace(tensors={name: ours}), ref_trace, facts, **extra)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("side", SIDES)
def test_a_latent_up_projection_cut_as_whole_blocks_is_named(side):
    """GLM-MoE-DSA's kv_b_proj holds each head's ``[k_nope (16) | v (12)]``; a loader cutting it as ``[all heads'
    k_nope | all heads' v]`` gives head h the output features ``[16h:16h + 16]`` as its k_nope (head 0 alike)."""
    from transformers import DeepseekV3Config

    facts = derive_facts(
        DeepseekV3Config(
            vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        )
    )  # fmt: skip
    heads, nope, rope, v = 4, 16, 8, 12
    kv = _randn(1, SEQ, heads * (nope + v), seed=1)  # kv_b_proj's output
    tail = _randn(1, 1, SEQ, rope, seed=2).expand(1, heads, SEQ, rope)  # the shared rotated key
    per_head = kv.reshape(1, SEQ, heads, nope + v)[..., :nope].transpose(1, 2)
    blocks = kv[..., : heads * nope].reshape(1, SEQ, heads, nope).transpose(1, 2)
    right, wrong = torch.cat([per_head, tail], -1), torch.cat([blocks, tail], -1)
    name = "model.layers.0.self_attn.k_rot"
    ours, ref = (wrong, right) if side == "ours" else (right, wrong)
    e = _evidence(name, ours, ref, facts, Trace(tensors={"model.layers.0.self_attn.kv_b_proj": kv}))
    hint = latent_split(e)
    assert hint is not None and hint.kind == "qkv_layout", hint
    assert f"kv_b_proj's output cut as whole blocks in {side}" in hint.text, hint
    assert "the per-head layout read as [all k_nope | all v]" in hint.text


def _probs(window: int | None) -> torch.Tensor:
    """Causal probabilities ``(1, 2, SEQ, SEQ)`` over the last ``window`` keys (every earlier key for None)."""
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    keep = (k <= q) & ((q - k < window) if window else torch.ones(SEQ, SEQ, dtype=torch.bool))
    scores = _randn(1, 2, SEQ, SEQ, seed=3).masked_fill(~keep, float("-inf"))
    return scores.softmax(-1)


@pytest.mark.parametrize("side", SIDES)
def test_a_sliding_layer_attended_as_the_configs_full_layers_names_the_layer_pattern(side):
    """Granite-MoE-SWA's layer 0 is sliding in ``config.layer_types``; a port rebuilding the pattern from its default
    rule makes it full. With a full layer in the config, the windowless side attends as those layers do."""
    from transformers import Qwen2Config

    facts = derive_facts(
        Qwen2Config(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True,
        )
    )  # fmt: skip
    windowed, full = _probs(4), _probs(None)
    ours, ref = (full, windowed) if side == "ours" else (windowed, full)
    hint = window_pattern(_evidence("model.layers.0.self_attn.probs", ours, ref, facts))
    assert hint is not None and hint.kind == "sliding_window", hint
    assert f"this is a sliding_attention layer in the config, and {side} attends as its full_attention" in hint.text
    # a window of another size is no layer pattern
    hint = window_pattern(_evidence("model.layers.0.self_attn.probs", _probs(5), windowed, facts))
    assert hint is not None and "layer pattern" not in hint.text, hint


@pytest.mark.parametrize("side", SIDES)
def test_routing_weights_scaled_by_one_factor_on_one_side_are_named_with_the_constant(side):
    """GLM-MoE-DSA's routed_scaling_factor (2.5) applied before the top-k renormalisation cancels: ours' weights are
    the reference's over 2.5 at every token (or, the fault on the reference, 2.5 times ours')."""
    from transformers import DeepseekV3Config

    facts = derive_facts(
        DeepseekV3Config(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        )
    )  # fmt: skip
    tokens, hidden, experts = 12, 16, 4
    chosen = torch.stack(
        [torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:2] for t in range(tokens)]
    )
    weights = 2.5 * _randn(tokens, 2, seed=4).softmax(-1)
    outputs = [_randn(tokens, hidden, seed=10 + x) for x in range(experts)]
    parts = torch.stack(outputs)[chosen, torch.arange(tokens)[:, None]]
    right, scaled = (weights[..., None] * parts).sum(1), (weights[..., None] / 2.5 * parts).sum(1)
    block = "model.layers.1.mlp"
    ref_trace = Trace(tensors={f"{block}.router.weights": weights, f"{block}.router.experts": chosen})
    ref_trace.tensors.update({f"{block}.experts.{x}": o for x, o in enumerate(outputs)})
    ref_weights = weights if side == "ours" else weights / 2.5
    ref_trace.tensors[f"{block}.router.weights"] = ref_weights
    ours, ref = (scaled, right) if side == "ours" else (right, scaled)
    hint = experts_sum(_evidence(f"{block}.experts", ours, ref, facts, ref_trace))
    assert hint is not None and hint.kind == "routing_weights", hint
    factor = "0.4" if side == "ours" else "2.5"
    assert f"the reference's weights times {factor} at every token; matches" in hint.text, hint
    assert "routed_scaling_factor (2.5)" in hint.text, hint
