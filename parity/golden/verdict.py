"""``parity compare`` and ``parity record --verify``: a runtime's dump, a live model, or the installed
reference judged against a golden trace by the stages a check uses."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch
from torch import nn

from parity.compare.metrics import MISSING, UNTAPPED
from parity.compare.results import NodeResult, compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.hints import Hint
from parity.golden.dumps import NameMap, map_dump, read_dump, read_dump_info, read_name_map
from parity.golden.summaries import (
    SummaryTrace,
    compare_summary,
    summarise,
)
from parity.golden.trace_file import GoldenTrace, read_trace, recording_versions, utc_now
from parity.model.pair import LOGITS, NodeSpec, Pair, PairSource
from parity.record.trace import Trace
from parity.report.result import CheckResult
from parity.run.options import CheckOptions
from parity.run.plan import Run
from parity.user.align import UNALIGNED
from parity.util.errors import ParityError

# --- comparing ---------------------------------------------------------------------------------------


#: what a comparison with a trace may change: the trace fixes the inputs, the dtype and the weights
TRACE_OPTIONS = ("mode", "atol", "rtol", "exact", "tolerances")


def trace_options(options: CheckOptions | None, option_values: dict, dump: bool) -> CheckOptions:
    """The options of a comparison with a trace; one that the trace fixes (its inputs) is refused by
    name, and so is a mode other than chained for a dump (a runtime parity does not drive)."""
    options = CheckOptions.of(options, **option_values)
    fixed = [
        f
        for f in ("seq_len", "batch_size", "left_pad", "calibrate", "decode")
        if getattr(options, f) != getattr(CheckOptions(), f)
    ]
    if fixed:
        raise ParityError(
            f"{', '.join(fixed)} cannot be changed when comparing with a trace: the trace fixes its inputs "
            "and tolerances (record another trace instead)"
        )
    if dump and options.mode != "chained":
        raise ParityError(
            "isolated mode is not possible from a dump (each node of ours would have to continue from the "
            "reference's tensor): compare a live model with --ours, or use mode chained"
        )
    return options


def _run_of(trace: GoldenTrace, options: CheckOptions, tolerances: Tolerances) -> Run:
    inputs = trace.inputs()
    return Run(
        input_ids=inputs["input_ids"],
        attention_mask=inputs.get("attention_mask"),
        position_ids=inputs["position_ids"],
        options=options,
        tolerances=tolerances,
        notes=(),
    )


def _trace_pair(trace: GoldenTrace, nodes: list[NodeSpec]) -> Pair:
    """A Pair with no models: what compare_run and analyse read (nodes, facts, the output node)."""
    ref = trace.manifest["reference"]
    source = PairSource(
        family=ref.get("family") or ref["model_type"],
        config_name=ref.get("config_name") or "",
        seed=trace.manifest["probe"].get("seed", 0),
    )
    no_model = cast(nn.Module, None)  # compare_run and analyse read no model
    return Pair(ours=no_model, reference=no_model, nodes=nodes, facts=trace.facts(), dtype=trace.dtype, source=source)


def judge(trace: GoldenTrace, pair: Pair, run, ours: Trace, tolerances: Tolerances):
    """``(node results, profile, logits)`` of ours against the trace: whole tensors through
    :func:`parity.run.stages.compare_run` and :func:`parity.run.stages.analyse` (metrics, the first failure's
    hint, where its error sits, its effect on the logits), summaries through :func:`compare_summary`."""
    from parity.run.stages import analyse, compare_run, untapped_nodes

    if trace.kind == "tensors":
        ref = trace.reference_trace()
        results = compare_run(pair, run, ours, ref, tolerances)
        profile, logits = analyse(pair, results, ours, ref)
        return results, profile, logits
    stored = trace.summaries()
    untapped = untapped_nodes(pair)
    by_name = {n.name: n for n in pair.nodes}
    order = [name for name in trace.names if name in by_name] + [n.name for n in pair.nodes if n.name not in stored]
    results = []
    for index, name in enumerate(order):
        spec, theirs = by_name[name], stored.get(name)
        mine = ours.summaries.get(name) if isinstance(ours, SummaryTrace) else None
        tensor = ours.tensors.get(name)
        if (
            theirs is None
            or (mine is None and tensor is None)
            or (mine is None and tensor is not None and tuple(tensor.shape) != theirs.shape)
        ):
            # not comparable (missing on a side, or another shape): judged as parity check judges it;
            # the reference's tensor stands in as an empty meta tensor of its shape and dtype
            placeholder = (
                None if theirs is None else torch.empty(theirs.shape, dtype=getattr(torch, theirs.dtype), device="meta")
            )
            results.append(compare_node(spec, index, tensor, placeholder, tolerances, name in untapped))
            continue
        if mine is None:
            assert tensor is not None  # mine and tensor both None was judged above
            mine = summarise(tensor, spec.kind, index=theirs.sample_index)
        results.append(compare_summary(spec, index, mine, theirs, tolerances))
    bad = next((r for r in results if r.failed), None)
    if bad is not None and bad.status in (MISSING, "shape"):
        from parity.diagnose.detectors import diagnose

        results[bad.index] = replace(bad, hint=diagnose(bad, Trace(), Trace(), pair.facts))
    return results, None, None


def _meta(
    trace: GoldenTrace, compared: str, what: str, run: Run, seconds: float, ours_class: str, aligned: bool = False
) -> dict:
    tolerances = run.tolerances
    m = trace.manifest
    ref, probe, weights = m["reference"], m["probe"], m["weights"]
    return {
        "family": ref.get("family") or ref["model_type"],
        "config": ref.get("config_name"),
        "checkpoint": weights.get("checkpoint"),
        "checkpoint_sha256": weights.get("checkpoint_sha256"),
        "dtype": probe["dtype"],
        "batch_size": probe["batch_size"],
        "seq_len": probe["seq_len"],
        "padding": probe.get("left_pad"),
        "seed": probe.get("seed"),
        "mode": run.mode,
        "atol": run.options.atol,
        "rtol": run.options.rtol,
        "exact": tolerances.exact,
        "calibrated": tolerances.calibrated is not None,
        "safety_factor": None,
        "tolerances": {k: list(v) for k, v in tolerances.per_node.items()},
        "config_diff": [],
        #: the versions that computed the reference (the trace's); installed_versions: this run's
        "versions": {"torch": m["versions"].get("torch"), "transformers": m["versions"].get("transformers")},
        "installed_versions": recording_versions(),
        "time": utc_now(),
        "seconds": round(seconds, 3),
        "model_type": ref["model_type"],
        "ours_class": ours_class,
        "aligned": aligned,
        "cfg": {},
        "compared": compared,
        "compared_with": what,
        "trace": {
            "path": str(trace.path),
            "version": m["version"],
            "kind": m["kind"],
            "created": m.get("created"),
            "config_sha256": ref.get("config_sha256"),
            "stale": bool(trace.stale()),
        },
    }


def _notes(trace: GoldenTrace, extra: list[str], verifying: bool = False) -> tuple[str, ...]:
    notes = [n for n in (trace.stale_note(verifying),) if n] + list(trace.manifest.get("notes") or []) + extra
    if trace.kind == "summaries":
        notes.append(
            "judged on summaries: a statistic or sampled element past its bound proves a node fails; a node "
            "that passes is only consistent with agreement (an error in a few elements can escape the sample)"
        )
    return tuple(notes)


def _missing_in_dump(results: list[NodeResult], names: Mapping[str, str]) -> list[NodeResult]:
    """Missing nodes of a dump, said in the dump's words (which key or file it looked for)."""
    out = []
    for r in results:
        if r.status == MISSING and r.shape_ref is not None and r.shape_ours is None:
            looked = names.get(r.name, r.name)
            detail = f"the dump has no tensor {looked!r} (a key of a .safetensors file or {looked}.npy)"
            hint = (
                Hint("missing", f"likely a name-map problem or a node the runtime does not dump: {detail}")
                if r.hint
                else None
            )
            r = replace(r, detail=detail, hint=hint)
        out.append(r)
    return out


def node_sizes(trace: GoldenTrace):
    """``node -> {size name: int}``: what a name map's size names stand for at each node (the probe's
    batch and sequence, the reference's widths, and the node's layer's heads, head_dim and scale)."""
    facts, probe = trace.facts(), trace.manifest["probe"]
    common = {
        "batch": int(probe["batch_size"]),
        "seq": int(probe["seq_len"]),
        "heads": facts.num_heads,
        "kv_heads": facts.num_kv_heads,
        "head_dim": facts.head_dim,
        "hidden": facts.hidden_size,
        "vocab": facts.vocab_size,
    }
    if facts.intermediate_size:
        common["intermediate"] = facts.intermediate_size
    layer_of = {n["name"]: n.get("layer") for n in trace.node_entries}

    def sizes(node: str) -> dict:
        layer = facts.layer(layer_of.get(node))
        if layer is None:
            return common
        return {
            **common,
            "kv_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim,
            "attention_scale": layer.attention_scale,
        }

    return sizes


#: a calibrated tolerance above this fraction of its node's RMS would let a real bug pass
LOOSE_FRACTION = 0.1


def loose_tolerance_note(trace: GoldenTrace, tolerances: Tolerances, ours_live: bool = False) -> str | None:
    """A note when the tolerances of a trace's nodes are so loose next to the nodes' own size (more
    than :data:`LOOSE_FRACTION` of their RMS: calibrated bfloat16 tolerances are 10x the reference's
    own bfloat16 error) that a real bug of that size would pass; None otherwise."""
    if trace.kind != "tensors":
        return None
    ref = trace.reference_trace()
    loose = []
    for name in trace.names:
        atol, rtol, source = tolerances.for_node(name)
        tensor = ref.tensors.get(name)
        if tensor is None or not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        rms = float(tensor.double().pow(2).mean().sqrt())
        allowed = atol + rtol * rms
        if rms > 0 and allowed > LOOSE_FRACTION * rms:
            loose.append((allowed / rms, name, atol, rtol, rms, source))
    if not loose:
        return None
    loose.sort(reverse=True)
    fraction, name, atol, rtol, rms, source = loose[0]
    said = f"atol {atol:.3g}" + (f", rtol {rtol:.3g}" if rtol else "")
    instead = (
        "the semantic rule (parity check --ours ... --semantic) judges a formula in float64 first"
        if ours_live
        else f"to judge formulas, record a float32 trace (parity record ... --dtype float32 --calibrate: tolerances "
        f"from the reference's own float32 error) and run the runtime in float32; keep this {trace.manifest['probe']['dtype']} "
        "trace for the rounding"
    )
    return (
        f"loose tolerances: {len(loose)} of {len(trace.names)} nodes allow errors above {LOOSE_FRACTION:g} of their "
        f"RMS ({source} {said} at {name} is {fraction:.2f} of its RMS {rms:.3g}): a real bug of that size (a RoPE "
        f"position off by one, a wrong eps) would pass there; {instead}"
    )


def padding_mask(trace: GoldenTrace) -> torch.Tensor | None:
    """``(batch, seq)`` True where the trace's inputs are padding, or None (no mask, or none is padding)."""
    mask = trace.inputs().get("attention_mask")
    if mask is None or bool((mask != 0).all()):
        return None
    return mask == 0


def exclude_padding(
    tensors: dict[str, torch.Tensor], ref: Trace, kinds: Mapping[str, str], pad: torch.Tensor
) -> list[str]:
    """Ours' values at padding positions replaced by the reference's, in every node with a token axis
    (and a key axis: ``scores``, ``probs``), so padding is never judged; the nodes changed."""
    from parity.compare.padding import without_padding

    changed = []
    for name, tensor in list(tensors.items()):
        theirs = ref.tensors.get(name)
        if theirs is None:
            continue
        moved = without_padding(kinds.get(name, ""), tensor, theirs, pad, keys=("scores", "probs"))
        if moved is not tensor:
            tensors[name] = moved
            changed.append(name)
    return changed


def padding_note(pad: torch.Tensor, excluded: bool) -> str:
    rows = [f"row {b}: {int(n)}" for b, n in enumerate(pad.sum(1).tolist()) if n]
    total = int(pad.sum())
    if excluded:
        return (
            f"padding: {total} of {pad.numel()} token positions are padding ({', '.join(rows)}) and were not judged in "
            "any node (their queries, and their keys in scores and probs); --judge-padding judges them"
        )
    return f"padding: {total} of {pad.numel()} token positions are padding ({', '.join(rows)}) and were judged"


def compare_dump(
    trace,
    dump,
    name_map=None,
    *,
    options: CheckOptions | None = None,
    ignore_padding: bool | None = None,
    **option_values,
) -> CheckResult:
    """Compare another runtime's dump (see :func:`read_dump`, :func:`read_name_map`; a dump folder's
    ``parity-dump.json`` gives its name map when ``name_map`` is None, and the nodes it cannot produce)
    with a trace. ``options`` / option keywords: ``atol``, ``rtol``, ``exact``, ``tolerances`` (node
    pattern -> (atol, rtol)) override the trace's (see :meth:`GoldenTrace.tolerances`).
    ``ignore_padding``: padding positions are not judged (None: when the trace holds a mask with
    padding). Raises ParityError for an unreadable trace, dump or name map, or an option the trace fixes."""
    options = trace_options(options, option_values, dump=True)
    start = time.perf_counter()
    trace = read_trace(trace)
    info = read_dump_info(dump)
    rules = read_name_map(name_map) if name_map is not None else (info.name_map or NameMap())
    rules = rules.merged(NameMap((), info.unavailable, info.notes))
    shapes = {n["name"]: tuple(n["shape"]) for n in trace.node_entries}
    shapes.update({u["name"]: None for u in trace.manifest.get("unrecorded", [])})
    tensors, keys, notes = map_dump(read_dump(dump), rules.rules, shapes, node_sizes(trace))
    if info.runtime:
        notes.insert(0, f"runtime: {info.runtime}")
    notes += list(rules.notes)
    # what the dump would be looked up under, for a node it lacks: the runtime's name when one rule gives it
    names: dict[str, str] = {}
    for node in list(trace.names) + [u["name"] for u in trace.manifest.get("unrecorded", [])]:
        for rule in rules.rules:
            looked_for = rule.runtime_name(node)
            if looked_for is not None:
                names.setdefault(node, looked_for)
    tolerance = trace.tolerances(options)
    looked = {n: keys.get(n, names.get(n, n)) for n in trace.names}
    unavailable = {}
    for node in trace.names:
        reason = rules.unavailable_reason(node)
        if reason is not None and node not in tensors:
            unavailable[node] = reason
            looked[node] = f"{UNALIGNED}{reason}"
    if LOGITS in looked and LOGITS not in tensors and trace.head_node is not None and trace.head_node in tensors:
        # what a runtime returns is its head's output unless it applies something after it; a dump
        # that gives the head and not ``logits`` is judged at the head, and says so
        looked[LOGITS] = (
            f"{UNALIGNED}the dump has no {LOGITS!r} (what the runtime returns): {trace.head_node} stands for it"
        )
    pad = padding_mask(trace) if trace.kind == "tensors" else None
    if ignore_padding and pad is None:
        raise ParityError(
            "--ignore-padding: the trace holds no padding (record it with --batch 2+ --left-pad N to have some)"
        )
    if pad is not None:
        excluded = ignore_padding is not False
        if excluded:
            kinds = {n["name"]: n.get("kind", "") for n in trace.node_entries}
            exclude_padding(tensors, trace.reference_trace(), kinds, pad)
        notes.append(padding_note(pad, excluded))
    nodes = [replace(n, match_layout=True) for n in trace.node_specs(looked)]  # a runtime keeps its own layouts
    pair = _trace_pair(trace, nodes)
    ours = Trace(tensors=tensors, wanted=frozenset(tensors))
    run = _run_of(trace, options, tolerance)
    results, profile, logits = judge(trace, pair, run, ours, tolerance)
    results = _missing_in_dump(results, names)
    results = [
        replace(r, detail=f"the runtime does not produce it: {unavailable[r.name]}")
        if r.name in unavailable and r.status == UNTAPPED
        else r
        for r in results
    ]
    if unavailable:
        by_reason: dict[str, int] = {}
        for reason in unavailable.values():
            by_reason[reason] = by_reason.get(reason, 0) + 1
        shown = "; ".join(f"{n}: {reason}" for reason, n in by_reason.items())
        notes.append(f"{len(unavailable)} node(s) the runtime does not produce are untapped, not judged ({shown})")
    loose = loose_tolerance_note(trace, tolerance)
    if loose:
        notes.append(loose)
    notes.append(
        "isolated mode is not possible from a dump (each node of ours would have to continue from the "
        "reference's tensor): errors compound, so the first failing node is where the error first shows"
    )
    return CheckResult(
        nodes=tuple(results),
        meta=_meta(trace, "dump", str(Path(dump)), run, time.perf_counter() - start, f"dump:{Path(dump).name}"),
        notes=_notes(trace, notes),
        profile=profile,
        logits=logits,
    )


def compare_model(
    trace, ours, *, node_map: dict | None = None, checkpoint=None, options: CheckOptions | None = None, **option_values
) -> CheckResult:
    """Compare a live PyTorch model with a trace: ``ours`` is ``build(state_dict, hf_config)`` (as
    :func:`parity.check_model`), given the weights the trace was recorded with, and aligned to its
    nodes by them. ``options`` / option keywords: ``mode`` (``isolated``/``both`` continue every node
    from the trace's tensors: a ``tensors`` trace), ``atol``, ``rtol``, ``exact``, ``tolerances``.
    Raises ParityError."""
    from parity.run.stages import trace_ours
    from parity.user.check_model import build_user_pair

    options = trace_options(options, option_values, dump=False)
    mode = options.mode
    start = time.perf_counter()
    trace = read_trace(trace)
    if mode != "chained" and trace.kind != "tensors":
        raise ParityError(
            "isolated mode continues every node from the reference's tensor, which a summaries trace does not hold"
        )
    ref = trace.rebuild_reference(checkpoint)
    pair = build_user_pair(
        ours, ref.model, dtype=trace.dtype, seed=trace.manifest["probe"].get("seed", 0), node_map=node_map
    )
    tolerance = trace.tolerances(options)
    run = _run_of(trace, options, tolerance)
    isolated = None
    if mode in ("isolated", "both"):
        substitute = trace.reference_trace()
        iso_trace = trace_ours(pair, run, substitute)
        isolated, _, _ = judge(trace, pair, run, iso_trace, tolerance)
    if mode == "isolated":
        assert isolated is not None  # judged just above for this mode
        results, profile, logits = isolated, None, None
    else:
        ours_trace = trace_ours(pair, run)
        results, profile, logits = judge(trace, pair, run, ours_trace, tolerance)
    ours_class = f"{type(pair.ours).__module__}.{type(pair.ours).__qualname__}"
    return CheckResult(
        nodes=tuple(results),
        meta=_meta(trace, "model", ours_class, run, time.perf_counter() - start, ours_class, True),
        notes=_notes(trace, [n for n in (loose_tolerance_note(trace, tolerance, ours_live=True),) if n]),
        profile=profile,
        logits=logits,
        isolated=tuple(isolated) if isolated is not None else None,
        coverage=pair.loading.coverage,
        alignment=tuple(pair.alignment),
    )


def verify(trace, checkpoint=None) -> CheckResult:
    """Re-run the reference the trace was recorded from, with the installed torch and Transformers, on
    the trace's inputs, and judge it against the trace with the trace's tolerances (``passed``: it
    still reproduces; ``first_divergence`` None: bit for bit). Raises ParityError."""
    from parity.run.stages import trace_reference

    start = time.perf_counter()
    trace = read_trace(trace)
    ref = trace.rebuild_reference(checkpoint)
    nodes = trace.node_specs()
    pair = Pair(
        ours=ref.model,
        reference=ref.model,
        nodes=nodes,
        facts=trace.facts(),
        dtype=trace.dtype,
        source=PairSource(family=ref.facts.model_type, config_name=ref.config_name),
    )
    tolerance = trace.tolerances()
    run = _run_of(trace, CheckOptions(), tolerance)
    into = None
    if trace.kind == "summaries":
        indices = {k: s.sample_index for k, s in trace.summaries().items()}
        into = SummaryTrace({n.name: n.kind for n in pair.nodes}, indices=indices)
    fresh = trace_reference(pair, run, into=into)
    results, profile, logits = judge(trace, _trace_pair(trace, nodes), run, fresh, tolerance)
    import transformers

    what = f"{ref.facts.model_type} reference re-run with torch {torch.__version__}, Transformers {transformers.__version__}"
    return CheckResult(
        nodes=tuple(results),
        meta=_meta(trace, "verify", what, run, time.perf_counter() - start, type(ref.model).__name__),
        notes=_notes(trace, [], verifying=True),
        profile=profile,
        logits=logits,
    )
