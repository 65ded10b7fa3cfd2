"""Capture what Transformers computes outside nn.Modules: post-RoPE q/k, attention probabilities,
context, and each MoE expert's output.

Transformers models dispatch attention through ``AttentionInterface``. We register one function,
``parity_eager``, that calls the model's *own* ``eager_attention_forward`` (the reference math,
unchanged) and writes its inputs and outputs into the active trace. Transformers only builds a
mask for implementations it knows, so the same name is registered in ``AttentionMaskInterface``
with the eager mask; without that the function would receive ``attention_mask=None`` and the
reference would silently attend to every position.

Mixture-of-experts models (``@use_experts_implementation``) dispatch their fused experts through
``ExpertsInterface``; the default on a CPU is ``grouped_mm``, which sums an expert's contributions
in another order than the experts class's own eager loop. We register ``parity_eager`` there too:
the class's eager forward (the loop over experts, each a gated MLP on the tokens routed to it,
accumulated with ``index_add_`` in expert order), so the reference is the model's own reference
math, as with attention. Expert ``e``'s output node ``<experts path>.<e>`` is that same eager
forward run with every choice but ``e`` replaced by the sentinel index ``num_experts`` (which the
loop skips) and the routing weights set to 1: the expert's unweighted output on the tokens routed
to it, zero elsewhere, ``(tokens, hidden)``.
"""

from __future__ import annotations

import inspect
import re
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from parity.record import hf_kernels
from parity.record.hooks import active_trace
from parity.util.errors import ParityError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_IMPLEMENTATION = "parity_eager"
EXPERTS_IMPLEMENTATION = "parity_eager"
SUFFIXES = ("q_rot", "k_rot", "scores", "probs", "context")
#: the names an attention block's output projection goes by (Llama, OPT/BART, GPT-NeoX/Phi, GPT-2, T5)
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo", "Wo", "out_lin")  # Wo: ModernBERT's
#: a position table's name in Transformers' families (GPT-2's wpe, OPT's and XGLM's embed_positions, BERT's, GPT-1's
#: positions_embed)
POSITION_TABLES = ("embed_positions", "wpe", "position_embeddings", "positions_embed")
#: a fused q/k/v projection's name in Transformers' families (BLOOM/Falcon/NeoX, GPT-2, Phi-3, MPT, Baichuan)
FUSED_QKV = ("query_key_value", "c_attn", "qkv_proj", "Wqkv", "W_pack")
#: a node that is one expert of an experts module: ``...mlp.experts.<e>``
#: a node of one expert of a MoE block (``mlp.experts.3``)
EXPERT_NODE = re.compile(r"\.experts\.\d+$")


def is_captured(name: str) -> bool:
    """Whether the reference's node ``name`` is recorded by a capture function (attention internals
    and one expert's output here, kernel internals in :mod:`parity.record.hf_kernels`) rather than by a
    module hook."""
    return name.rsplit(".", 1)[-1] in SUFFIXES or bool(EXPERT_NODE.search(name)) or hf_kernels.is_kernel_node(name)


_paths: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


#: a modeling module whose ``eager_attention_forward`` parity replaced by its recording one -> the original
_ORIGINAL_EAGER: dict[str, Any] = {}
#: modeling code that takes another path under any attention implementation but Transformers' own (a DSA
#: top-k index mask built only ``if self.config._attn_implementation in ("eager", "sdpa")``)
_NAMED_BRANCH = re.compile(r"_attn_implementation\s*(?:in\s*\(\s*\"eager\"|==\s*\"eager\")")


def _eager_for(module: nn.Module):
    modeling = sys.modules[type(module).__module__]
    eager = _ORIGINAL_EAGER.get(modeling.__name__) or getattr(modeling, "eager_attention_forward", None)
    if eager is None:
        raise ParityError(f"{type(module).__name__} has no eager_attention_forward in {modeling.__name__}")
    return eager


def _scores(module, query, key, scaling) -> torch.Tensor:
    """``(q @ k^T) * scaling`` before soft-cap and mask, with the ops eager attention uses (so the
    same bits): K heads expanded as ``repeat_kv`` does (each KV head repeated for its group)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        b, kv, s, d = key.shape
        key = key[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)
    return torch.matmul(query, key.transpose(2, 3)).mul_(scaling)  # in place: one matrix, not two, at a time


def _merge_heads(output: torch.Tensor) -> torch.Tensor:
    """Eager attention's output ``(batch, seq, heads, head_dim)`` as ``(batch, seq, heads * head_dim)``."""
    return output.reshape(*output.shape[:2], -1)


def parity_attention(module, query, key, value, attention_mask, **kwargs):
    """AttentionInterface function: the model's eager attention, recorded.

    Records ``<path>.q_rot`` ``(batch, heads, seq, head_dim)``, ``<path>.k_rot`` ``(batch, kv_heads,
    seq, head_dim)``, ``<path>.scores`` and ``<path>.probs`` ``(batch, heads, q_len, kv_len)`` (scores:
    ``q k^T * scaling`` before soft-cap and mask) and ``<path>.context`` ``(batch, seq, heads * head_dim)``.
    """
    output, weights = _eager_for(module)(module, query, key, value, attention_mask, **kwargs)
    trace = active_trace()
    path = _paths.get(module)
    if trace is not None and path is not None:
        # the context is recorded as the output the model goes on with, its heads merged by the trace:
        # a gradient hook on that live tensor sees what flows back (a reshape made here would see none)
        for suffix, tensor in zip(SUFFIXES, (query, key, None, weights, output)):
            name = f"{path}.{suffix}"
            if name in trace.wanted:
                if suffix == "scores":
                    tensor = _scores(module, query, key, kwargs.get("scaling", getattr(module, "scaling", 1.0)))
                trace.add(name, tensor, _merge_heads if suffix == "context" else None)
    return output, weights


@dataclass(frozen=True)
class ExpertEvidence:
    """What diagnosis may ask of one expert node of the reference: the experts module (its weights,
    referenced), this expert's index, the experts' input ``(tokens, hidden)`` and the tokens routed
    to this expert. Never compared."""

    #: a Transformers experts module (gate_up_proj, down_proj, act_fn, num_experts)
    module: Any
    index: int
    x: torch.Tensor
    rows: torch.Tensor
    #: ``run(module, x, chosen, weights)``: the class's own (eager) forward, for an expert of another layout
    run: Any = None

    def output(
        self,
        j: int,
        swap_halves: bool = False,
        interleaved: bool = False,
        down_transposed: bool = False,
        down_viewed: bool = False,
    ) -> torch.Tensor | None:
        """Expert ``j`` of the reference (with its gate and up halves swapped, the fused rows read as
        interleaved gate/up pairs, its square down projection transposed, or its ``(H, I)`` down projection
        viewed as ``(I, H)`` where a transpose was meant, when asked) on this expert's tokens, in float64,
        ``(len(rows), hidden)``; None for a layout other than Transformers' default (gate then up
        concatenated, ``(E, 2I, H)``, no bias)."""
        m = self.module
        if (
            getattr(m, "is_transposed", False)
            or not getattr(m, "is_concatenated", True)
            or getattr(m, "has_bias", False)
            or not getattr(m, "has_gate", True)
            or not hasattr(m, "gate_up_proj")
            or not hasattr(m, "act_fn")  # an activation of its own (HunYuan v4's clamped SwiGLU): its forward runs
        ):
            if self.run is None or swap_halves or interleaved or down_transposed or down_viewed:
                return None
            # another layout (GPT-OSS's clamped SwiGLU with biases, DBRX's stacked w1/v1/w2): the class's forward
            with torch.no_grad():
                alone = _expert_alone(self.run, m, self.x[self.rows], torch.ones(len(self.rows), dtype=torch.bool), j)
            return alone.double()
        if m.down_proj is None or j >= m.down_proj.shape[0]:
            return None  # no weights of its own (LongCat-Flash's zero-compute experts pass their input on)
        fused = m.gate_up_proj[j].detach().double()
        gate, up = (fused[0::2], fused[1::2]) if interleaved else fused.chunk(2, dim=0)
        if swap_halves:
            gate, up = up, gate
        x = self.x[self.rows].double()
        down = m.down_proj[j].detach().double()
        if down_transposed:
            if down.shape[0] != down.shape[1]:
                return None
            down = down.T
        if down_viewed:  # (H, I) read as (I, H) and used as x @ W
            down = down.reshape(down.shape[1], down.shape[0]).T
        if _gates_up(m.act_fn):  # an activation of the gate and up halves together (Inkling-2's soft-capped SwiGLU)
            return nn.functional.linear(m.act_fn(x @ gate.T, x @ up.T), down)
        return nn.functional.linear(m.act_fn(x @ gate.T) * (x @ up.T), down)

    @property
    def num_experts(self) -> int:
        return experts_count(self.module)


def _gates_up(act) -> bool:
    """Whether an experts module's ``act_fn`` takes the gate and the up halves both (``act_fn(gate, up)``, the
    gated product) rather than the gate alone."""
    forward = getattr(type(act), "forward", None) if isinstance(act, nn.Module) else act
    if not callable(forward):
        return False
    try:
        params = [p for p in inspect.signature(forward).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return False
    return len([p for p in params if p.default is inspect.Parameter.empty]) >= 2


def experts_count(module: nn.Module) -> int:
    """How many experts a Transformers experts module chooses among: ``num_experts``, or LongCat-Flash's
    ``total_experts`` (its routed experts and its zero-compute identity experts after them)."""
    count = getattr(module, "num_experts", None)
    return int(cast(int, count if count is not None else module.total_experts))


def _eager_experts(module: nn.Module):
    """The experts class's own forward, before ``use_experts_implementation`` wrapped it."""
    forward = type(module).forward
    eager = getattr(forward, "__wrapped__", None)
    if eager is None:
        raise ParityError(f"{type(module).__name__} has no eager forward under its experts implementation")
    return eager


def parity_experts(module, hidden_states, top_k_index, top_k_weights):
    """ExpertsInterface function: the experts class's eager forward, and each wanted expert's output.

    Records ``<path>.<e>`` ``(tokens, hidden)``: expert ``e`` on the tokens routed to it, unweighted,
    zero on the others (see the module docstring).
    """
    eager = _eager_experts(module)
    output = eager(module, hidden_states, top_k_index, top_k_weights)
    _record_experts(module, eager, hidden_states, top_k_index, top_k_weights)
    return output


def _record_experts(module, eager, hidden_states, top_k_index, top_k_weights) -> None:
    """Each wanted expert's output node ``<path>.<e>`` and its evidence (see :func:`parity_experts`);
    ``eager(module, hidden_states, chosen, weights)``: the class's own forward."""
    trace = active_trace()
    path = _paths.get(module)
    if trace is not None and path is not None:
        sentinel = experts_count(module)
        ones = torch.ones_like(top_k_weights)
        x = None  # one CPU copy of the input, shared by every expert's evidence
        for e in range(sentinel):
            name = f"{path}.{e}"
            if name in trace.wanted:
                chosen = top_k_index == e
                only = torch.where(chosen, top_k_index, torch.full_like(top_k_index, sentinel))
                try:
                    alone = eager(module, hidden_states, only, ones)
                except (RuntimeError, IndexError, ValueError):  # a class that takes no sentinel (GPT-OSS's one_hot)
                    alone = _expert_alone(eager, module, hidden_states, chosen.any(-1), e)
                trace.add(name, alone)
                if name not in trace.extras:
                    x = (
                        hidden_states.detach().reshape(-1, hidden_states.shape[-1]).to("cpu", copy=True)
                        if x is None
                        else x
                    )
                    routed = chosen.reshape(-1, chosen.shape[-1]).any(-1).nonzero().flatten().cpu()
                    trace.extras[name] = ExpertEvidence(module, e, x, routed, eager)


#: the experts modules :func:`_hooks_experts` hooked (once each)
_HOOKED_EXPERTS: weakref.WeakSet = weakref.WeakSet()


def _experts_hook(module, args, kwargs, output) -> None:
    """A forward hook on an experts module whose class takes no experts implementation (DBRX's): each
    expert's output recorded as :func:`parity_experts` does, from the class's own forward."""
    values = [*args, *kwargs.values()]
    if len(values) >= 3 and all(isinstance(v, torch.Tensor) for v in values[:3]):
        with torch.no_grad():
            _record_experts(module, type(module).forward, *values[:3])


def experts_arguments(module: nn.Module) -> tuple[str, str, str] | None:
    """The names of an experts module's forward arguments, ``(hidden_states, chosen experts, their
    weights)``, when its class is named ``...Experts`` and its forward takes those three; else None."""
    if not type(module).__name__.endswith("Experts"):
        return None
    try:
        names = [n for n in inspect.signature(type(module).forward).parameters if n != "self"]
    except (TypeError, ValueError):
        return None
    return (names[0], names[1], names[2]) if len(names) == 3 else None


def _hooks_experts(reference: nn.Module) -> None:
    """:func:`_experts_hook` on every experts module (:func:`experts_arguments`) that no experts
    implementation dispatches."""
    for module in reference.modules():
        if hasattr(type(module).forward, "__wrapped__") or experts_arguments(module) is None:
            continue
        if module not in _HOOKED_EXPERTS:
            module.register_forward_hook(_experts_hook, with_kwargs=True)
            _HOOKED_EXPERTS.add(module)


def _expert_alone(eager, module, hidden_states: torch.Tensor, routed: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e``'s unweighted output on the tokens ``routed`` to it (zero on the others), from the class's
    eager forward run on those tokens alone, each choosing ``e`` only with weight 1."""
    rows = routed.nonzero().flatten()
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = torch.zeros_like(x)
    if rows.numel():
        index = torch.full((rows.numel(), 1), e, dtype=torch.long, device=x.device)
        weights = torch.ones(rows.numel(), 1, dtype=x.dtype, device=x.device)
        try:
            alone = eager(module, x[rows], index, weights)
        except ValueError:  # a class that squeezes the top-k axis (LongCat-Flash's): e chosen twice, each half
            alone = eager(module, x[rows], index.expand(-1, 2), weights.expand(-1, 2) / 2)  # y/2 + y/2 = y exactly
        out[rows] = alone.reshape(rows.numel(), -1)
    return out.reshape(hidden_states.shape)


@dataclass(frozen=True)
class HeadsLayout:
    """The reference's own layout of an attention internal captured from its functions (a model whose
    attention does not go through AttentionInterface: Falcon's): ``q_rot``/``k_rot`` ``(batch, heads,
    seq, head_dim)`` (keys expanded to the query heads taken back to the KV heads), ``context``
    ``(batch, heads, seq, head_dim)`` -> ``(batch, seq, heads * head_dim)`` as the interface's."""

    kind: str
    heads: int
    kv_heads: int
    head_dim: int

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() != 4:
            return t
        if self.kind == "context" and t.shape[1] == self.heads:
            return t.transpose(1, 2).flatten(-2)
        if self.kind == "k_rot" and t.shape[1] == self.heads != self.kv_heads:
            return t[:, :: self.heads // self.kv_heads]
        return t


def functional_internals(names: list[str], facts) -> tuple[dict[str, str], dict[str, HeadsLayout]]:
    """``(taps, layouts)`` to record a reference's attention internals from the functions its attention
    calls (:mod:`parity.record.functional`), for a model that does not dispatch through
    AttentionInterface: each node ``<block>.<suffix>`` is the tap of that name under the block."""
    taps, layouts = {}, {}
    for name in names:
        kind = name.rsplit(".", 1)[-1]
        if kind not in SUFFIXES:
            continue
        taps[name] = name
        index = facts.locate(name)[0]
        layer = facts.layer(index)
        kv_heads = (layer.num_kv_heads if layer is not None else 0) or facts.num_kv_heads or facts.num_heads
        layouts[name] = HeadsLayout(kind, facts.heads_at(index), kv_heads, facts.head_dim)
    return taps, layouts


def dispatches(reference: nn.Module) -> bool:
    """Whether ``reference`` computes attention through Transformers' AttentionInterface (Transformers' own
    test: the flag, or, for models without it such as Qwen3.5, attention modules calling
    ``ALL_ATTENTION_FUNCTIONS.get_interface``, which is what ``set_attn_implementation`` accepts). One that
    does not (Falcon's own attention) has no attention internals to capture: its q_rot, scores, probs
    and context are no nodes, its modules still are."""
    can_set = getattr(type(reference), "_can_set_attn_implementation", lambda: False)
    return bool(getattr(reference, "_supports_attention_backend", False) or can_set())


def _eager_by_name(reference: nn.Module) -> bool:
    """For modeling code that branches on the implementation's name (:data:`_NAMED_BRANCH`): the reference kept
    on Transformers' own ``"eager"`` and its module's ``eager_attention_forward`` replaced by the recording one
    (which calls the original), so that the reference takes the path eager takes; False for any other code."""
    modeling = sys.modules[type(reference).__module__]
    try:
        source = inspect.getsource(modeling)
    except (OSError, TypeError):
        return False
    if not _NAMED_BRANCH.search(source) or not callable(getattr(modeling, "eager_attention_forward", None)):
        return False
    if modeling.__name__ not in _ORIGINAL_EAGER:
        _ORIGINAL_EAGER[modeling.__name__] = getattr(modeling, "eager_attention_forward")  # noqa: B009
        setattr(modeling, "eager_attention_forward", parity_attention)  # noqa: B010
    cast("PreTrainedModel", reference).set_attn_implementation("eager")
    return True


def install(reference: nn.Module) -> None:
    """Register ``parity_eager`` (attention + mask) and switch ``reference`` to it (once per model);
    wrap the kernel functions its linear-attention layers call (:mod:`parity.record.hf_kernels`). A
    model that does not dispatch attention through AttentionInterface (:func:`dispatches`) runs as it
    is: nothing inside its attention is captured."""
    hf_kernels.install(reference)
    if reference in _paths and (
        getattr(reference.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
        or type(reference).__module__ in _ORIGINAL_EAGER
    ):
        return
    if not dispatches(reference):
        for name, module in reference.named_modules():
            _paths[module] = name
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    model = cast("PreTrainedModel", reference)  # a Transformers model: its own methods below
    if not _eager_by_name(reference):
        AttentionInterface.register(ATTN_IMPLEMENTATION, parity_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model._can_set_experts_implementation() and getattr(reference.config, "_experts_implementation", None):
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, parity_experts)
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    _hooks_experts(reference)
    for name, module in reference.named_modules():
        _paths[module] = name
