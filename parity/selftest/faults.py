"""Known fault kinds, each injectable into a fresh pair, and the selftest that proves parity sees them.

A :class:`Fault` is a change to an otherwise correct implementation (from the test suite, or one of
the cases F01-F10 reported in public projects), with the node a good debugger must name first and the class of
hint it must give. ``inject`` mutates only the pair's own objects (our model instance, its cfg
copy, its modules' methods), never module globals, so faults cannot leak into later runs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parity.diagnose.hints import KINDS
from parity.model.pair import Pair


@dataclass(frozen=True)
class Fault:
    """``expected``: first failing node in chained mode. ``scope`` (a glob): in isolated mode every
    failing node matches it or lies inside what it matches (``scope.*``, ``scope@*``) — one node and
    its own children, or the same node in every layer the fault touches — and the first one is
    ``isolated`` (default: ``expected``). ``hint``: the kind the first mismatch's hint must have
    (one of :data:`parity.diagnose.hints.KINDS`). ``check_kwargs``: extra arguments of parity.check (a padded
    batch, ``exact=True`` for a fault only bit-exactness can see)."""

    id: str
    description: str
    config: str
    inject: Callable[[Pair], None]
    expected: str
    hint: str
    scope: str | None = None
    isolated: str | None = None
    source: str = ""
    overrides: tuple[tuple[str, Any], ...] = ()
    #: extra arguments for parity.check, e.g. (("batch_size", 2), ("left_pad", 5)) for padded batches
    check_kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.hint not in KINDS:
            raise ValueError(f"fault {self.id}: unknown hint kind {self.hint!r}; choose from {', '.join(KINDS)}")

    @property
    def isolated_expected(self) -> str:
        return self.isolated or self.expected

    @property
    def isolated_scope(self) -> str:
        return self.scope or self.isolated_expected


def in_scope(name: str, scope: str) -> bool:
    """``name`` matches the glob ``scope`` or lies inside a module it matches."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in (scope, scope + ".*", scope + "@*"))
