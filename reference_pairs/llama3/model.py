"""Llama from scratch: Llama 3.1/3.2 (Meta, "The Llama 3 Herd of Models", arXiv:2407.21783; the book's
ch. 11), and with the same code Llama 2 (arXiv:2307.09288: MHA, plain RoPE) and Mistral 7B
(arXiv:2310.06825: a sliding window on every layer).

A pre-norm decoder: every block is

    h = x + att(norm1(x))          # GQA with half-split RoPE, Llama 3 frequency scaling
    y = h + ff(norm2(h))           # SwiGLU

then ``final_norm`` and ``out_head``, which is the *same* Parameter as ``tok_emb.weight`` when
``cfg["tie_word_embeddings"]`` (the 1B and 3B models). No biases anywhere, no dropout. In bfloat16
Llama rounds early: RMSNorm casts ``x_hat`` to bf16 before the weight multiply (``LlamaRMSNorm``),
and cos/sin are rounded to bf16 and the rotation runs in bf16 (``LlamaRotaryEmbedding``); Mistral's
norm and rotary embedding round the same way.

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, rope_base, rope_freq`` (None for plain RoPE, or a dict with ``factor,
low_freq_factor, high_freq_factor, original_context_length``), ``rms_norm_eps,
tie_word_embeddings, layer_types`` (``"full_attention"``, or ``"sliding_attention"`` with
``sliding_window``), ``dtype``; Mistral's cfg adds ``sliding_window`` (None: full attention).
"""

from __future__ import annotations

from functools import partial

from ..common.attention import GroupedQueryAttention
from ..common.blocks import PreNormBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL, SLIDING
from ..common.mlp import GatedMLP
from ..common.norms import RMSNorm


def rope_parameters(cfg: dict) -> dict[str, dict]:
    """Llama 3 scaled RoPE if ``cfg["rope_freq"]``, else plain RoPE; one RoPE for every layer type."""
    freq = cfg["rope_freq"]
    if freq is None:
        rope = {"rope_type": "default", "rope_theta": cfg["rope_base"]}
    else:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg["rope_base"],
            "factor": float(freq["factor"]),
            "low_freq_factor": float(freq["low_freq_factor"]),
            "high_freq_factor": float(freq["high_freq_factor"]),
            "original_max_position_embeddings": int(freq["original_context_length"]),
        }
    return {FULL: rope, SLIDING: rope}


def transformer_block(cfg: dict, layer_type: str = FULL) -> PreNormBlock:
    """One pre-norm block: ``x + att(norm1(x))``, then ``+ ff(norm2(.))``; a sliding layer masks keys
    ``sliding_window`` or more positions back (Mistral)."""
    dtype, emb_dim = cfg["dtype"], cfg["emb_dim"]
    window = cfg["sliding_window"] if layer_type == SLIDING else None
    att = GroupedQueryAttention(
        emb_dim, cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], sliding_window=window, dtype=dtype
    )
    ff = GatedMLP(emb_dim, cfg["hidden_dim"], activation="silu", dtype=dtype)
    return PreNormBlock(
        att, ff, partial(RMSNorm, emb_dim, eps=cfg["rms_norm_eps"], cast_first=True, dtype=dtype), layer_type
    )


class Llama3Model(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        types = cfg["layer_types"]
        if any(t not in (FULL, SLIDING) for t in types) or len(types) != cfg["n_layers"]:
            raise ValueError(f"Llama has n_layers full_attention or sliding_attention layers, got layer_types={types}")
        if SLIDING in types and not cfg.get("sliding_window"):
            raise ValueError("sliding_attention layers need a sliding_window")
        blocks = [transformer_block(cfg, t) for t in types]
        final_norm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], cast_first=True, dtype=cfg["dtype"])
        super().__init__(cfg, blocks, final_norm)

    def rope_parameters(self) -> dict[str, dict]:
        return rope_parameters(self.cfg)
