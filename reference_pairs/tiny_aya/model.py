"""Tiny Aya from scratch (Cohere Labs, "Tiny Aya: Bridging Scale and Multilingual Depth", 2026,
arXiv:2603.11510; the Command R / Cohere 2 architecture of ``transformers.Cohere2ForCausalLM``).

What distinguishes it from Llama-style models:

* parallel blocks (GPT-J, Wang & Komatsuzaki 2021; PaLM, arXiv:2204.02311 sec. 2): one norm,
  then attention and the FFN both read the same normalized input, ``h = N(x)``,
  ``y = x + A(h) + F(h)`` (``Cohere2DecoderLayer``); the FFN never sees this layer's attention;
* the norm is a LayerNorm with a weight and no bias: it subtracts the mean (Ba et al. 2016), it is
  not an RMSNorm, computed in float32 (``Cohere2LayerNorm``);
* RoPE (Su et al. 2021, arXiv:2104.09864) with even/odd pairing, dimension ``2i`` rotating with
  ``2i + 1`` (the RoFormer paper's layout; ``Cohere2RotaryEmbedding`` repeat-interleaves the
  angles), cos/sin rounded to the activation dtype and the rotation run in float32, applied on
  ``sliding_attention`` layers only: ``full_attention`` layers use no positional rotation at all
  ("NoPE") but keep the causal mask (``Cohere2Attention``);
* logits are ``out_head(final_norm(x)) * logit_scale`` (``Cohere2ForCausalLM.forward``), and the
  output head is tied to the token embedding in the released models.

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, layer_norm_eps, sliding_window, layer_types, attention_bias, tie_word_embeddings,
rope_type ("default" only), rope_base, logit_scale, dtype``.
"""

from __future__ import annotations

from functools import partial

from ..common.attention import GroupedQueryAttention
from ..common.blocks import ParallelBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL, SLIDING
from ..common.mlp import GatedMLP
from ..common.norms import LayerNorm


def rope_parameters(cfg: dict) -> dict[str, dict | None]:
    """Default RoPE on sliding layers, none on full layers (NoPE)."""
    if cfg["rope_type"] != "default":
        raise ValueError(f"rope_type {cfg['rope_type']!r} is not supported (Tiny Aya uses 'default')")
    return {SLIDING: {"rope_type": "default", "rope_theta": cfg["rope_base"]}, FULL: None}


def transformer_block(cfg: dict, layer_type: str) -> ParallelBlock:
    """One parallel block; ``layer_type`` decides the window (and, through its RoPE table, the RoPE)."""
    dtype, emb_dim = cfg["dtype"], cfg["emb_dim"]
    att = GroupedQueryAttention(
        emb_dim,
        cfg["n_heads"],
        cfg["n_kv_heads"],
        cfg["head_dim"],
        sliding_window=cfg["sliding_window"] if layer_type == SLIDING else None,
        interleaved_rope=True,
        rotate_in_float32=True,
        bias=cfg["attention_bias"],
        dtype=dtype,
    )
    ff = GatedMLP(emb_dim, cfg["hidden_dim"], activation="silu", dtype=dtype)
    return ParallelBlock(att, ff, partial(LayerNorm, emb_dim, eps=cfg["layer_norm_eps"], dtype=dtype), layer_type)


class TinyAyaModel(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``, already
    multiplied by ``logit_scale``."""

    def __init__(self, cfg: dict):
        blocks = [transformer_block(cfg, t) for t in cfg["layer_types"]]
        final_norm = LayerNorm(cfg["emb_dim"], eps=cfg["layer_norm_eps"], dtype=cfg["dtype"])
        super().__init__(cfg, blocks, final_norm, logit_scale=cfg["logit_scale"])

    def rope_parameters(self) -> dict[str, dict | None]:
        return rope_parameters(self.cfg)
