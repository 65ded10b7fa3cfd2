"""OLMo 3 fault catalogue for ``parity selftest olmo3`` (test-suite faults and shared/cases F03, F04, F06, F07)."""

from __future__ import annotations

import types

from torch import nn

from parity.selftest.faults import Fault

from ..common.faults import (
    DECODE,
    PerHeadRMSNorm,
    cached_mask_sees_one_ahead,
    cached_positions_off_by_one,
    f07_repeat_kv,
    f10_masked_neg_inf,
    gate_up_swapped,
    sliding_cache_trimmed_as_if_one_token,
)
from .model import SLIDING

FIRST_YARN = 3  # the full-attention layer of the tiny configs


def _with_cfg(**changes):
    def inject(pair):
        pair.ours.cfg = {**pair.ours.cfg, **changes}

    return inject


def _per_head_q_norm(pair):
    att = pair.ours.blocks[0].att
    att.q_norm = PerHeadRMSNorm(att.q_norm, att.head_dim)


def _yarn_factor_twice(pair):
    f = pair.source.cfg["rope_attention_factor"]
    pair.ours.cfg = {**pair.ours.cfg, "rope_attention_factor": f * f}


def _unrounded_yarn_band(pair):
    """YaRN with the correction range left unrounded (no floor/ceil) (keras-hub #2981): what
    Transformers computes for ``truncate: false``, on the layers that use YaRN."""
    correct = pair.ours.rope_parameters

    def rope_parameters():
        return {t: p if p["rope_type"] != "yarn" else {**p, "truncate": False} for t, p in correct().items()}

    pair.ours.rope_parameters = rope_parameters


def _pre_norm(layer):
    def inject(pair):
        def forward(self, x, cos, sin, padding_mask=None, cache=None):
            x = x + self.att(self.post_attention_layernorm(x), cos, sin, padding_mask, cache)
            return x + self.ff(self.post_feedforward_layernorm(x))

        block = pair.ours.blocks[layer]
        block.forward = types.MethodType(forward, block)

    return inject


def _wider_window(pair):
    for block in pair.ours.blocks:
        if block.layer_type == SLIDING:
            block.att.sliding_window += 1


def _transposed_o_proj(layer):
    """A loader that transposes the square o_proj weight of one layer (a Conv1D-style load)."""

    def inject(pair):
        out_proj = pair.ours.blocks[layer].att.out_proj
        out_proj.weight = nn.Parameter(out_proj.weight.detach().T, requires_grad=False)

    return inject


ATT = "model.layers.{}.self_attn"
FAULTS = (
    Fault(
        "qk-norm-per-head",
        "Q norm computed per head instead of over the whole projection",
        "tiny",
        _per_head_q_norm,
        f"{ATT.format(0)}.q_norm",
        "norm_kind",
    ),
    Fault(
        "yarn-factor-dropped",
        "YaRN attention factor not applied to cos/sin",
        "yarn",
        _with_cfg(rope_attention_factor=1.0),
        f"{ATT.format(FIRST_YARN)}.q_rot",
        "rope_attention_factor",
        scope=ATT.format(FIRST_YARN),
    ),
    Fault(
        "F03",
        "YaRN correction range without floor/ceil rounding",
        "yarn",
        _unrounded_yarn_band,
        f"{ATT.format(FIRST_YARN)}.q_rot",
        "rope_band",
        scope=ATT.format(FIRST_YARN),
        source="keras-hub #2981",
    ),
    Fault(
        "F04",
        "YaRN attention factor applied twice",
        "yarn",
        _yarn_factor_twice,
        f"{ATT.format(FIRST_YARN)}.q_rot",
        "rope_attention_factor",
        scope=ATT.format(FIRST_YARN),
        source="sglang #33558",
    ),
    Fault(
        "F06",
        "block 2 built pre-norm x + attn(N(x)) instead of post-norm x + N(attn(x))",
        "tiny",
        _pre_norm(2),
        f"{ATT.format(2)}.q_proj",
        "norm_placement",
        scope="model.layers.2",
        source="gpt-neox #1408",
    ),
    Fault(
        "window-plus-one",
        "sliding window one token wider on every sliding layer",
        "tiny",
        _wider_window,
        f"{ATT.format(0)}.probs",
        "sliding_window",
        scope=f"{ATT.format('[012]')}.probs",
    ),
    gate_up_swapped(1),
    f07_repeat_kv(ATT),
    f10_masked_neg_inf(ATT),
    Fault(
        "F17",
        "a loader transposes the square o_proj weight of layer 1",
        "tiny",
        _transposed_o_proj(1),
        f"{ATT.format(1)}.o_proj",
        "transposed_weight",
    ),
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
    Fault(
        "cache-position-off-by-one",
        "from layer 1 up, cached steps rotate new tokens one position too far",
        "tiny",
        cached_positions_off_by_one(1),
        f"step1/{ATT.format(1)}.q_rot",
        "position_offset",
        check_kwargs=DECODE,
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
)
