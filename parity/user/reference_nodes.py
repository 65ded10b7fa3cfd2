"""The reference's nodes: its family's node map when a registered family has that ``model_type``,
else discovered from the reference's module tree (every module with a weight, every decoder layer,
the attention internals of every attention block, and what the forward returns). Used where no family builds the pair: a user's model, a golden trace of any checkpoint."""

from __future__ import annotations

from torch import nn

from parity.model.facts import ArchFacts
from parity.model.pair import LOGITS, NodeSpec
from parity.record.hf_capture import SUFFIXES

#: the output projection of an attention block, by the names Transformers' families give it
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and any(hasattr(module, n) for n in OUTPUT_PROJECTIONS)


def discover_nodes(model: nn.Module, facts: ArchFacts) -> list[NodeSpec]:
    """Nodes of a Transformers causal LM found from its modules (see the module docstring)."""
    nodes = []
    layers = {f"{facts.layer_prefix}.{i}" for i in range(facts.num_layers)}
    for path, module in model.named_modules():
        if not path:
            continue
        if path in layers:
            nodes.append(NodeSpec(path, path))
        elif _is_attention(module):
            nodes += [NodeSpec(f"{path}.{suffix}", f"{path}.{suffix}") for suffix in SUFFIXES]
        elif "weight" in dict(module.named_parameters(recurse=False)):
            nodes.append(NodeSpec(path, path))
    nodes.append(NodeSpec(LOGITS, "", reference=""))  # what the forward returns, after every module
    return nodes


def reference_nodes(model: nn.Module, facts: ArchFacts) -> tuple[list[NodeSpec], str | None]:
    """``(nodes, family name or None)``: the registered family's node map for this ``model_type``, else
    :func:`discover_nodes`."""
    from parity.model.registry import family_for_model_type

    family = family_for_model_type(facts.model_type, getattr(model, "config", None))
    if family is not None:
        return family.node_specs(facts), family.name
    return discover_nodes(model, facts), None
