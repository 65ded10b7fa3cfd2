"""Write files and report folders so that a reader never sees half of one, nothing is overwritten,
and nothing is left behind.

- A file is written through a temporary file in its folder and ``os.replace``; a report folder is
  filled under a hidden ``.staging-<host>-<pid>-<random>`` name and renamed when complete.
- Folders in use (staging folders, the gate's temporary checkpoints) are *live*: on SIGTERM (what
  CI sends on cancel) they are removed before the process ends with the signal's usual status. A
  SIGKILL leaves them behind; the next :func:`staging_folder` or :func:`temporary_folder` sweeps
  those whose process is gone.
- Names derived from user input (a checkpoint folder of 240 characters) are shortened to
  :data:`MAX_NAME` bytes, and :func:`path_problem` says up front when a folder is too long to hold
  a report at all, so a run never fails after its check.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from parity.util.errors import OutputError
from parity.util.text import size

#: longest folder or file name (bytes) derived from a family, config or case name
MAX_NAME = 96
#: bytes a report folder needs below its parent: "/" + folder name (with "-NNNN") + "/" + a file's
#: temporary name (".<name>.<8 random>")
RESERVED = 1 + MAX_NAME + 5 + 1 + MAX_NAME + 10
#: a live folder of a process that is gone is swept; one whose owner cannot be told is swept after this
STALE_SECONDS = 24 * 3600


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_MEASURE = threading.local()


@contextlib.contextmanager
def measuring() -> Iterator[list[int]]:
    """Within it, :func:`atomic_write` writes nothing and appends each file's size to the list it
    yields: how much room a set of files needs, found by running the code that writes them."""
    sizes: list[int] = []
    previous = getattr(_MEASURE, "sizes", None)
    _MEASURE.sizes = sizes
    try:
        yield sizes
    finally:
        _MEASURE.sizes = previous


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    sizes = getattr(_MEASURE, "sizes", None)
    if sizes is not None:  # measuring(): count, touch nothing
        sizes.append(len(data) if isinstance(data, bytes) else len(data.encode("utf-8")))
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if isinstance(data, bytes) else "utf-8") as fh:
            fh.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is as readable as any new file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --- names and path limits ----------------------------------------------------------------------------


def short_name(name: str, limit: int = MAX_NAME) -> str:
    """``name`` with characters a folder name should not hold replaced, cut to ``limit`` bytes; a cut
    name keeps its start and end and gains 8 hex digits of its hash, so two long names stay apart."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") or "_"
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    keep = limit - len(digest) - 2
    head, tail = keep - keep // 3, keep // 3
    return f"{name[:head]}~{digest}~{name[len(name) - tail :]}"


def _limits(path: Path) -> tuple[int, int]:
    """(PATH_MAX, NAME_MAX) of the file system ``path`` is (or would be) on."""
    probe = path
    while probe != probe.parent:
        try:
            if probe.exists():
                break
        except OSError:  # a name too long to even look up
            pass
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_PATH_MAX"), os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 4096, 255


def path_problem(path: str | Path, reserve: int = 0) -> str | None:
    """Why ``path`` cannot be used with ``reserve`` more bytes below it, or None.

    Checks every part against the file system's name limit (255 bytes on most) and the whole path
    plus ``reserve`` against its path limit (4096), as an absolute path: a report folder needs
    :data:`RESERVED` bytes.
    """
    if not str(path):
        return "is empty"
    absolute = Path(os.path.abspath(path))
    text = os.fsencode(str(absolute))
    path_max, name_max = _limits(absolute)
    for part in absolute.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            shown = part if len(part) <= 24 else part[:20] + "..."
            return f"has a part of {size} bytes ({shown}), over the file system's {name_max}-byte limit for a name"
    if len(text) + reserve >= path_max:
        room = path_max - 1 - reserve
        what = f", and what is written below it needs {reserve} more" if reserve else ""
        return f"is {len(text)} bytes as an absolute path{what}: over the system's {path_max}-byte path limit (at most {room} bytes here)"
    return None


def run_stem(family: str, config: str) -> str:
    """``<family>-<config>-<UTC timestamp>``, at most :data:`MAX_NAME` bytes; config paths are
    reduced to their last part (a ``config.json`` to its folder's name, ``tiny.json`` to ``tiny``)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = Path(config)
    name = path.name or path.resolve().name or "checkpoint"
    if name == "config.json":  # path/to/gemma-tiny/config.json: the folder says what it is
        name = path.parent.name or path.resolve().parent.name or "config"
    elif name.endswith(".json"):
        name = name[: -len(".json")]
    return short_name(f"{family}-{name}", MAX_NAME - len(stamp) - 1) + f"-{stamp}"


# --- live folders: removed on SIGTERM, swept when their process is gone ---------------------------------

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_LIVE: set[Path] = set()
_LOCK = threading.Lock()
_previous_handler = None


def _on_sigterm(signum, frame):
    for folder in list(_LIVE):
        shutil.rmtree(folder, ignore_errors=True)
    _LIVE.clear()
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # end as SIGTERM would have, status 128 + 15
    os.kill(os.getpid(), signum)


def _install_handler() -> None:
    """Route SIGTERM through :func:`_on_sigterm` (once; main thread only; never over SIG_IGN)."""
    global _previous_handler
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current == signal.SIG_IGN:
        return
    _previous_handler = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def live(folder: Path) -> Path:
    """Mark ``folder`` to be removed if the process gets SIGTERM before :func:`done` is called."""
    with _LOCK:
        _LIVE.add(Path(folder))
    _install_handler()
    return folder


def done(folder: Path) -> None:
    with _LOCK:
        _LIVE.discard(Path(folder))


def _live_name(prefix: str) -> str:
    return f"{prefix}{_HOST}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _du(path: str) -> int:
    """Bytes of the files under ``path`` (not following links)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


#: prefix of the folders spilled traces go to, in the temporary folder
SPILL_PREFIX = "parity-trace-"


def sweep_spills() -> str | None:
    """Remove the trace spill folders (``$TMPDIR/parity-trace-*``) that killed runs left (a SIGKILL
    gives a run no chance to remove its own) and say so in one line, with the space freed; None when
    there were none. Every check calls it first, whether it spills or not."""
    sizes: dict[Path, int] = {}
    removed = sweep(Path(tempfile.gettempdir()), SPILL_PREFIX, sizes)
    if not removed:
        return None
    n = len(removed)
    return (
        f"removed {n} trace spill folder{'s' if n != 1 else ''} ({size(sum(sizes.values()))}) that killed parity runs "
        f"left in {tempfile.gettempdir()}"
    )


def sweep(parent: Path, prefix: str, sizes: dict[Path, int] | None = None) -> list[Path]:
    """Remove ``<prefix><host>-<pid>-*`` folders in ``parent`` left by a process of this host that
    is gone, and any such folder untouched for :data:`STALE_SECONDS`. Returns what was removed
    (``sizes``: filled with the bytes each held)."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        match = re.match(rf"{re.escape(prefix)}([0-9a-f]{{8}})-(\d+)-", entry.name)
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        ours = match is not None and match.group(1) == _HOST
        if (
            ours and match is not None and int(match.group(2)) != os.getpid() and not _alive(int(match.group(2)))
        ) or age > STALE_SECONDS:
            if sizes is not None:
                sizes[Path(entry.path)] = _du(entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def staging_folder(parent: Path) -> Path:
    """A new hidden, live staging folder in ``parent`` (created), after sweeping stale ones.

    It is made 0700 (like mkdtemp's); it gets the umask's mode instead, like any folder ``mkdir`` makes (and
    like the files :func:`atomic_write` puts in it), so a published report is as readable as its files.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    sweep(parent, ".staging-")
    folder = _new_live_folder(parent, ".staging-")
    os.chmod(folder, 0o777 & ~_umask())
    return folder


def temporary_folder(prefix: str) -> Path:
    """A new live folder ``<tmp>/<prefix><host>-<pid>-*`` after sweeping stale ones; the caller
    removes it and calls :func:`done`."""
    parent = Path(tempfile.gettempdir())
    sweep(parent, prefix)
    return _new_live_folder(parent, prefix)


def _new_live_folder(parent: Path, prefix: str) -> Path:
    """Make ``parent/<prefix><host>-<pid>-<random>`` (mode 0700), marked live *before* it exists:
    a SIGTERM between making a folder and marking it would leave it behind (a handler removing a
    folder not yet made removes nothing, and the process ends before making it)."""
    for _ in range(100):
        folder = parent / (_live_name(prefix) + secrets.token_hex(4))
        live(folder)
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            done(folder)
            continue
        except BaseException:
            done(folder)
            raise
        return folder
    raise FileExistsError(errno.EEXIST, "no free temporary folder name", str(parent / _live_name(prefix)))


def publish_folder(staging: Path, parent: Path, stem: str) -> Path:
    """Rename a finished staging folder to ``parent/<stem>`` (or ``<stem>-2``, ``-3``...).

    ``os.rename`` onto an existing non-empty folder fails, so an earlier report is never replaced
    even by a concurrent run. ``stem`` is shortened to :data:`MAX_NAME` bytes.
    """
    stem = short_name(stem)
    for n in range(1, 10_000):
        target = parent / (stem if n == 1 else f"{stem}-{n}")
        if target.exists():
            continue
        try:
            os.rename(staging, target)
        except OSError:
            if not target.exists():
                raise
            continue
        done(staging)
        return target
    raise FileExistsError(f"no free report folder name for {stem} under {parent}")


def discard(folder: Path) -> None:
    """Remove a live folder (a staging folder that will not be published, a temporary folder)."""
    shutil.rmtree(folder, ignore_errors=True)
    done(folder)


# --- outputs that cannot be written: nothing visible, the space needed said ---------------------------


def disk_full(e: BaseException) -> bool:
    """True for the errors of a full disk or quota."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def free_bytes(folder: str | Path) -> int | None:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent)."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def cannot_write(e: OSError, what: str, where: str | Path, needed: int | None = None) -> OutputError:
    """The one-line error for an output that could not be written (nothing of it is left visible):
    on a full disk, how much it needed and how much is free."""
    if disk_full(e):
        free = free_bytes(where)
        need = f"it needs about {size(needed)}" if needed else "it needs more"
        have = f", {size(free)} free" if free is not None else ""
        return OutputError(
            f"{what} could not be written: no space left on the device of {where} ({need}{have}); nothing was "
            "written: free some space or write elsewhere, and run again"
        )
    name = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return OutputError(f"{what} could not be written to {where}: {e.strerror or e}{name}; nothing was written")


def write_folder(parent: Path, stem: str, fill: Callable[[Path], object], what: str = "the report") -> Path:
    """A new folder ``parent/<stem>`` (or ``<stem>-2``...) holding what ``fill(folder)`` writes through
    :func:`atomic_write`, published whole: it is filled under a hidden staging name and renamed when
    complete. When it cannot be written (a full disk, a read-only folder), nothing is left visible and
    :class:`~parity.util.errors.OutputError` says why, on a full disk with the space it needed
    (``fill`` run again under :func:`measuring`, which writes nothing)."""
    parent = Path(parent)
    try:
        staging = staging_folder(parent)
    except OSError as e:
        raise _unwritten(e, fill, what, parent) from None
    try:
        fill(staging)
        return publish_folder(staging, parent, stem)
    except OSError as e:
        discard(staging)
        raise _unwritten(e, fill, what, parent) from None
    except BaseException:
        discard(staging)
        raise


def _unwritten(e: OSError, fill: Callable[[Path], object], what: str, parent: Path) -> OutputError:
    needed = None
    if disk_full(e):
        with measuring() as sizes:
            fill(parent / ".parity-measure-only")  # nothing is written under measuring()
        needed = sum(-(-n // 4096) * 4096 for n in sizes) + 4096  # whole blocks, and the folder itself
    return cannot_write(e, what, parent, needed)
