"""ArchFacts from a Transformers config: the standard fields first, then the ``model_type``'s rule
(:mod:`parity.model.facts_rules`); and :func:`validate_facts`, the reasons no check can run on them."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

import torch

from parity.model.facts import (
    FULL,
    SLIDING,
    ArchFacts,
    LayerFacts,
    RopeFacts,
    default_inv_freq,
    rope_init,
    with_layers,
)
from parity.model.facts_rules import ATTENTION_FREE, MLA_INTERLEAVED_ROPE, ROTATED_LAST, RULES
from parity.util.source import source_of


def _clip_in_attn_config(config) -> float | None:
    """MPT keeps ``clip_qkv`` in its ``attn_config`` (an object or a dict)."""
    attn = getattr(config, "attn_config", None)
    value = attn.get("clip_qkv") if isinstance(attn, dict) else getattr(attn, "clip_qkv", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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


def _widest(size):
    """A size given per layer (Gemma 3n's ``intermediate_size`` list) as its largest; one size as it is."""
    return max(size) if isinstance(size, list | tuple) and size else size


def _per_layer(config, name: str, n_layers: int, default):
    """The value of ``name`` at each layer (``default`` where a layer does not set it)."""
    if not getattr(config, "is_heterogeneous", False) or name not in (config.per_layer_attributes or ()):
        return [default] * n_layers
    return [getattr(config.per_layer_config[i], name, None) or default for i in range(n_layers)]


def _rope_by_type(config, layer_types: tuple[str, ...]) -> dict[str, dict | None]:
    params = getattr(config, "rope_parameters", None)
    if not params:
        return {t: None for t in set(layer_types)}
    if (
        isinstance(params, Mapping)
        and set(params) & set(layer_types)
        and all(v is None or isinstance(v, Mapping) for v in params.values())  # None: a NoPE type (Beam's full layers)
        and any(isinstance(v, Mapping) for v in params.values())
    ):
        return {t: (dict(params[t]) if params.get(t) is not None else None) for t in set(layer_types)}
    return {t: dict(params) for t in set(layer_types)}


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
    try:
        return _homogeneous_facts(config, model)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError: a field read globally that varies per layer
        if not (getattr(config, "is_heterogeneous", False) and getattr(config, "per_layer_config", None)):
            raise
        return _heterogeneous_facts(config, model)


def _homogeneous_facts(config, model) -> ArchFacts:
    """:func:`derive_facts` of a config whose fields are read as the model's (a heterogeneous config's
    per-layer fields where the model's rule reads them per layer, as Gemma 4's)."""
    hidden = int(_get(config, "hidden_size", "n_embd", default=0))
    heads = int(_get(config, "num_attention_heads", "n_head", default=0))
    kv = _get(config, "num_key_value_heads", default=None)
    kv = heads if kv is None else int(kv)  # null means MHA; an explicit 0 is kept for validate_facts to refuse
    if _get(config, "multi_query", default=False) and not _get(config, "new_decoder_architecture", default=False):
        kv = 1  # Falcon's multi-query: one key/value head whatever num_kv_heads says (FalconAttention)
    head_dim = _get(config, "head_dim")
    head_dim = int(head_dim) if head_dim is not None else (hidden // heads if heads else 0)
    n_layers = int(_get(config, "num_hidden_layers", "n_layer", default=0))
    layer_types = tuple(_get(config, "layer_types", default=None) or [FULL] * n_layers)
    head_dims = [int(d) for d in _per_layer(config, "head_dim", n_layers, head_dim)]
    kv_heads = [int(k) for k in _per_layer(config, "num_key_value_heads", n_layers, kv)]
    window = _get(config, "sliding_window")
    ropes = _rope_by_type(config, layer_types)
    per_type = (
        bool(getattr(config, "rope_parameters", None)) and set(config.rope_parameters) & set(layer_types) != set()
    )
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
        alpha = params.get("alpha") if params.get("rope_type") == "dynamic" and rotary_dim > 2 else None
        if alpha:  # HunYuan's fixed NTK alpha: plain RoPE at every length, base theta * alpha^(d / (d - 2))
            theta = theta * float(alpha) ** (rotary_dim / (rotary_dim - 2))
            inv_freq, attention_factor = default_inv_freq(theta, rotary_dim), 1.0
        else:
            inv_freq, attention_factor = rope_init(config, layer_type, params, per_type, theta, rotary_dim)
        rope_facts[layer_type] = RopeFacts(
            rope_type=str(params.get("rope_type", "default")),
            theta=theta,
            parameters=MappingProxyType(params),
            attention_factor=attention_factor,
            rotary_dim=rotary_dim,
            inv_freq=inv_freq,
        )
    num_experts = int(_get(config, "num_experts", "num_local_experts", default=0) or 0)
    # a per-layer list where the config gives one (HunYuan MoE's moe_topk, read as num_experts_per_tok)
    per_token = _get(config, "num_experts_per_tok", default=0) or 0
    per_layer = [int(k) for k in per_token] if num_experts and isinstance(per_token, (list, tuple)) else []
    experts_per_token = 0 if not num_experts else max(per_layer) if per_layer else int(per_token)
    ffn = getattr(config, "ffn_config", None)  # DBRX keeps its MoE sizes in ffn_config
    if not num_experts and ffn is not None and getattr(ffn, "moe_num_experts", None):
        num_experts, experts_per_token = int(ffn.moe_num_experts), int(getattr(ffn, "moe_top_k", 0) or 0)
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
            attention_scale=scalar**-0.5 if scalar else (head_dims[i] ** -0.5 if head_dims[i] else 1.0),
            num_experts=num_experts,  # every layer, unless the model_type's rule says otherwise
            experts_per_token=per_layer[i] if i < len(per_layer) else experts_per_token,
        )
        for i, t in enumerate(layer_types)
    )
    eps = _get(config, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
    facts = ArchFacts(
        model_type=str(getattr(config, "model_type", "") or ""),
        vocab_size=int(_get(config, "vocab_size", default=0)),
        hidden_size=hidden,
        intermediate_size=_widest(_get(config, "intermediate_size", "n_inner")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        layers=layers,
        norm_kind="layernorm"
        if _get(config, "layer_norm_eps", "layer_norm_epsilon") is not None and _get(config, "rms_norm_eps") is None
        else "rmsnorm",
        norm_eps=float(eps) if eps is not None else None,
        logit_scale=_get(config, "logit_scale"),
        query_pre_attn_scalar=scalar,
        # RecurrentGemma's logits_soft_cap, xLSTM's output_logit_soft_cap
        final_softcap=_get(config, "final_logit_softcapping")
        or _get(config, "logits_soft_cap")
        or _get(config, "output_logit_soft_cap"),
        attn_softcap=_get(config, "attn_logit_softcapping"),
        clip_qkv=_get(config, "clip_qkv") or _clip_in_attn_config(config),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
        max_position_embeddings=_get(config, "max_position_embeddings"),
    )
    adjust = RULES.get(facts.model_type)
    if adjust is None and _get(config, "qk_nope_head_dim") and _get(config, "qk_rope_head_dim"):
        adjust = RULES["deepseek_v3"]  # a family of multi-head latent attention with no rule of its own
    if adjust is None and _group_limited_sigmoid(config):
        adjust = RULES["glm4_moe"]  # standard attention, DeepSeek V3's router, no rule of its own (Solar Open)
    if adjust is not None:
        facts = adjust(config, facts)
    facts = _nope_layers(config, facts)
    if _get(config, "num_attention_heads", "n_head") is None and not heads:
        # no attention heads in the config at all (Mamba's): no attention to size, nothing to refuse
        facts = replace(facts, features=frozenset(facts.features | {ATTENTION_FREE}))
    multipliers = _config_multipliers(config)
    if multipliers:  # Granite's embedding/residual/attention multipliers, logits_scaling: factors a hint can name
        facts = replace(facts, extra_constants={**multipliers, **facts.extra_constants})
    if model is not None:
        prefix = find_layer_prefix(model, facts.num_layers)
        if prefix is not None and prefix != facts.layer_prefix:
            facts = replace(facts, layer_prefix=prefix)
        facts = _from_modules(model, facts)
        if facts.embed_scale is None:  # an embedding module that scales its output (Gemma's ScaledWordEmbedding)
            scale = getattr(dict(model.named_modules()).get(facts.embed_module), "embed_scale", None)
            if isinstance(scale, torch.Tensor) and scale.numel() == 1:
                scale = float(scale)
            if isinstance(scale, (int, float)) and scale not in (0, 1):
                facts = replace(facts, embed_scale=float(scale))
    return facts


def _nope_layers(config, facts: ArchFacts) -> ArchFacts:
    """The layers a per-layer list in the config leaves without RoPE, where no rule said it: ``no_rope_layers``
    (1 marks a layer that uses RoPE: SmolLM3's, Mistral Large 4's) or ``layer_rope_theta`` (a theta of 0 is a NoPE
    layer: Granite-SWA's, Muse Spark's); their RoPE facts dropped and the field named."""
    if facts.nope_field:
        return facts
    n = len(facts.layers)
    for field, nope in (("no_rope_layers", lambda v: not v), ("layer_rope_theta", lambda v: v == 0)):
        values = _get(config, field)
        if isinstance(values, list | tuple) and len(values) >= n and any(nope(values[i]) for i in range(n)):
            unrotated = {i for i in range(n) if nope(values[i])}
            facts = with_layers(facts, rope=lambda layer, off=unrotated: None if layer.index in off else layer.rope)
            return replace(facts, nope_field=field)
    return facts


def _heterogeneous_facts(config, model) -> ArchFacts:
    """The facts of a heterogeneous config (Transformers' ``per_layer_config``: dots.3-note's sliding layers with
    their own heads, latent ranks and head widths): each layer's from its own layer config, which holds the
    model's fields with that layer's values; the model's from its first layer's. Only where reading a per-layer
    field globally raised: a rule reading them per layer (Gemma 4's) keeps its own facts."""
    n_layers = int(_get(config, "num_hidden_layers", default=0))
    facts = derive_facts(config.per_layer_config[0], model)
    own = [facts, *(derive_facts(config.per_layer_config[i]) for i in range(1, n_layers))]
    layers = tuple(
        replace(layer.layers[i], num_heads=layer.num_heads if layer.num_heads != facts.num_heads else 0)
        for i, layer in enumerate(own)
        if i < len(layer.layers)
    )
    return replace(facts, layers=layers) if len(layers) == n_layers else facts


def _group_limited_sigmoid(config) -> bool:
    """Whether ``config`` names DeepSeek V3's router (sigmoid scores, group-limited top k, a routed scaling factor:
    ``n_group``, ``topk_group``, ``routed_scaling_factor``) and not DeepSeek V2's softmax one (``scoring_func``
    "softmax", ``topk_method`` "greedy" or "group_limited_greedy")."""
    named = all(_get(config, n) is not None for n in ("n_group", "topk_group", "routed_scaling_factor"))
    softmax = _get(config, "scoring_func") == "softmax" or _get(config, "topk_method") in (
        "greedy",
        "group_limited_greedy",
    )
    return named and not softmax


def _from_modules(model, facts: ArchFacts) -> ArchFacts:
    """What the reference's modules say where its config names it otherwise (DBRX keeps its embedding at
    ``transformer.wte`` and its LayerNorms' eps out of the config): the input embedding's path, and a
    LayerNorm's kind and eps when the config named no eps."""
    modules = dict(model.named_modules())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    path = next((name for name, m in modules.items() if m is embed), None) if embed is not None else None
    if path and path != facts.embed_module and facts.embed_module not in modules:
        facts = replace(facts, embed_module=path)
    if facts.norm_eps is None:
        norm = next((m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)), None)
        if norm is not None:
            facts = replace(facts, norm_kind="layernorm", norm_eps=float(norm.eps))
    if _rotates_interleaved(model):
        facts = with_layers(facts, rope=lambda layer: replace(layer.rope, interleaved=True) if layer.rope else None)
    boundaries = _boundary_tokens(model)
    if boundaries and not facts.boundary_tokens:
        facts = replace(facts, boundary_tokens=boundaries)
    if ROTATED_LAST in facts.features and _latent_rope_always_interleaved(modules):
        facts = replace(facts, features=facts.features | {MLA_INTERLEAVED_ROPE})
    offset = _position_offset(modules)
    if offset:
        facts = replace(facts, position_offset=offset)
    return _kv_heads_from_modules(modules, facts)


def _position_offset(modules: dict) -> int:
    """``padding_idx + 1`` where an embedding module of the reference derives position ids from the input ids
    itself when given none (RobertaEmbeddings' ``create_position_ids_from_input_ids``: the real tokens count from
    ``padding_idx + 1``, fairseq's convention, which its checkpoints were trained with); 0 otherwise."""
    for module in modules.values():
        padding = getattr(module, "padding_idx", None)
        if callable(getattr(module, "create_position_ids_from_input_ids", None)) and isinstance(padding, int):
            return padding + 1
    return 0


def _boundary_tokens(model) -> tuple[int, ...]:
    """The config's ``eos_token_id`` (its first) when a module class of the reference reads it in its own code (the
    forward treats the token as a boundary: Qwen4-Exp's n-gram context restarts after it), else ()."""
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if not isinstance(eos, int):
        return ()
    classes = {type(m) for m in model.modules()}
    found = any(c.__module__.startswith("transformers.models.") and "eos_token_id" in source_of(c) for c in classes)
    return (eos,) if found else ()


def _latent_rope_always_interleaved(modules: dict) -> bool:
    """Whether the reference's latent attention reorders its rope rows from interleaved pairs whatever its config
    says: a module holding ``qk_rope_head_dim`` whose forward calls ``apply_rotary_pos_emb_interleave`` and never
    reads ``rope_interleave`` (DeepSeek V3.2's, LongCat-Flash's)."""
    classes = {type(m) for m in modules.values() if isinstance(getattr(m, "qk_rope_head_dim", None), int)}
    sources = [source_of(cls.forward) for cls in classes]  # one per class, not per layer
    return any("apply_rotary_pos_emb_interleave" in s and "rope_interleave" not in s for s in sources)


def _kv_heads_from_modules(modules: dict, facts: ArchFacts) -> ArchFacts:
    """Each layer's KV head count as its ``self_attn.k_proj`` holds it (output features / head_dim) where that
    differs from the config's: MiMo-V2-Flash's sliding layers double ``num_key_value_heads`` in code; and its
    query heads as its attention module holds them (``num_heads``, or ``num_key_value_groups`` times its KV
    heads) where they differ from the model's: Laguna's ``num_attention_heads_per_layer``."""
    layers = []
    for layer in facts.layers:
        attention = modules.get(f"{facts.layer_path(layer.index)}.self_attn")
        k_proj = modules.get(f"{facts.layer_path(layer.index)}.self_attn.k_proj")
        width = getattr(k_proj, "out_features", None)
        if isinstance(width, int) and layer.head_dim and width % layer.head_dim == 0:
            layer = replace(layer, num_kv_heads=width // layer.head_dim)
        heads = getattr(attention, "num_heads", None)
        groups = getattr(attention, "num_key_value_groups", None)
        if not isinstance(heads, int) and isinstance(groups, int) and layer.num_kv_heads:
            heads = groups * layer.num_kv_heads
        if isinstance(heads, int) and heads > 0 and heads != facts.num_heads:
            layer = replace(layer, num_heads=heads)
        layers.append(layer)
    if not any(f"{facts.layer_path(layer.index)}.self_attn.k_proj" in modules for layer in facts.layers):
        # no layer where the config's count puts them (HRM's two stacks, run in cycles: its num_hidden_layers
        # counts cache slots): every key projection the model holds, when one head count fits them all
        counts = {
            m.out_features // facts.head_dim
            for path, m in modules.items()
            if path.endswith("self_attn.k_proj") and isinstance(getattr(m, "out_features", None), int)
        }
        if len(counts) == 1 and facts.head_dim and (kv := counts.pop()) != facts.num_kv_heads:
            layers = [replace(layer, num_kv_heads=kv) for layer in layers]
            facts = replace(facts, num_kv_heads=kv)
    return replace(facts, layers=tuple(layers)) if tuple(layers) != tuple(facts.layers) else facts


def _rotates_interleaved(model) -> bool:
    """Whether the reference's modeling module rotates interleaved pairs ``(2i, 2i + 1)``: its ``rotate_half``
    (the function Transformers' ``apply_rotary_pos_emb`` calls) run on ``[0, 1, 2, 3]`` gives ``[-1, 0, -3, 2]``
    (Helium's, GLM's, Ernie 4.5's), not the half-split ``[-2, -3, 0, 1]`` of Llama's."""
    module = sys.modules.get(type(model).__module__)
    rotate_half = getattr(module, "rotate_half", None)
    if not callable(rotate_half):
        return False
    try:
        out = rotate_half(torch.arange(4.0)[None])
    except Exception:  # a rotate_half of another signature: the config's rule decides
        return False
    return isinstance(out, torch.Tensor) and out.flatten().tolist() == [-1.0, 0.0, -3.0, 2.0]


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
            name
            for name, m in model.named_modules()
            if name and isinstance(m, PreTrainedModel) and getattr(m, "config", None) is text_config
        ]
        path = min(found, key=lambda n: (n.count("."), len(n))) if found else path
    tail = facts.layer_prefix.partition(".")[2] or "layers"
    ids = (getattr(config, name, None) for name in PLACEHOLDERS.get(getattr(config, "model_type", ""), ()))
    placeholders = tuple(sorted({int(i) for i in ids if isinstance(i, int) and 0 <= i < facts.vocab_size}))
    return replace(
        facts,
        layer_prefix=f"{path}.{tail}",
        embed_module=f"{path}.{facts.embed_module.partition('.')[2]}",
        placeholder_tokens=placeholders,
    )


def _config_multipliers(config) -> dict[str, float]:
    """The config's scalar multipliers and scalings (a number field whose name says multiplier, scaling, factor
    or scale, not 1: MiMo-V2-Flash's attention_value_scale, MiniMax's residual alpha factors), with their squares,
    by a name a hint can use; RWKV's factor 2 its hidden states are halved by every ``rescale_every`` layers; and
    hidden_size over a base width the config names (muP's ``dim_model_base``: MiniCPM
    divides its logits by it)."""
    try:
        fields = config.to_dict()
    except Exception:  # a config that cannot serialise itself names no constants
        return {}
    named: dict[str, float] = {}
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value in (0, 1):
            continue
        if key.startswith(("initializer", "init_")):  # how weights were drawn at training start: no forward reads it
            continue
        words = ("multiplier", "scaling", "scale_depth", "scalar", "_factor")
        if any(word in key for word in words) or key.endswith("_scale"):
            named[f"the config's {key} ({value:g})"] = float(value)
            named[f"the config's {key} squared ({value * value:g})"] = float(value) ** 2
        if key == "linear_key_head_dim" and isinstance(value, int) and value > 1:  # Gated DeltaNet's query scale
            named[f"the delta rule's query scale 1 / sqrt(linear_key_head_dim={value}) ({value**-0.5:.6g})"] = (
                value**-0.5
            )
        if key == "rescale_every" and isinstance(value, int) and value > 0:  # RWKV's inference halving
            named[f"the hidden states' halving every config.rescale_every ({value}) layers (RWKV at inference)"] = 2.0
        if "conv" in key and "kernel" in key and isinstance(value, int) and value > 1:
            named.update(_conv_normalisers(key, value))
        hidden = fields.get("hidden_size")
        if "base" in key and ("dim" in key or "width" in key) and isinstance(hidden, int) and hidden != value > 0:
            # muP's base width (MiniCPM's dim_model_base): the logits are divided by hidden_size / base
            r = hidden / value
            named[f"the logits' width ratio hidden_size / the config's {key} ({r:g})"] = r
            named[f"the logits' width ratio hidden_size / the config's {key}, squared ({r * r:g}: the ratio applied "
                  "the other way round)"] = r * r  # fmt: skip
    return named


def _conv_normalisers(key: str, k: int) -> dict[str, float]:
    """The factors a short convolution of kernel width ``k`` (the config's ``key``) divides its output by (its
    taps and the residual summed: ``sqrt(k)``, ``sqrt(k + 1)``, ``sqrt(2k + 1)``, Inkling2-Loop's static and dynamic
    convs), and each one's ratio to another (one conv's normaliser where another's belongs)."""
    forms = {f"sqrt({key})": k, f"sqrt({key} + 1)": k + 1, f"sqrt(2 {key} + 1)": 2 * k + 1}
    named = {f"{name} ({math.sqrt(n):.6g}: a short conv's normaliser)": math.sqrt(n) for name, n in forms.items()}
    for (a, n), (b, m) in itertools.combinations(forms.items(), 2):
        named[f"{b} / {a} = sqrt({m}/{n}) (one short conv's normaliser where the other's belongs)"] = math.sqrt(m / n)
    return named


def find_layer_prefix(model, num_layers: int) -> str | None:
    """The path of the ModuleList holding ``num_layers`` decoder layers (the shortest such path)."""
    from torch import nn

    found = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and num_layers > 0 and name
    ]
    return min(found, key=lambda n: (n.count("."), len(n))) if found else None


# --- validation ---------------------------------------------------------------------------------


#: Transformers config fields that count something: a positive integer, or null where a model derives
#: it (``head_dim`` from the width); minimum per field (a mixture's expert counts may be 0: dense)
#: count fields a config may give per layer, as a list (Gemma 3n's MLP widths)
PER_LAYER_COUNTS = frozenset({"intermediate_size"})
COUNT_FIELDS = {
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "head_dim": 1,
    "vocab_size": 2,
    "max_position_embeddings": 1,
    "n_layer": 1,
    "n_head": 1,
    "n_embd": 1,
    "n_positions": 1,
    "n_inner": 1,
    "moe_intermediate_size": 1,
    "num_experts": 0,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
}


def count_field_problems(config) -> list[str]:
    """Count fields (:data:`COUNT_FIELDS`) of a Transformers config, or of a config.json dict (its
    ``text_config`` too), that hold anything but an integer at or above the field's minimum (null
    is left to the model, which may derive it): one line each, naming the field as the file does.
    Runs before anything reads them, so ``head_dim: 2.5`` is named, not rounded to 2 on one side only."""
    problems = []
    scopes = [("", config)]
    text = config.get("text_config") if isinstance(config, Mapping) else getattr(config, "text_config", None)
    if text is not None and text is not config:
        scopes.append(("text_config.", text))
    for prefix, scope in scopes:
        aliases = {} if isinstance(scope, Mapping) else getattr(type(scope), "attribute_map", None) or {}
        for name, minimum in COUNT_FIELDS.items():
            if name in aliases:  # GPT-2's num_attention_heads is its n_head: named as its file names it
                continue
            try:
                value = scope.get(name) if isinstance(scope, Mapping) else getattr(scope, name, None)
            except Exception:  # a per-layer attribute read globally: its layers are validated by Transformers
                continue
            if value is None:
                continue
            # one per layer where the architecture sizes each layer (Gemma 3n's intermediate_size)
            values = list(value) if name in PER_LAYER_COUNTS and isinstance(value, list | tuple) and value else [value]
            if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                what = "an integer, or one per layer" if name in PER_LAYER_COUNTS else "an integer"
                problems.append(f"{prefix}{name} is {value!r}; it must be {what}")
            elif min(values) < minimum:
                problems.append(f"{prefix}{name} is {value!r}; it must be at least {minimum}")
    return problems


def validate_facts(facts: ArchFacts) -> list[str]:
    """Reasons these facts describe a model no check can run on (one line each, naming the
    Transformers field); empty when the shapes make sense."""
    problems = []
    attention = ATTENTION_FREE not in facts.features  # (an explicit 0 heads is refused: only a config naming none)
    for label, value, minimum in (
        ("num_hidden_layers", facts.num_layers, 1),
        *(
            (("num_attention_heads", facts.num_heads, 1), ("num_key_value_heads", facts.num_kv_heads, 1))
            if attention
            else ()
        ),
        ("hidden_size", facts.hidden_size, 1),
        ("vocab_size", facts.vocab_size, 2),
        *((("head_dim", facts.head_dim, 1),) if attention else ()),
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
            shown = "null" if layer.window is None else repr(layer.window)
            problems.append(f"layer {layer.index} is sliding_attention but sliding_window is {shown}; it must be >= 1")
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


def remote_code_note(config) -> str | None:
    """One line when a config names remote code (``auto_map``: the classes a ``trust_remote_code``
    load would import from the checkpoint's own Python files), which parity never imports or runs:
    the reference is Transformers' own class for the ``model_type``, as ``from_pretrained`` loads it
    without ``trust_remote_code``, and the remote code may compute otherwise. None without ``auto_map``."""
    if config is None:
        return None
    auto_map = config.get("auto_map") if isinstance(config, Mapping) else getattr(config, "auto_map", None)
    if not auto_map or not isinstance(auto_map, Mapping):
        return None
    shown = ", ".join(f"{k} -> {v}" for k, v in list(auto_map.items())[:3]) + (" ..." if len(auto_map) > 3 else "")
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    return (
        f"config.json names remote code (auto_map: {shown}); parity never runs it: the reference is Transformers' own "
        f"{model_type} implementation, as from_pretrained loads it without trust_remote_code, and a model that is "
        "really that remote code may compute otherwise"
    )
