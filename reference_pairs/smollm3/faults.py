"""SmolLM3 fault catalogue for ``parity selftest smollm3``: what a port of NoPE layers gets wrong
(RoPE where the config says none, the ``no_rope_layers`` flag read the other way round or from the
wrong interval, only half of q/k left unrotated, a NoPE layer without its causal mask), a Llama
theta and eps carried over, YaRN dropped, and the handed cases F07, F08, F10. Each fault changes
our model (its modules, methods or cfg copy) only."""

from __future__ import annotations

import torch

from parity.selftest.faults import Fault

from ..common.faults import f07_repeat_kv, f08_untied_head, f10_masked_neg_inf, gate_up_swapped

ATT = "model.layers.{}.self_attn"
NOPE_LAYER = 3  # tiny and yarn: layers 0-2 and 4 rotate, layer 3 is NoPE
ROT = f"{ATT.format('*')}.[qk]_rot"
#: the hint a RoPE missing on a RoPE layer gets (parity/diagnose/rope.py ``rope_pattern``)
MISSING_ROPE_HINT = "rope_missing"


def _rope_on_nope_layer(pair):
    """A Llama port that rotates every layer: the NoPE layer too."""
    for block in pair.ours.blocks:
        block.att.use_rope = True


def _flags_inverted(pair):
    """``no_rope_layers`` read by its name (1 = no RoPE) instead of its meaning (1 = RoPE)."""
    for block in pair.ours.blocks:
        block.att.use_rope = not block.att.use_rope


def _interval_from_zero(pair):
    """The interval rule counted from 0: NoPE where ``i % 4 == 0`` (layers 0, 4) instead of ``(i + 1) % 4 == 0``."""
    for i, block in enumerate(pair.ours.blocks):
        block.att.use_rope = i % 4 != 0


def _nope_queries_only(layer):
    """The NoPE layer skips RoPE on the queries but still rotates the keys (the key path kept its
    rotation: the keys are told from the queries by their head count, GQA)."""

    def inject(pair):
        att = pair.ours.blocks[layer].att
        att.use_rope = True
        rotate = att.rotate
        att.rotate = lambda t, cos, sin, **rope: t if t.shape[1] == att.n_heads else rotate(t, cos, sin, **rope)

    return inject


def _nope_without_causal_mask(layer):
    """The NoPE layer run without a causal mask ("no positions" read as "no order"): every query sees
    every key of the sequence."""

    def inject(pair):
        att = pair.ours.blocks[layer].att
        masked = att.mask_scores
        att.mask_scores = lambda scores, allowed: masked(scores, torch.ones_like(allowed, dtype=torch.bool))

    return inject


def _cfg_changed(**changes):
    def inject(pair):
        pair.ours.cfg = {**pair.ours.cfg, **changes}

    return inject


def _norm_eps(eps: float):
    """Every RMSNorm of ours with another eps than the config's."""

    def inject(pair):
        for module in pair.ours.modules():
            if hasattr(module, "eps") and hasattr(module, "cast_first"):
                module.eps = eps

    return inject


FAULTS = (
    Fault(
        "rope-on-nope-layer",
        "RoPE applied on the NoPE layer (every layer rotated, as a Llama port does)",
        "tiny",
        _rope_on_nope_layer,
        f"{ATT.format(NOPE_LAYER)}.q_rot",
        "rope_unexpected",
        scope=f"{ATT.format(NOPE_LAYER)}.[qk]_rot",
    ),
    Fault(
        "no-rope-layers-inverted",
        "no_rope_layers read by its name (1 = NoPE): RoPE skipped on layers 0-2 and 4, applied on layer 3",
        "tiny",
        _flags_inverted,
        f"{ATT.format(0)}.q_rot",
        MISSING_ROPE_HINT,
        scope=ROT,
    ),
    Fault(
        "nope-interval-from-zero",
        "NoPE every 4th layer counted from 0 (layers 0 and 4) instead of (i + 1) % 4 == 0 (layer 3)",
        "tiny",
        _interval_from_zero,
        f"{ATT.format(0)}.q_rot",
        MISSING_ROPE_HINT,
        scope=ROT,
    ),
    Fault(
        "nope-keys-rotated",
        "the NoPE layer leaves the queries unrotated but still rotates the keys",
        "tiny",
        _nope_queries_only(NOPE_LAYER),
        f"{ATT.format(NOPE_LAYER)}.k_rot",
        "rope_unexpected",
        scope=f"{ATT.format(NOPE_LAYER)}.k_rot",
    ),
    Fault(
        "nope-not-causal",
        "the NoPE layer attends without the causal mask (no positions taken for no order)",
        "tiny",
        _nope_without_causal_mask(NOPE_LAYER),
        f"{ATT.format(NOPE_LAYER)}.probs",
        "causal_mask",
        scope=f"{ATT.format(NOPE_LAYER)}.probs",
    ),
    Fault(
        "llama-theta",
        "rope_theta 500000 (a Llama 3 port's) instead of SmolLM3's 5000000",
        "tiny",
        _cfg_changed(rope_base=500_000.0),
        f"{ATT.format(0)}.q_rot",
        "rope_theta",
        scope=ROT,
    ),
    Fault(
        "rms-eps-1e-5",
        "every RMSNorm with eps 1e-5 (Llama's) while the config says 1e-6",
        "tiny",
        _norm_eps(1e-5),
        "model.layers.0.input_layernorm",
        "norm_eps",
        scope="model.*norm",
    ),
    Fault(
        "yarn-not-applied",
        "plain RoPE where the config asks for YaRN (the model card's 128k recipe)",
        "yarn",
        _cfg_changed(rope_yarn=None),
        f"{ATT.format(0)}.q_rot",
        "rope_scaling",
        scope=ROT,
    ),
    gate_up_swapped(1),
    f07_repeat_kv(ATT),
    f08_untied_head(why="SmolLM3-3B ties it"),
    f10_masked_neg_inf(ATT),
)
