"""Hand-written plain-PyTorch port of Dots 3 Note Preview, text model (Transformers `dots3_note_text`,
Dots3NoteForCausalLM): DeepSeek-style MLA attention with a DSA top-k indexer, sliding-window layers with their own
MLA sizes and RoPE base, a per-head sigmoid output gate, and a DeepSeek-V3 MoE (sigmoid router with a choice-only
correction bias, grouped top-k, shared experts).

Architecture as this port implements it (all float32; `rms(x) = x * rsqrt(mean(x^2, -1) + eps)`, eps =
config.rms_norm_eps everywhere except the indexer's LayerNorm, eps 1e-6):
- h = embed[ids] (no embedding scale).  For each layer i (pre-norm):
      h = h + Attn_i(rms(h) * w_attn_norm);   h = h + FFN_i(rms(h) * w_ffn_norm)
  logits = (rms(h) * w_final_norm) @ head^T   (untied head).
- layer i's attention sizes come from config.per_layer_config[i] (sliding layers override heads, ranks, head dims):
  nh heads, q rank Rq, kv rank Rkv, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim.
- Attn (x = the normed input):
    q_lat  = rms(x Wqa^T + bqa) * w_qa * sqrt(H / Rq)        (Dots' q latent multiplier, after the norm)
    q      = q_lat Wqb^T, per head [q_nope (dn) | q_rope (dr)]
    [kv_lat | k_rope] = x Wkva^T + bkva                       (Rkv | dr, the rope key shared by all heads)
    kv_lat = rms(kv_lat) * w_kva * sqrt(H / Rkv)              (Dots' kv latent multiplier, after the norm)
    k_rope = rms(k_rope) * w_krope                            (Dots' extra norm on the shared rope key)
    per head [k_nope (dn) | v (dv)] = kv_lat Wkvb^T
    RoPE, interleaved pairs (x_{2j}, x_{2j+1}) rotated by angle pos * theta^{-2j/dr}, output laid out
    [all rotated evens | all rotated odds] (Transformers' layout; q and k the same), theta =
    config.rope_parameters[layer_type]["rope_theta"] (sliding layers have their own), on q_rope and k_rope.
    scores = [q_nope | q_rope] . [k_nope | k_rope] * (dn + dr)^-0.5 ; additive mask (finfo.min) where not allowed;
    allowed = causal (k <= q, array index) & key not padding & (sliding layers: q - k < sliding_window)
              & (indexed layers: k among the indexer's top-k for q)
    o = softmax(scores) v  per head;  o_h *= sigmoid(x Wg^T)_h  (one gate per head);  out = o Wo^T + bo
- DSA indexer (indexed_attention layers only; nI heads of width dI, top-k K = index_topk):
    iq = q_lat Wiq^T (the scaled q latent), per head; ik = LayerNorm(x Wik^T) (weight, bias, eps 1e-6);
    interleaved RoPE (same cos/sin as the layer) on the first dr channels of iq and ik;
    s[q, k] = sum_h (x Wiw^T)_h * nI^-0.5 * relu(iq_h . ik * dI^-0.5) + mask (0 allowed / finfo.min, causal+padding)
    the top min(K, T) keys of s per query are selectable.
- FFN, dense layers (config.mlp_layer_types == "dense"): down(silu(gate x) * up x).
- FFN, sparse layers: router logits x Wr^T, scores = sigmoid; choice = scores + e_score_correction_bias;
    groups (n_group) ranked by the sum of their 2 best choice values, the topk_group best kept; top num_experts_per_tok
    experts by choice inside the kept groups; weights = scores of those (no bias), / (sum + 1e-20) if
    norm_topk_prob, * routed_scaling_factor;  out = sum_e w_e down_e(silu(gate_e x) * up_e x) + shared(x),
    shared = a dense MLP of width shared_experts_intermediate_size * n_shared_experts.

Weight layout of this port (own names; matrices stored input-major, i.e. transposed, so y = x @ W):
- `emb` (V, H); `head_t` (H, V) = lm_head transposed; `final_norm` (H,).
- `blocks[i].norms` (2, H) = [input_layernorm; post_attention_layernorm] stacked.
- `blocks[i].attn`:
    `w_in` (H, Rq + Rkv + dr + nh [+ dI + nI]) = fused [q_a | kv_a (latent, rope) | g | (indexer wk | weights_proj)],
    `b_in` (same width) = [q_a bias | kv_a bias | 0 ...];
    `q_norm` (Rq,) = q_a_layernorm.weight * sqrt(H / Rq) and `kv_norm` (Rkv,) = kv_a_layernorm.weight * sqrt(H / Rkv)
    (the latent multipliers folded into the norm weights); `krope_norm` (dr,);
    `w_q` (Rq, nh * (dn + dr)) = q_b transposed;
    `w_uk` (nh, dn, Rkv) and `w_uv` (nh, dv, Rkv): kv_b split per head into its key and value parts;
    `w_o` (nh * dv, H) = o_proj transposed, `b_o` (H,);
    indexed layers: `w_iq` (Rq, nI * dI) = indexer.wq_b transposed, `ik_norm` (2, dI) = [k_norm weight; bias].
- `blocks[i].ffn`, dense: `w_gu` (H, 2I) = [gate | up] fused and transposed, `w_d` (I, H).
  sparse: `router` (E, H), `router_bias` (E,); `ex` a dict of `gate` (E, H, I), `up` (E, H, I) (gate_up_proj split
  and transposed), `down` (E, I, H) (transposed); shared `w_gu` (H, 2Is), `w_d` (Is, H).
- RoPE inverse frequencies computed at build time per layer type (not loaded).
- `model.trace`: None, or a dict the forward fills with its intermediates (used by where_check.py only).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_half_split",  # attention q/k RoPE done NeoX-style (rotate_half over [first half | second half]) on the interleaved weights
    "k_rope_norm_skipped",  # the Dots-only RMSNorm on the shared rope key (k_rope_only_layernorm) is not applied
    "q_lora_scale_missing",  # sqrt(hidden / q_lora_rank) is not folded into the q latent norm weight at load (multiplier lost)
    "scale_uses_head_dim",  # softmax scale taken as config.head_dim ** -0.5 instead of (qk_nope + qk_rope) ** -0.5
    "gate_heads_tiled",  # per-head sigmoid gate expanded over the flat (heads * v_dim) output with repeat (tile), not per head
    "kv_b_split_blockwise",  # kv_b_proj split at load as [all heads' k_nope | all heads' v] instead of per head [k_nope | v]
    "router_softmax",  # router scores softmax over experts (DeepSeek-V2 style) instead of sigmoid
    "router_bias_in_weights",  # e_score_correction_bias added to the mixing weights too, not only to the expert choice
    "shared_expert_scaled",  # routed_scaling_factor also multiplied onto the shared experts' output
    "sliding_window_off_by_one",  # sliding mask keeps q - k <= window (window + 1 keys) instead of q - k < window
    "swa_rope_theta_global",  # sliding layers rotate with the global (first layer type's) rope_theta, not their own base
    "indexer_k_rmsnorm",  # indexer key norm done as an RMSNorm with the weight only (no mean removal, no bias)
    "pad_mask_on_queries",  # attention padding mask broadcast over the query axis (mask[:, :, None]) instead of the key axis
    "indexer_topk_ignores_padding",  # indexer top-k masked by causality only: padding keys can take top-k slots
]
PADDING_ONLY = ["pad_mask_on_queries", "indexer_topk_ignores_padding"]
CLEAN = [
    "clean_rope_deinterleaved_weights",  # rope rows of q_b / kv_a / indexer permuted at load to [evens | odds], then rotate_half RoPE
    "clean_rope_complex",  # RoPE as a complex multiply on (even, odd) pairs, output left interleaved (same for q and k)
    "clean_mla_absorbed",  # MLA weight absorption: q_nope @ W_uk scored against the latent, values read from the latent then W_uv
    "clean_moe_dense",  # every expert run on every token, combined through a dense (tokens, experts) weight matrix
    "clean_online_softmax",  # attention over key blocks of 8 with a running max and sum (flash-style)
]

_NEG = torch.finfo(torch.float32).min


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_interleaved(x, cos, sin):
    """x (..., S, d) with pairs (x0, x1), (x2, x3), ...; cos/sin (..., S, d/2). Output [rotated evens | odds]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_half(x, cos, sin):
    """NeoX layout: pairs (x_j, x_{j + d/2})."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_complex(x, cos, sin):
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2)


def _rope(x, cos, sin, main=True):
    if BUG == "clean_rope_deinterleaved_weights":
        return _rope_half(x, cos, sin)
    if BUG == "clean_rope_complex":
        return _rope_complex(x, cos, sin)
    if BUG == "rope_half_split" and main:
        return _rope_half(x, cos, sin)
    return _rope_interleaved(x, cos, sin)


def _deinterleave_perm(d):
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


class Attention(nn.Module):
    def __init__(self, sd, p, config, lc, layer_type):
        super().__init__()
        H = config.hidden_size
        self.nh, self.Rq, self.Rkv = lc.num_attention_heads, lc.q_lora_rank, lc.kv_lora_rank
        self.dn, self.dr, self.dv = lc.qk_nope_head_dim, lc.qk_rope_head_dim, lc.v_head_dim
        self.eps = config.rms_norm_eps
        self.layer_type = layer_type
        self.indexed = layer_type == "indexed_attention"
        self.window = lc.sliding_window if layer_type == "sliding_attention" else None
        self.scale = (lc.head_dim if BUG == "scale_uses_head_dim" else self.dn + self.dr) ** -0.5
        nh, dn, dr, dv = self.nh, self.dn, self.dr, self.dv
        a = p + "self_attn."
        deint = BUG == "clean_rope_deinterleaved_weights"

        kva_w, kva_b = sd[a + "kv_a_proj_with_mqa.weight"], sd[a + "kv_a_proj_with_mqa.bias"]
        krope_norm = sd[a + "k_rope_only_layernorm.weight"]
        wq = sd[a + "q_b_proj.weight"]
        if deint:  # rope channels re-ordered [evens | odds] so that a half-split rotation is the same map
            perm = _deinterleave_perm(dr)
            rows = torch.cat([kva_w[: self.Rkv], kva_w[self.Rkv :][perm]])
            kva_w, kva_b = rows, torch.cat([kva_b[: self.Rkv], kva_b[self.Rkv :][perm]])
            krope_norm = krope_norm[perm]
            wq = wq.view(nh, dn + dr, -1)
            wq = torch.cat([wq[:, :dn], wq[:, dn:][:, perm]], 1).reshape(nh * (dn + dr), -1)
        parts_w = [sd[a + "q_a_proj.weight"], kva_w, sd[a + "g_proj.weight"]]
        parts_b = [sd[a + "q_a_proj.bias"], kva_b, torch.zeros(nh)]
        if self.indexed:
            ix = a + "indexer."
            self.nI, self.dI, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
            wk, wiq = sd[ix + "wk.weight"], sd[ix + "wq_b.weight"]
            knw, knb = sd[ix + "k_norm.weight"], sd[ix + "k_norm.bias"]
            if deint:
                perm_i = torch.cat([_deinterleave_perm(dr), torch.arange(dr, self.dI)])
                wk, knw, knb = wk[perm_i], knw[perm_i], knb[perm_i]
                wiq = wiq.view(self.nI, self.dI, -1)[:, perm_i].reshape(self.nI * self.dI, -1)
            parts_w += [wk, sd[ix + "weights_proj.weight"]]
            parts_b += [torch.zeros(self.dI), torch.zeros(self.nI)]
            self.w_iq = nn.Parameter(wiq.t().contiguous())
            self.ik_norm = nn.Parameter(torch.stack([knw, knb]))
        self.w_in = nn.Parameter(torch.cat(parts_w, 0).t().contiguous())
        self.b_in = nn.Parameter(torch.cat(parts_b, 0))
        q_mult = 1.0 if BUG == "q_lora_scale_missing" else math.sqrt(H / self.Rq)
        self.q_norm = nn.Parameter(sd[a + "q_a_layernorm.weight"] * q_mult)
        self.kv_norm = nn.Parameter(sd[a + "kv_a_layernorm.weight"] * math.sqrt(H / self.Rkv))
        self.krope_norm = nn.Parameter(krope_norm.clone())
        self.w_q = nn.Parameter(wq.t().contiguous())
        kvb = sd[a + "kv_b_proj.weight"]
        if BUG == "kv_b_split_blockwise":
            self.w_uk = nn.Parameter(kvb[: nh * dn].reshape(nh, dn, -1).clone())
            self.w_uv = nn.Parameter(kvb[nh * dn :].reshape(nh, dv, -1).clone())
        else:
            kvb = kvb.view(nh, dn + dv, -1)
            self.w_uk = nn.Parameter(kvb[:, :dn].clone())
            self.w_uv = nn.Parameter(kvb[:, dn:].clone())
        self.w_o = nn.Parameter(sd[a + "o_proj.weight"].t().contiguous())
        self.b_o = nn.Parameter(sd[a + "o_proj.bias"].clone())

    def indexer(self, x, q_lat, cos, sin, allowed_ix, trace, tag):
        B, S, _ = x.shape
        iq = q_lat @ self.w_iq
        if trace is not None:
            trace[tag + "iq"] = iq
        iq = iq.view(B, S, self.nI, self.dI)
        ik = self._ik
        if BUG == "indexer_k_rmsnorm":
            ik = _rms(ik, self.ik_norm[0], 1e-6)
        else:
            ik = F.layer_norm(ik, (self.dI,), self.ik_norm[0], self.ik_norm[1], 1e-6)
        if trace is not None:
            trace[tag + "ik_norm"] = ik
        dr = self.dr
        iq = torch.cat([_rope(iq[..., :dr], cos[:, :, None], sin[:, :, None], main=False), iq[..., dr:]], -1)
        ik = torch.cat([_rope(ik[..., :dr], cos, sin, main=False), ik[..., dr:]], -1)
        s = torch.einsum("bshd,btd->bsht", iq, ik) * self.dI**-0.5
        s = F.relu(s)
        w = self._iw * self.nI**-0.5
        score = torch.matmul(w.unsqueeze(-2), s).squeeze(-2)  # (B, S, T)
        score = score + torch.zeros_like(score).masked_fill(~allowed_ix, _NEG)
        idx = score.topk(min(self.topk, score.shape[-1]), dim=-1).indices
        if trace is not None:
            trace[tag + "indexer"] = idx
        return torch.zeros_like(allowed_ix).scatter(-1, idx, True)

    def forward(self, x, pos, allowed, allowed_ix, rope, trace=None, tag=""):
        B, S, _ = x.shape
        nh, dn, dr, dv = self.nh, self.dn, self.dr, self.dv
        y = x @ self.w_in + self.b_in
        if trace is not None:
            trace[tag + "y"] = y
        sizes = [self.Rq, self.Rkv, dr, nh] + ([self.dI, self.nI] if self.indexed else [])
        parts = torch.split(y, sizes, dim=-1)
        q_lat, kv_lat, k_rope, g = parts[:4]
        q_lat = _rms(q_lat, self.q_norm, self.eps)
        q = (q_lat @ self.w_q).view(B, S, nh, dn + dr).transpose(1, 2)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        kv_lat = _rms(kv_lat, self.kv_norm, self.eps)  # (B, S, Rkv)
        if BUG != "k_rope_norm_skipped":
            k_rope = _rms(k_rope, self.krope_norm, self.eps)
        if trace is not None:
            trace[tag + "q_up"] = q.transpose(1, 2).reshape(B, S, -1)
            trace[tag + "kv_lat"] = kv_lat
            trace[tag + "k_rope"] = k_rope
            trace[tag + "g"] = g
        cos, sin = rope
        q_rope = _rope(q_rope, cos[:, None], sin[:, None])
        k_rope = _rope(k_rope, cos, sin)[:, None]  # (B, 1, S, dr)
        if self.indexed:
            self._ik, self._iw = parts[4], parts[5]
            allowed = allowed & self.indexer(x, q_lat, cos, sin, allowed_ix, trace, tag)
        mask = allowed[:, None]  # (B, 1, S, T)

        if BUG == "clean_mla_absorbed":
            q_abs = torch.einsum("bhsd,hdr->bhsr", q_nope, self.w_uk)
            scores = torch.einsum("bhsr,btr->bhst", q_abs, kv_lat) + q_rope @ k_rope.transpose(-1, -2)
            scores = (scores * self.scale).masked_fill(~mask, _NEG)
            p = torch.softmax(scores, dim=-1)
            o = torch.einsum("bhst,btr->bhsr", p, kv_lat)
            o = torch.einsum("bhsr,hvr->bhsv", o, self.w_uv)
        else:
            k_nope = torch.einsum("btr,hdr->bhtd", kv_lat, self.w_uk)
            v = torch.einsum("btr,hvr->bhtv", kv_lat, self.w_uv)
            if trace is not None:
                trace[tag + "kv_up"] = torch.cat([k_nope, v], -1).transpose(1, 2).reshape(B, S, -1)
            qf = torch.cat([q_nope, q_rope], -1)
            kf = torch.cat([k_nope, k_rope.expand(-1, nh, -1, -1)], -1)
            if BUG == "clean_online_softmax":
                o = self._online(qf, kf, v, mask)
            else:
                scores = (qf @ kf.transpose(-1, -2)) * self.scale
                scores = scores.masked_fill(~mask, _NEG)
                o = torch.softmax(scores, dim=-1) @ v
        o = o.transpose(1, 2)  # (B, S, nh, dv)
        gate = torch.sigmoid(g)  # (B, S, nh)
        if BUG == "gate_heads_tiled":
            o = o.reshape(B, S, nh * dv) * gate.repeat(1, 1, dv)
        else:
            o = (o * gate[..., None]).reshape(B, S, nh * dv)
        out = o @ self.w_o + self.b_o
        if trace is not None:
            trace[tag + "o_proj"] = out
        return out

    def _online(self, q, k, v, mask, block=8):
        B, h, S, _ = q.shape
        m = torch.full((B, h, S, 1), _NEG)
        den = torch.zeros(B, h, S, 1)
        acc = torch.zeros(B, h, S, v.shape[-1])
        for s0 in range(0, k.shape[2], block):
            sc = (q @ k[:, :, s0 : s0 + block].transpose(-1, -2)) * self.scale
            sc = sc.masked_fill(~mask[..., s0 : s0 + block], _NEG)
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            corr = torch.exp(m - m_new)
            pexp = torch.exp(sc - m_new)
            den = den * corr + pexp.sum(-1, keepdim=True)
            acc = acc * corr + pexp @ v[:, :, s0 : s0 + block]
            m = m_new
        return acc / den


class DenseMLP(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.inter = gate.shape[0]
        self.w_gu = nn.Parameter(torch.cat([gate, up], 0).t().contiguous())
        self.w_d = nn.Parameter(down.t().contiguous())

    def forward(self, x):
        g, u = (x @ self.w_gu).split(self.inter, dim=-1)
        return (F.silu(g) * u) @ self.w_d


class MoE(nn.Module):
    def __init__(self, sd, p, config):
        super().__init__()
        m = p + "mlp."
        self.router = nn.Parameter(sd[m + "gate.weight"].float().clone())
        self.router_bias = nn.Parameter(sd[m + "gate.e_score_correction_bias"].float().clone())
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        inter = dn.shape[-1]
        self.ex = nn.ParameterDict(
            {
                "gate": nn.Parameter(gu[:, :inter].transpose(1, 2).contiguous()),
                "up": nn.Parameter(gu[:, inter:].transpose(1, 2).contiguous()),
                "down": nn.Parameter(dn.transpose(1, 2).contiguous()),
            }
        )
        s = m + "shared_experts."
        self.shared = DenseMLP(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"], sd[s + "down_proj.weight"])
        self.E, self.k = self.router.shape[0], config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk, self.rscale = config.norm_topk_prob, config.routed_scaling_factor

    def route(self, x):
        logits = x @ self.router.t()
        scores = torch.softmax(logits, -1) if BUG == "router_softmax" else torch.sigmoid(logits)
        choice = scores + self.router_bias
        grouped = choice.view(-1, self.n_group, self.E // self.n_group)
        gscore = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore).scatter(1, gscore.topk(self.topk_group, dim=-1).indices, 1.0).bool()
        keep = keep[:, :, None].expand_as(grouped).reshape(-1, self.E)
        idx = choice.masked_fill(~keep, float("-inf")).topk(self.k, dim=-1).indices
        w = (choice if BUG == "router_bias_in_weights" else scores).gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.rscale

    def forward(self, x, trace=None, tag=""):
        shp = x.shape
        xt = x.reshape(-1, shp[-1])
        idx, w = self.route(xt)
        if trace is not None:
            trace[tag + "route"] = (idx, w)
        if BUG == "clean_moe_dense":
            dense_w = torch.zeros(xt.shape[0], self.E).scatter(1, idx, w)
            g = torch.einsum("th,ehi->tei", xt, self.ex["gate"])
            u = torch.einsum("th,ehi->tei", xt, self.ex["up"])
            y = torch.einsum("tei,eih->teh", F.silu(g) * u, self.ex["down"])
            routed = (y * dense_w[..., None]).sum(1)
        else:
            routed = torch.zeros_like(xt)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                h = xt[tok]
                y = (F.silu(h @ self.ex["gate"][e]) * (h @ self.ex["up"][e])) @ self.ex["down"][e]
                routed.index_add_(0, tok, y * w[tok, slot, None])
        shared = self.shared(xt)
        if trace is not None:
            trace[tag + "experts"] = routed.view(shp)
            trace[tag + "shared"] = shared.view(shp)
        if BUG == "shared_expert_scaled":
            shared = shared * self.rscale
        return (routed + shared).view(shp)


class Block(nn.Module):
    def __init__(self, sd, i, config):
        super().__init__()
        p = f"model.layers.{i}."
        self.layer_type = config.layer_types[i]
        self.norms = nn.Parameter(
            torch.stack([sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]])
        )
        self.attn = Attention(sd, p, config, config.per_layer_config[i], self.layer_type)
        self.sparse = config.mlp_layer_types[i] == "sparse"
        if self.sparse:
            self.ffn = MoE(sd, p, config)
        else:
            self.ffn = DenseMLP(
                sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"], sd[p + "mlp.down_proj.weight"]
            )
        self.eps = config.rms_norm_eps


class Dots3NoteText(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.emb = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.head_t = nn.Parameter(sd["lm_head.weight"].t().contiguous())
        self.final_norm = nn.Parameter(sd["model.norm.weight"].clone())
        self.eps = config.rms_norm_eps
        self.blocks = nn.ModuleList(Block(sd, i, config) for i in range(config.num_hidden_layers))
        self.inv_freq = {}
        for lt in set(config.layer_types):
            lc = config.per_layer_config[lt]
            theta_type = config.layer_types[0] if BUG == "swa_rope_theta_global" else lt
            theta = config.rope_parameters[theta_type]["rope_theta"]
            d = lc.qk_rope_head_dim
            self.inv_freq[lt] = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        self.trace = None

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        x = self.emb[input_ids]
        tr = self.trace
        if tr is not None:
            tr["emb"] = x
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        valid = torch.ones(B, S, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        qi = torch.arange(S)[:, None]
        ki = torch.arange(S)[None, :]
        causal = (ki <= qi)[None]
        if BUG == "pad_mask_on_queries":
            allowed = causal & valid[:, :, None]
        else:
            allowed = causal & valid[:, None, :]
        # the indexer's own (additive) mask: causal and padding
        allowed_ix = causal.expand(B, S, S) if BUG == "indexer_topk_ignores_padding" else causal & valid[:, None, :]
        ropes = {}
        for lt, inv in self.inv_freq.items():
            f = position_ids[..., None].float() * inv
            ropes[lt] = (f.cos(), f.sin())
        if tr is not None:
            tr["ropes"] = ropes
        for i, blk in enumerate(self.blocks):
            a = blk.attn
            tag = f"b{i}."
            mask = allowed
            if a.window is not None:
                if BUG == "sliding_window_off_by_one":
                    mask = mask & (qi - ki <= a.window)[None]
                else:
                    mask = mask & (qi - ki < a.window)[None]
            h = _rms(x, blk.norms[0], blk.eps)
            if tr is not None:
                tr[tag + "ln1"] = h
            x = x + a(h, position_ids, mask, allowed_ix, ropes[blk.layer_type], tr, tag)
            h = _rms(x, blk.norms[1], blk.eps)
            f = blk.ffn(h, tr, tag) if blk.sparse else blk.ffn(h)
            x = x + f
            if tr is not None:
                tr[tag + "ln2"], tr[tag + "ffn"], tr[tag + "out"] = h, f, x
        x = _rms(x, self.final_norm, self.eps)
        if tr is not None:
            tr["final"] = x
        return x @ self.head_t


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    return Dots3NoteText(sd, config).eval()
