"""Qwen3.5 fault catalogue for ``parity selftest qwen3_5``: the issue's list (gate split, partial
rotary, ``(1 + w)``, conv causality, beta/g activations, L2 norms, the chunk boundary), the shared
GQA and padding faults on the full-attention layer, and the Gated DeltaNet's cache in decode checks
(the recurrent state and the conv inputs carried from call to call, padding in a continued chunk)."""

from __future__ import annotations

import types

import torch
from torch.nn import functional as F

from parity.selftest.faults import Fault

from ..common.cache import LinearAttentionCacheLayer
from ..common.faults import LEFT_PADDED, f07_repeat_kv, f10_masked_neg_inf
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


def _gate_silu(pair):
    """The output gate's activation SiLU instead of sigmoid (context * silu(gate))."""
    att = pair.ours.blocks[FULL_LAYER].att
    att.gate_activation = F.silu


def _value_heads_tiled(pair):
    """Each value head reads q/k head ``h % n_k`` (``repeat``) instead of ``h // (n_v / n_k)``."""
    att = pair.ours.blocks[0].att
    att.expand_heads = lambda t: t.repeat(1, 1, att.n_v_heads // att.n_k_heads, 1)


def _conv_channels_k_first(pair):
    """The conv output split as k | q | v instead of q | k | v."""
    att = pair.ours.blocks[0].att
    split = att.split_mixed

    def k_first(mixed):
        q, k, v = split(mixed)
        return k, q, v

    att.split_mixed = k_first


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
            return y, window[..., -self.kernel_size :]

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
        _, carried = rule(
            q[:, :, : c - 1], k[:, :, : c - 1], v[:, :, : c - 1], g[:, :, : c - 1], beta[:, :, : c - 1], state
        )
        rest, final = rule(q[:, :, c:], k[:, :, c:], v[:, :, c:], g[:, :, c:], beta[:, :, c:], carried)
        return torch.cat([first, rest], dim=2), final

    att.delta_rule = delta_rule


# --- the cache of a linear-attention layer (decode checks) -----------------------------------------


def _deltanets(pair):
    return [block.att for block in pair.ours.blocks if hasattr(block.att, "delta_rule")]


def _state_not_carried(pair):
    """Every prefill chunk runs the chunked rule from a zero state (a chunked rule written without an
    initial state); single-token steps carry it."""
    for att in _deltanets(pair):
        rule = att.delta_rule
        att.delta_rule = lambda q, k, v, g, beta, state, _rule=rule: _rule(
            q, k, v, g, beta, state if q.shape[2] == 1 else None
        )


def _conv_reads(pick):
    """The conv of a call continuing the cache reads ``pick(cached inputs)`` instead of the cached inputs."""

    def inject(pair):
        for att in _deltanets(pair):
            conv = att.conv1d
            forward = conv.forward
            conv.forward = lambda x, state=None, _forward=forward: _forward(
                x, None if state is None else pick(x, state)
            )

    return inject


def _conv_state_kept_one_early(pair):
    """The conv state kept after a call is the ``K`` inputs ending one token before its last."""
    for att in _deltanets(pair):
        conv = att.conv1d
        forward = conv.forward

        def kept_early(x, state=None, _forward=forward, _conv=conv):
            y, _ = _forward(x, state)
            window = x if state is None else torch.cat([state.to(x.dtype), x], dim=-1)
            k = _conv.kernel_size
            return y, F.pad(window, (max(k + 1 - window.shape[-1], 0), 0))[..., -k - 1 : -1]

        conv.forward = kept_early


def _recurrent_state_not_stored(pair):
    """The cache's recurrent state written as zeros after every call (a state slot allocated and never
    filled): the call itself computes right, the next one starts from nothing."""
    new_cache = pair.ours.new_cache

    def cache_keeping_zeros():
        cache = new_cache()
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionCacheLayer):
                update = layer.update
                layer.update = lambda conv, state, tokens, _update=update: _update(
                    conv, torch.zeros_like(state), tokens
                )
        return cache

    pair.ours.new_cache = cache_keeping_zeros


def _padding_zeroed_in_first_call_only(pair):
    """Padding zeroed only in a sequence's first call: left padding that falls in a later prefill chunk
    reaches the projections, the conv and the state."""
    for att in _deltanets(pair):
        forward = att.forward

        def first_call_masked(x, cos=None, sin=None, padding_mask=None, cache=None, _forward=forward, **kwargs):
            return _forward(x, cos, sin, None if cache is not None and cache.seen else padding_mask, cache, **kwargs)

        att.forward = first_call_masked


#: the decode schedule of the cache faults: a prompt of 8 in two calls of 4 (the second continues the
#: cache through the chunked rule and reads the conv's cached inputs), then 2 single-token steps
DECODE = (("decode", "8:4x2"),)
#: the same with padding in the second prefill call: rows 1 and 2 start with 5 padding tokens
DECODE_PADDED = (*DECODE, *LEFT_PADDED)

FAULTS = (
    Fault(
        "gate-split-flat",
        "q_proj's output split in two flat halves (queries | gates) instead of per head",
        "tiny",
        _flat_gate_split,
        f"{ATT.format(FULL_LAYER)}.gate",
        "head_mapping",
        scope=ATT.format(FULL_LAYER),
    ),
    Fault(
        "gate-activation-silu",
        "the output gate multiplies the context by silu(gate) instead of sigmoid(gate)",
        "tiny",
        _gate_silu,
        f"{ATT.format(FULL_LAYER)}.o_proj@input",
        "activation",
        scope=ATT.format(FULL_LAYER),
    ),
    Fault(
        "value-heads-tiled",
        "value heads read q/k heads by repeat (h % n_k) instead of repeat_interleave (h // (n_v / n_k))",
        "tiny",
        _value_heads_tiled,
        f"{LIN.format(0)}.q_l2norm",
        "head_mapping",
        scope=LIN.format(0),
    ),
    Fault(
        "conv-channels-k-first",
        "the short conv's output split as k | q | v instead of q | k | v",
        "tiny",
        _conv_channels_k_first,
        f"{LIN.format(0)}.q_l2norm",
        "swapped_roles",
        scope=LIN.format(0),
    ),
    Fault(
        "rotary-whole-head",
        "RoPE over the whole head instead of its first partial_rotary_factor (1/4)",
        "tiny",
        _whole_head_rotary,
        f"{ATT.format(FULL_LAYER)}.q_rot",
        "rope_partial",
        scope=f"{ATT.format(FULL_LAYER)}.[qk]_rot",
    ),
    Fault(
        "norm-w-not-1-plus-w",
        "input_layernorm of layer 0 scaled by w instead of 1 + w",
        "tiny",
        _norm_without_unit_offset,
        "model.layers.0.input_layernorm",
        "norm_weight_offset",
    ),
    Fault(
        "conv-padded-right",
        "the short conv padded on the right (anti-causal: reads K - 1 future tokens)",
        "tiny",
        _conv_padded_right(0),
        f"{LIN.format(0)}.conv_out",
        "sequence_shift",
    ),
    Fault(
        "beta-softplus",
        "beta = softplus(b) instead of sigmoid(b)",
        "tiny",
        _gates(beta_act=F.softplus),
        f"{LIN.format(0)}.beta",
        "activation",
    ),
    Fault(
        "g-sigmoid",
        "g = -exp(A_log) sigmoid(a + dt_bias) instead of softplus",
        "tiny",
        _gates(decay_act=torch.sigmoid),
        f"{LIN.format(0)}.g",
        "activation",
    ),
    Fault(
        "q-l2norm-missing",
        "q not L2-normalised before the delta rule",
        "tiny",
        _q_not_normalized,
        f"{LIN.format(0)}.q_l2norm",
        "row_scale",
        scope=LIN.format(0),
    ),
    Fault(
        "k-l2norm-missing",
        "k not L2-normalised before the delta rule",
        "tiny",
        _k_not_normalized,
        f"{LIN.format(0)}.k_l2norm",
        "row_scale",
        scope=LIN.format(0),
    ),
    Fault(
        "chunk-state-off-by-one",
        "the state carried out of the first chunk misses the chunk's last token",
        "tiny",
        _state_misses_chunk_end,
        f"{LIN.format(0)}.delta_out",
        "chunk_boundary",
        scope=LIN.format(0),
    ),
    f07_repeat_kv(ATT, config="tiny", layer=FULL_LAYER, scope=FULL_LAYER),
    f10_masked_neg_inf(ATT, layer=FULL_LAYER, scope=FULL_LAYER),
    Fault(
        "state-not-carried",
        "every prefill chunk runs the delta rule from a zero state (decode steps carry it)",
        "tiny",
        _state_not_carried,
        f"step1/{LIN.format(0)}.delta_out",
        "state_not_carried",
        check_kwargs=DECODE,
    ),
    Fault(
        "conv-state-not-carried",
        "the conv of a call continuing the cache starts from zeros, not the cached inputs",
        "tiny",
        _conv_reads(lambda x, state: torch.zeros_like(state)),
        f"step1/{LIN.format(0)}.conv_out",
        "conv_state",
        check_kwargs=DECODE,
    ),
    Fault(
        "conv-state-oldest-inputs",
        "a call continuing the cache reads the oldest K - 1 of the K cached conv inputs, not the newest",
        "tiny",
        _conv_reads(lambda x, state: state[..., :-1]),
        f"step1/{LIN.format(0)}.conv_out",
        "conv_state",
        check_kwargs=DECODE,
    ),
    Fault(
        "conv-state-kept-one-early",
        "the conv state kept after a call ends one input before the call's last",
        "tiny",
        _conv_state_kept_one_early,
        f"step0/{LIN.format(0)}.cache.conv_state",
        "conv_state",
        check_kwargs=DECODE,
    ),
    Fault(
        "recurrent-state-not-stored",
        "the cache keeps zeros for the recurrent state after every call (the slot never written)",
        "tiny",
        _recurrent_state_not_stored,
        f"step0/{LIN.format(0)}.cache.recurrent_state",
        "state_not_carried",
        check_kwargs=DECODE,
    ),
    Fault(
        "chunk-padding-leaks",
        "padding zeroed in a sequence's first call only: left padding in a later prefill "
        "chunk leaks into the conv and the recurrent state",
        "tiny",
        _padding_zeroed_in_first_call_only,
        f"step1/{LIN.format(0)}.in_proj_qkv",
        "padding",
        check_kwargs=DECODE_PADDED,
    ),
)
