"""Gemma 4 fault catalogue for ``parity selftest gemma4``: the test suite's faults and ones reported in
public projects (each naming its source). Each mutates only the pair's own objects."""

from __future__ import annotations

import types

import torch

from parity.selftest.faults import Fault

from ..common.faults import (
    f07_repeat_kv,
    f08_untied_head,
    f10_masked_neg_inf,
)
from ..common.norms import RMSNorm
from .model import FULL

ATT = "model.layers.{}.self_attn"
FIRST_FULL, FIRST_SHARED = 2, 3  # in the tiny configs: layers 0, 1 sliding, 2 full; 3 <- 1, 4 <- 1, 5 <- 2
BF16 = (("dtype", torch.bfloat16),)


def _gemma3_norms(pair):
    """Every weighted RMSNorm multiplies by 1 + w (Gemma 3's norm carried into Gemma 4, which uses w)."""
    for norm in pair.ours.modules():
        if isinstance(norm, RMSNorm) and norm.weight is not None:
            norm.unit_offset = True


def _embedding_scale_in_float32(pair):
    """The sqrt(emb_dim) normaliser multiplied in float32, then cast (Transformers rounds it to bfloat16 first)."""
    emb = pair.ours.tok_emb

    def forward(self, input_ids):
        x = torch.nn.functional.embedding(input_ids, self.weight)
        return (x.float() * self.scale).to(x.dtype)

    emb.forward = types.MethodType(forward, emb)


def _full_layers_rope(params: dict):
    def inject(pair):
        correct = pair.ours.rope_parameters
        pair.ours.rope_parameters = lambda: {**correct(), FULL: {**params, "rope_theta": pair.source.cfg["rope_base"]}}

    return inject


def _rotary_dims_paired_among_themselves(pair):
    """Full layers rotate their first ``partial * head_dim`` dims as a head of their own, pairing
    ``(i, i + rotary_dim/2)``, with the right frequencies: proportional RoPE built as ordinary partial
    rotary, its frequency table not padded with zeros to head_dim / 2 (Megatron-Bridge #4195)."""
    ours, n = (
        pair.ours,
        int(pair.source.cfg["rope_global_partial_rotary_factor"] * pair.source.cfg["global_head_dim"] // 2),
    )
    tables = ours.rope_tables

    def rope_tables(positions, device, dtype):
        out = tables(positions, device, dtype)
        cos, sin = out[FULL]
        return {**out, FULL: (cos[..., :n], sin[..., :n])}

    ours.rope_tables = rope_tables


def _kv_from_layer(consumer: int, source: int):
    def inject(pair):
        pair.ours.blocks[source].att.keep_kv = True
        pair.ours.blocks[consumer].kv_source = source

    return inject


def _shared_layers_project_their_own_kv(pair):
    """KV-shared layers compute keys and values from their own input (with their source layer's
    projections) instead of reusing the source layer's (mlx-swift-lm #333, mlx-lm #1702)."""
    for block in pair.ours.blocks:
        if block.kv_source is None:
            continue
        att, source = block.att, pair.ours.blocks[block.kv_source].att
        forward = att.forward

        def own_kv(
            self, x, cos=None, sin=None, padding_mask=None, cache=None, shared_kv=None, _src=source, _fwd=forward
        ):
            rope = dict(interleaved=_src.interleaved_rope, upcast=_src.rotate_in_float32)
            return _fwd(x, cos, sin, padding_mask, cache, shared_kv=_src._keys_values(x, cos, sin, rope))

        att.forward = types.MethodType(own_kv, att)


def _per_layer_branch_before_mlp(pair):
    """The per-layer input branch reads the residual stream after attention (before the FFN) instead of
    after the FFN; its output is still added at the end of the block."""

    def forward(self, x, cos=None, sin=None, padding_mask=None, cache=None, per_layer_input=None, shared_kv=None):
        x = x + self.post_attention_layernorm(
            self.att(self.input_layernorm(x), cos, sin, padding_mask, cache, shared_kv=shared_kv)
        )
        branch = self.post_per_layer_input_norm(
            self.per_layer_projection(self.act(self.per_layer_input_gate(x)) * per_layer_input)
        )
        x = x + self.post_feedforward_layernorm(self.ff(self.pre_feedforward_layernorm(x)))
        return (x + branch) * self.layer_scalar

    for block in pair.ours.blocks:
        block.forward = types.MethodType(forward, block)


def _per_layer_inputs_unscaled(pair):
    """Per-layer inputs summed without the 1/sqrt(2) (projection + embedding, not their mean-preserving sum)."""
    ours = pair.ours
    correct = ours.per_layer_inputs
    ours.per_layer_inputs = lambda input_ids, x: correct(input_ids, x) * 2.0**0.5


def _per_layer_inputs_one_layer_off(pair):
    """Layer i reads the per-layer input of layer i + 1 (a packed ``n_layers * width`` table unpacked
    one slice off)."""
    ours = pair.ours
    correct = ours.per_layer_inputs
    ours.per_layer_inputs = lambda input_ids, x: correct(input_ids, x).roll(-1, dims=2)


def _scale_from_head_dim(pair):
    """The attention scale head_dim ** -0.5 (a Llama/Gemma 3 habit) where Gemma 4 uses 1.0."""
    for block in pair.ours.blocks:
        block.att.scale = block.att.head_dim**-0.5


def _no_layer_scalar(pair):
    """The per-layer output scalar left out (a persistent buffer, not a parameter: converters drop it)."""
    for block in pair.ours.blocks:
        block.layer_scalar = torch.nn.Parameter(torch.ones_like(block.layer_scalar), requires_grad=False)


def _no_final_softcap(pair):
    pair.ours.final_softcap = None


FAULTS = (
    Fault(
        "gemma3-norm",
        "every weighted RMSNorm multiplies by 1 + w (Gemma 3's) instead of w",
        "tiny",
        _gemma3_norms,
        "model.per_layer_projection_norm",
        "norm_weight_offset",
        scope="model.*norm",
    ),
    Fault(
        "embed-scale-float32",
        "embedding normaliser sqrt(emb_dim) kept in float32 instead of rounded to bfloat16 (bfloat16 pair)",
        "tiny",
        _embedding_scale_in_float32,
        "model.embed_tokens",
        "rounding_order",
        source="transformers #29402",
        overrides=BF16,
    ),
    Fault(
        "partial-rotary-whole-head",
        "full layers rotate every pair of the head (default RoPE) instead of the first 25% (proportional)",
        "tiny",
        _full_layers_rope({"rope_type": "default"}),
        f"{ATT.format(FIRST_FULL)}.q_rot",
        "rope_partial",
        scope=f"{ATT.format('*')}.[qk]_rot",
    ),
    Fault(
        "proportional-as-partial",
        "proportional RoPE built as ordinary partial rotary: the first 25% of dims rotate as a head of their own",
        "tiny",
        _rotary_dims_paired_among_themselves,
        f"{ATT.format(FIRST_FULL)}.q_rot",
        "rope_partial",
        scope=f"{ATT.format('*')}.[qk]_rot",
        source="Megatron-Bridge #4195",
    ),
    Fault(
        "kv-wrong-layer",
        "layer 3 reads the keys and values of layer 0 instead of layer 1",
        "tiny",
        _kv_from_layer(FIRST_SHARED, 0),
        f"{ATT.format(FIRST_SHARED)}.k_rot",
        "kv_sharing",
        scope=ATT.format(FIRST_SHARED),
    ),
    Fault(
        "kv-own-projection",
        "KV-shared layers project their own keys and values instead of reusing their source layer's",
        "tiny",
        _shared_layers_project_their_own_kv,
        f"{ATT.format(FIRST_SHARED)}.k_rot",
        "kv_sharing",
        scope=f"{ATT.format('[345]')}",
        source="mlx-swift-lm #333, mlx-lm #1702",
    ),
    Fault(
        "per-layer-branch-before-mlp",
        "the per-layer input branch reads the residual stream before the FFN instead of after it",
        "tiny",
        _per_layer_branch_before_mlp,
        "model.layers.0.per_layer_input_gate@input",
        "block_layout",
        scope="model.layers.*.per_layer_input_gate",
    ),
    Fault(
        "per-layer-inputs-unscaled",
        "per-layer inputs summed without the 1/sqrt(2) scale",
        "tiny",
        _per_layer_inputs_unscaled,
        "model.layers.0@per_layer_input",
        "scale",
        scope="model.layers.*@per_layer_input",
    ),
    Fault(
        "per-layer-inputs-one-layer-off",
        "layer i reads the per-layer input of layer i + 1",
        "tiny",
        _per_layer_inputs_one_layer_off,
        "model.layers.0@per_layer_input",
        "layer_offset",
        scope="model.layers.*@per_layer_input",
    ),
    Fault(
        "scale-from-head-dim",
        "attention scale head_dim ** -0.5 instead of Gemma 4's 1.0",
        "tiny",
        _scale_from_head_dim,
        f"{ATT.format(0)}.scores",
        "attention_scale",
        scope=f"{ATT.format('*')}.scores",
    ),
    Fault(
        "layer-scalar-dropped",
        "each layer's output not multiplied by its layer_scalar",
        "tiny",
        _no_layer_scalar,
        "model.layers.0",
        "scale",
        scope="model.layers.[0-9]",
    ),
    Fault(
        "final-softcap-dropped", "final logit soft-cap (30) not applied", "tiny", _no_final_softcap, "logits", "softcap"
    ),
    f07_repeat_kv(ATT, "k-eq-v"),
    f08_untied_head(),
    f10_masked_neg_inf(ATT),
)
