"""Load a Transformers-format Gemma 4 (text) state dict into :class:`~reference_pairs.gemma4.model.Gemma4Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). Entries a
layer lacks on both sides are skipped: a KV-shared layer has no ``k_proj``/``v_proj``/``k_norm``, a
K = V layer no ``v_proj``, a model without per-layer inputs none of their tensors.
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, MLP, QK_NORM, SANDWICH_NORMS

PER_LAYER_INPUTS = {
    "model.embed_tokens_per_layer.weight": "embed_tokens_per_layer.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_projection.weight",
    "model.per_layer_projection_norm.weight": "per_layer_projection_norm.weight",
    **{
        f"model.layers.{{i}}.{name}.weight": f"blocks.{{i}}.{name}.weight"
        for name in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")
    },
}
WEIGHT_MAP = {
    **EMBED,
    **ATTENTION,
    **QK_NORM,
    **SANDWICH_NORMS,
    **MLP,
    **PER_LAYER_INPUTS,
    # a persistent buffer in Transformers (checkpoints carry it), a Parameter of ours
    "model.layers.{i}.layer_scalar": "blocks.{i}.layer_scalar",
    **FINAL,
}


load_weights_into_gemma4 = table_loader("gemma4", WEIGHT_MAP)
