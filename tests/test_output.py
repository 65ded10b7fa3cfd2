"""What a person reads in a terminal: node names kept whole at 80 columns, plain text in `parity list`,
hints that show only the evidence that applies to the node."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console
from torch import nn

import parity
from parity.cli import _node_table, main, selftest_output
from parity.model.registry import get_family
from parity.selftest.run import SelftestRow
from reference_pairs.olmo3 import build_pair


def rendered(renderables, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), force_terminal=False)
    for r in renderables:
        console.print(r, highlight=False)
    return console.file.getvalue()


def assert_names_whole(text: str, names, width: int) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text
    words = {w for line in lines for w in re.split(r"[\s│┃]+", line)}
    missing = [n for n in names if n not in words]
    assert not missing, missing


@pytest.mark.parametrize("width", [80, 100, 140])
@pytest.mark.parametrize("mode", ["chained", "both"])
def test_node_table_keeps_every_name_whole(fault, mode, width):
    result = fault if mode == "chained" else parity.check(_faulty_pair(), mode="both")
    console = Console(width=width, file=io.StringIO(), force_terminal=False)
    text = rendered([_node_table(result, console)], width)
    assert_names_whole(text, [n.name for n in result.nodes], width)
    assert "status" in text and "max_abs" in text  # the columns that stay


def _faulty_pair():
    pair = build_pair("tiny")
    pair.ours.blocks[0].att.sliding_window += 1
    return pair


@pytest.mark.parametrize("width", [80, 140, 220])
def test_selftest_output_keeps_every_name_whole(width):
    family = get_family("llama3")
    rows = [
        SelftestRow(
            f,
            f.expected if i else "model.layers.1.self_attn.k_proj",
            f.isolated_expected,
            [],
            "likely swapped or misassigned weights: ours matches the reference's model.layers.0.mlp.up_proj instead",
            f.hint,
            [] if i else ["chained: expected x"],
        )
        for i, f in enumerate(family.faults)
    ]
    text = rendered(selftest_output(family, rows, Console(width=width, file=io.StringIO())), width)
    names = {f.expected for f in family.faults} | {"model.layers.1.self_attn.k_proj"} | {f.id for f in family.faults}
    assert_names_whole(text, names, width)
    assert "transformers #31788" in " ".join(text.split())


def test_parity_list_shows_plain_text(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "`" not in out and ":func:" not in out
    assert "n_layers default 2" in " ".join(out.split())


def _replace(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)


def test_a_permutation_on_an_mlp_node_shows_no_head_evidence():
    pair = build_pair("tiny")
    up = pair.ours.blocks[0].ff.fc2
    perm = torch.arange(up.weight.shape[0]).roll(8)  # crosses every 8-wide block, which an MLP does not have
    _replace(up, up.weight.detach()[perm])
    bad = parity.check(pair).first_mismatch
    assert bad.name == "model.layers.0.mlp.up_proj" and bad.hint.kind == "weight_permutation"
    assert "head" not in bad.hint.text and "crosses_heads" not in bad.hint.evidence


def test_a_permutation_on_a_head_node_says_whether_it_crosses_heads():
    pair = build_pair("tiny")
    v = pair.ours.blocks[0].att.W_value
    perm = torch.arange(v.weight.shape[0]).roll(3)
    _replace(v, v.weight.detach()[perm])
    bad = parity.check(pair).first_mismatch
    assert bad.name == "model.layers.0.self_attn.v_proj" and bad.hint.kind == "weight_permutation"
    assert bad.hint.evidence["crosses_heads"] > 0 and "cross head boundaries" in bad.hint.text
