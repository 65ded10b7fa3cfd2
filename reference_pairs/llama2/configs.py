"""Built-in Llama 2 configs as named data, in the book's cfg vocabulary (``LLAMA2_CONFIG_7B``, ch. 11).

Real values from the released checkpoint's config.json (meta-llama/Llama-2-7b-hf): vocab 32000,
context 4096 (``max_position_embeddings``), hidden 4096, 32 layers, 32 heads and 32 KV heads (MHA),
head_dim 128, intermediate 11008, ``rms_norm_eps`` 1e-5, ``rope_theta`` 10000 with ``rope_scaling``
null, ``tie_word_embeddings`` false, no biases, SiLU. The book's ``LLAMA2_CONFIG_7B`` gives the same
widths. What Llama 3 changed (GQA, theta 500000, the llama3 frequency scaling, a larger vocabulary)
is all data: the model is the llama3 family's.
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=32_000,
        context_length=4096,
        rope_base=10_000.0,
        rope_freq=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg["n_kv_heads"] = cfg["n_heads"]  # multi-head attention: one K/V head per query head
    cfg["layer_types"] = [FULL] * cfg["n_layers"]
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """2 layers, emb 48, MHA with 4 heads of 16, FFN 96, plain RoPE with theta 10000, untied head."""
    return _base(vocab_size=257, emb_dim=48, n_heads=4, n_layers=n_layers or 2, hidden_dim=96, head_dim=16)


def shape_7b(n_layers: int | None = None) -> dict:
    """Llama 2 7B widths: emb 4096, 32 heads of 128 (MHA), FFN 11008, vocab 32000, untied; ``n_layers`` default 2 (32 released)."""
    return _base(emb_dim=4096, n_heads=32, n_layers=n_layers or 2, hidden_dim=11_008, head_dim=128)


CONFIGS = {"tiny": tiny, "7b-shape": shape_7b}
