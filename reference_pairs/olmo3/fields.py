"""OLMo 3 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest olmo3 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Field, choice, floats, ints, multiple_of, pattern

from ..common.layer_types import FULL, SLIDING

ATT = "model.layers.{}.self_attn"
FIRST_FULL = 3  # the full-attention layer of the tiny configs

FIELDS = (
    # structure: drawn for generated configs, not audited (both sides' shapes would change)
    Field("n_layers", ints(1, 4)),
    Field("n_kv_heads", ints(1, 3)),
    Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
    Field("head_dim", choice(2, 4, 8, 16, 32)),
    Field("emb_dim", choice(8, 16, 24, 32)),
    Field("hidden_dim", ints(8, 48)),
    Field("vocab_size", ints(16, 300)),
    Field("attention_bias", choice(False, True)),
    Field("tie_word_embeddings", choice(False, True)),
    Field("layer_types", pattern("n_layers", SLIDING, FULL)),
    # numbers: drawn and audited
    Field("rms_norm_eps", floats(1e-7, 1e-4, log=True), 1e-5, f"{ATT.format(0)}.q_norm", "norm_eps"),
    Field("sliding_window", ints(1, 24), 5, f"{ATT.format(0)}.probs", "sliding_window"),
    Field("rope_local_base", floats(1e3, 1e6, log=True), 10_000.0, f"{ATT.format(0)}.q_rot", "rope_theta"),
    Field("rope_base", floats(1e3, 1e6, log=True), 1_000_000.0, f"{ATT.format(FIRST_FULL)}.q_rot", "rope_theta"),
    Field(
        "layer_types",
        None,
        [FULL] * 4,
        f"{ATT.format(0)}.probs",
        "sliding_window",
        why="a sliding layer run as full attention",
    ),
    Field("rope_type", choice("default", "yarn")),
    Field(
        "rope_scaled_layer_types",
        choice([FULL], [SLIDING], [FULL, SLIDING]),
        [FULL, SLIDING],
        f"{ATT.format(0)}.q_rot",
        "rope_scaling",
        config="yarn",
    ),
    Field("rope_factor", floats(1.5, 40.0), 4.0, f"{ATT.format(FIRST_FULL)}.q_rot", config="yarn"),
    Field("rope_orig_max", choice(8, 16, 64, 8192), 16, f"{ATT.format(FIRST_FULL)}.q_rot", config="yarn"),
    Field("beta_fast", floats(1.5, 64.0), 1.5, f"{ATT.format(FIRST_FULL)}.q_rot", config="yarn"),
    Field("beta_slow", floats(0.05, 1.25), 0.05, f"{ATT.format(FIRST_FULL)}.q_rot", config="yarn"),
    Field(
        "rope_attention_factor",
        choice(None, 1.0, 1.2079441541679836, 2.0),
        1.0,
        f"{ATT.format(FIRST_FULL)}.q_rot",
        "rope_attention_factor",
        config="yarn",
    ),
)
