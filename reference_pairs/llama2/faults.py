"""Llama 2 fault catalogue for ``parity selftest llama2``: what goes wrong porting Llama 2 (Meta's own
checkpoint layout, a Llama 3 port reused for it) and shared/cases F08, F10. Each fault replaces a
Parameter, a method or the cfg of ours, never a shared tensor in place."""

from __future__ import annotations

from torch import nn

from parity.selftest.faults import Fault

from ..common.faults import f08_untied_head, f10_masked_neg_inf, to_interleaved_rows

ATT = "model.layers.{}.self_attn"


def _meta_qk_layout(pair):
    """q_proj and k_proj in Meta's original layout (RoPE pairs interleaved, 2i with 2i + 1), loaded
    without the un-permute ``convert_llama_weights_to_hf.py`` applies: rows move within each head."""
    cfg = pair.source.cfg
    for block in pair.ours.blocks:
        att = block.att
        for name, heads in (("W_query", cfg["n_heads"]), ("W_key", cfg["n_kv_heads"])):
            linear = getattr(att, name)
            linear.weight = nn.Parameter(to_interleaved_rows(linear.weight.detach(), heads), requires_grad=False)


def _llama3_theta(pair):
    """A Llama 3 port reused for Llama 2 keeps rope_theta 500000 (Llama 2: 10000)."""
    pair.ours.cfg = {**pair.ours.cfg, "rope_base": 500_000.0}


FAULTS = (
    Fault(
        "meta-qk-layout",
        "q/k weights in Meta's interleaved RoPE layout, loaded without un-permuting (F02's family)",
        "tiny",
        _meta_qk_layout,
        f"{ATT.format(0)}.q_proj",
        "weight_permutation",
        scope=f"{ATT.format('*')}.[qk]_proj",
    ),
    Fault(
        "llama3-theta",
        "rope_theta 500000 (Llama 3's) instead of Llama 2's 10000",
        "tiny",
        _llama3_theta,
        f"{ATT.format(0)}.q_rot",
        "rope_theta",
        scope=f"{ATT.format('*')}.[qk]_rot",
        source="penzai #102 (the reverse: 10000 hard-coded for Llama 3)",
    ),
    f08_untied_head(),
    f10_masked_neg_inf(ATT),
)
