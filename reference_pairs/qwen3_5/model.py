"""Qwen3.5 from scratch (Qwen team, 2026; the Qwen3-Next architecture; the book's ch. 11 tour).

A pre-norm hybrid: three ``linear_attention`` layers for every ``full_attention`` layer, each

    h = x + mixer(norm1(x))        # Gated DeltaNet, or gated full attention
    y = h + ff(norm2(h))           # SwiGLU

then ``final_norm`` and ``out_head`` (the embedding's own Parameter when tied, as in 0.8B). What
distinguishes it from Llama-style models:

* linear-attention layers: Gated DeltaNet (:mod:`reference_pairs.common.linear_attention`): a
  causal depthwise conv, L2-normalised q and k, a state decayed by ``g`` and corrected by the
  delta rule with strength ``beta``, a per-head RMSNorm gated by ``z``; no RoPE, no softmax;
* full-attention layers: ``q_proj`` twice as wide, each head's query followed by its own output
  gate (split per head, not in two flat halves); per-head Q/K RMSNorm; RoPE on the first quarter
  of each head (``partial_rotary_factor``); GQA; ``context * sigmoid(gate)`` before ``o_proj``;
* every RMSNorm but the DeltaNet's scales by ``(1 + w)`` with ``w`` initialised to zero, in float32
  and cast last (``Qwen3_5RMSNorm``); cos/sin and the rotation in the activation dtype.

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, rms_norm_eps, activation, attention_bias, tie_word_embeddings, rope_base,
partial_rotary_factor, layer_types, linear_num_key_heads, linear_num_value_heads,
linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim, dtype``.
"""

from __future__ import annotations

from functools import partial

from ..common.attention import GroupedQueryAttention
from ..common.blocks import PreNormBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL, LINEAR
from ..common.linear_attention import GatedDeltaNet
from ..common.mlp import GatedMLP
from ..common.norms import RMSNorm


def rope_parameters(cfg: dict) -> dict[str, dict | None]:
    """Plain RoPE on a ``partial_rotary_factor`` share of each head on full-attention layers; none on linear ones."""
    full = {
        "rope_type": "default",
        "rope_theta": cfg["rope_base"],
        "partial_rotary_factor": cfg["partial_rotary_factor"],
    }
    return {FULL: full, LINEAR: None}


def transformer_block(cfg: dict, layer_type: str) -> PreNormBlock:
    """One pre-norm block around a Gated DeltaNet (``linear_attention``) or gated attention (``full_attention``)."""
    dtype, emb_dim = cfg["dtype"], cfg["emb_dim"]
    norm = partial(RMSNorm, eps=cfg["rms_norm_eps"], unit_offset=True, dtype=dtype)
    if layer_type == LINEAR:
        att = GatedDeltaNet(
            emb_dim,
            cfg["linear_num_key_heads"],
            cfg["linear_num_value_heads"],
            cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"],
            cfg["linear_conv_kernel_dim"],
            eps=cfg["rms_norm_eps"],
            activation=cfg["activation"],
            dtype=dtype,
        )
    elif layer_type == FULL:
        att = GroupedQueryAttention(
            emb_dim,
            cfg["n_heads"],
            cfg["n_kv_heads"],
            cfg["head_dim"],
            qk_norm="head",
            norm=norm,
            output_gate=True,
            bias=cfg["attention_bias"],
            dtype=dtype,
        )
    else:
        raise ValueError(f"layer type {layer_type!r} is not one of Qwen3.5's ({LINEAR}, {FULL})")
    ff = GatedMLP(emb_dim, cfg["hidden_dim"], activation=cfg["activation"], dtype=dtype)
    return PreNormBlock(att, ff, partial(norm, emb_dim), layer_type)


class Qwen3_5Model(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        blocks = [transformer_block(cfg, t) for t in cfg["layer_types"]]
        final_norm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], unit_offset=True, dtype=cfg["dtype"])
        super().__init__(cfg, blocks, final_norm)

    def rope_parameters(self) -> dict[str, dict | None]:
        return rope_parameters(self.cfg)
