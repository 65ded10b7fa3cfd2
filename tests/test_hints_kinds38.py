"""Hints and readings the thirty-eighth held-back set prompted (``tests/test_heldout38_faults.py`` runs the user
models, faults on ours): a term of the sum a norm reads left out of it (a shared expert added after the post-MoE
norm), read with the fault on ours and on the reference, and not read as a norm placement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.evidence import Evidence
from parity.diagnose.norms import norm_order
from parity.diagnose.residual import input_source
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
SEQ, HIDDEN = 10, 32


def _facts():
    from transformers import LlamaConfig

    return derive_facts(
        LlamaConfig(
            vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
        )
    )


def _evidence(name, ours, ref, ours_trace, ref_trace) -> Evidence:
    facts = _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ours_trace.tensors[name], ref_trace.tensors[name] = ours, ref
    return Evidence(result, ours, ref, ours_trace, ref_trace, facts)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _norm(t: torch.Tensor) -> torch.Tensor:
    w = 1 + _randn(HIDDEN, seed=9)
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("side", SIDES)
def test_a_term_left_out_of_the_sum_a_norm_reads_is_named_with_the_branch(side):
    """Kolibri's post-MoE norm reads the routed and the shared experts' sum; a port adding the shared expert after the
    norm feeds it the routed part alone. Each side ran the shared expert (called, then dropped once compared), so
    the missing term is that branch's output, whichever side left it out; the router staying before the norm on
    both sides while the shared expert moved after it is no pre-norm/post-norm swap."""
    name = "model.layers.0.post_mlp_layernorm"
    routed, shared = _randn(1, SEQ, HIDDEN, seed=1), _randn(1, SEQ, HIDDEN, seed=2)
    ours_in, ref_in = (routed, routed + shared) if side == "ours" else (routed + shared, routed)
    ours_trace, ref_trace = Trace(), Trace()
    # the side at fault runs the norm before the shared expert
    before, after = (
        ["model.layers.0.mlp.shared_experts.down_proj", name],
        [name, "model.layers.0.mlp.shared_experts.down_proj"],
    )
    values = {"model.layers.0.mlp.gate": _randn(1, SEQ, 8, seed=3), name: _norm(ref_in)}
    values["model.layers.0.mlp.shared_experts.down_proj"] = shared
    for n in ["model.layers.0.mlp.gate", *(after if side == "the reference" else before)]:
        ref_trace.tensors[n] = values[n]
    for n in ["model.layers.0.mlp.gate", *(after if side == "ours" else before)]:
        ours_trace.calls[n] = 1  # the order ours ran them; their tensors dropped once compared
    ours_trace.inputs[name], ref_trace.inputs[name] = ours_in, ref_in
    e = _evidence(name, _norm(ours_in), _norm(ref_in), ours_trace, ref_trace)
    hint = input_source(e)
    assert hint is not None and hint.kind == "residual", hint
    whose, other = ("the reference's", "ours'") if side == "ours" else ("ours'", "the reference's")
    assert f"{whose} input to it is {other} plus model.layers.0.mlp.shared_experts.down_proj" in hint.text
    assert norm_order(e) is None


class Router(torch.nn.Module):
    """Kolibri's router: experts chosen by the top-k of the raw logits plus a correction bias (a buffer), weighted by
    the sigmoid of their logits; ``fault`` ranks ``sigmoid(logits) + bias`` instead (DeepSeek-V3's choice)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(8, HIDDEN, generator=g))
        self.register_buffer("e_score_correction_bias", torch.randn(8, generator=g))
        self.fault = False

    def forward(self, x):
        logits = x @ self.weight.T
        scores = torch.sigmoid(logits) if self.fault else logits
        chosen = torch.topk(scores + self.e_score_correction_bias, 2, dim=-1).indices
        return torch.zeros_like(logits).scatter(-1, chosen, torch.sigmoid(logits.gather(-1, chosen)))


def test_the_search_names_a_top_k_ranking_an_activation_of_the_logits():
    from parity.diagnose import one_change

    model = torch.nn.Sequential()
    model.add_module("router", Router())
    x = _randn(SEQ, HIDDEN, seed=4)
    with torch.no_grad():
        model.router.fault = True
        target = model(x)
        model.router.fault = False
        recorded = model(x)
    assert not torch.equal(target, recorded)
    close = lambda value: bool(torch.allclose(value, target, atol=1e-6))
    same = lambda value: bool(torch.allclose(value, recorded, atol=1e-6))
    found = one_change.search(model, "router", [one_change.Target("router", "router", close, same)], lambda: model(x))
    assert found is not None
    words = found[0][0].words
    assert "the top-k ranking sigmoid(scores) + router.e_score_correction_bias in place of scores" in words, words


class ShortConv(torch.nn.Module):
    """Qwen4-Exp's PLE short conv: depthwise, causal, dilated by the n-gram size (left-padded by (K - 1) * d); the
    fault runs it undilated on its K nearest steps."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, groups=HIDDEN, dilation=3, bias=False)
        self.fault = False

    def forward(self, x):
        h = x.transpose(1, 2)
        if self.fault:
            return F.conv1d(F.pad(h, (2, 0)), self.conv.weight, groups=HIDDEN).transpose(1, 2)
        return self.conv(F.pad(h, (6, 0))).transpose(1, 2)


def test_the_search_names_a_dilated_conv_run_undilated():
    from parity.diagnose import one_change

    model = torch.nn.Sequential()
    model.add_module("ple", ShortConv())
    x = _randn(1, SEQ, HIDDEN, seed=5)
    with torch.no_grad():
        model.ple.fault = True
        target = model(x)
        model.ple.fault = False
        recorded = model(x)
    close = lambda value: bool(torch.allclose(value, target, atol=1e-6))
    same = lambda value: bool(torch.allclose(value, recorded, atol=1e-6))
    found = one_change.search(model, "ple", [one_change.Target("ple", "ple", close, same)], lambda: model(x))
    assert found is not None and "the conv's dilation 1 in place of 3" in found[0][0].words, found
