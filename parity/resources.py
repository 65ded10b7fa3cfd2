"""Refuse, with numbers, work that cannot fit in this machine's memory, instead of being OOM-killed."""

from __future__ import annotations

from .errors import ParityError
from .facts import ArchFacts

GIB = 1024**3
#: share of the available memory a run may plan to use (forward passes need room beyond what is counted)
BUDGET = 0.8


def available_bytes() -> int | None:
    """Memory available to new allocations (psutil's ``available``), or None where that is unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # no psutil support on this platform: do not guess
        return None


def require(needed: int, what: str, advice: str) -> None:
    """Raise ParityError if ``needed`` bytes exceed :data:`BUDGET` of the available memory."""
    available = available_bytes()
    if available is not None and needed > BUDGET * available:
        raise ParityError(
            f"{what} needs about {needed / GIB:.1f} GiB but {available / GIB:.1f} GiB are available: {advice}"
        )


def trace_bytes(facts: ArchFacts, batch: int, seq: int, element_size: int) -> int:
    """Rough peak of a check: both traces (per layer the attention scores and probabilities plus ~17
    hidden-size and 3 FFN-size tensors per token, one hidden-size tensor per expert of a MoE layer,
    plus the logits) and the float64 working copies comparing the largest node takes (about six of it)."""
    heads, vocab = max(facts.num_heads, 1), facts.vocab_size
    ffn = facts.intermediate_size or 4 * facts.hidden_size
    per_token_layer = 2 * heads * seq + 17 * facts.hidden_size + 3 * ffn
    experts = sum(layer.num_experts for layer in facts.layers) * facts.hidden_size
    per_token = max(facts.num_layers, 1) * per_token_layer + experts + 2 * vocab
    traces = 2 * element_size * batch * seq * per_token
    largest = batch * seq * max(heads * seq, vocab, ffn)
    return traces + 6 * 8 * largest
