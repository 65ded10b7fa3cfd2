"""Golden traces: the reference's nodes recorded once, as files; any runtime's dump compared with them.

    parity record llama3:tiny --out golden/                      # run the reference, write the trace
    parity compare golden/ --dump my_runtime_dump/               # a dump of another runtime
    parity compare golden/ --ours mymodel.py:build               # a live PyTorch model (aligned by weights)
    parity record --verify golden/                               # do the installed versions still reproduce it?

A comparison against a trace gives what ``parity check`` gives (the same metrics, hints, reports and
exit codes), because it goes through the same stages: :func:`parity.run.stages.trace_reference` recorded
the trace, :func:`parity.run.stages.compare_run` (:func:`parity.compare.results.compare_traces` and
:func:`parity.diagnose.detectors.diagnose`) and :func:`parity.run.stages.analyse` judge it, and the result is a
:class:`~parity.report.result.CheckResult` with its writers. What a dump cannot give: isolated mode (each
node of ours continuing from the reference's tensor needs a runtime that parity drives) and loader
coverage (parity never sees the runtime's weights).

The trace format (version :data:`VERSION`; JSON Schema ``parity/golden/trace.schema.json``), readable
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

Summaries (``--summaries``, :mod:`parity.golden.summaries`, which says what can and cannot be concluded
from them) keep statistics, a seeded sample and per-position norms instead of each tensor. A dump
is read by :mod:`parity.golden.dumps` (``.safetensors`` keyed by node, ``.npy`` named by node, name maps).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import torch

from parity.compare.tolerances import Tolerances
from parity.golden.summaries import (
    Summary,
)
from parity.model.pair import NodeSpec
from parity.record.trace import SCALARS, Trace
from parity.run.options import CheckOptions
from parity.util.errors import ParityError

FORMAT = "parity-trace"
#: the trace format version this parity writes and reads (a newer one is refused with a message)
VERSION = 1
MANIFEST, INPUTS, CONFIG, WEIGHTS = "manifest.json", "inputs.safetensors", "config.json", "weights"
SCHEMA_FILE = "trace.schema.json"
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def recording_versions() -> dict:
    import platform

    import safetensors

    from parity.run.plan import versions
    from parity.util.version import VERSION as __version__

    return {
        **versions(),
        "parity": __version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def utc_now() -> str:
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
    "format": str,
    "version": int,
    "kind": str,
    "versions": dict,
    "reference": dict,
    "weights": dict,
    "probe": dict,
    "inputs": dict,
    "tolerances": dict,
    "nodes": list,
    "files": list,
}


def _check_manifest(m, path: Path) -> dict:
    where = path / MANIFEST
    if not isinstance(m, dict):
        raise TraceError(f"{where} is not a JSON object")
    if m.get("format") != FORMAT:
        raise TraceError(f"{where} is not a parity trace (format {m.get('format')!r}, expected {FORMAT!r})")
    version = m.get("version")
    if isinstance(version, int) and version > VERSION:
        raise TraceError(
            f"{where} has trace format version {version}, newer than this parity reads ({VERSION}): upgrade parity"
        )
    if version != VERSION:
        raise TraceError(f"{where} has an invalid trace format version {version!r} (this parity reads {VERSION})")
    for key, kind in _REQUIRED.items():
        if not isinstance(m.get(key), kind):
            raise TraceError(f"{where} lacks {key!r} (or it is not a JSON {kind.__name__})")
    if m["kind"] not in KINDS:
        raise TraceError(f"{where} has kind {m['kind']!r}; expected one of {', '.join(KINDS)}")
    for i, node in enumerate(m["nodes"]):
        if not (
            isinstance(node, dict)
            and isinstance(node.get("name"), str)
            and isinstance(node.get("shape"), list)
            and isinstance(node.get("file"), str)
        ):
            raise TraceError(f"{where}: nodes[{i}] needs a name, a shape and a file")
    for entry in m["files"]:
        if not (
            isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("sha256"), str)
        ):
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
        entries += [
            (u["name"], u.get("module"), u.get("layer"), u.get("kind", "")) for u in self.manifest.get("unrecorded", [])
        ]
        return [
            NodeSpec(
                name, ours.get(name, name), reference=module if module != name else None, layer=layer, kind=kind or ""
            )
            for name, module, layer, kind in entries
        ]

    def _file(self, name: str) -> bytes:
        entry = next((f for f in self.manifest["files"] if f["name"] == name), None)
        if entry is None:
            raise TraceError(f"{self.path / MANIFEST} does not list {name}")
        data = (self.path / name).read_bytes()
        if _sha256(data) != entry["sha256"]:
            raise TraceError(
                f"{self.path / name} does not match the sha256 in {MANIFEST}: the file changed or is corrupt"
            )
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
                raise TraceError(
                    f"{self.path / node['file']} holds node {node['name']} as {tuple(tensor.shape)}, "
                    f"{MANIFEST} says {tuple(node['shape'])}"
                )
            trace.tensors[node["name"]] = tensor
            for part, store in (("input", trace.inputs), ("weight", trace.weights), ("bias", trace.biases)):
                held = tensors.get(f"{node['name']}{SEP}{part}") if part in node.get("diagnosis", ()) else None
                if held is not None:
                    store[node["name"]] = held
        trace.wanted = frozenset(trace.tensors)
        trace.extras[SCALARS] = {k: float(v) for k, v in self.manifest.get("reference_scalars", {}).items()}
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
                raise TraceError(
                    f"{self.path / node['file']} lacks the sample of node {name} (or {MANIFEST} its stats)"
                )
            index = index.long()
            numel = math.prod(node["shape"])
            fits = index.dim() == 1 and index.shape == sample.shape
            if not fits or (index.numel() and not 0 <= int(index.min()) <= int(index.max()) < numel):
                raise TraceError(
                    f"{self.path / node['file']}: the sample of node {name} does not fit its shape "
                    f"{tuple(node['shape'])}"
                )
            stats = {k: (math.nan if v is None else v) for k, v in node["stats"].items()}
            out[name] = Summary(
                tuple(node["shape"]),
                node.get("dtype", ""),
                stats,
                index,
                sample,
                tensors.get(f"{name}{SEP}position_norm"),
            )
        return out

    def hf_config(self):
        """The reference's Transformers config, from the trace's config.json."""
        from parity.build.reference import config_from_raw

        raw = _read_json(self.path / self.manifest["reference"].get("config_file", CONFIG), "config")
        if not isinstance(raw, dict):
            raise TraceError(f"{self.path / CONFIG} is not a JSON object")
        return config_from_raw(raw, str(self.path / CONFIG))

    def facts(self):
        """ArchFacts of the reference (hints and reports read them), from its config."""
        if "facts" not in self._cache:
            from parity.model.derive import derive_facts

            facts = derive_facts(self.hf_config())
            prefix = self.manifest["reference"].get("layer_prefix")
            self._cache["facts"] = replace(facts, layer_prefix=prefix) if prefix else facts
        return self._cache["facts"]

    @property
    def head_node(self) -> str | None:
        """The node of the output head, when nothing follows it (no logit scale, no soft-cap), so a
        runtime's head output is what it returns; None otherwise."""
        facts = self.facts()
        if facts.logit_scale not in (None, 1.0) or facts.final_softcap:
            return None
        return next((n["name"] for n in self.node_entries if (n.get("module") or n["name"]) == facts.head_module), None)

    def tolerances(self, options: CheckOptions | None = None) -> Tolerances:
        """The trace's tolerances, overridden by ``options``: its ``atol``/``rtol`` replace the trace's
        run-wide and calibrated values, its node patterns join (and win over) the trace's, ``exact``
        makes every node 0/0 but the patterns."""
        t = self.manifest["tolerances"]
        atol, rtol = (options.atol, options.rtol) if options is not None else (None, None)
        given = atol is not None or rtol is not None
        calibrated = t.get("calibrated_nodes") if not given else None
        per_node = {k: tuple(v) for k, v in (t.get("per_node") or {}).items()}
        if options is not None:
            per_node = {**per_node, **dict(options.tolerances)}
        return Tolerances(
            self.dtype,
            atol if given else t.get("atol"),
            rtol if given else t.get("rtol"),
            per_node,
            {k: tuple(v) for k, v in calibrated.items()} if calibrated else None,
            exact=bool((options is not None and options.exact) or t.get("exact")),
        )

    def stale(self) -> list[tuple[str, str, str]]:
        """``(package, recorded, installed)`` for torch and Transformers where they differ."""
        from parity.run.plan import versions

        recorded, now = self.manifest["versions"], versions()
        return [(k, str(recorded.get(k)), now[k]) for k in ("torch", "transformers") if recorded.get(k) != now[k]]

    def stale_note(self, verifying: bool = False) -> str | None:
        """One line naming the versions that differ (None when none does); ``verifying``: said by the
        run that re-runs the reference."""
        diffs = self.stale()
        if not diffs:
            return None
        what = ", ".join(f"{k} {a} (installed: {b})" for k, a, b in diffs)
        then = (
            "this run re-runs it with the installed versions"
            if verifying
            else f"`parity record --verify {self.path}` re-runs it and says whether it still reproduces"
        )
        return (
            f"stale reference: this trace was recorded with {what}; the installed versions may compute the "
            f"reference differently; {then}"
        )

    def rebuild_reference(self, checkpoint: str | Path | None = None):
        """The Transformers model the trace was recorded from, with the same weights: regenerated from
        its config and seed (random weights), or read from the checkpoint (``checkpoint``, else the
        trace's saved ``weights/``, else the recorded path), whose sha256 must be the recorded one."""
        from parity.build.reference import resolve_reference

        w = self.manifest["weights"]
        if w.get("source") == "checkpoint":
            candidates = (
                [Path(checkpoint)]
                if checkpoint is not None
                else (
                    ([self.path / w["saved"]] if w.get("saved") else [])
                    + ([Path(w["checkpoint"])] if w.get("checkpoint") else [])
                )
            )
            found = next((c for c in candidates if c.is_dir()), None)
            if found is None:
                shown = " or ".join(str(c) for c in candidates) or "(none recorded)"
                raise TraceError(f"the trace's checkpoint is not at {shown}: pass its folder with --checkpoint")
            ref, _ = resolve_reference(found, self.dtype, 0)
            if w.get("checkpoint_sha256") and ref.checkpoint_hash != w["checkpoint_sha256"]:
                raise TraceError(
                    f"checkpoint {found} has sha256 {cast(str, ref.checkpoint_hash)[:16]}..., the trace was recorded from "
                    f"{w['checkpoint_sha256'][:16]}...: not the same weights"
                )
            return ref
        if checkpoint is not None:
            raise TraceError("this trace was recorded with random weights (from its seed): it takes no --checkpoint")
        ref, _ = resolve_reference(self.hf_config(), self.dtype, int(w.get("seed", 0)))
        return ref


def read_trace(path: str | Path) -> GoldenTrace:
    """Read a trace folder's manifest (files load on demand). Raises TraceError (one line)."""
    if isinstance(path, GoldenTrace):
        return path
    from parity.build.checkpoint import unreachable

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
