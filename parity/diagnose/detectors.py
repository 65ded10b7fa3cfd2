"""The detectors in the order they are tried, most specific evidence first (an exact match with
something else), most general last (a pattern), and :func:`diagnose`, which returns the first hint."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import cast

import torch

from parity.compare.metrics import CHOICE, MISSING, NONFINITE, SHAPE
from parity.compare.results import NodeResult
from parity.diagnose.alibi import alibi_slopes, relative_bias
from parity.diagnose.attention_refit import inline_attention, unread_attention
from parity.diagnose.cache import cached_state, chunk_boundary, conv_context, state_not_carried
from parity.diagnose.differential import after_context
from parity.diagnose.elementwise import (
    activation,
    activation_function,
    clamped,
    gate_activation,
    glu_form,
    input_floored_at_zero,
    nonfinite,
    precision,
    quantised_input,
    rounding_order,
    soft_capping,
)
from parity.diagnose.embeddings import embedding_rows, position_term, positions_added_before
from parity.diagnose.evidence import Evidence, cut_offset, fmt_list, heads_first
from parity.diagnose.hints import Hint
from parity.diagnose.latent import latent_pairing, latent_rope, latent_split
from parity.diagnose.masks import (
    attention_dropout,
    chunk_phase,
    dropout_elementwise,
    future_keys,
    mask_shifted,
    masked_keys,
    padding,
    padding_mask_inverted,
    sequence_shift,
    sparse_selection,
    tokens_moved,
    window_pattern,
)
from parity.diagnose.moe import (
    choice,
    combination_scale,
    expert_rows,
    expert_tokens,
    expert_weights,
    experts_at_stream,
    experts_per_token,
    experts_read_after,
    experts_sum,
    moe_block,
    moe_output,
    routed_in_block,
    routing_weights,
    row_normalisation,
    shared_expert,
)
from parity.diagnose.norms import (
    block_layout,
    embedding_norm,
    norm_around_activation,
    norm_eps,
    norm_kind,
    norm_order,
    norm_past_projection,
    norm_placement,
    norm_skipped,
    norm_statistic,
    norm_weight_offset,
    norm_weight_source,
    weightless_norm_eps,
)
from parity.diagnose.order import (
    before_reduction,
    execution_order,
    head_on_embedding,
    iteration_count,
    loop_count,
    partial_read,
    repeated_module,
    reused_module,
    swapped_in_order,
)
from parity.diagnose.residual import (
    input_scale,
    input_source,
    input_terms,
    projection_source,
    residual_add,
    residual_around_norm,
)
from parity.diagnose.rope import (
    bias_after_rope,
    bias_scaled_apart,
    gain_across_rope,
    heads_unrotated,
    norm_after_rope,
    norm_after_rope_at_rotation,
    position_table_offset,
    qkv_clip,
    rope_fit,
    rope_partial,
    rope_pattern,
    rope_precision,
    rope_skipped,
    rope_tables,
    values_rotated,
)
from parity.diagnose.scales import (
    added_vector,
    attention_softcap,
    channel_ratio,
    constant_ratio,
    partial_head_scores,
    position_scale,
    row_offset,
    row_scale,
    scaled_before_bias,
    softmax_axis,
    softmax_sink,
    softmax_temperature,
)
from parity.diagnose.short_conv import short_conv
from parity.diagnose.swaps import swapped_modules, swapped_weights, used_as
from parity.diagnose.token_shift import token_shift
from parity.diagnose.wiring import (
    activation_skipped,
    attention_rows_moved,
    concatenated_parts,
    fused_split,
    gate_up_roles,
    head_mapping,
    head_reads_table,
    heads_merged_unmoved,
    heads_split_unmoved,
    input_slice,
    input_slots_strided,
    kv_sharing,
    last_dim_permutation,
    other_layer,
    projection_input,
    rotated_other_projection,
    sibling_match,
    tap_layout,
    transposed_weight,
    untied_head,
    values_source,
)
from parity.model.facts import ArchFacts
from parity.model.pair import NodeSpec
from parity.record.hooks import UNRESOLVED
from parity.record.trace import Trace

#: a detector that raises is skipped (a hint is evidence, never a reason to fail the check) unless this
#: environment variable is "1" (the test suite sets it: a detector's crash there is a bug to fix)
STRICT = "PARITY_STRICT_DETECTORS"

#: ours-side node paths that are no module (a tap call, a value read from a function, nothing aligned)
UNHOOKED_PREFIXES = ("tap:", "param:", "unaligned:")

#: the q/k norms a family applies after RoPE (HunYuan's query_layernorm, key_layernorm) -> the rotated node they read
_NORMS_AFTER_ROPE = {"query_layernorm": "q_rot", "key_layernorm": "k_rot"}
#: the RoPE detectors, read at such a norm's input
_ROPE_DETECTORS = (rope_partial, rope_fit, latent_pairing, rope_tables, rope_pattern, heads_unrotated, head_mapping)


def rope_before_norm(e: Evidence) -> Hint | None:
    """A q/k norm the reference applies after RoPE (HunYuan's ``query_layernorm``) whose inputs differ:
    ours normalising before RoPE (its input is the projection's output, unrotated), or RoPE itself
    differing, read by the RoPE detectors on the two inputs as ``q_rot``/``k_rot`` (the first node that
    differs is the norm: no ``q_rot`` node comes before it). Ours-side placement; RoPE either side."""
    rot = _NORMS_AFTER_ROPE.get(e.kind)
    layer = e.facts.layer(e.result.layer)
    if rot is None or e.positions is None or layer is None:
        return None
    x_ours, x_ref = e.inputs()
    proj = e.ref_trace.tensors.get(f"{e.name.rsplit('.', 1)[0]}.{rot[0]}_proj")
    if x_ours is None or x_ref is None or proj is None:
        return None
    heads = e.facts.num_heads if rot == "q_rot" else (e.facts.num_kv_heads or e.facts.num_heads)
    seq = e.positions.shape[1]
    ours, ref, q = (heads_first(t, heads, layer.head_dim, seq) for t in (x_ours, x_ref, proj))
    if ours is None or ref is None or q is None or ours.shape != ref.shape or e.close(ref, q) or e.close(ours, ref):
        return None
    if e.close(ours, q):
        return Hint(
            "norm_placement",
            f"likely norm placement: ours' {e.kind} reads {rot[0]} before RoPE (its input is {rot[0]}_proj's output, "
            "unrotated), the reference normalises after RoPE",
            {"ours_reads": "before RoPE"},
        )
    at = replace(e, ours=ours, ref=ref, result=replace(e.result, kind=rot))
    for detect in _ROPE_DETECTORS:
        hint = detect(at)
        if hint is not None:
            return Hint(hint.kind, f"{hint.text} (read at {e.kind}'s input: RoPE runs before this norm)", hint.evidence)
    return None


#: detectors tried in order on a node that has both tensors of one shape
DETECTORS: tuple[Callable[[Evidence], Hint | None], ...] = (
    tap_layout,
    partial_read,
    execution_order,
    swapped_in_order,
    loop_count,
    iteration_count,  # a node in a loop both sides run, ours another number of times: no value fit is evidence
    embedding_rows,
    position_term,
    positions_added_before,
    position_table_offset,  # a position table read at p + k: before detectors that read a lookup's input
    kv_sharing,
    moe_output,  # before residual_add: a MoE block ours computes in functions, read after it
    experts_at_stream,  # the same where ours' router is a node and its experts are untapped
    residual_add,  # before sibling_match: a stream point equal to the branch's output is a missing residual
    short_conv,  # before sibling_match: a gated short conv's out_proj reads a product nothing else holds
    activation_skipped,  # before sibling_match: equal to the node before the activation is no swap
    sibling_match,
    latent_split,  # before swapped_weights: MLA's k_nope cut from kv_b_proj's heads otherwise
    input_slice,  # a module reading another cut of a fused output
    input_slots_strided,
    concatenated_parts,  # a linear over a concatenation of traced nodes: its parts joined otherwise, or left out
    fused_split,  # before swapped_weights and the rotation fits: q/k cut from a fused output otherwise
    swapped_weights,
    gate_up_roles,
    used_as,
    values_source,
    rotated_other_projection,
    token_shift,  # before projection_input: a projection's input mixed with its neighbour token otherwise
    projection_input,
    other_layer,
    head_reads_table,  # before untied_head: the table the head reads named
    untied_head,
    transposed_weight,
    heads_merged_unmoved,
    heads_split_unmoved,
    expert_tokens,
    expert_weights,
    experts_sum,
    moe_block,  # a block whose experts nothing taps, matched against the reference's experts and shared MLP
    experts_read_after,  # the experts' sum nothing taps, read at the input of the node after it (a post-norm)
    routed_in_block,  # before shared_expert: a block whose routed experts ours computes in functions
    shared_expert,
    combination_scale,  # after shared_expert: a shared expert's gate is another form, no coefficient
    quantised_input,  # before precision: a few integer levels, not a narrower float
    input_floored_at_zero,
    precision,
    rounding_order,
    padding,
    cached_state,
    conv_context,
    state_not_carried,
    qkv_clip,  # before the generic clamp and the RoPE fits: a clip of q, k or v around RoPE
    clamped,
    glu_form,  # before activation_function: a gated MLP's product read whole (act(gate) * up), each side's act
    activation_function,
    gate_activation,
    soft_capping,
    embedding_norm,  # before input_scale: a weight-free norm of the embeddings, eps-sized at layer 0
    input_scale,  # before the norms: a norm fed a scaled input differs only through its eps
    input_terms,
    residual_around_norm,  # after input_terms: a norm's input in place of its output is no reweighted term
    input_source,
    projection_source,
    rope_before_norm,  # a q/k norm after RoPE (HunYuan): RoPE read at its input, before the norm fits
    rope_precision,  # a cos/sin table rounded to bfloat16: before the fits, which read one amplitude per rotation
    norm_after_rope,
    norm_statistic,  # the module's own weight: exact, before the eps fit reads a per-token ratio
    norm_eps,
    norm_skipped,
    norm_weight_source,
    norm_weight_offset,
    norm_kind,
    block_layout,
    norm_order,
    norm_past_projection,
    norm_around_activation,
    weightless_norm_eps,  # before norm_placement: a norm nothing records, its eps read at the projection
    norm_placement,
    position_scale,  # before the RoPE fits: a factor per position on q is no rotation
    norm_after_rope_at_rotation,  # before rope_partial: a norm after RoPE changes every dim
    rope_partial,
    bias_after_rope,
    bias_scaled_apart,
    scaled_before_bias,
    gain_across_rope,  # before rope_fit: position 0 agrees, as for another frequency
    rope_fit,  # before constant_ratio: on q_rot/k_rot a constant factor is the cos/sin scale, read with its source
    values_rotated,
    attention_dropout,  # before constant_ratio: the kept probabilities are all scaled by one 1 / (1 - p)
    dropout_elementwise,
    constant_ratio,
    routing_weights,
    row_normalisation,
    last_dim_permutation,
    heads_unrotated,  # before head_mapping: heads left unrotated are no permutation
    head_mapping,
    attention_rows_moved,
    sequence_shift,
    tokens_moved,
    alibi_slopes,  # before the temperature: a bias per key distance, not a scale of the scores
    softmax_temperature,
    unread_attention,  # an attention parity read none of in ours, judged at its output projection
    inline_attention,  # the same where the reference's attention is inline (no internals): recomputed from q, k, v
    attention_softcap,
    partial_head_scores,
    softmax_sink,
    softmax_axis,
    padding_mask_inverted,
    mask_shifted,
    chunk_phase,
    masked_keys,
    sparse_selection,  # before future_keys and window_pattern: a mask with holes is no window
    future_keys,
    window_pattern,
    chunk_boundary,
    relative_bias,  # after the masks: a key one side hides is theirs, a bias by distance only then
    latent_pairing,  # before rope_pattern: MLA's rotated tail read apart from the pass-through dims
    latent_rope,
    rope_tables,  # before rope_pattern: a pairing and table mixed up is named, not only seen
    rope_pattern,
    rope_skipped,  # after rope_pattern: q unrotated times a factor per position (a NoPE layer's temperature)
    channel_ratio,
    added_vector,
    row_offset,
    repeated_module,  # late: a module called twice is often the mechanism of a fault named above
    row_scale,
    activation,
    after_context,  # late: the context agrees, o_proj's input does not (differential attention, else the stretch)
)


def _missing(result: NodeResult, ours: Trace, ref: Trace, spec: NodeSpec | None, facts: ArchFacts) -> Hint:
    """Which side never produced the node, and whether it has no such module or never ran it."""
    if result.name not in ref.tensors:
        path = spec.reference_path if spec is not None else result.name
        return Hint(
            "missing",
            f"the reference never ran {path} in this forward, ours did: a module the reference skips for this "
            "config (or one removed from it); the nodes after it compare what each side computed without it",
            {"side": "the reference", "path": path},
        )
    path = spec.ours if spec is not None else result.name
    if result.name in cast("set[str]", ours.extras.get(UNRESOLVED, set())):
        return Hint(
            "missing",
            f"ours has no module at {path}: a node-map or tap problem ({result.detail})",
            {"side": "ours", "path": path, "module": False},
        )
    if path.startswith(UNHOOKED_PREFIXES):
        return Hint("missing", f"likely a tap problem: {result.detail}", {"side": "ours", "path": path})
    module, at, argument = path.partition("@")
    if at and argument != "input":
        return Hint(
            "missing",
            f"ours never gives {module} its {argument!r} input: the reference passes this layer an input ours does "
            f"not compute or does not pass (e.g. Gemma 4's per-layer inputs), or {module} never ran",
            {"side": "ours", "path": path, "argument": argument},
        )
    reused = reused_module(result.name, ours, ref, facts) or head_on_embedding(result.name, ours, ref, facts)
    if reused is not None:
        return reused
    return Hint(
        "missing",
        f"ours never ran {path} in this forward (the module exists): a module skipped or called around "
        "(its parameters unused), or reached through another path",
        {"side": "ours", "path": path, "module": True},
    )


def _fewer_positions(result: NodeResult) -> Hint | None:
    """Ours' node has the reference's shape but fewer tokens along the sequence axis: ours computed it
    over chunks of the tokens (the first chunk recorded), or dropped positions."""
    a, b = result.shape_ours, result.shape_ref
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return None
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if differ != [1] or a[1] >= b[1]:
        return None
    return Hint(
        "shape",
        f"likely the tokens computed in chunks: ours' {result.kind} holds {a[1]} of the reference's {b[1]} positions "
        "(a loop over token chunks whose first call is the one recorded, or a range that drops the tail)",
        {"positions_ours": a[1], "positions_reference": b[1]},
    )


def _one_of_many(result: NodeResult, ref_trace: Trace) -> Hint | None:
    """A module of a list (``q_layernorm.norms.0``: one per head) whose output in ours holds all its
    siblings' share along one axis: ours applies that one module to every head (or every part) at
    once, the reference each module to its own."""
    stem, _, index = result.name.rpartition(".")
    a, b = result.shape_ours, result.shape_ref
    if not index.isdigit() or not a or not b or len(a) != len(b):
        return None
    siblings = sum(1 for n in ref_trace.tensors if n.rpartition(".")[0] == stem and n.rpartition(".")[2].isdigit())
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if siblings < 2 or len(differ) != 1 or a[differ[0]] != siblings * b[differ[0]]:
        return None
    return Hint(
        "shape",
        f"likely one module used for all {siblings}: ours applies {result.name} to all {siblings} parts along axis "
        f"{differ[0]} at once (its output {a}), the reference {stem}.0..{siblings - 1} each to its own part ({b}): "
        "a per-head module shared across heads",
        {"siblings": siblings, "axis": differ[0]},
    )


def _chosen_otherwise(result: NodeResult, ours_trace: Trace, ref_trace: Trace) -> Hint | None:
    """One of several parallel modules (``adapter_modules.en_XX``, ``experts.3``: siblings under one parent) run on
    rows by one side and on none by the other (its output's first axis 0): the two sides chose different ones (which
    chose right, the traces cannot say). Names the sibling the other side ran where this one did not (X-MOD's adapter
    of ``config.default_language`` where no ``lang_ids`` are given)."""
    a, b = result.shape_ours, result.shape_ref
    if not a or not b or len(a) != len(b) or a[1:] != b[1:] or (a[0] == 0) == (b[0] == 0):
        return None
    parts = result.name.split(".")
    # the siblings: the same path with one component (the choice) otherwise, run with rows on the other side
    for i in range(len(parts) - (1 if parts[-1].isdigit() else 2), 0, -1):  # (a leaf's siblings: other kinds)
        stem, tail = ".".join(parts[:i]) + ".", "." + ".".join(parts[i + 1 :]) if i + 1 < len(parts) else ""
        siblings = [
            n for n in {*ours_trace.tensors, *ref_trace.tensors}
            if n != result.name and n.startswith(stem) and n.endswith(tail) and "." not in n[len(stem) : len(n) - len(tail)]
        ]  # fmt: skip
        if siblings:
            break
    else:
        return None

    def rows(trace: Trace, name: str) -> int:
        t = trace.tensors.get(name)
        return 0 if t is None or t.dim() == 0 else t.shape[0]

    runner, other = ("ours", "the reference") if a[0] else ("the reference", "ours")
    mine, theirs = (ours_trace, ref_trace) if a[0] else (ref_trace, ours_trace)
    instead = sorted(n for n in siblings if rows(theirs, n) and not rows(mine, n))
    said = f"; {other} runs {fmt_list(instead)} there, which {runner} runs on no row" if instead else ""
    # (which side chose right the two traces cannot say: each runs one the other does not)
    return Hint(
        "routing",
        f"likely another of the parallel modules chosen on one side: {runner} runs {result.name} on "
        f"{max(a[0], b[0])} rows where {other} runs it on none{said} (a per-language adapter chosen otherwise, "
        "X-MOD's lang_ids or config.default_language, or an expert or branch selected by another rule)",
        {"runs": runner, "instead": instead},
    )


def _head_cut(result: NodeResult, ours_trace: Trace, ref_trace: Trace, facts: ArchFacts) -> Hint | None:
    """Ours' product ``(batch, heads, seq, w)`` over part of a projection whose reference output holds ``per``
    features per head (``(batch, [1,] seq, heads * per)``, per > w): ours reads columns ``[o:o + w]`` of each
    head. Named with MLA's parts where the projection is kv_b_proj (per head ``[k_nope | v]``): a per-head stack
    cut at another place (Youtu's ``[v | k]`` read from the wrong end)."""
    ours, ref = ours_trace.tensors.get(result.name), ref_trace.tensors.get(result.name)
    if ours is None or ref is None or ours.dim() != 4 or ref.shape[-1] % max(ours.shape[1], 1):
        return None
    b, heads, seq, w = ours.shape
    per = ref.shape[-1] // heads
    if ref.numel() != b * seq * heads * per or per <= w:
        return None
    by_head = ref.double().reshape(b, seq, heads, per).transpose(1, 2)
    tol = 1e-5 * max(float(by_head.abs().max()), 1e-30)
    offset = cut_offset(ours.double(), by_head, lambda a, b: torch.allclose(a, b, atol=tol))
    if offset is None:
        return None
    layer = facts.layer(result.layer)
    rotary = layer.rope.rotary_dim if layer is not None and layer.rope is not None else 0
    parts = ""
    if result.name.endswith("kv_b_proj") and layer is not None and 0 < rotary < layer.head_dim:
        nope = layer.head_dim - rotary
        parts = f" ({nope} k_nope then {per - nope} v: k_nope is [0:{nope}], v [{nope}:{per}])"
    return Hint(
        "qkv_layout",
        f"likely a per-head cut of {result.name}'s output at another place: ours' product (its shape {tuple(ours.shape)}) "
        f"is columns [{offset}:{offset + w}] of each head's {per}{parts} (a per-head stack of its parts read from "
        "the wrong end, or at the wrong width)",
        {"offset": offset, "width": w, "per_head": per},
    )


def _head_split(result: NodeResult, facts: ArchFacts) -> Hint | None:
    """An attention tensor of ``(batch, heads, seq, head_dim)`` cut into another number of heads of
    another width, the same total: head_dim taken as ``hidden_size / num_heads`` where the config sets
    its own (Gemma's 256 with a hidden size of 2048 and 8 heads), or the reverse."""
    a, b = result.shape_ours, result.shape_ref
    if result.kind not in ("q_rot", "k_rot") or not a or not b or len(a) != 4 or len(b) != 4:
        return None
    if a[0] != b[0] or a[2] != b[2] or a[1] * a[3] != b[1] * b[3] or a[3] == b[3]:
        return None
    per_head = facts.hidden_size // facts.num_heads if facts.hidden_size and facts.num_heads else None
    source = f" (= hidden_size / num_heads = {facts.hidden_size} / {facts.num_heads})" if per_head == a[3] else ""
    return Hint(
        "head_dim",
        f"likely another head_dim: ours cuts {result.kind[0]} into {a[1]} heads of {a[3]}{source}, the reference into "
        f"{b[1]} heads of {b[3]} (the config's head_dim); the projection's width is the same, its heads are not",
        {"ours": [a[1], a[3]], "reference": [b[1], b[3]]},
    )


def _padded_heads(result: NodeResult, ours: Trace, ref: Trace, facts: ArchFacts) -> Hint | None:
    """Ours' attention context wider per head than the reference's, each head holding the reference's
    values at one end and zeros at the other: values zero-padded to another head dim (q/k's, for a kernel
    that wants one head size; DeepSeek's v_head_dim < qk_head_dim), which ours must slice back from that end."""
    a, b = ours.tensors.get(result.name), ref.tensors.get(result.name)
    heads = facts.num_heads
    if result.kind != "context" or a is None or b is None or not heads or a.dim() != b.dim() or a.dim() < 2:
        return None
    if a.shape[:-1] != b.shape[:-1] or a.shape[-1] % heads or b.shape[-1] % heads or a.shape[-1] <= b.shape[-1]:
        return None
    wide, d = a.shape[-1] // heads, b.shape[-1] // heads
    ah, bh = a.double().unflatten(-1, (heads, wide)), b.double().unflatten(-1, (heads, d))
    atol = max(result.atol, 1e-6 * float(bh.abs().max()))
    ends = {"first": (ah[..., :d], ah[..., d:]), "last": (ah[..., wide - d :], ah[..., : wide - d])}
    end = next(
        (k for k, (held, pad) in ends.items() if torch.allclose(held, bh, atol=atol) and not bool(pad.any())), None
    )
    if end is None:
        return None
    text = (
        f"ours' context holds {wide} values per head where the reference's holds {d}: per head, ours' {end} {d} are "
        f"the reference's and the other {wide - d} are zeros (the values zero-padded to another head dim, "
        f"q/k's {wide}, for a kernel)"
    )
    text += f"; each head's {end} {d} are what its output projection must read back"
    return Hint("shape", f"likely {text}", {"padded_to": wide, "head_dim": d, "values_at": end})


def diagnose(
    result: NodeResult,
    ours_trace: Trace,
    ref_trace: Trace,
    facts: ArchFacts,
    positions: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    spec: NodeSpec | None = None,
) -> Hint | None:
    """A likely cause for a failing node, with its evidence; None if no pattern is recognised.
    ``positions``: ``(batch, seq)`` token positions of the run and ``attention_mask`` its padding
    (RoPE hints need them); ``spec``: the node's NodeSpec (which scores a choice was made from)."""
    if result.status == MISSING:
        return _missing(result, ours_trace, ref_trace, spec, facts)
    if result.status == SHAPE:
        swapped = swapped_modules(result.name, ours_trace, ref_trace)
        return (
            swapped
            or before_reduction(result, ours_trace, ref_trace)
            or experts_per_token(result, facts)  # before the positions: a router's k is its last axis
            or expert_rows(result, ref_trace, facts)  # an expert's node over other tokens: routing or placement
            or _fewer_positions(result)
            or _one_of_many(result, ref_trace)
            or _chosen_otherwise(result, ours_trace, ref_trace)
            or _head_split(result, facts)
            or _padded_heads(result, ours_trace, ref_trace, facts)
            or _head_cut(result, ours_trace, ref_trace, facts)
            or Hint("shape", f"likely a layout or head-count difference: {result.detail}")
        )
    ours, ref = ours_trace.tensors.get(result.name), ref_trace.tensors.get(result.name)
    if ours is None or ref is None:  # a node compared as it ran and not kept: its metrics stand, no hint
        return (
            Hint("nonfinite", f"non-finite values appear first here: {result.detail}")
            if result.status == NONFINITE
            else None
        )
    permuted = spec is not None and getattr(spec.transform, "dims", None) is not None
    if positions is not None and result.kind in ("q_rot", "k_rot") and ref.dim() == 4:
        b, seq = ref.shape[0], ref.shape[-2]
        if positions.dim() == 2 and positions.shape[-1] != seq:
            # a stack over another sequence than the input's (BLT's global transformer over its patches): it numbers
            # its own positions from 0; the run's padding says nothing of its rows
            positions, attention_mask = torch.arange(seq).expand(b, seq), None
    e = Evidence(result, ours, ref, ours_trace, ref_trace, facts, positions, attention_mask, permuted)
    if result.status == NONFINITE:
        return nonfinite(e)
    if result.status == CHOICE:
        return choice(e, spec)
    if e.ours.shape != e.ref.shape or not e.ref.is_floating_point():
        return None
    for detect in DETECTORS:
        try:
            hint = detect(e)
        except Exception:  # a detector meeting a model it was not written for: no hint from it, not a failed check
            if os.environ.get(STRICT) == "1":
                raise
            continue
        if hint is not None:
            return hint
    return None
