"""Load a Transformers-format Gemma 3 (text) state dict into :class:`~reference_pairs.gemma3.model.Gemma3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer).
"""

from __future__ import annotations

from ..common.builders import table_loader
from ..common.weights import ATTENTION, EMBED, FINAL, MLP, QK_NORM, SANDWICH_NORMS

WEIGHT_MAP = {**EMBED, **ATTENTION, **QK_NORM, **SANDWICH_NORMS, **MLP, **FINAL}


load_weights_into_gemma3 = table_loader("gemma3", WEIGHT_MAP)
