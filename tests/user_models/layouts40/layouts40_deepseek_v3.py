"""Hand-written plain-PyTorch port of DeepSeek-V3 (DeepseekV3ForCausalLM), every variant a CORRECT port.

Architecture as this port implements it:
- token embedding (no scaling); untied head; final RMSNorm (rms_norm_eps).  RMSNorm(x) = g * x / sqrt(ms(x) + eps).
- decoder layer i, pre-norm:  h = h + MLA(RMS_in(h));  h = h + FFN(RMS_post(h)).
- MLA (multi-head latent attention), n heads, no bias:
    q      = W_qb RMS_qa(W_qa x)              (q LoRA; the q_a / kv_a norms use eps 1e-6, not the config's)
             per head [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)]
    [c | k_pe] = W_kva x                      c: kv_lora_rank latent, k_pe: one rope key shared by all heads
    c      = RMS_kva(c);  per head [k_nope | v] = W_kvb c
    RoPE on q_pe and k_pe with INTERLEAVED pairs (2i, 2i+1) (config.rope_interleave), YaRN frequencies
    (factor, beta_fast/slow, original_max_position_embeddings) and cos/sin scaled by the YaRN attention factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim);
    score  = (q_nope . k_nope + q_pe . k_pe) * qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2;
    causal + key-padding mask, softmax, out = W_o [v-weighted heads].
- FFN: the first first_k_dense_replace layers are a dense SwiGLU of intermediate_size; the others a MoE:
    s = sigmoid(W_r x) (float32); choice scores s + e_score_correction_bias; the n_group groups ranked by the sum
    of their two best choice scores, the topk_group best kept, the others' experts excluded; top-k experts by
    choice score; weights = s (no bias) of those experts, renormalised (norm_topk_prob) and times
    routed_scaling_factor; out = sum_k w_k expert_k(x) + shared_expert(x) (SwiGLU of
    moe_intermediate_size * n_shared_experts).
- positions: position_ids, else 0..T-1.

Layout variants (BUG selects one; "" is the baseline):
- "" (baseline): DeepSeek's reference-inference style: own module tree; every matrix transposed (in, out), x @ W;
  kv_b split per head into w_uk (heads, kv_lora, nope) and w_uv (heads, kv_lora, v); RoPE by complex
  multiplication on the interleaved pairs with a freqs_cis table (YaRN, attention factor as its modulus)
  precomputed for the whole max length; router as DeepSeek's Gate (group mask by scatter, -inf fill);
  per-expert w1 / w3 / w2 stacked (E, ...) and a loop over experts; explicit softmax, additive finfo.min mask.
- dsv3_absorbed_mla: DeepSeek's "absorb" MLA: W_uk applied to the query (q_nope -> latent space), scores taken
  against the normalised latent c directly, W_uv applied after the attention to the latent output; DeepSeek's
  own module names (wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo) as nn.Linear; experts as an nn.ModuleList of
  per-expert w1 / w3 / w2 Linear modules (DeepSeek's Expert).
- dsv3_rotate_half_deinterleaved: the rope rows of W_qb (per head) and of W_kva permuted at load from interleaved
  to half-split order, then rotate-half RoPE with cat(freqs, freqs) cos/sin tables; kv_b kept fused;
  SDPA with an explicit scale and a boolean mask (v head dim != qk head dim); per-expert Linear modules.
- dsv3_fused_qkv_a_folded_norms: q_a and kv_a projections fused into one (H, q_lora + kv_lora + rope) matrix; every
  RMSNorm gain folded into the next projection (input norm into the fused a-projection, q_a norm into W_qb,
  kv_a norm into W_kvb, post-attention norm into router / experts / shared / dense MLP, final norm into the
  head); weightless norms.
- dsv3_expert_gather_scaled: experts with fused [gate | up] (E, H, 2I); per-token gather of the chosen experts'
  weights; routed_scaling_factor folded into the expert down projections; the group-limited top-k done by
  gathering the kept groups' scores (T, topk_group, E / n_group), top-k inside them and mapping back to ids.
- dsv3_shared_as_expert: the shared expert appended to the routed experts as expert E (E + 1 experts stacked),
  always chosen with combine weight 1; all experts computed densely with a (T, E + 1) combine matrix; group
  scores from a descending sort; attention as in dsv3_rotate_half_deinterleaved.
- dsv3_heads_einsum: W_qb as (heads, q_lora, qk_head), W_kvb as (heads, kv_lora, nope + v), W_o as
  (heads, v, hidden), all einsum; RoPE on even/odd slices with per-pair cos/sin, re-interleaved with stack;
  boolean mask through torch.where.
- dsv3_stacked_functional: one functional forward over an nn.ParameterList of per-kind tensors stacked over layers
  ((L, ...) attention / norms, (L_moe, E, ...) experts, (L_dense, ...) dense MLP) in HF (out, in) orientation
  with F.linear; experts dispatched by sorting (token, slot) pairs by expert id.
- dsv3_latent_cache_decode: the sequence fed one token at a time with a latent KV cache (normalised c and rotated
  k_pe, as DeepSeek caches them), keys/values expanded from the cache per step; GPT-J rotate-every-two RoPE with
  repeat_interleaved cos/sin; positions from the attention mask when no position_ids.
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
    "dsv3_absorbed_mla",  # W_uk absorbed into the query, scores on the latent, W_uv after attention (DeepSeek absorb)
    "dsv3_rotate_half_deinterleaved",  # rope rows permuted to half-split at load, rotate_half RoPE, SDPA with scale
    "dsv3_fused_qkv_a_folded_norms",  # fused q_a | kv_a projection, all RMSNorm gains folded into next projections
    "dsv3_expert_gather_scaled",  # per-token expert gather, routed scale folded into w2, gathered group top-k
    "dsv3_shared_as_expert",  # shared expert stacked as expert E with weight 1, dense (T, E+1) combine
    "dsv3_heads_einsum",  # (heads, in, out) MLA weights with einsum, even/odd RoPE re-interleaved
    "dsv3_stacked_functional",  # functional forward, ParameterList of (L, ...) stacks, sorted expert dispatch
    "dsv3_latent_cache_decode",  # token-by-token decode with a latent (c, k_pe) cache, rotate-every-two RoPE
]

_LORA_EPS = 1e-6  # DeepseekV3's q_a_layernorm / kv_a_layernorm are built with the default eps


# ----------------------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------------------


def _mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope(config, dim):
    """(inv_freq (dim/2,), cos/sin attention factor, softmax-scale multiplier) for default or YaRN RoPE."""
    rp = dict(getattr(config, "rope_parameters", None) or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    base = float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0, 1.0
    assert kind == "yarn", f"this port implements default and yarn RoPE, not {kind}"
    orig = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or config.max_position_embeddings / orig
    ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
    att = rp.get("attention_factor")
    if att is None:
        att = _mscale(factor, ms) / _mscale(factor, ms_all) if (ms and ms_all) else _mscale(factor)
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr(n_rot):
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(fast), corr(slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    softmax_mult = _mscale(rp["factor"], ms_all) ** 2 if ms_all else 1.0
    return inv, float(att), softmax_mult


def _conf(config):
    assert config.q_lora_rank is not None, "this port implements the q LoRA path (DeepSeek-V3)"
    assert not getattr(config, "attention_bias", False)
    nope, rope_d = config.qk_nope_head_dim, config.qk_rope_head_dim
    inv, att, mult = _rope(config, rope_d)
    L = config.num_hidden_layers
    return dict(
        V=config.vocab_size,
        H=config.hidden_size,
        nh=config.num_attention_heads,
        q_lora=config.q_lora_rank,
        kv_lora=config.kv_lora_rank,
        nope=nope,
        rope=rope_d,
        vd=config.v_head_dim,
        qk=nope + rope_d,
        L=L,
        moe=[i >= (config.first_k_dense_replace or 0) for i in range(L)],
        E=config.n_routed_experts,
        k=config.num_experts_per_tok,
        G=config.n_group,
        TG=config.topk_group,
        norm_topk=bool(config.norm_topk_prob),
        rscale=float(config.routed_scaling_factor),
        eps=config.rms_norm_eps,
        maxpos=config.max_position_embeddings,
        inv_freq=inv,
        att=att,
        scale=(nope + rope_d) ** -0.5 * mult,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _linear(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = _P(w)
    return lin


def _rms(x, g, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if g is None else g * y


def _positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids.long()
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)


def _allowed(attention_mask, B, T, device):
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    allowed = causal[None, None].expand(B, 1, T, T)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed


def _additive(attention_mask, B, T, device):
    allowed = _allowed(attention_mask, B, T, device)
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _freqs_cis(c):
    ang = torch.outer(torch.arange(c["maxpos"], dtype=torch.float), c["inv_freq"])
    return torch.polar(torch.full_like(ang, c["att"]), ang)  # modulus = YaRN attention factor


def _rope_complex(x, fc):
    """x (..., rope) with interleaved pairs; fc broadcastable complex (..., rope/2)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * fc).flatten(-2)


def _gate(x, w_t, bias, c):
    """DeepSeek's Gate: x (N, H), w_t (H, E) -> (weights (N, k), ids (N, k))."""
    scores = torch.sigmoid(x.float() @ w_t)
    original = scores
    scores = scores + bias
    N = x.shape[0]
    group_scores = scores.view(N, c["G"], -1).topk(2, dim=-1)[0].sum(dim=-1)
    keep = group_scores.topk(c["TG"], dim=-1)[1]
    drop = scores.new_ones(N, c["G"], dtype=torch.bool).scatter_(1, keep, False)
    scores = scores.view(N, c["G"], -1).masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)
    ids = torch.topk(scores, c["k"], dim=-1)[1]
    w = original.gather(1, ids)
    if c["norm_topk"]:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * c["rscale"], ids


def _experts_hf(sd, pre):
    """HF (E, 2I, H) [gate; up] and (E, H, I) -> gate (E, I, H), up (E, I, H), down (E, H, I)."""
    gu = sd[pre + "mlp.experts.gate_up_proj"]
    I = gu.shape[1] // 2
    return gu[:, :I], gu[:, I:], sd[pre + "mlp.experts.down_proj"]


def _head(sd, c):
    return sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"]


# ----------------------------------------------------------------------------------------------------------------
# baseline (DeepSeek reference-inference style)
# ----------------------------------------------------------------------------------------------------------------


class _MLA(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        nh = c["nh"]
        self.wq_a = _P(sd[a + "q_a_proj.weight"].t())
        self.q_gain = _P(sd[a + "q_a_layernorm.weight"])
        self.wq_b = _P(sd[a + "q_b_proj.weight"].t())
        self.wkv_a = _P(sd[a + "kv_a_proj_with_mqa.weight"].t())
        self.kv_gain = _P(sd[a + "kv_a_layernorm.weight"])
        kvb = sd[a + "kv_b_proj.weight"].view(nh, c["nope"] + c["vd"], c["kv_lora"])
        self.w_uk = _P(kvb[:, : c["nope"]].transpose(1, 2))  # (heads, kv_lora, nope)
        self.w_uv = _P(kvb[:, c["nope"] :].transpose(1, 2))  # (heads, kv_lora, v)
        self.wo = _P(sd[a + "o_proj.weight"].t())

    def forward(self, x, fc, mask):
        c = self.c
        B, T, _ = x.shape
        nh, nope = c["nh"], c["nope"]
        q = (_rms(x @ self.wq_a, self.q_gain, _LORA_EPS) @ self.wq_b).view(B, T, nh, c["qk"])
        q_nope, q_pe = q.split([nope, c["rope"]], dim=-1)
        q_pe = _rope_complex(q_pe, fc[:, :, None])
        kv, k_pe = (x @ self.wkv_a).split([c["kv_lora"], c["rope"]], dim=-1)
        kv = _rms(kv, self.kv_gain, _LORA_EPS)
        k_pe = _rope_complex(k_pe, fc)  # (B, T, rope)
        k_nope = torch.einsum("btc,hcd->bthd", kv, self.w_uk)
        v = torch.einsum("btc,hcd->bthd", kv, self.w_uv)
        s = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
        p = torch.softmax(s * c["scale"] + mask, dim=-1)
        o = torch.einsum("bhts,bshd->bthd", p, v)
        return o.reshape(B, T, -1) @ self.wo


class _SwiGLU(nn.Module):
    def __init__(self, w1, w3, w2):
        super().__init__()
        self.w1, self.w3, self.w2 = _P(w1.t()), _P(w3.t()), _P(w2.t())

    def forward(self, x):
        return (F.silu(x @ self.w1) * (x @ self.w3)) @ self.w2


class _RefMoE(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        g, u, d = _experts_hf(sd, pre)
        self.gate_w = _P(sd[pre + "mlp.gate.weight"].t())
        self.register_buffer("gate_bias", sd[pre + "mlp.gate.e_score_correction_bias"].float().clone())
        self.w1 = _P(g.transpose(1, 2))  # (E, H, I)
        self.w3 = _P(u.transpose(1, 2))
        self.w2 = _P(d.transpose(1, 2))  # (E, I, H)
        s = pre + "mlp.shared_experts."
        self.shared = _SwiGLU(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"])

    def forward(self, x):
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        w, ids = _gate(xf, self.gate_w, self.gate_bias, self.c)
        y = torch.zeros_like(xf)
        counts = torch.bincount(ids.flatten(), minlength=self.c["E"]).tolist()
        for e in range(self.c["E"]):
            if counts[e] == 0:
                continue
            idx, top = torch.where(ids == e)
            xe = xf[idx]
            y[idx] += ((F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e]) * w[idx, top, None]
        return (y + self.shared(xf)).view(B, T, H)


class _RefBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        self.attn_norm = _P(sd[pre + "input_layernorm.weight"])
        self.ffn_norm = _P(sd[pre + "post_attention_layernorm.weight"])
        self.attn = _MLA(sd, c, i)
        if c["moe"][i]:
            self.ffn = _RefMoE(sd, c, i)
        else:
            m = pre + "mlp."
            self.ffn = _SwiGLU(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])

    def forward(self, h, fc, mask):
        h = h + self.attn(_rms(h, self.attn_norm, self.c["eps"]), fc, mask)
        return h + self.ffn(_rms(h, self.ffn_norm, self.c["eps"]))


class DeepseekV3Baseline(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embed = _P(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_RefBlock(sd, c, i) for i in range(c["L"])])
        self.norm = _P(sd["model.norm.weight"])
        self.head = _P(_head(sd, c).t())
        self.register_buffer("freqs_cis", _freqs_cis(c), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        fc = self.freqs_cis[_positions(input_ids, position_ids)]  # (B, T, rope/2)
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = self.embed[input_ids]
        for layer in self.layers:
            h = layer(h, fc, mask)
        return (_rms(h, self.norm, self.c["eps"]) @ self.head).float()


# ----------------------------------------------------------------------------------------------------------------
# dsv3_absorbed_mla
# ----------------------------------------------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, g, eps):
        super().__init__()
        self.weight = _P(g)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


class _AbsorbMLA(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        self.wq_a = _linear(sd[a + "q_a_proj.weight"])
        self.q_norm = _RMSNorm(sd[a + "q_a_layernorm.weight"], _LORA_EPS)
        self.wq_b = _linear(sd[a + "q_b_proj.weight"])
        self.wkv_a = _linear(sd[a + "kv_a_proj_with_mqa.weight"])
        self.kv_norm = _RMSNorm(sd[a + "kv_a_layernorm.weight"], _LORA_EPS)
        self.wkv_b = _linear(sd[a + "kv_b_proj.weight"])
        self.wo = _linear(sd[a + "o_proj.weight"])

    def forward(self, x, fc, mask):
        c = self.c
        B, T, _ = x.shape
        nh, nope = c["nh"], c["nope"]
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, nh, c["qk"])
        q_nope, q_pe = torch.split(q, [nope, c["rope"]], dim=-1)
        q_pe = _rope_complex(q_pe, fc.unsqueeze(2))
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [c["kv_lora"], c["rope"]], dim=-1)
        k_pe = _rope_complex(k_pe, fc)
        kv = self.kv_norm(kv)
        wkv_b = self.wkv_b.weight.view(nh, -1, c["kv_lora"])
        q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :nope])  # absorbed W_uk
        scores = (torch.einsum("bshc,btc->bsht", q_nope, kv) + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * c["scale"]
        scores = scores + mask.permute(0, 2, 1, 3)  # (B, 1, T, T) -> (B, T, 1, T)
        scores = scores.softmax(dim=-1, dtype=torch.float32)
        x = torch.einsum("bsht,btc->bshc", scores, kv)
        x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -c["vd"] :])  # W_uv after attention
        return self.wo(x.flatten(2))


class _Expert(nn.Module):
    def __init__(self, w1, w3, w2):
        super().__init__()
        self.w1, self.w3, self.w2 = _linear(w1), _linear(w3), _linear(w2)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _GateModule(nn.Module):
    def __init__(self, w, bias, c):
        super().__init__()
        self.c = c
        self.weight = _P(w)
        self.register_buffer("bias", bias.float().clone())

    def forward(self, x):
        return _gate(x, self.weight.t(), self.bias, self.c)


class _AbsorbMoE(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        g, u, d = _experts_hf(sd, pre)
        self.gate = _GateModule(sd[pre + "mlp.gate.weight"], sd[pre + "mlp.gate.e_score_correction_bias"], c)
        self.experts = nn.ModuleList([_Expert(g[e], u[e], d[e]) for e in range(c["E"])])
        s = pre + "mlp.shared_experts."
        self.shared_experts = _Expert(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"])

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, self.c["H"])
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.c["E"]).tolist()
        for e in range(self.c["E"]):
            if counts[e] == 0:
                continue
            idx, top = torch.where(indices == e)
            y[idx] += self.experts[e](x[idx]) * weights[idx, top, None]
        return (y + self.shared_experts(x)).view(shape)


class _AbsorbBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.attn_norm = _RMSNorm(sd[pre + "input_layernorm.weight"], c["eps"])
        self.ffn_norm = _RMSNorm(sd[pre + "post_attention_layernorm.weight"], c["eps"])
        self.attn = _AbsorbMLA(sd, c, i)
        m = pre + "mlp."
        if c["moe"][i]:
            self.ffn = _AbsorbMoE(sd, c, i)
        else:
            self.ffn = _Expert(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])

    def forward(self, x, fc, mask):
        x = x + self.attn(self.attn_norm(x), fc, mask)
        return x + self.ffn(self.ffn_norm(x))


class DeepseekV3Absorbed(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["V"], c["H"], _weight=_P(sd["model.embed_tokens.weight"]))
        self.layers = nn.ModuleList([_AbsorbBlock(sd, c, i) for i in range(c["L"])])
        self.norm = _RMSNorm(sd["model.norm.weight"], c["eps"])
        self.head = _linear(_head(sd, c))
        self.register_buffer("freqs_cis", _freqs_cis(c), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        fc = self.freqs_cis[_positions(input_ids, position_ids)]
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, fc, mask)
        return self.head(self.norm(h)).float()


# ----------------------------------------------------------------------------------------------------------------
# dsv3_rotate_half_deinterleaved
# ----------------------------------------------------------------------------------------------------------------


def _deinterleave_rows(w, rope):
    """the last `rope` rows of w, (x0, x1, x2, x3, ..) -> (x0, x2, .., x1, x3, ..)."""
    head, pe = w[:-rope], w[-rope:]
    pe = pe.view(rope // 2, 2, *pe.shape[1:]).transpose(0, 1).reshape(pe.shape)
    return torch.cat([head, pe], 0)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _HalfMLA(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        nh, qk = c["nh"], c["qk"]
        qb = sd[a + "q_b_proj.weight"].view(nh, qk, -1)
        qb = torch.stack([_deinterleave_rows(qb[h], c["rope"]) for h in range(nh)]).reshape(nh * qk, -1)
        self.q_down = _linear(sd[a + "q_a_proj.weight"])
        self.q_down_norm = _RMSNorm(sd[a + "q_a_layernorm.weight"], _LORA_EPS)
        self.q_up = _linear(qb)
        self.kv_down = _linear(_deinterleave_rows(sd[a + "kv_a_proj_with_mqa.weight"], c["rope"]))
        self.kv_down_norm = _RMSNorm(sd[a + "kv_a_layernorm.weight"], _LORA_EPS)
        self.kv_up = _linear(sd[a + "kv_b_proj.weight"])
        self.out = _linear(sd[a + "o_proj.weight"])

    def forward(self, x, cos, sin, allowed):
        c = self.c
        B, T, _ = x.shape
        nh, nope = c["nh"], c["nope"]
        q = self.q_up(self.q_down_norm(self.q_down(x))).view(B, T, nh, c["qk"]).transpose(1, 2)
        q_nope, q_pe = q.split([nope, c["rope"]], -1)
        latent, k_pe = self.kv_down(x).split([c["kv_lora"], c["rope"]], -1)
        kv = self.kv_up(self.kv_down_norm(latent)).view(B, T, nh, nope + c["vd"]).transpose(1, 2)
        k_nope, v = kv.split([nope, c["vd"]], -1)
        k_pe = k_pe[:, None]  # (B, 1, T, rope)
        q_pe = q_pe * cos + _rotate_half(q_pe) * sin
        k_pe = k_pe * cos + _rotate_half(k_pe) * sin
        q = torch.cat([q_nope, q_pe], -1)
        k = torch.cat([k_nope, k_pe.expand(B, nh, T, c["rope"])], -1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=c["scale"])
        return self.out(o.transpose(1, 2).reshape(B, T, -1))


class _HalfBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.norm1 = _RMSNorm(sd[pre + "input_layernorm.weight"], c["eps"])
        self.norm2 = _RMSNorm(sd[pre + "post_attention_layernorm.weight"], c["eps"])
        self.self_attention = _HalfMLA(sd, c, i)
        m = pre + "mlp."
        if c["moe"][i]:
            self.mlp = _AbsorbMoE(sd, c, i)
        else:
            self.mlp = _Expert(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])

    def forward(self, x, cos, sin, allowed):
        x = x + self.self_attention(self.norm1(x), cos, sin, allowed)
        return x + self.mlp(self.norm2(x))


class DeepseekV3RotateHalf(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c["V"], c["H"], _weight=_P(sd["model.embed_tokens.weight"]))
        self.blocks = nn.ModuleList([_HalfBlock(sd, c, i) for i in range(c["L"])])
        self.ln_f = _RMSNorm(sd["model.norm.weight"], c["eps"])
        self.lm_head = _linear(_head(sd, c))
        ang = torch.outer(torch.arange(c["maxpos"], dtype=torch.float), c["inv_freq"])
        ang = torch.cat([ang, ang], -1)
        self.register_buffer("cos_cached", ang.cos() * c["att"], persistent=False)
        self.register_buffer("sin_cached", ang.sin() * c["att"], persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        pos = _positions(input_ids, position_ids)
        cos, sin = self.cos_cached[pos][:, None], self.sin_cached[pos][:, None]
        allowed = _allowed(attention_mask, B, T, input_ids.device)
        allowed = allowed | torch.eye(T, dtype=torch.bool, device=input_ids.device)  # no empty padded rows
        x = self.wte(input_ids)
        for blk in self.blocks:
            x = blk(x, cos, sin, allowed)
        return self.lm_head(self.ln_f(x)).float()


# ----------------------------------------------------------------------------------------------------------------
# dsv3_fused_qkv_a_folded_norms
# ----------------------------------------------------------------------------------------------------------------


class _FoldedMLA(_MLA):
    def __init__(self, sd, c, i, g_in):
        super().__init__(sd, c, i)
        with torch.no_grad():
            self.w_qkv_a = _P(torch.cat([self.wq_a, self.wkv_a], 1) * g_in[:, None])  # (H, q_lora + kv_lora + rope)
            self.wq_b.mul_(self.q_gain[:, None])
            self.w_uk.mul_(self.kv_gain[None, :, None])
            self.w_uv.mul_(self.kv_gain[None, :, None])
        del self.wq_a, self.wkv_a, self.q_gain, self.kv_gain

    def forward(self, x, fc, mask):
        c = self.c
        B, T, _ = x.shape
        qa, kv, k_pe = (x @ self.w_qkv_a).split([c["q_lora"], c["kv_lora"], c["rope"]], -1)
        q = (_rms(qa, None, _LORA_EPS) @ self.wq_b).view(B, T, c["nh"], c["qk"])
        q_nope, q_pe = q.split([c["nope"], c["rope"]], dim=-1)
        q_pe = _rope_complex(q_pe, fc[:, :, None])
        k_pe = _rope_complex(k_pe, fc)
        kv = _rms(kv, None, _LORA_EPS)
        k_nope = torch.einsum("btc,hcd->bthd", kv, self.w_uk)
        v = torch.einsum("btc,hcd->bthd", kv, self.w_uv)
        s = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
        p = torch.softmax(s * c["scale"] + mask, dim=-1)
        return torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, -1) @ self.wo


class _FoldedBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        g_in = sd[pre + "input_layernorm.weight"]
        g_post = sd[pre + "post_attention_layernorm.weight"]
        self.attn = _FoldedMLA(sd, c, i, g_in)
        if c["moe"][i]:
            self.ffn = _RefMoE(sd, c, i)
            with torch.no_grad():
                for p in (self.ffn.gate_w, self.ffn.w1, self.ffn.w3, self.ffn.shared.w1, self.ffn.shared.w3):
                    p.mul_(g_post.view(-1, 1))  # (.., H, out): scale the input rows
        else:
            m = pre + "mlp."
            self.ffn = _SwiGLU(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])
            with torch.no_grad():
                self.ffn.w1.mul_(g_post[:, None])
                self.ffn.w3.mul_(g_post[:, None])

    def forward(self, h, fc, mask):
        h = h + self.attn(_rms(h, None, self.c["eps"]), fc, mask)
        return h + self.ffn(_rms(h, None, self.c["eps"]))


class DeepseekV3Folded(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embed = _P(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_FoldedBlock(sd, c, i) for i in range(c["L"])])
        self.head = _P(_head(sd, c).t() * sd["model.norm.weight"][:, None])
        self.register_buffer("freqs_cis", _freqs_cis(c), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        fc = self.freqs_cis[_positions(input_ids, position_ids)]
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = self.embed[input_ids]
        for layer in self.layers:
            h = layer(h, fc, mask)
        return (_rms(h, None, self.c["eps"]) @ self.head).float()


# ----------------------------------------------------------------------------------------------------------------
# dsv3_expert_gather_scaled
# ----------------------------------------------------------------------------------------------------------------


class _GatherMoE(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        gu = sd[pre + "mlp.experts.gate_up_proj"]  # (E, 2I, H) [gate; up]
        self.router = _P(sd[pre + "mlp.gate.weight"])  # (E, H)
        self.register_buffer("router_bias", sd[pre + "mlp.gate.e_score_correction_bias"].float().clone())
        self.w13 = _P(gu.transpose(1, 2))  # (E, H, 2I)
        self.w2 = _P(sd[pre + "mlp.experts.down_proj"].transpose(1, 2) * c["rscale"])  # (E, I, H), scale folded
        s = pre + "mlp.shared_experts."
        self.shared = _SwiGLU(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"])

    def route(self, x):
        c = self.c
        N = x.shape[0]
        per = c["E"] // c["G"]
        s = torch.sigmoid(F.linear(x.float(), self.router))
        choice = (s + self.router_bias).view(N, c["G"], per)
        gscore = choice.topk(2, dim=-1).values.sum(-1)  # (N, G)
        gid = gscore.topk(c["TG"], dim=-1).indices  # (N, TG)
        kept = choice.gather(1, gid[..., None].expand(N, c["TG"], per))  # (N, TG, per)
        j = kept.flatten(1).topk(c["k"], dim=-1).indices  # positions inside the kept groups
        ids = gid.gather(1, j // per) * per + j % per
        w = s.gather(1, ids)
        if c["norm_topk"]:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w, ids  # routed_scaling_factor lives in w2

    def forward(self, x):
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        w, ids = self.route(xf)
        gu = torch.einsum("nh,nkhf->nkf", xf, self.w13[ids])
        g, u = gu.chunk(2, dim=-1)
        y = torch.einsum("nki,nkih->nkh", F.silu(g) * u, self.w2[ids])
        return (torch.einsum("nkh,nk->nh", y, w) + self.shared(xf)).view(B, T, H)


class _GatherBlock(_RefBlock):
    def __init__(self, sd, c, i):
        super().__init__(sd, c, i)
        if c["moe"][i]:
            self.ffn = _GatherMoE(sd, c, i)


class DeepseekV3Gather(DeepseekV3Baseline):
    def __init__(self, sd, c):
        super().__init__(sd, c)
        self.layers = nn.ModuleList([_GatherBlock(sd, c, i) for i in range(c["L"])])


# ----------------------------------------------------------------------------------------------------------------
# dsv3_shared_as_expert
# ----------------------------------------------------------------------------------------------------------------


class _FusedSharedMoE(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        g, u, d = _experts_hf(sd, pre)
        s = pre + "mlp.shared_experts."
        assert sd[s + "gate_proj.weight"].shape[0] == g.shape[1], "fusion needs n_shared_experts == 1"
        self.gate_proj = _P(torch.cat([g, sd[s + "gate_proj.weight"][None]]))  # (E + 1, I, H)
        self.up_proj = _P(torch.cat([u, sd[s + "up_proj.weight"][None]]))
        self.down_proj = _P(torch.cat([d, sd[s + "down_proj.weight"][None]]))  # (E + 1, H, I)
        self.gate = _linear(sd[pre + "mlp.gate.weight"])
        self.register_buffer("e_bias", sd[pre + "mlp.gate.e_score_correction_bias"].float().clone())

    def forward(self, x):
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        N, per = xf.shape[0], c["E"] // c["G"]
        s = self.gate(xf.float()).sigmoid()
        choice = s + self.e_bias
        gs = choice.view(N, c["G"], per).sort(dim=-1, descending=True).values[..., :2].sum(-1)
        gmask = torch.zeros(N, c["G"], dtype=torch.bool, device=xf.device).scatter(
            1, gs.topk(c["TG"], -1).indices, True
        )
        choice = choice.masked_fill(~gmask.repeat_interleave(per, dim=1), float("-inf"))
        ids = choice.topk(c["k"], -1).indices
        w = s.gather(1, ids)
        if c["norm_topk"]:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        combine = xf.new_zeros(N, c["E"] + 1).scatter(1, ids, w * c["rscale"])
        combine[:, c["E"]] = 1.0  # the shared expert: always on, weight 1
        hid = F.silu(torch.einsum("nh,eih->nei", xf, self.gate_proj)) * torch.einsum("nh,eih->nei", xf, self.up_proj)
        y = torch.einsum("nei,ehi->neh", hid, self.down_proj)
        return torch.einsum("neh,ne->nh", y, combine).view(B, T, H)


class _FusedSharedBlock(_AbsorbBlock):
    def __init__(self, sd, c, i):
        super().__init__(sd, c, i)
        self.attn = _HalfMLA(sd, c, i)
        if c["moe"][i]:
            self.ffn = _FusedSharedMoE(sd, c, i)

    def forward(self, x, cos, sin, allowed):
        x = x + self.attn(self.attn_norm(x), cos, sin, allowed)
        return x + self.ffn(self.ffn_norm(x))


class DeepseekV3SharedFused(DeepseekV3RotateHalf):
    def __init__(self, sd, c):
        super().__init__(sd, c)
        self.blocks = nn.ModuleList([_FusedSharedBlock(sd, c, i) for i in range(c["L"])])


# ----------------------------------------------------------------------------------------------------------------
# dsv3_heads_einsum
# ----------------------------------------------------------------------------------------------------------------


class _EinsumMLA(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        nh = c["nh"]
        self.q_a = _P(sd[a + "q_a_proj.weight"].t())  # (H, q_lora)
        self.q_a_norm = _P(sd[a + "q_a_layernorm.weight"])
        self.q_b = _P(sd[a + "q_b_proj.weight"].view(nh, c["qk"], -1).transpose(1, 2))  # (heads, q_lora, qk)
        self.kv_a = _P(sd[a + "kv_a_proj_with_mqa.weight"].t())  # (H, kv_lora + rope)
        self.kv_a_norm = _P(sd[a + "kv_a_layernorm.weight"])
        self.kv_b = _P(sd[a + "kv_b_proj.weight"].view(nh, c["nope"] + c["vd"], -1).transpose(1, 2))
        self.o = _P(sd[a + "o_proj.weight"].view(c["H"], nh, c["vd"]).permute(1, 2, 0))  # (heads, v, hidden)

    @staticmethod
    def _rope_even_odd(x, cos, sin):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)

    def forward(self, x, cos, sin, allowed):
        c = self.c
        nope = c["nope"]
        ql = _rms(torch.einsum("bth,hr->btr", x, self.q_a), self.q_a_norm, _LORA_EPS)
        q = torch.einsum("btr,nrd->bntd", ql, self.q_b)  # (B, heads, T, qk)
        kva = torch.einsum("bth,hr->btr", x, self.kv_a)
        lat = _rms(kva[..., : c["kv_lora"]], self.kv_a_norm, _LORA_EPS)
        k_pe = self._rope_even_odd(kva[..., c["kv_lora"] :], cos, sin)  # (B, T, rope)
        kv = torch.einsum("btr,nrd->bntd", lat, self.kv_b)
        q_pe = self._rope_even_odd(q[..., nope:], cos[:, None], sin[:, None])
        s = torch.einsum("bntd,bnsd->bnts", q[..., :nope], kv[..., :nope])
        s = (s + torch.einsum("bntd,bsd->bnts", q_pe, k_pe)) * c["scale"]
        s = torch.where(allowed, s, s.new_tensor(torch.finfo(torch.float32).min))
        o = torch.einsum("bnts,bnsd->bntd", s.softmax(-1), kv[..., nope:])
        return torch.einsum("bntd,ndh->bth", o, self.o)


class _EinsumBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        self.ln_attn = _P(sd[pre + "input_layernorm.weight"])
        self.ln_ffn = _P(sd[pre + "post_attention_layernorm.weight"])
        self.mla = _EinsumMLA(sd, c, i)
        m = pre + "mlp."
        self.ffn = (
            _RefMoE(sd, c, i)
            if c["moe"][i]
            else _SwiGLU(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])
        )

    def forward(self, h, cos, sin, allowed):
        h = h + self.mla(_rms(h, self.ln_attn, self.c["eps"]), cos, sin, allowed)
        return h + self.ffn(_rms(h, self.ln_ffn, self.c["eps"]))


class DeepseekV3Einsum(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.tok = _P(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([_EinsumBlock(sd, c, i) for i in range(c["L"])])
        self.ln_out = _P(sd["model.norm.weight"])
        self.unembed = _P(_head(sd, c).t())
        self.register_buffer("inv_freq", c["inv_freq"].clone(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        ang = _positions(input_ids, position_ids).float()[..., None] * self.inv_freq  # (B, T, rope/2)
        cos, sin = ang.cos() * self.c["att"], ang.sin() * self.c["att"]
        allowed = _allowed(attention_mask, B, T, input_ids.device)
        h = F.embedding(input_ids, self.tok)
        for blk in self.blocks:
            h = blk(h, cos, sin, allowed)
        return torch.einsum("bth,hv->btv", _rms(h, self.ln_out, self.c["eps"]), self.unembed).float()


# ----------------------------------------------------------------------------------------------------------------
# dsv3_stacked_functional
# ----------------------------------------------------------------------------------------------------------------

_KINDS = [
    "ln1", "ln2", "q_a", "q_a_ln", "q_b", "kv_a", "kv_a_ln", "kv_b", "o",  # (L, ...)
    "router", "router_bias", "w1", "w3", "w2", "sw1", "sw3", "sw2",  # (L_moe, ...)
    "dw1", "dw3", "dw2",  # (L_dense, ...)
    "embed", "final_ln", "head",
]  # fmt: skip


def _stacked_forward(W, c, freqs_cis, moe_slot, input_ids, attention_mask, position_ids):
    B, T = input_ids.shape
    nh, nope, rope, eps = c["nh"], c["nope"], c["rope"], c["eps"]
    fc = freqs_cis[_positions(input_ids, position_ids)]
    mask = _additive(attention_mask, B, T, input_ids.device)
    h = F.embedding(input_ids, W["embed"])
    for l in range(c["L"]):
        x = _rms(h, W["ln1"][l], eps)
        q = F.linear(_rms(F.linear(x, W["q_a"][l]), W["q_a_ln"][l], _LORA_EPS), W["q_b"][l])
        q = q.view(B, T, nh, c["qk"]).transpose(1, 2)
        kv, k_pe = F.linear(x, W["kv_a"][l]).split([c["kv_lora"], rope], -1)
        kv = F.linear(_rms(kv, W["kv_a_ln"][l], _LORA_EPS), W["kv_b"][l]).view(B, T, nh, -1).transpose(1, 2)
        q_pe = _rope_complex(q[..., nope:], fc[:, None])
        k_pe = _rope_complex(k_pe, fc)[:, None].expand(B, nh, T, rope)
        qq = torch.cat([q[..., :nope], q_pe], -1)
        kk = torch.cat([kv[..., :nope], k_pe], -1)
        a = torch.softmax(qq @ kk.transpose(-1, -2) * c["scale"] + mask, -1) @ kv[..., nope:]
        h = h + F.linear(a.transpose(1, 2).reshape(B, T, -1), W["o"][l])
        x = _rms(h, W["ln2"][l], eps)
        s = moe_slot[l]
        if c["moe"][l]:
            xf = x.reshape(B * T, -1)
            w, ids = _gate(xf, W["router"][s].t(), W["router_bias"][s], c)
            flat = ids.flatten()
            order = flat.argsort(stable=True)
            tok, wt = order // c["k"], w.flatten()[order]
            counts = torch.bincount(flat, minlength=c["E"]).tolist()
            ys, start = [], 0
            for e, n in enumerate(counts):
                xe = xf[tok[start : start + n]]
                ys.append(F.linear(F.silu(F.linear(xe, W["w1"][s, e])) * F.linear(xe, W["w3"][s, e]), W["w2"][s, e]))
                start += n
            y = torch.zeros_like(xf).index_add_(0, tok, torch.cat(ys) * wt[:, None])
            sh = F.linear(F.silu(F.linear(xf, W["sw1"][s])) * F.linear(xf, W["sw3"][s]), W["sw2"][s])
            h = h + (y + sh).view(B, T, -1)
        else:
            h = h + F.linear(F.silu(F.linear(x, W["dw1"][s])) * F.linear(x, W["dw3"][s]), W["dw2"][s])
    return F.linear(_rms(h, W["final_ln"], eps), W["head"]).float()


class DeepseekV3Stacked(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        L = c["L"]
        moe_ids = [i for i in range(L) if c["moe"][i]]
        dense_ids = [i for i in range(L) if not c["moe"][i]]
        self.moe_slot = [moe_ids.index(i) if c["moe"][i] else dense_ids.index(i) for i in range(L)]

        def st(name, ids):
            return torch.stack([sd[f"model.layers.{i}.{name}"] for i in ids])

        a = "self_attn."
        t = {
            "ln1": st("input_layernorm.weight", range(L)),
            "ln2": st("post_attention_layernorm.weight", range(L)),
            "q_a": st(a + "q_a_proj.weight", range(L)),
            "q_a_ln": st(a + "q_a_layernorm.weight", range(L)),
            "q_b": st(a + "q_b_proj.weight", range(L)),
            "kv_a": st(a + "kv_a_proj_with_mqa.weight", range(L)),
            "kv_a_ln": st(a + "kv_a_layernorm.weight", range(L)),
            "kv_b": st(a + "kv_b_proj.weight", range(L)),
            "o": st(a + "o_proj.weight", range(L)),
            "embed": sd["model.embed_tokens.weight"],
            "final_ln": sd["model.norm.weight"],
            "head": _head(sd, c),
        }
        empty = torch.zeros(0)
        if moe_ids:
            ex = [_experts_hf(sd, f"model.layers.{i}.") for i in moe_ids]
            t["router"] = st("mlp.gate.weight", moe_ids)
            t["router_bias"] = st("mlp.gate.e_score_correction_bias", moe_ids)
            t["w1"] = torch.stack([e[0] for e in ex])  # (Lm, E, I, H)
            t["w3"] = torch.stack([e[1] for e in ex])
            t["w2"] = torch.stack([e[2] for e in ex])  # (Lm, E, H, I)
            t["sw1"] = st("mlp.shared_experts.gate_proj.weight", moe_ids)
            t["sw3"] = st("mlp.shared_experts.up_proj.weight", moe_ids)
            t["sw2"] = st("mlp.shared_experts.down_proj.weight", moe_ids)
        if dense_ids:
            t["dw1"] = st("mlp.gate_proj.weight", dense_ids)
            t["dw3"] = st("mlp.up_proj.weight", dense_ids)
            t["dw2"] = st("mlp.down_proj.weight", dense_ids)
        self.weights = nn.ParameterList([_P(t.get(k, empty)) for k in _KINDS])
        self.register_buffer("freqs_cis", _freqs_cis(c), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        W = dict(zip(_KINDS, self.weights))
        return _stacked_forward(W, self.c, self.freqs_cis, self.moe_slot, input_ids, attention_mask, position_ids)


# ----------------------------------------------------------------------------------------------------------------
# dsv3_latent_cache_decode
# ----------------------------------------------------------------------------------------------------------------


def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class _CacheMLA(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        self.q_a_proj = _linear(sd[a + "q_a_proj.weight"])
        self.q_a_norm = _RMSNorm(sd[a + "q_a_layernorm.weight"], _LORA_EPS)
        self.q_b_proj = _linear(sd[a + "q_b_proj.weight"])
        self.kv_a_proj = _linear(sd[a + "kv_a_proj_with_mqa.weight"])
        self.kv_a_norm = _RMSNorm(sd[a + "kv_a_layernorm.weight"], _LORA_EPS)
        self.kv_b_proj = _linear(sd[a + "kv_b_proj.weight"])
        self.o_proj = _linear(sd[a + "o_proj.weight"])

    def step(self, x, cos, sin, cache, t, key_ok):
        """x (B, H) of token t; cache: dict latent (B, Tmax, kv_lora), pe (B, Tmax, rope)."""
        c = self.c
        B = x.shape[0]
        nh, nope = c["nh"], c["nope"]
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(B, nh, c["qk"])
        q_pe = q[..., nope:] * cos[:, None] + _rotate_every_two(q[..., nope:]) * sin[:, None]
        lat, pe = self.kv_a_proj(x).split([c["kv_lora"], c["rope"]], -1)
        cache["latent"][:, t] = self.kv_a_norm(lat)
        cache["pe"][:, t] = pe * cos + _rotate_every_two(pe) * sin
        kv = self.kv_b_proj(cache["latent"][:, : t + 1]).view(B, t + 1, nh, nope + c["vd"])
        s = torch.einsum("bhd,bshd->bhs", q[..., :nope], kv[..., :nope])
        s = (s + torch.einsum("bhd,bsd->bhs", q_pe, cache["pe"][:, : t + 1])) * c["scale"]
        s = s.masked_fill(~key_ok[:, None, :], torch.finfo(torch.float32).min)
        o = torch.einsum("bhs,bshd->bhd", torch.softmax(s, -1), kv[..., nope:])
        return self.o_proj(o.reshape(B, -1))


class _CacheBlock(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.input_norm = _RMSNorm(sd[pre + "input_layernorm.weight"], c["eps"])
        self.post_norm = _RMSNorm(sd[pre + "post_attention_layernorm.weight"], c["eps"])
        self.attn = _CacheMLA(sd, c, i)
        m = pre + "mlp."
        if c["moe"][i]:
            self.mlp = _AbsorbMoE(sd, c, i)
        else:
            self.mlp = _Expert(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"])


class DeepseekV3LatentCache(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["V"], c["H"], _weight=_P(sd["model.embed_tokens.weight"]))
        self.blocks = nn.ModuleList([_CacheBlock(sd, c, i) for i in range(c["L"])])
        self.norm = _RMSNorm(sd["model.norm.weight"], c["eps"])
        self.lm_head = _linear(_head(sd, c))
        ang = torch.outer(torch.arange(c["maxpos"], dtype=torch.float), c["inv_freq"])
        self.register_buffer("cos_il", ang.cos().repeat_interleave(2, -1) * c["att"], persistent=False)
        self.register_buffer("sin_il", ang.sin().repeat_interleave(2, -1) * c["att"], persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        B, T = input_ids.shape
        if position_ids is None and attention_mask is not None:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            pos = _positions(input_ids, position_ids)
        ok = (
            torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
            if attention_mask is None
            else attention_mask.bool()
        )
        dev = input_ids.device
        caches = [
            {"latent": torch.zeros(B, T, c["kv_lora"], device=dev), "pe": torch.zeros(B, T, c["rope"], device=dev)}
            for _ in self.blocks
        ]
        out = []
        for t in range(T):
            cos, sin = self.cos_il[pos[:, t]], self.sin_il[pos[:, t]]  # (B, rope)
            x = self.embed_tokens(input_ids[:, t])
            for blk, cache in zip(self.blocks, caches):
                x = x + blk.attn.step(blk.input_norm(x), cos, sin, cache, t, ok[:, : t + 1])
                x = x + blk.mlp(blk.post_norm(x))
            out.append(self.lm_head(self.norm(x)))
        return torch.stack(out, 1).float()


# ----------------------------------------------------------------------------------------------------------------


_VARIANTS = {
    "": DeepseekV3Baseline,
    "dsv3_absorbed_mla": DeepseekV3Absorbed,
    "dsv3_rotate_half_deinterleaved": DeepseekV3RotateHalf,
    "dsv3_fused_qkv_a_folded_norms": DeepseekV3Folded,
    "dsv3_expert_gather_scaled": DeepseekV3Gather,
    "dsv3_shared_as_expert": DeepseekV3SharedFused,
    "dsv3_heads_einsum": DeepseekV3Einsum,
    "dsv3_stacked_functional": DeepseekV3Stacked,
    "dsv3_latent_cache_decode": DeepseekV3LatentCache,
}


def build(state_dict, config):
    if BUG not in _VARIANTS:
        raise ValueError(f"unknown layout variant {BUG!r}")
    c = _conf(config)
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    with torch.no_grad():
        model = _VARIANTS[BUG](sd, c)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
