"""Detectors of wiring: ours equals another tensor of the reference (a sibling projection, another
layer, another head, a transposed weight, the unloaded head, a tap declared in another layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from parity.diagnose.elementwise import activations, function_of
from parity.diagnose.evidence import (
    EXPLAINS,
    Evidence,
    attention_values,
    cut_offset,
    fmt_list,
    fused_layouts,
    fused_output,
    heads_first,
    layer_values,
    pair_lengths,
    part_of,
    reads_stream,
    rel,
    whose,
)
from parity.diagnose.hints import Hint
from parity.diagnose.profile import HEAD_MAJOR, HEAD_MERGED, SEQ_HEADS
from parity.diagnose.rope import pre_rope, qk_norm_function
from parity.diagnose.rope_fit import rotate
from parity.model.facts_rules import ROTATED_LAST
from parity.record.hf_capture import OUTPUT_PROJECTIONS

if TYPE_CHECKING:
    from parity.model.facts import LayerFacts


def activation_skipped(e: Evidence) -> Hint | None:
    """One side's value is another node of its layer as it is, the other side's that node through an
    activation: the activation skipped on the first side (GPT-2's c_proj reading c_fc's output without
    the GELU), named with the activation and the side."""

    prefix = e.name.rsplit(".", 1)[0]
    for name, tensor in e.ref_trace.tensors.items():
        if name == e.name or not name.startswith(prefix) or tensor.shape != e.ours.shape:
            continue
        if e.result.layer is not None and e.facts.locate(name)[0] != e.result.layer:
            continue
        ours_plain, ref_plain = e.close(e.ours, tensor), e.close(e.ref, tensor)
        if ours_plain == ref_plain:
            continue
        applied = e.ref if ours_plain else e.ours
        label = next((label for label, act in activations().items() if e.close(applied, act(tensor))), None)
        if label is None:
            continue
        side = "ours" if ours_plain else "the reference"
        return Hint(
            "activation",
            f"likely the activation: {whose(side)} {e.kind} is the reference's {name} as it is, the other side's that through "
            f"{label}: the activation is skipped in {side} here (or applied elsewhere)",
            {"matches": name, "activation": label, "side": side},
        )
    return None


def sibling_match(e: Evidence) -> Hint | None:
    """Ours reproduces another reference node of the same layer (gate vs up, k vs v); for a branch's
    input, another point of the residual stream (the branch reads the stream at the wrong place)."""
    prefix = e.name.rsplit(".", 1)[0]
    for name, tensor in e.ref_trace.tensors.items():
        if name == e.name or not name.startswith(prefix) or tensor.shape != e.ours.shape:
            continue
        layer, kind = e.facts.locate(name)
        if e.result.layer is not None and layer != e.result.layer:
            continue  # another layer's node: see other_layer
        if not e.close(e.ours, tensor):
            continue
        if e.kind in ("q_rot", "k_rot") and kind[:2] == e.kind[:2]:
            continue  # q_rot equal to q_proj or q_norm: RoPE not applied (the rope detectors' case), no swap
        if {e.kind, kind} == {"q_l2norm", "k_l2norm"}:
            return Hint(
                "swapped_roles",
                f"likely the channel layout of the linear attention's conv output: ours' {e.kind} is the reference's "
                f"{name} (its channels split as k | q | v instead of q | k | v, or in_proj_qkv's rows in another order)",
                {"matches": name, "swapped": [e.kind, kind]},
            )
        roles = {"q_rot": "k_rot", "k_rot": "q_rot", "q_proj": "k_proj", "k_proj": "q_proj"}
        if roles.get(e.kind) == kind and e.kind.endswith("_rot"):
            mine, theirs = ("query", "key") if e.kind == "q_rot" else ("key", "query")
            return Hint(
                "swapped_roles",
                f"likely swapped roles: ours' {e.kind} is the reference's {name}: each projection agrees with the "
                f"reference's, but ours uses as the {mine} what the reference uses as the {theirs} (q_proj and k_proj "
                "swapped where they are used, or their weights loaded into each other's module)",
                {"matches": name, "swapped": [e.kind, kind]},
            )
        if reads_stream(e.kind) and reads_stream(kind):
            return Hint(
                "block_layout",
                f"likely the block layout: the {e.kind} of ours is the reference's {name}, another point of the "
                "residual stream (this branch reads the stream before or after the wrong sub-layer)",
                {"matches": name},
            )
        return Hint(
            "swapped_weights",
            f"likely swapped or misassigned weights: ours matches the reference's {name} instead",
            {"matches": name},
        )
    return None


def _same_kind_elsewhere(e: Evidence) -> list[tuple[int, str, torch.Tensor]]:
    """``(layer, name, tensor)`` of the reference's nodes of this node's kind in every other layer."""
    out = []
    for name, tensor in e.ref_trace.tensors.items():
        layer, kind = e.facts.locate(name)
        if kind == e.kind and layer is not None and layer != e.result.layer and tensor.shape == e.ours.shape:
            out.append((layer, name, tensor))
    return out


def kv_sharing(e: Evidence) -> Hint | None:
    """The keys of a layer that reads another layer's keys and values (cross-layer KV sharing): ours
    are some other layer's, or computed here."""
    layer = e.facts.layer(e.result.layer)
    if e.kind != "k_rot" or layer is None or layer.kv_source is None:
        return None
    own = [
        (i, name, t) for i, name, t in _same_kind_elsewhere(e) if cast("LayerFacts", e.facts.layer(i)).kv_source is None
    ]
    match = next(((i, name) for i, name, t in own if i != layer.kv_source and e.close(e.ours, t)), None)
    source = f"layer {layer.index} reads the keys and values of layer {layer.kv_source} in the reference (KV sharing)"
    if match is not None:
        return Hint(
            "kv_sharing",
            f"likely the wrong layer's keys: {source}; ours are layer {match[0]}'s ({match[1]})",
            {"reference_source": layer.kv_source, "ours_source": match[0]},
        )
    return Hint(
        "kv_sharing",
        f"likely KV sharing not applied: {source}; ours equal no layer's keys (computed here, "
        "e.g. by projecting this layer's own input)",
        {"reference_source": layer.kv_source, "ours_source": None},
    )


def other_layer(e: Evidence) -> Hint | None:
    """Ours equals the reference's node of the same kind in another layer (a per-layer input, weight
    or cache slot taken from the wrong layer)."""
    for layer, name, tensor in _same_kind_elsewhere(e):
        if e.close(e.ours, tensor):
            return Hint(
                "layer_offset",
                f"likely a per-layer tensor from the wrong layer: ours equals the reference's "
                f"{name} (layer {layer}, not {e.result.layer})",
                {"matches": name, "layer": layer},
            )
    return None


def transposed_weight(e: Evidence) -> Hint | None:
    """A linear node whose output equals the reference's input times the transposed weight.

    The reference's weight may be stored ``(out, in)`` (``nn.Linear``: ``x W^T``) or ``(in, out)``
    (Transformers' ``Conv1D``, GPT-2: ``x W``); of the two products, the one that reproduces the
    reference's own output is its layout, and ours matching the other is a transposed load."""
    x = e.ref_trace.inputs.get(e.name)
    weight = e.ref_trace.weights.get(e.name)
    if x is None or weight is None or weight.dim() != 2:
        return None
    xs = e.ours_trace.inputs.get(e.name)
    if xs is None or not e.close(xs, x):
        return None  # the input already differs: not this node's own fault
    bias = e.ref_trace.biases.get(e.name)
    if weight.shape[0] != weight.shape[1]:
        # a non-square weight cannot be used transposed, but it can be reshaped to the other shape
        # instead of transposed (``W.view(in, out)`` for ``W.T``): the same numbers in the wrong places
        w = weight.double().reshape(weight.shape[1], weight.shape[0])
        if not x.is_floating_point():
            return None
        products = [x.double() @ m for m in (w, w.T) if x.shape[-1] == m.shape[0]]
        for y in products:
            if y.shape == e.ours.shape and rel(e.ours, y + (bias.double() if bias is not None else 0.0)) < EXPLAINS:
                return Hint(
                    "transposed_weight",
                    f"likely a weight reshaped instead of transposed: ours equals the reference's input times its "
                    f"{e.kind} weight {tuple(weight.shape)} viewed as {tuple(w.shape)} (reshape/view, not .T)",
                    {"reshaped": True},
                )
        return None
    products = [
        torch.nn.functional.linear(x.double(), w) + (bias.double() if bias is not None else 0.0)
        for w in (weight.double().T, weight.double())
    ]
    if not any(rel(e.ref, y) < EXPLAINS for y in products):
        return None  # neither layout gives the reference's own output: the reference computes more (a fault of its)
    for y in products:
        if rel(e.ref, y) < EXPLAINS:
            continue  # the reference's own layout
        if rel(e.ours, y) < EXPLAINS:
            return Hint(
                "transposed_weight",
                f"likely a transposed weight: ours equals the reference's input times the transposed {e.kind} "
                f"weight (a Conv1D-style or transposed load; residual {rel(e.ours, y):.1e})",
                {"residual": rel(e.ours, y)},
            )
    return None


def tap_layout(e: Evidence) -> Hint | None:
    """Ours is the reference with the heads and positions axes swapped: a tap whose sequence length
    equals its head count, read in the other layout (the shape cannot tell them apart)."""
    if e.kind not in ("q_rot", "k_rot", "context") or e.ours is None or e.ours.shape != e.ref.shape:
        return None
    ours = e.ours
    if e.kind == "context" and ours.dim() == 3:
        layer = e.facts.layer(e.result.layer)
        head_dim = layer.head_dim if layer is not None else e.facts.head_dim
        if not head_dim or ours.shape[-1] % head_dim or ours.shape[-1] // head_dim != ours.shape[1]:
            return None
        swapped = ours.unflatten(-1, (-1, head_dim)).transpose(1, 2).flatten(-2)
    elif ours.dim() == 4 and ours.shape[1] == ours.shape[2] > 1:
        swapped = ours.transpose(1, 2)
    else:
        return None
    if not e.close(swapped, e.ref):
        return None
    return Hint(
        "tap_layout",
        f"ours equals the reference with heads and positions swapped: with seq_len = {ours.shape[1]} heads the "
        f"shape cannot tell (batch, seq, heads, head_dim) from (batch, heads, seq, head_dim); declare it, "
        f"parity.tap(tensor, {e.kind!r}, layout='bshd') or layout='bhsd', or check at another seq_len",
        {"seq_len": int(ours.shape[1])},
    )


def _heads(t: torch.Tensor, kind: str, head_dim: int | None) -> torch.Tensor | None:
    """(heads, rest...) view of an attention node, or None."""
    if kind in HEAD_MAJOR and t.dim() == 4:
        return t.transpose(0, 1)
    if kind in SEQ_HEADS and t.dim() == 4:
        return t.movedim(2, 0)
    if kind in HEAD_MERGED and head_dim and t.dim() == 3 and t.shape[-1] % head_dim == 0 and t.shape[-1] > head_dim:
        return t.unflatten(-1, (-1, head_dim)).movedim(-2, 0)
    return None


def input_slots_strided(e: Evidence) -> Hint | None:
    """A node whose input ``(batch, rows * k, d)`` is a wider tensor ``(batch, rows, k * d)`` cut into ``k`` slots
    per row, ours cutting them with a stride (slot ``j`` = features ``j::k``: ``view(rows, d, k).transpose``) where
    the reference cuts contiguous chunks (slot ``j`` = features ``j*d .. (j+1)*d``: BLT's patch projection reshaped
    into ``cross_attn_k`` slots), or the reverse. Read from the two inputs alone."""
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.shape != x_ref.shape or x_ref.dim() != 3 or e.close(x_ours, x_ref):
        return None
    b, n, d = x_ref.shape
    for k in (2, 3, 4, 8):
        if n % k or n // k < 1:
            continue
        for side, value in (("ours", x_ours), ("the reference", x_ref)):
            other = x_ref if side == "ours" else x_ours
            cut = other.reshape(b, n // k, k * d).reshape(b, n // k, d, k).transpose(-1, -2).reshape(b, n, d)
            if e.close(value, cut.to(value.dtype)) and not e.close(value, other):
                return Hint(
                    "qkv_layout",
                    f"likely {e.name}'s input cut into {k} slots per row with a stride in {side}: each row of {k * d} "
                    f"features split as view(rows, {d}, {k}).transpose (slot j = features j::{k}) where the other side "
                    f"takes contiguous chunks (slot j = features j*{d}..(j+1)*{d}: view(rows * {k}, {d}))",
                    {"side": side, "slots": k},
                )
    return None


def input_slice(e: Evidence) -> Hint | None:
    """A module whose input is a cut of a wider reference node's output (a fused projection's last axis) at
    another place on each side: ours reads columns ``[a:a + w]``, the reference ``[b:b + w]`` (MLA's
    ``kv_a_proj_with_mqa`` output split as ``[k_rope | latent]`` where it is ``[latent | k_rope]``). The wider
    node is one of the layer's before it; either side."""
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.shape != x_ref.shape or e.close(x_ours, x_ref):
        return None
    heads = e.facts.num_heads if e.kind.startswith("q") else e.facts.num_kv_heads if e.kind.startswith("k") else None
    if x_ref.dim() == 4:  # per head: the heads' features side by side, (batch, seq, heads * head_dim)
        if heads and x_ref.shape[1] == heads and x_ref.shape[2] != heads:  # (batch, heads, seq, head_dim)
            x_ours, x_ref = x_ours.transpose(1, 2), x_ref.transpose(1, 2)
        x_ours, x_ref = x_ours.flatten(-2), x_ref.flatten(-2)
    w = x_ref.shape[-1]
    a, b = x_ours.double().flatten(0, -2), x_ref.double().flatten(0, -2)
    for name, t in layer_values(e, before=True):
        if "@input" in name or t.shape[-1] <= w or t.numel() // t.shape[-1] != a.shape[0]:
            continue
        wide = t.double().reshape(a.shape[0], -1)
        ours, ref = _cut_of(a, wide, heads, e.close), _cut_of(b, wide, heads, e.close)
        if ours is not None and ref is not None and ours != ref:
            said = (f"its columns {ours[1]}" if isinstance(ours[0], int) else ours[1], ref[1])
            return Hint(
                "qkv_layout",
                f"likely {name}'s output split at another place: ours' {e.kind} reads {said[0]}, the reference's "
                f"{said[1]} of {wide.shape[-1]} (the parts of a fused output taken in another order or at another "
                "width: a query and its gate fused per head read as two blocks, or the reverse)",
                {"source": name, "ours": ours[2], "reference": ref[2]},
            )
    return None


def _cut_of(part: torch.Tensor, wide: torch.Tensor, heads: int | None, same) -> tuple | None:
    """Where ``part`` (``(rows, w)``) was cut from ``wide`` (``(rows, W)``), as ``(offset, words, evidence)``:
    columns ``[a:a + w]`` (offset ``a``), or, with ``heads`` dividing both widths, each head's ``[o:o + d]`` of its
    own ``D`` (offset None: a per-head fused layout, Qwen3-Next's ``q_proj`` holding ``[q_h | gate_h]``); None when
    neither."""
    w = part.shape[-1]
    at = cut_offset(part, wide, same)
    if at is not None:
        return at, f"[{at}:{at + w}]", [at, at + w]
    if not heads or w % heads or wide.shape[-1] % heads:
        return None
    d, per_head = w // heads, wide.unflatten(-1, (heads, -1))
    at = next(
        (o for o in range(0, per_head.shape[-1] - d + 1, d) if same(part, per_head[..., o : o + d].flatten(-2))), None
    )
    if at is None:
        return None
    return None, f"each head's [{at}:{at + d}] of its {per_head.shape[-1]}", {"per_head": [at, at + d]}


def fused_split(e: Evidence) -> Hint | None:
    """q (or k) after RoPE is, on one side, a head of the fused q/k/v output cut in another layout than
    the reference's own q/k/v projections give: a fused ``query_key_value`` split per head where the
    checkpoint stacks ``[q; k; v]`` (or the reverse), or the three taken in another order. Read without
    RoPE's angles: each pair's length (what a rotation keeps) against each layout's q (k); either side."""
    qk_norm = e.kind in ("q_layernorm", "k_layernorm", "q_norm", "k_norm")  # before RoPE: its input read
    if e.kind not in ("q_rot", "k_rot") and not qk_norm:
        return None
    stem = e.name.rsplit(".", 1)[0]
    parts = [e.ref_trace.tensors.get(f"{stem}.{p}_proj") for p in "qkv"]
    layer = e.facts.layer(e.result.layer)
    d = layer.head_dim if layer is not None else e.facts.head_dim
    heads, kv_heads = e.facts.num_heads, e.facts.num_kv_heads or e.facts.num_heads
    mine, theirs = (e.ours, e.ref) if not qk_norm else e.inputs()
    if qk_norm and mine is not None and theirs is not None and d and mine.shape == theirs.shape:
        n = heads if e.kind.startswith("q") else kv_heads
        if mine.dim() == 3 and mine.shape[-1] == n * d:  # (batch, seq, heads * head_dim)
            mine, theirs = (t.unflatten(-1, (n, d)).transpose(1, 2) for t in (mine, theirs))
        elif mine.dim() == 4 and mine.shape[2] == n and mine.shape[-1] == d:  # (batch, seq, heads, head_dim)
            mine, theirs = mine.transpose(1, 2), theirs.transpose(1, 2)
    if mine is None or theirs is None or mine.dim() != 4 or mine.shape != theirs.shape:
        return None
    raw = fused_output(e, stem)
    if not d or not heads:
        return None
    if all(p is not None and p.dim() == 3 for p in parts):
        if len({cast(torch.Tensor, p).shape[:-1] for p in parts}) != 1:
            return None  # a cross-attention's queries and keys over other sequences: no fused projection
        fused = torch.cat([cast(torch.Tensor, p).double() for p in parts], dim=-1)
    elif raw is not None and raw.dim() == 3:  # the reference's own fused output, in its own layout (BLOOM's)
        fused = raw.double()
        # the KV heads it holds, from its width: Falcon's new decoder holds num_kv_heads of them and expands them
        # to every query head after the split (the facts' count, the attention's)
        kv_heads = (fused.shape[-1] // d - heads) // 2
        if kv_heads < 1 or (heads + 2 * kv_heads) * d != fused.shape[-1]:
            return None
        parts = list(fused.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    else:
        return None
    if e.facts.clip_qkv:
        fused = fused.clamp(-e.facts.clip_qkv, e.facts.clip_qkv)  # OLMo clamps the fused output (commutes with a cut)
    layouts = fused_layouts(fused, heads, kv_heads, d)
    if not layouts:
        return None
    q, k, v = (cast(torch.Tensor, t).double() for t in parts)
    fast = tuple(  # each projection's features cut as (head_dim, heads): the heads the fast axis
        t.unflatten(-1, (d, t.shape[-1] // d)).transpose(-1, -2).transpose(1, 2) for t in (q, k, v)
    )
    if all(t.shape[-1] == d for t in fast):
        layouts["each projection's features as (head_dim, heads), the heads the fast axis"] = fast
    rope = layer.rope if layer is not None else None
    index = 0 if e.kind.startswith("q") else 1
    # a q/k norm between the projection and RoPE that ours computes untapped (StableLM's per-head LayerNorms): each
    # layout's q (k) normalised as the reference's own norm does, then read as RoPE keeps it
    norm = None if qk_norm else qk_norm_function(e, stem, e.kind[0], mine.shape[1], d, mine.shape[2])
    normed = norm[0] if norm is not None else None

    def lengths(t: torch.Tensor) -> torch.Tensor:  # what RoPE keeps; no RoPE (or before it): the values
        return pair_lengths(t, rope.rotary_dim, rope.interleaved) if rope is not None and not qk_norm else t.double()

    def as_rotated(t: torch.Tensor) -> torch.Tensor:
        return normed(t) if normed is not None and t.shape == mine.shape else t

    def layouts_of(t: torch.Tensor) -> list[str]:
        """Every layout whose q (k) this is: layouts that cut q alike (per head [q; k; v] and CodeGen's
        per-head blocks [q; v; k]) all match."""
        mine = lengths(t)
        atol = 2 * e.noise + 1e-6 * float(mine.abs().max())
        found = []
        for label, qkv in layouts.items():
            if qkv[index].shape != t.shape:
                continue
            theirs = lengths(as_rotated(qkv[index]))
            scale = float((mine * theirs).sum() / theirs.pow(2).sum().clamp_min(1e-300))  # OPT scales q in forward
            if scale > 0 and torch.allclose(mine, scale * theirs, atol=atol, rtol=1e-5):
                found.append(label)
        return found

    ours_all, ref_all = layouts_of(mine), layouts_of(theirs)
    if not ours_all or not ref_all or set(ours_all) & set(ref_all):
        return None
    # several layouts cut q alike: the one of this family's own checkpoint layout named first
    own = "CodeGen" if e.facts.model_type == "codegen" else None
    ours_is, ref_is = (
        sorted(found, key=lambda label: own is None or own not in label)[0] for found in (ours_all, ref_all)
    )
    if {ours_all[0], ref_all[0]} <= {f"stacked [{'; '.join(o)}]" for o in ("qkv", "qvk", "kqv", "vkq")}:
        return None  # two of the three exchanged: as well two projections' weights swapped (swapped_weights)
    return Hint(
        "qkv_layout",
        f"likely the q/k/v output cut into heads in another layout: {e.kind[0]} in ours is the projections' "
        f"output (fused or not) read {ours_is}, in the reference {ref_is}",
        {"ours": ours_is, "reference": ref_is},
    )


def head_mapping(e: Evidence) -> Hint | None:
    """Some heads agree and others do not, or ours' heads are the reference's in another order."""
    layer = e.facts.layer(e.result.layer)
    head_dim = layer.head_dim if layer else e.facts.head_dim
    a, b = _heads(e.ours, e.kind, head_dim), cast(torch.Tensor, _heads(e.ref, e.kind, head_dim))
    if a is None or a.shape[0] < 2:
        return None
    n = a.shape[0]
    same = [i for i in range(n) if e.close(a[i], b[i])]
    moved = {i: j for i in range(n) if i not in same for j in range(n) if j != i and e.close(a[i], b[j])}
    if not moved and (not same or len(same) == n):
        return None  # no head equals another: nothing here says "mapping"
    # K/V heads meet the query heads from the scores on: a head mix-up before that is not GQA's
    gqa = e.facts.num_kv_heads != e.facts.num_heads and e.kind in ("scores", "probs", "context")
    kv = e.facts.num_kv_heads or n
    if gqa and not moved and n % kv == 0 and set(same) != {i for i in range(n) if i // (n // kv) == i % kv}:
        # K/V heads tiled where they were meant interleaved (or the reverse) leave exactly the heads whose two
        # readings meet agreeing; another set of agreeing heads is a difference of some heads, not the mapping
        return None
    if gqa:
        cause = "GQA head mapping (K/V heads expanded with repeat instead of repeat_interleave, or grouped wrongly)"
    elif e.kind in ("q_l2norm", "k_l2norm"):
        cause = (
            "the linear-attention head mapping (which value head reads which q/k head: q and k expanded to the "
            "value heads with repeat instead of repeat_interleave, or grouped wrongly)"
        )
    else:
        cause = (
            "a head permutation in the weights or the head split (a fused projection cut in flat halves "
            "instead of per head)"
        )
    parts = [f"heads {fmt_list(same)} agree" if same else "no head agrees in place"]
    if moved:
        parts.append("ours " + ", ".join(f"head {i} = reference head {j}" for i, j in list(moved.items())[:6]))
    differ = [i for i in range(n) if i not in same]
    parts.append(f"heads {fmt_list(differ)} differ")
    return Hint(
        "head_mapping",
        f"likely {cause}: " + "; ".join(parts),
        {"agree": same, "moved": {str(k): v for k, v in moved.items()}, "differ": differ},
    )


def _input_parts(e: Evidence, x: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """The reference's traced nodes that, side by side along the last axis, are ``x`` (RoCBERT's ``cat(word, shape,
    pronunciation)`` embeddings read by ``map_inputs_layer``): ``[(name, tensor)]`` in their order, two or more of
    them; None where ``x`` is no such concatenation."""
    parts: list[tuple[str, torch.Tensor]] = []
    at, width = 0, x.shape[-1]
    while at < width:
        found = next(
            (
                (n, t)
                for n, t in e.ref_trace.tensors.items()
                if n != e.name
                and isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and t.shape[:-1] == x.shape[:-1]
                and 0 < t.shape[-1] <= width - at
                and t.shape[-1] < width
                and torch.equal(t.to(x.dtype), x[..., at : at + t.shape[-1]])
            ),
            None,
        )
        if found is None:
            return None
        parts.append(found)
        at += found[1].shape[-1]
    return parts if len(parts) >= 2 else None


def concatenated_parts(e: Evidence) -> Hint | None:
    """A linear node whose reference input is a concatenation of traced nodes (:func:`_input_parts`), ours' output
    the reference's product over those parts in another order, or with some of them zeros: the parts joined
    otherwise (``cat(word, pronunciation, shape)`` for ``cat(word, shape, pronunciation)``), or left out. Ours'
    side (its weight's columns, in the reference's order, applied to them)."""
    import itertools

    x, weight = e.ref_trace.inputs.get(e.name), e.ref_trace.weights.get(e.name)
    if (
        x is None
        or weight is None
        or weight.dim() != 2
        or x.shape[-1] != weight.shape[1]
        or e.ours.shape != e.ref.shape
    ):
        return None
    parts = _input_parts(e, x)
    if parts is None or len(parts) > 4:
        return None
    bias = e.ref_trace.biases.get(e.name)

    def out(tensors: list[torch.Tensor]) -> torch.Tensor:
        y = torch.cat([t.double() for t in tensors], -1) @ weight.double().T
        return y + bias.double() if bias is not None else y

    names = [n for n, _ in parts]
    for order in itertools.permutations(range(len(parts))):
        if list(order) == list(range(len(parts))):
            continue
        if [parts[i][1].shape[-1] for i in order] and e.close(
            out([parts[i][1] for i in order]).to(e.ours.dtype), e.ours
        ):
            joined = ", ".join(names[i].rsplit(".", 1)[-1] for i in order)
            meant = ", ".join(n.rsplit(".", 1)[-1] for n in names)
            return Hint(
                "concat_order",
                f"likely the parts of {e.kind}'s input concatenated in another order in ours: its output is the "
                f"reference's {e.kind} over cat({joined}) where the reference reads cat({meant}) (its weight's "
                "columns in the reference's order)",
                {"side": "ours", "order": [names[i] for i in order]},
            )
    for k in range(1, len(parts)):
        for left in itertools.combinations(range(len(parts)), k):
            tensors = [torch.zeros_like(t) if i in left else t for i, (_, t) in enumerate(parts)]
            if e.close(out(tensors).to(e.ours.dtype), e.ours):
                what = ", ".join(names[i] for i in left)
                return Hint(
                    "missing",
                    f"likely {what} left out of {e.kind}'s input in ours (zeros in its place): its output is the "
                    f"reference's {e.kind} over the same concatenation with {'that part' if k == 1 else 'those parts'} "
                    "zero",
                    {"side": "ours", "left_out": [names[i] for i in left]},
                )
    return None


def last_dim_permutation(e: Evidence) -> Hint | None:
    """Same values, other order along the last axis: a row permutation of a weight (RoPE layout
    permutation with a wrong head count, half-split vs interleaved Q/K rows). The identity is never
    a permutation."""
    ours, ref = e.ours, e.ref
    if ours.dim() < 2 or ours.shape[-1] < 4:
        return None
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)
    if not torch.allclose(a.sort(-1).values, b.sort(-1).values, atol=max(e.result.atol, 1e-12), rtol=e.result.rtol):
        return _features_gathered(e, a, b, "ours") or _features_gathered(e, b, a, "the reference") or _input_permuted(e)
    perm = [int((b[0] - a[0, j]).abs().argmin()) for j in range(a.shape[-1])]
    moved = [j for j, k in enumerate(perm) if j != k]
    if not moved or len(set(perm)) != len(perm):
        return None
    if rel(a, b[:, perm]) > EXPLAINS:  # ours[..., j] = reference[..., perm[j]] on every token
        return None
    evidence: dict = {"permutation": perm[:64], "moved": len(moved)}
    swapped = _parts_swapped(e, perm) or _concat_order(e, perm, "")
    if swapped is not None:
        return swapped
    within = ""
    head_dim = e.facts.head_dim
    if e.kind in HEAD_MERGED and head_dim and ours.shape[-1] % head_dim == 0:
        crossing = sum(1 for j, k in enumerate(perm) if j // head_dim != k // head_dim)
        evidence["crosses_heads"] = crossing
        within = (
            "; every element stays in its head (a permutation within heads: RoPE rows in Meta's interleaved "
            "layout, not un-permuted or un-permuted with the wrong head count)"
            if crossing == 0
            else f"; {crossing} positions cross head boundaries"
        )
    return Hint(
        "weight_permutation",
        f"likely a permutation of weight rows: same values per token, other order along the last axis "
        f"(ours[j] = reference[{fmt_list(perm, 8)}]){within}",
        evidence,
    )


def _input_permuted(e: Evidence) -> Hint | None:
    """A node whose input (not its output: its own weight is applied after) holds the reference's input
    values in another order along the last axis, the same within every head: q/k rows permuted at load
    (Meta's interleaved layout) where the reference keeps them, read where a per-head norm first weights
    them."""
    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.shape != x_ref.shape or x_ours.shape[-1] < 4:
        return None
    a, b = x_ours.double().flatten(0, -2), x_ref.double().flatten(0, -2)
    if not torch.allclose(a.sort(-1).values, b.sort(-1).values, atol=max(e.result.atol, 1e-9)):
        return None
    perm = [int((b[0] - a[0, j]).abs().argmin()) for j in range(a.shape[-1])]
    if perm == list(range(len(perm))) or len(set(perm)) != len(perm) or rel(a, b[:, perm]) > EXPLAINS:
        return None
    swapped = _concat_order(e, perm, "input")
    if swapped is not None:
        return swapped
    return Hint(
        "weight_permutation",
        f"likely a permutation of weight rows before {e.kind}: its input holds the reference's values per token in "
        f"another order along the last axis (ours[j] = reference[{fmt_list(perm, 8)}]), then its own weight, in the "
        "reference's order, is applied to them (q/k rows permuted at load where the reference keeps them, or the "
        "reverse)",
        {"permutation": perm[:64], "at": "input"},
    )


def _concat_order(e: Evidence, perm: list[int], at: str) -> Hint | None:
    """``perm`` (ours[j] = reference[perm[j]]) a rotation of two blocks of whole features: the reference's two parts
    ``cat(a, b)`` concatenated as ``cat(b, a)`` (Zamba's ``cat(hidden, embeddings)``, A.X-K2's q_gate_proj reading
    ``cat(q_resid, q_compressed)``), at the node's ``input`` or (``at`` empty) at its output. Either side."""
    moved = [j for j, p in enumerate(perm) if p != j]
    if not moved:
        return None
    lo, hi = (
        moved[0],
        moved[-1] + 1,
    )  # the swapped parts may sit among others kept in place (cat(x, b, a) for cat(x, a, b))
    first = perm[lo] - lo
    n = hi - lo
    # two parts of some size each (a quarter of the range at least): a row permutation rolled by a few is no join
    if (
        not 0 < first < n
        or 4 * min(first, n - first) < n
        or perm[lo:hi] != [*range(lo + first, hi), *range(lo, lo + first)]
    ):
        return None
    where = f"{e.kind}'s input" if at else e.kind
    a, b = first, n - first
    span = "" if (lo, hi) == (0, len(perm)) else f" (features {lo}:{hi}, the others in place)"
    return Hint(
        "concat_order",
        f"likely two parts concatenated in the other order: {where} holds the reference's last {b} features{span} "
        f"first, then its first {a} (one side builds cat(b, a) where the other builds cat(a, b)"
        + (
            "; the node's own weight is applied to them in the reference's order)"
            if at
            else ": two outputs joined in the other order, or a weight's two blocks of rows swapped at load)"
        ),
        {"first_part": a, "second_part": b, "at": at or "output"},
    )


def _parts_swapped(e: Evidence, perm: list[int]) -> Hint | None:
    """q (k) whose head is the reference's two parts, the rotated and the pass-through dims, concatenated
    in the other order (``cat(q_rope, q_nope)`` where the reference builds ``cat(q_nope, q_rope)``)."""
    layer = e.facts.layer(e.result.layer)
    d = e.ours.shape[-1]
    rotary = layer.rope.rotary_dim if layer is not None and layer.rope is not None else 0
    if e.kind not in ("q_rot", "k_rot") or not 0 < rotary < d or len(perm) != d:
        return None
    for first in (rotary, d - rotary):  # ours' first part: as wide as the reference's last
        if set(perm[:first]) == set(range(d - first, d)) and set(perm[first:]) == set(range(d - first)):
            # the side whose rotated dims sit where the family puts them (MLA: last; partial rotary: first) is right
            reference_rotated_last = first == rotary
            side = "ours"
            if rotary != d - rotary and reference_rotated_last != (ROTATED_LAST in e.facts.features):
                side = "the reference"
            other = "the reference" if side == "ours" else "ours"
            mine, theirs = ("rope, nope", "nope, rope") if (side == "ours") == reference_rotated_last else (
                "nope, rope", "rope, nope")  # fmt: skip
            return Hint(
                "qkv_layout",
                f"likely {e.kind[0]}'s parts concatenated in the other order in {side}: its first {first if side == 'ours' else d - first} "
                f"dims are {whose(other)} last, the rest {whose(other)} first (cat({mine}) where {other} builds "
                f"cat({theirs}); the other projection in {whose(other)} order)",
                {"first": first, "permutation": perm[:64], "side": side},
            )
    return None


def _features_gathered(e: Evidence, a: torch.Tensor, b: torch.Tensor, side: str) -> Hint | None:
    """Every feature of ``side`` (``a`` ``(tokens, features)``) is one of the other side's (``b``), some of them
    several times, on every token: values gathered with repeats along the last axis. The named case:
    ``repeat_interleave(n, dim=-1)`` then a view, where shared K/V heads were meant to be repeated
    along the heads axis (each feature ``j`` of a head reads the reference's ``j // n``)."""
    if a.shape != b.shape or a.shape[0] < 4:
        return None
    atol = max(e.result.atol, 1e-6 * float(b.abs().max()))
    other = "the reference" if side == "ours" else "ours"
    same = (a[:, :, None] - b[:, None, :]).abs().amax(0) <= atol  # (ours feature, reference feature)
    distinct = (b[:, :, None] - b[:, None, :]).abs().amax(0) > atol
    if not bool(distinct.fill_diagonal_(True).all()) or not bool(same.any(-1).all()):
        return None
    source = same.double().argmax(-1).tolist()
    if len(set(source)) == len(source):
        return None  # a permutation is judged by the sorted values above
    n = a.shape[-1]
    repeats = next((r for r in range(2, n + 1) if n % r == 0 and source == [j // r for j in range(n)]), None)
    how = (
        f"each of {whose(other)} features repeated {repeats} times in a row ({side}[j] = {other}[j // {repeats}]): "
        f"repeat_interleave({repeats}, dim=-1) along the features where the heads axis was meant (shared K/V heads "
        "expanded over head_dim, then viewed as heads)"
        if repeats
        else f"{side}[j] = {other}[{fmt_list(source, 8)}]: features read with repeats (a gather or expand along the "
        "wrong axis)"
    )
    return Hint(
        "head_mapping",
        f"likely the features gathered along the wrong axis in {side}: every feature of {whose(side)} {e.kind} is one "
        f"of {whose(other)}, {n - len(set(source))} of them repeated: {how}",
        {"source": source[:64], "repeats": repeats, "side": side},
    )


def head_reads_table(e: Evidence) -> Hint | None:
    """The logits (or the output head's node) one side computes from the head's input times another table of the
    reference's shape ``(vocab, hidden)``: the token embedding where the reference has a head of its own (a head
    tied although ``tie_word_embeddings`` is false, or left untied where it is true), its bias added or not."""
    head = e.facts.head_module
    if e.kind not in (head.rsplit(".", 1)[-1], "logits") or e.ours.shape != e.ref.shape:
        return None
    if head not in e.ref_trace.inputs:  # a head by another name (ELECTRA's generator_lm_head): the linear to the vocab
        head = next(
            (
                n
                for n, w in e.ref_trace.weights.items()
                if w.dim() == 2
                and w.shape[0] == e.ours.shape[-1]
                and n in e.ref_trace.inputs
                and e.ref_trace.inputs[n].is_floating_point()
                and e.ref_trace.inputs[n].shape[-1] == w.shape[1]
            ),
            head,
        )
    x, weight = e.ref_trace.inputs.get(head), e.ref_trace.weights.get(head)
    if x is None or weight is None or weight.dim() != 2 or e.ours.shape[-1] != weight.shape[0]:
        return None
    bias = e.ref_trace.biases.get(head)
    ours = e.ours.double()
    for name, table in e.ref_trace.weights.items():
        if name == head or table.shape != weight.shape or torch.equal(table, weight):
            continue
        product = x.double() @ table.double().T
        for added in (bias, None) if bias is not None else (None,):
            value = product if added is None else product + added.double()
            if value.shape == ours.shape and e.close(value.to(e.ours.dtype), e.ours):
                tied = "tied" if e.facts.tie_word_embeddings else "not tied"
                return Hint(
                    "untied_head",
                    f"likely the output head reading another table in ours: its logits are {head}'s input times "
                    f"{name} ({tuple(table.shape)}){' plus the head bias' if added is not None else ''}, where the "
                    f"reference's head multiplies by its own {head}.weight (the config's head is {tied} to the "
                    "embedding: tie_word_embeddings)",
                    {"side": "ours", "table": name},
                )
    return None


def untied_head(e: Evidence) -> Hint | None:
    """Everything before the output agrees but the logits are uncorrelated: an unloaded or untied head."""
    if (
        e.kind not in (e.facts.head_module.rsplit(".", 1)[-1], "logits")
        or e.result.cosine is None
        or abs(e.result.cosine) > 0.3
    ):
        return None
    if e.kind == "logits" and e.facts.head_module in e.ref_trace.tensors:
        return None  # the head's own node was compared before the logits and agreed: the head is loaded
    if e.ours.shape == e.ref.shape and e.close(e.ours.sort(-1).values, e.ref.sort(-1).values):
        return None  # the same values per token in another order: the vocabulary permuted, not an unloaded head
    tied = " (the config ties it to the embedding)" if e.facts.tie_word_embeddings else ""
    return Hint(
        "untied_head",
        f"likely an output head that was never loaded or tied{tied}: every hidden node before it agrees, "
        f"the logits are uncorrelated (cosine {e.result.cosine:.3f})",
        {"cosine": e.result.cosine},
    )


#: a gated MLP's down projection -> its gate and up projections, by the names Transformers gives them
#: (Llama's; LFM2's and Mixtral's w2 = down, w1 = gate, w3 = up)
_GLU_NAMES = {"down_proj": ("gate_proj", "up_proj"), "w2": ("w1", "w3")}


def gate_up_roles(e: Evidence) -> Hint | None:
    """A gated MLP's down projection reads ``act(up) * gate`` where the reference's reads ``act(gate) *
    up``: gate_proj and up_proj agree (each holds its weight), their roles are swapped (``swapped_roles``);
    or ``other(gate) * up``, another activation than the reference's (``activation``: SiLU for GELU,
    exact for tanh GELU, in a fused MLP with no node of its own for the activation)."""
    names = _GLU_NAMES.get(e.kind)
    if names is None or e.name not in e.ours_trace.inputs:
        return None
    gate_name, up_name = names
    stem = e.name.rsplit(".", 1)[0]
    gate, up = e.ref_trace.tensors.get(f"{stem}.{gate_name}"), e.ref_trace.tensors.get(f"{stem}.{up_name}")
    x = e.ours_trace.inputs[e.name]
    fused = e.ref_trace.tensors.get(f"{stem}.gate_up_proj")
    if fused is None:
        fused = _from_parts(e, f"{stem}.gate_up_proj")
    if gate is None and fused is not None and fused.shape[-1] == 2 * x.shape[-1]:
        return _fused_split(e, fused, x)
    if gate is None or up is None or gate.shape != up.shape or gate.shape != x.shape:
        return None

    x_ref = e.ref_trace.inputs.get(e.name) if hasattr(e.ref_trace.inputs, "get") else None
    for label, act in activations().items():
        right, swapped = act(gate) * up, act(up) * gate
        ours_swapped = e.close(x, swapped) and not e.close(x, right)
        ref_swapped = x_ref is not None and e.close(x_ref, swapped) and e.close(x, right) and not e.close(x_ref, right)
        if ours_swapped or ref_swapped:
            side, other = ("ours", "the reference") if ours_swapped else ("the reference", "ours")
            return Hint(
                "swapped_roles",
                f"likely swapped roles: {gate_name} and {up_name} agree on both sides, but {side} applies the activation "
                f"({label}) to {up_name}'s output and multiplies by {gate_name}'s ({other}: act(gate) * up)",
                {"swapped": [f"{stem}.{gate_name}", f"{stem}.{up_name}"], "activation": label, "side": side},
            )
    # the roles agree, the function differs: each side's down_proj input read back as act(gate) * up
    products = {label: act(gate) * up for label, act in activations().items()}
    ours_is = next((label for label, y in products.items() if e.close(x, y)), None)
    ref_is = next((label for label, y in products.items() if x_ref is not None and e.close(x_ref, y)), None)
    if ours_is is not None and ref_is is not None and ours_is != ref_is:
        return Hint(
            "activation",
            f"likely the activation function: ours' down_proj reads act(gate) * up with act = {ours_is}, the "
            f"reference's with {ref_is} (gate_proj and up_proj agree on both sides)",
            {"ours": ours_is, "reference": ref_is, "input": f"{stem}.{gate_name}"},
        )
    if ref_is is not None and ours_is is None:
        for what, alone in (
            (f"act(gate) alone ({ref_is}(gate_proj))", activations()[ref_is](gate)),
            ("up_proj alone", up),
        ):
            if e.close(x, alone):
                return Hint(
                    "activation",
                    f"likely the gated product incomplete: ours' down_proj reads {what}, the reference's act(gate) * "
                    "up (one factor never multiplied in)",
                    {"ours": what, "reference": ref_is, "input": f"{stem}.{gate_name}"},
                )
        # ours' down_proj input divided by up is still one smooth function of gate: another activation
        keep = up.double().abs() > 1e-2 * float(up.double().abs().max())
        f = x.double()[keep] / up.double()[keep]
        g = gate.double()[keep]
        if function_of(g, f):
            samples = [(float(v), float(f[(g - v).abs().argmin()])) for v in (-2.0, 0.0, 2.0)]
            points = ", ".join(f"f({v:g}) = {y:.4g}" for v, y in samples)
            return Hint(
                "activation",
                f"likely the activation function: ours' down_proj reads f(gate) * up with f another function than "
                f"the reference's {ref_is} ({points}; gate_proj and up_proj agree on both sides)",
                {"ours": None, "reference": ref_is, "input": f"{stem}.{gate_name}", "samples": samples},
            )
    return None


def _from_parts(e: Evidence, node: str) -> torch.Tensor | None:
    """A fused node's whole output put back from the part nodes the reference recorded
    (``node[a:b]``, ``node[a:b:step]``: the output features each module of ours holds)."""
    parts = [
        (list(part[1]), t) for name, t in e.ref_trace.tensors.items() if (part := part_of(name)) and part[0] == node
    ]
    if len(parts) < 2:
        return None
    width = max(max(rows) for rows, _ in parts) + 1
    if sum(len(rows) for rows, _ in parts) != width:
        return None
    whole = torch.zeros(*parts[0][1].shape[:-1], width, dtype=parts[0][1].dtype)
    for rows, t in parts:
        whole[..., rows] = t
    return whole


def _fused_split(e: Evidence, fused: torch.Tensor, x: torch.Tensor) -> Hint | None:
    """A fused ``gate_up_proj`` output read apart otherwise on one side: in halves ``[gate; up]``, the
    halves the other way round, or interleaved rows (gate = 0::2, up = 1::2)."""

    n = x.shape[-1]
    splits = {
        "halves [gate; up]": (fused[..., :n], fused[..., n:]),
        "halves the other way round [up; gate]": (fused[..., n:], fused[..., :n]),
        "interleaved rows (gate = rows 0::2, up = rows 1::2)": (fused[..., 0::2], fused[..., 1::2]),
    }
    x_ref = e.ref_trace.inputs.get(e.name)
    for label, act in activations().items():
        products = {how: act(g) * u for how, (g, u) in splits.items()}
        ref_is = next((how for how, y in products.items() if x_ref is not None and e.close(x_ref, y)), None)
        ours_is = next((how for how, y in products.items() if e.close(x, y)), None)
        if ref_is is not None and ours_is is not None and ours_is != ref_is:
            return Hint(
                "swapped_weights",
                f"likely the fused gate_up_proj split otherwise: ours reads its output as {ours_is}, the reference as "
                f"{ref_is} (act = {label}); the loader cut the fused weight another way",
                {"ours": ours_is, "reference": ref_is, "activation": label},
            )
    return None


def heads_merged_unmoved(e: Evidence) -> Hint | None:
    """The input of the output projection (the attention context, ``(batch, seq, heads * head_dim)``)
    holds the reference's numbers in another order: ours reshaped ``(batch, heads, seq, head_dim)``
    straight to ``(batch, seq, heads * head_dim)`` without moving the heads axis back next to
    ``head_dim`` (``.transpose(1, 2)`` before the reshape), so each row mixes positions and heads."""
    if e.kind not in OUTPUT_PROJECTIONS:  # o_proj, NeoX's dense, GPT-2's c_proj, ...
        return None
    x_ours, x_ref = e.inputs()
    h, d = e.facts.num_heads, e.facts.head_dim
    if x_ref is None or x_ours is None or x_ours.shape != x_ref.shape or x_ref.dim() != 3 or not h or not d:
        return None
    b, t, f = x_ref.shape
    if f != h * d or t < 2 or e.close(x_ours, x_ref):
        return None
    unmixed = x_ours.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, f)
    if not e.close(unmixed, x_ref):
        return None
    return Hint(
        "head_layout",
        f"likely the heads merged in the wrong axis order: ours' {e.kind} input is the context (batch, heads, seq, "
        "head_dim) reshaped to (batch, seq, heads * head_dim) without moving the heads axis next to head_dim first "
        "(transpose(1, 2) before the reshape), so each position's row mixes positions and heads",
        {"ours": "reshape without transpose"},
    )


def heads_split_unmoved(e: Evidence) -> Hint | None:
    """A rotated q or k (``(batch, heads, seq, head_dim)``) that holds the reference's projection
    split into heads by ``view(batch, heads, seq, head_dim)`` straight from ``(batch, seq, heads *
    head_dim)``, without the ``view(batch, seq, heads, head_dim).transpose(1, 2)``: each "head" then
    holds pieces of several positions. Checked after the layer's RoPE where it has one, either side."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None

    b, h, t, d = e.ref.shape
    x = pre_rope(e, h)
    if x is None or x.shape != e.ref.shape or t < 2 or h < 2 or e.positions.shape != (b, t):
        return None  # one head (MQA's keys): the two views are the same tensor, nothing to tell apart
    mixed = x.transpose(1, 2).reshape(b, t, h * d).reshape(b, h, t, d)
    layer = e.facts.layer(e.result.layer)
    if layer is not None and layer.rope is not None:
        mixed = rotate(mixed, layer.rope, e.positions)
    for side, value, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        if e.close(value, mixed.to(value.dtype)) and not e.close(other, mixed.to(other.dtype)):
            return Hint(
                "head_layout",
                f"likely the heads split in the wrong axis order in {side}: its {e.kind} is the projection (batch, seq, "
                "heads * head_dim) viewed as (batch, heads, seq, head_dim) directly, without view(batch, seq, heads, "
                "head_dim).transpose(1, 2), so each head holds pieces of several positions",
                {"side": side, "node": e.kind},
            )
    return None


def projection_input(e: Evidence) -> Hint | None:
    """A rotated q or k that is the reference's projection (its weight, its bias) applied to another
    value the reference computed in this layer before it, e.g. the residual stream before the norm
    (k and v projected from the un-normed input), then split into heads and rotated by the layer's
    RoPE. Only for attention without a q/k norm (a norm between would hide the input)."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None

    stem = e.name.rsplit(".", 1)[0]
    letter = e.kind[0]
    if f"{stem}.{letter}_norm" in e.ref_trace.tensors:
        return None
    proj = f"{stem}.{letter}_proj"
    weight, bias, own = e.ref_trace.weights.get(proj), e.ref_trace.biases.get(proj), e.ref_trace.inputs.get(proj)
    b, h, t, d = e.ref.shape
    if weight is None or weight.dim() != 2 or weight.shape[0] != h * d or own is None:
        return None
    layer = e.facts.layer(e.result.layer)
    rope = layer.rope if layer is not None else None
    if rope is not None and e.positions.shape != (b, t):
        return None
    candidates = layer_values(e, inputs_first=True)
    w = weight.double()
    for name, x in candidates:
        if name == e.name or x.shape != own.shape or not x.is_floating_point() or torch.equal(x, own):
            continue
        y = x.double() @ w.T + (bias.double() if bias is not None and bias.shape[0] == h * d else 0.0)
        heads = y.unflatten(-1, (h, d)).transpose(1, 2)
        if rope is not None:
            heads = rotate(heads, rope, e.positions)
        if e.close(e.ours, heads.to(e.ours.dtype)):
            return Hint(
                "projection_input",
                f"likely {letter}_proj reads another input in ours: ours' {e.kind} is the reference's {letter}_proj "
                f"applied to {name} (rotated as the reference rotates), where the reference's {letter}_proj reads its "
                "own input (e.g. the un-normed residual stream instead of the norm's output)",
                {"projection": proj, "ours_input": name},
            )
    return None


def rotated_other_projection(e: Evidence) -> Hint | None:
    """Ours' rotated keys (or queries) are another projection of the reference rotated: equal to it
    where RoPE leaves a token as it is (position 0) and of equal length in every rotated pair of dims
    elsewhere (a rotation keeps each pair's length). The values used as keys: a fused qkv split as
    ``q | v | k``, or k and v swapped where they are used."""
    if e.kind not in ("q_rot", "k_rot") or e.ours.dim() != 4 or e.positions is None:
        return None
    b, n_heads, seq, d = e.ours.shape
    if d % 2 or e.positions.shape != (b, seq):
        return None
    start = e.positions == 0
    if not bool(start.any()) or bool(start.all()):
        return None
    stem = e.name.rsplit(".", 1)[0]

    for kind in ("v_proj", "k_proj", "q_proj", "k_norm", "q_norm"):
        if kind[0] == e.kind[0]:
            continue  # its own projection: a RoPE fault, not a role
        t = e.ref_trace.tensors.get(f"{stem}.{kind}")
        other = heads_first(t, n_heads, d, seq) if t is not None else None
        if other is None or other.shape != e.ours.shape:
            continue
        first = start[:, None, :, None].expand_as(e.ours)
        at_start = e.close(e.ours[first], other[first])
        layer = e.facts.layer(e.result.layer)
        rope = layer.rope if layer is not None else None
        r, interleaved = (rope.rotary_dim, rope.interleaved) if rope is not None else (None, False)
        if at_start and e.close(pair_lengths(e.ours, r, interleaved), pair_lengths(other, r, interleaved)):
            role = {"v": "values", "k": "keys", "q": "queries"}[kind[0]]
            mine = "keys" if e.kind == "k_rot" else "queries"
            return Hint(
                "swapped_roles",
                f"likely swapped roles: ours' {e.kind} is the reference's {kind} rotated, so ours uses the {role} as "
                f"{mine} (a fused qkv split in another order, e.g. q | v | k, or the two swapped where they are used)",
                {"matches": f"{stem}.{kind}", "swapped": [e.kind, kind]},
            )
    return None


def values_source(e: Evidence) -> Hint | None:
    """The attention context of one side is the reference's probabilities times another tensor of the block
    than its values: the keys (``v`` cut from the same slice as ``k``, a copy-paste), or the queries. Read
    against the reference's ``k_rot`` (the keys before the softmax) and its probabilities; either side."""
    if e.kind != "context" or e.ours.shape != e.ref.shape:
        return None
    stem = e.name.rsplit(".", 1)[0]
    probs = e.ref_trace.tensors.get(f"{stem}.probs")
    if probs is None or probs.dim() != 4:
        return None
    b, h, t, _ = probs.shape
    candidates: dict[str, torch.Tensor | None] = {
        "the keys (k_rot)": e.ref_trace.tensors.get(f"{stem}.k_rot"),
        "the queries (q_rot)": e.ref_trace.tensors.get(f"{stem}.q_rot"),
    }

    def context(x: torch.Tensor) -> torch.Tensor | None:  # (x: the values, one row per key: cross-attention's too)
        if x.dim() != 4 or x.shape[0] != b or x.shape[2] != probs.shape[-1] or h % x.shape[1]:
            return None
        c = probs.double() @ x.double().repeat_interleave(h // x.shape[1], dim=1)  # (b, h, t, d)
        d = c.shape[-1]
        return next(
            (f for f in (c, c.transpose(1, 2), c.transpose(1, 2).reshape(b, t, h * d)) if f.shape == e.ref.shape),
            None,
        )

    found = attention_values(e)
    if found is not None:  # the values through a q/k norm of the block (a per-head norm applied to v too)
        v = found[1]
        for name in (f"{stem}.{n}" for n in ("k_layernorm", "k_norm", "q_layernorm", "q_norm")):
            w, bias = e.ref_trace.weights.get(name), e.ref_trace.biases.get(name)
            if w is None or w.dim() != 1 or w.shape[0] != v.shape[-1]:
                continue
            eps = e.facts.norm_eps or 1e-5
            normed = (
                torch.nn.functional.layer_norm(v, (v.shape[-1],), w.double(), bias.double(), eps)
                if bias is not None
                else v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.double()
            )
            candidates[f"the values through {name.rsplit('.', 1)[-1]}"] = normed
    candidates.update(_values_past_the_norm(e, stem, h, e.ref.shape[-1]))
    forms = {label: c for label, x in candidates.items() if x is not None and (c := context(x)) is not None}
    for side, value, other in (("ours", e.ours, e.ref), ("the reference", e.ref, e.ours)):
        for label, c in forms.items():
            if e.close(value, c.to(value.dtype)) and not e.close(other, c.to(other.dtype)):
                return Hint(
                    "swapped_roles",
                    f"likely the values taken from another tensor in {side}: its context is the probabilities times "
                    f"{label}, not the values as the projection gives them (a copy-paste: v cut from another "
                    "projection's slice, or passed through another's norm)",
                    {"side": side, "values": label},
                )
    return None


def _values_past_the_norm(e: Evidence, stem: str, heads: int, width: int) -> dict[str, torch.Tensor]:
    """The values as v_proj gives them from the input of the norm its keys are read through (BLT's cross-attention
    normalises the states once, k_norm, for both k_proj and v_proj): ``(batch, kv heads, seq, head_dim)`` per such
    norm, labelled."""
    w = e.ref_trace.weights.get(f"{stem}.v_proj")
    if w is None or w.dim() != 2 or not heads or width % heads:
        return {}
    d = width // heads
    bias = e.ref_trace.biases.get(f"{stem}.v_proj")
    found: dict[str, torch.Tensor] = {}
    for norm in ("k_norm", "k_layernorm", "kv_norm"):
        x = e.ref_trace.inputs.get(f"{stem}.{norm}")
        if x is None or x.dim() != 3 or x.shape[-1] != w.shape[1] or w.shape[0] % d:
            continue
        v = x.double() @ w.double().T + (bias.double() if bias is not None else 0.0)
        found[f"v_proj of {norm}'s input (the states before the norm: the values read without {norm})"] = v.unflatten(
            -1, (-1, d)
        ).transpose(1, 2)
    return found


def attention_rows_moved(e: Evidence) -> Hint | None:
    """One side's attention row for (head h, query q) is the softmax of the other side's scores of another
    (head, query) pair over the keys it keeps: rows moved by a reshape. The named case: queries
    flattened as (queries, heads) rows for one batched matmul against shared keys (StarCoder's
    multi-query ``bmm``) and viewed back as (heads, queries), or the reverse. Read from log-probabilities
    against the other side's unmasked scores (a row's log-probabilities are its scores less one constant)."""
    if e.kind != "probs" or e.ours.dim() != 4 or e.ours.shape != e.ref.shape:
        return None
    b, h, t, _ = e.ours.shape
    if h < 2 or t < 3 or h * t > 2048:
        return None
    scores_name = e.name.rsplit(".", 1)[0] + ".scores"
    for side, this, trace in (("ours", e.ours, e.ref_trace), ("the reference", e.ref, e.ours_trace)):
        scores = trace.tensors.get(scores_name)
        if scores is None or scores.shape != this.shape:
            continue
        real = None
        if e.attention_mask is not None and tuple(e.attention_mask.shape) == (b, t):
            real = e.attention_mask.bool().cpu()
        found = _row_sources(this.double(), scores.double(), real)
        if found is None:
            continue
        mapping, known = found
        rows = torch.arange(h * t).reshape(h, t)
        moved = int((mapping != rows[None])[known].sum())
        if moved < max(1, int(known.sum()) // 4):
            return None  # a reshape moves most rows; a few lookalikes are no evidence
        flat_ql = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(t), indexing="ij"), -1).reshape(-1, 2)
        named = {
            "its queries flattened as (queries, heads) rows for one matmul and viewed back as (heads, queries)": (
                lambda hh, qq: (hh * t + qq) % h * t + (hh * t + qq) // h
            ),
            "its queries flattened as (heads, queries) rows and viewed back as (queries, heads)": (
                lambda hh, qq: (qq * h + hh) // t * t + (qq * h + hh) % t
            ),
        }
        how = next(
            (
                label
                for label, f in named.items()
                if torch.equal(
                    mapping[known], f(flat_ql[:, 0], flat_ql[:, 1]).reshape(h, t)[None].expand_as(mapping)[known]
                )
            ),
            None,
        )
        if how is None and bool((mapping // t == torch.arange(h)[None, :, None])[known].all()):
            how = _queries_regrouped(mapping % t, known, t)
        bi, hi, qi = ((mapping != rows[None]) & known).nonzero()[0].tolist()
        src = divmod(int(mapping[bi, hi, qi]), t)
        example = f"(head {hi}, query {qi}) holds the other side's (head {src[0]}, query {src[1]})"
        return Hint(
            "head_mapping",
            f"likely the attention rows reshaped in {side}: {moved} of its {int(known.sum())} (batch, head, query) rows are the softmax "
            f"of the other side's scores for another (head, query) pair, {example}: "
            + (how or "a reshape or view of the (heads, queries) axes in another order"),
            {"side": side, "rows_moved": moved, "layout": how},
        )
    return None


def _queries_regrouped(source: torch.Tensor, known: torch.Tensor, t: int) -> str | None:
    """How rows moved within each head (``source`` ``(batch, heads, queries)``: the query each row is the other's)
    read as ``t = groups * k`` queries laid group-major on one side and slot-major on the other: ``repeat`` where
    the other side uses ``repeat_interleave`` (BLT's ``cross_attn_k`` slots per patch); None otherwise."""
    q = torch.arange(t)
    for k in (2, 3, 4, 8):
        if t % k:
            continue
        groups = t // k
        for label, f in (
            (f"slot-major (slot j of group g at j * {groups} + g: repeat) where the other side lays them group-major "
             f"(g * {k} + j: repeat_interleave)", (q % k) * groups + q // k),
            (f"group-major (g * {k} + j: repeat_interleave) where the other side lays them slot-major (j * {groups} + "
             "g: repeat)", (q % groups) * k + q // groups),
        ):  # fmt: skip
            if torch.equal(source[known], f[None, None].expand_as(source)[known]):
                return (
                    f"its {t} queries in another order within each head, {groups} groups of {k} slots laid {label}: a "
                    f"mask or a query tensor expanded with the other repeat"
                )
    return None


def _row_sources(
    p: torch.Tensor, scores: torch.Tensor, real: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sources, known)``, both ``(batch, heads, queries)``: for each row of ``p`` ``(b, h, t, n)``, the
    flat (head * t + query) index of the row of ``scores`` (same batch) whose values over the keys ``p``
    weights equal ``log p`` up to one constant, and which rows that was read for (two or more weighted
    keys, a real query when ``real`` ``(b, t)`` marks them); None unless every such row has a source."""
    b, h, t, n = p.shape
    keep = p > 0
    known = (keep.sum(-1) >= 2) & (real[:, None, :] if real is not None else True)
    lp = torch.where(keep, p.clamp_min(1e-300).log(), 0.0)
    out = torch.arange(h * t).reshape(1, h, t).repeat(b, 1, 1)
    for bi in range(b):
        cand = scores[bi].reshape(h * t, n)
        scale = 1e-4 * max(1.0, float(cand.abs().max()))
        for hi in range(h):
            k = keep[bi, hi]  # (t, n)
            counts = k.sum(-1)
            solved = ~known[bi, hi]
            if bool(solved.all()):
                continue
            a = lp[bi, hi]
            a = (a - (a * k).sum(-1, keepdim=True) / counts.clamp_min(1)[:, None]) * k  # (t, n) centred on its keys
            c = cand[None] * k[:, None]  # (t, R, n)
            c = (c - c.sum(-1, keepdim=True) / counts.clamp_min(1)[:, None, None]) * k[:, None]
            err = (a[:, None] - c).abs().amax(-1)  # (t, R)
            best, where = err.min(-1)
            if not bool((best[~solved] < scale).all()):
                return None
            own = err[torch.arange(t), hi * t + torch.arange(t)] < scale  # a row that is its own keeps its place
            out[bi, hi] = torch.where(solved | own, out[bi, hi], where)
    return out, known
