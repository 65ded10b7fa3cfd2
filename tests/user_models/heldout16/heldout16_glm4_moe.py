"""Hand-written plain-PyTorch port of GLM-4.5 MoE (Glm4MoeForCausalLM).

Architecture as this port implements it:
  * token embedding (no scaling); separate output head unless config.tie_word_embeddings;
  * pre-norm blocks, RMSNorm with the gain used as-is (eps = config.rms_norm_eps):
        h = h + Attn(RMS_attn(h));  h = h + FFN(RMS_mlp(h))
  * attention: GQA, head_dim = hidden / heads (16), softmax scale head_dim**-0.5, biases on q/k/v
    (config.attention_bias) but never on o_proj;
  * optional per-head QK-norm (config.use_qk_norm, on here): RMSNorm over head_dim on q and k, applied BEFORE RoPE;
  * partial rotary: only the first rd = int(head_dim * rope_parameters["partial_rotary_factor"]) channels of each head
    are rotated (0.75 -> 12 of 16), in the half-split (rotate_half) form over that slice, i.e. pairs (i, i + rd/2),
    with inv_freq = theta^(-2i/rd); the remaining head_dim - rd channels pass through unchanged;
  * FFN: layers i < config.first_k_dense_replace use a dense SwiGLU MLP (intermediate_size); the others a MoE:
      - router logits = x @ W_r^T (no bias), scores = sigmoid(logits);
      - selection uses scores + e_score_correction_bias; groups: experts split into n_group contiguous groups,
        group score = sum of the 2 largest biased scores in the group, only the topk_group best groups stay eligible,
        then top num_experts_per_tok experts among the eligible ones;
      - combine weights are the UNBIASED sigmoid scores of the chosen experts, divided by their sum
        (+1e-20) when norm_topk_prob, then multiplied by routed_scaling_factor;
      - each expert is a SwiGLU MLP (moe_intermediate_size); the shared expert is one SwiGLU MLP of width
        moe_intermediate_size * n_shared_experts, added unweighted (no scaling factor);
  * padding: HF-style attention_mask masks keys (float32 min fill); positions from position_ids (0..S-1 default).

Weight layout of this port (own names, not the HF state-dict names):
  embed.table (V, H); final_ln.g (H,); unembed (H, V) = TRANSPOSED head (absent when tied);
  layers[i].ln_attn.g / ln_mlp.g (H,);
  layers[i].attn.wq (nh*hd, H), wk / wv (nkv*hd, H) as (out, in) with bq / bk / bv; wo (H, nh*hd);
  layers[i].attn.q_ln.g / k_ln.g (hd,);
  dense layers: layers[i].ffn.fc1 (2 I, H) = [gate rows ; up rows] fused, fc2 (H, I);
  MoE layers:   layers[i].moe.router_w (H, E) transposed router, layers[i].moe.router_bias (E,) correction bias,
                layers[i].moe.w_gate / w_up (E, H, I_moe) and w_down (E, I_moe, H): stacked experts stored
                input-major (x @ w), split out of HF's fused (E, 2 I_moe, H) gate_up tensor;
                layers[i].moe.shared.fc1 (2 I_s, H) / fc2 (H, I_s) in the dense-FFN layout.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "glm_rope_interleaved",  # GLM-4 dense template: rotary slice rotated as interleaved pairs (2i, 2i+1) instead of rotate_half pairs (i, i + rd/2)
    "glm_rope_full_head",  # partial_rotary_factor ignored: RoPE over all 16 head channels (inv_freq over 16) instead of the first 12
    "glm_partial_factor_attr_fallback",  # factor read as getattr(config, "partial_rotary_factor", 0.5): v5 stores it in rope_parameters (0.75), so 8 dims rotate
    "glm_rope_freq_base_head_dim",  # rotary slice right (12 dims) but inv_freq exponent divided by head_dim (16) instead of the rotary dim (12)
    "glm_qk_norm_after_rope",  # q_norm / k_norm applied after RoPE instead of before
    "glm_bias_in_topk_weights",  # combine weights gathered from scores + e_score_correction_bias instead of the raw sigmoid scores
    "glm_correction_bias_dropped",  # loader skips the e_score_correction_bias buffer (not a Parameter): selection on raw scores
    "glm_group_top1_score",  # DeepSeek-V2 template: group score = max expert score of the group instead of the sum of its top-2
    "glm_softmax_router",  # Mixtral / DeepSeek-V2 template: softmax over expert logits instead of sigmoid
    "glm_norm_topk_ignored",  # norm_topk_prob ignored: top-k weights not renormalised to sum 1 before the scaling factor
    "glm_scale_on_shared_too",  # routed_scaling_factor applied to (routed + shared) output instead of the routed part only
    "glm_gate_up_halves_swapped",  # loader splits experts.gate_up_proj (E, 2I, H) as [up ; gate] instead of [gate ; up]
    "glm_pad_mask_ignored",  # attention_mask never read (single-sequence port): causal mask only, real tokens attend to left pads
]
PADDING_ONLY = {"glm_pad_mask_ignored"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask; NaN rows of pad queries zeroed
    "moe_token_loop",  # sparse dispatch: per expert, gather its tokens, run it, index_add back (default: dense all-expert einsum)
    "rope_interleaved_permuted",  # rotary rows of q/k (weights, biases, q/k-norm gains) permuted at load to (2i, 2i+1) pairs; interleaved RoPE
    "routed_scale_folded",  # routed_scaling_factor folded into the experts' w_down at load instead of scaling the combine weights
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


def _head_dim(cfg):
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rotary_dim(cfg):
    b = _bug()
    hd = _head_dim(cfg)
    if b == "glm_rope_full_head":
        return hd
    if b == "glm_partial_factor_attr_fallback":
        f = getattr(cfg, "partial_rotary_factor", 0.5)
    else:
        f = (cfg.rope_parameters or {}).get("partial_rotary_factor", 1.0)
    return int(hd * f)


def _halves_to_pairs_rows(n_heads, hd, rd):
    """per head: rotary channel order (i, i + rd/2) -> (2i, 2i+1); pass-through channels keep their place"""
    idx = []
    for h in range(n_heads):
        per = []
        for i in range(rd // 2):
            per += [i, rd // 2 + i]
        per += list(range(rd, hd))
        idx += [h * hd + j for j in per]
    return torch.tensor(idx)


class RMS(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.g = _P(w)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.g


class PartialRope:
    def __init__(self, cfg):
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        self.hd = _head_dim(cfg)
        self.rd = _rotary_dim(cfg)
        denom = self.hd if _bug() == "glm_rope_freq_base_head_dim" else self.rd
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, self.rd, 2, dtype=torch.float) / denom))

    def angles(self, pos):
        return pos[..., None].float() * self.inv_freq  # (B, S, rd/2)

    def apply(self, x, ang):
        """x (B, heads, S, hd)"""
        b = _bug()
        rd = self.rd
        xr, xp = x[..., :rd], x[..., rd:]
        if b in ("glm_rope_interleaved", "rope_interleaved_permuted"):
            c = ang.repeat_interleave(2, -1).cos()[:, None]
            s = ang.repeat_interleave(2, -1).sin()[:, None]
            rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        else:
            c = torch.cat((ang, ang), -1).cos()[:, None]
            s = torch.cat((ang, ang), -1).sin()[:, None]
            rot = torch.cat((-xr[..., rd // 2 :], xr[..., : rd // 2]), -1)
        return torch.cat((xr * c + rot * s, xp), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)

        def get(n, default_len):
            w = sd[p + n + ".weight"].float()
            bias = sd.get(p + n + ".bias")
            return w, (bias.float() if bias is not None else torch.zeros(default_len))

        qw, qb = get("q_proj", self.nh * self.hd)
        kw, kb = get("k_proj", self.nkv * self.hd)
        vw, vb = get("v_proj", self.nkv * self.hd)
        self.qk_norm = cfg.use_qk_norm
        qn = sd[p + "q_norm.weight"].float() if self.qk_norm else None
        kn = sd[p + "k_norm.weight"].float() if self.qk_norm else None
        if b == "rope_interleaved_permuted":
            rd = _rotary_dim(cfg)
            pq, pk = _halves_to_pairs_rows(self.nh, self.hd, rd), _halves_to_pairs_rows(self.nkv, self.hd, rd)
            qw, qb, kw, kb = qw[pq], qb[pq], kw[pk], kb[pk]
            if self.qk_norm:
                ph = _halves_to_pairs_rows(1, self.hd, rd)
                qn, kn = qn[ph], kn[ph]
        self.wq, self.bq = _P(qw), _P(qb)
        self.wk, self.bk = _P(kw), _P(kb)
        self.wv, self.bv = _P(vw), _P(vb)
        self.wo = _P(sd[p + "o_proj.weight"])
        if self.qk_norm:
            self.q_ln = RMS(qn, cfg.rms_norm_eps)
            self.k_ln = RMS(kn, cfg.rms_norm_eps)

    def forward(self, x, allowed, rope, ang):
        b = _bug()
        B, S, _ = x.shape
        q = F.linear(x, self.wq, self.bq)
        k = F.linear(x, self.wk, self.bk)
        v = F.linear(x, self.wv, self.bv)
        if b != "rope_interleaved_permuted":
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, self.nh, self.hd)
        k = k.view(B, S, self.nkv, self.hd)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        late = b == "glm_qk_norm_after_rope"
        if self.qk_norm and not late:
            q, k = self.q_ln(q), self.k_ln(k)
        q, k = rope.apply(q.transpose(1, 2), ang), rope.apply(k.transpose(1, 2), ang)
        if self.qk_norm and late:
            q, k = self.q_ln(q), self.k_ln(k)
        g = self.nh // self.nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scale = self.hd**-0.5
        if b == "sdpa":
            ctx = torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale))
        else:
            sc = (q @ k.transpose(-1, -2)) * scale
            sc = sc.masked_fill(~allowed, torch.finfo(sc.dtype).min)
            ctx = torch.softmax(sc, -1) @ v
        out = F.linear(ctx.transpose(1, 2).reshape(B, S, self.nh * self.hd), self.wo)
        _rec(self.pre + "o_proj", out)
        return out


class DenseFFN(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.fc1 = _P(torch.cat((sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]), 0))
        self.fc2 = _P(sd[p + "down_proj.weight"])
        self.pre = p

    def forward(self, x):
        gate, up = F.linear(x, self.fc1).chunk(2, -1)
        out = F.linear(F.silu(gate) * up, self.fc2)
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.E = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk = cfg.norm_topk_prob
        self.rsf = float(cfg.routed_scaling_factor)
        self.router_w = _P(sd[p + "gate.weight"].float().t())
        corr = sd.get(p + "gate.e_score_correction_bias")
        if corr is None or b == "glm_correction_bias_dropped":
            corr = torch.zeros(self.E)
        self.router_bias = _P(corr)
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        gate, up = gu.chunk(2, 1)
        if b == "glm_gate_up_halves_swapped":
            gate, up = up, gate
        self.w_gate = _P(gate.transpose(1, 2))
        self.w_up = _P(up.transpose(1, 2))
        down = sd[p + "experts.down_proj"].float().transpose(1, 2)  # (E, I, H)
        self.fold = b == "routed_scale_folded"
        self.w_down = _P(down * self.rsf if self.fold else down)
        self.shared = DenseFFN(sd, p + "shared_experts.")

    def route(self, x):
        b = _bug()
        T = x.shape[0]
        logits = x @ self.router_w
        _rec(self.pre + "gate", logits)
        scores = torch.softmax(logits, -1) if b == "glm_softmax_router" else torch.sigmoid(logits)
        choice = scores + self.router_bias
        grp = choice.view(T, self.n_group, self.E // self.n_group)
        if b == "glm_group_top1_score":
            gscore = grp.max(-1).values
        else:
            gscore = grp.topk(2, -1).values.sum(-1)
        gidx = gscore.topk(self.topk_group, -1).indices
        gmask = torch.zeros(T, self.n_group, dtype=torch.bool).scatter(1, gidx, True)
        eligible = gmask.repeat_interleave(self.E // self.n_group, 1)
        idx = choice.masked_fill(~eligible, float("-inf")).topk(self.top_k, -1).indices
        w = (choice if b == "glm_bias_in_topk_weights" else scores).gather(1, idx)
        if self.norm_topk and b != "glm_norm_topk_ignored":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if not self.fold and b != "glm_scale_on_shared_too":
            w = w * self.rsf
        return idx, w

    def forward(self, x):
        B, S, H = x.shape
        b = _bug()
        t = x.reshape(-1, H)
        idx, w = self.route(t)
        if b == "moe_token_loop":
            routed = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                xe = t[tok]
                ye = (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
                routed.index_add_(0, tok, ye * w[tok, slot, None])
        else:
            comb = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)
            hg = torch.einsum("th,ehi->tei", t, self.w_gate)
            hu = torch.einsum("th,ehi->tei", t, self.w_up)
            ye = torch.einsum("tei,eih->teh", F.silu(hg) * hu, self.w_down)
            routed = torch.einsum("te,teh->th", comb, ye)
        routed = routed.view(B, S, H)
        _rec(self.pre + "experts", routed)
        out = routed + self.shared(x)
        if b == "glm_scale_on_shared_too":
            out = out * self.rsf
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.ln_attn = RMS(sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = Attention(sd, p + "self_attn.", cfg)
        self.ln_mlp = RMS(sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if i < cfg.first_k_dense_replace:
            self.ffn = DenseFFN(sd, p + "mlp.")
        else:
            self.moe = MoE(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, rope, ang):
        n = self.ln_attn(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attn(n, allowed, rope, ang)
        n = self.ln_mlp(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + (self.ffn(n) if hasattr(self, "ffn") else self.moe(n))
        _rec(self.pre.rstrip("."), h)
        return h


class Glm4MoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Module()
        self.embed.table = _P(sd["model.embed_tokens.weight"])
        if not cfg.tie_word_embeddings:
            self.unembed = _P(sd["lm_head.weight"].float().t())
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_ln = RMS(sd["model.norm.weight"], cfg.rms_norm_eps)
        self.rope = PartialRope(cfg)

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        if _bug() == "glm_pad_mask_ignored":
            allowed = causal[None, None].expand(input_ids.shape[0], 1, S, S)
        else:
            allowed = causal[None, None] & keep[:, None, None, :]
        h = self.embed.table[input_ids]
        _rec("model.embed_tokens", h)
        ang = self.rope.angles(pos)
        for layer in self.layers:
            h = layer(h, allowed, self.rope, ang)
        h = self.final_ln(h)
        _rec("model.norm", h)
        logits = h @ self.unembed if hasattr(self, "unembed") else h @ self.embed.table.t()
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
    return Glm4MoePort(state_dict, config).eval()
