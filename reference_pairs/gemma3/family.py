"""The Gemma 3 (text) family: our :class:`Gemma3Model` against ``transformers.Gemma3ForCausalLM``."""

from __future__ import annotations

import torch

from parity.model.family import Composite, Family, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_from_hf, shared_to_hf
from ..common.mlp import ACTIVATIONS
from ..common.nodes import ATTENTION, EMBED, FINAL, LAYER_OUTPUT, MLP, QK_NORM, SANDWICH_NORMS
from .configs import CONFIGS, FULL, SLIDING
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import Gemma3Model, rope_parameters

NODES = NodeMap(
    # the embedding node is after the sqrt(emb_dim) scale on both sides (the scale is the module's)
    before=EMBED,
    per_layer=[*SANDWICH_NORMS, *ATTENTION, *QK_NORM, *MLP, *LAYER_OUTPUT],
    # ``lm_head`` is the head before the soft-cap, ``logits`` the model's output after it (also without a
    # cap in the config: a port that caps anyway shows there)
    after=FINAL,
)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.Gemma3TextConfig`` (RoPE given per layer type, as Transformers 5 stores it)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **shared_to_hf(cfg),
        hidden_activation=cfg["hidden_activation"],
        rms_norm_eps=cfg["rms_norm_eps"],
        query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
        sliding_window=cfg["sliding_window"],
        layer_types=list(cfg["layer_types"]),
        rope_parameters=rope_parameters(cfg),
        final_logit_softcapping=cfg["final_logit_softcap"],
        attn_logit_softcapping=None,
        attention_bias=cfg["attention_bias"],
    )


_ROPE_KEYS = {SLIDING: {"default": set()}, FULL: {"default": set(), "linear": {"factor"}}}


def _rope(hc, layer_type: str) -> dict:
    params = dict((hc.rope_parameters or {}).get(layer_type) or {"rope_type": "default"})
    rope_type = params.get("rope_type", "default")
    allowed = _ROPE_KEYS[layer_type]
    if rope_type not in allowed:
        raise ConfigError(
            f"rope_parameters.{layer_type}.rope_type {rope_type!r} is not supported ({', '.join(allowed)})"
        )
    if float(params.get("partial_rotary_factor", 1.0)) == 1.0:
        params.pop("partial_rotary_factor", None)
    extra = set(params) - allowed[rope_type] - {"rope_type", "rope_theta"}
    if extra:
        raise ConfigError(f"rope_parameters.{layer_type} has unsupported fields: {', '.join(sorted(extra))}")
    return params


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.Gemma3TextConfig`` (after its own RoPE standardisation: a legacy ``rope_scaling``
    lands on full-attention layers, ``rope_local_base_freq`` on sliding ones) -> our cfg.

    Raises ConfigError naming any field we cannot honour: ``attn_logit_softcapping`` (stored but never
    applied by Transformers 5.24's ``Gemma3Attention``: the reference would not cap, and the config
    says it should), ``use_bidirectional_attention``, an activation we do not implement, unknown
    layer types, a rope type other than default (sliding) or default/linear (full), partial rotary.
    """
    if hc.attn_logit_softcapping is not None:
        raise ConfigError(
            f"attn_logit_softcapping={hc.attn_logit_softcapping!r} is not supported: Gemma3Attention (Transformers "
            f"5.24) stores it but never applies it, so the reference does not do what the config says"
        )
    if hc.use_bidirectional_attention:
        raise ConfigError("use_bidirectional_attention=True is not supported (causal text model only)")
    if hc.hidden_activation not in ACTIVATIONS:
        raise ConfigError(f"hidden_activation {hc.hidden_activation!r} is not supported ({', '.join(ACTIVATIONS)})")
    layer_types = list(hc.layer_types)
    unknown_types = set(layer_types) - {SLIDING, FULL}
    if unknown_types:
        raise ConfigError(f"layer_types has unsupported entries: {', '.join(sorted(unknown_types))}")
    sliding, full = _rope(hc, SLIDING), _rope(hc, FULL)
    return dict(
        **shared_from_hf(hc),
        hidden_activation=hc.hidden_activation,
        rms_norm_eps=hc.rms_norm_eps,
        query_pre_attn_scalar=hc.query_pre_attn_scalar,
        sliding_window=hc.sliding_window,
        layer_types=layer_types,
        rope_base=float(full.get("rope_theta", hc.default_theta["global"])),
        rope_local_base=float(sliding.get("rope_theta", hc.default_theta["local"])),
        rope_scaling_factor=float(full["factor"]) if full.get("rope_type") == "linear" else None,
        final_logit_softcap=hc.final_logit_softcapping,
        attention_bias=bool(hc.attention_bias),
        dtype=dtype,
    )


def notes(cfg: dict) -> list[str]:
    """What this cfg cannot show."""
    types = set(cfg["layer_types"])
    notes = []
    if SLIDING not in types:
        notes.append("no sliding_attention layer: the window and the local RoPE are not exercised")
    if FULL not in types:
        notes.append("no full_attention layer: the global RoPE (and its scaling) is not exercised")
    return notes


FAMILY = Family(
    name="gemma3",
    model_type="gemma3_text",
    reference_class="Gemma3ForCausalLM",
    config_class="Gemma3TextConfig",
    model_class=Gemma3Model,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny", "linear"),
    real_configs=("270m-shape", "1b-shape"),
    notes=notes,
    # the released multimodal checkpoints: their text model, checked under its own node names
    composite=Composite("gemma3", "Gemma3ForConditionalGeneration", "Gemma3Config"),
)
build_pair = pair_builder(FAMILY)
