"""The sensitivity audit (`parity selftest <family> --fields`): every declared config field, changed on
the reference side only, is seen at the node where it first acts, with its hint kind. A field the
probes cannot make observable fails here."""

from __future__ import annotations

import random

import pytest

from parity.cli import main
from parity.model.fields import draw_config, get_value, set_value
from parity.model.registry import families
from parity.selftest.fields import audit_field

AUDITED = [(name, f) for name, fam in sorted(families().items()) for f in fam.fields if f.audited]


@pytest.mark.parametrize("family, field", AUDITED, ids=[f"{n}-{f.key}-{f.config}" for n, f in AUDITED])
def test_every_field_is_seen_where_it_acts(family, field):
    row = audit_field(families()[family], field)
    assert row.passed, (row.found, row.hint_kind, row.problems, row.hint)


def test_every_family_declares_fields_and_audits_its_numbers():
    for name, fam in families().items():
        audited = {f.key for f in fam.fields if f.audited}
        drawn = {f.key for f in fam.fields if f.domain is not None}
        assert audited and drawn, f"{name} declares no fields"


def test_an_unseen_field_fails_the_audit():
    """A field whose change the probe cannot see (here: a value equal to the config's) is a failure, not a pass."""
    from dataclasses import replace

    fam = families()["llama3"]
    field = next(f for f in fam.fields if f.key == "rms_norm_eps")
    row = audit_field(fam, replace(field, changed=1e-5))  # the tiny config's own eps
    assert not row.passed and any("equals the config's" in p for p in row.problems)
    assert any("unseen" in p for p in row.problems)


def test_cli_selftest_fields_lists_each_field(capsys):
    assert main(["selftest", "tiny_aya", "--fields"]) == 0
    out = capsys.readouterr().out
    for key in ("layer_norm_eps", "sliding_window", "rope_base", "logit_scale"):
        assert key in out
    assert "model.layers.0.input_layernorm" in out and "norm_eps" in out and "failed" in out


def test_draw_and_dotted_keys():
    fam = families()["llama3"]
    cfg = draw_config(fam.fields, fam.configs["tiny"](None), random.Random(3))
    assert cfg["n_heads"] % cfg["n_kv_heads"] == 0
    assert get_value(set_value(cfg, "rope_freq", {"factor": 2.0}), "rope_freq.factor") == 2.0
