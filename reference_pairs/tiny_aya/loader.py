"""Load a Transformers-format Tiny Aya (Cohere 2) state dict into :class:`~reference_pairs.tiny_aya.model.TinyAyaModel`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). A
Cohere 2 layer has a single norm (``input_layernorm``) feeding both branches, and no bias on it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..common.weights import apply_weight_map, expand_weight_map
from .model import TinyAyaModel

WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_emb.weight",
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.input_layernorm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blocks.{i}.att.W_query.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blocks.{i}.att.W_key.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blocks.{i}.att.W_value.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blocks.{i}.att.out_proj.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blocks.{i}.ff.fc1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blocks.{i}.ff.fc2.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blocks.{i}.ff.fc3.weight",
    "model.norm.weight": "final_norm.weight",
}
BIAS_MAP = {
    f"model.layers.{{i}}.self_attn.{hf}.bias": f"blocks.{{i}}.att.{ours}.bias"
    for hf, ours in [("q_proj", "W_query"), ("k_proj", "W_key"), ("v_proj", "W_value"), ("o_proj", "out_proj")]
}
HEAD_MAP = {"lm_head.weight": "out_head.weight"}
TIED = {"lm_head.weight": ("out_head.weight", "tok_emb.weight")}


def weight_map_for(cfg: dict) -> dict[str, str]:
    """The expanded checkpoint-key -> parameter-path map for this cfg (bias and head as configured)."""
    template = dict(WEIGHT_MAP)
    if cfg["attention_bias"]:
        template.update(BIAS_MAP)
    if not cfg["tie_word_embeddings"]:
        template.update(HEAD_MAP)
    return expand_weight_map(template, cfg["n_layers"])


def load_weights_into_tiny_aya(model: TinyAyaModel, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Assign Transformers-named tensors to ``model`` without copying; tie the head if configured
    (``out_head.weight`` becomes the very Parameter ``tok_emb.weight``).

    Returns the consumed checkpoint keys -> our parameter paths.

    Raises:
        LoaderError: naming every missing, unused or mis-shaped key and every parameter of ours left
            unwritten.
    """
    tied = TIED if cfg["tie_word_embeddings"] else None
    return apply_weight_map(model, state_dict, weight_map_for(cfg), tied=tied)
