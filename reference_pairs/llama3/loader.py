"""Load a Transformers-format Llama 3 state dict into :class:`~reference_pairs.llama3.model.Llama3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). The
keys are those of ``LlamaForCausalLM`` and of Meta's Hugging Face checkpoints (the book, ch. 11.6).
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, MLP

WEIGHT_MAP = {
    **EMBED,
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    **ATTENTION,
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.norm2.weight",
    **MLP,
    **FINAL,
}


load_weights_into_llama3 = table_loader("llama3", WEIGHT_MAP)
