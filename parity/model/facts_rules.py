"""Per-``model_type`` rules: what a model decides that its config does not say (Cohere 2 rotates
only on sliding layers, SmolLM3 skips RoPE on the layers ``no_rope_layers`` marks, GPT-2 keeps its
layers under ``transformer.h``, Qwen3-MoE's sparse layers).

A rule is ``f(config, facts) -> facts``, registered with :func:`rule` for one or more model types;
:func:`parity.model.derive.derive_facts` applies it after the generic derivation. A new family needs
a rule only where the generic facts are wrong for it (see docs/adding-a-family.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

from parity.model.facts import FULL, LINEAR, SLIDING, ArchFacts, LayerFacts, RopeFacts, default_inv_freq, with_layers

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


@rule("olmo2", "olmo3")
def _olmo(config, facts: ArchFacts) -> ArchFacts:
    return replace(facts, qk_norm="projection")


@rule("ernie4_5", "ernie4_5_moe")
def _ernie(config, facts: ArchFacts) -> ArchFacts:
    # Ernie4_5's rotate_half pairs (2i, 2i + 1): interleaved RoPE, as GPT-J's. Ernie4_5_MoeTopKRouter: a softmax
    # over the experts, moe_statics' correction bias added for the choice only, the chosen renormalised: DeepSeek
    # V3's router with one group, softmax scores and no scaling factor
    facts = with_layers(facts, rope=lambda layer: replace(layer.rope, interleaved=True) if layer.rope else None)
    if facts.model_type != "ernie4_5_moe":
        return facts
    return replace(facts, routing=_one_group(1.0, renormalised=True, softmax=True))


@rule("cohere", "cohere2")
def _cohere(config, facts: ArchFacts) -> ArchFacts:
    # Cohere2Attention rotates only on sliding layers (full layers are NoPE), with interleaved pairs.
    def rope(layer: LayerFacts):
        if layer.rope is None or (facts.model_type == "cohere2" and layer.layer_type != SLIDING):
            return None
        return replace(layer.rope, interleaved=True)

    return replace(with_layers(facts, rope=rope), norm_kind="layernorm")


@rule("exaone4", "kolibri1")
def _exaone4(config, facts: ArchFacts) -> ArchFacts:
    # Exaone4Attention (and Kolibri1Attention, its subclass) rotates only on sliding layers when the config has a
    # window (its full layers are NoPE)
    if not getattr(config, "sliding_window", None):
        return facts
    return with_layers(facts, rope=lambda layer: layer.rope if layer.layer_type == SLIDING else None)


@rule("flint")
def _flint(config, facts: ArchFacts) -> ArchFacts:
    # FlintAttention rotates only on sliding layers, and only with a window in the config (else on none)
    window = getattr(config, "sliding_window", None)
    return with_layers(facts, rope=lambda layer: layer.rope if window and layer.layer_type == SLIDING else None)


@rule("gptj", "codegen")
def _gptj(config, facts: ArchFacts) -> ArchFacts:
    # GPTJAttention / CodeGenAttention rotate interleaved pairs (rotate_every_two) in the first rotary_dim dims
    # (the whole head without one), base 10000; their configs carry no rope_parameters, only rotary_dim
    def rope(layer: LayerFacts):
        if layer.rope is not None:
            return replace(layer.rope, interleaved=True)
        rotary_dim = int(getattr(config, "rotary_dim", None) or layer.head_dim)
        return RopeFacts(
            rope_type="default",
            theta=10_000.0,
            parameters=MappingProxyType({"rope_type": "default", "rope_theta": 10_000.0}),
            rotary_dim=rotary_dim,
            interleaved=True,
            inv_freq=default_inv_freq(10_000.0, rotary_dim),
        )

    return with_layers(facts, rope=rope)


@rule("nemotron")
def _nemotron(config, facts: ArchFacts) -> ArchFacts:
    # NemotronLayerNorm1P: a LayerNorm (with bias) that scales by 1 + weight; its eps is config.norm_eps
    return replace(facts, norm_kind="layernorm", norm_weight_offset=1.0)


@rule("olmo")
def _olmo1(config, facts: ArchFacts) -> ArchFacts:
    # OlmoLayerNorm: F.layer_norm with no weight and no bias, eps fixed at 1e-5 (the config has no field)
    return replace(facts, norm_kind="layernorm", norm_eps=1e-5)


@rule("smollm3")
def _smollm3(config, facts: ArchFacts) -> ArchFacts:
    # SmolLM3Attention rotates only where no_rope_layers[i] is 1 (the list says which layers *use* RoPE)
    use = list(getattr(config, "no_rope_layers", None) or [])
    facts = with_layers(facts, rope=lambda layer: layer.rope if layer.index >= len(use) or use[layer.index] else None)
    return replace(facts, nope_field="no_rope_layers") if use else facts


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

    return replace(
        with_layers(facts, rope=rope),
        qk_norm="head",
        norm_weight_offset=1.0,
        chunk_size=64,
        conv_kernel=int(config.linear_conv_kernel_dim),
    )


@rule("mistral")
def _mistral(config, facts: ArchFacts) -> ArchFacts:
    # MistralModel builds a sliding-window mask for every layer whenever sliding_window is set.
    # A window of 0 is a window too (MistralModel tests `is None`): validate_facts refuses it by name.
    window = getattr(config, "sliding_window", None)
    if window is None:
        return facts
    return with_layers(facts, layer_type=lambda layer: SLIDING, window=lambda layer: int(window))


@rule("gemma2")
def _gemma2(config, facts: ArchFacts) -> ArchFacts:
    # Gemma2RMSNorm multiplies by 1 + w; Gemma2Model scales the embeddings by sqrt(hidden_size)
    return replace(facts, norm_weight_offset=1.0, embed_scale=math.sqrt(facts.hidden_size))


@rule("gemma3_text", "gemma3")
def _gemma3(config, facts: ArchFacts) -> ArchFacts:
    # Gemma3Attention (Transformers 5.24) keeps attn_logit_softcapping but never applies it
    return replace(
        facts, qk_norm="head", norm_weight_offset=1.0, embed_scale=math.sqrt(facts.hidden_size), attn_softcap=None
    )


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


@rule("gemma4_text", "gemma4_unified_text")
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
    return replace(
        facts,
        qk_norm="head",
        embed_scale=math.sqrt(facts.hidden_size),
        attn_softcap=None,
        extra_constants={**facts.extra_constants, **constants},
        features=facts.features | {name for name, present in features.items() if present},
    )


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


#: a feature: the config names no attention heads at all (Mamba's): a model without attention, whose heads and head
#: size are not asked for
ATTENTION_FREE = "no attention"


#: a feature: the reference multiplies q by the attention scale right after q_proj (fairseq's habit), so its
#: q (the q_rot node) is already scaled and its scores take no further scale
Q_PRESCALED = "q scaled after q_proj"


@rule("opt", "xglm", "biogpt")
def _q_prescaled(config, facts: ArchFacts) -> ArchFacts:
    # OPTAttention, XGLMAttention, BioGptAttention: query_states = q_proj(hidden_states) * scaling
    return replace(facts, features=frozenset(facts.features | {Q_PRESCALED}))


#: a feature: the checkpoint's experts hold gate and up interleaved along their last axis (GPT-OSS's
#: ``gate_up_proj[..., ::2]`` and ``[..., 1::2]``), so a port de-interleaving them at load reads them right
GATE_UP_INTERLEAVED = "gate/up interleaved"


@rule("gpt_oss")
def _gpt_oss(config, facts: ArchFacts) -> ArchFacts:
    return replace(facts, features=frozenset(facts.features | {GATE_UP_INTERLEAVED}))


#: a feature: q/k's rotated tail comes from checkpoint rows laid as interleaved pairs (DeepSeek's rope_interleave)
MLA_INTERLEAVED_ROPE = "MLA rope rows interleaved"
#: a feature: each q/k head is cat(pass-through, rotated) (MLA's cat(nope, rope)), where partial-rotary
#: families rotate the first dims (cat(rotated, pass-through))
ROTATED_LAST = "rotated dims last in each head"


@rule("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4")
def _deepseek(config, facts: ArchFacts) -> ArchFacts:
    # DeepseekV3Attention (multi-head latent attention; GLM-4-MoE-Lite's and Mistral 4's are the same): q and k
    # are qk_nope_head_dim + qk_rope_head_dim wide (config.head_dim is the rotated part alone) and the scores
    # scale by that width's -0.5 power, times YaRN's mscale(factor, mscale_all_dim) squared where the RoPE is
    # YaRN's (DeepseekV3Attention.__init__, Mistral 4's yarn_apply_mscale)
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if not nope or not rope:
        return facts
    width = int(nope) + int(rope)
    mscale = _yarn_softmax_mscale(config)
    scale = width**-0.5 * mscale**2
    facts = with_layers(facts, head_dim=lambda layer: width, attention_scale=lambda layer: scale)
    # rope_interleave: the checkpoint's rope rows hold interleaved pairs, which Transformers reorders into
    # halves before it rotates the tail of each head (apply_rotary_pos_emb_interleave)
    features = facts.features | {ROTATED_LAST}
    features |= {MLA_INTERLEAVED_ROPE} if getattr(config, "rope_interleave", False) else set()
    routing = _routing(config)
    if facts.model_type == "mistral4":  # Mistral4TopkRouter: DeepSeek V3's group-limited choice over a softmax
        routing = {**routing, "softmax_scores": 1.0}
    if facts.model_type == "deepseek_v2":  # DeepseekV2Moe: a softmax; group_limited_greedy scores a group by its best
        limited = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        routing = {**routing, "softmax_scores": 1.0, "group_max": 1.0}
        routing = routing if limited else {**routing, "n_group": 1.0, "topk_group": 1.0}  # greedy: no group limit
        # its apply_rotary_emb turns (2i, 2i + 1) pairs as complex numbers (no rotate_half to read it from)
        facts = with_layers(facts, rope=lambda layer: replace(layer.rope, interleaved=True) if layer.rope else None)
    named = {YARN_SOFTMAX_MSCALE: mscale} if mscale != 1.0 else {}
    return replace(
        facts,
        head_dim=width,
        features=frozenset(features),
        routing=routing,
        extra_constants={**named, **facts.extra_constants},
    )


#: the named constant of latent attention's YaRN softmax factor (applied squared to 1/sqrt(head_dim))
YARN_SOFTMAX_MSCALE = "YaRN's softmax mscale 0.1 mscale_all_dim ln(factor) + 1"


def _yarn_softmax_mscale(config) -> float:
    """YaRN's ``0.1 * mscale_all_dim * ln(factor) + 1`` (1 for a factor <= 1, no ``mscale_all_dim``, no YaRN), the
    factor DeepSeek's latent attention applies twice to its softmax scale (yarn_get_mscale in Transformers)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    factor, all_dim = float(params.get("factor") or 1.0), float(params.get("mscale_all_dim") or 0.0)
    if params.get("rope_type", params.get("type")) != "yarn" or not all_dim or factor <= 1:
        return 1.0
    return 0.1 * all_dim * math.log(factor) + 1.0


@rule("longcat_flash")
def _longcat_flash(config, facts: ArchFacts) -> ArchFacts:
    # LongcatFlashMLA: DeepSeek's latent attention, its rope rows always interleaved (apply_rotary_pos_emb_interleave
    # whatever the config says); LongcatFlashTopkRouter: a softmax over the routed and the zero-compute experts, the
    # correction bias for the choice only, the chosen's probabilities not renormalised, times routed_scaling_factor
    facts = _deepseek(config, facts)
    experts = int(config.n_routed_experts) + int(config.zero_expert_num or 0)  # the router scores both kinds
    facts = with_layers(facts, num_experts=lambda layer: experts if layer.num_experts else 0)
    hidden = float(config.hidden_size)
    lora = {  # LongcatFlashMLA's mla_scale_q_lora and mla_scale_kv_lora, factors a hint can name
        f"LongCat's q LoRA scale sqrt(hidden_size / q_lora_rank) ({(hidden / config.q_lora_rank) ** 0.5:g})": (
            hidden / config.q_lora_rank
        )
        ** 0.5,
        f"LongCat's kv LoRA scale sqrt(hidden_size / kv_lora_rank) ({(hidden / config.kv_lora_rank) ** 0.5:g})": (
            hidden / config.kv_lora_rank
        )
        ** 0.5,
    }
    return replace(
        facts,
        features=frozenset(facts.features | {MLA_INTERLEAVED_ROPE}),
        routing={
            **_one_group(float(config.routed_scaling_factor), renormalised=False, softmax=True),
            "zero_experts_from": float(config.n_routed_experts),
        },
        extra_constants={**lora, **facts.extra_constants},
    )


def _one_group(scale: float, renormalised: bool, softmax: bool = False) -> dict[str, float]:
    """The routing constants of DeepSeek V3's router with one group (no group limit): AFMoE's, ERNIE 4.5's
    (softmax scores), LongCat-Flash's (softmax scores, not renormalised)."""
    routing = {"routed_scaling_factor": scale, "n_group": 1.0, "topk_group": 1.0, "norm_topk_prob": float(renormalised)}
    return {**routing, "softmax_scores": 1.0} if softmax else routing


def _routing(config) -> dict[str, float]:
    """A group-limited sigmoid router's constants, those the config has."""
    return {
        name: float(getattr(config, name))
        for name in ("routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")
        if getattr(config, name, None) is not None
    }


@rule("phimoe")
def _sparsemixer_routing(config, facts: ArchFacts) -> ArchFacts:
    # PhimoeTopKRouter routes by SparseMixer (sparsemixer in modeling_phimoe): router_jitter_noise is its
    # threshold's eps at inference, not noise
    return replace(facts, routing={"sparsemixer_eps": float(config.router_jitter_noise)})


@rule("afmoe")
def _afmoe(config, facts: ArchFacts) -> ArchFacts:
    # AfmoeAttention rotates only on its sliding (local) layers; AfmoeTokenChoiceRouter: sigmoid scores, its
    # block's expert_bias added for the choice only, the top k renormalised and times route_scale: DeepSeek V3's
    # router with one group
    scale = float(getattr(config, "route_scale", 1.0) or 1.0)
    facts = with_layers(facts, rope=lambda layer: layer.rope if layer.layer_type == SLIDING else None)
    return replace(facts, routing=_one_group(scale, renormalised=True))


@rule("lfm2_moe")
def _lfm2_moe(config, facts: ArchFacts) -> ArchFacts:
    # Lfm2MoeTopKRouter: sigmoid scores, its block's expert_bias added for the choice only (use_expert_bias), the
    # top k renormalised where norm_topk_prob says so and times routed_scaling_factor: DeepSeek V3's router with
    # one group
    scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
    return replace(facts, routing=_one_group(scale, renormalised=bool(getattr(config, "norm_topk_prob", False))))


@rule("minimax_m2")
def _minimax_m2(config, facts: ArchFacts) -> ArchFacts:
    # MiniMaxM2TopKRouter: sigmoid scores, its block's e_score_correction_bias added for the choice only, the top k
    # renormalised, no routed scaling: DeepSeek V3's router with one group
    return replace(facts, routing=_one_group(1.0, renormalised=True))


@rule("cohere2_moe")
def _cohere2_moe(config, facts: ArchFacts) -> ArchFacts:
    # Cohere2MoeAttention rotates (interleaved pairs) on sliding layers, and on the dense prefix layers when
    # prefix_dense_sliding_window_pattern is 1 (its force_rope); its other full layers are NoPE
    dense = list(getattr(config, "mlp_layer_types", None) or [])
    forced = getattr(config, "prefix_dense_sliding_window_pattern", None) == 1

    def rope(layer: LayerFacts):
        rotated = layer.layer_type == SLIDING or (forced and layer.index < len(dense) and dense[layer.index] == "dense")
        return replace(layer.rope, interleaved=True) if layer.rope is not None and rotated else None

    return replace(with_layers(facts, rope=rope), norm_kind="layernorm")


@rule("glm4_moe", "dots1")
def _deepseek_routing(config, facts: ArchFacts) -> ArchFacts:
    # Glm4MoeTopkRouter / Dots1TopkRouter / ExaoneMoeTopkRouter route as DeepSeek V3 does (sigmoid scores, a
    # correction bias for the choice, group-limited top-k, routed_scaling_factor) with standard attention
    return replace(facts, routing=_routing(config))


@rule("exaone_moe")
def _exaone_moe(config, facts: ArchFacts) -> ArchFacts:
    # EXAONE 4's attention (RoPE on sliding layers only when the config has a window) with DeepSeek V3's routing
    return _exaone4(config, _deepseek_routing(config, facts))


#: BLT's three stacks of layers, in the order it runs them: (the ModuleList's path, the sub-config sizing it)
_BLT_STACKS = (
    ("model.local_encoder.layers", "encoder_config"),
    ("model.global_transformer.layers", "global_config"),
    ("model.local_decoder.layers", "decoder_config"),
)


@rule("blt")
def _blt(config, facts: ArchFacts) -> ArchFacts:
    # BltModel runs a local encoder over the bytes, a global transformer over the patches and a local decoder over
    # the bytes again, each a stack of its own sub-config's width, heads and RoPE theta (BltLocalEncoderConfig,
    # BltGlobalTransformerConfig, BltLocalDecoderConfig): one numbering of the layers across the three stacks
    from parity.model.derive import derive_facts  # (derive applies these rules)

    layers: list[LayerFacts] = []
    stacks: list[tuple[str, int]] = []
    for path, field in _BLT_STACKS:
        sub = getattr(config, field, None)
        if sub is None:
            return facts
        own = derive_facts(sub)
        stacks.append((path, len(layers)))
        layers += [replace(layer, index=len(layers) + i, num_heads=own.num_heads) for i, layer in enumerate(own.layers)]
    first = derive_facts(config.encoder_config)
    return replace(
        facts,
        layers=tuple(layers),
        num_layers=len(layers),
        layer_prefix=stacks[0][0],
        stacks=tuple(stacks[1:]),
        hidden_size=first.hidden_size,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        norm_kind=first.norm_kind,
        norm_eps=first.norm_eps,
        ngram_hash=MappingProxyType(
            {
                "group_sizes": tuple(getattr(config, "encoder_hash_byte_group_size", None) or ()),
                "vocab": int(getattr(config, "encoder_hash_byte_group_vocab", 0) or 0),
                "functions": int(getattr(config, "encoder_hash_byte_group_nb_functions", 0) or 0),
            }
        ),
    )
