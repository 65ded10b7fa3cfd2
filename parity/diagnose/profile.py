"""Where an error sits, for reports: by token position, by head, by channel; and what it does to the logits.

All functions take our tensor and the reference's (same shape, already in the reference layout)
and return plain lists of floats so results serialise to JSON.
"""

from __future__ import annotations

import math

import torch

from parity.compare.padding import HEAD_MAJOR

# HEAD_MAJOR: node kinds laid out (batch, heads, seq, ...); every other node is (batch, seq, ...), or
# (tokens, ...) when 2-D (a MoE block's router and experts work on the flattened tokens).
#: Node kinds (batch, seq, heads * head_dim) whose last axis splits into heads (``gate``: an
#: attention output gate, one per query head and dim).
HEAD_MERGED = {"q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "context", "gate"}
#: Node kinds laid out (batch, seq, heads, head_dim): a linear-attention layer's q/k after the L2 norm
#: (expanded to its value heads) and its delta rule's output.
SEQ_HEADS = {"q_l2norm", "k_l2norm", "delta_out"}


#: elements of float64 working memory per slice (error profile, logits effect): ~32 MiB per copy
SLICE = 1 << 22


def _amax_over_all_but(diff: torch.Tensor, axis: int) -> torch.Tensor:
    moved = diff.movedim(axis, 0)
    return moved.reshape(moved.shape[0], -1).amax(dim=1)


def error_profile(ours: torch.Tensor, ref: torch.Tensor, kind: str, head_dim: int | None = None) -> dict:
    """Max ``|ours - ref|`` per token position, per head (attention nodes) and per channel (last axis).

    Returns ``{"by_position": [...], "by_head": [...] or None, "by_channel": [...] or None}``; non-finite
    differences count as ``inf`` so they stand out. Differences are taken in float64 a slice of
    positions at a time (bounded memory on large nodes; maxima do not depend on the slicing).
    Raises ValueError if shapes differ.
    """
    if ours.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(ours.shape)} vs {tuple(ref.shape)}")
    if ours.dim() < 2:
        diff = (ours.double() - ref.double()).abs().nan_to_num(nan=float("inf"))
        return {"by_position": None, "by_head": None, "by_channel": diff.tolist()}
    head_major = kind in HEAD_MAJOR and ours.dim() == 4
    axis = 2 if head_major else 1 if ours.dim() > 2 else 0  # a 2-D node is (tokens, ...)
    split = kind in HEAD_MERGED and head_dim and ours.shape[-1] % head_dim == 0
    step = max(1, SLICE * ours.shape[axis] // max(ours.numel(), 1))  # slices of positions
    by_position, by_head, by_channel = [], None, None
    for start in range(0, ours.shape[axis], step):
        a, b = (
            ours.narrow(axis, start, min(step, ours.shape[axis] - start)),
            ref.narrow(axis, start, min(step, ours.shape[axis] - start)),
        )
        diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
        by_position.append(_amax_over_all_but(diff, axis))
        head = (
            _amax_over_all_but(diff, 1)
            if head_major
            else (_amax_over_all_but(diff.unflatten(-1, (-1, head_dim)), -2) if split else None)
        )
        if head is not None:
            by_head = head if by_head is None else torch.maximum(by_head, head)
        if diff.shape[-1] <= 4096:
            channel = _amax_over_all_but(diff, -1)
            by_channel = channel if by_channel is None else torch.maximum(by_channel, channel)
    return {
        "by_position": torch.cat(by_position).tolist(),
        "by_head": by_head.tolist() if by_head is not None else None,
        "by_channel": by_channel.tolist() if by_channel is not None else None,
    }


def _row_blocks(x, rows: int, width: int):
    """``(rows, width)`` blocks of ``x`` viewed as ``(-1, width)``: a tensor's views, or a spilled
    tensor's reads (each overwritten by the next)."""
    if isinstance(x, torch.Tensor):
        flat = x.reshape(-1, width)
        for start in range(0, flat.shape[0], rows):
            yield flat[start : start + rows]
    else:
        for chunk in x.chunks(rows * width):
            yield chunk.view(-1, width)


def logits_effect(ours: torch.Tensor, ref: torch.Tensor, k: int = 5) -> dict:
    """What a logits error does to predictions, per position (batch rows concatenated).

    ``top1_agree``: 1.0 where the arg-max token is the same; ``topk_overlap``: fraction of the
    reference's top-``k`` tokens also in ours; ``kl``: KL(reference || ours) in nats, computed in
    float64 from log-softmax. Shapes: ``(batch, seq, vocab)`` in. A slice of positions at a time; a
    slice whose two sides are bitwise equal (and finite) agrees by definition (1, 1, 0) and costs one
    comparison. ``ref`` may be a spilled tensor (:class:`parity.record.store.SpilledTensor`), read by slices.
    """
    width = ours.shape[-1]
    k = min(k, width)
    rows = max(1, SLICE // max(width, 1))
    if (
        isinstance(ref, torch.Tensor)
        and ours.numel()
        and torch.equal(ours, ref)
        and all(math.isfinite(float(v)) for v in ours.aminmax())
    ):  # equal logits agree everywhere: top-1 and top-k overlap 1, KL 0
        n = ours.numel() // max(width, 1)
        top1, overlap, kl = (
            torch.ones(n, dtype=torch.float64),
            torch.ones(n, dtype=torch.float64),
            torch.zeros(n, dtype=torch.float64),
        )
        return _effect(k, top1, overlap, kl)
    top1s, overlaps, kls = [], [], []
    for a, b in zip(_row_blocks(ours, rows, width), _row_blocks(ref, rows, width)):
        n = a.shape[0]
        if a.numel() and torch.equal(a, b) and all(math.isfinite(float(v)) for v in a.aminmax()):
            top1s.append(torch.ones(n, dtype=torch.float64))
            overlaps.append(torch.ones(n, dtype=torch.float64))
            kls.append(torch.zeros(n, dtype=torch.float64))
            continue
        a, b = a.double(), b.double()
        top1s.append((a.argmax(-1) == b.argmax(-1)).double())
        ours_top = a.topk(k, dim=-1).indices
        ref_top = b.topk(k, dim=-1).indices
        overlaps.append((ref_top[:, :, None] == ours_top[:, None, :]).any(-1).double().mean(-1))
        log_p, log_q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
    return _effect(k, torch.cat(top1s), torch.cat(overlaps), torch.cat(kls))


def _effect(k: int, top1: torch.Tensor, overlap: torch.Tensor, kl: torch.Tensor) -> dict:
    return {
        "k": k,
        "top1_agree": top1.tolist(),
        "topk_overlap": overlap.tolist(),
        "kl": kl.tolist(),
        "top1_agreement": float(top1.mean()),
        "mean_topk_overlap": float(overlap.mean()),
        "mean_kl": float(kl.mean()),
    }
