"""Gated DeltaNet: linear attention whose per-head state decays and is corrected by the delta rule.

Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(arXiv:2412.06464), as Qwen3-Next and Qwen3.5 use it in their ``linear_attention`` layers
(Transformers' ``Qwen3_5GatedDeltaNet``). Each value head carries a state ``S`` (``d_k x d_v``)
along the sequence. Token ``t`` brings a query ``q_t`` and key ``k_t`` (both L2-normalised), a value
``v_t``, a decay ``alpha_t = exp(g_t)`` in (0, 1] and a write strength ``beta_t`` in (0, 1):

    S_t = alpha_t S_{t-1} + k_t beta_t (v_t - alpha_t S_{t-1}^T k_t)^T    # decay, then write what S got wrong about k_t
    o_t = S_t^T q_t / sqrt(d_k)

that is ``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``: with ``alpha = 1`` the
delta rule of DeltaNet (Schlag et al. 2021, arXiv:2102.11174), with ``beta k k^T = 0`` Mamba 2's
gated linear attention. The layer around the rule (:class:`GatedDeltaNet`):

    q|k|v = silu(causal_conv(in_proj_qkv(x)))                         # depthwise, kernel K, over the fused channels
    beta = sigmoid(in_proj_b(x)),   g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = delta_rule(l2norm(q), l2norm(k), v, g, beta)
    y = out_proj(rmsnorm(o) * silu(in_proj_z(x)))                      # per value head, gated by z

A prompt runs the rule chunk by chunk (:func:`chunk_gated_delta_rule`, the chunkwise form of Yang
et al. 2024, arXiv:2406.06484); one token after a state runs it as the recurrence above
(:func:`recurrent_gated_delta_rule`). Both follow the operation order of Transformers' torch
fallbacks (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``), layouts
included, so ours rounds where the reference rounds: the same algebra in another order differs in
the last bits, and a float32 reduction even depends on the memory layout it runs over.

The state after a call is :class:`DeltaNetState`: what this layer's cache holds between calls (the
last ``K`` conv inputs and ``S``, as Transformers' ``LinearAttentionLayer`` holds them;
:class:`~reference_pairs.common.cache.LinearAttentionCacheLayer`).

Taps (see :class:`~reference_pairs.common.taps.Tap`): ``conv_out`` ``(batch, seq, channels)`` after
the conv and SiLU; ``beta`` and ``g`` ``(batch, seq, v_heads)``; ``q_l2norm``/``k_l2norm``
``(batch, seq, v_heads, d_k)`` float32, q and k after the L2 norm, repeated for every value head
they serve; ``delta_out`` ``(batch, seq, v_heads, d_v)`` the rule's output; ``recurrent_state``
``(batch, v_heads, d_k, d_v)`` float32, ``S`` after the last token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .mlp import get_activation
from .norms import GatedRMSNorm
from .taps import Tap

#: tokens per chunk of the chunked rule (``torch_chunk_gated_delta_rule``'s default, FLA's too)
CHUNK_SIZE = 64


class DeltaNetState(NamedTuple):
    """A Gated DeltaNet layer's state after some tokens: ``conv`` ``(batch, channels, K)`` the last
    conv inputs (zeros before the first token), ``recurrent`` ``(batch, v_heads, d_k, d_v)`` float32,
    the delta-rule state ``S``."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, written ``x * rsqrt(.)`` as FLA's and
    Transformers' ``l2norm`` are (eps inside the root, unlike ``F.normalize``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class CausalConv1d(nn.Module):
    """Depthwise causal convolution: output ``t`` of channel ``c`` is ``act(sum_j w[c, j] x[c, t - K + 1 + j])``,
    reading only tokens up to ``t`` (zeros, or the previous call's last inputs, on the left).

    ``x``: ``(batch, channels, seq)``; ``state``: the last ``K`` inputs before ``x`` ``(batch,
    channels, K)`` or None. Returns ``(y, new_state)``, ``y`` like ``x``. The weight is
    ``nn.Conv1d``'s ``(channels, 1, K)``, no bias.

    The state keeps ``K`` inputs, one more than the next output reads, as Transformers' cache does:
    the three calls below are the reference's (a prompt, a decode step, a prompt continued after a
    state), each slicing its output before the activation where the reference does, because the
    activation rounds differently on a strided slice than on a contiguous tensor. The sums are the same.
    """

    def __init__(self, channels: int, kernel_size: int, activation: str = "silu", dtype: torch.dtype | None = None):
        super().__init__()
        self.kernel_size, self.act_name, self.act = kernel_size, activation, get_activation(activation)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype))

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        k, seq, channels = self.kernel_size, x.shape[-1], x.shape[1]
        window = x if state is None else torch.cat([state.to(x.dtype), x], dim=-1)
        inputs = window.to(self.weight.dtype)
        if state is not None and seq == 1:  # a decode step (``causal_conv1d_update``): K + 1 inputs, the last output
            y = F.conv1d(inputs, self.weight, groups=channels)[..., -seq:]
        else:  # K - 1 zeros on the left (padding both sides, keeping the first outputs: ``causal_conv1d_fn``)
            y = F.conv1d(inputs, self.weight, padding=k - 1, groups=channels)[..., : window.shape[-1]]
        y = self.act(y).to(x.dtype)
        if y.shape[-1] != seq:  # only a call continuing a state has more: a whole-range slice would still
            y = y[..., -seq:]  # pass its gradient back packed, where the reference's arrives strided (other bits)
        return y, F.pad(window, (max(k - window.shape[-1], 0), 0))[..., -k:]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, kernel_size={self.kernel_size}, activation={self.act_name}"


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, ``chunk_size`` tokens at a time.

    In the kernels' layout, float32: ``q``, ``k`` ``(b, h, s, d_k)`` L2-normalised, ``v`` ``(b, h,
    s, d_v)``, ``g``, ``beta`` ``(b, h, s)``; ``state`` ``(b, h, d_k, d_v)`` or None (zeros).
    Returns ``(o (b, h, s, d_v), state after the last token)``.

    Inside a chunk of ``C`` tokens, with ``gamma_i = exp(g_1 + ... + g_i)`` the decay from the
    chunk's start and ``Gamma_ij = gamma_i / gamma_j`` (``j <= i``, else 0), the ``C`` sequential
    updates collapse into matrix products (the UT transform of the paper, section 3):

        T = (I + strictly_lower(diag(beta) K K^T * Gamma))^-1
        U = T diag(beta) V,    W = T diag(beta gamma) K        # what to write; how the carried S reads through the keys
        V_new = U - W S                                        # per chunk, S the state carried in
        O = diag(gamma) Q S + ((Q K^T) * Gamma) V_new
        S = gamma_C S + (diag(gamma_C / gamma) K)^T V_new

    The sequence is padded with zeros to a multiple of ``chunk_size``: a padded token has ``k = v =
    0`` and ``g = 0`` (no decay), so it writes nothing and leaves the state as it was.
    """
    b, h, s, d_k = k.shape
    d_v = v.shape[-1]
    q = q * d_k**-0.5
    pad = (chunk_size - s % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    # (b, h, chunks, C, d): one row of matrices per chunk
    q, k, k_beta, v_beta = (t.reshape(b, h, -1, chunk_size, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    log_gamma = g.reshape(b, h, -1, chunk_size).cumsum(dim=3)
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (log_gamma.unsqueeze(4) - log_gamma.unsqueeze(3)).masked_fill(later, float("-inf")).exp()  # Gamma
    beta_kk = (k_beta @ k.transpose(-1, -2)) * decay  # solve_triangular reads its strictly lower part, diagonal 1
    qk = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(beta_kk, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(beta_kk, k_beta * log_gamma.exp().unsqueeze(-1), upper=False, unitriangular=True)

    state = torch.zeros(b, h, d_k, d_v, dtype=u.dtype, device=u.device) if state is None else state.to(u)
    o = torch.zeros_like(u)
    q = q * log_gamma.exp().unsqueeze(-1)
    k = k * (log_gamma[..., -1:] - log_gamma).exp().unsqueeze(-1)
    chunk_decay = log_gamma[..., -1].exp()[..., None, None]
    for i in range(u.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        o[:, :, i] = q[:, :, i] @ state + qk[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return o.reshape(b, h, -1, d_v)[:, :, :s], state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, as the module docstring writes it (decode steps).

    Same arguments, layout and return value as :func:`chunk_gated_delta_rule` (no chunks). The
    query is divided by ``sqrt(d_k)`` here, multiplied by ``d_k**-0.5`` there, as the two
    reference functions do (the two round differently unless ``d_k`` is a power of 4).
    """
    b, h, s, d_k = k.shape
    q = q / (d_k**0.5)
    state = torch.zeros(b, h, d_k, v.shape[-1], dtype=v.dtype, device=v.device) if state is None else state.to(v)
    o = torch.zeros_like(v)
    for t in range(s):
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)  # S^T k_t
        delta = (v[:, :, t] - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return o, state


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer of a ``linear_attention`` layer (see the module docstring).

    ``n_k_heads`` query/key heads of width ``d_k``, ``n_v_heads`` value heads of width ``d_v``
    (a multiple: each q/k head serves ``n_v_heads // n_k_heads`` consecutive value heads, as
    ``repeat_interleave`` expands them); a causal conv of ``kernel_size`` with ``activation``; the
    gated output norm with ``eps``. Parameters carry Transformers' names (``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``,
    ``out_proj``): the book's Qwen3.5 reuses that component. ``gates``, ``normalize_qk`` and
    ``delta_rule`` are methods so a fault injection can replace them.
    """

    def __init__(
        self,
        d_in: int,
        n_k_heads: int,
        n_v_heads: int,
        d_k: int,
        d_v: int,
        kernel_size: int,
        *,
        eps: float = 1e-6,
        activation: str = "silu",
        chunk_size: int = CHUNK_SIZE,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"linear value heads ({n_v_heads}) must be a multiple of key heads ({n_k_heads})")
        self.n_k_heads, self.n_v_heads, self.d_k, self.d_v = n_k_heads, n_v_heads, d_k, d_v
        self.chunk_size = chunk_size
        self.key_dim, self.value_dim = n_k_heads * d_k, n_v_heads * d_v
        self.in_proj_qkv = nn.Linear(d_in, 2 * self.key_dim + self.value_dim, bias=False, dtype=dtype)
        self.in_proj_z = nn.Linear(d_in, self.value_dim, bias=False, dtype=dtype)
        self.in_proj_b = nn.Linear(d_in, n_v_heads, bias=False, dtype=dtype)
        self.in_proj_a = nn.Linear(d_in, n_v_heads, bias=False, dtype=dtype)
        self.conv1d = CausalConv1d(2 * self.key_dim + self.value_dim, kernel_size, activation, dtype=dtype)
        self.A_log = nn.Parameter(torch.empty(n_v_heads, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads, dtype=dtype))
        self.norm = GatedRMSNorm(d_v, eps=eps, dtype=dtype)
        self.out_proj = nn.Linear(self.value_dim, d_in, bias=False, dtype=dtype)
        self.conv_out, self.beta, self.g = Tap(), Tap(), Tap()
        self.q_l2norm, self.k_l2norm, self.delta_out, self.recurrent_state = Tap(), Tap(), Tap(), Tap()

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``beta = sigmoid(b)``, how strongly each token writes (activation dtype), and ``g =
        -exp(A_log) softplus(a + dt_bias)``, the log decay (<= 0, float32: ``A_log.exp()`` could
        overflow float16)."""
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k scaled to unit length per head and token (:func:`l2norm`): the state then reads and
        writes at a fixed scale, and ``beta`` alone decides how much of ``v`` a token writes."""
        return l2norm(q), l2norm(k)

    def delta_rule(self, q, k, v, g, beta, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step by step for one token after a state (decoding), in chunks otherwise (as the reference chooses)."""
        if state is not None and q.shape[2] == 1:
            return recurrent_gated_delta_rule(q, k, v, g, beta, state)
        return chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size, state)

    def forward(
        self,
        x: torch.Tensor,
        cos=None,
        sin=None,
        padding_mask: torch.Tensor | None = None,
        cache=None,
        *,
        state: DeltaNetState | None = None,
        return_state: bool = False,
    ):
        """``x``: ``(batch, seq, d_in)``; ``cos``/``sin`` are ignored (no RoPE in this layer; a block
        passes its layer type's tables, None); ``padding_mask`` ``(batch, seq)`` (with a cache: ``(batch,
        tokens so far)``, of which this call's are the last ``seq``), 1 for real tokens: padding is
        zeroed before anything reads it, so it neither writes the state nor reaches the conv, in a
        chunk continuing a cache as in a prompt.

        ``cache``: this layer's :class:`~reference_pairs.common.cache.LinearAttentionCacheLayer` (the
        slot a block passes its attention's cache in), or None. The call continues from what it holds
        (the conv's last inputs and the recurrent state; nothing before the first call), a single
        token through the recurrence, several through the chunked rule, and leaves the state after
        its last token there. ``state``: the same without a cache object (this layer's
        :class:`DeltaNetState` after earlier tokens; None: a new sequence).

        Returns ``y`` ``(batch, seq, d_in)``, or ``(y, state after these tokens)`` with ``return_state``.
        """
        if cache is not None:
            if not hasattr(cache, "recurrent_state"):
                raise ValueError(
                    f"a Gated DeltaNet layer keeps a LinearAttentionCacheLayer, not a {type(cache).__name__}"
                )
            if state is not None:
                raise ValueError("give a Gated DeltaNet its state through cache= or state=, not both")
            state = self.cached_state(cache)
        if padding_mask is not None:
            x = (x * padding_mask[:, -x.shape[1] :, None]).to(x.dtype)
        batch, seq, _ = x.shape
        mixed, conv_state = self.conv1d(self.in_proj_qkv(x).transpose(1, 2), None if state is None else state.conv)
        mixed = self.conv_out(mixed.transpose(1, 2))
        z = self.in_proj_z(x).reshape(batch, seq, -1, self.d_v)
        beta, g = self.gates(self.in_proj_b(x), self.in_proj_a(x))
        beta, g = self.beta(beta), self.g(g)
        q, k, v = self.split_mixed(mixed)
        q, k = q.reshape(batch, seq, -1, self.d_k), k.reshape(batch, seq, -1, self.d_k)
        v = v.reshape(batch, seq, -1, self.d_v)

        # the kernels' layout: q/k repeated for every value head they serve, (b, heads, seq, d) float32
        q, k = self.expand_heads(q), self.expand_heads(k)
        q, k, v, beta32, g32 = (
            t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in (q, k, v, beta, g)
        )
        q, k = self.normalize_qk(q, k)
        q = self.q_l2norm(q.transpose(1, 2)).transpose(1, 2)
        k = self.k_l2norm(k.transpose(1, 2)).transpose(1, 2)
        o, recurrent = self.delta_rule(q, k, v, g32, beta32, None if state is None else state.recurrent)
        o = self.delta_out(o.transpose(1, 2).to(x.dtype, memory_format=torch.contiguous_format))
        recurrent = self.recurrent_state(recurrent)

        o = self.norm(o.reshape(-1, self.d_v), z.reshape(-1, self.d_v)).reshape(batch, seq, -1)
        y = self.out_proj(o)
        if cache is not None:
            cache.update(conv_state, recurrent, seq)
        return (y, DeltaNetState(conv_state, recurrent)) if return_state else y

    def split_mixed(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output ``(b, s, 2 key_dim + value_dim)`` -> q, k, v, in that channel order."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return q, k, v

    def expand_heads(self, t: torch.Tensor) -> torch.Tensor:
        """q or k ``(b, s, n_k_heads, d_k)`` -> ``(b, s, n_v_heads, d_k)``: each q/k head serves
        ``n_v_heads // n_k_heads`` consecutive value heads (``repeat_interleave``)."""
        if self.n_v_heads == self.n_k_heads:
            return t
        return t.repeat_interleave(self.n_v_heads // self.n_k_heads, dim=2)

    def cached_state(self, cache) -> DeltaNetState | None:
        """The state a call continues from: what ``cache`` holds, None before its first call (an
        overridable method: a fault injection replaces it)."""
        return None if cache.recurrent_state is None else DeltaNetState(cache.conv_state, cache.recurrent_state)
