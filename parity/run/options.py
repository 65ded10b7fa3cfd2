"""How a check runs and judges, as one frozen, validated value shared by every entry point.

:class:`CheckOptions` is what :func:`parity.check`, :func:`parity.check_model`, golden traces
(``record``, ``compare``), the command line and the pytest plugin pass down: the probe's shape
(``seq_len``, ``batch_size``, ``left_pad``), the mode, the tolerance rule (``atol``/``rtol``, node
patterns, ``calibrate`` or ``exact``), a decode plan and the trace's memory budget. What needs the
pair (a tolerance pattern that matches no node, a left pad longer than the sequence) is checked
by :func:`parity.run.plan.plan`; everything else here, when the value is made, so a bad option is
one :class:`~parity.util.errors.ParityError` before any model runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from parity.util.errors import ParityError
from parity.util.resources import TRACE_MEMORY

if TYPE_CHECKING:  # the options themselves need neither: the command line checks them before torch loads
    import torch

    from parity.compare.tolerances import Tolerances

MODES = ("chained", "isolated", "both")
#: optimizers a backward check can take one step with (torch.optim.AdamW, torch.optim.SGD, their defaults)
STEPS = ("adamw", "sgd")
#: the step's learning rate when none is given (torch.optim.AdamW's default)
DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class DecodePlan:
    """``prefill`` tokens (in ``chunk``-token pieces, or at once), then ``steps`` single tokens (at
    least one: a plan without steps is a plain check of the prompt)."""

    prefill: int
    steps: int = 1
    chunk: int | None = None

    def __post_init__(self):
        for part, value, least in (("prefill", self.prefill, 1), ("steps", self.steps, 1), ("chunk", self.chunk, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                extra = "; without decode steps it checks the prompt only: run a plain check" if part == "steps" else ""
                raise ParityError(
                    f"decode plan {self.describe()} (PREFILL[:CHUNK]xSTEPS): {part} is {value}; "
                    f"it must be at least {least}{extra}"
                )

    @classmethod
    def parse(cls, text: str) -> DecodePlan:
        """``PREFILL[:CHUNK]xSTEPS`` (``12:4x8``: prefill 12 tokens in chunks of 4, then 8 steps)."""
        m = re.fullmatch(r"\s*(\d+)(?::(\d+))?\s*x\s*(\d+)\s*", text)
        if not m:
            raise ParityError(f"--decode {text!r} must be PREFILL[:CHUNK]xSTEPS, e.g. 12:4x8 or 16x4")
        prefill, chunk, steps = int(m.group(1)), m.group(2), int(m.group(3))
        return cls(prefill, steps, int(chunk) if chunk is not None else None)

    def describe(self) -> str:
        return f"{self.prefill}{f':{self.chunk}' if self.chunk is not None else ''}x{self.steps}"

    @property
    def total(self) -> int:
        return self.prefill + self.steps

    def schedule(self) -> list[tuple[int, int]]:
        """``(start, end)`` token ranges, one per step: the prefill chunks, then one per decode step."""
        size = self.chunk or self.prefill
        spans = [(a, min(a + size, self.prefill)) for a in range(0, self.prefill, size)]
        return spans + [(t, t + 1) for t in range(self.prefill, self.total)]


def _number(label: str, value, *, integer: bool = False, least: float = 0, allow_none: bool = True):
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or (not integer and not math.isfinite(value))
        or value < least
    ):
        what = "an integer" if integer else "a finite number"
        raise ParityError(f"{label} must be {what} >= {least:g}, got {value!r}")


@dataclass(frozen=True)
class CheckOptions:
    """How a check runs and judges its nodes (everything but the pair and its inputs).

    * ``seq_len`` (tokens, default the pair's ``default_seq_len``), ``batch_size``, ``left_pad``
      (every row but the last starts with that many padding tokens; needs ``batch_size >= 2``);
    * ``mode``: ``chained`` (both models run on their own), ``isolated`` (each node of ours
      continues from the reference's input for it) or ``both``;
    * the tolerance rule, ``|ours - ref| <= atol + rtol * |ref|`` per element: ``atol``/``rtol``
      run-wide (default: the dtype's, :data:`parity.compare.tolerances.DEFAULT_TOLERANCES`),
      ``tolerances`` ``{node glob: (atol, rtol)}`` winning over everything, ``calibrate`` (each
      node's atol = 10x the reference's own error against float64) or ``exact`` (atol = rtol = 0;
      None: what the pair's family claims for its dtype, unless a tolerance is given);
    * ``decode``: a :class:`DecodePlan` (or its text ``"12:4x8"``): run both models through their KV
      caches instead (chained, fixed tolerances);
    * ``trace_memory``: bytes of a trace held in memory before it spills to disk (None: never).
    * ``semantic``: judge in two runs (:mod:`parity.run.semantic`): both models in float64 first
      (a node that differs beyond 1e-9 of its scale there is a difference of formula), then the run's
      dtype within 10x the reference's own error against float64 (precision); None: on for a pair
      not claimed bit-exact when no tolerance rule is given (a user's model), off otherwise.
    * ``backward``: training parity after the forward check (:mod:`parity.run.backward`): both
      models in train mode with dropout off, the loss, every node's gradient, every parameter's
      gradient; ``labels`` ``(batch, seq)`` integer (-100: ignored; default the input ids, padding
      -100, shifted inside the loss as Transformers' ``ForCausalLMLoss`` does); ``step``
      (``"adamw"`` or ``"sgd"``) with ``lr`` (default 1e-3): one optimizer step on float32 copies,
      the updated weights compared;
    * ``causality``: logits at position ``t`` must not depend on tokens after ``t``: each model's
      nodes checked under perturbed later tokens (the first node that leaks is named).
    * real text (:mod:`parity.run.inputs`, :mod:`parity.run.prompt_set`): ``prompts`` (strings, or
      lists of ``{"role", "content"}`` messages) tokenized with the checkpoint's tokenizer, or
      ``prompt_ids`` (lists of token ids, any lengths); ``chat``: through the tokenizer's chat
      template. ``batch_size`` prompts run at a time, padded as the tokenizer pads (left for a
      decode plan, whose prefill becomes each batch's prompt length); the verdict is over the set.
      ``locate``: per node, the batch row and position of its largest difference
      (``result.meta["worst_at"]``; the prompt-set verdict sets it).

    Raises ParityError, naming the option, for a value no check could use.
    """

    seq_len: int | None = None
    batch_size: int = 1
    left_pad: int = 0
    mode: str = "chained"
    atol: float | None = None
    rtol: float | None = None
    tolerances: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    calibrate: bool = False
    exact: bool | None = None
    decode: DecodePlan | None = None
    trace_memory: int | None = TRACE_MEMORY
    semantic: bool | None = None
    backward: bool = False
    labels: torch.Tensor | None = field(default=None, compare=False, repr=False)
    step: str | None = None
    lr: float | None = None
    causality: bool = False
    prompts: tuple = field(default=(), compare=False)
    prompt_ids: tuple = field(default=(), compare=False)
    chat: bool = False
    locate: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ParityError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        _number("seq_len", self.seq_len, integer=True, least=1)
        _number("batch_size", self.batch_size, integer=True, least=1, allow_none=False)
        _number("left_pad", self.left_pad, integer=True, least=0, allow_none=False)
        _number("atol", self.atol)
        _number("rtol", self.rtol)
        _number("trace_memory", self.trace_memory, integer=True, least=0)
        for flag in ("calibrate", "backward", "causality"):
            if not isinstance(getattr(self, flag), bool):
                raise ParityError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.exact is not None and not isinstance(self.exact, bool):
            raise ParityError(f"exact must be True, False or None, got {self.exact!r}")
        if self.semantic is not None and not isinstance(self.semantic, bool):
            raise ParityError(f"semantic must be True, False or None, got {self.semantic!r}")
        if self.semantic and (self.atol is not None or self.rtol is not None or self.calibrate or self.exact):
            raise ParityError(
                "semantic sets each node's tolerance itself (float64, then 10x the reference's own "
                "error); drop atol/rtol/calibrate/exact, or override nodes with tolerances="
            )
        if self.semantic and self.decode is not None:
            raise ParityError("a decode check runs in the model's dtype only; drop semantic or the decode plan")
        if not isinstance(self.tolerances, Mapping):
            raise ParityError(
                f"tolerances must map node patterns to (atol, rtol), got {type(self.tolerances).__name__}"
            )
        for pattern, tol in self.tolerances.items():
            if not (
                isinstance(tol, (tuple, list))
                and len(tol) == 2
                and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in tol
                )
            ):
                raise ParityError(f"tolerances[{pattern!r}] must be (atol, rtol), finite and >= 0, got {tol!r}")
        object.__setattr__(
            self, "tolerances", MappingProxyType({p: (float(a), float(r)) for p, (a, r) in self.tolerances.items()})
        )
        if self.calibrate and (self.atol is not None or self.rtol is not None):
            raise ParityError(
                "calibrate sets each node's atol (rtol 0); drop atol/rtol, or override nodes with tolerances="
            )
        if self.exact and (self.atol is not None or self.rtol is not None or self.calibrate):
            raise ParityError("exact sets atol = rtol = 0 on every node; drop atol/rtol/calibrate")
        if isinstance(self.decode, str):
            object.__setattr__(self, "decode", DecodePlan.parse(self.decode))
        if self.decode is not None:
            if not isinstance(self.decode, DecodePlan):
                raise ParityError(
                    f"decode must be a DecodePlan or PREFILL[:CHUNK]xSTEPS, got {type(self.decode).__name__}"
                )
            if self.mode != "chained" or self.calibrate:
                raise ParityError(
                    "a decode check runs chained, with fixed tolerances (no isolated mode, no calibration)"
                )
            if self.seq_len is not None and self.seq_len != self.decode.prefill:
                raise ParityError(
                    f"seq_len {self.seq_len} and the decode plan's prefill {self.decode.prefill} disagree: "
                    "the prefill is the prompt"
                )
            object.__setattr__(self, "seq_len", self.decode.prefill)  # the prompt is the prefill
        self._check_training()
        self._check_text()

    def _check_text(self) -> None:
        """The real-text options (prompts, prompt_ids, chat), each refusal one line."""
        from parity.run.inputs import id_rows, prompt_item

        if not isinstance(self.chat, bool) or not isinstance(self.locate, bool):
            raise ParityError(f"chat and locate must be True or False, got {self.chat!r}, {self.locate!r}")
        prompts = (self.prompts,) if isinstance(self.prompts, str) else self.prompts
        if prompts is None or not isinstance(prompts, (list, tuple)):
            raise ParityError(f"prompts must be a list of strings or message lists, got {type(prompts).__name__}")
        object.__setattr__(self, "prompts", tuple(prompt_item(p) for p in prompts))
        if self.prompt_ids is None or (
            not isinstance(self.prompt_ids, (list, tuple)) and not hasattr(self.prompt_ids, "tolist")
        ):
            raise ParityError(f"prompt_ids must be a list of lists of token ids, got {type(self.prompt_ids).__name__}")
        object.__setattr__(self, "prompt_ids", id_rows(self.prompt_ids) if len(self.prompt_ids) else ())
        if self.prompts and self.prompt_ids:
            raise ParityError("give prompts or token ids (prompt_ids / --input-ids), not both")
        if self.chat and not self.prompts:
            raise ParityError("chat applies the tokenizer's chat template to prompts: give prompts too")
        if self.prompts or self.prompt_ids:
            if self.left_pad:
                raise ParityError("prompts are padded as the tokenizer pads them; drop left_pad (--left-pad)")
            if self.seq_len is not None and self.decode is None:
                raise ParityError("a prompt's length is its own; drop seq_len (--seq-len)")
            if self.backward or self.causality:
                raise ParityError("backward and causality run on the random probe; drop the prompts")

    def _check_training(self) -> None:
        """The backward, step and causality options, each refusal one line."""
        if self.decode is not None and (self.backward or self.causality):
            raise ParityError(
                "backward and causality run on the prompt in one forward, not through the KV cache; drop the decode plan"
            )
        if self.step is not None and self.step not in STEPS:
            raise ParityError(f"unknown step {self.step!r}; choose from {', '.join(STEPS)}")
        if self.step is not None and not self.backward:
            raise ParityError("a step needs the gradients: add backward=True (--backward)")
        _number("lr", self.lr)
        if self.lr is not None and (self.lr <= 0 or self.step is None):
            raise ParityError(
                f"lr {self.lr!r} must be > 0 and goes with a step (step='adamw' or 'sgd')"
                if self.lr <= 0
                else "lr is the step's learning rate: give step='adamw' or 'sgd' too"
            )
        labels = self.labels
        if labels is not None:
            import torch  # only a given labels tensor needs it

            if not self.backward:
                raise ParityError("labels are the loss's: add backward=True (--backward)")
            if (
                not isinstance(labels, torch.Tensor)
                or labels.dtype not in (torch.int64, torch.int32, torch.int16)
                or labels.dim() != 2
            ):
                got = (
                    f"a {labels.dtype} tensor of shape {tuple(labels.shape)}"
                    if isinstance(labels, torch.Tensor)
                    else type(labels).__name__
                )
                raise ParityError(f"labels must be an integer tensor (batch, seq) of token ids or -100, got {got}")

    @classmethod
    def of(cls, options: CheckOptions | None = None, **changes) -> CheckOptions:
        """``options`` (or the defaults) with ``changes``; an unknown option is one ParityError naming it
        and the known ones (no bare ``TypeError``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ParityError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the options are {', '.join(sorted(known))}"
            )
        base = options if options is not None else cls()
        if not isinstance(base, CheckOptions):
            raise ParityError(f"options must be a parity.CheckOptions, got {type(base).__name__}")
        return dataclasses.replace(base, **changes) if changes else base

    def resolved_exact(self, pair_exact: bool) -> bool:
        """Whether nodes are judged with atol = rtol = 0: ``exact`` when given, else the pair's claim,
        unless a tolerance rule was given."""
        if self.exact is not None:
            return self.exact
        return pair_exact and self.atol is None and self.rtol is None and not self.calibrate

    def resolved_semantic(self, pair_exact: bool) -> bool:
        """Whether the float64 semantic run judges: ``semantic`` when given, else on for a pair not
        claimed bit-exact when no other tolerance rule (atol, rtol, calibrate, exact) is given."""
        if self.semantic is not None:
            return self.semantic
        given = self.atol is not None or self.rtol is not None or self.calibrate or self.exact is not None
        return not pair_exact and not given and self.decode is None

    def tolerance_rule(self, dtype: torch.dtype, exact: bool) -> Tolerances:
        """The :class:`~parity.compare.tolerances.Tolerances` these options give nodes of ``dtype``."""
        from parity.compare.tolerances import Tolerances

        return Tolerances(dtype, self.atol, self.rtol, dict(self.tolerances), exact=exact)
