"""nodes.csv, result.json and junit.xml: stable columns, strict JSON that the shipped schema accepts,
JUnit that CI systems read (one test case per family/config, the first-mismatch line as message)."""

from __future__ import annotations

import dataclasses
import json
import math
import xml.etree.ElementTree as ET

import jsonschema
import pandas as pd
import pytest
import torch

import parity
from parity.cli import main
from parity.diagnose.hints import Hint
from parity.report import tables
from parity.report.junit import write_junit
from parity.report.result import CheckResult
from parity.report.tables import COLUMNS, RESULT_VERSION, result_dict, result_schema
from reference_pairs.olmo3 import build_pair

#: the columns nodes.csv has had since its first release, in order; new ones are only appended
FROZEN_COLUMNS = [
    "order",
    "name",
    "layer",
    "kind",
    "status",
    "shape_ours",
    "shape_ref",
    "dtype",
    "max_abs",
    "mean_abs",
    "max_rel",
    "cosine",
    "atol",
    "rtol",
    "hint",
    "detail",
    "rel_l2",
    "atol_needed",
    "rtol_needed",
    "tol_source",
]


@pytest.fixture(scope="module")
def nonfinite():
    """A NaN in one weight of layer 1's gate: the first failing node is non-finite."""
    pair = build_pair("tiny")
    fc1 = pair.ours.blocks[1].ff.fc1
    poisoned = fc1.weight.detach().clone()  # a new tensor: the original is shared with the reference
    poisoned[0, 0] = float("nan")
    fc1.weight = torch.nn.Parameter(poisoned, requires_grad=False)
    return parity.check(pair)


def with_missing_node(result: CheckResult) -> CheckResult:
    """A copy where one node is missing (no metrics) and one needs an infinite rtol."""
    nodes = list(result.nodes)
    nodes[3] = dataclasses.replace(
        nodes[3],
        status="missing",
        max_abs=None,
        mean_abs=None,
        max_rel=None,
        cosine=None,
        rel_l2=None,
        atol_needed=None,
        rtol_needed=None,
        shape_ours=None,
        detail="ours produced no tensor at blocks.0.att.x",
    )
    nodes[5] = dataclasses.replace(nodes[5], rtol_needed=math.inf)
    return dataclasses.replace(result, nodes=nodes, profile=None)


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# --- nodes.csv


def test_csv_columns_are_documented_and_append_only(fault, tmp_path):
    assert COLUMNS[: len(FROZEN_COLUMNS)] == FROZEN_COLUMNS
    for column in COLUMNS:
        assert column in tables.__doc__, f"nodes.csv column {column} is not documented in parity.report.tables"
    frame = pd.read_csv(fault.write_csv(tmp_path / "nodes.csv"))
    assert list(frame.columns) == COLUMNS


def test_csv_has_one_row_per_node_with_its_values(fault, tmp_path):
    frame = pd.read_csv(fault.write_csv(tmp_path / "nodes.csv"), keep_default_na=False, na_values=[""])
    assert len(frame) == len(fault.nodes)
    assert list(frame["order"]) == list(range(len(fault.nodes)))
    assert list(frame["name"]) == [n.name for n in fault.nodes]
    assert list(frame["status"]) == [n.status for n in fault.nodes]
    assert list(frame["kind"]) == [n.kind for n in fault.nodes]
    layers = [None if pd.isna(v) else int(v) for v in frame["layer"]]
    assert layers == [n.layer for n in fault.nodes]
    for column in ("max_abs", "mean_abs", "max_rel", "cosine", "atol", "rtol", "rel_l2"):
        assert frame[column].tolist() == pytest.approx([getattr(n, column) for n in fault.nodes], rel=1e-12)
    bad = fault.first_mismatch
    row = frame.iloc[bad.index]
    assert row["name"] == "model.layers.0.self_attn.probs" and row["status"] == "mismatch"
    assert row["hint"] == bad.hint.text and row["hint_kind"] == "sliding_window"
    assert row["shape_ours"] == row["shape_ref"] == "1x4x16x16" and row["dtype"] == "float32"


def test_csv_leaves_absent_metrics_empty(passing, tmp_path):
    text = with_missing_node(passing).write_csv(tmp_path / "nodes.csv").read_text()
    frame = pd.read_csv(tmp_path / "nodes.csv")
    assert (
        frame.loc[3, "status"] == "missing" and pd.isna(frame.loc[3, "max_abs"]) and pd.isna(frame.loc[3, "shape_ours"])
    )
    assert frame.loc[3, "detail"].startswith("ours produced no tensor")
    assert math.isinf(frame.loc[5, "rtol_needed"])
    assert "\n" not in text.splitlines()[0]


# --- result.json


@pytest.mark.parametrize("which", ["fault", "passing", "nonfinite"])
def test_json_is_strict_and_valid_against_the_schema(which, request, tmp_path):
    result = request.getfixturevalue(which)
    data = strict_json(result.write_json(tmp_path / "result.json").read_text())
    jsonschema.validate(data, result_schema(), cls=jsonschema.Draft202012Validator)
    assert data["version"] == RESULT_VERSION
    assert data["passed"] is result.passed and data["verdict"] == result.verdict()
    assert [n["name"] for n in data["nodes"]] == [n.name for n in result.nodes]
    assert sum(data["counts"].values()) == len(result.nodes)
    for key in ("family", "config", "checkpoint", "checkpoint_sha256", "dtype", "seq_len", "seed", "mode", "time"):
        assert key in data["meta"]
    assert set(data["meta"]["versions"]) >= {"torch", "transformers"}
    if result.passed:
        assert data["first_mismatch"] is None
    else:
        assert data["first_mismatch"]["name"] == result.first_mismatch.name
        assert data["profile"]["node"] == result.first_mismatch.name


def test_json_writes_non_finite_numbers_as_null(nonfinite, passing, tmp_path):
    bad = nonfinite.first_mismatch
    assert bad.status == "nonfinite" and bad.name.startswith("model.layers.1.mlp")
    data = strict_json(nonfinite.write_json(tmp_path / "a.json").read_text())
    assert data["first_mismatch"]["status"] == "nonfinite"
    assert None in data["profile"]["by_position"]  # the NaN position, which the profile holds as inf
    data = strict_json(with_missing_node(passing).write_json(tmp_path / "b.json").read_text())
    jsonschema.validate(data, result_schema(), cls=jsonschema.Draft202012Validator)
    assert data["nodes"][3]["max_abs"] is None and data["nodes"][3]["shape_ours"] is None
    assert data["nodes"][5]["rtol_needed"] is None


def test_schema_is_shipped_valid_and_not_vacuous(fault):
    schema = result_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    data = result_dict(fault)
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(data))
    broken = [
        {**data, "version": RESULT_VERSION + 1},
        {k: v for k, v in data.items() if k != "passed"},
        {**data, "nodes": [{**data["nodes"][0], "status": "fine"}]},
        {**data, "nodes": [{k: v for k, v in data["nodes"][0].items() if k != "max_abs"}]},
        {**data, "meta": {**data["meta"], "versions": {}}},
        {**data, "logits": {**data["logits"], "kl": "small"}},
    ]
    for case in broken:
        assert list(validator.iter_errors(case)), case


# --- junit.xml


def test_junit_failure_message_is_the_first_mismatch_line(fault, tmp_path):
    root = ET.parse(fault.write_junit(tmp_path / "junit.xml")).getroot()
    assert root.tag == "testsuites" and root.get("tests") == "1" and root.get("failures") == "1"
    (case,) = root.iter("testcase")
    assert case.get("classname") == "parity.olmo3" and case.get("name") == "tiny"
    failure = case.find("failure")
    assert failure.get("message") == fault.first_mismatch.line()
    assert failure.get("message").startswith("model.layers.0.self_attn.probs: mismatch")
    assert failure.get("type") == "mismatch"
    assert fault.verdict() in failure.text and "hint (sliding_window): likely the sliding window" in failure.text
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["transformers"] == fault.meta["versions"]["transformers"]


def test_junit_one_case_per_family_and_config(fault, passing, tmp_path):
    other = dataclasses.replace(passing, meta={**passing.meta, "config": "yarn"})
    root = ET.parse(write_junit([passing, fault, other], tmp_path / "j.xml")).getroot()
    cases = list(root.iter("testcase"))
    assert [c.get("classname") for c in cases] == ["parity.olmo3"] * 3
    names = [c.get("name") for c in cases]
    assert len(set(names)) == 3 and names[2] == "yarn"  # the two tiny runs are told apart
    assert [c.find("failure") is not None for c in cases] == [False, True, False]
    assert root.find("testsuite").get("failures") == "1"


def test_junit_survives_markup_and_control_characters(fault, tmp_path):
    nodes = list(fault.nodes)
    bad = fault.first_mismatch
    nodes[bad.index] = dataclasses.replace(bad, name='probs<&>"\x01', hint=Hint("sliding_window", "a\x0bb <c>"))
    odd = dataclasses.replace(fault, nodes=nodes, meta={**fault.meta, "config": 'x"<y>'})
    root = ET.parse(odd.write_junit(tmp_path / "junit.xml")).getroot()
    case = root.find("testsuite/testcase")
    assert case.get("name") == 'x"<y>'
    assert case.find("failure").get("message").startswith('probs<&>"\ufffd')


def test_cli_format_junit_writes_a_case(tmp_path):
    assert main(["check", "olmo3", "--format", "junit,json", "--report-dir", str(tmp_path)]) == 0
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert sorted(p.name for p in folder.iterdir()) == ["junit.xml", "result.json"]
    case = ET.parse(folder / "junit.xml").getroot().find("testsuite/testcase")
    assert case.get("classname") == "parity.olmo3" and case.find("failure") is None
    jsonschema.validate(strict_json((folder / "result.json").read_text()), result_schema())


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_report_folder_and_files_follow_the_umask(passing, tmp_path, umask, folder_mode, file_mode):
    import os
    import stat

    from parity.cli import _write_reports

    old = os.umask(umask)
    try:
        folder = _write_reports(passing, tmp_path, ["json", "csv"])
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == folder_mode
    assert {stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()} == {file_mode}
