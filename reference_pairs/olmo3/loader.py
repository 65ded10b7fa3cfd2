"""Load a Transformers-format OLMo 3 state dict into :class:`~reference_pairs.olmo3.model.Olmo3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer).
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, MLP, QK_NORM

WEIGHT_MAP = {
    **EMBED,
    **ATTENTION,
    **QK_NORM,
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.post_attention_layernorm.weight",
    **MLP,
    "model.layers.{i}.post_feedforward_layernorm.weight": "blocks.{i}.post_feedforward_layernorm.weight",
    **FINAL,
}


load_weights_into_olmo3 = table_loader("olmo3", WEIGHT_MAP)
