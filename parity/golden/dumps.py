"""A runtime's dump, read for ``parity compare --dump``: tensors keyed by node name, in ``.safetensors``
files or ``.npy`` files named by node, and name maps that translate a runtime's own names and layouts.

A name map is a JSON object ``{runtime name: node name}`` or ``{runtime name: {"node": ..., "permute":
[...], "reshape": [...]}}``; ``{i}`` in both stands for a layer index (``"blk.{i}.attn_q":
"model.layers.{i}.self_attn.q_proj"``). ``permute`` reorders the dump tensor's axes, then ``reshape``
gives its shape (0 keeps that axis, as ONNX Reshape; -1 takes the rest). A dump key no entry matches
is taken as a node name. A tensor lacking a node's leading batch axis of size 1 is read as batch 1.
Only safetensors and ``.npy`` without pickled objects are read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from parity.util.errors import ParityError


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ParityError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ParityError(f"{what} {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise ParityError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno}") from None


@dataclass(frozen=True)
class NameRule:
    """One name-map entry: the runtime's name (``{i}`` = layer index) -> the node, and the layout
    change (``permute``, then ``reshape``, where 0 keeps that axis and -1 takes the rest) that brings
    the runtime's tensor into the node's."""

    runtime: str
    node: str
    permute: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None

    def match(self, key: str) -> str | None:
        if "{i}" not in self.runtime:
            return self.node if key == self.runtime else None
        pattern = "^" + re.escape(self.runtime).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$"
        m = re.match(pattern, key)
        return self.node.replace("{i}", m.group("i")) if m else None


def read_name_map(source) -> list[NameRule]:
    """A name map from a JSON file (or a dict): ``{runtime name: node name}`` or ``{runtime name:
    {"node": ..., "permute": [...], "reshape": [...]}}``; ``{i}`` stands for a layer index. Raises
    ParityError naming the entry."""
    if source is None:
        return []
    where = "--name-map"
    if not isinstance(source, Mapping):
        where = f"--name-map {source}"
        data = _read_json(Path(source).expanduser(), "--name-map")
    else:
        data = source
    if not isinstance(data, Mapping):
        raise ParityError(f"{where} must hold a JSON object of runtime name -> node name")
    rules = []
    for key, value in data.items():
        spec = {"node": value} if isinstance(value, str) else value
        if not isinstance(key, str) or not isinstance(spec, Mapping) or not isinstance(spec.get("node"), str):
            raise ParityError(
                f"{where}: entry {key!r} must map to a node name or to "
                '{"node": ..., "permute": [...], "reshape": [...]}'
            )
        unknown = set(spec) - {"node", "permute", "reshape"}
        if unknown:
            raise ParityError(
                f"{where}: entry {key!r} has unknown field(s) {', '.join(sorted(unknown))} (node, permute, reshape)"
            )
        if "{i}" in spec["node"] and "{i}" not in key:
            raise ParityError(
                f"{where}: entry {key!r} maps to {spec['node']!r}, whose {{i}} the runtime name does not give"
            )
        layout = {}
        for field_name in ("permute", "reshape"):
            v = spec.get(field_name)
            integers = isinstance(v, list) and v and all(isinstance(d, int) and not isinstance(d, bool) for d in v)
            if v is not None and not integers:
                raise ParityError(f"{where}: entry {key!r}: {field_name} must be a list of integers, got {v!r}")
            layout[field_name] = tuple(v) if v is not None else None
        if layout["permute"] is not None and sorted(layout["permute"]) != list(range(len(layout["permute"]))):
            order = list(layout["permute"])
            raise ParityError(
                f"{where}: entry {key!r}: permute {order} is not an order of the axes 0..{len(order) - 1}"
            )
        rules.append(NameRule(key, spec["node"], **layout))
    return rules


def _load_dump_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            reason = str(e).splitlines()[0]
            raise ParityError(
                f"dump file {path} cannot be read as .npy (pickled objects are never loaded): {reason}"
            ) from None
        if array.dtype.kind not in "fiub":
            raise ParityError(f"dump file {path} holds {array.dtype}, not numbers")
        return {path.name[: -len(".npy")]: torch.from_numpy(np.ascontiguousarray(array).copy())}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ParityError(f"dump file {path} is corrupt or truncated: {str(e).splitlines()[0]}") from None


def read_dump(path: str | Path) -> dict[str, torch.Tensor]:
    """A runtime's dump: every tensor of a ``.safetensors`` file, or of the ``.safetensors`` and
    ``.npy`` files of a folder (an ``.npy`` file's name, without ``.npy``, is its key). Raises
    ParityError (a missing or empty folder, a key in two files, an unreadable file)."""
    from parity.build.checkpoint import unreachable

    path = Path(path).expanduser()
    problem = unreachable(path, "--dump")
    if problem:
        raise ParityError(problem)
    suffixes = (".npy", ".safetensors")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and p.suffix in suffixes)
    if path.is_file() and path.suffix not in (".npy", ".safetensors"):
        raise ParityError(f"--dump {path} is neither a folder nor a .safetensors or .npy file")
    if not files:
        raise ParityError(f"--dump {path} holds no .safetensors or .npy files")
    found_in: dict[str, Path]
    tensors, found_in = {}, {}
    for f in files:
        for key, tensor in _load_dump_file(f).items():
            if key in tensors:
                raise ParityError(f"dump key {key!r} is in two files: {found_in[key].name} and {f.name}")
            tensors[key], found_in[key] = tensor, f
    return tensors


def _layout(tensor: torch.Tensor, rule: NameRule, key: str) -> torch.Tensor:
    try:
        if rule.permute is not None:
            tensor = tensor.permute(*rule.permute)
        if rule.reshape is not None:  # 0 keeps that axis, as ONNX Reshape does
            tensor = tensor.reshape(
                *(tensor.shape[i] if d == 0 and i < tensor.dim() else d for i, d in enumerate(rule.reshape))
            )
    except RuntimeError as e:
        raise ParityError(
            f"name map entry {rule.runtime!r} cannot be applied to dump tensor {key!r} of shape "
            f"{tuple(tensor.shape)}: {str(e).splitlines()[0]}"
        ) from None
    return tensor


def map_dump(dump: Mapping[str, torch.Tensor], rules: list[NameRule], shapes: Mapping[str, tuple[int, ...] | None]):
    """``(tensors by node, dump key by node, notes)``: the dump's keys through the name map (a key no
    entry matches is taken as a node name), its layout changes applied, and a missing leading batch
    axis of size 1 restored. ``shapes``: every node of the trace and its shape (None if unknown)."""
    known = set(shapes)
    keys: dict[str, str]
    tensors, keys, unmatched, batchless = {}, {}, [], []
    for key, tensor in dump.items():
        rule = next((r for r in rules if r.match(key) is not None), None)
        node = rule.match(key) if rule is not None else key
        if node not in known:
            unmatched.append(key if node == key else f"{key} -> {node}")
            continue
        if node in tensors:
            raise ParityError(f"dump keys {keys[node]!r} and {key!r} both map to node {node}")
        if rule is not None:
            tensor = _layout(tensor, rule, key)
        ref_shape = shapes.get(node)
        if ref_shape and ref_shape[0] == 1 and tuple(tensor.shape) == ref_shape[1:]:
            tensor = tensor.unsqueeze(0)
            batchless.append(key)
        tensors[node], keys[node] = tensor, key
    notes = []
    if unmatched:
        shown = ", ".join(unmatched[:5]) + (f", ... ({len(unmatched)} in all)" if len(unmatched) > 5 else "")
        notes.append(
            f"{len(unmatched)} dump tensor(s) match no node of the trace ({shown}); a --name-map entry "
            "translates a runtime's own names"
        )
    if batchless:
        notes.append(
            f"{len(batchless)} dump tensor(s) had no batch axis ({', '.join(batchless[:3])}"
            f"{', ...' if len(batchless) > 3 else ''}); read as batch 1"
        )
    return tensors, keys, notes
