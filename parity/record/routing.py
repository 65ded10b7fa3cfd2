"""The routing of a mixture of experts in code you don't own, read from the functions that compute it.

A user's MoE block (a library's, a notebook's) computes its router's choices and weights in plain
functions and runs each expert, a module of its own, on the tokens routed to it. While ours runs,
:class:`RoutingCapture` (called by :class:`~parity.record.functional.FunctionCapture` under the
module aligned to the reference's MoE block) reads:

* ``torch.topk`` over the experts (``k`` of them): its indices are the chosen experts
  (``router.experts``);
* its values, followed through what the model does to them element by element (a softmax over
  the chosen ``k``, a renormalisation by their sum, a cast, a scaling), up to the first op that
  uses them on the experts' outputs (indexing, a product): the routing weights (``router.weights``);
* the gather of the block's tokens an expert module then runs on (``x[rows]``, ``index_select``):
  :class:`ExpertRows` puts that expert's output back on those rows, zero elsewhere, as the
  reference's per-expert node holds it.

In isolated mode both routing nodes are replaced by the reference's, in ours' layout, as a tap is.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from parity.record.ops import LOOKUPS, op_name

#: node names (after the block's path) of the router's choices and weights
CHOICES, WEIGHTS = "router.experts", "router.weights"
#: ops that read the routing weights without using them (their sum, for a renormalisation)
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "norm", "prod", "logsumexp", "size", "dim"})

#: the tokens the latest gather of a MoE block took, for :class:`ExpertRows`: ``(rows, tokens, chosen)``
_ROWS: contextvars.ContextVar[tuple[torch.Tensor, int, torch.Tensor | None] | None] = contextvars.ContextVar(
    "parity_expert_rows", default=None
)


@contextlib.contextmanager
def own_expert_rows() -> Iterator[None]:
    """A recording's :class:`ExpertRows` read only the gathers of its own forward: none of an earlier recording's
    (the context variable outlives it: a decode's last step's two tokens and choices zeroed a later model's expert
    rows, when that model's MoE had no routing parity read)."""
    token = _ROWS.set(None)
    try:
        yield
    finally:
        _ROWS.reset(token)


def is_router(module) -> bool:
    """Whether a reference module is a MoE router: Transformers 5's ``...TopKRouter`` (Mixtral, Qwen3-MoE),
    DBRX's ``DbrxRouter``, or a gate that picks the top k itself (HunYuan-MoE's ``HunYuanMoEV1Gate``, its
    weight in a child ``wg``)."""
    name = type(module).__name__
    return name.endswith("Router") or (name.endswith("Gate") and isinstance(getattr(module, "top_k", None), int))


def returns_choice(module) -> bool:
    """Whether a reference router picks the top k itself (it holds ``top_k``) and so returns ``(logits, weights,
    chosen experts)`` (a top-k router, HunYuan-MoE's gate), not its logits alone for the block to choose from
    (DBRX's)."""
    return is_router(module) and isinstance(getattr(module, "top_k", None), int)


#: what a top-k router returns, by position: Transformers 5's ``(logits, weights, chosen experts)``
ROUTER_OUTPUTS = {"logits": 0, "weights": 1, "chosen": 2}
#: words in the names a router's ``return`` gives its outputs, by role (``router_logits``, ``router_scores``,
#: ``router_indices``)
_ROLE_WORDS = {
    "logits": ("logit",),
    "chosen": ("indic", "index", "selected", "idx"),
    "weights": ("score", "weight", "prob"),
}


def router_outputs(module) -> dict[str, int]:
    """Which output of a top-k router is its logits, its weights and its chosen experts, read from the names
    its forward returns (``return router_scores, router_logits``: Llama 4's, scores first and no choice);
    :data:`ROUTER_OUTPUTS` when the forward returns no tuple of plain names or a name says nothing."""
    cls = type(module)
    if cls not in _OUTPUTS:
        _OUTPUTS[cls] = _router_outputs(cls)
    return dict(_OUTPUTS[cls])


#: router class -> :func:`router_outputs` (its source parsed once per class)
_OUTPUTS: dict[type[nn.Module], dict[str, int]] = {}


def _router_outputs(cls: type[nn.Module]) -> dict[str, int]:
    """:func:`router_outputs` of a router class."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return dict(ROUTER_OUTPUTS)
    returns = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    if len(returns) != 1 or not all(isinstance(e, ast.Name) for e in returns[0].elts):
        return dict(ROUTER_OUTPUTS)
    names = [cast(ast.Name, e).id.lower() for e in returns[0].elts]
    found: dict[str, int] = {}
    for i, name in enumerate(names):
        role = next((r for r, words in _ROLE_WORDS.items() if any(w in name for w in words)), None)
        if role is None or role in found:
            return dict(ROUTER_OUTPUTS)
        found[role] = i
    return found if "logits" in found else dict(ROUTER_OUTPUTS)


@dataclass(frozen=True)
class TopK:
    """What a MoE block's routing reads: ``experts`` of them, ``k`` chosen per token (the facts of its
    layer). Kept as the transform of the ``router.experts`` tap (it changes nothing)."""

    experts: int
    k: int
    #: the k of the model's other MoE layers: a top-k over the experts with one of them is ours' choice too
    #: (a per-layer k list read as one number, or the wrong layer's entry), compared against this layer's
    other_k: frozenset[int] = frozenset()
    #: ours' expert ``i`` is the reference's expert ``to_reference[i]`` (ours stacks its experts and router rows in
    #: another order, read from how it holds the router's weight); empty: the same order
    to_reference: tuple[int, ...] = ()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Ours' choices as the reference's ``(tokens, k)``, each expert index the reference's: a block that
        keeps the batch axis routes ``(batch, seq, k)``."""
        t = t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t
        if self.to_reference and not t.is_floating_point() and t.numel():
            table = torch.tensor(self.to_reference, device=t.device, dtype=t.dtype)
            if int(t.max()) < len(self.to_reference) and int(t.min()) >= 0:
                t = table[t]
        return t

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """The reference's choices in ours' shape (``(batch, seq, k)`` for ``(tokens, k)``) and expert order;
        ours' own when they cannot be (another k: compared, not replaced)."""
        if ref.numel() != current.numel():
            return current
        if self.to_reference:  # the reference's expert j is ours' argsort(to_reference)[j]
            ref = torch.argsort(torch.tensor(self.to_reference, device=ref.device)).to(ref.dtype)[ref]
        return ref.reshape(current.shape)


@dataclass(frozen=True)
class ExpertRows:
    """One expert's output of ours ``(n, hidden)`` on the tokens its block gathered (in ours' order),
    brought into the reference's ``(tokens, hidden)``: on those rows, zero elsewhere. An output over
    every token ``(tokens, hidden)`` (or ``(batch, seq, hidden)``: a block that runs each expert on all
    tokens, keeping the batch axis) keeps only the rows ours' router sent to ``expert``."""

    expert: int

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        found = _ROWS.get()
        if found is None or t.dim() < 2:
            return t
        rows, tokens, chosen = found
        if t.dim() > 2 and t.numel() == tokens * t.shape[-1]:
            t = t.reshape(tokens, t.shape[-1])
        if t.dim() != 2:
            return t
        if t.shape[0] == len(rows) != tokens:
            out = t.new_zeros((tokens, t.shape[1]))
            out[rows.to(t.device)] = t
            return out
        if t.shape[0] == tokens and chosen is not None:
            routed = (chosen.reshape(tokens, -1) == self.expert).any(-1).to(t.device)
            return torch.where(routed[:, None], t, torch.zeros_like(t))
        return t

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """The reference's rows for ours' tokens, in ours' order; ours' own when no gather says which."""
        found = _ROWS.get()
        if found is None or current.dim() < 2:
            return current
        rows, tokens, _ = found
        if current.dim() > 2:  # ours over every token, batch axis kept: the reference's rows in that shape
            fits = ref.numel() == current.numel() == tokens * current.shape[-1]
            return ref.reshape(current.shape) if fits else current
        if current.shape[0] == len(rows) != tokens:
            return ref[rows.to(ref.device)]
        return ref if current.shape[0] == tokens else current


@dataclass
class _Block:
    """One call of a MoE block: its tokens, ours' choices, the weights followed and their replacement."""

    tokens: int
    chosen: torch.Tensor
    weights: torch.Tensor
    replacement: torch.Tensor | None = None
    recorded: bool = False


class RoutingCapture:
    """Reads a MoE block's routing while ours runs (see the module docstring). ``record(name, tensor)
    -> tensor``: a functional tap; ``moe() -> (block path, TopK) | None``: the running module aligned
    to the reference's MoE block."""

    def __init__(self, record, moe):
        self.record, self.moe = record, moe
        self._blocks: dict[str, _Block] = {}

    def __call__(self, func, args, kwargs) -> tuple[bool, object]:
        """``(True, result)`` when the call was the routing's (computed here), else ``(False, None)``."""
        running = self.moe()
        if running is None:
            return False, None
        path, topk = running
        name = op_name(func)
        if name == "topk":
            return self._topk(path, topk, func, args, kwargs)
        block = self._blocks.get(path)
        if block is None:
            return False, None
        if name in _GATHERS and not block.recorded and _index_of(name, args, kwargs) is block.chosen:
            # the weights read from another score tensor at the chosen experts (DeepSeek V3's and GLM-4.5's
            # unbiased sigmoid scores, the choice made on the biased ones): followed from there
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape == block.weights.shape:
                block.weights = out
            return True, out
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(a is block.weights or a is block.replacement for a in tensors) and name not in _REDUCTIONS:
            return True, self._weights(block, name, func, args, kwargs)
        rows = _gathered_rows(name, args, block.tokens)
        if rows is not None:
            _ROWS.set((rows, block.tokens, block.chosen))
        return False, None

    def _topk(self, path: str, topk: TopK, func, args, kwargs):
        out = func(*args, **kwargs)
        values, indices = out
        if not isinstance(args[0], torch.Tensor) or args[0].shape[-1] != topk.experts:
            return True, out
        if values.shape[-1] != topk.k and values.shape[-1] not in topk.other_k:
            return True, out
        chosen = self.record(CHOICES, indices)
        tokens = values.numel() // values.shape[-1]
        self._blocks[path] = _Block(tokens, chosen, values)  # chosen: the tensor ours reads (integers, no grad)
        # no gather yet: an expert run on every token keeps the rows the router sent to it (ExpertRows)
        _ROWS.set((torch.arange(tokens), tokens, chosen.detach()))
        return True, type(out)((values, chosen))

    def _weights(self, block: _Block, name: str, func, args, kwargs):
        """An op reading the routing weights: followed while it transforms them element by element (same
        shape: a renormalisation, a cast, a scaling); the weights recorded (and, isolated, replaced) at the
        first op doing anything else with them (indexing them, broadcasting them onto the experts' outputs)."""
        if not block.recorded and args and args[0] is block.weights and _in_place_arithmetic(name):
            return func(*args, **kwargs)  # ``w /= w.sum(-1, keepdim=True)`` (EXAONE-MoE's): still the weights, followed
        if not block.recorded and name not in LOOKUPS and not name.endswith("_"):
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape == block.weights.shape:
                block.weights = out
                return out
            self._record_weights(block)  # a use, seen once it ran: run again only to read the reference's
            return out if block.replacement is None else func(*self._replaced(block, args), **kwargs)
        if not block.recorded:
            self._record_weights(block)
        return func(*self._replaced(block, args), **kwargs)

    def _record_weights(self, block: _Block) -> None:
        block.recorded = True
        new = self.record(WEIGHTS, block.weights)
        block.replacement = None if new is block.weights else new

    @staticmethod
    def _replaced(block: _Block, args) -> tuple:
        if block.replacement is None:
            return tuple(args)
        return tuple(block.replacement if a is block.weights else a for a in args)


def _in_place_arithmetic(name: str) -> bool:
    """Whether op ``name`` rewrites its first operand in place element by element (``/=``, ``mul_``)."""
    plain = name[3:-2] if name.startswith("__i") and name.endswith("__") else name[:-1] if name.endswith("_") else ""
    return plain in ("add", "sub", "mul", "truediv", "div", "clamp", "clamp_min", "clamp_max")


#: ops reading a tensor's values at given indices along an axis (the routing weights at the chosen experts)
_GATHERS = frozenset({"gather", "take_along_dim"})


def _index_of(name: str, args, kwargs):
    """The index tensor of ``gather(input, dim, index)`` / ``take_along_dim(input, indices, dim)``."""
    if name == "gather":
        return args[2] if len(args) > 2 else kwargs.get("index")
    return args[1] if len(args) > 1 else kwargs.get("indices")


def _gathered_rows(name: str, args, tokens: int) -> torch.Tensor | None:
    """The rows ``x[rows]`` / ``x.index_select(0, rows)`` takes of the block's tokens ``(tokens, hidden)``
    (an integer index, or a boolean mask over the tokens), as int64 on the CPU; None for any other op."""
    if name not in ("__getitem__", "index_select") or len(args) < 2:
        return None
    source = args[0]
    if not (isinstance(source, torch.Tensor) and source.is_floating_point() and source.dim() == 2):
        return None
    if source.shape[0] != tokens or (name == "index_select" and (len(args) < 3 or args[1] != 0)):
        return None
    index = args[2] if name == "index_select" else args[1]
    if isinstance(index, tuple):
        if not index or any(not isinstance(i, slice) for i in index[1:]):
            return None
        index = index[0]
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
        return None
    rows = index.nonzero().flatten() if index.dtype == torch.bool else index
    return rows.detach().to("cpu", torch.int64)
