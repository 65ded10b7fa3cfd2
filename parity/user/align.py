"""A user's own model: aligning its modules to the reference's nodes by the weights both hold.

No names are guessed. Loader coverage (:mod:`parity.build.coverage`) has already traced each of our
parameters to the checkpoint tensor it came from (same storage, equal values, transposed, or rows
of a fused tensor); from that:

* a reference module with weights (a projection, a norm, the embedding, the head) is aligned to the
  module of ours holding the same tensor (an embedding to an embedding, a projection to a
  projection, when a tie makes one tensor live in both); a fused projection (``qkv``,
  ``gate_up``) is compared through the rows it holds (:class:`Rows`);
* a container (a layer, an attention block, an MLP) is aligned to the lowest common ancestor of its
  aligned children in ours, provided that ancestor holds nothing of another container;
* ``<path>@input`` follows its module; the model's own output is ours' output;
* functional nodes (after RoPE, scores, probabilities, context) come from ``parity.tap`` calls in
  the user's forward, under the module aligned to the reference's attention block, in whatever
  layout the user keeps them (:class:`Layout`); a node nobody tapped is ``untapped``.

Every reference node gets one row of :class:`Aligned`: what it was aligned to and how, or why not.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from torch import nn

from parity.build.coverage import ROWS, TRANSPOSED, Coverage, Source
from parity.model.facts import ArchFacts
from parity.model.pair import NodeSpec
from parity.record.hf_capture import SUFFIXES
from parity.record.hooks import LAYOUTS
from parity.util.errors import ParityError

UNALIGNED, TAP, PARAM = "unaligned:", "tap:", "param:"


@dataclass(frozen=True)
class Aligned:
    """One reference node and where it is in ours: ``ours`` is a module path (with ``@input``), ``""``
    for the model output, ``tap:<path>`` for a functional node, or None when it could not be aligned
    (``detail`` says why). ``how``: weights | fused rows | container | input | output | tap | override |
    unaligned."""

    node: str
    ours: str | None
    how: str
    detail: str = ""

    def to_dict(self) -> dict:
        return {"node": self.node, "ours": self.ours, "how": self.how, "detail": self.detail}


@dataclass(frozen=True)
class Rows:
    """Compare a fused projection of ours through the output features that belong to one reference
    projection (the rows of the fused weight that hold its rows)."""

    rows: tuple[int, ...]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[..., list(self.rows)]

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        out = current.clone()
        out[..., list(self.rows)] = ref.to(device=current.device, dtype=current.dtype)
        return out


@dataclass(frozen=True)
class Layout:
    """Bring a tapped tensor of ours into the reference's layout, by shape.

    Reference layouts: ``q_rot``/``k_rot`` ``(batch, heads, seq, head_dim)`` (k with the KV heads),
    ``scores``/``probs`` ``(batch, heads, q, k)``, ``context`` ``(batch, seq, heads * head_dim)``.
    Accepted from ours: ``(batch, seq, heads, head_dim)``, ``(batch, seq, heads * head_dim)``,
    complex ``(..., head_dim / 2)`` (Meta's RoPE: real and imaginary parts are the interleaved pairs).
    A 4-D tensor whose sequence length equals the head count cannot be read by shape: ``declared``
    (``parity.tap(t, "q_rot", layout="bshd")``) says which it is; without it, the layout this tap
    showed on an earlier call of another length holds (a decode chunk after the prompt), and with
    neither ``(batch, heads, seq, head_dim)`` is assumed: a wrong guess fails the node, and its
    ``tap_layout`` hint names the fix.

    ``expanded``: the query head count, for keys ours expanded before attention (to each query head
    its KV head, as ``repeat_kv`` does, or tiled): they are compared as the KV heads they expand
    (each group's first). ``dims``: per head, where ours keeps the reference's dims (``ref[..., i] =
    ours[..., dims[i]]``): q/k rows permuted per head for interleaved RoPE keep the rotated dims in
    that order too.
    """

    kind: str
    heads: int
    head_dim: int
    #: the layout read from an unambiguous shape, kept for the tap's later ambiguous calls
    seen: dict = field(default_factory=dict, compare=False, repr=False)
    #: the layout the tap declared: "bhsd" (batch, heads, seq, head_dim), "bshd" or "bsf" (heads flattened)
    declared: str = ""
    #: query heads, for keys ours expanded to one per query head before attention (0: never expanded)
    expanded: int = 0
    #: ours' order of each head's dims (None: the reference's)
    dims: tuple[int, ...] | None = None

    def with_layout(self, layout: str) -> Layout:
        """This layout with the tap's declared ``layout``; raises ParityError for an unknown one."""
        if layout not in LAYOUTS:
            raise ParityError(
                f"parity.tap(..., {self.kind!r}, layout={layout!r}): layout must be one of {', '.join(LAYOUTS)}"
            )
        return replace(self, declared=layout)

    def _steps(self, t: torch.Tensor) -> tuple[bool, str]:
        complex_ = t.is_complex()
        shape = t.shape[:-1] + (t.shape[-1] * 2,) if complex_ else t.shape
        if self.declared:
            return complex_, self._declared(tuple(shape))
        if len(shape) == 4 and self.kind in ("q_rot", "k_rot", "context") and shape[1] == shape[2] == self.heads > 1:
            # the shape cannot tell: the layout this tap showed before, else (batch, heads, seq, head_dim);
            # a wrong guess fails the node with a tap_layout hint naming layout=
            return complex_, self.seen.get("layout", "bhsd" if self.kind == "context" else "")
        step = ""
        if self.kind in ("q_rot", "k_rot"):
            # the KV heads first; the query heads only when neither axis holds the KV heads (keys ours expanded)
            wide = self.expanded if self.expanded and self.heads not in shape[1:3] else self.heads
            if len(shape) == 4 and shape[1] != wide and shape[2] == wide:
                step = "bshd"
            elif len(shape) == 3 and shape[-1] == self.heads * self.head_dim:
                step = "bsf"
        elif self.kind == "context" and len(shape) == 4:
            step = "bhsd" if shape[1] == self.heads and shape[2] != self.heads else "bshd"
        if len(shape) == 4 and shape[1] != shape[2]:
            self.seen.setdefault("layout", step)
        return complex_, step

    def _declared(self, shape: tuple) -> str:
        """The conversion step for a declared layout ("" = already the reference's), checked against ``shape``."""
        reference = "bhsd" if self.kind in ("q_rot", "k_rot") else "bsf"
        fits = {
            "bhsd": len(shape) == 4 and shape[1] == self.heads,
            "bshd": len(shape) == 4 and shape[2] == self.heads,
            "bsf": len(shape) == 3 and shape[-1] == self.heads * self.head_dim,
        }[self.declared]
        if not fits:
            raise ParityError(
                f"parity.tap(..., {self.kind!r}, layout={self.declared!r}): shape {tuple(shape)} does not fit "
                f"{self.declared} with {self.heads} heads of {self.head_dim}"
            )
        return "" if self.declared == reference else self.declared

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 5:  # heads kept as (KV heads, group), as grouped attention computes them
            t = t.flatten(1, 2)
        complex_, layout = self._steps(t)
        if complex_:
            t = torch.view_as_real(t).flatten(-2)
        if self.kind in ("q_rot", "k_rot"):
            if layout == "bshd":
                t = t.transpose(1, 2)
            elif layout == "bsf":
                t = t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
            if self.expanded and t.dim() == 4 and t.shape[1] == self.expanded != self.heads:
                t = _kv_heads(t, self.heads)
            return t if self.dims is None else t[..., list(self.dims)]
        if self.kind == "context":
            if layout == "bhsd":
                return t.transpose(1, 2).flatten(-2)
            if layout == "bshd":
                return t.flatten(-2)
        return t

    def inverse(self, ref: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        if current.dim() == 5:
            flat = self.inverse(ref, current.flatten(1, 2))
            return (
                flat.unflatten(1, current.shape[1:3]) if flat.shape[1] == current.shape[1] * current.shape[2] else flat
            )
        complex_, layout = self._steps(current)
        if self.kind in ("q_rot", "k_rot") and self.dims is not None:
            ref = ref[..., torch.tensor(self.dims).argsort().tolist()]
        if self.kind in ("q_rot", "k_rot") and self.expanded:
            wide = current.shape[2] if layout == "bshd" else current.shape[1] if layout != "bsf" else 0
            if wide == self.expanded != self.heads:
                groups = self.expanded // self.heads
                tiled = _is_tiled(current, layout, self.heads)
                ref = ref.repeat(1, groups, 1, 1) if tiled else ref.repeat_interleave(groups, dim=1)
        if self.kind in ("q_rot", "k_rot") and layout == "bshd":
            ref = ref.transpose(1, 2)
        elif self.kind in ("q_rot", "k_rot") and layout == "bsf":
            ref = ref.transpose(1, 2).flatten(-2)
        elif self.kind == "context" and layout == "bhsd":
            ref = ref.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        elif self.kind == "context" and layout == "bshd":
            ref = ref.unflatten(-1, (current.shape[-2], -1))
        if complex_:
            ref = torch.view_as_complex(ref.float().unflatten(-1, (-1, 2)).contiguous())
        return ref.contiguous()


def _kv_heads(t: torch.Tensor, kv: int) -> torch.Tensor:
    """Keys expanded to the query heads ``(b, h, s, d)`` -> the ``kv`` heads they expand: each group's
    first when every query head of a group holds its KV head (``repeat_kv``), else the first ``kv``
    (tiled ``[K0, K1, K0, K1]``: the query heads then read other KV heads than the reference's, which
    the nodes after show)."""
    groups = t.shape[1] // kv
    if torch.equal(t.unflatten(1, (kv, groups)), t.unflatten(1, (kv, groups))[:, :, :1].expand(-1, -1, groups, -1, -1)):
        return t[:, ::groups]
    return t[:, :kv]


def _is_tiled(t: torch.Tensor, layout: str, kv: int) -> bool:
    """Whether keys ``t`` of ours (in ``layout``) were expanded by tiling, not per group."""
    heads = t.transpose(1, 2) if layout == "bshd" else t
    groups = heads.shape[1] // kv
    grouped = heads.unflatten(1, (kv, groups))
    return not torch.equal(grouped, grouped[:, :, :1].expand(-1, -1, groups, -1, -1))


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _common_ancestor(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _module_of(param_name: str) -> tuple[str, str]:
    module, _, leaf = param_name.rpartition(".")
    return module, leaf


class _Aligner:
    def __init__(self, reference: nn.Module, ours: nn.Module, coverage: Coverage, state_dict: dict, facts: ArchFacts):
        self.ref_modules = dict(reference.named_modules())
        self.our_modules = dict(ours.named_modules())
        self.facts = facts
        self.coverage = coverage
        keys_by_storage: dict[tuple, list[str]] = {}
        for key, t in state_dict.items():
            keys_by_storage.setdefault(_storage_key(t), []).append(key)
        self.keys_by_storage = keys_by_storage
        # checkpoint key -> sources of ours (every name of a tied Parameter)
        self.by_key: dict[str, list[tuple[str, Source]]] = {}
        for name, sources in coverage.sources.items():
            for s in sources:
                self.by_key.setdefault(s.key, []).append((name, s))
        self.leaves: dict[str, tuple[str, Source]] = {}  # reference module path -> (our module path, source)
        #: reference module path -> (our parameter, source) for a weight ours reads in a function
        self.functional: dict[str, tuple[str, Source]] = {}
        self.why: dict[str, str] = {}

    def leaf(self, path: str) -> tuple[str, Source] | None:
        """Our module holding the weight of the reference module ``path`` (memoised)."""
        if path in self.leaves or path in self.why:
            return self.leaves.get(path)
        module = self.ref_modules.get(path)
        weight = getattr(module, "weight", None) if module is not None else None
        if not isinstance(weight, torch.Tensor):
            self.why[path] = "no weight in the reference module"
            return None
        keys = self.keys_by_storage.get(_storage_key(weight), [])
        held = [(n, s) for k in keys for n, s in self.by_key.get(k, [])]
        found = held
        # the parameter must be its module's weight: named so, or (a norm's ``scale``, ``gamma``, ``g``,
        # ``w``) the only parameter of its module that holds a reference weight
        found = [(n, s) for n, s in found if self._is_weight_of_module(n)]
        ref_is_embedding = isinstance(module, nn.Embedding)
        candidates = {}
        for n, s in found:
            our_path = _module_of(n)[0]
            our_module = self.our_modules.get(our_path)
            if our_module is None:
                continue
            if isinstance(our_module, nn.Embedding) == ref_is_embedding:
                candidates[our_path] = s
        if not candidates and found and ref_is_embedding:  # a user's own embedding class: accept any holder
            candidates = {_module_of(n)[0]: s for n, s in found}
        if not candidates and found and path == self.facts.head_module:
            # the head computed from the embedding's weight (x @ embedding.weight.T): no module of its own;
            # its output is the model's (nothing follows the head), else it cannot be placed
            if self.facts.logit_scale in (None, 1.0) and not self.facts.final_softcap:
                self.leaves[path] = ("", found[0][1])
                return self.leaves[path]
            self.why[path] = (
                f"ours computes it from {found[0][0]} with no module of its own, and something follows the head"
            )
            return None
        if len(candidates) == 1:
            self.leaves[path] = next(iter(candidates.items()))
            return self.leaves[path]
        if not candidates and held and not isinstance(module, nn.Embedding):
            # a parameter of a module that holds several (TransformerLens' W_Q in attn): the op reading it
            # computes this module's output
            self.functional[path] = held[0]
            self.why[path] = f"ours holds its weight as {held[0][0]}, a parameter of a module that holds others too"
            return None
        if not candidates:
            self.why[path] = f"no module of ours holds {', '.join(keys) or 'its weight'}"
        else:
            self.why[path] = f"ambiguous: {', '.join(sorted(candidates))} all hold its weight"
        return None

    def _is_weight_of_module(self, param: str) -> bool:
        module, leaf = _module_of(param)
        if leaf == "weight":
            return True
        holders = [n for n in self.coverage.sources if _module_of(n)[0] == module and "." not in n[len(module) + 1 :]]
        weights = [n for n in holders if any(src.key.endswith(".weight") for src in self.coverage.sources[n])]
        return weights == [param]

    def container(self, path: str) -> str | None:
        """Our module that plays the role of the reference container ``path``."""
        if path in self.why:
            return None
        prefix = path + "." if path else ""
        inside: list[str]
        outside: list[str]
        inside, outside, owners = [], [], set()
        for ref_path, module in self.ref_modules.items():
            if not isinstance(getattr(module, "weight", None), torch.Tensor) or ref_path == path:
                continue
            hit = self.leaf(ref_path)
            if hit is None and ref_path in self.functional:  # read in a function: its parameter's module gathers it
                owner = _module_of(self.functional[ref_path][0])[0]
                owners.add(owner)
                hit = (owner, self.functional[ref_path][1])
            if hit is None or hit[0] == "":  # the head ours computes from the embedding: no module to gather
                continue
            (inside if ref_path.startswith(prefix) else outside).append(hit[0])
        if len(set(inside)) < 2 and not (set(inside) <= owners and inside):
            self.why[path] = "fewer than two of its weighted modules were found in ours"
            return None
        ancestor = _common_ancestor(sorted(set(inside)))
        if ancestor in owners and ancestor in outside:
            self.why[path] = f"{ancestor} also holds the weights of other reference blocks"
            return None
        if ancestor in set(inside) and ancestor not in owners:
            self.why[path] = f"its weighted modules in ours meet at {ancestor}, which is one of them"
            return None
        if any(o == ancestor or o.startswith(ancestor + ".") for o in outside if o not in inside):
            self.why[path] = f"{ancestor or 'the model'} also holds modules of other reference blocks"
            return None
        return ancestor

    def place(self, spec: NodeSpec) -> tuple[NodeSpec, Aligned]:
        name, ref_path = spec.name, spec.reference_path
        if ref_path == "":
            return replace(spec, ours=""), Aligned(name, "", "output", "the whole model's output")
        suffix = name.rsplit(".", 1)[-1]
        if suffix in SUFFIXES and name.endswith("." + suffix) and ref_path == name:
            att = name[: -len(suffix) - 1]
            our_att = self.container(att)
            if our_att is None:
                return self._unaligned(spec, f"attention block {att}: {self.why.get(att, 'not found')}")
            heads = self.facts.num_kv_heads if suffix == "k_rot" else self.facts.num_heads
            layer = self.facts.layer(spec.layer)
            head_dim = layer.head_dim if layer is not None else self.facts.head_dim
            dims = (
                self._head_dims(f"{att}.{'k_proj' if suffix == 'k_rot' else 'q_proj'}", head_dim)
                if suffix in ("q_rot", "k_rot")
                else None
            )
            expanded = self.facts.num_heads if suffix == "k_rot" and self.facts.num_heads != heads else 0
            layout = Layout(suffix, heads, head_dim, expanded=expanded, dims=dims)
            tap = f"{our_att}.{suffix}"
            detail = f"parity.tap(tensor, {suffix!r}) inside {our_att}, or what its functions compute"
            if dims is not None:
                detail += "; each head's dims in ours' order (its q/k rows are permuted per head)"
            return (
                replace(spec, ours=TAP + tap, transform=layout, inverse=layout.inverse),
                Aligned(name, TAP + tap, "tap", detail),
            )
        is_input = ref_path.endswith("@input")
        base = ref_path[: -len("@input")] if is_input else ref_path
        if spec.reference_transform is not None:  # a part of that module's output, not its output
            return self._unaligned(spec, f"a view of {base}'s output (name it with node_map)")
        hit = self.leaf(base) if isinstance(getattr(self.ref_modules.get(base), "weight", None), torch.Tensor) else None
        if hit is not None and hit[0] == "" and not is_input:
            return replace(spec, ours=""), Aligned(
                name,
                "",
                "output",
                f"the head is the embedding's weight used in forward ({hit[1].param}): the model's output",
            )
        if hit is not None and base == self.facts.embed_module and not is_input and self._scaled_outside(hit[0]):
            first = self.container(f"{self.facts.layer_prefix}.0")
            if first is not None:
                return replace(spec, ours=first + "@input"), Aligned(
                    name,
                    first + "@input",
                    "input",
                    f"the reference's embedding scales by {self.facts.embed_scale:g}; ours ({hit[0]}, a plain "
                    f"nn.Embedding) cannot, so its value appears where the reference's does: the first layer's input",
                )
        our_path: str | None
        if hit is not None:
            our_path, source = hit
            ours = our_path + ("@input" if is_input else "")
            if source.how == ROWS and not is_input:
                rows = Rows(cast(tuple[int, ...], source.rows))  # a ROWS source has its rows
                return (
                    replace(spec, ours=ours, transform=rows, inverse=rows.inverse),
                    Aligned(name, ours, "fused rows", f"rows of {source.param} holding {source.key}"),
                )
            how = "input" if is_input else "weights"
            detail = f"{'transposed ' if source.how == TRANSPOSED else ''}{source.key} ({source.how})"
            return replace(spec, ours=ours), Aligned(name, ours, how, detail)
        if base in self.ref_modules and not isinstance(getattr(self.ref_modules[base], "weight", None), torch.Tensor):
            our_path = self.container(base)
            if our_path is not None:
                ours = our_path + ("@input" if is_input else "")
                return replace(spec, ours=ours), Aligned(
                    name,
                    ours,
                    "input" if is_input else "container",
                    f"common ancestor of the modules aligned under {base}",
                )
        if base in self.functional and not is_input:
            param, source = self.functional[base]
            return replace(spec, ours=PARAM + param), Aligned(
                name,
                PARAM + param,
                "functional",
                f"the result of the op in ours that reads {param} ({source.description}): its module computes more",
            )
        return self._unaligned(spec, self.why.get(base, f"{base} is not a module of the reference"))

    def _head_dims(self, projection: str, head_dim: int) -> tuple[int, ...] | None:
        """Where ours keeps each head's dims, when its weight of ``projection`` (q_proj, k_proj) holds
        the reference's rows permuted the same way within every head (interleaved RoPE on Meta's
        layout): ``ref[..., i] = ours[..., dims[i]]``; None when ours keeps the reference's order."""
        hit = self.leaf(projection) if projection in self.ref_modules else None
        if hit is None or hit[1].how != ROWS or hit[1].rows is None:
            return None
        rows = list(hit[1].rows)
        if len(rows) % head_dim:
            return None
        heads = [
            tuple(r - h * head_dim for r in rows[h * head_dim : (h + 1) * head_dim])
            for h in range(len(rows) // head_dim)
        ]
        if len(set(heads)) != 1 or sorted(heads[0]) != list(range(head_dim)) or heads[0] == tuple(range(head_dim)):
            return None
        return heads[0]

    def _scaled_outside(self, our_path: str) -> bool:
        """The reference's embedding scales its output (Gemma: sqrt(hidden)) and ours is a plain
        ``nn.Embedding``, which cannot: the scale is applied by its caller."""
        scale = self.facts.embed_scale
        return scale not in (None, 1.0) and type(self.our_modules.get(our_path)) is nn.Embedding

    @staticmethod
    def _unaligned(spec: NodeSpec, reason: str) -> tuple[NodeSpec, Aligned]:
        return replace(spec, ours=UNALIGNED + reason), Aligned(spec.name, None, "unaligned", reason)


def align(
    reference: nn.Module,
    ours: nn.Module,
    nodes: list[NodeSpec],
    coverage: Coverage,
    state_dict: dict,
    facts: ArchFacts,
    overrides: dict[str, str] | None = None,
) -> tuple[list[NodeSpec], list[Aligned]]:
    """Our counterpart of every reference node (see the module docstring).

    ``overrides``: ``{reference node name or glob: our module path}`` (``tap:<path>`` for a
    functional node) replaces the automatic choice. Returns the NodeSpecs to trace and one
    :class:`Aligned` row per node, in the order of ``nodes``.
    """
    aligner = _Aligner(reference, ours, coverage, state_dict, facts)
    specs, rows = [], []
    for spec in nodes:
        pattern = next((p for p in (overrides or {}) if fnmatch.fnmatchcase(spec.name, p)), None)
        if pattern is not None:
            assert overrides is not None  # pattern is one of its keys
            target = overrides[pattern]
            specs.append(replace(spec, ours=target))
            rows.append(Aligned(spec.name, target, "override", f"node_map[{pattern!r}]"))
            continue
        new, row = aligner.place(spec)
        specs.append(new)
        rows.append(row)
    # a model nobody wrote for parity keeps its own layouts: a node differing only in layout is compared in the reference's
    # (not what forward returns: a training loop reads that value in its layout)
    specs = [replace(spec, match_layout=spec.reference_path != "") for spec in specs]
    return specs, rows


def alignment_table(rows: list[Aligned]) -> list[tuple[str, str, str, str]]:
    """``(node, ours, how, detail)`` per row, for printing."""
    return [(r.node, r.ours if r.ours is not None else "-", r.how, r.detail) for r in rows]
