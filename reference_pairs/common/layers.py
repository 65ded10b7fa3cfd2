"""Building blocks shared by the from-scratch models: norms, taps, the gated feed-forward.

Written from the formulas; nothing here imports Transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Tap(nn.Identity):
    """Names a tensor that is computed outside any module (post-RoPE q/k, softmax output, ...).

    It returns its input unchanged; a forward hook on it sees the tensor and a forward pre-hook can
    replace it. With no hook registered the call costs one Python function call.
    """


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``y = w * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Zhang & Sennrich 2019 ("Root Mean Square Layer Normalization"). Normalises in float32 and
    multiplies by the weight *before* casting back, as ``transformers`` ``Olmo3RMSNorm`` does; Llama
    casts first and multiplies after (see ``reference_pairs.llama3.model.Llama3RMSNorm``), which
    differs in bf16.

    Shapes: ``x`` is ``(..., dim)``; the output has the shape and dtype of ``x``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """Mean-subtracting layer norm, optionally without bias: ``y = w * (x - mu) / sqrt(var + eps) [+ b]``.

    Ba et al. 2016 ("Layer Normalization"). Computed in float32 and cast back, as
    ``transformers`` ``CohereLayerNorm`` does. Shapes: ``(..., dim)`` in and out.
    """

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        centered = x32 - x32.mean(dim=-1, keepdim=True)
        normed = centered * torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        out = self.weight.float() * normed
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``fc3(silu(fc1(x)) * fc2(x))``.

    Shazeer 2020 ("GLU Variants Improve Transformer"). ``fc1`` is the gate (Transformers
    ``gate_proj``), ``fc2`` the up projection (``up_proj``), ``fc3`` the down projection
    (``down_proj``). Shapes: ``(batch, seq, emb_dim)`` -> ``(batch, seq, emb_dim)``.
    """

    def __init__(self, emb_dim: int, hidden_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.fc1 = nn.Linear(emb_dim, hidden_dim, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(emb_dim, hidden_dim, bias=False, dtype=dtype)
        self.fc3 = nn.Linear(hidden_dim, emb_dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))
