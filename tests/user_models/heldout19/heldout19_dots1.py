"""Hand-written plain-PyTorch port of dots.llm1 (Dots1ForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding (no scaling); separate untied output head;
  * pre-norm blocks with plain RMSNorm y = x / sqrt(mean(x^2) + eps) * w (eps = rms_norm_eps):
        h = h + Attn(RMS_in(h));  h = h + FFN(RMS_post(h))
  * attention: GQA, head_dim = hidden / heads, no biases, scores = q.k / sqrt(head_dim);
  * * per-head QK-norm: q and k are RMS-normalised over each head's head_dim channels (q_norm / k_norm weights
    of size head_dim, shared by all heads), BEFORE RoPE;
  * RoPE in the half-split (rotate_half / NeoX) form over the full head_dim, theta = rope_parameters["rope_theta"];
  * * per-layer attention kind from config.layer_types (Qwen2 convention: layer i slides iff
    sliding_window is set and i >= max_window_layers; here layers 2 and 3); a sliding layer lets query q see key k
    iff q - W < k <= q (W = sliding_window); the key-padding mask is applied in both kinds of layer;
  * * FFN: the first `first_k_dense_replace` layers use a dense SwiGLU MLP (intermediate_size);
    the others a DeepSeek-V3-style MoE:
      - router logits = x Wr^T (float32), scores = sigmoid(logits) (not softmax);
      - selection uses scores + e_score_correction_bias; group-limited: experts split into n_group contiguous groups,
        group score = sum of the top-2 biased scores of the group, keep the best topk_group groups, then top-k
        (num_experts_per_tok) experts among the kept groups;
      - combine weights are the UNBIASED sigmoid scores of the chosen experts, renormalised to sum 1 when
        norm_topk_prob, then multiplied by routed_scaling_factor;
      - routed experts: SwiGLU with moe_intermediate_size; plus n_shared_experts shared experts as one SwiGLU MLP of
        width moe_intermediate_size * n_shared_experts, added unweighted (not scaled by routed_scaling_factor);
  * padding: HF-style attention_mask masks keys (float32 min fill); positions from position_ids
    (0..S-1 when absent, also for left-padded rows, as HF does).

Weight layout of this port (own names, einsum per-head attention, stacked experts):
  tok_emb (V, H); head (V, H); final_norm (H,);
  blocks[i].ln_attn (H,); blocks[i].ln_ffn (H,);
  blocks[i].attn.wq (H, nh, hd); blocks[i].attn.wkv (H, 2, nkv, hd) with [:, 0] = K, [:, 1] = V;
  blocks[i].attn.wo (nh, hd, H); blocks[i].attn.q_gain (hd,); blocks[i].attn.k_gain (hd,);
  dense layers: blocks[i].ffn.w1 / w3 (I, H) (gate / up), blocks[i].ffn.w2 (H, I) (nn.Linear orientation);
  MoE layers: blocks[i].ffn.router_w (E, H); blocks[i].ffn.router_bias (E,);
      blocks[i].ffn.w1 / w3 (E, H, Im) (gate / up, "x @ W" per expert); blocks[i].ffn.w2 (E, Im, H);
      blocks[i].ffn.shared.w1 / w3 (Is, H), blocks[i].ffn.shared.w2 (H, Is).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "d1_router_softmax",  # router scores from softmax (Mixtral / DeepSeek-V2 habit) instead of sigmoid
    "d1_bias_in_weights",  # combine weights gathered from the bias-corrected scores, not the raw sigmoid scores
    "d1_bias_ignored",  # e_score_correction_bias loaded but never added for the selection
    "d1_group_score_max",  # group score = max expert score of the group (DeepSeek-V2) instead of sum of its top-2
    "d1_group_limit_ignored",  # n_group / topk_group ignored: plain top-k over all experts
    "d1_topk_not_normalized",  # norm_topk_prob ignored: chosen sigmoid scores not renormalised to sum 1
    "d1_scale_before_norm",  # routed_scaling_factor applied before the renormalisation, so it cancels out
    "d1_shared_scaled",  # routed_scaling_factor applied to the whole MoE output, shared expert included
    "d1_gate_up_interleaved",  # HF gate_up_proj rows split as even = gate / odd = up instead of [gate | up] halves
    "d1_qk_norm_after_rope",  # per-head q/k RMSNorm applied after RoPE instead of before
    "d1_sliding_layers_inverted",  # max_window_layers read as "the first N layers slide" (layers 0, 1 instead of 2, 3)
    "d1_window_off_by_one",  # sliding mask q - k <= W: W + 1 keys visible instead of W
    "d1_sliding_pad_mask_dropped",  # key-padding mask merged into the full-attention mask only
]
PADDING_ONLY = {"d1_sliding_pad_mask_dropped"}
CLEAN = [
    "experts_dense_bmm",  # every expert run on every token with one bmm over the stacked experts, dense combine
    "grouped_topk_sorted",  # group-limited top-k via sort / argsort and an expert-to-group id map
    "routed_scale_folded",  # routed_scaling_factor folded into the stacked expert w2 at load
    "rope_complex",  # q/k head channels (and q/k norm gains) permuted at load; RoPE as a complex multiply
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


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, ang):
    """x (B, S, heads, hd); ang (B, S, hd/2)"""
    if _bug() == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, :, None]).flatten(-2)
    emb = torch.cat((ang, ang), -1)[:, :, None]
    h = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * emb.sin()


class Attn(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        H = cfg.hidden_size
        q = sd[p + "q_proj.weight"].float().view(self.nh, self.hd, H)
        k = sd[p + "k_proj.weight"].float().view(self.nkv, self.hd, H)
        v = sd[p + "v_proj.weight"].float().view(self.nkv, self.hd, H)
        qg = sd[p + "q_norm.weight"].float()
        kg = sd[p + "k_norm.weight"].float()
        if b == "rope_complex":
            order = _pairs_order(self.hd)
            q, k, qg, kg = q[:, order], k[:, order], qg[order], kg[order]
        self.wq = _P(q.permute(2, 0, 1))
        self.wkv = _P(torch.stack((k, v)).permute(3, 0, 1, 2))
        self.wo = _P(sd[p + "o_proj.weight"].float().t().reshape(self.nh, self.hd, H))
        self.q_gain = _P(qg)
        self.k_gain = _P(kg)
        self.eps = cfg.rms_norm_eps
        self.scale = self.hd**-0.5

    def forward(self, x, allowed, ang):
        b = _bug()
        B, S, _ = x.shape
        q = torch.einsum("bsh,hnd->bsnd", x, self.wq)
        kv = torch.einsum("bsh,hcnd->cbsnd", x, self.wkv)
        k, v = kv[0], kv[1]
        if b != "rope_complex":
            _rec(self.pre + "q_proj", q.reshape(B, S, -1))
            _rec(self.pre + "k_proj", k.reshape(B, S, -1))
        _rec(self.pre + "v_proj", v.reshape(B, S, -1))
        if b == "d1_qk_norm_after_rope":
            q, k = _rope(q, ang), _rope(k, ang)
            q, k = _rms(q, self.q_gain, self.eps), _rms(k, self.k_gain, self.eps)
        else:
            q, k = _rms(q, self.q_gain, self.eps), _rms(k, self.k_gain, self.eps)
            if b != "rope_complex":
                _rec(self.pre + "q_norm", q)
                _rec(self.pre + "k_norm", k)
            q, k = _rope(q, ang), _rope(k, ang)
        g = self.nh // self.nkv
        k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
        s = torch.einsum("bqnd,bknd->bnqk", q, k) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = torch.einsum("bnqk,bknd->bqnd", torch.softmax(s, -1), v)
        out = torch.einsum("bsnd,ndh->bsh", ctx, self.wo)
        _rec(self.pre.rstrip("."), out)
        return out


class DenseFFN(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.w1 = _P(sd[p + "gate_proj.weight"])
        self.w3 = _P(sd[p + "up_proj.weight"])
        self.w2 = _P(sd[p + "down_proj.weight"])
        self.pre = p

    def forward(self, x):
        out = F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        self.E = cfg.n_routed_experts
        self.k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk = cfg.norm_topk_prob
        self.rsf = float(cfg.routed_scaling_factor)
        self.router_w = _P(sd[p + "gate.weight"])
        self.router_bias = _P(sd[p + "gate.e_score_correction_bias"])
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2Im, H)
        Im = gu.shape[1] // 2
        if b == "d1_gate_up_interleaved":
            gate, up = gu[:, 0::2], gu[:, 1::2]
        else:
            gate, up = gu[:, :Im], gu[:, Im:]
        self.w1 = _P(gate.transpose(1, 2))
        self.w3 = _P(up.transpose(1, 2))
        w2 = sd[p + "experts.down_proj"].float().transpose(1, 2)  # (E, Im, H)
        if b == "routed_scale_folded":
            w2 = w2 * self.rsf
            self.rsf = 1.0
        self.w2 = _P(w2)
        self.shared = DenseFFN(sd, p + "shared_experts.")

    def _select(self, biased):
        """returns (T, k) expert ids from the bias-corrected scores"""
        b = _bug()
        T = biased.shape[0]
        G = self.n_group
        per = self.E // G
        if b == "d1_group_limit_ignored":
            return biased.topk(self.k, -1)[1]
        if b == "grouped_topk_sorted":
            gs = biased.view(T, G, per).sort(-1, descending=True)[0][..., :2].sum(-1)
            keep_groups = gs.argsort(-1, descending=True)[:, : self.topk_group]  # (T, tg)
            group_of = torch.arange(self.E) // per  # (E,)
            ok = (group_of[None, :, None] == keep_groups[:, None, :]).any(-1)  # (T, E)
            masked = torch.where(ok, biased, torch.full_like(biased, float("-inf")))
            order = masked.argsort(-1, descending=True)
            return order[:, : self.k]
        grouped = biased.view(T, G, per)
        if b == "d1_group_score_max":
            gs = grouped.max(-1)[0]
        else:
            gs = grouped.topk(2, -1)[0].sum(-1)
        gidx = gs.topk(self.topk_group, -1)[1]
        gmask = torch.zeros(T, G, dtype=torch.bool).scatter(1, gidx, True)
        emask = gmask[:, :, None].expand(T, G, per).reshape(T, self.E)
        return biased.masked_fill(~emask, float("-inf")).topk(self.k, -1)[1]

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = F.linear(t.float(), self.router_w)
        scores = torch.softmax(logits, -1) if b == "d1_router_softmax" else torch.sigmoid(logits)
        biased = scores if b == "d1_bias_ignored" else scores + self.router_bias
        idx = self._select(biased)
        w = (biased if b == "d1_bias_in_weights" else scores).gather(1, idx)
        if b == "d1_scale_before_norm":
            w = w * self.rsf
        if self.norm_topk and b != "d1_topk_not_normalized":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if b not in ("d1_scale_before_norm", "d1_shared_scaled"):
            w = w * self.rsf
        if b == "experts_dense_bmm":
            T = t.shape[0]
            dense_w = torch.zeros(T, self.E).scatter(1, idx, w)  # (T, E)
            xt = t[None].expand(self.E, T, H)
            hmid = F.silu(torch.bmm(xt, self.w1)) * torch.bmm(xt, self.w3)
            y = torch.bmm(hmid, self.w2)  # (E, T, H)
            routed = (y * dense_w.t()[..., None]).sum(0)
        else:
            routed = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                xe = t[tok]
                ye = (F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e]
                routed.index_add_(0, tok, ye * w[tok, slot, None])
        routed = routed.view(B, S, H)
        _rec(self.pre + "experts", routed.reshape(-1, H))
        out = routed + self.shared(x)
        if b == "d1_shared_scaled":
            out = out * self.rsf
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        if b == "d1_sliding_layers_inverted":
            self.sliding = cfg.sliding_window is not None and i < cfg.max_window_layers
        else:
            self.sliding = cfg.layer_types[i] == "sliding_attention"
        self.ln_attn = _P(sd[p + "input_layernorm.weight"])
        self.attn = Attn(sd, p + "self_attn.", cfg)
        self.ln_ffn = _P(sd[p + "post_attention_layernorm.weight"])
        self.ffn = MoE(sd, p + "mlp.", cfg) if i >= cfg.first_k_dense_replace else DenseFFN(sd, p + "mlp.")
        self.eps = cfg.rms_norm_eps

    def forward(self, h, masks, ang):
        n = _rms(h, self.ln_attn, self.eps)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attn(n, masks["sliding" if self.sliding else "full"], ang)
        n = _rms(h, self.ln_ffn, self.eps)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.ffn(n)
        _rec(self.pre.rstrip("."), h)
        return h


class Dots1Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = _P(sd["model.embed_tokens.weight"])
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in sd
        self.head = _P(sd["model.embed_tokens.weight" if tied else "lm_head.weight"])
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = _P(sd["model.norm.weight"])
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _masks(self, keep):
        b = _bug()
        S = keep.shape[1]
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        causal = (ki <= qi)[None, None]
        W = self.cfg.sliding_window
        if W is None:
            near = torch.ones(S, S, dtype=torch.bool)
        elif b == "d1_window_off_by_one":
            near = qi - ki <= W
        else:
            near = qi - ki < W
        pad = keep[:, None, None, :]
        full = causal & pad
        sliding = causal & near[None, None]
        if b != "d1_sliding_pad_mask_dropped":
            sliding = sliding & pad
        return {"full": full, "sliding": sliding.expand_as(full)}

    def _core(self, input_ids, keep, pos):
        masks = self._masks(keep)
        h = self.tok_emb[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        for blk in self.blocks:
            h = blk(h, masks, ang)
        h = _rms(h, self.final_norm, self.cfg.rms_norm_eps)
        _rec("model.norm", h)
        logits = h @ self.head.t()
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
    return Dots1Port(state_dict, config).eval()
