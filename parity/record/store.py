"""Where a trace's tensors live: in memory while a byte budget lasts, past it in safetensors files in
a temporary folder (read back in chunks, or memory-mapped), so a deep model's trace costs disk, not
memory."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

#: safetensors dtype codes of the dtypes a trace may hold
_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: bytes written per call when spilling (a bounded slice of a large tensor at a time)
_WRITE = 64 << 20


def write_safetensors(path: Path, name: str, tensor: torch.Tensor) -> int:
    """One CPU tensor to ``path`` in the safetensors format, written from the tensor's own memory
    (no serialised copy of it in memory). Returns the byte offset of its data in the file."""
    tensor = tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    header = json.dumps(
        {name: {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [0, nbytes]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, so it maps back as any dtype
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if nbytes else b""
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        # numpy's stubs give ndarray __buffer__ for Python >= 3.12 only; it is a buffer on every version
        view = memoryview(raw)  # type: ignore[arg-type]
        for start in range(0, nbytes, _WRITE):
            fh.write(view[start : start + _WRITE])
    return 8 + len(header)


def map_safetensors(path: Path, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """The tensor at byte ``offset`` of a file written by :func:`write_safetensors`, memory-mapped
    (copy-on-write: pages are read when touched and freed when the tensor is dropped)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_file(str(path), shared=False, size=offset + nbytes, dtype=torch.uint8)
    return raw[offset:].view(dtype).view(shape)


class Spill:
    """A memory budget shared by the stores of one trace, and the temporary folder that holds what
    does not fit (``$TMPDIR/parity-trace-<host>-<pid>-*``, removed on :meth:`close`, at garbage
    collection, on SIGTERM, or by the next run when a killed process left it).

    ``budget``: bytes of tensors kept in memory; None keeps everything in memory.
    """

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.in_memory = 0
        self.on_disk = 0
        #: bytes ever written to disk (a spilled tensor deleted later still counts)
        self.written = 0
        self.folder: Path | None = None
        self._count = 0
        self._finalizer: weakref.finalize[[Path], Spill] | None = None
        #: id of a stored item (a tensor in memory or a file) -> names holding it, across the stores
        self.holders: dict[int, int] = {}

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or self.in_memory + nbytes <= self.budget

    def new_file(self) -> Path:
        if self.folder is None:
            from parity.util.files import SPILL_PREFIX, temporary_folder

            self.folder = temporary_folder(SPILL_PREFIX)
            self._finalizer = weakref.finalize(self, _remove_folder, self.folder)
        self._count += 1
        return self.folder / f"{self._count:06d}.safetensors"

    def unwritten(self, e: OSError, nbytes: int):
        """The one-line error for a spill that could not be written, with the space it needed so far."""
        import tempfile

        from parity.util.files import cannot_write

        return cannot_write(
            e,
            f"the trace spilled past the memory budget (--trace-memory; {self.written / 2**30:.3g} GiB written, "
            f"{nbytes / 2**30:.3g} GiB more for the next node)",
            tempfile.gettempdir(),
            self.written + nbytes,
        )

    def close(self) -> None:
        """Remove the spill folder (the trace's spilled tensors are gone after this)."""
        if self._finalizer is not None:
            self._finalizer()
        self.folder = None


def _remove_folder(folder: Path) -> None:
    from parity.util.files import done

    shutil.rmtree(folder, ignore_errors=True)
    done(folder)


@dataclass(frozen=True)
class _OnDisk:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SpilledTensor:
    """A tensor on disk, read a chunk at a time into one reused buffer (the page cache holds the
    file; nothing of it is mapped into this process), or mapped whole with :meth:`load`."""

    def __init__(self, item: _OnDisk):
        self.item = item
        self.shape = torch.Size(item.shape)
        self.dtype = item.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def load(self) -> torch.Tensor:
        item = self.item
        return map_safetensors(item.path, item.dtype, item.shape, item.offset)

    def chunks(self, n: int) -> Iterator[torch.Tensor]:
        """Consecutive 1-D slices of at most ``n`` elements; each is overwritten by the next."""
        total = self.numel()
        if total == 0:
            return
        buffer = torch.empty(min(n, total), dtype=self.dtype)
        raw = buffer.view(torch.uint8).numpy()
        size = buffer.element_size()
        with open(self.item.path, "rb") as fh:
            fh.seek(self.item.offset)
            for start in range(0, total, n):
                count = min(n, total - start)
                view = memoryview(raw)[: count * size]  # type: ignore[arg-type]  # ndarray: see write_safetensors
                while view:
                    got = fh.readinto(view)
                    if not got:
                        raise OSError(f"{self.item.path} ends early")
                    view = view[got:]
                yield buffer[:count]


class TensorStore(MutableMapping):
    """Tensors by name in insertion order, in memory while the :class:`Spill` budget lasts and in
    safetensors files past it. Reading a spilled tensor maps it again (nothing is cached, so a trace
    read node by node never holds more than the node being read); :meth:`lazy` reads it in chunks."""

    def __init__(self, spill: Spill | None = None):
        self.spill = spill if spill is not None else Spill()
        self._items: dict[str, torch.Tensor | _OnDisk] = {}

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Store a copy of ``tensor`` (on the CPU), or write it to disk when it does not fit."""
        nbytes = tensor.numel() * tensor.element_size()
        if name in self._items:
            del self[name]
        if self.spill.fits(nbytes):
            self._hold(name, tensor.to("cpu", copy=True))
            self.spill.in_memory += nbytes
            return
        tensor = tensor.to("cpu")
        try:
            path = self.spill.new_file()
            offset = write_safetensors(path, "tensor", tensor)
        except OSError as e:  # a full disk (another process filled it since the run was planned): nothing left behind
            self.spill.close()
            raise self.spill.unwritten(e, nbytes) from None
        self._hold(name, _OnDisk(path, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        self.spill.on_disk += nbytes
        self.spill.written += nbytes

    def alias(self, name: str, store: TensorStore, source: str) -> None:
        """Store under ``name`` what ``store`` (sharing this store's Spill) holds as ``source``: no copy."""
        if name in self._items:
            del self[name]
        self._hold(name, store._items[source])

    def _hold(self, name: str, item) -> None:
        self._items[name] = item
        self.spill.holders[id(item)] = self.spill.holders.get(id(item), 0) + 1

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self.put(name, tensor)

    def __getitem__(self, name: str) -> torch.Tensor:
        item = self._items[name]
        if isinstance(item, _OnDisk):
            return map_safetensors(item.path, item.dtype, item.shape, item.offset)
        return item

    def __delitem__(self, name: str) -> None:
        item = self._items.pop(name)
        left = self.spill.holders.pop(id(item), 1) - 1
        if left:  # another name still holds it
            self.spill.holders[id(item)] = left
            return
        if isinstance(item, _OnDisk):
            self.spill.on_disk -= item.nbytes
            with contextlib.suppress(OSError):
                os.unlink(item.path)
        else:
            self.spill.in_memory -= item.numel() * item.element_size()

    def __contains__(self, name) -> bool:
        return name in self._items

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def spilled(self, name: str) -> bool:
        return isinstance(self._items.get(name), _OnDisk)

    def lazy(self, name: str, default=None) -> torch.Tensor | SpilledTensor | None:
        """The tensor if it is in memory, a :class:`SpilledTensor` (read by chunks) if on disk."""
        item = self._items.get(name)
        if item is None:
            return default
        return SpilledTensor(item) if isinstance(item, _OnDisk) else item


class OnCpu(dict):
    """A dict of tensors held where they are (a weight on a GPU, by reference) that hands out CPU
    copies: only the few a diagnosis reads are ever copied."""

    def __getitem__(self, key):
        return super().__getitem__(key).to("cpu")

    def get(self, key, default=None):
        return self[key] if key in self else default  # noqa: SIM401 (dict.get would skip the CPU copy)
