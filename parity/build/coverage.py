"""Loader coverage: did every checkpoint tensor land in exactly one parameter of ours, and nothing else?

Judged from the loaded model itself, not from a loader's table, so it holds for any loader (an
assigning one, a copying one, a user's own): each of our parameters is traced back to the
checkpoint tensor it came from, by shared storage (the whole tensor, or a view of part of it: a
fused tensor split into several parameters, e.g. MoE ``experts.gate_up_proj`` into one gate and one
up projection per expert, where every element must land in exactly one parameter), else by value
(a copy, a transpose, or the rows of several checkpoint tensors fused into one, e.g. ``qkv`` or
``gate_up``, in any row order). The :class:`Source` records say how, which is also what aligns a
user's model to the reference.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from parity.model.weights import storage_key

SHARED, COPY, TRANSPOSED, ROWS, SLICE = "shared", "copy", "transposed", "rows", "slice"
OFFSET, LAYOUT, PART, SCALED, SPLIT = "offset", "layout", "part", "scaled", "split"
#: a tensor held reversed along one axis (a conv's taps kept in lag order, applied by a shifted sum)
FLIPPED = "flipped"
STRIDED, FUSED_PART = "strided", "fused part"
#: every way a parameter (or buffer) of ours may hold a checkpoint tensor, in the words reports use
CONVENTIONS = {
    SHARED: "the checkpoint tensor itself (same storage)",
    SLICE: "a view of part of a fused checkpoint tensor (same storage)",
    COPY: "a copy (equal values)",
    TRANSPOSED: "its transpose (a Conv1D-style or (in, out) layout)",
    OFFSET: "its values plus or minus 1 (a norm weight kept as 1 + w, or as w - 1)",
    LAYOUT: "its values in another shape: axes permuted and reshaped (TransformerLens' 3-D attention weights)",
    ROWS: "its rows in another order, or fused with other tensors' rows in any order (qkv, gate_up; "
    "q/k rows permuted per head for interleaved RoPE)",
    PART: "a copy of some of its rows (one expert of a fused experts tensor copied into a module of its own)",
    FUSED_PART: "some of its rows fused with other tensors' rows, its other rows held elsewhere (the query rows of a "
    "per-head [query | gate] q_proj fused with k and v, the gate rows in a parameter of their own)",
    STRIDED: "every other slice of it along one axis (its interleaved pairs), where the family's checkpoint "
    "interleaves two tensors so (GPT-OSS's gate_up_proj: gate at [..., 0::2], up at [..., 1::2])",
    SPLIT: "a copy of an equal part of it along one axis, then axes permuted and reshaped, for weights and 1-D "
    "biases alike (TransformerLens' W_Q [heads, d_model, d_head] and b_Q [heads, d_head] cut out of GPT-2's fused "
    "c_attn)",
    SCALED: "its values times a named constant of the architecture (an embedding pre-multiplied by "
    "sqrt(hidden_size), as TransformerLens keeps Gemma's)",
    FLIPPED: "its values reshaped and reversed along one axis (a short conv's taps kept in lag order, the newest "
    "token's first, applied by a shifted sum)",
}


_NEVER_USED = "checkpoint keys never used:"
#: the prefix of the parameters :func:`parity.user.check_model.adopt_plain_tensors` registers for a user model's
#: plain tensors (weights kept in a dict or list attribute)
PLAIN = "plain__"
_HOLDING_NONE = "parameters of ours holding no checkpoint tensor:"
_ROWS_UNHELD = "rows copied into no parameter of ours"


@dataclass(frozen=True)
class Source:
    """Where (part of) one of our parameters comes from.

    ``param``: our parameter name (the first name of its Parameter); ``key``: the checkpoint key;
    ``how``: ``shared`` (same storage), ``copy`` (equal values), ``transposed`` (ours is the key's
    transpose), ``rows`` (ours holds the key's rows at ``rows[j]`` for the key's row ``j``) or
    ``slice`` (ours is a view of part of the key: ``region`` says which, e.g. ``[3, 0:16, :]``),
    ``offset`` (ours = key + ``offset``: 1 for a norm weight kept as ``1 + w``; set on ``rows`` too, for gains
    stacked so), ``layout`` (ours, axes permuted by ``permute`` and reshaped, is the key, or its transpose when
    ``transposed``) or
    ``part`` (ours' rows are the key's rows ``rows`` of the key seen as ``(-1, ours' last dim)``) or
    ``scaled`` (ours = key * ``scale``, the constant ``scale_name``) or ``split`` (ours, axes permuted by
    ``permute`` and reshaped, is the key's ``region``, ``part`` = ``(axis, start, stop)``) or ``flipped`` (ours
    is the key reshaped and reversed along ``flip_axis``). See :data:`CONVENTIONS`.
    """

    param: str
    key: str
    how: str
    rows: tuple[int, ...] | None = None
    region: str | None = None
    offset: float | None = None
    permute: tuple[int, ...] | None = None
    transposed: bool = False
    #: ours = key * scale, the constant named ``scale_name`` (``how`` is ``scaled``)
    scale: float | None = None
    scale_name: str | None = None
    #: ``(axis, start, stop)``: the part of the key ours holds (``how`` is ``split``); ``(axis, start, step)``
    #: for ``strided``
    part: tuple[int, int, int] | None = None
    #: the key's rows ours holds (``how`` is ``fused part``): ours' row ``rows[j]`` holds the key's row
    #: ``key_rows[j]``
    key_rows: tuple[int, ...] | None = None
    #: the axis of ours along which it holds the key (reshaped to ours' shape) reversed (``how`` is ``flipped``)
    flip_axis: int | None = None
    #: ``rows`` count ours' elements, ours flattened (``how`` is ``rows``): vectors fused end to end, then stacked
    #: (per-layer q, k and v biases as one ``(layers, q + k + v)`` tensor)
    flat: bool = False

    def input_axis(self, held_dim: int, key_dim: int) -> int | None:
        """The axis of ours' tensor (``held_dim`` axes) that holds the key's last axis (``key_dim`` axes): an
        ``nn.Linear`` weight's input features, which a product must contract to compute that projection. None
        where the layout does not say it (a view of a region, axes permuted and reshaped)."""
        if self.how in (SHARED, COPY, OFFSET):
            return held_dim - 1 if held_dim == key_dim else None
        if self.how == TRANSPOSED:
            return 0 if held_dim == 2 else None
        if self.how in (SCALED, ROWS, PART, FUSED_PART):
            if self.flat:
                return None
            if self.permute is not None:  # rows held with another axis last: that axis, moved last, is it
                return self.permute[-1] if self.how in (PART, ROWS, FUSED_PART) else None
            return (0 if held_dim == 2 else None) if self.transposed else held_dim - 1
        return None

    def row_axes(self, dim: int) -> tuple[list[int], list[int]]:
        """``(row axes, axes within a row)`` of ours' ``dim``-axis tensor, for the rows ``rows`` counts (a
        ``rows`` source): the axes before the last after ``permute`` (then reshaped to 2-D), the second of a
        transposed 2-D weight (kept input-major), else the first; every axis for ``flat`` rows (each an element)."""
        if self.flat:
            return list(range(dim)), []
        if self.permute is not None:
            return list(self.permute[:-1]), [self.permute[-1]]
        if self.transposed and dim == 2:
            return [1], [0]
        return [0], list(range(1, dim))

    @property
    def one_row(self) -> int | None:
        """The row of ours a ``rows`` source holds the key in whole (a norm's vector stacked with others as
        ``norms[i]``, or a weight and bias as ``wb[0]``, ``wb[1]``); None for any other."""
        return self.rows[0] if self.how == ROWS and self.rows is not None and len(self.rows) == 1 else None

    @property
    def slice_rows(self) -> tuple[int, ...] | None:
        """The key's rows a ``slice`` source holds when it is a block of whole rows (``[128:320, :]``, a bias's
        ``[128:320]``: Mamba-2's in_proj cut into z, xBC and dt at load, each a view); else None."""
        if self.how != SLICE or not self.region:
            return None
        first, *rest = (a.strip() for a in self.region.strip("[]").split(","))
        start, colon, stop = first.partition(":")
        if not colon or not start.isdigit() or not stop.isdigit() or any(a != ":" for a in rest):
            return None
        return tuple(range(int(start), int(stop)))

    @property
    def description(self) -> str:
        """How ours holds the key, in a few words (for alignment tables and coverage notes)."""
        if self.how == SCALED:
            return f"{self.key}{'.T' if self.transposed else ''} * {self.scale_name} ({self.scale:g})"
        if self.how == OFFSET:
            offset = cast(float, self.offset)  # set whenever how is OFFSET
            return f"{self.key} {'+' if offset > 0 else '-'} {abs(offset):g}"
        if self.how == LAYOUT:
            return f"{self.key}{'.T' if self.transposed else ''} as permute{self.permute} then reshape"
        if self.how in (PART, FUSED_PART):
            return f"{len(cast(tuple[int, ...], self.rows))} rows of {self.key}"
        if self.how == STRIDED and self.part is not None:
            axis, start, step = self.part
            return f"{self.key}: every {step}nd slice along axis {axis} from {start} (interleaved pairs)"
        if self.how == SPLIT:
            moved = f" as permute{self.permute} then reshape" if self.permute is not None else ""
            return f"{self.key}{self.region}{'.T' if self.transposed else ''}{moved}"
        return f"{self.key} ({self.how})"


@dataclass
class Coverage:
    """What the loader did with a checkpoint. ``gaps`` are failures; the rest is information.

    ``consumed``: checkpoint key -> our parameter labels (a tied group counts once, as
    ``a = b``). ``unused``: checkpoint keys no parameter came from. ``unwritten``: our parameters
    that hold no checkpoint tensor. ``conversions``: dtype casts and layout changes on the way
    (``key: float32 -> bfloat16``, ``key: transposed into p``, ``key: rows ... of p``). ``copies``:
    parameters equal to a checkpoint tensor by value but not sharing its storage. ``tied``: one line
    per tie the reference's config asks for, saying whether ours keeps one Parameter. ``sources``:
    per our parameter name (every name of a tied Parameter), where its values came from.
    ``replaced``: parameters of ours that held a checkpoint tensor when the pair was built and were
    replaced since (``module.weight = nn.Parameter(...)``, how a fault is injected by hand): the
    loader did its part, so they are named here once and judged by the nodes, not as gaps.
    """

    consumed: dict[str, list[str]] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    unwritten: list[str] = field(default_factory=list)
    conversions: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)
    sources: dict[str, list[Source]] = field(default_factory=dict, repr=False)
    #: our parameters replaced after the pair was built (a fault injected by hand): not a loader gap
    replaced: list[str] = field(default_factory=list)
    #: checkpoint keys outside the text model that ours leaves unused by design (a multimodal
    #: checkpoint's vision and audio towers and projectors), key -> the module it belongs to
    skipped: dict[str, str] = field(default_factory=dict)
    #: parameters of ours holding only zeros or only ones where the reference has no tensor (an
    #: additive bias of zero, a scale of one): neutral, not a gap
    constants: list[str] = field(default_factory=list)
    #: ties of the reference that ours keeps as separate copies (equal values, two Parameters)
    untied: list[str] = field(default_factory=list)
    #: checkpoint keys a user's build reads in a form no parameter holds (a value computed at load from
    #: several tensors), found by perturbing each alone (:mod:`parity.user.derived`): key -> our
    #: parameters derived from it (none when it went into a plain Python number)
    derived: dict[str, list[str]] = field(default_factory=dict)
    #: checkpoint keys some of whose rows (of the key flattened to ``(-1, last axis)``) no parameter of ours holds:
    #: key -> those rows (a gap, unless the build reads them in a form coverage cannot trace: :meth:`mark_derived`)
    rows_unheld: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: a norm's gain folded into the input columns of the projections reading that norm, at load: gain key ->
    #: those projections' weight keys (:mod:`parity.user.folded`); ours runs the norm without its gain
    folded: dict[str, list[str]] = field(default_factory=dict)
    #: plain tensors of a user's model (kept in a dict or list, adopted as ``plain__`` parameters) and RoPE
    #: frequencies kept as frozen parameters (``requires_grad=False``) that hold no checkpoint tensor and are smaller or larger than every unplaced one: state computed at build (RoPE
    #: frequencies), as a buffer's would be, not a gap
    computed: list[str] = field(default_factory=list)
    #: scalar buffers of the reference (constants of the architecture its module registers, xIELU's eps) that
    #: ours holds as plain numbers: key -> value; the nodes judge the value ours uses
    numbers: dict[str, float] = field(default_factory=dict)
    #: buffers of the reference that its modules compute from the config when built (MiniMax's lightning decay
    #: rates), saved with the checkpoint: ours may compute them itself; the nodes judge the values it uses
    from_config: list[str] = field(default_factory=list)
    #: checkpoint keys the reference's logits never depend on in this config (MBart's decoder run alone: its
    #: cross-attention's weights, with no encoder states to attend; BigBird's pooler, computed beside the LM head):
    #: nothing of ours needs to hold them
    unread_by_reference: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.gaps

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "gaps": self.gaps,
            "consumed": len(self.consumed),
            "unused": self.unused,
            "unwritten": self.unwritten,
            "conversions": self.conversions,
            "copies": self.copies,
            "tied": self.tied,
            "replaced": self.replaced,
            "skipped": self.skipped_note(),
            "constants": self.constants,
            "untied": self.untied,
            "derived": self.derived_note(),
            "numbers": self.numbers_note(),
            "from_config": self.from_config_note(),
            "computed": self.computed,
        }

    def numbers_note(self) -> str | None:
        """One sentence for the reference's scalar buffers ours holds as numbers, or None."""
        if not self.numbers:
            return None
        shown = ", ".join(f"{k} = {v:g}" for k, v in list(self.numbers.items())[:3])
        n = len(self.numbers)
        return (
            f"{n} scalar buffer{'s' if n != 1 else ''} of the reference (constants its modules register) held by ours "
            f"as numbers, not tensors: {shown}{f', ... ({n} in all)' if n > 3 else ''}; the nodes judge the values"
        )

    def unwritten_names(self, reasoned: bool = False) -> list[str]:
        """Our parameters in ``unwritten``, by name; with ``reasoned``, only those coverage read as a likely
        loader mistake (a reason after ``"; "``: halves read as interleaved pairs, a weight transposed before
        fusing)."""
        return [u.split(" (")[0] for u in self.unwritten if not reasoned or "; " in u]

    def from_config_note(self) -> str | None:
        """One sentence for the reference's buffers computed from its config that ours holds no copy of, or None."""
        if not self.from_config:
            return None
        n = len(self.from_config)
        return (
            f"{n} buffer{'s' if n != 1 else ''} of the reference computed from its config when built (a fresh model "
            f"holds the same values) that ours computes itself: {_summary(self.from_config)}; the nodes judge the "
            "values it uses"
        )

    def mark_from_config(self, keys: list[str]) -> None:
        """Take ``keys`` (the reference's buffers a fresh model computes alike from its config) out of ``unused``."""
        self.from_config += [k for k in keys if k not in self.from_config]
        self._taken(set(keys), set())

    def mark_numbers(self, numbers: dict[str, float]) -> None:
        """Take ``numbers`` (the reference's scalar buffers ours holds as plain numbers, key -> value) out of
        ``unused``: the nodes judge the values."""
        self.numbers.update(numbers)
        self._taken(set(numbers), set())

    def mark_unread_by_reference(self, keys: list[str]) -> None:
        """Take ``keys`` (checkpoint keys the reference's forward never reads) out of ``unused``: no computation of
        the check reads them, on either side."""
        self.unread_by_reference.extend(k for k in keys if k not in self.unread_by_reference)
        self._taken(set(keys), set())

    def mark_derived(self, found: dict[str, list[str]]) -> None:
        """Take the keys of ``found`` (checkpoint key -> our parameters derived from it) out of ``unused`` and
        those parameters out of ``unwritten``: read in a form coverage cannot trace, they are judged by the
        nodes."""
        self.derived.update(found)
        self._taken(set(found), {p for names in found.values() for p in names})

    def _taken(self, keys: set[str], params: set[str]) -> None:
        """``keys`` out of ``unused`` and ``params`` out of ``unwritten``, the gap lines written again for what
        remains."""
        if not keys and not params:
            return
        self.unused = [k for k in self.unused if k not in keys]
        self.unwritten = [u for u in self.unwritten if u.split(" (")[0] not in params]
        # rows of a key no parameter holds, read in a derived form: no gap either
        folded = {k for k in keys if self.rows_unheld.pop(k, None) is not None}
        self.gaps = [g for g in self.gaps if not (g.endswith(_ROWS_UNHELD) and g.split(": ", 1)[0] in folded)]
        self.gaps = [g for g in self.gaps if not g.startswith((_NEVER_USED, _HOLDING_NONE))]
        if self.unused:
            self.gaps.append(f"{_NEVER_USED} {_summary(self.unused)}")
        if self.unwritten:
            self.gaps.append(f"{_HOLDING_NONE} {_summary(self.unwritten)}")

    def derived_note(self) -> str | None:
        """One sentence for the checkpoint tensors read in a form no parameter holds, or None."""
        if not self.derived:
            return None
        parts = [
            f"{k} -> {', '.join(v[:3])}" if v else f"{k} -> a value no parameter holds" for k, v in self.derived.items()
        ]
        n = len(parts)
        return (
            f"{n} checkpoint tensor{'s' if n != 1 else ''} computed into other values at load (perturbed alone, each "
            f"changes your logits; the nodes judge the result): {'; '.join(parts[:4])}"
            + (f"; ... ({n} in all)" if n > 4 else "")
        )

    def skipped_note(self) -> str | None:
        """One line naming and counting the checkpoint tensors not used by design, per module, or None."""
        if not self.skipped:
            return None
        per: dict[str, int] = {}
        for module in self.skipped.values():
            per[module] = per.get(module, 0) + 1
        parts = ", ".join(f"{module} {n}" for module, n in sorted(per.items(), key=lambda kv: (-kv[1], kv[0])))
        n = len(self.skipped)
        return f"{n} checkpoint tensor{'s' if n != 1 else ''} outside the text model, not used by design ({parts})"

    def replaced_note(self) -> str | None:
        """One sentence for every parameter replaced after loading, or None."""
        if not self.replaced:
            return None
        shown = "; ".join(self.replaced[:3]) + (
            f"; ... ({len(self.replaced)} in all)" if len(self.replaced) > 3 else ""
        )
        return (
            f"ours no longer holds the checkpoint tensor of {len(self.replaced)} parameter"
            f"{'s' if len(self.replaced) != 1 else ''} replaced after the pair was built ({shown}); "
            "loader coverage does not judge them, the nodes do"
        )


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last element offset ``t`` touches in its storage."""
    offset = cast(int, t.storage_offset())
    if t.numel() == 0:
        return offset, offset
    last = offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return offset, last + 1


def _runs(t: torch.Tensor) -> list[tuple[int, int]]:
    """The storage intervals ``[start, end)`` a strided view covers (one per contiguous run)."""
    if t.numel() == 0:
        return []
    if t.is_contiguous():
        return [(cast(int, t.storage_offset()), cast(int, t.storage_offset()) + t.numel())]
    shape, stride = list(t.shape), list(t.stride())
    inner = shape[-1] if stride[-1] == 1 else 1
    outer_shape, outer_stride = (shape[:-1], stride[:-1]) if stride[-1] == 1 else (shape, stride)
    starts = torch.zeros((), dtype=torch.int64) + cast(int, t.storage_offset())
    for n, s in zip(outer_shape, outer_stride):
        starts = starts[..., None] + torch.arange(n, dtype=torch.int64) * s
    return [(int(a), int(a) + inner) for a in starts.reshape(-1).tolist()]


def _region(view: torch.Tensor, whole: torch.Tensor) -> str:
    """``view``'s place in ``whole`` as an index expression (``[3, 0:16, :]``) when it is a block of
    it with ``whole``'s strides or whole rows of it in another shape, else its element range."""
    offset = view.storage_offset() - whole.storage_offset()
    if (
        whole.is_contiguous()
        and view.dim() <= whole.dim()
        and tuple(view.stride()) == tuple(whole.stride()[whole.dim() - view.dim() :])
    ):
        start = [int(i) for i in torch.unravel_index(torch.tensor(offset), tuple(whole.shape))] if whole.numel() else []
        sizes = [1] * (whole.dim() - view.dim()) + list(view.shape)
        parts = []
        for d, (a, n) in enumerate(zip(start, sizes)):
            lead = d < whole.dim() - view.dim()
            parts.append(str(a) if lead else ":" if n == whole.shape[d] else f"{a}:{a + n}")
        return "[" + ", ".join(parts) + "]"
    row = whole[0].numel() if whole.dim() >= 2 and whole.shape[0] else 0
    if whole.is_contiguous() and view.is_contiguous() and row and offset % row == 0 and view.numel() % row == 0:
        # whole rows in another shape (``kv_b[:heads * d].view(heads, d, -1)``): those rows
        first = offset // row
        return f"[{first}:{first + view.numel() // row}" + ", :" * (whole.dim() - 1) + "]"
    return f"[elements {offset}..{offset + view.numel() - 1}]"


def _row_bytes(t: torch.Tensor) -> list[bytes]:
    flat = t.detach().reshape(t.shape[0], -1).contiguous()
    raw = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    return [row.numpy().tobytes() for row in raw.cpu()]


def _offset(p: torch.Tensor, t: torch.Tensor) -> float | None:
    """1 or -1 when ``p`` is ``t + 1`` or ``t - 1`` (computed in ``p``'s dtype or in float32 and cast,
    both ways a user's loader may have written it), else None."""
    if p.shape != t.shape or not p.is_floating_point():
        return None
    for offset in (1.0, -1.0):
        if torch.equal(p, t.to(p.dtype) + offset) or torch.equal(p, (t.float() + offset).to(p.dtype)):
            return offset
    return None


def _scaled(p: torch.Tensor, t: torch.Tensor, constants: dict[str, float]) -> tuple[str, float] | None:
    """``(name, c)`` when ``p`` is ``t * c`` for one of the named ``constants`` (or its inverse), computed
    in ``p``'s dtype or in float64 and cast, as a loader may have written it; None otherwise."""
    if p.shape != t.shape or not p.is_floating_point() or not p.numel():
        return None
    # a few elements spread over the tensor (a padding row may be zeros) rule most constants out cheaply
    at = torch.linspace(0, t.numel() - 1, min(t.numel(), 257)).long()
    sample, ours = t.reshape(-1)[at].to(p.dtype), p.reshape(-1)[at]
    nonzero = (sample != 0).nonzero()
    if not len(nonzero):
        return None
    i = int(nonzero[0])
    ratio = float(ours[i]) / float(sample[i])
    t = t.to(p.dtype)
    named = [(n, c) for n, c in constants.items() if c] + [(f"1 / {n}", 1 / c) for n, c in constants.items() if c]
    for name, c in named:
        if abs(ratio / c - 1) > 1e-2:  # the first nonzero element rules out most constants cheaply
            continue
        products = (t * c, t * torch.tensor(c, dtype=p.dtype), (t.double() * c).to(p.dtype))
        if any(torch.equal(p, product) for product in products):
            return name, c
    return None


def _layout(p: torch.Tensor, t: torch.Tensor) -> tuple[tuple[int, ...], bool] | None:
    """``(permute, transposed)`` when ``p``'s axes permuted by ``permute`` and reshaped to ``t``'s
    shape are ``t`` (or, ``transposed``, reshaped to ``t.T`` are ``t.T``): a weight kept in another
    shape (TransformerLens' ``W_Q`` ``[heads, d_model, d_head]`` is ``q_proj.weight`` seen as
    ``[heads, d_head, d_model]`` with its last two axes swapped), or in the same shape with its axes
    exchanged (stacked experts kept input-major, ``(experts, in, out)``, where hidden and intermediate
    sizes are equal). None otherwise."""
    if p.numel() != t.numel() or p.dim() > 4 or p.numel() < 2:
        return None
    identity = tuple(range(p.dim()))
    for perm in itertools.permutations(range(p.dim())):
        if p.shape == t.shape and (perm == identity or p.dim() == 2):
            continue  # equal values in place are a copy, a 2-D transpose TRANSPOSED: judged as such elsewhere
        q = p.permute(perm)
        for transposed in (False, True) if t.dim() == 2 else (False,):
            target = t.T if transposed else t
            try:
                shaped = q.reshape(target.shape)
            except RuntimeError:
                continue
            if torch.equal(shaped, target.to(p.dtype)):
                return perm, transposed
    return None


def _flipped(p: torch.Tensor, t: torch.Tensor) -> int | None:
    """The axis of ``p`` along which it holds ``t`` (reshaped to ``p``'s shape) reversed, its last: a short
    conv's ``(channels, 1, K)`` taps kept ``(channels, K)`` in lag order (the newest token's tap first, applied
    by a shifted sum); None otherwise."""
    if p.numel() < 2 or not p.is_floating_point():
        return None
    try:
        q = t.to(p.dtype).reshape(p.shape)
    except RuntimeError:
        return None
    # the last axis only: rows in another order (experts reversed) are rows reordered, read with the fused rows
    axis = p.dim() - 1
    if p.shape[axis] > 1 and not torch.equal(p, q) and torch.equal(p, q.flip(axis)):
        return axis
    return None


def _part_rows(p: torch.Tensor, t: torch.Tensor, cache: dict | None = None) -> tuple[int, ...] | None:
    """The rows of ``t`` (seen as ``(-1, p.shape[-1])``) that ``p``'s rows copy, in ``p``'s row order,
    when every row of ``p`` is one and ``t`` has more: one expert copied out of a fused experts tensor.
    ``cache``: row indices of tensors already seen (one expert after another reads the same ``t``)."""
    if p.dim() < 1 or t.numel() <= p.numel() or t.dim() < 2 or t.shape[-1] != p.shape[-1]:
        return None
    width = p.shape[-1]
    tag = (id(t), p.dtype)
    where = cache.get(tag) if cache is not None else None
    if where is None:
        where = {}
        for r, b in enumerate(_row_bytes(t.reshape(-1, width).to(p.dtype))):
            where.setdefault(b, []).append(r)
        if cache is not None:
            cache[tag] = where
    rows: list[int] = []
    used: set[int] = set()
    for b in _row_bytes(p.reshape(-1, width)):
        free = [r for r in where.get(b, []) if r not in used]
        if not free:
            return None
        rows.append(free[0])
        used.add(free[0])
    return tuple(rows)


def _companion_bias(p: torch.Tensor, weight_sources: list, state_dict: dict) -> tuple[str, tuple[int, ...]] | None:
    """``(bias key, rows)`` when the module's weight holds some rows of a fused checkpoint weight and
    ``p`` holds the same elements of that weight's bias."""
    for source in weight_sources:
        held = source.rows if source.how in (PART, ROWS) else source.slice_rows  # a block of rows kept as a view
        if not held or not source.key.endswith(".weight"):
            continue
        key = source.key[: -len("weight")] + "bias"
        bias = state_dict.get(key)
        rows = tuple(held)
        if bias is None or bias.dim() != 1 or len(rows) != p.numel() or max(rows) >= bias.numel():
            continue
        if torch.equal(p, bias[list(rows)].to(p.dtype)):
            return key, rows
        if source.how == ROWS and sorted(rows) == list(range(len(rows))):
            # ROWS says where ours holds each of the key's rows: the bias permuted the same way
            held = tuple(sorted(range(len(rows)), key=rows.__getitem__))
            if torch.equal(p, bias[list(held)].to(p.dtype)):
                return key, held
    return None


def _split_part(p: torch.Tensor, t: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, ...], bool] | None:
    """``((axis, start, stop), permute, transposed)`` when ``p`` is ``t``'s part ``start:stop`` along ``axis``,
    one of equal parts, as it is or axes permuted and reshaped (:func:`_layout`); None otherwise."""
    if not p.is_floating_point() or not 0 < p.numel() < t.numel():
        return None
    for axis, n in enumerate(t.shape):
        if (p.numel() * n) % t.numel():
            continue
        size = p.numel() * n // t.numel()
        if not 0 < size < n or n % size:
            continue
        for start in range(0, n, size):
            part = t.narrow(axis, start, size)
            if part.shape == p.shape and torch.equal(p, part.to(p.dtype)):
                return (axis, start, start + size), tuple(range(p.dim())), False
            if p.dim() == 2 and part.shape == p.shape and torch.equal(p.T, part.to(p.dtype)):
                # a square part transposed (GPT-2's Conv1D c_attn cut into q/k/v nn.Linear weights):
                # _layout leaves equal shapes alone
                return (axis, start, start + size), (1, 0), False
            found = _layout(p, part)
            if found is not None:
                return (axis, start, start + size), found[0], found[1]
    return _vector_slice(p, t)


def _frequencies(t: torch.Tensor) -> bool:
    """Whether ``t`` looks like RoPE's inverse frequencies: a float vector of positive values, none above 1,
    never rising (``theta ** (-2i / d)``, scaled or not)."""
    if t.dim() != 1 or t.numel() < 2 or not t.is_floating_point():
        return False
    return bool((t > 0).all() and (t <= 1).all() and (t[1:] <= t[:-1]).all())


def _vector_slice(p: torch.Tensor, t: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, ...], bool] | None:
    """``((0, start, stop), identity, False)`` when ``p`` holds a contiguous slice of the vector ``t`` in another
    shape, the vector cut into unequal parts (Mamba-2's in_proj bias cut into z, x, B, C and dt at load, each
    kept per head as ``(heads, head_dim)``); None otherwise."""
    if t.dim() != 1 or p.dim() < 2:
        return None
    flat = p.reshape(-1).to(t.dtype)
    for start in (flat[0] == t).nonzero().flatten().tolist():
        stop = start + flat.numel()
        if stop <= t.numel() and torch.equal(t[start:stop], flat):
            return (0, start, stop), tuple(range(p.dim())), False
    return None


def _region_of(part: tuple[int, int, int], dim: int) -> str:
    axis, start, stop = part
    return "[" + ", ".join(f"{start}:{stop}" if d == axis else ":" for d in range(dim)) + "]"


def _split_gaps(key: str, whole: torch.Tensor, parts: list[tuple[tuple[int, int, int], str]]) -> list[str]:
    """Every part of a tensor split along one axis in exactly one parameter: other axes, overlaps and holes."""
    axes = {part[0] for part, _ in parts}
    if len(axes) > 1:
        return [f"{key}: cut along more than one axis ({', '.join(label for _, label in parts[:4])})"]
    axis = axes.pop()
    reach, gaps = 0, []
    for (_, start, stop), label in sorted(parts, key=lambda item: item[0][1]):
        if start < reach:
            gaps.append(f"{key}: part {start}:{stop} along axis {axis} lands twice ({label})")
        elif start > reach:
            gaps.append(f"{key}: part {reach}:{start} along axis {axis} lands in no parameter of ours")
        reach = max(reach, stop)
    if reach < whole.shape[axis]:
        gaps.append(f"{key}: part {reach}:{whole.shape[axis]} along axis {axis} lands in no parameter of ours")
    return gaps


def _row_index(p: torch.Tensor) -> dict[bytes, list[int]]:
    """``p``'s rows by their bytes: each row's indices in ``p``."""
    where: dict[bytes, list[int]] = {}
    for r, b in enumerate(_row_bytes(p)):
        where.setdefault(b, []).append(r)
    return where


def _whole_parts(
    p: torch.Tensor, candidates: dict[str, torch.Tensor], where: dict[bytes, list[int]], cache: dict | None = None
) -> tuple[list[tuple[str, tuple[int, ...]]], set[int]]:
    """The candidates whose rows, all of them, are rows of ``p`` not taken by an earlier one: ``([(key, our row of
    each of its rows)], the rows of ``p`` they take)``. A vector (or a ``(1, 1, hidden)`` tensor) counts as one row
    of a 2-D ``p`` (a LayerNorm's weight and bias kept as one ``(2, hidden)`` tensor, RWKV's mixes stacked).
    ``cache``: key -> its rows' bytes, filled here for a caller that reads the same candidates again."""
    taken: set[int] = set()
    parts = []
    for key, t in candidates.items():
        if t.dim() not in (0, 2) and p.dim() == 2 and t.numel() == t.shape[-1] and t.is_floating_point():
            t = t.reshape(1, -1)
        taller = t.shape[0] > p.shape[0] if t.dim() else True
        if t.dim() != p.dim() or tuple(t.shape[1:]) != tuple(p.shape[1:]) or (taller and cache is None):
            continue
        row_bytes = _row_bytes(t.to(p.dtype))
        if cache is not None:  # a taller tensor too: some of its rows may be p's
            cache[key] = row_bytes
        if taller:
            continue
        rows: list[int] = []
        for b in row_bytes:
            free = [r for r in where.get(b, []) if r not in taken and r not in rows]
            if not free:
                break
            rows.append(free[0])
        else:
            taken.update(rows)
            parts.append((key, tuple(rows)))
    return parts, taken


def _fused_rows(p: torch.Tensor, candidates: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...]]] | None:
    """The checkpoint tensors whose rows, all of them, make up every row of ``p`` (in any order), as
    ``[(key, our row of each of its rows)]``; None unless they explain ``p`` exactly. One tensor whose
    rows ``p`` holds in another order counts too (q/k rows permuted per head for interleaved RoPE)."""
    if p.dim() < 2 or p.shape[0] < 2:
        return None
    parts, taken = _whole_parts(p, candidates, _row_index(p))
    if len(taken) != p.shape[0] or not parts:
        return None
    if len(parts) == 1 and parts[0][1] == tuple(range(p.shape[0])):
        return None  # the identity: a copy, judged as such
    return parts


def _one_slab_each(parts: list[tuple[str, tuple[int, ...]]], p: torch.Tensor) -> bool:
    """Whether each key's rows (of ``p`` seen as rows of its last axis) lie in one slab along ``p``'s first axis: a
    stack of whole tensors per layer, not tensors cut across the stack."""
    per_slab = math.prod(p.shape[1:-1])
    return all(len({r // per_slab for r in rows}) == 1 for _, rows in parts)


def _stacked_parts(
    p: torch.Tensor, candidates: dict[str, torch.Tensor], cache: dict | None = None
) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, ...], tuple[int, ...]]]] | None:
    """``p`` (three axes or more) as a stack along its first axis of parts of checkpoint tensors, one tensor per
    slab (Falcon's fused ``query_key_value`` cut into q, k and v at load, each stacked over layers and kept
    input-major: ``(layers, hidden, heads * head_dim)``): ``(the axes' order whose last holds the key's input
    features, [(key, ours' rows, the key's rows)])`` with ours' rows counted in ``p`` permuted so, every axis but
    the last flattened; None unless every slab is some rows of one tensor, a distinct tensor each."""
    if p.dim() < 3 or p.shape[0] < 2 or not p.is_floating_point():
        return None
    flat = p.flatten()
    if bool((flat == flat[0]).all()):
        return None  # a constant matches any tensor's equal rows
    for axis in (*range(1, p.dim() - 1), p.dim() - 1):
        order = tuple(a for a in range(p.dim()) if a != axis) + (axis,)
        held = p.permute(order)
        per_slab = math.prod(held.shape[1:-1])
        rows = held.reshape(-1, held.shape[-1])
        fitting = {k: t for k, t in candidates.items() if t.dim() >= 2 and t.shape[-1] == held.shape[-1]}
        found: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        used: set[str] = set()
        for slab in range(p.shape[0]):
            start, stop = slab * per_slab, (slab + 1) * per_slab
            hit = next(
                (
                    (k, key_rows)
                    for k, t in fitting.items()
                    if k not in used and (key_rows := _part_rows(rows[start:stop], t, cache))
                ),
                None,
            )
            if hit is None:
                break
            used.add(hit[0])
            found.append((hit[0], tuple(range(start, stop)), hit[1]))
        else:
            return order, found
    return None


def _neutral_rows(
    p: torch.Tensor, vectors: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, tuple[int, ...]]], list[int]] | None:
    """Checkpoint vectors making up every row of the 2-D ``p`` but some, each of those all ones or all zeros (a
    neutral slot: no module of the reference there), as ``(parts, the neutral rows)``; None otherwise, or when
    they are most rows (a table of gains not loaded at all is no stack of vectors)."""
    if p.dim() != 2 or p.shape[0] < 3 or not vectors:
        return None
    parts, taken = _whole_parts(p, vectors, _row_index(p))
    rest = [r for r in range(p.shape[0]) if r not in taken]
    if not parts or not rest or len(rest) * 2 >= p.shape[0]:
        return None
    neutral = all(bool((p[r] == 1).all()) or bool((p[r] == 0).all()) for r in rest)
    return (parts, rest) if neutral else None


def _fused_with_part(
    p: torch.Tensor, candidates: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...], tuple[int, ...]]]] | None:
    """``p``'s rows as whole checkpoint tensors' rows (as :func:`_fused_rows` reads them) and, for the rows left,
    some rows of other tensors, each of several distinct rows: ``(whole parts, [(key, ours' rows, the key's
    rows)])``; None unless every row of ``p`` is explained, one tensor at least whole and one partial (a per-head
    ``[query | gate]`` q_proj whose query rows ours fuses with k and v, its gate rows held apart)."""
    if p.dim() != 2 or p.shape[0] < 2:
        return None
    where = _row_index(p)
    fitting = {
        k: t for k, t in candidates.items() if t.dim() == 2 and t.shape[1] == p.shape[1] and t.is_floating_point()
    }
    rows_of: dict[str, list[bytes]] = {}
    whole, taken = _whole_parts(p, fitting, where, rows_of)
    partial: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for key, row_bytes in rows_of.items():
        if len(taken) == p.shape[0]:
            break
        if any(k == key for k, _ in whole) or len(set(row_bytes)) < 2:
            continue
        ours_rows, key_rows = [], []
        for j, b in enumerate(row_bytes):
            free = [r for r in where.get(b, []) if r not in taken and r not in ours_rows]
            if free:
                ours_rows.append(free[0])
                key_rows.append(j)
        if len(key_rows) >= 2 and len({row_bytes[j] for j in key_rows}) >= 2:
            taken.update(ours_rows)
            partial.append((key, tuple(ours_rows), tuple(key_rows)))
    if len(taken) != p.shape[0] or not partial or not whole:  # one tensor's rows alone: a part (_part_rows)
        return None
    return whole, partial


def _transposed_in(p: torch.Tensor, free: dict[str, torch.Tensor]) -> str:
    """Why a fused tensor of ours holds no checkpoint tensor, when it is one: its rows are checkpoint
    tensors' rows with a square one transposed (``torch.cat([wq.T, wk, wv])``: a weight transposed
    before it was fused, which computes ``x @ W`` for that part instead of ``x @ W.T``)."""
    square = {k: t for k, t in free.items() if t.dim() == 2 and t.shape[0] == t.shape[1] > 1}
    for key, t in square.items():
        parts = _fused_rows(p, {**{k: v for k, v in free.items() if k != key}, key: t.T.contiguous()})
        if parts and any(k == key for k, _ in parts):
            return f"; its rows are {', '.join(k for k, _ in parts)} with {key} transposed: a weight transposed before it was fused"
    return ""


def _rows_zeroed(p: torch.Tensor, free: dict[str, torch.Tensor]) -> tuple[str, list[int]] | None:
    """``(key, rows)`` when ``p`` (2-D) is a checkpoint tensor of its shape with a few rows (at most an eighth)
    set to zero and every other row equal."""
    if p.dim() != 2 or not p.is_floating_point():
        return None
    zero = (p == 0).all(-1)
    if not bool(zero.any()) or int(zero.sum()) * 8 > p.shape[0]:
        return None
    for key, t in free.items():
        if tuple(t.shape) == tuple(p.shape) and torch.equal(p[~zero], t[~zero].to(p.dtype)):
            rows = zero.nonzero().flatten().tolist()
            if bool((t[zero] != 0).any()):
                return key, rows
    return None


def _permuted_vector(p: torch.Tensor, free: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...]]] | None:
    """``[(key, our element of each of its elements)]`` when 1-D ``p`` holds a 1-D checkpoint tensor's distinct
    values in another order (a per-head norm's weight permuted as its q/k rows were, for another RoPE
    pairing); None otherwise."""
    if p.numel() < 2 or not p.is_floating_point() or p.unique().numel() != p.numel():
        return None
    for key, t in free.items():
        same = t.dim() == 1 and t.shape == p.shape and t.is_floating_point() and not torch.equal(t.to(p.dtype), p)
        if same and torch.equal(t.to(p.dtype).sort().values, p.sort().values):
            where = {float(v): i for i, v in enumerate(p.tolist())}
            return [(key, tuple(where[float(v)] for v in t.to(p.dtype).tolist()))]
    return None


def _strided_part(p: torch.Tensor, free: dict[str, torch.Tensor]) -> tuple[str, tuple[int, int, int]] | None:
    """``(key, (axis, start, 2))`` when ``p`` is every other slice of a checkpoint tensor along one axis."""
    for key, t in free.items():
        if t.dim() != p.dim() or t.numel() != 2 * p.numel() or not t.is_floating_point():
            continue
        for axis in range(t.dim()):
            if t.shape[axis] % 2 or t.shape[axis] // 2 != p.shape[axis]:
                continue
            for start in (0, 1):
                if torch.equal(p, t.index_select(axis, torch.arange(start, t.shape[axis], 2)).to(p.dtype)):
                    return key, (axis, start, 2)
    return None


def _strided_in(p: torch.Tensor, free: dict[str, torch.Tensor]) -> str:
    """Why a parameter of ours holds no checkpoint tensor, when it holds every other row of one (as it is,
    or its last two axes exchanged): a fused tensor read as interleaved pairs where the checkpoint stacks
    its parts (``gate_up_proj[:, 0::2]`` for Transformers' ``[gate; up]``), or the reverse."""
    exchanged = [(p.transpose(-1, -2), ", its last two axes exchanged")] if p.dim() >= 2 else []
    for held, how in [(p, ""), *exchanged]:
        found = _strided_part(held, free)
        if found is not None:
            key, (axis, start, _) = found
            return (
                f"; it holds every other slice of {key} along axis {axis}, from {start}{how}: the fused "
                "tensor read as interleaved pairs where the checkpoint stacks its two halves (or the reverse)"
            )
    return ""


def _fused_slices(p: torch.Tensor, candidates: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...]]] | None:
    """1-D ``p`` as consecutive 1-D checkpoint tensors (fused biases); None unless exact."""
    if p.dim() != 1:
        return None
    parts, start, n = [], 0, p.shape[0]
    remaining = {k: t for k, t in candidates.items() if t.dim() == 1 and t.shape[0] < n}
    while start < n:
        hit = next(
            (
                k
                for k, t in remaining.items()
                if start + t.shape[0] <= n and torch.equal(p[start : start + t.shape[0]], t.to(p.dtype))
            ),
            None,
        )
        if hit is None:
            return None
        size = remaining.pop(hit).shape[0]
        parts.append((hit, tuple(range(start, start + size))))
        start += size
    return parts if len(parts) >= 2 else None


def _pick(equal: list[str], names: list[str], consumed) -> str:
    """Among checkpoint keys whose tensors ``names`` (a parameter of ours) equals, the one it holds: one nothing
    consumed yet, the one named as ours names it first (an untrained checkpoint's all-ones norms or all-zero
    tables: the assignment a port keeping the checkpoint's names means)."""
    ordered = sorted(equal, key=lambda k: not _named_alike(k, names))
    return next((k for k in ordered if k not in consumed), ordered[0])


def _named_alike(key: str, names: list[str]) -> bool:
    """Whether one of ``names`` (a parameter of ours) is ``key`` (a checkpoint key), or either ends with the
    other at a dot (ours under a prefix of its own: ``inner.model.norm.weight`` for ``model.norm.weight``)."""
    return any(n == key or n.endswith("." + key) or key.endswith("." + n) for n in names)


def loader_coverage(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    tied_keys: dict[str, str] | None = None,
    conversions: list[str] | None = None,
    built: dict[str, tuple] | None = None,
    by_design: dict[str, str] | None = None,
    copies_break_ties: bool = True,
    constants: dict[str, float] | None = None,
    interleaved: bool = False,
    unread: dict[str, range] | None = None,
) -> Coverage:
    """Trace every parameter of ``model`` back to ``state_dict`` (the tensors it was loaded from).

    ``tied_keys``: checkpoint key -> the key it must be tied to (Transformers'
    ``_tied_weights_keys`` when the config ties embeddings); ours must then hold one Parameter for
    both. ``conversions``: casts already applied to the state dict, reported as they are.
    ``built``: :func:`parameter_storages` taken right after loading; a parameter that held a
    checkpoint tensor then and another tensor now was replaced by hand, and lands in ``replaced``.
    ``by_design``: checkpoint key -> module, for keys ours is not meant to use (a multimodal checkpoint's
    parts outside the text model); left unused they land in ``skipped``, not in the gaps (one ours
    does use is judged like any other key). ``copies_break_ties``: a tie kept as equal copies is a gap
    (our families' loaders must tie); False for a user's model, where it is a note (the forward
    agrees; a training step would not, which the backward check judges). ``constants``: named scalars
    of the architecture a parameter of ours may hold a checkpoint tensor multiplied by (``scaled``).
    ``interleaved``: the family's checkpoint interleaves pairs of tensors along an axis (GPT-OSS's
    gate/up), so a parameter holding every other slice of one is that tensor's part (``strided``); else it
    is refused, with that reading named as the likely loader bug. ``unread``: checkpoint key -> rows (over
    its leading axes) the reference's forward never reads (:func:`parity.build.reference.unread_rows`): ours
    may leave them out.
    """
    cov = Coverage(conversions=list(conversions or []))
    # checkpoint keys that alias one storage (state_dict() of a tied model) form one source
    sources: dict[tuple, list[str]] = {}
    key: str | None
    for key, tensor in state_dict.items():
        sources.setdefault(storage_key(tensor), []).append(key)
    by_shape: dict[tuple, list[str]] = {}
    for key, tensor in state_dict.items():
        by_shape.setdefault(tuple(tensor.shape), []).append(key)

    params: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), (p, []))[1].append(name)
    # buffers hold checkpoint tensors too (Gemma 4's layer_scalar); one that holds none is derived
    # state (RoPE frequencies, a mask), never a gap
    buffers: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in params:
            buffers.setdefault(id(b), (b, []))[1].append(name)

    def record(names: list[str], key: str, how: str, rows=None, region=None, **extra) -> None:
        label = " = ".join(names)
        cov.consumed.setdefault(key, []).append(label)
        for n in names:
            cov.sources.setdefault(n, []).append(Source(names[0], key, how, rows, region, **extra))

    def by_value(p: torch.Tensor, names: list[str]) -> bool:
        """Trace ``p`` to a checkpoint tensor by value (a copy, a transpose, w +- 1, another shape);
        among equal candidates one nothing consumed yet (an untrained checkpoint's norm weights are
        all ones: any one-to-one assignment holds)."""
        label = " = ".join(names)
        equal = [k for k in by_shape.get(tuple(p.shape), []) if torch.equal(p, state_dict[k].to(p.dtype))]
        match: str | None
        if equal:
            match = _pick(equal, names, cov.consumed)
            record(names, match, COPY)
            cov.copies.append(f"{label} is a copy of {match}")
            return True
        if p.is_floating_point():  # a copy stored rounded through a narrower dtype (a table kept in bfloat16)
            for narrow in (torch.bfloat16, torch.float16):
                rounded = [
                    k
                    for k in by_shape.get(tuple(p.shape), [])
                    if k not in cov.consumed
                    and state_dict[k].is_floating_point()
                    and torch.equal(p, state_dict[k].to(narrow).to(p.dtype))
                ]
                if rounded:
                    record(names, rounded[0], COPY)
                    cov.conversions.append(
                        f"{rounded[0]}: into {label} rounded to {str(narrow).replace('torch.', '')} (its values lose "
                        "precision: the nodes that read it differ by that rounding)"
                    )
                    return True
        if p.dim() == 2:
            match = next(
                (k for k in by_shape.get(tuple(p.shape[::-1]), []) if torch.equal(p, state_dict[k].to(p.dtype).T)),
                None,
            )
            if match is not None:
                record(names, match, TRANSPOSED)
                cov.conversions.append(f"{match}: transposed into {label}")
                return True
        for key in by_shape.get(tuple(p.shape), []):
            offset = _offset(p, state_dict[key])
            if offset is not None and key not in cov.consumed:
                record(names, key, OFFSET, offset=offset)
                cov.conversions.append(f"{key}: into {label} as {'1 + w' if offset > 0 else 'w - 1'}")
                return True
        for key, t in state_dict.items() if p.dim() >= 2 else ():
            # a norm's vector kept as 1 + w in another shape (a grouped norm's (streams, hidden) gain for its
            # (streams * hidden,) weight)
            offset = _offset(p.reshape(-1), t) if t.dim() == 1 and t.numel() == p.numel() else None
            if offset is not None and key not in cov.consumed:
                record(names, key, OFFSET, offset=offset)
                as_held = "1 + w" if offset > 0 else "w - 1"
                cov.conversions.append(f"{key}: into {label} {tuple(p.shape)} as {as_held}")
                return True
        for key, t in state_dict.items():
            if t.numel() != p.numel() or key in cov.consumed:
                continue
            found = _layout(p, t)
            if found is not None:
                perm, transposed = found
                record(names, key, LAYOUT, permute=perm, transposed=transposed)
                cov.conversions.append(
                    f"{key}: into {label} {tuple(p.shape)} (axes {perm}{', transposed' if transposed else ''})"
                )
                return True
        for key, t in state_dict.items():
            if t.numel() != p.numel() or key in cov.consumed or not t.is_floating_point():
                continue
            axis = _flipped(p, t)
            if axis is not None:
                record(names, key, FLIPPED, flip_axis=axis)
                cov.conversions.append(f"{key}: into {label} {tuple(p.shape)} reversed along axis {axis}")
                return True
        # a copy scaled by a constant: of a tensor nothing consumed yet first, else of a tie's tensor (its
        # other copy already holds it: TransformerLens' W_U beside W_E * sqrt(hidden_size))
        same = sorted(by_shape.get(tuple(p.shape), []) if constants else [], key=lambda k: k in cov.consumed)
        # transposed: a matrix's two axes, or stacked experts' last two ((experts, out, in) held (experts, in, out))
        swapped = (*p.shape[:-2], p.shape[-1], p.shape[-2]) if p.dim() in (2, 3) else None
        flipped = by_shape.get(swapped, []) if constants and swapped is not None else []
        flipped = sorted(flipped, key=lambda k: k in cov.consumed)  # a tied head kept transposed and scaled too
        for key, transposed in [(k, False) for k in same] + [(k, True) for k in flipped]:
            t = state_dict[key].transpose(-1, -2) if transposed else state_dict[key]
            scaled = _scaled(p, t, cast(dict, constants))
            if scaled is not None:
                record(names, key, SCALED, scale=scaled[1], scale_name=scaled[0], transposed=transposed)
                how = "transposed, " if transposed else ""
                cov.conversions.append(f"{key}: into {label} {how}times {scaled[0]} ({scaled[1]:g})")
                return True
        return False

    # checkpoint tensors by the storage they live in, for parameters that are views of part of one
    by_ptr: dict[tuple, list[str]] = {}
    keys: list[str] | None
    for st, keys in sources.items():
        by_ptr.setdefault(st[:2], []).append(keys[0])

    def owner(st: tuple, t: torch.Tensor | None = None) -> str | None:
        """The checkpoint key whose tensor holds storage tuple ``st``: ``t`` a view of a proper part of it
        (a whole tensor in another layout, a transpose, is judged by value below)."""
        for key in by_ptr.get(st[:2], []):
            whole = state_dict[key]
            lo, hi = storage_span(whole)
            part = t is not None and lo <= storage_span(t)[0] and storage_span(t)[1] <= hi and t.dtype == whole.dtype
            # all of it in the same element order (one expert of one, a reshape) is a part too; not a transpose
            if t is None or (part and (t.numel() < whole.numel() or (t.is_contiguous() and whole.is_contiguous()))):
                return key
        return None

    sliced: dict[str, list[tuple[list[tuple[int, int]], str]]] = {}

    unexplained: list[tuple[nn.Parameter, list[str]]] = []
    plain: list[tuple[str, int]] = []  # plain tensors of a user's model (adopted as parameters) holding nothing
    set_aside: set[str] = set()  # checkpoint keys whose parameter was replaced after loading
    for p, names in params.values():
        label = " = ".join(names)
        was = [
            built[n]
            for n in names
            if built
            and n in built
            and built[n] != storage_key(p.data)
            and (built[n] in sources or owner(built[n]) is not None)
        ]
        if was:
            # was[0] is in sources, or owner() finds it (the filter above)
            before = sources.get(was[0]) or [cast(str, owner(was[0]))]
            now = sources.get(storage_key(p.data)) or (
                [cast(str, owner(storage_key(p.data), p.data))] if owner(storage_key(p.data), p.data) else None
            )
            holds = f"now shares {now[0]}" if now else "now a tensor of its own"
            cov.replaced.append(f"{label} (held {before[0]}; {holds})")
            set_aside.update(before)
            continue
        keys = sources.get(storage_key(p.data))
        if keys:
            for key in keys:
                record(names, key, SHARED)
            continue
        key = owner(storage_key(p.data), p.data) if not p.is_meta else None
        if key is not None:  # a view of part of a fused checkpoint tensor
            record(names, key, SLICE, region=_region(p.data, state_dict[key]))
            sliced.setdefault(key, []).append((_runs(p.data), label))
            continue
        if p.is_meta:
            cov.unwritten.append(f"{label} (never written: still on the meta device)")
            continue
        if not by_value(p.data, names):
            unexplained.append((p, names))
    stacked_buffers: set[int] = set()
    for b, names in buffers.values():
        keys = sources.get(storage_key(b))
        if keys:
            for key in keys:
                record(names, key, SHARED)
        elif not b.is_meta and b.is_floating_point():
            if not by_value(b.detach(), names):
                # rows of several checkpoint tensors stacked in a buffer (per-layer router biases), tried as fused
                # rows below; any other buffer is state of ours (a cos/sin table, a mask), no gap
                unexplained.append((cast(nn.Parameter, b), names))  # read as a parameter's value is
                stacked_buffers.add(id(b))
        elif not b.is_meta:  # an integer table (DeepSeek V4's tid2eid): an exact copy of an integer tensor only
            equal = [
                k
                for k in by_shape.get(tuple(b.shape), [])
                if not state_dict[k].is_floating_point() and torch.equal(b, state_dict[k].to(b.dtype))
            ]
            if equal:
                match = _pick(equal, names, cov.consumed)
                record(names, match, COPY)
                cov.copies.append(f"{' = '.join(names)} is a copy of {match}")
    parts_of: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    splits_of: dict[str, list[tuple[tuple[int, int, int], str]]] = {}
    strided_of: dict[str, list[tuple[tuple[int, int, int], str]]] = {}
    row_cache: dict = {}
    if unexplained:  # fused tensors: only now, and only against what nothing else consumed
        free = {k: t for k, t in state_dict.items() if k not in cov.consumed}
        for p, names in unexplained:
            if p.numel() == 0:
                continue  # an empty tensor (a bias of no features) holds nothing to trace
            label = " = ".join(names)
            parts = _fused_rows(p.data, free) or _fused_slices(p.data, free)
            if parts is None and id(p) in stacked_buffers:
                continue
            fused_input_major = False
            moved_axes: tuple[int, ...] | None = None
            stacked_offset: float | None = None  # rows of ours = the checkpoint's vectors + this (1 + w gains)
            if parts is None and p.dim() == 2:  # a fused weight kept input-major (``x @ W``, its columns the rows)
                parts = _fused_rows(p.data.T, free)
                fused_input_major = parts is not None
            # Conv1D weights (GPT-1's and GPT-2's, (in, out)) as their transposes: ours may stack them output-major
            # (a square one's transpose is its axes exchanged: the moved-axis layouts read it)
            conv1d = (
                {k: t.T for k, t in free.items() if t.dim() == 2 and t.shape[0] != t.shape[1] and t.is_floating_point()}
                if p.dim() >= 3
                else {}
            )
            layouts = [
                (axis, keys_transposed)
                for keys_transposed in (False, True)
                for axis in (*range(p.dim() - 1), p.dim() - 1)
                if parts is None and p.dim() >= 3
            ]
            for axis, keys_transposed in layouts:
                # weights fused along leading axes with the input features on another (DBRX's w1 and v1 as one
                # (E, H, 2I), Gemma JAX's kv_einsum (2, KV heads, H, head_dim)): that axis moved last, the rows of
                # every leading index in turn; last, stacked as they are stored ((layers, out, in): the last axis kept);
                # then Conv1D weights stacked so ((layers, 3, heads, head_dim, hidden): GPT-1's c_attn per layer)
                last = tuple(a for a in range(p.dim()) if a != axis) + (axis,)
                parts = _fused_rows(
                    p.data.permute(last).reshape(-1, p.shape[axis]), conv1d if keys_transposed else free
                )
                if parts is not None and axis == p.dim() - 1 and not _one_slab_each(parts, p):
                    parts = None  # (a key across slabs: a per-group fused weight, Jais2's (kv groups, q..k v, in))
                if (
                    parts is not None
                    and keys_transposed
                    and (last[0] != 0 or not _one_slab_each(parts, p.permute(last)))
                ):
                    parts = None  # Conv1D weights stacked per layer only: each whole in one slab of the first axis
                moved_axes = last if parts is not None else None
                if parts is not None:
                    fused_input_major = keys_transposed  # the key's columns are ours' rows
                    break
            if parts is None and p.dim() >= 2:
                # vectors stacked (along several leading axes: (layers, 2, hidden) gains), some slots neutral: a
                # row of ones or zeros where the reference has no module (ModernBERT's layer-0 attention norm is
                # an identity: its slot holds ones), each named in the conversions
                vectors = {k: t for k, t in free.items() if t.dim() == 1}  # (matrices' rows: parts, below)
                rows_of = p.data.reshape(-1, p.shape[-1])
                parts = _fused_rows(rows_of, vectors) if p.dim() >= 3 else None
                for offset in (1.0, -1.0) if parts is None else ():
                    # norm gains kept as 1 + w (Gemma's), stacked: (layers, 4, hidden), or a block's two: (2, hidden)
                    parts = _fused_rows(rows_of, {k: t + offset for k, t in vectors.items()})  # as ours adds it
                    if parts is not None:
                        stacked_offset = offset
                        cov.conversions.append(f"{label}: its rows kept as w {'+' if offset > 0 else '-'} 1")
                        break
                neutral = _neutral_rows(rows_of, vectors) if parts is None else None
                if neutral is not None:
                    parts, slots = neutral
                    cov.conversions.append(
                        f"{label}: {'row' if len(slots) == 1 else 'rows'} {', '.join(map(str, slots))} (of {label} "
                        "flattened to rows) held by no checkpoint tensor, neutral (ones or zeros): a slot where the "
                        "reference has no module"
                    )
                moved_axes = tuple(range(p.dim())) if parts is not None and p.dim() >= 3 else None
            end_to_end = False
            if parts is None and p.dim() >= 2:  # vectors fused end to end, then stacked: (layers, q + k + v) biases
                parts = _fused_slices(p.data.reshape(-1), free)
                end_to_end = parts is not None
            if parts is None and p.dim() == 2:
                # some of a tensor's rows fused with whole others, its other rows held elsewhere: parts of both kinds
                fused_part = next(
                    (
                        (f, flipped)
                        for held, flipped in ((p.data, False), (p.data.T, True))
                        if (f := _fused_with_part(held, free))
                    ),
                    None,
                )
                if fused_part is not None:
                    (whole_parts, partial_parts), flipped = fused_part
                    for key, held_rows in whole_parts:
                        record(names, key, ROWS, held_rows, transposed=flipped)
                        cov.conversions.append(f"{key}: rows of {label}")
                        free.pop(key, None)
                    for key, held_rows, key_rows in partial_parts:
                        record(names, key, FUSED_PART, held_rows, transposed=flipped, key_rows=key_rows)
                        parts_of.setdefault(key, []).append((key_rows, label))
                    continue
            stacked = (
                _stacked_parts(
                    p.data, {k: t for k, t in state_dict.items() if k not in cov.consumed or k in parts_of}, row_cache
                )
                if parts is None and p.dim() >= 3
                else None
            )
            if stacked is not None and not any(
                _taken(parts_of.get(key, []), key_rows) for key, _, key_rows in stacked[1]
            ):
                order, slabs = stacked
                for key, held_rows, key_rows in slabs:
                    record(names, key, FUSED_PART, held_rows, permute=order, key_rows=key_rows)
                    parts_of.setdefault(key, []).append((key_rows, label))
                cov.conversions.append(
                    f"{label}: a stack of parts, one per slab ({slabs[0][0]}, ... {len(slabs)} tensors), "
                    f"as permute{order} then reshape"
                )
                continue
            if parts is None and p.dim() == 1:
                parts = _permuted_vector(p.data, free)  # a per-head norm's weight permuted with its q/k rows
            if parts is None and p.dim() == 1:
                # a bias cut as its module's weight was: the same output rows of the fused bias (NeoX's
                # per-head interleaved query_key_value split into to_q, to_k, to_v); a bias outside a module
                # (``q_b`` beside ``q``) is matched against every weight cut so far
                weights = (
                    cov.sources.get(names[0][: -len("bias")] + "weight", [])
                    if names[0].endswith(".bias")
                    else [s for held in cov.sources.values() for s in held]
                )
                companion = _companion_bias(p.data, weights, state_dict)
                if companion is not None:
                    record(names, companion[0], PART, companion[1])
                    parts_of.setdefault(companion[0], []).append((companion[1], label))
                    continue
            if parts is None:
                # rows of a checkpoint tensor: as ours holds them, or (a 2-D weight kept input-major, ``x @ W``)
                # its columns, or (3-D and more) with another axis last (DeepSeek's q_b_proj kept per head
                # input-major, ``(q_lora_rank, heads, head_dim)``: the rows of each head's part); a tensor ours
                # also holds whole (a fused copy beside its parts) counts too
                moved = [tuple(i for i in range(p.dim()) if i != a) + (a,) for a in range(p.dim() - 1)]
                as_held: list[tuple[torch.Tensor, bool, tuple[int, ...] | None]] = (
                    [(p.data, False, None)]
                    + ([(p.data.T, True, None)] if p.dim() == 2 else [])
                    + ([(p.data.permute(perm), False, perm) for perm in moved] if p.dim() >= 3 else [])
                )
                flat = p.data.flatten()
                constant = p.numel() > 0 and bool((flat == flat[0]).all())  # zeros match any tensor's zero rows

                def fresh(k: str, rows: tuple[int, ...], constant: bool = constant) -> bool:
                    """A key nothing consumed, or rows of one ours also holds whole (a fused copy beside
                    the parts cut from it): several rows, of values that are no constant."""
                    return k not in cov.consumed or k in parts_of or (len(rows) > 1 and not constant)

                part = next(
                    (
                        (k, rows, flipped, perm)
                        for rows_of, flipped, perm in as_held
                        for k, t in state_dict.items()
                        if (rows := _part_rows(rows_of, t, row_cache)) is not None
                        and fresh(k, rows)
                        # with an axis moved, not every other row throughout (a fused gate/up read as
                        # interleaved pairs: refused, its reason told below)
                        and (perm is None or not all(b - a == 2 for a, b in itertools.pairwise(rows)))
                        and not _taken(parts_of.get(k, []), rows)
                    ),
                    None,
                )
                if part is not None:
                    key, rows, flipped, perm = part
                    record(names, key, PART, rows, transposed=flipped, permute=perm)
                    parts_of.setdefault(key, []).append((rows, label))
                    continue
                split = next(
                    (
                        (k, cutting)
                        for k, t in state_dict.items()
                        if (k not in cov.consumed or k in splits_of) and t.is_floating_point()
                        if (cutting := _split_part(p.data, t)) is not None
                        and all(cutting[0] != cut for cut, _ in splits_of.get(k, []))
                    ),
                    None,
                )
                if split is not None:
                    key, (cut, perm, transposed) = split
                    region = _region_of(cut, state_dict[key].dim())
                    record(names, key, SPLIT, region=region, permute=perm, transposed=transposed, part=cut)
                    splits_of.setdefault(key, []).append((cut, label))
                    continue
                strided = _strided_part(p.data, free) if interleaved else None
                if strided is not None:
                    key, cut = strided
                    record(names, key, STRIDED, part=cut)
                    strided_of.setdefault(key, []).append((cut, label))
                    continue
                value = p.data
                if (
                    value.is_floating_point()
                    and value.numel()
                    and bool((value == value.flatten()[0]).all())
                    and float(value.flatten()[0]) in (0.0, 1.0)
                ):
                    what = "zeros (a bias of zero)" if float(value.flatten()[0]) == 0 else "ones (a scale of one)"
                    cov.constants.append(f"{label} holds only {what}, where the reference has no tensor")
                    continue
                zeroed = _rows_zeroed(p.data, free)
                if zeroed is not None:  # a copy with some rows zeroed (a padding row zeroed at load): a gap, named
                    key, zero_rows = zeroed
                    record(names, key, COPY)
                    cov.gaps.append(
                        f"{key}: copied into {label} with row(s) {_summary([str(r) for r in zero_rows])} zeroed where the "
                        "checkpoint's are not (a padding_idx row zeroed at load, while that token id is real text)"
                    )
                    continue
                why = _transposed_in(p.data, free) or _strided_in(p.data, free)
                # a plain tensor adopted as a parameter, or RoPE's inverse frequencies kept as a frozen one
                # (``requires_grad=False``): state, as a buffer is
                state = all(n.rsplit(".", 1)[-1].startswith(PLAIN) for n in names) or (
                    not p.requires_grad and _frequencies(p.data)
                )
                if state and not why:
                    plain.append((label, p.numel()))  # judged below, once every checkpoint tensor is placed
                    continue
                cov.unwritten.append(f"{label} (holds no checkpoint tensor in any layout parity knows{why})")
                continue
            for key, rows in parts:
                record(
                    names,
                    key,
                    ROWS,
                    rows,
                    transposed=fused_input_major,
                    permute=moved_axes,
                    flat=end_to_end,
                    offset=stacked_offset,
                )
                span = (
                    f"{rows[0]}..{rows[-1]}"
                    if list(rows) == list(range(rows[0], rows[-1] + 1))
                    else f"{len(rows)} rows"
                )
                cov.conversions.append(
                    f"{key}: rows {span} of {label}" if len(parts) > 1 else f"{key}: its rows reordered in {label}"
                )
                free.pop(key, None)

    for storage_keys in sources.values():
        used = [k for k in storage_keys if k in cov.consumed or k in set_aside]
        if not used:
            for k in storage_keys:
                if by_design and k in by_design:
                    cov.skipped[k] = by_design[k]
                elif not (tied_keys and k in tied_keys):
                    cov.unused.append(k)
    # views of a key by the rows they hold (a block of whole rows kept as ``w[a:b]``: Mamba-2's in_proj), and the keys
    # viewed otherwise (any other slice): row blocks beside copied parts are judged with them, row by row
    row_views: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    other_views: set[str] = set()
    for label, held_by in cov.sources.items():
        for src in held_by:
            if src.how == SLICE and (rows := src.slice_rows):
                row_views.setdefault(src.key, []).append((rows, label))
            elif src.how == SLICE:
                other_views.add(src.key)
    # a vector cut both ways (Mamba-2's in_proj bias: some parts kept per head, one copied as rows): its cuts along
    # its one axis are rows too, judged together
    for key in [k for k in splits_of if k in parts_of and state_dict[k].dim() == 1]:
        parts_of[key] += [(tuple(range(start, stop)), label) for (_, start, stop), label in splits_of.pop(key)]
    for key, copied in parts_of.items():
        labels = [label for _, label in copied]
        fused = state_dict[key]
        rows_total = fused.numel() if fused.dim() == 1 else fused.numel() // fused.shape[-1]  # a bias: its elements
        copied = copied + row_views.get(key, [])
        held = sum(len(rows) for rows, _ in copied)
        missing = set(range(rows_total)).difference(*(rows for rows, _ in copied))
        if missing and unread and missing <= set(unread.get(key, ())):
            cov.conversions.append(
                f"{key}: rows {min(missing)}..{max(missing)} left out, which the reference itself never reads "
                "(experts with no down projection: zero-compute experts)"
            )
        elif held != rows_total:
            cov.gaps.append(f"{key}: {rows_total - held} of {rows_total} {_ROWS_UNHELD}")
            if missing:
                cov.rows_unheld[key] = tuple(sorted(missing))
        cov.conversions.append(f"{key}: copied in {len(labels)} parts ({labels[0]} .. {labels[-1]})")
    # a user's model keeping a tie of the reference as copies (plain or transposed: the embedding and the
    # head) consumes its tensor once per member of the tie: judged below as a tie, a note (our families'
    # loaders must tie: there it stays a gap)
    tie_members: dict[str, int] = {}
    for source in (tied_keys or {}).values() if not copies_break_ties else ():
        for key in sources.get(storage_key(state_dict[source]), [source]) if source in state_dict else [source]:
            tie_members[key] = tie_members.get(key, 1) + 1
    for key, cuts in splits_of.items():
        cov.gaps += _split_gaps(key, state_dict[key], cuts)
        labels = [label for _, label in cuts]
        cov.conversions.append(f"{key}: cut in {len(labels)} parts ({', '.join(labels[:4])})")
    for key, cuts in strided_of.items():
        starts = sorted(start for (_, start, _), _ in cuts)
        step = cuts[0][0][2]
        if len({axis for (axis, _, _), _ in cuts}) > 1 or starts != list(range(step)):
            cov.gaps.append(
                f"{key}: its interleaved slices land in {', '.join(label for _, label in cuts)}, not once each"
            )
        cov.conversions.append(f"{key}: de-interleaved into {', '.join(label for _, label in cuts)}")
    for key, targets in cov.consumed.items():
        if key in parts_of or key in splits_of or key in strided_of:
            continue
        whole = len(targets) - len(sliced.get(key, []))
        if key in sliced and whole:
            cov.gaps.append(f"{key} consumed whole and in {len(sliced[key])} parts: {', '.join(targets[:4])}")
        elif whole > tie_members.get(key, 1):
            cov.gaps.append(f"{key} consumed {len(targets)} times: {', '.join(targets)}")
    for key, views in sliced.items():
        if key in set_aside or (key in parts_of and key in row_views and key not in other_views):
            continue  # blocks of rows viewed beside copied rows: judged with them, row by row (above)
        cov.gaps += _slice_gaps(key, state_dict[key], views)
        labels = [label for _, label in views]
        shown = labels[0] if len(labels) == 1 else f"{labels[0]} .. {labels[-1]}"
        cov.conversions.append(f"{key}: split into {len(labels)} view{'s' if len(labels) != 1 else ''} ({shown})")

    def consumers(key: str) -> list[str]:
        aliases = sources.get(storage_key(state_dict[key]), [key]) if key in state_dict else []
        return [label for k in aliases for label in cov.consumed.get(k, [])]

    for target, source in (tied_keys or {}).items():
        if {target, source} & set_aside:
            cov.tied.append(f"{target} -> {source}: not judged (a parameter of the tie was replaced after loading)")
            continue
        labels = consumers(source)
        if len(labels) == 1:  # one Parameter: reachable under several names, or used as the head functionally
            cov.tied.append(f"{target} -> {source}: one Parameter ({labels[0]})")
        elif labels:
            # copies of the one reference tensor: the forward is the same, training is not (each copy
            # gets its own gradient); a note, and what a backward check judges
            found = ", ".join(labels)
            cov.tied.append(f"{target} -> {source}: not tied in ours ({found}: {len(labels)} copies)")
            cov.untied.append(
                f"{target} and {source} are one tensor in the reference, {len(labels)} copies in ours ({found}): "
                "the forward agrees, but a training step would update each copy apart"
            )
            if copies_break_ties:
                cov.gaps.append(f"tied weights {target} and {source} are not the same Parameter in ours: {found}")
        else:
            cov.tied.append(f"{target} -> {source}: no parameter of ours holds it")
    # a plain (or frozen) tensor of ours holding nothing is state computed at build (RoPE frequencies kept in a
    # dict), as a buffer would be, unless it is as large as a checkpoint tensor nothing holds: then it may be that weight
    # loaded in a layout parity does not know, and stays a gap
    sizes = {state_dict[k].numel() for k in cov.unused}
    for label, numel in plain:
        if numel in sizes:
            cov.unwritten.append(f"{label} (holds no checkpoint tensor in any layout parity knows)")
        else:
            cov.computed.append(label)
    if cov.unused:
        cov.gaps.append(f"{_NEVER_USED} {_summary(cov.unused)}")
    if cov.unwritten:
        cov.gaps.append(f"{_HOLDING_NONE} {_summary(cov.unwritten)}")
    return cov


def _taken(parts: list[tuple[tuple[int, ...], str]], rows: tuple[int, ...]) -> bool:
    """Whether any of ``rows`` is already held by one of ``parts``."""
    held = {r for rows_, _ in parts for r in rows_}
    return bool(held.intersection(rows))


def _slice_gaps(key: str, whole: torch.Tensor, parts: list[tuple[list[tuple[int, int]], str]]) -> list[str]:
    """Every element of a fused checkpoint tensor in exactly one parameter: overlaps and holes, one line each."""
    runs = sorted((a, b, label) for intervals, label in parts for a, b in intervals)
    lo, hi = storage_span(whole)
    gaps, reach, last = [], lo, None
    holes = overlaps = 0
    for a, b, label in runs:
        if a < reach:
            overlaps += 1
            if overlaps == 1:
                gaps.append(
                    f"{key}: elements {a - lo}..{min(b, reach) - lo - 1} land in two parameters ({last}, {label})"
                )
        elif a > reach:
            holes += a - reach
        if b > reach:
            reach, last = b, label
    holes += max(0, hi - reach)
    if holes:
        gaps.append(f"{key}: {holes} of {whole.numel()} elements land in no parameter of ours")
    return gaps


def _summary(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _blocks(p: torch.Tensor, shape: tuple[int, ...]):
    """Each block of ``p`` (slices along its leading axes, then runs of rows, in ``p``'s layout or transposed)
    of ``shape``: where a loader may put one checkpoint tensor in a parameter holding several (a fused q/k/v
    ``(3 * out, in)`` or ``(in, 3 * out)``, stacked over layers ``(layers, ...)``)."""
    if p.dim() > len(shape):
        for i in range(p.shape[0]):
            yield from _blocks(p[i], shape)
        return
    if p.dim() != len(shape) or not shape:
        return
    for view in (p, p.T) if p.dim() == 2 else (p,):
        n = shape[0]
        if tuple(view.shape[1:]) == shape[1:] and view.shape[0] % n == 0:
            for start in range(0, view.shape[0], n):
                yield view[start : start + n]


def scale_held(params: dict[str, torch.Tensor], key: torch.Tensor, into: list[str]) -> tuple[str, float] | None:
    """``(parameter, c)`` when a block of one of ``into``'s parameters (:func:`_blocks`) is the checkpoint tensor
    ``key`` times one number ``c`` (a scale folded in at load: the softmax's ``1 / sqrt(head_dim)`` moved into
    the query's weights), to float32's rounding; None when no block is (another function of it)."""
    t = key.detach().double()
    norm = float(t.norm())
    if not t.numel() or norm == 0:
        return None
    for name in into:
        p = params.get(name)
        if p is None or not p.is_floating_point() or p.numel() < t.numel():
            continue
        for block in _blocks(p.detach(), tuple(t.shape)):
            b = block.double()
            c = float((b * t).sum()) / norm**2
            if c != 0 and float((b - c * t).norm()) <= 1e-5 * abs(c) * norm:
                return name, c
    return None
