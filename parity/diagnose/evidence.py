"""What a detector may look at (:class:`Evidence`: the failing node, both tensors, both traces, the
architecture's facts) and the helpers detectors share.

Each detector is a small function of one Evidence returning a :class:`~parity.diagnose.hints.Hint`
or None, and stays silent unless its evidence clearly exceeds the noise the node itself shows: no
hint is better than a wrong one.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parity.compare.results import NodeResult
from parity.diagnose.profile import HEAD_MAJOR
from parity.model.facts import ArchFacts
from parity.record.hf_capture import FUSED_QKV
from parity.record.trace import Trace

#: relative residual below which an explanation "reproduces" a tensor
EXPLAINS = 1e-3


@dataclass(frozen=True)
class Evidence:
    """What a detector may look at: the failing node, its two tensors and everything traced."""

    result: NodeResult
    ours: torch.Tensor
    ref: torch.Tensor
    ours_trace: Trace
    ref_trace: Trace
    facts: ArchFacts
    #: the position of every token, ``(batch, seq)`` (what RoPE rotates by)
    positions: torch.Tensor | None = None
    #: ``(batch, seq)`` 1 for real tokens, 0 for padding, when the run is padded
    attention_mask: torch.Tensor | None = None
    #: ours' q/k rows are held permuted per head at load (the node is compared through that permutation:
    #: its Layout's ``dims``), as a conversion between RoPE pairings permutes them
    rows_permuted: bool = False
    #: the reference's input to RoPE ``(batch, heads, seq, rotary)`` where a detector reads RoPE on part of each
    #: head (MLA's rotated tail: :func:`~parity.diagnose.latent.latent_rope`), else None (read from the trace)
    rope_input: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return self.result.kind

    @property
    def name(self) -> str:
        return self.result.name

    def close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Equal within this node's tolerance (and a little slack when the tolerance is exact)."""
        return within_tolerance(a, b, self.result)

    def inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:attr:`_inputs`, read once per node (two dozen detectors ask)."""
        return self._inputs

    @functools.cached_property
    def _inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both sides' kept module inputs of the node (ours, reference), ours in the reference's shape
        when the two differ only by how the leading axes are flattened (OPT's MLP runs on
        ``(batch * seq, hidden)``, a port on ``(batch, seq, hidden)``) or ordered (a per-head norm's input
        ``(batch, heads, seq, head_dim)`` where the reference's is ``(batch, seq, heads, head_dim)``: the order
        whose values line up best with the reference's); None where not kept."""
        x_ours, x_ref = self.ours_trace.inputs.get(self.name), self.ref_trace.inputs.get(self.name)
        if (
            x_ours is None
            or x_ref is None
            or x_ours.shape == x_ref.shape
            or x_ours.numel() != x_ref.numel()
            or not x_ours.dim()
            or not x_ref.dim()
        ):
            return x_ours, x_ref
        candidates = [x_ours.reshape(x_ref.shape)] if x_ours.shape[-1] == x_ref.shape[-1] else []
        if 2 < x_ours.dim() <= 4:  # the features stay last: the leading axes in another order
            last = x_ours.dim() - 1
            candidates += [
                t
                for order in itertools.permutations(range(last))
                if (t := x_ours.permute(*order, last)).shape == x_ref.shape
            ]
        if len(candidates) > 1:
            ref = x_ref.double().flatten()

            def alike(t: torch.Tensor) -> float:
                return abs(float(torch.nn.functional.cosine_similarity(t.double().flatten(), ref, dim=0)))

            return max(candidates, key=alike), x_ref
        return (candidates[0] if candidates else x_ours), x_ref

    @property
    def noise(self) -> float:
        """The node's tolerance at its largest reference value: errors below it are noise."""
        return self.result.atol + self.result.rtol * float(self.ref.abs().max())


def within_tolerance(a: torch.Tensor, b: torch.Tensor, result: NodeResult) -> bool:
    """``a`` equals ``b`` (the reference's side) within ``result``'s atol/rtol, with a little slack (1e-6 of
    ``b``'s largest magnitude) when the tolerance is exact."""
    atol = max(result.atol, 1e-6 * float(b.abs().max()) if b.numel() else 0.0)
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=result.rtol))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / nb if nb > 0 else math.inf


def golden_minimum(f: Callable[[float], float], grid: list[float], steps: int = 60) -> float:
    """The argument where ``f`` (one-dimensional, unimodal near its best) is least: the best point of the
    evenly spaced ``grid``, refined by a golden-section search within one grid step on either side."""
    best = min(grid, key=f)
    step = grid[1] - grid[0]
    low, high = best - step, best + step
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(steps):
        a, c = high - golden * (high - low), low + golden * (high - low)
        if f(a) < f(c):
            high = c
        else:
            low = a
    return (low + high) / 2


def fmt_list(xs, n=6) -> str:
    xs = list(xs)
    body = ", ".join(str(x) for x in xs[:n])
    return body + (", ..." if len(xs) > n else "")


def whose(side: str) -> str:
    """The possessive of a side's name: ``ours'``, ``the reference's``."""
    return "ours'" if side == "ours" else f"{side}'s"


def same_input(e: Evidence) -> torch.Tensor | None:
    """The reference's module input of the failing node when ours read the same values, in the
    reference's layout (ours may hold them with the axes in another order, heads split or merged: a
    per-head norm applied after the heads transpose); None when either input was not kept or they
    differ (then the node is not at fault on its own)."""
    x_ref, x_ours = e.ref_trace.inputs.get(e.name), e.ours_trace.inputs.get(e.name)
    if x_ref is not None and x_ours is None:
        # ours kept no input for this node (another runtime's dump, or a norm computed in functions): the
        # node is the first that fails, so what fed it agreed, when what fed it is a node of its own
        # (q_proj before q_norm); a value computed between nodes (an embedding multiplier applied in
        # forward) may differ unseen, and then nothing is assumed
        if not e.ours_trace.inputs and not e.ours_trace.calls:
            return x_ref  # a dump: nothing recorded live
        return x_ref if _fed_by_a_node(e, x_ref) else None
    if x_ref is None or x_ours is None or x_ours.numel() != x_ref.numel():
        return None
    if x_ours.shape == x_ref.shape:
        return x_ref if e.close(x_ours, x_ref) else None
    candidates = [x_ours.permute(p) for p in itertools.permutations(range(x_ours.dim())) if x_ours.dim() <= 4]
    for t in candidates:
        for u in (t, t.reshape(x_ref.shape) if t.shape != x_ref.shape else t):
            if u.shape == x_ref.shape and e.close(u, x_ref):
                return x_ref
    return None


def _fed_by_a_node(e: Evidence, x_ref: torch.Tensor) -> bool:
    """Whether the reference's input of the failing node is the output of a node produced before it
    (which ours matched, the failing node being the first), in the node's layout or merged heads."""
    for name, tensor in e.ref_trace.tensors.items():
        if name == e.name:
            break
        if tensor.numel() != x_ref.numel() or not tensor.is_floating_point():
            continue
        done = e.ours_trace.results.get(name)
        if e.ours_trace.results and (done is None or not done.judged or not done.passed):
            continue  # compared live: only a node ours produced and that agreed vouches for the input
        flat = tensor.reshape(x_ref.shape) if tensor.shape != x_ref.shape else tensor
        if tensor.shape == x_ref.shape and e.close(flat, x_ref):
            return True
        if tensor.dim() == 3 and x_ref.dim() == 4 and e.close(tensor, x_ref.flatten(-2).reshape(tensor.shape)):
            return True  # (batch, seq, heads * head_dim) split into heads before a per-head norm
        if tensor.dim() == 3 and x_ref.dim() == 4 and e.close(tensor, x_ref.transpose(1, 2).reshape(tensor.shape)):
            return True  # the same, the heads moved ahead of the sequence: (batch, heads, seq, head_dim)
    return False


def forms_of(
    e: Evidence, forms: dict[str, torch.Tensor], ours: torch.Tensor, ref: torch.Tensor
) -> tuple[str | None, str | None]:
    """The first of ``forms`` (label -> a value computed from the reference's own tensors) that ``ours``
    and that ``ref`` each equal within the node's tolerance; None for a side that equals none."""

    def form_of(t: torch.Tensor) -> str | None:
        return next(
            (label for label, f in forms.items() if f.shape == t.shape and e.close(t.double(), f.double())), None
        )

    return form_of(ours), form_of(ref)


def attention_values(e: Evidence) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(probs, v)``: the reference's probabilities ``(batch, heads, seq, keys)`` of the failing node's
    attention block and its values ``(batch, kv_heads, seq, head_dim)`` (float64) from its ``v_proj``
    node, when both were traced and the heads group evenly; without a ``v_proj``, the values cut from
    the block's fused q/k/v output in the layout whose values give the reference's own context."""
    stem = e.name.rsplit(".", 1)[0]
    probs, values = e.ref_trace.tensors.get(f"{stem}.probs"), e.ref_trace.tensors.get(f"{stem}.v_proj")
    d = e.facts.head_dim
    if probs is None or probs.dim() != 4 or not d:
        return None
    b, h, t, _ = probs.shape
    if values is None:
        v = _fused_values(e, stem, probs, d)
        return None if v is None else (probs, v)
    if values.numel() % (b * t * d) or h % (values.numel() // (b * t * d)):
        return None
    kv = values.numel() // (b * t * d)
    return probs, values.double().reshape(b, t, kv, d).transpose(1, 2)


def fused_output(e: Evidence, stem: str) -> torch.Tensor | None:
    """The reference's fused q/k/v projection output of the attention block ``stem`` (any of
    :data:`~parity.record.hf_capture.FUSED_QKV`), when traced."""
    return next((t for n in FUSED_QKV if (t := e.ref_trace.tensors.get(f"{stem}.{n}")) is not None), None)


def _fused_values(e: Evidence, stem: str, probs: torch.Tensor, d: int) -> torch.Tensor | None:
    """The values ``(batch, kv_heads, seq, head_dim)`` of a block whose q/k/v come from one fused
    projection (Persimmon, GPT-NeoX, MPT): the layout of :func:`fused_layouts` whose values, weighted
    by the reference's probabilities, give the reference's context."""
    fused = fused_output(e, stem)
    # either side's context: the one without a fault in its values tells the layout
    contexts = [c for trace in (e.ref_trace, e.ours_trace) if (c := trace.tensors.get(f"{stem}.context")) is not None]
    if fused is None or not contexts or fused.dim() != 3:
        return None
    b, h, t, _ = probs.shape
    kv = e.facts.num_kv_heads or h
    p = probs.double()
    for _, (_, _, v) in fused_layouts(fused.double(), h, kv, d).items():
        c = p @ v.repeat_interleave(h // v.shape[1], dim=1)  # (b, h, t, d)
        for form in (c, c.transpose(1, 2), c.transpose(1, 2).reshape(b, t, h * d)):
            if any(form.shape == x.shape and rel(form, x) < EXPLAINS for x in contexts):
                return v
    return None


def fused_layouts(f: torch.Tensor, heads: int, kv_heads: int, d: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """``(q, k, v)``, each ``(batch, heads, seq, head_dim)``, read from a fused q/k/v projection output
    ``f`` ``(batch, seq, (heads + 2 kv_heads) head_dim)`` the ways ports cut one: stacked ``[q; k; v]``
    (Transformers' own q/k/v, OLMo, Phi-3) in any order of the three, per head ``(heads, 3, head_dim)``
    (GPT-NeoX, BLOOM), per KV group ``(kv_heads, group + 2, head_dim)`` (Falcon's new layout) and in
    ``mp_num`` model-parallel blocks of ``[q; v; k]`` (CodeGen's ``qkv_proj``)."""
    b, s, width = f.shape
    widths = {"q": heads * d, "k": kv_heads * d, "v": kv_heads * d}
    if width != sum(widths.values()):
        return {}

    def split(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.reshape(b, s, n, d).transpose(1, 2)

    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for order in ("qkv", "kvq", "qvk", "kqv", "vqk", "vkq"):
        parts = dict(zip(order, f.split([widths[c] for c in order], dim=-1), strict=True))
        label = "stacked [" + "; ".join(order) + "]"
        out[label] = tuple(split(parts[c], heads if c == "q" else kv_heads) for c in "qkv")
    if heads == kv_heads:
        g = f.reshape(b, s, heads, 3, d)
        out["per head (heads, 3, head_dim): GPT-NeoX / BLOOM"] = tuple(g[..., i, :].transpose(1, 2) for i in range(3))
        g = f.reshape(b, s, heads, d, 3)
        out["per head as (heads, head_dim, 3): q, k and v interleaved element by element"] = tuple(
            g[..., i].transpose(1, 2) for i in range(3)
        )
        for mp in (2, 4, 8):  # CodeGen: mp_num model-parallel blocks, each its share of q, v, k in that order
            local = width // (3 * mp)
            for order in ("qvk", "qkv"):
                if width % (3 * mp) or (mp == heads and order == "qkv"):
                    continue  # one block per head in q, k, v order is GPT-NeoX's per-head layout above
                label = f"in {mp} model-parallel blocks, each [{'; '.join(order)}] (CodeGen's mp_num = {mp})"
                blocks = f.reshape(b, s, mp, 3, local)
                cut = {c: blocks[..., i, :].reshape(b, s, heads, d).transpose(1, 2) for i, c in enumerate(order)}
                out[label] = (cut["q"], cut["k"], cut["v"])
    elif heads % kv_heads == 0:
        group = heads // kv_heads
        g = f.reshape(b, s, kv_heads, group + 2, d)
        q = g[..., :group, :].reshape(b, s, heads, d).transpose(1, 2)
        out["per KV group (kv_heads, group + 2, head_dim): Falcon"] = (
            q,
            g[..., group, :].transpose(1, 2),
            g[..., group + 1, :].transpose(1, 2),
        )
    return out


def heads_first(t: torch.Tensor, n_heads: int, head_dim: int, seq: int) -> torch.Tensor | None:
    """A projection's output ``(batch, seq, heads * head_dim)`` (or already split) as ``(batch, heads,
    seq, head_dim)``."""
    if t.dim() == 3 and t.shape[1] == seq and t.shape[-1] == n_heads * head_dim:
        return t.unflatten(-1, (n_heads, head_dim)).transpose(1, 2)
    if t.dim() == 4 and t.shape[1:] == (seq, n_heads, head_dim):
        return t.transpose(1, 2)
    if t.dim() == 4 and t.shape[1:] == (n_heads, seq, head_dim):
        return t
    return None


def pair_lengths(t: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False) -> torch.Tensor:
    """The length of each RoPE pair of ``t`` (..., head_dim), half-split ``(i, i + r/2)`` or ``interleaved``
    ``(2i, 2i + 1)`` within the first ``rotary_dim`` dims ``r`` (the whole head by default), followed by the
    dims past them as they are (partial rotary passes them through): what a rotation keeps, so a tensor
    and its rotation agree here at every position."""
    t = t.double()
    r = t.shape[-1] if rotary_dim is None else rotary_dim
    a, b = (t[..., 0:r:2], t[..., 1:r:2]) if interleaved else (t[..., : r // 2], t[..., r // 2 : r])
    return torch.cat([(a.pow(2) + b.pow(2)).sqrt(), t[..., r:]], dim=-1)


def layer_values(e: Evidence, before: bool = False, inputs_first: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The reference's values of the failing node's layer, by name: its nodes and its modules' inputs
    (``<node>@input``); ``before``: only those produced before the failing node (and their inputs)."""
    nodes = []
    for name, tensor in e.ref_trace.tensors.items():
        if before and name == e.name:
            break
        if e.facts.locate(name)[0] == e.result.layer:
            nodes.append((name, tensor))
    held = {name for name, _ in nodes} if before else None
    inputs = [
        (f"{n}@input", t)
        for n, t in e.ref_trace.inputs.items()
        if e.facts.locate(n)[0] == e.result.layer and (held is None or n in held)
    ]
    return inputs + nodes if inputs_first else nodes + inputs


def reference_output(e: Evidence, name: str) -> torch.Tensor | None:
    """The reference module ``name``'s whole output (float64): its node; else, for a module traced only as parts
    (``name[a:b]``, ``name[rows ...]``: ours holds its weight cut), its kept input times its whole weight (plus
    its bias); else its contiguous ``[a:b]`` parts joined; None when neither is traced."""
    out = e.ref_trace.tensors.get(name)
    if out is not None:
        return out.double()
    parts = [(n, t) for n, t in e.ref_trace.tensors.items() if n.startswith(name + "[")]
    for node, _ in parts:
        x, weight = e.ref_trace.inputs.get(node), e.ref_trace.weights.get(node)
        if x is not None and weight is not None and weight.dim() == 2 and x.shape[-1] == weight.shape[1]:
            y = x.double() @ weight.double().T
            bias = e.ref_trace.biases.get(node)
            return y + bias.double() if bias is not None and bias.shape == y.shape[-1:] else y
    spans = sorted((span, t) for n, t in parts if (span := part_of(n)) is not None and span[1].step == 1)
    starts = [span[1].start for span, _ in spans]
    stops = [span[1].stop for span, _ in spans]
    if spans and starts[0] == 0 and starts[1:] == stops[:-1]:
        return torch.cat([t.double() for _, t in spans], -1)
    return None


def cut_offset(
    part: torch.Tensor, wide: torch.Tensor, same: Callable[[torch.Tensor, torch.Tensor], bool]
) -> int | None:
    """The first offset ``o`` along the last axis with ``same(part, wide[..., o:o + w])`` (``w``: ``part``'s
    width): where a side's tensor was cut from a wider one (a fused output, a per-head stack); None if nowhere."""
    w = part.shape[-1]
    return next((o for o in range(wide.shape[-1] - w + 1) if same(part, wide[..., o : o + w])), None)


# --- nodes that are parts of a fused projection -------------------------------------------------

_PART = re.compile(r"\[(\d+):(\d+)(?::(\d+))?\]$")


def part_of(name: str) -> tuple[str, range] | None:
    """``(fused node, its output features)`` of a part node named ``<node>[a:b]`` or ``<node>[a:b:step]``
    (the reference's output features a module of ours holds), else None."""
    m = _PART.search(name)
    if m is None:
        return None
    return name[: m.start()], range(int(m.group(1)), int(m.group(2)), int(m.group(3) or 1))


# --- exact matches with something else ---------------------------------------------------------


def reads_stream(kind: str) -> bool:
    """A node that is a point of the residual stream: a module's input, or a layer's output."""
    return "@input" in kind or kind == "layer"


# --- positions -----------------------------------------------------------------------------------


def seq_axis(kind: str) -> int:
    return 2 if kind in HEAD_MAJOR else 1


def by_position(ours: torch.Tensor, ref: torch.Tensor, axis: int) -> torch.Tensor:
    diff = (ours.double() - ref.double()).abs().movedim(axis, 0)
    return diff.reshape(diff.shape[0], -1).amax(dim=1)


def positions_axis(e: Evidence) -> int | None:
    """The sequence axis of the failing node when its layout is ``(batch, seq, ...)`` or ``(batch,
    heads, seq, ...)`` for this run's tokens; None for nodes without one (a recurrent state)."""
    if e.positions is None:
        return None
    axis = seq_axis(e.kind)
    batch, seq = e.positions.shape
    return axis if e.ours.dim() > axis and e.ours.shape[0] == batch and e.ours.shape[axis] == seq else None


# --- calls continuing a cache (decode checks) -------------------------------------------------------


def call_index(name: str) -> int | None:
    """The step of a decode check's node (``step3/...``: 3), None outside a decode check. Step 0 is the
    first call of a sequence; every later one continues from the cache."""
    m = re.match(r"^step(\d+)/", name)
    return int(m.group(1)) if m else None


#: element-wise functions a swapped activation may involve (applied in float64)
ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softplus": torch.nn.functional.softplus,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu (tanh)": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "identity": lambda x: x,
}


def constant_named(e: Evidence, ratio: float) -> str:
    """``; matches the config's embedding_multiplier (6)`` (every constant ``ratio`` or its inverse equals,
    the config's own first), else ``""``."""
    named = sorted(e.facts.named_constants().items(), key=lambda item: "config" not in item[0])
    matches = [
        f"{label}{'' if label.endswith(')') else f' = {value:g}'}"
        for label, value in named
        if value and abs(ratio / value - 1) < 1e-3
    ] + [f"1 / {label}" for label, value in named if value and abs(ratio * value - 1) < 1e-3]
    return f"; matches {', or '.join(matches[:3])}" if matches else ""
