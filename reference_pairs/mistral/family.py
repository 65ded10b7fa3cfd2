"""The Mistral family: the llama3 family's model, weight table and node map against
``transformers.MistralForCausalLM``; the config mapping adds ``sliding_window``."""

from __future__ import annotations

import dataclasses

import torch

from ..common.builders import pair_builder
from ..common.config import shared_to_hf
from ..common.layer_types import FULL, SLIDING
from ..llama3.family import FAMILY as LLAMA3
from ..llama3.family import from_hf as llama_from_hf
from ..llama3.model import rope_parameters
from .configs import CONFIGS
from .faults import FAULTS
from .fields import FIELDS


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.MistralConfig`` (``layer_types`` is not a Mistral field: it follows
    from ``sliding_window``)."""
    from transformers import MistralConfig

    return MistralConfig(
        **shared_to_hf(cfg),
        rms_norm_eps=cfg["rms_norm_eps"],
        hidden_act="silu",
        sliding_window=cfg["sliding_window"],
        rope_parameters=rope_parameters(cfg)[FULL],
    )


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.MistralConfig`` -> our cfg: Llama's mapping (and its refusals: a rope type
    other than default or llama3, an activation other than SiLU), plus the window on every layer."""
    cfg = llama_from_hf(hc, dtype)
    window = hc.sliding_window  # None: full attention (a window below 1 is refused with the facts)
    cfg.update(sliding_window=window, layer_types=[FULL if window is None else SLIDING] * hc.num_hidden_layers)
    return cfg


FAMILY = dataclasses.replace(
    LLAMA3,
    name="mistral",
    model_type="mistral",
    reference_class="MistralForCausalLM",
    config_class="MistralConfig",
    configs=CONFIGS,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    fields=FIELDS,
    ci_configs=("tiny",),
    real_configs=("7b-shape",),
)
build_pair = pair_builder(FAMILY)
