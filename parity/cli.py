"""Command line: ``parity check <family> ...``, ``parity record`` / ``parity compare`` (golden traces),
``parity list``, ``parity selftest``, ``parity gate``, ``parity align``.

Exit codes: 0 parity holds; 1 a node failed; 2 bad usage or bad input (one line on stderr, in the
options' own words, before any model is built where the options alone show it); 3 an internal
error (a bug in parity: traceback on stderr).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rich.console import Console
from rich.table import Table

from parity.util.errors import ParityError
from parity.util.files import RESERVED

if TYPE_CHECKING:
    from collections.abc import Sequence

    from parity.run.options import CheckOptions

DTYPES = ("float32", "bfloat16")
FORMATS = ("html", "csv", "json", "junit")
#: the working folder the command started in (report paths are shown relative to it)
_START: str | None = None
#: bytes below a --checkpoint that its files need ("/model-00001-of-00002.safetensors.index.json" and the like)
CHECKPOINT_FILE = 64


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage)
        raise ParityError(message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2^63, got {text!r}")
    return value


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2^63), got {text!r}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _path(reserve: int):
    """argparse type: a path with ``~`` expanded, refused (exit 2, one line) when it or what is written
    below it (``reserve`` bytes: a report folder and its files) would pass the system's path limits."""
    from parity.util.files import path_problem

    def parse(text: str) -> str:
        path = os.path.expanduser(text)
        problem = path_problem(path, reserve)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return path

    return parse


def _gib(text: str) -> int:
    """argparse type: a size in GiB (``0.5``, ``4``) -> bytes."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a size in GiB >= 0, got {text!r}")
    return int(value * 1024**3)


def _report_parent(path: str) -> Path:
    """The report folder's parent, created now, so a bad --report-dir fails before any model is built."""
    parent = Path(path)
    if parent.exists() and not parent.is_dir():
        raise ParityError(f"--report-dir {parent} is a file, not a folder")
    if os.path.islink(parent) and not parent.exists():  # a loop or a dangling link: mkdir would say "File exists"
        from parity.build.checkpoint import unreachable

        raise ParityError(unreachable(parent, "--report-dir") or f"--report-dir {parent} is a broken symbolic link")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParityError(f"--report-dir {parent} cannot be created: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise ParityError(f"--report-dir {parent} is not writable")
    return Path(os.path.abspath(parent))  # a model whose forward changes the working folder moves no report


def _shown(folder: Path) -> str:
    """A written folder as the user named its parent: relative to where the command started, when it is below it."""
    start = _START or os.getcwd()
    try:
        rel = os.path.relpath(folder, start)
    except ValueError:
        return str(folder)
    return str(folder) if rel.startswith("..") else rel


def _formats(text: str) -> list[str]:
    items = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in items if f not in FORMATS]
    if unknown or not items:
        raise argparse.ArgumentTypeError(
            f"unknown format {', '.join(unknown) or text!r}; choose from {', '.join(FORMATS)}"
        )
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="parity", description="Layer-by-layer parity of a from-scratch LLM against Transformers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = sub.add_parser("check", help="compare one family's pair, or your own model, node by node")
    check.add_argument("family", nargs="?", help="a registered family (see `parity list`); omit it with --ours")
    _add_user_model_args(check)
    check.add_argument("--config", help="built-in config name or a config.json path (default: the family's)")
    check.add_argument("--layers", type=_positive, help="number of layers for built-in configs")
    check.add_argument(
        "--checkpoint",
        type=_path(CHECKPOINT_FILE),
        help="Transformers-format directory (config.json + safetensors), or a .gguf (or a folder holding one): "
        "dequantized to --dtype by Transformers (pip install 'parity[gguf]')",
    )
    check.add_argument("--seq-len", type=_positive, help="tokens per sequence (default: past the sliding window)")
    check.add_argument("--batch", type=_positive, default=1, help="sequences per batch (default 1)")
    check.add_argument("--seed", type=_nonnegative, default=0, help="seed for random weights and input tokens")
    check.add_argument(
        "--left-pad",
        type=_nonnegative,
        default=0,
        metavar="N",
        help="left-pad every batch row but the last with N padding tokens (needs --batch 2+)",
    )
    check.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype of both models")
    _add_text_args(check)
    check.add_argument("--atol", type=_nonnegative_float, help="absolute tolerance (default by dtype)")
    check.add_argument("--rtol", type=_nonnegative_float, help="relative tolerance (default by dtype)")
    check.add_argument(
        "--mode",
        choices=("chained", "isolated", "both"),
        default="chained",
        help="chained: both models run on their own; isolated: each node of ours continues from the "
        "reference's tensors (the first failing node is the fault); both: the two side by side",
    )
    check.add_argument(
        "--decode",
        metavar="PREFILL[:CHUNK]xSTEPS",
        help="KV-cache run: prefill PREFILL tokens (in CHUNK-token pieces), then STEPS decode steps; every node and "
        "both caches compared at each step (e.g. 12:4x8)",
    )
    check.add_argument(
        "--exact",
        action="store_true",
        help="atol = rtol = 0 on every node (for pairs that are bit-identical when correct, e.g. our bf16 pairs)",
    )
    check.add_argument(
        "--calibrate",
        action="store_true",
        help="set each node's atol from the reference's own float32-vs-float64 error (x10) instead of fixed defaults",
    )
    check.add_argument(
        "--semantic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="judge in float64 first (a difference of formula), then the dtype within 10x the reference's own "
        "error (default: on with --ours, off for a family, which is bit-exact)",
    )
    check.add_argument(
        "--device", help="where both models run: cpu (default), cuda, cuda:N or mps; traces come back to the CPU"
    )
    check.add_argument(
        "--device-map",
        choices=("auto",),
        help="auto: spread the weights over the GPUs through accelerate (a model larger than one GPU)",
    )
    check.add_argument(
        "--trace-memory",
        type=_gib,
        metavar="GIB",
        help="GiB of each trace held in memory before it spills to a temporary folder (default 1)",
    )
    # training parity (parity.run.backward)
    check.add_argument(
        "--backward",
        action="store_true",
        help="after the forward: both models in train mode (dropout off), the loss, every node's and parameter's "
        "gradient compared in backward order",
    )
    check.add_argument("--step", choices=("adamw", "sgd"), help="with --backward: one optimizer step, weights compared")
    check.add_argument("--lr", type=_nonnegative_float, help="the --step's learning rate (default 1e-3)")
    check.add_argument(
        "--causality", action="store_true", help="no node at position t may change when only later tokens change"
    )
    check.add_argument(
        "--report-dir", type=_path(RESERVED), default="reports", help="parent folder of the run's new report folder"
    )
    check.add_argument(
        "--format", type=_formats, default=["html", "csv", "json"], help="comma list of html,csv,json,junit"
    )
    align = sub.add_parser("align", help="show how your model's modules align to the reference's nodes")
    _add_user_model_args(align, required=True)
    align.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the reference's weights")
    align.add_argument("--seed", type=_nonnegative, default=0, help="seed for the reference's random weights")
    sub.add_parser("list", help="registered families and their configs")
    gate = sub.add_parser(
        "gate",
        help="CI gate: the project's families' CI cases, as pytest tests, against the committed baseline",
        description="Runs parity.gate.pytest_gate under pytest: one test per family/config/source/dtype, judged by its "
        "checks and against the baseline, and one config-coverage test per family. Given PATHS (what a pre-commit "
        "hook passes) or --changed-since, only the families whose files changed.",
    )
    gate.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="changed files (relative to the project): run only the families they touch",
    )
    gate.add_argument(
        "--family", action="append", help="only this family (repeatable; default: the project's families)"
    )
    gate.add_argument(
        "--baseline",
        type=_path(0),
        help="baseline file (default: [tool.parity] baseline in pyproject.toml, else parity-baseline.json)",
    )
    gate.add_argument(
        "--update-baseline", action="store_true", help="rewrite the baseline from this run (only if it passes)"
    )
    gate.add_argument(
        "--changed-since", metavar="REF", help="run only families whose files changed since this git commit"
    )
    gate.add_argument(
        "--report-dir", type=_path(RESERVED), help="parent folder of the gate's report folder (default reports)"
    )
    gate.add_argument("--no-reports", action="store_true", help="write no report files")
    _add_trace_commands(sub)
    _add_runtime_commands(sub)
    selftest = sub.add_parser("selftest", help="inject every known fault and check parity locates it")
    selftest.add_argument("family", help="a registered family (see `parity list`)")
    selftest.add_argument(
        "--fields",
        action="store_true",
        help="audit the config fields instead: change each on the reference side only and require "
        "parity to see it at the node where it first acts",
    )
    return parser


def _add_text_args(parser) -> None:
    """--prompt / --prompts / --input-ids / --chat: real text instead of seeded random ids (parity.run.inputs)."""
    parser.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt, tokenized with the checkpoint's tokenizer (repeatable: a prompt set)",
    )
    parser.add_argument(
        "--prompts", metavar="FILE", help="prompts, one per line, or JSONL with a text or messages field"
    )
    parser.add_argument(
        "--input-ids", metavar="FILE", help="token ids instead of text: a JSON list of lists of ints, one per prompt"
    )
    parser.add_argument("--chat", action="store_true", default=None, help="apply the tokenizer's chat template")


def text_options(args) -> dict:
    """The CheckOptions fields of --prompt / --prompts / --input-ids / --chat, files read now (one line,
    exit 2, for a file that cannot serve), before anything is built. Raises ParityError."""
    from parity.run.inputs import read_ids_file, read_prompts_file

    prompts, ids = list(getattr(args, "prompt", None) or ()), getattr(args, "input_ids", None)
    if any(p == "" for p in prompts):
        raise ParityError("--prompt is empty")
    if getattr(args, "prompts", None) is not None:
        prompts += list(read_prompts_file(args.prompts))
    if ids is not None and prompts:
        raise ParityError("--input-ids gives token ids instead of text: drop --prompt/--prompts, or --input-ids")
    chat = bool(getattr(args, "chat", None))
    if chat and not prompts:
        raise ParityError("--chat applies the tokenizer's chat template to --prompt/--prompts: give prompts")
    if not prompts and ids is None:
        return {}
    if getattr(args, "seq_len", None) is not None:
        raise ParityError("a prompt's length is its own: drop --seq-len")
    if getattr(args, "left_pad", None):
        raise ParityError("prompts are padded as the tokenizer pads them (left for --decode): drop --left-pad")
    if getattr(args, "backward", False) or getattr(args, "causality", False):
        raise ParityError("--backward and --causality run on the random probe: drop --prompt/--prompts/--input-ids")
    if prompts:
        return {"prompts": tuple(prompts), "chat": chat}
    assert ids is not None  # neither prompts nor ids returned above
    return {"prompt_ids": read_ids_file(ids)}


def _add_trace_commands(sub) -> None:
    """``parity record`` and ``parity compare`` (golden traces, :mod:`parity.golden`). Options default
    to None so that the commands can tell which were given."""
    record = sub.add_parser(
        "record",
        help="run the reference once and write a golden trace (node tensors, inputs, manifest)",
        description="Writes a golden trace of the reference to --out: node tensors (or --summaries), the inputs and a "
        "versioned manifest.json (see parity/golden/trace.schema.json). --verify TRACE_DIR re-runs a trace's reference instead.",
    )
    record.add_argument(
        "target", nargs="?", metavar="FAMILY[:CONFIG]", help="a registered family and one of its configs"
    )
    record.add_argument(
        "--reference", metavar="DIR|config.json", help="a checkpoint folder or a config.json instead of a family"
    )
    record.add_argument("--out", type=_path(RESERVED), metavar="TRACE_DIR", help="the trace folder to create")
    record.add_argument("--layers", type=_positive, help="number of layers for a family's built-in config")
    record.add_argument("--seq-len", type=_positive, help="tokens per sequence (default: past the sliding window)")
    record.add_argument("--batch", type=_positive, help="sequences per batch (default 1)")
    record.add_argument(
        "--left-pad", type=_nonnegative, metavar="N", help="left-pad every batch row but the last (needs --batch 2+)"
    )
    record.add_argument("--seed", type=_nonnegative, help="seed of the random weights and input tokens (default 0)")
    _add_text_args(record)
    record.add_argument(
        "--dtype", choices=(*DTYPES, "float16"), help="compute dtype of the reference (default float32)"
    )
    record.add_argument(
        "--atol", type=_nonnegative_float, help="absolute tolerance the trace carries (default by dtype)"
    )
    record.add_argument(
        "--rtol", type=_nonnegative_float, help="relative tolerance the trace carries (default by dtype)"
    )
    record.add_argument(
        "--calibrate",
        action="store_true",
        default=None,
        help="carry per-node atol = 10x the reference's own error against float64 (recommended for other runtimes)",
    )
    record.add_argument(
        "--summaries",
        action="store_true",
        default=None,
        help="per-node statistics, a seeded sample and per-position norms instead of whole tensors (deep models)",
    )
    record.add_argument(
        "--sample", type=_positive, metavar="N", help="elements sampled per node with --summaries (default 1024)"
    )
    record.add_argument(
        "--save-weights",
        action="store_true",
        default=None,
        help="copy the weights into TRACE_DIR/weights (a Transformers checkpoint) for other runtimes to load",
    )
    record.add_argument(
        "--shard-size", metavar="SIZE", help="largest nodes-*.safetensors file, e.g. 500MB (default 1GB)"
    )
    record.add_argument(
        "--verify",
        type=_path(0),
        metavar="TRACE_DIR",
        help="re-run the reference of an existing trace and say whether the installed versions reproduce it",
    )
    record.add_argument(
        "--checkpoint",
        type=_path(CHECKPOINT_FILE),
        metavar="DIR",
        help="with --verify: the trace's checkpoint, when it is no longer where it was recorded",
    )
    record.add_argument(
        "--report-dir", type=_path(RESERVED), help="with --verify: parent folder of its report folder (default reports)"
    )
    record.add_argument(
        "--format", type=_formats, help="with --verify: comma list of html,csv,json,junit (default html,csv,json)"
    )
    compare = sub.add_parser(
        "compare",
        help="compare another runtime's dump, or a live PyTorch model, with a golden trace",
        description="Judges a dump (a folder of .safetensors files keyed by node name or .npy files named by node) or "
        "your model (--ours) against a trace made by `parity record`, with the metrics, hints, reports and exit codes "
        "of `parity check`.",
    )
    compare.add_argument("trace", metavar="TRACE_DIR", help="a folder written by parity record")
    compare.add_argument(
        "--dump", type=_path(0), metavar="DIR", help="the runtime's dump: a folder (or one file) of .safetensors/.npy"
    )
    compare.add_argument(
        "--name-map",
        metavar="FILE",
        help="with --dump: JSON {runtime name: node name or {node, permute, reshape}}; {i} is a layer index",
    )
    compare.add_argument(
        "--ours",
        metavar="MODULE:BUILD",
        help="your model instead of a dump: build(state_dict, hf_config) -> nn.Module, given the trace's weights",
    )
    compare.add_argument("--node-map", metavar="JSON", help="with --ours: {reference node or glob: your module path}")
    compare.add_argument(
        "--checkpoint",
        type=_path(CHECKPOINT_FILE),
        metavar="DIR",
        help="with --ours: the trace's checkpoint, when it is no longer where it was recorded",
    )
    compare.add_argument(
        "--mode",
        choices=("chained", "isolated", "both"),
        help="with --ours (a dump cannot continue from the reference's tensors): as parity check --mode",
    )
    compare.add_argument("--atol", type=_nonnegative_float, help="absolute tolerance instead of the trace's")
    compare.add_argument("--rtol", type=_nonnegative_float, help="relative tolerance instead of the trace's")
    compare.add_argument("--exact", action="store_true", help="atol = rtol = 0 on every node")
    compare.add_argument(
        "--tolerance",
        action="append",
        type=_tolerance_pattern,
        metavar="PATTERN=ATOL,RTOL",
        help="a node glob's own tolerance, winning over the others (repeatable), e.g. 'model.layers.*.self_attn.scores=1e-3,0'",
    )
    padding = compare.add_mutually_exclusive_group()
    padding.add_argument(
        "--ignore-padding",
        action="store_true",
        default=None,
        help="with --dump: do not judge padding positions (the default where the trace holds padding)",
    )
    padding.add_argument("--judge-padding", action="store_true", help="with --dump: judge padding positions too")
    compare.add_argument(
        "--report-dir", type=_path(RESERVED), default="reports", help="parent folder of the run's new report folder"
    )
    compare.add_argument(
        "--format", type=_formats, default=["html", "csv", "json"], help="comma list of html,csv,json,junit"
    )


# --- other runtimes: parity trace show, parity dump (issue 28) ------------------------------------------


def _tolerance_pattern(text: str) -> tuple[str, tuple[float, float]]:
    """``'PATTERN=ATOL,RTOL'`` -> ``(pattern, (atol, rtol))``, in --tolerance's words."""
    pattern, eq, values = text.rpartition("=")
    parts = values.split(",")
    try:
        atol, rtol = (float(parts[0]), float(parts[1])) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        atol = rtol = math.nan
    if not eq or not pattern or not (math.isfinite(atol) and math.isfinite(rtol)) or atol < 0 or rtol < 0:
        raise argparse.ArgumentTypeError(
            f"--tolerance {text!r} must be PATTERN=ATOL,RTOL (a node glob, two numbers >= 0), e.g. 'lm_head=1e-3,0'"
        )
    return pattern, (atol, rtol)


def _config_change(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` (VALUE read as JSON, else a string) for ``parity dump --set``."""
    import json

    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r} must be KEY=VALUE (a config.json field, a JSON value)")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _add_runtime_commands(sub) -> None:
    """``parity trace show`` (what a dump must match) and ``parity dump mlx|llama-cpp`` (the adapters of
    :mod:`parity.runtimes`)."""
    trace = sub.add_parser("trace", help="look into a golden trace")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True, parser_class=_Parser)
    show = trace_sub.add_parser(
        "show", help="the nodes, shapes, layouts, dtypes and tolerances a dump must match, and the inputs to feed"
    )
    show.add_argument("trace", metavar="TRACE_DIR", help="a folder written by parity record")
    show.add_argument("--json", action="store_true", help="print it as JSON")
    dump = sub.add_parser(
        "dump",
        help="run another runtime (mlx, llama-cpp) on a trace's inputs and write a dump for parity compare",
        description="Runs MODEL (a Transformers checkpoint folder such as TRACE_DIR/weights; for llama-cpp also a "
        ".gguf) with the runtime on the trace's inputs and writes a dump folder (tensors under node names and "
        "parity-dump.json: the runtime, what it cannot produce, notes) that `parity compare TRACE_DIR --dump OUT` judges.",
    )
    dump.add_argument("runtime", choices=("mlx", "llama-cpp"), help="the runtime: mlx (mlx-lm) or llama-cpp")
    dump.add_argument(
        "model", metavar="MODEL", help="a checkpoint folder (TRACE_DIR/weights) or, for llama-cpp, a .gguf"
    )
    dump.add_argument("--trace", required=True, metavar="TRACE_DIR", help="the golden trace whose inputs to run")
    dump.add_argument(
        "--out", required=True, type=_path(RESERVED), metavar="DUMP_DIR", help="the dump folder to create"
    )
    dump.add_argument(
        "--set",
        action="append",
        type=_config_change,
        metavar="KEY=VALUE",
        help="change a config.json field for this run (repeatable; a what-if: rope_theta=10000, rms_norm_eps=1e-5)",
    )
    dump.add_argument("--flash-attn", action="store_true", help="llama-cpp: llama.cpp's flash attention (default off)")
    dump.add_argument(
        "--cache-type", choices=("f32", "f16", "bf16", "q8_0"), help="llama-cpp: the KV cache's type (default f32)"
    )
    dump.add_argument(
        "--raw", action="store_true", help="llama-cpp: keep llama.cpp's own names (the name map goes in the dump)"
    )


def cmd_runtime(args, console: Console) -> int:
    """``parity trace show`` (exit 0) and ``parity dump`` (exit 0 when the dump is written, 2 on bad input
    or a runtime that is not installed)."""
    if args.command == "trace":
        return _trace_show(args, console)
    llama = args.runtime == "llama-cpp"
    for flag, given in (("--flash-attn", args.flash_attn), ("--cache-type", args.cache_type), ("--raw", args.raw)):
        if given and not llama:
            raise ParityError(f"{flag} goes with llama-cpp")
    changes = dict(args.set or ())
    from parity.golden.trace_file import read_trace

    trace = read_trace(args.trace)
    with console.status(f"running {args.model} with {args.runtime} on the inputs of {trace.path}"):
        if llama:
            from parity.runtimes import llama_cpp

            out = llama_cpp.dump(
                args.model,
                trace,
                args.out,
                flash_attn=bool(args.flash_attn),
                cache_type=args.cache_type or "f32",
                config_changes=changes,
                raw=bool(args.raw),
            )
        else:
            from parity.runtimes import mlx

            out = mlx.dump(args.model, trace, args.out, config_changes=changes)
    from parity.golden.dumps import read_dump, read_dump_info

    info = read_dump_info(out)
    for note in info.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    if info.unavailable:
        console.print(
            f"not produced by the runtime (untapped in compare): {len(info.unavailable)} node(s)", highlight=False
        )
    console.print(f"dump: {out} ({len(read_dump(out))} tensors, {info.runtime})", highlight=False)
    console.print(f"next: parity compare {trace.path} --dump {out}", highlight=False)
    return 0


def _trace_show(args, console: Console) -> int:
    import json

    from parity.golden.show import describe

    d = describe(args.trace)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    ref, probe = d["reference"], d["probe"]
    console.print(
        f"trace {d['trace']} ({d['kind']}): {ref['source']} ({ref['class']}, model_type {ref['model_type']}"
        + (f", family {ref['family']}" if ref.get("family") else "")
        + f"), recorded with torch {d['versions']['torch']}, Transformers {d['versions']['transformers']}",
        highlight=False,
    )
    pad = f", left padding {probe['left_pad']}" if probe.get("left_pad") else ""
    console.print(
        f"probe: {probe['dtype']}, batch {probe['batch_size']} x seq {probe['seq_len']}{pad}, seed {probe['seed']}; "
        "feed the runtime inputs.safetensors: "
        + ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in d["inputs"].items()),
        highlight=False,
    )
    t = d["tolerances"]
    console.print(f"tolerances: {'calibrated per node' if t['calibrated'] else 'fixed'} ({t['rule']})", highlight=False)
    table = Table(show_lines=False)
    for column in ("#", "node", "shape", "layout", "dtype", "atol", "rtol"):
        table.add_column(column, overflow="fold")
    for i, n in enumerate(d["nodes"]):
        table.add_row(
            str(i),
            n["name"],
            "(" + ", ".join(map(str, n["shape"])) + ")",
            n["layout"],
            n["dtype"] or "",
            f"{n['atol']:.3g}" if n["atol"] is not None else "",
            f"{n['rtol']:.3g}" if n["rtol"] is not None else "",
        )
    console.print(table)
    if d["unrecorded"]:
        console.print(f"never produced by the reference: {', '.join(d['unrecorded'])}", highlight=False)
    console.print(
        "a dump holds these names (or a --name-map's), in these layouts (a missing leading batch axis of 1 is fine); "
        "a node the runtime cannot produce is listed in the dump's parity-dump.json or the map's @unavailable",
        highlight=False,
    )
    return 0


def _add_user_model_args(parser, required: bool = False) -> None:
    parser.add_argument(
        "--ours",
        required=required,
        metavar="MODULE:BUILD",
        help="your model: build(state_dict, hf_config) -> nn.Module, as module:function or file.py:function",
    )
    parser.add_argument(
        "--reference",
        metavar="REF",
        help="with --ours: family[:config] (random weights), a checkpoint folder or a config.json "
        "(default: the family argument, or olmo3)",
    )
    parser.add_argument(
        "--node-map",
        metavar="JSON",
        help="with --ours: a JSON file {reference node or glob: your module path} overriding the alignment",
    )


def _node_map(path: str | None) -> dict | None:
    if path is None:
        return None
    import json

    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ParityError(
            f"--node-map {path}: {getattr(e, 'msg', None) or getattr(e, 'strerror', None) or e}"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ParityError(f"--node-map {path} must hold a JSON object of reference node -> your module path")
    return data


def _user_pair(args, console: Console):
    """The Pair of --ours against --reference (or the family argument)."""
    import torch

    from parity.user.check_model import build_user_pair, load_callable

    if args.family is not None and args.reference is not None:
        raise ParityError("give the reference once: the family argument or --reference, not both")
    for flag in ("config", "checkpoint", "layers"):
        if getattr(args, flag, None) is not None:
            raise ParityError(
                f"--{flag} does not apply with --ours; pass the reference as --reference family:config or a folder"
            )
    build = load_callable(args.ours)
    reference = args.reference or args.family or "olmo3"
    node_map = _node_map(args.node_map)
    placement = dict(device=getattr(args, "device", None), device_map=getattr(args, "device_map", None))
    with console.status(f"building the reference ({reference}) and your model ({args.ours})"):
        return build_user_pair(
            build, reference, dtype=getattr(torch, args.dtype), seed=args.seed, node_map=node_map, **placement
        )


def _print_alignment(pair, console: Console) -> None:
    table = Table(
        title=f"alignment: {sum(r.ours is not None for r in pair.alignment)} of {len(pair.alignment)} reference nodes"
    )
    table.add_column("reference node", no_wrap=True, overflow="fold")
    table.add_column("your model", overflow="fold")
    table.add_column("how")
    table.add_column("detail", overflow="fold")
    for r in pair.alignment:
        ours = "-" if r.ours is None else r.ours
        table.add_row(r.node, f"[red]{ours}[/]" if r.ours is None else ours, r.how, r.detail)
    console.print(table)


def cmd_align(args, console: Console) -> int:
    """Exit 0 when every reference node found a place in your model (taps may be missing), 1 otherwise."""
    args.family = None
    pair = _user_pair(args, console)
    _print_alignment(pair, console)
    unaligned = [r for r in pair.alignment if r.ours is None]
    for r in unaligned:
        console.print(f"[red]unaligned:[/] {r.node}: {r.detail}", highlight=False, soft_wrap=True)
    taps = sum(r.how == "tap" for r in pair.alignment)
    console.print(
        f"{len(pair.alignment) - len(unaligned)} aligned ({taps} expect a parity.tap call), {len(unaligned)} unaligned",
        highlight=False,
    )
    return 1 if unaligned else 0


def fit_table(
    columns: list[tuple], rows: Sequence[tuple[list[str], str | None]], console: Console, **table_kwargs
) -> Table | None:
    """A Table of the columns that fit ``console``'s width, dropping optional columns first.

    ``columns``: ``(header, options, drop_rank)`` where ``drop_rank`` is None for a column that is
    always kept and otherwise the order of dropping (1 first); ``rows``: ``(cells, row style)``.
    Node names go in ``no_wrap`` columns, so a name is never cut or wrapped mid-word: other columns
    go before it does. None when even the kept columns do not fit.
    """
    from rich.measure import Measurement

    dropped: set[int] = set()
    ranks = sorted((rank, i) for i, (_, _, rank) in enumerate(columns) if rank is not None)
    while True:
        keep = [i for i in range(len(columns)) if i not in dropped]
        table = Table(**table_kwargs)
        for i in keep:
            header, options, _ = columns[i]
            table.add_column(header, **options)
        for cells, style in rows:
            table.add_row(*(cells[i] for i in keep), style=style)
        wide = console.options.update_width(10_000)
        if Measurement.get(console, wide, table).minimum <= console.width:
            return _fix_widths(table, console, wide)
        if not ranks:
            return None
        dropped.add(ranks.pop(0)[1])


def _fix_widths(table: Table, console: Console, wide) -> Table:
    """Column widths that never go below a column's minimum (rich's own squeezing can cut a word):
    each column its minimum, the space left shared by how much more each would take."""
    try:  # rich's own column measure (not public API: without it, rich's layout stands)
        ranges = [table._measure_column(console, wide, column) for column in table.columns]
        extra = table._extra_width
    except AttributeError:
        return table
    spare = console.width - extra - sum(r.minimum for r in ranges)
    want = [r.maximum - r.minimum for r in ranges]
    if spare >= sum(want):
        return table  # everything fits at its natural width
    pad = 2  # a column's measure includes the Table's default padding, (0, 1)
    for column, r, w in zip(table.columns, ranges, want):
        column.width = r.minimum - pad + spare * w // sum(want)
    return table


def _node_table(result, console: Console) -> Table:
    """Every node: index, name (whole), status and the metrics that fit the console's width."""
    bad = result.first_mismatch
    colors = {
        "ok": "green",
        "mismatch": "red",
        "choice": "red",
        "shape": "magenta",
        "missing": "magenta",
        "nonfinite": "red",
        "untapped": "dim",
    }
    isolated = {r.name: r for r in result.isolated or []} if result.isolated is not result.nodes else {}
    fmt = lambda v, spec=".3g": "" if v is None else format(v, spec)
    columns = [
        ("#", dict(justify="right", no_wrap=True), 5),
        ("node", dict(no_wrap=True), None),
        ("status", dict(no_wrap=True), None),
        ("max_abs", dict(justify="right", no_wrap=True), 4),
        ("mean_abs", dict(justify="right", no_wrap=True), 1),
        ("cosine", dict(justify="right", no_wrap=True), 2),
    ]
    if isolated:
        columns.append(("isolated", dict(no_wrap=True), 3))
    rows = []
    for r in result.nodes:
        style = "bold reverse red" if bad is not None and r.index == bad.index else None
        cells = [
            str(r.index),
            r.name,
            f"[{colors.get(r.status, 'red')}]{r.status}[/]",
            fmt(r.max_abs),
            fmt(r.mean_abs),
            fmt(r.cosine, ".6f"),
        ]
        if isolated:
            iso = isolated.get(r.name)
            cells.append(f"[{colors.get(iso.status, 'red')}]{iso.status}[/] {fmt(iso.max_abs)}" if iso else "")
        rows.append((cells, style))
    title = f"{result.meta['family']} / {result.meta['config']} ({result.meta['dtype']})"
    table = fit_table(columns, rows, console, title=title)
    if table is None:  # narrower than one node name: fold rather than lose the end of a name
        table = Table(title=title)
        table.add_column("node", overflow="fold")
        table.add_column("status")
        for cells, style in rows:
            table.add_row(cells[1], cells[2], style=style)
    return table


def _print_coverage(coverage, console: Console) -> None:
    if coverage is None:
        return
    head = "[green]complete[/]" if coverage.ok else f"[red]{len(coverage.gaps)} gap(s)[/]"
    console.print(
        f"[bold]loader coverage:[/] {head}; {len(coverage.consumed)} checkpoint tensors consumed", highlight=False
    )
    from parity.util.text import grouped

    conversions = grouped(coverage.conversions)  # a cast checkpoint converts every tensor alike: said once
    skipped = [coverage.skipped_note()] if getattr(coverage, "skipped", None) else []
    notes = (coverage.derived_note(), coverage.numbers_note(), getattr(coverage, "from_config_note", lambda: None)())
    derived = [note for note in notes if note is not None]
    for label, lines in (
        ("tied", coverage.tied),
        ("conversion", conversions),
        ("copy", coverage.copies),
        ("skipped", skipped),
        ("derived", derived),
        ("gap", coverage.gaps),
    ):
        for line in lines:
            style = "red" if label == "gap" else "dim"
            console.print(f"  [{style}]{label}:[/] {line}", highlight=False, soft_wrap=True)


def _write_reports(result, parent: Path, formats: list[str]) -> Path:
    """The run's report folder, published whole; on a full disk or a read-only folder nothing is left
    visible and the one-line error (exit 2) says how much space the report needed."""
    from parity.report.result import WRITERS
    from parity.util.files import run_stem, write_folder

    def fill(folder: Path) -> None:
        for fmt in formats:
            result.write(fmt, folder / WRITERS[fmt].filename)

    return write_folder(
        parent, run_stem(result.meta["family"], result.meta["config"]), fill, f"the report ({', '.join(formats)})"
    )


def check_options(args, placement: bool = True) -> CheckOptions:
    """Everything about ``parity check``'s options that needs no model, in the options' own words,
    before anything is built, and the :class:`~parity.run.options.CheckOptions` they make. Raises
    ParityError. ``placement``: check --device / --device-map too (that imports torch)."""
    if args.checkpoint is not None and (args.config is not None or args.layers is not None):
        raise ParityError("--checkpoint brings its own config.json; do not combine it with --config or --layers")
    if args.calibrate and (args.atol is not None or args.rtol is not None):
        raise ParityError("--calibrate sets each node's atol itself (rtol 0); drop --atol/--rtol, or drop --calibrate")
    if args.exact and (args.atol is not None or args.rtol is not None or args.calibrate):
        raise ParityError("--exact sets atol = rtol = 0 on every node; drop --atol/--rtol/--calibrate, or drop --exact")
    if args.semantic and (args.atol is not None or args.rtol is not None or args.calibrate or args.exact):
        raise ParityError("--semantic sets each node's tolerance itself; drop --atol/--rtol/--calibrate/--exact")
    if args.semantic and args.decode is not None:
        raise ParityError("--decode runs in the model's dtype only; drop --semantic")
    if args.decode is not None:
        from parity.run.options import DecodePlan

        plan = DecodePlan.parse(args.decode)
        if args.mode != "chained" or args.calibrate:
            raise ParityError("--decode runs chained with fixed tolerances: drop --mode/--calibrate")
        if args.seq_len is not None and args.seq_len != plan.prefill:
            raise ParityError(
                f"--seq-len {args.seq_len} and --decode's prefill {plan.prefill} disagree: the prefill is the prompt"
            )
    if args.left_pad:
        if args.batch < 2:
            raise ParityError(
                f"--left-pad {args.left_pad} pads every batch row but the last, so it needs --batch 2 or more "
                f"(got --batch {args.batch})"
            )
        if args.seq_len is not None and args.left_pad >= args.seq_len:
            raise ParityError(f"--left-pad {args.left_pad} must be shorter than --seq-len {args.seq_len}")
    backward, step, lr = getattr(args, "backward", False), getattr(args, "step", None), getattr(args, "lr", None)
    causality = getattr(args, "causality", False)
    if step is not None and not backward:
        raise ParityError(f"--step {step} needs the gradients: add --backward")
    if lr is not None and (step is None or lr <= 0):
        raise ParityError("--lr is the step's learning rate: give --step too" if step is None else "--lr must be > 0")
    if (backward or causality) and args.decode is not None:
        raise ParityError("--backward and --causality run on the prompt, not through the KV cache: drop --decode")
    if placement:
        _check_placement(args)
    text = text_options(args)
    from parity.run.options import CheckOptions

    return CheckOptions(
        **text,
        backward=backward,
        step=step,
        lr=lr,
        causality=causality,
        seq_len=args.seq_len,
        batch_size=args.batch,
        left_pad=args.left_pad,
        mode=args.mode,
        atol=args.atol,
        rtol=args.rtol,
        calibrate=args.calibrate,
        exact=True if args.exact else None,
        decode=args.decode,
        semantic=args.semantic,
        **({"trace_memory": args.trace_memory} if args.trace_memory is not None else {}),
    )


def _check_placement(args) -> None:
    """--device / --device-map, in the options' words, before anything is built."""
    from parity.util.devices import Placement
    from parity.util.errors import ConfigError

    if args.device is not None and args.device_map is not None:
        raise ParityError("--device and --device-map both place the models; give one")
    try:
        Placement.of(args.device, args.device_map)
    except ConfigError as e:
        text = (
            str(e).replace("a device map needs", "--device-map needs").replace("device map must", "--device-map must")
        )
        raise ParityError(
            text.replace(f"device {args.device} cannot", f"--device {args.device} cannot", 1).replace(
                f"unknown device {args.device!r}", f"unknown --device {args.device!r}", 1
            )
        ) from None


def _check_left_pad(args, default_seq_len: int) -> None:
    """--left-pad against the sequence: --seq-len, the decode plan's prefill, or the config's default."""
    seq_len = args.seq_len or default_seq_len
    if args.decode is not None:
        from parity.run.options import DecodePlan

        seq_len = DecodePlan.parse(args.decode).prefill
    if args.left_pad and args.left_pad >= seq_len:
        raise ParityError(
            f"--left-pad {args.left_pad} must be shorter than the sequence ({seq_len} tokens by default for this "
            "config); pass a longer --seq-len or a smaller --left-pad"
        )


def check_usage(args) -> None:
    """What ``parity check``'s options alone can show wrong, before torch is imported. Raises ParityError."""
    if args.ours is None and args.family is None:
        raise ParityError("name a family (see `parity list`), or check your own model with --ours module:build")
    if args.ours is None and (args.reference is not None or args.node_map is not None):
        raise ParityError("--reference and --node-map go with --ours")
    for flag in ("config", "reference", "ours", "node_map", "decode", "device"):
        if getattr(args, flag, None) == "":
            raise ParityError(f"--{flag.replace('_', '-')} is empty")
    if args.ours is None:
        from parity.model.registry import family_names

        known = family_names()
        if args.family not in known:
            raise ParityError(f"unknown family {args.family!r}; known families: {', '.join(known) or 'none installed'}")
    check_options(args, placement=False)


def cmd_check(args, console: Console) -> int:
    import torch

    from parity import build as build_stage
    from parity.model.registry import get_family
    from parity.run.check import check

    check_usage(args)
    options = check_options(args)
    report_parent = _report_parent(args.report_dir)
    if args.ours is not None:
        pair = _user_pair(args, console)
    else:
        family = get_family(args.family)
        dtype = getattr(torch, args.dtype)
        overrides = {"n_layers": args.layers} if args.layers is not None else {}
        config = None if args.checkpoint else (args.config or family.default_config)
        if config is not None and config not in family.configs and Path(config).is_dir():
            raise ParityError(
                f"--config {config} is a folder: pass a checkpoint folder with --checkpoint, "
                "or the config.json inside it with --config"
            )
        if config is not None and args.left_pad and args.seq_len is None and args.decode is None:
            from parity.build.builder import default_seq_len, resolve_config

            # the default length comes from the config's facts: judge --left-pad before minutes of building
            _check_left_pad(args, default_seq_len(resolve_config(family, config, dtype, overrides)[2]))
        what = args.checkpoint or config
        if args.device is not None or args.device_map is not None:
            overrides.update(device=args.device, device_map=args.device_map)
        with console.status(f"building {family.name} pair ({what}, {args.dtype}): ours and {family.reference_class}"):
            pair = build_stage.build_pair(
                family, config=config, checkpoint=args.checkpoint, dtype=dtype, seed=args.seed, **overrides
            )
    _check_left_pad(args, pair.default_seq_len)
    if options.prompts or options.prompt_ids:
        result = _check_text(pair, options, console)
    else:
        with console.status("tracing both models and comparing every node"):
            result = check(pair, options=options)
    console.print(_node_table(result, console))
    _print_coverage(result.coverage, console)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    if result.text is not None:
        _print_text(result.text, console)
    bad = result.first_mismatch
    if bad is not None and bad.hint is not None:
        console.print(f"[bold]hint ({bad.hint.kind}):[/] {bad.hint.text}", highlight=False)
    if args.mode == "both":
        iso = result.first_isolated_mismatch
        line = "every node agrees on its own" if iso is None else f"first node failing on its own: {iso.line()}"
        console.print(f"[bold]isolated:[/] {line}", highlight=False)
    divergence = result.first_divergence
    if divergence is not None and (bad is None or divergence.name != bad.name):
        console.print(
            f"[bold]first divergence:[/] {divergence.name} (max_abs {divergence.max_abs:.3g}): the first node "
            "with any difference at all",
            highlight=False,
        )
    if result.origin_reason:
        console.print(f"[bold]origin:[/] {result.origin_reason}", highlight=False, soft_wrap=True)
    console.print(("[bold green]" if result.passed else "[bold red]") + result.verdict() + "[/]", highlight=False)
    replaced = result.coverage.replaced_note() if result.coverage is not None else None
    if replaced:  # a fault injected by hand: said once, under the finding it explains
        console.print(f"[yellow]note:[/] {replaced}", highlight=False)
    folder = _write_reports(result, report_parent, args.format)
    console.print(f"reports: {_shown(folder)}", highlight=False)
    return 0 if result.passed else 1


def _check_text(pair, options, console: Console):
    """A prompt-set check with a progress bar over its batches of prompts."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from parity.run.prompt_set import check_prompt_set

    with Progress(
        TextColumn("checking prompts"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label)

        return check_prompt_set(pair, options, progress=progress)


def _token_cells(prompt: dict, limit: int = 24) -> str:
    """``id:'piece'`` per position (the first ``limit``), escaped for rich."""
    from rich.markup import escape

    cells = [f"{i}:{p!r}" if p else str(i) for i, p in zip(prompt["ids"], prompt["pieces"])]
    more = f" ... ({len(cells)} tokens)" if len(cells) > limit else ""
    return escape(" ".join(cells[:limit]) + more)


def _print_text(text: dict, console: Console) -> None:
    """The prompt set: the tokens fed, per prompt KL / top-k, the logits verdict, disagreements, decode."""
    fmt = lambda v: "-" if v is None else f"{v:.3g}"
    table = Table(title=f"prompts ({text['count']})")
    table.add_column("#", justify="right")
    table.add_column("tokens (id:piece)", overflow="fold")
    for column in ("KL mean", "KL max", "top-1", "top-5"):
        table.add_column(column, justify="right")
    table.add_column("nodes")
    shown = text["prompts"][:50]
    for p in shown:
        table.add_row(
            str(p["index"]),
            _token_cells(p),
            fmt(p["kl_mean"]),
            fmt(p["kl_max"]),
            f"{p['top1_agreement']:.0%}",
            f"{p['top5_agreement']:.0%}",
            "[green]pass[/]" if p["passed"] else f"[red]{p['first_mismatch'] or 'FAIL'}[/]",
        )
    console.print(table)
    if len(text["prompts"]) > len(shown):
        console.print(f"... {len(text['prompts']) - len(shown)} more prompts in the reports", highlight=False)
    v = text["logits"]
    at = v["kl_max_at"]
    console.print(
        f"[bold]logits over {text['count']} prompt(s), {v['positions']} positions:[/] KL(reference || ours) mean "
        f"{fmt(v['kl_mean'])}, max {fmt(v['kl_max'])} nats (prompt {at['prompt']}, position {at['position']}); "
        f"top-1 agreement {v['top1_agreement']:.2%}, top-5 {v['top5_agreement']:.2%}; reference vs float64: KL mean "
        f"{fmt(v['noise_kl_mean'])}, max {fmt(v['noise_kl_max'])}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"[bold]judgement:[/] {v['judgement']}", highlight=False, soft_wrap=True)
    for d in text["disagreements"][:20]:
        tie = (
            " [yellow](a near-tie: within the reference's own error)[/]"
            if d["near_tie"]
            else ""
            if d["near_tie"] is None
            else " (not a near-tie)"
        )
        err = "" if d["ref_error"] is None else f", the reference's own error {d['ref_error']:.3g}"
        console.print(
            f"[red]top-1 disagrees:[/] prompt {d['prompt']} position {d['position']}: reference {d['token_ref']}, ours "
            f"{d['token_ours']}; the reference's margin {d['margin']:.3g}{err}{tie}",
            highlight=False,
            soft_wrap=True,
        )
    if len(text["disagreements"]) > 20:
        console.print(f"... {len(text['disagreements']) - 20} more disagreements in the reports", highlight=False)
    div = text.get("decode_divergence")
    if "decode_divergence" in text and div is None:
        console.print("[bold]greedy decoding:[/] ours picks the reference's token at every step of every prompt")
    elif div:
        console.print(
            f"[bold]greedy decoding:[/] first diverges at prompt {div['prompt']}, generated token {div['token']} "
            f"(schedule step {div['step']}): reference {div['token_ref']}, ours {div['token_ours']}",
            highlight=False,
        )


#: parity record's options that describe a new recording (none applies with --verify)
_RECORD_OPTIONS = (
    "target",
    "reference",
    "out",
    "layers",
    "seq_len",
    "batch",
    "left_pad",
    "seed",
    "dtype",
    "atol",
    "rtol",
    "calibrate",
    "summaries",
    "sample",
    "save_weights",
    "shard_size",
    "prompt",
    "prompts",
    "input_ids",
    "chat",
)


def _flag(dest: str) -> str:
    return "FAMILY[:CONFIG]" if dest == "target" else "--" + dest.replace("_", "-")


def cmd_record(args, console: Console) -> int:
    """Exit 0 when the trace is written (with --verify: when the installed versions reproduce it), 1
    when --verify finds it no longer reproduces, 2 on bad input."""
    given = [d for d in _RECORD_OPTIONS if getattr(args, d) is not None]
    if args.verify is not None:
        if given:
            raise ParityError(f"--verify re-runs the trace as it was recorded; {_flag(given[0])} does not apply")
        return _verify(args, console)
    for dest in ("checkpoint", "report_dir", "format"):
        if getattr(args, dest) is not None:
            raise ParityError(f"{_flag(dest)} goes with --verify")
    if (args.target is None) == (args.reference is None):
        raise ParityError("name what to record: a family (family[:config]) or --reference DIR|config.json, not both")
    if args.out is None:
        raise ParityError("--out TRACE_DIR is required: the folder the trace is written to")
    if args.layers is not None and args.target is None:
        raise ParityError("--layers goes with a family; a checkpoint or config.json brings its own depth")
    if args.calibrate and (args.atol is not None or args.rtol is not None):
        raise ParityError("--calibrate sets each node's atol itself (rtol 0); drop --atol/--rtol, or drop --calibrate")
    if args.calibrate and args.summaries:
        raise ParityError("--calibrate needs whole tensors (a float64 trace beside this one); drop it or --summaries")
    if args.sample is not None and not args.summaries:
        raise ParityError("--sample goes with --summaries")
    batch = args.batch or 1
    if args.left_pad:
        if batch < 2:
            raise ParityError(
                f"--left-pad {args.left_pad} pads every batch row but the last, so it needs --batch 2 or more"
            )
        if args.seq_len is not None and args.left_pad >= args.seq_len:
            raise ParityError(f"--left-pad {args.left_pad} must be shorter than --seq-len {args.seq_len}")
    import torch

    from parity.golden.record import record
    from parity.golden.summaries import DEFAULT_SAMPLE
    from parity.golden.trace_file import parse_size

    shard_bytes = parse_size(args.shard_size) if args.shard_size is not None else None
    source = args.target if args.target is not None else Path(args.reference).expanduser()
    dtype = args.dtype or "float32"
    from parity.run.options import CheckOptions

    options = CheckOptions(
        **text_options(args),
        seq_len=args.seq_len,
        batch_size=batch,
        left_pad=args.left_pad or 0,
        atol=args.atol,
        rtol=args.rtol,
        calibrate=bool(args.calibrate),
    )
    with console.status(f"recording the reference of {source} ({dtype})"):
        trace = record(
            source,
            args.out,
            n_layers=args.layers,
            dtype=getattr(torch, dtype),
            seed=args.seed or 0,
            summaries=bool(args.summaries),
            sample=args.sample or DEFAULT_SAMPLE,
            save_weights=bool(args.save_weights),
            options=options,
            **({"shard_bytes": shard_bytes} if shard_bytes is not None else {}),
        )
    m = trace.manifest
    for note in m.get("notes") or []:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    files = [f for f in m["files"] if f["name"].startswith("nodes-")]
    size = sum(f["bytes"] for f in m["files"])
    probe = m["probe"]
    console.print(
        f"recorded {m['reference']['source']} ({probe['dtype']}, {probe['batch_size']} x {probe['seq_len']} tokens): "
        f"{len(m['nodes'])} nodes as {m['kind']} in {len(files)} file(s), {size / 1e6:.3g} MB"
        + (f", weights in {trace.path / m['weights']['saved']}" if m["weights"].get("saved") else ""),
        highlight=False,
    )
    console.print(f"trace: {trace.path} (format {m['format']} version {m['version']})", highlight=False)
    return 0


def _print_compared(result, console: Console) -> None:
    """What parity check prints: the node table, loader coverage, notes, the hint, isolated mode, the
    verdict; a stale reference first and in bold."""
    console.print(_node_table(result, console))
    _print_coverage(result.coverage, console)
    for note in result.notes:
        if note.startswith("stale reference:"):
            console.print(f"[bold yellow]stale reference:[/] {note[len('stale reference: ') :]}", highlight=False)
        else:
            console.print(f"[yellow]note:[/] {note}", highlight=False)
    bad = result.first_mismatch
    if bad is not None and bad.hint is not None:
        console.print(f"[bold]hint ({bad.hint.kind}):[/] {bad.hint.text}", highlight=False)
    if result.meta.get("mode") == "both":
        iso = result.first_isolated_mismatch
        line = "every node agrees on its own" if iso is None else f"first node failing on its own: {iso.line()}"
        console.print(f"[bold]isolated:[/] {line}", highlight=False)


def _verify(args, console: Console) -> int:
    from parity.golden.trace_file import read_trace
    from parity.golden.verdict import verify

    report_parent = _report_parent(args.report_dir or "reports")
    trace = read_trace(args.verify)
    recorded = trace.manifest["versions"]
    with console.status(f"re-running the reference of {trace.path}"):
        result = verify(trace, args.checkpoint)
    _print_compared(result, console)
    now = result.meta["installed_versions"]
    console.print(
        f"recorded with torch {recorded.get('torch')}, Transformers {recorded.get('transformers')}; "
        f"re-run with torch {now['torch']}, Transformers {now['transformers']}",
        highlight=False,
    )
    if not result.passed:
        line = f"[bold red]does not reproduce: {result.verdict()}[/]"
    elif result.first_divergence is None:
        line = "[bold green]reproduces: every node bit for bit[/]"
    else:
        worst = max(
            (n for n in result.nodes if n.max_abs is not None),
            key=lambda n: cast(float, n.max_abs) / max(n.atol, 1e-300),
        )
        line = (
            f"[bold green]reproduces within the trace's tolerances[/] (not bit for bit: the largest difference is "
            f"max_abs {worst.max_abs:.3g} at {worst.name}, atol {worst.atol:g})"
        )
    console.print(line, highlight=False)
    folder = _write_reports(result, report_parent, args.format or ["html", "csv", "json"])
    console.print(f"reports: {_shown(folder)}", highlight=False)
    return 0 if result.passed else 1


def cmd_compare(args, console: Console) -> int:
    """Exit codes as parity check: 0 every node agrees with the trace, 1 a node fails, 2 bad input."""
    if (args.dump is None) == (args.ours is None):
        raise ParityError(
            "compare what: --dump DIR (another runtime's dump) or --ours MODULE:BUILD (a PyTorch model), one of them"
        )
    if args.dump is not None:
        for dest in ("node_map", "checkpoint"):
            if getattr(args, dest) is not None:
                raise ParityError(f"{_flag(dest)} goes with --ours; a dump is matched by name (--name-map)")
        if args.mode not in (None, "chained"):
            raise ParityError(
                f"--mode {args.mode} is not possible from a dump: isolated mode continues each node of ours "
                "from the reference's tensor, which needs a runtime parity drives (--ours)"
            )
    if args.ours is not None and args.name_map is not None:
        raise ParityError("--name-map goes with --dump; with --ours, --node-map overrides the alignment")
    if args.exact and (args.atol is not None or args.rtol is not None):
        raise ParityError("--exact sets atol = rtol = 0 on every node; drop --atol/--rtol, or drop --exact")
    from parity.run.options import CheckOptions

    options = CheckOptions(
        mode=args.mode or "chained",
        atol=args.atol,
        rtol=args.rtol,
        exact=bool(args.exact),
        tolerances=dict(args.tolerance or ()),
    )
    report_parent = _report_parent(args.report_dir)
    from parity.golden.trace_file import read_trace
    from parity.golden.verdict import compare_dump, compare_model

    trace = read_trace(args.trace)
    if args.dump is not None:
        with console.status(f"comparing {args.dump} with {trace.path}"):
            padding = False if args.judge_padding else args.ignore_padding
            result = compare_dump(trace, args.dump, args.name_map, options=options, ignore_padding=padding)
    else:
        from parity.user.check_model import load_callable

        build = load_callable(args.ours)
        with console.status(f"tracing {args.ours} on the trace's inputs"):
            result = compare_model(
                trace, build, node_map=_node_map(args.node_map), checkpoint=args.checkpoint, options=options
            )
    _print_compared(result, console)
    console.print(("[bold green]" if result.passed else "[bold red]") + result.verdict() + "[/]", highlight=False)
    replaced = result.coverage.replaced_note() if result.coverage is not None else None
    if replaced:
        console.print(f"[yellow]note:[/] {replaced}", highlight=False)
    folder = _write_reports(result, report_parent, args.format)
    console.print(f"reports: {_shown(folder)}", highlight=False)
    return 0 if result.passed else 1


def selftest_output(family, rows, console: Console) -> list:
    """Renderables for the selftest's rows: a table where the node names fit whole, else one block
    per fault (a label, then the name on its own line)."""
    from rich.text import Text

    def found(name, expected):
        return "-" if name is None else "same" if name == expected else name

    columns = [
        ("fault", dict(), None),
        ("expected node", dict(no_wrap=True), None),
        ("chained", dict(no_wrap=True), None),
        ("isolated", dict(no_wrap=True), None),
        ("hint", dict(no_wrap=True), None),
        ("hint text", dict(), 1),
        ("result", dict(no_wrap=True), None),
    ]
    cells = []
    for row in rows:
        fault = row.fault
        cells.append(
            (
                [
                    f"{fault.id}\n{fault.description}" + (f"\n({fault.source})" if fault.source else ""),
                    fault.expected,
                    found(row.chained, fault.expected),
                    found(row.isolated, fault.isolated_expected),
                    row.hint_kind or "-",
                    row.hint or "-",
                    "[green]pass[/]" if row.passed else "[red]FAIL[/]",
                ],
                None,
            )
        )
    title = f"parity selftest {family.name}: {len(rows)} faults"
    table = fit_table(columns, cells, console, title=title, show_lines=True)
    if table is not None:
        return [table]
    out: list[Text | str] = [Text(title, style="bold")]
    for row in rows:
        fault = row.fault
        verdict = "[green]pass[/]" if row.passed else "[red]FAIL[/]"
        out.append(
            f"{verdict} [bold]{fault.id}[/] {fault.description}" + (f" ({fault.source})" if fault.source else "")
        )
        out.append(f"  expected  {fault.expected}")
        if fault.isolated_expected != fault.expected:
            out.append(f"  expected  {fault.isolated_expected} (isolated)")
        out.append(f"  chained   {found(row.chained, fault.expected)}")
        out.append(f"  isolated  {found(row.isolated, fault.isolated_expected)}")
        out.append(f"  hint      {row.hint_kind or '-'}")
    return out


def cmd_selftest(args, console: Console) -> int:
    """Every fault of the family's catalogue, injected into a fresh pair: exit 1 if any is missed."""
    from parity.model.registry import get_family
    from parity.selftest.run import run_fault

    family = get_family(args.family)
    if args.fields:
        return _selftest_fields(family, console)
    if not family.faults:
        raise ParityError(f"family {family.name} has no fault catalogue")
    rows = []
    for fault in family.faults:
        with console.status(f"{fault.id}: {fault.description}"):
            rows.append(run_fault(family, fault))
    for renderable in selftest_output(family, rows, console):
        console.print(renderable, highlight=False)
    for row in rows:  # unfolded, for logs
        for problem in row.problems:
            console.print(f"{row.fault.id}: {problem}", highlight=False, soft_wrap=True)
    failed = [r.fault.id for r in rows if not r.passed]
    summary = f"{len(rows) - len(failed)} passed, {len(failed)} failed"
    console.print(("[bold green]" if not failed else "[bold red]") + summary + "[/]", highlight=False)
    return 1 if failed else 0


def _selftest_fields(family, console: Console) -> int:
    """``parity selftest <family> --fields``: exit 1 if a field's change goes unseen or shows elsewhere."""
    from parity.selftest.fields import audit_field

    fields = [f for f in family.fields if f.audited]
    if not fields:
        raise ParityError(f"family {family.name} declares no audited config fields")
    rows = []
    for f in fields:
        with console.status(f"field {f.key}"):
            rows.append(audit_field(family, f))
    columns = [
        ("field", dict(no_wrap=True), None),
        ("ours -> reference", dict(overflow="fold"), 2),
        ("seen at", dict(no_wrap=True), None),
        ("hint", dict(no_wrap=True), None),
        ("result", dict(no_wrap=True), None),
    ]
    cells = [
        (
            [
                r.field.key,
                f"{r.ours!r} -> {r.reference!r}",
                r.found or "unseen",
                r.hint_kind or "-",
                "[green]pass[/]" if r.passed else "[red]FAIL[/]",
            ],
            None,
        )
        for r in rows
    ]
    table = fit_table(columns, cells, console, title=f"parity selftest {family.name} --fields: {len(rows)} fields")
    console.print(table if table is not None else "\n".join(" ".join(c[:4]) for c, _ in cells), highlight=False)
    for r in rows:
        for problem in r.problems:
            console.print(f"{r.field.key}: {problem}", highlight=False, soft_wrap=True)
    failed = [r for r in rows if not r.passed]
    console.print(
        ("[bold green]" if not failed else "[bold red]") + f"{len(rows) - len(failed)} passed, {len(failed)} failed[/]",
        highlight=False,
    )
    return 1 if failed else 0


class _GateErrors:
    """pytest plugin for ``parity gate``: keeps the failure text of tests that broke (a bug, not a verdict)."""

    def __init__(self):
        self.failures: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failures[report.nodeid] = report.longreprtext

    def pytest_collectreport(self, report):
        if report.failed:
            self.failures[report.nodeid or "collection"] = report.longreprtext


def _gate_pytest(run, junit: Path | None, console: Console) -> tuple[int, _GateErrors]:
    """Run parity.gate.pytest_gate under pytest, in this process, on ``run``'s cases."""
    import pytest

    from parity.gate import pytest_plugin
    from parity.gate.run import gate_module_path

    module = gate_module_path()
    errors = _GateErrors()
    argv = [
        str(module),
        "-c",
        os.devnull,
        f"--rootdir={module.parent.parent}",
        f"--confcutdir={module.parent}",
        "--disable-plugin-autoload",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:terminal",
        "-s",
        "--parity-no-reports",
        "-o",
        "junit_suite_name=parity-gate",
    ] + ([f"--junitxml={junit}"] if junit is not None else [])
    saved = {
        k: os.environ.pop(k) for k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS") if k in os.environ
    }  # the gate's own run
    try:
        with console.status("running the gate") as status:
            run.on_case = lambda case: status.update(f"gate: {case.id}")
            code = pytest.main(argv, plugins=[pytest_plugin, run, errors])
    finally:
        os.environ.update(saved)
    return int(code), errors


def cmd_gate(args, console: Console) -> int:
    """Exit 0 when every case passes and nothing grew past its budget, 1 otherwise (2: bad input,
    130: interrupted, 3: a case broke with an error that is parity's bug)."""
    if args.paths and args.changed_since:
        raise ParityError("give changed PATHs or --changed-since, not both")
    if args.no_reports and args.report_dir is not None:
        raise ParityError("--no-reports writes no report folder: drop --report-dir, or drop --no-reports")
    from parity.gate.project import changed_since
    from parity.gate.run import GateRun, write_reports
    from parity.util.files import discard, publish_folder, run_stem, staging_folder

    report_parent = None if args.no_reports else _report_parent(args.report_dir or "reports")
    changed = changed_since(args.changed_since) if args.changed_since else (args.paths or None)
    run = GateRun.prepare(".", args.baseline, args.family, changed, args.update_baseline)
    for line in run.selection:
        console.print(f"[bold]selected:[/] {line}", highlight=False, soft_wrap=True)
    if not run.cases:
        console.print("gate: nothing to check", highlight=False)
        return 0
    staging = staging_folder(report_parent) if report_parent is not None else None
    try:
        code, errors = _gate_pytest(run, staging / "junit.xml" if staging else None, console)
        if code == 2:  # pytest's "interrupted"
            raise KeyboardInterrupt
        broken = [c.id for c in run.cases if c.id not in run.outcomes] + [n for n in run.names if n not in run.holes]
        if code not in (0, 1) or broken:
            for nodeid, text in errors.failures.items():
                print(f"{nodeid}\n{text}", file=sys.stderr)
            print(
                f"parity gate: {len(broken)} test(s) broke instead of giving a verdict (pytest exit {code})",
                file=sys.stderr,
            )
            return 3
        _print_gate(run, console)
        if run.update:
            run.finish()  # ParityError (exit 2) when any case fails
            console.print(f"baseline written: {run.baseline_path}", highlight=False)
        if staging is not None:
            assert report_parent is not None  # staging is made only under a report parent
            try:
                write_reports(run, staging)
                folder = publish_folder(staging, report_parent, run_stem("gate", "all").replace("gate-all-", "gate-"))
            except OSError as e:
                raise _gate_unwritten(e, run, staging, report_parent) from None
            staging = None
            console.print(f"reports: {_shown(folder)}", highlight=False)
    finally:
        run.close()
        if staging is not None:
            discard(staging)
    failed = sum(not o.passed for o in run.outcomes.values())
    holes = sum(len(h) for h in run.holes.values())
    style = "[bold green]" if run.passed else "[bold red]"
    console.print(
        f"{style}gate: {len(run.cases) - failed} of {len(run.cases)} cases pass, {failed + holes} failure(s)[/]",
        highlight=False,
    )
    return 0 if run.passed else 1


def _gate_unwritten(e: OSError, run, staging: Path, parent: Path):
    """The gate's report folder could not be written: the one-line error, with (on a full disk) the
    space it needed: pytest's junit.xml as written, the rest measured without writing it."""
    from parity.gate.run import write_reports
    from parity.util.files import cannot_write, disk_full, measuring

    needed = None
    if disk_full(e):
        junit = staging / "junit.xml"
        with measuring() as sizes:
            write_reports(run, staging)
        needed = sum(-(-n // 4096) * 4096 for n in sizes) + (junit.stat().st_size if junit.exists() else 0) + 8192
    return cannot_write(e, "the gate's report folder", parent, needed)


def _print_gate(run, console: Console) -> None:
    """One table row per case, then at most two lines per failing case (the report has every line)."""
    table = Table(title=f"parity gate ({len(run.cases)} cases)")
    for col in ("case", "nodes", "max max_abs", "loader coverage", "result"):
        table.add_column(col)
    for case in run.cases:
        outcome = run.outcomes[case.id]
        r = outcome.result
        worst = max((n.max_abs or 0.0 for n in r.nodes), default=0.0) if r else None
        coverage = (
            "-"
            if r is None or r.coverage is None
            else ("complete" if r.coverage.ok else f"{len(r.coverage.gaps)} gap(s)")
        )
        table.add_row(
            case.id,
            str(len(r.nodes)) if r else "-",
            "-" if worst is None else f"{worst:.3g}",
            coverage,
            "[green]pass[/]" if outcome.passed else "[red]FAIL[/]",
        )
    console.print(table)
    for outcome in run.outcomes.values():
        for line in outcome.summary():
            console.print(f"[red]{outcome.case.id}:[/] {line}", highlight=False, soft_wrap=True)
    for hole in (h for hs in run.holes.values() for h in hs):
        console.print(f"[red]config coverage:[/] {hole}", highlight=False, soft_wrap=True)
    for note in run.version_notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)


def cmd_list(console: Console) -> int:
    """Every registered family; one that cannot be loaded is listed with its error (exit 2)."""
    from parity.model.registry import family_names, get_family

    table = Table(title="registered families")
    for col in ("family", "reference", "config", "description"):
        table.add_column(col)
    broken = 0
    for family_name in family_names():
        try:
            fam = get_family(family_name)
        except ParityError as e:
            broken += 1
            table.add_row(family_name, "[red]unavailable[/]", "", str(e))
            continue
        for i, (name, desc) in enumerate(fam.config_descriptions.items()):
            shown = f"{name} (default)" if name == fam.default_config else name
            table.add_row(fam.name if i == 0 else "", fam.reference_class if i == 0 else "", shown, desc)
    console.print(table)
    return 2 if broken else 0


def _quiet_transformers() -> None:
    """Transformers' config warnings would break our one-line errors. Set through its environment
    variable, read when it is first imported (a usage error is answered before torch or Transformers
    loads), and directly where it already is (``main`` called in a process that imported it)."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    global _START
    _START = os.getcwd()
    console = Console()
    if not console.is_terminal:  # logs and CI: wide enough that node names are never cut
        console = Console(width=max(console.width, 140))
    err = Console(stderr=True)
    try:
        args = build_parser().parse_args(argv)
        if args.command == "check":
            check_usage(args)  # before torch: a usage error costs no import
        if args.command != "list":
            from parity.util.version import require_transformers

            require_transformers()  # a release outside the tested range: refused now, not a wrong verdict later
        _quiet_transformers()
        if args.command == "list":
            return cmd_list(console)
        if args.command == "selftest":
            return cmd_selftest(args, console)
        if args.command == "gate":
            return cmd_gate(args, console)
        if args.command == "align":
            return cmd_align(args, console)
        if args.command == "record":
            return cmd_record(args, console)
        if args.command == "compare":
            return cmd_compare(args, console)
        if args.command in ("trace", "dump"):
            return cmd_runtime(args, console)
        return cmd_check(args, console)
    except ParityError as e:
        err.print(f"parity: error: {e}", highlight=False, markup=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("parity: interrupted", highlight=False, markup=False)
        return 130
    except OSError as e:
        problem = _environment_problem(e)
        if problem is None:
            return _bug()
        err.print(f"parity: error: {problem}", highlight=False, markup=False, soft_wrap=True)
        return 2
    except Exception:  # a bug in parity, not bad input: keep the traceback, and say so
        return _bug()


def _bug() -> int:
    traceback.print_exc()
    from parity.util.version import bug_line

    print(bug_line(), file=sys.stderr)
    return 3


#: errors of the file system a user's input or machine causes (a full disk, a read-only or unreadable
#: file, a symbolic link loop, a name too long), never a bug of parity's
ENVIRONMENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "ELOOP", "ENAMETOOLONG", "EFBIG", "EMFILE", "ENFILE")
    if hasattr(errno, name)
)


def _environment_problem(e: OSError) -> str | None:
    """One line for an OSError the machine or the input caused (naming the file), or None for any other."""
    if e.errno not in ENVIRONMENT_ERRNOS:
        return None
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device{where}: nothing was written; free some space and run again"
    return f"{e.strerror}{where}"


if __name__ == "__main__":
    sys.exit(main())
