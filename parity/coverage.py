"""Loader coverage: did every checkpoint tensor land in exactly one parameter of ours, and nothing else?

Judged from the loaded model itself, not from the loader's table, so it holds for any loader:
each of our parameters is traced back to the checkpoint tensor whose storage it shares (or,
failing that, whose values it equals, as a copy or a transpose).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Coverage:
    """What the loader did with a checkpoint. ``gaps`` are failures; the rest is information.

    ``consumed``: checkpoint key -> our parameter names (a tied group counts once).
    ``unused``: checkpoint keys no parameter came from. ``unwritten``: our parameters that hold
    no checkpoint tensor (never written, still their initial values). ``conversions``: dtype casts
    and layout changes on the way (``key: float32 -> bfloat16``, ``key: transposed``). ``copies``:
    parameters equal to a checkpoint tensor by value but not sharing its storage. ``tied``: one
    line per tie the reference's config asks for, saying whether ours keeps one Parameter.
    """

    consumed: dict[str, list[str]] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    unwritten: list[str] = field(default_factory=list)
    conversions: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.gaps

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "gaps": self.gaps,
            "consumed": len(self.consumed),
            "unused": self.unused,
            "unwritten": self.unwritten,
            "conversions": self.conversions,
            "copies": self.copies,
            "tied": self.tied,
        }


def _storage(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr() if not t.is_meta else id(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def loader_coverage(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    tied_keys: dict[str, str] | None = None,
    conversions: list[str] | None = None,
) -> Coverage:
    """Trace every parameter of ``model`` back to ``state_dict`` (the tensors it was loaded from).

    ``tied_keys``: checkpoint key -> the key it must be tied to (Transformers'
    ``_tied_weights_keys`` when the config ties embeddings); ours must then hold one Parameter for
    both. ``conversions``: casts already applied to the state dict, reported as they are.
    """
    cov = Coverage(conversions=list(conversions or []))
    # checkpoint keys that alias one storage (state_dict() of a tied model) form one source
    sources: dict[tuple, list[str]] = {}
    for key, tensor in state_dict.items():
        sources.setdefault(_storage(tensor), []).append(key)
    by_shape: dict[tuple, list[str]] = {}
    for key, tensor in state_dict.items():
        by_shape.setdefault(tuple(tensor.shape), []).append(key)

    params: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), (p, []))[1].append(name)

    origin: dict[str, str] = {}  # our parameter name -> checkpoint key
    for p, names in params.values():
        label = " = ".join(names)
        keys = sources.get(_storage(p.data))
        if keys:
            for key in keys:
                cov.consumed.setdefault(key, []).append(label)
            origin.update({n: keys[0] for n in names})
            continue
        if p.is_meta:
            cov.unwritten.append(f"{label} (never written: still on the meta device)")
            continue
        match = next((k for k in by_shape.get(tuple(p.shape), []) if torch.equal(p.data, state_dict[k].to(p.dtype))), None)
        if match is not None:
            cov.consumed.setdefault(match, []).append(label)
            cov.copies.append(f"{label} is a copy of {match}")
            origin.update({n: match for n in names})
            continue
        if p.dim() == 2:
            match = next(
                (k for k in by_shape.get(tuple(p.shape[::-1]), []) if torch.equal(p.data, state_dict[k].to(p.dtype).T)),
                None,
            )
            if match is not None:
                cov.consumed.setdefault(match, []).append(label)
                cov.conversions.append(f"{match}: transposed into {label}")
                origin.update({n: match for n in names})
                continue
        cov.unwritten.append(f"{label} (holds no checkpoint tensor)")

    for storage_keys in sources.values():
        used = [k for k in storage_keys if k in cov.consumed]
        if not used:
            cov.unused.extend(k for k in storage_keys if not (tied_keys and k in tied_keys))
    for key, targets in cov.consumed.items():
        if len(targets) > 1:
            cov.gaps.append(f"{key} consumed {len(targets)} times: {', '.join(targets)}")
    def consumers(key: str) -> list[str]:
        aliases = sources.get(_storage(state_dict[key]), [key]) if key in state_dict else []
        return [label for k in aliases for label in cov.consumed.get(k, [])]

    for target, source in (tied_keys or {}).items():
        labels = consumers(source)
        if len(labels) == 1 and " = " in labels[0]:  # one Parameter reachable under several names
            cov.tied.append(f"{target} -> {source}: one Parameter ({labels[0]})")
        else:
            found = ", ".join(labels) or "no parameter"
            cov.tied.append(f"{target} -> {source}: not tied in ours ({found})")
            cov.gaps.append(f"tied weights {target} and {source} are not the same Parameter in ours: {found}")
    if cov.unused:
        cov.gaps.append(f"checkpoint keys never used: {', '.join(cov.unused)}")
    if cov.unwritten:
        cov.gaps.append(f"parameters of ours holding no checkpoint tensor: {', '.join(cov.unwritten)}")
    return cov
