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
    * ``qk_norm_heads_first``: the per-head Q/K norm runs on ``(batch, heads, seq, head_dim)`` instead
      of ``(batch, seq, heads, head_dim)`` (``Gemma3Attention``): the same numbers, in the layout
      the reference's ``q_norm``/``k_norm`` return;
    * ``v_norm(head_dim)``: a norm on each value head (Gemma 4: ``RMSNorm(weight=False)``);
    * ``k_eq_v``: no ``W_value``; the values are the raw key projection, before ``k_norm`` and RoPE
      (Gemma 4 ``attention_k_eq_v`` on full-attention layers);
    * ``kv_shared``: no K/V projections or norms at all; ``forward`` attends to the ``shared_kv``
      it is given, the keys and values another layer computed (Gemma 4 ``num_kv_shared_layers``);
      ``keep_kv``: after each forward, ``self.kv`` holds this layer's ``(keys, values, k_start)``
      (after norm, RoPE and the cache update, before GQA expansion; ``k_start`` the sequence index
      of the first key) for the layers that share them;
    * ``softmax_in_activation_dtype``: the softmax runs on the scores in their own dtype (GPT-2's
      eager attention, ``softmax(w)`` then ``.type(v.dtype)``) instead of in float32 then cast back
      (``softmax(w, dtype=float32).to(q.dtype)``, Llama and the rest): in bfloat16 torch's two
      kernels round some probabilities one ulp apart;
    * RoPE: a layer without it gets ``cos = sin = None``. ``cos``/``sin`` narrower than ``head_dim / 2``
      rotate only the first dims (partial rotary); ``interleaved_rope`` pairs ``2i`` with ``2i + 1``
      instead of ``i`` with ``i + d/2``; ``rotate_in_float32`` upcasts q/k for the rotation
      (Cohere 2) — see :func:`~reference_pairs.common.rope.apply_rope`;

    KV heads are expanded as Transformers' ``repeat_kv`` expands them, so query head ``h`` reads KV
    head ``h // group`` (``repeat_interleave``'s order, not ``repeat``'s), in ``repeat_kv``'s memory
    layout too: a stride-0 view for one KV head, a packed copy otherwise (a matrix product over
    another layout takes another CPU kernel, which rounds otherwise on some CPUs). ``split_qkv``, ``expand_kv``, ``mask_scores``,
    ``split_gate``, ``gate_activation`` and ``rotate`` are methods so a fault injection can replace them.

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
        qk_norm_heads_first: bool = False,
        v_norm: Callable[[int], nn.Module] | None = None,
        k_eq_v: bool = False,
        kv_shared: bool = False,
        keep_kv: bool = False,
        sliding_window: int | None = None,
        fused_qkv: bool = False,
        interleaved_rope: bool = False,
        rotate_in_float32: bool = False,
        softmax_in_activation_dtype: bool = False,
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
        if qk_norm_heads_first and qk_norm != "head":
            raise ValueError("qk_norm_heads_first is a layout of the per-head Q/K norm (qk_norm='head')")
        if kv_shared and (k_eq_v or keep_kv):
            raise ValueError(
                "a kv_shared layer computes no keys or values (k_eq_v and keep_kv describe those it computes)"
            )
        if fused_qkv and (output_gate or k_eq_v or kv_shared):
            raise ValueError("fused_qkv with an output gate, K = V or shared K/V: no reference model does this")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group_size = n_heads // n_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap, self.qk_norm, self.output_gate = softcap, qk_norm, output_gate
        self.qk_norm_heads_first, self.k_eq_v, self.kv_shared, self.keep_kv = (
            qk_norm_heads_first,
            k_eq_v,
            kv_shared,
            keep_kv,
        )
        self.sliding_window = sliding_window
        self.interleaved_rope, self.rotate_in_float32 = interleaved_rope, rotate_in_float32
        self.softmax_in_activation_dtype = softmax_in_activation_dtype
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        q_width = n_heads * head_dim * (2 if output_gate else 1)
        whole = qk_norm == "projection"
        self.widths = (q_width, n_kv_heads * head_dim, n_kv_heads * head_dim)
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.W_qkv = nn.Linear(d_in, sum(self.widths), bias=bias, dtype=dtype)
        else:
            self.W_query = nn.Linear(d_in, q_width, bias=bias, dtype=dtype)
        if qk_norm is not None:
            self.q_norm = norm(n_heads * head_dim if whole else head_dim)
        if not kv_shared:
            if not fused_qkv:
                self.W_key = nn.Linear(d_in, n_kv_heads * head_dim, bias=bias, dtype=dtype)
            if not (k_eq_v or fused_qkv):
                self.W_value = nn.Linear(d_in, n_kv_heads * head_dim, bias=bias, dtype=dtype)
            if qk_norm is not None:
                self.k_norm = norm(n_kv_heads * head_dim if whole else head_dim)
            if v_norm is not None:
                self.v_norm = v_norm(head_dim)
        self.out_proj = nn.Linear(n_heads * head_dim, d_in, bias=bias, dtype=dtype)
        self.q_rot, self.k_rot, self.scores, self.probs, self.context = Tap(), Tap(), Tap(), Tap(), Tap()
        if output_gate:
            self.gate = Tap()

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``W_qkv``'s output ``(batch, seq, q + k + v widths)`` -> queries, keys, values, in that order."""
        return qkv.split(self.widths, dim=-1)

    def split_gate(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b, s, heads, 2 * head_dim)`` -> the query ``(b, s, heads, head_dim)`` and the gate ``(b, s,
        heads * head_dim)``: each head's first ``head_dim`` values are its query, the next its gate."""
        queries, gate = queries.chunk(2, dim=-1)
        return queries, gate.reshape(*gate.shape[:2], -1)

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``(batch, n_kv_heads, seq, head_dim)`` -> ``(batch, n_heads, seq, head_dim)``: KV head ``g``
        serves query heads ``g * group .. (g + 1) * group - 1`` (``repeat_interleave``'s order, not
        ``repeat``'s). Expanded then reshaped, as ``repeat_kv`` does: the same memory layout, so the
        matrix products that read it take the reference's kernel (one KV head stays a stride-0 view)."""
        if self.group_size == 1:
            return t
        b, kv, s, d = t.shape
        return t[:, :, None].expand(b, kv, self.group_size, s, d).reshape(b, kv * self.group_size, s, d)

    def rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **rope) -> torch.Tensor:
        """RoPE on queries or keys ``(batch, heads, seq, head_dim)``
        (:func:`~reference_pairs.common.rope.apply_rope`, its ``interleaved``/``upcast`` options in ``rope``)."""
        return apply_rope(t, cos, sin, **rope)

    def mask_scores(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Disallowed positions get the dtype's lowest finite value, as Transformers' eager masks do:
        a query row with no allowed key (a left-padding row) then gets uniform weights, not NaN. Added
        as a bias of 0 or that value (``eager_mask``), not filled in: the same values, and the gradient
        of a masked score flows as the reference's does (a row with no allowed key attends to every key
        uniformly, and its gradient reaches them)."""
        zero = torch.tensor(0.0, dtype=scores.dtype, device=scores.device)
        return scores + torch.where(allowed, zero, torch.finfo(scores.dtype).min)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cache=None,
        shared_kv: tuple | None = None,
    ) -> torch.Tensor:
        """``x``: ``(batch, seq, d_in)``; ``cos``/``sin``: ``(seq, rotary_dim // 2)`` or None (no RoPE);
        ``padding_mask``: ``(batch, seq)`` (with a cache: ``(batch, tokens so far)``), True (or 1) for
        real tokens, or None for no padding; ``cache``: this layer's
        :class:`~reference_pairs.common.cache.CacheLayer`, or None for a plain forward (a
        ``kv_shared`` layer keeps none); ``shared_kv`` (``kv_shared`` layers only): another layer's
        ``self.kv``, ``(keys, values[, k_start])`` with keys and values ``(batch, n_kv_heads, seq,
        head_dim)``. The ``k_rot`` tap sees the keys attention reads (with a cache: past and new, as
        the reference's do)."""
        b, s, _ = x.shape
        if self.fused_qkv:
            queries, keys, values = self.split_qkv(self.W_qkv(x))
            projected = (keys, values)
        else:
            queries, projected = self.W_query(x), None
        if self.qk_norm == "projection":
            queries = self.q_norm(queries)
        queries = queries.unflatten(-1, (self.n_heads, -1))  # (b, s, heads, head_dim [* 2])
        if self.output_gate:
            queries, gate = self.split_gate(queries)
            gate = self.gate(gate)
        queries = self._per_head_norm(self.q_norm, queries) if self.qk_norm == "head" else queries.transpose(1, 2)
        rope = dict(interleaved=self.interleaved_rope, upcast=self.rotate_in_float32)
        if cos is not None:
            queries = self.rotate(queries, cos, sin, **rope)
        q_start = 0 if cache is None else cache.seen
        if self.kv_shared:
            if shared_kv is None:
                raise ValueError("a kv_shared attention needs the (keys, values) of the layer it shares (shared_kv=)")
            keys, values, k_start = (*shared_kv, 0)[:3]
            if len(shared_kv) > 2:
                q_start = keys.shape[-2] + k_start - s  # the source layer's cache has just taken these tokens
        else:
            keys, values = self._keys_values(x, cos, sin, rope, projected)
            k_start = 0
            if cache is not None:
                keys, values, k_start = cache.update(keys, values)
        queries, keys = self.q_rot(queries), self.k_rot(keys)
        self.kv = (keys, values, k_start) if self.keep_kv else None

        keys, values = self.expand_kv(keys), self.expand_kv(values)
        scores = self.scores(queries @ keys.transpose(2, 3) * self.scale)
        if self.softcap is not None:
            scores = soft_cap(scores, self.softcap)
        k_len = keys.shape[-2]
        allowed = causal_mask(s, self.sliding_window, q_start, k_start, k_len).to(scores.device)[None, None]
        if padding_mask is not None:
            allowed = allowed & padding_mask.bool()[:, None, None, k_start : k_start + k_len]
        scores = self.mask_scores(scores, allowed)
        if self.softmax_in_activation_dtype:
            probs = self.probs(torch.softmax(scores, dim=-1).to(queries.dtype))
        else:
            probs = self.probs(torch.softmax(scores.float(), dim=-1).to(queries.dtype))
        context = self.context((probs @ values).transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))
        if self.output_gate:
            context = context * self.gate_activation(gate)
        return self.out_proj(context)

    def gate_activation(self, gate: torch.Tensor) -> torch.Tensor:
        """The output gate's activation: ``sigmoid`` (``Qwen3_5Attention``)."""
        return torch.sigmoid(gate)

    def _per_head_norm(self, norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
        """``(b, s, heads, head_dim)`` -> normalised per head, ``(b, heads, s, head_dim)``."""
        return norm(t.transpose(1, 2)) if self.qk_norm_heads_first else norm(t).transpose(1, 2)

    def _keys_values(self, x: torch.Tensor, cos, sin, rope: dict, projected=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys (normalised, rotated) and values, each ``(b, n_kv_heads, s, head_dim)``;
        ``projected``: the raw ``(keys, values)`` projections when ``W_qkv`` made them."""
        if projected is not None:
            keys, values = projected
        else:
            keys = self.W_key(x)
            values = keys if self.k_eq_v else self.W_value(x)  # K = V: the raw projection, before k_norm
        if self.qk_norm == "projection":
            keys = self.k_norm(keys)
        keys = keys.unflatten(-1, (self.n_kv_heads, self.head_dim))
        values = values.unflatten(-1, (self.n_kv_heads, self.head_dim))
        keys = self._per_head_norm(self.k_norm, keys) if self.qk_norm == "head" else keys.transpose(1, 2)
        if hasattr(self, "v_norm"):
            values = self.v_norm(values)
        if cos is not None:
            keys = self.rotate(keys, cos, sin, **rope)
        return keys, values.transpose(1, 2)
