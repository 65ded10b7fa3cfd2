"""Detectors of what ran, when: layers run in another order, a module of ours run where the
reference runs another one (so the reference's module is never run by ours), and a module applied
before a reduction the other side applies first.

Both traces record nodes in the order each side produced them (``Trace.calls`` keeps first calls in
order, also when a stream compares and drops the tensors), so the order is evidence of its own,
independent of any value.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import cast

import torch

from parity.compare.results import TIED_COPIES, NodeResult
from parity.diagnose.evidence import Evidence, fmt_list
from parity.diagnose.hints import Hint
from parity.model.facts import ArchFacts
from parity.record.hf_capture import SUFFIXES
from parity.record.trace import Trace


def _layer_order(trace: Trace, facts: ArchFacts) -> list[int]:
    """The decoder layers in the order their first node was produced."""
    seen: list[int] = []
    for name in trace.calls:
        layer = facts.locate(name)[0]
        if layer is not None and layer not in seen:
            seen.append(layer)
    return seen


def execution_order(e: Evidence) -> Hint | None:
    """Ours runs the decoder layers in another order than the reference (the layer list reversed,
    sorted as strings: 0, 1, 10, 11, 2, ...), read from the order each side produced its nodes."""
    if e.result.layer is None:
        return None
    ours, ref = _layer_order(e.ours_trace, e.facts), _layer_order(e.ref_trace, e.facts)
    common = [layer for layer in ref if layer in ours]
    ours_common = [layer for layer in ours if layer in common]
    if len(common) < 2 or ours_common == common:
        return None
    tied = cast(frozenset, e.ref_trace.extras.get(TIED_COPIES, frozenset()))
    if e.name in tied:  # a block the reference ties across layers
        return Hint(
            "wrong_module",
            f"likely the shared block run for another layer: {e.name}'s weights are tied across layers (one block "
            "run for each layer that uses it, each use with its own adapters), and ours' uses of it come in another "
            f"order than the reference's (the nodes' layers: ours {fmt_list(ours_common, 8)}, the reference "
            f"{fmt_list(common, 8)}): the block or adapters chosen for each layer by another rule (the layer's index "
            "where the count of the layers using shared blocks was meant, or the reverse)",
            {"ours": ours_common, "reference": common, "shared": e.name},
        )
    return Hint(
        "execution_order",
        f"likely the layers run in another order: ours runs layers {fmt_list(ours_common, 8)}, the reference "
        f"{fmt_list(common, 8)} (the order each side produced its nodes): the layer list iterated reversed, sorted by "
        "name, or built in another order",
        {"ours": ours_common, "reference": common},
    )


def swapped_in_order(e: Evidence) -> Hint | None:
    """Ours produces this node and another of its kind in the same layer each in the other's place in the
    order (the reference's attention-output norm where its FFN-output norm comes, and the reverse): parity
    follows each weight to the node it belongs to, so one side holds the two modules' weights in each other's
    slots (a loader matching ``output.LayerNorm`` by suffix) or calls each module where the other belongs."""
    if e.result.layer is None:
        return None
    ours = [n for n in e.ours_trace.calls if e.facts.locate(n)[0] == e.result.layer]
    held = set(ours)
    ref = [n for n in e.ref_trace.calls if n in held and e.facts.locate(n)[0] == e.result.layer]
    common = set(ref)
    ours = [n for n in ours if n in common]
    if e.name not in common or ours == ref:
        return None
    for other in ref:
        if other == e.name or e.facts.locate(other)[1] != e.kind:
            continue
        if [other if n == e.name else e.name if n == other else n for n in ours] == ref:
            return Hint(
                "swapped_weights",
                f"likely the weights of {e.name} and {other} swapped on one side: each is run where the other "
                f"belongs (ours produces {e.name} where the reference produces {other}, and the reverse; parity "
                "follows each weight to its node): their weights loaded into each other's slots (a checkpoint key "
                "matched by its suffix, two stacked rows in the other order), or the two modules called in each "
                "other's place",
                {"swapped": [e.name, other]},
            )
    return None


def reused_module(name: str, ours: Trace, ref: Trace, facts: ArchFacts) -> Hint | None:
    """Ours never ran ``name``'s module, and a module of ours aligned to another node of the same kind
    ran more often than the reference's: ours calls that module where the reference runs this one
    (the final norm computed with layer 0's norm, one layer's module called twice)."""
    kind = facts.locate(name)[1]

    def uses(node: str) -> int:  # calls of its module, and reads of its parameter in functions after
        return ours.calls.get(node, 0) + ours.reads.get(node, 0)

    extra = [
        other
        for other in ours.calls
        if other != name and 0 < ref.calls.get(other, 0) < uses(other) and _same_family(kind, other, facts)
    ]
    if not extra:
        return None
    other = extra[0]
    return Hint(
        "wrong_module",
        f"likely a module reused in place of another: ours never runs {name}, and uses {other}'s module (or its "
        f"weight) {uses(other)} times where the reference runs it {ref.calls[other]}: ours uses it where the reference "
        f"runs {name}",
        {"node": name, "reused": other, "uses": uses(other), "reference_calls": ref.calls[other]},
    )


def _same_family(kind: str, other: str, facts: ArchFacts) -> bool:
    """Nodes of one family: two norms, two projections, two layers' same node."""
    other_kind = facts.locate(other)[1]
    if "@" in other_kind:
        return False
    norms = ("norm", "ln")
    if any(n in kind for n in norms) and any(n in other_kind for n in norms):
        return True
    if kind.endswith("_proj") and other_kind.endswith("_proj"):  # gate_proj computed with up_proj's weight
        return True
    return other_kind == kind


def head_on_embedding(name: str, ours: Trace, ref: Trace, facts: ArchFacts) -> Hint | None:
    """Ours never ran the output head, and its logits are the reference's last hidden state times the
    embedding matrix: ours ties the head to the embedding where the reference has its own head (or
    reads the embedding where it should read ``lm_head``)."""
    if name != facts.head_module:
        return None
    logits = ours.tensors.get("logits")
    table = next((ref.weights[n] for n in ref.weights if facts.locate(n)[1] in ("embed_tokens", "wte")), None)
    if logits is None or table is None:
        return None
    hidden = None  # the head's input: the last hidden-sized node the reference produced before it
    for node in ref.tensors:
        if node == name:
            break
        t = ref.tensors[node]
        if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == table.shape[1]:
            hidden = t
    if hidden is None:
        return None
    tied = hidden.double() @ table.double().T
    if tied.shape != logits.shape:
        return None
    err = float((tied - logits.double()).abs().max())
    if err > 1e-4 * float(tied.abs().max()) + 1e-5:
        return None
    config = "the config unties them" if not facts.tie_word_embeddings else "the reference's head holds other weights"
    return Hint(
        "untied_head",
        f"likely the head tied by mistake: ours never runs {name}; its logits are the last hidden state times the "
        f"embedding matrix (max error {err:.2g}), and {config}",
        {"node": name, "tied_error": err},
    )


def partial_read(e: Evidence) -> Hint | None:
    """Ours computed this node as a sum of products over slices of its weight (head by head, in chunks)
    and the slices cover only part of it: a loop whose range skips the weight's tail
    (``range(n // chunk)`` where ``n`` is no multiple of ``chunk``); or the slices' products averaged
    (``torch.stack(parts).mean(0)``) where they are summed."""
    from parity.record.hooks import PARTS_REDUCED, READ_SHARE

    reductions = e.ours_trace.extras.get(PARTS_REDUCED)
    reduced = reductions.get(e.name) if isinstance(reductions, dict) else None
    if reduced is not None and reduced[0] == "mean" and e.close(e.ours * reduced[1], e.ref):
        k = reduced[1]
        return Hint(
            "partial_read",
            f"likely the partial products averaged: ours computes {e.name} as {k} products over slices of its "
            f"weight (row-parallel shards) and takes their mean where they are summed (ours / reference = 1/{k})",
            {"parts": k, "reduction": "mean"},
        )
    shares = e.ours_trace.extras.get(READ_SHARE)
    share = shares.get(e.name) if isinstance(shares, dict) else None
    if share is None or share >= 1:
        return None
    return Hint(
        "partial_read",
        f"likely part of the weight skipped: ours computes {e.name} as a sum of products over slices of its weight, "
        f"and the slices read {share:.1%} of it (a loop over chunks or heads whose range drops the tail)",
        {"share": share},
    )


def loop_count(e: Evidence) -> Hint | None:
    """Modules the reference runs more than once (a recurrent stack, a looped block: HRM's two stacks run in
    cycles, Dory's recurrent layers) that ran another number of times on each side before this node's first
    call, read from the order each side produced its nodes (``Trace.sequence``): a loop's count read from
    another config field or two counts swapped; or, where the reference had not run them yet, two such
    modules run in the other order (their weights swapped at load). Nodes the reference runs once (a layer's
    own projections, which a port may compute in another order) are no evidence."""
    ours_seq, ref_seq = e.ours_trace.sequence, e.ref_trace.sequence
    if e.name not in ours_seq or e.name not in ref_seq:
        return None
    ours_before = Counter(ours_seq[: ours_seq.index(e.name)])
    ref_before = Counter(ref_seq[: ref_seq.index(e.name)])
    differ = [
        n
        for n in dict.fromkeys([*ref_before, *ours_before])
        if ours_before[n] != ref_before[n]
        and e.ref_trace.calls.get(n, 0) > 1
        and e.ours_trace.calls.get(n, 0) >= 1
        and "@" not in n
        and n.rsplit(".", 1)[-1] not in SUFFIXES  # a tap and the capture of one value count twice
    ]
    if len(differ) < 8:
        return None  # a looped block holds a layer's worth of nodes; a module or two called again is no loop
    (mine, theirs), _ = Counter((ours_before[n], ref_before[n]) for n in differ).most_common(1)[0]
    group = _common_module(differ)
    nodes = f"{group} ({len(differ)} nodes)" if group else fmt_list(differ, 4)
    if theirs == 0:
        return Hint(
            "execution_order",
            f"likely two looped blocks run in the other order: ours runs {nodes} before {e.name}'s first call, the "
            "reference only after it (their weights swapped at load, or the loop's steps in another order)",
            {"nodes": differ, "ours_calls": mine, "reference_calls": theirs},
        )
    return Hint(
        "loop_count",
        f"likely a loop's count: ours runs {nodes} {_times(mine)} before {e.name}'s first call, the reference "
        f"{_times(theirs)} (the number of steps of the loop around it read from another config field, or two counts "
        "swapped)",
        {"nodes": differ, "ours_calls": mine, "reference_calls": theirs},
    )


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _common_module(names: list[str]) -> str:
    """The longest module path every name lies under (``model.L_module``), or ``""``."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _sequential_block(e: Evidence) -> Hint | None:
    """The block layout read at this node's input (:func:`~parity.diagnose.norms.block_layout`): a parallel
    block (Cohere's) run sequentially calls its one norm again on the stream after attention."""
    from parity.diagnose.norms import block_layout

    x_ours, x_ref = e.inputs()
    if x_ours is None or x_ref is None or x_ours.shape != x_ref.shape:
        return None
    return block_layout(replace(e, ours=x_ours, ref=x_ref, result=replace(e.result, kind=f"{e.kind}@input")))


def iteration_count(e: Evidence) -> Hint | None:
    """The failing node runs in a loop on both sides (several calls each in one forward) and ours runs it another
    number of times than the reference: the loop around it iterates otherwise (its bounds: which tokens or blocks
    it visits), so its first call may already read another iteration's values, and no value fit of that call is
    evidence (Qwen4-Exp's QSA indexer pools and normalises keys once per query and block)."""
    runs_ours, runs_ref = Counter(e.ours_trace.sequence)[e.name], Counter(e.ref_trace.sequence)[e.name]
    if runs_ours < 2 or runs_ref < 2 or runs_ours == runs_ref:
        return None
    return Hint(
        "loop_count",
        f"likely the loop around {e.name}: ours runs it {runs_ours} times in this forward, the reference {runs_ref} "
        "(once per iteration of a loop: which tokens, blocks or steps it visits differs), so its first call already "
        "reads another iteration's values",
        {"node": e.name, "calls": runs_ours, "reference_calls": runs_ref},
    )


def repeated_module(e: Evidence) -> Hint | None:
    """A node of ours that ran more often than the reference's, before the failing node: ours applies
    that module twice (the final norm applied twice, a layer called twice); its first call, the one
    compared, agrees, so the difference shows after it."""
    names = list(e.ref_trace.order)
    if e.name not in names:
        return None
    before = names[: names.index(e.name)]
    for name in reversed(before):
        mine, theirs = e.ours_trace.calls.get(name, 0), e.ref_trace.calls.get(name, 0)
        tapped = name.rsplit(".", 1)[-1] in SUFFIXES  # a tap and the capture of one value count twice
        if theirs and mine > theirs and "@" not in name and not tapped:
            layout = _sequential_block(e)
            if layout is not None:  # a parallel block's one norm, called again on the stream after attention
                return replace(
                    layout,
                    text=f"{layout.text} (ours runs {name} {mine} times in this forward, the reference {theirs})",
                )
            return Hint(
                "repeated_module",
                f"likely a module applied twice: ours runs {name} {mine} times in this forward, the reference "
                f"{theirs} (its first call, the one compared, agrees; what follows reads the repeated one)",
                {"node": name, "calls": mine, "reference_calls": theirs},
            )
    return None


def before_reduction(result: NodeResult, ours: Trace, ref: Trace) -> Hint | None:
    """One side's node holds one axis more than the other's, and that side's input reduced over that
    axis (its mean or its sum) is the other side's input: the side with the axis applies the module to
    each vector before the reduction the other applies first (a norm applied to every key of a block
    before the block's mean pools them, where the reference normalises the pooled key)."""
    name = result.name
    for side, longer, shorter in (("ours", ours, ref), ("the reference", ref, ours)):
        out_l, out_s = longer.tensors.get(name), shorter.tensors.get(name)
        in_l, in_s = longer.inputs.get(name), shorter.inputs.get(name)
        if out_l is None or out_s is None or in_l is None or in_s is None:
            continue
        if out_l.dim() != out_s.dim() + 1 or in_l.dim() != in_s.dim() + 1 or not in_s.is_floating_point():
            continue
        for axis in range(in_l.dim()):
            size = in_l.shape[axis]
            kept = in_l.shape[:axis] + in_l.shape[axis + 1 :]
            if size < 2 or kept != in_s.shape or out_l.shape[:axis] + out_l.shape[axis + 1 :] != out_s.shape:
                continue
            target = in_s.double()
            atol = 1e-5 * (1.0 + float(target.abs().max()))
            for how, reduce in (("mean", torch.mean), ("sum", torch.sum)):
                if torch.allclose(reduce(in_l.double(), dim=axis), target, rtol=1e-4, atol=atol):
                    other = "the reference" if side == "ours" else "ours"
                    whose = "ours'" if side == "ours" else "the reference's"
                    return Hint(
                        "reduction_order",
                        f"likely {name} applied before a {how}: {side} applies it to each of the {size} vectors "
                        f"along axis {axis} (output {tuple(out_l.shape)}) and takes their {how} after; {other} "
                        f"applies it to their {how} (its input is the {how} over that axis of {whose} input)",
                        {
                            "side": "ours" if side == "ours" else "reference",
                            "axis": axis,
                            "size": size,
                            "reduction": how,
                        },
                    )
    return None
