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
    ``replaced``: parameters of ours that held a checkpoint tensor when the pair was built and were
    replaced since (``module.weight = nn.Parameter(...)``, how a fault is injected by hand): the
    loader did its part, so they are named here once and judged by the nodes, not as gaps.
    """

    consumed: dict[str, list[str]] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    unwritten: list[str] = field(default_factory=list)
    conversions: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)
    #: our parameters replaced after the pair was built (a fault injected by hand): not a loader gap
    replaced: list[str] = field(default_factory=list)

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
            "replaced": self.replaced,
        }

    def replaced_note(self) -> str | None:
        """One sentence for every parameter replaced after loading, or None."""
        if not self.replaced:
            return None
        shown = "; ".join(self.replaced[:3]) + (f"; ... ({len(self.replaced)} in all)" if len(self.replaced) > 3 else "")
        return (
            f"ours no longer holds the checkpoint tensor of {len(self.replaced)} parameter"
            f"{'s' if len(self.replaced) != 1 else ''} replaced after the pair was built ({shown}); "
            "loader coverage does not judge them, the nodes do"
        )


def _storage(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr() if not t.is_meta else id(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def parameter_storages(model: nn.Module) -> dict[str, tuple]:
    """Our parameter name -> where its data lives, taken right after loading, so that
    :func:`loader_coverage` can tell a loader's gap from a Parameter replaced afterwards."""
    return {name: _storage(p.data) for name, p in model.named_parameters(remove_duplicate=False)}


def loader_coverage(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    tied_keys: dict[str, str] | None = None,
    conversions: list[str] | None = None,
    built: dict[str, tuple] | None = None,
) -> Coverage:
    """Trace every parameter of ``model`` back to ``state_dict`` (the tensors it was loaded from).

    ``tied_keys``: checkpoint key -> the key it must be tied to (Transformers'
    ``_tied_weights_keys`` when the config ties embeddings); ours must then hold one Parameter for
    both. ``conversions``: casts already applied to the state dict, reported as they are.
    ``built``: :func:`parameter_storages` taken right after loading; a parameter that held a
    checkpoint tensor then and another tensor now was replaced by hand, and lands in ``replaced``.
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
    set_aside: set[str] = set()  # checkpoint keys whose parameter was replaced after loading
    for p, names in params.values():
        label = " = ".join(names)
        was = [built[n] for n in names if built and n in built and built[n] != _storage(p.data) and built[n] in sources]
        if was:
            before = sources[was[0]]
            now = sources.get(_storage(p.data))
            holds = f"now shares {now[0]}" if now else "now a tensor of its own"
            cov.replaced.append(f"{label} (held {before[0]}; {holds})")
            set_aside.update(before)
            continue
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
        used = [k for k in storage_keys if k in cov.consumed or k in set_aside]
        if not used:
            cov.unused.extend(k for k in storage_keys if not (tied_keys and k in tied_keys))
    for key, targets in cov.consumed.items():
        if len(targets) > 1:
            cov.gaps.append(f"{key} consumed {len(targets)} times: {', '.join(targets)}")
    def consumers(key: str) -> list[str]:
        aliases = sources.get(_storage(state_dict[key]), [key]) if key in state_dict else []
        return [label for k in aliases for label in cov.consumed.get(k, [])]

    for target, source in (tied_keys or {}).items():
        if {target, source} & set_aside:
            cov.tied.append(f"{target} -> {source}: not judged (a parameter of the tie was replaced after loading)")
            continue
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
