"""The Qwen3-MoE family: our :class:`Qwen3MoeModel` against ``transformers.Qwen3MoeForCausalLM``."""

from __future__ import annotations

import torch

from parity.model.family import Family, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.layer_types import FULL
from ..common.nodes import DENSE_MLP, EMBED, FINAL, LAYER_OUTPUT, MOE
from ..qwen3.family import PRE_NORM_ATTENTION, attention_from_hf, attention_to_hf
from .configs import CONFIGS
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import Qwen3MoeModel

NODES = NodeMap(before=EMBED, per_layer=[*PRE_NORM_ATTENTION, *DENSE_MLP, *MOE, *LAYER_OUTPUT], after=FINAL)

#: our cfg key -> Qwen3MoeConfig field, for the mixture of experts
MOE_FIELDS = (
    ("num_experts", "num_experts"),
    ("num_experts_per_tok", "num_experts_per_tok"),
    ("moe_intermediate_size", "moe_intermediate_size"),
    ("norm_topk_prob", "norm_topk_prob"),
    ("decoder_sparse_step", "decoder_sparse_step"),
    ("mlp_only_layers", "mlp_only_layers"),
)
_NO_WINDOW = (
    "use_sliding_window true is not supported for qwen3_moe (Transformers masks every layer with the window then, "
    "and no released Qwen3-MoE uses it)"
)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.Qwen3MoeConfig`` (no layer types: every layer is full attention)."""
    from transformers import Qwen3MoeConfig

    if cfg["sliding_window"] is not None or set(cfg["layer_types"]) != {FULL}:
        raise ConfigError(_NO_WINDOW)
    fields = attention_to_hf(cfg)
    fields.pop("max_window_layers")
    moe = {hf: cfg[ours] for ours, hf in MOE_FIELDS}
    return Qwen3MoeConfig(**fields, **{**moe, "mlp_only_layers": list(cfg["mlp_only_layers"])})


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.Qwen3MoeConfig`` -> our cfg. Raises ConfigError naming a field we cannot honour:
    ``use_sliding_window`` (see :data:`_NO_WINDOW`), ``decoder_sparse_step`` below 1, and whatever
    Qwen3's :func:`~reference_pairs.qwen3.family.attention_from_hf` refuses."""
    if hc.sliding_window is not None:
        raise ConfigError(_NO_WINDOW)
    if int(hc.decoder_sparse_step) < 1:
        raise ConfigError(f"decoder_sparse_step {hc.decoder_sparse_step!r} is not supported (at least 1)")
    moe = {ours: getattr(hc, hf) for ours, hf in MOE_FIELDS}
    moe.update(
        norm_topk_prob=bool(moe["norm_topk_prob"]), mlp_only_layers=sorted(int(i) for i in moe["mlp_only_layers"] or [])
    )
    return dict(**attention_from_hf(hc, dtype), layer_types=[FULL] * hc.num_hidden_layers, **moe)


def features(cfg: dict) -> set[str]:
    """What a cfg exercises beyond the facts the gate reads itself: how the top-k weights are formed."""
    return {
        "top-k weights renormalised (norm_topk_prob)"
        if cfg["norm_topk_prob"]
        else "top-k weights as softmax probabilities"
    }


FAMILY = Family(
    name="qwen3_moe",
    model_type="qwen3_moe",
    reference_class="Qwen3MoeForCausalLM",
    config_class="Qwen3MoeConfig",
    model_class=Qwen3MoeModel,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    default_config="tiny-moe",
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny-moe",),
    real_configs=("30b-a3b-shape",),
    features=features,
)
build_pair = pair_builder(FAMILY)
