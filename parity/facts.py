"""ArchFacts: everything the engine may know about an architecture, derived from a Transformers config.

The engine (check, diagnose, analysis, resources, reports) reads these facts and the NodeSpecs,
never a family's cfg dict, so a user's own model, which has no cfg dict of ours, gets the same
hints, guards and reports as a built-in family. The facts come from the *reference's* config: the
standard fields every decoder config has, plus one small rule per ``model_type`` where a model
decides something the config does not say (Cohere 2 applies no RoPE on full-attention layers,
GPT-2's layers live under ``transformer.h``, Gemma scales its embeddings).

RoPE is kept in Transformers 5's ``rope_parameters`` shape, per layer type, together with the
cos/sin scaling factor Transformers computes for it (``ROPE_INIT_FUNCTIONS``), so a hint can name
"the YaRN attention factor 1.2079" without knowing how any family spells it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


@dataclass(frozen=True)
class RopeFacts:
    """RoPE of one layer type.

    ``parameters``: the Transformers ``rope_parameters`` dict of that layer type (read-only).
    ``attention_factor``: the factor Transformers multiplies cos and sin by (1.0 unless YaRN or
    LongRoPE say otherwise). ``rotary_dim``: how many dims of a head the rotation spans (``head_dim *
    partial_rotary_factor``; the whole head for "proportional" RoPE, whose zero frequencies leave
    the pairs past the partial part unrotated). ``interleaved``: pairs ``(2i, 2i + 1)`` rotate together (RoFormer,
    Cohere) instead of ``(i, i + d/2)`` (GPT-NeoX, Llama).
    """

    rope_type: str
    theta: float
    parameters: Mapping[str, object]
    attention_factor: float = 1.0
    rotary_dim: int = 0
    interleaved: bool = False
    #: the inverse frequencies Transformers computes (``rotary_dim // 2`` of them), for hints
    inv_freq: tuple[float, ...] = ()

    def unscaled_inv_freq(self) -> tuple[float, ...]:
        """Plain RoPE frequencies ``theta^(-2i/d)`` with this theta (what a forgotten scaling gives)."""
        return default_inv_freq(self.theta, self.rotary_dim)

    def with_theta(self, theta: float, head_dim: int, max_position_embeddings: int | None) -> tuple[float, ...]:
        """This RoPE's frequencies (same type and scaling) had its theta been ``theta``."""
        if self.rope_type == "default":
            return default_inv_freq(theta, self.rotary_dim)
        params = {**self.parameters, "rope_theta": theta}
        inv_freq, _ = _rope_init(_RopeConfig(params, head_dim, max_position_embeddings), None, params, False, theta, self.rotary_dim)
        return inv_freq


    def get(self, key: str, default=None):
        return self.parameters.get(key, default)


class _RopeConfig:
    """The attributes Transformers' RoPE init functions read, for one rope dict (no model config)."""

    def __init__(self, params: dict, head_dim: int, max_position_embeddings: int | None):
        self.rope_parameters = dict(params)
        self.head_dim, self.hidden_size, self.num_attention_heads = head_dim, head_dim, 1
        self.max_position_embeddings = max_position_embeddings or 2048
        self.partial_rotary_factor = float(params.get("partial_rotary_factor", 1.0))

    def standardize_rope_params(self) -> None:
        """Already standard: one rope dict."""

@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer: its type, attention window (None = full causal), RoPE (None = no RoPE),
    head_dim, KV heads and softmax scale (``scores = q k^T * attention_scale``); a mixture-of-experts
    feed-forward has ``num_experts`` routed experts of which each token uses ``experts_per_token``
    (0 and 0: a dense feed-forward).

    ``kv_source``: the index of the earlier layer whose keys and values this layer attends to
    instead of computing its own (cross-layer KV sharing, Gemma 4 ``num_kv_shared_layers``); None
    when it computes them. ``k_eq_v``: its values are its key projection (no value projection)."""

    index: int
    layer_type: str
    window: int | None
    rope: RopeFacts | None
    head_dim: int
    num_kv_heads: int
    attention_scale: float
    kv_source: int | None = None
    k_eq_v: bool = False
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def sparse(self) -> bool:
        """True when this layer's feed-forward is a mixture of experts."""
        return self.num_experts > 0


@dataclass(frozen=True)
class ArchFacts:
    """What the engine knows about one architecture (see the module docstring).

    Node locations: ``layer_prefix`` is the module path of the decoder layers' ModuleList
    (``model.layers``, ``model.language_model.layers``, ``transformer.h``); ``embed_module`` and
    ``head_module`` are the token embedding and the output projection. Scalars the output may carry:
    ``logit_scale`` (Cohere multiplies the logits), ``final_softcap`` / ``attn_softcap`` (Gemma
    ``cap * tanh(x / cap)``), ``embed_scale`` (Gemma multiplies embeddings by sqrt(hidden)).
    ``norm_kind`` is ``"rmsnorm"`` or ``"layernorm"``; ``norm_weight_offset`` is 1.0 where the norm
    multiplies by ``(1 + w)``. ``qk_norm``: None, ``"head"`` (per head, Qwen3/Gemma) or
    ``"projection"`` (over the whole projection, OLMo 2/3). ``chunk_size``: linear-attention
    layers run their recurrence over the sequence in chunks of this many tokens (None: no such
    layers); only a sequence longer than one chunk exercises the state carried between chunks.
    ``conv_kernel``: the width of those layers' short causal convolution (a call continuing a cache
    reads the previous call's last ``conv_kernel - 1`` inputs).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerFacts, ...]
    layer_prefix: str = "model.layers"
    embed_module: str = "model.embed_tokens"
    head_module: str = "lm_head"
    norm_kind: str = "rmsnorm"
    norm_eps: float | None = None
    norm_weight_offset: float = 0.0
    qk_norm: str | None = None
    logit_scale: float | None = None
    final_softcap: float | None = None
    attn_softcap: float | None = None
    embed_scale: float | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    chunk_size: int | None = None
    conv_kernel: int | None = None
    #: named constants a constant ratio may equal (see :meth:`named_constants`)
    extra_constants: Mapping[str, float] = field(default_factory=dict)
    #: named parts of the architecture beyond the fields above (Gemma 4: "per-layer inputs", "KV
    #: sharing", "K = V", "double-wide MLP"): a node map's ``when`` and the gate's config coverage read them
    features: frozenset[str] = frozenset()
    #: token ids the reference swaps out before its text model sees them (a multimodal model's image,
    #: video and audio placeholders: Gemma 4 embeds pad in their place); random inputs avoid them
    placeholder_tokens: tuple[int, ...] = ()

    @property
    def text_model(self) -> str:
        """The module path of the text model that holds the decoder layers: ``model``, ``transformer``, or
        ``model.language_model`` in a multimodal checkpoint's model (``...ForConditionalGeneration``)."""
        return self.layer_prefix.rpartition(".")[0]

    # --- per layer -----------------------------------------------------------------------------

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(layer.layer_type for layer in self.layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(layer.window for layer in self.layers)

    @property
    def sliding_window(self) -> int | None:
        """The largest attention window of any layer, or None when every layer is full causal."""
        windows = [w for w in self.windows if w]
        return max(windows) if windows else None

    def layer(self, index: int | None) -> LayerFacts | None:
        return self.layers[index] if index is not None and 0 <= index < len(self.layers) else None

    def rope_of_type(self, layer_type: str) -> RopeFacts | None:
        return next((layer.rope for layer in self.layers if layer.layer_type == layer_type), None)

    # --- node names ----------------------------------------------------------------------------

    def locate(self, name: str) -> tuple[int | None, str]:
        """``(layer index or None, kind)`` of a canonical node name.

        The kind is the last path component without the layer prefix (``q_proj``, ``probs``,
        ``mlp@input``); a layer's own output is ``layer``; outside the layers the last component
        (``embed_tokens``, ``norm``, ``lm_head``, ``logits``). A ``stepN/`` prefix (decode checks) is
        ignored.
        """
        bare = name.split("/", 1)[1] if re.match(r"^step\d+/", name) else name
        prefix = self.layer_prefix + "."
        if bare.startswith(prefix):
            head, _, rest = bare[len(prefix):].partition(".")
            layer_part, at, after_at = head.partition("@")
            if layer_part.isdigit():
                index = int(layer_part)
                if at:
                    return index, "layer@" + after_at
                if not rest:
                    return index, "layer"
                if "@" in rest:
                    path, _, what = rest.partition("@")
                    return index, f"{path.rsplit('.', 1)[-1]}@{what}"
                return index, rest.rsplit(".", 1)[-1]
        if "@" in bare:
            path, _, what = bare.partition("@")
            return None, f"{path.rsplit('.', 1)[-1]}@{what}"
        return None, bare.rsplit(".", 1)[-1] if bare else "logits"

    def named_constants(self) -> dict[str, float]:
        """Scalars a missing or extra factor is likely to equal, by name (for constant-ratio hints)."""
        named: dict[str, float] = {}
        for layer in self.layers:
            rope = layer.rope
            if rope is not None and rope.attention_factor != 1.0:
                f = rope.attention_factor
                named.setdefault(f"the {rope.rope_type} attention factor of {layer.layer_type} layers", f)
                named.setdefault(f"the {rope.rope_type} attention factor of {layer.layer_type} layers, squared", f * f)
            factor = rope.get("factor") if rope is not None and rope.rope_type == "yarn" else None
            if isinstance(factor, (int, float)) and factor > 1:  # YaRN's default, 0.1 ln(s) + 1 (arXiv:2309.00071 eq. 22)
                named.setdefault(f"the default YaRN attention factor 0.1 ln({factor:g}) + 1", 0.1 * math.log(factor) + 1)
        if self.logit_scale not in (None, 1.0):
            named["logit_scale"] = float(self.logit_scale)
        if self.embed_scale not in (None, 1.0):
            named["the embedding scale"] = float(self.embed_scale)
        named[f"sqrt(hidden_size={self.hidden_size})"] = math.sqrt(self.hidden_size)
        named[f"sqrt(head_dim={self.head_dim})"] = math.sqrt(self.head_dim)
        if self.num_heads and self.hidden_size % self.num_heads == 0 and self.hidden_size // self.num_heads != self.head_dim:
            alt = self.hidden_size // self.num_heads
            named[f"sqrt(head_dim / (hidden_size / num_heads)) = sqrt({self.head_dim}/{alt})"] = math.sqrt(self.head_dim / alt)
        named.update(self.extra_constants)
        return named


# --- derivation ---------------------------------------------------------------------------------

#: model_type -> rule that adjusts the generic facts for what that model decides itself
RULES: dict[str, Callable[[object, ArchFacts], ArchFacts]] = {}


def rule(*model_types: str):
    """Register a per-``model_type`` adjustment of the generic facts."""

    def register(fn):
        for model_type in model_types:
            RULES[model_type] = fn
        return fn

    return register


def _get(config, *names, default=None):
    for name in names:
        value = _attr(config, name)
        if value is not None:
            return value
    return default


def _attr(config, name: str, layer: int = 0):
    """``config.name``; for an attribute that varies per layer in a heterogeneous config (Transformers'
    ``per_layer_config``, where reading it globally raises), its value at ``layer``."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError: read it per layer
        return getattr(config.per_layer_config[layer], name, None)


def _per_layer(config, name: str, n_layers: int, default):
    """The value of ``name`` at each layer (``default`` where a layer does not set it)."""
    if not getattr(config, "is_heterogeneous", False) or name not in (config.per_layer_attributes or ()):
        return [default] * n_layers
    return [getattr(config.per_layer_config[i], name, None) or default for i in range(n_layers)]


def _rope_by_type(config, layer_types: tuple[str, ...]) -> dict[str, dict | None]:
    params = getattr(config, "rope_parameters", None)
    if not params:
        return {t: None for t in set(layer_types)}
    if isinstance(params, Mapping) and set(params) & set(layer_types) and all(isinstance(v, Mapping) for v in params.values()):
        return {t: (dict(params[t]) if params.get(t) is not None else None) for t in set(layer_types)}
    return {t: dict(params) for t in set(layer_types)}


def default_inv_freq(theta: float, rotary_dim: int) -> tuple[float, ...]:
    """``theta^(-2i/d)`` for ``i < d/2``, computed as Transformers' default RoPE does (float32)."""
    import torch

    if rotary_dim < 2 or not theta > 0:
        return ()
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return tuple((1.0 / (theta**exponents)).tolist())


def _rope_init(config, layer_type: str, params: dict, per_type: bool, theta: float, rotary_dim: int) -> tuple[tuple, float]:
    """``(inverse frequencies, cos/sin scale)`` as Transformers computes them for these parameters."""
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(theta, rotary_dim), 1.0
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, factor = fn(config, "cpu", layer_type=layer_type) if per_type else fn(config, "cpu")
        return tuple(inv_freq.float().tolist()), float(factor)
    except Exception:  # a config Transformers itself cannot run; the build path reports it
        value = params.get("attention_factor")
        return (), float(value) if isinstance(value, (int, float)) else 1.0


def derive_facts(config, model=None) -> ArchFacts:
    """ArchFacts from a Transformers ``PretrainedConfig`` (and, when given, the reference model,
    whose module tree fixes the layer prefix). Standard fields first, then the ``model_type``'s rule.

    Raises nothing for unusual configs: missing fields become None or their Transformers defaults;
    :func:`validate_facts` judges whether a check can run.

    A multimodal config (one whose ``get_text_config()`` is its ``text_config``: Gemma 3 and 4's
    ``...ForConditionalGeneration``) gives the facts of its text config, located where the model holds
    the text model (``model.language_model``).
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        return _composite_facts(config, text_config, model)
    hidden = int(_get(config, "hidden_size", "n_embd", default=0))
    heads = int(_get(config, "num_attention_heads", "n_head", default=0))
    kv = _get(config, "num_key_value_heads", default=None)
    kv = heads if kv is None else int(kv)  # null means MHA; an explicit 0 is kept for validate_facts to refuse
    head_dim = _get(config, "head_dim")
    head_dim = int(head_dim) if head_dim is not None else (hidden // heads if heads else 0)
    n_layers = int(_get(config, "num_hidden_layers", "n_layer", default=0))
    layer_types = tuple(_get(config, "layer_types", default=None) or [FULL] * n_layers)
    head_dims = [int(d) for d in _per_layer(config, "head_dim", n_layers, head_dim)]
    kv_heads = [int(k) for k in _per_layer(config, "num_key_value_heads", n_layers, kv)]
    window = _get(config, "sliding_window")
    ropes = _rope_by_type(config, layer_types)
    per_type = bool(getattr(config, "rope_parameters", None)) and set(config.rope_parameters) & set(layer_types) != set()
    rope_facts: dict[str, RopeFacts | None] = {}
    for layer_type, params in ropes.items():
        if params is None:
            rope_facts[layer_type] = None
            continue
        partial = float(params.get("partial_rotary_factor", _get(config, "partial_rotary_factor", default=1.0)))
        theta = float(params.get("rope_theta", getattr(config, "default_theta", 10_000.0)))
        type_head_dim = head_dims[layer_types.index(layer_type)] if layer_type in layer_types else head_dim
        # proportional RoPE (Gemma 4) spans the whole head, pairs (i, i + d/2), zero frequencies past the partial part
        rotary_dim = type_head_dim if params.get("rope_type") == "proportional" else int(type_head_dim * partial)
        inv_freq, attention_factor = _rope_init(config, layer_type, params, per_type, theta, rotary_dim)
        rope_facts[layer_type] = RopeFacts(
            rope_type=str(params.get("rope_type", "default")),
            theta=theta,
            parameters=MappingProxyType(params),
            attention_factor=attention_factor,
            rotary_dim=rotary_dim,
            inv_freq=inv_freq,
        )
    num_experts = int(_get(config, "num_experts", "num_local_experts", default=0) or 0)
    experts_per_token = int(_get(config, "num_experts_per_tok", default=0) or 0) if num_experts else 0
    scalar = _get(config, "query_pre_attn_scalar")
    scalar = float(scalar) if scalar else None
    layers = tuple(
        LayerFacts(
            index=i,
            layer_type=t,
            window=int(window) if window is not None and t == SLIDING else None,
            rope=rope_facts.get(t),
            head_dim=head_dims[i],
            num_kv_heads=kv_heads[i],
            attention_scale=scalar ** -0.5 if scalar else (head_dims[i] ** -0.5 if head_dims[i] else 1.0),
            num_experts=num_experts,  # every layer, unless the model_type's rule says otherwise
            experts_per_token=experts_per_token,
        )
        for i, t in enumerate(layer_types)
    )
    eps = _get(config, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
    facts = ArchFacts(
        model_type=str(getattr(config, "model_type", "") or ""),
        vocab_size=int(_get(config, "vocab_size", default=0)),
        hidden_size=hidden,
        intermediate_size=_get(config, "intermediate_size", "n_inner"),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        layers=layers,
        norm_kind="layernorm" if _get(config, "layer_norm_eps", "layer_norm_epsilon") is not None and _get(config, "rms_norm_eps") is None else "rmsnorm",
        norm_eps=float(eps) if eps is not None else None,
        logit_scale=_get(config, "logit_scale"),
        final_softcap=_get(config, "final_logit_softcapping"),
        attn_softcap=_get(config, "attn_logit_softcapping"),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
        max_position_embeddings=_get(config, "max_position_embeddings"),
    )
    adjust = RULES.get(facts.model_type)
    if adjust is not None:
        facts = adjust(config, facts)
    if model is not None:
        prefix = find_layer_prefix(model, facts.num_layers)
        if prefix is not None and prefix != facts.layer_prefix:
            facts = replace(facts, layer_prefix=prefix)
    return facts


#: multimodal model_type -> the config fields naming token ids its model swaps out before the text model
#: (Gemma4Model.forward embeds pad in place of image, video and audio placeholders; Gemma3Model swaps an
#: image placeholder only when it lies past the vocabulary, where no input can hold it)
PLACEHOLDERS: dict[str, tuple[str, ...]] = {"gemma4": ("image_token_id", "video_token_id", "audio_token_id")}


def _composite_facts(config, text_config, model=None) -> ArchFacts:
    """The text config's facts, located in the multimodal model: the text model is the module whose
    config is ``text_config`` (shortest path; ``model.language_model`` without a model to look in)."""
    from transformers import PreTrainedModel

    facts = derive_facts(text_config)
    path = "model.language_model"
    if model is not None:
        found = [
            name for name, m in model.named_modules()
            if name and isinstance(m, PreTrainedModel) and getattr(m, "config", None) is text_config
        ]
        path = min(found, key=lambda n: (n.count("."), len(n))) if found else path
    tail = facts.layer_prefix.partition(".")[2] or "layers"
    ids = (getattr(config, name, None) for name in PLACEHOLDERS.get(getattr(config, "model_type", ""), ()))
    placeholders = tuple(sorted({int(i) for i in ids if isinstance(i, int) and 0 <= i < facts.vocab_size}))
    return replace(facts, layer_prefix=f"{path}.{tail}", embed_module=f"{path}.{facts.embed_module.partition('.')[2]}",
                   placeholder_tokens=placeholders)


def find_layer_prefix(model, num_layers: int) -> str | None:
    """The path of the ModuleList holding ``num_layers`` decoder layers (the shortest such path)."""
    from torch import nn

    found = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and num_layers > 0 and name
    ]
    return min(found, key=lambda n: (n.count("."), len(n))) if found else None


def with_layers(facts: ArchFacts, **changes) -> ArchFacts:
    """``facts`` with every LayerFacts updated by ``fn(layer)`` for the given fields."""
    return replace(facts, layers=tuple(replace(layer, **{k: fn(layer) for k, fn in changes.items()}) for layer in facts.layers))


@rule("olmo2", "olmo3")
def _olmo(config, facts: ArchFacts) -> ArchFacts:
    return replace(facts, qk_norm="projection")


@rule("cohere", "cohere2")
def _cohere(config, facts: ArchFacts) -> ArchFacts:
    # Cohere2Attention rotates only on sliding layers (full layers are NoPE), with interleaved pairs.
    def rope(layer: LayerFacts):
        if layer.rope is None or (facts.model_type == "cohere2" and layer.layer_type != SLIDING):
            return None
        return replace(layer.rope, interleaved=True)

    return replace(with_layers(facts, rope=rope), norm_kind="layernorm")


@rule("qwen3", "qwen3_moe")
def _qwen3(config, facts: ArchFacts) -> ArchFacts:
    facts = replace(facts, qk_norm="head")
    if facts.model_type != "qwen3_moe":
        return facts
    # Qwen3MoeDecoderLayer: layer i is sparse unless listed in mlp_only_layers, and only every
    # decoder_sparse_step-th layer ((i + 1) % step == 0) is
    dense_only = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)

    def sparse(layer: LayerFacts) -> bool:
        return layer.num_experts > 0 and layer.index not in dense_only and (layer.index + 1) % step == 0

    return with_layers(
        facts,
        num_experts=lambda layer: layer.num_experts if sparse(layer) else 0,
        experts_per_token=lambda layer: layer.experts_per_token if sparse(layer) else 0,
    )


@rule("qwen3_5_text")
def _qwen3_5(config, facts: ArchFacts) -> ArchFacts:
    # Qwen3_5DecoderLayer: linear_attention layers are Gated DeltaNet (no RoPE; the delta rule in chunks
    # of 64, torch_chunk_gated_delta_rule's default; a causal conv of linear_conv_kernel_dim before it);
    # full_attention layers norm Q/K per head; every RMSNorm but the DeltaNet's gated one scales by (1 + w).
    def rope(layer: LayerFacts):
        return None if layer.layer_type == LINEAR else layer.rope

    return replace(with_layers(facts, rope=rope), qk_norm="head", norm_weight_offset=1.0, chunk_size=64,
                   conv_kernel=int(config.linear_conv_kernel_dim))


@rule("mistral")
def _mistral(config, facts: ArchFacts) -> ArchFacts:
    # MistralModel builds a sliding-window mask for every layer whenever sliding_window is set.
    # A window of 0 is a window too (MistralModel tests `is None`): validate_facts refuses it by name.
    window = getattr(config, "sliding_window", None)
    if window is None:
        return facts
    return with_layers(facts, layer_type=lambda layer: SLIDING, window=lambda layer: int(window))


@rule("gemma3_text", "gemma3")
def _gemma3(config, facts: ArchFacts) -> ArchFacts:
    # Gemma3Attention (Transformers 5.24) keeps attn_logit_softcapping but never applies it
    return replace(facts, qk_norm="head", norm_weight_offset=1.0, embed_scale=math.sqrt(facts.hidden_size), attn_softcap=None)


def kv_sources(config) -> dict[int, int]:
    """Gemma 4 KV sharing: ``{consumer layer: layer whose keys and values it reads}``. The last
    ``num_kv_shared_layers`` layers compute none; each reads the last earlier layer of its own type
    (``Gemma4TextConfig.kv_sharing_modes``: that layer "stores", the consumers "reuse"). Empty when
    the config shares nothing or cannot (a layer type without an earlier producer)."""
    n, shared = int(getattr(config, "num_hidden_layers", 0)), int(getattr(config, "num_kv_shared_layers", 0) or 0)
    types = list(getattr(config, "layer_types", None) or [])
    first = n - shared
    if not shared or first <= 0 or len(types) != n:
        return {}
    producers = {t: i for i, t in enumerate(types[:first])}  # the last producer of each type
    if any(t not in producers for t in types[first:]):
        return {}
    return {i: producers[types[i]] for i in range(first, n)}


@rule("gemma4_text")
def _gemma4(config, facts: ArchFacts) -> ArchFacts:
    # Gemma4TextAttention: scaling 1.0 (q and k are RMS-normalised per head), K = V on full layers
    # with attention_k_eq_v, keys and values of the last num_kv_shared_layers read from an earlier layer
    sources, k_eq_v = kv_sources(config), bool(getattr(config, "attention_k_eq_v", False))
    facts = with_layers(
        facts,
        attention_scale=lambda layer: 1.0,
        kv_source=lambda layer: sources.get(layer.index),
        k_eq_v=lambda layer: k_eq_v and layer.layer_type == FULL and layer.index not in sources,
    )
    per_layer_inputs = bool(getattr(config, "hidden_size_per_layer_input", 0))
    constants = {"the per-layer input scale 1/sqrt(2)": 2**-0.5} if per_layer_inputs else {}
    features = {
        "per-layer inputs": per_layer_inputs,
        "KV sharing": bool(sources),
        "K = V": any(layer.k_eq_v for layer in facts.layers),
        "double-wide MLP": bool(sources) and bool(getattr(config, "use_double_wide_mlp", False)),
        "per-layer head_dim": len({layer.head_dim for layer in facts.layers}) > 1,
    }
    return replace(facts, qk_norm="head", embed_scale=math.sqrt(facts.hidden_size), attn_softcap=None,
                   extra_constants={**facts.extra_constants, **constants},
                   features=facts.features | {name for name, present in features.items() if present})


def _gpt2_scale(config, layer: LayerFacts) -> float:
    """``GPT2Attention.scaling``: ``head_dim**-0.5`` (1.0 without ``scale_attn_weights``), divided by
    ``layer + 1`` with ``scale_attn_by_inverse_layer_idx``, in that order of operations."""
    scaling = layer.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scaling /= float(layer.index + 1)
    return scaling


@rule("gpt2")
def _gpt2(config, facts: ArchFacts) -> ArchFacts:
    return replace(
        with_layers(facts, rope=lambda layer: None, attention_scale=lambda layer: _gpt2_scale(config, layer)),
        layer_prefix="transformer.h",
        embed_module="transformer.wte",
        norm_kind="layernorm",
        intermediate_size=facts.intermediate_size or 4 * facts.hidden_size,
    )


# --- validation ---------------------------------------------------------------------------------


def validate_facts(facts: ArchFacts) -> list[str]:
    """Reasons these facts describe a model no check can run on (one line each, naming the
    Transformers field); empty when the shapes make sense."""
    problems = []
    for label, value, minimum in (
        ("num_hidden_layers", facts.num_layers, 1),
        ("num_attention_heads", facts.num_heads, 1),
        ("num_key_value_heads", facts.num_kv_heads, 1),
        ("hidden_size", facts.hidden_size, 1),
        ("vocab_size", facts.vocab_size, 2),
        ("head_dim", facts.head_dim, 1),
    ):
        if not isinstance(value, int) or value < minimum:
            problems.append(f"{label} is {value!r}; it must be at least {minimum}")
    if facts.intermediate_size is not None and facts.intermediate_size < 1:
        problems.append(f"intermediate_size is {facts.intermediate_size!r}; it must be at least 1")
    if facts.num_heads >= 1 and facts.num_kv_heads >= 1 and facts.num_heads % facts.num_kv_heads:
        problems.append(
            f"num_attention_heads ({facts.num_heads}) is not a multiple of num_key_value_heads ({facts.num_kv_heads})"
        )
    if facts.norm_eps is not None and not (math.isfinite(facts.norm_eps) and facts.norm_eps >= 0):
        problems.append(f"the norm eps is {facts.norm_eps!r}; it must be a finite number >= 0")
    for layer in facts.layers:
        if layer.layer_type == SLIDING and (layer.window is None or layer.window < 1):
            value = "null" if layer.window is None else repr(layer.window)
            problems.append(f"layer {layer.index} is sliding_attention but sliding_window is {value}; it must be >= 1")
            break
    if facts.max_position_embeddings is not None and (
        not isinstance(facts.max_position_embeddings, int) or facts.max_position_embeddings < 1
    ):
        problems.append(f"max_position_embeddings is {facts.max_position_embeddings!r}; it must be at least 1")
    for layer_type in sorted(set(facts.layer_types)):
        rope = facts.rope_of_type(layer_type)
        if rope is not None:
            problems += [f"{problem} ({layer_type} layers)" for problem in rope_problems(rope.parameters)]
        if rope is not None and rope.rotary_dim % 2:
            problems.append(f"RoPE on {layer_type} layers rotates {rope.rotary_dim} dims of each head; it must be even")
        if rope is not None and not (math.isfinite(rope.theta) and rope.theta > 0):
            problems.append(f"rope_theta of {layer_type} layers is {rope.theta!r}; it must be > 0")
    return problems


#: RoPE parameters that are numbers, with the least value Transformers' RoPE functions can use
#: (``modeling_rope_utils``: a scaling ``factor`` below 1 only logs a warning there, then shrinks or
#: inverts the frequencies; an ``original_max_position_embeddings`` of 0 divides by zero)
_ROPE_MINIMUMS = {
    "factor": (1.0, True),
    "original_max_position_embeddings": (1, True),
    "attention_factor": (0.0, False),
    "beta_fast": (0.0, True),  # 0 (or null) means the default, 32 / 1, in Transformers' YaRN
    "beta_slow": (0.0, True),
    "low_freq_factor": (0.0, False),
    "high_freq_factor": (0.0, False),
    "partial_rotary_factor": (0.0, False),
}


def rope_problems(params) -> list[str]:
    """One line per RoPE parameter (``rope_parameters`` / ``rope_scaling`` of one layer type) that no
    RoPE can be computed from: a scaling ``factor`` below 1, an ``original_max_position_embeddings``
    below 1, a negative ``beta_fast``/``beta_slow``, an ``attention_factor`` or frequency factor that is
    not positive, any of them not a finite number; each line names the key. Bounds follow Transformers' ``_validate_*_rope_parameters`` (modeling_rope_utils)."""
    problems = []
    for key, (minimum, inclusive) in _ROPE_MINIMUMS.items():
        value = params.get(key) if isinstance(params, Mapping) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"rope_parameters {key} is {value!r}; it must be a finite number")
        elif value < minimum or (value == minimum and not inclusive):
            bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            problems.append(f"rope_parameters {key} is {value!r}; it must be {bound}")
    return problems


def rope_problem_of(error: BaseException) -> str | None:
    """The named RoPE field behind an error a Transformers config raised while validating its RoPE
    parameters (a bare ``division by zero`` from ``_validate_yarn_rope_parameters``): the frames of
    its traceback hold the parameters it was checking. None when the error did not come from there."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name.startswith("_validate") and isinstance(frame.f_locals.get("rope_parameters"), Mapping):
            found = rope_problems(frame.f_locals["rope_parameters"])
            if found:
                return found[0]
        tb = tb.tb_next
    return None
