"""A token shift read wrong: a projection whose input mixes each token with its neighbour (RWKV's ``time_mix``:
``x * mix + x_prev * (1 - mix)``, per channel) where the two sides mix otherwise.

The mixed value is no node; the projection's kept input is. Both sides' inputs are fitted per channel as
``a * h + b * h_prev + c * h_next`` over an earlier node ``h`` of the same shape (the norm before the mixing),
``h_prev`` / ``h_next`` that node shifted by one token (zero past the ends, as RWKV's first token reads a zero
state): a fit that reproduces both inputs says which term moved (Peng et al. 2023, RWKV: Reinventing RNNs for the
Transformer Era; Transformers' ``RwkvSelfAttention`` / ``RwkvFeedForward``). Either side.
"""

from __future__ import annotations

import torch

from parity.diagnose.evidence import Evidence, rel
from parity.diagnose.hints import Hint

#: relative residual below which the fit reproduces an input
_FITS = 1e-4
#: a term's weight below this (relative to the largest) is no term
_NONE = 1e-3


def _shifted(h: torch.Tensor, by: int) -> torch.Tensor:
    """``h`` ``(batch, seq, channels)`` moved ``by`` tokens along the sequence, zeros where nothing moved in."""
    out = torch.zeros_like(h)
    if by > 0:
        out[:, by:] = h[:, :-by]
    else:
        out[:, :by] = h[:, -by:]
    return out


def _fit(x: torch.Tensor, bases: list[torch.Tensor]) -> tuple[torch.Tensor, float] | None:
    """Per channel least squares ``x ~= sum_k w[k, c] * bases[k]``: ``(w (k, channels), relative residual)``."""
    a = torch.stack([b.flatten(0, -2) for b in bases], -1).transpose(0, 1)  # (channels, tokens, k)
    y = x.flatten(0, -2).transpose(0, 1)[..., None]  # (channels, tokens, 1)
    try:
        w = torch.linalg.lstsq(a, y).solution[..., 0]  # (channels, k)
    except RuntimeError:
        return None
    return w.transpose(0, 1), rel((a @ w[..., None])[..., 0].transpose(0, 1), x.flatten(0, -2))


def _terms(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.abs().max().clamp_min(1e-30)
    return {name: w[k] for k, name in enumerate(("current", "previous", "next")) if w[k].abs().max() > _NONE * scale}


def token_shift(e: Evidence) -> Hint | None:
    """The node's input mixes the token with its previous one on one side and otherwise on the other: the next
    token, no neighbour (a shift state never filled), or the two weights exchanged (the mix read inverted)."""
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ref.dim() != 3 or x_ours.shape != x_ref.shape or x_ref.shape[1] < 4:
        return None
    names = list(e.ref_trace.tensors)
    if e.name not in names:
        return None
    earlier = [n for n in reversed(names[: names.index(e.name)]) if e.ref_trace.tensors[n].shape == x_ref.shape][:3]
    for source in earlier:
        h = e.ref_trace.tensors[source].double()
        bases = [h, _shifted(h, 1), _shifted(h, -1)]
        fits = [_fit(x.double(), bases) for x in (x_ours, x_ref)]
        if any(f is None or f[1] > _FITS for f in fits):
            continue
        (w_ours, _), (w_ref, _) = fits  # type: ignore[misc]  # checked just above
        ours, ref = _terms(w_ours), _terms(w_ref)
        normal = "each side's"
        if set(ref) == {"current", "previous"} and set(ours) == {"current", "previous"}:
            swapped = rel(ours["current"], ref["previous"]) < 1e-3 and rel(ours["previous"], ref["current"]) < 1e-3
            if not swapped:
                return None
            what = (
                "the two weights exchanged: ours weights the token by the reference's weight of its previous one and "
                "the previous token by the token's (the mix read inverted, 1 - mix for mix)"
            )
        elif set(ref) == {"current", "previous"} or set(ours) == {"current", "previous"}:
            mixes, other = (ours, ref) if set(ours) == {"current", "previous"} else (ref, ours)
            normal, side = ("ours'", "the reference") if mixes is ours else ("the reference's", "ours")
            if set(other) == {"current", "next"}:
                what = f"{side} mixes each token with the next one (the shift taken the wrong way: the future leaks in)"
            elif set(other) == {"current"}:
                what = f"{side} mixes in no neighbour (the shifted input never filled: a zero shift state)"
            else:
                return None
        else:
            return None
        return Hint(
            "token_shift",
            f"likely the token shift before {e.name}: {normal} input mixes each token of {source} with the previous "
            f"one (RWKV's time_mix), and {what}",
            {"source": source, "ours": sorted(ours), "reference": sorted(ref)},
        )
    return None
