"""The memory model of a check: what one trace, the largest node and a forward pass cost, and what
the guard must find free before a check starts (see the README's Speed and memory)."""

from __future__ import annotations

from dataclasses import dataclass

from parity.model.facts import ArchFacts
from parity.util.resources import TRACE_MEMORY


def _per_layer(facts: ArchFacts) -> tuple[int, int, int]:
    heads = max(facts.num_heads, 1)
    ffn = facts.intermediate_size or 4 * facts.hidden_size
    return heads, ffn, max(facts.num_layers, 1)


def one_trace_bytes(facts: ArchFacts, batch: int, seq: int, element_size: int) -> int:
    """Bytes of one model's full trace: per layer the attention scores and probabilities, ~24
    hidden-size and 3 FFN-size tensors per token (nodes and the module inputs kept for diagnosis),
    one hidden-size tensor per expert of a MoE layer, plus the embeddings and the logits."""
    heads, ffn, layers = _per_layer(facts)
    per_token_layer = 2 * heads * seq + 24 * facts.hidden_size + 3 * ffn
    experts = sum(layer.num_experts for layer in facts.layers) * facts.hidden_size
    per_token = layers * per_token_layer + experts + 3 * facts.hidden_size + facts.vocab_size
    return element_size * batch * seq * per_token


def largest_node_bytes(facts: ArchFacts, batch: int, seq: int, element_size: int) -> int:
    """Bytes of the largest single node: an attention matrix, an FFN activation or the logits."""
    heads, ffn, _ = _per_layer(facts)
    return element_size * batch * seq * max(heads * seq, ffn, facts.vocab_size, facts.hidden_size)


def forward_bytes(facts: ArchFacts, batch: int, seq: int, element_size: int, budget: int | None = TRACE_MEMORY) -> int:
    """Working set of a check's forward passes beyond the weights, at their widest. In a layer's
    attention: two attention-matrix-sized tensors (eager attention keeps two alive at a time, and a
    node being compared is read from disk in chunks, not held) and a few FFN- and hidden-width
    activations. At the head: ours' logits, and the reference's while they are recorded (a copy
    when they fit the trace budget, else written straight to disk). One layer at a time: depth does
    not add to it."""
    heads, ffn, _ = _per_layer(facts)
    attention = 2 * heads * seq * seq + seq * (4 * ffn + 8 * facts.hidden_size)
    logits = seq * facts.vocab_size
    head = logits + (logits if budget is None else min(logits, budget // max(element_size * batch, 1)))
    head += seq * 4 * facts.hidden_size
    return element_size * batch * max(attention, head) + 64 * 1024**2  # + the comparison's chunk buffers


@dataclass(frozen=True)
class Footprint:
    """What a check adds to the weights: bytes of memory and of disk (spilled traces)."""

    memory: int
    disk: int


def check_footprint(facts: ArchFacts, batch: int, seq: int, element_size: int, budget: int | None) -> Footprint:
    """The memory model above, for one check (one forward at a time; ``budget`` None: no spilling)."""
    reference = one_trace_bytes(facts, batch, seq, element_size)
    kept_ours = 3 * largest_node_bytes(facts, batch, seq, element_size)  # a failing node, its input, its context
    in_memory = reference if budget is None else min(reference, budget)
    kept_memory = kept_ours if budget is None else min(kept_ours, budget)
    disk = 0 if budget is None else max(0, reference - budget) + max(0, kept_ours - budget)
    return Footprint(memory=forward_bytes(facts, batch, seq, element_size, budget) + in_memory + kept_memory, disk=disk)


def step_trace_bytes(facts: ArchFacts, batch: int, length: int, context: int, element_size: int) -> int:
    """Bytes of one model's trace of one decode call of ``length`` new tokens over ``context`` tokens so
    far: per layer the attention scores and probabilities (``length x context`` per head), ~24
    hidden-size and 3 FFN-size tensors per new token, the keys and values its cache holds (and the keys
    and values the call's attention reads, over the context); one hidden-size tensor per expert of a
    MoE layer per token, the embeddings, and the head's two vocabulary-wide nodes (lm_head, logits)."""
    heads, ffn, layers = _per_layer(facts)
    kv = 2 * max(facts.num_kv_heads, 1) * max(facts.head_dim, 1)
    per_layer = 2 * heads * length * context + length * (24 * facts.hidden_size + 3 * ffn) + 2 * kv * context
    experts = sum(layer.num_experts for layer in facts.layers) * facts.hidden_size * length
    head = length * (3 * facts.hidden_size + 2 * facts.vocab_size)
    return element_size * batch * (layers * per_layer + experts + head)


def decode_bytes(facts: ArchFacts, batch: int, calls: list[tuple[int, int]], element_size: int) -> int:
    """What a decode check (:mod:`parity.run.decode`) adds to the weights, at its widest call ``(start,
    end)`` of ``calls`` (the plan's schedule): both models' traces of the call, alive while they are
    compared, and both traces of the first failing call, kept for its diagnosis (at most the widest
    call's); both caches over the tokens so far; the call's logits (float32 upcasts of the last row
    for the greedy choice are small); and the working set of ours' full forward over every token so
    far (the cached logits are checked against it each step), its logits included. One call's traces
    at a time: the number of steps does not add to it (only the context length does)."""
    layers = max(facts.num_layers, 1)
    kv = 2 * max(facts.num_kv_heads, 1) * max(facts.head_dim, 1)
    widest = 0
    for start, end in calls:
        length = end - start
        traces = 4 * step_trace_bytes(facts, batch, length, end, element_size)
        caches = 2 * element_size * batch * layers * kv * end
        logits = 2 * element_size * batch * length * facts.vocab_size
        full = forward_bytes(facts, batch, end, element_size, budget=None)
        widest = max(widest, traces + caches + logits + full)
    return widest


def trace_bytes(facts: ArchFacts, batch: int, seq: int, element_size: int) -> int:
    """Rough peak of a check holding both traces whole (a trace recorded to a folder, :mod:`parity.golden`):
    both traces (per layer the attention scores and probabilities plus ~17
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


def backward_bytes(
    facts: ArchFacts, batch: int, seq: int, element_size: int, weights: int, budget: int | None = TRACE_MEMORY
) -> int:
    """What a backward check (:mod:`parity.run.backward`) adds to the weights, one model's autograd
    graph at a time: the activations autograd keeps for the backward (about two full traces' worth:
    every layer's inputs, the attention matrices, the float32 upcasts of norms and softmax), the
    float32 logits the loss reads and their gradient (three copies), both models' parameter
    gradients (twice the weights), and the two gradient traces up to the trace budget each."""
    graph = 2 * one_trace_bytes(facts, batch, seq, element_size)
    logits = 3 * 4 * batch * seq * facts.vocab_size
    grads = one_trace_bytes(facts, batch, seq, element_size)
    kept = 2 * (grads if budget is None else min(grads, budget))
    return graph + logits + 2 * weights + kept + forward_bytes(facts, batch, seq, element_size, budget)


def causality_bytes(facts: ArchFacts, rows: int, seq: int, element_size: int) -> int:
    """A causality check's forward of ``rows`` sequences at once (the base and one perturbed copy per
    tested position), each node judged as it is produced and dropped: one forward's working set and
    one node's float64 differences."""
    return forward_bytes(facts, rows, seq, element_size, 0) + 3 * 8 * largest_node_bytes(facts, rows, seq, 1)
