"""Qwen3-MoE config fields: the values generated configs draw, and where a wrong value must show
(``parity selftest qwen3_moe --fields``; see :mod:`parity.model.fields`)."""

from __future__ import annotations

from parity.model.fields import Domain, Field, choice, ints

from ..qwen3.fields import shared_fields

MLP = "model.layers.{}.mlp"

#: 1..num_experts experts per token
TOP_K = Domain("1..num_experts", lambda rng, cfg: rng.randint(1, cfg["num_experts"]))
#: any subset of the layers
DENSE_LAYERS = Domain(
    "subset of 0..n_layers-1", lambda rng, cfg: sorted(i for i in range(cfg["n_layers"]) if rng.random() < 0.3)
)

FIELDS = shared_fields("tiny-moe", None) + (
    Field(
        "num_experts",
        ints(1, 8),
        6,
        "loader",
        config="tiny-moe",
        why="another expert count: the fused tensors do not split into ours",
    ),
    Field(
        "num_experts_per_tok",
        TOP_K,
        lambda cfg: cfg["num_experts_per_tok"] + 1,
        f"{MLP.format(0)}.router.experts",
        "experts_per_token",
        config="tiny-moe",
    ),
    Field("moe_intermediate_size", ints(4, 32), 24, "loader", config="tiny-moe"),
    Field(
        "norm_topk_prob",
        choice(False, True),
        False,
        f"{MLP.format(0)}.router.weights",
        "renormalisation",
        config="tiny-moe",
    ),
    Field(
        "decoder_sparse_step",
        ints(1, 3),
        2,
        "loader",
        config="tiny-moe",
        why="another sparse step: other layers hold experts",
    ),
    Field("mlp_only_layers", DENSE_LAYERS, [], "loader", config="tiny-moe", why="layer 1 sparse in the reference"),
)
