"""Qwen3-MoE with a copying loader: every expert its own small SwiGLU of nn.Linear modules.

Conventions (ours, not Transformers'):

    Qwen3MoeLM
      tok_embeddings               nn.Embedding
      blocks[i]: Block             pre-norm: x = x + attn(attn_norm(x)); x = x + ffn(ffn_norm(x))
        attn: Attention            wq wk wv wo (nn.Linear); q_norm / k_norm: RMSNorm over head_dim,
                                   per head, after the head split and before RoPE; half-split RoPE;
                                   eager softmax(q k^T / sqrt(d) + mask) in float32
        ffn: SparseMoE | DenseMLP  SparseMoE on the layers the config makes sparse
          router                   nn.Linear(dim, n_experts); its logits reshaped to (batch*seq, n_experts)
          experts[e]               nn.ModuleList([gate, up, down]) of nn.Linear, one per expert
        attn_norm, ffn_norm        RMSNorm
      norm: RMSNorm
      output: nn.Linear

Routing: softmax over the router logits (float32), top-k, renormalised over the k chosen when the
config says ``norm_topk_prob``, cast to the activation dtype; expert e's SwiGLU output on its tokens is
scaled by the token's weight and summed into a zero buffer, experts in index order.

Loading copies: Transformers stores each sparse layer's experts as two fused 3-D tensors,
``mlp.experts.gate_up_proj`` (n_experts, 2 * moe_ffn, dim) with the gate rows first and
``mlp.experts.down_proj`` (n_experts, dim, moe_ffn); ``build`` copies each expert's slices into its own
freshly allocated nn.Linear weights (nothing is shared with the state dict).

BUG switch (module level, None = correct model):

    "no_softmax"   the raw router logits used as routing weights (top-k on logits, no softmax)
    "no_renorm"    the top-k weights not renormalised even though norm_topk_prob is set
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = None  # None | "no_softmax" | "no_renorm"
#: a correct variant: the top-k weights renormalised in place (``weights /= weights.sum(...)``, EXAONE-MoE's way)
IN_PLACE_RENORM = False


@dataclass
class MoeArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    moe_ffn_dim: int
    n_experts: int
    top_k: int
    norm_topk: bool
    sparse_layers: tuple
    vocab: int
    eps: float
    theta: float
    window: int | None
    tied: bool

    @classmethod
    def from_hf(cls, c) -> MoeArgs:
        rope = getattr(c, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"RoPE type {rope['rope_type']!r} is not implemented")
        if getattr(c, "attention_bias", False):
            raise NotImplementedError("attention_bias is not implemented")
        skip = set(c.mlp_only_layers or [])
        step = c.decoder_sparse_step
        sparse = tuple(i not in skip and c.num_experts > 0 and (i + 1) % step == 0 for i in range(c.num_hidden_layers))
        return cls(
            dim=c.hidden_size,
            n_layers=c.num_hidden_layers,
            n_heads=c.num_attention_heads,
            n_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            ffn_dim=c.intermediate_size,
            moe_ffn_dim=c.moe_intermediate_size,
            n_experts=c.num_experts,
            top_k=c.num_experts_per_tok,
            norm_topk=bool(c.norm_topk_prob),
            sparse_layers=sparse,
            vocab=c.vocab_size,
            eps=c.rms_norm_eps,
            theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            window=getattr(c, "sliding_window", None),  # None unless use_sliding_window
            tied=bool(getattr(c, "tie_word_embeddings", False)),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, a: MoeArgs):
        super().__init__()
        self.a = a
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.eps)
        self.k_norm = RMSNorm(a.head_dim, a.eps)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        a = self.a
        q = self.q_norm(self.wq(x).view(b, t, a.n_heads, a.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(b, t, a.n_kv_heads, a.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = a.n_heads // a.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) * a.head_dim**-0.5 + mask
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.wo((att @ v).transpose(1, 2).reshape(b, t, -1))


class DenseMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def expert(dim, hidden) -> nn.ModuleList:
    """[gate, up, down]"""
    return nn.ModuleList(
        [nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)]
    )


class SparseMoE(nn.Module):
    def __init__(self, a: MoeArgs):
        super().__init__()
        self.a = a
        self.router = nn.Linear(a.dim, a.n_experts, bias=False)
        self.experts = nn.ModuleList(expert(a.dim, a.moe_ffn_dim) for _ in range(a.n_experts))

    def route(self, logits):
        """logits (tokens, n_experts) -> weights (tokens, k) in float32, expert ids (tokens, k)."""
        if BUG == "no_softmax":
            scores = logits.float()
        else:
            scores = F.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(scores, self.a.top_k, dim=-1)
        if self.a.norm_topk and BUG != "no_renorm" and IN_PLACE_RENORM:
            weights /= weights.sum(dim=-1, keepdim=True)
        elif self.a.norm_topk and BUG != "no_renorm":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        logits = self.router(x).reshape(b * t, self.a.n_experts)
        weights, ids = self.route(logits)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e, (gate, up, down) in enumerate(self.experts):
            rows, slot = torch.where(ids == e)
            if rows.numel() == 0:
                continue
            h = flat[rows]
            y = down(F.silu(gate(h)) * up(h))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out.view(b, t, d)


class Block(nn.Module):
    def __init__(self, a: MoeArgs, sparse: bool):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.eps)
        self.ffn = SparseMoE(a) if sparse else DenseMLP(a.dim, a.ffn_dim)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class Qwen3MoeLM(nn.Module):
    def __init__(self, a: MoeArgs):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList(Block(a, s) for s in a.sparse_layers)
        self.norm = RMSNorm(a.dim, a.eps)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        dev = input_ids.device
        x = self.tok_embeddings(input_ids)
        if attention_mask is not None:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            pos = torch.arange(t, device=dev)[None].expand(b, t)
        inv = 1.0 / self.a.theta ** (torch.arange(0, self.a.head_dim, 2, device=dev).float() / self.a.head_dim)
        ang = pos.float()[..., None] * inv
        ang = torch.cat([ang, ang], dim=-1)[:, None]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        qi, ki = torch.arange(t, device=dev)[:, None], torch.arange(t, device=dev)[None]
        ok = ki <= qi
        if self.a.window is not None:
            ok = ok & (ki > qi - self.a.window)
        ok = ok[None, None]
        if attention_mask is not None:
            ok = ok & attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(ok.shape, dtype=x.dtype, device=dev).masked_fill(~ok, torch.finfo(x.dtype).min)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        return self.output(self.norm(x))


# ------------------------------------------------------------------------------------------ loading

_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_norm": "q_norm", "k_norm": "k_norm"}


def build(state_dict, hf_config) -> nn.Module:
    a = MoeArgs.from_hf(hf_config)
    sd = dict(state_dict)
    dtype = sd["model.embed_tokens.weight"].dtype
    model = Qwen3MoeLM(a).to(dtype)

    def take(dst: torch.Tensor, key: str, src: torch.Tensor | None = None):
        src = sd.pop(key) if src is None else src
        if dst.shape != src.shape:
            raise ValueError(f"{key}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)

    with torch.no_grad():
        take(model.tok_embeddings.weight, "model.embed_tokens.weight")
        take(model.norm.weight, "model.norm.weight")
        if a.tied:
            sd.pop("lm_head.weight", None)
            model.output.weight = model.tok_embeddings.weight
        else:
            take(model.output.weight, "lm_head.weight")
        for i, blk in enumerate(model.blocks):
            p = f"model.layers.{i}."
            take(blk.attn_norm.weight, p + "input_layernorm.weight")
            take(blk.ffn_norm.weight, p + "post_attention_layernorm.weight")
            for hf, ours in _ATTN.items():
                take(getattr(blk.attn, ours).weight, f"{p}self_attn.{hf}.weight")
            if isinstance(blk.ffn, DenseMLP):
                for n in ("gate", "up", "down"):
                    take(getattr(blk.ffn, n).weight, f"{p}mlp.{n}_proj.weight")
                continue
            take(blk.ffn.router.weight, p + "mlp.gate.weight")
            gate_up = sd.pop(p + "mlp.experts.gate_up_proj")  # (E, 2I, D): [gate; up] per expert
            down = sd.pop(p + "mlp.experts.down_proj")  # (E, D, I)
            n_i = a.moe_ffn_dim
            for e, (g, u, dn) in enumerate(blk.ffn.experts):
                take(g.weight, "", gate_up[e, :n_i])
                take(u.weight, "", gate_up[e, n_i:])
                take(dn.weight, "", down[e])
    left = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if left:
        raise KeyError(f"unused checkpoint keys: {left}")
    return model.eval().requires_grad_(False)
