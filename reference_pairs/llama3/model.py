"""Llama 3.2 from scratch (Meta, "The Llama 3 Herd of Models", arXiv:2407.21783; the book's ch. 11).

A pre-norm decoder: every block is

    h = x + att(norm1(x))          # GQA with half-split RoPE, Llama 3 frequency scaling
    y = h + ff(norm2(h))           # SwiGLU

then ``final_norm`` and ``out_head``, which is the *same* Parameter as ``tok_emb.weight`` when
``cfg["tie_word_embeddings"]`` (the 1B and 3B models). No biases anywhere, no dropout.

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, rope_base, rope_freq`` (None for plain RoPE, or a dict with ``factor,
low_freq_factor, high_freq_factor, original_context_length``), ``rms_norm_eps,
tie_word_embeddings, layer_types`` (all ``"full_attention"``), ``dtype``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..common.attention import GroupedQueryAttention
from ..common.layers import FeedForward, RMSNorm
from ..common.rope import default_inv_freq, llama3_inv_freq, rope_cos_sin


def compute_inv_freq(cfg: dict) -> torch.Tensor:
    """Inverse frequencies ``(head_dim // 2,)`` float32: Llama 3 scaled if ``cfg["rope_freq"]``, else plain."""
    freq = cfg["rope_freq"]
    if freq is None:
        return default_inv_freq(cfg["head_dim"], cfg["rope_base"])
    return llama3_inv_freq(
        cfg["head_dim"],
        cfg["rope_base"],
        freq["factor"],
        freq["low_freq_factor"],
        freq["high_freq_factor"],
        freq["original_context_length"],
    )


class Llama3RMSNorm(RMSNorm):
    """RMSNorm with Llama's rounding order: normalise in float32, cast to the input dtype, *then*
    multiply by the weight (``transformers`` ``LlamaRMSNorm``; the shared RMSNorm multiplies in
    float32 and casts last, as OLMo does). Identical in float32; in bfloat16 this is the order
    the checkpoint was trained with. Shapes: ``(..., dim)`` in and out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class TransformerBlock(nn.Module):
    """One pre-norm Llama block: ``x + att(norm1(x))``, then ``+ ff(norm2(.))``. ``(b, s, emb_dim)`` in and out."""

    def __init__(self, cfg: dict):
        super().__init__()
        dtype = cfg["dtype"]
        self.att = GroupedQueryAttention(
            cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], qk_norm=None, bias=False,
            rope_in_input_dtype=True, dtype=dtype,
        )
        self.ff = FeedForward(cfg["emb_dim"], cfg["hidden_dim"], dtype=dtype)
        self.norm1 = Llama3RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], dtype=dtype)
        self.norm2 = Llama3RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, padding_mask=None) -> torch.Tensor:
        x = x + self.att(self.norm1(x), cos, sin, padding_mask)
        x = x + self.ff(self.norm2(x))
        return x


class Llama3Model(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        super().__init__()
        if any(t != "full_attention" for t in cfg["layer_types"]) or len(cfg["layer_types"]) != cfg["n_layers"]:
            raise ValueError(f"Llama 3 has n_layers full_attention layers, got layer_types={cfg['layer_types']}")
        self.cfg = cfg
        dtype = cfg["dtype"]
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=dtype)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg["n_layers"]))
        self.final_norm = Llama3RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], dtype=dtype)
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=dtype)
        if cfg["tie_word_embeddings"]:
            self.out_head.weight = self.tok_emb.weight

    def rope_tables(self, seq_len: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos/sin ``(seq_len, head_dim)``, computed in float32 and cast to the activations' dtype,
        as ``LlamaRotaryEmbedding`` returns them. Computed per call: no buffers, so the model can
        be built on the meta device."""
        cos, sin = rope_cos_sin(compute_inv_freq(self.cfg), seq_len)
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask``: ``(batch, seq)`` 1 for real tokens, 0 for padding (keys only are masked)."""
        x = self.tok_emb(input_ids)
        cos, sin = self.rope_tables(input_ids.shape[1], x.dtype, x.device)
        for block in self.blocks:
            x = block(x, cos, sin, padding_mask=attention_mask)
        return self.out_head(self.final_norm(x))
