"""Hand-written plain-PyTorch port of GLM-MoE-DSA (GLM-5, Transformers `glm_moe_dsa`): DeepSeek-style MLA attention
with a DSA "lightning indexer" that picks the top-k keys of every query (shared across layers on "shared" layers),
and a DeepSeek-V3 MoE (sigmoid router with correction bias, grouped top-k, shared experts).

Architecture as this port implements it (all in float32; x is the residual stream, (B, S, hidden)):
- h = emb[input_ids] (no scaling); untied head; final RMSNorm with config.rms_norm_eps; logits = norm(x) @ head_t.
- RMSNorm(x) = w * (x * rsqrt(mean(x^2) + eps)) (plain weight, no 1 + w).
- decoder layer i:  x = x + Attn(RMSNorm_in(x));  x = x + FFN(RMSNorm_post(x))   (both norms: config.rms_norm_eps).
- rotary (YaRN when rope_parameters.rope_type == "yarn", over the r = qk_rope_head_dim rope channels):
    inv_freq = interp * (1 - e) + extrap * e with extrap = theta^(-2j/r), interp = extrap / factor,
    e = 1 - clamp((j - low) / (high - low), 0, 1), (low, high) = YaRN correction range (beta_fast, beta_slow,
    original_max_position_embeddings; floored / ceiled);  cos, sin = af * cos(p * inv_freq), af * sin(p * inv_freq)
    with af = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim), mscale_of(s, m) = 0.1 m ln s + 1.
    RoPE pairs are INTERLEAVED: (x[2j], x[2j+1]) rotated by angle j; the output is written de-interleaved,
    [x_even * cos - x_odd * sin, x_odd * cos + x_even * sin] (the same permutation for q and k, so q.k is unchanged).
- MLA attention (H heads, per head q/k = [nope (dn) | rope (r)], v of width dv):
    one fused down projection of the normed input n:  [q_lat | kv_lat | k_rope | idx_k | idx_w] = n @ down_t + down_b
    q = RMSNorm_q(q_lat; eps 1e-6) @ q_up_t -> (H, dn + r) = [q_nope | q_rope]
    c = RMSNorm_kv(kv_lat; eps 1e-6);  k_nope_h = c @ uk_h^T,  v_h = c @ uv_h^T;  k_rope shared by all heads
    q_rope, k_rope rotated;  scores = (q_nope . k_nope + q_rope . k_rope) * scale,
    scale = (dn + r)^-0.5 * mscale_of(factor, mscale_all_dim)^2   (YaRN only; 1 otherwise)
    additive mask: causal, padded keys, and keys NOT selected by the indexer -> finfo.min; softmax; o = P v;
    out = concat_h(o_h) @ o_t + o_b.
- DSA indexer (on "full" layers; "shared" layers reuse the selection of the most recent full layer):
    qi = RMSNorm_q(q_lat) @ iq_t -> (Hi, di), ki = LayerNorm(idx_k; eps 1e-6, weight + bias) -> (di,) per token;
    the FIRST r channels of qi / ki are rotated (interleaved RoPE), the rest pass;
    s[h, t] = relu(qi_h . ki_t * di^-0.5);  index[t] = sum_h (idx_w_h * Hi^-0.5) * s[h, t];  index += causal/pad mask;
    selected = top-k(index) with k = min(index_topk, T).
- FFN: dense layers (mlp_layer_types == "dense"): down(silu(gate n) * up n).
  MoE layers: p = sigmoid(n @ router_t); choice = p + correction_bias; experts split in n_group groups, a group
  scored by the sum of its two best choice values, keep the topk_group best groups, choose the top_k experts by
  choice inside them; weights = p[chosen] / (sum + 1e-20) (norm_topk_prob) * routed_scaling_factor;
  out = sum_k weight_k * expert_k(n) + shared(n), shared = dense MLP of width moe_intermediate * n_shared_experts.
- attention_mask (B, S) of 1/0 (left padding) masks padded keys in the attention and in the indexer;
  position_ids default to arange(S).
Weight layout of this port (own names; transposed = stored (in, out)):
- emb (V, D); head_t (D, V) transposed; norm.w (D,).
- blocks[i]: ln_attn.w, ln_ffn.w (D,);
  attn.down.w (D, ql + kl + r [+ di + Hi]) = [q_a | kv_a_with_mqa | indexer wk | indexer weights_proj] fused and
  transposed, attn.down.b the matching bias (zeros for the two indexer parts);
  attn.q_norm.w (ql,), attn.kv_norm.w (kl,); attn.q_up.w (ql, H (dn + r)) transposed;
  attn.kv_up.uk (H, dn, kl), attn.kv_up.uv (H, dv, kl): kv_b_proj split per head;
  attn.out.w (H dv, D) transposed, attn.out.b (D,);
  attn.indexer.q_proj.w (ql, Hi di) transposed, attn.indexer.k_norm.wb (2, di) = [weight; bias].
- dense ffn: ffn.gu (D, 2I) = [gate | up] fused + transposed, ffn.dn (I, D) transposed.
- MoE ffn: ffn.router.w_t (D, E) transposed, ffn.router.corr (E,) buffer;
  ffn.experts.wg / wu (E, D, I) split from gate_up_proj and transposed, ffn.experts.wd (E, I, D) transposed;
  ffn.shared.gu (D, 2 Is), ffn.shared.dn (Is, D).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "mscale_once",  # YaRN softmax scale multiplied by mscale_of(factor, mscale_all_dim) once instead of squared
    "indexer_rope_neox",  # indexer RoPE pairs channel j with j + r/2 (DeepSeek-V3.2's indexer) instead of 2j with 2j+1
    "q_split_rope_first",  # MLA query head split as [rope | nope] (the indexer's order) instead of [nope | rope]
    "indexer_k_rmsnorm",  # indexer key norm done as an RMSNorm (no mean removal, no bias) instead of a LayerNorm
    "indexer_relu_after_sum",  # indexer ReLU applied to the head-weighted sum instead of to each head's score
    "shared_topk_stale",  # "shared" layers reuse the FIRST full layer's selection instead of the latest one
    "sparse_mask_after_softmax",  # unselected keys zeroed after the softmax (no renormalisation), not masked before
    "router_softmax",  # router scores softmax(logits) (DeepSeek-V2 style) instead of sigmoid(logits)
    "bias_in_weights",  # expert weights gathered from the bias-corrected scores instead of the raw sigmoid scores
    "group_score_max",  # expert group scored by its best expert (max) instead of the sum of its two best
    "scale_before_norm",  # routed_scaling_factor applied before the top-k renormalisation, so it cancels out
    "kv_b_blockwise_split",  # kv_b_proj split at load as [all heads' k_nope rows | all heads' v rows], not per head
    "latent_norm_eps_config",  # q_a / kv_a latent RMSNorms built with config.rms_norm_eps instead of their fixed 1e-6
    "indexer_causal_only",  # indexer scores masked causally only: padded keys can take top-k slots (padding only)
]
PADDING_ONLY = ["indexer_causal_only"]
CLEAN = [
    "absorbed_mla",  # kv_b absorbed: q_nope -> latent space via uk, attention over the latent, uv applied after
    "gathered_sparse_attention",  # attention over the gathered top-k keys of each query instead of a dense mask
    "threshold_select",  # indexer selection as index >= k-th largest value instead of top-k indices + scatter
    "dense_moe",  # every expert run on every token, combined with a dense (tokens, experts) weight matrix
    "complex_rope",  # RoPE as a complex multiply on interleaved pairs, output left interleaved (q and k alike)
]

NEG = torch.finfo(torch.float32).min


def _mscale_of(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope_tables(config):
    """inv_freq over the rope channels, the cos/sin factor, and the extra softmax-scale factor."""
    rp = dict(config.rope_parameters or {})
    dim = config.qk_rope_head_dim
    base = rp.get("rope_theta", 10000.0)
    extrap = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rp.get("rope_type", "default") != "yarn":
        return extrap, 1.0, 1.0
    orig = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or config.max_position_embeddings / orig
    ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
    af = rp.get("attention_factor")
    if af is None:
        af = _mscale_of(factor, ms) / _mscale_of(factor, msa) if (ms and msa) else _mscale_of(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    soft = 1.0
    if msa:
        m = _mscale_of(factor, msa)
        soft = m if BUG == "mscale_once" else m * m
    return inv, af, soft


def rope(x, cos, sin, neox=False):
    """Rotates the last dim of x (pairs interleaved), cos / sin (..., r/2) broadcast against x[..., ::2]."""
    if BUG == "complex_rope" and not neox:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        rot = torch.complex(cos, sin)
        return torch.view_as_real(xc * rot).flatten(-2)
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.w = nn.Parameter(w)
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w * (x * torch.rsqrt(var + self.eps))


class Affine(nn.Module):
    """y = x @ w (+ b), w stored (in, out)."""

    def __init__(self, w_t, b=None):
        super().__init__()
        self.w = nn.Parameter(w_t.contiguous())
        self.b = None if b is None else nn.Parameter(b)

    def forward(self, x):
        y = x @ self.w
        return y if self.b is None else y + self.b


class KvUp(nn.Module):
    """The per-head up projection of the normed KV latent: (k_nope, v), each (B, H, S, .)."""

    def __init__(self, kv_b, heads, dn, dv):
        super().__init__()
        if BUG == "kv_b_blockwise_split":
            uk, uv = kv_b[: heads * dn].view(heads, dn, -1), kv_b[heads * dn :].view(heads, dv, -1)
        else:
            per_head = kv_b.view(heads, dn + dv, -1)
            uk, uv = per_head[:, :dn], per_head[:, dn:]
        self.uk = nn.Parameter(uk.contiguous())
        self.uv = nn.Parameter(uv.contiguous())

    def forward(self, c):  # c (B, S, kl)
        k = torch.einsum("bsr,hnr->bhsn", c, self.uk)
        v = torch.einsum("bsr,hvr->bhsv", c, self.uv)
        return k, v


class KeyNorm(nn.Module):
    """The indexer's key LayerNorm (eps 1e-6), weight and bias stacked as one (2, di) tensor."""

    def __init__(self, w, b):
        super().__init__()
        self.wb = nn.Parameter(torch.stack([w, b]))

    def forward(self, x):
        if BUG == "indexer_k_rmsnorm":
            return self.wb[0] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return F.layer_norm(x, (x.shape[-1],), self.wb[0], self.wb[1], 1e-6)


class Indexer(nn.Module):
    """Lightning indexer: returns the boolean selection (B, S, T) of each query's top-k keys."""

    def __init__(self, iq, k_w, k_b, heads, dim, rope_dim, topk):
        super().__init__()
        self.q_proj = Affine(iq.t())
        self.k_norm = KeyNorm(k_w, k_b)
        self.heads, self.dim, self.rope_dim, self.topk = heads, dim, rope_dim, topk

    def forward(self, q_lat_n, k_raw, w_raw, cos, sin, mask_add):
        b, s, _ = q_lat_n.shape
        r = self.rope_dim
        q = self.q_proj(q_lat_n).view(b, s, self.heads, self.dim)
        k = self.k_norm(k_raw)
        neox = BUG == "indexer_rope_neox"
        q = torch.cat([rope(q[..., :r], cos.unsqueeze(2), sin.unsqueeze(2), neox), q[..., r:]], dim=-1)
        k = torch.cat([rope(k[..., :r], cos, sin, neox), k[..., r:]], dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * self.dim**-0.5  # (B, S, Hi, T)
        if BUG != "indexer_relu_after_sum":
            scores = F.relu(scores)
        weights = w_raw * self.heads**-0.5
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, S, T)
        if BUG == "indexer_relu_after_sum":
            index = F.relu(index)
        index = index + mask_add
        k_top = min(self.topk, index.shape[-1])
        if BUG == "threshold_select":
            kth = index.topk(k_top, dim=-1).values[..., -1:]
            return index >= kth
        top = index.topk(k_top, dim=-1).indices
        return torch.zeros_like(index, dtype=torch.bool).scatter(-1, top, True)


class Attention(nn.Module):
    def __init__(self, sd, p, config, full, soft):
        super().__init__()
        c = config
        self.h, self.dn, self.r, self.dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.ql, self.kl = c.q_lora_rank, c.kv_lora_rank
        self.full = full
        ws = [sd[p + "q_a_proj.weight"], sd[p + "kv_a_proj_with_mqa.weight"]]
        bias = c.attention_bias
        bs = [sd[p + "q_a_proj.bias"], sd[p + "kv_a_proj_with_mqa.bias"]] if bias else None
        if full:
            self.ih, self.idim = c.index_n_heads, c.index_head_dim
            ws += [sd[p + "indexer.wk.weight"], sd[p + "indexer.weights_proj.weight"]]
            if bias:
                bs += [torch.zeros(self.idim), torch.zeros(self.ih)]
        self.down = Affine(torch.cat(ws, 0).t(), None if bs is None else torch.cat(bs))
        eps = c.rms_norm_eps if BUG == "latent_norm_eps_config" else 1e-6
        self.q_norm = RMSNorm(sd[p + "q_a_layernorm.weight"], eps)
        self.kv_norm = RMSNorm(sd[p + "kv_a_layernorm.weight"], eps)
        self.q_up = Affine(sd[p + "q_b_proj.weight"].t())
        self.kv_up = KvUp(sd[p + "kv_b_proj.weight"], self.h, self.dn, self.dv)
        self.out = Affine(sd[p + "o_proj.weight"].t(), sd[p + "o_proj.bias"] if bias else None)
        self.scale = (self.dn + self.r) ** -0.5 * soft
        if full:
            self.indexer = Indexer(
                sd[p + "indexer.wq_b.weight"],
                sd[p + "indexer.k_norm.weight"],
                sd[p + "indexer.k_norm.bias"],
                self.ih,
                self.idim,
                self.r,
                c.index_topk,
            )

    def forward(self, n, cos, sin, mask_add, idx_mask_add, prev_sel):
        b, s, _ = n.shape
        h, dn, r = self.h, self.dn, self.r
        fused = self.down(n)
        q_lat, kv_lat, k_rot = (
            fused[..., : self.ql],
            fused[..., self.ql : self.ql + self.kl],
            fused[..., self.ql + self.kl : self.ql + self.kl + r],
        )
        q_lat_n = self.q_norm(q_lat)
        q = self.q_up(q_lat_n).view(b, s, h, dn + r).transpose(1, 2)
        if BUG == "q_split_rope_first":
            q_rot, q_nope = q[..., :r], q[..., r:]
        else:
            q_nope, q_rot = q[..., :dn], q[..., dn:]
        c_kv = self.kv_norm(kv_lat)
        q_rot = rope(q_rot, cos.unsqueeze(1), sin.unsqueeze(1))
        k_rot = rope(k_rot.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1))  # (B, 1, S, r)

        if self.full:
            o = self.ql + self.kl + r
            sel = self.indexer(
                q_lat_n, fused[..., o : o + self.idim], fused[..., o + self.idim :], cos, sin, idx_mask_add
            )
        else:
            sel = prev_sel

        if BUG == "absorbed_mla":
            q_abs = torch.einsum("bhsn,hnr->bhsr", q_nope, self.kv_up.uk)
            lat = c_kv.unsqueeze(1)  # (B, 1, T, kl)
            scores = (q_abs @ lat.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scale
            scores = (scores + mask_add.unsqueeze(1)).masked_fill(~sel.unsqueeze(1), NEG)
            o_lat = scores.softmax(-1) @ lat  # (B, H, S, kl)
            attn = torch.einsum("bhsr,hvr->bhsv", o_lat, self.kv_up.uv)
        else:
            k_nope, v = self.kv_up(c_kv)
            k = torch.cat([k_nope, k_rot.expand(-1, h, -1, -1)], dim=-1)
            qf = torch.cat([q_nope, q_rot], dim=-1)
            if BUG == "gathered_sparse_attention":
                k_top = int(sel.sum(-1).max())
                idx = sel.to(torch.uint8).sort(dim=-1, descending=True, stable=True).indices[..., :k_top]  # (B,S,K)
                gi = idx[:, None, :, :, None]  # (B, 1, S, K, 1)
                kg = torch.gather(k.unsqueeze(2).expand(-1, -1, s, -1, -1), 3, gi.expand(-1, h, -1, -1, k.shape[-1]))
                vg = torch.gather(v.unsqueeze(2).expand(-1, -1, s, -1, -1), 3, gi.expand(-1, h, -1, -1, v.shape[-1]))
                mg = torch.gather(mask_add, 2, idx).unsqueeze(1)  # (B, 1, S, K)
                sc = torch.einsum("bhsd,bhskd->bhsk", qf, kg) * self.scale + mg
                attn = torch.einsum("bhsk,bhskv->bhsv", sc.softmax(-1), vg)
            else:
                scores = qf @ k.transpose(-1, -2) * self.scale + mask_add.unsqueeze(1)
                if BUG == "sparse_mask_after_softmax":
                    probs = scores.softmax(-1) * sel.unsqueeze(1)
                else:
                    probs = scores.masked_fill(~sel.unsqueeze(1), NEG).softmax(-1)
                attn = probs @ v
        y = self.out(attn.transpose(1, 2).reshape(b, s, -1))
        return y, sel


class Mlp(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gu = nn.Parameter(torch.cat([gate, up], 0).t().contiguous())
        self.dn = nn.Parameter(down.t().contiguous())

    def forward(self, x):
        g, u = (x @ self.gu).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.dn


class Router(nn.Module):
    def __init__(self, w, corr, config):
        super().__init__()
        self.w_t = nn.Parameter(w.t().contiguous())
        self.register_buffer("corr", corr.clone())
        self.top_k, self.groups, self.top_groups = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm, self.rsf = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x):  # x (T, D) -> weights (T, k), experts (T, k)
        logits = x @ self.w_t
        p = logits.softmax(-1) if BUG == "router_softmax" else logits.sigmoid()
        choice = p + self.corr
        t, e = choice.shape
        grouped = choice.view(t, self.groups, e // self.groups)
        if BUG == "group_score_max":
            g_score = grouped.max(-1).values
        else:
            g_score = grouped.topk(2, dim=-1).values.sum(-1)
        g_keep = torch.zeros_like(g_score).scatter(1, g_score.topk(self.top_groups, dim=-1).indices, 1.0)
        keep = g_keep.unsqueeze(-1).expand(-1, -1, e // self.groups).reshape(t, e).bool()
        experts = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices
        w = (choice if BUG == "bias_in_weights" else p).gather(1, experts)
        if BUG == "scale_before_norm":
            w = w * self.rsf
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if BUG != "scale_before_norm":
            w = w * self.rsf
        return w, experts


class Experts(nn.Module):
    def __init__(self, gate_up, down):
        super().__init__()
        inter = gate_up.shape[1] // 2
        self.wg = nn.Parameter(gate_up[:, :inter].transpose(1, 2).contiguous())
        self.wu = nn.Parameter(gate_up[:, inter:].transpose(1, 2).contiguous())
        self.wd = nn.Parameter(down.transpose(1, 2).contiguous())

    def forward(self, x, w, experts):
        n_exp = self.wg.shape[0]
        if BUG == "dense_moe":
            h = F.silu(torch.einsum("td,edi->tei", x, self.wg)) * torch.einsum("td,edi->tei", x, self.wu)
            y = torch.einsum("tei,eid->ted", h, self.wd)
            comb = torch.zeros(x.shape[0], n_exp, dtype=x.dtype).scatter(1, experts, w)
            return torch.einsum("te,ted->td", comb, y)
        out = torch.zeros_like(x)
        for e in range(n_exp):
            tok, slot = torch.where(experts == e)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            ye = (F.silu(xe @ self.wg[e]) * (xe @ self.wu[e])) @ self.wd[e]
            out.index_add_(0, tok, ye * w[tok, slot, None])
        return out


class Moe(nn.Module):
    def __init__(self, sd, p, config):
        super().__init__()
        self.router = Router(sd[p + "gate.weight"], sd[p + "gate.e_score_correction_bias"], config)
        self.experts = Experts(sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"])
        self.shared = Mlp(
            sd[p + "shared_experts.gate_proj.weight"],
            sd[p + "shared_experts.up_proj.weight"],
            sd[p + "shared_experts.down_proj.weight"],
        )

    def forward(self, x):
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        w, experts = self.router(flat)
        return self.experts(flat, w, experts).view(b, s, d) + self.shared(x)


class Block(nn.Module):
    def __init__(self, sd, i, config, soft):
        super().__init__()
        p = f"model.layers.{i}."
        eps = config.rms_norm_eps
        self.ln_attn = RMSNorm(sd[p + "input_layernorm.weight"], eps)
        self.ln_ffn = RMSNorm(sd[p + "post_attention_layernorm.weight"], eps)
        self.attn = Attention(sd, p + "self_attn.", config, config.indexer_types[i] == "full", soft)
        if config.mlp_layer_types[i] == "sparse":
            self.ffn = Moe(sd, p + "mlp.", config)
        else:
            self.ffn = Mlp(sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"], sd[p + "mlp.down_proj.weight"])

    def forward(self, x, cos, sin, mask_add, idx_mask_add, prev_sel):
        a, sel = self.attn(self.ln_attn(x), cos, sin, mask_add, idx_mask_add, prev_sel)
        x = x + a
        x = x + self.ffn(self.ln_ffn(x))
        return x, sel


class GlmMoeDsaPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        inv, af, soft = _rope_tables(config)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_gain = af
        self.emb = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.blocks = nn.ModuleList([Block(sd, i, config, soft) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(sd["model.norm.weight"], config.rms_norm_eps)
        head = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]
        self.head_t = nn.Parameter(head.t().contiguous())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, s = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, s, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)  # (B, S, T)
        mask_add = torch.zeros(b, s, s).masked_fill(~allowed, NEG)
        idx_mask_add = mask_add
        if BUG == "indexer_causal_only":
            idx_mask_add = torch.zeros(b, s, s).masked_fill(~causal.unsqueeze(0), NEG)
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos() * self.rope_gain, freqs.sin() * self.rope_gain  # (B, S, r/2)

        x = F.embedding(input_ids, self.emb)
        sel, first_sel = None, None
        for blk in self.blocks:
            x, new_sel = blk(x, cos, sin, mask_add, idx_mask_add, first_sel if BUG == "shared_topk_stale" else sel)
            if blk.attn.full and first_sel is None:
                first_sel = new_sel
            sel = new_sel
        return self.norm(x) @ self.head_t


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    return GlmMoeDsaPort(sd, config).eval()
