"""From-scratch PyTorch port of Mixtral (MixtralForCausalLM, sparse MoE) weights.

Conventions of this port
------------------------
* Attention uses ONE fused ``qkv`` Linear (rows = [q heads | k heads | v heads],
  no bias), GQA (query head h reads KV head h // group), full-width rotary
  embedding with NeoX rotate-half pairing, and ``torch.nn.functional.
  scaled_dot_product_attention`` with an explicit additive mask.
* Sliding window: query i may attend key j iff ``i - window < j <= i`` (window
  counts the query itself), in both the unpadded (no mask) and padded paths.
* MoE: router logits -> softmax over ALL experts (fp32) -> top-k -> renormalise the
  k weights to sum 1.  Experts are stacked in two 3-D parameters:
  ``w13`` (E, 2*I, H) holding [w1 (gate); w3 (up)] and ``w2`` (E, H, I); the
  reference path gathers the selected experts' weights per token.
  expert(x) = w2 @ (silu(w1 @ x) * (w3 @ x)).
* RMSNorm (weight * x / rms), untied lm_head without bias.
* The checkpoint is read in the on-disk layout
  ``model.layers.N.block_sparse_moe.experts.E.w{1,2,3}.weight`` and
  ``block_sparse_moe.gate.weight``.
* Call: ``module(input_ids, attention_mask=None, position_ids=None)`` -> logits
  (batch, seq, vocab); left padding via ``attention_mask`` and caller position_ids.

``BUG`` selects the variant ("" reference, ``CLEAN`` equivalents, ``BUGS`` one mistake
each).  ``REC`` (dict) receives intermediate tensors under HF module names.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "router_no_renorm",  # top-k softmax probabilities used without renormalising them to sum 1
    "router_softmax_dim0",  # router softmax taken over the token axis (dim 0) instead of the expert axis
    "last_expert_skipped",  # expert loop skips e == num_experts - 1 (HF's sentinel check copied off by one)
    "w1_w3_swapped",  # loader stacks [w3; w1] so silu is applied to the up projection
    "gate_up_interleaved_split",  # w13 stacked [w1; w3] but split as interleaved rows (::2 / 1::2)
    "router_bf16",  # router matmul and softmax run in bfloat16
    "window_off_by_one",  # window test j >= i - window lets window+1 keys through
    "window_only_padded_path",  # unpadded path uses plain causal attention, window only built with a mask
    "window_lost_with_padding",  # padded path rebuilds mask as causal & padding, dropping the window
    "mask_as_additive_01",  # 0/1 attention_mask added to the scores as if it were an additive bias
    "weights_flatten_order",  # routing weights flattened k-major while expert ids are flattened token-major
    "rope_bf16_cache",  # cos/sin table computed and cached in bfloat16
    "rmsnorm_one_plus",  # RMSNorm scale written as (1 + weight) (Gemma template)
    "router_unnormed_input",  # router fed the pre-norm residual stream instead of post_attention_layernorm output
    "qkv_grouped_layout",  # qkv packed per KV group [q_g, k_g, v_g] (Megatron style) but split as [Q | K | V]
]
PADDING_ONLY = {"window_lost_with_padding", "mask_as_additive_01"}
CLEAN = [
    "expert_loop",  # loop over experts with index_add instead of gathering stacked weights
    "topk_then_softmax",  # top-k on logits, softmax over the k selected logits (equal to softmax-topk-renorm)
    "eager_attn",  # manual softmax attention with repeat_interleave'd K/V instead of SDPA
]


def _rec(name, value):
    if isinstance(REC, dict):
        if isinstance(value, tuple):
            REC[name] = tuple(v.detach().clone() for v in value)
        else:
            REC[name] = value.detach().clone()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = 1.0 + self.weight if BUG == "rmsnorm_one_plus" else self.weight
        return w * y


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.E = cfg.num_local_experts
        self.k = cfg.num_experts_per_tok
        self.inner = cfg.intermediate_size
        self.router = nn.Linear(cfg.hidden_size, self.E, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.E, 2 * self.inner, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.E, cfg.hidden_size, self.inner))

    def route(self, x):
        if BUG == "router_bf16":
            logits = F.linear(x.bfloat16(), self.router.weight.bfloat16())
            probs = torch.softmax(logits, dim=-1)
            w, idx = probs.topk(self.k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            return logits.float(), w.float(), idx
        logits = self.router(x)
        if BUG == "topk_then_softmax":
            top, idx = logits.topk(self.k, dim=-1)
            w = torch.softmax(top.float(), dim=-1)
            return logits, w, idx
        probs = torch.softmax(logits.float(), dim=0 if BUG == "router_softmax_dim0" else -1)
        w, idx = probs.topk(self.k, dim=-1)
        if BUG != "router_no_renorm":
            w = w / w.sum(-1, keepdim=True)
        return logits, w, idx

    def _split(self, h):
        if BUG == "gate_up_interleaved_split":
            return h[..., 0::2], h[..., 1::2]
        return h[..., : self.inner], h[..., self.inner :]

    def experts_gathered(self, x, w, idx):
        N = x.shape[0]
        flat_idx = idx.reshape(-1)  # (N*k,) token-major
        if BUG == "weights_flatten_order":
            flat_w = w.t().reshape(-1)
        else:
            flat_w = w.reshape(-1)
        xs = x.repeat_interleave(self.k, dim=0)  # (N*k, H)
        h = torch.einsum("nh,nih->ni", xs, self.w13[flat_idx])  # (N*k, 2I)
        g, u = self._split(h)
        a = F.silu(g) * u
        y = torch.einsum("ni,nhi->nh", a, self.w2[flat_idx])  # (N*k, H)
        y = y * flat_w[:, None].to(y.dtype)
        return y.view(N, self.k, -1).sum(1)

    def experts_loop(self, x, w, idx):
        out = torch.zeros_like(x)
        for e in range(self.E):
            if BUG == "last_expert_skipped" and e == self.E - 1:
                continue
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            h = x[tok] @ self.w13[e].t()
            g, u = self._split(h)
            y = (F.silu(g) * u) @ self.w2[e].t()
            out.index_add_(0, tok, y * w[tok, slot, None].to(y.dtype))
        return out

    def forward(self, x, router_in, pfx):
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        logits, w, idx = self.route(router_in.reshape(-1, H))
        _rec(pfx + ".gate", (logits, w, idx))
        if BUG in ("expert_loop", "last_expert_skipped"):
            y = self.experts_loop(xf, w, idx)
        else:
            y = self.experts_gathered(xf, w, idx)
        _rec(pfx + ".experts", y)
        y = y.view(B, T, H)
        _rec(pfx, y)
        return y


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.qkv = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.out = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, pfx):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        _rec(pfx + ".q_proj", q)
        _rec(pfx + ".k_proj", k)
        _rec(pfx + ".v_proj", v)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        c, s = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q = q * c + _rot_half(q) * s
        k = k * c + _rot_half(k) * s
        if BUG == "eager_attn":
            g = self.nh // self.nkv
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
            sc = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd) + mask
            o = torch.softmax(sc.float(), dim=-1).to(q.dtype) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        o = self.out(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        _rec(pfx + ".o_proj", o)
        _rec(pfx, o)
        return o


def _rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm_attn = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.norm_ffn = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = SparseMoE(cfg)

    def forward(self, x, cos, sin, mask, pfx):
        h = self.norm_attn(x)
        _rec(pfx + ".input_layernorm", h)
        x = x + self.attn(h, cos, sin, mask, pfx + ".self_attn")
        h = self.norm_ffn(x)
        _rec(pfx + ".post_attention_layernorm", h)
        x = x + self.moe(h, x if BUG == "router_unnormed_input" else h, pfx + ".mlp")
        _rec(pfx, x)
        return x


class MixtralPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.window = cfg.sliding_window

    def rope(self, pos):
        ang = pos[..., None].float() * self.inv_freq
        ang = torch.cat([ang, ang], -1)
        if BUG == "rope_bf16_cache":
            return ang.bfloat16().cos().float(), ang.bfloat16().sin().float()
        return ang.cos(), ang.sin()

    def _band(self, T, device, with_window=True):
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(T, device=device)[None, :]
        ok = j <= i
        if self.window is not None and with_window:
            if BUG == "window_off_by_one":
                ok = ok & (j >= i - self.window)
            else:
                ok = ok & (j > i - self.window)
        return ok

    def make_mask(self, attention_mask, B, T, dtype, device):
        neg = torch.finfo(dtype).min
        if attention_mask is None:
            ok = self._band(T, device, with_window=(BUG != "window_only_padded_path"))[None, None]
            return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill(~ok, neg)
        band = self._band(T, device, with_window=(BUG != "window_lost_with_padding"))[None, None]
        am = attention_mask.bool()
        if BUG == "mask_as_additive_01":
            bias = torch.zeros(band.shape, dtype=dtype, device=device).masked_fill(~band, neg)
            return bias + attention_mask[:, None, None, :].to(dtype)
        ok = band & am[:, None, None, :]
        return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill(~ok, neg)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        x = self.embed(input_ids)
        _rec("model.embed_tokens", x)
        cos, sin = self.rope(position_ids)
        _rec("model.rotary_emb", (cos, sin))
        mask = self.make_mask(attention_mask, B, T, x.dtype, x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, f"model.layers.{i}")
        x = self.norm(x)
        _rec("model.norm", x)
        logits = self.lm_head(x)
        _rec("lm_head", logits)
        return logits


def _pack_qkv(q, k, v, nkv, hd):
    if BUG != "qkv_grouped_layout":
        return torch.cat([q, k, v], 0)
    g = q.shape[0] // (nkv * hd)
    parts = []
    for n in range(nkv):
        parts += [q[n * g * hd : (n + 1) * g * hd], k[n * hd : (n + 1) * hd], v[n * hd : (n + 1) * hd]]
    return torch.cat(parts, 0)


def build(state_dict, config):
    """Map the on-disk Mixtral checkpoint onto the fused/stacked layout of this port."""
    sd = {k: v.float() for k, v in state_dict.items()}
    model = MixtralPort(config)
    E = config.num_local_experts
    own = {
        "embed.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    att = model.layers[0].attn
    for i in range(config.num_hidden_layers):
        s = f"model.layers.{i}."
        d = f"layers.{i}."
        own[d + "norm_attn.weight"] = sd[s + "input_layernorm.weight"]
        own[d + "norm_ffn.weight"] = sd[s + "post_attention_layernorm.weight"]
        own[d + "attn.qkv.weight"] = _pack_qkv(
            sd[s + "self_attn.q_proj.weight"],
            sd[s + "self_attn.k_proj.weight"],
            sd[s + "self_attn.v_proj.weight"],
            att.nkv,
            att.hd,
        )
        own[d + "attn.out.weight"] = sd[s + "self_attn.o_proj.weight"]
        moe = s + "block_sparse_moe."
        own[d + "moe.router.weight"] = sd[moe + "gate.weight"]
        w13 = []
        for e in range(E):
            w1 = sd[moe + f"experts.{e}.w1.weight"]
            w3 = sd[moe + f"experts.{e}.w3.weight"]
            w13.append(torch.cat([w3, w1], 0) if BUG == "w1_w3_swapped" else torch.cat([w1, w3], 0))
        own[d + "moe.w13"] = torch.stack(w13, 0)
        own[d + "moe.w2"] = torch.stack([sd[moe + f"experts.{e}.w2.weight"] for e in range(E)], 0)
    missing, unexpected = model.load_state_dict(own, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()
