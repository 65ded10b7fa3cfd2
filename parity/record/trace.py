"""A Trace: the recorded tensors of one forward, by node name, in the order they were produced,
plus what diagnosis needs beside them (module inputs and weights of selected nodes)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import cast

import torch

from parity.record.store import OnCpu, Spill, TensorStore

#: ``Trace.extras`` key of the reference's one-element parameters and buffers by path (a constant
#: factor a hint can name: Gemma 4's ``layer_scalar``)
SCALARS = "reference scalars"


def first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return first_tensor(list(value.values()))
    if hasattr(value, "to_tuple"):  # Transformers ModelOutput
        return first_tensor(value.to_tuple())
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


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place op), None for an inference-mode tensor
    (which has none: it is then never taken as unchanged)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def later_call(name: str, call: int) -> str:
    """The node name of ``name``'s call number ``call`` (2 or more): a block run again in a loop, a shared module."""
    return f"{name} (call {call})"


#: :meth:`Trace._by_rows`'s answer while a per-row node still waits for rows
_PENDING = object()
#: prefix of a module input's key among the per-row parts (its output's key is the node's name)
_INPUT = "@input:"


@dataclass
class Trace:
    """Recorded tensors by node name, in the order they were produced.

    A module that runs more than once in one forward keeps its first tensor; ``calls`` counts
    every call so a repeated module is visible, and ``sequence`` lists every call in order. The later calls of
    the nodes in ``repeats`` (every node's with ``repeats=None``) are kept in ``later`` by :func:`later_call`
    name. ``inputs`` (first
    input) and ``weights``/``biases`` (the module's own parameters, referenced, not copied) of selected nodes are
    kept for diagnosis only, never compared (``weights``: 1-D and 2-D ones; ``biases``: of projections and of
    norms); so are ``extras``, records a capture function leaves for a node (one expert's weights and tokens,
    see :mod:`parity.record.hf_capture`). ``tensors`` and ``inputs`` share one :class:`Spill` (``spill``):
    past its budget they live on disk. ``sink(name, tensor) -> bool``, when set, sees each node's
    first tensor before it is stored and returns True when it consumed it (nothing is stored); it
    may fill ``results`` (the node's comparison, made as it was produced) and ``watched``.
    """

    tensors: MutableMapping[str, torch.Tensor] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    #: every call's node name, in the order they ran (a loop's count before a node's first call is evidence)
    sequence: list[str] = field(default_factory=list)
    #: nodes whose later calls are kept: None keeps every node's (the reference's side, which decides which
    #: nodes repeat), the empty set none
    repeats: frozenset[str] | None = frozenset()
    later: MutableMapping[str, torch.Tensor] = field(default_factory=dict)
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
    #: node -> how often ours read the node's parameter in functions after the node was recorded
    #: (a norm weight applied again elsewhere: a module's weights reused where another's belong)
    reads: dict[str, int] = field(default_factory=dict)
    #: ``live(name, tensor, transform)``, when set, sees each node's first tensor *before* it is detached
    #: (the backward check registers a gradient hook on it: :mod:`parity.run.backward`)
    live: Callable[[str, torch.Tensor, Callable | None], None] | None = None
    #: module inputs are held by reference until :meth:`keep_input` or :meth:`drop_input` (a sink
    #: that keeps only a failing node's input copies that one alone)
    defer_inputs: bool = False
    pending: dict = field(default_factory=dict, repr=False)
    #: id of a live tensor already stored -> (weakref, version, stored in inputs?, name): the same
    #: unchanged tensor recorded twice (q/k/v's shared input, a node that is the next one's input) is
    #: stored once
    _stored: dict = field(default_factory=dict, repr=False)
    #: ``(batch, seq)`` bool, the real tokens of a padded batch, set when tracing a user's model: a node whose
    #: module runs once per row on that row's real tokens alone (batch 1, a varlen loop) is assembled from
    #: its calls into the padded batch (:meth:`_by_rows`), pad positions zero
    rows: torch.Tensor | None = None
    #: node -> (its token axes, the calls so far, its transform), while a per-row node is assembled
    _row_parts: dict = field(default_factory=dict, repr=False)
    #: the first node assembled per row, and the row whose calls run now (see :meth:`_by_rows`)
    _row_leader: str | None = field(default=None, repr=False)
    _row_now: int = field(default=0, repr=False)
    #: nodes (and ``@input:`` module inputs) assembled from per-row calls: zeros at the padding positions
    assembled: set[str] = field(default_factory=set, repr=False)
    #: each node's calls in ``sequence`` so far (:meth:`ran`)
    _runs: dict[str, int] = field(default_factory=dict, repr=False)

    @classmethod
    def spilling(cls, budget: int | None, **kwargs) -> Trace:
        """An empty trace whose tensors and inputs spill to disk past ``budget`` bytes."""
        spill = Spill(budget)
        return cls(
            tensors=TensorStore(spill), inputs=TensorStore(spill), later=TensorStore(spill), spill=spill, **kwargs
        )

    def add(self, name: str, value, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        tensor = first_tensor(value)
        if tensor is None:
            return
        self.calls[name] = self.calls.get(name, 0) + 1
        self.ran(name)
        if self.rows is not None and name not in self.tensors and (self.calls[name] == 1 or name in self._row_parts):
            whole = self._by_rows(name, tensor, transform)
            if whole is _PENDING:
                return
            if whole is not None:
                tensor, self.calls[name] = whole, 1
        if self.calls[name] > 1 or name in self.tensors:
            if self.calls[name] > 1:
                self.keep_later(name, tensor, transform)
            return
        self._store(name, tensor, transform)

    def pass_over(self, name: str) -> None:
        """``name``'s turn came and went without its value (ours reads its parameter in a form that computes none):
        a parameter's later reads go to the nodes after it; nothing is stored, so the node is not judged."""
        self.calls[name] = self.calls.get(name, 0) + 1
        self.ran(name)

    def ran(self, name: str) -> None:
        """One more call of ``name`` in ``sequence`` (a module's, or a read again of the parameter of a node ours
        computes in functions)."""
        self.sequence.append(name)
        self._runs[name] = self._runs.get(name, 0) + 1

    def keep_later(self, name: str, value, transform: Callable | None = None) -> None:
        """A later call of ``name`` (its count in ``sequence`` numbers it), kept when ``repeats`` asks for it and
        the node is not assembled from calls per row: a module's hook calling again, or ours reading the
        parameter of a node it computes in functions again (:mod:`parity.record.hooks`)."""
        tensor = first_tensor(value)
        if tensor is None or (self.repeats is not None and name not in self.repeats):
            return
        if name in self.assembled or name in self._row_parts:
            return
        tensor = tensor.detach()
        if transform is not None:
            tensor = transform(tensor)
        key = later_call(name, self._runs.get(name, 0))
        if self.sink is not None and self.sink(key, tensor):
            return  # a sink that consumed it (a float64 run measuring each call's rounding)
        with one_thread():
            if isinstance(self.later, TensorStore):
                self.later.put(key, tensor)
            else:
                self.later[key] = tensor.to("cpu", copy=True)

    def _store(self, name: str, tensor: torch.Tensor, transform: Callable | None) -> None:
        if self.live is not None:
            self.live(name, tensor, transform)
        live = tensor
        tensor = tensor.detach()
        if transform is not None:
            tensor = live = transform(tensor)
        with one_thread():
            if self.sink is not None and self.sink(name, tensor):
                return
            self.keep(name, live)

    def recorded(self, name: str) -> bool:
        """``name`` recorded in this forward (a per-row node still waiting for rows is not yet)."""
        return bool(self.calls.get(name)) and name not in self._row_parts

    def _by_rows(self, name: str, tensor: torch.Tensor, transform: Callable | None):
        """The node assembled from per-row calls: :data:`_PENDING` while rows are missing, the ``(batch, ...)``
        tensor once every row ran, or None when this call is no row's (the first call decides: batch 1, and
        axes the length of row 0's real tokens, fewer than the sequence: queries, and keys too for scores; a
        broadcast ``(1, seq, ...)`` table is no row). The first node to run per row (the embedding) says which
        row runs now; a call that is not the running row's (the node recorded again within a row: a tap after
        the module's hook, a tied head's product) is left out, as a batched forward keeps a node's first call.
        A node whose rows never all ran is its first call (:meth:`finish_rows`)."""
        rows = cast(torch.Tensor, self.rows)
        batch, seq = rows.shape
        held = self._row_parts.get(name)
        if held is None:
            n = int(rows[0].sum())
            # tokens flattened (a router's (tokens, experts)): one row's as (1, n, ...), assembled flat again
            flat = tensor.dim() >= 2 and tensor.shape[0] == n > 1
            tensor = tensor.unsqueeze(0) if flat else tensor
            axes = tuple(a for a in range(1, tensor.dim()) if tensor.shape[a] == n)
            if batch < 2 or n >= seq or tensor.shape[0] != 1 or not axes or self._row_now:
                return None
            if not name.startswith(_INPUT) and not flat:
                self._row_leader = self._row_leader or name
            held = self._row_parts[name] = (axes, cast(list[torch.Tensor], []), transform, flat)
        elif held[3]:
            tensor = tensor.unsqueeze(0)
        axes, parts, _, flat = held
        n = int(rows[len(parts)].sum())
        expected = [n if a in axes else size for a, size in enumerate(parts[0].shape if parts else tensor.shape)]
        if tensor.shape[0] != 1 or list(tensor.shape[1:]) != expected[1:]:
            return _PENDING  # not this node's call for the next row
        if name == self._row_leader and parts:
            self._row_now = len(parts)  # the leader's next row: that row runs now
        elif len(parts) > self._row_now:
            return _PENDING  # recorded again within the running row
        parts.append(tensor.detach())
        if len(parts) < batch:
            return _PENDING
        del self._row_parts[name]
        self.assembled.add(name)
        rows_out = []
        for r, part in enumerate(parts):
            index, row = rows[r].nonzero().flatten().to(part.device), part[0]
            for a in axes:  # each token axis widened to the sequence, the real tokens where the mask has them
                shape = list(row.shape)
                shape[a - 1] = seq
                row = row.new_zeros(shape).index_copy_(a - 1, index, row)
            rows_out.append(row)
        return torch.stack(rows_out).flatten(0, 1) if flat else torch.stack(rows_out)

    def finish_rows(self) -> None:
        """At the end of a forward: a node assembled per row whose rows did not all run is its first call."""
        for name, (_, parts, transform, flat) in list(self._row_parts.items()):
            del self._row_parts[name]
            first = parts[0][0] if flat else parts[0]
            if name.startswith(_INPUT):
                self.hold_input(name[len(_INPUT) :], first)
                continue
            self.calls[name] = 1
            self._store(name, first, transform)

    def retract(self, name: str) -> None:
        """Forget what was recorded for ``name`` in this forward (its tensor, call count, comparison and
        held input), so the next :meth:`add` records it afresh: a model's own ``parity.tap`` of a value
        a function capture recorded first (the model changed it in between) is the one judged."""
        self.calls.pop(name, None)
        if name in self.tensors:
            del self.tensors[name]
        self.results.pop(name, None)
        self.drop_input(name)
        retract = getattr(self.sink, "retract", None)
        if retract is not None:
            retract(name)

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
                store.alias(name, cast(TensorStore, source), seen[3])  # stored there through the store branch
                return
        store.put(name, tensor.detach())
        self._stored[id(tensor)] = (weakref.ref(tensor), _version(tensor), inputs, name)

    def hold_input(self, name: str, tensor: torch.Tensor) -> None:
        """A module input for diagnosis: copied now, or held by reference when inputs are deferred; one
        module run per row has its rows assembled first, as its output is (:meth:`_by_rows`)."""
        if self.rows is not None:
            whole = self._by_rows(_INPUT + name, tensor, None)
            if whole is _PENDING:
                return
            tensor = tensor if whole is None else whole
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
