"""Mistral written with fused, group-interleaved projections (a GQA-kernel-friendly layout).

Conventions (ours, not Transformers'):

    MistralLM
      embed                      nn.Embedding
      layers[i]: Layer           pre-norm: x = x + attn(norm1(x)); x = x + mlp(norm2(x))
        norm1, norm2: RMSNorm    parameter ``gamma``; normalise in float32, cast, then scale
        attn: FusedAttention
          wqkv                   ONE nn.Linear; its rows are interleaved per KV group: for each kv
                                 head g, the q rows of query heads g*G .. g*G+G-1 (G = heads / kv
                                 heads), then the k rows of kv head g, then its v rows
          wo                     nn.Linear
        mlp: FusedMLP
          w_up_gate              ONE nn.Linear stored [up; gate] (up rows first)
          w_down                 nn.Linear
      norm: RMSNorm
      head: nn.Linear            (tied to embed when the config says so)

Attention: half-split RoPE (cos/sin rounded to the activation dtype, as Mistral does), then
``F.scaled_dot_product_attention`` with an explicit boolean mask (True = may attend): causal, and
on every layer a sliding window of ``sliding_window`` keys including the query itself
(``q - window < k <= q``); no window when the config's ``sliding_window`` is None.

BUG switch (module level, None = correct model):

    "gate_up_roles"   SiLU applied to the up half instead of the gate half of ``w_up_gate``
    "window"          the sliding window one key too narrow (window - 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = None  # None | "gate_up_roles" | "window"


@dataclass
class Args:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int
    eps: float
    theta: float
    window: int | None
    tied: bool

    @classmethod
    def from_hf(cls, cfg) -> Args:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r}: only SiLU is implemented")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"RoPE type {rope['rope_type']!r} is not implemented")
        heads = cfg.num_attention_heads
        return cls(
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=heads,
            n_kv_heads=cfg.num_key_value_heads or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            ffn_dim=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            eps=cfg.rms_norm_eps,
            theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            window=getattr(cfg, "sliding_window", None),
            tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.gamma * h.to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """positions (b, t) -> cos, sin (b, 1, t, head_dim), half-split layout, rounded to ``dtype``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype)[:, None], ang.sin().to(dtype)[:, None]


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class FusedAttention(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.h, self.kv, self.d = a.n_heads, a.n_kv_heads, a.head_dim
        self.group = a.n_heads // a.n_kv_heads
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x, cos, sin, allowed):
        b, t, _ = x.shape
        fused = self.wqkv(x).view(b, t, self.kv, self.group + 2, self.d)
        q = fused[:, :, :, : self.group].reshape(b, t, self.h, self.d).transpose(1, 2)
        k = fused[:, :, :, self.group].transpose(1, 2)
        v = fused[:, :, :, self.group + 1].transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k = k.repeat_interleave(self.group, dim=1)  # query head j reads kv head j // group
        v = v.repeat_interleave(self.group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.h * self.d))


class FusedMLP(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.w_up_gate = nn.Linear(a.dim, 2 * a.ffn_dim, bias=False)
        self.w_down = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x):
        up, gate = self.w_up_gate(x).chunk(2, dim=-1)
        if BUG == "gate_up_roles":
            return self.w_down(F.silu(up) * gate)
        return self.w_down(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.norm1 = RMSNorm(a.dim, a.eps)
        self.attn = FusedAttention(a)
        self.norm2 = RMSNorm(a.dim, a.eps)
        self.mlp = FusedMLP(a)

    def forward(self, x, cos, sin, allowed):
        x = x + self.attn(self.norm1(x), cos, sin, allowed)
        return x + self.mlp(self.norm2(x))


class MistralLM(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.eps)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)

    def allowed(self, t: int, attention_mask, device):
        """Boolean (b|1, 1, t, t) mask: causal, sliding window, padding keys removed."""
        q = torch.arange(t, device=device)[:, None]
        k = torch.arange(t, device=device)[None, :]
        ok = k <= q
        if self.args.window is not None:
            w = self.args.window - 1 if BUG == "window" else self.args.window
            ok = ok & (k > q - w)
        ok = ok[None, None]
        if attention_mask is not None:
            ok = ok & attention_mask.bool()[:, None, None, :]
        return ok

    def forward(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        if attention_mask is not None:  # count positions over each row's real tokens
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            pos = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        x = self.embed(input_ids)
        cos, sin = rope_tables(pos, self.args.head_dim, self.args.theta, x.dtype)
        allowed = self.allowed(t, attention_mask, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, allowed)
        return self.head(self.norm(x))


# ------------------------------------------------------------------------------------------ loading


def _interleave_qkv(q, k, v, a: Args) -> torch.Tensor:
    """Rows [q heads of group 0; k0; v0; q heads of group 1; k1; v1; ...]."""
    d, g = a.head_dim, a.n_heads // a.n_kv_heads
    q = q.view(a.n_kv_heads, g * d, -1)
    k = k.view(a.n_kv_heads, d, -1)
    v = v.view(a.n_kv_heads, d, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


def build(state_dict, hf_config) -> nn.Module:
    a = Args.from_hf(hf_config)
    sd = dict(state_dict)
    ours = {"embed.weight": sd.pop("model.embed_tokens.weight"), "norm.gamma": sd.pop("model.norm.weight")}
    head = sd.pop("lm_head.weight", None)
    ours["head.weight"] = ours["embed.weight"] if (a.tied or head is None) else head
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        q, k, v, o = (sd.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkvo")
        ours[f"layers.{i}.attn.wqkv.weight"] = _interleave_qkv(q, k, v, a)
        ours[f"layers.{i}.attn.wo.weight"] = o
        up, gate = sd.pop(f"{p}mlp.up_proj.weight"), sd.pop(f"{p}mlp.gate_proj.weight")
        ours[f"layers.{i}.mlp.w_up_gate.weight"] = torch.cat([up, gate], dim=0)
        ours[f"layers.{i}.mlp.w_down.weight"] = sd.pop(f"{p}mlp.down_proj.weight")
        ours[f"layers.{i}.norm1.gamma"] = sd.pop(f"{p}input_layernorm.weight")
        ours[f"layers.{i}.norm2.gamma"] = sd.pop(f"{p}post_attention_layernorm.weight")
    left = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if left:
        raise KeyError(f"unused checkpoint keys: {left}")
    with torch.device("meta"):
        model = MistralLM(a)
    model.load_state_dict(ours, strict=True, assign=True)
    if a.tied:
        model.head.weight = model.embed.weight
    return model.eval().requires_grad_(False)
