"""The semantic run: noise or bug, for a pair that is not bit-exact when correct (a user's model).

Two passes judge every node:

1. **Semantic** (float64): both models run in float64 under :class:`~parity.run.float64.Float64Mode`
   (so ``x.float()`` stays float64). Where the pair can (``Pair.rebuild64``: a user's ``build``),
   both are *rebuilt* from a float64 copy of the weights under the mode, so each derives its tables
   (RoPE frequencies) and weights (a norm's ``1 + w``) in float64 too; otherwise they are float64
   copies of the built models, and what a model derived in float32 when it was built stays
   float32-rounded. Rounding is then near 1e-15, except what is still baked in float32: how much
   each node moves under such rounding is measured on a float64 reference whose buffers (and, for
   copies, weights) move by one float32 ulp (random signs). A node of ours off by more than
   :data:`BAKED_ULPS` times that (and at least :data:`SEMANTIC` of its scale) computes another
   formula: an eps, a scale, a window, a position.
2. **Precision** (the run's dtype): each node within :data:`~parity.run.stages.SAFETY_FACTOR` times the
   reference's own error against the float64 reference at that node (floored): rounding as good as
   the reference's, whatever the order of operations; worse (a cast too early, a softmax in
   bfloat16) fails here.

A node's verdict is the semantic one when that fails, else the precision one; the first failing node
is the fault, with the hint of the run it failed in (float64 evidence is exact). A node that agrees
in float64 but differs in the run's dtype within its budget is rounding, counted and sized in a note.
"""

from __future__ import annotations

import time
import types
from dataclasses import replace
from typing import cast

import torch

from parity.compare.arbiter import arbitrated_note, is_arbitrated
from parity.compare.results import NodeResult, first_mismatch
from parity.compare.tolerances import Tolerances
from parity.model.pair import Loading, Pair
from parity.record.hooks import split_path
from parity.record.trace import Trace
from parity.report.result import CheckResult
from parity.run.float64 import Float64Mode, all_float64, float64_models
from parity.run.plan import Run
from parity.run.stages import (
    CALIBRATION_FLOOR,
    SAFETY_FACTOR,
    UNHOOKED,
    analyse,
    compare_run,
    config_diff,
    max_error,
    refuse_changed_weights,
    run_meta,
    settle_with_isolated,
    trace_ours,
    trace_reference,
)
from parity.util.errors import ParityError
from parity.util.resources import require
from parity.util.text import one_line

#: the least relative size of a float64 difference that is a difference of formula (float64 rounding
#: through a model stays below 1e-13)
SEMANTIC = 1e-9
#: how many times a node's movement under one-float32-ulp weights a float64 difference may reach and
#: still be rounding a model baked in (measured: 1-2x for RoPE tables and 1 + w norm weights computed
#: in float32; an eps of 1e-5 instead of 1e-6 moves a unit-scale norm 40x more)
BAKED_ULPS = 8.0
#: the relative move of every weight and buffer in the sensitivity run: one float32 ulp
ULP32 = 2.0**-23
#: by dtype; looked up with None too (a buffer of no known dtype), which is not a key
ULPS: dict[torch.dtype | None, float] = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float32: ULP32,
    torch.float64: 2.0**-52,
}

RULE = (
    "semantic run: both models {how} in float64 (a node off by more than {ulps:g}x what float32 ulps in the "
    "{what} move it computes another formula), then {dtype} within {k:g}x the reference's own {dtype} error against "
    "float64 (precision)"
)


def _node(trace: Trace, name: str):
    """The tensor ``trace`` holds for node ``name``: a first call's, or a later call's (a loop's pass)."""
    tensor = trace.tensors.get(name)
    return trace.later.get(name) if tensor is None else tensor


def _scale(trace: Trace, name: str) -> float:
    tensor = _node(trace, name)
    if tensor is None or not tensor.is_floating_point() or tensor.numel() == 0:
        return 1.0
    return float(tensor.detach().abs().double().nan_to_num(0.0, 0.0, 0.0).max()) or 1.0


def baked_sensitivity(
    pair64: Pair, run64: Run, ref64: Trace, original: torch.nn.Module, *, weights: bool = True
) -> dict[str, float]:
    """Per node, how far the float64 reference moves when each of its buffers (and, with ``weights``,
    its weights) moves by one float32 ulp (random signs, seeded): the size of rounding a model bakes
    in when it derives tables (or, copied to float64 after building, weights such as ``1 + w``) in
    float32 before it runs."""
    (moved,) = float64_models(pair64.reference, what="the sensitivity run of the semantic check")
    # a buffer (a RoPE table the model derived) moves by an ulp of its own dtype: a bfloat16 reference's
    # tables are bfloat16, and a port that keeps them in float32 computes the same formula
    own = {n: b.dtype for n, b in original.named_buffers()}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        seen = set()
        tensors: list[tuple[float, torch.Tensor]] = [(ULP32, p) for p in moved.parameters()] if weights else []
        tensors += [(ULPS.get(own.get(n), ULP32), b) for n, b in moved.named_buffers()]
        for ulp, t in tensors:
            if t.is_floating_point() and id(t) not in seen and t.numel():
                seen.add(id(t))
                signs = torch.randint(0, 2, t.shape, generator=gen).to(t.dtype) * 2 - 1
                t.mul_(1 + signs * ulp)
    moves: dict[str, float] = {}

    def measure(name: str, tensor: torch.Tensor) -> bool:
        base = _node(ref64, name)
        if base is not None and tuple(base.shape) == tuple(tensor.shape) and tensor.is_floating_point():
            moves[name] = max_error(base, tensor.to("cpu"))
        return True

    with Float64Mode():
        trace_reference(pair64, run64, model=moved, sink=measure).close()
    return moves


def semantic_tolerances(ref64: Trace, run: Run, baked: dict[str, float]) -> Tolerances:
    """Per node ``(max(BAKED_ULPS x its movement under float32 ulps, SEMANTIC x max |ref|), 0)`` in
    float64; node patterns the user gave win."""
    per = {
        name: (max(BAKED_ULPS * baked.get(name, 0.0), SEMANTIC * _scale(ref64, name)), 0.0)
        for name in [*ref64.tensors, *ref64.later]
    }
    return Tolerances(
        torch.float64, per_node=dict(run.tolerances.per_node), calibrated=per, calibrated_source="semantic"
    )


def precision_tolerances(pair: Pair, run: Run, ref: Trace, ref64: Trace) -> tuple[Tolerances, dict[str, float]]:
    """Per node ``(SAFETY_FACTOR x the reference's own error against float64, 0)``, floored; and the noise."""
    noise = {}
    for name in [*ref.tensors, *ref.later]:
        store, store64 = (ref.later, ref64.later) if name not in ref.tensors else (ref.tensors, ref64.tensors)
        a, b = store.lazy(name) if hasattr(store, "lazy") else store[name], store64.get(name)
        if b is not None and a is not None and tuple(a.shape) == tuple(b.shape) and a.is_floating_point():
            noise[name] = max_error(a, b)
    floor = CALIBRATION_FLOOR.get(pair.dtype, 1e-6)
    calibrated = {name: (max(SAFETY_FACTOR * err, floor), 0.0) for name, err in noise.items()}
    return replace(run.tolerances, calibrated=calibrated, exact=False, calibrated_source="precision"), noise


def _rebuilt(pair: Pair) -> tuple[torch.nn.Module, torch.nn.Module] | str:
    """Both models rebuilt in float64 (``pair.rebuild64``), or why not (a line for the notes)."""
    assert pair.rebuild64 is not None
    require(
        8 * sum(p.numel() for p in pair.reference.parameters()),
        "a float64 copy of the weights (the float64 semantic run)",
        "use a smaller config or drop the semantic run",
    )
    try:
        ours64, ref64 = pair.rebuild64()
    except ParityError as e:
        return f"rebuilding it in float64 failed ({one_line(e)})"
    except Exception as e:  # the user's build with a float64 state dict: any failure falls back, said
        return f"rebuilding it in float64 raised {type(e).__name__}: {one_line(e)[:200]}"
    low = all_float64(ours64)
    if low is not None:
        return f"rebuilt from float64 weights it still holds another dtype ({low})"
    altered = _altered(pair.reference, ref64)
    if altered is not None:  # a twin built from the class would not compute what the reference given computes
        return f"the reference given is not its class as built ({altered})"
    paths = {name for name, _ in ours64.named_modules()}
    lost = [n.ours for n in pair.nodes if "." in n.ours and split_path(n.ours)[0].partition("@")[0] not in paths]
    lost = [p for p in lost if not p.startswith(UNHOOKED)]
    if lost:
        return f"rebuilt it has no module {lost[0]}"
    return ours64.eval(), ref64.eval()


def _method_placed(value, twin) -> bool:
    """Whether ``value`` (an attribute of a given module's instance) is a function its twin built from the class
    does not hold there: a method replaced on the instance, or a function of other code. Modules, classes and
    callables the twin holds alike (an activation function both constructors set) are not."""
    if not isinstance(value, (types.MethodType, types.FunctionType)):
        return False
    mine, theirs = getattr(value, "__func__", value), getattr(twin, "__func__", twin)
    if twin is None or mine is theirs:
        return twin is None
    code = getattr(theirs, "__code__", None)
    return code is None or getattr(mine, "__code__", None) is not code


def _setting(value) -> bool:
    """A plain setting of a module: a number, a string, None, or a tuple or list of such."""
    if isinstance(value, (tuple, list)):
        return all(_setting(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def _altered(given: torch.nn.Module, built: torch.nn.Module) -> str | None:
    """How a reference passed in as a model differs from its class built anew from its config (the float64
    twin), or None: another module at some path (a norm replaced by an Identity), a forward replaced on an
    instance, forward hooks registered on a module, a plain setting changed on an instance, or a buffer holding
    other values (RoPE's inv_freq replaced). Such a reference is copied instead: a twin built from
    the class would compute otherwise, and its difference would be taken for the reference's own rounding."""
    mine = dict(built.named_modules())
    for name, module in given.named_modules():
        where = name or "the model"
        other = mine.get(name)
        if other is None or type(other) is not type(module):
            return f"{where} is a {type(module).__name__}" + (f", not a {type(other).__name__}" if other else "")
        if "forward" in vars(module):
            return f"{where}'s forward is replaced on the instance"
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{where} has forward hooks"
        theirs_attrs = vars(other)
        replaced = next((k for k, v in vars(module).items() if _method_placed(v, theirs_attrs.get(k))), None)
        if replaced is not None:  # another method set on the instance (xIELU's _xielu_python): forward calls it
            return f"{where}'s {replaced} is replaced on the instance"
        for key, value in vars(module).items():  # a setting changed on the instance (a combination strategy, a
            # padding, a group size set to None)
            if key == "training" or key.startswith("_") or not _setting(value) or key not in theirs_attrs:
                continue
            if _setting(theirs_attrs[key]) and theirs_attrs[key] != value:
                return f"{where}'s {key} is {value!r}, its class sets {theirs_attrs[key]!r}"
    theirs = dict(built.named_buffers())
    for name, buffer in given.named_buffers():  # a buffer set on the instance (RoPE's inv_freq replaced)
        other = theirs.get(name)
        if other is None or other.shape != buffer.shape:
            return f"its buffer {name} is not its class's"
        a, b = buffer.detach().double().cpu(), other.detach().double().cpu()
        # (a table the class computes in float32, XGLM's sinusoids, differs from the float64 twin's by its rounding)
        if a.is_floating_point() and not torch.allclose(a, b, rtol=1e-3, atol=1e-3, equal_nan=True):
            return f"its buffer {name} holds other values than its class computes"
    return None


def _pair64(pair: Pair) -> tuple[Pair, str | None]:
    """The pair in float64, and why its models are copies rather than rebuilt (None: rebuilt)."""
    why = "ours was given as a module (no build to call)" if pair.rebuild64 is None else None
    if pair.rebuild64 is not None:
        rebuilt = _rebuilt(pair)
        if not isinstance(rebuilt, str):
            ours64, ref64 = rebuilt
            return replace(
                pair, ours=ours64, reference=ref64, dtype=torch.float64, loading=_names_only(pair.loading), exact=False
            ), None
        why = rebuilt
    ours64, ref64 = float64_models(pair.ours, pair.reference)
    return replace(
        pair, ours=ours64, reference=ref64, dtype=torch.float64, loading=_names_only(pair.loading), exact=False
    ), why


def _names_only(loading: Loading) -> Loading:
    """What the float64 pair keeps of loading: coverage, which says by parameter name how ours holds each
    tensor (the rebuilt model has the same names), not the float32 tensors nor their storage."""
    return Loading(coverage=loading.coverage)


def _merge(semantic: list[NodeResult], precision: list[NodeResult]) -> list[NodeResult]:
    """Per node the semantic result when it fails or was arbitrated by the logits (a value misread in ours is so in
    any dtype: a bfloat16 run's logits are too rough to arbitrate it again), else the precision one (the same node
    order)."""
    by_name = {r.name: r for r in precision}
    out = []
    for r in semantic:
        p = by_name.get(r.name)
        out.append(r if r.failed or p is None or is_arbitrated(r) else p)
    return out


def check_semantic(pair: Pair, run: Run, notes: list[str], coverage) -> CheckResult:
    """The semantic run of :func:`parity.check` (see the module docstring)."""
    refuse_changed_weights(pair, "before the check")
    start = time.perf_counter()
    pair64, copied = _pair64(pair)
    run64 = replace(run, tolerances=Tolerances(torch.float64))
    with Float64Mode():
        ref64 = trace_reference(pair64, run64)
    # rebuilt, the weights are the checkpoint's values exactly on both sides; only a table a model
    # derives outside the mode (numpy, a constant) can be float32, and the buffers stand for those
    baked = baked_sensitivity(pair64, run64, ref64, pair.reference, weights=copied is not None)
    sem_tol = semantic_tolerances(ref64, run, baked)
    isolated = None
    with Float64Mode():
        if run.mode in ("isolated", "both"):
            iso_trace = trace_ours(pair64, run64, ref64, reference=ref64, tolerances=sem_tol)
            isolated = compare_run(pair64, run64, iso_trace, ref64, sem_tol, search=run.mode == "isolated")
            iso_trace.close()
        ours64 = None
        if run.mode != "isolated":
            ours64 = trace_ours(pair64, run64, reference=ref64, tolerances=sem_tol)
            semantic, isolated = settle_with_isolated(compare_run(pair64, run64, ours64, ref64, sem_tol), isolated)
        else:
            assert isolated is not None  # compared just above for this mode
            semantic = isolated
    ref = trace_reference(pair, run)
    prec_tol, noise = precision_tolerances(pair, run, ref, ref64)
    ours = trace_ours(pair, run, reference=ref, tolerances=prec_tol)
    precision = compare_run(pair, run, ours, ref, prec_tol, search=first_mismatch(semantic) is None)
    refuse_changed_weights(pair, "during the forward passes")
    nodes = _merge(semantic, precision)
    bad = first_mismatch(nodes)
    if bad is not None and bad.tol_source == "semantic":
        profile, logits = analyse(pair64, nodes, ours64, ref64)
    else:
        profile, logits = analyse(pair, nodes, ours, ref)
    dtype = str(pair.dtype).replace("torch.", "")
    rule = RULE.format(
        dtype=dtype,
        k=SAFETY_FACTOR,
        ulps=BAKED_ULPS,
        how="rebuilt" if copied is None else "copied",
        what="tables a model derives" if copied is None else "weights and tables",
    )
    notes = [*notes, rule]
    if (arbitrated := arbitrated_note(nodes)) is not None:
        notes.append(arbitrated)
    if copied is not None:
        notes.append(
            f"the float64 run uses float64 copies of both models: {copied}; float32 tables or weights ours derived "
            "before the run stay float32-rounded, so its tolerances are wider (a small eps difference may pass)"
        )
    rounding = [p for s, p in zip(semantic, precision, strict=False) if s.passed and p.passed and p.max_abs]
    if rounding:
        worst = max(rounding, key=lambda r: cast(float, r.max_abs))  # rounding nodes have one
        notes.append(
            f"rounding: {len(rounding)} node(s) agree in float64 and differ in {dtype} within the reference's own "
            f"{dtype} noise (largest {worst.max_abs:.3g} at {worst.name}, the reference's own error there "
            f"{noise.get(worst.name, 0.0):.3g})"
        )
    for trace in (ref64, ours64, ref, ours):
        if trace is not None:
            trace.close()
    meta = run_meta(pair, run, config_diff(pair), time.perf_counter() - start)
    meta["semantic"] = True
    meta["verdict_rule"] = rule
    return CheckResult(
        nodes=tuple(nodes),
        meta=meta,
        notes=tuple(notes),
        profile=profile,
        logits=logits,
        isolated=tuple(isolated) if isolated is not None else None,
        coverage=coverage,
        alignment=tuple(pair.alignment),
    )
