"""A node that is another node of its block: ours' module (or tensor) runs where another one does.

A user's model is aligned by the weights its modules hold, so the module holding the reference's
``q_norm`` weight is compared at ``q_norm``. If the loader put ``q_norm``'s and ``k_norm``'s weights into
each other's modules, that module runs on the keys: its output has the shape of the reference's
``k_norm`` (with grouped keys) and equals it up to one factor per channel (the other weight). And when
the projections agree but are used in each other's places, a tensor downstream (``k_rot``) equals
another projection's output (the values)."""

from __future__ import annotations

import torch

from parity.compare.layouts import layouts
from parity.diagnose.evidence import EXPLAINS, Evidence, rel
from parity.diagnose.hints import Hint
from parity.record.hf_capture import SUFFIXES
from parity.record.trace import Trace


def _in_shape(t: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """``t`` in ``shape``, once per layout of ours that fits it (or as it is, when it has it)."""
    if tuple(t.shape) == shape:
        return [t]
    return [layout(t) for layout in layouts(tuple(t.shape), shape)]


def _per_channel(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """ours / ref is one factor per channel (last axis), the same on every row within the rounding of
    ours' dtype (read where the reference is not near zero): another weight vector."""
    a, b = ours.double().reshape(-1, ours.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    if a.shape[0] < 2:
        return False
    tol = min(1e-2, 1000 * torch.finfo(ours.dtype).eps)
    held = b.abs() > 1e-3 * float(b.abs().max())
    ratio = torch.where(held, a / torch.where(held, b, torch.ones_like(b)), torch.nan)
    per = ratio.nanmedian(0).values
    spread = (ratio - per).abs() <= tol * per.abs().clamp(min=1e-12)
    return bool(held.any(0).all()) and bool((spread | ~held).all())


def _siblings(name: str, ref_trace: Trace) -> list[str]:
    """Other nodes of the same parent module in the reference's trace (no module inputs)."""
    parent = name.rpartition(".")[0]
    return [n for n in ref_trace.order if n != name and n.rpartition(".")[0] == parent and "@" not in n]


#: projections named by their role alone (RWKV's time mix: key, value, receptance)
_BARE_PROJECTIONS = frozenset({"query", "key", "value", "receptance"})


def _role(name: str) -> str:
    """What a module's name says it does after its prefix: ``norm`` for ``q_norm``, ``proj`` for ``k_proj`` and for
    a projection named by its role alone (RWKV's ``key``)."""
    leaf = name.rpartition(".")[2]
    return leaf.rpartition("_")[2] if "_" in leaf else "proj" if leaf in _BARE_PROJECTIONS else ""


def swapped_modules(name: str, ours_trace: Trace, ref_trace: Trace) -> Hint | None:
    """At a failing module node (``q_norm``): ours' tensor has the shape of exactly one sibling module
    of the same role (``k_norm``) and equals it up to one factor per channel, not this node: the module
    holding this node's weight runs where the sibling's does (the two weights swapped by the loader)."""
    ours, ref = ours_trace.tensors.get(name), ref_trace.tensors.get(name)
    if ours is None or ref is None or not ours.is_floating_point() or not _role(name):
        return None
    if tuple(ours.shape) == tuple(ref.shape) and _per_channel(ours, ref):
        return None  # another weight of its own: channel_ratio's case
    found = []
    for other in _siblings(name, ref_trace):
        theirs = ref_trace.tensors.get(other)
        if _role(other) != _role(name) or theirs is None or theirs.numel() != ours.numel():
            continue
        if any(_per_channel(moved, theirs) for moved in _in_shape(ours, tuple(theirs.shape))):
            found.append(other)
    if len(found) != 1:
        return None
    other = found[0]
    done, order = ours_trace.results.get(other), ref_trace.order
    if done is not None and done.passed and other in order and name in order and order.index(other) < order.index(name):
        # the module holding the other weight ran before, as the reference's does: no swap, this module
        # reads the other one's input (a norm reading the stream before the add): the input detectors' case
        return None
    return Hint(
        "swapped_weights",
        f"likely the weights of {name.rpartition('.')[2]} and {other.rpartition('.')[2]} loaded into each other's "
        f"modules, or the two modules fed each other's inputs: ours' module holding {name}'s weight (aligned here "
        f"by it) runs where the reference's {other} does, on its input (its output has {other}'s shape "
        f"{tuple(ref_trace.tensors[other].shape)} and equals it up to one factor per channel: another weight)",
        {"runs_as": other},
    )


def swapped_weights(e: Evidence) -> Hint | None:
    """:func:`swapped_modules` at a node of the reference's shape (the two modules' outputs have one shape)."""
    return swapped_modules(e.name, e.ours_trace, e.ref_trace)


def used_as(e: Evidence) -> Hint | None:
    """Ours' tensor at an attention node (``k_rot``...) equals another node of its block (in some layout):
    the projections agree, but ours uses one in another's place (the values' projection as the keys)."""
    ours = e.ours_trace.tensors.get(e.name)
    if e.name.rpartition(".")[2] not in SUFFIXES or ours is None or not ours.is_floating_point():
        return None  # a module's own output equal to its input is a skipped module (norm_skipped's case)
    if rel(e.ours, e.ref) < EXPLAINS:
        return None
    leaf = e.name.rpartition(".")[2]
    for other in _siblings(e.name, e.ref_trace):
        theirs = e.ref_trace.tensors.get(other)
        if theirs is None or theirs.numel() != ours.numel() or not theirs.is_floating_point():
            continue
        if leaf[:2] in ("q_", "k_") and other.rpartition(".")[2].startswith(leaf[:2]):
            continue  # q_rot equal to q_proj or q_norm: RoPE not applied (rope_pattern's case), no swap
        if any(rel(moved, theirs) < EXPLAINS for moved in _in_shape(ours, tuple(theirs.shape))):
            return Hint(
                "swapped_roles",
                f"likely swapped roles: ours' {e.name.rpartition('.')[2]} equals the reference's {other} (in "
                f"another layout): the tensor computed there is used in {e.name.rpartition('.')[2]}'s place",
                {"equals": other},
            )
    return None
