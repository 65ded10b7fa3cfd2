"""Hand-written plain-PyTorch port of HunYuan v4 (HYV4ForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
- token embedding (no scaling), untied lm_head, final RMSNorm.
- * hyper-connections: the residual is hc_mult parallel streams (B, S, N, H), all starting as the embedding.
  Before each attention / FFN block, a HC unit reads the flattened streams f (N*H): mixes = (f @ fn^T) / rms(f)
  (eps = rms_norm_eps); pre = sigmoid(mix_pre * scale[0] + base_pre) + hc_eps,
  post = hc_magnitude * sigmoid(mix_post * scale[1] + base_post) + hc_eps; the block input is sum_i pre_i * s_i,
  and every stream i gets s_i += post_i * block_output (no stream-mixing matrix). At the end a HyperHead collapses
  the streams with sigmoid(mixes * hc_scale + hc_base) + hc_eps weights, before the final RMSNorm.
- blocks are pre-norm: RMSNorm on the HC-mixed input (input_layernorm / post_attention_layernorm).
- * MLA attention (one key/value per head): q = W_qb RMSNorm(W_qa x) (eps 1e-6), per head [nope | rope];
  latent = RMSNorm(kv_a x [:kv_lora_rank]) (eps 1e-6), shared k_rope = kv_a x [kv_lora_rank:];
  per head [k_nope | v] = kv_b latent; rotate-half RoPE on the rope parts only (theta from config);
  scale 1/sqrt(nope + rope) (config.head_dim is the rope dim only, not the scale's dim);
  * DSA sparse selection: on "full" indexer layers an indexer scores keys
    sum_h (weights_proj(x)_h / sqrt(n_idx * idx_dim)) * relu(q_idx_h . k_idx), q_idx = wq_b(q latent),
    k_idx = LayerNorm(wk x) (with bias), RoPE on the LAST rope dims of q_idx / k_idx; the causal / padding mask is
    added, and each query keeps its index_topk best keys; "shared" layers reuse the most recent full layer's choice;
  * learned per-head attention sink logit joins the softmax, then is dropped;
  * output gate: per head, o * sigmoid(gate_proj(x)) (x = the normed attention input), then o_proj.
- FFN per config.mlp_layer_types: "dense" SwiGLU; "sparse" MoE: sigmoid router (fp32), correction bias for the
  choice only, top-k weights renormalised (+1e-20) and * routed_scaling_factor; routed experts use a clamped
  SwiGLU (gate <= swiglu_limit, |up| <= swiglu_limit), plus an unclamped shared SwiGLU expert.
Weight layout of this port (own names):
- tok (V, H); head_t (H, V) transposed; fin (H,); hh_w (N*H, N) transposed hc_fn, hh_b (N,), hh_s (1,).
- per layer `blocks[i]`: hc_a / hc_f sub-modules with w_pre / w_post (N*H, N) (fn's rows split + transposed),
  b_pre / b_post (N,), s_pre / s_post (scalars); g_a / g_f (H,) norm gains;
  w_qa (H, rq), g_qa (rq,), w_qb (rq, nH*(nope+rope)); w_kva (H, rkv + rope), g_kva (rkv,);
  k_up (nH, rkv, nope) and v_up (nH, rkv, v) (kv_b_proj split per head); w_gate (H, nH*v); sink (nH,);
  w_o (nH*v, H); indexer (full layers): w_iq (rq, nI*di), w_ik (H, di), ln_w / ln_b (di,), w_iw (H, nI).
  dense: w_gu (H, 2I) [gate | up], w_d (I, H); sparse: w_r (H, E), corr (E,) buffer,
  eg / eu (E, H, Im), ed (E, Im, H), sh_gu (H, 2Is), sh_d (Is, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "hy4_indexer_rope_front",  # indexer RoPE on the FIRST rope dims of its q/k (as in main attention), not the last
    "hy4_indexer_no_relu",  # ReLU missing on the indexer's per-head q.k scores
    "hy4_indexer_key_rmsnorm",  # indexer key norm done as RMSNorm (gain only) instead of LayerNorm with bias
    "hy4_shared_reuses_first",  # "shared" indexer layers reuse layer 0's top-k instead of the latest full layer's
    "hy4_sink_missing",  # learned attention-sink logits left out of the softmax
    "hy4_gate_from_stream",  # output gate computed from the un-normed HC-mixed input instead of the normed one
    "hy4_scale_config_head_dim",  # softmax scale 1/sqrt(config.head_dim) (= rope dim) instead of 1/sqrt(nope + rope)
    "hy4_kvb_split_swapped",  # kv_b_proj rows of each head read as [v | k_nope] instead of [k_nope | v] at load
    "hy4_hc_scale_swapped",  # HC scale pair unpacked as (post, pre) instead of (pre, post) at load
    "hy4_hc_no_input_norm",  # HC mixes not divided by the rms of the flattened streams
    "hy4_hc_head_mean",  # final streams collapsed by a plain mean instead of the HyperHead's sigmoid weights
    "hy4_swiglu_clamp_shared",  # routed experts' SwiGLU clamp also applied to the shared expert and dense MLP
    "hy4_swiglu_clamp_gate_both",  # gate clamped to [-limit, limit] instead of only from above
    "hy4_indexer_no_padding_mask",  # indexer scores get the causal mask only, so top-k slots go to padding keys
]
PADDING_ONLY = {"hy4_indexer_no_padding_mask"}
CLEAN = [
    "hy4_absorbed_mla",  # MLA with absorbed weights: q_nope mapped into the latent, values expanded after attention
    "hy4_sink_sigmoid",  # sink applied as softmax without it times sigmoid(logsumexp - sink)
    "hy4_dense_moe",  # every expert run on every token, combined with a scattered (T, E) weight matrix
    "hy4_complex_rope",  # RoPE as complex multiplication of (x_i, x_{i+d/2}) pairs
    "hy4_hc_fold_scale",  # HC pre/post scales folded into the mixing weights at call time
]


def _rms(x, g, eps):
    x = x.float()
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, ang):
    """x (..., S, h, d) or broadcastable; ang (B, S, 1, d/2) -> rotate-half RoPE over the whole last dim."""
    half = x.shape[-1] // 2
    if BUG == "hy4_complex_rope":
        z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(ang), ang)
        return torch.cat((z.real, z.imag), -1)
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


class _HC(nn.Module):
    def __init__(self, fn, base, scale, n):
        super().__init__()
        self.w_pre = nn.Parameter(fn[:n].t().contiguous())
        self.w_post = nn.Parameter(fn[n:].t().contiguous())
        self.b_pre, self.b_post = nn.Parameter(base[:n].clone()), nn.Parameter(base[n:].clone())
        s_pre, s_post = scale[1], scale[0]
        if BUG != "hy4_hc_scale_swapped":
            s_pre, s_post = scale[0], scale[1]
        self.s_pre, self.s_post = nn.Parameter(s_pre.clone()), nn.Parameter(s_post.clone())


class HyV4Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rkv = cfg.kv_lora_rank
        self.eps = cfg.rms_norm_eps
        self.theta = cfg.rope_parameters["rope_theta"]
        self.N = cfg.hc_mult
        self.hc_eps, self.hc_mag = cfg.hc_eps, cfg.hc_magnitude
        self.ni, self.di, self.itop = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.topk, self.rscale, self.renorm = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.limit = cfg.swiglu_limit
        self.mlp_kinds = list(cfg.mlp_layer_types)
        self.idx_kinds = list(cfg.indexer_types)
        self.cfg_head_dim = cfg.head_dim
        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("model.norm.weight"))
        self.hh_w = nn.Parameter(g("model.hc_head.hc_fn").t().contiguous())
        self.hh_b = nn.Parameter(g("model.hc_head.hc_base"))
        self.hh_s = nn.Parameter(g("model.hc_head.hc_scale"))
        self.blocks = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            b = nn.Module()
            for tag, name in (("hc_a", "attn_hc"), ("hc_f", "ffn_hc")):
                setattr(b, tag, _HC(g(p + name + ".fn"), g(p + name + ".base"), g(p + name + ".scale"), self.N))
            b.g_a = nn.Parameter(g(p + "input_layernorm.weight"))
            b.g_f = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            b.w_qa = nn.Parameter(g(a + "q_a_proj.weight").t().contiguous())
            b.g_qa = nn.Parameter(g(a + "q_a_layernorm.weight"))
            b.w_qb = nn.Parameter(g(a + "q_b_proj.weight").t().contiguous())
            b.w_kva = nn.Parameter(g(a + "kv_a_proj_with_mqa.weight").t().contiguous())
            b.g_kva = nn.Parameter(g(a + "kv_a_layernorm.weight"))
            kvb = g(a + "kv_b_proj.weight").view(self.nh, self.nope + self.vd, self.rkv)
            if BUG == "hy4_kvb_split_swapped":
                v_rows, k_rows = kvb.split([self.vd, self.nope], 1)
            else:
                k_rows, v_rows = kvb.split([self.nope, self.vd], 1)
            b.k_up = nn.Parameter(k_rows.transpose(1, 2).contiguous())  # (nH, rkv, nope)
            b.v_up = nn.Parameter(v_rows.transpose(1, 2).contiguous())  # (nH, rkv, v)
            b.w_gate = nn.Parameter(g(a + "gate_proj.weight").t().contiguous())
            b.sink = nn.Parameter(g(a + "sinks"))
            b.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            if self.idx_kinds[i] == "full":
                ix = a + "indexer."
                b.w_iq = nn.Parameter(g(ix + "wq_b.weight").t().contiguous())
                b.w_ik = nn.Parameter(g(ix + "wk.weight").t().contiguous())
                b.ln_w = nn.Parameter(g(ix + "k_norm.weight"))
                b.ln_b = nn.Parameter(g(ix + "k_norm.bias"))
                b.w_iw = nn.Parameter(g(ix + "weights_proj.weight").t().contiguous())
            if self.mlp_kinds[i] == "sparse":
                b.w_r = nn.Parameter(g(m + "gate.weight").t().contiguous())
                b.register_buffer("corr", g(m + "gate.e_score_correction_bias"))
                gu = g(m + "experts.gate_up_proj")
                im = gu.shape[1] // 2
                b.eg = nn.Parameter(gu[:, :im].transpose(1, 2).contiguous())
                b.eu = nn.Parameter(gu[:, im:].transpose(1, 2).contiguous())
                b.ed = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous())
                s = m + "shared_experts."
                b.sh_gu = nn.Parameter(
                    torch.cat([g(s + "gate_proj.weight"), g(s + "up_proj.weight")], 0).t().contiguous()
                )
                b.sh_d = nn.Parameter(g(s + "down_proj.weight").t().contiguous())
            else:
                b.w_gu = nn.Parameter(
                    torch.cat([g(m + "gate_proj.weight"), g(m + "up_proj.weight")], 0).t().contiguous()
                )
                b.w_d = nn.Parameter(g(m + "down_proj.weight").t().contiguous())
            self.blocks.append(b)

    # ---- hyper-connections ----
    def _inv_rms(self, flat):
        if BUG == "hy4_hc_no_input_norm":
            return torch.ones_like(flat[..., :1])
        return torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)

    def _hc(self, hc, streams):
        flat = streams.flatten(2)
        inv = self._inv_rms(flat)
        if BUG == "hy4_hc_fold_scale":
            pre_l = (flat @ (hc.w_pre * hc.s_pre)) * inv + hc.b_pre
            post_l = (flat @ (hc.w_post * hc.s_post)) * inv + hc.b_post
        else:
            pre_l = (flat @ hc.w_pre) * inv * hc.s_pre + hc.b_pre
            post_l = (flat @ hc.w_post) * inv * hc.s_post + hc.b_post
        pre = torch.sigmoid(pre_l) + self.hc_eps
        post = self.hc_mag * torch.sigmoid(post_l) + self.hc_eps
        return post, (pre[..., None] * streams).sum(2)

    def _head(self, streams):
        if BUG == "hy4_hc_head_mean":
            return streams.mean(2)
        flat = streams.flatten(2)
        w = torch.sigmoid((flat @ self.hh_w) * self._inv_rms(flat) * self.hh_s + self.hh_b) + self.hc_eps
        return (w[..., None] * streams).sum(2)

    # ---- DSA indexer ----
    def _indexer(self, b, x, q_lat, ang, allowed):
        B, S, _ = x.shape
        nr = self.rope
        q = (q_lat @ b.w_iq).view(B, S, self.ni, self.di)
        k = x @ b.w_ik
        if BUG == "hy4_indexer_key_rmsnorm":
            k = _rms(k, b.ln_w, self.eps)
        else:
            k = F.layer_norm(k, (self.di,), b.ln_w, b.ln_b, self.eps)
        k = k[:, :, None]
        if BUG == "hy4_indexer_rope_front":
            q = torch.cat([_rope(q[..., :nr], ang), q[..., nr:]], -1)
            k = torch.cat([_rope(k[..., :nr], ang), k[..., nr:]], -1)
        else:
            q = torch.cat([q[..., : self.di - nr], _rope(q[..., self.di - nr :], ang)], -1)
            k = torch.cat([k[..., : self.di - nr], _rope(k[..., self.di - nr :], ang)], -1)
        s = torch.einsum("bqhd,bkd->bqhk", q, k[:, :, 0])
        if BUG != "hy4_indexer_no_relu":
            s = F.relu(s)
        w = (x @ b.w_iw) * (self.ni**-0.5 * self.di**-0.5)
        score = torch.einsum("bqh,bqhk->bqk", w, s)
        score = score.masked_fill(~allowed, torch.finfo(torch.float32).min)
        return score.topk(min(self.itop, S), -1).indices

    # ---- attention ----
    def _attn(self, b, x, stream_in, ang, allowed, allowed_idx, prev_sel):
        B, S, _ = x.shape
        nh, nope, nr, vd = self.nh, self.nope, self.rope, self.vd
        gate_src = stream_in if BUG == "hy4_gate_from_stream" else x
        gate = (gate_src @ b.w_gate).view(B, S, nh, vd)
        q_lat = _rms(x @ b.w_qa, b.g_qa, 1e-6)
        q = (q_lat @ b.w_qb).view(B, S, nh, nope + nr)
        q_nope, q_rot = q[..., :nope], _rope(q[..., nope:], ang)
        kv = x @ b.w_kva
        lat = _rms(kv[..., : self.rkv], b.g_kva, 1e-6)
        k_rot = _rope(kv[..., self.rkv :][:, :, None], ang)[:, :, 0]  # (B, S, rope)
        dim = self.cfg_head_dim if BUG == "hy4_scale_config_head_dim" else nope + nr
        if BUG == "hy4_absorbed_mla":
            q_abs = torch.einsum("bqhn,hrn->bqhr", q_nope, b.k_up)
            sc = torch.einsum("bqhr,bkr->bhqk", q_abs, lat)
        else:
            k_nope = torch.einsum("bkr,hrn->bkhn", lat, b.k_up)
            sc = torch.einsum("bqhn,bkhn->bhqk", q_nope, k_nope)
        sc = (sc + torch.einsum("bqhd,bkd->bhqk", q_rot, k_rot)) * dim**-0.5
        if hasattr(b, "w_iq"):
            sel = self._indexer(b, x, q_lat, ang, allowed_idx)
        elif BUG == "hy4_shared_reuses_first":
            sel = prev_sel[0]
        else:
            sel = prev_sel[-1]
        chosen = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, sel, True)
        keep = (allowed & chosen)[:, None]
        sc = sc.masked_fill(~keep, torch.finfo(torch.float32).min)
        sink = b.sink.view(1, nh, 1, 1)
        if BUG == "hy4_sink_missing":
            pr = sc.softmax(-1)
        elif BUG == "hy4_sink_sigmoid":
            pr = sc.softmax(-1) * torch.sigmoid(sc.logsumexp(-1, keepdim=True) - sink)
        else:
            full = torch.cat([sc, sink.expand(B, nh, S, 1)], -1)
            pr = (full - full.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
        if BUG == "hy4_absorbed_mla":
            o_lat = torch.einsum("bhqk,bkr->bqhr", pr, lat)
            o = torch.einsum("bqhr,hrv->bqhv", o_lat, b.v_up)
        else:
            v = torch.einsum("bkr,hrv->bkhv", lat, b.v_up)
            o = torch.einsum("bhqk,bkhv->bqhv", pr, v)
        o = o * torch.sigmoid(gate)
        return o.reshape(B, S, nh * vd) @ b.w_o, sel

    # ---- FFN ----
    def _swiglu(self, x, w_gu, w_d, clamp):
        gt, up = (x @ w_gu).chunk(2, -1)
        if clamp:
            gt = gt.clamp(min=-self.limit if BUG == "hy4_swiglu_clamp_gate_both" else None, max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        return (F.silu(gt) * up) @ w_d

    def _moe(self, b, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        scores = (t @ b.w_r).sigmoid()
        idx = (scores + b.corr).topk(self.topk, -1).indices
        w = scores.gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.rscale
        E = b.eg.shape[0]
        if BUG == "hy4_dense_moe":
            dense = torch.zeros(t.shape[0], E).scatter(1, idx, w)
            gt = torch.einsum("th,ehi->tei", t, b.eg).clamp(
                min=-self.limit if BUG == "hy4_swiglu_clamp_gate_both" else None, max=self.limit
            )
            up = torch.einsum("th,ehi->tei", t, b.eu).clamp(-self.limit, self.limit)
            routed = torch.einsum("tei,eih,te->th", F.silu(gt) * up, b.ed, dense)
        else:
            routed = torch.zeros_like(t)
            for e in range(E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel():
                    gu = torch.cat([b.eg[e], b.eu[e]], 1)
                    ye = self._swiglu(t[tok], gu, b.ed[e], clamp=True)
                    routed.index_add_(0, tok, ye * w[tok, slot, None])
        shared = self._swiglu(t, b.sh_gu, b.sh_d, clamp=BUG == "hy4_swiglu_clamp_shared")
        return (routed + shared).view(B, S, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None]
        allowed = causal & attention_mask.bool()[:, None, :]
        allowed_idx = causal.expand(B, S, S) if BUG == "hy4_indexer_no_padding_mask" else allowed
        inv = 1.0 / (self.theta ** (torch.arange(0, self.rope, 2, dtype=torch.float32) / self.rope))
        ang = (position_ids[..., None].float() * inv)[:, :, None]  # (B, S, 1, rope/2)
        streams = self.tok[input_ids][:, :, None].expand(B, S, self.N, self.H)
        sels = []
        for i, b in enumerate(self.blocks):
            post, xin = self._hc(b.hc_a, streams)
            a, sel = self._attn(b, _rms(xin, b.g_a, self.eps), xin, ang, allowed, allowed_idx, sels)
            if self.idx_kinds[i] == "full":
                sels.append(sel)
            streams = streams + post[..., None] * a[:, :, None]
            post, xin = self._hc(b.hc_f, streams)
            xn = _rms(xin, b.g_f, self.eps)
            if self.mlp_kinds[i] == "sparse":
                f = self._moe(b, xn)
            else:
                f = self._swiglu(xn, b.w_gu, b.w_d, clamp=BUG == "hy4_swiglu_clamp_shared")
            streams = streams + post[..., None] * f[:, :, None]
        h = _rms(self._head(streams), self.fin, self.eps)
        return (h @ self.head_t).float()


def build(state_dict, config):
    return HyV4Port(state_dict, config).eval()
