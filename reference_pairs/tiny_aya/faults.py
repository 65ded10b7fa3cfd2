"""Tiny Aya fault catalogue for ``parity selftest tiny_aya`` (test-suite faults and shared/cases F01, F05, F07)."""

from __future__ import annotations

import types

from parity.selftest.faults import Fault

from ..common.faults import (
    DECODE,
    f07_repeat_kv,
    f10_masked_neg_inf,
    rms_instead_of,
    sliding_cache_trimmed_as_if_one_token,
)
from ..common.layer_types import FULL, SLIDING

ATT = "model.layers.{}.self_attn"
FULL_LAYER = 3  # the tiny config's full-attention (NoPE) layer


def _sequential(layer):
    def inject(pair):
        def forward(self, x, cos, sin, padding_mask=None, cache=None):
            x = x + self.att(self.input_layernorm(x), cos, sin, padding_mask, cache)
            return x + self.ff(self.input_layernorm(x))

        block = pair.ours.blocks[layer]
        block.forward = types.MethodType(forward, block)

    return inject


def _rms_layer0(pair):
    block = pair.ours.blocks[0]
    block.input_layernorm = rms_instead_of(block.input_layernorm)


def _half_split(pair):
    for block in pair.ours.blocks:
        block.att.interleaved_rope = False


def _rope_on_full(pair):
    """The full-attention layers given the sliding layers' RoPE, as a Llama-derived port would."""
    correct = pair.ours.rope_parameters
    pair.ours.rope_parameters = lambda: {**correct(), FULL: correct()[SLIDING]}


def _no_logit_scale(pair):
    pair.ours.logit_scale = 1.0


FAULTS = (
    Fault(
        "sequential-residual",
        "layer 1 sequential x + A(N(x)), then + F(N(.)), instead of parallel",
        "tiny",
        _sequential(1),
        "model.layers.1.mlp@input",
        "block_layout",
        scope="model.layers.1",
    ),
    Fault(
        "F05",
        "bias-free LayerNorm implemented as RMSNorm (layer 0 input_layernorm)",
        "tiny",
        _rms_layer0,
        "model.layers.0.input_layernorm",
        "norm_kind",
        source="omniserve #32",
    ),
    Fault(
        "F01",
        "RoPE with half-split pairs and concatenated cos/sin instead of even/odd pairs",
        "tiny",
        _half_split,
        f"{ATT.format(0)}.q_rot",
        "rope_pairing",
        scope=f"{ATT.format('*')}.[qk]_rot",
        source="llama.cpp #6033",
    ),
    Fault(
        "rope-on-full-layer",
        "RoPE also applied on the full-attention (NoPE) layer",
        "tiny",
        _rope_on_full,
        f"{ATT.format(FULL_LAYER)}.q_rot",
        "rope_unexpected",
        scope=f"{ATT.format(FULL_LAYER)}.[qk]_rot",
    ),
    Fault(
        "logit-scale-missing", "logits not multiplied by logit_scale", "tiny", _no_logit_scale, "logits", "logit_scale"
    ),
    f07_repeat_kv(ATT),
    f10_masked_neg_inf(ATT),
    Fault(
        "F11",
        "a sliding layer's cache trimmed as if one token arrived when a chunk of 4 does",
        "tiny",
        sliding_cache_trimmed_as_if_one_token,
        f"step0/{ATT.format(0)}.cache.keys",
        "cache_length",
        source="mlx-lm #1914",
        check_kwargs=DECODE,
    ),
)
