"""A node of ours in another layout than the reference's: the same values, axes permuted and regrouped.

Code nobody wrote for parity keeps its tensors its own way: heads before the sequence, ``(batch *
seq, experts)`` router logits for ``(batch, seq, experts)``, a per-head norm's output with the
sequence and heads merged in another order (TransformerLens' ``(seq * heads, head_dim)`` for the
reference's ``(batch, heads, seq, head_dim)``), no batch axis. Such a node is compared in the
reference's layout when one exists: ours' axes permuted and then adjacent axes merged or split, or
ours' axes split into the reference's and then permuted (never mixing elements otherwise).

Whether a node is in another layout is decided by the shapes alone: a node whose shape fits a layout
is compared in it whatever its values, so a wrong value in a node kept in another layout is a
``mismatch`` there, never a ``shape``. Structure narrows the layouts that fit: a node whose last
axis has the reference's size keeps it last (what a norm or a projection computes along). Only when
several layouts still fit (two axes of one size, or two orders of axes merged into one) do the values
choose among them: the closest is taken, and the detail says so. A node that fits no layout stays a
``shape`` failure. Only nodes that declare it (``NodeSpec.match_layout``: a user's model, a runtime's
dump) are searched; our families' layouts are exact.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

#: axes beyond which no permutation is tried (5! = 120 candidates at most)
MAX_AXES = 5
#: elements up to which layouts are told apart by the index maps they make (larger: by their steps)
_INDEX_LIMIT = 1 << 22


def _prefixes(shape: tuple[int, ...]) -> set[int]:
    out, p = set(), 1
    for n in shape:
        p *= n
        out.add(p)
    return out


def regroups(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """Whether ``src`` becomes ``dst`` by merging and splitting adjacent axes only (size-1 axes
    appear or vanish freely): every boundary of the coarser shape is one of the finer's."""
    if math.prod(src) != math.prod(dst):
        return False
    a = _prefixes(tuple(n for n in src if n != 1))
    b = _prefixes(tuple(n for n in dst if n != 1))
    return a <= b or b <= a


def candidates(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Orders of ``src``'s axes after which it regroups into ``dst`` (the identity first)."""
    if len(src) > MAX_AXES or math.prod(src) != math.prod(dst):
        return []
    found = []
    for perm in itertools.permutations(range(len(src))):
        shape = tuple(src[i] for i in perm)
        if regroups(shape, dst):
            found.append(perm)
    return found


@dataclass(frozen=True)
class Layout:
    """One way to bring a tensor of shape ``src`` into shape ``dst``: reshape to ``split`` (when set),
    permute by ``perm``, reshape to ``dst``."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    perm: tuple[int, ...]
    split: tuple[int, ...] | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.split is not None:
            t = t.reshape(self.split)
        return t.permute(self.perm).reshape(self.dst)

    @property
    def description(self) -> str:
        split = f".reshape{self.split}" if self.split is not None else ""
        moved = "" if self.perm == tuple(range(len(self.perm))) else f".permute{self.perm}"
        return f"ours{split}{moved}.reshape{tuple(self.dst)} (ours is {tuple(self.src)})"


def describe(perm: tuple[int, ...], src: tuple[int, ...], dst: tuple[int, ...]) -> str:
    return Layout(src, dst, perm).description


def layouts(src: tuple[int, ...], dst: tuple[int, ...]) -> list[Layout]:
    """Every layout that takes shape ``src`` to ``dst`` (see the module docstring), each way of moving
    the elements once, those keeping the last axis last first when ``src`` and ``dst`` end in the same size."""
    if src == dst or math.prod(src) != math.prod(dst):
        return []
    found = [Layout(src, dst, perm) for perm in candidates(src, dst)]
    # ours' axes split into the reference's, then permuted: (seq * heads, d) for (heads, seq, d)
    atoms = tuple(n for n in dst if n != 1)
    if len(atoms) <= MAX_AXES:
        for order in itertools.permutations(range(len(atoms))):
            split = tuple(atoms[i] for i in order)
            if order != tuple(range(len(atoms))) and regroups(split, src):
                perm = tuple(sorted(range(len(order)), key=lambda i: order[i]))
                found.append(Layout(src, dst, perm, split))
    found = _distinct(found)
    if src and dst and src[-1] == dst[-1]:
        kept = [layout for layout in found if _keeps_last(layout)]
        found = kept or found
    return found


def _index_map(layout: Layout) -> torch.Tensor | None:
    n = math.prod(layout.src)
    return layout(torch.arange(n).reshape(layout.src)) if n <= _INDEX_LIMIT else None


def _distinct(found: list[Layout]) -> list[Layout]:
    """One layout per way of moving the elements (permuting two axes of size 1 moves nothing)."""
    seen, out = set(), []
    for layout in found:
        index = _index_map(layout)
        key = index.numpy().tobytes() if index is not None else (layout.perm, layout.split)
        if key not in seen:
            seen.add(key)
            out.append(layout)
    return out


def _keeps_last(layout: Layout) -> bool:
    """Whether the layout keeps ours' last axis as the reference's last (same elements, same order)."""
    index = _index_map(layout)
    if index is None:
        return layout.split is None and layout.perm[-1] == len(layout.src) - 1
    last = layout.src[-1]
    rows = index.reshape(-1, last)
    return bool((rows - rows[:, :1] == torch.arange(last)).all()) and bool((rows[:, 0] % last == 0).all())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of two tensors' values, flattened (1 for two zeros, 0 for one)."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b) / (na * nb)


def match_layout(ours: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """``(ours in the reference's layout, how)`` when ours' shape fits a layout of the reference's,
    whatever the values; the closest when several fit (see the module docstring); None when none fits."""
    if ours.shape == ref.shape or ours.numel() != ref.numel() or not ours.is_floating_point():
        return None
    found = layouts(tuple(ours.shape), tuple(ref.shape))
    if not found:
        return None
    if len(found) == 1:
        return found[0](ours), found[0].description
    scored: list[tuple[float, Layout, torch.Tensor]] = []
    for layout in found:
        moved = layout(ours)
        finite = bool(torch.isfinite(moved).all())
        scored.append((cosine(moved, ref) if finite else -2.0, layout, moved))
    _, best, moved = max(scored, key=lambda item: item[0])
    return moved, f"{best.description}; the closest of {len(found)} layouts that fit the shapes"
