"""The reference's nodes: its family's node map when a registered family has that ``model_type``,
else discovered from the reference's module tree (every module with a weight, every decoder layer,
the attention internals of every attention block, a mixture-of-experts block's router outputs and
experts, and what the forward returns). Used where no family builds the pair: a user's model, a golden trace of any checkpoint."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

from parity.model.facts import ArchFacts
from parity.model.pair import LOGITS, NodeSpec
from parity.record.hf_capture import OUTPUT_PROJECTIONS, SUFFIXES, experts_arguments
from parity.record.routing import CHOICES, ROUTER_OUTPUTS, WEIGHTS, is_router, returns_choice, router_outputs


def _is_attention(module: nn.Module, parent: nn.Module | None = None) -> bool:
    """An attention block: an output projection, and a class named ``...Attention`` or a forward that calls
    Transformers' attention interface (LongCat-Flash's ``LongcatFlashMLA``); or a forward calling that interface
    whose output projection is a sibling module's (BERT's and RoBERTa's ``attention.self`` beside
    ``attention.output.dense``, both children of ``parent``)."""
    calls = "attention_interface(" in (_source(type(module).forward) or "")
    if any(hasattr(module, n) for n in OUTPUT_PROJECTIONS):
        return type(module).__name__.endswith("Attention") or calls
    siblings = [m for m in parent.children() if m is not module] if parent is not None else []
    return calls and any(hasattr(m, n) for m in siblings for n in OUTPUT_PROJECTIONS)


@functools.cache
def _source(function: Callable) -> str | None:
    """The source of a module class's ``forward`` (read once per class), None when it cannot be read."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return None


def _router_weight(router: nn.Module) -> torch.Tensor | None:
    """A router's weight ``(experts, hidden)``: its own, or its one linear layer's (DBRX's ``router.layer``)."""
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight
    linears = [m for m in router.modules() if isinstance(m, nn.Linear)]
    return linears[0].weight if len(linears) == 1 else None


def _moe_parts(module: nn.Module) -> tuple[str, str, int, tuple[str, str] | None] | None:
    """``(router child, experts child, experts, routing arguments)`` of a mixture-of-experts block: a router
    (Transformers 5's ``...TopKRouter``: Mixtral, Qwen3-MoE, GPT-OSS, returning ``(logits, weights, chosen
    experts)``; or DBRX's, returning the logits, the block choosing) beside an experts module holding every
    expert's weights stacked (``gate_up_proj`` ``(experts, 2 I, H)``, GPT-OSS's biases ``(experts, 2 I)``
    beside them; DBRX's ``mlp.w1`` ``(experts * I, H)`` in a child). ``routing arguments``: for a router that
    returns its logits alone, the names of the experts' forward arguments holding the chosen experts and
    their weights (read there); None when the router returns them."""
    children = dict(module.named_children())
    router = next((n for n, c in children.items() if is_router(c)), None)
    weight = _router_weight(children[router]) if router else None
    if router is None or weight is None:
        return None
    experts = weight.shape[0]
    # a router that returns its choice (its weight its own, or a top-k gate's child linear, HunYuan-MoE's)
    chooses = getattr(children[router], "weight", None) is weight or returns_choice(children[router])
    for name, child in children.items():
        if name == router:
            continue
        own = list(child.parameters(recurse=False))
        # every expert's weights stacked (experts, ., .), their biases too (GPT-OSS: gate_up_proj_bias (experts, 2 I))
        # (LongCat-Flash's down_proj holds its routed experts alone, fewer: the zero-compute ones after have none)
        stacked = [p for p in own if p.dim() == 3]
        fits = bool(stacked) and stacked[0].shape[0] == experts
        if fits and chooses and all(p.dim() in (2, 3) and p.shape[0] <= experts for p in own):
            return router, name, experts, None
        # the experts' weights in a child, stacked along the rows (DBRX: experts.mlp.w1 (experts * I, H))
        inner = list(child.parameters())
        arguments = experts_arguments(child) if not own and not chooses else None
        if arguments is not None and inner and all(p.dim() == 2 and p.shape[0] % experts == 0 for p in inner):
            return router, name, experts, arguments[1:]
    return None


def calls_child(module: nn.Module, child: str) -> bool:
    """Whether ``module``'s forward calls its child ``child`` as a module (``self.layer(x)``, DBRX's router),
    rather than reading its weight in a function (``F.linear(x, self.classifier.weight)``, LongCat-Flash's): a
    child never called produces no output of its own. True when the source cannot be read."""
    source = _source(type(module).forward)
    return source is None or f"self.{child}(" in source


def _combines_more(module: nn.Module, router: str, experts: str) -> bool:
    """Whether a MoE block holds weights besides its router and experts (Qwen2-MoE's shared expert and its
    gate): its output is then more than the experts' weighted sum, and is compared as a node of its own."""
    own = any(True for _ in module.parameters(recurse=False))
    return own or any(
        name not in (router, experts) and any(True for _ in child.parameters())
        for name, child in module.named_children()
    )


def _moe_nodes(
    path: str,
    router: str,
    experts_child: str,
    experts: int,
    arguments: tuple[str, str] | None = None,
    router_returns: dict[str, int] | None = None,
) -> list[NodeSpec]:
    """A MoE block's nodes: the router's logits, its chosen experts (compared exactly, a different choice
    reported with the logits' margin) and weights (the router's outputs 2 and 1, or the experts' forward
    arguments ``arguments``), each expert's unweighted output on its tokens (captured by
    :mod:`parity.record.hf_capture`), and the experts' weighted sum. ``router_returns``: which of the router's
    outputs is which (:func:`parity.record.routing.router_outputs`); a router returning no choice has no choice
    or weights node."""
    gate, fused = f"{path}.{router}", f"{path}.{experts_child}"
    outputs = ROUTER_OUTPUTS if router_returns is None else router_returns
    logits = None if outputs["logits"] == 0 else f"{gate}#{outputs['logits']}"
    routing: list[NodeSpec] = []
    if arguments is not None or "chosen" in outputs:  # a router returning no choice (Llama 4's): nothing to compare
        chosen, weights = (
            (f"{gate}#{outputs['chosen']}", f"{gate}#{outputs['weights']}")
            if arguments is None
            else (f"{fused}@{a}" for a in arguments)
        )
        routing = [
            NodeSpec(f"{path}.{CHOICES}", f"{path}.{CHOICES}", reference=chosen, kind=CHOICES, chosen_from=gate),
            NodeSpec(f"{path}.{WEIGHTS}", f"{path}.{WEIGHTS}", reference=weights, kind=WEIGHTS),
        ]
    return [
        NodeSpec(gate, gate, reference=logits),
        *routing,
        *(NodeSpec(f"{fused}.{e}", f"{fused}.{e}", kind="expert") for e in range(experts)),
        NodeSpec(fused, fused, kind="experts"),
    ]


def discover_nodes(model: nn.Module, facts: ArchFacts) -> list[NodeSpec]:
    """Nodes of a Transformers causal LM found from its modules (see the module docstring)."""
    nodes = []
    layers = {facts.layer_path(i) for i in range(facts.num_layers)}
    inside_moe: set[str] = set()
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if not path or path in inside_moe:
            continue
        moe = _moe_parts(module)
        if path in layers:
            nodes.append(NodeSpec(path, path))
        elif _is_attention(module, modules.get(path.rpartition(".")[0])):
            nodes += [NodeSpec(f"{path}.{suffix}", f"{path}.{suffix}") for suffix in SUFFIXES]
        elif moe is not None:
            returns = router_outputs(dict(module.named_children())[moe[0]]) if moe[3] is None else None
            nodes += _moe_nodes(path, *moe, router_returns=returns)
            inside_moe |= {f"{path}.{moe[0]}", f"{path}.{moe[1]}"}
            router = dict(module.named_children())[moe[0]]
            inside_moe |= {f"{path}.{moe[0]}.{n}" for n, _ in router.named_children() if not calls_child(router, n)}
            if _combines_more(module, moe[0], moe[1]):  # a shared expert beside: the block's output is a node
                nodes.append(NodeSpec(path, path))
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
