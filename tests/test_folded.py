"""Which projections read which norm (:mod:`parity.user.folded`), found by one forward of the reference, and the
checkpoint tensors as a port folding those norms' gains into them at load holds them."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from parity.user.folded import folded_tensors, norm_readers


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_each_norm_is_read_by_the_projections_after_it():
    readers = norm_readers(_llama(), 32)
    layer = "model.layers.1."
    assert readers[layer + "input_layernorm.weight"] == [layer + f"self_attn.{p}_proj.weight" for p in ("k", "q", "v")]
    assert readers[layer + "post_attention_layernorm.weight"] == [
        layer + f"mlp.{p}_proj.weight" for p in ("gate", "up")
    ]
    assert readers["model.norm.weight"] == ["lm_head.weight"]  # through the head's slice of the hidden states
    assert not any("o_proj" in w or "down_proj" in w for ws in readers.values() for w in ws)


def test_only_unplaced_weights_are_folded_with_the_gain_in_their_input_columns():
    model = _llama()
    state_dict = model.state_dict()
    readers = norm_readers(model, 32)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    folded, into = folded_tensors(readers, state_dict, [q])
    g = state_dict["model.layers.0.input_layernorm.weight"]
    assert list(folded) == [q] and k not in folded
    assert torch.equal(folded[q], state_dict[q] * g[None, :])
    assert into == {"model.layers.0.input_layernorm.weight": [q]}
