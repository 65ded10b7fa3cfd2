"""Capture what Transformers computes inside kernel functions: the short causal convolution and the
gated delta rule of linear-attention layers (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo hybrid).

These layers call plain functions, not submodules, for their core: ``causal_conv1d_fn`` /
``causal_conv1d_update`` (the ``causal-conv1d`` package's API) and ``torch_chunk_gated_delta_rule``
/ ``torch_recurrent_gated_delta_rule`` (FLA's), each a torch fallback defined in the modeling file
(or the package's kernel when it is installed) and looked up there as a module global at call time.
Forward hooks cannot see inside them. As :mod:`parity.record.hf_capture` does for attention, each such
global is wrapped once (:func:`install`): the wrapper calls the original with the caller's
arguments and, while a trace is recorded, writes what it read and returned under the path of the
module that called it (:func:`parity.record.hooks.running_module`):

* ``<path>.conv_out`` ``(batch, seq, channels)``: the conv's output after its activation (the
  function's ``(batch, channels, seq)``, transposed: channels last like every other node), for this
  call's tokens. With a cache, ``causal_conv1d_fn`` convolves the cached inputs and the new ones
  together and the layer keeps the last ``seq`` outputs; the wrapper cannot tell ``seq`` from its
  arguments, so where the delta rule follows (it can) the conv's output waits for it and is cut to
  the rule's length there (recorded before ``beta``: the order is the reference's);
* ``<path>.beta``, ``<path>.g`` ``(batch, seq, v_heads)``: the rule's write strength and log decay,
  as passed to it;
* ``<path>.q_l2norm``, ``<path>.k_l2norm`` ``(batch, seq, v_heads, d_k)`` float32: q and k after
  the rule's own L2 norm (``use_qk_l2norm_in_kernel``), as the rule holds them (repeated for
  every value head they serve): the outputs of the modeling file's ``l2norm`` calls inside the
  rule, observed, not recomputed;
* ``<path>.delta_out`` ``(batch, seq, v_heads, d_v)``: the rule's output;
* ``<path>.recurrent_state`` ``(batch, v_heads, d_k, d_v)`` float32: the state after the last
  token. Without a cache the layer does not ask for it; the wrapper then asks
  (``output_final_state=True``: the rule computes the state either way and only drops it) and
  hands the layer ``None`` as before.

Nothing is recorded, and the call is the original's, outside a trace or where no node is wanted.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from parity.record.hooks import active_trace, running_module

if TYPE_CHECKING:
    from parity.record.trace import Trace

CONV = ("causal_conv1d_fn", "causal_conv1d_update")
DELTA_RULE = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
SUFFIXES = ("conv_out", "beta", "g", "q_l2norm", "k_l2norm", "delta_out", "recurrent_state")

#: the ``l2norm`` outputs seen inside the delta rule running now (None outside one)
_L2NORMS: contextvars.ContextVar[list | None] = contextvars.ContextVar("parity_l2norms", default=None)
#: conv outputs waiting for the delta rule of the same module to say how many tokens the call has
_CONV_OUT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("parity_conv_out", default=None)


def _wanted(path: str | None) -> dict[str, str]:
    """``{suffix: node name}`` of the kernel nodes of ``path`` the active trace wants."""
    trace = active_trace()
    if trace is None or path is None:
        return {}
    return {s: f"{path}.{s}" for s in SUFFIXES if f"{path}.{s}" in trace.wanted}


#: ``Trace.extras`` key prefix of a short conv's weights, ``f"{CONV_WEIGHTS}{module path}"``
CONV_WEIGHTS = "conv_weights:"


@dataclass(frozen=True)
class ConvWeights:
    """What a short causal conv computed with (kept for diagnosis only, never compared): ``weight``
    ``(channels, taps)`` (tap ``taps - 1`` on the current token), ``bias`` ``(channels,)`` or None, the
    ``activation`` after it (None, ``"silu"``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str | None


def _keep_conv_weights(args: tuple, kwargs: dict) -> None:
    """The conv's weights under the calling module's path, once per trace (``causal_conv1d_fn(x, weight,
    bias=None, activation=None)``, the causal-conv1d package's API)."""
    trace, path = active_trace(), running_module()
    if trace is None or path is None or CONV_WEIGHTS + path in trace.extras:
        return
    given = dict(zip(("x", "weight", "bias", "activation"), args)) | kwargs
    weight = given.get("weight")
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        bias = given.get("bias")
        trace.extras[CONV_WEIGHTS + path] = ConvWeights(
            weight.detach(), bias.detach() if isinstance(bias, torch.Tensor) else None, given.get("activation")
        )


def _conv(original):
    @functools.wraps(original)
    def conv(*args, **kwargs):
        out = original(*args, **kwargs)
        _keep_conv_weights(args, kwargs)
        wanted = _wanted(running_module())
        if "conv_out" in wanted:
            if wanted.keys() & {"beta", "g", "delta_out"}:  # the rule follows: it knows this call's length
                pending = _CONV_OUT.get() or {}
                pending[wanted["conv_out"]] = out
                _CONV_OUT.set(pending)
            else:
                # a node is wanted only while a trace is active
                cast("Trace", active_trace()).add(wanted["conv_out"], out, _channels_last)
        return out

    return conv


def _channels_last(t):
    """``(batch, x, seq, ...)`` -> ``(batch, seq, x, ...)``. Views like this are applied by the trace to the
    tensor the layer goes on with (given as the live tensor), so a gradient hook on it sees what flows back."""
    return t.transpose(1, 2)


def _last_tokens_channels_last(t, seq: int):
    """The conv output ``(batch, channels, cached + seq)`` as this call's ``(batch, seq, channels)``."""
    return t[..., -seq:].transpose(1, 2)


def _record_conv_out(trace, name: str, seq: int) -> None:
    """The conv output waiting for this rule, cut to the rule's ``seq`` tokens (the layer keeps those)."""
    pending = _CONV_OUT.get()
    out = pending.pop(name, None) if pending else None
    if out is not None:
        trace.add(name, out, functools.partial(_last_tokens_channels_last, seq=seq))


def _delta_rule(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def delta_rule(*args, **kwargs):
        wanted = _wanted(running_module())
        if not wanted:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        trace, given = active_trace(), bound.arguments
        assert trace is not None  # wanted is empty unless a trace is active
        if "conv_out" in wanted:
            _record_conv_out(trace, wanted["conv_out"], given["g"].shape[1])  # g: (batch, seq, v_heads)
        for suffix in ("beta", "g"):
            if suffix in wanted:
                trace.add(wanted[suffix], given[suffix])
        asked = bool(given.get("output_final_state"))
        if "output_final_state" in given:
            given["output_final_state"] = True
        token = _L2NORMS.set([])
        try:
            out, state = original(*bound.args, **bound.kwargs)
            l2norms = cast(list, _L2NORMS.get())  # the list set above
        finally:
            _L2NORMS.reset(token)
        if given.get("use_qk_l2norm_in_kernel") and len(l2norms) >= 2:  # the rule normalises q, then k
            for suffix, tensor in zip(("q_l2norm", "k_l2norm"), l2norms[:2]):
                if suffix in wanted:
                    trace.add(wanted[suffix], tensor, _channels_last)
        if "delta_out" in wanted:
            trace.add(wanted["delta_out"], out)
        if "recurrent_state" in wanted and state is not None:
            trace.add(wanted["recurrent_state"], state)
        return out, state if asked else None

    return delta_rule


def _l2norm(original):
    @functools.wraps(original)
    def l2norm(*args, **kwargs):
        out = original(*args, **kwargs)
        seen = _L2NORMS.get()
        if seen is not None:
            seen.append(out)
        return out

    return l2norm


_WRAPPERS = {**{name: _conv for name in CONV}, **{name: _delta_rule for name in DELTA_RULE}, "l2norm": _l2norm}


def _wrap(modeling: ModuleType) -> None:
    """Wrap the kernel globals of one modeling module (once: a wrapper is never wrapped again)."""
    if not any(callable(getattr(modeling, name, None)) for name in (*CONV, *DELTA_RULE)):
        return
    for name, wrapper in _WRAPPERS.items():
        original = getattr(modeling, name, None)
        if callable(original) and not getattr(original, "__parity_kernel__", False):
            wrapped = wrapper(original)
            wrapped.__parity_kernel__ = True
            setattr(modeling, name, wrapped)


def install(reference: nn.Module) -> None:
    """Wrap the kernel functions of every modeling module the reference's layers come from."""
    for module in {sys.modules.get(type(m).__module__) for m in reference.modules()}:
        if module is not None:
            _wrap(module)


def calls_conv_kernels(reference: nn.Module) -> bool:
    """Whether some module of the reference comes from a modeling file with a short causal conv kernel
    (LFM2's, Gated DeltaNet's): its weights are kept under the calling module (:class:`ConvWeights`),
    which needs the module stack."""
    return any(
        callable(getattr(sys.modules.get(type(m).__module__), name, None)) for m in reference.modules() for name in CONV
    )


def is_kernel_node(name: str) -> bool:
    """Whether ``name`` is one of the nodes this module records (by its last component)."""
    return name.rsplit(".", 1)[-1] in SUFFIXES
