"""MLX (mlx-lm) as a runtime parity compares: load a Transformers checkpoint folder with mlx-lm, run
it on a golden trace's inputs and dump every node it computes.

    parity dump mlx TRACE/weights --trace TRACE --out DUMP      # pip install 'parity[mlx]'
    parity compare TRACE --dump DUMP

mlx-lm names its modules as Transformers does (``model.layers.0.self_attn.q_proj``), so each node is
the output of the module of that path (``<path>@input``: its input), read by swapping the module's
class for a subclass whose ``__call__`` records (MLX modules have no hooks); ``q_rot`` and ``k_rot``
are the two calls of the attention's ``rope`` (queries, then keys), ``context`` is the input of
``o_proj`` and ``logits`` what the model returns. mlx-lm computes attention with the fused
``mx.fast.scaled_dot_product_attention``: ``scores`` and ``probs`` do not exist, and the dump says so
(``parity-dump.json``), which makes them ``untapped``. A node whose module mlx-lm does not have (a
tied head: ``embed_tokens.as_linear``) is unavailable too, with that reason.

A padded trace is run one row at a time on the row's real tokens (mlx-lm's forward takes no mask), each
row's tensors put back at its positions. The config is the checkpoint's, as mlx-lm reads it, with
one adjustment said in a note: mlx-lm 0.32 reads ``rope_theta``/``rope_scaling`` and not
Transformers 5's ``rope_parameters`` (without them it runs its default base), so they are passed
from ``rope_parameters``. ``config_changes`` override config fields (what-if runs: a RoPE base, a
window, an eps), each said in a note.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from parity.runtimes.common import Probe, RuntimeMissing, assemble, check_out, probe_of, write_dump
from parity.util.errors import ParityError

#: attention internals a fused kernel does not produce
FUSED = ("scores", "probs")
FUSED_REASON = "mlx-lm's fused attention (mx.fast.scaled_dot_product_attention) computes no scores or probs"


def _mlx():
    try:
        import mlx.core as mx
        import mlx_lm
        from mlx_lm.utils import load_model
    except ImportError as e:
        raise RuntimeMissing(
            f"the MLX adapter needs mlx and mlx-lm ({e.name or e}): pip install 'parity[mlx]' "
            "(on Linux: the CPU wheels, mlx-cpu)"
        ) from None
    return mx, mlx_lm, load_model


def versions() -> str:
    """``mlx-lm X (mlx Y, device)``."""
    mx, mlx_lm, _ = _mlx()
    return f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__}, {mx.default_device()})"


def model_config(config: Mapping, changes: Mapping | None = None) -> tuple[dict, list[str]]:
    """``(fields to give mlx-lm over the checkpoint's config.json, notes)``: ``rope_theta`` and
    ``rope_scaling`` from Transformers 5's ``rope_parameters`` where the config lacks them (per layer
    type: the full-attention layers', said in a note when the types differ), then ``changes``."""
    extra: dict = {}
    notes = []
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping) and "rope_theta" not in config:
        per_type = {k: v for k, v in rope.items() if isinstance(v, Mapping)}
        chosen = rope
        if per_type:
            chosen = per_type.get("full_attention") or next(iter(per_type.values()))
            if len({json.dumps(v, sort_keys=True) for v in per_type.values()}) > 1:
                notes.append(
                    f"the config's RoPE differs per layer type ({', '.join(per_type)}); mlx-lm takes one set: "
                    "the full-attention layers' was given"
                )
        if "rope_theta" in chosen:
            extra["rope_theta"] = chosen["rope_theta"]
        scaling = {k: v for k, v in chosen.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            extra["rope_scaling"] = scaling
        notes.append(
            "mlx-lm reads rope_theta/rope_scaling, not Transformers 5's rope_parameters (it would run its default "
            f"RoPE base): passed {', '.join(f'{k}={v}' for k, v in extra.items()) or 'nothing'} from rope_parameters"
        )
    for key, value in (changes or {}).items():
        extra[key] = value
        notes.append(f"config changed for this run: {key} = {value!r} (the checkpoint says {config.get(key)!r})")
    return extra, notes


class _Recorder:
    """What the patched modules record during one forward: node name -> array, and the attention
    module running (its rope calls are its q_rot, then k_rot)."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.attention: list[str] = []
        self.rope_calls: dict[str, int] = {}


def _patch(module, recorder: _Recorder, output: str | None, input_: str | None, attention: str | None = None):
    """Swap ``module``'s class for a subclass whose ``__call__`` records its output (as node ``output``)
    and its first input (``input_``); ``attention``: the module is an attention block (its rope
    calls are recorded under its path)."""
    base = type(module)
    wanted = {"output": output, "input": input_, "attention": attention}
    existing = getattr(module, "_parity_wanted", None)
    if existing is not None:  # patched already (a node and its input): add to what it records
        for k, v in wanted.items():
            existing[k] = existing[k] or v
        return
    wanted_box = dict(wanted)

    def __call__(self, *args, **kwargs):
        if wanted_box["input"] and args:
            recorder.values[wanted_box["input"]] = args[0]
        if wanted_box["attention"]:
            recorder.attention.append(wanted_box["attention"])
        try:
            result = base.__call__(self, *args, **kwargs)
        finally:
            if wanted_box["attention"]:
                recorder.attention.pop()
        if wanted_box["output"]:
            recorder.values[wanted_box["output"]] = result
        return result

    patched = type(base.__name__, (base,), {"__call__": __call__, "_parity_wanted": wanted_box})
    module.__class__ = patched


def _rope_patch(rope, recorder: _Recorder):
    base = type(rope)
    if getattr(rope, "_parity_rope", False):
        return

    def __call__(self, x, *args, **kwargs):
        result = base.__call__(self, x, *args, **kwargs)
        if recorder.attention:
            path = recorder.attention[-1]
            n = recorder.rope_calls.get(path, 0)
            recorder.rope_calls[path] = n + 1
            if n < 2:
                recorder.values[f"{path}.{'q_rot' if n == 0 else 'k_rot'}"] = result
        return result

    rope.__class__ = type(base.__name__, (base,), {"__call__": __call__, "_parity_rope": True})


def _module_at(model, path: str):
    """The MLX module at a Transformers-style path (``model.layers.0.mlp``), or None."""
    here = model
    for part in path.split("."):
        if isinstance(here, list):
            if not part.isdigit() or int(part) >= len(here):
                return None
            here = here[int(part)]
        elif hasattr(here, "children") and part in here:
            here = here[part]
        else:
            return None
    return here


def install(model, nodes: list[dict]) -> tuple[_Recorder, dict[str, str]]:
    """Patch ``model`` to record the trace's ``nodes``; ``(recorder, unavailable: node -> reason)``."""
    recorder = _Recorder()
    unavailable = {}
    for node in nodes:
        name = node["name"]
        path = node.get("module") or name
        if name == "logits":
            continue
        base, _, suffix = path.rpartition(".")
        if suffix in FUSED and _module_at(model, base) is not None:
            unavailable[name] = FUSED_REASON
            continue
        if suffix in ("q_rot", "k_rot", "context"):
            attention = _module_at(model, base)
            rope = getattr(attention, "rope", None) if attention is not None else None
            o_proj = getattr(attention, "o_proj", None) if attention is not None else None
            if attention is None or (suffix != "context" and rope is None) or (suffix == "context" and o_proj is None):
                unavailable[name] = f"mlx-lm's model has no {'rope' if suffix != 'context' else 'o_proj'} in {base}"
                continue
            _patch(attention, recorder, None, None, attention=base)
            if suffix == "context":
                _patch(o_proj, recorder, None, name)
            else:
                _rope_patch(rope, recorder)
            continue
        module_path, at, argument = path.partition("@")
        module = _module_at(model, module_path)
        if module is None:
            unavailable[name] = f"mlx-lm's model has no module {module_path}"
            continue
        if at and argument != "input":
            unavailable[name] = f"the adapter reads a module's output or input, not its argument {argument!r}"
            continue
        _patch(module, recorder, None if at else name, name if at else None)
    return recorder, unavailable


def run(model_dir, trace, *, config_changes: Mapping | None = None) -> tuple[dict[str, np.ndarray], dict, list[str]]:
    """Load ``model_dir`` with mlx-lm and run it on the trace's inputs: ``(tensors by node name,
    unavailable: node -> reason, notes)``."""
    mx, _, load_model = _mlx()
    model_dir = Path(model_dir).expanduser()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ParityError(f"{model_dir} is not a checkpoint folder (no config.json); a trace's weights/ is one")
    config = json.loads(config_path.read_text())
    extra, notes = model_config(config, config_changes)
    try:
        model, _ = load_model(model_dir, model_config=extra)
    except (ValueError, TypeError, KeyError) as e:
        raise ParityError(f"mlx-lm cannot load {model_dir}: {str(e).splitlines()[0]}") from None
    probe: Probe = probe_of(trace)
    nodes = probe.nodes
    recorder, unavailable = install(model, nodes)
    kinds = {n["name"]: n.get("kind", "") for n in nodes}
    wanted = {n["name"] for n in nodes}
    per_row = []
    rows = probe.rows() if probe.mask is not None else [probe.input_ids]
    for tokens in rows:
        recorder.values.clear()
        recorder.rope_calls.clear()
        ids = mx.array(np.asarray(tokens)[None] if probe.mask is not None else np.asarray(tokens))
        logits = model(ids)
        recorder.values["logits"] = logits
        got = {k: v for k, v in recorder.values.items() if k in wanted}
        mx.eval(list(got.values()))
        per_row.append({k: _numpy(mx, v) for k, v in got.items()})
    tensors = assemble(probe, per_row, kinds)
    if probe.mask is not None:
        notes.append("the padded batch ran one row at a time on its real tokens (mlx-lm's forward takes no mask)")
    return tensors, unavailable, notes


def _numpy(mx, array) -> np.ndarray:
    if array.dtype in (mx.bfloat16,):
        array = array.astype(mx.float32)
    return np.array(array, copy=True)


def dump(model_dir, trace, out, *, config_changes: Mapping | None = None) -> Path:
    """Run ``model_dir`` (a Transformers checkpoint folder; a trace's ``weights/``) with mlx-lm on
    ``trace``'s inputs and write the dump folder ``out`` (``dump.safetensors`` keyed by node name,
    ``parity-dump.json`` naming the runtime, the nodes it cannot produce and notes) for
    ``parity compare TRACE --dump OUT``. Raises ParityError (RuntimeMissing when mlx is not installed)."""
    check_out(out)
    tensors, unavailable, notes = run(model_dir, trace, config_changes=config_changes)
    return write_dump(out, tensors, runtime=versions(), unavailable=unavailable, notes=notes)
