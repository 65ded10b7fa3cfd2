"""Llama 3 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest llama3 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Field, choice, floats, ints, multiple_of

ATT = "model.layers.{}.self_attn"

FIELDS = (
    Field("n_layers", ints(1, 3)),
    Field("n_kv_heads", ints(1, 3)),
    Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
    Field("head_dim", choice(2, 4, 8, 16, 32)),
    # LlamaConfig requires hidden_size to be a multiple of the heads, even with an explicit head_dim
    Field("emb_dim", multiple_of("n_heads", 1, 8)),
    Field("hidden_dim", ints(8, 96)),
    Field("vocab_size", ints(16, 300)),
    Field("tie_word_embeddings", choice(False, True)),
    Field("rms_norm_eps", floats(1e-7, 1e-4, log=True), 1e-6, "model.layers.0.input_layernorm", "norm_eps"),
    Field("rope_base", floats(1e3, 1e6, log=True), 10_000.0, f"{ATT.format(0)}.q_rot", "rope_theta"),
    Field("rope_freq.factor", floats(1.5, 64.0), 8.0, f"{ATT.format(0)}.q_rot"),
    Field("rope_freq.low_freq_factor", floats(0.5, 2.0), 2.0, f"{ATT.format(0)}.q_rot"),
    Field("rope_freq.high_freq_factor", floats(2.5, 8.0), 8.0, f"{ATT.format(0)}.q_rot"),
    Field("rope_freq.original_context_length", choice(16, 64, 256, 8192), 64, f"{ATT.format(0)}.q_rot"),
    Field("rope_freq", choice(None), None, f"{ATT.format(0)}.q_rot", why="drawn as None: plain RoPE"),
)
