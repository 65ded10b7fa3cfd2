"""Causal self-attention with grouped-query heads and the options the reference families add.

GQA: Ainslie et al. 2023, arXiv:2305.13245 (MHA is the case ``n_kv_heads == n_heads``).
Sliding window semantics follow ``transformers.masking_utils.sliding_window_overlay``: query
``i`` sees key ``j`` when ``j <= i`` and ``i - j < window`` (itself plus ``window - 1`` earlier tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .norms import RMSNorm
from .rope import apply_rope
from .taps import Tap


def causal_mask(
    seq_len: int, sliding_window: int | None = None, q_start: int = 0, k_start: int = 0, k_len: int | None = None
) -> torch.Tensor:
    """Boolean ``(seq_len, k_len)`` mask, True where query ``i`` may attend to key ``j``; queries are the
    sequence indices ``q_start ..``, keys ``k_start ..`` (a KV cache reads keys from earlier steps)."""
    i = q_start + torch.arange(seq_len)[:, None]
    j = k_start + torch.arange(seq_len if k_len is None else k_len)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & (i - j < sliding_window)
    return allowed


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: squashes ``x`` smoothly into ``(-cap, cap)`` (Gemma 2 report,
    arXiv:2408.00118, attention and final-logit soft-capping; divide, tanh, multiply, as
    ``Gemma3`` ``eager_attention_forward`` and ``Gemma3ForCausalLM`` do)."""
    return torch.tanh(x / cap) * cap


class GroupedQueryAttention(nn.Module):
    """Multi-head attention where ``n_heads // n_kv_heads`` query heads share one K/V head.

    The computation, per head: ``softmax(mask(cap(scale * q k^T))) v``, then heads merged,
    optionally gated, and ``out_proj``. Options (each off by default):

    * ``scale``: the score multiplier, default ``head_dim**-0.5``; Gemma 3 passes
      ``query_pre_attn_scalar**-0.5``;
    * ``softcap``: attention-logit soft-cap ``cap * tanh(s / cap)`` after the scale, before the
      mask (Gemma 2/3, ``attn_logit_softcapping``);
    * ``qk_norm``: ``"projection"`` (one norm over the whole ``n_heads * head_dim`` projection before
      the head split, OLMo 2/3) or ``"head"`` (one norm over ``head_dim`` shared by every head,
      Qwen3, Gemma 3, Qwen3.5); ``norm(dim)`` builds it (default ``RMSNorm(dim)``; pass e.g.
      ``partial(RMSNorm, eps=1e-6, unit_offset=True, dtype=...)`` for another variant);
    * ``output_gate`` (Qwen3.5 full attention): ``W_query`` is ``2 * n_heads * head_dim`` wide and
      splits *per head* into the query (first ``head_dim``) and a gate (second ``head_dim``); the
      merged context is multiplied by ``sigmoid(gate)`` before ``out_proj`` (``Qwen3_5Attention``);
    * ``sliding_window``: keys more than ``window - 1`` positions back are masked;
    * ``fused_qkv``: one projection ``W_qkv`` whose output is ``[q | k | v]`` along its last axis
      (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) instead of ``W_query``/``W_key``/``W_value``: one
      matrix product, rounded as the reference rounds it (three products over the column blocks of
      the same matrix differ in bfloat16 at real widths: the kernel blocks the wider product
      differently); ``split_qkv`` cuts it;
    * RoPE: a layer without it gets ``cos = sin = None``. ``cos``/``sin`` narrower than ``head_dim / 2``
      rotate only the first dims (partial rotary); ``interleaved_rope`` pairs ``2i`` with ``2i + 1``
      instead of ``i`` with ``i + d/2``; ``rotate_in_float32`` upcasts q/k for the rotation
      (Cohere 2) — see :func:`~reference_pairs.common.rope.apply_rope`;

    KV heads are expanded with ``repeat_interleave`` so query head ``h`` reads KV head
    ``h // group``, as Transformers' ``repeat_kv`` does. ``split_qkv``, ``expand_kv``, ``mask_scores``
    and ``split_gate`` are methods so a fault injection can replace them.

    Taps (see :class:`~reference_pairs.common.taps.Tap`): ``q_rot``/``k_rot`` after RoPE (the
    unrotated q/k without RoPE) ``(batch, heads, seq, head_dim)``, K before expansion; ``scores``
    ``(q @ k^T) * scale`` before soft-cap and mask ``(batch, n_heads, q_len, k_len)``; ``probs``
    the softmax output, same shape; ``context`` the head-merged output before the gate and
    ``out_proj`` ``(batch, seq, n_heads * head_dim)``; with ``output_gate``, ``gate`` the gate
    before its sigmoid, same shape as ``context``.
    """

    def __init__(
        self,
        d_in: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        qk_norm: str | None = None,
        norm: Callable[[int], nn.Module] = RMSNorm,
        output_gate: bool = False,
        sliding_window: int | None = None,
        fused_qkv: bool = False,
        interleaved_rope: bool = False,
        rotate_in_float32: bool = False,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if qk_norm not in (None, "projection", "head"):
            raise ValueError(f"qk_norm must be None, 'projection' or 'head', got {qk_norm!r}")
        if output_gate and qk_norm == "projection":
            raise ValueError("output_gate with a whole-projection Q norm: no reference model does this")
        if fused_qkv and output_gate:
            raise ValueError("fused_qkv with an output gate: no reference model does this")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group_size = n_heads // n_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap, self.qk_norm, self.output_gate = softcap, qk_norm, output_gate
        self.sliding_window = sliding_window
        self.interleaved_rope, self.rotate_in_float32 = interleaved_rope, rotate_in_float32
        q_width = n_heads * head_dim * (2 if output_gate else 1)
        self.widths = (q_width, n_kv_heads * head_dim, n_kv_heads * head_dim)
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.W_qkv = nn.Linear(d_in, sum(self.widths), bias=bias, dtype=dtype)
        else:
            self.W_query = nn.Linear(d_in, q_width, bias=bias, dtype=dtype)
            self.W_key = nn.Linear(d_in, n_kv_heads * head_dim, bias=bias, dtype=dtype)
            self.W_value = nn.Linear(d_in, n_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.out_proj = nn.Linear(n_heads * head_dim, d_in, bias=bias, dtype=dtype)
        if qk_norm is not None:
            whole = qk_norm == "projection"
            self.q_norm = norm(n_heads * head_dim if whole else head_dim)
            self.k_norm = norm(n_kv_heads * head_dim if whole else head_dim)
        self.q_rot, self.k_rot, self.scores, self.probs, self.context = Tap(), Tap(), Tap(), Tap(), Tap()
        if output_gate:
            self.gate = Tap()

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``W_qkv``'s output ``(batch, seq, q + k + v widths)`` -> queries, keys, values, in that order."""
        return qkv.split(self.widths, dim=-1)

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``(batch, n_kv_heads, seq, head_dim)`` -> ``(batch, n_heads, seq, head_dim)``: KV head ``g``
        serves query heads ``g * group .. (g + 1) * group - 1`` (``repeat_interleave``, not ``repeat``)."""
        return t.repeat_interleave(self.group_size, dim=1)

    def split_gate(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b, s, heads, 2 * head_dim)`` -> the query ``(b, s, heads, head_dim)`` and the gate ``(b, s,
        heads * head_dim)``: each head's first ``head_dim`` values are its query, the next its gate."""
        queries, gate = queries.chunk(2, dim=-1)
        return queries, gate.reshape(*gate.shape[:2], -1)

    def mask_scores(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Disallowed positions get the dtype's lowest finite value, as Transformers' eager masks do:
        a query row with no allowed key (a left-padding row) then gets uniform weights, not NaN."""
        return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """``x``: ``(batch, seq, d_in)``; ``cos``/``sin``: ``(seq, rotary_dim // 2)`` or None (no RoPE);
        ``padding_mask``: ``(batch, seq)`` (with a cache: ``(batch, tokens so far)``), True (or 1) for
        real tokens, or None for no padding; ``cache``: this layer's
        :class:`~reference_pairs.common.cache.CacheLayer`, or None for a plain forward. The ``k_rot``
        tap sees the keys attention reads (with a cache: past and new, as the reference's do)."""
        b, s, _ = x.shape
        if self.fused_qkv:
            queries, keys, values = self.split_qkv(self.W_qkv(x))
        else:
            queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)
        if self.qk_norm == "projection":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = queries.unflatten(-1, (self.n_heads, -1))  # (b, s, heads, head_dim [* 2])
        keys = keys.unflatten(-1, (self.n_kv_heads, self.head_dim))
        values = values.unflatten(-1, (self.n_kv_heads, self.head_dim))
        if self.output_gate:
            queries, gate = self.split_gate(queries)
            gate = self.gate(gate)
        if self.qk_norm == "head":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys, values = queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if cos is not None:
            rope = dict(interleaved=self.interleaved_rope, upcast=self.rotate_in_float32)
            queries, keys = apply_rope(queries, cos, sin, **rope), apply_rope(keys, cos, sin, **rope)
        queries, q_start, k_start = self.q_rot(queries), 0, 0
        if cache is not None:
            q_start = cache.seen
            keys, values, k_start = cache.update(keys, values)
        keys = self.k_rot(keys)

        keys, values = self.expand_kv(keys), self.expand_kv(values)
        scores = self.scores(queries @ keys.transpose(2, 3) * self.scale)
        if self.softcap is not None:
            scores = soft_cap(scores, self.softcap)
        k_len = keys.shape[-2]
        allowed = causal_mask(s, self.sliding_window, q_start, k_start, k_len).to(scores.device)[None, None]
        if padding_mask is not None:
            allowed = allowed & padding_mask.bool()[:, None, None, k_start : k_start + k_len]
        scores = self.mask_scores(scores, allowed)
        probs = self.probs(torch.softmax(scores.float(), dim=-1).to(queries.dtype))
        context = self.context((probs @ values).transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))
        if self.output_gate:
            context = context * torch.sigmoid(gate)
        return self.out_proj(context)
