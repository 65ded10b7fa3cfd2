"""A user's own model: aligning its modules to the reference's nodes by the weights both hold.

No names are guessed. Loader coverage (:mod:`parity.build.coverage`) has already traced each of our
parameters to the checkpoint tensor it came from (same storage, equal values, transposed, or rows
of a fused tensor); from that:

* a reference module with weights (a projection, a norm, the embedding, the head) is aligned to the
  module of ours holding the same tensor; when a tie kept as copies puts one tensor in several
  modules, the op reading each decides (an embedding is read by a lookup, a projection by a
  product), never its class or name; a fused projection (``qkv``, ``gate_up``) is compared through
  the rows it holds (:class:`Rows`); a reference projection whose weight ours holds cut into parts
  (TransformerLens' ``W_Q``/``W_K``/``W_V`` out of GPT-2's ``c_attn``) becomes one node per part,
  ``<node>[start:stop]``: the reference's output features of that part (:class:`OutputPart`)
  against the op of ours reading it (and adding its bias part, when ours adds it after);
* a mixture of experts: the reference's per-expert node against the op of ours reading the
  parameter that holds that expert's output projection (a module per expert, copied out of the
  fused experts tensor), on the tokens ours' block gathered for it; the router's choices and
  weights from torch.topk under ours' MoE block (:mod:`parity.record.routing`); the experts'
  weighted sum where ours computes it, its MoE block, when its experts have no forward of their own;
* a container (a layer, an attention block, an MLP) is aligned to the lowest common ancestor of its
  aligned children in ours, provided that ancestor holds nothing of another container;
* ``<path>@input`` follows its module; the model's own output is ours' output;
* functional nodes (after RoPE, scores, probabilities, context) come from ``parity.tap`` calls in
  the user's forward, under the module aligned to the reference's attention block, in whatever
  layout the user keeps them (:class:`Layout`); a node nobody tapped is ``untapped``.

Every reference node gets one row of :class:`Aligned`: what it was aligned to and how, or why not.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from torch import nn

from parity.build.coverage import (
    CONVENTIONS,
    COPY,
    FLIPPED,
    FUSED_PART,
    LAYOUT,
    PART,
    ROWS,
    SCALED,
    SHARED,
    SLICE,
    SPLIT,
    TRANSPOSED,
    Coverage,
    Source,
)
from parity.model.facts import ArchFacts
from parity.model.facts_rules import MLA_INTERLEAVED_ROPE, Q_PRESCALED
from parity.model.pair import NodeSpec
from parity.record.functional import Block, FeaturesMismatch, probe_reads
from parity.record.hf_capture import FUSED_QKV, POSITION_TABLES, SUFFIXES
from parity.record.hooks import FUNCTIONS, LAYOUTS
from parity.record.ops import LOOKUP, PRODUCT
from parity.record.routing import CHOICES, WEIGHTS, ExpertRows, TopK, is_router
from parity.user.reference_nodes import calls_child
from parity.util.errors import ParityError

UNALIGNED, TAP, PARAM = "unaligned:", "tap:", "param:"


@dataclass(frozen=True)
class Aligned:
    """One reference node and where it is in ours: ``ours`` is a module path (with ``@input``), ``""``
    for the model output, ``tap:<path>`` for a functional node, or None when it could not be aligned
    (``detail`` says why). ``how``: weights | fused rows | part | container | input | output | tap |
    functional | routing | expert | override | unaligned."""

    node: str
    ours: str | None
    how: str
    detail: str = ""

    def to_dict(self) -> dict:
        return {"node": self.node, "ours": self.ours, "how": self.how, "detail": self.detail}


@dataclass(frozen=True)
class Rows:
    """Compare a fused projection of ours through the output features that belong to one reference
    projection (the rows of the fused weight that hold its rows)."""

    rows: tuple[int, ...]
    #: the storage elements of ours' parameter holding these rows, when a product can read them alone (``W[1]``
    #: of a stacked gate/up, ``W[:I]``, ``wkv[:, 0]``): such a product computes this projection alone, its output
    #: features the rows in ours' order (:meth:`alone`)
    block: Block | None = None
    #: the output features of the product these rows are picked from (0: unknown), to read a product that
    #: keeps its heads apart (``bsh,nhd->bnsd``) as ``(batch, seq, heads * head_dim)``
    width: int = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        features = _features_last(t, self.width)
        if self.rows and max(self.rows) >= features.shape[-1]:
            raise FeaturesMismatch(f"{features.shape[-1]} output features, rows up to {max(self.rows)}")
        return features[..., list(self.rows)]

    def alone(self) -> Rows | AsHeld:
        """The rows as the output of a product over this projection's block alone: ranks among themselves,
        or (in order) the product as it is, whatever its layout (``bsh,nhd->bnsd`` keeps the heads apart)."""
        order = sorted(self.rows)
        if list(self.rows) == order:
            return AsHeld()
        return Rows(tuple(order.index(r) for r in self.rows), width=len(self.rows))

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        out = _features_last(current, self.width).clone()
        out[..., list(self.rows)] = ref.to(device=current.device, dtype=current.dtype)
        if out.shape == current.shape:
            return out
        apart = _heads_apart(current, self.width)
        if apart == "heads last":
            return out.unflatten(-1, current.shape[-2:])
        if apart == "parts first":  # (batch, seq, parts * heads * head_dim) to (parts, batch, heads, seq, head_dim)
            held = (current.shape[0], *current.shape[2:-2], current.shape[-1])
            return out.unflatten(-1, held).movedim(1, -2).movedim(0, 1)
        return out.unflatten(-1, (*current.shape[1:-2], current.shape[-1])).movedim(1, -2)


def _heads_apart(t: torch.Tensor, width: int) -> str:
    """How a product's output of ``width`` features keeps its heads apart: ``"seq before last"`` (``(batch, heads,
    seq, head_dim)``, or more head axes before the sequence), ``"heads last"`` (``(batch, seq, heads, head_dim)``:
    a JAX port's ``btc,chd->bthd``), ``"parts first"`` (``(parts, batch, heads, seq, head_dim)``), or ``""`` (its
    last axis holds the features)."""
    if not width or t.shape[-1] == width or t.dim() < 4:
        return ""
    if math.prod(t.shape[1:-2]) * t.shape[-1] == width:
        return "seq before last"
    if t.shape[-2] * t.shape[-1] == width:
        return "heads last"
    # (parts, batch, heads, seq, head_dim): q, k and v in one product first (GPT-1's port's ``btc,shdc->sbhtd``)
    return "parts first" if t.dim() >= 5 and t.shape[0] * math.prod(t.shape[2:-2]) * t.shape[-1] == width else ""


def _features_last(t: torch.Tensor, width: int) -> torch.Tensor:
    """A product's output that keeps its heads apart, ``(batch, heads, seq, head_dim)`` or with more head axes
    (``(batch, kv_heads, group, seq, head_dim)``: HunYuan's q/k/v grouped per KV head), or ``(batch, seq, heads,
    head_dim)``, as ``(batch, seq, features)`` when that is ``width`` features and its last axis is not; else as it
    is (:func:`_heads_apart`)."""
    apart = _heads_apart(t, width)
    if apart == "parts first":
        return t.movedim(1, 0).movedim(-2, 1).flatten(2)
    if apart == "seq before last":
        return t.movedim(-2, 1).flatten(2)
    return t.flatten(-2) if apart == "heads last" else t


@dataclass(frozen=True)
class AsHeld:
    """A product over the block of a fused weight that holds one projection's rows in order: that
    projection's output as it is (its heads read by shape when compared); isolated mode writes the
    reference's back only where the shapes agree."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        return ref


@dataclass(frozen=True)
class Layout:
    """Bring a tapped tensor of ours into the reference's layout, by shape.

    Reference layouts: ``q_rot``/``k_rot`` ``(batch, heads, seq, head_dim)`` (k with the KV heads),
    ``scores``/``probs`` ``(batch, heads, q, k)``, ``context`` ``(batch, seq, heads * head_dim)``.
    Accepted from ours: ``(batch, seq, heads, head_dim)``, ``(batch, seq, heads * head_dim)``,
    complex ``(..., head_dim / 2)`` (Meta's RoPE: real and imaginary parts are the interleaved pairs).
    A 4-D tensor whose sequence length equals the head count cannot be read by shape: ``declared``
    (``parity.tap(t, "q_rot", layout="bshd")``) says which it is; without it, the layout this tap
    showed on an earlier call of another length holds (a decode chunk after the prompt), and with
    neither ``(batch, heads, seq, head_dim)`` is assumed: a wrong guess fails the node, and its
    ``tap_layout`` hint names the fix.

    ``expanded``: the query head count, for keys ours expanded before attention (to each query head
    its KV head, as ``repeat_kv`` does, or tiled): they are compared as the KV heads they expand
    (each group's first). ``dims``: per head, where ours keeps the reference's dims (``ref[..., i] =
    ours[..., dims[i]]``): q/k rows permuted per head for interleaved RoPE keep the rotated dims in
    that order too.
    """

    kind: str
    heads: int
    head_dim: int
    #: the layout read from an unambiguous shape, kept for the tap's later ambiguous calls
    seen: dict = field(default_factory=dict, compare=False, repr=False)
    #: the layout the tap declared: "bhsd" (batch, heads, seq, head_dim), "bshd" or "bsf" (heads flattened)
    declared: str = ""
    #: query heads, for keys ours expanded to one per query head before attention (0: never expanded)
    expanded: int = 0
    #: ours' order of each head's dims (None: the reference's)
    dims: tuple[int, ...] | None = None
    #: the constant ours' q (k) holds the reference's times: a scale folded into its projection at load
    #: (the attention scale in q_proj's weight and bias), compared divided by it
    scale: float = 1.0
    #: ``dims`` is a guess the weights cannot settle (a latent attention's rope tail: in pair order when ours
    #: rotates the pairs where the checkpoint lays them, in the reference's halves when ours rotates as Transformers
    #: does; a context whose values are the keys, K = V, in the keys' order unless ours puts it back): the
    #: reference's order is the :meth:`alternative`, taken for good once it agrees
    guessed: bool = False

    def _dims(self) -> tuple[int, ...] | None:
        return None if self.seen.get("dims") == "reference" else self.dims

    def alternative(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` (this layout's output) with the guessed dims put back in ours' order, or None when the dims are
        no guess or already settled. Either order holds the same q . k when q and k share it: the scores judge."""
        if not self.guessed or self.dims is None or "dims" in self.seen:
            return None
        return self._per_head(t, torch.tensor(self.dims).argsort().tolist())

    def _per_head(self, t: torch.Tensor, order: list[int]) -> torch.Tensor:
        """``t`` in the reference's layout with each head's dims taken in ``order`` (the context's heads are
        flattened: unflattened for it)."""
        if self.kind == "context":
            return t.unflatten(-1, (-1, len(order)))[..., order].flatten(-2)
        return t[..., order]

    def take_alternative(self) -> str:
        """Settle the guess for the reference's order (this node's later calls and the inverse follow); the words
        for the node's detail."""
        self.seen["dims"] = "reference"
        return "its rope dims in the reference's order (ours rotates them as the reference does, not pair by pair)"

    def with_layout(self, layout: str) -> Layout:
        """This layout with the tap's declared ``layout``; raises ParityError for an unknown one."""
        if layout not in LAYOUTS:
            raise ParityError(
                f"parity.tap(..., {self.kind!r}, layout={layout!r}): layout must be one of {', '.join(LAYOUTS)}"
            )
        return replace(self, declared=layout)

    def _steps(self, t: torch.Tensor) -> tuple[bool, str]:
        complex_ = t.is_complex()
        shape = t.shape[:-1] + (t.shape[-1] * 2,) if complex_ else t.shape
        if self.declared:
            return complex_, self._declared(tuple(shape))
        if len(shape) == 4 and self.kind in ("q_rot", "k_rot", "context") and shape[1] == shape[2] == self.heads > 1:
            # the shape cannot tell: the layout this tap showed before, else (batch, heads, seq, head_dim);
            # a wrong guess fails the node with a tap_layout hint naming layout=
            return complex_, self.seen.get("layout", "bhsd" if self.kind == "context" else "")
        step = ""
        if self.kind in ("q_rot", "k_rot"):
            # the KV heads first; the query heads only when neither axis holds the KV heads (keys ours expanded)
            wide = self.expanded if self.expanded and self.heads not in shape[1:3] else self.heads
            if len(shape) == 4 and shape[1] != wide and shape[2] == wide:
                step = "bshd"
            elif len(shape) == 3 and shape[-1] == self.heads * self.head_dim:
                step = "bsf"
        elif self.kind == "context" and len(shape) == 4:
            step = "bhsd" if shape[1] == self.heads and shape[2] != self.heads else "bshd"
        if len(shape) == 4 and shape[1] != shape[2]:
            self.seen.setdefault("layout", step)
        return complex_, step

    def _declared(self, shape: tuple) -> str:
        """The conversion step for a declared layout ("" = already the reference's), checked against ``shape``."""
        reference = "bhsd" if self.kind in ("q_rot", "k_rot") else "bsf"
        fits = {
            "bhsd": len(shape) == 4 and shape[1] == self.heads,
            "bshd": len(shape) == 4 and shape[2] == self.heads,
            "bsf": len(shape) == 3 and shape[-1] == self.heads * self.head_dim,
        }[self.declared]
        if not fits:
            raise ParityError(
                f"parity.tap(..., {self.kind!r}, layout={self.declared!r}): shape {tuple(shape)} does not fit "
                f"{self.declared} with {self.heads} heads of {self.head_dim}"
            )
        return "" if self.declared == reference else self.declared

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 5:  # heads kept as (KV heads, group), as grouped attention computes them
            t = t.flatten(1, 2)
        complex_, layout = self._steps(t)
        if complex_:
            t = torch.view_as_real(t).flatten(-2)
        if self.kind in ("q_rot", "k_rot"):
            if layout == "bshd":
                t = t.transpose(1, 2)
            elif layout == "bsf":
                t = t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
            if self.expanded and t.dim() == 4 and t.shape[1] == self.expanded != self.heads:
                t = _kv_heads(t, self.heads)
            t = t if self.scale == 1.0 else t / self.scale
            dims = self._dims()
            return t if dims is None else t[..., list(dims)]
        if self.kind == "context":
            if layout == "bhsd":
                t = t.transpose(1, 2).flatten(-2)
            elif layout == "bshd":
                t = t.flatten(-2)
            dims = self._dims()
            return t if dims is None or t.shape[-1] % len(dims) else self._per_head(t, list(dims))
        return t

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        if current.dim() == 5:
            flat = self.inverse(ref, current.flatten(1, 2))
            return (
                flat.unflatten(1, current.shape[1:3]) if flat.shape[1] == current.shape[1] * current.shape[2] else flat
            )
        complex_, layout = self._steps(current)
        dims = self._dims()
        if self.kind == "context" and dims is not None and ref.shape[-1] % len(dims) == 0:
            ref = self._per_head(ref, torch.tensor(dims).argsort().tolist())
        if self.kind in ("q_rot", "k_rot") and dims is not None:
            ref = ref[..., torch.tensor(dims).argsort().tolist()]
        if self.kind in ("q_rot", "k_rot") and self.scale != 1.0:
            ref = ref * self.scale
        if self.kind in ("q_rot", "k_rot") and self.expanded:
            wide = current.shape[2] if layout == "bshd" else current.shape[1] if layout != "bsf" else 0
            if wide == self.expanded != self.heads:
                groups = self.expanded // self.heads
                tiled = _is_tiled(current, layout, self.heads)
                ref = ref.repeat(1, groups, 1, 1) if tiled else ref.repeat_interleave(groups, dim=1)
        if self.kind in ("q_rot", "k_rot") and layout == "bshd":
            ref = ref.transpose(1, 2)
        elif self.kind in ("q_rot", "k_rot") and layout == "bsf":
            ref = ref.transpose(1, 2).flatten(-2)
        elif self.kind == "context" and layout == "bhsd":
            ref = ref.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        elif self.kind == "context" and layout == "bshd":
            ref = ref.unflatten(-1, (current.shape[-2], -1))
        if complex_:
            ref = torch.view_as_complex(ref.float().unflatten(-1, (-1, 2)).contiguous())
        return ref.contiguous()


@dataclass(frozen=True)
class PlusBias:
    """A projection of ours whose module has no bias while ours holds the reference's bias in a
    parameter of its own, added after the module (per head, after the heads split: Qwen2 ports): the
    module's output (through ``rows``, for a fused one) is compared with that bias added. Where ours
    adds it (before RoPE, after the GQA expansion) is judged at the nodes after."""

    bias: torch.Tensor = field(compare=False, repr=False)
    rows: Rows | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = self.rows(t) if self.rows is not None else t
        return t + self.bias.detach().reshape(-1).to(device=t.device, dtype=t.dtype)

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        unbiased = ref - self.bias.detach().reshape(-1).to(device=ref.device, dtype=ref.dtype)
        return self.rows.inverse(unbiased, current) if self.rows is not None else unbiased.to(current.dtype)


#: the leaf names of an experts module's stacked output projection: a constant folded into it scales the block's output
OUTPUT_PROJECTION_LEAVES = ("down_proj", "w2", "output_linear", "c_proj")


@dataclass(frozen=True)
class Unscaled:
    """A projection of ours whose weight (and bias) hold the reference's times a named constant (OPT's
    ``head_dim ** -0.5`` folded into ``q_proj`` at load, where the reference scales q after it): its
    output is compared divided by that constant; where ours applies it instead is judged at the nodes
    after."""

    factor: float

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t / self.factor

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        return (ref * self.factor).to(current.dtype)


@dataclass(frozen=True)
class OutputPart:
    """The reference module's output features ``start:stop`` (the part of a fused projection ours
    computes apart), a view taken on the reference's side."""

    start: int
    stop: int

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[..., self.start : self.stop]


@dataclass(frozen=True)
class OutputRows:
    """The reference module's output features ``rows`` (a fused projection ours holds as separate
    modules, each some of its rows), a view taken on the reference's side."""

    rows: tuple[int, ...]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[..., list(self.rows)]


def _output_axis(module: nn.Module | None, weight: torch.Tensor) -> int | None:
    """The axis of a projection's weight that makes its output features: the one its bias matches, else
    ``nn.Linear``'s ``(out, in)`` first; None when neither tells (a Conv1D without a bias)."""
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.dim() == 1:
        axes = [a for a, n in enumerate(weight.shape) if n == bias.numel()]
        if len(axes) == 1:
            return axes[0]
    return 0 if isinstance(module, nn.Linear) else None


def expert_of(source: Source, whole: torch.Tensor, experts: int) -> int | None:
    """The one expert of a fused experts tensor ``whole`` (``(experts, ...)``) whose part ``source`` holds:
    rows copied out of it, a view of it, or a part cut along its first axis; None for any other part."""
    if whole.dim() < 2 or whole.shape[0] != experts:
        return None
    found: set[int] = set()
    if source.how == PART and source.rows:
        per = whole.numel() // whole.shape[-1] // experts
        found = {r // per for r in source.rows}
    elif source.how == SLICE and source.region:
        first = source.region.strip("[]").split(",")[0].strip()
        found = {int(first)} if first.isdigit() else set()
    elif source.how == SPLIT and source.part and source.part[0] == 0 and source.part[2] - source.part[1] == 1:
        found = {source.part[1]}
    return found.pop() if len(found) == 1 else None


def _rows_of(fused: torch.Tensor, source: Source) -> Rows:
    """The output features of ours' product with the fused parameter ``fused`` that hold ``source``'s rows."""
    width = math.prod(fused.shape[a] for a in source.row_axes(fused.dim())[0])
    return Rows(cast(tuple[int, ...], source.rows), _block_of(fused, source), width)


def _as_rows(source: Source) -> Source:
    """A ``slice`` source that is a block of whole rows (``[128:320, :]``, a bias's ``[128:320]``: Mamba-2's in_proj
    cut into z, xBC and dt at load, each a view) as the ``part`` it is, holding those rows; any other as it is."""
    rows = source.slice_rows
    return source if rows is None else replace(source, how=PART, rows=rows, region=None)


def _key_rows(source: Source) -> tuple[int, ...]:
    """The rows of its checkpoint tensor a ``part`` or ``fused part`` source holds."""
    return cast(tuple[int, ...], source.key_rows if source.how == FUSED_PART else source.rows)


def _block_of(p: torch.Tensor, source: Source) -> Block | None:
    """The storage elements of ``p`` holding ``source``'s rows, when they are not all of ``p`` and a product can
    read them alone: one block (``W[:I]``, ``W[1]``), or a strided view (``wkv[:, 0]`` of a ``(hidden, 2, kv_heads,
    head_dim)`` weight); None otherwise (worked out from the strides: a real model's weight is never indexed)."""
    rows = cast(tuple[int, ...], source.rows)
    row_axes, within = source.row_axes(p.dim())
    shape, stride = [int(n) for n in p.shape], p.stride()
    firsts = []
    for r in rows:
        start = int(p.storage_offset())
        for axis in reversed(row_axes):
            r, i = divmod(r, shape[axis])
            start += i * stride[axis]
        firsts.append(start)
    offsets = torch.zeros((), dtype=torch.long)
    for a in within:  # each row's elements relative to its first
        offsets = (offsets[..., None] + torch.arange(shape[a]) * stride[a]).flatten()
    elements = (torch.tensor(firsts)[:, None] + offsets.reshape(1, -1)).flatten().sort().values
    if elements.numel() >= p.numel() or bool((elements[1:] == elements[:-1]).any()):
        return None
    first, end = int(elements[0]), int(elements[-1]) + 1
    return Block(first, end, None if end - first == elements.numel() else elements)


def _first(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _kv_heads(t: torch.Tensor, kv: int) -> torch.Tensor:
    """Keys expanded to the query heads ``(b, h, s, d)`` -> the ``kv`` heads they expand: each group's
    first when every query head of a group holds its KV head (``repeat_kv``), else the first ``kv``
    (tiled ``[K0, K1, K0, K1]``: the query heads then read other KV heads than the reference's, which
    the nodes after show)."""
    groups = t.shape[1] // kv
    grouped = t.unflatten(1, (kv, groups))
    if _same(grouped, grouped[:, :, :1].expand(-1, -1, groups, -1, -1)):
        return t[:, ::groups]
    return t[:, :kv]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN (keys copied from one head are copies, NaN too:
    a padding row's NaN is the same in every copy)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _is_tiled(t: torch.Tensor, layout: str, kv: int) -> bool:
    """Whether keys ``t`` of ours (in ``layout``) were expanded by tiling, not per group."""
    heads = t.transpose(1, 2) if layout == "bshd" else t
    groups = heads.shape[1] // kv
    grouped = heads.unflatten(1, (kv, groups))
    return not _same(grouped, grouped[:, :, :1].expand(-1, -1, groups, -1, -1))


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _router_softcap(module) -> float:
    """The soft cap a reference router applies to its logits inside its module (Laguna's
    ``router_logit_softcapping``: ``cap * tanh(logits / cap)``), 0.0 for none or for any other module."""
    if module is None or not is_router(module):
        return 0.0
    caps = [v for k, v in vars(module).items() if "softcap" in k and isinstance(v, int | float) and v > 0]
    return float(caps[0]) if caps else 0.0


def _common_ancestor(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _module_of(param_name: str) -> tuple[str, str]:
    module, _, leaf = param_name.rpartition(".")
    return module, leaf


class _Aligner:
    def __init__(self, reference: nn.Module, ours: nn.Module, coverage: Coverage, state_dict: dict, facts: ArchFacts):
        self.ref_modules = dict(reference.named_modules())
        self.ours = ours
        self.our_modules = dict(ours.named_modules())
        # buffers too: a model may hold its weights as buffers (stacked per kind, read in functions)
        self.ours_params = {**dict(ours.named_buffers()), **dict(ours.named_parameters())}
        self._first_reads: dict[str, str] | None = None
        #: each parameter of ours -> the modules running at its first read (filled with ``_first_reads``)
        self._read_within: dict[str, tuple[str, ...]] = {}
        #: each module of ours -> the last axis of what its first call returned (filled with ``_first_reads``)
        self._widths: dict[str, int] = {}
        #: (reference module, output index) -> what it returns on a random input and its plain product (``_returned``)
        self._returns: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
        self.facts = facts
        self.coverage = coverage
        keys_by_storage: dict[tuple, list[str]] = {}
        for key, t in state_dict.items():
            keys_by_storage.setdefault(_storage_key(t), []).append(key)
        self.keys_by_storage = keys_by_storage
        self.state_dict = state_dict
        # checkpoint key -> sources of ours (every name of a tied Parameter)
        #: our parameters computed at load from checkpoint tensors (coverage's ``derived``)
        self.derived_params = {n for names in coverage.derived.values() for n in names}
        self.by_key: dict[str, list[tuple[str, Source]]] = {}
        for name, sources in coverage.sources.items():
            for s in sources:
                self.by_key.setdefault(s.key, []).append((name, s))
        self.leaves: dict[str, tuple[str, Source]] = {}  # reference module path -> (our module path, source)
        #: reference module path -> (our parameter, source) for a weight ours reads in a function
        self.functional: dict[str, tuple[str, Source]] = {}
        self.why: dict[str, str] = {}

    def leaf(self, path: str) -> tuple[str, Source] | None:
        """Our module holding the weight of the reference module ``path`` (memoised)."""
        if path in self.leaves or path in self.why:
            return self.leaves.get(path)
        module = self.ref_modules.get(path)
        weight = getattr(module, "weight", None) if module is not None else None
        if not isinstance(weight, torch.Tensor):
            self.why[path] = "no weight in the reference module"
            return None
        keys = self.keys_by_storage.get(_storage_key(weight), [])
        held = self._held(weight)
        found = held
        # the parameter must be its module's weight: named so, or (a norm's ``scale``, ``gamma``, ``g``,
        # ``w``) the only parameter of its module that holds a reference weight
        found = [(n, s) for n, s in found if self._is_weight_of_module(n, path)]
        ref_is_embedding = isinstance(module, nn.Embedding)
        candidates = {}
        for n, s in found:
            our_path = _module_of(n)[0]
            our_module = self.our_modules.get(our_path)
            if our_module is None:
                continue
            if isinstance(our_module, nn.Embedding) == ref_is_embedding:
                candidates[our_path] = s
        if not candidates and found and ref_is_embedding:  # a user's own embedding class: accept any holder
            candidates = {_module_of(n)[0]: s for n, s in found}
            looked_up = [(n, s) for n, s in held if self._reads().get(n) == LOOKUP]
            if looked_up and not any(n in dict(looked_up) for n, _ in found):
                # the table is looked up as a parameter of a module holding others (a backbone's ``emb``), and the
                # module holding it as its weight is a tied head multiplying by it: the lookup is that op
                candidates, found, held = {}, [], looked_up
        if len(candidates) > 1:
            candidates = self._by_reading_op(candidates, found, ref_is_embedding)
        if not candidates and found and path == self.facts.head_module:
            # the head computed from the embedding's weight (x @ embedding.weight.T): no module of its own;
            # its output is the model's (nothing follows the head), else it cannot be placed
            if self.facts.logit_scale in (None, 1.0) and not self.facts.final_softcap:
                self.leaves[path] = ("", found[0][1])
                return self.leaves[path]
            self.why[path] = (
                f"ours computes it from {found[0][0]} with no module of its own, and something follows the head"
            )
            return None
        if (
            len(candidates) == 1
            and is_router(module)
            and not isinstance(self.our_modules.get(next(iter(candidates))), nn.Linear)
        ):
            # a router module of ours computing more than its logits (Megatron's returns the routing probabilities
            # and map): the reference router's node is its logits, the product of its weight, read as an op
            self.functional[path] = next((n, s) for n, s in found if _module_of(n)[0] in candidates)
            self.why[path] = f"ours' router module {next(iter(candidates))} computes more than its logits"
            return None
        if len(candidates) == 1:
            self.leaves[path] = next(iter(candidates.items()))
            return self.leaves[path]
        if not candidates and held and (not isinstance(module, nn.Embedding) or not found):
            # a parameter of a module that holds several (TransformerLens' W_Q in attn): the op reading it
            # computes this module's output; of copies of one tensor (a tied table copied twice), the one the forward
            # reads, by a lookup for an embedding
            reads = self._reads()
            chosen = next((h for h in held if reads.get(h[0]) == LOOKUP), None) if ref_is_embedding else None
            chosen = chosen or next((h for h in held if reads.get(h[0])), held[0])
            self.functional[path] = chosen
            self.why[path] = f"ours holds its weight as {chosen[0]}, a parameter of a module that holds others too"
            return None
        if not candidates:
            self.why[path] = f"no module of ours holds {', '.join(keys) or 'its weight'}"
        else:
            self.why[path] = f"ambiguous: {', '.join(sorted(candidates))} all hold its weight"
        return None

    def _by_reading_op(self, candidates: dict[str, Source], found: list, embedding: bool) -> dict[str, Source]:
        """Of several modules of ours holding one reference tensor (a tie kept as copies: TransformerLens'
        ``W_E`` and ``W_U``), those whose forward reads it as the reference module does: an embedding by a
        lookup, a projection by a product (the op reading it decides, never the class or the name)."""
        reads = self._reads()
        want = LOOKUP if embedding else PRODUCT
        names = {_module_of(n)[0]: n for n, _ in found}
        chosen = {path: s for path, s in candidates.items() if reads.get(names.get(path, "")) == want}
        return chosen or candidates

    def _reads(self) -> dict[str, str]:
        """How ours' forward first reads each of its parameters (:func:`~parity.record.functional.first_reads`),
        from one short probe forward, run once."""
        if self._first_reads is None:
            self._first_reads = probe_reads(self.ours, self.facts.vocab_size, self._read_within, self._widths)
        return self._first_reads

    def _holders(self, ref_path: str) -> list[str]:
        """Our modules holding (parts of) the reference module's own parameters of three or more axes
        other than ``weight``: fused experts (a bias or a scalar belongs to a module found otherwise)."""
        module = self.ref_modules[ref_path]
        held = []
        for leaf, tensor in module.named_parameters(recurse=False):
            if leaf != "weight" and tensor.dim() >= 3:
                keys = self.keys_by_storage.get(_storage_key(tensor), [])
                held += [_module_of(n)[0] for k in keys for n, _ in self.by_key.get(k, [])]
        return held

    def _derived_holders(self, ref_path: str) -> list[str]:
        """Our modules holding parameters derived at load from the reference module's own tensors
        (:mod:`parity.user.derived`: HunYuan's shared MLP stacked as one more expert beside the experts)."""
        keys = (
            k
            for tensor in self.ref_modules[ref_path].parameters(recurse=False)
            for k in self.keys_by_storage.get(_storage_key(tensor), [])
        )
        return [_module_of(n)[0] for k in keys for n in self.coverage.derived.get(k, [])]

    def _is_weight_of_module(self, param: str, path: str = "") -> bool:
        module, leaf = _module_of(param)
        if module and module in self.our_modules and not self._runs(module):
            return False  # a ParameterDict's entry (``emb["tok"]``): no forward of its own, the op reading it is
        held = self.ours_params.get(param)
        if leaf == "weight":
            # unless its module returns neither of the matrix's widths (a router returning its top-k weights and
            # ids, DeepSeek's Gate): it computes more than the product reading it, which is the node
            return held is None or (
                (held.dim() != 2 or self._returns_width(module, held.shape)) and self._returns_rows(module, param)
            )
        if not module and held is not None and (held.dim() == 1 or path == self.facts.embed_module):
            # a tensor of the whole model (a final norm's vector beside the blocks, the embedding's table): the op
            # reading it; a root table read as the head stays the model's output (place() says which)
            return False
        holders = [n for n in self.coverage.sources if _module_of(n)[0] == module and "." not in n[len(module) + 1 :]]
        weights = [n for n in holders if any(src.key.endswith(".weight") for src in self.coverage.sources[n])]
        if weights != [param]:
            return False
        if any(_module_of(n)[0] == module and n != param for n in self.derived_params):
            return False  # other weights of it derived at load from the reference's (HunYuan's shared MLP stacked
            # with its experts): the module computes more than the op reading this one
        # a module whose submodules hold other reference weights computes more than the op reading this
        # one (an MLP holding w_down itself, w_gate and w_up as submodules; a layer holding its norm's gain
        # beside its mixer): the op is the node, not it
        if held is None:
            return True
        if held.dim() < 2 and all(self.state_dict[src.key].dim() < 2 for src in self.coverage.sources[param]):
            # a norm's one vector (``scale``, ``g``, beside its bias): its module is the norm, unless a submodule
            # holds other reference weights (a layer holding its norm's gain beside its mixer: the op is the node)
            return not any(
                module and n.startswith(module + ".") and "." in n[len(module) + 1 :] for n in self.coverage.sources
            )
        # (a linear's (1, in) weight kept flat, Qwen2-MoE's shared_expert_gate, is no norm: judged as a matrix)
        inner = any(module and n.startswith(module + ".") and n != param for n in self.coverage.sources)
        return not inner and self._returns_rows(module, param)

    def container(self, path: str) -> str | None:
        """Our module that plays the role of the reference container ``path``."""
        if path in self.why:
            return None
        prefix = path + "." if path else ""
        inside: list[str]
        outside: list[str]
        inside, outside, owners, stacked = [], [], set(), set()
        for ref_path, module in self.ref_modules.items():
            # tensors held otherwise than as a module's weight (fused experts): the modules of ours holding them
            holders = self._holders(ref_path)
            within = ref_path == path or ref_path.startswith(prefix)
            (inside if within else outside).extend(holders)
            if within:
                stacked.update(holders)
            else:  # tensors ours derived at load from outside (stacked with others): that module computes more
                outside.extend(self._derived_holders(ref_path))
            if not isinstance(getattr(module, "weight", None), torch.Tensor) or ref_path == path:
                continue
            hit = self.leaf(ref_path)
            if hit is None and ref_path in self.functional:  # read in a function: its parameter's module gathers it
                owner = _module_of(self.functional[ref_path][0])[0]
                owners.add(owner)
                hit = (owner, self.functional[ref_path][1])
            if hit is None:  # its weight cut in parts, each a module of ours (q, k, v nn.Linear out of c_attn)
                weight_keys = self.keys_by_storage.get(_storage_key(module.weight), [])
                (inside if ref_path.startswith(prefix) else outside).extend(
                    _module_of(n)[0] for k in weight_keys for n, s in self.by_key.get(k, []) if s.how == SPLIT
                )
            if hit is None or hit[0] == "":  # the head ours computes from the embedding: no module to gather
                continue
            (inside if ref_path.startswith(prefix) else outside).append(hit[0])
        if len(set(inside)) == 1 and set(inside) <= stacked and self._holds_only(inside[0], prefix):
            return inside[0]  # one module of ours holds every stacked tensor of the experts, and nothing else
        if len(set(inside)) < 2 and not (set(inside) <= owners and inside):
            block = self._experts_block(path, set(inside))
            if block is not None:
                return block
            self.why[path] = "fewer than two of its weighted modules were found in ours"
            return None
        ancestor = _common_ancestor(sorted(set(inside)))
        if ancestor in owners and ancestor in outside:
            self.why[path] = f"{ancestor} also holds the weights of other reference blocks"
            return None
        # a module of ours holding the experts' stacked weights as its own parameters, and the router as a
        # submodule, is the MoE block itself
        if ancestor in set(inside) and ancestor not in owners and ancestor not in stacked:
            self.why[path] = f"its weighted modules in ours meet at {ancestor}, which is one of them"
            return None
        if ancestor == "" and path and any(o not in inside for o in outside):
            # a layer whose modules ours keeps apart (shared blocks, mixers) meets them only at the model's root,
            # whose output is the logits
            self.why[path] = "its weighted modules in ours meet only at the model's root, which holds other blocks too"
            return None
        if any(o == ancestor or o.startswith(ancestor + ".") for o in outside if o not in inside):
            self.why[path] = f"{ancestor or 'the model'} also holds modules of other reference blocks"
            return None
        if ancestor and self.facts.locate(path)[1] == "layer":
            ancestor = self._layer_level(ancestor, set(outside) - set(inside))
            outside_read = self._read_outside(ancestor, prefix)
            if outside_read is not None:  # its caller normalises the stream and adds the residual: a branch
                self.why[path] = (
                    f"ours' {ancestor} computes part of the layer only: {outside_read} is read outside its forward "
                    "(its caller computes the rest: a norm, the residual add)"
                )
                return None
        return ancestor

    def _layer_level(self, ancestor: str, others: set[str]) -> str:
        """The highest module of ours at or above ``ancestor`` that runs and holds none of ``others`` (the modules
        holding other reference blocks' weights): ours' layer, where the modules found under a reference layer meet
        lower (a norm folded into the next projection at load leaves only the mixer's modules found)."""
        up = ancestor
        while "." in up:
            parent = up.rpartition(".")[0]
            if not self._runs(parent) or any(o == parent or o.startswith(parent + ".") for o in others):
                break
            up = parent
        return up

    def _read_outside(self, module: str, prefix: str) -> str | None:
        """A parameter of ``module`` (or its submodules) holding checkpoint tensors under ``prefix`` only that
        ours' forward reads while ``module`` is not running (ours' block returning its branch, the layer's norm
        and residual add done by the caller: Nemotron-H ports), else None."""
        self._reads()
        for name, sources in self.coverage.sources.items():
            owner = _module_of(name)[0]
            if not (owner == module or owner.startswith(module + ".")):
                continue
            if not sources or not all(s.key.startswith(prefix) for s in sources):
                continue
            running = self._read_within.get(name)
            if running is not None and module not in running:
                return name
        return None

    def _holds_only(self, module: str, prefix: str) -> bool:
        """Whether every checkpoint tensor ``module`` of ours (and its submodules) holds has a key under ``prefix``."""
        keys = {
            s.key
            for n, sources in self.coverage.sources.items()
            if _module_of(n)[0] == module or n.startswith(module + ".")
            for s in sources
        }
        return bool(keys) and all(k.startswith(prefix) for k in keys)

    def _experts_block(self, path: str, inside: set[str]) -> str | None:
        """Ours' MoE block, for the reference's fused experts module ``path`` whose every tensor ours holds as
        that block's own parameters (no module of ours is the experts alone): its output is the experts'
        weighted sum when the reference's block holds nothing but its router and these experts (Mixtral,
        Qwen3-MoE; a shared expert would add to it). None otherwise."""
        parent = path.rpartition(".")[0]
        module = self.ref_modules.get(path)
        if len(inside) != 1 or module is None or set(self._holders(path)) != inside or not parent:
            return None
        weighted = {
            p for p, m in self.ref_modules.items()
            if p.startswith(parent + ".") and p != path and not p.startswith(path + ".")
            and any(True for _ in m.parameters(recurse=False))
        }  # fmt: skip
        routers = [p for p, m in self.ref_modules.items() if p.startswith(parent + ".") and is_router(m)]
        if (
            len(routers) != 1
            or not weighted
            or any(p != routers[0] and not p.startswith(routers[0] + ".") for p in weighted)
        ):
            return None  # the block holds more than one router (its own weight, or a child's: LongCat's classifier)
        block = self.container(parent)
        return block if block is not None and block in inside else None

    def _in_functions(self, att: str) -> bool:
        """Whether ours computes the reference's attention block ``att`` with no module of its own, every
        weighted module of the block found in ours (modules of a flat block that also holds the MLP's,
        parameters read in functions, or parameters computed from its weights at load): the block is then what
        ours computes between running or reading the first of them and the last (:data:`FUNCTIONS`)."""
        inside = [
            p for p, m in self.ref_modules.items()
            if p.startswith(att + ".") and isinstance(getattr(m, "weight", None), torch.Tensor)
        ]  # fmt: skip
        # a weight ours computes from at load (Inkling's short-conv kernels, reversed into taps) is found too
        found = [p for p in inside if self.leaf(p) is not None or p in self.functional or self._derived_holders(p)]
        return len(inside) >= 2 and len(found) == len(inside)

    def split(self, spec: NodeSpec) -> list[tuple[NodeSpec, Aligned]] | None:
        """A reference module whose weight ours holds cut into parts along its output axis (TransformerLens'
        ``W_Q``, ``W_K``, ``W_V`` cut out of GPT-2's fused ``c_attn``): one node per part, the reference's
        output features of that part (``<node>[start:stop]``) against what ours computes from it. None
        when the node is not such a module's output."""
        module = self.ref_modules.get(spec.reference_path)
        weight = getattr(module, "weight", None)
        if spec.reference_transform is not None or not isinstance(weight, torch.Tensor):
            return None
        held = [(n, _as_rows(s)) for n, s in self._held(weight)]
        rows = [(n, s) for n, s in held if s.how in (PART, FUSED_PART) and s.rows and weight.dim() == 2]
        whole = [n for n, s in held if s.how in (SHARED, COPY, TRANSPOSED)]  # a fused copy kept beside its parts
        if rows and isinstance(module, nn.Embedding):  # a table's rows are token ids, not output features
            return [
                self._unaligned(
                    spec,
                    f"ours holds its table in parts by token id ({', '.join(n for n, _ in rows[:4])}: a vocabulary-"
                    "parallel embedding): its lookups are compared where the stream reads them",
                )
            ]
        if rows and len(rows) + len(whole) == len({n for n, _ in held}) and len(rows) > 1:
            # separate modules holding rows of one fused weight (Phi-3's qkv_proj as wq, wk, wv), or some of its rows
            # fused with other weights (Qwen3-Next's per-head [query | gate] q_proj: the queries fused with k and v,
            # the gates apart): one node each
            ordered = sorted(rows, key=lambda ns: min(_key_rows(ns[1])))
            paired = self._bias_parts(spec.reference_path, len(ordered))
            return [self._rows_node(spec, n, s, paired[i] if paired else None) for i, (n, s) in enumerate(ordered)]
        parts = sorted({s.part: (n, s) for n, s in held if s.how == SPLIT and s.part}.items())
        if not parts or len(parts) != len({n for n, _ in held}):
            return None
        axis = _output_axis(module, weight)
        if axis is None or any(part[0] != axis for part, _ in parts):
            why = "which axis of its weight makes the output is unknown" if axis is None else "not its output axis"
            return [self._unaligned(spec, f"ours holds its weight cut along an axis that is {why}")]
        return [self._part_node(spec, part, param, source) for part, (param, source) in parts]

    def _bias_parts(self, ref_path: str, parts: int) -> list[str] | None:
        """The parameters of ours holding the reference module's bias in ``parts`` equal parts, in the order
        of the elements they hold (each added after its weight part's product: the i-th weight part's
        bias is the i-th), whatever elements each holds; None when it is not cut so."""
        bias = getattr(self.ref_modules.get(ref_path), "bias", None)
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
            return None

        def first(source: Source) -> int | None:
            if source.how == PART and source.rows:
                return min(source.rows)
            if source.how == SPLIT and source.part:
                return source.part[1]
            return None

        held = [(first(s), n) for n, s in self._held(bias) if first(s) is not None]
        if len(held) != parts or any(self.ours_params[n].numel() * parts != bias.numel() for _, n in held):
            return None
        return [n for _, n in sorted(held, key=lambda fn: cast(int, fn[0]))]

    def _rows_node(
        self, spec: NodeSpec, param: str, source: Source, bias_part: str | None = None
    ) -> tuple[NodeSpec, Aligned]:
        """The reference's output features ``source.rows`` (a module of ours holds those rows of its fused
        weight) against that module's output: ``<node>[a:b]``, ``[a:b:step]`` for evenly spaced rows."""
        rows = _key_rows(source)
        step = rows[1] - rows[0] if len(rows) > 1 else 1
        even = step > 0 and all(b - a == step for a, b in itertools.pairwise(rows))
        where = (
            f"[{rows[0]}:{rows[-1] + 1}]"
            if even and step == 1
            else f"[{rows[0]}:{rows[-1] + 1}:{step}]"
            if even
            else f"[rows {', '.join(map(str, rows[:4]))}, ...]"
        )
        name = f"{spec.name}{where}"
        view = OutputRows(rows)
        bias = getattr(self.ref_modules.get(spec.reference_path), "bias", None)
        held_bias = (
            [n for n, s in self._held(bias) if _as_rows(s).how == PART and _as_rows(s).rows == source.rows]
            if isinstance(bias, torch.Tensor)
            else []
        )  # the same rows of the fused bias, which ours adds after the product (``x @ W + b``)
        if len(held_bias) != 1 and bias_part is not None:
            held_bias = [bias_part]  # the bias part ours adds after this product, whichever elements it holds
        ours = (
            _module_of(param)[0]
            if self._is_weight_of_module(param)
            else PARAM + param + (f"+{held_bias[0]}" if len(held_bias) == 1 else "")
        )
        detail = f"output features {where} of {spec.reference_path}: {source.description} held by {param}"
        new = replace(spec, name=name, ours=ours, reference=spec.reference_path, reference_transform=view)
        if source.how == FUSED_PART:  # ours' product holds other tensors' rows too: this part's picked from it
            pick = _rows_of(self.ours_params[param], source)
            new = replace(new, transform=pick, inverse=pick.inverse)
            detail += ", fused with other rows there"
        return new, Aligned(name, ours, "part" if ours.startswith(PARAM) else "weights", detail)

    def _held(self, tensor: torch.Tensor) -> list[tuple[str, Source]]:
        """The parameters of ours holding (part of) one of the reference's tensors, with how each does."""
        return [(n, s) for k in self.keys_by_storage.get(_storage_key(tensor), []) for n, s in self.by_key.get(k, [])]

    def _bias_of(self, ref_path: str, part: tuple[int, int, int] | None = None) -> str | None:
        """The parameter of ours holding the reference module's bias (its ``part`` of it, for a weight cut
        in parts): ours may add it after the op reading the weight (``x @ W + b``), as the module does."""
        bias = getattr(self.ref_modules.get(ref_path), "bias", None)
        if not isinstance(bias, torch.Tensor):
            return None
        held = self._held(bias)
        if part is not None:
            held = [(n, s) for n, s in held if s.how == SPLIT and s.part is not None and s.part[1:] == part[1:]]
        return held[0][0] if len(held) == 1 else None

    def _returned(self, ref_path: str, spec: NodeSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(what the module returns as the node's output #k, its plain product with its weight)`` on a random
        input ``(3, in)``, both float64, for a reference module (not a plain ``nn.Linear``) holding a 2-D weight;
        None where it cannot run alone on such an input."""
        module = self.ref_modules.get(ref_path)
        weight = getattr(module, "weight", None)
        if module is None or isinstance(module, (nn.Linear, nn.Embedding)) or not isinstance(weight, torch.Tensor):
            return None
        if weight.dim() != 2 or weight.is_meta:
            return None
        k = int(spec.reference_path.rsplit("#", 1)[1]) if "#" in spec.reference_path else 0
        if (ref_path, k) in self._returns:  # (its scale and its columns are both read from one run)
            return self._returns[(ref_path, k)]
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        try:
            with torch.no_grad():
                out = module(x)
        except Exception:  # a module that needs more than its input: nothing read
            out = None
        out = out[k] if isinstance(out, (tuple, list)) and len(out) > k else out if k == 0 else None
        found = None
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.is_floating_point():
            found = out.double(), torch.nn.functional.linear(x.double(), weight.detach().double())
        self._returns[(ref_path, k)] = found
        return found

    def _returned_scale(self, ref_path: str, spec: NodeSpec) -> float | None:
        """The constant a module multiplies its whole product by before returning it (Muse Spark's router:
        its logits times the config's ``output_multiplier``), found by running it on a random input; None where
        it returns the product itself or anything else."""
        found = self._returned(ref_path, spec)
        if found is None or found[0].shape != found[1].shape:
            return None
        got, full = found
        c = float((got * full).sum() / (full * full).sum().clamp_min(1e-300))
        if c == 0 or abs(c - 1) < 1e-6 or float((got - c * full).abs().max()) > 1e-5 * float(got.abs().max()):
            return None
        return c

    def _returned_columns(self, ref_path: str, spec: NodeSpec) -> OutputPart | None:
        """The output features of a module's product with its weight that the module returns (as its output
        ``#k``, the node's), where that is a part of them: Inkling's router weight holds its shared experts'
        rows too and returns the routed experts' logits alone. Found by running the module on a random input;
        None where it returns the whole product, or cannot run alone."""
        found = self._returned(ref_path, spec)
        if found is None or not 0 < found[0].shape[-1] < found[1].shape[-1]:
            return None
        got, full = found
        weight = cast(torch.Tensor, self.ref_modules[ref_path].weight)
        n = got.shape[-1]
        tol = 1e-4 * float(got.abs().max().clamp_min(1e-30))
        start = next(
            (a for a in range(weight.shape[0] - n + 1) if bool(((full[:, a : a + n] - got).abs() <= tol).all())), None
        )
        return OutputPart(start, start + n) if start is not None else None

    def _children_after(self, ref_path: str) -> list[str]:
        """The submodules holding parameters of a reference ``nn.Embedding`` or ``nn.Linear`` subclass, which its
        forward runs on its own op's result (Inkling's embedding normalised by its ``embed_norm``): the module's
        output is theirs. An embedding's submodules without parameters too (Muse Spark's weightless
        ``embed_norm``): a table holds nothing else a lookup could apply."""
        module = self.ref_modules.get(ref_path)
        if not isinstance(module, (nn.Embedding, nn.Linear)):
            return []
        return [
            f"{ref_path}.{name}"
            for name, child in module.named_children()
            if isinstance(module, nn.Embedding) or any(True for _ in child.parameters())
        ]

    def _post_scale_of(self, ref_path: str) -> str | None:
        """The parameter of ours holding (or computed at load from) the reference projection's one parameter
        besides its weight and bias, a vector its forward multiplies the product by (Dory's
        ``lm_head.logit_scale``): ours may multiply the product by it after the op reading the weight, as the
        module does (``(x @ W) * s``)."""
        module = self.ref_modules.get(ref_path)
        if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            return None
        extra = [p for n, p in module.named_parameters(recurse=False) if n not in ("weight", "bias")]
        if len(extra) != 1 or extra[0].dim() != 1 or extra[0].shape[0] != module.weight.shape[0]:
            return None  # one factor per output feature (a router's one global scale weighs its choices instead)
        held = [n for n, _ in self._held(extra[0]) if n in self.ours_params]
        for key in self.keys_by_storage.get(_storage_key(extra[0]), []):  # or computed from it at load
            held += [n for n in self.coverage.derived.get(key, []) if n in self.ours_params and n not in held]
        return held[0] if len(held) == 1 else None

    def _bias_outside(self, ref_path: str, our_path: str) -> str | None:
        """The parameter of ours holding the reference projection's bias (whole, any shape) when the
        module of ours aligned to it has no bias of its own: ours adds it outside the module."""
        module = self.our_modules.get(our_path)
        if module is None or isinstance(getattr(module, "bias", None), torch.Tensor):
            return None
        bias = getattr(self.ref_modules.get(ref_path), "bias", None)
        if not isinstance(bias, torch.Tensor):
            return None
        held = [
            n
            for n, s in self._held(bias)
            if s.how in (SHARED, COPY, LAYOUT, SLICE, FLIPPED)
            and n in self.ours_params
            and self.ours_params[n].numel() == bias.numel()
        ]
        if len(held) != 1 or (our_path and held[0].startswith(our_path + ".")):
            return None  # the module holds it itself (under another name: a LayerNorm's ``b``): it adds it
        return held[0]

    def _part_node(self, spec: NodeSpec, part: tuple[int, int, int], param: str, source: Source):
        _, start, stop = part
        name = f"{spec.name}[{start}:{stop}]"
        view = OutputPart(start, stop)
        bias = self._bias_of(spec.reference_path, part)
        ours = (
            _module_of(param)[0] if self._is_weight_of_module(param) else PARAM + param + (f"+{bias}" if bias else "")
        )
        detail = (
            f"output features {start}:{stop} of {spec.reference_path}; ours computes them from {param} "
            f"({source.description}: {CONVENTIONS[SPLIT].split(' (')[0]})"
        )
        new = replace(spec, name=name, ours=ours, reference=spec.reference_path, reference_transform=view)
        return new, Aligned(name, ours, "part" if ours.startswith(PARAM) else "weights", detail)

    def place(self, spec: NodeSpec) -> tuple[NodeSpec, Aligned]:
        name, ref_path = spec.name, spec.reference_path
        if ref_path == "":
            return replace(spec, ours=""), Aligned(name, "", "output", "the whole model's output")
        moe = self._moe(spec)
        if moe is not None:
            return moe
        gain_in = self.coverage.folded.get(f"{ref_path}.weight")
        if gain_in:  # its gain is in the projections reading it: ours' norm output is not the reference's
            projections = ", ".join(k.removesuffix(".weight") for k in gain_in[:3])
            return self._unaligned(spec, f"its gain folded into {projections} at load (compared there)")
        suffix = name.rsplit(".", 1)[-1]
        if suffix in SUFFIXES and name.endswith("." + suffix) and ref_path == name:
            att = name[: -len(suffix) - 1]
            our_att = self.container(att)
            functions = our_att is None and self._in_functions(att)
            if our_att is None and not functions:
                return self._unaligned(spec, f"attention block {att}: {self.why.get(att, 'not found')}")
            layer = self.facts.layer(spec.layer)
            kv_heads = layer.num_kv_heads if layer is not None and layer.num_kv_heads else self.facts.num_kv_heads
            q_heads = self.facts.heads_at(spec.layer)  # per layer: Laguna's
            heads = kv_heads if suffix == "k_rot" else q_heads  # per layer: MiMo's sliding ones double
            head_dim = layer.head_dim if layer is not None else self.facts.head_dim
            dims = (
                self._head_dims(f"{att}.{'k_proj' if suffix == 'k_rot' else 'q_proj'}", head_dim)
                if suffix in ("q_rot", "k_rot")
                else None
            )
            if dims is None and suffix in ("q_rot", "k_rot"):
                dims = self._fused_head_dims(att, head_dim)
            guessed = dims is None and suffix in ("q_rot", "k_rot") and MLA_INTERLEAVED_ROPE in self.facts.features
            if guessed:
                dims = self._mla_dims(att, suffix, head_dim, layer.rope.rotary_dim if layer and layer.rope else 0)
            if suffix == "context":  # values that are the keys (K = V): in the keys' order, unless ours undoes it
                dims = self._value_dims(att, head_dim)
                guessed = dims is not None
            expanded = q_heads if suffix == "k_rot" and q_heads != heads else 0
            folded = (  # a scale folded into ours' q_proj, which the reference applies in its scores
                self._folded_scale(f"{att}.{'k_proj' if suffix == 'k_rot' else 'q_proj'}")
                if dims is None and Q_PRESCALED not in self.facts.features
                else 1.0
            )
            layout = Layout(
                suffix,
                heads,
                head_dim,
                expanded=expanded,
                dims=dims,
                scale=folded,
                guessed=guessed and dims is not None,
            )
            tap = f"{FUNCTIONS}{att}.{suffix}" if functions else f"{our_att}.{suffix}"
            detail = (
                f"what ours computes between running (or reading the weight of) {att}'s first projection and its last"
                if functions
                else f"parity.tap(tensor, {suffix!r}) inside {our_att}, or what its functions compute"
            )
            if dims is not None:
                detail += (
                    "; each head's dims in ours' order (its q/k rows are permuted per head)"
                    if suffix != "context"
                    else "; each head's dims in the order of ours' keys (its values are the keys), if ours keeps it"
                )
            return (
                replace(spec, ours=TAP + tap, transform=layout, inverse=layout.inverse),
                Aligned(name, TAP + tap, "tap", detail),
            )
        is_input = ref_path.endswith("@input")
        base = ref_path[: -len("@input")] if is_input else ref_path
        module_of, sep, _item = base.partition("#")
        if sep and spec.name == module_of and is_router(self.ref_modules.get(module_of)):
            base = module_of  # a router's logits returned after another output (Llama 4's): its weight's product
        if spec.reference_transform is not None:  # a part of that module's output, not its output
            return self._unaligned(spec, f"a view of {base}'s output (name it with node_map)")
        weight = getattr(self.ref_modules.get(base), "weight", None)
        hit = self.leaf(base) if isinstance(weight, torch.Tensor) else None
        # a weight ours holds at its root, read in forward: the head's (a vocabulary projection) is the model's
        # output; any other (a final norm's vector beside the embedding) is the op reading it, below
        head = (
            isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and weight.shape[0] == self.facts.vocab_size
            and base != self.facts.embed_module  # the table itself, tied: its lookup is the embedding's node
        )
        if hit is not None and not is_input and head and (hit[0] == "" or self._embedding_module(hit[0])):
            after = [
                what
                for what, value in (("soft-caps", self.facts.final_softcap), ("scales", self.facts.logit_scale))
                if value not in (None, 1.0)
            ]
            if after:  # the model's output is the head's product transformed: that product is no module's output
                return self._unaligned(
                    spec,
                    f"ours computes the head's product in forward (with {hit[1].param}) and the reference "
                    f"{' and '.join(after)} the logits after it, so no value of ours is the head's output alone; "
                    "the logits node compares what forward returns",
                )
            return replace(spec, ours=""), Aligned(
                name,
                "",
                "output",
                f"the head is the embedding's weight used in forward ({hit[1].param}): the model's output",
            )
        if (
            hit is not None
            and base == self.facts.embed_module
            and not is_input
            and hit[1].how != SCALED  # a table pre-multiplied by the scale: its lookup is the reference's output
            and self._scaled_outside(hit[0])
        ):
            first = self._first_layer_reads_embedding()
            if first is not None:
                return replace(spec, ours=first + "@input"), Aligned(
                    name,
                    first + "@input",
                    "input",
                    f"the reference's embedding scales by {self.facts.embed_scale:g}; ours ({hit[0]}, a plain "
                    f"nn.Embedding) cannot, so its value appears where the reference's does: the first layer's input",
                )
            return self._scaled_lookup(spec, hit[0], cast(float, self.facts.embed_scale))
        capped = _router_softcap(self.ref_modules.get(base))
        if capped and not is_input and (hit is not None or base in self.functional):
            return self._unaligned(  # the router's logits are its product transformed: no value of ours is them
                spec,
                f"the reference's router soft-caps its logits ({capped:g} tanh(x / {capped:g})) inside its module, "
                "so ours' product with its weight is not its output; its routing weights and choices are compared",
            )
        our_path: str | None
        if hit is not None:
            our_path, source = hit
            ours = our_path + ("@input" if is_input else "")
            outside = None if is_input else self._bias_outside(base, our_path)
            # a norm's gain held whole as one row of a stacked tensor is no fused projection's rows: its module makes
            # its whole output (a vector held with its elements reordered is: its rows are those elements)
            stacked = (
                source.one_row is not None and source.key in self.state_dict and self.state_dict[source.key].dim() < 2
            )
            if source.how == ROWS and not is_input and not stacked:
                rows = Rows(cast(tuple[int, ...], source.rows))  # a ROWS source has its rows
                if outside is not None:
                    plus = PlusBias(self.ours_params[outside], rows)
                    return replace(spec, ours=ours, transform=plus, inverse=plus.inverse), Aligned(
                        name,
                        ours,
                        "fused rows",
                        f"rows of {source.param} holding {source.key}, plus {outside} (its bias, which ours adds "
                        "outside the module)",
                    )
                return (
                    replace(spec, ours=ours, transform=rows, inverse=rows.inverse),
                    Aligned(name, ours, "fused rows", f"rows of {source.param} holding {source.key}"),
                )
            if outside is not None and source.how in (SHARED, COPY):
                plus = PlusBias(self.ours_params[outside])
                return replace(spec, ours=ours, transform=plus, inverse=plus.inverse), Aligned(
                    name,
                    ours,
                    "weights",
                    f"{source.key} ({source.how}), plus {outside} (its bias, which ours adds outside the module)",
                )
            how = "input" if is_input else "weights"
            detail = f"{'transposed ' if source.how == TRANSPOSED else ''}{source.key} ({source.how})"
            if source.how == SCALED:
                detail = f"{source.description}: a scaled copy"
                if not is_input and source.scale and self._divide_scaled(base, source):
                    unscaled = Unscaled(float(source.scale))
                    return replace(spec, ours=ours, transform=unscaled, inverse=unscaled.inverse), Aligned(
                        name, ours, how, f"{detail}, its output compared divided by {float(source.scale):.6g}"
                    )
            return replace(spec, ours=ours), Aligned(name, ours, how, detail)
        if base in self.ref_modules and not isinstance(getattr(self.ref_modules[base], "weight", None), torch.Tensor):
            our_path = self.container(base)
            if our_path is not None and not self._runs(our_path):
                return self._sum_of_parts(spec, base, our_path, is_input)
            if our_path is not None:
                ours = our_path + ("@input" if is_input else "")
                factor = None if is_input else self._output_scale(base)
                if factor is not None:  # stacked experts whose down projections hold the reference's times c
                    unscaled = Unscaled(factor)
                    return replace(spec, ours=ours, transform=unscaled, inverse=unscaled.inverse), Aligned(
                        name,
                        ours,
                        "container",
                        f"{ours} holds {base}'s output projection times {factor:g} (folded at load): its output is "
                        f"compared divided by {factor:g}",
                    )
                return replace(spec, ours=ours), Aligned(
                    name,
                    ours,
                    "input" if is_input else "container",
                    f"common ancestor of the modules aligned under {base}",
                )
        base = self._router_linear(base) if not is_input else base
        if base in self.functional and not is_input:
            stacked = getattr(self.ref_modules.get(base), "weight", None)
            if isinstance(self.ref_modules.get(base), nn.modules.conv._ConvNd):
                return self._unaligned(
                    spec,
                    f"{base} is a convolution ours computes in a function reading {self.functional[base][0]}: no op of "
                    "ours is read as its output; the nodes after it are compared",
                )
            if isinstance(stacked, torch.Tensor) and stacked.dim() == 3:
                return self._unaligned(
                    spec,
                    f"{base} holds every expert's weight stacked {tuple(stacked.shape)}: its output is the "
                    "reference's tokens in its own dispatch order (sorted by expert), which ours' products need not "
                    "follow; the block's output is compared",
                )
            param, source = self.functional[base]
            after = self._children_after(base)
            if after:
                return self._unaligned(
                    spec,
                    f"{base} runs its submodules ({', '.join(after)}) on the result of the op reading its weight, "
                    "inside its own forward: their nodes are compared, not the op ours computes in a function",
                )
            scale = self.facts.embed_scale
            if base == self.facts.embed_module and scale not in (None, 1.0) and source.how != SCALED:
                # a plain table read by a lookup cannot scale: the reference's scaled embedding is what the
                # first layer reads
                first = self._first_layer_reads_embedding()
                if first is not None:
                    return replace(spec, ours=first + "@input"), Aligned(
                        name,
                        first + "@input",
                        "input",
                        f"the reference's embedding scales by {scale:g}; ours reads {param} in a lookup, so its value "
                        "appears where the reference's does: the first layer's input",
                    )
                return self._scaled_lookup(spec, PARAM + param, cast(float, scale))
            bias, scale_param = self._bias_of(base), self._post_scale_of(base)
            ours = PARAM + param + (f"+{bias}" if bias else "") + (f"*{scale_param}" if scale_param else "")
            columns = self._returned_columns(base, spec)
            if columns is not None and source.how in (SHARED, COPY, TRANSPOSED):
                return replace(spec, ours=ours, transform=columns), Aligned(
                    name,
                    ours,
                    "functional",
                    f"output features {columns.start}:{columns.stop} of the op in ours that reads {param}: "
                    f"{base} returns those of its product alone (its weight holds more rows: a MoE router's "
                    "shared experts' logits)",
                )
            returned = self._returned_scale(base, spec) if source.how in (SHARED, COPY, TRANSPOSED) else None
            if returned is not None:
                times = Unscaled(1.0 / returned)
                return replace(spec, ours=ours, transform=times, inverse=times.inverse), Aligned(
                    name,
                    ours,
                    "functional",
                    f"{base} returns its product times {returned:.6g} (a constant inside its forward); the op in "
                    f"ours that reads {param} is compared times it (ours applies it after, judged at the nodes after)",
                )
            if source.how == SCALED and source.scale and self._divide_scaled(base, source):
                unscaled = Unscaled(float(source.scale))  # a scale folded into the weight (and bias) at load
                return replace(spec, ours=ours, transform=unscaled, inverse=unscaled.inverse), Aligned(
                    name,
                    ours,
                    "functional",
                    f"the result of the op in ours that reads {param} ({source.description}: a scaled copy), "
                    f"compared divided by {float(source.scale):.6g}",
                )
            # a vector held as one row of a stacked parameter (a LayerNorm's (2, hidden) [weight; bias]): read as the
            # vector it is, not as a product's rows (a vector permuted in place, a per-head norm's, is one)
            key = self.state_dict.get(source.key)
            vector = key is not None and key.dim() > 0 and key.numel() == key.shape[-1]
            # (a linear's one-row weight, Qwen3-Next's (1, hidden) shared-expert gate fused beside the router's, is
            # a product's row)
            vector = (
                vector and self.ours_params[param].dim() >= 2 and not isinstance(self.ref_modules.get(base), nn.Linear)
            )
            if source.how == ROWS and source.rows and not vector:  # a fused parameter read in a function: its rows
                rows = _rows_of(self.ours_params[param], source)
                return replace(spec, ours=ours, transform=rows, inverse=rows.inverse), Aligned(
                    name, ours, "functional", f"rows of {param} holding {source.key}, read in a function"
                )
            return replace(spec, ours=ours), Aligned(
                name,
                ours,
                "functional",
                f"the result of the op in ours that reads {param} ({source.description}): its module computes more",
            )
        return self._unaligned(spec, self.why.get(base) or self._unplaced(base))

    def _router_linear(self, base: str) -> str:
        """A router with no weight of its own whose logits are its one linear child's weight read in a function
        (LongCat-Flash's ``F.linear(x, self.classifier.weight)``): that child, whose read ours' op is; else
        ``base``."""
        module = self.ref_modules.get(base)
        if module is None or base in self.functional or not is_router(module) or hasattr(module, "weight"):
            return base
        # a child the router calls as a module (DBRX's router.layer) is a node of its own, the router's output too
        linears = [n for n, m in module.named_children() if isinstance(m, nn.Linear)]
        if len(linears) != 1 or calls_child(module, linears[0]):
            return base
        return f"{base}.{linears[0]}" if f"{base}.{linears[0]}" in self.functional else base

    def _unplaced(self, base: str) -> str:
        """Why a reference node that is no module's output of its own found nothing in ours, in true words."""
        module, sep, item = base.partition("#")
        if sep and module in self.ref_modules:
            return f"output {item} of the reference's {module}, which ours computes nowhere parity can see"
        parent = base
        while parent and parent not in self.ref_modules:
            parent = parent.rpartition(".")[0]
        if parent != base:
            return (
                f"the reference computes it inside {parent or 'the model'} (no module of its own); "
                "no module or op of ours was found for it"
            )
        return f"no module of ours holds {base}'s weights"

    # --- a mixture of experts ------------------------------------------------------------------------

    def _moe(self, spec: NodeSpec) -> tuple[NodeSpec, Aligned] | None:
        """The router's choices and weights, or one expert's output; None for any other node."""
        if spec.kind in (CHOICES, WEIGHTS) and ("#" in spec.reference_path or "@" in spec.reference_path):
            return self._routing(spec)
        parent, _, index = spec.reference_path.rpartition(".")
        if index.isdigit() and parent in self.ref_modules and self._part_keys(parent):
            return self._expert(spec, parent, int(index))
        return None

    def _routing(self, spec: NodeSpec) -> tuple[NodeSpec, Aligned]:
        """A router output the reference's router module returns and ours computes in functions: a tap
        under ours' MoE block, filled from torch.topk and what follows (:mod:`parity.record.routing`)."""
        block = spec.reference_path.split("#")[0].split("@")[0].rpartition(".")[0]
        our_block = self.container(block)
        if our_block is None:
            return self._unaligned(spec, f"MoE block {block}: {self.why.get(block, 'not found in ours')}")
        layer = self.facts.layer(spec.layer)
        experts, k = (layer.num_experts, layer.experts_per_token) if layer is not None else (0, 0)
        tap = TAP + f"{our_block}.{spec.kind}"
        if spec.kind == CHOICES:
            others = frozenset(
                n.experts_per_token for n in self.facts.layers if n.num_experts == experts and n.experts_per_token != k
            )
            order = self._expert_order(block, experts)
            topk = TopK(experts, k, others, order)
            detail = f"the indices of torch.topk over the {experts} experts (k = {k}) under {our_block}" + (
                f"; ours' experts in another order (ours' expert i is the reference's {list(order)[:8]}[i])"
                if order
                else ""
            )
            return replace(spec, ours=tap, transform=topk, inverse=topk.inverse), Aligned(
                spec.name, tap, "routing", detail
            )
        detail = (
            f"torch.topk's values under {our_block}, as ours transforms them (a softmax, a renormalisation, a "
            "cast) up to their first use on the experts' outputs"
        )
        return replace(spec, ours=tap), Aligned(spec.name, tap, "routing", detail)

    def _expert_order(self, block: str, experts: int) -> tuple[int, ...]:
        """``to_reference`` (ours' expert i is the reference's ``to_reference[i]``) when ours holds the block's
        router weight with its rows (one per expert) in another order (an experts' stack reversed or permuted
        at load, the router rows with it); () for the same order or when it cannot be read."""
        router = next(
            (
                m
                for name, m in self.ref_modules.items()
                if name.rpartition(".")[0] == block
                and is_router(m)
                and isinstance(getattr(m, "weight", None), torch.Tensor)
            ),
            None,
        )
        weight = getattr(router, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != experts:
            return ()
        for _, source in self._held(weight):
            if source.how == ROWS and source.rows and sorted(source.rows) == list(range(experts)):
                order = sorted(range(experts), key=source.rows.__getitem__)  # the key's row j is ours' row rows[j]
                return tuple(order) if order != list(range(experts)) else ()
        return ()

    def _expert(self, spec: NodeSpec, parent: str, expert: int) -> tuple[NodeSpec, Aligned]:
        """Expert ``expert`` of the reference's fused experts module ``parent``: the op in ours reading the
        parameter that holds its output projection's part, on the tokens ours' block gathered for it."""
        keys = self._part_keys(parent)
        experts = int(self.state_dict[keys[0]].shape[0])
        mine = [
            (n, s, k)
            for k in keys
            for n, s in self.by_key.get(k, [])
            if expert_of(s, self.state_dict[k], experts) == expert
        ]
        if not mine:
            held = sorted({n for k in keys for n, _ in self.by_key.get(k, [])})
            return self._unaligned(
                spec, f"no parameter of ours holds expert {expert} of {parent} alone (ours holds it in {_first(held)})"
            )
        out_key = self._expert_output(keys)
        down = [(n, s) for n, s, k in mine if k == out_key]
        if out_key is None or len(down) != 1:
            return self._unaligned(
                spec, f"expert {expert}'s output projection of {parent} is in {len(down)} parameters of ours"
            )
        param, source = down[0]
        rows = ExpertRows(expert)
        modules = sorted({_module_of(n)[0] for n, _, _ in mine})
        detail = (
            f"expert {expert} on its tokens: the op in ours reading {param} ({source.description}), on the rows "
            f"ours' block gathered for it, zero elsewhere; expert {expert}'s tensors in ours: {_first(modules)}"
        )
        return replace(spec, ours=PARAM + param, transform=rows, inverse=rows.inverse), Aligned(
            spec.name, PARAM + param, "expert", detail
        )

    def _part_keys(self, ref_path: str) -> list[str]:
        """Checkpoint keys of the reference module's own 3-D parameters other than ``weight``, one matrix
        per expert (a fused experts module's ``gate_up_proj``, ``down_proj``), that ours holds."""
        module = self.ref_modules[ref_path]
        return [
            key
            for leaf, tensor in module.named_parameters(recurse=False)
            if leaf != "weight" and tensor.dim() == 3
            for key in self.keys_by_storage.get(_storage_key(tensor), [])
            if self.by_key.get(key)
        ]

    def _expert_output(self, keys: list[str]) -> str | None:
        """The key of the experts' output projection: per expert ``(hidden, intermediate)``, the one
        reading another width than the hidden size; by the reference's name when the widths are equal."""
        hidden = self.facts.hidden_size
        found = [k for k in keys if self.state_dict[k].shape[-2] == hidden != self.state_dict[k].shape[-1]]
        if len(found) != 1:
            found = [k for k in keys if k.endswith("down_proj")]
        return found[0] if len(found) == 1 else None

    def _width(self, module: str) -> int | None:
        """The last axis of what ours' ``module`` returned in the probe forward (None where it did not say)."""
        self._reads()
        return self._widths.get(module)

    def _returns_width(self, module: str, shape: torch.Size) -> bool:
        """Whether ours' ``module`` returns one of ``shape``'s widths on its last axis, as a product with a
        weight of that shape does (True where the probe forward did not say)."""
        width = self._width(module)
        return width is None or width in tuple(shape)

    def _embedding_module(self, our_path: str) -> bool:
        """Whether ours' ``our_path`` is the module ours looks its tokens up in (the reference's embedding's): a
        tied head reading its table computes the head's product outside it (``h @ self.tok.table.t()``)."""
        found = self.leaf(self.facts.embed_module)
        return found is not None and found[0] == our_path

    def _returns_rows(self, module: str, param: str) -> bool:
        """Whether ours' ``module`` returns as many features as the rows ``param`` holds of fused reference
        weights (a module holding AltUp's projections stacked returns the streams, one projection's width):
        else it is no product with the fused weight (True where the probe forward did not say)."""
        width = self._width(module)
        rows = [max(s.rows) for s in self.coverage.sources.get(param, []) if s.how == ROWS and s.rows]
        return width is None or not rows or max(rows) < width

    def _runs(self, our_path: str) -> bool:
        """Whether ours' module has a forward of its own (an ``nn.ModuleList`` of experts has none)."""
        module = self.our_modules.get(our_path)
        return module is not None and type(module).forward is not nn.Module.forward

    def _sum_of_parts(self, spec: NodeSpec, base: str, our_path: str, is_input: bool) -> tuple[NodeSpec, Aligned]:
        """A reference container (the experts' weighted sum) whose modules in ours meet in a module that
        never runs (a ModuleList): the lowest module of ours that runs, when it is ours' block of the
        reference's parent and that parent adds nothing to the sum but a router (its one other weight,
        one row per expert)."""
        block = base.rpartition(".")[0]
        up = our_path
        while up and not self._runs(up):
            up = up.rpartition(".")[0]
        if is_input or not up or up != self.container(block):
            return self._unaligned(
                spec, f"ours' {our_path} has no forward of its own, and no module of ours computes {base} alone"
            )
        others = [
            p
            for p, m in self.ref_modules.items()
            if p.startswith(block + ".")
            and not p.startswith(base)
            and isinstance(getattr(m, "weight", None), torch.Tensor)
        ]
        layer = self.facts.layer(spec.layer)
        experts = layer.num_experts if layer is not None else 0
        if any(self.ref_modules[p].weight.shape[0] != experts for p in others):
            return self._unaligned(
                spec, f"ours computes {base} inside {up}, whose output the reference's {block} adds more to"
            )
        detail = (
            f"ours' {our_path} has no forward of its own; {up} returns the experts' weighted sum (the reference's "
            f"{block} adds nothing to it but the router's choices)"
        )
        return replace(spec, ours=up), Aligned(spec.name, up, "container", detail)

    def _head_dims(self, projection: str, head_dim: int) -> tuple[int, ...] | None:
        """Where ours keeps each head's dims, when its weight of ``projection`` (q_proj, k_proj) holds
        the reference's rows permuted the same way within every head (interleaved RoPE on Meta's
        layout): ``ref[..., i] = ours[..., dims[i]]``; None when ours keeps the reference's order."""
        hit = self.leaf(projection) if projection in self.ref_modules else None
        if hit is None and projection in self.ref_modules:  # a weight ours reads in a function (``x @ self.wq``)
            weight = getattr(self.ref_modules[projection], "weight", None)
            held = self._held(weight) if isinstance(weight, torch.Tensor) else []
            hit = held[0] if len(held) == 1 else None
        if hit is None or hit[1].how != ROWS or hit[1].rows is None:
            return None
        rows = list(hit[1].rows)  # where ours holds each of the key's rows, each head's as one run of ours' rows
        if len(rows) % head_dim:  # (k after q in a fused qkv, HunYuan's q heads beside their group's k and v)
            return None
        runs = [rows[h : h + head_dim] for h in range(0, len(rows), head_dim)]
        heads = [tuple(r - min(run) for r in run) for run in runs]
        if len(set(heads)) != 1 or sorted(heads[0]) != list(range(head_dim)) or heads[0] == tuple(range(head_dim)):
            return None
        return heads[0]

    def _value_dims(self, att: str, head_dim: int) -> tuple[int, ...] | None:
        """:meth:`_head_dims` of the keys the values of attention ``att`` are (Gemma 4's K = V layers: no v_proj,
        its values the k_proj's output), or, for a layer reading an earlier layer's keys and values (a shared KV
        layer: neither), those of the K = V layers' keys of its head size. None when its values are its own."""
        if f"{att}.v_proj" in self.ref_modules:
            return None
        if f"{att}.k_proj" in self.ref_modules:
            return self._head_dims(f"{att}.k_proj", head_dim)
        found = {
            self._head_dims(name, head_dim)
            for name, module in self.ref_modules.items()
            if name.endswith(".k_proj")
            and f"{name.removesuffix('.k_proj')}.v_proj" not in self.ref_modules
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.shape[0] % head_dim == 0
        }
        return found.pop() if len(found) == 1 else None

    def _folded_scale(self, projection: str) -> float:
        """The named constant ours' weight of ``projection`` (q_proj, k_proj) holds the reference's times (a
        scale folded in at load, :data:`~parity.build.coverage.SCALED`), else 1."""
        weight = getattr(self.ref_modules.get(projection), "weight", None)
        held = self._held(weight) if isinstance(weight, torch.Tensor) else []
        scales = {float(s.scale) for _, s in held if s.how == SCALED and s.scale}
        return scales.pop() if len(scales) == 1 and len(held) == 1 else 1.0

    def _fused_head_dims(self, att: str, head_dim: int) -> tuple[int, ...] | None:
        """:meth:`_head_dims` for a reference whose q/k/v are one fused projection (CodeGen's model-parallel
        blocks, NeoX's per-head triples): ours' parameters cut from it, each holding every head's
        ``head_dim`` rows as one contiguous run of the fused rows, all permuted the same way within every
        head (q and k reordered at load for another RoPE pairing; v, kept in order, says nothing). None when
        no part is permuted so, or two disagree."""
        module = next((self.ref_modules[f"{att}.{n}"] for n in FUSED_QKV if f"{att}.{n}" in self.ref_modules), None)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return None
        found: set[tuple[int, ...]] = set()
        for _, source in self._held(weight):
            rows = list(source.rows) if source.how == PART and source.rows else []  # ours' row j: the key's rows[j]
            if not rows or len(rows) % head_dim:
                return None
            heads = [rows[h : h + head_dim] for h in range(0, len(rows), head_dim)]
            if any(max(run) - min(run) != head_dim - 1 for run in heads):
                return None  # a head's dims not one run of the fused rows: a layout this cannot read
            orders = {tuple(r - min(run) for r in run) for run in heads}
            if len(orders) != 1:
                return None
            order = orders.pop()  # ours' dim j of a head holds the reference's dim order[j]
            if order != tuple(range(head_dim)):
                found.add(tuple(sorted(range(head_dim), key=order.__getitem__)))
        return found.pop() if len(found) == 1 else None

    def _mla_dims(self, att: str, suffix: str, head_dim: int, rotary: int) -> tuple[int, ...] | None:
        """DeepSeek's q/k (multi-head latent attention) with ``rope_interleave``: Transformers reorders each
        head's rotated tail from interleaved pairs into halves before rotating, so a port rotating the pairs
        where the checkpoint lays them holds the same tail in pair order (``ref[..., dn + i] = ours[..., dn +
        P[i]]``, P = 0, 2, 4, ..., 1, 3, ...); a port that reordered its rope rows at load (as Transformers
        does at run time) holds the reference's order. None when ours' rope rows are not in the checkpoint's
        order, or the projection is not found."""
        nope = head_dim - rotary
        if rotary < 4 or rotary % 2 or nope < 0:
            return None
        names = ("q_b_proj", "q_proj") if suffix == "q_rot" else ("kv_a_proj_with_mqa",)
        module = next((self.ref_modules[f"{att}.{n}"] for n in names if f"{att}.{n}" in self.ref_modules), None)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return None
        first = nope if suffix == "q_rot" else weight.shape[0] - rotary  # head 0's first rope row
        for _, source in self._held(weight):
            rows = source.rows if source.how in (PART, ROWS) and source.rows else None
            if rows is None:
                continue
            # part: ours' row i is the key's row rows[i]; rows: the key's row j is ours' row rows[j]
            if source.how == PART and first in rows:
                at = rows.index(first)
                reordered = at + 1 < len(rows) and rows[at + 1] != first + 1
            else:
                reordered = source.how == ROWS and first + 1 < len(rows) and rows[first + 1] != rows[first] + 1
            if reordered:
                return None  # ours reordered its rope rows at load: its tail is in the reference's order
        pairs = [2 * i for i in range(rotary // 2)] + [2 * i + 1 for i in range(rotary // 2)]
        return tuple(range(nope)) + tuple(nope + p for p in pairs)

    def _first_layer_reads_embedding(self) -> str | None:
        """Ours' first layer, when its input is the reference's scaled embedding as it is: it runs a forward
        of its own and the reference adds no position embedding before it (XGLM's sinusoids, OPT's learned
        positions are added after the scale)."""
        first = self.container(f"{self.facts.layer_prefix}.0")
        positions = any(path.rpartition(".")[2] in POSITION_TABLES for path in self.ref_modules)
        return first if first is not None and self._runs(first) and not positions else None

    def _scaled_lookup(self, spec: NodeSpec, ours: str, scale: float) -> tuple[NodeSpec, Aligned]:
        """The reference's scaled embedding against ours' plain lookup times the scale (ours applies it
        after, where the nodes after judge it)."""
        times = Unscaled(1.0 / scale)
        return replace(spec, ours=ours, transform=times, inverse=times.inverse), Aligned(
            spec.name,
            ours,
            "functional" if ours.startswith(PARAM) else "weights",
            f"the reference's embedding scales by {scale:g}; ours' lookup is compared times {scale:g} (ours scales "
            "after it, or adds positions before the first layer)",
        )

    def _output_scale(self, base: str) -> float | None:
        """The constant ours' copy of ``base``'s stacked output projection (experts' ``down_proj``, ``w2``) is
        scaled by at load (Granite's residual_multiplier folded into every expert), when ours holds that
        tensor scaled and the block's other tensors unscaled: ``base``'s output is then scaled by it. None
        otherwise."""
        module = self.ref_modules.get(base)
        if module is None:
            return None
        keys = {self.keys_by_storage.get(_storage_key(t), [None])[0]: leaf for leaf, t in module.named_parameters()}
        scaled = {
            leaf: src.scale
            for key, leaf in keys.items()
            for _, src in self.by_key.get(key or "", [])
            if src.how == SCALED and src.scale
        }
        outputs = [leaf for leaf in scaled if leaf.rsplit(".", 1)[-1] in OUTPUT_PROJECTION_LEAVES]
        if len(scaled) != 1 or len(outputs) != 1:
            return None
        scale = float(cast(float, scaled[outputs[0]]))
        routed = self.facts.routing.get("routed_scaling_factor")
        if routed and abs(scale / float(routed) - 1) < 1e-6:
            return None  # a constant the block applies itself (DeepSeek V3's, GLM-4.5's): moved inside, not out of it
        return scale

    def _divide_scaled(self, base: str, source: Source) -> bool:
        """Whether ours' output from a scaled copy of ``base``'s weight is compared divided by the scale: always,
        except the embedding whose reference scales its own output by that factor (Gemma's, TransformerLens'
        pre-multiplied table): Granite's embedding_multiplier folded into the table is applied after the
        reference's module, so its lookup is the module's output times the multiplier."""
        scale = self.facts.embed_scale
        if base != self.facts.embed_module or scale in (None, 1.0):
            return True
        return abs(float(cast(float, source.scale)) / float(scale) - 1) > 1e-6

    def _scaled_outside(self, our_path: str) -> bool:
        """The reference's embedding scales its output (Gemma: sqrt(hidden)) and ours is a plain
        ``nn.Embedding``, which cannot: the scale is applied by its caller."""
        scale = self.facts.embed_scale
        return scale not in (None, 1.0) and type(self.our_modules.get(our_path)) is nn.Embedding

    @staticmethod
    def _unaligned(spec: NodeSpec, reason: str) -> tuple[NodeSpec, Aligned]:
        return replace(spec, ours=UNALIGNED + reason), Aligned(spec.name, None, "unaligned", reason)


def align(
    reference: nn.Module,
    ours: nn.Module,
    nodes: list[NodeSpec],
    coverage: Coverage,
    state_dict: dict,
    facts: ArchFacts,
    overrides: dict[str, str] | None = None,
) -> tuple[list[NodeSpec], list[Aligned]]:
    """Our counterpart of every reference node (see the module docstring).

    ``overrides``: ``{reference node name or glob: our module path}`` (``tap:<path>`` for a
    functional node) replaces the automatic choice. Returns the NodeSpecs to trace and one
    :class:`Aligned` row per node, in the order of ``nodes``.
    """
    aligner = _Aligner(reference, ours, coverage, state_dict, facts)
    check_node_map(overrides or {}, nodes)
    specs, rows = [], []
    for spec in nodes:
        pattern = next((p for p in (overrides or {}) if fnmatch.fnmatchcase(spec.name, p)), None)
        if pattern is not None:
            assert overrides is not None  # pattern is one of its keys
            layer = facts.locate(spec.name)[0]
            target = overrides[pattern].replace("{i}", str(layer)) if layer is not None else overrides[pattern]
            check_node_map_target(pattern, target, ours)
            specs.append(replace(spec, ours=target))
            rows.append(Aligned(spec.name, target, "override", f"node_map[{pattern!r}]"))
            continue
        for new, row in aligner.split(spec) or [aligner.place(spec)]:
            specs.append(new)
            rows.append(row)
    # a model nobody wrote for parity keeps its own layouts: a node differing only in layout is compared in the reference's
    # (not what forward returns: a training loop reads that value in its layout)
    specs = [replace(spec, match_layout=spec.reference_path != "") for spec in specs]
    return specs, rows


def check_node_map(overrides: dict[str, str], nodes: list[NodeSpec]) -> None:
    """Every key of a node map names a reference node (or is a glob matching one). ParityError otherwise:
    a typo would silently change nothing."""
    import difflib

    names = [n.name for n in nodes]
    for pattern, target in overrides.items():
        if not isinstance(pattern, str) or not isinstance(target, str):
            raise ParityError(
                f"node_map: {pattern!r}: {target!r} must map a reference node name to a path in your model"
            )
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            close = difflib.get_close_matches(pattern, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ParityError(f"node_map: {pattern!r} matches no reference node{hint}")


def check_node_map_target(pattern: str, target: str, ours: nn.Module) -> None:
    """A node map's value names something your model has: a module path (``a.b``, ``a.b@input``, an
    argument ``a.b@name`` of its forward, an output ``a.b#1``), or ``tap:<module>.<name>``;
    ``unaligned:<why>`` and ``param:`` are taken as they are. ParityError (bad input) otherwise,
    rather than a node that fails as missing."""
    import difflib
    import inspect

    from parity.record.hooks import split_path

    if target.startswith((UNALIGNED, PARAM)):
        return
    modules = dict(ours.named_modules())
    where = f"node_map[{pattern!r}] = {target!r}"
    if target.startswith(TAP):
        module = target[len(TAP) :].rpartition(".")[0]
    else:
        module, _, _ = split_path(target)
        module, at, argument = module.partition("@")
        if at and module in modules:
            try:
                params = dict(inspect.signature(modules[module].forward).parameters)
            except (TypeError, ValueError):
                params = {}
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            if params and not takes_any and argument not in params:
                raise ParityError(
                    f"{where}: {module or 'your model'}'s forward has no argument {argument!r} "
                    f"(it takes {', '.join(params) or 'none'}; @input is its first input)"
                )
    if module not in modules:
        close = difflib.get_close_matches(module, [m for m in modules if m], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ParityError(f"{where}: your model has no module {module!r}{hint}")


def alignment_table(rows: list[Aligned]) -> list[tuple[str, str, str, str]]:
    """``(node, ours, how, detail)`` per row, for printing."""
    return [(r.node, r.ours if r.ours is not None else "-", r.how, r.detail) for r in rows]
