"""Read a Transformers-format checkpoint directory through safetensors only.

Accepted: ``config.json`` plus ``model.safetensors``, or plus ``model.safetensors.index.json``
and the shards it names. Pickle-based weights (``*.bin``, ``*.pt``) are never opened.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from parity.util.errors import CheckpointError
from parity.util.resources import require

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass
class Checkpoint:
    """A checkpoint read into memory: its config.json as a dict, its tensors, and provenance."""

    path: Path
    config: dict
    state_dict: dict[str, torch.Tensor]
    files: list[Path] = field(default_factory=list)
    #: what a reader says about the checkpoint beyond its tensors (a GGUF's float32 config values)
    notes: list[str] = field(default_factory=list)

    def content_hash(self) -> str:
        """SHA-256 over config.json and the weight files, in order (identifies what was compared); a GGUF
        checkpoint (``path`` the file) is its one file."""
        h = hashlib.sha256()
        for f in [*([self.path / "config.json"] if self.path.is_dir() else []), *self.files]:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object (found a {type(data).__name__})")
    return data


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated: {str(e).splitlines()[0]}") from None


def unreachable(path: Path, what: str) -> str | None:
    """Why ``path`` cannot be opened, in words (``what`` names it: "checkpoint directory"), or None.

    ``Path.exists()`` answers False for a symlink loop, a dangling link or a folder without search
    permission alike; the error number tells them apart.
    """
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{what} {path} is a symbolic link loop (it resolves to itself)"
        if e.errno == errno.ENOENT and os.path.islink(path):
            return f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist"
        if e.errno == errno.ENOENT:
            return f"{what} {path} does not exist"
        if e.errno == errno.ENOTDIR:
            return f"{what} {path} does not exist (a part of the path is a file)"
        return f"{what} {path} cannot be read: {e.strerror}"
    return None


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory (or the file itself). Raises CheckpointError."""
    path = Path(path)
    problem = unreachable(path, "config file")
    if problem:
        raise CheckpointError(problem)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        if not os.path.lexists(config_path):
            raise CheckpointError(f"no config.json in {path}")
        raise CheckpointError(unreachable(config_path, "config file") or f"{config_path} is not a file")
    return _read_json(config_path)


def read_checkpoint(directory: str | Path, model_type: str | tuple[str, ...] | None = None) -> Checkpoint:
    """Read ``directory``'s config.json and safetensors weights.

    Raises:
        CheckpointError: the directory or config.json is missing (or not a JSON object);
            ``model_type`` differs from the expected one (or ones); no safetensors weights (pickle files are
            refused, not opened); an index names a missing shard, a shard outside the directory or a
            key its shard lacks; a key stands in two shards; a file is corrupt or truncated.
    """
    directory = Path(directory)
    problem = unreachable(directory, "checkpoint directory")
    if problem:
        raise CheckpointError(problem)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} is a file; pass the directory that holds config.json")
    config = read_config(directory)
    found = config.get("model_type")
    expected = (model_type,) if isinstance(model_type, str) else tuple(model_type or ())
    if expected and found not in expected:
        raise CheckpointError(
            f"{directory / 'config.json'} has model_type {found!r}, expected {' or '.join(map(repr, expected))}"
        )
    for name in (SINGLE, INDEX):  # a loop or a dangling link by a weights file's name: named as what it is
        if os.path.lexists(directory / name) and not (directory / name).is_file():
            raise CheckpointError(
                unreachable(directory / name, "checkpoint file") or f"checkpoint file {directory / name} is not a file"
            )
    weights = [directory / SINGLE] if (directory / SINGLE).is_file() else sorted(directory.glob("*.safetensors"))
    for f in weights:
        problem = unreachable(f, "checkpoint file")
        if problem:
            raise CheckpointError(problem)
    require(sum(f.stat().st_size for f in weights), f"checkpoint {directory}", "check a smaller checkpoint")
    # Like Transformers, a complete single file wins over an index lying next to it.
    if (directory / SINGLE).is_file():
        files = [directory / SINGLE]
        state_dict = _load(files[0])
    elif (directory / INDEX).is_file():
        index = _read_json(directory / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{directory / INDEX} has no weight_map of key -> shard file")
        root = directory.resolve()
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        found_in: dict[str, Path]
        state_dict, found_in = {}, {}
        for f in files:
            if f.resolve().parent != root:
                raise CheckpointError(f"shard {f.name!r} named in {INDEX} lies outside {directory}")
            if not f.is_file():
                raise CheckpointError(
                    unreachable(f, f"shard named in {INDEX}:") or f"shard {f} named in {INDEX} does not exist"
                )
            shard = _load(f)
            listed = {k for k, v in weight_map.items() if directory / v == f}
            if listed - shard.keys():
                raise CheckpointError(
                    f"shard {f} lacks keys listed in {INDEX}: {', '.join(sorted(listed - shard.keys()))}"
                )
            twice = sorted(k for k in shard if k in found_in)
            if twice:
                raise CheckpointError(f"key {twice[0]} is in two shards: {found_in[twice[0]].name} and {f.name}")
            found_in.update(dict.fromkeys(shard, f))
            state_dict.update(shard)
    else:
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        extra = f" (found {', '.join(pickles)}: pickle files are never loaded)" if pickles else ""
        raise CheckpointError(f"no {SINGLE} or {INDEX} in {directory}{extra}")
    return Checkpoint(directory, config, state_dict, files)
