"""Normalisation layers: RMSNorm and LayerNorm in the variants the reference models use.

The formulas are textbook; what differs between references is *where they round* in bfloat16
(normalise in float32, then multiply by the weight before or after casting back) and whether the
weight is ``w`` or ``1 + w``. Each option below names the Transformers class it matches bit for bit
(tests/test_blocks.py instantiates those classes and compares).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension: ``y = x / sqrt(mean(x^2) + eps) * scale``.

    Zhang & Sennrich 2019 ("Root Mean Square Layer Normalization"). ``x_hat`` is always computed in
    float32; then

    * default, ``scale = w``: multiplied in float32, cast last: ``(w * x_hat).to(dtype)``
      (``Olmo3RMSNorm``, ``Gemma4RMSNorm``);
    * ``cast_first``: ``w * x_hat.to(dtype)``, the multiply in the input dtype (``LlamaRMSNorm``,
      ``Qwen3RMSNorm``, ``MistralRMSNorm``);
    * ``unit_offset``: ``scale = 1 + w`` in float32, ``w`` initialised to zeros, cast last
      (``Gemma3RMSNorm``, ``Qwen3_5RMSNorm``);
    * ``weight=False``: no weight at all, ``x_hat.to(dtype)`` (Gemma 4's ``v_norm``,
      ``Gemma4RMSNorm(with_scale=False)``).

    All three weighted variants are the same function in float32 and differ in bfloat16.
    ``Gemma4RMSNorm`` writes ``pow(ms + eps, -0.5)`` where the others write ``rsqrt``: torch computes
    that power with ``rsqrt`` (the same bits forward; tests/test_blocks.py), but its gradient is
    ``pow``'s, ``-0.5 * u^-1.5``, rounded otherwise than ``rsqrt``'s: ``power=True`` writes the power.
    Shapes: ``x`` is ``(..., dim)``; the output has the shape and dtype of ``x``.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        unit_offset: bool = False,
        cast_first: bool = False,
        weight: bool = True,
        power: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.power = power
        if unit_offset and cast_first:
            raise ValueError("unit_offset and cast_first together: no reference rounds that way")
        if not weight and (unit_offset or cast_first):
            raise ValueError("unit_offset and cast_first describe a weight; weight=False has none")
        self.eps, self.unit_offset, self.cast_first, self.dim = eps, unit_offset, cast_first, dim
        if weight:
            self.weight = nn.Parameter((torch.zeros if unit_offset else torch.ones)(dim, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean_square = x32.pow(2).mean(dim=-1, keepdim=True) + self.eps
        normed = x32 * (torch.pow(mean_square, -0.5) if self.power else torch.rsqrt(mean_square))
        if self.weight is None:
            return normed.to(x.dtype)
        if self.cast_first:
            return self.weight * normed.to(x.dtype)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return (self.weight * normed).to(x.dtype)

    def extra_repr(self) -> str:
        options = [name for name in ("unit_offset", "cast_first") if getattr(self, name)]
        options += ["weight=False"] if self.weight is None else []
        return ", ".join([f"{self.dim}", f"eps={self.eps}", *options])


class LayerNorm(nn.Module):
    """Mean-subtracting layer norm: ``y = w * (x - mu) / sqrt(var + eps) [+ b]`` over the last dimension.

    Ba et al. 2016 ("Layer Normalization"). Default: computed in float32 from the formula and cast
    back, with weight and no bias (``CohereLayerNorm``, ``Cohere2LayerNorm``). ``bias`` adds the
    learned shift. ``fused``: torch's own ``layer_norm`` kernel in the input dtype, exactly
    ``nn.LayerNorm`` (GPT-2, which has a bias); it rounds differently from the float32 formula.
    Shapes: ``(..., dim)`` in and out, in the input dtype.
    """

    def __init__(
        self, dim: int, eps: float = 1e-5, *, bias: bool = False, fused: bool = False, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        x32 = x.float()
        mean = x32.mean(dim=-1, keepdim=True)
        # x - mean twice, as Cohere2LayerNorm writes it: the same values as one centred tensor used twice,
        # but its gradient flows back through two subtractions, summed in the reference's order
        variance = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
        normed = (x32 - mean) * torch.rsqrt(variance + self.eps)
        out = self.weight.float() * normed
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}, fused={self.fused}"


class GatedRMSNorm(nn.Module):
    """RMSNorm, then times ``silu(gate)``: ``y = (w * x_hat.to(dtype)) * silu(gate)``, norm before gate.

    The output norm of Gated DeltaNet layers (``Qwen3_5RMSNormGated``, FLA's ``FusedRMSNormGated``
    with ``norm_before_gate``): ``x_hat`` in float32, cast to the input dtype, multiplied by ``w``
    (initialised to ones) in that dtype (Llama's order), then by ``silu(gate)`` computed in
    float32, and cast back last. Shapes: ``x`` and ``gate`` ``(..., dim)``; the output has ``x``'s
    shape and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
