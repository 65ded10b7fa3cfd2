"""report.html: one self-contained file that opens offline.

Inline CSS, an inline script of our own (table sorting, filtering, node details) and figures from
:mod:`parity.report.plots` inlined as SVG; nothing is fetched from a network. Jinja2 autoescape is
on: every name from a config, a checkpoint path or a module path is escaped.

Sections: header (verdict and run facts), first-mismatch card (metrics, hint, error by position
and head), depth (heatmap of max_abs / tolerance per layer and node kind, the embedding, final norm
and head a row each, every cell naming its numbers on hover; error through depth), where the error
sits (by position / head / channel, and what it does to the logits), the node table (sortable,
filterable, a details row per node), the model cfg. Where every node agrees, a sentence says so
instead of a plot of nothing (the plots stay one click away when the errors are not all zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from parity.compare.metrics import STATUSES
from parity.compare.results import first_mismatch
from parity.report import plots
from parity.report.tables import result_dict, tolerance_ratio
from parity.util.files import atomic_write
from parity.util.text import grouped

_env = Environment(
    loader=PackageLoader("parity.report", "templates"),
    autoescape=select_autoescape(["j2", "html"], default_for_string=True, default=True),
    trim_blocks=True,
    lstrip_blocks=True,
)

#: node kinds whose last axis is the key position rather than a channel
KEY_AXIS_KINDS = {"probs"}
#: run facts short enough never to wrap (a timestamp broken over two lines reads as two values)
NOWRAP_FACTS = {"family", "dtype", "seq len", "seed", "mode", "torch", "transformers", "time"}


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec)


def _sort_value(value) -> str:
    """``data-v`` for the table script: a plain number, or empty (sorted last)."""
    if value is None or math.isnan(value):
        return ""
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(float(value))


def _fmt_ratio(value, spec: str = ".3g") -> str:
    """max_abs / tolerance; an infinite one (a nonzero error under atol 0, rtol 0) says why."""
    if isinstance(value, float) and math.isinf(value):
        return "inf (tolerance 0: any nonzero error fails)"
    return _fmt(value, spec)


_env.filters["fmt"] = _fmt
_env.filters["ratio"] = _fmt_ratio
_env.filters["sortv"] = _sort_value


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape) if shape else ""


def _top(values, k: int = 3) -> list[int]:
    finite = [(v if v is not None and not math.isnan(v) else math.inf, i) for i, v in enumerate(values or [])]
    return [i for _, i in sorted(finite, key=lambda t: -t[0])[:k]]


def _tolerance_facts(result) -> list[tuple[str, str]]:
    meta = result.meta
    base = next((n for n in result.nodes if not n.tol_source.startswith("pattern:")), None)
    facts = []
    if base is not None:
        where = {"run": "set for this run", "exact": "exact: the pair is bit-identical when correct"}.get(
            base.tol_source, base.tol_source.replace("default:", "defaults for ")
        )
        facts.append(("tolerance", f"atol {base.atol:g}, rtol {base.rtol:g} ({where})"))
    elif meta.get("atol") is not None or meta.get("rtol") is not None:
        facts.append(("tolerance", f"atol {meta.get('atol')}, rtol {meta.get('rtol')} (set for this run)"))
    for pattern, tol in (meta.get("tolerances") or {}).items():
        facts.append(("tolerance", f"{pattern}: atol {tol[0]:g}, rtol {tol[1]:g}"))
    calibrated = sum(n.tol_source == "calibrated" for n in result.nodes)
    if calibrated:
        factor = f", safety factor {meta['safety_factor']:g}" if meta.get("safety_factor") else ""
        facts.append(("tolerance", f"{calibrated} nodes calibrated from the reference's float64 error{factor}"))
    return facts


def _coverage(result) -> dict | None:
    coverage = getattr(result, "coverage", None)
    if coverage is None:
        return None
    d = coverage.to_dict()
    summary = (
        f"complete: {d.get('consumed', 0)} checkpoint tensors, each in one parameter"
        if coverage.ok
        else (f"{len(d['gaps'])} gap{'s' if len(d['gaps']) != 1 else ''}")
    )
    return {
        "ok": coverage.ok,
        "summary": summary,
        "gaps": list(d["gaps"]),
        "info": [f"{k}: {v}" for k in ("tied", "conversions", "copies") for v in grouped(d.get(k) or [])]
        + ([f"skipped: {d['skipped']}"] if d.get("skipped") else []),
        "replaced": coverage.replaced_note() if hasattr(coverage, "replaced_note") else None,
    }


def _time(stamp) -> str | None:
    """``2026-11-30T09:26:29+00:00`` -> ``2026-11-30 09:26:29 UTC`` (other offsets kept as they are)."""
    if not isinstance(stamp, str):
        return stamp
    return (
        stamp.replace("T", " ", 1).replace("+00:00", " UTC") if stamp.endswith("+00:00") else stamp.replace("T", " ", 1)
    )


def _facts(result) -> list[dict]:
    meta = result.meta
    versions = meta.get("versions") or {}
    facts = [
        ("family", meta.get("family")),
        ("config", meta.get("config")),
        ("checkpoint", meta.get("checkpoint") or "none: random weights from the seed"),
    ]
    if meta.get("checkpoint_sha256"):
        facts.append(("checkpoint sha256", meta["checkpoint_sha256"]))
    facts += [
        ("dtype", meta.get("dtype")),
        (
            "seq len",
            f"{meta.get('seq_len')} tokens"
            + (f" x batch {meta['batch_size']}" if meta.get("batch_size", 1) != 1 else ""),
        ),
        ("seed", meta.get("seed")),
        ("mode", meta.get("mode")),
        ("probe", meta.get("probe")),
        *_tolerance_facts(result),
        ("torch", versions.get("torch")),
        ("transformers", versions.get("transformers")),
        ("time", _time(meta.get("time"))),
    ]
    coverage = _coverage(result)
    if coverage is not None:
        facts.append(("loader coverage", coverage["summary"]))
    if meta.get("seconds") is not None:
        facts.append(("duration", f"{meta['seconds']:g} s tracing and comparing"))
    return [{"key": k, "value": "-" if v is None else str(v)} for k, v in facts]


def _card(result, bad) -> dict | None:
    if bad is None:
        return None
    profile = result.profile if result.profile and result.profile.get("node") == bad.name else None
    card = {
        "ratio": tolerance_ratio(bad),
        "failing": sum(n.failed for n in result.nodes),
        "after": sum(n.failed for n in result.nodes if n.index > bad.index),
        "profile": profile,
        "position_svg": None,
        "head_svg": None,
        "isolated_first": None,
        "tokens": None,
    }
    if result.isolated is not None and result.meta.get("mode") != "isolated":
        card["isolated_first"] = first_mismatch(result.isolated)
    worst = (result.text or {}).get("worst", {}).get(bad.name) if getattr(result, "text", None) else None
    if worst is not None:  # the tokens of the prompt where this node is worst, beside its position profile
        card["tokens"] = next((row for row in token_rows(result.text) if row["index"] == worst["prompt"]), None)
    if profile:
        card["position_svg"] = _svg(
            plots.profile_svg(profile.get("by_position"), bad.atol, "token position", "position")
        )
        card["head_svg"] = _svg(plots.profile_svg(profile.get("by_head"), bad.atol, "head", "head", width=3.6))
    return card


def _where(result, bad, card) -> dict:
    profile = card["profile"] if card else None
    where: dict[str, Any] = {"channel_svg": None, "channel_label": "", "tops": [], "logits_svg": None}
    if profile and bad is not None:
        key_axis = bad.kind in KEY_AXIS_KINDS
        where["channel_label"] = "key position (last axis)" if key_axis else "channel (last axis)"
        where["channel_svg"] = _svg(
            plots.profile_svg(profile.get("by_channel"), bad.atol, where["channel_label"], "channel", width=9.0)
        )
        for label, key in (
            ("token positions", "by_position"),
            ("heads", "by_head"),
            (where["channel_label"], "by_channel"),
        ):
            values = profile.get(key)
            if values:
                where["tops"].append(
                    {
                        "label": label,
                        "n": len(values),
                        "top": [{"i": i, "v": values[i]} for i in _top(values)],
                        "over": sum(1 for v in values if v is None or not math.isfinite(v) or v > bad.atol),
                    }
                )
    if result.logits and _logits_agree(result.logits) is None:
        where["logits_svg"] = _svg(plots.logits_svg(result.logits, int(result.meta.get("batch_size") or 1)))
    return where


def _kl_color(kl) -> str:
    """A token's background by its KL(reference || ours): the exact colour at 0, pale to dark red from 1e-12 to 1 nat."""
    if kl is None or kl <= 0:
        return plots.EXACT + ";color:#000"
    t = min(max((math.log10(kl) + 12.0) / 12.0, 0.0), 1.0)
    r, g, b, _ = plots.ERROR_CMAP(t)
    ink = "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "#000"  # readable on dark red
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x};color:{ink}"


def token_rows(text) -> list[dict]:
    """Per prompt of a prompt set: its tokens (position, id, piece) with KL and top-1 per position."""
    if not text:
        return []
    out = []
    for p in text["prompts"]:
        s = p["positions"]
        cells = [
            {
                "position": t,
                "id": i,
                "piece": piece,
                "kl": s["kl"][t],
                "top1": s["top1"][t],
                "color": _kl_color(s["kl"][t]),
            }
            for t, (i, piece) in enumerate(zip(p["ids"], p["pieces"]))
        ]
        out.append({"index": p["index"], "cells": cells, "kl_max": p["kl_max"], "top1_agreement": p["top1_agreement"]})
    return out


def _svg(text: str | None) -> Markup | None:
    # plots.* output is matplotlib's SVG writer output (it escapes all text); safe to inline as is
    return Markup(text) if text else None


def _rows(result) -> list[dict]:
    separate = result.isolated and result.meta.get("mode") != "isolated"
    isolated = {n.name: n for n in result.isolated} if separate else {}
    rows = []
    for n in result.nodes:
        ratio = tolerance_ratio(n)
        rows.append(
            {
                "n": n,
                "ratio": ratio,
                "shape": _shape(n.shape_ref or n.shape_ours),
                "shape_ours": _shape(n.shape_ours) or "-",
                "shape_ref": _shape(n.shape_ref) or "-",
                "iso": isolated.get(n.name),
                "iso_ratio": tolerance_ratio(isolated[n.name]) if n.name in isolated else None,
            }
        )
    return rows


def _filters(result) -> dict:
    layers = sorted({n.layer for n in result.nodes if n.layer is not None})
    kinds: list[str] = []
    for n in result.nodes:
        if n.kind not in kinds:
            kinds.append(n.kind)
    present = {n.status for n in result.nodes}
    return {
        "statuses": [s for s in STATUSES if s in present] + sorted(present - set(STATUSES)),
        "layers": layers,
        "has_unlayered": any(n.layer is None for n in result.nodes),
        "kinds": kinds,
    }


def _depth_summary(result) -> dict:
    """One sentence for a run where every node agrees (plots of nothing look like a broken page):
    ``exact`` when every error is 0, else the node closest to its tolerance."""
    judged = [n for n in result.nodes if n.judged and tolerance_ratio(n) is not None]
    worst = max(judged, key=cast("Callable[[Any], float]", tolerance_ratio), default=None)  # judged have one
    exact = all(n.max_abs == 0 for n in judged)
    return {
        "exact": exact,
        "worst": worst,
        "ratio": tolerance_ratio(worst) if worst is not None else None,
        "n": len(judged),
    }


def _logits_agree(logits) -> dict | None:
    """``{"kl": largest KL}`` when the output agrees everywhere (the same top-1 and top-k at every
    position, KL at rounding level), where a plot would be flat; else None."""
    if not logits:
        return None
    kl = logits.get("kl") or []
    if (
        logits.get("top1_agreement") == 1
        and logits.get("mean_topk_overlap") == 1
        and kl
        and all(v is not None and math.isfinite(v) and abs(v) < 1e-6 for v in kl)
    ):
        return {"kl": max(kl)}
    return None


def _facts_nowrap(facts: list[dict]) -> list[dict]:
    for f in facts:
        f["nowrap"] = f["key"] in NOWRAP_FACTS
    return facts


def render_html(result) -> str:
    bad = result.first_mismatch
    card = _card(result, bad)
    mode = result.meta.get("mode", "chained")
    depth_summary = _depth_summary(result)
    exact = bad is None and depth_summary["exact"]  # nothing to plot
    decode = result.decode is not None  # steps x layers replaces the layer x kind picture
    separate = mode != "isolated" and result.isolated
    scale = plots.error_scale(list(result.nodes) + list(result.isolated or []))
    return _env.get_template("report.html.j2").render(
        r=result,
        d=result_dict(result),
        bad=bad,
        facts=_facts_nowrap(_facts(result)),
        depth_summary=depth_summary,
        logits_agree=_logits_agree(result.logits),
        card=card,
        heatmap_svg=None
        if exact or decode
        else _svg(plots.depth_heatmap_svg(forward_nodes(result.nodes), bad.index if bad else None, scale)),
        grad_svg=None
        if exact or not any(n.name.startswith("grad/") for n in result.nodes)
        else _svg(plots.depth_heatmap_svg(gradient_nodes(result.nodes), bad.index if bad else None, scale)),
        decode_svg=_svg(plots.decode_heatmap_svg(result.nodes, bad.index if bad else None, scale)) if decode else None,
        depth_svg=None
        if exact
        else _svg(
            plots.depth_line_svg(
                result.nodes,
                result.isolated if separate else None,
                bad.index if bad else None,
                label="isolated" if mode == "isolated" else "chained",
                scale=scale,
            )
        ),
        scale=scale,
        where=_where(result, bad, card),
        rows=_rows(result),
        filters=_filters(result),
        coverage=_coverage(result),
        mode=mode,
        iso_column=bool(separate),
        text=result.text,
        token_rows=token_rows(result.text),
        prompt_kl_svg=_svg(plots.prompt_kl_svg(result.text)) if result.text else None,
    )


#: what a training check appends after the forward's nodes (parity.run.backward): the train-mode logits,
#: the loss, gradients, the optimizer step, causality; the forward's depth picture leaves them out
TRAINING_PREFIXES = ("train/", "grad/", "step/", "causal/")


def forward_nodes(nodes) -> list:
    """The forward's own nodes of a result (without a training check's ``loss`` and prefixed nodes)."""
    return [n for n in nodes if not n.name.startswith(TRAINING_PREFIXES) and n.name != "loss"]


def gradient_nodes(nodes) -> list:
    """The node gradients of a training check (``grad/<node>``; parameter gradients, whose kind names the
    parameter, ``q_proj.weight``, left out): the second depth picture, layers by node kind."""
    return [n for n in nodes if n.name.startswith("grad/") and "." not in n.kind]


def write_html(result, path) -> Path:
    return atomic_write(path, render_html(result))
