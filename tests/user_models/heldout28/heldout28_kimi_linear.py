"""Hand-written plain-PyTorch port of Kimi Linear (KimiLinearForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
- token embedding, untied lm_head, final RMSNorm; pre-norm layers x + Mix(RMSNorm(x)); x + FFN(RMSNorm(x)).
- * two mixer kinds from config.layer_types:
  * "linear_attention" = Kimi Delta Attention (KDA): padding positions of the layer input zeroed;
    q, k, v = separate bias-free projections (linear_num_heads x linear_head_dim), a depthwise causal
    conv1d (kernel linear_conv_kernel_dim, no bias) over the concatenated [q|k|v] channels, then SiLU;
    q, k L2-normalised per head (x / sqrt(sum x^2 + 1e-6)), q scaled by 1/sqrt(head_dim);
    * per-CHANNEL forget gate g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias) (log-decay);
    beta = sigmoid(b_proj(x)) per head; gated delta rule, state S (dk x dv) per head:
      S <- diag(exp(g_t)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
    output: * per-head RMSNorm (eps rms_norm_eps) times sigmoid(g_b(g_a(x))) gate, then o_proj.
  * "full_attention" = MLA with * NO rotary embedding at all (the "rope" slice of the key is
    shared across heads but never rotated): q = q_b(RMSNorm(q_a(x))), latent = kv_a(x) split into
    [c (kv_lora_rank) | k_r (qk_rope_head_dim)], c normed, kv_b(c) -> per head [k_nope | v];
    k = [k_nope | k_r]; softmax scale 1/sqrt(qk_nope + qk_rope); causal + key-padding mask.
- FFN from config.mlp_layer_types: "dense" SwiGLU; "sparse" MoE: * sigmoid router (fp32) + correction bias
  for the choice, * group-limited choice (n_group groups scored by the sum of their top-2 biased scores,
  topk_group groups kept), weights = unbiased sigmoid scores, renormalised (norm_topk_prob, +1e-20),
  * times routed_scaling_factor; plus a shared SwiGLU expert.
Weight layout of this port (own names):
- tok (V, H); out_w (H, V) transposed lm_head; out_ln (H,).
- per layer `layers[i]`: n1, n2 gains.
  KDA `mix`: wqkv (H, 3 D) fused+transposed; conv (3 D, K) squeezed; fa (H, hd), fb (hd, D) transposed;
  dtb (D,); neg_rate (nh,) = exp(A_log) precomputed; wb (H, nh); ga (H, hd), gb (hd, D); onorm (hd,); wo (D, H).
  MLA `mix`: wqa (H, qr), qln (qr,), wqb (qr, nh, qk) ; wkva (H, kvr + r), kvln (kvr,);
  wuk (nh, kvr, nope) and wuv (nh, kvr, vd) (kv_b split per head); wo (nh*vd, H).
  dense: wg, wu (H, I), wd (I, H). sparse: gate_w (H, E), bias (E,), e_gu (E, H, 2Im) fused transposed,
  e_d (E, Im, H); sg, su (H, Is), sd (Is, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "kimi_mla_rope",  # DeepSeek habit: RoPE applied to the MLA rope slice (Kimi's MLA has no RoPE)
    "kimi_scale_nope_only",  # MLA softmax scale 1/sqrt(qk_nope_head_dim) instead of 1/sqrt(nope + rope)
    "kimi_kv_b_swapped",  # kv_b per-head rows read as [v | k_nope] instead of [k_nope | v]
    "kimi_no_qk_l2norm",  # KDA q/k not L2-normalised
    "kimi_A_log_not_exp",  # forget gate uses -A_log instead of -exp(A_log)
    "kimi_beta_v_only",  # delta rule: beta on v only (u = beta v - S^T k)
    "kimi_conv_no_silu",  # short conv output not passed through SiLU
    "kimi_onorm_silu_gate",  # output gate through SiLU instead of sigmoid
    "kimi_q_unscaled",  # KDA q not scaled by 1/sqrt(head_dim)
    "kimi_decay_after_update",  # state decayed after the delta update instead of before
    "kimi_group_max",  # expert-group score = max instead of sum of top-2
    "kimi_bias_in_weights",  # correction bias kept in the expert weights
    "kimi_pad_not_zeroed",  # KDA input not zeroed at padding positions (pads leak into conv/state)
]
PADDING_ONLY = {"kimi_pad_not_zeroed"}
CLEAN = [
    "kimi_absorbed_mla",  # MLA with kv_b absorbed: scores and values computed against the latent
    "kimi_sdpa",  # MLA attention via F.scaled_dot_product_attention
    "kimi_conv_unfold",  # causal depthwise conv as an explicit sum of shifted inputs
    "kimi_dense_moe",  # all experts on all tokens, scattered (T, E) weights
    "kimi_parallel_kda",  # KDA as one parallel block: triangular solve for the delta-rule values
]


def _bug():
    return BUG


def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class _KDA(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        g = lambda k: sd[p + k].detach().clone().float()
        self.nh, self.hd, self.eps = cfg.linear_num_heads, cfg.linear_head_dim, cfg.rms_norm_eps
        self.wqkv = nn.Parameter(torch.cat([g(f"{n}_proj.weight") for n in "qkv"], 0).t().contiguous())
        self.conv = nn.Parameter(g("conv1d.weight").squeeze(1))
        self.fa = nn.Parameter(g("forget_gate.f_a_proj.weight").t().contiguous())
        self.fb = nn.Parameter(g("forget_gate.f_b_proj.weight").t().contiguous())
        self.dtb = nn.Parameter(g("forget_gate.dt_bias"))
        a_log = g("forget_gate.A_log").reshape(-1)
        self.neg_rate = nn.Parameter(a_log.exp())
        self.register_buffer("a_log_raw", a_log)  # kept for the record (bug path)
        self.wb = nn.Parameter(g("b_proj.weight").t().contiguous())
        self.ga = nn.Parameter(g("g_a_proj.weight").t().contiguous())
        self.gb = nn.Parameter(g("g_b_proj.weight").t().contiguous())
        self.onorm = nn.Parameter(g("o_norm.weight"))
        self.wo = nn.Parameter(g("o_proj.weight").t().contiguous())

    def forward(self, x, mask2d):
        bug = _bug()
        B, S, _ = x.shape
        nh, hd = self.nh, self.hd
        if mask2d is not None and bug != "kimi_pad_not_zeroed":
            x = x * mask2d[:, :, None].to(x.dtype)
        qkv = x @ self.wqkv  # (B, S, 3D)
        K = self.conv.shape[1]
        if bug == "kimi_conv_unfold":
            xp = F.pad(qkv, (0, 0, K - 1, 0))
            y = sum(xp[:, j : j + S] * self.conv[:, j] for j in range(K))
        else:
            y = F.conv1d(qkv.transpose(1, 2), self.conv[:, None], padding=K - 1, groups=qkv.shape[-1])[..., :S]
            y = y.transpose(1, 2)
        if bug != "kimi_conv_no_silu":
            y = F.silu(y)
        q, k, v = [t.reshape(B, S, nh, hd) for t in y.chunk(3, -1)]
        if bug != "kimi_no_qk_l2norm":
            q, k = _l2(q), _l2(k)
        if bug != "kimi_q_unscaled":
            q = q / math.sqrt(hd)
        f = (x @ self.fa @ self.fb + self.dtb).view(B, S, nh, hd)
        rate = -self.a_log_raw if bug == "kimi_A_log_not_exp" else self.neg_rate
        lg = -rate[:, None] * F.softplus(f)  # log decay per channel (B, S, nh, hd)
        beta = torch.sigmoid(x @ self.wb)  # (B, S, nh)
        if bug == "kimi_parallel_kda":
            o = self._parallel(q, k, v, lg, beta)
        else:
            o = self._recurrent(q, k, v, lg, beta)
        gate = (x @ self.ga @ self.gb).view(B, S, nh, hd)
        act = F.silu(gate) if bug == "kimi_onorm_silu_gate" else torch.sigmoid(gate)
        o = _rms(o, self.onorm, self.eps) * act
        return o.reshape(B, S, nh * hd) @ self.wo

    @staticmethod
    def _recurrent(q, k, v, lg, beta):
        bug = _bug()
        B, S, nh, hd = q.shape
        st = torch.zeros(B, nh, hd, v.shape[-1])
        outs = []
        for t in range(S):
            kt, vt, bt, dec = k[:, t], v[:, t], beta[:, t, :, None], lg[:, t].exp()[..., None]
            if bug == "kimi_decay_after_update":
                u = bt * (vt - (st * kt[..., None]).sum(-2))
                st = (st + kt[..., None] * u[:, :, None, :]) * dec
            else:
                st = st * dec
                mem = (st * kt[..., None]).sum(-2)
                u = bt * vt - mem if bug == "kimi_beta_v_only" else bt * (vt - mem)
                st = st + kt[..., None] * u[:, :, None, :]
            outs.append((st * q[:, t][..., None]).sum(-2))
        return torch.stack(outs, 1)

    @staticmethod
    def _parallel(q, k, v, lg, beta):
        # u = (I + diag(beta) L)^-1 (beta v), L[i, j] = (k_i * exp(G_i - G_j)) . k_j for j < i
        q, k, v, lg, beta = [t.transpose(1, 2) for t in (q, k, v, lg, beta)]  # (B, nh, S, ...)
        S = q.shape[2]
        G = lg.cumsum(2)
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # (B, nh, i, j, hd)
        low = torch.ones(S, S, dtype=torch.bool).tril()
        strict = torch.ones(S, S, dtype=torch.bool).tril(-1)
        dec_incl = diff.masked_fill(~low[..., None], float("-inf")).exp()
        L = torch.einsum("bhic,bhijc,bhjc->bhij", k, dec_incl, k) * strict
        Amat = torch.eye(S) + beta[..., None] * L
        u = torch.linalg.solve_triangular(Amat, beta[..., None] * v, upper=False)
        P = torch.einsum("bhic,bhijc,bhjc->bhij", q, dec_incl, k)
        return (P @ u).transpose(1, 2)


class _MLA(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        g = lambda k: sd[p + k].detach().clone().float()
        self.nh = cfg.num_attention_heads
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kvr = cfg.kv_lora_rank
        self.eps = 1e-6  # q_a_layernorm / kv_a_layernorm are built with the RMSNorm default eps
        qk = self.nope + self.rope
        self.wqa = nn.Parameter(g("q_a_proj.weight").t().contiguous())
        self.qln = nn.Parameter(g("q_a_layernorm.weight"))
        self.wqb = nn.Parameter(g("q_b_proj.weight").t().reshape(-1, self.nh, qk).contiguous())
        self.wkva = nn.Parameter(g("kv_a_proj_with_mqa.weight").t().contiguous())
        self.kvln = nn.Parameter(g("kv_a_layernorm.weight"))
        kvb = g("kv_b_proj.weight").view(self.nh, self.nope + self.vd, self.kvr)
        if _bug() == "kimi_kv_b_swapped":
            kvb = torch.cat([kvb[:, self.vd :], kvb[:, : self.vd]], 1)
        self.wuk = nn.Parameter(kvb[:, : self.nope].transpose(1, 2).contiguous())  # (nh, kvr, nope)
        self.wuv = nn.Parameter(kvb[:, self.nope :].transpose(1, 2).contiguous())  # (nh, kvr, vd)
        self.wo = nn.Parameter(g("o_proj.weight").t().contiguous())

    def forward(self, x, keep, pos):
        bug = _bug()
        B, S, _ = x.shape
        q = torch.einsum("bsr,rhd->bhsd", _rms(x @ self.wqa, self.qln, self.eps), self.wqb)
        q_n, q_r = q.split([self.nope, self.rope], -1)
        lat = x @ self.wkva
        c, k_r = lat.split([self.kvr, self.rope], -1)
        c = _rms(c, self.kvln, self.eps)
        k_r = k_r[:, None]  # (B, 1, S, r) shared by all heads
        if bug == "kimi_mla_rope":
            inv = 1.0 / (10000.0 ** (torch.arange(0, self.rope, 2).float() / self.rope))
            fr = pos[..., None].float() * inv
            emb = torch.cat((fr, fr), -1)[:, None]
            rot = lambda t: (
                t * emb.cos() + torch.cat((-t[..., self.rope // 2 :], t[..., : self.rope // 2]), -1) * emb.sin()
            )
            q_r, k_r = rot(q_r), rot(k_r)
        scale = (self.nope if bug == "kimi_scale_nope_only" else self.nope + self.rope) ** -0.5
        if bug == "kimi_absorbed_mla":
            q_lat = torch.einsum("bhsd,hrd->bhsr", q_n, self.wuk)
            sc = (q_lat @ c[:, None].transpose(-1, -2) + q_r @ k_r.transpose(-1, -2)) * scale
            sc = sc.masked_fill(~keep[:, None], torch.finfo(sc.dtype).min)
            o_lat = sc.softmax(-1) @ c[:, None]  # (B, nh, S, kvr)
            o = torch.einsum("bhsr,hrv->bhsv", o_lat, self.wuv)
        else:
            k_n = torch.einsum("bsr,hrd->bhsd", c, self.wuk)
            v = torch.einsum("bsr,hrv->bhsv", c, self.wuv)
            k = torch.cat([k_n, k_r.expand(-1, self.nh, -1, -1)], -1)
            qq = torch.cat([q_n, q_r], -1)
            if bug == "kimi_sdpa":
                o = F.scaled_dot_product_attention(qq, k, v, attn_mask=keep[:, None], scale=scale)
            else:
                sc = (qq @ k.transpose(-1, -2)) * scale
                sc = sc.masked_fill(~keep[:, None], torch.finfo(sc.dtype).min)
                o = sc.softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, S, -1) @ self.wo


class KimiLinearPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        g = lambda k: sd[k].detach().clone().float()
        self.eps = cfg.rms_norm_eps
        self.kinds = list(cfg.layer_types)
        self.ffn = list(cfg.mlp_layer_types)
        self.topk, self.ng, self.tg = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.renorm, self.rscale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.out_w = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.out_ln = nn.Parameter(g("model.norm.weight"))
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            L = nn.Module()
            L.n1 = nn.Parameter(g(p + "input_layernorm.weight"))
            L.n2 = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            L.mix = (_KDA if self.kinds[i] == "linear_attention" else _MLA)(sd, p + "self_attn.", cfg)
            if self.ffn[i] == "sparse":
                L.gate_w = nn.Parameter(g(p + "mlp.gate.weight").t().contiguous())
                L.register_buffer("bias", g(p + "mlp.gate.e_score_correction_bias"))
                L.e_gu = nn.Parameter(g(p + "mlp.experts.gate_up_proj").transpose(1, 2).contiguous())
                L.e_d = nn.Parameter(g(p + "mlp.experts.down_proj").transpose(1, 2).contiguous())
                pre = p + "mlp.shared_experts."
            else:
                pre = p + "mlp."
            L.sg = nn.Parameter(g(pre + "gate_proj.weight").t().contiguous())
            L.su = nn.Parameter(g(pre + "up_proj.weight").t().contiguous())
            L.sd = nn.Parameter(g(pre + "down_proj.weight").t().contiguous())
            self.layers.append(L)

    def _moe(self, L, t):
        bug = _bug()
        T = t.shape[0]
        E = L.gate_w.shape[1]
        scores = (t.float() @ L.gate_w).sigmoid()
        ch = scores + L.bias
        grp = ch.view(T, self.ng, E // self.ng)
        gs = grp.max(-1).values if bug == "kimi_group_max" else grp.topk(2, -1).values.sum(-1)
        keep_g = torch.zeros_like(gs).scatter(1, gs.topk(self.tg, -1).indices, 1.0).bool()
        ch = ch.masked_fill(~keep_g.repeat_interleave(E // self.ng, 1), float("-inf"))
        idx = ch.topk(self.topk, -1).indices
        w = (scores + L.bias if bug == "kimi_bias_in_weights" else scores).gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.rscale
        Im = L.e_d.shape[1]
        if bug == "kimi_dense_moe":
            full = torch.zeros(T, E).scatter(1, idx, w)
            gu = torch.einsum("th,ehj->tej", t, L.e_gu)
            hmid = F.silu(gu[..., :Im]) * gu[..., Im:]
            return torch.einsum("tei,eih,te->th", hmid, L.e_d, full)
        out = torch.zeros_like(t)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                gu = t[tok] @ L.e_gu[e]
                y = (F.silu(gu[:, :Im]) * gu[:, Im:]) @ L.e_d[e]
                out.index_add_(0, tok, y * w[tok, slot, None])
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        km = torch.ones(B, S, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        keep = torch.ones(S, S, dtype=torch.bool).tril()[None] & km[:, None, :]
        mask2d = None if bool(km.all()) else km
        h = self.tok[input_ids]
        for i, L in enumerate(self.layers):
            xn = _rms(h, L.n1, self.eps)
            if self.kinds[i] == "linear_attention":
                h = h + L.mix(xn, mask2d)
            else:
                h = h + L.mix(xn, keep, position_ids)
            xn = _rms(h, L.n2, self.eps)
            flat = xn.reshape(-1, xn.shape[-1])
            y = (F.silu(flat @ L.sg) * (flat @ L.su)) @ L.sd
            if self.ffn[i] == "sparse":
                y = y + self._moe(L, flat)
            h = h + y.view_as(h)
        return (_rms(h, self.out_ln, self.eps) @ self.out_w).float()


def build(state_dict, config):
    return KimiLinearPort(state_dict, config).eval()
