"""Weight tables as data and one generic applier (the random weights a check runs on are in
:mod:`parity.probes`).

A family's loader is a table ``{checkpoint key template: our parameter path}`` with ``{i}`` for the
layer index (the litgpt convention). An entry may instead say what the loader does to the tensor on
the way (:class:`Transposed`), so loader coverage and the alignment of a user's model can read it.

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

import torch
from torch import nn

from .errors import LoaderError


@dataclass(frozen=True)
class Transposed:
    """A table entry whose checkpoint tensor is stored transposed relative to ours (GPT-2's Conv1D
    ``(in, out)`` vs ``nn.Linear``'s ``(out, in)``): ours gets ``tensor.T`` (a view, no copy)."""

    target: str

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.T

    def describe(self, key: str) -> str:
        return f"{key}: transposed into {self.target}"


def _target(entry) -> str:
    return entry if isinstance(entry, str) else entry.target


def _indices(template: str, names) -> set[str]:
    pattern = re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")
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
            expanded[src.format(i=i)] = _target(entry).format(i=i) if isinstance(entry, str) else type(entry)(
                _target(entry).format(i=i)
            )
    return expanded


def _summary(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def apply_weight_table(model: nn.Module, state_dict: Mapping[str, torch.Tensor], table: Mapping[str, object]) -> dict[str, str]:
    """Assign the checkpoint's tensors to ``model``'s parameters as the table says, without copying.

    Tensors are wrapped, not copied, so a model loaded from the same state dict as another shares
    its storage. Returns the consumed checkpoint keys -> our parameter paths.

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

    problems, plan = [], {}
    missing, unknown, shapes, mismatched = [], [], [], set()
    for src, entry in expanded.items():
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
        tensor = state_dict[src] if isinstance(entry, str) else entry.apply(state_dict[src])
        if tuple(tensor.shape) != tuple(ours[dst].shape):
            moved = "" if isinstance(entry, str) else f" ({type(entry).__name__.lower()}: {tuple(tensor.shape)})"
            shapes.append(
                f"{src}: checkpoint {tuple(state_dict[src].shape)}{moved}, expected {tuple(ours[dst].shape)} ({dst})"
            )
            mismatched.add(id(ours[dst]))  # named here already, not again as "never written"
            continue
        plan[src] = (dst, tensor)
    # a tie in ours: one group may be written from two keys only when they hold the same values
    written: dict[int, str] = {}
    for src, (dst, tensor) in list(plan.items()):
        gid = id(ours[dst])
        if gid in written:
            first = written[gid]
            if not torch.equal(plan[first][1], tensor):
                problems.append(f"{src} differs from {first} but ours ties {dst} to {plan[first][0]} (one Parameter)")
            plan[src] = (dst, None)  # consumed, not assigned twice
        else:
            written[gid] = src
    if shapes:  # a wrong width mismatches every tensor: the first few say it, the count says how far it goes
        shapes.sort(key=lambda entry: tuple(int(n) for n in re.findall(r"\.(\d+)\.", entry.split(":", 1)[0])))
        shown = "; ".join(shapes[:3]) + (f"; ... ({len(shapes)} keys in all)" if len(shapes) > 3 else "")
        problems.insert(0, f"shape mismatch for {shown}")
    missing = [k for k in missing if id(ours[_target(expanded[k])]) not in written]  # a tied name is written through its group
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

    for src, (dst, tensor) in plan.items():
        if tensor is None:
            continue
        param = nn.Parameter(tensor, requires_grad=False)
        for name in group_of[dst]:
            module_path, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_path) if module_path else model, leaf, param)
    return {src: dst for src, (dst, _) in plan.items()}
