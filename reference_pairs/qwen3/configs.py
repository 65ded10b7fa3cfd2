"""Built-in Qwen3 (dense) configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoints' config.json (Qwen/Qwen3-0.6B and Qwen/Qwen3-8B): vocab
151936, 40960 positions, ``rope_theta`` 1000000, ``rms_norm_eps`` 1e-6, ``head_dim`` 128 (explicit:
0.6B has hidden 1024 / 16 heads = 64, so the attention scale is 128**-0.5, not 64**-0.5), no biases,
SiLU, ``use_sliding_window`` false. 0.6B: hidden 1024, 28 layers, 16 heads, 8 KV heads,
intermediate 3072, tied head. 8B: hidden 4096, 36 layers, 32 heads, 8 KV heads, intermediate
12288, untied head. Long context (the model cards): YaRN ``{"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}`` for 131072 positions.

``rope_yarn`` is None (plain RoPE) or the YaRN values in book names: ``factor``,
``original_context_length`` (``original_max_position_embeddings``), ``beta_fast``, ``beta_slow``,
``attention_factor`` (None: Transformers' ``0.1 ln(factor) + 1``). ``sliding_window`` is None unless
``use_sliding_window``; then ``layer_types`` says which layers use it (Transformers: layers from
``max_window_layers`` on).
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL, SLIDING

#: Qwen3's long-context recipe (model cards), in book names
QWEN3_YARN = dict(factor=4.0, original_context_length=32_768, beta_fast=32.0, beta_slow=1.0, attention_factor=None)


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
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("layer_types", [FULL] * cfg["n_layers"])
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """3 layers, emb 32, GQA 4 query / 2 KV heads, head_dim 16 (not emb/heads = 8), tied head, plain RoPE."""
    return _base(
        vocab_size=257,
        context_length=4096,
        emb_dim=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=n_layers or 3,
        hidden_dim=48,
        head_dim=16,
        tie_word_embeddings=True,
    )


def yarn(n_layers: int | None = None) -> dict:
    """``tiny`` untied (as the large models), with YaRN factor 4 over 64 original positions.

    Qwen3's factor, but 64 original positions instead of 32768, so at head_dim 16 and theta 1e6 the
    ramp band is frequencies 0..2 and every lower one is divided by 4 within 16 tokens (with 32768
    only frequencies turning by a hundredth of a radian would move: visible in float32, no margin).
    """
    return {
        **tiny(n_layers),
        "tie_word_embeddings": False,
        "context_length": 256,
        "rope_yarn": {**QWEN3_YARN, "original_context_length": 64},
    }


def swa(n_layers: int | None = None) -> dict:
    """``tiny`` with ``use_sliding_window``: window 4 from ``max_window_layers`` = 1 on (layer 0 full, the rest sliding)."""
    cfg = tiny(n_layers)
    return {**cfg, "sliding_window": 4, "layer_types": [FULL] + [SLIDING] * (cfg["n_layers"] - 1)}


def shape_0_6b(n_layers: int | None = None) -> dict:
    """Qwen3 0.6B widths: emb 1024, 16 query / 8 KV heads, head_dim 128, FFN 3072, tied; ``n_layers`` default 2 (28 released)."""
    return _base(
        emb_dim=1024,
        n_heads=16,
        n_kv_heads=8,
        n_layers=n_layers or 2,
        hidden_dim=3072,
        head_dim=128,
        tie_word_embeddings=True,
    )


def shape_8b(n_layers: int | None = None) -> dict:
    """Qwen3 8B widths: emb 4096, 32 query / 8 KV heads, head_dim 128, FFN 12288, untied; ``n_layers`` default 2 (36 released)."""
    return _base(emb_dim=4096, n_heads=32, n_kv_heads=8, n_layers=n_layers or 2, hidden_dim=12_288, head_dim=128)


CONFIGS = {"tiny": tiny, "yarn": yarn, "swa": swa, "0.6b-shape": shape_0_6b, "8b-shape": shape_8b}
