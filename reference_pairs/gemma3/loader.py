"""Load a Transformers-format Gemma 3 (text) state dict into :class:`~reference_pairs.gemma3.model.Gemma3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parity.weights import apply_weight_table

from ..common.weights import ATTENTION, EMBED, FINAL, MLP, QK_NORM, SANDWICH_NORMS
from .model import Gemma3Model

WEIGHT_MAP = {**EMBED, **ATTENTION, **QK_NORM, **SANDWICH_NORMS, **MLP, **FINAL}


def load_weights_into_gemma3(model: Gemma3Model, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying (the tied head stays tied).

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key and every parameter of ours left
            unwritten.
    """
    return apply_weight_table(model, state_dict, WEIGHT_MAP)
