"""A bias added to the attention scores that grows with the distance between query and key: ALiBi
(Press et al. 2022, "Train Short, Test Long", arXiv:2108.12409; BLOOM, MPT). Each head ``h`` adds
``m_h * (p_key - p_query)`` to its scores, with the slopes ``m_h = 2^(-8 (h + 1) / n)`` for ``n`` heads
(a power of two; Transformers' ``build_alibi_tensor``). The bias is read back from the probabilities
and the scores before it: per row, ``log p - s`` is the bias up to the row's normaliser."""

from __future__ import annotations

import math

import torch

from parity.diagnose.evidence import Evidence, fmt_list
from parity.diagnose.hints import Hint


def standard_slopes(heads: int) -> list[float]:
    """ALiBi's slopes for ``heads`` heads: ``2^(-8 (h + 1) / n)`` for a power of two ``n``, else the
    closest power of two's and every other slope of twice as many (Press et al. 2022, sec. 3)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = [2 ** (-8 * (h + 1) / closest) for h in range(closest)]
    extra = [2 ** (-4 * (2 * h + 1) / closest) for h in range(heads - closest)]
    return base + extra


def _slopes(bias: torch.Tensor, distance: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
    """``(batch, heads)``: the slope per row and head of ``bias`` ``(b, h, q, k)`` against ``distance``
    ``(b, 1, q, k)`` over ``valid`` entries; None when the bias is not linear in the distance there."""
    x = distance.expand_as(bias).where(valid, torch.zeros_like(bias))
    y = bias.where(valid, torch.zeros_like(bias))
    slope = (x * y).sum((-2, -1)) / x.pow(2).sum((-2, -1)).clamp_min(1e-300)
    fit = slope[..., None, None] * x
    spread = float(y.abs().max())
    if spread and float((fit - y).abs().max()) > 1e-3 * max(spread, 1.0):
        return None
    return slope


def alibi_slopes(e: Evidence) -> Hint | None:
    """The probabilities differ where the scores before the bias agree, and each side's bias is linear in
    the key's distance from the query with one slope per head: ALiBi's slopes differ. Both sides' slopes
    are read back and named against the standard ones: the sign flipped, the list reversed over the heads,
    the exponents counted from 0, scaled by a constant (the bias added before the 1/sqrt(d) scaling),
    none at all (a bias laid along the queries is a row constant the softmax removes), or rows of the
    batch given other heads' slopes."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.ours.shape != e.ref.shape or e.positions is None:
        return None
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    b, h, q, k = e.ref.shape
    if scores is None or scores.shape != e.ref.shape or q != k or e.positions.shape != (b, q):
        return None
    pos = e.positions.double()
    distance = (pos[:, None, None, :] - pos[:, None, :, None]).double()  # p_key - p_query
    valid = torch.ones(b, 1, q, k, dtype=torch.bool).tril()
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (b, q):
        real = e.attention_mask.bool()
        valid = valid & real[:, None, None, :] & real[:, None, :, None]
    others = [distance]
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (b, q):
        m = e.attention_mask.double()
        alt = (m.cumsum(1) - 1).clamp_min(0) * m
        others.append(alt[:, None, None, :] - alt[:, None, :, None])
    s = scores.double()
    slopes, moved = {}, {}
    for side, p in (("ours", e.ours.double()), ("the reference", e.ref.double())):
        keep = (valid & (p > 1e-30)).expand_as(p)
        log = p.clamp_min(1e-300).log() - s  # the bias plus the row's normaliser
        diag = log.diagonal(dim1=-2, dim2=-1)[..., :, None]  # the query's own key: distance 0
        slope = _slopes(log - diag, distance, keep)
        for row in range(b) if slope is None else ():  # one row's positions for the whole batch
            for d in others:  # a padding key at position 0 (BLOOM's (cumsum - 1) * mask) or 1 (generate's)
                slope = slope if slope is not None else _slopes(log - diag, d[row : row + 1].expand_as(d), keep)
            if slope is not None:
                moved[side] = row
                break
        if slope is None:
            return None
        slopes[side] = slope
    if moved:
        side, row = next(iter(moved.items()))
        other = "the reference" if side == "ours" else "ours"
        return Hint(
            "alibi",
            f"likely the ALiBi positions: {side} adds the bias at the key positions of batch row {row} in every row "
            f"(positions built from attention_mask[{row}] for the whole batch), {other} at each row's own",
            {"side": side, "row": row},
        )
    ours, ref = slopes["ours"], slopes["the reference"]
    if torch.allclose(ours, ref, rtol=1e-3, atol=1e-6):
        return None
    standard = torch.tensor(standard_slopes(h), dtype=torch.float64)
    forms = {
        "the standard slopes 2^(-8 (h + 1) / n)": standard,
        "the slopes with the sign flipped (far keys favoured)": -standard,
        "the slope list reversed over the heads": standard.flip(0),
        "the exponents counted from 0 (2^(-8 h / n))": torch.tensor(
            [2 ** (-8 * i / h) for i in range(h)], dtype=torch.float64
        ),
        "no ALiBi (slope 0: a bias along the queries is a row constant the softmax removes)": torch.zeros(
            h, dtype=torch.float64
        ),
    }

    def form_of(t: torch.Tensor) -> str | None:
        for label, value in forms.items():
            if torch.allclose(t, value.expand_as(t), rtol=1e-3, atol=1e-6):
                return label
        if bool((t[:, :1] != 0).all()):
            ratio = t / standard
            if torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio), rtol=1e-3):
                return f"the standard slopes times {float(ratio.flatten()[0]):.6g} (the bias scaled with the scores)"
        rows = [form_of_row(t[r]) for r in range(t.shape[0])]
        if len(set(rows)) > 1:
            return "other slopes per batch row (" + "; ".join(f"row {r}: {x}" for r, x in enumerate(rows)) + ")"
        return None if rows[0].startswith("slopes ") else rows[0]

    def form_of_row(row: torch.Tensor) -> str:
        for label, value in forms.items():
            if torch.allclose(row, value, rtol=1e-3, atol=1e-6):
                return label
        mine = [int((standard - v).abs().argmin()) for v in row.tolist()]
        if all(abs(float(standard[j]) - v) <= 1e-3 * abs(v) for j, v in zip(mine, row.tolist(), strict=True)):
            return f"the standard slopes in another head order ({fmt_list(mine, 8)})"
        if bool((row > 0).all()):  # 2^(-c (h + 1)): the exponent's step c = bias_max / n read back
            c = -torch.log2(row)
            step = float(c[0])
            if torch.allclose(c, step * torch.arange(1, h + 1, dtype=c.dtype), rtol=1e-3):
                named = {"n_heads": h, "head_dim": e.facts.head_dim, "hidden_size": e.facts.hidden_size}
                over = next((f" = 8 / {n} ({v})" for n, v in named.items() if v and abs(step * v / 8 - 1) < 1e-3), "")
                return f"the slopes 2^(-{step:.4g} (h + 1)) (an exponent step of {step:.4g}{over}, not 8 / n_heads)"
        return "slopes " + fmt_list((f"{v:.4g}" for v in row.tolist()), 4)

    ours_is, ref_is = form_of(ours), form_of(ref)
    shown = fmt_list((f"{v:.4g}" for v in ours[0].tolist()), 4)
    theirs = fmt_list((f"{v:.4g}" for v in ref[0].tolist()), 4)
    return Hint(
        "alibi",
        f"likely the ALiBi bias: the scores before it agree, and each side adds a bias linear in the key's distance "
        f"from the query: ours with {ours_is or 'slopes ' + shown}, the reference with {ref_is or 'slopes ' + theirs}"
        + ("" if ours_is else f" (ours' slopes per head: {shown}; the reference's: {theirs})"),
        {"ours": ours.tolist(), "reference": ref.tolist(), "ours_form": ours_is, "reference_form": ref_is},
    )


def relative_bias(e: Evidence) -> Hint | None:
    """The probabilities differ where the scores before the bias agree, and ours' bias minus the reference's
    depends on the head and the query-key distance alone (a learned relative position bias, T5's or Inkling's,
    read otherwise: its extent, what lies past it, its table's layout). Read as :func:`alibi_slopes` reads the
    bias: per row, ``log p - s`` is the bias up to the row's normaliser, taken out at distance 0. Either side."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.ours.shape != e.ref.shape or e.positions is None:
        return None
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    b, _, q, k = e.ref.shape
    if scores is None or scores.shape != e.ref.shape or q != k or e.positions.shape != (b, q) or q < 3:
        return None
    pos = e.positions.double()
    distance = (pos[:, None, :, None] - pos[:, None, None, :]).round().long()  # p_query - p_key
    valid = (e.ours.double() > 1e-30) & (e.ref.double() > 1e-30)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (b, q):
        real = e.attention_mask.bool()
        valid = valid & real[:, None, None, :] & real[:, None, :, None]
    diff = e.ours.double().clamp_min(1e-300).log() - e.ref.double().clamp_min(1e-300).log()
    diff = diff - diff.diagonal(dim1=-2, dim2=-1)[..., :, None]  # each row's normaliser out (distance 0: no bias)
    own = valid.diagonal(dim1=-2, dim2=-1)  # each query's own key: the row's reference point
    if not bool(own.all()):
        return None  # a query that cannot see itself on one side: a mask's (causal_mask's), not a bias
    valid = valid & (distance >= 0)
    if int(valid.sum()) < 4:
        return None
    per: dict[tuple[int, int], list[float]] = {}
    for bi, head, qi, ki in valid.nonzero().tolist():
        per.setdefault((head, int(distance[bi, 0, qi, ki])), []).append(float(diff[bi, head, qi, ki]))
    scale = max(abs(x) for v in per.values() for x in v)
    if scale < 1e-3:
        return None
    tol = 1e-3 * max(scale, 1.0)
    by_distance: dict[int, list[bool]] = {}
    for (_, d), v in per.items():
        by_distance.setdefault(d, []).extend(abs(x) > tol for x in v)
    if any(0 < sum(flags) < len(flags) for flags in by_distance.values()):
        return None  # the difference is not where a distance puts it
    differs = sorted(d for d, flags in by_distance.items() if all(flags))
    if not differs:
        return None
    exact = all(max(v) - min(v) <= tol for v in per.values())  # one value per head and distance, every query
    how = (
        "depends on the head and the query-key distance alone" if exact else "sits exactly at some query-key distances"
    )
    return Hint(
        "position_bias",
        f"likely the relative position bias: the scores before it agree, and ours' bias minus the reference's {how}, "
        f"from distance {differs[0]} on ({len(differs)} distances differ): its extent, what it adds past the extent "
        "(clamped to the last entry, or zero), or its table read in another layout",
        {"from_distance": differs[0], "distances": differs[:32], "by_distance_only": exact},
    )
