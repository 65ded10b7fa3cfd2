"""Hand-written plain-PyTorch port of Ministral 3 (Ministral3ForCausalLM), the text decoder of Mistral 3.

Architecture as this port implements it:
- token embedding (no scaling); L pre-norm blocks; final RMSNorm; LM head tied to the embedding when
  tie_word_embeddings (else lm_head).
- block: h = h + Attn(RMSNorm(h)); h = h + SwiGLU(RMSNorm(h)), SwiGLU = down(silu(gate x) * up x), no biases.
- Attn: explicit head_dim (may differ from hidden / heads), GQA; RoPE in the rotate-half convention with YaRN
  frequencies, YaRN's attention factor multiplying cos and sin; after RoPE the query is multiplied by the Llama-4
  position-dependent scale  1 + beta * log(1 + floor(pos / original_max_position_embeddings))  (beta =
  rope_parameters["llama_4_scaling_beta"]); softmax(q k^T / sqrt(hd)); causal + padding mask, and, when
  config.sliding_window is set, a window on the token index: key j visible to query i iff i - W < j <= i.
- positions: `position_ids`, else 0..S-1. Padding queries may see themselves only (their outputs are never used).

Layouts (BUG selects one; every one is a correct port):
- "" (baseline): own names; q / k / v / o TRANSPOSED (x @ W); gate and up fused into one transposed (H, 2I) tensor
  [gate | up]; cos / sin tables for all positions precomputed as buffers with the YaRN attention factor folded in;
  the Llama-4 query scale precomputed as a per-position table; the head reuses the embedding Parameter (tied).
- mi_meta_complex_rope: mistral-inference's layout and names (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3,
  attention_norm, ffn_norm, tok_embeddings, output): wq / wk rows in Meta's interleaved pair order, RoPE as a
  complex multiplication by freqs_cis computed per call.
- mi_heads_einsum: weights with a head axis (heads, hd, H); projections and output by einsum, GQA by grouping the
  query heads (no repeat of k / v).
- mi_interleaved_gate_up: out x in (F.linear) layouts; q / k / v fused in one [q | k | v] weight; gate / up
  INTERLEAVED row by row ([g0, u0, g1, u1, ...]) and split with strided slices.
- mi_stacked_layers: one (L, ...) tensor per weight kind (transposed), both norm gains of a layer in (L, 2, H),
  indexed in a loop.
- mi_folded_norms: the RMSNorm gains folded into wq / wk / wv, into gate / up, and the final one into an untied
  copy of the head; 1/sqrt(hd) and attention_factor^2 folded into wq (cos / sin tables without the factor).
- mi_sdpa_posmask: F.scaled_dot_product_attention with a boolean (causal & window & padding) mask; positions (RoPE
  and the Llama-4 scale) recomputed from the attention mask, ignoring position_ids.
- mi_functional_banded: one functional forward over a flat ParameterDict; sliding-window attention computed block by
  block (queries in blocks of W, each against the keys of its own and the previous block only).
- mi_gemma_norm_kvfused: norm gains stored as (g - 1) and applied as (1 + w); k and v fused into one transposed
  (H, 2 nkv hd) tensor; the body returns hidden states and a separate head module holds its own transposed (H, V)
  copy of the embedding.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = []
PADDING_ONLY = []
CLEAN = [
    "mi_meta_complex_rope",  # mistral-inference names, Meta-permuted wq/wk rows, complex freqs_cis RoPE
    "mi_heads_einsum",  # (heads, hd, H) weights, einsum projections, grouped-query einsum attention
    "mi_interleaved_gate_up",  # out x in layouts, fused [q | k | v], gate/up interleaved row by row
    "mi_stacked_layers",  # one (L, ...) tensor per weight kind, transposed, indexed in a loop
    "mi_folded_norms",  # norm gains folded into next projections / untied head copy; 1/sqrt(hd) * af^2 into wq
    "mi_sdpa_posmask",  # SDPA with a boolean window mask; positions recomputed from the attention mask
    "mi_functional_banded",  # functional forward over a flat ParameterDict; sliding window computed block-banded
    "mi_gemma_norm_kvfused",  # gains stored as g - 1; fused [k | v]; separate head module with a transposed copy
]


# --------------------------------------------------------------------------------------------------- helpers
def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope_setup(config, dim):
    """(inv_freq, attention_factor) for default or YaRN RoPE."""
    rp = dict(config.rope_parameters or {})
    base = rp.get("rope_theta", 10000.0)
    kind = rp.get("rope_type", "default")
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv, 1.0
    assert kind == "yarn", kind
    old = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or config.max_position_embeddings / old
    ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
    af = rp.get("attention_factor")
    if af is None:
        af = _mscale(factor, ms) / _mscale(factor, msa) if (ms and msa) else _mscale(factor)
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr(rot):
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr(fast), corr(slow)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(af)


def _llama4_scale(pos, beta, orig):
    """1 + beta * log(1 + floor(pos / orig)), pos any shape (float result)."""
    if not beta:
        return torch.ones(pos.shape, device=pos.device)
    return 1 + beta * torch.log(1 + torch.floor(pos / orig))


def _positions(input_ids, position_ids):
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    return position_ids


def _keep(attention_mask, s, window, device):
    """bool (b or 1, 1, s, s): causal, inside the window, not padding; a query always sees itself."""
    idx = torch.arange(s, device=device)
    keep = idx[None, :] <= idx[:, None]
    if window is not None:
        keep = keep & (idx[None, :] > idx[:, None] - window)
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.bool()[:, None, None, :]
    return keep | torch.eye(s, dtype=torch.bool, device=device)


def _additive(keep):
    return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, torch.finfo(torch.float32).min)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _meta_perm(n_heads, hd):
    """Row order turning the rotate-half head layout into Meta's interleaved one: meta[2i + j] = hf[j * hd/2 + i]."""
    return torch.arange(n_heads * hd).view(n_heads, 2, hd // 2).transpose(1, 2).reshape(-1)


def _attend(q, k, v, add, scale):
    """Explicit softmax attention; q (b, s, nh, hd), k / v (b, s, nkv, hd) -> (b, s, nh hd)."""
    b, s, nh, hd = q.shape
    g = nh // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    p = ((q @ k.transpose(-1, -2)) * scale + add).softmax(-1)
    return (p @ v).transpose(1, 2).reshape(b, s, nh * hd)


class _Cfg:
    def __init__(self, sd, config):
        self.H = config.hidden_size
        self.nh = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.hd = getattr(config, "head_dim", None) or self.H // self.nh
        self.L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.max_pos = config.max_position_embeddings
        self.window = getattr(config, "sliding_window", None)
        self.inv_freq, self.af = _rope_setup(config, self.hd)
        rp = dict(config.rope_parameters or {})
        self.beta = rp.get("llama_4_scaling_beta")
        self.orig = rp.get("original_max_position_embeddings")


def _g(sd, name, i=None):
    return sd[name if i is None else f"model.layers.{i}.{name}"].detach().float().clone()


def _layer(sd, i):
    a = "self_attn."
    w = {n: _g(sd, f"{a}{n}_proj.weight", i) for n in "qkvo"}
    w.update({n: _g(sd, f"mlp.{n}_proj.weight", i) for n in ("gate", "up", "down")})
    w["g_attn"] = _g(sd, "input_layernorm.weight", i)
    w["g_ffn"] = _g(sd, "post_attention_layernorm.weight", i)
    return w


def _head(sd, config):
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in sd:
        return None
    return _g(sd, "lm_head.weight")


# ------------------------------------------------------------------------------------ module-tree ports
class Block(nn.Module):
    def __init__(self, w, c, variant):
        super().__init__()
        self.c, self.v = c, variant
        nh, nkv, hd, H = c.nh, c.nkv, c.hd, c.H
        if variant == "mi_meta_complex_rope":
            self.attention_norm, self.ffn_norm = nn.Parameter(w["g_attn"]), nn.Parameter(w["g_ffn"])
            self.attention = nn.ParameterDict(
                dict(
                    wq=nn.Parameter(w["q"][_meta_perm(nh, hd)]),
                    wk=nn.Parameter(w["k"][_meta_perm(nkv, hd)]),
                    wv=nn.Parameter(w["v"]),
                    wo=nn.Parameter(w["o"]),
                )
            )
            self.feed_forward = nn.ParameterDict(
                dict(w1=nn.Parameter(w["gate"]), w2=nn.Parameter(w["down"]), w3=nn.Parameter(w["up"]))
            )
        elif variant == "mi_heads_einsum":
            self.g_attn, self.g_ffn = nn.Parameter(w["g_attn"]), nn.Parameter(w["g_ffn"])
            self.wq = nn.Parameter(w["q"].view(nh, hd, H))
            self.wk = nn.Parameter(w["k"].view(nkv, hd, H))
            self.wv = nn.Parameter(w["v"].view(nkv, hd, H))
            self.wo = nn.Parameter(w["o"].t().reshape(nh, hd, H))
            self.w13 = nn.Parameter(torch.cat([w["gate"], w["up"]]).t().contiguous())
            self.w2 = nn.Parameter(w["down"].t().contiguous())
        elif variant == "mi_interleaved_gate_up":
            self.g_attn, self.g_ffn = nn.Parameter(w["g_attn"]), nn.Parameter(w["g_ffn"])
            self.qkv = nn.Parameter(torch.cat([w["q"], w["k"], w["v"]]))
            self.o = nn.Parameter(w["o"])
            self.gate_up = nn.Parameter(torch.stack([w["gate"], w["up"]], 1).reshape(-1, H))
            self.down = nn.Parameter(w["down"])
        elif variant == "mi_gemma_norm_kvfused":
            self.g_attn, self.g_ffn = nn.Parameter(w["g_attn"] - 1), nn.Parameter(w["g_ffn"] - 1)
            self.wq = nn.Parameter(w["q"].t().contiguous())
            self.wkv = nn.Parameter(torch.cat([w["k"], w["v"]]).t().contiguous())
            self.wo = nn.Parameter(w["o"].t().contiguous())
            self.w13 = nn.Parameter(torch.cat([w["gate"], w["up"]]).t().contiguous())
            self.w2 = nn.Parameter(w["down"].t().contiguous())
        else:  # baseline, folded, sdpa
            wq, wk, wv, wg, wu = w["q"], w["k"], w["v"], w["gate"], w["up"]
            if variant == "mi_folded_norms":
                wq, wk, wv = wq * w["g_attn"], wk * w["g_attn"], wv * w["g_attn"]
                wg, wu = wg * w["g_ffn"], wu * w["g_ffn"]
                wq = wq * (hd**-0.5 * c.af**2)
            else:
                self.g_attn, self.g_ffn = nn.Parameter(w["g_attn"]), nn.Parameter(w["g_ffn"])
            self.wq = nn.Parameter(wq.t().contiguous())
            self.wk = nn.Parameter(wk.t().contiguous())
            self.wv = nn.Parameter(wv.t().contiguous())
            self.wo = nn.Parameter(w["o"].t().contiguous())
            self.w13 = nn.Parameter(torch.cat([wg, wu]).t().contiguous())
            self.w2 = nn.Parameter(w["down"].t().contiguous())

    def forward(self, h, rope, qscale, keep, add):
        c, v = self.c, self.v
        b, s, _ = h.shape
        nh, nkv, hd = c.nh, c.nkv, c.hd
        g = nh // nkv
        if v == "mi_meta_complex_rope":
            at, ff = self.attention, self.feed_forward
            x = _rms(h, c.eps) * self.attention_norm
            xq = F.linear(x, at["wq"]).view(b, s, nh, hd)
            xk = F.linear(x, at["wk"]).view(b, s, nkv, hd)
            xv = F.linear(x, at["wv"]).view(b, s, nkv, hd)
            fc = rope[:, :, None]
            xq = torch.view_as_real(torch.view_as_complex(xq.float().reshape(b, s, nh, -1, 2)) * fc).flatten(3)
            xk = torch.view_as_real(torch.view_as_complex(xk.float().reshape(b, s, nkv, -1, 2)) * fc).flatten(3)
            xq = xq * qscale[:, :, None, None]
            h = h + F.linear(_attend(xq, xk, xv, add, hd**-0.5), at["wo"])
            x = _rms(h, c.eps) * self.ffn_norm
            return h + F.linear(F.silu(F.linear(x, ff["w1"])) * F.linear(x, ff["w3"]), ff["w2"])
        cos, sin = rope
        if v == "mi_heads_einsum":
            x = _rms(h, c.eps) * self.g_attn
            q = torch.einsum("bsh,ndh->bsnd", x, self.wq)
            k = torch.einsum("bsh,ndh->bsnd", x, self.wk)
            val = torch.einsum("bsh,ndh->bsnd", x, self.wv)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            q = (q * qscale[:, :, None, None]).view(b, s, nkv, g, hd)
            sc = torch.einsum("bqngd,bknd->bngqk", q, k) * hd**-0.5 + add[:, :, None]
            o = torch.einsum("bngqk,bknd->bqngd", sc.softmax(-1), val).reshape(b, s, nh, hd)
            h = h + torch.einsum("bsnd,ndh->bsh", o, self.wo)
            x = _rms(h, c.eps) * self.g_ffn
            gt, up = (x @ self.w13).chunk(2, -1)
            return h + (F.silu(gt) * up) @ self.w2
        if v == "mi_interleaved_gate_up":
            x = _rms(h, c.eps) * self.g_attn
            q, k, val = F.linear(x, self.qkv).split([nh * hd, nkv * hd, nkv * hd], -1)
            q, k, val = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), val.view(b, s, nkv, hd)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            q = q * qscale[:, :, None, None]
            h = h + F.linear(_attend(q, k, val, add, hd**-0.5), self.o)
            x = _rms(h, c.eps) * self.g_ffn
            gu = F.linear(x, self.gate_up)
            return h + F.linear(F.silu(gu[..., 0::2]) * gu[..., 1::2], self.down)
        if v == "mi_gemma_norm_kvfused":
            x = _rms(h, c.eps) * (1 + self.g_attn)
            q = (x @ self.wq).view(b, s, nh, hd)
            k, val = (x @ self.wkv).view(b, s, 2, nkv, hd).unbind(2)
        else:
            x = _rms(h, c.eps)
            if v != "mi_folded_norms":
                x = x * self.g_attn
            q = (x @ self.wq).view(b, s, nh, hd)
            k, val = (x @ self.wk).view(b, s, nkv, hd), (x @ self.wv).view(b, s, nkv, hd)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q = q * qscale[:, :, None, None]
        if v == "mi_sdpa_posmask":
            qt = q.transpose(1, 2)
            kt = k.transpose(1, 2).repeat_interleave(g, 1)
            vt = val.transpose(1, 2).repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, scale=hd**-0.5)
            o = o.transpose(1, 2).reshape(b, s, nh * hd)
        else:
            o = _attend(q, k, val, add, 1.0 if v == "mi_folded_norms" else hd**-0.5)
        h = h + o @ self.wo
        x = _rms(h, c.eps)
        if v == "mi_gemma_norm_kvfused":
            x = x * (1 + self.g_ffn)
        elif v != "mi_folded_norms":
            x = x * self.g_ffn
        gt, up = (x @ self.w13).chunk(2, -1)
        return h + (F.silu(gt) * up) @ self.w2


class Ministral3Port(nn.Module):
    def __init__(self, sd, config, variant, with_head=True):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        self.v = variant
        emb = _g(sd, "model.embed_tokens.weight")
        head = _head(sd, config)
        gn = _g(sd, "model.norm.weight")
        if variant == "mi_meta_complex_rope":
            self.tok_embeddings = nn.Parameter(emb)
            self.layers = nn.ModuleList([Block(_layer(sd, i), c, variant) for i in range(c.L)])
            self.norm = nn.Parameter(gn)
            self.output = self.tok_embeddings if head is None else nn.Parameter(head)
            return
        self.embed = nn.Parameter(emb)
        self.blocks = nn.ModuleList([Block(_layer(sd, i), c, variant) for i in range(c.L)])
        if variant == "mi_folded_norms":
            self.head_t = nn.Parameter(((emb if head is None else head) * gn).t().contiguous())
        elif variant == "mi_gemma_norm_kvfused":
            self.final_norm = nn.Parameter(gn - 1)
        else:
            self.final_norm = nn.Parameter(gn)
            self.head = self.embed if head is None else nn.Parameter(head)  # tied: the same Parameter
        freqs = torch.outer(torch.arange(c.max_pos, dtype=torch.float32), c.inv_freq)
        emb2 = torch.cat([freqs, freqs], -1)
        af = 1.0 if variant == "mi_folded_norms" else c.af
        self.register_buffer("cos_t", emb2.cos() * af, persistent=False)
        self.register_buffer("sin_t", emb2.sin() * af, persistent=False)
        self.register_buffer(
            "qscale_t", _llama4_scale(torch.arange(c.max_pos, dtype=torch.float32), c.beta, c.orig), persistent=False
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        s = input_ids.shape[1]
        if self.v == "mi_sdpa_posmask":
            am = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            position_ids = (am.long().cumsum(-1) - 1).clamp(min=0)
        pos = _positions(input_ids, position_ids)
        keep = _keep(attention_mask, s, c.window, input_ids.device)
        add = _additive(keep)
        if self.v == "mi_meta_complex_rope":
            ang = pos.float()[..., None] * c.inv_freq.to(input_ids.device)
            rope = torch.polar(torch.full_like(ang, c.af), ang)  # freqs_cis, attention factor as its modulus
            qscale = _llama4_scale(pos.float(), c.beta, c.orig)
            h = F.embedding(input_ids, self.tok_embeddings)
            for layer in self.layers:
                h = layer(h, rope, qscale, keep, add)
            return F.linear(_rms(h, c.eps) * self.norm, self.output).float()
        rope = (self.cos_t[pos][:, :, None], self.sin_t[pos][:, :, None])
        qscale = self.qscale_t[pos]
        h = F.embedding(input_ids, self.embed)
        for blk in self.blocks:
            h = blk(h, rope, qscale, keep, add)
        h = _rms(h, c.eps)
        if self.v == "mi_folded_norms":
            return (h @ self.head_t).float()
        if self.v == "mi_gemma_norm_kvfused":
            return h * (1 + self.final_norm)
        return F.linear(h * self.final_norm, self.head).float()


class TransposedHead(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight_t = nn.Parameter(weight.t().contiguous())  # (H, V)

    def forward(self, h):
        return h @ self.weight_t


class Ministral3BodyAndHead(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.body = Ministral3Port(sd, config, "mi_gemma_norm_kvfused")
        head = _head(sd, config)
        self.lm_head = TransposedHead(_g(sd, "model.embed_tokens.weight") if head is None else head)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.lm_head(self.body(input_ids, attention_mask, position_ids)).float()


# ------------------------------------------------------------------------------------ stacked layers
class Ministral3Stacked(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        ws = [_layer(sd, i) for i in range(c.L)]
        st = lambda k: nn.Parameter(torch.stack([w[k].t() for w in ws]).contiguous())
        self.emb = nn.Parameter(_g(sd, "model.embed_tokens.weight"))
        self.Wq, self.Wk, self.Wv, self.Wo = st("q"), st("k"), st("v"), st("o")
        self.Wg, self.Wu, self.Wd = st("gate"), st("up"), st("down")
        self.G = nn.Parameter(torch.stack([torch.stack([w["g_attn"], w["g_ffn"]]) for w in ws]))
        self.g_final = nn.Parameter(_g(sd, "model.norm.weight"))
        head = _head(sd, config)
        if head is not None:
            self.lm_head = nn.Parameter(head)
        self.register_buffer("inv_freq", c.inv_freq, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        b, s = input_ids.shape
        nh, nkv, hd = c.nh, c.nkv, c.hd
        pos = _positions(input_ids, position_ids).float()
        ang = pos[..., None] * self.inv_freq
        ang = torch.cat([ang, ang], -1)
        cos, sin = (ang.cos() * c.af)[:, :, None], (ang.sin() * c.af)[:, :, None]
        qs = _llama4_scale(pos, c.beta, c.orig)[:, :, None, None]
        add = _additive(_keep(attention_mask, s, c.window, input_ids.device))
        h = self.emb[input_ids]
        for i in range(c.L):
            x = _rms(h, c.eps) * self.G[i, 0]
            q = (x @ self.Wq[i]).view(b, s, nh, hd)
            k = (x @ self.Wk[i]).view(b, s, nkv, hd)
            v = (x @ self.Wv[i]).view(b, s, nkv, hd)
            q = (q * cos + _rotate_half(q) * sin) * qs
            k = k * cos + _rotate_half(k) * sin
            h = h + _attend(q, k, v, add, hd**-0.5) @ self.Wo[i]
            x = _rms(h, c.eps) * self.G[i, 1]
            h = h + (F.silu(x @ self.Wg[i]) * (x @ self.Wu[i])) @ self.Wd[i]
        h = _rms(h, c.eps) * self.g_final
        return F.linear(h, self.lm_head if hasattr(self, "lm_head") else self.emb).float()


# ------------------------------------------------------------------------------------ functional port
def _banded_attention(q, k, v, attention_mask, window, scale):
    """Sliding-window causal attention computed per query block of `window` tokens, each block against the keys of
    its own and the previous block (the only ones a window can reach). q (b, nh, s, hd), k / v (b, nh, s, hd)."""
    b, s = q.shape[0], q.shape[2]
    W = window if window is not None else s
    out = torch.empty_like(q)
    valid = attention_mask.bool() if attention_mask is not None else torch.ones(b, s, dtype=torch.bool)
    for start in range(0, s, W):
        end = min(start + W, s)
        k0 = max(0, start - W + 1) if window is not None else 0
        qi = torch.arange(start, end)[:, None]
        kj = torch.arange(k0, end)[None, :]
        ok = (kj <= qi) & (kj > qi - W) if window is not None else kj <= qi
        ok = (ok[None, None] & valid[:, None, None, k0:end]) | (kj == qi)[None, None]
        sc = (q[:, :, start:end] @ k[:, :, k0:end].transpose(-1, -2)) * scale
        sc = sc.masked_fill(~ok, float("-inf"))
        out[:, :, start:end] = sc.softmax(-1) @ v[:, :, k0:end]
    return out


def ministral3_forward(P, c, input_ids, attention_mask=None, position_ids=None):
    """One functional forward over a flat dict of the checkpoint's out x in tensors."""
    b, s = input_ids.shape
    nh, nkv, hd = c.nh, c.nkv, c.hd
    g = nh // nkv
    pos = _positions(input_ids, position_ids).float()
    ang = pos[..., None] * P["inv_freq"]
    ang = torch.cat([ang, ang], -1)
    cos, sin = (ang.cos() * c.af)[:, None], (ang.sin() * c.af)[:, None]
    qs = _llama4_scale(pos, c.beta, c.orig)[:, None, :, None]
    h = F.embedding(input_ids, P["tok_embeddings"])
    for i in range(c.L):
        p = f"l{i}_"
        x = _rms(h, c.eps) * P[p + "attention_norm"]
        q = F.linear(x, P[p + "wq"]).view(b, s, nh, hd).transpose(1, 2)
        k = F.linear(x, P[p + "wk"]).view(b, s, nkv, hd).transpose(1, 2)
        v = F.linear(x, P[p + "wv"]).view(b, s, nkv, hd).transpose(1, 2)
        q = (q * cos + _rotate_half(q) * sin) * qs
        k = k * cos + _rotate_half(k) * sin
        k = k[:, :, None].expand(b, nkv, g, s, hd).reshape(b, nh, s, hd)
        v = v[:, :, None].expand(b, nkv, g, s, hd).reshape(b, nh, s, hd)
        o = _banded_attention(q, k, v, attention_mask, c.window, 1 / math.sqrt(hd))
        h = h + F.linear(o.transpose(1, 2).reshape(b, s, nh * hd), P[p + "wo"])
        x = _rms(h, c.eps) * P[p + "ffn_norm"]
        h = h + F.linear(F.silu(F.linear(x, P[p + "w1"])) * F.linear(x, P[p + "w3"]), P[p + "w2"])
    h = _rms(h, c.eps) * P["norm"]
    return F.linear(h, P.get("output", P["tok_embeddings"])).float()


class Ministral3Functional(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        P = {"tok_embeddings": _g(sd, "model.embed_tokens.weight"), "norm": _g(sd, "model.norm.weight")}
        head = _head(sd, config)
        if head is not None:
            P["output"] = head
        for i in range(c.L):
            w, p = _layer(sd, i), f"l{i}_"
            P.update({p + "wq": w["q"], p + "wk": w["k"], p + "wv": w["v"], p + "wo": w["o"]})
            P.update({p + "w1": w["gate"], p + "w2": w["down"], p + "w3": w["up"]})
            P.update({p + "attention_norm": w["g_attn"], p + "ffn_norm": w["g_ffn"]})
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in P.items()})
        self.register_buffer("inv_freq", c.inv_freq, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        P = dict(self.params.items())
        P["inv_freq"] = self.inv_freq
        return ministral3_forward(P, self.c, input_ids, attention_mask, position_ids)


# ------------------------------------------------------------------------------------ entry point
def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN and variant not in BUGS:
        raise ValueError(f"unknown layout variant {variant!r}")
    with torch.no_grad():
        if variant == "mi_stacked_layers":
            model = Ministral3Stacked(state_dict, config)
        elif variant == "mi_functional_banded":
            model = Ministral3Functional(state_dict, config)
        elif variant == "mi_gemma_norm_kvfused":
            model = Ministral3BodyAndHead(state_dict, config)
        else:
            model = Ministral3Port(state_dict, config, variant)
    return model.eval()
