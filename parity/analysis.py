"""Where an error sits, for reports: by token position, by head, by channel; and what it does to the logits.

All functions take our tensor and the reference's (same shape, already in the reference layout)
and return plain lists of floats so results serialise to JSON.
"""

from __future__ import annotations

import torch

#: Node kinds laid out (batch, heads, seq, ...); every other node is (batch, seq, ...), or (tokens, ...)
#: when 2-D (a MoE block's router and experts work on the flattened tokens).
HEAD_MAJOR = {"q_rot", "k_rot", "scores", "probs"}
#: Node kinds (batch, seq, heads * head_dim) whose last axis splits into heads (``gate``: an
#: attention output gate, one per query head and dim).
HEAD_MERGED = {"q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "context", "gate"}


def _amax_over_all_but(diff: torch.Tensor, axis: int) -> list[float]:
    moved = diff.movedim(axis, 0)
    return moved.reshape(moved.shape[0], -1).amax(dim=1).tolist()


def error_profile(ours: torch.Tensor, ref: torch.Tensor, kind: str, head_dim: int | None = None) -> dict:
    """Max ``|ours - ref|`` per token position, per head (attention nodes) and per channel (last axis).

    Returns ``{"by_position": [...], "by_head": [...] or None, "by_channel": [...] or None}``; non-finite
    differences count as ``inf`` so they stand out. Raises ValueError if shapes differ.
    """
    if ours.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(ours.shape)} vs {tuple(ref.shape)}")
    diff = (ours.double() - ref.double()).abs().nan_to_num(nan=float("inf"))
    if diff.dim() < 2:
        return {"by_position": None, "by_head": None, "by_channel": diff.tolist()}
    head_major = kind in HEAD_MAJOR and diff.dim() == 4
    by_position = _amax_over_all_but(diff, 2 if head_major else 1 if diff.dim() > 2 else 0)
    by_head = None
    if head_major:
        by_head = _amax_over_all_but(diff, 1)
    elif kind in HEAD_MERGED and head_dim and diff.shape[-1] % head_dim == 0:
        by_head = _amax_over_all_but(diff.unflatten(-1, (-1, head_dim)), -2)
    by_channel = _amax_over_all_but(diff, -1) if diff.shape[-1] <= 4096 else None
    return {"by_position": by_position, "by_head": by_head, "by_channel": by_channel}


def logits_effect(ours: torch.Tensor, ref: torch.Tensor, k: int = 5) -> dict:
    """What a logits error does to predictions, per position (batch rows concatenated).

    ``top1_agree``: 1.0 where the arg-max token is the same; ``topk_overlap``: fraction of the
    reference's top-``k`` tokens also in ours; ``kl``: KL(reference || ours) in nats, computed in
    float64 from log-softmax. Shapes: ``(batch, seq, vocab)`` in.
    """
    a = ours.double().reshape(-1, ours.shape[-1])
    b = ref.double().reshape(-1, ref.shape[-1])
    k = min(k, a.shape[-1])
    top1 = (a.argmax(-1) == b.argmax(-1)).double()
    ours_top = a.topk(k, dim=-1).indices
    ref_top = b.topk(k, dim=-1).indices
    overlap = (ref_top[:, :, None] == ours_top[:, None, :]).any(-1).double().mean(-1)
    log_p, log_q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "k": k,
        "top1_agree": top1.tolist(),
        "topk_overlap": overlap.tolist(),
        "kl": kl.tolist(),
        "top1_agreement": float(top1.mean()),
        "mean_topk_overlap": float(overlap.mean()),
        "mean_kl": float(kl.mean()),
    }
