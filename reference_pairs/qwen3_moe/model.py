"""Qwen3-MoE from scratch (Qwen team, "Qwen3 Technical Report", arXiv:2505.09388; the book's ch. 10 MoE
and ch. 11 architecture tour).

Qwen3's decoder (:mod:`reference_pairs.qwen3.model`: pre-norm, per-head Q/K RMSNorm, GQA, RoPE)
with the feed-forward of most layers a mixture of experts
(:class:`~reference_pairs.common.moe.SparseMoE`): the router's logits ``gate(x)``, softmax over every
expert, the top ``num_experts_per_tok`` (renormalised over those when ``norm_topk_prob``), each
chosen expert a SwiGLU of width ``moe_intermediate_size``, their outputs summed with the weights.
Layer ``i`` is sparse unless it is in ``mlp_only_layers``, and only when ``(i + 1) %
decoder_sparse_step == 0``; the other layers keep a dense SwiGLU of width ``hidden_dim``.

``cfg`` keys: Qwen3's, plus ``num_experts, num_experts_per_tok, moe_intermediate_size,
norm_topk_prob, decoder_sparse_step, mlp_only_layers``.
"""

from __future__ import annotations

from ..common.blocks import PreNormBlock
from ..common.decoder import DecoderModel
from ..common.mlp import GatedMLP
from ..common.moe import SparseMoE
from ..qwen3.model import attention, norm, rope_parameters


def is_sparse(cfg: dict, i: int) -> bool:
    """Whether layer ``i``'s feed-forward is the mixture of experts (``Qwen3MoeDecoderLayer``)."""
    return i not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0


def feed_forward(cfg: dict, i: int):
    if is_sparse(cfg, i):
        return SparseMoE(
            cfg["emb_dim"],
            cfg["moe_intermediate_size"],
            cfg["num_experts"],
            cfg["num_experts_per_tok"],
            norm_topk_prob=cfg["norm_topk_prob"],
            activation="silu",
            dtype=cfg["dtype"],
        )
    return GatedMLP(cfg["emb_dim"], cfg["hidden_dim"], activation="silu", dtype=cfg["dtype"])


class Qwen3MoeModel(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        blocks = [
            PreNormBlock(attention(cfg, t), feed_forward(cfg, i), norm(cfg), t)
            for i, t in enumerate(cfg["layer_types"])
        ]
        super().__init__(cfg, blocks, norm(cfg)())

    def rope_parameters(self) -> dict[str, dict]:
        return rope_parameters(self.cfg)
