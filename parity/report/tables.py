"""nodes.csv and result.json.

nodes.csv columns, in this order (stable; new columns are only ever appended):

=========  ==============================================================
order      position in the reference's execution order (0-based)
name       canonical node name (Transformers module path, ``@input``, attention suffix)
layer      decoder layer index, empty for embed/norm/head
kind       node kind without the layer prefix (``q_proj``, ``probs``, ``layer``...)
status     ok | mismatch | shape | missing | nonfinite
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
tol_source where atol/rtol came from: default:<dtype>, run, pattern:<glob>, calibrated
=========  ==============================================================
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from .atomic import atomic_write

COLUMNS = [
    "order", "name", "layer", "kind", "status", "shape_ours", "shape_ref", "dtype",
    "max_abs", "mean_abs", "max_rel", "cosine", "atol", "rtol", "hint", "detail",
    "rel_l2", "atol_needed", "rtol_needed", "tol_source",
]
RESULT_VERSION = 1


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


def write_csv(result, path) -> Path:
    return atomic_write(path, nodes_frame(result).to_csv(index=False))


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def result_dict(result) -> dict:
    bad = result.first_mismatch
    return {
        "version": RESULT_VERSION,
        "passed": result.passed,
        "verdict": result.verdict(),
        "first_mismatch": bad.to_dict() if bad is not None else None,
        "meta": result.meta,
        "notes": result.notes,
        "counts": {s: sum(r.status == s for r in result.nodes) for s in sorted({r.status for r in result.nodes})},
        "nodes": [{k: _clean(v) for k, v in r.to_dict().items()} for r in result.nodes],
        "isolated": (
            [{k: _clean(v) for k, v in r.to_dict().items()} for r in result.isolated]
            if result.isolated is not None
            else None
        ),
        "profile": result.profile,
        "logits": result.logits,
    }


def write_json(result, path) -> Path:
    return atomic_write(path, json.dumps(result_dict(result), indent=2, default=str) + "\n")
