"""Hand-written plain-PyTorch port of Arcee / AFM (ArceeForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding (no scaling), untied output head (config.tie_word_embeddings = False here);
  * pre-norm blocks with plain RMSNorm  y = w * x / sqrt(mean(x^2) + eps):
        h = h + Attn(RMS_attn(h));  h = h + MLP(RMS_mlp(h))
  * attention: GQA (kv head j serves query heads j*g .. j*g+g-1), head_dim = hidden / heads, no biases,
    causal + key-padding mask, softmax in float32;
  * RoPE in the half-split (rotate_half / NeoX) form, with * YaRN scaling from config.rope_parameters:
        base inverse frequencies f_i = theta^(-2i/d);
        correction range [lo, hi] from the dims where beta_fast / beta_slow rotations fit into
        original_max_position_embeddings (lo floored, hi ceiled, clamped to [0, d-1]);
        ramp r_i = clamp((i - lo) / (hi - lo), 0, 1);  f'_i = f_i / s * r_i + f_i * (1 - r_i)  (s = factor);
        attention temperature m = attention_factor or 0.1 * ln(s) + 1, applied to cos AND sin in HF, i.e. the
        scores pick up m^2 -- this port multiplies the softmax scale by m^2 instead of touching cos/sin;
  * * MLP is NOT gated: down( relu(up(x))^2 )  (hidden_act = "relu2"), no biases.

Weight layout of this port (own names, "x @ W" orientation, i.e. everything transposed vs nn.Linear):
  tok_emb (V, H); head (H, V); final_gain (H,);
  blocks[i].attn_gain / mlp_gain (H,);
  blocks[i].wqkv (H, (nh + 2*nkv) * hd) fused, columns [q heads | k heads | v heads];
  blocks[i].wo (nh*hd, H); blocks[i].w_up (H, I); blocks[i].w_down (I, H).
  RoPE tables inv_freq (hd/2,) and the scalar score multiplier `score_scale` = hd**-0.5 * m^2 live on the model.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "ar_relu_not_squared",  # relu2 read as plain ReLU: down(relu(up(x)))
    "ar_relu2_as_square",  # relu2 written as x**2 without the ReLU: negative pre-activations also contribute
    "ar_yarn_ignored",  # rope_parameters["rope_type"] == "yarn" ignored: plain RoPE with theta, no temperature
    "ar_yarn_mscale_dropped",  # YaRN frequencies right but the attention temperature 0.1*ln(s)+1 never applied
    "ar_yarn_mscale_not_squared",  # temperature multiplied into the softmax scale once instead of m^2 (cos AND sin carry m)
    "ar_yarn_ramp_inverted",  # ramp mixing swapped: high-frequency dims interpolated, low-frequency ones extrapolated
    "ar_yarn_orig_ctx_from_max_pos",  # correction range computed with max_position_embeddings instead of original_max_position_embeddings
    "ar_yarn_no_truncate",  # correction range bounds not floored/ceiled (truncate defaults to True)
    "ar_yarn_factor_multiplies",  # interpolated frequencies written f * s instead of f / s
    "ar_rope_interleaved",  # GPT-J interleaved-pair rotation applied to a half-split (NeoX) checkpoint
    "ar_gqa_kv_tiled",  # kv heads expanded with .repeat (tiling) instead of repeat_interleave: wrong q->kv grouping
    "ar_head_tied_to_embedding",  # tie_word_embeddings assumed: embedding table reused as the head, lm_head.weight ignored
    "ar_pad_mask_on_queries",  # padding mask broadcast over the query axis instead of the key axis: pad keys stay visible
]
PADDING_ONLY = {"ar_pad_mask_on_queries"}
CLEAN = [
    "norm_gain_folded",  # RMSNorm gains folded into the rows of wqkv / w_up / head at load, norms applied gain-free
    "yarn_mscale_folded",  # YaRN temperature m folded into the q and k columns of wqkv at load, softmax scale hd**-0.5
    "rope_complex",  # q/k channels permuted at load to interleaved pairs; RoPE as a complex multiply
    "kv_grouped_einsum",  # no kv repeat: queries reshaped to (B, nkv, g, S, hd) and contracted per kv group
    "varlen_unpad",  # each row's real tokens run alone with their own position_ids, logits scattered back
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _pairs_order(hd):
    """channel order that puts half-split pair (i, i + hd/2) at (2i, 2i+1)"""
    idx = []
    for i in range(hd // 2):
        idx += [i, hd // 2 + i]
    return torch.tensor(idx)


def _yarn(cfg, hd):
    """returns (inv_freq (hd/2,), temperature m)"""
    b = _bug()
    rp = dict(cfg.rope_parameters or {})
    theta = float(rp.get("rope_theta", 10000.0))
    base = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default" or b == "ar_yarn_ignored":
        return base, 1.0
    if kind != "yarn":
        raise NotImplementedError(kind)
    s = float(rp["factor"])
    ctx = rp.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if b == "ar_yarn_orig_ctx_from_max_pos":
        ctx = cfg.max_position_embeddings
    fast = rp.get("beta_fast") or 32.0
    slow = rp.get("beta_slow") or 1.0

    def dim_for(rotations):
        return hd * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for(fast), dim_for(slow)
    if rp.get("truncate", True) and b != "ar_yarn_no_truncate":
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, hd - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    interp = base * s if b == "ar_yarn_factor_multiplies" else base / s
    if b == "ar_yarn_ramp_inverted":
        inv = interp * (1 - ramp) + base * ramp
    else:
        inv = interp * ramp + base * (1 - ramp)
    m = rp.get("attention_factor")
    if m is None:
        ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
        g = lambda x, k=1.0: 1.0 if s <= 1 else 0.1 * k * math.log(x) + 1.0
        m = g(s, ms) / g(s, msa) if (ms and msa) else g(s)
    return inv, float(m)


def _rope(x, ang):
    """x (B, heads, S, hd); ang (B, S, hd/2)"""
    b = _bug()
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    if b == "ar_rope_interleaved":
        c, s_ = ang.cos()[:, None], ang.sin()[:, None]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s_, x0 * s_ + x1 * c), -1).flatten(-2)
    emb = torch.cat((ang, ang), -1)[:, None]
    h = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * emb.sin()


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Block(nn.Module):
    def __init__(self, sd, cfg, i, m):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.eps = cfg.rms_norm_eps
        q = sd[p + "self_attn.q_proj.weight"].float()
        k = sd[p + "self_attn.k_proj.weight"].float()
        v = sd[p + "self_attn.v_proj.weight"].float()
        if b == "rope_complex":
            oq = torch.cat([h * self.hd + _pairs_order(self.hd) for h in range(self.nh)])
            ok = torch.cat([h * self.hd + _pairs_order(self.hd) for h in range(self.nkv)])
            q, k = q[oq], k[ok]
        if b == "yarn_mscale_folded":
            q, k = q * m, k * m
        wqkv = torch.cat((q, k, v), 0).t()
        w_up = sd[p + "mlp.up_proj.weight"].float().t()
        g_attn = sd[p + "input_layernorm.weight"].float()
        g_mlp = sd[p + "post_attention_layernorm.weight"].float()
        self.folded = b == "norm_gain_folded"
        if self.folded:
            wqkv, w_up = g_attn[:, None] * wqkv, g_mlp[:, None] * w_up
        self.attn_gain, self.mlp_gain = _P(g_attn), _P(g_mlp)
        self.wqkv = _P(wqkv)
        self.wo = _P(sd[p + "self_attn.o_proj.weight"].float().t())
        self.w_up = _P(w_up)
        self.w_down = _P(sd[p + "mlp.down_proj.weight"].float().t())
        if cfg.hidden_act != "relu2":
            raise NotImplementedError(cfg.hidden_act)

    def attn(self, x, allowed, ang, scale):
        b = _bug()
        B, S, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        qkv = x @ self.wqkv
        q = qkv[..., :nq].view(B, S, self.nh, self.hd).transpose(1, 2)
        k = qkv[..., nq : nq + nk].view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = qkv[..., nq + nk :].view(B, S, self.nkv, self.hd).transpose(1, 2)
        _rec(self.pre + "self_attn.v_proj", v.transpose(1, 2).reshape(B, S, -1))
        q, k = _rope(q, ang), _rope(k, ang)
        g = self.nh // self.nkv
        fill = torch.finfo(torch.float32).min
        if b == "kv_grouped_einsum":
            qg = q.view(B, self.nkv, g, S, self.hd)
            s = torch.einsum("bjgqd,bjkd->bjgqk", qg, k) * scale
            s = s.masked_fill(~allowed[:, :, None], fill)
            ctx = torch.einsum("bjgqk,bjkd->bjgqd", torch.softmax(s, -1), v).reshape(B, self.nh, S, self.hd)
        else:
            if b == "ar_gqa_kv_tiled":
                k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            else:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, fill)
            ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.wo
        _rec(self.pre + "self_attn", out)
        return out

    def mlp(self, x):
        b = _bug()
        u = x @ self.w_up
        if b == "ar_relu_not_squared":
            a = F.relu(u)
        elif b == "ar_relu2_as_square":
            a = u * u
        else:
            a = F.relu(u).square()
        out = a @ self.w_down
        _rec(self.pre + "mlp", out)
        return out

    def forward(self, h, allowed, ang, scale):
        n = _rms(h, self.eps) if self.folded else _rms(h, self.eps) * self.attn_gain
        h = h + self.attn(n, allowed, ang, scale)
        n = _rms(h, self.eps) if self.folded else _rms(h, self.eps) * self.mlp_gain
        h = h + self.mlp(n)
        _rec(self.pre.rstrip("."), h)
        return h


class ArceePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv, m = _yarn(cfg, hd)
        self.inv_freq = inv
        if b in ("yarn_mscale_folded", "ar_yarn_mscale_dropped"):
            self.score_scale = hd**-0.5
        elif b == "ar_yarn_mscale_not_squared":
            self.score_scale = hd**-0.5 * m
        else:
            self.score_scale = hd**-0.5 * m * m
        self.tok_emb = _P(sd["model.embed_tokens.weight"])
        if cfg.tie_word_embeddings or b == "ar_head_tied_to_embedding" or "lm_head.weight" not in sd:
            head = sd["model.embed_tokens.weight"].float().t()
        else:
            head = sd["lm_head.weight"].float().t()
        fg = sd["model.norm.weight"].float()
        self.folded = b == "norm_gain_folded"
        if self.folded:
            head = fg[:, None] * head
        self.final_gain = _P(fg)
        self.head = _P(head)
        self.blocks = nn.ModuleList(Block(sd, cfg, i, m) for i in range(cfg.num_hidden_layers))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if b == "ar_pad_mask_on_queries":
            allowed = causal & keep[:, None, :, None]
        else:
            allowed = causal & keep[:, None, None, :]
        h = self.tok_emb[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        for blk in self.blocks:
            h = blk(h, allowed, ang, self.score_scale)
        eps = self.cfg.rms_norm_eps
        h = _rms(h, eps) if self.folded else _rms(h, eps) * self.final_gain
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
            position_ids = torch.arange(S)[None]
        position_ids = position_ids.expand(B, S)
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.cfg.vocab_size)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return ArceePort(state_dict, config).eval()
