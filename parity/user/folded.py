"""Norm gains folded into the next weight at load: ``W' = W * g`` along W's input features.

An inference port may multiply a pre-norm's gain into the projections that read that norm (each input column
``j`` of ``q_proj``, ``k_proj``, ``v_proj`` times ``g[j]``) and run the norm without its weight: the product is
the same, ``(norm(x) * g) @ W^T = norm(x) @ (W * g)^T``. QuaRot and SpinQuant fuse RMSNorm gains this way before
rotating the weights; a port may do it to save a multiply. No parameter of ours then holds ``W`` in any
convention :mod:`parity.build.coverage` knows. This module names the pairs a fold can join (each norm of the
reference and the ``nn.Linear`` modules reading its output as it is, found by one forward) and the checkpoint
tensors folded so, for coverage to be asked again: the keys it then finds held are held in that form.
"""

from __future__ import annotations

import torch
from torch import nn

#: tokens of the forward that finds which projections read which norm
PROBE_TOKENS = 4


def norm_readers(reference: nn.Module, vocab_size: int) -> dict[str, list[str]]:
    """``{norm weight key: [weight keys of the nn.Linear modules reading that norm's output as it is]}`` for the
    reference's norms with a 1-D ``weight`` (a module whose class name says Norm), from one forward on a few
    tokens (the output tensor, or a view of all of it: ``hidden_states[:, -0:]`` before the head). Empty when
    the forward raises."""
    modules = dict(reference.named_modules())
    norms = {
        name: m
        for name, m in modules.items()
        if "Norm" in type(m).__name__ and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1
    }
    outputs: dict[tuple[int, int, tuple[int, ...]], str] = {}
    readers: dict[str, list[str]] = {}

    def where(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
        return t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape)

    def kept(name: str):
        def hook(_module, _args, out):
            if isinstance(out, torch.Tensor):
                outputs[where(out)] = name

        return hook

    def read(name: str):
        def hook(_module, args):
            x = args[0] if args else None
            norm = outputs.get(where(x)) if isinstance(x, torch.Tensor) else None
            if norm is not None:
                readers.setdefault(f"{norm}.weight", []).append(f"{name}.weight")

        return hook

    handles = [norms[n].register_forward_hook(kept(n)) for n in norms]
    handles += [m.register_forward_pre_hook(read(n)) for n, m in modules.items() if isinstance(m, nn.Linear)]
    ids = torch.arange(PROBE_TOKENS).remainder(max(int(vocab_size), 1))[None]
    device = next(iter(reference.parameters()), torch.empty(0)).device
    try:
        with torch.no_grad():
            reference(input_ids=ids.to(device))
    except Exception:  # a reference that cannot run here: no fold is looked for
        return {}
    finally:
        for h in handles:
            h.remove()
    return {g: sorted(set(ws)) for g, ws in readers.items()}


def folded_tensors(
    readers: dict[str, list[str]], state_dict: dict, unused: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """``(W * g for each unused weight key W reading a norm of gain g, {g: [those W]})``: the checkpoint tensors as
    a port folding the gains at load holds them (``W[:, j] * g[j]``, in W's dtype)."""
    todo = set(unused)
    folded: dict[str, torch.Tensor] = {}
    into: dict[str, list[str]] = {}
    for g_key, w_keys in readers.items():
        g = state_dict.get(g_key)
        for w_key in w_keys:
            w = state_dict.get(w_key)
            if w_key not in todo or g is None or w is None or w.dim() != 2 or w.shape[1] != g.numel():
                continue
            folded[w_key] = w * g.to(w.dtype)[None, :]
            into.setdefault(g_key, []).append(w_key)
    return folded, into
