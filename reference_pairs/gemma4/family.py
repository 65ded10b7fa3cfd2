"""The Gemma 4 (dense text) family: our :class:`Gemma4Model` against ``transformers.Gemma4ForCausalLM``."""

from __future__ import annotations

import torch

from parity.model.facts_rules import kv_sources
from parity.model.family import Composite, Family, Node, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_to_hf
from ..common.mlp import ACTIVATIONS
from ..common.nodes import ATTENTION, EMBED, FINAL, LAYER_OUTPUT, MLP, QK_NORM, SANDWICH_NORMS
from .configs import CONFIGS, FULL, SLIDING
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import Gemma4Model, rope_parameters


def _has(feature: str):
    return lambda facts: feature in facts.features


def _own_kv(layer) -> bool:
    return layer.kv_source is None


#: a KV-shared layer has no K/V projections or norms (its ``k_rot`` is the keys of its ``kv_source``);
#: a K = V layer no value projection
_WHERE = {"k_proj": _own_kv, "k_norm": _own_kv, "v_proj": lambda layer: _own_kv(layer) and not layer.k_eq_v}
_ATT = "model.layers.{i}.self_attn"
_PLE, _BLOCK = _has("per-layer inputs"), "blocks.{i}"
NODES = NodeMap(
    before=[
        *EMBED,  # after the sqrt(emb_dim) scale on both sides
        Node("model.embed_tokens_per_layer", "embed_tokens_per_layer", when=_PLE),
        Node("model.per_layer_model_projection", "per_layer_model_projection", when=_PLE),
        Node("model.per_layer_projection_norm", "per_layer_projection_norm", when=_PLE),
    ],
    per_layer=[
        *SANDWICH_NORMS,
        *(Node(name, ours, where=_WHERE.get(name.rsplit(".", 1)[-1])) for name, ours in (*ATTENTION, *QK_NORM)),
        Node(f"{_ATT}.v_norm", f"{_BLOCK}.att.v_norm", where=_own_kv),
        *MLP,
        # this layer's slice of the per-layer inputs, and the branch that adds it after the FFN
        Node("model.layers.{i}@per_layer_input", f"{_BLOCK}@per_layer_input", when=_PLE),
        Node("model.layers.{i}.per_layer_input_gate@input", f"{_BLOCK}.per_layer_input_gate@input", when=_PLE),
        Node("model.layers.{i}.per_layer_input_gate", f"{_BLOCK}.per_layer_input_gate", when=_PLE),
        Node("model.layers.{i}.per_layer_projection@input", f"{_BLOCK}.per_layer_projection@input", when=_PLE),
        Node("model.layers.{i}.per_layer_projection", f"{_BLOCK}.per_layer_projection", when=_PLE),
        Node("model.layers.{i}.post_per_layer_input_norm", f"{_BLOCK}.post_per_layer_input_norm", when=_PLE),
        *LAYER_OUTPUT,  # after the layer scalar
    ],
    # ``lm_head`` is the head before the soft-cap, ``logits`` the model's output after it (also without a
    # cap in the config: a port that caps anyway shows there)
    after=FINAL,
)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.Gemma4TextConfig`` (per-layer head_dim through ``global_head_dim``,
    as a released config.json gives it). Raises ConfigError for what Gemma4TextConfig would change
    silently: a last layer that is not full attention, ``num_global_kv_heads`` without K = V."""
    from transformers import Gemma4TextConfig

    if cfg["layer_types"] and cfg["layer_types"][-1] != FULL:
        raise ConfigError("layer_types must end with full_attention (Gemma4TextConfig makes the last layer full)")
    if cfg["num_global_kv_heads"] is not None and not cfg["attention_k_eq_v"]:
        raise ConfigError(
            "num_global_kv_heads is read only with attention_k_eq_v (Gemma4TextConfig ignores it otherwise)"
        )
    return Gemma4TextConfig(
        **shared_to_hf(cfg),
        global_head_dim=cfg["global_head_dim"],
        num_global_key_value_heads=cfg["num_global_kv_heads"],
        vocab_size_per_layer_input=cfg["vocab_size_per_layer_input"],
        hidden_size_per_layer_input=cfg["hidden_size_per_layer_input"],
        hidden_activation=cfg["hidden_activation"],
        rms_norm_eps=cfg["rms_norm_eps"],
        sliding_window=cfg["sliding_window"],
        layer_types=list(cfg["layer_types"]),
        rope_parameters=rope_parameters(cfg),
        num_kv_shared_layers=cfg["num_kv_shared_layers"],
        use_double_wide_mlp=cfg["use_double_wide_mlp"],
        attention_k_eq_v=cfg["attention_k_eq_v"],
        final_logit_softcapping=cfg["final_logit_softcap"],
        attention_bias=cfg["attention_bias"],
        enable_moe_block=False,
    )


def _rope(hc, layer_type: str) -> dict:
    params = dict((hc.rope_parameters or {}).get(layer_type) or {"rope_type": "default"})
    rope_type = params.get("rope_type", "default")
    allowed = ("default", "proportional") if layer_type == FULL else ("default",)
    if rope_type not in allowed:
        raise ConfigError(
            f"rope_parameters.{layer_type}.rope_type {rope_type!r} is not supported ({', '.join(allowed)})"
        )
    if float(params.get("factor", 1.0)) == 1.0:
        params.pop("factor", None)
    if rope_type == "default" and float(params.get("partial_rotary_factor", 1.0)) == 1.0:
        params.pop("partial_rotary_factor", None)  # Gemma 4's default RoPE ignores it: only 1.0 means what it says
    extra = (
        set(params)
        - {"rope_type", "rope_theta"}
        - ({"partial_rotary_factor"} if rope_type == "proportional" else set())
    )
    if extra:
        raise ConfigError(f"rope_parameters.{layer_type} has unsupported fields: {', '.join(sorted(extra))}")
    return params


def _per_layer(hc, name: str, layer_type: str, default):
    """The one value ``name`` has on every layer of ``layer_type`` (``per_layer_config``), or ``default``."""
    values = {getattr(hc.per_layer_config[i], name) for i, t in enumerate(hc.layer_types) if t == layer_type}
    if len(values) > 1:
        raise ConfigError(f"per_layer_config gives {layer_type} layers different {name} values: {sorted(values)}")
    return values.pop() if values else default


def _refuse_what_we_cannot_honour(hc) -> None:
    if hc.enable_moe_block:
        raise ConfigError("enable_moe_block=True is not supported (the dense Gemma 4 text model only; no MoE block)")
    if hc.use_bidirectional_attention is not None:
        raise ConfigError(
            f"use_bidirectional_attention={hc.use_bidirectional_attention!r} is not supported (causal text model only)"
        )
    if hc.hidden_activation not in ACTIVATIONS:
        raise ConfigError(f"hidden_activation {hc.hidden_activation!r} is not supported ({', '.join(ACTIVATIONS)})")
    unknown_types = set(hc.layer_types) - {SLIDING, FULL}
    if unknown_types:
        raise ConfigError(f"layer_types has unsupported entries: {', '.join(sorted(unknown_types))}")
    per_layer = set(hc.per_layer_attributes or ()) - {"head_dim", "num_key_value_heads"}
    if per_layer:
        raise ConfigError(
            f"per_layer_config overrides {', '.join(sorted(per_layer))}: not supported (head_dim and KV heads of full layers only)"
        )
    shared = int(hc.num_kv_shared_layers or 0)
    if shared and not kv_sources(hc):
        raise ConfigError(
            f"num_kv_shared_layers={shared} leaves a shared layer type without an earlier layer of its type to "
            f"read keys and values from ({hc.num_hidden_layers} layers: {', '.join(hc.layer_types)})"
        )
    if shared and not hc.hidden_size_per_layer_input:
        raise ConfigError(
            f"num_kv_shared_layers={shared} with hidden_size_per_layer_input={hc.hidden_size_per_layer_input!r} is not "
            "supported: Gemma4TextModel (Transformers 5.24) slices the per-layer inputs, None here, before its first "
            "KV-shared layer and fails"
        )
    if hc.hidden_size_per_layer_input and hc.vocab_size_per_layer_input < hc.vocab_size:
        raise ConfigError(
            f"vocab_size_per_layer_input={hc.vocab_size_per_layer_input} is smaller than vocab_size={hc.vocab_size}: "
            "token ids past it have no per-layer embedding"
        )


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.Gemma4TextConfig`` -> our cfg (head_dim and KV heads per layer type from its
    ``per_layer_config``).

    Raises ConfigError naming any field we cannot honour: the MoE block (``enable_moe_block``, Gemma 4
    26B A4B), ``use_bidirectional_attention``, ``per_layer_config`` overrides other than full layers'
    head_dim and KV heads, an activation we do not implement, unknown layer types, a rope type other
    than default (sliding) or proportional/default (full), RoPE options we do not implement,
    ``num_kv_shared_layers`` that leaves a shared layer type without an earlier layer to read, KV
    sharing without per-layer inputs (the reference fails on it), a per-layer vocabulary smaller than
    the vocabulary.
    """
    _refuse_what_we_cannot_honour(hc)
    globals_ = hc.to_dict()  # global values (a heterogeneous config raises when they are read as attributes)
    head_dim = _per_layer(hc, "head_dim", SLIDING, globals_["head_dim"] or hc.hidden_size // hc.num_attention_heads)
    kv_heads = _per_layer(hc, "num_key_value_heads", SLIDING, globals_["num_key_value_heads"])
    full_kv = _per_layer(hc, "num_key_value_heads", FULL, kv_heads)
    if full_kv != kv_heads and not hc.attention_k_eq_v:
        raise ConfigError(
            f"per_layer_config gives full layers {full_kv} KV heads without attention_k_eq_v (ours: {kv_heads})"
        )
    sliding, full = _rope(hc, SLIDING), _rope(hc, FULL)
    return dict(
        vocab_size=hc.vocab_size,
        vocab_size_per_layer_input=hc.vocab_size_per_layer_input,
        context_length=hc.max_position_embeddings,
        emb_dim=hc.hidden_size,
        hidden_dim=hc.intermediate_size,
        n_layers=hc.num_hidden_layers,
        n_heads=hc.num_attention_heads,
        n_kv_heads=kv_heads,
        num_global_kv_heads=full_kv if hc.attention_k_eq_v and full_kv != kv_heads else None,
        head_dim=head_dim,
        global_head_dim=_per_layer(hc, "head_dim", FULL, head_dim),
        hidden_activation=hc.hidden_activation,
        rms_norm_eps=hc.rms_norm_eps,
        sliding_window=hc.sliding_window,
        layer_types=list(hc.layer_types),
        rope_local_base=float(sliding.get("rope_theta", 10_000.0)),
        rope_base=float(full.get("rope_theta", 1_000_000.0)),
        rope_global_type=full.get("rope_type", "default"),
        rope_global_partial_rotary_factor=float(full.get("partial_rotary_factor", 1.0)),
        hidden_size_per_layer_input=hc.hidden_size_per_layer_input or 0,
        num_kv_shared_layers=int(hc.num_kv_shared_layers or 0),
        use_double_wide_mlp=bool(hc.use_double_wide_mlp),
        attention_k_eq_v=bool(hc.attention_k_eq_v),
        final_logit_softcap=hc.final_logit_softcapping,
        attention_bias=bool(hc.attention_bias),
        tie_word_embeddings=bool(hc.tie_word_embeddings),
        dtype=dtype,
    )


def notes(cfg: dict) -> list[str]:
    """Which layers read which layers' keys (their ``k_rot`` nodes are those keys), and what this cfg cannot show."""
    from .model import kv_sources as sources_of

    notes = []
    sources = sources_of(cfg)
    if sources:
        pairs = ", ".join(f"{i} <- {j}" for i, j in sources.items())
        notes.append(
            f"KV sharing: layers read the keys and values of earlier layers ({pairs}); a shared layer's k_rot "
            "node is the keys it reads, and it has no k_proj, v_proj, k_norm or v_norm nodes"
        )
    elif cfg["use_double_wide_mlp"]:
        notes.append("use_double_wide_mlp widens only KV-shared layers, and this config has none: it is not exercised")
    types = set(cfg["layer_types"])
    if SLIDING not in types:
        notes.append("no sliding_attention layer: the window and the local RoPE are not exercised")
    return notes


FAMILY = Family(
    name="gemma4",
    model_type="gemma4_text",
    reference_class="Gemma4ForCausalLM",
    config_class="Gemma4TextConfig",
    model_class=Gemma4Model,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    # float32 gradients differ in the last bits: the reference rotates q/k before moving the heads axis
    # (the q_norm weight's gradient sums in another order) and sums a K = V projection's two uses otherwise
    exact_backward_dtypes=(torch.bfloat16,),
    fields=FIELDS,
    ci_configs=("tiny", "k-eq-v"),
    real_configs=("e2b-shape", "e4b-shape"),
    notes=notes,
    # the released multimodal checkpoints: their text model, checked under its own node names
    composite=Composite("gemma4", "Gemma4ForConditionalGeneration", "Gemma4Config"),
)
build_pair = pair_builder(FAMILY)
