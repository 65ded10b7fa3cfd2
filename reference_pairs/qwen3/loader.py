"""Load a Transformers-format Qwen3 state dict into :class:`~reference_pairs.qwen3.model.Qwen3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer); the
book's names on the right (``norm1``/``norm2`` for ``input_layernorm``/``post_attention_layernorm``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parity.weights import apply_weight_table

from ..common.weights import ATTENTION, EMBED, FINAL, MLP, QK_NORM
from .model import Qwen3Model

NORMS = {
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.norm2.weight",
}
WEIGHT_MAP = {**EMBED, **ATTENTION, **QK_NORM, **NORMS, **MLP, **FINAL}


def load_weights_into_qwen3(model: Qwen3Model, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying (a tied head stays tied).

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key and every parameter of ours left
            unwritten.
    """
    return apply_weight_table(model, state_dict, WEIGHT_MAP)
