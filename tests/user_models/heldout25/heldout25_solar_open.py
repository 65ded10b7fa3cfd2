"""Hand-written plain-PyTorch port of Solar Open (SolarOpenForCausalLM, Upstage's Solar-Open MoE).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block (eps = rms_norm_eps):
        h = h + Attn(RMS_in(h));  h = h + MoE(RMS_post(h))
  - attention: GQA (q head h reads kv head h // groups), scores * head_dim**-0.5, causal;
    * head_dim from config.head_dim (24 here), NOT hidden_size / heads (16 here);
    * config.attention_bias adds biases to q_proj / k_proj / v_proj ONLY: o_proj never has a bias;
    * RoPE in the half-split (rotate_half) form over the FULL head_dim (no partial rotary, unlike the GLM-4.5
      MoE it is derived from), theta = rope_parameters["rope_theta"] (class default 1e6);
  * every layer is a MoE (no leading dense layers):
      router logits r = x W_r^T (float32), s = sigmoid(r);  c = s + e_score_correction_bias (a buffer);
      experts are split into n_group groups; group score = sum of the TWO largest c in the group; the top
      topk_group groups are kept, all other experts' c set to -inf; top-k experts chosen on c;
      mixing weights = the UNBIASED s of the chosen experts, w / (sum w + 1e-20) (norm_topk_prob),
      then * routed_scaling_factor;
      routed experts: SwiGLU (silu(gate) * up -> down) of width moe_intermediate_size;
      plus an always-on shared SwiGLU expert of width moe_intermediate_size * n_shared_experts (NOT scaled);
  - final RMSNorm, then the head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (own names):
  tok (V, H); out (V, H) F.linear layout; g_out (H,);
  blocks[i].g1 / g2 (H,);
  attn.w_qkv (H, (nh + 2 nkv) * hd) (in, out), columns [q heads | k heads | v heads]; attn.b_qkv (same order);
  attn.w_o (nh * hd, H) (in, out);
  moe.router (E, H) F.linear layout; moe.ebias (E,);
  moe.w13 (E, 2 I, H) F.linear layout with gate / up rows INTERLEAVED: row 2j = gate_j, row 2j + 1 = up_j;
  moe.w2 (E, H, I) F.linear layout;
  moe.ws_gu (H, 2 Is) (in, out) columns [gate | up]; moe.ws_d (Is, H) (in, out).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "so_router_softmax",  # DeepSeek-V2 / Mixtral template: softmax router probabilities instead of sigmoid
    "so_score_bias_in_weights",  # mixing weights gathered from the bias-corrected scores s + bias instead of s
    "so_group_score_max",  # group score = the group's best expert only, instead of the sum of its top two
    "so_group_routing_ignored",  # n_group / topk_group ignored: top-k taken over all experts
    "so_topk_not_renormalised",  # norm_topk_prob ignored: chosen sigmoid scores used as-is
    "so_routed_scaling_missing",  # routed_scaling_factor never applied to the routed mixing weights
    "so_shared_expert_scaled",  # routed_scaling_factor also applied to the shared-expert output
    "so_qkv_bias_dropped",  # Llama template: attention_bias ignored, q/k/v biases never loaded
    "so_glm_partial_rotary",  # GLM-4.5-MoE template: RoPE only on the first head_dim / 2 channels (freqs over that)
    "so_rope_theta_default",  # theta falls back to 10000 instead of rope_parameters["rope_theta"] (1e6)
    "so_expert_gate_up_swapped",  # HF gate_up_proj halves interleaved as (up, gate): silu applied to the up branch
    "so_gqa_tiled_heads",  # kv heads expanded with repeat (tile): q head h reads kv head h % nkv, not h // groups
    "so_pad_mask_dropped",  # attention_mask ignored: causal only, pad keys visible to the real tokens
]
PADDING_ONLY = {"so_pad_mask_dropped"}
CLEAN = [
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of explicit softmax
    "rope_complex",  # q/k channels (and biases) of each head permuted at load to adjacent pairs; complex multiply
    "experts_dense",  # every routed expert run on every token, combined with a dense (T, E) weight matrix
    "shared_as_expert",  # shared expert appended to the expert bank (routed ones zero-padded), always routed, weight 1
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
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _to_pairs(d):
    """index list: new channel 2i <- old i, new 2i + 1 <- old i + d/2 (half-split -> adjacent pairs)"""
    h = d // 2
    return torch.stack((torch.arange(h), torch.arange(h) + h), -1).flatten()


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, rot/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b == "rope_complex":
        z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    rot = 2 * cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    h = rot // 2
    x1, x2 = xr[..., :h], xr[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xp), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.g = self.nh // self.nkv
        H = cfg.hidden_size
        ws, bs = [], []
        for name, n in (("q_proj", self.nh), ("k_proj", self.nkv), ("v_proj", self.nkv)):
            w = sd[p + name + ".weight"].float().view(n, self.hd, H)
            if cfg.attention_bias and b != "so_qkv_bias_dropped":
                bb = sd[p + name + ".bias"].float().view(n, self.hd)
            else:
                bb = torch.zeros(n, self.hd)
            if b == "rope_complex" and name != "v_proj":
                perm = _to_pairs(self.hd)
                w, bb = w[:, perm], bb[:, perm]
            ws.append(w.reshape(n * self.hd, H))
            bs.append(bb.reshape(-1))
        self.w_qkv = _P(torch.cat(ws, 0).t())
        self.b_qkv = _P(torch.cat(bs))
        self.w_o = _P(sd[p + "o_proj.weight"].float().t())
        self.scale = self.hd**-0.5

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        qkv = x @ self.w_qkv + self.b_qkv
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q = qkv[..., :nq].view(B, S, self.nh, self.hd).transpose(1, 2)
        k = qkv[..., nq : nq + nk].view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = qkv[..., nq + nk :].view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if b == "so_gqa_tiled_heads":
            k, v = k.repeat(1, self.g, 1, 1), v.repeat(1, self.g, 1, 1)
        else:
            k, v = k.repeat_interleave(self.g, 1), v.repeat_interleave(self.g, 1)
        if b == "sdpa_attention":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.w_o
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        self.k = cfg.num_experts_per_tok
        self.E = cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk = cfg.norm_topk_prob
        self.rsf = float(cfg.routed_scaling_factor)
        self.router = _P(sd[p + "gate.weight"])
        self.ebias = _P(sd[p + "gate.e_score_correction_bias"])
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H) rows [gate | up]
        I = gu.shape[1] // 2  # noqa: E741
        gate, up = gu[:, :I], gu[:, I:]
        pair = (up, gate) if b == "so_expert_gate_up_swapped" else (gate, up)
        w13 = torch.stack(pair, 2).reshape(self.E, 2 * I, -1)
        w2 = sd[p + "experts.down_proj"].float()  # (E, H, I)
        sg = sd[p + "shared_experts.gate_proj.weight"].float().t()
        su = sd[p + "shared_experts.up_proj.weight"].float().t()
        sdn = sd[p + "shared_experts.down_proj.weight"].float().t()
        self.shared_in_bank = b == "shared_as_expert"
        if self.shared_in_bank:
            Is = sg.shape[1]
            W = max(I, Is)
            pad13 = torch.zeros(self.E, 2 * W, w13.shape[-1])
            pad13[:, : 2 * I] = w13
            pad2 = torch.zeros(self.E, w2.shape[1], W)
            pad2[:, :, :I] = w2
            sh13 = torch.zeros(1, 2 * W, w13.shape[-1])
            sh13[0, 0 : 2 * Is : 2] = sg.t()
            sh13[0, 1 : 2 * Is : 2] = su.t()
            sh2 = torch.zeros(1, w2.shape[1], W)
            sh2[0, :, :Is] = sdn.t()
            w13, w2 = torch.cat((pad13, sh13)), torch.cat((pad2, sh2))
        else:
            self.ws_gu = _P(torch.cat((sg, su), 1))
            self.ws_d = _P(sdn)
        self.w13, self.w2 = _P(w13), _P(w2)

    def _expert(self, x, e):
        gu = F.linear(x, self.w13[e])
        return F.linear(F.silu(gu[:, 0::2]) * gu[:, 1::2], self.w2[e])

    def _shared(self, x):
        g, u = (x @ self.ws_gu).chunk(2, -1)
        return (F.silu(g) * u) @ self.ws_d

    def _route(self, t):
        b = _bug()
        logits = F.linear(t.float(), self.router)
        s = torch.softmax(logits, -1) if b == "so_router_softmax" else torch.sigmoid(logits)
        c = s + self.ebias
        if b != "so_group_routing_ignored":
            cg = c.view(-1, self.n_group, self.E // self.n_group)
            if b == "so_group_score_max":
                gs = cg.max(-1).values
            else:
                gs = cg.topk(2, -1).values.sum(-1)
            gi = gs.topk(self.topk_group, -1).indices
            gmask = torch.zeros_like(gs, dtype=torch.bool).scatter(1, gi, True)
            emask = gmask[:, :, None].expand_as(cg).reshape(-1, self.E)
            c_sel = c.masked_fill(~emask, float("-inf"))
        else:
            c_sel = c
        idx = c_sel.topk(self.k, -1).indices
        w = (c if b == "so_score_bias_in_weights" else s).gather(1, idx)
        if self.norm_topk and b != "so_topk_not_renormalised":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if b != "so_routed_scaling_missing":
            w = w * self.rsf
        return idx, w

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        idx, w = self._route(t)
        out = torch.zeros_like(t)
        nE = self.E
        if self.shared_in_bank:
            idx = torch.cat((idx, torch.full_like(idx[:, :1], self.E)), 1)
            w = torch.cat((w, torch.ones_like(w[:, :1])), 1)
            nE = self.E + 1
        if b == "experts_dense":
            dense = w.new_zeros(t.shape[0], nE).scatter(1, idx, w)
            for e in range(nE):
                out = out + dense[:, e : e + 1] * self._expert(t, e)
        else:
            for e in range(nE):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel():
                    out.index_add_(0, tok, self._expert(t[tok], e) * w[tok, slot, None])
        if not self.shared_in_bank:
            sh = self._shared(t)
            if b == "so_shared_expert_scaled":
                sh = sh * self.rsf
            out = out + sh
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.g1 = _P(sd[p + "input_layernorm.weight"])
        self.g2 = _P(sd[p + "post_attention_layernorm.weight"])
        self.attn = Attention(sd, p + "self_attn.", cfg)
        self.moe = MoE(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, cos, sin):
        h = h + self.attn(_norm(h, self.g1, self.eps), allowed, cos, sin)
        h = h + self.moe(_norm(h, self.g2, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class SolarOpenPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        self.out = _P(head)
        self.g_out = _P(sd["model.norm.weight"])
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dim = int(hd * rp.get("partial_rotary_factor", 1.0))
        if b == "so_glm_partial_rotary":
            dim = hd // 2
        theta = 10000.0 if b == "so_rope_theta_default" else float(rp["rope_theta"])
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if b == "so_pad_mask_dropped":
            allowed = causal.expand(input_ids.shape[0], 1, S, S)
        else:
            allowed = causal & keep[:, None, None, :]
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            h = blk(h, allowed, cos, sin)
        h = _norm(h, self.g_out, self.cfg.rms_norm_eps)
        _rec("model.norm", h)
        logits = F.linear(h, self.out)
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
            logits = torch.zeros(B, S, self.out.shape[0], dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return SolarOpenPort(state_dict, config).eval()
