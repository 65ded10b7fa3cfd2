"""The stages of a check after planning: trace the reference, calibrate, trace ours (chained or
isolated, compared as it runs), compare and diagnose, analyse; and the run's metadata.

Each is a function of what the earlier ones produced; :mod:`parity.run.check` strings them together
and golden traces (:mod:`parity.golden`) reuse them, so a dump is judged exactly as a check is.
"""

from __future__ import annotations

import datetime as _dt
import inspect
import itertools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import torch

from parity.build.builder import tied_weights
from parity.build.coverage import (
    COPY,
    FUSED_PART,
    LAYOUT,
    ROWS,
    SCALED,
    SHARED,
    SLICE,
    SPLIT,
    STRIDED,
    TRANSPOSED,
    scale_held,
    storage_span,
)
from parity.compare.arbiter import arbitrated_like, output_arbitrates
from parity.compare.later_calls import call_of, with_later_calls
from parity.compare.metrics import CHUNK, MISMATCH, MISSING, SHAPE, UNTAPPED, chunks
from parity.compare.padding import unpadded_rows
from parity.compare.results import (
    CAPTURED,
    QK_KINDS,
    QK_MOVED,
    RECORDED_ELSEWHERE,
    TIED_COPIES,
    WEIGHT_READ,
    WEIGHTS_MOVED,
    NodeResult,
    NodeStream,
    compare_traces,
    first_mismatch,
    moved_constant,
)
from parity.compare.tolerances import Tolerances
from parity.diagnose import one_change
from parity.diagnose.detectors import diagnose
from parity.diagnose.evidence import fmt_list, within_tolerance
from parity.diagnose.hints import Hint
from parity.diagnose.later_calls import later_call_hint
from parity.diagnose.norms import is_norm
from parity.diagnose.profile import error_profile, logits_effect
from parity.model.pair import NodeSpec, Pair
from parity.record import hf_capture, hf_kernels
from parity.record.functional import Block, StorageKey, probe_reads, storage_keys
from parity.record.hf_capture import FUSED_QKV, OUTPUT_PROJECTIONS, POSITION_TABLES
from parity.record.hooks import CAPTURED_IN_FUNCTIONS, FUNCTIONS, forward_takes, recording
from parity.record.trace import SCALARS, Trace
from parity.run.options import CheckOptions
from parity.run.plan import Run, plan, versions
from parity.util.errors import ParityError
from parity.util.resources import BUDGET as RESOURCE_BUDGET
from parity.util.resources import GIB, available_bytes, require
from parity.util.source import source_of
from parity.util.text import one_line

#: node kinds whose module input (and weight) is kept for diagnosis (norm placement, norm kind, transposes)
DIAGNOSIS_INPUT_KINDS = (
    "proj",  # q_proj .. down_proj, GPT-2's c_proj
    "fc",  # GPT-2's c_fc, Phi's fc1/fc2, GPT-J's fc_in/fc_out
    "dense",  # Phi's and Falcon's dense, dense_h_to_4h
    "query_key_value",
    "qkv",  # MPT's Wqkv, Phi-3's qkv_proj
    "W_pack",  # Baichuan's fused q/k/v
    "gate",  # a MoE router
    "router",  # GPT-OSS's and DBRX's MoE router (its bias: the choice's, or the weights' too)
    "norm",
    "c_attn",
    "ln_",  # GPT-2's Conv1D projections and LayerNorms
    "wte",
    "wpe",
    "embed",  # a lookup's ids and table: which rows each side read
)
#: node kinds of ours the diagnosis of a later node of the same attention reads (softmax temperature
#: needs q and k to agree); everything else of ours is dropped once compared
DIAGNOSIS_CONTEXT_KINDS = ("q_rot", "k_rot")
#: calibrated atol = SAFETY_FACTOR x |reference - reference in float64|, at least the floor
SAFETY_FACTOR = 10.0
CALIBRATION_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def diagnosis_inputs(pair: Pair) -> frozenset[str]:
    """The nodes whose module input is kept for diagnosis: by kind (:data:`DIAGNOSIS_INPUT_KINDS`), and every
    reference ``nn.Linear`` whatever its name or place (Granite's ``input_linear``, Mixtral's ``w1``, a head): what a
    projection read is the evidence of a projection reading another point of the stream."""
    modules = dict(pair.reference.named_modules())
    return frozenset(
        n.name
        for n in pair.nodes
        if "@" not in n.kind
        and (
            any(k in n.kind for k in DIAGNOSIS_INPUT_KINDS)
            or is_norm(n.kind)
            # every linear, in a layer or not (XLM's attentions beside its layers, RoCBERT's map_inputs_layer over
            # its embeddings, ELECTRA's generator_lm_head): what it read, which table the logits read
            or isinstance(modules.get(n.reference_path), torch.nn.Linear)
        )
    )


def device_of(model) -> torch.device:
    """Where a model takes its inputs: the device of its first parameter (the embedding, also under a
    device map, whose hooks move activations on from there)."""
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def on_device(device: torch.device, tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.device == device else tensor.to(device)


def trace_reference(pair: Pair, run: Run, model=None, sink=None, into: Trace | None = None) -> Trace:
    """Run the reference (or ``model``, a copy of it) on the run's inputs; attention internals
    come through :mod:`parity.record.hf_capture`. The trace spills to disk past ``run.trace_memory``.
    ``sink`` (see :class:`~parity.record.trace.Trace`) sees each node instead of the trace storing it;
    ``into``: the Trace to fill instead (see :func:`parity.record.hooks.recording`). Raises ParityError
    when the reference itself cannot run the config (a config Transformers accepts but its forward
    rejects is bad input, not a bug)."""
    model = pair.reference if model is None else model
    hf_capture.install(model)
    captured = [n.name for n in pair.nodes if hf_capture.is_captured(n.name)]
    points = [(n.name, n.reference_path) for n in pair.nodes if n.name not in captured]
    views = {n.name: n.reference_transform for n in pair.nodes if n.reference_transform is not None}
    if sink is None:  # a fused q/k/v compared in parts: its whole output too, for the hints reading its layout
        names = {n.name for n in pair.nodes}
        fused = {n.reference_path for n in pair.nodes if n.name in views}
        points += [(path, path) for path in sorted(fused) if path.rsplit(".", 1)[-1] in FUSED_QKV and path not in names]
    # named after the module that calls them; a short conv's weights are kept under it
    kernels = any(hf_kernels.is_kernel_node(name) for name in captured) or hf_kernels.calls_conv_kernels(model)
    # every node's later calls kept: ours keeps those of the nodes the reference ran more than once (a loop)
    trace = Trace.spilling(run.trace_memory, sink=sink, repeats=None) if into is None else into
    keep = diagnosis_inputs(pair) if sink is None else frozenset()
    device = device_of(model)
    own: dict = {}
    if captured and not hf_capture.dispatches(model):  # attention of its own (Falcon's): read from its functions
        taps, layouts = hf_capture.functional_internals(captured, pair.facts)
        own = dict(taps=taps, functional={})
        views = {**views, **layouts}
        captured = [n for n in captured if n not in taps]
    # no_grad, not inference_mode: tensors keep their version counters (an unchanged tensor recorded
    # twice is stored once, an in-place edit is seen)
    with (
        torch.no_grad(),
        recording(
            model,
            points,
            transforms=views,
            captured=captured,
            keep_inputs=keep,
            module_stack=kernels,
            into=trace,
            **own,
        ),
    ):
        try:
            model(
                input_ids=on_device(device, run.input_ids),
                attention_mask=on_device(device, run.attention_mask),
                position_ids=on_device(device, run.position_ids),
                use_cache=False,
            )
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
            trace.close()
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ParityError(
                f"the reference ({type(model).__name__}) cannot run this config: {reason[:300]}"
            ) from None
    trace.extras[SCALARS] = reference_scalars(model)
    trace.extras[TIED_COPIES] = tied_copies(model, pair.nodes)
    trace.extras[WEIGHT_READ] = weights_read(model, pair.nodes)
    return trace


def weights_read(model: torch.nn.Module, nodes) -> frozenset[str]:
    """The nodes whose module's weight the code of its parent reads directly (``self.dt_proj.weight @ x``:
    Jamba's mixer calls dt_proj only for a quantized model): a module the reference may never call."""
    modules = dict(model.named_modules())
    found = set()
    for node in nodes:
        path = node.reference_path.partition("#")[0].partition("@")[0]
        parent, _, child = path.rpartition(".")
        owner = modules.get(parent)
        if owner is None or not isinstance(getattr(modules.get(path), "weight", None), torch.Tensor):
            continue
        if f"self.{child}.weight" in source_of(type(owner)):
            found.add(node.name)
    return frozenset(found)


def tied_copies(model: torch.nn.Module, nodes) -> frozenset[str]:
    """The nodes whose reference module holds parameters and every one of them is tied, as the model declares
    (``all_tied_weights_keys``), to another module's: Zamba2's shared transformer block under each layer that uses
    it. A parameter two modules share by accident (a patched reference) is no declared tie."""
    ties = tied_weights(model)
    tied = set(ties) | set(ties.values())
    modules = dict(model.named_modules(remove_duplicate=False))
    found = set()
    for node in nodes:
        path = node.reference_path.partition("#")[0].partition("@")[0]
        module = modules.get(path)
        own = [name for name, _ in module.named_parameters(recurse=False)] if module is not None else []
        if own and all(f"{path}.{name}" in tied for name in own):
            found.add(node.name)
    return frozenset(found)


def reference_scalars(model: torch.nn.Module) -> dict[str, float]:
    """The reference's one-element floating parameters and buffers by path (Gemma 4's ``layer_scalar``):
    a constant factor a hint can name."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    scalars = {name: float(t.detach().float()) for name, t in tensors if t.numel() == 1 and t.is_floating_point()}
    return {name: value for name, value in scalars.items() if math.isfinite(value)}  # JSON holds finite numbers


def forward_accepts(model, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


#: ours-side prefixes of nodes no hook records: a tap call, a value read from a function call (the
#: op reading a parameter), or nothing to align; such a node ours never produced is untapped, not failed
UNHOOKED = ("tap:", "param:", "unaligned:")


def unjudged_padding(pair: Pair, run: Run) -> torch.Tensor | None:
    """``(batch, seq)``, True at the padding positions a check does not judge: a user's model's (what
    it computes there is its own business: it may skip, zero or pack them; :mod:`parity.compare.padding`).
    The families' padding is judged: they compute it as Transformers does. None without padding."""
    if not pair.alignment or run.attention_mask is None:
        return None
    pad = run.attention_mask.detach().cpu() == 0
    return pad if bool(pad.any()) else None


def untapped_nodes(pair: Pair) -> frozenset[str]:
    return frozenset(n.name for n in pair.nodes if n.ours.startswith(UNHOOKED))


def _key_shapes(pair: Pair) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> its shape: the state dict's, or (the float64 pair keeps names only) the reference's tensor
    of that name."""
    shapes = {k: tuple(t.shape) for k, t in pair.reference.state_dict(keep_vars=True).items()}
    shapes.update({k: tuple(t.shape) for k, t in pair.loading.state_dict.items() if isinstance(t, torch.Tensor)})
    return shapes


def ours_recording(pair: Pair, order: Sequence[str] = ()) -> dict:
    """The arguments of :func:`~parity.record.hooks.recording` for ours: module points, layouts,
    taps, and for a user's model the functional capture (attention internals computed in functions,
    projections computed from a parameter of a bigger module). ``order``: the reference's nodes in the order it
    ran them, where known: the nodes one parameter of ours serves (norm gains stacked as rows of one tensor) take
    its reads in that order."""
    taps = {n.ours[len("tap:") :]: n.name for n in pair.nodes if n.ours.startswith("tap:")}
    # buffers too: a model may hold its weights as buffers (stacked per kind, read in functions)
    params = {**dict(pair.ours.named_buffers()), **dict(pair.ours.named_parameters())} if pair.alignment else {}
    key_of = storage_keys(params.values())  # parameters that view one storage told apart by their elements
    functional: dict[StorageKey, str] = {}
    siblings: dict[str, list[str]] = {}
    biases: dict[StorageKey, str] = {}
    scales: dict[StorageKey, str] = {}
    parts: dict[int, list[tuple[Block, str, Callable]]] = {}
    for n in pair.nodes:
        # param:W (the op reading W), param:W+b (and the add of b that follows it), param:W*s (and the product
        # with s that follows it: a projection's own scale after its product)
        read, _, scale = n.ours[len("param:") :].partition("*") if n.ours.startswith("param:") else ("", "", "")
        weight, _, bias = read.partition("+")
        if scale in params and id(params[scale]) in key_of:
            scales.setdefault(key_of[id(params[scale])], n.name)
        if weight in params and id(params[weight]) in key_of:
            ptr = key_of[id(params[weight])]
            if ptr in functional:  # a fused parameter read once for several nodes (each its rows), a tied table
                siblings.setdefault(functional[ptr], []).append(n.name)
            else:
                functional[ptr] = n.name
        block, alone = getattr(n.transform, "block", None), getattr(n.transform, "alone", None)
        if weight in params and block is not None and alone is not None:
            # one projection's rows of a fused parameter (a Rows transform's): a product reading those elements
            # alone (``W[1]``, ``W[:I]``, ``wkv[:, 0]``) computes this node alone, its outputs in its rows' order
            parts.setdefault(params[weight].untyped_storage().data_ptr(), []).append((block, n.name, alone()))
        if bias in params and id(params[bias]) in key_of:
            # a fused bias added once for several nodes (their rows): the node its fused weight's product records
            biases.setdefault(key_of[id(params[bias])], n.name)
    if order:  # each read of a parameter serving several nodes is the next of them as the reference ran them
        rank = {name: i for i, name in enumerate(order)}
        for ptr, first in list(functional.items()):
            group = sorted([first, *siblings.pop(first, [])], key=lambda name: rank.get(name, len(rank)))
            functional[ptr] = group[0]
            if group[1:]:
                siblings[group[0]] = group[1:]
    rebased = _stacked_rows(pair, params, key_of, functional, siblings, biases)
    _rowed_biases(pair, params, key_of, functional, biases)
    # a module of ours aligned by its weight whose forward never runs (F.linear(x, self.head.weight) in its
    # parent): the product reading that weight outside the module is the node
    modules = dict(pair.ours.named_modules()) if pair.alignment else {}
    ref_modules = dict(pair.reference.named_modules()) if pair.alignment else {}
    owners: dict[str, str] = {}
    for n in pair.nodes:
        module = modules.get(n.ours) if n.ours and not n.ours.startswith(UNHOOKED) else None
        held = getattr(module, "weight", None)
        own = list(module.parameters(recurse=False)) if module is not None and held is None else []
        if len(own) == 1 and own[0].dim() == 1:  # a norm whose one parameter is called scale, gamma, g, ...
            held = own[0]
        if isinstance(held, torch.Tensor) and held.numel():
            functional.setdefault(key_of.get(id(held), held.untyped_storage().data_ptr()), n.name)
            owners[n.name] = n.ours
    # a bias of the reference no parameter of ours aligned to (cut in another layout than its weight): a
    # vector of ours aligned to nothing, added to such a node's product, is recorded as that node's bias
    expects_bias = frozenset(
        n.name
        for n in pair.nodes
        if n.ours.startswith("param:")
        and "+" not in n.ours
        and isinstance(getattr(ref_modules.get(n.reference_path), "bias", None), torch.Tensor)
    )
    if expects_bias:
        # a vector, or a stack of them computed at load in no layout parity knows (GPT-1's port's b_qkv (layers, 3,
        # heads, head_dim) read per head interleaved): what ours adds there is still its bias
        coverage = pair.loading.coverage
        unwritten = (
            set(coverage.unwritten_names()) | {n for held in coverage.derived.values() for n in held}
            if coverage is not None
            else set()
        )
        for name, p in params.items():
            key = key_of.get(id(p))
            vector = p.dim() == 1 or (name in unwritten and p.dim() >= 2 and p.shape[-1] < p.numel() ** 0.5)
            if vector and key is not None and key not in biases and key not in functional:
                biases[key] = ""
    # a parameter read for several nodes is followed as its first (a tied table: the embedding): its product
    # waits for the bias a sibling's module adds (ERNIE 4.5's tied head with a bias)
    biased = set(biases.values()) | expects_bias
    expects_bias |= {first for first, others in siblings.items() if biased & set(others)}
    # each product over one part's block of a fused weight whose fused bias ours adds (``x @ W[:, a:b] + b[a:b]``)
    # waits for its slice of that bias as the whole product would
    part_nodes = {name for held in parts.values() for _, name, alone in held if alone is not None}
    expects_bias |= {o for first, others in siblings.items() if first in biased for o in others if o in part_nodes}
    input_axes = _input_axes(pair, params, ref_modules)
    # parameters holding a checkpoint vector in another shape (a grouped norm's gain kept (streams, hidden)): read
    # as a norm's weight vector is
    coverage = pair.loading.coverage
    shapes = _key_shapes(pair) if coverage is not None else {}
    vectors = {
        key_of[id(p)]: name
        for name, p in params.items()
        if p.dim() >= 2
        and id(p) in key_of
        and coverage is not None
        and (held := coverage.sources.get(name))
        and all(len(shapes.get(s.key, ())) == 1 for s in held)
    }
    # attention blocks ours computes in functions only: each opens when one of its projections is read and
    # closes with its last
    blocks: dict[str, tuple[str, bool]] = {}
    names = [n.name for n in pair.nodes]
    for path in {key.rsplit(".", 1)[0] for key in taps if key.startswith(FUNCTIONS)}:
        block = path[len(FUNCTIONS) :]
        members = [
            n.name
            for n in pair.nodes
            if n.name.startswith(block + ".") and (n.ours.startswith("param:") or not n.ours.startswith(UNHOOKED))
        ]
        # the block closes with its output projection: the member right after its context in the node list
        after = names[names.index(f"{block}.context") + 1 :] if f"{block}.context" in names else []
        last = next((n for n in after if n in members), members[-1] if members else "")
        output = [m for m in members if m.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS]
        if len(output) == 1:  # by its name first: the node list need not hold the block's nodes in execution order
            last = output[0]
        blocks.update({m: (path, m == last) for m in members})
    return dict(
        points=[(n.name, n.ours) for n in pair.nodes if not n.ours.startswith(UNHOOKED)],
        transforms={**{n.name: n.transform for n in pair.nodes if n.transform is not None}, **rebased},
        # (the nodes' own inverses are the caller's: the rebased ones replace them)
        inverses={name: rows.inverse for name, rows in rebased.items()},
        taps=taps,
        functional=functional if pair.alignment and (functional or taps) else None,
        functional_biases=biases or None,
        functional_scales=scales or None,
        functional_vectors=vectors or None,
        functional_widths={
            n.name: w.numel()
            for n in pair.nodes
            if n.ours.startswith("param:")
            and isinstance(w := getattr(ref_modules.get(n.reference_path), "weight", None), torch.Tensor)
            and w.dim() == 1
        },
        functional_expects_bias=expects_bias,
        functional_gated=frozenset(
            n.name
            for n in pair.nodes
            if n.ours.startswith("param:")
            and is_norm(n.kind)
            and forward_takes(ref_modules.get(n.reference_path), "gate")
        ),
        functional_owners=owners or None,
        functional_siblings=siblings or None,
        functional_parts=parts or None,
        functional_blocks=blocks or None,
        functional_input_axes=input_axes or None,
        functional_lookups=frozenset(  # (a module of ours whose table forward reads in a lookup, F.embedding, too)
            n.name
            for n in pair.nodes
            if (n.ours.startswith("param:") or n.name in owners)
            and isinstance(ref_modules.get(n.reference_path), torch.nn.Embedding)
        ),
    )


def with_inverses(args: dict, inverses: dict) -> dict:
    """:func:`ours_recording`'s ``args`` with the nodes' own ``inverses`` under those it rebased."""
    return {**args, "inverses": {**inverses, **args.get("inverses", {})}}


def _stacked_rows(
    pair: Pair,
    params: dict,
    key_of: dict,
    functional: dict[StorageKey, str],
    siblings: dict[str, list[str]],
    biases: dict[StorageKey, str],
) -> dict[str, Any]:
    """A parameter of ours stacking several nodes' checkpoint tensors (loader coverage says where each is), read in
    parts: each part's read is its own nodes', whatever order ours runs them in.

    - Vectors, one node each: norm gains stacked as rows (``norms[i]``) or side by side in a row (``qk_norm[i] =
      [q_norm | k_norm]``). A read of one is its node (Gemma 3n's port normalises k before q; a gain folded into
      the next weights at load is never read); one read again once its node is recorded goes to the next node
      not yet recorded, in the reference's order (a row read where another norm runs is that norm's weight
      applied there: the hint names it).
    - Matrices stacked over the first axis (``wqkv[layer]`` holding a layer's q, k and v projections): a read of
      one slab is the nodes it holds (each taking its rows), never another slab's; their biases stacked alike
      (``bqkv[layer]``) are that slab's bias.

    Rewrites ``functional`` and ``siblings`` in place: the parameter's key becomes one region per part. Returns
    the slabs' nodes' transforms, their rows counted within their slab (what a read of it computes)."""
    coverage = pair.loading.coverage
    rebased: dict[str, Any] = {}  # node -> its Rows (parity.user.align) counted within its slab
    if coverage is None:
        return rebased
    transforms = {n.name: n.transform for n in pair.nodes}
    weight_key = {n.name: f"{n.reference_path}.weight" for n in pair.nodes if n.ours.startswith("param:")}
    for name, p in params.items():
        key = key_of.get(id(p))
        if p.dim() < 2 or key is None or key not in functional:
            continue
        group = [functional[key], *siblings.get(functional[key], [])]  # the reference's order
        # rows of norms the reference runs as no node of its own (Gemma 4's post_feedforward_layernorm_1) are
        # read by no node
        # each node of the group with the source of its weight (several nodes may read parts of one fused key:
        # Falcon's q, k and v rows of a layer's query_key_value, each stacked over layers in its own parameter)
        by_key = {s.key: s for s in coverage.sources.get(name, [])}
        sources = {n: by_key[weight_key[n]] for n in group if weight_key.get(n) in by_key}
        held = {n: _held_elements(p, s) for n, s in sources.items()}
        regions = {n: span for n, span in held.items() if n in group and span is not None}
        spans = sorted(set(regions.values()))
        if len(group) < 2 or set(regions) != set(group) or len(spans) < 2:
            continue
        if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            continue  # parts overlapping in storage: no read tells them apart
        one_each = len(spans) == len(regions)
        ptr = p.untyped_storage().data_ptr()
        siblings.pop(functional.pop(key), None)
        for start, end in spans:
            members = [n for n in group if regions[n] == (start, end)]
            functional[(ptr, start, end)] = cast(str, members[0])
            others = [n for n in group if n != members[0]] if one_each else members[1:]
            if others:
                siblings[cast(str, members[0])] = others
        if p.dim() >= 3:
            for node in group:
                rows = transforms.get(node)
                if isinstance(getattr(rows, "rows", None), tuple) and not sources[node].flat:
                    rebased[node] = _within_slab(p, sources[node], rows)
            _stacked_biases(pair, params, key_of, biases, [[n for n in group if regions[n] == span] for span in spans])
    return rebased


def _stacked_biases(
    pair: Pair, params: dict, key_of: dict, biases: dict[StorageKey, str], slabs: list[list[str]]
) -> None:
    """The biases of a stacked weight's slabs (``slabs``: each slab's nodes, its first the one its read records)
    held stacked alike, one row per slab (``bqkv[layer]``): each row the bias of its slab's first node, in place of
    the whole parameter's (which named one node for every layer's add)."""
    coverage = pair.loading.coverage
    if coverage is None:
        return
    paths = {n.name: n.reference_path for n in pair.nodes}
    held = {s.key: (name, s) for name, sources in coverage.sources.items() for s in sources}
    for members in slabs:
        elements: set[tuple[str, int]] = set()
        for node in members:
            found = held.get(f"{paths.get(node)}.bias")
            b = params.get(found[0]) if found is not None else None
            if found is None or b is None or b.dim() < 2 or not found[1].rows or found[1].how != ROWS:
                elements = set()
                break
            width = 1 if found[1].flat else b.shape[-1]  # (rows count elements, or rows of (-1, last axis))
            elements |= {(found[0], r * width + j) for r in found[1].rows for j in range(width)}
        names = {name for name, _ in elements}
        if len(names) != 1:
            continue  # none of the slab's biases stacked, or in several parameters: left as they are
        (name,) = names
        b = params[name]
        first, last = min(r for _, r in elements), max(r for _, r in elements)
        if not b.is_contiguous() or last + 1 - first != len(elements):
            continue  # the slab's biases not one run of the parameter's elements
        # one run per slab, whatever the stacking: a layer's row (GPT-1's port's b_qkv (layers, 3, heads, head_dim))
        # or a (layer, language) cell (X-MOD's port's adapter biases (layers, languages, bottleneck))
        whole = key_of.get(id(b))
        if whole is not None:
            biases.pop(whole, None)
        start = cast(int, b.storage_offset())
        biases[(b.untyped_storage().data_ptr(), start + first, start + last + 1)] = members[0]


def _rowed_biases(
    pair: Pair, params: dict, key_of: dict, functional: dict[StorageKey, str], biases: dict[StorageKey, str]
) -> None:
    """A norm's weight and bias held as rows of one parameter of ours (``ln = [weight; bias]``, ``(2, hidden)``, or
    every layer's stacked), read in functions (``x_hat * ln[0] + ln[1]``): the weight's row is the node's read, the
    bias's row its bias, added after it as the reference's LayerNorm adds it. Rewrites ``functional`` (the whole
    parameter's key becomes the weight's row where it stood for that node) and adds to ``biases`` in place."""
    coverage = pair.loading.coverage
    if coverage is None:
        return
    nodes = {f"{n.reference_path}.weight": n.name for n in pair.nodes if n.ours.startswith("param:")}
    for name, p in params.items():
        key = key_of.get(id(p))
        if p.dim() < 2 or key is None:
            continue
        sources = {s.key: s for s in coverage.sources.get(name, [])}
        ptr = p.untyped_storage().data_ptr()
        for bias_key, bias_source in sources.items():
            node = nodes.get(bias_key.removesuffix(".bias") + ".weight") if bias_key.endswith(".bias") else None
            weight_source = sources.get(bias_key.removesuffix(".bias") + ".weight")
            if node is None or weight_source is None:
                continue
            weight, bias = _held_elements(p, weight_source), _held_elements(p, bias_source)
            if weight is None or bias is None or not (weight[1] <= bias[0] or bias[1] <= weight[0]):
                continue
            if functional.get(key) == node:  # the whole parameter stood for the node: its weight's row now does
                del functional[key]
                key = (ptr, weight[0], weight[1])
                functional[key] = node
            biases[(ptr, bias[0], bias[1])] = node


def _within_slab(p: torch.Tensor, source, rows):
    """``rows`` (a :class:`parity.user.align.Rows` of ``p``'s product over all its slabs) counted within the one
    slab holding them: what a product over that slab (``x @ W[layer]``) gives."""
    order = source.permute or tuple(range(p.dim()))
    per_slab = math.prod(p.shape[i] for i in order[1:-1])
    first = (rows.rows[0] // per_slab) * per_slab
    return replace(rows, rows=tuple(r - first for r in rows.rows), block=None, width=per_slab)


def _held_elements(p: torch.Tensor, source) -> tuple[int, int] | None:
    """The storage elements ``[start, end)`` of the parameter ``p`` (two axes or more) holding ``source``'s tensor:
    one whole row (``norms[i]``, ``ln[layer, 1]``); a run of one row's elements (``qk_norm[i] = [q_norm |
    k_norm]``: a flat source whose elements follow each other in storage); the one slab along the first axis
    holding a matrix's rows (``wqkv[layer]``, three axes or more); None for any other source."""
    order = source.permute or tuple(range(p.dim()))
    if source.one_row is not None and tuple(order) == tuple(range(p.dim())):  # a row of p's leading axes flattened
        index = torch.unravel_index(torch.tensor(source.one_row), tuple(p.shape[:-1]))
        return storage_span(p[tuple(int(i) for i in index)])
    rows = source.rows
    if source.how not in (ROWS, FUSED_PART) or not rows:
        return None
    if not source.flat:  # rows of p's view in the source's axis order, every axis but the last flattened
        if p.dim() < 3 or order[0] != 0:
            return None
        per_slab = math.prod(p.shape[i] for i in order[1:-1])
        slab = rows[0] // per_slab
        return storage_span(p[slab]) if all(r // per_slab == slab for r in rows) else None
    if p.dim() != 2 or tuple(rows) != tuple(range(rows[0], rows[-1] + 1)):
        return None
    (row, first), (last_row, last) = divmod(rows[0], p.shape[1]), divmod(rows[-1], p.shape[1])
    if row != last_row:  # one row's elements only: a vector spread over rows is another layout
        return None
    start, end = storage_span(p[row, first : last + 1])
    return (start, end) if end - start == len(rows) else None  # elements next to each other in storage


def _input_axes(pair: Pair, params: dict, ref_modules: dict) -> dict[int, tuple[torch.Tensor, int]]:
    """``id(weight) -> (weight, its axis holding the input features)`` for each of ours' parameters that a
    node reads in a function as a reference ``nn.Linear``'s weight (or that a module of ours holds as its
    ``weight``, which a function may read without running it), where loader coverage says that axis (every
    checkpoint tensor it holds agreeing)."""
    coverage = pair.loading.coverage
    out: dict[int, tuple[torch.Tensor, int]] = {}
    if coverage is None:
        return out
    for n in pair.nodes:
        weight = (
            n.ours[len("param:") :].partition("*")[0].partition("+")[0]
            if n.ours.startswith("param:")
            else f"{n.ours}.weight"
        )
        held = params.get(weight)
        if held is None or not isinstance(ref_modules.get(n.reference_path), torch.nn.Linear):
            continue
        axes = {s.input_axis(held.dim(), 2) for s in coverage.sources.get(weight, []) if s.key.endswith(".weight")}
        axis = axes.pop() if len(axes) == 1 else None
        if axis is not None:
            out[id(held)] = (held, axis)
    return out


#: ``Trace.extras`` flag of a trace of ours run in isolated mode (each node from the reference's inputs)
ISOLATED = "isolated"


def trace_ours(
    pair: Pair,
    run: Run,
    substitute: Trace | None = None,
    *,
    reference: Trace | None = None,
    tolerances: Tolerances | None = None,
) -> Trace:
    """Run our model; with ``substitute`` (isolated mode) every node continues from the reference's tensor.

    With ``reference`` (the reference's trace), every node is compared as ours produces it
    (:class:`~parity.compare.results.NodeStream`, on ``tolerances``, by default the run's) and dropped: the
    trace returned holds the results, the first failure with what its diagnosis reads, and the
    logits effect (``watched``). Without it, every tensor of ours is kept.
    """
    inverses = {n.name: n.inverse for n in pair.nodes if n.inverse is not None}
    device = device_of(pair.ours)
    kwargs = {}
    if run.attention_mask is not None:
        kwargs["attention_mask"] = on_device(device, run.attention_mask)
        if forward_accepts(pair.ours, "position_ids"):
            kwargs["position_ids"] = on_device(device, run.position_ids)
    # a chained run keeps the later calls of the nodes the reference ran more than once (compared after the forward)
    repeats = (
        frozenset(n for n, c in reference.calls.items() if c > 1)
        if reference is not None and substitute is None
        else None
    )
    trace = Trace.spilling(run.trace_memory, repeats=repeats or frozenset())
    if pair.alignment and run.attention_mask is not None:  # a user's model may run each row alone (varlen)
        trace.rows = run.attention_mask.bool().cpu()
    stream = None
    if reference is not None:
        output = pair.output_node
        stream = NodeStream(
            pair.nodes,
            reference,
            tolerances or run.tolerances,
            untapped_nodes(pair),
            DIAGNOSIS_CONTEXT_KINDS,
            watch=({output: logits_effect} if output is not None else {})
            | ({"*": worst_at(int(run.input_ids.shape[1]))} if run.options.locate else {}),
            padding=unjudged_padding(pair, run),
            # chained only: in isolated mode the scores are computed from the reference's q and k
            qk_through_scores=bool(pair.alignment) and substitute is None,
            provisional=frozenset(_folded_block(k) for k in _folds(pair)),
            keep_layer=bool(pair.alignment),
            reads_another=(  # chained only: in isolated mode the next node reads the reference's value
                (lambda node, after, mine: reads_another_value(pair, reference, node, after, mine))
                if pair.alignment and substitute is None
                else None
            ),
        )
        stream.attach(trace)
    if substitute is not None:
        trace.extras[ISOLATED] = True
    with (
        torch.no_grad(),
        recording(
            pair.ours,
            substitute=substitute,
            keep_inputs=diagnosis_inputs(pair),
            into=trace,
            **with_inverses(ours_recording(pair, reference.order if reference is not None else ()), inverses),
        ),
    ):
        run_ours(pair, pair.ours, on_device(device, run.input_ids), **kwargs)
    if stream is not None:
        stream.finish()
    return trace


def worst_at(seq: int):
    """``f(ours, ref) -> [row, position, max_abs]``: where a node's largest ``|ours - ref|`` sits, its
    position read on the first axis after the batch whose size is ``seq`` (``(batch, seq, ...)``, or
    ``(batch, heads, seq, ...)``: the query position); position None when no axis has that size."""

    def where(ours: torch.Tensor, ref) -> list:
        exact = ref if isinstance(ref, torch.Tensor) else ref.load()
        if ours.numel() == 0 or ours.dim() == 0:
            return [None, None, 0.0]
        diff = (ours.double() - exact.double()).abs().nan_to_num(nan=math.inf)
        flat = int(diff.argmax())
        coords = []
        for size in reversed(diff.shape):
            coords.append(flat % size)
            flat //= size
        coords.reverse()
        axis = next((a for a in range(1, diff.dim()) if diff.shape[a] == seq), None)
        return [int(coords[0]), int(coords[axis]) if axis is not None else None, float(diff.max())]

    return where


def run_ours(pair: Pair, fn, *args, **kwargs):
    """Call ours (its forward, or a cache protocol's ``forward``). A user's model (an aligned pair)
    that raises is bad input, one line naming it, and so is ``sys.exit()`` or an interrupt inside it
    (never a silent exit 0); our own families' models raising is a bug of parity's and propagates."""
    try:
        return fn(*args, **kwargs)
    except ParityError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        if not pair.alignment and not isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
        what = f"{type(pair.ours).__module__}.{type(pair.ours).__qualname__}.forward"
        if (
            isinstance(e, Exception)
            and isinstance(pair.ours, torch.nn.Module)
            and not raises_plain(pair.ours, fn, args, kwargs)
        ):
            # the same call runs without parity's hooks and function capture: what raised is parity's recording
            raise RuntimeError(
                f"parity: {what} runs without parity's hooks and function capture on the same input, so this is a "
                f"bug of parity's recording, not of your model ({type(e).__name__}: {one_line(e)[:200]})"
            ) from e
        if isinstance(e, SystemExit):
            reason = f"SystemExit({e.code!r}) (sys.exit)"
        elif isinstance(e, KeyboardInterrupt):
            reason = "KeyboardInterrupt (interrupted)"
        else:
            reason = f"{type(e).__name__}: {one_line(e)[:300]}"
        raise ParityError(f"your model's forward ({what}) raised {reason}{raised_where(e)}") from None


def raises_plain(model: torch.nn.Module, fn, args: tuple, kwargs: dict) -> bool:
    """Whether ``fn(*args, **kwargs)`` (a forward of ``model``) raises with parity's instrumentation set aside:
    every module's forward hooks and pre-hooks removed for the call, torch function modes (parity's function
    capture) disabled, ``parity.tap`` a pass-through, no gradients. The hooks are put back whatever happens."""
    saved = []
    for module in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):  # fmt: skip
            hooks = getattr(module, attr, None)
            if isinstance(hooks, dict) and hooks:
                saved.append((hooks, dict(hooks)))
                hooks.clear()
    from parity.record.hooks import recording_paused

    try:
        with torch.no_grad(), torch._C.DisableTorchFunction(), recording_paused():
            fn(*args, **kwargs)
    except BaseException:
        return True
    finally:
        for hooks, kept in saved:
            hooks.update(kept)
    return False


def raised_where(e: BaseException) -> str:
    """`` (in block_forward, my_model.py:42)``: the innermost frame of the user's own code in the
    traceback (not torch's, Transformers', parity's or an installed package's), or ``""``."""
    import os
    import traceback

    skip = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # parity's own package
    for name in ("torch", "transformers"):
        where = getattr(sys.modules.get(name), "__file__", None)
        if where:
            skip.append(os.path.dirname(os.path.abspath(where)))
    found = None
    for frame in traceback.extract_tb(e.__traceback__):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or "site-packages" in path or any(path.startswith(d + os.sep) for d in skip):
            continue
        found = frame
    return f" (in {found.name}, {os.path.basename(found.filename)}:{found.lineno})" if found is not None else ""


def trace_pair(pair: Pair, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[Trace, Trace]:
    """Run the reference, then ours, on ``input_ids`` and return their traces (reference, ours)."""
    run = plan(pair, CheckOptions(), input_ids, attention_mask)
    return trace_reference(pair, run), trace_ours(pair, run)


def reference_noise(pair: Pair, run: Run, ref_trace: Trace) -> dict[str, float]:
    """Per node, the reference's own max |error| against a float64 copy of itself (same weights, same
    inputs): the rounding noise of the run's dtype. Each float64 node is compared as it is produced
    and dropped (nothing of the float64 run is kept). Costs a float64 copy of the weights (refused up
    front when it would not fit)."""
    n_params = sum(p.numel() for p in pair.reference.parameters())
    require(8 * n_params, "a float64 copy of the reference (calibration, origin)", "use mode chained without calibrate")
    noise = {}

    def measure(name: str, exact: torch.Tensor) -> bool:
        store = ref_trace.later if call_of(name) is not None else ref_trace.tensors  # a later call: its own noise
        tensor = store.lazy(name) if hasattr(store, "lazy") else store.get(name)
        if tensor is not None and tensor.shape == exact.shape:
            noise[name] = max_error(tensor, exact.to("cpu"))
        return True

    from parity.run.float64 import Float64Mode, float64_models

    # really float64: Transformers' norms and RoPE cast to float32 explicitly (x.float()), which the
    # mode keeps in float64; a plain .to(float64) copy would carry float32 noise there
    (ref64,) = float64_models(pair.reference, what="a float64 copy of the reference (calibration, origin)")
    try:
        with Float64Mode():
            trace_reference(pair, run, model=ref64, sink=measure).close()
    finally:
        del ref64
    return {name: noise[name] for name in [*ref_trace.tensors, *ref_trace.later] if name in noise}


def calibrate_tolerances(
    pair: Pair, run: Run, ref_trace: Trace, safety: float = SAFETY_FACTOR, noise: dict[str, float] | None = None
) -> dict:
    """Per-node ``(atol, 0.0)``: ``safety`` times the reference's own error against itself in float64
    (:func:`reference_noise`), floored (:data:`CALIBRATION_FLOOR`) so that an exactly representable
    node does not demand bit-exactness."""
    noise = reference_noise(pair, run, ref_trace) if noise is None else noise
    floor = CALIBRATION_FLOOR.get(pair.dtype, 1e-6)
    return {name: (max(safety * err, floor), 0.0) for name, err in noise.items()}


def max_error(tensor, exact: torch.Tensor) -> float:
    """max |tensor - exact| in float64 over finite differences (0 for an empty tensor), a chunk at a
    time (``tensor`` may be a spilled one)."""
    worst = 0.0
    for a, b in zip(chunks(tensor, CHUNK), chunks(exact, CHUNK)):
        err = (a.double() - b.double()).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        worst = max(worst, float(err.max()))
    return worst


#: hint kinds that name a component only: a search for one change to the reference's code may name the cause
SEARCHED = frozenset({"untapped_block", "context_to_output", "moe_block", "attention_internals", "row_scale"})


def compare_run(
    pair: Pair, run: Run, ours: Trace, ref: Trace, tolerances: Tolerances, search: bool = True
) -> list[NodeResult]:
    """Every node compared; the first judged failure carries its hint (unless it is too large to
    diagnose in the memory available: :func:`undiagnosed`). ``search``: where no detector names a cause,
    look for one change to the reference's code that explains it (:func:`one_change_inside`; off for a
    pass whose hint is not the verdict's)."""
    padding = unjudged_padding(pair, run)
    results = compare_traces(ours, ref, pair.nodes, tolerances, untapped_nodes(pair), padding)
    if pair.alignment:
        results = computed_otherwise(
            results, {n.name for n in pair.nodes if n.ours and not n.ours.startswith(UNHOOKED)}
        )
    results = folded_differences(results, pair)
    if pair.alignment:
        results = recorded_elsewhere(results, frozenset(cast(set, ours.extras.get(RECORDED_ELSEWHERE, set()))))
    if pair.alignment and not ours.extras.get(ISOLATED):  # isolated scores come from the reference's q and k
        results = read_through_scores(results, frozenset(cast(set, ours.extras.get(QK_MOVED, set()))))
        results = weights_read_through_block(results, frozenset(cast(set, ours.extras.get(WEIGHTS_MOVED, set()))))
    if pair.alignment:
        # (chained only: in isolated mode each node reads the reference's inputs, so o_proj agreeing says nothing of
        # what parity read in ours inside a module)
        read = cast(
            frozenset, frozenset() if ours.extras.get(ISOLATED) else ours.extras.get(CAPTURED_IN_FUNCTIONS, frozenset())
        )
        captured = {
            n.name
            for n in pair.nodes
            if (n.ours.removeprefix("tap:").startswith(FUNCTIONS) or n.name in read) and n.kind in CAPTURED
        }
        results = misread_internals(results, frozenset(captured))
    if not ours.extras.get(ISOLATED):  # isolated mode substitutes first calls only: later ones run on ours' values
        results = with_later_calls(results, ours, ref, pair.nodes, tolerances, padding)
    if pair.alignment and not ours.extras.get(ISOLATED):  # ours' own logits: a gross internal difference is misread
        declared = frozenset(
            n.name for n in pair.nodes if n.ours.startswith("tap:") and not n.ours.startswith(f"tap:{FUNCTIONS}")
        )
        results = output_arbitrates(results, declared)
    bad = first_mismatch(results)
    if bad is not None and call_of(bad.name) is not None:
        results[bad.index] = replace(bad, hint=later_call_hint(results, bad, ref.calls, ours, ref))
    elif bad is not None and undiagnosed(bad) is None:
        spec = next((n for n in pair.nodes if n.name == bad.name), None)
        seen_ours, seen_ref = ours, ref
        mask: torch.Tensor | None = run.attention_mask
        positions: torch.Tensor | None = run.position_ids
        rows = unpadded_rows(ours, ref, mask, positions) if mask is not None and ours.assembled else None
        if rows is not None:  # ours ran each row alone (zeros at the padding): the detectors read the full rows
            seen_ours, seen_ref, mask, positions = rows
        hint = diagnose(bad, seen_ours, seen_ref, pair.facts, positions, mask, spec)
        if hint is None or hint.kind in SEARCHED:  # none, or a block's generic verdict: the loader's evidence first
            hint = (
                unequal_fold_before(results, bad, pair)
                or never_read_before(results, bad, pair)
                or loader_gap_before(results, bad, pair)
                or reshaped_before(results, bad, pair)
                or hint
            )
        hint = hint or derived_before(results, bad, pair) or untapped_before(results, bad, pair.facts)
        if search and (hint is None or hint.kind in SEARCHED):
            hint = one_change_inside(pair, run, results, bad, seen_ours, seen_ref, mask, hint) or hint
        results[bad.index] = replace(bad, hint=hint)
    return results


#: the query and key projections' names an attention module holds (Llama's, BERT's, GPT-2's fused one)
_QUERY_KEY = (("q_proj", "k_proj"), ("query", "key"), ("c_attn", "c_attn"), ("query_key_value", "query_key_value"))


def _attention_around(model: torch.nn.Module, parent: str, layer: str) -> str:
    """``parent`` (an output projection's module), or the module above it where its attention's q and k are a
    sibling module's (BERT's, RoFormer's ``attention.self`` beside ``attention.output``): the search's block must
    hold the attention's code, where the output projection's own module holds only the projection."""
    modules = dict(model.named_modules())

    def holds_attention(path: str) -> bool:
        module = modules.get(path)
        return module is not None and any(
            all(hasattr(m, n) for n in pair) for m in module.modules() for pair in _QUERY_KEY
        )

    grand = parent.rpartition(".")[0]
    if holds_attention(parent) or not grand.startswith(layer) or not holds_attention(grand):
        return parent
    return grand


def one_change_inside(
    pair: Pair,
    run: Run,
    results: list[NodeResult],
    bad: NodeResult,
    ours: Trace,
    ref: Trace,
    mask: torch.Tensor | None,
    hint: Hint | None,
) -> Hint | None:
    """The first failure after a block ours leaves untapped (``hint``'s block), or one no detector named (its
    own module): the one change to the reference's code inside that block after which the reference agrees
    with ours at that node, at the block's output or at its layer's (:mod:`parity.diagnose.one_change`), None
    when no single change does or the search cannot run (no such node is a module's output both traces kept)."""
    if pair.reference is None:
        return None
    specs = {n.name: n for n in pair.nodes}
    spec = specs.get(bad.name)
    named = hint.evidence.get("block") if hint is not None else None
    if hint is not None and hint.kind == "context_to_output":  # between the attention's context and o_proj
        named = bad.name.rsplit(".", 1)[0]
    layer = pair.facts.layer_path(bad.layer) if bad.layer is not None else None
    if named is None and spec is not None:  # no hint: the module holding the node (a norm inside its mixer)
        path = spec.reference_path.partition("#")[0]
        parent = path.rpartition(".")[0]
        named = parent if layer is not None and parent.startswith(layer) else path
        if layer is not None and spec.kind in OUTPUT_PROJECTIONS and named == parent:
            named = _attention_around(pair.reference, parent, layer)
    block = str(named or "")
    if spec is None or not block:
        return None
    later = [r for r in results[bad.index + 1 :] if r.layer == bad.layer and r.layer is not None]
    ends = [r for r in later if r.failed and (r.name == block or pair.facts.locate(r.name)[1] == "layer")]
    if not ends:  # the layer's output untapped in ours: the next node of the layer that fails (its o_proj), one
        # a module outputs (a captured attention internal is none: the search cannot read it)
        ends = [r for r in later if r.failed and r.name in specs and specs[r.name].kind not in CAPTURED][:1]
    judged = mask.detach().cpu().bool() if mask is not None else None

    def close_to(target: torch.Tensor, result: NodeResult) -> Callable[[torch.Tensor], bool]:
        """Equal to ``target`` within ``result``'s tolerance, at the positions judged."""
        b_all = target.detach().cpu().double()

        def close(value: torch.Tensor) -> bool:
            a, b = value.detach().cpu().double(), b_all
            if judged is not None and a.shape == b.shape and a.dim() >= 2 and a.shape[:2] == judged.shape:
                a, b = a[judged], b[judged]
            return within_tolerance(a, b, result)

        return close

    targets = []
    for result in [bad, *ends[:2]]:
        node = specs.get(result.name)
        theirs, recorded = ours.tensors.get(result.name), ref.tensors.get(result.name)
        if node is None or theirs is None or recorded is None or not theirs.is_floating_point():
            continue
        targets.append(
            one_change.Target(
                result.name,
                node.reference_path,
                close_to(theirs, result),
                close_to(recorded, result),
                node.reference_transform,
            )
        )
    device = device_of(pair.reference)

    def forward() -> object:
        return pair.reference(
            input_ids=on_device(device, run.input_ids),
            attention_mask=on_device(device, run.attention_mask),
            position_ids=on_device(device, run.position_ids),
            use_cache=False,
        )

    found = one_change.search(pair.reference, block, targets, forward, scope=layer, unseen=_unseen(pair, spec))
    return one_change.named(found, block.partition("#")[0]) if found else None


def _unseen(pair: Pair, spec: NodeSpec) -> tuple[str, ...]:
    """The modules beside the failing node's (children of its parent) that no node records, nor anything inside
    them: steps of the reference the trace never saw (an attention residual computing the MLP's input)."""
    assert pair.reference is not None
    paths = {n.reference_path.partition("#")[0] for n in pair.nodes if n.reference_path}
    parent = spec.reference_path.partition("#")[0].rpartition(".")[0]
    holder = pair.reference.get_submodule(parent) if parent else pair.reference
    found = []
    for name, child in holder.named_children():
        path = f"{parent}.{name}" if parent else name
        if isinstance(child, torch.nn.ModuleList | torch.nn.ModuleDict) or not list(child.parameters()):
            continue  # the layers' list; a rotary embedding or a weightless helper
        if any(p == path or p.startswith(path + ".") for p in paths):
            continue
        found.append(path)
    return tuple(found)


def _since_agreement(results: list[NodeResult], bad: NodeResult) -> list[NodeResult]:
    """The nodes between the last one that agreed before ``bad`` and ``bad`` itself."""
    before = results[: bad.index]
    last_ok = max((r.index for r in before if r.passed), default=-1)
    return before[last_ok + 1 :]


def never_read_before(results: list[NodeResult], bad: NodeResult, pair: Pair | None = None) -> Hint | None:
    """A node between the last one that agreed and the first failure whose weight ours never read in the
    forward (a norm or projection computed in functions, skipped): the likeliest cause, named when no
    detector read one at the failing node. A weight ours' forward does read by some operation (``repeat``ed
    across heads, a norm's gain tiled) is no skipped one: nothing is said then."""
    # since the last agreement, or earlier in the failing node's own block (a norm on one branch of an attention,
    # MLA's rope key, whose other branches' nodes agree in between)
    block = bad.name.rsplit(".", 1)[0] + "."
    # a lookup that agrees vouches for no other lookup summed beside it (a token-type table skipped between the
    # token and position embeddings, all read before the first layer's first node)
    last_ok = max((r.index for r in results[: bad.index] if r.passed and not _is_lookup(r.name)), default=-1)
    scope = (
        _since_agreement(results, bad)
        + [r for r in results[: bad.index] if r.name.startswith(block) and "[" not in r.name]
        + [r for r in results[last_ok + 1 : bad.index] if _is_lookup(r.name)]
    )
    skipped = list(
        {
            r.name: r
            for r in scope
            # (a node the reference never ran either, XLM's language embedding with no languages given: not skipped)
            if r.status == UNTAPPED and r.detail.startswith("no product in ours read") and r.shape_ref is not None
        }.values()
    )
    if skipped and pair is not None and pair.ours is not None:
        specs = {n.name: n.ours for n in pair.nodes}
        read: dict[str, tuple[str, ...]] = {}
        probe_reads(pair.ours, pair.facts.vocab_size, within=read)
        skipped = [r for r in skipped if specs.get(r.name, "").removeprefix("param:") not in read]
    if not skipped:
        return None
    names = ", ".join(r.name for r in skipped[:3])
    return Hint(
        "missing",
        f"likely {names} skipped in ours, or computed from another tensor than its weight: the reference runs it, "
        f"ours never read its weight in this forward, and {bad.name} is the first node after it to differ",
        {"side": "ours", "never_read": [r.name for r in skipped]},
    )


def _is_lookup(name: str) -> bool:
    """An embedding table's node (token, position or token-type rows read by id): ``embed_tokens``, ``wte``,
    BERT's ``token_type_embeddings``, the position tables of :data:`POSITION_TABLES`."""
    leaf = name.rsplit(".", 1)[-1]
    return "embed" in leaf.lower() or leaf in ("wte", *POSITION_TABLES)


def _failure_scope(results: list[NodeResult], bad: NodeResult) -> list[str]:
    """The failing node and the untapped nodes since the last agreement before it: where its cause may sit."""
    return [bad.name] + [r.name for r in _since_agreement(results, bad) if r.status == UNTAPPED]


def _module_in(key: str, scope: list[str]) -> bool:
    """Whether the module holding checkpoint tensor ``key`` is one of ``scope``'s nodes or holds one."""
    module = key.rsplit(".", 1)[0]
    return any(n == module or n.startswith(module + ".") for n in scope)


def loader_gap_before(results: list[NodeResult], bad: NodeResult, pair: Pair) -> Hint | None:
    """The failure sits in (or right after the untapped nodes of) a module some of whose checkpoint tensor ours
    holds only in part (loader coverage's gaps: a shared MLP cut to one expert's width): that gap is the
    likeliest cause, named with the coverage's own words."""
    coverage = pair.loading.coverage if pair.loading is not None else None
    gaps = list(getattr(coverage, "gaps", None) or [])
    if not gaps:
        return None
    scope = _failure_scope(results, bad)
    within = [g for g in gaps if any(g.startswith(n + ".") for n in scope)]
    if not within:
        return None
    return Hint(
        "loader_gap",
        f"likely the loader: ours holds only part of a checkpoint tensor here ({'; '.join(within[:2])}"
        f"{f'; {len(within) - 2} more' if len(within) > 2 else ''}); the nodes before agree, and {bad.name} is "
        "the first node after them to differ",
        {"side": "ours", "gaps": within},
    )


def reshaped_before(results: list[NodeResult], bad: NodeResult, pair: Pair) -> Hint | None:
    """The failure sits in (or right after the untapped nodes of) a module one of whose checkpoint tensors ours holds
    as a view of all its elements in their order under the key's axis sizes permuted (``(heads, out, in)`` kept as
    ``(heads, in, out)`` by ``reshape``, not ``transpose``): the values land on other axes than the key's."""
    coverage = pair.loading.coverage if pair.loading is not None else None
    if coverage is None:
        return None
    scope = _failure_scope(results, bad)
    shapes = _key_shapes(pair)
    params = dict(pair.ours.named_parameters())
    for name, sources in coverage.sources.items():
        for source in sources:
            held = params.get(name)
            key = shapes.get(source.key)
            # a view (slice) or a copy in another shape whose elements keep the checkpoint's order (a layout with
            # no axis moved)
            reshaped = source.how == SLICE or (
                source.how == LAYOUT and tuple(source.permute or ()) == tuple(range(len(source.permute or ())))
            )
            if not reshaped or held is None or key is None or not _module_in(source.key, scope):
                continue
            mine = tuple(held.shape)
            if mine != key and sorted(mine) == sorted(key) and held.numel() == math.prod(key):
                return Hint(
                    "reshaped_weight",
                    f"likely the loader: ours holds {source.key} {key} as {name} {mine}, its elements in the "
                    f"checkpoint's order (a reshape, where a transpose or permute would move them onto those axes); "
                    f"the nodes before agree, and {bad.name} is the first node after it to differ",
                    {"side": "ours", "key": source.key, "param": name, "key_shape": key, "shape": mine},
                )
    return None


#: the ways coverage finds a checkpoint tensor held with its values unchanged (a scale of one)
_AS_IS = frozenset({SHARED, COPY, TRANSPOSED, ROWS, SLICE, LAYOUT, SPLIT, STRIDED})


def _scale_at_load(
    pair: Pair, key: str, params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
) -> tuple[str, float] | None:
    """``(parameter, c)``: where ours holds checkpoint tensor ``key``, times ``c`` (1 as it is), from coverage's
    sources or, for a key computed at load, a block of ours' ``params`` derived from it (``tensors``: the
    reference's, by key); None when neither says."""
    coverage = pair.loading.coverage if pair.loading is not None else None
    for name, sources in (getattr(coverage, "sources", None) or {}).items():
        for source in sources:
            if source.key == key and source.how == SCALED and source.scale is not None:
                return name, float(source.scale)
            if source.key == key and source.how in _AS_IS:
                return name, 1.0
    into, tensor = _derived(pair).get(key), tensors.get(key)
    if not into or tensor is None:
        return None
    return scale_held(params, tensor, into)


def unequal_fold_before(results: list[NodeResult], bad: NodeResult, pair: Pair) -> Hint | None:
    """The failure sits in (or right after the untapped nodes of) a projection whose weight ours holds times one
    number and whose bias times another (``1 / sqrt(head_dim)`` folded into the query's weight at load and not
    into its bias: ``(x W + b) s`` needs both scaled): that fold named, with both factors."""
    if not _derived(pair) and not any(
        s.how == SCALED for ss in getattr(getattr(pair.loading, "coverage", None), "sources", {}).values() for s in ss
    ):
        return None
    scope = _failure_scope(results, bad)
    tensors: dict[str, torch.Tensor] = dict(pair.reference.named_parameters()) if pair.reference is not None else {}
    params: dict[str, torch.Tensor] = dict(pair.ours.named_parameters())
    for weight in sorted(k for k in tensors if k.endswith(".weight") and _module_in(k, scope)):
        bias = weight[: -len("weight")] + "bias"
        if bias not in tensors:
            continue
        w, b = _scale_at_load(pair, weight, params, tensors), _scale_at_load(pair, bias, params, tensors)
        if w is None or b is None or abs(w[1] - b[1]) <= 1e-4 * max(abs(w[1]), abs(b[1])):
            continue
        return Hint(
            "derived_at_load",
            f"likely a scale folded in at load into the weight and not the bias (or not alike): ours holds {weight} "
            f"times {w[1]:.6g} (in {w[0]}) and {bias} times {b[1]:.6g} (in {b[0]}), where (x W + b) * s needs "
            f"both times s; the nodes before agree, and {bad.name} is the first node after them to differ",
            {"side": "ours", "keys": [weight, bias], "into": sorted({w[0], b[0]}), "scales": [w[1], b[1]]},
        )
    return None


def derived_before(results: list[NodeResult], bad: NodeResult, pair: Pair) -> Hint | None:
    """The failure sits in (or right after the untapped nodes of) a module whose checkpoint tensors ours
    computes into other values at load (a norm folded into the next projection, DiffLlama's lambdas folded
    into one number: :mod:`parity.user.derived`), the nodes before agree: that computation is the likeliest
    cause, named when no detector read one; unless the module has other tensors ours reads where nothing taps
    them (a conv, a bias read in functions): then the block is named as the component, the derived values one
    suspect among them."""
    derived = _derived(pair)
    if not derived:
        return None
    scope = _failure_scope(results, bad)
    # a tensor of the model's root (Zaya's embedding affine, folded into the table) holds no block of its own:
    # the nodes after it are all "inside" it, so it is no suspect of one of them
    stack = pair.facts.layer_prefix + "."
    keys = [k for k in derived if not stack.startswith(k.rsplit(".", 1)[0] + ".") and _module_in(k, scope)]
    if not keys:
        return None
    into = sorted({p for k in keys for p in derived[k]})
    where = f" (into {', '.join(into[:3])})" if into else " (into values no parameter holds)"
    levels = _quantised_levels(pair.ours, into)
    if levels is not None:
        name, count = levels
        return Hint(
            "derived_at_load",
            f"likely the weights quantised at load: ours' {name} (computed from {', '.join(keys[:4])}) holds only "
            f"{count} distinct values (e.g. ternary {{-1, 0, +1}} times a scale, BitNet's absmean quantisation) "
            f"where the checkpoint's are full precision and the reference uses them as they are; the nodes before "
            f"agree, and {bad.name} is the first node after them to differ",
            {"side": "ours", "keys": keys, "into": into, "levels": count},
        )
    offset = _offset_at_load(pair, keys, into)
    if offset is not None:
        return Hint(
            "norm_weight_offset",
            f"likely {offset}; the nodes before agree, and {bad.name} is the first node after them to differ",
            {"side": "ours", "keys": keys, "into": into},
        )
    permuted = _permuted_at_load(pair, keys, into)
    if permuted is not None:
        return Hint(
            "derived_at_load",
            f"likely {permuted}; the nodes before agree, and {bad.name} is the first node after them to differ",
            {"side": "ours", "keys": keys, "into": into, "permuted": permuted},
        )
    others = _other_suspects(results, pair, keys, bad)
    # an attention's internals untapped before the failure (its mask, scale, softmax: computed from no tensor of
    # the checkpoint) are as much a suspect as the derived values
    internals = [r.name for r in _since_agreement(results, bad) if r.status == UNTAPPED and r.kind in CAPTURED]
    others += internals
    if others:  # the block computes more than the derived values untapped: one suspect of several, not the cause
        block = keys[0].rsplit(".", 1)[0]
        if internals:
            block = internals[0].rsplit(".", 1)[0]
        return Hint(
            "untapped_block",
            f"likely inside {block}: the nodes before agree and {bad.name} is the first to differ, but ours computes "
            f"part of {block} where nothing taps it ("
            + (
                f"its {fmt_list(n.rsplit('.', 1)[1] for n in internals)}"
                if internals
                else "reading " + ", ".join(others[:3])
            )
            + "), and computes "
            f"{', '.join(keys[:2])} at load{where}: tap its internals (parity.tap) to be told which",
            {"block": block, "keys": keys, "into": into, "untapped": others},
        )
    return Hint(
        "derived_at_load",
        f"likely the values ours computes at load from {', '.join(keys[:4])}{where}: the nodes before agree, and "
        f"{bad.name} is the first node after them to differ; compare that computation with the reference's "
        "formula (which tensor, which axis, which order)",
        {"side": "ours", "keys": keys, "into": into},
    )


def _offset_at_load(pair: Pair, keys: list[str], into: list[str]) -> str | None:
    """How ours holds a norm's weight ``w`` as ``1 + w`` (or ``w - 1``), a row of a parameter it computes at load
    (two norms' gains stacked), where the reference's norm multiplies by ``w`` as it is (or by ``1 + w``): its
    words, None when no derived row is such an offset or the reference's norm takes the same form."""
    held = dict(pair.ours.named_parameters())
    modules = dict(pair.reference.named_modules()) if pair.reference is not None else {}
    weights = dict(pair.reference.named_parameters()) if pair.reference is not None else {}
    for key in keys:
        param = weights.get(key)
        norm = modules.get(key.rpartition(".")[0])
        if param is None or param.dim() != 1 or norm is None or "Norm" not in type(norm).__name__:
            continue
        w = param.detach().float().cpu()
        theirs = _norm_offset(norm, w)
        for name in into:
            p = held.get(name)
            if p is None or p.numel() % w.numel():
                continue
            rows = p.detach().float().cpu().reshape(-1, w.numel())
            for offset in (1.0, -1.0):
                row = next((r for r in range(len(rows)) if torch.allclose(rows[r], w + offset, atol=1e-6)), None)
                # ours multiplies by what it holds (1 + w), or by 1 plus it (w - 1 held: w): the reference's form
                # alike is no fault, nor one parity cannot read
                if row is None or theirs is None or theirs == (1.0 if offset > 0 else 0.0):
                    continue
                held_as, their_form = ("1 + w", "w") if offset > 0 else ("w - 1", "1 + w")
                return (
                    f"the norm weight offset: ours holds {key} as {held_as} (row {row} of {name}, computed at load) "
                    f"where the reference's norm multiplies by {their_form}"
                )
    return None


def _norm_offset(norm: torch.nn.Module, w: torch.Tensor) -> float | None:
    """1.0 when ``norm`` (an RMS norm of weight ``w``) multiplies by ``1 + w``, 0.0 when by ``w``; None when
    neither (it centres, or takes more arguments)."""
    x = torch.randn(3, w.numel(), generator=torch.Generator().manual_seed(0))
    weight = next(iter(norm.parameters()))
    try:
        with torch.no_grad():
            y = norm(x.to(weight.dtype)).float()
    except Exception:  # a norm that takes more than one input
        return None
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    for offset in (0.0, 1.0):
        if torch.allclose(y, normed * (w + offset), rtol=1e-3, atol=1e-3):
            return offset
    return None


def _permuted_at_load(pair: Pair, keys: list[str], into: list[str]) -> str | None:
    """How ours holds a 2-D checkpoint tensor's values in another order (one key, one parameter of as many
    elements): its columns (or rows) permuted, named as a transposed ``(a, b)`` grid where the order is one (a
    ``(head_dim, heads)`` layout read as ``(heads, head_dim)``); None for anything else."""
    held = dict(pair.ours.named_parameters())
    if len(keys) != 1 or len(into) != 1 or into[0] not in held:
        return None
    # the checkpoint's tensor, or the reference's parameter of that name (the float64 pair keeps no state dict)
    found = dict(pair.reference.named_parameters()).get(keys[0])
    w, p = (found.detach() if found is not None else None), held[into[0]].detach()
    if (
        w is None
        or w.dim() != 2
        or p.numel() != w.numel()
        or not torch.equal(w.flatten().sort().values, p.flatten().sort().values)
    ):
        return None
    for ours, how in ((p.reshape(w.shape), ""), (p.reshape(w.shape[::-1]).T, " (transposed)")):
        for axis, what in ((1, "input columns"), (0, "output rows")):
            perm = _axis_permutation(w, ours, axis)
            if perm is None:
                continue
            n = len(perm)
            grid = next(
                (
                    (a, n // a)
                    for a in range(2, n)
                    if n % a == 0 and perm == [(j % a) * (n // a) + j // a for j in range(n)]
                ),
                None,
            )
            named = _grid_name(pair, grid) if grid is not None else ""
            shape = f"a ({grid[0]}, {grid[1]}) grid transposed{named}" if grid is not None else "another order"
            return (
                f"{keys[0]} held by ours' {into[0]}{how} with its {what} in {shape} (ours[j] = checkpoint"
                f"[{', '.join(map(str, perm[:6]))}, ...]): a layout reshaped where it needed a permute at load"
            )
    return None


def _axis_permutation(w: torch.Tensor, ours: torch.Tensor, axis: int) -> list[int] | None:
    """``perm`` with ``ours.select(axis, j) == w.select(axis, perm[j])`` for every ``j`` (not the identity), else None."""
    a, b = w.movedim(axis, 0).flatten(1), ours.movedim(axis, 0).flatten(1)
    index = {tuple(row.tolist()): i for i, row in enumerate(a)}
    perm = [index.get(tuple(row.tolist()), -1) for row in b]
    return perm if -1 not in perm and sorted(perm) == list(range(len(perm))) and perm != sorted(perm) else None


def _grid_name(pair: Pair, grid: tuple[int, int]) -> str:
    """`` (heads by head_dim)`` when the grid's sides are the model's heads and head_dim, else ``""``."""
    heads, head_dim = pair.facts.num_heads, pair.facts.head_dim
    if set(grid) == {heads, head_dim} and heads != head_dim:
        # ours' j = outer * a + inner, its inner axis of grid[0]: its outer (major) axis is grid[1]'s
        ours_major = "head_dim" if grid[1] == head_dim else "heads"
        theirs = "heads" if ours_major == "head_dim" else "head_dim"
        return f": ours holds them {ours_major}-major where the checkpoint is {theirs}-major"
    return ""


def _quantised_levels(model, params: list[str]) -> tuple[str, int] | None:
    """``(parameter, distinct values)`` for the first of ``params`` (ours' parameters computed at load) that is
    a matrix of at most 16 distinct values over at least 256 elements: quantised, not a float computation."""
    held = dict(model.named_parameters()) if model is not None else {}
    for name in params:
        p = held.get(name)
        if p is not None and p.dim() >= 2 and p.numel() >= 256 and p.is_floating_point():
            count = int(torch.unique(p.detach().float().cpu()).numel())
            if count <= 16:
                return name, count
    return None


def untapped_before(results: list[NodeResult], bad: NodeResult, facts) -> Hint | None:
    """The failure is the first node after a stretch ours left untapped (a block computed in functions
    nothing taps or aligns: JetMoE's mixture of attention heads), the nodes before it agree: the difference
    enters inside that block, named as the component when no detector named a cause."""
    between = _since_agreement(results, bad)
    stretch = [r.name for r in between if r.status == UNTAPPED]
    if not stretch or len(stretch) != len(between):
        return None
    inner = [n for n in stretch if facts.locate(n)[1] != "layer"]
    layers = sorted({facts.locate(n)[0] for n in inner if facts.locate(n)[0] is not None})
    if len(layers) > 1:  # a stretch over two layers: the difference enters in the first (its later ones read it)
        inner = [n for n in inner if facts.locate(n)[0] == layers[0]]
    if not inner:  # only a layer's output (its sum) untapped: the block of that layer no agreeing node checked
        block = _unchecked_block(results, bad, stretch[-1])
    else:
        common: list[str] = []
        for pieces in zip(*(n.rsplit(".", 1)[0].split(".") for n in inner), strict=False):
            if len(set(pieces)) != 1:
                break
            common.append(pieces[0])
        block = ".".join(common) if common else inner[-1].rsplit(".", 1)[0]
    return Hint(
        "untapped_block",
        (
            f"likely inside {block}: the nodes before it agree, every node of it is untapped in ours ({len(stretch)}: "
            f"computed in functions nothing taps or aligns, e.g. {stretch[0]}), and {bad.name} is the first node "
            "after it to differ; tap its internals (parity.tap) to be told where"
            if inner
            else f"likely inside {block}: the nodes before agree, but ours leaves {stretch[-1]}'s output untapped "
            f"and no node of {block} after its untapped ones agrees to check it; {bad.name} is the first node after "
            "it to differ; tap its internals (parity.tap) to be told where"
        ),
        {"block": block, "untapped": stretch[:8]},
    )


def _unchecked_block(results: list[NodeResult], bad: NodeResult, layer: str) -> str:
    """The block of ``layer`` (its child: a mixer, a MoE) holding untapped nodes that no later node of the same
    block checked by agreeing (a MoE's experts, while its shared MLP beside them agrees and a Mamba's conv is
    checked by its norm after it); the layer itself when none or several are."""
    within = [r for r in results[: bad.index] if r.name.startswith(layer + ".")]
    child = lambda name: ".".join(name.split(".")[: layer.count(".") + 2])
    unchecked = []
    for k, r in enumerate(within):
        if r.status != UNTAPPED or child(r.name) in unchecked:
            continue
        if not any(later.passed and child(later.name) == child(r.name) for later in within[k + 1 :]):
            unchecked.append(child(r.name))
    return unchecked[0] if len(unchecked) == 1 else layer


def _other_suspects(results: list[NodeResult], pair: Pair, keys: list[str], bad: NodeResult) -> list[str]:
    """Checkpoint tensors of the modules holding ``keys`` (tensors ours computes at load) that are neither among
    ``keys`` nor the weight of a node that agreed, of the failing node or of a judged node after it: read where
    nothing taps them (a conv, a bias read in functions), each as much a suspect as the derived values (Qwen3-Next's
    Gated DeltaNet: A_log computed at load beside its untapped conv1d and dt_bias)."""
    coverage = pair.loading.coverage if pair.loading is not None else None
    # the checkpoint's keys: the state dict, or (the float64 pair keeps names only) what coverage placed
    state = list((pair.loading.state_dict if pair.loading is not None else None) or {}) or [
        *(getattr(coverage, "consumed", None) or {}),
        *_derived(pair),
    ]
    # a node that agreed, the failing one, or a judged node after it: none of their weights is the suspect
    agreed = {r.name for r in results if r.passed or (r.index > bad.index and r.status != UNTAPPED)} | {bad.name}
    modules = {k.rsplit(".", 1)[0] for k in keys}
    return [
        k
        for k in state
        if k not in keys and k.rsplit(".", 1)[0] not in agreed and any(k.startswith(m + ".") for m in modules)
    ]


def _derived(pair: Pair) -> dict[str, list[str]]:
    """The pair's checkpoint keys computed at load (loader coverage's ``derived``), key -> our parameters."""
    return getattr(pair.loading.coverage if pair.loading is not None else None, "derived", None) or {}


def _folds(pair: Pair) -> dict[str, str]:
    """Checkpoint keys ours holds otherwise than loaded, key -> how: computed at load (:func:`_derived`), or
    multiplied by a named constant (a scale folded into them: GLM-4.5's routed_scaling_factor moved from the
    routing weights into the experts' down projections)."""
    folds = {key: "computed at load from" for key in _derived(pair)}
    coverage = pair.loading.coverage if pair.loading is not None else None
    for sources in (getattr(coverage, "sources", None) or {}).values():
        for source in sources:
            if source.how == SCALED and source.scale_name:
                folds.setdefault(source.key, f"multiplied by {source.scale_name} at load in")
    return folds


def _folded_block(key: str) -> str:
    """The block a checkpoint tensor belongs to: a norm's or a projection's weight, its parent (the
    attention, the layer); a block's own tensor (DiffLlama's ``self_attn.lambda_q1``), that block; a
    mixture of experts' stacked weights, the MoE block (its routing weights scale their outputs)."""
    if ".experts." in key:
        return key.split(".experts.", 1)[0]
    module = key.rsplit(".", 1)[0]
    leaf = module.rsplit(".", 1)[-1]
    return module.rsplit(".", 1)[0] if "norm" in leaf or leaf.endswith("proj") else module


def folded_differences(results: list[NodeResult], pair: Pair) -> list[NodeResult]:
    """A user's model that computes some checkpoint tensors into other values at load (:mod:`parity.user.derived`:
    HunYuan's key-norm gain folded into the query's, with the softmax scale) may differ at a block's inner
    nodes by design of the fold while the block's output agrees: those mismatches, inside a block holding
    such a tensor and followed there by agreeing nodes up to its last judged one, are untapped with the
    reason, not failed. Where the block's output differs they stay failures (``derived_at_load`` names them)."""
    derived = _folds(pair)
    if not derived:
        return results
    out = list(results)
    # a folded tensor the reference ties to another (a scaled embedding table its tied head reads too): the tie's
    # block holds it as well, and may hand the fold on to the node after it (the head's input scaled down by as much)
    ties = tied_weights(pair.reference) if pair.reference is not None else {}
    tied = {_folded_block(target): source for target, source in ties.items() if source in derived}
    for block in {_folded_block(k) for k in derived} | set(tied):
        inside = [i for i, r in enumerate(out) if r.name.startswith(block + ".") or r.name == block]
        failing = [i for i in inside if out[i].status == MISMATCH]
        judged = [i for i in inside if out[i].status != UNTAPPED]
        if block in tied and inside:
            judged += [i for i in range(inside[-1] + 1, len(out)) if out[i].status != UNTAPPED][:1]
        if not failing or not judged or any(out[i].failed and out[i].status != MISMATCH for i in inside):
            continue
        if judged[-1] <= max(failing) or not all(out[i].passed for i in judged if i > max(failing)):
            continue
        keys = "; ".join(
            f"{how} {k}" for k, how in derived.items() if _folded_block(k) == block or tied.get(block) == k
        )
        for i in failing:
            out[i] = replace(
                out[i],
                status=UNTAPPED,
                detail=f"{out[i].detail + '; ' if out[i].detail else ''}differs where ours holds values {keys}, and "
                f"{out[judged[-1]].name} agrees: the fold moves values between this block's nodes (not judged)",
            )
    return out


def misread_internals(results: list[NodeResult], captured: frozenset[str]) -> list[NodeResult]:
    """Attention internals parity read from ours' functions (``captured``: no tap of the user's) that differ
    while their block's ``o_proj`` after them agrees, with nothing but such internals failing between, or in a block
    where another internal read so does not even fit the reference's shape: what parity read in ours is another
    product of the block (a DSA indexer's q k^T taken for the attention's), not ours' attention. Untapped with the
    reason, not failed; a fault inside that attention is then judged at its o_proj."""
    out = list(results)
    index = {r.name: i for i, r in enumerate(out)}
    # blocks where what parity read does not even run along the reference's tokens (a (batch, heads, tokens, dim)
    # read whose token axis is another length) and no internal read there agrees: every internal read there is
    # suspect; a fault's shape keeps the tokens (a head_dim taken from the hidden size, values zero-padded) and is
    # judged where it shows
    agreed = {r.name.rsplit(".", 1)[0] for r in results if r.passed and r.name in captured}
    misfit = {r.name.rsplit(".", 1)[0] for r in results if r.name in captured and _off_tokens(r)} - agreed
    for i, r in enumerate(results):
        if not r.failed or r.name not in captured:
            continue
        stem = r.name.rsplit(".", 1)[0]
        at = index.get(f"{stem}.o_proj")
        if stem in misfit:
            reason = "another internal of this block read in ours does not fit the reference's shape"
        elif (
            at is None
            or at < i
            or not out[at].passed
            or any(b.failed and b.name not in captured for b in out[i + 1 : at])
        ):
            continue
        else:
            reason = f"{out[at].name} agrees"
        out[i] = replace(
            r,
            status=UNTAPPED,
            detail=f"{r.detail + '; ' if r.detail else ''}differs while {reason}: what parity read in ours' "
            "functions here is another product of the block than its attention (not judged; tap it with parity.tap "
            "to judge it)",
        )
    return out


def _off_tokens(r: NodeResult) -> bool:
    """A shape mismatch of a captured attention internal whose token axis (axis 2 of ``(batch, heads, tokens,
    ...)``, axis 1 of the context's ``(batch, tokens, width)``) has another length than the reference's."""
    ours, ref = r.shape_ours, r.shape_ref
    if r.status != SHAPE or ours is None or ref is None or len(ours) != len(ref):
        return False
    axis = 1 if r.kind == "context" else 2
    return len(ours) > axis and ours[axis] != ref[axis]


def read_through_scores(results: list[NodeResult], moved: frozenset[str] = frozenset()) -> list[NodeResult]:
    """q and k after RoPE are read only through their product: a user's model that applies a constant to the
    scores where the reference applies it to q and k (YaRN's attention factor on cos and sin, taken as its
    square on the softmax scale) differs at ``q_rot``/``k_rot`` by that constant (:func:`moved_constant`) and
    agrees at ``scores`` (or, in ``moved``'s attention blocks, in some of its heads: a bug in the others). Such
    mismatches, followed by those scores with nothing but q/k nodes between, are untapped with the reason, not
    failed; where the scores differ in every head, or q/k differ otherwise (a tap's layout), they stay
    failures."""
    out = list(results)
    index = {r.name: i for i, r in enumerate(out)}
    for i, r in enumerate(results):
        if not moved_constant(r):
            continue
        stem = r.name.rsplit(".", 1)[0]
        at = index.get(f"{stem}.scores")
        if at is None or at < i or out[at].status == UNTAPPED or not (out[at].passed or stem in moved):
            continue
        between = out[i + 1 : at]
        if any(b.failed and b.kind not in QK_KINDS for b in between):
            continue
        out[i] = replace(
            r,
            status=UNTAPPED,
            detail=f"{r.detail + '; ' if r.detail else ''}differs while {out[at].name} agrees"
            + ("" if out[at].passed else " in some heads")
            + ": q and k are read only "
            "through their product, so a constant moved between them and the scores (RoPE's attention factor "
            "taken on the softmax scale) changes nothing (not judged)",
        )
    return out


def weights_read_through_block(results: list[NodeResult], moved: frozenset[str]) -> list[NodeResult]:
    """Top-k routing weights that differ from the reference's by one constant (``moved``: seen by the
    node stream, their MoE block's output judged after them) are read through that output: a port may apply
    routed_scaling_factor to the experts' output instead of to the weights. Untapped with the reason; the
    block's output, pass or fail, is judged."""
    if not moved:
        return results
    return [
        replace(
            r,
            status=UNTAPPED,
            detail=f"{r.detail + '; ' if r.detail else ''}the reference's times one constant: a scale of the weights "
            "(routed_scaling_factor) taken on the experts' output instead, judged at the block's output (not judged)",
        )
        if r.name in moved and r.status == MISMATCH
        else r
        for r in results
    ]


def recorded_elsewhere(results: list[NodeResult], moved: frozenset[str]) -> list[NodeResult]:
    """A user's model's failures whose value ours recorded at another step than the one its next node reads
    (``moved``, from the stream: :func:`reads_another_value`), untapped with the reason, not failed."""
    return [
        replace(
            r,
            status=UNTAPPED,
            detail=f"{r.detail + '; ' if r.detail else ''}ours' value here is not what the next node reads (that node "
            "agrees, and its weight on ours' value gives another result): recorded at another step of what ours "
            "computes in functions, a gated norm's product before its gate (not judged)",
        )
        if r.name in moved and r.failed
        else r
        for r in results
    ]


def reads_another_value(pair: Pair, ref: Trace, node: str, after: str, mine: torch.Tensor) -> bool:
    """Whether the reference's ``after`` (a projection, judged equal to ours) reads the reference's ``node`` and
    its weight applied to ``mine`` (ours' recorded ``node``, which failed) gives another result: ours recorded
    ``node`` at another step than what its next projection reads (Kimi Linear's and Qwen3-Next's ports hold their
    gated norm's product before its gate). A node held per head is read flat."""
    try:
        module = pair.reference.get_submodule(after) if pair.reference is not None else None
    except AttributeError:  # a node that is no module's output (an attention's scores)
        module = None
    weight = getattr(module, "weight", None)
    theirs, read = ref.tensors.get(node), ref.tensors.get(after)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or theirs is None or read is None:
        return False
    width = weight.shape[1]
    if (
        theirs.shape != mine.shape
        or theirs.numel() % width
        or theirs.numel() // width * weight.shape[0] != read.numel()
    ):
        return False
    w = weight.detach().cpu().double()
    bias = getattr(module, "bias", None)
    b = bias.detach().cpu().double() if isinstance(bias, torch.Tensor) else None

    def product(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.detach().cpu().double().reshape(-1, width), w, b).reshape(read.shape)

    expected = read.detach().cpu().double()
    scale = float(expected.abs().max()) or 1.0
    if float((product(theirs) - expected).abs().max()) > 1e-4 * scale:
        return False  # the reference's own node is not what its next projection reads
    return float((product(mine) - expected).abs().max()) > 1e-2 * scale


def computed_otherwise(results: list[NodeResult], modules: set[str]) -> list[NodeResult]:
    """A user's model whose modules of some nodes never ran while every node it produced agrees (each
    head's q-norm computed at once from the stacked weights of per-head norm modules, a module bypassed
    by an equivalent function): those nodes are computed another way, untapped, not failed. Where any
    node fails they stay missing: the module not run is then the likeliest cause. ``modules``: the nodes
    a module of ours records (what ``forward`` returns is never computed another way)."""
    missing = [
        r for r in results
        if r.status == MISSING and r.name in modules and r.detail.startswith("ours produced no tensor")
    ]  # fmt: skip
    if not missing or any(r.failed and r.status != MISSING for r in results):
        return results
    if any(r.status == MISSING and r not in missing for r in results):
        return results
    names = {r.name for r in missing}
    return [
        replace(
            r,
            status=UNTAPPED,
            detail=f"{r.detail}; every node ours produced agrees, so ours computes this one another way (not judged)",
        )
        if r.name in names
        else r
        for r in results
    ]


def settle_with_isolated(
    nodes: list[NodeResult], isolated: list[NodeResult] | None
) -> tuple[list[NodeResult], list[NodeResult] | None]:
    """The chained run's results and the isolated run's, each settled by the other: the isolated run's failures at
    the nodes the chained run's logits arbitrated untapped alike (:func:`~parity.compare.arbiter.arbitrated_like`),
    then the chained run's first failure with no hint given the isolated run's (:func:`borrow_isolated_hint`)."""
    if isolated is not None:
        isolated = arbitrated_like(isolated, nodes)
    return borrow_isolated_hint(nodes, isolated), isolated


def borrow_isolated_hint(nodes: list[NodeResult], isolated: list[NodeResult] | None) -> list[NodeResult]:
    """The chained run's first failure with no hint takes the isolated run's hint when the isolated
    run fails first at the same node: there the node's inputs are the reference's, so evidence that
    the chained run's drifted inputs blur (a norm's weight read where another norm runs) is clean."""
    bad, iso = first_mismatch(nodes), first_mismatch(isolated or [])
    if bad is None or iso is None or bad.hint is not None or iso.hint is None or bad.name != iso.name:
        return nodes
    hint = Hint(
        iso.hint.kind,
        f"{iso.hint.text} (read in the isolated run, where this node's inputs are the reference's)",
        {**iso.hint.evidence, "from": "isolated"},
    )
    out = list(nodes)
    out[bad.index] = replace(bad, hint=hint)
    return out


#: float64 copies of a node the hint detectors may hold at once
_DIAGNOSIS_COPIES = 10


def undiagnosed(bad: NodeResult) -> str | None:
    """Why the failing node ``bad`` gets no diagnosis (a note), or None: its detectors work on float64
    copies of it, and a node of GiBs (the probabilities of a 4096-token window) would not fit."""
    shape = bad.shape_ref or bad.shape_ours
    available = available_bytes()
    if not shape or available is None:
        return None
    need = math.prod(shape) * 8 * _DIAGNOSIS_COPIES
    if need <= RESOURCE_BUDGET * available:
        return None
    return (
        f"{bad.name} was not diagnosed (no hint): its detectors would need about {need / GIB:.1f} GiB and "
        f"{available / GIB:.1f} GiB are available; its metrics, error profile and logits effect stand"
    )


def undiagnosed_note(results: list[NodeResult]) -> str | None:
    bad = first_mismatch(results)
    if bad is None or bad.hint is not None or bad.status in ("missing", "shape"):
        return None
    return undiagnosed(bad)


def config_diff(pair: Pair) -> list[dict]:
    """Hyperparameters where the cfg our model runs with differs from the reference's config.

    Our side: ``pair.ours.cfg`` (the dict our model was built with, which a user may have edited);
    reference side: ``pair.source.reference_cfg``, the reference config read back through the family's
    mapping. Compared key by key, whatever the keys are. Returns ``[{"key", "ours", "reference"}]``;
    keys missing on one side are listed too.
    """
    ours = getattr(pair.ours, "cfg", None) or pair.source.cfg
    ref = pair.source.reference_cfg
    if not isinstance(ours, Mapping) or ref is None:
        return []
    diffs = []
    for key in sorted(set(ours) | set(ref)):
        a, b = ours.get(key, "<absent>"), ref.get(key, "<absent>")
        if isinstance(a, torch.dtype) or isinstance(b, torch.dtype):
            continue
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            same = list(a) == list(b)
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            same = a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))
        else:
            same = a == b
        if not same:
            diffs.append({"key": key, "ours": a, "reference": b})
    return diffs


def refuse_changed_weights(pair: Pair, when: str) -> None:
    changed = pair.changed_weights()
    if changed:
        raise ParityError(
            f"{len(changed)} weight tensor(s) changed in place {when} ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}): ours and the reference share that storage, so both changed; "
            "replace a Parameter (module.weight = nn.Parameter(...)) instead of editing it in place"
        )


def analyse(pair: Pair, nodes: list[NodeResult], ours: Trace | None, ref: Trace) -> tuple[dict | None, dict | None]:
    """Error profile of the first failing node and the logits effect at the output node."""
    if ours is None:
        return None, None
    profile = logits = None
    bad = first_mismatch(nodes)
    if bad is not None:
        ours_t, ref_t = ours.tensors.get(bad.name), ref.tensors.get(bad.name)
        if ours_t is not None and ref_t is not None and ours_t.shape == ref_t.shape:
            layer = pair.facts.layer(bad.layer)
            head_dim = layer.head_dim if layer is not None else pair.facts.head_dim
            profile = {"node": bad.name, **error_profile(ours_t, ref_t, bad.kind, head_dim)}
    output = pair.output_node
    if output is not None and output in ours.watched:  # computed while ours ran (a NodeStream)
        logits = {"node": output, **ours.watched[output]}
    elif (
        output is not None
        and output in ours.tensors
        and output in ref.tensors
        and ours.tensors[output].shape == ref.tensors[output].shape
    ):
        logits = {"node": output, **logits_effect(ours.tensors[output], ref.tensors[output])}
    return profile, logits


def run_meta(pair: Pair, run: Run, diffs: list[dict], seconds: float) -> dict:
    """The run's metadata for results and reports (``result.meta``)."""
    options = run.options
    return {
        "family": pair.source.family,
        "config": pair.source.config_name,
        "checkpoint": pair.source.checkpoint,
        "checkpoint_sha256": pair.source.checkpoint_hash,
        "dtype": str(pair.dtype).replace("torch.", ""),
        "batch_size": int(run.input_ids.shape[0]),
        "seq_len": int(run.input_ids.shape[1]),
        "padding": None if run.attention_mask is None else [int(n) for n in (run.attention_mask == 0).sum(1)],
        "seed": pair.source.seed,
        "mode": run.mode,
        "atol": options.atol,
        "rtol": options.rtol,
        "exact": run.tolerances.exact,
        "calibrated": options.calibrate,
        "safety_factor": SAFETY_FACTOR if options.calibrate else None,
        "tolerances": {pattern: list(tol) for pattern, tol in options.tolerances.items()},
        "config_diff": diffs,
        "versions": versions(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "model_type": pair.facts.model_type,
        "device": pair.source.device,
        "trace_memory": run.trace_memory,
        "ours_class": f"{type(pair.ours).__module__}.{type(pair.ours).__qualname__}",
        # the Transformers class compared against (a multimodal checkpoint: ...ForConditionalGeneration)
        "reference_class": f"{type(pair.reference).__module__}.{type(pair.reference).__qualname__}",
        "aligned": bool(pair.alignment),
        "probe": pair.source.probe
        + (
            f"; inputs: seeded random token ids, {int(run.input_ids.shape[0])} x {int(run.input_ids.shape[1])}"
            + (", left-padded, positions from the mask" if run.attention_mask is not None else "")
        ),
        "cfg": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in pair.source.cfg.items()},
    }
