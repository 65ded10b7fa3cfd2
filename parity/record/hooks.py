"""Record named intermediates of a model with forward hooks, detached to CPU, in execution order.

A point is ``(node name, module path)``; a path ending in ``@input`` records the module's first
input through a forward pre-hook, ``@<name>`` the argument of its ``forward`` called ``name``
(positional or keyword: Gemma 4's decoder layers receive ``per_layer_input`` beside the hidden
states), any other path its output. Tensors computed outside modules
are recorded through taps: our models' ``Tap`` modules (ordinary hooks), :func:`tap` calls in a
user's forward (recorded under the module that is running), and, for Transformers,
:mod:`parity.record.hf_capture` writing into the active trace.

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
import itertools
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from parity.record.functional import FeaturesMismatch
from parity.record.routing import is_router, own_expert_rows
from parity.record.trace import Trace, first_tensor
from parity.util.errors import ParityError

if TYPE_CHECKING:
    from parity.record.functional import Block, StorageKey

#: layouts a tap may declare for q_rot/k_rot/context: (batch, heads, seq, head_dim), (batch, seq, heads,
#: head_dim), (batch, seq, heads * head_dim)
LAYOUTS = ("bhsd", "bshd", "bsf")

#: the tap path prefix of a reference attention block a user's model computes with no module of its own
#: (a flat block that also holds the MLP, a model of plain parameters): ``functions:<block>.q_rot`` is
#: recorded while ours runs between its first projection (run or read) and its output projection
#: (``functional_blocks`` of :func:`recording`)
FUNCTIONS = "functions:"

#: ``Trace.extras`` key: the nodes whose module path resolves to no module of the model recorded
UNRESOLVED = "no module"

_ACTIVE: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("parity_active_recording", default=None)


def _replace_first_tensor(value, new: torch.Tensor):
    """``value`` with its first tensor replaced by ``new`` (cast to that tensor's dtype and device)."""
    if isinstance(value, torch.Tensor):
        return new.to(dtype=value.dtype, device=value.device)
    if isinstance(value, (tuple, list)):
        items = list(value)
        for i, item in enumerate(items):
            if first_tensor(item) is not None:
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


def _with_residual(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, residual)`` of a call handing a module whose forward takes a ``residual`` a second tensor of its
    input's shape (vLLM's fused add and RMSNorm, ``norm(x, residual)``), which such a module adds to its input
    before normalising; None for any other call (a gated norm's ``norm(x, gate)``)."""
    if not forward_takes(module, "residual"):
        return None
    x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    second = args[1] if len(args) > 1 else kwargs.get("residual")
    if isinstance(x, torch.Tensor) and isinstance(second, torch.Tensor) and second.shape == x.shape:
        return x, second
    return None


def _residual_sum(pair: tuple[torch.Tensor, torch.Tensor], output) -> torch.Tensor:
    """The input a fused add-and-norm normalised: the sum ``x + residual`` it returns beside its output
    (``(norm(x + r), x + r)``), else its first argument, as for any module."""
    x, residual = pair
    if isinstance(output, tuple | list):
        total = x + residual
        for item in output[1:]:
            if isinstance(item, torch.Tensor) and item.shape == total.shape and torch.equal(item, total):
                return item
    return x


def _carries_residual(node: str, module: nn.Module, output) -> bool:
    """Whether a decoder layer's output is ``(f(x), residual)``, the stream carried as two tensors summed by the
    next layer's fused add-and-norm (vLLM's layers, ``forward(..., residual)``): its hidden states are their
    sum."""
    if not node.rpartition(".")[2].isdigit() or not isinstance(output, tuple) or len(output) < 2:
        return False
    a, b = output[0], output[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape):
        return False
    return forward_takes(module, "residual")


def forward_takes(module: nn.Module | None, name: str) -> bool:
    """Whether ``module``'s forward takes an argument called ``name``: a ``residual`` (vLLM's convention for the
    stream carried apart), a ``gate`` (a gated RMSNorm multiplying its output by it)."""
    if module is None:
        return False
    try:
        return name in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


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


#: ``Trace.extras`` key: node -> the share of its parameter ours' recorded value read, when below 1
READ_SHARE = "read_share"
#: ``Trace.extras`` key: node -> ``(reduction, parts)`` of partial products reduced otherwise than summed
PARTS_REDUCED = "parts_reduced"
#: ``Trace.extras`` key: reference module -> why ours never computes its output (its weight absorbed into
#: another product, :meth:`~parity.record.functional.FunctionCapture._absorbs`)
ABSORBED = "absorbed"
#: ``Trace.extras`` key: the nodes parity read in ours' functions inside a module of ours (no tap of the user's),
#: which may be another product of the block than the one the node names
CAPTURED_IN_FUNCTIONS = "captured_in_functions"


@dataclass
class _Recording:
    trace: Trace
    replacement: Callable[[str, object, object], torch.Tensor | None]
    #: module paths of the modules running now (innermost last), for :func:`tap`
    stack: list[str] = field(default_factory=list)
    #: functional node name -> canonical node name, for taps recorded in a user's model
    tap_names: dict[str, str] = field(default_factory=dict)
    #: node name -> transform into the reference's layout (applied to tapped tensors too)
    transforms: dict = field(default_factory=dict)
    #: node -> (what a function capture recorded, what it returned) in this forward: the model's own
    #: tap of a value it changed since replaces the record (:func:`_changed_since_capture`)
    captured: dict[str, tuple[bool, weakref.ref]] = field(default_factory=dict)
    #: node -> the outputs of every call of its module in this forward (held weakly)
    call_outputs: dict[str, list[weakref.ref]] = field(default_factory=dict)
    #: node read in a function -> (the :data:`FUNCTIONS` block it opens, whether it is the block's last)
    blocks: dict[str, tuple[str, bool]] = field(default_factory=dict)
    #: the :data:`FUNCTIONS` block ours computes now (between its first projection read and its last)
    in_block: str | None = None
    #: a module of ours several nodes read the output of in turn (one block ours runs for each layer that
    #: shares it, Zamba2's) -> the calls it has started in this forward
    turns: dict[str, int] = field(default_factory=dict)


def active_trace() -> Trace | None:
    """The trace being recorded in this context, if any (used by :mod:`parity.record.hf_capture`)."""
    rec = _ACTIVE.get()
    return rec.trace if rec is not None else None


def running_module() -> str | None:
    """The path of the innermost module running now in the model being recorded, when the recording
    keeps the module stack (``taps``, or ``module_stack=True``); None otherwise. Used by
    :mod:`parity.record.hf_kernels` to name what a function computes after the module that called it."""
    rec = _ACTIVE.get()
    return rec.stack[-1] if rec is not None and rec.stack else None


@contextlib.contextmanager
def recording_paused():
    """No recording active inside (``parity.tap`` returns its tensor unchanged), the one before restored after."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def tap(tensor: torch.Tensor, name: str, *, layout: str | None = None) -> torch.Tensor:
    """Name a tensor computed outside any module, inside a model's forward: ``q = parity.tap(q, "q_rot")``.

    Recorded as ``<path of the module that is running>.<name>`` while parity traces the model; in
    isolated mode the reference's tensor for that node comes back instead, so the rest of the
    forward continues from it. Free when nothing is being traced: returns ``tensor`` unchanged.
    ``layout`` ("bhsd", "bshd" or "bsf": batch, heads, seq, head_dim in that order, or heads
    flattened) says how a ``q_rot``/``k_rot``/``context`` tensor is laid out; without it the layout is
    read from the shape (a 4-D shape whose sequence length equals the head count cannot tell, and is
    read as this tap's earlier calls were, else as ``(batch, heads, seq, head_dim)``). Raises
    :class:`parity.ParityError` for another layout name, a name that is no non-empty string or a
    first argument that is no tensor (traced or not: such a mistake shows on the first run), and,
    while traced, for a shape that cannot hold the declared layout or ``layout`` on a tap other than
    those three.
    """
    if not isinstance(name, str) or not name:
        raise ParityError(f"parity.tap(tensor, name): the name must be a non-empty string, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ParityError(
            f"parity.tap(..., {name!r}): the first argument must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if layout is not None and layout not in LAYOUTS:
        raise ParityError(f"parity.tap(..., {name!r}, layout={layout!r}): layout must be one of {', '.join(LAYOUTS)}")
    rec = _ACTIVE.get()
    if rec is None or not rec.tap_names:
        return tensor
    node = _tap_node(rec, name)
    if node is None:
        return tensor
    transform = rec.transforms.get(node)
    if layout is not None:
        if transform is None or not hasattr(transform, "with_layout"):
            raise ParityError(
                f"parity.tap(..., {name!r}, layout={layout!r}): layout applies to q_rot, k_rot and context taps only"
            )
        transform = transform.with_layout(layout)
    if node in rec.captured and _changed_since_capture(rec, node, tensor):
        rec.trace.retract(node)  # the model changed the value a function capture recorded: its tap wins
    rec.trace.add(node, tensor, transform)
    new = rec.replacement(node, tensor, transform if layout is not None else None)
    return tensor if new is None else new.to(dtype=tensor.dtype, device=tensor.device)


def _tap_node(rec: _Recording, name: str) -> str | None:
    """The node a tap called ``name`` records, found from the innermost running module outwards."""
    for path in _paths(rec):
        node = rec.tap_names.get(f"{path}.{name}" if path else name)
        if node is not None:
            return node
    return None


def functional_tap(rec: _Recording, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tap made by :mod:`parity.record.functional` for a value the model computed in a function: it
    records only a node nothing recorded yet (the model's own tap wins) and, in isolated mode,
    returns the reference's value in ours' layout."""
    node = _tap_node(rec, name)
    if node is None or rec.trace.recorded(node):
        return tensor
    returned = _record_value(rec, node, tensor)
    rec.captured[node] = (returned is not tensor, weakref.ref(returned))  # held weakly: memory stays as it was
    return returned


def _turns(points: Sequence[tuple[str, str]], transforms: dict) -> dict[str, tuple[str, int]]:
    """Node -> (module path, which call of it is the node's) for the nodes that read one module's whole output
    in turn: several nodes on one module path of ours, none of them its input, a named argument or a part (no
    transform): the block ours holds once and runs for each layer that shares it (Zamba2's shared transformer,
    tied in the reference across layers); the k-th node, in execution order, is its k-th call."""
    by_path: dict[str, list[str]] = {}
    for name, path in points:
        module_path, is_input, item = split_path(path)
        if module_path and not is_input and "@" not in module_path and name not in transforms:
            by_path.setdefault(f"{module_path}#{item}" if item is not None else module_path, []).append(name)
    return {
        name: (split_path(key)[0], k)
        for key, names in by_path.items()
        if len(names) > 1 and len({re.sub(r"\.\d+(?=\.|$)", ".N", n) for n in names}) == 1  # one node, other layers
        for k, name in enumerate(names)
    }


def _joined(rec: _Recording, tensors, out: torch.Tensor) -> None:
    """A concatenation of the outputs of several calls of one node's module (an MLP run over chunks of
    the tokens): the concatenation is the node, recorded in place of the first call's output."""
    if len(tensors) < 2:
        return
    for node, refs in rec.call_outputs.items():
        outputs = [r() for r in refs]
        if len(outputs) >= 2 and all(any(t is o for o in outputs) for t in tensors):
            rec.call_outputs.pop(node)
            rec.trace.retract(node)
            rec.trace.add(node, out, rec.transforms.get(node))
            return


def _hold_functional_input(trace: Trace, node: str, x: torch.Tensor, siblings=()) -> None:
    """The input of a node ours computes in a function (``F.linear(x, W)``, ``x @ W``), held for the hints
    as a module's input is (the first call's; the stream drops it once the node passes). A parameter serving
    several nodes (norm gains stacked as rows of one tensor): the input is the next unrecorded one's, as the
    read's result is (:func:`_record_param`)."""
    node = next((n for n in (node, *siblings) if not trace.recorded(n)), node)
    if not trace.recorded(node) and node not in trace.inputs and node not in trace.pending:
        trace.hold_input(node, x)


def _retract_captured(rec: _Recording, name: str) -> None:
    """Forget the running block's node ``name`` when a function capture recorded it (not a model's tap)."""
    node = _tap_node(rec, name)
    if node is not None and node in rec.captured:
        rec.captured.pop(node)
        rec.trace.retract(node)


def _forget_module(rec: _Recording, module: str) -> None:
    """Forget every node of the reference module ``module`` (``module`` or ``module[...]``, its parts)
    recorded so far in this forward."""
    for node in [n for n in rec.trace.wanted if n == module or n.startswith(module + "[")]:
        rec.trace.retract(node)


def _correction_bias(module: nn.Module) -> torch.Tensor | None:
    """A router's correction bias, added to its scores for the choice only: its own ``e_score_correction_bias``
    (DeepSeek V3's) or a child's (ERNIE 4.5's ``moe_statics``, ``(1, experts)``), flattened; else None."""
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    found = next((t for n, t in tensors if n.rsplit(".", 1)[-1] == "e_score_correction_bias"), None)
    return found.flatten() if isinstance(found, torch.Tensor) else None


def _record_param(
    rec: _Recording,
    node: str,
    tensor: torch.Tensor,
    siblings,
    lookup: bool,
    lookups: frozenset[str],
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The result of an op reading a node's parameter: recorded as each node sharing that parameter that
    reads it this way (a lookup for an embedding, a product for a projection: a tied table is both; a
    fused weight read once gives every part its rows by its transform); in isolated mode each writes
    the reference's rows back in turn. A lookup at ``ids`` of a table whose rows hold several nodes' tables
    (ERNIE's token-type and task-type tables stacked): the node whose rows hold the ids, the rows read as they are."""
    nodes = [n for n in (node, *siblings) if (n in lookups) == lookup]
    if lookup and ids is not None:
        read = {int(i) for i in ids.flatten().unique()}
        held = [n for n in nodes if getattr(rec.transforms.get(n), "rows", None)]
        if held:
            within = [n for n in held if read <= set(rec.transforms[n].rows)]
            if not within:
                return tensor
            node = within[0]
            if rec.trace.recorded(node):
                rec.trace.keep_later(node, tensor, None)
                return tensor
            return _record_value(rec, node, tensor, as_read=True)
    read_again = bool(nodes) and tensor is not None and all(rec.trace.recorded(n) for n in nodes)
    if not (read_again and _inside_another_block(rec, node)):
        _enter_block(rec, node)
    if not nodes:
        return tensor
    if tensor is None:  # a read that computes none of them (a norm's gain folded into the next weight): the next
        # node of a parameter several nodes share is passed over, its output never computed
        passed = next((n for n in nodes if not rec.trace.recorded(n)), None)
        if passed is not None:
            rec.trace.pass_over(passed)
            cast(dict, rec.trace.extras.setdefault(ABSORBED, {}))[passed] = (
                "its gain multiplied into the next weight (g[:, None] * W): ours runs it without its gain, so its "
                "output is not the reference's: not judged; the projection reading it is"
            )
        return tensor
    if all(rec.trace.recorded(n) for n in nodes):
        again = _read_again(rec.trace, nodes[0], tensor)
        for other in nodes[1:]:  # each node this read makes runs again, in order (a loop's later step)
            rec.trace.ran(other)
        for other in nodes:
            rec.trace.keep_later(other, tensor, rec.transforms.get(other))
        return again
    value = tensor
    taken: list[str] = []
    for other in nodes:
        if rec.trace.recorded(other):
            continue
        view = rec.transforms.get(other)
        if any(_same_view(view, rec.transforms.get(t)) for t in taken):
            continue  # the same view as a node this read records: a tied copy the reference runs later (its turn)
        value = _record_value(rec, other, value)
        taken.append(other)
    return value


def _same_view(a, b) -> bool:
    """Whether two nodes read one parameter the same way (no transform, or equal ones): the reference's tied
    copies of one module (Zamba2's shared block in each layer using it), each a later read of it in ours."""
    if a is None or b is None:
        return a is b
    try:
        return a is b or bool(a == b)
    except Exception:  # a transform that cannot be compared: not the same view
        return False


def _record_part(rec: _Recording, node: str, tensor: torch.Tensor, rows: Callable) -> torch.Tensor:
    """A product over the block of a fused parameter that holds one node's rows alone (``W[1]`` of a stacked
    gate/up): that node, ``rows`` picking its outputs in the reference's order (in isolated mode, writing the
    reference's back the same way)."""
    _enter_block(rec, node)
    if rec.trace.recorded(node):
        again = _read_again(rec.trace, node, tensor)
        rec.trace.keep_later(node, tensor, rows)
        return again
    rec.trace.add(node, tensor, rows)
    new = rec.replacement(node, tensor, rows)
    return tensor if new is None else new.to(dtype=tensor.dtype, device=tensor.device)


def _lookup_capable(lookups: frozenset[str] | None, siblings: dict[str, list[str]] | None) -> frozenset[str] | None:
    """The nodes whose parameter a lookup may read: the embeddings, and a node sharing its parameter with
    one (a tied head: the table's first node may be the head, the lookup its sibling's)."""
    if lookups is None:
        return None
    tied = {node for node, others in (siblings or {}).items() if any(o in lookups for o in others)}
    return frozenset(lookups | tied)


def _enter_block(rec: _Recording, node: str) -> None:
    """A node of ours produced: a projection of a :data:`FUNCTIONS` block opens it (its last closes it);
    any other node closes the block running."""
    if rec.blocks:
        block, last = rec.blocks.get(node, (None, True))
        rec.in_block = None if last else block


def _inside_another_block(rec: _Recording, node: str) -> bool:
    """Whether ``node``'s parameter, read again, is read inside another block still running: an earlier layer's
    projection run again by a later layer's attention (Gemma 4's shared-KV layers computing an earlier layer's
    keys anew), which leaves that later block running (its internals are its own)."""
    block, last = rec.blocks.get(node, (None, True)) if rec.blocks else (None, True)
    return rec.in_block is not None and block is not None and block != rec.in_block and not last


def _read_again(trace: Trace, node: str, tensor: torch.Tensor) -> torch.Tensor:
    """A parameter of a recorded node read again in a function: counted (``Trace.reads``, and in the order of
    calls, ``Trace.sequence``), not recorded."""
    trace.reads[node] = trace.reads.get(node, 0) + 1
    trace.ran(node)
    return tensor


def _changed_since_capture(rec: _Recording, node: str, tapped: torch.Tensor) -> bool:
    """Whether the model's own tap of ``node`` should replace what a function capture recorded: the
    model changed the value in between (dropout, a renormalisation after ``torch.softmax``). In
    isolated mode the capture returned the reference's value; when what it recorded already failed,
    the fault is before the capture and that record stays (the tap only sees the reference's value)."""
    replaced, ref = rec.captured.pop(node)
    returned = ref()
    if returned is not None and (
        tapped is returned or (tapped.shape == returned.shape and torch.equal(tapped, returned))
    ):
        return False
    result = rec.trace.results.get(node)
    return not (replaced and result is not None and result.failed)


def _record_value(rec: _Recording, node: str, tensor: torch.Tensor, as_read: bool = False) -> torch.Tensor:
    """``tensor`` recorded as ``node`` through its transform (``as_read``: as it is, a lookup's rows), and what
    ours goes on with (the reference's value in isolated mode)."""
    rec.trace.add(node, tensor, None if as_read else rec.transforms.get(node))
    new = rec.replacement(node, tensor, None)
    return tensor if new is None else new.to(dtype=tensor.dtype, device=tensor.device)


def _paths(rec: _Recording) -> list[str]:
    """The running modules' paths, innermost first, after the block ours computes in functions now."""
    inner = [rec.in_block] if rec.in_block is not None else []
    return inner + list(reversed(rec.stack))


def _running_block(rec: _Recording) -> tuple[str, int, int] | None:
    """The innermost running module that is aligned to a reference attention block, with its head_dim and
    query head count (0 when no q_rot layout says it)."""
    for path in _paths(rec):
        for suffix in ("q_rot", "context", "probs"):
            node = rec.tap_names.get(f"{path}.{suffix}")
            if node is not None:
                layout = rec.transforms.get(rec.tap_names.get(f"{path}.q_rot", node))
                return path, getattr(layout, "head_dim", None) or -1, getattr(layout, "heads", 0)
    return None


def _running_moe(rec: _Recording) -> tuple[str, object] | None:
    """The innermost running module aligned to a reference MoE block (it has a ``router.experts`` tap),
    with what its routing reads (the tap's :class:`~parity.record.routing.TopK`)."""
    for path in reversed(rec.stack):
        node = rec.tap_names.get(f"{path}.router.experts")
        topk = rec.transforms.get(node) if node is not None else None
        if topk is not None and hasattr(topk, "experts"):
            return path, topk
    return None


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
    inverses: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
    keep_inputs: frozenset[str] = frozenset(),
    taps: dict[str, str] | None = None,
    into: Trace | None = None,
    module_stack: bool = False,
    functional: dict[StorageKey, str] | None = None,
    functional_biases: dict[StorageKey, str] | None = None,
    functional_scales: dict[StorageKey, str] | None = None,
    functional_vectors: dict[StorageKey, str] | None = None,
    functional_widths: dict[str, int] | None = None,
    functional_expects_bias: frozenset[str] = frozenset(),
    functional_gated: frozenset[str] = frozenset(),
    functional_owners: dict[str, str] | None = None,
    functional_siblings: dict[str, list[str]] | None = None,
    functional_parts: dict[int, list[tuple[Block, str, Callable]]] | None = None,
    functional_lookups: frozenset[str] | None = None,
    functional_blocks: dict[str, tuple[str, bool]] | None = None,
    functional_input_axes: dict[int, tuple[torch.Tensor, int]] | None = None,
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
    instead of tensors (:mod:`parity.golden`); by default a new in-memory one. ``module_stack``: keep the
    paths of the running modules (:func:`running_module`) even without ``taps``. ``functional``:
    record what attention computes in functions (:mod:`parity.record.functional`) into the ``taps``
    nodes nothing tapped, and, keyed by a parameter's storage, the node of the op that reads it;
    ``functional_biases``: keyed the same way, the node whose op's result ours adds that bias to next;
    ``functional_expects_bias``: nodes whose reference module has a bias no parameter of ours aligned to;
    ``functional_gated``: norm nodes whose reference module multiplies its output by a gate it is given;
    ``functional_owners``: node -> the module of ours holding its weight, whose own hook records the node
    (an op reading that weight counts only while the module is not running). ``functional_blocks``: node
    read in a function -> (the :data:`FUNCTIONS` tap path of the attention block it belongs to, whether it
    is that block's last projection): the block's taps are recorded between the two.
    ``functional_input_axes``: ``id(weight) -> (weight, the axis holding its projection's input features)``:
    a product keeping that axis absorbs the weight (:data:`ABSORBED`).
    """
    transforms, inverses = transforms or {}, inverses or {}
    trace = Trace() if into is None else into
    trace.wanted = frozenset([name for name, _ in points] + list(captured) + list((taps or {}).values()))

    def replacement(name: str, current, declared=None) -> torch.Tensor | None:
        """The reference's tensor for ``name`` in ``current``'s layout; ``declared``: a tap's own
        transform (its declared layout), whose inverse then replaces the node's."""
        if substitute is None or trace.calls.get(name, 0) != 1 or name not in substitute.tensors:
            return None
        ref: torch.Tensor | None
        ref = substitute.tensors[name]
        mine = first_tensor(current)
        if mine is None:
            return None
        if name in transforms:
            inverse = getattr(declared, "inverse", None) or inverses.get(name)
            try:
                ref = inverse(ref, mine) if inverse is not None else None
            except RuntimeError:  # ours' call holds part of the node (a chunk of the tokens): not substituted
                ref = None
        if ref is None or ref.shape != mine.shape:
            return None  # a node of another shape is reported as such; ours keeps its own tensor
        # the values are the reference's, the memory layout ours' (a view's gaps included): CPU kernels
        # take another path, with another rounding, for another layout (a sigmoid of a strided view
        # differs by an ulp from the same values packed), and isolated mode must change values only
        try:
            return torch.empty_strided(mine.shape, mine.stride(), dtype=mine.dtype, device=mine.device).copy_(ref)
        except RuntimeError:  # an expanded (overlapping) view cannot be written: packed is the best
            return torch.empty_like(mine, memory_format=torch.contiguous_format).copy_(ref)

    rec = _Recording(
        trace, replacement, tap_names=dict(taps or {}), transforms=transforms, blocks=dict(functional_blocks or {})
    )
    handles = _module_stack_hooks(model, rec) if taps or module_stack or functional is not None else []
    modules = dict(model.named_modules())
    unresolved = cast("set[str]", trace.extras.setdefault(UNRESOLVED, set()))
    turns = _turns(points, transforms)
    for path in {p for p, _ in turns.values()}:
        if path in modules:

            def started(mod, args, _path=path):
                rec.turns[_path] = rec.turns.get(_path, -1) + 1

            handles.append(modules[path].register_forward_pre_hook(started))
    for name, path in points:
        module_path, is_input, item = split_path(path)
        module_path, at, argument = module_path.partition("@")  # a named forward argument: a.b@name
        module = modules.get(module_path)
        if module is None:
            unresolved.add(name)  # no such module: the node is missing, said as such by diagnosis
            continue
        transform = transforms.get(name)
        if is_input:
            summing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def pre_hook(mod, args, kwargs, _name=name, _t=transform, _summing=summing):
                pair = _with_residual(mod, args, kwargs)
                if pair is not None:  # read after the call: the sum it makes inside may be the input
                    _summing[id(mod)] = pair
                    return None
                trace.add(_name, args if args else kwargs, _t)
                new = replacement(_name, args if args else kwargs)
                if new is None:
                    return None
                if args:
                    return _replace_first_tensor(args, new), kwargs
                key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
                return args, {**kwargs, key: _replace_first_tensor(kwargs[key], new)}

            def summed_hook(mod, args, output, _name=name, _t=transform, _summing=summing):
                pair = _summing.pop(id(mod), None)
                if pair is not None:
                    trace.add(_name, _residual_sum(pair, output), _t)

            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(module.register_forward_hook(summed_hook))
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
                assert isinstance(key, int)  # an "args" slot is a position
                return (*args[:key], _replace_first_tensor(value, new), *args[key + 1 :]), kwargs

            handles.append(module.register_forward_pre_hook(argument_hook, with_kwargs=True))
        else:

            def hook(mod, args, output, _name=name, _t=transform, _n=item, _turn=turns.get(name)):
                if _turn is not None and rec.turns.get(_turn[0]) != _turn[1]:
                    return None  # another node's call of this module (the one ours runs for each layer sharing it)
                carried = _n is None and _carries_residual(_name, mod, output)
                value = output[0] + output[1] if carried else _item(output, _n)
                try:
                    trace.add(_name, value, _t)
                except FeaturesMismatch:  # the module returns other features than the rows it holds: no value of
                    return None  # the node (AltUp's projections stacked in a module returning the streams)
                _enter_block(rec, _name)
                new = replacement(_name, value)
                if new is None:
                    value = first_tensor(value)
                    if value is not None:  # every call's output: a cat of them is the node (token chunks)
                        rec.call_outputs.setdefault(_name, []).append(weakref.ref(value))
                    return None
                return _replace_item(output, _n, new - output[1] if carried else new)

            handles.append(module.register_forward_hook(hook))
            if name in keep_inputs:

                def keep(mod, args, kwargs, _name=name):
                    tensor = first_tensor(args if args else kwargs)
                    if trace.recorded(_name) or _name in trace.inputs:
                        return
                    if tensor is None:  # a table called with a shape (RoFormer's sinusoids): its rows only
                        weight = getattr(mod, "weight", None)
                        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and _name not in trace.weights:
                            trace.weights[_name] = weight.detach()
                    else:
                        trace.hold_input(_name, tensor)
                        weight, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)
                        if isinstance(weight, torch.Tensor) and weight.dim() in (1, 2):  # linear or norm weight
                            trace.weights[_name] = weight.detach()
                        # DeepSeek's router keeps the bias it adds to the scores for the choice apart; AFMoE's
                        # router is handed its block's (``router(hidden_states, self.expert_bias)``)
                        bias = bias if bias is not None else _correction_bias(mod)
                        if bias is None and is_router(mod):
                            bias = kwargs.get("expert_bias", args[1] if len(args) > 1 else None)
                            bias = bias if isinstance(bias, torch.Tensor) and bias.dim() == 1 else None
                        if isinstance(bias, torch.Tensor):  # a projection's, or a LayerNorm's shift
                            trace.biases[_name] = bias.detach()

                handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    token = _ACTIVE.set(rec)
    capture: contextlib.AbstractContextManager = contextlib.nullcontext()
    if functional is not None:
        from parity.record.functional import FunctionCapture

        capture = FunctionCapture(
            lambda name, t: functional_tap(rec, name, t),
            lambda: _running_block(rec),
            functional,
            lambda node, t, lookup=False, part=None, ids=None: (
                _record_param(
                    rec,
                    node,
                    t,
                    (functional_siblings or {}).get(node, ()),
                    lookup,
                    functional_lookups or frozenset(),
                    ids,
                )
                if part is None
                else _record_part(rec, node, t, part)
            ),
            parts=functional_parts,
            moe=(lambda: _running_moe(rec)) if any(n.endswith(".router.experts") for n in rec.tap_names) else None,
            biases=functional_biases,
            scales=functional_scales,
            vectors=functional_vectors,
            widths=functional_widths,
            expects_bias=functional_expects_bias,
            gated=functional_gated,
            owners=(functional_owners or {}, lambda: rec.stack),
            retract=lambda kind: _retract_captured(rec, kind),
            hold_input=lambda node, x: _hold_functional_input(
                trace, node, x, (functional_siblings or {}).get(node, ())
            ),
            joined=lambda tensors, out: _joined(rec, tensors, out),
            lookups=_lookup_capable(functional_lookups, functional_siblings),
            input_axes=functional_input_axes,
            forget=lambda module: _forget_module(rec, module),
        )
    try:
        with capture, own_expert_rows():
            yield trace
            trace.finish_rows()
            settle = getattr(capture, "settle_all", None)
            if settle is not None:  # partial sums the forward returned or left unread
                settle()
    finally:
        shares = getattr(capture, "shares", None)
        if shares:
            trace.extras[READ_SHARE] = dict(shares)
        reductions = getattr(capture, "reductions", None)
        if reductions:
            trace.extras[PARTS_REDUCED] = dict(reductions)
        absorbed = getattr(capture, "absorbed", None)
        if absorbed:
            trace.extras[ABSORBED] = {**cast(dict, trace.extras.get(ABSORBED, {})), **absorbed}
        if rec.captured:
            trace.extras[CAPTURED_IN_FUNCTIONS] = frozenset(rec.captured)
        _ACTIVE.reset(token)
        for handle in handles:
            handle.remove()
