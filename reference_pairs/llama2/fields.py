"""Llama 2 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest llama2 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Field, choice, floats, ints, multiple_of

ATT = "model.layers.{}.self_attn"

FIELDS = (
    Field("n_layers", ints(1, 3)),
    Field("n_heads", ints(1, 4)),
    Field("n_kv_heads", multiple_of("n_heads", 1, 1)),  # MHA
    Field("head_dim", choice(2, 4, 8, 16, 32)),
    Field("emb_dim", choice(8, 16, 24, 48)),
    Field("hidden_dim", ints(8, 96)),
    Field("vocab_size", ints(16, 300)),
    Field("tie_word_embeddings", choice(False, True)),
    Field("rms_norm_eps", floats(1e-7, 1e-4, log=True), 1e-6, "model.layers.0.input_layernorm", "norm_eps"),
    Field("rope_base", floats(1e3, 1e6, log=True), 500_000.0, f"{ATT.format(0)}.q_rot", "rope_theta"),
    Field(
        "rope_freq",
        None,
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=256),
        f"{ATT.format(0)}.q_rot",
        "rope_scaling",
        why="Llama 3.1's frequency scaling on the reference only",
    ),
)
