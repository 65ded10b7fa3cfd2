"""A small Llama 3.2 written in the litgpt style.

Module tree:
    GPT
      transformer.wte        nn.Embedding(vocab_size, n_embd)
      transformer.h[i]       Block: norm_1, attn (qkv, proj), norm_2, mlp (fc_1, fc_2, proj)
      transformer.ln_f       RMSNorm
      lm_head                nn.Linear(n_embd, vocab_size), weight shared with wte when tied

The fused `attn.qkv` weight stacks rows as [all q heads; all k groups; all v groups].
`build(state_dict, hf_config)` converts a Transformers Llama checkpoint into this layout.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import parity


@dataclass
class Config:
    vocab_size: int = 257
    n_embd: int = 48
    n_layer: int = 2
    n_head: int = 4
    n_query_groups: int = 2
    head_size: int = 16
    intermediate_size: int = 96
    norm_eps: float = 1e-5
    rope_base: float = 500000.0
    # llama3 frequency scaling: factor, low_freq_factor, high_freq_factor, original_max_seq_len
    rope_adjustments: dict | None = field(default=None)
    tie_embeddings: bool = True


# ---------------------------------------------------------------- RoPE


def llama3_adjust_inv_freq(inv_freq: torch.Tensor, adj: dict) -> torch.Tensor:
    """Llama 3 scaling: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = adj["factor"]
    low, high = adj["low_freq_factor"], adj["high_freq_factor"]
    old_len = adj["original_max_seq_len"]

    wavelen = 2 * math.pi / inv_freq
    long_wave = old_len / low  # wavelengths beyond this are fully scaled
    short_wave = old_len / high  # wavelengths below this are untouched

    # smooth goes 0 -> 1 as the wavelength shrinks from long_wave to short_wave
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq

    out = torch.where(wavelen > long_wave, inv_freq / factor, inv_freq)
    middle = (wavelen >= short_wave) & (wavelen <= long_wave)
    return torch.where(middle, blended, out)


def build_rope_cache(
    seq_len: int,
    n_elem: int,
    base: float = 10000.0,
    adjustments: dict | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos, sin), each (seq_len, n_elem), in float32, half-split layout."""
    exponent = torch.arange(0, n_elem, 2, device=device).float() / n_elem
    inv_freq = 1.0 / (base**exponent)
    if adjustments is not None:
        inv_freq = llama3_adjust_inv_freq(inv_freq, adjustments)

    pos = torch.arange(seq_len, device=device).float()
    angles = torch.outer(pos, inv_freq)  # (T, n_elem / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, n_elem): same angle for i and i + n_elem/2
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, hs). Rotate pairs (i, i + hs/2)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)  # normalise in fp32, scale in the input dtype


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        hs = config.head_size
        qkv_rows = (config.n_head + 2 * config.n_query_groups) * hs
        self.qkv = nn.Linear(config.n_embd, qkv_rows, bias=False)
        self.proj = nn.Linear(config.n_head * hs, config.n_embd, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        c = self.config
        hs, nh, ng = c.head_size, c.n_head, c.n_query_groups

        # split the fused projection: [q rows; k rows; v rows]
        q, k, v = self.qkv(x).split([nh * hs, ng * hs, ng * hs], dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, ng, hs).transpose(1, 2)  # (B, ng, T, hs)
        v = v.view(B, T, ng, hs).transpose(1, 2)

        q = parity.tap(apply_rope(q, cos, sin), "q_rot")  # the only taps: the rest is aligned by weights
        k = parity.tap(apply_rope(k, cos, sin), "k_rot")

        # GQA: each kv group serves nh // ng consecutive query heads
        if ng != nh:
            k = k.repeat_interleave(nh // ng, dim=1)
            v = v.repeat_interleave(nh // ng, dim=1)

        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hs))
        y = y.transpose(1, 2).reshape(B, T, nh * hs)
        return self.proj(y)


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)  # gate
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)  # up
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = LLaMAMLP(config)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm_1(x), cos, sin, mask)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=RMSNorm(config.n_embd, config.norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def build_mask(self, T, attention_mask, dtype, device):
        """Additive (B or 1, 1, T, T) mask: 0 where allowed, dtype min where blocked."""
        allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
        if attention_mask is not None:
            keys_ok = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
            allowed = allowed & keys_ok
        zero = torch.zeros((), dtype=dtype, device=device)
        blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
        return torch.where(allowed, zero, blocked)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        c = self.config
        T = input_ids.size(1)
        x = self.transformer.wte(input_ids)

        cos, sin = build_rope_cache(T, c.head_size, c.rope_base, c.rope_adjustments, x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        mask = self.build_mask(T, attention_mask, x.dtype, x.device)

        for block in self.transformer.h:
            x = block(x, cos, sin, mask)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab)


# ---------------------------------------------------------------- HF conversion


def config_from_hf(hf_config) -> Config:
    n_head = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_head
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    adjustments = None
    if rope.get("rope_type", "default") == "llama3":
        adjustments = dict(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_seq_len=rope["original_max_position_embeddings"],
        )
    elif rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
    return Config(
        vocab_size=hf_config.vocab_size,
        n_embd=hf_config.hidden_size,
        n_layer=hf_config.num_hidden_layers,
        n_head=n_head,
        n_query_groups=hf_config.num_key_value_heads or n_head,
        head_size=head_size,
        intermediate_size=hf_config.intermediate_size,
        norm_eps=hf_config.rms_norm_eps,
        rope_base=rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)),
        rope_adjustments=adjustments,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
    )


def convert_hf_checkpoint(sd: dict, config: Config) -> dict:
    """Map Transformers Llama names onto ours, fusing q/k/v into one qkv weight."""
    out = {
        "transformer.wte.weight": sd["model.embed_tokens.weight"],
        "transformer.ln_f.weight": sd["model.norm.weight"],
    }
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        out[dst + "norm_1.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "norm_2.weight"] = sd[src + "post_attention_layernorm.weight"]
        out[dst + "attn.qkv.weight"] = torch.cat(
            [
                sd[src + "self_attn.q_proj.weight"],
                sd[src + "self_attn.k_proj.weight"],
                sd[src + "self_attn.v_proj.weight"],
            ],
            dim=0,
        )
        out[dst + "attn.proj.weight"] = sd[src + "self_attn.o_proj.weight"]
        out[dst + "mlp.fc_1.weight"] = sd[src + "mlp.gate_proj.weight"]
        out[dst + "mlp.fc_2.weight"] = sd[src + "mlp.up_proj.weight"]
        out[dst + "mlp.proj.weight"] = sd[src + "mlp.down_proj.weight"]
    # tied: lm_head.weight is the embedding parameter, so give it the same tensor
    if config.tie_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    else:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def build(state_dict: dict, hf_config) -> nn.Module:
    config = config_from_hf(hf_config)
    dtype = state_dict["model.embed_tokens.weight"].dtype
    model = GPT(config).to(dtype)
    model.load_state_dict(convert_hf_checkpoint(state_dict, config), strict=True)
    if config.tie_embeddings:
        assert model.lm_head.weight is model.transformer.wte.weight
    return model.eval()
