"""Gemma 3 (text) with ``scale`` norms, written in the style of gemma_pytorch / llama.cpp conversions.

Convention:
    * every RMSNorm holds a parameter ``scale`` that already contains ``1 + w``: the loader adds
      the 1 (in float32; norm scales stay float32 whatever the model dtype, as GGUF keeps them)
      and the norm multiplies the float32-normalised input by ``scale`` directly, then casts.
    * ``embedder`` is a plain ``nn.Embedding``; the caller multiplies its output by
      ``sqrt(hidden_size)``, the factor rounded to the activation dtype (gemma_pytorch's
      ``normalizer``).
    * sandwich blocks: ``input_layernorm`` -> attention -> ``post_attention_norm`` -> residual,
      ``pre_ffw_norm`` -> MLP -> ``post_ffw_norm`` -> residual.
    * attention: per-head ``query_norm`` / ``key_norm``, RoPE through complex numbers on the
      half-split pairs ``(i, i + d/2)`` (gemma_pytorch's ``apply_rotary_emb``), local base for
      ``sliding_attention`` layers and global base (with linear scaling when the config asks)
      for ``full_attention`` layers, scale ``query_pre_attn_scalar ** -0.5``, optional
      attention-logit soft-cap, sliding window ``key > query - window``.
    * MLP: gate and up fused in ONE ``gate_up`` Linear whose rows are ``[up; gate]`` (up first),
      GELU (tanh approximation) on the gate.
    * the head reuses the embedding (tied) or an own ``lm_head``; optional final logit soft-cap.

Bugs (``BUG = "<name>"`` before calling ``build``):
    "post_norm_eps"      the post-attention norm uses eps 1e-5 instead of the config's.
    "window_off_by_one"  sliding layers see ``window + 1`` keys.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BUG = None
BUGS = ("post_norm_eps", "window_off_by_one")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class GemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: list
    rope_local_base: float
    rope_global_base: float
    rope_global_linear_factor: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    tie_word_embeddings: bool


class RMSNorm(nn.Module):
    """y = x / rms(x) * scale, with ``scale`` = 1 + w stored by the loader (float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.scale.float()).type_as(x)


def precompute_freqs_cis(dim: int, end: int, theta: float, linear_factor: float = 1.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim)) / linear_factor
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # (end, dim // 2) complex64


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); pairs are (j, j + head_dim / 2)."""
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis[None, :, None, :])  # (..., d/2, 2)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)  # (..., d, 1): real halves, then imag
    return x_out.reshape(x.shape).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_type: str):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping
        self.window = None
        if layer_type == SLIDING:
            self.window = cfg.sliding_window + (1 if BUG == "window_off_by_one" else 0)
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.query_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.key_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, freqs_cis, key_mask):
        b, t, _ = x.shape
        q = self.query_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim))
        k = self.key_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)

        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (b, h, t, hd)

        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap

        pos = torch.arange(t, device=x.device)
        allowed = pos[None, :] <= pos[:, None]
        if self.window is not None:
            allowed = allowed & (pos[None, :] > pos[:, None] - self.window)
        allowed = allowed[None, None] & key_mask[:, None, None, :]
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # padding queries: no NaN rows
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)  # rows: [up; gate]
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        up, gate = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_type: str):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, layer_type)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, 1e-5 if BUG == "post_norm_eps" else eps)
        self.pre_ffw_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_ffw_norm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, freqs_cis, key_mask):
        h = self.post_attention_norm(self.self_attn(self.input_layernorm(x), freqs_cis, key_mask))
        x = x + h
        h = self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x)))
        return x + h


class Gemma3Text(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.cfg = cfg
        self.embedder = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, lt) for lt in cfg.layer_types)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def freqs(self, seq_len: int):
        c = self.cfg
        return {
            SLIDING: precompute_freqs_cis(c.head_dim, seq_len, c.rope_local_base),
            FULL: precompute_freqs_cis(c.head_dim, seq_len, c.rope_global_base, c.rope_global_linear_factor),
        }

    def forward(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        x = self.embedder(input_ids)
        normalizer = torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype, device=x.device)
        x = x * normalizer
        freqs = {k: v.to(x.device) for k, v in self.freqs(t).items()}
        if attention_mask is None:
            key_mask = torch.ones(b, t, dtype=torch.bool, device=x.device)
        else:
            key_mask = attention_mask.to(x.device).bool()
        for layer in self.layers:
            x = layer(x, freqs[layer.layer_type], key_mask)
        x = self.final_norm(x)
        head = self.embedder.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# ---------------------------------------------------------------- Transformers -> ours


def config_from_hf(hf) -> GemmaConfig:
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    rope = hf.rope_parameters
    local, glob = rope[SLIDING], rope[FULL]
    for name, p in ((SLIDING, local), (FULL, glob)):
        if p.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(f"unsupported rope_type {p.get('rope_type')!r} on {name}")
    if local.get("rope_type", "default") != "default":
        raise ValueError("scaled RoPE on sliding layers is not supported")
    return GemmaConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        query_pre_attn_scalar=hf.query_pre_attn_scalar,
        sliding_window=hf.sliding_window,
        layer_types=list(hf.layer_types),
        rope_local_base=local["rope_theta"],
        rope_global_base=glob["rope_theta"],
        rope_global_linear_factor=glob.get("factor", 1.0) if glob.get("rope_type") == "linear" else 1.0,
        attn_logit_softcapping=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def convert(sd: dict, cfg: GemmaConfig) -> dict:
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in sd else "model."

    def scale(key):  # 1 + w, kept in float32
        return 1.0 + sd[key].float()

    out = {"embedder.weight": sd[prefix + "embed_tokens.weight"], "final_norm.scale": scale(prefix + "norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{dst}self_attn.{proj}.weight"] = sd[f"{src}self_attn.{proj}.weight"]
        out[dst + "self_attn.query_norm.scale"] = scale(src + "self_attn.q_norm.weight")
        out[dst + "self_attn.key_norm.scale"] = scale(src + "self_attn.k_norm.weight")
        out[dst + "input_layernorm.scale"] = scale(src + "input_layernorm.weight")
        out[dst + "post_attention_norm.scale"] = scale(src + "post_attention_layernorm.weight")
        out[dst + "pre_ffw_norm.scale"] = scale(src + "pre_feedforward_layernorm.weight")
        out[dst + "post_ffw_norm.scale"] = scale(src + "post_feedforward_layernorm.weight")
        up, gate = sd[src + "mlp.up_proj.weight"], sd[src + "mlp.gate_proj.weight"]
        out[dst + "mlp.gate_up.weight"] = torch.cat([up, gate], dim=0)
        out[dst + "mlp.down.weight"] = sd[src + "mlp.down_proj.weight"]
    return out


def build(state_dict: dict, hf_config) -> nn.Module:
    """Build ours from a Transformers Gemma 3 text state dict; norm scales are 1 + w in float32."""
    if BUG is not None and BUG not in BUGS:
        raise ValueError(f"unknown BUG {BUG!r}; one of {BUGS}")
    cfg = config_from_hf(hf_config)
    with torch.device("meta"):
        model = Gemma3Text(cfg)
    # assign=True keeps each tensor's own dtype: weights in the model dtype, norm scales float32
    model.load_state_dict(convert(state_dict, cfg), strict=True, assign=True)
    return model.eval()
