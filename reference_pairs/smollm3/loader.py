"""Load a Transformers-format SmolLM3 state dict into :class:`~reference_pairs.smollm3.model.SmolLM3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer); the
book's names on the right (``norm1``/``norm2`` for ``input_layernorm``/``post_attention_layernorm``).
The keys are ``SmolLM3ForCausalLM``'s (Llama's); biases only where ``attention_bias``/``mlp_bias``
put them, and the released (tied) files may omit ``lm_head.weight``. A NoPE layer has the same
weights as any other: nothing in the checkpoint says which layers skip RoPE (the config does).
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, MLP

NORMS = {
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.norm2.weight",
}
#: ``mlp_bias``: the three projections' biases (the shared MLP table has weights only)
MLP_BIAS = {key.replace(".weight", ".bias"): ours.replace(".weight", ".bias") for key, ours in MLP.items()}
WEIGHT_MAP = {**EMBED, **NORMS, **ATTENTION, **MLP, **MLP_BIAS, **FINAL}


load_weights_into_smollm3 = table_loader("smollm3", WEIGHT_MAP)
