"""Refuse, with numbers, work that cannot fit in this machine's memory, instead of being OOM-killed."""

from __future__ import annotations

from pathlib import Path

from .errors import ParityError

GIB = 1024**3
#: share of the available memory a run may plan to use (forward passes need room beyond what is counted)
BUDGET = 0.8


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where that is unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require(needed: int, what: str, advice: str) -> None:
    """Raise ParityError if ``needed`` bytes exceed :data:`BUDGET` of the available memory."""
    available = available_bytes()
    if available is not None and needed > BUDGET * available:
        raise ParityError(
            f"{what} needs about {needed / GIB:.1f} GiB but {available / GIB:.1f} GiB are available: {advice}"
        )


def trace_bytes(cfg: dict, batch: int, seq: int, element_size: int) -> int:
    """Rough peak of a check: both traces (per layer the attention probabilities plus ~17 hidden-size
    and 3 FFN-size tensors per token, plus the logits) and the float64 working copies comparing the
    largest node takes (about six of it)."""
    heads, vocab = cfg.get("n_heads", 1), cfg.get("vocab_size", 0)
    per_token_layer = heads * seq + 17 * cfg.get("emb_dim", 0) + 3 * cfg.get("hidden_dim", 0)
    per_token = cfg.get("n_layers", 1) * per_token_layer + 2 * vocab
    traces = 2 * element_size * batch * seq * per_token
    largest = batch * seq * max(heads * seq, vocab, cfg.get("hidden_dim", 0))
    return traces + 6 * 8 * largest
