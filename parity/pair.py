"""A Pair: our model, the reference, and the declaration of which tensors correspond.

The engine only sees this object; it knows nothing of any one architecture. Families build Pairs
(``reference_pairs/<family>/pair.py``) and register a :class:`Family` in the ``parity.pairs``
entry-point group.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)(?:\.(.*))?$")


@dataclass(frozen=True)
class NodeSpec:
    """One compared tensor.

    ``name`` is canonical: the Transformers module path, ``<path>@input`` for a module's input, or
    an attention suffix (``.q_rot``, ``.k_rot``, ``.probs``, ``.context``). ``ours`` is the module
    path in our model, with the same ``@input`` convention (``""`` is the whole model's output).
    ``reference`` is the reference's module path when it differs from ``name`` (e.g. ``logits``
    after a scale applied outside any module is the root's output, ``""``). ``transform``
    (optional) maps our tensor into the reference's layout before comparing; ``inverse`` maps a
    reference tensor back into ours, which isolated mode needs to substitute that node.
    """

    name: str
    ours: str
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    reference: str | None = None
    inverse: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def reference_path(self) -> str:
        return self.name if self.reference is None else self.reference

    @property
    def layer(self) -> int | None:
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def kind(self) -> str:
        """Node kind without the layer prefix: ``q_proj``, ``probs``, ``mlp@input``, ``layer``, ``lm_head``."""
        m = _LAYER.match(self.name)
        if not m:
            return self.name.rsplit(".", 1)[-1]
        rest = m.group(2)
        if rest is None:
            return "layer"
        return rest.rsplit(".", 1)[-1] if "@" not in rest else rest.split(".")[-1]


def expand_nodes(
    before: Sequence[tuple[str, str]],
    per_layer: Sequence[tuple[str, str]],
    after: Sequence[tuple[str, str]],
    n_layers: int,
) -> list[NodeSpec]:
    """Declarative node map -> NodeSpecs: ``per_layer`` entries use ``{i}`` for the layer index."""
    nodes = [NodeSpec(n, o) for n, o in before]
    for i in range(n_layers):
        nodes += [NodeSpec(n.format(i=i), o.format(i=i)) for n, o in per_layer]
    nodes += [NodeSpec(n, o) for n, o in after]
    return nodes


@dataclass
class Pair:
    """Our model and the reference, holding identical weights, plus what to compare.

    ``ours(input_ids)`` returns logits; ``reference(input_ids=...)`` is a Transformers
    ``*ForCausalLM``. ``nodes`` lists every compared tensor; order is fixed by the reference's
    execution, not by this list. ``notes`` carries warnings a user should see (for example a
    sequence length that does not reach the sliding window).
    """

    ours: nn.Module
    reference: nn.Module
    cfg: dict
    nodes: list[NodeSpec]
    family: str
    config_name: str
    dtype: torch.dtype = torch.float32
    seed: int = 0
    checkpoint: str | None = None
    checkpoint_hash: str | None = None
    default_seq_len: int = 16
    notes: list[str] = field(default_factory=list)
    loaded_keys: dict[str, str] = field(default_factory=dict)
    #: the reference's config read back through the family's mapping, for the config diff
    reference_cfg: dict | None = None
    #: the checkpoint-named tensors both models were loaded from (shared, not a copy), for loader coverage
    state_dict: dict = field(default_factory=dict, repr=False)
    #: dtype casts applied to the checkpoint on the way in (``key: float32 -> bfloat16``)
    conversions: list[str] = field(default_factory=list)
    #: checkpoint key -> key it must be tied to (from the reference, when its config ties them)
    tied_keys: dict[str, str] = field(default_factory=dict)
    #: per checkpoint tensor, a cheap checksum taken at build time (see :meth:`changed_weights`)
    fingerprint: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.state_dict and not self.fingerprint:
            self.fingerprint = checksums(self.state_dict)

    def changed_weights(self) -> list[str]:
        """Checkpoint tensors whose values changed since the pair was built.

        Both models share these tensors, so an in-place edit of one of ours (``w.mul_(2)``, a forward
        that folds a weight in place) changes the reference too and would hide any difference.
        """
        now = checksums(self.state_dict)
        return [k for k, v in self.fingerprint.items() if now.get(k) != v]

    @property
    def vocab_size(self) -> int:
        return int(self.cfg["vocab_size"])

    def make_inputs(self, seq_len: int | None = None, batch_size: int = 1, seed: int | None = None) -> torch.Tensor:
        """Seeded random token ids ``(batch_size, seq_len)`` in ``[0, vocab_size)``, int64."""
        gen = torch.Generator().manual_seed(self.seed if seed is None else seed)
        return torch.randint(0, self.vocab_size, (batch_size, seq_len or self.default_seq_len), generator=gen)


def checksums(state_dict) -> dict[str, tuple[float, float]]:
    """Per tensor: its float32 sum and the float32 sum of every 97th element (cheap, no copy)."""
    out = {}
    with torch.no_grad():
        for key, t in state_dict.items():
            flat = t.detach().reshape(-1)
            out[key] = (float(flat.sum(dtype=torch.float32)), float(flat[::97].sum(dtype=torch.float32)))
    return out


@dataclass(frozen=True)
class Family:
    """A registered family: how to build its pairs and what configs it offers.

    ``configs`` maps built-in config names to one-line descriptions; ``ci_configs`` are the ones
    small enough for every test run. ``build_pair(config=..., checkpoint=..., dtype=..., seed=...,
    **overrides)`` returns a :class:`Pair`. ``faults``: the family's catalogue of
    :class:`parity.faults.Fault` for ``parity selftest``. ``real_configs`` are the configs of the
    released models; ``config_features(name)`` lists what a config exercises, and the gate fails if
    a real config uses a feature no CI config has.
    """

    name: str
    reference_class: str
    build_pair: Callable[..., Pair]
    configs: dict[str, str]
    default_config: str = "tiny"
    ci_configs: tuple[str, ...] = ("tiny",)
    faults: tuple = ()
    real_configs: tuple[str, ...] = ()
    config_features: Callable[[str], set[str]] | None = None
