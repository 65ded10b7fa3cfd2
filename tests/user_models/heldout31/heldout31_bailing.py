"""Hand-written plain-PyTorch port of Bailing hybrid (BailingHybridForCausalLM, Ling 3.0: KDA + MLA + sigmoid MoE).

Architecture as this port implements it:
- token embedding, no scaling; untied lm_head; final RMSNorm (gain * x / rms, eps = config.rms_norm_eps).
- decoder layer, pre-norm: h = h + Mixer(RMSNorm(h)); h = h + FFN(RMSNorm(h)). The mixer is chosen by
  config.layer_types ("linear_attention": KDA, "full_attention": MLA), the FFN by config.mlp_layer_types
  ("dense": SwiGLU of intermediate_size, "sparse": MoE).
- KDA (Kimi delta attention), heads nh = config.linear_num_heads, head dim d = config.linear_head_dim, D = nh * d:
  * padding tokens of the layer input are zeroed first (attention_mask multiplies the hidden states);
  * q, k, v = x W_q, x W_k, x W_v (each D wide), then one causal depthwise short conv over the concatenated
    [q | k | v] channels (kernel config.short_conv_kernel_size, no bias: y_t = sum_j w_j x_{t-K+1+j}), then SiLU;
  * q, k l2-normalised per head (x / sqrt(sum x^2 + 1e-6)), q scaled by d^-0.5;
  * per-channel log decay (safe gate): g = lower_bound * sigmoid(exp(A_log)[head] * (x W_f + dt_bias)),
    lower_bound = config.kda_lower_bound; beta = sigmoid(x W_b) per head;
  * delta rule per head, state S (d_k, d_v), all in float32:
    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t;
  * gated RMSNorm per head: rms(o) * w_onorm * sigmoid(x W_g) (eps = rms_norm_eps), then W_o.
- MLA (DeepSeek-style latent attention) with a head-wise output gate:
  * q = RMSNorm_1e-6(x W_qa) W_qb -> per head [q_nope (qk_nope) | q_rope (qk_rope)] (q = x W_q when
    q_lora_rank is None; default RoPE only, no YaRN mscale);
  * x W_kva -> [c (kv_lora_rank) | k_rope (qk_rope, one for all heads)]; c = RMSNorm_1e-6(c);
    per head k_nope = c W_kn, v = c W_v;
  * RoPE on the rope parts only, the checkpoint's interleaved pairs (x_2i, x_2i+1) with angle pos * theta^(-2i/r);
    this port permutes those weight columns at load to [evens | odds] and applies rotate-half RoPE;
  * scores = (q_nope.k_nope + q_rope.k_rope) * (qk_nope + qk_rope)^-0.5, causal + padding mask (finfo.min);
  * softmax, times v; each head's output times sigmoid(x W_gate)[head]; then W_o.
- MoE: router s = sigmoid(x W_r) (float32); selection on s + e_score_correction_bias: n_group groups scored by the
  sum of their two best biased scores, the topk_group best groups kept, top num_experts_per_tok experts among
  them; weights = unbiased s of the chosen experts / (their sum + 1e-20) (norm_topk_prob) * routed_scaling_factor;
  experts are SwiGLU (moe_intermediate_size); plus a shared SwiGLU expert of moe_intermediate_size *
  n_shared_experts, added unweighted.
Weight layout of this port (own names, x @ W):
- tok (V, H); head_t (H, V) = lm_head transposed; fin (H,).
- every layer `layers[i]`: n1 / n2 norm gains (H,).
- KDA layer: w_in (H, 5D + nh) = [q | k | v | f | g | b] fused + transposed; conv (K, 3D) taps first;
  decay (nh,) = exp(A_log); dtb (nh, d) = dt_bias; on (d,) o_norm gain; w_o (D, H).
- MLA layer: w_dn (H, q_lora + kv_lora + r + nh) = [q_a | kv_a (c | k_rope) | gate] fused + transposed, k_rope
  columns de-interleaved; qa_n (q_lora,), kv_n (kv_lora,); w_qb (q_lora, nh, qk_nope + r) with the rope columns
  de-interleaved (q_lora_rank None: no q_a / qa_n, w_qb (H, nh, qk_nope + r) is q_proj); w_kn (kv_lora, nh,
  qk_nope), w_v (kv_lora, nh, v_dim) split from kv_b_proj per head; w_o (nh v_dim, H).
- dense FFN: w_gu (H, 2I) = [gate | up] fused + transposed, w_d (I, H).
- MoE FFN: w_r (H, E); bias (E,); e_gu (E, H, 2I) [gate | up]; e_d (E, I, H); shared s_gu (H, 2Is), s_d (Is, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "kda_softplus_gate",  # Kimi-Linear decay law g = -exp(A_log) * softplus(f + dt_bias) used instead of the safe gate
    "kda_lower_bound_default",  # safe gate bound hard-coded to -5.0 (the released checkpoints') instead of kda_lower_bound
    "kda_conv_taps_reversed",  # short-conv kernel taps applied in reverse time order (w_0 on the newest token)
    "kda_decay_after_write",  # state decayed after the delta-rule write instead of before the read and the write
    "kda_beta_value_only",  # delta computed as beta * v - S^T k: beta scales only the value, not the correction
    "kda_dt_bias_transposed",  # dt_bias (nh * d,) reshaped as (d, nh) and transposed at load instead of (nh, d)
    "kda_onorm_silu_gate",  # gated output RMSNorm uses SiLU on the gate (Qwen3-Next style) instead of sigmoid
    "kda_pad_not_zeroed",  # padding tokens of the KDA input not zeroed: they leak through the conv and the state
    "mla_rope_interleave_kept",  # rope weight columns left interleaved while rotate-half RoPE is applied
    "mla_kv_b_split_blockwise",  # kv_b_proj split as [all heads' k_nope | all heads' v] instead of per head
    "mla_gate_heads_tiled",  # head gate broadcast over the flattened output tiled (h % nh) instead of per head
    "mla_rope_dim_from_qk_head_dim",  # RoPE frequencies built over qk_head_dim (nope + rope) instead of qk_rope_head_dim
    "moe_weights_with_bias",  # expert weights gathered from the bias-corrected scores instead of the raw sigmoid
    "moe_group_score_max",  # expert group scored by its best expert instead of the sum of its best two
]
PADDING_ONLY = {"kda_pad_not_zeroed"}
CLEAN = [
    "kda_chunked",  # delta rule in chunks of 8 (triangular solve within a chunk, state carried between chunks)
    "mla_absorbed",  # W_kn absorbed into the query, attention over the latent c, W_v applied after
    "mla_complex_rope",  # no column permutation: interleaved RoPE as complex multiplication of (x_2i, x_2i+1)
    "mla_sdpa",  # MLA attention through F.scaled_dot_product_attention with a float mask
    "moe_dense",  # every expert evaluated, combined through a dense (N, E) weight matrix
]


def _rms(x, g, eps):
    x = x.float()
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _deinterleave(n):
    """Column order taking interleaved pairs (x0, x1), (x2, x3), ... to [x0, x2, ... | x1, x3, ...]."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _delta_recurrent(q, k, v, g, beta):
    """q, k (B, h, S, dk), v (B, h, S, dv), g (B, h, S, dk) log decay, beta (B, h, S) -> (B, h, S, dv)."""
    B, h, S, dk = k.shape
    st = q.new_zeros(B, h, dk, v.shape[-1])
    out = []
    for t in range(S):
        a = g[:, :, t].exp()[..., None]
        kt, bt = k[:, :, t], beta[:, :, t, None]
        if BUG != "kda_decay_after_write":
            st = st * a
        read = torch.einsum("bhkv,bhk->bhv", st, kt)
        if BUG == "kda_beta_value_only":
            u = bt * v[:, :, t] - read
        else:
            u = bt * (v[:, :, t] - read)
        st = st + kt[..., None] * u[..., None, :]
        if BUG == "kda_decay_after_write":
            st = st * a
        out.append(torch.einsum("bhkv,bhk->bhv", st, q[:, :, t]))
    return torch.stack(out, 2)


def _delta_chunked(q, k, v, g, beta, C=8):
    """The same delta rule, C tokens at a time: within a chunk with cumulative decay G, the written deltas U solve
    (I + diag(beta) A) U = diag(beta) (V - (K e^G) S0), A_sr = sum_d k_s k_r e^(G_s - G_r) for r < s."""
    B, h, S, dk = k.shape
    pad = (-S) % C
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    st = q.new_zeros(B, h, dk, v.shape[-1])
    eye = torch.eye(C)
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool).tril()
    out = []
    for c0 in range(0, S + pad, C):
        qc, kc, vc, bc = q[:, :, c0 : c0 + C], k[:, :, c0 : c0 + C], v[:, :, c0 : c0 + C], beta[:, :, c0 : c0 + C]
        G = g[:, :, c0 : c0 + C].cumsum(2)
        diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~incl[:, :, None], float("-inf")).exp()
        A = torch.einsum("bhsd,bhrd,bhsrd->bhsr", kc, kc, diff) * strict
        L = eye + bc[..., None] * A
        rhs = bc[..., None] * (vc - (kc * G.exp()) @ st)
        U = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
        P = torch.einsum("bhsd,bhrd,bhsrd->bhsr", qc, kc, diff) * incl
        out.append((qc * G.exp()) @ st + P @ U)
        last = G[:, :, -1:]
        st = last.transpose(-1, -2).exp() * st + (kc * (last - G).exp()).transpose(-1, -2) @ U
    return torch.cat(out, 2)[:, :, :S]


class BailingHybridPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.eps = cfg.rms_norm_eps
        self.types = list(cfg.layer_types)
        self.mlps = list(cfg.mlp_layer_types)
        # KDA
        self.nh, self.d = cfg.linear_num_heads, cfg.linear_head_dim
        self.K = cfg.linear_conv_kernel_dim
        self.lower = -5.0 if BUG == "kda_lower_bound_default" else cfg.kda_lower_bound
        self.safe = cfg.kda_safe_gate and BUG != "kda_softplus_gate"
        # MLA
        self.na = cfg.num_attention_heads
        self.nope, self.r, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qr, self.kvr = cfg.q_lora_rank, cfg.kv_lora_rank
        rd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if BUG == "mla_rope_dim_from_qk_head_dim" else self.r
        theta = cfg.rope_parameters["rope_theta"]
        self.register_buffer("inv", (1.0 / theta ** (torch.arange(0, rd, 2).float() / rd))[: self.r // 2])
        permute = BUG not in ("mla_rope_interleave_kept", "mla_complex_rope")
        # MoE
        self.E, self.topk = cfg.num_local_experts, cfg.num_experts_per_tok
        self.ng, self.tg = cfg.n_group, cfg.topk_group
        self.renorm, self.rscale = cfg.norm_topk_prob, cfg.routed_scaling_factor

        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("model.norm.weight"))
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            L = nn.Module()
            L.n1 = nn.Parameter(g(p + "input_layernorm.weight"))
            L.n2 = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            if self.types[i] == "linear_attention":
                ws = [g(a + f"{n}_proj.weight") for n in "qkv"]
                ws += [g(a + "forget_gate.f_proj.weight"), g(a + "g_proj.weight"), g(a + "b_proj.weight")]
                L.w_in = nn.Parameter(torch.cat(ws, 0).t().contiguous())
                L.conv = nn.Parameter(g(a + "conv1d.weight")[:, 0].t().contiguous())
                L.decay = nn.Parameter(g(a + "forget_gate.A_log").exp())
                dtb = g(a + "forget_gate.dt_bias")
                if BUG == "kda_dt_bias_transposed":
                    dtb = dtb.view(self.d, self.nh).t()
                L.dtb = nn.Parameter(dtb.reshape(self.nh, self.d).contiguous())
                L.on = nn.Parameter(g(a + "o_norm.weight"))
                L.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            else:
                kva = g(a + "kv_a_proj_with_mqa.weight")  # (kvr + r, H)
                lora = self.qr is not None
                qb = g(a + ("q_b_proj.weight" if lora else "q_proj.weight")).view(self.na, self.nope + self.r, -1)
                if permute:
                    order = _deinterleave(self.r)
                    kva = torch.cat([kva[: self.kvr], kva[self.kvr :][order]], 0)
                    qb = torch.cat([qb[:, : self.nope], qb[:, self.nope :][:, order]], 1)
                down = [g(a + "q_a_proj.weight")] if lora else []
                L.w_dn = nn.Parameter(torch.cat([*down, kva, g(a + "g_proj.weight")], 0).t())
                if lora:
                    L.qa_n = nn.Parameter(g(a + "q_a_layernorm.weight"))
                L.kv_n = nn.Parameter(g(a + "kv_a_layernorm.weight"))
                L.w_qb = nn.Parameter(qb.permute(2, 0, 1).contiguous())
                kvb = g(a + "kv_b_proj.weight")  # (na * (nope + vd), kvr)
                if BUG == "mla_kv_b_split_blockwise":
                    kn, vv = kvb.split([self.na * self.nope, self.na * self.vd], 0)
                    kn, vv = kn.view(self.na, self.nope, -1), vv.view(self.na, self.vd, -1)
                else:
                    kn, vv = kvb.view(self.na, self.nope + self.vd, -1).split([self.nope, self.vd], 1)
                L.w_kn = nn.Parameter(kn.permute(2, 0, 1).contiguous())
                L.w_v = nn.Parameter(vv.permute(2, 0, 1).contiguous())
                L.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            if self.mlps[i] == "dense":
                L.w_gu = nn.Parameter(torch.cat([g(m + "gate_proj.weight"), g(m + "up_proj.weight")], 0).t())
                L.w_d = nn.Parameter(g(m + "down_proj.weight").t().contiguous())
            else:
                L.w_r = nn.Parameter(g(m + "gate.weight").t().contiguous())
                L.bias = nn.Parameter(g(m + "gate.e_score_correction_bias"))
                L.e_gu = nn.Parameter(g(m + "experts.gate_up_proj").transpose(1, 2).contiguous())
                L.e_d = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous())
                sh = m + "shared_experts."
                L.s_gu = nn.Parameter(torch.cat([g(sh + "gate_proj.weight"), g(sh + "up_proj.weight")], 0).t())
                L.s_d = nn.Parameter(g(sh + "down_proj.weight").t().contiguous())
            self.layers.append(L)

    # ---- KDA ----
    def _kda(self, L, x, mask):
        B, S, _ = x.shape
        nh, d, K, D = self.nh, self.d, self.K, self.nh * self.d
        if mask is not None and BUG != "kda_pad_not_zeroed":
            x = x * mask[:, :, None]
        qkv, f, gate, b = (x @ L.w_in).split([3 * D, D, D, nh], -1)
        taps = L.conv.flip(0) if BUG == "kda_conv_taps_reversed" else L.conv
        xp = F.pad(qkv, (0, 0, K - 1, 0))
        qkv = F.silu(sum(taps[j] * xp[:, j : j + S] for j in range(K)))
        q, k, v = (t.view(B, S, nh, d).transpose(1, 2) for t in qkv.split(D, -1))
        q, k = _l2(q) * d**-0.5, _l2(k)
        z = f.view(B, S, nh, d) + L.dtb
        if self.safe:
            lg = self.lower * torch.sigmoid(L.decay[:, None] * z)
        else:
            lg = -L.decay[:, None] * F.softplus(z)
        lg = lg.transpose(1, 2)
        beta = torch.sigmoid(b).transpose(1, 2)
        if BUG == "kda_chunked":
            o = _delta_chunked(q, k, v, lg, beta)
        else:
            o = _delta_recurrent(q, k, v, lg, beta)
        o = o.transpose(1, 2)  # (B, S, nh, d)
        act = F.silu if BUG == "kda_onorm_silu_gate" else torch.sigmoid
        o = _rms(o, L.on, self.eps) * act(gate.view(B, S, nh, d))
        return o.reshape(B, S, D) @ L.w_o

    # ---- MLA ----
    def _rope(self, x, ang):  # x (B, S, n, r); ang (B, S, r/2)
        c, s = ang.cos()[:, :, None], ang.sin()[:, :, None]
        if BUG == "mla_complex_rope":
            z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * torch.polar(
                torch.ones_like(c), ang[:, :, None]
            )
            return torch.view_as_real(z).flatten(-2)
        h = self.r // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    def _mla(self, L, x, ang, allowed):
        B, S, _ = x.shape
        na, nope, r, vd = self.na, self.nope, self.r, self.vd
        if self.qr is None:  # direct query projection
            c, kr, gl = (x @ L.w_dn).split([self.kvr, r, na], -1)
            ql = x
        else:
            ql, c, kr, gl = (x @ L.w_dn).split([self.qr, self.kvr, r, na], -1)
            ql = _rms(ql, L.qa_n, 1e-6)
        q = torch.einsum("bsl,lnd->bsnd", ql, L.w_qb)
        qn, qr = q.split([nope, r], -1)
        c = _rms(c, L.kv_n, 1e-6)
        qr, kr = self._rope(qr, ang), self._rope(kr[:, :, None], ang)
        scale = (nope + r) ** -0.5
        low = torch.finfo(torch.float32).min
        bias = torch.zeros(B, 1, S, S).masked_fill(~allowed[:, None], low)
        if BUG == "mla_absorbed":
            qc = torch.einsum("bsnd,lnd->bnsl", qn, L.w_kn)
            sc = qc @ c[:, None].transpose(-1, -2) + qr.transpose(1, 2) @ kr.transpose(1, 2).transpose(-1, -2)
            lat = (sc * scale + bias).softmax(-1) @ c[:, None]  # (B, na, S, kvr)
            o = torch.einsum("bnsl,lnv->bsnv", lat, L.w_v)
        else:
            kn = torch.einsum("bsl,lnd->bnsd", c, L.w_kn)
            v = torch.einsum("bsl,lnv->bnsv", c, L.w_v)
            qf = torch.cat([qn, qr], -1).transpose(1, 2)
            kf = torch.cat([kn, kr.transpose(1, 2).expand(B, na, S, r)], -1)
            if BUG == "mla_sdpa":
                o = F.scaled_dot_product_attention(qf, kf, v, attn_mask=bias, scale=scale)
            else:
                o = ((qf @ kf.transpose(-1, -2)) * scale + bias).softmax(-1) @ v
            o = o.transpose(1, 2)  # (B, S, na, vd)
        gate = torch.sigmoid(gl)
        o = o.reshape(B, S, na * vd)
        if BUG == "mla_gate_heads_tiled":
            o = o * gate.repeat(1, 1, vd)
        else:
            o = o * gate.repeat_interleave(vd, -1)
        return o @ L.w_o

    # ---- FFN ----
    @staticmethod
    def _swiglu(x, w_gu, w_d):
        gt, up = (x @ w_gu).chunk(2, -1)
        return (F.silu(gt) * up) @ w_d

    def _moe(self, L, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        N = t.shape[0]
        s = torch.sigmoid(t.float() @ L.w_r)
        choice = s + L.bias
        grp = choice.view(N, self.ng, -1)
        if BUG == "moe_group_score_max":
            gs = grp.max(-1).values
        else:
            gs = grp.topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter(1, gs.topk(self.tg, -1).indices, 1.0).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(self.E // self.ng, 1), float("-inf"))
        idx = choice.topk(self.topk, -1).indices
        w = (choice if BUG == "moe_weights_with_bias" else s).gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.rscale
        if BUG == "moe_dense":
            dense = torch.zeros(N, self.E).scatter(1, idx, w)
            gt, up = torch.einsum("nh,ehi->nei", t, L.e_gu).chunk(2, -1)
            y = torch.einsum("nei,eih->neh", F.silu(gt) * up, L.e_d)
            routed = (y * dense[..., None]).sum(1)
        else:
            gt, up = torch.einsum("nh,nkhi->nki", t, L.e_gu[idx]).chunk(2, -1)
            y = torch.einsum("nki,nkih->nkh", F.silu(gt) * up, L.e_d[idx])
            routed = (y * w[..., None]).sum(1)
        return (routed + self._swiglu(t, L.s_gu, L.s_d)).view(B, S, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        keymask = torch.ones(B, S) if attention_mask is None else attention_mask.float()
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & keymask.bool()[:, None, :]
        ang = position_ids[..., None].float() * self.inv
        h = self.tok[input_ids]
        for i, L in enumerate(self.layers):
            x = _rms(h, L.n1, self.eps)
            if self.types[i] == "linear_attention":
                h = h + self._kda(L, x, None if attention_mask is None else keymask)
            else:
                h = h + self._mla(L, x, ang, allowed)
            x = _rms(h, L.n2, self.eps)
            h = h + (self._swiglu(x, L.w_gu, L.w_d) if self.mlps[i] == "dense" else self._moe(L, x))
        return (_rms(h, self.fin, self.eps) @ self.head_t).float()


def build(state_dict, config):
    return BailingHybridPort(state_dict, config).eval()
