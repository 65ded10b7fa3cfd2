"""What every family module exports the same way: ``build_pair`` with the family bound, and a
weight-table loader named after the family (``load_weights_into_olmo3``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from parity.build import build_pair as build_any_pair
from parity.model.family import Family
from parity.model.pair import Pair
from parity.model.weights import apply_weight_table


def pair_builder(family: Family) -> Callable[..., Pair]:
    """``build_pair(config=None, checkpoint=None, dtype=torch.float32, seed=0, **overrides)`` for
    ``family``: :func:`parity.build.build_pair` with the family bound."""

    def build_pair(
        config=None, checkpoint=None, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
    ) -> Pair:
        return build_any_pair(family, config, checkpoint, dtype, seed, **overrides)

    build_pair.__doc__ = (
        f"A {family.name} Pair (ours against ``transformers.{family.reference_class}``) from a built-in config name "
        f"({', '.join(family.configs)}), a cfg dict, a config.json path or a checkpoint directory; "
        "see :func:`parity.build.build_pair` for every argument and the errors it raises."
    )
    build_pair.__qualname__ = build_pair.__name__
    return build_pair


def table_loader(
    name: str, table: Mapping[str, object]
) -> Callable[[nn.Module, dict, Mapping[str, torch.Tensor]], dict[str, str]]:
    """``load_weights_into_<name>(model, cfg, state_dict) -> {checkpoint key: our parameter path}``:
    the weight ``table`` applied by :func:`parity.model.weights.apply_weight_table` (tensors assigned
    without copying, a tied head kept tied). Raises LoaderError naming every missing, unused or
    mis-shaped key and every parameter of ours left unwritten."""

    def load(model: nn.Module, cfg: dict, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
        return apply_weight_table(model, state_dict, table)

    load.__name__ = load.__qualname__ = f"load_weights_into_{name}"
    load.__doc__ = table_loader.__doc__.replace("``load_weights_into_<name>", f"``load_weights_into_{name}")
    return load
