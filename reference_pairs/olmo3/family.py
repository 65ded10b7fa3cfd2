"""The OLMo 3 family: our :class:`Olmo3Model` against ``transformers.Olmo3ForCausalLM``."""

from __future__ import annotations

import torch

from parity.model.family import Family, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_from_hf, shared_to_hf
from ..common.nodes import ATTENTION, EMBED, FINAL, LAYER_OUTPUT, MLP, QK_NORM
from ..common.rope import default_or_yarn
from .configs import CONFIGS, FULL, SLIDING
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import Olmo3Model

NODES = NodeMap(
    before=EMBED,
    per_layer=[
        *ATTENTION,
        *QK_NORM,
        ("model.layers.{i}.post_attention_layernorm", "blocks.{i}.post_attention_layernorm"),
        # post-norm: the residual stream after attention is the MLP's input
        ("model.layers.{i}.mlp@input", "blocks.{i}.ff@input"),
        *MLP,
        ("model.layers.{i}.post_feedforward_layernorm", "blocks.{i}.post_feedforward_layernorm"),
        *LAYER_OUTPUT,
    ],
    after=FINAL,
)


def _rope_dict(cfg: dict, layer_type: str) -> dict:
    base = cfg["rope_local_base"] if layer_type == SLIDING else cfg["rope_base"]
    if cfg["rope_type"] != "yarn" or layer_type not in cfg["rope_scaled_layer_types"]:
        return default_or_yarn(base, None)
    yarn = {
        "factor": cfg["rope_factor"],
        "original_context_length": cfg["rope_orig_max"],
        "beta_fast": cfg["beta_fast"],
        "beta_slow": cfg["beta_slow"],
        "attention_factor": cfg["rope_attention_factor"],
    }
    return default_or_yarn(base, yarn)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.Olmo3Config`` (RoPE given per layer type, as Transformers 5 stores it)."""
    from transformers import Olmo3Config

    return Olmo3Config(
        **shared_to_hf(cfg),
        rms_norm_eps=cfg["rms_norm_eps"],
        sliding_window=cfg["sliding_window"],
        layer_types=list(cfg["layer_types"]),
        attention_bias=cfg["attention_bias"],
        rope_parameters={t: _rope_dict(cfg, t) for t in (SLIDING, FULL)},
    )


_YARN_KEYS = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "rope_orig_max",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "rope_attention_factor",
}
_KNOWN_ROPE_KEYS = {"rope_type", "rope_theta", "truncate", *_YARN_KEYS}


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.Olmo3Config`` (after its own RoPE standardisation) -> our cfg.

    Which layer types get YaRN is read from ``hc.rope_parameters`` exactly as Transformers filled
    it (a legacy ``rope_scaling`` lands on ``full_attention`` only). Missing YaRN values take
    Transformers' defaults (``factor`` = max / original positions, ``beta_fast`` 32, ``beta_slow``
    1, also for a 0). Raises ConfigError naming any field we cannot honour: an unknown rope type,
    YaRN options we do not implement (mscale, ``truncate`` false, partial rotary), different YaRN
    parameters per layer type, a non-SiLU activation.
    """
    if hc.hidden_act != "silu":
        raise ConfigError(f"hidden_act {hc.hidden_act!r} is not supported (OLMo 3 uses 'silu')")
    layer_types = list(hc.layer_types)
    unknown_types = set(layer_types) - {SLIDING, FULL}
    if unknown_types:
        raise ConfigError(f"layer_types has unsupported entries: {', '.join(sorted(unknown_types))}")
    rope = hc.rope_parameters or {}
    yarn_params, scaled, theta = None, [], {}
    for layer_type in (SLIDING, FULL):
        params = rope.get(layer_type) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"rope_parameters.{layer_type}.rope_type {rope_type!r} is not supported (default, yarn)")
        extra = set(params) - _KNOWN_ROPE_KEYS
        if extra:
            raise ConfigError(f"rope_parameters.{layer_type} has unsupported fields: {', '.join(sorted(extra))}")
        if params.get("truncate", True) is not True:
            raise ConfigError(f"rope_parameters.{layer_type}.truncate {params['truncate']!r} is not supported (true)")
        theta[layer_type] = float(params.get("rope_theta", hc.default_theta))
        if rope_type == "yarn":
            these = {ours: params.get(key) for key, ours in _YARN_KEYS.items()}
            if these["rope_orig_max"] is None:
                raise ConfigError(f"rope_parameters.{layer_type} (yarn) lacks original_max_position_embeddings")
            if these["rope_factor"] is None:  # Transformers derives it from the two context lengths
                these["rope_factor"] = hc.max_position_embeddings / these["rope_orig_max"]
            these["beta_fast"] = these["beta_fast"] or 32.0  # Transformers: `or 32`, so 0 means the default too
            these["beta_slow"] = these["beta_slow"] or 1.0
            if yarn_params is not None and these != yarn_params:
                raise ConfigError(
                    f"rope_parameters: YaRN parameters differ between layer types: {yarn_params} vs {these}"
                )
            yarn_params = these
            scaled.append(layer_type)
    cfg = dict(
        **shared_from_hf(hc),
        rms_norm_eps=hc.rms_norm_eps,
        sliding_window=hc.sliding_window,
        layer_types=layer_types,
        attention_bias=bool(hc.attention_bias),
        rope_type="yarn" if yarn_params else "default",
        rope_base=theta[FULL],
        rope_local_base=theta[SLIDING],
        rope_scaled_layer_types=scaled or [FULL],
        rope_factor=1.0,
        rope_orig_max=None,
        beta_fast=32.0,
        beta_slow=1.0,
        rope_attention_factor=None,
        dtype=dtype,
    )
    cfg.update(yarn_params or {})
    return cfg


def notes(cfg: dict) -> list[str]:
    """Notes for configs that leave a branch unexercised (YaRN configured but no layer uses it)."""
    if cfg["rope_type"] == "yarn" and not set(cfg["rope_scaled_layer_types"]) & set(cfg["layer_types"]):
        return [
            f"YaRN is configured for {', '.join(cfg['rope_scaled_layer_types'])} layers but no layer has that type: "
            "YaRN is not exercised (use more layers)"
        ]
    return []


FAMILY = Family(
    name="olmo3",
    model_type="olmo3",
    reference_class="Olmo3ForCausalLM",
    config_class="Olmo3Config",
    model_class=Olmo3Model,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny", "yarn", "mha"),
    real_configs=("7b-shape", "32b-shape"),
    notes=notes,
)
build_pair = pair_builder(FAMILY)
