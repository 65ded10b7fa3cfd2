"""``parity.check``: trace both models of a Pair on the same input and compare every node."""

from __future__ import annotations

import datetime as _dt
import fnmatch
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hf_capture
from .analysis import error_profile, logits_effect
from .compare import NodeResult, compare_traces, first_mismatch
from .coverage import Coverage, loader_coverage
from .diagnose import diagnose
from .errors import ParityError
from .pair import Pair
from .resources import require, trace_bytes
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
    #: what the loader did with the checkpoint tensors (see parity.coverage); gaps fail the run
    coverage: Coverage | None = None

    @property
    def first_mismatch(self) -> NodeResult | None:
        return first_mismatch(self.nodes)

    @property
    def passed(self) -> bool:
        """Every node agrees and the loader covered the checkpoint exactly."""
        return self.first_mismatch is None and (self.coverage is None or self.coverage.ok)

    @property
    def first_isolated_mismatch(self) -> NodeResult | None:
        """The first failing node in isolated mode (the likely fault), when isolated mode ran."""
        return first_mismatch(self.isolated) if self.isolated is not None else None

    def verdict(self) -> str:
        """One line: parity holds, or the first node that fails with its metrics."""
        n = len(self.nodes)
        bad = self.first_mismatch
        if bad is None and self.coverage is not None and not self.coverage.ok:
            return f"FAIL: all {n} nodes agree, but loader coverage has gaps: {'; '.join(self.coverage.gaps)}"
        if bad is None:
            return f"PASS: all {n} nodes agree within tolerance"
        failing = sum(not r.passed for r in self.nodes)
        return f"FAIL: first mismatch at node {bad.index} of {n}, {bad.line()} [{failing} nodes fail]"

    def to_frame(self):
        """pandas DataFrame, one row per node (columns documented in parity.report.tables)."""
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


MODES = ("chained", "isolated", "both")
#: node kinds whose module input is kept for diagnosis (norm placement, LayerNorm vs RMSNorm)
_DIAGNOSIS_INPUT_KINDS = ("q_proj", "gate_proj", "norm", "layernorm")
#: calibrated atol = SAFETY_FACTOR x |reference - reference in float64|, at least the floor
SAFETY_FACTOR = 10.0
CALIBRATION_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def _keep_inputs(pair: Pair) -> frozenset[str]:
    return frozenset(n.name for n in pair.nodes if any(k in n.kind for k in _DIAGNOSIS_INPUT_KINDS))


def trace_reference(pair: Pair, input_ids: torch.Tensor, model=None, attention_mask: torch.Tensor | None = None) -> Trace:
    """Run the reference (or ``model``, a copy of it) on ``input_ids``; attention internals
    come through :mod:`parity.hf_capture`."""
    model = pair.reference if model is None else model
    hf_capture.install(model)
    captured = [n.name for n in pair.nodes if n.name.rsplit(".", 1)[-1] in hf_capture.SUFFIXES]
    points = [(n.name, n.reference_path) for n in pair.nodes if n.name not in captured]
    with torch.inference_mode(), recording(model, points, captured=captured, keep_inputs=_keep_inputs(pair)) as trace:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return trace


def trace_ours(
    pair: Pair, input_ids: torch.Tensor, substitute: Trace | None = None, attention_mask: torch.Tensor | None = None
) -> Trace:
    """Run our model; with ``substitute`` (isolated mode) every node continues from the reference's tensor."""
    points = [(n.name, n.ours) for n in pair.nodes]
    transforms = {n.name: n.transform for n in pair.nodes if n.transform is not None}
    inverses = {n.name: n.inverse for n in pair.nodes if n.inverse is not None}
    with torch.inference_mode(), recording(
        pair.ours, points, transforms=transforms, substitute=substitute, inverses=inverses,
        keep_inputs=_keep_inputs(pair),
    ) as trace:
        if attention_mask is None:
            pair.ours(input_ids)
        else:
            pair.ours(input_ids, attention_mask=attention_mask)
    return trace


def trace_pair(pair: Pair, input_ids: torch.Tensor) -> tuple[Trace, Trace]:
    """Run the reference, then ours, on ``input_ids`` and return their traces (reference, ours)."""
    ref_trace = trace_reference(pair, input_ids)
    return ref_trace, trace_ours(pair, input_ids)


def calibrate_tolerances(
    pair: Pair, input_ids: torch.Tensor, ref_trace: Trace, safety: float = SAFETY_FACTOR, attention_mask=None
) -> dict:
    """Per-node ``(atol, 0.0)`` from the reference's own error against itself in float64.

    A float64 copy of the reference (same weights) runs on the same inputs; each node's atol is
    ``safety`` times the reference's max |error|, floored (:data:`CALIBRATION_FLOOR`) so that an
    exactly representable node does not demand bit-exactness. Costs a float64 copy of the weights.
    """
    import copy

    ref64 = copy.deepcopy(pair.reference).to(torch.float64)
    try:
        trace64 = trace_reference(pair, input_ids, model=ref64, attention_mask=attention_mask)
    finally:
        del ref64
    floor = CALIBRATION_FLOOR.get(pair.dtype, 1e-6)
    tolerances = {}
    for name, tensor in ref_trace.tensors.items():
        exact = trace64.tensors.get(name)
        if exact is None or exact.shape != tensor.shape:
            continue
        err = (tensor.double() - exact).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        tolerances[name] = (max(safety * float(err.max()) if err.numel() else 0.0, floor), 0.0)
    return tolerances


def config_diff(pair: Pair) -> list[dict]:
    """Hyperparameters where the cfg our model runs with differs from the reference's config.

    Our side: ``pair.ours.cfg`` (the dict our model was built with, which a user may have edited);
    reference side: ``pair.reference_cfg``, the reference config read back through the family's
    mapping. Returns ``[{"key", "ours", "reference"}]``; keys missing on one side are listed too.
    """
    ours = getattr(pair.ours, "cfg", None) or pair.cfg
    ref = pair.reference_cfg
    if ref is None:
        return []
    diffs = []
    for key in sorted(set(ours) | set(ref)):
        if key == "dtype":
            continue
        a, b = ours.get(key, "<absent>"), ref.get(key, "<absent>")
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            same = list(a) == list(b)
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            same = a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))
        else:
            same = a == b
        if not same:
            diffs.append({"key": key, "ours": a, "reference": b})
    return diffs


def _refuse_changed_weights(pair: Pair, when: str) -> None:
    changed = pair.changed_weights()
    if changed:
        raise ParityError(
            f"{len(changed)} weight tensor(s) changed in place {when} ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}): ours and the reference share that storage, so both changed; "
            "replace a Parameter (module.weight = nn.Parameter(...)) instead of editing it in place"
        )


def check(
    pair: Pair,
    input_ids: torch.Tensor | None = None,
    seq_len: int | None = None,
    batch_size: int = 1,
    mode: str = "chained",
    atol: float | None = None,
    rtol: float | None = None,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    calibrate: bool = False,
    attention_mask: torch.Tensor | None = None,
    left_pad: int = 0,
) -> CheckResult:
    """Compare ``pair.ours`` with ``pair.reference`` node by node.

    ``input_ids``: ``(batch, seq)`` int64; by default seeded random tokens of ``seq_len``
    (``pair.default_seq_len``, which passes the sliding window of small configs) and
    ``batch_size``. ``mode``: ``chained`` (both models run on their own; errors compound),
    ``isolated`` (every node of ours continues from the reference's tensors, so each node shows
    only its own error; the first failing node is the fault) or ``both`` (verdict from chained,
    ``result.isolated`` filled too). ``atol``/``rtol`` override the dtype defaults
    (:data:`parity.compare.DEFAULT_TOLERANCES`); ``calibrate`` derives each node's atol from the
    reference's own float32-vs-float64 error (:func:`calibrate_tolerances`); ``tolerances`` maps
    node-name glob patterns to ``(atol, rtol)`` and wins over all of them.

    ``attention_mask``: ``(batch, seq)``, 1 for real tokens and 0 for padding, given to both models;
    ``left_pad`` builds one instead: every batch row after the first starts with that many padding
    tokens (the rows whose queries see no real key are where masking bugs turn into NaN).

    Raises:
        ParityError: unknown ``mode``; ``input_ids`` not 2-D or out of the vocabulary; a mask of
            another shape; ``left_pad`` without a second row or not shorter than the sequence;
            invalid tolerances; weights shared by both models edited in place (before or during the
            check); a run that would not fit in memory.
    """
    if mode not in MODES:
        raise ParityError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    for label, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ParityError(f"{label} must be a finite number >= 0, got {value!r}")
    if calibrate and (atol is not None or rtol is not None):
        raise ParityError("calibrate sets each node's atol (rtol 0); drop atol/rtol, or override nodes with tolerances=")
    for pattern, tol in (tolerances or {}).items():
        if not (isinstance(tol, (tuple, list)) and len(tol) == 2
                and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in tol)):
            raise ParityError(f"tolerances[{pattern!r}] must be (atol, rtol), finite and >= 0, got {tol!r}")
        if not any(fnmatch.fnmatchcase(n.name, pattern) for n in pair.nodes):
            raise ParityError(f"tolerance pattern {pattern!r} matches no node of this pair")
    if input_ids is None:
        if (seq_len is not None and seq_len < 1) or batch_size < 1:
            raise ParityError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        input_ids = pair.make_inputs(seq_len, batch_size)
    if input_ids.dim() != 2:
        raise ParityError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= pair.vocab_size:
        raise ParityError(f"input_ids must lie in [0, {pair.vocab_size}), got [{int(input_ids.min())}, {int(input_ids.max())}]")
    if left_pad:
        if attention_mask is not None or input_ids.shape[0] < 2 or not 0 < left_pad < input_ids.shape[1]:
            raise ParityError(
                f"left_pad {left_pad} needs batch_size >= 2, 0 < left_pad < seq_len ({input_ids.shape[1]}) and no attention_mask"
            )
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1:, :left_pad] = 0
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ParityError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    notes = list(pair.notes)
    window = pair.cfg.get("sliding_window")
    if window and "sliding_attention" in pair.cfg.get("layer_types", []) and input_ids.shape[1] <= window:
        notes.append(
            f"seq_len {input_ids.shape[1]} does not exceed the sliding window ({window}): sliding layers "
            f"behave like full attention here; pass --seq-len {window + 1} or more to exercise the window"
        )
    require(
        trace_bytes(pair.cfg, input_ids.shape[0], input_ids.shape[1], torch.finfo(pair.dtype).bits // 8)
        * (2 if mode == "both" else 1),
        f"tracing {input_ids.shape[0]} x {input_ids.shape[1]} tokens",
        "use a shorter --seq-len, a smaller --batch or fewer layers",
    )
    diffs = config_diff(pair)
    notes += [f"config differs: {d['key']} is {d['ours']!r} in ours, {d['reference']!r} in the reference" for d in diffs]
    _refuse_changed_weights(pair, "before the check")
    start = time.perf_counter()
    ref_trace = trace_reference(pair, input_ids, attention_mask=attention_mask)
    calibrated = calibrate_tolerances(pair, input_ids, ref_trace, attention_mask=attention_mask) if calibrate else None

    def run(substitute: Trace | None) -> tuple[list[NodeResult], Trace]:
        ours = trace_ours(pair, input_ids, substitute, attention_mask)
        results = compare_traces(ours, ref_trace, pair.nodes, pair.dtype, atol, rtol, tolerances, calibrated)
        bad = first_mismatch(results)
        if bad is not None:
            bad.hint = diagnose(bad, ours, ref_trace, pair)
        return results, ours

    isolated = run(ref_trace)[0] if mode in ("isolated", "both") else None
    if mode == "isolated":
        nodes, our_trace = isolated, None
    else:
        nodes, our_trace = run(None)
    _refuse_changed_weights(pair, "during the forward passes")
    bad = first_mismatch(nodes)
    profile = logits = None
    if our_trace is not None:
        if bad is not None:
            ours_t, ref_t = our_trace.tensors.get(bad.name), ref_trace.tensors.get(bad.name)
            if ours_t is not None and ref_t is not None and ours_t.shape == ref_t.shape:
                profile = {"node": bad.name, **error_profile(ours_t, ref_t, bad.kind, pair.cfg.get("head_dim"))}
        output = next((n.name for n in reversed(nodes) if n.name in ("logits", "lm_head")), None)
        if output is not None and output in our_trace.tensors and output in ref_trace.tensors:
            if our_trace.tensors[output].shape == ref_trace.tensors[output].shape:
                logits = {"node": output, **logits_effect(our_trace.tensors[output], ref_trace.tensors[output])}
    meta = {
        "family": pair.family,
        "config": pair.config_name,
        "checkpoint": pair.checkpoint,
        "checkpoint_sha256": pair.checkpoint_hash,
        "dtype": str(pair.dtype).replace("torch.", ""),
        "batch_size": int(input_ids.shape[0]),
        "seq_len": int(input_ids.shape[1]),
        "padding": None if attention_mask is None else [int(n) for n in (attention_mask == 0).sum(1)],
        "seed": pair.seed,
        "mode": mode,
        "atol": atol,
        "rtol": rtol,
        "calibrated": bool(calibrate),
        "safety_factor": SAFETY_FACTOR if calibrate else None,
        "tolerances": dict(tolerances or {}),
        "config_diff": diffs,
        "versions": _versions(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - start, 3),
        "cfg": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in pair.cfg.items()},
    }
    coverage = loader_coverage(pair.ours, pair.state_dict, pair.tied_keys, pair.conversions) if pair.state_dict else None
    return CheckResult(
        nodes=nodes, meta=meta, notes=notes, profile=profile, logits=logits, isolated=isolated, coverage=coverage
    )
