"""``parity record``: run the reference through the stage a check uses and write a golden trace."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from parity.compare.tolerances import Tolerances, default_tolerance
from parity.golden.summaries import (
    DEFAULT_SAMPLE,
    SAMPLE_SEED,
    STATISTICS,
    SummaryTrace,
)
from parity.golden.trace_file import (
    CONFIG,
    DEFAULT_SHARD_BYTES,
    FORMAT,
    INPUTS,
    MANIFEST,
    RULE,
    SEP,
    VERSION,
    WEIGHTS,
    GoldenTrace,
    _sha256,
    dtype_name,
    read_trace,
    recording_versions,
    utc_now,
)
from parity.model.pair import Pair, PairSource
from parity.record.trace import SCALARS
from parity.run.options import CheckOptions
from parity.util.errors import ParityError


def _source(source, n_layers, dtype, seed):
    """``(Reference, family name or None, description, nodes)`` of what to record: a family's node
    map for ``family[:config]``, else the registered family's for that ``model_type`` or the nodes
    found in the reference's modules (:func:`parity.user.reference_nodes.reference_nodes`)."""
    from parity.build.builder import make_reference
    from parity.build.reference import resolve_reference
    from parity.model.registry import get_family
    from parity.user.reference_nodes import reference_nodes

    text = str(source)
    is_path = not isinstance(source, str) or text.endswith(".json") or os.sep in text or "/" in text
    if not is_path:
        name, _, config = text.partition(":")
        family = get_family(name)
        overrides = {"n_layers": n_layers} if n_layers is not None else {}
        ref = make_reference(family, config or None, dtype=dtype, seed=seed, **overrides)
        return ref, family.name, f"{family.name}:{ref.config_name}", family.node_specs(ref.facts)
    if n_layers is not None:
        raise ParityError(
            "the number of layers goes with a family (family:config); a checkpoint or config.json brings its own"
        )
    ref, _ = resolve_reference(source, dtype, seed)
    assert ref.model is not None  # resolve_reference builds the model
    nodes, family_name = reference_nodes(ref.model, ref.facts)
    return ref, family_name, text, nodes


def _plan(pair: Pair, options: CheckOptions, tolerances: Tolerances, summaries: bool):
    """The check's Run for one reference pass (validated inputs, notes), with a memory guard for one
    trace: whole tensors, or one node at a time for summaries."""
    from parity.run.inputs import check_fits, text_inputs
    from parity.run.memory import trace_bytes
    from parity.run.plan import Run, check_patterns, generation_positions, position_notes, run_inputs, window_notes
    from parity.util.resources import require

    check_patterns(pair, options)
    text = text_inputs(options, pair.source.checkpoint)
    text_notes: tuple[str, ...] = ()
    if text is not None:  # every prompt in one batch, padded as the tokenizer pads
        check_fits(text, pair.vocab_size, pair.facts.max_position_embeddings)
        ((rows, ids, given_mask),) = text.batches(len(text.prompts))
        input_ids, mask = run_inputs(
            pair, replace(options, prompts=(), prompt_ids=(), chat=False, batch_size=len(rows)), ids, given_mask
        )
        text_notes = (
            f"inputs: {len(rows)} prompt(s), {text.source}; {text.bos}"
            + (f"; padded on the {text.padding_side} (id {text.pad_id})" if given_mask is not None else ""),
            "tokens: "
            + " | ".join(" ".join(f"{i}:{p!r}" if p else str(i) for i, p in zip(r.ids, r.pieces)) for r in rows),
        )
    else:
        input_ids, mask = run_inputs(pair, options)
    batch, seq = input_ids.shape
    size = torch.finfo(pair.dtype).bits // 8
    facts = pair.facts
    largest = (
        batch
        * seq
        * max(max(facts.num_heads, 1) * seq, facts.vocab_size, facts.intermediate_size or 0, facts.hidden_size)
    )
    needed = 8 * 8 * largest if summaries else trace_bytes(facts, batch, seq, size) // 2
    require(
        needed,
        f"recording {batch} x {seq} tokens",
        "use a shorter --seq-len, a smaller --batch, fewer layers or --summaries",
    )
    return Run(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=generation_positions(mask, batch, seq, pair.facts.position_offset),
        options=options,
        tolerances=tolerances,
        notes=text_notes + tuple(window_notes(pair, seq)) + tuple(position_notes(pair, seq)),
    )


def _config_json(hf_config) -> tuple[str, str]:
    """The config as config.json text, and the sha256 of its canonical form (sorted keys, without
    ``transformers_version``, which the manifest's versions hold)."""
    data = json.loads(hf_config.to_json_string(use_diff=False))
    canonical = {k: v for k, v in data.items() if k != "transformers_version"}
    return json.dumps(data, indent=2, sort_keys=True) + "\n", _sha256(json.dumps(canonical, sort_keys=True).encode())


def _shards(items: list[tuple[str, dict[str, torch.Tensor]]], shard_bytes: int) -> list[list[tuple[str, dict]]]:
    """Nodes grouped into shards of at most ``shard_bytes`` (a node larger than that gets its own)."""
    current: list[tuple[str, dict]]
    shards, current, size = [], [], 0
    for name, tensors in items:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, tensors))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _save(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    out, seen = {}, set()
    for k, v in tensors.items():
        v = v.detach().contiguous()
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        # a trace stores an unchanged tensor recorded under two names once (Gemma 4's shared KV):
        # safetensors writes each name's own bytes
        out[k] = v.clone() if key in seen else v
        seen.add(key)
    return save(out, metadata={"format": "pt", "writer": FORMAT})


def _copy_checkpoint(source: Path, target: Path) -> None:
    """A checkpoint's config.json and safetensors files (an index and its shards), byte for byte."""
    target.mkdir()
    for f in sorted(source.iterdir()):
        if f.name == CONFIG or f.name.endswith(".safetensors") or f.name.endswith(".safetensors.index.json"):
            shutil.copyfile(f, target / f.name)


def _save_pretrained(model, folder: Path) -> None:
    """``save_pretrained`` without its progress bar (the terminal shows parity's own lines)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    except Exception as e:  # safetensors' writer reports an OS error as its own type, with the errno in the text
        match = re.search(r"os error (\d+)", str(e))
        if match is None:
            raise
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), str(folder)) from None
    finally:
        if shown:
            logging.enable_progress_bar()


def _out_folder(out) -> tuple[Path, Path]:
    """``(out, its parent)``, refusing an existing non-empty folder (a trace is never overwritten)."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ParityError(
            f"--out {out} already exists; a trace is written to a new folder (an earlier one is never replaced)"
        )
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParityError(f"--out {out}: its folder cannot be created: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise ParityError(f"--out {out}: {parent} is not writable")
    return out, parent


def record(
    source,
    out: str | Path,
    *,
    n_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    summaries: bool = False,
    sample: int = DEFAULT_SAMPLE,
    save_weights: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    options: CheckOptions | None = None,
    input_ids=None,
    **option_values,
) -> GoldenTrace:
    """Run the reference once and write its golden trace to the new folder ``out``.

    ``source``: ``"family[:config]"`` (the family's reference with parity's seeded probe weights;
    ``n_layers`` its depth), or a checkpoint folder or a config.json (probe weights) as a ``Path``
    (a string is a path when it ends in ``.json`` or holds a ``/``). ``dtype``,
    ``seed``: as :func:`parity.build.build_pair`. ``options`` / option keywords (a
    :class:`parity.CheckOptions`): ``seq_len``, ``batch_size``, ``left_pad`` shape the probe, or
    ``prompts`` / ``prompt_ids`` / ``chat`` give real text instead (every prompt in one batch, padded
    as the tokenizer pads; the tokens fed are the manifest's first notes); ``input_ids``: rows of
    token ids instead (a list of lists of any lengths, or a ``(batch, seq)`` tensor);
    ``atol``/``rtol``/``tolerances``/``calibrate`` are the tolerances the trace carries (default: the
    dtype's; calibration needs whole tensors); a mode or a decode plan is refused. ``summaries``: statistics instead of tensors (``sample`` elements per node).
    ``save_weights``: a copy of the weights in ``out/weights`` for other runtimes. The folder appears
    only when complete. Raises ParityError (bad input, an existing ``out``).
    """
    from parity.build.builder import default_seq_len
    from parity.run.stages import calibrate_tolerances, trace_reference
    from parity.util.files import cannot_write, discard, done, staging_folder

    options = CheckOptions.of(options, **option_values)
    if input_ids is not None:  # rows of token ids (a list of lists, or a (batch, seq) tensor): as prompt_ids
        options = replace(options, prompt_ids=input_ids)
    if options.mode != "chained" or options.decode is not None or options.exact:
        raise ParityError(
            "a trace records the reference alone, once: no mode, decode plan or exact (give those to compare)"
        )
    calibrate = options.calibrate
    if summaries and calibrate:
        raise ParityError(
            "calibration needs whole tensors (a float64 trace beside this one): drop --calibrate or --summaries"
        )
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise ParityError(f"the sample size must be a positive integer, got {sample!r}")
    out, parent = _out_folder(out)
    start = time.perf_counter()
    ref, family, described, nodes = _source(source, n_layers, dtype, seed)
    pair = Pair(
        ours=ref.model,
        reference=ref.model,
        nodes=nodes,
        facts=ref.facts,
        dtype=dtype,
        source=PairSource(
            family=family or ref.facts.model_type,
            config_name=ref.config_name,
            seed=seed,
            checkpoint=ref.checkpoint,
            checkpoint_hash=ref.checkpoint_hash,
        ),
        default_seq_len=default_seq_len(ref.facts),
    )
    tol = options.tolerance_rule(dtype, exact=False)
    run = _plan(pair, options, tol, summaries)
    config_text, config_hash = _config_json(ref.hf_config)
    try:
        staging = staging_folder(parent)
    except OSError as e:
        raise cannot_write(e, f"the trace {out}", parent, _needed(ref, save_weights, None, pair, run)) from None
    trace = None
    try:
        saved = None
        if save_weights:  # before tracing: parity's attention capture is not part of the saved config
            if ref.checkpoint is not None:
                _copy_checkpoint(Path(ref.checkpoint), staging / WEIGHTS)
            else:
                _save_pretrained(ref.model, staging / WEIGHTS)
            saved = WEIGHTS
        kinds = {n.name: n.kind for n in pair.nodes}
        trace = trace_reference(pair, run, into=SummaryTrace(kinds, sample) if summaries else None)
        if calibrate:
            tol = replace(tol, calibrated=calibrate_tolerances(pair, run, trace))
        checkpoint_hash = ref.checkpoint_hash
        if saved and ref.checkpoint is None:
            from parity.build.checkpoint import read_checkpoint

            checkpoint_hash = read_checkpoint(staging / WEIGHTS).content_hash()
        manifest = _manifest(
            pair,
            run,
            ref,
            described,
            family,
            tol,
            trace,
            summaries,
            sample,
            config_hash,
            saved,
            checkpoint_hash,
            time.perf_counter() - start,
        )
        _write(staging, manifest, pair, run, trace, summaries, shard_bytes, config_text)
        try:
            os.rename(staging, out)
        except OSError:
            raise ParityError(f"--out {out} appeared while recording; the trace was not written") from None
        done(staging)
    except OSError as e:  # a full disk or a read-only folder: nothing visible, the space it needed said
        discard(staging)
        raise cannot_write(e, f"the trace {out}", parent, _needed(ref, save_weights, trace, pair, run)) from None
    except BaseException:
        discard(staging)
        raise
    return read_trace(out)


def _needed(ref, save_weights: bool, trace, pair, run) -> int:
    """Bytes a trace folder needs: the weights when saved, the node tensors (as recorded, or the
    memory model's estimate before they are), and a MiB for the inputs, config and manifest."""
    from parity.run.memory import one_trace_bytes

    weights = 0
    if save_weights:
        if ref.checkpoint is not None:
            weights = sum(f.stat().st_size for f in Path(ref.checkpoint).glob("*.safetensors"))
        else:
            weights = sum(t.numel() * t.element_size() for t in ref.state_dict.values())
    if trace is not None and not hasattr(trace, "summaries"):
        store = trace.tensors
        nodes = sum(
            t.numel() * t.dtype.itemsize for t in (store.lazy(n) if hasattr(store, "lazy") else store[n] for n in store)
        )
    elif trace is not None:
        nodes = 0
    else:
        element = torch.empty((), dtype=pair.dtype).element_size()
        nodes = one_trace_bytes(pair.facts, int(run.input_ids.shape[0]), int(run.input_ids.shape[1]), element)
    return weights + nodes + (1 << 20)


def _manifest(
    pair,
    run,
    ref,
    described,
    family,
    tol: Tolerances,
    trace,
    summaries,
    sample,
    config_hash,
    saved,
    checkpoint_hash,
    seconds,
) -> dict:
    specs = {n.name: n for n in pair.nodes}
    order = trace.order
    nodes = []
    for index, name in enumerate(order):
        spec = specs[name]
        atol, rtol, source = tol.for_node(name)
        entry = {"name": name, "index": index, "layer": spec.layer, "kind": spec.kind, "module": spec.reference_path}
        if summaries:
            s = trace.summaries[name]
            entry.update(
                shape=list(s.shape),
                dtype=s.dtype,
                stats={k: (v if isinstance(v, int) or math.isfinite(v) else None) for k, v in s.stats.items()},
            )
        else:
            t = trace.tensors[name]
            entry.update(shape=list(t.shape), dtype=dtype_name(t.dtype))
            kept = [part for part in DIAGNOSIS_PARTS if f"{name}{SEP}{part}" in _diagnosis_tensors(trace, name)]
            if kept:
                entry["diagnosis"] = kept
        entry.update(atol=atol, rtol=rtol, tol_source=source)
        nodes.append(entry)
    unrecorded = [
        {"name": n.name, "layer": n.layer, "kind": n.kind, "module": n.reference_path}
        for n in pair.nodes
        if n.name not in set(order)
    ]
    default = default_tolerance(pair.dtype)
    inputs = {"input_ids": run.input_ids, "position_ids": run.position_ids}
    if run.attention_mask is not None:
        inputs["attention_mask"] = run.attention_mask
    random = ref.checkpoint is None
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "summaries" if summaries else "tensors",
        "created": utc_now(),
        "seconds": round(seconds, 3),
        "versions": recording_versions(),
        "reference": {
            "family": family,
            "model_type": pair.facts.model_type,
            "class": type(ref.model).__name__,
            "config_name": ref.config_name,
            "source": str(described),
            "config_file": CONFIG,
            "config_sha256": config_hash,
            "layer_prefix": pair.facts.layer_prefix,
        },
        "weights": {
            "source": "random" if random else "checkpoint",
            "seed": pair.source.seed if random else None,
            "description": "parity's seeded probe weights (parity.build.probes), regenerated from the config and the seed"
            if random
            else "the checkpoint's safetensors, cast to the probe dtype",
            "checkpoint": None if random else str(Path(ref.checkpoint).resolve()),
            "checkpoint_sha256": checkpoint_hash,
            "saved": saved,
        },
        "probe": {
            "dtype": dtype_name(pair.dtype),
            "batch_size": int(run.input_ids.shape[0]),
            "seq_len": int(run.input_ids.shape[1]),
            "left_pad": [int(n) for n in (run.attention_mask == 0).sum(1)] if run.attention_mask is not None else None,
            "seed": pair.source.seed,
            "tokens": "torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))",
        },
        "inputs": {
            "file": INPUTS,
            "tensors": {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in inputs.items()},
        },
        "tolerances": {
            "rule": RULE,
            "dtype": dtype_name(pair.dtype),
            "default": list(default),
            "atol": tol.atol,
            "rtol": tol.rtol,
            "exact": tol.exact,
            "per_node": {k: list(v) for k, v in tol.per_node.items()},
            "calibrated": tol.calibrated is not None,
            "calibrated_nodes": {k: list(v) for k, v in tol.calibrated.items()} if tol.calibrated is not None else None,
        },
        "summaries": {
            "sample_size": sample,
            "sample_seed": SAMPLE_SEED,
            "statistics": list(STATISTICS),
            "keys": {
                "sample": f"<node>{SEP}sample",
                "sample_index": f"<node>{SEP}sample_index",
                "position_norm": f"<node>{SEP}position_norm",
            },
        }
        if summaries
        else None,
        "nodes": nodes,
        "unrecorded": unrecorded,
        "files": [],
        "notes": list(run.notes),
        "reference_scalars": dict(trace.extras.get(SCALARS, {})),
    }


#: what the hint detectors read beside a node, stored with it (see trace.schema.json "diagnosis")
DIAGNOSIS_PARTS = ("input", "weight", "bias")


def _diagnosis_tensors(trace, name: str) -> dict[str, torch.Tensor]:
    """``{<node>::input, ::weight, ::bias}`` the trace kept for diagnosing ``name`` (norms, projections):
    ``parity compare`` gives the same hints as ``check`` with them."""
    held = {"input": trace.inputs.get(name), "weight": trace.weights.get(name), "bias": trace.biases.get(name)}
    return {f"{name}{SEP}{part}": t.detach().contiguous() for part, t in held.items() if t is not None}


def _write(
    staging: Path, manifest: dict, pair, run, trace, summaries: bool, shard_bytes: int, config_text: str
) -> None:
    files = []

    def put(name: str, data: bytes) -> None:
        (staging / name).write_bytes(data)
        files.append({"name": name, "bytes": len(data), "sha256": _sha256(data)})

    inputs = {"input_ids": run.input_ids, "position_ids": run.position_ids}
    if run.attention_mask is not None:
        inputs["attention_mask"] = run.attention_mask.long()
    put(INPUTS, _save({k: v.long() for k, v in inputs.items()}))
    put(CONFIG, config_text.encode())
    items = []
    for entry in manifest["nodes"]:
        name = entry["name"]
        if summaries:
            s = trace.summaries[name]
            small = s.sample_index.numel() == 0 or int(s.sample_index.max()) < 2**31
            index = s.sample_index.to(torch.int32 if small else torch.int64)
            tensors = {f"{name}{SEP}sample": s.sample, f"{name}{SEP}sample_index": index}
            if s.position_norm is not None:
                tensors[f"{name}{SEP}position_norm"] = s.position_norm
        else:
            tensors = {name: trace.tensors[name], **_diagnosis_tensors(trace, name)}
        items.append((name, tensors))
    shards = _shards(items, shard_bytes)
    for i, shard in enumerate(shards, 1):
        file = f"nodes-{i:05d}-of-{len(shards):05d}.safetensors"
        put(file, _save({k: v for _, tensors in shard for k, v in tensors.items()}))
        for name, _ in shard:
            next(e for e in manifest["nodes"] if e["name"] == name)["file"] = file
    manifest["files"] = files
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n", encoding="utf-8")
