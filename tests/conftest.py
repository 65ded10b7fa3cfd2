"""Shared test helpers: checkpoints written with the reference's own save_pretrained."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PARITY_STRICT_DETECTORS", "1")  # a detector that raises fails its test

from hypothesis import settings

# Property tests (tests/test_properties.py): examples per family and test. `default` keeps every
# test run within its budget; `.ci/run` uses `ci`. Both draw the same examples on every run
# (derandomize): a gate that passed here passes in CI, and a failure reproduces. `nightly`, a long run
# by hand, draws new examples each time: that is where new bugs are found (then kept as tests).
settings.register_profile("default", max_examples=10, derandomize=True)
settings.register_profile("ci", max_examples=200, derandomize=True)
settings.register_profile("nightly", max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

pytest_plugins = ["pytester"]


def save_checkpoint(pair, directory: Path, sharded: bool = False) -> Path:
    """Write ``pair.reference`` with ``save_pretrained`` (safetensors); sharded into several files
    when asked (a shard size far below the model size)."""
    kwargs = {"max_shard_size": "20KB"} if sharded else {}
    pair.reference.save_pretrained(directory, **kwargs)
    return directory


@pytest.fixture
def checkpoint_of(tmp_path):
    """``checkpoint_of(pair, sharded=False) -> Path`` of a fresh save_pretrained directory."""
    counter = iter(range(1000))

    def make(pair, sharded: bool = False) -> Path:
        return save_checkpoint(pair, tmp_path / f"ckpt{next(counter)}", sharded)

    return make


@pytest.fixture
def replace_table():
    """``replace_table(table, new)``: make a family's weight table (the dict its Family holds) read
    ``new`` for this test only, as an edited loader.py would. The table gets its own entries back,
    in their order (a loader's messages follow the table's order)."""
    saved = []

    def replace(table: dict, new: dict) -> None:
        saved.append((table, dict(table)))
        new = dict(new)
        table.clear()
        table.update(new)

    yield replace
    for table, original in reversed(saved):
        table.clear()
        table.update(original)


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    """save_pretrained draws progress bars on stderr; tests read stderr for one-line errors."""
    from transformers.utils import logging

    logging.disable_progress_bar()


@pytest.fixture(scope="session")
def fault():
    """A CheckResult with layer 0's sliding window one too wide: first mismatch at its probs."""
    import parity
    from reference_pairs.olmo3 import build_pair

    pair = build_pair("tiny")
    pair.ours.blocks[0].att.sliding_window += 1
    return parity.check(pair)


@pytest.fixture(scope="session")
def passing():
    """A CheckResult of the clean tiny OLMo 3 pair."""
    import parity
    from reference_pairs.olmo3 import build_pair

    return parity.check(build_pair("tiny"))
