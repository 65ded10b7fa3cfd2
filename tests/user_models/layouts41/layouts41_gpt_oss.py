"""Hand-written plain-PyTorch port of OpenAI gpt-oss (GptOssForCausalLM): attention with learned sinks, alternating
sliding-window / full layers, YaRN RoPE and a top-k mixture of clamped-SwiGLU experts with biases.

Architecture as this port implements it:
- token embedding (no scaling); untied LM head; RMSNorm rms(x) * w (eps = config.rms_norm_eps).
- block i (pre-norm): h = h + Attn(norm1(h)); h = h + MoE(norm2(h)).
- attention: q/k/v/o with biases; RoPE on the whole head_dim in half-split pairs (i, i + hd/2) with YaRN
  inverse frequencies (NTK-by-parts ramp between beta_fast and beta_slow over original_max_position_embeddings,
  truncate flag honoured) and cos/sin multiplied by the YaRN attention factor 0.1 ln(factor) + 1; GQA (kv head j
  serves query heads j*G .. j*G+G-1); scores q k^T / sqrt(hd), causal, key padding masked, and on
  "sliding_attention" layers only keys with index > query index - sliding_window; one learned sink logit per
  head joins each row's softmax and is dropped after it (probabilities of real keys sum to < 1).
- MoE: router logits = x Wr^T + br; the top-k logits per token, softmax over those k; expert e:
  [gate, up] = x Wgu_e + bgu_e with gate / up INTERLEAVED in Transformers' (E, H, 2I) tensor (gate = [..., ::2],
  up = [..., 1::2]); gate clamped above at limit, up clamped to [-limit, limit]; glu = gate * sigmoid(alpha gate);
  y_e = ((up + 1) * glu) Wd_e + bd_e (Wd: (E, I, H)); output = sum over the chosen experts of weight * y_e.
- positions: position_ids, else 0..T-1 (some variants derive them from the attention mask).

Layout of the baseline (BUG == ""), own names:
- emb (V, H); head_t (H, V) transposed; norm gains n1 / n2 / final_g.
- attention: w_q_t / w_k_t / w_v_t / w_o_t transposed (in, out) applied as x @ W, biases b_q / b_k / b_v / b_o,
  sinks; explicit softmax over [scores | sink] with an additive finfo.min mask.
- MoE: router_t (H, E) transposed + router_b; experts' gate/up DE-INTERLEAVED at load into w_gate (E, H, I) and
  w_up (E, H, I) with b_gate / b_up; w_down (E, I, H), b_down; every expert computed for every token (einsum)
  and combined with a dense (N, E) weight matrix scattered from the top-k softmax.
- YaRN frequencies and attention factor computed by this file.

Variants (CLEAN, each a correct port):
- oss_openai_reference: OpenAI's reference layout (gpt_oss/torch/model.py): norms owned by the attention / MLP
  blocks (residual inside), fused qkv Linear (q | k | v, with bias), sinks reshaped (n_kv, q_mult), attention as
  einsum over (tokens, kv heads, q_mult, hd) with a -inf triu / tril(-window) mask; mlp1_weight (E, 2I, H)
  interleaved (out, in), mlp1_bias, mlp2_weight (E, H, I), mlp2_bias; per-token gather of the chosen experts'
  weights (mlp1_weight[expert_indices]) with einsum.
- oss_sorted_dispatch: experts' gate/up fused as concatenated halves [gate | up] (E, H, 2I); (token, slot) pairs
  sorted by expert (argsort), one matmul per contiguous expert segment, weighted index_add back.
- oss_sink_lse_sdpa: attention by F.scaled_dot_product_attention (boolean causal/window/padding mask, padding rows
  keep their diagonal, enable_gqa), the sink applied afterwards as a rescale out * sigmoid(lse - sink) with the
  row log-sum-exp of the masked scores.
- oss_heads_einsum_complex_rope: heads as a weight axis (wq (nh, hd, H), bq (nh, hd), ...) with einsum; Meta-style
  q/k row (and bias) permutation to interleaved pairs; RoPE as complex multiplication with a freqs_cis buffer
  (attention factor folded into its modulus).
- oss_folded: the attention scale 1/sqrt(hd) and the YaRN attention factor squared (q and k both carry it) folded
  into q's weight and bias (rope tables unscaled); norm1 folded into q/k/v, norm2 into the router and the experts'
  gate/up, the final norm into the head.
- oss_stacked_functional: every weight stacked over layers ((L, ...), experts (L, E, ...)) in an nn.ParameterDict
  read by one functional forward; cos/sin tables for all max_position_embeddings positions as buffers.
- oss_bool_mask_fullsoftmax_router: router as softmax over all experts, top-k, renormalised (exactly the top-k
  softmax); experts with Transformers' interleaved gate/up transposed to (E, 2I, H) and run densely with bmm over
  (E, N, H); boolean masks applied with torch.where; the sink as an extra key column with a zero value row.
- oss_grouped_qkv_backbone: q/k/v fused Falcon/NeoX-style grouped per kv head [q heads of the group | k | v]
  (weight and bias); per-layer nn.ModuleDict; positions from the attention mask; a backbone returning the last
  normed hidden states and a separate LM-head module.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = []
PADDING_ONLY = []
CLEAN = [
    "oss_openai_reference",  # OpenAI reference: fused qkv, mlp1 (E, 2I, H) interleaved, per-token expert gather
    "oss_sorted_dispatch",  # gate/up as [gate | up] halves, argsort-by-expert segments + index_add
    "oss_sink_lse_sdpa",  # SDPA (bool mask, enable_gqa) then the sink as a sigmoid(lse - sink) rescale
    "oss_heads_einsum_complex_rope",  # heads weight axis, Meta q/k permutation (+ biases), complex RoPE buffer
    "oss_folded",  # scale * mscale^2 folded into q, norms folded into q/k/v, router, experts, head
    "oss_stacked_functional",  # all weights stacked (L, ...) in a ParameterDict, functional forward, cos/sin buffers
    "oss_bool_mask_fullsoftmax_router",  # full softmax router + renorm, bmm experts (E, 2I, H), sink as a zero-value key
    "oss_grouped_qkv_backbone",  # qkv grouped per kv head, ModuleDict layers, mask positions, backbone + head
]


# ----------------------------------------------------------------------------------------------- helpers
def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _yarn(config):
    """(inv_freq (hd/2,), attention factor) of YaRN as configured, else plain RoPE with factor 1."""
    rp = dict(config.rope_parameters)
    hd = config.head_dim
    base = rp["rope_theta"]
    pos_freqs = base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)
    if rp.get("rope_type", "default") != "yarn":
        return 1.0 / pos_freqs, 1.0
    factor = rp.get("factor") or config.max_position_embeddings / rp["original_max_position_embeddings"]
    orig = rp["original_max_position_embeddings"]

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    att = rp.get("attention_factor")
    if att is None:
        if rp.get("mscale") and rp.get("mscale_all_dim"):
            att = mscale(factor, rp["mscale"]) / mscale(factor, rp["mscale_all_dim"])
        else:
            att = mscale(factor)
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr_dim(rot):
        return hd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(fast), corr_dim(slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(hd // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extra = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(att)


def _rope_half(x, cos, sin):
    a, b = x.chunk(2, -1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)


def _allowed(mask, T, window, device, keep_diag=False):
    """(B|1, 1, T, T) bool: causal, key padding, and the sliding window (key > query - window)."""
    i = torch.arange(T, device=device)
    ok = i[None, :] <= i[:, None]
    if window:
        ok = ok & (i[None, :] > i[:, None] - window)
    ok = ok[None, None]
    if mask is not None:
        ok = ok & mask.bool()[:, None, None, :]
        if keep_diag:
            ok = ok | torch.eye(T, dtype=torch.bool, device=device)
    return ok


def _additive(ok):
    return torch.zeros(ok.shape, device=ok.device).masked_fill(~ok, torch.finfo(torch.float32).min)


def _swiglu(gate, up, alpha, limit):
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _sink_attend(q, k, v, add_mask, sinks, scale):
    """explicit softmax over [scores | sink]; q (B, nh, T, hd), k/v (B, nkv, T, hd)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale + add_mask
    s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)], -1)
    p = (s - s.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
    return p @ v


class _Dims:
    def __init__(self, c):
        self.H, self.nh, self.nkv, self.hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.G = self.nh // self.nkv
        self.E, self.k, self.I = c.num_local_experts, c.num_experts_per_tok, c.intermediate_size
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit
        self.eps = c.rms_norm_eps
        self.L = c.num_hidden_layers
        self.windows = [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types]
        self.max_pos = c.max_position_embeddings


# ------------------------------------------------------------------------------------------- attention
def _meta_perm(hd):
    idx = []
    for i in range(hd // 2):
        idx += [i, i + hd // 2]
    return torch.tensor(idx)


class Attention(nn.Module):
    def __init__(self, sd, pre, d, variant, window, att_factor, fold=None):
        super().__init__()
        self.d, self.variant, self.window = d, variant, window
        W = lambda n: sd[pre + n].float()  # noqa: E731
        wq, wk, wv, wo = (W(f"{n}_proj.weight") for n in "qkvo")
        bq, bk, bv, bo = (W(f"{n}_proj.bias") for n in "qkvo")
        self.sinks = _p(W("sinks"))
        self.scale = d.hd**-0.5
        if variant == "oss_heads_einsum_complex_rope":
            perm = _meta_perm(d.hd)
            self.wq = _p(wq.view(d.nh, d.hd, d.H)[:, perm])
            self.bq = _p(bq.view(d.nh, d.hd)[:, perm])
            self.wk = _p(wk.view(d.nkv, d.hd, d.H)[:, perm])
            self.bk = _p(bk.view(d.nkv, d.hd)[:, perm])
            self.wv, self.bv = _p(wv.view(d.nkv, d.hd, d.H)), _p(bv.view(d.nkv, d.hd))
            self.wo, self.bo = _p(wo.view(d.H, d.nh, d.hd)), _p(bo)
            return
        if variant == "oss_grouped_qkv_backbone":
            rows, bias = [], []
            for j in range(d.nkv):
                qs = slice(j * d.G * d.hd, (j + 1) * d.G * d.hd)
                ks = slice(j * d.hd, (j + 1) * d.hd)
                rows += [wq[qs], wk[ks], wv[ks]]
                bias += [bq[qs], bk[ks], bv[ks]]
            self.qkv_w, self.qkv_b = _p(torch.cat(rows)), _p(torch.cat(bias))
            self.o_w, self.o_b = _p(wo), _p(bo)
            return
        if variant == "oss_bool_mask_fullsoftmax_router":
            self.w_qkv, self.b_qkv = _p(torch.cat([wq, wk, wv])), _p(torch.cat([bq, bk, bv]))
            self.w_o, self.b_o = _p(wo), _p(bo)
            return
        if fold is not None:
            wq, wk, wv = wq * fold, wk * fold, wv * fold
            c = self.scale * att_factor**2
            wq, bq = wq * c, bq * c
            self.scale = 1.0
        self.w_q_t, self.w_k_t, self.w_v_t, self.w_o_t = (_p(w.t()) for w in (wq, wk, wv, wo))
        self.b_q, self.b_k, self.b_v, self.b_o = (_p(b) for b in (bq, bk, bv, bo))

    def forward(self, x, rope, mask):
        d, V = self.d, self.variant
        B, T, _ = x.shape
        if V == "oss_heads_einsum_complex_rope":
            q = torch.einsum("bth,ndh->bntd", x, self.wq) + self.bq[None, :, None]
            k = torch.einsum("bth,ndh->bntd", x, self.wk) + self.bk[None, :, None]
            v = torch.einsum("bth,ndh->bntd", x, self.wv) + self.bv[None, :, None]
            fc = rope[:, None]

            def rot(t):
                return torch.view_as_real(
                    torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) * fc
                ).flatten(-2)

            o = _sink_attend(
                rot(q), rot(k), v, _additive(_allowed(mask, T, self.window, x.device)), self.sinks, self.scale
            )
            return torch.einsum("bntd,hnd->bth", o, self.wo) + self.bo
        cos, sin = rope
        if V == "oss_grouped_qkv_backbone":
            g = F.linear(x, self.qkv_w, self.qkv_b).view(B, T, d.nkv, d.G + 2, d.hd)
            q = g[:, :, :, : d.G].reshape(B, T, d.nh, d.hd).transpose(1, 2)
            k, v = g[:, :, :, d.G].transpose(1, 2), g[:, :, :, d.G + 1].transpose(1, 2)
        elif V == "oss_bool_mask_fullsoftmax_router":
            q, k, v = F.linear(x, self.w_qkv, self.b_qkv).split([d.nh * d.hd, d.nkv * d.hd, d.nkv * d.hd], -1)
            q, k, v = (t.view(B, T, -1, d.hd).transpose(1, 2) for t in (q, k, v))
        else:
            q = (x @ self.w_q_t + self.b_q).view(B, T, d.nh, d.hd).transpose(1, 2)
            k = (x @ self.w_k_t + self.b_k).view(B, T, d.nkv, d.hd).transpose(1, 2)
            v = (x @ self.w_v_t + self.b_v).view(B, T, d.nkv, d.hd).transpose(1, 2)
        q, k = _rope_half(q, cos, sin), _rope_half(k, cos, sin)
        if V == "oss_sink_lse_sdpa":
            ok = _allowed(mask, T, self.window, x.device, keep_diag=True)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=ok, enable_gqa=True)
            kk = k.repeat_interleave(d.G, 1)
            s = ((q @ kk.transpose(-1, -2)) * self.scale).masked_fill(~ok, float("-inf"))
            lse = torch.logsumexp(s, -1, keepdim=True)
            o = o * torch.sigmoid(lse - self.sinks.view(1, -1, 1, 1))
        elif V == "oss_bool_mask_fullsoftmax_router":
            ok = _allowed(mask, T, self.window, x.device)
            kk, vv = k.repeat_interleave(d.G, 1), v.repeat_interleave(d.G, 1)
            s = torch.where(ok, (q @ kk.transpose(-1, -2)) * self.scale, torch.tensor(float("-inf")))
            s = torch.cat([s, self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)], -1)  # sink key column
            vv = torch.cat([vv, vv.new_zeros(B, d.nh, 1, d.hd)], 2)  # its value row is zero
            o = s.softmax(-1) @ vv
        else:
            o = _sink_attend(q, k, v, _additive(_allowed(mask, T, self.window, x.device)), self.sinks, self.scale)
        o = o.transpose(1, 2).reshape(B, T, -1)
        if V == "oss_grouped_qkv_backbone":
            return F.linear(o, self.o_w, self.o_b)
        if V == "oss_bool_mask_fullsoftmax_router":
            return F.linear(o, self.w_o, self.b_o)
        return o @ self.w_o_t + self.b_o


# -------------------------------------------------------------------------------------------------- MoE
class MoE(nn.Module):
    def __init__(self, sd, pre, d, variant, fold=None):
        super().__init__()
        self.d, self.variant = d, variant
        W = lambda n: sd[pre + n].float()  # noqa: E731
        rw, rb = W("router.weight"), W("router.bias")
        gu, gub = W("experts.gate_up_proj"), W("experts.gate_up_proj_bias")  # (E, H, 2I) interleaved
        dw, db = W("experts.down_proj"), W("experts.down_proj_bias")  # (E, I, H)
        if fold is not None:
            rw = rw * fold
            gu = gu * fold[None, :, None]
        if variant == "oss_bool_mask_fullsoftmax_router":
            self.router_w, self.router_b = _p(rw), _p(rb)
            self.w_gu_oi, self.b_gu = _p(gu.transpose(1, 2)), _p(gub)  # (E, 2I, H), still interleaved
            self.w_down_oi, self.b_down = _p(dw.transpose(1, 2)), _p(db)  # (E, H, I)
            return
        if variant == "oss_sorted_dispatch":
            self.router_t, self.router_b = _p(rw.t()), _p(rb)
            self.w13 = _p(torch.cat([gu[..., ::2], gu[..., 1::2]], -1))  # (E, H, 2I) = [gate | up]
            self.b13 = _p(torch.cat([gub[..., ::2], gub[..., 1::2]], -1))
            self.w2, self.b2 = _p(dw), _p(db)
            return
        self.router_t, self.router_b = _p(rw.t()), _p(rb)
        self.w_gate, self.w_up = _p(gu[..., ::2]), _p(gu[..., 1::2])
        self.b_gate, self.b_up = _p(gub[..., ::2]), _p(gub[..., 1::2])
        self.w_down, self.b_down = _p(dw), _p(db)

    def forward(self, x):
        d, V = self.d, self.variant
        shape = x.shape
        x = x.reshape(-1, d.H)
        N = x.shape[0]
        if V == "oss_bool_mask_fullsoftmax_router":
            probs = F.linear(x, self.router_w, self.router_b).softmax(-1)
            top_p, top_i = probs.topk(d.k, -1)
            top_w = top_p / top_p.sum(-1, keepdim=True)
            xe = x[None].expand(d.E, N, d.H)
            gu = torch.bmm(xe, self.w_gu_oi.transpose(1, 2)) + self.b_gu[:, None]  # (E, N, 2I)
            y = torch.bmm(_swiglu(gu[..., ::2], gu[..., 1::2], d.alpha, d.limit), self.w_down_oi.transpose(1, 2))
            y = y + self.b_down[:, None]  # (E, N, H)
            comb = torch.zeros(N, d.E, dtype=x.dtype, device=x.device).scatter(1, top_i, top_w)
            return torch.einsum("enh,ne->nh", y, comb).view(shape)
        logits = x @ self.router_t + self.router_b
        top_v, top_i = logits.topk(d.k, -1)
        top_w = top_v.softmax(-1)
        if V == "oss_sorted_dispatch":
            flat_e = top_i.reshape(-1)
            order = flat_e.argsort(stable=True)
            tok = order // d.k
            counts = torch.bincount(flat_e, minlength=d.E).tolist()
            out = torch.zeros_like(x)
            start = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                sel = order[start : start + n]
                t = tok[start : start + n]
                h13 = x[t] @ self.w13[e] + self.b13[e]
                g, u = h13.chunk(2, -1)
                y = _swiglu(g, u, d.alpha, d.limit) @ self.w2[e] + self.b2[e]
                out.index_add_(0, t, y * top_w.reshape(-1)[sel, None])
                start += n
            return out.view(shape)
        # baseline / others: every expert on every token, combined with a dense (N, E) weight matrix
        g = torch.einsum("nh,ehi->eni", x, self.w_gate) + self.b_gate[:, None]
        u = torch.einsum("nh,ehi->eni", x, self.w_up) + self.b_up[:, None]
        y = torch.einsum("eni,eih->enh", _swiglu(g, u, d.alpha, d.limit), self.w_down) + self.b_down[:, None]
        comb = torch.zeros(N, d.E, dtype=x.dtype, device=x.device).scatter(1, top_i, top_w)
        return torch.einsum("enh,ne->nh", y, comb).view(shape)


class Block(nn.Module):
    def __init__(self, sd, i, d, variant, att_factor):
        super().__init__()
        pre = f"model.layers.{i}."
        self.d, self.variant = d, variant
        g1, g2 = sd[pre + "input_layernorm.weight"].float(), sd[pre + "post_attention_layernorm.weight"].float()
        folded = variant == "oss_folded"
        attn = Attention(sd, pre + "self_attn.", d, variant, d.windows[i], att_factor, fold=g1 if folded else None)
        moe = MoE(sd, pre + "mlp.", d, variant, fold=g2 if folded else None)
        if variant == "oss_grouped_qkv_backbone":
            self.parts = nn.ModuleDict({"attn": attn, "moe": moe})
        else:
            self.attn, self.moe = attn, moe
        if not folded:
            self.n1, self.n2 = _p(g1), _p(g2)

    def forward(self, h, rope, mask):
        attn = self.parts["attn"] if self.variant == "oss_grouped_qkv_backbone" else self.attn
        moe = self.parts["moe"] if self.variant == "oss_grouped_qkv_backbone" else self.moe
        if self.variant == "oss_folded":
            h = h + attn(_rms(h, self.d.eps), rope, mask)
            return h + moe(_rms(h, self.d.eps))
        h = h + attn(_rms(h, self.d.eps) * self.n1, rope, mask)
        return h + moe(_rms(h, self.d.eps) * self.n2)


class GptOssPort(nn.Module):
    def __init__(self, sd, config, variant):
        super().__init__()
        d = self.d = _Dims(config)
        self.variant = variant
        inv, att = _yarn(config)
        self.att_factor = att
        self.emb = _p(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([Block(sd, i, d, variant, att) for i in range(d.L)])
        gf, head = sd["model.norm.weight"].float(), sd["lm_head.weight"].float()
        if variant == "oss_folded":
            head = head * gf
        else:
            self.final_g = _p(gf)
        if variant != "oss_grouped_qkv_backbone":
            self.head_t = _p(head.t())
        self.register_buffer("inv_freq", inv, persistent=False)
        if variant == "oss_heads_einsum_complex_rope":
            ang = torch.arange(d.max_pos, dtype=torch.float)[:, None] * inv
            self.register_buffer("freqs_cis", torch.polar(torch.full_like(ang, att), ang), persistent=False)

    def _rope(self, pos):
        if self.variant == "oss_heads_einsum_complex_rope":
            return self.freqs_cis[pos]
        ang = pos[..., None].float() * self.inv_freq
        if self.variant == "oss_folded":  # the attention factor lives in q's weight
            return ang.cos()[:, None], ang.sin()[:, None]
        return (ang.cos() * self.att_factor)[:, None], (ang.sin() * self.att_factor)[:, None]

    def hidden(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            if self.variant == "oss_grouped_qkv_backbone" and attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        rope = self._rope(position_ids)
        h = F.embedding(input_ids, self.emb)
        for blk in self.blocks:
            h = blk(h, rope, attention_mask)
        h = _rms(h, self.d.eps)
        return h if self.variant == "oss_folded" else h * self.final_g

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return (self.hidden(input_ids, attention_mask, position_ids) @ self.head_t).float()


class LMHead(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = _p(w)

    def forward(self, h):
        return F.linear(h, self.weight)


class GptOssWithHead(nn.Module):
    def __init__(self, sd, config, variant):
        super().__init__()
        self.backbone = GptOssPort(sd, config, variant)
        self.lm_head = LMHead(sd["lm_head.weight"].float())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.lm_head(self.backbone.hidden(input_ids, attention_mask, position_ids)).float()


# ---------------------------------------------------------------- OpenAI reference layout (oss_openai_reference)
class OAIAttentionBlock(nn.Module):
    def __init__(self, sd, pre, d, window):
        super().__init__()
        self.d, self.window = d, window
        W = lambda n: sd[pre + n].float()  # noqa: E731
        self.norm_scale = _p(W("input_layernorm.weight"))
        self.qkv = nn.Linear(d.H, (d.nh + 2 * d.nkv) * d.hd)
        self.qkv.weight = _p(torch.cat([W(f"self_attn.{n}_proj.weight") for n in "qkv"]))
        self.qkv.bias = _p(torch.cat([W(f"self_attn.{n}_proj.bias") for n in "qkv"]))
        self.out = nn.Linear(d.nh * d.hd, d.H)
        self.out.weight, self.out.bias = _p(W("self_attn.o_proj.weight")), _p(W("self_attn.o_proj.bias"))
        self.sinks = _p(W("self_attn.sinks"))
        self.sm_scale = 1 / math.sqrt(d.hd)

    def forward(self, x, cos, sin, mask):
        d = self.d
        B, T, _ = x.shape
        t = _rms(x, d.eps) * self.norm_scale
        qkv = self.qkv(t)
        q = qkv[..., : d.nh * d.hd].view(B, T, d.nkv, d.G, d.hd)
        k = qkv[..., d.nh * d.hd : (d.nh + d.nkv) * d.hd].view(B, T, d.nkv, d.hd)
        v = qkv[..., (d.nh + d.nkv) * d.hd :].view(B, T, d.nkv, d.hd)
        q = _rope_half(q, cos[:, :, None, None], sin[:, :, None, None])
        k = _rope_half(k, cos[:, :, None], sin[:, :, None])
        m = torch.triu(x.new_full((T, T), -float("inf")), diagonal=1)
        if self.window:
            m = m + torch.tril(x.new_full((T, T), -float("inf")), diagonal=-self.window)
        m = m[None, None, None]
        if mask is not None:
            m = m + torch.zeros(mask.shape, dtype=x.dtype).masked_fill(mask == 0, -float("inf"))[:, None, None, None, :]
        qk = torch.einsum("bqhmd,bkhd->bhmqk", q, k) * self.sm_scale + m
        S = self.sinks.reshape(d.nkv, d.G, 1, 1).expand(B, -1, -1, T, 1)
        w = torch.cat([qk, S], -1).softmax(-1)[..., :-1]
        attn = torch.einsum("bhmqk,bkhd->bqhmd", w, v).reshape(B, T, -1)
        return x + self.out(attn)


class OAIMLPBlock(nn.Module):
    def __init__(self, sd, pre, d):
        super().__init__()
        self.d = d
        W = lambda n: sd[pre + n].float()  # noqa: E731
        self.norm_scale = _p(W("post_attention_layernorm.weight"))
        self.gate = nn.Linear(d.H, d.E)
        self.gate.weight, self.gate.bias = _p(W("mlp.router.weight")), _p(W("mlp.router.bias"))
        self.mlp1_weight = _p(W("mlp.experts.gate_up_proj").transpose(1, 2))  # (E, 2I, H), interleaved rows
        self.mlp1_bias = _p(W("mlp.experts.gate_up_proj_bias"))
        self.mlp2_weight = _p(W("mlp.experts.down_proj").transpose(1, 2))  # (E, H, I)
        self.mlp2_bias = _p(W("mlp.experts.down_proj_bias"))

    def forward(self, x):
        d = self.d
        t = _rms(x, d.eps) * self.norm_scale
        g = self.gate(t)
        experts = torch.topk(g, k=d.k, dim=-1, sorted=True)
        ew = F.softmax(experts.values, dim=-1)
        ei = experts.indices
        t = torch.einsum("btech,bth->btec", self.mlp1_weight[ei], t) + self.mlp1_bias[ei]
        t = _swiglu(t[..., ::2], t[..., 1::2], d.alpha, d.limit)
        t = torch.einsum("btehc,btec->bteh", self.mlp2_weight[ei], t) + self.mlp2_bias[ei]
        return x + torch.einsum("bteh,bte->bth", t, ew)


class OAITransformer(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        d = self.d = _Dims(config)
        inv, self.concentration = _yarn(config)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.embedding = nn.Embedding(config.vocab_size, d.H)
        self.embedding.weight = _p(sd["model.embed_tokens.weight"])
        self.block = nn.ModuleList()
        for i in range(d.L):
            pre = f"model.layers.{i}."
            self.block.append(nn.ModuleList([OAIAttentionBlock(sd, pre, d, d.windows[i]), OAIMLPBlock(sd, pre, d)]))
        self.norm_scale = _p(sd["model.norm.weight"])
        self.unembedding = nn.Linear(d.H, config.vocab_size, bias=False)
        self.unembedding.weight = _p(sd["lm_head.weight"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        pos = position_ids if position_ids is not None else torch.arange(T)[None].expand(B, T)
        freqs = pos[..., None].float() * self.inv_freq
        cos, sin = freqs.cos() * self.concentration, freqs.sin() * self.concentration
        x = self.embedding(input_ids)
        for attn, mlp in self.block:
            x = mlp(attn(x, cos, sin, attention_mask))
        return self.unembedding(_rms(x, self.d.eps) * self.norm_scale).float()


# --------------------------------------------------------------------------- stacked functional variant
def _stack(sd, d):
    L = lambda i, n: sd[f"model.layers.{i}.{n}"].float()  # noqa: E731
    S = lambda n, f=lambda t: t: torch.stack([f(L(i, n)) for i in range(d.L)])  # noqa: E731
    return {
        "emb": sd["model.embed_tokens.weight"].float(),
        "head": sd["lm_head.weight"].float(),
        "norm_f": sd["model.norm.weight"].float(),
        "norm_1": S("input_layernorm.weight"),
        "norm_2": S("post_attention_layernorm.weight"),
        "wq": S("self_attn.q_proj.weight"),
        "bq": S("self_attn.q_proj.bias"),
        "wk": S("self_attn.k_proj.weight"),
        "bk": S("self_attn.k_proj.bias"),
        "wv": S("self_attn.v_proj.weight"),
        "bv": S("self_attn.v_proj.bias"),
        "wo": S("self_attn.o_proj.weight"),
        "bo": S("self_attn.o_proj.bias"),
        "sinks": S("self_attn.sinks"),
        "router_w": S("mlp.router.weight"),
        "router_b": S("mlp.router.bias"),
        "gate_up": S("mlp.experts.gate_up_proj"),
        "gate_up_b": S("mlp.experts.gate_up_proj_bias"),
        "down": S("mlp.experts.down_proj"),
        "down_b": S("mlp.experts.down_proj_bias"),
    }


def _functional(W, d, cos_t, sin_t, ids, attention_mask, position_ids):
    B, T = ids.shape
    pos = position_ids if position_ids is not None else torch.arange(T, device=ids.device)[None].expand(B, T)
    cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]
    h = W["emb"][ids]
    for i in range(d.L):
        x = _rms(h, d.eps) * W["norm_1"][i]
        q = F.linear(x, W["wq"][i], W["bq"][i]).view(B, T, d.nh, d.hd).transpose(1, 2)
        k = F.linear(x, W["wk"][i], W["bk"][i]).view(B, T, d.nkv, d.hd).transpose(1, 2)
        v = F.linear(x, W["wv"][i], W["bv"][i]).view(B, T, d.nkv, d.hd).transpose(1, 2)
        q, k = _rope_half(q, cos, sin), _rope_half(k, cos, sin)
        add = _additive(_allowed(attention_mask, T, d.windows[i], ids.device))
        o = _sink_attend(q, k, v, add, W["sinks"][i], d.hd**-0.5)
        h = h + F.linear(o.transpose(1, 2).reshape(B, T, -1), W["wo"][i], W["bo"][i])
        x = (_rms(h, d.eps) * W["norm_2"][i]).reshape(-1, d.H)
        top_v, top_i = F.linear(x, W["router_w"][i], W["router_b"][i]).topk(d.k, -1)
        top_w = top_v.softmax(-1)
        out = torch.zeros_like(x)
        for e in range(d.E):
            tok, slot = (top_i == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gu = x[tok] @ W["gate_up"][i, e] + W["gate_up_b"][i, e]
            y = _swiglu(gu[:, ::2], gu[:, 1::2], d.alpha, d.limit) @ W["down"][i, e] + W["down_b"][i, e]
            out.index_add_(0, tok, y * top_w[tok, slot, None])
        h = h + out.view(B, T, d.H)
    return F.linear(_rms(h, d.eps) * W["norm_f"], W["head"])


class GptOssFunctional(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.d = _Dims(config)
        self.params = nn.ParameterDict({k: _p(v) for k, v in _stack(sd, self.d).items()})
        inv, att = _yarn(config)
        ang = torch.arange(self.d.max_pos, dtype=torch.float)[:, None] * inv
        self.register_buffer("cos_table", ang.cos() * att, persistent=False)
        self.register_buffer("sin_table", ang.sin() * att, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        W = dict(self.params.items())
        return _functional(W, self.d, self.cos_table, self.sin_table, input_ids, attention_mask, position_ids).float()


def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN:
        raise ValueError(f"unknown layout variant {variant!r}")
    sd = {k: v.float() for k, v in state_dict.items()}
    if variant == "oss_openai_reference":
        model = OAITransformer(sd, config)
    elif variant == "oss_stacked_functional":
        model = GptOssFunctional(sd, config)
    elif variant == "oss_grouped_qkv_backbone":
        model = GptOssWithHead(sd, config, variant)
    else:
        model = GptOssPort(sd, config, variant)
    return model.eval()
