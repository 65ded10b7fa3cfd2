"""An attention whose internals parity could not read in ours (a weight absorbed into the query, MLA's
``q @ W_UK``; a fused kernel), judged at its output projection: ours' context (that projection's input)
against the reference's attention recomputed from its own traced scores, probabilities and context.

The reference's values are recovered from its context and probabilities (``context = probs @ v`` per
head, solved by least squares), so no value projection needs to be traced; a context that the reference's
attention gives at another softmax temperature names the scale, any other difference names the
attention as the component (every projection feeding it agrees, or the first mismatch would be earlier).
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import torch

from parity.diagnose import masks
from parity.diagnose.differential import output_gate
from parity.diagnose.embeddings import position_table
from parity.diagnose.evidence import EXPLAINS, Evidence, golden_minimum, rel
from parity.diagnose.hints import Hint
from parity.diagnose.scales import layer_coefficient, scale_readings
from parity.model.facts import default_inv_freq
from parity.record.hf_capture import OUTPUT_PROJECTIONS

#: the attention internals after the rotated queries and keys (none of them read in ours: a fused kernel such
#: as scaled_dot_product_attention runs them; the rotated queries and keys, read or not, agree)
_CORE = ("scores", "probs", "context")


def unread_attention(e: Evidence) -> Hint | None:
    """The output projection of an attention block fails, parity read none of ours' internals of that
    block, and ours' context differs from the reference's: the temperature that reproduces ours' context
    (Hint ``attention_scale``), else the attention itself (``attention_internals``)."""
    stem = internals_stem(e)
    if stem is None:
        return None
    # ours' probabilities or context read (and agreeing, or the first failure would be there): the detectors of the
    # nodes after them judge what differs (differential attention's combination, an output gate); its scores alone
    # read agree with a mask or softmax that differs after them
    read = [e.ours_trace.results.get(f"{stem}.{k}") for k in ("probs", "context")]
    if any(f"{stem}.{k}" in e.ours_trace.tensors for k in _CORE) or any(r is not None and r.judged for r in read):
        return None
    scores, probs, context = (e.ref_trace.tensors.get(f"{stem}.{k}") for k in ("scores", "probs", "context"))
    x_ours, x_ref = e.inputs()
    if scores is None or probs is None or context is None or x_ours is None or probs.dim() != 4:
        return None
    if x_ours.numel() != context.numel() or (x_ref is not None and e.close(x_ours, x_ref)):
        return None  # the projection's input agrees: the projection itself differs, for the weight detectors
    b, h, q, _ = probs.shape
    if scores.shape != probs.shape or context.numel() % (b * h * q):
        return None
    ours = _per_head(x_ours.double(), b, h, q)
    if x_ref is not None and x_ref.shape == x_ours.shape:
        # an output gate between the context and the projection (Qwen3.5's gated attention): elementwise, as the
        # gate projection agrees, so ours' context is its projection input over the reference's gate
        gate = _per_head(x_ref.double(), b, h, q) / _per_head(context.double(), b, h, q)
        if not bool(torch.isfinite(gate).all()) or bool((gate == 0).any()):
            return None
        if rel(gate, torch.ones_like(gate)) > 1e-9:
            spread = output_gate(e, stem, x_ours, x_ref)  # the gate applied otherwise (tiled over the channels)
            if spread is not None:
                return spread
            ours = ours / gate
    if e.close(ours.transpose(1, 2).reshape(context.shape).to(context.dtype), context):
        return None  # the context agrees: the gate or the projection itself differs
    factor = _temperature(scores.double(), probs.double(), _per_head(context.double(), b, h, q), ours)
    if factor is not None:
        return Hint(
            "attention_scale",
            f"likely the attention scale (softmax temperature) of an attention parity could not read in ours: "
            f"ours' context is the reference's attention with its scores times {factor:.6g}"
            f"{scale_readings(e, factor)}",
            {"factor": factor},
        )
    mask = _mask_refit(e, stem, probs.double(), _per_head(context.double(), b, h, q), ours)
    if mask is not None:
        return mask
    layout = _traced_refit(e, stem, scores.double(), probs.double(), ours)
    if layout is not None:
        return layout
    return Hint(
        "attention_internals",
        f"ours' attention output (the context {e.name} reads) differs from the reference's while every "
        "projection feeding it agrees, and parity read none of ours' attention internals there (a weight "
        "absorbed into the query, a fused kernel): the difference is inside that attention: its scale, mask or "
        "softmax, or the keys and values it attends over (tap them with parity.tap to be told which)",
        {"block": stem},
    )


def internals_stem(e: Evidence) -> str | None:
    """The module path whose attention internals (``<stem>.scores``, ``.probs``, ``.context``) the reference traced
    for the output projection ``e`` (``o_proj``, NeoX's ``dense``, GPT-2's ``c_proj``): its own block's, or a
    sibling's where the projection sits in a module of its own beside the attention (BERT's and RoBERTa's
    ``attention.output.dense`` after ``attention.self``); None for any other node (an MLP's ``dense``)."""
    if e.kind not in OUTPUT_PROJECTIONS:
        return None
    stem = e.name.rsplit(".", 1)[0]
    if f"{stem}.scores" in e.ref_trace.tensors:
        return stem
    parent = stem.rsplit(".", 1)[0] + "."
    siblings = {
        n[: -len(".scores")]
        for n in e.ref_trace.tensors
        if n.endswith(".scores") and n.startswith(parent) and "." not in n[len(parent) : -len(".scores")]
    }
    return siblings.pop() if len(siblings) == 1 else None


#: each projection's names, as the reference's attention modules call them (Llama's, BERT's, XLM's)
_PROJECTIONS = {"q": ("q_proj", "query", "q_lin"), "k": ("k_proj", "key", "k_lin"), "v": ("v_proj", "value", "v_lin")}


def _traced_refit(e: Evidence, stem: str, scores: torch.Tensor, probs: torch.Tensor, ours: torch.Tensor) -> Hint | None:
    """Ours' context ``(batch, heads, seq, head_dim)`` as the reference's attention (its scale ``c``, its mask: the
    keys its probabilities keep) recomputed from its traced q, k and v with one thing otherwise: q, k and v cut from
    their fused output ``[q | k | v]`` per head, ``(heads, 3, head_dim)`` (GPT-NeoX's, BLOOM's layout: a fused
    projection's output split in another layout inside ours' forward, its weight held right); each projection's heads
    split without moving their axis; the softmax taken over the queries; the query ``c x W + b`` where the
    reference's is ``c (x W + b)`` (BART's ``q_proj(x) * scaling`` written as ``x (c W) + b``: the scale folded into
    the weight and not the bias). Only without RoPE (the q and k nodes are what the scores read) and without GQA
    (every part one width). Hint ``qkv_layout``, ``head_layout``, ``softmax_axis`` or ``bias``; None otherwise."""
    found = [_traced_projection(e, stem, part) for part in _PROJECTIONS]
    if any(t is None for t in found):
        return None
    q, k, v = (cast(torch.Tensor, t).double() for t in found)
    b, h, n, d = ours.shape
    if not (q.shape == k.shape == v.shape == (b, n, h * d)):
        return None

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, n, h, d).transpose(1, 2)

    raw = heads(q) @ heads(k).transpose(-1, -2)
    allowed = probs > 0
    if not bool(allowed.any()):
        return None
    s, r = scores[allowed], raw[allowed]
    c = float((s * r).sum() / r.pow(2).sum().clamp_min(1e-300))
    if c == 0 or rel(c * r, s) > 1e-6:
        return None  # the scores are more than the traced q k^T scaled (RoPE, a bias): no recut recomputes them
    rows = allowed.any(-1)

    def explains(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, axis: int = -1) -> bool:
        logits = (c * qh @ kh.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        return rel((torch.softmax(logits, axis).nan_to_num(0.0) @ vh)[rows], ours[rows]) <= EXPLAINS

    if explains(*_per_head_recut(q, k, v, h)):
        return Hint(
            "qkv_layout",
            "likely q, k and v cut from the fused projection's output in another layout in ours: its context is the "
            "reference's attention over them read per head (heads, 3, head_dim: GPT-NeoX / BLOOM) where the "
            "reference keeps them stacked [q; k; v] (the fused weight is held right: its split in the forward differs)",
            {"layout": "per head (heads, 3, head_dim)", "side": "ours"},
        )
    if explains(q.reshape(b, h, n, d), k.reshape(b, h, n, d), v.reshape(b, h, n, d)):  # viewed with no transpose
        return Hint(
            "head_layout",
            "likely the heads split without moving their axis in ours: its context is the reference's attention with "
            "each projection (batch, seq, heads * head_dim) viewed as (batch, heads, seq, head_dim) directly, with no "
            "view(batch, seq, heads, head_dim).transpose(1, 2)",
            {"layout": "heads split unmoved", "side": "ours"},
        )
    if explains(heads(q), heads(k), heads(v), axis=-2):
        return Hint(
            "softmax_axis",
            "likely the softmax taken over the queries in ours: its context is the reference's attention with each "
            "key's column of scores normalised (softmax(scores, dim=-2)) where the reference normalises each query's "
            "row over the keys (dim=-1)",
            {"side": "ours", "axis": -2},
        )
    bias = next(
        (e.ref_trace.biases[f"{stem}.{n}"] for n in _PROJECTIONS["q"] if f"{stem}.{n}" in e.ref_trace.biases), None
    )
    if bias is None or bias.numel() != h * d or not bool(bias.any()) or abs(c - 1) < 1e-6:
        return None
    if explains(heads(q + bias.double() * (1 / c - 1)), heads(k), heads(v)):  # c (x W + b / c) = c x W + b
        return Hint(
            "bias",
            f"likely the query's scale applied before its bias in ours: its context is the reference's attention with "
            f"q = {c:.6g} * (x W) + b where the reference scales the whole projection, {c:.6g} * (x W + b) (the scale "
            "folded into the query's weight and not its bias, or applied before the bias is added)",
            {"scale": c, "side": "ours"},
        )
    return None


def inline_attention(e: Evidence) -> Hint | None:
    """The output projection of an attention the reference computes inline (no attention interface, so no
    internals traced: RoFormer's, Megatron-BERT's), parity reading none of ours' either: the reference's own
    context recomputed from its traced q, k and v (scaled ``q k^T`` by ``1 / sqrt(head_dim)``, causal, the padding
    keys masked) to confirm the formula, then ours' context matched against that attention with one thing
    otherwise: q, k and v recut from their fused output per head, the heads split without moving their axis, or
    another softmax temperature. Only without RoPE and GQA (the formula must give the reference's context); the
    one-change search reads the rest (a mask, a scale taken from another size). Hints ``qkv_layout``,
    ``head_layout``, ``attention_scale``; None otherwise."""
    if e.kind not in OUTPUT_PROJECTIONS or internals_stem(e) is not None or e.result.layer is None:
        return None
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.shape != x_ref.shape or x_ref.dim() != 3 or e.close(x_ours, x_ref):
        return None
    parts = _inline_projections(e)
    if parts is None:
        return None
    q, k, v = parts
    b, n, width = x_ref.shape
    h = e.facts.heads_at(e.result.layer)
    if not h or width % h or not (q.shape == k.shape == v.shape == (b, n, width)):
        return None
    d = width // h
    allowed = torch.ones(b, 1, n, n, dtype=torch.bool).tril()
    rows = torch.ones(b, n, dtype=torch.bool)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (b, n):
        allowed = allowed & e.attention_mask.bool()[:, None, None, :]
        rows = e.attention_mask.bool()

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, n, h, d).transpose(1, 2)

    def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, c: float = d**-0.5) -> torch.Tensor:
        logits = (c * qh @ kh.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        return (torch.softmax(logits, -1).nan_to_num(0.0) @ vh).transpose(1, 2).reshape(b, n, width)

    q, k, v = q.double(), k.double(), v.double()
    ours, ref = x_ours.double(), x_ref.double()
    heads = (split(q), split(k), split(v))
    slots = torch.arange(n).expand(b, n)
    table = _sinusoid_table(e, d, n)
    found = next(  # the reference's inline RoPE (RoFormer's) and the positions it rotates by
        (
            (r, p)
            for r in _INLINE_ROPES
            for p in ([slots] if e.positions is None else [slots, e.positions.cpu()])
            if rel(attend(*_rotated(heads, r, p, table))[rows], ref[rows]) <= 1e-6
        ),
        None,
    )
    if found is None and rel(attend(*heads)[rows], ref[rows]) > 1e-6:
        return None  # the reference's attention is more than this formula (another RoPE, a bias, a soft-cap)
    rope, positions = found if found is not None else (None, slots)

    def prep(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (qh, kh, vh) if rope is None else _rotated((qh, kh, vh), rope, positions, table)

    recut = _per_head_recut(q, k, v, h)
    q_u, k_u, v_u = (t.reshape(b, h, n, d) for t in (q, k, v))  # the heads split with no transpose
    variants = {
        ("qkv_layout", "q, k and v cut from the fused projection's output per head (heads, 3, head_dim: GPT-NeoX / "
         "BLOOM) where the reference keeps them stacked [q; k; v]"): attend(*prep(recut[0], recut[1], recut[2])),
        ("head_layout", "the heads split without moving their axis: each projection (batch, seq, heads * head_dim) "
         "viewed as (batch, heads, seq, head_dim) directly, with no view(batch, seq, heads, head_dim).transpose(1, "
         "2)"): attend(*prep(q_u, k_u, v_u)),
    }  # fmt: skip
    if rope is not None:  # the reference's inline RoPE (RoFormer's) with its pairs or positions otherwise
        other = dataclasses.replace(rope, interleaved=not rope.interleaved)
        pairs = {True: "adjacent pairs (2i, 2i + 1: RoFormer's)", False: "halves (i, i + d/2: GPT-NeoX's rotate_half)"}
        variants[
            (
                "rope_pairing",
                f"RoPE's pairs taken as {pairs[other.interleaved]} where the reference rotates "
                f"{pairs[rope.interleaved]}",
            )
        ] = attend(*_rotated(heads, other, positions, table))
        for shift in (1, -1):
            variants[
                (
                    "position_offset",
                    f"RoPE's positions {shift:+d} (counted from {shift}, the reference's from 0)"
                    if shift > 0
                    else f"RoPE's positions {shift:+d}",
                )
            ] = attend(*_rotated(heads, rope, positions + shift, table))
    for (kind, said), context in variants.items():
        if rel(context[rows], ours[rows]) < EXPLAINS:
            return Hint(
                kind,
                f"likely {said} in ours: its context (what {e.name} reads) is the reference's attention, recomputed "
                "from its q, k and v, with that one change",
                {"side": "ours", "reading": said},
            )

    def residual(log_c: float) -> float:
        return rel(attend(*prep(*heads), math.exp(log_c) * d**-0.5)[rows], ours[rows])

    log_c = golden_minimum(residual, [math.log(0.05) + i * (math.log(20.0) - math.log(0.05)) / 60 for i in range(61)])
    factor = math.exp(log_c)
    if residual(log_c) < EXPLAINS and abs(factor - 1) > 1e-3:
        return Hint(
            "attention_scale",
            f"likely the attention scale (softmax temperature) in ours: its context is the reference's attention, "
            f"recomputed from its q, k and v, with the scores times {factor:.6g}{layer_coefficient(e, factor)}"
            f"{scale_readings(e, factor, d**-0.5)}",
            {"factor": factor},
        )
    return None


@dataclasses.dataclass(frozen=True)
class _InlineRope:
    """A RoPE an attention computes inline over the whole head (RoFormer's, from its sinusoid table)."""

    interleaved: bool
    values: bool  # the values rotated too (RoFormer's ``rotary_value``)


_INLINE_ROPES = tuple(_InlineRope(i, v) for i in (True, False) for v in (False, True))


def _rotated(
    heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rope: _InlineRope,
    positions: torch.Tensor,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(batch, heads, seq, head_dim)`` with q and k (and v where ``rope.values``) rotated at ``positions``
    ``(batch, seq)`` by the sinusoid ``table`` ``(max_positions, head_dim)``, laid ``sin | cos`` (Su et al. 2021;
    RoFormer's ``apply_rotary_position_embeddings``: each pair times ``cos + i sin`` of its position's row)."""
    d = heads[0].shape[-1]
    rows = table.double()[positions.clamp(0, table.shape[0] - 1)][:, None]  # (batch, 1, seq, head_dim)
    turn = torch.complex(rows[..., d // 2 :], rows[..., : d // 2])

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if rope.interleaved:
            z = torch.complex(x[..., 0::2], x[..., 1::2]) * turn
            return torch.stack([z.real, z.imag], -1).flatten(-2)
        z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * turn
        return torch.cat([z.real, z.imag], -1)

    q, k, v = heads
    return rotate(q), rotate(k), rotate(v) if rope.values else v


def _sinusoid_table(e: Evidence, head_dim: int, n: int) -> torch.Tensor:
    """The reference's position table of ``head_dim`` columns (RoFormer's ``embed_positions``, whatever its
    weights), else the theta-10000 sinusoids ``(n, head_dim)`` laid ``sin | cos``."""
    table = position_table(e, head_dim)
    if table is not None:
        return table.double()
    angle = torch.arange(n + 2, dtype=torch.float64)[:, None] * torch.tensor(default_inv_freq(10000.0, head_dim))
    return torch.cat([angle.sin(), angle.cos()], -1)


def _inline_projections(e: Evidence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The reference's traced q, k and v projections of the attention whose output projection ``e`` is: modules
    named by :data:`_PROJECTIONS` beside it or in a sibling module (BERT's ``attention.self``); None where any is
    missing."""
    stem = e.name.rsplit(".", 1)[0]
    for holder in (stem, stem.rsplit(".", 1)[0]):
        prefix = holder + "."
        found = []
        for names in _PROJECTIONS.values():
            hit = next(
                (
                    t
                    for m, t in e.ref_trace.tensors.items()
                    if m.startswith(prefix) and m.rsplit(".", 1)[-1] in names and m.count(".") - holder.count(".") <= 2
                ),
                None,
            )
            found.append(hit)
        if all(t is not None for t in found):
            return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple(found))
    return None


def _per_head_recut(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """q, k and v ``(batch, seq, heads * head_dim)`` concatenated ``[q | k | v]`` and cut again per head
    ``(heads, 3, head_dim)`` (GPT-NeoX's, BLOOM's layout): ``(3, batch, heads, seq, head_dim)``."""
    b, n, width = q.shape
    return torch.cat([q, k, v], -1).view(b, n, heads, 3, width // heads).permute(3, 0, 2, 1, 4)


def _traced_projection(e: Evidence, stem: str, part: str) -> torch.Tensor | None:
    """The reference's traced ``part`` projection (``"q"``, ``"k"``, ``"v"``: :data:`_PROJECTIONS`' names) of the
    attention ``stem``; None where none is traced."""
    return next(
        (e.ref_trace.tensors[f"{stem}.{n}"] for n in _PROJECTIONS[part] if f"{stem}.{n}" in e.ref_trace.tensors), None
    )


def _traced_values(e: Evidence, stem: str, context: torch.Tensor) -> torch.Tensor | None:
    """The reference's values ``(batch, heads, seq, head_dim)`` from its traced value projection (``v_proj``,
    BERT's ``value``) in the attention ``stem``, repeated over the query heads (GQA), for ``context``
    ``(batch, heads, seq, head_dim)``; None where none is traced or its width does not cut into heads."""
    b, h, n, d = context.shape
    v = _traced_projection(e, stem, "v")
    if v is None or v.numel() % (b * n * d):
        return None
    kv = v.numel() // (b * n * d)
    if not kv or h % kv:
        return None
    return v.double().reshape(b, n, kv, d).transpose(1, 2).repeat_interleave(h // kv, 1)


def _per_head(context: torch.Tensor, b: int, h: int, q: int) -> torch.Tensor:
    """``(batch, seq, heads * head_dim)`` as ``(batch, heads, seq, head_dim)``."""
    return context.reshape(b, q, h, -1).transpose(1, 2)


def _temperature(scores: torch.Tensor, probs: torch.Tensor, context: torch.Tensor, ours: torch.Tensor) -> float | None:
    """The factor ``c`` (other than 1) for which ``softmax(c * scores + mask) @ v`` is ours' context, with
    ``v`` solved from the reference's own ``context = probs @ v`` and the mask where its probabilities are
    zero; None when the reference's own attention cannot be recomputed so, or no factor explains ours."""
    allowed = probs > 0
    values = torch.linalg.lstsq(probs, context).solution
    if rel(probs @ values, context) > 1e-6:
        return None

    def residual(log_c: float) -> float:
        logits = (math.exp(log_c) * scores).masked_fill(~allowed, float("-inf"))
        return rel(torch.softmax(logits, -1).nan_to_num(0.0) @ values, ours)

    log_c = golden_minimum(residual, [math.log(0.02) + i * (math.log(50.0) - math.log(0.02)) / 80 for i in range(81)])
    factor = math.exp(log_c)
    if residual(log_c) > EXPLAINS or abs(factor - 1) < 1e-3:
        return None
    return factor


def _mask_refit(e: Evidence, stem: str, probs: torch.Tensor, context: torch.Tensor, ours: torch.Tensor) -> Hint | None:
    """The key mask that reproduces ours' context (``(batch, heads, q, head_dim)``) from the reference's own
    attention: the reference's raw scores ``c * q_rot @ k_rot^T`` (``c`` fitted where it attends), its values
    solved from ``context = probs @ v``, softmax over another mask: the sliding window a key or two wider or
    narrower, no window, or the key padding left unmasked. Hint ``sliding_window`` or ``padding``; None when
    no such mask explains ours (or the reference's own attention cannot be recomputed so)."""
    q_rot, k_rot = (e.ref_trace.tensors.get(f"{stem}.{k}") for k in ("q_rot", "k_rot"))
    if q_rot is None or k_rot is None or q_rot.dim() != 4 or k_rot.dim() != 4:
        return None
    b, h, n, _ = probs.shape
    if q_rot.shape[:3] != (b, h, n) or k_rot.shape[2] != n or h % k_rot.shape[1] or k_rot.shape[-1] != q_rot.shape[-1]:
        return None
    raw = q_rot.double() @ k_rot.double().repeat_interleave(h // k_rot.shape[1], 1).transpose(-1, -2)
    allowed = probs > 0
    scores = e.ref_trace.tensors.get(f"{stem}.scores")
    if scores is None or scores.shape != probs.shape:
        return None
    s, r = scores.double()[allowed], raw[allowed]
    c = float((s * r).sum() / r.pow(2).sum().clamp_min(1e-300))
    q_pos, k_pos = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = k_pos <= q_pos
    real_key = torch.ones(b, 1, 1, n, dtype=torch.bool)
    real_query = torch.ones(b, 1, n, 1, dtype=torch.bool)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (b, n):
        real_key, real_query = e.attention_mask.bool()[:, None, None, :], e.attention_mask.bool()[:, None, :, None]
    rows = real_query.expand(b, h, n, 1).squeeze(-1)
    # the values from the real queries' rows alone (a padding query's row is whatever its mask made it)
    values = torch.linalg.lstsq(probs * rows[..., None], context * rows[..., None]).solution
    known = (allowed & rows[..., None]).any(-2, keepdim=True)  # (b, h, 1, k): keys whose values that solves
    traced = _traced_values(e, stem, context)
    if traced is not None and rel((probs @ traced)[rows], context[rows]) < 1e-6:
        values, known = traced, torch.ones_like(known)  # the value projection's own output: every key's
    if rel(c * r, s) > 1e-6 or rel((probs @ values)[rows], context[rows]) > 1e-6:
        return None  # the reference's attention is more than a scaled q k^T under a mask (a soft-cap, a bias)

    # an attention sink's share of each row (GPT-OSS's, MiMo's: a softmax over [scores | sink], the sink column
    # dropped): the row's normaliser read from any key it keeps, the sink's term what the kept keys leave of it
    logits = c * raw
    log_z = (logits - probs.clamp_min(1e-300).log()).masked_fill(~allowed, float("nan")).nanmedian(-1).values
    sunk = (1 - probs.sum(-1)).clamp_min(0.0)
    log_sink = torch.where(sunk > 1e-9, sunk.clamp_min(1e-300).log() + log_z, torch.full_like(sunk, float("-inf")))

    def context_under(mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kept = (logits if bias is None else logits + bias).masked_fill(~mask, float("-inf"))
        total = torch.logaddexp(torch.logsumexp(kept, -1), log_sink)
        return torch.exp(kept - total[..., None]).nan_to_num(0.0) @ values

    if rel(context_under(allowed)[rows], context[rows]) > 1e-6:
        return None  # the probabilities are not one softmax over the keys they keep (and a sink)
    window = masks._window_of(probs, e.attention_mask)
    candidates: list[tuple[str, str, torch.Tensor] | tuple[str, str, torch.Tensor, torch.Tensor]] = []
    if window is not None:
        for w in (window + 1, window - 1, window + 2, window - 2):
            if w > 0:
                said = f"a window of {w} keys where the reference keeps {window} (q - k < {w})"
                candidates.append(("sliding_window", said, causal & (q_pos - k_pos < w) & real_key))
        said = f"no window: every earlier key, where the reference keeps the last {window}"
        candidates.append(("sliding_window", said, causal & real_key))
    if not bool(real_key.all()):
        kept = allowed | (causal & ~real_key & (q_pos - k_pos < (window or n + 1)))
        candidates.append(("padding", "the padding keys left unmasked", kept))
        said = "the 0/1 attention_mask added to the scores as is (never turned into 0 / -inf: the padding keys read)"
        candidates.append(("padding", said, kept, real_key.double().expand(b, 1, 1, n)))
    if window is None:
        said = "no causal mask: every key, later ones too (an encoder's bidirectional attention: is_decoder ignored)"
        candidates.append(("causal_mask", said, real_key.expand(b, 1, n, n)))
        said = "the causal mask one key wider: each query also sees the next token (triu's diagonal off by one)"
        candidates.append(("causal_mask", said, (k_pos <= q_pos + 1) & real_key))
    for kind, said, mask, *bias in candidates:
        mask = torch.where(rows[..., None], mask.expand(b, h, n, n), allowed)  # padding queries: not judged
        if (torch.equal(mask, allowed) and not bias) or bool((mask & rows[..., None] & ~known).any()):
            continue  # no other mask, or one over keys no real query of the reference attends (values unknown)
        if rel(context_under(mask, *bias)[rows], ours[rows]) < EXPLAINS:
            return Hint(
                kind,
                f"likely the attention mask of an attention parity could not read in ours (a fused kernel): ours' "
                f"context is the reference's attention recomputed with {said}",
                {"mask": said, "window": window},
            )
    return None
