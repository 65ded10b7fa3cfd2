"""Detectors of element-wise functions: another activation, a soft-cap, a cast order (differences
of one or two ulps), the first non-finite value."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch

from parity.diagnose.evidence import ELEMENTWISE, EXPLAINS, Evidence, fmt_list, rel, seq_axis
from parity.diagnose.hints import Hint
from parity.diagnose.learned_activation import xielu_parameters


def _solve_cap(h: torch.Tensor, y: torch.Tensor, form: str) -> float | None:
    """The cap ``c`` with ``y = c * tanh(h / c)`` (``form`` "cap") or ``y = h * tanh(h / c)`` ("gate"), from
    the element of largest ``|h|`` (bisection on a log scale: both forms are monotone in ``c``)."""
    i = int(h.abs().argmax())
    hx, yx = float(h.flatten()[i]), float(y.flatten()[i])
    if hx == 0 or yx == 0 or (yx > 0) != (hx > 0):
        return None

    def f(c: float) -> float:
        return (c * math.tanh(hx / c) if form == "cap" else hx * math.tanh(hx / c)) - yx

    lo, hi = 1e-3, 1e6
    if f(lo) * f(hi) > 0:
        return None
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if (f(mid) > 0) == (f(hi) > 0):
            hi = mid
        else:
            lo = mid
    return float(f"{math.sqrt(lo * hi):.4g}")  # a cap is a round number; the last digits are the fit's


def _capped(
    h: torch.Tensor, y: torch.Tensor, config_cap: float | None, tol: float, names: dict[str, float] | None = None
) -> str | None:
    """How ``y`` is computed from the head's output ``h``: ``"uncapped"``, ``"c * tanh(x / c)"`` or
    ``"x * tanh(x / c)"`` (c read back from the values), ``"c * tanh(x)"`` (the config's c, the division
    forgotten), or None when it is none of those."""
    h, y = h.double(), y.double()
    if rel(y, h) < tol:
        return "x (no cap)"
    for form, text in (("cap", "{c:g} * tanh(x / {c:g})"), ("gate", "x * tanh(x / {c:g})")):
        caps = [config_cap] if config_cap else []
        fitted = _solve_cap(h, y, form)
        caps += [fitted] if fitted is not None else []
        for c in caps:
            z = c * torch.tanh(h / c) if form == "cap" else h * torch.tanh(h / c)
            if rel(y, z) < tol:
                return text.format(c=c)
    if config_cap and rel(y, config_cap * torch.tanh(h)) < tol:  # the cap's division forgotten: c * tanh(x)
        return f"{config_cap:g} * tanh(x) (x not divided by the cap)"
    if config_cap and rel(y, torch.tanh(h / config_cap)) < tol:  # the multiply-back forgotten: tanh(x / c)
        return f"tanh(x / {config_cap:g}) (not multiplied back by the cap)"
    scaled = _cap_input_scale(h, y, config_cap, tol)
    if scaled is not None:
        named = next((f" = {n}" for n, v in (names or {}).items() if abs(scaled / v - 1) < 1e-4), "")
        return (
            f"{config_cap:g} * tanh({scaled:.6g} x / {config_cap:g}) (x scaled by {scaled:.6g}{named} before the cap)"
        )
    return None


def _cap_input_scale(h: torch.Tensor, y: torch.Tensor, cap: float | None, tol: float) -> float | None:
    """``k`` when ``y = cap * tanh(k h / cap)`` (the cap's input scaled: a pre-scaled table reused as the
    tied head), read back through atanh where ``y`` is well inside the cap; None otherwise."""
    if not cap:
        return None
    inside = y.abs() < 0.9 * cap
    if int(inside.sum()) < 8:
        return None
    u, x = cap * torch.atanh(y[inside] / cap), h[inside]
    k = float((u * x).sum() / (x * x).sum().clamp_min(1e-300))
    return k if abs(k - 1) > 1e-3 and rel(u, k * x) < max(tol, 1e-6) else None


def soft_capping(e: Evidence) -> Hint | None:
    """The logits differ where the output head agrees: each side's logits read back as a function of
    the head's output (the reference's ``lm_head`` node): no cap, ``c * tanh(x / c)`` with its cap, or
    a cap written wrongly (``x * tanh(x / c)``). Names what each side does and what the config says
    (``final_logit_softcapping``), whichever side is off."""
    if e.name == e.facts.head_module and e.kind != "logits":
        return _capped_head(e)
    if e.kind != "logits":
        return None
    h = e.ref_trace.tensors.get(e.facts.head_module)
    if h is None or h.shape != e.ref.shape:
        if not e.facts.final_softcap:  # without the head's output only the config's cap can be tried
            return None
        h = None
    cap = e.facts.final_softcap
    tol = max(EXPLAINS, 4 * torch.finfo(e.ref.dtype).eps)
    ours_is: str | None
    ref_is: str | None
    if h is None:
        assert cap  # checked above: without the head's output only the config's cap is tried
        a, b = e.ours.double(), e.ref.double()
        if rel(b, cap * torch.tanh(a / cap)) < tol:
            ours_is, ref_is = "x (no cap)", f"{cap:g} * tanh(x / {cap:g})"
        elif rel(a, cap * torch.tanh(b / cap)) < tol:
            ours_is, ref_is = f"capped twice ({cap:g} * tanh(x / {cap:g}) of the capped logits)", "capped once"
        else:
            return None
    else:
        names = e.facts.named_constants()
        ours_is, ref_is = _capped(h, e.ours, cap, tol, names), _capped(h, e.ref, cap, tol, names)
        if ours_is is None or ref_is is None or ours_is == ref_is:
            return None
    config = f"final_logit_softcapping {cap:g}" if cap else "no final logit soft-cap"
    return Hint(
        "softcap",
        f"likely the final logit soft-cap: ours' logits are {ours_is}, the reference's {ref_is}, x the output head's "
        f"output (the config: {config})",
        {"ours": ours_is, "reference": ref_is, "config_cap": cap},
    )


def _capped_head(e: Evidence) -> Hint | None:
    """The head's node where one side's head is its model's output (a head computed in forward from the
    tied embedding, the cap applied before it returns): that side's value read as a function of the
    other's uncapped product."""
    tol = max(EXPLAINS, 4 * torch.finfo(e.ref.dtype).eps)
    cap = e.facts.final_softcap
    for side, value, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        form = _capped(other, value, cap, tol, e.facts.named_constants())
        if form is not None and not form.startswith("x (no cap)"):
            config = f"final_logit_softcapping {cap:g}" if cap else "no final logit soft-cap"
            ours_is, ref_is = (form, "x (no cap)") if side == "ours" else ("x (no cap)", form)
            return Hint(
                "softcap",
                f"likely the final logit soft-cap: ours' logits are {ours_is}, the reference's {ref_is}, x the output "
                f"head's product (the config: {config})",
                {"ours": ours_is, "reference": ref_is, "config_cap": cap},
            )
    return None


def _fits_in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element of a float32 or float64 ``t``: whether ``dtype`` (bfloat16, float16) holds it exactly, read
    from its bits (its mantissa's low bits zero, its exponent in range), not by a cast: the semantic run's
    detectors work under :class:`~parity.run.float64.Float64Mode`, where a cast to a narrower dtype stays float64."""
    narrow = torch.finfo(dtype)
    mantissa = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
    if t.dtype not in (torch.float32, torch.float64):  # held in a narrow dtype itself (a port's bfloat16 input)
        return torch.ones_like(t, dtype=torch.bool) if t.dtype == dtype else _fits_in(t.float(), dtype)
    drop = mantissa[t.dtype] - mantissa[dtype]  # mantissa bits the narrower dtype lacks
    bits = t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)
    low = (bits & ((1 << drop) - 1)) == 0
    size = t.abs()
    step = narrow.smallest_normal * narrow.eps  # below the normal range: multiples of the smallest subnormal
    subnormal = (size < narrow.smallest_normal) & ((t / step) == (t / step).round())
    return (low & (size <= narrow.max) & (size >= narrow.smallest_normal)) | subnormal


def _node_and_input(e: Evidence, label: str) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """``(ours, reference, where)`` of the node (``where`` empty) and, when both sides' inputs were kept and
    differ, of its input (``where`` = ``label``): an op with no node of its own between two projections
    shows only there."""
    x_ours, x_ref = e.inputs()
    pairs = [(e.ours, e.ref, "")]
    if x_ours is not None and x_ref is not None and x_ours.shape == x_ref.shape and not e.close(x_ours, x_ref):
        pairs.append((x_ours, x_ref, label))
    return pairs


def _fake_quantised(x: torch.Tensor, levels: int, per_token: bool) -> torch.Tensor:
    """``x`` rounded to ``levels`` steps each way of its absolute maximum (per token: along the last axis; else
    over the whole tensor), symmetric integer quantisation and back (BitNet's per-token absmax int8)."""
    top = x.abs().amax(-1, keepdim=True) if per_token else x.abs().amax()
    scale = levels / top.clamp(min=1e-5)
    return (x * scale).round().clamp(-levels - 1, levels) / scale


def quantised_input(e: Evidence) -> Hint | None:
    """A node whose input on one side is the other side's rounded to a few integer levels (int8 or int4,
    per token or per tensor, scaled by the absolute maximum): activation quantisation (BitNet's ``act_quant``)
    applied on one side only. Either side."""
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.shape != x_ref.shape or not x_ref.is_floating_point():
        return None
    if e.close(x_ours, x_ref) or x_ref.numel() < 64:
        return None
    for side, this, other in (
        ("ours", x_ours.double(), x_ref.double()),
        ("the reference", x_ref.double(), x_ours.double()),
    ):
        for bits, levels in ((8, 127), (4, 7)):
            for per_token in (True, False):
                if e.close(this, _fake_quantised(other, levels, per_token)):
                    how = "per token (along the last axis)" if per_token else "over the whole tensor"
                    return Hint(
                        "quantisation",
                        f"likely activation quantisation in {side}: {e.kind}'s input is the other side's rounded to "
                        f"int{bits} levels {how}, in steps of its absolute maximum / {levels} (BitNet's act_quant), "
                        "which the other side does not apply",
                        {"side": side, "bits": bits, "per_token": per_token},
                    )
    return None


def input_floored_at_zero(e: Evidence) -> Hint | None:
    """A node whose input on one side is the other side's with every negative value replaced by zero: a max that
    also counts a zero it starts from (a pooling ``zeros.scatter_reduce(..., "amax", include_self=True)`` where
    the reference leaves the starting zeros out, BLT's ``patch_reduce``), or a ReLU on one side only. Either side."""
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.shape != x_ref.shape or not x_ref.is_floating_point():
        return None
    if e.close(x_ours, x_ref) or x_ref.numel() < 16:
        return None
    for side, this, other in (("ours", x_ours, x_ref), ("the reference", x_ref, x_ours)):
        negative = other < 0
        if bool(negative.any()) and e.close(this.double(), other.double().clamp(min=0)):
            return Hint(
                "activation",
                f"likely {e.kind}'s input floored at zero in {side}: it is the other side's with its "
                f"{int(negative.sum())} negative values replaced by 0: a max-pool over a zero-filled tensor that "
                "counts the zeros (scatter_reduce amax with include_self=True, where the other side leaves them out), "
                "or a ReLU the other side does not apply",
                {"side": side, "negatives": int(negative.sum())},
            )
    return None


def precision(e: Evidence) -> Hint | None:
    """A float32 (or float64) node whose values on one side are all exactly representable in a
    narrower dtype (bfloat16, float16) and on the other side mostly not: that side computed the node
    in the narrower dtype and cast back (a softmax in float16, q @ k^T in bfloat16)."""
    if e.ours.dtype != e.ref.dtype and e.ours.is_floating_point() and e.ref.is_floating_point():
        bits_ours, bits_ref = torch.finfo(e.ours.dtype).bits, torch.finfo(e.ref.dtype).bits
        if bits_ours != bits_ref:
            side, narrow, wide_dtype = (
                ("ours", e.ours.dtype, e.ref.dtype)
                if bits_ours < bits_ref
                else ("the reference", e.ref.dtype, e.ours.dtype)
            )
            narrow_name, wide_name = (str(d).replace("torch.", "") for d in (narrow, wide_dtype))
            return Hint(
                "precision",
                f"likely computed in {narrow_name} in {side}: {side} produces this node as a {narrow_name} tensor, the "
                f"other side as {wide_name} (a cast before the op, e.g. q @ k^T or a softmax in half precision)",
                {"side": side, "dtype": narrow_name},
            )
    if e.ref.dtype not in (torch.float32, torch.float64) or e.ours.dtype != e.ref.dtype or e.ref.numel() < 64:
        return None

    def representable(t: torch.Tensor, dtype: torch.dtype) -> float:
        t = t[torch.isfinite(t) & (t != 0) & (t.abs() < 1e30)]  # a mask's fill value is no computed value
        if t.numel() < 64 or float(t.abs().max()) > torch.finfo(dtype).max:
            return 0.0
        if bool((t == t.round()).all()):  # whole numbers (indices, counts) fit any dtype: no evidence
            return float("nan")
        return float(_fits_in(t, dtype).double().mean())

    wide = str(e.ref.dtype).replace("torch.", "")
    # the node, or its input when that differs (an activation with no node of its own between two
    # projections, computed in half precision: Persimmon's relu2 in a fused float16 kernel)
    for ours, ref, where in _node_and_input(e, "input"):
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).replace("torch.", "")
            for side, this, other in (("ours", ours, ref), ("the reference", ref, ours)):
                if representable(this, dtype) == 1.0 and representable(other, dtype) < 0.5:  # nan: neither
                    what = (
                        f"{e.kind}'s input (the activation or op before it, which has no node of its own)"
                        if where
                        else "this node"
                    )
                    return Hint(
                        "precision",
                        f"likely {name} precision in {side}: every value {side} holds in {what} is exactly a {name} "
                        f"number (the other side's are {wide} values): {side} computes it in {name} and casts back, "
                        f"or reads a table stored in {name} (a softmax, a matmul, an activation, an embedding in half "
                        "precision)",
                        {"side": side, "dtype": name, **({"at": "input"} if where else {})},
                    )
    return None


def rounding_order(e: Evidence) -> Hint | None:
    """Every difference within two units in the last place of the node's dtype: the same formula
    rounded in another order (cast before or after a multiply, fused or separate operations)."""
    dtype = e.ref.dtype
    if not dtype.is_floating_point:
        return None
    a, b = e.ours.double(), e.ref.double()
    diff = (a - b).abs()
    if not bool((diff > 0).any()):
        return None
    mantissa = -round(math.log2(torch.finfo(dtype).eps))  # explicit mantissa bits: 23 float32, 7 bfloat16
    magnitude = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.pow(2.0, torch.floor(torch.log2(magnitude)) - mantissa)
    units = diff / ulp
    worst = float(units.max())
    if worst > 2.0:
        return None
    count = int((diff > 0).sum())
    return Hint(
        "rounding_order",
        f"likely a rounding-order difference: {count} of {diff.numel()} elements differ, none by more than "
        f"{worst:.0f} unit(s) in the last place of {str(dtype).replace('torch.', '')} (the same formula with a cast "
        "before instead of after a multiply, or ops fused differently); the reference's order is the one the "
        "checkpoint was trained with",
        {"elements": count, "max_ulps": worst},
    )


def activations() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Activations a port may use instead of the reference's, by Transformers name, computed as the
    references compute them (in the tensor's own dtype)."""
    F = torch.nn.functional

    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    return {
        "gelu (exact, erf)": F.gelu,
        "gelu_new (tanh approximation, op by op)": gelu_new,
        "gelu_pytorch_tanh (torch's fused tanh approximation)": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
        "relu": F.relu,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "sigmoid": torch.sigmoid,
        "relu squared (Primer's relu2)": lambda x: F.relu(x).square(),
        "tanh": torch.tanh,
        "softplus": F.softplus,
        "mish": F.mish,
        "elu": F.elu,
        "leaky_relu (0.01)": F.leaky_relu,
        "square (x^2, no ReLU first)": torch.square,
    }


def function_of(x: torch.Tensor, y: torch.Tensor, steep: bool = False) -> bool:
    """Whether ``y`` is a smooth function of ``x`` value by value (all elements pooled, float64): sorted
    by ``x``, neighbouring values of ``y`` stay close (each step of ``y`` at most 5% of its spread, the
    typical one under 1%). Another activation applied to the same input passes; a different input fails."""
    x, y = x.double().flatten(), y.double().flatten()
    finite = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[finite], y[finite]
    if x.numel() < 64:
        return False
    spread = float(y.std())
    if spread == 0:
        return False
    order = x.argsort()
    steps = y[order].diff().abs() / spread
    # ``steep``: judged where neighbouring values of x are close (the denser half of the steps) only; a
    # steep, sparsely sampled tail (relu squared, a cube at large x) moves y further between far-apart points
    judged = x[order].diff() <= x[order].diff().median() if steep else torch.ones_like(steps, dtype=torch.bool)
    return float(steps[judged].max()) < 5e-2 and float(steps.median()) < 1e-2


def activation_function(e: Evidence) -> Hint | None:
    """Ours equals an earlier reference node of the same layer and shape (the pre-activation, e.g.
    GPT-2's ``c_fc`` output) through another activation than the reference's: exact vs tanh GELU,
    SiLU for GELU."""
    if e.result.layer is None:
        return None
    acts = activations()
    # the node itself, or its input (the activation between two projections that has no node of its own:
    # StarCoder2's c_fc -> act -> c_proj), when ours' input was kept and differs
    pairs = _node_and_input(e, f"{e.kind}'s input: ")
    for ours, ref, where in pairs:
        for name, pre in e.ref_trace.tensors.items():
            if name == e.name:
                break  # only nodes the reference computed before this one
            if pre.shape != ref.shape or not pre.is_floating_point() or e.facts.locate(name)[0] != e.result.layer:
                continue
            values = {label: fn(pre) for label, fn in acts.items()}
            ours_is = next((label for label, y in values.items() if e.close(ours, y) and not e.close(ref, y)), None)
            bias = e.ref_trace.biases.get(name)
            if ours_is is None and bias is not None and bias.shape == pre.shape[-1:]:
                # the bias added after the activation: f(x W) + b for f(x W + b) (a fused bias-GELU unpacked)
                after = {label: fn(pre - bias) + bias for label, fn in acts.items()}
                found = next((label for label, y in after.items() if e.close(ours, y) and not e.close(ref, y)), None)
                ref_is = next((label for label, y in values.items() if e.close(ref, y)), None)
                if found is not None and found == ref_is:
                    return Hint(
                        "activation",
                        f"likely the bias added after the activation: {where}ours equals {found} of {name} without "
                        f"its bias, plus the bias; the reference {ref_is} of {name}, the bias inside (a fused "
                        "bias-activation unpacked in the other order)",
                        {"ours": f"{found} before the bias", "reference": ref_is, "input": name},
                    )
            if ours_is is None:
                continue
            ref_is = next((label for label, y in values.items() if e.close(ref, y)), None)
            theirs = f"the reference {ref_is}" if ref_is else "the reference another function"
            if ref_is is None and function_of(pre, ref, steep=True):
                points = [p for p in SAMPLE_POINTS if float(pre.min()) <= p <= float(pre.max())]
                if len(points) >= 3:
                    x = pre.double().flatten()
                    shown = ", ".join(f"{v:.3g}" for v in _sampled(x, ref.double().flatten(), points))
                    theirs += f" (at x = {', '.join(f'{p:g}' for p in points)} it gives {shown})"
            return Hint(
                "activation",
                f"likely the activation function: {where}ours equals {ours_is} of the reference's {name}, {theirs}",
                {"ours": ours_is, "reference": ref_is, "input": name},
            )
    for ours, ref, where in pairs:
        hint = _other_function(e, ours, ref, where, acts)
        if hint is not None:
            return hint
    return None


#: where an element-wise function is read back: the points of its argument shown, in order
SAMPLE_POINTS = (-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0)


def _sampled(x: torch.Tensor, y: torch.Tensor, points: list[float]) -> list[float]:
    """``y`` as a function of ``x`` (pooled values), linearly interpolated at ``points``."""
    order = x.argsort()
    xs, ys = x[order], y[order]
    out = []
    for p in points:
        i = int(torch.searchsorted(xs, torch.tensor(p, dtype=xs.dtype)).clamp(1, xs.numel() - 1))
        x0, x1, y0, y1 = float(xs[i - 1]), float(xs[i]), float(ys[i - 1]), float(ys[i])
        out.append(y0 if x1 == x0 else y0 + (y1 - y0) * (p - x0) / (x1 - x0))
    return out


def _other_function(e: Evidence, ours: torch.Tensor, ref: torch.Tensor, where: str, acts) -> Hint | None:
    """Ours is an element-wise function of an earlier reference node of the layer (a projection's output,
    not a norm's or attention's) other than every activation known here (relu applied after the square,
    a gate multiplied in twice, a typo in a constant), while the reference is its own activation of
    it: the two functions are read back at a few points and shown side by side."""
    for name, pre in e.ref_trace.tensors.items():
        if name == e.name:
            break
        kind = e.facts.locate(name)[1] or ""
        if (
            pre.shape != ref.shape
            or not pre.is_floating_point()
            or e.facts.locate(name)[0] != e.result.layer
            or any(w in kind or w in name for w in ("norm", "attn", "attention"))
        ):
            continue
        x, a, b = pre.double().flatten(), ours.double().flatten(), ref.double().flatten()
        if (
            not (function_of(x, a, steep=True) and function_of(x, b, steep=True))
            or e.close(ours, pre)
            or e.close(ref, pre)
        ):
            continue
        centred = b - b.mean()
        slope = float((centred * a).sum() / centred.pow(2).sum().clamp_min(1e-300))
        if rel(a.mean() + slope * centred, a) < 1e-3:
            continue  # ours is the reference's scaled or shifted: a scale, not another function
        points = [p for p in SAMPLE_POINTS if float(x.min()) <= p <= float(x.max())]
        if len(points) < 3:
            continue
        learned = xielu_parameters(e, ours, ref, pre, where)
        if learned is not None:
            return learned
        ref_is = next((label for label, fn in acts.items() if e.close(ref, fn(pre))), None)
        floor = 1e-6 * float(b.abs().max())

        def fmt(values) -> str:
            return ", ".join(values)

        def at_points(y: torch.Tensor, x=x, points=points, floor=floor):
            return (f"{v:.3g}" if abs(v) > floor else "0" for v in _sampled(x, y, points))

        return Hint(
            "activation",
            f"likely the activation function: {where}ours is another element-wise function of the reference's "
            f"{name} than the reference's {ref_is or 'activation'}: at x = {fmt(f'{p:g}' for p in points)} ours "
            f"gives {fmt(at_points(a))}, the reference {fmt(at_points(b))}",
            {"ours": "another function", "reference": ref_is, "input": name, "points": points},
        )
    return None


def gate_function(context: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> str | None:
    """The element-wise function ``f`` (a name of :data:`ELEMENTWISE`) by which ``y`` is ``context * f(gate)``
    (an output gate's product, all three of one shape), read as ``y / context`` where the context is not near
    zero; None when none is."""
    c, g = context.double().reshape(y.shape), gate.double().reshape(y.shape)
    keep = c.abs() > 1e-2 * float(c.abs().max())
    factor = y.double()[keep] / c[keep]
    tol = max(EXPLAINS, 4 * torch.finfo(y.dtype).eps)
    return next((label for label, fn in ELEMENTWISE.items() if rel(factor, fn(g)[keep]) < tol), None)


def gate_activation(e: Evidence) -> Hint | None:
    """A gated product (``context * f(gate)`` before o_proj, Qwen3.5's output gate) where one side
    applies another function to the gate: the factor each side multiplies the reference's ``context``
    by is read back and named as a function of the reference's ``gate`` node (sigmoid, SiLU, none)."""
    if not e.kind.endswith("@input") or e.result.layer is None:
        return None
    stem = e.name.rsplit(".", 1)[0]
    context, gate = e.ref_trace.tensors.get(f"{stem}.context"), e.ref_trace.tensors.get(f"{stem}.gate")
    if context is None or gate is None or context.shape != e.ref.shape or gate.shape != e.ref.shape:
        return None
    ours_is, ref_is = (gate_function(context, gate, y) for y in (e.ours, e.ref))
    if ours_is is None or ours_is == ref_is:
        return None
    return Hint(
        "activation",
        f"likely the gate's activation: ours multiplies the context by {ours_is}(gate), the reference by "
        f"{ref_is or 'another function'}(gate)",
        {"ours": ours_is, "reference": ref_is, "input": f"{stem}.gate"},
    )


#: a gated MLP's gate and up projections, fused or apart, by their Transformers names
_GATE_UP = (("gate_proj", "up_proj"), ("gate_up_proj", ""), ("w1", "w3"), ("fc1", ""))


def glu_form(e: Evidence) -> Hint | None:
    """A gated MLP's node after the product (its down projection, BitNet's ffn_sub_norm) whose input (ours', or
    the reference's) is the reference's gate and up combined otherwise than ``act(gate) * up``: another
    activation, the activation of the product ``act(gate * up)``, of the up half ``gate * act(up)``, none
    ``gate * up``, or the up half left for later ``act(gate)``; each side's activation is the one that
    reproduces its input (read, not assumed from the config). Either side."""
    x_ours, x_ref = e.inputs()
    if e.result.layer is None or x_ours is None or x_ref is None or x_ours.shape != x_ref.shape:
        return None
    stem = e.name.rsplit(".", 1)[0]
    halves = None
    for gate_name, up_name in _GATE_UP:
        gate = e.ref_trace.tensors.get(f"{stem}.{gate_name}")
        up = e.ref_trace.tensors.get(f"{stem}.{up_name}") if up_name else None
        if gate is not None and up is None and gate.shape[-1] == 2 * x_ref.shape[-1]:
            halves = gate.double().chunk(2, -1)
        elif gate is not None and up is not None and gate.shape == up.shape == x_ref.shape:
            halves = (gate.double(), up.double())
        if halves is not None:
            break
    if halves is None:  # a fused gate/up by another name (ModernBERT's Wi: ``input, gate = Wi(x).chunk(2)``)
        fused = [
            t
            for name, t in e.ref_trace.tensors.items()
            if name.rsplit(".", 1)[0] == stem
            and isinstance(t, torch.Tensor)
            and t.shape[:-1] == x_ref.shape[:-1]
            and t.shape[-1] == 2 * x_ref.shape[-1]
        ]
        halves = fused[0].double().chunk(2, -1) if len(fused) == 1 else None
    if halves is None or halves[0].shape != x_ref.shape or e.close(x_ours, x_ref):
        return None
    g, u = halves
    forms: dict[str, torch.Tensor] = {"gate * up (no activation)": g * u}
    for label, act in activations().items():
        a, f = act(g), label.split(" (")[0]  # (its name without the note: "relu squared", "gelu")
        # (GELU's forms differ by their note alone: exact, or which tanh approximation)
        note = label.partition(" (")[2].removesuffix(")") if f.startswith("gelu") else ""
        forms[f"{f}(gate) * up" + (f" ({note})" if note else "")] = a * u
        forms[f"{f}(gate * up) (the activation of the product)"] = act(g * u)
        forms[f"gate * {f}(up) (the activation on the up half)"] = g * act(u)
        forms[f"{f}(gate) alone (the product with up_proj taken after {e.kind}, or dropped)"] = a
    ours_is = next((k for k, y in forms.items() if e.close(x_ours, y.to(x_ours.dtype))), None)
    ref_is = next((k for k, y in forms.items() if e.close(x_ref, y.to(x_ref.dtype))), None)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    return Hint(
        "activation",
        f"likely the gated MLP's activation: {e.name}'s input is {ours_is} in ours, {ref_is} in the reference "
        "(same gate and up)",
        {"ours": ours_is, "reference": ref_is},
    )


def _elementwise_of(e: Evidence, y: torch.Tensor, x: torch.Tensor) -> str | None:
    for name, fn in ELEMENTWISE.items():
        if e.close(y, fn(x.double())):
            return name
    return None


#: the fewest distinct reference values per channel on which a monotone curve is evidence of a function
ACTIVATION_MIN_POINTS = 8
#: how far the curve must bend away from a straight line, in multiples of the noise (the node's
#: tolerance, or the most the rising/falling order is broken by) and of the dtype's rounding (eps)
ACTIVATION_MARGIN = 10.0
ACTIVATION_EPS_MARGIN = 8.0


def _dtype_eps(dtype: str | None) -> float:
    """Machine epsilon of a dtype named like ``bfloat16``; float32's when unknown."""
    value = getattr(torch, str(dtype or "float32").removeprefix("torch."), None)
    try:
        return float(torch.finfo(cast(torch.dtype, value)).eps)  # not a dtype: TypeError, below
    except TypeError:
        return float(torch.finfo(torch.float32).eps)


def activation(e: Evidence) -> Hint | None:
    """Ours is a monotone, non-affine function of the reference, value by value in each channel (the
    last axis): the same pre-activation through another element-wise function (sigmoid vs softplus).
    Both functions are named when an earlier node of the layer is the input of both.

    Rounding is monotone too (two roundings of one value stay in order), so a rounding fault (a norm
    that multiplies in float32, then casts) looks like "a monotone function" within a loose tolerance.
    The curve is evidence only where it clearly exceeds noise: at least :data:`ACTIVATION_MIN_POINTS`
    distinct reference values in every channel, a departure from the best straight line per channel
    at least :data:`ACTIVATION_MARGIN` times the node's tolerance and the largest break of the order,
    and, relative to ours, :data:`ACTIVATION_EPS_MARGIN` times the dtype's eps (F14, F20)."""
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    if a.shape[0] < ACTIVATION_MIN_POINTS or not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    order = b.argsort(dim=0)
    da, db = a.gather(0, order).diff(dim=0), b.gather(0, order).diff(dim=0)
    if int((db > 0).sum(0).min()) + 1 < ACTIVATION_MIN_POINTS:
        return None  # too few distinct values in some channel to see a curve
    tol = e.noise + 1e-6 * float(a.abs().max())
    rising, falling = (da >= -tol).all(0), (da <= tol).all(0)
    if not bool((rising | falling).all()) or bool((da.abs() > tol)[db == 0].any()):
        return None  # not a function of the reference value, channel by channel
    broken = float(torch.minimum((-da).clamp_min(0).amax(0), da.clamp_min(0).amax(0)).max())
    centred = b - b.mean(0)
    slope = (centred * a).sum(0) / centred.pow(2).sum(0).clamp_min(1e-300)
    affine = a.mean(0) + slope * centred
    bend = float((a - affine).abs().max())
    if rel(affine, a) < max(1e-3, ACTIVATION_EPS_MARGIN * _dtype_eps(e.result.dtype)):
        return None  # a scale or an offset per channel (up to rounding): not an activation
    if bend < ACTIVATION_MARGIN * max(tol, broken):
        return None  # the bend is within the noise: rounding, not another function
    names = None
    for name, x in e.ref_trace.tensors.items():
        if name == e.name:
            break
        if x.shape == e.ref.shape and e.facts.locate(name)[0] == e.result.layer and name != e.name:
            ref_fn, ours_fn = _elementwise_of(e, e.ref, x), _elementwise_of(e, e.ours, x)
            if ref_fn and ours_fn and ref_fn != ours_fn:
                names = (ours_fn, ref_fn, name)
    if names:
        ours_fn, ref_fn, source = names
        return Hint(
            "activation",
            f"likely the activation: ours applies {ours_fn} to {source}, the reference {ref_fn}",
            {"ours": ours_fn, "reference": ref_fn, "input": source},
        )
    return Hint(
        "activation",
        "likely an element-wise function (activation) that differs: in every channel ours is a monotone, non-linear "
        "function of the reference's value (the same input through e.g. sigmoid vs softplus)",
        {},
    )


def nonfinite(e: Evidence) -> Hint:
    result = e.result
    bad = ~torch.isfinite(e.ours) | ~torch.isfinite(e.ref)
    axis = seq_axis(e.kind)
    where, evidence = [], {}
    if bad.dim() > axis:
        rows = bad.movedim(axis, 0).flatten(1).any(1).nonzero().flatten().tolist()
        where.append(f"positions {fmt_list(rows, 10)}")
        evidence["positions"] = rows[:64]
    if bad.dim() > 1:
        batch = bad.flatten(1).any(1).nonzero().flatten().tolist()
        where.append(f"batch rows {fmt_list(batch)}")
        evidence["batch_rows"] = batch
    return Hint(
        "nonfinite",
        f"non-finite values appear first here: {result.detail}; at {', '.join(where)} (masked or padded rows?)",
        evidence,
    )


def _within(tol: float):
    """``close(a, b)``: same shape, every element within ``tol``."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and float((a.double() - b.double()).abs().max()) <= tol

    return close


def _nice(lo: float, hi: float) -> float:
    """The roundest number strictly between ``lo`` and ``hi`` (a threshold a port wrote): 8, 7.5, 1e-06."""
    for step in (100.0, 10.0, 5.0, 1.0, 0.5, 0.1, 0.01, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7):
        c = math.floor(hi / step) * step
        if lo < c < hi or (c == hi and lo < c):
            return c
    return (lo + hi) / 2


def _clamp_bounds(this: torch.Tensor, other: torch.Tensor, close) -> str | None:
    """``[lo, hi]`` when ``this`` is ``other`` clamped to the bounds ``this`` reaches, else None."""
    if close(this, other):
        return None  # nothing clipped past the noise
    lo, hi = float(this.min()), float(this.max())
    if lo == hi:
        return None  # one value everywhere: a constant in place of the values (all ones), not a clamp of them
    clipped_hi, clipped_lo = bool((other > hi).any()), bool((other < lo).any())
    if not (clipped_hi or clipped_lo) or not close(
        this, other.clamp(lo if clipped_lo else None, hi if clipped_hi else None)
    ):
        return None
    return f"[{lo:.4g}, {hi:.4g}]" if clipped_lo and clipped_hi else (f"<= {hi:.4g}" if clipped_hi else f">= {lo:.4g}")


def _threshold(diff: torch.Tensor, v: torch.Tensor) -> tuple[str, float] | None:
    """``(condition, c)`` when the elements that differ (``diff``) are exactly those where ``v`` passes
    a threshold: ``|v| > c``, ``v > c`` or ``v < c``."""
    if not bool(diff.any()) or float(diff.double().mean()) > 0.5:
        return None  # a clamp changes the few values past its bound, not most of them
    v = v.double()
    for label, value in (("above", v), ("below", -v), ("beyond +-", v.abs())):
        inside, outside = value[~diff], value[diff]
        if float(outside.min()) > float(inside.max()):
            lo, hi = float(inside.max()), float(outside.min())
            c = _nice(lo, hi)
            if abs(c) < 0.05 * float(v.abs().max()):
                return None  # the values near zero agree, the rest differ: a scale, not a bound
            return label, (-c if label == "below" else c)
    return None


def clamped(e: Evidence) -> Hint | None:
    """One side clamps (clips) a value the other does not: the node itself is the other side's clamped
    to the bounds it reaches, or the node's input is (OLMo's clip_qkv carried over), or the node's input
    differs exactly where an earlier value of the layer passes a threshold (a SwiGLU limit, an
    exponent clamped "for float16 safety"), on either side."""
    x_ours, x_ref = e.inputs()
    lookup = "embed" in e.kind or "pos" in e.kind or e.kind in ("wte", "wpe")  # its input: ids, or a 0/1 mask
    has_input = (
        not lookup
        and x_ref is not None
        and x_ours is not None
        and x_ref.shape == x_ours.shape
        and x_ref.is_floating_point()
    )
    in_tol = 1e-6 * float(x_ref.abs().max()) + e.result.atol if has_input and x_ref is not None else 0.0
    values = [("output", e.ours, e.ref, e.noise + 1e-6 * float(e.ref.abs().max()))]
    if has_input and x_ref is not None and x_ours is not None:
        values.append(("input", x_ours, x_ref, in_tol))
    for where, mine, theirs, tol in values:
        close = _within(tol)
        for side, this, other in (("ours", mine, theirs), ("the reference", theirs, mine)):
            bounds = _clamp_bounds(this.double(), other.double(), close)
            if bounds is not None:
                what = f"its {e.kind} is" if where == "output" else f"the input of its {e.kind} is"
                clip = e.facts.clip_qkv
                why = (
                    "a clip or limit one side applies"
                    if where == "output"
                    else f"clip_qkv ({clip:g}) applied to the projection's input instead of its output"
                    if clip and f"{clip:g}" in bounds
                    else "a clip of the values before it, e.g. clip_qkv where the architecture has none"
                )
                return Hint(
                    "clamp",
                    f"likely a clamp in {side}: {what} the other side's clamped to {bounds} ({why})",
                    {"side": side, "bounds": bounds, "where": where},
                )
    if not has_input or x_ref is None or x_ours is None:
        return None
    diff = (x_ours.double() - x_ref.double()).abs() > in_tol
    operands = [(f"{e.name}@input", x_ref)]
    for name, t in e.ref_trace.tensors.items():
        if e.facts.locate(name)[0] != e.result.layer or not t.is_floating_point() or t.shape[:-1] != x_ref.shape[:-1]:
            continue
        n, width = x_ref.shape[-1], t.shape[-1]
        if width % n == 0:  # the node, or each part of a fused one (Phi-3's gate_up_proj)
            parts = width // n
            operands += [
                (name if parts == 1 else f"{name}[{i * n}:{(i + 1) * n}]", t[..., i * n : (i + 1) * n])
                for i in range(parts)
            ]
    found: list[tuple[str, tuple[str, float]]] = [
        (name, hit) for name, t in operands if (hit := _threshold(diff, t)) is not None
    ]
    if not found and bool((~diff).any()) and float(diff.double().mean()) <= 0.5:
        best = []  # per earlier value, the threshold that explains most of the difference and nothing else
        for name, t in operands[1:]:
            options = []
            for label, value in (("beyond +-", t.double().abs()), ("above", t.double()), ("below", -t.double())):
                c = float(value[~diff].max())
                past = value > c
                if bool(past.any()) and not bool((past & ~diff).any()) and c >= 0.05 * float(value.abs().max()):
                    c = _nice(c, float(value[past].min()))
                    options.append((int(past.sum()), name, label, -c if label == "below" else c, past))
            if options:
                best.append(max(options, key=lambda o: o[0]))
        best.sort(key=lambda o: -o[0])
        covered = torch.zeros_like(diff)
        for _, name, label, c, past in best[:2]:  # a limit on two values at most (gate and up)
            covered |= past
            found.append((name, (label, c)))
        if not bool((covered == diff).all()):
            found = []
    if not found:
        return None
    where = " or ".join(
        f"{name} is {label}{'' if label.endswith('+-') else ' '}{c:g}" for name, (label, c) in found[:2]
    )
    return Hint(
        "clamp",
        f"likely a clamp or limit: the input of {e.kind} differs exactly where {where} (elsewhere the two sides "
        "agree): one side clips or limits values past that threshold",
        {"thresholds": [[name, label, c] for name, (label, c) in found[:2]]},
    )
