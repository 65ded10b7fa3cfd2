"""Llama 3.2 fault catalogue for ``parity selftest llama3`` (test-suite faults and shared/cases F02, F07, F08)."""

from __future__ import annotations

import torch
from torch import nn

from parity.faults import Fault

from ..common.faults import LEFT_PADDED, expand_kv_with_repeat, mask_with_neg_inf, untie_head

ATT = "model.layers.{}.self_attn"


def _skip_llama3_scaling(pair):
    pair.ours.cfg = {**pair.ours.cfg, "rope_freq": None}


def _to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved q/k rows -> Transformers' half-split rows, grouping rows in ``n_heads`` heads."""
    out, d_in = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(out, d_in)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, d_in = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, d_in).transpose(1, 2).reshape(out, d_in)


def _k_permuted_by_query_heads(pair):
    """A converter that un-permutes k_proj correctly (KV heads) but re-permutes it grouping by query
    heads (transformers #31788): rows move, values stay."""
    cfg, att = pair.cfg, pair.ours.blocks[0].att
    meta = _to_interleaved(att.W_key.weight.detach(), cfg["n_kv_heads"])
    att.W_key.weight = nn.Parameter(_to_half_split(meta, cfg["n_heads"]), requires_grad=False)


FAULTS = (
    Fault("llama3-scaling-skipped", "Llama 3 RoPE frequency scaling not applied", "tiny", _skip_llama3_scaling,
          f"{ATT.format(0)}.q_rot", "rope_scaling", scope=f"{ATT.format('*')}.[qk]_rot"),
    Fault("F02", "k_proj rows (un)permuted for RoPE grouped by query heads instead of KV heads", "tiny",
          _k_permuted_by_query_heads, f"{ATT.format(0)}.k_proj", "weight_permutation", source="transformers #31788"),
    Fault("F07", "K/V heads expanded with repeat instead of repeat_interleave", "tiny", expand_kv_with_repeat,
          f"{ATT.format(0)}.scores", "head_mapping", scope=ATT.format("*"), source="onnx #7274"),
    Fault("F08", "output head its own Parameter, never loaded or tied", "tiny", untie_head, "lm_head",
          "untied_head", source="tinygrad #13796"),
    Fault("F10", "masked scores filled with -inf: fully masked (left-pad) query rows give NaN", "tiny",
          mask_with_neg_inf, f"{ATT.format(0)}.probs", "nonfinite", scope=f"{ATT.format('*')}.probs",
          source="unsloth #9848", check_kwargs=LEFT_PADDED),
)
