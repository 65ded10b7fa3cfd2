"""Llama 3.2 fault catalogue for ``parity selftest llama3`` (test-suite faults and shared/cases F02,
F07, F08, F10, F12-F16). F12-F15 change the Transformers side (attributes and buffers of
``pair.reference``, never an in-place edit of a shared weight), as the handed cases describe."""

from __future__ import annotations

import types

import torch
from torch import nn

from parity.selftest.faults import Fault

from ..common.faults import (
    DECODE,
    LEFT_PADDED,
    cached_mask_sees_one_ahead,
    f07_repeat_kv,
    f08_untied_head,
    f10_masked_neg_inf,
    to_half_split_rows,
    to_interleaved_rows,
    training_faults,
)

ATT = "model.layers.{}.self_attn"


def _skip_llama3_scaling(pair):
    pair.ours.cfg = {**pair.ours.cfg, "rope_freq": None}


def _k_permuted_by_query_heads(pair):
    """A converter that un-permutes k_proj correctly (KV heads) but re-permutes it grouping by query
    heads (transformers #31788): rows move, values stay."""
    cfg, att = pair.source.cfg, pair.ours.blocks[0].att
    meta = to_interleaved_rows(att.W_key.weight.detach(), cfg["n_kv_heads"])
    att.W_key.weight = nn.Parameter(to_half_split_rows(meta, cfg["n_heads"]), requires_grad=False)


def _reference_norms(pair):
    return [m for m in pair.reference.modules() if type(m).__name__ == "LlamaRMSNorm"]


def _reference_eps(eps: float):
    """Every RMSNorm of the reference with another ``variance_epsilon`` than the config's (candle #271)."""

    def inject(pair):
        for norm in _reference_norms(pair):
            norm.variance_epsilon = eps

    return inject


def _reference_inv_freq_in_bf16(pair):
    """The reference's RoPE inverse frequencies rounded to bfloat16 and back (NeMo Automodel #2549)."""
    rotary = pair.reference.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq.to(torch.bfloat16).to(torch.float32)
    rotary.original_inv_freq = rotary.inv_freq


def _reference_norm_multiplies_in_fp32(pair):
    """The reference's RMSNorm multiplies weight and normalised input in float32, then casts (TransformerEngine #1132)."""

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * normed).to(x.dtype)

    for norm in _reference_norms(pair):
        norm.forward = types.MethodType(forward, norm)


def _reference_scale_from_width(pair):
    """The reference's attention scale from hidden_size // num_heads instead of head_dim (lmdeploy #2761, TGI #2254)."""
    config = pair.reference.config
    for layer in pair.reference.model.layers:
        layer.self_attn.scaling = (config.hidden_size // config.num_attention_heads) ** -0.5


def _positions_not_from_mask(pair):
    """Ours rotates every row by 0..S-1 although the batch is left-padded (unsloth #3795)."""
    forward = pair.ours.forward

    def ignore_positions(self, input_ids, attention_mask=None, position_ids=None):
        return forward(input_ids, attention_mask=attention_mask)

    pair.ours.forward = types.MethodType(ignore_positions, pair.ours)


BF16 = (("dtype", torch.bfloat16),)
FAULTS = (
    Fault(
        "llama3-scaling-skipped",
        "Llama 3 RoPE frequency scaling not applied",
        "tiny",
        _skip_llama3_scaling,
        f"{ATT.format(0)}.q_rot",
        "rope_scaling",
        scope=f"{ATT.format('*')}.[qk]_rot",
    ),
    Fault(
        "F02",
        "k_proj rows (un)permuted for RoPE grouped by query heads instead of KV heads",
        "tiny",
        _k_permuted_by_query_heads,
        f"{ATT.format(0)}.k_proj",
        "weight_permutation",
        source="transformers #31788",
    ),
    f07_repeat_kv(ATT),
    f08_untied_head(),
    f10_masked_neg_inf(ATT),
    Fault(
        "F12",
        "every RMSNorm's variance_epsilon 1e-6 while the config says 1e-5",
        "tiny",
        _reference_eps(1e-6),
        "model.layers.0.input_layernorm",
        "norm_eps",
        scope="model.*norm",
        source="candle #271",
    ),
    Fault(
        "F13",
        "RoPE inverse frequencies rounded to bfloat16 (bfloat16 pair)",
        "tiny",
        _reference_inv_freq_in_bf16,
        f"{ATT.format(0)}.q_rot",
        "rope_frequencies",
        scope=f"{ATT.format('*')}.[qk]_rot",
        source="NeMo Automodel #2549",
        overrides=BF16,
    ),
    Fault(
        "F14",
        "RMSNorm multiplies in float32, then casts, instead of Llama's cast-then-multiply (bfloat16 pair)",
        "tiny",
        _reference_norm_multiplies_in_fp32,
        "model.layers.0.input_layernorm",
        "rounding_order",
        scope="model.*norm",
        source="TransformerEngine #1132",
        overrides=BF16,
    ),
    Fault(
        "F15",
        "attention scale from hidden_size // num_heads (12) instead of head_dim (16)",
        "tiny",
        _reference_scale_from_width,
        f"{ATT.format(0)}.scores",
        "attention_scale",
        scope=f"{ATT.format('*')}.scores",
        source="lmdeploy #2761, TGI #2254",
    ),
    Fault(
        "F16",
        "positions 0..S-1 in every row of a left-padded batch instead of positions from the mask",
        "tiny",
        _positions_not_from_mask,
        f"{ATT.format(0)}.q_rot",
        "position_offset",
        scope=f"{ATT.format('*')}.[qk]_rot",
        source="unsloth #3795",
        check_kwargs=LEFT_PADDED,
    ),
    Fault(
        "decode-mask-one-ahead",
        "with a cache, each query of a chunk also sees the next key",
        "tiny",
        cached_mask_sees_one_ahead,
        f"step1/{ATT.format(0)}.probs",
        "causal_mask",
        check_kwargs=DECODE,
    ),
    # training parity (backward=True): the forward agrees, the gradients do not
    *training_faults(ATT, "model.layers.{}.mlp", tied=True),
)
