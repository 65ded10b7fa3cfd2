"""GPT-2 from scratch (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners";
the book's ch. 4, loaded with OpenAI's weights in ch. 5.5).

A pre-norm decoder with learned absolute positions: ``x = tok_emb(ids) + pos_emb(positions)``, then
every block is

    h = x + att(norm1(x))          # MHA with biases, no RoPE, one fused q|k|v projection
    y = h + ff(norm2(h))           # fc2(gelu_new(fc1(.))), with biases

then ``final_norm`` and ``out_head``, the *same* Parameter as ``tok_emb.weight``. The norms are
LayerNorms with bias, computed by torch's kernel in the activation dtype (``nn.LayerNorm``); the
activation is GELU's tanh approximation written op by op (``gelu_new``); the softmax runs in the
activation dtype, as GPT-2's eager attention runs it (in bfloat16 torch's kernel for it rounds some
probabilities one ulp away from a float32 softmax cast back). Transformers stores the projections as
``Conv1D`` ``(in, out)`` matrices; ours are ``nn.Linear``, which the loader fills with transposed
views. The fused projection ``W_qkv`` (``c_attn``) keeps GPT-2's one matrix product: three
products over its column blocks round differently in bfloat16 at the released widths.

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_layers, hidden_dim,
layer_norm_eps, activation, tie_word_embeddings, scale_attn_weights,
scale_attn_by_inverse_layer_idx, dtype``.
"""

from __future__ import annotations

from functools import partial

from ..common.attention import GroupedQueryAttention
from ..common.blocks import PreNormBlock
from ..common.decoder import DecoderModel
from ..common.layer_types import FULL
from ..common.mlp import MLP
from ..common.norms import LayerNorm


def attention_scale(cfg: dict, layer: int) -> float:
    """``head_dim**-0.5`` (1 without ``scale_attn_weights``), divided by ``layer + 1`` with
    ``scale_attn_by_inverse_layer_idx``, as ``GPT2Attention.scaling`` computes it (Python floats, that order)."""
    scale = (cfg["emb_dim"] // cfg["n_heads"]) ** -0.5 if cfg["scale_attn_weights"] else 1.0
    if cfg["scale_attn_by_inverse_layer_idx"]:
        scale /= float(layer + 1)
    return scale


def transformer_block(cfg: dict, layer: int) -> PreNormBlock:
    """One pre-norm block: ``x + att(norm1(x))``, then ``+ ff(norm2(.))``."""
    dtype, emb_dim, n_heads = cfg["dtype"], cfg["emb_dim"], cfg["n_heads"]
    att = GroupedQueryAttention(
        emb_dim,
        n_heads,
        n_heads,
        emb_dim // n_heads,
        scale=attention_scale(cfg, layer),
        fused_qkv=True,
        bias=True,
        softmax_in_activation_dtype=True,
        dtype=dtype,
    )
    ff = MLP(emb_dim, cfg["hidden_dim"], activation=cfg["activation"], dtype=dtype)
    norm = partial(LayerNorm, emb_dim, eps=cfg["layer_norm_eps"], bias=True, fused=True, dtype=dtype)
    return PreNormBlock(att, ff, norm)


class GPTModel(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        blocks = [transformer_block(cfg, i) for i in range(cfg["n_layers"])]
        final_norm = LayerNorm(cfg["emb_dim"], eps=cfg["layer_norm_eps"], bias=True, fused=True, dtype=cfg["dtype"])
        super().__init__(cfg, blocks, final_norm, learned_positions=True)

    def rope_parameters(self) -> dict[str, dict | None]:
        return {FULL: None}  # positions are learned and added to the embeddings
