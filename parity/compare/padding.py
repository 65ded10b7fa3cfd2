"""Padding positions, not judged: a node of ours whose padding tokens (and padding keys) take the
reference's values, and a node of ours that holds the real tokens alone (a padded batch unpadded
and packed into one sequence, FlashAttention's varlen layout) put back in the reference's layout.

What a model computes at a padding position is unspecified (Transformers itself computes whatever
its masks give there); a user's model may skip, zero or pack those positions. So a user's model is
judged on its real tokens; the padding of the reference's own families is judged (they compute it
as Transformers does), and ``parity compare`` lets a dump choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping

import torch

from parity.record.trace import Trace

#: node kinds laid out (batch, heads, seq, ...): their token axis is 2 (the diagnosis' profiles read it too)
HEAD_MAJOR = {"q_rot", "k_rot", "scores", "probs"}


def token_axis(kind: str) -> int:
    """The token axis of a node of this kind: 2 for ``(batch, heads, seq, ...)`` nodes, else 1."""
    return 2 if kind in HEAD_MAJOR else 1


def without_padding(
    kind: str, ours: torch.Tensor, ref: torch.Tensor, pad: torch.Tensor, keys: tuple[str, ...] = ("scores",)
) -> torch.Tensor:
    """``ours`` with the reference's values at padding positions (``pad``: ``(batch, seq)``, True at
    padding), along its token axis and, for the node kinds in ``keys``, their key axis too (by default
    the scores only: a real query's weight on a padding key, in the probabilities, stays judged; a dump
    from another runtime leaves the probabilities' padding keys out as well); ``ours`` unchanged when its
    shape has no such axes."""
    batch, seq = pad.shape
    axis = token_axis(kind)
    if axis == 1 and ours.dim() == 4 and ours.shape[1] != seq and ours.shape[2] == seq:
        axis = 2  # a node of another kind laid out heads first (a per-head norm of (batch, heads, seq, head_dim))
    if tuple(ours.shape) != tuple(ref.shape) or ours.dim() < 2 or ours.dim() <= axis:
        return ours
    if axis == 1 and ours.dim() == 2 and ours.shape[0] == batch * seq and batch * seq > 1:
        # tokens flattened, ``(batch * seq, features)`` (a MoE router's logits, OPT's MLP): row b * seq + s
        flat = without_padding(kind, ours.unflatten(0, (batch, seq)), ref.unflatten(0, (batch, seq)), pad, keys)
        return flat.flatten(0, 1)
    if ours.shape[0] != batch or ours.shape[axis] != seq:
        return ours
    where = pad.view(batch, *([1] * (axis - 1)), seq, *([1] * (ours.dim() - axis - 1)))
    if kind in keys and ours.dim() == 4 and ours.shape[3] == seq:
        # a padding key's score is masked after: unspecified; its probability is not (a real query must
        # give it no weight), so the probabilities keep their key axis judged
        where = where | pad.view(batch, 1, 1, seq)
    return torch.where(where.expand(ours.shape), ref.to(ours.dtype), ours)


def unpacked(kind: str, ours: torch.Tensor, ref: torch.Tensor, pad: torch.Tensor) -> torch.Tensor | None:
    """``ours`` holding the real tokens only, in order (``(1, N, ...)`` or ``(N, ...)``; tokens flattened,
    ``(N, features)`` for ``(batch * seq, features)``; heads first,
    ``(1, heads, N, ...)``; scores and probabilities ``(1, heads, N, N)``), in the reference's padded
    layout with the reference's values at the padding (and, for scores, between different rows'
    tokens); None when ``ours`` is no such packing of ``ref``."""
    batch, seq = pad.shape
    real = ~pad
    n = int(real.sum())
    axis = token_axis(kind)
    if axis == 1 and ref.dim() == 4 and ref.shape[0] == batch and ref.shape[1] != seq and ref.shape[2] == seq:
        axis = 2  # a per-head norm's output taken heads first (EXAONE 4's q_norm after the transpose)
    if axis == 1 and ref.dim() == 2 and ref.shape[0] == batch * seq != n and tuple(ours.shape) == (n, ref.shape[1]):
        # tokens flattened, ``(batch * seq, features)`` (a MoE router's logits), ours on the real ones alone
        out = ref.clone().to(ours.dtype)
        out[real.flatten()] = ours
        return out
    if ref.dim() <= axis or ref.shape[0] != batch or ref.shape[axis] != seq or n == batch * seq:
        return None
    packed = ours[0] if ours.dim() == ref.dim() and ours.shape[0] == 1 else ours
    if packed.dim() != ref.dim() - 1:
        return None
    out = ref.clone().to(ours.dtype)
    if axis == 1:  # (batch, seq, ...) from (N, ...)
        if tuple(packed.shape) != (n, *ref.shape[2:]):
            return None
        out[real] = packed
        return out
    keys = ref.dim() == 4 and ref.shape[3] == seq
    if packed.shape[1] != n or (keys and packed.shape[2] != n) or packed.shape[0] != ref.shape[1]:
        return None
    if not keys and tuple(packed.shape[2:]) != tuple(ref.shape[3:]):
        return None
    start = 0
    for row in range(batch):
        tokens = real[row].nonzero().flatten()
        span = torch.arange(start, start + len(tokens))
        start += len(tokens)
        if keys:  # this row's block of its own tokens against its own keys
            out[row][:, tokens[:, None], tokens[None, :]] = packed[:, span[:, None], span[None, :]]
        else:
            out[row][:, tokens] = packed[:, span]
    return out


class _Rows(MutableMapping):
    """A trace's tensors (perhaps spilled) read as the batch rows ``rows`` only: a tensor whose first axis is
    the batch is sliced on access, any other is read as it is."""

    def __init__(self, base: MutableMapping, rows: torch.Tensor, batch: int):
        self.base, self.rows, self.batch = base, rows, batch

    def __getitem__(self, key):
        t = self.base[key]
        return t[self.rows] if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == self.batch else t

    def __setitem__(self, key, value) -> None:
        self.base[key] = value

    def __delitem__(self, key) -> None:
        del self.base[key]

    def __iter__(self) -> Iterator:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def unpadded_rows(
    ours: Trace, ref: Trace, mask: torch.Tensor, positions: torch.Tensor | None
) -> tuple[Trace, Trace, torch.Tensor, torch.Tensor | None] | None:
    """Both traces, the mask and the positions restricted to the batch rows without padding, for the
    detectors of a model that ran each row alone (:meth:`parity.record.trace.Trace._by_rows`): its nodes hold
    zeros at the padding, so a fit over every token (a norm's eps per token) would read zeros against the
    reference's values; the unpadded rows hold what a batched forward would. None when every row is padded.
    ``mask``: ``(batch, seq)``, 1 for real tokens."""
    full = mask.cpu().bool().all(-1)
    if not bool(full.any()):
        return None
    rows, batch = full.nonzero().flatten(), mask.shape[0]

    def view(trace: Trace) -> Trace:
        return dataclasses.replace(
            trace, tensors=_Rows(trace.tensors, rows, batch), inputs=_Rows(trace.inputs, rows, batch)
        )

    return (
        view(ours),
        view(ref),
        mask[rows.to(mask.device)],
        None if positions is None else positions[rows.to(positions.device)],
    )
