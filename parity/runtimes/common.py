"""What every adapter does the same way: read a trace's inputs, the rows of a padded batch, place a
row's tensors back at their positions, and write a dump folder whole (tensors and
``parity-dump.json``) or not at all."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parity.diagnose.profile import HEAD_MAJOR
from parity.golden.dumps import write_dump_info
from parity.golden.trace_file import GoldenTrace, read_trace
from parity.util.errors import ParityError

#: the file an adapter writes its tensors to, inside the dump folder
TENSORS = "dump.safetensors"


class RuntimeMissing(ParityError):
    """The runtime an adapter drives is not installed (the message says which extra installs it)."""


@dataclass(frozen=True)
class Probe:
    """A trace's inputs as an adapter feeds them: token ids per batch row (padding left out), where
    each row's tokens sit in the trace's ``(batch, seq)`` grid, and the trace's nodes."""

    trace: GoldenTrace
    input_ids: np.ndarray  # (batch, seq) int64
    mask: np.ndarray | None  # (batch, seq) 1 = real token, None: no padding anywhere

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])

    def rows(self) -> list[np.ndarray]:
        """Each row's real tokens (a padded row without its padding)."""
        if self.mask is None:
            return [self.input_ids[b] for b in range(self.batch)]
        return [self.input_ids[b][self.mask[b] != 0] for b in range(self.batch)]

    def positions(self, row: int) -> np.ndarray:
        """Where row ``row``'s real tokens sit along the trace's sequence axis."""
        if self.mask is None:
            return np.arange(self.seq)
        return np.nonzero(self.mask[row] != 0)[0]

    @property
    def nodes(self) -> list[dict]:
        return self.trace.node_entries


def probe_of(trace) -> Probe:
    """The trace's inputs (``inputs.safetensors``). A mask whose real tokens are not one contiguous run
    per row is refused: an adapter runs each row's tokens as one sequence."""
    trace = trace if isinstance(trace, GoldenTrace) else read_trace(trace)
    inputs = trace.inputs()
    ids = inputs["input_ids"].numpy().astype(np.int64)
    mask = inputs.get("attention_mask")
    mask_np = None if mask is None or bool((mask != 0).all()) else mask.numpy()
    if mask_np is not None:
        for b, row in enumerate(mask_np):
            real = np.nonzero(row)[0]
            if len(real) == 0 or real[-1] - real[0] + 1 != len(real):
                raise ParityError(f"the trace's attention_mask row {b} is not one run of real tokens")
    return Probe(trace, ids, mask_np)


def token_axis(kind: str) -> int:
    """The sequence axis of a node of this kind: ``(batch, heads, seq, ...)`` or ``(batch, seq, ...)``."""
    return 2 if kind in HEAD_MAJOR else 1


def assemble(probe: Probe, per_row: list[dict[str, np.ndarray]], kinds: Mapping[str, str]) -> dict[str, np.ndarray]:
    """One ``(batch, ...)`` tensor per node from each row's ``(1, ...)`` tensors: a row run without its
    padding is placed at its real positions (zeros elsewhere: padding, which compare does not judge by
    default), its key axis too for ``scores``/``probs``. Nodes some row lacks are left out."""
    if len(per_row) == 1 and probe.batch == 1 and probe.mask is None:
        return per_row[0]
    names = set(per_row[0]).intersection(*per_row[1:]) if per_row else set()
    out = {}
    for name in names:
        rows = [r[name] for r in per_row]
        if probe.mask is None:
            out[name] = np.concatenate(rows, axis=0)
            continue
        axis = token_axis(kinds.get(name, ""))
        first = rows[0]
        if first.ndim <= axis:
            continue
        shape = list(first.shape)
        shape[0], shape[axis] = probe.batch, probe.seq
        keys = first.ndim == 4 and axis == 2 and kinds.get(name) in ("scores", "probs")
        if keys:
            shape[3] = probe.seq
        full = np.zeros(shape, dtype=first.dtype)
        for b, tensor in enumerate(rows):
            where = probe.positions(b)
            row = full[b]  # a view: one advanced index below keeps the axes in place
            if keys:
                row[:, where[:, None], where[None, :]] = tensor[0]
            else:
                index: list = [slice(None)] * row.ndim
                index[axis - 1] = where
                row[tuple(index)] = tensor[0]
        out[name] = full
    return out


def check_out(out: str | Path) -> Path:
    """``out`` as a dump folder to create: refused (one line) when it exists and is not an empty folder,
    before any runtime runs."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ParityError(f"--out {out} already exists; a dump is written to a new folder")
    return out


def write_dump(
    out: str | Path,
    tensors: Mapping[str, np.ndarray],
    *,
    runtime: str,
    name_map: Mapping | None = None,
    unavailable: Mapping[str, str] | None = None,
    notes: list[str] | tuple[str, ...] = (),
) -> Path:
    """The dump folder ``out`` (new, or empty): ``dump.safetensors`` and ``parity-dump.json``, written
    in a staging folder and renamed into place, so a dump is whole or absent."""
    from safetensors.numpy import save

    from parity.util.files import cannot_write, discard, done, staging_folder

    out = check_out(out)
    parent = out.parent
    try:
        staging = staging_folder(parent)
    except OSError as e:
        raise cannot_write(e, f"the dump {out}", parent) from None
    try:
        data = save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata={"writer": "parity.runtimes"})
        (staging / TENSORS).write_bytes(data)
        write_dump_info(staging, runtime=runtime, name_map=name_map, unavailable=unavailable, notes=notes)
        if out.exists():
            out.rmdir()
        os.rename(staging, out)
        done(staging)
    except OSError as e:
        discard(staging)
        raise cannot_write(e, f"the dump {out}", parent) from None
    except BaseException:
        discard(staging)
        raise
    return out
