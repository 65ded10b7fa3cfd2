"""Causal self-attention with grouped-query heads, optional Q/K norm and sliding windows.

GQA: Ainslie et al. 2023, arXiv:2305.13245 (MHA is the case ``n_kv_heads == n_heads``).
Sliding window semantics follow ``transformers.masking_utils.sliding_window_overlay``: query
``i`` sees key ``j`` when ``j <= i`` and ``i - j < window`` (itself plus ``window - 1`` earlier tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm, Tap
from .rope import apply_rope


def causal_mask(seq_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean ``(seq_len, seq_len)`` mask, True where query ``i`` may attend to key ``j``."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & (i - j < sliding_window)
    return allowed


class GroupedQueryAttention(nn.Module):
    """Multi-head attention where ``n_heads // n_kv_heads`` query heads share one K/V head.

    ``qk_norm``: ``None``, ``"projection"`` (one RMSNorm over the whole ``n_heads * head_dim``
    projection before the head split, OLMo 2/3) or ``"head"`` (one RMSNorm over ``head_dim`` per
    head, Qwen3/Gemma 3). KV heads are expanded with ``repeat_interleave`` so query head ``h``
    reads KV head ``h // group``, as ``transformers`` ``repeat_kv`` does.

    Taps (see :class:`~reference_pairs.common.layers.Tap`): ``q_rot``/``k_rot`` after RoPE
    ``(batch, heads, seq, head_dim)`` (K before expansion), ``probs`` the softmax output
    ``(batch, n_heads, seq, seq)``, ``context`` the head-merged output before ``out_proj``
    ``(batch, seq, n_heads * head_dim)``.
    """

    def __init__(
        self,
        d_in: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: str | None = None,
        norm_eps: float = 1e-6,
        bias: bool = False,
        sliding_window: int | None = None,
        interleaved_rope: bool = False,
        rope_in_input_dtype: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group_size = n_heads // n_kv_heads
        self.sliding_window = sliding_window
        self.interleaved_rope = interleaved_rope
        self.rope_in_input_dtype = rope_in_input_dtype
        self.qk_norm = qk_norm
        self.W_query = nn.Linear(d_in, n_heads * head_dim, bias=bias, dtype=dtype)
        self.W_key = nn.Linear(d_in, n_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.W_value = nn.Linear(d_in, n_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.out_proj = nn.Linear(n_heads * head_dim, d_in, bias=bias, dtype=dtype)
        if qk_norm == "projection":
            self.q_norm = RMSNorm(n_heads * head_dim, eps=norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(n_kv_heads * head_dim, eps=norm_eps, dtype=dtype)
        elif qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype)
        elif qk_norm is not None:
            raise ValueError(f"qk_norm must be None, 'projection' or 'head', got {qk_norm!r}")
        self.q_rot, self.k_rot, self.probs, self.context = Tap(), Tap(), Tap(), Tap()

    def _split_heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``(batch, n_kv_heads, seq, head_dim)`` -> ``(batch, n_heads, seq, head_dim)``: KV head ``g``
        serves query heads ``g * group .. (g + 1) * group - 1`` (``repeat_interleave``, not ``repeat``)."""
        return t.repeat_interleave(self.group_size, dim=1)

    def mask_scores(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Disallowed positions get the dtype's lowest finite value, as Transformers' eager masks do:
        a query row with no allowed key (a left-padding row) then gets uniform weights, not NaN."""
        return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x``: ``(batch, seq, d_in)``; ``cos``/``sin``: ``(seq, head_dim)`` or None for no RoPE;
        ``padding_mask``: ``(batch, seq)``, True (or 1) for real tokens, or None for no padding."""
        b, s, _ = x.shape
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)
        if self.qk_norm == "projection":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = self._split_heads(queries, self.n_heads)
        keys = self._split_heads(keys, self.n_kv_heads)
        values = self._split_heads(values, self.n_kv_heads)
        if self.qk_norm == "head":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if cos is not None:
            queries = apply_rope(queries, cos, sin, self.interleaved_rope, self.rope_in_input_dtype)
            keys = apply_rope(keys, cos, sin, self.interleaved_rope, self.rope_in_input_dtype)
        queries, keys = self.q_rot(queries), self.k_rot(keys)

        keys, values = self.expand_kv(keys), self.expand_kv(values)
        scores = queries @ keys.transpose(2, 3) * self.head_dim**-0.5
        allowed = causal_mask(s, self.sliding_window).to(scores.device)[None, None]
        if padding_mask is not None:
            allowed = allowed & padding_mask.bool()[:, None, None, :]
        scores = self.mask_scores(scores, allowed)
        probs = self.probs(torch.softmax(scores.float(), dim=-1).to(queries.dtype))
        context = (probs @ values).transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.out_proj(self.context(context))
