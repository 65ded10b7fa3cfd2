"""``parity.check``: trace both models of a Pair on the same input and compare every node."""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hf_capture
from .analysis import error_profile, logits_effect
from .compare import NodeResult, compare_traces, first_mismatch
from .diagnose import diagnose
from .errors import ParityError
from .pair import Pair
from .trace import Trace, recording


@dataclass
class CheckResult:
    """Every node's comparison in reference execution order, plus the run's metadata."""

    nodes: list[NodeResult]
    meta: dict
    notes: list[str] = field(default_factory=list)
    #: error by position / head / channel of the first failing node (see parity.analysis.error_profile)
    profile: dict | None = None
    #: effect on predictions at the output node (see parity.analysis.logits_effect)
    logits: dict | None = None
    #: per-node results of isolated mode, when it ran (same order as ``nodes``)
    isolated: list[NodeResult] | None = None

    @property
    def first_mismatch(self) -> NodeResult | None:
        return first_mismatch(self.nodes)

    @property
    def passed(self) -> bool:
        return self.first_mismatch is None

    def verdict(self) -> str:
        """One line: parity holds, or the first node that fails with its metrics."""
        n = len(self.nodes)
        bad = self.first_mismatch
        if bad is None:
            return f"PASS: all {n} nodes agree within tolerance"
        failing = sum(not r.passed for r in self.nodes)
        return f"FAIL: first mismatch at node {bad.index} of {n}, {bad.line()} [{failing} nodes fail]"

    def to_frame(self):
        """pandas DataFrame, one row per node (columns documented in parity.report.csv)."""
        from .report.tables import nodes_frame

        return nodes_frame(self)

    def write_csv(self, path: str | Path) -> Path:
        from .report.tables import write_csv

        return write_csv(self, path)

    def write_json(self, path: str | Path) -> Path:
        from .report.tables import write_json

        return write_json(self, path)

    def write_html(self, path: str | Path) -> Path:
        from .report.html import write_html

        return write_html(self, path)

    def write_junit(self, path: str | Path) -> Path:
        from .report.junit import write_junit

        return write_junit(self, path)


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def trace_pair(pair: Pair, input_ids: torch.Tensor) -> tuple[Trace, Trace]:
    """Run the reference, then ours, on ``input_ids`` and return their traces (reference, ours)."""
    hf_capture.install(pair.reference)
    captured = [n.name for n in pair.nodes if n.name.rsplit(".", 1)[-1] in hf_capture.SUFFIXES]
    ref_points = [(n.name, n.reference_path) for n in pair.nodes if n.name not in captured]
    our_points = [(n.name, n.ours) for n in pair.nodes]
    transforms = {n.name: n.transform for n in pair.nodes if n.transform is not None}
    with torch.inference_mode():
        with recording(pair.reference, ref_points, captured=captured) as ref_trace:
            pair.reference(input_ids=input_ids, use_cache=False)
        with recording(pair.ours, our_points, transforms=transforms) as our_trace:
            pair.ours(input_ids)
    return ref_trace, our_trace


def check(
    pair: Pair,
    input_ids: torch.Tensor | None = None,
    seq_len: int | None = None,
    batch_size: int = 1,
    mode: str = "chained",
    atol: float | None = None,
    rtol: float | None = None,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
) -> CheckResult:
    """Compare ``pair.ours`` with ``pair.reference`` node by node.

    ``input_ids``: ``(batch, seq)`` int64; by default seeded random tokens of ``seq_len``
    (``pair.default_seq_len``, which passes the sliding window of small configs) and
    ``batch_size``. ``atol``/``rtol`` override the dtype defaults
    (:data:`parity.compare.DEFAULT_TOLERANCES`); ``tolerances`` maps node-name glob patterns to
    ``(atol, rtol)`` and wins over both.

    Raises:
        ParityError: unsupported ``mode``, or ``input_ids`` that are not 2-D or out of the vocabulary.
    """
    if mode != "chained":
        raise ParityError(f"mode {mode!r} is not available yet; use 'chained'")
    if input_ids is None:
        if seq_len is not None and seq_len < 1 or batch_size < 1:
            raise ParityError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        input_ids = pair.make_inputs(seq_len, batch_size)
    if input_ids.dim() != 2:
        raise ParityError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= pair.vocab_size:
        raise ParityError(f"input_ids must lie in [0, {pair.vocab_size}), got [{int(input_ids.min())}, {int(input_ids.max())}]")
    notes = list(pair.notes)
    window = pair.cfg.get("sliding_window")
    if window and "sliding_attention" in pair.cfg.get("layer_types", []) and input_ids.shape[1] <= window:
        notes.append(
            f"seq_len {input_ids.shape[1]} does not exceed the sliding window ({window}): sliding layers "
            f"behave like full attention here; pass --seq-len {window + 1} or more to exercise the window"
        )
    start = time.perf_counter()
    ref_trace, our_trace = trace_pair(pair, input_ids)
    nodes = compare_traces(our_trace, ref_trace, pair.nodes, pair.dtype, atol, rtol, tolerances)
    bad = first_mismatch(nodes)
    profile = None
    if bad is not None:
        bad.hint = diagnose(bad, our_trace, ref_trace, pair)
        ours_t, ref_t = our_trace.tensors.get(bad.name), ref_trace.tensors.get(bad.name)
        if ours_t is not None and ref_t is not None and ours_t.shape == ref_t.shape:
            profile = {"node": bad.name, **error_profile(ours_t, ref_t, bad.kind, pair.cfg.get("head_dim"))}
    output = next((n.name for n in reversed(nodes) if n.name in ("logits", "lm_head") and n.status != "shape"), None)
    logits = None
    if output is not None and output in our_trace.tensors and output in ref_trace.tensors:
        logits = {"node": output, **logits_effect(our_trace.tensors[output], ref_trace.tensors[output])}
    meta = {
        "family": pair.family,
        "config": pair.config_name,
        "checkpoint": pair.checkpoint,
        "checkpoint_sha256": pair.checkpoint_hash,
        "dtype": str(pair.dtype).replace("torch.", ""),
        "batch_size": int(input_ids.shape[0]),
        "seq_len": int(input_ids.shape[1]),
        "seed": pair.seed,
        "mode": mode,
        "atol": atol,
        "rtol": rtol,
        "tolerances": dict(tolerances or {}),
        "versions": _versions(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - start, 3),
        "cfg": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in pair.cfg.items()},
    }
    return CheckResult(nodes=nodes, meta=meta, notes=notes, profile=profile, logits=logits)
