"""The Qwen3.5 family: our :class:`Qwen3_5Model` against ``transformers.Qwen3_5ForCausalLM`` (the text model)."""

from __future__ import annotations

import torch

from parity.model.facts import ArchFacts
from parity.model.family import Family, Node, NodeMap
from parity.model.pair import NodeSpec
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import shared_from_hf, shared_to_hf
from ..common.mlp import ACTIVATIONS
from ..common.nodes import ATTENTION, EMBED, FINAL, GATED_DELTANET, LAYER_OUTPUT, MLP, QK_NORM
from .configs import CONFIGS, FULL, LINEAR
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import Qwen3_5Model


def per_head_gate(head_dim: int):
    """The output gate inside a ``q_proj`` output ``(b, s, heads * 2 * head_dim)``: each head's second
    ``head_dim`` values, heads merged again, with ``Qwen3_5Attention``'s own view ops (no arithmetic)."""

    def gate(q: torch.Tensor) -> torch.Tensor:
        return torch.chunk(q.view(*q.shape[:-1], -1, 2 * head_dim), 2, dim=-1)[1].reshape(*q.shape[:-1], -1)

    return gate


def node_map(head_dim: int) -> NodeMap:
    """Nodes of a layer by its type; ``head_dim`` (of full attention) splits the reference's gate out of ``q_proj``."""

    def only(layer_type, entries):
        return [Node(name, ours, layer_types=(layer_type,)) for name, ours in entries]

    gate = Node(
        "model.layers.{i}.self_attn.gate",
        "blocks.{i}.att.gate",
        layer_types=(FULL,),
        reference="model.layers.{i}.self_attn.q_proj",
        reference_transform=per_head_gate(head_dim),
    )
    return NodeMap(
        before=EMBED,
        per_layer=[
            ("model.layers.{i}.input_layernorm", "blocks.{i}.norm1"),
            *only(LINEAR, GATED_DELTANET),
            *only(FULL, [*ATTENTION, *QK_NORM]),
            gate,
            # the gated context, context * sigmoid(gate): what the output gate does is seen before o_proj mixes it
            Node("model.layers.{i}.self_attn.o_proj@input", "blocks.{i}.att.out_proj@input", layer_types=(FULL,)),
            # the residual stream after the token mixer: the input of the second pre-norm
            ("model.layers.{i}.post_attention_layernorm@input", "blocks.{i}.norm2@input"),
            ("model.layers.{i}.post_attention_layernorm", "blocks.{i}.norm2"),
            *MLP,
            *LAYER_OUTPUT,
        ],
        after=FINAL,
    )


def nodes(facts: ArchFacts) -> list[NodeSpec]:
    return node_map(facts.head_dim).expand(facts)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.Qwen3_5TextConfig`` (plain RoPE with its rotary share in ``rope_parameters``)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **shared_to_hf(cfg),
        rms_norm_eps=cfg["rms_norm_eps"],
        hidden_act=cfg["activation"],
        attention_bias=cfg["attention_bias"],
        layer_types=list(cfg["layer_types"]),
        linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"],
        linear_conv_kernel_dim=cfg["linear_conv_kernel_dim"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg["rope_base"],
            "partial_rotary_factor": cfg["partial_rotary_factor"],
        },
    )


#: rope_parameters keys we read; ``mrope_*`` place image and video tokens, and a text sequence has the
#: same position on every M-RoPE axis, so for text they change nothing
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
_LINEAR_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.Qwen3_5TextConfig`` -> our cfg.

    Raises ConfigError naming any field we cannot honour: a rope type other than ``default``
    (``Qwen3_5TextRotaryEmbedding`` would take YaRN and others, we do not), unknown RoPE fields,
    layer types other than ``linear_attention`` / ``full_attention``, linear value heads that are
    not a multiple of its key heads, an activation we do not have, ``attn_output_gate`` false
    (Qwen3-Next's switch: ``Qwen3_5Attention`` gates its output whatever it says).
    """
    if hc.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"hidden_act {hc.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if getattr(hc, "attn_output_gate", True) is False:
        raise ConfigError("attn_output_gate false is not honoured: Qwen3_5Attention always gates its output")
    layer_types = list(hc.layer_types)
    unknown = set(layer_types) - {LINEAR, FULL}
    if unknown:
        raise ConfigError(f"layer_types has unsupported entries: {', '.join(sorted(unknown))}")
    for name in _LINEAR_FIELDS:
        value = getattr(hc, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} is {value!r}; it must be a positive integer")
    if hc.linear_num_value_heads % hc.linear_num_key_heads:
        raise ConfigError(
            f"linear_num_value_heads ({hc.linear_num_value_heads}) is not a multiple of linear_num_key_heads "
            f"({hc.linear_num_key_heads})"
        )
    rope = dict(hc.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.rope_type {rope['rope_type']!r} is not supported (default)")
    extra = set(rope) - _ROPE_KEYS
    if extra:
        raise ConfigError(f"rope_parameters has unsupported fields: {', '.join(sorted(extra))}")
    return dict(
        **shared_from_hf(hc),
        rms_norm_eps=hc.rms_norm_eps,
        activation=hc.hidden_act,
        attention_bias=bool(hc.attention_bias),
        rope_base=float(rope.get("rope_theta", hc.default_theta)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        layer_types=layer_types,
        **{name: getattr(hc, name) for name in _LINEAR_FIELDS},
        dtype=dtype,
    )


FAMILY = Family(
    name="qwen3_5",
    model_type="qwen3_5_text",
    reference_class="Qwen3_5ForCausalLM",
    config_class="Qwen3_5TextConfig",
    model_class=Qwen3_5Model,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=nodes,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny",),
    real_configs=("0.8b-shape",),
)
build_pair = pair_builder(FAMILY)
