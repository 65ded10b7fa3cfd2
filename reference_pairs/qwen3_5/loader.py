"""Load a Transformers-format Qwen3.5 state dict into :class:`~reference_pairs.qwen3_5.model.Qwen3_5Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). Entries
of the other layer type (``self_attn`` on a linear layer, ``linear_attn`` on a full one) exist on
neither side and are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parity.weights import apply_weight_table

from ..common.weights import ATTENTION, EMBED, FINAL, GATED_DELTANET, MLP, QK_NORM
from .model import Qwen3_5Model

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


def load_weights_into_qwen3_5(model: Qwen3_5Model, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying (a tied head stays tied).

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key and every parameter of ours left
            unwritten.
    """
    return apply_weight_table(model, state_dict, WEIGHT_MAP)
