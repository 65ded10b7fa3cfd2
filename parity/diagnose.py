"""Typed hints from the pattern of a failing node's error.

Each detector is a small function of one :class:`Evidence` (the failing node, both tensors, both
traces, the architecture's facts) returning a :class:`~parity.hints.Hint` or None; :func:`diagnose`
tries them in order, from the most specific evidence (an exact match with something else) to the
most general (a pattern). A detector stays silent unless its evidence clearly exceeds the noise the
node itself shows: no hint is better than a wrong one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .analysis import HEAD_MAJOR, HEAD_MERGED
from .compare import CHOICE, MISSING, NONFINITE, SHAPE, NodeResult, choice_margins
from .facts import LINEAR, ArchFacts
from .hints import Hint
from .pair import NodeSpec
from .trace import Trace

#: relative residual below which an explanation "reproduces" a tensor
EXPLAINS = 1e-3


@dataclass(frozen=True)
class Evidence:
    """What a detector may look at: the failing node, its two tensors and everything traced."""

    result: NodeResult
    ours: torch.Tensor | None
    ref: torch.Tensor | None
    ours_trace: Trace
    ref_trace: Trace
    facts: ArchFacts
    #: the position of every token, ``(batch, seq)`` (what RoPE rotates by)
    positions: torch.Tensor | None = None
    #: ``(batch, seq)`` 1 for real tokens, 0 for padding, when the run is padded
    attention_mask: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return self.result.kind

    @property
    def name(self) -> str:
        return self.result.name

    def close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Equal within this node's tolerance (and a little slack when the tolerance is exact)."""
        atol = max(self.result.atol, 1e-6 * float(b.abs().max()) if b.numel() else 0.0)
        return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=self.result.rtol))

    @property
    def noise(self) -> float:
        """The node's tolerance at its largest reference value: errors below it are noise."""
        return self.result.atol + self.result.rtol * float(self.ref.abs().max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / nb if nb > 0 else math.inf


def _fmt_list(xs, n=6) -> str:
    xs = list(xs)
    body = ", ".join(str(x) for x in xs[:n])
    return body + (", ..." if len(xs) > n else "")


# --- exact matches with something else ---------------------------------------------------------


def _reads_stream(kind: str) -> bool:
    """A node that is a point of the residual stream: a module's input, or a layer's output."""
    return "@input" in kind or kind == "layer"


def sibling_match(e: Evidence) -> Hint | None:
    """Ours reproduces another reference node of the same layer (gate vs up, k vs v); for a branch's
    input, another point of the residual stream (the branch reads the stream at the wrong place)."""
    prefix = e.name.rsplit(".", 1)[0]
    for name, tensor in e.ref_trace.tensors.items():
        if name == e.name or not name.startswith(prefix) or tensor.shape != e.ours.shape:
            continue
        layer, kind = e.facts.locate(name)
        if e.result.layer is not None and layer != e.result.layer:
            continue  # another layer's node: see other_layer
        if not e.close(e.ours, tensor):
            continue
        if _reads_stream(e.kind) and _reads_stream(kind):
            return Hint(
                "block_layout",
                f"likely the block layout: the {e.kind} of ours is the reference's {name}, another point of the "
                "residual stream (this branch reads the stream before or after the wrong sub-layer)",
                {"matches": name},
            )
        return Hint(
            "swapped_weights",
            f"likely swapped or misassigned weights: ours matches the reference's {name} instead",
            {"matches": name},
        )
    return None


def _same_kind_elsewhere(e: Evidence) -> list[tuple[int, str, torch.Tensor]]:
    """``(layer, name, tensor)`` of the reference's nodes of this node's kind in every other layer."""
    out = []
    for name, tensor in e.ref_trace.tensors.items():
        layer, kind = e.facts.locate(name)
        if kind == e.kind and layer is not None and layer != e.result.layer and tensor.shape == e.ours.shape:
            out.append((layer, name, tensor))
    return out


def kv_sharing(e: Evidence) -> Hint | None:
    """The keys of a layer that reads another layer's keys and values (cross-layer KV sharing): ours
    are some other layer's, or computed here."""
    layer = e.facts.layer(e.result.layer)
    if e.kind != "k_rot" or layer is None or layer.kv_source is None:
        return None
    own = [(i, name, t) for i, name, t in _same_kind_elsewhere(e) if e.facts.layer(i).kv_source is None]
    match = next(((i, name) for i, name, t in own if i != layer.kv_source and e.close(e.ours, t)), None)
    source = f"layer {layer.index} reads the keys and values of layer {layer.kv_source} in the reference (KV sharing)"
    if match is not None:
        return Hint("kv_sharing", f"likely the wrong layer's keys: {source}; ours are layer {match[0]}'s ({match[1]})",
                    {"reference_source": layer.kv_source, "ours_source": match[0]})
    return Hint("kv_sharing", f"likely KV sharing not applied: {source}; ours equal no layer's keys (computed here, "
                "e.g. by projecting this layer's own input)", {"reference_source": layer.kv_source, "ours_source": None})


def other_layer(e: Evidence) -> Hint | None:
    """Ours equals the reference's node of the same kind in another layer (a per-layer input, weight
    or cache slot taken from the wrong layer)."""
    for layer, name, tensor in _same_kind_elsewhere(e):
        if e.close(e.ours, tensor):
            return Hint("layer_offset", f"likely a per-layer tensor from the wrong layer: ours equals the reference's "
                        f"{name} (layer {layer}, not {e.result.layer})", {"matches": name, "layer": layer})
    return None


def soft_capping(e: Evidence) -> Hint | None:
    """The logits of one side are the other's soft-capped, ``cap * tanh(x / cap)``: the final soft-cap
    missing in ours, or applied where the reference applies none (or twice)."""
    cap = e.facts.final_softcap
    if e.kind != "logits" or not cap:
        return None
    a, b = e.ours.double(), e.ref.double()
    tol = max(EXPLAINS, 4 * torch.finfo(e.ref.dtype).eps)
    if _rel(b, cap * torch.tanh(a / cap)) < tol:
        return Hint("softcap", f"likely the final logit soft-cap is missing: the reference's logits are ours "
                    f"soft-capped, {cap:g} * tanh(x / {cap:g})", {"cap": cap, "ours": "uncapped"})
    if _rel(a, cap * torch.tanh(b / cap)) < tol:
        return Hint("softcap", f"likely an extra soft-cap: ours are the reference's logits soft-capped again, "
                    f"{cap:g} * tanh(x / {cap:g})", {"cap": cap, "ours": "capped twice"})
    return None


def transposed_weight(e: Evidence) -> Hint | None:
    """A linear node whose output equals the reference's input times the transposed weight.

    The reference's weight may be stored ``(out, in)`` (``nn.Linear``: ``x W^T``) or ``(in, out)``
    (Transformers' ``Conv1D``, GPT-2: ``x W``); of the two products, the one that reproduces the
    reference's own output is its layout, and ours matching the other is a transposed load."""
    x = e.ref_trace.inputs.get(e.name)
    weight = e.ref_trace.weights.get(e.name)
    if x is None or weight is None or weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
        return None
    xs = e.ours_trace.inputs.get(e.name)
    if xs is None or not e.close(xs, x):
        return None  # the input already differs: not this node's own fault
    bias = e.ref_trace.biases.get(e.name)
    for w in (weight.double().T, weight.double()):
        y = torch.nn.functional.linear(x.double(), w)
        if bias is not None:
            y = y + bias.double()
        if _rel(e.ref, y) < EXPLAINS:
            continue  # the reference's own layout
        if _rel(e.ours, y) < EXPLAINS:
            return Hint(
                "transposed_weight",
                f"likely a transposed weight: ours equals the reference's input times the transposed {e.kind} "
                f"weight (a Conv1D-style or transposed load; residual {_rel(e.ours, y):.1e})",
                {"residual": _rel(e.ours, y)},
            )
    return None


def tap_layout(e: Evidence) -> Hint | None:
    """Ours is the reference with the heads and positions axes swapped: a tap whose sequence length
    equals its head count, read in the other layout (the shape cannot tell them apart)."""
    if e.kind not in ("q_rot", "k_rot", "context") or e.ours is None or e.ours.shape != e.ref.shape:
        return None
    ours = e.ours
    if e.kind == "context" and ours.dim() == 3:
        layer = e.facts.layer(e.result.layer)
        head_dim = layer.head_dim if layer is not None else e.facts.head_dim
        if not head_dim or ours.shape[-1] % head_dim or ours.shape[-1] // head_dim != ours.shape[1]:
            return None
        swapped = ours.unflatten(-1, (-1, head_dim)).transpose(1, 2).flatten(-2)
    elif ours.dim() == 4 and ours.shape[1] == ours.shape[2] > 1:
        swapped = ours.transpose(1, 2)
    else:
        return None
    if not e.close(swapped, e.ref):
        return None
    return Hint(
        "tap_layout",
        f"ours equals the reference with heads and positions swapped: with seq_len = {ours.shape[1]} heads the "
        f"shape cannot tell (batch, seq, heads, head_dim) from (batch, heads, seq, head_dim); declare it, "
        f"parity.tap(tensor, {e.kind!r}, layout='bshd') or layout='bhsd', or check at another seq_len",
        {"seq_len": int(ours.shape[1])},
    )


def _heads(t: torch.Tensor, kind: str, head_dim: int | None) -> torch.Tensor | None:
    """(heads, rest...) view of an attention node, or None."""
    if kind in HEAD_MAJOR and t.dim() == 4:
        return t.transpose(0, 1)
    if kind in HEAD_MERGED and head_dim and t.dim() == 3 and t.shape[-1] % head_dim == 0 and t.shape[-1] > head_dim:
        return t.unflatten(-1, (-1, head_dim)).movedim(-2, 0)
    return None


def head_mapping(e: Evidence) -> Hint | None:
    """Some heads agree and others do not, or ours' heads are the reference's in another order."""
    head_dim = e.facts.layer(e.result.layer).head_dim if e.facts.layer(e.result.layer) else e.facts.head_dim
    a, b = _heads(e.ours, e.kind, head_dim), _heads(e.ref, e.kind, head_dim)
    if a is None or a.shape[0] < 2:
        return None
    n = a.shape[0]
    same = [i for i in range(n) if e.close(a[i], b[i])]
    moved = {i: j for i in range(n) if i not in same for j in range(n) if j != i and e.close(a[i], b[j])}
    if not moved and (not same or len(same) == n):
        return None  # no head equals another: nothing here says "mapping"
    # K/V heads meet the query heads from the scores on: a head mix-up before that is not GQA's
    gqa = e.facts.num_kv_heads != e.facts.num_heads and e.kind in ("scores", "probs", "context")
    cause = (
        "GQA head mapping (K/V heads expanded with repeat instead of repeat_interleave, or grouped wrongly)"
        if gqa else "a head permutation in the weights or the head split (a fused projection cut in flat halves "
        "instead of per head)"
    )
    parts = [f"heads {_fmt_list(same)} agree" if same else "no head agrees in place"]
    if moved:
        parts.append("ours " + ", ".join(f"head {i} = reference head {j}" for i, j in list(moved.items())[:6]))
    differ = [i for i in range(n) if i not in same]
    parts.append(f"heads {_fmt_list(differ)} differ")
    return Hint("head_mapping", f"likely {cause}: " + "; ".join(parts),
                {"agree": same, "moved": {str(k): v for k, v in moved.items()}, "differ": differ})


def last_dim_permutation(e: Evidence) -> Hint | None:
    """Same values, other order along the last axis: a row permutation of a weight (RoPE layout
    permutation with a wrong head count, half-split vs interleaved Q/K rows). The identity is never
    a permutation."""
    ours, ref = e.ours, e.ref
    if ours.dim() < 2 or ours.shape[-1] < 4:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if not torch.allclose(a.sort(-1).values, b.sort(-1).values, atol=max(e.result.atol, 1e-12), rtol=e.result.rtol):
        return None
    perm = [int((b[0] - a[0, j]).abs().argmin()) for j in range(a.shape[-1])]
    moved = [j for j, k in enumerate(perm) if j != k]
    if not moved or len(set(perm)) != len(perm):
        return None
    if _rel(a, b[:, perm]) > EXPLAINS:  # ours[..., j] = reference[..., perm[j]] on every token
        return None
    evidence: dict = {"permutation": perm[:64], "moved": len(moved)}
    within = ""
    head_dim = e.facts.head_dim
    if e.kind in HEAD_MERGED and head_dim and ours.shape[-1] % head_dim == 0:
        crossing = sum(1 for j, k in enumerate(perm) if j // head_dim != k // head_dim)
        evidence["crosses_heads"] = crossing
        within = (
            "; every element stays in its head (a permutation within heads: RoPE rows in Meta's interleaved "
            "layout, not un-permuted or un-permuted with the wrong head count)"
            if crossing == 0 else f"; {crossing} positions cross head boundaries"
        )
    return Hint(
        "weight_permutation",
        f"likely a permutation of weight rows: same values per token, other order along the last axis "
        f"(ours[j] = reference[{_fmt_list(perm, 8)}]){within}",
        evidence,
    )


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


def _activations() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
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
    }


def activation_function(e: Evidence) -> Hint | None:
    """Ours equals an earlier reference node of the same layer and shape (the pre-activation, e.g.
    GPT-2's ``c_fc`` output) through another activation than the reference's: exact vs tanh GELU,
    SiLU for GELU."""
    if e.result.layer is None:
        return None
    acts = _activations()
    for name, pre in e.ref_trace.tensors.items():
        if name == e.name:
            break  # only nodes the reference computed before this one
        if pre.shape != e.ref.shape or not pre.is_floating_point() or e.facts.locate(name)[0] != e.result.layer:
            continue
        values = {label: fn(pre) for label, fn in acts.items()}
        ours_is = next((label for label, y in values.items() if e.close(e.ours, y) and not e.close(e.ref, y)), None)
        if ours_is is None:
            continue
        ref_is = next((label for label, y in values.items() if e.close(e.ref, y)), None)
        theirs = f"the reference {ref_is}" if ref_is else "the reference another function"
        return Hint(
            "activation",
            f"likely the activation function: ours equals {ours_is} of the reference's {name}, {theirs}",
            {"ours": ours_is, "reference": ref_is, "input": name},
        )
    return None


def _ms(x: torch.Tensor, centered: bool) -> torch.Tensor:
    x = x.double()
    if centered:
        x = x - x.mean(-1, keepdim=True)
    return x.pow(2).mean(-1)


def _is_norm(kind: str) -> bool:
    """A norm node's kind: ``*norm*`` (Llama, OLMo, Gemma...) or GPT-2's ``ln_1``, ``ln_2``, ``ln_f``."""
    return "norm" in kind or kind.startswith("ln_")


def norm_eps(e: Evidence) -> Hint | None:
    """A norm whose inputs agree, and whose ours/ref ratio is constant over channels but varies per
    token with the token's mean square: another eps (or eps outside the square root)."""
    if not _is_norm(e.kind) or e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if x_ref.shape != e.ref.shape or not e.close(x_ours, x_ref):
        return None
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    shift = e.ref_trace.biases.get(e.name)  # a LayerNorm's bias: the ratio holds for w * x_hat alone
    if shift is not None and shift.shape == a.shape[-1:]:
        a, b = a - shift.double(), b - shift.double()
    keep = b.abs() > 1e-3 * b.abs().amax(-1, keepdim=True)
    ratio = torch.where(keep, a / b.where(keep, torch.ones_like(b)), torch.nan)
    r = ratio.nanmean(-1)
    spread = ((ratio - r[:, None]).abs().nan_to_num(0.0).amax(-1) / r.abs()).max()
    if not bool(torch.isfinite(r).all()) or float(spread) > 1e-3 or float((r - 1).abs().max()) < 1e-4:
        return None  # not a per-token factor, or no factor at all
    centered = e.facts.norm_kind == "layernorm"
    ms = _ms(x_ref, centered).flatten()
    r2 = r.pow(2)
    # r^2 = (ms + eps_ref) / (ms + eps_ours)  <=>  r^2 * eps_ours - eps_ref = ms * (1 - r^2): least squares,
    # each token's equation divided by its ms + eps so large-RMS tokens (where eps is invisible) add no noise
    weight = 1.0 / (ms + (e.facts.norm_eps or 1e-6))
    design = torch.stack([r2, -torch.ones_like(r2)], 1) * weight[:, None]
    solution = torch.linalg.lstsq(design, (ms * (1 - r2) * weight)[:, None]).solution.flatten()
    eps_ours, eps_ref = float(solution[0]), float(solution[1])
    predicted = ((ms + eps_ref) / (ms + eps_ours)).sqrt()
    if min(eps_ours, eps_ref) >= -1e-12 and float(((predicted - r).abs() / r).max()) < 1e-3:
        return Hint(
            "norm_eps",
            f"likely the norm's eps: ours / reference varies per token with the token's mean square (ratio "
            f"{float(r.min()):.4g}..{float(r.max()):.4g}), as eps {eps_ours:.3g} in ours and {eps_ref:.3g} in the reference "
            f"give (the config says {e.facts.norm_eps:g})",
            {"eps_ours": eps_ours, "eps_reference": eps_ref, "config_eps": e.facts.norm_eps},
        )
    eps = e.facts.norm_eps or 0.0
    outside = ((ms + eps).sqrt() / r - ms.sqrt())  # ours = x / (sqrt(ms) + eps'): one eps' for every token
    if float(outside.std()) <= 1e-3 * max(float(outside.abs().mean()), 1e-30):
        return Hint(
            "norm_eps",
            f"likely eps outside the square root: ours behaves like x / (sqrt(mean(x^2)) + {float(outside.mean()):.3g}), "
            f"the reference like x / sqrt(mean(x^2) + {eps:g})",
            {"eps_outside": float(outside.mean()), "config_eps": eps},
        )
    return None


def _qk_agree(e: Evidence) -> bool:
    stem = e.name.rsplit(".", 1)[0]
    for kind in ("q_rot", "k_rot"):
        a, b = e.ours_trace.tensors.get(f"{stem}.{kind}"), e.ref_trace.tensors.get(f"{stem}.{kind}")
        if a is None or b is None or a.shape != b.shape or not e.close(a, b):
            return False
    return True


def softmax_temperature(e: Evidence) -> Hint | None:
    """Attention probabilities that are the reference's scores times one constant, softmaxed: the
    attention scale (softmax temperature), with q and k agreeing."""
    if e.kind != "probs" or not _qk_agree(e):
        return None
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    if scores is None or scores.shape != e.ref.shape:
        return None
    p_o, p_r, s = e.ours.double(), e.ref.double(), scores.double()
    keep = (p_o > 1e-6) & (p_r > 1e-6)
    # log p_o - log p_r = (c - 1) s - const per row: c from the slope over kept entries
    d = (p_o.log() - p_r.log()).where(keep, torch.zeros_like(p_o))
    n = keep.sum(-1, keepdim=True).clamp_min(1)
    s_c = (s.where(keep, torch.zeros_like(s)) - (s * keep).sum(-1, keepdim=True) / n) * keep
    d_c = (d - d.sum(-1, keepdim=True) / n) * keep
    denom = float(s_c.pow(2).sum())
    if denom == 0:
        return None
    slope = float((s_c * d_c).sum()) / denom
    if abs(slope) < 1e-3 or float((d_c - slope * s_c).pow(2).sum()) > 1e-6 * float(d_c.pow(2).sum()) + 1e-18:
        return None
    c = 1 + slope
    return Hint(
        "attention_scale",
        f"likely the attention scale (softmax temperature): q and k agree, and ours' probabilities are the "
        f"softmax of the reference's scores times {c:.6g}",
        {"factor": c},
    )


# --- scales --------------------------------------------------------------------------------------


def constant_ratio(e: Evidence) -> Hint | None:
    """ours / reference is one constant everywhere: a missing or extra scale (named when it equals
    a known constant of the architecture)."""
    a, b = e.ours.double().flatten(), e.ref.double().flatten()
    keep = b.abs() > 1e-3 * b.abs().max()
    if int(keep.sum()) < 4:
        return None
    ratio = a[keep] / b[keep]
    mean = float(ratio.mean())
    if abs(mean) < 1e-12 or float(ratio.std()) / abs(mean) > 1e-3:
        return None
    # the ratio must stand out from the node's own noise, not be a rounding drift (F20)
    if abs(mean - 1) * float(b.abs().max()) <= 10 * e.noise or abs(mean - 1) < 1e-3:
        return None
    r = max(mean, 1 / mean)  # compare magnitudes >= 1, whichever side carries the extra factor
    bigger = "ours / reference" if mean > 1 else "reference / ours"
    matched = [
        (name, value) for name, value in e.facts.named_constants().items()
        if value > 0 and abs(r / max(value, 1 / value) - 1) < 1e-3
    ]
    known = ""
    kind = "attention_scale" if e.kind == "scores" and _qk_agree(e) else "scale"
    if e.kind == "logits" and e.facts.logit_scale not in (None, 1.0):
        return Hint("logit_scale", f"likely logit_scale: the logits differ by one factor, ours / reference = {mean:.6g} "
                    f"(the reference's logit_scale is {e.facts.logit_scale:g})", {"ratio": mean})
    if matched and kind == "scale":
        name, value = matched[0]
        known = f"; matches {bigger} = {name} ({max(value, 1 / value):.6g})"
        if "attention factor" in name:
            kind = "rope_attention_factor"
        elif name == "logit_scale":
            kind = "logit_scale"
    if kind == "attention_scale":
        named = f"; matches {matched[0][0]}" if matched else ""
        return Hint(kind, f"likely the attention scale (softmax temperature): q and k agree, the pre-softmax scores "
                    f"differ by one factor, ours / reference = {mean:.6g}{named}", {"ratio": mean, "matches": matched[0][0] if matched else None})
    return Hint(
        kind,
        f"likely a missing or extra scale: ours / reference = {mean:.6g} at every position including 0 "
        f"(reference / ours = {1 / mean:.6g}){known}",
        {"ratio": mean, "matches": matched[0][0] if matched else None},
    )


def row_scale(e: Evidence) -> Hint | None:
    """ours / reference is one factor per row (the last axis: a token's or a head's vector), another
    factor for other rows: a per-vector normalisation (L2, RMS) that one side applies and the other
    does not, e.g. a missing L2 norm of q or k before linear attention."""
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    if a.shape[0] < 2 or a.shape[-1] < 2:
        return None
    keep = b.abs() > 1e-3 * b.abs().amax(-1, keepdim=True)
    ratio = torch.where(keep, a / b.where(keep, torch.ones_like(b)), torch.nan)
    r = ratio.nanmean(-1)
    rows = (keep.sum(-1) >= 2) & torch.isfinite(r) & (r != 0)
    if int(rows.sum()) < 2:
        return None
    spread = ((ratio[rows] - r[rows, None]).abs().nan_to_num(0.0).amax(-1) / r[rows].abs()).max()
    factors = r[rows]
    if float(spread) > 1e-3 or float(factors.max() / factors.min()) < 1.01 or bool((factors < 0).any()):
        return None  # not one factor per row, or the same factor everywhere (a scale)
    if _rel(b[rows] * factors[:, None], a[rows]) > EXPLAINS:
        return None  # the factors miss what ours holds where the reference is ~0 (a key the window adds)
    evidence: dict = {"row_factors": factors[:8].tolist()}
    cause = "a per-vector normalisation applied on one side only"
    for label, size in (("unit L2 length", a[rows].norm(dim=-1)), ("unit RMS", a[rows].pow(2).mean(-1).sqrt())):
        ref_size = size / factors
        ours_unit, ref_unit = bool(((size - 1).abs() < 1e-3).all()), bool(((ref_size - 1).abs() < 1e-3).all())
        if ref_unit != ours_unit:
            side = ("the reference's rows have" if ref_unit else "ours have")
            cause = f"{side} {label}, the other side's do not: a missing {'L2' if 'L2' in label else 'RMS'} normalisation"
            evidence["unit"] = {"reference" if ref_unit else "ours": label}
            break
    return Hint(
        "row_scale",
        f"likely {cause}: ours / reference is one factor per row (along the last axis), a different one for each "
        f"row ({_fmt_list(f'{v:.4g}' for v in factors[:4].tolist())})",
        evidence,
    )


def row_normalisation(e: Evidence) -> Hint | None:
    """ours / reference is one factor per row (over the last axis), different across rows, and one
    side's rows sum to 1: a normalisation over the last axis on one side only (top-k routing weights
    renormalised, or not, against ``norm_topk_prob``)."""
    if e.ours.dim() < 2 or e.ours.shape[-1] < 2 or not e.ref.is_floating_point():
        return None
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    if a.shape[0] < 2 or bool((b.abs() < 1e-12).any()):
        return None
    ratio = a / b
    per_row = ratio.mean(-1)
    if float((ratio.std(-1) / per_row.abs()).max()) > 1e-3 or float(per_row.std() / per_row.abs().mean()) < 1e-3:
        return None  # not one factor per row, or one factor everywhere (constant_ratio's case)
    tol = max(1e-3, 4 * float(torch.finfo(e.ref.dtype).eps))
    ours_one, ref_one = bool(((a.sum(-1) - 1).abs() < tol).all()), bool(((b.sum(-1) - 1).abs() < tol).all())
    if ours_one == ref_one:
        return None
    side, other = ("ours", "the reference") if ours_one else ("the reference", "ours")
    return Hint(
        "renormalisation",
        f"likely a normalisation over the last axis on one side only: {side} sums to 1 in every row, {other} does "
        f"not, and ours / reference is one factor per row ({float(per_row.min()):.4g}..{float(per_row.max()):.4g}); "
        "for top-k routing weights: renormalised over the chosen experts where the config says not, or the reverse "
        "(norm_topk_prob)",
        {"ours_sums_to_one": ours_one, "reference_sums_to_one": ref_one,
         "ratio_min": float(per_row.min()), "ratio_max": float(per_row.max())},
    )


def expert_weights(e: Evidence) -> Hint | None:
    """One expert's output explained by the reference's experts under another weight assignment:
    another expert's weights (experts indexed in another order), or this expert with its fused gate
    and up halves swapped."""
    record = e.ref_trace.extras.get(e.name)
    if record is None or not hasattr(record, "output") or len(record.rows) == 0:
        return None
    ours = e.ours.double()[record.rows]
    if not bool(torch.isfinite(ours).all()):
        return None
    halves = record.output(record.index, swap_halves=True)
    if halves is None:
        return None
    if _rel(ours, halves) < EXPLAINS:
        return Hint(
            "swapped_weights",
            f"likely the fused gate/up projection split the wrong way round: ours equals the reference's expert "
            f"{record.index} with its gate and up halves swapped (residual {_rel(ours, halves):.1e})",
            {"expert": record.index, "residual": _rel(ours, halves)},
        )
    for j in range(record.num_experts):
        if j == record.index:
            continue
        other = record.output(j)
        if other is not None and _rel(ours, other) < EXPLAINS:
            return Hint(
                "expert_mapping",
                f"likely experts indexed in another order: ours' expert {record.index} computes with the reference's "
                f"expert {j} weights on its {len(record.rows)} token{'s' if len(record.rows) != 1 else ''} "
                f"(residual {_rel(ours, other):.1e})",
                {"expert": record.index, "matches": j, "tokens": len(record.rows)},
            )
    return None


def choice(e: Evidence, spec: NodeSpec | None) -> Hint:
    """A different choice at an integer node (top-k experts): where, whether it is the same set in
    another order, and how near a tie the reference's scores were there."""
    scores = e.ref_trace.tensors.get(spec.chosen_from) if spec is not None and spec.chosen_from else None
    found = choice_margins(e.ours, e.ref, scores)
    rows = found["rows"]
    where = f"rows {_fmt_list(rows, 8)}"
    if e.positions is not None and e.positions.numel() == found["total"]:
        seq = e.positions.shape[1]
        where = "tokens " + _fmt_list([f"(row {r // seq}, position {r % seq})" for r in rows], 6)
    evidence: dict = {"rows": rows[:64], "same_set": found["same_set"][:64]}
    if found["same_set"] and len(found["same_set"]) == len(rows):
        return Hint("routing", f"likely the same experts chosen in another order (top-k sorted differently) at {where}; "
                    "the combined output is unaffected unless the order is used", evidence)
    text = f"likely a different expert choice at {where} ({len(rows)} of {found['total']} tokens)"
    margins = found["margins"]
    if margins:
        evidence["margins"] = margins[:64]
        s = scores.detach().double()
        floor = 8 * float(torch.finfo(scores.dtype).eps) * float(s.abs().max()) if scores.is_floating_point() else 0.0
        near = [m for m in margins if m <= floor]
        if len(near) == len(margins):
            text += (f": the reference's scores there are near-ties (margin {max(margins):.2g} between its last chosen and "
                     f"first unchosen expert, within rounding): a numerical accident upstream decides, not a routing bug")
        else:
            text += (f": the reference's margin between its last chosen and first unchosen score there is "
                     f"{min(margins):.3g}..{max(margins):.3g}, not a near-tie: the router scores or the top-k differ")
    return Hint("routing", text, evidence)


def channel_ratio(e: Evidence) -> Hint | None:
    """ours / reference constant over tokens for each channel, different across channels."""
    ours, ref = e.ours, e.ref
    if ours.dim() < 2 or ours.shape[-1] < 2:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if a.shape[0] < 2 or bool((b.abs() < 1e-6).any()):
        return None
    ratio = a / b
    spread = float((ratio.std(0) / ratio.mean(0).abs().clamp_min(1e-12)).max())
    if spread > 1e-3:
        return None
    per_channel = ratio.mean(0)
    if float((per_channel - 1).abs().max()) < 1e-3:
        return None
    return Hint(
        "channel_scale",
        "likely a per-channel weight difference (a norm weight used as w instead of 1 + w, or a wrong norm "
        f"weight): ours / reference is constant over tokens per channel, e.g. "
        f"{_fmt_list(f'{v:.4g}' for v in per_channel[:4].tolist())}",
        {"per_channel": per_channel[:16].tolist()},
    )


# --- norms ---------------------------------------------------------------------------------------


def norm_weight_offset(e: Evidence) -> Hint | None:
    """A norm whose inputs agree and whose output is the reference's times ``(w + 1 - o) / (w + o)``
    per channel, ``w`` the stored weight and ``o`` the reference's offset: ours multiplies by ``w``
    where the reference multiplies by ``1 + w`` (Gemma 3), or the reverse (a Gemma 3 norm in Gemma 4)."""
    if "norm" not in e.kind or e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    w = e.ref_trace.weights.get(e.name)
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if w is None or w.dim() != 1 or w.shape[0] != e.ref.shape[-1] or not e.close(x_ours, x_ref):
        return None
    offset, w = e.facts.norm_weight_offset, w.double()
    if bool(((w + offset).abs() < 1e-6).any()):
        return None
    predicted = e.ref.double() * (w + 1 - offset) / (w + offset)
    if _rel(e.ours, predicted) >= max(EXPLAINS, 4 * torch.finfo(e.ref.dtype).eps):
        return None
    ours, ref = ("w", "1 + w") if offset == 1.0 else ("1 + w", "w")
    return Hint(
        "norm_weight_offset",
        f"likely the norm weight offset: ours multiplies by {ours}, the reference by {ref} (ours / reference = "
        f"({ours}) / ({ref}) per channel, constant over tokens, e.g. {_fmt_list(f'{v:.4g}' for v in ((w + 1 - offset) / (w + offset))[:4].tolist())})",
        {"ours": ours, "reference": ref},
    )


def _normalisers(x: torch.Tensor, head_dim: int | None, eps: float = 0.0) -> dict[str, torch.Tensor]:
    """``x`` normalised each way a norm might (``eps``: the architecture's norm eps)."""
    x = x.double()
    centered = x - x.mean(-1, keepdim=True)
    out = {
        "RMSNorm over the last axis": x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
        "LayerNorm (mean-subtracting)": centered / (centered.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
    }
    if head_dim and x.shape[-1] % head_dim == 0 and x.shape[-1] > head_dim:
        h = x.unflatten(-1, (-1, head_dim))
        out["RMSNorm per head"] = (h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()).flatten(-2)
    if head_dim and x.dim() >= 3 and x.shape[-1] == head_dim and x.shape[-2] > 1:  # (..., heads, head_dim)
        out["RMSNorm over the whole projection"] = x / (x.pow(2).mean((-2, -1), keepdim=True) + eps).sqrt()
    return out


def _explained_by(y: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str | None:
    """The candidate n with y ~= n * w for a per-channel w (least squares), or y ~= n * w + b with a
    per-channel bias too (a LayerNorm with bias, GPT-2), if any."""
    y = y.double().flatten(0, -2)
    for name, n in candidates.items():
        n = n.flatten(0, -2)
        w = (y * n).sum(0) / n.pow(2).sum(0).clamp_min(1e-30)
        if _rel(n * w, y) < EXPLAINS:
            return name
        if n.shape[0] > 2:
            nc, yc = n - n.mean(0), y - y.mean(0)
            w = (yc * nc).sum(0) / nc.pow(2).sum(0).clamp_min(1e-30)
            if _rel(nc * w, yc) < EXPLAINS:
                return name
    return None


def norm_kind(e: Evidence) -> Hint | None:
    """A norm node whose output is explained by another normaliser than the reference's."""
    if not _is_norm(e.kind) or e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if not e.close(x_ours, x_ref):
        return None  # the input already differs: not this norm's own fault
    candidates = _normalisers(x_ref, e.facts.head_dim, e.facts.norm_eps or 0.0)
    ours_is, ref_is = _explained_by(e.ours, candidates), _explained_by(e.ref, candidates)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    evidence = ""
    if "LayerNorm" in ref_is or "LayerNorm" in ours_is:
        means = x_ref.double().mean(-1).flatten()
        evidence = f"; the difference tracks each token's mean (input means {_fmt_list(f'{m:.3g}' for m in means[:4].tolist())}): mean subtraction"
    if any(w in label for w in ("per head", "whole projection") for label in (ours_is, ref_is)):
        evidence = "; per-head vs whole-projection Q/K norm"
    return Hint("norm_kind", f"likely the wrong norm: ours behaves like {ours_is}, the reference like {ref_is}{evidence}",
                {"ours": ours_is, "reference": ref_is})


def norm_placement(e: Evidence) -> Hint | None:
    """A projection whose input is the reference's input after a norm (pre-norm vs post-norm)."""
    if e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if x_ref.shape != x_ours.shape or e.close(x_ours, x_ref):
        return None
    ours_is = _explained_by(x_ours, _normalisers(x_ref, None, e.facts.norm_eps or 0.0))
    if ours_is is not None:
        return Hint(
            "norm_placement",
            f"likely norm placement: the input of {e.kind} in ours equals the reference's input after a "
            f"{ours_is} (pre-norm vs post-norm)",
            {"normaliser": ours_is},
        )
    return None


def _layer_node(e: Evidence, layer: int, kind: str) -> torch.Tensor | None:
    """The reference's tensor of the node of that kind in that layer, if traced."""
    for name, tensor in e.ref_trace.tensors.items():
        if e.facts.locate(name) == (layer, kind):
            return tensor
    return None


def _residual_into(e: Evidence, layer: int) -> torch.Tensor | None:
    """The reference's residual stream entering ``layer``: the previous layer's output, or the
    (scaled) token embedding before layer 0."""
    if layer > 0:
        return _layer_node(e, layer - 1, "layer")
    x = e.ref_trace.tensors.get(e.facts.embed_module)
    return x * e.facts.embed_scale if x is not None and e.facts.embed_scale else x


def block_layout(e: Evidence) -> Hint | None:
    """The MLP branch reads the residual after attention on one side and the layer's input on the
    other: a parallel block (``x + attn(N(x)) + mlp(N(x))``) run sequentially, or the reverse."""
    if e.result.layer is None or not (e.kind.endswith("@input") or _is_norm(e.kind)):
        return None
    x, attn = _residual_into(e, e.result.layer), _layer_node(e, e.result.layer, "o_proj")
    if x is None or attn is None or x.shape != e.ref.shape or attn.shape != x.shape:
        return None
    candidates = {
        "the residual after attention (sequential block)": x.double() + attn.double(),
        "the layer's input (parallel block)": x.double(),
    }

    def explained(y: torch.Tensor) -> str | None:
        for label, u in candidates.items():
            if _rel(y, u) < EXPLAINS or _explained_by(y, _normalisers(u, None, e.facts.norm_eps or 0.0)) is not None:
                return label
        return None

    ours_is, ref_is = explained(e.ours), explained(e.ref)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    return Hint(
        "block_layout",
        f"likely the block layout: the {e.kind} of ours is computed from {ours_is}, the reference's from {ref_is}",
        {"ours": ours_is, "reference": ref_is},
    )


# --- positions -----------------------------------------------------------------------------------


def _seq_axis(kind: str) -> int:
    return 2 if kind in HEAD_MAJOR else 1


def _by_position(ours: torch.Tensor, ref: torch.Tensor, axis: int) -> torch.Tensor:
    diff = (ours.double() - ref.double()).abs().movedim(axis, 0)
    return diff.reshape(diff.shape[0], -1).amax(dim=1)


def position_table_offset(e: Evidence) -> Hint | None:
    """A position embedding node (``wpe``, ``embed_positions``) where ours at position ``p`` equals the
    reference at ``p + k`` for every ``p`` both have (``k`` != 0): a learned position table indexed with
    ``position + k``. Other nodes shifted along the sequence are :func:`sequence_shift`'s."""
    axis = _seq_axis(e.kind)
    if ("pos" not in e.kind and e.kind != "wpe") or e.ours.dim() <= axis or e.ours.shape[axis] < 4:
        return None
    n = e.ours.shape[axis]
    for k in (1, -1, 2, -2):
        ours, ref = e.ours.narrow(axis, max(0, -k), n - abs(k)), e.ref.narrow(axis, max(0, k), n - abs(k))
        if e.close(ours, ref):
            sign = "+" if k > 0 else "-"
            return Hint(
                "position_offset",
                f"likely positions off by {k}: ours at position p equals the reference at position p {sign} {abs(k)} "
                f"(for p = {max(0, -k)}..{n - 1 - max(0, k)}; a position table or position ids shifted by {k})",
                {"offset": k},
            )
    return None


def _pre_rope(e: Evidence, n_heads: int) -> torch.Tensor | None:
    """The reference's q (or k) before RoPE as (batch, heads, seq, head_dim), from the q_norm/q_proj node
    (a per-head norm's output is ``(batch, seq, heads, head_dim)`` where Transformers normalises
    before moving heads first, Qwen3 and Gemma 4, and ``(batch, heads, seq, head_dim)`` where it
    normalises after, Gemma 3). When the sequence length equals the head count the shape cannot
    tell: the layout that equals the reference's rotated tensor at position 0 (no rotation) wins."""
    stem = e.name.rsplit(".", 1)[0]
    letter = e.kind[0]
    head_dim = e.ref.shape[-1]
    seq = e.ref.shape[2] if e.ref.dim() == 4 else None
    for kind in (f"{letter}_norm", f"{letter}_proj"):
        t = e.ref_trace.tensors.get(f"{stem}.{kind}")
        if t is None:
            continue
        if t.dim() == 3 and t.shape[-1] == n_heads * head_dim:
            return t.unflatten(-1, (n_heads, head_dim)).transpose(1, 2)
        if t.dim() != 4:
            continue
        candidates = []
        if t.shape[1:3] == (n_heads, seq):
            candidates.append(t)
        if t.shape[1:3] == (seq, n_heads):
            candidates.append(t.transpose(1, 2))
        if len(candidates) > 1 and e.positions is not None and e.positions.shape == (t.shape[0], seq):
            start = e.positions == 0  # (batch, seq): tokens RoPE leaves as they are
            if bool(start.any()):
                at_start = [c for c in candidates if e.close(c.transpose(1, 2)[start], e.ref.transpose(1, 2)[start])]
                candidates = at_start or candidates
        if candidates:
            return candidates[0]
    return None


def _rotated_dims(e: Evidence, rotated: torch.Tensor, x: torch.Tensor) -> int:
    """How many leading dims of each head ``rotated`` changes: the rest equal the unrotated ``x``
    (partial rotary passes them through)."""
    n = x.shape[-1]
    while n > 0 and e.close(rotated[..., n - 1], x[..., n - 1]):
        n -= 1
    return n


def _pairing(rotated: torch.Tensor, x: torch.Tensor) -> str | None:
    """Which RoPE pairing ``rotated`` preserves (pair norms equal to the input's, up to one scale)."""
    d = x.shape[-1]
    layouts = {
        "half-split (i, i + d/2)": (torch.arange(d // 2), torch.arange(d // 2) + d // 2),
        "interleaved (2i, 2i + 1)": (torch.arange(0, d, 2), torch.arange(1, d, 2)),
    }
    for name, (i, j) in layouts.items():
        rn = rotated.double()[..., i].pow(2) + rotated.double()[..., j].pow(2)
        xn = x.double()[..., i].pow(2) + x.double()[..., j].pow(2)
        keep = xn > 1e-6 * xn.max()
        ratio = rn[keep] / xn[keep]
        if ratio.numel() and float(ratio.std()) / float(ratio.mean()) < 1e-4:
            return name
    return None


def rope_fit(e: Evidence) -> Hint | None:
    """Read ours' rotation back (angles and amplitude per frequency and position) and name the RoPE
    that reproduces it: another layer type's, the unscaled one, another theta, shifted positions."""
    from .rope_fit import identify

    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    layer = e.facts.layer(e.result.layer)
    x = _pre_rope(e, e.ours.shape[1])
    if layer is None or x is None or x.shape != e.ours.shape or e.positions.shape != (e.ours.shape[0], e.ours.shape[2]):
        return None
    ropes = {t: e.facts.rope_of_type(t) for t in sorted(set(e.facts.layer_types))}
    tol = 1e-2 if e.ours.dtype in (torch.bfloat16, torch.float16) else 1e-4
    fit = identify(x, e.ours, layer, ropes, e.positions, tol, e.attention_mask, e.facts.max_position_embeddings)
    if fit is None:
        return None
    own = layer.rope.attention_factor if layer.rope is not None else 1.0
    amp = f"cos/sin scaled by {fit.amplitude:.6g} (the reference: {own:.6g})"
    evidence = {"ours": fit.label, "amplitude": fit.amplitude, "reference_amplitude": own, "layer_type": layer.layer_type}
    if fit.offsets:
        pads = [0] * len(fit.offsets) if e.attention_mask is None else [int(n) for n in (e.attention_mask == 0).sum(1)]
        same = list(fit.offsets) == pads
        because = ("each row's offset equals its pad count: ours counts positions 0..S-1 over the padding, the "
                   "reference (as generation does) from each row's first real token") if same else "positions are shifted"
        return Hint(
            "position_offset",
            f"likely positions not derived from the attention mask: ours rotates each batch row by this layer's RoPE "
            f"at its position + {list(fit.offsets)} (pad counts {pads}); {because}",
            {**evidence, "offsets": list(fit.offsets), "pad_counts": pads},
        )
    if fit.label.startswith("this layer's RoPE"):
        if abs(fit.amplitude / own - 1) < 1e-3:
            return None  # ours is this layer's RoPE: the error is not in the rotation
        named = [(n, v) for n, v in e.facts.named_constants().items() if "attention factor" in n and abs(fit.amplitude / own / v - 1) < 1e-3]
        detail = f" ({named[0][0]})" if named else ""
        return Hint("rope_attention_factor",
                    f"likely the RoPE attention factor: ours rotates with this layer's frequencies but {amp}{detail}", evidence)
    if fit.label.startswith("the RoPE of") and layer.rope is None:
        return Hint(
            "rope_unexpected",
            f"likely RoPE where the reference applies none: this {layer.layer_type} layer is NoPE in the reference, "
            f"ours rotates it with {fit.label}, {amp}",
            evidence,
        )
    if fit.label.startswith("the RoPE of"):
        return Hint(
            "rope_layer_type",
            f"likely RoPE per layer type: this {layer.layer_type} layer of ours uses {fit.label}, {amp}; "
            "in Transformers 5 each layer type has its own rope_parameters (e.g. YaRN on full_attention only)",
            evidence,
        )
    if fit.label.startswith("the unscaled RoPE"):
        return Hint("rope_scaling", f"likely the RoPE scaling is not applied: ours rotates with {fit.label}, {amp}", evidence)
    return Hint("rope_theta", f"likely a different rope theta: ours rotates like {fit.label}, {amp} (the reference: theta "
                f"{layer.rope.theta:g})", evidence)


def _unrotated_dims(t: torch.Tensor, x: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """``(head_dim,)`` bool: the dims ``t`` leaves exactly as ``x`` at every token whose position is
    past 0 (``moved``, ``(batch, seq)``)."""
    a, b = t.transpose(1, 2)[moved], x.transpose(1, 2)[moved]  # (tokens, heads, head_dim)
    return (a != b).sum(dim=(0, 1)) == 0


def rope_partial(e: Evidence) -> Hint | None:
    """Ours rotates other dims of each head than the reference: partial rotary over the whole head,
    or over the first dims where the reference pairs ``(i, i + head_dim/2)`` (Gemma 4's
    proportional RoPE), or the reverse. Dims with a zero frequency come through RoPE bit for bit."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    x = _pre_rope(e, e.ours.shape[1])
    moved = e.positions > 0
    if x is None or x.shape != e.ours.shape or moved.shape != (e.ours.shape[0], e.ours.shape[2]) or not bool(moved.any()):
        return None
    ours_still, ref_still = _unrotated_dims(e.ours, x, moved), _unrotated_dims(e.ref, x, moved)
    if torch.equal(ours_still, ref_still) or bool(ref_still.all()) or bool(ours_still.all()):  # no RoPE: rope_pattern
        return None
    d = e.ours.shape[-1]

    def rotated(still: torch.Tensor) -> str:
        dims = (~still).nonzero().flatten().tolist()
        return f"{len(dims)} of {d} dims ({_fmt_list(dims, 8)})" if dims else "no dims"

    return Hint(
        "rope_partial",
        f"likely partial rotary: the reference rotates {rotated(ref_still)} of each head and leaves the rest as they "
        f"are, ours rotates {rotated(ours_still)} (how many dims rotate, and which pairs: (i, i + d/2) over the whole "
        "head, or within the first dims)",
        {"reference_rotated": (~ref_still).nonzero().flatten().tolist(), "ours_rotated": (~ours_still).nonzero().flatten().tolist()},
    )


def rope_pattern(e: Evidence) -> Hint | None:
    """Position 0 agrees and the error grows with position: RoPE (frequencies, scaling, pairing, offset)."""
    ours, ref = e.ours, e.ref
    # Only where RoPE acts: after attention, position 0 agrees trivially (it sees one key).
    if e.kind not in ("q_rot", "k_rot") or ours.dim() != 4 or ours.shape[2] < 3:
        return None
    per_pos = _by_position(ours, ref, 2)
    tol = e.noise
    if float(per_pos[0]) > tol or float(per_pos.max()) <= tol:
        return None
    numbers = (
        f"position 0 agrees (error {float(per_pos[0]):.2g}), later positions differ "
        f"(pos 1: {float(per_pos[1]):.3g}, pos {len(per_pos) - 1}: {float(per_pos[-1]):.3g})"
    )
    evidence = {"position_0": float(per_pos[0]), "last_position": float(per_pos[-1])}
    x = _pre_rope(e, ours.shape[1])
    ref_pairs = None
    if x is not None and x.shape == ours.shape:
        if e.close(ref, x):
            return Hint("rope_unexpected",
                        f"likely RoPE where the reference applies no rotation (a NoPE layer): the reference's {e.kind} is its unrotated input; {numbers}",
                        evidence)
        if e.close(ours, x):
            return Hint("rope_missing", f"likely a missing RoPE: ours applies no rotation here, the reference does; {numbers}", evidence)
        ours_dims, ref_dims = _rotated_dims(e, ours, x), _rotated_dims(e, ref, x)
        here = e.facts.layer(e.result.layer)
        declared = here.rope.rotary_dim if here is not None and here.rope is not None else None
        if ours_dims != ref_dims and ref_dims == declared:
            d = ours.shape[-1]
            return Hint(
                "rope_partial",
                f"likely the rotary share of each head (partial_rotary_factor): ours rotates its first {ours_dims} of "
                f"{d} dims ({ours_dims / d:g}), the reference its first {ref_dims} ({ref_dims / d:g}) and passes the "
                f"rest through; {numbers}",
                {**evidence, "ours_rotated_dims": ours_dims, "reference_rotated_dims": ref_dims},
            )
        ours_pairs, ref_pairs = _pairing(ours, x), _pairing(ref, x)
        if ours_pairs and ref_pairs and ours_pairs != ref_pairs:
            return Hint("rope_pairing", f"likely RoPE pairing layout: ours rotates {ours_pairs} pairs, the reference {ref_pairs}; {numbers}",
                        {**evidence, "ours": ours_pairs, "reference": ref_pairs})
    d = ours.shape[-1]
    by_dim = (ours.double() - ref.double()).abs().amax(dim=(0, 1, 2))
    if ref_pairs is not None and ref_pairs.startswith("interleaved"):
        freq_err = torch.maximum(by_dim[0::2], by_dim[1::2])  # frequency i rotates dims 2i, 2i + 1
    else:
        freq_err = torch.maximum(by_dim[: d // 2], by_dim[d // 2 :])  # frequency i rotates dims i, i + d/2
    bad = (freq_err > tol).nonzero().flatten().tolist()
    layer = e.facts.layer(e.result.layer)
    rope_type = layer.rope.rope_type if layer is not None and layer.rope is not None else None
    precision = _frequency_precision(e, x, ref_pairs) if x is not None and x.shape == ours.shape else None
    if precision is not None:
        return Hint(
            "rope_frequencies",
            f"likely RoPE frequencies off in their last bits: ours' rotation angles differ from the reference's by "
            f"{precision:.2g} relative (bfloat16 rounding is 4e-3): inverse frequencies computed or rounded in a lower "
            f"precision than the reference's float32; {numbers}",
            {**evidence, "relative": precision},
        )
    # a band: the highest and the lowest frequency agree, the error sits between (a YaRN / llama3 ramp)
    if bad and bad[0] > 0 and bad[-1] < d // 2 - 1:
        band = f" (a {rope_type} correction range / ramp band: rounding or clamping)" if rope_type in ("yarn", "llama3") else ""
        return Hint(
            "rope_band",
            f"likely RoPE frequencies{band}: error confined to a band of rotary frequencies "
            f"{_fmt_list(bad)} of {d // 2}; {numbers}",
            {**evidence, "band": bad},
        )
    return Hint("rope_frequencies", f"likely RoPE frequencies, scaling or offset: {numbers}", evidence)


def _frequency_precision(e: Evidence, x: torch.Tensor, pairing: str | None) -> float | None:
    """The largest relative difference of ours' rotation angles from the reference's, when every
    frequency is off by under 1% (a precision problem, not a different formula), else None."""
    from .rope_fit import rotation

    layer = e.facts.layer(e.result.layer)
    if layer is None or layer.rope is None or e.positions is None:
        return None
    interleaved = pairing is not None and pairing.startswith("interleaved")
    ours_r, _ = rotation(x, e.ours, interleaved, layer.rope.rotary_dim)
    ref_r, weight = rotation(x, e.ref, interleaved, layer.rope.rotary_dim)
    last = int(e.positions[0].argmax())
    angle_ref = ref_r[0, last].angle().abs()
    delta = (ours_r[0, last] / ref_r[0, last]).angle().abs()
    keep = (angle_ref > 1e-3) & (angle_ref < 3.0) & (weight[0, last] > 0)  # unwrapped angles only
    if not bool(keep.any()) or not bool((delta[keep] > 0).any()):
        return None
    relative = float((delta[keep] / angle_ref[keep]).max())
    return relative if relative < 1e-2 else None


def _window_of(probs: torch.Tensor, valid: torch.Tensor | None) -> int | None:
    """The attention window ``probs`` ``(b, h, q, k)`` keeps: the longest span from a query back to
    the earliest key it gives any weight (None: every query sees all earlier keys). Padded rows are
    skipped (their keys are masked by padding, not by a window)."""
    seen = probs.abs() > 0
    if valid is not None:
        seen = seen[valid.bool().all(-1)]
    if seen.numel() == 0:
        return None
    q = torch.arange(seen.shape[-2])[:, None]
    k = torch.arange(seen.shape[-1])[None, :]
    span = torch.where(seen, q - k + 1, torch.zeros_like(q - k)).amax(dim=-1)  # (..., q)
    full = (span == q.flatten() + 1).all()
    return None if bool(full) else int(span.amax())


def future_keys(e: Evidence) -> Hint | None:
    """Ours gives weight to keys the reference masks, later than the last key the reference lets each
    query see: the causal mask lets a query see the future (a decode-time mask off by one, a chunk
    attending to all of itself)."""
    if e.kind != "probs" or e.ours.dim() != 4:
        return None
    seen_ref, seen_ours = e.ref.abs() > 0, e.ours.abs() > 0
    keys = torch.arange(e.ref.shape[-1])
    last = torch.where(seen_ref, keys, torch.full_like(keys, -1)).amax(-1, keepdim=True)  # per query row
    future = seen_ours & ~seen_ref & (keys > last)
    if not bool(future.any()):
        return None
    rows = future.any(-1).flatten(0, 1).any(0).nonzero().flatten().tolist()
    return Hint(
        "causal_mask",
        f"likely the causal mask: ours gives weight to keys after the last one the reference lets a query see "
        f"({int(future.sum())} entries; queries {_fmt_list(rows)}), so a query reads the future",
        {"entries": int(future.sum()), "queries": rows[:32]},
    )


def window_pattern(e: Evidence) -> Hint | None:
    """Only the query positions from some point up to the window on differ: the first position
    that can see a key the window decides about (the smaller of ours' and the reference's window)."""
    if e.kind not in ("probs", "context", "scores"):
        return None
    if e.kind == "probs" and e.ours.dim() == 4 and e.ours.shape[-1] == e.ours.shape[-2]:
        ours_w, ref_w = _window_of(e.ours, e.attention_mask), _window_of(e.ref, e.attention_mask)
        if ours_w != ref_w:
            show = lambda w: "full causal attention" if w is None else f"a window of {w}"
            return Hint(
                "sliding_window",
                f"likely the sliding window size or mask: ours attends with {show(ours_w)}, the reference with "
                f"{show(ref_w)} (read from which keys get any weight)",
                {"ours": ours_w, "reference": ref_w},
            )
    layer = e.facts.layer(e.result.layer)
    window = (layer.window if layer is not None else None) or e.facts.sliding_window
    axis = _seq_axis(e.kind)
    if not window or e.ours.dim() <= axis or e.ours.shape[axis] <= window:
        return None
    per_pos = _by_position(e.ours, e.ref, axis)
    bad = (per_pos > e.noise).nonzero().flatten().tolist()
    if bad and 1 <= min(bad) <= window:
        mine = layer.window if layer is not None else None
        ref = f"the reference's window here is {mine}" if mine else "the reference attends to every earlier key here"
        return Hint(
            "sliding_window",
            f"likely the sliding window size or mask: positions < {bad[0]} agree, positions {bad[0]}..{bad[-1]} "
            f"differ (max error {float(per_pos.max()):.3g}); {ref}",
            {"window": mine, "first_bad_position": bad[0]},
        )
    return None


def _positions_axis(e: Evidence) -> int | None:
    """The sequence axis of the failing node when its layout is ``(batch, seq, ...)`` or ``(batch,
    heads, seq, ...)`` for this run's tokens; None for nodes without one (a recurrent state)."""
    if e.positions is None:
        return None
    axis = _seq_axis(e.kind)
    batch, seq = e.positions.shape
    return axis if e.ours.dim() > axis and e.ours.shape[0] == batch and e.ours.shape[axis] == seq else None


def sequence_shift(e: Evidence) -> Hint | None:
    """Ours at position ``t`` holds the reference's value at ``t + d`` (``d != 0``) wherever both
    exist: a causal convolution padded on the wrong side (it reads the future), a token shift, an
    off-by-one in the sequence."""
    axis = _positions_axis(e)
    if axis is None or e.ours.shape[axis] < 3:
        return None
    ours, ref = e.ours.movedim(axis, 0), e.ref.movedim(axis, 0)
    seq = ours.shape[0]
    for d in sorted((d for d in range(-min(8, seq - 2), min(8, seq - 2) + 1) if d), key=lambda d: (abs(d), d < 0)):
        mine, theirs = ours[max(0, -d): seq - max(0, d)], ref[max(0, d): seq + min(0, d)]
        if e.close(mine, theirs):
            later = f"{d} position{'s' if abs(d) > 1 else ''} later" if d > 0 else f"{-d} position{'s' if -d > 1 else ''} earlier"
            return Hint(
                "sequence_shift",
                f"likely a shift along the sequence: ours at each position equals the reference {later} (on the "
                f"{mine.shape[0]} of {seq} positions both have); a causal convolution padded on the wrong side reads "
                "the future, or a token shift / position off by one",
                {"shift": d, "positions": int(mine.shape[0])},
            )
    return None


def chunk_boundary(e: Evidence) -> Hint | None:
    """Positions before a chunk boundary agree, the first differing one starts a chunk: the state a
    chunked linear-attention recurrence carries from one chunk to the next (``facts.chunk_size``)."""
    chunk, axis = e.facts.chunk_size, _positions_axis(e)
    if not chunk or axis is None or e.ours.shape[axis] <= chunk:
        return None
    per_pos = _by_position(e.ours, e.ref, axis)
    bad = (per_pos > e.noise).nonzero().flatten().tolist()
    if not bad or bad[0] < chunk or bad[0] % chunk:
        return None
    return Hint(
        "chunk_boundary",
        f"likely the state carried between chunks: positions < {bad[0]} agree, positions {bad[0]}..{bad[-1]} differ "
        f"(max error {float(per_pos.max()):.3g}); the linear-attention recurrence runs in chunks of {chunk} tokens "
        f"and position {bad[0]} starts one (what the chunk before hands on: its state, its decay, its padding)",
        {"chunk_size": chunk, "first_bad_position": bad[0]},
    )


# --- calls continuing a cache (decode checks) -------------------------------------------------------


def _call_index(name: str) -> int | None:
    """The step of a decode check's node (``step3/...``: 3), None outside a decode check. Step 0 is the
    first call of a sequence; every later one continues from the cache."""
    m = re.match(r"^step(\d+)/", name)
    return int(m.group(1)) if m else None


def _linear_layer(e: Evidence) -> bool:
    layer = e.facts.layer(e.result.layer)
    return layer is not None and layer.layer_type == LINEAR


def padding(e: Evidence) -> Hint | None:
    """Every differing position is padding (the run's ``attention_mask`` is 0 there) and some padding
    differs: the two sides treat padding differently. A linear-attention layer must zero its padding
    before anything reads it, in every call: padding in a chunk that continues a cache leaks into the
    state otherwise (the reference's mask covers each call's own tokens)."""
    axis = _positions_axis(e)
    if axis is None or e.attention_mask is None or tuple(e.attention_mask.shape) != tuple(e.positions.shape):
        return None
    diff = (e.ours.double() - e.ref.double()).abs().movedim(axis, 1)
    bad = diff.reshape(*diff.shape[:2], -1).amax(-1) > e.noise  # (batch, seq)
    pad = e.attention_mask.to(bad.device) == 0
    if not bool(bad.any()) or bool((bad & ~pad).any()):
        return None
    rows, cols = bad.nonzero(as_tuple=True)
    zero = bool((e.ref.movedim(axis, 1)[pad] == 0).all())
    where = f"padding tokens at batch rows {_fmt_list(sorted(set(rows.tolist())))}, positions {_fmt_list(sorted(set(cols.tolist())))}"
    call = _call_index(e.name)
    continuing = f" (a call continuing the cache: step {call})" if call else ""
    treat = "zeroes them" if zero else "treats them otherwise"
    return Hint(
        "padding",
        f"likely padding that is not masked: only padding tokens differ ({where}{continuing}); the reference {treat}. "
        "A linear-attention layer must zero its padding in every call, a chunk continuing a cache included, "
        "or the padding writes into the conv and the recurrent state",
        {"batch_rows": sorted(set(rows.tolist())), "positions": sorted(set(cols.tolist())), "reference_zero": zero,
         "step": call},
    )


def conv_context(e: Evidence) -> Hint | None:
    """In a call continuing a cache, only the first ``conv_kernel - 1`` positions of a linear-attention
    layer differ, later ones agree: those are the outputs whose window reaches back into the previous
    call's inputs (the conv state). The cached inputs are not carried, or the wrong ones are read."""
    k, axis = e.facts.conv_kernel, _positions_axis(e)
    if not k or axis is None or not _call_index(e.name) or not _linear_layer(e) or e.ours.shape[axis] < k:
        return None
    per_pos = _by_position(e.ours, e.ref, axis)
    bad = (per_pos > e.noise).nonzero().flatten().tolist()
    if not bad or bad[-1] >= k - 1:
        return None
    return Hint(
        "conv_state",
        f"likely the short conv's cached inputs: in this call (step {_call_index(e.name)}, continuing the cache) "
        f"positions {_fmt_list(bad)} differ and positions {k - 1}.. agree; with kernel {k} the first {k - 1} outputs "
        f"read the previous call's last {k - 1} inputs (the conv state): not carried, or the wrong ones taken from it",
        {"conv_kernel": k, "positions": bad, "step": _call_index(e.name)},
    )


def _conv_shift(e: Evidence) -> Hint | None:
    """A cached conv state ``(batch, channels, K)`` holding the reference's inputs shifted along the
    last axis (``d`` tokens older or newer), or no inputs at all (zeros)."""
    ours, ref = e.ours.double(), e.ref.double()
    held = ours.shape[-1]
    if not bool((ours == 0).all()):
        for d in sorted((d for d in range(-(held - 1), held) if d), key=lambda d: (abs(d), d)):
            # d > 0: ours' slot j holds the reference's slot j - d (ours is d tokens older)
            mine, theirs = (ours[..., d:], ref[..., : held - d]) if d > 0 else (ours[..., : held + d], ref[..., -d:])
            if e.close(mine, theirs):
                older = f"{abs(d)} token{'s' if abs(d) > 1 else ''} {'older' if d > 0 else 'newer'}"
                return Hint(
                    "conv_state",
                    f"likely the conv state cut at the wrong place: ours holds the reference's conv inputs {older} (on "
                    f"the {held - abs(d)} of {held} slots both hold); the state after a call is its last {held} inputs",
                    {"shift": d, "held": held},
                )
        return None
    return Hint("conv_state", "likely the conv state never stored: ours holds zeros where the reference holds the last "
                f"{held} conv inputs", {"shift": None, "held": held})


def cached_state(e: Evidence) -> Hint | None:
    """A linear-attention layer's cache after a step: a conv state shifted or empty (see
    :func:`_conv_shift`), a recurrent state that is zeros where the reference's is not."""
    if e.kind == "cache.conv_state" and e.ours.dim() == 3:
        return _conv_shift(e)
    if e.kind == "cache.recurrent_state" and bool((e.ours == 0).all()) and bool((e.ref != 0).any()):
        return Hint("state_not_carried", "likely the recurrent state never stored: ours holds zeros after the step, "
                    "the reference the state after its last token", {})
    return None


def _replay_from_zero(e: Evidence, stem: str) -> torch.Tensor | None:
    """The gated delta rule on this call's inputs as the reference traced them (L2-normalised q and k,
    v from the conv's output, g, beta), from a zero state, in float64: ``(batch, seq, v_heads, d_v)``."""
    t = e.ref_trace.tensors
    names = [f"{stem}.{s}" for s in ("q_l2norm", "k_l2norm", "conv_out", "g", "beta")]
    if not all(n in t for n in names):
        return None
    q, k, mixed, g, beta = (t[n].double() for n in names)
    b, s, h, d_v = e.ref.shape
    if q.shape[:3] != (b, s, h) or mixed.shape[:2] != (b, s) or mixed.shape[-1] < h * d_v or g.shape != (b, s, h):
        return None
    v = mixed[..., -h * d_v:].reshape(b, s, h, d_v)
    state = torch.zeros(b, h, q.shape[-1], d_v, dtype=torch.float64)
    out = torch.empty(b, s, h, d_v, dtype=torch.float64)
    for i in range(s):
        state = state * g[:, i].exp()[..., None, None]
        predicted = (state * k[:, i, :, :, None]).sum(-2)
        state = state + k[:, i, :, :, None] * ((v[:, i] - predicted) * beta[:, i, :, None])[:, :, None, :]
        out[:, i] = (state * q[:, i, :, :, None]).sum(-2) / q.shape[-1] ** 0.5
    return out


def state_not_carried(e: Evidence) -> Hint | None:
    """In a call continuing a cache, the rule's output of ours equals the rule replayed from a zero state
    on this call's inputs, the reference's does not: ours' state was not carried into this call."""
    if e.kind != "delta_out" or not _call_index(e.name) or e.ours.dim() != 4:
        return None
    zero = _replay_from_zero(e, e.name[: -len(".delta_out")])
    if zero is None:
        return None
    ours_gap, ref_gap = _rel(e.ours, zero), _rel(e.ref, zero)
    if not (ours_gap < 2e-2 and ours_gap * 10 < ref_gap):
        return None
    return Hint(
        "state_not_carried",
        f"likely the recurrent state not carried into this call (step {_call_index(e.name)}, continuing the cache): "
        f"ours equals the delta rule run from a zero state on this call's inputs (relative difference {ours_gap:.2g}), "
        f"the reference does not ({ref_gap:.2g}: it continues from the state after the previous call)",
        {"ours_vs_zero_start": ours_gap, "reference_vs_zero_start": ref_gap, "step": _call_index(e.name)},
    )


#: element-wise functions a swapped activation may involve (applied in float64)
_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softplus": torch.nn.functional.softplus,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu (tanh)": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "identity": lambda x: x,
}


def _elementwise_of(e: Evidence, y: torch.Tensor, x: torch.Tensor) -> str | None:
    for name, fn in _ELEMENTWISE.items():
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
        return float(torch.finfo(value).eps)
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
    if _rel(affine, a) < max(1e-3, ACTIVATION_EPS_MARGIN * _dtype_eps(e.result.dtype)):
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
        return Hint("activation", f"likely the activation: ours applies {ours_fn} to {source}, the reference {ref_fn}",
                    {"ours": ours_fn, "reference": ref_fn, "input": source})
    return Hint(
        "activation",
        "likely an element-wise function (activation) that differs: in every channel ours is a monotone, non-linear "
        "function of the reference's value (the same input through e.g. sigmoid vs softplus)",
        {},
    )


def untied_head(e: Evidence) -> Hint | None:
    """Everything before the output agrees but the logits are uncorrelated: an unloaded or untied head."""
    if e.kind not in (e.facts.head_module.rsplit(".", 1)[-1], "logits") or e.result.cosine is None or abs(e.result.cosine) > 0.3:
        return None
    tied = " (the config ties it to the embedding)" if e.facts.tie_word_embeddings else ""
    return Hint(
        "untied_head",
        f"likely an output head that was never loaded or tied{tied}: every hidden node before it agrees, "
        f"the logits are uncorrelated (cosine {e.result.cosine:.3f})",
        {"cosine": e.result.cosine},
    )


def nonfinite(e: Evidence) -> Hint:
    result = e.result
    if e.ours is None or e.ref is None:
        return Hint("nonfinite", f"non-finite values appear first here: {result.detail}")
    bad = ~torch.isfinite(e.ours) | ~torch.isfinite(e.ref)
    axis = _seq_axis(e.kind)
    where, evidence = [], {}
    if bad.dim() > axis:
        rows = bad.movedim(axis, 0).flatten(1).any(1).nonzero().flatten().tolist()
        where.append(f"positions {_fmt_list(rows, 10)}")
        evidence["positions"] = rows[:64]
    if bad.dim() > 1:
        batch = bad.flatten(1).any(1).nonzero().flatten().tolist()
        where.append(f"batch rows {_fmt_list(batch)}")
        evidence["batch_rows"] = batch
    return Hint("nonfinite", f"non-finite values appear first here: {result.detail}; at {', '.join(where)} (masked or padded rows?)",
                evidence)


#: detectors tried in order on a node that has both tensors of one shape
DETECTORS: tuple[Callable[[Evidence], Hint | None], ...] = (
    tap_layout,
    kv_sharing,
    sibling_match,
    other_layer,
    untied_head,
    transposed_weight,
    expert_weights,
    rounding_order,
    padding,
    cached_state,
    conv_context,
    state_not_carried,
    activation_function,
    soft_capping,
    norm_eps,
    norm_weight_offset,
    norm_kind,
    block_layout,
    norm_placement,
    constant_ratio,
    row_normalisation,
    last_dim_permutation,
    position_table_offset,
    head_mapping,
    sequence_shift,
    softmax_temperature,
    future_keys,
    window_pattern,
    chunk_boundary,
    rope_partial,
    rope_fit,
    rope_pattern,
    channel_ratio,
    row_scale,
    activation,
)


def diagnose(result: NodeResult, ours_trace: Trace, ref_trace: Trace, facts: ArchFacts,
             positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             spec: NodeSpec | None = None) -> Hint | None:
    """A likely cause for a failing node, with its evidence; None if no pattern is recognised.
    ``positions``: ``(batch, seq)`` token positions of the run and ``attention_mask`` its padding
    (RoPE hints need them); ``spec``: the node's NodeSpec (which scores a choice was made from)."""
    if result.status == MISSING:
        return Hint("missing", f"likely a node-map or tap problem: {result.detail}")
    if result.status == SHAPE:
        return Hint("shape", f"likely a layout or head-count difference: {result.detail}")
    e = Evidence(result, ours_trace.tensors.get(result.name), ref_trace.tensors.get(result.name), ours_trace, ref_trace,
                 facts, positions, attention_mask)
    if result.status == NONFINITE:
        return nonfinite(e)
    if result.status == CHOICE:
        return choice(e, spec)
    if e.ours is None or e.ref is None or e.ours.shape != e.ref.shape or not e.ref.is_floating_point():
        return None
    for detect in DETECTORS:
        hint = detect(e)
        if hint is not None:
            return hint
    return None
