"""A check over a set of real prompts, and its verdict.

:func:`check_prompt_set` tokenizes the options' prompts (:mod:`parity.run.inputs`), runs
:func:`parity.check` on ``batch_size`` prompts at a time (padded as the tokenizer pads, left for a
decode plan, the mask given to both models), and gathers one :class:`~parity.report.result.CheckResult`:

* per node, its worst case over the set (a failing status first, then the largest
  ``max_abs / tolerance``) and where it occurred (prompt, position: ``text["worst"]``);
* at the logits, from one plain forward of each model per batch (padding left out):
  KL(reference || ours) per position, its mean and max, top-1 agreement (the same arg-max) and top-5
  agreement (the reference's arg-max among ours' top 5), and every top-1 disagreement with the
  reference's margin (its top-1 minus top-2 logit);
* the reference's own error, from a float64 copy of it (:mod:`parity.run.float64`) run on the same
  batches: KL(reference in float64 || reference) is the rounding floor the spread is judged against,
  and a disagreement whose margin is within twice the reference's largest logit error at that position
  is a near-tie (rounding can flip it), not a bug;
* with a decode plan, the first prompt and step where the greedy tokens part.

The result's ``text`` holds all of it (JSON, CSV ``prompts.csv``, HTML); its nodes, notes and
verdict are those of a check, so exit codes and reports read the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from parity.model.pair import Pair
from parity.report.result import CheckResult
from parity.report.tables import tolerance_ratio
from parity.run.inputs import TextInputs, check_fits, text_inputs
from parity.run.options import CheckOptions, DecodePlan
from parity.util.errors import ParityError

#: KL(reference || ours) within this many times the reference's own KL against float64 is rounding
NOISE_FACTOR = 10.0
#: top-k of the "top-5 agreement"
TOP_K = 5


def _badness(r) -> tuple:
    ratio = tolerance_ratio(r)
    return (r.failed, math.inf if ratio is None and r.failed else (ratio if ratio is not None else -1.0))


def logits_of(out) -> torch.Tensor:
    """The logits a forward returned: a tensor, an output with ``.logits``, or the first tensor of a tuple/dict."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    found = next((v for v in values if isinstance(v, torch.Tensor)), None)
    if found is None:
        raise ParityError(f"the forward returned {type(out).__name__}, not logits (batch, seq, vocab)")
    return found


def forward_logits(pair: Pair, model, ids: torch.Tensor, mask: torch.Tensor | None, reference: bool) -> torch.Tensor:
    """``(batch, seq, vocab)`` logits of one plain forward (no hooks), on the CPU in float64."""
    from parity.run.plan import generation_positions
    from parity.run.stages import device_of, forward_accepts, on_device, run_ours

    device = device_of(model)
    batch, seq = ids.shape
    positions = generation_positions(mask, batch, seq, pair.facts.position_offset)
    with torch.no_grad():
        if reference:
            out = model(
                input_ids=on_device(device, ids),
                attention_mask=on_device(device, mask),
                position_ids=on_device(device, positions),
                use_cache=False,
            )
        else:
            kwargs = {}
            if mask is not None:
                kwargs["attention_mask"] = on_device(device, mask)
                if forward_accepts(model, "position_ids"):
                    kwargs["position_ids"] = on_device(device, positions)
            out = run_ours(pair, model, on_device(device, ids), **kwargs)
    return logits_of(out).detach().to("cpu", torch.float64)


def kl_divergence(ref: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """KL(ref || ours) in nats per position over the last axis (float64 logits in, ``(...,)`` out)."""
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def position_stats(ref: torch.Tensor, ours: torch.Tensor, ref64: torch.Tensor | None) -> dict:
    """Per position of one prompt (``(seq, vocab)`` float64 logits each): KL, top-1 and top-5
    agreement, the reference's margin, its own error (max |reference - float64| over the vocabulary)
    and KL against float64. Lists of length seq."""
    k = min(TOP_K, ref.shape[-1])
    ref_top = ref.topk(min(2, ref.shape[-1]), -1)
    ours_top = ours.topk(k, -1).indices
    top1_ref, top1_ours = ref_top.indices[:, 0], ours_top[:, 0]
    margin = (ref_top.values[:, 0] - ref_top.values[:, -1]) if ref.shape[-1] > 1 else torch.zeros(ref.shape[0])
    stats = {
        "kl": kl_divergence(ref, ours).tolist(),
        "top1": (top1_ref == top1_ours).tolist(),
        "top5": (ours_top == top1_ref[:, None]).any(-1).tolist(),
        "token_ref": top1_ref.tolist(),
        "token_ours": top1_ours.tolist(),
        "margin": margin.tolist(),
        "ref_error": None,
        "noise_kl": None,
    }
    if ref64 is not None:
        stats["ref_error"] = (ref - ref64).abs().amax(-1).tolist()
        stats["noise_kl"] = kl_divergence(ref64, ref).clamp_min(0.0).tolist()
    return stats


def _float64_reference(pair: Pair, notes: list[str]):
    """A float64 copy of the reference, or None (with a note) when it would not fit or cannot be made."""
    from parity.run.float64 import float64_models

    try:
        (ref64,) = float64_models(pair.reference, what="a float64 copy of the reference (the prompt-set noise floor)")
        return ref64
    except ParityError as e:
        notes.append(f"no float64 copy of the reference ({e}): near-ties and the noise floor are not judged")
        return None


def _batch_options(options: CheckOptions, inputs_len: int, rows: int) -> CheckOptions:
    changes: dict = dict(prompts=(), prompt_ids=(), chat=False, locate=True, batch_size=rows, seq_len=None)
    if options.decode is not None:
        plan = options.decode
        changes["decode"] = DecodePlan(inputs_len, plan.steps, plan.chunk if plan.chunk else None)
    return replace(options, **changes)


def check_prompt_set(
    pair: Pair, options: CheckOptions, progress: Callable[[int, int, str], None] | None = None
) -> CheckResult:
    """Check ``pair`` on the prompt set of ``options`` (``prompts`` or ``prompt_ids``), ``batch_size``
    prompts at a time, and return one CheckResult with the set's verdict in ``result.text`` (see the
    module docstring). ``progress(done, total, label)`` is called before each batch and at the end.

    Raises:
        ParityError: no tokenizer (or one that needs remote code or fails to load), no chat template
            with ``chat``, a prompt longer than the model's positions, a token id outside the
            vocabulary, and everything :func:`parity.check` raises.
    """
    from parity.run.check import check

    inputs = text_inputs(options, pair.source.checkpoint)
    assert inputs is not None  # called only with prompts or prompt ids
    steps = options.decode.steps if options.decode is not None else 0
    check_fits(inputs, pair.vocab_size, pair.facts.max_position_embeddings, steps)
    side = "left" if options.decode is not None else inputs.padding_side
    notes: list[str] = [f"inputs: {len(inputs.prompts)} prompt(s), {inputs.source}; {inputs.bos}"]
    from parity.run.stages import forward_accepts

    lacks = [arg for arg in ("attention_mask", "position_ids") if not forward_accepts(pair.ours, arg)]
    if options.batch_size > 1 and len(inputs.prompts) > 1 and lacks:
        # a padded row's positions (and, without a mask, its padding keys) follow the mask in the reference
        # only: ours would differ at the padding, or at every real token of a left-padded row
        notes.append(
            f"ours' forward takes no {' or '.join(lacks)}: a padded batch would judge positions ours cannot "
            f"follow, so the prompts run one at a time (--batch {options.batch_size} asked)"
        )
        options = replace(options, batch_size=1)
    batches = inputs.batches(options.batch_size, side)
    if inputs.chat:
        notes.append("each prompt went through the tokenizer's chat template (with the generation prompt)")
    if any(mask is not None for _, _, mask in batches):
        notes.append(
            f"batches of {options.batch_size} padded on the {side} (id {inputs.pad_id}), the mask given to both models"
        )
    if options.decode is not None and any(ids.shape[1] != options.decode.prefill for _, ids, _ in batches):
        notes.append(
            f"the prefill is each batch's prompt ({', '.join(sorted({str(ids.shape[1]) for _, ids, _ in batches}))} "
            f"tokens), not --decode's {options.decode.prefill}; then {steps} decode steps"
        )
    ref64 = _float64_reference(pair, notes)
    results: list[tuple[list, CheckResult]] = []
    per_prompt: list[dict] = []
    try:
        for b, (rows, ids, mask) in enumerate(batches):
            if progress is not None:
                progress(b, len(batches), f"prompts {rows[0].index}-{rows[-1].index}")
            result = check(pair, ids, attention_mask=mask, options=_batch_options(options, ids.shape[1], len(rows)))
            results.append((rows, result))
            ref = forward_logits(pair, pair.reference, ids, mask, reference=True)
            ours = forward_logits(pair, pair.ours, ids, mask, reference=False)
            exact = None
            if ref64 is not None:
                from parity.run.float64 import Float64Mode

                with Float64Mode():
                    exact = forward_logits(pair, ref64, ids, mask, reference=True)
            for r, prompt in enumerate(rows):
                real = mask[r].bool() if mask is not None else torch.ones(ids.shape[1], dtype=torch.bool)
                stats = position_stats(ref[r][real], ours[r][real], exact[r][real] if exact is not None else None)
                per_prompt.append(_prompt_row(prompt, b, r, result, stats))
    finally:
        del ref64
    if progress is not None:
        progress(len(batches), len(batches), "done")
    return _gather(pair, options, inputs, results, per_prompt, notes, batches)


def _prompt_row(prompt, batch: int, row: int, result: CheckResult, stats: dict) -> dict:
    bad = result.first_mismatch
    n = len(stats["kl"])
    return {
        **prompt.to_dict(),
        "batch": batch,
        "row": row,
        "tokens": n,
        "passed": result.passed,
        "first_mismatch": bad.name if bad is not None else None,
        "kl_mean": sum(stats["kl"]) / n,
        "kl_max": max(stats["kl"]),
        "top1_agreement": sum(stats["top1"]) / n,
        "top5_agreement": sum(stats["top5"]) / n,
        "noise_kl_mean": sum(stats["noise_kl"]) / n if stats["noise_kl"] is not None else None,
        "positions": stats,
    }


def _near_tie(stats: dict, t: int) -> bool | None:
    err = stats["ref_error"]
    return None if err is None else stats["margin"][t] <= 2 * err[t]


def _disagreements(per_prompt: list[dict]) -> list[dict]:
    out = []
    for p in per_prompt:
        s = p["positions"]
        for t, agree in enumerate(s["top1"]):
            if not agree:
                out.append(
                    {
                        "prompt": p["index"],
                        "position": t,
                        "token_ref": s["token_ref"][t],
                        "token_ours": s["token_ours"][t],
                        "margin": s["margin"][t],
                        "ref_error": s["ref_error"][t] if s["ref_error"] is not None else None,
                        "near_tie": _near_tie(s, t),
                    }
                )
    return out


def _logits_verdict(per_prompt: list[dict]) -> dict:
    kls = [(v, p["index"], t) for p in per_prompt for t, v in enumerate(p["positions"]["kl"])]
    n = len(kls)
    worst = max(kls, key=lambda x: x[0])
    noise = [v for p in per_prompt for v in (p["positions"]["noise_kl"] or [])]
    top1 = sum(v for p in per_prompt for v in p["positions"]["top1"]) / n
    top5 = sum(v for p in per_prompt for v in p["positions"]["top5"]) / n
    mean = sum(v for v, _, _ in kls) / n
    out = {
        "positions": n,
        "kl_mean": mean,
        "kl_max": worst[0],
        "kl_max_at": {"prompt": worst[1], "position": worst[2]},
        "top1_agreement": top1,
        "top5_agreement": top5,
        "noise_kl_mean": sum(noise) / len(noise) if noise else None,
        "noise_kl_max": max(noise) if noise else None,
    }
    out["judgement"] = _judgement(out)
    return out


def _judgement(v: dict) -> str:
    """One line: is the spread of KL within the reference's own rounding?"""
    if v["kl_max"] == 0:
        return "ours' logits equal the reference's at every position (KL 0)"
    noise = v["noise_kl_max"]
    if noise is None:
        return f"KL max {v['kl_max']:.3g} nats (no float64 copy of the reference to judge it against)"
    floor = max(noise, 1e-300)
    ratio = v["kl_max"] / floor
    if v["kl_max"] <= NOISE_FACTOR * noise:
        return (
            f"within the reference's own rounding: KL max {v['kl_max']:.3g} nats, the reference against float64 "
            f"{noise:.3g} ({ratio:.3g}x, at most {NOISE_FACTOR:g}x)"
        )
    return (
        f"beyond the reference's own rounding: KL max {v['kl_max']:.3g} nats is {ratio:.3g}x the reference's own KL "
        f"against float64 ({noise:.3g})"
    )


def _first_divergence(results: list[tuple[list, CheckResult]], steps: int) -> dict | None:
    """The first prompt (in prompt order), and its first generated token, where ours' greedy token
    differs from the reference's (``step``: the call of the schedule; ``token``: 0 for the token after
    the prompt)."""
    best = None
    for rows, result in results:
        decode = result.decode
        if not decode:
            continue
        last_prefill = len(decode["steps"]) - steps - 1  # its greedy token is the first one generated
        for r, prompt in enumerate(rows):
            for k in range(max(last_prefill, 0), len(decode["greedy_reference"])):
                a, b = decode["greedy_reference"][k][r], decode["greedy_ours"][k][r]
                if a != b:
                    found = {
                        "prompt": prompt.index,
                        "step": k,
                        "token": k - last_prefill,
                        "token_ref": a,
                        "token_ours": b,
                    }
                    if best is None or found["prompt"] < best["prompt"]:
                        best = found
                    break
    return best


def _batch_notes(results: list[CheckResult]) -> list[str]:
    """The batches' notes, each said once: notes that differ only in their numbers (a rounding summary
    per batch) are one, the first batch's shown with how many more batches said the like."""
    import re

    first: dict[str, str] = {}
    texts: dict[str, set[str]] = {}
    count: dict[str, int] = {}
    for result in results:
        for n in dict.fromkeys(result.notes):
            key = re.sub(r"\d[\d.e+-]*", "#", n)
            first.setdefault(key, n)
            texts.setdefault(key, set()).add(n)
            count[key] = count.get(key, 0) + 1
    return [n if len(texts[k]) == 1 else f"{n} (and {count[k] - 1} more batch(es) alike)" for k, n in first.items()]


def _gather(pair, options, inputs: TextInputs, results, per_prompt, notes, batches) -> CheckResult:
    first = results[0][1]
    worst: dict[str, tuple] = {}
    for rows, result in results:
        located = result.meta.get("worst_at") or {}
        for node in result.nodes:
            held = worst.get(node.name)
            if held is None or _badness(node) > _badness(held[0]):
                at = located.get(node.name)
                if at and at[0] is not None and at[0] < len(rows):
                    prompt, position = rows[at[0]].index, at[1]
                else:  # not located (a semantic or decode run): the prompt is known only in a batch of one
                    prompt, position = (rows[0].index if len(rows) == 1 else None), None
                worst[node.name] = (node, prompt, position, [p.index for p in rows])
    order = {n.name: i for i, n in enumerate(first.nodes)}
    for _, result in results[1:]:
        for node in result.nodes:
            order.setdefault(node.name, len(order))
    nodes: list = []
    for name in sorted(worst, key=order.__getitem__):
        node, prompt, position, batch = worst[name]
        where = (
            f"worst in the batch of prompts {batch[0]}-{batch[-1]}"
            if prompt is None
            else f"worst at prompt {prompt}" + (f", position {position}" if position is not None else "")
        )
        located = len(per_prompt) > 1 and bool(node.max_abs)  # where an exact node is worst says nothing
        detail = "; ".join(d for d in (node.detail, where) if d) if located else node.detail
        nodes.append(replace(node, index=len(nodes), detail=detail))
    all_notes = list(dict.fromkeys(notes)) + _batch_notes([r for _, r in results])
    logits = _logits_verdict(per_prompt)
    disagreements = _disagreements(per_prompt)
    text = {
        **inputs.to_dict(),
        "count": len(per_prompt),
        "batches": len(batches),
        "prompts": per_prompt,
        "logits": logits,
        "disagreements": disagreements,
        "worst": {
            name: {
                "prompt": prompt,
                "batch": batch,
                "position": position,
                "max_abs": node.max_abs,
                "status": node.status,
            }
            for name, (node, prompt, position, batch) in worst.items()
        },
    }
    if options.decode is not None:  # None: ours picks the reference's greedy token everywhere
        text["decode_divergence"] = _first_divergence(results, options.decode.steps)
    meta = dict(first.meta)
    meta.pop("worst_at", None)
    meta["batch_size"] = int(options.batch_size)
    meta["seq_len"] = max(int(ids.shape[1]) for _, ids, _ in batches)
    meta["probe"] = f"{pair.source.probe}; inputs: {len(per_prompt)} prompt(s), {inputs.source}"
    meta["seconds"] = round(sum(r.meta.get("seconds") or 0.0 for _, r in results), 3)
    meta["prompts"] = len(per_prompt)
    bad_runs = [r for _, r in results if not r.passed]
    coverage = first.coverage
    return CheckResult(
        nodes=tuple(nodes),
        meta=meta,
        notes=tuple(all_notes),
        profile=(bad_runs[0] if bad_runs else first).profile,
        logits=None,
        isolated=None,
        coverage=coverage,
        alignment=first.alignment,
        decode=(bad_runs[0] if bad_runs else first).decode,
        text=text,
    )
