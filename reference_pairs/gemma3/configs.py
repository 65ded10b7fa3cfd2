"""Built-in Gemma 3 (text) configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoints' config.json (google/gemma-3-270m and google/gemma-3-1b-pt):
vocab 262144, 32K context, head_dim 256, ``query_pre_attn_scalar`` 256, rms_norm_eps 1e-6,
sliding window 512 on 5 of every 6 layers, RoPE theta 10000 on sliding layers
(``rope_local_base_freq``) and 1e6 on full layers, no soft-caps, GeGLU (``gelu_pytorch_tanh``), tied
head. The 4B/12B/27B models add ``rope_scaling`` linear factor 8 on the full-attention layers (the
``linear`` config exercises it).
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL, SLIDING, every_nth_full  # noqa: F401 (re-exported)


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=262_144,
        context_length=32_768,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=256,
        rope_base=1_000_000.0,
        rope_local_base=10_000.0,
        rope_scaling_factor=None,  # linear RoPE scaling on full-attention layers (4B and larger: 8.0)
        final_logit_softcap=None,
        attention_bias=False,
        tie_word_embeddings=True,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("layer_types", every_nth_full(cfg["n_layers"], 6))  # Gemma 3: every 6th layer full (5:1)
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """6 layers (5 sliding + 1 full), window 4, 4 query heads on 1 KV head (MQA, as in 270M and
    1B), head_dim 16 with query_pre_attn_scalar 24 (a scale that is not head_dim's, as in 27B)."""
    return _base(
        vocab_size=257,
        context_length=4096,
        emb_dim=32,
        n_heads=4,
        n_kv_heads=1,
        n_layers=n_layers or 6,
        hidden_dim=64,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
    )


def linear(n_layers: int | None = None) -> dict:
    """``tiny`` as the 4B-27B models are: GQA (4 query / 2 KV heads) and linear RoPE scaling (factor 8)
    on full layers; and a final logit soft-cap of 30 (optional in Gemma 3; Gemma 2's value)."""
    return {**tiny(n_layers), "n_kv_heads": 2, "rope_scaling_factor": 8.0, "final_logit_softcap": 30.0}


def shape_270m(n_layers: int | None = None) -> dict:
    """Gemma 3 270M widths: emb 640, 4 query / 1 KV heads (MQA), head_dim 256, FFN 2048; ``n_layers`` default 2."""
    return _base(
        emb_dim=640, n_heads=4, n_kv_heads=1, n_layers=n_layers or 2, hidden_dim=2048, head_dim=256, sliding_window=512
    )


def shape_1b(n_layers: int | None = None) -> dict:
    """Gemma 3 1B widths: emb 1152, 4 query / 1 KV heads (MQA), head_dim 256, FFN 6912; ``n_layers`` default 2."""
    return _base(
        emb_dim=1152, n_heads=4, n_kv_heads=1, n_layers=n_layers or 2, hidden_dim=6912, head_dim=256, sliding_window=512
    )


CONFIGS = {"tiny": tiny, "linear": linear, "270m-shape": shape_270m, "1b-shape": shape_1b}
