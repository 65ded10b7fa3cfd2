"""The handed cases (F12-F22 of the fault catalogue), each as it was handed in: the change, the run,
and the right answer. F12-F17 are also entries of the families' fault catalogues (so `parity
selftest` and tests/test_selftest.py check them chained and isolated); here they run as a user would
run them, with the default `parity.check`."""

from __future__ import annotations

import json
import re

import pytest
import torch

import parity
import parity.build
from parity.cli import main
from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.detectors import diagnose
from parity.model.pair import NodeSpec
from parity.model.registry import get_family
from parity.record.trace import Trace
from reference_pairs.llama3.faults import FAULTS as LLAMA3_FAULTS
from reference_pairs.olmo3 import build_pair as olmo3_pair
from reference_pairs.olmo3.faults import FAULTS as OLMO3_FAULTS
from reference_pairs.tiny_aya import build_pair as tiny_aya_pair

FULL = "full_attention"
HANDED = {f.id: f for f in (*LLAMA3_FAULTS, *OLMO3_FAULTS) if f.id in {"F12", "F13", "F14", "F15", "F16", "F17"}}


@pytest.mark.parametrize("case", sorted(HANDED))
def test_handed_fault_is_located_by_the_default_check(case):
    """F12-F17: the node and hint kind the case names, with `parity.check(pair)` as it comes."""
    fault = HANDED[case]
    family = get_family("llama3" if fault in LLAMA3_FAULTS else "olmo3")
    pair = parity.build.build_pair(family, config=fault.config, **dict(fault.overrides))
    fault.inject(pair)
    bad = parity.check(pair, **dict(fault.check_kwargs)).first_mismatch
    assert bad is not None and bad.name == fault.expected, bad
    assert bad.hint is not None and bad.hint.kind == fault.hint, bad.hint


def test_f14_is_invisible_to_fixed_bf16_tolerances_but_not_to_the_exact_default():
    """The fault is one ulp: a 5e-2 tolerance hides it, the bit-exact pair's default does not."""
    fault = HANDED["F14"]
    pair = parity.build.build_pair(get_family("llama3"), config="tiny", dtype=torch.bfloat16)
    fault.inject(pair)
    hidden = parity.check(pair, atol=5e-2, rtol=5e-2).first_mismatch
    assert hidden is None or hidden.name != "model.layers.0.input_layernorm"  # fixed tolerances hide the fault's node
    res = parity.check(pair)
    assert res.first_mismatch.name == "model.layers.0.input_layernorm" and res.first_mismatch.tol_source == "exact"
    assert res.first_divergence.name == "model.layers.0.input_layernorm"


def test_f14_under_a_user_tolerance_gets_no_activation_hint():
    """With atol 5e-2 the rounding fault first shows on the residual stream after attention, grown to a
    few ulps; rounding is monotone, but no activation sits there and the bend is noise (F20)."""
    fault = HANDED["F14"]
    pair = parity.build.build_pair(get_family("llama3"), config="tiny", dtype=torch.bfloat16)
    fault.inject(pair)
    bad = parity.check(pair, seq_len=16, atol=5e-2, rtol=0).first_mismatch
    assert bad is not None and bad.name == "model.layers.0.post_attention_layernorm@input", bad
    assert bad.hint is None or bad.hint.kind != "activation", bad.hint


def test_f18_yarn_with_a_factor_not_a_power_of_two_is_bit_identical():
    pair = olmo3_pair(
        config="tiny",
        n_layers=1,
        emb_dim=2,
        n_heads=1,
        n_kv_heads=1,
        head_dim=32,
        hidden_dim=16,
        vocab_size=64,
        rope_type="yarn",
        rope_scaled_layer_types=["sliding_attention"],
        rope_factor=12.0,
        rope_orig_max=64,
        rope_local_base=10000.0,
        rope_attention_factor=2.0,
        seed=8564,
    )
    res = parity.check(pair, seq_len=22, mode="both")
    assert res.passed and res.first_isolated_mismatch is None
    assert all(n.max_abs == 0 for n in res.nodes) and all(n.max_abs == 0 for n in res.isolated)
    bf16 = olmo3_pair(
        config="tiny",
        n_layers=1,
        emb_dim=2,
        n_heads=1,
        n_kv_heads=1,
        head_dim=32,
        hidden_dim=16,
        vocab_size=64,
        rope_type="yarn",
        rope_scaled_layer_types=["sliding_attention"],
        rope_factor=12.0,
        rope_orig_max=64,
        rope_local_base=10000.0,
        rope_attention_factor=2.0,
        seed=8564,
        dtype=torch.bfloat16,
    )
    assert all(n.max_abs == 0 for n in parity.check(bf16, seq_len=22).nodes)


def _near_noise_case(ratio: float, shape=(1, 8, 16)):
    ref = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = ref * ratio
    spec = NodeSpec("model.layers.0.mlp.down_proj", "x", layer=0, kind="down_proj")
    result = compare_node(spec, 0, ours, ref, Tolerances(torch.float32, 1e-5, 0.0))
    ours_t, ref_t = Trace(), Trace()
    ours_t.add(spec.name, ours)
    ref_t.add(spec.name, ref)
    return result, ours_t, ref_t


def test_f20_no_hint_from_noise_and_the_identity_is_never_a_permutation():
    facts = olmo3_pair("tiny").facts
    result, ours, ref = _near_noise_case(1.00013)  # the F18 drift: just past atol, a ratio of 1.00013
    assert result.status == "mismatch"
    hint = diagnose(result, ours, ref, facts)
    assert hint is None or hint.kind not in ("scale", "weight_permutation")
    identical, ours_i, ref_i = _near_noise_case(1.0)
    assert (
        diagnose(identical, ours_i, ref_i, facts) is None
        or diagnose(identical, ours_i, ref_i, facts).kind != "weight_permutation"
    )


@pytest.mark.parametrize("override", [dict(beta_fast=0.0), dict(beta_slow=0.0), dict(rope_factor=None)])
def test_f21_cfg_values_transformers_normalises_are_normalised_alike(override):
    """beta 0 means Transformers' default (32, 1); a missing factor is max / original positions."""
    pair = olmo3_pair(config="yarn", **override)
    key = next(iter(override))
    assert pair.source.cfg[key] == {"beta_fast": 32.0, "beta_slow": 1.0, "rope_factor": 65536 / 8192}[key]
    assert parity.check(pair).passed


def test_f21_a_zero_width_is_one_line_naming_the_field():
    with pytest.raises(parity.ConfigError, match="intermediate_size is 0; it must be at least 1"):
        olmo3_pair(config="yarn", hidden_dim=0)


def test_f21_cfg_dict_and_config_json_validate_alike(tmp_path):
    cfg = olmo3_pair("tiny").source.cfg
    bad = {**cfg, "hidden_dim": 0}
    with pytest.raises(parity.ConfigError) as from_dict:
        olmo3_pair(config=bad)
    config = olmo3_pair("tiny").reference.config.to_dict()
    config["intermediate_size"] = 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(parity.ConfigError) as from_json:
        olmo3_pair(config=str(path))
    assert str(from_dict.value) == str(from_json.value)


def _yarn_rope(config: dict, **changes) -> dict:
    config["rope_parameters"] = {
        t: ({**p, **changes} if p.get("rope_type") == "yarn" else p) for t, p in config["rope_parameters"].items()
    }
    return config


# the same kind as F21, found by a breaker: fields that divided by zero, crashed the reference or ran
# silently; each now refused in one line naming the field, through our cfg dict and a config.json alike
ZERO_OR_BELOW_ONE = [
    ("n_kv_heads", 0, lambda c: c.update(num_key_value_heads=0), "num_key_value_heads is 0; it must be at least 1"),
    ("head_dim", 0, None, "head_dim is 0; it must be at least 1"),  # Olmo3Config has no head_dim: cfg only
    ("rope_factor", 0.0, lambda c: _yarn_rope(c, factor=0.0), "rope_parameters factor is 0.0; it must be >= 1"),
    ("rope_factor", -2.0, lambda c: _yarn_rope(c, factor=-2.0), "rope_parameters factor is -2.0; it must be >= 1"),
    (
        "rope_orig_max",
        0,
        lambda c: _yarn_rope(c, original_max_position_embeddings=0),
        "rope_parameters original_max_position_embeddings is 0; it must be >= 1",
    ),
    (
        "context_length",
        0,
        lambda c: c.update(max_position_embeddings=0),
        "max_position_embeddings is 0; it must be at least 1",
    ),
]


@pytest.mark.parametrize(
    "key,value,change,message", ZERO_OR_BELOW_ONE, ids=[f"{k}={v}" for k, v, _, _ in ZERO_OR_BELOW_ONE]
)
def test_f21_kind_fields_that_divide_by_zero_are_refused_alike_from_cfg_and_config_json(
    key, value, change, message, tmp_path, capsys
):
    base = olmo3_pair("yarn")
    assert key in base.source.cfg
    with pytest.raises(parity.ConfigError, match=re.escape(message)):
        olmo3_pair(config="yarn", **{key: value})
    if change is None:
        return
    config = base.reference.config.to_dict()
    change(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(parity.ConfigError, match=re.escape(message)):
        olmo3_pair(config=str(path))
    assert main(["check", "olmo3", "--config", str(path), "--report-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("build", [olmo3_pair, tiny_aya_pair], ids=["olmo3", "tiny_aya"])
def test_f22_a_config_the_reference_cannot_run_is_bad_input(build):
    pair = build("tiny", sliding_window=None, layer_types=[FULL] * 4)
    with pytest.raises(
        parity.ParityError, match=r"the reference \(\w+ForCausalLM\) cannot run this config: .*sliding_window"
    ):
        parity.check(pair)


def test_f22_cli_exit_2_one_line(tmp_path, capsys):
    config = olmo3_pair("tiny").reference.config.to_dict()
    config.update(sliding_window=None, layer_types=[FULL] * 4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["check", "olmo3", "--config", str(path), "--report-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot run this config" in err
