"""Built-in OLMo 3 configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoints' config.json (allenai/Olmo-3-1025-7B and -32B): vocab
100278, 64K context, rms_norm_eps 1e-6, sliding window 4096 on 3 of every 4 layers, rope_theta
500000 with YaRN (factor 8, original 8192 positions, beta_fast 32, beta_slow 1, attention_factor
1.2079441541679836) on full-attention layers.
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL, SLIDING, every_nth_full  # noqa: F401 (re-exported)

YARN = dict(
    rope_type="yarn",
    rope_factor=8.0,
    rope_orig_max=8192,
    beta_fast=32.0,
    beta_slow=1.0,
    rope_attention_factor=1.2079441541679836,
)


def _base(**kw) -> dict:
    cfg = dict(
        attention_bias=False,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_type="default",
        rope_base=500_000.0,
        rope_local_base=500_000.0,
        rope_scaled_layer_types=[FULL],
        rope_factor=1.0,
        rope_orig_max=None,
        beta_fast=32.0,
        beta_slow=1.0,
        rope_attention_factor=None,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("layer_types", every_nth_full(cfg["n_layers"], 4))  # OLMo 3: every 4th layer full
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """4 layers (3 sliding + 1 full), window 4, GQA 4 query / 2 KV heads, head_dim 8, default RoPE."""
    n = n_layers or 4
    return _base(
        vocab_size=257,
        context_length=4096,
        emb_dim=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=n,
        hidden_dim=64,
        head_dim=8,
        sliding_window=4,
    )


def yarn(n_layers: int | None = None) -> dict:
    """``tiny`` with OLMo 3's YaRN on the full-attention layer (64K context = 8 x 8192)."""
    return {**tiny(n_layers), **YARN, "context_length": 65_536}


def mha(n_layers: int | None = None) -> dict:
    """``tiny`` with as many KV heads as query heads (MHA, as in OLMo 3 7B)."""
    return {**tiny(n_layers), "n_kv_heads": 4}


def shape_7b(n_layers: int | None = None) -> dict:
    """OLMo 3 7B widths: emb 4096, 32 heads (MHA), head_dim 128, FFN 11008; ``n_layers`` default 2."""
    return _base(
        vocab_size=100_278,
        context_length=65_536,
        emb_dim=4096,
        n_heads=32,
        n_kv_heads=32,
        n_layers=n_layers or 2,
        hidden_dim=11_008,
        head_dim=128,
        sliding_window=4096,
        **YARN,
    )


def shape_32b(n_layers: int | None = None) -> dict:
    """OLMo 3 32B widths: emb 5120, 40 query / 8 KV heads, head_dim 128, FFN 27648; ``n_layers`` default 2."""
    return _base(
        vocab_size=100_278,
        context_length=65_536,
        emb_dim=5120,
        n_heads=40,
        n_kv_heads=8,
        n_layers=n_layers or 2,
        hidden_dim=27_648,
        head_dim=128,
        sliding_window=4096,
        **YARN,
    )


CONFIGS = {"tiny": tiny, "yarn": yarn, "mha": mha, "7b-shape": shape_7b, "32b-shape": shape_32b}
