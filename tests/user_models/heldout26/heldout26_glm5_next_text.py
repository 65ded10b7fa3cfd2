"""Hand-written plain-PyTorch port of the GLM-5.3-Flash text causal LM (glm5_next package).

The package ships no text-only *ForCausalLM: its causal LM is Glm5NextForConditionalGeneration (language model under
model.language_model.*, head lm_head), run here on text-only input; build() takes that model's state dict and its
composite Glm5NextConfig (or a bare Glm5NextTextConfig with model.* keys).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head; Llama RMSNorm (w * x / rms) for block / q_a / kv_a / final norms;
  * manifold-constrained HYPER-CONNECTIONS (mHC): the residual is N = hc_mult streams (B, S, N, H), all initialised to
    the embedding. Around each mixer and each FFN:
        f = unweighted_rmsnorm(flatten(streams)) @ fn^T  ->  (pre (N), post (N), comb (N x N, row i = f[2N + iN ...]))
        pre = sigmoid(s0 pre + b) + hc_eps;  post = 2 sigmoid(s1 post + b);  comb = softmax_row(s2 comb + b) + hc_eps,
        then Sinkhorn: one column normalisation, then (iters - 1) x (row, column) normalisations (each + hc_eps);
        x = sum_i pre_i stream_i;  y = Block(RMS(x));  stream_j <- post_j y + sum_i comb[i, j] stream_i  (comb^T);
    final hidden = MEAN of the streams, then final RMSNorm and head;
  * per-layer mixer from config.layer_types: "linear_attention" (KDA) or "indexed_attention" (MLA + DSA indexer);
    here [KDA, indexed(full indexer), indexed(shared: reuses the previous layer's selection), KDA];
  * KDA (Kimi delta attention), nh heads of hd: padded inputs zeroed; q, k, v projections, causal depthwise conv (K)
    over [q | k | v], SiLU; q, k L2-normalised (x / sqrt(sum x^2 + 1e-6)), q * hd^-0.5;
    PER-CHANNEL forget gate  f = f_b(f_a(x)) + dt_bias,  g = lower_bound * sigmoid(exp(A_log_head) * f)  (log decay);
    beta = sigmoid(b_proj(x)) per head;  state S (hd, hd): S <- diag(exp(g_t)) S;  u = beta (v - S^T k);  S += k u^T;
    o = S^T q;  output gated norm  w * rmsnorm(o) * SIGMOID(g_b(g_a(x)));  o_proj;
  * MLA attention (NoPE: qk_rope_head_dim = 0, no RoPE at all; num_key_value_heads == heads):
      q = q_b(RMS_qa(q_a(x))) per head (qk_nope);  latent c = RMS_kva(kv_a(x));  kv_b(c) per head [k_nope_h | v_h];
      scores * (qk_nope + qk_rope)^-0.5, softmax over the keys picked by the DSA indexer;
  * DSA indexer with k-pools (kpool P): iq = wq_b(q_resid) (n_i heads x d_i); ik = LayerNorm(wk(x));
      pools of P consecutive REAL tokens counted from the row's first real token; a pool is valid if all P slots are
      real; pooled key = sum_j softmax_j(gate_j + ape_j) ik_j (per channel), gate = x @ compress_gate^T;
      score(q, pool) = sum_h [w_h(x_q) n_i^-0.5] relu(iq_h . pooled * d_i^-0.5); candidates: valid pools whose last
      token is <= q; the top index_topk / P candidates are kept and expanded to their tokens, plus the TAIL: the
      query's own incomplete pool (real tokens at local index >= P * floor(count / P), count = real tokens <= q);
      "shared" layers reuse the previous full layer's selection;
  * FFN from config.mlp_layer_types: dense SwiGLU, or MoE = routed experts + shared expert (moe_intermediate * n_shared);
    all SwiGLUs CLAMPED: gate <= swiglu_limit, |up| <= swiglu_limit;
    router: sigmoid scores, + e_score_correction_bias for choice, group score = top-2 sum per group, topk_group groups,
    top-k experts, weights = unbiased scores renormalised (+1e-20) * routed_scaling_factor;
  - padding: HF-style 0/1 attention_mask: padded inputs of KDA zeroed, padded keys never selected.

Weight layout of this port (own names):
  tok (V, H); out (V, H) (F.linear layout); g_out (H,);
  blocks[i].hc_a / hc_f: w ((N H), (2 + N) N) (in, out), base ((2 + N) N,), sc (3,); g1 / g2 (H,);
  MLA: w_dq_dkv (H, q_lora + kv_lora) (in, out) columns [q_a | kv_a]; g_qa, g_kva; w_qb (q_lora, nh nope) (in, out);
       w_uk (nh, nope, kv_lora), w_uv (nh, vd, kv_lora) split from kv_b_proj; w_o (nh vd, H) (in, out);
  indexer: w_iq (q_lora, n_i d_i) (in, out); w_kgw (H, 2 d_i + n_i) (in, out) columns [wk | compress_gate | weights];
       ln_w / ln_b (d_i,); ape (P, d_i);
  KDA: w_qkv (H, 3 nh hd) (in, out); conv (K, 3 nh hd); w_fgb (H, 2 hd + nh) columns [f_a | g_a | b];
       w_fb / w_gb (hd, nh hd) (in, out); dt (nh hd,); A_rate (nh,) = exp(A_log); gn (hd,); w_o (nh hd, H) (in, out);
  FFN: w_gu (H, 2 I) [up | gate], w_dn (I, H); MoE: w_r (H, E), e_bias (E,), w_gu (E, H, 2 I) [up | gate],
       w_dn (E, I, H), shared s_gu / s_dn.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "g5_hc_comb_not_transposed",  # residual streams mixed with comb instead of comb^T (stream_j <- sum_i comb[j, i] ..)
    "g5_hc_post_no_double",  # hyper-connection post weights sigmoid(.) instead of 2 * sigmoid(.)
    "g5_kda_gate_softplus",  # linear_lower_bound ignored: forget gate -exp(A_log) * softplus(f) instead of lb * sigmoid
    "g5_kda_gate_per_head",  # KDA decay collapsed to one scalar per head (Gated-DeltaNet style) instead of per channel
    "g5_o_norm_gate_silu",  # KDA output gated norm uses silu(gate) instead of sigmoid(gate)
    "g5_conv_no_silu",  # SiLU after the KDA short conv dropped
    "g5_kv_b_flat_split",  # kv_b_proj rows read as [all k_nope | all v] instead of per head [k_nope_h | v_h]
    "g5_scale_v_head_dim",  # MLA softmax scale v_head_dim**-0.5 instead of qk_head_dim**-0.5
    "g5_indexer_shared_ignored",  # "shared" indexer layers attend densely (causal) instead of reusing the selection
    "g5_indexer_no_tail",  # the query's incomplete k-pool (tail) not added to the selected tokens
    "g5_indexer_no_relu",  # indexer head scores not passed through ReLU before the weighted head sum
    "g5_swiglu_no_clamp",  # swiglu_limit ignored: gate / up projections not clamped
    "g5_kpool_from_slot0",  # k-pools counted from slot 0 instead of the row's first real token (left padding)
]
PADDING_ONLY = {"g5_kpool_from_slot0"}
CLEAN = [
    "sdpa_attention",  # F.scaled_dot_product_attention with the boolean selection mask instead of explicit softmax
    "kda_chunked",  # chunked (chunk 8) per-channel-decay WY form of the KDA recurrence instead of token by token
    "mla_absorbed",  # MLA with kv_b absorbed: scores and context computed in the kv_lora latent space
    "moe_dense_all_experts",  # every expert run on every token, combined with a dense (T, E) routing-weight matrix
    "varlen_unpad",  # each row's real tokens run alone, logits scattered back
]

CHUNK = 8


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, g, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if g is None else y * g


def _l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _swiglu(x, w_gu, w_dn, limit):
    up, gate = (x @ w_gu).chunk(2, -1)
    if _bug() != "g5_swiglu_no_clamp":
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (F.silu(gate) * up) @ w_dn


def _gu_cols(sd, p):
    wg = sd[p + "gate_proj.weight"].float().t()
    wu = sd[p + "up_proj.weight"].float().t()
    return torch.cat((wu, wg), 1), sd[p + "down_proj.weight"].float().t()


class HyperConn(nn.Module):
    def __init__(self, sd, p, tc):
        super().__init__()
        self.N = tc.hc_mult
        self.iters = tc.hc_sinkhorn_iters
        self.heps = tc.hc_eps
        self.eps = tc.rms_norm_eps
        self.w = _P(sd[p + "fn"].float().t())
        self.base = _P(sd[p + "base"])
        self.sc = _P(sd[p + "scale"])

    def forward(self, streams):
        B, S, N, H = streams.shape
        f = _rms(streams.reshape(B, S, N * H), None, self.eps) @ self.w
        pw, qw, cw = f.split((N, N, N * N), -1)
        pb, qb, cb = self.base.split((N, N, N * N))
        pre = torch.sigmoid(pw * self.sc[0] + pb) + self.heps
        post = torch.sigmoid(qw * self.sc[1] + qb)
        if _bug() != "g5_hc_post_no_double":
            post = 2 * post
        comb = torch.softmax((cw * self.sc[2] + cb).view(B, S, N, N), -1) + self.heps
        comb = comb / (comb.sum(-2, keepdim=True) + self.heps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.heps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.heps)
        x = (pre[..., None] * streams).sum(2)
        return x, post, comb

    @staticmethod
    def merge(y, streams, post, comb):
        if _bug() == "g5_hc_comb_not_transposed":
            mixed = torch.einsum("bsji,bsih->bsjh", comb, streams)
        else:
            mixed = torch.einsum("bsij,bsih->bsjh", comb, streams)
        return post[..., None] * y[:, :, None, :] + mixed


def _kda_recurrent(q, k, v, g, beta):
    """q, k, v (B, n, S, d); g (B, n, S, dk) per-channel log decay; beta (B, n, S)"""
    B, n, S, dk = k.shape
    st = q.new_zeros(B, n, dk, v.shape[-1])
    outs = []
    for t in range(S):
        st = st * g[:, :, t, :, None].exp()
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bnkv,bnk->bnv", st, kt))
        st = st + kt[..., None] * u[..., None, :]
        outs.append(torch.einsum("bnkv,bnk->bnv", st, q[:, :, t]))
    return torch.stack(outs, 2)


def _kda_chunked(q, k, v, g, beta, C=CHUNK):
    """chunked WY form with per-channel decay; G = within-chunk prefix sum of g (per channel):
    u = (I + A)^-1 beta (v - (e^G * k) S0),  A_ts = beta_t sum_c k_tc k_sc e^(G_tc - G_sc)  (s < t);
    o_t = (e^G_t * q_t) S0 + sum_{s<=t} [sum_c q_tc k_sc e^(G_tc - G_sc)] u_s;  S_end = e^G_C * S0 + sum_s (e^(G_C-G_s) k_s) u_s^T"""
    B, n, S, dk = k.shape
    dv = v.shape[-1]
    pad = (-S) % C
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    N = (S + pad) // C
    q, k, v, g = (x.view(B, n, N, C, -1) for x in (q, k, v, g))
    beta = beta.view(B, n, N, C)
    G = g.cumsum(3)
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)[..., None]
    incl = torch.ones(C, C, dtype=torch.bool).tril(0)[..., None]
    eye = torch.eye(C)
    st = q.new_zeros(B, n, dk, dv)
    outs = []
    for c in range(N):
        qc, kc, vc, Gc, bc = q[:, :, c], k[:, :, c], v[:, :, c], G[:, :, c], beta[:, :, c]
        diff = Gc[:, :, :, None, :] - Gc[:, :, None, :, :]  # (B, n, t, s, dk)
        d_s = diff.masked_fill(~strict, float("-inf")).exp()
        d_i = diff.masked_fill(~incl, float("-inf")).exp()
        A = bc[..., None] * torch.einsum("bntc,bnsc,bntsc->bnts", kc, kc, d_s)
        rhs = bc[..., None] * (vc - (kc * Gc.exp()) @ st)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        o = (qc * Gc.exp()) @ st + torch.einsum("bntc,bnsc,bntsc->bnts", qc, kc, d_i) @ u
        outs.append(o)
        last = Gc[:, :, -1:]
        st = last.transpose(-1, -2).exp() * st + (kc * (last - Gc).exp()).transpose(-1, -2) @ u
    return torch.cat(outs, 2)[:, :, :S]


class KDA(nn.Module):
    def __init__(self, sd, p, tc):
        super().__init__()
        self.pre = p
        self.nh, self.hd = tc.linear_num_heads, tc.linear_head_dim
        self.K = tc.linear_conv_kernel_dim
        self.eps = tc.rms_norm_eps
        self.lb = tc.linear_lower_bound
        if tc.hidden_act != "silu":
            raise NotImplementedError(tc.hidden_act)
        self.w_qkv = _P(torch.cat([sd[p + n + "_proj.weight"].float() for n in "qkv"], 0).t())
        self.conv = _P(sd[p + "conv1d.weight"].float()[:, 0, :].t())
        self.w_fgb = _P(
            torch.cat((sd[p + "forget_gate.f_a_proj.weight"], sd[p + "g_a_proj.weight"], sd[p + "b_proj.weight"]), 0)
            .float()
            .t()
        )
        self.w_fb = _P(sd[p + "forget_gate.f_b_proj.weight"].float().t())
        self.w_gb = _P(sd[p + "g_b_proj.weight"].float().t())
        self.dt = _P(sd[p + "forget_gate.dt_bias"])
        self.A_rate = _P(sd[p + "forget_gate.A_log"].float().exp())
        self.gn = _P(sd[p + "o_norm.weight"])
        self.w_o = _P(sd[p + "o_proj.weight"].float().t())

    def forward(self, x, keep):
        b = _bug()
        B, S, _ = x.shape
        nh, hd = self.nh, self.hd
        x = torch.where(keep[..., None], x, torch.zeros((), dtype=x.dtype))
        xp = F.pad(x @ self.w_qkv, (0, 0, self.K - 1, 0))
        y = sum(xp[:, j : j + S] * self.conv[j] for j in range(self.K))
        if b != "g5_conv_no_silu":
            y = F.silu(y)
        q, k, v = (t.view(B, S, nh, hd) for t in y.chunk(3, -1))
        q, k = _l2n(q) * hd**-0.5, _l2n(k)
        fa, ga, bb = (x @ self.w_fgb).split((hd, hd, nh), -1)
        f = (fa @ self.w_fb + self.dt).view(B, S, nh, hd)
        A = self.A_rate[:, None]
        if self.lb is None or b == "g5_kda_gate_softplus":
            g = -A * F.softplus(f)
        else:
            g = self.lb * torch.sigmoid(A * f)
        if b == "g5_kda_gate_per_head":
            g = g.mean(-1, keepdim=True).expand_as(g)
        beta = torch.sigmoid(bb)
        q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
        beta = beta.transpose(1, 2)
        if b == "kda_chunked":
            o = _kda_chunked(q, k, v, g, beta)
        else:
            o = _kda_recurrent(q, k, v, g, beta)
        o = o.transpose(1, 2)
        gate = (ga @ self.w_gb).view(B, S, nh, hd)
        act = F.silu(gate) if b == "g5_o_norm_gate_silu" else torch.sigmoid(gate)
        o = _rms(o, self.gn, self.eps) * act
        out = o.reshape(B, S, -1) @ self.w_o
        _rec(self.pre.rstrip("."), out)
        return out


class Indexer(nn.Module):
    def __init__(self, sd, p, tc):
        super().__init__()
        self.n, self.d = tc.index_n_heads, tc.index_head_dim
        self.P = tc.index_kpool
        self.topk = tc.index_topk
        self.tail = tc.index_kpool_always_select_tail
        self.w_iq = _P(sd[p + "wq_b.weight"].float().t())
        self.w_kgw = _P(
            torch.cat((sd[p + "wk.weight"], sd[p + "index_kpool_compress_gate"], sd[p + "weights_proj.weight"]), 0)
            .float()
            .t()
        )
        self.ln_w, self.ln_b = _P(sd[p + "k_norm.weight"]), _P(sd[p + "k_norm.bias"])
        self.ape = _P(sd[p + "index_kpool_compress_ape"])

    def forward(self, x, q_resid, keep):
        """returns the (B, S, S) boolean selection of keys per query"""
        b = _bug()
        B, S, _ = x.shape
        Pk = self.P
        iq = (q_resid @ self.w_iq).view(B, S, self.n, self.d)
        ik, gate, w = (x @ self.w_kgw).split((self.d, self.d, self.n), -1)
        ik = F.layer_norm(ik, (self.d,), self.ln_w, self.ln_b, 1e-6)
        if b == "g5_kpool_from_slot0":
            first = torch.zeros(B, dtype=torch.long)
        else:
            first = torch.where(keep.any(-1), keep.long().argmax(-1), torch.full((B,), S))
        # local index of every slot (slot - first real slot) and its pool number
        loc = torch.arange(S)[None] - first[:, None]  # (B, S)
        npool = (S + Pk - 1) // Pk
        real = keep & (loc >= 0)
        pool_of = torch.where(real, loc // Pk, -1)
        member = pool_of[:, None, :] == torch.arange(npool)[None, :, None]  # (B, npool, S)
        full_pool = member.sum(-1) == Pk
        logits = (gate[:, None, :, :] + self.ape[(loc.clamp(min=0) % Pk)][:, None]).expand(B, npool, S, self.d)
        logits = logits.masked_fill(~member[..., None], float("-inf"))
        pw = torch.nan_to_num(torch.softmax(logits, 2))
        pooled = torch.einsum("bpsd,bsd->bpd", pw, ik)
        sc = torch.einsum("bqhd,bpd->bqhp", iq, pooled) * self.d**-0.5
        if b != "g5_indexer_no_relu":
            sc = F.relu(sc)
        idx_scores = torch.einsum("bqh,bqhp->bqp", w * self.n**-0.5, sc)
        pool_end = first[:, None] + (torch.arange(npool)[None] + 1) * Pk - 1  # (B, npool)
        qpos = torch.arange(S)
        cand = full_pool[:, None, :] & (pool_end[:, None, :] <= qpos[None, :, None])  # (B, S, npool)
        kk = min(self.topk // Pk, int(full_pool.any(0).sum()))  # pools full in no row are dropped (as HF does)
        top = idx_scores.masked_fill(~cand, torch.finfo(idx_scores.dtype).min).topk(kk, -1).indices
        chosen = torch.zeros_like(cand).scatter(-1, top, True) & cand
        sel = torch.einsum("bqp,bps->bqs", chosen.float(), member.float()) > 0
        if self.tail and b != "g5_indexer_no_tail":
            cnt = real.long().cumsum(-1)  # (B, S): real tokens at slots <= query
            tail_start = (cnt // Pk) * Pk  # local index where the query's incomplete pool starts
            tail = real[:, None, :] & (loc[:, None, :] >= tail_start[:, :, None]) & (loc[:, None, :] < cnt[:, :, None])
            sel = sel | tail
        return sel & keep[:, :, None] & keep[:, None, :]


class MLA(nn.Module):
    def __init__(self, sd, p, tc, with_indexer):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh = tc.num_attention_heads
        self.nope, self.rope, self.vd = tc.qk_nope_head_dim, tc.qk_rope_head_dim, tc.v_head_dim
        if self.rope:
            raise NotImplementedError("qk_rope_head_dim > 0")
        self.ql, self.kl = tc.q_lora_rank, tc.kv_lora_rank
        self.eps = tc.rms_norm_eps
        if tc.attention_bias:
            raise NotImplementedError("attention_bias")
        self.w_dq_dkv = _P(torch.cat((sd[p + "q_a_proj.weight"], sd[p + "kv_a_proj_with_mqa.weight"]), 0).float().t())
        self.g_qa, self.g_kva = _P(sd[p + "q_a_layernorm.weight"]), _P(sd[p + "kv_a_layernorm.weight"])
        self.w_qb = _P(sd[p + "q_b_proj.weight"].float().t())
        kvb = sd[p + "kv_b_proj.weight"].float()
        if b == "g5_kv_b_flat_split":
            wk, wv = kvb.split((self.nh * self.nope, self.nh * self.vd), 0)
            wk, wv = wk.view(self.nh, self.nope, -1), wv.view(self.nh, self.vd, -1)
        else:
            wk, wv = kvb.view(self.nh, self.nope + self.vd, -1).split((self.nope, self.vd), 1)
        self.w_uk, self.w_uv = _P(wk), _P(wv)
        self.w_o = _P(sd[p + "o_proj.weight"].float().t())
        self.scale = (self.vd if b == "g5_scale_v_head_dim" else self.nope + self.rope) ** -0.5
        self.indexer = Indexer(sd, p + "indexer.", tc) if with_indexer else None

    def forward(self, x, keep, prev_sel):
        b = _bug()
        B, S, _ = x.shape
        qa, ca = (x @ self.w_dq_dkv).split((self.ql, self.kl), -1)
        q_resid = _rms(qa, self.g_qa, self.eps)
        c = _rms(ca, self.g_kva, self.eps)  # (B, S, kl)
        q = (q_resid @ self.w_qb).view(B, S, self.nh, self.nope).transpose(1, 2)
        if self.indexer is not None:
            sel = self.indexer(x, q_resid, keep)
        else:
            sel = prev_sel
        if b == "g5_indexer_shared_ignored" and self.indexer is None:
            i = torch.arange(S)
            sel = (i[None, :] <= i[:, None])[None] & keep[:, None, :] & keep[:, :, None]
        # a query need not see itself (its own full pool may lose the top-k); only rows with nothing selected
        # (padded queries) keep their own slot so that no softmax row is empty
        allowed = (sel | (torch.eye(S, dtype=torch.bool)[None] & ~sel.any(-1, keepdim=True)))[:, None]
        if b == "mla_absorbed":
            ql = torch.einsum("bhsd,hdl->bhsl", q, self.w_uk)
            s = torch.einsum("bhsl,btl->bhst", ql, c) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx_l = torch.einsum("bhst,btl->bhsl", torch.softmax(s, -1), c)
            ctx = torch.einsum("bhsl,hvl->bhsv", ctx_l, self.w_uv)
        else:
            k = torch.einsum("btl,hdl->bhtd", c, self.w_uk)
            v = torch.einsum("btl,hvl->bhtv", c, self.w_uv)
            if b == "sdpa_attention":
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
            else:
                s = (q @ k.transpose(-1, -2)) * self.scale
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
                ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.w_o
        _rec(self.pre.rstrip("."), out)
        return out, sel


class DenseMLP(nn.Module):
    def __init__(self, sd, p, tc):
        super().__init__()
        self.pre = p
        self.limit = tc.swiglu_limit
        w_gu, w_dn = _gu_cols(sd, p)
        self.w_gu, self.w_dn = _P(w_gu), _P(w_dn)

    def forward(self, x):
        out = _swiglu(x, self.w_gu, self.w_dn, self.limit)
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, tc):
        super().__init__()
        self.pre = p
        self.limit = tc.swiglu_limit
        self.E, self.k = tc.n_routed_experts, tc.num_experts_per_tok
        self.ng, self.tg = tc.n_group, tc.topk_group
        self.renorm = tc.norm_topk_prob
        self.rsf = float(tc.routed_scaling_factor)
        self.w_r = _P(sd[p + "gate.weight"].float().t())
        self.e_bias = _P(sd[p + "gate.e_score_correction_bias"])
        wg, wu = sd[p + "experts.gate_up_proj"].float().chunk(2, 1)
        self.w_gu = _P(torch.cat((wu, wg), 1).transpose(1, 2))
        self.w_dn = _P(sd[p + "experts.down_proj"].float().transpose(1, 2))
        s_gu, s_dn = _gu_cols(sd, p + "shared_experts.")
        self.s_gu, self.s_dn = _P(s_gu), _P(s_dn)

    def forward(self, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        scores = torch.sigmoid(t @ self.w_r)
        choice = scores + self.e_bias
        per = choice.view(-1, self.ng, self.E // self.ng)
        gs = per.topk(2, -1).values.sum(-1)
        keep_g = torch.zeros_like(gs).scatter(1, gs.topk(self.tg, -1).indices, 1.0).bool()
        keep_e = keep_g[:, :, None].expand_as(per).reshape(-1, self.E)
        idx = choice.masked_fill(~keep_e, float("-inf")).topk(self.k, -1).indices
        w = scores.gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.rsf
        if _bug() == "moe_dense_all_experts":
            dense = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)
            up, gate = torch.einsum("th,ehi->eti", t, self.w_gu).chunk(2, -1)
            if _bug() != "g5_swiglu_no_clamp":
                gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            y = torch.einsum("eti,eih->eth", F.silu(gate) * up, self.w_dn)
            routed = torch.einsum("te,eth->th", dense, y)
        else:
            routed = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel() == 0:
                    continue
                routed.index_add_(0, tok, _swiglu(t[tok], self.w_gu[e], self.w_dn[e], self.limit) * w[tok, slot, None])
        out = (routed + _swiglu(t, self.s_gu, self.s_dn, self.limit)).view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, tc, pre, i):
        super().__init__()
        p = f"{pre}layers.{i}."
        self.pre = p
        self.eps = tc.rms_norm_eps
        self.kind = tc.layer_types[i]
        self.hc_a = HyperConn(sd, p + "attn_hc.", tc)
        self.hc_f = HyperConn(sd, p + "ffn_hc.", tc)
        self.g1 = _P(sd[p + "input_layernorm.weight"])
        self.g2 = _P(sd[p + "post_attention_layernorm.weight"])
        if self.kind == "linear_attention":
            self.mixer = KDA(sd, p + "self_attn.", tc)
        elif self.kind == "indexed_attention":
            self.mixer = MLA(sd, p + "self_attn.", tc, tc.indexer_types[i] != "shared")
        else:
            raise NotImplementedError(self.kind)
        self.ffn = MoE(sd, p + "mlp.", tc) if tc.mlp_layer_types[i] == "sparse" else DenseMLP(sd, p + "mlp.", tc)

    def forward(self, streams, keep, sel):
        x, post, comb = self.hc_a(streams)
        x = _rms(x, self.g1, self.eps)
        if self.kind == "linear_attention":
            y = self.mixer(x, keep)
        else:
            y, sel = self.mixer(x, keep, sel)
        streams = HyperConn.merge(y, streams, post, comb)
        x, post, comb = self.hc_f(streams)
        streams = HyperConn.merge(self.ffn(_rms(x, self.g2, self.eps)), streams, post, comb)
        _rec(self.pre.rstrip("."), streams)
        return streams, sel


class Glm5NextTextPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        tc = getattr(cfg, "text_config", None) or cfg
        self.tc = tc
        pre = "model.language_model." if "model.language_model.embed_tokens.weight" in sd else "model."
        self.pre = pre
        self.tok = _P(sd[pre + "embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or getattr(cfg, "tie_word_embeddings", False):
            head = sd[pre + "embed_tokens.weight"]
        self.out = _P(head)
        self.g_out = _P(sd[pre + "norm.weight"])
        self.blocks = nn.ModuleList(Block(sd, tc, pre, i) for i in range(tc.num_hidden_layers))

    def _core(self, input_ids, keep):
        h = self.tok[input_ids]
        _rec(self.pre + "embed_tokens", h)
        streams = h[:, :, None, :].expand(-1, -1, self.tc.hc_mult, -1)
        sel = None
        for blk in self.blocks:
            streams, sel = blk(streams, keep, sel)
        h = _rms(streams.mean(2), self.g_out, self.tc.rms_norm_eps)
        _rec(self.pre + "norm", h)
        logits = F.linear(h, self.out)
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.tc.vocab_size, dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool))[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep).float()


def build(state_dict, config):
    return Glm5NextTextPort(state_dict, config).eval()
