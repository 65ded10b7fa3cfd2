"""The SmolLM3 family: our :class:`SmolLM3Model` against ``transformers.SmolLM3ForCausalLM``."""

from __future__ import annotations

from itertools import pairwise

import torch

from parity.model.family import Family, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_from_hf, shared_to_hf
from ..common.layer_types import FULL
from ..common.nodes import ATTENTION, EMBED, FINAL, LAYER_OUTPUT, MLP
from ..qwen3.family import rope_from_hf
from .configs import CONFIGS
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import SmolLM3Model, rope_parameters

#: Llama's pre-norm block; on a NoPE layer ``q_rot``/``k_rot`` are the unrotated heads
NODES = NodeMap(
    before=EMBED,
    per_layer=[
        ("model.layers.{i}.input_layernorm", "blocks.{i}.norm1"),
        *ATTENTION,
        # the residual stream after attention: the input of the second pre-norm
        ("model.layers.{i}.post_attention_layernorm@input", "blocks.{i}.norm2@input"),
        ("model.layers.{i}.post_attention_layernorm", "blocks.{i}.norm2"),
        *MLP,
        *LAYER_OUTPUT,
    ],
    after=FINAL,
)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.SmolLM3Config``: RoPE as one ``rope_parameters`` dict, the NoPE layers
    as an explicit ``no_rope_layers`` list (so ``no_rope_layer_interval`` is never read), no window."""
    from transformers import SmolLM3Config

    return SmolLM3Config(
        **shared_to_hf(cfg),
        rms_norm_eps=cfg["rms_norm_eps"],
        hidden_act="silu",
        attention_bias=cfg["attention_bias"],
        mlp_bias=cfg["mlp_bias"],
        rope_parameters=rope_parameters(cfg)[FULL],
        no_rope_layers=list(cfg["no_rope_layers"]),
        use_sliding_window=False,
        sliding_window=None,
        layer_types=list(cfg["layer_types"]),
    )


def no_rope_layers_from_hf(hc) -> list[int]:
    """``no_rope_layers`` as ``SmolLM3Attention`` reads it: entry ``i`` of the list (derived from
    ``no_rope_layer_interval`` when the config has none), truthy = RoPE. The list may be longer than
    the model (Transformers reads the first ``num_hidden_layers``); shorter is refused, as is an entry
    that is not an integer or boolean (a string ``"0"`` would be truthy there)."""
    flags = list(hc.no_rope_layers)
    n = hc.num_hidden_layers
    if len(flags) < n:
        raise ConfigError(f"no_rope_layers has {len(flags)} entries for num_hidden_layers={n}")
    bad = [f for f in flags[:n] if not isinstance(f, (bool, int))]
    if bad:
        raise ConfigError(f"no_rope_layers entries must be 0 (NoPE) or 1 (RoPE), got {bad[0]!r}")
    return [int(bool(f)) for f in flags[:n]]


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.SmolLM3Config`` -> our cfg. Raises ConfigError naming a field we cannot honour:
    an activation other than SiLU, a rope type other than default or YaRN (see
    :func:`reference_pairs.qwen3.family.rope_from_hf`, the same Transformers-5 rope handling), a
    ``sliding_attention`` layer (``use_sliding_window`` with a ``sliding_window``: Transformers then
    windows the NoPE layers; no released SmolLM3 does), ``no_rope_layers`` as
    :func:`no_rope_layers_from_hf` says."""
    if hc.hidden_act != "silu":
        raise ConfigError(f"hidden_act {hc.hidden_act!r} is not supported (SmolLM3 uses 'silu')")
    layer_types = list(hc.layer_types)
    if any(t != FULL for t in layer_types):
        others = sorted(set(layer_types) - {FULL})
        raise ConfigError(
            f"layer_types has {', '.join(others)} layers (use_sliding_window={hc.use_sliding_window}, "
            f"sliding_window={hc.sliding_window}): only full_attention is supported"
        )
    rope_base, rope_yarn = rope_from_hf(hc)
    return dict(
        **shared_from_hf(hc),
        rms_norm_eps=hc.rms_norm_eps,
        attention_bias=bool(hc.attention_bias),
        mlp_bias=bool(hc.mlp_bias),
        rope_base=rope_base,
        rope_yarn=rope_yarn,
        no_rope_layers=no_rope_layers_from_hf(hc),
        layer_types=layer_types,
        dtype=dtype,
    )


def features(cfg: dict) -> set[str]:
    """What a cfg exercises (the gate requires every real config's features in some CI config)."""
    flags = cfg["no_rope_layers"]
    out = {"tied_head" if cfg["tie_word_embeddings"] else "untied_head"}
    out |= {"rope_layer"} if 1 in flags else set()
    out |= {"nope_layer"} if 0 in flags else set()
    out |= {"rope_after_nope"} if any(a == 0 and b == 1 for a, b in pairwise(flags)) else set()
    out |= {"gqa"} if 1 < cfg["n_kv_heads"] < cfg["n_heads"] else set()
    out |= {"mqa"} if cfg["n_kv_heads"] == 1 < cfg["n_heads"] else set()
    out |= {"yarn"} if cfg["rope_yarn"] is not None else set()
    out |= {name for name in ("attention_bias", "mlp_bias") if cfg[name]}
    return out


def notes(cfg: dict) -> list[str]:
    """What a cfg cannot show about NoPE."""
    flags = cfg["no_rope_layers"]
    if 0 not in flags:
        return ["no NoPE layer (no_rope_layers all 1): RoPE applied where SmolLM3 skips it cannot show"]
    if 1 not in flags:
        return ["no RoPE layer (no_rope_layers all 0): theta, YaRN and RoPE layout cannot show"]
    return []


FAMILY = Family(
    name="smollm3",
    model_type="smollm3",
    reference_class="SmolLM3ForCausalLM",
    config_class="SmolLM3Config",
    model_class=SmolLM3Model,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny", "yarn"),
    real_configs=("3b-shape",),
    features=features,
    notes=notes,
)
build_pair = pair_builder(FAMILY)
