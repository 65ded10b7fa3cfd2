"""The reference's nodes: its family's node map when a registered family has that ``model_type``,
else discovered from the reference's module tree (every module with a weight, every decoder layer,
the attention internals of every attention block, a mixture-of-experts block's router outputs and
experts, and what the forward returns). Used where no family builds the pair: a user's model, a golden trace of any checkpoint."""

from __future__ import annotations

from torch import nn

from parity.model.facts import ArchFacts
from parity.model.pair import LOGITS, NodeSpec
from parity.record.hf_capture import OUTPUT_PROJECTIONS, SUFFIXES
from parity.record.routing import CHOICES, WEIGHTS, is_router


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and any(hasattr(module, n) for n in OUTPUT_PROJECTIONS)


def _moe_parts(module: nn.Module) -> tuple[str, str, int] | None:
    """``(router child, experts child, experts)`` of a mixture-of-experts block: a router returning
    ``(logits, weights, chosen experts)`` (Transformers 5's ``...TopKRouter``: Mixtral, Qwen3-MoE) beside
    an experts module holding every expert's weights stacked (``gate_up_proj`` ``(experts, 2 I, H)``)."""
    children = dict(module.named_children())
    router = next((n for n, c in children.items() if is_router(c)), None)
    weight = getattr(children.get(router), "weight", None) if router else None
    if router is None or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return None
    experts = weight.shape[0]
    for name, child in children.items():
        own = list(child.parameters(recurse=False))
        if name != router and own and all(p.dim() == 3 and p.shape[0] == experts for p in own):
            return router, name, experts
    return None


def _moe_nodes(path: str, router: str, experts_child: str, experts: int) -> list[NodeSpec]:
    """A MoE block's nodes: the router's logits, its chosen experts (compared exactly, a different choice
    reported with the logits' margin) and weights (outputs 2 and 1), each expert's unweighted output on
    its tokens (captured by :mod:`parity.record.hf_capture`), and the experts' weighted sum."""
    gate, fused = f"{path}.{router}", f"{path}.{experts_child}"
    return [
        NodeSpec(gate, gate),
        NodeSpec(f"{path}.{CHOICES}", f"{path}.{CHOICES}", reference=f"{gate}#2", kind=CHOICES, chosen_from=gate),
        NodeSpec(f"{path}.{WEIGHTS}", f"{path}.{WEIGHTS}", reference=f"{gate}#1", kind=WEIGHTS),
        *(NodeSpec(f"{fused}.{e}", f"{fused}.{e}", kind="expert") for e in range(experts)),
        NodeSpec(fused, fused, kind="experts"),
    ]


def discover_nodes(model: nn.Module, facts: ArchFacts) -> list[NodeSpec]:
    """Nodes of a Transformers causal LM found from its modules (see the module docstring)."""
    nodes = []
    layers = {f"{facts.layer_prefix}.{i}" for i in range(facts.num_layers)}
    inside_moe: set[str] = set()
    for path, module in model.named_modules():
        if not path or path in inside_moe:
            continue
        moe = _moe_parts(module)
        if path in layers:
            nodes.append(NodeSpec(path, path))
        elif _is_attention(module):
            nodes += [NodeSpec(f"{path}.{suffix}", f"{path}.{suffix}") for suffix in SUFFIXES]
        elif moe is not None:
            nodes += _moe_nodes(path, *moe)
            inside_moe |= {f"{path}.{moe[0]}", f"{path}.{moe[1]}"}
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
