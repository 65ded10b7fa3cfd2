"""Hand-written plain-PyTorch port of Beam (BeamForCausalLM, Reflection AI), float32, no cache.

Architecture as this port implements it (H hidden, nq / nkv query / key-value heads, d = config.head_dim, which
need not be H / nq; RMSNorm(x; w, eps) = w * x / sqrt(mean(x^2) + eps), eps = config.rms_norm_eps everywhere):
- h_1 = emb[ids] (no embedding scale).
- layer l (l = 0..L-1), "sandwich" norms and a depth-scaled residual:
      a = Attn_l(RMSNorm(h; w_in));  a = RMSNorm(a; w_attn_out)
      h <- a / sqrt(n) + h * sqrt((n - 1) / n)            with n = 2 (l + 1)
      m = MLP_l(RMSNorm(h; w_ffn_in));  m = RMSNorm(m; w_ffn_out)
      h <- m / sqrt(n') + h * sqrt((n' - 1) / n')         with n' = 2 (l + 1) + 1
  (the embedding counts as residual add 1, so h_n = S_n / sqrt(n) for the plain running sum S_n.)
- logits = cap * tanh((RMSNorm(h; w_final) @ W_head^T) / cap), cap = config.final_logit_softcapping.
- attention (layer_types[l] picks "sliding_attention" or "full_attention"):
      q = x W_q^T + b_q, k = x W_k^T + b_k, v = x W_v^T + b_v   (attention_bias), split into heads of d;
      q = RMSNorm_d(q; w_qn), k = RMSNorm_d(k; w_kn)   per head, BEFORE any position encoding;
      sliding layers: RoPE (rotate-half pairing (i, i + d/2), theta = rope_parameters["sliding_attention"]
        ["rope_theta"], angles position_ids * theta^(-2i/d));
      full layers: no RoPE (NoPE); instead q *= exp(0.1 * log1p((pos + 1) / 2048)) (scalable softmax, the
        position from position_ids);
      scores = q k^T * d^-0.5 (GQA: kv head j serves query heads j*g .. j*g+g-1), softmax in float32;
      mask: causal, key padding (attention_mask), and in sliding layers q_idx - k_idx < sliding_window;
      o = softmax @ v;  o *= sigmoid(x W_g^T + gate_bias[head])  (one gate bias per head, broadcast over d);
      out = o W_o^T + b_o.
- dense MLP: down(silu(x W_gate^T) * (x W_up^T)).
- sparse MLP (MoE, no shared expert): s = sigmoid(x W_r^T) (float32); c = s + e_score_correction_bias;
      group score = sum of the top-2 c inside each of n_group groups; keep the topk_group best groups;
      top num_experts_per_tok of c among them; weights = s (NOT c) at those experts, divided by their sum
      (+1e-20) when norm_topk_prob; y = routed_scaling_factor * sum_e w_e * down_e(silu(x G_e) * (x U_e)),
      the scale applied after the aggregation (note: post_feedforward_layernorm follows, so this scale, like any
      scale of a branch output, only survives through eps; the same holds for the depth-scaled residual, which
      every reader sees through an RMSNorm: see the CLEAN variant beam_clean_unscaled_residual).

Weight layout of this port (own names; Transformers' tensors converted in `build`):
- emb (V, H); head_t (H, V) = lm_head transposed; final_norm (H,); buffer inv_freq (d/2,).
- blocks[l]:
    norms (4, H) stacked rows [attn_in, attn_out, ffn_in, ffn_out]
      (= input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm);
    qk_norm (2, d) rows [q_norm, k_norm];
    w_qkvg (H, nq d + 2 nkv d + nq d) = [q | k | v | gate] projections fused and transposed;
    b_qkvg (same width) = [b_q | b_k | b_v | gate_bias repeated per channel of its head] (precomputed);
    w_o (nq d, H) transposed; b_o (H,); buffer res (2, 2) rows [attn, mlp] = [1/sqrt(n), sqrt((n-1)/n)];
    dense: w_gu (H, 2 I) = [gate | up] fused transposed; w_down (I, H) transposed;
    sparse: router_t (H, E) transposed; router_bias (E,) = e_score_correction_bias;
      w_gate, w_up (E, H, I) split from the fused gate_up_proj (E, 2I, H) and transposed; w_down (E, I, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "beam_residual_scales_swapped",  # depth-scaled add as h*sqrt((n-1)/n) + residual/sqrt(n): the two scales swapped
    "beam_window_off_by_one",  # sliding mask keeps q_idx - k_idx <= sliding_window: one key too many (W + 1 keys)
    "beam_rope_on_full_layers",  # RoPE applied in every layer: the NoPE full-attention layers get rotated q / k too
    "beam_qk_norm_after_rope",  # per-head q_norm / k_norm applied after RoPE instead of before it
    "beam_gate_bias_tiled",  # per-head gate_bias expanded at load with .repeat(d) (tiled) instead of repeat_interleave
    "beam_router_weights_with_bias",  # expert weights gathered from s + e_score_correction_bias instead of s
    "beam_group_score_top1",  # group score = max expert score of the group instead of the sum of its top 2
    "beam_expert_gate_up_swapped",  # fused experts gate_up_proj split as [up | gate] instead of [gate | up]
    "beam_post_attn_norm_as_pre_ffn",  # Llama naming: post_attention_layernorm loaded as the pre-FFN norm and
    #                                    pre_feedforward_layernorm as the norm after attention (the two swapped)
    "beam_rmsnorm_one_plus",  # RMSNorm scales by (1 + w) (Gemma convention) instead of w
    "beam_scaling_from_hidden",  # attention scale (H / nq)^-0.5 = 16^-0.5 instead of config.head_dim^-0.5 = 32^-0.5
    "beam_softcap_no_divide",  # final soft-cap as cap * tanh(logits): the division by cap before tanh missing
    "beam_nope_scale_log",  # NoPE query scale exp(0.1 * log((pos + 1) / 2048)): log instead of log1p (the 1 + lost)
    "beam_pad_mask_ignored_sliding",  # sliding layers build causal+window mask only: key padding not masked there
]
PADDING_ONLY = ["beam_pad_mask_ignored_sliding"]
CLEAN = [
    "beam_clean_unscaled_residual",  # residual kept as the plain running sum S_n = sqrt(n) h_n; each norm reading
    #                                  it uses eps * n (RMSNorm(S / sqrt(n); eps) == RMSNorm(S; n eps))
    "beam_clean_online_softmax",  # attention over key blocks of 8 with a running max / denominator (flash style)
    "beam_clean_dense_experts",  # every expert on every token, combined with a dense (tokens, E) weight matrix
    "beam_clean_complex_rope",  # RoPE as a complex product on the (i, i + d/2) pairs
    "beam_clean_softcap_sigmoid",  # cap * tanh(x / cap) computed as cap * (2 sigmoid(2 x / cap) - 1)
]

NEG = torch.finfo(torch.float32).min


def rms_norm(x, w, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if BUG == "beam_rmsnorm_one_plus":
        return (1.0 + w) * y
    return w * y


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, cos, sin):
    """x (B, heads, T, d); cos / sin (B, T, d/2)."""
    if BUG == "beam_clean_complex_rope":
        half = x.shape[-1] // 2
        z = torch.complex(x[..., :half], x[..., half:])
        rot = torch.complex(cos, sin)[:, None]
        z = z * rot
        return torch.cat((z.real, z.imag), dim=-1)
    c = torch.cat((cos, cos), dim=-1)[:, None]
    s = torch.cat((sin, sin), dim=-1)[:, None]
    return x * c + rotate_half(x) * s


def attend(q, k, v, allow, scaling):
    """q (B, nq, T, d), k / v (B, nq, T, d) (already repeated), allow (B or 1, 1, T, T) bool -> (B, nq, T, d)."""
    if BUG == "beam_clean_online_softmax":
        B, nh, T, d = q.shape
        m = torch.full((B, nh, T, 1), NEG)
        den = torch.zeros(B, nh, T, 1)
        acc = torch.zeros(B, nh, T, d)
        for s0 in range(0, T, 8):
            sc = (q @ k[:, :, s0 : s0 + 8].transpose(-1, -2)) * scaling
            sc = sc.masked_fill(~allow[..., s0 : s0 + 8], NEG)
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            corr = torch.exp(m - m_new)
            p = torch.exp(sc - m_new)
            den = den * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v[:, :, s0 : s0 + 8]
            m = m_new
        return acc / den
    sc = (q @ k.transpose(-1, -2)) * scaling
    sc = sc.masked_fill(~allow, NEG)
    p = torch.softmax(sc.float(), dim=-1)
    return p @ v


class BeamBlock(nn.Module):
    def __init__(self, sd, cfg, l):
        super().__init__()
        p = f"model.layers.{l}."
        H, nq, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.head_dim
        self.nq, self.nkv, self.d, self.H = nq, nkv, d, H
        self.eps = cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[l]
        self.sparse = cfg.mlp_layer_types[l] == "sparse"
        self.window = cfg.sliding_window
        self.scaling = (H // nq) ** -0.5 if BUG == "beam_scaling_from_hidden" else d**-0.5
        self.idx = (2 * (l + 1), 2 * (l + 1) + 1)

        names = [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ]
        if BUG == "beam_post_attn_norm_as_pre_ffn":
            names = [
                "input_layernorm",
                "pre_feedforward_layernorm",
                "post_attention_layernorm",
                "post_feedforward_layernorm",
            ]
        self.norms = nn.Parameter(torch.stack([sd[p + n + ".weight"] for n in names]))
        a = p + "self_attn."
        self.qk_norm = nn.Parameter(torch.stack([sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]]))
        w = [sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"], sd[a + "gate_proj.weight"]]
        self.w_qkvg = nn.Parameter(torch.cat(w, 0).t().contiguous())
        gb = sd[a + "gate_bias"]
        gb = gb.repeat(d) if BUG == "beam_gate_bias_tiled" else gb.repeat_interleave(d)

        def bias(n, size):
            return sd[a + n + ".bias"] if (a + n + ".bias") in sd else torch.zeros(size)

        self.b_qkvg = nn.Parameter(
            torch.cat([bias("q_proj", nq * d), bias("k_proj", nkv * d), bias("v_proj", nkv * d), gb])
        )
        self.w_o = nn.Parameter(sd[a + "o_proj.weight"].t().contiguous())
        self.b_o = nn.Parameter(bias("o_proj", H))
        res = []
        for n in self.idx:
            s_new, s_res = 1.0 / math.sqrt(n), math.sqrt((n - 1) / n)
            if BUG == "beam_residual_scales_swapped":
                s_new, s_res = s_res, s_new
            res.append([s_new, s_res])
        self.register_buffer("res", torch.tensor(res, dtype=torch.float64), persistent=False)

        m = p + "mlp."
        if self.sparse:
            self.E = cfg.num_experts
            self.top_k = cfg.num_experts_per_tok
            self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
            self.norm_topk = cfg.norm_topk_prob
            self.rscale = cfg.routed_scaling_factor
            self.router_t = nn.Parameter(sd[m + "gate.weight"].float().t().contiguous())
            self.router_bias = nn.Parameter(sd[m + "gate.e_score_correction_bias"].float().clone())
            gu = sd[m + "experts.gate_up_proj"]  # (E, 2I, H)
            g, u = gu.chunk(2, dim=1)
            if BUG == "beam_expert_gate_up_swapped":
                g, u = u, g
            self.w_gate = nn.Parameter(g.transpose(1, 2).contiguous())
            self.w_up = nn.Parameter(u.transpose(1, 2).contiguous())
            self.w_down = nn.Parameter(sd[m + "experts.down_proj"].transpose(1, 2).contiguous())
        else:
            self.w_gu = nn.Parameter(
                torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]], 0).t().contiguous()
            )
            self.w_down = nn.Parameter(sd[m + "down_proj.weight"].t().contiguous())

    # ---------------------------------------------------------------- attention
    def attention(self, x, rope, qscale, allow):
        B, T, _ = x.shape
        nq, nkv, d = self.nq, self.nkv, self.d
        y = x @ self.w_qkvg + self.b_qkvg
        q, k, v, g = y.split([nq * d, nkv * d, nkv * d, nq * d], dim=-1)
        q = q.view(B, T, nq, d)
        k = k.view(B, T, nkv, d)
        v = v.view(B, T, nkv, d).transpose(1, 2)
        use_rope = rope is not None
        if BUG == "beam_qk_norm_after_rope" and use_rope:
            q = apply_rope(q.transpose(1, 2), *rope)
            k = apply_rope(k.transpose(1, 2), *rope)
            q = rms_norm(q, self.qk_norm[0], self.eps)
            k = rms_norm(k, self.qk_norm[1], self.eps)
        else:
            q = rms_norm(q, self.qk_norm[0], self.eps).transpose(1, 2)
            k = rms_norm(k, self.qk_norm[1], self.eps).transpose(1, 2)
            if use_rope:
                q = apply_rope(q, *rope)
                k = apply_rope(k, *rope)
        if qscale is not None:
            q = q * qscale
        rep = nq // nkv
        k = k[:, :, None].expand(B, nkv, rep, T, d).reshape(B, nq, T, d)
        v = v[:, :, None].expand(B, nkv, rep, T, d).reshape(B, nq, T, d)
        o = attend(q, k, v, allow, self.scaling).transpose(1, 2)  # (B, T, nq, d)
        o = o * torch.sigmoid(g.view(B, T, nq, d))
        return o.reshape(B, T, nq * d) @ self.w_o + self.b_o

    # ---------------------------------------------------------------- MLPs
    def dense_mlp(self, x):
        g, u = (x @ self.w_gu).chunk(2, dim=-1)
        return (F.silu(g.float()) * u.float()) @ self.w_down

    def route(self, x):
        """x (N, H) -> weights (N, k), indices (N, k)."""
        s = torch.sigmoid(x.float() @ self.router_t)
        c = s + self.router_bias
        N = c.shape[0]
        grouped = c.view(N, self.n_group, self.E // self.n_group)
        if BUG == "beam_group_score_top1":
            gs = grouped.max(dim=-1).values
        else:
            gs = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(self.topk_group, dim=-1).indices, 1.0).bool()
        keep = keep[:, :, None].expand_as(grouped).reshape(N, self.E)
        idx = c.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices
        w = (c if BUG == "beam_router_weights_with_bias" else s).gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w, idx

    def expert(self, x, e):
        return (F.silu((x @ self.w_gate[e]).float()) * (x @ self.w_up[e]).float()) @ self.w_down[e]

    def sparse_mlp(self, x):
        B, T, H = x.shape
        x = x.reshape(-1, H)
        w, idx = self.route(x)
        if BUG == "beam_clean_dense_experts":
            dense_w = torch.zeros(x.shape[0], self.E).scatter_add_(1, idx, w)
            outs = torch.stack([self.expert(x, e) for e in range(self.E)], dim=1)  # (N, E, H)
            out = (dense_w[:, :, None] * outs).sum(1)
        else:
            out = torch.zeros_like(x)
            for e in range(self.E):
                tok, pos = torch.where(idx == e)
                if tok.numel():
                    out.index_add_(0, tok, self.expert(x[tok], e) * w[tok, pos, None])
        out = out * self.rscale
        return out.view(B, T, H)

    # ---------------------------------------------------------------- block
    def add(self, new, resid, which, n):
        if BUG == "beam_clean_unscaled_residual":
            return resid + new  # the stream is S_n = sqrt(n) h_n
        s_new, s_res = self.res[which].tolist()
        return new * s_new + resid * s_res

    def norm_eps(self, n):
        return self.eps * n if BUG == "beam_clean_unscaled_residual" else self.eps

    def forward(self, h, rope, qscale, allow):
        n_in, n_mid = self.idx[0] - 1, self.idx[0]
        a = self.attention(rms_norm(h, self.norms[0], self.norm_eps(n_in)), rope, qscale, allow)
        a = rms_norm(a, self.norms[1], self.eps)
        h = self.add(a, h, 0, self.idx[0])
        m = rms_norm(h, self.norms[2], self.norm_eps(n_mid))
        m = self.sparse_mlp(m) if self.sparse else self.dense_mlp(m)
        m = rms_norm(m, self.norms[3], self.eps)
        return self.add(m, h, 1, self.idx[1])


class BeamPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.L = cfg.num_hidden_layers
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window
        self.cap = cfg.final_logit_softcapping
        self.emb = nn.Parameter(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([BeamBlock(sd, cfg, l) for l in range(self.L)])
        self.final_norm = nn.Parameter(sd["model.norm.weight"])
        head = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]
        self.head_t = nn.Parameter(head.t().contiguous())
        d = cfg.head_dim
        rp = cfg.rope_parameters["sliding_attention"]
        theta = rp["rope_theta"]
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), persistent=False
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        h = self.emb[input_ids].float()

        i = torch.arange(T)
        causal = (i[None, :] <= i[:, None])[None, None]  # (1, 1, Tq, Tk)
        if BUG == "beam_window_off_by_one":
            window = causal & ((i[:, None] - i[None, :]) <= self.window)[None, None]
        else:
            window = causal & ((i[:, None] - i[None, :]) < self.window)[None, None]
        if attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :]
            full_allow = causal & keys
            slide_allow = window if BUG == "beam_pad_mask_ignored_sliding" else window & keys
        else:
            full_allow, slide_allow = causal, window

        ang = position_ids[..., None].float() * self.inv_freq  # (B, T, d/2)
        rope = (ang.cos(), ang.sin())
        if BUG == "beam_nope_scale_log":
            qscale = torch.exp(0.1 * torch.log((position_ids.float() + 1) / 2048))[:, None, :, None]
        else:
            qscale = torch.exp(0.1 * torch.log1p((position_ids.float() + 1) / 2048))[:, None, :, None]

        for l, blk in enumerate(self.blocks):
            if blk.layer_type == "sliding_attention":
                h = blk(h, rope, None, slide_allow)
            else:
                h = blk(h, rope if BUG == "beam_rope_on_full_layers" else None, qscale, full_allow)

        n_final = 2 * self.L + 1
        eps = self.eps * n_final if BUG == "beam_clean_unscaled_residual" else self.eps
        logits = rms_norm(h, self.final_norm, eps) @ self.head_t
        if self.cap is not None:
            if BUG == "beam_softcap_no_divide":
                logits = self.cap * torch.tanh(logits)
            elif BUG == "beam_clean_softcap_sigmoid":
                logits = self.cap * (2.0 * torch.sigmoid(2.0 * logits / self.cap) - 1.0)
            else:
                logits = self.cap * torch.tanh(logits / self.cap)
        return logits.float()


def build(state_dict, config) -> nn.Module:
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    with torch.no_grad():
        model = BeamPort(sd, config)
    return model.eval()
