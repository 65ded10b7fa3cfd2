"""SmolLM3 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest smollm3 --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Domain, Field, choice, floats, ints, multiple_of

from ..common.layer_types import FULL
from .configs import SMOLLM3_YARN
from .faults import MISSING_ROPE_HINT

ATT = "model.layers.{}.self_attn"
NOPE_LAYER = 3  # tiny and yarn: layer 3 is the NoPE layer

#: one 0 (NoPE) or 1 (RoPE) per layer, drawn after n_layers
NO_ROPE_LAYERS = Domain("[0 | 1] x n_layers", lambda rng, cfg: [rng.randint(0, 1) for _ in range(cfg["n_layers"])])
#: every layer full attention (a window is refused), as long as n_layers
LAYER_TYPES = Domain("full_attention x n_layers", lambda rng, cfg: [FULL] * cfg["n_layers"])
YARN = Domain(
    "None | YaRN",
    lambda rng, cfg: (
        None
        if rng.random() < 0.5
        else {**SMOLLM3_YARN, "factor": rng.choice([2.0, 4.0]), "original_context_length": rng.choice([16, 64, 256])}
    ),
)
Q_ROT = f"{ATT.format(0)}.q_rot"

FIELDS = (
    Field("n_layers", ints(1, 5)),
    Field("n_kv_heads", ints(1, 3)),
    Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
    Field("head_dim", choice(2, 4, 8, 16, 32)),
    Field("emb_dim", choice(8, 16, 24, 32, 64)),
    Field("hidden_dim", ints(8, 96)),
    Field("vocab_size", ints(16, 300)),
    Field("tie_word_embeddings", choice(False, True)),
    Field("attention_bias", choice(False, True)),
    Field("mlp_bias", choice(False, True)),
    Field("layer_types", LAYER_TYPES),
    Field("rms_norm_eps", floats(1e-7, 1e-4, log=True), 1e-5, "model.layers.0.input_layernorm", "norm_eps"),
    Field("rope_base", floats(1e3, 1e7, log=True), 500_000.0, Q_ROT, "rope_theta"),
    Field(
        "no_rope_layers",
        NO_ROPE_LAYERS,
        lambda cfg: [1] * cfg["n_layers"],
        f"{ATT.format(NOPE_LAYER)}.q_rot",
        MISSING_ROPE_HINT,
        why="no NoPE layer on the reference: it rotates layer 3, ours does not",
    ),
    Field(
        "no_rope_layers",
        None,
        lambda cfg: [0] + list(cfg["no_rope_layers"][1:]),
        Q_ROT,
        "rope_unexpected",
        why="layer 0 NoPE on the reference too: ours rotates it",
    ),
    Field("rope_yarn", YARN),
    Field("rope_yarn.factor", None, 4.0, Q_ROT, config="yarn"),
    Field("rope_yarn.original_context_length", None, 16, Q_ROT, config="yarn"),
    Field(
        "rope_yarn.beta_fast",
        None,
        0.5,
        Q_ROT,
        config="yarn",
        why="at theta 5e6 the ramp's low end moves from dim 0 to dim 1 only below 1.5 rotations",
    ),
    Field("rope_yarn.beta_slow", None, 0.05, Q_ROT, config="yarn"),
    Field("rope_yarn.attention_factor", None, 1.0, Q_ROT, "rope_attention_factor", config="yarn"),
)
