"""Multi-head latent attention (MLA) read at its rotated q and k: which rows of the up-projections a side
cuts each head from, and which RoPE pairs it rotates in the checkpoint's order.

The operator (DeepSeek-V2, arXiv:2405.04434 section 2.1; Transformers' ``DeepseekV3Attention`` and
``LongcatFlashMLA``): each head of q is ``cat(q_nope, q_rope)`` cut from ``q_b_proj`` (``q_proj``), each head
of k is ``cat(k_nope, k_rope)`` with ``k_nope`` cut from ``kv_b_proj``'s per-head ``[k_nope | v]`` and one
``k_rope`` shared by all heads, the last ``qk_rope_head_dim`` columns of ``kv_a_proj_with_mqa``. The generic
detectors see the head whole: a RoPE pairing read over ``q_nope`` too, a cut of ``kv_b_proj``'s output that is
no fused q/k/v layout. These read the two parts apart.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from parity.diagnose.evidence import Evidence, cut_offset, reference_output
from parity.diagnose.hints import Hint
from parity.diagnose.rope import _pairing, rope_fit, rope_pattern, rope_tables
from parity.model.facts_rules import MLA_INTERLEAVED_ROPE, ROTATED_LAST

#: the projection whose output holds each side's input to RoPE, by node kind, in the order tried
_ROPE_SOURCES = {"q_rot": ("q_b_proj", "q_proj", "q_gate_proj"), "k_rot": ("kv_a_proj_with_mqa",)}


def _widths(e: Evidence) -> tuple[int, int] | None:
    """``(nope, rope)`` widths of each head at an MLA q_rot/k_rot node ``(batch, heads, seq, nope + rope)``."""
    layer = e.facts.layer(e.result.layer)
    if ROTATED_LAST not in e.facts.features or layer is None or layer.rope is None:
        return None
    if e.kind not in _ROPE_SOURCES or e.ours.dim() != 4 or e.ours.shape != e.ref.shape:
        return None
    rope = layer.rope.rotary_dim
    nope = e.ours.shape[-1] - rope
    return (nope, rope) if rope >= 4 and rope % 2 == 0 and nope > 0 else None


def _rope_input(e: Evidence, nope: int, rope: int) -> torch.Tensor | None:
    """The reference's input to RoPE ``(batch, heads, seq, rope)`` in the checkpoint's row order: the tail of
    each q head of ``q_b_proj``'s output (of each head's q, its first ``nope + rope`` dims, where the projection
    holds a gate after them: A.X-K2's ``q_gate_proj``), or k's shared tail, ``kv_a_proj_with_mqa``'s last ``rope``
    columns."""
    stem = e.name.rsplit(".", 1)[0]
    b, heads, seq, d = e.ref.shape
    for source in _ROPE_SOURCES[e.kind]:
        y = reference_output(e, f"{stem}.{source}")
        if y is None or y.dim() < 3 or y.shape[-2] != seq:
            continue
        y = y.reshape(b, seq, y.shape[-1])
        if e.kind == "q_rot" and y.shape[-1] % heads == 0 and y.shape[-1] // heads >= d:
            return y.unflatten(-1, (heads, -1)).transpose(1, 2)[..., nope:d]
        if e.kind == "k_rot" and y.shape[-1] > rope:
            return y[..., -rope:][:, None].expand(b, heads, seq, rope)
    return None


def _order_at_start(e: Evidence, tail: torch.Tensor, x: torch.Tensor, orders: list[list[int]]) -> list[int] | None:
    """The order of ``x``'s dims that ``tail`` holds at position 0 (RoPE turns nothing there), up to a
    scale (LongCat's LoRA scale): the identity, or the halves Transformers makes of interleaved rope rows."""
    if e.positions is None or e.positions.shape != (tail.shape[0], tail.shape[2]):
        return None
    start = e.positions == 0
    if not bool(start.any()):
        return None
    a = tail.double().transpose(1, 2)[start].flatten(0, -2)
    for order in orders:
        b = x.transpose(1, 2)[start].flatten(0, -2)[..., order]
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)
        if bool((cos > 1 - 1e-6).all()):
            return order
    return None


def _tail(e: Evidence) -> tuple[int, int, torch.Tensor, list[list[int]]] | None:
    """``(nope, rope, the reference's input to RoPE in the checkpoint's order, the orders its rotated tail may
    hold)``: the identity and the halves Transformers makes of interleaved rope rows, the facts' likelier first."""
    widths = _widths(e)
    x = _rope_input(e, *widths) if widths is not None else None
    if widths is None or x is None:
        return None
    rope = widths[1]
    halves = [*range(0, rope, 2), *range(1, rope, 2)]
    orders = [halves, list(range(rope))] if MLA_INTERLEAVED_ROPE in e.facts.features else [list(range(rope)), halves]
    return widths[0], rope, x, orders


def latent_pairing(e: Evidence) -> Hint | None:
    """An MLA head's rotated tail turned with other RoPE pairs than the reference's, both read in the
    checkpoint's row order: (i, i + r/2) on one side, (2i, 2i + 1) on the other (``rope_interleave``: the
    rope rows hold interleaved pairs, which Transformers reorders into halves before rotating; a port that
    rotates halves of the rows as stored pairs them wrongly). Either side."""
    found = _tail(e)
    if found is None:
        return None
    nope, rope, x, orders = found
    pairs = {}
    for side, t in (("ours", e.ours), ("reference", e.ref)):
        tail = t[..., nope:]
        order = _order_at_start(e, tail, x, orders)
        if order is None:
            return None
        raw = torch.empty_like(tail)
        raw[..., order] = tail  # back into the checkpoint's order
        pairs[side] = _pairing(raw, x)
    if not pairs["ours"] or not pairs["reference"] or pairs["ours"] == pairs["reference"]:
        return None
    return Hint(
        "rope_pairing",
        f"likely RoPE pairing layout of the latent attention's rotated dims (the last {rope} of each "
        f"{e.kind[0]} head, in the checkpoint's row order): ours rotates {pairs['ours']} pairs, the reference "
        f"{pairs['reference']}"
        + (
            " (the checkpoint's rope rows hold interleaved pairs, which the reference reorders into halves before "
            "rotate_half: rope_interleave)"
            if MLA_INTERLEAVED_ROPE in e.facts.features
            else ""
        ),
        {"ours": pairs["ours"], "reference": pairs["reference"], "rotary_dims": rope},
    )


def latent_rope(e: Evidence) -> Hint | None:
    """The RoPE fits (another theta, the unscaled or another layer type's frequencies, tables laid out for other
    pairs) read on an MLA head's rotated tail alone: both sides' tails against the reference's input to RoPE in
    the order the reference rotates it (its halves of interleaved rope rows). Either side, as the fits are."""
    found = _tail(e)
    if found is None:
        return None
    nope, rope, x, orders = found
    ours_tail, ref_tail = e.ours[..., nope:].double(), e.ref[..., nope:].double()
    order = _order_at_start(e, ref_tail, x, orders)
    if order is None:
        return None
    # ours' tail in another order than the reference's: the pairing reading says it; or ours rotates some row's
    # first token at another position (one row's positions for the whole batch): only a position fit names it
    positions_only = _order_at_start(e, ours_tail, x, [order]) is None
    factor = float((ours_tail * ref_tail).sum() / ref_tail.pow(2).sum().clamp_min(1e-300))
    if e.close(ours_tail, factor * ref_tail):
        return None  # one constant apart: a scale on the rotated dims (channel_ratio reads it), not RoPE
    # the reference's own factor before RoPE (LongCat's LoRA scale), read where RoPE turns nothing: position 0
    assert e.positions is not None  # _order_at_start found position 0
    start = e.positions == 0
    x = x[..., order]
    at_start, seen = x.transpose(1, 2)[start], ref_tail.transpose(1, 2)[start]
    own = float((seen * at_start).sum() / at_start.pow(2).sum().clamp_min(1e-300))
    layer = e.facts.layer(e.result.layer)
    if layer is not None and layer.rope is not None and layer.rope.attention_factor:
        own /= layer.rope.attention_factor  # the factor before RoPE: the fits read cos/sin's own from what follows
    tail = replace(e, ours=e.ours[..., nope:], ref=e.ref[..., nope:], rope_input=(own * x).to(e.ref.dtype))
    for detect in (rope_fit, rope_tables, rope_pattern):  # rope_pattern: a tail left unrotated on one side
        hint = detect(tail)
        if hint is not None and (not positions_only or hint.kind == "position_offset"):
            return replace(
                hint, text=f"{hint.text} (read on the last {rope} dims of each {e.kind[0]} head, the rotated ones)"
            )
    return None


#: the up-projection each head's pass-through dims are cut from, by node kind, in the order tried
_NOPE_SOURCES = {"q_rot": ("q_b_proj", "q_proj"), "k_rot": ("kv_b_proj",)}


def latent_split(e: Evidence) -> Hint | None:
    """MLA's pass-through dims (``q_nope``, ``k_nope``) cut from another part of each head's up-projection output
    than the reference's: ``q_b_proj``'s per-head ``[q_nope | q_rope]`` read as ``[q_rope | q_nope]``,
    ``kv_b_proj``'s ``[k_nope | v]`` as ``[v | k_nope]``, or cut at another width. Either side: each side's
    pass-through dims are matched against every offset of the reference's whole output, up to a scale (a LoRA
    scale after the cut)."""
    widths = _widths(e)
    if widths is None:
        return None
    nope, _ = widths
    stem = e.name.rsplit(".", 1)[0]
    b, heads, seq, _ = e.ref.shape
    source, y = next(
        ((n, t) for n in _NOPE_SOURCES[e.kind] if (t := reference_output(e, f"{stem}.{n}")) is not None), (None, None)
    )
    if y is None or y.numel() % (b * seq * heads):
        return None
    per_head = y.numel() // (b * seq * heads)
    if per_head <= nope:
        return None
    flat = y.reshape(b, seq, heads * per_head)
    y = y.reshape(b, seq, heads, per_head).transpose(1, 2)

    def scaled(part: torch.Tensor, cut: torch.Tensor) -> bool:
        scale = float((part * cut).sum() / cut.pow(2).sum().clamp_min(1e-300))
        return bool(scale) and e.close(part, scale * cut)

    ours, ref = (cut_offset(t[..., :nope].double(), y, scaled) for t in (e.ours, e.ref))
    letter = e.kind[0]
    other = "v" if letter == "k" else f"{letter}_rope"
    # every head's pass-through dims first, then every head's other part: the per-head layout read as two blocks
    blocked = flat[..., : heads * nope].reshape(b, seq, heads, nope).transpose(1, 2).double()
    # the output's features unpacked as (per_head, heads), the heads the inner axis: head h's feature j at j H + h
    strided = flat.reshape(b, seq, per_head, heads).permute(0, 3, 1, 2)[..., :nope].double()
    for side, this, theirs in (("ours", e.ours, ref), ("the reference", e.ref, ours)):
        if theirs is None or (ours if side == "ours" else ref) is not None:
            continue
        if scaled(this[..., :nope].double(), blocked):
            return Hint(
                "qkv_layout",
                f"likely {source}'s output cut as whole blocks in {side}: its {letter}_nope for head h is features "
                f"[{nope}h:{nope}h + {nope}] of the output (every head's {letter}_nope first, then every head's "
                f"{other}), where each head's {per_head} features hold [{letter}_nope | {other}] (the per-head "
                f"layout read as [all {letter}_nope | all {other}])",
                {"side": side, "per_head": per_head, "source": source, "blocked": True},
            )
        if scaled(this[..., :nope].double(), strided):
            return Hint(
                "qkv_layout",
                f"likely {source}'s output (or weight rows) unpacked with the axes the other way round in {side}: as "
                f"({per_head}, heads) where it holds (heads, {per_head}), so its {letter}_nope for head h takes "
                f"features j * {heads} + h of the output, not h * {per_head} + j (a view(heads, {per_head}) written "
                f"view({per_head}, heads), or a transpose after it missing)",
                {"side": side, "per_head": per_head, "source": source, "strided": True},
            )
    if ours is None or ref is None or ours == ref:
        return None
    rest = per_head - nope
    swapped = {ours, ref} == {0, rest}
    return Hint(
        "qkv_layout",
        f"likely {source}'s output cut into each head's parts in another order: ours' {letter}_nope is columns "
        f"[{ours}:{ours + nope}] of each head's {per_head} ({nope} {letter}_nope + {rest} {other}), the reference's "
        f"[{ref}:{ref + nope}]"
        + (
            f" (the per-head split [{letter}_nope | {other}] read as [{other} | {letter}_nope] in "
            f"{'ours' if ours else 'the reference'})"
            if swapped
            else ""
        ),
        {"ours_offset": ours, "reference_offset": ref, "per_head": per_head, "source": source},
    )
