"""Fault injection: a correct pair, one deliberate fault, and first_mismatch must name the right node."""

from __future__ import annotations

import types

import torch
from torch import nn

import parity
import reference_pairs.olmo3.model as olmo3_model
from reference_pairs.olmo3 import build_pair


def first_bad(pair) -> parity.NodeResult:
    res = parity.check(pair)
    assert res.first_mismatch is not None, "the fault went unnoticed"
    return res.first_mismatch


class PerHeadRMSNorm(nn.Module):
    """The classic mistake: normalise each head separately instead of the whole projection."""

    def __init__(self, whole: nn.Module, head_dim: int):
        super().__init__()
        self.weight, self.eps, self.head_dim = whole.weight, whole.eps, head_dim

    def forward(self, x):
        heads = x.float().unflatten(-1, (-1, self.head_dim))
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * heads.flatten(-2)).to(x.dtype)


def test_control_pair_is_clean():
    assert parity.check(build_pair("yarn")).passed


def test_q_norm_per_head_is_found_at_layer0_q_norm():
    pair = build_pair("tiny")
    att = pair.ours.blocks[0].att
    att.q_norm = PerHeadRMSNorm(att.q_norm, att.head_dim)
    assert first_bad(pair).name == "model.layers.0.self_attn.q_norm"


def test_dropped_yarn_attention_factor_is_found_at_first_yarn_q_rot(monkeypatch):
    pair = build_pair("yarn")
    correct = olmo3_model.rope_parameters

    def factor_dropped(cfg):
        return {t: p if p["rope_type"] != "yarn" else {**p, "attention_factor": 1.0} for t, p in correct(cfg).items()}

    monkeypatch.setattr(olmo3_model, "rope_parameters", factor_dropped)
    bad = first_bad(pair)
    first_yarn = pair.source.cfg["layer_types"].index("full_attention")
    assert bad.name == f"model.layers.{first_yarn}.self_attn.q_rot"
    assert bad.hint.kind == "rope_attention_factor" and "1.20794" in bad.hint.text


def test_pre_norm_block_is_found_at_that_layers_q_proj():
    pair = build_pair("tiny")

    def pre_norm(self, x, cos, sin, padding_mask=None, cache=None):
        x = x + self.att(self.post_attention_layernorm(x), cos, sin, padding_mask, cache)
        return x + self.ff(self.post_feedforward_layernorm(x))

    block = pair.ours.blocks[2]
    block.forward = types.MethodType(pre_norm, block)
    assert first_bad(pair).name == "model.layers.2.self_attn.q_proj"


def test_window_one_token_wider_is_found_at_first_sliding_probs():
    pair = build_pair("tiny")
    pair.ours.blocks[0].att.sliding_window += 1
    bad = first_bad(pair)
    assert bad.name == "model.layers.0.self_attn.probs"
    assert bad.hint.kind == "sliding_window"


def test_swapped_gate_and_up_is_found_at_that_layers_gate_proj():
    pair = build_pair("mha")
    ff = pair.ours.blocks[1].ff
    ff.fc1.weight, ff.fc2.weight = ff.fc2.weight, ff.fc1.weight
    bad = first_bad(pair)
    assert bad.name == "model.layers.1.mlp.gate_proj"
    assert bad.hint.kind == "swapped_weights" and bad.hint.evidence["matches"] == "model.layers.1.mlp.up_proj"


def test_every_node_after_a_late_fault_still_passes_before_it():
    """The nodes before the fault are all ok: first_mismatch is earliest, not merely some failure."""
    pair = build_pair("tiny")
    pair.ours.blocks[3].ff.fc3.weight.data = pair.ours.blocks[3].ff.fc3.weight.data.clone() * 1.01
    res = parity.check(pair)
    bad = res.first_mismatch
    assert bad.name == "model.layers.3.mlp.down_proj"
    assert all(n.passed for n in res.nodes[: bad.index])
    assert "1.01" in bad.hint.text


def test_missing_node_counts_as_failure():
    """A user's model without a module for a node: reported as missing, never as agreeing."""
    pair = build_pair("tiny")
    i = next(k for k, n in enumerate(pair.nodes) if n.name == "model.layers.1.self_attn.probs")
    pair.nodes[i] = parity.NodeSpec(pair.nodes[i].name, "blocks.1.att.no_such_tap")
    res = parity.check(pair)
    assert res.first_mismatch.name == "model.layers.1.self_attn.probs"
    assert res.first_mismatch.status == "missing"
