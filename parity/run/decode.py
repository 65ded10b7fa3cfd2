"""KV-cache runs: prefill (whole or in chunks), then single-token decode steps, compared node by node
at every step, with the caches themselves compared after each step.

The reference runs exactly as ``generate`` drives it: one Transformers ``DynamicCache`` (sliding
layers keep ``window - 1`` tokens; linear-attention layers a ``LinearAttentionLayer``: the short
conv's last ``K`` inputs and the recurrent state), the attention mask over every token so far,
``position_ids`` counted over each row's real tokens. Ours runs the same schedule with its own cache:
a model exposes ``new_cache()`` (whose ``layers[i].keys`` / ``.values`` are the keys after RoPE and
the values, ``(batch, kv_heads, tokens held, head_dim)``; a linear-attention layer's
``layers[i].conv_state`` / ``.recurrent_state`` instead, see :data:`CACHE_PARTS`) and takes
``cache=`` in its forward; that is the whole protocol of our families, whose caches hold exactly
what Transformers' holds (a cache of another length fails, ``cache_length``).

A user's model with another cache API is driven through a :class:`CacheProtocol` (three small
functions) given to :func:`parity.check_model` as ``cache_protocol=``; without one, a forward that
takes its cache as ``cache=``, ``past_key_values=`` or ``kv_cache=`` is driven as it is
(:func:`infer_protocol`), and a model whose cache is kept where parity cannot start it afresh is
refused in one line naming what to write. A user's cache may hold more than the reference's (a
sliding layer keeping ``window`` tokens, or all of them, masked): keys, caches, scores and
probabilities are compared on the positions the reference's attention reads (:data:`KEY_AXIS`), and
the difference in length is a note.

Nodes are named per step: ``step3/model.layers.0.self_attn.k_rot`` (after the cache update: the keys
attention reads, past and new), and ``step3/model.layers.0.self_attn.cache.keys`` / ``.values`` after
the step (``step3/model.layers.0.linear_attn.cache.conv_state`` / ``.recurrent_state`` for a
linear-attention layer). Decode steps feed the reference's greedy token to both models (teacher forcing), so every
step compares the same inputs; whether ours would have chosen the same token, and by what margin, is
reported beside (``greedy``), as is the agreement of ours' cached logits with ours' own full
forward of the same prefix (``consistency``: a cache bug shows there even without a reference).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch

from parity.compare.metrics import SHAPE
from parity.compare.results import NodeResult, compare_traces, first_mismatch
from parity.compare.tolerances import Tolerances
from parity.diagnose.cache import keys_missing, weight_outside
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
    #: what the run says beside: how ours' cache was driven and read, and a cache that held more than the reference's
    notes: list[str] = field(default_factory=list)

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
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        out = list(self.notes)
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
    ``(keys, values)``, each ``(batch, kv_heads, held, head_dim)`` with the oldest token first and the
    newest last (keys after RoPE), or ``(None, None)`` for a layer without a cache; or None for a
    cache parity should not read (its contents are then not compared after each step: the keys each
    step's attention reads still are).

    A cache may hold more than Transformers' (a sliding layer that keeps ``window`` tokens instead of
    ``window - 1``, or every token, masked): keys, caches, scores and probabilities are compared on the
    positions the reference's attention reads (aligned by sequence index, newest last), the extra
    older entries are not (probabilities there must be 0), and the difference in length is one note.
    A cache that holds fewer than the reference's attention reads fails (``cache_length``, naming the
    missing positions; ``cache_not_read`` when a call continuing the cache reads only its own keys).

    A layer whose cache is not keys and values gives a mapping of its parts instead (see
    :data:`CACHE_PARTS`): a linear-attention layer ``{"conv_state": (batch, channels, K) the short
    conv's last K inputs, oldest first, "recurrent_state": (batch, v_heads, d_k, d_v)}``. A pair
    ``(keys, values)`` stands for ``{"keys": keys, "values": values}``, so a protocol written for
    attention-only models needs no change.
    """

    new_cache: Callable
    forward: Callable
    layers: Callable
    #: how an inferred protocol drives the model (:func:`infer_protocol`; "" for one written by hand)
    driven: str = ""


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

#: the names a user's forward may take its cache under, tried in this order (:func:`infer_protocol`)
CACHE_ARGUMENTS = ("cache", "past_key_values", "kv_cache")
#: what a decode error tells a user to write when parity cannot drive the cache as it is
WRITE_A_PROTOCOL = (
    "write a parity.CacheProtocol(new_cache, forward, layers) (three functions: an empty cache; one call on "
    "new tokens returning logits; each layer's (keys, values)) and pass it as check_model(cache_protocol=...)"
)


@dataclass
class _Held:
    """The cache a model driven by :func:`infer_protocol` holds between calls: the one given to it, or
    the one its forward returned (a model may hand back a new object each call, legacy tuples)."""

    cache: object = None


def _fresh_cache(model):
    """``model.new_cache()`` when the model has one callable without arguments, else None (the model
    makes its cache when given none)."""
    make = getattr(model, "new_cache", None)
    if not callable(make):
        return None
    try:
        required = [
            p
            for p in inspect.signature(make).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    return make() if not required else None


def _split_output(out, where: str) -> tuple[torch.Tensor, object]:
    """``(logits, the cache the output carries or None)`` of a forward's output: logits; a tuple
    ``(logits, cache, ...)``; an object with ``.logits`` (and ``.past_key_values`` or ``.cache``)."""
    if isinstance(out, torch.Tensor):
        return out, None
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        for name in ("past_key_values", "cache", "kv_cache"):
            if getattr(out, name, None) is not None:
                return logits, getattr(out, name)
        return logits, None
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], next((x for x in out[1:] if x is not None and not isinstance(x, torch.Tensor)), None)
    raise ParityError(f"{where} returned {type(out).__name__}: a decode check reads logits, or (logits, cache)")


def read_cache_layers(cache) -> list | None:
    """Per layer ``(keys, values)`` (or a mapping of parts, :data:`CACHE_PARTS`) of a cache in a form
    parity knows, else None: ``layers[i].keys`` / ``.values`` (ours' form, Transformers' ``Cache``),
    ``key_cache`` / ``value_cache`` lists, or a sequence of per-layer ``(keys, values)`` pairs (the
    legacy ``past_key_values``). Another form (a ring buffer, preallocated slots) is not guessed at:
    its order and its unused slots cannot be told from its attributes."""
    if cache is None:
        return None
    parts = {p for ps in CACHE_PARTS.values() for p in ps}
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)) and any(any(hasattr(x, p) for p in parts) for x in layers):
        return _our_layers(cache)
    keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if isinstance(keys, (list, tuple)) and isinstance(values, (list, tuple)):
        return list(zip(keys, values))

    def pair(x) -> bool:
        return isinstance(x, (tuple, list)) and len(x) == 2 and all(t is None or isinstance(t, torch.Tensor) for t in x)

    if isinstance(cache, (tuple, list)) and cache and all(x is None or pair(x) for x in cache):
        return [x if x is not None else (None, None) for x in cache]
    return None


def infer_protocol(model) -> CacheProtocol:
    """A protocol for a user's model given none, from its forward's signature: the cache passed as
    ``cache=``, ``past_key_values=`` or ``kv_cache=`` (``new_cache()`` when the model has one, else None
    with ``use_cache=True`` and the cache its output returns), ``position_ids=`` and ``attention_mask=``
    when the forward takes them. Raises ParityError naming what to write when the cache cannot be
    driven that way: a forward with ``use_cache=`` but no cache argument, or ``input_pos`` /
    ``start_pos`` (a cache kept inside the model: parity can neither start it afresh for each run nor
    read it), or no cache at all."""
    name = f"{type(model).__name__}.forward"
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    argument = next((a for a in CACHE_ARGUMENTS if a in params), None)
    if argument is None:
        inside = next((a for a in ("use_cache", "input_pos", "start_pos") if a in params), None)
        if inside is not None:
            raise ParityError(
                f"{name} takes {inside}= but no cache argument (cache=, past_key_values=, kv_cache=): its cache is "
                f"kept inside the model, which parity cannot drive (it must start a fresh cache for each run and "
                f"read each layer's keys); {WRITE_A_PROTOCOL}"
            )
        raise ParityError(
            f"{name} takes no cache argument (cache=, past_key_values=, kv_cache= or use_cache=): a decode check "
            f"needs ours to keep a KV cache; {WRITE_A_PROTOCOL}"
        )
    use_cache, positions_arg, mask_arg = ("use_cache" in params, "position_ids" in params, "attention_mask" in params)
    call = f"{name}({argument}=" + ", use_cache=True" * use_cache + ")"

    def forward(model, ids, mask, positions, held: _Held):
        kwargs: dict[str, object] = {argument: held.cache}
        if use_cache:
            kwargs["use_cache"] = True
        if positions_arg:
            kwargs["position_ids"] = positions
        if mask_arg:
            kwargs["attention_mask"] = mask
        elif mask is not None:
            raise ParityError(f"{name} takes no attention_mask: a padded decode needs one (check without --left-pad)")
        logits, returned = _split_output(model(ids, **kwargs), name)
        if returned is not None:
            held.cache = returned
        if held.cache is None:
            raise ParityError(
                f"{call} with no cache given returned none, and the model has no new_cache(): parity cannot "
                f"carry its cache to the next call; {WRITE_A_PROTOCOL}"
            )
        return logits

    return CacheProtocol(
        new_cache=lambda model: _Held(_fresh_cache(model)),
        forward=forward,
        layers=lambda held: read_cache_layers(held.cache),
        driven=call,
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


def protocol_for(pair: Pair) -> CacheProtocol:
    """How ours is driven: the pair's protocol; our families' (:data:`DEFAULT_PROTOCOL`) for a family's
    model; for a user's model given none, one inferred from its forward (:func:`infer_protocol`)."""
    if pair.cache_protocol is not None:
        return pair.cache_protocol
    return infer_protocol(pair.ours) if pair.alignment else DEFAULT_PROTOCOL


def exact_lengths(pair: Pair) -> bool:
    """Whether ours' cache must hold exactly the reference's tokens: a family's own model, whose cache is
    written with Transformers' semantics (``reference_pairs/common/cache.py``), so any other length is a
    bug of its cache. A user's cache (a protocol given or inferred) may hold more (see :data:`KEY_AXIS`)."""
    return pair.cache_protocol is None and not pair.alignment


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


#: the nodes with an axis over keys (the tokens attention reads, or a cache holds), and that axis.
#: Both sides hold their tokens oldest first and end with the call's last one, so entry ``j`` of a
#: length ``n`` at a call ending before sequence index ``end`` is the token at ``end - n + j``.
KEY_AXIS = {"k_rot": -2, "scores": -1, "probs": -1, "cache.keys": -2, "cache.values": -2}


@dataclass(frozen=True)
class KeySpan:
    """A key-axis node that holds other tokens on each side: ``ours`` and ``reference`` entries along
    ``axis``, both ending with the token before sequence index ``end``."""

    kind: str
    ours: int
    reference: int
    end: int
    axis: int
    #: the node was compared on the reference's positions only (ours holds ``ours - reference`` older ones)
    aligned: bool = False
    #: probabilities: the most weight ours' attention gives an older entry (0 when they are masked)
    weight: float = 0.0

    @property
    def extra(self) -> int:
        return max(self.ours - self.reference, 0)

    def detail(self) -> str:
        older = (
            f"{self.end - self.ours}..{self.end - self.reference - 1}" if self.extra > 1 else str(self.end - self.ours)
        )
        first = self.end - self.reference
        positions = f"position{'s' if self.extra > 1 else ''} {older}"
        if self.kind == "probs":
            return (
                f"ours holds {self.extra} older key{'s' if self.extra > 1 else ''} ({positions}) the reference's "
                f"attention does not read: compared with probability 0 there"
            )
        return (
            f"compared on the {self.reference} positions the reference's attention reads ({first}..{self.end - 1}); "
            f"ours' {self.extra} older ({positions}) not compared"
        )


def _key_span(kind: str, ours, ref, end: int) -> KeySpan | None:
    """The span of a key-axis node whose two sides differ only in how many tokens they hold, else None."""
    axis = KEY_AXIS.get(kind)
    if axis is None or ours is None or ref is None or ours.dim() != ref.dim() or ours.dim() < -axis:
        return None
    cut = ours.dim() + axis
    if ours.shape[cut] == ref.shape[cut] or [n for d, n in enumerate(ours.shape) if d != cut] != [
        n for d, n in enumerate(ref.shape) if d != cut
    ]:
        return None
    return KeySpan(kind, ours.shape[cut], ref.shape[cut], end, axis)


def _align_keys(our_tensors, ref_tensors, kinds: Mapping[str, str], end: int, lenient: bool) -> dict[str, KeySpan]:
    """For every key-axis node whose sides hold other numbers of tokens, its :class:`KeySpan`; with
    ``lenient`` (a user's cache), a node where ours holds more is brought to the reference's positions
    before it is compared: ours' older entries dropped, or for probabilities the reference's extended
    with zeros over them (its attention gives them no weight; ours must not either)."""
    spans = {}
    for name, kind in kinds.items():
        span = _key_span(kind, our_tensors.get(name), ref_tensors.get(name), end)
        if span is None:
            continue
        if lenient and span.extra:
            ours, ref = our_tensors[name], ref_tensors[name]
            weight = 0.0
            if kind == "probs":
                pad = list(ref.shape)
                pad[ref.dim() + span.axis] = span.extra
                ref_tensors[name] = torch.cat([ref.new_zeros(pad), ref], dim=span.axis)
                weight = float(ours.narrow(span.axis, 0, span.extra).double().abs().max())
            else:
                our_tensors[name] = ours.narrow(span.axis, span.extra, span.reference)
            span = replace(span, aligned=True, weight=weight)
        spans[name] = span
    return spans


def _lengths_note(pair: Pair, spans: Mapping[str, KeySpan], results: Mapping[str, NodeResult]) -> str | None:
    """One note for a run whose cache held more tokens than the reference's: per layer type, how many
    (the caches after the last step where they differed, else the keys attention read), and whether
    ours' attention gave the extra ones probability 0."""
    held: dict[str, tuple[int, int, bool]] = {}
    reads: dict[str, tuple[int, int]] = {}
    for name, span in spans.items():
        layer = pair.facts.layer(results[name].layer) if name in results else None
        if not span.aligned or layer is None:
            continue
        if span.kind == "cache.keys":
            every = span.ours == span.end and held.get(layer.layer_type, (0, 0, True))[2]
            held[layer.layer_type] = (span.ours, span.reference, every)
        elif span.kind == "k_rot":
            reads[layer.layer_type] = (span.ours, span.reference)
    if not held and not reads:
        return None
    probs = [(s, results[n]) for n, s in spans.items() if s.aligned and s.kind == "probs" and n in results]
    probs = [(s, r) for s, r in probs if r.judged]
    if not probs:
        masked = "whether ours' attention masks them shows only in the nodes after (probs untapped)"
    elif all(s.weight <= r.atol for s, r in probs):
        masked = "ours' attention gives them probability 0 (checked at every step's probs)"
    else:
        worst = max(s.weight for s, _ in probs)
        masked = f"ours' attention gives some of them weight (up to {worst:.3g}: see the probs nodes)"
    parts = []
    for layer_type in sorted(set(held) | set(reads)):
        window = next((x.window for x in pair.facts.layers if x.layer_type == layer_type and x.window), None)
        if layer_type in held:
            ours, ref, every = held[layer_type]
            keeps = "every token so far" if every else f"{ours} tokens"
            cut = f" (window - 1 = {ref})" if window and ref == window - 1 else ""
            parts.append(f"ours' cache keeps {keeps} on {layer_type} layers, Transformers' {ref}{cut}")
        else:
            ours, ref = reads[layer_type]
            parts.append(f"ours' attention reads {ours} keys on {layer_type} layers, Transformers' {ref}")
    return (
        f"cache length (not a failure): {'; '.join(parts)}, at the last step where they differ; the older entries "
        f"are outside what the reference's attention reads, and {masked}; keys, caches, scores and probabilities "
        f"are compared on the positions the reference's attention reads"
    )


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
    positions = generation_positions(
        mask if attention_mask is not None else None, batch, plan.total, pair.facts.position_offset
    )
    protocol = protocol_for(pair)
    lenient = not exact_lengths(pair)
    ref_cache, our_cache = new_caches(pair, protocol)
    stems = _cache_stems(pair)
    outcome = DecodeOutcome(plan, plan.schedule())
    if protocol.driven:
        outcome.notes.append(f"ours' cache driven as {protocol.driven} (no CacheProtocol given)")
    results: list[NodeResult] = []
    # both traces of the first call holding a failure, for its diagnosis; every other call's are dropped
    # once compared (a decode's memory is one call's traces, not the sum over its steps)
    kept: tuple[int, Trace, Trace, torch.Tensor] | None = None
    spans: dict[str, KeySpan] = {}
    untapped = untapped_nodes(pair)
    unread = ""  # the type of ours' cache when its protocol does not read it (its cache nodes untapped)
    for k, (a, b) in enumerate(outcome.steps):
        step_mask = mask[:, :b] if attention_mask is not None else None
        ref_trace, ref_logits = _trace_reference_step(pair, ids[:, a:b], step_mask, positions[:, a:b], ref_cache)
        our_trace, our_logits = _trace_ours_step(pair, protocol, ids[:, a:b], step_mask, positions[:, a:b], our_cache)
        ref_trace.tensors.update(_cache_tensors(_reference_layers(ref_cache), stems))
        our_layers = protocol.layers(our_cache)
        if our_layers is None:
            held = getattr(our_cache, "cache", our_cache)
            unread = f"{type(held).__module__}.{type(held).__qualname__}"
        else:
            our_trace.tensors.update(_cache_tensors(our_layers, stems))
        cache_specs = [
            NodeSpec(
                f"{stem}.cache.{part}",
                f"unaligned:ours' cache ({unread.rsplit('.', 1)[-1]}) is not read: a CacheProtocol's layers() reads it"
                if our_layers is None
                else "",
                layer=i,
                kind=f"cache.{part}",
            )
            for i, (stem, parts) in stems.items()
            for part in parts
        ]
        step_spans = _align_keys(
            our_trace.tensors,
            ref_trace.tensors,
            {n.name: n.kind for n in [*pair.nodes, *cache_specs] if n.kind in KEY_AXIS},
            b,
            lenient,
        )
        specs = [replace(n, name=_step(k, n.name)) for n in [*pair.nodes, *cache_specs]]
        skipped = untapped | ({n.name for n in cache_specs} if our_layers is None else set())
        step_results = compare_traces(
            _prefixed(our_trace, k),
            _prefixed(ref_trace, k),
            specs,
            tolerances,
            frozenset(_step(k, n) for n in skipped),
        )
        for j, r in enumerate(step_results):
            span = step_spans.get(r.name.split("/", 1)[1])
            if span is not None and span.aligned:  # the real shapes, and what was compared
                ours_shape, ref_shape = list(r.shape_ref or ()), list(r.shape_ref or ())
                ours_shape[span.axis], ref_shape[span.axis] = span.ours, span.reference
                detail = "; ".join(d for d in (r.detail, span.detail()) if d)
                r = replace(r, shape_ours=tuple(ours_shape), shape_ref=tuple(ref_shape), detail=detail)
            step_results[j] = replace(r, index=len(results) + j)
        spans.update({_step(k, n): span for n, span in step_spans.items()})
        results += step_results
        if kept is None and first_mismatch(step_results) is not None:
            kept = (k, _prefixed(our_trace, k), _prefixed(ref_trace, k), positions[:, a:b])
        del our_trace, ref_trace
        # beside the nodes: ours against its own full forward, and the greedy choice of each model
        if a == 0:  # the first call is that full forward already (a fresh cache, the same tokens)
            outcome.consistency.append(0.0)
        else:
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
            del full  # vocabulary-wide over every token so far: not held into the next call
        ref_next, our_next = ref_logits[:, -1].argmax(-1), our_logits[:, -1].argmax(-1)
        outcome.tokens_reference.append(ref_next.tolist())
        outcome.tokens_ours.append(our_next.tolist())
        if outcome.first_divergent_step is None and not torch.equal(ref_next, our_next):
            top2 = ref_logits[:, -1].double().topk(2, dim=-1).values
            margin = float((top2[:, 0] - top2[:, 1]).min())
            outcome.first_divergent_step, outcome.margin, outcome.near_tie = k, margin, margin < NEAR_TIE
        if plan.prefill <= b < plan.total:  # the next decode step feeds the reference's greedy token to both
            ids[:, b] = fed_token(ref_logits[:, -1], pair.facts.placeholder_tokens)
    if unread:
        outcome.notes.append(
            f"ours' cache ({unread}) is in no form parity reads (layers[i].keys / .values, a Transformers Cache, "
            f"per-layer (keys, values) pairs): the caches after each step are untapped; the keys each step's "
            f"attention reads are compared; a CacheProtocol whose layers() returns each layer's (keys, values), "
            f"oldest first, compares the caches too"
        )
    note = _lengths_note(pair, spans, {r.name: r for r in results})
    if note is not None:
        outcome.notes.append(note)
    bad = first_mismatch(results)
    if bad is not None:
        step = int(bad.name.split("/", 1)[0][len("step") :])
        assert kept is not None and kept[0] == step  # the first failure lies in the first call holding one
        _, ours_t, ref_t, step_positions = kept
        a, b = outcome.steps[step]
        layer = pair.facts.layer(bad.layer) if bad.layer is not None else None
        hint = _key_hint(bad, spans.get(bad.name), step, (a, b), ours_t, ref_t, layer)
        if hint is None and bad.kind.startswith("cache.") and bad.status == SHAPE:
            hint = _cache_hint(
                bad, ours_t.tensors.get(bad.name), ref_t.tensors.get(bad.name), layer.window if layer else None
            )
        if hint is None:
            hint = diagnose(
                bad, ours_t, ref_t, pair.facts, step_positions, mask[:, a:b] if attention_mask is not None else None
            )
        results[bad.index] = replace(bad, hint=hint)
    return results, outcome


def _key_hint(
    bad: NodeResult, span: KeySpan | None, step: int, call: tuple[int, int], ours: Trace, ref: Trace, layer
) -> Hint | None:
    """The hint of a failing key-axis node whose sides hold other tokens: ours lacks positions the
    reference's attention reads (:func:`~parity.diagnose.cache.keys_missing`), or gives weight to older
    ones it holds beyond them (:func:`~parity.diagnose.cache.weight_outside`)."""
    if span is None:
        return None
    window = layer.window if layer is not None else None
    if span.ours < span.reference:
        agree = None
        if span.kind == "k_rot" and call[0] > 0 and span.ours == call[1] - call[0]:
            mine, theirs = ours.tensors.get(bad.name), ref.tensors.get(bad.name)
            if mine is not None and theirs is not None:
                own = theirs.narrow(span.axis, span.reference - span.ours, span.ours)
                agree = bool(torch.isclose(mine.double(), own.double(), atol=bad.atol, rtol=bad.rtol).all())
        kv_source = layer.kv_source if layer is not None else None
        return keys_missing(span.kind, step, call, span.ours, span.reference, window, kv_source, agree)
    if span.aligned and span.kind == "probs" and span.weight > bad.atol:
        mine = ours.tensors.get(bad.name)
        if mine is not None:
            older = mine.narrow(span.axis, 0, span.extra).double().abs().movedim(span.axis, 0).flatten(1)
            per_position = older.max(dim=1).values.tolist()
            first = call[1] - span.ours
            weights = {first + j: w for j, w in enumerate(per_position) if w > bad.atol}
            if weights:
                return weight_outside(step, call, span.reference, weights, window)
    return None
