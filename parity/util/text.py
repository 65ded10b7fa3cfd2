"""One-line messages: an exception's text as one line, a long list cut to its first items."""

from __future__ import annotations

import re

#: the wrapper huggingface_hub's strict dataclasses put around a validator's own message
_VALIDATOR_WRAPPER = re.compile(
    r"^(?:Class validation error for validator '[^']*'|Validation error for field '[^']*'):\s*"
    r"(?:[A-Za-z_.]*(?:Error|Exception|Warning):\s*)?"
)


def one_line(e: BaseException) -> str:
    """An exception's message as one line, the reason kept whole (Transformers' validators put it
    on a second line, under a header naming the validator function)."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    text = " ".join(p.strip() for p in text.splitlines() if p.strip())
    return _VALIDATOR_WRAPPER.sub("", text) or type(e).__name__


def summary(items: list[str], n: int = 3, what: str = "") -> str:
    """The first ``n`` items and how many there are in all (a message stays one readable line)."""
    body = "; ".join(items[:n])
    return body + (f"; ... ({len(items)} {what or 'in all'})" if len(items) > n else "")


def size(nbytes: float) -> str:
    """``1.5 GiB``, ``230 KiB``, ``12 B``: a byte count for a message."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def grouped(lines: list[str], least: int = 4, what: str = "tensors") -> list[str]:
    """``key: what happened`` lines with one line per kind that ``least`` or more keys share
    (``236 tensors: float32 -> bfloat16 (model.embed_tokens.weight, ...)``), the others as they are,
    in the order each kind first appears: a checkpoint cast to another dtype is one line, not 236."""
    kinds: dict[str, list[str]] = {}
    for line in lines:
        key, sep, rest = line.partition(": ")
        kinds.setdefault(rest if sep else line, []).append(key if sep else "")
    out: list[str] = []
    done: set[str] = set()
    for line in lines:
        key, sep, rest = line.partition(": ")
        kind = rest if sep else line
        keys = kinds[kind]
        if not sep or len(keys) < least:
            out.append(line)
        elif kind not in done:
            done.add(kind)
            out.append(f"{len(keys)} {what}: {kind} ({keys[0]}, ...)")
    return out
