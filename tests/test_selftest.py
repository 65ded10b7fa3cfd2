"""`parity selftest`: every fault of every family's catalogue is located, chained and isolated, with its hint class."""

from __future__ import annotations

import dataclasses

import pytest

from parity.cli import main
from parity.model.registry import families, get_family
from parity.selftest.run import run_fault

CASES = [(name, fault) for name, fam in families().items() for fault in fam.faults]


def test_every_family_has_a_catalogue_with_the_handed_cases():
    ids = {name: {f.id for f in fam.faults} for name, fam in families().items()}
    assert {"F03", "F04", "F06", "F07", "F10"} <= ids["olmo3"]
    assert {"F01", "F05", "F07", "F10"} <= ids["tiny_aya"]
    assert {"F02", "F07", "F08", "F10"} <= ids["llama3"]
    assert {
        "state-not-carried",
        "conv-state-not-carried",
        "conv-state-oldest-inputs",
        "conv-state-kept-one-early",
        "recurrent-state-not-stored",
        "chunk-padding-leaks",
    } <= ids["qwen3_5"]  # the DeltaNet cache in decode


@pytest.mark.parametrize("family, fault", CASES, ids=[f"{n}-{f.id}" for n, f in CASES])
def test_fault_is_located_chained_and_isolated_with_its_hint(family, fault):
    row = run_fault(get_family(family), fault)
    assert row.passed, row.problems
    if {"decode", "backward"} & set(dict(fault.check_kwargs)):
        return  # a KV-cache run and a training check are chained only: the step or gradient node is the location
    # isolated mode pins the fault: something fails, and only inside the fault's scope
    assert row.isolated_failing and row.isolated == fault.isolated_expected


def test_selftest_command_passes_and_reports_each_fault(capsys):
    assert main(["selftest", "llama3"]) == 0
    out = capsys.readouterr().out
    n = len(families()["llama3"].faults)
    assert f"{n} passed, 0 failed" in out and "F08" in out and "transformers #31788" in out


def test_selftest_fails_when_a_fault_is_mislocated(monkeypatch, capsys):
    """A catalogue entry expecting the wrong node must turn the selftest red (exit 1)."""
    fam = get_family("olmo3")
    wrong = dataclasses.replace(fam.faults[0], expected="model.layers.1.self_attn.q_norm")
    monkeypatch.setattr("parity.model.registry.get_family", lambda name: dataclasses.replace(fam, faults=(wrong,)))
    assert main(["selftest", "olmo3"]) == 1
    assert (
        "chained: expected model.layers.1.self_attn.q_norm, found model.layers.0.self_attn.q_norm"
        in capsys.readouterr().out
    )
