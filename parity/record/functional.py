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
parameter they read: the result of the ``linear``/``matmul``/``einsum`` with that parameter is the
node of the reference module whose weight it holds. In isolated mode each recorded value is
replaced by the reference's, in ours' layout, as a tap's is.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SDPA = F.scaled_dot_product_attention
SOFTMAXES = (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax)
PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
EINSUM = torch.einsum
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


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1)


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


def _canonical_heads(t: torch.Tensor, letters: str, batch: str, heads: str, seq: str, dim: str) -> torch.Tensor:
    """``t`` (axes named by ``letters``) as ``(batch, heads, seq, dim)``."""
    order = [letters.index(c) for c in (batch, heads, seq, dim)]
    return t.permute(order)


class FunctionCapture(TorchFunctionMode):
    """Records attention internals and functional projections of ours while it runs (see the module
    docstring). ``record(name, tensor) -> tensor``: a tap that yields to the model's own
    (:func:`~parity.record.hooks.functional_tap`); ``block() -> (path, head_dim) | None``: the
    running attention block aligned to the reference's; ``params``: storage of a parameter of ours
    -> the node of the op that reads it, recorded by ``record_param(node, tensor) -> tensor``."""

    def __init__(self, record, block, params: dict[int, str], record_param):
        super().__init__()
        self.record, self.block, self.params, self.record_param = record, block, params, record_param
        #: blocks whose probabilities were recorded in this call: their next product is the context
        self._after_probs: set[str] = set()
        #: per block, ``(latest, product)``: ``q @ k^T`` not yet recorded as the scores, followed through
        #: what the model does to it (a mask); a scaling by a scalar on the way gives the scores (that
        #: scaling of the unmasked product), the softmax without one the product itself
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA:
            return self._sdpa(args, kwargs)
        if self.params and func in (*PRODUCTS, EINSUM, LINEAR):
            node = self._param_node(func, args)
            if node is not None:
                return self.record_param(node, func(*args, **kwargs))
        running = self.block()
        if running is None:
            return func(*args, **kwargs)
        block, head_dim = running
        pending = self._pending.get(block)
        if pending is not None and any(a is pending[0] for a in args if isinstance(a, torch.Tensor)):
            latest, product = self._pending.pop(block)
            if func in SCALINGS and len(args) == 2 and _scalar(args[1] if args[0] is latest else args[0]):
                self.record("scores", func(*[product if a is latest else a for a in args], **kwargs))
            elif func in SOFTMAXES:
                self.record("scores", product)
            else:  # a mask on the way: follow its result
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    self._pending[block] = (out, product)
                return out
        if func in SOFTMAXES:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.dim() >= 3:
                out = self.record("probs", out)
                self._after_probs.add(block)
            return out
        if func in PRODUCTS and len(args) >= 2:
            return self._product(block, head_dim, func, args, kwargs)
        if func is EINSUM and args and isinstance(args[0], str):
            return self._einsum(block, head_dim, func, args, kwargs)
        return func(*args, **kwargs)

    def _param_node(self, func, args) -> str | None:
        operands = args[1:] if func is EINSUM else args
        for t in operands:
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            node = self.params.get(storage) if storage is not None else None
            if node is not None:
                return node
        return None

    def _sdpa(self, args, kwargs):
        call = _sdpa_arguments(args, kwargs)
        q, k = self.record("q_rot", call["query"]), self.record("k_rot", call["key"])
        scores, probs = sdpa_scores_probs(q, k, call)
        self.record("scores", scores)
        self.record("probs", probs)
        rest = {n: v for n, v in call.items() if n not in ("query", "key")}
        return self.record("context", SDPA(q, k, **rest))

    def _product(self, block: str, head_dim: int, func, args, kwargs):
        a, b = args[0], args[1]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 3 and b.dim() >= 3):
            return func(*args, **kwargs)
        if block in self._after_probs and b.shape[-1] == head_dim and a.shape[-1] == b.shape[-2]:
            self._after_probs.discard(block)  # probabilities times values
            return self.record("context", func(*args, **kwargs))
        if block not in self._after_probs and a.shape[-1] == head_dim and b.shape[-2] == head_dim:
            # q @ k^T: both operands carry head_dim (k transposed), the result is (..., q_len, k_len)
            kt = b.transpose(-2, -1)
            q, k = self.record("q_rot", a), self.record("k_rot", kt)
            if q is a and k is kt:
                out = func(*args, **kwargs)
            else:
                out = func(q, k.transpose(-2, -1), *args[2:], **kwargs)
            self._pending[block] = (out, out)
            return out
        return func(*args, **kwargs)

    def _einsum(self, block: str, head_dim: int, func, args, kwargs):
        equation, operands = args[0], args[1:]
        parts = _einsum_parts(equation) if len(operands) == 2 else None
        if parts is None or not all(isinstance(t, torch.Tensor) for t in operands):
            return func(*args, **kwargs)
        a_letters, b_letters, out = parts
        a, b = operands
        contracted = [c for c in a_letters if c in b_letters and c not in out]
        shared = [c for c in a_letters if c in b_letters and c in out]
        only_a = [c for c in a_letters if c not in b_letters]
        only_b = [c for c in b_letters if c not in a_letters]
        four = len(a_letters) == len(b_letters) == len(out) == 4 and len(shared) == 2
        if block in self._after_probs and four and len(contracted) == 1:
            self._after_probs.discard(block)  # probabilities . values
            return self.record("context", func(*args, **kwargs))
        if four and len(contracted) == 1 and a.shape[a_letters.index(contracted[0])] == head_dim:
            # q . k over head_dim (``bqhd,bkhd->bhqk`` and its spellings): the shared letter first in the
            # output is the batch, the other the heads
            batch, heads = sorted(shared, key=out.index)
            qc = _canonical_heads(a, a_letters, batch, heads, only_a[0], contracted[0])
            kc = _canonical_heads(b, b_letters, batch, heads, only_b[0], contracted[0])
            q, k = self.record("q_rot", qc), self.record("k_rot", kc)
            if q is qc and k is kc:  # nothing substituted: the model's own product, as it wrote it
                product = func(*args, **kwargs)
            else:
                axis = {batch: 0, heads: 1, only_a[0]: 2, only_b[0]: 3}
                product = torch.einsum("bhqd,bhkd->bhqk", q, k).permute([axis[c] for c in out])
            if out[:2] == batch + heads:  # scores in the reference's layout: (batch, heads, q, k)
                self._pending[block] = (product, product)
            return product
        return func(*args, **kwargs)
