"""Read a RoPE back from its effect: the rotation angle and amplitude of every frequency at every
position, and which known RoPE (or which position offset) reproduces ours.

RoPE turns each pair of dims ``(a, b)`` of a head into ``(a + i b) * A e^{i w p}`` at position ``p``
(Su et al. 2021, arXiv:2104.09864; ``A`` is 1, or the YaRN attention factor). Given the unrotated
q (or k) and a rotated one, the complex ratio per (row, position, frequency), pooled over heads by
least squares, recovers ``A`` and ``w p`` without knowing how the rotation was written. Comparing
those with the frequencies of every RoPE the architecture knows (:class:`~parity.model.facts.RopeFacts`
per layer type, the same RoPE without its scaling) names the mistake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from parity.model.facts import LayerFacts, RopeFacts, default_inv_freq


def _pairs(t: torch.Tensor, interleaved: bool, rotary_dim: int) -> torch.Tensor:
    """``(b, h, s, d)`` -> complex ``(b, h, s, rotary_dim / 2)`` of the rotated pairs."""
    t = t.double()[..., :rotary_dim]
    if interleaved:
        return torch.complex(t[..., 0::2], t[..., 1::2])
    half = rotary_dim // 2
    return torch.complex(t[..., :half], t[..., half:])


def rotation(x: torch.Tensor, y: torch.Tensor, interleaved: bool, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, weight)``: the complex factor taking ``x``'s pairs to ``y``'s, ``(b, s, f)``, pooled over
    heads by least squares (``sum y conj(x) / sum |x|^2``), and the pooled ``sum |x|^2``."""
    zx, zy = _pairs(x, interleaved, rotary_dim), _pairs(y, interleaved, rotary_dim)
    weight = zx.abs().pow(2).sum(1)
    ratio = (zy * zx.conj()).sum(1) / weight.clamp_min(1e-300)
    return ratio, weight


def rotate(x: torch.Tensor, rope: RopeFacts, positions: torch.Tensor) -> torch.Tensor:
    """``x`` ``(batch, heads, seq, head_dim)`` rotated by ``rope`` at ``positions`` ``(batch, seq)``, in
    float64 (Su et al. 2021: each pair times ``A e^{i w p}``); dims past ``rotary_dim`` pass through."""
    d = rope.rotary_dim
    z = _pairs(x, rope.interleaved, d)
    angle = positions.double()[:, None, :, None] * torch.tensor(rope.inv_freq, dtype=torch.float64)
    z = z * rope.attention_factor * torch.polar(torch.ones_like(angle), angle)
    out = x.double().clone()
    if rope.interleaved:
        out[..., 0:d:2], out[..., 1:d:2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2 : d] = z.real, z.imag
    return out


def _wrap(angle: torch.Tensor) -> torch.Tensor:
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


#: (label, sign, shift): a rotation by ``shift + sign * w p`` with this layer's frequencies ``w``
ROTATION_MISTAKES = (
    ("cos and sin swapped (each pair turned by pi/2 - w p)", -1.0, math.pi / 2),
    ("the rotation reversed (sin negated: each pair turned by -w p)", -1.0, 0.0),
    ("cos and sin swapped and sin negated (each pair turned by w p - pi/2)", 1.0, -math.pi / 2),
)


@dataclass(frozen=True)
class Fit:
    """What ours' rotation is: ``label`` names the RoPE (or offset) that reproduces it, ``amplitude``
    the cos/sin factor it applies, ``offsets`` per batch row when positions are shifted."""

    label: str
    amplitude: float
    residual: float
    offsets: tuple[int, ...] = ()
    inv_freq: tuple[float, ...] = ()
    #: per batch row, the row whose positions it was rotated at (one row's positions broadcast to the batch)
    rows: tuple[int, ...] = ()
    #: per batch row, the one position every token of it was rotated at (positions read from another axis)
    constant: tuple[int, ...] = ()
    #: the positions each token was rotated at ``(batch, seq)``, read from the rotation itself where no rule of the
    #: run's positions gives them (a stack handed another sequence's positions: BLT's bytes' for its patches)
    read: tuple[tuple[int, ...], ...] = ()
    #: the other candidates with the same frequencies (within the angle tolerance): a fit that cannot tell them apart
    same_as: tuple[str, ...] = ()
    #: read after each row was brought to the unrotated row's length (a per-token scale, or a norm after RoPE):
    #: ``amplitude`` says nothing of the cos/sin scale
    rescaled: bool = False


def _fits(
    angle: torch.Tensor, keep: torch.Tensor, inv_freq, positions: torch.Tensor, tol: float, sign=1.0, shift=0.0
) -> float | None:
    """Largest angle error (radians) of ``shift + sign * inv_freq x positions`` against ``angle`` where
    ``keep``; None if above ``tol``."""
    if len(inv_freq) != angle.shape[-1]:
        return None
    w = torch.tensor(inv_freq, dtype=torch.float64)
    predicted = shift + sign * positions.double()[..., None] * w
    err = _wrap(angle - predicted).abs()[keep]
    worst = float(err.max()) if err.numel() else 0.0
    return worst if worst <= tol else None


def _rows_of_positions(
    angle: torch.Tensor, keep: torch.Tensor, inv_freq, positions: torch.Tensor, tol: float
) -> tuple[int, ...] | None:
    """Per batch row, the row whose positions reproduce its angles, when some row is rotated at another
    row's positions (cos/sin built from ``position_ids[0]`` and broadcast over a left-padded batch); None
    when every row is at its own or none fits. Rows whose positions are all the same say nothing."""
    rows = []
    for row in range(angle.shape[0]):
        if (
            not bool(keep[row].any())
            or _fits(angle[row : row + 1], keep[row : row + 1], inv_freq, positions[row : row + 1], tol) is not None
        ):
            rows.append(row)
            continue
        source = next(
            (
                other
                for other in range(positions.shape[0])
                if other != row
                and not torch.equal(positions[other], positions[row])
                and _fits(angle[row : row + 1], keep[row : row + 1], inv_freq, positions[other : other + 1], tol)
                is not None
            ),
            None,
        )
        if source is None:
            return None
        rows.append(source)
    return tuple(rows) if rows != list(range(angle.shape[0])) else None


def identify(
    x: torch.Tensor,
    ours: torch.Tensor,
    layer: LayerFacts,
    ropes: dict[str, RopeFacts | None],
    positions: torch.Tensor,
    tol: float,
    valid: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    hidden_per_head: int | None = None,
) -> Fit | None:
    """Which RoPE turns the unrotated ``x`` into ``ours`` (both ``(b, h, s, d)``), at ``positions``
    ``(b, s)``: this layer's own RoPE, another layer type's, this one without its scaling, default
    RoPE with another theta, or this one at positions shifted per row. ``valid`` ``(b, s)``: the
    tokens to judge (padding excluded); ``hidden_per_head``: ``hidden_size / num_heads``, a head_dim a
    port may derive where the config sets another. None when nothing fits or ``ours`` is no rotation of ``x`` at
    all (pair norms not kept up to one factor)."""
    rope = layer.rope
    probe = rope if rope is not None else next((r for r in ropes.values() if r is not None), None)
    if probe is None or x.shape != ours.shape:
        return None
    ratio, weight = rotation(x, ours, probe.interleaved, probe.rotary_dim)
    keep = weight > 1e-6 * weight.max()
    if valid is not None:
        keep = keep & valid.bool()[..., None]
    amp = ratio.abs()[keep]
    if amp.numel() == 0 or float(amp.std()) > 1e-2 * float(amp.mean()):
        return None  # not one rotation with one amplitude: something else changed q/k
    amplitude = float(amp.mean())
    angle = ratio.angle()
    candidates: list[tuple[str, tuple[float, ...]]] = []
    if rope is not None:
        candidates.append(
            (f"this layer's RoPE ({layer.layer_type}: {rope.rope_type}, theta {rope.theta:g})", rope.inv_freq)
        )
        if rope.rope_type != "default":
            candidates.append(
                (
                    f"the unscaled RoPE (theta {rope.unscaled_theta:g}, no {rope.rope_type} scaling"
                    + (f": NTK alpha {rope.get('alpha'):g} left out)" if rope.get("alpha") else ")"),
                    rope.unscaled_inv_freq(),
                )
            )
    candidates += _yarn_variants(rope, layer.head_dim, max_position_embeddings)
    candidates += _longrope_variants(rope, layer.head_dim)
    candidates += _llama3_variants(rope, layer.head_dim, max_position_embeddings)
    if rope is not None and rope.rope_type == "default" and layer.head_dim and rope.rotary_dim < layer.head_dim:
        # partial rotary: theta^(-2i/r) over the rotated dims r, not over the whole head
        wide = tuple(rope.theta ** (-2 * i / layer.head_dim) for i in range(rope.rotary_dim // 2))
        unstepped = (
            f", or the exponent's arange without its step of 2 (arange(r / 2) / r: theta^(-i/{rope.rotary_dim}))"
            if layer.head_dim == 2 * rope.rotary_dim
            else ""
        )
        candidates.append(
            (
                f"default RoPE with theta {rope.theta:g} whose exponents divide by head_dim ({layer.head_dim}), not by "
                f"the rotary dims ({rope.rotary_dim}): theta^(-2i/{layer.head_dim}) where the reference has "
                f"theta^(-2i/{rope.rotary_dim}){unstepped}",
                wide,
            )
        )
    if rope is not None and rope.rope_type != "default" and layer.head_dim and rope.rotary_dim < layer.head_dim:
        # a scaled RoPE's frequencies computed for the whole head (MLA's nope + rope) and cut to the rotary dims
        whole = rope.with_parameters({"partial_rotary_factor": 1.0}, layer.head_dim, max_position_embeddings)
        if len(whole) >= rope.rotary_dim // 2:
            candidates.append(
                (
                    f"{rope.rope_type} frequencies computed over the whole head ({layer.head_dim} dims) and cut to "
                    f"its first {rope.rotary_dim // 2}, not computed over the {rope.rotary_dim} rotary dims",
                    whole[: rope.rotary_dim // 2],
                )
            )
    if (
        rope is not None
        and rope.rope_type != "default"
        and hidden_per_head
        and hidden_per_head not in (rope.rotary_dim, layer.head_dim)
    ):  # a scaled RoPE's frequencies computed over hidden_size / num_heads dims and cut to the rotary dims
        wide = rope.with_parameters({"partial_rotary_factor": 1.0}, hidden_per_head, max_position_embeddings)
        if len(wide) >= rope.rotary_dim // 2:
            candidates.append(
                (
                    f"{rope.rope_type} frequencies computed over hidden_size / num_heads ({hidden_per_head} dims) and "
                    f"cut to its first {rope.rotary_dim // 2}, not computed over the {rope.rotary_dim} rotary dims",
                    wide[: rope.rotary_dim // 2],
                )
            )
    if rope is not None and rope.rope_type == "default" and rope.rotary_dim >= 4:
        r = rope.rotary_dim  # the exponent's arange(0, r, 2) written arange(0, r / 2): half of every exponent
        candidates.append(
            (
                f"default RoPE with theta {rope.theta:g} whose exponent's arange lost its step of 2: theta^(-i/{r}) "
                f"(arange(0, {r // 2}) / {r}) where the reference has theta^(-2i/{r})",
                tuple(rope.theta ** (-i / r) for i in range(r // 2)),
            )
        )
    if rope is not None and rope.inv_freq:
        candidates.append(
            (
                "every angle doubled: this layer's RoPE applied twice (q or k rotated in two places)",
                tuple(2 * f for f in rope.inv_freq),
            )
        )
    if (
        rope is not None
        and rope.rope_type == "default"
        and hidden_per_head
        and hidden_per_head not in (rope.rotary_dim, layer.head_dim)
    ):
        narrow = tuple(rope.theta ** (-2 * i / hidden_per_head) for i in range(rope.rotary_dim // 2))
        candidates.append(
            (
                f"default RoPE with theta {rope.theta:g} whose exponents divide by hidden_size / num_heads "
                f"({hidden_per_head}), not by the head's rotary dims ({rope.rotary_dim}): the head_dim taken as "
                "hidden_size / num_heads where the config sets head_dim",
                narrow,
            )
        )
    for layer_type, other in ropes.items():
        if other is None or layer_type == layer.layer_type:
            continue
        if rope is not None and other.rope_type == rope.rope_type and other.attention_factor == rope.attention_factor:
            # the same kind of RoPE with another theta: a theta mistake, whichever layer type has it
            candidates.append(
                (
                    f"{other.rope_type} RoPE with theta {other.theta:g} (the theta of {layer_type} layers)",
                    other.inv_freq,
                )
            )
        else:
            candidates.append(
                (f"the RoPE of {layer_type} layers ({other.rope_type}, theta {other.theta:g})", other.inv_freq)
            )
            if rope is not None and other.rope_type != "default" and rope.rope_type == "default" and layer.head_dim:
                # this layer's theta with the other layer type's scaling (Gemma 3's linear factor of its global
                # layers applied to its local ones too)
                scaled = other.with_parameters({"rope_theta": rope.theta}, layer.head_dim, max_position_embeddings)
                factor = other.get("factor")
                candidates.append(
                    (
                        f"{other.rope_type} RoPE{f' (factor {factor:g})' if factor else ''} with this layer's theta "
                        f"{rope.theta:g}: the {layer_type} layers' {other.rope_type} scaling applied to this "
                        f"{layer.layer_type} layer too, whose rope_parameters have none",
                        scaled,
                    )
                )
    for i, (label, inv_freq) in enumerate(candidates):
        if not inv_freq:
            continue  # a variant that could not be computed for this layer
        worst = _fits(angle, keep, inv_freq, positions, tol)
        if worst is not None:
            # (this layer's own RoPE fitting: its frequencies are right, a variant rotating alike here is no cause)
            own = rope is not None and i == 0
            same = tuple(
                other
                for other, freqs in candidates[i + 1 :]
                if not own and freqs and _fits(angle, keep, freqs, positions, tol) is not None
            )
            return Fit(label, amplitude, worst, inv_freq=tuple(inv_freq), same_as=same)
    if rope is not None:
        # this layer's frequencies with the rotation written otherwise: cos and sin exchanged turns
        # (a + ib) e^{iwp} into (a + ib) i e^{-iwp} (angle pi/2 - wp); a negated sin rotates by -wp
        for label, sign, shift in ROTATION_MISTAKES:
            worst = _fits(angle, keep, rope.inv_freq, positions, tol, sign, shift)
            if worst is not None:
                return Fit(label, amplitude, worst, inv_freq=tuple(rope.inv_freq))
    if rope is not None:
        offsets = []
        for row in range(angle.shape[0]):
            if not bool(keep[row].any()):  # nothing to judge in this row (all padding): no offset to read
                offsets.append(0)
                continue
            best = None
            for delta in range(-angle.shape[1], angle.shape[1] + 1):
                worst = _fits(
                    angle[row : row + 1], keep[row : row + 1], rope.inv_freq, positions[row : row + 1] + delta, tol
                )
                if worst is not None:
                    best = delta
                    break
            if best is None:
                break
            offsets.append(best)
        else:
            if any(offsets):
                return Fit(
                    "this layer's RoPE at shifted positions",
                    amplitude,
                    0.0,
                    offsets=tuple(offsets),
                    inv_freq=rope.inv_freq,
                )
        constant = _constant_positions(angle, keep, rope.inv_freq, positions, tol)
        if constant is not None:
            return Fit(
                "this layer's RoPE at one position per row", amplitude, 0.0, inv_freq=rope.inv_freq, constant=constant
            )
        rows = _rows_of_positions(angle, keep, rope.inv_freq, positions, tol)
        if rows is not None:
            return Fit(
                "this layer's RoPE at another row's positions", amplitude, 0.0, inv_freq=rope.inv_freq, rows=rows
            )
        read = _read_positions(angle, keep, rope.inv_freq, positions, tol)
        if read is not None:
            return Fit("this layer's RoPE at other positions", amplitude, 0.0, inv_freq=rope.inv_freq, read=read)
        fitted = _fit_theta(angle, keep, positions, probe.rotary_dim)
        # the fit reads frequency 1, which a scaling (llama3's smooth band) may move: the thetas templates
        # hard-code are tried too
        for theta in ([fitted] if fitted is not None else []) + [t for t in COMMON_THETAS if t != fitted]:
            if abs(theta / rope.theta - 1) <= 1e-3:
                continue
            for label, inv_freq in (
                (
                    f"{rope.rope_type} RoPE with theta {theta:.6g}",
                    rope.with_theta(theta, layer.head_dim, max_position_embeddings),
                ),
                (f"default RoPE with theta {theta:.6g}", default_inv_freq(theta, probe.rotary_dim)),
            ):
                worst = _fits(angle, keep, inv_freq, positions, tol)
                if worst is not None:
                    return Fit(label, amplitude, worst, inv_freq=inv_freq)
    return None


def _read_positions(
    angle: torch.Tensor, keep: torch.Tensor, inv_freq, positions: torch.Tensor, tol: float
) -> tuple[tuple[int, ...], ...] | None:
    """The integer position of each token ``(batch, seq)`` that this RoPE's frequencies turn it by, read from its
    slowest frequency (a turn below pi over the run's positions) and confirmed at every frequency; None where they
    are the run's own or no integer positions reproduce the angles."""
    if not inv_freq:
        return None
    slow = min(range(len(inv_freq)), key=lambda i: inv_freq[i])
    f = float(inv_freq[slow])
    if f <= 0 or f * (int(positions.max()) + positions.shape[-1]) >= math.pi:
        return None  # the slowest frequency wraps within the positions a run holds: no unique reading
    read = torch.round(angle[..., slow] / f).long()  # (batch, seq)
    if bool((read == read[:, :1]).all()):
        return None  # one position per row (none rotated at all: a NoPE layer or RoPE left out) is others' to name
    if (
        torch.equal(read[keep.any(-1)], positions.long()[keep.any(-1)])
        or _fits(angle, keep, inv_freq, read, tol) is None
    ):
        return None
    return tuple(tuple(int(p) for p in row) for row in read)


#: thetas a template or a default hard-codes (Llama 2's 10000, Llama 3's 500000, Qwen's 1e6, ...)
COMMON_THETAS = (10000.0, 50000.0, 100000.0, 500000.0, 1000000.0, 5000000.0, 10000000.0)


def _constant_positions(
    angle: torch.Tensor, keep: torch.Tensor, inv_freq, positions: torch.Tensor, tol: float
) -> tuple[int, ...] | None:
    """Per batch row, the one position every token of it was rotated at, when each row has one and the
    tokens' own positions do not all equal it (a seq-first RoPE cache sliced by the batch axis: row b at
    position b); None otherwise."""
    found = []
    for row in range(angle.shape[0]):
        if not bool(keep[row].any()):
            found.append(-1)
            continue
        hit = next(
            (
                c
                for c in range(angle.shape[1] + 1)
                if _fits(
                    angle[row : row + 1],
                    keep[row : row + 1],
                    inv_freq,
                    torch.full_like(positions[row : row + 1], c),
                    tol,
                )
                is not None
            ),
            None,
        )
        if hit is None:
            return None
        found.append(hit)
    if all(bool((positions[row][keep[row].any(-1)] == c).all()) for row, c in enumerate(found) if c >= 0):
        return None  # the tokens' own positions: no rotation to explain
    if all(c <= 0 for c in found):
        return None  # position 0 everywhere is no rotation at all: a RoPE not applied, named as such
    return tuple(found)


def _longrope_variants(rope, head_dim: int = 0) -> list[tuple[str, tuple[float, ...]]]:
    """LongRoPE (Phi-3, PhiMoE: ``_compute_longrope_parameters``) divides each default frequency by a factor
    of ``short_factor`` while the sequence fits ``original_max_position_embeddings``, of ``long_factor``
    past it: the other list, or none, as a port may take it; the factors multiplied in where they divide;
    with partial rotary and ``head_dim``, the exponents over the whole head (``theta^(-2i/head_dim)``)."""
    if rope is None or rope.rope_type != "longrope":
        return []
    short, long = rope.get("short_factor"), rope.get("long_factor")
    base = default_inv_freq(rope.theta, rope.rotary_dim)
    n = len(base)
    wide = (
        tuple(rope.theta ** (-2 * i / head_dim) for i in range(n)) if head_dim and head_dim != rope.rotary_dim else ()
    )
    original = rope.get("original_max_position_embeddings")
    # the other list first (the likelier port), then each list misread: multiplied in, or over the whole head
    other_list: list[tuple[str, tuple[float, ...]]] = []
    misread: list[tuple[str, tuple[float, ...]]] = []
    for label, factors in (("short_factor", short), ("long_factor", long)):
        if factors is None or len(factors) != n:
            continue
        inv_freq = tuple(f / float(a) for f, a in zip(base, factors, strict=True))
        if any(abs(a / b - 1) > 1e-6 for a, b in zip(inv_freq, rope.inv_freq, strict=False)):
            other_list.append(
                (
                    f"LongRoPE with {label} (the frequencies divided by its factors) where the config takes the "
                    f"other list (original_max_position_embeddings {original} decides which, by the sequence "
                    "length)",
                    inv_freq,
                )
            )
        misread.append(
            (
                f"LongRoPE with its {label} multiplying the frequencies (inv_freq * factor) where LongRoPE divides "
                "them (1 / (factor * theta^(2i/d)))",
                tuple(f * float(a) for f, a in zip(base, factors, strict=True)),
            )
        )
        if wide:
            misread.append(
                (
                    f"LongRoPE whose exponents divide by head_dim ({head_dim}), not by the rotary dims "
                    f"({rope.rotary_dim}): 1 / ({label} * theta^(2i/{head_dim})) where the config gives "
                    f"theta^(2i/{rope.rotary_dim})",
                    tuple(f / float(a) for f, a in zip(wide, factors, strict=True)),
                )
            )
    out = other_list + misread
    out.append(("LongRoPE without its factors (the default frequencies, theta " + f"{rope.theta:g})", base))
    return out


def _yarn_variants(
    rope: RopeFacts | None, head_dim: int = 0, max_position_embeddings: int | None = None
) -> list[tuple[str, tuple[float, ...]]]:
    """YaRN's frequencies written otherwise (Peng et al. 2023; Transformers' ``_compute_yarn_parameters``):
    every frequency divided by the factor (linear position interpolation, ``rope_type`` yarn read as
    linear), the ramp used the wrong way round (interpolation where it extrapolates), the interpolated
    frequencies multiplied by the factor; with ``head_dim``, the correction range's bounds not truncated
    (or truncated where ``truncate`` is false) and the range computed from ``max_position_embeddings`` in
    place of ``original_max_position_embeddings``. The ramp's per-dimension blend is read back from the
    layer's own frequencies: ``inv = interp (1 - m) + extrap m``."""
    if rope is None or rope.rope_type != "yarn" or not rope.inv_freq:
        return []
    factor = float(cast(float, rope.parameters.get("factor", 1.0)) or 1.0)
    if factor <= 1.0:
        return []
    extrap = torch.tensor(rope.unscaled_inv_freq(), dtype=torch.float64)
    interp = extrap / factor
    inv = torch.tensor(rope.inv_freq, dtype=torch.float64)
    blend = ((inv - interp) / (extrap - interp)).clamp(0.0, 1.0)  # 1: extrapolated (kept), 0: interpolated
    inverted = interp * blend + extrap * (1 - blend)
    out = [
        (
            f"linear position interpolation: every frequency divided by the YaRN factor {factor:g} (rope_type yarn "
            "read as linear, no ramp)",
            tuple(interp.tolist()),
        ),
        (
            "YaRN with its ramp the wrong way round: the high-frequency dims interpolated and the low-frequency dims "
            "kept, where YaRN keeps the high ones and interpolates the low ones",
            tuple(inverted.tolist()),
        ),
        (
            f"YaRN with its interpolated frequencies multiplied by the factor {factor:g} where they are divided by it",
            tuple((extrap * factor * (1 - blend) + extrap * blend).tolist()),
        ),
    ]
    if not head_dim:
        return out
    truncate = bool(rope.parameters.get("truncate", True))
    out.append(
        (
            "YaRN with its correction range's bounds "
            + ("left unrounded (truncate is true: floor and ceil them)" if truncate else "rounded (truncate is false)"),
            _recomputed(rope, {"truncate": not truncate}, head_dim, max_position_embeddings),
        )
    )
    fast, slow = (rope.parameters.get(k) for k in ("beta_fast", "beta_slow"))
    fast, slow = float(cast(float, fast or 32.0)), float(cast(float, slow or 1.0))
    if fast != slow:  # the two betas read each for the other: the ramp's ends swapped
        out.append(
            (
                f"YaRN with its correction range from beta_fast and beta_slow swapped (beta_fast {slow:g}, "
                f"beta_slow {fast:g})",
                _recomputed(rope, {"beta_fast": slow, "beta_slow": fast}, head_dim, max_position_embeddings),
            )
        )
    return out + _from_max_positions(rope, "YaRN with its correction range computed", head_dim, max_position_embeddings)


def _from_max_positions(
    rope: RopeFacts, what: str, head_dim: int, max_position_embeddings: int | None
) -> list[tuple[str, tuple[float, ...]]]:
    """``rope``'s frequencies with ``original_max_position_embeddings`` taken from ``max_position_embeddings``
    (``what``: the variant's name), where the two differ; else nothing."""
    original = rope.parameters.get("original_max_position_embeddings")
    if (
        not head_dim
        or not max_position_embeddings
        or not original
        or int(cast(int, original)) == max_position_embeddings
    ):
        return []
    changes = {"original_max_position_embeddings": max_position_embeddings}
    return [
        (
            f"{what} from max_position_embeddings ({max_position_embeddings}), not original_max_position_embeddings "
            f"({int(cast(int, original))})",
            _recomputed(rope, changes, head_dim, max_position_embeddings),
        )
    ]


def _recomputed(
    rope: RopeFacts, changes: dict, head_dim: int, max_position_embeddings: int | None
) -> tuple[float, ...]:
    """``rope``'s frequencies had its parameters held ``changes``, computed over ``head_dim`` or, where that gives
    another number of frequencies than the layer's (MLA: Youtu's config.head_dim is the rope width alone, the
    facts' the whole head), over the rotary dims; () when neither does."""
    for dims in dict.fromkeys((head_dim, rope.rotary_dim)):
        inv = rope.with_parameters(changes, dims, max_position_embeddings)
        if len(inv) == len(rope.inv_freq):
            return inv
    return ()


def _llama3_variants(
    rope: RopeFacts | None, head_dim: int = 0, max_position_embeddings: int | None = None
) -> list[tuple[str, tuple[float, ...]]]:
    """Llama 3's frequency scaling written otherwise (Transformers' ``_compute_llama3_parameters``): the medium
    band's blend the wrong way round (``s f / factor + (1 - s) f`` for ``(1 - s) f / factor + s f``), the low and
    high frequency factors exchanged, and the old context length taken from ``max_position_embeddings`` in place of ``original_max_position_embeddings``."""
    if rope is None or rope.rope_type != "llama3" or not rope.inv_freq:
        return []
    p = rope.parameters
    factor = float(cast(float, p.get("factor", 1.0)) or 1.0)
    low, high = float(cast(float, p.get("low_freq_factor", 1.0))), float(cast(float, p.get("high_freq_factor", 4.0)))
    old = float(cast(float, p.get("original_max_position_embeddings", 0)) or 0)
    if factor <= 1.0 or not old or high <= low:
        return []
    f = torch.tensor(rope.unscaled_inv_freq(), dtype=torch.float64)
    wavelength = 2 * math.pi / f
    s = ((old / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    medium = (wavelength <= old / low) & (wavelength >= old / high)
    scaled = torch.where(wavelength > old / low, f / factor, f)
    inverted = torch.where(medium, s * f / factor + (1 - s) * f, scaled)
    # the factors exchanged, through the formula as written (its band tests and blend with low and high swapped)
    exchanged = torch.where(wavelength > old / high, f / factor, f)
    blend = (old / wavelength - high) / (low - high)
    band = (wavelength >= old / low) & (wavelength <= old / high)
    exchanged = torch.where(band, (1 - blend) * exchanged / factor + blend * exchanged, exchanged)
    out = [
        (
            "llama3 scaling with its medium band blended the wrong way round (s f / factor + (1 - s) f, where "
            "Llama 3 has (1 - s) f / factor + s f)",
            tuple(inverted.tolist()),
        ),
        (
            f"llama3 scaling with low_freq_factor and high_freq_factor exchanged ({high:g} and {low:g} where the "
            f"config has low {low:g}, high {high:g})",
            tuple(exchanged.tolist()),
        ),
    ]
    return out + _from_max_positions(
        rope, "llama3 scaling with its old context length", head_dim, max_position_embeddings
    )


def _fit_theta(angle: torch.Tensor, keep: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> float | None:
    """Theta of a default RoPE from the rotation of frequency 1 between the first two positions of a row."""
    if angle.shape[-1] < 2 or angle.shape[1] < 2:
        return None
    step = positions[0, 1] - positions[0, 0]
    if int(step) != 1 or not bool(keep[0, :2, 1].all()):
        return None
    w1 = float(_wrap(angle[0, 1, 1] - angle[0, 0, 1]))
    if w1 <= 0:
        return None
    theta = w1 ** (-rotary_dim / 2)  # w_1 = theta^(-2/d)
    return float(f"{theta:.4g}")  # a theta is a round number; the fit's last digits are noise
