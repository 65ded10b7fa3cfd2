"""Detectors of table lookups: which rows of an embedding table (token or learned position) each
side read, against the ids the module was given.

A lookup's output row is a row of its table (times one constant, Gemma's ``sqrt(hidden_size)``).
Reading the table row ours returned at every token, and comparing those row numbers with the ids
the reference's module received, names the mistake: token ids shifted (``ids + 1``: a BOS or
vocabulary offset), positions shifted, reversed or counted from 0 over padding (``position_ids``
ignored), or another mapping.
"""

from __future__ import annotations

import torch

from parity.diagnose.evidence import Evidence, fmt_list
from parity.diagnose.hints import Hint

#: most table rows x looked-up tokens compared at once (a real vocabulary times a short prompt fits)
MAX_PAIRS = 2**28


def _is_lookup(kind: str) -> bool:
    return kind in ("wte", "wpe", "embed_tokens", "embed_positions", "word_embeddings", "position_embeddings")


def _rows_read(out: torch.Tensor, table: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The table row each output row equals (``(n,)``), or None when some row is no row of the table."""
    rows = out.reshape(-1, out.shape[-1]).double() / scale
    t = table.double()
    if rows.shape[0] * t.shape[0] > MAX_PAIRS:
        return None
    dist = torch.cdist(rows, t)
    best = dist.min(dim=1)
    tol = 1e-5 * (float(t.abs().max()) + float(t.norm(dim=1).mean()))  # rounding of the largest entry, of a row
    if bool((best.values > tol).any()):
        return None
    return best.indices


def embedding_rows(e: Evidence) -> Hint | None:
    """A token or position embedding whose rows on one side are the table's, read at other ids than
    the module was given (the other side reads them at the ids): ``row = table[f(id)]``. Names a
    constant shift, a reversed table, positions counted over the padding (each row shifted by its pad
    count), or lists the mapping; either side."""
    if not _is_lookup(e.kind):
        return None
    table, ids = e.ref_trace.weights.get(e.name), e.ref_trace.inputs.get(e.name)
    if table is None or ids is None or table.dim() != 2 or ids.is_floating_point() or ids.numel() == 0:
        return None
    if e.ref.shape[:-1] != ids.shape or e.ref.shape[-1] != table.shape[1]:
        return None
    ids = ids.long()
    expected = table[ids.clamp(0, table.shape[0] - 1)].double()
    keep = expected.abs() > 1e-6 * float(expected.abs().max())
    if not bool(keep.any()):
        return None
    for side, right, wrong in (("ours", e.ref, e.ours), ("the reference", e.ours, e.ref)):
        scale = float((right.double()[keep] / expected[keep]).median())  # the module's constant (Gemma: sqrt(h))
        if scale == 0 or not e.close(right, (expected * scale).to(right.dtype)):
            continue  # this side is no scaled lookup at the ids: look at the other
        read = _rows_read(wrong, table, scale)
        if read is None:
            return None
        return _mapping_hint(e, side, read.reshape(ids.shape), ids)
    return None


def _mapping_hint(e: Evidence, side: str, read: torch.Tensor, ids: torch.Tensor) -> Hint | None:
    """The hint for ``side`` reading rows ``read`` where the ids are ``ids`` (both ``(batch, seq)``)."""
    valid = torch.ones_like(ids, dtype=torch.bool)
    if e.attention_mask is not None and e.attention_mask.shape == ids.shape:
        valid = e.attention_mask.bool()
    if bool((read[valid] == ids[valid]).all()):
        return None  # the right rows: the difference is elsewhere (a scale is constant_ratio's)
    position = e.kind in ("wpe", "embed_positions", "position_embeddings")
    what = "positions" if position else "token ids"
    shift = (read - ids)[valid]
    evidence: dict[str, object] = {
        "side": side,
        "ids": ids[0].tolist()[:8],
        "rows_read": read[0].tolist()[:8],
        "table": "position" if position else "token",
    }
    kind = "position_offset" if position else "token_ids"
    if bool((shift == shift[0]).all()):
        k = int(shift[0])
        return Hint(
            kind,
            f"likely {what} off by {k:+d} in {side}: it reads row id {'+' if k > 0 else '-'} {abs(k)} of the {e.name} "
            f"table where the other side reads row id (ids {fmt_list(ids[0].tolist())}, rows read "
            f"{fmt_list(read[0].tolist())})"
            + (": position ids counted from 1, or a table offset (OPT's +2)" if position else ": a vocabulary offset"),
            {**evidence, "offset": k},
        )
    if position:
        n = ids.shape[-1]
        counted = torch.arange(n).expand_as(read)
        if e.attention_mask is not None and bool((read[valid] == counted[valid]).all()):
            pads = [int(p) for p in (e.attention_mask == 0).sum(1)]
            return Hint(
                kind,
                f"likely positions not derived from the attention mask in {side}: it reads position rows 0..{n - 1} in "
                f"every batch row, the other side each row's position_ids (pad counts {pads}): position_ids ignored "
                "(an arange over the padding)",
                {**evidence, "pad_counts": pads},
            )
        last = int(ids[valid].max())
        if bool((read[valid] == (last - ids[valid])).all()):
            return Hint(
                kind,
                f"likely the position table read in reverse in {side}: it reads row {last} - p at position p (rows "
                f"{fmt_list(read[0].tolist())})",
                {**evidence, "reversed": True},
            )
    return Hint(
        kind,
        f"likely the {what} mapped otherwise in {side}: it reads rows {fmt_list(read[0].tolist())} of the {e.name} "
        f"table where the ids are {fmt_list(ids[0].tolist())}",
        evidence,
    )
