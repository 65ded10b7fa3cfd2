"""Built-in Mistral configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoint's config.json (mistralai/Mistral-7B-v0.1): vocab 32000,
context 32768 (``max_position_embeddings``), hidden 4096, 32 layers, 32 heads and 8 KV heads,
head_dim 128, intermediate 14336, ``sliding_window`` 4096, ``rope_theta`` 10000, ``rms_norm_eps``
1e-5, ``tie_word_embeddings`` false, no biases, SiLU. Later releases (v0.2, v0.3) set
``sliding_window`` null and theta 1e6: the same family with ``sliding_window=None``.

A Mistral is a Llama whose every layer attends through a sliding window (``MistralModel`` builds a
sliding-window mask for every layer whenever ``sliding_window`` is set), so ``layer_types`` is
derived: every layer ``sliding_attention`` with a window, ``full_attention`` without one.
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL, SLIDING


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=32_000,
        context_length=32_768,
        rope_base=10_000.0,
        rope_freq=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=4096,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg["layer_types"] = [FULL if cfg["sliding_window"] is None else SLIDING] * cfg["n_layers"]
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """2 layers, emb 48, GQA 4 query / 2 KV heads of 16, FFN 96, window 5 on every layer (20 tokens by default), untied head."""
    return _base(
        vocab_size=257,
        context_length=4096,
        emb_dim=48,
        n_heads=4,
        n_kv_heads=2,
        n_layers=n_layers or 2,
        hidden_dim=96,
        head_dim=16,
        sliding_window=5,
    )


def shape_7b(n_layers: int | None = None) -> dict:
    """Mistral 7B v0.1 widths: emb 4096, 32 query / 8 KV heads of 128, FFN 14336, window 4096, untied; ``n_layers`` default 2 (32 released)."""
    return _base(emb_dim=4096, n_heads=32, n_kv_heads=8, n_layers=n_layers or 2, hidden_dim=14_336, head_dim=128)


CONFIGS = {"tiny": tiny, "7b-shape": shape_7b}
