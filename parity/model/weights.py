"""Weight tables as data and one generic applier (the random weights a check runs on are in
:mod:`parity.build.probes`).

A family's loader is a table ``{checkpoint key template: our parameter path}`` with ``{i}`` for the
layer index (the litgpt convention). An entry may instead say what the loader does to the tensor on
the way (:class:`Transposed`) or that one fused checkpoint tensor feeds several of our parameters
(:class:`Split`), so loader coverage and the alignment of a user's model can read it.

:func:`apply_weight_table` needs nothing but the table, the model and the checkpoint:

* ``{i}`` expands over every layer index either side has;
* an entry whose checkpoint key and our parameter are *both* absent is skipped (an optional part
  such as attention biases or an untied head that this config does not have);
* our own ties (one Parameter reachable under two names, e.g. ``out_head.weight`` and
  ``tok_emb.weight``) are kept: writing one name writes the whole group;
* everything else that does not fit is one LoaderError naming every key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from parity.util.errors import LoaderError


@dataclass(frozen=True)
class Transposed:
    """A table entry whose checkpoint tensor is stored transposed relative to ours (GPT-2's Conv1D
    ``(in, out)`` vs ``nn.Linear``'s ``(out, in)``): ours gets ``tensor.T`` (a view, no copy)."""

    target: str

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.T

    def describe(self, key: str) -> str:
        return f"{key}: transposed into {self.target}"


@dataclass(frozen=True)
class Split:
    """A table entry whose checkpoint tensor is several of our parameters fused: each target gets a
    view of its part (no copy, so the storage stays shared and loader coverage can account for every
    slice exactly once).

    ``targets``: our parameter paths in the order their parts are stored (``("...fc1.weight",
    "...fc2.weight")`` for a ``gate_up_proj`` whose first half is the gate). The tensor (or, with
    ``{e}`` in the targets, each ``tensor[e]``: the first dimension indexes experts, one set of
    targets per ``e``) is cut into ``len(targets)`` equal chunks along ``dim``. Transformers 5 stores
    MoE experts so: ``experts.gate_up_proj`` ``(E, 2I, H)`` -> ``Split((gate_e, up_e))``,
    ``experts.down_proj`` ``(E, H, I)`` -> ``Split((down_e,))``.
    """

    targets: tuple[str, ...]
    dim: int = 0

    @property
    def target(self) -> str:
        return self.targets[0]

    @property
    def per_index(self) -> bool:
        return "{e}" in self.targets[0]

    def parts(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(concrete target, view)]`` in storage order; ValueError when the tensor does not cut evenly."""
        groups = [(e, tensor[e]) for e in range(tensor.shape[0])] if self.per_index else [(None, tensor)]
        out = []
        for e, t in groups:
            if t.dim() <= self.dim or t.shape[self.dim] % len(self.targets):
                raise ValueError(
                    f"cannot cut {tuple(t.shape)} into {len(self.targets)} equal parts along dim {self.dim}"
                )
            for target, part in zip(self.targets, t.chunk(len(self.targets), dim=self.dim)):
                out.append((target if e is None else target.replace("{e}", str(e)), part))
        return out

    def describe(self, key: str) -> str:
        per = " per index of dim 0" if self.per_index else ""
        return f"{key}: split{per} into {', '.join(self.targets)}"


def _target(entry) -> str:
    return entry if isinstance(entry, str) else entry.target


def _concrete(entry, i: str):
    """``entry`` with ``{i}`` filled in (``{e}`` stays for :class:`Split`)."""
    if isinstance(entry, str):
        return entry.format(i=i)
    if isinstance(entry, Split):
        return Split(tuple(t.replace("{i}", i) for t in entry.targets), entry.dim)
    return type(entry)(_target(entry).format(i=i))


def _indices(template: str, names) -> set[str]:
    pattern = re.compile(
        "^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)").replace(re.escape("{e}"), r"\d+") + "$"
    )
    return {m.group(1) for m in map(pattern.match, names) if m}


def expand_table(table: Mapping[str, object], checkpoint_keys, our_names) -> dict[str, object]:
    """``{i}`` templates -> concrete entries, for every layer index found on either side."""
    our_names = list(our_names)
    expanded: dict[str, object] = {}
    for src, entry in table.items():
        if "{i}" not in src:
            expanded[src] = entry
            continue
        indices = _indices(src, checkpoint_keys) | _indices(_target(entry), our_names)
        for i in sorted(indices, key=int):
            expanded[src.format(i=i)] = _concrete(entry, i)
    return expanded


def _summary(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _split_problems(src: str, entry: Split, tensor: torch.Tensor, ours: dict) -> tuple[list, list, list, list]:
    """``(plan items, unknown, shape problems, mismatched parameter ids)`` of one :class:`Split` entry."""
    try:
        parts = entry.parts(tensor)
    except ValueError as e:
        pattern = re.compile(
            "^(?:" + "|".join(re.escape(t).replace(re.escape("{e}"), r"\d+") for t in entry.targets) + ")$"
        )
        targets = [id(p) for name, p in ours.items() if pattern.match(name)]  # named here, not again as "never written"
        return [], [], [f"{src}: checkpoint {tuple(tensor.shape)}: {e} ({', '.join(entry.targets)})"], targets
    items, unknown, shapes, mismatched = [], [], [], []
    for n, (dst, view) in enumerate(parts):
        label = f"{src}[{n // len(entry.targets)}]" if entry.per_index else src
        if dst not in ours:
            unknown.append(f"{label} -> {dst}")
        elif tuple(view.shape) != tuple(ours[dst].shape):
            shapes.append(f"{label}: checkpoint part {tuple(view.shape)}, expected {tuple(ours[dst].shape)} ({dst})")
            mismatched.append(id(ours[dst]))
        else:
            items.append((src, dst, view))
    return items, unknown, shapes, mismatched


def apply_weight_table(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], table: Mapping[str, object]
) -> dict[str, str]:
    """Assign the checkpoint's tensors to ``model``'s parameters as the table says, without copying.

    Tensors are wrapped, not copied, so a model loaded from the same state dict as another shares
    its storage (a :class:`Split` entry assigns views of one tensor). Returns the consumed
    checkpoint keys -> our parameter paths (a split key: its first and last target and how many).

    Raises:
        LoaderError: naming every missing key, unused key, shape mismatch (key, checkpoint shape,
            expected shape), untied pair whose values differ, and parameter of ours the table never writes.
    """
    ours = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, p in ours.items():
        groups.setdefault(id(p), []).append(name)
    group_of = {name: groups[id(p)] for name, p in ours.items()}
    expanded = expand_table(table, state_dict.keys(), ours)

    problems, plan = [], []  # plan: (checkpoint key, our parameter, tensor or view)
    missing, unknown, shapes, mismatched = [], [], [], set()
    for src, entry in expanded.items():
        if isinstance(entry, Split):
            in_ckpt = src in state_dict
            in_ours = (
                any(_indices(t.replace("{e}", "{i}"), ours) for t in entry.targets)
                if entry.per_index
                else any(t in ours for t in entry.targets)
            )
            if not in_ckpt and in_ours:
                missing.append(src)
            elif in_ckpt:
                items, bad_targets, bad_shapes, bad_ids = _split_problems(src, entry, state_dict[src], ours)
                plan += items
                unknown += bad_targets
                shapes += bad_shapes
                mismatched.update(bad_ids)
            continue
        dst = _target(entry)
        in_ckpt, in_ours = src in state_dict, dst in ours
        if not in_ckpt and not in_ours:
            continue  # an optional part this config does not have on either side
        if in_ckpt and not in_ours:
            unknown.append(f"{src} -> {dst}")
            continue
        if not in_ckpt:
            missing.append(src)
            continue
        tensor = state_dict[src] if isinstance(entry, str) else cast(Transposed, entry).apply(state_dict[src])
        if tuple(tensor.shape) != tuple(ours[dst].shape):
            moved = "" if isinstance(entry, str) else f" ({type(entry).__name__.lower()}: {tuple(tensor.shape)})"
            shapes.append(
                f"{src}: checkpoint {tuple(state_dict[src].shape)}{moved}, expected {tuple(ours[dst].shape)} ({dst})"
            )
            mismatched.add(id(ours[dst]))  # named here already, not again as "never written"
            continue
        plan.append((src, dst, tensor))
    # a tie in ours: one group may be written from two keys only when they hold the same values
    written: dict[int, int] = {}
    for n, (src, dst, tensor) in enumerate(plan):
        gid = id(ours[dst])
        if gid in written:
            first_src, first_dst, first_tensor = plan[written[gid]]
            if not torch.equal(first_tensor, tensor):
                problems.append(f"{src} differs from {first_src} but ours ties {dst} to {first_dst} (one Parameter)")
            plan[n] = (src, dst, None)  # consumed, not assigned twice
        else:
            written[gid] = n
    if shapes:  # a wrong width mismatches every tensor: the first few say it, the count says how far it goes
        shapes.sort(key=lambda entry: tuple(int(n) for n in re.findall(r"\.(\d+)\.", entry.split(":", 1)[0])))
        shown = "; ".join(shapes[:3]) + (f"; ... ({len(shapes)} keys in all)" if len(shapes) > 3 else "")
        problems.insert(0, f"shape mismatch for {shown}")
    missing = [
        k
        for k in missing
        if isinstance(expanded[k], Split)
        or id(ours[_target(expanded[k])]) not in written  # a tied name is written through its group
    ]
    if missing:
        problems.append(f"missing checkpoint keys: {_summary(missing)}")
    if unknown:
        problems.append(f"checkpoint keys mapped to no parameter of ours: {_summary(unknown)}")
    unused = [k for k in state_dict if k not in expanded]
    if unused:
        problems.append(f"unused checkpoint keys: {_summary(unused)}")
    accounted = set(written) | mismatched
    unwritten = sorted({name for name in ours if id(ours[name]) not in accounted})
    if unwritten:
        problems.append(f"parameters of ours never written: {_summary(unwritten)}")
    if problems:
        raise LoaderError("; ".join(problems))

    consumed: dict[str, list[str]] = {}
    for src, dst, tensor in plan:
        consumed.setdefault(src, []).append(dst)
        if tensor is None:
            continue
        param = nn.Parameter(tensor, requires_grad=False)
        for name in group_of[dst]:
            module_path, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_path) if module_path else model, leaf, param)
    return {
        src: dsts[0] if len(dsts) == 1 else f"{dsts[0]} .. {dsts[-1]} ({len(dsts)} views)"
        for src, dsts in consumed.items()
    }


def storage_key(t: torch.Tensor) -> tuple:
    return (
        t.device.type,
        t.untyped_storage().data_ptr() if not t.is_meta else id(t),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
    )


def parameter_storages(model: nn.Module) -> dict[str, tuple]:
    """Our parameter name -> where its data lives, taken right after loading, so that
    :func:`loader_coverage` can tell a loader's gap from a Parameter replaced afterwards."""
    return {name: storage_key(p.data) for name, p in model.named_parameters(remove_duplicate=False)}
