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
