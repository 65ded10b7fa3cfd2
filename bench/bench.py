"""parity's benchmark: what a check costs next to the two bare forward passes, in time and memory.

    python bench/bench.py            # everything (about an hour on 2 cores)
    python bench/bench.py --quick    # OLMo 3 7B widths, 2 layers, 128 tokens
    python bench/bench.py --lock /tmp/parity-bigmem.lock   # on a shared machine: one big case at a time
    python bench/bench.py --backward --cases olmo3:7b-shape:128   # check(backward=True) / bare forward + backward

For every ``*-shape`` config of every registered family, at 128 tokens and at 4097 (past a real
4096-token sliding window), one child process per case: build the pair, then ``--repeats`` times
the two bare forward passes (ours and the reference, no hooks, the reference on the same eager
attention the check uses) and ``parity.check`` on the same tokens. It prints the median times, their
ratio, the process's peak RSS (``VmHWM``: weights, forward passes and traces together) over the
bytes of one copy of the weights, and what the traces spilled to disk; then OLMo 3 at 7B widths with
8 layers read from a sharded checkpoint (written first, into a temporary folder); then the wall
time of the default test suite. Numbers depend on the machine and on what else runs on it: the
header says which machine and its load.

Not a test: nothing here asserts a time (the README's table is its output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import parity.build

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3


def _peak_rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _weight_bytes(state_dict) -> int:
    seen, total = set(), 0
    for t in state_dict.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def child(spec: dict) -> dict:
    """One case, in this (fresh) process. Returns the measurements."""
    import torch

    import parity
    from parity.model.registry import get_family
    from parity.record import hf_capture

    family = get_family(spec["family"])
    start = time.perf_counter()
    if spec.get("checkpoint"):
        pair = parity.build.build_pair(family, checkpoint=spec["checkpoint"])
    else:
        pair = parity.build.build_pair(
            family, config=spec["config"], **({"n_layers": spec["layers"]} if spec.get("layers") else {})
        )
    build = time.perf_counter() - start
    hf_capture.install(pair.reference)  # the bare reference runs the same eager attention as the check
    ids = pair.make_inputs(spec["seq"])
    backward = bool(spec.get("backward"))
    bare, checks, result = [], [], None
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        if backward:
            bare_forward_backward(pair, ids)
        else:
            with torch.inference_mode():
                pair.ours(ids)
                pair.reference(input_ids=ids, use_cache=False)
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = parity.check(
            pair,
            seq_len=spec["seq"],
            **({"trace_memory": spec["trace_memory"]} if "trace_memory" in spec else {}),
            **({"backward": True} if backward else {}),
        )
        checks.append(time.perf_counter() - start)
    start = time.perf_counter()
    pair.changed_weights()  # the in-place edit check a check runs twice
    changed = time.perf_counter() - start
    return {
        **spec,
        "layers": pair.facts.num_layers,
        "changed_weights_s": changed,
        "build_s": build,
        "bare_s": bare,
        "check_s": checks,
        "ratio": statistics.median(checks) / statistics.median(bare),
        "ratio_best": min(checks) / min(bare),
        "weights": _weight_bytes(pair.loading.state_dict),
        "peak_rss": _peak_rss(),
        "spilled": result.meta.get("trace_spilled_bytes", 0),
        "verdict": result.verdict().splitlines()[0],
        "passed": result.passed,
    }


def bare_forward_backward(pair, ids) -> None:
    """What a training step of both models costs without parity: each in train mode (dropout off, as the
    check runs them), its loss (ours: Transformers' loss on its logits; the reference: its own) and the
    gradients of every parameter (``torch.autograd.grad``, as the check takes them), one model after the other."""
    import torch

    from parity.run.backward import causal_lm_loss, default_labels, training

    labels = default_labels(ids)
    with training(pair.ours, pair.reference):
        loss = causal_lm_loss(pair.ours(ids), labels, pair.vocab_size)
        torch.autograd.grad(loss, [p for p in pair.ours.parameters() if p.requires_grad], allow_unused=True)
        del loss
        loss = pair.reference(input_ids=ids, labels=labels, use_cache=False).loss
        torch.autograd.grad(loss, [p for p in pair.reference.parameters() if p.requires_grad], allow_unused=True)


def write_checkpoint(spec: dict) -> dict:
    """Write ``spec``'s random weights as a sharded checkpoint folder (``save_pretrained``)."""
    from parity.model.registry import get_family

    pair = parity.build.build_pair(get_family(spec["family"]), config=spec["config"], n_layers=spec["layers"])
    pair.reference.save_pretrained(spec["checkpoint"], max_shard_size="2GB")
    return {"shards": len(list(Path(spec["checkpoint"]).glob("*.safetensors")))}


class _Lock:
    """An exclusive flock on ``path`` while a case runs (None: no lock), so that on a shared machine
    the memory-hungry cases of several users take turns instead of running at once."""

    def __init__(self, path: str | None):
        self.path, self.fh = path, None

    def __enter__(self):
        if self.path:
            import fcntl

            self.fh = open(self.path, "a")
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fh is not None:
            self.fh.close()  # releases the lock


def run_child(spec: dict, timeout: float, lock: str | None = None, mode: str = "--child") -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        with _Lock(lock):
            done = subprocess.run(
                [sys.executable, __file__, mode, json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                cwd=ROOT,
            )
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {**spec, "error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(lines[-1])


def shape_cases(seq_lens: list[int], repeats: dict[int, int]) -> list[dict]:
    from parity.model.registry import family_names, get_family

    cases = []
    for name in family_names():
        for config in get_family(name).configs:
            if config.endswith("-shape"):
                cases += [dict(family=name, config=config, seq=seq, repeats=repeats.get(seq, 1)) for seq in seq_lens]
    return cases


def suite_seconds() -> dict:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    tail = (done.stdout.strip().splitlines() or ["?"])[-1]
    return {"seconds": time.perf_counter() - start, "summary": tail.strip("= "), "exit": done.returncode}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            total = int(next(line for line in fh if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        total = 0
    import torch

    return (
        f"{cpu}, {os.cpu_count()} cores, {total / GIB:.0f} GiB, Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )


def load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def table(rows: list[dict]) -> str:
    out = [
        "| case | tokens | layers | check / bare | check s | bare s | peak RSS / weights | weights GiB | spilled GiB | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        case = f"{r['family']} {r.get('label') or r['config']}"
        if "error" in r:
            out.append(f"| {case} | {r['seq']} | {r.get('layers', '')} | | | | | | | error: {r['error']} |")
            continue
        out.append(
            f"| {case} | {r['seq']} | {r['layers']} | {r['ratio']:.2f} | {statistics.median(r['check_s']):.1f} | "
            f"{statistics.median(r['bare_s']):.1f} | {r['peak_rss'] / r['weights']:.2f} | {r['weights'] / GIB:.1f} | "
            f"{r['spilled'] / GIB:.1f} | {'pass' if r['passed'] else r['verdict']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--write-checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="only OLMo 3 at 7B widths, 2 layers, 128 tokens")
    parser.add_argument(
        "--cases", help="only these cases: comma list of family:config:tokens (no sharded case, no suite)"
    )
    parser.add_argument("--seq-lens", default="128,4097", help="comma list of sequence lengths (default 128,4097)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="check and bare-forward repeats at 128 tokens (default 3; 1 past it)"
    )
    parser.add_argument("--no-sharded", action="store_true", help="skip the 8-layer sharded checkpoint case")
    parser.add_argument("--no-suite", action="store_true", help="skip the test suite's wall time")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per case (default 3600)")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument(
        "--backward",
        action="store_true",
        help="check with backward=True against a bare forward + backward of both models (train mode, "
        "autograd.grad of every parameter) instead of the bare forward passes",
    )
    parser.add_argument(
        "--lock", metavar="FILE", help="hold an flock on FILE around each case (a machine shared with others)"
    )
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.write_checkpoint:
        print(json.dumps(write_checkpoint(json.loads(args.write_checkpoint))), flush=True)
        return 0

    sys.path.insert(0, str(ROOT))
    print(f"machine: {machine()}\nload average at start: {load()}", flush=True)
    seqs = [int(s) for s in args.seq_lens.split(",")]
    if args.cases:
        cases = [
            dict(family=f, config=c, seq=int(t), repeats=args.repeats if int(t) <= 128 else 1)
            for f, c, t in (item.split(":") for item in args.cases.split(","))
        ]
    elif args.quick:
        cases = [dict(family="olmo3", config="7b-shape", seq=128, repeats=args.repeats)]
    else:
        cases = shape_cases(seqs, {128: args.repeats})
        cases.insert(
            0, dict(family="olmo3", config="7b-shape", layers=1, seq=128, repeats=1, label="7b-shape (1 layer)")
        )
    rows = []
    for spec in cases:
        if args.backward:
            spec["backward"] = True
        print(f"running {spec}", file=sys.stderr, flush=True)
        rows.append(run_child(spec, args.timeout, args.lock))
    if not (args.quick or args.cases or args.no_sharded):
        folder = Path(tempfile.mkdtemp(prefix="parity-bench-"))
        try:
            spec = dict(family="olmo3", config="7b-shape", layers=8, checkpoint=str(folder / "ckpt"))
            print(f"writing {spec}", file=sys.stderr, flush=True)
            written = run_child(spec, args.timeout, args.lock, mode="--write-checkpoint")
            shards = written.get("shards", 0)
            label = f"7b-shape (8 layers, checkpoint in {shards} shards)"
            case = dict(
                family="olmo3", config="7b-shape", checkpoint=spec["checkpoint"], seq=128, repeats=1, label=label
            )
            print(f"running {case}", file=sys.stderr, flush=True)
            rows.append(run_child(case, args.timeout, args.lock) if shards else {**case, "error": written.get("error")})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(table(rows))
    if not (args.quick or args.cases or args.no_suite):
        suite = suite_seconds()
        print(f"\ndefault test suite (`HF_HUB_OFFLINE=1 pytest -q`): {suite['seconds']:.0f} s wall, {suite['summary']}")
        rows.append({"suite": suite})
    print(f"load average at end: {load()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
