"""Hand-written plain-PyTorch port of Phi-3.5-MoE (PhimoeForCausalLM).

Architecture as this port implements it:
  * token embedding (no scaling); untied output head WITH a bias (config.lm_head_bias);
  * every norm is a true LayerNorm (mean-centred, weight AND bias), eps = config.rms_norm_eps
    (the field name says "rms" but the model uses LayerNorm); pre-norm blocks:
        h = h + Attn(LN_1(h));  h = h + MoE(LN_2(h));  logits = head(LN_f(h)) + head_bias
  * attention: GQA (nh query heads share nkv key/value heads, repeat-interleaved), q/k/v/o projections all
    carry biases (config.attention_bias), scores scaled by head_dim**-0.5;
  * mask: causal + sliding window (query q sees key k iff q - W < k <= q, W = config.sliding_window) +
    HF left-padding mask on keys;
  * RoPE, LongRoPE flavour (half-split / NeoX rotation over the full head_dim):
        inv_freq_i = 1 / (short_factor_i * theta ** (2i / hd))        (HF always uses short_factor here)
        cos, sin multiplied by mscale, where mscale = long_mscale if max(position_ids) + 1 >
        original_max_position_embeddings else short_mscale; since both q and k are rotated with the scaled
        cos/sin, the attention logits pick up mscale**2;
  * MoE FFN: router logits s = x @ W_r (no bias), SparseMixer top-2 routing (inference form):
        e1 = argmax s; drop every expert j with (s_e1 - s_j) / max(|s_j|, s_e1) > 2 * jitter_eps;
        w1 = softmax over the surviving logits, taken at e1;
        e2 = argmax of s with e1 removed; drop j (and e1) with (s_e2 - s_j) / max(|s_j|, s_e2) > 2 * jitter_eps;
        w2 = softmax over the survivors, taken at e2;   (jitter_eps = config.router_jitter_noise)
     the two weights are NOT renormalised; expert e: down(silu(gate(x)) * up(x)), no biases.

Weight layout of this port (own names):
  tok_emb (V, H); head_w (H, V), head_b (V,);
  blocks[i].ln1.g / .b, blocks[i].ln2.g / .b, ln_f.g / .b (H,);
  blocks[i].attn.wq (H, nh, hd), bq (nh, hd); wk / wv (H, nkv, hd), bk / bv (nkv, hd);
  blocks[i].attn.wo (nh, hd, H), bo (H,)   (all applied through torch.einsum);
  blocks[i].moe.router (H, E); blocks[i].moe.w_in (E, H, 2I) with [..., :I] = gate, [..., I:] = up;
  blocks[i].moe.w_out (E, I, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "pm_layernorm_as_rmsnorm",  # Mixtral template kept: RMSNorm(x) * g, no mean-centering and the LayerNorm bias ignored
    "pm_lm_head_bias_dropped",  # lm_head built bias-free as in Mixtral; config.lm_head_bias ignored
    "pm_mixtral_routing",  # softmax over all router logits, top-2, renormalised (Mixtral) instead of SparseMixer
    "pm_jitter_eps_not_doubled",  # SparseMixer threshold compares against jitter_eps instead of 2 * jitter_eps
    "pm_top2_keeps_top1",  # second-expert softmax forgets to remove the first expert from the candidate set
    "pm_top2_weights_renormalised",  # the two SparseMixer multipliers divided by their sum (norm_topk_prob habit)
    "pm_gate_up_swapped",  # fused experts.gate_up_proj read as [up; gate]: SiLU applied to the up half
    "pm_mscale_ignored",  # LongRoPE short_mscale never applied to cos/sin
    "pm_mscale_on_q_only",  # mscale applied once (to q only), so the logits get mscale instead of mscale**2
    "pm_rope_long_factor",  # long_factor used for the inverse frequencies although the sequence is short
    "pm_sliding_window_ignored",  # config.sliding_window not applied: plain causal attention
    "pm_window_off_by_one",  # window written q - k <= W: one key more than HF's q - W < k
    "pm_pad_mask_dropped",  # left padding not masked out of the keys (causal/window only)
]
PADDING_ONLY = {"pm_pad_mask_dropped"}
CLEAN = [
    "mscale_folded",  # short_mscale folded into the q/k projections (weights and biases) at load, RoPE left unscaled
    "rope_complex",  # q/k head channels permuted to interleaved pairs at load, RoPE as a complex multiply
    "fused_qkv",  # q, k, v projections fused into one (H, (nh + 2 nkv) hd) matrix and bias, split after the matmul
    "dense_experts",  # every expert run on every token, combined with a dense (T, E) gate matrix (zeros off the top-2)
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


def _pair_perm(hd):
    """channel order putting half-split partners (i, i + hd/2) next to each other"""
    return torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], -1).flatten()


class LN(nn.Module):
    def __init__(self, sd, p, eps):
        super().__init__()
        self.g = _P(sd[p + ".weight"])
        self.b = _P(sd[p + ".bias"])
        self.eps = eps

    def forward(self, x):
        if _bug() == "pm_layernorm_as_rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.g
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + self.eps) * self.g + self.b


def _rotate(x, cos, sin, complex_form):
    """x (B, n, S, hd); cos/sin (B, S, hd/2) already carrying any mscale"""
    cos, sin = cos[:, None], sin[:, None]
    if complex_form:
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, fold):
        super().__init__()
        b = _bug()
        H = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.pre = p

        def proj(name, n):
            w = sd[p + name + ".weight"].float().view(n, self.hd, H).permute(2, 0, 1)  # (H, n, hd)
            bias = sd[p + name + ".bias"].float().view(n, self.hd)
            return w, bias

        wq, bq = proj("q_proj", self.nh)
        wk, bk = proj("k_proj", self.nkv)
        wv, bv = proj("v_proj", self.nkv)
        if b == "rope_complex":
            perm = _pair_perm(self.hd)
            wq, bq, wk, bk = wq[..., perm], bq[..., perm], wk[..., perm], bk[..., perm]
        if fold is not None:
            wq, bq, wk, bk = wq * fold, bq * fold, wk * fold, bk * fold
        self.fused = b == "fused_qkv"
        if self.fused:
            self.wqkv = _P(torch.cat([w.reshape(H, -1) for w in (wq, wk, wv)], 1))
            self.bqkv = _P(torch.cat([t.reshape(-1) for t in (bq, bk, bv)]))
        else:
            self.wq, self.bq, self.wk, self.bk, self.wv, self.bv = (_P(t) for t in (wq, bq, wk, bk, wv, bv))
        o = sd[p + "o_proj.weight"].float()  # (H, nh*hd)
        self.wo = _P(o.t().reshape(self.nh, self.hd, H))
        self.bo = _P(sd[p + "o_proj.bias"])
        self.scale = self.hd**-0.5

    def forward(self, x, allowed, cos, sin, qmul):
        b = _bug()
        B, S, _ = x.shape
        if self.fused:
            qkv = x @ self.wqkv + self.bqkv
            nq, nk = self.nh * self.hd, self.nkv * self.hd
            q = qkv[..., :nq].view(B, S, self.nh, self.hd).transpose(1, 2)
            k = qkv[..., nq : nq + nk].view(B, S, self.nkv, self.hd).transpose(1, 2)
            v = qkv[..., nq + nk :].view(B, S, self.nkv, self.hd).transpose(1, 2)
        else:
            q = torch.einsum("bsh,hnd->bnsd", x, self.wq) + self.bq[:, None]
            k = torch.einsum("bsh,hnd->bnsd", x, self.wk) + self.bk[:, None]
            v = torch.einsum("bsh,hnd->bnsd", x, self.wv) + self.bv[:, None]
        _rec(self.pre + "v_proj", v.transpose(1, 2).reshape(B, S, -1))
        cx = b == "rope_complex"
        if b == "pm_mscale_on_q_only":
            q = _rotate(q, cos * qmul, sin * qmul, cx)
            k = _rotate(k, cos, sin, cx)
        else:
            q = _rotate(q * qmul, cos, sin, cx)
            k = _rotate(k * qmul, cos, sin, cx)
        g = self.nh // self.nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("bnqd,bnkd->bnqk", q, k) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = torch.einsum("bnqk,bnkd->bnqd", torch.softmax(s, -1), v)
        out = torch.einsum("bnsd,ndh->bsh", ctx, self.wo) + self.bo
        _rec(self.pre.rstrip("."), out)
        return out


def sparse_mix(s, eps):
    """SparseMixer top-2 in inference form. s (T, E) router logits -> weights (T, 2), experts (T, 2)"""
    b = _bug()
    thr = eps if b == "pm_jitter_eps_not_doubled" else 2.0 * eps
    neg = torch.finfo(s.dtype).min

    m1, e1 = s.max(-1, keepdim=True)
    keep1 = (m1 - s) / torch.maximum(s.abs(), m1) <= thr
    w1 = torch.softmax(s.masked_fill(~keep1, neg), -1).gather(-1, e1)

    s_rest = s.scatter(-1, e1, neg)
    m2, e2 = s_rest.max(-1, keepdim=True)
    keep2 = (m2 - s) / torch.maximum(s.abs(), m2) <= thr
    base = s if b == "pm_top2_keeps_top1" else s_rest
    w2 = torch.softmax(base.masked_fill(~keep2, neg), -1).gather(-1, e2)

    w = torch.cat((w1, w2), -1)
    if b == "pm_top2_weights_renormalised":
        w = w / w.sum(-1, keepdim=True)
    return w, torch.cat((e1, e2), -1)


class SparseMoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.router = _P(sd[p + "router.weight"].float().t())  # (H, E)
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        inter = gu.shape[1] // 2
        gate, up = gu[:, :inter], gu[:, inter:]
        if _bug() == "pm_gate_up_swapped":
            gate, up = up, gate
        self.w_in = _P(torch.cat((gate, up), 1).transpose(1, 2))  # (E, H, 2I)
        self.w_out = _P(sd[p + "experts.down_proj"].float().transpose(1, 2))  # (E, I, H)
        self.I = inter
        self.E = gu.shape[0]
        self.eps = cfg.router_jitter_noise
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        self.pre = p

    def _expert(self, e, x):
        h = x @ self.w_in[e]
        return (F.silu(h[..., : self.I]) * h[..., self.I :]) @ self.w_out[e]

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t @ self.router
        if b == "pm_mixtral_routing":
            w, idx = torch.softmax(logits, -1).topk(2, -1)
            w = w / w.sum(-1, keepdim=True)
        else:
            w, idx = sparse_mix(logits, self.eps)
        if b == "dense_experts":
            dense = torch.zeros_like(logits).scatter_add(-1, idx, w)  # (T, E)
            outs = torch.stack([self._expert(e, t) for e in range(self.E)], 1)  # (T, E, H)
            out = (dense[..., None] * outs).sum(1)
        else:
            out = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel():
                    out.index_add_(0, tok, self._expert(e, t[tok]) * w[tok, slot, None])
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i, fold):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        eps = cfg.rms_norm_eps
        self.ln1 = LN(sd, p + "input_layernorm", eps)
        self.attn = Attention(sd, p + "self_attn.", cfg, fold)
        self.ln2 = LN(sd, p + "post_attention_layernorm", eps)
        self.moe = SparseMoE(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, cos, sin, qmul):
        h = h + self.attn(self.ln1(h), allowed, cos, sin, qmul)
        h = h + self.moe(self.ln2(h))
        _rec(self.pre.rstrip("."), h)
        return h


class PhiMoEPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        rp = dict(cfg.rope_parameters or {})
        self.rope_type = rp.get("rope_type", "default")
        H = cfg.hidden_size
        hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        expo = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
        theta = float(rp["rope_theta"])
        if self.rope_type == "default":
            ext = torch.ones(hd // 2)
            self.mscales = (1.0, 1.0)
            self.orig_max = None
        elif self.rope_type == "longrope":
            key = "long_factor" if b == "pm_rope_long_factor" else "short_factor"
            ext = torch.tensor(rp[key], dtype=torch.float32)
            self.mscales = (float(rp["short_mscale"]), float(rp["long_mscale"]))
            self.orig_max = int(rp["original_max_position_embeddings"])
        else:
            raise NotImplementedError(self.rope_type)
        self.inv_freq = 1.0 / (ext * theta**expo)
        self.fold = self.mscales[0] if b == "mscale_folded" else None
        self.tok_emb = _P(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList(Block(sd, cfg, i, self.fold) for i in range(cfg.num_hidden_layers))
        self.ln_f = LN(sd, "model.norm", cfg.rms_norm_eps)
        self.head_w = _P(sd["lm_head.weight"].float().t())
        hb = sd.get("lm_head.bias")
        if hb is not None and b != "pm_lm_head_bias_dropped":
            self.head_b = _P(hb)
        else:
            self.head_b = None

    def _mscale(self, position_ids):
        if self.orig_max is None:
            return 1.0
        long = int(position_ids.max()) + 1 > self.orig_max
        return self.mscales[1] if long else self.mscales[0]

    def _mask(self, keep):
        b = _bug()
        S = keep.shape[1]
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        allowed = ki <= qi
        W = self.cfg.sliding_window
        if W is not None and b != "pm_sliding_window_ignored":
            allowed = allowed & ((qi - ki <= W) if b == "pm_window_off_by_one" else (qi - ki < W))
        allowed = allowed[None, None]
        if b != "pm_pad_mask_dropped":
            allowed = allowed & keep[:, None, None, :]
        return allowed

    def _core(self, input_ids, keep, pos, mscale):
        b = _bug()
        allowed = self._mask(keep)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        if b == "pm_mscale_on_q_only":
            qmul = mscale
        elif b == "pm_mscale_ignored":
            qmul = 1.0
        elif self.fold is not None:
            qmul = mscale / self.fold
        else:
            qmul = mscale
        h = self.tok_emb[input_ids]
        _rec("model.embed_tokens", h)
        for blk in self.blocks:
            h = blk(h, allowed, cos, sin, qmul)
        h = self.ln_f(h)
        _rec("model.norm", h)
        logits = h @ self.head_w
        if self.head_b is not None:
            logits = logits + self.head_b
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
        mscale = self._mscale(position_ids)
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.cfg.vocab_size)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos, mscale)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids, mscale).float()


def build(state_dict, config):
    return PhiMoEPort(state_dict, config).eval()
