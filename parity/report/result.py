"""CheckResult: every node's comparison, immutable, plus the run's metadata; and the writer registry.

Report formats register here (:func:`register_writer`, done by :mod:`parity.report`), so the
result never imports a writer: ``result.write("html", path)`` looks the format up.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from parity.compare.results import NodeResult, first_divergence, first_mismatch
from parity.util.errors import ParityError

if TYPE_CHECKING:
    from parity.build.coverage import Coverage


@dataclass(frozen=True)
class Writer:
    """A report format: the file name a report folder gives it and ``module:function`` writing it."""

    fmt: str
    filename: str
    target: str

    def __call__(self, result: CheckResult, path: str | Path) -> Path:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(result, path)


#: format name -> Writer, filled by parity.report
WRITERS: dict[str, Writer] = {}


def register_writer(fmt: str, filename: str, target: str) -> None:
    """Make ``result.write(fmt, path)`` call ``target`` (``"package.module:function"``)."""
    WRITERS[fmt] = Writer(fmt, filename, target)


@dataclass(frozen=True)
class CheckResult:
    """Every node's comparison in reference execution order, plus the run's metadata.

    ``isolated``: per-node results of isolated mode when it ran. ``profile``: error by position /
    head / channel of the first failing node (:func:`parity.diagnose.profile.error_profile`); ``logits``: its
    effect on predictions at the output node (:func:`parity.diagnose.profile.logits_effect`). ``coverage``:
    what the loader did with the checkpoint (:mod:`parity.build.coverage`); gaps fail the run. ``origin``:
    in chained mode, the earliest node whose own (isolated) error stands out above the reference's
    own rounding noise, when the first mismatch lies downstream of it. ``alignment``: for a user's
    model, how each reference node was found in it (:mod:`parity.user.align`).
    """

    nodes: tuple[NodeResult, ...]
    meta: Mapping
    notes: tuple[str, ...] = ()
    profile: Mapping | None = None
    logits: Mapping | None = None
    isolated: tuple[NodeResult, ...] | None = None
    coverage: Coverage | None = None
    origin: NodeResult | None = None
    origin_reason: str = ""
    alignment: tuple = field(default_factory=tuple)
    #: a KV-cache run's summary (parity.run.decode.DecodeOutcome.to_dict): consistency and greedy tokens
    decode: Mapping | None = None
    #: a check over real prompts (parity.run.prompt_set): the tokens, per-prompt rows, the logits verdict
    text: Mapping | None = None

    @property
    def first_mismatch(self) -> NodeResult | None:
        return first_mismatch(self.nodes)

    @property
    def first_divergence(self) -> NodeResult | None:
        """The first node with any difference at all (useful where a pair is bit-exact when correct)."""
        return first_divergence(self.nodes)

    @property
    def passed(self) -> bool:
        """Every judged node agrees and the loader covered the checkpoint exactly."""
        return self.first_mismatch is None and (self.coverage is None or self.coverage.ok)

    @property
    def first_isolated_mismatch(self) -> NodeResult | None:
        """The first failing node in isolated mode (the likely fault), when isolated mode ran."""
        return first_mismatch(self.isolated) if self.isolated is not None else None

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.status] = out.get(n.status, 0) + 1
        return out

    def verdict(self) -> str:
        """One line: parity holds, or the first node that fails with its metrics."""
        judged = [n for n in self.nodes if n.judged]
        untapped = len(self.nodes) - len(judged)
        cover = f" ({untapped} of {len(self.nodes)} reference nodes untapped)" if untapped else ""
        bad = self.first_mismatch
        if bad is None and self.coverage is not None and not self.coverage.ok:
            return f"FAIL: all {len(judged)} nodes agree, but loader coverage has gaps: {'; '.join(self.coverage.gaps)}"
        if bad is None:
            return f"PASS: all {len(judged)} nodes agree within tolerance{cover}"
        failing = sum(not r.passed for r in judged)
        return (
            f"FAIL: first mismatch at node {bad.index} of {len(self.nodes)}, {bad.line()} [{failing} nodes fail]{cover}"
        )

    def to_frame(self):
        """pandas DataFrame, one row per node (columns documented in parity.report.tables)."""
        from parity.report.tables import nodes_frame

        return nodes_frame(self)

    def write(self, fmt: str, path: str | Path) -> Path:
        """Write this result in a registered format (``html``, ``csv``, ``json``, ``junit``...)."""
        if fmt not in WRITERS:
            raise ParityError(f"unknown report format {fmt!r}; choose from {', '.join(sorted(WRITERS))}")
        return WRITERS[fmt](self, path)

    def write_csv(self, path: str | Path) -> Path:
        return self.write("csv", path)

    def write_json(self, path: str | Path) -> Path:
        return self.write("json", path)

    def write_html(self, path: str | Path) -> Path:
        return self.write("html", path)

    def write_junit(self, path: str | Path) -> Path:
        return self.write("junit", path)
