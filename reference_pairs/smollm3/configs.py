"""Built-in SmolLM3 configs as named data, in the book's cfg vocabulary.

Real values from the released checkpoint's config.json (HuggingFaceTB/SmolLM3-3B, as released in
July 2025 with Transformers 4.54): vocab 128256, 65536 positions (``max_position_embeddings``),
hidden 2048, 36 layers, 16 heads and 4 KV heads (head_dim 128 = 2048 / 16, no explicit
``head_dim``), intermediate 11008, ``rms_norm_eps`` 1e-6, ``rope_theta`` 5000000 with
``rope_scaling`` null, ``no_rope_layer_interval`` 4 with ``no_rope_layers`` ``[1, 1, 1, 0] * 9``
(every 4th layer, 3, 7, ..., 35, is a NoPE layer), ``use_sliding_window`` false and
``sliding_window`` null, no attention or MLP biases, SiLU, ``tie_word_embeddings`` true. Long
context (the model card, "HuggingFaceTB/SmolLM3-3B"): YaRN ``{"type": "yarn", "factor": 2.0,
"original_max_position_embeddings": 65536}`` for 131072 positions. (Values as known from the
released files; no network here to re-read them.)

``no_rope_layers`` keeps Transformers' name *and its meaning*: one entry per layer, **1 = the layer
uses RoPE**, 0 = a NoPE layer (``SmolLM3Attention.use_rope = config.no_rope_layers[layer_idx]``).
Without an explicit list Transformers derives it from ``no_rope_layer_interval``: layer ``i`` is
NoPE when ``(i + 1) % interval == 0`` (:func:`nope_pattern`). ``rope_yarn`` is None (plain RoPE) or
the YaRN values in book names: ``factor``, ``original_context_length``
(``original_max_position_embeddings``), ``beta_fast``, ``beta_slow``, ``attention_factor`` (None:
Transformers' ``0.1 ln(factor) + 1``). ``layer_types`` is every layer ``full_attention`` (a window
is refused, see :func:`reference_pairs.smollm3.family.from_hf`).
"""

from __future__ import annotations

import torch

from ..common.layer_types import FULL

#: the released no_rope_layer_interval: every 4th layer has no RoPE
NOPE_INTERVAL = 4
#: the model card's long-context recipe, in book names (beta defaults as Transformers fills them)
SMOLLM3_YARN = dict(factor=2.0, original_context_length=65_536, beta_fast=32.0, beta_slow=1.0, attention_factor=None)


def nope_pattern(n_layers: int, interval: int = NOPE_INTERVAL, truncated: bool = False) -> list[int]:
    """``no_rope_layers`` as ``SmolLM3Config`` derives it: 1 (RoPE) except layer ``i`` with
    ``(i + 1) % interval == 0`` (0, NoPE). ``truncated``: a shape config cut to fewer than
    ``interval`` layers makes its last layer NoPE, so both kinds of layer are still compared."""
    pattern = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if truncated and 0 not in pattern and n_layers > 1:
        pattern[-1] = 0
    return pattern


def _base(**kw) -> dict:
    cfg = dict(
        vocab_size=128_256,
        context_length=65_536,
        rope_base=5_000_000.0,
        rope_yarn=None,
        rms_norm_eps=1e-6,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        dtype=torch.float32,
    )
    cfg.update(kw)
    cfg.setdefault("no_rope_layers", nope_pattern(cfg["n_layers"]))
    cfg["layer_types"] = [FULL] * cfg["n_layers"]
    return cfg


def tiny(n_layers: int | None = None) -> dict:
    """5 layers, emb 64, GQA 4 query / 2 KV heads of 16, FFN 96, tied head, RoPE theta 5e6 on layers 0-2 and 4, layer 3 NoPE.

    The released interval 4, so layer 3 is the NoPE layer and layer 4 a RoPE layer after it (a
    flag left over from the NoPE layer shows there); ``head_dim`` is ``emb_dim / n_heads`` as in
    the released model (``SmolLM3Config`` has no ``head_dim`` field).
    """
    n = n_layers or 5
    return _base(
        vocab_size=257,
        context_length=4096,
        emb_dim=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=n,
        hidden_dim=96,
        head_dim=16,
        no_rope_layers=nope_pattern(n, truncated=n_layers is not None),
    )


def yarn(n_layers: int | None = None) -> dict:
    """``tiny`` with the model card's YaRN (factor 2) over 64 original positions instead of 65536.

    With 65536 only frequencies turning by well under a radian in the probe's tokens would move; 64
    original positions put the ramp inside head_dim 16 at theta 5e6, so the scaling shows within
    16 tokens. The NoPE layer stays unrotated (YaRN's attention factor scales cos/sin only).
    """
    return {**tiny(n_layers), "context_length": 256, "rope_yarn": {**SMOLLM3_YARN, "original_context_length": 64}}


def shape_3b(n_layers: int | None = None) -> dict:
    """SmolLM3 3B widths: emb 2048, 16 query / 4 KV heads of 128, FFN 11008, theta 5e6, tied; ``n_layers`` default 2 (36 released), the last NoPE.

    ``no_rope_layers`` as released (every 4th layer NoPE); cut to fewer than 4 layers, the last
    layer is the NoPE one.
    """
    n = n_layers or 2
    return _base(
        emb_dim=2048,
        n_heads=16,
        n_kv_heads=4,
        n_layers=n,
        hidden_dim=11_008,
        head_dim=128,
        no_rope_layers=nope_pattern(n, truncated=True),
    )


CONFIGS = {"tiny": tiny, "yarn": yarn, "3b-shape": shape_3b}
