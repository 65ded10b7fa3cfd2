"""Hand-written plain-PyTorch port of MiMo-V2-Flash (MiMoV2FlashForCausalLM, Xiaomi).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block, final norm, head:
        h = h + Attn(RMS_in(h));  h = h + FFN(RMS_post(h))
  * per-layer attention kind from config.layer_types: "full_attention" (causal) or "sliding_attention" (causal AND
    key index > query index - sliding_window); here [full, sliding, sliding, full];
  * asymmetric heads: q / k heads have head_dim (24 here, not hidden / heads = 16), v / o heads have v_head_dim (16);
    scores * head_dim**-0.5;
  * sliding layers have TWICE config.num_key_value_heads kv heads (4 here, so one kv head per q head) and a learned
    per-q-head attention SINK logit: softmax over [scores..., sink], the sink column then dropped (rows sum < 1);
    full layers use config.num_key_value_heads (2) and no sink; q head h reads kv head h // (nh / nkv_layer);
  * values multiplied by config.attention_value_scale (0.707) before attention;
  * partial RoPE per layer type (config.rope_parameters[layer_type]): its own rope_theta (5e6 full, 1e4 sliding) and
    partial_rotary_factor (0.334): only the first int(head_dim * 0.334) = 8 q / k channels rotated, half-split form;
  * FFN from config.mlp_layer_types: "dense" SwiGLU (layer 0 here) or "sparse" MoE WITHOUT shared expert:
      scores = sigmoid(x W_r^T) (fp32);  choice = scores + e_score_correction_bias;
      group score = sum of the top-2 choice values inside each of n_group groups; keep topk_group groups;
      top-k experts by choice inside kept groups; weights = UNBIASED scores of those experts, renormalised
      (norm_topk_prob, + 1e-20) and multiplied by routed_scaling_factor; experts SwiGLU;
  - padding: HF-style 0/1 attention_mask masks keys (in both the full and the sliding masks); positions 0..S-1.

Weight layout of this port (own names):
  tok (V, H); out (V, H) (F.linear layout); g_out (H,);
  blocks[i].g1 / g2 (H,);
  attn.w_qkv (nh hd + nkv hd + nkv vd, H) F.linear layout, rows [q | k | v]; attn.w_o (nh vd, H) (in, out) layout;
  attn.sink (nh,) (sliding layers only);
  dense mlp.w_gu (H, 2 I) (in, out) columns [up | gate]; mlp.w_dn (I, H);
  moe.w_r (H, E) (in, out); moe.e_bias (E,); moe.w_gu (E, H, 2 I) columns [up | gate]; moe.w_dn (E, I, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "mi_sink_dropped",  # attention sinks of the sliding layers ignored: plain softmax over the keys
    "mi_swa_group_from_config",  # sliding-layer GQA group size from config.num_key_value_heads (not the doubled count)
    "mi_v_scale_missing",  # attention_value_scale not applied to the values
    "mi_rope_single_theta",  # one RoPE table for all layers: sliding layers use the full-attention rope_theta
    "mi_rope_partial_ignored",  # partial_rotary_factor ignored: RoPE over the whole q / k head_dim
    "mi_window_off_by_one",  # sliding mask keeps key index >= q - window: window + 1 tokens
    "mi_router_softmax",  # router scores by softmax instead of sigmoid
    "mi_router_bias_in_weights",  # expert weights gathered from bias-corrected scores instead of the raw sigmoid scores
    "mi_group_score_max",  # group score = best expert of the group instead of the sum of its top-2
    "mi_scaling_factor_dropped",  # routed_scaling_factor not applied to the routing weights
    "mi_scale_v_head_dim",  # softmax scale v_head_dim**-0.5 instead of head_dim**-0.5
    "mi_experts_gate_up_swapped",  # fused experts.gate_up_proj halves read as [up | gate] instead of [gate | up]
    "mi_swa_mask_ignores_padding",  # padding merged only into the full-attention mask; sliding layers see pad keys
]
PADDING_ONLY = {"mi_swa_mask_ignores_padding"}
CLEAN = [
    "sdpa_sink_rescale",  # F.scaled_dot_product_attention, sink applied afterwards as a sigmoid(lse - sink) rescale
    "rope_complex",  # rotary q / k channels permuted at load to adjacent pairs; RoPE as a complex multiply
    "scales_folded",  # softmax scale folded into the q rows, attention_value_scale into the v rows at load
    "moe_dense_all_experts",  # every expert run on every token, combined with a dense (T, E) routing-weight matrix
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


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _to_pairs(d):
    """index list: new channel 2i <- old i, new 2i + 1 <- old i + d/2 (half-split -> adjacent pairs)"""
    h = d // 2
    return torch.stack((torch.arange(h), torch.arange(h) + h), -1).flatten()


def _rope(x, cos, sin):
    """x (B, n, S, d); cos / sin (B, S, rot/2): rotates the first rot channels"""
    rot = cos.shape[-1] * 2
    cos, sin = cos[:, None], sin[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    if _bug() == "rope_complex":
        z = torch.view_as_complex(xr.unflatten(-1, (-1, 2)).contiguous())
        xr = torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
        return torch.cat((xr, xp), -1)
    h = rot // 2
    x1, x2 = xr[..., :h], xr[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xp), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, kind, rot):
        super().__init__()
        b = _bug()
        self.pre = p
        self.kind = kind
        swa = kind == "sliding_attention"
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads * (2 if swa else 1)
        self.hd, self.vd = cfg.head_dim, cfg.v_head_dim
        self.rot = rot
        H = cfg.hidden_size
        if b == "mi_swa_group_from_config":
            self.g = self.nh // cfg.num_key_value_heads
        else:
            self.g = self.nh // self.nkv
        wq = sd[p + "q_proj.weight"].float().view(self.nh, self.hd, H)
        wk = sd[p + "k_proj.weight"].float().view(self.nkv, self.hd, H)
        wv = sd[p + "v_proj.weight"].float()
        if b == "rope_complex":
            perm = torch.cat((_to_pairs(rot), torch.arange(rot, self.hd)))
            wq, wk = wq[:, perm], wk[:, perm]
        self.scale = (self.vd if b == "mi_scale_v_head_dim" else self.hd) ** -0.5
        vs = cfg.attention_value_scale if cfg.attention_value_scale is not None else 1.0
        self.v_scale = 1.0 if b == "mi_v_scale_missing" else vs
        wq = wq.reshape(-1, H)
        if b == "scales_folded":
            wq, wv = wq * self.scale, wv * self.v_scale
            self.scale, self.v_scale = 1.0, 1.0
        self.w_qkv = _P(torch.cat((wq, wk.reshape(-1, H), wv), 0))
        self.w_o = _P(sd[p + "o_proj.weight"].float().t())
        self.sink = _P(sd[p + "sinks"]) if swa and b != "mi_sink_dropped" else None

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        q, k, v = F.linear(x, self.w_qkv).split((self.nh * self.hd, self.nkv * self.hd, self.nkv * self.vd), -1)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.vd).transpose(1, 2) * self.v_scale
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        hk = torch.arange(self.nh) // self.g
        k, v = k[:, hk], v[:, hk]
        if b == "sdpa_sink_rescale":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
            if self.sink is not None:
                s = (q @ k.transpose(-1, -2)) * self.scale
                lse = s.masked_fill(~allowed, float("-inf")).logsumexp(-1, keepdim=True)
                ctx = ctx * torch.sigmoid(lse - self.sink[None, :, None, None])
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            if self.sink is not None:
                s = torch.cat((s, self.sink[None, :, None, None].expand(B, -1, S, 1)), -1)
            pr = torch.softmax(s, -1)
            if self.sink is not None:
                pr = pr[..., :-1]
            ctx = pr @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.w_o
        _rec(self.pre.rstrip("."), out)
        return out


def _swiglu(x, w_gu, w_dn):
    up, gate = (x @ w_gu).chunk(2, -1)
    return (F.silu(gate) * up) @ w_dn


class DenseMLP(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.pre = p
        wg = sd[p + "gate_proj.weight"].float().t()
        wu = sd[p + "up_proj.weight"].float().t()
        self.w_gu = _P(torch.cat((wu, wg), 1))
        self.w_dn = _P(sd[p + "down_proj.weight"].float().t())

    def forward(self, x):
        out = _swiglu(x, self.w_gu, self.w_dn)
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.E, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.ng, self.tg = cfg.n_group, cfg.topk_group
        self.renorm = cfg.norm_topk_prob
        self.rsf = 1.0 if b == "mi_scaling_factor_dropped" else float(cfg.routed_scaling_factor or 1.0)
        self.w_r = _P(sd[p + "gate.weight"].float().t())
        self.e_bias = _P(sd[p + "gate.e_score_correction_bias"])
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        wg, wu = gu.chunk(2, 1)
        if b == "mi_experts_gate_up_swapped":
            wg, wu = wu, wg
        self.w_gu = _P(torch.cat((wu, wg), 1).transpose(1, 2))  # (E, H, 2I) [up | gate]
        self.w_dn = _P(sd[p + "experts.down_proj"].float().transpose(1, 2))  # (E, I, H)

    def route(self, t):
        b = _bug()
        logits = t @ self.w_r
        scores = torch.softmax(logits, -1) if b == "mi_router_softmax" else torch.sigmoid(logits)
        choice = scores + self.e_bias
        per = choice.view(-1, self.ng, self.E // self.ng)
        if b == "mi_group_score_max":
            gs = per.max(-1).values
        else:
            gs = per.topk(2, -1).values.sum(-1)
        keep_g = torch.zeros_like(gs).scatter(1, gs.topk(self.tg, -1).indices, 1.0).bool()
        keep_e = keep_g[:, :, None].expand_as(per).reshape(-1, self.E)
        idx = choice.masked_fill(~keep_e, float("-inf")).topk(self.k, -1).indices
        w = (choice if b == "mi_router_bias_in_weights" else scores).gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.rsf

    def forward(self, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        idx, w = self.route(t)
        if _bug() == "moe_dense_all_experts":
            dense = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)
            up, gate = torch.einsum("th,ehi->eti", t, self.w_gu).chunk(2, -1)
            y = torch.einsum("eti,eih->eth", F.silu(gate) * up, self.w_dn)
            out = torch.einsum("te,eth->th", dense, y)
        else:
            out = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel() == 0:
                    continue
                out.index_add_(0, tok, _swiglu(t[tok], self.w_gu[e], self.w_dn[e]) * w[tok, slot, None])
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


def _rope_table(cfg, kind):
    """(inv_freq, rot) for one layer type"""
    b = _bug()
    rps = cfg.rope_parameters
    rp = rps.get(kind) if isinstance(rps, dict) and kind in rps else rps
    if b == "mi_rope_single_theta" and "full_attention" in rps:
        rp = {**rp, "rope_theta": rps["full_attention"]["rope_theta"]}
    if rp.get("rope_type", "default") != "default":
        raise NotImplementedError(rp["rope_type"])
    prf = rp.get("partial_rotary_factor", 0.334)
    rot = cfg.head_dim if b == "mi_rope_partial_ignored" else int(cfg.head_dim * prf)
    inv = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    return inv, rot


class Block(nn.Module):
    def __init__(self, sd, cfg, i, rot):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.kind = cfg.layer_types[i]
        self.g1 = _P(sd[p + "input_layernorm.weight"])
        self.g2 = _P(sd[p + "post_attention_layernorm.weight"])
        self.attn = Attention(sd, p + "self_attn.", cfg, self.kind, rot)
        self.ffn = MoE(sd, p + "mlp.", cfg) if cfg.mlp_layer_types[i] == "sparse" else DenseMLP(sd, p + "mlp.")

    def forward(self, h, masks, tabs):
        cos, sin = tabs[self.kind]
        h = h + self.attn(_rms(h, self.g1, self.eps), masks[self.kind], cos, sin)
        h = h + self.ffn(_rms(h, self.g2, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class MiMoV2FlashPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        self.out = _P(head)
        self.g_out = _P(sd["model.norm.weight"])
        self.kinds = sorted(set(cfg.layer_types))
        self.inv = {}
        rots = {}
        for kind in self.kinds:
            self.inv[kind], rots[kind] = _rope_table(cfg, kind)
        self.blocks = nn.ModuleList(Block(sd, cfg, i, rots[cfg.layer_types[i]]) for i in range(cfg.num_hidden_layers))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        i = torch.arange(S)
        causal = (i[None, :] <= i[:, None])[None, None]
        W = self.cfg.sliding_window
        if b == "mi_window_off_by_one":
            band = (i[None, :] >= i[:, None] - W)[None, None]
        else:
            band = (i[None, :] > i[:, None] - W)[None, None]
        pad = keep[:, None, None, :]
        diag = torch.eye(S, dtype=torch.bool)[None, None]  # fully padded query rows keep themselves
        masks = {"full_attention": (causal & pad) | diag, "sliding_attention": causal & band}
        if b != "mi_swa_mask_ignores_padding":
            masks["sliding_attention"] = (masks["sliding_attention"] & pad) | diag
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        tabs = {}
        for kind in self.kinds:
            ang = pos[..., None].float() * self.inv[kind]
            tabs[kind] = (ang.cos(), ang.sin())
        for blk in self.blocks:
            h = blk(h, masks, tabs)
        h = _rms(h, self.g_out, self.cfg.rms_norm_eps)
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
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return MiMoV2FlashPort(state_dict, config).eval()
