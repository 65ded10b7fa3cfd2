"""OLMo 3 with a Hugging Face-style call signature and a KV cache of its own.

Conventions (ours, not Transformers'):

    Olmo3ForGeneration
      wte                          nn.Embedding
      h[i]: DecoderBlock           post-norm: x = x + norm_attn(attn(x)); x = x + norm_mlp(mlp(x))
        attn: SelfAttention        q, k, v, o (nn.Linear); q_ln / k_ln: RMSNorm over the whole projection,
                                   before the head split; half-split RoPE in float32 with the theta of
                                   the layer's kind; eager softmax in float32; GQA by repeat_interleave
        mlp: GatedMLP              w_gate, w_up, w_down
      ln_f: RMSNorm
      lm_head: nn.Linear           tied to wte when the config says so

``forward(input_ids, attention_mask=None, past_key_values=None, use_cache=False)``: ``attention_mask``
covers every token so far (cached + new; 0 on padding), as ``generate`` passes it. RoPE positions
are counted over each row's real tokens (``cumsum(mask) - 1``, padding at 1, as ``generate`` does).
Returns the logits, or ``(logits, cache)`` with ``use_cache=True`` (a new cache when none is given).

Cache (``KVCache``): per layer the keys/values after RoPE, (batch, kv_heads, length, head_dim), oldest
first, and ``seen``, the number of tokens fed so far (padding included). A call attends over
cached + new keys, then stores them; sliding layers then keep their last ``window`` tokens (not
``window - 1`` as Transformers' DynamicCache: the oldest one is masked out anyway, since a query
sees ``q - window < k <= q``), full layers keep everything.

The parity adapters are the last section, the only code that imports parity: ``CACHE`` shows each
layer's cache as held (``window`` tokens on sliding layers); ``CACHE_AS_TRANSFORMERS`` shows sliding
layers cut to the last ``window - 1`` tokens, what Transformers' cache would hold.

BUG switch (module level, None = correct model):

    "second_call_ignores_cache"  a multi-token call on a non-empty cache attends over its own tokens
                                 only (the cached keys are still stored, never read)
    "window_cache_cut_early"     sliding layers keep window - 2 tokens
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = None  # None | "second_call_ignores_cache" | "window_cache_cut_early"

SLIDING, FULL = "sliding_attention", "full_attention"


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class LayerKV:
    def __init__(self, keep: int | None):
        self.keep = keep  # None: keep every token
        self.k = self.v = None

    def __len__(self):
        return 0 if self.k is None else self.k.shape[2]

    def store(self, k, v):
        if self.keep is not None:
            k, v = k[:, :, -self.keep :], v[:, :, -self.keep :]
        self.k, self.v = k, v


class KVCache:
    def __init__(self, kinds, window):
        keep = window - 2 if BUG == "window_cache_cut_early" else window
        self.layers = [LayerKV(keep if kind == SLIDING else None) for kind in kinds]
        self.window = window
        self.seen = 0


class SelfAttention(nn.Module):
    def __init__(self, cfg, kind):
        super().__init__()
        self.kind = kind
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.window = cfg.sliding_window if kind == SLIDING else None
        bias = bool(getattr(cfg, "attention_bias", False))
        d = cfg.hidden_size
        self.q = nn.Linear(d, self.nh * self.hd, bias=bias)
        self.k = nn.Linear(d, self.nkv * self.hd, bias=bias)
        self.v = nn.Linear(d, self.nkv * self.hd, bias=bias)
        self.o = nn.Linear(self.nh * self.hd, d, bias=bias)
        self.q_ln = RMSNorm(self.nh * self.hd, cfg.rms_norm_eps)
        self.k_ln = RMSNorm(self.nkv * self.hd, cfg.rms_norm_eps)

    @staticmethod
    def rope(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        rot = torch.cat([-x2, x1], dim=-1)
        return (x.float() * cos + rot * sin).to(x.dtype)

    def forward(self, x, cos, sin, pad, layer_kv: LayerKV | None, start: int):
        b, n, _ = x.shape
        q = self.q_ln(self.q(x)).view(b, n, self.nh, self.hd).transpose(1, 2)
        k = self.k_ln(self.k(x)).view(b, n, self.nkv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, n, self.nkv, self.hd).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if layer_kv is not None and len(layer_kv):
            all_k = torch.cat([layer_kv.k, k], dim=2)
            all_v = torch.cat([layer_kv.v, v], dim=2)
            layer_kv.store(all_k, all_v)
            if BUG == "second_call_ignores_cache" and n > 1:
                all_k, all_v = k, v
        else:
            all_k, all_v = k, v
            if layer_kv is not None:
                layer_kv.store(k, v)
        first = start + n - all_k.shape[2]  # sequence index of the oldest key attended over
        qi = torch.arange(start, start + n, device=x.device)[:, None]
        ki = torch.arange(first, start + n, device=x.device)[None, :]
        ok = ki <= qi
        if self.window is not None:
            ok = ok & (ki > qi - self.window)
        ok = ok[None, None]
        if pad is not None:
            ok = ok & pad[:, first : start + n].bool()[:, None, None, :]
        g = self.nh // self.nkv
        kk, vv = all_k.repeat_interleave(g, dim=1), all_v.repeat_interleave(g, dim=1)
        scores = (q @ kk.transpose(-1, -2)) * self.hd**-0.5
        scores = scores.masked_fill(~ok, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o((probs @ vv).transpose(1, 2).reshape(b, n, -1))


class GatedMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg, kind):
        super().__init__()
        self.kind = kind
        self.attn = SelfAttention(cfg, kind)
        self.norm_attn = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)
        self.norm_mlp = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, pad, layer_kv, start):
        x = x + self.norm_attn(self.attn(x, cos, sin, pad, layer_kv, start))
        return x + self.norm_mlp(self.mlp(x))


class Olmo3ForGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.kinds = list(cfg.layer_types or [FULL] * cfg.num_hidden_layers)
        self.window = cfg.sliding_window
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.theta = {}
        for kind in set(self.kinds):
            params = (cfg.rope_parameters or {}).get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise NotImplementedError(f"RoPE type {params['rope_type']!r} on {kind} layers")
            self.theta[kind] = float(params.get("rope_theta", 10000.0))
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.h = nn.ModuleList(DecoderBlock(cfg, kind) for kind in self.kinds)
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def new_cache(self) -> KVCache:
        return KVCache(self.kinds, self.window)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        b, n = input_ids.shape
        cache = past_key_values if past_key_values is not None else (self.new_cache() if use_cache else None)
        start = cache.seen if cache is not None else 0
        if attention_mask is not None:
            if attention_mask.shape[1] != start + n:
                raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens, expected {start + n}")
            pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)[:, start:]
        else:
            pos = torch.arange(start, start + n, device=input_ids.device)[None].expand(b, n)
        x = self.wte(input_ids)
        tables = {}
        for kind, theta in self.theta.items():
            inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim)
            ang = pos.float()[..., None] * inv
            ang = torch.cat([ang, ang], dim=-1)[:, None]
            tables[kind] = (ang.cos(), ang.sin())
        for i, blk in enumerate(self.h):
            cos, sin = tables[blk.kind]
            x = blk(x, cos, sin, attention_mask, cache.layers[i] if cache is not None else None, start)
        logits = self.lm_head(self.ln_f(x))
        if cache is None:
            return logits
        cache.seen = start + n
        return logits, cache


# ------------------------------------------------------------------------------------------ loading

_RENAME = {
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o",
    "self_attn.q_norm": "attn.q_ln",
    "self_attn.k_norm": "attn.k_ln",
    "post_attention_layernorm": "norm_attn",
    "post_feedforward_layernorm": "norm_mlp",
    "mlp.gate_proj": "mlp.w_gate",
    "mlp.up_proj": "mlp.w_up",
    "mlp.down_proj": "mlp.w_down",
}


def build(state_dict, hf_config) -> nn.Module:
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    with torch.device("meta"):
        model = Olmo3ForGeneration(hf_config)
    ours = {}
    for key, t in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key == "model.embed_tokens.weight":
            ours["wte.weight"] = t
        elif key == "model.norm.weight":
            ours["ln_f.weight"] = t
        elif key == "lm_head.weight":
            if not tied:
                ours["lm_head.weight"] = t
        else:
            _, _, i, rest = key.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            ours[f"h.{i}.{_RENAME[module]}.{leaf}"] = t
    if tied:
        ours["lm_head.weight"] = ours["wte.weight"]
    model.load_state_dict(ours, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.wte.weight
    return model.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ parity

import parity  # noqa: E402  (the adapter below is the only code that knows parity)


def _forward(model, ids, mask, pos, cache):
    return model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)[0]


def _layers(cache: KVCache):
    """Every layer's (keys, values) as held, oldest first; (None, None) before the first call."""
    return [(kv.k, kv.v) for kv in cache.layers]


def _layers_as_transformers(cache: KVCache):
    """The same, sliding layers cut to the last window - 1 tokens, what Transformers' cache holds."""
    cut = cache.window - 1
    return [
        (kv.k[:, :, -cut:], kv.v[:, :, -cut:]) if kv.keep and kv.k is not None else (kv.k, kv.v) for kv in cache.layers
    ]


CACHE = parity.CacheProtocol(new_cache=lambda model: model.new_cache(), forward=_forward, layers=_layers)
CACHE_AS_TRANSFORMERS = parity.CacheProtocol(
    new_cache=lambda model: model.new_cache(), forward=_forward, layers=_layers_as_transformers
)
