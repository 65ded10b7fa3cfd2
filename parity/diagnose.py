"""Hints from the pattern of a failing node's error.

A hint says "likely", names the kind of mistake and shows the numbers it rests on; it never
changes the measured status. Each detector is a small function of (our tensor, the reference's,
what the traces hold) returning a hint or None; :func:`diagnose` tries them in order, from the
most specific evidence (an exact match with something else) to the most general (a pattern).
"""

from __future__ import annotations

import math

import torch

from .analysis import HEAD_MAJOR, HEAD_MERGED
from .compare import MISSING, NONFINITE, SHAPE, NodeResult
from .pair import Pair
from .trace import Trace

#: relative residual below which an explanation "reproduces" a tensor
EXPLAINS = 1e-3


def _close(a: torch.Tensor, b: torch.Tensor, result: NodeResult) -> bool:
    return bool(torch.allclose(a.double(), b.double(), atol=result.atol, rtol=result.rtol))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / nb if nb > 0 else math.inf


def _fmt_list(xs, n=6) -> str:
    xs = list(xs)
    body = ", ".join(str(x) for x in xs[:n])
    return body + (", ..." if len(xs) > n else "")


# --- exact matches with something else ---------------------------------------------------------


def sibling_match(result: NodeResult, ours: torch.Tensor, ref_trace: Trace, pair: Pair) -> str | None:
    """Ours reproduces another reference node of the same layer (gate vs up, k vs v)."""
    prefix = result.name.rsplit(".", 1)[0]
    for name, tensor in ref_trace.tensors.items():
        if name != result.name and name.startswith(prefix) and tensor.shape == ours.shape and _close(ours, tensor, result):
            return f"likely swapped or misassigned weights: ours matches the reference's {name} instead"
    return None


def _heads(t: torch.Tensor, kind: str, head_dim: int | None) -> torch.Tensor | None:
    """(heads, rest...) view of an attention node, or None."""
    if kind in HEAD_MAJOR and t.dim() == 4:
        return t.transpose(0, 1)
    if kind in HEAD_MERGED and head_dim and t.dim() == 3 and t.shape[-1] % head_dim == 0 and t.shape[-1] > head_dim:
        return t.unflatten(-1, (-1, head_dim)).movedim(-2, 0)
    return None


def head_mapping(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, pair: Pair) -> str | None:
    """Some heads agree and others do not, or ours' heads are the reference's in another order."""
    a, b = _heads(ours, result.kind, pair.cfg.get("head_dim")), _heads(ref, result.kind, pair.cfg.get("head_dim"))
    if a is None or a.shape[0] < 2:
        return None
    n = a.shape[0]
    same = [i for i in range(n) if _close(a[i], b[i], result)]
    moved = {i: j for i in range(n) if i not in same for j in range(n) if j != i and _close(a[i], b[j], result)}
    if not same and not moved:
        return None
    gqa = pair.cfg.get("n_kv_heads") not in (None, pair.cfg.get("n_heads"))
    cause = "GQA head mapping (K/V heads expanded with repeat instead of repeat_interleave, or grouped wrongly)" if gqa else "a head permutation in the weights or the head split"
    parts = [f"heads {_fmt_list(same)} agree" if same else "no head agrees in place"]
    if moved:
        parts.append("ours " + ", ".join(f"head {i} = reference head {j}" for i, j in list(moved.items())[:6]))
    differ = [i for i in range(n) if i not in same]
    parts.append(f"heads {_fmt_list(differ)} differ")
    return f"likely {cause}: " + "; ".join(parts)


def last_dim_permutation(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, pair: Pair) -> str | None:
    """Same values, other order along the last axis: a row permutation of a weight (RoPE layout
    permutation with a wrong head count, half-split vs interleaved Q/K rows)."""
    if ours.dim() < 2 or ours.shape[-1] < 4:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if not torch.allclose(a.sort(-1).values, b.sort(-1).values, atol=result.atol, rtol=result.rtol):
        return None
    perm = [int((b[0] - a[0, j]).abs().argmin()) for j in range(a.shape[-1])]
    head_dim = pair.cfg.get("head_dim")
    within = ""
    if head_dim and ours.shape[-1] % head_dim == 0:
        crossing = sum(1 for j, k in enumerate(perm) if j // head_dim != k // head_dim)
        within = (
            "; every element stays in its head (a permutation within heads, as a RoPE un-permute with the "
            "wrong head count gives)" if crossing == 0 else f"; {crossing} positions cross head boundaries"
        )
    return (
        f"likely a permutation of weight rows: same values per token, other order along the last axis "
        f"(ours[j] = reference[{_fmt_list(perm, 8)}]){within}"
    )


# --- scales --------------------------------------------------------------------------------------


def _named_constants(pair: Pair) -> dict[str, float]:
    cfg = pair.cfg
    named = {}
    if cfg.get("rope_attention_factor"):
        f = float(cfg["rope_attention_factor"])
        named.update({"the YaRN attention factor": f, "the YaRN attention factor squared": f * f})
    if cfg.get("logit_scale"):
        named["logit_scale"] = float(cfg["logit_scale"])
    for key in ("emb_dim", "head_dim"):
        if cfg.get(key):
            named[f"sqrt({key}={cfg[key]})"] = math.sqrt(cfg[key])
    return named


def constant_ratio(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, pair: Pair) -> str | None:
    """ours / reference is one constant everywhere: a missing or extra scale."""
    a, b = ours.double().flatten(), ref.double().flatten()
    keep = b.abs() > 1e-3 * b.abs().max()
    if int(keep.sum()) < 4:
        return None
    ratio = a[keep] / b[keep]
    mean = float(ratio.mean())
    if abs(mean) < 1e-12 or abs(mean - 1) < 1e-6 or float(ratio.std()) / abs(mean) > 1e-3:
        return None
    r = max(mean, 1 / mean)  # compare magnitudes >= 1, whichever side carries the extra factor
    bigger = "ours / reference" if mean > 1 else "reference / ours"
    names = [
        f"{bigger} = {name} ({value:.6g})" if value >= 1 else f"{bigger} = 1 / {name} ({1 / value:.6g})"
        for name, value in _named_constants(pair).items()
        if value > 0 and abs(r / max(value, 1 / value) - 1) < 1e-3
    ]
    known = f"; matches {names[0]}" if names else ""
    return (
        f"likely a missing or extra scale: ours / reference = {mean:.6g} at every position including 0 "
        f"(reference / ours = {1 / mean:.6g}){known}"
    )


def channel_ratio(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, pair: Pair) -> str | None:
    """ours / reference constant over tokens for each channel, different across channels."""
    if ours.dim() < 2 or ours.shape[-1] < 2:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if a.shape[0] < 2 or bool((b.abs() < 1e-6).any()):
        return None
    ratio = a / b
    spread = float((ratio.std(0) / ratio.mean(0).abs().clamp_min(1e-12)).max())
    if spread > 1e-3:
        return None
    per_channel = ratio.mean(0)
    return (
        "likely a per-channel weight difference (a norm weight used as w instead of 1 + w, or a wrong norm "
        f"weight): ours / reference is constant over tokens per channel, e.g. {_fmt_list(f'{v:.4g}' for v in per_channel[:4].tolist())}"
    )


# --- norms ---------------------------------------------------------------------------------------


def _normalisers(x: torch.Tensor, head_dim: int | None) -> dict[str, torch.Tensor]:
    x = x.double()
    out = {
        "RMSNorm over the last axis": x / x.pow(2).mean(-1, keepdim=True).sqrt(),
        "LayerNorm (mean-subtracting)": (x - x.mean(-1, keepdim=True))
        / (x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True).sqrt(),
    }
    if head_dim and x.shape[-1] % head_dim == 0 and x.shape[-1] > head_dim:
        h = x.unflatten(-1, (-1, head_dim))
        out["RMSNorm per head"] = (h / h.pow(2).mean(-1, keepdim=True).sqrt()).flatten(-2)
    return out


def _explained_by(y: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str | None:
    """The candidate n with y ~= n * w for a per-channel w (least squares), if any."""
    y = y.double().flatten(0, -2)
    for name, n in candidates.items():
        n = n.flatten(0, -2)
        w = (y * n).sum(0) / n.pow(2).sum(0).clamp_min(1e-30)
        if _rel(n * w, y) < EXPLAINS:
            return name
    return None


def norm_kind(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, ours_trace: Trace, ref_trace: Trace, pair: Pair) -> str | None:
    """A norm node whose output is explained by another normaliser than the reference's."""
    if "norm" not in result.kind or result.name not in ref_trace.inputs or result.name not in ours_trace.inputs:
        return None
    x_ref, x_ours = ref_trace.inputs[result.name], ours_trace.inputs[result.name]
    if not _close(x_ours, x_ref, result):
        return None  # the input already differs: not this norm's own fault
    candidates = _normalisers(x_ref, pair.cfg.get("head_dim"))
    ours_is, ref_is = _explained_by(ours, candidates), _explained_by(ref, candidates)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    evidence = ""
    if "LayerNorm" in ref_is or "LayerNorm" in ours_is:
        means = x_ref.double().mean(-1).flatten()
        evidence = f"; the difference tracks each token's mean (input means {_fmt_list(f'{m:.3g}' for m in means[:4].tolist())}): mean subtraction"
    if "per head" in ours_is or "per head" in ref_is:
        evidence = "; per-head vs whole-projection Q/K norm"
    return f"likely the wrong norm: ours behaves like {ours_is}, the reference like {ref_is}{evidence}"


def norm_placement(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, ours_trace: Trace, ref_trace: Trace, pair: Pair) -> str | None:
    """A projection whose input is the reference's input after a norm (pre-norm vs post-norm)."""
    if result.name not in ref_trace.inputs or result.name not in ours_trace.inputs:
        return None
    x_ref, x_ours = ref_trace.inputs[result.name], ours_trace.inputs[result.name]
    if x_ref.shape != x_ours.shape or _close(x_ours, x_ref, result):
        return None
    cand = {k: v for k, v in _normalisers(x_ref, None).items()}
    ours_is = _explained_by(x_ours, cand)
    if ours_is is not None:
        return (
            f"likely norm placement: the input of {result.kind} in ours equals the reference's input after a "
            f"{ours_is} (pre-norm vs post-norm)"
        )
    return None


# --- positions -----------------------------------------------------------------------------------


def _seq_axis(kind: str) -> int:
    return 2 if kind in HEAD_MAJOR else 1


def _by_position(ours: torch.Tensor, ref: torch.Tensor, axis: int) -> torch.Tensor:
    diff = (ours.double() - ref.double()).abs().movedim(axis, 0)
    return diff.reshape(diff.shape[0], -1).amax(dim=1)


def _pre_rope(result: NodeResult, ref_trace: Trace, pair: Pair, n_heads: int) -> torch.Tensor | None:
    """The reference's q (or k) before RoPE as (batch, heads, seq, head_dim), from the q_norm/q_proj node."""
    stem = result.name.rsplit(".", 1)[0]
    letter = result.kind[0]
    for kind in (f"{letter}_norm", f"{letter}_proj"):
        t = ref_trace.tensors.get(f"{stem}.{kind}")
        if t is None:
            continue
        head_dim = pair.cfg.get("head_dim")
        if t.dim() == 3 and head_dim and t.shape[-1] == n_heads * head_dim:
            return t.unflatten(-1, (n_heads, head_dim)).transpose(1, 2)
        if t.dim() == 4 and t.shape[1] == n_heads:
            return t
    return None


def _pairing(rotated: torch.Tensor, x: torch.Tensor) -> str | None:
    """Which RoPE pairing ``rotated`` preserves (pair norms equal to the input's, up to one scale)."""
    d = x.shape[-1]
    layouts = {
        "half-split (i, i + d/2)": (torch.arange(d // 2), torch.arange(d // 2) + d // 2),
        "interleaved (2i, 2i + 1)": (torch.arange(0, d, 2), torch.arange(1, d, 2)),
    }
    for name, (i, j) in layouts.items():
        rn = rotated.double()[..., i].pow(2) + rotated.double()[..., j].pow(2)
        xn = x.double()[..., i].pow(2) + x.double()[..., j].pow(2)
        keep = xn > 1e-6 * xn.max()
        ratio = rn[keep] / xn[keep]
        if ratio.numel() and float(ratio.std()) / float(ratio.mean()) < 1e-4:
            return name
    return None


def rope_pattern(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, ref_trace: Trace, pair: Pair) -> str | None:
    """Position 0 agrees and the error grows with position: RoPE (frequencies, scaling, pairing, offset)."""
    # Only where RoPE acts: after attention, position 0 agrees trivially (it sees one key).
    if result.kind not in ("q_rot", "k_rot") or ours.dim() != 4 or ours.shape[2] < 3:
        return None
    per_pos = _by_position(ours, ref, 2)
    tol = result.atol + result.rtol * float(ref.abs().max())
    if float(per_pos[0]) > tol or float(per_pos.max()) <= tol:
        return None
    numbers = (
        f"position 0 agrees (error {float(per_pos[0]):.2g}), later positions differ "
        f"(pos 1: {float(per_pos[1]):.3g}, pos {len(per_pos) - 1}: {float(per_pos[-1]):.3g})"
    )
    x = _pre_rope(result, ref_trace, pair, ours.shape[1])
    ref_pairs = None
    if x is not None and x.shape == ours.shape:
        if _close(ref, x, result):
            return f"likely RoPE where the reference applies no rotation (a NoPE layer): the reference's {result.kind} is its unrotated input; {numbers}"
        if _close(ours, x, result):
            return f"likely a missing RoPE: ours applies no rotation here, the reference does; {numbers}"
        ours_pairs, ref_pairs = _pairing(ours, x), _pairing(ref, x)
        if ours_pairs and ref_pairs and ours_pairs != ref_pairs:
            return f"likely RoPE pairing layout: ours rotates {ours_pairs} pairs, the reference {ref_pairs}; {numbers}"
    d = ours.shape[-1]
    by_dim = (ours.double() - ref.double()).abs().amax(dim=(0, 1, 2))
    if ref_pairs is not None and ref_pairs.startswith("interleaved"):
        freq_err = torch.maximum(by_dim[0::2], by_dim[1::2])  # frequency i rotates dims 2i, 2i + 1
    else:
        freq_err = torch.maximum(by_dim[: d // 2], by_dim[d // 2 :])  # frequency i rotates dims i, i + d/2
    bad = (freq_err > tol).nonzero().flatten().tolist()
    if bad and len(bad) < d // 2:
        yarn = " (a YaRN correction range / ramp band: rounding or clamping)" if pair.cfg.get("rope_type") == "yarn" else ""
        return (
            f"likely RoPE frequencies{yarn}: error confined to a band of rotary frequencies "
            f"{_fmt_list(bad)} of {d // 2}; {numbers}"
        )
    return f"likely RoPE frequencies, scaling or offset: {numbers}"


def window_pattern(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, pair: Pair) -> str | None:
    """Only query positions at or past the sliding window differ."""
    window = pair.cfg.get("sliding_window")
    axis = _seq_axis(result.kind)
    if not window or ours.dim() <= axis or ours.shape[axis] <= window:
        return None
    per_pos = _by_position(ours, ref, axis)
    tol = result.atol + result.rtol * float(ref.abs().max())
    bad = (per_pos > tol).nonzero().flatten().tolist()
    if bad and min(bad) >= window:
        return (
            f"likely the sliding window size or mask: positions < {window} agree, positions {bad[0]}..{bad[-1]} "
            f"differ (max error {float(per_pos.max()):.3g})"
        )
    return None


def untied_head(result: NodeResult, ours: torch.Tensor, ref: torch.Tensor, pair: Pair) -> str | None:
    """Everything before the output agrees but the logits are uncorrelated: an unloaded or untied head."""
    if result.kind not in ("lm_head", "logits") or result.cosine is None or abs(result.cosine) > 0.3:
        return None
    tied = " (the config ties it to the embedding)" if pair.cfg.get("tie_word_embeddings") else ""
    return (
        f"likely an output head that was never loaded or tied{tied}: every hidden node before it agrees, "
        f"the logits are uncorrelated (cosine {result.cosine:.3f})"
    )


def nonfinite(result: NodeResult, ours: torch.Tensor | None, ref: torch.Tensor | None) -> str:
    if ours is None or ref is None:
        return f"non-finite values appear first here: {result.detail}"
    bad = ~torch.isfinite(ours) | ~torch.isfinite(ref)
    axis = _seq_axis(result.kind)
    where = []
    if bad.dim() > axis:
        rows = bad.movedim(axis, 0).flatten(1).any(1).nonzero().flatten().tolist()
        where.append(f"positions {_fmt_list(rows, 10)}")
    if bad.dim() > 0:
        batch = bad.flatten(1).any(1).nonzero().flatten().tolist() if bad.dim() > 1 else []
        where.append(f"batch rows {_fmt_list(batch)}")
    return f"non-finite values appear first here: {result.detail}; at {', '.join(where)} (masked or padded rows?)"


def diagnose(result: NodeResult, ours_trace: Trace, ref_trace: Trace, pair: Pair) -> str:
    """A likely cause for a failing node, with its evidence; "" if no pattern is recognised."""
    if result.status == MISSING:
        return f"likely a node-map or tap problem: {result.detail}"
    if result.status == SHAPE:
        return f"likely a layout or head-count difference: {result.detail}"
    ours, ref = ours_trace.tensors.get(result.name), ref_trace.tensors.get(result.name)
    if result.status == NONFINITE:
        return nonfinite(result, ours, ref)
    detectors = (
        lambda: sibling_match(result, ours, ref_trace, pair),
        lambda: untied_head(result, ours, ref, pair),
        lambda: norm_kind(result, ours, ref, ours_trace, ref_trace, pair),
        lambda: norm_placement(result, ours, ref, ours_trace, ref_trace, pair),
        lambda: constant_ratio(result, ours, ref, pair),
        lambda: last_dim_permutation(result, ours, ref, pair),
        lambda: head_mapping(result, ours, ref, pair),
        lambda: window_pattern(result, ours, ref, pair),
        lambda: rope_pattern(result, ours, ref, ref_trace, pair),
        lambda: channel_ratio(result, ours, ref, pair),
    )
    for detect in detectors:
        hint = detect()
        if hint:
            return hint
    return ""
