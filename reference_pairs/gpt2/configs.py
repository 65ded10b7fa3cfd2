"""Built-in GPT-2 configs as named data, in the book's cfg vocabulary (``GPT_CONFIG_124M``, ch. 4).

Real values from the released checkpoints' config.json (openai-community/gpt2 and gpt2-medium):
vocab 50257, context 1024 (``n_positions``), ``layer_norm_epsilon`` 1e-5, ``activation_function``
``gelu_new``, ``n_inner`` null (4 x emb), tied embeddings, ``scale_attn_weights`` true,
``scale_attn_by_inverse_layer_idx`` false. 124M: emb 768, 12 layers, 12 heads; 355M: emb 1024,
24 layers, 16 heads. The book (ch. 4, 5.5) gives the same numbers (``drop_rate`` is irrelevant:
both models run in eval mode). Every Conv1D of GPT-2 has a bias, so the book's ``qkv_bias`` is
always true here: Transformers' GPT-2 cannot drop it.
"""

from __future__ import annotations

import torch


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=50_257,
        context_length=1024,
        layer_norm_eps=1e-5,
        activation="gelu_new",
        tie_word_embeddings=True,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("hidden_dim", 4 * cfg["emb_dim"])
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """2 layers, emb 48, 4 heads of 12, FFN 192, context 64, tied head: GPT-2's layout at a test size."""
    return _base(vocab_size=257, context_length=64, emb_dim=48, n_heads=4, n_layers=n_layers or 2)


def shape_124m(n_layers: int | None = None) -> dict:
    """GPT-2 124M widths: emb 768, 12 heads of 64, FFN 3072, vocab 50257, context 1024; ``n_layers`` default 2 (12 released)."""
    return _base(emb_dim=768, n_heads=12, n_layers=n_layers or 2)


def shape_355m(n_layers: int | None = None) -> dict:
    """GPT-2 355M (medium) widths: emb 1024, 16 heads of 64, FFN 4096; ``n_layers`` default 2 (24 released)."""
    return _base(emb_dim=1024, n_heads=16, n_layers=n_layers or 2)


CONFIGS = {"tiny": tiny, "124m-shape": shape_124m, "355m-shape": shape_355m}
