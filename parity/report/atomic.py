"""Write files and report folders so that a reader never sees half of one and nothing is overwritten."""

from __future__ import annotations

import datetime as _dt
import os
import re
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as fh:
            fh.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is as readable as any new file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def publish_folder(staging: Path, parent: Path, stem: str) -> Path:
    """Rename a finished staging folder to ``parent/<stem>`` (or ``<stem>-2``, ``-3``...).

    ``os.rename`` onto an existing non-empty folder fails, so an earlier report is never replaced
    even by a concurrent run.
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)
    for n in range(1, 10_000):
        target = parent / (stem if n == 1 else f"{stem}-{n}")
        if target.exists():
            continue
        try:
            os.rename(staging, target)
            return target
        except OSError:
            if not target.exists():
                raise
    raise FileExistsError(f"no free report folder name for {stem} under {parent}")


def run_stem(family: str, config: str) -> str:
    """``<family>-<config>-<UTC timestamp>``; config paths are reduced to their last part."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = Path(config).name or Path(config).resolve().name or "checkpoint"
    return f"{family}-{name}-{stamp}"


def staging_folder(parent: Path) -> Path:
    """A new, empty folder in ``parent`` to write a report into before :func:`publish_folder`.

    mkdtemp makes it 0700; it gets the umask's mode instead, like any folder ``mkdir`` makes (and
    like the 0644 files :func:`atomic_write` puts in it), so a published report is as readable as
    its files.
    """
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".staging-", dir=parent))
    os.chmod(folder, 0o777 & ~_umask())
    return folder
