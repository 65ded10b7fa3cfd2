"""Training parity: the loss, every node's gradient, every parameter's gradient, one optimizer step,
and causality, after the forward check (``check(pair, backward=True)``, ``causality=True``).

A from-scratch model is written to be trained: the same loop (``logits = model(ids)``,
cross-entropy on the shifted labels, ``backward``, ``step``) with the architecture swapped inside.
A forward that agrees does not make training agree: a ``.detach()`` in RoPE, an in-place op, an
untied copy of a tied embedding, a loss over padding, labels shifted twice, dropout left on. This
stage compares what training reads, node by node, in backward order:

1. The forward check runs first (chained, as usual); if a node fails there, nothing here is judged
   (one note says so and the result keeps the forward's verdict).
2. Both models in train mode with dropout off (:func:`training`: every ``nn.Dropout``'s ``p`` and
   every float attribute named ``*dropout*`` set to 0, restored after; every floating parameter
   requires grad for the run). ``train/logits``: ours' logits in train mode against the reference's,
   judged as the forward judged the logits; if they differ, the model whose train mode differs from
   its eval mode is named (hint ``dropout``) and no gradient is compared.
3. ``loss``: the reference's is its own (``model(..., labels=labels).loss``: Transformers'
   ``ForCausalLMLoss``, :func:`causal_lm_loss`); ours' is its own when its ``forward`` takes
   ``labels`` and returns a loss (a scalar, a tuple starting with one, or an object with ``.loss``),
   so a user's loss bugs show; else parity computes Transformers' loss from ours' logits. The labels
   are the input ids with padding -100 (:func:`default_labels`) unless given.
4. ``grad/<node>``: the gradient of the loss with respect to every node's tensor, taken by a tensor
   hook registered when the recording sees the live tensor (:attr:`~parity.record.trace.Trace.live`),
   through the node's own layout transform (a reshape, permute or row selection maps a gradient as it
   maps the value), stored in a :class:`~parity.record.trace.Trace` that spills past the trace
   budget; compared in reverse forward order (``grad/logits`` first, the embedding last). A node
   whose gradient reaches the reference but not ours is ``missing`` (hint ``detached``, or
   ``in_place`` when ours' backward raised); one whose recorded value is off the reference's
   autograd path (recomputed for recording: attention ``scores``, one expert's output) or off both
   paths (an integer node, a state the loss never reads) is ``untapped``, with the reason.
5. ``grad/<reference parameter>``: ``torch.autograd.grad(loss, parameters)`` per model (the weights
   are shared: nothing accumulates into ``.grad``), ours' gradient brought into the reference
   parameter's layout through loader coverage's :class:`~parity.build.coverage.Source` records
   (transposed, fused rows, views of a fused tensor, ``w + 1``, another shape). A tie is one
   Parameter, whose gradient already sums both uses; copies of a tied tensor in ours fail, hint
   ``untied_copy``.
6. ``step/<reference parameter>`` (``step="adamw"``/``"sgd"``, ``lr``): one ``torch.optim`` step of each
   model's own parameters (float32 copies, one parameter at a time: the step is elementwise) with its
   own gradients; the updated weights compared (:func:`step_tolerance` says how).
7. ``causal/<node>`` (``causality=True``, :func:`causality`): each node of ours at position ``t``
   must not change when only tokens after ``t`` change; the reference is held to the same (a note).

Tolerances: a pair claimed bit-exact is judged at atol = rtol = 0 (our families' gradients are
bit-identical in float32 and bfloat16, tests/test_backward.py); otherwise a gradient node's atol is
the run's atol (default: the dtype's) times the largest |reference gradient| of that node, its rtol
the run's: gradients have no natural unit (a mean over N tokens divides them by N), so the absolute
part scales with the node's own gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from parity.build.coverage import COPY, LAYOUT, OFFSET, PART, ROWS, SHARED, SLICE, TRANSPOSED, Coverage, Source
from parity.compare.metrics import CHUNK, MISSING, OK, UNTAPPED, chunks, tensor_metrics
from parity.compare.results import NodeResult, compare_node, first_mismatch
from parity.compare.tolerances import Tolerances, default_tolerance
from parity.diagnose import backward as hints
from parity.model.pair import NodeSpec, Pair
from parity.model.weights import storage_key
from parity.record import hf_capture, hf_kernels
from parity.record.hooks import recording
from parity.record.trace import Trace, first_tensor
from parity.report.result import CheckResult
from parity.run.memory import backward_bytes, causality_bytes
from parity.run.options import DEFAULT_LR
from parity.run.plan import Run, weight_bytes
from parity.run.stages import device_of, forward_accepts, on_device, ours_recording, run_ours
from parity.util.errors import ParityError
from parity.util.resources import require
from parity.util.text import one_line

GRAD, STEP, TRAIN, CAUSAL = "grad/", "step/", "train/", "causal/"
LOSS = "loss"
#: label of a position the loss ignores (Transformers' ``ignore_index``)
IGNORE_INDEX = -100
#: node kinds the functional capture of a user's model may record from a recomputation (an SDPA call's
#: scores and probabilities): without a gradient in ours they are not judged, never called detached
RECOMPUTED_KINDS = ("scores", "probs")
#: positions tested for causality: every one for sequences up to this long, else this many spread out
CAUSAL_POSITIONS = 16
WHOLE = (SHARED, COPY, TRANSPOSED, OFFSET, LAYOUT)


# --- labels and the loss ---------------------------------------------------------------------------


def default_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The labels a causal LM is trained with: ``input_ids`` ``(batch, seq)`` themselves (the loss
    shifts them), -100 where ``attention_mask`` is 0 (padding is never a target)."""
    labels = input_ids.clone().long()
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask.to(labels.device) == 0, IGNORE_INDEX)
    return labels


def check_labels(run: Run, vocab_size: int) -> None:
    """Given labels must have the input ids' shape and hold token ids in ``[0, vocab_size)`` or -100.
    Raises ParityError."""
    labels = run.options.labels
    if labels is None:
        return
    if tuple(labels.shape) != tuple(run.input_ids.shape):
        raise ParityError(f"labels have shape {tuple(labels.shape)}, input_ids {tuple(run.input_ids.shape)}")
    ids = labels[labels != IGNORE_INDEX]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ParityError(
            f"labels must be token ids in [0, {vocab_size}) or -100, got [{int(ids.min())}, {int(ids.max())}]"
        )


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Transformers' ``ForCausalLMLoss`` (``transformers.loss.loss_utils``), op for op: logits
    ``(batch, seq, vocab)`` upcast to float32, labels ``(batch, seq)`` padded with -100 on the right
    and shifted one left (position ``t`` predicts token ``t + 1``), cross-entropy averaged over the
    positions whose label is not -100. Returns a float32 scalar."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    return F.cross_entropy(logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="mean")


def _explicit(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` names the parameter ``name`` (not only through ``**kwargs``)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def loss_and_logits(output) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(loss, logits)`` of what a model's forward returned: a 0-d tensor is a loss; a tuple or list
    starting with a 0-d tensor is ``(loss, logits, ...)``; an object with ``.loss`` (a Transformers
    ``ModelOutput``) gives its ``.loss`` and ``.logits``; anything else is the logits (its first tensor)."""
    if isinstance(output, torch.Tensor):
        return (output, None) if output.dim() == 0 else (None, output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        rest = next((t for t in output[1:] if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        return output[0], rest
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        logits = getattr(output, "logits", None)
        return loss, logits if isinstance(logits, torch.Tensor) else None
    return None, first_tensor(output)


# --- train mode ------------------------------------------------------------------------------------


@dataclass
class Training:
    """What :func:`training` changed, to say so: dropout modules and attributes set to 0."""

    modules: int = 0
    attributes: int = 0

    def note(self) -> str:
        zeroed = f"{self.modules} dropout module(s) and {self.attributes} dropout attribute(s) set to 0"
        return f"backward: both models ran in train mode with dropout off ({zeroed} for the run, restored after)"


@contextlib.contextmanager
def training(*models: nn.Module) -> Iterator[Training]:
    """Put ``models`` in train mode with dropout off for the block, and every floating parameter
    requiring grad; everything is restored after (mode, ``p``, attributes, ``requires_grad``).

    Dropout off: every ``nn.Dropout`` (any ``_DropoutNd``) gets ``p = 0``, and every float
    attribute of a module whose name contains ``dropout`` (Transformers' ``attention_dropout``,
    read in forward as ``dropout=0.0 if not self.training else self.attention_dropout``) is set to 0.0.
    """
    changed = Training()
    undo: list = []
    try:
        for model in models:
            undo.append((model.train, model.training))
            for module in model.modules():
                if isinstance(module, nn.modules.dropout._DropoutNd) and module.p:
                    undo.append((module, "p", module.p))
                    module.p = 0.0
                    changed.modules += 1
                for name, value in list(vars(module).items()):
                    if "dropout" in name.lower() and isinstance(value, float) and value:
                        undo.append((module, name, value))
                        setattr(module, name, 0.0)
                        changed.attributes += 1
            for p in model.parameters():
                if p.is_floating_point() and not p.requires_grad:
                    undo.append((p, "requires_grad", False))
                    p.requires_grad_(True)
            model.train()
        yield changed
    finally:
        for item in reversed(undo):
            if len(item) == 2:
                item[0](item[1])  # model.train(was)
            elif item[1] == "requires_grad":
                item[0].requires_grad_(item[2])
            else:
                setattr(item[0], item[1], item[2])


# --- one model's forward and backward --------------------------------------------------------------


@dataclass
class GradPass:
    """One model's forward in train mode and its backward: the loss (float32 scalar on the CPU, or
    None), where it came from, the node gradients (``grads``, in the reference's layout, spilling past
    the budget), which nodes were recorded and which of those required grad, the parameters (in
    ``named_parameters`` order, one per Parameter) with their gradients, and the error ours'
    backward raised, if any."""

    side: str
    grads: Trace
    loss: torch.Tensor | None = None
    loss_source: str = ""
    produced: set[str] = field(default_factory=set)
    live: set[str] = field(default_factory=set)
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    param_grads: dict[int, torch.Tensor | None] = field(default_factory=dict)
    error: str = ""
    #: ours' ``train/logits`` result (compared as ours ran)
    train: NodeResult | None = None

    def close(self) -> None:
        self.grads.close()


def _unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _live_hook(grads: Trace, produced: set[str], live: set[str], wanted: frozenset[str]):
    """The :attr:`Trace.live` callback: a gradient hook on each recorded tensor that requires grad,
    storing the gradient through the node's transform (a CPU copy, or spilled)."""

    def see(name: str, tensor: torch.Tensor, transform) -> None:
        if name not in wanted:
            return
        produced.add(name)
        if not (isinstance(tensor, torch.Tensor) and tensor.requires_grad):
            return
        live.add(name)

        def hook(grad: torch.Tensor, _name=name, _t=transform):
            with torch.no_grad():
                grads.keep(_name, (_t(grad) if _t is not None else grad).detach())

        tensor.register_hook(hook)

    return see


def _reference_points(pair: Pair, model) -> dict:
    """:func:`recording` arguments for the reference (as :func:`~parity.run.stages.trace_reference`
    records it), without the root's output: with labels its first tensor is the loss."""
    hf_capture.install(model)
    captured = [n.name for n in pair.nodes if hf_capture.is_captured(n.name)]
    return dict(
        points=[(n.name, n.reference_path) for n in pair.nodes if n.name not in captured and n.reference_path != ""],
        transforms={n.name: n.reference_transform for n in pair.nodes if n.reference_transform is not None},
        captured=captured,
        module_stack=any(hf_kernels.is_kernel_node(name) for name in captured),
    )


def _ours_points(pair: Pair) -> dict:
    args = ours_recording(pair)
    args["points"] = [(name, path) for name, path in args["points"] if path != ""]
    return args


def _root_node(pair: Pair) -> NodeSpec | None:
    return next((n for n in pair.nodes if n.reference_path == ""), None)


def _backward(side: GradPass, loss: torch.Tensor) -> None:
    params = [p for _, p in side.params]
    if not loss.requires_grad:
        side.error = "the loss does not require grad: nothing in the forward is on an autograd path"
        side.param_grads = {id(p): None for p in params}
        return
    try:
        found = torch.autograd.grad(loss, params, allow_unused=True)
    except RuntimeError as e:
        side.error = one_line(e)
        side.param_grads = {id(p): None for p in params}
        return
    side.param_grads = {id(p): (None if g is None else g.detach()) for p, g in zip(params, found)}


def reference_pass(pair: Pair, run: Run, labels: torch.Tensor) -> GradPass:
    """The reference's forward in train mode (with ``labels``: its own loss) and backward. Its
    train-mode logits are kept in its gradient trace as ``train/logits``."""
    model = pair.reference
    side = GradPass("reference", Trace.spilling(run.trace_memory))
    wanted = frozenset(n.name for n in pair.nodes)
    sink = Trace(sink=lambda name, t: True, live=_live_hook(side.grads, side.produced, side.live, wanted))
    device = device_of(model)
    root = _root_node(pair)
    with torch.enable_grad(), recording(model, into=sink, **_reference_points(pair, model)):
        out = model(
            input_ids=on_device(device, run.input_ids),
            attention_mask=on_device(device, run.attention_mask),
            position_ids=on_device(device, run.position_ids),
            labels=on_device(device, labels),
            use_cache=False,
        )
    loss, logits = out.loss, out.logits
    side.loss, side.loss_source = loss.detach().float().cpu(), f"{type(model).__name__}'s own (ForCausalLMLoss)"
    side.grads.keep(TRAIN + "logits", logits.detach())
    if root is not None and logits.requires_grad:
        _live_hook(side.grads, side.produced, side.live, wanted)(root.name, logits, None)
    side.params = _unique_params(model)
    _backward(side, loss)
    return side


def _reraise(e: BaseException):
    raise e


def ours_pass(pair: Pair, run: Run, labels: torch.Tensor, reference: GradPass, train_spec: NodeSpec, tol) -> GradPass:
    """Ours' forward in train mode and backward. Its train-mode logits are compared with the
    reference's as they come (``train/logits``); when they differ, no backward runs."""
    model = pair.ours
    side = GradPass("ours", Trace.spilling(run.trace_memory))
    wanted = frozenset(n.name for n in pair.nodes)
    sink = Trace(sink=lambda name, t: True, live=_live_hook(side.grads, side.produced, side.live, wanted))
    device = device_of(model)
    kwargs = {}
    if run.attention_mask is not None:
        kwargs["attention_mask"] = on_device(device, run.attention_mask)
        if forward_accepts(model, "position_ids"):
            kwargs["position_ids"] = on_device(device, run.position_ids)
    own_loss = _explicit(model, "labels")
    if own_loss:
        kwargs["labels"] = on_device(device, labels)
    root = _root_node(pair)
    try:
        with torch.enable_grad(), recording(model, into=sink, **_ours_points(pair)):
            out = model(on_device(device, run.input_ids), **kwargs)
    except RuntimeError as e:  # autograd's own errors (an in-place op on a leaf or on a view it needs) raise here
        side.error = one_line(e)
        side.params = _unique_params(model)
        side.param_grads = {id(p): None for _, p in side.params}
        return side
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # as any forward of ours: a user's is bad input
        run_ours(pair, _reraise, e)
        raise
    loss, logits = loss_and_logits(out)
    if loss is not None:
        side.loss_source = "ours' own (its forward takes labels and returns a loss)"
    elif logits is not None:
        loss = causal_lm_loss(logits, labels.to(logits.device), pair.vocab_size)
        side.loss_source = "computed by parity from ours' logits (Transformers' ForCausalLMLoss)"
    side.loss = None if loss is None else loss.detach().float().cpu()
    if root is not None and logits is not None:
        ref_logits = reference.grads.tensors.get(TRAIN + "logits")
        side.train = compare_node(train_spec, 0, logits.detach().cpu(), ref_logits, tol)
        if logits.requires_grad:
            _live_hook(side.grads, side.produced, side.live, wanted)(root.name, logits, None)
    side.params = _unique_params(model)
    if side.train is not None and side.train.failed:
        side.param_grads = {id(p): None for _, p in side.params}
        return side
    if loss is None:
        side.error = "ours returned neither a loss nor logits"
        side.param_grads = {id(p): None for _, p in side.params}
        return side
    _backward(side, loss)
    return side


# --- judging ---------------------------------------------------------------------------------------


def _lazy(trace: Trace, name: str):
    """A stored tensor as the comparison reads it (a spilled one in chunks, not loaded), or None."""
    store = trace.tensors
    if name not in store:
        return None
    return store.lazy(name) if hasattr(store, "lazy") else store.get(name)


def _max_abs(t) -> float:
    worst = 0.0
    for c in chunks(t, CHUNK):
        values = c.double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        if values.numel():
            worst = max(worst, float(values.max()))
    return worst


def _all_zero(t) -> bool:
    return all(not bool(c.any()) for c in chunks(t, CHUNK))


def backward_exact(pair: Pair) -> bool:
    """Whether the pair's family claims bit-exact gradients in its dtype (``Family.exact_backward_dtypes``,
    by default its forward claim); a pair that is no registered family's makes no claim beyond its own."""
    if not pair.exact:
        return False
    if pair.alignment or not pair.source.family:
        return pair.exact
    try:
        from parity.model.registry import get_family

        family = get_family(pair.source.family)
    except ParityError:
        return pair.exact
    claimed = family.exact_backward_dtypes
    return pair.dtype in (family.exact_dtypes if claimed is None else claimed)


@dataclass(frozen=True)
class GradRule:
    """How gradient nodes are judged: ``exact`` (atol = rtol = 0), else ``atol`` times the node's
    largest |reference gradient| plus ``rtol`` |reference| per element."""

    dtype: torch.dtype
    atol: float
    rtol: float
    exact: bool
    source: str

    @classmethod
    def of(cls, run: Run, pair: Pair) -> GradRule:
        """The run's rule: exact when the run is (``exact=True``, or the pair's claim) and, for a claim,
        the family claims its gradients too (:func:`backward_exact`)."""
        options, dtype = run.options, pair.dtype
        d_atol, d_rtol = default_tolerance(dtype)
        given = options.atol is not None or options.rtol is not None
        exact = run.tolerances.exact and (options.exact is True or backward_exact(pair))
        return cls(
            dtype,
            d_atol if options.atol is None else options.atol,
            d_rtol if options.rtol is None else options.rtol,
            exact,
            "exact" if exact else "grad-scaled:" + ("run" if given else str(dtype).split(".")[-1]),
        )

    def for_gradient(self, ref) -> tuple[float, float]:
        if self.exact:
            return 0.0, 0.0
        return self.atol * (_max_abs(ref) if ref is not None else 0.0), self.rtol

    def tolerances(self, atol: float, rtol: float) -> Tolerances:
        return Tolerances(self.dtype, atol, rtol, exact=self.exact)


def _identical(ours, ref) -> bool:
    """Both in memory, of one shape and dtype, equal bit for bit and finite: a correct port's usual
    gradient (a parameter's can be the size of the weights: two passes instead of the metrics' four)."""
    return (
        isinstance(ours, torch.Tensor)
        and isinstance(ref, torch.Tensor)
        and ours.shape == ref.shape
        and ours.dtype == ref.dtype
        and ours.is_floating_point()
        and torch.equal(ours, ref)
        and bool(torch.isfinite(ref.sum()))  # a NaN or an infinity makes the sum non-finite (so may an overflow)
    )


def _judge(spec: NodeSpec, index: int, ours, ref, rule: GradRule, untapped: bool = False) -> NodeResult:
    atol, rtol = rule.for_gradient(ref)
    if _identical(ours, ref):
        exact = NodeResult(
            name=spec.name,
            index=index,
            status=OK,
            layer=spec.layer,
            kind=spec.kind,
            shape_ours=tuple(ours.shape),
            shape_ref=tuple(ref.shape),
            dtype=str(ref.dtype).replace("torch.", ""),
            max_abs=0.0,
            mean_abs=0.0,
            max_rel=0.0,
            cosine=1.0,
            atol=atol,
            rtol=rtol,
            rel_l2=0.0,
            atol_needed=0.0,
            rtol_needed=0.0,
            tol_source=rule.source,
        )
        return exact
    result = compare_node(spec, index, ours, ref, rule.tolerances(atol, rtol), untapped)
    return replace(result, tol_source=rule.source)


def _plain(spec: NodeSpec, index: int, status: str, detail: str, hint=None) -> NodeResult:
    return NodeResult(
        name=spec.name,
        index=index,
        status=status,
        layer=spec.layer,
        kind=spec.kind,
        shape_ours=None,
        shape_ref=None,
        dtype=None,
        max_abs=None,
        mean_abs=None,
        max_rel=None,
        cosine=None,
        atol=0.0,
        rtol=0.0,
        hint=hint,
        detail=detail,
    )


def _grad_spec(spec: NodeSpec) -> NodeSpec:
    return replace(spec, name=GRAD + spec.name, chosen_from=None)


def grad_node_result(
    spec: NodeSpec,
    index: int,
    ours: GradPass,
    ref: GradPass,
    rule: GradRule,
    forward: NodeResult | None,
    functional: bool,
) -> NodeResult:
    """``grad/<node>``: both gradients compared, or why not (see the module docstring)."""
    gspec = _grad_spec(spec)
    name = spec.name
    if forward is not None and forward.status == UNTAPPED:
        return _plain(gspec, index, UNTAPPED, forward.detail + " (so no gradient either)")
    r = _lazy(ref.grads, name)
    o = ours.grads.tensors.get(name) if name in ours.grads.tensors else None
    if r is None:
        if name in ref.live:
            why = (
                "the reference's recorded value is off its autograd path (recomputed for recording, or a value the "
                "loss never reads), so it has no gradient to compare"
            )
        elif name in ref.produced:
            why = "the reference's value carries no gradient (an integer node, or computed without autograd)"
        else:
            why = "the reference never produced this node"
        if o is None:
            why = "no gradient on either side: " + why
        return _plain(gspec, index, UNTAPPED, why)
    if o is None:
        if functional and spec.kind in RECOMPUTED_KINDS and name in ours.live and spec.ours.startswith("tap:"):
            return _plain(
                gspec,
                index,
                UNTAPPED,
                "ours' value was recorded from a recomputation (parity's capture of an attention function): it is "
                "off ours' autograd path, so it has no gradient to compare",
            )
        if _all_zero(r):  # no gradient is a zero gradient
            return _judge(gspec, index, torch.zeros(tuple(r.shape), dtype=r.dtype), r, rule)
        if ours.error:
            detail = f"ours' backward raised before this node's gradient: {ours.error[:200]}"
        elif name in ours.live:
            detail = "ours' tensor required grad but no gradient reached it (not on the path to ours' loss)"
        elif name in ours.produced:
            detail = NO_GRAD + " (detached, or computed under torch.no_grad())"
        else:
            detail = "ours never produced this node"
        return _plain(gspec, index, MISSING, detail)
    return _judge(gspec, index, o, r, rule)


#: how a missing gradient node of ours that carries no gradient at all is described (see grad_node_result)
NO_GRAD = "ours' tensor does not require grad"


def _cut(results: list[NodeResult], at: int) -> str:
    """From the failing node ``results[at]`` on (backward order), the last node of the run of ours'
    nodes that require no grad (skipping untapped ones): where the graph is cut."""
    cut = results[at].name
    for r in results[at + 1 :]:
        if r.status == MISSING and r.detail.startswith(NO_GRAD):
            cut = r.name
        elif r.status != UNTAPPED:
            break
    return cut


def _diagnose_grad(
    results: list[NodeResult], at: int, ours: GradPass, ref: GradPass, labels_hint: hints.Hint | None
) -> hints.Hint | None:
    """The hint of the first failing backward node ``results[at]``."""
    result = results[at]
    if result.name == LOSS:
        return labels_hint
    if not result.name.startswith(GRAD):
        return None
    node = result.name[len(GRAD) :]
    r = ref.grads.tensors.get(node) if node in ref.grads.tensors else None
    if r is None:
        return labels_hint
    if result.status == MISSING:
        if ours.error:
            return hints.in_place(ours.error)
        cut = _cut(results, at) if result.detail.startswith(NO_GRAD) else None
        return hints.detached(result.name, r, ours_zero=False, cut=cut)
    o = ours.grads.tensors.get(node) if node in ours.grads.tensors else None
    if o is not None and _all_zero(o) and not _all_zero(r):
        return hints.detached(result.name, r, ours_zero=True)
    return labels_hint


# --- parameter gradients ---------------------------------------------------------------------------


@dataclass
class _Holder:
    """One Parameter of ours holding (part of) a checkpoint tensor, and how (a coverage Source)."""

    name: str
    param: nn.Parameter
    source: Source


def _holders(pair: Pair, coverage: Coverage | None, ours: GradPass) -> dict[str, list[_Holder]]:
    """Checkpoint key -> the Parameters of ours holding it (loader coverage's Sources; a Parameter
    replaced after loading, which coverage no longer traces, by its values: a copy or a transpose)."""
    state = pair.loading.state_dict
    by_shape: dict[tuple, list[str]] = {}
    for key, t in state.items():
        by_shape.setdefault(tuple(t.shape), []).append(key)
    out: dict[str, list[_Holder]] = {}
    sources = coverage.sources if coverage is not None else {}
    for name, p in ours.params:
        found = sources.get(name, [])
        if not found:
            with torch.no_grad():
                data = p.detach()
                key = next(
                    (k for k in by_shape.get(tuple(data.shape), []) if torch.equal(data, state[k].to(data))), None
                )
                how = COPY
                if key is None and data.dim() == 2:
                    key = next(
                        (
                            k
                            for k in by_shape.get(tuple(data.shape[::-1]), [])
                            if torch.equal(data, state[k].to(data).T)
                        ),
                        None,
                    )
                    how = TRANSPOSED
            found = [Source(name, key, how)] if key is not None else []
        for source in found:
            out.setdefault(source.key, []).append(_Holder(name, p, source))
    for holders in out.values():  # the holder sharing the checkpoint tensor first
        holders.sort(key=lambda h: h.source.how != SHARED)
    return out


def _reference_keys(pair: Pair) -> dict[int, str]:
    """id of each reference Parameter -> the checkpoint key it holds (same storage; its own name
    first when several keys alias it)."""
    by_storage: dict[tuple, list[str]] = {}
    for key, t in pair.loading.state_dict.items():
        by_storage.setdefault(storage_key(t), []).append(key)
    out = {}
    for name, p in pair.reference.named_parameters():
        keys = by_storage.get(storage_key(p.data), [])
        out[id(p)] = name if name in keys else keys[0] if keys else name
    return out


def to_key_layout(
    key_like: torch.Tensor, parts: list[tuple[Source, torch.Tensor, torch.Tensor]], values: bool = False
) -> torch.Tensor | None:
    """A tensor of ours in the checkpoint tensor's layout (``key_like``: that tensor, for its shape
    and strides): ``parts`` are ``(source, ours' parameter data, ours' tensor)`` with ours' tensor
    (a gradient, or with ``values`` an updated weight) in ours' parameter's layout; a whole holder
    maps on its own, views of a fused tensor (``slice``, ``rows``, ``part``) are assembled. None
    when a layout cannot be mapped."""
    whole = [part for part in parts if part[0].how in WHOLE]
    if whole:
        source, _, t = whole[0]
        t = t.detach().cpu()
        if source.how == TRANSPOSED:
            return t.T
        if source.how == OFFSET and values:  # a vector may be held in another shape (a grouped norm's)
            return (t - float(source.offset or 0.0)).reshape(key_like.shape)
        if source.how == LAYOUT:
            perm = source.permute or tuple(range(t.dim()))
            target = tuple(key_like.shape[::-1]) if source.transposed else tuple(key_like.shape)
            moved = t.permute(perm).reshape(target)
            return moved.T if source.transposed else moved
        return t
    rows = [part for part in parts if part[0].how == ROWS and part[0].rows is not None]
    if rows:  # ours holds the key's row j as its row rows[j] (a fused qkv / gate_up, or rows reordered)
        source, _, t = rows[0]
        t = t.detach().cpu()
        held = t.T if source.transposed else t  # a fused weight kept input-major: its columns are the rows
        if source.permute is not None:  # experts' weights fused with their last two axes exchanged
            held = t.permute(source.permute).reshape(-1, key_like.shape[-1])
        if source.flat:  # vectors fused end to end, then stacked: each row one element
            held = t.reshape(-1)
        return held[list(source.rows or ())].reshape(tuple(key_like.shape))
    dtype = parts[0][2].dtype
    full = torch.zeros(tuple(key_like.shape), dtype=dtype)
    for source, data, t in parts:
        t = t.detach().cpu()
        if source.how == SLICE:
            if not key_like.is_contiguous():
                return None
            offset = data.storage_offset() - key_like.storage_offset()
            full.as_strided(tuple(data.shape), data.stride(), offset).copy_(t)
        elif source.how == PART and source.rows is not None:
            # ours holds the rows input-major (2-D, transposed) or with another axis last (3-D and more)
            held = t.permute(source.permute) if source.permute else t.T if source.transposed else t
            full.view(-1, full.shape[-1])[list(source.rows)] = held.reshape(-1, full.shape[-1])
        else:
            return None
    return full


def _param_spec(pair: Pair, prefix: str, name: str) -> NodeSpec:
    module, _, leaf = name.rpartition(".")
    layer, kind = pair.facts.locate(module) if module else (None, leaf)
    return NodeSpec(prefix + name, "param:" + name, layer=layer, kind=f"{kind}.{leaf}" if module else leaf)


def _param_results(
    pair: Pair, coverage: Coverage | None, ours: GradPass, ref: GradPass, rule: GradRule, start: int
) -> tuple[list[NodeResult], list[tuple[str, torch.Tensor, list[_Holder], torch.Tensor | None]]]:
    """``grad/<reference parameter>`` for every reference parameter, in reverse order (the head first),
    and per parameter what the step needs: ``(name, reference parameter, ours' holders, the
    reference's gradient)``."""
    holders = _holders(pair, coverage, ours)
    keys = _reference_keys(pair)
    state = pair.loading.state_dict
    results: list[NodeResult] = []
    kept: list[tuple[str, torch.Tensor, list[_Holder], torch.Tensor | None]] = []
    for name, p in reversed(ref.params):
        index = start + len(results)
        spec = _param_spec(pair, GRAD, name)
        key = keys.get(id(p), name)
        g_ref = ref.param_grads.get(id(p))
        g_ref = None if g_ref is None else g_ref.cpu()
        mine = holders.get(key, [])
        kept.append((name, p, mine, g_ref))
        if not mine:
            results.append(
                _plain(spec, index, MISSING, f"no parameter of ours holds {key} (loader coverage found none)")
            )
            continue
        grads = [ours.param_grads.get(id(h.param)) for h in mine]
        if any(g is None for g in grads):
            missing = [h.name for h, g in zip(mine, grads) if g is None]
            if g_ref is None:
                results.append(_plain(spec, index, UNTAPPED, "no gradient on either side (the loss does not read it)"))
                continue
            if _all_zero(g_ref):
                grads = [torch.zeros_like(h.param, device="cpu") if g is None else g for h, g in zip(mine, grads)]
            else:
                why = (
                    f"ours' backward raised: {ours.error[:200]}" if ours.error else "the loss does not reach it in ours"
                )
                results.append(_plain(spec, index, MISSING, f"no gradient for {', '.join(missing)}: {why}"))
                continue
        if g_ref is None:
            g_ref = torch.zeros(tuple(p.shape), dtype=p.dtype)
        key_like = state.get(key, p.detach())
        copies = [h for h in mine if h.source.how in WHOLE]
        given = cast("list[torch.Tensor]", grads)  # every None was replaced, or the parameter skipped
        parts = [(h.source, h.param.detach(), g) for h, g in zip(mine, given)]
        g_ours = to_key_layout(key_like, parts)
        if g_ours is None:
            results.append(
                _plain(spec, index, UNTAPPED, f"ours holds {key} in a layout parity cannot map gradients through")
            )
            continue
        result = _judge(spec, index, g_ours, g_ref, rule)
        if len({id(h.param) for h in copies}) > 1:
            names = ", ".join(h.name for h in copies)
            result = replace(
                result,
                detail="; ".join(
                    d
                    for d in (result.detail, f"ours holds it {len(copies)} times: {names}; compared: {copies[0].name}")
                    if d
                ),
            )
            if result.failed:
                mapped = [
                    (h.name, to_key_layout(key_like, [(h.source, h.param.detach(), g)]))
                    for h, g in zip(mine, given)
                    if h.source.how in WHOLE
                ]
                atol, rtol = rule.for_gradient(g_ref) if not rule.exact else (0.0, 0.0)
                if rule.exact:  # a sum of copies rounds once more: judge it with the dtype's own eps
                    atol = float(torch.finfo(g_ref.dtype).eps) * 4 * _max_abs(g_ref)
                hint = hints.untied_copy(g_ref, [(n, t) for n, t in mapped if t is not None], atol, rtol)
                result = replace(result, hint=hint)
        results.append(result)
    return results, kept


# --- one optimizer step ----------------------------------------------------------------------------


def _optimizer_step(kind: str, lr: float, value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``value`` after one ``torch.optim`` step (AdamW or SGD, torch's defaults but ``lr``) with
    ``grad``, both taken as float32 copies on the CPU."""
    param = nn.Parameter(value.detach().to("cpu", torch.float32, copy=True))
    param.grad = grad.detach().to("cpu", torch.float32, copy=True)
    opt = torch.optim.AdamW([param], lr=lr) if kind == "adamw" else torch.optim.SGD([param], lr=lr)
    opt.step()
    return param.detach()


def step_tolerance(kind: str, lr: float, atol_g: float, rtol_g: float, g_ref: torch.Tensor, weight: torch.Tensor):
    """``(atol, ambiguous)`` for the updated weights: the rule (documented in the README's *Training parity*):

    * SGD: ``w - lr g``; gradients within ``atol_g + rtol_g |g|`` give weights within ``lr (atol_g +
      rtol_g max|g|)``;
    * AdamW's first step is ``w - lr (g / (|g| + eps) + weight_decay w)``, about ``lr sign(g)``: a
      gradient agreeing within its tolerance moves the weight by the same amount, except where the
      reference's gradient is itself zero within that tolerance (``ambiguous``, its sign is noise):
      such an element may step either way, within ``2 lr``; every other element within ``lr rtol_g``.

    Both add 4 float32 ulps of the largest weight (the step rounds once in float32). A pair judged
    exactly (atol = rtol = 0) is compared exactly and nothing is ambiguous."""
    rounding = 4 * float(torch.finfo(torch.float32).eps) * _max_abs(weight)
    if atol_g == 0 and rtol_g == 0:
        return 0.0, None
    if kind == "sgd":
        return lr * (atol_g + rtol_g * _max_abs(g_ref)) + rounding, None
    ambiguous = g_ref.double().abs() <= atol_g
    return lr * rtol_g + rounding, ambiguous


def _step_results(
    pair: Pair, kept, ours: GradPass, rule: GradRule, kind: str, lr: float, start: int
) -> list[NodeResult]:
    state = pair.loading.state_dict
    keys = _reference_keys(pair)
    results: list[NodeResult] = []
    for name, p, mine, g_ref in kept:
        index = start + len(results)
        spec = _param_spec(pair, STEP, name)
        grads = [ours.param_grads.get(id(h.param)) for h in mine]
        if not mine or g_ref is None or any(g is None for g in grads):
            results.append(_plain(spec, index, UNTAPPED, "no step: a gradient is missing (see grad/" + name + ")"))
            continue
        key_like = state.get(keys.get(id(p), name), p.detach())
        ref_new = _optimizer_step(kind, lr, p.detach(), g_ref)
        given = cast("list[torch.Tensor]", grads)  # none is None (checked above)
        parts = [
            (h.source, h.param.detach(), _optimizer_step(kind, lr, h.param.detach(), g)) for h, g in zip(mine, given)
        ]
        ours_new = to_key_layout(key_like, parts, values=True)
        if ours_new is None:
            results.append(_plain(spec, index, UNTAPPED, "ours' layout of this parameter cannot be mapped"))
            continue
        atol_g, rtol_g = rule.for_gradient(g_ref)
        atol, ambiguous = step_tolerance(kind, lr, atol_g, rtol_g, g_ref, ref_new)
        detail = ""
        if ambiguous is not None and ours_new.shape == ref_new.shape and bool(ambiguous.any()):
            either_way = ambiguous & ((ours_new.double() - ref_new.double()).abs() <= 2 * lr + atol)
            ours_new = torch.where(either_way, ref_new, ours_new)
            detail = (
                f"{int(either_way.sum())} element(s) whose reference gradient is zero within tolerance stepped "
                f"either way (allowed: 2 lr)"
            )
        metrics = tensor_metrics(ours_new, ref_new, atol, 0.0) if ours_new.shape == ref_new.shape else None
        if metrics is None:
            results.append(
                _plain(spec, index, "shape", f"ours {tuple(ours_new.shape)} vs reference {tuple(ref_new.shape)}")
            )
            continue
        results.append(
            NodeResult(
                name=spec.name,
                index=index,
                status=metrics.status,
                layer=spec.layer,
                kind=spec.kind,
                shape_ours=tuple(ours_new.shape),
                shape_ref=tuple(ref_new.shape),
                dtype="float32",
                max_abs=metrics.max_abs,
                mean_abs=metrics.mean_abs,
                max_rel=metrics.max_rel,
                cosine=metrics.cosine,
                atol=atol,
                rtol=0.0,
                detail="; ".join(d for d in (metrics.detail, detail) if d),
                rel_l2=metrics.rel_l2,
                atol_needed=metrics.atol_needed,
                rtol_needed=metrics.rtol_needed,
                tol_source=f"step:{kind}:lr={lr:g}" if not rule.exact else "exact",
            )
        )
    return results


# --- causality -------------------------------------------------------------------------------------


def causal_positions(seq: int) -> list[int]:
    """The positions ``t`` whose later tokens are perturbed: every one from 0 to ``seq - 2`` up to
    :data:`CAUSAL_POSITIONS` of them, else that many spread evenly (0 and ``seq - 2`` included)."""
    last = seq - 2
    if last < 0:
        return []
    if last + 1 <= CAUSAL_POSITIONS:
        return list(range(last + 1))
    n = CAUSAL_POSITIONS
    return sorted({round(i * last / (n - 1)) for i in range(n)})


#: node kinds without a token axis (a recurrent state after the last token)
NO_TOKEN_AXIS = ("recurrent_state",)


def _seq_view(t: torch.Tensor, kind: str, rows: int, seq: int) -> torch.Tensor | None:
    """``t`` as ``(rows, seq, -1)``: the sequence axis by the node's layout, ``(b, t, ...)``, ``(b, h,
    t, ...)`` for attention internals, or tokens flattened first ``(b * t * ..., ...)``; None without one."""
    shape = tuple(t.shape)
    if kind in NO_TOKEN_AXIS or not shape:
        return None
    if len(shape) >= 3 and kind in ("q_rot", "k_rot", "scores", "probs") and shape[0] == rows and shape[2] == seq:
        return t.movedim(2, 1).reshape(rows, seq, -1)
    if len(shape) >= 2 and shape[0] == rows and shape[1] == seq:
        return t.reshape(rows, seq, -1)
    if shape[0] % (rows * seq) == 0:
        return t.reshape(rows, seq, -1)
    return None


@dataclass
class _Leaks:
    """Per node: the largest change at positions <= t over the tested t, and the t that changed."""

    rows: int
    seq: int
    positions: list[int]
    kinds: dict[str, str]
    threshold: float
    order: list[str] = field(default_factory=list)
    change: dict[str, float] = field(default_factory=dict)
    leaking: dict[str, list[int]] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)

    def __call__(self, name: str, tensor: torch.Tensor) -> bool:
        if name in self.change or name not in self.kinds:
            return True
        kind = self.kinds[name]
        view = _seq_view(tensor.detach(), kind, self.rows, self.seq)
        self.order.append(name)
        self.shapes[name] = tuple(tensor.shape)
        if view is None:
            self.change[name] = math.nan
            return True
        worst, bad = 0.0, []
        base = view[0]
        for k, t in enumerate(self.positions, start=1):
            now, was = view[k, : t + 1], base[: t + 1]
            if kind == "scores":  # before the mask: keys after t are scored too; compare keys <= t
                heads = tensor.shape[1] if tensor.dim() == 4 else 1
                now = now.reshape(t + 1, heads, -1)[..., : t + 1]
                was = was.reshape(t + 1, heads, -1)[..., : t + 1]
            if not now.is_floating_point():
                delta = float((now != was).any())
            else:
                delta = (
                    float((now.double() - was.double()).abs().nan_to_num(nan=math.inf).max()) if now.numel() else 0.0
                )
                scale = float(was.double().abs().nan_to_num(nan=0.0).max()) if was.numel() else 0.0
                delta = delta if delta > self.threshold * max(scale, 1e-30) else 0.0
            if delta:
                bad.append(t)
                worst = max(worst, delta)
        self.change[name] = worst
        if bad:
            self.leaking[name] = bad
        return True


def causality(
    model: nn.Module,
    input_ids: torch.Tensor,
    points: list[tuple[str, str]] | None = None,
    kinds: dict[str, str] | None = None,
    record: dict | None = None,
    call=None,
    seed: int = 0,
    threshold: float = 0.0,
    placeholders: frozenset[int] | tuple = (),
    vocab_size: int | None = None,
) -> _Leaks:
    """Does ``model`` keep every node at position ``t`` independent of the tokens after ``t``?

    ``input_ids`` ``(1, seq)``: one sequence; for each tested ``t`` (:func:`causal_positions`) a copy
    whose tokens after ``t`` are all replaced (seeded, never the same token, never a ``placeholders``
    token) is stacked under it, and one forward of the batch (eval, no grad) records every node
    (``points``, or every named module's output; ``record``: more :func:`recording` arguments; ``call(batch)``
    runs the model, default ``model(batch)``). A node leaks at ``t`` when its values at positions
    ``<= t`` (``scores``: keys ``<= t`` too) move by more than ``threshold`` times their largest
    magnitude. Returns the per-node changes (:class:`_Leaks`). Raises ParityError for fewer than two tokens.
    """
    seq = int(input_ids.shape[1])
    positions = causal_positions(seq)
    if not positions:
        raise ParityError(f"causality needs at least 2 tokens, got {seq}")
    vocab = vocab_size or int(input_ids.max()) + 1
    gen = torch.Generator().manual_seed(seed + 7919)
    base = input_ids[:1].cpu()
    rows = [base]
    for t in positions:
        row = base.clone()
        later = seq - t - 1
        new = (base[0, t + 1 :] + 1 + torch.randint(0, max(vocab - 1, 1), (later,), generator=gen)) % vocab
        for token in sorted(placeholders):
            new = torch.where(new == token, (token + 1) % vocab, new)
        new = torch.where(new == base[0, t + 1 :], (new + 1) % vocab, new)
        row[0, t + 1 :] = new
        rows.append(row)
    batch = torch.cat(rows)
    if points is None:
        points = [(name, name) for name, _ in model.named_modules() if name]
    kinds = kinds or {name: name.rsplit(".", 1)[-1] for name, _ in points}
    leaks = _Leaks(len(rows), seq, positions, kinds, threshold)
    sink = Trace(sink=leaks)
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), recording(model, points, into=sink, **(record or {})):
            device = device_of(model)
            (call or model)(batch.to(device))
    finally:
        model.train(was)
    return leaks


def check_causality(model: nn.Module, input_ids: torch.Tensor, **kwargs) -> list[NodeResult]:
    """:func:`causality` of one model, on its own (no reference): one ``causal/<module path>`` result
    per module output it records (``ok``, ``mismatch`` where it leaks, the first leak with a
    ``future_leak`` hint; ``untapped`` for an output without a sequence axis)."""
    leaks = causality(model, input_ids, **kwargs)
    return _causal_results(leaks, {name: NodeSpec(name, name, kind=name.rsplit(".", 1)[-1]) for name in leaks.order}, 0)


def _causal_results(leaks: _Leaks, specs: dict[str, NodeSpec], start: int) -> list[NodeResult]:
    results: list[NodeResult] = []
    first = next((name for name in leaks.order if name in leaks.leaking), None)
    for name in leaks.order:
        spec = specs[name]
        index = start + len(results)
        cspec = replace(spec, name=CAUSAL + spec.name)
        change = leaks.change[name]
        if math.isnan(change):
            results.append(_plain(cspec, index, UNTAPPED, f"no token axis in shape {leaks.shapes[name]}"))
            continue
        bad = leaks.leaking.get(name, [])
        status = "mismatch" if bad else OK
        detail = (
            f"values at positions <= t change when only tokens after t change (t = {hints.fmt_positions(bad)})"
            if bad
            else f"unchanged at positions <= t for t in {hints.fmt_positions(leaks.positions)}"
        )
        shape = leaks.shapes[name]
        results.append(
            NodeResult(
                name=cspec.name,
                index=index,
                status=status,
                layer=spec.layer,
                kind=spec.kind,
                shape_ours=shape,
                shape_ref=shape,
                dtype=None,
                max_abs=change,
                mean_abs=None,
                max_rel=None,
                cosine=None,
                atol=leaks.threshold,
                rtol=0.0,
                hint=hints.future_leak(cspec.name, bad, change) if name == first else None,
                detail=detail,
                tol_source="causality",
            )
        )
    return results


def _pair_causality(pair: Pair, run: Run, start: int) -> tuple[list[NodeResult], list[str]]:
    """Causality of ours (``causal/<node>`` results) and of the reference (a note)."""
    seq = int(run.input_ids.shape[1])
    rows = len(causal_positions(seq)) + 1
    size = torch.finfo(pair.dtype).bits // 8
    require(
        causality_bytes(pair.facts, rows, seq, size),
        f"the causality check ({rows} sequences of {seq} tokens in one batch)",
        "use a shorter --seq-len",
    )
    threshold = 0.0 if run.tolerances.exact else default_tolerance(pair.dtype)[1] * 1e-2
    kinds = {n.name: n.kind for n in pair.nodes}
    common: dict[str, Any] = dict(
        kinds=kinds,
        seed=pair.source.seed,
        threshold=threshold,
        placeholders=pair.facts.placeholder_tokens,
        vocab_size=pair.vocab_size,
    )
    ours_args = ours_recording(pair)
    points = ours_args.pop("points")
    ours = causality(
        pair.ours,
        run.input_ids,
        points,
        record=ours_args,
        call=lambda ids: run_ours(pair, pair.ours, ids),
        **common,
    )
    ref_args = _reference_points(pair, pair.reference)
    ref_points = ref_args.pop("points") + [(n.name, "") for n in pair.nodes if n.reference_path == ""]
    reference = causality(
        pair.reference,
        run.input_ids,
        ref_points,
        record=ref_args,
        call=lambda ids: pair.reference(input_ids=ids, use_cache=False),
        **common,
    )
    specs = {n.name: n for n in pair.nodes}
    order = [name for name in reference.order if name in specs] + [n for n in ours.order if n not in reference.order]
    ours.order = [name for name in order if name in ours.change]
    results = _causal_results(ours, specs, start)
    leak = next((name for name in reference.order if name in reference.leaking), None)
    tested = hints.fmt_positions(ours.positions)
    note = (
        f"causality: the reference itself changes at {leak} (positions <= t) when only later tokens change: not causal"
        if leak
        else f"causality: the reference keeps every node causal (t = {tested}, later tokens perturbed)"
    )
    return results, [note]


# --- the stage -------------------------------------------------------------------------------------


def check_backward(pair: Pair, run: Run, forward: CheckResult) -> CheckResult:
    """Training parity and causality after the forward check ``forward`` (see the module docstring):
    the forward's result with the ``train/logits``, ``loss``, ``grad/``, ``step/`` and ``causal/``
    nodes appended, notes and ``meta["backward"]``. Raises ParityError when the run would not fit
    in memory (with the numbers)."""
    options = run.options
    start = time.perf_counter()
    nodes = list(forward.nodes)
    notes = list(forward.notes)
    meta = dict(forward.meta)
    info: dict = {}
    if options.backward:
        bad = first_mismatch(forward.nodes)
        if bad is not None:
            notes.append(
                f"backward not judged: the forward fails at {bad.name}, and gradients through a forward that "
                "differs mean nothing; fix the forward first"
            )
            info["judged"] = False
        else:
            added, more, info = _backward_nodes(pair, run, forward, len(nodes))
            nodes += added
            notes += more
    if options.causality:
        added, more = _pair_causality(pair, run, len(nodes))
        nodes += added
        notes += more
    seconds = round(time.perf_counter() - start, 3)
    if options.backward:
        meta["backward"] = {**info, "seconds": seconds}
    if options.causality:
        meta["causality"] = {"positions": causal_positions(int(run.input_ids.shape[1])), "seconds": seconds}
    return dataclasses.replace(forward, nodes=tuple(nodes), notes=tuple(notes), meta=meta)


def _backward_nodes(pair: Pair, run: Run, forward: CheckResult, start: int) -> tuple[list[NodeResult], list[str], dict]:
    options = run.options
    batch, seq = (int(n) for n in run.input_ids.shape)
    size = torch.finfo(pair.dtype).bits // 8
    weights = weight_bytes(pair)
    require(
        backward_bytes(pair.facts, batch, seq, size, weights, run.trace_memory),
        f"the backward of {batch} x {seq} tokens (both models' activations kept for autograd, their gradients)",
        "use a shorter --seq-len, a smaller --batch or fewer layers",
    )
    if options.step is not None:
        largest = max((p.numel() for p in pair.reference.parameters()), default=0)
        require(
            2 * 4 * 4 * largest,
            f"one {options.step} step (float32 copies of the largest parameter, its gradient and the optimizer's "
            "state, for each model, one parameter at a time)",
            "drop --step",
        )
    labels = options.labels if options.labels is not None else default_labels(run.input_ids, run.attention_mask)
    check_labels(run, pair.vocab_size)
    labels = labels.long()
    root = _root_node(pair)
    by_name = {n.name: n for n in forward.nodes}
    train_spec = NodeSpec(TRAIN + "logits", root.ours if root else "", layer=None, kind="logits")
    out_fwd = by_name.get(root.name) if root is not None else None
    train_tol = Tolerances(
        pair.dtype,
        out_fwd.atol if out_fwd is not None else None,
        out_fwd.rtol if out_fwd is not None else None,
        exact=run.tolerances.exact,
    )
    rule = GradRule.of(run, pair)
    notes: list[str] = []
    results: list[NodeResult] = []
    with training(pair.reference, pair.ours) as changed:
        ref = reference_pass(pair, run, labels)
        try:
            ours = ours_pass(pair, run, labels, ref, train_spec, train_tol)
        except BaseException:
            ref.close()
            raise
    try:
        notes.append(changed.note())
        info: dict[str, object] = {
            "judged": True,
            "labels": "given" if options.labels is not None else "input_ids, padding -100 (shifted inside the loss)",
            "loss_ours": ours.loss_source,
            "loss_reference": ref.loss_source,
            "tolerance": rule.source,
        }
        if ours.train is not None:
            results.append(replace(ours.train, index=start, tol_source=ours.train.tol_source or "forward"))
            if ours.train.failed:
                changes = _mode_changes(pair, run)
                named = [side for side, change in changes if change]
                hint = hints.dropout(named, [c for _, c in changes if c])
                results[0] = replace(results[0], hint=hint)
                notes.append("backward: gradients not compared: the train-mode forward differs (train/logits)")
                return results, notes, info
        loss_spec = NodeSpec(LOSS, "loss", layer=None, kind="loss")
        if ours.loss is None or ref.loss is None:
            detail = f"ours' forward under autograd raised: {ours.error[:200]}" if ours.error else "no loss"
            hint = hints.in_place(ours.error) if ours.error else None
            results.append(_plain(replace(loss_spec), start + len(results), MISSING, detail, hint))
            return results, notes, info
        loss_tol = Tolerances(pair.dtype, options.atol, options.rtol, exact=run.tolerances.exact)
        loss_result = compare_node(loss_spec, start + len(results), ours.loss, ref.loss, loss_tol)
        results.append(replace(loss_result, detail=f"ours: {ours.loss_source}"))
        order = [n.name for n in reversed(forward.nodes) if n.name in {s.name for s in pair.nodes}]
        specs = {n.name: n for n in pair.nodes}
        functional = bool(pair.alignment)
        for name in order:
            results.append(
                grad_node_result(specs[name], start + len(results), ours, ref, rule, by_name.get(name), functional)
            )
        param_results, kept = _param_results(pair, forward.coverage, ours, ref, rule, start + len(results))
        results += param_results
        if options.step is not None:
            lr = options.lr if options.lr is not None else DEFAULT_LR
            results += _step_results(pair, kept, ours, rule, options.step, lr, start + len(results))
            info["step"] = {"optimizer": options.step, "lr": lr}
        if ours.error:
            notes.append(f"backward: ours' backward raised: {ours.error[:300]}")
        bad = first_mismatch(results)
        if bad is not None and bad.hint is None:
            output = root.name if root is not None else ""
            o = ours.grads.tensors.get(output) if output in ours.grads.tensors else None
            r = ref.grads.tensors.get(output) if output in ref.grads.tensors else None
            labels_hint = hints.loss_hints(o, r) if bad.name in (LOSS, GRAD + output) else None
            hint = _diagnose_grad(results, bad.index - start, ours, ref, labels_hint)
            results[bad.index - start] = replace(bad, hint=hint)
        info["spilled_bytes"] = ref.grads.spilled_bytes + ours.grads.spilled_bytes
        return results, notes, info
    finally:
        ref.close()
        ours.close()


def _mode_changes(pair: Pair, run: Run) -> list[tuple[str, float]]:
    """Per model (``ours``, ``the reference``): max |train-mode logits - eval-mode logits| with dropout
    off (no grad), 0.0 when they are identical."""
    out = []
    for side, model in (("ours", pair.ours), ("the reference", pair.reference)):
        device = device_of(model)

        def call(model=model, side=side, device=device):
            ids = on_device(device, run.input_ids)
            if side == "ours":
                kwargs = {}
                if run.attention_mask is not None:
                    kwargs["attention_mask"] = on_device(device, run.attention_mask)
                    if forward_accepts(model, "position_ids"):
                        kwargs["position_ids"] = on_device(device, run.position_ids)
                return loss_and_logits(run_ours(pair, model, ids, **kwargs))[1]
            return model(
                input_ids=ids,
                attention_mask=on_device(device, run.attention_mask),
                position_ids=on_device(device, run.position_ids),
                use_cache=False,
            ).logits

        with torch.no_grad(), training(model):
            trained = call()
            model.eval()
            evaluated = call()
        if trained is None or evaluated is None or trained.shape != evaluated.shape:
            out.append((side, 0.0))
            continue
        out.append((side, float((trained.double() - evaluated.double()).abs().nan_to_num(nan=math.inf).max())))
    return out


__all__ = [
    "CAUSAL",
    "GRAD",
    "LOSS",
    "STEP",
    "TRAIN",
    "causal_lm_loss",
    "causality",
    "check_backward",
    "check_causality",
    "default_labels",
    "loss_and_logits",
    "training",
]
