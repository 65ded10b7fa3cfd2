"""Hand-written plain-PyTorch port of Youtu-LLM (YoutuForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; output head TIED to the embedding table (config.tie_word_embeddings);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block (eps = rms_norm_eps):
        h = h + MLA(RMS_in(h));  h = h + SwiGLU(RMS_post(h))
  * attention is DeepSeek-V3 style MLA in a DENSE model (no MoE anywhere), num_key_value_heads == heads:
        q = W_qb RMS_q(W_qa x + b_qa)   (latent rank q_lora_rank; latent norm eps fixed at 1e-6)
            -> per head [q_nope | q_rot]   (q = W_q x when q_lora_rank is None);
        [c | k_rot] = W_kva x + b_kva;  c = RMS_kv(c) (eps 1e-6);  per head [k_nope | v] = W_kvb c (no bias);
        k_rot is ONE shared (single-head) rotary key broadcast to all heads;
      * config.attention_bias puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj (NOT on q_b / kv_b);
      * scores = [q_nope | q_rot] . [k_nope | k_rot] * softmax_scale with
            softmax_scale = qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2   (YaRN; qk_head_dim = dn + dr,
            mscale(s, m) = 0.1 m ln(s) + 1), v_head_dim (20 here) differs from qk_head_dim (24 here);
      * NB config.head_dim is an alias of qk_rope_head_dim (8 here), not the attention head width;
    * RoPE only on the qk_rope_head_dim part, on INTERLEAVED pairs (2i, 2i+1) (config.rope_interleave);
    * YaRN frequencies over the rope dims: extrapolated / interpolated (/ factor) frequencies blended with a linear
      ramp between the (floored / ceiled, "truncate") correction dims of beta_fast / beta_slow w.r.t.
      original_max_position_embeddings; cos/sin x attention_factor = mscale(factor, mscale) / mscale(factor,
      mscale_all_dim);
  - MLP: SwiGLU (silu(gate) * up -> down), width intermediate_size, no biases;
  - final RMSNorm, then the (tied) head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (own names, (in, out) matrices applied as x @ w):
  emb (V, H); head (H, V) (a transposed copy of emb); g_final (H,);
  layers[i].g_attn / g_mlp (H,);
  mla.w_a (H, rq + dr + rkv): q_a_proj and kv_a_proj_with_mqa FUSED, columns [q latent | rotary key | kv latent];
      b_a (rq + dr + rkv,) the matching fused bias; q_g (rq,); kv_g (rkv,);
      w_qb (rq, nh, dn + dr) per head [nope | rope] (rope channels stay interleaved);
      w_kvb (rkv, nh, dv + dn) per head REORDERED to [v | k_nope];
      wo (nh * dv, H); bo (H,);
  mlp.w_in (H, 2 I) columns [up | gate] (HF order swapped); w_out (I, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "yt_scale_v_head_dim",  # softmax scale from v_head_dim (20) instead of qk_head_dim = nope + rope (24)
    "yt_mscale_not_squared",  # YaRN mscale(factor, mscale_all_dim) multiplied into the softmax scale once, not squared
    "yt_yarn_attention_factor_missing",  # cos/sin not multiplied by the YaRN attention_factor (mscale ratio)
    "yt_yarn_not_truncated",  # YaRN correction range used as raw floats (no floor / ceil, rope_parameters truncate)
    "yt_rope_half_split",  # rope_interleave ignored: rotate_half RoPE on (i, i + dr/2) pairs
    "yt_kv_b_split_swapped",  # kv_b_proj rows per head read as [v | k_nope] instead of [k_nope | v]
    "yt_latent_bias_after_norm",  # q_a / kv_a biases added after the latent RMSNorms instead of before
    "yt_o_proj_bias_dropped",  # attention_bias taken to mean only the down-projections: o_proj bias ignored
    "yt_mlp_gelu",  # MLP activation written as tanh-GELU instead of config.hidden_act (silu)
    "yt_mlp_gate_up_swapped",  # gate_proj / up_proj placed into the [up | gate] columns the wrong way round
    "yt_residual_from_normed",  # residual branch taken from the normalised hidden state instead of the raw one
    "yt_final_norm_skipped",  # final model.norm not applied before the tied head
    "yt_pad_mask_dropped",  # attention_mask ignored: causal only, pad keys visible to the real tokens
]
PADDING_ONLY = {"yt_pad_mask_dropped"}
CLEAN = [
    "sdpa_attention",  # queries/keys concatenated [nope | rot], F.scaled_dot_product_attention with a boolean mask
    "mla_absorbed",  # k/v up-projections absorbed: attention computed in the kv latent space
    "scale_folded",  # softmax scale (with the YaRN mscale**2) folded into w_qb at load
    "norm_gain_folded",  # all RMSNorm gains (block, latent, final) folded into the rows of the following weights
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


def _norm(x, g, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if g is None else y * g


def _mscale(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


def _yarn(rp, dim):
    b = _bug()
    base = float(rp["rope_theta"])
    factor = float(rp["factor"])
    orig = rp["original_max_position_embeddings"]
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1
    m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
    att = rp.get("attention_factor")
    if att is None:
        att = _mscale(factor, m) / _mscale(factor, m_all) if (m and m_all) else _mscale(factor)

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True) and b != "yt_yarn_not_truncated":
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, att


def _rope(x, cos, sin):
    """x (B, n, S, dr) with interleaved pairs (2i, 2i+1); cos/sin (B, S, dr/2)"""
    cos, sin = cos[:, None], sin[:, None]
    if _bug() == "yt_rope_half_split":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    xp = x.unflatten(-1, (-1, 2))
    x1, x2 = xp[..., 0], xp[..., 1]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)


class MLA(nn.Module):
    def __init__(self, sd, p, cfg, scale, g_in):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh = cfg.num_attention_heads
        if cfg.num_key_value_heads != self.nh:
            raise NotImplementedError("MLA with num_key_value_heads != num_attention_heads")
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rq, self.rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        fold = b == "norm_gain_folded"
        H = cfg.hidden_size
        bias = cfg.attention_bias

        def _lin(name, n_out):
            w = sd[p + name + ".weight"].float().t()
            bb = sd[p + name + ".bias"].float() if bias else torch.zeros(n_out)
            return w, bb

        kva, kva_b = _lin("kv_a_proj_with_mqa", self.rkv + self.dr)
        lat, k_rope = kva[:, : self.rkv], kva[:, self.rkv :]
        lat_b, k_rope_b = kva_b[: self.rkv], kva_b[self.rkv :]
        if self.rq is not None:
            qa, qa_b = _lin("q_a_proj", self.rq)
            self.q_split = self.rq
            q_g = sd[p + "q_a_layernorm.weight"].float()
            qb = sd[p + "q_b_proj.weight"].float().t()  # (rq, nh * (dn + dr))
        else:
            qa = torch.zeros(H, 0)
            qa_b = torch.zeros(0)
            self.q_split = 0
            q_g = None
            qb = sd[p + "q_proj.weight"].float().t()  # (H, nh * (dn + dr))
        w_a = torch.cat((qa, k_rope, lat), 1)
        if fold:
            w_a = g_in[:, None] * w_a
        self.w_a = _P(w_a)
        self.b_a = _P(torch.cat((qa_b, k_rope_b, lat_b)))
        kv_g = sd[p + "kv_a_layernorm.weight"].float()
        qb = qb.reshape(qb.shape[0], self.nh, self.dn + self.dr)
        if fold:  # the latent gain (or, without a q latent, the block's input gain) scales the rows of w_qb
            qb = (q_g if self.rq is not None else g_in)[:, None, None] * qb
        self.scale = scale
        if b == "scale_folded":
            qb = qb * scale
            self.scale = 1.0
        self.w_qb = _P(qb)
        self.q_g = None if (fold or q_g is None) else _P(q_g)
        kvb = sd[p + "kv_b_proj.weight"].float().view(self.nh, self.dn + self.dv, self.rkv)
        if b == "yt_kv_b_split_swapped":
            wv, wk = kvb[:, : self.dv], kvb[:, self.dv :]
        else:
            wk, wv = kvb[:, : self.dn], kvb[:, self.dn :]
        w_kvb = torch.cat((wv, wk), 1).permute(2, 0, 1)  # (rkv, nh, dv + dn)
        if fold:
            w_kvb = kv_g[:, None, None] * w_kvb
        self.w_kvb = _P(w_kvb)
        self.kv_g = None if fold else _P(kv_g)
        self.wo = _P(sd[p + "o_proj.weight"].float().t())
        bo = sd[p + "o_proj.bias"].float() if bias else torch.zeros(H)
        if b == "yt_o_proj_bias_dropped":
            bo = torch.zeros_like(bo)
        self.bo = _P(bo)

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        if b == "yt_latent_bias_after_norm":
            d = x @ self.w_a
        else:
            d = x @ self.w_a + self.b_a
        ql, k_rot, c = d.split((self.q_split, self.dr, self.rkv), -1)
        if self.q_split:
            ql = _norm(ql, self.q_g, 1e-6)
        else:
            ql = x
        c = _norm(c, self.kv_g, 1e-6)
        if b == "yt_latent_bias_after_norm":
            bq, bk, bc = self.b_a.split((self.q_split, self.dr, self.rkv))
            ql, k_rot, c = (ql + bq if self.q_split else ql), k_rot + bk, c + bc
        q = torch.einsum("bsr,rnd->bnsd", ql, self.w_qb)
        q_nope, q_rot = q[..., : self.dn], q[..., self.dn :]
        q_rot = _rope(q_rot, cos, sin)
        k_rot = _rope(k_rot[:, None], cos, sin)  # (B, 1, S, dr)
        w_v, w_k = self.w_kvb[..., : self.dv], self.w_kvb[..., self.dv :]
        if b == "mla_absorbed":
            q_lat = torch.einsum("bnsd,rnd->bnsr", q_nope, w_k)
            s = (q_lat @ c[:, None].transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx_lat = torch.softmax(s, -1) @ c[:, None]  # (B, nh, S, rkv)
            ctx = torch.einsum("bnsr,rnd->bnsd", ctx_lat, w_v)
        else:
            k_nope = torch.einsum("bsr,rnd->bnsd", c, w_k)
            v = torch.einsum("bsr,rnd->bnsd", c, w_v)
            if b == "sdpa_attention":
                qq = torch.cat((q_nope, q_rot), -1)
                kk = torch.cat((k_nope, k_rot.expand(-1, self.nh, -1, -1)), -1)
                ctx = F.scaled_dot_product_attention(qq, kk, v, attn_mask=allowed, scale=self.scale)
            else:
                s = (q_nope @ k_nope.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scale
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
                ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.wo + self.bo
        _rec(self.pre.rstrip("."), out)
        return out


class MLP(nn.Module):
    def __init__(self, sd, p, cfg, g):
        super().__init__()
        b = _bug()
        self.pre = p
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        gate, up = sd[p + "gate_proj.weight"].float().t(), sd[p + "up_proj.weight"].float().t()
        if b == "yt_mlp_gate_up_swapped":
            gate, up = up, gate
        w_in = torch.cat((up, gate), 1)
        if g is not None:
            w_in = g[:, None] * w_in
        self.w_in = _P(w_in)
        self.w_out = _P(sd[p + "down_proj.weight"].float().t())

    def forward(self, x):
        up, gate = (x @ self.w_in).chunk(2, -1)
        act = F.gelu(gate, approximate="tanh") if _bug() == "yt_mlp_gelu" else F.silu(gate)
        out = (act * up) @ self.w_out
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i, scale):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        fold = _bug() == "norm_gain_folded"
        g_attn = sd[p + "input_layernorm.weight"].float()
        g_mlp = sd[p + "post_attention_layernorm.weight"].float()
        self.g_attn = None if fold else _P(g_attn)
        self.g_mlp = None if fold else _P(g_mlp)
        self.mla = MLA(sd, p + "self_attn.", cfg, scale, g_attn)
        self.mlp = MLP(sd, p + "mlp.", cfg, g_mlp if fold else None)

    def forward(self, h, allowed, cos, sin):
        b = _bug()
        n = _norm(h, self.g_attn, self.eps)
        h = (n if b == "yt_residual_from_normed" else h) + self.mla(n, allowed, cos, sin)
        n = _norm(h, self.g_mlp, self.eps)
        h = (n if b == "yt_residual_from_normed" else h) + self.mlp(n)
        _rec(self.pre.rstrip("."), h)
        return h


class YoutuPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.emb = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        head = head.float().t()
        g_final = sd["model.norm.weight"].float()
        fold = b == "norm_gain_folded"
        if fold:
            head = g_final[:, None] * head
        self.head = _P(head)
        self.g_final = None if fold else _P(g_final)
        rp = cfg.rope_parameters or {}
        dr = cfg.qk_rope_head_dim
        scale = (cfg.qk_nope_head_dim + dr) ** -0.5
        if b == "yt_scale_v_head_dim":
            scale = cfg.v_head_dim**-0.5
        rtype = rp.get("rope_type", "default")
        if rtype == "yarn":
            inv, att = _yarn(rp, dr)
            if rp.get("mscale_all_dim"):
                ms = _mscale(float(rp["factor"]), rp["mscale_all_dim"])
                scale = scale * (ms if b == "yt_mscale_not_squared" else ms * ms)
        elif rtype == "default":
            theta = float(rp["rope_theta"])
            inv, att = 1.0 / (theta ** (torch.arange(0, dr, 2, dtype=torch.float) / dr)), 1.0
        else:
            raise NotImplementedError(rtype)
        if b == "yt_yarn_attention_factor_missing":
            att = 1.0
        self.inv_freq, self.att = inv, float(att)
        self.layers = nn.ModuleList(Layer(sd, cfg, i, scale) for i in range(cfg.num_hidden_layers))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if b != "yt_pad_mask_dropped":
            allowed = allowed & keep[:, None, None, :]
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos() * self.att, ang.sin() * self.att
        for layer in self.layers:
            h = layer(h, allowed, cos, sin)
        if b != "yt_final_norm_skipped":
            h = _norm(h, self.g_final, self.cfg.rms_norm_eps)
        if b != "norm_gain_folded":
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
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.emb.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return YoutuPort(state_dict, config).eval()
