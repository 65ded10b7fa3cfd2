"""Built-in Qwen3-MoE configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoint's config.json (Qwen/Qwen3-30B-A3B): vocab 151936, 40960
positions, hidden 2048, 48 layers, 32 query / 4 KV heads, ``head_dim`` 128, 128 experts of width
(``moe_intermediate_size``) 768 with 8 per token, ``norm_topk_prob`` true, ``decoder_sparse_step`` 1,
``mlp_only_layers`` [] (every layer sparse; ``intermediate_size`` 6144 is then unused),
``rope_theta`` 1000000, ``rms_norm_eps`` 1e-6, untied head, no biases, SiLU.

The attention and RoPE keys are Qwen3's (:mod:`reference_pairs.qwen3.configs`); the MoE keys are the
book's Qwen3-MoE notebook's: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, plus
``norm_topk_prob``, ``decoder_sparse_step`` and ``mlp_only_layers`` (which layers are sparse).
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=151_936,
        context_length=40_960,
        rope_base=1_000_000.0,
        rope_yarn=None,
        rms_norm_eps=1e-6,
        attention_bias=False,
        tie_word_embeddings=False,
        sliding_window=None,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("layer_types", [FULL] * cfg["n_layers"])
    return cfg


def tiny_moe(n_layers: int | None = None) -> dict:
    """3 layers (layer 1 a dense MLP, ``mlp_only_layers`` [1]), 8 experts of width 16, top-2 renormalised; GQA 4/2, head_dim 16."""
    n = n_layers or 3
    return _base(
        vocab_size=257,
        context_length=4096,
        emb_dim=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=n,
        hidden_dim=48,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[1] if n > 1 else [],
    )


def shape_30b_a3b(n_layers: int | None = None) -> dict:
    """Qwen3-30B-A3B widths: emb 2048, 32 query / 4 KV heads, head_dim 128, 128 experts (top-8) of 768; ``n_layers`` default 2 (48 released)."""
    return _base(
        emb_dim=2048,
        n_heads=32,
        n_kv_heads=4,
        n_layers=n_layers or 2,
        hidden_dim=6144,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    )


CONFIGS = {"tiny-moe": tiny_moe, "30b-a3b-shape": shape_30b_a3b}
