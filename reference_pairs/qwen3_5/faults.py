"""Qwen3.5 fault catalogue for ``parity selftest qwen3_5``: the issue's list (gate split, partial
rotary, ``(1 + w)``, conv causality, beta/g activations, L2 norms, the chunk boundary) and the shared
GQA and padding faults on the full-attention layer."""

from __future__ import annotations

import types

import torch
from torch.nn import functional as F

from parity.faults import Fault

from ..common.faults import LEFT_PADDED, expand_kv_with_repeat, mask_with_neg_inf
from ..common.linear_attention import l2norm

FULL_LAYER = 3  # the full-attention layer of the tiny config
ATT = "model.layers.{}.self_attn"
LIN = "model.layers.{}.linear_attn"


def _flat_gate_split(pair):
    """q_proj's output cut in two flat halves (queries, then gates) instead of per head."""
    att = pair.ours.blocks[FULL_LAYER].att

    def split_gate(self, queries):
        flat = queries.flatten(-2)
        query, gate = flat.chunk(2, dim=-1)
        return query.unflatten(-1, (self.n_heads, self.head_dim)), gate

    att.split_gate = types.MethodType(split_gate, att)


def _whole_head_rotary(pair):
    pair.ours.cfg = {**pair.ours.cfg, "partial_rotary_factor": 1.0}


def _norm_without_unit_offset(pair):
    pair.ours.blocks[0].norm1.unit_offset = False  # multiplies by w, not 1 + w


def _conv_padded_right(layer):
    """The short conv padded on the right: output t reads tokens t .. t + K - 1 (the future)."""

    def inject(pair):
        conv = pair.ours.blocks[layer].att.conv1d

        def forward(self, x, state=None):
            window = F.pad(x, (0, self.kernel_size - 1))
            y = self.act(F.conv1d(window.to(self.weight.dtype), self.weight, groups=x.shape[1])).to(x.dtype)
            return y, window[..., -self.kernel_size:]

        conv.forward = types.MethodType(forward, conv)

    return inject


def _gates(beta_act=None, decay_act=None):
    def inject(pair):
        att = pair.ours.blocks[0].att

        def gates(self, b, a):
            beta = (beta_act or torch.sigmoid)(b)
            return beta, -self.A_log.float().exp() * (decay_act or F.softplus)(a.float() + self.dt_bias)

        att.gates = types.MethodType(gates, att)

    return inject


def _q_not_normalized(pair):
    att = pair.ours.blocks[0].att
    att.normalize_qk = lambda q, k: (q, l2norm(k))


def _k_not_normalized(pair):
    att = pair.ours.blocks[0].att
    att.normalize_qk = lambda q, k: (l2norm(q), k)


def _state_misses_chunk_end(pair):
    """The state handed to the next chunk is the one before the chunk's last token: the last token of
    the first chunk writes into its own chunk's output but never into the carried state."""
    att = pair.ours.blocks[0].att
    rule = att.delta_rule
    c = att.chunk_size

    def delta_rule(q, k, v, g, beta, state):
        if q.shape[2] <= c:
            return rule(q, k, v, g, beta, state)
        first, _ = rule(q[:, :, :c], k[:, :, :c], v[:, :, :c], g[:, :, :c], beta[:, :, :c], state)
        _, carried = rule(q[:, :, : c - 1], k[:, :, : c - 1], v[:, :, : c - 1], g[:, :, : c - 1], beta[:, :, : c - 1], state)
        rest, final = rule(q[:, :, c:], k[:, :, c:], v[:, :, c:], g[:, :, c:], beta[:, :, c:], carried)
        return torch.cat([first, rest], dim=2), final

    att.delta_rule = delta_rule


FAULTS = (
    Fault("gate-split-flat", "q_proj's output split in two flat halves (queries | gates) instead of per head",
          "tiny", _flat_gate_split, f"{ATT.format(FULL_LAYER)}.gate", "head_mapping", scope=ATT.format(FULL_LAYER)),
    Fault("rotary-whole-head", "RoPE over the whole head instead of its first partial_rotary_factor (1/4)",
          "tiny", _whole_head_rotary, f"{ATT.format(FULL_LAYER)}.q_rot", "rope_partial",
          scope=f"{ATT.format(FULL_LAYER)}.[qk]_rot"),
    Fault("norm-w-not-1-plus-w", "input_layernorm of layer 0 scaled by w instead of 1 + w", "tiny",
          _norm_without_unit_offset, "model.layers.0.input_layernorm", "norm_weight_offset"),
    Fault("conv-padded-right", "the short conv padded on the right (anti-causal: reads K - 1 future tokens)",
          "tiny", _conv_padded_right(0), f"{LIN.format(0)}.conv_out", "sequence_shift"),
    Fault("beta-softplus", "beta = softplus(b) instead of sigmoid(b)", "tiny", _gates(beta_act=F.softplus),
          f"{LIN.format(0)}.beta", "activation"),
    Fault("g-sigmoid", "g = -exp(A_log) sigmoid(a + dt_bias) instead of softplus", "tiny",
          _gates(decay_act=torch.sigmoid), f"{LIN.format(0)}.g", "activation"),
    Fault("q-l2norm-missing", "q not L2-normalised before the delta rule", "tiny", _q_not_normalized,
          f"{LIN.format(0)}.q_l2norm", "row_scale", scope=LIN.format(0)),
    Fault("k-l2norm-missing", "k not L2-normalised before the delta rule", "tiny", _k_not_normalized,
          f"{LIN.format(0)}.k_l2norm", "row_scale", scope=LIN.format(0)),
    Fault("chunk-state-off-by-one", "the state carried out of the first chunk misses the chunk's last token",
          "tiny", _state_misses_chunk_end, f"{LIN.format(0)}.delta_out", "chunk_boundary", scope=LIN.format(0)),
    Fault("F07", "K/V heads expanded with repeat instead of repeat_interleave", "tiny", expand_kv_with_repeat,
          f"{ATT.format(FULL_LAYER)}.scores", "head_mapping", scope=ATT.format(FULL_LAYER), source="onnx #7274"),
    Fault("F10", "masked scores filled with -inf: fully masked (left-pad) query rows give NaN", "tiny",
          mask_with_neg_inf, f"{ATT.format(FULL_LAYER)}.probs", "nonfinite", scope=f"{ATT.format(FULL_LAYER)}.probs",
          source="unsloth #9848", check_kwargs=LEFT_PADDED),
)
