"""Qwen3 written in the TransformerLens style (``HookedTransformer`` weight layout).

Convention:
    * parameters, not ``nn.Linear`` modules: ``embed.W_E`` [d_vocab, d_model],
      ``blocks.{i}.attn.W_Q`` [n_heads, d_model, d_head], ``W_K`` / ``W_V``
      [n_kv_heads, d_model, d_head], ``W_O`` [n_heads, d_head, d_model],
      ``blocks.{i}.mlp.W_gate`` / ``W_in`` [d_model, d_mlp], ``W_out`` [d_mlp, d_model],
      ``unembed.W_U`` [d_model, d_vocab]; every product is an ``einsum``.
    * RMSNorm parameters are called ``w``; the norm divides by ``sqrt(mean(x^2) + eps)`` in
      float32, casts back, then multiplies by ``w`` (TransformerLens' order).
    * Qwen3's q/k RMSNorm is applied per head, after the heads are split, before RoPE.
    * rotate-half RoPE written out by hand (cos/sin from float32 angles, cast to the activations).
    * attention scores as an explicit ``q @ k.transpose(-1, -2) / sqrt(d_head)``, a causal (and,
      for ``sliding_attention`` layers, windowed) mask filled with -inf, float32 softmax; GQA by
      ``repeat_interleave`` of the key/value heads.
    * the unembedding ``W_U`` is its own parameter (the transposed embedding when the checkpoint
      ties them), as TransformerLens' converters produce it.

Bugs (``BUG = "<name>"`` before calling ``build``):
    "scale"        scores divided by d_head instead of sqrt(d_head).
    "qk_norm_eps"  the q/k norms use eps 1e-5 instead of the config's ``rms_norm_eps``.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BUG = None
BUGS = ("scale", "qk_norm_eps")


@dataclass
class LensConfig:
    d_model: int
    d_head: int
    n_heads: int
    n_key_value_heads: int
    d_mlp: int
    d_vocab: int
    n_layers: int
    eps: float
    qk_norm_eps: float
    rotary_base: float
    layer_types: list
    window_size: int | None
    dtype: torch.dtype = torch.float32


class RMSNorm(nn.Module):
    def __init__(self, length: int, eps: float):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(length))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        return (x / scale).to(dtype) * self.w


class Embed(nn.Module):
    def __init__(self, cfg: LensConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))

    def forward(self, tokens):
        return self.W_E[tokens, :]


class Unembed(nn.Module):
    def __init__(self, cfg: LensConfig):
        super().__init__()
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))

    def forward(self, residual):
        return torch.einsum("bpd,dv->bpv", residual, self.W_U)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(n_pos: int, d_head: int, base: float, device, dtype):
    """cos, sin of shape (n_pos, d_head): each angle appears twice (dims j and j + d_head/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.int64).float().to(device) / d_head))
    angles = torch.arange(n_pos, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LensConfig, layer_type: str):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.window_size if layer_type == "sliding_attention" else None
        self.W_Q = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_model, cfg.d_head))
        self.W_K = nn.Parameter(torch.empty(cfg.n_key_value_heads, cfg.d_model, cfg.d_head))
        self.W_V = nn.Parameter(torch.empty(cfg.n_key_value_heads, cfg.d_model, cfg.d_head))
        self.W_O = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_head, cfg.d_model))
        self.q_norm = RMSNorm(cfg.d_head, cfg.qk_norm_eps)
        self.k_norm = RMSNorm(cfg.d_head, cfg.qk_norm_eps)
        self.attn_scale = cfg.d_head if BUG == "scale" else math.sqrt(cfg.d_head)

    def forward(self, x, cos, sin, key_mask):
        # (batch, pos, head, d_head)
        q = torch.einsum("bpm,hmd->bphd", x, self.W_Q)
        k = torch.einsum("bpm,hmd->bphd", x, self.W_K)
        v = torch.einsum("bpm,hmd->bphd", x, self.W_V)
        q, k = self.q_norm(q), self.k_norm(k)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, head, pos, d_head)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        n_rep = self.cfg.n_heads // self.cfg.n_key_value_heads
        k = torch.repeat_interleave(k, n_rep, dim=1)
        v = torch.repeat_interleave(v, n_rep, dim=1)

        scores = q @ k.transpose(-1, -2) / self.attn_scale  # (batch, head, query, key)
        n = scores.shape[-1]
        qpos = torch.arange(n, device=x.device)[:, None]
        kpos = torch.arange(n, device=x.device)[None, :]
        allowed = kpos <= qpos
        if self.window is not None:
            allowed = allowed & (kpos > qpos - self.window)
        allowed = allowed[None, None] & key_mask[:, None, None, :]
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # padding queries: no NaN rows
        scores = torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=scores.dtype, device=x.device))
        pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        z = pattern @ v  # (batch, head, pos, d_head)
        return torch.einsum("bhpd,hdm->bpm", z, self.W_O)


class GatedMLP(nn.Module):
    def __init__(self, cfg: LensConfig):
        super().__init__()
        self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))

    def forward(self, x):
        pre_act = torch.einsum("bpd,dm->bpm", x, self.W_gate)
        pre_linear = torch.einsum("bpd,dm->bpm", x, self.W_in)
        post = F.silu(pre_act) * pre_linear
        return torch.einsum("bpm,md->bpd", post, self.W_out)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LensConfig, layer_type: str):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg, layer_type)
        self.ln2 = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, resid_pre, cos, sin, key_mask):
        resid_mid = resid_pre + self.attn(self.ln1(resid_pre), cos, sin, key_mask)
        return resid_mid + self.mlp(self.ln2(resid_mid))


class HookedQwen3(nn.Module):
    def __init__(self, cfg: LensConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, t) for t in cfg.layer_types)
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps)
        self.unembed = Unembed(cfg)

    def forward(self, input_ids, attention_mask=None):
        batch, n = input_ids.shape
        residual = self.embed(input_ids)
        cos, sin = rotary_cos_sin(n, self.cfg.d_head, self.cfg.rotary_base, residual.device, residual.dtype)
        if attention_mask is None:
            key_mask = torch.ones(batch, n, dtype=torch.bool, device=residual.device)
        else:
            key_mask = attention_mask.to(residual.device).bool()
        for block in self.blocks:
            residual = block(residual, cos, sin, key_mask)
        return self.unembed(self.ln_final(residual))


# ---------------------------------------------------------------- Transformers -> lens weights


def config_from_hf(hf) -> LensConfig:
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
    n_heads = hf.num_attention_heads
    layer_types = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    return LensConfig(
        d_model=hf.hidden_size,
        d_head=getattr(hf, "head_dim", None) or hf.hidden_size // n_heads,
        n_heads=n_heads,
        n_key_value_heads=hf.num_key_value_heads or n_heads,
        d_mlp=hf.intermediate_size,
        d_vocab=hf.vocab_size,
        n_layers=hf.num_hidden_layers,
        eps=hf.rms_norm_eps,
        qk_norm_eps=1e-5 if BUG == "qk_norm_eps" else hf.rms_norm_eps,
        rotary_base=rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)),
        layer_types=layer_types,
        window_size=getattr(hf, "sliding_window", None),
    )


def convert_qwen3_weights(sd: dict, cfg: LensConfig) -> dict:
    """Rearrange nn.Linear weights [out, in] into TransformerLens' per-head 3-D tensors."""
    h, kv, dh, dm = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
    out = {"embed.W_E": sd["model.embed_tokens.weight"], "ln_final.w": sd["model.norm.weight"]}
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    out["unembed.W_U"] = head.T
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        att = src + "self_attn."
        out[dst + "ln1.w"] = sd[src + "input_layernorm.weight"]
        out[dst + "ln2.w"] = sd[src + "post_attention_layernorm.weight"]
        out[dst + "attn.W_Q"] = sd[att + "q_proj.weight"].view(h, dh, dm).transpose(1, 2)
        out[dst + "attn.W_K"] = sd[att + "k_proj.weight"].view(kv, dh, dm).transpose(1, 2)
        out[dst + "attn.W_V"] = sd[att + "v_proj.weight"].view(kv, dh, dm).transpose(1, 2)
        out[dst + "attn.W_O"] = sd[att + "o_proj.weight"].T.reshape(h, dh, dm)
        out[dst + "attn.q_norm.w"] = sd[att + "q_norm.weight"]
        out[dst + "attn.k_norm.w"] = sd[att + "k_norm.weight"]
        out[dst + "mlp.W_gate"] = sd[src + "mlp.gate_proj.weight"].T
        out[dst + "mlp.W_in"] = sd[src + "mlp.up_proj.weight"].T
        out[dst + "mlp.W_out"] = sd[src + "mlp.down_proj.weight"].T
    return out


def build(state_dict: dict, hf_config) -> nn.Module:
    """Build a HookedQwen3 from a Transformers Qwen3 state dict and config."""
    if BUG is not None and BUG not in BUGS:
        raise ValueError(f"unknown BUG {BUG!r}; one of {BUGS}")
    cfg = config_from_hf(hf_config)
    weight = state_dict["model.embed_tokens.weight"]
    cfg.dtype = weight.dtype
    model = HookedQwen3(cfg).to(dtype=weight.dtype, device=weight.device)
    model.load_state_dict(convert_qwen3_weights(state_dict, cfg), strict=True)
    return model.eval()
