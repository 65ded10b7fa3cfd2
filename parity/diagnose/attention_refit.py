"""An attention whose internals parity could not read in ours (a weight absorbed into the query, MLA's
``q @ W_UK``; a fused kernel), judged at its output projection: ours' context (that projection's input)
against the reference's attention recomputed from its own traced scores, probabilities and context.

The reference's values are recovered from its context and probabilities (``context = probs @ v`` per
head, solved by least squares), so no value projection needs to be traced; a context that the reference's
attention gives at another softmax temperature names the scale, any other difference names the
attention as the component (every projection feeding it agrees, or the first mismatch would be earlier).
"""

from __future__ import annotations

import math

import torch

from parity.diagnose.evidence import EXPLAINS, Evidence, golden_minimum, rel
from parity.diagnose.hints import Hint
from parity.diagnose.scales import scale_readings

#: the attention internals parity reads in a block (none of them in ours: the attention was not read)
_INTERNALS = ("q_rot", "k_rot", "scores", "probs", "context")


def unread_attention(e: Evidence) -> Hint | None:
    """The output projection of an attention block fails, parity read none of ours' internals of that
    block, and ours' context differs from the reference's: the temperature that reproduces ours' context
    (Hint ``attention_scale``), else the attention itself (``attention_internals``)."""
    if e.kind != "o_proj":
        return None
    stem = e.name.rsplit(".", 1)[0]
    if any(f"{stem}.{k}" in e.ours_trace.tensors for k in _INTERNALS):
        return None
    scores, probs, context = (e.ref_trace.tensors.get(f"{stem}.{k}") for k in ("scores", "probs", "context"))
    x_ours, _ = e.inputs()
    if scores is None or probs is None or context is None or x_ours is None or probs.dim() != 4:
        return None
    if x_ours.numel() != context.numel() or e.close(x_ours.reshape(context.shape), context):
        return None  # the context agrees: the projection itself differs, for the weight detectors
    b, h, q, _ = probs.shape
    if scores.shape != probs.shape or context.numel() % (b * h * q):
        return None
    ours = _per_head(x_ours.double(), b, h, q)
    factor = _temperature(scores.double(), probs.double(), _per_head(context.double(), b, h, q), ours)
    if factor is not None:
        return Hint(
            "attention_scale",
            f"likely the attention scale (softmax temperature) of an attention parity could not read in ours: "
            f"ours' context is the reference's attention with its scores times {factor:.6g}"
            f"{scale_readings(e, factor)}",
            {"factor": factor},
        )
    return Hint(
        "attention_internals",
        f"ours' attention output (the context {stem}.o_proj reads) differs from the reference's while every "
        "projection feeding it agrees, and parity read none of ours' attention internals there (a weight "
        "absorbed into the query, a fused kernel): the difference is inside that attention: its scale, mask or "
        "softmax, or the keys and values it attends over (tap them with parity.tap to be told which)",
        {"block": stem},
    )


def _per_head(context: torch.Tensor, b: int, h: int, q: int) -> torch.Tensor:
    """``(batch, seq, heads * head_dim)`` as ``(batch, heads, seq, head_dim)``."""
    return context.reshape(b, q, h, -1).transpose(1, 2)


def _temperature(scores: torch.Tensor, probs: torch.Tensor, context: torch.Tensor, ours: torch.Tensor) -> float | None:
    """The factor ``c`` (other than 1) for which ``softmax(c * scores + mask) @ v`` is ours' context, with
    ``v`` solved from the reference's own ``context = probs @ v`` and the mask where its probabilities are
    zero; None when the reference's own attention cannot be recomputed so, or no factor explains ours."""
    allowed = probs > 0
    values = torch.linalg.lstsq(probs, context).solution
    if rel(probs @ values, context) > 1e-6:
        return None

    def residual(log_c: float) -> float:
        logits = (math.exp(log_c) * scores).masked_fill(~allowed, float("-inf"))
        return rel(torch.softmax(logits, -1).nan_to_num(0.0) @ values, ours)

    log_c = golden_minimum(residual, [math.log(0.02) + i * (math.log(50.0) - math.log(0.02)) / 80 for i in range(81)])
    factor = math.exp(log_c)
    if residual(log_c) > EXPLAINS or abs(factor - 1) < 1e-3:
        return None
    return factor
