# OLMo 3 from scratch, written while working through an "LLMs from scratch"-style
# book. Plain PyTorch only: a config dict, a handful of small modules, and a
# weight loader that copies a Hugging Face checkpoint into our own parameters.

import math

import torch
import torch.nn as nn

import parity

# A tiny example config (same keys that `build()` fills in from a real checkpoint).
OLMO3_CONFIG_TINY = {
    "vocab_size": 128,  # Vocabulary size
    "context_length": 64,  # Max positions the model was configured for
    "emb_dim": 32,  # Embedding (residual stream) width
    "n_heads": 4,  # Query heads
    "n_kv_heads": 2,  # Key/value heads (grouped-query attention)
    "n_layers": 4,  # Number of transformer blocks
    "hidden_dim": 64,  # Width of the feed-forward layer
    "head_dim": 8,  # Size of one attention head
    "qkv_bias": False,  # Bias on the attention projections
    "norm_eps": 1e-6,  # RMSNorm epsilon
    "sliding_window": 4,  # Window for the sliding-attention layers
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "rope_parameters": {  # One RoPE setting per layer type
        "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
    },
    "tie_embeddings": False,  # Share tok_emb and out_head weights
    "dtype": torch.float32,
}


# ---------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------


def _yarn_mscale(scale, mscale=1.0):
    # Attention temperature suggested by the YaRN paper: 0.1 * ln(s) + 1
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def compute_rope_params(cfg, layer_type):
    """Return (inv_freq, attention_scaling) for the given layer type.

    Each layer type ("sliding_attention" / "full_attention") has its own RoPE
    settings in cfg["rope_parameters"]. Sliding layers use plain RoPE; full
    layers of long-context OLMo 3 checkpoints use YaRN.
    """
    params = cfg["rope_parameters"][layer_type]
    rope_type = params.get("rope_type", "default")
    theta = params["rope_theta"]
    dim = cfg["head_dim"]

    # Plain RoPE: theta_i = base^(-2i/d)
    base_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if rope_type == "default":
        return 1.0 / base_freqs, 1.0

    if rope_type != "yarn":
        raise NotImplementedError(f"RoPE type {rope_type!r} is not covered in this chapter")

    # --- YaRN ("NTK-by-parts" interpolation + attention temperature) ---
    orig_ctx = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = cfg["context_length"] / orig_ctx

    attn_factor = params.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attn_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attn_factor = _yarn_mscale(factor)

    beta_fast = params.get("beta_fast") or 32.0
    beta_slow = params.get("beta_slow") or 1.0

    # Which dimension index completes `n_rot` full rotations over the original context?
    #   d(n_rot) = dim * ln(L / (2 pi n_rot)) / (2 ln theta)
    def dim_for_rotations(n_rot):
        return dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero

    # Ramp goes 0 -> 1 from dimension `low` to `high`; gamma is the share of the
    # original (extrapolated) frequency. Fast-rotating dims keep their frequency,
    # slow ones are interpolated (divided by `factor`).
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    gamma = 1 - ramp
    inv_freq_extrap = 1.0 / base_freqs
    inv_freq_interp = 1.0 / (factor * base_freqs)
    inv_freq = inv_freq_interp * (1 - gamma) + inv_freq_extrap * gamma
    return inv_freq, attn_factor


def rope_cos_sin(cfg, layer_type, seq_len, device=None):
    # Positions 0..seq_len-1, angles duplicated for the two halves (rotate-half layout)
    inv_freq, attn_scaling = compute_rope_params(cfg, layer_type)
    positions = torch.arange(seq_len, device=device).float()
    angles = positions[:, None] * inv_freq.to(device)[None, :]  # (seq, dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, dim)
    return angles.cos() * attn_scaling, angles.sin() * attn_scaling


def apply_rope(x, cos, sin):
    # x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim) in float32
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = x * cos + rotated * sin  # computed in float32
    return out.to(x.dtype)


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * x).to(in_dtype)


class FeedForward(nn.Module):
    # SwiGLU: fc3( silu(fc1(x)) * fc2(x) )
    def __init__(self, cfg):
        super().__init__()
        d, h, dt = cfg["emb_dim"], cfg["hidden_dim"], cfg["dtype"]
        self.fc1 = nn.Linear(d, h, bias=False, dtype=dt)  # gate
        self.fc2 = nn.Linear(d, h, bias=False, dtype=dt)  # up
        self.fc3 = nn.Linear(h, d, bias=False, dtype=dt)  # down

    def forward(self, x):
        return self.fc3(nn.functional.silu(self.fc1(x)) * self.fc2(x))


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg["n_heads"]
        self.n_kv_heads = cfg["n_kv_heads"]
        self.head_dim = cfg["head_dim"]
        self.group_size = self.n_heads // self.n_kv_heads
        d, dt, bias = cfg["emb_dim"], cfg["dtype"], cfg["qkv_bias"]
        q_out = self.n_heads * self.head_dim
        kv_out = self.n_kv_heads * self.head_dim

        self.W_query = nn.Linear(d, q_out, bias=bias, dtype=dt)
        self.W_key = nn.Linear(d, kv_out, bias=bias, dtype=dt)
        self.W_value = nn.Linear(d, kv_out, bias=bias, dtype=dt)
        self.out_proj = nn.Linear(q_out, d, bias=bias, dtype=dt)

        # OLMo normalizes the *whole* query/key projection, before splitting into heads
        self.q_norm = RMSNorm(q_out, cfg["norm_eps"], dtype=dt)
        self.k_norm = RMSNorm(kv_out, cfg["norm_eps"], dtype=dt)

    def forward(self, x, mask, cos, sin):
        b, n, _ = x.shape
        queries = self.q_norm(self.W_query(x))
        keys = self.k_norm(self.W_key(x))
        values = self.W_value(x)

        # (b, n, heads*hd) -> (b, heads, n, hd)
        queries = queries.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)

        queries = parity.tap(apply_rope(queries, cos, sin), "q_rot")  # named for the debugger
        keys = parity.tap(apply_rope(keys, cos, sin), "k_rot")

        # Each K/V head serves `group_size` query heads
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)

        scores = parity.tap((queries @ keys.transpose(2, 3)) * self.head_dim**-0.5, "scores")
        # Finite min instead of -inf: a row with every key masked stays NaN-free
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        weights = parity.tap(torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype), "probs")

        context = parity.tap((weights @ values).transpose(1, 2).reshape(b, n, -1), "context")
        return self.out_proj(context)


class TransformerBlock(nn.Module):
    def __init__(self, cfg, layer_type):
        super().__init__()
        self.layer_type = layer_type
        self.att = GroupedQueryAttention(cfg)
        self.ff = FeedForward(cfg)
        # OLMo 2/3 use *post*-norms: normalize the sublayer output, then add
        self.norm1 = RMSNorm(cfg["emb_dim"], cfg["norm_eps"], dtype=cfg["dtype"])
        self.norm2 = RMSNorm(cfg["emb_dim"], cfg["norm_eps"], dtype=cfg["dtype"])

    def forward(self, x, mask, cos, sin):
        x = x + self.norm1(self.att(x, mask, cos, sin))
        x = x + self.norm2(self.ff(x))
        return x


class Olmo3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        dt = cfg["dtype"]
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=dt)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg, layer_type) for layer_type in cfg["layer_types"]])
        self.final_norm = RMSNorm(cfg["emb_dim"], cfg["norm_eps"], dtype=dt)
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=dt)
        if cfg["tie_embeddings"]:
            self.out_head.weight = self.tok_emb.weight

    def build_masks(self, seq_len, attention_mask, device):
        # True = "may not attend"
        ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
        future = torch.triu(ones, diagonal=1)  # j > i
        too_old = torch.tril(ones, diagonal=-self.cfg["sliding_window"])  # j <= i - window
        masks = {"full_attention": future, "sliding_attention": future | too_old}
        masks = {k: m[None, None] for k, m in masks.items()}  # (1, 1, n, n)
        if attention_mask is not None:
            padded = (attention_mask == 0)[:, None, None, :]  # (b, 1, 1, n)
            masks = {k: m | padded for k, m in masks.items()}
        return masks

    def forward(self, in_idx, attention_mask=None):
        n = in_idx.shape[1]
        device = in_idx.device
        x = self.tok_emb(in_idx)

        masks = self.build_masks(n, attention_mask, device)
        rope = {t: rope_cos_sin(self.cfg, t, n, device) for t in set(self.cfg["layer_types"])}

        for block in self.trf_blocks:
            cos, sin = rope[block.layer_type]
            x = block(x, masks[block.layer_type], cos, sin)

        x = self.final_norm(x)
        return self.out_head(x)


# ---------------------------------------------------------------------------
# Loading Hugging Face weights
# ---------------------------------------------------------------------------


def config_from_hf(hf_config, dtype):
    n_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    layer_types = list(hf_config.layer_types)

    rope = dict(hf_config.rope_parameters or {})
    if "rope_type" in rope or "rope_theta" in rope:  # a single flat setting: use it everywhere
        rope = {t: dict(rope) for t in set(layer_types)}
    rope = {t: dict(p) for t, p in rope.items()}

    return {
        "vocab_size": hf_config.vocab_size,
        "context_length": hf_config.max_position_embeddings,
        "emb_dim": hf_config.hidden_size,
        "n_heads": n_heads,
        "n_kv_heads": hf_config.num_key_value_heads or n_heads,
        "n_layers": hf_config.num_hidden_layers,
        "hidden_dim": hf_config.intermediate_size,
        "head_dim": head_dim,
        "qkv_bias": bool(getattr(hf_config, "attention_bias", False)),
        "norm_eps": hf_config.rms_norm_eps,
        "sliding_window": hf_config.sliding_window,
        "layer_types": layer_types,
        "rope_parameters": rope,
        "tie_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "dtype": dtype,
    }


def assign(param, tensor, name):
    if param.shape != tensor.shape:
        raise ValueError(f"Shape mismatch for {name}: model {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def load_weights_into_olmo3(model, cfg, params):
    assign(model.tok_emb.weight, params["model.embed_tokens.weight"], "model.embed_tokens.weight")

    for i, block in enumerate(model.trf_blocks):
        p = f"model.layers.{i}."
        att, ff = block.att, block.ff
        pairs = [
            (att.W_query.weight, "self_attn.q_proj.weight"),
            (att.W_key.weight, "self_attn.k_proj.weight"),
            (att.W_value.weight, "self_attn.v_proj.weight"),
            (att.out_proj.weight, "self_attn.o_proj.weight"),
            (att.q_norm.weight, "self_attn.q_norm.weight"),
            (att.k_norm.weight, "self_attn.k_norm.weight"),
            (block.norm1.weight, "post_attention_layernorm.weight"),
            (ff.fc1.weight, "mlp.gate_proj.weight"),
            (ff.fc2.weight, "mlp.up_proj.weight"),
            (ff.fc3.weight, "mlp.down_proj.weight"),
            (block.norm2.weight, "post_feedforward_layernorm.weight"),
        ]
        if cfg["qkv_bias"]:
            pairs += [
                (att.W_query.bias, "self_attn.q_proj.bias"),
                (att.W_key.bias, "self_attn.k_proj.bias"),
                (att.W_value.bias, "self_attn.v_proj.bias"),
                (att.out_proj.bias, "self_attn.o_proj.bias"),
            ]
        for param, key in pairs:
            assign(param, params[p + key], p + key)

    assign(model.final_norm.weight, params["model.norm.weight"], "model.norm.weight")

    if cfg["tie_embeddings"]:
        # out_head.weight *is* tok_emb.weight, already loaded above
        model.out_head.weight = model.tok_emb.weight
    else:
        assign(model.out_head.weight, params["lm_head.weight"], "lm_head.weight")


def build(state_dict, hf_config):
    dtype = state_dict["model.embed_tokens.weight"].dtype
    cfg = config_from_hf(hf_config, dtype)
    model = Olmo3Model(cfg)
    load_weights_into_olmo3(model, cfg, state_dict)
    return model.eval()


if __name__ == "__main__":
    torch.manual_seed(123)
    model = Olmo3Model(OLMO3_CONFIG_TINY).eval()
    ids = torch.randint(0, OLMO3_CONFIG_TINY["vocab_size"], (2, 10))
    with torch.no_grad():
        print(model(ids).shape)
