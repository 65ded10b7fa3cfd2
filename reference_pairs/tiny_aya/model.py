"""Tiny Aya from scratch (Cohere Labs, "Tiny Aya: Bridging Scale and Multilingual Depth", 2026,
arXiv:2603.11510; the Command R / Cohere 2 architecture of ``transformers.Cohere2ForCausalLM``).

What distinguishes it from Llama-style models:

* parallel blocks (GPT-J, Wang & Komatsuzaki 2021; PaLM, arXiv:2204.02311 sec. 2): one norm,
  then attention and the FFN both read the same normalized input, ``h = N(x)``,
  ``y = x + A(h) + F(h)`` (``Cohere2DecoderLayer``); the FFN never sees this layer's attention;
* the norm is a LayerNorm with a weight and no bias: it subtracts the mean (Ba et al. 2016), it is
  not an RMSNorm, computed in float32 (``Cohere2LayerNorm``);
* RoPE (Su et al. 2021, arXiv:2104.09864) with even/odd pairing, dimension ``2i`` rotating with
  ``2i + 1`` (the RoFormer paper's layout; ``Cohere2RotaryEmbedding`` repeat-interleaves the
  angles), applied on ``sliding_attention`` layers only: ``full_attention`` layers use no
  positional rotation at all ("NoPE") but keep the causal mask (``Cohere2Attention``);
* logits are ``out_head(final_norm(x)) * logit_scale`` (``Cohere2ForCausalLM.forward``), and the
  output head is tied to the token embedding in the released models.

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, layer_norm_eps, sliding_window, layer_types, attention_bias, tie_word_embeddings,
rope_type ("default" only), rope_base, logit_scale, dtype``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..common.attention import GroupedQueryAttention
from ..common.layer_types import SLIDING
from ..common.layers import FeedForward, LayerNorm
from ..common.rope import default_inv_freq, rope_cos_sin


class TransformerBlock(nn.Module):
    """One parallel Tiny Aya block: ``h = input_layernorm(x)``, ``y = x + att(h) + ff(h)``.

    ``layer_type`` decides the window and whether the block rotates q/k (``use_rope``: sliding
    layers only). Shapes: ``x`` ``(batch, seq, emb_dim)`` -> same.
    """

    def __init__(self, cfg: dict, layer_type: str):
        super().__init__()
        dtype = cfg["dtype"]
        self.layer_type = layer_type
        self.use_rope = layer_type == SLIDING
        self.input_layernorm = LayerNorm(cfg["emb_dim"], eps=cfg["layer_norm_eps"], bias=False, dtype=dtype)
        self.att = GroupedQueryAttention(
            cfg["emb_dim"],
            cfg["n_heads"],
            cfg["n_kv_heads"],
            cfg["head_dim"],
            bias=cfg["attention_bias"],
            sliding_window=cfg["sliding_window"] if layer_type == SLIDING else None,
            interleaved_rope=True,
            dtype=dtype,
        )
        self.ff = FeedForward(cfg["emb_dim"], cfg["hidden_dim"], dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, padding_mask=None) -> torch.Tensor:
        """``cos``/``sin``: ``(seq, head_dim)`` interleaved tables; ignored unless ``use_rope``."""
        h = self.input_layernorm(x)
        if not self.use_rope:
            cos = sin = None
        return x + self.att(h, cos, sin, padding_mask) + self.ff(h)


class TinyAyaModel(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``, already
    multiplied by ``logit_scale``.

    ``interleaved_rope`` (True for every Cohere model) selects the even/odd RoPE layout of the
    tables; the attention modules carry the same flag for the rotation.
    """

    def __init__(self, cfg: dict):
        super().__init__()
        if len(cfg["layer_types"]) != cfg["n_layers"]:
            raise ValueError(f"layer_types has {len(cfg['layer_types'])} entries for n_layers={cfg['n_layers']}")
        if cfg["rope_type"] != "default":
            raise ValueError(f"rope_type {cfg['rope_type']!r} is not supported (Tiny Aya uses 'default')")
        self.cfg = cfg
        dtype = cfg["dtype"]
        self.logit_scale = cfg["logit_scale"]
        self.interleaved_rope = True
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=dtype)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, t) for t in cfg["layer_types"])
        self.final_norm = LayerNorm(cfg["emb_dim"], eps=cfg["layer_norm_eps"], bias=False, dtype=dtype)
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=dtype)
        if cfg["tie_word_embeddings"]:
            self.out_head.weight = self.tok_emb.weight

    def rope_tables(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos/sin ``(seq_len, head_dim)`` for positions ``0 .. seq_len - 1``, angles in float32, then
        rounded to ``dtype`` as ``Cohere2RotaryEmbedding`` returns them (the rotation itself runs in
        float32). Computed per call, so the model has no buffers and can be built on the meta device."""
        inv_freq = default_inv_freq(self.cfg["head_dim"], self.cfg["rope_base"])
        cos, sin = rope_cos_sin(inv_freq, seq_len, interleaved=self.interleaved_rope)
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask``: ``(batch, seq)`` 1 for real tokens, 0 for padding (keys only are masked)."""
        x = self.tok_emb(input_ids)
        cos, sin = self.rope_tables(input_ids.shape[1], x.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, padding_mask=attention_mask)
        return self.out_head(self.final_norm(x)) * self.logit_scale
