"""The GPT-2 family: our :class:`GPTModel` against ``transformers.GPT2LMHeadModel``."""

from __future__ import annotations

import torch

from parity.model.family import Family, Node, NodeMap
from parity.util.errors import ConfigError

from ..common.builders import pair_builder
from ..common.config import NO_SPECIAL_TOKENS
from ..common.mlp import ACTIVATIONS
from ..common.nodes import LOGITS
from .configs import CONFIGS
from .faults import FAULTS
from .fields import FIELDS
from .loader import WEIGHT_MAP
from .model import GPTModel

H = "transformer.h.{i}"
NODES = NodeMap(
    before=[("transformer.wte", "tok_emb"), ("transformer.wpe", "pos_emb")],
    per_layer=[
        (f"{H}.ln_1", "blocks.{i}.norm1"),
        (f"{H}.attn.c_attn", "blocks.{i}.att.W_qkv"),  # [q | k | v], as GPT-2 computes it
        # q/k "after RoPE" are the unrotated heads: GPT-2 has no RoPE
        *[(f"{H}.attn.{tap}", f"blocks.{{i}}.att.{tap}") for tap in ("q_rot", "k_rot", "scores", "probs", "context")],
        # two modules are called c_proj: the kinds tell them apart
        Node(f"{H}.attn.c_proj", "blocks.{i}.att.out_proj", kind="attn.c_proj"),
        # the residual stream after attention: the input of the second pre-norm
        (f"{H}.ln_2@input", "blocks.{i}.norm2@input"),
        (f"{H}.ln_2", "blocks.{i}.norm2"),
        (f"{H}.mlp.c_fc", "blocks.{i}.ff.fc1"),
        # the activation's output (GPT2MLP.act has no parameter; c_proj reads it)
        Node(f"{H}.mlp.c_proj@input", "blocks.{i}.ff.fc2@input", kind="mlp.c_proj@input"),
        Node(f"{H}.mlp.c_proj", "blocks.{i}.ff.fc2", kind="mlp.c_proj"),
        (H, "blocks.{i}"),
    ],
    after=[("transformer.ln_f", "final_norm"), ("lm_head", "out_head"), LOGITS],
)


def to_hf(cfg: dict):
    """Our cfg -> ``transformers.GPT2Config`` (``n_inner`` always explicit)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg["vocab_size"],
        n_positions=cfg["context_length"],
        n_embd=cfg["emb_dim"],
        n_layer=cfg["n_layers"],
        n_head=cfg["n_heads"],
        n_inner=cfg["hidden_dim"],
        activation_function=cfg["activation"],
        layer_norm_epsilon=cfg["layer_norm_eps"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        scale_attn_weights=cfg["scale_attn_weights"],
        scale_attn_by_inverse_layer_idx=cfg["scale_attn_by_inverse_layer_idx"],
        **NO_SPECIAL_TOKENS,
    )


def from_hf(hc, dtype: torch.dtype) -> dict:
    """``transformers.GPT2Config`` -> our cfg (``n_inner`` null is 4 x ``n_embd``, as GPT2Block builds it).

    Raises ConfigError naming any field we cannot honour: an activation our MLP does not compute,
    ``add_cross_attention`` (an encoder-decoder GPT-2), ``reorder_and_upcast_attn`` (Transformers
    honours it only in its own ``eager`` attention; parity runs the reference through
    ``AttentionInterface``, where it is ignored, so the reference would not be what the config says),
    ``n_embd`` not a multiple of ``n_head``.
    """
    if hc.activation_function not in ACTIVATIONS:
        raise ConfigError(f"activation_function {hc.activation_function!r} is not supported ({', '.join(ACTIVATIONS)})")
    if hc.add_cross_attention:
        raise ConfigError("add_cross_attention true is not supported (a decoder-only GPT-2 has no cross-attention)")
    if hc.reorder_and_upcast_attn:
        raise ConfigError(
            "reorder_and_upcast_attn true is not supported (Transformers applies it only in its own eager "
            "attention, not through the attention interface parity records the reference with)"
        )
    if hc.n_embd % hc.n_head:
        raise ConfigError(f"n_embd ({hc.n_embd}) is not a multiple of n_head ({hc.n_head})")
    return dict(
        vocab_size=hc.vocab_size,
        context_length=hc.n_positions,
        emb_dim=hc.n_embd,
        n_heads=hc.n_head,
        n_layers=hc.n_layer,
        hidden_dim=hc.n_inner if hc.n_inner is not None else 4 * hc.n_embd,
        layer_norm_eps=hc.layer_norm_epsilon,
        activation=hc.activation_function,
        tie_word_embeddings=bool(hc.tie_word_embeddings),
        scale_attn_weights=bool(hc.scale_attn_weights),
        scale_attn_by_inverse_layer_idx=bool(hc.scale_attn_by_inverse_layer_idx),
        dtype=dtype,
    )


def features(cfg: dict) -> set[str]:
    """What a GPT-2 cfg exercises beyond the facts the gate reads itself."""
    feats = {"learned positions", f"activation {cfg['activation']}"}
    if not cfg["scale_attn_weights"]:
        feats.add("unscaled attention")
    if cfg["scale_attn_by_inverse_layer_idx"]:
        feats.add("attention scaled by 1 / (layer + 1)")
    return feats


FAMILY = Family(
    name="gpt2",
    model_type="gpt2",
    reference_class="GPT2LMHeadModel",
    config_class="GPT2Config",
    model_class=GPTModel,
    configs=CONFIGS,
    weights=WEIGHT_MAP,
    nodes=NODES,
    to_hf=to_hf,
    from_hf=from_hf,
    faults=FAULTS,
    exact_dtypes=(torch.float32, torch.bfloat16),
    fields=FIELDS,
    ci_configs=("tiny",),
    real_configs=("124m-shape", "355m-shape"),
    features=features,
)
build_pair = pair_builder(FAMILY)
