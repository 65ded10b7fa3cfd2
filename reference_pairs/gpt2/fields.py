"""GPT-2 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest gpt2 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Field, choice, floats, ints, multiple_of

H = "transformer.h.{}"

FIELDS = (
    # structure: drawn for generated configs, not audited (both sides' shapes would change)
    Field("n_layers", ints(1, 3)),
    Field("n_heads", ints(1, 4)),
    Field("emb_dim", multiple_of("n_heads", 2, 12)),
    Field("hidden_dim", ints(8, 96)),
    Field("vocab_size", ints(16, 300)),
    Field("context_length", ints(32, 128)),  # past the default 16 tokens: learned positions end there
    Field("tie_word_embeddings", choice(True, False)),
    # numbers and choices: drawn and audited
    Field("layer_norm_eps", floats(1e-7, 1e-4, log=True), 1e-6, f"{H.format(0)}.ln_1", "norm_eps"),
    Field(
        "activation",
        choice("gelu_new", "gelu", "gelu_pytorch_tanh", "silu"),
        "gelu",
        f"{H.format(0)}.mlp.c_proj@input",
        "activation",
    ),
    Field("scale_attn_weights", choice(True, False), False, f"{H.format(0)}.attn.scores", "attention_scale"),
    Field(
        "scale_attn_by_inverse_layer_idx",
        choice(False, True),
        True,
        f"{H.format(1)}.attn.scores",
        "attention_scale",
        why="layer 0 divides by 1: the first layer it changes is layer 1",
    ),
)
