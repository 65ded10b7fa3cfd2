"""Built-in Qwen3.5 configs as named data, in the book's cfg vocabulary (Transformers' names for the
linear-attention fields: the book's Qwen3.5 reuses that component).

Real values from the released Qwen/Qwen3.5-0.8B config.json (``text_config``): vocab 248320, 256K
context, hidden 1024, FFN 3584, 24 layers with every 4th full attention (``full_attention_interval``
4), 8 query / 2 KV heads of 256, linear attention with 16 key and 16 value heads of 128 and a conv
kernel of 4, rms_norm_eps 1e-6, RoPE theta 1e7 on a quarter of each head (``partial_rotary_factor``
0.25), tied embeddings. Its ``mrope_section`` only matters for images and video (text positions are
the same on every M-RoPE axis), so the text configs here leave it out.
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL, LINEAR, every_nth_full  # noqa: F401 (re-exported)


def _base(**kw) -> dict:
    cfg = dict(
        rms_norm_eps=1e-6,
        activation="silu",
        attention_bias=False,
        tie_word_embeddings=True,
        rope_base=10_000_000.0,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("layer_types", every_nth_full(cfg["n_layers"], 4, LINEAR))  # 3 linear : 1 full
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """4 layers (3 linear + 1 full), GQA 4/2 heads of 16, linear attention 2 key / 4 value heads of 8.

    A quarter of each attention head (4 dims) rotates; each linear key head serves 2 value heads.
    The default 80 tokens pass the delta rule's first 64-token chunk.
    """
    return _base(
        vocab_size=257,
        context_length=4096,
        emb_dim=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=64,
        n_layers=n_layers or 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )


def shape_0_8b(n_layers: int | None = None) -> dict:
    """Qwen3.5-0.8B widths: emb 1024, 8 / 2 heads of 256, FFN 3584, linear 16 / 16 heads of 128; 4 layers.

    Vocabulary 248320; ``n_layers`` default 4 (3 linear + 1 full) of the released 24.
    """
    return _base(
        vocab_size=248_320,
        context_length=262_144,
        emb_dim=1024,
        n_heads=8,
        n_kv_heads=2,
        head_dim=256,
        hidden_dim=3584,
        n_layers=n_layers or 4,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )


CONFIGS = {"tiny": tiny, "0.8b-shape": shape_0_8b}
