"""Hints and readings the thirty-sixth held-back set prompted (``tests/test_heldout36_faults.py`` runs the user
models, faults on ours), each read here with the fault on ours and on the reference where the reading has a side: a
per-head vector tiled across its features, a norm reading the residual sum with a scaled branch, two unequal parts of
a split read in the other order, a MoE block's scaling factor between its experts and the node after it, a per-layer-
type RoPE whose NoPE type is marked None."""

from __future__ import annotations

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose import one_change
from parity.diagnose.evidence import Evidence
from parity.diagnose.moe import _factor_of
from parity.diagnose.residual import input_source
from parity.diagnose.scales import added_vector
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
HEADS, SEQ, HIDDEN = 4, 10, 32


def _facts():
    from transformers import LlamaConfig

    return derive_facts(
        LlamaConfig(
            vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2
        )
    )


def _evidence(name, faulty, correct, side, ours_trace=None, ref_trace=None) -> Evidence:
    """The evidence at ``name`` with the faulty tensor on ``side`` and the correct one on the other."""
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    facts = _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ours_trace = ours_trace if ours_trace is not None else Trace()
    ref_trace = ref_trace if ref_trace is not None else Trace()
    ours_trace.tensors[name], ref_trace.tensors[name] = ours, ref
    return Evidence(result, ours, ref, ours_trace, ref_trace, facts)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("side", SIDES)
def test_a_per_head_vector_tiled_across_the_features_is_named(side):
    """Beam's per-head gate bias folded into a projection's bias with ``repeat`` (feature j reads head j % heads)
    where each head's value belongs to its own features: one side's output is the other's plus that tiled vector."""
    per_head = torch.tensor([0.5, -1.0, 2.0, 0.25])
    product = _randn(1, SEQ, 128)
    tiled = product + per_head.repeat(128 // HEADS)
    hint = added_vector(_evidence("model.layers.0.self_attn.q_proj", tiled, product, side))
    assert hint is not None and hint.kind == "bias", hint
    assert "4 values tiled across its 128 features (feature j reads value j % 4)" in hint.text
    # a bias of one value per head broadcast over its own features is no tiling: the plain bias reading
    blocks = product + per_head.repeat_interleave(128 // HEADS)
    hint = added_vector(_evidence("model.layers.0.self_attn.q_proj", blocks, product, side))
    assert hint is not None and "tiled" not in hint.text


@pytest.mark.parametrize("side", SIDES)
def test_a_norm_reading_the_residual_sum_with_a_scaled_branch_is_named(side):
    """HyperCLOVA X's peri-norm applied to ``h + 0.4 * attn`` instead of ``attn``: the norm's input on one side is
    the stream entering the layer plus the other side's input times the residual multiplier."""
    stream, branch = _randn(1, SEQ, HIDDEN, seed=1), _randn(1, SEQ, HIDDEN, seed=2)
    summed = stream + 0.4 * branch
    name = "model.layers.0.post_attention_layernorm"
    ours_in, ref_in = (summed, branch) if side == "ours" else (branch, summed)
    ref_trace = Trace()
    ref_trace.tensors["model.layers.0.input_layernorm"] = _randn(1, SEQ, HIDDEN, seed=3)
    ref_trace.inputs["model.layers.0.input_layernorm"] = stream
    ours_trace = Trace()
    ours_trace.inputs[name], ref_trace.inputs[name] = ours_in, ref_in

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    faulty, correct = rms(summed), rms(branch)
    hint = input_source(_evidence(name, faulty, correct, side, ours_trace, ref_trace))
    assert hint is not None and hint.kind == "norm_placement", hint
    assert hint.evidence["side"] == side and abs(hint.evidence["branch"] - 0.4) < 1e-6, hint
    whose = "ours'" if side == "ours" else "the reference's"
    assert f"{whose} post_attention_layernorm normalises the sum after the residual add" in hint.text


def test_two_unequal_parts_of_a_split_read_in_the_other_order():
    """Mamba-2's in_proj output cut as ``[xBC | z | dt]`` where it is ``[z | xBC | dt]``: the change reads the first
    part's features after the second's, each part keeping its size (the search tries it on either side's code)."""
    x = torch.arange(2 * 11, dtype=torch.float64).reshape(2, 11)
    site = one_change.Site("split", "model.py", 1)
    changes = one_change._unequal_parts_reordered(site, (x, [3, 6, 2], -1), {}, torch.split(x, [3, 6, 2], -1))
    assert [c.words for c in changes] == [
        "parts 0 and 1 of this split (sizes 3 and 6) read in the other order from the fused tensor (part 1's 6 "
        "features first, each part keeping its size)",
        "parts 1 and 2 of this split (sizes 6 and 2) read in the other order from the fused tensor (part 2's 2 "
        "features first, each part keeping its size)",
    ]
    z, xbc, dt = changes[0].rewrite((x, [3, 6, 2], -1), {}, torch.split(x, [3, 6, 2], -1))
    assert torch.equal(z, x[:, 6:9]) and torch.equal(xbc, x[:, 0:6]) and torch.equal(dt, x[:, 9:])
    # parts of one size are the plain swap's, not this one's
    assert one_change._unequal_parts_reordered(site, (x[:, :8], [4, 4], -1), {}, torch.split(x[:, :8], 4, -1)) == []


def test_a_moe_blocks_scaling_factor_between_its_experts_and_the_next_node():
    """Beam's routed_scaling_factor multiplies the experts' sum inside the MoE block: the node after the block reads
    the experts' output times that factor, read back exactly (not an equality any more)."""
    experts = _randn(24, HIDDEN, seed=4).float()
    assert _factor_of(experts, experts.clone()) == 1.0
    assert abs(_factor_of(experts, experts * 1.7) - 1.7) < 1e-6
    assert _factor_of(experts, experts * 1.7 + 1e-3 * _randn(24, HIDDEN, seed=5).float()) is None


def test_a_per_layer_type_rope_with_a_nope_type_marked_none():
    """Beam's ``rope_parameters`` keyed by layer type, ``None`` for its NoPE full-attention layers: those layers have
    no RoPE in the facts, the sliding ones their own theta (read as one RoPE for every layer before)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "beam", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0}, "full_attention": None},
    )  # fmt: skip
    layers = derive_facts(config).layers
    assert layers[1].rope is None
    assert layers[0].rope is not None and layers[0].rope.theta == 500.0


def test_an_untapped_stretch_over_two_layers_names_the_first_layers_block():
    """Qwen4-Exp's MoE of layer 0 computed in functions, then layer 1's hyper-connection internals untapped too, the
    first judged node in layer 1 differing: the block named (and searched for one change) is layer 0, where the
    difference enters, not the layers' common container (``model.layers``, a ModuleList with no code of its own to
    change)."""
    from parity.compare.metrics import MISMATCH, OK, UNTAPPED
    from parity.compare.results import NodeResult
    from parity.run.stages import untapped_before

    facts = _facts()
    names = [
        ("model.layers.0.self_attn.o_proj", OK),
        ("model.layers.0.mlp.gate", UNTAPPED),
        ("model.layers.0.mlp", UNTAPPED),
        ("model.layers.1.attn_hyper_connection.input_mix", UNTAPPED),
        ("model.layers.1.input_layernorm", MISMATCH),
    ]
    results = [
        NodeResult(n, i, status, facts.locate(n)[0], facts.locate(n)[1], None, None, None, 0.0, 0.0, 0.0, 1.0, 0, 0)
        for i, (n, status) in enumerate(names)
    ]
    hint = untapped_before(results, results[-1], facts)
    assert hint is not None and hint.kind == "untapped_block", hint
    assert hint.evidence["block"] == "model.layers.0", hint.evidence  # was model.layers: both layers' container
