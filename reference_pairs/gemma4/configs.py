"""Built-in Gemma 4 (dense text) configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoints' ``text_config`` (google/gemma-4-E2B and -E4B, as the
book's standalone notebook reads them): vocab 262144 for both embedding tables, 128K context,
head_dim 256 on sliding layers and 512 (``global_head_dim``) on full layers, rms_norm_eps 1e-6,
sliding window 512, RoPE theta 10000 (default) on sliding layers and 1e6 "proportional" with
``partial_rotary_factor`` 0.25 on full layers, per-layer inputs of width 256, final logit soft-cap
30, tied head. E2B: emb 1536, FFN 6144 (doubled on the KV-shared layers), 35 layers with every
5th full, 8 query / 1 KV heads, the last 20 layers KV-shared. E4B: emb 2560, FFN 10240, 42 layers
with every 6th full, 8 query / 2 KV heads, the last 18 layers KV-shared. Neither uses
``attention_k_eq_v`` (the larger Gemma 4 models do; the ``k-eq-v`` config exercises it).
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL, SLIDING, every_nth_full  # noqa: F401 (re-exported)


def layer_types(n_layers: int, period: int) -> list[str]:
    """Every ``period``-th layer full, and always the last one (``Gemma4TextConfig`` forces it)."""
    types = every_nth_full(n_layers, period)
    types[-1] = FULL
    return types


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=262_144,
        vocab_size_per_layer_input=262_144,
        context_length=131_072,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        sliding_window=512,
        rope_local_base=10_000.0,
        rope_base=1_000_000.0,
        rope_global_type="proportional",
        rope_global_partial_rotary_factor=0.25,
        hidden_size_per_layer_input=256,
        use_double_wide_mlp=False,
        attention_k_eq_v=False,
        num_global_kv_heads=None,
        final_logit_softcap=30.0,
        attention_bias=False,
        tie_word_embeddings=True,
        dtype=torch.float32,
    )
    cfg.update(kw)
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """6 layers (every 3rd full), the last 3 reading the keys and values of layers 1 (sliding) and 2
    (full) with a double-wide FFN; window 4, 4 query heads on 1 KV head (MQA, as in E2B), head_dim 8
    on sliding and 16 on full layers, per-layer inputs of width 8."""
    n = n_layers or 6
    return _base(
        vocab_size=257,
        vocab_size_per_layer_input=257,
        context_length=4096,
        emb_dim=32,
        n_heads=4,
        n_kv_heads=1,
        n_layers=n,
        hidden_dim=64,
        head_dim=8,
        global_head_dim=16,
        sliding_window=4,
        layer_types=layer_types(n, 3),
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=n // 2,
        use_double_wide_mlp=True,
    )


def k_eq_v(n_layers: int | None = None) -> dict:
    """``tiny`` with GQA (4 query / 2 KV heads, as in E4B) and ``attention_k_eq_v``: full layers use
    their key projection as values, with 1 KV head of their own (as the larger Gemma 4 models do)."""
    return {**tiny(n_layers), "n_kv_heads": 2, "attention_k_eq_v": True, "num_global_kv_heads": 1}


def _shape(n_layers: int | None, first_shared: int, period: int, **kw) -> dict:
    """The first ``n_layers`` (default 2) layers of a released model: its layer pattern (the last layer
    full), and KV sharing from the layer where the real model starts it (``--layers`` past it shows it)."""
    n = n_layers or 2
    return _base(n_layers=n, layer_types=layer_types(n, period), num_kv_shared_layers=max(0, n - first_shared), **kw)


def shape_e2b(n_layers: int | None = None) -> dict:
    """Gemma 4 E2B widths: emb 1536, 8 query / 1 KV heads (MQA), head_dim 256/512, FFN 6144 (12288 on
    KV-shared layers); ``n_layers`` default 2 (layers 15+ share KV: ``--layers 16``)."""
    return _shape(
        n_layers,
        15,
        5,
        emb_dim=1536,
        n_heads=8,
        n_kv_heads=1,
        hidden_dim=6144,
        head_dim=256,
        global_head_dim=512,
        use_double_wide_mlp=True,
    )


def shape_e4b(n_layers: int | None = None) -> dict:
    """Gemma 4 E4B widths: emb 2560, 8 query / 2 KV heads, head_dim 256/512, FFN 10240; ``n_layers``
    default 2 (layers 24+ share KV: ``--layers 25``)."""
    return _shape(
        n_layers, 24, 6, emb_dim=2560, n_heads=8, n_kv_heads=2, hidden_dim=10_240, head_dim=256, global_head_dim=512
    )


CONFIGS = {"tiny": tiny, "k-eq-v": k_eq_v, "e2b-shape": shape_e2b, "e4b-shape": shape_e4b}
