"""Detectors of normalisation: eps, ``w`` vs ``1 + w``, RMSNorm vs LayerNorm, per head vs the whole
projection, pre- vs post-norm, a parallel block run sequentially."""

from __future__ import annotations

import itertools
import math
from typing import cast

import torch

from parity.compare.results import TIED_COPIES
from parity.diagnose.elementwise import activations
from parity.diagnose.evidence import EXPLAINS, Evidence, fmt_list, rel, same_input, whose
from parity.diagnose.hints import Hint
from parity.record.hf_capture import OUTPUT_PROJECTIONS


def _ms(x: torch.Tensor, centered: bool) -> torch.Tensor:
    x = x.double()
    if centered:
        x = x - x.mean(-1, keepdim=True)
    return x.pow(2).mean(-1)


def is_norm(kind: str) -> bool:
    """A norm node's kind: ``*norm*`` (Llama, OLMo, Gemma...; BERT's and RoBERTa's ``LayerNorm``), GPT-2's ``ln_1``,
    ``ln_2``, ``ln_f``, RWKV's ``ln1``, ``ln_out`` and ``pre_ln``."""
    return "norm" in kind.lower() or kind.startswith("ln") or kind.endswith("_ln")


def _factor(r: float) -> str:
    """A ratio for a hint: ``0.9731``, or ``1 - 1.8e-05`` when it is that close to 1."""
    return f"1 {'-' if r < 1 else '+'} {abs(r - 1):.2g}" if abs(r - 1) < 1e-3 else f"{r:.4g}"


def _token_ratio(e: Evidence, assume_input: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(r, x)``: ours / reference as one factor per row of the failing norm (a token's vector, or a
    head's for a per-head norm), and the reference's input in the same rows; None when ours read
    other values, or the ratio is not one factor per row, or there is no factor at all."""
    x_ref = e.ref_trace.inputs.get(e.name) if assume_input else same_input(e)
    if x_ref is None or x_ref.shape != e.ref.shape:
        return None
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    shift = e.ref_trace.biases.get(e.name)  # a LayerNorm's bias: the ratio holds for w * x_hat alone
    if shift is not None and shift.shape == a.shape[-1:]:
        a, b = a - shift.double(), b - shift.double()
    keep = b.abs() > 1e-3 * b.abs().amax(-1, keepdim=True)
    ratio = torch.where(keep, a / b.where(keep, torch.ones_like(b)), torch.nan)
    r = ratio.nanmean(-1)
    spread = ((ratio - r[:, None]).abs().nan_to_num(0.0).amax(-1) / r.abs()).max()
    # the least factor that is no rounding: 1e-4 in float32 and coarser; in a float64 (semantic) run,
    # where rounding is near 1e-16, an eps of 1e-5 instead of 1e-6 on unit-scale tokens (1e-6) shows
    least = min(1e-4, 1e3 * torch.finfo(e.ref.dtype).eps)
    if not bool(torch.isfinite(r).all()) or float(spread) > 1e-3 or float((r - 1).abs().max()) < least:
        return None
    return r, x_ref.double().flatten(0, -2)


def _eps_outside(r: torch.Tensor, ms: torch.Tensor, eps: float) -> tuple[str, float] | None:
    """``(side, eps')`` when one side computes ``x / (sqrt(mean(x^2)) + eps')`` and the other ``x /
    sqrt(mean(x^2) + eps)`` (eps outside the square root, one eps' for every token), else None."""
    rms = ms.sqrt()
    # the tokens where eps weighs most (the smallest mean squares) fix eps'; every token must then agree
    small = ms <= ms.quantile(0.25)
    for side, per_token in (
        ("ours", (ms + eps).sqrt() / r - rms),  # r = sqrt(ms + eps) / (rms + eps')
        ("the reference", r * (ms + eps).sqrt() - rms),  # r = (rms + eps') / sqrt(ms + eps)
    ):
        eps_out = float(per_token[small].median())
        if not eps_out > 0:
            continue
        outside, inside = rms + eps_out, (ms + eps).sqrt()
        predicted = inside / outside if side == "ours" else outside / inside
        if float(((predicted - r).abs() / r).max()) < 1e-3 and float((r - 1).abs().max()) > 10 * float(
            ((predicted - r).abs() / r).max()
        ):
            return side, eps_out
    return None


def norm_eps(e: Evidence) -> Hint | None:
    """A norm whose inputs agree, and whose ours/ref ratio is constant over channels but varies per
    token with the token's mean square: another eps, or eps outside the square root on one side."""
    if not is_norm(e.kind):
        return None
    found = _token_ratio(e)
    unseen = found is None and e.ours_trace.inputs.get(e.name) is None  # ours' input was not kept
    if unseen:
        found = _token_ratio(e, assume_input=True)
    if found is None:
        return None
    r, x = found
    centered = e.facts.norm_kind == "layernorm"
    ms = _ms(x, centered)
    r2 = r.pow(2)
    # r^2 = (ms + eps_ref) / (ms + eps_ours)  <=>  r^2 * eps_ours - eps_ref = ms * (1 - r^2): least squares,
    # each token's equation divided by its ms + eps so large-RMS tokens (where eps is invisible) add no noise
    weight = 1.0 / (ms + (e.facts.norm_eps or 1e-6))
    design = torch.stack([r2, -torch.ones_like(r2)], 1) * weight[:, None]
    solution = torch.linalg.lstsq(design, (ms * (1 - r2) * weight)[:, None]).solution.flatten()
    eps_ours, eps_ref = float(solution[0]), float(solution[1])
    predicted = ((ms + eps_ref) / (ms + eps_ours)).sqrt()
    if min(eps_ours, eps_ref) >= -1e-12 and float(((predicted - r).abs() / r).max()) < 1e-3:
        # norm(c x, eps) = norm(x, eps / c^2): the same evidence is an input scaled by c on one side
        scale = math.sqrt(eps_ref / eps_ours) if eps_ours > 0 and eps_ref > 0 else None
        named = named_scale(e, scale) if scale is not None else ""
        also = (
            f"; or the same eps on both sides and ours' input scaled by {scale:.4g}{named} (a multiplier applied "
            "outside any module: a norm hides it except through eps)"
            if scale is not None and (named or abs(math.log10(scale)) > 0.5 or unseen)
            else ""
        )
        if unseen and scale is not None:  # ours' input unseen: the two readings are equally likely
            return Hint(
                "norm_eps",
                f"likely the norm's input scaled on one side, or its eps: ours / reference varies per token with "
                f"the token's mean square, as ours' input scaled by {scale:.4g}{named} gives (a multiplier "
                f"applied outside any module, which a norm hides except through eps), or eps {eps_ours:.3g} in "
                f"ours for the reference's {eps_ref:.3g}",
                {"eps_ours": eps_ours, "eps_reference": eps_ref, "input_scale": scale, "input_seen": False},
            )
        return Hint(
            "norm_eps",
            f"likely the norm's eps: ours / reference varies per token with the token's mean square (ratio "
            f"{_factor(float(r.min()))}..{_factor(float(r.max()))}), as eps {eps_ours:.3g} in ours and {eps_ref:.3g} in the reference "
            f"give (the config says {e.facts.norm_eps:g}){also}",
            {"eps_ours": eps_ours, "eps_reference": eps_ref, "config_eps": e.facts.norm_eps, "input_scale": scale},
        )
    eps = e.facts.norm_eps or 0.0
    outside = _eps_outside(r, ms, eps)
    if outside is not None:
        side, eps_out = outside
        other = "the reference" if side == "ours" else "ours"
        return Hint(
            "norm_eps",
            f"likely eps outside the square root in {side}: {side} computes x / (sqrt(mean(x^2)) + {eps_out:.3g}), "
            f"{other} x / sqrt(mean(x^2) + {eps:g}) (the ratio varies per token with its mean square)",
            {"eps_outside": eps_out, "side": side, "config_eps": eps},
        )
    return None


def named_scale(e: Evidence, scale: float) -> str:
    """`` (= 1 / the config's embedding_multiplier ...)`` when ``scale`` (or its inverse, or a ratio of
    two named constants) matches one, else ``""``."""
    named = e.facts.named_constants()
    ordered = sorted(named.items(), key=lambda item: "config's" not in item[0])  # the config's own fields first
    for label, value in ordered:
        if value and abs(scale / value - 1) < 1e-3:
            return f" (= {label})"
        if value and abs(scale * value - 1) < 1e-3:
            return f" (= 1 / {label})"
    return ""


def norm_weight_source(e: Evidence) -> Hint | None:
    """A norm whose inputs agree and whose output is the normalised input times *another* norm's
    weight on one side (a loader or a block that reads the wrong norm's parameter: the input norm's
    weight in the post-attention norm). The weight each side applies is read back per channel."""
    if not is_norm(e.kind):
        return None
    # ours' input unread, or read as another operand of a norm computed in functions: the reference's input,
    # which the fit below checks (ours' output must be that input normalised times another norm's weight)
    x = same_input(e)
    x = x if x is not None else e.ref_trace.inputs.get(e.name)
    own = e.ref_trace.weights.get(e.name)
    if x is None or x.shape != e.ref.shape or own is None or own.dim() != 1 or own.shape[0] != x.shape[-1]:
        return None  # own: the reference module's weight, for its size (which weights may stand in)
    offset = e.facts.norm_weight_offset
    centered = e.facts.norm_kind == "layernorm"
    xd = x.double().flatten(0, -2)
    if centered:
        xd = xd - xd.mean(-1, keepdim=True)
    x_hat = xd / (xd.pow(2).mean(-1, keepdim=True) + (e.facts.norm_eps or 0.0)).sqrt()

    def applied(y: torch.Tensor) -> torch.Tensor:  # least squares per channel: y = x_hat * w
        y = y.double().flatten(0, -2)
        return (y * x_hat).sum(0) / x_hat.pow(2).sum(0).clamp_min(1e-300)

    tied = cast(frozenset, e.ref_trace.extras.get(TIED_COPIES, frozenset()))
    others = {  # another norm's weight; not a copy of this one's the model ties to it (Zamba2's shared blocks)
        name: w.double() + offset
        for name, w in e.ref_trace.weights.items()
        if name != e.name
        and is_norm(e.facts.locate(name)[1])
        and w.shape == own.shape
        and not (name in tied and e.name in tied and torch.equal(w, own))
    }
    for side, y, other_y in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        w_side, w_other = applied(y), applied(other_y)
        for name, w in others.items():
            if (
                rel(w_side, w) < EXPLAINS
                and rel(w_other, w) > 10 * EXPLAINS
                and rel(y.double().flatten(0, -2), x_hat * w) < EXPLAINS
            ):
                return Hint(
                    "swapped_weights",
                    f"likely a norm weight from another norm: {whose(side)} {e.name} multiplies by the weight of {name} "
                    f"({'1 + ' if offset else ''}w per channel read back from the output)",
                    {"side": side, "weight_of": name},
                )
    return None


def norm_skipped(e: Evidence) -> Hint | None:
    """A norm one side does not apply: its output is its input (or its input times the weight)."""
    if not is_norm(e.kind):
        return None
    x = same_input(e)
    if x is None or x.shape != e.ref.shape:
        return None
    w = e.ref_trace.weights.get(e.name)
    offset = e.facts.norm_weight_offset
    candidates = {"its input unchanged": x.double()}
    if w is not None and w.dim() == 1 and w.shape[0] == x.shape[-1]:
        candidates["its input times the weight, not normalised"] = x.double() * (w.double() + offset)
    for side, y, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        for label, u in candidates.items():
            if rel(y, u) < EXPLAINS and rel(other, u) > 10 * EXPLAINS:
                return Hint(
                    "norm_skipped",
                    f"likely the norm is not applied in {side}: {whose(side)} {e.kind} output is {label}",
                    {"side": side, "output": label},
                )
    return None


def embedding_norm(e: Evidence) -> Hint | None:
    """A weight-free RMSNorm of the token embeddings before the first layer (nanochat's; no module of its
    own, so no node) that one side does not apply: the first layer's normalised input is the embeddings
    normalised twice on one side, once on the other, either side. The two differ only through eps, so the
    test is each side's value itself, not a ratio."""
    if e.result.layer is None or e.facts.norm_kind != "rmsnorm" or not e.facts.norm_eps:
        return None
    first = min((n.index for n in e.facts.layers), default=None)
    if e.result.layer != first:
        return None
    emb = next((t for n, t in e.ref_trace.tensors.items() if e.facts.locate(n)[1] in ("embed_tokens", "wte")), None)
    x_ours, x_ref = e.inputs()
    if emb is None or x_ours is None or x_ref is None or not (emb.shape == x_ours.shape == x_ref.shape):
        return None
    eps = float(e.facts.norm_eps)

    def normed(t: torch.Tensor) -> torch.Tensor:
        return t * (t.pow(2).mean(-1, keepdim=True) + eps).rsqrt()

    once = normed(emb.double())
    twice = normed(once)

    step = twice - once

    def share(x: torch.Tensor) -> float:
        # where x sits between the two forms (0: once, 1: twice), along their difference: the forms differ by
        # eps-sized amounts, float32 rounding by less, and rounding has no direction
        return float(((x.double() - once) * step).sum() / step.pow(2).sum().clamp_min(1e-300))

    for side, lacks, has in (("ours", x_ours, x_ref), ("the reference", x_ref, x_ours)):
        if share(lacks) < 0.25 and share(has) > 0.75 and e.close(lacks, once.to(lacks.dtype)):
            return Hint(
                "norm_skipped",
                f"likely the norm of the token embeddings (RMSNorm without weights, before the first layer, "
                f"nanochat's) not applied in {side}: {whose(side)} {e.kind} reads the embeddings normalised once (by "
                f"this layer's norm), the other side's twice; the difference is eps-sized here, the residual stream "
                "carries the unnormalised embeddings on",
                {"side": side},
            )
    return None


# --- norms ---------------------------------------------------------------------------------------


def _scale_form(a: float) -> str:
    """The factor a norm multiplies by, written with its offset to the stored weight ``w``."""
    if abs(a) < 1e-3:
        return "w"
    if abs(a - 1) < 1e-3:
        return "1 + w"
    if abs(a - 2) < 1e-3:
        return "2 + w (1 + w with 1 added again)"
    if abs(a + 1) < 1e-3:
        return "w - 1"
    return f"w + {a:.4g}"


def norm_weight_offset(e: Evidence) -> Hint | None:
    """A norm whose inputs agree and whose outputs scale each channel by ``w + a`` (ours) and ``w + o``
    (the reference), ``w`` the stored weight, a bias added after either: ours multiplies by ``w`` where
    the reference multiplies by ``1 + w`` (Gemma 3, Nemotron's LayerNorm1P), the reverse (a Gemma 3 norm
    in Gemma 4), or ``2 + w`` (the 1 added to a weight already stored as ``1 + w``). Both offsets are
    read back from the outputs alone (their ratio per channel is ``(w + a) / (w + o)``), whichever side
    holds the fault."""
    if not is_norm(e.kind) or e.name not in e.ref_trace.inputs:
        return None
    w = e.ref_trace.weights.get(e.name)
    # ours' input, where kept, agrees (a norm computed in functions may keep none: a gated norm's gate multiplies
    # after it; one factor per channel constant over tokens is then the evidence inputs that agree give)
    x_ours, x_ref = e.inputs()  # in the reference's layout (a per-head norm's (batch, seq, heads, d) as tokens)
    x_ref = x_ref if x_ref is not None else e.ref_trace.inputs[e.name]
    x_ours = x_ours if x_ours is not None and x_ours.shape == x_ref.shape else x_ref
    if w is None or w.dim() != 1 or w.shape[0] != e.ref.shape[-1] or not e.close(x_ours, x_ref):
        return None
    w = w.double()
    bias = e.ref_trace.biases.get(e.name)
    shift = bias.double() if bias is not None and bias.shape == w.shape else torch.zeros_like(w)
    ref, ours = (e.ref.double() - shift).flatten(0, -2), (e.ours.double() - shift).flatten(0, -2)
    ratio = (ours * ref).sum(0) / ref.pow(2).sum(0).clamp_min(1e-300)  # per channel: (w + a) / (w + o)
    if rel(ours, ref * ratio) >= max(EXPLAINS, 4 * torch.finfo(e.ref.dtype).eps):
        return None  # not one factor per channel, constant over tokens
    # ratio (w + o) = w + a  ->  a - ratio o = w (ratio - 1): one (a, o) for every channel
    system = torch.stack([torch.ones_like(ratio), -ratio], dim=1)
    solved = torch.linalg.lstsq(system, (w * (ratio - 1))[:, None]).solution[:, 0]
    a, o = float(solved[0]), float(solved[1])
    if rel(system @ solved, w * (ratio - 1)) > 1e-6 or abs(a - o) < 1e-3:
        return None  # not two offsets of one weight (another weight, or the same offset)
    if min(abs(a - round(a)), abs(o - round(o))) > 1e-3:
        return None  # offsets are whole numbers (w, 1 + w, 2 + w); anything else is a scale, read elsewhere
    ours_form, ref_form = _scale_form(round(a)), _scale_form(round(o))
    ratios = ratio[:4].tolist()
    side = "ours" if abs(round(o) - e.facts.norm_weight_offset) < 1e-9 else "the reference"
    return Hint(
        "norm_weight_offset",
        f"likely the norm weight offset: ours multiplies by {ours_form}, the reference by {ref_form} (ours / "
        f"reference = ({ours_form.split(' (')[0]}) / ({ref_form.split(' (')[0]}) per channel, constant over tokens, "
        f"e.g. {fmt_list(f'{v:.4g}' for v in ratios)})",
        {"ours": ours_form, "reference": ref_form, "offset": round(a), "reference_offset": round(o), "side": side},
    )


def _normalisers(
    x: torch.Tensor, head_dim: int | None, eps: float = 0.0, heads: int | None = None
) -> dict[str, torch.Tensor]:
    """``x`` normalised each way a norm might (``eps``: the architecture's norm eps). A per-head input
    (``(..., heads, head_dim)``, or ``(batch, heads, seq, head_dim)`` when ``heads`` says so) also normalised over
    all its heads at once (a norm over the whole projection)."""
    x = x.double()
    centered = x - x.mean(-1, keepdim=True)
    per_head = bool(head_dim) and x.dim() >= 3 and x.shape[-1] == head_dim and x.shape[-2] > 1
    # the heads' axis: next to head_dim, or ahead of the sequence ((batch, heads, seq, head_dim))
    axis = 1 if per_head and heads and x.dim() == 4 and x.shape[1] == heads and x.shape[-2] != heads else -2
    out = {
        "RMSNorm over the last axis" + (" (per head)" if per_head else ""): x
        / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
        "LayerNorm (mean-subtracting)": centered / (centered.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
    }
    if head_dim and x.shape[-1] % head_dim == 0 and x.shape[-1] > head_dim:
        h = x.unflatten(-1, (-1, head_dim))
        out["RMSNorm per head"] = (h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()).flatten(-2)
    if per_head:  # (..., heads, head_dim)
        out["RMSNorm over the whole projection"] = x / (x.pow(2).mean((axis, -1), keepdim=True) + eps).sqrt()
    return out


def norm_statistics(x: torch.Tensor, eps: float, layernorm: bool, heads: int | None = None) -> dict[str, torch.Tensor]:
    """``x`` (``(..., seq, hidden)``) normalised by each statistic a port may compute instead of the
    norm's own (RMSNorm: Zhang & Sennrich 2019; LayerNorm: Ba et al. 2016), with the norm's eps."""
    x = x.double()
    n = x.shape[-1]
    c = x - x.mean(-1, keepdim=True)
    ms, var = x.pow(2).mean(-1, keepdim=True), c.pow(2).mean(-1, keepdim=True)
    out = {
        "RMSNorm (x / sqrt(mean(x^2) + eps))": x / (ms + eps).sqrt(),
        "LayerNorm ((x - mean) / sqrt(var + eps))": c / (var + eps).sqrt(),
        "the unbiased variance (sum / (N - 1), torch.var's default)": (c if layernorm else x)
        / ((c.pow(2) if layernorm else x.pow(2)).sum(-1, keepdim=True) / max(n - 1, 1) + eps).sqrt(),
        "no square root (x / (mean(x^2) + eps))": (c if layernorm else x) / ((var if layernorm else ms) + eps),
        "sqrt(|mean(x)|) for the RMS (the mean, not the mean of squares)": x
        / (x.mean(-1, keepdim=True).abs() + eps).sqrt(),
        "the mean absolute value (x / (mean|x| + eps))": x / (x.abs().mean(-1, keepdim=True) + eps),
        "the sum of squares for the mean (x / sqrt(sum(x^2) + eps), no 1/N)": x
        / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt(),
        "the variance not centred ((x - mean) / sqrt(mean(x^2) + eps))": c / (ms + eps).sqrt(),
        "the variance for the mean of squares (x / sqrt(var(x) + eps): the mean subtracted in the statistic only)": x
        / (var + eps).sqrt(),
    }
    for groups in dict.fromkeys(g for g in (heads, 2, 4) if g):  # one statistic per part of the vector
        if n % groups == 0 and n // groups > 1:
            g = x.unflatten(-1, (groups, n // groups))
            label = (
                f"one RMS per head ({groups} heads of {n // groups}: a per-head norm where the norm spans the whole "
                "projection)"
                if groups == heads
                else f"one RMS per {groups} parts of the vector (each shard of {n // groups} on its own)"
            )
            out[label] = (g / (g.pow(2).mean(-1, keepdim=True) + eps).sqrt()).flatten(-2)
    if x.dim() >= 3 and x.shape[-2] > 1:
        sq = x.pow(2).mean(-2, keepdim=True)
        out["statistics over the sequence axis (mean over tokens, not over the hidden size)"] = (
            c if layernorm else x
        ) / ((c.pow(2).mean(-2, keepdim=True) if layernorm else sq) + eps).sqrt()
        out["statistics over the whole tensor (one mean for every token)"] = x / (x.pow(2).mean() + eps).sqrt()
    return out


def norm_statistic(e: Evidence) -> Hint | None:
    """A norm whose inputs agree, where ours (or the reference) is the input normalised by another
    statistic times the module's own weight (and bias): over the sequence axis instead of the hidden
    one, the unbiased variance, no square root, ``sqrt(|mean(x)|)``, the mean absolute value. The
    weight is the module's, not fitted, so a factor like ``sqrt((N-1)/N)`` shows."""
    if not is_norm(e.kind):
        return None
    x = same_input(e)
    w = e.ref_trace.weights.get(e.name)
    if x is None or w is None or x.shape != e.ref.shape or w.dim() != 1 or w.shape[0] != x.shape[-1]:
        return None
    b = e.ref_trace.biases.get(e.name)
    shift = b.double() if b is not None and b.shape == w.shape else 0.0
    layernorm = e.facts.norm_kind == "layernorm"
    # a QK norm over the whole projection: its heads, as a per-head one would cut it
    per_head = (
        e.facts.num_heads if e.kind.startswith("q_") else e.facts.num_kv_heads if e.kind.startswith("k_") else None
    )
    stats = norm_statistics(x, e.facts.norm_eps or 0.0, layernorm, per_head)
    sibling = {"q_norm": "k_norm", "k_norm": "q_norm"}.get(e.kind)
    other = e.ref_trace.inputs.get(f"{e.name.rsplit('.', 1)[0]}.{sibling}") if sibling else None
    if sibling and other is not None and other.shape[:-1] == x.shape[:-1]:  # one statistic over q and k together
        ms = torch.cat([x.double(), other.double()], -1).pow(2).mean(-1, keepdim=True)
        stats[f"one RMS over {e.kind[0]} and {sibling[0]} together (the statistic of [q; k])"] = (
            x.double() / (ms + (e.facts.norm_eps or 0.0)).sqrt()
        )
    whole = _whole_output(e, x)
    if whole is not None:  # a norm of part of a projection's output, its statistic taken before the cut
        label, full = whole
        if not layernorm:
            wide = full.double().pow(2).mean(-1, keepdim=True)
            stats[label] = x.double() / (wide + (e.facts.norm_eps or 0.0)).sqrt()
    for weight in (w.double(), 1.0 + w.double()):  # w, or Gemma's 1 + w: whichever gives the reference
        applied = {label: n * weight + shift for label, n in stats.items()}
        wx = x.double() * weight  # the weight applied first: the statistic of w * x
        applied["the weight applied before the statistic (w x / sqrt(mean((w x)^2) + eps))"] = (
            wx / (wx.pow(2).mean(-1, keepdim=True) + (e.facts.norm_eps or 0.0)).sqrt() + shift
        )
        ref_is = next((label for label, y in applied.items() if e.close(e.ref, y.to(e.ref.dtype))), None)
        if ref_is is None:
            continue
        ours_is = next((label for label, y in applied.items() if e.close(e.ours, y.to(e.ours.dtype))), None)
        if ours_is is None or ours_is == ref_is or {ours_is, ref_is} == set(list(stats)[:2]):
            return None  # RMSNorm vs LayerNorm: norm_kind's, with the per-token means as evidence
        return Hint(
            "norm_kind",
            f"likely the norm's statistic: ours normalises by {ours_is}, the reference by {ref_is} (same input, same "
            "weight)",
            {"ours": ours_is, "reference": ref_is},
        )
    return None


def _whole_output(e: Evidence, x: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """When the norm's input ``x`` is one part (``proj[a:b]``) of a projection's output cut in parts (DeepSeek's
    kv_a_proj_with_mqa: the latent, then the RoPE keys), a label and that whole output, its parts joined in
    order; else None."""
    x = x.double()
    part = next(
        (n for n, t in e.ref_trace.tensors.items() if "[" in n and t.shape == x.shape and rel(t.double(), x) < 1e-9),
        None,
    )
    if part is None:
        return None
    module = part.partition("[")[0]
    cuts = []
    for n, t in e.ref_trace.tensors.items():
        span = n[len(module) :] if n.startswith(module + "[") else ""
        start, colon, stop = span.strip("[]").partition(":")
        if colon and start.isdigit() and stop.isdigit() and t.shape[:-1] == x.shape[:-1]:
            cuts.append((int(start), int(stop), t))
    cuts.sort(key=lambda c: c[0])
    if len(cuts) < 2 or any(a[1] != b[0] for a, b in itertools.pairwise(cuts)) or cuts[0][0] != 0:
        return None
    full = torch.cat([t.double() for _, _, t in cuts], -1)
    return (
        f"the RMS over all of {module}'s output ({full.shape[-1]} features: the norm's {x.shape[-1]} and the rest, "
        "normalised before it was cut)",
        full,
    )


def _regrouped(x: torch.Tensor, counts: set[int], eps: float) -> dict[str, torch.Tensor]:
    """A per-head input ``(..., heads, head_dim)`` normalised per group of another head count (``counts``: the
    config's attention heads where the model reads its own, xLSTM's ``num_heads``): LayerNorm and RMSNorm."""
    if x.dim() < 3 or x.shape[-2] < 2:
        return {}
    flat = x.double().flatten(-2)
    out = {}
    for g in sorted(c for c in counts if c and c != x.shape[-2] and flat.shape[-1] % c == 0):
        h = flat.unflatten(-1, (g, -1))
        c = h - h.mean(-1, keepdim=True)
        out[f"LayerNorm per head with {g} heads (the model's own count is {x.shape[-2]})"] = (
            c / (c.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        ).flatten(-2)
        out[f"RMSNorm per head with {g} heads (the model's own count is {x.shape[-2]})"] = (
            h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        ).flatten(-2)
    return out


def _per_stream(x: torch.Tensor, hidden: int, eps: float) -> dict[str, torch.Tensor]:
    """An input of several hidden-size streams side by side ``(..., streams * hidden)`` (hyper-connections'
    residual streams) normalised per stream and over all of them at once: RMSNorm both ways."""
    width = x.shape[-1]
    if not hidden or width % hidden or width // hidden < 2:
        return {}
    streams = width // hidden
    h = x.double().unflatten(-1, (streams, hidden))
    flat = x.double()
    return {
        f"RMSNorm per stream ({streams} groups of hidden_size {hidden})": (
            h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        ).flatten(-2),
        f"RMSNorm over all {width} features at once ({streams} streams of hidden_size {hidden} together)": flat
        / (flat.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
    }


def _explained_by(y: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str | None:
    """The candidate n with y ~= n * w for a per-channel w (least squares), or y ~= n * w + b with a
    per-channel bias too (a LayerNorm with bias, GPT-2), if any."""
    y = y.double().flatten(0, -2)
    for name, n in candidates.items():
        n = n.flatten(0, -2)
        w = (y * n).sum(0) / n.pow(2).sum(0).clamp_min(1e-30)
        if rel(n * w, y) < EXPLAINS:
            return name
        if n.shape[0] > 2:
            nc, yc = n - n.mean(0), y - y.mean(0)
            w = (yc * nc).sum(0) / nc.pow(2).sum(0).clamp_min(1e-30)
            if rel(nc * w, yc) < EXPLAINS:
                return name
    return None


def norm_kind(e: Evidence) -> Hint | None:
    """A norm node whose output is explained by another normaliser than the reference's."""
    if not is_norm(e.kind):
        return None
    x_ref = same_input(e)  # ours' input in the reference's layout (a norm called before the heads split)
    if x_ref is None and e.ours_trace.inputs.get(e.name) is None:
        # ours computes the norm in functions from a value no node holds (xLSTM's per-head norm after its
        # cell): its input assumed the reference's, which only an exact fit of both sides below confirms
        x_ref = e.ref_trace.inputs.get(e.name)
    if x_ref is None:
        return None  # the input already differs (or was not kept): not this norm's own fault
    heads = e.facts.num_heads if e.kind.startswith("q_") else e.facts.num_kv_heads if e.kind.startswith("k_") else None
    shape = e.ours.shape  # a per-head norm's output with its heads merged ((batch, seq, heads * head_dim))
    # the config's eps first, then the eps a module hard-codes (DeepSeek V3.2's indexer LayerNorm: 1e-6)
    for eps in dict.fromkeys((e.facts.norm_eps or 0.0, 1e-6, 1e-5)):
        candidates = _normalisers(x_ref, e.facts.head_dim, eps, heads)
        candidates |= _regrouped(x_ref, {e.facts.num_heads, e.facts.num_kv_heads}, eps)
        candidates |= _per_stream(x_ref, e.facts.hidden_size, eps)
        candidates = {k: v.reshape(shape) if v.numel() == e.ours.numel() else v for k, v in candidates.items()}
        ours_is, ref_is = _explained_by(e.ours, candidates), _explained_by(e.ref, candidates)
        if ours_is is not None and ref_is is not None:
            break
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    evidence = ""
    if "LayerNorm" in ref_is or "LayerNorm" in ours_is:
        means = x_ref.double().mean(-1).flatten()
        evidence = f"; the difference tracks each token's mean (input means {fmt_list(f'{m:.3g}' for m in means[:4].tolist())}): mean subtraction"
    if any("the model's own count" in label for label in (ours_is, ref_is)):
        evidence = "; the heads counted from another config field (each group another width)"
    elif any(w in label for w in ("per head", "whole projection") for label in (ours_is, ref_is)):
        evidence = "; per-head vs whole-projection Q/K norm"
    return Hint(
        "norm_kind",
        f"likely the wrong norm: ours behaves like {ours_is}, the reference like {ref_is}{evidence}",
        {"ours": ours_is, "reference": ref_is},
    )


def weightless_norm_eps(e: Evidence) -> Hint | None:
    """A projection whose input is the reference's times one factor per token, where that input is the output
    of a weight-free RMSNorm nothing records (HRM's, Dory's: no parameter to align, no node): another eps in
    that norm on one side. With ``y = x / sqrt(ms + eps)`` the side using the config's eps gives each token's
    mean square back (``ms = eps * ms_y / (1 - ms_y)``), and the other side's factor its eps; one eps must fit
    every token. Either side."""
    if e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs or e.facts.norm_kind != "rmsnorm":
        return None
    eps = e.facts.norm_eps
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if not eps or x_ref.shape != x_ours.shape or e.close(x_ours, x_ref):
        return None
    xo, xr = x_ours.double().flatten(0, -2), x_ref.double().flatten(0, -2)
    real = (xr.pow(2).sum(-1) > 0) & (xo.pow(2).sum(-1) > 0)
    xo, xr = xo[real], xr[real]
    if xo.shape[0] < 2:
        return None
    factor = (xo * xr).sum(-1) / xr.pow(2).sum(-1)
    if rel(xo, factor[:, None] * xr) > EXPLAINS or float((factor - 1).abs().max()) < 1e-4:
        return None  # not one factor per token, or none at all
    for side, config_side, other in (("ours", xr, xo), ("the reference", xo, xr)):
        ms_normed, ms_other = config_side.pow(2).mean(-1), other.pow(2).mean(-1)
        if float(ms_normed.max()) >= 1:
            continue  # not a weight-free RMSNorm's output with the config's eps
        ms = eps * ms_normed / (1 - ms_normed)
        # ms_other / ms_normed = (ms + eps) / (ms + eps'): each token's eps'
        found = (ms + eps) * ms_normed / ms_other - ms
        middle = float(found.median())
        # norm(c x, eps) = norm(x, eps / c^2): the other side's assumption fits too, with an eps past any real
        # one (near 1 / eps' times larger); the eps a norm can hold is the reading
        if not 0 < middle < 1 or float(((found - middle).abs() / middle).max()) > 0.05:
            continue
        return Hint(
            "norm_eps",
            f"likely eps of the weight-free RMSNorm before {e.kind}: {side} normalises with eps ~ {middle:.2g}, "
            f"{'the reference' if side == 'ours' else 'ours'} with the config's {eps:g} (its input differs from the "
            "other side's by one factor per token, largest where a token's mean square is smallest)",
            {"side": side, "eps": middle, "config_eps": eps},
        )
    return None


def norm_placement(e: Evidence) -> Hint | None:
    """A projection whose input is the reference's input after a norm (pre-norm vs post-norm)."""
    if e.name not in e.ref_trace.inputs or e.name not in e.ours_trace.inputs:
        return None
    x_ref, x_ours = e.ref_trace.inputs[e.name], e.ours_trace.inputs[e.name]
    if x_ref.shape != x_ours.shape or e.close(x_ours, x_ref):
        return None
    ours_forms = _normalisers(x_ref, None, e.facts.norm_eps or 0.0)
    ours_is = _explained_by(x_ours, ours_forms)
    if ours_is is not None:
        # the reference's input already a norm's output of this layer: ours normalises it a second time
        normed = next(
            (
                n
                for n, t in e.ref_trace.tensors.items()
                if "@" not in n
                and is_norm(n.rsplit(".", 1)[-1])
                and e.facts.locate(n)[0] == e.result.layer
                and t.shape == x_ref.shape
                and e.close(t, x_ref)
            ),
            None,
        )
        whose_weight = None if normed else _norm_weighting(e, x_ours, ours_forms[ours_is])
        how = (
            f"; its input is already {normed}'s output: ours applies a norm again to the normalised input (the norm "
            "applied twice)"
            if normed
            else f" weighted by {whose_weight}'s weight: ours applies {whose_weight} here, where the reference runs it "
            f"elsewhere ({_moved_norm(e, whose_weight)})"
            if whose_weight
            else " (pre-norm vs post-norm)"
        )
        return Hint(
            "norm_placement",
            f"likely norm placement: the input of {e.kind} in ours equals the reference's input after a {ours_is}{how}",
            {"normaliser": ours_is, "twice": normed, "weight_of": whose_weight},
        )
    # the reference's side: its input is ours' after one of its own norms, moved here (named only with the norm)
    ref_forms = _normalisers(x_ours, None, e.facts.norm_eps or 0.0)
    ref_is = _explained_by(x_ref, ref_forms)
    moved = _norm_weighting(e, x_ref, ref_forms[ref_is]) if ref_is is not None else None
    if moved is not None and not e.ours_trace.calls.get(moved) and not e.ours_trace.reads.get(moved):
        return Hint(
            "norm_skipped",
            f"likely {moved} skipped in ours: the input of {e.kind} in the reference equals ours' input after a "
            f"{ref_is} weighted by {moved}'s weight, and ours never reads that weight in its forward",
            {"normaliser": ref_is, "norm": moved, "side": "ours"},
        )
    if moved is not None:
        return Hint(
            "norm_placement",
            f"likely norm placement: the input of {e.kind} in the reference equals ours' input after a {ref_is} "
            f"weighted by {moved}'s weight: the reference applies {moved} here, where ours runs it elsewhere "
            f"({_moved_norm(e, moved)})",
            {"normaliser": ref_is, "twice": None, "weight_of": moved, "side": "the reference"},
        )
    return None


def norm_around_activation(e: Evidence) -> Hint | None:
    """A norm one side runs before an element-wise activation and the other after it (ModernBERT's prediction
    head ``dense -> act -> norm``, ported ``dense -> norm -> act``): at the norm, each side's output is a norm (any
    per-channel weight and bias) of the node before it in its block, through the activation on one side only.
    Either side."""
    if not is_norm(e.kind) or e.ours.shape != e.ref.shape:
        return None
    names = [n for n in e.ref_trace.tensors if "@" not in n]
    if e.name not in names:
        return None
    stem = e.name.rsplit(".", 1)[0]
    before = [n for n in names[: names.index(e.name)] if n.rsplit(".", 1)[0] == stem]
    x = e.ref_trace.tensors[before[-1]] if before else None
    if x is None or x.shape != e.ref.shape:
        return None
    eps = e.facts.norm_eps or 0.0
    forms = {"": x.double(), **{label: act(x.double()) for label, act in activations().items()}}

    def through(y: torch.Tensor) -> str | None:
        return next((f for f, v in forms.items() if _explained_by(y, _normalisers(v, None, eps)) is not None), None)

    ours_is, ref_is = through(e.ours), through(e.ref)
    if ours_is is None or ref_is is None or ours_is == ref_is or "" not in (ours_is, ref_is):
        return None
    act = (ours_is or ref_is).split(" (")[0]
    first, then = ("ours", "the reference") if ours_is == "" else ("the reference", "ours")
    source = before[-1].rsplit(".", 1)[-1]
    return Hint(
        "norm_placement",
        f"likely the order of {e.kind} and the activation: {first} normalises {source}'s output before the {act} "
        f"activation ({source} -> {e.kind} -> {act}), {then} after it ({source} -> {act} -> {e.kind})",
        {"activation": act, "before_activation": first, "input": before[-1]},
    )


def _moved_norm(e: Evidence, norm: str) -> str:
    """What moving ``norm`` here likely was: the final norm (outside the layers) applied before them, LFM2's
    ``embedding_norm`` read by its name; else a norm moved."""
    if e.facts.locate(norm)[0] is None and e.result.layer == 0:
        return "the final norm applied to the embeddings before the first layer: LFM2 names it embedding_norm"
    return "a norm moved"


def _norm_weighting(e: Evidence, y: torch.Tensor, n: torch.Tensor) -> str | None:
    """The reference norm (any layer, or outside the layers) whose weight ``w`` gives ``y = n * w`` for the
    normalised ``n``, when ``y`` is so weighted (least squares per channel); None when none does."""
    yf, nf = y.double().flatten(0, -2), n.double().flatten(0, -2)
    w = (yf * nf).sum(0) / nf.pow(2).sum(0).clamp_min(1e-30)
    for name, weight in e.ref_trace.weights.items():
        a_norm = weight.dim() == 1 and weight.shape == w.shape and is_norm(name.rsplit(".", 1)[-1]) and name != e.name
        if a_norm and rel(w, weight.double()) < 1e-6 and rel(nf * weight.double(), yf) < EXPLAINS:
            return name
    return None


def _reused_weight(e: Evidence, pair: tuple[str, str]) -> str | None:
    """The node of ``pair`` whose weight ours applies at this node (one of the pair) in place of this node's own: the
    per-feature weight fitted from ours' input and output here (``y = norm(x) * w + b``, either norm's statistic) is
    the reference's weight of the other node. Parity follows each weight to its node, so a weight read twice (one
    norm's weight reused for another) has its second read stand for the node never read; a swap or a call order
    gives each node its own weight. None otherwise."""
    others = [n for n in pair if n != e.name]
    if len(others) != 1:
        return None
    other = others[0]
    x, y = e.inputs()[0], e.ours
    w_other, w_own = e.ref_trace.weights.get(other), e.ref_trace.weights.get(e.name)
    if x is None or w_other is None or w_own is None or x.shape != y.shape or w_own.shape != x.shape[-1:]:
        return None
    rows, out = x.double().flatten(0, -2), y.double().flatten(0, -2)
    if rows.shape[0] < 4:
        return None
    for n in _normalisers(rows, None, 1e-30).values():  # either statistic: RMSNorm's, LayerNorm's
        nc, oc = n - n.mean(0), out - out.mean(0)
        w = (nc * oc).sum(0) / nc.pow(2).sum(0).clamp_min(1e-30)
        if rel(w, w_other.double()) < 1e-3 and rel(w, w_own.double()) > 1e-2:
            return other
    return None


#: the last projection of a sub-block (attention's output, the MLP's down projection) by the names
#: Transformers' families give it
BRANCH_OUTPUTS = OUTPUT_PROJECTIONS + ("down_proj", "fc2", "dense_4h_to_h", "w2")


def norm_past_projection(e: Evidence) -> Hint | None:
    """A q or k norm the reference applies to its projection's input (``q_proj(q_norm(x))``: BLT's cross-attention)
    that ours applies to the projection's output (``q_norm(q_proj(x))``, Qwen3's order): ours' norm node is the norm
    (its own weight, either statistic) of the reference's projection of the norm's input. Ours' side only: the
    reference's order is the model's."""
    if e.kind not in ("q_norm", "k_norm") or e.ours.shape != e.ref.shape:
        return None
    stem = e.name.rsplit(".", 1)[0]
    x, w = e.ref_trace.inputs.get(e.name), e.ref_trace.weights.get(e.name)
    proj = e.ref_trace.weights.get(f"{stem}.{e.kind[0]}_proj")
    if x is None or w is None or proj is None or proj.dim() != 2 or x.shape[-1] != proj.shape[1]:
        return None
    if proj.shape[0] != w.shape[-1] or x.shape[:-1] != e.ours.shape[:-1] or e.ours.shape[-1] != proj.shape[0]:
        return None
    y = x.double() @ proj.double().T
    for statistic, normed in _normalisers(y, None, e.facts.norm_eps or 1e-6).items():
        if e.close(e.ours, (normed * w.double()).to(e.ours.dtype)):
            return Hint(
                "norm_placement",
                f"likely {e.kind} applied after {e.kind[0]}_proj in ours: its {e.kind} is the norm of the projection's "
                f"output ({e.kind}({e.kind[0]}_proj(x)), Qwen3's order), where the reference normalises the "
                f"projection's input ({e.kind[0]}_proj({e.kind}(x)))",
                {"side": "ours", "statistic": statistic},
            )
    return None


def norm_order(e: Evidence) -> Hint | None:
    """A norm runs on the other side of its sub-block: one side produces the norm before the nodes that
    read it (pre-norm, ``x + attn(norm(x))``), the other only after that sub-block's output (post-norm,
    ``norm(x + attn(x))``: OPT's ``do_layer_norm_before`` read the wrong way round). Read from the order
    each side produced the layer's nodes, at the norm or (the reference post-norm: its projections run
    first) at the first of the nodes it moved across; either side."""
    if e.result.layer is None:
        return None
    layer = e.result.layer

    def layer_order(names) -> list[str]:
        return [n for n in names if e.facts.locate(n)[0] == layer]

    ref, ours = layer_order(e.ref_trace.tensors), layer_order(e.ours_trace.calls or e.ours_trace.results)
    shared = [n for n in ref if n in ours]
    ours_shared = [n for n in ours if n in shared]

    def moves(norm: str) -> tuple[list[str], list[str]]:
        """The layer's nodes ours runs before ``norm`` and the reference after it, and the reverse."""
        ref_after = shared[shared.index(norm) + 1 :]
        ours_after = ours_shared[ours_shared.index(norm) + 1 :]
        return [n for n in ref_after if n not in ours_after], [n for n in ours_after if n not in ref_after]

    layer_norms = [n for n in shared if is_norm(e.facts.locate(n)[1]) and "@" not in n]
    moved = {n: moves(n) for n in layer_norms}
    moving = {n: bool(back) for n, (back, ahead) in moved.items() if bool(back) != bool(ahead)}
    # one norm moved back across another that moved ahead across it: the nodes are aligned by weight, so each
    # norm's weight is applied where the other norm runs (a loader that swapped them), not a block run in another
    # order (a q_norm moved back across projections ours runs first is no swap: no norm moved the other way)
    pairs = [
        (back, ahead)
        for back, b in moving.items()
        if b
        for ahead, a in moving.items()
        if not a and ahead in moved[back][0] and back in moved[ahead][1]
    ]
    if pairs:
        back, ahead = next((p for p in pairs if e.name in p), pairs[0])
        if e.name not in (back, ahead):
            return None
        a, b = (e.facts.locate(n)[1] for n in (ahead, back))
        reused = _reused_weight(e, (ahead, back))
        if reused is not None:
            used, lost = e.facts.locate(reused)[1], e.facts.locate(e.name)[1]
            return Hint(
                "wrong_module",
                f"likely {used}'s weight applied where the reference runs {lost} too: ours normalises with {used}'s "
                f"weight at both places and never reads {lost}'s own (one norm's weight reused for another; parity "
                f"follows each weight to its node, so ours' second read of {used}'s weight stands for {lost})",
                {"nodes": [ahead, back], "reused": reused},
            )
        return Hint(
            "swapped_weights",
            f"likely the weights of {a} and {b} loaded into each other's places, or the two norms called in each "
            f"other's order: ours applies {b}'s weight where the reference runs {a} and {a}'s where it runs {b} "
            "(read from the order each side used them)",
            {"nodes": [ahead, back]},
        )
    norms = [e.name] if is_norm(e.kind) else layer_norms
    for norm in norms:
        if norm not in shared:
            continue
        moved_back, moved_ahead = moves(norm)
        if bool(moved_back) == bool(moved_ahead):
            continue
        block = moved_back or moved_ahead
        if (norm != e.name and e.name not in block) or not any(n.rsplit(".", 1)[-1] in BRANCH_OUTPUTS for n in block):
            continue  # a norm moved across a whole sub-block (its output projection too), not among q/k/v
        if _part_of_sub_block(e, layer, block, shared, norm):
            continue  # one branch of a sub-block moved across it (a shared expert added after): no placement
        post, pre = ("ours", "the reference") if moved_back else ("the reference", "ours")
        kind = e.facts.locate(norm)[1]
        return Hint(
            "norm_placement",
            f"likely norm placement (pre-norm vs post-norm): {post} runs {kind} after {block[-1].rsplit('.', 1)[-1]} "
            f"(on the sub-block's output plus the residual, post-norm), {pre} before the sub-block reads it "
            f"(pre-norm); {len(block)} node(s) of the layer moved across it ({fmt_list(n.rsplit('.', 1)[-1] for n in block)})",
            {"post_norm": "ours" if moved_back else "reference", "norm": norm, "moved": block},
        )
    return None


def _part_of_sub_block(e: Evidence, layer: int, block: list[str], shared: list[str], norm: str) -> bool:
    """Whether the nodes moved across ``norm`` are part of a sub-block only (the layer's child holding them has
    other nodes, both sides' alike, that stay on their side of the norm: a MoE's router while its shared expert
    moved), not the whole sub-block a pre-norm and a post-norm run on opposite sides of it."""
    depth = e.facts.layer_path(layer).count(".") + 2
    child = lambda name: ".".join(name.split(".")[:depth])
    subs = {child(n) for n in block}
    if child(norm) in subs:  # a norm inside that sub-block (BitNet's attn_sub_norm): a placement within it
        return False
    return any(n not in block and n != norm and child(n) in subs for n in shared)


def _layer_node(e: Evidence, layer: int, kind: str) -> torch.Tensor | None:
    """The reference's tensor of the node of that kind in that layer, if traced."""
    for name, tensor in e.ref_trace.tensors.items():
        if e.facts.locate(name) == (layer, kind):
            return tensor
    return None


def residual_into(e: Evidence, layer: int) -> torch.Tensor | None:
    """The reference's residual stream entering ``layer``: the previous layer's output, or the
    (scaled) token embedding before layer 0."""
    if layer > 0:
        return _layer_node(e, layer - 1, "layer")
    x = e.ref_trace.tensors.get(e.facts.embed_module)
    return x * e.facts.embed_scale if x is not None and e.facts.embed_scale else x


def block_layout(e: Evidence) -> Hint | None:
    """The MLP branch reads the residual after attention on one side and the layer's input on the
    other: a parallel block (``x + attn(N(x)) + mlp(N(x))``) run sequentially, or the reverse."""
    if e.result.layer is None:
        return None
    ours_y: torch.Tensor | None = e.ours
    ref_y: torch.Tensor | None = e.ref
    if not (e.kind.endswith("@input") or is_norm(e.kind)):
        # the MLP's first projection, its input read (Cohere's parallel block, one norm for both branches)
        if e.kind not in ("gate_proj", "up_proj", "fc1", "c_fc", "w1", "w3"):
            return None
        ours_y, ref_y = e.inputs()
    if ours_y is None or ref_y is None:
        return None
    x = residual_into(e, e.result.layer)
    attn = next(
        (t for kind in OUTPUT_PROJECTIONS if (t := _layer_node(e, e.result.layer, kind)) is not None), None
    )  # o_proj, NeoX's dense, ...
    if x is None or attn is None or x.shape != ref_y.shape or attn.shape != x.shape or ours_y.shape != x.shape:
        return None
    after = x.double() + attn.double()
    for kept in e.inputs() if is_norm(e.kind) else ():
        # a bias added beside the projection (GPT-NeoX-Japanese's dense_bias): a sequential side's own stream
        # after attention, where it is x + attn plus one vector
        if kept is not None and kept.shape == x.shape:
            bias = (kept.double() - after).flatten(0, -2).mean(0)
            if rel(kept.double(), after + bias) < EXPLAINS:
                after = after + bias
                break
    candidates = {
        "the residual after attention (sequential block)": after,
        "the layer's input (parallel block)": x.double(),
    }

    def explained(y: torch.Tensor) -> str | None:
        for label, u in candidates.items():
            if rel(y, u) < EXPLAINS or _explained_by(y, _normalisers(u, None, e.facts.norm_eps or 0.0)) is not None:
                return label
        return None

    ours_is, ref_is = explained(ours_y), explained(ref_y)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    what = e.kind if ours_y is e.ours else f"input of {e.kind}"
    return Hint(
        "block_layout",
        f"likely the block layout: the {what} of ours is computed from {ours_is}, the reference's from {ref_is}",
        {"ours": ours_is, "reference": ref_is},
    )
