"""OLMo 3 from scratch (Allen AI, "OLMo 3", 2025; the OLMo 2 paper, arXiv:2501.00656, for post-norm and QK-norm).

What distinguishes it from Llama-style models:

* post-norm blocks: ``u = x + N_a(attn(x))``, ``y = u + N_f(ffn(u))`` (the norm acts on the branch
  output, the residual sum is never normalized);
* Q/K RMSNorm over the whole projection (``n_heads * head_dim`` wide) *before* the head split;
* ``layer_types``: sliding-window layers and full-attention layers (3:1 in the released models);
* RoPE per layer type: YaRN on the layer types listed in ``cfg["rope_scaled_layer_types"]``
  (Transformers 5 puts a checkpoint's ``rope_scaling`` on ``full_attention`` only), default RoPE
  elsewhere.

``cfg`` keys: ``vocab_size, context_length, emb_dim, n_heads, n_kv_heads, n_layers, hidden_dim,
head_dim, rms_norm_eps, sliding_window, layer_types, attention_bias, tie_word_embeddings,
rope_base, rope_local_base, rope_type ("default" | "yarn"), rope_scaled_layer_types, rope_factor,
rope_orig_max, beta_fast, beta_slow, rope_attention_factor (None: 0.1 ln(factor) + 1), dtype``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..common.attention import GroupedQueryAttention
from ..common.layer_types import SLIDING
from ..common.layers import FeedForward, RMSNorm
from ..common.rope import default_inv_freq, rope_cos_sin, yarn_attention_factor, yarn_inv_freq


def rope_params_for(cfg: dict, layer_type: str) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(head_dim // 2,)`` and cos/sin scale for one layer type."""
    base = cfg["rope_local_base"] if layer_type == SLIDING else cfg["rope_base"]
    scaled = cfg["rope_type"] == "yarn" and layer_type in cfg["rope_scaled_layer_types"]
    if not scaled:
        return default_inv_freq(cfg["head_dim"], base), 1.0
    inv_freq = yarn_inv_freq(
        cfg["head_dim"], base, cfg["rope_factor"], cfg["rope_orig_max"], cfg["beta_fast"], cfg["beta_slow"]
    )
    factor = cfg["rope_attention_factor"]
    return inv_freq, yarn_attention_factor(cfg["rope_factor"]) if factor is None else factor


class TransformerBlock(nn.Module):
    """One post-norm OLMo 3 block; ``layer_type`` decides the window (and, through cos/sin, the RoPE)."""

    def __init__(self, cfg: dict, layer_type: str):
        super().__init__()
        dtype = cfg["dtype"]
        self.layer_type = layer_type
        self.att = GroupedQueryAttention(
            cfg["emb_dim"],
            cfg["n_heads"],
            cfg["n_kv_heads"],
            cfg["head_dim"],
            qk_norm="projection",
            norm_eps=cfg["rms_norm_eps"],
            bias=cfg["attention_bias"],
            sliding_window=cfg["sliding_window"] if layer_type == SLIDING else None,
            dtype=dtype,
        )
        self.ff = FeedForward(cfg["emb_dim"], cfg["hidden_dim"], dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, padding_mask=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.att(x, cos, sin, padding_mask))
        x = x + self.post_feedforward_layernorm(self.ff(x))
        return x


class Olmo3Model(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        super().__init__()
        if len(cfg["layer_types"]) != cfg["n_layers"]:
            raise ValueError(f"layer_types has {len(cfg['layer_types'])} entries for n_layers={cfg['n_layers']}")
        self.cfg = cfg
        dtype = cfg["dtype"]
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=dtype)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, t) for t in cfg["layer_types"])
        self.final_norm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"], dtype=dtype)
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=dtype)
        if cfg["tie_word_embeddings"]:
            self.out_head.weight = self.tok_emb.weight

    def rope_tables(self, seq_len: int, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Cos/sin ``(seq_len, head_dim)`` float32 for each layer type present. Computed per call (cheap,
        and it keeps the model free of buffers so it can be built on the meta device)."""
        tables = {}
        for layer_type in set(self.cfg["layer_types"]):
            inv_freq, scale = rope_params_for(self.cfg, layer_type)
            cos, sin = rope_cos_sin(inv_freq, seq_len, scale)
            tables[layer_type] = (cos.to(device), sin.to(device))
        return tables

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask``: ``(batch, seq)`` 1 for real tokens, 0 for padding (keys only are masked)."""
        x = self.tok_emb(input_ids)
        tables = self.rope_tables(input_ids.shape[1], x.device)
        for block in self.blocks:
            x = block(x, *tables[block.layer_type], padding_mask=attention_mask)
        return self.out_head(self.final_norm(x))
