"""The Tiny Aya family: our :class:`TinyAyaModel` against ``transformers.Cohere2ForCausalLM``."""

from __future__ import annotations

import torch

from parity.model.family import Family, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_from_hf, shared_to_hf
from ..common.nodes import ATTENTION, EMBED, FINAL, LAYER_OUTPUT, MLP
from .configs import CONFIGS, FULL, SLIDING
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import TinyAyaModel

NODES = NodeMap(
    before=EMBED,
    per_layer=[
        ("model.layers.{i}.input_layernorm", "blocks.{i}.input_layernorm"),
        *ATTENTION,  # q_rot/k_rot are the unrotated q/k on full (NoPE) layers
        # The shared normalized input of the parallel block: equal to input_layernorm's output.
        ("model.layers.{i}.mlp@input", "blocks.{i}.ff@input"),
        *MLP,
        *LAYER_OUTPUT,
    ],
    # ``lm_head`` is the head before scaling; ``logits`` is the whole models' output, after
    # ``* logit_scale`` (applied outside any module on both sides).
    after=FINAL,
)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.Cohere2Config``. Raises ConfigError for a rope type other than default."""
    from transformers import Cohere2Config

    if cfg["rope_type"] != "default":
        raise ConfigError(f"rope_type {cfg['rope_type']!r} is not supported (Tiny Aya uses 'default')")
    return Cohere2Config(
        **shared_to_hf(cfg),
        logit_scale=cfg["logit_scale"],
        hidden_act="silu",
        layer_norm_eps=cfg["layer_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_base"]},
        attention_bias=cfg["attention_bias"],
        sliding_window=cfg["sliding_window"],
        layer_types=list(cfg["layer_types"]),
    )


#: Fields of the original Cohere configs that ``Cohere2ForCausalLM`` ignores: it always builds a
#: parallel block without Q/K norm and rotates the whole head. A config asking for anything else
#: describes a model that neither side implements, so it is refused rather than silently compared.
_COHERE_FIXED = {"use_qk_norm": False, "use_parallel_block": True, "rotary_pct": 1.0, "partial_rotary_factor": 1.0}
_KNOWN_ROPE_KEYS = {"rope_type", "rope_theta"}


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.Cohere2Config`` (after its own RoPE standardisation) -> our cfg.

    Raises ConfigError naming any field we cannot honour: a rope type other than ``default`` (or
    any RoPE option besides ``rope_theta``), a non-SiLU activation, unknown layer types, sliding
    layers without a window, and the original Cohere switches ``Cohere2ForCausalLM`` ignores
    (Q/K norm, sequential blocks, partial rotary).
    """
    if hc.hidden_act != "silu":
        raise ConfigError(f"hidden_act {hc.hidden_act!r} is not supported (Tiny Aya uses 'silu')")
    for key, value in _COHERE_FIXED.items():
        if getattr(hc, key, None) not in (None, value):
            raise ConfigError(
                f"{key}={getattr(hc, key)!r} is not supported (Cohere2ForCausalLM implements only {value!r})"
            )
    layer_types = list(hc.layer_types)
    unknown_types = set(layer_types) - {SLIDING, FULL}
    if unknown_types:
        raise ConfigError(f"layer_types has unsupported entries: {', '.join(sorted(unknown_types))}")
    rope = dict(hc.rope_parameters or {})
    if set(rope) & {SLIDING, FULL}:
        raise ConfigError("rope_parameters per layer type is not supported (Cohere2 has one RoPE for sliding layers)")
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (default)")
    extra = set(rope) - _KNOWN_ROPE_KEYS
    if extra:
        raise ConfigError(f"rope_parameters has unsupported fields: {', '.join(sorted(extra))}")
    return dict(
        **shared_from_hf(hc),
        layer_norm_eps=hc.layer_norm_eps,
        sliding_window=hc.sliding_window,
        layer_types=layer_types,
        attention_bias=bool(hc.attention_bias),
        rope_type="default",
        rope_base=float(rope.get("rope_theta", hc.default_theta)),
        logit_scale=float(hc.logit_scale),
        dtype=dtype,
    )


def notes(cfg: dict) -> list[str]:
    """Notes for the user about what this cfg cannot show."""
    notes = []
    if cfg["logit_scale"] == 1.0:
        notes.append("logit_scale is 1.0: a missing logit scale cannot show at this config (the tiny config checks it)")
    types = set(cfg["layer_types"])
    if SLIDING not in types:
        notes.append("no sliding_attention layer: RoPE and the window are not exercised")
    if FULL not in types:
        notes.append("no full_attention layer: the no-RoPE layers are not exercised")
    return notes


FAMILY = Family(
    name="tiny_aya",
    model_type="cohere2",
    reference_class="Cohere2ForCausalLM",
    config_class="Cohere2Config",
    model_class=TinyAyaModel,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny",),
    real_configs=("3b-shape",),
    notes=notes,
)
build_pair = pair_builder(FAMILY)
