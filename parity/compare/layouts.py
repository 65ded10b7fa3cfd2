"""A node of ours in another layout than the reference's: the same values, axes permuted and regrouped.

Code nobody wrote for parity keeps its tensors its own way: heads before the sequence, ``(batch *
seq, experts)`` router logits for ``(batch, seq, experts)``, a per-head norm's output after the
heads transpose, no batch axis. Such a node is compared in the reference's layout when one exists:
an order of ours' axes after which merging or splitting adjacent axes (never mixing them) gives
the reference's shape. Several may fit a shape (two axes of one size); the one whose values come
closest is taken, and only when it is clearly the same tensor (cosine 0.9 or more): a node that
fits no layout stays a ``shape`` failure. Only nodes that declare it (``NodeSpec.match_layout``:
a user's model, a runtime's dump) are searched; our families' layouts are exact.
"""

from __future__ import annotations

import itertools
import math

import torch

#: the least cosine at which a layout's values are the reference's (noise and bugs stay far above 0.9)
SAME_TENSOR = 0.9
#: axes beyond which no permutation is tried (5! = 120 candidates at most)
MAX_AXES = 5


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


def describe(perm: tuple[int, ...], src: tuple[int, ...], dst: tuple[int, ...]) -> str:
    moved = "" if perm == tuple(range(len(perm))) else f".permute{perm}"
    return f"ours{moved}.reshape{tuple(dst)} (ours is {tuple(src)})"


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b) / (na * nb)


def match_layout(ours: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """``(ours in the reference's layout, how)`` for the closest layout that is clearly the same
    tensor, or None (see the module docstring)."""
    if ours.shape == ref.shape or ours.numel() != ref.numel() or not ours.is_floating_point():
        return None
    best = None
    for perm in candidates(tuple(ours.shape), tuple(ref.shape)):
        moved = ours.permute(perm).reshape(ref.shape)
        if not bool(torch.isfinite(moved).all()):
            continue
        score = _cosine(moved, ref)
        if best is None or score > best[0]:
            best = (score, perm, moved)
    if best is None or best[0] < SAME_TENSOR:
        return None
    return best[2], describe(best[1], tuple(ours.shape), tuple(ref.shape))
