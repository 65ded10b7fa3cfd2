"""``parity.check``: trace both models of a Pair on the same input and compare every node.

The run is a few small stages, each a function of what the previous ones produced:
:func:`plan` (validate the arguments, build the inputs) -> :func:`trace_reference` ->
:func:`calibrate_tolerances` (optional) -> :func:`trace_ours` (chained and/or isolated) ->
:func:`compare_run` (compare, diagnose the first failure) -> :func:`analyse` (where the error sits,
what it does to the logits) -> an immutable :class:`~parity.result.CheckResult`.
"""

from __future__ import annotations

import copy
import datetime as _dt
import fnmatch
import inspect
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from . import hf_capture, hf_kernels
from .analysis import error_profile, logits_effect
from .compare import CHUNK, NodeResult, NodeStream, Tolerances, chunks, compare_traces, first_mismatch
from .coverage import loader_coverage
from .diagnose import diagnose
from .errors import ParityError
from .origin import find_origin
from .pair import Pair
from .resources import BUDGET as RESOURCE_BUDGET
from .resources import GIB, TRACE_MEMORY, available_bytes, check_footprint, require, require_disk
from .result import CheckResult
from .trace import Trace, recording

MODES = ("chained", "isolated", "both")
#: node kinds whose module input (and weight) is kept for diagnosis (norm placement, norm kind, transposes)
_DIAGNOSIS_INPUT_KINDS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "norm", "layernorm",
    "c_attn", "c_proj", "c_fc", "ln_",  # GPT-2's Conv1D projections and LayerNorms
)
#: node kinds of ours the diagnosis of a later node of the same attention reads (softmax temperature
#: needs q and k to agree); everything else of ours is dropped once compared
_DIAGNOSIS_CONTEXT_KINDS = ("q_rot", "k_rot")
#: calibrated atol = SAFETY_FACTOR x |reference - reference in float64|, at least the floor
SAFETY_FACTOR = 10.0
CALIBRATION_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


@dataclass(frozen=True)
class Run:
    """A validated request: the inputs both models get and how nodes are judged."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    #: ``(batch, seq)`` token positions: 0..S-1, or counted over real tokens when padded (as generate does)
    position_ids: torch.Tensor
    mode: str
    tolerances: Tolerances
    calibrate: bool
    notes: tuple[str, ...]
    #: bytes of each trace kept in memory before it spills to disk (None: never spill)
    trace_memory: int | None = TRACE_MEMORY


def _check_tolerance_args(pair: Pair, atol, rtol, tolerances, calibrate: bool, exact: bool) -> None:
    for label, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ParityError(f"{label} must be a finite number >= 0, got {value!r}")
    if calibrate and (atol is not None or rtol is not None):
        raise ParityError("calibrate sets each node's atol (rtol 0); drop atol/rtol, or override nodes with tolerances=")
    if exact and (atol is not None or rtol is not None or calibrate):
        raise ParityError("exact sets atol = rtol = 0 on every node; drop atol/rtol/calibrate")
    for pattern, tol in (tolerances or {}).items():
        if not (isinstance(tol, (tuple, list)) and len(tol) == 2
                and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in tol)):
            raise ParityError(f"tolerances[{pattern!r}] must be (atol, rtol), finite and >= 0, got {tol!r}")
        if not any(fnmatch.fnmatchcase(n.name, pattern) for n in pair.nodes):
            raise ParityError(f"tolerance pattern {pattern!r} matches no node of this pair")


def _inputs(pair: Pair, input_ids, seq_len, batch_size, attention_mask, left_pad):
    if input_ids is None:
        if (seq_len is not None and seq_len < 1) or batch_size < 1:
            raise ParityError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        input_ids = pair.make_inputs(seq_len, batch_size)
    if input_ids.dim() != 2:
        raise ParityError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= pair.vocab_size:
        raise ParityError(f"input_ids must lie in [0, {pair.vocab_size}), got [{int(input_ids.min())}, {int(input_ids.max())}]")
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
        attention_mask[1:, :left_pad] = 0
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ParityError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    return input_ids, attention_mask


def generation_positions(attention_mask: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor:
    """``(batch, seq)`` positions as ``generate`` derives them: ``0 .. seq - 1`` without padding; with
    an attention mask, real tokens counted from 0 in each row (padding gets 1, as in Transformers'
    ``prepare_inputs_for_generation``)."""
    if attention_mask is None:
        return torch.arange(seq).expand(batch, seq)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _window_notes(pair: Pair, seq_len: int) -> list[str]:
    facts = pair.facts
    windows = sorted({w for w in facts.windows if w})
    if windows and seq_len <= windows[-1]:
        return [
            f"seq_len {seq_len} does not exceed the sliding window ({windows[-1]}): sliding layers "
            f"behave like full attention here; pass --seq-len {windows[-1] + 1} or more to exercise the window"
        ]
    return []


def _chunk_notes(pair: Pair, seq_len: int) -> list[str]:
    chunk = pair.facts.chunk_size
    if chunk and seq_len <= chunk:
        return [
            f"seq_len {seq_len} does not exceed the linear-attention chunk ({chunk} tokens): the state carried "
            f"from one chunk to the next is not exercised; pass --seq-len {chunk + 1} or more"
        ]
    return []


def _decode_chunk_notes(pair: Pair, run_notes, decode_plan) -> list[str]:
    """A decode run's notes: the chunk note speaks of its longest call (each call continues the state
    from the cache; only a call longer than a chunk carries it from chunk to chunk inside the rule)."""
    calls = decode_plan.schedule()
    longest, chunk = max(b - a for a, b in calls), pair.facts.chunk_size
    if len(calls) == 1 or not chunk:
        return list(run_notes)
    notes = [n for n in run_notes if n not in _chunk_notes(pair, decode_plan.prefill)]
    if longest <= chunk:
        notes.append(
            f"no call of decode plan {decode_plan.describe()} exceeds the linear-attention chunk ({chunk} tokens): the "
            f"state is carried from call to call through the cache, never from one chunk to the next inside a call; a "
            f"prefill chunk of {chunk + 1} or more tokens exercises that too"
        )
    return notes


def _position_notes(pair: Pair, seq_len: int) -> list[str]:
    limit = pair.facts.max_position_embeddings
    if limit and seq_len > limit:
        return [
            f"seq_len {seq_len} exceeds max_position_embeddings ({limit}): positions {limit} and later lie past "
            f"the context the config declares, where the reference makes no promise; pass --seq-len {limit} or less "
            "unless that is what you mean to test"
        ]
    return []


def plan(
    pair: Pair,
    input_ids=None,
    seq_len=None,
    batch_size=1,
    mode="chained",
    atol=None,
    rtol=None,
    tolerances=None,
    calibrate=False,
    attention_mask=None,
    left_pad=0,
    exact=False,
    trace_memory=TRACE_MEMORY,
) -> Run:
    """Validate a check's arguments against the pair and build its inputs. Raises ParityError."""
    if mode not in MODES:
        raise ParityError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    _check_tolerance_args(pair, atol, rtol, tolerances, calibrate, exact)
    if trace_memory is not None and (isinstance(trace_memory, bool) or not isinstance(trace_memory, int) or trace_memory < 0):
        raise ParityError(f"trace_memory must be a number of bytes >= 0 (or None: never spill), got {trace_memory!r}")
    input_ids, attention_mask = _inputs(pair, input_ids, seq_len, batch_size, attention_mask, left_pad)
    batch, seq = input_ids.shape
    _require_room(pair, batch, seq, trace_memory, calibrate)
    return Run(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=generation_positions(attention_mask, batch, seq),
        mode=mode,
        tolerances=Tolerances(pair.dtype, atol, rtol, dict(tolerances or {}), exact=exact),
        calibrate=calibrate,
        notes=tuple(pair.notes) + tuple(_window_notes(pair, seq)) + tuple(_chunk_notes(pair, seq)) + tuple(_position_notes(pair, seq)),
        trace_memory=trace_memory,
    )


def _weight_bytes(pair: Pair) -> int:
    seen, total = set(), 0
    for tensor in pair.state_dict.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def _require_room(pair: Pair, batch: int, seq: int, trace_memory: int | None, calibrate: bool) -> None:
    """Refuse a check whose traces and forward passes would not fit (see :mod:`parity.resources`)."""
    size = torch.finfo(pair.dtype).bits // 8
    need = check_footprint(pair.facts, batch, seq, size, trace_memory)
    memory = need.memory
    if calibrate:  # a float64 copy of the reference runs too
        memory += _weight_bytes(pair) * 8 // size + check_footprint(pair.facts, batch, seq, 8, trace_memory).memory
    advice = "use a shorter --seq-len, a smaller --batch or fewer layers"
    require(memory, f"tracing {batch} x {seq} tokens" + (" (and a float64 copy to calibrate)" if calibrate else ""),
            advice + (" (or a smaller --trace-memory)" if trace_memory and trace_memory > GIB else ""))
    require_disk(need.disk, f"spilling the traces of {batch} x {seq} tokens past --trace-memory",
                 f"{advice}, or point TMPDIR to a larger disk")


def _keep_inputs(pair: Pair) -> frozenset[str]:
    return frozenset(n.name for n in pair.nodes if any(k in n.kind for k in _DIAGNOSIS_INPUT_KINDS) and "@" not in n.kind)


def _device_of(model) -> torch.device:
    """Where a model takes its inputs: the device of its first parameter (the embedding, also under a
    device map, whose hooks move activations on from there)."""
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def _on(device: torch.device, tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.device == device else tensor.to(device)


def trace_reference(pair: Pair, run: Run, model=None, sink=None, into: Trace | None = None) -> Trace:
    """Run the reference (or ``model``, a copy of it) on the run's inputs; attention internals
    come through :mod:`parity.hf_capture`. The trace spills to disk past ``run.trace_memory``.
    ``sink`` (see :class:`~parity.trace.Trace`) sees each node instead of the trace storing it;
    ``into``: the Trace to fill instead (see :func:`parity.trace.recording`). Raises ParityError
    when the reference itself cannot run the config (a config Transformers accepts but its forward
    rejects is bad input, not a bug)."""
    model = pair.reference if model is None else model
    hf_capture.install(model)
    captured = [n.name for n in pair.nodes if hf_capture.is_captured(n.name)]
    points = [(n.name, n.reference_path) for n in pair.nodes if n.name not in captured]
    views = {n.name: n.reference_transform for n in pair.nodes if n.reference_transform is not None}
    kernels = any(hf_kernels.is_kernel_node(name) for name in captured)  # named after the module that calls them
    trace = Trace.spilling(run.trace_memory, sink=sink) if into is None else into
    keep = _keep_inputs(pair) if sink is None else frozenset()
    device = _device_of(model)
    # no_grad, not inference_mode: tensors keep their version counters (an unchanged tensor recorded
    # twice is stored once, an in-place edit is seen)
    with torch.no_grad(), recording(
        model, points, transforms=views, captured=captured, keep_inputs=keep, module_stack=kernels, into=trace,
    ):
        try:
            model(input_ids=_on(device, run.input_ids), attention_mask=_on(device, run.attention_mask),
                  position_ids=_on(device, run.position_ids), use_cache=False)
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
            trace.close()
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ParityError(f"the reference ({type(model).__name__}) cannot run this config: {reason[:300]}") from None
    return trace


def _accepts(model, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _untapped(pair: Pair) -> frozenset[str]:
    return frozenset(n.name for n in pair.nodes if n.ours.startswith(("tap:", "unaligned:")))


def trace_ours(pair: Pair, run: Run, substitute: Trace | None = None, *, reference: Trace | None = None,
               tolerances: Tolerances | None = None) -> Trace:
    """Run our model; with ``substitute`` (isolated mode) every node continues from the reference's tensor.

    With ``reference`` (the reference's trace), every node is compared as ours produces it
    (:class:`~parity.compare.NodeStream`, on ``tolerances``, by default the run's) and dropped: the
    trace returned holds the results, the first failure with what its diagnosis reads, and the
    logits effect (``watched``). Without it, every tensor of ours is kept.
    """
    tapped = {n.ours: n.name for n in pair.nodes if n.ours.startswith("tap:")}
    points = [(n.name, n.ours) for n in pair.nodes if not n.ours.startswith(("tap:", "unaligned:"))]
    transforms = {n.name: n.transform for n in pair.nodes if n.transform is not None}
    inverses = {n.name: n.inverse for n in pair.nodes if n.inverse is not None}
    taps = {path[len("tap:"):]: name for path, name in tapped.items()}
    device = _device_of(pair.ours)
    kwargs = {}
    if run.attention_mask is not None:
        kwargs["attention_mask"] = _on(device, run.attention_mask)
        if _accepts(pair.ours, "position_ids"):
            kwargs["position_ids"] = _on(device, run.position_ids)
    trace = Trace.spilling(run.trace_memory)
    stream = None
    if reference is not None:
        output = pair.output_node
        stream = NodeStream(pair.nodes, reference, tolerances or run.tolerances, _untapped(pair), _DIAGNOSIS_CONTEXT_KINDS,
                            watch={output: logits_effect} if output is not None else None)
        stream.attach(trace)
    with torch.no_grad(), recording(
        pair.ours, points, transforms=transforms, substitute=substitute, inverses=inverses,
        keep_inputs=_keep_inputs(pair), taps=taps, into=trace,
    ):
        pair.ours(_on(device, run.input_ids), **kwargs)
    if stream is not None:
        stream.finish()
    return trace


def trace_pair(pair: Pair, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[Trace, Trace]:
    """Run the reference, then ours, on ``input_ids`` and return their traces (reference, ours)."""
    run = plan(pair, input_ids=input_ids, attention_mask=attention_mask)
    return trace_reference(pair, run), trace_ours(pair, run)


def reference_noise(pair: Pair, run: Run, ref_trace: Trace) -> dict[str, float]:
    """Per node, the reference's own max |error| against a float64 copy of itself (same weights, same
    inputs): the rounding noise of the run's dtype. Each float64 node is compared as it is produced
    and dropped (nothing of the float64 run is kept). Costs a float64 copy of the weights (refused up
    front when it would not fit)."""
    n_params = sum(p.numel() for p in pair.reference.parameters())
    require(8 * n_params, "a float64 copy of the reference (calibration, origin)", "use mode chained without calibrate")
    noise = {}

    def measure(name: str, exact: torch.Tensor) -> bool:
        store = ref_trace.tensors
        tensor = store.lazy(name) if hasattr(store, "lazy") else store.get(name)
        if tensor is not None and tensor.shape == exact.shape:
            noise[name] = _max_error(tensor, exact.to("cpu"))
        return True

    ref64 = copy.deepcopy(pair.reference).to(torch.float64)
    try:
        trace_reference(pair, run, model=ref64, sink=measure).close()
    finally:
        del ref64
    return {name: noise[name] for name in ref_trace.tensors if name in noise}


def calibrate_tolerances(pair: Pair, run: Run, ref_trace: Trace, safety: float = SAFETY_FACTOR,
                         noise: dict[str, float] | None = None) -> dict:
    """Per-node ``(atol, 0.0)``: ``safety`` times the reference's own error against itself in float64
    (:func:`reference_noise`), floored (:data:`CALIBRATION_FLOOR`) so that an exactly representable
    node does not demand bit-exactness."""
    noise = reference_noise(pair, run, ref_trace) if noise is None else noise
    floor = CALIBRATION_FLOOR.get(pair.dtype, 1e-6)
    return {name: (max(safety * err, floor), 0.0) for name, err in noise.items()}


def _max_error(tensor, exact: torch.Tensor) -> float:
    """max |tensor - exact| in float64 over finite differences (0 for an empty tensor), a chunk at a
    time (``tensor`` may be a spilled one)."""
    worst = 0.0
    for a, b in zip(chunks(tensor, CHUNK), chunks(exact, CHUNK)):
        err = (a.double() - b.double()).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        worst = max(worst, float(err.max()))
    return worst


def compare_run(pair: Pair, run: Run, ours: Trace, ref: Trace, tolerances: Tolerances) -> list[NodeResult]:
    """Every node compared; the first judged failure carries its hint (unless it is too large to
    diagnose in the memory available: :func:`undiagnosed`)."""
    results = compare_traces(ours, ref, pair.nodes, tolerances, _untapped(pair))
    bad = first_mismatch(results)
    if bad is not None and undiagnosed(bad) is None:
        spec = next((n for n in pair.nodes if n.name == bad.name), None)
        results[bad.index] = replace(bad, hint=diagnose(bad, ours, ref, pair.facts, run.position_ids, run.attention_mask, spec))
    return results


#: float64 copies of a node the hint detectors may hold at once
_DIAGNOSIS_COPIES = 10


def undiagnosed(bad: NodeResult) -> str | None:
    """Why the failing node ``bad`` gets no diagnosis (a note), or None: its detectors work on float64
    copies of it, and a node of GiBs (the probabilities of a 4096-token window) would not fit."""
    shape = bad.shape_ref or bad.shape_ours
    available = available_bytes()
    if not shape or available is None:
        return None
    need = math.prod(shape) * 8 * _DIAGNOSIS_COPIES
    if need <= RESOURCE_BUDGET * available:
        return None
    return (f"{bad.name} was not diagnosed (no hint): its detectors would need about {need / GIB:.1f} GiB and "
            f"{available / GIB:.1f} GiB are available; its metrics, error profile and logits effect stand")


def _undiagnosed_note(results: list[NodeResult]) -> str | None:
    bad = first_mismatch(results)
    if bad is None or bad.hint is not None or bad.status in ("missing", "shape"):
        return None
    return undiagnosed(bad)


def config_diff(pair: Pair) -> list[dict]:
    """Hyperparameters where the cfg our model runs with differs from the reference's config.

    Our side: ``pair.ours.cfg`` (the dict our model was built with, which a user may have edited);
    reference side: ``pair.reference_cfg``, the reference config read back through the family's
    mapping. Compared key by key, whatever the keys are. Returns ``[{"key", "ours", "reference"}]``;
    keys missing on one side are listed too.
    """
    ours = getattr(pair.ours, "cfg", None) or pair.cfg
    ref = pair.reference_cfg
    if not isinstance(ours, Mapping) or ref is None:
        return []
    diffs = []
    for key in sorted(set(ours) | set(ref)):
        a, b = ours.get(key, "<absent>"), ref.get(key, "<absent>")
        if isinstance(a, torch.dtype) or isinstance(b, torch.dtype):
            continue
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


def analyse(pair: Pair, nodes: list[NodeResult], ours: Trace | None, ref: Trace) -> tuple[dict | None, dict | None]:
    """Error profile of the first failing node and the logits effect at the output node."""
    if ours is None:
        return None, None
    profile = logits = None
    bad = first_mismatch(nodes)
    if bad is not None:
        ours_t, ref_t = ours.tensors.get(bad.name), ref.tensors.get(bad.name)
        if ours_t is not None and ref_t is not None and ours_t.shape == ref_t.shape:
            layer = pair.facts.layer(bad.layer)
            head_dim = layer.head_dim if layer is not None else pair.facts.head_dim
            profile = {"node": bad.name, **error_profile(ours_t, ref_t, bad.kind, head_dim)}
    output = pair.output_node
    if output is not None and output in ours.watched:  # computed while ours ran (a NodeStream)
        logits = {"node": output, **ours.watched[output]}
    elif (output is not None and output in ours.tensors and output in ref.tensors
          and ours.tensors[output].shape == ref.tensors[output].shape):
            logits = {"node": output, **logits_effect(ours.tensors[output], ref.tensors[output])}
    return profile, logits


def _meta(pair: Pair, run: Run, diffs: list[dict], seconds: float, atol, rtol, tolerances, calibrate) -> dict:
    return {
        "family": pair.family,
        "config": pair.config_name,
        "checkpoint": pair.checkpoint,
        "checkpoint_sha256": pair.checkpoint_hash,
        "dtype": str(pair.dtype).replace("torch.", ""),
        "batch_size": int(run.input_ids.shape[0]),
        "seq_len": int(run.input_ids.shape[1]),
        "padding": None if run.attention_mask is None else [int(n) for n in (run.attention_mask == 0).sum(1)],
        "seed": pair.seed,
        "mode": run.mode,
        "atol": atol,
        "rtol": rtol,
        "exact": run.tolerances.exact,
        "calibrated": bool(calibrate),
        "safety_factor": SAFETY_FACTOR if calibrate else None,
        "tolerances": dict(tolerances or {}),
        "config_diff": diffs,
        "versions": versions(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "model_type": pair.facts.model_type,
        "device": pair.device,
        "trace_memory": run.trace_memory,
        "ours_class": f"{type(pair.ours).__module__}.{type(pair.ours).__qualname__}",
        # the Transformers class compared against (a multimodal checkpoint: ...ForConditionalGeneration)
        "reference_class": f"{type(pair.reference).__module__}.{type(pair.reference).__qualname__}",
        "aligned": bool(pair.alignment),
        "probe": pair.probe + (f"; inputs: seeded random token ids, {int(run.input_ids.shape[0])} x {int(run.input_ids.shape[1])}"
                               + (", left-padded, positions from the mask" if run.attention_mask is not None else "")),
        "cfg": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in pair.cfg.items()},
    }


def _check_decode(pair, decode, input_ids, seq_len, batch_size, mode, atol, rtol, tolerances, calibrate,
                  attention_mask, left_pad, exact) -> CheckResult:
    """The KV-cache run of :func:`check` (see :mod:`parity.decode`)."""
    from .decode import DecodePlan, run_decode

    plan_ = DecodePlan.parse(decode) if isinstance(decode, str) else decode
    if not isinstance(plan_, DecodePlan):
        raise ParityError(f"decode must be a DecodePlan or PREFILL[:CHUNK]xSTEPS, got {type(decode).__name__}")
    if mode != "chained" or calibrate:
        raise ParityError("a decode check runs chained, with fixed tolerances (no isolated mode, no calibration)")
    if seq_len is not None and seq_len != plan_.prefill:
        raise ParityError(f"seq_len {seq_len} and the decode plan's prefill {plan_.prefill} disagree: the prefill is the prompt")
    run = plan(pair, input_ids, plan_.prefill, batch_size, mode, atol, rtol, tolerances, False, attention_mask, left_pad, exact)
    notes = _decode_chunk_notes(pair, run.notes, plan_)
    _refuse_changed_weights(pair, "before the check")
    start = time.perf_counter()
    nodes, outcome = run_decode(pair, run.input_ids, run.attention_mask, plan_, run.tolerances)
    _refuse_changed_weights(pair, "during the forward passes")
    notes += outcome.lines()
    coverage = pair.coverage
    if coverage is None and pair.state_dict:
        coverage = loader_coverage(pair.ours, pair.state_dict, pair.tied_keys, pair.conversions, pair.built_storage, pair.by_design)
    meta = _meta(pair, run, config_diff(pair), time.perf_counter() - start, atol, rtol, tolerances, False)
    meta["decode"] = plan_.describe()
    return CheckResult(nodes=tuple(nodes), meta=meta, notes=tuple(notes), coverage=coverage,
                       alignment=tuple(pair.alignment), decode=outcome.to_dict())


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
    exact: bool | None = None,
    decode=None,
    trace_memory: int | None = TRACE_MEMORY,
) -> CheckResult:
    """Compare ``pair.ours`` with ``pair.reference`` node by node.

    ``input_ids``: ``(batch, seq)`` int64; by default seeded random tokens of ``seq_len``
    (``pair.default_seq_len``, which passes the sliding window of small configs) and
    ``batch_size``. ``mode``: ``chained`` (both models run on their own; errors compound),
    ``isolated`` (every node of ours continues from the reference's tensors, so each node shows
    only its own error; the first failing node is the fault) or ``both`` (verdict from chained,
    ``result.isolated`` filled too). ``atol``/``rtol`` override the dtype defaults
    (:data:`parity.compare.DEFAULT_TOLERANCES`); ``exact`` sets both to 0 (for pairs that are
    bit-identical when correct; by default ``pair.exact``, what the pair's family claims for its
    dtype, unless tolerances are given); ``calibrate`` derives each node's atol from the reference's own
    float32-vs-float64 error (:func:`calibrate_tolerances`); ``tolerances`` maps node-name glob
    patterns to ``(atol, rtol)`` and wins over all of them.

    ``attention_mask``: ``(batch, seq)``, 1 for real tokens and 0 for padding, given to both models;
    ``left_pad`` builds one instead: every batch row after the first starts with that many padding
    tokens (the rows whose queries see no real key are where masking bugs turn into NaN).

    ``trace_memory``: bytes of the reference's trace (and of what is kept of ours) held in memory;
    past it they spill to a temporary folder and are memory-mapped back (None: never spill). Ours
    is compared node by node as it runs, so only its first failure and that node's neighbourhood
    are kept (see :mod:`parity.resources` for the memory model).

    ``decode``: a :class:`parity.decode.DecodePlan` (or its text, ``"12:4x8"``) runs both models with
    their KV caches instead: prefill (``seq_len`` is the prefill length), chunks, decode steps, every
    node and both caches compared at every step (chained mode only; see :mod:`parity.decode`).

    Raises:
        ParityError: unknown ``mode``; ``input_ids`` not 2-D or out of the vocabulary; a mask of
            another shape; ``left_pad`` without a second row or not shorter than the sequence;
            invalid tolerances; weights shared by both models edited in place (before or during the
            check); a run that would not fit in memory (or its spilled traces on disk); a config the
            reference cannot run.
    """
    if exact is None:
        exact = pair.exact and atol is None and rtol is None and not calibrate
    if decode is not None:
        return _check_decode(pair, decode, input_ids, seq_len, batch_size, mode, atol, rtol, tolerances, calibrate,
                             attention_mask, left_pad, exact)
    run = plan(pair, input_ids, seq_len, batch_size, mode, atol, rtol, tolerances, calibrate, attention_mask, left_pad, exact,
               trace_memory)
    diffs = config_diff(pair)
    notes = list(run.notes)
    if run.attention_mask is not None and not _accepts(pair.ours, "position_ids"):
        notes.append("ours takes no position_ids: it gets the mask only, while the reference rotates each padded row "
                     "by positions counted over its real tokens (as generation does)")
    notes += [
        f"config differs: {d['key']} is {d['ours']!r} in ours, {d['reference']!r} in the reference" for d in diffs
    ]
    _refuse_changed_weights(pair, "before the check")
    start = time.perf_counter()
    ref_trace = trace_reference(pair, run)  # spills to disk past run.trace_memory; freed when dropped
    tolerance = run.tolerances
    noise = None
    if run.calibrate:
        noise = reference_noise(pair, run, ref_trace)
        tolerance = replace(tolerance, calibrated=calibrate_tolerances(pair, run, ref_trace, noise=noise))
    isolated = None
    if run.mode in ("isolated", "both"):
        isolated = compare_run(pair, run, trace_ours(pair, run, ref_trace, reference=ref_trace, tolerances=tolerance),
                               ref_trace, tolerance)
    our_trace = None
    if run.mode == "isolated":
        nodes = isolated
    else:
        our_trace = trace_ours(pair, run, reference=ref_trace, tolerances=tolerance)  # compared as it runs
        nodes = compare_run(pair, run, our_trace, ref_trace, tolerance)
    _refuse_changed_weights(pair, "during the forward passes")
    origin, origin_reason = None, ""
    if isolated is not None and run.mode == "both" and not run.tolerances.exact and first_mismatch(nodes) is not None:
        noise = reference_noise(pair, run, ref_trace) if noise is None else noise
        origin, origin_reason = find_origin(nodes, isolated, noise)
    profile, logits = analyse(pair, nodes, our_trace, ref_trace)
    spilled = ref_trace.spilled_bytes + (our_trace.spilled_bytes if our_trace is not None else 0)
    for trace in (ref_trace, our_trace):
        if trace is not None:
            trace.close()
    notes += [note for results in (nodes, isolated or []) if (note := _undiagnosed_note(results))]
    coverage = pair.coverage
    if coverage is None and pair.state_dict:
        coverage = loader_coverage(pair.ours, pair.state_dict, pair.tied_keys, pair.conversions, pair.built_storage, pair.by_design)
    meta = _meta(pair, run, diffs, time.perf_counter() - start, atol, rtol, tolerances, calibrate)
    meta["trace_spilled_bytes"] = spilled
    return CheckResult(
        nodes=tuple(nodes),
        meta=meta,
        notes=tuple(notes),
        profile=profile,
        logits=logits,
        isolated=tuple(isolated) if isolated is not None else None,
        coverage=coverage,
        origin=origin,
        origin_reason=origin_reason,
        alignment=tuple(pair.alignment),
    )
