"""A validated request: the inputs both models get (token ids, padding mask, positions as generation
derives them) and how nodes are judged, checked against the pair before anything runs."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from parity.compare.tolerances import Tolerances
from parity.model.derive import remote_code_note
from parity.model.pair import Pair
from parity.run.memory import check_footprint, decode_bytes
from parity.run.options import CheckOptions, DecodePlan
from parity.util.errors import ParityError
from parity.util.files import sweep_spills
from parity.util.resources import GIB, require, require_disk


def versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


@dataclass(frozen=True)
class Run:
    """A validated request: the inputs both models get, the options it runs with, and the tolerance
    rule they give its nodes (the pair's exactness claim resolved)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    #: ``(batch, seq)`` token positions: 0..S-1, or counted over real tokens when padded (as generate does)
    position_ids: torch.Tensor
    options: CheckOptions
    tolerances: Tolerances
    notes: tuple[str, ...]

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def calibrate(self) -> bool:
        return self.options.calibrate

    @property
    def trace_memory(self) -> int | None:
        """Bytes of each trace kept in memory before it spills to disk (None: never spill)."""
        return self.options.trace_memory


def check_patterns(pair: Pair, options: CheckOptions) -> None:
    """Every tolerance pattern must match a node of this pair (a typo would silently judge nothing)."""
    for pattern in options.tolerances:
        if not any(fnmatch.fnmatchcase(n.name, pattern) for n in pair.nodes):
            raise ParityError(f"tolerance pattern {pattern!r} matches no node of this pair")


def run_inputs(pair: Pair, options: CheckOptions, input_ids=None, attention_mask=None):
    """``(input_ids, attention_mask)`` of a run: the given ids (checked against the vocabulary) or
    seeded random ones of the options' shape, and the mask ``left_pad`` builds. Raises ParityError."""
    left_pad = options.left_pad
    if input_ids is None:
        input_ids = pair.make_inputs(options.seq_len, options.batch_size)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.uint8,
    ):
        got = f"{input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ParityError(f"input_ids must be an integer tensor of token ids (batch, seq), got a {got}")
    if input_ids.dim() != 2:
        raise ParityError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ParityError(f"input_ids hold no token: shape {tuple(input_ids.shape)}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= pair.vocab_size:
        raise ParityError(
            f"input_ids must lie in [0, {pair.vocab_size}), got [{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    swapped = [t for t in pair.facts.placeholder_tokens if bool((input_ids == t).any())]
    if swapped:
        raise ParityError(
            f"input_ids hold token {swapped[0]}, a multimodal placeholder the reference ({type(pair.reference).__name__}) "
            "replaces before its text model; a text-only check cannot compare it (leave it out of input_ids)"
        )
    if left_pad:
        if attention_mask is not None or input_ids.shape[0] < 2 or not 0 < left_pad < input_ids.shape[1]:
            raise ParityError(
                f"left_pad {left_pad} needs batch_size >= 2, 0 < left_pad < seq_len ({input_ids.shape[1]}) and no attention_mask"
            )
        attention_mask = torch.ones_like(input_ids)
        attention_mask[:-1, :left_pad] = 0
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ParityError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    return input_ids, attention_mask


def generation_positions(attention_mask: torch.Tensor | None, batch: int, seq: int, offset: int = 0) -> torch.Tensor:
    """``(batch, seq)`` positions as ``generate`` derives them: ``0 .. seq - 1`` without padding; with
    an attention mask, real tokens counted from 0 in each row (padding gets 1, as in Transformers'
    ``prepare_inputs_for_generation``). ``offset`` (:attr:`ArchFacts.position_offset`): a reference whose
    embedding counts positions from ``padding_idx + 1`` (RoBERTa's ``create_position_ids_from_input_ids``)
    gets its own convention, real tokens counted from ``offset`` and padding at ``offset - 1``, the table's
    padding row."""
    if attention_mask is None:
        return torch.arange(seq).expand(batch, seq) + offset
    positions = attention_mask.long().cumsum(-1) - 1 + offset
    return positions.masked_fill(attention_mask == 0, offset - 1 if offset else 1)


def window_notes(pair: Pair, seq_len: int) -> list[str]:
    facts = pair.facts
    windows = sorted({w for w in facts.windows if w})
    if windows and seq_len <= windows[-1]:
        return [
            f"seq_len {seq_len} does not exceed the sliding window ({windows[-1]}): sliding layers "
            f"behave like full attention here; pass --seq-len {windows[-1] + 1} or more to exercise the window"
        ]
    return []


def chunk_notes(pair: Pair, seq_len: int) -> list[str]:
    chunk = pair.facts.chunk_size
    if chunk and seq_len <= chunk:
        return [
            f"seq_len {seq_len} does not exceed the linear-attention chunk ({chunk} tokens): the state carried "
            f"from one chunk to the next is not exercised; pass --seq-len {chunk + 1} or more"
        ]
    return []


def decode_chunk_notes(pair: Pair, run_notes, decode_plan) -> list[str]:
    """A decode run's notes: the chunk note speaks of its longest call (each call continues the state
    from the cache; only a call longer than a chunk carries it from chunk to chunk inside the rule)."""
    calls = decode_plan.schedule()
    longest, chunk = max(b - a for a, b in calls), pair.facts.chunk_size
    if len(calls) == 1 or not chunk:
        return list(run_notes)
    notes = [n for n in run_notes if n not in chunk_notes(pair, decode_plan.prefill)]
    if longest <= chunk:
        notes.append(
            f"no call of decode plan {decode_plan.describe()} exceeds the linear-attention chunk ({chunk} tokens): the "
            f"state is carried from call to call through the cache, never from one chunk to the next inside a call; a "
            f"prefill chunk of {chunk + 1} or more tokens exercises that too"
        )
    return notes


def decode_window_notes(pair: Pair, run_notes, decode_plan) -> list[str]:
    """A decode run's notes: the window note speaks of every token the plan reaches (prefill and steps),
    not of the prefill alone; a plan that stays inside the window is told how to cross it with --decode
    (--seq-len goes with a plain check only)."""
    notes = [n for n in run_notes if n not in window_notes(pair, decode_plan.prefill)]
    windows = sorted({w for w in pair.facts.windows if w})
    if windows and decode_plan.total <= windows[-1]:
        window = windows[-1]
        prefill = max(1, window + 1 - decode_plan.steps)
        notes.append(
            f"decode plan {decode_plan.describe()} reaches {decode_plan.total} tokens, not past the sliding window "
            f"({window}): sliding layers behave like full attention here; a plan reaching {window + 1} tokens or "
            f"more exercises the window, e.g. --decode {prefill}x{decode_plan.steps}"
        )
    return notes


def position_notes(pair: Pair, seq_len: int) -> list[str]:
    limit = pair.facts.max_position_embeddings
    if limit and seq_len > limit:
        return [
            f"seq_len {seq_len} exceeds max_position_embeddings ({limit}): positions {limit} and later lie past "
            f"the context the config declares, where the reference makes no promise; pass --seq-len {limit} or less "
            "unless that is what you mean to test"
        ]
    return []


def plan(pair: Pair, options: CheckOptions | None = None, input_ids=None, attention_mask=None) -> Run:
    """Validate ``options`` against the pair, build the run's inputs, and refuse a run that would not
    fit in memory. Raises ParityError."""
    options = CheckOptions() if options is None else options
    swept = sweep_spills()  # what killed runs left in $TMPDIR, whether this run spills or not
    remote = remote_code_note(getattr(pair.reference, "config", None))
    check_patterns(pair, options)
    if input_ids is None:  # judged before the ids exist: a huge --seq-len is refused, not allocated
        _require_room(
            pair,
            options.batch_size,
            options.seq_len or pair.default_seq_len,
            options.trace_memory,
            options.calibrate,
            options.decode,
        )
    input_ids, attention_mask = run_inputs(pair, options, input_ids, attention_mask)
    batch, seq = input_ids.shape
    _require_room(pair, batch, seq, options.trace_memory, options.calibrate, options.decode)
    return Run(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=generation_positions(attention_mask, batch, seq, pair.facts.position_offset),
        options=options,
        tolerances=options.tolerance_rule(pair.dtype, options.resolved_exact(pair.exact)),
        notes=((swept,) if swept else ())
        + ((remote,) if remote else ())
        + tuple(pair.notes)
        + tuple(window_notes(pair, seq))
        + tuple(chunk_notes(pair, seq))
        + tuple(position_notes(pair, seq)),
    )


def weight_bytes(pair: Pair) -> int:
    seen, total = set(), 0
    for tensor in pair.loading.state_dict.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def _require_room(
    pair: Pair, batch: int, seq: int, trace_memory: int | None, calibrate: bool, decode: DecodePlan | None = None
) -> None:
    """Refuse a check whose traces and forward passes would not fit (see :mod:`parity.util.resources`); a
    decode check by its widest call (:func:`parity.run.memory.decode_bytes`: its traces stay in memory)."""
    size = torch.finfo(pair.dtype).bits // 8
    if decode is not None:
        require(
            decode_bytes(pair.facts, batch, decode.schedule(), size),
            f"decoding {batch} x {decode.total} tokens (decode plan {decode.describe()})",
            "use a shorter prefill, prefill in chunks (PREFILL:CHUNKxSTEPS), a smaller --batch or fewer layers",
        )
        return
    need = check_footprint(pair.facts, batch, seq, size, trace_memory)
    memory = need.memory
    if calibrate:  # a float64 copy of the reference runs too
        memory += weight_bytes(pair) * 8 // size + check_footprint(pair.facts, batch, seq, 8, trace_memory).memory
    advice = "use a shorter --seq-len, a smaller --batch or fewer layers"
    require(
        memory,
        f"tracing {batch} x {seq} tokens" + (" (and a float64 copy to calibrate)" if calibrate else ""),
        advice + (" (or a smaller --trace-memory)" if trace_memory and trace_memory > GIB else ""),
    )
    require_disk(
        need.disk,
        f"spilling the traces of {batch} x {seq} tokens past --trace-memory",
        f"{advice}, or point TMPDIR to a larger disk",
    )
