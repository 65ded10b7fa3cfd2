"""A family is data: configs, a weight table, a node map, the Transformers classes, faults, CI configs.

One :class:`Family` per architecture, registered in the ``parity.pairs`` entry-point group (the
built-ins register exactly like a user's package would). :meth:`Family.build_pair` is the same
generic build path for every family (:mod:`parity.build`).

A node map is declared once per family (:class:`NodeMap`): entries before the layers, per layer
(``{i}`` = layer index; an entry may be limited to some layer types) and after them. It expands
against the :class:`~parity.model.facts.ArchFacts` of the reference, so it needs no family cfg key.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from parity.model.facts import ArchFacts, LayerFacts
from parity.model.pair import NodeSpec

#: a name, or an optional one: what a name template filled in (or moved) stays
_Name = TypeVar("_Name", str, "str | None")


@dataclass(frozen=True)
class Node:
    """One node-map entry: canonical name template and our module path template (``{i}`` = layer).

    ``layer_types`` limits a per-layer entry to those layer types (None: every layer); ``sparse``
    to the layers whose feed-forward is a mixture of experts (True) or dense (False; None: every
    layer); ``where`` (optional) decides it per layer from that layer's
    :class:`~parity.model.facts.LayerFacts` (e.g. no ``k_proj`` on a layer that reads another layer's
    keys). ``{e}`` in a per-layer entry expands over the layer's experts (``mlp.experts.{e}``).
    ``transform``/``inverse``/``reference``/``kind``/``reference_transform``/``chosen_from`` are
    passed to :class:`~parity.model.pair.NodeSpec`. ``when`` (optional) decides from the facts whether the
    entry exists at all (e.g. a node only for a config with a soft-cap).
    """

    name: str
    ours: str
    layer_types: tuple[str, ...] | None = None
    transform: Callable | None = None
    inverse: Callable | None = None
    reference: str | None = None
    kind: str = ""
    when: Callable[[ArchFacts], bool] | None = None
    reference_transform: Callable | None = None
    where: Callable[[LayerFacts], bool] | None = None
    sparse: bool | None = None
    chosen_from: str | None = None

    def spec(self, i: int | None = None, e: int | None = None) -> NodeSpec:
        def fmt(s: _Name) -> _Name:
            if s is None:
                return None
            s = s if i is None else s.replace("{i}", str(i))
            return s if e is None else s.replace("{e}", str(e))

        return NodeSpec(
            fmt(self.name),
            fmt(self.ours),
            self.transform,
            fmt(self.reference),
            self.inverse,
            kind=self.kind,
            reference_transform=self.reference_transform,
            chosen_from=fmt(self.chosen_from),
        )

    def applies_to(self, layer) -> bool:
        """Whether this per-layer entry exists on ``layer`` (a :class:`~parity.model.facts.LayerFacts`)."""
        if self.layer_types is not None and layer.layer_type not in self.layer_types:
            return False
        if self.where is not None and not self.where(layer):
            return False
        return self.sparse is None or self.sparse == layer.sparse


def _node(entry) -> Node:
    return entry if isinstance(entry, Node) else Node(*entry)


@dataclass(frozen=True)
class NodeMap:
    """``before`` the layers, ``per_layer`` (``{i}``), ``after`` them; entries are :class:`Node` or
    ``(name, ours)`` pairs. Order within a list does not matter: nodes are compared in the
    reference's execution order."""

    before: Sequence = ()
    per_layer: Sequence = ()
    after: Sequence = ()

    def expand(self, facts: ArchFacts) -> list[NodeSpec]:
        def keep(node: Node) -> bool:
            return node.when is None or node.when(facts)

        nodes = [n.spec() for n in map(_node, self.before) if keep(n)]
        for layer in facts.layers:
            for n in map(_node, self.per_layer):
                if not (keep(n) and n.applies_to(layer)):
                    continue
                if "{e}" in n.name:
                    nodes += [n.spec(layer.index, e) for e in range(layer.num_experts)]
                else:
                    nodes.append(n.spec(layer.index))
        nodes += [n.spec() for n in map(_node, self.after) if keep(n)]
        return nodes


#: reStructuredText inline markup: ``literal``, :role:`target`, `interpreted`, *emphasis*
_RST = re.compile(r"(?::[\w.+-]+:)?``?([^`]+?)``?|\*\*?([^*\s][^*]*?)\*?\*")


def plain_text(text: str) -> str:
    """A docstring line as a terminal shows it: inline reStructuredText markup removed
    (``` ``n_layers`` ``` -> ``n_layers``, ``:func:`f``` -> ``f``, ``*x*`` -> ``x``)."""
    return _RST.sub(lambda m: m.group(1) if m.group(1) is not None else m.group(2), text)


def summary(doc: str | None) -> str:
    """A docstring's first paragraph (up to the first blank line), its lines joined with single spaces
    and inline markup removed: the whole description, never its first physical line alone."""
    paragraph: list[str] = []
    for line in inspect.cleandoc(doc or "").splitlines():
        if not line.strip():
            if paragraph:
                break
            continue
        paragraph.append(line.strip())
    return plain_text(" ".join(paragraph))


def reroot(nodes: list[NodeSpec], text_model: str) -> list[NodeSpec]:
    """``nodes`` of a node map written for a text model at ``model`` (``model.layers.3``,
    ``model.embed_tokens``), named where ``text_model`` holds it (``model.language_model.layers.3``);
    names outside it (``lm_head``, ``logits``) stay as they are."""
    if not text_model.startswith("model."):  # "model" itself, or a model that names it otherwise (transformer.h)
        return nodes

    def moved(path: _Name) -> _Name:
        return f"{text_model}.{path[len('model.') :]}" if path and path.startswith("model.") else path

    return [
        replace(n, name=moved(n.name), reference=moved(n.reference), chosen_from=moved(n.chosen_from)) for n in nodes
    ]


@dataclass(frozen=True)
class Composite:
    """A multimodal model that holds a family's text model (Gemma 3 and 4: ``...ForConditionalGeneration``,
    with vision and audio towers and their projectors next to ``model.language_model``).

    A checkpoint whose config.json has this ``model_type`` is checked as the family's text model: our
    side is built from its ``text_config`` and loaded from the keys under ``text_prefix`` (after
    Transformers' own checkpoint conversion, so older ``language_model.model.*`` files read the same),
    plus the head; the reference is ``reference_class`` built from the whole checkpoint, so node names
    are the checkpoint's own (``model.language_model.layers.3...``). The rest of the checkpoint is
    reported by loader coverage as not used by design, under the module it belongs to.
    """

    model_type: str
    reference_class: str
    config_class: str
    text_prefix: str = "model.language_model."

    def reference_cls(self):
        import transformers

        return getattr(transformers, self.reference_class)

    def config_cls(self):
        import transformers

        return getattr(transformers, self.config_class)


@dataclass(frozen=True)
class Family:
    """A registered family (see the module docstring).

    ``model_class(cfg)``: our from-scratch model. ``configs``: built-in name -> ``f(n_layers=None)
    -> cfg``. ``weights``: the weight table (:mod:`parity.model.weights`), or ``load(model, cfg, state_dict) ->
    consumed keys`` for a loader of its own. ``nodes``: a :class:`NodeMap` or ``f(facts) ->
    NodeSpecs``. ``to_hf(cfg)`` -> Transformers config; ``from_hf(config, dtype)`` -> cfg (raises
    ConfigError naming a field it cannot honour). ``faults``: the catalogue for ``parity selftest``.
    ``ci_configs`` run in every test run and the gate; ``real_configs`` are the released models'
    shapes; ``features(cfg)`` lists what a cfg exercises (the gate fails if a real config uses a
    feature no CI config has); ``notes(cfg)`` warns what a cfg cannot show; ``fields`` declares the
    config fields the sensitivity audit and the property tests draw (:mod:`parity.model.fields`);
    ``exact_dtypes``: the dtypes in which the family claims bit-exactness (tests hold it to that);
    ``exact_backward_dtypes``: those in which its gradients are bit-exact too (None: the same).
    ``composite``: the multimodal model whose checkpoints hold this text model (:class:`Composite`).
    """

    name: str
    model_type: str
    reference_class: str
    config_class: str
    model_class: Callable[[dict], torch.nn.Module]
    configs: Mapping[str, Callable[..., dict]]
    nodes: NodeMap | Callable[[ArchFacts], list[NodeSpec]]
    to_hf: Callable[[dict], object]
    from_hf: Callable[[object, torch.dtype], dict]
    weights: Mapping[str, object] = field(default_factory=dict)
    load: Callable | None = None
    faults: tuple = ()
    default_config: str = "tiny"
    ci_configs: tuple[str, ...] = ("tiny",)
    real_configs: tuple[str, ...] = ()
    features: Callable[[dict], set[str]] | None = None
    notes: Callable[[dict], list[str]] | None = None
    fields: tuple = ()
    #: compute dtypes in which our model is bit-identical to the reference when correct (on the CPU):
    #: checks of such pairs default to atol = rtol = 0, so the first node with any difference is the fault
    exact_dtypes: tuple[torch.dtype, ...] = ()
    #: compute dtypes in which our model's gradients (every node's and parameter's, parity.run.backward)
    #: are bit-identical to the reference's too; None: the same as ``exact_dtypes``
    exact_backward_dtypes: tuple[torch.dtype, ...] | None = None
    #: the multimodal model a checkpoint of this family's text model may come in (see :class:`Composite`)
    composite: Composite | None = None

    def node_specs(self, facts: ArchFacts) -> list[NodeSpec]:
        """The node map expanded for ``facts``, named where the reference holds the text model."""
        nodes = self.nodes.expand(facts) if isinstance(self.nodes, NodeMap) else list(self.nodes(facts))
        return reroot(nodes, facts.text_model)

    def composite_for(self, model_type: str | None) -> Composite | None:
        """This family's :class:`Composite` when ``model_type`` is its model_type, else None."""
        return self.composite if self.composite is not None and model_type == self.composite.model_type else None

    def reference_cls(self):
        import transformers

        return getattr(transformers, self.reference_class)

    def config_cls(self):
        import transformers

        return getattr(transformers, self.config_class)

    @property
    def config_descriptions(self) -> dict[str, str]:
        """Built-in config name -> the first paragraph of its docstring (see :func:`summary`)."""
        return {name: summary(fn.__doc__) for name, fn in self.configs.items()}

    def config_features(self, name: str) -> set[str]:
        return set() if self.features is None else self.features(self.configs[name](None))

    @property
    def folder(self) -> str:
        """``reference_pairs/olmo3/`` for a family whose model lives in ``reference_pairs.olmo3.model``."""
        return "/".join(self.model_class.__module__.split(".")[:-1]) + "/"
