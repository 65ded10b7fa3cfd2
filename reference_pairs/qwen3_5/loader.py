"""Load a Transformers-format Qwen3.5 state dict into :class:`~reference_pairs.qwen3_5.model.Qwen3_5Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). Entries
of the other layer type (``self_attn`` on a linear layer, ``linear_attn`` on a full one) exist on
neither side and are skipped.
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, GATED_DELTANET, MLP, QK_NORM

WEIGHT_MAP = {
    **EMBED,
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    **GATED_DELTANET,
    **ATTENTION,
    **QK_NORM,
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.norm2.weight",
    **MLP,
    **FINAL,
}


load_weights_into_qwen3_5 = table_loader("qwen3_5", WEIGHT_MAP)
