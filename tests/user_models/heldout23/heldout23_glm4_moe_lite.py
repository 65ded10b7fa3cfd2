"""Hand-written plain-PyTorch port of GLM-4-MoE-Lite (Glm4MoeLiteForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block:
        h = h + MLA(RMS_in(h));  h = h + FFN(RMS_post(h))
  * attention is DeepSeek-V3 style MLA (multi-head latent attention), num_key_value_heads == num_attention_heads,
    no biases:
        q = W_qb RMS_q(W_qa x)  (latent rank q_lora_rank, latent norm eps 1e-6)  -> per head [q_nope | q_rot];
        [c | k_rot] = W_kva x;  c = RMS_kv(c) (eps 1e-6);  per head [k_nope | v] = W_kvb c  (v_head_dim may differ
        from qk_nope_head_dim: 20 vs 16 here);
        k_rot is ONE shared (single-head) rotary key broadcast to all heads;
        scores = [q_nope | q_rot] . [k_nope | k_rot] * qk_head_dim**-0.5, qk_head_dim = nope + rope dims (24 here);
      * NB config.head_dim is an alias of qk_rope_head_dim (8 here), it is NOT the attention head width;
    * RoPE on INTERLEAVED pairs (config.rope_interleave) of the rope part only, default (unscaled) frequencies over
      qk_rope_head_dim, theta = rope_parameters["rope_theta"] (1000 here);
  * FFN kind per layer from config.mlp_layer_types ("dense" / "sparse", here [dense, sparse, dense, sparse]):
      dense: SwiGLU of width intermediate_size;
      sparse: s = sigmoid(router(x)) (float32); choice = s + e_score_correction_bias; group-limited selection:
        experts split into n_group groups, group score = sum of the group's two largest choice values, only the
        topk_group best groups eligible, top-k on choice within them; weights = UNBIASED s of the chosen experts,
        renormalised (norm_topk_prob, + 1e-20), x routed_scaling_factor; routed experts SwiGLU (moe_intermediate_size);
        plus a shared SwiGLU of width moe_intermediate_size * n_shared_experts, always added, NOT scaled;
  - final RMSNorm, then the head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (own names, (in, out) matrices applied as x @ w):
  embed (V, H); head (H, V); final_g (H,);
  layers[i].g_in / g_post (H,);
  layers[i].mla.wqa (H, rq); q_g (rq,); wq_up (rq, nh, dr + dn) with per-head columns REORDERED to [rope | nope];
      wkv_a (H, dr + rkv) with columns REORDERED to [rotary key | latent]; kv_g (rkv,);
      wk_up (rkv, nh, dn); wv_up (rkv, nh, dv); wo (nh * dv, H);
      rotary channels stay interleaved (pairs 2i, 2i+1);
  dense / shared SwiGLU: w13 (H, 2 I) columns [gate | up], w2 (I, H);
  MoE: router (H, E); score_bias (E,); w13 (E, H, 2 I') columns [gate | up]; w2 (E, I', H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "gl_scale_config_head_dim",  # softmax scale from config.head_dim (an alias of the rope dim, 8) not qk_head_dim (24)
    "gl_q_split_swapped",  # q_b_proj rows per head kept in HF order but read as [rope | nope]: rotary on the wrong dims
    "gl_kv_a_split_swapped",  # kv_a_proj_with_mqa columns not reordered: latent/rotary-key split taken at the wrong end
    "gl_kv_norm_skipped",  # kv_a_layernorm not applied to the kv latent
    "gl_router_softmax",  # DeepSeek-V2 template: softmax router scores instead of sigmoid
    "gl_score_bias_in_weights",  # mixing weights gathered from the bias-corrected scores instead of the raw sigmoid
    "gl_score_bias_ignored",  # e_score_correction_bias never used (neither for the groups nor for the top-k)
    "gl_group_score_max",  # group score = the group's best expert only, instead of the sum of its top two
    "gl_shared_expert_scaled",  # routed_scaling_factor also applied to the shared-expert output
    "gl_rope_half_split",  # rope_interleave ignored: rotate_half RoPE on (i, i + dr/2) pairs
    "gl_rope_theta_default",  # theta falls back to 10000 instead of rope_parameters["rope_theta"]
    "gl_wo_head_major_mixup",  # o_proj converted with the (dv, nh) column order instead of (nh, dv)
    "gl_mask_on_query_axis",  # padding applied on the query axis of the mask instead of the key axis
]
PADDING_ONLY = {"gl_mask_on_query_axis"}
CLEAN = [
    "sdpa_attention",  # keys/queries concatenated [nope | rot], F.scaled_dot_product_attention with a boolean mask
    "rope_rotate_half",  # rotary channels permuted at load to half-split order; RoPE via rotate_half
    "experts_dense",  # every routed expert run on every token, combined with a dense (T, E) weight matrix
    "latent_gain_folded",  # q/kv latent RMSNorm gains folded into the rows of wq_up / wk_up / wv_up at load
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


def _rope(x, cos, sin):
    """x (B, n, S, d); cos/sin (B, S, d/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b in ("gl_rope_half_split", "rope_rotate_half"):
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
        self.nh = cfg.num_attention_heads
        if cfg.num_key_value_heads != self.nh:
            raise NotImplementedError("MLA with num_key_value_heads != num_attention_heads")
        if cfg.q_lora_rank is None or cfg.attention_bias:
            raise NotImplementedError("q_lora_rank None / attention_bias")
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rq, self.rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        fold = b == "latent_gain_folded"
        perm = torch.cat((torch.arange(0, self.dr, 2), torch.arange(1, self.dr, 2)))
        to_half = b == "rope_rotate_half"

        self.wqa = _P(sd[p + "q_a_proj.weight"].float().t())
        q_g = sd[p + "q_a_layernorm.weight"].float()
        qb = sd[p + "q_b_proj.weight"].float().view(self.nh, self.dn + self.dr, self.rq)
        if b == "gl_q_split_swapped":
            q_rope, q_nope = qb[:, : self.dr], qb[:, self.dr :]
        else:
            q_nope, q_rope = qb[:, : self.dn], qb[:, self.dn :]
        if to_half:
            q_rope = q_rope[:, perm]
        wq_up = torch.cat((q_rope, q_nope), 1).permute(2, 0, 1)  # (rq, nh, dr + dn)
        if fold:
            wq_up = q_g[:, None, None] * wq_up
        self.wq_up = _P(wq_up)
        self.q_g = None if fold else _P(q_g)

        kva = sd[p + "kv_a_proj_with_mqa.weight"].float()  # (rkv + dr, H) rows [latent | rotary key]
        if b == "gl_kv_a_split_swapped":
            k_rope, lat = kva[: self.dr], kva[self.dr :]
        else:
            lat, k_rope = kva[: self.rkv], kva[self.rkv :]
        if to_half:
            k_rope = k_rope[perm]
        self.wkv_a = _P(torch.cat((k_rope, lat), 0).t())  # (H, dr + rkv)
        kv_g = sd[p + "kv_a_layernorm.weight"].float()
        kvb = sd[p + "kv_b_proj.weight"].float().view(self.nh, self.dn + self.dv, self.rkv)
        wk_up = kvb[:, : self.dn].permute(2, 0, 1)  # (rkv, nh, dn)
        wv_up = kvb[:, self.dn :].permute(2, 0, 1)  # (rkv, nh, dv)
        if fold:
            wk_up, wv_up = kv_g[:, None, None] * wk_up, kv_g[:, None, None] * wv_up
        self.wk_up, self.wv_up = _P(wk_up), _P(wv_up)
        self.kv_g = None if fold else _P(kv_g)
        wo = sd[p + "o_proj.weight"].float().t()  # (nh * dv, H)
        if b == "gl_wo_head_major_mixup":
            wo = wo.view(self.nh, self.dv, -1).transpose(0, 1).reshape(wo.shape)
        self.wo = _P(wo)
        self.scale = (self.dn + self.dr) ** -0.5
        if b == "gl_scale_config_head_dim":
            self.scale = cfg.head_dim**-0.5

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        ql = x @ self.wqa
        ql = _norm(ql, self.q_g, 1e-6)
        q = torch.einsum("bsr,rnd->bnsd", ql, self.wq_up)
        q_rot, q_nope = q[..., : self.dr], q[..., self.dr :]
        kva = x @ self.wkv_a
        k_rot, c = kva[..., : self.dr], kva[..., self.dr :]
        if b != "gl_kv_norm_skipped":
            c = _norm(c, self.kv_g, 1e-6)
        k_nope = torch.einsum("bsr,rnd->bnsd", c, self.wk_up)
        v = torch.einsum("bsr,rnd->bnsd", c, self.wv_up)
        q_rot = _rope(q_rot, cos, sin)
        k_rot = _rope(k_rot[:, None], cos, sin).expand(-1, self.nh, -1, -1)
        if b == "sdpa_attention":
            qq = torch.cat((q_nope, q_rot), -1)
            kk = torch.cat((k_nope, k_rot), -1)
            ctx = F.scaled_dot_product_attention(qq, kk, v, attn_mask=allowed, scale=self.scale)
        else:
            s = (q_nope @ k_nope.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.wo
        _rec(self.pre.rstrip("."), out)
        return out


class SwiGLU(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.pre = p
        self.w13 = _P(torch.cat((sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]), 0).t())
        self.w2 = _P(sd[p + "down_proj.weight"].float().t())

    def forward(self, x, rec=True):
        g, u = (x @ self.w13).chunk(2, -1)
        out = (F.silu(g) * u) @ self.w2
        if rec:
            _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.pre = p
        self.E = cfg.n_routed_experts
        self.k = cfg.num_experts_per_tok
        self.G, self.TG = cfg.n_group, cfg.topk_group
        self.norm_topk = cfg.norm_topk_prob
        self.rsf = cfg.routed_scaling_factor
        self.router = _P(sd[p + "gate.weight"].float().t())
        self.score_bias = _P(sd[p + "gate.e_score_correction_bias"])
        self.w13 = _P(sd[p + "experts.gate_up_proj"].float().transpose(1, 2))  # (E, H, 2I) [gate | up]
        self.w2 = _P(sd[p + "experts.down_proj"].float().transpose(1, 2))  # (E, I, H)
        self.shared = SwiGLU(sd, p + "shared_experts.")

    def _expert(self, x, e):
        g, u = (x @ self.w13[e]).chunk(2, -1)
        return (F.silu(g) * u) @ self.w2[e]

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t @ self.router
        s = torch.softmax(logits, -1) if b == "gl_router_softmax" else torch.sigmoid(logits)
        choice = s if b == "gl_score_bias_ignored" else s + self.score_bias
        grouped = choice.view(-1, self.G, self.E // self.G)
        if b == "gl_group_score_max":
            gs = grouped.max(-1).values
        else:
            gs = grouped.topk(2, -1).values.sum(-1)
        gidx = gs.topk(self.TG, -1).indices
        gmask = torch.zeros_like(gs, dtype=torch.bool).scatter(1, gidx, True)
        emask = gmask[:, :, None].expand(-1, -1, self.E // self.G).reshape(-1, self.E)
        idx = choice.masked_fill(~emask, float("-inf")).topk(self.k, -1).indices
        w = (choice if b == "gl_score_bias_in_weights" else s).gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
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
        sh = self.shared(x)
        if b == "gl_shared_expert_scaled":
            sh = sh * self.rsf
        out = out.view(B, S, H) + sh
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.g_in = _P(sd[p + "input_layernorm.weight"])
        self.g_post = _P(sd[p + "post_attention_layernorm.weight"])
        self.mla = MLA(sd, p + "self_attn.", cfg)
        self.ffn = MoE(sd, p + "mlp.", cfg) if cfg.mlp_layer_types[i] == "sparse" else SwiGLU(sd, p + "mlp.")

    def forward(self, h, allowed, cos, sin):
        h = h + self.mla(_norm(h, self.g_in, self.eps), allowed, cos, sin)
        h = h + self.ffn(_norm(h, self.g_post, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class Glm4MoeLitePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.embed = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        self.head = _P(head.float().t())
        self.final_g = _P(sd["model.norm.weight"])
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        d = int(cfg.qk_rope_head_dim * rp.get("partial_rotary_factor", 1.0))
        theta = 10000.0 if b == "gl_rope_theta_default" else float(rp["rope_theta"])
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if _bug() == "gl_mask_on_query_axis":
            allowed = causal & keep[:, None, :, None]
        else:
            allowed = causal & keep[:, None, None, :]
        h = self.embed[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for layer in self.layers:
            h = layer(h, allowed, cos, sin)
        h = _norm(h, self.final_g, self.cfg.rms_norm_eps)
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
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.embed.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Glm4MoeLitePort(state_dict, config).eval()
