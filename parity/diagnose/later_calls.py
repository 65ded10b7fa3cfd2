"""The hint for a node that agrees on its first call and differs on a later one (:mod:`parity.compare.later_calls`).

Every node before the failure agrees, its first call included, so the node's own computation is the same on both
sides: what changes between calls is either what ours feeds the looped block on that pass (the failure is the
first node of its pass: the state carried from one pass to the next, an input injected before each pass) or what
the node does on later calls alone (a node of the same pass before it agrees: a per-pass constant, a cache slot,
a state the module keeps between calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from parity.compare.later_calls import call_of
from parity.compare.results import NodeResult
from parity.diagnose.hints import Hint


def looped_block(node: str, calls: Mapping[str, int]) -> str:
    """The outermost module holding ``node`` whose every node the reference ran as often as ``node`` at least
    (HRM's ``model.L_module``; Dory's recurrent layer ``model.layers.2``): the block the loop runs."""
    parts = node.split(".")
    least = calls.get(node, 0)
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth])
        inside = [c for name, c in calls.items() if name.startswith(prefix + ".")]
        if inside and min(inside) >= least:
            return prefix
    return node


def later_call_hint(
    results: Sequence[NodeResult], bad: NodeResult, reference_calls: Mapping[str, int], ours=None, ref=None
) -> Hint | None:
    """The cause of ``bad``, a later call's failure with every node before it agreeing (None for a first call).
    ``ours``, ``ref``: the two traces, where a table read again (BLT's hash embedding, once per n-gram group) is
    read for the rows each side took on that call."""
    parsed = call_of(bad.name)
    if parsed is None:
        return None
    node, call = parsed
    rows = _rows_on_call(bad.name, node, ours, ref) if ours is not None and ref is not None else None
    if rows is not None:
        return rows
    block = looped_block(node, reference_calls)
    runs = reference_calls.get(node, call)
    before = [r for r in results[: bad.index] if r.judged]
    previous = before[-1] if before else None
    prev = call_of(previous.name) if previous is not None else None
    evidence = {"node": node, "call": call, "calls": runs, "block": block}
    if previous is not None and prev is not None and prev[1] == call and prev[0].startswith(block + "."):
        return Hint(
            "loop_call",
            f"{node} agrees on its first call and differs on call {call} of {runs}, while {prev[0]} before it in the "
            f"same pass agrees: ours' {node} computes otherwise on a later call (a per-pass constant or index, a "
            f"cache slot, a state it keeps between calls)",
            evidence | {"previous": previous.name},
        )
    return Hint(
        "loop_input",
        f"{block}, which the reference runs {runs} times, agrees on its earlier passes; on pass {call} its first node "
        f"({node}) differs, every node before agreeing: ours feeds it something else on that pass: the state carried "
        f"from one pass to the next, or the input added before each pass (the embeddings, another stack's output, "
        f"the input section's output), not the block's own computation",
        evidence,
    )


def _rows_on_call(name: str, node: str, ours, ref) -> Hint | None:
    """A table (``node``'s 2-D weight) whose later call ``name`` reads, on both sides, rows of it, ours each at a
    constant offset from the reference's: the ids of that call offset otherwise."""
    from parity.diagnose.embeddings import rows_read  # (the table reading of first calls)

    table, a, b = ref.weights.get(node), ours.later.get(name), ref.later.get(name)
    if (
        table is None
        or table.dim() != 2
        or a is None
        or b is None
        or a.shape != b.shape
        or a.shape[-1] != table.shape[1]
    ):
        return None
    mine, theirs = rows_read(a, table, 1.0), rows_read(b, table, 1.0)
    if mine is None or theirs is None or bool((mine == theirs).all()):
        return None
    shift = mine - theirs
    if not bool((shift == shift[0]).all()):
        return None
    k, call = int(shift[0]), name.rpartition("(call ")[2].rstrip(")")
    return Hint(
        "token_ids",
        f"likely the ids of {node}'s call {call} offset by {k:+d} in ours: on that call it reads row id "
        f"{'+' if k > 0 else '-'} {abs(k)} of the table where the reference reads row id (its earlier calls agree): a per-call offset into one table shared "
        f"by several lookups (BLT's hash n-gram groups, each at j x encoder_hash_byte_group_vocab) left out or "
        f"taken otherwise",
        {"offset": k, "call": int(call) if call.isdigit() else call},
    )
