"""``parity trace show TRACE``: what a dump must match, read from a trace: its nodes in the reference's
order with their shapes, the layout each axis has (``(batch, heads, seq, head_dim)``), dtypes and
tolerances, the inputs to feed the runtime, and what the recording was."""

from __future__ import annotations

from parity.diagnose.profile import HEAD_MAJOR
from parity.golden.trace_file import GoldenTrace, read_trace

#: the kinds whose last axis is the query heads' features, the key/value heads', or the MLP's
_QUERY_WIDE = {"q_proj", "q_norm", "context", "gate"}
_KV_WIDE = {"k_proj", "v_proj", "k_norm"}
_MLP_WIDE = {"gate_proj", "up_proj", "mlp.gate_proj", "mlp.up_proj", "down_proj@input", "mlp.down_proj@input"}


def axis_names(shape: list[int] | tuple[int, ...], kind: str, sizes: dict[str, int]) -> list[str]:
    """A name for each axis of a node's shape (``batch``, ``seq``, ``heads``, ``kv_heads``,
    ``head_dim``, ``hidden``, ``vocab``, ``intermediate``, ``heads*head_dim``...), or the size itself
    where nothing fits."""
    batch, seq = sizes["batch"], sizes["seq"]
    names = [str(d) for d in shape]
    if not shape:
        return names
    if shape[0] == batch:
        names[0] = "batch"
    last_kind = kind.rsplit(".", 1)[-1]
    if last_kind in HEAD_MAJOR and len(shape) == 4:
        heads = {sizes["heads"]: "heads", sizes["kv_heads"]: "kv_heads"}
        if last_kind == "k_rot":
            heads[sizes["kv_heads"]] = "kv_heads"
        elif shape[1] == sizes["heads"]:
            heads[sizes["heads"]] = "heads"
        names[1] = heads.get(shape[1], names[1])
        names[2] = "seq" if shape[2] == seq else names[2]
        names[3] = "seq" if last_kind in ("scores", "probs") and shape[3] == seq else names[3]
        if last_kind in ("q_rot", "k_rot") and shape[3] == sizes["head_dim"]:
            names[3] = "head_dim"
        return names
    if len(shape) >= 2 and shape[1] == seq:
        names[1] = "seq"
    if len(shape) >= 3:
        width = shape[-1]
        preferred = []
        if last_kind in _QUERY_WIDE:
            preferred.append(("heads*head_dim", sizes["heads"] * sizes["head_dim"]))
        if last_kind in _KV_WIDE:
            preferred.append(("kv_heads*head_dim", sizes["kv_heads"] * sizes["head_dim"]))
        if kind in _MLP_WIDE or last_kind in _MLP_WIDE:
            preferred.append(("intermediate", sizes.get("intermediate", -1)))
        preferred += [
            ("hidden", sizes["hidden"]),
            ("vocab", sizes["vocab"]),
            ("intermediate", sizes.get("intermediate", -1)),
            ("heads*head_dim", sizes["heads"] * sizes["head_dim"]),
            ("kv_heads*head_dim", sizes["kv_heads"] * sizes["head_dim"]),
        ]
        names[-1] = next((n for n, size in preferred if size == width), names[-1])
    return names


def describe(trace) -> dict:
    """What a dump of this trace must hold: ``{"trace", "reference", "probe", "inputs", "tolerances",
    "nodes": [{name, layer, kind, shape, layout, dtype, atol, rtol, tol_source}], "unrecorded"}``."""
    trace = trace if isinstance(trace, GoldenTrace) else read_trace(trace)
    m = trace.manifest
    facts, probe = trace.facts(), m["probe"]
    nodes = []
    for n in trace.node_entries:
        layer = facts.layer(n.get("layer"))
        sizes = {
            "batch": int(probe["batch_size"]),
            "seq": int(probe["seq_len"]),
            "heads": facts.num_heads,
            "kv_heads": layer.num_kv_heads if layer is not None else facts.num_kv_heads,
            "head_dim": layer.head_dim if layer is not None else facts.head_dim,
            "hidden": facts.hidden_size,
            "vocab": facts.vocab_size,
            "intermediate": facts.intermediate_size or -1,
        }
        kind = n.get("kind") or ""
        nodes.append(
            {
                "name": n["name"],
                "layer": n.get("layer"),
                "kind": kind,
                "shape": list(n["shape"]),
                "layout": "(" + ", ".join(axis_names(n["shape"], kind, sizes)) + ")",
                "dtype": n.get("dtype"),
                "atol": n.get("atol"),
                "rtol": n.get("rtol"),
                "tol_source": n.get("tol_source"),
            }
        )
    t = m["tolerances"]
    return {
        "trace": str(trace.path),
        "kind": m["kind"],
        "versions": {k: m["versions"].get(k) for k in ("torch", "transformers", "parity")},
        "reference": {k: m["reference"].get(k) for k in ("family", "model_type", "class", "source")},
        "weights": {k: m["weights"].get(k) for k in ("source", "seed", "checkpoint", "saved")},
        "probe": {k: probe.get(k) for k in ("dtype", "batch_size", "seq_len", "left_pad", "seed")},
        "inputs": m["inputs"].get("tensors", {}),
        "tolerances": {
            "rule": t.get("rule"),
            "calibrated": t.get("calibrated"),
            "default": t.get("default"),
            "atol": t.get("atol"),
            "rtol": t.get("rtol"),
        },
        "nodes": nodes,
        "unrecorded": [u["name"] for u in m.get("unrecorded", [])],
    }
