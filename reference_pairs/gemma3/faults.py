"""Gemma 3 fault catalogue for ``parity selftest gemma3``: the test suite's faults and ones reported in
public projects (each naming its source). Each mutates only the pair's own objects."""

from __future__ import annotations

import types

import torch

from parity.selftest.faults import Fault

from ..common.faults import (
    f07_repeat_kv,
    f08_untied_head,
    f10_masked_neg_inf,
)
from ..common.norms import RMSNorm
from .model import FULL, SLIDING

ATT = "model.layers.{}.self_attn"
FIRST_FULL = 5  # the full-attention layer of the tiny configs (every 6th)
BF16 = (("dtype", torch.bfloat16),)


def _norms(pair) -> list[RMSNorm]:
    return [m for m in pair.ours.modules() if isinstance(m, RMSNorm)]


def _w_instead_of_one_plus_w(pair):
    """Every RMSNorm multiplies by ``w`` instead of ``1 + w`` (a Llama RMSNorm reused for Gemma)."""
    for norm in _norms(pair):
        norm.unit_offset = False


def _norm_casts_first(pair):
    """Every RMSNorm casts the normalised input to the model dtype before multiplying by ``1 + w``
    (Llama's order) instead of multiplying in float32 and casting last."""

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * (1.0 + self.weight)

    for norm in _norms(pair):
        norm.forward = types.MethodType(forward, norm)


def _embedding_scale_in_float32(pair):
    """The sqrt(emb_dim) normaliser multiplied in float32 (exact root), then cast: Transformers rounds
    the factor to the model dtype first."""
    emb = pair.ours.tok_emb

    def forward(self, input_ids):
        x = torch.nn.functional.embedding(input_ids, self.weight)
        return (x.float() * self.scale).to(x.dtype)

    emb.forward = types.MethodType(forward, emb)


def _embedding_scaled_twice(pair):
    """The embeddings multiplied by sqrt(emb_dim) in the embedding and again by hand."""
    emb = pair.ours.tok_emb
    emb.scale = emb.scale * emb.scale


def _scale_from_head_dim(pair):
    for block in pair.ours.blocks:
        block.att.scale = block.att.head_dim**-0.5


def _sliding_layers_use_global_rope(pair):
    """Sliding layers rotate with the full layers' RoPE (theta 1e6, and its scaling)."""
    correct = pair.ours.rope_parameters

    def rope_parameters():
        params = correct()
        return {**params, SLIDING: params[FULL]}

    pair.ours.rope_parameters = rope_parameters


def _with_cfg(**changes):
    def inject(pair):
        pair.ours.cfg = {**pair.ours.cfg, **changes}

    return inject


def _wider_window(pair):
    for block in pair.ours.blocks:
        if block.layer_type == SLIDING:
            block.att.sliding_window += 1


def _no_final_softcap(pair):
    pair.ours.final_softcap = None


def _softcap_x_tanh(pair):
    """The cap's multiplier is the logit itself, ``x * tanh(x / cap)``: past about 2x the cap it caps nothing."""
    model, cap = pair.ours, pair.ours.final_softcap
    model.final_softcap = None
    forward = model.forward

    def x_tanh(self, *args, **kwargs):
        logits = forward(*args, **kwargs)
        return logits * torch.tanh(logits / cap)

    model.forward = types.MethodType(x_tanh, model)


FAULTS = (
    Fault(
        "F09",
        "every RMSNorm multiplies by w instead of 1 + w",
        "tiny",
        _w_instead_of_one_plus_w,
        "model.layers.0.input_layernorm",
        "norm_weight_offset",
        scope="model.*norm",
        source="executorch #19901",
    ),
    Fault(
        "norm-cast-first",
        "RMSNorm casts to bfloat16 before multiplying by 1 + w (Llama's order; bfloat16 pair)",
        "tiny",
        _norm_casts_first,
        "model.layers.0.input_layernorm",
        "rounding_order",
        scope="model.*norm",
        source="transformers #29402",
        overrides=BF16,
    ),
    Fault(
        "embed-scale-float32",
        "embedding normaliser sqrt(emb_dim) kept in float32 instead of rounded to bfloat16 (bfloat16 pair)",
        "tiny",
        _embedding_scale_in_float32,
        "model.embed_tokens",
        "rounding_order",
        source="transformers #29402",
        overrides=BF16,
    ),
    Fault(
        "embed-scale-twice",
        "token embeddings multiplied by sqrt(emb_dim) twice",
        "tiny",
        _embedding_scaled_twice,
        "model.embed_tokens",
        "scale",
        source="OpenTau #179",
    ),
    Fault(
        "scale-from-head-dim",
        "attention scale head_dim ** -0.5 instead of query_pre_attn_scalar ** -0.5",
        "tiny",
        _scale_from_head_dim,
        f"{ATT.format(0)}.scores",
        "attention_scale",
        scope=f"{ATT.format('*')}.scores",
        source="llama.cpp #13951, tt-metal #22810",
    ),
    Fault(
        "sliding-global-rope",
        "sliding layers rotate with the full layers' RoPE (theta 1e6, linear x8) instead of the local theta 10000",
        "linear",
        _sliding_layers_use_global_rope,
        f"{ATT.format(0)}.q_rot",
        "rope_layer_type",
        scope=f"{ATT.format('*')}.[qk]_rot",
        source="vllm #29111",
    ),
    Fault(
        "linear-scaling-skipped",
        "linear RoPE scaling (factor 8) not applied on the full layers",
        "linear",
        _with_cfg(rope_scaling_factor=None),
        f"{ATT.format(FIRST_FULL)}.q_rot",
        "rope_scaling",
        scope=f"{ATT.format(FIRST_FULL)}.[qk]_rot",
        source="mlx-vlm #1709, mlxcel #1340",
    ),
    Fault(
        "window-plus-one",
        "sliding window one token wider on every sliding layer",
        "tiny",
        _wider_window,
        f"{ATT.format(0)}.probs",
        "sliding_window",
        scope=f"{ATT.format('[0-4]')}.probs",
        source="mlx-lm #390",
    ),
    Fault(
        "final-softcap-dropped",
        "final logit soft-cap (30) not applied",
        "linear",
        _no_final_softcap,
        "logits",
        "softcap",
        source="Megatron-Bridge #4645",
    ),
    Fault(
        "final-softcap-x-tanh",
        "final logit soft-cap written as x * tanh(x / cap) instead of cap * tanh(x / cap)",
        "linear",
        _softcap_x_tanh,
        "logits",
        "softcap",
        source="unsloth-zoo #593",
    ),
    f07_repeat_kv(ATT, "linear"),
    f08_untied_head(),
    f10_masked_neg_inf(ATT),
)
