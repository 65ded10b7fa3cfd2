"""Typed hints: what a failing node's error pattern suggests, as ``Hint(kind, evidence, text)``.

``kind`` is one of :data:`KINDS` (tests, fault catalogues and the selftest compare kinds, never
the prose); ``evidence`` holds the numbers the hint rests on (JSON-serialisable); ``text`` is the
sentence a user reads. A hint says "likely" and never changes the measured status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: every hint kind, with what it means
KINDS: dict[str, str] = {
    "missing": "a node one side never produced (node map, tap or module path)",
    "shape": "the same node has another shape on each side (layout, head count)",
    "nonfinite": "the first NaN/Inf, with its positions and batch rows (masked or padded rows?)",
    "tap_layout": "a tapped attention tensor equals the reference with heads and positions swapped (declare parity.tap(..., layout=))",
    "swapped_weights": "ours equals another reference node of the same layer (gate vs up, k vs v), or the reference with a fused gate/up split the other way round",
    "swapped_roles": "the projections agree (each holds the reference's weight) but their roles are swapped where they "
    "are used: the activation applied to up_proj's output instead of gate_proj's, k used as the query",
    "expert_mapping": "one expert of ours computes with another expert's weights (experts indexed in another order)",
    "expert_missing": "the experts' weighted sum without one expert's share (a loop over experts that stops short)",
    "routing": "an integer node (the experts a router chose) differs: where, same set or not, and the reference's margin (a near-tie?)",
    "quantisation": "one side's input is the other's rounded to a few integer levels (activation quantisation, int8 absmax per token)",
    "expert_rows": "a node inside one expert over other tokens: run once after the experts' sum (a per-expert norm moved "
    "out of the experts), or the router chose other experts upstream",
    "experts_per_token": "a MoE layer chooses another number of experts per token (k of another layer, a per-layer list misread)",
    "routing_weights": "the top-k routing weights formed otherwise from the router's logits (the raw logits, no softmax)",
    "renormalisation": "ours / ref is one factor per row and one side's rows sum to 1 (top-k weights renormalised on one side only)",
    "transposed_weight": "ours equals the reference computed with a transposed weight (Conv1D-style load)",
    "weight_permutation": "same values per token in another order along the last axis (a row permutation)",
    "concat_order": "two parts concatenated in the other order along the last axis (cat(b, a) for cat(a, b))",
    "head_layout": "heads merged or split in another axis order (a reshape without the transpose before it)",
    "alibi": "the ALiBi bias added to the scores with other slopes (sign, order over the heads, exponents, scale, none)",
    "head_dim": "q/k cut into another number of heads of another width (head_dim taken as hidden_size / num_heads)",
    "qkv_layout": "q/k/v cut from a fused projection's output in another layout (per head vs stacked [q; k; v], or another order)",
    "head_mapping": "some heads agree, others equal a different reference head (GQA expansion, head split)",
    "untied_head": "every hidden node agrees, the logits are uncorrelated (head never loaded or tied)",
    "norm_kind": "the norm behaves like another normaliser (RMSNorm vs LayerNorm, per head vs projection)",
    "block_layout": "a parallel block run sequentially, or the reverse (the MLP reads the residual after attention)",
    "residual": "a residual connection missing or added twice (the stream or the branch's output)",
    "norm_placement": "a block's input equals the reference's input after a norm (pre- vs post-norm)",
    "norm_eps": "the norm's eps: ours/ref varies per token with that token's RMS (another eps, or eps outside the "
    "square root on one side)",
    "norm_skipped": "a norm one side does not apply: its output is its input (or the input times the weight)",
    "norm_weight_offset": "the norm weight used as w instead of 1 + w (per-channel ratio w / (1 + w))",
    "channel_scale": "ours/ref constant over tokens per channel (a per-channel weight difference)",
    "bias": "ours - ref is one vector at every position (a bias one side adds and the other does not)",
    "softmax_sink": "one side's attention rows sum to less than 1, each the other's times one factor: an extra "
    "logit in the softmax's denominator (an attention sink; 0: the off-by-one softmax)",
    "softmax_axis": "attention probabilities normalised over another axis than the keys",
    "scale": "ours/ref is one constant everywhere (a missing or extra factor)",
    "rope_attention_factor": "a constant ratio equal to the RoPE (YaRN) attention factor, at every position incl. 0",
    "logit_scale": "a constant ratio equal to logit_scale",
    "attention_scale": "q and k agree, the pre-softmax scores differ by a constant factor (softmax temperature)",
    "differential_attention": "differential attention (o1 - lambda o2 over head pairs, RMS-normed, times "
    "1 - lambda_init) formed otherwise: lambda, the scale, the norm's width or the head pairing",
    "context_to_output": "the attention's context agrees and its output projection's input does not: what is done "
    "between them (a combination of heads, a gate, a norm, a scale)",
    "moe_combination": "a MoE block's routed sum and shared expert added with other coefficients (a routed scaling "
    "factor applied to their sum, or to the other term)",
    "sparse_selection": "a dynamic sparse attention's chosen keys (an indexer's or a top-k's key blocks) differ",
    "shared_expert": "a MoE block's shared expert combined otherwise with the routed experts (its gate, the gate's "
    "sigmoid, what the gate scales)",
    "loader_gap": "a checkpoint tensor ours holds only in part (loader coverage's gap) is where the failure sits",
    "reshaped_weight": "ours holds a checkpoint tensor in its own element order under permuted axis sizes (a reshape "
    "where a transpose is meant) where the failure sits",
    "derived_at_load": "a module whose checkpoint tensors ours computes into other values at load (folded) is where "
    "the difference enters: the computation, not the tensors, differs",
    "one_change": "one change to the reference's code inside a block ours computes untapped (an activation left out "
    "or another, a scale or a parameter left out, a slice from the other end, heads tiled) makes the two agree: "
    "the operation and the source line named",
    "untapped_block": "the first node after a block ours left untapped differs while the nodes before it agree: "
    "the difference enters inside that block",
    "moe_block": "a MoE block ours computes in functions differs where the stream continues, no routing formula "
    "or combination of the reference's experts reproduces it: the experts themselves or how their outputs are put back",
    "attention_internals": "an attention parity could not read in ours (a weight absorbed, a fused kernel) gives "
    "another context while every projection feeding it agrees: the difference is inside it",
    "attention_partial_head": "q . k taken over part of each head only (a partial-rotary head's pass-through dims dropped)",
    "sliding_window": "only query positions at or past the window differ",
    "rope_pairing": "RoPE pairs (i, i + d/2) on one side and (2i, 2i + 1) on the other",
    "rope_frequencies": "position 0 agrees, the error grows with position (frequencies, scaling, offset)",
    "rope_precision": "the RoPE's cos/sin table rounded to a lower precision (bfloat16, float16) on one side",
    "rope_band": "the error is confined to a band of rotary frequencies (YaRN / llama3 ramp band)",
    "rope_missing": "ours does not rotate where the reference does",
    "rope_partial": "ours rotates other dims of each head than the reference (partial_rotary_factor: how many dims, which pairs)",
    "rope_unexpected": "ours rotates where the reference applies no RoPE (a NoPE layer)",
    "rope_layer_type": "RoPE differs on exactly the layers of one type (per-layer-type RoPE parameters)",
    "rope_rotation": "ours turns each pair with this layer's frequencies but another angle formula: cos and sin "
    "swapped (pi/2 - w p) or sin negated (-w p)",
    "rope_theta": "the rotation equals RoPE with another theta (a fallback theta)",
    "rope_scaling": "ours rotates with the unscaled frequencies where the reference scales them (llama3, YaRN, linear)",
    "position_offset": "positions shifted: each padded row rotated by its pad count (positions not from the mask), or "
    "ours at position p equals the reference at p + k (a learned position table read off by k)",
    "projection_input": "ours' projection (its own weight) reads another value than the reference's does (the "
    "un-normed residual, another point of the stream)",
    "partial_read": "ours computed the node as a sum of products over slices of its weight that cover only part "
    "of it (a chunked loop that drops the tail)",
    "loop_count": "a module run in a loop (a recurrent stack, a looped block) ran another number of times before this "
    "node's first call on one side: the loop's count read from another config field, or two counts swapped",
    "loop_input": "a block the reference runs more than once (a looped stack, a recurrent section) agrees on its "
    "earlier passes and differs from a later pass's first node: what ours feeds it on that pass (the carried state, "
    "an input added before each pass) differs",
    "loop_call": "a node agrees on its first call and differs on a later one while the nodes before it in that pass "
    "agree: it computes otherwise on later calls (a per-pass constant, a cache slot, a state kept between calls)",
    "token_shift": "a projection's input mixes each token with its neighbour (RWKV's time_mix) otherwise on one side: "
    "the next token, no neighbour, or the two weights exchanged",
    "gain_order": "a per-channel gain on q or k (a norm's weight, a learned scale) applied before RoPE on one side "
    "and after it on the other",
    "position_bias": "a bias added to the attention scores by query-key distance differs (a relative position "
    "bias's extent, clamping or table layout)",
    "repeated_module": "a module ours runs more often than the reference before this node (applied twice)",
    "clamp": "one side clamps (clips, limits) values the other does not: equal below a threshold, the bound above it",
    "row_offset": "ours - ref is one value per row (token): a per-token shift, e.g. log-probabilities (log_softmax) "
    "returned for logits",
    "token_ids": "ours reads other rows of the token embedding table than the ids (ids shifted: a BOS or vocabulary "
    "offset, or another mapping)",
    "reduction_order": "a module applied to each vector before a reduction (a mean, a sum over an axis) on one side "
    "and to the reduced vector on the other: the side applying it first holds one axis more",
    "execution_order": "ours runs the same modules in another order than the reference (layers reversed, the MLP "
    "before the attention)",
    "wrong_module": "ours never runs this node's module and runs another node's module more often than the "
    "reference: that module called in its place (its weights used here)",
    "cache_length": "a cache holds another number of tokens than the reference's (a sliding layer keeps window - 1, a "
    "linear-attention layer's conv state the kernel's width); a user's cache: fewer than the reference's attention "
    "reads (the missing positions named)",
    "argument_slot": "an argument of the forward read in another's place: ours' logits move with an input no "
    "computation of that name can change them by (an all-ones attention_mask moving the last token: the mask passed "
    "positionally as token_type_ids)",
    "cache_not_read": "a call continuing a KV cache reads only its own keys: the cached ones are stored but not read",
    "causal_mask": "ours gives weight to keys the reference masks, later than the query (a query sees the future)",
    "rounding_order": "every difference is within one or two units in the last place of the dtype (cast order)",
    "precision": "one side's values are all exact numbers of a narrower dtype (bfloat16, float16), the other's are "
    "not: that side computed the node in the narrower dtype and cast back",
    "row_scale": "ours / ref is one factor per row (token, head), another for each row: a per-vector norm on one side only",
    "activation": "another element-wise activation: ours equals the reference's pre-activation through another "
    "function (exact vs tanh GELU, SiLU), or is a monotone function of the reference value by value",
    "sequence_shift": "ours at position t equals the reference at t + d (a conv padded on the wrong side, a token shift)",
    "chunk_boundary": "positions before the first chunk boundary agree, later ones differ: the state carried between chunks",
    "padding": "only padding positions differ: padding treated otherwise than the reference treats it (a recurrent "
    "layer that does not zero it in every call writes it into its state)",
    "short_conv": "a gated short conv (LFM2) formed otherwise at its output projection: the taps reversed, tokens "
    "after the current one read, the gates or in_proj's chunks in another place, an activation added or dropped, padding reaching the conv",
    "conv_state": "a short causal conv continues from other cached inputs than the reference's: in a call continuing "
    "a cache only the first kernel - 1 positions differ, or the cached inputs themselves are shifted",
    "state_not_carried": "a call continuing a cache computes as if from a zero recurrent state (ours equals the rule "
    "replayed from zeros on this call's inputs): the state not carried across calls",
    "softcap": "one side equals the other soft-capped, cap * tanh(x / cap) (a soft-cap missing or extra)",
    "kv_sharing": "a layer that reads another layer's keys reads other keys (another layer's, or its own projection)",
    "layer_offset": "ours equals the reference's same node in another layer (a per-layer tensor taken from the wrong layer)",
    # training parity (parity.run.backward, parity.diagnose.backward)
    "detached": "ours gets no gradient (or a zero one) at a node where the reference's is non-zero: a .detach(), "
    "torch.no_grad() or .data in ours there",
    "untied_copy": "the reference ties a tensor, ours keeps copies: each copy's gradient differs, their sum matches",
    "loss_mask": "the gradient at the logits differs only at positions one loss ignores (padding, label -100)",
    "label_shift": "ours trains each position toward the target the reference trains a neighbouring position "
    "toward (labels shifted twice, or not at all)",
    "in_place": "ours' backward raised (an in-place op overwrote a tensor a backward formula reads): named, one line",
    "dropout": "a model's forward in train mode differs from its eval mode with every visible dropout at 0",
    "future_leak": "values at position t change when only tokens after t change (causality: the first node that leaks)",
}


@dataclass(frozen=True)
class Hint:
    """A likely cause: ``kind`` (see :data:`KINDS`), ``text`` for people, ``evidence`` for machines."""

    kind: str
    text: str
    evidence: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown hint kind {self.kind!r}")

    def __str__(self) -> str:
        return self.text

    def to_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text, "evidence": dict(self.evidence)}
