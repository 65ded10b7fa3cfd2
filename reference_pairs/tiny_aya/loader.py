"""Load a Transformers-format Tiny Aya (Cohere 2) state dict into :class:`~reference_pairs.tiny_aya.model.TinyAyaModel`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). A
Cohere 2 layer has a single norm (``input_layernorm``) feeding both branches, and no bias on it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parity.weights import apply_weight_table

from ..common.weights import ATTENTION, EMBED, FINAL, MLP
from .model import TinyAyaModel

WEIGHT_MAP = {
    **EMBED,
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.input_layernorm.weight",
    **ATTENTION,
    **MLP,
    **FINAL,
}


def load_weights_into_tiny_aya(model: TinyAyaModel, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying; a tied head stays the very
    Parameter ``tok_emb.weight``.

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key and every parameter of ours left
            unwritten.
    """
    return apply_weight_table(model, state_dict, WEIGHT_MAP)
