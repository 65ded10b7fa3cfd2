"""Detectors of scale: one constant (named when it equals a constant of the architecture), one
factor per row or per channel, the softmax temperature."""

from __future__ import annotations

import math

import torch

from parity.diagnose.evidence import EXPLAINS, Evidence, constant_named, fmt_list, forms_of, part_of, rel
from parity.diagnose.hints import Hint
from parity.diagnose.norms import is_norm, named_scale
from parity.model.facts_rules import ROTATED_LAST, YARN_SOFTMAX_MSCALE
from parity.record.hf_capture import FUSED_QKV
from parity.record.trace import SCALARS

#: projections whose output is cut into heads (no sum over heads follows them)
HEAD_INPUTS = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v")


def _qk_agree(e: Evidence) -> bool:
    stem = e.name.rsplit(".", 1)[0]
    for kind in ("q_rot", "k_rot"):
        a, b = e.ours_trace.tensors.get(f"{stem}.{kind}"), e.ref_trace.tensors.get(f"{stem}.{kind}")
        if a is None or b is None or a.shape != b.shape or not e.close(a, b):
            return False
    return True


def _reference_scale(e: Evidence) -> float | None:
    """The scale the reference multiplies ``q k^T`` by in the failing node's block, read from its own
    trace (``scores / (q_rot k_rot^T)``; a config's own multiplier, Granite's attention_multiplier,
    included), or None when the block's q, k and scores are not all recorded."""
    stem = e.name.rsplit(".", 1)[0]
    q, k, scores = (e.ref_trace.tensors.get(f"{stem}.{kind}") for kind in ("q_rot", "k_rot", "scores"))
    if q is None or k is None or scores is None or q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
        return None
    product = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-2, -1)
    if product.shape != scores.shape:
        return None
    keep = product.abs() > 1e-2 * float(product.abs().max())
    if not bool(keep.any()):
        return None
    ratio = scores.double()[keep] / product[keep]
    scale = float(ratio.median())
    return scale if float((ratio - scale).abs().max()) < 1e-3 * abs(scale) else None


def _scale_name(e: Evidence, scale: float) -> str:
    """`` (= 1/sqrt(head_dim=16))``: what an attention scale equals, among the config's named constants
    and the usual formulas (up to three readings, the config's first), else ``""``."""
    layer = e.facts.layer(e.result.layer)
    head_dim = (layer.head_dim if layer is not None else None) or e.facts.head_dim
    named = {label: v for label, v in e.facts.named_constants().items() if v and not label.startswith("sqrt(")}
    # another width of the head first (the values' v_head_dim): the formula, before a constant equal by chance
    candidates = {f"1/sqrt({n}={w})": w**-0.5 for n, w in _head_widths(e, head_dim).items() if n != "head_dim"}
    # then the config's own constants, the usual formulas, and last the constants squared or inverted (a square
    # of a residual multiplier equal to 1/sqrt(head_dim) by chance is no reading before the formula)
    candidates.update({label: v for label, v in named.items() if "squared" not in label})
    scalar = e.facts.query_pre_attn_scalar
    if scalar and scalar != head_dim:  # Gemma's attention scale where it is not head_dim's (Gemma 3 27B: 168, 128)
        candidates[f"1/sqrt(query_pre_attn_scalar={scalar:g})"] = scalar**-0.5
    candidates.update(
        {
            "1 (no scale)": 1.0,
            f"1/sqrt(head_dim={head_dim})": head_dim**-0.5,
            f"1/sqrt(hidden_size={e.facts.hidden_size})": e.facts.hidden_size**-0.5,
            f"1/head_dim (1/sqrt(head_dim={head_dim}) applied twice)": 1.0 / head_dim,
        }
    )
    candidates.update({label: v for label, v in named.items() if "squared" in label})
    candidates.update({f"1 / {label}": 1 / v for label, v in named.items()})
    cap = e.facts.attn_softcap
    if cap:  # the soft-cap's x / cap taken on the raw q k^T, its scale applied only after the tanh (Gemma 2)
        candidates[
            f"1/attn_logit_softcapping (1/{cap:g}): the soft-cap's tanh(x / cap) taken on the unscaled q k^T, the "
            "attention scale applied after it"
        ] = 1 / cap
    mscale = named.get(YARN_SOFTMAX_MSCALE)
    if mscale is not None:  # latent attention with YaRN: 1/sqrt(width) times mscale squared, over each width
        for width_name, width in _head_widths(e, head_dim).items():
            candidates.setdefault(
                f"1/sqrt({width_name}={width}) times the YaRN softmax mscale ({mscale:.6g}) squared",
                width**-0.5 * mscale * mscale,
            )
        candidates[f"1/sqrt(head_dim={head_dim}) times the YaRN softmax mscale once (not squared)"] = (
            head_dim**-0.5 * mscale
        )
    for label, v in named.items():
        if "squared" not in label:
            candidates.setdefault(f"{label} / sqrt(head_dim={head_dim})", v * head_dim**-0.5)
            candidates.setdefault(f"{label} squared", v * v)
    matches = [label for label, value in candidates.items() if abs(scale / value - 1) < 1e-4]
    return f" (= {', or '.join(matches[:3])})" if matches else ""


def _head_widths(e: Evidence, head_dim: int) -> dict[str, int]:
    """The widths a port may take its attention scale from: head_dim, hidden_size / num_attention_heads where the
    config sets another head_dim (a port deriving it, as most configs do), for latent attention (MLA: each head
    ``cat(nope, rope)``) the nope and rope parts, with partial rotary the rotated width, and the values' width where it differs (read from the context
    node)."""
    widths = {"head_dim": head_dim}
    layer = e.facts.layer(e.result.layer)
    rotary = layer.rope.rotary_dim if layer is not None and layer.rope is not None else 0
    if ROTATED_LAST in e.facts.features and 0 < rotary < head_dim:
        widths |= {"qk_nope_head_dim": head_dim - rotary, "qk_rope_head_dim": rotary}
    elif 0 < rotary < head_dim:  # partial rotary: the rotated share's width (Bamba's head_dim * 0.5)
        widths["rotary_dim"] = rotary
    # the values' own width where it is not the queries' (MLA, MiMo-V2-Flash's v_head_dim)
    context = e.ref_trace.tensors.get(f"{e.name.rsplit('.', 1)[0]}.context")
    heads = e.facts.num_heads
    if context is not None and heads and context.shape[-1] % heads == 0 and context.shape[-1] // heads != head_dim:
        widths["v_head_dim"] = context.shape[-1] // heads
    hidden = e.facts.hidden_size
    if hidden and heads and hidden % heads == 0 and hidden // heads not in widths.values():
        widths["hidden_size/num_attention_heads"] = hidden // heads  # last: a named width of that size first
    return widths


def layer_coefficient(e: Evidence, factor: float) -> str:
    """`` (= 1 / (layer index + 1) ...)``: a factor equal to the layer's number or its inverse, past the first
    layer (Megatron's ``apply_query_key_layer_scaling``: q divided by the layer number and multiplied back in
    the softmax), else ``""``."""
    n = (e.result.layer or 0) + 1
    if n < 2:
        return ""
    if abs(factor * n - 1) < 1e-4:
        return (
            f" (= 1 / (layer index + 1) = 1/{n}: a per-layer coefficient divided out and never multiplied back, as "
            "Megatron's apply_query_key_layer_scaling does in its softmax)"
        )
    if abs(factor / n - 1) < 1e-4:
        return f" (= layer index + 1 = {n}: a per-layer coefficient multiplied in where it cancels)"
    return ""


def scale_readings(e: Evidence, factor: float, reference: float | None = None) -> str:
    """``: ours scales q k^T by 0.25 (= 1/sqrt(head_dim=16)), the reference by 0.0625 (= ...)`` for ours'
    scores being the reference's times ``factor``, when the reference's scale is readable (``reference``: known
    otherwise, an attention recomputed at that scale)."""
    reference = reference if reference is not None else _reference_scale(e)
    if reference is None:
        return ""
    ours = factor * reference
    return (
        f"; ours scales q k^T by {ours:.6g}{_scale_name(e, ours)}, the reference by {reference:.6g}"
        f"{_scale_name(e, reference)}"
    )


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
        f"softmax of the reference's scores times {c:.6g}{layer_coefficient(e, c)}{scale_readings(e, c)}",
        {"factor": c},
    )


def partial_head_scores(e: Evidence) -> Hint | None:
    """Attention probabilities that are the softmax of ``q . k`` over part of each head only (the rotary
    dims of a partial-rotary head, the pass-through dims dropped; or the other part) on one side and over
    the whole head on the other, computed from the reference's own ``q_rot`` and ``k_rot`` and the keys
    the reference gives weight to, scaled by ``1/sqrt(head_dim)`` or by the part's."""
    if e.kind != "probs" or e.ours.dim() != 4:
        return None
    stem = e.name.rsplit(".", 1)[0]
    q, k = e.ref_trace.tensors.get(f"{stem}.q_rot"), e.ref_trace.tensors.get(f"{stem}.k_rot")
    if q is None or k is None or q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
        return None
    b, h, t, d = q.shape
    if e.ref.shape != (b, h, t, k.shape[2]):
        return None
    q, k = q.double(), k.double().repeat_interleave(h // k.shape[1], dim=1)
    allowed = (e.ref.double() > 0) & (e.ours.double() > 0)
    layer = e.facts.layer(e.result.layer)
    r = layer.rope.rotary_dim if layer is not None and layer.rope is not None and layer.rope.rotary_dim < d else d // 2
    parts = {
        f"all {d} dims": slice(0, d),
        f"dims 0..{r - 1} only": slice(0, r),
        f"dims {r}..{d - 1} only": slice(r, d),
    }
    candidates = {}
    for label, part in parts.items():
        n = part.stop - part.start
        scores = (q[..., part] @ k[..., part].transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        candidates[f"{label}, scaled by 1/sqrt({d})"] = torch.softmax(scores * d**-0.5, -1)
        if n != d:
            candidates[f"{label}, scaled by 1/sqrt({n})"] = torch.softmax(scores * n**-0.5, -1)

    ours_is, ref_is = forms_of(e, candidates, e.ours, e.ref)
    if ours_is is None or ref_is is None or ours_is.startswith("all ") == ref_is.startswith("all "):
        return None  # both over the whole head (a scale: softmax_temperature's), or neither
    side = "ours" if ref_is.startswith("all ") else "the reference"
    return Hint(
        "attention_partial_head",
        f"likely q . k over part of each head in {side}: ours' probabilities are the softmax of q_rot . k_rot over "
        f"{ours_is}, the reference's over {ref_is} (a partial-rotary head's rotated part used alone, the part "
        "RoPE passes through not concatenated back before q . k)",
        {"ours": ours_is, "reference": ref_is, "side": side},
    )


def attention_softcap(e: Evidence) -> Hint | None:
    """Attention probabilities that are the softmax of the reference's scores soft-capped ``c tanh(s / c)``
    on one side only (Gemma 2's attn_logit_softcapping carried into a model without it, or left out of
    one with it), over the keys the reference gives weight to; ``c`` read back from the probabilities."""
    if e.kind != "probs" or e.ours.dim() != 4:
        return None
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    if scores is None or scores.shape != e.ref.shape:
        return None
    s = scores.double()
    allowed = (e.ref.double() > 0) & (e.ours.double() > 0)
    plain = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)

    def capped(c: float) -> torch.Tensor:
        return torch.softmax((c * torch.tanh(s / c)).masked_fill(~allowed, float("-inf")), -1)

    config = e.facts.attn_softcap
    grid = torch.logspace(0, 3, 31, dtype=torch.float64).tolist()  # caps 1..1000, neighbours 1.26 apart
    for side, value, other in (
        ("ours", e.ours.double(), e.ref.double()),
        ("the reference", e.ref.double(), e.ours.double()),
    ):
        if not e.close(plain.to(other.dtype), other) and not (config and e.close(capped(config), other)):
            continue
        best = min(([config] if config else []) + grid, key=lambda c: rel(value, capped(c)))
        lo, hi = best / 1.26, best * 1.26
        for _ in range(40):  # golden-section refinement of the cap
            m1, m2 = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
            lo, hi = (lo, m2) if rel(value, capped(m1)) < rel(value, capped(m2)) else (m1, hi)
        c = (lo + hi) / 2
        if config and abs(best - config) < 1e-9:
            c = config
        if not e.close(capped(c).to(value.dtype), value) or e.close(plain.to(value.dtype), value):
            continue
        shown = f"{round(c):g}" if abs(c - round(c)) < 1e-3 * c else f"{c:.4g}"
        told = f"attn_logit_softcapping {config:g}" if config else "no attention soft-cap"
        return Hint(
            "softcap",
            f"likely an attention soft-cap in {side} only: its probabilities are the softmax of the reference's scores "
            f"capped as {shown} * tanh(s / {shown}), the other side's of the scores as they are (the config: {told})",
            {"side": side, "cap": c, "config_cap": config},
        )
    return None


def row_offset(e: Evidence) -> Hint | None:
    """Ours minus the reference is one value per row (a token's vector), another for each row: a
    per-token shift. When that shift is minus the row's logsumexp, one side returns log-probabilities
    (``log_softmax``) where the other returns logits."""
    if e.ours.dim() < 2 or e.ref.shape[-1] < 4:
        return None
    a, b = e.ours.double().flatten(0, -2), e.ref.double().flatten(0, -2)
    d = a - b
    shift = d.mean(-1, keepdim=True)
    if a.shape[0] < 2 or rel(d, shift.expand_as(d)) > EXPLAINS or float(shift.abs().max()) == 0:
        return None
    for side, value, other in (("ours", a, b), ("the reference", b, a)):
        if float((value - torch.log_softmax(other, -1)).abs().max()) <= 1e-5 * float(other.abs().max()) + e.noise:
            return Hint(
                "row_offset",
                f"likely log-probabilities: {side} returns log_softmax of the other side's {e.kind} (each row shifted "
                "by minus its logsumexp); return the logits, before any log_softmax",
                {"side": side, "log_softmax": True},
            )
    return Hint(
        "row_offset",
        f"likely a per-token shift: ours - reference is one value per row of {e.kind}, another for each row "
        f"({fmt_list(f'{v:.4g}' for v in shift.flatten()[:4].tolist())})",
        {"row_shifts": shift.flatten()[:8].tolist()},
    )


def _scaled_after_the_scores(e: Evidence, ratio: float) -> Hint | None:
    """Scores one factor apart whose probabilities are not that temperature apart: ours' probability rows are the
    reference's, each times one factor (the same softmax over the keys, another share left to an extra logit), so
    ours softmaxes scores scaled after the point parity read them (a scale applied to ``[scores | sink]`` together),
    and what differs is the sink's term: Hint ``softmax_sink``; None where ours' probabilities are not read, agree,
    or differ otherwise."""
    stem = e.name.rsplit(".", 1)[0]
    p_o, p_r = e.ours_trace.tensors.get(f"{stem}.probs"), e.ref_trace.tensors.get(f"{stem}.probs")
    if p_o is None or p_r is None or p_o.shape != p_r.shape:
        return None
    p_o, p_r = p_o.double(), p_r.double()
    s_o, s_r = p_o.sum(-1), p_r.sum(-1)
    real = s_r > 1e-6
    if not bool(real.any()) or float((s_o - s_r)[real].abs().max()) < 1e-6:
        return None
    if rel((p_r * (s_o / s_r.clamp_min(1e-300))[..., None])[real], p_o[real]) > EXPLAINS:
        return None  # another softmax over the keys: a temperature (or more) indeed
    return Hint(
        "softmax_sink",
        f"likely the attention sink's logit in ours: its scores read {ratio:.6g}x the reference's, yet its "
        "probabilities are the reference's rows, each times one factor (rows summing to "
        f"{float(s_o[real].min()):.4g}..{float(s_o[real].max()):.4g} where the reference's sum to "
        f"{float(s_r[real].min()):.4g}..{float(s_r[real].max()):.4g}): ours scales its scores after the point "
        "parity reads them, and the extra logit in the softmax's denominator (the sink) differs: scaled with the "
        "scores (concatenated before the scale), or another value",
        {"ratio": ratio, "side": "ours"},
    )


def softmax_sink(e: Evidence) -> Hint | None:
    """Attention probabilities whose rows on one side sum to less than 1, each row the other side's
    times one factor: the softmax's denominator has an extra term ``exp(c)``, a logit no key holds (an
    attention sink, gpt-oss; with ``c = 0`` the "off-by-one" softmax, softmax1). ``c`` is read per row
    from the reference's scores, ``c = log(1 / sum - 1) + logsumexp(scores)``, and must be one value."""
    if e.kind != "probs":
        return None
    p_o, p_r = e.ours.double(), e.ref.double()
    s_o, s_r = p_o.sum(-1), p_r.sum(-1)
    # rows of real queries that differ (a fully masked padding row may sum to 0 on one side; a padding
    # row not judged holds the reference's values on both sides)
    real = (s_r > 0.5) & ((p_o - p_r).abs().amax(-1) > 1e-7)
    if not bool(real.any()):
        return None
    both = _sinks_differ(e, p_o, p_r, s_o, s_r, real)
    if both is not None:
        return both
    if "packed into one sequence" in (e.result.detail or "") and bool((s_o[real] < 1 - 1e-5).any()):
        return Hint(
            "padding",
            "likely rows attending across the batch in ours: it packs the real tokens of every row into one sequence "
            f"(padding skipped), and, unpacked, its queries' weights sum to {float(s_o[real].min()):.4g}.."
            f"{float(s_o[real].max()):.4g} over their own row's keys: the rest went to other rows' tokens (a packed, "
            "varlen batch attended without a document mask: cu_seqlens or a block-diagonal mask)",
            {"side": "ours", "row_sums": s_o[real][:6].tolist()},
        )
    for side, low, other, p_low, p_other in (("ours", s_o, s_r, p_o, p_r), ("the reference", s_r, s_o, p_r, p_o)):
        if not bool(((other[real] - 1).abs() < 1e-4).all()) or float((1 - low[real]).min()) < 1e-5:
            continue
        if rel(p_other * low[..., None], p_low) > EXPLAINS:
            continue  # not the other side's rows times one factor each
        scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
        constant = ""
        evidence: dict = {"side": side, "row_sums": low[real][:6].tolist()}
        if scores is not None and scores.shape == p_r.shape:
            allowed = p_other > 0
            lse = torch.logsumexp(scores.double().masked_fill(~allowed, -math.inf), -1)
            c = ((1 / low - 1).log() + lse)[real]
            heads = _per_head(((1 / low - 1).log() + lse), real)
            if heads is not None and float(heads.max() - heads.min()) > 1e-3 * max(1.0, float(heads.abs().max())):
                constant = (
                    f", one extra logit per head ({fmt_list(f'{v:.4g}' for v in heads.tolist())}: an attention sink)"
                )
                evidence["sink_logits"] = heads.tolist()
            elif bool(torch.isfinite(c).all()) and float(c.max() - c.min()) < 1e-3 * max(1.0, float(c.abs().max())):
                value = float(c.mean()) if abs(float(c.mean())) > 1e-4 else 0.0  # 0 up to rounding
                constant = f", one extra logit of {value:.4g} for every row" + (
                    " (the off-by-one softmax, softmax1: 1 + sum exp)" if abs(value) < 1e-3 else " (an attention sink)"
                )
                evidence["sink_logit"] = value
        dropped = _padding_dropped(e, low, real)
        if dropped is not None:
            return Hint(
                "padding",
                f"likely the padding mask applied after the softmax in {side}: its rows sum to "
                f"{float(low[real].min()):.4g}..{float(low[real].max()):.4g}, the mass the padding keys took in a softmax "
                "over every key, then zeroed without renormalising (mask the scores before the softmax)",
                {**evidence, "after_softmax": True},
            )
        return Hint(
            "softmax_sink",
            f"likely an extra term in the softmax's denominator in {side}: its probability rows sum to "
            f"{float(low[real].min()):.4g}..{float(low[real].max()):.4g}, each the other side's row times one factor"
            f"{constant}",
            evidence,
        )
    return None


def _per_head(c: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
    """``c`` ``(batch, heads, queries)`` as one value per head over the real rows, when it is one (up to
    rounding); None otherwise."""
    if c.dim() != 3:
        return None
    values = []
    for h in range(c.shape[1]):
        rows = c[:, h][real[:, h]]
        if not rows.numel() or not bool(torch.isfinite(rows).all()):
            return None
        if float(rows.max() - rows.min()) > 1e-3 * max(1.0, float(rows.abs().max())):
            return None
        values.append(float(rows.mean()))
    return torch.tensor(values, dtype=torch.float64)


def _sinks_differ(
    e: Evidence, p_o: torch.Tensor, p_r: torch.Tensor, s_o: torch.Tensor, s_r: torch.Tensor, real: torch.Tensor
) -> Hint | None:
    """Both sides' rows sum to less than 1 (both softmaxes have an attention sink), each row the other's
    times one factor: the sink logit read per head on each side from the reference's scores, named when one
    is the other's times a constant (the sink scaled like a q.k score), or when one side's rows hold the
    mass the other's sink takes (the sink's rescale ``sigmoid(lse - sink)`` written with its sign flipped)."""
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    if scores is None or scores.shape != p_r.shape or scores.dim() != 4:
        return None
    # every real query's row (a large sink may leave a row little mass on either side: still a row)
    real = (s_o > 1e-6) & (s_r > 1e-6) & ((p_o - p_r).abs().amax(-1) > 1e-7)
    if not bool(real.any()) or float((1 - s_o[real]).min()) < 1e-5 or float((1 - s_r[real]).min()) < 1e-5:
        return None
    if rel(p_r * (s_o / s_r)[..., None], p_o) > EXPLAINS:
        return None
    if bool(((s_o + s_r - 1)[real].abs() < 1e-4).all()):
        return Hint(
            "softmax_sink",
            "likely the attention sink's rescale with its sign flipped on one side: each row of ours holds the mass "
            "the other side's sink takes (row sums add up to 1: sigmoid(sink - lse) where sigmoid(lse - sink) is "
            "meant), the rows otherwise the same",
            {"row_sums_ours": s_o[real][:6].tolist(), "row_sums_reference": s_r[real][:6].tolist()},
        )
    lse = torch.logsumexp(scores.double().masked_fill(~(p_r > 0), -math.inf), -1)
    ours, ref = _per_head((1 / s_o - 1).log() + lse, real), _per_head((1 / s_r - 1).log() + lse, real)
    if ours is None or ref is None or bool((ref.abs() < 1e-6).any()):
        return None
    ratio = ours / ref
    k = float(ratio.mean())
    if float((ratio - k).abs().max()) > 1e-3 * abs(k) or abs(k - 1) < 1e-3:
        return None
    return Hint(
        "softmax_sink",
        f"likely the attention sink's logit: ours' is the reference's times {k:.6g}{_scale_name(e, k)} in every head "
        f"(ours {fmt_list(f'{v:.4g}' for v in ours.tolist())}, the reference {fmt_list(f'{v:.4g}' for v in ref.tolist())}): "
        "a sink scaled like a q.k score where it joins the scaled scores as it is",
        {"factor": k, "sink_ours": ours.tolist(), "sink_reference": ref.tolist()},
    )


def _padding_dropped(e: Evidence, low: torch.Tensor, rows: torch.Tensor) -> bool | None:
    """True when each row's missing mass is what the padding keys take in a softmax over all keys (the
    reference's unmasked scores): the padding zeroed after the softmax. None otherwise."""
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    if e.attention_mask is None or scores is None or scores.dim() != 4:
        return None
    pad = (e.attention_mask == 0)[:, None, None, :].to(scores.device)
    if not bool(pad.any()):
        return None
    s = scores.double()
    q, k = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
    causal = (k <= q)[None, None]
    real_keys = causal & ~pad
    pad_keys = causal & pad
    lse = lambda m: torch.logsumexp(s.masked_fill(~m, -math.inf), -1)
    predicted = 1 / (1 + torch.exp(lse(pad_keys) - lse(real_keys)))
    ok = rows & torch.isfinite(predicted)
    if not bool(ok.any()) or float((predicted[ok] - low[ok]).abs().max()) > 1e-4:
        return None
    return True


# --- scales --------------------------------------------------------------------------------------


def _layer_scalars(e: Evidence) -> dict[str, float]:
    """The reference's one-element parameters and buffers of the failing node's layer (or outside any
    layer for a node outside one), by a name a hint can use: ``the reference's model.layers.3.layer_scalar``."""
    scalars = e.ref_trace.extras.get(SCALARS)
    if not isinstance(scalars, dict):
        return {}
    stem = e.name.rsplit(".", 1)[0] if e.result.layer is not None else ""
    layer_prefix = e.name if e.kind == "layer" else stem
    return {
        f"the reference's {path}": value
        for path, value in scalars.items()
        if path.startswith(layer_prefix + ".") or (e.result.layer is not None and path.startswith(e.name + "."))
    }


def _l2_for_rms(e: Evidence, mean: float, r: float) -> Hint | None:
    """At q or k after a per-head norm, a ratio of sqrt(head_dim) where the smaller side's head vectors have unit
    L2 length: an L2 norm on one side where the other normalises to unit RMS (Llama 4's weight-free "L2Norm" is
    an RMS norm; F.normalize is not)."""
    layer = e.facts.layer(e.result.layer)
    head_dim = layer.head_dim if layer is not None else e.facts.head_dim
    if e.kind not in ("q_rot", "k_rot", "q_norm", "k_norm") or not head_dim or abs(r / head_dim**0.5 - 1) > 1e-3:
        return None
    smaller, side = (e.ours, "ours") if mean < 1 else (e.ref, "the reference")
    if smaller.shape[-1] != head_dim or not _unit_heads(smaller):
        # q scaled after its norm (Dory's per-channel gain): read at the block's keys, the same factor apart
        stem = e.name.rsplit(".", 1)[0]
        k_ours, k_ref = e.ours_trace.tensors.get(f"{stem}.k_rot"), e.ref_trace.tensors.get(f"{stem}.k_rot")
        if e.kind != "q_rot" or k_ours is None or k_ref is None or k_ours.shape != k_ref.shape:
            return None
        k_smaller = k_ours if mean < 1 else k_ref
        if k_smaller.shape[-1] != head_dim or not _unit_heads(k_smaller) or rel(k_ours, k_ref * mean) > 1e-3:
            return None
    other = "the reference" if side == "ours" else "ours"
    return Hint(
        "norm_kind",
        f"likely the {e.kind[0]} norm's kind: {side} normalises each head's {e.kind[0]} to unit L2 length "
        f"(F.normalize), {other} to unit RMS (x / sqrt(mean(x^2) + eps), Llama 4's weight-free L2Norm): the two "
        f"differ by sqrt(head_dim={head_dim}) = {head_dim**0.5:g}, ours / reference = {mean:.6g}",
        {"ratio": mean, "unit_l2": side},
    )


def _unit_heads(t: torch.Tensor) -> bool:
    """Whether every head vector (the last axis) of ``t`` has unit L2 length."""
    return float((t.double().norm(dim=-1) - 1).abs().max()) <= 1e-3


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
    unit = _l2_for_rms(e, mean, r)
    if unit is not None:
        return unit
    matched = [
        (name, value)
        for name, value in {**e.facts.named_constants(), **_layer_scalars(e)}.items()
        if value > 0 and abs(r / max(value, 1 / value) - 1) < 1e-3
    ]
    known = ""
    kind = "attention_scale" if e.kind == "scores" and _qk_agree(e) else "scale"
    if e.kind == "logits" and e.facts.logit_scale not in (None, 1.0):
        return Hint(
            "logit_scale",
            f"likely logit_scale: the logits differ by one factor, ours / reference = {mean:.6g} "
            f"(the reference's logit_scale is {e.facts.logit_scale:g})",
            {"ratio": mean},
        )
    # the config's own fields first, and among them the one that belongs where the node sits (the logits'
    # scaling at the logits, the embedding's multiplier at the embedding): several may be equal
    near = "logit" if e.kind in ("logits", "lm_head") else "embed" if "embed" in e.kind else None
    matched.sort(key=lambda item: (near is None or near not in item[0], "config's" not in item[0]))
    if matched and kind == "scale":
        name, value = matched[0]
        others = "".join(f", or {n}" for n, _ in matched[1:3])
        expr = name if value >= 1 else f"1 / {name}"  # the ratio read is at least 1: a value below 1 is its inverse
        known = f"; matches {bigger} = {expr} ({max(value, 1 / value):.6g}){others}"
        if name.startswith("the config's") and name.split(" (")[0].endswith("squared"):
            known += " (one side divides by it where the other multiplies)"
        if "attention factor" in name:
            kind = "rope_attention_factor"
        elif name == "logit_scale":
            kind = "logit_scale"
    if kind == "attention_scale":
        after = _scaled_after_the_scores(e, mean)
        if after is not None:
            return after
        named = f"; matches {matched[0][0]}" if matched else ""
        return Hint(
            kind,
            f"likely the attention scale (softmax temperature): q and k agree, the pre-softmax scores "
            f"differ by one factor, ours / reference = {mean:.6g}{layer_coefficient(e, mean)}"
            f"{scale_readings(e, mean) or named}",
            {"ratio": mean, "matches": matched[0][0] if matched else None},
        )
    layer = e.facts.layer(e.result.layer)
    scale = layer.attention_scale if layer is not None else None
    carrier = (
        "ours"
        if scale and abs(mean / scale - 1) < 1e-3
        else "the reference"
        if scale and abs(mean * scale - 1) < 1e-3
        else None
    )
    if e.kind == "context" and carrier:  # the probabilities agree: the values carry the factor
        return Hint(
            "scale",
            f"likely the values scaled by the attention scale in {carrier}: the context is ours / reference = {mean:.6g} "
            f"= the attention scale ({scale:.6g}, 1/sqrt(head_dim)) where the probabilities agree: q's scaling "
            "applied to v as well (a copy-paste)",
            {"ratio": mean, "matches": "attention scale", "side": carrier},
        )
    return Hint(
        kind,
        f"likely a missing or extra scale: ours / reference = {mean:.6g} at every position including 0 "
        f"(reference / ours = {1 / mean:.6g}){known}",
        {"ratio": mean, "matches": matched[0][0] if matched else None},
    )


def _position_scales(e: Evidence, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The query scales by position a port may write for the config's Llama 4 attention temperature
    (``rope_parameters["llama_4_scaling_beta"]``, Mistral 4's ``get_llama_4_attn_scale``: ``1 + beta ln(1 +
    floor(p / original_max_position_embeddings))``), by name; empty where the config has none."""
    layer = e.facts.layer(e.result.layer)
    rope = layer.rope if layer is not None else None
    beta = rope.parameters.get("llama_4_scaling_beta") if rope is not None else None
    span = rope.parameters.get("original_max_position_embeddings") if rope is not None else None
    if not isinstance(beta, (int, float)) or not beta or not isinstance(span, (int, float)) or span <= 0:
        return {}
    p = positions.double() / float(span)
    index = torch.arange(positions.shape[-1], dtype=torch.float64).expand_as(p) / float(span)
    forms = {
        "the Llama 4 query scale": 1 + beta * torch.log1p(torch.floor(p)),
        "no query scale": torch.ones_like(p),
        "the Llama 4 query scale without its floor (ln(1 + p / original_max_position_embeddings))": 1
        + beta * torch.log1p(p),
        "the Llama 4 query scale with p + 1 for p": 1
        + beta * torch.log1p(torch.floor((positions.double() + 1) / span)),
        "the Llama 4 query scale at each token's index in its row (arange(seq)), not at its position id (a "
        "left-padded row's positions start after its padding)": 1 + beta * torch.log1p(torch.floor(index)),
    }
    longest = e.facts.max_position_embeddings
    if longest and longest != span:
        label = (
            f"the Llama 4 query scale over max_position_embeddings ({longest}), not original_max_position_embeddings"
        )
        forms[f"{label} ({span:g})"] = 1 + beta * torch.log1p(torch.floor(positions.double() / float(longest)))
    return forms


def position_scale(e: Evidence) -> Hint | None:
    """ours / reference is one factor per position (the same over heads and dims) at q: a query scale by
    position written otherwise (Llama 4's attention temperature in Mistral 4: missing, or its floor dropped).
    Each side's factor read against the forms of :func:`_position_scales`; either side. At k: the query's scale
    applied to the keys as well. Padding positions are not judged."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    if e.positions.shape != (e.ref.shape[0], e.ref.shape[2]):
        return None
    a, b = e.ours.double(), e.ref.double()
    real = torch.ones(e.positions.shape, dtype=torch.bool) if e.attention_mask is None else e.attention_mask.bool()
    if real.shape != e.positions.shape:
        return None
    keep = (b.abs() > 1e-3 * float(b.abs().max())) & real[:, None, :, None]
    ratio = torch.where(keep, a / torch.where(keep, b, torch.ones_like(b)), torch.nan)
    per_position = ratio.nanmedian(dim=-1).values.nanmedian(dim=1).values  # (batch, seq)
    per_position = torch.where(real, per_position, torch.ones_like(per_position))
    judged = real[:, None, :, None].expand_as(a)
    if (
        not bool(torch.isfinite(per_position).all())
        or rel(a[judged], (b * per_position[:, None, :, None])[judged]) > 1e-6
    ):
        return _head_position_scale(e, a, b, ratio, real)  # not one factor per position: one per head and position?
    if float(per_position[real].max() / per_position[real].min()) < 1.001:
        return None  # one factor everywhere: a scale, not one by position
    forms = _position_scales(e, e.positions)
    if e.kind == "k_rot":
        if not forms:  # no form of the config's to read it against (Llama 4's own temperature): the factor shown
            row = int((per_position - 1).abs().amax(-1).argmax())
            step = max(1, e.positions.shape[1] // 4)
            pairs = zip(e.positions[row][::step].tolist(), per_position[row][::step].tolist(), strict=True)
            return Hint(
                "scale",
                "likely a scale by position on the keys one side applies and the other does not (an attention "
                "temperature meant for the queries applied to the keys as well): ours / reference is one factor per "
                f"position, the same over every head and dim of k ({', '.join(f'p{int(p)}: {f:.4g}' for p, f in pairs)})",
                {"per_position": per_position[row][:64].tolist(), "form": "on the keys"},
            )
        truth = forms["the Llama 4 query scale"]
        for side, factor in (("ours", per_position), ("the reference", 1 / per_position)):
            if torch.allclose(truth[real], factor[real], rtol=1e-6, atol=1e-9):
                return Hint(
                    "scale",
                    f"likely the query scale by position (the config's llama_4_scaling_beta, 1 + beta ln(1 + floor(p / "
                    f"original_max_position_embeddings))) applied to the keys as well in {side}: it scales the "
                    "queries alone (one factor per position over every head and dim of k)",
                    {"side": side, "form": "on the keys"},
                )
        return None
    if not forms:
        row = int((per_position - 1).abs().amax(-1).argmax())  # the batch row that differs most
        step = max(1, e.positions.shape[1] // 4)
        pairs = zip(e.positions[row][::step].tolist(), per_position[row][::step].tolist(), strict=True)
        shown = ", ".join(f"p{int(p)}: {f:.4g}" for p, f in pairs)
        return Hint(
            "scale",
            "likely a query scale by position (an attention temperature) one side applies and the other does not, "
            "or computes otherwise (its floor, its offset, the position index it reads: the token's index or its "
            f"position id): ours / reference is one factor per position, the same over every head and dim ({shown})",
            {"per_position": per_position[row][:64].tolist()},
        )
    truth = forms["the Llama 4 query scale"]
    for side, factor in (("ours", per_position), ("the reference", 1 / per_position)):
        # factor = side's scale / the other's; the other side holds the config's form
        # every form that fits (positions short of a span make two forms one: say both)
        found = "; or ".join(
            label
            for label, f in forms.items()
            if label != "the Llama 4 query scale"
            and torch.allclose((f / truth)[real], factor[real], rtol=1e-6, atol=1e-9)
        )
        if found:
            return Hint(
                "scale",
                f"likely the query scale by position (the config's llama_4_scaling_beta): {side} applies {found}, "
                "the other side the Llama 4 query scale 1 + beta ln(1 + floor(p / original_max_position_embeddings)) "
                "(one factor per position over every head and dim of q)",
                {"side": side, "form": found},
            )
    return None


def _head_position_scale(
    e: Evidence, a: torch.Tensor, b: torch.Tensor, ratio: torch.Tensor, real: torch.Tensor
) -> Hint | None:
    """At q: ours / reference one factor per head and position (the same over the dims), 1 at position 0 and not
    later: a query scale by position with its own coefficients per head (Mistral Large 4's log-position softmax
    scaling, ``scale_h ln(p + 1) + bias_h``) one side computes otherwise (the position it reads, its log)."""
    positions = e.positions
    if e.kind != "q_rot" or a.shape[1] < 2 or positions is None:
        return None
    factor = ratio.nanmedian(dim=-1).values  # (batch, heads, seq): ``ratio`` is ours / reference where judged
    judged = real[:, None, :, None].expand_as(a)
    if not bool(torch.isfinite(factor[real[:, None, :].expand_as(factor)]).all()):
        return None
    if rel(a[judged], (b * factor.nan_to_num(1.0)[..., None])[judged]) > 1e-6:
        return None  # not one factor per head and position
    first = positions == positions.min()
    at_start = factor.permute(0, 2, 1)[first & real]  # (tokens at the first position, heads)
    later = factor.permute(0, 2, 1)[~first & real]
    if at_start.numel() == 0 or later.numel() == 0 or float((at_start - 1).abs().max()) > 1e-5:
        return None
    if float((later - 1).abs().max()) < 1e-3:
        return None
    row = int(real.sum(1).argmax())
    step = max(1, positions.shape[1] // 4)
    pairs = zip(positions[row][::step].tolist(), factor[row, 0][::step].tolist(), strict=True)
    shown = ", ".join(f"p{int(p)}: {f:.4g}" for p, f in pairs)
    return Hint(
        "scale",
        "likely a query scale by position with coefficients per head (a log-position softmax scaling, scale_h "
        "ln(p + 1) + bias_h) computed otherwise on one side (the position it reads, p or p + 1, its log or floor): "
        f"ours / reference is one factor per head and position, 1 at position 0 (head 0: {shown})",
        {"per_head_position": True},
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
    if rel(b[rows] * factors[:, None], a[rows]) > EXPLAINS:
        return None  # the factors miss what ours holds where the reference is ~0 (a key the window adds)
    evidence: dict = {"row_factors": factors[:8].tolist()}
    spans = _qk_norm_span(e)
    if spans is not None:
        return spans
    if e.kind in ("q_rot", "k_rot") and e.ours.dim() == 4 and bool(rows.all()):
        per_head = factors.view(e.ours.shape[:3])  # (batch, heads, tokens)
        if float((per_head.amax(-1) / per_head.amin(-1) - 1).max()) < 1e-3:  # one factor per head, every token
            heads = per_head[0, :, 0].tolist()
            return Hint(
                "scale",
                f"likely a per-head factor on {e.kind[0]} (a learned per-head temperature or scale one side applies "
                f"and the other does not): ours / reference is one factor per head, the same at every token "
                f"({fmt_list(f'{v:.4g}' for v in heads[:4])})",
                {**evidence, "per_head": heads[:64]},
            )
    cause = "a per-vector normalisation applied on one side only"
    for label, size in (("unit L2 length", a[rows].norm(dim=-1)), ("unit RMS", a[rows].pow(2).mean(-1).sqrt())):
        ref_size = size / factors
        ours_unit, ref_unit = bool(((size - 1).abs() < 1e-3).all()), bool(((ref_size - 1).abs() < 1e-3).all())
        if ref_unit != ours_unit:
            side = "the reference's rows have" if ref_unit else "ours have"
            cause = (
                f"{side} {label}, the other side's do not: a missing {'L2' if 'L2' in label else 'RMS'} normalisation"
            )
            evidence["unit"] = {"reference" if ref_unit else "ours": label}
            if e.kind in ("q_rot", "k_rot") and label == "unit RMS":  # the rows are heads at tokens
                letter, skipped = e.kind[0], "ours" if ref_unit else "the reference"
                return Hint(
                    "norm_skipped",
                    f"likely the per-head {letter} norm ({letter}_norm, RMS over each head's features) skipped in "
                    f"{skipped}: {side} unit RMS per head and token, the other side's do not; ours / reference is one "
                    f"factor per head and token ({fmt_list(f'{v:.4g}' for v in factors[:4].tolist())})",
                    {**evidence, "side": skipped},
                )
            break
    capped = (factors - 1).abs() < 1e-6
    if "unit" not in evidence and bool(capped.any()) and not bool(capped.all()):
        # some rows agree exactly, the others differ by one factor each: a per-row cap on both sides (an L2 clip:
        # rows over the threshold brought to it) after a scale one side applies, the rows the cap reaches agreeing
        c = float(factors[(factors.log().abs()).argmax()])
        return Hint(
            "scale",
            f"likely a scale on {e.kind}'s values before a per-row cap (an L2 clip) both sides apply: "
            f"{int(capped.sum())} of {len(factors)} rows agree exactly (the cap reached on both sides), the others "
            f"differ by one factor each, up to {c:.6g} (ours / reference where neither side's row reaches the cap)",
            {**evidence, "factor": c, "capped_rows": int(capped.sum())},
        )
    if "unit" not in evidence and is_norm(e.kind):
        # a norm's output on both sides, neither of unit size: not one side normalising and the other not (a gate
        # moved across the norm gives one factor per row too: rms(x) / rms(x g)); the one-change search reads it
        return None
    return Hint(
        "row_scale",
        f"likely {cause}: ours / reference is one factor per row (along the last axis), a different one for each "
        f"row ({fmt_list(f'{v:.4g}' for v in factors[:4].tolist())})",
        evidence,
    )


def _qk_norm_span(e: Evidence) -> Hint | None:
    """At q_rot (k_rot) behind a per-head QK norm: one factor per (head, token) that is the ratio of one span's
    RMS to another's, over the reference's projection: the norm's statistic taken over every head's features
    together (the flat projection) where the other side normalises each head, either side."""
    stem, letter = e.name.rsplit(".", 1)[0], e.kind[:1]
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4:
        return None
    proj = e.ref_trace.tensors.get(f"{stem}.{letter}_proj")
    b, h, s, d = e.ref.shape
    if proj is None or proj.numel() != b * h * s * d:
        return None  # (a norm after RoPE, HunYuan's or nanochat's weight-free one, keeps each head's RMS: the same
        # ratio holds; the ratio itself, to 1e-4, is the test: no norm node needs to be seen)
    x = proj.double().reshape(b, s, h, d)
    eps = e.facts.norm_eps or 1e-6
    per_head = (x.pow(2).mean(-1) + eps).rsqrt()  # (b, s, h)
    flat = (x.pow(2).mean((-1, -2)) + eps).rsqrt()[..., None]  # (b, s, 1)
    ratio = (e.ours.double().norm(dim=-1) / e.ref.double().norm(dim=-1).clamp_min(1e-300)).transpose(1, 2)
    for side, expected in (("ours", flat / per_head), ("the reference", per_head / flat)):
        if rel(ratio, expected) < 1e-4:
            return Hint(
                "norm_kind",
                f"likely the {letter}_norm's statistic over every head's features together in {side} (the flat "
                f"projection, {h * d} features) where the other side normalises each head ({d}): {e.kind} differs by "
                "one factor per head and token, the ratio of the two RMS",
                {"side": side, "span": h * d, "head_dim": d},
            )
    return None


def channel_ratio(e: Evidence) -> Hint | None:
    """ours / reference constant over tokens for each channel, different across channels."""
    ours, ref = e.ours, e.ref
    if ours.dim() < 2 or ours.shape[-1] < 2:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if a.shape[0] < 2 or bool((b.abs() < 1e-6).any()):
        return _head_channel_ratio(e)
    ratio = a / b
    spread = float((ratio.std(0) / ratio.mean(0).abs().clamp_min(1e-12)).max())
    if spread > 1e-3:
        return _head_channel_ratio(e)
    per_channel = ratio.mean(0)
    if float((per_channel - 1).abs().max()) < 1e-3:
        return None
    rotated = _rotated_dims_scaled(e, per_channel)
    if rotated is not None:
        return rotated
    named = _channels_as_weight(e, per_channel)
    if named is not None:
        return named
    return Hint(
        "channel_scale",
        "likely a per-channel weight difference (a norm weight used as w instead of 1 + w, or a wrong norm "
        f"weight): ours / reference is constant over tokens per channel, e.g. "
        f"{fmt_list(f'{v:.4g}' for v in per_channel[:4].tolist())}",
        {"per_channel": per_channel[:16].tolist()},
    )


def _channels_as_weight(e: Evidence, per_channel: torch.Tensor) -> Hint | None:
    """ours / reference per channel that is a norm weight of the reference's in this layer (repeated over the heads,
    or its reciprocal): a weight applied here by one side alone (Gemma 4's K = V values normalised with the keys'
    k_norm weight where the reference's v_norm has none)."""
    n = per_channel.numel()
    for name, weight in e.ref_trace.weights.items():
        layer, kind = e.facts.locate(name)
        if layer != e.result.layer or weight.dim() != 1 or n % weight.numel() or not is_norm(kind):
            continue
        tiled = (weight.double() + float(e.facts.norm_weight_offset or 0.0)).repeat(n // weight.numel())
        for side, expected in (("ours", tiled), ("the reference", 1 / tiled)):
            if bool(torch.isfinite(expected).all()) and rel(per_channel, expected) < 1e-4:
                heads = f" (repeated over {n // weight.numel()} heads)" if n > weight.numel() else ""
                values = (
                    " (a K = V layer's values: the keys' projection normalised without a weight in the reference, "
                    "ours normalised them with the keys' norm)"
                    if e.kind == "context" and kind == "k_norm" and side == "ours"
                    else ""
                )
                return Hint(
                    "channel_scale",
                    f"likely {name}'s weight applied here by {side} alone: ours / reference per channel is "
                    f"{'that weight' if side == 'ours' else 'its reciprocal'}{heads}{values}",
                    {"weight": name, "side": side},
                )
    return None


def _head_channel_ratio(e: Evidence) -> Hint | None:
    """At q or k ``(batch, heads, seq, head_dim)``: ours / reference constant over the tokens for each head and
    channel, different across heads (a learned per-head, per-channel gain: nGPT's and Dory's ``sqk``, a per-head
    q/k norm weight), where one factor per channel alone does not fit."""
    if e.kind not in ("q_rot", "k_rot", "q_norm", "k_norm") or e.ours.dim() != 4:
        return None
    a, b = (t.double().transpose(1, 2).flatten(0, 1) for t in (e.ours, e.ref))  # (tokens, heads, head_dim)
    kept = b.abs() > 1e-4 * float(b.abs().max())  # entries near zero carry only rounding in their ratio
    read = kept.sum(0) >= 2  # (heads, head_dim) read on two tokens or more: most of them must be
    if a.shape[0] < 2 or int(read.sum()) * 2 < read.numel():
        return None
    ratio = torch.where(kept, a / b.where(kept, torch.ones_like(b)), torch.nan)
    factors = ratio.nanmean(0)
    spread = ((ratio - factors).abs() / factors.abs().clamp_min(1e-12)).nan_to_num(0.0)
    if float(spread.max()) > 1e-3:
        return None
    per_head = factors.nanmean(-1, keepdim=True)
    if float(((factors - per_head).abs() / per_head.abs().clamp_min(1e-12)).nan_to_num(0.0).max()) < 1e-3:
        return None  # one factor per head, every channel alike: a per-head temperature (row_scale names it)
    factors = factors[read]
    if float((factors - 1).abs().max()) < 1e-3:
        return None
    letter = e.kind[0]
    return Hint(
        "channel_scale",
        f"likely a per-head, per-channel gain on {letter} that differs (a learned {letter} scale applied otherwise: "
        "squared or not, another initialisation constant, a per-head norm weight): ours / reference is constant over "
        f"tokens for each head and channel, e.g. {fmt_list(f'{v:.4g}' for v in factors.flatten()[:4].tolist())}",
        {"per_head_channel": factors.flatten()[:16].tolist()},
    )


def _rotated_dims_scaled(e: Evidence, per_channel: torch.Tensor) -> Hint | None:
    """q (k) after RoPE whose rotated dims are the reference's times one constant and whose pass-through
    dims agree, in every head: a factor applied with the rotation (folded into its cos/sin tables) that
    misses the dims a partial RoPE leaves as they are."""
    layer = e.facts.layer(e.result.layer)
    rope = layer.rope if layer is not None else None
    d = e.ours.shape[-1]
    rotary = rope.rotary_dim if rope is not None else 0
    if e.kind not in ("q_rot", "k_rot") or not 0 < rotary < d or per_channel.numel() != d:
        return None
    last = ROTATED_LAST in e.facts.features  # MLA's heads: cat(pass-through, rotated)
    rot, rest = (
        (per_channel[d - rotary :], per_channel[: d - rotary]) if last else (per_channel[:rotary], per_channel[rotary:])
    )

    def one_factor(t: torch.Tensor) -> float | None:
        c = float(t.mean())
        return c if float((t - c).abs().max()) <= 1e-4 * abs(c) and abs(c - 1) >= 1e-3 else None

    agrees = {"rotated": float((rot - 1).abs().max()) <= 1e-4, "rest": float((rest - 1).abs().max()) <= 1e-4}
    c = one_factor(rest)
    if c is not None and agrees["rotated"]:
        return Hint(
            "scale",
            f"likely a factor that reaches only the dims RoPE leaves as they are: ours' {e.kind[0]} is the reference's "
            f"times {c:.6g}{_scale_name(e, c)} on the {d - rotary} pass-through dims of each head and agrees on the "
            f"{rotary} rotated ones (a scale applied to one part of each head, e.g. MLA's q_nope, where the other "
            "side applies it to both)",
            {"factor": c, "rotary_dim": rotary, "part": "pass-through"},
        )
    c = one_factor(rot)
    if c is None or not agrees["rest"]:
        return None
    why = (
        "a scale applied to one part of each head, e.g. MLA's q_rope, where the other side applies it to both"
        if last
        else "a scale folded into the cos/sin tables, which partial rotary never applies to the pass-through dims"
    )
    return Hint(
        "scale",
        f"likely a factor that reaches only the rotated dims: ours' {e.kind[0]} is the reference's times "
        f"{c:.6g}{_scale_name(e, c)} on the {rotary} rotated dims of each head and agrees on the other "
        f"{d - rotary} ({why})",
        {"factor": c, "rotary_dim": rotary, "part": "rotated"},
    )


def softmax_axis(e: Evidence) -> Hint | None:
    """Attention probabilities normalised over another axis than the keys on one side: one side's rows
    (a query's weights over the keys, the last axis) sum to 1, the other's sum to 1 over the queries
    (``softmax(scores, dim=-2)``) or the heads instead."""
    if e.kind != "probs" or e.ours.dim() < 3 or e.ours.shape != e.ref.shape:
        return None
    tol = max(1e-3, 16 * torch.finfo(e.ref.dtype).eps)
    labels = {-1: "the keys (the last axis)", -2: "the queries (dim=-2)", 1: "the heads (dim=1)"}

    def axis_of(t: torch.Tensor) -> int | None:
        t = t.double()
        return next((axis for axis in labels if bool(((t.sum(axis) - 1).abs() < tol).all())), None)

    ours_axis, ref_axis = axis_of(e.ours), axis_of(e.ref)
    if ours_axis is None or ref_axis is None or ours_axis == ref_axis or -1 not in (ours_axis, ref_axis):
        return None
    side = "ours" if ref_axis == -1 else "the reference"
    return Hint(
        "softmax_axis",
        f"likely the softmax axis: ours' attention probabilities sum to 1 over {labels[ours_axis]}, the reference's "
        f"over {labels[ref_axis]} (softmax(scores, dim=-1) normalises over the keys)",
        {"ours_axis": ours_axis, "reference_axis": ref_axis, "side": side},
    )


def scaled_before_bias(e: Evidence) -> Hint | None:
    """A projection with a bias, one side's output the other's product ``x W`` times one constant plus the same
    bias: ``s x W + b`` against ``x W + b`` (fairseq's ``q_proj(x) * scaling`` ported as the scale folded into the
    weight alone, the projection then recorded with it). Either side, by which is scaled; the constant named
    where the config gives it (``1 / sqrt(head_dim)``)."""
    bias = e.ref_trace.biases.get(e.name)
    if bias is None or e.ours.shape != e.ref.shape or e.ref.shape[-1] != bias.numel() or not bool(bias.any()):
        return None
    b = bias.double()
    ours, ref = (t.double().reshape(-1, b.numel()) - b for t in (e.ours, e.ref))
    if ours.shape[0] < 2:
        return None
    c = float((ours * ref).sum() / ref.pow(2).sum().clamp_min(1e-300))
    if c == 0 or abs(c - 1) < 1e-3 or rel(ours, c * ref) > max(EXPLAINS, 16 * torch.finfo(e.ref.dtype).eps):
        return None
    # the side whose output is not its module's plain x W^T + b holds the scale (by the reference's own weight and
    # input where kept; else the scale taken as below one: the softmax's 1 / sqrt(head_dim))
    x, weight = e.ref_trace.inputs.get(e.name), e.ref_trace.weights.get(e.name)
    plain = None
    if x is not None and weight is not None and weight.dim() == 2 and x.shape[-1] == weight.shape[1]:
        plain = (x.double() @ weight.double().T + b).reshape(-1, b.numel())
    if plain is not None and plain.shape == ours.shape and rel(plain - b, ref) <= EXPLAINS:
        side, factor = "ours", c
    elif plain is not None and plain.shape == ours.shape and rel(plain - b, ours) <= EXPLAINS:
        side, factor = "the reference", 1 / c
    else:
        side, factor = ("ours", c) if abs(c) < 1 else ("the reference", 1 / c)
    named = constant_named(e, factor)
    return Hint(
        "bias",
        f"likely {e.kind}'s product scaled before its bias is added in {side}: one side's output is "
        f"{factor:.6g} x (x W) + b, the other's x W + b (the scale folded into the weight and not the bias, where "
        f"the reference scales the whole projection after it, bias included){named}",
        {"side": side, "factor": factor},
    )


def added_vector(e: Evidence) -> Hint | None:
    """Ours minus the reference is one vector added at every position (a bias one side has and the
    other lacks, or a bias loaded into the wrong module), with its size."""
    if e.ours.dim() < 2 or e.ours.shape != e.ref.shape or e.ref.shape[-1] < 2:
        return None
    d = (e.ours.double() - e.ref.double()).reshape(-1, e.ref.shape[-1])
    if d.shape[0] < 2:
        return None
    v = d.mean(0)
    if float(v.norm()) == 0 or rel(d, v.expand_as(d)) > max(EXPLAINS, 16 * torch.finfo(e.ref.dtype).eps):
        return None
    evidence = {"norm": float(v.norm()), "max_abs": float(v.abs().max())}
    named = _bias_source(e, v)
    if named is not None:
        return Hint(
            "bias",
            f"likely the bias: {named} (ours - reference is one vector at every position, norm {float(v.norm()):.4g})",
            {**evidence, "source": named},
        )
    tiled = _tiled_per_head(e, v)
    if tiled is not None:
        return Hint("bias", tiled, {**evidence, "tiled": True})
    return Hint(
        "bias",
        f"likely a bias one side adds and the other does not: ours - reference is the same vector at every "
        f"position (norm {float(v.norm()):.4g}, largest |element| {float(v.abs().max()):.4g}) at {e.kind}",
        evidence,
    )


def _tiled_per_head(e: Evidence, v: torch.Tensor) -> str | None:
    """The vector one side adds (``v``, ours - reference) is a few values, one per head, tiled across the
    features (feature j reads value j % heads): a per-head vector (Beam's per-head gate bias) expanded with
    ``repeat`` at load where each head's value belongs to its own head_dim features (``repeat_interleave``)."""
    n = v.shape[0]
    heads = [h for h in (e.facts.num_heads, e.facts.num_kv_heads) if h and 1 < h < n and n % h == 0]
    for h in dict.fromkeys(heads):
        values = v[:h].double()
        if float(values.max() - values.min()) <= 1e-6 * float(values.abs().max()):
            continue  # one value throughout: no per-head pattern to read
        if float((v.double() - values.repeat(n // h)).abs().max()) <= 1e-5 * float(values.abs().max()):
            return (
                f"likely a per-head vector expanded in another layout: ours - reference at {e.kind} is {h} values "
                f"tiled across its {n} features (feature j reads value j % {h}), a vector of one value per head "
                f"expanded with repeat where each head's value belongs to its own {n // h} features "
                "(repeat_interleave), or added on one side only"
            )
    return None


def _bias_block(e: Evidence, full: torch.Tensor, v: torch.Tensor) -> str | None:
    """At rows of a fused output (a weight cut per head, ``[rows 0, 1, 2, ...]``): ours adds a block of
    consecutive elements of the fused bias where the reference adds the elements of those rows (the bias
    cut flat into [q; k; v] blocks while the weight is cut per head, or the reverse). ``v``: ours - reference."""
    n, full, v = v.shape[0], full.double(), v.double()
    if full.dim() != 1 or full.shape[0] % n:
        return None
    pool = full.sort().values
    tol = 1e-4 * max(float(full.abs().max()), 1e-30)  # v is a mean over positions of float32 differences
    for i in range(full.shape[0] // n):
        block = full[i * n : (i + 1) * n]
        own = block - v  # what the reference added, if ours added this block
        at = torch.searchsorted(pool, own).clamp(max=pool.shape[0] - 1)
        near = torch.minimum((pool[at] - own).abs(), (pool[(at - 1).clamp(min=0)] - own).abs())
        if bool((near <= tol).all()) and not torch.allclose(block, own, atol=tol):
            return (
                f"ours adds elements [{i * n}:{(i + 1) * n}] of {_fused_name(e.name).split('[')[0]}'s bias (one block, "
                "cut flat) where the reference adds the bias of these rows (cut as the weight is: per head)"
            )
    return None


def _fused_name(name: str) -> str:
    part = part_of(name)
    return part[0] if part is not None else name


def _bias_source(e: Evidence, v: torch.Tensor) -> str | None:
    """What one side adds instead of the reference's bias ``b`` (the other side adding ``b``): none,
    ``b`` twice, another part of a fused bias (split in another order), another module's bias, or (a
    norm) ``b * w``, the bias added before the weight. ``v`` is ours - reference."""
    full = e.ref_trace.biases.get(e.name)
    if full is None or full.dim() != 1:
        return None
    n = v.shape[0]
    part = part_of(e.name)
    features = part[1] if part is not None and part[1].step == 1 else None
    own = full[features.start : features.stop] if features is not None and full.shape[0] != n else full
    if own.shape[0] != n:
        return _bias_block(e, full, v)
    own, v = own.double(), v.double()

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return float((a - b).norm()) <= 1e-3 * max(float(b.norm()), float(v.norm()))

    weight = e.ref_trace.weights.get(e.name)
    for side, added in (("ours", own + v), ("the reference", own - v)):  # the other side adding b
        if same(added, torch.zeros_like(added)):
            # a query's or key's bias added after RoPE reads as none here, where the product is compared
            later = (
                " (left out, or added later: a query or key bias added after RoPE, where the rotation would turn it)"
                if e.kind in ("q_proj", "k_proj", "query", "key")
                and any(k.endswith("_rot") for k in e.ref_trace.tensors)
                else ""
            )
            return f"{side} adds none at {e.name}, the other side its bias{later}"
        if same(added, 2 * own):
            return f"{side} adds {e.name}'s bias twice"
        scale = float((added * own).sum() / own.pow(2).sum().clamp_min(1e-300))
        if abs(scale - 1) > 1e-3 and abs(scale) > 1e-3 and same(added, scale * own):
            named = named_scale(e, scale)
            # a projection whose output is cut into heads sums no heads: its bias cannot be added once per head
            splits_heads = e.kind in HEAD_INPUTS or e.kind.split("[")[0] in FUSED_QKV
            if e.facts.num_heads and abs(scale - e.facts.num_heads) < 1e-3 and not (splits_heads and named):
                also = (
                    f", or times {scale:g}{named} where a scale was folded into the weight at load and not into the "
                    "bias"
                    if named
                    else ""
                )
                return (
                    f"{side} adds {e.name}'s bias {e.facts.num_heads} times: once per head (num_heads = "
                    f"{e.facts.num_heads}), added to each head's share before the heads are summed{also}"
                )
            return (
                f"{side} adds {e.name}'s bias times {scale:.6g}{named_scale(e, scale)}, compared here in the "
                "reference's units: a scale folded into the weight at load and not into the bias (or the reverse)"
            )
        if weight is not None and weight.shape == own.shape and same(added, own * weight.double()):
            return f"{side} adds the bias before the weight ((x_hat + b) * w), the other side after (x_hat * w + b)"
        for name, other in e.ref_trace.biases.items():
            other = other.double()
            if other.dim() != 1 or other.shape[0] % n:
                continue
            for i in range(other.shape[0] // n):
                chunk = other[i * n : (i + 1) * n]
                if same(added, chunk) and not same(chunk, own):
                    if other.shape[0] == n:
                        return f"{side} adds {name}'s bias at {e.name} (another module's bias)"
                    return (
                        f"{side} adds part [{i * n}:{(i + 1) * n}] of {_fused_name(name)}'s bias at {e.name} (a fused "
                        "bias split in another order)"
                    )
    return None
