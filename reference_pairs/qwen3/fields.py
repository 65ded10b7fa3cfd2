"""Qwen3 (dense) config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest qwen3 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Domain, Field, choice, floats, ints, multiple_of

from ..common.layer_types import FULL, SLIDING
from .configs import QWEN3_YARN

ATT = "model.layers.{}.self_attn"
FIRST_SLIDING = 1  # the swa config: layer 0 full, the rest sliding

#: no window (every released config), or one; drawn before the layer types that use it
WINDOW = Domain("None | 1..24", lambda rng, cfg: None if rng.random() < 0.5 else rng.randint(1, 24))
#: Transformers' layer types for a window: full up to max_window_layers, sliding from there
LAYER_TYPES = Domain(
    "full x max_window_layers + sliding (with a window)",
    lambda rng, cfg: (
        [FULL] * cfg["n_layers"]
        if cfg["sliding_window"] is None
        else (lambda k: [FULL] * k + [SLIDING] * (cfg["n_layers"] - k))(rng.randint(0, cfg["n_layers"]))
    ),
)
YARN = Domain(
    "None | YaRN",
    lambda rng, cfg: (
        None if rng.random() < 0.5 else {**QWEN3_YARN, "original_context_length": rng.choice([16, 64, 256])}
    ),
)


def shared_fields(config: str = "tiny", yarn_config: str | None = "yarn") -> tuple[Field, ...]:
    """The fields every Qwen3 (dense and MoE) shares; ``config``/``yarn_config``: the built-in configs
    the audits start from (None: no YaRN config, its fields are drawn only)."""
    fields = (
        Field("n_layers", ints(1, 3)),
        Field("n_kv_heads", ints(1, 3)),
        Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
        Field("head_dim", choice(2, 4, 8, 16, 32)),
        Field("emb_dim", choice(8, 16, 24, 32)),
        Field("hidden_dim", ints(8, 48)),
        Field("vocab_size", ints(16, 300)),
        Field("tie_word_embeddings", choice(False, True)),
        Field("attention_bias", choice(False, True)),
        Field(
            "rms_norm_eps",
            floats(1e-7, 1e-4, log=True),
            1e-5,
            "model.layers.0.input_layernorm",
            "norm_eps",
            config=config,
        ),
        Field("rope_base", floats(1e3, 1e7, log=True), 10_000.0, f"{ATT.format(0)}.q_rot", "rope_theta", config=config),
        Field("rope_yarn", YARN),
    )
    if yarn_config is None:
        return fields
    q_rot = f"{ATT.format(0)}.q_rot"
    return fields + (
        Field("rope_yarn.factor", None, 8.0, q_rot, config=yarn_config),
        Field("rope_yarn.original_context_length", None, 16, q_rot, config=yarn_config),
        Field("rope_yarn.beta_fast", None, 1.5, q_rot, config=yarn_config),
        Field("rope_yarn.beta_slow", None, 0.05, q_rot, config=yarn_config),
        Field("rope_yarn.attention_factor", None, 1.0, q_rot, "rope_attention_factor", config=yarn_config),
    )


FIELDS = shared_fields() + (
    Field("sliding_window", WINDOW, 5, f"{ATT.format(FIRST_SLIDING)}.probs", "sliding_window", config="swa"),
    Field(
        "layer_types",
        LAYER_TYPES,
        lambda cfg: [FULL] * cfg["n_layers"],
        f"{ATT.format(FIRST_SLIDING)}.probs",
        "sliding_window",
        config="swa",
        why="max_window_layers past the last layer: no layer windowed",
    ),
)
