"""Rotary position embeddings (RoPE) and their frequency-scaling variants.

RoPE: Su et al. 2021 ("RoFormer"), arXiv:2104.09864. YaRN: Peng et al. 2023, arXiv:2309.00071,
with the correction-range conventions of ``transformers.modeling_rope_utils._compute_yarn_parameters``
(floor/ceil of the range, clamp to ``[0, dim - 1]``, linear ramp over ``dim // 2`` frequencies).

Every function works in float32, because the reference computes its inverse frequencies and
angles in float32; computing them in float64 would differ in the last bits.
"""

from __future__ import annotations

import math

import torch


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """Inverse frequencies ``base^(-2i/d)`` for ``i = 0 .. d/2 - 1``. Shape ``(head_dim // 2,)``, float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (base**exponents)


def yarn_correction_range(
    head_dim: int, base: float, beta_fast: float, beta_slow: float, original_context_length: int
) -> tuple[float, float]:
    """Dimension band ``[low, high]`` between pure extrapolation and pure interpolation (YaRN eq. 17-18).

    The dimension index at which a frequency makes ``r`` full rotations over the original context is
    ``d * ln(L / (2 pi r)) / (2 ln(base))``. ``beta_fast`` rotations give ``low`` (floored),
    ``beta_slow`` give ``high`` (ceiled); the band is clamped to ``[0, head_dim - 1]``.
    """

    def dim_for_rotations(rotations: float) -> float:
        return head_dim * math.log(original_context_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(dim_for_rotations(beta_fast))
    high = math.ceil(dim_for_rotations(beta_slow))
    return max(low, 0), min(high, head_dim - 1)


def yarn_inv_freq(
    head_dim: int,
    base: float,
    factor: float,
    original_context_length: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """YaRN "NTK-by-parts" inverse frequencies. Shape ``(head_dim // 2,)``, float32.

    Frequencies below the band are interpolated (divided by ``factor``), above it extrapolated
    (kept), and blended linearly inside it.
    """
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)  # the reference's rounding order, not extrapolated / factor (F18)
    low, high = yarn_correction_range(head_dim, base, beta_fast, beta_slow, original_context_length)
    if low == high:
        high += 0.001  # a zero-width band would divide by zero; the reference widens it the same way
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the extrapolated (unchanged) frequency
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_attention_factor(factor: float) -> float:
    """Default YaRN magnitude correction ``0.1 ln(s) + 1`` (YaRN eq. 22, sqrt(1/t)); 1.0 when ``s <= 1``."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_cos_sin(
    inv_freq: torch.Tensor, seq_len: int, attention_factor: float = 1.0, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables for positions ``0 .. seq_len - 1``, scaled by ``attention_factor``.

    Shapes ``(seq_len, head_dim)``, float32. Half-split layout repeats the ``d/2`` angles as
    ``[a0..a_{d/2-1}, a0..a_{d/2-1}]``; the interleaved layout as ``[a0, a0, a1, a1, ...]``.
    """
    positions = torch.arange(seq_len, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, in_input_dtype: bool = False
) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, heads, seq, head_dim)`` by position.

    Half-split pairing rotates dimension ``i`` with ``i + d/2`` (GPT-NeoX / Llama layout);
    interleaved pairing rotates ``2i`` with ``2i + 1`` (the RoFormer paper, Cohere).
    ``cos``/``sin`` are ``(seq, head_dim)`` from :func:`rope_cos_sin` with the same layout.
    The rotation runs in float32 and is cast back to ``x``'s dtype (OLMo 3, Cohere 2), or with
    ``in_input_dtype`` entirely in ``x``'s dtype with cos/sin rounded to it first (Llama: its
    rotary embedding returns cos/sin in the activation dtype). Identical in float32.
    """
    if in_input_dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if interleaved:
            rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
        else:
            half = x.shape[-1] // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
    x32 = x.float()
    if interleaved:
        even, odd = x32[..., 0::2], x32[..., 1::2]
        rotated = torch.stack([-odd, even], dim=-1).flatten(-2)
    else:
        half = x32.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def llama3_inv_freq(
    head_dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context_length: int,
) -> torch.Tensor:
    """Llama 3 frequency scaling ("rope_type": "llama3"). Shape ``(head_dim // 2,)``, float32.

    Meta's Llama 3.1 release (``apply_scaling`` in meta-llama/llama-models; Llama 3 paper,
    arXiv:2407.21783), as ``transformers.modeling_rope_utils._compute_llama3_parameters`` computes
    it. With wavelength ``lam = 2 pi / w`` of each default frequency ``w`` and ``L`` the original
    context length:

    * ``lam < L / high_freq_factor`` (high frequencies): ``w`` unchanged;
    * ``lam > L / low_freq_factor`` (low frequencies): ``w / factor``;
    * in between: ``(1 - s) * w / factor + s * w`` with ``s = (L / lam - low_freq_factor) /
      (high_freq_factor - low_freq_factor)``, a linear blend of the two.

    The blend is evaluated as ``((1 - s) * w) / factor + s * w``, the reference's operation order;
    tests/test_llama3.py checks bit-for-bit agreement in float32.
    """
    inv_freq = default_inv_freq(head_dim, base)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_context_length / low_freq_factor  # longer than this: interpolate
    high_freq_wavelen = original_context_length / high_freq_factor  # shorter than this: keep
    smooth = (original_context_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    kept_or_blended = torch.where(wavelen < high_freq_wavelen, inv_freq, blended)
    return torch.where(wavelen > low_freq_wavelen, inv_freq / factor, kept_or_blended)
