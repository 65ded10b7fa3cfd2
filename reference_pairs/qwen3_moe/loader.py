"""Load a Transformers-format Qwen3-MoE state dict into :class:`~reference_pairs.qwen3_moe.model.Qwen3MoeModel`.

The map is data: Qwen3's table, the router, and Transformers 5's fused 3-D experts split into one
SwiGLU per expert (``experts.gate_up_proj`` ``(E, 2I, H)``: gate rows first, then up; ``down_proj``
``(E, H, I)``), as views, so every element of the fused tensors lands in exactly one parameter.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parity.weights import apply_weight_table

from ..common.weights import MOE
from ..qwen3.loader import WEIGHT_MAP as QWEN3_WEIGHT_MAP
from .model import Qwen3MoeModel

#: dense layers keep Qwen3's MLP entries; sparse layers have the router and experts instead
WEIGHT_MAP = {**QWEN3_WEIGHT_MAP, **MOE}


def load_weights_into_qwen3_moe(model: Qwen3MoeModel, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying (expert weights as views).

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key (a fused tensor that does not
            split into the experts ours has, naming the expert) and every parameter of ours left
            unwritten.
    """
    return apply_weight_table(model, state_dict, WEIGHT_MAP)
