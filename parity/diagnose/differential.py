"""What an attention does between its context and its output projection: read at the output projection
when the context agrees and its input does not. The named case is differential attention (DiffLlama;
Ye et al. 2024, "Differential Transformer"; Transformers' ``DiffLlamaAttention``): the heads' outputs
over two halves of the values, ``o1 - lambda * o2`` head-pair by head-pair, an RMS norm over each pair's
``2 * head_dim`` features without a weight, times ``1 - lambda_init``, with ``lambda_init = 0.8 - 0.6
exp(-0.3 * layer_idx)``. ``lambda`` is read back from each side's input (a one-dimensional fit), so a
lambda formed otherwise is named by its value and what it equals."""

from __future__ import annotations

import math

import torch

from parity.diagnose.evidence import EXPLAINS, Evidence, golden_minimum, rel
from parity.diagnose.hints import Hint


def lambda_init(layer: int) -> float:
    """DiffLlama's ``lambda_init_fn``: 0.8 - 0.6 exp(-0.3 * layer_idx)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def after_context(e: Evidence) -> Hint | None:
    """The output projection fails, the block's context agrees, and the projection's input differs: the
    difference sits between the two. Differential attention's lambda, scale, norm and head pairing are read
    back when the reference is one; otherwise the stretch is named as the component."""
    if e.kind != "o_proj" or e.result.layer is None:
        return None
    stem = e.name.rsplit(".", 1)[0]
    context = e.ours_trace.results.get(f"{stem}.context")
    x_ours, x_ref = e.inputs()
    if context is None or context.status != "ok" or x_ours is None or x_ref is None or x_ours.shape != x_ref.shape:
        return None
    if e.close(x_ours, x_ref):
        return None
    named = _differential(e, stem, x_ours.double(), x_ref.double()) or output_gate(e, stem, x_ours, x_ref)
    if named is not None:
        return named
    return Hint(
        "context_to_output",
        f"likely what ours does between {stem}'s context and its output projection: the context agrees, the "
        "projection's input does not (a combination of the heads, a norm or a scale applied there: differential "
        "attention's o1 - lambda o2, a gate, a sub-layer norm)",
        {"block": stem},
    )


def output_gate(e: Evidence, stem: str, x_ours: torch.Tensor, x_ref: torch.Tensor) -> Hint | None:
    """An output gate between the context and the output projection (AFMoE's ``gate_proj``: ``context *
    sigmoid(gate_proj(x))``; LFM3's per-head ``g_proj``: one gate per head over its ``head_dim`` channels) with
    another function or another spread over the channels on one side: each side's projection input read as the
    reference's context times a function (:func:`~parity.diagnose.elementwise.gate_function`) of the reference's
    gate output, a per-head gate laid over the channels head by head or tiled, or the context alone."""
    from parity.diagnose.elementwise import gate_function

    context = e.ref_trace.tensors.get(f"{stem}.context")
    name, gate = next(
        ((n, t) for n in ("gate_proj", "g_proj", "gate") if (t := e.ref_trace.tensors.get(f"{stem}.{n}")) is not None),
        (None, None),
    )
    if context is None or gate is None or context.numel() != x_ref.numel():
        return None
    context = context.reshape(x_ref.shape)
    spreads = {"": gate} if gate.numel() == x_ref.numel() else {}
    width, heads = x_ref.shape[-1], gate.shape[-1]
    if gate.shape[:-1] == x_ref.shape[:-1] and heads > 1 and width % heads == 0 and width > heads:
        per = width // heads  # a per-head gate: channel c of the context belongs to head c // head_dim
        spreads[", each head's gate over its own channels"] = gate.repeat_interleave(per, -1)
        spreads[
            f", the gate tiled over the channels (channel c reads head c % {heads}'s: repeat for repeat_interleave)"
        ] = gate.repeat(*[1] * (gate.dim() - 1), per)

    def form_of(y: torch.Tensor) -> str | None:
        if rel(y.double(), context.double()) < EXPLAINS:
            return "the context alone (the gate not applied)"
        for spread, g in spreads.items():
            label = gate_function(context, g.reshape(y.shape), y)
            if label is not None:
                return f"the context times {label}({name}){spread}"
        return None

    ours_is, ref_is = form_of(x_ours), form_of(x_ref)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    return Hint(
        "activation" if ours_is.split(",")[0] != ref_is.split(",")[0] else "head_mapping",
        f"likely the attention's output gate: the input of {stem}'s output projection is {ours_is} in ours, "
        f"{ref_is} in the reference",
        {"ours": ours_is, "reference": ref_is, "gate": f"{stem}.{name}"},
    )


def _halves(e: Evidence, stem: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(o1, o2)`` ``(batch, seq, heads / 2, 2 head_dim)``: the reference's probabilities over the two halves
    of its values (each half's KV heads repeated twice, then expanded to the query heads), laid as
    ``DiffLlamaAttention`` chunks them before the combination."""
    probs, values = e.ref_trace.tensors.get(f"{stem}.probs"), e.ref_trace.tensors.get(f"{stem}.v_proj")
    d = e.facts.head_dim
    if probs is None or values is None or probs.dim() != 4 or not d:
        return None
    b, h, s, _ = probs.shape
    if values.numel() % (b * s * d) or h % 2:
        return None
    kv = values.numel() // (b * s * d)
    if kv % 2 or h % kv:
        return None
    v = values.double().reshape(b, s, kv, d).transpose(1, 2)
    outs = []
    for part in torch.chunk(v, 2, dim=1):
        full = part.repeat(1, 2, 1, 1).repeat_interleave(h // kv, dim=1)
        outs.append((probs.double() @ full).transpose(1, 2))  # (b, s, h, d)
    both = torch.cat(outs, -1)  # (b, s, h, 2d)
    o1, o2 = torch.chunk(both, 2, dim=2)
    return o1, o2


def _combine(
    o1: torch.Tensor, o2: torch.Tensor, lam: float, scale: float, eps: float, width: int | None = None
) -> torch.Tensor:
    """``scale * rms_norm(o1 - lam * o2)`` over each pair's features (or over groups of ``width``), as
    ``(batch, seq, features)``."""
    x = o1 - lam * o2
    if width is not None:  # the norm over each head_dim alone (a group of 2 per pair)
        x = x.unflatten(-1, (-1, width))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (scale * x).reshape(*o1.shape[:2], -1)


def _fit(
    o1: torch.Tensor, o2: torch.Tensor, x: torch.Tensor, eps: float, width: int | None = None
) -> tuple[float, float, float]:
    """``(lambda, scale, residual)`` that best give ``x`` (lambda searched, :func:`golden_minimum`; the
    scale by least squares)."""

    def scored(lam: float) -> tuple[float, float]:
        y = _combine(o1, o2, lam, 1.0, eps, width)
        scale = float((y * x).sum() / y.pow(2).sum().clamp_min(1e-300))
        return rel(scale * y, x), scale

    lam = golden_minimum(lambda v: scored(v)[0], [-4 + 8 * i / 160 for i in range(161)])
    residual, scale = scored(lam)
    return lam, scale, residual


def _differential(e: Evidence, stem: str, x_ours: torch.Tensor, x_ref: torch.Tensor) -> Hint | None:
    """The reference's input is its differential combination: name how ours' differs (lambda, the scale,
    the norm's width, the head pairing)."""
    halves = _halves(e, stem)
    if halves is None:
        return None
    o1, o2 = halves
    b, s = x_ref.shape[0], x_ref.shape[1] if x_ref.dim() == 3 else 0
    if x_ref.dim() != 3 or o1.shape[:2] != (b, s) or o1[0, 0].numel() != x_ref.shape[-1]:
        return None
    layer = int(e.result.layer or 0)
    eps = e.facts.norm_eps or 1e-6
    lam_ref, scale_ref, res_ref = _fit(o1, o2, x_ref, eps)
    if res_ref > 1e-6:
        return None  # the reference is no differential attention as read here
    lam, scale, res = _fit(o1, o2, x_ours, eps)
    d = o1.shape[-1] // 2
    if res > 1e-5:
        # another grouping: the norm over each head_dim, or heads paired as neighbours (2i, 2i + 1)
        both = torch.cat([o1, o2], 2)
        forms = {
            f"the norm taken over each head_dim ({d}) alone, not over the pair's {2 * d} features": (o1, o2, d),
            "heads paired as neighbours (2i, 2i + 1) where the reference pairs head i with head i + heads / 2": (
                both[:, :, 0::2],
                both[:, :, 1::2],
                None,
            ),
        }
        for text, (a, c, width) in forms.items():
            lam_f, scale_f, res_f = _fit(a, c, x_ours, eps, width)
            if res_f < EXPLAINS:
                return _hint(stem, f"{text} (lambda {lam_f:.4g}, scale {scale_f:.4g})", {"form": text})
        return None
    readings = []
    if abs(lam - lam_ref) > 1e-4:
        said = _lambda_reading(lam, lam_ref, layer, "ours") or _lambda_reading(lam_ref, lam, layer, "the reference")
        readings.append(
            f"ours' lambda is {lam:.5g} where the reference's is {lam_ref:.5g}" + (f": {said}" if said else "")
        )
    if abs(scale / scale_ref - 1) > 1e-4:
        said = " (the 1 - lambda_init factor left out)" if abs(scale - 1) < 1e-3 else ""
        readings.append(
            f"ours scales the normed difference by {scale:.5g} where the reference does by {scale_ref:.5g}{said}"
        )
    if not readings:
        return None
    return _hint(stem, "; ".join(readings), {"lambda": lam, "reference_lambda": lam_ref, "scale": scale})


def _lambda_reading(mine: float, other: float, layer: int, side: str) -> str | None:
    """What ``side``'s lambda equals in terms of the other side's, taken as right: its lambda_init left out, taken
    from the next layer, or a constant 0.8."""
    init = lambda_init(layer)
    candidates = {
        f"{side} leaves lambda_init ({init:.4g}) out of lambda": other - init,
        f"{side} takes lambda_init of layer index + 1 ({lambda_init(layer + 1):.4g}: layers counted from 1)": other
        - init
        + lambda_init(layer + 1),
        f"{side} takes lambda_init as a constant 0.8 (not 0.8 - 0.6 exp(-0.3 layer))": other - init + 0.8,
    }
    return next((t for t, v in candidates.items() if abs(mine - v) < 1e-3 * max(1.0, abs(v))), None)


def _hint(stem: str, what: str, evidence: dict) -> Hint:
    return Hint(
        "differential_attention",
        f"likely the differential attention of {stem} (o1 - lambda o2 over head pairs, RMS-normed, times "
        f"1 - lambda_init): {what}",
        {"block": stem, **evidence},
    )
