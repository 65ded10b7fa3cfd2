"""Load a Transformers-format Qwen3-MoE state dict into :class:`~reference_pairs.qwen3_moe.model.Qwen3MoeModel`.

The map is data: Qwen3's table, the router, and Transformers 5's fused 3-D experts split into one
SwiGLU per expert (``experts.gate_up_proj`` ``(E, 2I, H)``: gate rows first, then up; ``down_proj``
``(E, H, I)``), as views, so every element of the fused tensors lands in exactly one parameter.
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import MOE
from ..qwen3.loader import WEIGHT_MAP as QWEN3_WEIGHT_MAP

#: dense layers keep Qwen3's MLP entries; sparse layers have the router and experts instead
WEIGHT_MAP = {**QWEN3_WEIGHT_MAP, **MOE}


load_weights_into_qwen3_moe = table_loader("qwen3_moe", WEIGHT_MAP)
