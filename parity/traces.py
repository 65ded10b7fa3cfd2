"""Golden traces: the reference's nodes recorded once, as files; any runtime's dump compared with them.

    parity record llama3:tiny --out golden/                      # run the reference, write the trace
    parity compare golden/ --dump my_runtime_dump/               # a dump of another runtime
    parity compare golden/ --ours mymodel.py:build               # a live PyTorch model (aligned by weights)
    parity record --verify golden/                               # do the installed versions still reproduce it?

A comparison against a trace gives what ``parity check`` gives (the same metrics, hints, reports and
exit codes), because it goes through the same stages: :func:`parity.check.trace_reference` recorded
the trace, :func:`parity.check.compare_run` (:func:`parity.compare.compare_traces` and
:func:`parity.diagnose.diagnose`) and :func:`parity.check.analyse` judge it, and the result is a
:class:`~parity.result.CheckResult` with its writers. What a dump cannot give: isolated mode (each
node of ours continuing from the reference's tensor needs a runtime that parity drives) and loader
coverage (parity never sees the runtime's weights).

The trace format (version :data:`VERSION`; JSON Schema ``parity/traces.schema.json``), readable
without parity (JSON and safetensors):

``manifest.json``
    ``format`` ("parity-trace"), ``version``, ``kind`` (``tensors`` or ``summaries``), ``created``;
    ``versions`` (torch, Transformers, parity, safetensors, Python that recorded it); ``reference``
    (family, ``model_type``, Transformers class, config name, where it came from, ``config.json`` and
    its sha256, the module path of the layers); ``weights`` (``random``: parity's seeded probe weights
    from ``seed``, or ``checkpoint``: its path and sha256; ``saved``: the folder in the trace holding
    them, with ``--save-weights``); ``probe`` (dtype, batch, sequence length, left padding, seed);
    ``inputs`` (tensors of ``inputs.safetensors``); ``tolerances`` (the rule, the dtype's default,
    run-wide and per-pattern overrides, calibration); ``summaries`` (summaries only: sample size and
    seed, statistics, key suffixes); ``nodes`` in the reference's execution order (name, index, layer,
    kind, the reference's module path, shape, dtype, the file holding it, its atol/rtol; summaries:
    its statistics); ``unrecorded`` (nodes the reference never produced); ``files`` (name, bytes,
    sha256 of every other file); ``notes``.
``inputs.safetensors``
    ``input_ids`` (int64, ``(batch, seq)``), ``position_ids`` (int64, ``(batch, seq)``) and, when
    padded, ``attention_mask`` (int64, 1 = real token).
``nodes-00001-of-0000N.safetensors``
    ``tensors``: one tensor per node, the key is the node name, in the recording dtype; shards are cut
    at ``--shard-size``. ``summaries``: per node ``<name>::sample`` (the sampled elements, recording
    dtype), ``<name>::sample_index`` (their flat indices; int32 below 2^31 elements, else int64) and
    ``<name>::position_norm`` (float64 ``(batch, seq)``: the L2 norm of each token position's
    elements; absent below 2 axes).
``config.json``
    the reference's Transformers config.
``weights/`` (``--save-weights``)
    a Transformers checkpoint folder (``config.json``, safetensors) holding the weights the trace was
    recorded with, for a runtime to load.

Summaries (``--summaries``, :mod:`parity.summaries`, which says what can and cannot be concluded
from them) keep statistics, a seeded sample and per-position norms instead of each tensor. A dump
is read by :mod:`parity.dumps` (``.safetensors`` keyed by node, ``.npy`` named by node, name maps).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .compare import MISSING, NodeResult, Tolerances, compare_node, default_tolerance
from .dumps import NameRule, map_dump, read_dump, read_name_map
from .errors import ParityError
from .hints import Hint
from .pair import NodeSpec, Pair
from .result import CheckResult
from .summaries import DEFAULT_SAMPLE, SAMPLE_SEED, STATISTICS, Summary, SummaryTrace, compare_summary, summarise
from .trace import Trace

FORMAT = "parity-trace"
#: the trace format version this parity writes and reads (a newer one is refused with a message)
VERSION = 1
MANIFEST, INPUTS, CONFIG, WEIGHTS = "manifest.json", "inputs.safetensors", "config.json", "weights"
SCHEMA_FILE = "traces.schema.json"
KINDS = ("tensors", "summaries")
DEFAULT_SHARD_BYTES = 1 << 30
#: between a node name and the part of its summary a key holds (``model.norm::sample``)
SEP = "::"
#: the element rule every tolerance means
RULE = "|ours - ref| <= atol + rtol * |ref|, element by element"


def trace_schema() -> dict:
    """The JSON Schema (draft 2020-12) every manifest.json of :data:`VERSION` satisfies."""
    from importlib import resources

    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _versions() -> dict:
    import platform

    import safetensors

    from . import __version__
    from .check import versions

    return {**versions(), "parity": __version__, "safetensors": safetensors.__version__, "python": platform.python_version()}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --- reading a trace ---------------------------------------------------------------------------------


class TraceError(ParityError):
    """A trace folder that cannot be read: missing, corrupt, or of an unknown format version."""


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise TraceError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{what} {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno}") from None


#: manifest keys a reader needs, with their JSON types
_REQUIRED = {
    "format": str, "version": int, "kind": str, "versions": dict, "reference": dict, "weights": dict, "probe": dict,
    "inputs": dict, "tolerances": dict, "nodes": list, "files": list,
}


def _check_manifest(m, path: Path) -> dict:
    where = path / MANIFEST
    if not isinstance(m, dict):
        raise TraceError(f"{where} is not a JSON object")
    if m.get("format") != FORMAT:
        raise TraceError(f"{where} is not a parity trace (format {m.get('format')!r}, expected {FORMAT!r})")
    version = m.get("version")
    if isinstance(version, int) and version > VERSION:
        raise TraceError(f"{where} has trace format version {version}, newer than this parity reads ({VERSION}): upgrade parity")
    if version != VERSION:
        raise TraceError(f"{where} has an invalid trace format version {version!r} (this parity reads {VERSION})")
    for key, kind in _REQUIRED.items():
        if not isinstance(m.get(key), kind):
            raise TraceError(f"{where} lacks {key!r} (or it is not a JSON {kind.__name__})")
    if m["kind"] not in KINDS:
        raise TraceError(f"{where} has kind {m['kind']!r}; expected one of {', '.join(KINDS)}")
    for i, node in enumerate(m["nodes"]):
        if not (isinstance(node, dict) and isinstance(node.get("name"), str) and isinstance(node.get("shape"), list)
                and isinstance(node.get("file"), str)):
            raise TraceError(f"{where}: nodes[{i}] needs a name, a shape and a file")
    for entry in m["files"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("sha256"), str)):
            raise TraceError(f"{where}: every files entry needs a name and a sha256")
        name = entry["name"]
        if "/" in name or "\\" in name or name.startswith("."):
            raise TraceError(f"{where}: file {name!r} lies outside the trace folder")
        if not (path / name).is_file():
            raise TraceError(f"{where} lists {name}, which is not in {path}")
    return m


@dataclass
class GoldenTrace:
    """A trace folder, read: its manifest, and its files loaded on demand (each checked against
    the sha256 the manifest holds)."""

    path: Path
    manifest: dict
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest["probe"]["dtype"])

    @property
    def node_entries(self) -> list[dict]:
        return self.manifest["nodes"]

    @property
    def names(self) -> list[str]:
        return [n["name"] for n in self.node_entries]

    def node_specs(self, ours: Mapping[str, str] | None = None) -> list[NodeSpec]:
        """NodeSpecs of every node (recorded ones in order, then the unrecorded); ``ours``: node ->
        the name ours holds it under (a dump's key), for messages."""
        ours = ours or {}
        entries = [(n["name"], n.get("module"), n.get("layer"), n.get("kind", "")) for n in self.node_entries]
        entries += [(u["name"], u.get("module"), u.get("layer"), u.get("kind", "")) for u in self.manifest.get("unrecorded", [])]
        return [NodeSpec(name, ours.get(name, name), reference=module if module != name else None, layer=layer, kind=kind or "")
                for name, module, layer, kind in entries]

    def _file(self, name: str) -> bytes:
        entry = next((f for f in self.manifest["files"] if f["name"] == name), None)
        if entry is None:
            raise TraceError(f"{self.path / MANIFEST} does not list {name}")
        data = (self.path / name).read_bytes()
        if _sha256(data) != entry["sha256"]:
            raise TraceError(f"{self.path / name} does not match the sha256 in {MANIFEST}: the file changed or is corrupt")
        return data

    def _tensors(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._cache:
            from safetensors import SafetensorError
            from safetensors.torch import load

            try:
                self._cache[name] = load(self._file(name))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise TraceError(f"{self.path / name} is corrupt: {str(e).splitlines()[0]}") from None
        return self._cache[name]

    def inputs(self) -> dict[str, torch.Tensor]:
        """``input_ids``, ``position_ids`` and (padded runs) ``attention_mask``."""
        tensors = self._tensors(self.manifest["inputs"].get("file", INPUTS))
        if "input_ids" not in tensors or "position_ids" not in tensors:
            raise TraceError(f"{self.path / INPUTS} lacks input_ids or position_ids")
        return tensors

    def reference_trace(self) -> Trace:
        """The recorded tensors as a Trace, in execution order (a ``tensors`` trace)."""
        if self.kind != "tensors":
            raise TraceError(f"{self.path} holds summaries, not tensors")
        trace = Trace()
        for node in self.node_entries:
            tensors = self._tensors(node["file"])
            tensor = tensors.get(node["name"])
            if tensor is None:
                raise TraceError(f"{self.path / node['file']} lacks node {node['name']}")
            if list(tensor.shape) != list(node["shape"]):
                raise TraceError(f"{self.path / node['file']} holds node {node['name']} as {tuple(tensor.shape)}, "
                                 f"{MANIFEST} says {tuple(node['shape'])}")
            trace.tensors[node["name"]] = tensor
        trace.wanted = frozenset(trace.tensors)
        return trace

    def summaries(self) -> dict[str, Summary]:
        """Every node's :class:`Summary` (a ``summaries`` trace)."""
        if self.kind != "summaries":
            raise TraceError(f"{self.path} holds whole tensors, not summaries")
        out = {}
        for node in self.node_entries:
            tensors, name = self._tensors(node["file"]), node["name"]
            sample, index = tensors.get(f"{name}{SEP}sample"), tensors.get(f"{name}{SEP}sample_index")
            if sample is None or index is None or not isinstance(node.get("stats"), dict):
                raise TraceError(f"{self.path / node['file']} lacks the sample of node {name} (or {MANIFEST} its stats)")
            index = index.long()
            numel = math.prod(node["shape"])
            fits = index.dim() == 1 and index.shape == sample.shape
            if not fits or (index.numel() and not 0 <= int(index.min()) <= int(index.max()) < numel):
                raise TraceError(f"{self.path / node['file']}: the sample of node {name} does not fit its shape "
                                 f"{tuple(node['shape'])}")
            stats = {k: (math.nan if v is None else v) for k, v in node["stats"].items()}
            out[name] = Summary(tuple(node["shape"]), node.get("dtype", ""), stats, index, sample,
                                tensors.get(f"{name}{SEP}position_norm"))
        return out

    def hf_config(self):
        """The reference's Transformers config, from the trace's config.json."""
        from .user_model import _config_from_dict

        raw = _read_json(self.path / self.manifest["reference"].get("config_file", CONFIG), "config")
        if not isinstance(raw, dict):
            raise TraceError(f"{self.path / CONFIG} is not a JSON object")
        return _config_from_dict(raw, str(self.path / CONFIG))

    def facts(self):
        """ArchFacts of the reference (hints and reports read them), from its config."""
        if "facts" not in self._cache:
            from .facts import derive_facts

            facts = derive_facts(self.hf_config())
            prefix = self.manifest["reference"].get("layer_prefix")
            self._cache["facts"] = replace(facts, layer_prefix=prefix) if prefix else facts
        return self._cache["facts"]

    def tolerances(self, atol: float | None = None, rtol: float | None = None, exact: bool = False) -> Tolerances:
        """The trace's tolerances; ``atol``/``rtol`` replace its run-wide and calibrated values (its
        per-pattern ones stay), ``exact`` makes every node 0/0 but those patterns."""
        t = self.manifest["tolerances"]
        calibrated = t.get("calibrated_nodes") if atol is None and rtol is None else None
        return Tolerances(
            self.dtype,
            atol if atol is not None or rtol is not None else t.get("atol"),
            rtol if atol is not None or rtol is not None else t.get("rtol"),
            {k: tuple(v) for k, v in (t.get("per_node") or {}).items()},
            {k: tuple(v) for k, v in calibrated.items()} if calibrated else None,
            exact=bool(exact or t.get("exact")),
        )

    def stale(self) -> list[tuple[str, str, str]]:
        """``(package, recorded, installed)`` for torch and Transformers where they differ."""
        from .check import versions

        recorded, now = self.manifest["versions"], versions()
        return [(k, str(recorded.get(k)), now[k]) for k in ("torch", "transformers") if recorded.get(k) != now[k]]

    def stale_note(self, verifying: bool = False) -> str | None:
        """One line naming the versions that differ (None when none does); ``verifying``: said by the
        run that re-runs the reference."""
        diffs = self.stale()
        if not diffs:
            return None
        what = ", ".join(f"{k} {a} (installed: {b})" for k, a, b in diffs)
        then = ("this run re-runs it with the installed versions" if verifying else
                f"`parity record --verify {self.path}` re-runs it and says whether it still reproduces")
        return (f"stale reference: this trace was recorded with {what}; the installed versions may compute the "
                f"reference differently; {then}")

    def rebuild_reference(self, checkpoint: str | Path | None = None):
        """The Transformers model the trace was recorded from, with the same weights: regenerated from
        its config and seed (random weights), or read from the checkpoint (``checkpoint``, else the
        trace's saved ``weights/``, else the recorded path), whose sha256 must be the recorded one."""
        from .user_model import resolve_reference

        w = self.manifest["weights"]
        if w.get("source") == "checkpoint":
            candidates = [Path(checkpoint)] if checkpoint is not None else (
                ([self.path / w["saved"]] if w.get("saved") else []) + ([Path(w["checkpoint"])] if w.get("checkpoint") else []))
            found = next((c for c in candidates if c.is_dir()), None)
            if found is None:
                shown = " or ".join(str(c) for c in candidates) or "(none recorded)"
                raise TraceError(f"the trace's checkpoint is not at {shown}: pass its folder with --checkpoint")
            ref, _ = resolve_reference(found, self.dtype, 0)
            if w.get("checkpoint_sha256") and ref.checkpoint_hash != w["checkpoint_sha256"]:
                raise TraceError(f"checkpoint {found} has sha256 {ref.checkpoint_hash[:16]}..., the trace was recorded from "
                                 f"{w['checkpoint_sha256'][:16]}...: not the same weights")
            return ref
        if checkpoint is not None:
            raise TraceError("this trace was recorded with random weights (from its seed): it takes no --checkpoint")
        ref, _ = resolve_reference(self.hf_config(), self.dtype, int(w.get("seed", 0)))
        return ref


def read_trace(path: str | Path) -> GoldenTrace:
    """Read a trace folder's manifest (files load on demand). Raises TraceError (one line)."""
    if isinstance(path, GoldenTrace):
        return path
    from .checkpoint import unreachable

    path = Path(path).expanduser()
    problem = unreachable(path, "trace folder")
    if problem:
        raise TraceError(problem)
    if not path.is_dir():
        raise TraceError(f"trace {path} is a file; pass the folder that holds {MANIFEST}")
    if not (path / MANIFEST).is_file():
        raise TraceError(f"no {MANIFEST} in {path}: not a parity trace")
    return GoldenTrace(path, _check_manifest(_read_json(path / MANIFEST, "manifest"), path))


# --- recording ---------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"1GB"``, ``"500MB"``, ``"64KiB"``, ``"4096"`` -> bytes (decimal units; ``*iB`` binary)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", str(text), flags=re.I)
    if not m or int(m.group(1)) < 1:
        raise ParityError(f"shard size {text!r} must be a positive size like 500MB, 1GB or 64KiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}[unit]
    return int(m.group(1)) * scale


def _source(source, n_layers, dtype, seed):
    """``(Reference, family name or None, description, nodes)`` of what to record: a family's node
    map for ``family[:config]``, else the registered family's for that ``model_type`` or the nodes
    found in the reference's modules (:func:`parity.nodes.reference_nodes`)."""
    from .build import make_reference
    from .nodes import reference_nodes
    from .registry import get_family
    from .user_model import resolve_reference

    text = str(source)
    is_path = not isinstance(source, str) or text.endswith(".json") or os.sep in text or "/" in text
    if not is_path:
        name, _, config = text.partition(":")
        family = get_family(name)
        overrides = {"n_layers": n_layers} if n_layers is not None else {}
        ref = make_reference(family, config or None, dtype=dtype, seed=seed, **overrides)
        return ref, family.name, f"{family.name}:{ref.config_name}", family.node_specs(ref.facts)
    if n_layers is not None:
        raise ParityError("the number of layers goes with a family (family:config); a checkpoint or config.json brings its own")
    ref, _ = resolve_reference(source, dtype, seed)
    nodes, family = reference_nodes(ref.model, ref.facts)
    return ref, family, text, nodes


def _plan(pair: Pair, seq_len, batch_size, left_pad, tolerances: Tolerances, summaries: bool):
    """The check's Run for one reference pass (validated inputs, notes), with a memory guard for one
    trace: whole tensors, or one node at a time for summaries."""
    from .check import Run, _inputs, _position_notes, _window_notes, generation_positions
    from .resources import require, trace_bytes

    input_ids, mask = _inputs(pair, None, seq_len, batch_size, None, left_pad)
    batch, seq = input_ids.shape
    size = torch.finfo(pair.dtype).bits // 8
    facts = pair.facts
    largest = batch * seq * max(max(facts.num_heads, 1) * seq, facts.vocab_size, facts.intermediate_size or 0, facts.hidden_size)
    needed = 8 * 8 * largest if summaries else trace_bytes(facts, batch, seq, size) // 2
    require(needed, f"recording {batch} x {seq} tokens",
            "use a shorter --seq-len, a smaller --batch, fewer layers or --summaries")
    return Run(
        input_ids=input_ids, attention_mask=mask, position_ids=generation_positions(mask, batch, seq), mode="chained",
        tolerances=tolerances, calibrate=False,
        notes=tuple(_window_notes(pair, seq)) + tuple(_position_notes(pair, seq)),
    )


def _config_json(hf_config) -> tuple[str, str]:
    """The config as config.json text, and the sha256 of its canonical form (sorted keys, without
    ``transformers_version``, which the manifest's versions hold)."""
    data = json.loads(hf_config.to_json_string(use_diff=False))
    canonical = {k: v for k, v in data.items() if k != "transformers_version"}
    return json.dumps(data, indent=2, sort_keys=True) + "\n", _sha256(json.dumps(canonical, sort_keys=True).encode())


def _shards(items: list[tuple[str, dict[str, torch.Tensor]]], shard_bytes: int) -> list[list[tuple[str, dict]]]:
    """Nodes grouped into shards of at most ``shard_bytes`` (a node larger than that gets its own)."""
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
    finally:
        if shown:
            logging.enable_progress_bar()


def _out_folder(out) -> tuple[Path, Path]:
    """``(out, its parent)``, refusing an existing non-empty folder (a trace is never overwritten)."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ParityError(f"--out {out} already exists; a trace is written to a new folder (an earlier one is never replaced)")
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
    seq_len: int | None = None,
    batch_size: int = 1,
    left_pad: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    calibrate: bool = False,
    summaries: bool = False,
    sample: int = DEFAULT_SAMPLE,
    save_weights: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> GoldenTrace:
    """Run the reference once and write its golden trace to the new folder ``out``.

    ``source``: ``"family[:config]"`` (the family's reference with parity's seeded probe weights;
    ``n_layers`` its depth), or a checkpoint folder or a config.json (probe weights) as a ``Path``
    (a string is a path when it ends in ``.json`` or holds a ``/``). ``seq_len``,
    ``batch_size``, ``left_pad``, ``dtype``, ``seed``: as :func:`parity.check`. ``atol``/``rtol``/
    ``tolerances``/``calibrate``: the tolerances the trace carries (default: the dtype's); calibration
    needs whole tensors. ``summaries``: statistics instead of tensors (``sample`` elements per node).
    ``save_weights``: a copy of the weights in ``out/weights`` for other runtimes. The folder appears
    only when complete. Raises ParityError (bad input, an existing ``out``).
    """
    from .build import default_seq_len
    from .check import _check_tolerance_args, calibrate_tolerances, trace_reference
    from .report.atomic import discard, done, staging_folder

    if summaries and calibrate:
        raise ParityError("calibration needs whole tensors (a float64 trace beside this one): drop --calibrate or --summaries")
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise ParityError(f"the sample size must be a positive integer, got {sample!r}")
    out, parent = _out_folder(out)
    start = time.perf_counter()
    ref, family, described, nodes = _source(source, n_layers, dtype, seed)
    pair = Pair(ours=ref.model, reference=ref.model, nodes=nodes, facts=ref.facts, family=family or ref.facts.model_type,
                config_name=ref.config_name, dtype=dtype, seed=seed, checkpoint=ref.checkpoint,
                checkpoint_hash=ref.checkpoint_hash, default_seq_len=default_seq_len(ref.facts))
    _check_tolerance_args(pair, atol, rtol, tolerances, calibrate, False)
    tol = Tolerances(dtype, atol, rtol, dict(tolerances or {}))
    run = _plan(pair, seq_len, batch_size, left_pad, tol, summaries)
    config_text, config_hash = _config_json(ref.hf_config)
    staging = staging_folder(parent)
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
            from .checkpoint import read_checkpoint

            checkpoint_hash = read_checkpoint(staging / WEIGHTS).content_hash()
        manifest = _manifest(pair, run, ref, described, family, tol, trace, summaries, sample, config_hash,
                             saved, checkpoint_hash, time.perf_counter() - start)
        _write(staging, manifest, pair, run, trace, summaries, shard_bytes, config_text)
        try:
            os.rename(staging, out)
        except OSError:
            raise ParityError(f"--out {out} appeared while recording; the trace was not written") from None
        done(staging)
    except BaseException:
        discard(staging)
        raise
    return read_trace(out)


def _manifest(pair, run, ref, described, family, tol: Tolerances, trace, summaries, sample, config_hash, saved,
              checkpoint_hash, seconds) -> dict:
    specs = {n.name: n for n in pair.nodes}
    order = trace.order
    nodes = []
    for index, name in enumerate(order):
        spec = specs[name]
        atol, rtol, source = tol.for_node(name)
        entry = {"name": name, "index": index, "layer": spec.layer, "kind": spec.kind, "module": spec.reference_path}
        if summaries:
            s = trace.summaries[name]
            entry.update(shape=list(s.shape), dtype=s.dtype,
                         stats={k: (v if isinstance(v, int) or math.isfinite(v) else None) for k, v in s.stats.items()})
        else:
            t = trace.tensors[name]
            entry.update(shape=list(t.shape), dtype=_dtype_name(t.dtype))
        entry.update(atol=atol, rtol=rtol, tol_source=source)
        nodes.append(entry)
    unrecorded = [{"name": n.name, "layer": n.layer, "kind": n.kind, "module": n.reference_path}
                  for n in pair.nodes if n.name not in set(order)]
    default = default_tolerance(pair.dtype)
    inputs = {"input_ids": run.input_ids, "position_ids": run.position_ids}
    if run.attention_mask is not None:
        inputs["attention_mask"] = run.attention_mask
    random = ref.checkpoint is None
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "summaries" if summaries else "tensors",
        "created": _now(),
        "seconds": round(seconds, 3),
        "versions": _versions(),
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
            "seed": pair.seed if random else None,
            "description": "parity's seeded probe weights (parity.probes), regenerated from the config and the seed"
            if random else "the checkpoint's safetensors, cast to the probe dtype",
            "checkpoint": None if random else str(Path(ref.checkpoint).resolve()),
            "checkpoint_sha256": checkpoint_hash,
            "saved": saved,
        },
        "probe": {
            "dtype": _dtype_name(pair.dtype),
            "batch_size": int(run.input_ids.shape[0]),
            "seq_len": int(run.input_ids.shape[1]),
            "left_pad": [int(n) for n in (run.attention_mask == 0).sum(1)] if run.attention_mask is not None else None,
            "seed": pair.seed,
            "tokens": "torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))",
        },
        "inputs": {"file": INPUTS,
                   "tensors": {k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in inputs.items()}},
        "tolerances": {
            "rule": RULE,
            "dtype": _dtype_name(pair.dtype),
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
            "keys": {"sample": f"<node>{SEP}sample", "sample_index": f"<node>{SEP}sample_index",
                     "position_norm": f"<node>{SEP}position_norm"},
        } if summaries else None,
        "nodes": nodes,
        "unrecorded": unrecorded,
        "files": [],
        "notes": list(run.notes),
    }


def _write(staging: Path, manifest: dict, pair, run, trace, summaries: bool, shard_bytes: int, config_text: str) -> None:
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
            tensors = {name: trace.tensors[name]}
        items.append((name, tensors))
    shards = _shards(items, shard_bytes)
    for i, shard in enumerate(shards, 1):
        file = f"nodes-{i:05d}-of-{len(shards):05d}.safetensors"
        put(file, _save({k: v for _, tensors in shard for k, v in tensors.items()}))
        for name, _ in shard:
            next(e for e in manifest["nodes"] if e["name"] == name)["file"] = file
    manifest["files"] = files
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n", encoding="utf-8")


# --- comparing ---------------------------------------------------------------------------------------


def _run_of(trace: GoldenTrace, tolerances: Tolerances, mode: str = "chained"):
    from .check import Run

    inputs = trace.inputs()
    return Run(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
               position_ids=inputs["position_ids"], mode=mode, tolerances=tolerances, calibrate=False, notes=())


def _trace_pair(trace: GoldenTrace, nodes: list[NodeSpec]) -> Pair:
    """A Pair with no models: what compare_run and analyse read (nodes, facts, the output node)."""
    ref = trace.manifest["reference"]
    return Pair(ours=None, reference=None, nodes=nodes, facts=trace.facts(), family=ref.get("family") or ref["model_type"],
                config_name=ref.get("config_name") or "", dtype=trace.dtype, seed=trace.manifest["probe"].get("seed", 0))


def judge(trace: GoldenTrace, pair: Pair, run, ours: Trace, tolerances: Tolerances):
    """``(node results, profile, logits)`` of ours against the trace: whole tensors through
    :func:`parity.check.compare_run` and :func:`parity.check.analyse` (metrics, the first failure's
    hint, where its error sits, its effect on the logits), summaries through :func:`compare_summary`."""
    from .check import analyse, compare_run

    if trace.kind == "tensors":
        ref = trace.reference_trace()
        results = compare_run(pair, run, ours, ref, tolerances)
        profile, logits = analyse(pair, results, ours, ref)
        return results, profile, logits
    stored = trace.summaries()
    untapped = frozenset(n.name for n in pair.nodes if n.ours.startswith(("tap:", "unaligned:")))
    by_name = {n.name: n for n in pair.nodes}
    order = [name for name in trace.names if name in by_name] + [n.name for n in pair.nodes if n.name not in stored]
    results = []
    for index, name in enumerate(order):
        spec, theirs = by_name[name], stored.get(name)
        mine = ours.summaries.get(name) if isinstance(ours, SummaryTrace) else None
        tensor = ours.tensors.get(name)
        if theirs is None or (mine is None and tensor is None) or (mine is None and tuple(tensor.shape) != theirs.shape):
            # not comparable (missing on a side, or another shape): judged as parity check judges it;
            # the reference's tensor stands in as an empty meta tensor of its shape and dtype
            placeholder = None if theirs is None else torch.empty(theirs.shape, dtype=getattr(torch, theirs.dtype), device="meta")
            results.append(compare_node(spec, index, tensor, placeholder, tolerances, name in untapped))
            continue
        if mine is None:
            mine = summarise(tensor, spec.kind, index=theirs.sample_index)
        results.append(compare_summary(spec, index, mine, theirs, tolerances))
    bad = next((r for r in results if r.failed), None)
    if bad is not None and bad.status in (MISSING, "shape"):
        from .diagnose import diagnose

        results[bad.index] = replace(bad, hint=diagnose(bad, Trace(), Trace(), pair.facts))
    return results, None, None


def _meta(trace: GoldenTrace, compared: str, what: str, tolerances: Tolerances, atol, rtol, mode: str, seconds: float,
          ours_class: str, aligned: bool = False) -> dict:
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
        "mode": mode,
        "atol": atol,
        "rtol": rtol,
        "exact": tolerances.exact,
        "calibrated": tolerances.calibrated is not None,
        "safety_factor": None,
        "tolerances": {k: list(v) for k, v in tolerances.per_node.items()},
        "config_diff": [],
        #: the versions that computed the reference (the trace's); installed_versions: this run's
        "versions": {"torch": m["versions"].get("torch"), "transformers": m["versions"].get("transformers")},
        "installed_versions": _versions(),
        "time": _now(),
        "seconds": round(seconds, 3),
        "model_type": ref["model_type"],
        "ours_class": ours_class,
        "aligned": aligned,
        "cfg": {},
        "compared": compared,
        "compared_with": what,
        "trace": {"path": str(trace.path), "version": m["version"], "kind": m["kind"], "created": m.get("created"),
                  "config_sha256": ref.get("config_sha256"), "stale": bool(trace.stale())},
    }


def _notes(trace: GoldenTrace, extra: list[str], verifying: bool = False) -> tuple[str, ...]:
    notes = [n for n in (trace.stale_note(verifying),) if n] + list(trace.manifest.get("notes") or []) + extra
    if trace.kind == "summaries":
        notes.append("judged on summaries: a statistic or sampled element past its bound proves a node fails; a node "
                     "that passes is only consistent with agreement (an error in a few elements can escape the sample)")
    return tuple(notes)


def _missing_in_dump(results: list[NodeResult], names: Mapping[str, str]) -> list[NodeResult]:
    """Missing nodes of a dump, said in the dump's words (which key or file it looked for)."""
    out = []
    for r in results:
        if r.status == MISSING and r.shape_ref is not None and r.shape_ours is None:
            looked = names.get(r.name, r.name)
            detail = f"the dump has no tensor {looked!r} (a key of a .safetensors file or {looked}.npy)"
            hint = Hint("missing", f"likely a name-map problem or a node the runtime does not dump: {detail}") if r.hint else None
            r = replace(r, detail=detail, hint=hint)
        out.append(r)
    return out


def compare_dump(trace, dump, name_map=None, *, atol: float | None = None, rtol: float | None = None,
                 exact: bool = False) -> CheckResult:
    """Compare another runtime's dump (see :func:`read_dump`, :func:`read_name_map`) with a trace.
    Raises ParityError for an unreadable trace, dump or name map."""
    start = time.perf_counter()
    trace = read_trace(trace)
    rules = read_name_map(name_map)
    shapes = {n["name"]: tuple(n["shape"]) for n in trace.node_entries}
    shapes.update({u["name"]: None for u in trace.manifest.get("unrecorded", [])})
    tensors, keys, notes = map_dump(read_dump(dump), rules, shapes)
    # what the dump would be looked up under, for a node it lacks: the runtime's name when one rule gives it
    names = {}
    for rule in rules:
        if "{i}" not in rule.runtime:
            names[rule.node] = rule.runtime
    for node in trace.names:
        for rule in rules:
            if "{i}" in rule.runtime:
                m = re.fullmatch(re.escape(rule.node).replace(re.escape("{i}"), r"(\d+)"), node)
                if m:
                    names.setdefault(node, rule.runtime.replace("{i}", m.group(1)))
    tolerance = trace.tolerances(atol, rtol, exact)
    nodes = trace.node_specs({n: keys.get(n, names.get(n, n)) for n in trace.names})
    pair = _trace_pair(trace, nodes)
    ours = Trace(tensors=tensors, wanted=frozenset(tensors))
    results, profile, logits = judge(trace, pair, _run_of(trace, tolerance), ours, tolerance)
    results = _missing_in_dump(results, names)
    notes.append("isolated mode is not possible from a dump (each node of ours would have to continue from the "
                 "reference's tensor): errors compound, so the first failing node is where the error first shows")
    return CheckResult(
        nodes=tuple(results),
        meta=_meta(trace, "dump", str(Path(dump)), tolerance, atol, rtol, "chained", time.perf_counter() - start,
                   f"dump:{Path(dump).name}"),
        notes=_notes(trace, notes),
        profile=profile,
        logits=logits,
    )


def compare_model(trace, ours, *, node_map: dict | None = None, mode: str = "chained", atol: float | None = None,
                  rtol: float | None = None, exact: bool = False, checkpoint=None) -> CheckResult:
    """Compare a live PyTorch model with a trace: ``ours`` is ``build(state_dict, hf_config)`` (as
    :func:`parity.check_model`), given the weights the trace was recorded with, and aligned to its
    nodes by them; ``mode`` ``isolated``/``both`` continue every node from the trace's tensors (a
    ``tensors`` trace). Raises ParityError."""
    from .check import MODES, trace_ours
    from .user_model import build_user_pair

    if mode not in MODES:
        raise ParityError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    start = time.perf_counter()
    trace = read_trace(trace)
    if mode != "chained" and trace.kind != "tensors":
        raise ParityError("isolated mode continues every node from the reference's tensor, which a summaries trace does not hold")
    ref = trace.rebuild_reference(checkpoint)
    pair = build_user_pair(ours, ref.model, dtype=trace.dtype, seed=trace.manifest["probe"].get("seed", 0), node_map=node_map)
    tolerance = trace.tolerances(atol, rtol, exact)
    run = _run_of(trace, tolerance, mode)
    isolated = None
    if mode in ("isolated", "both"):
        substitute = trace.reference_trace()
        iso_trace = trace_ours(pair, run, substitute)
        isolated, _, _ = judge(trace, pair, run, iso_trace, tolerance)
    if mode == "isolated":
        results, profile, logits = isolated, None, None
    else:
        ours_trace = trace_ours(pair, run)
        results, profile, logits = judge(trace, pair, run, ours_trace, tolerance)
    ours_class = f"{type(pair.ours).__module__}.{type(pair.ours).__qualname__}"
    return CheckResult(
        nodes=tuple(results),
        meta=_meta(trace, "model", ours_class, tolerance, atol, rtol, mode, time.perf_counter() - start, ours_class, True),
        notes=_notes(trace, []),
        profile=profile,
        logits=logits,
        isolated=tuple(isolated) if isolated is not None else None,
        coverage=pair.coverage,
        alignment=tuple(pair.alignment),
    )


def verify(trace, checkpoint=None) -> CheckResult:
    """Re-run the reference the trace was recorded from, with the installed torch and Transformers, on
    the trace's inputs, and judge it against the trace with the trace's tolerances (``passed``: it
    still reproduces; ``first_divergence`` None: bit for bit). Raises ParityError."""
    from .check import trace_reference

    start = time.perf_counter()
    trace = read_trace(trace)
    ref = trace.rebuild_reference(checkpoint)
    nodes = trace.node_specs()
    pair = Pair(ours=ref.model, reference=ref.model, nodes=nodes, facts=trace.facts(), family=ref.facts.model_type,
                config_name=ref.config_name, dtype=trace.dtype)
    tolerance = trace.tolerances()
    run = _run_of(trace, tolerance)
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
        meta=_meta(trace, "verify", what, tolerance, None, None, "chained", time.perf_counter() - start,
                   type(ref.model).__name__),
        notes=_notes(trace, [], verifying=True),
        profile=profile,
        logits=logits,
    )


__all__ = [
    "FORMAT", "VERSION", "GoldenTrace", "NameRule", "Summary", "SummaryTrace", "TraceError", "compare_dump", "compare_model",
    "compare_summary", "judge", "map_dump", "read_dump", "read_name_map", "read_trace", "record", "summarise", "trace_schema",
    "verify",
]
