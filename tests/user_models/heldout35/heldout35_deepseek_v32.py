"""Hand-written plain-PyTorch port of DeepSeek-V3.2 (DeepseekV32ForCausalLM): MLA + DSA lightning indexer + MoE.

Architecture as this port implements it (what differs from Llama is marked *):
- token embedding, no scaling; untied lm_head; final RMSNorm; pre-norm decoder layers
    h = h + Attn(RMSNorm(h));  h = h + FFN(RMSNorm(h))      (RMSNorm: gain * x / sqrt(mean(x^2) + rms_norm_eps)).
- * Multi-head latent attention (one key / value per query head, no grouping):
    q latent  cq = RMSNorm_1e-6(h @ Wq_a)                    (q_lora_rank; this norm's eps is a fixed 1e-6)
    kv latent c  = RMSNorm_1e-6((h @ Wkv_a)[:kv_lora_rank]), plus ONE shared rope key k_pe = (h @ Wkv_a)[kv_lora_rank:]
    per head: q = [cq @ Wq_nope_h | rope(cq @ Wq_rope_h)]   (q_b_proj rows per head: nope dims first, then rope)
              k = [c @ Wk_nope_h | rope(k_pe)],  v = c @ Wv_h  (kv_b_proj rows per head: k_nope first, then v)
    * RoPE on the rope dims rotates INTERLEAVED pairs (x0, x1), (x2, x3), ... (pair i at frequency i);
    * YaRN frequencies: inv_freq blended between base^(-2i/d) (extrapolated) and that / factor (interpolated) by a
      linear ramp over the pair index between the correction dims of beta_fast / beta_slow at
      original_max_position_embeddings (floored / ceiled); cos / sin multiplied by the attention factor
      mscale(factor, mscale) / mscale(factor, mscale_all_dim), mscale(s, m) = 0.1 m ln s + 1;
    * softmax scale (qk_nope + qk_rope)^-0.5 * mscale(factor, mscale_all_dim)^2.
- * DSA lightning indexer (every layer), deciding which keys each query may attend to:
    iq = cq @ Wi_q (index_n_heads x index_head_dim), ik = LayerNorm_1e-6(h @ Wi_k) (one key head, with bias);
    RoPE on the FIRST qk_rope_head_dim dims of iq / ik, HALF-SPLIT (rotate-half, NeoX style, unlike MLA), same
    YaRN cos / sin; score(s, t) = sum_j w_j(s) * relu(iq_j(s) . ik(t) / sqrt(index_head_dim)), w = h @ Wi_w
    scaled by index_n_heads^-0.5; the causal / padding mask is applied to the scores, then each query keeps its
    index_topk highest keys; attention sees only keys both selected and allowed (finfo.min elsewhere, so a fully
    masked padding row averages all values instead of giving NaN).
- FFN per config.mlp_layer_types: "dense" = SwiGLU MLP (intermediate_size); "sparse" = * DeepSeek MoE:
    p = sigmoid(h @ Wr); choice = p + e_score_correction_bias; group score = sum of the top-2 choices of each of
    n_group groups; only the topk_group best groups compete; num_experts_per_tok experts by choice; gate weights
    from p (not choice), renormalised (norm_topk_prob, + 1e-20) then * routed_scaling_factor; plus a shared SwiGLU
    MLP (moe_intermediate_size * n_shared_experts) added unscaled.
Weight layout of this port (own names):
- emb (V, H); head_t (H, V) = lm_head transposed; final_g (H,).
- per layer `blocks[i]`: g_attn / g_ffn (H,);
  w_in (H, q_lora + kv_lora + rope + index_head_dim + index_n_heads): q_a_proj | kv_a_proj_with_mqa | indexer.wk |
  indexer.weights_proj fused and transposed (b_in the matching biases, zeros without attention_bias);
  g_q (q_lora,), g_kv (kv_lora,); wq_nope (nh, q_lora, nope), wq_rope (nh, q_lora, rope) from q_b_proj;
  wk_nope (nh, kv_lora, nope), wv (nh, kv_lora, v) from kv_b_proj; wo (nh * v, H), b_o;
  wi_q (q_lora, index_n_heads * index_head_dim); ik_g / ik_b (index_head_dim,) the indexer key LayerNorm;
  dense: w_gu (H, 2I) = [gate | up], w_dn (I, H);
  sparse: w_r (H, E) router transposed, r_bias (E,); e_gate / e_up (E, H, Ie) and e_down (E, Ie, H) from the fused
  gate_up_proj (E, 2 Ie, H) (first Ie rows gate, next Ie up) and down_proj (E, H, Ie); s_gu (H, 2 Is), s_dn (Is, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "mla_kv_b_global_split",  # kv_b_proj rows split as [all heads' k_nope | all heads' v] instead of per head
    "mla_mscale_wrong_field",  # softmax-scale mscale^2 computed from rope_parameters["mscale"], not "mscale_all_dim"
    "latent_norm_config_eps",  # q_a / kv_a latent RMSNorms use config.rms_norm_eps instead of their fixed 1e-6
    "yarn_no_attention_factor",  # YaRN attention factor never applied to cos / sin (rope dims unscaled)
    "indexer_rope_interleaved",  # indexer RoPE rotates interleaved pairs (as MLA does) instead of half-split
    "indexer_k_rmsnorm",  # indexer key norm done as RMSNorm (no mean removal, no bias) instead of LayerNorm
    "indexer_no_relu",  # ReLU on the per-head index scores skipped before the weighted head sum
    "indexer_q_from_raw_latent",  # indexer query projected from the q latent before q_a_layernorm
    "indexer_topk_before_mask",  # top-k taken over unmasked index scores; causal mask applied only afterwards
    "indexer_causal_only",  # indexer masks causally only: padding keys compete for (and waste) top-k slots
    "router_weights_biased",  # gate weights gathered from the bias-corrected scores instead of the raw sigmoid
    "router_group_max",  # group score = max expert score (DeepSeek-V2 style) instead of the sum of the top 2
    "moe_scale_on_shared",  # routed_scaling_factor applied to routed + shared output instead of routed only
    "experts_gate_up_interleaved",  # fused gate_up_proj rows read as interleaved (gate, up) pairs, not halves
]
PADDING_ONLY = {"indexer_causal_only"}
CLEAN = [
    "ds_sdpa",  # attention through F.scaled_dot_product_attention with a float mask (selected & allowed)
    "ds_absorbed_mla",  # weight-absorbed MLA: scores and values computed in the kv latent space
    "ds_complex_rope",  # both RoPEs as complex multiplication (interleaved pairs / half-split pairs)
    "ds_dense_experts",  # every expert evaluated, combined through a dense (N, E) gate-weight matrix
    "ds_gathered_sparse",  # attention only over each query's gathered top-k keys (true sparse form)
]


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _layernorm(x, g, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + eps) * g + b


def _yarn_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope_setup(cfg, d):
    """inv_freq (d/2,), the cos/sin attention factor and the softmax-scale multiplier (YaRN or plain)."""
    rp = dict(cfg.rope_parameters)
    base = rp["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return inv, 1.0, 1.0
    assert kind == "yarn", kind
    f = rp.get("factor") or cfg.max_position_embeddings / rp["original_max_position_embeddings"]
    omax = rp["original_max_position_embeddings"]
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr_dim(rot):
        return d * math.log(omax / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(fast), corr_dim(slow)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    inv = (inv / f) * ramp + inv * (1 - ramp)  # ramp 0: keep (high frequencies), 1: interpolate
    ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
    af = rp.get("attention_factor")
    if af is None:
        af = _yarn_mscale(f, ms) / _yarn_mscale(f, msa) if ms and msa else _yarn_mscale(f)
    soft = 1.0
    field = "mscale" if BUG == "mla_mscale_wrong_field" else "mscale_all_dim"
    if rp.get(field):
        soft = _yarn_mscale(f, rp[field]) ** 2
    return inv, float(af), soft


def _rope_pairs(x, c, s):
    """Interleaved RoPE: pair (x[2i], x[2i+1]) rotated by angle i; output keeps the interleaved order."""
    if BUG == "ds_complex_rope":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)


def _rope_half(x, c, s):
    """Half-split (NeoX) RoPE: pair (x[i], x[i + d/2]) rotated by angle i."""
    h = x.shape[-1] // 2
    if BUG == "ds_complex_rope":
        z = torch.complex(x[..., :h], x[..., h:]) * torch.complex(c, s)
        return torch.cat((z.real, z.imag), -1)
    a, b = x[..., :h], x[..., h:]
    return torch.cat((a * c - b * s, b * c + a * s), -1)


class DeepseekV32Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qr, self.kvr = cfg.q_lora_rank, cfg.kv_lora_rank
        self.ih, self.ihd, self.itopk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.eps = cfg.rms_norm_eps
        self.latent_eps = cfg.rms_norm_eps if BUG == "latent_norm_config_eps" else 1e-6
        inv, af, soft = _rope_setup(cfg, self.rope)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.af = 1.0 if BUG == "yarn_no_attention_factor" else af
        self.scale = (self.nope + self.rope) ** -0.5 * soft
        self.E, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.groups, self.topk_group = cfg.n_group, cfg.topk_group
        self.renorm, self.rsf = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.kinds = list(cfg.mlp_layer_types)

        self.emb = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.final_g = nn.Parameter(g("model.norm.weight"))
        nh, nope, rope, vd = self.nh, self.nope, self.rope, self.vd
        self.blocks = nn.ModuleList()
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            ix = a + "indexer."
            m = p + "mlp."
            L = nn.Module()
            L.g_attn = nn.Parameter(g(p + "input_layernorm.weight"))
            L.g_ffn = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            parts = [a + "q_a_proj", a + "kv_a_proj_with_mqa", ix + "wk", ix + "weights_proj"]
            ws = [g(n + ".weight") for n in parts]
            L.w_in = nn.Parameter(torch.cat(ws, 0).t().contiguous())
            L.b_in = nn.Parameter(
                torch.cat([g(n + ".bias") if n + ".bias" in sd else torch.zeros(w.shape[0]) for n, w in zip(parts, ws)])
            )
            L.g_q = nn.Parameter(g(a + "q_a_layernorm.weight"))
            L.g_kv = nn.Parameter(g(a + "kv_a_layernorm.weight"))
            qb = g(a + "q_b_proj.weight").view(nh, nope + rope, self.qr)
            L.wq_nope = nn.Parameter(qb[:, :nope].transpose(1, 2).contiguous())
            L.wq_rope = nn.Parameter(qb[:, nope:].transpose(1, 2).contiguous())
            kvb = g(a + "kv_b_proj.weight")
            if BUG == "mla_kv_b_global_split":
                wk, wv = kvb[: nh * nope].view(nh, nope, self.kvr), kvb[nh * nope :].view(nh, vd, self.kvr)
            else:
                kvb = kvb.view(nh, nope + vd, self.kvr)
                wk, wv = kvb[:, :nope], kvb[:, nope:]
            L.wk_nope = nn.Parameter(wk.transpose(1, 2).contiguous())
            L.wv = nn.Parameter(wv.transpose(1, 2).contiguous())
            L.wo = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            L.b_o = nn.Parameter(g(a + "o_proj.bias") if a + "o_proj.bias" in sd else torch.zeros(H))
            L.wi_q = nn.Parameter(g(ix + "wq_b.weight").t().contiguous())
            L.ik_g = nn.Parameter(g(ix + "k_norm.weight"))
            L.ik_b = nn.Parameter(g(ix + "k_norm.bias"))
            if kind == "sparse":
                L.w_r = nn.Parameter(g(m + "gate.weight").t().contiguous())
                L.r_bias = nn.Parameter(g(m + "gate.e_score_correction_bias"))
                gu = g(m + "experts.gate_up_proj")  # (E, 2 Ie, H)
                if BUG == "experts_gate_up_interleaved":
                    gate, up = gu[:, 0::2], gu[:, 1::2]
                else:
                    gate, up = gu.chunk(2, dim=1)
                L.e_gate = nn.Parameter(gate.transpose(1, 2).contiguous())
                L.e_up = nn.Parameter(up.transpose(1, 2).contiguous())
                L.e_down = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous())
                s = m + "shared_experts."
            else:
                s = m
            L.s_gu = nn.Parameter(torch.cat([g(s + "gate_proj.weight"), g(s + "up_proj.weight")], 0).t().contiguous())
            L.s_dn = nn.Parameter(g(s + "down_proj.weight").t().contiguous())
            self.blocks.append(L)

    # ---- lightning indexer: which keys each query keeps ----
    def _index(self, L, cq, cq_raw, ik, iw, cs, allowed, causal):
        B, S, _ = cq.shape
        c, s = cs
        r = self.rope
        src = cq_raw if BUG == "indexer_q_from_raw_latent" else cq
        iq = (src @ L.wi_q).view(B, S, self.ih, self.ihd)
        if BUG == "indexer_k_rmsnorm":
            ik = _rms(ik, L.ik_g, 1e-6)
        else:
            ik = _layernorm(ik, L.ik_g, L.ik_b, 1e-6)
        rot = _rope_pairs if BUG == "indexer_rope_interleaved" else _rope_half
        iq = torch.cat((rot(iq[..., :r], c[:, :, None], s[:, :, None]), iq[..., r:]), -1)
        ik = torch.cat((rot(ik[..., :r], c, s), ik[..., r:]), -1)
        sc = torch.einsum("bshd,btd->bsht", iq, ik) * self.ihd**-0.5
        if BUG != "indexer_no_relu":
            sc = F.relu(sc)
        w = iw * self.ih**-0.5
        score = torch.einsum("bsh,bsht->bst", w, sc)
        k = min(self.itopk, S)
        if BUG == "indexer_topk_before_mask":
            return score.topk(k, dim=-1).indices
        ok = causal.expand(B, S, S) if BUG == "indexer_causal_only" else allowed
        return score.masked_fill(~ok, float("-inf")).topk(k, dim=-1).indices

    # ---- MLA + DSA ----
    def _attn(self, L, x, cs, allowed, causal):
        B, S, _ = x.shape
        nh, rope = self.nh, self.rope
        z = x @ L.w_in + L.b_in
        cq_raw, ckv, k_pe, ik, iw = z.split([self.qr, self.kvr, rope, self.ihd, self.ih], -1)
        cq = _rms(cq_raw, L.g_q, self.latent_eps)
        c = _rms(ckv, L.g_kv, self.latent_eps)
        cos, sin = cs
        q_nope = torch.einsum("bsr,hrd->bhsd", cq, L.wq_nope)
        q_pe = _rope_pairs(torch.einsum("bsr,hrd->bhsd", cq, L.wq_rope), cos[:, None], sin[:, None])
        k_pe = _rope_pairs(k_pe, cos, sin)[:, None]  # (B, 1, S, rope): one rope key shared by every head

        idx = self._index(L, cq, cq_raw, ik, iw, cs, allowed, causal)  # (B, S, topk)
        keep = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, idx, True) & allowed
        neg = torch.finfo(x.dtype).min

        if BUG == "ds_absorbed_mla":
            q_lat = torch.einsum("bhsd,hrd->bhsr", q_nope, L.wk_nope)  # query absorbed into the kv latent
            sc = (q_lat @ c[:, None].transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)) * self.scale
            pr = sc.masked_fill(~keep[:, None], neg).softmax(-1)
            o = torch.einsum("bhsr,hrd->bhsd", pr @ c[:, None], L.wv)
        else:
            k_nope = torch.einsum("bsr,hrd->bhsd", c, L.wk_nope)
            v = torch.einsum("bsr,hrd->bhsd", c, L.wv)
            q = torch.cat((q_nope, q_pe), -1)
            k = torch.cat((k_nope, k_pe.expand(B, nh, S, rope)), -1)
            if BUG == "ds_sdpa":
                bias = torch.zeros(B, 1, S, S).masked_fill(~keep[:, None], neg)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)
            elif BUG == "ds_gathered_sparse":
                bi = torch.arange(B)[:, None, None, None]
                hi = torch.arange(nh)[None, :, None, None]
                ti = idx[:, None]  # (B, 1, S, topk)
                kg, vg = k[bi, hi, ti], v[bi, hi, ti]  # (B, nh, S, topk, d)
                sc = torch.einsum("bhsd,bhskd->bhsk", q, kg) * self.scale
                ok = allowed.gather(-1, idx)[:, None]
                pr = sc.masked_fill(~ok, neg).softmax(-1)
                o = torch.einsum("bhsk,bhskd->bhsd", pr, vg)
            else:
                sc = (q @ k.transpose(-1, -2)) * self.scale
                pr = sc.masked_fill(~keep[:, None], neg).softmax(-1)
                o = pr @ v
        o = o.transpose(1, 2).reshape(B, S, nh * self.vd)
        return o @ L.wo + L.b_o

    # ---- FFN ----
    @staticmethod
    def _swiglu(x, w_gu, w_dn):
        gate, up = (x @ w_gu).chunk(2, -1)
        return (F.silu(gate) * up) @ w_dn

    def _moe(self, L, x):
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        N = t.shape[0]
        p = torch.sigmoid(t @ L.w_r)
        choice = p + L.r_bias
        grouped = choice.view(N, self.groups, -1)
        if BUG == "router_group_max":
            gs = grouped.max(-1).values
        else:
            gs = grouped.topk(2, dim=-1).values.sum(-1)
        gsel = gs.topk(self.topk_group, dim=-1).indices
        gmask = torch.zeros_like(gs, dtype=torch.bool).scatter(-1, gsel, True)
        gmask = gmask[:, :, None].expand_as(grouped).reshape(N, self.E)
        sel = choice.masked_fill(~gmask, float("-inf")).topk(self.k, dim=-1).indices
        w = (choice if BUG == "router_weights_biased" else p).gather(-1, sel)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if BUG != "moe_scale_on_shared":
            w = w * self.rsf
        if BUG == "ds_dense_experts":
            dense = torch.zeros(N, self.E).scatter(-1, sel, w)
            hid = F.silu(torch.einsum("nh,ehi->nei", t, L.e_gate)) * torch.einsum("nh,ehi->nei", t, L.e_up)
            out = torch.einsum("nei,eih,ne->nh", hid, L.e_down, dense)
        else:
            out = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = (sel == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                xe = t[tok]
                ye = (F.silu(xe @ L.e_gate[e]) * (xe @ L.e_up[e])) @ L.e_down[e]
                out.index_add_(0, tok, ye * w[tok, slot, None])
        shared = self._swiglu(t, L.s_gu, L.s_dn)
        if BUG == "moe_scale_on_shared":
            out = (out + shared) * self.rsf
        else:
            out = out + shared
        return out.view(shape)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None]
        allowed = causal & attention_mask.bool()[:, None, :]  # (B, S, T)
        ang = position_ids[..., None].float() * self.inv_freq  # (B, S, rope / 2)
        cs = (ang.cos() * self.af, ang.sin() * self.af)
        h = self.emb[input_ids]
        for L, kind in zip(self.blocks, self.kinds):
            h = h + self._attn(L, _rms(h, L.g_attn, self.eps), cs, allowed, causal)
            x = _rms(h, L.g_ffn, self.eps)
            h = h + (self._moe(L, x) if kind == "sparse" else self._swiglu(x, L.s_gu, L.s_dn))
        return _rms(h, self.final_g, self.eps) @ self.head_t


def build(state_dict, config):
    return DeepseekV32Port(state_dict, config).eval()
