"""Parity in a project's own test suite: ``assert_parity`` and (through the pytest plugin) the
``parity_pair`` fixture.

    def test_my_olmo3(parity_pair):
        assert_parity(parity_pair("olmo3", "tiny"))

Inside :func:`collecting`, every result ``assert_parity`` makes is also appended to a list: the
pytest plugin uses it to write the reports of a failing test.
"""

from __future__ import annotations

import contextlib
import contextvars
import io

from parity.model.pair import Pair
from parity.report.result import CheckResult
from parity.run.check import check


def mismatch_table(result: CheckResult, context: int = 3) -> str:
    """Plain-text table of the nodes around the first mismatch (or the last nodes if all pass),
    the hint and any loader-coverage gaps: the message a failing parity test shows."""
    from rich.console import Console
    from rich.table import Table

    bad = result.first_mismatch
    center = bad.index if bad is not None else len(result.nodes) - 1
    rows = result.nodes[max(0, center - context) : center + context + 1]
    table = Table(box=None, pad_edge=False)
    for col in ("#", "node", "status", "max_abs", "mean_abs", "cosine", "atol", "rtol"):
        table.add_column(col)
    fmt = lambda v, spec=".3g": "" if v is None else format(v, spec)
    for r in rows:
        marker = ">" if bad is not None and r.index == bad.index else " "
        table.add_row(
            f"{marker}{r.index}",
            r.name,
            r.status,
            fmt(r.max_abs),
            fmt(r.mean_abs),
            fmt(r.cosine, ".6f"),
            f"{r.atol:g}",
            f"{r.rtol:g}",
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=160, color_system=None)
    console.print(result.verdict(), soft_wrap=True, highlight=False)
    console.print(table)
    if bad is not None and bad.hint is not None:
        console.print(f"hint ({bad.hint.kind}): {bad.hint.text}", soft_wrap=True, highlight=False)
    for gap in result.coverage.gaps if result.coverage is not None else []:
        console.print(f"loader coverage: {gap}", soft_wrap=True, highlight=False)
    return buffer.getvalue()


class ParityAssertionError(AssertionError):
    """``assert_parity`` failed; ``result`` is the CheckResult."""

    def __init__(self, message: str, result: CheckResult):
        super().__init__(message)
        self.result = result


_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("parity_results", default=None)


@contextlib.contextmanager
def collecting():
    """``with collecting() as results:`` every CheckResult ``assert_parity`` makes inside is appended."""
    results: list[CheckResult] = []
    token = _SINK.set(results)
    try:
        yield results
    finally:
        _SINK.reset(token)


def assert_parity(pair_or_result: Pair | CheckResult, **check_kwargs) -> CheckResult:
    """Raise :class:`ParityAssertionError` (an AssertionError) with the first-mismatch table unless
    parity holds.

    Given a Pair, runs :func:`parity.check` first (``check_kwargs``: ``seq_len``, ``mode``, ``atol``,
    ``tolerances``...); given a CheckResult (e.g. from :func:`parity.check_model`), judges it as is.
    Returns the result when parity holds.
    """
    if isinstance(pair_or_result, CheckResult):
        if check_kwargs:
            raise TypeError("check options go with a Pair, not with a finished CheckResult")
        result = pair_or_result
    else:
        result = check(pair_or_result, **check_kwargs)
    sink = _SINK.get()
    if sink is not None:
        sink.append(result)
    if not result.passed:
        raise ParityAssertionError("parity failed\n" + mismatch_table(result), result)
    return result


def assert_bit_exact(pair_or_result: Pair | CheckResult, **check_kwargs) -> CheckResult:
    """:func:`assert_parity` at atol = rtol = 0, and then every node identical to the last bit
    (``max_abs == 0.0``; ``exact=True`` is passed to :func:`parity.check` unless given) and none
    untapped: what a pair that follows the reference's rounding order promises. Returns the result;
    raises :class:`ParityAssertionError` naming the first nodes that differ."""
    if isinstance(pair_or_result, CheckResult):
        result = assert_parity(pair_or_result, **check_kwargs)
    else:
        result = assert_parity(pair_or_result, **{"exact": True, **check_kwargs})
    off = [(n.name, n.status, n.max_abs) for n in result.nodes if n.status != "ok" or n.max_abs != 0.0]
    if off:
        raise ParityAssertionError(f"not bit-exact at {len(off)} node(s): {off[:6]}", result)
    return result
