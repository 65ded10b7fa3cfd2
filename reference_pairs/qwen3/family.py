"""The Qwen3 (dense) family: our :class:`Qwen3Model` against ``transformers.Qwen3ForCausalLM``."""

from __future__ import annotations

import torch

from parity.model.family import Family, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_from_hf, shared_to_hf
from ..common.layer_types import FULL, SLIDING
from ..common.nodes import ATTENTION, EMBED, FINAL, LAYER_OUTPUT, MLP, QK_NORM
from .configs import CONFIGS
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import Qwen3Model, rope_parameters

#: the pre-norm block's nodes (Llama's), with Qwen3's per-head Q/K norm
PRE_NORM_ATTENTION = [
    ("model.layers.{i}.input_layernorm", "blocks.{i}.norm1"),
    *ATTENTION,
    *QK_NORM,
    # the residual stream after attention: the input of the second pre-norm
    ("model.layers.{i}.post_attention_layernorm@input", "blocks.{i}.norm2@input"),
    ("model.layers.{i}.post_attention_layernorm", "blocks.{i}.norm2"),
]
NODES = NodeMap(before=EMBED, per_layer=[*PRE_NORM_ATTENTION, *MLP, *LAYER_OUTPUT], after=FINAL)


def attention_to_hf(cfg: dict) -> dict:
    """The Transformers config fields of the attention, norms and RoPE every Qwen3 shares: RoPE as
    one ``rope_parameters`` dict; a window as ``use_sliding_window`` with the layer types spelled
    out (``max_window_layers``: the first sliding layer, as Transformers would derive them)."""
    window, types = cfg["sliding_window"], list(cfg["layer_types"])
    return dict(
        **shared_to_hf(cfg),
        rms_norm_eps=cfg["rms_norm_eps"],
        hidden_act="silu",
        attention_bias=cfg["attention_bias"],
        rope_parameters=rope_parameters(cfg)[FULL],
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=types.index(SLIDING) if SLIDING in types else len(types),
    )


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.Qwen3Config``."""
    from transformers import Qwen3Config

    return Qwen3Config(**attention_to_hf(cfg), layer_types=list(cfg["layer_types"]))


#: Transformers' YaRN keys -> the book's ``rope_yarn`` keys
_YARN_KEYS = {
    "factor": "factor",
    "original_max_position_embeddings": "original_context_length",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
}
_ROPE_KEYS = {"default": {"rope_type", "rope_theta", "type"}, "yarn": {"rope_type", "rope_theta", "type", *_YARN_KEYS}}


def rope_from_hf(hc) -> tuple[float, dict | None]:
    """``(rope_base, rope_yarn)`` from a Qwen3 config's ``rope_parameters`` (after Transformers'
    standardisation, so a legacy ``rope_scaling`` arrives here). Missing YaRN values take
    Transformers' defaults (``factor`` = max / original positions, ``beta_fast`` 32 and ``beta_slow``
    1, also for a 0). Raises ConfigError naming a rope type or field we do not implement (linear,
    dynamic, longrope, llama3; ``partial_rotary_factor`` below 1, which Qwen3's own default RoPE
    would ignore; YaRN ``mscale``, ``truncate`` false)."""
    rope = dict(hc.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _ROPE_KEYS:
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (default, yarn)")
    if float(rope.get("partial_rotary_factor", 1.0)) == 1.0:
        rope.pop("partial_rotary_factor", None)
    if rope.get("truncate", True) is True:
        rope.pop("truncate", None)
    extra = set(rope) - _ROPE_KEYS[rope_type]
    if extra:
        raise ConfigError(
            f"rope_parameters has unsupported fields for rope_type {rope_type!r}: {', '.join(sorted(extra))}"
        )
    base = float(rope.get("rope_theta", hc.default_theta))
    if rope_type == "default":
        return base, None
    yarn = {ours: rope.get(key) for key, ours in _YARN_KEYS.items()}
    if yarn["original_context_length"] is None:
        raise ConfigError("rope_parameters (yarn) lacks original_max_position_embeddings")
    yarn["original_context_length"] = int(yarn["original_context_length"])
    if yarn["factor"] is None:  # Transformers derives it from the two context lengths
        yarn["factor"] = hc.max_position_embeddings / yarn["original_context_length"]
    yarn["factor"] = float(yarn["factor"])
    yarn["beta_fast"] = float(yarn["beta_fast"] or 32.0)  # Transformers: `or 32`, so 0 means the default too
    yarn["beta_slow"] = float(yarn["beta_slow"] or 1.0)
    return base, yarn


def attention_from_hf(hc, dtype: torch.dtype) -> dict:
    """Our cfg keys for what :func:`attention_to_hf` writes. Raises ConfigError naming a field we
    cannot honour (an activation other than SiLU, a layer type other than full or sliding, RoPE as
    :func:`rope_from_hf` says)."""
    if hc.hidden_act != "silu":
        raise ConfigError(f"hidden_act {hc.hidden_act!r} is not supported (Qwen3 uses 'silu')")
    rope_base, rope_yarn = rope_from_hf(hc)
    return dict(
        **shared_from_hf(hc),
        rms_norm_eps=hc.rms_norm_eps,
        attention_bias=bool(hc.attention_bias),
        rope_base=rope_base,
        rope_yarn=rope_yarn,
        sliding_window=hc.sliding_window,
        dtype=dtype,
    )


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.Qwen3Config`` -> our cfg. ``use_sliding_window`` and ``max_window_layers`` are
    read as Transformers resolves them: its ``sliding_window`` (None unless ``use_sliding_window``)
    and its ``layer_types`` (``sliding_attention`` from layer ``max_window_layers`` on)."""
    layer_types = list(hc.layer_types)
    unknown = set(layer_types) - {FULL, SLIDING}
    if unknown:
        raise ConfigError(f"layer_types has unsupported entries: {', '.join(sorted(unknown))}")
    return dict(**attention_from_hf(hc, dtype), layer_types=layer_types)


FAMILY = Family(
    name="qwen3",
    model_type="qwen3",
    reference_class="Qwen3ForCausalLM",
    config_class="Qwen3Config",
    model_class=Qwen3Model,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny", "yarn"),
    real_configs=("0.6b-shape", "8b-shape"),
)
build_pair = pair_builder(FAMILY)
