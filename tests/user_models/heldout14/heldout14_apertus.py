"""Hand-written plain-PyTorch port of an Apertus (ApertusForCausalLM) causal LM.

Architecture as this port implements it:
  * pre-norm decoder: h = h + Attn(RMS_a(h)); h = h + MLP(RMS_f(h)); final RMSNorm; untied lm_head;
    the block's first norm is the checkpoint's `attention_layernorm`, the second `feedforward_layernorm`;
  * attention: GQA, q/k/v projections without bias, per-head RMSNorm on q and k (over head_dim, with
    learned gains) applied BEFORE the rotary embedding, softmax scale head_dim**-0.5, causal + key padding mask;
  * RoPE in the half-split form (pairs (i, i + d/2)) with llama3 frequency scaling: wavelengths shorter than
    orig/high_freq_factor kept, longer than orig/low_freq_factor divided by `factor`, smooth blend between;
  * non-gated MLP: down(xIELU(up(x))) with a learned xIELU per layer:
        a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n)
        xIELU(x) = a_p x^2 + beta x                          for x > 0
                 = a_n (expm1(min(x, eps)) - x) + beta x      for x <= 0
  * positions are 0..S-1 for every row (also with left padding).

Weight layout of this port (own names, not the HF state-dict names):
  embed (V, H); blocks[i].norm_a.gain / norm_f.gain (H,); blocks[i].attn.w_q / w_k / w_v / w_o as (in, out)
  matrices; blocks[i].attn.q_gain / k_gain (head_dim,); blocks[i].mlp.w_up (H, I), w_down (I, H);
  blocks[i].mlp.act.raw_p / raw_n (pre-softplus scalars), beta, eps; final_norm.gain; head (H, V).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "ap_xielu_no_softplus",  # stored alpha_p / alpha_n used directly as the coefficients: the softplus reparametrisation is skipped
    "ap_xielu_alpha_n_without_beta",  # negative-branch coefficient taken as softplus(alpha_n); the + beta offset is forgotten
    "ap_xielu_negative_missing_linear",  # negative branch written ELU-style a_n*expm1(x) + beta*x: the - a_n*x term dropped
    "ap_xielu_alphas_sorted_swap",  # loader zips sorted parameter names (alpha_n, alpha_p) into the (alpha_p, alpha_n) slots
    "ap_qk_norm_after_rope",  # q_norm / k_norm applied after the rotary embedding instead of before it
    "ap_k_norm_from_q_norm",  # loader reads self_attn.q_norm.weight for both the q and the k gains
    "ap_llama3_scaling_ignored",  # rope_type llama3 not handled: plain inverse frequencies, no wavelength-dependent scaling
    "ap_llama3_smooth_inverted",  # llama3 blend factor computed from wavelen/orig instead of orig/wavelen for the medium band
    "ap_rope_theta_template_default",  # rope_theta hard-coded to the Llama-2 template's 10000 instead of the config's 1.2e7
    "ap_norms_swapped",  # attention_layernorm taken for the pre-MLP norm (Llama's post_attention_layernorm slot) and vice versa
    "ap_head_tied_to_embedding",  # small-Llama template ties lm_head to the embedding; Apertus has a separate lm_head
    "ap_padding_mask_on_queries",  # padding mask broadcast over query rows ([:, None, :, None]) instead of key columns
]
PADDING_ONLY = {"ap_padding_mask_on_queries"}
CLEAN = [
    "sdpa_gqa",  # F.scaled_dot_product_attention(enable_gqa=True) with an additive float mask, kv heads not expanded
    "fused_qkv_transposed",  # q|k|v re-packed at load into one (H, q+2kv) matrix, split at run time
    "xielu_folded",  # softplus of alpha_p / alpha_n (+beta) evaluated once at load; activation written with boolean masks
    "rope_complex",  # RoPE as complex multiplication over (i, i + d/2) pairs
    "varlen_unpad",  # each row's real tokens run alone (positions from 0), results scattered back into the padded batch
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _llama3_inv_freq(rp, dim, theta=None):
    b = _bug()
    base = theta if theta is not None else rp["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if b == "ap_llama3_scaling_ignored" or rp.get("rope_type", "default") != "llama3":
        return inv
    factor = rp["factor"]
    lo, hi = rp["low_freq_factor"], rp["high_freq_factor"]
    orig = rp["original_max_position_embeddings"]
    wl = 2 * math.pi / inv
    long_wl, short_wl = orig / lo, orig / hi
    if b == "ap_llama3_smooth_inverted":
        blend = (wl / orig - lo) / (hi - lo)
    else:
        blend = (orig / wl - lo) / (hi - lo)
    mid = (1 - blend) * inv / factor + blend * inv
    out = torch.where(wl > long_wl, inv / factor, inv)
    in_mid = (wl >= short_wl) & (wl <= long_wl)
    return torch.where(in_mid, mid, out)


class RMS(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.gain = _P(w)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.gain, self.eps)


class XIELU(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        b = _bug()
        ap, an = sd[pre + "alpha_p"], sd[pre + "alpha_n"]
        if b == "ap_xielu_alphas_sorted_swap":
            names = sorted(k for k in sd if k.startswith(pre + "alpha_"))
            ap, an = sd[names[0]], sd[names[1]]
        self.raw_p, self.raw_n = _P(ap.reshape(())), _P(an.reshape(()))
        self.beta = float(sd[pre + "beta"]) if pre + "beta" in sd else 0.5
        self.eps = float(sd[pre + "eps"]) if pre + "eps" in sd else -1e-6
        if b == "xielu_folded":
            self.coef_p = _P(F.softplus(self.raw_p))
            self.coef_n = _P(self.beta + F.softplus(self.raw_n))

    def forward(self, x):
        b = _bug()
        beta = self.beta
        if b == "xielu_folded":
            pos = x > 0
            xn = torch.clamp(x, max=self.eps)
            y = beta * x
            y = y + pos * (self.coef_p * x * x)
            y = y + (~pos) * (self.coef_n * (torch.expm1(xn) - x))
            return y
        if b == "ap_xielu_no_softplus":
            a_p, a_n = self.raw_p, self.raw_n
        elif b == "ap_xielu_alpha_n_without_beta":
            a_p, a_n = F.softplus(self.raw_p), F.softplus(self.raw_n)
        else:
            a_p, a_n = F.softplus(self.raw_p), beta + F.softplus(self.raw_n)
        em = torch.expm1(torch.minimum(x, torch.tensor(self.eps)))
        if b == "ap_xielu_negative_missing_linear":
            neg = a_n * em + beta * x
        else:
            neg = (em - x) * a_n + beta * x
        return torch.where(x > 0, a_p * x * x + beta * x, neg)


class PlainMLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.w_up = _P(sd[pre + "up_proj.weight"].t())
        self.w_down = _P(sd[pre + "down_proj.weight"].t())
        self.act = XIELU(sd, pre + "act_fn.")
        self.pre = pre

    def forward(self, x):
        u = x @ self.w_up
        _rec(self.pre + "up_proj", u)
        a = self.act(u)
        _rec(self.pre + "act_fn", a)
        y = a @ self.w_down
        _rec(self.pre + "down_proj", y)
        _rec(self.pre.rstrip("."), y)
        return y


class QKNormAttention(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        b = _bug()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.eps = cfg.rms_norm_eps
        wq, wk, wv = sd[pre + "q_proj.weight"], sd[pre + "k_proj.weight"], sd[pre + "v_proj.weight"]
        if b == "fused_qkv_transposed":
            self.w_qkv = _P(torch.cat((wq, wk, wv), 0).t())
        else:
            self.w_q, self.w_k, self.w_v = _P(wq.t()), _P(wk.t()), _P(wv.t())
        self.w_o = _P(sd[pre + "o_proj.weight"].t())
        self.q_gain = _P(sd[pre + "q_norm.weight"])
        self.k_gain = _P(sd[pre + ("q_norm.weight" if b == "ap_k_norm_from_q_norm" else "k_norm.weight")])
        self.pre = pre

    @staticmethod
    def rope(x, cos, sin):
        cos, sin = cos[:, None], sin[:, None]
        h = x.shape[-1] // 2
        if _bug() == "rope_complex":
            z = torch.complex(x[..., :h], x[..., h:]) * torch.complex(cos[..., :h], sin[..., :h])
            return torch.cat((z.real, z.imag), -1)
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if b == "fused_qkv_transposed":
            q, k, v = (x @ self.w_qkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        else:
            q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v
        _rec(self.pre + "q_proj", q)
        _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, nh, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        if b == "ap_qk_norm_after_rope":
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            q, k = _rms(q, self.q_gain, self.eps), _rms(k, self.k_gain, self.eps)
        else:
            q, k = _rms(q, self.q_gain, self.eps), _rms(k, self.k_gain, self.eps)
            _rec(self.pre + "q_norm", q)
            _rec(self.pre + "k_norm", k)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        g = nh // nkv
        if b == "sdpa_gqa":
            add = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=hd**-0.5, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = (q @ k.transpose(-1, -2)) * hd**-0.5
            s = s.masked_fill(~allowed, torch.finfo(torch.float32).min)
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nh * hd)
        out = ctx @ self.w_o
        _rec(self.pre + "o_proj", out)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, idx):
        super().__init__()
        pre = f"model.layers.{idx}."
        na, nf = pre + "attention_layernorm.weight", pre + "feedforward_layernorm.weight"
        if _bug() == "ap_norms_swapped":
            na, nf = nf, na
        self.norm_a = RMS(sd[na], cfg.rms_norm_eps)
        self.attn = QKNormAttention(sd, pre + "self_attn.", cfg)
        self.norm_f = RMS(sd[nf], cfg.rms_norm_eps)
        self.mlp = PlainMLP(sd, pre + "mlp.")
        self.pre = pre

    def forward(self, h, allowed, cos, sin):
        n = self.norm_a(h)
        _rec(self.pre + "attention_layernorm", n)
        h = h + self.attn(n, allowed, cos, sin)
        n = self.norm_f(h)
        _rec(self.pre + "feedforward_layernorm", n)
        h = h + self.mlp(n)
        _rec(self.pre.rstrip("."), h)
        return h


class ApertusPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        nh = cfg.num_attention_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
        theta = 10000.0 if b == "ap_rope_theta_template_default" else None
        self.register_buffer("inv_freq", _llama3_inv_freq(cfg.rope_parameters, self.hd, theta), persistent=False)
        self.embed = _P(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = RMS(sd["model.norm.weight"], cfg.rms_norm_eps)
        if b == "ap_head_tied_to_embedding":
            self.head = _P(sd["model.embed_tokens.weight"].t())
        else:
            self.head = _P(sd["lm_head.weight"].t())

    def _tables(self, pos):
        ang = pos[..., None].float() * self.inv_freq
        ang = torch.cat((ang, ang), -1)
        return ang.cos(), ang.sin()

    def _mask(self, keep):
        S = keep.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        if _bug() == "ap_padding_mask_on_queries":
            return causal[None, None] & keep[:, None, :, None]
        return causal[None, None] & keep[:, None, None, :]

    def _core(self, input_ids, keep, pos):
        h = self.embed[input_ids]
        _rec("model.embed_tokens", h)
        cos, sin = self._tables(pos)
        _rec("model.rotary_emb", cos)
        allowed = self._mask(keep)
        for blk in self.blocks:
            h = blk(h, allowed, cos, sin)
        h = self.final_norm(h)
        _rec("model.norm", h)
        logits = h @ self.head
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)  # HF Apertus: arange, padding is not skipped
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.head.shape[1])
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                n = ids.shape[1]
                logits[r, keep[r]] = self._core(ids, torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None])[0]
            globals()["REC"] = saved
            _rec("lm_head", logits)
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return ApertusPort(state_dict, config).eval()
