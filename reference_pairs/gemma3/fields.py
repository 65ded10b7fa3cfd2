"""Gemma 3 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest gemma3 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Field, choice, floats, ints, multiple_of, pattern

from ..common.layer_types import FULL, SLIDING

ATT = "model.layers.{}.self_attn"
FIRST_FULL = 5  # the full-attention layer of the tiny configs

FIELDS = (
    # structure: drawn for generated configs, not audited (both sides' shapes would change)
    Field("n_layers", ints(1, 7)),
    Field("n_kv_heads", ints(1, 3)),
    Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
    Field("head_dim", choice(2, 4, 8, 16, 32)),
    Field("emb_dim", multiple_of("n_heads", 2, 6)),  # Gemma3TextConfig: a multiple of the head count
    Field("hidden_dim", ints(8, 64)),
    Field("vocab_size", ints(16, 300)),
    Field("attention_bias", choice(False, True)),
    Field("layer_types", pattern("n_layers", SLIDING, FULL)),
    # a tied head one side unties: only the loader can tell
    Field("tie_word_embeddings", choice(True, False), False, "loader"),
    # numbers and choices: drawn and audited
    Field("rms_norm_eps", floats(1e-7, 1e-4, log=True), 1e-5, "model.layers.0.input_layernorm", "norm_eps"),
    Field("query_pre_attn_scalar", ints(1, 512), 64, f"{ATT.format(0)}.scores", "attention_scale"),
    Field("hidden_activation", choice("gelu_pytorch_tanh", "gelu", "silu"), "gelu", "model.layers.0.mlp.down_proj"),
    Field("sliding_window", ints(1, 24), 5, f"{ATT.format(0)}.probs", "sliding_window"),
    Field("rope_local_base", floats(1e3, 1e6, log=True), 100_000.0, f"{ATT.format(0)}.q_rot", "rope_theta"),
    Field("rope_base", floats(1e3, 1e7, log=True), 100_000.0, f"{ATT.format(FIRST_FULL)}.q_rot", "rope_theta"),
    Field(
        "layer_types",
        None,
        [FULL] * 6,
        f"{ATT.format(0)}.q_rot",
        "rope_theta",
        why="a sliding layer run as full attention: the global RoPE shows before the window",
    ),
    Field("rope_scaling_factor", choice(None, 2.0, 8.0), 8.0, f"{ATT.format(FIRST_FULL)}.q_rot", "rope_scaling"),
    Field(
        "rope_scaling_factor",
        None,
        4.0,
        f"{ATT.format(FIRST_FULL)}.q_rot",
        config="linear",
        why="linear factor 8 in ours, 4 in the reference",
    ),
    Field("final_logit_softcap", choice(None, 30.0, 50.0), 30.0, "logits", "softcap"),
    Field("final_logit_softcap", None, 50.0, "logits", config="linear", why="cap 30 in ours, 50 in the reference"),
)
