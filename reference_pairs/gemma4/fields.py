"""Gemma 4 config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest gemma4 --fields``; see :mod:`parity.model.fields`). Fields that change a weight's shape
or drop a weight (per-layer head_dim, KV sharing, K = V, the double-wide FFN, per-layer inputs) can
only be seen by the loader: ours and the reference's checkpoint no longer fit."""

from __future__ import annotations

from parity.model.fields import Domain, Field, choice, floats, ints, multiple_of, relative

from ..common.layer_types import FULL, SLIDING
from .model import kv_sources

ATT = "model.layers.{}.self_attn"
FIRST_FULL = 2  # the first full-attention layer of the tiny configs

#: a layer pattern whose last layer is full (Gemma4TextConfig forces it)
LAYER_TYPES = Domain(
    "[sliding_attention | full_attention] x n_layers, the last full_attention",
    lambda rng, cfg: [rng.choice((SLIDING, FULL)) for _ in range(cfg["n_layers"] - 1)] + [FULL],
)


def _shareable(cfg: dict) -> list[int]:
    """The KV-shared layer counts this layer pattern allows (every shared type has an earlier producer)."""
    counts = [0]
    for k in range(1, cfg["n_layers"]):
        try:
            kv_sources({**cfg, "num_kv_shared_layers": k})
        except KeyError:
            continue
        counts.append(k)
    return counts


KV_SHARED = Domain(
    "0 .. n_layers - 1, leaving each shared layer type an earlier layer (0 without per-layer inputs)",
    lambda rng, cfg: rng.choice(_shareable(cfg)) if cfg["hidden_size_per_layer_input"] else 0,
)
#: K = V full layers may have their own KV head count (a divisor of n_heads); otherwise none
GLOBAL_KV_HEADS = Domain(
    "None, or with attention_k_eq_v a divisor of n_heads",
    lambda rng, cfg: (
        rng.choice([None] + [d for d in range(1, cfg["n_heads"] + 1) if cfg["n_heads"] % d == 0])
        if cfg["attention_k_eq_v"]
        else None
    ),
)

FIELDS = (
    # structure: drawn for generated configs
    Field("n_layers", ints(1, 7)),
    Field("layer_types", LAYER_TYPES),
    Field("n_kv_heads", ints(1, 3)),
    Field("n_heads", multiple_of("n_kv_heads", 1, 3)),
    Field("head_dim", choice(2, 4, 8, 16)),
    Field("emb_dim", choice(8, 16, 24, 32)),
    Field("hidden_dim", ints(8, 64)),
    Field("vocab_size", ints(16, 300)),
    Field("attention_bias", choice(False, True)),
    # shape changes only the loader sees
    Field("global_head_dim", choice(4, 8, 16, 32), 32, "loader"),
    Field("vocab_size_per_layer_input", relative("vocab_size", 0, 40), 300, "loader"),
    Field("hidden_size_per_layer_input", choice(0, 4, 8), 4, "loader"),
    Field("num_kv_shared_layers", KV_SHARED, 0, "loader"),
    Field("use_double_wide_mlp", choice(False, True), False, "loader"),
    Field("attention_k_eq_v", choice(False, True), True, "loader"),
    Field("num_global_kv_heads", GLOBAL_KV_HEADS, 2, "loader", config="k-eq-v"),
    Field("tie_word_embeddings", choice(True, False), False, "loader"),
    # numbers and choices: drawn and audited
    Field("rms_norm_eps", floats(1e-7, 1e-4, log=True), 1e-5, "model.per_layer_projection_norm", "norm_eps"),
    Field("hidden_activation", choice("gelu_pytorch_tanh", "gelu", "silu"), "gelu", "model.layers.0.mlp.down_proj"),
    Field("sliding_window", ints(1, 24), 5, f"{ATT.format(0)}.probs", "sliding_window"),
    Field("rope_local_base", floats(1e3, 1e6, log=True), 100_000.0, f"{ATT.format(0)}.q_rot", "rope_theta"),
    Field("rope_base", floats(1e3, 1e7, log=True), 100_000.0, f"{ATT.format(FIRST_FULL)}.q_rot", "rope_theta"),
    Field(
        "rope_global_type",
        choice("proportional", "default"),
        "default",
        f"{ATT.format(FIRST_FULL)}.q_rot",
        "rope_partial",
    ),
    Field(
        "rope_global_partial_rotary_factor",
        choice(0.25, 0.5, 1.0),
        0.5,
        f"{ATT.format(FIRST_FULL)}.q_rot",
        "rope_partial",
    ),
    Field("final_logit_softcap", choice(None, 30.0, 50.0), 50.0, "logits", why="cap 30 in ours, 50 in the reference"),
)
