"""Detectors of state carried across calls and chunks: a short conv continuing from other cached
inputs, a recurrent state not carried, an error starting at a chunk boundary; and the hints of a
decode step whose attention reads other cached keys than the reference's (fewer: a cache cut too
early or not read; more, with weight: the window mask), by sequence index."""

from __future__ import annotations

import torch

from parity.diagnose.evidence import Evidence, by_position, call_index, fmt_list, positions_axis, rel
from parity.diagnose.hints import Hint
from parity.model.facts import LINEAR


def chunk_boundary(e: Evidence) -> Hint | None:
    """Positions before a chunk boundary agree, the first differing one starts a chunk: the state a
    chunked linear-attention recurrence carries from one chunk to the next (``facts.chunk_size``)."""
    chunk, axis = e.facts.chunk_size, positions_axis(e)
    if not chunk or axis is None or e.ours.shape[axis] <= chunk:
        return None
    per_pos = by_position(e.ours, e.ref, axis)
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


def _linear_layer(e: Evidence) -> bool:
    layer = e.facts.layer(e.result.layer)
    return layer is not None and layer.layer_type == LINEAR


def conv_context(e: Evidence) -> Hint | None:
    """In a call continuing a cache, only the first ``conv_kernel - 1`` positions of a linear-attention
    layer differ, later ones agree: those are the outputs whose window reaches back into the previous
    call's inputs (the conv state). The cached inputs are not carried, or the wrong ones are read."""
    k, axis = e.facts.conv_kernel, positions_axis(e)
    if not k or axis is None or not call_index(e.name) or not _linear_layer(e) or e.ours.shape[axis] < k:
        return None
    per_pos = by_position(e.ours, e.ref, axis)
    bad = (per_pos > e.noise).nonzero().flatten().tolist()
    if not bad or bad[-1] >= k - 1:
        return None
    return Hint(
        "conv_state",
        f"likely the short conv's cached inputs: in this call (step {call_index(e.name)}, continuing the cache) "
        f"positions {fmt_list(bad)} differ and positions {k - 1}.. agree; with kernel {k} the first {k - 1} outputs "
        f"read the previous call's last {k - 1} inputs (the conv state): not carried, or the wrong ones taken from it",
        {"conv_kernel": k, "positions": bad, "step": call_index(e.name)},
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
    return Hint(
        "conv_state",
        f"likely the conv state never stored: ours holds zeros where the reference holds the last {held} conv inputs",
        {"shift": None, "held": held},
    )


def cached_state(e: Evidence) -> Hint | None:
    """A linear-attention layer's cache after a step: a conv state shifted or empty (see
    :func:`_conv_shift`), a recurrent state that is zeros where the reference's is not."""
    if e.kind == "cache.conv_state" and e.ours.dim() == 3:
        return _conv_shift(e)
    if e.kind == "cache.recurrent_state" and bool((e.ours == 0).all()) and bool((e.ref != 0).any()):
        return Hint(
            "state_not_carried",
            "likely the recurrent state never stored: ours holds zeros after the step, "
            "the reference the state after its last token",
            {},
        )
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
    v = mixed[..., -h * d_v :].reshape(b, s, h, d_v)
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
    if e.kind != "delta_out" or not call_index(e.name) or e.ours.dim() != 4:
        return None
    zero = _replay_from_zero(e, e.name[: -len(".delta_out")])
    if zero is None:
        return None
    ours_gap, ref_gap = rel(e.ours, zero), rel(e.ref, zero)
    if not (ours_gap < 2e-2 and ours_gap * 10 < ref_gap):
        return None
    return Hint(
        "state_not_carried",
        f"likely the recurrent state not carried into this call (step {call_index(e.name)}, continuing the cache): "
        f"ours equals the delta rule run from a zero state on this call's inputs (relative difference {ours_gap:.2g}), "
        f"the reference does not ({ref_gap:.2g}: it continues from the state after the previous call)",
        {"ours_vs_zero_start": ours_gap, "reference_vs_zero_start": ref_gap, "step": call_index(e.name)},
    )


# --- the keys a decode step's attention reads, by sequence index ------------------------------------


def _span(first: int, stop: int) -> str:
    """Sequence indices ``first .. stop - 1`` as text."""
    return "none" if stop <= first else str(first) if stop - first == 1 else f"{first}..{stop - 1}"


def _positions(first: int, stop: int) -> str:
    """``position 3`` or ``positions 1..3``."""
    return f"position{'s' if stop - first > 1 else ''} {_span(first, stop)}"


def keys_missing(
    kind: str,
    step: int,
    call: tuple[int, int],
    ours: int,
    reference: int,
    window: int | None,
    kv_source: int | None = None,
    own_keys_agree: bool | None = None,
) -> Hint:
    """Ours holds fewer tokens along a key axis than the reference's attention reads (both sides end with
    the call's last token, ``call[1] - 1``): ``cache_not_read`` when the call continues a cache and ours'
    attention reads exactly the call's own tokens, else ``cache_length`` naming the missing positions
    (a KV-shared layer, ``kv_source`` the layer whose keys it reads: always ``cache_length``, the keys
    handed on from the source are too few). ``kind``: the node's (``k_rot``, ``scores``, ``probs``, or
    ``cache.keys`` / ``cache.values`` after the step)."""
    a, end = call
    missing = (end - reference, end - ours)
    are = "are" if missing[1] - missing[0] > 1 else "is"
    evidence: dict[str, object] = {
        "step": step,
        "ours": ours,
        "reference": reference,
        "missing": list(range(*missing)),
        "window": window,
        "kv_source": kv_source,
    }
    held = f"(positions {_span(end - ours, end)}), the reference's {reference} ({_span(end - reference, end)})"
    if kind.startswith("cache."):
        sliding = f" (window {window}: the next query sees the last {window - 1} tokens before it)" if window else ""
        return Hint(
            "cache_length",
            f"likely the KV cache cut too early: after step {step} ours' cache holds {ours} tokens at this layer "
            f"{held}; {_positions(*missing)}, which the next step's attention reads{sliding}, {are} missing",
            evidence,
        )
    if kv_source is not None:
        return Hint(
            "cache_length",
            f"likely the keys handed on from layer {kv_source} (this layer reads its keys): at step {step} ours' "
            f"attention at this layer reads {ours} keys {held}: {_positions(*missing)} {are} missing; layer "
            f"{kv_source}'s cache after its cut to the window handed on instead of the keys its attention read?",
            evidence,
        )
    own = end - a
    if a > 0 and ours == own:
        agree = (
            "; ours' keys agree with the reference's on the call's own positions"
            if own_keys_agree
            else "; ours' keys differ from the reference's on the call's own positions too"
            if own_keys_agree is False
            else ""
        )
        return Hint(
            "cache_not_read",
            f"likely the cache not read: at step {step} (tokens {_span(a, end)}, continuing a cache of {a} tokens) "
            f"ours' attention at this layer reads only the call's own {own} keys, the reference's {reference} "
            f"(positions {_span(end - reference, end)}): {_positions(*missing)} from the cache {are} not "
            f"read{agree}",
            {**evidence, "call": [a, end]},
        )
    sliding = f" (window {window}: a sliding layer must keep window - 1 = {window - 1} tokens)" if window else ""
    return Hint(
        "cache_length",
        f"likely the KV cache cut too early: at step {step} ours' attention at this layer reads {ours} keys "
        f"{held}: {_positions(*missing)} {are} missing from ours' cache{sliding}",
        evidence,
    )


def weight_outside(
    step: int, call: tuple[int, int], reference: int, weights: dict[int, float], window: int | None
) -> Hint:
    """Ours' attention gives weight to older keys the reference's attention does not read (entries ours
    holds beyond the reference's; ``weights``: position -> the most weight a query gives it). Positions
    no query of the call may see (older than the window) are ours' mask; positions the window does
    reach are ones the reference's cache no longer holds (the reference's side: its cache cut short)."""
    a, end = call
    first = max(0, a - window + 1) if window else 0  # the oldest position a query of this call sees
    seen = sorted(p for p in weights if p >= first)
    worst = max(weights.values())
    evidence = {"step": step, "positions": sorted(weights), "weight": worst, "window": window}
    if seen and window:
        held = reference - (end - a)
        return Hint(
            "cache_length",
            f"likely the reference's cache cut short: at step {step} ours' attention gives weight (up to "
            f"{max(weights[p] for p in seen):.3g}) to {_positions(seen[0], seen[-1] + 1)}, which the call's first "
            f"query (at {a}) sees through the window of {window} but the reference's attention does not read: the "
            f"reference's cache held {held} tokens before the step, where a sliding layer keeps window - 1 = "
            f"{window - 1}",
            {**evidence, "reference_held": held},
        )
    them = "them" if len(weights) > 1 else "it"
    where = f"older than any query of the call sees through the window of {window}" if window else "not in its cache"
    return Hint(
        "sliding_window",
        f"likely the window mask over the cache: at step {step} ours' attention gives weight (up to {worst:.3g}) "
        f"to {_positions(min(weights), max(weights) + 1)}, which the reference's attention does not read "
        f"({where}: ours' cache may hold {them}, but attention must give {them} no weight)",
        evidence,
    )
