""":func:`parity.check`: trace both models of a Pair on the same input and compare every node.

The run is a few small stages, each a function of what the previous ones produced:
:func:`~parity.run.plan.plan` (validate, build the inputs) -> :func:`~parity.run.stages.trace_reference`
-> :func:`~parity.run.stages.calibrate_tolerances` (optional) -> :func:`~parity.run.stages.trace_ours`
(chained and/or isolated) -> :func:`~parity.run.stages.compare_run` (compare, diagnose the first
failure) -> :func:`~parity.run.stages.analyse` (where the error sits, what it does to the logits) ->
an immutable :class:`~parity.report.result.CheckResult`. With a decode plan, :mod:`parity.run.decode`
runs instead."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from parity.build.coverage import loader_coverage
from parity.compare.arbiter import arbitrated_note
from parity.compare.results import first_mismatch
from parity.diagnose.origin import find_origin
from parity.model.pair import Pair
from parity.report.result import CheckResult
from parity.run.options import CheckOptions
from parity.run.plan import Run, decode_chunk_notes, decode_window_notes, plan
from parity.run.positions import all_ones_mask_result, unpositioned_result
from parity.run.stages import (
    analyse,
    calibrate_tolerances,
    compare_run,
    config_diff,
    forward_accepts,
    reference_noise,
    refuse_changed_weights,
    run_meta,
    settle_with_isolated,
    trace_ours,
    trace_reference,
    undiagnosed_note,
    unjudged_padding,
)
from parity.util.errors import ParityError
from parity.util.text import one_line


def _check_decode(pair: Pair, run: Run) -> CheckResult:
    """The KV-cache run of :func:`check` (see :mod:`parity.run.decode`)."""
    from parity.run.decode import run_decode

    decode = run.options.decode
    assert decode is not None  # check() comes here only with a decode plan
    notes = decode_window_notes(pair, decode_chunk_notes(pair, run.notes, decode), decode)
    refuse_changed_weights(pair, "before the check")
    start = time.perf_counter()
    nodes, outcome = run_decode(pair, run.input_ids, run.attention_mask, decode, run.tolerances)
    refuse_changed_weights(pair, "during the forward passes")
    notes += outcome.lines()
    meta = run_meta(pair, run, config_diff(pair), time.perf_counter() - start)
    meta["decode"] = decode.describe()
    return CheckResult(
        nodes=tuple(nodes),
        meta=meta,
        notes=tuple(notes),
        coverage=_coverage(pair),
        alignment=tuple(pair.alignment),
        decode=outcome.to_dict(),
    )


def _coverage(pair: Pair):
    """Loader coverage: computed while building (check_model), else now."""
    loading = pair.loading
    if loading.coverage is None and loading.state_dict:
        return loader_coverage(
            pair.ours,
            loading.state_dict,
            loading.tied_keys,
            loading.conversions,
            loading.built_storage,
            loading.by_design,
        )
    return loading.coverage


def coverage_notes(coverage) -> list[str]:
    """What loader coverage found that is no gap but a user should read: ties kept as copies,
    neutral constants where the reference has no tensor."""
    if coverage is None:
        return []
    notes = list(coverage.untied)
    if coverage.constants:
        shown = "; ".join(coverage.constants[:3]) + (
            f"; ... ({len(coverage.constants)} in all)" if len(coverage.constants) > 3 else ""
        )
        notes.append(f"neutral parameters of ours, no reference tensor: {shown}")
    unread = getattr(coverage, "unread_by_reference", [])
    if unread:
        shown = ", ".join(unread[:3]) + (f", ... ({len(unread)} in all)" if len(unread) > 3 else "")
        notes.append(
            f"reference tensors its logits never depend on in this config, not required of ours: {shown} (never "
            "read, as a decoder's cross-attention run without encoder states, or read where moving them changes no "
            "logit, as a pooler beside the LM head)"
        )
    return notes


def check(
    pair: Pair,
    input_ids: torch.Tensor | list | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    options: CheckOptions | None = None,
    **option_values,
) -> CheckResult:
    """Compare ``pair.ours`` with ``pair.reference`` node by node.

    ``input_ids``: ``(batch, seq)`` int64 (or a list of lists of token ids, any lengths: a prompt set,
    as ``prompt_ids``); by default seeded random tokens of ``seq_len``
    (``pair.default_seq_len``, which passes the sliding window of small configs) and ``batch_size``.
    ``attention_mask``: ``(batch, seq)``, 1 for real tokens and 0 for padding, given to both models
    (or ``left_pad=N`` builds one: every row but the last starts with N padding tokens, the first row
    among them, so code reading row 0's positions or mask for every row shows; the rows whose queries
    see no real key are where masking bugs turn into NaN).

    How it runs and judges: a :class:`parity.CheckOptions` (``options=``) and/or its fields as
    keywords, which win: ``seq_len``, ``batch_size``, ``left_pad``, ``mode`` (``chained``: both
    models run on their own and errors compound; ``isolated``: every node of ours continues from
    the reference's tensors, so the first failing node is the fault; ``both``: the verdict from
    chained, ``result.isolated`` filled too), ``atol``/``rtol`` (default: the dtype's,
    :data:`parity.compare.tolerances.DEFAULT_TOLERANCES`), ``exact`` (atol = rtol = 0; by default
    what the pair's family claims for its dtype, unless a tolerance is given), ``calibrate`` (each
    node's atol from the reference's own error against float64), ``tolerances`` (``{node glob:
    (atol, rtol)}``, winning over all), ``decode`` (a :class:`parity.DecodePlan` or ``"12:4x8"``:
    prefill, chunks and decode steps through both KV caches, every node and both caches compared
    at every step; chained only, see :mod:`parity.run.decode`), ``trace_memory`` (bytes of a
    trace held in memory before it spills to a temporary folder; see :mod:`parity.run.memory`),
    ``backward`` (training parity after the forward: ``train/logits``, ``loss``, every node's and
    parameter's gradient as ``grad/...``, with ``labels``; ``step="adamw"|"sgd"`` and ``lr``: one
    optimizer step, ``step/...``; see :mod:`parity.run.backward`) and ``causality`` (``causal/...``:
    no node of ours at position t may change when only later tokens change), ``prompts`` /
    ``prompt_ids`` / ``chat`` (real text: a prompt set checked ``batch_size`` prompts at a time, its
    verdict in ``result.text``; see :mod:`parity.run.prompt_set`).

    Returns an immutable :class:`parity.CheckResult` (``.passed``, ``.first_mismatch``, ``.nodes``...).

    Raises:
        ParityError: an unknown or invalid option; ``input_ids`` not 2-D integer ids in the
            vocabulary; a mask of another shape; ``left_pad`` without a second row or not shorter
            than the sequence; a tolerance pattern matching no node; weights shared by both models
            edited in place (before or during the check); a run that would not fit in memory (or its
            spilled traces on disk); a config the reference cannot run.
    """
    options = CheckOptions.of(options, **option_values)
    if input_ids is not None and not isinstance(input_ids, torch.Tensor) and isinstance(input_ids, (list, tuple)):
        options = replace(options, prompt_ids=tuple(input_ids))  # ragged rows of ids: a prompt set
        input_ids = None
    if options.prompts or options.prompt_ids:
        if input_ids is not None or attention_mask is not None:
            raise ParityError("give prompts (or lists of token ids) or an input_ids tensor, not both")
        from parity.run.prompt_set import check_prompt_set

        return check_prompt_set(pair, options)
    run = plan(pair, options, input_ids, attention_mask)
    if run.attention_mask is not None and run.options.decode is None:
        _require_mask_argument(pair, run)
    if run.options.decode is not None:
        return _check_decode(pair, run)
    if run.options.labels is not None:  # before the forward: a labels tensor that cannot serve is bad input
        from parity.run.backward import check_labels

        check_labels(run, pair.vocab_size)
    if run.options.resolved_semantic(pair.exact):
        from parity.run.semantic import check_semantic

        coverage = _coverage(pair)
        try:
            result = check_semantic(pair, run, _forward_notes(pair, run) + coverage_notes(coverage), coverage)
        except (ParityError, RuntimeError, TypeError, NotImplementedError) as err:
            if isinstance(err, ParityError) and " raised " not in str(err):
                raise  # bad input the semantic run found (weights changed, a refusal): not a float64 limit
            # an op that cannot run in float64 (torch's grouped matmul): the run's dtype alone, said in one line
            result = _check_forward(pair, run)
            why = one_line(err)[:300]
            note = f"the float64 semantic run could not run ({why}); judged in the run's dtype alone"
            result = replace(result, notes=(note, *result.notes))
    else:
        result = _check_forward(pair, run)
    unpositioned = unpositioned_result(pair, run, len(result.nodes))
    if unpositioned is not None:  # a forward without position_ids: after every node of the check itself
        result = replace(result, nodes=(*result.nodes, unpositioned))
    unmasked = all_ones_mask_result(pair, run, len(result.nodes))
    if unmasked is not None:  # an unpadded forward given an all-ones mask: after every node of the check itself
        result = replace(result, nodes=(*result.nodes, unmasked))
    if run.options.backward or run.options.causality:  # training parity, after the forward it needs
        from parity.run.backward import check_backward

        refuse_changed_weights(pair, "before the backward")
        result = check_backward(pair, run, result)
        refuse_changed_weights(pair, "during the backward")
    return result


def _require_mask_argument(pair: Pair, run: Run) -> None:
    """A padded run gives ours an ``attention_mask``: a forward that visibly takes none (no such
    parameter, no ``**kwargs``) is refused before anything runs, in one line naming it."""
    import inspect

    try:
        signature = inspect.signature(pair.ours.forward)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    if "attention_mask" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    what = f"{type(pair.ours).__name__}.forward{signature}"
    raise ParityError(
        f"the run pads rows (left_pad {run.options.left_pad} / --left-pad, or an attention_mask given), but your "
        f"model's forward {what} takes no attention_mask: accept one, forward(input_ids, attention_mask=None, "
        "position_ids=None), or check without padding"
    )


def _forward_notes(pair: Pair, run: Run) -> list[str]:
    """What a forward check says before its nodes: the run's notes, positions a model without
    position_ids cannot follow (a model that takes them and derives others when given none fails a node of
    its own, :func:`~parity.run.positions.unpositioned_result`), every config field ours holds otherwise than
    the reference."""
    notes = list(run.notes)
    if run.attention_mask is not None and not forward_accepts(pair.ours, "position_ids"):
        notes.append(
            "ours takes no position_ids: it gets the mask only, while the reference rotates each padded row "
            "by positions counted over its real tokens (as generation does)"
        )
    pad = unjudged_padding(pair, run)
    if pad is not None:
        rows = ", ".join(f"row {b}: {int(n)}" for b, n in enumerate(pad.sum(1).tolist()) if n)
        notes.append(
            f"padding: {int(pad.sum())} of {pad.numel()} token positions are padding ({rows}) and were not judged "
            "(what a model computes there is its own; a real token's attention to a padding key is judged)"
        )
    diffs = config_diff(pair)
    return notes + [
        f"config differs: {d['key']} is {d['ours']!r} in ours, {d['reference']!r} in the reference" for d in diffs
    ]


def _check_forward(pair: Pair, run: Run) -> CheckResult:
    """The plain (no cache) run of :func:`check`: chained and/or isolated."""
    diffs = config_diff(pair)
    notes = _forward_notes(pair, run)
    refuse_changed_weights(pair, "before the check")
    start = time.perf_counter()
    ref_trace = trace_reference(pair, run)  # spills to disk past run.trace_memory; freed when dropped
    tolerance = run.tolerances
    noise = None
    if run.calibrate:
        noise = reference_noise(pair, run, ref_trace)
        tolerance = replace(tolerance, calibrated=calibrate_tolerances(pair, run, ref_trace, noise=noise))
    isolated = None
    if run.mode in ("isolated", "both"):
        isolated = compare_run(
            pair,
            run,
            trace_ours(pair, run, ref_trace, reference=ref_trace, tolerances=tolerance),
            ref_trace,
            tolerance,
            search=run.mode == "isolated",
        )
    our_trace = None
    if run.mode == "isolated":
        assert isolated is not None  # compared just above for this mode
        nodes = isolated
    else:
        our_trace = trace_ours(pair, run, reference=ref_trace, tolerances=tolerance)  # compared as it runs
        nodes, isolated = settle_with_isolated(compare_run(pair, run, our_trace, ref_trace, tolerance), isolated)
    refuse_changed_weights(pair, "during the forward passes")
    origin, origin_reason = None, ""
    if isolated is not None and run.mode == "both" and not run.tolerances.exact and first_mismatch(nodes) is not None:
        noise = reference_noise(pair, run, ref_trace) if noise is None else noise
        origin, origin_reason = find_origin(nodes, isolated, noise)
    profile, logits = analyse(pair, nodes, our_trace, ref_trace)
    spilled = ref_trace.spilled_bytes + (our_trace.spilled_bytes if our_trace is not None else 0)
    for trace in (ref_trace, our_trace):
        if trace is not None:
            trace.close()
    notes += [note for results in (nodes, isolated or []) if (note := undiagnosed_note(results))]
    notes += [note] if (note := arbitrated_note(nodes)) else []
    meta = run_meta(pair, run, diffs, time.perf_counter() - start)
    meta["trace_spilled_bytes"] = spilled
    if run.options.locate and our_trace is not None:
        meta["worst_at"] = dict(our_trace.watched.get("*", {}))
    coverage = _coverage(pair)
    notes += coverage_notes(coverage)
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
