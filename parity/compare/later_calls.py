"""Later calls: a node the reference runs more than once in one forward (a block looped, HRM's stacks and Dory's
recurrent section; a module shared across layers) is compared on every call, not on its first alone.

A loop's later passes differ from its first only through what is fed into them (the carried state, an input
injected before each pass) or through what a module keeps between calls: a fault there changes no first call, and
without its later calls the first node to differ would be the first one after the loop, with nothing to say why.
The traces keep the later calls (:attr:`parity.record.trace.Trace.later`, by :func:`~parity.record.trace.later_call`
name); a node's later calls are judged only where ours ran it as often as the reference (another count is a
loop's count, read from the first calls: :mod:`parity.diagnose.order`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import torch

from parity.compare.metrics import MISSING, UNTAPPED
from parity.compare.results import NodeResult, compare_node
from parity.compare.tolerances import Tolerances
from parity.model.pair import NodeSpec
from parity.record.trace import later_call


def call_positions(sequence: Sequence[str]) -> dict[str, int]:
    """Every call's place in a trace's ``sequence``: the node's name for its first call, its
    :func:`later_call` name for the later ones."""
    positions: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, name in enumerate(sequence):
        count[name] = count.get(name, 0) + 1
        positions.setdefault(name if count[name] == 1 else later_call(name, count[name]), i)
    return positions


def with_later_calls(
    results: list[NodeResult],
    ours,
    reference,
    nodes: Sequence[NodeSpec],
    tolerances: Tolerances,
    padding: torch.Tensor | None = None,
) -> list[NodeResult]:
    """``results`` (first calls, in the reference's order) with every later call both sides kept merged in where
    the reference ran it: a node ours ran as often as the reference, whose first call was compared (not untapped,
    not missing). Unchanged when no node repeats. Indexes are renumbered."""
    later = getattr(reference, "later", None)
    if not later or not getattr(ours, "later", None):
        return results
    specs = {n.name: n for n in nodes}
    first = {r.name: r for r in results}
    positions = call_positions(reference.sequence)
    keyed: list[tuple[int, int, NodeResult]] = []
    last = -1
    for r in results:  # a node the reference never produced stays after its predecessor
        last = max(last, positions.get(r.name, last))
        keyed.append((last, 0, r))
    runs = Counter(ours.sequence)  # a module's calls, and ours' reads again of a parameter it computes in functions
    for name, calls in reference.calls.items():
        spec, done = specs.get(name), first.get(name)
        if spec is None or done is None or done.status in (UNTAPPED, MISSING) or runs[name] != calls:
            continue
        for call in range(2, calls + 1):
            key = later_call(name, call)
            if key not in later or key not in ours.later or key not in positions:
                continue
            # judged within the reference's own rounding at that call, where calibrated (a later pass of a loop
            # carries the rounding of the passes before it)
            r = compare_node(replace(spec, name=key), 0, ours.later[key], later[key], tolerances, padding=padding)
            keyed.append((positions[key], 1, replace(r, name=key)))
    if len(keyed) == len(results):
        return results
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [replace(r, index=i) for i, (_, _, r) in enumerate(keyed)]


def call_of(name: str) -> tuple[str, int] | None:
    """``(node, call)`` for a :func:`later_call` name, None for a first call's."""
    node, sep, rest = name.rpartition(" (call ")
    if not sep or not rest.endswith(")") or not rest[:-1].isdigit():
        return None
    return node, int(rest[:-1])
