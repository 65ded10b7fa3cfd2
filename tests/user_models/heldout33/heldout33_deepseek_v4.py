"""Hand-written plain-PyTorch port of DeepSeek-V4 (DeepseekV4ForCausalLM), prefill only, no cache.

Architecture as this port implements it:
- token embedding (no scaling), copied into N = hc_mult identical residual streams: the residual is (B, S, N, D).
- * manifold-constrained hyper-connections (mHC), one for the attention and one for the FFN of every layer:
  the N streams are flattened (N*D), RMS-normalised without a gain (eps = rms_norm_eps) and projected to
  2N + N*N mixing logits [pre | post | comb]; pre = sigmoid(a0 * l_pre + b_pre) + hc_eps,
  post = 2 * sigmoid(a1 * l_post + b_post), comb = softmax_rows(a2 * l_comb + b_comb) + hc_eps, then Sinkhorn:
  one column normalisation, then (hc_sinkhorn_iters - 1) x (rows, columns), each dividing by (sum + hc_eps).
  Block input x = sum_n pre_n * h_n; block output y; new streams h'_k = post_k * y + sum_j comb[j, k] * h_j
  (comb used transposed).
- decoder layer: x = RMSNorm_g1(collapse_attn(h)) -> attention; x = RMSNorm_g2(collapse_ffn(h)) -> MoE.
- attention (single shared K=V head, "MQA with K == V"):
  q_res = RMSNorm_gq(x W_qa);  q = RMS(q_res W_qb) per head (no gain);  kv = RMSNorm_gkv(x W_kv)  (one head);
  RoPE on the trailing rd = head_dim * partial_rotary_factor channels, interleaved pairs (2i, 2i+1).
  Sliding layers use the "main" rope (rope_theta, plain); compressed layers (CSA / HCA) use the "compress" rope
  (compress_rope_theta, YaRN when configured: ramp between interpolated / extrapolated frequencies, cos / sin
  scaled by the config's attention_factor, which is 1.0) for q, kv, the compressed entries and the indexer.
  Keys = values = [kv of the sliding window | compressed entries]; scores * head_dim^-0.5; a per-head learned
  sink logit joins the softmax denominator only.  Sliding mask: j <= i, j > i - sliding_window, j not padding.
  The attention output's rope slice is rotated back (angle -theta at the query position), then the grouped
  output projection: heads split in o_groups contiguous groups, each group (H/G * hd) -> o_lora_rank through its
  own matrix, the G * o_lora_rank concatenation -> D.
- * compressors (applied to the attention input x, windows counted over the tensor index, remainder dropped):
  HCA (rate m'): per window of m' tokens, C = x W_c, Z = x W_z + position_bias, entry = sum softmax_window(Z) * C
  (per channel), RMSNorm with gain, RoPE at position w * m'.  CSA (rate m): W_c, W_z give 2*hd channels, the
  first half (Ca) pools into the NEXT window, the second (Cb) into its own: entry w pools 2m slots
  [Ca of window w-1 | Cb of window w] (window 0: Ca slots empty).  Entry w is visible to query position p iff
  w < (p + 1) // m (position ids, not tensor index).
- * lightning indexer (CSA layers): its own CSA-style compressor at index_head_dim, queries q_res W_iq
  (index_n_heads heads, RoPE at the query position), score_t = sum_h (w_h * n_h^-0.5) * ReLU(q_h . k_t) * d^-0.5,
  w = x W_w; future entries -> -inf, keep the top index_topk (picks that are still future are dropped); the
  attention sees only the kept compressed entries.
- MoE FFN: scores s = sqrt(softplus(x W_r)); "moe" layers pick top-k of s + correction bias, "hash_moe" layers
  take the experts tid2eid[token id]; weights = s[picked] / sum * routed_scaling_factor.  Experts and the shared
  expert are SwiGLU with gate clamped to <= swiglu_limit and up to [-limit, limit]; output = routed + shared.
- final: hyper-head collapse (RMS of flattened streams -> N logits, sigmoid(a * l + b) + hc_eps, weighted sum),
  RMSNorm, untied lm_head.
Weight layout of this port (own names):
- tok (V, D); head_t (D, V) = lm_head transposed; fin (D,); hh_w (N*D, N) hc_head.hc_fn transposed, hh_b (N,),
  hh_s (1,).
- per layer `layers[i]`: g1 / g2 (D,); hc_w (2, N*D, (2+N)N) = [attn_hc.fn, ffn_hc.fn] transposed and stacked,
  hc_b (2, (2+N)N), hc_s (2, 3);
  attention: w_a (D, r + hd) = [q_a_proj | kv_proj] fused + transposed, gq (r,), gkv (hd,), wq_b (r, H*hd),
  sink (H,), wo_a (G, H/G*hd, r_o) per-group transposed, wo_b (G*r_o, D);
  compressor: c_w (D, 2*cw) = [kv_proj | gate_proj] fused + transposed (cw = 2hd for CSA, hd for HCA),
  c_pb (m, cw), c_g (hd,); indexer: i_w (D, 4 dI) fused [kv | gate], i_pb (m, 2dI), i_g (dI,), i_wq (r, nI*dI),
  i_wh (D, nI);
  MoE: w_rt (D, E), rt_bias (E,) (zeros for hash layers), tid2eid (V, k) (hash layers), w_gu (E, D, 2I) =
  gate_up_proj transposed ([gate | up] halves), w_dn (E, I, D), s_gu (D, 2I) shared [gate | up], s_dn (I, D).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "hc_comb_not_transposed",  # mHC residual mixing uses comb @ streams (comb[k, j]) instead of comb transposed
    "hc_post_no_double",  # mHC post weights = sigmoid(...) without the factor 2
    "attn_out_not_derotated",  # the inverse RoPE on the attention output's rope slice (K == V) is skipped
    "compressed_layers_main_rope",  # CSA / HCA layers rotate q / kv with rope_theta (plain), not compress rope + YaRN
    "rope_neox_pairs",  # RoPE pairs channel i with i + rd/2 (rotate-half) instead of interleaved (2i, 2i+1)
    "q_head_norm_missing",  # per-head unweighted RMSNorm of q after q_b_proj is skipped
    "csa_halves_swapped",  # CSA compressor: Ca / Cb channel halves of kv_proj / gate_proj swapped at the split
    "hca_softmax_channels",  # HCA compressor gate softmax taken over the channels instead of the window slots
    "compress_rope_window_end",  # compressed entry w rotated at its window's last token w*m + m - 1, not w*m
    "indexer_no_relu",  # lightning indexer scores without the ReLU on q . k
    "hash_router_learned",  # hash_moe layers routed by learned top-k instead of the tid2eid table
    "shared_expert_no_clamp",  # swiglu_limit clamp applied to routed experts only, not to the shared expert
    "experts_gate_up_interleaved",  # gate_up_proj split as interleaved rows (gate even, up odd) instead of halves
    "compress_pos_from_position_ids",  # compressed entry rope position = position id of its window's first token
]
PADDING_ONLY = {"compress_pos_from_position_ids"}
CLEAN = [
    "sdpa_sink",  # attention through F.scaled_dot_product_attention, the sink as an extra zero key with bias = sink
    "complex_rope",  # interleaved RoPE as complex multiplication (inverse with the conjugate)
    "dense_experts",  # all experts evaluated, combined through a dense (N, E) scatter-added weight matrix
    "folded_o_proj",  # grouped output projection folded into one (H*hd, D) matrix at load time
    "csa_split_softmax",  # CSA pooling as two per-half partial softmax sums merged through a log-sum-exp
]


def _rms(x, eps, g=None):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if g is None else g * y


def _inv_freq(theta, rd, rp):
    """Inverse frequencies (rd / 2,) and the cos / sin scale for one rope kind (plain or YaRN)."""
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    if rp.get("rope_type", "default") != "yarn":
        return inv, 1.0
    f = rp["factor"]
    orig = rp["original_max_position_embeddings"]
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def dim_at(rot):
        return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(dim_at(fast)), 0), min(math.ceil(dim_at(slow)), rd - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(rd // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    inv = (inv / f) * ramp + inv * (1 - ramp)
    scale = rp.get("attention_factor")
    if scale is None:
        scale = 0.1 * math.log(f) + 1.0 if f > 1 else 1.0
    return inv, scale


class DeepseekV4Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.D, self.H, self.hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.N = cfg.hc_mult
        self.eps, self.hc_eps, self.iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self.rd = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.window = cfg.sliding_window
        self.G, self.ro = cfg.o_groups, cfg.o_lora_rank
        self.r = cfg.q_lora_rank
        self.nI, self.dI, self.topk_i = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.E, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.rsf, self.limit = cfg.routed_scaling_factor, cfg.swiglu_limit
        self.layer_types, self.mlp_types = list(cfg.layer_types), list(cfg.mlp_layer_types)
        self.rates = dict(cfg.compress_rates)
        rp = cfg.rope_parameters
        inv_m, sc_m = _inv_freq(cfg.rope_theta, self.rd, {})
        inv_c, sc_c = _inv_freq(cfg.compress_rope_theta, self.rd, rp.get("compress", {}))
        self.register_buffer("inv_main", inv_m, persistent=False)
        self.register_buffer("inv_comp", inv_c, persistent=False)
        self.sc_main, self.sc_comp = sc_m, sc_c

        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("model.norm.weight"))
        self.hh_w = nn.Parameter(g("model.hc_head.hc_fn").t().contiguous())
        self.hh_b = nn.Parameter(g("model.hc_head.hc_base"))
        self.hh_s = nn.Parameter(g("model.hc_head.hc_scale"))
        G, ro = self.G, self.ro
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            L = nn.Module()
            L.g1 = nn.Parameter(g(p + "input_layernorm.weight"))
            L.g2 = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            L.hc_w = nn.Parameter(torch.stack([g(p + f"{n}_hc.fn").t() for n in ("attn", "ffn")]))
            L.hc_b = nn.Parameter(torch.stack([g(p + f"{n}_hc.base") for n in ("attn", "ffn")]))
            L.hc_s = nn.Parameter(torch.stack([g(p + f"{n}_hc.scale") for n in ("attn", "ffn")]))
            # attention
            L.w_a = nn.Parameter(torch.cat([g(a + "q_a_proj.weight"), g(a + "kv_proj.weight")], 0).t().contiguous())
            L.gq = nn.Parameter(g(a + "q_a_norm.weight"))
            L.gkv = nn.Parameter(g(a + "kv_norm.weight"))
            L.wq_b = nn.Parameter(g(a + "q_b_proj.weight").t().contiguous())
            L.sink = nn.Parameter(g(a + "sinks"))
            wo_a = g(a + "o_a_proj.weight").view(G, ro, -1).transpose(1, 2).contiguous()  # (G, H/G*hd, ro)
            wo_b = g(a + "o_b_proj.weight").t().contiguous()  # (G*ro, D)
            if BUG == "folded_o_proj":
                L.wo = nn.Parameter(torch.block_diag(*wo_a) @ wo_b)
            else:
                L.wo_a, L.wo_b = nn.Parameter(wo_a), nn.Parameter(wo_b)
            kind = self.layer_types[i]
            if kind != "sliding_attention":
                c = a + "compressor."
                L.c_w = nn.Parameter(
                    torch.cat([g(c + "kv_proj.weight"), g(c + "gate_proj.weight")], 0).t().contiguous()
                )
                L.c_pb = nn.Parameter(g(c + "position_bias"))
                L.c_g = nn.Parameter(g(c + "kv_norm.weight"))
                if kind == "compressed_sparse_attention":
                    x = c + "indexer."
                    L.i_w = nn.Parameter(
                        torch.cat([g(x + "kv_proj.weight"), g(x + "gate_proj.weight")], 0).t().contiguous()
                    )
                    L.i_pb = nn.Parameter(g(x + "position_bias"))
                    L.i_g = nn.Parameter(g(x + "kv_norm.weight"))
                    L.i_wq = nn.Parameter(g(x + "q_b_proj.weight").t().contiguous())
                    L.i_wh = nn.Parameter(g(x + "scorer.weights_proj.weight").t().contiguous())
            # MoE
            L.w_rt = nn.Parameter(g(m + "gate.weight").t().contiguous())
            if self.mlp_types[i] == "hash_moe":
                L.register_buffer("tid2eid", sd[m + "gate.tid2eid"].detach().clone().long())
                L.register_buffer("rt_bias", torch.zeros(self.E))
            else:
                L.register_buffer("rt_bias", g(m + "gate.e_score_correction_bias"))
            gu = g(m + "experts.gate_up_proj")  # (E, 2I, D): rows [gate | up]
            if BUG == "experts_gate_up_interleaved":
                gu = torch.cat([gu[:, 0::2], gu[:, 1::2]], 1)
            L.w_gu = nn.Parameter(gu.transpose(1, 2).contiguous())  # (E, D, 2I)
            L.w_dn = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous())  # (E, I, D)
            s = m + "shared_experts."
            L.s_gu = nn.Parameter(torch.cat([g(s + "gate_proj.weight"), g(s + "up_proj.weight")], 0).t().contiguous())
            L.s_dn = nn.Parameter(g(s + "down_proj.weight").t().contiguous())
            self.layers.append(L)

    # ---- rotary (interleaved pairs on the trailing rd channels) ----
    def _cs(self, pos, kind):
        inv, sc = (self.inv_main, self.sc_main) if kind == "main" else (self.inv_comp, self.sc_comp)
        ang = pos[..., None].float() * inv
        return ang.cos() * sc, ang.sin() * sc

    def _rope(self, x, cos, sin):
        """x (..., S, d), cos / sin broadcastable to (..., S, rd / 2)."""
        rd = self.rd
        nope, r = x[..., :-rd], x[..., -rd:]
        if BUG == "complex_rope":
            z = torch.view_as_complex(r.float().reshape(*r.shape[:-1], rd // 2, 2).contiguous())
            r = torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
        elif BUG == "rope_neox_pairs":
            r1, r2 = r[..., : rd // 2], r[..., rd // 2 :]
            r = torch.cat([r1 * cos - r2 * sin, r2 * cos + r1 * sin], -1)
        else:
            e, o = r[..., 0::2], r[..., 1::2]
            r = torch.stack([e * cos - o * sin, e * sin + o * cos], -1).flatten(-2)
        return torch.cat([nope, r], -1)

    # ---- hyper-connections ----
    def _hc(self, L, j, h):
        B, S, N, D = h.shape
        mix = _rms(h.reshape(B, S, N * D), self.eps) @ L.hc_w[j]
        lp, lq, lc = mix.split([N, N, N * N], -1)
        bp, bq, bc = L.hc_b[j].split([N, N, N * N])
        sp, sq, scm = L.hc_s[j]
        pre = torch.sigmoid(lp * sp + bp) + self.hc_eps
        post = torch.sigmoid(lq * sq + bq)
        if BUG != "hc_post_no_double":
            post = 2 * post
        comb = torch.softmax((lc * scm + bc).view(B, S, N, N), -1) + self.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        x = (pre[..., None] * h).sum(2)
        return x, post, comb

    def _hc_out(self, y, post, comb, h):
        if BUG == "hc_comb_not_transposed":
            mixed = torch.einsum("bskj,bsjd->bskd", comb, h)
        else:
            mixed = torch.einsum("bsjk,bsjd->bskd", comb, h)
        return post[..., None] * y[:, :, None, :] + mixed

    # ---- compressors ----
    def _pool(self, x, w, pb, gain, m, width, overlap, pos, main=True):
        """Gated pooling of tensor-index windows of m tokens -> (B, n, width) entries, normed and rotated."""
        B, S, _ = x.shape
        n = S // m
        cw = 2 * width if overlap else width
        kv, z = (x @ w).split(cw, -1)
        kv = kv[:, : n * m].reshape(B, n, m, cw)
        z = z[:, : n * m].reshape(B, n, m, cw) + pb
        if overlap:
            ka, kb = kv[..., :width], kv[..., width:]
            za, zb = z[..., :width], z[..., width:]
            if BUG == "csa_halves_swapped" and main:
                ka, kb, za, zb = kb, ka, zb, za
            # Ca of window w - 1 joins window w; window 0 gets empty slots (weight 0)
            ka = torch.cat([torch.zeros_like(ka[:, :1]), ka[:, :-1]], 1)
            za = torch.cat([torch.full_like(za[:, :1], float("-inf")), za[:, :-1]], 1)
            if BUG == "csa_split_softmax":
                lse_a, lse_b = za.logsumexp(2, keepdim=True), zb.logsumexp(2, keepdim=True)
                lse = torch.logaddexp(lse_a, lse_b)
                part_a = (ka * (za - lse_a).exp()).sum(2) * (lse_a - lse).squeeze(2).exp()
                part_b = (kb * (zb - lse_b).exp()).sum(2) * (lse_b - lse).squeeze(2).exp()
                pooled = torch.nan_to_num(part_a) + part_b
                return self._finish(pooled, gain, m, n, pos)
            kv, z = torch.cat([ka, kb], 2), torch.cat([za, zb], 2)
        if BUG == "hca_softmax_channels" and not overlap:
            pooled = (kv * z.softmax(-1)).sum(2)
        else:
            pooled = (kv * z.softmax(2)).sum(2)
        return self._finish(pooled, gain, m, n, pos)

    def _finish(self, pooled, gain, m, n, pos):
        c = _rms(pooled, self.eps, gain)
        B = c.shape[0]
        start = torch.arange(n) * m
        if BUG == "compress_rope_window_end":
            where = (start + m - 1)[None].expand(B, n)
        elif BUG == "compress_pos_from_position_ids":
            where = pos[:, start]
        else:
            where = start[None].expand(B, n)
        cos, sin = self._cs(where, "compress")
        return self._rope(c, cos, sin)

    def _indexer(self, L, x, q_res, pos, m):
        B, S, _ = x.shape
        keys = self._pool(x, L.i_w, L.i_pb, L.i_g, m, self.dI, True, pos, main=False)  # (B, T, dI)
        T = keys.shape[1]
        cos, sin = self._cs(pos, "compress")
        q = self._rope((q_res @ L.i_wq).view(B, S, self.nI, self.dI).transpose(1, 2), cos[:, None], sin[:, None])
        q = q.transpose(1, 2)  # (B, S, nI, dI)
        dots = torch.matmul(q, keys.transpose(-1, -2)[:, None])  # (B, S, nI, T)
        if BUG != "indexer_no_relu":
            dots = F.relu(dots)
        dots = dots * self.dI**-0.5
        wts = (x @ L.i_wh) * self.nI**-0.5
        score = (dots * wts[..., None]).sum(2)  # (B, S, T)
        limit = ((pos + 1) // m)[..., None]
        future = torch.arange(T)[None, None] >= limit
        score = score.masked_fill(future, float("-inf"))
        top = score.topk(min(self.topk_i, T), -1).indices
        keep = torch.zeros(B, S, T, dtype=torch.bool)
        return keep.scatter(-1, top, top < limit)

    # ---- attention ----
    def _attn(self, L, x, kind, pos, allowed, cs):
        B, S, _ = x.shape
        H, hd, r = self.H, self.hd, self.r
        cos, sin = cs["main" if kind == "sliding_attention" or BUG == "compressed_layers_main_rope" else "compress"]
        qa, kv = (x @ L.w_a).split([r, hd], -1)
        q_res = _rms(qa, self.eps, L.gq)
        q = (q_res @ L.wq_b).view(B, S, H, hd).transpose(1, 2)
        if BUG != "q_head_norm_missing":
            q = _rms(q, self.eps)
        q = self._rope(q, cos[:, None], sin[:, None])  # (B, H, S, hd)
        k = self._rope(_rms(kv, self.eps, L.gkv), cos, sin)  # (B, S, hd)
        vis = allowed
        if kind != "sliding_attention":
            m = self.rates[kind]
            ck = self._pool(x, L.c_w, L.c_pb, L.c_g, m, hd, kind == "compressed_sparse_attention", pos)
            T = ck.shape[1]
            if kind == "compressed_sparse_attention":
                cvis = self._indexer(L, x, q_res, pos, m)
            else:
                cvis = torch.arange(T)[None, None] < ((pos + 1) // m)[..., None]
            k = torch.cat([k, ck], 1)
            vis = torch.cat([allowed, cvis], -1)
        if BUG == "sdpa_sink":
            kk = torch.cat([k, torch.zeros_like(k[:, :1])], 1)[:, None].expand(B, H, -1, hd)
            bias = torch.zeros(vis.shape, dtype=q.dtype).masked_fill(~vis, float("-inf"))[:, None].expand(B, H, S, -1)
            bias = torch.cat([bias, L.sink.view(1, H, 1, 1).expand(B, H, S, 1)], -1)
            o = F.scaled_dot_product_attention(q, kk, kk, attn_mask=bias)
        else:
            sc = torch.matmul(q, k[:, None].transpose(-1, -2)) * hd**-0.5  # (B, H, S, K)
            sc = sc.masked_fill(~vis[:, None], float("-inf"))
            sc = torch.cat([sc, L.sink.view(1, H, 1, 1).expand(B, H, S, 1)], -1)
            o = torch.matmul(sc.softmax(-1)[..., :-1], k[:, None])  # (B, H, S, hd)
        if BUG != "attn_out_not_derotated":
            o = self._rope(o, cos[:, None], -sin[:, None])
        o = o.transpose(1, 2).reshape(B, S, H * hd)
        if BUG == "folded_o_proj":
            return o @ L.wo
        og = o.view(B, S, self.G, -1)
        return torch.einsum("bsgi,gio->bsgo", og, L.wo_a).reshape(B, S, -1) @ L.wo_b

    # ---- MoE ----
    def _swiglu(self, gu, clamp=True):
        gt, up = gu.chunk(2, -1)
        if clamp:
            gt, up = gt.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return F.silu(gt) * up

    def _moe(self, L, x, ids, hashed):
        B, S, D = x.shape
        t = x.reshape(-1, D)
        s = torch.sqrt(F.softplus(t @ L.w_rt))
        if hashed and BUG != "hash_router_learned":
            idx = L.tid2eid[ids.reshape(-1)]
        else:
            idx = (s + L.rt_bias).topk(self.k, -1).indices
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.rsf
        if BUG == "dense_experts":
            dense = torch.zeros(t.shape[0], self.E).scatter_add(1, idx, w)
            act = self._swiglu(torch.einsum("nd,edf->enf", t, L.w_gu))
            routed = torch.einsum("enf,efd,ne->nd", act, L.w_dn, dense)
        else:
            act = self._swiglu(torch.einsum("nd,nkdf->nkf", t, L.w_gu[idx]))
            routed = torch.einsum("nkf,nkfd,nk->nd", act, L.w_dn[idx], w)
        shared = self._swiglu(t @ L.s_gu, clamp=BUG != "shared_expert_no_clamp") @ L.s_dn
        return (routed + shared).view(B, S, D)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        pos = torch.arange(S)[None].expand(B, S) if position_ids is None else position_ids
        am = torch.ones(B, S, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        i = torch.arange(S)
        band = (i[None] <= i[:, None]) & (i[None] > i[:, None] - self.window)
        allowed = band[None] & am[:, None, :]  # (B, S, S)
        cs = {"main": self._cs(pos, "main"), "compress": self._cs(pos, "compress")}
        h = self.tok[input_ids][:, :, None, :].expand(B, S, self.N, self.D)
        for li, L in enumerate(self.layers):
            x, post, comb = self._hc(L, 0, h)
            y = self._attn(L, _rms(x, self.eps, L.g1), self.layer_types[li], pos, allowed, cs)
            h = self._hc_out(y, post, comb, h)
            x, post, comb = self._hc(L, 1, h)
            y = self._moe(L, _rms(x, self.eps, L.g2), input_ids, self.mlp_types[li] == "hash_moe")
            h = self._hc_out(y, post, comb, h)
        mix = _rms(h.reshape(B, S, -1), self.eps) @ self.hh_w
        pre = torch.sigmoid(mix * self.hh_s + self.hh_b) + self.hc_eps
        x = (pre[..., None] * h).sum(2)
        return (_rms(x, self.eps, self.fin) @ self.head_t).float()


def build(state_dict, config):
    return DeepseekV4Port(state_dict, config).eval()
