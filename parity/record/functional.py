"""Functional nodes of code you don't own: what attention and projections compute in plain functions.

A user's model (a library's, a notebook's) computes attention in functions, not modules: a fused
``torch.nn.functional.scaled_dot_product_attention``, or ``q @ k^T``, a softmax and ``probs @ v``
written out, or ``einsum``. While ours runs, :class:`FunctionCapture` (a ``TorchFunctionMode``,
installed only when the pair has such nodes) watches those calls and records them as
:func:`parity.record.hooks.tap` would, under the running module aligned to the reference's
attention block:

* ``scaled_dot_product_attention(q, k, v, ...)``: ``q`` and ``k`` are ``q_rot`` and ``k_rot`` (after
  RoPE), the result is ``context``; ``scores`` (``q k^T * scale``) and ``probs`` (softmax of the
  scores with the call's own mask, causality and scale) are computed from the call's arguments,
  exactly what the fused kernel computes inside;
* a product of two head tensors contracting ``head_dim`` (``q @ k.transpose(-2, -1)``, an
  ``einsum`` such as ``bqhd,bkhd->bhqk``): its operands are ``q_rot`` and ``k_rot``;
* a softmax inside the attention block: ``probs``; the product of the probabilities with the
  values: ``context``.

A tap the model calls itself wins (the first record of a node stands). Projections computed from a
parameter of a module that holds several (TransformerLens' ``W_Q`` in ``attn``) are recorded by the
parameter they read: the result of the ``linear``/``matmul``/``einsum``/``addmm`` with that parameter,
or with a rearranged copy of it (TransformerLens rearranges ``W_Q`` to ``(heads * d_head, d_model)``
for ``F.linear``), is the node of the reference module whose weight it holds, with the bias ours adds
right after it (``x @ W + b``) when the reference's module adds one. A module of ours whose weight
is read outside it (``F.linear(x, self.head.weight)``: its own forward never runs) is recorded the
same way, and so is a norm whose weight vector is applied outside its module (``F.rms_norm(x, shape,
self.q_norm.weight)``, or ``F.rms_norm(x, shape) * self.q_norm.g``): the op applying it is the node. In isolated mode each recorded value is replaced by the reference's, in ours' layout, as a
tap's is. A mixture of experts' routing is read by :mod:`parity.record.routing`.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from parity.record.ops import (
    DERIVES,
    LOOKUP,
    LOOKUPS,
    NORM_WEIGHT_NAMES,
    PRODUCT,
    PRODUCT_NAMES,
    REARRANGES,
    STATISTIC_NAMES,
    op_name,
)
from parity.record.routing import RoutingCapture

SDPA = F.scaled_dot_product_attention
SOFTMAXES = (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax)
PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
EINSUM = torch.einsum
#: ``bias.baddbmm(q, k^T, beta=, alpha=)``: scores and a bias in one op (BLOOM adds ALiBi so)
BADDBMMS = (torch.baddbmm, torch.Tensor.baddbmm)
LINEAR = F.linear
#: the scalar scalings a written-out attention applies to ``q @ k^T`` (``/ sqrt(d)``, ``* scale``)
SCALINGS = (
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.__truediv__,
    torch.Tensor.mul,
    torch.Tensor.div,
    torch.mul,
    torch.div,
)
#: in-place scalings (``scores /= math.sqrt(d)``: Falcon's eager attention), read as their out-of-place op
IN_PLACE_SCALINGS = {
    torch.Tensor.__itruediv__: torch.Tensor.__truediv__,
    torch.Tensor.__imul__: torch.Tensor.__mul__,
    torch.Tensor.div_: torch.Tensor.div,
    torch.Tensor.mul_: torch.Tensor.mul,
}


#: how many rearranged parameters are followed at once (each is consumed by the next op or two)
_FOLLOWED = 16


#: a parameter's key in the maps by storage: its storage's address, or, where several parameters of ours
#: are views into one storage (``nn.Parameter(b.chunk(3)[0])``), ``(address, first element, end)``
StorageKey = int | tuple[int, int, int]


class FeaturesMismatch(ValueError):
    """A node's transform given a product whose output features are not the node's (a product over part of a
    parameter's output features: MLA's k and v read apart from one stored kv_b weight): that product is no
    value of the node, which is left to what else records it."""


@dataclass(frozen=True)
class Block:
    """The storage elements of a fused parameter that hold one projection's rows: ``first`` to ``end``, all of
    them, or (``elements``, sorted) those of a strided view (``wkv[:, 0]`` of a ``(hidden, 2, kv_heads,
    head_dim)`` weight)."""

    first: int
    end: int
    elements: torch.Tensor | None = field(default=None, compare=False)

    def read_by(self, t: torch.Tensor) -> bool:
        """Whether the view ``t`` of the parameter's storage reads exactly these elements."""
        start = int(t.storage_offset())
        if start != self.first or start + _span_of(t) != self.end:
            return False
        if self.elements is None:
            return t.numel() == self.end - self.first
        if t.numel() != self.elements.numel():
            return False
        index = torch.arange(self.end - self.first).as_strided(t.shape, t.stride())
        return bool(torch.equal(index.flatten().sort().values + start, self.elements))


def storage_keys(params) -> dict[int, StorageKey]:
    """``id(parameter) -> its key`` (:data:`StorageKey`) for ``params``: the storage address, unless another
    parameter is another view into the same storage, then the address with the elements it spans."""
    spans: dict[int, set[tuple[int, int]]] = {}
    for p in params:
        if p.numel():
            spans.setdefault(p.untyped_storage().data_ptr(), set()).add((p.storage_offset(), p.numel()))
    keys: dict[int, StorageKey] = {}
    for p in params:
        if not p.numel():
            continue
        ptr, start = p.untyped_storage().data_ptr(), p.storage_offset()
        keys[id(p)] = ptr if len(spans[ptr]) == 1 else (ptr, start, start + _span_of(p))
    return keys


def _normalised(x: torch.Tensor, out: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether ``out``, a norm's output with its weight (one of ``weights``, broadcast) applied, can be ``x``
    normalised: divided by the weight, each row is ``x``'s, or ``x`` less its mean, times one factor. A statistic
    read on an earlier tensor (a weightless norm before a residual gate, then this norm on the gate's output) is no
    input of this norm; where the weight is unknown, the input is kept."""
    if len(weights) != 1 or x.dim() < 1 or x.shape[-1] < 4:
        return True
    w = weights[0].detach().double()
    try:
        plain = (out.detach().double() / torch.where(w.abs() > 1e-12, w, torch.ones_like(w))).flatten(0, -2)
    except RuntimeError:
        return True
    a = x.detach().double().flatten(0, -2)
    if plain.shape != a.shape:
        return True
    width = a.shape[-1]
    for size in (d for d in range(width, 3, -1) if width % d == 0):  # the whole row, or groups of it (group norms)
        rows, held = a.reshape(-1, size), plain.reshape(-1, size)
        for form in (rows, rows - rows.mean(-1, keepdim=True)):
            c = (held * form).sum(-1, keepdim=True) / (form * form).sum(-1, keepdim=True).clamp_min(1e-300)
            if float((held - c * form).norm()) <= 1e-3 * float(held.norm()):
                return True
    return False


def _span_of(t: torch.Tensor) -> int:
    """How many elements of its storage ``t`` reaches from its first (its numel when packed)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)


class Followed:
    """Parameters (by storage) and their rearranged copies (by identity, the last few): what each one is."""

    def __init__(self, by_storage: dict[StorageKey, str]):
        self.by_storage = by_storage
        #: id -> (node, the tensor, the elements of the parameter it came from when it holds part of them,
        #: whether it came from a vector: a norm's weight)
        self._derived: dict[int, tuple[str, torch.Tensor, int | None, bool]] = {}
        #: per storage address shared by several parameters, ``(first element, end, node)`` of each
        self._regions: dict[int, list[tuple[int, int, str]]] = {}
        for key, node in by_storage.items():
            if isinstance(key, tuple):
                self._regions.setdefault(key[0], []).append((key[1], key[2], node))

    def of(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        derived = self._derived.get(id(t))
        if derived is not None and derived[1] is t:
            return derived[0]
        storage = _storage(t)
        if storage is None:
            return None
        regions = self._regions.get(storage)
        if regions:  # one of several parameters viewing this storage: the one whose elements it reads
            start = t.storage_offset()
            end = start + _span_of(t)
            return next((node for first, last, node in regions if first <= start and end <= last), None)
        return self.by_storage.get(storage)

    def rearranged_vector(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a vector parameter's values in another shape (``w.view(heads, head_dim)``)."""
        derived = self._derived.get(id(t))
        return derived is not None and derived[1] is t and derived[2] is None and derived[3]

    def size_of(self, t: torch.Tensor) -> int:
        """The elements of the parameter ``t`` reads (its storage's, or its region's where shared)."""
        derived = self._derived.get(id(t))
        if derived is not None and derived[1] is t and derived[2] is not None:
            return derived[2]
        storage = _storage(t)
        start, end = t.storage_offset(), t.storage_offset() + _span_of(t)
        for first, last, _ in self._regions.get(storage, []) if storage is not None else []:
            if first <= start and end <= last:
                return last - first
        return t.untyped_storage().nbytes() // max(t.element_size(), 1)

    def follow(self, func, args, out) -> None:
        """Remember ``out`` as its input's parameter when ``func`` only rearranges it, or derives a weight of
        another form from it and constants alone (:func:`derived_from`)."""
        if args and isinstance(out, torch.Tensor):
            self.keep(out, args[0] if op_name(func) in REARRANGES else self.derived_from(func, args))

    def keep(self, out: torch.Tensor, source, part: bool = False) -> None:
        """Remember ``out`` as ``source``'s parameter (when it is one) holding its values in another form,
        or (``part``) some of them: rows picked by index (a row-parallel shard, ``W[idx]``), whose products
        are summed into the node as a slice's are."""
        what = self.of(source)
        if what is not None and isinstance(source, torch.Tensor) and (part or out.numel() == source.numel()):
            vector = source.dim() == 1 or self.rearranged_vector(source)
            self._derived[id(out)] = (what, out, self.size_of(source) if part else None, vector)
            while len(self._derived) > _FOLLOWED:
                self._derived.pop(next(iter(self._derived)))

    def derived_from(self, func, args) -> torch.Tensor | None:
        """The parameter (or its rearranged copy) an element-wise op makes another weight of, with nothing
        but constants beside it (``1 + w``, ``w * c``, ``-w``), else None."""
        if op_name(func) not in DERIVES:
            return None
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
        if len(tensors) != 1 or any(isinstance(a, (list, tuple)) for a in args) or self.of(tensors[0]) is None:
            return None
        return tensors[0]


class _FirstReads(TorchFunctionMode):
    def __init__(self, followed: Followed):
        super().__init__()
        self.followed = followed
        self.reads: dict[str, str] = {}
        #: the module paths running (outermost first) while the model's forward runs
        self.running: list[str] = []
        #: parameter -> the modules running at its first read by any op
        self.within: dict[str, tuple[str, ...]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = op_name(func)
        operands = args[1:] if name == "einsum" else args
        for i, t in enumerate(operands):
            what = self.followed.of(t)
            if what is not None and what not in self.within:
                self.within[what] = tuple(self.running)
            if what is None or what in self.reads:
                continue
            if name in PRODUCT_NAMES:
                self.reads[what] = PRODUCT
            elif name in LOOKUPS and (i == 1 if name == "embedding" else i == 0):
                self.reads[what] = LOOKUP
        self.followed.follow(func, args, out)
        return out


def first_reads(
    model: torch.nn.Module,
    names: dict[StorageKey, str],
    input_ids: torch.Tensor,
    within: dict[str, tuple[str, ...]] | None = None,
    widths: dict[str, int] | None = None,
) -> dict[str, str]:
    """How ``model``'s forward on ``input_ids`` first reads each watched parameter: ``{name: "lookup" |
    "product"}`` (an embedding lookup or indexing, or a matrix product, directly or after a rearrangement);
    ``names``: a parameter's storage -> its name. ``within`` (filled when given): each parameter read by any op
    -> the paths of the modules whose forward was running then, outermost first. ``widths`` (filled when
    given): each module's path -> the last axis of the first tensor its first call returned. A forward that
    raises reads nothing: ``{}``."""
    mode = _FirstReads(Followed(names))
    paths = {id(m): n for n, m in model.named_modules()}

    def enter(module, _args):
        mode.running.append(paths.get(id(module), "?"))

    def leave(module, _args, out):
        if mode.running:
            path = mode.running.pop()
            first = out[0] if isinstance(out, tuple | list) and out else out
            if widths is not None and isinstance(first, torch.Tensor) and first.dim():
                widths.setdefault(path, first.shape[-1])

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave, always_call=True) for m in model.modules()]
    try:
        with torch.no_grad(), mode:
            model(input_ids)
    except (Exception, SystemExit, KeyboardInterrupt):  # the probe is a hint for alignment: the check's own call
        return {}  # of the forward reports what it raises (stages.run_ours), sys.exit() and an interrupt included
    finally:
        for h in handles:
            h.remove()
    if within is not None:
        within.update(mode.within)
    return mode.reads


def probe_reads(
    model: torch.nn.Module,
    vocab_size: int,
    within: dict[str, tuple[str, ...]] | None = None,
    widths: dict[str, int] | None = None,
) -> dict[str, str]:
    """:func:`first_reads` of every parameter of ``model`` (by name) on a four-token probe of its vocabulary."""
    params = dict(model.named_parameters())
    key_of = storage_keys(params.values())
    names: dict[StorageKey, str] = {key_of[id(p)]: n for n, p in params.items() if id(p) in key_of}
    device = next((p.device for p in params.values()), torch.device("cpu"))
    probe = (torch.arange(4, device=device) % max(1, vocab_size))[None]
    return first_reads(model, names, probe, within, widths)


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1)


#: ops that change a tensor's dtype alone
_CASTS = frozenset({"float", "double", "half", "bfloat16", "to", "type_as"})
#: ops that cut a tensor into pieces along one axis
_SPLITS = frozenset({"split", "chunk", "split_with_sizes", "tensor_split"})


def _feature_offsets(whole: torch.Tensor, pieces) -> list[int] | None:
    """Each piece's first feature where ``pieces`` cut ``whole`` along its last axis in order (views side by side
    covering it); None for any other cut."""
    if not isinstance(pieces, (tuple, list)) or not pieces or not all(isinstance(p, torch.Tensor) for p in pieces):
        return None
    offsets, at = [], 0
    for p in pieces:
        if p.shape[:-1] != whole.shape[:-1] or p.storage_offset() - whole.storage_offset() != at * whole.stride(-1):
            return None
        offsets.append(at)
        at += p.shape[-1]
    return offsets if at == whole.shape[-1] else None


def _template_only(func, args, latest: torch.Tensor) -> bool:
    """Whether ``func`` reads ``latest`` for its shape or dtype alone (``mask.expand_as(scores)``, XLM's padding
    mask; ``x.type_as(scores)``): the scores go on unchanged, the op's result is no step of theirs."""
    return op_name(func).endswith("_as") and bool(args) and args[0] is not latest


def _normalisable(args) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() and args[0].dim() >= 2


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None


def _sdpa_arguments(args, kwargs) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


def sdpa_scores_probs(q: torch.Tensor, k: torch.Tensor, call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q k^T * scale, softmax(q k^T * scale + mask))`` of one ``scaled_dot_product_attention``
    call, as its math backend computes them (float32, cast back to the query's dtype): the
    scores before any mask, the probabilities each query gives each key."""
    scale = call.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if call.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    logits = scores
    mask = call.get("attn_mask")
    if call.get("is_causal"):
        lq, lk = q.shape[-2], k.shape[-2]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        logits = logits.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.float()
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no key: zeros, as the kernel gives
    return scores.to(q.dtype), probs.to(q.dtype)


_EINSUM_TERM = re.compile(r"^\s*([a-zA-Z.]+)\s*,\s*([a-zA-Z.]+)\s*->\s*([a-zA-Z.]*)\s*$")


def _einsum_parts(equation: str) -> tuple[str, str, str] | None:
    m = _EINSUM_TERM.match(equation.replace(" ", ""))
    return (m.group(1), m.group(2), m.group(3)) if m and "." not in equation else None


class Canonical:
    """A tensor of ours brought into the reference's attention layout by its axes' letters: ``groups``
    lists, in the reference's order, the letters each of its axes flattens (``[["b"], ["g", "r"], ["q"],
    ["k"]]`` for an ``einsum`` output ``bgrqk``: heads kept as (KV heads, group), flattened as
    ``repeat_kv`` numbers them). ``back(t)`` puts a tensor in that layout into ours' again."""

    def __init__(self, t: torch.Tensor, letters: str, groups: list[list[str]]):
        self.perm = [letters.index(c) for group in groups for c in group]
        permuted = t.permute(self.perm)
        self.sizes = permuted.shape
        shape, i = [], 0
        for group in groups:
            shape.append(math.prod(self.sizes[i : i + len(group)]))
            i += len(group)
        self.value = permuted.reshape(shape)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.sizes).permute(torch.tensor(self.perm).argsort().tolist())


def _picks_rows(name: str, args) -> bool:
    """``W[idx]`` / ``W.index_select(0, idx)`` with a 1-D index into a 2-D weight (a row-parallel shard's
    rows), not a table lookup at token ids (``(batch, seq)`` of them)."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
        return False
    index = args[1] if name == "__getitem__" and len(args) > 1 else args[2] if len(args) > 2 else None
    return isinstance(index, torch.Tensor) and index.dim() == 1 and not index.is_floating_point()


def _einsum_specs(func, args) -> tuple[list[str], str, list] | None:
    """``(each operand's letters, the output's letters, the operands)`` of an ``einsum`` call given an
    explicit output (``"bsd,hd->bsh"``, operands after it or in one list); None for any other call."""
    if op_name(func) != "einsum" or not args or not isinstance(args[0], str) or "->" not in args[0]:
        return None
    inputs, output = args[0].replace(" ", "").split("->")
    operands = list(args[1:]) if len(args) > 2 else (list(args[1]) if len(args) == 2 else [])
    return inputs.split(","), output, operands


@dataclass(frozen=True)
class _AsLinear:
    """An ``einsum`` product whose result does not lead with its input's axes (``bsh,hcnd->cbsnd``: K and V
    of one stacked weight, the stack axis first) or keeps the weight's output axes apart (``bsh,hnd->bsnd``,
    ``bsh,hjtd->bjtsd``): the result read as ``(input's kept axes..., features)``, the weight's output axes
    flattened in the weight's order (its rows, as the reference's linear gives them), and put back after."""

    perm: tuple[int, ...]
    shape: tuple[int, ...]
    lead: int

    @staticmethod
    def of(func, args, followed: Followed, out) -> _AsLinear | None:
        parsed = _einsum_specs(func, args)
        if parsed is None or not isinstance(out, torch.Tensor) or "." in args[0]:
            return None
        specs, output, operands = parsed
        if len(specs) != 2 or len(operands) != 2:
            return None
        held = [followed.of(t) is not None for t in operands]
        if held.count(True) != 1:
            return None
        w_spec, x_spec = (specs[0], specs[1]) if held[0] else (specs[1], specs[0])
        lead = [c for c in x_spec if c in output]
        features = [c for c in w_spec if c in output and c not in x_spec]
        if not lead or sorted(lead + features) != sorted(output):
            return None
        if output[0] == lead[0] and len(features) < 2:  # already (input's axes..., features)
            return None
        perm = tuple(output.index(c) for c in lead + features)
        return _AsLinear(perm, tuple(out.shape[i] for i in perm), len(lead))

    def view(self, out: torch.Tensor) -> torch.Tensor:
        return out.permute(self.perm).flatten(self.lead)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.shape).permute(tuple(torch.tensor(self.perm).argsort().tolist()))


def _kept_weight_axis(func, args, followed: Followed) -> int | None:
    """The axis of an ``einsum``'s result that the parameter it reads shares with its input and keeps (not
    the output features, its last letter): ``bnsh,nhd->bnsd`` keeps the head axis ``n`` at 1, one output
    per head. None for any other product (``bsd,hdk->bshk`` cuts the output features into heads)."""
    parsed = _einsum_specs(func, args)
    if parsed is None:
        return None
    specs, output, operands = parsed
    for i, (spec, t) in enumerate(zip(specs, operands, strict=False)):
        if followed.of(t) is None:
            continue
        others = "".join(s for j, s in enumerate(specs) if j != i)
        # an axis the weight shares with its input and keeps (heads: one output per head, summed after);
        # an axis of the weight alone in the result is its output features cut (TransformerLens' W_Q)
        kept = [c for c in spec if c in output and c != output[-1] and c in others]
        return output.index(kept[0]) if len(kept) == 1 else None
    return None


def _held_axis(t: torch.Tensor, input_axes: dict[int, tuple[torch.Tensor, int]]) -> int | None:
    """The input axis of the projection weight ``t`` is, or is a view of in another shape or a slice of along
    its other axes (MLA's ``w_kvb[..., dv:]``: k's rows of a weight stored ``(rank, heads, dv + dn)``; DeepSeek's
    ``wkv_b.weight.view(heads, -1, rank)[:, :nope]``): the one axis of ``t`` holding that axis whole, with the
    parameter's own stride. None for anything else."""
    held = input_axes.get(id(t))
    if held is not None and held[0] is t:
        return held[1]
    if not t.dim():
        return None
    ptr = t.untyped_storage().data_ptr()
    for param, axis in input_axes.values():
        if param.untyped_storage().data_ptr() != ptr or t.numel() > param.numel():
            continue
        size, stride = param.shape[axis], param.stride(axis)
        same = [i for i in range(t.dim()) if t.shape[i] == size and t.stride(i) == stride]
        if len(same) == 1 and size > 1:
            return same[0]
    return None


def _kept_input_axis(func, args, input_axes: dict[int, tuple[torch.Tensor, int]]) -> int | None:
    """The input axis of a projection weight a product reads as it is held (no rearranged copy, or a slice of
    it along its other axes) when the product keeps that axis instead of contracting it (see
    :meth:`FunctionCapture._absorbs`), else None."""
    name = op_name(func)
    if name == "einsum":
        parsed = _einsum_specs(func, args)
        if parsed is None or "." in args[0]:
            return None
        specs, output, operands = parsed
        for spec, t in zip(specs, operands, strict=False):
            axis = _held_axis(t, input_axes) if isinstance(t, torch.Tensor) else None
            if axis is not None and len(spec) == t.dim():
                return axis if spec[axis] in output else None
        return None
    # x @ W contracts W's second-to-last axis, W @ x its last, F.linear(x, W) its input features (axis 1)
    if name in ("matmul", "__matmul__", "mm", "bmm"):
        slots = [(args[0], -1), (args[1], -2)] if len(args) >= 2 else []
    elif name == "__rmatmul__":
        slots = [(args[0], -2)] if args else []
    elif name == "linear":
        slots = [(args[1], 1)] if len(args) >= 2 else []
    else:
        return None
    for t, contracted in slots:
        axis = _held_axis(t, input_axes) if isinstance(t, torch.Tensor) else None
        if axis is not None and t.dim() >= 2:
            return axis if axis != contracted % t.dim() else None
    return None


class Heads:
    """``(batch * heads, seq, x)`` (a ``bmm`` over batch and heads folded together) as ``(batch, heads,
    seq, x)`` and back; any other tensor passes as it is."""

    def __init__(self, t: torch.Tensor, heads: int):
        self.folded = t.dim() == 3 and heads > 0 and t.shape[0] % heads == 0
        self.heads = heads

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(0, (-1, self.heads)) if self.folded else t

    def back(self, t: torch.Tensor) -> torch.Tensor:
        return t.flatten(0, 1) if self.folded else t

    def canonical(self, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        return self.view(t), self.back


@dataclass
class Pending:
    """``q @ k^T`` of a block not yet recorded as its scores: ``latest`` is what the model made of it so far
    (a mask), ``canonical(t) -> (t in the reference's layout, back)``."""

    latest: torch.Tensor
    product: torch.Tensor
    canonical: Callable[[torch.Tensor], tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]


class FunctionCapture(TorchFunctionMode):
    """Records attention internals and functional projections of ours while it runs (see the module
    docstring) and, under a MoE block, its routing (:mod:`parity.record.routing`, ``moe``).
    ``record(name, tensor) -> tensor``: a tap that yields to the model's own
    (:func:`~parity.record.hooks.functional_tap`); ``block() -> (path, head_dim, heads) | None``: the
    running attention block aligned to the reference's; ``params``: storage of a parameter of ours
    -> the node of the op that reads it, recorded by ``record_param(node, tensor) -> tensor``;
    ``biases``: storage of a bias -> the node whose op's result ours adds it to (``""``: a vector of ours
    aligned to nothing, a bias to whichever node in ``expects_bias`` it is added to); ``owners``: ``(node ->
    the module of ours whose hook records it, running() -> the running module paths)``; ``moe() ->
    (path, TopK) | None``: the running MoE block."""

    def __init__(
        self,
        record,
        block,
        params: dict[StorageKey, str],
        record_param,
        moe=None,
        biases=None,
        scales=None,
        vectors=None,
        expects_bias: frozenset[str] = frozenset(),
        gated: frozenset[str] = frozenset(),
        owners=None,
        retract=None,
        hold_input=None,
        joined=None,
        lookups: frozenset[str] | None = None,
        input_axes: dict[int, tuple[torch.Tensor, int]] | None = None,
        forget=None,
        parts: dict[int, list[tuple[Block, str, Callable]]] | None = None,
        widths: dict[str, int] | None = None,
    ):
        super().__init__()
        #: norm node -> the reference's weight vector's length: a product reading a shorter slice of it is part of
        #: the node (:meth:`_vector_slice`)
        self.widths = widths or {}
        #: ``storage address -> [(block, node, its rows)]``: the elements of a fused parameter holding one node's
        #: rows alone; a product reading exactly those is that node (``W[1]`` of a stacked gate/up, ``wkv[:, 0]``)
        self.parts = parts or {}
        #: results of such products waiting for their bias: ``id -> the node's rows``
        self._part_rows: dict[int, Callable] = {}
        #: ``id(weight) -> (weight, its axis holding the reference projection's input features)``, for the
        #: projection weights of ours whose layout says it (:meth:`parity.build.coverage.Source.input_axis`)
        self.input_axes = input_axes or {}
        #: ``forget(module)``: drop every node of the reference module ``module`` recorded so far
        self.forget = forget or (lambda module: None)
        #: reference module -> why ours never computes its output: a product reads its weight with the input
        #: features kept (MLA's weight absorption, ``q_nope @ W_UK``): its nodes and its block's attention
        #: internals are not judged; the nodes after them are
        self.absorbed: dict[str, str] = {}
        #: the nodes that are a table's lookup (an embedding); None: any table read by index is one
        self.lookups = lookups
        #: ``retract(kind)``: forget what this capture recorded for the running block's node of that kind
        self.retract = retract or (lambda kind: None)
        #: ``hold_input(node, x)``: keep what a product reading a node's weight reads besides it (its input)
        self.hold_input = hold_input or (lambda node, x: None)
        #: ``joined(tensors, out)``: a concatenation, which may join the outputs of one module's calls
        self.joined = joined or (lambda tensors, out: None)
        #: per block, the queries its ``q @ k^T`` products read; the same queries again: attention over key
        #: chunks (an online softmax), whose partial scores are no node: the block is then left alone
        self._queries: dict[str, list[weakref.ref]] = {}
        #: per block, the keys its products read, as views of their storage (``k.transpose(-1, -2)`` is a new
        #: tensor each time, its storage the same); the same keys again: attention over query chunks
        self._keys: dict[str, list[tuple[weakref.ref, tuple]]] = {}
        #: results of products that read a slice of a node's parameter: ``id -> (node, elements read, elements
        #: of the parameter, result)``, summed until the whole parameter is read (o_proj head by head)
        self._partials: dict[int, tuple[str, int, int, torch.Tensor]] = {}
        #: results of products that read some of a node's output features (a column slice of its weight, whole
        #: along what the product sums over: Gemma 3n's per-layer projection computed per layer): node -> ``(first
        #: element read, elements read, elements of the parameter, result)``, joined once the forward is over
        self._slices: dict[str, list[tuple[int, int, int, torch.Tensor]]] = {}
        #: id of a partial result above that is such a slice -> its first element
        self._slice_at: dict[int, int] = {}
        #: a product waiting for its bias, split along its output features before the bias is added (``q, k, v =
        #: (x @ W_qkv).split(d, -1)``, then ``q + b_q``): ``id(piece) -> (node, first feature, piece)``; each piece's
        #: value (its bias added, or as read) in ``_piece_values[node]`` until all the product's features are in
        self._pieces: dict[int, tuple[str, int, torch.Tensor]] = {}
        self._piece_values: dict[str, tuple[int, dict[int, torch.Tensor]]] = {}
        #: node -> the share of its parameter its recorded value read (below 1: part of the weight skipped)
        self.shares: dict[str, float] = {}
        #: node -> ``(reduction, parts)`` when its partial products were stacked and reduced otherwise than
        #: summed (``torch.stack(parts).mean(0)``: row-parallel shards averaged)
        self.reductions: dict[str, tuple[str, int]] = {}
        #: stacked partial products of one node covering its whole weight: ``id -> (node, parts, stacked)``
        self._stacked: dict[int, tuple[str, int, torch.Tensor]] = {}
        self._chunked: set[str] = set()
        #: the last few ``t * c`` of a tensor of heads and a scalar: ``id(out) -> (out, t, redo the scaling)``
        self._scaled: dict[int, tuple[weakref.ref, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = {}
        #: the input of the first statistic (mean square, mean, variance) since a norm's weight was applied
        self._statistic: torch.Tensor | None = None
        #: ``(node, w * x, x)``: a norm's weight applied before any statistic, not recorded yet: a statistic of
        #: it and a product with a factor per row make the norm's output (``w x / rms(w x)``), anything else
        #: reads ``w * x`` as it is (:meth:`_weighted_read`)
        self._weighted: tuple[str, torch.Tensor, torch.Tensor] | None = None
        self.record, self.block, self.params, self.record_param = record, block, params, record_param
        #: the routing of the running MoE block (``moe() -> (path, TopK) | None``), when ours has one
        self.routing = RoutingCapture(record, moe) if moe is not None else None
        #: the parameters read in functions, and their rearranged copies (TransformerLens' W_Q for F.linear)
        self.followed = Followed(params)
        #: the biases ours adds after such an op (``x @ W + b``), and the results waiting for theirs
        self.biases = Followed(biases or {})
        # and the nodes whose reference module has a bias ours' alignment gave no parameter for (a bias
        # cut in another layout than its weight matches nothing): a bias-like vector ours adds next is theirs
        #: the vectors ours multiplies such a result by, its module's own scale (``(x @ W) * s``: Dory's head)
        self.scales = Followed(scales or {})
        #: the parameters holding a checkpoint vector in another shape (a grouped norm's ``(streams, hidden)``
        #: gain): a norm's weight, read as a vector is
        self.vectors = Followed(vectors or {})
        self._biased = {n for n in self.biases.by_storage.values() if n} | set(expects_bias)
        self._biased |= {n for n in self.scales.by_storage.values() if n}
        #: norms whose reference module multiplies its output by a gate it is given (Qwen3-Next's gated RMSNorm,
        #: ``norm(x) * w * silu(z)``): ours' product with the weight waits for that gate as for a bias
        self._gated = set(gated)
        self._biased |= self._gated
        self._unbiased: dict[int, tuple[str, torch.Tensor]] = {}
        #: a product waiting for its bias whose einsum result does not lead with its input's axes: ``id -> how it
        #: reads as a linear's output`` (:class:`_AsLinear`), applied to it once its bias is added
        self._reordered: dict[int, tuple[torch.Tensor, _AsLinear]] = {}
        #: a product waiting for its bias that ours added to another tensor first (the residual): ``id(sum) ->
        #: the product``, recorded with the bias if the sum's next add is that bias
        self._carried: dict[int, torch.Tensor] = {}
        #: results of products that keep an axis of the weight (``einsum("bnsh,nhd->bnsd", ctx, W_O)``: one
        #: output per head), ``id -> (node, that axis in the result, result)``, until the model sums it
        self._per_axis: dict[int, tuple[str, int, torch.Tensor]] = {}
        #: node -> ours' module recording it by its hook, and the running modules: its weight read inside it
        #: is its own forward (the hook records that), outside it a function of another module's
        self.owners, self.running = owners if owners is not None else ({}, lambda: [])
        #: blocks whose probabilities were recorded in this call: their next product is the context
        self._after_probs: set[str] = set()
        #: per block, ``(latest, product)``: ``q @ k^T`` not yet recorded as the scores, followed through
        #: what the model does to it (a mask); a scaling by a scalar on the way gives the scores (that
        #: scaling of the unmasked product), the softmax without one the product itself
        self._pending: dict[str, Pending] = {}
        #: per block, the (q_len, k_len) of its ``q @ k^T`` not yet multiplied with the values
        self._scored: dict[str, tuple[int, ...]] = {}
        #: per block, the last products ``(out, q part, k part^T)`` contracting a part of each head (MLA's
        #: ``q_nope @ k_nope^T`` and ``q_rope @ k_rope^T``): two of them summed are its ``q @ k^T``
        self._split: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        #: blocks whose ``q @ k^T`` was such a sum: their values may have a width of their own (``v_head_dim``)
        self._split_scored: set[str] = set()
        #: per norm node, the slices of its weight vector read so far: storage offset -> (output, its input)
        self._vector_slices: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._weighted is not None and any(a is self._weighted[1] for a in args):
            normalised, normed = self._weighted_read(func, args, kwargs)
            if normalised:
                return normed
        if func is SDPA:
            return self._sdpa(args, kwargs)
        if self._per_axis:
            held = next((a for a in args if isinstance(a, torch.Tensor) and id(a) in self._per_axis), None)
            if held is not None:
                return self._summed(held, func, args, kwargs)
        if self._pieces:
            handled, out = self._piece_read(func, args, kwargs)
            if handled:
                return out
        if self._unbiased:
            handled, args, out = self._bias(func, args, kwargs)
            if handled:
                return out
        name = op_name(func)
        if name in ("cat", "concat", "concatenate") and args and isinstance(args[0], (list, tuple)):
            out = func(*args, **kwargs)
            parts = [t for t in args[0] if isinstance(t, torch.Tensor) and self._partial(t) is not None]
            if parts and len(parts) == len(args[0]) and len({self._partials[id(t)][0] for t in parts}) == 1:
                # products over slices of one weight's output rows, joined (a vocabulary-parallel head)
                joined_node, whole = self._partials[id(parts[0])][0], self._partials[id(parts[0])][2]
                read = sum(self._partials.pop(id(t))[1] for t in parts)
                for t in parts:
                    self._slice_at.pop(id(t), None)
                if read >= whole:
                    return self.record_param(joined_node, out)
                self._partials[id(out)] = (joined_node, read, whole, out)
                return out
            self.joined(list(args[0]), out)
            return out
        derived = self.followed.derived_from(func, args) if self.params else None
        if derived is not None:
            out = func(*args, **kwargs)  # a weight computed from a parameter (a norm's 1 + w): still that parameter
            if isinstance(out, torch.Tensor):
                self.followed.keep(out, derived)
            return out
        if name in PRODUCT_NAMES:
            self._statistic = None  # a statistic before a product (an activation's square) is no norm's input
        if self.params and self._statistic is None and name in STATISTIC_NAMES and _normalisable(args):
            self._statistic = args[0]  # a norm computed in functions: what it normalises
        if self.params and name in NORM_WEIGHT_NAMES:  # a norm's weight vector applied outside its module
            # F.layer_norm / F.rms_norm hand their weight and bias to __torch_function__ as keywords
            operands = (*args, *kwargs.values())
            node = self._param_node(func, operands, vector=True)
            weight = next((t for t in operands if self._another_weight(t, node)), None) if node is not None else None
            if weight is not None and name in ("mul", "__mul__", "__rmul__"):
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.shape == weight.shape:
                    # a norm's gain folded into the next projection's weight at call time (``(g * n) W = n (g W)``):
                    # that weight in another form, whose product is its node; the norm's own output is never computed
                    self.followed.keep(out, weight)
                    self.record_param(node, None)
                return out
            if node is not None:
                out = func(*args, **kwargs)
                sliced = self._vector_slice(operands, node, out)
                if sliced is not None:
                    return sliced
                if self._statistic is None and name in ("mul", "__mul__", "__rmul__") and isinstance(out, torch.Tensor):
                    # the weight applied before any statistic: the norm may normalise ``w * x`` next
                    self._weighted = (node, out, next(a for a in args if isinstance(a, torch.Tensor) and a is not None))
                    return out
                x, self._statistic = self._statistic, None
                if (
                    x is not None
                    and isinstance(out, torch.Tensor)
                    and x.shape == out.shape
                    and _normalised(
                        x, out, [t for t in operands if isinstance(t, torch.Tensor) and t.shape != out.shape]
                    )
                ):
                    self.hold_input(node, x)  # its input, for the hints (a module's would be kept)
                if node in self._biased and not any(self.biases.of(t) == node for t in operands):
                    self._unbiased[id(out)] = (node, out)  # a LayerNorm's shift comes next: x_hat * w + b
                    return out
                return self.record_param(node, out)
        if self.params and name in LOOKUPS and args:  # a table read by a lookup outside its module
            node = self._lookup_node(func, name, args)
            if node is not None and (self.lookups is None or node in self.lookups):
                ids = args[0] if name == "embedding" else args[1]
                return self.record_param(node, func(*args, **kwargs), True, ids=ids)
            table = args[0]
            if name == "__getitem__" and len(args) > 1 and isinstance(args[1], slice) and self.lookups:
                # a learned position table read as a block of rows (``wpe[:seq]``, ``wpe[-seq:]``): its lookup
                node = self.followed.of(table) if isinstance(table, torch.Tensor) and table.dim() == 2 else None
                if node is not None and node in self.lookups:
                    return self.record_param(node, func(*args, **kwargs), True)
            if _picks_rows(name, args) and self.followed.of(args[0]) is not None:
                out = func(*args, **kwargs)  # rows of a projection's weight picked by index: a part of it
                if isinstance(out, torch.Tensor):
                    self.followed.keep(out, args[0], part=out.numel() < args[0].numel())
                return out
        if self._stacked and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self._stacked:
            return self._reduced(func, args, kwargs)
        if self._partials:
            if name == "stack" and args and isinstance(args[0], (list, tuple)):
                stacked = self._stack(func, args, kwargs)
                if stacked is not None:
                    return stacked
            if name in ("add", "__add__", "__radd__", "add_", "__iadd__"):
                handled, out = self._partial_sum(func, args, kwargs)
                if handled:
                    return out
            else:
                self._settle([a for a in args if isinstance(a, torch.Tensor) and self._partial(a) is not None])
        if self.params and name in PRODUCT_NAMES:  # addmm too: TransformerLens' batch_addmm(b_in, W_in, x)
            node = self._param_node(func, args)
            if node is not None and (node.partition("[")[0] in self.absorbed or self._absorbs(node, func, args)):
                return func(*args, **kwargs)  # a product of a weight ours absorbed elsewhere: no node's value
            if node is not None:
                out = func(*args, **kwargs)
                operands = args[1:] if op_name(func) == "einsum" else args
                part = self._part_read(operands, out)
                node = node if part is None else part[0]
                x = next((t for t in operands if isinstance(t, torch.Tensor) and self.followed.of(t) is None), None)
                if x is not None:  # what the product reads besides the weight: the node's input, for the hints
                    self.hold_input(node, x)
                reordered = _AsLinear.of(func, args, self.followed, out)
                if part is not None and reordered is not None:  # a block of a stacked weight, batch not first
                    if node in self._biased and not any(self.biases.of(t) is not None for t in operands):
                        # its bias (a row of a stacked bias: GPT-1's port's b_qkv[layer]) comes next
                        self._unbiased[id(out)], self._part_rows[id(out)] = (node, out), part[1]
                        self._reordered[id(out)] = (out, reordered)
                        return out
                    seen = reordered.view(out)
                    kept = self.record_param(node, seen, part=part[1])
                    return out if kept is seen else reordered.back(kept)
                if part is not None:  # one node's block of a fused weight: that node alone
                    if node in self._biased and not any(self.biases.of(t) is not None for t in operands):
                        self._unbiased[id(out)], self._part_rows[id(out)] = (node, out), part[1]
                        return out
                    return self.record_param(node, out, part=part[1])
                read, whole = self._share(node, operands)
                if read < whole:  # a slice of the weight (o_proj head by head): the node is the sum of such
                    self._partials[id(out)] = (node, read, whole, out)
                    offset = self._output_slice(func, args, node)
                    if offset is not None:  # or some of its output features: such slices side by side (joined)
                        self._slice_at[id(out)] = offset
                    return out
                kept = _kept_weight_axis(func, args, self.followed) if isinstance(out, torch.Tensor) else None
                if kept is not None:  # per head, a head axis of the weight kept: the node is its sum over it
                    self._per_axis[id(out)] = (node, kept, out)
                    return out
                if node in self._biased and not any(self.biases.of(t) == node for t in operands):
                    self._unbiased[id(out)] = (node, out)  # its bias comes next, as the reference's module adds it
                    if reordered is not None:
                        self._reordered[id(out)] = (out, reordered)
                    return out
                if reordered is not None:
                    seen = reordered.view(out)
                    kept = self.record_param(node, seen)
                    return out if kept is seen else reordered.back(kept)
                return self.record_param(node, out)
        if args and op_name(func) in REARRANGES and (self.followed.of(args[0]) or self.biases.of(args[0])):
            out = func(*args, **kwargs)
            self.followed.follow(func, args, out)
            self.biases.follow(func, args, out)
            return out
        if self.routing is not None:
            handled, out = self.routing(func, args, kwargs)
            if handled:
                return out
        running = self.block()
        if running is None:
            return func(*args, **kwargs)
        block, head_dim, heads = running
        if block in self._chunked:
            return func(*args, **kwargs)
        product_op = func in PRODUCTS or func is EINSUM
        pending = self._pending.get(block)
        if (
            pending is not None
            and not product_op  # a product reading it is the values' (a softmax written as exp / sum)
            and any(a is pending.latest for a in args if isinstance(a, torch.Tensor))
            and not _template_only(func, args, pending.latest)
        ):
            self._pending.pop(block)
            latest, product = pending.latest, pending.product
            scaling = IN_PLACE_SCALINGS.get(func, func)  # recorded out of place: the model's own op runs after
            if scaling in SCALINGS and len(args) == 2 and _scalar(args[1] if args[0] is latest else args[0]):
                self._record_in("scores", scaling(*[product if a is latest else a for a in args], **kwargs), pending)
            elif func in SOFTMAXES:
                self._record_in("scores", product, pending)
            else:  # a mask, or a softmax written out (max, exp, sum): follow its result
                if product is latest and op_name(func).endswith("_"):  # masked_fill_ on the product itself
                    pending.product = product.clone()  # the scores are the unmasked product, as the reference's
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    pending.latest = out
                self._pending[block] = pending  # a max's (values, indices): still the same pending product
                return out
        if func in SOFTMAXES:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.dim() >= 3:
                # the probabilities are what multiplies the values: recorded there, after what the model
                # does to the softmax's output first (a cast, a dropout, a mask applied after it)
                self._after_probs.add(block)
            return out
        if func in PRODUCTS and len(args) >= 2:
            return self._product(block, head_dim, heads, func, args, kwargs)
        if func in BADDBMMS:
            return self._baddbmm(block, head_dim, heads, func, args, kwargs)
        if func is EINSUM and args and isinstance(args[0], str):
            return self._einsum(block, head_dim, func, args, kwargs)
        if op_name(func) in ("add", "__add__", "__radd__") and block in self._split and len(args) == 2:
            joined = self._split_scores(block, head_dim, func, args, kwargs)
            if joined is not None:
                return joined
        out = func(*args, **kwargs)
        if func in SCALINGS:
            self._note_scaling(func, args, out)
        elif op_name(func) in REARRANGES and args and isinstance(args[0], torch.Tensor):
            self._carry_scaling(func, args, kwargs, out)
        return out

    def _split_scores(self, block: str, head_dim: int, func, args, kwargs) -> torch.Tensor | None:
        """``q_a @ k_a^T + q_b @ k_b^T`` whose widths make a head: the block's ``q @ k^T`` with ``q_rot`` and
        ``k_rot`` each head's two parts concatenated (MLA's scores over its pass-through and its rotated dims,
        computed apart: the part whose keys one head shares, the decoupled RoPE key, last, as Transformers'
        ``cat(q_pass, q_rot)``), keys expanded to the queries' heads; None for any other sum."""
        held = {id(out): (out, a, b) for out, a, b in self._split[block]}
        parts = [held.get(id(t)) for t in args]
        if any(p is None or p[0] is not t for p, t in zip(parts, args, strict=True)):
            return None
        first, second = cast(list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], parts)
        if first[1].shape[-1] + second[1].shape[-1] != head_dim or first[0].shape != second[0].shape:
            return None
        if first[2].shape[1] == 1 and second[2].shape[1] != 1:  # the shared key's part is the rotated one
            first, second = second, first
        del self._split[block]
        heads = first[1].shape[1]
        q = torch.cat((first[1], second[1]), -1)
        k = torch.cat([t.expand(-1, heads, -1, -1).transpose(-2, -1) for t in (first[2], second[2])], -1)
        q_seen, k_seen = self.record("q_rot", q), self.record("k_rot", k)
        out = func(*args, **kwargs)
        if q_seen is not q or k_seen is not k:  # isolated mode: the reference's q and k, their product
            out = (q_seen @ k_seen.transpose(-2, -1)).to(out.dtype)
        self._scored[block] = tuple(out.shape[-2:])
        self._pending[block] = Pending(out, out, Heads(out, 0).canonical)
        self._split_scored.add(block)
        return out

    def _carry_scaling(self, func, args, kwargs, out) -> None:
        """A scaled query rearranged after its scaling (JAX's ``(q * c).reshape(B, T, K, G, H)``): the same
        rearrangement of the query before it, with that scaling, so q_rot is still read before it."""
        held = self._scaled.get(id(args[0]))
        if held is None or held[0]() is not args[0] or not isinstance(out, torch.Tensor):
            return
        self._scaled[id(out)] = (weakref.ref(out), func(held[1], *args[1:], **kwargs), held[2])

    def _note_scaling(self, func, args, out) -> None:
        """Remember ``out = t * c`` (or ``t / c``) for a tensor ``t`` of heads and a scalar ``c``: queries the
        model scales before ``q @ k^T`` (the softmax scale applied to q) are ``q_rot`` before the scaling."""
        if len(args) != 2 or not isinstance(out, torch.Tensor) or out.dim() < 3:
            return
        first = isinstance(args[0], torch.Tensor) and args[0].dim() >= 3 and _scalar(args[1])
        second = isinstance(args[1], torch.Tensor) and args[1].dim() >= 3 and _scalar(args[0])
        if not (first or second):
            return
        t, c = (args[0], args[1]) if first else (args[1], args[0])
        self._scaled[id(out)] = (weakref.ref(out), t, (lambda x: func(x, c)) if first else (lambda x: func(c, x)))
        while len(self._scaled) > 4:
            self._scaled.pop(next(iter(self._scaled)))

    def _unscaled(self, q: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """``(q before a scalar scaling the model applied to it last, that scaling)``, or ``(q, identity)``."""
        held = self._scaled.get(id(q))
        if held is not None and held[0]() is q:
            return held[1], held[2]
        return q, lambda x: x

    def _record_in(self, kind: str, t: torch.Tensor, pending: Pending) -> torch.Tensor:
        value, back = pending.canonical(t)
        recorded = self.record(kind, value)
        return t if recorded is value else back(recorded)

    def _values_product(self, block: str, head_dim: int, qk: tuple[int, ...], dim: int) -> bool:
        """Whether a product of a ``qk``-shaped ``(q_len, k_len)`` operand with values of ``dim`` per head
        is this block's product of its probabilities with its values: after its softmax, or after its
        ``q @ k^T`` when the softmax is written out (exp over a sum), the probabilities then of the
        scores' shape."""
        if dim != head_dim:  # values of their own width (MLA's v_head_dim) after split scores' softmax only
            return block in self._split_scored and block in self._after_probs and self._scored.get(block, qk) == qk
        return block in self._after_probs or self._scored.get(block) == qk

    def _before_values(self, block: str) -> None:
        """The product with the values is next: scores still pending (no scaling, no torch softmax: the
        softmax written out) are the ``q @ k^T`` product itself."""
        self._after_probs.discard(block)
        self._scored.pop(block, None)
        pending = self._pending.pop(block, None)
        if pending is not None:
            self._record_in("scores", pending.product, pending)

    def _lookup_node(self, func, name: str, args) -> str | None:
        """The node of the table this lookup reads at token ids (``F.embedding(ids, W)``, ``W[ids]``), not a
        slice of a product's weight (``W[:, h]``)."""
        ids, table = (
            (args[0], args[1] if len(args) > 1 else None)
            if name == "embedding"
            else (
                args[1] if len(args) > 1 else None,
                args[0],
            )
        )
        if name != "embedding" and not (
            isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dtype != torch.bool
        ):
            return None
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            return None
        return self._param_node(func, (table,))

    def _share(self, node: str, operands) -> tuple[int, int]:
        """``(elements read, elements of the parameter)`` of the operand holding ``node``'s parameter."""
        for t in operands:
            if isinstance(t, torch.Tensor) and self.followed.of(t) == node:
                return t.numel(), self.followed.size_of(t)
        return 1, 1

    def _partial_sum(self, func, args, kwargs) -> tuple[bool, object]:
        """An add of products that each read a slice of one parameter (and scalars, ``sum()``'s 0): the
        sum of all of them, once it has read the whole parameter, is the node; ``(handled, result)``."""
        parts = [a for a in args if isinstance(a, torch.Tensor) and self._partial(a) is not None]
        if not parts:
            return False, None
        # (an all-zero tensor is an accumulator's start, ``torch.zeros_like(x)``, as sum()'s 0 is)
        others = [
            a
            for a in args
            if isinstance(a, torch.Tensor) and self._partial(a) is None and a.numel() > 1 and bool(a.any())
        ]
        nodes = {self._partials[id(a)][0] for a in parts}
        # the node's own bias added to a slice's product (each row-parallel shard adding it): still the sum
        biases = [a for a in others if len(nodes) == 1 and self.biases.of(a) in nodes]
        if len(others) > len(biases):  # the sum so far is read by something else: it is what ours computes
            self._settle(parts)
            return False, None
        out = func(*args, **kwargs)
        if len(nodes) != 1:
            return True, out
        node, whole = nodes.pop(), self._partials[id(parts[0])][2]
        read = sum(self._partials.pop(id(a))[1] for a in parts)
        if read >= whole:
            if node in self._biased:  # its bias may come next (again, when a slice added it already)
                self._unbiased[id(out)] = (node, out)
                return True, out
            return True, self.record_param(node, out)
        self._partials[id(out)] = (node, read, whole, out)
        if len(parts) == 1 and id(parts[0]) in self._slice_at:  # a slice's product plus its bias: still that slice
            self._slice_at[id(out)] = self._slice_at.pop(id(parts[0]))
        return True, out

    def _stack(self, func, args, kwargs):
        """``torch.stack`` of partial products of one node that read its whole weight (row-parallel shards
        stacked for one reduction): followed until reduced along the stacked axis; None otherwise."""
        items = list(args[0])
        parts = [a for a in items if isinstance(a, torch.Tensor) and self._partial(a) is not None]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        nodes = {self._partials[id(a)][0] for a in parts}
        if not parts or len(parts) != len(items) or len(nodes) != 1 or dim != 0:
            return None
        read, whole = sum(self._partials[id(a)][1] for a in parts), self._partials[id(parts[0])][2]
        if read < whole:
            return None
        for a in parts:
            self._partials.pop(id(a))
        out = func(*args, **kwargs)
        self._stacked[id(out)] = (nodes.pop(), len(parts), out)
        return out

    def _reduced(self, func, args, kwargs):
        """A reduction of stacked partial products over the stacked axis: the node (a sum is the product
        over the whole weight; a mean is recorded as such for the hints)."""
        node, parts, _ = self._stacked.pop(id(args[0]))
        out = func(*args, **kwargs)
        name = op_name(func)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if name in ("sum", "mean") and dim in (0, -args[0].dim()) and isinstance(out, torch.Tensor):
            if name == "mean":
                self.reductions[node] = ("mean", parts)
            if node in self._biased:
                self._unbiased[id(out)] = (node, out)
                return out
            return self.record_param(node, out)
        return out

    def _settle(self, parts) -> None:
        """Partial sums read by another op than the sum: each recorded as its node, with the share of the
        parameter it read (``Trace.extras["read_share"]``: a loop that skips part of a weight)."""
        for t in parts:
            node, read, whole, _ = self._partials.pop(id(t))
            offset = self._slice_at.pop(id(t), None)
            if offset is not None:  # some of the node's output features, used apart: joined once the forward is over
                self._slices.setdefault(node, []).append((offset, read, whole, t))
                continue
            try:
                self.record_param(node, t)
            except FeaturesMismatch:
                continue  # a cut of the node's output features, not a partial sum: no value of the node
            self.shares[node] = read / whole

    def _output_slice(self, func, args, node: str) -> int | None:
        """The first storage element of ``node``'s 2-D weight this product reads when it reads a slice of the
        weight's output features, whole along the axis the product sums over (``x @ W[:, a:b]``, ``F.linear(x,
        W[a:b])``); None for any other read (a slice of its input features: o_proj head by head)."""
        name = op_name(func)
        slot = {"matmul": (1, 0), "__matmul__": (1, 0), "mm": (1, 0), "linear": (1, 1)}.get(name)
        if slot is None or len(args) <= slot[0]:
            return None
        t = args[slot[0]]
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or self.followed.of(t) != node:
            return None
        if slot == (1, 0) and t.stride(0) == 1 and t.stride(1) == t.shape[0]:  # x @ W[a:b].T: W's rows a:b
            t = t.T
            slot = (1, 1)
        if t.stride(1) != 1:
            return None
        row = t.stride(0)  # a view of a row-major weight: its rows' length, and so its row count
        if row <= 0 or self.followed.size_of(t) % row:
            return None
        full = (self.followed.size_of(t) // row, row)[slot[1]]
        return int(t.storage_offset()) if t.shape[slot[1]] == full else None

    def _join_slices(self) -> None:
        """Each node computed as slices of its output features that ours never joins (a model's own ``cat`` of
        them is the node: a vocabulary-parallel head): the slices side by side, in the order they sit in its
        weight, recorded as the node once together they read the whole weight."""
        for node, held in self._slices.items():
            # the same features read again are another call's (Gemma 4's shared-KV layers running an earlier
            # layer's projection again), not the other slices: each call's slices joined apart, in turn
            calls: list[list[tuple]] = []
            for h in held:
                call = next((c for c in calls if all(o[0] != h[0] for o in c)), None)
                if call is None:
                    calls.append(call := [])
                call.append(h)
            for call in calls:
                read, whole = sum(h[1] for h in call), call[0][2]
                outs = [h[3] for h in sorted(call, key=lambda h: h[0])]
                if read == whole and len({o.shape[:-1] for o in outs}) == 1:
                    self.record_param(node, torch.cat(outs, dim=-1))
        self._slices.clear()

    def _piece_read(self, func, args, kwargs) -> tuple[bool, object]:
        """An op reading a piece of a split product waiting for its bias (:attr:`_pieces`): the piece plus a bias is
        its value (``(True, sum)``); any other op takes the piece as it is (``(False, None)``, the op runs on). Once
        every piece has its value, the pieces side by side are the node's."""
        held = [a for a in args if isinstance(a, torch.Tensor) and id(a) in self._pieces]
        if not held:
            return False, None
        piece = held[0]
        node, offset, _ = self._pieces.pop(id(piece))
        others = [a for a in args if a is not piece]
        biased = op_name(func) in ("add", "__add__", "__radd__") and any(self.biases.of(a) is not None for a in others)
        out = func(*args, **kwargs) if biased else None
        total, values = self._piece_values.get(node, (0, {}))
        values[offset] = out if isinstance(out, torch.Tensor) and out.shape == piece.shape else piece
        if self._join_pieces(node, total, values):
            self._piece_values.pop(node, None)
        return biased, out

    def _join_pieces(self, node: str, total: int, values: dict[int, torch.Tensor]) -> bool:
        """The pieces side by side recorded as ``node`` once they cover the product's ``total`` features; whether
        they did."""
        if not values or sum(v.shape[-1] for v in values.values()) < total:
            return False
        self._recorded(node, torch.cat([values[o] for o in sorted(values)], dim=-1))
        return True

    def settle_all(self) -> None:
        """Every partial sum still followed, and every result still waiting for a bias, recorded as its
        node (the forward is over)."""
        self._settle([held[3] for held in list(self._partials.values())])
        self._join_slices()
        for key, (node, out) in list(self._unbiased.items()):
            rows = self._part_rows.pop(key, None)
            reordered = self._read_as_linear(out)
            seen = out if reordered is None else reordered.view(out)
            self.record_param(node, seen, **({} if rows is None else {"part": rows}))
        self._unbiased.clear()
        self._reordered.clear()
        self._carried.clear()
        for node, offset, piece in list(self._pieces.values()):  # pieces nothing read after the split: as they are
            self._piece_values.get(node, (0, {}))[1].setdefault(offset, piece)
        for node, (total, values) in self._piece_values.items():
            self._join_pieces(node, total, values)
        self._pieces.clear()
        self._piece_values.clear()
        if self._weighted is not None:  # a norm's weight applied last, nothing read it after
            self.record_param(self._weighted[0], self._weighted[1])
            self._weighted = None

    def _part_read(self, operands, out) -> tuple[str, Callable] | None:
        """``(node, its rows)`` when a product's weight operand is exactly the block of a fused parameter that
        holds one node's rows (:attr:`parts`) and its output has that many features; else None."""
        if not self.parts or not isinstance(out, torch.Tensor):
            return None
        for t in operands:
            if isinstance(t, torch.Tensor) and self.followed.of(t) is not None and t.numel():
                for block, node, alone in self.parts.get(t.untyped_storage().data_ptr(), []):
                    if not block.read_by(t):
                        continue
                    rows = getattr(alone, "rows", None)  # a product keeping its heads apart: heads * head_dim
                    features = {out.shape[-1]} | ({out.shape[1] * out.shape[3]} if out.dim() == 4 else set())
                    if rows is None or len(rows) in features:
                        return node, alone
        return None

    def _partial(self, t: torch.Tensor):
        held = self._partials.get(id(t))
        return held if held is not None and held[3] is t else None

    def _summed(self, held: torch.Tensor, func, args, kwargs):
        """An op reading a per-axis product (:func:`_kept_weight_axis`): its sum over that axis is the node
        (then waiting for its bias, as a product's result does); an element-wise op before the sum (a bias
        added per head) is followed; anything else records the product as it is."""
        node, axis, _ = self._per_axis.pop(id(held))
        out = func(*args, **kwargs)
        name = op_name(func)
        dim = kwargs.get("dim", args[1] if len(args) > 1 and name == "sum" else None)
        if name == "sum" and dim in (axis, axis - held.dim()) and isinstance(out, torch.Tensor):
            if node in self._biased:
                self._unbiased[id(out)] = (node, out)
                return out
            return self.record_param(node, out)
        elementwise = name in ("add", "__add__", "__radd__", "mul", "__mul__")
        if elementwise and isinstance(out, torch.Tensor) and out.shape == held.shape:
            self._per_axis[id(out)] = (node, axis, out)
            return out
        self.record_param(node, held)
        return out

    def _recorded(self, node: str, value: torch.Tensor, **part) -> torch.Tensor:
        """``value`` recorded as ``node`` (what :attr:`record_param` returns), or as it is when its output features
        are not the node's (a product over a scaled slice of a fused weight, ``x @ (W[:, :d] * s)``, plus a slice of
        the fused bias): no value of the node, left to what else records it."""
        try:
            return self.record_param(node, value, **part)
        except FeaturesMismatch:
            return value

    def _bias(self, func, args, kwargs) -> tuple[bool, tuple, object]:
        """A result waiting for its bias, read by this op: recorded with the bias when the op adds it
        (``(True, args, sum)``), else as it is before the op reads it (in isolated mode the op then reads
        the reference's value: ``(False, args, None)``)."""
        waiting = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and id(a) in self._unbiased]
        if not waiting:
            return False, args, None
        i, result = waiting[0]
        if i == 0 and op_name(func) in _CASTS and id(result) not in self._part_rows and id(result) not in self._carried:
            out = func(*args, **kwargs)  # a product cast before its bias (a bfloat16 head's output made float32)
            if isinstance(out, torch.Tensor) and out.shape == result.shape and self._read_as_linear(result) is None:
                self._unbiased[id(out)] = (self._unbiased.pop(id(result))[0], out)
                return True, args, out
            return False, args, None  # the op runs again as the caller's: a cast has no side effect
        if (
            i == 0
            and op_name(func) in _SPLITS
            and id(result) not in self._part_rows
            and id(result) not in self._carried
        ):
            out = func(*args, **kwargs)
            offsets = _feature_offsets(result, out)
            if offsets is not None and self._read_as_linear(result) is None:
                node, _ = self._unbiased.pop(id(result))
                for piece, offset in zip(out, offsets):
                    self._pieces[id(piece)] = (node, offset, piece)
                self._piece_values[node] = (result.shape[-1], {})
                return True, args, out
            return False, args, None  # the op runs again as the caller's: a split has no side effect
        node, product = self._unbiased.pop(id(result))
        carried = self._carried.pop(id(result), None)
        rows = self._part_rows.pop(id(result), None)
        part = {} if rows is None else {"part": rows}
        others = [a for j, a in enumerate(args) if j != i]
        adds = op_name(func) in ("add", "__add__", "__radd__")
        bias = next((a for a in others if self.biases.of(a) is not None), None) if adds else None
        reordered = self._read_as_linear(result)
        if reordered is not None and carried is None:  # (an einsum's result read as a linear's: bsh,hcnd->cbsnd)
            biased = func(*args, **kwargs) if bias is not None else None  # the op runs once: here, or the caller's
            seen = reordered.view(biased if biased is not None else result)
            kept = self._recorded(node, seen, **part)
            if biased is not None:
                return True, args, biased if kept is seen else reordered.back(kept)
            value = result if kept is seen else reordered.back(kept)
            return False, tuple(value if j == i else a for j, a in enumerate(args)), None
        scaled = op_name(func) in ("mul", "__mul__", "__rmul__") and any(self.scales.of(a) == node for a in others)
        if scaled and carried is None:  # the module's own scale after its product: the module's output
            return True, args, self._recorded(node, func(*args, **kwargs), **part)
        gates = (
            node in self._gated
            and op_name(func) in ("mul", "__mul__", "__rmul__")
            and any(
                isinstance(a, torch.Tensor) and a.shape == result.shape and self.followed.of(a) is None for a in others
            )
        )
        if gates and carried is None:  # a gated norm's gate after its weight: the module's output
            return True, args, self._recorded(node, func(*args, **kwargs), **part)
        if bias is not None and carried is not None:  # ``h + x @ W + b``: the product plus its bias, h apart
            self._recorded(node, carried + bias, **part)
            return True, args, func(*args, **kwargs)
        if bias is not None:
            # its bias, or another node's (a loader that gave this layer another layer's bias): what ours adds
            return True, args, self._recorded(node, func(*args, **kwargs), **part)
        if (
            adds
            and carried is None
            and len(others) == 1
            and isinstance(others[0], torch.Tensor)
            and others[0].shape == result.shape
        ):  # the product added to the residual first (``h + x @ W + b``): its bias may come next, to the sum
            out = func(*args, **kwargs)
            self._unbiased[id(out)], self._carried[id(out)] = (node, product), result
            if rows is not None:
                self._part_rows[id(out)] = rows
            return True, args, out
        value = self._recorded(node, product if carried is not None else result, **part)
        if carried is not None:  # a sum with the residual is no node's value: nothing replaced in it
            return False, args, None
        return False, tuple(value if j == i else a for j, a in enumerate(args)), None

    def _read_as_linear(self, result: torch.Tensor) -> _AsLinear | None:
        """How ``result`` (a product waiting for its bias) reads as a linear's output, when an einsum's layout
        needs it (:attr:`_reordered`); None otherwise."""
        held = self._reordered.pop(id(result), None)
        return held[1] if held is not None and held[0] is result else None

    def _vector_slice(self, operands, node: str, out) -> torch.Tensor | None:
        """``out`` when it applies a slice of ``node``'s weight vector (``x_h * r * w[:H]`` beside ``x_e * r * w[H:]``:
        one norm over two halves never concatenated): held until slices covering the vector are read, then their
        outputs, in the vector's order, are the node (their inputs its input). None for a read of the whole."""
        t = next(
            (t for t in operands if isinstance(t, torch.Tensor) and t.dim() == 1 and self.followed.of(t) == node), None
        )
        if t is None or not isinstance(out, torch.Tensor) or out.shape[-1] != t.numel():
            return None
        whole = self.widths.get(node, 0)
        if t.numel() >= whole or not t.is_contiguous():
            return None
        x, self._statistic = self._statistic, None
        held = self._vector_slices.setdefault(node, {})
        held[int(t.storage_offset())] = (out, x if x is not None and x.shape == out.shape else None)
        if sum(o.shape[-1] for o, _ in held.values()) < whole:
            return out
        del self._vector_slices[node]
        parts = [held[k] for k in sorted(held)]
        try:
            joined = torch.cat([o for o, _ in parts], -1)
        except RuntimeError:  # slices of differently shaped reads: no one node
            return out
        inputs = [x for _, x in parts if x is not None]
        if len(inputs) == len(parts):
            self.hold_input(node, torch.cat(inputs, -1))
        self.record_param(node, joined)
        return out

    def _another_weight(self, t, node: str) -> bool:
        """Whether ``t`` is a matrix of another node's parameter (or its rearranged copy) than ``node``'s."""
        return isinstance(t, torch.Tensor) and t.dim() >= 2 and self.followed.of(t) not in (None, node)

    def _param_node(self, func, args, vector: bool = False) -> str | None:
        """The node whose parameter this op reads (``vector``: only a 1-D one, a norm's weight, read as it
        is), unless the module holding it is running (its own hook records the node)."""
        operands = args[1:] if op_name(func) == "einsum" else args
        if vector:  # a norm's weight vector, or that vector viewed per head (``w.view(heads, head_dim)``)
            operands = [
                t
                for t in operands
                if isinstance(t, torch.Tensor)
                and (t.dim() == 1 or self.followed.rearranged_vector(t) or self.vectors.of(t) is not None)
            ]
        node = next((node for t in operands if (node := self.followed.of(t)) is not None), None)
        owner = self.owners.get(node) if node is not None else None
        return None if owner is not None and owner in self.running() else node

    def _sdpa(self, args, kwargs):
        call = _sdpa_arguments(args, kwargs)
        base, scaling = self._unscaled(call["query"])  # queries the model scaled before the call: q_rot is before
        q, k = self.record("q_rot", base), self.record("k_rot", call["key"])
        q = call["query"] if q is base else scaling(q)
        scores, probs = sdpa_scores_probs(q, k, call)
        self.record("scores", scores)
        self.record("probs", probs)
        rest = {n: v for n, v in call.items() if n not in ("query", "key")}
        return self.record("context", SDPA(q, k, **rest))

    def _product(self, block: str, head_dim: int, heads: int, func, args, kwargs):
        a, b = args[0], args[1]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 3 and b.dim() >= 3):
            return func(*args, **kwargs)
        folded = Heads(a, heads) if a.dim() == b.dim() == 3 else Heads(a, 0)  # bmm over (batch * heads)
        if a.shape[-1] == b.shape[-2] and self._values_product(block, head_dim, tuple(a.shape[-2:]), b.shape[-1]):
            self._before_values(block)  # probabilities times values
            pv = folded.view(a)
            probs = self.record("probs", pv)
            out = func(a if probs is pv else folded.back(probs), b, *args[2:], **kwargs)
            cv = folded.view(out)
            context = self.record("context", cv)
            return out if context is cv else folded.back(context)
        if self._part_of_head(block, head_dim, heads, a, b):
            out = func(*args, **kwargs)
            self._split[block] = [*self._split.get(block, [])[-1:], (out, a, b)]
            return out
        if (a.shape[-1] == head_dim and b.shape[-2] == head_dim) or self._other_head_dim(block, head_dim, heads, a, b):
            # q @ k^T: both operands carry head_dim (k transposed), the result is (..., q_len, k_len)
            if self._chunk_of(block, a, b):
                return func(*args, **kwargs)
            kt = b.transpose(-2, -1)
            base, scaling = self._unscaled(a)  # the softmax scale applied to q first: q_rot is before it
            qv, kv = folded.view(base), folded.view(kt)
            q, k = self.record("q_rot", qv), self.record("k_rot", kv)
            if q is qv and k is kv:
                out = func(*args, **kwargs)
            else:
                out = func(scaling(folded.back(q)), folded.back(k).transpose(-2, -1), *args[2:], **kwargs)
            self._scored[block] = tuple(out.shape[-2:])
            self._pending[block] = Pending(out, out, folded.canonical)
            return out
        return func(*args, **kwargs)

    def _part_of_head(self, block: str, head_dim: int, heads: int, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether ``a @ b`` may be one of two products that sum to the block's ``q @ k^T`` (see
        :meth:`_split_scores`): 4-D, the block's heads (the keys' one head broadcast), contracting fewer
        dims than a head's, before the block's scores."""
        d = a.shape[-1]
        return (
            a.dim() == b.dim() == 4
            and 0 < d < head_dim
            and b.shape[-2] == d
            and block not in self._scored
            and a.shape[1] == heads
            and b.shape[1] in (1, heads)
        )

    def _other_head_dim(self, block: str, head_dim: int, heads: int, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether ``a @ b`` is the block's first ``q @ k^T`` with the heads cut to another head_dim (a port
        taking head_dim as hidden_size / num_heads where the config sets its own: Gemma): both operands
        4-D, contracting one width, q's heads times that width the reference's heads times head_dim (the
        same projection cut otherwise; MLA's partial products read a part of each head and stay out)."""
        d = a.shape[-1]
        return (
            a.dim() == b.dim() == 4
            and d != head_dim
            and b.shape[-2] == d
            and block not in self._scored
            and a.shape[1] * d == heads * head_dim
            and a.shape[1] != heads
        )

    def _baddbmm(self, block: str, head_dim: int, heads: int, func, args, kwargs):
        """``beta * bias + alpha * (q @ k^T)`` in one op (BLOOM's ALiBi): ``q_rot`` and ``k_rot`` are its
        batches, ``scores`` is ``alpha * q @ k^T`` before the bias (what a port computes as its scaled
        product, adding the bias after). The op's own result is returned unless isolated mode replaced
        one of them (then it is recomputed from the replacements)."""
        names = ("input", "batch1", "batch2")
        given = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        bias, a, b = given.get("input"), given.get("batch1"), given.get("batch2")
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (a, b)) or bias is None:
            return func(*args, **kwargs)
        a, b = cast(torch.Tensor, a), cast(torch.Tensor, b)
        if a.shape[-1] != head_dim or b.shape[-2] != head_dim or self._chunk_of(block, a, b):
            return func(*args, **kwargs)
        folded = Heads(a, heads)
        qv, kv = folded.view(a), folded.view(b.transpose(-2, -1))
        q, k = self.record("q_rot", qv), self.record("k_rot", kv)
        a2 = a if q is qv else folded.back(q)
        b2 = b if k is kv else folded.back(k).transpose(-2, -1)
        product = torch.bmm(a2, b2) * alpha
        sv = folded.view(product)
        scores = self.record("scores", sv)
        self._scored[block] = tuple(product.shape[-2:])
        if q is qv and k is kv and scores is sv:
            return func(*args, **kwargs)
        return bias * beta + (product if scores is sv else folded.back(scores))

    def _weighted_read(self, func, args, kwargs) -> tuple[bool, torch.Tensor | None]:
        """An op reading ``w * x`` held by :attr:`_weighted`: a statistic of it leaves it held; a product or a
        division by a factor per row (``w x * rsqrt(mean((w x)^2) + eps)``) is the norm's output, recorded as
        the node (its input ``x``); anything else records ``w * x`` itself first (a plain scale by a vector)."""
        assert self._weighted is not None
        node, held, x = self._weighted
        name = op_name(func)
        if name in STATISTIC_NAMES:
            return True, func(*args, **kwargs)
        other = next((a for a in args if isinstance(a, torch.Tensor) and a is not held), None)
        per_row = other is not None and other.dim() == held.dim() and other.shape[-1] == 1 and held.shape[-1] > 1
        self._weighted = None
        if per_row and name in ("mul", "__mul__", "__rmul__", "div", "__truediv__"):
            out = func(*args, **kwargs)
            self._statistic = None  # the statistic of w * x was this norm's own
            self.hold_input(node, x)
            return True, self.record_param(node, out)
        recorded = self.record_param(node, held)
        if recorded is not held:  # isolated mode: the reference's value replaces ours' before it is read
            args = tuple(recorded if a is held else a for a in args)
            return True, func(*args, **kwargs)
        return False, None

    def _absorbs(self, node: str, func, args) -> bool:
        """Whether this product reads ``node``'s weight (the parameter itself) with its input features kept in
        the result, contracting its output features instead: the weight absorbed into another operand
        (DeepSeek's MLA computed as ``q_nope @ W_UK`` against the compressed keys), so ours never computes
        the reference's projection. Then the projection's nodes are forgotten and no longer recorded, and
        its running attention block is left alone (its q, k and scores are in another space)."""
        axis = _kept_input_axis(func, args, self.input_axes)
        if axis is None:
            return False
        module = node.partition("[")[0]
        equation = f" ({args[0]})" if op_name(func) == "einsum" else ""
        self.absorbed[module] = (
            f"ours reads {module.rsplit('.', 1)[-1]}'s weight along its output features{equation}, keeping its "
            "input features: the weight is absorbed into another product (MLA's q @ W_UK), so ours never "
            "computes this projection; not judged, nor its attention block's internals; the nodes after them are"
        )
        self.forget(module)
        running = self.block()
        if running is not None:
            self._leave_alone(running[0])
        return True

    def _leave_alone(self, block: str) -> None:
        """Retract what was captured for ``block``'s attention internals and capture nothing more of it."""
        self._chunked.add(block)
        self._pending.pop(block, None)
        self._after_probs.discard(block)
        self._scored.pop(block, None)
        for kind in ("scores", "probs", "context", "q_rot", "k_rot"):
            self.retract(kind)

    def _chunk_of(self, block: str, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether this ``q @ k^T`` reads queries a product of this block read before in this forward
        (attention computed over chunks of the keys: flash-style, an online softmax), or the same keys
        (over chunks of the queries: memory-efficient attention). Its scores, probabilities and context are
        then partial: what was captured for the block is retracted (those nodes stay untapped, not failed)
        and nothing more is captured for it."""
        seen = self._queries.setdefault(block, [])
        keys = self._keys.setdefault(block, [])
        storage, layout = k.untyped_storage(), (k.storage_offset(), tuple(k.shape), tuple(k.stride()))
        if any(ref() is q for ref in seen) or any(ref() is storage and view == layout for ref, view in keys):
            self._leave_alone(block)
            return True
        seen.append(weakref.ref(q))
        keys.append((weakref.ref(storage), layout))
        return False

    def _einsum(self, block: str, head_dim: int, func, args, kwargs):
        """An ``einsum`` of attention: ``q . k`` over ``head_dim`` or ``probs . values`` over the keys, in any
        spelling (``bhqd,bkhd->bhqk``, or with heads kept as (KV heads, group): ``bgrqd,bgkd->bgrqk``)."""
        equation, operands = args[0], args[1:]
        parts = _einsum_parts(equation) if len(operands) == 2 else None
        if parts is None or not all(isinstance(t, torch.Tensor) for t in operands):
            return func(*args, **kwargs)
        a_letters, b_letters, out = parts
        a, b = operands
        contracted = [c for c in a_letters if c in b_letters and c not in out]
        shared = [c for c in out if c in a_letters and c in b_letters]
        only_a = [c for c in out if c in a_letters and c not in b_letters]
        only_b = [c for c in out if c in b_letters and c not in a_letters]
        plain = len(set(a_letters)) == len(a_letters) and len(set(b_letters)) == len(b_letters)
        if not (plain and len(contracted) == 1 and shared and only_a and len(only_b) == 1):
            return func(*args, **kwargs)
        if len(out) != len(shared) + len(only_a) + 1 or len(shared) + len(only_a) < 3:
            return func(*args, **kwargs)  # a letter summed away besides the contraction: no attention product
        batch, kv, c = shared[:1], shared[1:], contracted[0]
        # probabilities keep their query axis next to the key axis the product sums over (``bngqk``), whatever
        # order the output lists them in (``bqngd``)
        before_keys = a_letters[a_letters.index(c) - 1] if a_letters.index(c) > 0 else ""
        query = _as_many(a, a_letters, only_a, a.shape[a_letters.index(c)]) or (
            [before_keys] if before_keys in only_a else only_a[-1:]
        )
        qk = (a.shape[a_letters.index(query[0])], a.shape[a_letters.index(c)])
        values = self._values_product(block, head_dim, qk, b.shape[b_letters.index(only_b[0])])
        if not values:  # q . k: the query axis, as many as the keys (JAX's ``BTKGH,BSKH->BTKGS``: T, not G)
            query = _as_many(a, a_letters, only_a, b.shape[b_letters.index(only_b[0])]) or only_a[-1:]
        heads = kv + [x for x in only_a if x not in query]  # as repeat_kv numbers the query heads: KV head, group
        if values:
            self._before_values(block)  # probabilities . values
            pc = Canonical(a, a_letters, [batch, heads, query, [c]])
            probs = self.record("probs", pc.value)
            result = func(equation, a if probs is pc.value else pc.back(probs), b, **kwargs)
            cc = Canonical(result, out, [batch, heads, query, only_b])
            context = self.record("context", cc.value)
            return result if context is cc.value else cc.back(context)
        if a.shape[a_letters.index(c)] != head_dim:
            return func(*args, **kwargs)
        if self._chunk_of(block, a, b):
            return func(*args, **kwargs)
        base, scaling = self._unscaled(a)  # the softmax scale applied to q first: q_rot is before it
        qc = Canonical(base, a_letters, [batch, heads, query, [c]])
        kc = Canonical(b, b_letters, [batch, kv, only_b, [c]])
        q, k = self.record("q_rot", qc.value), self.record("k_rot", kc.value)
        if q is qc.value and k is kc.value:  # nothing substituted: the model's own product, as it wrote it
            product = func(*args, **kwargs)
        else:
            product = func(equation, scaling(qc.back(q)), kc.back(k), **kwargs)
        groups = [batch, heads, query, only_b]
        self._scored[block] = tuple(Canonical(product, out, groups).value.shape[-2:])
        self._pending[block] = Pending(product, product, lambda t: _canonical_of(t, out, groups))
        return product


def _as_many(t: torch.Tensor, letters: str, among: list[str], keys: int) -> list[str]:
    """The one axis of ``among`` (``t``'s letters) with as many entries as there are keys: the query axis of
    a self-attention product whose heads are kept as (KV heads, group), the group next to the head dim
    (``BTKGH``); empty where none or several are (a decode step, as many heads as tokens)."""
    sized = [x for x in among if t.shape[letters.index(x)] == keys]
    return sized if len(sized) == 1 else []


def _canonical_of(t: torch.Tensor, letters: str, groups: list[list[str]]):
    canonical = Canonical(t, letters, groups)
    return canonical.value, canonical.back
