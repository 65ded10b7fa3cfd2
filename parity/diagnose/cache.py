"""Detectors of state carried across calls and chunks: a short conv continuing from other cached
inputs, a recurrent state not carried, an error starting at a chunk boundary."""

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
