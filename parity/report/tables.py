"""nodes.csv and result.json.

nodes.csv columns, in this order (stable; new columns are only ever appended):

=========  ==============================================================
order      position in the reference's execution order (0-based)
name       canonical node name (Transformers module path, ``@input``, attention suffix)
layer      decoder layer index, empty for embed/norm/head
kind       node kind without the layer prefix (``q_proj``, ``probs``, ``layer``...)
status     ok | mismatch | choice | shape | missing | nonfinite | untapped
shape_ours / shape_ref   shapes as ``AxBxC``
dtype      reference tensor dtype
max_abs, mean_abs        max and mean of ``|ours - ref|``
max_rel    max of ``|ours - ref| / |ref|`` over ``ref != 0``
cosine     cosine similarity of the flattened tensors
atol, rtol tolerance the node was judged with
hint       likely cause (first failing node only)
detail     why a node could not be compared, or where non-finite values are
rel_l2     ``||ours - ref|| / ||ref||``
atol_needed / rtol_needed   smallest atol (at this rtol) / rtol (at this atol) that would pass
tol_source where atol/rtol came from: default:<dtype>, run, pattern:<glob>, calibrated, exact
hint_kind  the hint's kind (see parity.diagnose.hints.KINDS), empty without a hint
=========  ==============================================================

Empty cells: a metric that does not exist for the node (missing, shape mismatch, all non-finite).

result.json is ``result_dict``: ``version`` (:data:`RESULT_VERSION`), ``passed``, ``verdict``,
``first_mismatch``, ``meta`` (the run: family, config, checkpoint and its sha256, dtype, sizes,
seed, mode, tolerances, torch/transformers versions, time), ``notes``, ``counts`` (nodes per
status), ``nodes`` (NodeResult fields; ``index`` is the CSV's ``order``, shapes are lists),
``isolated``, ``profile`` and ``logits`` (see :mod:`parity.diagnose.profile`), ``coverage`` (what the
loader did with the checkpoint, see :mod:`parity.build.coverage`; null without a checkpoint), and
for a check over real prompts only, ``text`` (:mod:`parity.run.prompt_set`; its per-prompt rows are
also ``prompts.csv``, :data:`PROMPT_COLUMNS`). It is strict JSON: a
non-finite number (an infinite ``rtol_needed``, an error profile entry at a NaN) is written as
``null``. ``result.schema.json`` next to this module is its JSON Schema (:func:`result_schema`).
"""

from __future__ import annotations

import json
import math
import numbers
from importlib import resources
from pathlib import Path

import pandas as pd

from parity.util.files import atomic_write

COLUMNS = [
    "order",
    "name",
    "layer",
    "kind",
    "status",
    "shape_ours",
    "shape_ref",
    "dtype",
    "max_abs",
    "mean_abs",
    "max_rel",
    "cosine",
    "atol",
    "rtol",
    "hint",
    "detail",
    "rel_l2",
    "atol_needed",
    "rtol_needed",
    "tol_source",
    "hint_kind",
]
RESULT_VERSION = 2
SCHEMA_FILE = "result.schema.json"


def result_schema() -> dict:
    """The JSON Schema (draft 2020-12) that every result.json of :data:`RESULT_VERSION` satisfies."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def tolerance_ratio(node) -> float | None:
    """How far a node is from its tolerance: ``max_abs / (atol + rtol * |ref|)``, with ``|ref|`` taken
    at the element that needs the largest atol (``atol_needed = max(|ours - ref| - rtol * |ref|)``).

    Above 1 exactly when the node fails the ``|ours - ref| <= atol + rtol * |ref|`` rule (and equal
    to the worst element's ratio when that element is also the one with the largest error); 0 for
    an exact match; None when the node has no metrics (missing, shape mismatch, all non-finite).
    """
    max_abs = node.max_abs
    if max_abs is None or not math.isfinite(max_abs):
        return None
    needed = node.atol_needed
    if needed is None or not math.isfinite(needed):
        tolerance = node.atol
    else:
        tolerance = node.atol + max(0.0, max_abs - needed)
    if tolerance <= 0:
        return 0.0 if max_abs == 0 else math.inf
    return max_abs / tolerance


def _shape(s) -> str:
    return "x".join(str(d) for d in s) if s is not None else ""


def nodes_frame(result) -> pd.DataFrame:
    rows = []
    for r in result.nodes:
        d = r.to_dict()
        d["order"] = d.pop("index")
        d["shape_ours"], d["shape_ref"] = _shape(r.shape_ours), _shape(r.shape_ref)
        rows.append(d)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["layer"] = frame["layer"].astype("Int64")
    return frame


#: prompts.csv columns (a check over real prompts only; one row per prompt)
PROMPT_COLUMNS = [
    "prompt",
    "batch",
    "row",
    "tokens",
    "passed",
    "first_mismatch",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "top5_agreement",
    "noise_kl_mean",
    "text",
    "ids",
    "pieces",
]


def prompts_frame(result) -> pd.DataFrame | None:
    """One row per prompt of a check over real prompts (``result.text``), or None: the columns of
    :data:`PROMPT_COLUMNS`; ``ids`` space-separated, ``pieces`` a JSON list."""
    text = getattr(result, "text", None)
    if not text:
        return None
    rows = [
        {
            **{k: p.get(k) for k in PROMPT_COLUMNS if k not in ("prompt", "ids", "pieces")},
            "prompt": p["index"],
            "ids": " ".join(map(str, p["ids"])),
            "pieces": json.dumps(p["pieces"], ensure_ascii=False),
        }
        for p in text["prompts"]
    ]
    return pd.DataFrame(rows, columns=PROMPT_COLUMNS)


def write_csv(result, path) -> Path:
    """nodes.csv; with a prompt set, prompts.csv beside it (:func:`prompts_frame`)."""
    prompts = prompts_frame(result)
    if prompts is not None:
        atomic_write(Path(path).with_name("prompts.csv"), prompts.to_csv(index=False))
    return atomic_write(path, nodes_frame(result).to_csv(index=False))


def _clean(value):
    """JSON-ready copy: non-finite floats become None, tuples become lists, all the way down."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return str(value)


def result_dict(result) -> dict:
    """The content of result.json (see the module docstring and result.schema.json)."""
    bad = result.first_mismatch
    return _clean(
        {
            "version": RESULT_VERSION,
            "passed": result.passed,
            "verdict": result.verdict(),
            "first_mismatch": bad.to_dict() if bad is not None else None,
            "first_divergence": result.first_divergence.to_dict() if result.first_divergence is not None else None,
            "origin": result.origin.to_dict() if result.origin is not None else None,
            "origin_reason": result.origin_reason,
            "meta": result.meta,
            "notes": result.notes,
            "counts": dict(sorted(result.counts.items())),
            "nodes": [r.to_dict() for r in result.nodes],
            "isolated": [r.to_dict() for r in result.isolated] if result.isolated is not None else None,
            "profile": result.profile,
            "logits": result.logits,
            "coverage": _coverage(result),
        }
        | ({"text": result.text} if getattr(result, "text", None) is not None else {})
    )


def _coverage(result) -> dict | None:
    coverage = getattr(result, "coverage", None)
    return coverage.to_dict() if coverage is not None else None


def write_json(result, path) -> Path:
    return atomic_write(path, json.dumps(result_dict(result), indent=2, allow_nan=False) + "\n")
