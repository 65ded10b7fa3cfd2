"""Hand-written plain-PyTorch port of EXAONE-MoE (ExaoneMoeForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  token embedding (no scaling); untied output head; RMSNorm y = x / sqrt(mean(x^2) + eps) * w, two pre-norms per block;
  attention: GQA (nh = 4, nkv = 2), head_dim = hidden / heads, no biases, scores scaled by head_dim**-0.5;
  * per-head RMSNorm on q and on k (q_norm / k_norm over head_dim, own gains) applied BEFORE RoPE;
  * per-layer attention kind from config.layer_types (from sliding_window_pattern: layer i sliding iff
    (i + 1) % pattern != 0, here [sliding, full, sliding, full]); a sliding layer lets query q see key k iff
    q - W < k <= q (W = config.sliding_window);
  * RoPE (half-split / rotate_half form, theta = rope_parameters["rope_theta"]) ONLY on sliding layers; full-attention
    layers use no positional encoding at all (NoPE);
  * first first_k_dense_replace layers (config.mlp_layer_types "dense") use a dense SwiGLU MLP (intermediate_size);
    the others a MoE block:
      - router: logits = x @ Wr^T in float32, scores = sigmoid(logits); choice = scores + e_score_correction_bias;
        experts split in n_group groups, group score = sum of its 2 best choice values, only the topk_group best
        groups kept; top-k (num_experts_per_tok) of the choice values among kept experts;
        weights = UNBIASED sigmoid scores of the chosen experts, renormalised to sum 1 (norm_topk_prob),
        then multiplied by routed_scaling_factor;
      - routed experts: silu(gate) * up -> down (moe_intermediate_size), weighted and summed;
      - shared expert (moe_intermediate_size * num_shared_experts), always on, weight 1, added to the routed sum;
  padding: HF-style attention_mask masks padded keys in both the full and the sliding masks;
  positions from position_ids (0..S-1 when absent).

Weight layout of this port (own names, not the HF state-dict names):
  embed (V, H); final_norm.g (H,); unembed (V, H);
  layers[i].norm1.g / norm2.g (H,); layers[i].attn.wq (nh*hd, H), wk / wv (nkv*hd, H), wo (H, nh*hd) (F.linear);
  layers[i].attn.qn.g / kn.g (hd,); each layer has plain attributes `sliding` (bool) and `rope` (bool);
  dense layers: layers[i].ffn.w1 / w3 (H, I), w2 (I, H) applied as x @ w;
  MoE layers: layers[i].ffn.router (E, H), layers[i].ffn.router_bias (E,);
    layers[i].ffn.w1 / w3 (E, H, Im) (gate / up, unpacked from the HF gate_up_proj), w2 (E, Im, H);
    layers[i].ffn.shared_w1 / shared_w3 (H, Is), shared_w2 (Is, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "em_rope_on_all_layers",  # RoPE applied on full-attention layers too (their NoPE missed)
    "em_qk_norm_dropped",  # q_norm / k_norm weights never loaded, per-head norm skipped
    "em_qk_norm_after_rope",  # per-head q/k RMSNorm applied after the rotation instead of before
    "em_layer_types_shifted",  # pattern off by one: full when i % pattern == 0 instead of (i + 1) % pattern == 0
    "em_window_one_extra_key",  # sliding mask written q - k <= W: W + 1 keys visible
    "em_router_softmax",  # DeepSeek-V2 / Mixtral template: softmax scoring instead of sigmoid
    "em_router_bias_dropped",  # e_score_correction_bias buffer not loaded: selection uses raw sigmoid scores
    "em_weights_from_biased_scores",  # combine weights gathered from bias-corrected scores instead of raw scores
    "em_group_limit_ignored",  # n_group / topk_group restriction skipped: top-k over all experts
    "em_no_topk_renorm",  # norm_topk_prob ignored: chosen sigmoid scores not renormalised
    "em_routed_scaling_dropped",  # routed_scaling_factor never applied to the routed experts
    "em_shared_expert_dropped",  # shared_experts weights never loaded
    "em_full_pad_mask_dropped",  # padding merged into the sliding mask only; full layers get causal only
]
PADDING_ONLY = {"em_full_pad_mask_dropped"}
CLEAN = [
    "routed_scale_folded",  # routed_scaling_factor folded into every routed expert's w2 at load
    "shared_as_expert",  # shared expert appended as an extra always-selected expert with weight 1
    "rope_complex",  # head channels of q/k (and q_norm/k_norm gains) permuted to pairs; RoPE as complex multiply
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask (pad queries see themselves)
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
    idx = []
    for i in range(hd // 2):
        idx += [i, hd // 2 + i]
    return torch.tensor(idx)


class Norm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.g = _P(w)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.g


def _rope(x, cos, sin):
    """x (B, heads, S, hd); cos/sin (B, S, hd/2)"""
    if _bug() == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)[:, None]).flatten(-2)
    c, s = cos[:, None], sin[:, None]
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), -1)


class Attn(nn.Module):
    def __init__(self, sd, p, cfg, sliding):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        H = cfg.hidden_size
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        q = sd[p + "q_proj.weight"].float().view(self.nh, self.hd, H)
        k = sd[p + "k_proj.weight"].float().view(self.nkv, self.hd, H)
        qn, kn = sd[p + "q_norm.weight"].float(), sd[p + "k_norm.weight"].float()
        if b == "rope_complex":
            o = _pairs_order(self.hd)
            q, k, qn, kn = q[:, o], k[:, o], qn[o], kn[o]
        self.wq = _P(q.reshape(-1, H))
        self.wk = _P(k.reshape(-1, H))
        self.wv = _P(sd[p + "v_proj.weight"])
        self.wo = _P(sd[p + "o_proj.weight"])
        self.qn = Norm(qn, cfg.rms_norm_eps)
        self.kn = Norm(kn, cfg.rms_norm_eps)
        self.sliding = sliding
        if cfg.sliding_window is None or b == "em_rope_on_all_layers":
            self.rope = True
        else:
            self.rope = sliding

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        q = F.linear(x, self.wq)
        k = F.linear(x, self.wk)
        v = F.linear(x, self.wv)
        if b != "rope_complex":
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        if b not in ("em_qk_norm_dropped", "em_qk_norm_after_rope"):
            q, k = self.qn(q), self.kn(k)
        if self.rope:
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if b == "em_qk_norm_after_rope":
            q, k = self.qn(q), self.kn(k)
        g = self.nh // self.nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if b == "sdpa_attention":
            eye = torch.eye(S, dtype=torch.bool)[None, None]
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | eye)
        else:
            s = (q @ k.transpose(-1, -2)) * self.hd**-0.5
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = F.linear(ctx.transpose(1, 2).reshape(B, S, -1), self.wo)
        _rec(self.pre.rstrip("."), out)
        return out


class DenseFFN(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.w1 = _P(sd[p + "gate_proj.weight"].float().t())
        self.w3 = _P(sd[p + "up_proj.weight"].float().t())
        self.w2 = _P(sd[p + "down_proj.weight"].float().t())
        self.pre = p

    def forward(self, x):
        out = (F.silu(x @ self.w1) * (x @ self.w3)) @ self.w2
        _rec(self.pre.rstrip("."), out)
        return out


class MoEFFN(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk = cfg.norm_topk_prob
        self.rsf = float(cfg.routed_scaling_factor)
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        E, I2, _ = gu.shape
        I = I2 // 2  # noqa: E741
        self.E = E
        w2 = sd[p + "experts.down_proj"].float().transpose(1, 2)  # (E, I, H)
        if b == "routed_scale_folded":
            w2 = w2 * self.rsf
            self.rsf = 1.0
        self.w1 = _P(gu[:, :I].transpose(1, 2))
        self.w3 = _P(gu[:, I:].transpose(1, 2))
        self.w2 = _P(w2)
        self.router = _P(sd[p + "gate.weight"])
        bias = sd.get(p + "gate.e_score_correction_bias")
        if bias is None or b == "em_router_bias_dropped":
            bias = torch.zeros(E)
        self.router_bias = _P(bias)
        self.has_shared = (p + "shared_experts.gate_proj.weight") in sd and b != "em_shared_expert_dropped"
        if self.has_shared:
            self.shared_w1 = _P(sd[p + "shared_experts.gate_proj.weight"].float().t())
            self.shared_w3 = _P(sd[p + "shared_experts.up_proj.weight"].float().t())
            self.shared_w2 = _P(sd[p + "shared_experts.down_proj.weight"].float().t())

    def route(self, t):
        b = _bug()
        logits = F.linear(t.float(), self.router)
        scores = torch.softmax(logits, -1) if b == "em_router_softmax" else torch.sigmoid(logits)
        choice = scores + self.router_bias
        if b != "em_group_limit_ignored" and self.n_group > 1:
            T = t.shape[0]
            grp = choice.view(T, self.n_group, -1).topk(2, -1)[0].sum(-1)
            gidx = grp.topk(self.topk_group, -1)[1]
            gmask = torch.zeros_like(grp, dtype=torch.bool).scatter(1, gidx, True)
            emask = gmask[:, :, None].expand(T, self.n_group, self.E // self.n_group).reshape(T, self.E)
            choice = choice.masked_fill(~emask, float("-inf"))
        idx = choice.topk(self.k, -1)[1]
        src = choice if b == "em_weights_from_biased_scores" else scores
        w = src.gather(1, idx)
        if self.norm_topk and b != "em_no_topk_renorm":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if b != "em_routed_scaling_dropped":
            w = w * self.rsf
        return idx, w

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        idx, w = self.route(t)
        w1, w3, w2 = self.w1, self.w3, self.w2
        if b == "shared_as_expert" and self.has_shared:
            w1 = torch.cat((w1, self.shared_w1[None]))
            w3 = torch.cat((w3, self.shared_w3[None]))
            w2 = torch.cat((w2, self.shared_w2[None]))
            T = t.shape[0]
            idx = torch.cat((idx, torch.full((T, 1), self.E, dtype=idx.dtype)), 1)
            w = torch.cat((w, torch.ones(T, 1)), 1)
        out = torch.zeros_like(t)
        for e in range(w1.shape[0]):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = t[tok]
            y = (F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]
            out.index_add_(0, tok, y * w[tok, slot, None])
        if self.has_shared and b != "shared_as_expert":
            out = out + (F.silu(t @ self.shared_w1) * (t @ self.shared_w3)) @ self.shared_w2
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        pat = cfg.sliding_window_pattern
        if cfg.sliding_window is None:
            self.sliding = False
        elif _bug() == "em_layer_types_shifted":
            self.sliding = i % pat != 0
        else:
            self.sliding = cfg.layer_types[i] == "sliding_attention"
        self.norm1 = Norm(sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = Attn(sd, p + "self_attn.", cfg, self.sliding)
        self.norm2 = Norm(sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if cfg.mlp_layer_types[i] == "sparse":
            self.ffn = MoEFFN(sd, p + "mlp.", cfg)
        else:
            self.ffn = DenseFFN(sd, p + "mlp.")

    def forward(self, h, masks, cos, sin):
        n = self.norm1(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attn(n, masks["sliding" if self.sliding else "full"], cos, sin)
        n = self.norm2(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.ffn(n)
        _rec(self.pre.rstrip("."), h)
        return h


class ExaoneMoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        self.unembed = _P(head)
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = Norm(sd["model.norm.weight"], cfg.rms_norm_eps)
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
        W = self.cfg.sliding_window or S
        near = (qi - ki <= W) if b == "em_window_one_extra_key" else (qi - ki < W)
        pad = keep[:, None, None, :]
        full = causal if b == "em_full_pad_mask_dropped" else causal & pad
        sliding = causal & near[None, None] & pad
        shape = (keep.shape[0], 1, S, S)
        return {"full": full.expand(shape), "sliding": sliding.expand(shape)}

    def _core(self, input_ids, keep, pos):
        masks = self._masks(keep)
        h = self.embed[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for layer in self.layers:
            h = layer(h, masks, cos, sin)
        h = self.final_norm(h)
        _rec("model.norm", h)
        logits = F.linear(h, self.unembed)
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
    return ExaoneMoePort(state_dict, config).eval()
