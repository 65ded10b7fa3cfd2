"""Hand-written plain-PyTorch port of an ERNIE 4.5 dense (Ernie4_5ForCausalLM) causal LM.

Architecture as this port implements it:
  * token embedding tied with the output head: logits = RMS_final(h) @ E^T (no scaling of the embedding);
  * pre-norm blocks with RMSNorm (weight only, gain used as-is):
        h = h + Attn(RMS_in(h));  h = h + MLP(RMS_post(h))
  * every projection carries a bias when config.use_bias (q, k, v, o, gate, up, down);
  * GQA attention with an explicit head_dim (24 here, not hidden/heads), softmax scale head_dim**-0.5;
  * rotary embedding in the INTERLEAVED (GLM / GPT-J) form: channel pairs (2i, 2i+1) of each head are
    rotated by angle pos * theta^(-2i/head_dim), theta = config.rope_parameters["rope_theta"] (5e5 here);
  * SwiGLU MLP silu(gate(x)) * up(x) -> down;
  * positions are 0..S-1 for every row (HF does not skip left pads); padding enters through the key mask,
    masked scores are set to the float32 minimum (never -inf, so no softmax row is all -inf).

Weight layout of this port (own names, not the HF state-dict names):
  emb (V, H) (also the head); units[i].ln1.g / ln2.g (H,);
  units[i].mix.q_w / k_w / v_w / o_w kept as (out, in) matrices (used through F.linear), with q_b / k_b /
  v_b / o_b; units[i].ff.g_w / u_w (I, H), d_w (H, I) with g_b / u_b / d_b; ln_f.g (H,).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "er_rope_half_split",  # Llama template RoPE: rotate_half over (i, i + d/2) on a checkpoint trained with interleaved pairs
    "er_rope_tables_catted",  # pairs rotated interleaved, but cos/sin tables left as cat(freqs, freqs) instead of repeat_interleave(freqs, 2)
    "er_rope_theta_template_default",  # rope_theta hard-coded to the Llama-2 template's 10000 instead of the config's 5e5
    "er_rope_dim_from_hidden",  # inverse frequencies theta^(-2i/d) built with d = hidden_size // heads (16) instead of config.head_dim (24)
    "er_llama_conversion_permute",  # loader runs the Llama checkpoint-conversion permute on q/k rows (and biases) but keeps interleaved RoPE
    "er_qkv_bias_only",  # Qwen2 template: biases loaded for q/k/v only; o_proj and MLP biases (use_bias covers all) dropped
    "er_gate_bias_after_act",  # gate_proj bias added after the SiLU instead of inside it: silu(W x) + b
    "er_embed_scaled_sqrt_hidden",  # Gemma template: embeddings multiplied by sqrt(hidden_size) before the first block
    "er_norm_gain_plus_one",  # Gemma template RMSNorm: scales by (1 + weight) on a checkpoint storing the gain itself
    "er_residual_from_normed",  # residual branch taken from the normalised input: h = n + Attn(n) with n = RMS(h)
    "er_causal_dropped_with_mask",  # causal triangle only built when attention_mask is None; a passed mask becomes a pure key-padding mask
    "er_inf_masks_nan_pad_rows",  # causal and padding masks built with -inf: all-masked pad query rows give NaN, which leaks through V next layer
]
PADDING_ONLY = {"er_inf_masks_nan_pad_rows"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask; NaN rows of pad queries zeroed
    "rope_halfsplit_permuted",  # q/k rows and biases permuted at load so pairs (2i, 2i+1) become (i, i + d/2); rotate_half RoPE
    "rope_complex",  # RoPE as a complex multiply: channel pairs viewed as complex numbers times e^{i angle}
    "bias_augmented_input",  # biases folded into the matrices as an extra input row; inputs get a constant-1 channel
    "varlen_unpad",  # each row's real tokens run alone (positions from 0; RoPE is relative), scattered back
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _pairs_to_halves(n_heads, hd):
    """row order that moves interleaved pair (2i, 2i+1) of each head to (i, i + hd/2)"""
    idx = []
    for h in range(n_heads):
        base = h * hd
        idx += [base + 2 * i for i in range(hd // 2)] + [base + 2 * i + 1 for i in range(hd // 2)]
    return torch.tensor(idx)


class Affine(nn.Module):
    """y = x W^T + b with W stored (out, in); bias_augmented_input stores [W | b] and appends a 1 to x"""

    def __init__(self, w, b, tag):
        super().__init__()
        if b is None:
            b = torch.zeros(w.shape[0])
        self.aug = _bug() == "bias_augmented_input"
        if self.aug:
            setattr(self, tag + "_wb", _P(torch.cat((w, b[:, None]), 1)))
        else:
            setattr(self, tag + "_w", _P(w))
            setattr(self, tag + "_b", _P(b))
        self.tag = tag

    def forward(self, x):
        if self.aug:
            x1 = torch.cat((x, torch.ones_like(x[..., :1])), -1)
            return F.linear(x1, getattr(self, self.tag + "_wb"))
        return F.linear(x, getattr(self, self.tag + "_w"), getattr(self, self.tag + "_b"))


class RMSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.g = _P(w)
        self.eps = eps

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if _bug() == "er_norm_gain_plus_one":
            return y * (1.0 + self.g)
        return y * self.g


class PairRotary(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        b = _bug()
        hd = cfg.head_dim
        theta = 10000.0 if b == "er_rope_theta_template_default" else float(cfg.rope_parameters["rope_theta"])
        if cfg.rope_parameters.get("rope_type", "default") != "default":
            raise NotImplementedError(cfg.rope_parameters["rope_type"])
        d = cfg.hidden_size // cfg.num_attention_heads if b == "er_rope_dim_from_hidden" else hd
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / d)), persistent=False
        )

    def forward(self, pos):
        """returns (angles (B, S, hd/2), cos, sin) with cos/sin laid out for the rotation in use"""
        b = _bug()
        ang = pos[..., None].float() * self.inv_freq
        _rec("model.rotary_emb", torch.cat((ang, ang), -1).cos())  # HF's table layout, for comparison
        if b in ("er_rope_half_split", "er_rope_tables_catted", "rope_halfsplit_permuted"):
            full = torch.cat((ang, ang), -1)
        else:
            full = ang.repeat_interleave(2, -1)
        return ang, full.cos(), full.sin()


def _rotate(x, ang, cos, sin):
    """x (B, heads, S, hd)"""
    b = _bug()
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        e = torch.polar(torch.ones_like(ang), ang)[:, None]
        return torch.view_as_real(z * e).flatten(-2)
    cos, sin = cos[:, None], sin[:, None]
    if b in ("er_rope_half_split", "rope_halfsplit_permuted"):
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    else:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return x * cos + rot * sin


class Mixer(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        b = _bug()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.pre = pre

        def wb(n, keep_bias=True):
            return sd[pre + n + ".weight"], (sd.get(pre + n + ".bias") if keep_bias else None)

        qw, qb = wb("q_proj")
        kw, kb = wb("k_proj")
        if b in ("rope_halfsplit_permuted", "er_llama_conversion_permute"):
            pq, pk = _pairs_to_halves(self.nh, self.hd), _pairs_to_halves(self.nkv, self.hd)
            qw, kw = qw[pq], kw[pk]
            qb = qb[pq] if qb is not None else None
            kb = kb[pk] if kb is not None else None
        self.q = Affine(qw, qb, "q")
        self.k = Affine(kw, kb, "k")
        self.v = Affine(*wb("v_proj"), "v")
        self.o = Affine(*wb("o_proj", keep_bias=b != "er_qkv_bias_only"), "o")
        self.scale = self.hd**-0.5

    def forward(self, x, allowed, ang, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if b not in ("rope_halfsplit_permuted", "er_llama_conversion_permute"):
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rotate(q, ang, cos, sin), _rotate(k, ang, cos, sin)
        g = self.nh // self.nkv
        k = k[:, :, None].expand(B, self.nkv, g, S, self.hd).reshape(B, self.nh, S, self.hd)
        v = v[:, :, None].expand(B, self.nkv, g, S, self.hd).reshape(B, self.nh, S, self.hd)
        if b == "sdpa":
            ctx = torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale))
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            if b == "er_inf_masks_nan_pad_rows":
                s = s + allowed  # here `allowed` is an additive (-inf / 0) mask
            else:
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, self.nh * self.hd)
        out = self.o(ctx)
        _rec(self.pre + "o_proj", out)
        _rec(self.pre.rstrip("."), out)
        return out


class FeedForward(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        b = _bug()
        keep = b != "er_qkv_bias_only"
        gb = sd.get(pre + "gate_proj.bias") if keep else None
        self.late_gate_bias = None
        if b == "er_gate_bias_after_act" and gb is not None:
            self.late_gate_bias = _P(gb)
            gb = None
        self.gate = Affine(sd[pre + "gate_proj.weight"], gb, "g")
        self.up = Affine(sd[pre + "up_proj.weight"], sd.get(pre + "up_proj.bias") if keep else None, "u")
        self.down = Affine(sd[pre + "down_proj.weight"], sd.get(pre + "down_proj.bias") if keep else None, "d")
        self.pre = pre

    def forward(self, x):
        g, u = self.gate(x), self.up(x)
        if self.late_gate_bias is None:
            _rec(self.pre + "gate_proj", g)
            a = F.silu(g)
        else:
            a = F.silu(g) + self.late_gate_bias
        _rec(self.pre + "up_proj", u)
        y = self.down(a * u)
        _rec(self.pre + "down_proj", y)
        _rec(self.pre.rstrip("."), y)
        return y


class Unit(nn.Module):
    def __init__(self, sd, cfg, idx):
        super().__init__()
        pre = f"model.layers.{idx}."
        self.ln1 = RMSNorm(sd[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.mix = Mixer(sd, pre + "self_attn.", cfg)
        self.ln2 = RMSNorm(sd[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.ff = FeedForward(sd, pre + "mlp.", cfg)
        self.pre = pre

    def forward(self, h, allowed, ang, cos, sin):
        from_normed = _bug() == "er_residual_from_normed"
        n = self.ln1(h)
        _rec(self.pre + "input_layernorm", n)
        h = (n if from_normed else h) + self.mix(n, allowed, ang, cos, sin)
        n = self.ln2(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = (n if from_normed else h) + self.ff(n)
        _rec(self.pre.rstrip("."), h)
        return h


class Ernie45Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.emb = _P(sd["model.embed_tokens.weight"])
        if not cfg.tie_word_embeddings:
            self.head = _P(sd["lm_head.weight"])
        self.rotary = PairRotary(cfg)
        self.units = nn.ModuleList(Unit(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(sd["model.norm.weight"], cfg.rms_norm_eps)

    def _mask(self, keep, given):
        b = _bug()
        S = keep.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        if b == "er_inf_masks_nan_pad_rows":
            ninf = float("-inf")
            c = torch.zeros(S, S).masked_fill(~causal, ninf)
            p = torch.zeros(keep.shape).masked_fill(~keep, ninf)
            return c[None, None] + p[:, None, None, :]
        if b == "er_causal_dropped_with_mask" and given:
            return keep[:, None, None, :].expand(-1, 1, S, S)
        return causal[None, None] & keep[:, None, None, :]

    def _core(self, input_ids, keep, pos, given=True):
        allowed = self._mask(keep, given)
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        if _bug() == "er_embed_scaled_sqrt_hidden":
            h = h * self.cfg.hidden_size**0.5
        ang, cos, sin = self.rotary(pos)
        for u in self.units:
            h = u(h, allowed, ang, cos, sin)
        h = self.ln_f(h)
        _rec("model.norm", h)
        w = self.emb if self.cfg.tie_word_embeddings else self.head
        logits = h @ w.t()
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        given = attention_mask is not None
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None]
        position_ids = position_ids.expand(B, S)
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.emb.shape[0] if self.cfg.tie_word_embeddings else self.head.shape[0])
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                n = ids.shape[1]
                logits[r, keep[r]] = self._core(ids, torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None])[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids, given).float()


def build(state_dict, config):
    return Ernie45Port(state_dict, config).eval()
