"""Qwen3.5 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest qwen3_5 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Field, choice, floats, ints, multiple_of, pattern

from ..common.layer_types import FULL, LINEAR

FIRST_FULL = 3  # the full-attention layer of the tiny config
ATT = f"model.layers.{FIRST_FULL}.self_attn"
LIN = "model.layers.0.linear_attn"

FIELDS = (
    # structure: drawn for generated configs, not audited (both sides' shapes would change)
    Field("n_layers", ints(1, 4)),
    Field("n_kv_heads", ints(1, 3)),
    Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
    Field("head_dim", choice(8, 16, 32)),
    Field("emb_dim", choice(8, 16, 24, 32)),
    Field("hidden_dim", ints(8, 48)),
    Field("vocab_size", ints(16, 300)),
    Field("attention_bias", choice(False, True)),
    Field("tie_word_embeddings", choice(False, True)),
    Field("linear_num_key_heads", ints(1, 3)),
    Field("linear_num_value_heads", multiple_of("linear_num_key_heads", 1, 3)),
    Field("linear_key_head_dim", choice(2, 4, 8, 16)),
    Field("linear_value_head_dim", choice(2, 4, 8, 16)),
    Field("layer_types", pattern("n_layers", LINEAR, FULL)),
    # numbers and choices: drawn and audited
    Field("rms_norm_eps", floats(1e-7, 1e-4, log=True), 1e-5, "model.layers.0.input_layernorm", "norm_eps"),
    Field("rope_base", floats(1e3, 1e7, log=True), 1_000_000.0, f"{ATT}.q_rot", "rope_theta"),
    Field("partial_rotary_factor", choice(0.25, 0.5, 1.0), 0.5, f"{ATT}.q_rot", "rope_partial"),
    Field("linear_conv_kernel_dim", ints(2, 5), 3, "loader", why="the conv weight is (channels, 1, K)"),
    Field(
        "activation",
        choice("silu", "gelu_pytorch_tanh"),
        "gelu_pytorch_tanh",
        f"{LIN}.conv_out",
        why="the conv's activation comes first (the MLP's later); no hint: silu and gelu both dip below zero, "
        "so neither is a monotone function of the other and the conv's input is no node",
    ),
    Field(
        "layer_types",
        None,
        [LINEAR, LINEAR, FULL, FULL],
        "loader",
        why="a linear layer and a full one hold different weights",
    ),
)
