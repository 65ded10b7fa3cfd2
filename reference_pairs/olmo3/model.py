"""OLMo 3 from scratch (Allen AI, "OLMo 3", 2025; the OLMo 2 paper, arXiv:2501.00656, for post-norm and QK-norm).

What distinguishes it from Llama-style models:

* post-norm blocks: ``u = x + N_a(attn(x))``, ``y = u + N_f(ffn(u))`` (the norm acts on the branch
  output, the residual sum is never normalized);
* Q/K RMSNorm over the whole projection (``n_heads * head_dim`` wide) *before* the head split;
* ``layer_types``: sliding-window layers and full-attention layers (3:1 in the released models);
* RoPE per layer type: YaRN on the layer types listed in ``cfg["rope_scaled_layer_types"]``
  (Transformers 5 puts a checkpoint's ``rope_scaling`` on ``full_attention`` only), default RoPE
  elsewhere; cos/sin stay in float32 and the rotation runs in float32 (``Olmo3RotaryEmbedding``).

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, rms_norm_eps, sliding_window, layer_types, attention_bias, tie_word_embeddings,
rope_base, rope_local_base, rope_type ("default" | "yarn"), rope_scaled_layer_types, rope_factor,
rope_orig_max, beta_fast, beta_slow, rope_attention_factor (None: 0.1 ln(factor) + 1), dtype``.
"""

from __future__ import annotations

from functools import partial

from ..common.attention import GroupedQueryAttention
from ..common.blocks import PostNormBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL, SLIDING
from ..common.mlp import GatedMLP
from ..common.norms import RMSNorm


def rope_parameters(cfg: dict) -> dict[str, dict]:
    """Transformers-5 rope dict per layer type: YaRN where ``rope_scaled_layer_types`` says, default elsewhere."""
    params = {}
    for layer_type in (SLIDING, FULL):
        base = cfg["rope_local_base"] if layer_type == SLIDING else cfg["rope_base"]
        params[layer_type] = {"rope_type": "default", "rope_theta": base}
        if cfg["rope_type"] == "yarn" and layer_type in cfg["rope_scaled_layer_types"]:
            params[layer_type] = {
                "rope_type": "yarn",
                "rope_theta": base,
                "factor": cfg["rope_factor"],
                "original_max_position_embeddings": cfg["rope_orig_max"],
                "beta_fast": cfg["beta_fast"],
                "beta_slow": cfg["beta_slow"],
            }
            if cfg["rope_attention_factor"] is not None:
                params[layer_type]["attention_factor"] = cfg["rope_attention_factor"]
    return params


def transformer_block(cfg: dict, layer_type: str) -> PostNormBlock:
    """One post-norm block; ``layer_type`` decides the window (and, through its RoPE table, the RoPE)."""
    dtype, emb_dim = cfg["dtype"], cfg["emb_dim"]
    att = GroupedQueryAttention(
        emb_dim,
        cfg["n_heads"],
        cfg["n_kv_heads"],
        cfg["head_dim"],
        qk_norm="projection",
        norm=partial(RMSNorm, eps=cfg["rms_norm_eps"], dtype=dtype),
        sliding_window=cfg["sliding_window"] if layer_type == SLIDING else None,
        bias=cfg["attention_bias"],
        dtype=dtype,
    )
    ff = GatedMLP(emb_dim, cfg["hidden_dim"], activation="silu", dtype=dtype)
    return PostNormBlock(att, ff, partial(RMSNorm, emb_dim, eps=cfg["rms_norm_eps"], dtype=dtype), layer_type)


class Olmo3Model(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        blocks = [transformer_block(cfg, t) for t in cfg["layer_types"]]
        final_norm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], dtype=cfg["dtype"])
        super().__init__(cfg, blocks, final_norm, rope_in_float32=True)

    def rope_parameters(self) -> dict[str, dict]:
        return rope_parameters(self.cfg)
