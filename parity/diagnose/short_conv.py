"""A gated short convolution written otherwise (LFM2's ``Lfm2ShortConv``): read at its output projection.

The operator (Liquid AI's LFM2, Transformers' ``Lfm2ShortConv.forward``): ``[B | C | X] = in_proj(x)``
(three ``hidden``-wide chunks in that order), ``y = C * conv(B * X)``, ``out_proj(y)``; ``conv`` is
depthwise and causal, ``conv(u)_t = sum_j w[:, j] u_{t - L + 1 + j}`` over the last ``L`` tokens (tap
``L - 1`` on the current one, zeros before the first; ``F.conv1d``'s cross-correlation, padded ``L - 1``
on the left). The conv runs in a kernel function, so no node holds its output: the first node that
differs is ``out_proj``, whose input is ``y``. This rebuilds ``y`` from the reference's ``in_proj``
output and the conv's weights (kept by :mod:`parity.record.hf_kernels`) in the forms ports write, and
names the one that gives either side's ``y`` while the other side's is the reference's form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parity.diagnose.evidence import Evidence, reference_output
from parity.diagnose.hints import Hint
from parity.record.hf_kernels import CONV_WEIGHTS, ConvWeights

_THE_FORM = "C * conv(B * X) (in_proj's chunks [B | C | X], the taps over the current and previous tokens)"


def _conv(u: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, ahead: int = 0) -> torch.Tensor:
    """Depthwise conv of ``u`` ``(batch, seq, channels)`` with taps ``w`` ``(channels, L)`` along the
    sequence: causal (tap ``L - 1`` on token t, tap 0 on t - L + 1), or its window moved ``ahead`` tokens
    later (over t - L + 1 + ahead .. t + ahead: ``L - 1`` is the future alone, ``(L - 1) // 2`` padding='same')."""
    taps = w.shape[-1]
    x = F.pad(u.transpose(1, 2), (taps - 1 - ahead, ahead))
    return F.conv1d(x, w[:, None], bias, groups=w.shape[0]).transpose(1, 2)


def _forms(z: torch.Tensor, kept: ConvWeights) -> dict[str, torch.Tensor]:
    """The conv block's ``y`` from ``in_proj``'s output ``z`` ``(batch, seq, 3 hidden)``, by how it is formed."""
    b, c, x = z.double().chunk(3, dim=-1)
    w = kept.weight.double()
    bias = kept.bias.double() if kept.bias is not None else None

    def act(t: torch.Tensor) -> torch.Tensor:
        return F.silu(t) if kept.activation in ("silu", "swish") else t

    def conv(u: torch.Tensor, taps: torch.Tensor = w, ahead: int = 0) -> torch.Tensor:
        return act(_conv(u, taps, bias, ahead))

    forms = {
        _THE_FORM: c * conv(b * x),
        "the taps reversed (tap 0 on the current token: a true convolution, or the kernel flipped at load)": c
        * conv(b * x, w.flip(-1)),
        "the current and the NEXT L - 1 tokens (the conv's output cut from its end, or padded on the right): it "
        "sees the future": c * conv(b * x, ahead=w.shape[-1] - 1),
        "both gates before the conv, conv(C * B * X)": conv(c * b * x),
        "the output gate read from X's chunk and the conv's input from C's (in_proj's chunks taken as [B | X | C])": x
        * conv(b * c),
        "the output gate read from B's chunk (in_proj's chunks taken as [C | B | X] or [X | B | C])": b * conv(c * x),
        "no output gate, conv(B * X)": conv(b * x),
    }
    for ahead in range(1, w.shape[-1] - 1):  # a centred window: nn.Conv1d(padding="same") for odd L
        same = " (nn.Conv1d(padding='same'), not padded L - 1 on the left)" if ahead == (w.shape[-1] - 1) // 2 else ""
        window = f"the previous {w.shape[-1] - 1 - ahead}, the current and the next {ahead} token(s)"
        forms[f"a window moved {ahead} token(s) later ({window}){same}: it sees the future"] = c * conv(
            b * x, ahead=ahead
        )
    if kept.activation is None:
        forms["a SiLU after the conv (the reference's conv has no activation)"] = c * F.silu(_conv(b * x, w, bias))
    else:
        forms[f"no activation after the conv (the reference applies {kept.activation})"] = c * _conv(b * x, w, bias)
    return forms


def short_conv(e: Evidence) -> Hint | None:
    """At a gated short conv's ``out_proj`` whose input differs: the form of ``y`` each side computes,
    either side; else padding that reaches the conv (:func:`_padding_reaches_conv`)."""
    if not e.name.endswith(".out_proj"):
        return None
    stem = e.name[: -len(".out_proj")]
    kept = e.ref_trace.extras.get(CONV_WEIGHTS + stem)
    z = reference_output(e, f"{stem}.in_proj")  # ours may hold in_proj cut into B, C and X
    y_ours, y_ref = e.inputs()
    if not isinstance(kept, ConvWeights) or z is None or y_ours is None or y_ref is None:
        return None
    hidden = kept.weight.shape[0]
    if z.shape[-1] != 3 * hidden or y_ref.shape != z.shape[:-1] + (hidden,) or y_ours.shape != y_ref.shape:
        return None
    forms = _forms(z, kept)
    if not e.close(y_ref, forms[_THE_FORM].to(y_ref.dtype)):
        side, y = "the reference", y_ref  # a fault on the reference's side: ours holds the form
        if not e.close(y_ours, forms[_THE_FORM].to(y_ours.dtype)):
            return _padding_reaches_conv(e, kept, y_ours, y_ref)
    else:
        side, y = "ours", y_ours
    taps = kept.weight.shape[-1]
    for label, form in forms.items():
        if label != _THE_FORM and e.close(y, form.to(y.dtype)):
            return Hint(
                "short_conv",
                f"likely the gated short conv written otherwise: {side} computes out_proj's input as {label}; the "
                f"reference's form is {_THE_FORM}, L = {taps} taps",
                {"side": side, "form": label, "taps": taps},
            )
    return _padding_reaches_conv(e, kept, y_ours, y_ref)


def _padding_reaches_conv(e: Evidence, kept: ConvWeights, y_ours: torch.Tensor, y_ref: torch.Tensor) -> Hint | None:
    """In a left-padded batch, out_proj's inputs differ only at the first L - 1 real tokens of the padded
    rows: exactly the outputs whose window reaches the padding. The padded tokens are not zeroed before
    the conv (Transformers' ``apply_mask_to_padding_states``) on one side, so in_proj's output there (its
    bias, or the pad token's projection) is convolved into them."""
    mask = e.attention_mask
    if mask is None or mask.shape != y_ref.shape[:2] or bool((mask != 0).all()):
        return None
    taps = kept.weight.shape[-1]
    real = mask != 0
    differs = ((y_ours.double() - y_ref.double()).abs().amax(-1) > e.noise) & real
    reach = torch.zeros_like(real)
    for row in range(real.shape[0]):
        first = int(real[row].nonzero()[0]) if bool(real[row].any()) else real.shape[1]
        if first:
            reach[row, first : first + taps - 1] = True
    if not bool(differs.any()) or bool((differs & ~reach).any()):
        return None
    return Hint(
        "short_conv",
        f"likely padding reaching the short conv: only the first {taps - 1} real tokens after the padding differ "
        f"(L = {taps} taps: the outputs whose window reaches the padding); the padded tokens are not zeroed before "
        "the conv on one side (Transformers zeros them: apply_mask_to_padding_states), so in_proj's output there "
        "is convolved in",
        {"form": "padding not zeroed", "taps": taps},
    )
