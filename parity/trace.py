"""Record named intermediates of a model with forward hooks, detached to CPU, in execution order.

A point is ``(node name, module path)``; a path ending in ``@input`` records the module's first
input through a forward pre-hook, ``@<name>`` the argument of its ``forward`` called ``name``
(positional or keyword: Gemma 4's decoder layers receive ``per_layer_input`` beside the hidden
states), any other path its output. Tensors computed outside modules
are recorded through taps: our models' ``Tap`` modules (ordinary hooks), :func:`tap` calls in a
user's forward (recorded under the module that is running), and, for Transformers,
:mod:`parity.hf_capture` writing into the active trace.

A trace holds its tensors in a :class:`TensorStore`: in memory up to a byte budget, past it in
safetensors files in a temporary folder, read back in chunks or memory-mapped (so a trace costs
disk, not memory, beyond its budget, whatever the depth). A ``sink`` sees every tensor as it is produced and
may consume it instead of storing it: that is how ours is compared against the stored reference
node by node while it runs, keeping only what a report needs.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
import math
import os
import shutil
import struct
import weakref
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .errors import ParityError

_ACTIVE: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("parity_active_recording", default=None)


def _replace_first_tensor(value, new: torch.Tensor):
    """``value`` with its first tensor replaced by ``new`` (cast to that tensor's dtype and device)."""
    if isinstance(value, torch.Tensor):
        return new.to(dtype=value.dtype, device=value.device)
    if isinstance(value, (tuple, list)):
        items = list(value)
        for i, item in enumerate(items):
            if _first_tensor(item) is not None:
                items[i] = _replace_first_tensor(item, new)
                return type(value)(items)
    return value


def _argument_slot(module: nn.Module, name: str, args: tuple, kwargs: dict) -> tuple[str, int | str] | None:
    """Where the ``forward`` argument ``name`` of this call is: ``("kwargs", name)``, ``("args", index)``,
    or None when the call leaves it at its default."""
    if name in kwargs:
        return "kwargs", name
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if name in positional and positional.index(name) < len(args):
        return "args", positional.index(name)
    return None


def _item(value, n: int | None):
    """``value`` itself (``n`` None), or the ``n``-th item of a tuple/list output (``path#n``)."""
    if n is None:
        return value
    if isinstance(value, (tuple, list)):
        return value[n] if n < len(value) else None
    return value if n == 0 else None


def _replace_item(value, n: int | None, new: torch.Tensor):
    """``value`` with its ``n``-th item (or, ``n`` None, its first tensor) replaced by ``new``."""
    if n is None or not isinstance(value, (tuple, list)):
        return _replace_first_tensor(value, new)
    items = list(value)
    items[n] = _replace_first_tensor(items[n], new)
    return type(value)(items)


def split_path(path: str) -> tuple[str, bool, int | None]:
    """``(module path, is_input, output item)`` of a node path: ``a.b@input`` -> ``("a.b", True, None)``,
    ``a.b#2`` -> ``("a.b", False, 2)`` (the module's third output), ``a.b`` -> ``("a.b", False, None)``.
    A named forward argument, ``a.b@name``, comes back whole (see :func:`recording`)."""
    if path.endswith("@input"):
        return path[: -len("@input")], True, None
    head, sep, tail = path.rpartition("#")
    if sep and tail.isdigit():
        return head, False, int(tail)
    return path, False, None


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_tensor(list(value.values()))
    if hasattr(value, "to_tuple"):  # Transformers ModelOutput
        return _first_tensor(value.to_tuple())
    return None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one intra-op thread. Recording and comparing are many memory-bound calls;
    with several threads each call waits until every thread has a core, which on a machine whose
    cores are busy with other work costs more than the call (measured: a comparison 1.1 to 5x
    slower with 2 threads than with 1 on 2 loaded cores). The forward passes keep every thread."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: safetensors dtype codes of the dtypes a trace may hold
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
#: bytes written per call when spilling (a bounded slice of a large tensor at a time)
_WRITE = 64 << 20


def write_safetensors(path: Path, name: str, tensor: torch.Tensor) -> int:
    """One CPU tensor to ``path`` in the safetensors format, written from the tensor's own memory
    (no serialised copy of it in memory). Returns the byte offset of its data in the file."""
    tensor = tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    header = json.dumps({name: {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                                "data_offsets": [0, nbytes]}}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, so it maps back as any dtype
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if nbytes else b""
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        view = memoryview(raw)
        for start in range(0, nbytes, _WRITE):
            fh.write(view[start : start + _WRITE])
    return 8 + len(header)


def map_safetensors(path: Path, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """The tensor at byte ``offset`` of a file written by :func:`write_safetensors`, memory-mapped
    (copy-on-write: pages are read when touched and freed when the tensor is dropped)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_file(str(path), shared=False, size=offset + nbytes, dtype=torch.uint8)
    return raw[offset:].view(dtype).view(shape)


class Spill:
    """A memory budget shared by the stores of one trace, and the temporary folder that holds what
    does not fit (``$TMPDIR/parity-trace-<host>-<pid>-*``, removed on :meth:`close`, at garbage
    collection, on SIGTERM, or by the next run when a killed process left it).

    ``budget``: bytes of tensors kept in memory; None keeps everything in memory.
    """

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.in_memory = 0
        self.on_disk = 0
        #: bytes ever written to disk (a spilled tensor deleted later still counts)
        self.written = 0
        self.folder: Path | None = None
        self._count = 0
        self._finalizer = None
        #: id of a stored item (a tensor in memory or a file) -> names holding it, across the stores
        self.holders: dict[int, int] = {}

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or self.in_memory + nbytes <= self.budget

    def new_file(self) -> Path:
        if self.folder is None:
            from .report.atomic import temporary_folder

            self.folder = temporary_folder("parity-trace-")
            self._finalizer = weakref.finalize(self, _remove_folder, self.folder)
        self._count += 1
        return self.folder / f"{self._count:06d}.safetensors"

    def close(self) -> None:
        """Remove the spill folder (the trace's spilled tensors are gone after this)."""
        if self._finalizer is not None:
            self._finalizer()
        self.folder = None


def _remove_folder(folder: Path) -> None:
    from .report.atomic import done

    shutil.rmtree(folder, ignore_errors=True)
    done(folder)


@dataclass(frozen=True)
class _OnDisk:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SpilledTensor:
    """A tensor on disk, read a chunk at a time into one reused buffer (the page cache holds the
    file; nothing of it is mapped into this process), or mapped whole with :meth:`load`."""

    def __init__(self, item: _OnDisk):
        self.item = item
        self.shape = torch.Size(item.shape)
        self.dtype = item.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def load(self) -> torch.Tensor:
        item = self.item
        return map_safetensors(item.path, item.dtype, item.shape, item.offset)

    def chunks(self, n: int) -> Iterator[torch.Tensor]:
        """Consecutive 1-D slices of at most ``n`` elements; each is overwritten by the next."""
        total = self.numel()
        if total == 0:
            return
        buffer = torch.empty(min(n, total), dtype=self.dtype)
        raw = buffer.view(torch.uint8).numpy()
        size = buffer.element_size()
        with open(self.item.path, "rb") as fh:
            fh.seek(self.item.offset)
            for start in range(0, total, n):
                count = min(n, total - start)
                view = memoryview(raw)[: count * size]
                while view:
                    got = fh.readinto(view)
                    if not got:
                        raise OSError(f"{self.item.path} ends early")
                    view = view[got:]
                yield buffer[:count]


class TensorStore(MutableMapping):
    """Tensors by name in insertion order, in memory while the :class:`Spill` budget lasts and in
    safetensors files past it. Reading a spilled tensor maps it again (nothing is cached, so a trace
    read node by node never holds more than the node being read); :meth:`lazy` reads it in chunks."""

    def __init__(self, spill: Spill | None = None):
        self.spill = spill if spill is not None else Spill()
        self._items: dict[str, torch.Tensor | _OnDisk] = {}

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Store a copy of ``tensor`` (on the CPU), or write it to disk when it does not fit."""
        nbytes = tensor.numel() * tensor.element_size()
        if name in self._items:
            del self[name]
        if self.spill.fits(nbytes):
            self._hold(name, tensor.to("cpu", copy=True))
            self.spill.in_memory += nbytes
            return
        tensor = tensor.to("cpu")
        path = self.spill.new_file()
        offset = write_safetensors(path, "tensor", tensor)
        self._hold(name, _OnDisk(path, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        self.spill.on_disk += nbytes
        self.spill.written += nbytes

    def alias(self, name: str, store: TensorStore, source: str) -> None:
        """Store under ``name`` what ``store`` (sharing this store's Spill) holds as ``source``: no copy."""
        if name in self._items:
            del self[name]
        self._hold(name, store._items[source])

    def _hold(self, name: str, item) -> None:
        self._items[name] = item
        self.spill.holders[id(item)] = self.spill.holders.get(id(item), 0) + 1

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self.put(name, tensor)

    def __getitem__(self, name: str) -> torch.Tensor:
        item = self._items[name]
        if isinstance(item, _OnDisk):
            return map_safetensors(item.path, item.dtype, item.shape, item.offset)
        return item

    def __delitem__(self, name: str) -> None:
        item = self._items.pop(name)
        left = self.spill.holders.pop(id(item), 1) - 1
        if left:  # another name still holds it
            self.spill.holders[id(item)] = left
            return
        if isinstance(item, _OnDisk):
            self.spill.on_disk -= item.nbytes
            with contextlib.suppress(OSError):
                os.unlink(item.path)
        else:
            self.spill.in_memory -= item.numel() * item.element_size()

    def __contains__(self, name) -> bool:
        return name in self._items

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def spilled(self, name: str) -> bool:
        return isinstance(self._items.get(name), _OnDisk)

    def lazy(self, name: str, default=None) -> torch.Tensor | SpilledTensor | None:
        """The tensor if it is in memory, a :class:`SpilledTensor` (read by chunks) if on disk."""
        item = self._items.get(name)
        if item is None:
            return default
        return SpilledTensor(item) if isinstance(item, _OnDisk) else item


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place op), None for an inference-mode tensor
    (which has none: it is then never taken as unchanged)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


class OnCpu(dict):
    """A dict of tensors held where they are (a weight on a GPU, by reference) that hands out CPU
    copies: only the few a diagnosis reads are ever copied."""

    def __getitem__(self, key):
        return super().__getitem__(key).to("cpu")

    def get(self, key, default=None):
        return self[key] if key in self else default  # noqa: SIM401 (dict.get would skip the CPU copy)


@dataclass
class Trace:
    """Recorded tensors by node name, in the order they were produced.

    A module that runs more than once in one forward keeps its first tensor; ``calls`` counts
    every call so a repeated module is visible. ``inputs`` (first input) and ``weights``/``biases``
    (the module's own parameters, referenced, not copied) of selected nodes are kept for diagnosis
    only, never compared (``weights``: 1-D and 2-D ones; ``biases``: of projections and of norms); so
    are ``extras``, records a capture function leaves for a node (one expert's weights and tokens,
    see :mod:`parity.hf_capture`). ``tensors`` and ``inputs`` share one :class:`Spill` (``spill``):
    past its budget they live on disk. ``sink(name, tensor) -> bool``, when set, sees each node's
    first tensor before it is stored and returns True when it consumed it (nothing is stored); it
    may fill ``results`` (the node's comparison, made as it was produced) and ``watched``.
    """

    tensors: MutableMapping[str, torch.Tensor] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    wanted: frozenset[str] = frozenset()
    inputs: MutableMapping[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=OnCpu)
    biases: dict[str, torch.Tensor] = field(default_factory=OnCpu)
    extras: dict[str, object] = field(default_factory=dict)
    spill: Spill | None = None
    sink: Callable[[str, torch.Tensor], bool] | None = None
    #: node name -> NodeResult, for nodes compared while they were produced
    results: dict = field(default_factory=dict)
    #: what a sink computed from tensors it did not keep (``{output node: logits effect}``)
    watched: dict = field(default_factory=dict)
    #: module inputs are held by reference until :meth:`keep_input` or :meth:`drop_input` (a sink
    #: that keeps only a failing node's input copies that one alone)
    defer_inputs: bool = False
    pending: dict = field(default_factory=dict, repr=False)
    #: id of a live tensor already stored -> (weakref, version, stored in inputs?, name): the same
    #: unchanged tensor recorded twice (q/k/v's shared input, a node that is the next one's input) is
    #: stored once
    _stored: dict = field(default_factory=dict, repr=False)

    @classmethod
    def spilling(cls, budget: int | None, **kwargs) -> Trace:
        """An empty trace whose tensors and inputs spill to disk past ``budget`` bytes."""
        spill = Spill(budget)
        return cls(tensors=TensorStore(spill), inputs=TensorStore(spill), spill=spill, **kwargs)

    def add(self, name: str, value, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        tensor = _first_tensor(value)
        if tensor is None:
            return
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] > 1 or name in self.tensors:
            return
        live = tensor
        tensor = tensor.detach()
        if transform is not None:
            tensor = live = transform(tensor)
        with one_thread():
            if self.sink is not None and self.sink(name, tensor):
                return
            self.keep(name, live)

    def keep(self, name: str, tensor: torch.Tensor, inputs: bool = False) -> None:
        """Store a CPU copy of ``tensor`` (in ``inputs`` with ``inputs=True``); a tensor this trace
        already stored, unchanged since (same object, same version), is stored once."""
        store = self.inputs if inputs else self.tensors
        if not isinstance(store, TensorStore):
            store[name] = tensor.detach().to("cpu", copy=True)
            return
        seen = self._stored.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] is not None and seen[1] == _version(tensor):
            source = self.inputs if seen[2] else self.tensors
            if seen[3] in source:
                store.alias(name, source, seen[3])
                return
        store.put(name, tensor.detach())
        self._stored[id(tensor)] = (weakref.ref(tensor), _version(tensor), inputs, name)

    def hold_input(self, name: str, tensor: torch.Tensor) -> None:
        """A module input for diagnosis: copied now, or held by reference when inputs are deferred."""
        if self.defer_inputs:
            self.pending[name] = (tensor, _version(tensor))
        else:
            with one_thread():
                self.keep(name, tensor, inputs=True)

    def keep_input(self, name: str) -> None:
        """Copy a deferred input now, if its tensor was not changed in place since it was held."""
        held = self.pending.pop(name, None)
        if held is not None and held[1] is not None and _version(held[0]) == held[1]:
            self.keep(name, held[0], inputs=True)

    def drop_input(self, name: str) -> None:
        self.pending.pop(name, None)
        if name in self.inputs:
            del self.inputs[name]

    @property
    def order(self) -> list[str]:
        return list(self.tensors)

    @property
    def spilled_bytes(self) -> int:
        """Bytes this trace wrote to disk."""
        return self.spill.written if self.spill is not None else 0

    def close(self) -> None:
        """Free the disk this trace spilled to."""
        self.pending.clear()
        if self.spill is not None:
            self.spill.close()


@dataclass
class _Recording:
    trace: Trace
    replacement: Callable[[str, object], torch.Tensor | None]
    #: module paths of the modules running now (innermost last), for :func:`tap`
    stack: list[str] = field(default_factory=list)
    #: functional node name -> canonical node name, for taps recorded in a user's model
    tap_names: dict[str, str] = field(default_factory=dict)
    #: node name -> transform into the reference's layout (applied to tapped tensors too)
    transforms: dict = field(default_factory=dict)


def active_trace() -> Trace | None:
    """The trace being recorded in this context, if any (used by :mod:`parity.hf_capture`)."""
    rec = _ACTIVE.get()
    return rec.trace if rec is not None else None


def running_module() -> str | None:
    """The path of the innermost module running now in the model being recorded, when the recording
    keeps the module stack (``taps``, or ``module_stack=True``); None otherwise. Used by
    :mod:`parity.hf_kernels` to name what a function computes after the module that called it."""
    rec = _ACTIVE.get()
    return rec.stack[-1] if rec is not None and rec.stack else None


def tap(tensor: torch.Tensor, name: str, *, layout: str | None = None) -> torch.Tensor:
    """Name a tensor computed outside any module, inside a model's forward: ``q = parity.tap(q, "q_rot")``.

    Recorded as ``<path of the module that is running>.<name>`` while parity traces the model; in
    isolated mode the reference's tensor for that node comes back instead, so the rest of the
    forward continues from it. Free when nothing is being traced: returns ``tensor`` unchanged.
    ``layout`` ("bhsd", "bshd" or "bsf": batch, heads, seq, head_dim in that order, or heads
    flattened) says how a ``q_rot``/``k_rot``/``context`` tensor is laid out; without it the layout is
    read from the shape (a 4-D shape whose sequence length equals the head count cannot tell, and is
    read as this tap's earlier calls were, else as ``(batch, heads, seq, head_dim)``). Raises
    :class:`parity.ParityError` for another layout name, a shape that cannot hold the declared
    layout, or ``layout`` on a tap other than those three.
    """
    rec = _ACTIVE.get()
    if rec is None or not rec.tap_names:
        return tensor
    node = None
    for path in reversed(rec.stack):  # the innermost running module first, then its parents
        node = rec.tap_names.get(f"{path}.{name}" if path else name)
        if node is not None:
            break
    if node is None:
        return tensor
    transform = rec.transforms.get(node)
    if layout is not None:
        if not hasattr(transform, "with_layout"):
            raise ParityError(f"parity.tap(..., {name!r}, layout={layout!r}): layout applies to q_rot, k_rot and context taps only")
        transform = transform.with_layout(layout)
    rec.trace.add(node, tensor, transform)
    new = rec.replacement(node, tensor, transform if layout is not None else None)
    return tensor if new is None else new.to(dtype=tensor.dtype, device=tensor.device)


def _module_stack_hooks(model: nn.Module, rec: _Recording) -> list:
    """Hooks that keep ``rec.stack`` = the paths of the modules running now (for :func:`tap`)."""
    handles = []
    for path, module in model.named_modules():
        def push(mod, args, _p=path):
            rec.stack.append(_p)

        def pop(mod, args, output, _p=path):
            if rec.stack and rec.stack[-1] == _p:
                rec.stack.pop()

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    return handles


@contextlib.contextmanager
def recording(
    model: nn.Module,
    points: Sequence[tuple[str, str]],
    transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    captured: Sequence[str] = (),
    substitute: Trace | None = None,
    inverses: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    keep_inputs: frozenset[str] = frozenset(),
    taps: dict[str, str] | None = None,
    into: Trace | None = None,
    module_stack: bool = False,
) -> Iterator[Trace]:
    """Hook ``model`` for the duration of the block and yield the Trace being filled.

    ``points``: ``(node name, module path)`` pairs; a path that does not resolve records nothing
    (compare reports that node as missing), so a partial model can still be compared. Node names
    that are not module paths (attention internals of a Transformers model) go in ``captured``:
    they are ``wanted`` and filled by a capture function through :func:`active_trace`. ``taps``:
    ``{path as tap() computes it: node name}`` for functional nodes of a user's model.

    ``substitute`` (isolated mode): after a node's own tensor is recorded, the model continues
    with ``substitute``'s tensor for that node instead (outputs through the forward hook's return
    value, ``@input`` nodes through the pre-hook's), so every later node reads the reference's
    values and is judged on its own error. A node with a ``transform`` is substituted only if
    ``inverses`` maps the reference tensor back into our layout (``inverse(ref, ours) -> ours``:
    a fused projection writes the reference's part into our tensor), and only where the shapes agree.
    Only a module's first call is substituted. ``keep_inputs``: node names whose module input (and
    1-D or 2-D weight and bias, by reference) are also kept for diagnosis. ``into``: the (empty) Trace to
    fill, e.g. one that spills (:meth:`Trace.spilling`), has a sink, or whose ``add`` keeps statistics
    instead of tensors (:mod:`parity.traces`); by default a new in-memory one. ``module_stack``: keep the
    paths of the running modules (:func:`running_module`) even without ``taps``.
    """
    transforms, inverses = transforms or {}, inverses or {}
    trace = Trace() if into is None else into
    trace.wanted = frozenset([name for name, _ in points] + list(captured) + list((taps or {}).values()))

    def replacement(name: str, current, declared=None) -> torch.Tensor | None:
        """The reference's tensor for ``name`` in ``current``'s layout; ``declared``: a tap's own
        transform (its declared layout), whose inverse then replaces the node's."""
        if substitute is None or trace.calls.get(name, 0) != 1 or name not in substitute.tensors:
            return None
        ref = substitute.tensors[name]
        mine = _first_tensor(current)
        if mine is None:
            return None
        if name in transforms:
            inverse = getattr(declared, "inverse", None) or inverses.get(name)
            ref = inverse(ref, mine) if inverse is not None else None
        if ref is None or ref.shape != mine.shape:
            return None  # a node of another shape is reported as such; ours keeps its own tensor
        # the values are the reference's, the memory layout ours' (a view's gaps included): CPU kernels
        # take another path, with another rounding, for another layout (a sigmoid of a strided view
        # differs by an ulp from the same values packed), and isolated mode must change values only
        try:
            return torch.empty_strided(mine.shape, mine.stride(), dtype=mine.dtype, device=mine.device).copy_(ref)
        except RuntimeError:  # an expanded (overlapping) view cannot be written: packed is the best
            return torch.empty_like(mine, memory_format=torch.contiguous_format).copy_(ref)

    rec = _Recording(trace, replacement, tap_names=dict(taps or {}), transforms=transforms)
    handles = _module_stack_hooks(model, rec) if taps or module_stack else []
    modules = dict(model.named_modules())
    for name, path in points:
        module_path, is_input, item = split_path(path)
        module_path, at, argument = module_path.partition("@")  # a named forward argument: a.b@name
        module = modules.get(module_path)
        if module is None:
            continue
        transform = transforms.get(name)
        if is_input:

            def pre_hook(mod, args, kwargs, _name=name, _t=transform):
                trace.add(_name, args if args else kwargs, _t)
                new = replacement(_name, args if args else kwargs)
                if new is None:
                    return None
                if args:
                    return _replace_first_tensor(args, new), kwargs
                key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
                return args, {**kwargs, key: _replace_first_tensor(kwargs[key], new)}

            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        elif at:

            def argument_hook(mod, args, kwargs, _name=name, _t=transform, _arg=argument):
                slot = _argument_slot(mod, _arg, args, kwargs)
                if slot is None:
                    return None
                where, key = slot
                value = kwargs[key] if where == "kwargs" else args[key]
                trace.add(_name, value, _t)
                new = replacement(_name, value)
                if new is None:
                    return None
                if where == "kwargs":
                    return args, {**kwargs, key: _replace_first_tensor(value, new)}
                return (*args[:key], _replace_first_tensor(value, new), *args[key + 1:]), kwargs

            handles.append(module.register_forward_pre_hook(argument_hook, with_kwargs=True))
        else:

            def hook(mod, args, output, _name=name, _t=transform, _n=item):
                trace.add(_name, _item(output, _n), _t)
                new = replacement(_name, _item(output, _n))
                return None if new is None else _replace_item(output, _n, new)

            handles.append(module.register_forward_hook(hook))
            if name in keep_inputs:

                def keep(mod, args, kwargs, _name=name):
                    tensor = _first_tensor(args if args else kwargs)
                    if tensor is not None and not trace.calls.get(_name) and _name not in trace.inputs:
                        trace.hold_input(_name, tensor)
                        weight, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)
                        if isinstance(weight, torch.Tensor) and weight.dim() in (1, 2):  # linear or norm weight
                            trace.weights[_name] = weight.detach()
                        if isinstance(bias, torch.Tensor):  # a projection's, or a LayerNorm's shift
                            trace.biases[_name] = bias.detach()

                handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    token = _ACTIVE.set(rec)
    try:
        yield trace
    finally:
        _ACTIVE.reset(token)
        for handle in handles:
            handle.remove()
