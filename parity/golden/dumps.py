"""A runtime's dump, read for ``parity compare --dump``: tensors keyed by node name, in ``.safetensors``
files or ``.npy`` files named by node, what the dump says about itself (``parity-dump.json``), and
name maps that translate a runtime's own names and layouts.

**A name map** is a JSON object. Each entry maps a runtime name to a node, ``{runtime name: node
name}``, or to a node and the layout change that brings the runtime's tensor into the node's::

    {"Qcur-{i}#last": {"node": "model.layers.{i}.self_attn.q_rot",
                       "ops": [{"reshape": [0, 0, -1, 2]}, {"permute": [1, 0, 3, 2]}, {"reshape": [0, 0, -1]}]}}

``{i}`` stands for a layer index, in the runtime name and the node alike. A runtime name may end in
a *write*: a runtime that writes one name several times (llama.cpp's ``Qcur-0`` is the projection,
its reshaped view and the rotated result) dumps the writes as ``NAME``, ``NAME#1``, ``NAME#2``...,
and an entry picks one with ``#N`` (the N-th write, from 0), ``#last`` (the last write) or ``#{i}``
(write ``i`` is layer ``i``: a name that carries no layer index). An entry without a write matches
only a name written once; a name written several times must say which write it means.

``ops`` are applied in order (one key each):

``{"reshape": [d, ...]}``
    0 keeps that axis (as ONNX Reshape), -1 takes the rest, and a name stands for a size of the
    trace: ``batch``, ``seq``, ``heads``, ``kv_heads``, ``head_dim``, ``hidden``, ``vocab``,
    ``intermediate`` (``["batch", "seq", -1]`` unflattens a token axis that holds several sequences);
``{"permute": [a, ...]}``
    reorders the axes;
``{"slice": [axis, start, stop]}``
    keeps ``start:stop`` of an axis (``stop`` may be a size name, or null for the end): llama.cpp's
    ``kq`` holds 256 cache slots, of which the sequence is the first ``seq``;
``{"select": [axis, index]}``
    takes one index of an axis and drops the axis;
``{"scale": x}``
    multiplies by a number, or by ``attention_scale`` (the reference's ``q k^T`` scale of that layer):
    a runtime that scales inside its softmax dumps unscaled scores.

The older ``"permute"`` and ``"reshape"`` fields of an entry still work (permute, then reshape) and
cannot be mixed with ``ops``. Reserved keys: ``"@unavailable": {node glob: reason}`` names the nodes
the runtime cannot produce (fused attention has no ``scores`` or ``probs``): they are ``untapped``,
shown and counted, never a failure; ``"@notes": [...]`` are shown with the result (a runtime's
precision choices); ``"@about"`` is a comment. A dump key no entry matches is taken as a node name. A tensor lacking a node's
leading batch axis of size 1 is read as batch 1.

**parity-dump.json**, beside the tensors of a dump folder, says what the dump cannot say in tensors:
``{"format": "parity-dump", "version": 1, "runtime": "...", "name_map": {...}, "unavailable":
{node glob: reason}, "notes": [...]}``, every field but ``format`` and ``version`` optional. Its
``name_map`` is used when ``--name-map`` gives none; ``unavailable`` and ``notes`` join the name map's.

Only safetensors and ``.npy`` without pickled objects are read.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parity.util.errors import ParityError

#: the file of a dump folder that says what the dump is (see the module docstring)
DUMP_INFO = "parity-dump.json"
DUMP_FORMAT = "parity-dump"
DUMP_VERSION = 1
#: the transforms a name-map entry's ``ops`` may use, each with what it takes
OPS = {
    "reshape": "a list of sizes (0 keeps an axis, -1 takes the rest, or a size name)",
    "permute": "an order of the axes",
    "slice": "[axis, start, stop] (stop: an integer, a size name or null)",
    "select": "[axis, index]",
    "scale": "a number or attention_scale",
}
#: sizes a reshape or a slice may name, from the trace
SIZE_NAMES = ("batch", "seq", "heads", "kv_heads", "head_dim", "hidden", "vocab", "intermediate")
#: reserved name-map keys
UNAVAILABLE, NOTES, ABOUT = "@unavailable", "@notes", "@about"

_WRITE = re.compile(r"^(?P<base>.*?)#(?P<write>\d+|last|\{i\})$")
_DUMP_WRITE = re.compile(r"^(?P<base>.*)#(?P<write>[1-9]\d*)$")


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
    """One name-map entry: the runtime's name (``{i}`` = layer index) and which of its writes
    (``write``: None = the only one, an integer, ``"last"`` or ``"{i}"`` = the layer) -> the node, and
    the ops that bring the runtime's tensor into the node's layout (``permute`` then ``reshape`` of
    the older form become ops)."""

    runtime: str
    node: str
    permute: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None
    ops: tuple[tuple[str, Any], ...] = ()
    write: int | str | None = None

    @property
    def steps(self) -> tuple[tuple[str, Any], ...]:
        older: tuple[tuple[str, Any], ...] = (("permute", self.permute),) if self.permute is not None else ()
        older += (("reshape", self.reshape),) if self.reshape is not None else ()
        return older + self.ops

    @property
    def key(self) -> str:
        """The entry as the name map writes it."""
        return self.runtime if self.write is None else f"{self.runtime}#{self.write}"

    def match(self, key: str) -> str | None:
        """The node a runtime name (without a write) maps to, or None."""
        if "{i}" not in self.runtime:
            return self.node if key == self.runtime else None
        pattern = "^" + re.escape(self.runtime).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$"
        m = re.match(pattern, key)
        return self.node.replace("{i}", m.group("i")) if m else None

    def runtime_name(self, node: str) -> str | None:
        """The dump key this entry reads for ``node`` (None when it gives another node)."""
        if "{i}" not in self.node:
            return self.key if node == self.node else None
        m = re.fullmatch(re.escape(self.node).replace(re.escape("{i}"), r"(\d+)"), node)
        if m is None:
            return None
        if self.write == "{i}":
            return f"{self.runtime}#{m.group(1)}"
        return self.key.replace("{i}", m.group(1))


@dataclass(frozen=True)
class NameMap:
    """A read name map: its rules, the nodes the runtime cannot produce (glob -> reason) and notes."""

    rules: tuple[NameRule, ...] = ()
    unavailable: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def unavailable_reason(self, node: str) -> str | None:
        return next((r for glob, r in self.unavailable.items() if fnmatch.fnmatchcase(node, glob)), None)

    def merged(self, other: NameMap) -> NameMap:
        """This map's rules, and both maps' unavailable nodes and notes (this one's win)."""
        return NameMap(self.rules, {**other.unavailable, **self.unavailable}, self.notes + other.notes)


def _integers(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(d, int) and not isinstance(d, bool) for d in v)


def _size(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or v in SIZE_NAMES


def _check_op(where: str, key: str, n: int, op) -> tuple[str, Any]:
    said = f"{where}: entry {key!r}, ops[{n}]"
    if not isinstance(op, Mapping) or len(op) != 1:
        raise ParityError(f"{said} must be one object with one key of {', '.join(OPS)}, got {op!r}")
    ((name, arg),) = op.items()
    if name not in OPS:
        raise ParityError(f"{said}: unknown op {name!r} (known: {', '.join(OPS)})")
    ok = {
        "reshape": isinstance(arg, list) and bool(arg) and all(_size(d) for d in arg),
        "permute": _integers(arg) and sorted(arg) == list(range(len(arg))),
        "slice": isinstance(arg, list)
        and len(arg) == 3
        and _size(arg[0])
        and isinstance(arg[0], int)
        and _size(arg[1])
        and (arg[2] is None or _size(arg[2])),
        "select": _integers(arg) and len(arg) == 2,
        "scale": (isinstance(arg, (int, float)) and not isinstance(arg, bool) and math.isfinite(arg))
        or arg == "attention_scale",
    }[name]
    if not ok:
        raise ParityError(f"{said}: {name} takes {OPS[name]}, got {arg!r}")
    if name == "reshape" and sum(d == -1 for d in arg) > 1:
        raise ParityError(f"{said}: reshape {arg} has more than one -1")
    return name, tuple(arg) if isinstance(arg, list) else arg


def _rule(where: str, key, value) -> NameRule:
    spec = {"node": value} if isinstance(value, str) else value
    if not isinstance(key, str) or not isinstance(spec, Mapping) or not isinstance(spec.get("node"), str):
        raise ParityError(
            f"{where}: entry {key!r} must map to a node name or to "
            '{"node": ..., "ops": [...]} (or the older {"node": ..., "permute": [...], "reshape": [...]})'
        )
    unknown = set(spec) - {"node", "permute", "reshape", "ops"}
    if unknown:
        raise ParityError(
            f"{where}: entry {key!r} has unknown field(s) {', '.join(sorted(unknown))} (node, ops, permute, reshape)"
        )
    m = _WRITE.match(key)
    runtime, write = (m.group("base"), m.group("write")) if m else (key, None)
    if "#" in runtime:
        raise ParityError(f"{where}: entry {key!r}: a write is #N, #last or #{{i}} at the end of the name")
    node = spec["node"]
    if write == "{i}" and "{i}" in runtime:
        raise ParityError(f"{where}: entry {key!r} gives the layer twice ({{i}} in the name and as the write)")
    if "{i}" in node and "{i}" not in runtime and write != "{i}":
        raise ParityError(f"{where}: entry {key!r} maps to {node!r}, whose {{i}} the runtime name does not give")
    layout: dict = {}
    for field_name in ("permute", "reshape"):
        v = spec.get(field_name)
        if v is not None and not _integers(v):
            raise ParityError(f"{where}: entry {key!r}: {field_name} must be a list of integers, got {v!r}")
        layout[field_name] = tuple(v) if v is not None else None
    if layout["permute"] is not None and sorted(layout["permute"]) != list(range(len(layout["permute"]))):
        order = list(layout["permute"])
        raise ParityError(f"{where}: entry {key!r}: permute {order} is not an order of the axes 0..{len(order) - 1}")
    ops = spec.get("ops")
    if ops is not None:
        if layout["permute"] is not None or layout["reshape"] is not None:
            raise ParityError(f"{where}: entry {key!r}: give the layout as ops, or as permute/reshape, not both")
        if not isinstance(ops, list):
            raise ParityError(f"{where}: entry {key!r}: ops must be a list of one-key objects, got {ops!r}")
    steps = tuple(_check_op(where, key, n, op) for n, op in enumerate(ops or []))
    parsed_write: int | str | None = int(write) if write is not None and write.isdigit() else write
    return NameRule(runtime, node, layout["permute"], layout["reshape"], steps, parsed_write)


def read_name_map(source) -> NameMap:
    """A name map from a JSON file (or a dict, or a :class:`NameMap`): see the module docstring.
    Raises ParityError naming the entry (one line)."""
    if source is None:
        return NameMap()
    if isinstance(source, NameMap):
        return source
    where = "--name-map"
    if not isinstance(source, Mapping):
        where = f"--name-map {source}"
        data = _read_json(Path(source).expanduser(), "--name-map")
    else:
        data = source
    if not isinstance(data, Mapping):
        raise ParityError(f"{where} must hold a JSON object of runtime name -> node name")
    rules: list[NameRule] = []
    unavailable: dict[str, str] = {}
    notes: tuple[str, ...] = ()
    for key, value in data.items():
        if key == UNAVAILABLE:
            unavailable = _unavailable(value, f"{where}: {UNAVAILABLE}")
        elif key == NOTES:
            notes = _notes(value, f"{where}: {NOTES}")
        elif key == ABOUT:
            continue  # a comment
        elif isinstance(key, str) and key.startswith("@"):
            raise ParityError(f"{where}: unknown reserved key {key!r} ({UNAVAILABLE}, {NOTES}, {ABOUT})")
        else:
            rules.append(_rule(where, key, value))
    seen: dict[tuple[str, object], str] = {}
    for rule in rules:
        if (rule.runtime, rule.write) in seen:
            raise ParityError(
                f"{where}: entries {seen[rule.runtime, rule.write]!r} and {rule.key!r} read the same name"
            )
        seen[rule.runtime, rule.write] = rule.key
    return NameMap(tuple(rules), unavailable, notes)


def _unavailable(value, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items()
    ):
        raise ParityError(f"{where} must map node names or globs to the reason the runtime cannot produce them")
    return dict(value)


def _notes(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ParityError(f"{where} must be a list of strings")
    return tuple(value)


@dataclass(frozen=True)
class DumpInfo:
    """What a dump folder's ``parity-dump.json`` says: the runtime, its name map, the nodes it cannot
    produce and notes (an empty one for a dump without the file)."""

    runtime: str | None = None
    name_map: NameMap | None = None
    unavailable: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def read_dump_info(path: str | Path) -> DumpInfo:
    """A dump folder's ``parity-dump.json`` (an empty DumpInfo when there is none). Raises ParityError."""
    path = Path(path).expanduser()
    info_path = path / DUMP_INFO if path.is_dir() else None
    if info_path is None or not info_path.is_file():
        return DumpInfo()
    data = _read_json(info_path, "dump description")
    where = str(info_path)
    if not isinstance(data, Mapping) or data.get("format") != DUMP_FORMAT:
        raise ParityError(f"{where} is not a parity dump description (format {DUMP_FORMAT!r})")
    if data.get("version") != DUMP_VERSION:
        raise ParityError(f"{where} has version {data.get('version')!r}; this parity reads {DUMP_VERSION}")
    unknown = set(data) - {"format", "version", "runtime", "name_map", "unavailable", "notes", "created"}
    if unknown:
        raise ParityError(f"{where} has unknown field(s) {', '.join(sorted(unknown))}")
    runtime = data.get("runtime")
    if runtime is not None and not isinstance(runtime, str):
        raise ParityError(f"{where}: runtime must be a string")
    name_map = data.get("name_map")
    return DumpInfo(
        runtime=runtime,
        name_map=None if name_map is None else read_name_map_of(name_map, f"{where}: name_map"),
        unavailable=_unavailable(data.get("unavailable") or {}, f"{where}: unavailable"),
        notes=_notes(data.get("notes") or [], f"{where}: notes"),
    )


def read_name_map_of(data, where: str) -> NameMap:
    """:func:`read_name_map` of a JSON object, with errors said as ``where``."""
    if not isinstance(data, Mapping):
        raise ParityError(f"{where} must hold a JSON object of runtime name -> node name")
    try:
        return read_name_map(data)
    except ParityError as e:
        raise ParityError(str(e).replace("--name-map", where, 1)) from None


def write_dump_info(
    folder: str | Path,
    *,
    runtime: str,
    name_map: Mapping | None = None,
    unavailable: Mapping[str, str] | None = None,
    notes: list[str] | tuple[str, ...] = (),
) -> Path:
    """Write ``parity-dump.json`` into a dump folder (what an adapter says about its dump)."""
    data: dict = {"format": DUMP_FORMAT, "version": DUMP_VERSION, "runtime": runtime}
    if name_map is not None:
        data["name_map"] = dict(name_map)
    if unavailable:
        data["unavailable"] = dict(unavailable)
    if notes:
        data["notes"] = list(notes)
    path = Path(folder) / DUMP_INFO
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


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


def _dim(d, sizes: Mapping[str, int], rule: NameRule) -> int:
    if isinstance(d, int):
        return d
    if d not in sizes:
        raise ParityError(f"name map entry {rule.key!r}: the trace gives no size {d!r} for this node")
    return int(sizes[d])


def apply_ops(tensor: torch.Tensor, rule: NameRule, key: str, sizes: Mapping[str, int] | None = None) -> torch.Tensor:
    """``tensor`` (the dump's ``key``) through ``rule``'s ops; ``sizes``: what the size names stand for
    at this node (``attention_scale`` included). Raises ParityError naming the entry and the shape."""
    sizes = sizes or {}
    for n, (name, arg) in enumerate(rule.steps):
        shape = tuple(tensor.shape)
        try:
            if name == "permute":
                tensor = tensor.permute(*arg)
            elif name == "reshape":
                dims = [_dim(d, sizes, rule) for d in arg]
                tensor = tensor.reshape(*(shape[i] if d == 0 and i < len(shape) else d for i, d in enumerate(dims)))
            elif name == "slice":
                axis, start, stop = arg
                start, stop = _dim(start, sizes, rule), None if stop is None else _dim(stop, sizes, rule)
                if not -tensor.dim() <= axis < tensor.dim():
                    raise IndexError(f"axis {axis} is not an axis of {tensor.dim()}")
                if stop is not None and stop > tensor.shape[axis]:
                    raise IndexError(f"stop {stop} is past the axis' {tensor.shape[axis]} entries")
                tensor = tensor.narrow(axis, start, (tensor.shape[axis] if stop is None else stop) - start)
            elif name == "select":
                axis, index = arg
                tensor = tensor.select(axis, index)
            elif name == "scale":
                factor = sizes.get("attention_scale") if arg == "attention_scale" else arg
                if factor is None:
                    raise ParityError(f"name map entry {rule.key!r}: the trace gives no attention_scale for this node")
                tensor = tensor * float(factor)
        except (RuntimeError, IndexError, ValueError) as e:
            raise ParityError(
                f"name map entry {rule.key!r} cannot apply {name} {list(arg) if isinstance(arg, tuple) else arg} "
                f"(step {n + 1}) to dump tensor {key!r} of shape {shape}: {str(e).splitlines()[0]}"
            ) from None
    return tensor


def _writes(dump: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Dump key by base name, in write order: ``NAME``, ``NAME#1``, ``NAME#2``..."""
    found: dict[str, dict[int, str]] = {}
    for key in dump:
        m = _DUMP_WRITE.match(key)
        base, n = (m.group("base"), int(m.group("write"))) if m else (key, 0)
        found.setdefault(base, {})[n] = key
    out = {}
    for base, by_n in found.items():
        if 0 not in by_n:  # ``x#2`` without ``x``: a name that ends in #N, not a write
            out.update({key: [key] for key in by_n.values()})
            continue
        out[base] = [by_n[n] for n in sorted(by_n)]
    return out


def _match(rules: tuple[NameRule, ...], base: str, writes: list[str]) -> list[tuple[str, NameRule | None, str]]:
    """``(dump key, rule, node)`` for each write of ``base`` an entry reads (the rule None: the key
    is taken as a node name)."""
    out: list[tuple[str, NameRule | None, str]] = []
    for rule in rules:
        node = rule.match(base)
        if node is None:
            continue
        if rule.write is None:
            if len(writes) > 1:
                shown = ", ".join(writes[:4]) + (", ..." if len(writes) > 4 else "")
                raise ParityError(
                    f"dump name {base!r} was written {len(writes)} times ({shown}): say which write name map entry "
                    f"{rule.key!r} means ({rule.runtime}#last, #N from 0, or #{{i}} for one write per layer)"
                )
            picked = [(writes[0], node)]
        elif rule.write == "last":
            picked = [(writes[-1], node)]
        elif rule.write == "{i}":
            picked = [(key, node.replace("{i}", str(n))) for n, key in enumerate(writes)]
        else:
            n = int(rule.write)
            picked = [(writes[n], node)] if n < len(writes) else []
        out += [(key, rule, target) for key, target in picked]
    if not out:
        out = [(key, None, key) for key in writes]
    return out


def map_dump(
    dump: Mapping[str, torch.Tensor],
    rules,
    shapes: Mapping[str, tuple[int, ...] | None],
    sizes=None,
):
    """``(tensors by node, dump key by node, notes)``: the dump's keys through the name map (a key no
    entry matches is taken as a node name), its ops applied, and a missing leading batch axis of
    size 1 restored. ``shapes``: every node of the trace and its shape (None if unknown); ``sizes``:
    ``node -> {size name: int}`` (or one mapping for every node) for the ops' size names."""
    rules = tuple(read_name_map(rules) if not isinstance(rules, (list, tuple)) else rules)
    known = set(shapes)
    keys: dict[str, str]
    tensors, keys, unmatched, batchless = {}, {}, [], []
    for base, writes in _writes(dump).items():
        for key, rule, node in _match(rules, base, writes):
            tensor = dump[key]
            if node not in known:
                unmatched.append(key if node == key else f"{key} -> {node}")
                continue
            if node in tensors:
                raise ParityError(f"dump keys {keys[node]!r} and {key!r} both map to node {node}")
            if rule is not None:
                at = sizes(node) if callable(sizes) else (sizes or {})
                tensor = apply_ops(tensor, rule, key, at)
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
