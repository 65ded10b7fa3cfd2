"""Capture what Transformers computes outside nn.Modules: post-RoPE q/k, attention probabilities, context.

Transformers models dispatch attention through ``AttentionInterface``. We register one function,
``parity_eager``, that calls the model's *own* ``eager_attention_forward`` (the reference math,
unchanged) and writes its inputs and outputs into the active trace. Transformers only builds a
mask for implementations it knows, so the same name is registered in ``AttentionMaskInterface``
with the eager mask; without that the function would receive ``attention_mask=None`` and the
reference would silently attend to every position.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from .errors import ParityError
from .trace import active_trace

ATTN_IMPLEMENTATION = "parity_eager"
SUFFIXES = ("q_rot", "k_rot", "scores", "probs", "context")

_paths: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _eager_for(module: nn.Module):
    modeling = sys.modules[type(module).__module__]
    eager = getattr(modeling, "eager_attention_forward", None)
    if eager is None:
        raise ParityError(f"{type(module).__name__} has no eager_attention_forward in {modeling.__name__}")
    return eager


def _scores(module, query, key, scaling) -> torch.Tensor:
    """``(q @ k^T) * scaling`` before soft-cap and mask, with the ops eager attention uses (so the
    same bits): K heads expanded as ``repeat_kv`` does (each KV head repeated for its group)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        b, kv, s, d = key.shape
        key = key[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)
    return torch.matmul(query, key.transpose(2, 3)).mul_(scaling)  # in place: one matrix, not two, at a time


def parity_attention(module, query, key, value, attention_mask, **kwargs):
    """AttentionInterface function: the model's eager attention, recorded.

    Records ``<path>.q_rot`` ``(batch, heads, seq, head_dim)``, ``<path>.k_rot`` ``(batch, kv_heads,
    seq, head_dim)``, ``<path>.scores`` and ``<path>.probs`` ``(batch, heads, q_len, kv_len)`` (scores:
    ``q k^T * scaling`` before soft-cap and mask) and ``<path>.context`` ``(batch, seq, heads * head_dim)``.
    """
    output, weights = _eager_for(module)(module, query, key, value, attention_mask, **kwargs)
    trace = active_trace()
    path = _paths.get(module)
    if trace is not None and path is not None:
        context = output.reshape(*output.shape[:2], -1)
        for suffix, tensor in zip(SUFFIXES, (query, key, None, weights, context)):
            name = f"{path}.{suffix}"
            if name in trace.wanted:
                if suffix == "scores":
                    tensor = _scores(module, query, key, kwargs.get("scaling", getattr(module, "scaling", 1.0)))
                trace.add(name, tensor)
    return output, weights


def install(reference: nn.Module) -> None:
    """Register ``parity_eager`` (attention + mask) and switch ``reference`` to it (once per model).

    Raises ParityError if the model does not dispatch attention through AttentionInterface.
    """
    if getattr(reference.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION and reference in _paths:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, parity_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
    if not getattr(reference, "_supports_attention_backend", False):
        raise ParityError(f"{type(reference).__name__} does not dispatch attention through AttentionInterface")
    reference.set_attn_implementation(ATTN_IMPLEMENTATION)
    for name, module in reference.named_modules():
        _paths[module] = name
