"""Hand-written plain-PyTorch port of LiquidAI LFM2 (Lfm2ForCausalLM): a hybrid of gated short-convolution
layers and GQA attention layers.

Architecture as this port implements it:
- token embedding (no scaling); the LM head is TIED to the embedding; RMSNorms are plain rms(x) * w
  (eps = config.norm_eps); the model's last norm (Transformers calls it embedding_norm) is applied to the final
  hidden states before the head.
- block i (pre-norm): h = h + Op(operator_norm(h)); h = h + FFN(ffn_norm(h)), FFN = w2(silu(w1 x) * w3 x) with the
  auto-adjusted width (int(2 I / 3), times block_ffn_dim_multiplier, rounded up to block_multiple_of).
- Op is config.layer_types[i]:
  "conv" (gated short conv): padding rows zeroed (x * mask) BEFORE in_proj (so with conv_bias the padding
  tokens carry in_proj's bias into the conv window, exactly as Transformers does); [B | C | x] = in_proj(x)
  (3 H, bias); y = C * causalconv(B * x) (depthwise, kernel L = conv_L_cache, bias, left zero padding);
  out_proj(y) (bias).
  "full_attention": q/k/v (no bias), per-head RMSNorm on q and k (q_layernorm / k_layernorm), RoPE (rotate-half,
  full head_dim, theta from config), GQA (kv head j serves query heads j*G .. j*G+G-1), causal softmax with key
  padding masked, scale 1/sqrt(hd), out_proj (no bias).
- positions: position_ids, else 0..T-1 (some variants derive them from the attention mask instead).

Layout of the baseline (BUG == ""), own names, matrices stored TRANSPOSED (in, out) and applied as x @ W:
- emb (V, H), reused by the head (F.linear(h, emb)); final_g; per block op_g / ffn_g.
- conv block: in_proj split at load into w_b_t / w_c_t / w_x_t with biases b_b / b_c / b_x; conv_w (C, K)
  (squeezed (C, 1, K)) applied by left zero padding + a sum of K shifted slices, conv_b; w_out_t, b_out.
- attention: w_q_t, w_k_t, w_v_t, w_o_t; q_g / k_g; explicit softmax with an additive finfo.min mask; RoPE cos/sin
  computed on the fly.
- FFN: w1_t, w3_t, w2_t.

Variants (CLEAN, each a correct port):
- lfm2_unfold_conv_flipped: in_proj kept fused (H, 3H) transposed and chunked [B | C | x]; the conv kernel stored
  time-reversed as (K, C) (tap 0 = current token) and applied by unfold windows.
- lfm2_bcx_interleaved: in_proj rows (and bias) interleaved per channel [B_c, C_c, x_c] (out, in), split by a
  (..., H, 3) view; the gated conv run channels-first (B, C, T) with an nn.Conv1d (weight (C, 1, K),
  padding L - 1, trimmed); out_proj (out, in) with F.linear.
- lfm2_heads_einsum: attention heads as a weight axis (wq (nh, hd, H), wk/wv (nkv, hd, H), wo (H, nh, hd)) with
  einsum; GQA by grouping the query heads (B, nkv, G, T, hd) instead of repeating k/v.
- lfm2_meta_complex_rope: Meta-style q/k row permutation to interleaved pairs (q/k norm gains permuted alike),
  RoPE as complex multiplication with a freqs_cis buffer for all max_position_embeddings positions.
- lfm2_folded_norms: operator_norm gain folded into in_proj / q, k, v input columns, ffn_norm into w1 / w3, the
  final norm into an untied copy of the head (emb * g); attention scale folded into the q-norm gain.
- lfm2_stacked_functional: conv layers' and attention layers' weights stacked per kind ((n_conv, ...),
  (n_att, ...)), FFN and norms (L, ...), in an nn.ParameterDict read by one functional forward; w1 / w3 fused
  into one (H, 2I) matrix.
- lfm2_sdpa_fused_qkv: q/k/v fused [q | k | v] (out, in); F.scaled_dot_product_attention with a boolean mask
  (padding rows keep their diagonal) and enable_gqa; w1 / w3 fused row-interleaved [w1_0, w3_0, w1_1, ...];
  positions from the attention mask (cumsum - 1) when none are given.
- lfm2_recurrent_conv: the short conv run token by token with a rolling (B, C, L) conv state (the generation-cache
  form); per-layer nn.ModuleDict containers ("mixer" / "ffn"); cos/sin tables precomputed as buffers; a backbone
  returning the last normed hidden states and a separate tied-head module holding the embedding.
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
    "lfm2_unfold_conv_flipped",  # fused (H, 3H) in_proj chunked, conv kernel time-reversed (K, C) via unfold
    "lfm2_bcx_interleaved",  # in_proj rows interleaved per channel [B_c, C_c, x_c], channels-first nn.Conv1d
    "lfm2_heads_einsum",  # heads as a weight axis with einsum, GQA by grouping query heads (no repeat)
    "lfm2_meta_complex_rope",  # Meta q/k row permutation (+ norm gains), complex RoPE with a freqs_cis buffer
    "lfm2_folded_norms",  # norm gains folded into the next projections / untied head copy, scale into q-norm
    "lfm2_stacked_functional",  # per-kind stacked (n_layers, ...) ParameterDict, functional forward, fused w1|w3
    "lfm2_sdpa_fused_qkv",  # fused [q|k|v], SDPA + bool mask + enable_gqa, interleaved w1/w3, mask positions
    "lfm2_recurrent_conv",  # token-by-token conv with a rolling state, ModuleDict layers, backbone + head module
]


# ----------------------------------------------------------------------------------------------- helpers
def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def _additive_mask(mask, T, device):
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _bool_mask(mask, T, device):
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if mask is not None:
        allowed = (allowed & mask.bool()[:, None, None, :]) | torch.eye(T, dtype=torch.bool, device=device)
    return allowed


def _ffn_width(c):
    inter = c.intermediate_size
    if c.block_auto_adjust_ff_dim:
        inter = int(2 * inter / 3)
        if c.block_ffn_dim_multiplier is not None:
            inter = int(c.block_ffn_dim_multiplier * inter)
            inter = c.block_multiple_of * ((inter + c.block_multiple_of - 1) // c.block_multiple_of)
    return inter


class _Dims:
    def __init__(self, c):
        self.H, self.nh, self.nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.G = self.nh // self.nkv
        self.K = c.conv_L_cache
        self.eps = c.norm_eps
        self.types = list(c.layer_types)
        self.L = c.num_hidden_layers
        self.I = _ffn_width(c)
        self.theta = c.rope_parameters["rope_theta"]
        self.max_pos = c.max_position_embeddings


def _inv_freq(d):
    return 1.0 / (d.theta ** (torch.arange(0, d.hd, 2, dtype=torch.float) / d.hd))


def _meta_perm(hd):
    idx = []
    for i in range(hd // 2):
        idx += [i, i + hd // 2]
    return torch.tensor(idx)


def _conv_shift_sum(x, w, b):
    """x (B, T, C), w (C, K): out[t] = b + sum_k w[:, k] x[t - K + 1 + k]."""
    K, T = w.shape[1], x.shape[1]
    xp = F.pad(x, (0, 0, K - 1, 0))
    out = sum(xp[:, k : k + T] * w[:, k] for k in range(K))
    return out if b is None else out + b


# ------------------------------------------------------------------------------------------------ modules
class ShortConv(nn.Module):
    def __init__(self, sd, pre, d, variant, fold=None):
        super().__init__()
        self.d, self.variant = d, variant
        W = lambda n: sd[pre + n].float()  # noqa: E731
        win, bin_ = W("in_proj.weight"), W("in_proj.bias") if pre + "in_proj.bias" in sd else None
        if fold is not None:
            win = win * fold
        wout = W("out_proj.weight")
        bout = W("out_proj.bias") if pre + "out_proj.bias" in sd else torch.zeros(d.H)
        conv = W("conv.weight").squeeze(1)  # (C, K)
        cb = W("conv.bias") if pre + "conv.bias" in sd else torch.zeros(d.H)
        bin_ = bin_ if bin_ is not None else torch.zeros(3 * d.H)
        if variant == "lfm2_unfold_conv_flipped":
            self.w_in_t, self.b_in = _p(win.t()), _p(bin_)
            self.kernel_rev = _p(conv.flip(-1).t())  # (K, C), row 0 = current token
            self.conv_b = _p(cb)
            self.w_out_t, self.b_out = _p(wout.t()), _p(bout)
        elif variant == "lfm2_bcx_interleaved":
            self.in_proj_w = _p(win.view(3, d.H, d.H).transpose(0, 1).reshape(3 * d.H, d.H))
            self.in_proj_b = _p(bin_.view(3, d.H).t().reshape(-1))
            self.conv = nn.Conv1d(d.H, d.H, d.K, groups=d.H, padding=d.K - 1, bias=True)
            self.conv.weight = _p(conv[:, None, :])
            self.conv.bias = _p(cb)
            self.out_proj_w, self.out_proj_b = _p(wout), _p(bout)
        else:
            wb, wc, wx = win.chunk(3)
            bb, bc, bx = bin_.chunk(3)
            self.w_b_t, self.w_c_t, self.w_x_t = _p(wb.t()), _p(wc.t()), _p(wx.t())
            self.b_b, self.b_c, self.b_x = _p(bb), _p(bc), _p(bx)
            self.conv_w, self.conv_b = _p(conv), _p(cb)
            self.w_out_t, self.b_out = _p(wout.t()), _p(bout)

    def forward(self, x, mask):
        V = self.variant
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        T = x.shape[1]
        if V == "lfm2_unfold_conv_flipped":
            Bg, Cg, xx = (x @ self.w_in_t + self.b_in).chunk(3, -1)
            u = F.pad((Bg * xx).transpose(1, 2), (self.d.K - 1, 0)).unfold(-1, self.d.K, 1)  # (B, C, T, K)
            conv = torch.einsum("bctk,kc->btc", u.flip(-1), self.kernel_rev) + self.conv_b
            return (Cg * conv) @ self.w_out_t + self.b_out
        if V == "lfm2_bcx_interleaved":
            bcx = F.linear(x, self.in_proj_w, self.in_proj_b).view(*x.shape[:-1], self.d.H, 3)
            Bg, Cg, xx = (t.transpose(1, 2) for t in bcx.unbind(-1))  # (B, C, T)
            y = Cg * self.conv(Bg * xx)[..., :T]
            return F.linear(y.transpose(1, 2), self.out_proj_w, self.out_proj_b)
        Bg, Cg, xx = x @ self.w_b_t + self.b_b, x @ self.w_c_t + self.b_c, x @ self.w_x_t + self.b_x
        bx = Bg * xx
        if V == "lfm2_recurrent_conv":
            state = bx.new_zeros(bx.shape[0], bx.shape[2], self.d.K)  # (B, C, K): last K inputs, oldest first
            outs = []
            for t in range(T):
                state = torch.cat([state[..., 1:], bx[:, t, :, None]], -1)
                outs.append((state * self.conv_w).sum(-1) + self.conv_b)
            conv = torch.stack(outs, 1)
        else:
            conv = _conv_shift_sum(bx, self.conv_w, self.conv_b)
        return (Cg * conv) @ self.w_out_t + self.b_out


class Attention(nn.Module):
    def __init__(self, sd, pre, d, variant, fold=None):
        super().__init__()
        self.d, self.variant = d, variant
        W = lambda n: sd[pre + n].float()  # noqa: E731
        wq, wk, wv, wo = W("q_proj.weight"), W("k_proj.weight"), W("v_proj.weight"), W("out_proj.weight")
        qg, kg = W("q_layernorm.weight"), W("k_layernorm.weight")
        self.scale = d.hd**-0.5
        if variant in ("lfm2_heads_einsum", "lfm2_meta_complex_rope"):
            if variant == "lfm2_meta_complex_rope":
                perm = _meta_perm(d.hd)
                wq, wk = wq.view(d.nh, d.hd, d.H)[:, perm], wk.view(d.nkv, d.hd, d.H)[:, perm]
                qg, kg = qg[perm], kg[perm]
            self.wq, self.wk = _p(wq.reshape(d.nh, d.hd, d.H)), _p(wk.reshape(d.nkv, d.hd, d.H))
            self.wv, self.wo = _p(wv.view(d.nkv, d.hd, d.H)), _p(wo.view(d.H, d.nh, d.hd))
        elif variant == "lfm2_sdpa_fused_qkv":
            self.w_qkv = _p(torch.cat([wq, wk, wv]))
            self.w_o = _p(wo)
        else:
            if fold is not None:
                wq, wk, wv = wq * fold, wk * fold, wv * fold
                qg = qg * self.scale
                self.scale = 1.0
            self.w_q_t, self.w_k_t, self.w_v_t, self.w_o_t = (_p(w.t()) for w in (wq, wk, wv, wo))
        self.q_g, self.k_g = _p(qg), _p(kg)

    def forward(self, x, rope, masks):
        d, V = self.d, self.variant
        B, T, _ = x.shape
        if V in ("lfm2_heads_einsum", "lfm2_meta_complex_rope"):
            q = torch.einsum("bth,ndh->bntd", x, self.wq)
            k = torch.einsum("bth,ndh->bntd", x, self.wk)
            v = torch.einsum("bth,ndh->bntd", x, self.wv)
        elif V == "lfm2_sdpa_fused_qkv":
            q, k, v = F.linear(x, self.w_qkv).split([d.nh * d.hd, d.nkv * d.hd, d.nkv * d.hd], -1)
            q, k, v = (t.view(B, T, -1, d.hd).transpose(1, 2) for t in (q, k, v))
        else:
            q, k, v = ((x @ w).view(B, T, -1, d.hd).transpose(1, 2) for w in (self.w_q_t, self.w_k_t, self.w_v_t))
        q, k = _rms(q, d.eps) * self.q_g, _rms(k, d.eps) * self.k_g
        if V == "lfm2_meta_complex_rope":
            fc = rope[:, None]

            def rot(t):
                tc = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
                return torch.view_as_real(tc * fc).flatten(-2)

            q, k = rot(q), rot(k)
        else:
            cos, sin = rope
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if V == "lfm2_sdpa_fused_qkv":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks["bool"], enable_gqa=True)
            return F.linear(o.transpose(1, 2).reshape(B, T, -1), self.w_o)
        if V in ("lfm2_heads_einsum", "lfm2_meta_complex_rope"):
            qg = q.view(B, d.nkv, d.G, T, d.hd)
            s = torch.einsum("bkgtd,bksd->bkgts", qg, k) * self.scale + masks["add"][:, :, None]
            o = torch.einsum("bkgts,bksd->bkgtd", s.softmax(-1), v).reshape(B, d.nh, T, d.hd)
            return torch.einsum("bntd,hnd->bth", o, self.wo)
        k, v = k.repeat_interleave(d.G, 1), v.repeat_interleave(d.G, 1)
        s = (q @ k.transpose(-1, -2)) * self.scale + masks["add"]
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
        return o @ self.w_o_t


class FFN(nn.Module):
    def __init__(self, sd, pre, d, variant, fold=None):
        super().__init__()
        self.variant = variant
        w1, w3, w2 = (sd[pre + f"feed_forward.{n}.weight"].float() for n in ("w1", "w3", "w2"))
        if fold is not None:
            w1, w3 = w1 * fold, w3 * fold
        if variant == "lfm2_sdpa_fused_qkv":
            self.w13_il = _p(torch.stack([w1, w3], 1).reshape(-1, d.H))
            self.w2 = _p(w2)
        else:
            self.w1_t, self.w3_t, self.w2_t = _p(w1.t()), _p(w3.t()), _p(w2.t())

    def forward(self, x):
        if self.variant == "lfm2_sdpa_fused_qkv":
            y = F.linear(x, self.w13_il).view(*x.shape[:-1], -1, 2)
            return F.linear(F.silu(y[..., 0]) * y[..., 1], self.w2)
        return (F.silu(x @ self.w1_t) * (x @ self.w3_t)) @ self.w2_t


class Block(nn.Module):
    def __init__(self, sd, i, d, variant):
        super().__init__()
        pre = f"model.layers.{i}."
        self.kind, self.d, self.variant = d.types[i], d, variant
        g_op, g_ffn = sd[pre + "operator_norm.weight"].float(), sd[pre + "ffn_norm.weight"].float()
        folded = variant == "lfm2_folded_norms"
        if self.kind == "conv":
            mixer = ShortConv(sd, pre + "conv.", d, variant, fold=g_op if folded else None)
        else:
            mixer = Attention(sd, pre + "self_attn.", d, variant, fold=g_op if folded else None)
        ffn = FFN(sd, pre, d, variant, fold=g_ffn if folded else None)
        if variant == "lfm2_recurrent_conv":
            self.layer = nn.ModuleDict({"mixer": mixer, "ffn": ffn})
        else:
            self.mixer, self.ffn = mixer, ffn
        if not folded:
            self.op_g, self.ffn_g = _p(g_op), _p(g_ffn)

    def forward(self, h, rope, masks, mask):
        mixer = self.layer["mixer"] if self.variant == "lfm2_recurrent_conv" else self.mixer
        ffn = self.layer["ffn"] if self.variant == "lfm2_recurrent_conv" else self.ffn
        folded = self.variant == "lfm2_folded_norms"
        x = _rms(h, self.d.eps) if folded else _rms(h, self.d.eps) * self.op_g
        h = h + (mixer(x, mask) if self.kind == "conv" else mixer(x, rope, masks))
        x = _rms(h, self.d.eps) if folded else _rms(h, self.d.eps) * self.ffn_g
        return h + ffn(x)


class Lfm2Port(nn.Module):
    def __init__(self, sd, config, variant):
        super().__init__()
        d = self.d = _Dims(config)
        self.variant = variant
        self.emb = _p(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([Block(sd, i, d, variant) for i in range(d.L)])
        gf = sd["model.embedding_norm.weight"].float()
        if variant == "lfm2_folded_norms":
            self.head_folded = _p(sd["model.embed_tokens.weight"].float() * gf)
        else:
            self.final_g = _p(gf)
        inv = _inv_freq(d)
        self.register_buffer("inv_freq", inv, persistent=False)
        ang = torch.arange(d.max_pos, dtype=torch.float)[:, None] * inv
        if variant == "lfm2_meta_complex_rope":
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)
        elif variant == "lfm2_recurrent_conv":
            emb = torch.cat([ang, ang], -1)
            self.register_buffer("cos_cached", emb.cos(), persistent=False)
            self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def _positions(self, ids, attention_mask, position_ids):
        B, T = ids.shape
        if position_ids is not None:
            return position_ids
        if self.variant == "lfm2_sdpa_fused_qkv" and attention_mask is not None:
            return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return torch.arange(T, device=ids.device)[None].expand(B, T)

    def _rope(self, pos):
        if self.variant == "lfm2_meta_complex_rope":
            return self.freqs_cis[pos]
        if self.variant == "lfm2_recurrent_conv":
            return self.cos_cached[pos][:, None], self.sin_cached[pos][:, None]
        ang = pos[..., None].float() * self.inv_freq
        emb = torch.cat([ang, ang], -1)
        return emb.cos()[:, None], emb.sin()[:, None]

    def hidden(self, input_ids, attention_mask=None, position_ids=None):
        T = input_ids.shape[1]
        rope = self._rope(self._positions(input_ids, attention_mask, position_ids))
        masks = {
            "add": _additive_mask(attention_mask, T, input_ids.device),
            "bool": _bool_mask(attention_mask, T, input_ids.device),
        }
        h = F.embedding(input_ids, self.emb)
        for blk in self.blocks:
            h = blk(h, rope, masks, attention_mask)
        h = _rms(h, self.d.eps)
        return h if self.variant == "lfm2_folded_norms" else h * self.final_g

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.hidden(input_ids, attention_mask, position_ids)
        w = self.head_folded if self.variant == "lfm2_folded_norms" else self.emb
        return F.linear(h, w).float()


class TiedHead(nn.Module):
    """the LM head of lfm2_recurrent_conv: holds (a reference to) the embedding parameter itself."""

    def __init__(self, embedding):
        super().__init__()
        self.weight = embedding

    def forward(self, h):
        return h @ self.weight.t()


class Lfm2WithHead(nn.Module):
    def __init__(self, sd, config, variant):
        super().__init__()
        self.backbone = Lfm2Port(sd, config, variant)
        self.head = TiedHead(self.backbone.emb)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.backbone.hidden(input_ids, attention_mask, position_ids)).float()


# --------------------------------------------------------------------------- stacked functional variant
def _stack(sd, d):
    conv = [i for i, t in enumerate(d.types) if t == "conv"]
    att = [i for i, t in enumerate(d.types) if t != "conv"]
    L = lambda i, n: sd[f"model.layers.{i}.{n}"].float()  # noqa: E731
    W = {
        "emb": sd["model.embed_tokens.weight"].float(),
        "final_g": sd["model.embedding_norm.weight"].float(),
        "op_g": torch.stack([L(i, "operator_norm.weight") for i in range(d.L)]),
        "ffn_g": torch.stack([L(i, "ffn_norm.weight") for i in range(d.L)]),
        "w13_t": torch.stack(
            [torch.cat([L(i, "feed_forward.w1.weight"), L(i, "feed_forward.w3.weight")]).t() for i in range(d.L)]
        ),
        "w2_t": torch.stack([L(i, "feed_forward.w2.weight").t() for i in range(d.L)]),
    }
    if conv:
        zero = lambda n: torch.zeros(n)  # noqa: E731
        get = lambda i, n, size: L(i, n) if f"model.layers.{i}.{n}" in sd else zero(size)  # noqa: E731
        W["cv_in_t"] = torch.stack([L(i, "conv.in_proj.weight").t() for i in conv])
        W["cv_in_b"] = torch.stack([get(i, "conv.in_proj.bias", 3 * d.H) for i in conv])
        W["cv_w"] = torch.stack([L(i, "conv.conv.weight").squeeze(1) for i in conv])
        W["cv_b"] = torch.stack([get(i, "conv.conv.bias", d.H) for i in conv])
        W["cv_out_t"] = torch.stack([L(i, "conv.out_proj.weight").t() for i in conv])
        W["cv_out_b"] = torch.stack([get(i, "conv.out_proj.bias", d.H) for i in conv])
    if att:
        for key, n in (("at_q_t", "q_proj"), ("at_k_t", "k_proj"), ("at_v_t", "v_proj"), ("at_o_t", "out_proj")):
            W[key] = torch.stack([L(i, f"self_attn.{n}.weight").t() for i in att])
        W["at_qg"] = torch.stack([L(i, "self_attn.q_layernorm.weight") for i in att])
        W["at_kg"] = torch.stack([L(i, "self_attn.k_layernorm.weight") for i in att])
    return W


def _functional(W, d, inv_freq, ids, attention_mask, position_ids):
    B, T = ids.shape
    pos = position_ids if position_ids is not None else torch.arange(T, device=ids.device)[None].expand(B, T)
    ang = pos[..., None].float() * inv_freq
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    add = _additive_mask(attention_mask, T, ids.device)
    h = W["emb"][ids]
    ci = ai = 0
    for i, kind in enumerate(d.types):
        x = _rms(h, d.eps) * W["op_g"][i]
        if kind == "conv":
            if attention_mask is not None:
                x = x * attention_mask[..., None].to(x.dtype)
            Bg, Cg, xx = (x @ W["cv_in_t"][ci] + W["cv_in_b"][ci]).chunk(3, -1)
            y = Cg * _conv_shift_sum(Bg * xx, W["cv_w"][ci], W["cv_b"][ci])
            h = h + y @ W["cv_out_t"][ci] + W["cv_out_b"][ci]
            ci += 1
        else:
            q = (x @ W["at_q_t"][ai]).view(B, T, d.nh, d.hd).transpose(1, 2)
            k = (x @ W["at_k_t"][ai]).view(B, T, d.nkv, d.hd).transpose(1, 2)
            v = (x @ W["at_v_t"][ai]).view(B, T, d.nkv, d.hd).transpose(1, 2)
            q, k = _rms(q, d.eps) * W["at_qg"][ai], _rms(k, d.eps) * W["at_kg"][ai]
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = k.repeat_interleave(d.G, 1), v.repeat_interleave(d.G, 1)
            p = ((q @ k.transpose(-1, -2)) / math.sqrt(d.hd) + add).softmax(-1)
            h = h + (p @ v).transpose(1, 2).reshape(B, T, -1) @ W["at_o_t"][ai]
            ai += 1
        x = _rms(h, d.eps) * W["ffn_g"][i]
        a, b = (x @ W["w13_t"][i]).chunk(2, -1)
        h = h + (F.silu(a) * b) @ W["w2_t"][i]
    h = _rms(h, d.eps) * W["final_g"]
    return h @ W["emb"].t()


class Lfm2Functional(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = _Dims(config)
        self.params = nn.ParameterDict({k: _p(v) for k, v in _stack(sd, self.d).items()})
        self.register_buffer("inv_freq", _inv_freq(self.d), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return _functional(
            dict(self.params.items()), self.d, self.inv_freq, input_ids, attention_mask, position_ids
        ).float()


def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN:
        raise ValueError(f"unknown layout variant {variant!r}")
    sd = {k: v.float() for k, v in state_dict.items()}
    if variant == "lfm2_stacked_functional":
        model = Lfm2Functional(sd, config)
    elif variant == "lfm2_recurrent_conv":
        model = Lfm2WithHead(sd, config, variant)
    else:
        model = Lfm2Port(sd, config, variant)
    return model.eval()
