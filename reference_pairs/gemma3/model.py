"""Gemma 3 (text) from scratch (Gemma Team, "Gemma 3 Technical Report", arXiv:2503.19786; the
Gemma 2 report, arXiv:2408.00118, for the sandwich norms and soft-capping).

What distinguishes it from Llama-style models:

* token embeddings times ``sqrt(emb_dim)``, the factor rounded to the model dtype first
  (``Gemma3TextScaledWordEmbedding``: in bfloat16 ``sqrt(1152)`` is 34.0, not 33.94);
* RMSNorm with ``(1 + w)``, computed in float32 and cast last, four per block: before and after
  attention, before and after the feed-forward network (a sandwich);
* per-head Q/K RMSNorm (also ``(1 + w)``), normalising q/k after the heads are moved first;
* attention scale ``query_pre_attn_scalar ** -0.5`` (not necessarily ``head_dim ** -0.5``);
* GeGLU feed-forward (``gelu_pytorch_tanh``);
* sliding-window and full layers 5:1 (``layer_types``), each type with its own RoPE: theta 10000
  on sliding layers, 1e6 on full layers, linear scaling (``rope_scaling_factor``) on full layers
  only; cos/sin rounded to the activation dtype (``Gemma3RotaryEmbedding``);
* an optional final logit soft-cap ``cap * tanh(logits / cap)``; the tied head.

Transformers 5.24's ``Gemma3Attention`` stores ``attn_logit_softcapping`` but never applies it, so
neither does this model (a config setting it is refused by the pair).

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, hidden_activation, rms_norm_eps, query_pre_attn_scalar, sliding_window, layer_types,
rope_base, rope_local_base, rope_scaling_factor (None: no scaling), final_logit_softcap (None: none),
attention_bias, tie_word_embeddings, dtype``.
"""

from __future__ import annotations

from functools import partial

from ..common.attention import GroupedQueryAttention
from ..common.blocks import SandwichBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL, SLIDING
from ..common.mlp import GatedMLP
from ..common.norms import RMSNorm


def rope_parameters(cfg: dict) -> dict[str, dict]:
    """Transformers-5 rope dict per layer type: plain RoPE on sliding layers, linear scaling on full
    layers when ``rope_scaling_factor`` is set (as Transformers assigns a checkpoint's ``rope_scaling``)."""
    full = {"rope_type": "default", "rope_theta": cfg["rope_base"]}
    if cfg["rope_scaling_factor"] is not None:
        full = {"rope_type": "linear", "rope_theta": cfg["rope_base"], "factor": cfg["rope_scaling_factor"]}
    return {SLIDING: {"rope_type": "default", "rope_theta": cfg["rope_local_base"]}, FULL: full}


def gemma_norm(cfg: dict):
    """Gemma 3's RMSNorm factory: ``(1 + w)`` in float32, cast last."""
    return partial(RMSNorm, eps=cfg["rms_norm_eps"], unit_offset=True, dtype=cfg["dtype"])


def transformer_block(cfg: dict, layer_type: str) -> SandwichBlock:
    """One sandwich block; ``layer_type`` decides the window (and, through its RoPE table, the RoPE)."""
    dtype, emb_dim, norm = cfg["dtype"], cfg["emb_dim"], gemma_norm(cfg)
    att = GroupedQueryAttention(
        emb_dim,
        cfg["n_heads"],
        cfg["n_kv_heads"],
        cfg["head_dim"],
        scale=cfg["query_pre_attn_scalar"] ** -0.5,
        qk_norm="head",
        qk_norm_heads_first=True,
        norm=norm,
        sliding_window=cfg["sliding_window"] if layer_type == SLIDING else None,
        bias=cfg["attention_bias"],
        dtype=dtype,
    )
    ff = GatedMLP(emb_dim, cfg["hidden_dim"], activation=cfg["hidden_activation"], dtype=dtype)
    return SandwichBlock(att, ff, partial(norm, emb_dim), layer_type)


class Gemma3Model(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        blocks = [transformer_block(cfg, t) for t in cfg["layer_types"]]
        final_norm = gemma_norm(cfg)(cfg["emb_dim"])
        super().__init__(
            cfg, blocks, final_norm, emb_scale=cfg["emb_dim"] ** 0.5, final_softcap=cfg["final_logit_softcap"]
        )

    def rope_parameters(self) -> dict[str, dict]:
        return rope_parameters(self.cfg)
