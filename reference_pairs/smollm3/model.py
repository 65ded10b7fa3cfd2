"""SmolLM3 from scratch (Hugging Face, "SmolLM3: smol, multilingual, long-context reasoner", 2025
blog and model card of HuggingFaceTB/SmolLM3-3B; the architecture of ``transformers.SmolLM3ForCausalLM``).

A Llama-style pre-norm decoder (the book's ch. 11), every block

    h = x + att(norm1(x))          # GQA; half-split RoPE on most layers, none on NoPE layers
    y = h + ff(norm2(h))           # SwiGLU

then ``final_norm`` and ``out_head`` (the embedding's Parameter itself: the released model ties
them). What distinguishes it from Llama 3:

* **NoPE layers** (Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length
  Generalization in Transformers", arXiv:2305.19466; Yang et al. 2025, "RoPE to NoRoPE and Back
  Again", arXiv:2501.18795): a layer with ``no_rope_layers[i] == 0`` rotates neither queries nor
  keys (``SmolLM3Attention``: ``if self.use_rope: apply_rotary_pos_emb(...)``); it keeps the causal
  mask, which is then its only source of order. Note the name: 1 in ``no_rope_layers`` means the
  layer *uses* RoPE. Released: every 4th layer (3, 7, ..., 35) is NoPE;
* theta 5e6 (``SmolLM3RotaryEmbedding``; the config class's default is 2e6), optional YaRN as the
  model card extends it to 128k (``ROPE_INIT_FUNCTIONS["yarn"]``: its attention factor multiplies
  cos/sin, so a NoPE layer never sees it);
* optional ``attention_bias`` and ``mlp_bias`` (false in the release).

Rounding as Llama's: RMSNorm casts ``x_hat`` before the weight multiply (``SmolLM3RMSNorm``), cos/sin
are rounded to the activation dtype and the rotation runs in it (``SmolLM3RotaryEmbedding``,
``apply_rotary_pos_emb``), the softmax in float32 (``eager_attention_forward``).

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, rms_norm_eps, attention_bias, mlp_bias, tie_word_embeddings, rope_base, rope_yarn`` (None
or ``factor, original_context_length, beta_fast, beta_slow, attention_factor``), ``no_rope_layers``
(one 0/1 per layer, 1 = RoPE), ``layer_types`` (every layer ``full_attention``), ``dtype``.
"""

from __future__ import annotations

from functools import partial

import torch

from ..common.attention import GroupedQueryAttention
from ..common.blocks import PreNormBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL
from ..common.mlp import GatedMLP
from ..common.norms import RMSNorm
from ..common.rope import default_or_yarn


def rope_parameters(cfg: dict) -> dict[str, dict]:
    """The one Transformers-5 rope dict (YaRN if ``cfg["rope_yarn"]``); every layer is ``full_attention``
    (a NoPE layer receives the table and does not use it, as ``SmolLM3Attention`` does)."""
    params = default_or_yarn(cfg["rope_base"], cfg["rope_yarn"])
    return {FULL: params}


class NoPEAttention(GroupedQueryAttention):
    """:class:`~reference_pairs.common.attention.GroupedQueryAttention` that skips RoPE when
    ``use_rope`` is false (``SmolLM3Attention.use_rope``): the ``q_rot``/``k_rot`` taps then hold the
    unrotated heads. ``use_rope`` is an attribute so a test or a fault can flip it per layer."""

    def __init__(self, *args, use_rope: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_rope = use_rope

    def forward(self, x: torch.Tensor, cos=None, sin=None, padding_mask=None, cache=None) -> torch.Tensor:
        if not self.use_rope:
            cos = sin = None
        return super().forward(x, cos, sin, padding_mask, cache)

    def extra_repr(self) -> str:
        return f"use_rope={self.use_rope}"


def norm(cfg: dict) -> partial:
    """SmolLM3's RMSNorm of the residual stream (Llama's cast-then-weight order)."""
    return partial(RMSNorm, cfg["emb_dim"], eps=cfg["rms_norm_eps"], cast_first=True, dtype=cfg["dtype"])


def transformer_block(cfg: dict, use_rope: bool) -> PreNormBlock:
    """One pre-norm block: ``x + att(norm1(x))``, then ``+ ff(norm2(.))``; ``use_rope`` false: a NoPE layer."""
    dtype = cfg["dtype"]
    att = NoPEAttention(
        cfg["emb_dim"],
        cfg["n_heads"],
        cfg["n_kv_heads"],
        cfg["head_dim"],
        use_rope=use_rope,
        bias=cfg["attention_bias"],
        dtype=dtype,
    )
    ff = GatedMLP(cfg["emb_dim"], cfg["hidden_dim"], activation="silu", bias=cfg["mlp_bias"], dtype=dtype)
    return PreNormBlock(att, ff, norm(cfg), FULL)


class SmolLM3Model(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        flags, types = cfg["no_rope_layers"], cfg["layer_types"]
        if len(flags) != cfg["n_layers"] or any(f not in (0, 1) for f in flags):
            raise ValueError(f"no_rope_layers needs one 0 (NoPE) or 1 (RoPE) per layer, got {flags}")
        if any(t != FULL for t in types):
            raise ValueError(f"SmolLM3 here has full_attention layers only, got layer_types={types}")
        blocks = [transformer_block(cfg, bool(flag)) for flag in flags]
        super().__init__(cfg, blocks, norm(cfg)())

    def rope_parameters(self) -> dict[str, dict]:
        return rope_parameters(self.cfg)
