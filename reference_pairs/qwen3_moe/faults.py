"""Qwen3-MoE fault catalogue for ``parity selftest qwen3_moe``: the router, the top-k, the fused
expert split and the experts' order, and Qwen3's attention faults that a MoE pair must see too."""

from __future__ import annotations

import types

import torch
from torch import nn

from parity.selftest.faults import Fault

from ..common.faults import f07_repeat_kv
from ..common.moe import Experts

ATT = "model.layers.{}.self_attn"
MLP = "model.layers.{}.mlp"
NOT_RENORMALISED = (("norm_topk_prob", False),)


def _fused_split_swapped(layer):
    """A loader that reads ``gate_up_proj`` as up first, then gate: each expert's fc1 and fc2 trade halves."""

    def inject(pair):
        for expert in pair.ours.blocks[layer].ff.experts:
            expert.fc1.weight, expert.fc2.weight = expert.fc2.weight, expert.fc1.weight

    return inject


def _experts_reversed(layer):
    """A loader that assigns the experts of one layer in reverse order (ours' expert e holds expert E-1-e)."""

    def inject(pair):
        ff = pair.ours.blocks[layer].ff
        ff.experts = Experts(reversed(list(ff.experts)))

    return inject


def _not_renormalised(pair):
    for block in pair.ours.blocks:
        if hasattr(block.ff, "router"):
            block.ff.router.norm_topk_prob = False


def _softmax_over_top_k(pair):
    """Top-k on the logits, softmax over the chosen k only (Megatron's router), where the config says
    the weights are the probabilities over every expert (``norm_topk_prob`` false)."""

    def forward(self, logits):
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return self.weights(torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype)), self.experts(chosen)

    for block in pair.ours.blocks:
        if hasattr(block.ff, "router"):
            block.ff.router.forward = types.MethodType(forward, block.ff.router)


def _top_k_ascending(pair):
    """The chosen experts listed least probable first (a port's argsort or argpartition)."""
    for block in pair.ours.blocks:
        if hasattr(block.ff, "router"):
            router = block.ff.router

            def ascending(logits, _router=router):
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                weights, chosen = torch.topk(probs, _router.top_k, dim=-1)
                weights, chosen = weights.flip(-1), chosen.flip(-1)
                if _router.norm_topk_prob:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                return _router.weights(weights.to(logits.dtype)), _router.experts(chosen)

            router.forward = ascending


def _router_rows_reversed(layer):
    """A loader that reads the router's rows (one per expert) in reverse order."""

    def inject(pair):
        gate = pair.ours.blocks[layer].ff.gate
        gate.weight = nn.Parameter(gate.weight.detach().flip(0), requires_grad=False)

    return inject


FAULTS = (
    Fault(
        "fused-gate-up-swapped",
        "gate_up_proj split as up first, then gate (every expert of layer 0)",
        "tiny-moe",
        _fused_split_swapped(0),
        f"{MLP.format(0)}.experts.0",
        "swapped_weights",
        scope=f"{MLP.format(0)}.experts.*",
        source="ms-swift #7181",
    ),
    Fault(
        "experts-reversed",
        "the experts of layer 2 loaded in reverse order",
        "tiny-moe",
        _experts_reversed(2),
        f"{MLP.format(2)}.experts.0",
        "expert_mapping",
        scope=f"{MLP.format(2)}.experts.*",
    ),
    Fault(
        "top-k-not-renormalised",
        "top-k weights left as probabilities although norm_topk_prob is true",
        "tiny-moe",
        _not_renormalised,
        f"{MLP.format(0)}.router.weights",
        "renormalisation",
        scope=f"{MLP.format('*')}.router.weights",
        source="torchtitan #1448",
    ),
    Fault(
        "softmax-over-top-k",
        "softmax over the top-k logits only (renormalised) although norm_topk_prob is false",
        "tiny-moe",
        _softmax_over_top_k,
        f"{MLP.format(0)}.router.weights",
        "renormalisation",
        scope=f"{MLP.format('*')}.router.weights",
        source="QwenLM/Qwen3 #687",
        overrides=NOT_RENORMALISED,
    ),
    Fault(
        "top-k-ascending",
        "the chosen experts listed least probable first",
        "tiny-moe",
        _top_k_ascending,
        f"{MLP.format(0)}.router.experts",
        "routing",
        scope=f"{MLP.format('*')}.router.*",
    ),
    Fault(
        "router-rows-reversed",
        "the router's rows (one per expert) of layer 0 loaded in reverse order",
        "tiny-moe",
        _router_rows_reversed(0),
        f"{MLP.format(0)}.gate",
        "weight_permutation",
    ),
    f07_repeat_kv(ATT, "tiny-moe"),
)
