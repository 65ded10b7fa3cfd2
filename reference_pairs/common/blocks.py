"""Transformer block layouts: where the norms sit around attention and the feed-forward network.

Each block takes its attention ``att`` and feed-forward ``ff`` ready-made, and ``norm``, a
factory called once per norm (e.g. ``partial(RMSNorm, emb_dim, eps=1e-6, dtype=dtype)``), so a
family chooses the parts and the block only fixes the wiring, written as the formula reads.
``layer_type`` (``"full_attention"``, ``"sliding_attention"``) tells the model which RoPE table the
block receives. Every block maps ``(batch, seq, emb_dim)`` to the same shape; ``cos``/``sin`` are the
RoPE tables of its layer type (None: no RoPE) and ``padding_mask`` ``(batch, seq)`` marks real tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .layer_types import FULL

Norm = Callable[[], nn.Module]


class PreNormBlock(nn.Module):
    """Pre-norm: ``h = x + att(norm1(x))``, ``y = h + ff(norm2(h))``.

    Xiong et al. 2020 ("On Layer Normalization in the Transformer Architecture", arXiv:2002.04745);
    GPT-2, Llama, Qwen3, Mistral (Transformers' ``input_layernorm`` / ``post_attention_layernorm``).
    """

    def __init__(self, att: nn.Module, ff: nn.Module, norm: Norm, layer_type: str = FULL):
        super().__init__()
        self.layer_type = layer_type
        self.norm1, self.att, self.norm2, self.ff = norm(), att, norm(), ff

    def forward(self, x: torch.Tensor, cos=None, sin=None, padding_mask=None, cache=None) -> torch.Tensor:
        x = x + self.att(self.norm1(x), cos, sin, padding_mask, cache)
        x = x + self.ff(self.norm2(x))
        return x


class PostNormBlock(nn.Module):
    """Post-norm on the branch: ``h = x + N_a(att(x))``, ``y = h + N_f(ff(h))``; the residual sum
    itself is never normalised (OLMo 2, arXiv:2501.00656; OLMo 3)."""

    def __init__(self, att: nn.Module, ff: nn.Module, norm: Norm, layer_type: str = FULL):
        super().__init__()
        self.layer_type = layer_type
        self.att, self.post_attention_layernorm = att, norm()
        self.ff, self.post_feedforward_layernorm = ff, norm()

    def forward(self, x: torch.Tensor, cos=None, sin=None, padding_mask=None, cache=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.att(x, cos, sin, padding_mask, cache))
        x = x + self.post_feedforward_layernorm(self.ff(x))
        return x


class SandwichBlock(nn.Module):
    """Four norms, before and after each branch: ``h = x + N_post_att(att(N_in(x)))``,
    ``y = h + N_post_ff(ff(N_pre_ff(h)))`` (Gemma 2 report, arXiv:2408.00118; ``Gemma3DecoderLayer``).
    Keyword arguments beyond ``padding_mask`` go to the attention (Gemma 4's ``shared_kv``)."""

    def __init__(self, att: nn.Module, ff: nn.Module, norm: Norm, layer_type: str = FULL):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm, self.att, self.post_attention_layernorm = norm(), att, norm()
        self.pre_feedforward_layernorm, self.ff, self.post_feedforward_layernorm = norm(), ff, norm()

    def forward(self, x: torch.Tensor, cos=None, sin=None, padding_mask=None, cache=None, **att_kwargs) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.att(self.input_layernorm(x), cos, sin, padding_mask, cache, **att_kwargs)
        )
        x = x + self.post_feedforward_layernorm(self.ff(self.pre_feedforward_layernorm(x)))
        return x


class ParallelBlock(nn.Module):
    """Parallel branches on one norm: ``h = N(x)``, ``y = x + att(h) + ff(h)``; the FFN never sees
    this layer's attention (GPT-J, Wang & Komatsuzaki 2021; PaLM, arXiv:2204.02311 sec. 2;
    ``CohereDecoderLayer``, ``Cohere2DecoderLayer``; sums left to right as they do)."""

    def __init__(self, att: nn.Module, ff: nn.Module, norm: Norm, layer_type: str = FULL):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm, self.att, self.ff = norm(), att, ff

    def forward(self, x: torch.Tensor, cos=None, sin=None, padding_mask=None, cache=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.att(h, cos, sin, padding_mask, cache) + self.ff(h)
