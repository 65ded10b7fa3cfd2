"""A cast that rounds even inside :class:`~parity.run.float64.Float64Mode` (which keeps every other cast to a low
float dtype in float64): diagnosis forms that model a narrower dtype on purpose ("the routing weights rounded
through bfloat16") need the rounding, and the semantic run's comparison runs inside the mode."""

from __future__ import annotations

import contextvars

import torch

#: set while :func:`rounded` casts: Float64Mode lets that cast through
ROUNDING = contextvars.ContextVar("parity_rounding", default=False)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back to ``x``'s dtype, inside Float64Mode too."""
    token = ROUNDING.set(True)
    try:
        return x.to(dtype).to(x.dtype)
    finally:
        ROUNDING.reset(token)
