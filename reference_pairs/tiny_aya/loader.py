"""Load a Transformers-format Tiny Aya (Cohere 2) state dict into :class:`~reference_pairs.tiny_aya.model.TinyAyaModel`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). A
Cohere 2 layer has a single norm (``input_layernorm``) feeding both branches, and no bias on it.
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, MLP

WEIGHT_MAP = {
    **EMBED,
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.input_layernorm.weight",
    **ATTENTION,
    **MLP,
    **FINAL,
}


load_weights_into_tiny_aya = table_loader("tiny_aya", WEIGHT_MAP)
