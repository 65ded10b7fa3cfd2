"""First divergence, first mismatch and origin: where an error that fails downstream starts."""

from __future__ import annotations

import torch
from torch import nn

import parity
import parity.build
from reference_pairs.llama3 import FAMILY as LLAMA3
from reference_pairs.llama3.faults import FAULTS as LLAMA3_FAULTS
from reference_pairs.olmo3 import build_pair


def test_origin_names_the_node_where_a_downstream_failure_starts(tmp_path):
    """A norm weight off by 1e-4 (inside a loose tolerance) fails only at a tightly judged lm_head:
    chained names lm_head, the origin names the norm, whose own error stands far above rounding noise."""
    pair = build_pair("tiny")
    norm = pair.ours.blocks[0].post_attention_layernorm
    norm.weight = nn.Parameter(norm.weight.detach() * (1 + 1e-4), requires_grad=False)
    res = parity.check(pair, mode="both", atol=1e-2, rtol=1e-2, tolerances={"lm_head": (1e-6, 0.0)})
    assert res.first_mismatch.name == "lm_head"
    assert res.origin.name == "model.layers.0.post_attention_layernorm"
    assert "is where the error starts" in res.origin_reason and "lm_head" in res.origin_reason
    assert res.first_divergence.name == "model.layers.0.post_attention_layernorm"
    html = res.write_html(tmp_path / "r.html").read_text()
    assert 'id="origin"' in html and 'id="first-divergence"' in html
    data = parity.report.tables.result_dict(res)
    assert data["origin"]["name"] == res.origin.name and data["first_divergence"]["name"] == res.first_divergence.name


def test_compounded_rounding_has_no_origin_and_says_so():
    """F14 under fixed bf16 tolerances: every node's own error is a rounding; nothing stands out."""
    fault = next(f for f in LLAMA3_FAULTS if f.id == "F14")
    pair = parity.build.build_pair(LLAMA3, "tiny", dtype=torch.bfloat16)
    fault.inject(pair)
    res = parity.check(pair, mode="both", atol=5e-2, rtol=5e-2)
    assert res.first_mismatch is not None and res.origin is None
    assert "no node's own error stands out" in res.origin_reason
    assert res.first_divergence.name == "model.layers.0.input_layernorm"


def test_the_report_names_the_probe():
    res = parity.check(build_pair("tiny"))
    assert "parity.build.probes" in res.meta["probe"] and "16" in res.meta["probe"]
