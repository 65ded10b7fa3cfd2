"""The residual stream and what a module reads from it: a residual add missing or done twice, a norm
that reads another point of the stream (a post-norm where the reference has a pre-norm, a norm after
the residual add), a module input scaled by a constant (an embedding scale a port added or dropped).

Each detector reads only the reference's own trace and ours' value at the failing node, so it names
the side that differs whichever side the fault sits on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, cast

import torch

from parity.diagnose.evidence import (
    EXPLAINS,
    Evidence,
    constant_named,
    forms_of,
    layer_values,
    reads_stream,
    rel,
    whose,
)
from parity.diagnose.hints import Hint
from parity.diagnose.masks import dropout_left_on, dropout_pattern
from parity.diagnose.norms import is_norm, norm_statistics, residual_into


def _as_node(e: Evidence, t: torch.Tensor) -> torch.Tensor | None:
    """``t`` in the failing node's shape, when it differs only by how the leading axes are flattened
    (OPT runs its MLP and final norms on ``(batch * seq, hidden)``); None for another shape."""
    if t.shape == e.ref.shape:
        return t
    if t.numel() == e.ref.numel() and t.dim() and e.ref.dim() and t.shape[-1] == e.ref.shape[-1]:
        return t.reshape(e.ref.shape)
    return None


def _branch_output(e: Evidence) -> tuple[str, torch.Tensor] | None:
    """The last reference node before the failing one, in its layer, of the residual stream's shape
    that is no point of the stream itself: what the sub-layer adds (o_proj, a post-attention norm)."""
    found = previous = None
    for name, tensor in e.ref_trace.tensors.items():
        if name == e.name:
            break
        layer, kind = e.facts.locate(name)
        shaped = _as_node(e, tensor)
        if shaped is None or reads_stream(kind) or layer is None or e.result.layer is None:
            continue
        tensor = shaped
        if layer == e.result.layer:
            found = (name, tensor)
        elif layer == e.result.layer - 1:  # a layer's first norm reads the previous layer's last add
            previous = (name, tensor)
    return found or previous


def _parallel_branches(e: Evidence, stream: str) -> tuple[str, torch.Tensor] | None:
    """``("a + b", a + b)``: every branch output of the failing node's layer after the stream point
    ``stream`` (Phi's and GPT-J's attention and MLP, both reading the layer's input), when there are two or
    more; None otherwise."""
    if e.result.layer is None:
        return None
    names = list(e.ref_trace.tensors)
    begin = stream.partition("@")[0]
    after = names[names.index(begin) :] if begin in names else names
    last: dict[str, tuple[str, torch.Tensor]] = {}  # per sub-block (self_attn, mlp): its last node, its output
    for name in after:
        if name == e.name:
            break
        layer, kind = e.facts.locate(name)
        tensor = e.ref_trace.tensors[name]
        if layer == e.result.layer and not reads_stream(kind) and "norm" not in kind:
            last[name.rpartition(".")[0]] = (name, tensor.double())
    found = [(n, t) for n, t in last.values() if t.shape == e.ref.shape]
    if len(found) < 2 or len(found) != len(last):
        return None
    return " + ".join(n for n, _ in found), sum((t for _, t in found), torch.zeros_like(found[0][1]))


def _stream_before(e: Evidence, branch: str) -> tuple[str, torch.Tensor] | None:
    """The residual stream the branch was added to: the latest point of the stream before the branch
    in the reference's trace (``post_attention_layernorm@input`` for the MLP's add), else the input
    of the layer's first node (the layer's input)."""
    names = list(e.ref_trace.tensors)
    before = names[: names.index(branch)]
    at = e.facts.locate(branch)[0]  # the branch's layer (the previous one for a layer's first norm)
    for name in reversed(before):
        layer, kind = e.facts.locate(name)
        point = _as_node(e, e.ref_trace.tensors[name])
        if layer == at and reads_stream(kind) and point is not None:
            return name, point
    # the input of the last norm before the branch (the pre-norm that read the stream), else of the
    # layer's first node with one (the layer's input)
    for name in [*[n for n in reversed(before) if "norm" in e.facts.locate(n)[1].lower()], *before]:
        x = e.ref_trace.inputs.get(name)
        x = _as_node(e, x) if x is not None else None
        if e.facts.locate(name)[0] == at and x is not None:
            return f"{name}@input", x
    return None


def stream_around(e: Evidence) -> tuple[Evidence, tuple[str, torch.Tensor], tuple[str, torch.Tensor]] | None:
    """At a point of the residual stream after a sub-block (a node reading the stream, or a norm whose
    input is the stream), the evidence read there (a norm's inputs in place of its outputs), the
    reference's branch node added at this point and the stream it was added to, each ``(name, tensor)``;
    None elsewhere."""
    if e.result.layer is None:
        return None
    if not reads_stream(e.kind):
        # a norm reading the stream (a pre-norm after the add): its inputs are the stream's values
        x_ours, x_ref = e.inputs()
        if not is_norm(e.kind) or x_ours is None or x_ref is None or x_ours.shape != x_ref.shape:
            return None
        e = replace(e, ours=x_ours, ref=x_ref)
    if e.ours.shape != e.ref.shape:
        return None
    branch = _branch_output(e)
    stream = _stream_before(e, branch[0]) if branch is not None else None
    if branch is None or stream is None:
        return None
    return e, branch, stream


def residual_add(e: Evidence) -> Hint | None:
    """A point of the residual stream where one side computes ``x + f(x)`` and the other ``f(x)`` alone
    (the residual missing), ``x + 2 f(x)`` (the branch added twice) or ``2 x + f(x)`` (the stream added
    twice): ``f(x)`` is the reference's last branch output before this point (``o_proj``, or the
    post-attention norm of a sandwich block) and ``x`` the stream it is added to. Ours being ``x`` alone
    is left to :func:`~parity.diagnose.wiring.sibling_match`: that is a parallel block (the MLP reading
    the layer's input), another point of the stream."""
    at_norm_input = not reads_stream(e.kind)
    around = stream_around(e)
    if around is None:
        return None
    e, branch, stream = around
    if at_norm_input and e.close(e.ours, e.ref):
        return None
    name, f, x = branch[0], branch[1].double(), stream[1].double()
    tol = max(EXPLAINS, 8 * torch.finfo(e.ref.dtype).eps)
    parallel = _parallel_branches(e, stream[0])
    if parallel is not None and rel(e.ref.double(), x + f) >= tol and rel(e.ref.double(), x + parallel[1]) < tol:
        name, f = parallel  # a parallel block adds every branch to the same stream: x + attn(x) + mlp(x)
    forms = {
        "x + f(x)": x + f,
        "f(x) alone (the residual x not added)": f,
        "x + 2 f(x) (the branch's output added twice)": x + 2 * f,
        "2 x + f(x) (the residual added twice)": 2 * x + f,
    }

    def form_of(t: torch.Tensor) -> str | None:
        return next((label for label, value in forms.items() if rel(t.double(), value) < tol), None)

    ours_is, ref_is = form_of(e.ours), form_of(e.ref)
    if at_norm_input and ref_is != "x + f(x)":  # the reference's own add scales (Granite's residual_multiplier)
        fitted = _coefficients_differ(e, x, f, name, stream[0], tol)
        if fitted is not None or ours_is != "x + f(x)":
            return fitted
        return _branch_elsewhere(e, "the reference", e.ref, x, f, name, stream[0], tol)
    for side, value, other_is in (("ours", e.ours, ref_is), ("the reference", e.ref, ours_is)):
        if other_is == "x + f(x)" and form_of(value) is None:
            keep = f.abs() > 1e-2 * float(f.abs().max())
            c = float(((value.double() - x)[keep] / f[keep]).median()) if bool(keep.any()) else 1.0
            # c near 0 is x alone (the branch not added: a parallel block, sibling_match's case)
            if abs(c - 1) > 1e-3 and abs(c) > 1e-3 and rel(value.double(), x + c * f) < tol:
                return Hint(
                    "residual",
                    f"likely the branch scaled before the residual add in {side}: it adds {c:.6g} * f(x), f(x) = {name}, "
                    f"to x = {stream[0]}{constant_named(e, c)} (a depth or branch scale one side applies: MiniCPM's "
                    "scale_depth / sqrt(num_layers))",
                    {"side": side, "branch": name, "stream": stream[0], "branch_scale": c},
                )
            keep = f.abs() > 1e-3 * float(f.abs().max())
            rate = dropout_pattern(((value.double() - x)[keep] / f[keep]).flatten())
            if rate is not None:
                return dropout_left_on(side, rate[0], rate[1], f"the branch {name}, before the residual add")
            elsewhere = _branch_elsewhere(e, side, value, x, f, name, stream[0], tol)
            if elsewhere is not None:
                return elsewhere
            source = _added_to(e, value.double() - f, stream[0], tol)
            if source is not None:
                return Hint(
                    "residual",
                    f"likely the residual connection in {side}: it adds f(x) = {name} to the reference's {source} "
                    f"instead of the stream x = {stream[0]} (the residual taken from another point, e.g. the normed "
                    "input)",
                    {"side": side, "branch": name, "stream": stream[0], "added_to": source},
                )
    if ours_is is None and ref_is == "x + f(x)":
        scaled = _stream_scaled(e, e.ours.double() - f, x, stream[0], tol)
        return scaled if scaled is not None else _coefficients_differ(e, x, f, name, stream[0], tol)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return _coefficients_differ(e, x, f, name, stream[0], tol)
    side = "ours" if ref_is == "x + f(x)" else "the reference"
    alone = ours_is if side == "ours" else ref_is
    also = (
        f" (or this norm moved onto the branch: {side} normalises {name}'s output before the residual add, a "
        "sandwich post-norm as Gemma 2's post_attention_layernorm, where the other normalises the stream after it)"
        if at_norm_input and alone.startswith("f(x) alone")
        else ""
    )
    return Hint(
        "residual",
        f"likely the residual connection in {side}: ours' {e.kind} is {ours_is}, the reference's {ref_is}, with "
        f"f(x) = {name} and x = {stream[0]}{also}",
        {"ours": ours_is, "reference": ref_is, "branch": name, "stream": stream[0], "side": side},
    )


def coefficients(value: torch.Tensor, x: torch.Tensor, f: torch.Tensor, tol: float) -> tuple[float, float] | None:
    """``(a, b)`` when ``value`` is ``a x + b f`` (least squares, exact within ``tol``), else None."""
    design = torch.stack([x.flatten(), f.flatten()], 1)
    solution = torch.linalg.lstsq(design, value.double().flatten()[:, None]).solution.flatten()
    a, b = float(solution[0]), float(solution[1])
    return (a, b) if rel(value.double(), a * x + b * f) < tol else None


def _coefficients_differ(e: Evidence, x: torch.Tensor, f: torch.Tensor, branch: str, stream: str, tol: float):
    """Both sides add the branch ``f`` to the stream ``x`` as ``a x + b f`` with other coefficients: a
    residual multiplier (Granite's, MiniCPM's depth scale) applied to the other term, taken from
    another field of the config, applied to the sum, or rounded to a lower precision; each coefficient
    named by the config constant it equals."""
    # x: the stream point, else the stream's normalised value (MiniMax adds its branch to the normed input)
    normed = _normed_stream(e, stream)
    points = [(stream, x), *([normed] if normed is not None else [])]

    def fitted(value: torch.Tensor) -> tuple[str, torch.Tensor, tuple[float, float]] | None:
        return next(((at, p, c) for at, p in points if (c := coefficients(value, p, f, tol)) is not None), None)

    ours_fit, ref_fit = fitted(e.ours), fitted(e.ref)
    if ours_fit is not None and ref_fit is not None and ours_fit[0] != ref_fit[0]:
        text = "; ".join(
            f"{side} {c[0]:.7g} x + {c[1]:.7g} f(x) with x = {at}"
            for side, (at, _, c) in (("ours", ours_fit), ("the reference", ref_fit))
        )
        return Hint(
            "residual",
            f"likely the residual connection: the two sides add f(x) = {branch} to another x ({text}): the "
            f"residual taken from the normalised input ({cast(tuple, normed)[0]}'s output, MiniMax's) on one side, "
            "from the stream itself on the other",
            {"ours": ours_fit[0], "reference": ref_fit[0], "branch": branch},
        )
    if ours_fit is None or ref_fit is None:
        on_stream = any(fit is not None and fit[0] == stream for fit in (ours_fit, ref_fit))
        return None if on_stream else _branch_coefficients_differ(e, x, stream, tol)
    (stream, x, ours), ref = ours_fit, ref_fit[2]
    if max(abs(o - r) / max(abs(r), 1e-12) for o, r in zip(ours, ref)) < 1e-6:
        return None
    if min(abs(c) for c in (*ours, *ref)) < 1e-3:
        return None  # a term missing (x alone: a parallel block, f alone): the wiring detectors' cases
    if abs(ours[0] / ref[0] - ours[1] / ref[1]) < 1e-6 * abs(ours[1] / ref[1]):
        return None  # the whole sum scaled (a layer scalar): one ratio everywhere, the scale detectors' case

    def form(c: tuple[float, float]) -> str:
        return f"{c[0]:.7g} x + {c[1]:.7g} f(x)"

    named = [
        f"{which} {o:.7g}{constant_words(e, o)} in ours, {r:.7g}{constant_words(e, r)} in the reference"
        for which, o, r in (("x's coefficient", ours[0], ref[0]), ("f(x)'s coefficient", ours[1], ref[1]))
        if abs(o - r) > 1e-6 * max(abs(r), 1e-12)
    ]
    return Hint(
        "residual",
        f"likely the residual add's multiplier: ours computes {form(ours)}, the reference {form(ref)}, with f(x) = "
        f"{branch} and x = {stream} ({'; '.join(named)})",
        {"ours": list(ours), "reference": list(ref), "branch": branch, "stream": stream},
    )


def _normed_stream(e: Evidence, stream: str) -> tuple[str, torch.Tensor] | None:
    """The reference's first norm node of the failing node's layer after the stream point ``stream``, in the
    stream's shape: the normalised stream its sub-block reads (``input_layernorm``), ``(name, tensor)``."""
    names = list(e.ref_trace.tensors)
    begin = stream.partition("@")[0]
    after = names[names.index(begin) :] if begin in names else names
    for name in after:
        if name == e.name:
            break
        layer, kind = e.facts.locate(name)
        shaped = _as_node(e, e.ref_trace.tensors[name])
        if layer == e.result.layer and is_norm(kind) and shaped is not None and not reads_stream(kind):
            return name, shaped.double()
    return None


def _sub_block_outputs(e: Evidence, stream: str) -> list[tuple[str, torch.Tensor]]:
    """Each sub-block's last output of the stream's shape in the failing node's layer after the stream point
    ``stream``, in order: what that layer's add sums (a MoE block's routed experts and its shared MLP beside
    them, GraniteMoeShared's ``block_sparse_moe`` and ``shared_mlp``)."""
    names = list(e.ref_trace.tensors)
    begin = stream.partition("@")[0]
    after = names[names.index(begin) + 1 :] if begin in names else []
    prefix = f"{e.facts.layer_path(e.result.layer)}." if e.result.layer is not None else "\0"  # (no layer: none)
    last: dict[str, tuple[str, torch.Tensor]] = {}
    for name in after:
        if name == e.name:
            break
        layer, kind = e.facts.locate(name)
        shaped = _as_node(e, e.ref_trace.tensors[name])
        if layer != e.result.layer or not name.startswith(prefix) or reads_stream(kind) or shaped is None:
            continue
        if "norm" not in kind:  # a sub-block's norm is no branch output
            last[name[len(prefix) :].split(".")[0]] = (name, shaped.double())
    return list(last.values())


def _branch_coefficients_differ(e: Evidence, x: torch.Tensor, stream: str, tol: float) -> Hint | None:
    """Both sides add two or more branches to the stream ``x`` as ``a x + b1 f1 + b2 f2 ...`` (least squares,
    exact within ``tol``) with other coefficients: a residual multiplier applied to some of the branches only
    (GraniteMoeShared's shared MLP added outside ``residual_multiplier``), each coefficient named by the config
    constant it equals."""
    branches = _sub_block_outputs(e, stream)
    if len(branches) < 2:
        return None
    design = torch.stack([x.flatten(), *(f.flatten() for _, f in branches)], 1)

    def fit(value: torch.Tensor) -> list[float] | None:
        solution = torch.linalg.lstsq(design, value.double().flatten()[:, None]).solution.flatten()
        exact = rel(value.double().flatten(), design @ solution) < tol
        return [float(c) for c in solution] if exact else None

    ours, ref = fit(e.ours), fit(e.ref)
    if ours is None or ref is None:
        return None
    terms = ["x", *(f"f{i + 1}" for i in range(len(branches)))]
    differ = [i for i, (o, r) in enumerate(zip(ours, ref)) if abs(o - r) > 1e-6 * max(abs(r), 1e-12)]
    if not differ or min(abs(c) for c in (*ours, *ref)) < 1e-3:
        return None  # a term missing: the wiring detectors' cases

    def form(c: list[float]) -> str:
        return " + ".join(f"{v:.7g} {t}" for v, t in zip(c, terms))

    named = [
        f"{terms[i]}'s coefficient {ours[i]:.7g}{constant_words(e, ours[i])} in ours, "
        f"{ref[i]:.7g}{constant_words(e, ref[i])} in the reference"
        for i in differ
    ]
    where = ", ".join(f"f{i + 1} = {name}" for i, (name, _) in enumerate(branches))
    return Hint(
        "residual",
        f"likely the residual add's multiplier: ours computes {form(ours)}, the reference {form(ref)}, with {where} "
        f"and x = {stream} ({'; '.join(named)}): a multiplier applied to some branches only, or to another set",
        {"ours": ours, "reference": ref, "branches": [n for n, _ in branches], "stream": stream},
    )


def constant_words(e: Evidence, c: float) -> str:
    """`` (= the config's residual_multiplier (0.22))`` (or that constant rounded to float16 or bfloat16,
    or its inverse, or 1) when ``c`` is one, else ``""``."""
    if abs(c - 1) < 1e-9:
        return " (= 1, no multiplier)"
    constants = {(k if k.endswith(")") else f"{k} ({v:g})"): v for k, v in e.facts.named_constants().items() if v}
    direct = next((label for label, value in constants.items() if abs(c / value - 1) < 1e-9), None)
    if direct is not None:  # a constant itself before any inverse (0.8: a beta factor, not 1 / an alpha of 1.25)
        return f" (= {direct})"
    for label, value in constants.items():
        if abs(c * value - 1) < 1e-9:
            return f" (= 1 / {label})"
        for dtype in (torch.float16, torch.bfloat16):
            rounded = float(torch.tensor(value, dtype=dtype))
            if rounded != value and abs(c / rounded - 1) < 1e-9:
                return f" (= {label} rounded to {str(dtype).removeprefix('torch.')})"
    return ""


def _branch_elsewhere(
    e: Evidence, side: str, value: torch.Tensor, x: torch.Tensor, f: torch.Tensor, name: str, stream: str, tol: float
) -> Hint | None:
    """``side``'s stream point is ``x + f(x) + g`` with ``g`` another node of the layer before it (LongCat's
    shortcut MoE added after the first sublayer, not at the end): that branch added at another point."""
    extra = _added_to(e, value.double() - x - f, stream, tol)
    if extra is None or extra == name:
        return None
    return Hint(
        "residual",
        f"likely a branch added at another point of the stream in {side}: it computes x + f(x) + g with g = the "
        f"reference's {extra}, f(x) = {name} and x = {stream}: {extra} added here, where the other side adds it "
        "elsewhere (earlier or later in the layer)",
        {"side": side, "branch": name, "stream": stream, "extra": extra},
    )


def _added_to(e: Evidence, value: torch.Tensor, stream: str, tol: float) -> str | None:
    """The reference value of the failing node's layer, produced before it, that ``value`` equals (the
    point a branch was added to), other than the stream itself: a node, or a module's input (the
    layer's input: a residual taken from before the attention)."""
    for name, tensor in layer_values(e, before=True):
        shaped = _as_node(e, tensor)  # a MoE block's output over the tokens flattened: (tokens, hidden)
        if shaped is not None and shaped.shape == value.shape and name != stream and rel(value, shaped.double()) < tol:
            return name
    return None


def _stream_scaled(e: Evidence, ours_x: torch.Tensor, x: torch.Tensor, where: str, tol: float) -> Hint | None:
    """Ours' stream before the branch's add is the reference's times one constant (the embedding scaled
    in ours' forward, outside any module, a norm before hiding it up to its eps)."""
    keep = x.abs() > 1e-3 * float(x.abs().max())
    if not bool(keep.any()):
        return None
    ratio = float((ours_x[keep] / x[keep]).median())
    if abs(ratio - 1) < 1e-3 or rel(ours_x, ratio * x) > tol:
        return None
    return Hint(
        "scale",
        f"likely a missing or extra scale on the residual stream: ours' stream at {where} (before this add) is the "
        f"reference's times {ratio:.6g}{constant_named(e, ratio)} (a scale applied outside any module, on one side only)",
        {"ratio": ratio, "where": where},
    )


def input_scale(e: Evidence) -> Hint | None:
    """Ours' module input is the reference's times one constant (an embedding scaled by sqrt(hidden)
    in ours only, or not at all): named where it enters, with the named constant it matches."""
    x_ours, x_ref = e.inputs()
    if x_ref is None or x_ours is None or x_ref.shape != x_ours.shape or e.close(x_ours, x_ref):
        return None
    a, b = x_ours.double(), x_ref.double()
    keep = b.abs() > 1e-3 * float(b.abs().max())
    if not bool(keep.any()):
        return None
    ratio = float((a[keep] / b[keep]).median())
    if abs(ratio - 1) < 1e-3 or rel(a, ratio * b) > max(EXPLAINS, 8 * torch.finfo(x_ref.dtype).eps):
        return None
    match = constant_named(e, ratio)
    return Hint(
        "scale",
        f"likely a missing or extra scale before {e.kind}: ours' input to it is the reference's times {ratio:.6g} at "
        f"every position{match} (a scale applied to the stream on one side only)",
        {"ratio": ratio, "where": "input"},
    )


def input_terms(e: Evidence) -> Hint | None:
    """Ours' module input and the reference's are both sums of the same earlier reference nodes with
    other weights: the token embedding scaled before the learned positions are added (fairseq's
    ``embed_scale`` kept in an OPT port: ``8 * embed_tokens + embed_positions``), a branch added twice or
    halved. Each side's input is fitted as a linear combination of the nodes it can have summed (the
    embeddings before the first layer, the stream entering the layer and the layer's earlier nodes);
    named when both fits are exact and one term's weight differs, either side."""
    x_ours, x_ref = e.inputs()
    if x_ref is None or x_ours is None or x_ref.shape != x_ours.shape or e.close(x_ours, x_ref):
        return None
    if not x_ref.is_floating_point() or x_ref.numel() < 64:
        return None
    layer = e.result.layer
    candidates: list[tuple[str, torch.Tensor]] = []
    # the first node of a layer reads the previous layer's sum: its branches and the stream entering it
    first = next((n for n in e.ref_trace.tensors if e.facts.locate(n)[0] == layer), None) == e.name
    layers = (None, layer, layer - 1) if first and layer else (None, layer)
    for name, tensor in e.ref_trace.tensors.items():
        if name == e.name:
            break
        if first and layer and name == e.facts.layer_path(layer - 1):
            continue  # the previous layer's output is the sum itself: its terms are what is read
        if (
            e.facts.locate(name)[0] in layers
            and tensor.is_floating_point()
            and tensor.numel() == x_ref.numel()
            and tensor.shape[-1:] == x_ref.shape[-1:]
        ):
            candidates.append((name, tensor))
    # (for a layer's first node that stream is the previous layer's sum, read as its terms instead)
    stream = residual_into(e, layer) if layer is not None and not (first and layer) else None
    if stream is not None and stream.numel() == x_ref.numel():  # last: a node it equals keeps its own name
        candidates.append(("the stream entering the layer", stream))
    # the stream entering the previous layer: its first node's input as the reference held it
    opening = next((n for n in e.ref_trace.tensors if e.facts.locate(n)[0] == layer - 1), None) if layer else None
    before = e.ref_trace.inputs.get(opening) if first and opening is not None else None
    if before is not None and before.numel() == x_ref.numel():
        candidates.append(("the stream entering the previous layer", before))
    columns: list[torch.Tensor] = []
    names: list[str] = []
    for name, tensor in candidates:  # independent columns only, in the order the reference produced them
        column = tensor.double().flatten()
        trial = torch.stack([*columns, column], dim=1)
        if int(torch.linalg.matrix_rank(trial)) == trial.shape[1]:
            columns.append(column)
            names.append(name)
    if len(columns) < 2:
        return None
    basis = torch.stack(columns, dim=1)

    def fit(x: torch.Tensor) -> torch.Tensor | None:
        y = x.double().flatten()
        weights = torch.linalg.lstsq(basis, y.unsqueeze(1)).solution.flatten()
        exact = max(1e-6, 8 * torch.finfo(x_ref.dtype).eps)
        return weights if rel(basis @ weights, y) < exact else None

    w_ours, w_ref = fit(x_ours), fit(x_ref)
    if w_ours is None or w_ref is None:
        return None
    w_ours = torch.where(w_ours.abs() < 1e-6, torch.zeros_like(w_ours), w_ours)
    w_ref = torch.where(w_ref.abs() < 1e-6, torch.zeros_like(w_ref), w_ref)
    differ = [i for i in range(len(names)) if abs(float(w_ours[i] - w_ref[i])) > 1e-3 * max(1.0, abs(float(w_ref[i])))]
    used = [i for i in range(len(names)) if w_ours[i] != 0 or w_ref[i] != 0]
    if not differ or len(used) < 2 or len(differ) == len(used):
        return None  # one scale on every term is input_scale's reading
    if any(w_ours[i] == 0 or w_ref[i] == 0 for i in used):
        left = [i for i in differ if (w_ours[i] == 0) != (w_ref[i] == 0)]
        # read only at a layer's first node, whose input is the previous layer's sum of branches
        if first and layer and len(differ) == 1 and left and abs(float(w_ours[left[0]] + w_ref[left[0]]) - 1) < 1e-3:
            i = left[0]
            side = "ours" if w_ours[i] == 0 else "the reference"
            return Hint(
                "residual",
                f"likely a branch left out of the residual sum in {side}: {e.kind}'s input is "
                f"{terms_of(w_ours, used, names)} in ours, {terms_of(w_ref, used, names)} in the reference "
                f"({names[i]} missing in {side}: a residual variable not refreshed after that branch was added)",
                {"term": names[i], "side": side},
            )
        terms = _TermFit(w_ours, w_ref, differ, left, used, names)
        elsewhere = _residual_elsewhere(e, terms) or _stream_before_norm(e, terms)
        if elsewhere is not None:
            return elsewhere
        return None  # a term one side leaves out: another point of the stream (the wiring detectors' reading)

    i = differ[0]
    ratio = float(w_ours[i] / w_ref[i])
    match = constant_named(e, ratio)
    what = f"weighted {ratio:.6g}x in ours{match}"
    return Hint(
        "scale",
        f"likely a term of {e.kind}'s input scaled on one side: ours' input is {terms_of(w_ours, used, names)}, the "
        f"reference's {terms_of(w_ref, used, names)} ({names[i]} {what}; the other terms agree)",
        {"term": names[i], "ours": [float(w_ours[j]) for j in used], "reference": [float(w_ref[j]) for j in used]},
    )


class _TermFit(NamedTuple):
    """:func:`input_terms`' fit of both sides' inputs: each term's weight on each side, the terms whose weights
    differ, those one side alone holds, those either side holds, and every term's name."""

    w_ours: torch.Tensor
    w_ref: torch.Tensor
    differ: list[int]
    left: list[int]
    used: list[int]
    names: list[str]


def _residual_elsewhere(e: Evidence, fit: _TermFit) -> Hint | None:
    """Every differing term one side's alone, one side holding a single one where the other holds one or more, all
    of one weight: a skip connection reading another point of the stream (the layer's input kept where the
    attention block's output was meant, a norm's output where its input was: one value in place of a sum of
    terms), either side. Hint ``residual``; None otherwise."""
    w_ours, w_ref, differ, left, used, names = fit
    if set(differ) != set(left):
        return None
    around = residual_around_norm(e)  # one value a norm's input where the other side reads its output: named so
    if around is not None:
        return around
    only_ours = [i for i in left if w_ref[i] == 0]
    only_ref = [i for i in left if w_ours[i] == 0]
    weights = [float(w_ours[i]) for i in only_ours] + [float(w_ref[i]) for i in only_ref]
    if not only_ours or not only_ref or max(weights) - min(weights) > 1e-3 * max(1.0, abs(weights[0])):
        return None
    if len(only_ours) != 1 and len(only_ref) != 1:
        return None
    ours_sum = " + ".join(names[i] for i in only_ours)
    ref_sum = " + ".join(names[i] for i in only_ref)
    return Hint(
        "residual",
        f"likely the residual taken from another point of the stream: {e.kind}'s input is "
        f"{terms_of(w_ours, used, names)} in ours, {terms_of(w_ref, used, names)} in the reference ({ours_sum} in "
        f"ours where the reference adds {ref_sum}: the skip connection reads another variable, the layer's input "
        "kept where the sub-block's output was meant, a norm's output where its input was, or the reverse)",
        {"ours": [names[i] for i in only_ours], "reference": [names[i] for i in only_ref]},
    )


def _stream_before_norm(e: Evidence, fit: _TermFit) -> Hint | None:
    """A norm whose input on one side is the other side's plus the residual stream (the layer's input and the
    branches added to it so far, each weight 1): that side adds the residual before the norm, which then
    normalises the stream with the block's output (A.X-K1's ``post_mlp_layernorm`` moved past the residual add),
    either side. Hint ``norm_placement``; None otherwise."""
    w_ours, w_ref, differ, left, used, names = fit
    if not is_norm(e.kind) or set(differ) != set(left):
        return None
    for side, extra, other in (("ours", w_ours, w_ref), ("the reference", w_ref, w_ours)):
        added = [i for i in left if other[i] == 0]
        if len(added) != len(left) or any(abs(float(extra[i]) - 1) > 1e-3 for i in added):
            continue
        if not any(names[i].startswith("the stream entering") for i in added):
            continue  # the terms added are no stream (a lookup left out beside others): the wiring detectors' reading
        return Hint(
            "norm_placement",
            f"likely the residual added before {e.kind} in {side}: its input there is {terms_of(extra, used, names)}, "
            f"on the other side {terms_of(other, used, names)} ({' + '.join(names[i] for i in added)} added in "
            f"{side}: the stream summed with the block's output before the norm, which the other side applies to the "
            "block's output alone, adding the residual after it)",
            {"side": side, "added": [names[i] for i in added]},
        )
    return None


def residual_around_norm(e: Evidence) -> Hint | None:
    """Ours' module input differs from the reference's by an earlier norm's input less its output, in this layer:
    one side adds the stream from before that norm where the other adds the norm's output (a post-norm block, GPT-1's
    and BERT's ``ln_2(ln_1(x + attn) + mlp)``, whose residual is the normed sum; or a pre-norm stream read after the
    norm). Either side."""
    x_ours, x_ref = e.inputs()
    if x_ref is None or x_ours is None or x_ref.shape != x_ours.shape or e.close(x_ours, x_ref):
        return None
    layer = e.result.layer
    diff = x_ours.double() - x_ref.double()
    for name, out in e.ref_trace.tensors.items():
        if name == e.name:
            break
        norm_in = e.ref_trace.inputs.get(name)
        at, kind = e.facts.locate(name)
        if at != layer or not is_norm(kind or "") or norm_in is None:
            continue
        if out.shape != x_ref.shape or norm_in.shape != x_ref.shape or e.close(x_ref, out) or e.close(x_ours, out):
            continue  # (a node reading the norm's output itself: a projection's input, not a residual sum)
        step = norm_in.double() - out.double()  # what adding the norm's input in place of its output adds
        for side, sign in (("ours", 1.0), ("the reference", -1.0)):
            if rel(sign * diff, step) < 1e-5:
                short = name.rsplit(".", 1)[-1]
                return Hint(
                    "residual",
                    f"likely the residual taken around {short} in {side}: {whose(side)} {e.kind} input adds {short}'s "
                    f"input (the stream before the norm) where the other side adds {short}'s output (a post-norm "
                    "block's residual is the normed sum: ln_2(ln_1(x + attn) + mlp))",
                    {"side": side, "norm": name},
                )
    return None


def terms_of(w: torch.Tensor, used: list[int], names: list[str]) -> str:
    """A fitted sum as ``1 x out_proj + 1 x fc2``, its nonzero terms only."""
    return " + ".join(f"{float(w[i]):.4g} x {names[i].rsplit('.', 1)[-1]}" for i in used if w[i] != 0) or "0"


def input_source(e: Evidence) -> Hint | None:
    """A norm that reads another value in ours than in the reference: another reference node of its
    layer (a point of the residual stream, a sub-layer's output), ours' own output of a node the
    reference computes after the norm (ours normalises the sub-layer's output: a post-norm where the
    reference has a pre-norm), or the reference's input plus the stream before the sub-layer (ours
    normalises after the residual add)."""
    if not is_norm(e.kind) or e.result.layer is None:
        return None
    x_ours, x_ref = e.inputs()
    if x_ref is None or x_ours is None or x_ours.shape != x_ref.shape or e.close(x_ours, x_ref):
        return None
    in_layer = [
        (name, tensor)
        for name, tensor in e.ref_trace.tensors.items()
        if name != e.name and tensor.shape == x_ours.shape and e.facts.locate(name)[0] == e.result.layer
    ]
    for name, tensor in in_layer:
        if e.close(x_ours, tensor):
            return _placement(e, f"the reference's {name}", name)
    names = list(e.ref_trace.tensors)
    later = names[names.index(e.name) + 1 :] if e.name in names else []
    for name in later:
        ours_value = e.ours_trace.tensors.get(name)
        if ours_value is None or ours_value.shape != x_ours.shape or e.facts.locate(name)[0] != e.result.layer:
            continue
        if e.close(x_ours, ours_value):
            return _placement(
                e, f"ours' own {name} (computed after it in the reference: ours' norm follows that sub-layer)", name
            )
    before = names[: names.index(e.name)] if e.name in names else []
    streams = [(n, e.ref_trace.tensors[n]) for n in before if reads_stream(e.facts.locate(n)[1])]
    streams += [(f"{n}@input", e.ref_trace.inputs[n]) for n in before if n in e.ref_trace.inputs]
    for name, tensor in streams:
        in_layer_stream = tensor.shape == x_ours.shape and e.facts.locate(name)[0] == e.result.layer
        if in_layer_stream and e.close(x_ours, tensor + x_ref):
            return _placement(e, f"the sum after the residual add (its reference input plus {name})", name)
        if not in_layer_stream:
            continue
        # the branch scaled before the add (a residual multiplier): the same placement, on either side; each side's
        # input is a combination of the stream and the other's, the sum's the one of two positive weights
        fits = [
            (side, weights)
            for side, this, other in (("ours", x_ours, x_ref), ("the reference", x_ref, x_ours))
            if (weights := _sum_of(this, tensor, other)) is not None and min(weights) > 0
        ]
        if len(fits) == 1:
            side, (a, b) = fits[0]
            whose, twin = ("ours'", "the reference") if side == "ours" else ("the reference's", "ours")
            return Hint(
                "norm_placement",
                f"likely norm placement: {whose} {e.kind} normalises the sum after the residual add ({a:.6g} x "
                f"{name} + {b:.6g} x {twin}'s input to it); {twin}'s normalises the sub-layer's output before the add",
                {"side": side, "reads": name, "stream": a, "branch": b},
            )
    return _branch_added(e, x_ours, x_ref, before, later)


def _branch_added(
    e: Evidence, x_ours: torch.Tensor, x_ref: torch.Tensor, before: list[str], later: list[str]
) -> Hint | None:
    """The norm's input on one side is the other's plus one node of the previous layer (a branch added to the
    residual stream as well: Zamba's transformer output, which the reference feeds to the Mamba layer's
    input alone, added to the stream too), or plus one node of its own layer both sides computed (a term of
    the sum it normalises added after it: Kolibri's shared expert added after the post-MoE norm): named with
    the node and the side holding the extra term. ``before`` and ``later``: the reference's nodes before and
    after the norm (a branch the reference adds after it runs later there)."""
    layer = e.result.layer
    assert layer is not None  # input_source's caller checked it
    diff = (x_ours.double() - x_ref.double()).flatten()
    for name in [*reversed(before), *(n for n in later if e.facts.locate(n)[0] == layer)]:
        at = e.facts.locate(name)[0]
        tensor = e.ref_trace.tensors.get(name)
        if at not in (layer - 1, layer) or tensor is None or tensor.shape != x_ours.shape:
            continue
        if at == layer and not _computed_in_ours(e, name):
            continue  # a branch of this layer ours never computed is a block layout: its own detectors
        t = tensor.double().flatten()
        norm = float(t @ t)
        if norm == 0:
            continue
        c = float(diff @ t) / norm
        if abs(c) < 1e-3 or not e.close((x_ref.double() + c * tensor.double()).to(x_ours.dtype), x_ours):
            continue
        if c < 0 and not _computed_in_ours(e, name):
            return None  # a branch ours never computed: a module missing in ours (the never-read hints' case)
        side, other = ("ours", "the reference") if c > 0 else ("the reference", "ours")
        own = {"ours": "ours'", "the reference": "the reference's"}
        times = "" if abs(abs(c) - 1) < 1e-6 else f"{abs(c):.6g} x "
        if at == layer and _stream_point(e, x_ref if c > 0 else x_ours, before):
            return None  # the side without the term reads the stream itself (a stale residual): the block's layout
        if at == layer:
            return Hint(
                "residual",
                f"likely a term of the sum {e.kind} normalises: {own[side]} input to it is {own[other]} plus "
                f"{times}{name}, which {other} adds after the norm or not at all (that branch's output left out "
                "of what the norm reads)",
                {"side": side, "added": name, "factor": abs(c), "same_layer": True},
            )
        return Hint(
            "residual",
            f"likely the residual stream: {own[side]} input to {e.kind} is {own[other]} plus {times}{name} (a branch's "
            f"output added to the stream as well, where {other} feeds it on without adding it)",
            {"side": side, "added": name, "factor": abs(c)},
        )
    return None


def _stream_point(e: Evidence, x: torch.Tensor, before: list[str]) -> bool:
    """Whether ``x`` is the residual stream at a point the reference recorded before the norm (a norm's input
    of this layer or the one before, a stream node)."""
    points = [e.ref_trace.inputs.get(n) for n in before if is_norm(e.facts.locate(n)[1])]
    points += [e.ref_trace.tensors.get(n) for n in before if reads_stream(e.facts.locate(n)[1])]
    return any(p is not None and p.shape == x.shape and e.close(x, p) for p in points)


def _computed_in_ours(e: Evidence, name: str) -> bool:
    """Whether ours produced the node (kept, or called and dropped once compared)."""
    return name in e.ours_trace.tensors or bool(e.ours_trace.calls.get(name))


def _sum_of(x: torch.Tensor, stream: torch.Tensor, branch: torch.Tensor) -> tuple[float, float] | None:
    """``(a, b)`` when ``x`` is ``a * stream + b * branch`` exactly (both weights nonzero; the rounding of one
    sum allowed), else None."""
    basis = torch.stack([stream.double().flatten(), branch.double().flatten()], dim=1)
    y = x.double().flatten()
    if int(torch.linalg.matrix_rank(basis)) < 2:
        return None
    a, b = (float(w) for w in torch.linalg.lstsq(basis, y.unsqueeze(1)).solution.flatten())
    exact = max(1e-6, 8 * torch.finfo(x.dtype).eps)
    if min(abs(a), abs(b)) < 1e-6 or rel(basis @ torch.tensor([a, b], dtype=torch.float64), y) >= exact:
        return None
    return a, b


def _placement(e: Evidence, what: str, name: str) -> Hint:
    return Hint(
        "norm_placement",
        f"likely norm placement: ours' {e.kind} normalises {what}; the reference's normalises the value "
        "before its sub-layer or before the residual add (pre-norm vs post-norm, or a norm after the add)",
        {"ours_reads": name},
    )


def _weightless_norm(
    e: Evidence, x_ours: torch.Tensor, x_ref: torch.Tensor, stream: torch.Tensor | None
) -> Hint | None:
    """A projection reading the layer's stream through a norm without weights (OLMo's non-parametric
    LayerNorm: no module, no node of its own), computed another way on one side: each side's input read
    as the stream normalised by each statistic a port may use, or as the norm's own statistic of another
    stream (the residual after attention built on the normed input instead of the stream: ``h = norm(x);
    x = h + attn(h)``)."""
    if stream is None or stream.shape != x_ref.shape or e.facts.norm_kind not in ("layernorm", "rmsnorm"):
        return None
    eps, centred = e.facts.norm_eps or 0.0, e.facts.norm_kind == "layernorm"
    statistics = norm_statistics(stream, eps, centred)
    ways = {f"the layer's stream normalised by {label}": t for label, t in statistics.items()}
    streams = dict.fromkeys(ways, "the layer's stream")
    own = "LayerNorm ((x - mean) / sqrt(var + eps))" if centred else "RMSNorm (x / sqrt(mean(x^2) + eps))"
    values = [(n, t) for n, t in layer_values(e, before=True) if t.shape == stream.shape and t.is_floating_point()]
    earlier = [(n, t) for n, t in values if "@" not in n]
    # the normed stream: a norm's node, or (a weightless norm has none) the first projection's input
    normed = [(f"{n}'s output", t) for n, t in earlier if "norm" in n.rsplit(".", 1)[-1].lower()]
    normed += [(f"{n.partition('@')[0]}'s input (the normed stream)", t) for n, t in values if "@" in n][:1]
    for branch, b in earlier:  # the stream after a sub-block: a base plus its output
        bases = [("the stream entering the layer", stream)] + normed
        for base, t in bases:
            label = f"({base} + {branch.rsplit('.', 1)[-1]}) normalised by {own}"
            ways[label] = norm_statistics(t.double() + b.double(), eps, centred)[own]
            streams[label] = f"{base} + {branch}"
    ours_is, ref_is = forms_of(e, ways, x_ours, x_ref)
    if ours_is is None or ref_is is None or ours_is == ref_is:
        return None
    residual = streams[ours_is] != streams[ref_is]
    layer_input = [side for side, form in (("ours", ours_is), ("the reference", ref_is)) if "+" not in streams[form]]
    if residual and len(layer_input) == 1 and own in ours_is and own in ref_is:
        # one side's sub-block reads the layer's input where the other's reads the stream after attention
        side = layer_input[0]
        other = "the reference" if side == "ours" else "ours"
        return Hint(
            "block_layout",
            f"likely the block layout: {whose(side)} {e.kind} reads the layer's input through the norm (a parallel "
            f"block: x + attn(N(x)) + mlp(N(x))), {whose(other)} the stream after the attention (sequential); a norm without "
            "weights, so no node of its own",
            {"parallel": side, "ours": ours_is, "reference": ref_is},
        )
    what = "the residual stream it normalises" if residual else "the statistic of the norm"
    return Hint(
        "norm_kind" if not residual else "residual",
        f"likely {what} before {e.kind} (a norm without weights, so no node of its own): ours' input to {e.kind} is "
        f"{ours_is}, the reference's {ref_is}",
        {"ours": ours_is, "reference": ref_is},
    )


def projection_source(e: Evidence) -> Hint | None:
    """A projection whose input in ours is another value the reference computed in this layer (the MLP
    reading the normalised attention branch instead of the residual stream), either side."""
    if e.result.layer is None or is_norm(e.kind) or reads_stream(e.kind):
        return None
    x_ours, x_ref = e.inputs()
    if x_ref is None or x_ours is None or x_ours.shape != x_ref.shape or e.close(x_ours, x_ref):
        return None
    values = layer_values(e)
    stream = residual_into(e, e.result.layer)  # the un-normed stream entering the layer (ours skipped its norm)
    if stream is not None:
        values.append(("residual stream entering the layer (before its norm)", stream))
    weightless = _weightless_norm(e, x_ours, x_ref, stream)
    if weightless is not None:
        return weightless
    width = x_ours.shape[-1]
    for name, tensor in list(values):  # a fused output's parts (Mamba's in_proj: [x | z]): its x before the conv
        if (
            tensor.dim() == x_ours.dim()
            and tensor.shape[:-1] == x_ours.shape[:-1]
            and tensor.shape[-1] in (2 * width, 3 * width)
        ):
            values += [
                (f"{name}[{a}:{a + width}]", tensor[..., a : a + width]) for a in range(0, tensor.shape[-1], width)
            ]
    for name, tensor in values:
        if name.partition("@")[0] == e.name or tensor.numel() != x_ours.numel():
            continue
        if e.close(x_ours.reshape(tensor.shape), tensor):  # a router reads the tokens flattened: (tokens, hidden)
            from parity.diagnose.elementwise import activations

            act = next(
                (label for label, fn in activations().items() if e.close(x_ref.reshape(tensor.shape), fn(tensor))),
                None,
            )
            skipped = next(
                (
                    n
                    for n, t in e.ref_trace.tensors.items()
                    if "@" not in n
                    and is_norm(n.rsplit(".", 1)[-1])
                    and t.numel() == x_ref.numel()
                    and e.close(t.reshape(x_ref.shape), x_ref)  # a router reads the tokens flattened
                    and (held := e.ref_trace.inputs.get(n)) is not None
                    and held.numel() == tensor.numel()
                    and e.close(held.reshape(tensor.shape), tensor)
                ),
                None,
            )
            if skipped is not None:  # the reference reads that value through a norm ours skips
                return Hint(
                    "projection_input",
                    f"likely {skipped} skipped in ours: {e.kind} reads the reference's {name} as it is, the "
                    f"reference's {e.kind} reads it through {skipped.rsplit('.', 1)[-1]}",
                    {"projection": e.name, "ours_input": name, "skipped": skipped, "side": "ours"},
                )
            if act is not None:  # the reference reads that value through an activation ours skips here
                return Hint(
                    "activation",
                    f"likely the activation skipped before {e.kind} in ours: its input is the reference's {name} as it "
                    f"is, the reference's {e.kind} reads {act} of it (the activation applied elsewhere in ours, after "
                    f"{e.kind}, or not at all)",
                    {"projection": e.name, "ours_input": name, "activation": act, "side": "ours"},
                )
            return Hint(
                "projection_input",
                f"likely {e.kind} reads another input in ours: its input is the reference's {name}, where the "
                f"reference's {e.kind} reads another value (e.g. the un-normed residual stream instead of the norm's "
                "output, or the normalised branch instead of the stream)",
                {"projection": e.name, "ours_input": name},
            )
    return None
