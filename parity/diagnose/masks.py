"""Detectors of what attention may see: future keys, the sliding window, padding, a sequence
shifted by d positions."""

from __future__ import annotations

import math

import torch

from parity.diagnose.evidence import (
    Evidence,
    attention_values,
    by_position,
    call_index,
    fmt_list,
    positions_axis,
    seq_axis,
    whose,
)
from parity.diagnose.hints import Hint


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


def _first_keys(probs: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
    """Per query, the earliest key any row and head gives weight to (``(q,)``), padded rows skipped."""
    seen = probs.abs() > 0
    if valid is not None:
        seen = seen[valid.bool().all(-1)]
    if seen.numel() == 0:
        return None
    seen = seen.flatten(0, -3).any(0)  # (q, k)
    k = torch.arange(seen.shape[-1])
    return torch.where(seen, k, seen.shape[-1]).amin(-1)


def _blocked(e: Evidence, ours_w: int | None, ref_w: int | None) -> Hint | None:
    """One side attends within blocks of ``w`` (each query from its block's first key: ``floor(i / w) * w``,
    mesh-tf's local_attention_1d) where the other slides a window of ``w`` (``i - w + 1``)."""
    first = {side: _first_keys(p, e.attention_mask) for side, p in (("ours", e.ours), ("the reference", e.ref))}
    starts = {side: v for side, v in first.items() if v is not None}
    if len(starts) != 2:
        return None
    q = torch.arange(e.ours.shape[-2])
    for side, other, w in (("ours", "the reference", ours_w), ("the reference", "ours", ref_w)):
        if not w or w < 2:
            continue
        block, sliding = (q // w) * w, (q - w + 1).clamp_min(0)
        if torch.equal(starts[side], block) and torch.equal(starts[other], sliding):
            return Hint(
                "sliding_window",
                f"likely block-local attention for a sliding window: {side} lets each query see keys from the start "
                f"of its block of {w} (floor(i / {w}) * {w} .. i, local attention in blocks), {other} the {w} keys "
                f"up to it (i - {w - 1} .. i, a sliding window)",
                {"blocked": side, "window": w},
            )
    return None


def chunk_phase(e: Evidence) -> Hint | None:
    """Both sides attend within blocks (chunked attention, Llama 4's), and in a left-padded row one side counts
    its blocks from the row's first real token (``L + floor((i - L) / w) * w``) where the other counts them from
    the padded row's index 0 (``floor(i / w) * w``, kept past the padding): the chunk boundaries moved by the
    padding. The block size ``w`` is read from the side counting from index 0 in the rows without padding."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.attention_mask is None or e.ours.shape != e.ref.shape:
        return None
    mask = e.attention_mask.bool()
    b, _, q, k = e.ours.shape
    if q != k or tuple(mask.shape) != (b, k) or bool(mask.all()):
        return None
    lead = (mask.long().cumsum(-1) == 0).sum(-1)  # leading padding per row
    i = torch.arange(q)
    starts = {}
    for side, t in (("ours", e.ours), ("the reference", e.ref)):
        seen = (t.detach().cpu().abs() > 0).any(1)  # (batch, q, k): a key any head weighs
        starts[side] = torch.where(seen, torch.arange(k), k).amin(-1)  # (batch, q)
    full = [r for r in range(b) if int(lead[r]) == 0]
    if not full:
        return None
    # the block size: where the earliest key seen jumps to the query itself (a new block) in a row without padding
    first = starts["the reference"][full[0]]
    jumps = [int(x) for x in i[1:][first[1:] == i[1:]]]
    if not jumps or any(j % jumps[0] for j in jumps) or jumps[0] < 2:
        return None
    w = jumps[0]
    for side, other in (("ours", "the reference"), ("the reference", "ours")):
        moved = False
        for r in range(b):
            n = int(lead[r])
            real = i >= n
            relative = n + torch.div(i - n, w, rounding_mode="floor") * w
            absolute = torch.maximum(torch.div(i, w, rounding_mode="floor") * w, torch.tensor(n))
            if not (
                torch.equal(starts[side][r][real], relative[real])
                and torch.equal(starts[other][r][real], absolute[real])
            ):
                break
            moved |= not torch.equal(relative[real], absolute[real])
        else:
            if moved:
                return Hint(
                    "padding",
                    f"likely chunked attention's blocks counted from another start in a left-padded row: {side} starts "
                    f"each block of {w} at the row's first real token (L + floor((i - L) / {w}) * {w}), {other} at the "
                    f"padded row's index 0 (floor(i / {w}) * {w}): the chunk boundaries counted with or without the "
                    "padding",
                    {"from_first_real_token": side, "block": w},
                )
    return None


def padding_mask_inverted(e: Evidence) -> Hint | None:
    """One side's real-token queries attend the padding instead of the real keys: in a padded row they
    put most of their weight on padding keys, in a row without padding (every key masked) equal weight
    on the keys they attend (all, or those another mask left). The attention_mask inverted, or applied
    to the real tokens, on that side."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.attention_mask is None:
        return None
    real = e.attention_mask.bool()
    if real.shape != (e.ours.shape[0], e.ours.shape[-1]) or bool(real.all()):
        return None

    def inverted(p: torch.Tensor) -> bool:
        p = p.double()
        on_pads = (p * (~real)[:, None, None, :]).sum(-1)  # (batch, heads, queries)
        weighted = p > 1e-12
        low = torch.where(weighted, p, torch.full_like(p, math.inf)).amin(-1)
        uniform = (p.amax(-1) - low).abs() < 1e-6  # equal weight on every key it attends: its scores all masked
        padded_row = (~real).any(-1)[:, None, None].expand_as(on_pads)
        wrong = torch.where(padded_row, (on_pads > 0.5) | uniform, uniform)
        return bool(wrong[real[:, None, :].expand_as(wrong)].all())

    ours_bad, ref_bad = inverted(e.ours), inverted(e.ref)
    if ours_bad == ref_bad:
        return None
    side = "ours" if ours_bad else "the reference"
    return Hint(
        "padding",
        f"likely the padding mask in {side}: its real tokens attend the padding (most weight on padding keys, or "
        "equal weight on every key where a row has none), the other side's their real keys: the attention_mask "
        "inverted, or applied to the real tokens",
        {"side": side},
    )


def mask_shifted(e: Evidence) -> Hint | None:
    """The keys one side masks in a padded row are the other side's padding keys moved by a position or two
    (a key padding vector padded on the wrong side when a column is added for an attention sink or a cache
    slot, ``F.pad(mask, (1, 0))`` for ``(0, 1)``): the keys no real query gives weight to. Either side."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.attention_mask is None or e.ours.shape != e.ref.shape:
        return None
    b, _, q, k = e.ours.shape
    if q != k or tuple(e.attention_mask.shape) != (b, k):
        return None
    real = e.attention_mask.bool().to(e.ours.device)[:, None, :, None]  # the real queries, judged
    hidden = [~((t > 0) & real).any(2).any(1) for t in (e.ours, e.ref)]  # (batch, keys): no real query weighs it
    if torch.equal(hidden[0], hidden[1]) or not bool(hidden[1].any() | hidden[0].any()):
        return None
    pad = (e.attention_mask == 0).to(hidden[0].device)
    for side, mine, theirs in (("ours", hidden[0], hidden[1]), ("the reference", hidden[1], hidden[0])):
        if torch.equal(mine, pad):
            continue  # this side masks exactly the padding: the other one moved
        for shift in (1, -1, 2, -2):
            moved = torch.zeros_like(theirs)
            if shift > 0:
                moved[:, shift:] = theirs[:, :-shift]
            else:
                moved[:, :shift] = theirs[:, -shift:]
            if torch.equal(mine, moved):
                other = "the reference" if side == "ours" else "ours"
                rows = sorted(set(theirs.nonzero()[:, 0].tolist()))
                return Hint(
                    "padding",
                    f"likely the key padding mask moved by {shift:+d} in {side}: it masks the keys {other} masks "
                    f"{abs(shift)} position(s) {'later' if shift > 0 else 'earlier'} (batch rows {fmt_list(rows)}), so a "
                    "real key is masked and a padding key is not (a mask padded on the wrong side when a column is "
                    "added for an attention sink or a cache slot)",
                    {"side": side, "shift": shift, "rows": rows},
                )
    return None


def masked_keys(e: Evidence) -> Hint | None:
    """One side gives weight to earlier keys the other masks (future keys are :func:`future_keys`'):
    padding keys (the padding mask not applied) or keys before the window (the window mask not
    applied). When every such key of a query gets one same probability, the mask was applied with a
    finite fill value (``masked_fill(..., 0)``, an additive mask of 0) instead of -inf: the fill
    value ``c`` is read from the reference's scores, ``c = s_j + log(p_masked / p_j)``."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.ours.shape[-1] != e.ours.shape[-2]:
        return None
    n = e.ours.shape[-1]
    keys = torch.arange(n)
    past = keys[None, :] <= keys[:, None]  # (q, k): the keys a causal query may see
    pad_key, real_query = None, torch.ones(1, 1, n, 1, dtype=torch.bool)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (e.ours.shape[0], n):
        pad_key, real_query = (e.attention_mask == 0)[:, None, None, :], e.attention_mask.bool()[:, None, :, None]
    for side, this, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        extra = (this.abs() > 0) & (other == 0) & real_query
        if not bool(extra.any()) or bool((extra & ~past).any()):
            continue  # nothing extra, or future keys: the causal mask's detector
        on_pads = pad_key is not None and bool(extra[~pad_key.expand_as(extra)].sum() == 0)
        which = "padding mask" if on_pads else "sliding-window mask"
        kind = "padding" if on_pads else "sliding_window"
        fill = _fill_value(e, this.double(), other.double(), extra)
        if fill is None and not on_pads:
            continue  # another window size (window_pattern reads both sizes), or real keys the other side hides
        shift = _score_shift(e, this.double(), other.double(), extra) if fill is None else None
        how = (
            f"applied with the finite fill value {fill:.4g} instead of -inf (the masked scores set to {fill:.4g}, so "
            "the masked keys still get weight)"
            if fill is not None
            else f"added as a small shift: those keys keep their own scores {shift:+.4g} (a 0/1 attention_mask added "
            "to the scores as it is, where the padding needs a large negative)"
            if shift is not None and abs(shift) > 1e-3
            else "not applied (those keys keep their own scores)"
            + (
                ", or laid along the queries instead of the keys (broadcast as (batch, 1, seq, 1): the padding "
                "queries' rows, where that would show, are not judged)"
                if on_pads
                else ""
            )
        )
        if on_pads and fill is None and (shift is None or abs(shift) <= 1e-3) and _queries_masked(e, this, side):
            how = (
                "laid along the queries instead of the keys (broadcast as (batch, 1, seq, 1)): the padding queries' "
                "rows are masked whole, as the other side's are, while the real queries still see the padding keys"
            )
        hidden = ((other.abs() > 0) & (this == 0) & real_query).any(-1).any(1)  # (batch, keys) ``this`` masks wrongly
        if on_pads and e.attention_mask is not None and _right_padded(hidden, e.attention_mask):
            how = (
                "built for right padding: in each padded row it masks the last keys, as many as the row has padding "
                "(keys >= length), where the padding is on the left: the mask rebuilt from lengths, not taken from "
                "attention_mask"
            )
        elif on_pads and bool(hidden.any()) and e.attention_mask is not None:
            rows = hidden.any(-1).nonzero().flatten().tolist()
            masked = hidden[rows[0]].nonzero().flatten().tolist()
            how += (
                f", and it masks real keys the other side attends instead (batch row {rows[0]}: keys "
                f"{fmt_list(masked)}): the padding taken at the other end of the row (right padding assumed), or "
                "the mask applied along the queries"
            )
        queries = extra.any(-1).flatten(0, 1).any(0).nonzero().flatten().tolist()
        return Hint(
            kind,
            f"likely the {which} in {side}: {side} gives weight to {int(extra.sum())} earlier "
            f"{'padding ' if on_pads else 'out-of-window '}keys the other side masks (queries {fmt_list(queries)}): the "
            f"mask {how}",
            {"side": side, "entries": int(extra.sum()), "fill_value": fill, "mask": which},
        )
    return None


def _queries_masked(e: Evidence, this: torch.Tensor, side: str) -> bool:
    """The padding queries' rows of ``this`` (``side``'s) are masked whole (equal weight on every key they
    weight, where that side's own scores over those keys differ) while its real queries see padding keys:
    the padding mask applied along the query axis. A mask not applied leaves those rows a plain softmax."""
    if e.attention_mask is None:
        return False
    pad_query = (e.attention_mask == 0)[:, None, :].expand(this.shape[:-1]).cpu()
    trace = e.ours_trace if side == "ours" else e.ref_trace
    scores = trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    if not bool(pad_query.any()) or scores is None or scores.shape != this.shape:
        return False
    p = this.double()[pad_query]  # (rows, keys)
    weighted = p > 0
    rows = weighted.sum(-1) >= 2
    if not bool(rows.any()):
        return False
    p, weighted, s = p[rows], weighted[rows], scores.double()[pad_query][rows]
    uniform = (p.amax(-1) - torch.where(weighted, p, torch.ones_like(p)).amin(-1)).abs() <= 1e-6 * p.amax(-1)
    # identical padding tokens at one position (generation gives them all position 1) score alike: a row
    # over them reads uniform whether masked or not, and proves nothing
    spread = torch.where(weighted, s, -math.inf).amax(-1) - torch.where(weighted, s, math.inf).amin(-1)
    varied = spread > 1e-4 * max(1.0, float(s.abs().max()))
    return bool(varied.any()) and bool(uniform[varied].all())


def _right_padded(hidden: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Every padded row hides exactly its last ``n_pad`` keys (``hidden`` ``(batch, keys)``, the real keys
    one side masks): a padding mask built as if the padding were on the right."""
    pads = (attention_mask == 0).sum(-1)
    if not bool((pads > 0).any()):
        return False
    n = hidden.shape[-1]
    tail = torch.arange(n)[None, :] >= (n - pads)[:, None]
    return bool(torch.equal(hidden.cpu(), tail & (pads > 0)[:, None]))


def _extra_scores(
    e: Evidence, p: torch.Tensor, other: torch.Tensor, extra: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(given, own)`` at the ``extra`` keys of ``p`` (in rows that have any): the score each got in ``p``,
    read against the reference's scores (per row, ``log p_j - s_j`` is one constant, the row's
    log-normaliser, over the keys both sides weight), and the reference's own score there; None without
    the reference's scores."""
    scores = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + ".scores")
    if scores is None or scores.shape != p.shape:
        return None
    s = scores.double()
    both = (p > 0) & (other > 0)  # keys both sides weight: their scores are the reference's
    rows = extra.any(-1) & both.any(-1)
    if not bool(rows.any()):
        return None
    cap = e.facts.attn_softcap
    if cap:  # scores read before an attention soft-cap: the softmax reads them capped, cap * tanh(s / cap)
        capped = cap * torch.tanh(s / cap)
        spread = [
            float(torch.where(both, p.clamp_min(1e-300).log() - t, torch.nan).nan_to_num(0).std(-1).amax())
            for t in (s, capped)
        ]
        s = capped if spread[1] < spread[0] else s
    offset = torch.where(both, p.clamp_min(1e-300).log() - s, torch.nan).nanmean(-1, keepdim=True)
    where = extra & rows.unsqueeze(-1)
    given = (p.clamp_min(1e-300).log() - offset)[where]
    keep = torch.isfinite(given)
    return given[keep], s[where][keep]


def _one_value(t: torch.Tensor) -> float | None:
    """The one value every element of ``t`` holds (to 1e-3 relative), or None."""
    if t.numel() == 0 or float(t.max() - t.min()) > 1e-3 * max(1.0, float(t.abs().max())):
        return None
    return float(t.mean())


def _score_shift(e: Evidence, p: torch.Tensor, other: torch.Tensor, extra: torch.Tensor) -> float | None:
    """The one amount every extra key's own score was shifted by in ``p``, read against the reference's
    scores (an additive 0/1 mask: -1 relative to the real keys), or None."""
    found = _extra_scores(e, p, other, extra)
    return _one_value(found[0] - found[1]) if found is not None else None


def _fill_value(e: Evidence, p: torch.Tensor, other: torch.Tensor, extra: torch.Tensor) -> float | None:
    """The one score every extra key of ``p`` got, read against the reference's scores, or None."""
    found = _extra_scores(e, p, other, extra)
    value = _one_value(found[0]) if found is not None else None
    return None if value is None else value if abs(value) > 1e-6 else 0.0


def _gapped(probs: torch.Tensor, valid: torch.Tensor | None) -> bool:
    """Whether some query of ``probs`` ``(b, h, q, k)`` gives no weight to a real earlier key between the first
    key it reads and itself: a mask with holes (key blocks chosen per query), no window, causal or chunk
    (each of those keeps a contiguous run of keys ending at the query)."""
    seen = probs.abs() > 0
    n, m = seen.shape[-2], seen.shape[-1]
    if n != m:
        return False
    real = torch.ones(seen.shape[0], m, dtype=torch.bool)
    if valid is not None and tuple(valid.shape) == (seen.shape[0], m):
        real = valid.bool().cpu()
    keys = torch.arange(m)
    rows = real[:, None, :, None] & real[:, None, None, :]  # real queries, real keys
    later = keys[None, :] <= torch.arange(n)[:, None]  # (q, k): the key at or before the query
    # keys every real query at or after them reads (a window that keeps the first token, StreamingLLM's sink): no
    # part of a per-query choice, left out before the holes are looked for
    kept = (seen | ~(later & rows)).all(-2, keepdim=True)  # (b, h, 1, k)
    chosen = seen & ~kept
    first = torch.where(chosen, keys, m).amin(-1, keepdim=True)  # (b, h, q, 1)
    inside = (keys >= first) & later  # between its first chosen key and itself
    return bool((inside & ~seen & ~kept & rows).any())


def sparse_selection(e: Evidence) -> Hint | None:
    """The two sides keep other keys where at least one side's mask has holes: a dynamic sparse attention (a
    lightning indexer's or a top-k's chosen key blocks, MiniMax-M3's, DeepSeek's sparse attention) chose
    otherwise. Named by the kept keys that differ; a window, causal or padding mask (contiguous) is read by the
    detectors after it."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.ours.shape != e.ref.shape:
        return None
    holes = [side for side, p in (("ours", e.ours), ("the reference", e.ref)) if _gapped(p, e.attention_mask)]
    if not holes:
        return None
    seen_ours, seen_ref = e.ours.abs() > 0, e.ref.abs() > 0
    keys, queries = torch.arange(e.ref.shape[-1]), torch.arange(e.ref.shape[-2])[:, None]
    real = torch.ones(e.ref.shape[0], e.ref.shape[-1], dtype=torch.bool)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == tuple(real.shape):
        real = e.attention_mask.bool().cpu()
    rows = real[:, None, :, None] & real[:, None, None, :]
    if bool(((seen_ours | seen_ref) & (keys > queries) & real[:, None, :, None]).any()):
        return None  # a real query reading a key after it: the causal mask's detectors
    only_ours, only_ref = seen_ours & ~seen_ref & rows, seen_ref & ~seen_ours & rows
    if not bool(only_ours.any() or only_ref.any()):
        return None
    stem = e.name.rsplit(".", 1)[0]
    words = ("index", "select", "topk")
    parts = next(
        (n.split(".") for n in e.ref_trace.tensors if n.startswith(stem + ".") and any(w in n for w in words)), None
    )
    selector = None
    if parts is not None:  # the module holding the selection (its q_proj a node of it): up to the part naming it
        selector = ".".join(parts[: next(i for i, p in enumerate(parts) if any(w in p for w in words)) + 1])
    bad = (only_ours | only_ref).any(-1).flatten(0, 1).any(0).nonzero().flatten().tolist()
    chooser = f"{selector}'s" if selector else "the attention's dynamic"
    masks = "ours' and the reference's masks have" if len(holes) == 2 else f"{whose(holes[0])} mask has"
    return Hint(
        "sparse_selection",
        f"likely the keys {chooser} key selection keeps: {masks} holes (key blocks chosen per "
        f"query, no window), and ours reads {int(only_ours.sum())} earlier keys the reference masks, the reference "
        f"{int(only_ref.sum())} ours masks (queries {fmt_list(bad)}): the selection's scores, its causal mask, "
        "its local blocks or the positions it reads differ",
        {
            "side": holes[0],
            "selector": selector,
            "ours_only": int(only_ours.sum()),
            "reference_only": int(only_ref.sum()),
        },
    )


def future_keys(e: Evidence) -> Hint | None:
    """Ours gives weight to keys the reference masks, later than the last key the reference lets each
    query see: the causal mask lets a query see the future (a decode-time mask off by one, a chunk
    attending to all of itself)."""
    if e.kind != "probs" or e.ours.dim() != 4:
        return None
    diagonal = _diagonal_hidden(e)
    if diagonal is not None:
        return diagonal
    keys = torch.arange(e.ref.shape[-1])
    for side, this, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        seen_this, seen_other = this.abs() > 0, other.abs() > 0
        last = torch.where(seen_other, keys, torch.full_like(keys, -1)).amax(-1, keepdim=True)  # per query row
        future = seen_this & ~seen_other & (keys > last)
        if not bool(future.any()):
            continue
        rows = future.any(-1).flatten(0, 1).any(0).nonzero().flatten().tolist()
        offending = future.any(-1)  # (batch, heads, queries)
        p = this.double()
        uniform = (p.amax(-1) - p.amin(-1)).abs() <= 1e-9 * p.amax(-1)  # every key the same weight: none unmasked
        if bool(uniform[offending].all()):
            batch_rows = offending.flatten(1).any(-1).nonzero().flatten().tolist()
            return Hint(
                "padding",
                f"likely a mask in {side} that hides every key of some queries (batch rows {fmt_list(batch_rows)}, "
                f"queries {fmt_list(rows)}): their weights are uniform over all keys, future ones included, as a "
                "softmax over scores all masked gives; another row's padding mask applied to this row, or a mask "
                "built for other positions",
                {"side": side, "batch_rows": batch_rows, "queries": rows[:32]},
            )
        extra = seen_this & ~seen_other
        fill = _fill_value(e, this.double(), other.double(), extra)
        cap = e.facts.attn_softcap
        if fill is not None and cap and abs(fill / cap + 1) < 1e-3:  # the fill capped: masked before the cap
            return Hint(
                "softcap",
                f"likely the mask in {side} applied before the attention soft-cap: every key the other side masks "
                f"({int(extra.sum())} entries, future keys included) gets the score {fill:.4g} = -cap, the cap's "
                f"{cap:g} * tanh(s / {cap:g}) of the mask's large negative fill, so masked keys keep weight e^-{cap:g}; "
                "cap the scores first, then mask (the config: attn_logit_softcapping "
                f"{cap:g})",
                {"side": side, "entries": int(extra.sum()), "fill_value": fill, "cap": cap},
            )
        if fill is not None:  # every masked key got one same score: the mask's fill value is finite
            return Hint(
                "causal_mask",
                f"likely the mask in {side} applied with the finite fill value {fill:.4g} instead of -inf: {side} "
                f"gives every key the other side masks ({int(extra.sum())} entries, future keys included) the score "
                f"{fill:.4g}, so masked keys still get weight",
                {"side": side, "entries": int(extra.sum()), "fill_value": fill, "queries": rows[:32]},
            )
        other_side = "the reference" if side == "ours" else "ours"
        queries = torch.arange(this.shape[-2])[:, None] + (this.shape[-1] - this.shape[-2])  # each query's position
        if not bool((future & (keys > queries)).any()):  # none after the query itself: a window, not causality
            return Hint(
                "sliding_window",
                f"likely a key mask one side applies and the other does not: {side} gives weight to earlier keys "
                f"{other_side} masks ({int(extra.sum())} entries, none after the query itself; queries "
                f"{fmt_list(rows)}): a sliding window, a kept-keys top-k or a dynamic mask missing in {side}, or "
                f"one {other_side} applies by mistake",
                {"side": side, "entries": int(extra.sum()), "queries": rows[:32]},
            )
        return Hint(
            "causal_mask",
            f"likely the causal mask in {side}: {side} gives weight to keys after the last one {other_side} lets a "
            f"query see ({int(future.sum())} entries; queries {fmt_list(rows)}), so a query reads the future",
            {"side": side, "entries": int(future.sum()), "queries": rows[:32]},
        )
    return None


def _diagonal_hidden(e: Evidence) -> Hint | None:
    """One side's causal mask hides each query's own key (``k < q`` where the mask needs ``k <= q``: ``triu``
    with diagonal 0 where 1 is meant): from the second query on it gives no weight to the key at the
    query's position while the other side does, and the keys before it are the other side's; the first
    query, with no key left, spreads its weight evenly (a softmax over scores all masked)."""
    n = e.ours.shape[-1]
    if e.ours.shape[-2] != n or n < 3:
        return None
    real = torch.ones(e.ours.shape[0], n, dtype=torch.bool)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (e.ours.shape[0], n):
        real = e.attention_mask.bool().cpu()
    first = real.int().argmax(-1)  # each row's first real position
    for side, this, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        own = this.diagonal(dim1=-2, dim2=-1)  # (batch, heads, q): each query's weight on its own key
        theirs = other.diagonal(dim1=-2, dim2=-1)
        later = real & (torch.arange(n)[None, :] > first[:, None])  # real queries with an earlier real key
        if not bool(later.any()):
            continue
        sel = later[:, None, :].expand_as(own)
        if not (bool((own[sel] == 0).all()) and bool((theirs[sel] > 0).all())):
            continue
        earlier = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1)  # keys strictly before the query
        both = (this.abs() > 0) & earlier & real[:, None, :, None] & real[:, None, None, :]
        seen_other = (other.abs() > 0) & earlier & real[:, None, :, None] & real[:, None, None, :]
        if not torch.equal(both, seen_other):
            continue
        return Hint(
            "causal_mask",
            f"likely the causal mask in {side} hides each query's own key: from the second token on, {side} gives "
            "the key at the query's own position no weight and the earlier keys as the other side does (a mask of "
            "k < q where k <= q is meant: triu(..., diagonal=0) where diagonal=1 is meant); the first query, left "
            "with no key, spreads its weight evenly",
            {"side": side, "diagonal_hidden": True},
        )
    return None


def _layer_type_read_otherwise(e: Evidence, ours_w: int | None, ref_w: int | None) -> str:
    """``; this sliding_attention layer ...``: one side windowless at a layer the config's layer types make sliding,
    or windowed at a full one, while layers of the other type exist: the layer pattern read otherwise, else ``""``."""
    layer = e.facts.layer(e.result.layer)
    if layer is None or (ours_w is None) == (ref_w is None):
        return ""
    others = sorted({n.layer_type for n in e.facts.layers if n.layer_type != layer.layer_type and n.layer_type})
    if not others or not layer.layer_type:
        return ""
    side = "ours" if (ours_w is None) == (layer.window is not None) else "the reference"
    return (
        f"; this is a {layer.layer_type} layer in the config, and {side} attends as its {', '.join(others)} layers "
        "do: the layer pattern (config.layer_types, or the rule deriving it) read otherwise"
    )


def window_pattern(e: Evidence) -> Hint | None:
    """Only the query positions from some point up to the window on differ: the first position
    that can see a key the window decides about (the smaller of ours' and the reference's window),
    at 2 or later (positions 0 and 1 agree under most attention bugs, a softmax in float16, RoPE on
    the values: that is no window's evidence)."""
    if e.kind not in ("probs", "context", "scores"):
        return None
    if e.kind == "probs" and e.ours.dim() == 4 and e.ours.shape[-1] == e.ours.shape[-2]:
        ours_w, ref_w = _window_of(e.ours, e.attention_mask), _window_of(e.ref, e.attention_mask)
        blocked = _blocked(e, ours_w, ref_w)
        if blocked is not None:
            return blocked
        if ours_w != ref_w:
            show = lambda w: "full causal attention" if w is None else f"a window of {w}"
            return Hint(
                "sliding_window",
                f"likely the sliding window size or mask: ours attends with {show(ours_w)}, the reference with "
                f"{show(ref_w)} (read from which keys get any weight){_layer_type_read_otherwise(e, ours_w, ref_w)}",
                {"ours": ours_w, "reference": ref_w},
            )
    layer = e.facts.layer(e.result.layer)
    window = (layer.window if layer is not None else None) or e.facts.sliding_window
    axis = seq_axis(e.kind)
    if not window or e.ours.dim() <= axis or e.ours.shape[axis] <= window:
        return None
    per_pos = by_position(e.ours, e.ref, axis)
    bad = (per_pos > e.noise).nonzero().flatten().tolist()
    # position 0 (one key) and 1 (two) agree under most attention bugs: a window is told from the first
    # query that can see past the smaller window, so at least the first two positions must agree
    if bad and 2 <= min(bad) <= window:
        mine = layer.window if layer is not None else None
        ref = f"the reference's window here is {mine}" if mine else "the reference attends to every earlier key here"
        return Hint(
            "sliding_window",
            f"likely the sliding window size or mask: positions < {bad[0]} agree, positions {bad[0]}..{bad[-1]} "
            f"differ (max error {float(per_pos.max()):.3g}); {ref}",
            {"window": mine, "first_bad_position": bad[0]},
        )
    return None


def sequence_shift(e: Evidence) -> Hint | None:
    """Ours at position ``t`` holds the reference's value at ``t + d`` (``d != 0``) wherever both
    exist: a causal convolution padded on the wrong side (it reads the future), a token shift, an
    off-by-one in the sequence."""
    axis = positions_axis(e)
    if axis is None or e.ours.shape[axis] < 3:
        return None
    ours, ref = e.ours.movedim(axis, 0), e.ref.movedim(axis, 0)
    seq = ours.shape[0]
    for d in sorted((d for d in range(-min(8, seq - 2), min(8, seq - 2) + 1) if d), key=lambda d: (abs(d), d < 0)):
        mine, theirs = ours[max(0, -d) : seq - max(0, d)], ref[max(0, d) : seq + min(0, d)]
        if e.close(mine, theirs):
            later = (
                f"{d} position{'s' if abs(d) > 1 else ''} later"
                if d > 0
                else f"{-d} position{'s' if -d > 1 else ''} earlier"
            )
            return Hint(
                "sequence_shift",
                f"likely a shift along the sequence: ours at each position equals the reference {later} (on the "
                f"{mine.shape[0]} of {seq} positions both have); a causal convolution padded on the wrong side reads "
                "the future, or a token shift / position off by one",
                {"shift": d, "positions": int(mine.shape[0])},
            )
    return None


#: at most this many tokens are matched one against the other (a pairwise distance per pair)
_MOVED_TOKENS = 4096


def _moved(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``(moved, nearest, at_front)`` when ``a``'s real tokens (rows of ``(tokens, features)``) hold ``b``'s
    values of other real tokens: every one that differs where it is, but those never written (zeros); None
    otherwise. ``at_front``: ``a``'s real position ``p < n`` holds ``b``'s ``p``-th real token."""
    distance = torch.cdist(a[real], b[real])
    nearest = distance.argmin(-1)
    scale = b[real].norm(dim=-1).clamp_min(1e-30)
    matched = distance.gather(-1, nearest[:, None])[:, 0] <= 1e-3 * scale[nearest]
    moved = matched & (nearest != torch.arange(len(real)))
    # a few look-alikes among many differing tokens are no placement
    differs = (a[real] - b[real]).norm(dim=-1) > 1e-3 * scale
    written = a[real].abs().amax(-1) > 0  # a position nothing was written back to holds zeros
    if not bool(moved.any()) or int((differs & ~moved & written).sum()) > 0.1 * int(differs.sum()):
        return None
    inside = real[real < len(real)]
    front = (a[inside] - b[real[inside]]).norm(dim=-1) <= 1e-3 * b[real[inside]].norm(dim=-1).clamp_min(1e-30)
    return moved, nearest, bool(front.all())


def tokens_moved(e: Evidence) -> Hint | None:
    """One side's real tokens hold the other side's values of other tokens (each matched to one within a
    relative 1e-3, some of them elsewhere): results computed on the real tokens alone (padding dropped, a
    sort) written back to the wrong positions; named as the front of the batch when that side's ``i``-th
    flat position holds the ``i``-th real token. Either side."""
    if e.attention_mask is None or e.ours.shape != e.ref.shape or e.ours.dim() < 2 or e.kind in ("scores", "probs"):
        return None
    mask = e.attention_mask.to("cpu").bool()
    tokens = mask.numel()
    if e.ours.numel() % tokens or e.ours.shape[0] not in (mask.shape[0], tokens) or tokens > _MOVED_TOKENS:
        return None
    ours, ref = e.ours.double().reshape(tokens, -1), e.ref.double().reshape(tokens, -1)
    real = mask.flatten().nonzero().flatten()
    for side, a, b in (("ours", ours, ref), ("the reference", ref, ours)):
        found = _moved(a, b, real)
        if found is None:
            continue
        moved, nearest, at_front = found
        other = "the reference" if side == "ours" else "ours"
        pairs = fmt_list([f"{int(real[i])} <- {int(real[int(nearest[i])])}" for i in moved.nonzero().flatten()[:4]], 4)
        how = (
            f"{side}'s first {len(real)} flat positions hold the real tokens in order: results computed on the real "
            "tokens alone (padding dropped) written back at the front, not at the real tokens' positions"
            if at_front
            else "results computed on the tokens in another order (padding dropped, sorted) written back to other "
            "positions"
        )
        return Hint(
            "padding",
            f"likely tokens written back to the wrong positions in {side}: {int(moved.sum())} of its {len(real)} real "
            f"tokens hold another token's value (flat position <- {other}'s: {pairs}); {how}",
            {"side": side, "moved": int(moved.sum()), "at_front": at_front},
        )
    return None


def padding(e: Evidence) -> Hint | None:
    """Every differing position is padding (the run's ``attention_mask`` is 0 there) and some padding
    differs: the two sides treat padding differently. A linear-attention layer must zero its padding
    before anything reads it, in every call: padding in a chunk that continues a cache leaks into the
    state otherwise (the reference's mask covers each call's own tokens)."""
    axis = positions_axis(e)
    if (
        axis is None
        or e.positions is None
        or e.attention_mask is None
        or tuple(e.attention_mask.shape) != tuple(e.positions.shape)
    ):
        return None
    diff = (e.ours.double() - e.ref.double()).abs().movedim(axis, 1)
    bad = diff.reshape(*diff.shape[:2], -1).amax(-1) > e.noise  # (batch, seq)
    pad = e.attention_mask.to(bad.device) == 0
    if not bool(bad.any()) or bool((bad & ~pad).any()):
        return None
    rows, cols = bad.nonzero(as_tuple=True)
    zero = bool((e.ref.movedim(axis, 1)[pad] == 0).all())
    where = f"padding tokens at batch rows {fmt_list(sorted(set(rows.tolist())))}, positions {fmt_list(sorted(set(cols.tolist())))}"
    call = call_index(e.name)
    continuing = f" (a call continuing the cache: step {call})" if call else ""
    treat = "zeroes them" if zero else "treats them otherwise"
    return Hint(
        "padding",
        f"likely padding that is not masked: only padding tokens differ ({where}{continuing}); the reference {treat}. "
        "If ours derives positions itself, its padding tokens get other positions than the reference's (generation "
        "gives them position 1): take position_ids in forward (forward(input_ids, attention_mask, position_ids)) "
        "and parity passes the reference's. A linear-attention layer must zero its padding in every call, a chunk "
        "continuing a cache included, or the padding writes into the conv and the recurrent state",
        {
            "batch_rows": sorted(set(rows.tolist())),
            "positions": sorted(set(cols.tolist())),
            "reference_zero": zero,
            "step": call,
        },
    )


def attention_dropout(e: Evidence) -> Hint | None:
    """The context is the probabilities times the values with some probabilities dropped and the rest
    scaled by ``1 / (1 - p)``: attention dropout left on (a module in train mode, or ``dropout_p`` given
    to ``scaled_dot_product_attention`` outside training), on either side. Read back per query from
    each side's context as the weights on the reference's values against the reference's
    probabilities (exact while a query sees no more keys than ``head_dim``)."""
    if e.kind == "probs" and e.ours.shape == e.ref.shape:  # the probabilities recorded after the dropout
        for side, dropped_side, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
            keep = other.double() > 1e-4
            rate = dropout_pattern((dropped_side.double()[keep] / other.double()[keep]).flatten())
            if rate is not None:
                return _dropout_hint(side, rate[0], rate[1], "probabilities")
        return None
    if e.kind != "context" or e.result.layer is None:
        return None
    found = attention_values(e)
    if found is None:
        return None
    probs, v = found
    b, h, t, _ = probs.shape
    d = v.shape[-1]
    if e.ours.numel() != b * h * t * d:
        return None
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    for side, context in (("ours", e.ours), ("the reference", e.ref)):
        rate = _dropout_rate(context.double(), probs.double(), v, h, t, d)
        if rate is not None:
            return _dropout_hint(side, rate[0], rate[1], "context")
    return None


def dropout_elementwise(e: Evidence) -> Hint | None:
    """Ours / reference element by element is 0 or one ``k > 1`` (dropout's mask, scaled by ``1 / (1 -
    p)``) on either side: a dropout left on outside training (``F.dropout``'s ``training=True`` default,
    ``nn.Dropout`` in a model left in train mode) on an activation, not on the attention."""
    if e.kind in ("probs", "context") or e.ours.shape != e.ref.shape or e.ref.numel() < 64:
        return None
    for side, dropped_side, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        o = other.double()
        keep = o.abs() > 1e-3 * float(o.abs().max())
        rate = dropout_pattern((dropped_side.double()[keep] / o[keep]).flatten())
        if rate is not None:
            return dropout_left_on(side, rate[0], rate[1], f"{e.kind} (element by element)")
    return None


def dropout_left_on(side: str, k: float, dropped: float, where: str) -> Hint:
    """The hint for a dropout (not of the attention) left on in ``side`` at ``where``."""
    return Hint(
        "dropout",
        f"likely dropout left on in {side} at {where}: {dropped:.0%} of the values are zeroed and the rest scaled by "
        f"{k:.4g} = 1 / (1 - p), p = {1 - 1 / k:.3g} (F.dropout's training=True default, or a module in train mode)",
        {"p": 1 - 1 / k, "dropped": dropped, "side": side},
    )


def _dropout_hint(side: str, k: float, dropped: float, where: str) -> Hint:
    what = (
        "its probabilities are the other side's"
        if where == "probabilities"
        else "its context weights the values by the probabilities"
    )
    return Hint(
        "dropout",
        f"likely attention dropout left on in {side}: {what} with {dropped:.0%} of them dropped and the rest scaled by "
        f"{k:.4g} = 1 / (1 - p), p = {1 - 1 / k:.3g} (eval mode, or dropout_p=0 outside training)",
        {"p": 1 - 1 / k, "dropped": dropped, "side": side},
    )


def dropout_pattern(r: torch.Tensor) -> tuple[float, float] | None:
    """``(k, fraction dropped)`` when the ratios ``r`` are 0 or one ``k > 1``: a dropout's mask, scaled."""
    if r.numel() < 8:
        return None
    dropped = r.abs() < 1e-3
    kept = r[~dropped]
    if not 0.01 <= float(dropped.double().mean()) <= 0.9 or kept.numel() < 4:
        return None
    k = float(kept.median())
    if k <= 1 or float(((kept - k).abs() / k).max()) > 1e-3:
        return None
    return k, float(dropped.double().mean())


def _dropout_rate(ctx: torch.Tensor, probs: torch.Tensor, v: torch.Tensor, h: int, t: int, d: int):
    """``(1 / (1 - p), fraction dropped)`` when ``ctx`` is ``dropout(probs) @ v``, else None."""
    b = probs.shape[0]
    if ctx.dim() == 3 or (ctx.dim() == 4 and ctx.shape[1] == t and ctx.shape[1] != h):  # (b, t, h * d) or (b, t, h, d)
        ctx = ctx.reshape(b, t, h, d).transpose(1, 2)
    ratios = []
    for i in range(min(t, d)):  # a query that sees i + 1 keys: its weights are solvable from d equations
        keys = v[:, :, : i + 1, :].transpose(-1, -2)  # (b, h, d, i + 1)
        weights = torch.linalg.lstsq(keys, ctx[:, :, i, :, None]).solution[..., 0]  # (b, h, i + 1)
        p = probs[:, :, i, : i + 1]
        keep = p > 1e-4
        ratios.append((weights[keep] / p[keep]).flatten())
    return dropout_pattern(torch.cat(ratios) if ratios else torch.zeros(0))
