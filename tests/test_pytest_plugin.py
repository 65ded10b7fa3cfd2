"""The pytest plugin: a three-line parity test, and a failure message that is the first-mismatch table."""

from __future__ import annotations

import pytest

import parity

from parity import assert_parity


@pytest.mark.parametrize("family", ["olmo3", "tiny_aya", "llama3"])
def test_three_line_parity_test(parity_pair, family):
    assert_parity(parity_pair(family))


def test_fixture_passes_config_and_overrides(parity_pair):
    pair = parity_pair("olmo3", "yarn", n_layers=2)
    assert pair.cfg["n_layers"] == 2 and pair.cfg["rope_type"] == "yarn"
    assert assert_parity(pair, mode="both").isolated is not None


def test_failure_message_is_the_first_mismatch_table(parity_pair):
    pair = parity_pair("olmo3")
    pair.ours.blocks[0].att.sliding_window += 1
    with pytest.raises(AssertionError) as info:
        assert_parity(pair)
    message = str(info.value)
    probs = next(n.index for n in parity.check(parity_pair("olmo3")).nodes if n.name == "model.layers.0.self_attn.probs")
    assert f"FAIL: first mismatch at node {probs} of {len(pair.nodes)}, model.layers.0.self_attn.probs" in message
    assert f">{probs}   model.layers.0.self_attn.probs" in message  # the failing row, marked, with its neighbours
    assert "model.layers.0.self_attn.k_rot" in message and "model.layers.0.self_attn.context" in message
    assert "hint (sliding_window): likely the sliding window size or mask" in message


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
