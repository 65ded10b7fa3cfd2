"""Weight-table entries every family shares: checkpoint key template -> our parameter path (``{i}`` =
layer), applied by :func:`parity.model.weights.apply_weight_table`. A family's table is these plus what
differs (its norms); entries for parts a config may lack (biases, an untied head) are harmless when
both sides lack them."""

from __future__ import annotations

from parity.model.weights import Split

EMBED = {"model.embed_tokens.weight": "tok_emb.weight"}
#: :class:`~reference_pairs.common.attention.GroupedQueryAttention` (biases only where the config has them)
ATTENTION = {
    f"model.layers.{{i}}.self_attn.{hf}.{p}": f"blocks.{{i}}.att.{ours}.{p}"
    for hf, ours in [("q_proj", "W_query"), ("k_proj", "W_key"), ("v_proj", "W_value"), ("o_proj", "out_proj")]
    for p in ("weight", "bias")
}
QK_NORM = {
    "model.layers.{i}.self_attn.q_norm.weight": "blocks.{i}.att.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blocks.{i}.att.k_norm.weight",
}
#: :class:`~reference_pairs.common.blocks.SandwichBlock`'s four norms, under the same names on both sides
SANDWICH_NORMS = {
    f"model.layers.{{i}}.{name}.weight": f"blocks.{{i}}.{name}.weight"
    for name in (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )
}
#: the gated feed-forward (``fc1`` gate, ``fc2`` up, ``fc3`` down)
MLP = {
    "model.layers.{i}.mlp.gate_proj.weight": "blocks.{i}.ff.fc1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blocks.{i}.ff.fc2.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blocks.{i}.ff.fc3.weight",
}
#: final norm and output head (a tied head is the embedding's Parameter in ours; the checkpoint may
#: omit ``lm_head.weight`` then)
FINAL = {"model.norm.weight": "final_norm.weight", "lm_head.weight": "out_head.weight"}
#: :class:`~reference_pairs.common.linear_attention.GatedDeltaNet`, a ``linear_attention`` layer's
#: token mixer (it keeps Transformers' parameter names)
GATED_DELTANET = {
    f"model.layers.{{i}}.linear_attn.{name}": f"blocks.{{i}}.att.{name}"
    for name in (
        "in_proj_qkv.weight",
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "conv1d.weight",
        "A_log",
        "dt_bias",
        "norm.weight",
        "out_proj.weight",
    )
}
#: :class:`~reference_pairs.common.moe.SparseMoE`: the router, and Transformers 5's fused 3-D experts
#: (``gate_up_proj`` ``(E, 2I, H)``, gate rows first; ``down_proj`` ``(E, H, I)``) split into one gated
#: MLP per expert, as views
MOE = {
    "model.layers.{i}.mlp.gate.weight": "blocks.{i}.ff.gate.weight",
    "model.layers.{i}.mlp.experts.gate_up_proj": Split(
        ("blocks.{i}.ff.experts.{e}.fc1.weight", "blocks.{i}.ff.experts.{e}.fc2.weight")
    ),
    "model.layers.{i}.mlp.experts.down_proj": Split(("blocks.{i}.ff.experts.{e}.fc3.weight",)),
}
