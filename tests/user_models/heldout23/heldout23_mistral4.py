"""Hand-written plain-PyTorch port of Mistral 4 (Mistral4ForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block:
        h = h + MLA(RMS_in(h));  h = h + FFN(RMS_post(h))
  * attention is DeepSeek-style MLA (multi-head latent attention), num_key_value_heads == num_attention_heads:
        q = W_qb RMS_q(W_qa x)  (latent rank q_lora_rank, latent norm eps 1e-6)  -> per head [q_nope | q_rot];
        [c | k_rot] = W_kva x;  c = RMS_kv(c) (eps 1e-6);  per head [k_nope | v] = W_kvb c;
        k_rot is ONE shared (single-head) rotary key broadcast to all heads;
        scores = [q_nope | q_rot] . [k_nope | k_rot] * softmax_scale;
    * RoPE only on the qk_rope_head_dim part, on INTERLEAVED pairs (config.rope_interleave) of q_rot and k_rot;
    * YaRN rotary frequencies (rope_parameters: factor, original_max_position_embeddings, beta_fast/slow, theta)
      computed over the rope dims only (= head_dim * partial_rotary_factor), cos/sin x attention_factor
      (= mscale(factor, mscale) / mscale(factor, mscale_all_dim), 1 here);
    * softmax_scale = qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2, mscale(s, m) = 0.1 m ln(s) + 1;
    * Llama-4 style position-dependent query scaling after RoPE:
        q *= 1 + llama_4_scaling_beta * ln(1 + floor(pos / original_max_position_embeddings));
  * FFN: dense SwiGLU (intermediate_size) for i < first_k_dense_replace, else the MoE:
      p = softmax(router(x)) over n_routed_experts; group-limited choice: the experts are split into n_group groups,
      group score = sum of the group's two largest p, only the topk_group best groups are eligible; top-k on p within
      them; weights = p of the chosen, renormalised (norm_topk_prob, + 1e-20), x routed_scaling_factor;
      routed experts are SwiGLU (moe_intermediate_size); plus a shared SwiGLU of width
      moe_intermediate_size * n_shared_experts on the same input, always added;
  - final RMSNorm, then the head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (F.linear (out, in) layout, own names):
  tok (V, H); lm (V, H); norm_f (H,);
  layers[i].ln_attn / ln_ffn (H,);
  layers[i].attn.w_down (rq + rkv + dr, H): rows [q_a | kv latent | rotary key]  (q_a_proj and kv_a_proj_with_mqa
      fused); q_ln (rq,); kv_ln (rkv,);
      wq_nope (nh * dn, rq); wq_rope (nh * dr, rq);  wk_up (nh, dn, rkv); wv_up (nh, dv, rkv); wo (H, nh * dv);
      * the rotary rows (of wq_rope and of the rotary-key rows of w_down) are permuted at load from HF's interleaved
        pairs to half-split order (channel i <- 2i, i + dr/2 <- 2i + 1) and RoPE is applied with rotate_half;
  dense / shared SwiGLU: w_in (2 I, H) rows [gate | up], w_out (H, I);
  MoE: router (E, H); experts w_in (E, 2 I', H) with rows [up | gate] (HF's halves swapped), w_out (E, H, I').
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "m4_rope_half_split",  # interleaved -> half-split channel permutation forgotten at load; rotate_half on raw pairs
    "m4_rope_dim_full_head",  # YaRN frequencies computed over head_dim (nope + rope = 24) instead of the 8 rope dims
    "m4_yarn_mscale_missing",  # softmax scale left at qk_head_dim**-0.5: YaRN mscale(factor, mscale_all_dim)**2 dropped
    "m4_llama4_scale_missing",  # position-dependent Llama-4 query scaling never applied
    "m4_llama4_scale_no_floor",  # Llama-4 query scale uses ln(1 + pos / orig_max) without the floor
    "m4_kv_b_split_swapped",  # kv_b_proj rows per head split as [v | k_nope] instead of [k_nope | v]
    "m4_q_latent_norm_skipped",  # q_a_layernorm not applied to the query latent
    "m4_group_routing_ignored",  # n_group / topk_group ignored: top-k over all experts
    "m4_router_sigmoid",  # DeepSeek-V3 template: sigmoid router scores instead of softmax
    "m4_topk_not_renormalised",  # norm_topk_prob ignored: chosen softmax probabilities used as-is
    "m4_routed_scaling_missing",  # routed_scaling_factor not applied to the expert weights
    "m4_expert_gate_up_swapped",  # HF gate_up_proj halves copied without reordering into this port's [up | gate]
    "m4_pad_mask_dropped",  # attention_mask ignored: causal only, pad keys visible to the real tokens
]
PADDING_ONLY = {"m4_pad_mask_dropped"}
CLEAN = [
    "mla_absorbed",  # k/v up-projections absorbed: attention computed in the kv latent space
    "scale_folded",  # softmax scale (with the YaRN mscale**2) folded into wq_nope / wq_rope at load
    "rope_complex",  # rotary channels left interleaved at load; RoPE as a complex multiply on adjacent pairs
    "experts_dense",  # every routed expert run on every token, combined with a dense (T, E) weight matrix
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


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _deinterleave(d):
    """index list: new channel i <- old 2i, new i + d/2 <- old 2i + 1"""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))


def _mscale(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


def _yarn(rp, dim):
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
    if rp.get("truncate", True):
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
    """x (B, n, S, d); cos/sin (B, S, d/2). Half-split layout unless rope_complex (interleaved pairs)."""
    cos, sin = cos[:, None], sin[:, None]
    if _bug() == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class MLA(nn.Module):
    def __init__(self, sd, p, cfg, softmax_scale):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh = cfg.num_attention_heads
        if cfg.num_key_value_heads != self.nh:
            raise NotImplementedError("MLA with num_key_value_heads != num_attention_heads")
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rq, self.rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        if self.rq is None:
            raise NotImplementedError("q_lora_rank None")
        dqk = self.dn + self.dr
        permute = b not in ("m4_rope_half_split", "rope_complex")
        perm = _deinterleave(self.dr)
        qa = sd[p + "q_a_proj.weight"].float()
        kva = sd[p + "kv_a_proj_with_mqa.weight"].float()
        kv_lat, k_rope = kva[: self.rkv], kva[self.rkv :]
        if permute:
            k_rope = k_rope[perm]
        self.w_down = _P(torch.cat((qa, kv_lat, k_rope), 0))
        self.q_ln = _P(sd[p + "q_a_layernorm.weight"])
        self.kv_ln = _P(sd[p + "kv_a_layernorm.weight"])
        qb = sd[p + "q_b_proj.weight"].float().view(self.nh, dqk, self.rq)
        wq_nope, wq_rope = qb[:, : self.dn], qb[:, self.dn :]
        if permute:
            wq_rope = wq_rope[:, perm]
        self.scale = softmax_scale
        if b == "scale_folded":
            wq_nope, wq_rope = wq_nope * self.scale, wq_rope * self.scale
            self.scale = 1.0
        self.wq_nope = _P(wq_nope.reshape(-1, self.rq))
        self.wq_rope = _P(wq_rope.reshape(-1, self.rq))
        kvb = sd[p + "kv_b_proj.weight"].float().view(self.nh, self.dn + self.dv, self.rkv)
        if b == "m4_kv_b_split_swapped":
            wv, wk = kvb[:, : self.dv], kvb[:, self.dv :]
        else:
            wk, wv = kvb[:, : self.dn], kvb[:, self.dn :]
        self.wk_up, self.wv_up = _P(wk), _P(wv)
        self.wo = _P(sd[p + "o_proj.weight"])
        if cfg.attention_bias:
            raise NotImplementedError("attention_bias")

    def forward(self, x, allowed, cos, sin, qscale):
        b = _bug()
        B, S, _ = x.shape
        d = F.linear(x, self.w_down)
        ql, c, k_rot = d.split((self.rq, self.rkv, self.dr), -1)
        if b != "m4_q_latent_norm_skipped":
            ql = _rms(ql, self.q_ln, 1e-6)
        c = _rms(c, self.kv_ln, 1e-6)
        q_nope = F.linear(ql, self.wq_nope).view(B, S, self.nh, self.dn).transpose(1, 2)
        q_rot = F.linear(ql, self.wq_rope).view(B, S, self.nh, self.dr).transpose(1, 2)
        q_rot = _rope(q_rot, cos, sin)
        k_rot = _rope(k_rot[:, None], cos, sin)  # (B, 1, S, dr)
        q_nope, q_rot = q_nope * qscale, q_rot * qscale
        s_rot = q_rot @ k_rot.transpose(-1, -2)
        if b == "mla_absorbed":
            q_lat = torch.einsum("bnsd,ndr->bnsr", q_nope, self.wk_up)
            s = (q_lat @ c[:, None].transpose(-1, -2) + s_rot) * self.scale
        else:
            k_nope = torch.einsum("bsr,ndr->bnsd", c, self.wk_up)
            s = (q_nope @ k_nope.transpose(-1, -2) + s_rot) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        a = torch.softmax(s, -1)
        if b == "mla_absorbed":
            ctx = torch.einsum("bnsr,ndr->bnsd", a @ c[:, None], self.wv_up)
        else:
            v = torch.einsum("bsr,ndr->bnsd", c, self.wv_up)
            ctx = a @ v
        out = F.linear(ctx.transpose(1, 2).reshape(B, S, -1), self.wo)
        _rec(self.pre.rstrip("."), out)
        return out


class SwiGLU(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.pre = p
        self.w_in = _P(torch.cat((sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]), 0))
        self.w_out = _P(sd[p + "down_proj.weight"])

    def forward(self, x, rec=True):
        g, u = F.linear(x, self.w_in).chunk(2, -1)
        out = F.linear(F.silu(g) * u, self.w_out)
        if rec:
            _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.E = cfg.n_routed_experts
        self.k = cfg.num_experts_per_tok
        self.G, self.TG = cfg.n_group, cfg.topk_group
        self.norm_topk = cfg.norm_topk_prob
        self.rsf = cfg.routed_scaling_factor
        self.router = _P(sd[p + "gate.weight"])
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H) rows [gate | up]
        I = gu.shape[1] // 2  # noqa: E741
        if b != "m4_expert_gate_up_swapped":
            gu = torch.cat((gu[:, I:], gu[:, :I]), 1)  # -> [up | gate]
        self.w_in = _P(gu)
        self.w_out = _P(sd[p + "experts.down_proj"])  # (E, H, I)
        self.shared = SwiGLU(sd, p + "shared_experts.")

    def _expert(self, x, e):
        u, g = F.linear(x, self.w_in[e]).chunk(2, -1)
        return F.linear(F.silu(g) * u, self.w_out[e])

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = F.linear(t, self.router)
        p = torch.sigmoid(logits) if b == "m4_router_sigmoid" else torch.softmax(logits, -1)
        if b == "m4_group_routing_ignored":
            choice = p
        else:
            gs = p.view(-1, self.G, self.E // self.G).topk(2, -1).values.sum(-1)
            gidx = gs.topk(self.TG, -1).indices
            gmask = torch.zeros_like(gs, dtype=torch.bool).scatter(1, gidx, True)
            emask = gmask[:, :, None].expand(-1, -1, self.E // self.G).reshape(-1, self.E)
            choice = p.masked_fill(~emask, 0.0)
        idx = choice.topk(self.k, -1).indices
        w = p.gather(1, idx)
        if self.norm_topk and b != "m4_topk_not_renormalised":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if b != "m4_routed_scaling_missing":
            w = w * self.rsf
        out = torch.zeros_like(t)
        if b == "experts_dense":
            dense = w.new_zeros(t.shape[0], self.E).scatter(1, idx, w)
            for e in range(self.E):
                out = out + dense[:, e : e + 1] * self._expert(t, e)
        else:
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel():
                    out.index_add_(0, tok, self._expert(t[tok], e) * w[tok, slot, None])
        out = out.view(B, S, H) + self.shared(x)
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i, softmax_scale):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.ln_attn = _P(sd[p + "input_layernorm.weight"])
        self.ln_ffn = _P(sd[p + "post_attention_layernorm.weight"])
        self.attn = MLA(sd, p + "self_attn.", cfg, softmax_scale)
        self.ffn = MoE(sd, p + "mlp.", cfg) if i >= cfg.first_k_dense_replace else SwiGLU(sd, p + "mlp.")

    def forward(self, h, allowed, cos, sin, qscale):
        h = h + self.attn(_rms(h, self.ln_attn, self.eps), allowed, cos, sin, qscale)
        h = h + self.ffn(_rms(h, self.ln_ffn, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class Mistral4Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        self.lm = _P(sd["model.embed_tokens.weight"] if head is None or cfg.tie_word_embeddings else head)
        self.norm_f = _P(sd["model.norm.weight"])
        rp = dict(cfg.rope_parameters or {})
        dr = cfg.qk_rope_head_dim
        dqk = cfg.qk_nope_head_dim + dr
        scale = dqk**-0.5
        self.beta = self.orig = None
        if rp.get("rope_type", "default") == "yarn":
            dim = dqk if b == "m4_rope_dim_full_head" else int(dqk * rp.get("partial_rotary_factor", dr / dqk))
            inv, att = _yarn(rp, dim)
            self.inv_freq, self.att = inv[: dr // 2], att
            if rp.get("mscale_all_dim") and b != "m4_yarn_mscale_missing":
                scale = scale * _mscale(float(rp["factor"]), rp["mscale_all_dim"]) ** 2
            self.orig = rp["original_max_position_embeddings"]
        elif rp.get("rope_type", "default") == "default":
            theta = float(rp["rope_theta"])
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, dr, 2, dtype=torch.float) / dr))
            self.att = 1.0
            self.orig = rp.get("original_max_position_embeddings")
        else:
            raise NotImplementedError(rp["rope_type"])
        self.beta = rp.get("llama_4_scaling_beta")
        self.layers = nn.ModuleList(Layer(sd, cfg, i, scale) for i in range(cfg.num_hidden_layers))

    def _qscale(self, pos):
        b = _bug()
        if self.beta is None or b == "m4_llama4_scale_missing":
            return torch.ones(pos.shape[0], 1, pos.shape[1], 1)
        r = pos.float() / self.orig
        if b != "m4_llama4_scale_no_floor":
            r = torch.floor(r)
        return (1 + self.beta * torch.log(1 + r))[:, None, :, None]

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        allowed = causal if _bug() == "m4_pad_mask_dropped" else causal & keep[:, None, None, :]
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos() * self.att, ang.sin() * self.att
        qscale = self._qscale(pos)
        for layer in self.layers:
            h = layer(h, allowed, cos, sin, qscale)
        h = _rms(h, self.norm_f, self.cfg.rms_norm_eps)
        _rec("model.norm", h)
        logits = F.linear(h, self.lm)
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
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Mistral4Port(state_dict, config).eval()
