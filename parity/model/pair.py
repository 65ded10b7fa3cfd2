"""A Pair: our model, the reference, the facts of the architecture, and which tensors correspond.

The engine only sees this object: ``facts`` (:class:`parity.model.facts.ArchFacts`, derived from the
reference's Transformers config) and ``nodes`` (:class:`NodeSpec`). Families build Pairs through
:meth:`parity.model.family.Family.build_pair`; :func:`parity.check_model` builds one for a user's model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from parity.model.facts import ArchFacts
from parity.model.weights import parameter_storages

if TYPE_CHECKING:
    from parity.build.coverage import Coverage
    from parity.run.decode import CacheProtocol


@dataclass(frozen=True)
class NodeSpec:
    """One compared tensor.

    ``name`` is canonical: the Transformers module path, ``<path>@input`` for a module's input, or
    an attention suffix (``.q_rot``, ``.k_rot``, ``.scores``, ``.probs``, ``.context``). ``ours`` is
    the module path in our model, with the same ``@input`` convention (``""`` is the whole model's
    output). ``reference`` is the reference's module path when it differs from ``name`` (e.g.
    ``logits`` after a scale applied outside any module is the root's output, ``""``).

    ``transform`` (optional) maps our tensor into the reference's layout before comparing (a slice
    of a fused projection, a transpose of a head-major layout); ``inverse(ref, ours) -> ours`` maps a
    reference tensor back into our layout (given our tensor, so a fused projection can write only its
    part), which isolated mode needs to substitute that node (without it the node is compared but
    not substituted). ``layer`` and ``kind`` are filled from the facts
    (:meth:`ArchFacts.locate`) unless given. ``reference_transform`` (optional) makes the node a
    view of what the reference module computes, recorded when it runs: a part the reference
    splits off its output outside any module (the gate half of a fused ``q_proj``), taken with the
    reference's own view ops, so no arithmetic is added.

    A module path (either side) may end in ``#n``: the ``n``-th tensor of the module's output (a
    router returning logits, weights and chosen experts). An integer node (indices) is compared
    exactly; ``chosen_from`` names the node whose scores the indices were chosen from (top-k), so a
    different choice is reported with the reference's margin there.
    """

    name: str
    ours: str
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    reference: str | None = None
    inverse: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    layer: int | None = None
    kind: str = ""
    reference_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    chosen_from: str | None = None
    #: compare ours in the reference's layout when only the layout differs (a user's model, a
    #: runtime's dump; see :mod:`parity.compare.layouts`)
    match_layout: bool = False

    @property
    def reference_path(self) -> str:
        return self.name if self.reference is None else self.reference


#: the node of what the model's forward returns (a Transformers model: its ``logits``), compared after
#: every module: a training loop and ``generate`` use that value, not the head's module output
LOGITS = "logits"


def with_output_node(nodes: Sequence[NodeSpec]) -> list[NodeSpec]:
    """``nodes`` with the model's returned value as a node (``logits``: the root's output on both
    sides) unless one is there already (a family with something after the head names it so)."""
    nodes = list(nodes)
    if not any(n.reference_path == "" for n in nodes):
        nodes.append(NodeSpec(LOGITS, "", reference=""))
    return nodes


def annotate(nodes: Sequence[NodeSpec], facts: ArchFacts) -> list[NodeSpec]:
    """Fill each node's ``layer`` and ``kind`` from the facts (explicit values win)."""
    out = []
    for n in nodes:
        layer, kind = facts.locate(n.name)
        out.append(replace(n, layer=n.layer if n.layer is not None else layer, kind=n.kind or kind))
    return out


PROBE_WEIGHTS = "probe weights (parity.build.probes: per-token embedding RMS 1e-3..10, norm weights 1 + 0.1 N(0, 1))"


@dataclass
class PairSource:
    """Where a Pair came from, for reports and the config diff (the engine judges nothing by it).

    ``family`` and ``config_name`` name it; ``cfg`` is the family's own config dict (opaque to the
    engine: reported, and diffed key by key against ``reference_cfg``, the reference's config read
    back through the family's mapping); ``seed`` made the probe weights; ``checkpoint`` and its
    sha256 where they came from a checkpoint instead; ``probe`` says which in words; ``device``
    where both models run (``cpu``, ``cuda:0``, ``mps`` or ``device_map=auto``).
    """

    family: str = ""
    config_name: str = ""
    cfg: dict = field(default_factory=dict)
    reference_cfg: dict | None = None
    seed: int = 0
    checkpoint: str | None = None
    checkpoint_hash: str | None = None
    probe: str = PROBE_WEIGHTS
    device: str = "cpu"


@dataclass
class Loading:
    """What loading the weights recorded, for loader coverage and the in-place edit guard.

    ``state_dict``: the checkpoint-named tensors both models were loaded from (shared, not a copy);
    ``loaded_keys``: checkpoint key -> our parameter path (a weight table's answer);
    ``conversions``: what was done to the checkpoint on the way in (``key: float32 -> bfloat16``);
    ``tied_keys``: checkpoint key -> the key it must stay tied to; ``by_design``: keys of a
    multimodal checkpoint outside the text model (towers, projectors) -> the module they belong to,
    left unused by design; ``fingerprint``: per tensor its version counter and a sample of its bits
    at build time; ``built_storage``: where each of our parameters lived right after loading (a
    replaced Parameter, a fault injected by hand, is then told from a loader's gap); ``coverage``:
    loader coverage when building computed it (check_model), else the check computes it.
    """

    state_dict: dict = field(default_factory=dict, repr=False)
    loaded_keys: dict[str, str] = field(default_factory=dict)
    conversions: list[str] = field(default_factory=list)
    tied_keys: dict[str, str] = field(default_factory=dict)
    by_design: dict[str, str] = field(default_factory=dict)
    fingerprint: dict = field(default_factory=dict, repr=False)
    built_storage: dict = field(default_factory=dict, repr=False)
    coverage: Coverage | None = field(default=None, repr=False)


@dataclass
class Pair:
    """Our model and the reference, holding identical weights, plus what to compare.

    ``ours(input_ids, attention_mask=None, [position_ids=None]) -> logits``; ``reference(input_ids=...)``
    is a Transformers ``*ForCausalLM``. ``nodes`` lists every compared tensor; order is fixed by the
    reference's execution, not by this list. ``facts`` is all the engine knows about the
    architecture; ``dtype`` both models' compute dtype. ``source`` says where the pair came from,
    ``loading`` what loading recorded. ``notes`` carries warnings a user should see; ``alignment``
    how each reference node was found in ours (check_model; empty for families); ``exact``: ours is
    bit-identical to the reference when correct (its family claims it for this dtype), so checks
    default to atol = rtol = 0; ``cache_protocol``: how to run ours with its KV cache in a decode
    check (None: our families' protocol, see :mod:`parity.run.decode`); ``rebuild64``: builds
    both models anew in float64 (ours, reference), each making its own tables and derived weights
    in float64, for the semantic run (:mod:`parity.run.semantic`); None: that run uses float64
    copies of the two models instead.
    """

    ours: nn.Module
    reference: nn.Module
    nodes: list[NodeSpec]
    facts: ArchFacts
    dtype: torch.dtype = torch.float32
    source: PairSource = field(default_factory=PairSource)
    loading: Loading = field(default_factory=Loading)
    default_seq_len: int = 16
    notes: list[str] = field(default_factory=list)
    alignment: list = field(default_factory=list)
    exact: bool = False
    cache_protocol: CacheProtocol | None = None
    rebuild64: Callable[[], tuple[nn.Module, nn.Module]] | None = field(default=None, repr=False)

    def __post_init__(self):
        self.nodes = annotate(with_output_node(self.nodes), self.facts)
        loading = self.loading
        if loading.state_dict and not loading.fingerprint:
            loading.fingerprint = fingerprints(loading.state_dict)
        if loading.state_dict and not loading.built_storage:
            loading.built_storage = parameter_storages(self.ours)

    def changed_weights(self) -> list[str]:
        """Checkpoint tensors changed in place since the pair was built.

        Both models share these tensors, so an in-place edit of one of ours (``w.mul_(2)``, a forward
        that folds a weight in place) changes the reference too and would hide any difference. The
        version counter catches every in-place op in O(1); a fixed sample of each tensor's bits also
        catches edits through ``.data`` (which bypass the counter). Bits, not values, so a NaN
        weight is equal to itself.
        """
        now = fingerprints(self.loading.state_dict)
        return [k for k, v in self.loading.fingerprint.items() if now.get(k) != v]

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def output_node(self) -> str | None:
        """The node holding the model's final output: the root output (``logits``) unless ours cannot
        give it (a dump without it, judged at its head), else the head."""
        names = {n.reference_path: n.name for n in self.nodes if not n.ours.startswith(("unaligned:", "tap:"))}
        return names.get("", names.get(self.facts.head_module))

    def make_inputs(self, seq_len: int | None = None, batch_size: int = 1, seed: int | None = None) -> torch.Tensor:
        """Seeded random token ids ``(batch_size, seq_len)`` in ``[0, vocab_size)``, int64, none of them a
        placeholder the reference swaps out (``facts.placeholder_tokens``; without any, the same ids as ever), each
        boundary token its forward acts on (``facts.boundary_tokens``: an EOS) once, from the middle on."""
        gen = torch.Generator().manual_seed(self.source.seed if seed is None else seed)
        skip = self.facts.placeholder_tokens
        ids = torch.randint(
            0, self.vocab_size - len(skip), (batch_size, seq_len or self.default_seq_len), generator=gen
        )
        for token in sorted(skip):  # ascending: each shift moves the ids at or past it one up, over it
            ids = ids + (ids >= token).long()
        for i, token in enumerate(self.facts.boundary_tokens):  # a boundary the reference's forward acts on, once
            if 0 <= token < self.vocab_size and ids.shape[1] > 2 * (i + 1):
                ids[:, ids.shape[1] // 2 + i] = token
        return ids


#: elements sampled per tensor for the fingerprint (spread evenly, first and last included)
_SAMPLE = 64


def _bits(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return b""
    k = min(_SAMPLE, flat.numel())
    # integer arithmetic: a float linspace rounds past the last index of a tensor of 2^24+ elements
    idx = torch.arange(k, dtype=torch.int64) * (flat.numel() - 1) // max(k - 1, 1)
    return (
        flat[idx].cpu().numpy().tobytes()
        if flat.dtype != torch.bfloat16
        else flat[idx].view(torch.int16).cpu().numpy().tobytes()
    )


def fingerprints(state_dict) -> dict[str, tuple[int, bytes]]:
    """Per tensor: its version counter (every in-place op bumps it) and a fixed sample of its bits."""
    with torch.no_grad():
        return {key: (t._version, _bits(t)) for key, t in state_dict.items()}
