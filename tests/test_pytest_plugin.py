"""The pytest plugin: a three-line parity test, and a failure message that is the first-mismatch table."""

from __future__ import annotations

import json

import pytest

import parity
from parity import assert_parity


@pytest.mark.parametrize("family", ["olmo3", "tiny_aya", "llama3"])
def test_three_line_parity_test(parity_pair, family):
    assert_parity(parity_pair(family))


def test_fixture_passes_config_and_overrides(parity_pair):
    pair = parity_pair("olmo3", "yarn", n_layers=2)
    assert pair.source.cfg["n_layers"] == 2 and pair.source.cfg["rope_type"] == "yarn"
    assert assert_parity(pair, mode="both").isolated is not None


def test_failure_message_is_the_first_mismatch_table(parity_pair):
    pair = parity_pair("olmo3")
    pair.ours.blocks[0].att.sliding_window += 1
    with pytest.raises(AssertionError) as info:
        assert_parity(pair)
    message = str(info.value)
    probs = next(
        n.index for n in parity.check(parity_pair("olmo3")).nodes if n.name == "model.layers.0.self_attn.probs"
    )
    assert f"FAIL: first mismatch at node {probs} of {len(pair.nodes)}, model.layers.0.self_attn.probs" in message
    assert f">{probs}   model.layers.0.self_attn.probs" in message  # the failing row, marked, with its neighbours
    assert "model.layers.0.self_attn.k_rot" in message and "model.layers.0.self_attn.context" in message
    assert "hint (sliding_window): likely the sliding window size or mask" in message


@pytest.mark.slow  # a subprocess run of pytest/git (10-30 s): in .ci/run's `pytest -m slow`
def test_plugin_is_registered_for_other_projects(pytester):
    """A project that installs parity gets the fixture with no conftest of its own."""
    pytester.makepyfile(
        """
        from parity import assert_parity

        def test_my_model(parity_pair):
            assert_parity(parity_pair("llama3", "tiny"))
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


FAILING_AND_PASSING = """
from parity import assert_parity

def test_broken(parity_pair):
    pair = parity_pair("llama3")
    pair.ours.blocks[0].att.sliding_window = 2
    assert_parity(pair)

def test_fine(parity_pair):
    assert_parity(parity_pair("llama3"))
"""


def run_pytest(path, *args) -> int:
    """pytest in this process (no second interpreter to start) on the project at ``path``."""
    return pytest.main(
        [
            str(path),
            f"--rootdir={path}",
            "-c",
            str(path / "pytest.ini"),
            "--import-mode=importlib",
            "-p",
            "no:cacheprovider",
            *args,
        ]
    )


@pytest.mark.slow  # a subprocess run of pytest/git (10-30 s): in .ci/run's `pytest -m slow`
def test_a_failing_parity_test_leaves_its_report_and_names_it(tmp_path, capsys):
    """The plugin writes report.html and result.json for a failing test, into a folder the failure
    message names; a passing test writes nothing unless --parity-keep-reports."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_models.py").write_text(FAILING_AND_PASSING)
    assert run_pytest(tmp_path) == pytest.ExitCode.TESTS_FAILED
    (folder,) = (tmp_path / "reports").iterdir()
    assert folder.name.startswith("test_models-test_broken-")
    assert (folder / "report.html").is_file() and json.loads((folder / "result.json").read_text())["passed"] is False
    out = capsys.readouterr().out
    assert f"parity report: {folder}" in out and "1 failed, 1 passed" in out

    kept = tmp_path / "kept"
    assert (
        run_pytest(tmp_path, f"--parity-report-dir={kept}", "--parity-keep-reports", "-k", "fine") == pytest.ExitCode.OK
    )
    (folder,) = kept.iterdir()
    assert folder.name.startswith("test_models-test_fine-") and (folder / "report.html").is_file()


def test_report_dir_too_long_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_models.py").write_text(FAILING_AND_PASSING)
    assert run_pytest(tmp_path, "--parity-report-dir", "/" + "x" * 300) == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: --parity-report-dir has a part of 300 bytes" in capsys.readouterr().err
