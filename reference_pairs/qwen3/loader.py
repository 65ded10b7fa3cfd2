"""Load a Transformers-format Qwen3 state dict into :class:`~reference_pairs.qwen3.model.Qwen3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer); the
book's names on the right (``norm1``/``norm2`` for ``input_layernorm``/``post_attention_layernorm``).
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, MLP, QK_NORM

NORMS = {
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.norm2.weight",
}
WEIGHT_MAP = {**EMBED, **ATTENTION, **QK_NORM, **NORMS, **MLP, **FINAL}


load_weights_into_qwen3 = table_loader("qwen3", WEIGHT_MAP)
