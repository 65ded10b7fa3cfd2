"""Detectors of positions: RoPE read back from its rotation (theta, scaling, pairing, partial rotary,
per-layer type) and a learned position table read off by k."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from parity.diagnose.evidence import (
    Evidence,
    attention_values,
    by_position,
    fmt_list,
    forms_of,
    fused_layouts,
    fused_output,
    heads_first,
    pair_lengths,
    rel,
    seq_axis,
    whose,
)
from parity.diagnose.hints import Hint
from parity.diagnose.rope_fit import ROTATION_MISTAKES

if TYPE_CHECKING:
    from parity.model.facts import RopeFacts


def position_table_offset(e: Evidence) -> Hint | None:
    """A position embedding node (``wpe``, ``embed_positions``) where ours at position ``p`` equals the
    reference at ``p + k`` for every ``p`` both have (``k`` != 0): a learned position table indexed with
    ``position + k``. Other nodes shifted along the sequence are :func:`sequence_shift`'s."""
    axis = seq_axis(e.kind) if e.ours.dim() > 2 else 0  # (a table's rows broadcast over the batch: (seq, hidden))
    if ("pos" not in e.kind and e.kind != "wpe") or e.ours.dim() <= axis or e.ours.shape[axis] < 4:
        return None
    n = e.ours.shape[axis]
    for k in (1, -1, 2, -2):
        ours, ref = e.ours.narrow(axis, max(0, -k), n - abs(k)), e.ref.narrow(axis, max(0, k), n - abs(k))
        if e.close(ours, ref):
            sign = "+" if k > 0 else "-"
            opt = (
                " (OPT reads its learned table at position + 2: OPTLearnedPositionalEmbedding's offset)"
                if e.facts.model_type == "opt" and abs(k) == 2
                else ""
            )
            return Hint(
                "position_offset",
                f"likely positions off by {k}: ours at position p equals the reference at position p {sign} {abs(k)} "
                f"(for p = {max(0, -k)}..{n - 1 - max(0, k)}; a position table or position ids shifted by {k}){opt}",
                {"offset": k},
            )
    return None


def pre_rope(e: Evidence, n_heads: int) -> torch.Tensor | None:
    """The reference's q (or k) as RoPE reads it, ``(batch, heads, seq, head_dim)``: :func:`projection_heads`,
    clamped to [-clip_qkv, clip_qkv] where the config clips them (OLMo)."""
    if e.rope_input is not None:
        return e.rope_input
    x = projection_heads(e, n_heads)
    clip = e.facts.clip_qkv
    return x.clamp(-clip, clip) if x is not None and clip else x


def projection_heads(e: Evidence, n_heads: int) -> torch.Tensor | None:
    """The reference's q (or k) before RoPE as (batch, heads, seq, head_dim), from the q_norm/q_proj node
    (a per-head norm's output is ``(batch, seq, heads, head_dim)`` where Transformers normalises
    before moving heads first, Qwen3 and Gemma 4, and ``(batch, heads, seq, head_dim)`` where it
    normalises after, Gemma 3). When the sequence length equals the head count the shape cannot
    tell: the layout that equals the reference's rotated tensor at position 0 (no rotation) wins."""
    stem = e.name.rsplit(".", 1)[0]
    letter = e.kind[0]
    head_dim = e.ref.shape[-1]
    seq = e.ref.shape[2] if e.ref.dim() == 4 else None
    for kind in (f"{letter}_norm", f"{letter}_layernorm", f"{letter}_proj"):
        t = e.ref_trace.tensors.get(f"{stem}.{kind}")
        if t is None:
            t = _per_head_norms(e, f"{stem}.{kind}")
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
    return _pre_rope_fused(e, n_heads, stem)


def _per_head_norms(e: Evidence, base: str) -> torch.Tensor | None:
    """The outputs of a per-head norm's modules (StableLM's ``q_layernorm.norms.<head>``, each ``(batch, 1,
    seq, head_dim)``) joined along the heads, or None when the reference has none."""
    parts: list[torch.Tensor] = []
    while (t := e.ref_trace.tensors.get(f"{base}.norms.{len(parts)}")) is not None:
        parts.append(t)
    return torch.cat(parts, dim=1) if parts and all(t.dim() == 4 for t in parts) else None


def _pre_rope_fused(e: Evidence, n_heads: int, stem: str) -> torch.Tensor | None:
    """The reference's q (or k) before RoPE from a fused projection (GPT-2's ``c_attn``, Falcon's
    ``query_key_value``, Phi-3's ``qkv_proj``): a node of the attention before the failing one whose
    last axis holds whole heads, each of the rotated tensor's heads taken from the fused head that
    equals it at position 0 (where RoPE turns nothing but scales the rotated dims by its cos/sin factor;
    everywhere without RoPE). The heads are found one by one, so any fused layout (q heads first, or q, k, v per
    KV group) gives them."""
    if e.positions is None or e.ref.dim() != 4:
        return None
    b, _, t, d = e.ref.shape
    start = e.positions == 0
    if e.positions.shape != (b, t) or not bool(start.any()):
        return None
    target = e.ref.transpose(1, 2)[start]  # (tokens at position 0, heads, head_dim)
    layer = e.facts.layer(e.result.layer)
    rope = layer.rope if layer is not None else None
    r = 0 if rope is None else rope.rotary_dim if 0 < rope.rotary_dim <= d else d  # the dims RoPE turns

    def equals(part: torch.Tensor, head: torch.Tensor) -> bool:
        """The fused head ``part`` is ``head`` before RoPE: equal on the pass-through dims and, at position 0,
        one factor apart on the rotated ones (RoPE's cos/sin factor: LongRoPE's, YaRN's, whatever its source)."""
        if not e.close(part[..., r:], head[..., r:]):
            return False
        if not r:
            return True
        a, b = part[..., :r].double(), head[..., :r].double()
        factor = float((a * b).sum() / a.pow(2).sum().clamp_min(1e-300))
        return 0.25 < factor < 4 and e.close((a * factor).to(head.dtype), head[..., :r])

    for name, tensor in e.ref_trace.tensors.items():
        if name == e.name:
            break
        if not name.startswith(stem + ".") or tensor.dim() != 3 or tensor.shape[:2] != (b, t) or tensor.shape[-1] % d:
            continue
        fused = tensor.unflatten(-1, (tensor.shape[-1] // d, d))  # (b, t, fused heads, head_dim)
        at_start = fused[start]
        picked: list[int] = []
        for head in range(n_heads):
            match = next(
                (j for j in range(fused.shape[2]) if j not in picked and equals(at_start[:, j], target[:, head])),
                None,
            )
            if match is None:
                break
            picked.append(match)
        if len(picked) == n_heads:
            return fused[:, :, picked].transpose(1, 2)
    return None


def _rotated_dims(e: Evidence, rotated: torch.Tensor, x: torch.Tensor) -> int:
    """How many leading dims of each head ``rotated`` changes: the rest equal the unrotated ``x``
    (partial rotary passes them through)."""
    n = x.shape[-1]
    while n > 0 and e.close(rotated[..., n - 1], x[..., n - 1]):
        n -= 1
    return n


def _pairing(rotated: torch.Tensor, x: torch.Tensor) -> str | None:
    """Which RoPE pairing ``rotated`` preserves (pair norms equal to the input's, up to one scale per row:
    a head at a token, which a weight-free norm after RoPE, nanochat's, rescales)."""
    d = x.shape[-1]
    layouts = {
        "half-split (i, i + d/2)": (torch.arange(d // 2), torch.arange(d // 2) + d // 2),
        "interleaved (2i, 2i + 1)": (torch.arange(0, d, 2), torch.arange(1, d, 2)),
    }
    for name, (i, j) in layouts.items():
        rn = rotated.double()[..., i].pow(2) + rotated.double()[..., j].pow(2)
        xn = x.double()[..., i].pow(2) + x.double()[..., j].pow(2)
        keep = xn > 1e-6 * xn.max()
        ratio = torch.where(keep, rn / xn.clamp_min(1e-300), torch.nan)
        per_row = ratio / ratio.nanmean(-1, keepdim=True)
        spread = per_row[keep]
        if spread.numel() and float(spread.std()) < 1e-4:
            return name
    return None


def rope_fit(e: Evidence) -> Hint | None:
    """Read ours' rotation back (angles and amplitude per frequency and position) and name the RoPE
    that reproduces it: another layer type's, the unscaled one, another theta, shifted positions.
    When ours is this layer's own RoPE, the reference's rotation is read instead (a fault on the
    reference's side: a checkpoint or a Transformers version that rotates otherwise)."""
    from parity.diagnose.rope_fit import identify

    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    layer = e.facts.layer(e.result.layer)
    x = pre_rope(e, e.ours.shape[1])
    if layer is None or x is None or x.shape != e.ours.shape or e.positions.shape != (e.ours.shape[0], e.ours.shape[2]):
        return None
    ropes = {t: e.facts.rope_of_type(t) for t in sorted(set(e.facts.layer_types))}
    tol = 1e-2 if e.ours.dtype in (torch.bfloat16, torch.float16) else 1e-4
    own = layer.rope.attention_factor if layer.rope is not None else 1.0

    positions = e.positions

    def fit_of(rotated: torch.Tensor):
        per_head = e.facts.hidden_size // e.facts.num_heads if e.facts.hidden_size and e.facts.num_heads else None
        return identify(
            x, rotated, layer, ropes, positions, tol, e.attention_mask, e.facts.max_position_embeddings, per_head
        )

    def as_it_should(fit) -> bool:
        return (
            fit is not None
            and not fit.offsets
            and not fit.rows
            and not fit.constant
            and not fit.read
            and fit.label.startswith("this layer's RoPE")
            and (fit.rescaled or abs(fit.amplitude / own - 1) < 1e-3)  # (a rescaled read has no cos/sin scale to judge)
        )

    def rescaled(t: torch.Tensor) -> torch.Tensor:
        """``t``'s rows (a head at a token) brought to the lengths of x's: a weight-free norm after RoPE
        (nanochat's q/k norm) undone, since a rotation keeps each row's length."""
        return t * (x.norm(dim=-1, keepdim=True) / t.norm(dim=-1, keepdim=True).clamp_min(1e-30))

    def read(t: torch.Tensor):
        fit = fit_of(t)
        if fit is not None:
            return fit
        fit = fit_of(rescaled(t))
        return None if fit is None else dataclasses.replace(fit, rescaled=True)

    def frequencies_right(fit) -> bool:  # this layer's RoPE at the right positions, whatever its cos/sin scale
        return (
            fit is not None
            and not (fit.offsets or fit.rows or fit.constant or fit.read)
            and fit.label.startswith("this layer's RoPE")
        )

    fit, side = read(e.ours), "ours"
    if fit is None:
        return None
    if frequencies_right(fit) and not as_it_should(fit) and _scaled_throughout(e, x, fit.amplitude / own):
        return None  # the pass-through dims scaled alike: a factor on all of q (k), not RoPE's cos/sin
    ref_fit = read(e.ref)
    if frequencies_right(fit) and not as_it_should(fit) and ref_fit is not None and not frequencies_right(ref_fit):
        # ours' rotation is this layer's bar its scale (a factor a port may take on the scores), the reference's
        # frequencies are not: the reference's rotation is the difference to name
        return _rope_hint(e, ref_fit, "the reference", layer, own)
    if as_it_should(fit):
        fit, side = ref_fit, "the reference"  # ours rotates as it should: is it the reference?
        if as_it_should(fit):
            return None  # both are this layer's RoPE: the error is not in the rotation
    elif _alike(fit, ref_fit):
        return None  # both sides rotate alike (the reference's own convention): the error is elsewhere
    if fit is None:
        return None
    return _rope_hint(e, fit, side, layer, own)


def _scaled_throughout(e: Evidence, x: torch.Tensor, factor: float) -> bool:
    """Whether ours' dims past the rotary ones (partial rotary passes them through) are ``x``'s times ``factor``
    too (not ``x``'s): one factor on the whole head, which RoPE's cos/sin factor never reaches."""
    layer = e.facts.layer(e.result.layer)
    r = layer.rope.rotary_dim if layer is not None and layer.rope is not None else x.shape[-1]
    if r >= x.shape[-1] or abs(factor - 1) < 1e-4:
        return False
    rest, theirs = e.ours[..., r:], x[..., r:]
    return not e.close(rest, theirs) and e.close(rest, (theirs.double() * factor).to(rest.dtype))


def _alike(a, b) -> bool:
    """Two rotation fits that say the same: one RoPE, the same offsets, the same cos/sin scale."""
    return (
        a is not None
        and b is not None
        and (a.label, a.offsets) == (b.label, b.offsets)
        and abs(b.amplitude / a.amplitude - 1) < 1e-3
    )


def _factor_sources(rope, max_position_embeddings: int | None = None) -> dict[str, float]:
    """Where a cos/sin factor may come from, by name: none, the config's ``attention_factor``, YaRN's
    default ``0.1 ln(s) + 1`` (Peng et al. 2023, arXiv:2309.00071 eq. 22; Transformers'
    ``get_mscale``), with the config's ``mscale`` / ``mscale_all_dim`` (DeepSeek's ratio), squared;
    LongRoPE's ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))`` (Transformers'
    ``_compute_longrope_parameters``, s = max / original positions) and its misreadings."""
    sources = {"no factor (1)": 1.0}
    if rope is None:
        return sources
    explicit = rope.get("attention_factor")
    if isinstance(explicit, (int, float)):
        sources[f"the config's attention_factor ({explicit:.6g})"] = float(explicit)
    original = rope.get("original_max_position_embeddings")
    if rope.rope_type == "longrope" and isinstance(original, int) and original > 1 and max_position_embeddings:
        s = rope.get("factor") or max_position_embeddings / original
        if isinstance(s, (int, float)) and s > 1:
            logs = {
                f"original_max_position_embeddings {original}": math.log(original),
                f"max_position_embeddings {max_position_embeddings}": math.log(max_position_embeddings),
            }
            for name, log in logs.items():
                sources[f"LongRoPE's sqrt(1 + ln({s:g}) / ln({name}))"] = math.sqrt(1 + math.log(s) / log)
                sources[f"LongRoPE's 1 + ln({s:g}) / ln({name}) without its square root"] = 1 + math.log(s) / log
    s = rope.get("factor")
    if isinstance(s, (int, float)) and s > 1:
        formula = 0.1 * math.log(s) + 1
        sources[f"YaRN's default 0.1 ln({s:g}) + 1 ({formula:.6g})"] = formula
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if isinstance(m, (int, float)) and isinstance(m_all, (int, float)) and m and m_all:
            ratio = (0.1 * m * math.log(s) + 1) / (0.1 * m_all * math.log(s) + 1)
            sources[f"the mscale ratio (0.1 {m:g} ln s + 1) / (0.1 {m_all:g} ln s + 1) ({ratio:.6g})"] = ratio
    sources.update({f"{label}, squared": v * v for label, v in list(sources.items())[1:]})
    return sources


def _rope_hint(e: Evidence, fit, side: str, layer, own: float) -> Hint | None:
    """The hint for ``side``'s rotation ``fit`` (a :class:`~parity.diagnose.rope_fit.Fit`)."""
    other = "the reference" if side == "ours" else "ours"
    amp = (
        f"cos/sin scaled by {fit.amplitude:.6g} (this layer's RoPE: {own:.6g})"
        if not fit.rescaled
        else "its cos/sin scale not read (each row's length differs from the unrotated one's by token: a per-token "
        "scale on q/k, or a norm after RoPE)"
    )
    if fit.same_as:  # the candidates that rotate alike here: the run cannot tell them apart
        amp += "; the same frequencies here as " + "; or ".join(fit.same_as)
    evidence = {
        "side": side,
        side.replace("the ", ""): fit.label,
        "amplitude": fit.amplitude,
        "reference_amplitude": own,
        "layer_type": layer.layer_type,
    }
    if fit.offsets:
        pads = [0] * len(fit.offsets) if e.attention_mask is None else [int(n) for n in (e.attention_mask == 0).sum(1)]
        evidence = {**evidence, "offsets": list(fit.offsets), "pad_counts": pads}
        if list(fit.offsets) == pads and any(pads):
            return Hint(
                "position_offset",
                f"likely positions not derived from the attention mask: {side} rotates each batch row by this layer's "
                f"RoPE at its position + {list(fit.offsets)} (pad counts {pads}): {side} counts positions 0..S-1 over "
                f"the padding, {other} (as generation does) from each row's first real token",
                evidence,
            )
        shifts = sorted(set(fit.offsets))
        k = shifts[0]
        shift = f"{k:+d}" if len(shifts) == 1 else f"{list(fit.offsets)} per batch row"
        at = f"p {'+' if k > 0 else '-'} {abs(k)}" if len(shifts) == 1 else "p shifted per row"
        return Hint(
            "position_offset",
            f"likely positions shifted by {shift}: {side} rotates position p as {other} rotates {at}"
            + (f" (pad counts {pads})" if any(pads) else " (no padding in this run)")
            + "; position_ids counted from 1, or a cache offset",
            evidence,
        )
    if fit.constant:
        batch = (
            " (each row's batch index: a seq-first cache sliced with the batch axis)"
            if list(fit.constant) == list(range(len(fit.constant)))
            else ""
        )
        return Hint(
            "position_offset",
            f"likely positions read from another axis: {side} rotates every token of batch row b at one position "
            f"({fmt_list(fit.constant)} for rows 0..{len(fit.constant) - 1}){batch}, {other} each token at its own",
            {**evidence, "constant_positions": list(fit.constant)},
        )
    if fit.read and e.positions is not None:
        rows = [r for r, row in enumerate(fit.read) if list(row) != e.positions[r].tolist()]
        r = rows[0] if rows else 0
        return Hint(
            "position_offset",
            f"likely other positions given to this layer's RoPE in {side}: it rotates batch row {r} at positions "
            f"{fmt_list(fit.read[r])}, {other} at {fmt_list(e.positions[r].tolist())} (read from the rotation: this "
            "layer's own frequencies at those integer positions; a stack handed another sequence's positions, as the "
            "bytes' position_ids for BLT's patches, or positions counted otherwise)",
            {**evidence, "positions": [list(row) for row in fit.read]},
        )
    if fit.rows:
        moved = [row for row, source in enumerate(fit.rows) if source != row]
        return Hint(
            "position_offset",
            f"likely one row's positions used for the whole batch: {side} rotates batch row(s) {fmt_list(moved)} at the "
            f"positions of row(s) {fmt_list(fit.rows[r] for r in moved)} (cos/sin built from position_ids[0] and "
            f"broadcast over a padded batch), {other} each row at its own positions",
            {**evidence, "rows": list(fit.rows)},
        )
    if any(fit.label == label for label, _, _ in ROTATION_MISTAKES):
        if side == "ours":
            return Hint(
                "rope_rotation",
                f"likely the rotation written wrongly: ours applies this layer's RoPE frequencies with {fit.label}, "
                f"{amp}; the reference turns each pair by w p (x cos + rotate_half(x) sin)",
                evidence,
            )
        return Hint(
            "rope_rotation",
            f"likely the rotation's direction: the reference applies this layer's RoPE frequencies with {fit.label} "
            f"relative to Llama's x cos + rotate_half(x) sin (its own rotate_half, as nanochat's (x2, -x1)), {amp}; "
            "ours turns each pair by w p (Llama's rotate_half (-x2, x1)): rotate as the reference does",
            evidence,
        )
    if fit.label.startswith("this layer's RoPE"):
        sources = _factor_sources(layer.rope, e.facts.max_position_embeddings)
        source = next((label for label, v in sources.items() if abs(fit.amplitude / v - 1) < 1e-3), None)
        if source is not None:
            own_source = next((label for label, v in sources.items() if abs(own / v - 1) < 1e-3), f"{own:.6g}")
            detail = f": {side} takes {source}, {other} {own_source} (the attention factor from the wrong source)"
            evidence = {**evidence, "source": source, "reference_source": own_source}
        else:
            named = [
                (n, v)
                for n, v in e.facts.named_constants().items()
                if "attention factor" in n and abs(fit.amplitude / own / v - 1) < 1e-3
            ]
            detail = f" ({named[0][0]})" if named else ""
        return Hint(
            "rope_attention_factor",
            f"likely the RoPE attention factor: {side} rotates with this layer's frequencies but {amp}{detail}",
            evidence,
        )
    if fit.label.startswith("the RoPE of") and layer.rope is None:
        return Hint(
            "rope_unexpected",
            f"likely RoPE where the config asks for none: this {layer.layer_type} layer is NoPE"
            + (f" ({e.facts.nope_field} marks it so)" if e.facts.nope_field else "")
            + f", {side} rotates it with {fit.label}, {amp}",
            evidence,
        )
    if fit.label.startswith("the RoPE of") or "scaling applied to this" in fit.label:
        return Hint(
            "rope_layer_type",
            f"likely RoPE per layer type: this {layer.layer_type} layer of {side} uses {fit.label}, {amp}; "
            "in Transformers 5 each layer type has its own rope_parameters (e.g. YaRN on full_attention only)",
            evidence,
        )
    if fit.label.startswith("the unscaled RoPE"):
        return Hint(
            "rope_scaling", f"likely the RoPE scaling is not applied: {side} rotates with {fit.label}, {amp}", evidence
        )
    if fit.label.startswith("every angle doubled"):
        return Hint(
            "rope_rotation",
            f"likely RoPE applied twice in {side}: it rotates with {fit.label.split(': ', 1)[1]}, every angle twice "
            f"{whose(other)}, {amp}",
            evidence,
        )
    if "arange lost its step" in fit.label:
        return Hint(
            "rope_frequencies", f"likely the inverse frequencies: {side} rotates like {fit.label}, {amp}", evidence
        )
    if "correction range" in fit.label:  # the ramp's ends moved: a band of frequencies differs
        return Hint(
            "rope_band",
            f"likely RoPE frequencies in YaRN's ramp band: {side} rotates like {fit.label}, {amp}",
            evidence,
        )
    if "YaRN" in fit.label or fit.label.startswith("LongRoPE") or fit.label.startswith("llama3 scaling"):
        return Hint("rope_scaling", f"likely the RoPE scaling: {side} rotates like {fit.label}, {amp}", evidence)
    if "computed over the whole head" in fit.label or "computed over hidden_size / num_heads" in fit.label:
        return Hint(
            "rope_frequencies",
            f"likely the inverse frequencies over the wrong width: {side} rotates like {fit.label}, {amp}",
            evidence,
        )
    if "divide by head_dim" in fit.label or "divide by hidden_size" in fit.label:
        what = "of partial rotary" if "divide by head_dim" in fit.label else "over another head_dim"
        return Hint(
            "rope_frequencies",
            f"likely the inverse frequencies {what}: {side} rotates like {fit.label}, {amp}",
            evidence,
        )
    rope = cast("RopeFacts", layer.rope)
    fitted = re.search(r"theta ([0-9.e+-]+)", fit.label)
    if fitted and rope.theta > 1 and float(fitted.group(1)) > 1:
        # theta'^(-2i/r) = theta^(-2i/D): the exponents divided by another width D = r ln(theta) / ln(theta')
        width = rope.rotary_dim * math.log(rope.theta) / math.log(float(fitted.group(1)))
        widths = {
            "hidden_size": e.facts.hidden_size or 0,
            "num_heads * head_dim": (e.facts.num_heads or 0) * (layer.head_dim or 0),
            # proportional RoPE (Gemma 4, LFM3) turns the first pairs only, its exponent still over the whole head
            "the rotated dims only (2 x the nonzero frequencies)": 2 * sum(1 for f in rope.inv_freq if f > 0),
        }
        source = next((n for n, v in widths.items() if v and v != rope.rotary_dim and abs(width / v - 1) < 1e-3), None)
        if source is not None:
            return Hint(
                "rope_frequencies",
                f"likely the inverse frequencies over another width: {side} rotates with theta^(-2i / {width:.0f}) "
                f"({source}) where the reference divides by the rotary dims ({rope.rotary_dim}): the same as "
                f"{fit.label}, {amp}",
                {**evidence, "width": round(width), "source": source},
            )
    alpha = _ntk_alpha_reading(rope, float(fitted.group(1)), e.facts, layer) if fitted else None
    return Hint(
        "rope_theta",
        f"likely a different rope theta: {side} rotates like {fit.label}, {amp} (the config: theta {rope.theta:g}"
        + (f"; {alpha})" if alpha else ")"),
        evidence,
    )


def _ntk_alpha_reading(rope: RopeFacts, theta: float, facts, layer) -> str | None:
    """How a fitted ``theta`` comes from HunYuan's NTK alpha base ``theta0 * alpha^(d / (d - 2))`` written
    otherwise: the exponent left out (``theta0 * alpha``), or ``d`` taken from another width; None when the
    RoPE has no alpha or no reading fits."""
    alpha, theta0 = rope.get("alpha"), rope.unscaled_theta
    if not alpha or theta <= 1:
        return None
    readings = {f"theta * alpha = {theta0:g} * {alpha:g}: the exponent d / (d - 2) left out": theta0 * alpha}
    for name, d in (
        ("hidden_size / num_heads", (facts.hidden_size or 0) // (facts.num_heads or 1)),
        ("head_dim", layer.head_dim or 0),
    ):
        if d > 2 and d != rope.rotary_dim:
            readings[
                f"the NTK alpha exponent d / (d - 2) with d = {name} ({d}), not the rotary dims ({rope.rotary_dim})"
            ] = theta0 * alpha ** (d / (d - 2))
    return next((text for text, value in readings.items() if abs(theta / value - 1) < 2e-3), None)


def _unrotated_dims(e: Evidence, t: torch.Tensor, x: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """``(head_dim,)`` bool: the dims ``t`` leaves as ``x`` at every token whose position is past 0
    (``moved``, ``(batch, seq)``). Bit for bit where that gives a run of dims or none (dims with a zero
    frequency come through RoPE exactly); else within the node's tolerance (ours' pass-through dims are
    ours' projection, equal to the reference's up to rounding) when that gives one run, the only shape a
    pass-through has: dims of two runs merely turning too slowly to see (the lowest frequencies of each
    half) are not left alone."""
    a, b = t.transpose(1, 2)[moved].double(), x.transpose(1, 2)[moved].double()  # (tokens, heads, head_dim)
    exact = (a != b).sum(dim=(0, 1)) == 0
    if bool(exact.any()):
        return exact
    scale = float(b.abs().max()) if b.numel() else 0.0
    tol = max(e.result.atol, 1e-6 * scale) + e.result.rtol * scale
    close = (a - b).abs().amax(dim=(0, 1)) <= tol
    # a dim turning slowly (the lowest frequencies) moves further from x the later the position; a dim
    # passed through differs by rounding alone, whatever the position
    assert e.positions is not None  # rope_partial's guard: ``moved`` is read from them
    positions = e.positions[moved].double()  # (tokens,)
    dev = (a - b).abs().amax(dim=1)  # (tokens, head_dim)
    late, early = positions >= positions.quantile(2 / 3), positions <= positions.quantile(1 / 3)
    if bool(late.any()) and bool(early.any()):
        growing = dev[late].mean(0) > 3 * dev[early].mean(0) + 1e-12 * scale
        close = close & ~growing
    return close if _one_block(close) else exact


def rope_partial(e: Evidence) -> Hint | None:
    """Ours rotates other dims of each head than the reference: partial rotary over the whole head,
    or over the first dims where the reference pairs ``(i, i + head_dim/2)`` (Gemma 4's
    proportional RoPE), or the reverse. Dims with a zero frequency come through RoPE bit for bit."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    x = pre_rope(e, e.ours.shape[1])
    moved = e.positions > 0
    if (
        x is None
        or x.shape != e.ours.shape
        or moved.shape != (e.ours.shape[0], e.ours.shape[2])
        or not bool(moved.any())
        or e.close(e.ours, x)  # ours rotates nothing (within the node's tolerance): rope_pattern says rope_missing
        or e.close(e.ref, x)
    ):
        return None
    start = (e.positions == 0)[:, None, :, None].expand_as(x)
    layer = e.facts.layer(e.result.layer)
    factor = layer.rope.attention_factor if layer is not None and layer.rope is not None else 1.0
    at_start = x  # RoPE at position 0: the rotated dims times its cos/sin factor (LongRoPE's, YaRN's), the rest as is
    if factor != 1.0 and layer is not None and layer.rope is not None:
        at_start = x.clone()
        at_start[..., : layer.rope.rotary_dim] *= factor
    if bool(start.any()) and not e.close(e.ref[start], at_start[start]):
        return None  # RoPE leaves position 0 as it is: a side that changes it differs before RoPE
    ours, order = e.ours, None
    if bool(start.any()) and not e.close(ours[start], at_start[start]):
        # ours' head dims in another order (the rotated part put first), or its factor on other dims: read them in
        # the reference's order
        order = _dim_order(e, ours, x, e.positions == 0, factor)
        if order is None:
            return None
        ours = ours[..., order]
        if order == sorted(order):
            order = None  # the dims in place, ours' factor on other dims than the reference's: no other order
    ours_still, ref_still = _unrotated_dims(e, ours, x, moved), _unrotated_dims(e, e.ref, x, moved)
    if torch.equal(ours_still, ref_still) or bool(ref_still.all()) or bool(ours_still.all()):  # no RoPE: rope_pattern
        return None
    if not (_turns_alone(ours, x, ~ours_still, moved) and _turns_alone(e.ref, x, ~ref_still, moved)):
        return None  # the dims a side changes are no rotation (their lengths change: a norm after RoPE)
    faint = _faint_dims(e, x.shape[-1])
    if faint is not None:  # dims this layer's RoPE turns too little to see: no evidence either way
        ours_still = torch.where(faint, ref_still, ours_still)
        if torch.equal(ours_still, ref_still):
            return None
    other_type = rope_fit(e)  # another layer type's RoPE (its zero frequencies pass dims through): that, named
    if other_type is not None and other_type.kind == "rope_layer_type":
        return other_type
    d = e.ours.shape[-1]

    def rotated(still: torch.Tensor) -> str:
        dims = (~still).nonzero().flatten().tolist()
        return f"{len(dims)} of {d} dims ({fmt_list(dims, 8)})" if dims else "no dims"

    moved_dims = ""
    if order is not None:
        held = [order[j] for j in range(d) if not bool(ours_still[j])]  # ours' own dims holding the rotated ones
        moved_dims = (
            f"; ours also lays the head's dims out in another order: its dims "
            f"{fmt_list(held, 8)} hold the rotated ones (rotated and pass-through "
            "parts concatenated the other way round)"
        )
    return Hint(
        "rope_partial",
        f"likely partial rotary: the reference rotates {rotated(ref_still)} of each head and leaves the rest as they "
        f"are, ours rotates {rotated(ours_still)} (how many dims rotate, and which pairs: (i, i + d/2) over the whole "
        f"head, or within the first dims){moved_dims}",
        {
            "reference_rotated": (~ref_still).nonzero().flatten().tolist(),
            "ours_rotated": (~ours_still).nonzero().flatten().tolist(),
            "ours_dim_order": order,
        },
    )


def _turns_alone(t: torch.Tensor, x: torch.Tensor, dims: torch.Tensor, moved: torch.Tensor) -> bool:
    """Whether ``t`` changes ``x``'s ``dims`` (``(head_dim,)`` bool) as a rotation does at the tokens past position 0
    (``moved``): the length of those dims kept at every head and token, up to one factor for all (RoPE's cos/sin
    factor). A norm applied after RoPE rescales each row by its own statistic."""
    a = t.transpose(1, 2)[moved][..., dims].double().pow(2).sum(-1)  # (tokens, heads)
    b = x.transpose(1, 2)[moved][..., dims].double().pow(2).sum(-1)
    keep = b > 1e-12 * float(b.max()) if b.numel() else b > 0
    if not bool(keep.any()):
        return True
    ratio = a[keep] / b[keep]
    return float(ratio.std()) <= 1e-3 * float(ratio.mean()) if ratio.numel() > 1 else True


def _faint_dims(e: Evidence, head_dim: int) -> torch.Tensor | None:
    """``(head_dim,)`` bool: the dims this layer's RoPE turns, but by under 5e-3 radians at the run's last
    position (its lowest nonzero frequencies): a port's other frequencies may leave them bit for bit as
    they are, which is no partial rotary. None without the layer's RoPE."""
    layer = e.facts.layer(e.result.layer)
    if layer is None or layer.rope is None or e.positions is None:
        return None
    r = layer.rope.rotary_dim
    inv = torch.tensor(layer.rope.inv_freq, dtype=torch.float64)
    if inv.numel() != r // 2 or r > head_dim:
        return None
    per_dim = inv.repeat_interleave(2) if layer.rope.interleaved else torch.cat([inv, inv])
    angle = torch.zeros(head_dim, dtype=torch.float64)
    angle[:r] = per_dim * float(e.positions.max())
    faint = (angle > 0) & (angle < 5e-3)  # a zero frequency (proportional RoPE's) leaves its dims by design
    return faint


def _one_block(still: torch.Tensor) -> bool:
    """Whether the dims ``still`` marks form one run (or none): what partial rotary passes through; or the same
    run in each half of the head: what RoPE with its last frequencies zero (Gemma 4's proportional RoPE, pairs
    ``(i, i + d/2)``) passes through."""
    dims = still.nonzero().flatten()
    if dims.numel() == 0 or int(dims[-1] - dims[0]) + 1 == dims.numel():
        return True
    half = still.shape[-1] // 2
    return still.shape[-1] % 2 == 0 and torch.equal(still[:half], still[half:]) and _one_block(still[:half])


def _dim_order(
    e: Evidence, t: torch.Tensor, x: torch.Tensor, start: torch.Tensor, factor: float = 1.0
) -> list[int] | None:
    """``order`` with ``t[..., order]`` equal to ``x`` (or, on a rotated dim, ``x`` times RoPE's cos/sin
    ``factor``) at the tokens at position 0 (``start``, ``(batch, seq)``): which of ``t``'s head dims holds
    each of ``x``'s; None when some dim of ``x`` is in none."""
    a, b = t.transpose(1, 2)[start], x.transpose(1, 2)[start]  # (tokens, heads, head_dim)
    order: list[int] = []

    def holds(j: int, i: int) -> bool:
        return e.close(a[..., j], b[..., i]) or (factor != 1.0 and e.close(a[..., j], b[..., i] * factor))

    for i in range(b.shape[-1]):
        j = next((j for j in range(a.shape[-1]) if j not in order and holds(j, i)), None)
        if j is None:
            return None
        order.append(j)
    return order


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_tables(e: Evidence) -> Hint | None:
    """Ours' rotation is this layer's frequencies with the pairs and the cos/sin table laid out in another
    combination: pairs split in halves or interleaved, the table's frequencies concatenated ``cat(f, f)``
    or repeated ``repeat_interleave(f, 2)`` (a table laid out for the other pairing mixes two frequencies
    in one pair: no rotation, so no fit reads it). Each of the four is computed from the reference's
    input to RoPE and the one ours equals is named."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    layer = e.facts.layer(e.result.layer)
    x = pre_rope(e, e.ours.shape[1])
    if layer is None or layer.rope is None or x is None or x.shape != e.ours.shape:
        return None
    r = layer.rope.rotary_dim
    inv = torch.tensor(layer.rope.inv_freq, dtype=torch.float64)
    if inv.numel() != r // 2 or e.positions.shape != (x.shape[0], x.shape[2]):
        return None
    angles = e.positions.double()[:, None, :, None] * inv  # (batch, 1, seq, r/2)
    layouts = {
        "concatenated cat(f, f)": torch.cat([angles, angles], -1),
        "repeated per pair": angles.repeat_interleave(2, -1),
    }
    xd, head = x.double()[..., :r], x.double()[..., r:]
    amplitude = layer.rope.attention_factor
    d = x.shape[-1]
    if r < d and layer.rope.rope_type == "default":
        # partial rotary with tables built for the whole head: its d/2 frequencies theta^(-2i/d), cut to r
        whole = e.positions.double()[:, None, :, None] * torch.tensor(
            [layer.rope.theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64
        )
        layouts[f"built for the whole head (theta^(-2i/{d}), cat(f, f)) and cut to the {r} rotary dims"] = torch.cat(
            [whole, whole], -1
        )[..., :r]
    combos = {}
    for pairs, interleaved in (("half-split (i, i + d/2)", False), ("interleaved (2i, 2i + 1)", True)):
        for table, a in layouts.items():
            rotated = (xd * a.cos() + _rotate(xd, interleaved) * a.sin()) * amplitude
            combos[(pairs, table)] = torch.cat([rotated, head], -1)
    if r < d:
        # the rotary table padded to the whole head (cos 1, sin 0) and rotate_half taken over the whole head
        a = layouts["concatenated cat(f, f)"]
        pad = torch.zeros(*a.shape[:-1], d - r, dtype=a.dtype)
        cos, sin = torch.cat([a.cos() * amplitude, pad + 1], -1), torch.cat([a.sin() * amplitude, pad], -1)
        whole_pairs = f"half-split over the whole head (i, i + {d // 2})"
        combos[(whole_pairs, f"padded to head_dim with cos 1 and sin 0 past the {r} rotary dims")] = (
            x.double() * cos + _rotate(x.double(), False) * sin
        )
    # each side with the layer's attention factor on cos and sin, or without it (a port taking it on the scores)
    scales = (1.0,) if amplitude == 1.0 else (1.0, 1.0 / amplitude)

    def matching(side: torch.Tensor) -> list[tuple[str, str]]:
        return [
            c for c, t in combos.items() if any(e.close(side.double(), (t * k).to(side.dtype).double()) for k in scales)
        ]

    ours_is, ref_is = matching(e.ours), matching(e.ref)
    if not ours_is or not ref_is or set(ours_is) & set(ref_is):
        return None
    (ours_pairs, ours_table), (ref_pairs, ref_table) = ours_is[0], ref_is[0]

    def for_other(pairs: str, table: str) -> bool:  # a table laid out for the other pairing: two frequencies a pair
        return ("interleaved" in pairs) != (table == "repeated per pair")

    mixed = ours_pairs == ref_pairs or for_other(ours_pairs, ours_table) or for_other(ref_pairs, ref_table)
    if ours_table == ref_table and not mixed:
        return None  # the pairing alone: rope_pattern's pairing reading says it
    return Hint(
        "rope_pairing",
        f"likely RoPE's pairs and cos/sin table: ours rotates {ours_pairs} pairs with the table's frequencies "
        f"{ours_table}, the reference {ref_pairs} pairs with them {ref_table}"
        + (" (a table laid out for the other pairing gives each pair two frequencies)" if mixed else "")
        + (_PERMUTED_AT_LOAD if e.rows_permuted and ours_pairs != ref_pairs else ""),
        {"ours": list(ours_is[0]), "reference": list(ref_is[0]), "rows_permuted": e.rows_permuted},
    )


#: why the pairs differ where ours holds q/k's rows permuted per head at load
_PERMUTED_AT_LOAD = (
    "; ours holds q/k's rows permuted per head at load (the conversion between the two pairings, e.g. the Meta "
    "to Transformers permute), so its rotation acts on the other pairing of the reference's dims: a permute "
    "applied to a checkpoint already in the order its RoPE expects, or a permute without the matching RoPE"
)


def rope_pattern(e: Evidence) -> Hint | None:
    """Position 0 agrees and the error grows with position: RoPE (frequencies, scaling, pairing, offset)."""
    ours, ref = e.ours, e.ref
    # Only where RoPE acts: after attention, position 0 agrees trivially (it sees one key).
    if e.kind not in ("q_rot", "k_rot") or ours.dim() != 4 or ours.shape[2] < 3:
        return None
    per_pos = by_position(ours, ref, 2)
    tol = e.noise
    if float(per_pos[0]) > tol or float(per_pos.max()) <= tol:
        return None
    if float((per_pos[1:] > tol).double().mean()) < 0.5:
        return None  # a rotation differs at every later position; a few positions apart (padding leaking) are not it
    numbers = (
        f"position 0 agrees (error {float(per_pos[0]):.2g}), later positions differ "
        f"(pos 1: {float(per_pos[1]):.3g}, pos {len(per_pos) - 1}: {float(per_pos[-1]):.3g})"
    )
    evidence = {"position_0": float(per_pos[0]), "last_position": float(per_pos[-1])}
    x = pre_rope(e, ours.shape[1])
    ref_pairs = None
    if x is not None and x.shape == ours.shape:
        if e.close(ref, x):
            return Hint(
                "rope_unexpected",
                f"likely RoPE where the reference applies no rotation (a NoPE layer): the reference's {e.kind} is its unrotated input; {numbers}",
                evidence,
            )
        if e.close(ours, x):
            layer = e.facts.layer(e.result.layer)
            nope = sorted({t for t in e.facts.layer_types if e.facts.rope_of_type(t) is None})
            unrotated = [str(n.index) for n in e.facts.layers if n.rope is None]
            if layer is not None and layer.rope is not None and unrotated and e.facts.nope_field:
                pattern = (  # a per-layer list says which layers are NoPE (SmolLM3), not their type
                    f"; the config's {e.facts.nope_field} leaves layer(s) {', '.join(unrotated)} unrotated (NoPE) and "
                    f"rotates this layer {layer.index}: ours may mark other layers NoPE (the list read inverted, 1 "
                    "taken for NoPE, or their interval counted from another start)"
                )
            elif layer is not None and nope and layer.layer_type not in nope:
                pattern = (
                    f"; this {layer.layer_type} layer rotates in the reference while its {', '.join(nope)} layers do "
                    "not: ours may take it for one of those (the layer pattern counted from another start)"
                )
            elif (
                layer is not None
                and layer.rope is not None
                and (alike := [n.index for n in e.facts.layers if n.layer_type == layer.layer_type and n.rope is None])
            ):
                pattern = (
                    f"; this {layer.layer_type} layer {layer.index} rotates in the reference while {layer.layer_type} "
                    f"layer(s) {fmt_list(alike)} do not (a per-layer rule: Cohere2-MoE's dense prefix layers rotate, "
                    "force_rope): ours may treat it as one of those"
                )
            else:
                pattern = ""
            return Hint(
                "rope_missing",
                f"likely a missing RoPE: ours applies no rotation here, the reference does (or rotates every token by "
                f"position 0: positions read from another axis, the batch index of a seq-first cache){pattern}; "
                f"{numbers}",
                {**evidence, "nope_layer_types": nope},
            )
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
        # partial rotary: the pairs within the dims the config rotates
        r = declared if declared and declared % 2 == 0 and declared < ours.shape[-1] else ours.shape[-1]
        ours_pairs, ref_pairs = _pairing(ours[..., :r], x[..., :r]), _pairing(ref[..., :r], x[..., :r])
        if ours_pairs and ref_pairs and ours_pairs != ref_pairs:
            return Hint(
                "rope_pairing",
                f"likely RoPE pairing layout: ours rotates {ours_pairs} pairs, the reference {ref_pairs}; {numbers}",
                {**evidence, "ours": ours_pairs, "reference": ref_pairs},
            )
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
            f"{precision:.2g} relative (bfloat16 rounding is 4e-3): inverse frequencies or angles computed or rounded in a lower "
            f"precision than the reference's float32; {numbers}",
            {**evidence, "relative": precision},
        )
    # a band: the highest and the lowest frequency agree, the error sits between (a YaRN / llama3 ramp)
    if bad and bad[0] > 0 and bad[-1] < d // 2 - 1:
        band = (
            f" (a {rope_type} correction range / ramp band: rounding or clamping)"
            if rope_type in ("yarn", "llama3")
            else ""
        )
        return Hint(
            "rope_band",
            f"likely RoPE frequencies{band}: error confined to a band of rotary frequencies "
            f"{fmt_list(bad)} of {d // 2}; {numbers}",
            {**evidence, "band": bad},
        )
    return Hint("rope_frequencies", f"likely RoPE frequencies, scaling or offset: {numbers}", evidence)


def rope_precision(e: Evidence) -> Hint | None:
    """q/k rotated by the layer's cos/sin table rounded to bfloat16 or float16 on one side (a table built or cached
    in a low precision, used with float32 activations), the float32 table on the other: every position differs a
    little, position 0 too where the attention factor is inside the table (YaRN's)."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.ours.shape != e.ref.shape:
        return None
    x = pre_rope(e, e.ours.shape[1])
    found = _rounded_table(e, x) if x is not None and x.shape == e.ours.shape else None
    if found is None:
        return None
    side, dtype = found
    return Hint(
        "rope_precision",
        f"likely the RoPE's cos/sin table rounded to {dtype} in {side} (built or cached in {dtype}, then used with "
        f"float32 q/k): {whose(side)} {e.kind} is the rotation by the rounded table, "
        f"{whose('the reference' if side == 'ours' else 'ours')} by the float32 one",
        {"side": side, "dtype": dtype},
    )


def _rounded_table(e: Evidence, x: torch.Tensor) -> tuple[str, str] | None:
    """``(side, dtype)``: one side's rotation of ``x`` (the unrotated q/k, ``(batch, heads, seq, head_dim)``) uses
    this layer's cos/sin (its attention factor inside) rounded to bfloat16 or float16, the other side's the float32
    table (Transformers' ``..RotaryEmbedding`` returns cos/sin in the activations' dtype): each side's value read up
    to one factor per position (a query scale by position after RoPE, Llama 4's)."""
    layer = e.facts.layer(e.result.layer)
    if layer is None or layer.rope is None or e.positions is None or e.positions.shape != (x.shape[0], x.shape[2]):
        return None
    rope, d = layer.rope, layer.rope.rotary_dim
    if layer.rope.interleaved or d % 2 or d > x.shape[-1]:
        return None
    angle = e.positions.double()[:, None, :, None] * torch.tensor(rope.inv_freq, dtype=torch.float32).double()
    angle = torch.cat((angle, angle), -1).float()  # as Transformers: float32 angles, cos/sin times the factor
    cos, sin = angle.cos() * rope.attention_factor, angle.sin() * rope.attention_factor
    xd = x.double()
    half = torch.cat((-xd[..., d // 2 : d], xd[..., : d // 2]), -1)

    def rotated(c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = xd.clone()
        out[..., :d] = xd[..., :d] * c.double() + half * s.double()
        return out

    def fits(value: torch.Tensor, form: torch.Tensor) -> bool:
        v = value.double()
        scale = (v * form).sum((1, 3), keepdim=True) / form.pow(2).sum((1, 3), keepdim=True).clamp_min(1e-30)
        return rel(v, form * scale) < 1e-6

    exact = rotated(cos, sin)
    for dtype in (torch.bfloat16, torch.float16):
        low = rotated(cos.to(dtype), sin.to(dtype))
        if rel(low, exact) < 1e-6:
            continue  # rounding changes nothing here
        for side, value, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
            if fits(value, low) and fits(other, exact):
                return side, str(dtype).replace("torch.", "")
    return None


def _frequency_precision(e: Evidence, x: torch.Tensor, pairing: str | None) -> float | None:
    """The largest relative difference of ours' rotation angles from the reference's, when every
    frequency is off by under 1% (a precision problem, not a different formula), else None."""
    from parity.diagnose.rope_fit import rotation

    layer = e.facts.layer(e.result.layer)
    if layer is None or layer.rope is None or e.positions is None:
        return None
    interleaved = pairing is not None and pairing.startswith("interleaved")
    ours_r, _ = rotation(x, e.ours, interleaved, layer.rope.rotary_dim)
    ref_r, weight = rotation(x, e.ref, interleaved, layer.rope.rotary_dim)
    last = int(e.positions[0].argmax())
    delta = (ours_r[0, last] / ref_r[0, last]).angle().abs()
    inv_freq = torch.tensor(layer.rope.inv_freq, dtype=torch.float64)
    if inv_freq.numel() != delta.shape[-1]:
        return None
    # each angle unwrapped: the position times the frequency (the reference's rotation is this layer's RoPE)
    angle_ref = (float(e.positions[0, last]) * inv_freq).expand_as(delta)
    keep = (angle_ref > 1e-3) & (weight[0, last] > 0)
    if not bool(keep.any()) or not bool((delta[keep] > 0).any()):
        return None
    relative = float((delta[keep] / angle_ref[keep]).max())
    return relative if relative < 1e-2 else None


def norm_after_rope(e: Evidence) -> Hint | None:
    """A q/k norm whose input in ours is the reference's input rotated: equal where RoPE leaves a token
    as it is (position 0), each rotated pair of dims of the same length elsewhere. Ours normalises q
    (or k) after RoPE, the reference before it."""
    if not (e.kind.startswith(("q_", "k_")) and "norm" in e.kind) or e.positions is None:
        return None
    x_ref, x_ours = e.ref_trace.inputs.get(e.name), e.ours_trace.inputs.get(e.name)
    if x_ref is None or x_ref.dim() < 3:
        return None
    b, seq = e.positions.shape
    d = e.facts.head_dim
    if not d or d % 2 or x_ref.shape[-1] % d or x_ref.numel() % (b * seq * d):
        return None
    n_heads = x_ref.numel() // (b * seq * d)
    if x_ours is None:  # ours' norm computed in functions, its input unread: its output and the norm's gain instead
        found = _normalised_both(e, x_ref, n_heads, d, seq)
        if found is None:
            return None
        x_ref, x_ours = found
    if x_ref.numel() != x_ours.numel():
        return None
    ref = heads_first(x_ref.reshape(b, seq, n_heads * d) if x_ref.shape[1] == seq else x_ref, n_heads, d, seq)
    start = e.positions == 0
    if ref is None or not bool(start.any()) or bool(start.all()):
        return None
    candidates = [heads_first(x_ours, n_heads, d, seq)]
    if x_ours.dim() == 4 and x_ours.shape[1] == x_ours.shape[2]:  # seq == heads: both layouts possible
        candidates.append(x_ours.transpose(1, 2))
    first = start[:, None, :, None].expand_as(ref)

    for ours in candidates:
        if ours is None or ours.shape != ref.shape or e.close(ours, ref):
            continue
        layer = e.facts.layer(e.result.layer)
        r = layer.rope.rotary_dim if layer is not None and layer.rope is not None else d
        interleaved = layer is not None and layer.rope is not None and layer.rope.interleaved
        if e.close(ours[first], ref[first]) and e.close(
            pair_lengths(ours, r, interleaved), pair_lengths(ref, r, interleaved)
        ):
            return Hint(
                "norm_placement",
                f"likely norm placement: ours' {e.kind} reads its input after RoPE (the reference's input rotated: equal "
                f"at position 0, each rotated pair of the same length), the reference normalises before RoPE",
                {"ours_reads": "after RoPE"},
            )
    return None


def norm_after_rope_at_rotation(e: Evidence) -> Hint | None:
    """A rotated q (or k) whose q/k norm ours computes untapped (its per-head gains held in one table), and
    applies after RoPE: ours' ``q_rot`` is the reference's norm (its statistic, its gains and bias) of the
    reference's input to that norm rotated, where the reference rotates the norm's output. Read with the
    norm's statistic that reproduces the reference's own norm (RMS, or LayerNorm's: StableLM's per-head
    ``q_layernorm``)."""
    from parity.diagnose.rope_fit import rotate

    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    layer = e.facts.layer(e.result.layer)
    if layer is None or layer.rope is None or e.ours.shape != e.ref.shape:
        return None
    b, h, seq, d = e.ref.shape
    found = qk_norm_function(e, e.name.rsplit(".", 1)[0], e.kind[0], h, d, seq)
    if found is None or e.positions.shape != (b, seq):
        return None
    normed, x = found
    after = normed(rotate(x, layer.rope, e.positions))
    if e.close(e.ours, after.to(e.ours.dtype)) and not e.close(e.ref, after.to(e.ref.dtype)):
        return Hint(
            "norm_placement",
            f"likely norm placement: ours' {e.kind} is the reference's {e.kind[0]} norm applied after RoPE (its "
            f"input rotated, then normalised with its gains), the reference normalises {e.kind[0]} before RoPE",
            {"ours_reads": "after RoPE"},
        )
    return None


def qk_norm_function(
    e: Evidence, stem: str, letter: str, heads: int, d: int, seq: int
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None:
    """``(the reference's q (k) norm of the attention stem as a function of (batch, heads, seq, head_dim) values,
    its input)``: the statistic (RMS, or LayerNorm's mean-subtracted one) that reproduces the reference's own
    norm output from its input, with its gains and bias; None without such a norm."""
    norm = _qk_norm(e, stem, letter, heads, d, seq)
    if norm is None:
        return None
    from parity.diagnose.norms import _normalisers

    x, y, weight, bias = norm
    eps = e.facts.norm_eps or 1e-6
    for statistic in ("RMSNorm over the last axis", "LayerNorm (mean-subtracting)"):

        def normed(t: torch.Tensor, statistic: str = statistic) -> torch.Tensor:
            return _normalisers(t, None, eps)[statistic] * weight + bias

        if rel(normed(x), y) <= 1e-4:
            return normed, x
    return None


def _qk_norm(
    e: Evidence, stem: str, letter: str, heads: int, d: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The reference's q (k) norm of the attention ``stem``: its input and output ``(batch, heads, seq, head_dim)``,
    its gains and bias ``(heads, 1, head_dim)`` (per head, StableLM's ``q_layernorm.norms.<h>``) or ``(head_dim,)``
    (zeros without a bias); None without one."""
    for kind in (f"{letter}_norm", f"{letter}_layernorm"):
        base = f"{stem}.{kind}"
        names = [f"{base}.norms.{i}" for i in range(heads)]
        if all(n in e.ref_trace.inputs for n in names):
            parts = [(e.ref_trace.inputs[n], e.ref_trace.tensors.get(n), e.ref_trace.weights.get(n)) for n in names]
            if any(out is None or w is None or w.shape != (d,) or x.dim() != 4 for x, out, w in parts):
                return None
            x = torch.cat([x for x, _, _ in parts], 1).double()
            y = torch.cat([cast(torch.Tensor, out) for _, out, _ in parts], 1).double()
            weight = torch.stack([cast(torch.Tensor, w) for _, _, w in parts])[:, None].double()
            biases = [e.ref_trace.biases.get(n) for n in names]
            bias = (
                torch.stack([cast(torch.Tensor, c) for c in biases])[:, None].double()
                if all(c is not None and c.shape == (d,) for c in biases)
                else torch.zeros(d, dtype=torch.float64)
            )
        elif (
            base in e.ref_trace.inputs
            and base in e.ref_trace.tensors
            and (w := e.ref_trace.weights.get(base)) is not None
        ):
            x_in = heads_first(e.ref_trace.inputs[base], heads, d, seq)
            y_out = heads_first(e.ref_trace.tensors[base], heads, d, seq)
            if x_in is None or y_out is None or w.shape != (d,):
                return None
            x, y, weight = x_in.double(), y_out.double(), w.double()
            c = e.ref_trace.biases.get(base)
            bias = c.double() if c is not None and c.shape == (d,) else torch.zeros(d, dtype=torch.float64)
        else:
            continue
        return (x, y, weight, bias) if x.shape == y.shape == (e.ref.shape[0], heads, seq, d) else None
    return None


def _normalised_both(
    e: Evidence, x_ref: torch.Tensor, n_heads: int, d: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(the reference's q/k norm output, ours')``, each divided by the norm's per-dim gain (read from the reference:
    its output over its input's RMS-normalised rows, one factor per dim), ``(batch, heads, seq, head_dim)``; None when
    the reference's output is no such norm of its input, or ours' has another shape."""
    ref_in = heads_first(x_ref.double().reshape(x_ref.shape[0], seq, n_heads * d), n_heads, d, seq)
    ref_out = (
        heads_first(e.ref.double().reshape(e.ref.shape[0], seq, -1), n_heads, d, seq) if e.ref.dim() >= 3 else None
    )
    ours = (
        heads_first(e.ours.double().reshape(e.ours.shape[0], seq, -1), n_heads, d, seq) if e.ours.dim() >= 3 else None
    )
    if ref_in is None or ref_out is None or ours is None or ours.shape != ref_out.shape:
        return None
    normed = ref_in * ref_in.pow(2).mean(-1, keepdim=True).add(e.facts.norm_eps or 1e-30).rsqrt()
    keep = normed.abs() > 1e-6
    gain = torch.where(keep, ref_out / torch.where(keep, normed, torch.ones_like(normed)), torch.nan)
    gain = gain.flatten(0, -2).nanmedian(0).values  # (head_dim,): one factor per dim
    if not bool(torch.isfinite(gain).all()) or bool((gain.abs() < 1e-6).any()) or rel(normed * gain, ref_out) > 1e-3:
        return None
    return normed, ours / gain


def values_rotated(e: Evidence) -> Hint | None:
    """The attention context of one side is the probabilities times the values rotated by the layer's
    RoPE (RoPE applied to v as well as q and k), the other side's the plain values."""
    if e.kind != "context" or e.result.layer is None or e.positions is None:
        return None
    from parity.diagnose.rope_fit import rotate

    layer = e.facts.layer(e.result.layer)
    found = attention_values(e)
    if layer is None or layer.rope is None or found is None:
        return None
    probs, v = found
    b, h, t, _ = probs.shape
    kv, d = v.shape[1], v.shape[-1]
    if e.positions.shape != (b, t):
        return None

    def context(v_heads: torch.Tensor) -> torch.Tensor | None:
        c = probs.double() @ v_heads.repeat_interleave(h // kv, dim=1)  # (b, h, t, d)
        for form in (c, c.transpose(1, 2), c.transpose(1, 2).reshape(b, t, h * d)):
            if form.shape == e.ref.shape:
                return form
        return None

    plain, rotated = context(v), context(rotate(v, layer.rope, e.positions))
    if plain is None or rotated is None:
        return None
    for side, value, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        if e.close(value, rotated.to(value.dtype)) and e.close(other, plain.to(other.dtype)):
            return Hint(
                "rope_unexpected",
                f"likely RoPE applied to the values in {side}: its context is the probabilities times v rotated by "
                "this layer's RoPE; RoPE turns q and k only",
                {"side": side, "rotated": "v"},
            )
    return None


def qkv_clip(e: Evidence) -> Hint | None:
    """A ``clip_qkv`` (OLMo) done otherwise on one side: q, k (at ``q_rot``/``k_rot``) or v (at the
    context) not clamped, clamped above only, or q and k clamped after RoPE instead of before; each
    side's tensor is matched against the reference's projection through each form."""
    clip = e.facts.clip_qkv
    layer = e.facts.layer(e.result.layer)
    if not clip or layer is None or e.positions is None:
        return None
    from parity.diagnose.rope_fit import rotate

    if e.kind in ("q_rot", "k_rot") and e.ours.dim() == 4 and layer.rope is not None:
        for p in _projections_before_rope(e):
            if p.shape != e.ours.shape or e.positions.shape != (p.shape[0], p.shape[2]):
                continue
            p = p.double()
            forms = {
                f"clamped to [-{clip:g}, {clip:g}] before RoPE": rotate(p.clamp(-clip, clip), layer.rope, e.positions),
                "not clamped": rotate(p, layer.rope, e.positions),
                f"clamped above only (max {clip:g})": rotate(p.clamp(max=clip), layer.rope, e.positions),
                f"clamped to [-{clip:g}, {clip:g}] after RoPE": rotate(p, layer.rope, e.positions).clamp(-clip, clip),
                f"soft-capped {clip:g} * tanh(x / {clip:g}) before RoPE (not clamped)": rotate(
                    clip * torch.tanh(p / clip), layer.rope, e.positions
                ),
            }
            if forms_of(e, forms, e.ref, e.ref)[0] is not None:
                break  # the layout in which the reference is one of the forms
        else:
            return None
        what = e.kind[0]
    elif e.kind == "context":
        found = attention_values(e)
        if found is None:
            return None
        probs, v = found
        b, h, t, _ = probs.shape
        d = v.shape[-1]

        def context(values: torch.Tensor) -> torch.Tensor:
            c = (probs.double() @ values.repeat_interleave(h // v.shape[1], dim=1)).transpose(1, 2)
            return c.reshape(b, t, h * d) if e.ref.dim() == 3 else c.transpose(1, 2)

        forms = {
            f"clamped to [-{clip:g}, {clip:g}]": context(v.clamp(-clip, clip)),
            "not clamped": context(v),
            f"clamped above only (max {clip:g})": context(v.clamp(max=clip)),
        }
        what = "v"
    else:
        return None

    ours_is, ref_is = forms_of(e, forms, e.ours, e.ref)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    return Hint(
        "clamp",
        f"likely clip_qkv ({clip:g}): ours' {what} is {ours_is}, the reference's {ref_is} (q, k and v clamped to "
        f"[-{clip:g}, {clip:g}] right after their projections, before RoPE)",
        {"ours": ours_is, "reference": ref_is, "clip_qkv": clip, "tensor": what},
    )


def _projections_before_rope(e: Evidence) -> list[torch.Tensor]:
    """The reference's q (k) before RoPE ``(batch, heads, seq, head_dim)``: from its own projection or norm
    node, else each way a fused q/k/v output may be cut (:func:`fused_layouts`)."""
    p = projection_heads(e, e.ours.shape[1])
    if p is not None:
        return [p]
    stem = e.name.rsplit(".", 1)[0]
    fused = fused_output(e, stem)
    d, heads = e.ref.shape[-1], e.facts.num_heads
    if fused is None or fused.dim() != 3 or not d or not heads:
        return []
    index = 0 if e.kind == "q_rot" else 1
    return [parts[index] for parts in fused_layouts(fused, heads, e.facts.num_kv_heads or heads, d).values()]


def bias_after_rope(e: Evidence) -> Hint | None:
    """A rotated q or k whose projection's bias one side adds after RoPE (the bias not rotated): that
    side's tensor is RoPE of the projection without its bias, plus the bias (Qwen2-style q/k biases)."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    from parity.diagnose.rope_fit import rotate

    layer = e.facts.layer(e.result.layer)
    stem = e.name.rsplit(".", 1)[0]
    bias = e.ref_trace.biases.get(f"{stem}.{e.kind[0]}_proj")
    b, h, t, d = e.ref.shape
    x = pre_rope(e, h)
    if layer is None or layer.rope is None or bias is None or x is None or bias.numel() != h * d:
        return None
    if e.positions.shape != (b, t):
        return None
    per_head = bias.double().reshape(1, h, 1, d)
    late = rotate(x.double() - per_head, layer.rope, e.positions) + per_head
    for side, value, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        if e.close(value, late.to(value.dtype)) and not e.close(other, late.to(other.dtype)):
            return Hint(
                "bias",
                f"likely the {e.kind[0]}_proj bias added after RoPE in {side}: its {e.kind} is RoPE of the projection "
                "without its bias, plus the bias (the bias not rotated); the bias belongs to the projection, before RoPE",
                {"side": side, "bias": f"{stem}.{e.kind[0]}_proj"},
            )
    return None


def bias_scaled_apart(e: Evidence) -> Hint | None:
    """A q (or k) without RoPE, one side's the other's plus its projection's bias times one constant at every token:
    the bias scaled otherwise than the weight (fairseq's ``q_proj(x) * scaling`` ported as the scale folded into
    ``q_proj``'s weight alone: ours - reference = (1 - scaling) x bias). Either side, by the sign of the factor."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.ours.shape != e.ref.shape:
        return None
    layer = e.facts.layer(e.result.layer)
    stem = e.name.rsplit(".", 1)[0]
    bias = e.ref_trace.biases.get(f"{stem}.{e.kind[0]}_proj")
    b, h, t, d = e.ref.shape
    if layer is None or layer.rope is not None or bias is None or bias.numel() != h * d or b * t < 2:
        return None
    ours, ref = (x.double().permute(0, 2, 1, 3).reshape(b * t, h * d) for x in (e.ours, e.ref))
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == (b, t):
        real = e.attention_mask.reshape(-1).bool()
        ours, ref = ours[real], ref[real]
    bias, scale = bias.double().flatten(), d**-0.5
    # ours = a x reference + k x bias at every token: a = 1 (compared unscaled), or scaling (ours' q scaled, the
    # reference's scaled in its attention): the weight scaled with one factor, the bias with another
    for a in (1.0, scale, 1 / scale):
        diff = ours - a * ref
        vector = diff.mean(0)
        k = float(vector @ bias / (bias @ bias).clamp_min(1e-300))
        if rel(diff, vector.expand_as(diff)) > 1e-4 or abs(k) < 1e-6 or rel(vector, k * bias) > 1e-4:
            continue
        side = (
            "ours" if (a == scale and k > 0) or (a == 1.0 and k > 0) or (a == 1 / scale and k < 0) else "the reference"
        )
        weight = {1.0: "", scale: f" times scaling (head_dim^-0.5 = {scale:.6g})", 1 / scale: " over scaling"}[a]
        return Hint(
            "bias",
            f"likely {e.kind[0]}_proj's bias scaled otherwise than its weight in {side}: ours' {e.kind} is the "
            f"reference's{weight} {'plus' if k > 0 else 'less'} {abs(k):.6g} x the bias at every token (the softmax "
            f"scale folded into {e.kind[0]}_proj's weight and not its bias, where the reference scales the "
            "projection's output, bias included)",
            {"side": side, "factor": k, "weight_factor": a},
        )
    return None


def gain_across_rope(e: Evidence) -> Hint | None:
    """A rotated q or k whose per-channel gain (a q/k norm's weight, nGPT's and Dory's ``sqk``) one side applies
    before RoPE and the other after it: position 0 agrees (no rotation), later positions differ. With ``v`` the
    before-side's tensor rotated back (``G x``) and ``t = g_a / g_b`` per rotated pair and head, the after-side's
    pair is ``(c v_a - s t v_b, s v_a / t + c v_b)`` (``c, s`` the layer's RoPE at each position); ``t`` is read by
    least squares and must explain every position. Either side."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    from parity.diagnose.rope_fit import _pairs

    layer = e.facts.layer(e.result.layer)
    rope = layer.rope if layer is not None else None
    b, _, t, d = e.ref.shape
    if rope is None or e.positions.shape != (b, t) or t < 2 or not rope.inv_freq:
        return None
    r = rope.rotary_dim
    if r < d and not e.close(e.ours[..., r:], e.ref[..., r:]):
        return None
    angle = e.positions.double()[:, None, :, None] * torch.tensor(rope.inv_freq, dtype=torch.float64)
    amplitude = float(rope.attention_factor)
    c, s = amplitude * angle.cos(), amplitude * angle.sin()
    for side, before, after in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        v = _pairs(before, rope.interleaved, r) * torch.polar(torch.ones_like(angle), -angle) / amplitude
        z = _pairs(after, rope.interleaved, r)
        va, vb, ra, rb = v.real, v.imag, z.real, z.imag
        ratio = -((ra - c * va) * s * vb).sum((0, 2)) / (s * vb).pow(2).sum((0, 2)).clamp_min(1e-300)  # (heads, pairs)
        if not bool((ratio > 1e-6).all()):
            continue  # a ratio of -1 is the rotation reversed (rope_fit's), not a gain; gains keep their sign
        tt = ratio[None, :, None, :]
        error = ((c * va - s * tt * vb - ra).pow(2) + (s * va / tt + c * vb - rb).pow(2)).sum().sqrt()
        if float(error / (ra.pow(2) + rb.pow(2)).sum().sqrt()) > 1e-3 or float((ratio - 1).abs().max()) < 1e-2:
            continue
        other = "the reference" if side == "ours" else "ours"
        letter = e.kind[0]
        return Hint(
            "gain_order",
            f"likely a per-channel gain on {letter} applied before RoPE in {side}, after it in {other} (a {letter} "
            "norm's weight or a learned q/k scale moved across the rotation): position 0 agrees, and the later "
            "positions fit one gain ratio per rotated pair and head "
            f"({fmt_list(f'{x:.3g}' for x in ratio.flatten()[:4].tolist())})",
            {"side": side, "pair_ratios": ratio.flatten()[:16].tolist()},
        )
    return None


def rope_skipped(e: Evidence) -> Hint | None:
    """One side's q (k) at this layer is the projection's as RoPE would read it, unrotated (times one factor per
    position at most: a NoPE layer's query temperature), while the other side's is not: RoPE skipped on one
    side at this layer, a layer pattern saying which layers rotate (Llama 4's ``no_rope_layers``, 1 = RoPE)
    read otherwise or inverted. Either side."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    x = pre_rope(e, e.ours.shape[1])
    if x is None or x.shape != e.ours.shape:
        return None
    x = x.double()

    def per_position(t: torch.Tensor) -> torch.Tensor | None:
        """t = x times one factor per (batch, position), or None."""
        keep = x.abs() > 1e-3 * float(x.abs().max())
        ratio = torch.where(keep, t.double() / torch.where(keep, x, torch.ones_like(x)), torch.nan)
        f = ratio.nanmedian(dim=-1).values.nanmedian(dim=1).values  # (batch, seq)
        if not bool(torch.isfinite(f).all()) or rel(t.double(), x * f[:, None, :, None]) > 1e-6:
            return None
        return f

    layer = e.facts.layer(e.result.layer)
    rotates = layer is not None and layer.rope is not None  # the reference's facts: RoPE on this layer

    def turned(t: torch.Tensor) -> bool:
        """t is x rotated: each pair (half-split or interleaved) keeps x's length at every position."""
        half = t.shape[-1] // 2
        for pairs in (
            lambda y: y[..., :half] ** 2 + y[..., half:] ** 2,
            lambda y: y[..., 0::2] ** 2 + y[..., 1::2] ** 2,
        ):
            if rel(pairs(t.double()), pairs(x)) < 1e-6:
                return True
        return False

    for side, this, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        f = per_position(this)
        if f is None or per_position(other) is not None:
            continue
        if not turned(other) and (side != "ours" or not rotates):
            continue  # the other side is no rotation of q (nor, for ours, the reference's RoPE layer): no RoPE skipped
        scaled = float((f - 1).abs().max()) > 1e-6
        return Hint(
            "rope_missing" if side == "ours" else "rope_unexpected",
            f"likely RoPE skipped in {side} at this layer: its {e.kind[0]} is the projection's, unrotated"
            + (" (times one factor per position: a NoPE layer's query temperature)" if scaled else "")
            + ", where the other side rotates it: the pattern of which layers use RoPE (no_rope_layers, a NoPE "
            "interval, a layer type) read otherwise or inverted",
            {"side": side, "per_position_factor": scaled},
        )
    return None


def heads_unrotated(e: Evidence) -> Hint | None:
    """Some heads of one side come out of RoPE as they went in while the others are rotated as the other
    side's (RoPE applied to the first ``rotary_dim`` features of the merged heads, ``(batch, seq, heads *
    head_dim)``, before the heads were split: only head 0 turns), or the dims RoPE passes through taken
    from the other projection (``k = cat(k_rot, q_pass)``); either side."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None or e.ours.shape[1] < 2:
        return None
    x = pre_rope(e, e.ours.shape[1])
    if x is None or x.shape != e.ours.shape or e.close(e.ref, x):
        return None
    heads = range(e.ours.shape[1])
    for side, this, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        rotated = [h for h in heads if e.close(this[:, h], other[:, h])]
        still = [h for h in heads if h not in rotated and e.close(this[:, h], x[:, h])]
        if rotated and still and len(rotated) + len(still) == len(heads):
            return Hint(
                "rope_partial",
                f"likely RoPE applied to only some heads in {side}: head(s) {fmt_list(still)} come out unrotated "
                f"(equal to q/k before RoPE), head(s) {fmt_list(rotated)} rotated as the other side's: the rotary "
                "dims cut from the merged (heads * head_dim) features before the heads were split",
                {"side": side, "unrotated_heads": still, "rotated_heads": rotated},
            )
    return _pass_from_other(e)


def _pass_from_other(e: Evidence) -> Hint | None:
    """k's (q's) dims past the rotary part equal the other projection's on one side: the pass-through part
    concatenated from the wrong tensor (``cat(k_rot, q_pass)``, a copy-paste)."""
    layer = e.facts.layer(e.result.layer)
    rotary = layer.rope.rotary_dim if layer is not None and layer.rope is not None else 0
    sibling = e.ref_trace.tensors.get(e.name.rsplit(".", 1)[0] + (".q_rot" if e.kind == "k_rot" else ".k_rot"))
    if not rotary or rotary >= e.ours.shape[-1] or sibling is None or sibling.dim() != 4:
        return None
    if sibling.shape[1] != e.ours.shape[1] and e.ours.shape[1] % sibling.shape[1] == 0:
        sibling = sibling.repeat_interleave(e.ours.shape[1] // sibling.shape[1], dim=1)
    if sibling.shape != e.ours.shape:
        return None
    own, there = e.kind[0], "q" if e.kind == "k_rot" else "k"
    for side, this, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        if (
            e.close(this[..., :rotary], other[..., :rotary])
            and e.close(this[..., rotary:], sibling[..., rotary:])
            and not e.close(other[..., rotary:], sibling[..., rotary:])
        ):
            return Hint(
                "swapped_roles",
                f"likely the pass-through dims of {own} taken from {there} in {side}: its rotated dims (0..{rotary - 1}) "
                f"agree, its dims {rotary}.. equal {there}'s (cat({own}_rot, {there}_pass): a copy-paste)",
                {"side": side, "from": there},
            )
    return None
