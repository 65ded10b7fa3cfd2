"""Qwen3 (dense) from scratch (Qwen team, "Qwen3 Technical Report", arXiv:2505.09388; the book's ch. 11).

A Llama-style pre-norm decoder, every block

    h = x + att(norm1(x))          # GQA; Q/K RMSNorm per head, after the head split, before RoPE
    y = h + ff(norm2(h))           # SwiGLU

then ``final_norm`` and ``out_head`` (the embedding's Parameter itself on the small, tied models).
What distinguishes it from Llama 3: the Q/K norm over ``head_dim`` (one weight shared by every head;
OLMo 3 normalises the whole projection instead), an explicit ``head_dim`` that need not be
``emb_dim / n_heads`` (the attention scale is ``head_dim**-0.5``), theta 1e6, optional YaRN, and
``use_sliding_window`` layers (off in every released config). In bfloat16 it rounds as Llama:
RMSNorm casts ``x_hat`` before the weight multiply, cos/sin are rounded to bf16 and the rotation
runs in bf16 (``Qwen3RMSNorm``, ``Qwen3RotaryEmbedding``).

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, rms_norm_eps, attention_bias, tie_word_embeddings, rope_base, rope_yarn`` (None or
``factor, original_context_length, beta_fast, beta_slow, attention_factor``), ``sliding_window``
(None, or the window of the ``sliding_attention`` layers), ``layer_types, dtype``.
"""

from __future__ import annotations

from functools import partial

from ..common.attention import GroupedQueryAttention
from ..common.blocks import PreNormBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL, SLIDING
from ..common.mlp import GatedMLP
from ..common.norms import RMSNorm
from ..common.rope import default_or_yarn


def rope_parameters(cfg: dict) -> dict[str, dict]:
    """The one Transformers-5 rope dict (YaRN if ``cfg["rope_yarn"]``), for both layer types."""
    params = default_or_yarn(cfg["rope_base"], cfg["rope_yarn"])
    return {FULL: params, SLIDING: params}


def attention(cfg: dict, layer_type: str) -> GroupedQueryAttention:
    """GQA with Qwen3's per-head Q/K RMSNorm; the window on ``sliding_attention`` layers."""
    return GroupedQueryAttention(
        cfg["emb_dim"],
        cfg["n_heads"],
        cfg["n_kv_heads"],
        cfg["head_dim"],
        qk_norm="head",
        norm=partial(RMSNorm, eps=cfg["rms_norm_eps"], cast_first=True, dtype=cfg["dtype"]),
        sliding_window=cfg["sliding_window"] if layer_type == SLIDING else None,
        bias=cfg["attention_bias"],
        dtype=cfg["dtype"],
    )


def norm(cfg: dict) -> partial:
    """Qwen3's RMSNorm of the residual stream (Llama's cast-then-weight order)."""
    return partial(RMSNorm, cfg["emb_dim"], eps=cfg["rms_norm_eps"], cast_first=True, dtype=cfg["dtype"])


def transformer_block(cfg: dict, layer_type: str) -> PreNormBlock:
    """One pre-norm block: ``x + att(norm1(x))``, then ``+ ff(norm2(.))``."""
    ff = GatedMLP(cfg["emb_dim"], cfg["hidden_dim"], activation="silu", dtype=cfg["dtype"])
    return PreNormBlock(attention(cfg, layer_type), ff, norm(cfg), layer_type)


class Qwen3Model(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        blocks = [transformer_block(cfg, t) for t in cfg["layer_types"]]
        super().__init__(cfg, blocks, norm(cfg)())

    def rope_parameters(self) -> dict[str, dict]:
        return rope_parameters(self.cfg)
