"""KV-cache runs: prefill (whole or in chunks), then single-token decode steps, compared node by node
at every step, with the caches themselves compared after each step.

The reference runs exactly as ``generate`` drives it: one Transformers ``DynamicCache`` (sliding
layers keep ``window - 1`` tokens; linear-attention layers a ``LinearAttentionLayer``: the short
conv's last ``K`` inputs and the recurrent state), the attention mask over every token so far,
``position_ids`` counted over each row's real tokens. Ours runs the same schedule with its own cache:
a model exposes ``new_cache()`` (whose ``layers[i].keys`` / ``.values`` are the keys after RoPE and
the values, ``(batch, kv_heads, tokens held, head_dim)``; a linear-attention layer's
``layers[i].conv_state`` / ``.recurrent_state`` instead, see :data:`CACHE_PARTS`) and takes
``cache=`` in its forward; that is the whole protocol, for our families and for a user's model alike.

A user's model with another cache API is driven through a :class:`CacheProtocol` (three small
functions) given to :func:`parity.check_model` as ``cache_protocol=``.

Nodes are named per step: ``step3/model.layers.0.self_attn.k_rot`` (after the cache update: the keys
attention reads, past and new), and ``step3/model.layers.0.self_attn.cache.keys`` / ``.values`` after
the step (``step3/model.layers.0.linear_attn.cache.conv_state`` / ``.recurrent_state`` for a
linear-attention layer). Decode steps feed the reference's greedy token to both models (teacher forcing), so every
step compares the same inputs; whether ours would have chosen the same token, and by what margin, is
reported beside (``greedy``), as is the agreement of ours' cached logits with ours' own full
forward of the same prefix (``consistency``: a cache bug shows there even without a reference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch

from parity.compare.metrics import SHAPE
from parity.compare.results import NodeResult, compare_traces, first_mismatch
from parity.compare.tolerances import Tolerances
from parity.diagnose.detectors import diagnose
from parity.diagnose.hints import Hint
from parity.model.pair import NodeSpec, Pair
from parity.record import hf_capture, hf_kernels
from parity.record.hooks import recording
from parity.record.trace import Trace
from parity.run.options import DecodePlan
from parity.run.stages import ours_recording, run_ours, untapped_nodes
from parity.util.errors import ParityError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: a logit margin (top-1 minus top-2 of the reference) below this is a near-tie, not a bug
NEAR_TIE = 1e-2


@dataclass
class DecodeOutcome:
    """What a decode check found beside the nodes: per step, ours' cached logits against ours' own
    full forward (``consistency``), and greedy tokens with the first step where ours' choice differs."""

    plan: DecodePlan
    steps: list[tuple[int, int]]
    consistency: list[float] = field(default_factory=list)
    tokens_reference: list[list[int]] = field(default_factory=list)
    tokens_ours: list[list[int]] = field(default_factory=list)
    first_divergent_step: int | None = None
    margin: float | None = None
    near_tie: bool = False

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.describe(),
            "steps": [list(s) for s in self.steps],
            "consistency_max_abs": self.consistency,
            "greedy_reference": self.tokens_reference,
            "greedy_ours": self.tokens_ours,
            "first_divergent_step": self.first_divergent_step,
            "margin": self.margin,
            "near_tie": self.near_tie,
        }

    def lines(self) -> list[str]:
        out = []
        worst = max(self.consistency, default=0.0)
        out.append(
            f"cached vs full forward (ours alone): max |difference| {worst:.3g} over {len(self.consistency)} steps"
        )
        if self.first_divergent_step is None:
            out.append(
                f"greedy tokens: ours chooses the reference's token at every one of {len(self.tokens_reference)} steps"
            )
        else:
            tie = f" (a near-tie: the reference's top two logits are within {NEAR_TIE:g})" if self.near_tie else ""
            out.append(
                f"greedy tokens: ours first chooses another token at step {self.first_divergent_step}, where the "
                f"reference's margin between its top two logits is {self.margin:.3g}{tie}"
            )
        return out


@dataclass(frozen=True)
class CacheProtocol:
    """How to run a model with its KV cache, for a model whose API is not ours.

    ``new_cache(model)`` -> an empty cache; ``forward(model, input_ids, attention_mask, position_ids,
    cache)`` -> logits ``(batch, new, vocab)`` for this call's tokens ``input_ids`` ``(batch, new)``,
    given the mask over every token so far ``(batch, so far)`` (or None without padding) and the
    positions of the new tokens ``(batch, new)``, updating ``cache``; ``layers(cache)`` -> per layer
    ``(keys, values)``, each ``(batch, kv_heads, held, head_dim)`` with the oldest token first (keys
    after RoPE), or ``(None, None)`` for a layer without a cache. A sliding layer should hold the last
    ``window - 1`` tokens, as Transformers does; one that holds more is reported (``cache_length``).

    A layer whose cache is not keys and values gives a mapping of its parts instead (see
    :data:`CACHE_PARTS`): a linear-attention layer ``{"conv_state": (batch, channels, K) the short
    conv's last K inputs, oldest first, "recurrent_state": (batch, v_heads, d_k, d_v)}``. A pair
    ``(keys, values)`` stands for ``{"keys": keys, "values": values}``, so a protocol written for
    attention-only models needs no change.
    """

    new_cache: Callable
    forward: Callable
    layers: Callable


#: what a layer's cache holds, by the node that names its module (``<module>.<anchor>``): the parts
#: compared after every step as ``<module>.cache.<part>``. Keys (after RoPE) and values ``(batch,
#: kv_heads, held, head_dim)``; a linear-attention layer's short-conv inputs ``(batch, channels, K)``
#: and recurrent state ``(batch, v_heads, d_k, d_v)`` (Transformers' ``LinearAttentionLayer``).
CACHE_PARTS = {"k_rot": ("keys", "values"), "recurrent_state": ("conv_state", "recurrent_state")}
#: the axis of each part that counts tokens held (a cache of another length: ``cache_length``)
HELD_AXIS = {"keys": -2, "values": -2, "conv_state": -1}


def _our_layers(cache) -> list[dict]:
    """Per layer, the parts of :data:`CACHE_PARTS` it holds as attributes (None: not held)."""
    parts = {p for ps in CACHE_PARTS.values() for p in ps}
    return [{p: getattr(layer, p, None) for p in parts} for layer in cache.layers]


#: our families' protocol: ``model.new_cache()``, ``model(ids, attention_mask=, position_ids=, cache=)``,
#: ``cache.layers[i].keys`` / ``.values`` (``.conv_state`` / ``.recurrent_state``)
DEFAULT_PROTOCOL = CacheProtocol(
    new_cache=lambda model: model.new_cache(),
    forward=lambda model, ids, mask, positions, cache: model(
        ids, attention_mask=mask, position_ids=positions, cache=cache
    ),
    layers=_our_layers,
)


def fed_token(logits: torch.Tensor, placeholders: tuple[int, ...] = ()) -> torch.Tensor:
    """The greedy token of ``logits`` ``(batch, vocab)`` among those the text model can be fed: a
    multimodal placeholder (``ArchFacts.placeholder_tokens``, which the reference swaps out) never is."""
    if placeholders:
        logits = logits.clone()
        logits[:, list(placeholders)] = float("-inf")
    return logits.argmax(-1)


def _step(k: int, name: str) -> str:
    return f"step{k}/{name}"


def _cache_stems(pair: Pair) -> dict[int, tuple[str, tuple[str, ...]]]:
    """Layer index -> (the canonical path of the module whose cache it is, the parts that cache holds),
    for the layers that keep a cache of their own (a KV-shared layer reads its source layer's): an
    attention module from its ``k_rot`` node, a linear-attention module from its ``recurrent_state``."""

    def own(i: int) -> bool:
        layer = pair.facts.layer(i)
        return layer is None or layer.kv_source is None

    return {
        n.layer: (n.name[: -len(n.kind) - 1], CACHE_PARTS[n.kind])
        for n in pair.nodes
        if n.kind in CACHE_PARTS and n.layer is not None and own(n.layer)
    }


def _parts(entry) -> dict:
    """One layer's entry of ``CacheProtocol.layers``: a mapping of parts, or the pair ``(keys, values)``."""
    if entry is None:
        return {}
    if isinstance(entry, Mapping):
        return dict(entry)
    keys, values = entry
    return {"keys": keys, "values": values}


def _cache_tensors(layers: list, stems: dict[int, tuple[str, tuple[str, ...]]]) -> dict[str, torch.Tensor]:
    """``{<module path>.cache.<part>: tensor}`` from the per-layer entries of ``CacheProtocol.layers``
    (a part a layer does not hold is left out: its node is then missing on that side)."""
    out = {}
    for i, (stem, parts) in stems.items():
        held = _parts(layers[i]) if i < len(layers) else {}
        for part in parts:
            if held.get(part) is not None:
                out[f"{stem}.cache.{part}"] = held[part].detach().to("cpu", copy=True)
    return out


def _reference_layers(cache) -> list[dict]:
    """Per layer of a Transformers cache: its keys and values, and a linear-attention layer's conv and
    recurrent state (``LinearAttentionLayer`` keeps one of each here: state index 0)."""
    out = []
    for layer in cache.layers:
        parts = {"keys": getattr(layer, "keys", None), "values": getattr(layer, "values", None)}
        if hasattr(layer, "conv_states"):
            parts.update(conv_state=layer.conv_states.get(0), recurrent_state=layer.recurrent_states.get(0))
        out.append(parts)
    return out


def _prefixed(trace: Trace, k: int) -> Trace:
    out = Trace()
    out.tensors = {_step(k, n): t for n, t in trace.tensors.items()}
    out.calls = {_step(k, n): c for n, c in trace.calls.items()}
    out.inputs = {_step(k, n): t for n, t in trace.inputs.items()}
    out.weights = {_step(k, n): t for n, t in trace.weights.items()}
    out.biases = {_step(k, n): t for n, t in trace.biases.items()}
    return out


def _inputs_for_trace(pair: Pair) -> frozenset[str]:
    kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "norm", "layernorm")
    return frozenset(n.name for n in pair.nodes if any(k in n.kind for k in kinds) and "@" not in n.kind)


def _trace_reference_step(pair: Pair, ids, mask, positions, cache) -> tuple[Trace, torch.Tensor]:
    captured = [n.name for n in pair.nodes if hf_capture.is_captured(n.name)]
    points = [(n.name, n.reference_path) for n in pair.nodes if n.name not in captured]
    views = {n.name: n.reference_transform for n in pair.nodes if n.reference_transform is not None}
    kernels = any(hf_kernels.is_kernel_node(name) for name in captured)  # named after the module that calls them
    with (
        torch.inference_mode(),
        recording(
            pair.reference,
            points,
            transforms=views,
            captured=captured,
            keep_inputs=_inputs_for_trace(pair),
            module_stack=kernels,
        ) as trace,
    ):
        try:
            out = pair.reference(
                input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
            )
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ParityError(
                f"the reference ({type(pair.reference).__name__}) cannot decode this config: {reason[:300]}"
            ) from None
    return trace, out.logits


def _trace_ours_step(pair: Pair, protocol: CacheProtocol, ids, mask, positions, cache) -> tuple[Trace, torch.Tensor]:
    with (
        torch.inference_mode(),
        recording(pair.ours, keep_inputs=_inputs_for_trace(pair), **ours_recording(pair)) as trace,
    ):
        logits = run_ours(pair, protocol.forward, pair.ours, ids, mask, positions, cache)
    return trace, logits


#: layer types whose cache is keys and values
KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
#: layer types a decode check steps and compares (keys and values, or a linear-attention state)
CACHED_LAYER_TYPES = KV_LAYER_TYPES | {"linear_attention"}


def new_caches(pair: Pair, protocol: CacheProtocol):
    """``(reference cache, ours' cache)``: a Transformers DynamicCache and ours' (through ``protocol``)."""
    from transformers import DynamicCache

    if protocol is DEFAULT_PROTOCOL and not callable(getattr(pair.ours, "new_cache", None)):
        raise ParityError(
            f"{type(pair.ours).__name__} has no new_cache(): a decode check needs ours to keep a KV cache "
            "(new_cache() -> object with layers[i].keys / .values, and forward(..., cache=)), or a "
            "parity.run.decode.CacheProtocol given to check_model(cache_protocol=...)"
        )
    uncached = [i for i, layer in enumerate(pair.facts.layers) if layer.layer_type not in CACHED_LAYER_TYPES]
    if uncached:
        kinds = sorted({pair.facts.layers[i].layer_type for i in uncached})
        raise ParityError(
            f"decode checks compare caches of {', '.join(sorted(CACHED_LAYER_TYPES))} layers; layers {uncached[:8]} "
            f"are {', '.join(kinds)}, whose cache parity's decode does not step yet: check without --decode"
        )
    return DynamicCache(config=cast("PreTrainedModel", pair.reference).config), protocol.new_cache(pair.ours)


def _cache_hint(
    result: NodeResult, ours: torch.Tensor | None, ref: torch.Tensor | None, window: int | None
) -> Hint | None:
    """A cache part of another length than the reference's (the same shape but along the axis that
    counts tokens): a ``cache_length`` hint."""
    part = result.kind.split(".", 1)[-1]
    axis = HELD_AXIS.get(part)
    if axis is None or ours is None or ref is None or ours.dim() != ref.dim() or ours.shape[axis] == ref.shape[axis]:
        return None
    if [n for d, n in enumerate(ours.shape) if d != ours.dim() + axis] != [
        n for d, n in enumerate(ref.shape) if d != ref.dim() + axis
    ]:
        return None
    held, expected = ours.shape[axis], ref.shape[axis]
    if part == "conv_state":
        return Hint(
            "cache_length",
            f"likely the conv state's length: ours keeps the last {held} inputs of the short convolution at this "
            f"layer, the reference {expected} (the kernel's width: one more than the next output reads)",
            {"ours": held, "reference": expected, "window": None},
        )
    what = f" (a sliding layer with window {window} keeps window - 1 = {window - 1} tokens)" if window else ""
    return Hint(
        "cache_length",
        f"likely the KV cache's length: ours holds {held} tokens at this layer after the step, the reference "
        f"{expected}{what}: {'not trimmed to the window when several tokens arrive at once' if window and held > expected else 'trimmed differently'}",
        {"ours": held, "reference": expected, "window": window},
    )


def run_decode(
    pair: Pair, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, plan: DecodePlan, tolerances: Tolerances
) -> tuple[list[NodeResult], DecodeOutcome]:
    """Every step's nodes compared (step order, then the reference's execution order within a step),
    the first failure diagnosed, and the step-wise consistency and greedy summaries."""
    from parity.run.plan import generation_positions

    hf_capture.install(pair.reference)
    batch = input_ids.shape[0]
    ids = torch.cat([input_ids, torch.zeros(batch, plan.steps, dtype=input_ids.dtype)], dim=1)
    mask = (
        torch.ones(batch, plan.total, dtype=torch.long)
        if attention_mask is None
        else torch.cat([attention_mask.long(), torch.ones(batch, plan.steps, dtype=torch.long)], dim=1)
    )
    positions = generation_positions(mask if attention_mask is not None else None, batch, plan.total)
    protocol = pair.cache_protocol or DEFAULT_PROTOCOL
    ref_cache, our_cache = new_caches(pair, protocol)
    stems = _cache_stems(pair)
    outcome = DecodeOutcome(plan, plan.schedule())
    results: list[NodeResult] = []
    traces: list[tuple[Trace, Trace, torch.Tensor]] = []
    untapped = untapped_nodes(pair)
    for k, (a, b) in enumerate(outcome.steps):
        step_mask = mask[:, :b] if attention_mask is not None else None
        ref_trace, ref_logits = _trace_reference_step(pair, ids[:, a:b], step_mask, positions[:, a:b], ref_cache)
        our_trace, our_logits = _trace_ours_step(pair, protocol, ids[:, a:b], step_mask, positions[:, a:b], our_cache)
        ref_trace.tensors.update(_cache_tensors(_reference_layers(ref_cache), stems))
        our_trace.tensors.update(_cache_tensors(protocol.layers(our_cache), stems))
        specs = [replace(n, name=_step(k, n.name)) for n in pair.nodes]
        specs += [
            NodeSpec(_step(k, f"{stem}.cache.{part}"), "", layer=i, kind=f"cache.{part}")
            for i, (stem, parts) in stems.items()
            for part in parts
        ]
        step_results = compare_traces(
            _prefixed(our_trace, k),
            _prefixed(ref_trace, k),
            specs,
            tolerances,
            frozenset(_step(k, n) for n in untapped),
        )
        results += [replace(r, index=len(results) + j) for j, r in enumerate(step_results)]
        traces.append((_prefixed(our_trace, k), _prefixed(ref_trace, k), positions[:, a:b]))
        # beside the nodes: ours against its own full forward, and the greedy choice of each model
        with torch.inference_mode():  # the same prefix through a fresh cache, in one call
            full = run_ours(
                pair,
                protocol.forward,
                pair.ours,
                ids[:, :b],
                mask[:, :b] if attention_mask is not None else None,
                positions[:, :b],
                protocol.new_cache(pair.ours),
            )
        outcome.consistency.append(float((full[:, a:b].double() - our_logits.double()).abs().max()))
        ref_next, our_next = ref_logits[:, -1].argmax(-1), our_logits[:, -1].argmax(-1)
        outcome.tokens_reference.append(ref_next.tolist())
        outcome.tokens_ours.append(our_next.tolist())
        if outcome.first_divergent_step is None and not torch.equal(ref_next, our_next):
            top2 = ref_logits[:, -1].double().topk(2, dim=-1).values
            margin = float((top2[:, 0] - top2[:, 1]).min())
            outcome.first_divergent_step, outcome.margin, outcome.near_tie = k, margin, margin < NEAR_TIE
        if plan.prefill <= b < plan.total:  # the next decode step feeds the reference's greedy choice to both
            ids[:, b] = fed_token(ref_logits[:, -1], pair.facts.placeholder_tokens)
    bad = first_mismatch(results)
    if bad is not None:
        step = int(bad.name.split("/", 1)[0][len("step") :])
        ours_t, ref_t, step_positions = traces[step]
        hint = None
        if bad.kind.startswith("cache.") and bad.status == SHAPE:
            layer = pair.facts.layer(bad.layer)
            hint = _cache_hint(
                bad, ours_t.tensors.get(bad.name), ref_t.tensors.get(bad.name), layer.window if layer else None
            )
        if hint is None:
            a, b = outcome.steps[step]
            hint = diagnose(
                bad, ours_t, ref_t, pair.facts, step_positions, mask[:, a:b] if attention_mask is not None else None
            )
        results[bad.index] = replace(bad, hint=hint)
    return results, outcome
