"""Node-map entries every family shares: canonical (Transformers) name template -> our module path
template, ``{i}`` = layer. Families add only what differs (norm placement, Q/K norm, taps of their
own). Order within a list does not matter: nodes are compared in the reference's execution order."""

from __future__ import annotations

from parity.model.family import Node

EMBED = [("model.embed_tokens", "tok_emb")]
#: :class:`~reference_pairs.common.attention.GroupedQueryAttention` and its taps
ATTENTION = [
    ("model.layers.{i}.self_attn.q_proj", "blocks.{i}.att.W_query"),
    ("model.layers.{i}.self_attn.k_proj", "blocks.{i}.att.W_key"),
    ("model.layers.{i}.self_attn.v_proj", "blocks.{i}.att.W_value"),
    # after RoPE; the unrotated q/k on a layer without RoPE
    ("model.layers.{i}.self_attn.q_rot", "blocks.{i}.att.q_rot"),
    ("model.layers.{i}.self_attn.k_rot", "blocks.{i}.att.k_rot"),
    # q k^T * scale, before soft-cap and mask: an attention-scale error shows here as one constant ratio
    ("model.layers.{i}.self_attn.scores", "blocks.{i}.att.scores"),
    ("model.layers.{i}.self_attn.probs", "blocks.{i}.att.probs"),
    ("model.layers.{i}.self_attn.context", "blocks.{i}.att.context"),
    ("model.layers.{i}.self_attn.o_proj", "blocks.{i}.att.out_proj"),
]
QK_NORM = [
    ("model.layers.{i}.self_attn.q_norm", "blocks.{i}.att.q_norm"),
    ("model.layers.{i}.self_attn.k_norm", "blocks.{i}.att.k_norm"),
]
#: :class:`~reference_pairs.common.mlp.GatedMLP`
MLP = [
    ("model.layers.{i}.mlp.gate_proj", "blocks.{i}.ff.fc1"),
    ("model.layers.{i}.mlp.up_proj", "blocks.{i}.ff.fc2"),
    ("model.layers.{i}.mlp.down_proj", "blocks.{i}.ff.fc3"),
]
#: :class:`~reference_pairs.common.blocks.SandwichBlock`'s four norms, and the residual stream after
#: attention (the input of the second pre-norm)
SANDWICH_NORMS = [
    ("model.layers.{i}.input_layernorm", "blocks.{i}.input_layernorm"),
    ("model.layers.{i}.post_attention_layernorm", "blocks.{i}.post_attention_layernorm"),
    ("model.layers.{i}.pre_feedforward_layernorm@input", "blocks.{i}.pre_feedforward_layernorm@input"),
    ("model.layers.{i}.pre_feedforward_layernorm", "blocks.{i}.pre_feedforward_layernorm"),
    ("model.layers.{i}.post_feedforward_layernorm", "blocks.{i}.post_feedforward_layernorm"),
]
LAYER_OUTPUT = [("model.layers.{i}", "blocks.{i}")]
#: the final norm, the head, and what the model's forward returns (``logits``: the root's output on
#: both sides, compared after every module; with a scale or soft-cap after the head it differs from it)
LOGITS = Node("logits", "", reference="")
FINAL = [("model.norm", "final_norm"), ("lm_head", "out_head"), LOGITS]
#: :class:`~reference_pairs.common.linear_attention.GatedDeltaNet`: the projections, the gated norm
#: and ``out_proj`` are modules on both sides; what the reference computes inside its kernel
#: functions (conv output, beta, g, q/k after the L2 norm, the delta rule's output and final state)
#: is captured by :mod:`parity.record.hf_kernels`, ours by taps of the same names
GATED_DELTANET = [
    (f"model.layers.{{i}}.linear_attn.{name}", f"blocks.{{i}}.att.{name}")
    for name in (
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "conv_out",
        "beta",
        "g",
        "q_l2norm",
        "k_l2norm",
        "delta_out",
        "recurrent_state",
        "norm",
        "out_proj",
    )
]
#: :class:`~reference_pairs.common.moe.SparseMoE`, on the layers whose feed-forward is a mixture of
#: experts. The reference's router (``mlp.gate``) returns ``(logits, weights, experts)``: its logits
#: are the module's node, the chosen experts (compared exactly, a different choice reported with the
#: reference's logit margin) and their weights its outputs 2 and 1. ``mlp.experts.{e}`` is expert
#: ``e``'s unweighted output on the tokens routed to it (zero elsewhere; captured by
#: :mod:`parity.record.hf_capture`), ``mlp.experts`` the weighted sum.
MOE = [
    Node("model.layers.{i}.mlp.gate", "blocks.{i}.ff.gate", sparse=True),
    Node(
        "model.layers.{i}.mlp.router.experts",
        "blocks.{i}.ff.router.experts",
        reference="model.layers.{i}.mlp.gate#2",
        kind="router.experts",
        sparse=True,
        chosen_from="model.layers.{i}.mlp.gate",
    ),
    Node(
        "model.layers.{i}.mlp.router.weights",
        "blocks.{i}.ff.router.weights",
        reference="model.layers.{i}.mlp.gate#1",
        kind="router.weights",
        sparse=True,
    ),
    Node("model.layers.{i}.mlp.experts.{e}", "blocks.{i}.ff.experts.{e}", kind="expert", sparse=True),
    Node("model.layers.{i}.mlp.experts", "blocks.{i}.ff.experts", kind="experts", sparse=True),
]
#: :data:`MLP` on the dense layers of a model whose other layers are MoE
DENSE_MLP = [Node(name, ours, sparse=False) for name, ours in MLP]
