"""Hand-written plain-PyTorch port of LongCat-Flash (LongcatFlashForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head;
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps);
  * each of the config.num_layers decoder layers holds TWO attention + dense-MLP sublayers and ONE shortcut MoE
    (config.num_hidden_layers = 2 * num_layers):
        n0 = RMS_post0(h1) where h1 = h + MLA0(RMS_in0(h));   moe = MoE(n0)
        h2 = h1 + MLP0(n0);  h3 = h2 + MLA1(RMS_in1(h2));    h  = h3 + MLP1(RMS_post1(h3)) + moe
  * attention is DeepSeek-style MLA (multi-head latent attention), all heads, no biases:
        q = W_qb RMS_q(W_qa x)  (q latent rank q_lora_rank, latent norm eps 1e-6)  -> per head [q_nope | q_rot];
        [c | k_rot] = W_kva x;  c = RMS_kv(c) (eps 1e-6);  per head [k_nope | v] = W_kvb c;
        k_rot is one shared (single-head) rotary key broadcast to all heads;
      * LoRA scaling: q_nope and q_rot both x sqrt(hidden / q_lora_rank); c x sqrt(hidden / kv_lora_rank)
        (k_rot NOT scaled);
      scores = [q_nope | q_rot] . [k_nope | k_rot] * qk_head_dim**-0.5 (qk_head_dim = nope + rope dims = 24 here);
    * RoPE on INTERLEAVED pairs of the rope part only (qk_rope_head_dim = 8 here), theta = rope_parameters["rope_theta"];
  - dense MLPs: SwiGLU of width ffn_hidden_size, no biases;
  * MoE: logits over n_routed_experts + zero_expert_num experts (float32), p = softmax over ALL of them;
      top-k chosen on p + e_score_correction_bias; weights = unbiased p of the chosen (NOT renormalised)
      * routed_scaling_factor; routed experts are SwiGLU (width expert_ffn_hidden_size); zero experts
      (indices >= n_routed_experts) are identities: they contribute weight * x;
  - final RMSNorm, then the head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (einsum with head axes, own names):
  tok (V, H); lm_out (V, H) (F.linear layout); final_ln (H,);
  layers[i].subs[j] (j = 0, 1): attn_ln, ffn_ln (H,);
      mla.wq_down (H, rq); mla.q_ln (rq,); mla.wq_up (rq, nh, dqk)  [per head: nope dims then rope dims];
      mla.wkv_down (H, rkv + drope)  [latent columns then the shared rope-key columns]; mla.kv_ln (rkv,);
      mla.wk_up (rkv, nh, dnope); mla.wv_up (rkv, nh, dv); mla.wo (nh, dv, H);
      ffn.w1 / ffn.w3 (I, H), ffn.w2 (H, I)  (F.linear layout: w2(silu(w1 x) * w3 x));
  layers[i].moe: router (E + Z, H); router_bias (E + Z,); w1 / w3 (E, I', H) and w2 (E, H, I') stacked over the
      routed experts only (the unused zero-expert rows of HF's gate_up_proj are dropped); n_zero (int).
  The rotary pairs stay interleaved (channels 2i, 2i+1) throughout.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "lc_q_lora_scale_missing",  # sqrt(hidden / q_lora_rank) never applied to the queries
    "lc_q_lora_scale_nope_only",  # q LoRA scale applied to q_nope only; the rotary query part left unscaled
    "lc_kv_lora_scale_missing",  # sqrt(hidden / kv_lora_rank) never applied to the normed kv latent
    "lc_softmax_scale_config_head_dim",  # scores scaled by config.head_dim**-0.5 (the rope dim, 8) not qk_head_dim (24)
    "lc_rope_half_split",  # rotate_half RoPE on the rope part instead of interleaved pairs
    "lc_kv_up_split_swapped",  # kv_b_proj rows per head split as [v | k_nope] instead of [k_nope | v]
    "lc_zero_experts_dropped",  # zero (identity) experts treated as contributing nothing
    "lc_routed_scaling_missing",  # routed_scaling_factor not applied to the expert weights
    "lc_topk_renormalised",  # DeepSeek-V3 template: chosen weights renormalised to sum 1 before scaling
    "lc_score_bias_ignored",  # e_score_correction_bias not used when choosing the top-k experts
    "lc_shortcut_from_second_sublayer",  # shortcut MoE fed with the second sublayer's post-attention norm output
    "lc_shortcut_added_midway",  # shortcut MoE output added after the first sublayer instead of at the very end
    "lc_pad_mask_dropped",  # attention_mask ignored: causal only, pad keys visible to the real tokens
]
PADDING_ONLY = {"lc_pad_mask_dropped"}
CLEAN = [
    "mla_absorbed",  # k/v up-projections absorbed: attention computed in the kv latent space
    "scales_folded",  # q LoRA scale and softmax scale folded into wq_up, kv LoRA scale folded into kv_ln at load
    "experts_dense",  # every routed expert run on every token, zero experts as a dense identity weight
    "rope_complex",  # interleaved rotary pairs applied as a complex multiply
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


def _rope(x, cos, sin):
    """x (B, n, S, d) with interleaved pairs; cos/sin (B, S, d/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    if b == "lc_rope_half_split":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)


class MLA(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rq, self.rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        dqk = self.dn + self.dr
        self.wq_down = _P(sd[p + "q_a_proj.weight"].float().t())
        self.q_ln = _P(sd[p + "q_a_layernorm.weight"])
        wq_up = sd[p + "q_b_proj.weight"].float().view(self.nh, dqk, self.rq).permute(2, 0, 1)  # (rq, nh, dqk)
        self.wkv_down = _P(sd[p + "kv_a_proj_with_mqa.weight"].float().t())
        kv_ln = sd[p + "kv_a_layernorm.weight"].float()
        kvb = sd[p + "kv_b_proj.weight"].float().view(self.nh, self.dn + self.dv, self.rkv)
        if b == "lc_kv_up_split_swapped":
            v_up, k_up = kvb[:, : self.dv], kvb[:, self.dv :]
        else:
            k_up, v_up = kvb[:, : self.dn], kvb[:, self.dn :]
        self.wk_up = _P(k_up.permute(2, 0, 1))  # (rkv, nh, dn)
        self.wv_up = _P(v_up.permute(2, 0, 1))  # (rkv, nh, dv)
        self.wo = _P(sd[p + "o_proj.weight"].float().t().reshape(self.nh, self.dv, H))
        self.q_scale = (H / self.rq) ** 0.5
        self.kv_scale = (H / self.rkv) ** 0.5
        self.q_scale_rot = self.q_scale
        if b == "lc_q_lora_scale_missing":
            self.q_scale = self.q_scale_rot = 1.0
        if b == "lc_q_lora_scale_nope_only":
            self.q_scale_rot = 1.0
        if b == "lc_kv_lora_scale_missing":
            self.kv_scale = 1.0
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        self.scale = dqk**-0.5
        if b == "lc_softmax_scale_config_head_dim":
            self.scale = cfg.head_dim**-0.5
        if b == "scales_folded":
            wq_up = wq_up * (self.q_scale * self.scale)
            kv_ln = kv_ln * self.kv_scale
            self.q_scale = self.q_scale_rot = self.kv_scale = self.scale = 1.0
        self.wq_up = _P(wq_up)
        self.kv_ln = _P(kv_ln)

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape  # noqa: RUF059
        ql = _rms(x @ self.wq_down, self.q_ln, 1e-6)
        q = torch.einsum("bsr,rnd->bnsd", ql, self.wq_up)
        q_nope, q_rot = q[..., : self.dn] * self.q_scale, q[..., self.dn :] * self.q_scale_rot
        ckv = x @ self.wkv_down
        c, k_rot = ckv[..., : self.rkv], ckv[..., self.rkv :]
        c = _rms(c, self.kv_ln, 1e-6) * self.kv_scale
        q_rot = _rope(q_rot, cos, sin)
        k_rot = _rope(k_rot[:, None], cos, sin)  # (B, 1, S, dr)
        s_rot = q_rot @ k_rot.transpose(-1, -2)
        if b == "mla_absorbed":
            q_lat = torch.einsum("bnsd,rnd->bnsr", q_nope, self.wk_up)
            s = (q_lat @ c[:, None].transpose(-1, -2) + s_rot) * self.scale
        else:
            k_nope = torch.einsum("bsr,rnd->bnsd", c, self.wk_up)
            s = (q_nope @ k_nope.transpose(-1, -2) + s_rot) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        a = torch.softmax(s, -1)
        if b == "mla_absorbed":
            ctx = torch.einsum("bnsr,rnd->bnsd", a @ c[:, None], self.wv_up)
        else:
            v = torch.einsum("bsr,rnd->bnsd", c, self.wv_up)
            ctx = a @ v
        out = torch.einsum("bnsd,ndh->bsh", ctx, self.wo)
        _rec(self.pre.rstrip("."), out)
        return out


class FFN(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.w1 = _P(sd[p + "gate_proj.weight"])
        self.w3 = _P(sd[p + "up_proj.weight"])
        self.w2 = _P(sd[p + "down_proj.weight"])

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class ShortcutMoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.pre = p
        self.E = cfg.n_routed_experts
        self.n_zero = cfg.zero_expert_num or 0
        self.k = cfg.moe_topk
        self.rsf = cfg.routed_scaling_factor
        self.router = _P(sd[p + "router.classifier.weight"])
        self.router_bias = _P(sd[p + "router.e_score_correction_bias"])
        gu = sd[p + "experts.gate_up_proj"].float()[: self.E]  # (E, 2I, H)
        I = gu.shape[1] // 2  # noqa: E741
        self.w1, self.w3 = _P(gu[:, :I]), _P(gu[:, I:])
        self.w2 = _P(sd[p + "experts.down_proj"])  # (E, H, I)

    def _expert(self, x, e):
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        p = torch.softmax(F.linear(t, self.router), -1)
        choice = p if b == "lc_score_bias_ignored" else p + self.router_bias
        idx = torch.topk(choice, self.k, -1).indices
        w = p.gather(1, idx)
        if b == "lc_topk_renormalised":
            w = w / w.sum(-1, keepdim=True)
        if b != "lc_routed_scaling_missing":
            w = w * self.rsf
        if b == "lc_zero_experts_dropped":
            w = w.masked_fill(idx >= self.E, 0.0)
        out = torch.zeros_like(t)
        if b == "experts_dense":
            dense = torch.zeros(t.shape[0], self.E + self.n_zero).scatter(1, idx, w)
            for e in range(self.E):
                out = out + dense[:, e : e + 1] * self._expert(t, e)
            out = out + dense[:, self.E :].sum(-1, keepdim=True) * t
        else:
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel():
                    out.index_add_(0, tok, self._expert(t[tok], e) * w[tok, slot, None])
            zw = (w * (idx >= self.E)).sum(-1, keepdim=True)
            out = out + zw * t
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Sub(nn.Module):
    def __init__(self, sd, p, j, cfg):
        super().__init__()
        self.attn_ln = _P(sd[p + f"input_layernorm.{j}.weight"])
        self.ffn_ln = _P(sd[p + f"post_attention_layernorm.{j}.weight"])
        self.mla = MLA(sd, p + f"self_attn.{j}.", cfg)
        self.ffn = FFN(sd, p + f"mlps.{j}.")


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.subs = nn.ModuleList(Sub(sd, p, j, cfg) for j in (0, 1))
        self.moe = ShortcutMoE(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, cos, sin):
        b = _bug()
        s0, s1 = self.subs
        h = h + s0.mla(_rms(h, s0.attn_ln, self.eps), allowed, cos, sin)
        n0 = _rms(h, s0.ffn_ln, self.eps)
        moe = None
        if b != "lc_shortcut_from_second_sublayer":
            moe = self.moe(n0)
        h = h + s0.ffn(n0)
        if b == "lc_shortcut_added_midway":
            h = h + moe
        h = h + s1.mla(_rms(h, s1.attn_ln, self.eps), allowed, cos, sin)
        n1 = _rms(h, s1.ffn_ln, self.eps)
        if moe is None:
            moe = self.moe(n1)
        h = h + s1.ffn(n1)
        if b != "lc_shortcut_added_midway":
            h = h + moe
        _rec(self.pre.rstrip("."), h)
        return h


class LongcatPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        self.lm_out = _P(sd["model.embed_tokens.weight"] if head is None or cfg.tie_word_embeddings else head)
        self.final_ln = _P(sd["model.norm.weight"])
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_layers))
        d = cfg.qk_rope_head_dim
        theta = float(cfg.rope_parameters["rope_theta"])
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        allowed = causal if _bug() == "lc_pad_mask_dropped" else causal & keep[:, None, None, :]
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for layer in self.layers:
            h = layer(h, allowed, cos, sin)
        h = _rms(h, self.final_ln, self.cfg.rms_norm_eps)
        _rec("model.norm", h)
        logits = F.linear(h, self.lm_out)
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
    return LongcatPort(state_dict, config).eval()
