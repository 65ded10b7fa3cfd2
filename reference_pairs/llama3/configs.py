"""Built-in Llama 3.1 and 3.2 configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoints' config.json (meta-llama/Llama-3.2-1B and
meta-llama/Llama-3.2-3B): vocab 128256, context 131072 (``max_position_embeddings``),
``rope_theta`` 500000 with ``rope_scaling`` ``{"rope_type": "llama3", "factor": 32.0,
"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``,
``rms_norm_eps`` 1e-5, ``tie_word_embeddings`` true, no biases, SiLU. 1B: hidden 2048, 16 layers,
32 heads, 8 KV heads, head_dim 64, intermediate 8192. 3B: hidden 3072, 28 layers, 24 heads, 8 KV
heads, head_dim 128, intermediate 8192. The book (shared/seeds, ch. 11.5) gives the same 1B numbers.
Llama 3.1 8B (meta-llama/Llama-3.1-8B config.json): the same vocab, context, theta and eps, the
llama3 scaling with ``factor`` 8.0 (the other three values as above), hidden 4096, 32 layers, 32
heads, 8 KV heads, head_dim 128, intermediate 14336, and an *untied* head.

``layer_types`` (every layer ``full_attention``) is carried because the shared decoder skeleton
(:class:`reference_pairs.common.decoder.DecoderModel`) builds one block per entry and checks its
length against ``n_layers``; Llama has one layer type.
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL

#: Llama 3.2 frequency scaling as released (book names; ``original_context_length`` is
#: Transformers' ``original_max_position_embeddings``).
LLAMA32_ROPE_FREQ = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=8192)
#: Llama 3.1's: the same band, factor 8
LLAMA31_ROPE_FREQ = dict(LLAMA32_ROPE_FREQ, factor=8.0)


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=128_256,
        context_length=131_072,
        rope_base=500_000.0,
        rope_freq=dict(LLAMA32_ROPE_FREQ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg["layer_types"] = [FULL] * cfg["n_layers"]
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """2 layers, emb 48, GQA 4 query / 2 KV heads, head_dim 16, tied head, Llama 3 RoPE scaling seen in 16 tokens.

    The real theta 500000 and factor 32, but ``original_context_length`` 256 instead of 8192, so
    at head_dim 16 the wavelengths 6.3, 32, 167, 860, ... straddle the band [64, 256]: one
    frequency is blended, five are divided by 32, and at position 15 the blended one's angle moves
    by about 0.45 rad. With 8192 only frequencies that turn by under 0.03 rad in 16 tokens would
    be touched: visible in float32, but no margin. ``emb_dim`` 48 differs from ``n_heads * head_dim`` 64
    so the two cannot be confused.
    """
    return _base(
        vocab_size=257,
        context_length=8192,
        emb_dim=48,
        n_heads=4,
        n_kv_heads=2,
        n_layers=n_layers or 2,
        hidden_dim=96,
        head_dim=16,
        rope_freq=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=256),
    )


def tiny_untied(n_layers: int | None = None) -> dict:
    """``tiny`` as Llama 3.1 8B is laid out: untied head, llama3 scaling factor 8 (band [64, 256] as in ``tiny``)."""
    cfg = tiny(n_layers)
    cfg.update(tie_word_embeddings=False, rope_freq=dict(cfg["rope_freq"], factor=8.0))
    return cfg


def shape_1b(n_layers: int | None = None) -> dict:
    """Llama 3.2 1B widths: emb 2048, 32 query / 8 KV heads, head_dim 64, FFN 8192; ``n_layers`` default 2 (16 released)."""
    return _base(emb_dim=2048, n_heads=32, n_kv_heads=8, n_layers=n_layers or 2, hidden_dim=8192, head_dim=64)


def shape_3b(n_layers: int | None = None) -> dict:
    """Llama 3.2 3B widths: emb 3072, 24 query / 8 KV heads, head_dim 128, FFN 8192; ``n_layers`` default 2 (28 released)."""
    return _base(emb_dim=3072, n_heads=24, n_kv_heads=8, n_layers=n_layers or 2, hidden_dim=8192, head_dim=128)


def shape_8b(n_layers: int | None = None) -> dict:
    """Llama 3.1 8B widths: emb 4096, 32 query / 8 KV heads, head_dim 128, FFN 14336, untied head, llama3 factor 8; ``n_layers`` default 2 (32 released)."""
    return _base(
        emb_dim=4096,
        n_heads=32,
        n_kv_heads=8,
        n_layers=n_layers or 2,
        hidden_dim=14_336,
        head_dim=128,
        rope_freq=dict(LLAMA31_ROPE_FREQ),
        tie_word_embeddings=False,
    )


CONFIGS = {"tiny": tiny, "tiny-untied": tiny_untied, "1b-shape": shape_1b, "3b-shape": shape_3b, "8b-shape": shape_8b}
