"""The Llama 3 family (3.1 and 3.2): our :class:`Llama3Model` against ``transformers.LlamaForCausalLM``.

Its node map, weight table and config mapping serve the ``llama2`` and ``mistral`` families too."""

from __future__ import annotations

import torch

from parity.model.family import Family, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_from_hf, shared_to_hf
from ..common.nodes import ATTENTION, EMBED, FINAL, LAYER_OUTPUT, MLP
from .configs import CONFIGS, FULL
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import Llama3Model

NODES = NodeMap(
    before=EMBED,
    per_layer=[
        ("model.layers.{i}.input_layernorm", "blocks.{i}.norm1"),
        *ATTENTION,
        # the residual stream after attention: the input of the second pre-norm
        ("model.layers.{i}.post_attention_layernorm@input", "blocks.{i}.norm2@input"),
        ("model.layers.{i}.post_attention_layernorm", "blocks.{i}.norm2"),
        *MLP,
        *LAYER_OUTPUT,
    ],
    after=FINAL,
)


def _rope_dict(cfg: dict) -> dict:
    freq = cfg["rope_freq"]
    if freq is None:
        return {"rope_type": "default", "rope_theta": cfg["rope_base"]}
    return {
        "rope_type": "llama3",
        "rope_theta": cfg["rope_base"],
        "factor": float(freq["factor"]),
        "low_freq_factor": float(freq["low_freq_factor"]),
        "high_freq_factor": float(freq["high_freq_factor"]),
        "original_max_position_embeddings": int(freq["original_context_length"]),
    }


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.LlamaConfig`` (RoPE in Transformers 5's ``rope_parameters``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **shared_to_hf(cfg),
        rms_norm_eps=cfg["rms_norm_eps"],
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        rope_parameters=_rope_dict(cfg),
    )


#: Transformers' llama3 rope keys -> the book's ``rope_freq`` keys.
_FREQ_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_context_length",
}
_ROPE_KEYS = {
    "default": {"rope_type", "rope_theta", "type"},
    "llama3": {"rope_type", "rope_theta", "type", *_FREQ_KEYS},
}


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.LlamaConfig`` (after its own RoPE standardisation, so a legacy
    ``rope_scaling`` + ``rope_theta`` config.json arrives as ``rope_parameters``) -> our cfg.

    Raises ConfigError naming any field we cannot honour: a rope type other than ``default`` or
    ``llama3`` (linear, dynamic, yarn, longrope, ...), RoPE fields we do not implement
    (``partial_rotary_factor`` below 1, per-layer-type RoPE, ...), ``attention_bias`` or
    ``mlp_bias``, an activation other than SiLU.
    """
    if hc.hidden_act != "silu":
        raise ConfigError(f"hidden_act {hc.hidden_act!r} is not supported (Llama uses 'silu')")
    if getattr(hc, "attention_bias", False):  # a LlamaConfig field; MistralConfig has none
        raise ConfigError("attention_bias true is not supported (Llama has no attention biases)")
    if getattr(hc, "mlp_bias", False):
        raise ConfigError("mlp_bias true is not supported (Llama has no MLP biases)")
    rope = dict(hc.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _ROPE_KEYS:
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (default, llama3)")
    if float(rope.get("partial_rotary_factor", 1.0)) == 1.0:
        rope.pop("partial_rotary_factor", None)
    extra = set(rope) - _ROPE_KEYS[rope_type]
    if extra:
        raise ConfigError(
            f"rope_parameters has unsupported fields for rope_type {rope_type!r}: {', '.join(sorted(extra))}"
        )
    rope_freq = None
    if rope_type == "llama3":
        missing = [key for key in _FREQ_KEYS if rope.get(key) is None]
        if missing:
            raise ConfigError(f"rope_parameters (llama3) lacks {', '.join(missing)}")
        rope_freq = {ours: rope[key] for key, ours in _FREQ_KEYS.items()}
        rope_freq = {k: int(v) if k == "original_context_length" else float(v) for k, v in rope_freq.items()}
    return dict(
        **shared_from_hf(hc),
        rope_base=float(rope.get("rope_theta", hc.default_theta)),
        rope_freq=rope_freq,
        rms_norm_eps=hc.rms_norm_eps,
        layer_types=[FULL] * hc.num_hidden_layers,
        dtype=dtype,
    )


FAMILY = Family(
    name="llama3",
    model_type="llama",
    reference_class="LlamaForCausalLM",
    config_class="LlamaConfig",
    model_class=Llama3Model,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny", "tiny-untied"),
    real_configs=("1b-shape", "3b-shape", "8b-shape"),
)
build_pair = pair_builder(FAMILY)
