"""Load a Transformers-format Llama 3 state dict into :class:`~reference_pairs.llama3.model.Llama3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). The
keys are those of ``LlamaForCausalLM`` and of Meta's Hugging Face checkpoints (the book, ch. 11.6).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parity.weights import apply_weight_table

from ..common.weights import ATTENTION, EMBED, FINAL, MLP
from .model import Llama3Model

WEIGHT_MAP = {
    **EMBED,
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    **ATTENTION,
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.norm2.weight",
    **MLP,
    **FINAL,
}


def load_weights_into_llama3(model: Llama3Model, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying; with a tied head,
    ``model.out_head.weight`` stays the same Parameter as ``model.tok_emb.weight``.

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key and every parameter of ours left
            unwritten.
    """
    return apply_weight_table(model, state_dict, WEIGHT_MAP)
