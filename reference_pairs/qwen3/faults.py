"""Qwen3 (dense) fault catalogue for ``parity selftest qwen3``: the test suite's faults and cases
reported in public projects (each naming its source)."""

from __future__ import annotations

from parity.selftest.faults import Fault

from ..common.faults import (
    WholeProjectionRMSNorm,
    f07_repeat_kv,
    f08_untied_head,
    f10_masked_neg_inf,
    gate_up_swapped,
)
from ..common.layer_types import FULL, SLIDING

ATT = "model.layers.{}.self_attn"


def _whole_projection_q_norm(pair):
    att = pair.ours.blocks[0].att
    att.q_norm = WholeProjectionRMSNorm(att.q_norm)


def _scale_from_width(pair):
    """Every layer's attention scale from emb_dim // n_heads (8) instead of head_dim (16)."""
    cfg = pair.ours.cfg
    for block in pair.ours.blocks:
        block.att.scale = (cfg["emb_dim"] // cfg["n_heads"]) ** -0.5


def _norm_eps(eps: float):
    """Every RMSNorm of ours (blocks, Q/K norms, final norm) with another eps than the config's."""

    def inject(pair):
        for module in pair.ours.modules():
            if hasattr(module, "eps") and hasattr(module, "cast_first"):
                module.eps = eps

    return inject


def _yarn_changed(**changes):
    def inject(pair):
        pair.ours.cfg = {
            **pair.ours.cfg,
            "rope_yarn": None if changes.get("plain") else {**pair.ours.cfg["rope_yarn"], **changes},
        }

    return inject


def _windowed_layers_first(pair):
    """``max_window_layers`` read the other way round: the first layers windowed, the later ones full."""
    blocks = pair.ours.blocks
    n_sliding = sum(b.layer_type == SLIDING for b in blocks)
    window = pair.ours.cfg["sliding_window"]
    for i, block in enumerate(blocks):
        block.layer_type = SLIDING if i < n_sliding else FULL
        block.att.sliding_window = window if i < n_sliding else None


def _wider_window(pair):
    for block in pair.ours.blocks:
        if block.layer_type == SLIDING:
            block.att.sliding_window += 1


FIRST_SLIDING = 1  # the swa config: layer 0 full, layers 1.. sliding
FAULTS = (
    Fault(
        "qk-norm-whole-projection",
        "Q norm over the whole projection (every head at once) instead of per head",
        "tiny",
        _whole_projection_q_norm,
        f"{ATT.format(0)}.q_norm",
        "norm_kind",
        source="Lumina-T2X #112",
    ),
    Fault(
        "F15",
        "attention scale from emb_dim // n_heads (8) instead of head_dim (16)",
        "tiny",
        _scale_from_width,
        f"{ATT.format(0)}.scores",
        "attention_scale",
        scope=f"{ATT.format('*')}.scores",
        source="lmdeploy #2761, TGI #2254, EAGLE #223",
    ),
    Fault(
        "rms-eps-1e-5",
        "every RMSNorm with eps 1e-5 (a LayerNorm default) while the config says 1e-6",
        "tiny",
        _norm_eps(1e-5),
        "model.layers.0.input_layernorm",
        "norm_eps",
        scope="model.*norm",
        source="MinivLLM #82",
    ),
    Fault(
        "yarn-factor-dropped",
        "YaRN attention factor not applied to cos/sin",
        "yarn",
        _yarn_changed(attention_factor=1.0),
        f"{ATT.format(0)}.q_rot",
        "rope_attention_factor",
        scope=f"{ATT.format('*')}.[qk]_rot",
    ),
    Fault(
        "yarn-not-applied",
        "plain RoPE where the config asks for YaRN",
        "yarn",
        _yarn_changed(plain=True),
        f"{ATT.format(0)}.q_rot",
        "rope_scaling",
        scope=f"{ATT.format('*')}.[qk]_rot",
    ),
    Fault(
        "window-layers-first",
        "max_window_layers read the other way round: the first layers windowed, the rest full",
        "swa",
        _windowed_layers_first,
        f"{ATT.format(0)}.probs",
        "sliding_window",
        scope=f"{ATT.format('*')}.probs",
    ),
    Fault(
        "window-plus-one",
        "sliding window one token wider on every sliding layer",
        "swa",
        _wider_window,
        f"{ATT.format(FIRST_SLIDING)}.probs",
        "sliding_window",
        scope=f"{ATT.format('*')}.probs",
    ),
    gate_up_swapped(1),
    f07_repeat_kv(ATT),
    f08_untied_head(why="0.6B ties it"),
    f10_masked_neg_inf(ATT),
)
