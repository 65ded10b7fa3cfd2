"""Mixture-of-experts feed-forward: a router picks ``k`` of ``n`` experts for every token, each expert
a gated MLP, and the token's output is their outputs summed, weighted by the router.

Shazeer et al. 2017 ("Outrageously Large Neural Networks", arXiv:1701.06538); Mixtral (arXiv:2401.04088);
Qwen3-MoE (Qwen3 technical report, arXiv:2505.09388): softmax over *all* experts in float32, top-k,
optionally renormalised over the chosen ``k`` (``norm_topk_prob``), the weights cast back to the
activation dtype. The book's chapter keeps one small SwiGLU module per expert; so does
:class:`Experts` (a checkpoint's fused 3-D expert tensors are split into them by the loader).

Operation order follows Transformers 5's eager experts loop (``Qwen3MoeExperts.forward``), so the
block is bit-exact in float32 and bfloat16: experts in ascending index order; each expert's tokens
gathered in the order ``torch.where`` lists them on its ``(k, tokens)`` mask (first-choice tokens
first); gate and up in one product (:class:`~reference_pairs.common.mlp.GatedMLP` ``fused_gate_up``);
the weighted output accumulated with ``index_add_`` into zeros in the activation dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from .mlp import GatedMLP
from .taps import Tap


class TopKRouter(nn.Module):
    """Router logits ``(tokens, n_experts)`` -> ``(weights, experts)``, both ``(tokens, k)``.

    ``softmax`` over every expert in float32, ``topk`` (largest first), with ``norm_topk_prob``
    the chosen probabilities divided by their sum (in float32), then the weights cast to the
    logits' dtype (``Qwen3MoeTopKRouter``). Taps: ``weights`` and ``experts`` (the chosen indices,
    int64, largest probability first).
    """

    def __init__(self, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.experts, self.weights = Tap(), Tap()

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.weights(weights.to(logits.dtype)), self.experts(chosen)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


class Expert(GatedMLP):
    """One expert: a gated MLP (gate and up in one product) run on the tokens routed to it.

    ``forward(x, tokens)``: ``x`` ``(n_tokens, emb_dim)`` holds every token, ``tokens`` the indices
    routed here. The output is laid out over every token, ``(n_tokens, emb_dim)``, zero on tokens
    routed elsewhere, so it lines up token by token with the reference's per-expert node.
    """

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        out[tokens] = super().forward(x[tokens])
        return out


class Experts(nn.ModuleList):
    """The experts of one layer, ``experts[e]`` an :class:`Expert`; ``forward(x, weights, chosen)``
    combines them: ``x`` ``(n_tokens, emb_dim)``, ``weights``/``chosen`` ``(n_tokens, k)``."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):  # ascending expert index: the reference's summation order
            slot, tokens = torch.where(e == chosen.T)  # first-choice tokens first, as the reference gathers
            y = expert(x, tokens)[tokens]
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out


class SparseMoE(nn.Module):
    """``(batch, seq, emb_dim)`` -> same shape: tokens flattened, ``gate`` (the router's logits, a
    bias-free Linear), ``router`` (top-k), ``experts`` (weighted sum), shape restored
    (``Qwen3MoeSparseMoeBlock``). ``hidden_dim`` is each expert's width (``moe_intermediate_size``)."""

    def __init__(
        self,
        emb_dim: int,
        hidden_dim: int,
        n_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool,
        activation: str = "silu",
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k ({top_k}) must lie in 1..n_experts ({n_experts})")
        self.gate = nn.Linear(emb_dim, n_experts, bias=False, dtype=dtype)
        self.router = TopKRouter(top_k, norm_topk_prob)
        self.experts = Experts(
            Expert(emb_dim, hidden_dim, activation=activation, fused_gate_up=True, dtype=dtype)
            for _ in range(n_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(self.gate(tokens))
        return self.experts(tokens, weights, chosen).reshape(x.shape)
