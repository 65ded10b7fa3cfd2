"""Rotary position embeddings (RoPE) from a Transformers-5 ``rope_parameters`` dict.

RoPE: Su et al. 2021 ("RoFormer"), arXiv:2104.09864: pair ``(x_a, x_b)`` of a head at position
``m`` is rotated by the angle ``m * w_i``, with inverse frequency ``w_i = theta^(-2i/d)``.

Three steps, each a function:

* :func:`rope_init`: a rope dict (``{"rope_type": ..., "rope_theta": ..., ...}``, the shape
  Transformers 5 stores per layer type) and a head_dim -> inverse frequencies ``(rotary_dim // 2,)``
  float32 and the attention factor that scales cos/sin. The frequency-scaling variants follow
  ``transformers.modeling_rope_utils`` (``ROPE_INIT_FUNCTIONS``) operation by operation, because
  a formula with two rounding orders (``(1/b)/f`` or ``1/(f*b)``) differs in the last bit;
* :func:`rope_cos_sin`: one angle per rotated pair, ``(positions, rotary_dim // 2)`` float32;
* :func:`apply_rope`: rotate the first ``rotary_dim`` dims of each head, half-split pairs
  (``i`` with ``i + rotary_dim/2``: GPT-NeoX, Llama) or interleaved pairs (``2i`` with ``2i + 1``:
  the RoFormer paper, Cohere).

Every frequency is computed in float32, as the reference does; float64 would differ in the last bits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

#: keys each rope_type reads besides ``rope_type`` and ``rope_theta`` (Transformers 5 names)
ROPE_KEYS = {
    "default": {"partial_rotary_factor"},
    "linear": {"factor", "partial_rotary_factor"},
    "llama3": {
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "partial_rotary_factor",
    },
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
        "mscale",
        "mscale_all_dim",
        "partial_rotary_factor",
    },
    "proportional": {"factor", "partial_rotary_factor"},
}


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """Dimensions of a head that rotate: ``int(head_dim * partial_rotary_factor)`` (the rest pass through)."""
    return int(head_dim * partial_rotary_factor)


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """``base^(-2i/dim)`` for ``i = 0 .. dim/2 - 1``; ``(dim // 2,)`` float32 (``compute_default_rope_parameters``)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def linear_inv_freq(dim: int, base: float, factor: float) -> torch.Tensor:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): every frequency divided by
    ``factor`` (``_compute_linear_scaling_rope_parameters``). ``(dim // 2,)`` float32."""
    return default_inv_freq(dim, base) / factor


def proportional_inv_freq(head_dim: int, base: float, factor: float, partial_rotary_factor: float) -> torch.Tensor:
    """Gemma 4's "proportional" RoPE (``_compute_proportional_rope_parameters``): the first
    ``int(partial * head_dim // 2)`` frequencies are ``base^(-2i/head_dim)`` (exponents over the
    *whole* head_dim), the rest are 0 (those pairs never turn), all divided by ``factor``.
    ``(head_dim // 2,)`` float32: the rotation spans the whole head, pairing ``i`` with ``i + head_dim/2``."""
    n_rotating = int(partial_rotary_factor * head_dim // 2)
    rotating = 1.0 / (base ** (torch.arange(0, 2 * n_rotating, 2, dtype=torch.float32) / head_dim))
    still = torch.zeros(head_dim // 2 - n_rotating, dtype=torch.float32)
    return torch.cat([rotating, still]) / factor


def llama3_inv_freq(
    dim: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float, original_context_length: int
) -> torch.Tensor:
    """Llama 3 frequency scaling ("rope_type": "llama3"). ``(dim // 2,)`` float32.

    Meta's Llama 3.1 release (``apply_scaling`` in meta-llama/llama-models; arXiv:2407.21783), in
    the operation order of ``_compute_llama3_parameters``. With wavelength ``lam = 2 pi / w`` of
    each default frequency ``w`` and ``L`` the original context length:

    * ``lam < L / high_freq_factor`` (high frequencies): ``w`` unchanged;
    * ``lam > L / low_freq_factor`` (low frequencies): ``w / factor``;
    * in between: ``((1 - s) * w) / factor + s * w`` with ``s = (L / lam - low_freq_factor) /
      (high_freq_factor - low_freq_factor)``, a linear blend of the two.
    """
    inv_freq = default_inv_freq(dim, base)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_context_length / low_freq_factor  # longer than this: interpolate
    high_freq_wavelen = original_context_length / high_freq_factor  # shorter than this: keep
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def yarn_correction_range(
    dim: int, base: float, beta_fast: float, beta_slow: float, original_context_length: int, truncate: bool = True
) -> tuple[float, float]:
    """Dimension band ``[low, high]`` between pure extrapolation and pure interpolation (YaRN eq. 17-18).

    The dimension index at which a frequency makes ``r`` full rotations over the original context is
    ``(d * ln(L / (2 pi r))) / (2 ln(base))``. ``beta_fast`` rotations give ``low``, ``beta_slow``
    give ``high``; with ``truncate`` (the default) ``low`` is floored and ``high`` ceiled; the band is
    clamped to ``[0, dim - 1]`` (``find_correction_range`` in ``_compute_yarn_parameters``).
    """

    def dim_for_rotations(rotations: float) -> float:
        return (dim * math.log(original_context_length / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_context_length: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN "NTK-by-parts" inverse frequencies (Peng et al. 2023, arXiv:2309.00071). ``(dim // 2,)`` float32.

    Frequencies below the band are interpolated, ``1 / (factor * base^(2i/d))`` (this rounding
    order, not ``base^(-2i/d) / factor``: the two differ by an ulp for some factors), above it
    extrapolated (kept), and blended linearly inside it; operation order of ``_compute_yarn_parameters``.
    """
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    low, high = yarn_correction_range(dim, base, beta_fast, beta_slow, original_context_length, truncate)
    if low == high:
        high += 0.001  # a zero-width band would divide by zero; the reference widens it the same way
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the extrapolated (unchanged) frequency
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN magnitude correction of cos/sin: ``0.1 ln(s) + 1`` (YaRN eq. 22, sqrt(1/t)); 1.0 when
    ``s <= 1``. With both ``mscale`` and ``mscale_all_dim`` (DeepSeek): ``g(s, mscale) / g(s, mscale_all_dim)``
    with ``g(s, m) = 0.1 m ln(s) + 1``."""

    def g(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(g(factor, mscale) / g(factor, mscale_all_dim))
    return g(factor)


def default_or_yarn(base: float, yarn: Mapping | None) -> dict:
    """A Transformers-5 rope dict from a config's ``rope_base`` and optional ``rope_yarn`` (``factor``,
    ``original_context_length``, ``beta_fast``, ``beta_slow``, ``attention_factor`` or None): default
    RoPE with that theta, or YaRN (arXiv:2309.00071) over it."""
    if yarn is None:
        return {"rope_type": "default", "rope_theta": base}
    params = {
        "rope_type": "yarn",
        "rope_theta": base,
        "factor": yarn["factor"],
        "original_max_position_embeddings": yarn["original_context_length"],
        "beta_fast": yarn["beta_fast"],
        "beta_slow": yarn["beta_slow"],
    }
    if yarn["attention_factor"] is not None:
        params["attention_factor"] = yarn["attention_factor"]
    return params


def rope_init(params: Mapping, head_dim: int, max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(rotary_dim // 2,)`` float32 and the cos/sin attention factor of one rope dict.

    ``params``: Transformers 5 ``rope_parameters`` of one layer type, e.g. ``{"rope_type": "yarn",
    "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 8192}``. ``rope_type``:
    ``default``, ``linear``, ``llama3``, ``yarn`` or ``proportional``; ``partial_rotary_factor``
    below 1 rotates only the first ``int(head_dim * partial)`` dims of each head (the table is
    narrower; ``proportional`` instead keeps the full width with zero frequencies).
    ``max_position_embeddings`` only serves YaRN without a ``factor`` (then ``max / original``).

    Bit-identical to ``ROPE_INIT_FUNCTIONS[rope_type]`` (and to the default of a model whose
    ``compute_default_rope_parameters`` reads ``partial_rotary_factor``, e.g. Qwen3.5); tests/test_rope.py.
    Where a reference's own default RoPE ignores ``partial_rotary_factor`` (Llama), its family must
    refuse it. Note: Transformers' YaRN reads ``truncate`` from the *top level* of
    ``config.rope_parameters``, so a per-layer-type dict's ``truncate`` is ignored there; a family
    with per-layer-type RoPE must not pass it.

    Raises:
        ValueError: an unknown ``rope_type``, a key this type does not read (``dynamic`` and
            ``longrope`` are refused: they depend on the sequence length), a missing required key.
    """
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_KEYS)})")
    extra = set(params) - ROPE_KEYS[rope_type] - {"rope_type", "rope_theta"}
    if extra:
        raise ValueError(f"rope_type {rope_type!r} does not read {', '.join(sorted(extra))}")

    def need(key: str):
        if params.get(key) is None:
            raise ValueError(f"rope_type {rope_type!r} needs {key!r}")
        return params[key]

    base = need("rope_theta")
    partial = params.get("partial_rotary_factor", 1.0)
    dim = rotary_dim(head_dim, partial)
    if rope_type == "default":
        return default_inv_freq(dim, base), 1.0
    if rope_type == "linear":
        return linear_inv_freq(dim, base, need("factor")), 1.0
    if rope_type == "proportional":
        return proportional_inv_freq(head_dim, base, params.get("factor", 1.0), partial), 1.0
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return llama3_inv_freq(dim, base, *(need(k) for k in keys)), 1.0
    # yarn
    original = need("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("rope_type 'yarn' without 'factor' needs max_position_embeddings (factor = max/original)")
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, params.get("mscale"), params.get("mscale_all_dim"))
    beta_fast = params.get("beta_fast") or 32  # 0 and None mean the default, as in the reference
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)
    return yarn_inv_freq(dim, base, factor, original, beta_fast, beta_slow, truncate), float(attention_factor)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: int | torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of each pair's angle ``p * w_i``, times ``attention_factor``.

    ``positions``: a sequence length (positions ``0 .. n - 1``), a tensor ``(seq,)``, or per-row
    positions ``(batch, seq)`` (left-padded batches). Returns two ``(..., seq, rotary_dim // 2)``
    float32 tables on ``inv_freq``'s device, one column per rotated pair (:func:`pair_layout` spreads
    them over dimensions). Same float32 operations as the references' rotary embeddings (one product
    ``p * w`` per angle).
    """
    if isinstance(positions, int):
        positions = torch.arange(positions, device=inv_freq.device)
    angles = positions.float()[..., None] * inv_freq.float()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def pair_layout(table: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """One column per pair ``(..., rotary_dim // 2)`` -> one per dimension ``(..., rotary_dim)``:
    ``[c0 .. c_{n-1}, c0 .. c_{n-1}]`` for half-split pairs, ``[c0, c0, c1, c1, ...]`` for interleaved
    pairs; the layout the references' rotary embeddings return their cos/sin in."""
    return table.repeat_interleave(2, dim=-1) if interleaved else torch.cat([table, table], dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False, upcast: bool = False
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of each head of ``x``; the rest pass through.

    ``x``: ``(batch, heads, seq, head_dim)``; ``cos``/``sin``: ``(seq, rotary_dim // 2)`` from
    :func:`rope_cos_sin` (float32, or already rounded to the activation dtype as most references
    return them). Each pair ``(a, b)`` becomes ``(a cos - b sin, b cos + a sin)``, written as the
    references write it, ``x * cos + partner * sin`` with ``partner = (-b, a)``:

    * half-split pairing (``interleaved=False``): ``a = x[i]``, ``b = x[i + rotary_dim/2]``
      (``rotate_half`` in Llama, Qwen, Gemma, OLMo);
    * interleaved pairing: ``a = x[2i]``, ``b = x[2i + 1]`` (Cohere);

    with the tables laid out to match by :func:`pair_layout`.

    The arithmetic runs in the promoted dtype of ``x`` and the tables (float32 tables rotate in
    float32: OLMo 3; tables in the activation dtype rotate in it: Llama), or with ``upcast`` in
    float32 on tables rounded to the activation dtype (Cohere 2). The result has ``x``'s dtype.
    """
    if cos.dim() == 3:  # per-row positions (batch, seq, rotary_dim // 2)
        cos, sin = cos[:, None], sin[:, None]
    n = 2 * cos.shape[-1]
    # the ops in the references' order (x * cos first, then rotate_half: its first half, its second, the
    # negation, the concatenation), and no slice when every dim rotates: the forward is the same either
    # way, but the gradient reaching x sums its three parts in the order autograd meets them
    x_rot, x_pass = (x, None) if n == x.shape[-1] else (x[..., :n], x[..., n:])
    if upcast:
        x_rot = x_rot.float()
    cos, sin = pair_layout(cos, interleaved), pair_layout(sin, interleaved)
    first = x_rot * cos
    if interleaved:
        a, b = x_rot[..., 0::2], x_rot[..., 1::2]
        partner = torch.stack([-b, a], dim=-1).flatten(-2)
    else:
        a, b = x_rot[..., : n // 2], x_rot[..., n // 2 :]
        partner = torch.cat([-b, a], dim=-1)
    rotated = (first + partner * sin).to(x.dtype)
    return rotated if x_pass is None else torch.cat([rotated, x_pass], dim=-1)
