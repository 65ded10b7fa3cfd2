"""Refuse, with numbers, work that cannot fit in this machine's memory (or disk), instead of being
OOM-killed halfway.

The memory model of a check (weights are counted when the pair is built; these are the bytes a
check adds on top of them):

    memory = forward working set + min(reference trace, budget) + min(ours kept, budget)
    disk   = max(0, reference trace - budget) + max(0, ours kept - budget)

The reference's trace is stored (it is what ours is compared with); past the trace budget
(:data:`TRACE_MEMORY`, ``check(trace_memory=...)``, ``--trace-memory``) it goes to disk, and a
node on disk is compared by reading it in chunks. Ours is compared node by node while it runs and
only the first failure and its neighbourhood are kept. No term grows with depth: the forward
working set is one layer's (a model runs layer by layer) and the kept terms are capped.
"""

from __future__ import annotations

import shutil
import tempfile

from parity.util.errors import ParityError
from parity.util.text import size

GIB = 1024**3
#: share of the available memory a run may plan to use (forward passes need room beyond what is counted)
BUDGET = 0.8
#: bytes of a trace kept in memory before it spills to disk (per trace: the reference's, ours' kept)
TRACE_MEMORY = 1 * GIB
#: bytes of disk a spilling run leaves free for everyone else
DISK_RESERVE = 1 * GIB


def available_bytes() -> int | None:
    """Memory available to new allocations (psutil's ``available``, else the kernel's
    ``MemAvailable``), or None where neither can be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # no psutil, or no support on this platform
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def disk_free_bytes(folder: str | None = None) -> int | None:
    """Free bytes on the file system of ``folder`` (default: the temporary folder spills go to)."""
    try:
        return shutil.disk_usage(folder or tempfile.gettempdir()).free
    except OSError:
        return None


def gib(nbytes: float) -> str:
    """``25.7 GiB``; a size under 0.05 GiB in the unit that shows it (``230 KiB``), never ``0.0 GiB``."""
    if nbytes >= 1e6 * GIB:
        return f"{nbytes / GIB:.3g} GiB"
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= 0.05 * GIB else size(nbytes)


def require(needed: int, what: str, advice: str) -> None:
    """Raise ParityError if ``needed`` bytes exceed :data:`BUDGET` of the available memory."""
    available = available_bytes()
    if available is not None and needed > BUDGET * available:
        raise ParityError(f"{what} needs about {gib(needed)} but {gib(available)} are available: {advice}")


def require_disk(needed: int, what: str, advice: str) -> None:
    """Raise ParityError if ``needed`` bytes do not fit on the temporary folder's file system."""
    if needed <= 0:
        return
    free = disk_free_bytes()
    if free is not None and needed + DISK_RESERVE > free:
        raise ParityError(
            f"{what} needs about {gib(needed)} of disk in {tempfile.gettempdir()} (and {gib(DISK_RESERVE)} left "
            f"free for others) but {gib(free)} are free: {advice}"
        )
