"""Tiny Aya config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest tiny_aya --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Field, choice, floats, ints, multiple_of, pattern

from ..common.layer_types import FULL, SLIDING

ATT = "model.layers.{}.self_attn"

FIELDS = (
    Field("n_layers", ints(1, 4)),
    Field("n_kv_heads", ints(1, 3)),
    Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
    Field("head_dim", choice(2, 4, 8, 16)),
    Field("emb_dim", choice(8, 16, 24, 32)),
    Field("hidden_dim", ints(8, 48)),
    Field("vocab_size", ints(16, 300)),
    Field("attention_bias", choice(False, True)),
    Field("tie_word_embeddings", choice(False, True)),
    Field("layer_types", pattern("n_layers", SLIDING, FULL)),
    Field("layer_norm_eps", floats(1e-7, 1e-4, log=True), 1e-6, "model.layers.0.input_layernorm", "norm_eps"),
    Field("sliding_window", ints(1, 24), 5, f"{ATT.format(0)}.probs", "sliding_window"),
    Field("rope_base", floats(1e3, 1e6, log=True), 10_000.0, f"{ATT.format(0)}.q_rot", "rope_theta"),
    Field("logit_scale", floats(0.01, 2.0), 0.125, "logits", "logit_scale"),
    Field(
        "layer_types",
        None,
        [FULL] * 4,
        f"{ATT.format(0)}.q_rot",
        "rope_unexpected",
        why="a sliding layer run as a full (NoPE) layer: ours rotates it",
    ),
)
