"""Load a Transformers-format Llama 3 state dict into :class:`~reference_pairs.llama3.model.Llama3Model`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). The
keys are those of ``LlamaForCausalLM`` and of Meta's Hugging Face checkpoints (the book, ch. 11.6).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..common.weights import load_by_table
from .model import Llama3Model

WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_emb.weight",
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blocks.{i}.att.W_query.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blocks.{i}.att.W_key.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blocks.{i}.att.W_value.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blocks.{i}.att.out_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.norm2.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blocks.{i}.ff.fc1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blocks.{i}.ff.fc2.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blocks.{i}.ff.fc3.weight",
    "model.norm.weight": "final_norm.weight",
}


def load_weights_into_llama3(model: Llama3Model, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying; with a tied head,
    ``model.out_head.weight`` ends as the same Parameter as ``model.tok_emb.weight``.

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key and every parameter of ours left
            unwritten.
    """
    return load_by_table(model, cfg, state_dict, WEIGHT_MAP)
