"""Read a Transformers-format checkpoint directory through safetensors only.

Accepted: ``config.json`` plus ``model.safetensors``, or plus ``model.safetensors.index.json``
and the shards it names. Pickle-based weights (``*.bin``, ``*.pt``) are never opened.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .errors import CheckpointError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass
class Checkpoint:
    """A checkpoint read into memory: its config.json as a dict, its tensors, and provenance."""

    path: Path
    config: dict
    state_dict: dict[str, torch.Tensor]
    files: list[Path] = field(default_factory=list)

    def content_hash(self) -> str:
        """SHA-256 over config.json and the weight files, in order (identifies what was compared)."""
        h = hashlib.sha256()
        for f in [self.path / "config.json", *self.files]:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated: {str(e).splitlines()[0]}") from None


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory (or the file itself). Raises CheckpointError."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in {path}" if path.is_dir() else f"config file {path} does not exist")
    return _read_json(config_path)


def read_checkpoint(directory: str | Path, model_type: str | None = None) -> Checkpoint:
    """Read ``directory``'s config.json and safetensors weights.

    Raises:
        CheckpointError: the directory or config.json is missing; ``model_type`` differs from the
            expected one; no safetensors weights (pickle files are refused, not opened); an index
            names a missing shard or a key its shard lacks; a file is corrupt or truncated.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    config = read_config(directory)
    found = config.get("model_type")
    if model_type is not None and found != model_type:
        raise CheckpointError(f"{directory / 'config.json'} has model_type {found!r}, expected {model_type!r}")
    if (directory / INDEX).is_file():
        index = _read_json(directory / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{directory / INDEX} has no weight_map")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        state_dict = {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f} named in {INDEX} does not exist")
            shard = _load(f)
            expected = {k for k, v in weight_map.items() if directory / v == f}
            if expected - shard.keys():
                raise CheckpointError(f"shard {f} lacks keys listed in {INDEX}: {', '.join(sorted(expected - shard.keys()))}")
            state_dict.update(shard)
    elif (directory / SINGLE).is_file():
        files = [directory / SINGLE]
        state_dict = _load(files[0])
    else:
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        extra = f" (found {', '.join(pickles)}: pickle files are never loaded)" if pickles else ""
        raise CheckpointError(f"no {SINGLE} or {INDEX} in {directory}{extra}")
    return Checkpoint(directory, config, state_dict, files)
