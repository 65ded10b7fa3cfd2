"""Built-in Tiny Aya configs as named data, in the book's cfg vocabulary.

Real values (``3b-shape``) are those of the released checkpoints' config.json
(CohereLabs/tiny-aya-base, -global, -fire, -water, -earth; 3.35B parameters, ``model_type``
``cohere2``), as transcribed in the ``TINY_AYA_CONFIG`` of LLMs-from-scratch
``ch05/15_tiny-aya/standalone-tiny-aya.ipynb`` (the source behind the book's chapter 22.3-22.4):
vocab 262144, ``max_position_embeddings`` 500000, hidden 2048, 36 layers (3 sliding : 1 full),
16 query / 4 KV heads, head_dim 128 (= 2048 / 16), FFN 11008, sliding window 4096, rope_theta
50000, layer_norm_eps 1e-5, logit_scale 1.0, tied embeddings. Cross-checks: the parameter count
these widths give, 3,349,227,520 with the tied embedding counted once, is the model card's 3.35B;
the README there and the book give the 3:1 pattern, window 4096 and no RoPE on full layers.
Where a value is absent from config.json, ``transformers.Cohere2Config``'s default applies
(``logit_scale`` 0.0625, ``layer_norm_eps`` 1e-5, pattern 4, ``tie_word_embeddings`` True).
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL, SLIDING, every_nth_full  # noqa: F401 (re-exported)


def _base(**kw) -> dict:
    cfg = dict(
        attention_bias=False,
        tie_word_embeddings=True,
        layer_norm_eps=1e-5,
        rope_type="default",
        rope_base=50_000.0,
        logit_scale=1.0,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("layer_types", every_nth_full(cfg["n_layers"], 4))  # Cohere2Config sliding_window_pattern 4
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """4 layers (3 sliding + 1 full), window 4, GQA 4 query / 2 KV heads, head_dim 8, logit_scale 0.0625, tied."""
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
        # Not Tiny Aya's 1.0 (Cohere2Config's default, as in Command R): a scale of 1 would make a
        # forgotten ``logits * logit_scale`` invisible.
        logit_scale=0.0625,
    )


def shape_3b(n_layers: int | None = None) -> dict:
    """Tiny Aya 3.35B widths: emb 2048, 16 query / 4 KV heads, head_dim 128, FFN 11008, vocab 262144; ``n_layers`` default 2.

    Values from the released config.json (see the module docstring). ``logit_scale`` is 1.0 there,
    so at this shape a missing logit scale cannot show; the ``tiny`` config covers it.
    """
    return _base(
        vocab_size=262_144,
        context_length=500_000,
        emb_dim=2048,
        n_heads=16,
        n_kv_heads=4,
        n_layers=n_layers or 2,
        hidden_dim=11_008,
        head_dim=128,
        sliding_window=4096,
        rope_base=50_000.0,
        layer_norm_eps=1e-5,
        logit_scale=1.0,
        tie_word_embeddings=True,
    )


CONFIGS = {"tiny": tiny, "3b-shape": shape_3b}
