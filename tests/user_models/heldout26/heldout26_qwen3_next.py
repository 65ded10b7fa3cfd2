"""Hand-written plain-PyTorch port of Qwen3-Next (Qwen3NextForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  * zero-centred RMSNorm everywhere except the gated norm: y = (1 + w) * x / sqrt(mean(x^2) + eps), computed in fp32;
    two pre-norms per block:  h = h + Mixer(RMS_in(h));  h = h + FFN(RMS_post(h));  final zero-centred norm, then head;
  * per-layer token mixer from config.layer_types: "linear_attention" (Gated DeltaNet) or "full_attention";
    here [linear, full, linear, full] (NOT the default "full every 4th layer" pattern);
  * full attention (GQA, q head h reads kv head h // groups, no biases), head_dim = config.head_dim (24 here, not 16):
      q_proj emits, PER HEAD, [query_h (hd) | gate_h (hd)];  per-head zero-centred RMSNorm on q and k (q_norm/k_norm);
      partial RoPE: only the first rot = int(head_dim * partial_rotary_factor) channels (12 here) are rotated, in the
      half-split (rotate_half) form with inv_freq = theta^(-2i/rot); the rest pass through;
      softmax(q k^T * head_dim^-0.5 + causal/padding mask) v, then the output is multiplied by sigmoid(gate) before o_proj;
  * Gated DeltaNet (linear attention), nk key heads (dk), nv value heads (dv), r = nv / nk:
      in_proj_qkvz rows are grouped PER KEY HEAD g: [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)],
      in_proj_ba rows per key head g: [b_g (r) | a_g (r)];
      padded positions are zeroed before the projections (so no padding enters conv or state);
      causal depthwise conv (kernel K, no bias) over channels [q | k | v], then SiLU;
      q, k L2-normalised per head (x / sqrt(sum x^2 + 1e-6)), q scaled by dk^-0.5;
      value head j uses key head j // r (grouped, repeat_interleave);
      beta = sigmoid(b);  decay g = -exp(A_log) * softplus(a + dt_bias) (log space, per value head);
      recurrence per value head, state S (dk, dv):  S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;
      o_t = S^T q_t  (computed here in a chunked WY form, chunk 8);
      gated RMSNorm per value head with PLAIN gain w (not 1 + w): w * rmsnorm(o) * silu(z);  then out_proj;
  * FFN: sparse MoE on layers not in config.mlp_only_layers (here layer 2 is a dense SwiGLU MLP):
      router softmax over all experts (fp32), top-k, renormalised (norm_topk_prob); experts SwiGLU;
      plus a shared SwiGLU expert scaled by sigmoid(shared_expert_gate(x));
  - padding: HF-style 0/1 attention_mask masks keys in full attention and zeroes padded inputs of the DeltaNet layers;
    positions 0..S-1 when absent.

Weight layout of this port (own names):
  tok (V, H); out (V, H) (F.linear layout); g_out (H,) holds the EFFECTIVE gain 1 + w (as do all zero-centred norms);
  blocks[i].g1 / g2 (H,) effective gains;
  full attention: attn.w_qgkv ((2 nh + 2 nkv) hd, H) F.linear layout, rows [q (all heads) | gate (all heads) | k | v];
      attn.gq / gk (hd,) effective gains; attn.w_o (nh hd, H) (in, out) layout;
  DeltaNet: lin.w_in (H, 2 nk dk + 2 nv dv + 2 nv) (in, out), columns FLAT [q | k | v | z | b | a] (head-major);
      lin.conv (K, 2 nk dk + nv dv) taps x channels; lin.A_neg (nv,) = -exp(A_log); lin.dt (nv,); lin.gn (dv,);
      lin.w_out (nv dv, H) (in, out);
  MoE: moe.w_r (H, E) (in, out); moe.w_gu (E, H, 2 I) (in, out) columns [up | gate]; moe.w_dn (E, I, H);
      moe.s_gu (H, 2 Is) [up | gate]; moe.s_dn (Is, H); moe.w_sg (H, 1);
  dense MLP: mlp.w_gu (H, 2 I) [up | gate]; mlp.w_dn (I, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "qn_norm_plain_gain",  # zero-centred RMSNorm weights loaded as the gain w instead of 1 + w
    "qn_attn_gate_blocked_split",  # q_proj rows read as [all queries | all gates] instead of per head [q_h | gate_h]
    "qn_rope_full_head_dim",  # partial_rotary_factor ignored: RoPE rotates the whole head_dim
    "qn_qkvz_flat_split",  # in_proj_qkvz / in_proj_ba taken as flat [q|k|v|z], [b|a] instead of grouped per key head
    "qn_gva_tiled_heads",  # value head j paired with key head j % nk (tiled) instead of j // (nv / nk)
    "qn_conv_not_causal",  # conv output sliced from the wrong end: token t mixes t .. t+K-1 instead of t-K+1 .. t
    "qn_conv_no_silu",  # SiLU after the short depthwise conv dropped
    "qn_decay_A_log_not_exp",  # A_log used as the decay rate directly: g = -A_log * softplus(.) not -exp(A_log) * ...
    "qn_no_qk_l2norm",  # q / k of the delta rule not L2-normalised (use_qk_l2norm_in_kernel ignored)
    "qn_gated_norm_sigmoid",  # gated RMSNorm gates with sigmoid(z) instead of silu(z)
    "qn_shared_expert_ungated",  # shared expert added without its sigmoid(shared_expert_gate) scale
    "qn_topk_no_renorm",  # norm_topk_prob ignored: top-k softmax probabilities not renormalised
    "qn_pad_state_leak",  # padded positions not zeroed before the DeltaNet layer: pads enter conv and state
]
PADDING_ONLY = {"qn_pad_state_leak"}
CLEAN = [
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of explicit softmax
    "delta_recurrent",  # token-by-token gated delta recurrence instead of the chunked WY form
    "moe_dense_all_experts",  # every expert run on every token, combined with a dense (T, E) routing-weight matrix
    "norm_gain_folded",  # block / final zero-centred gains (1 + w) folded into the following weights at load
    "varlen_unpad",  # each row's real tokens run alone with their own position_ids, logits scattered back
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


def _zc_gain(w):
    """effective gain of a zero-centred norm weight"""
    w = w.float()
    return w if _bug() == "qn_norm_plain_gain" else 1.0 + w


def _rms(x, g, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if g is None else y * g


def _l2n(x):
    if _bug() == "qn_no_qk_l2norm":
        return x
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos / sin (B, S, rot/2); rotates the first rot channels (half-split form)"""
    rot = cos.shape[-1] * 2
    cos, sin = cos[:, None], sin[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    h = rot // 2
    x1, x2 = xr[..., :h], xr[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xp), -1)


class FullAttention(nn.Module):
    def __init__(self, sd, p, cfg, g_in):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.head_dim
        self.g = self.nh // self.nkv
        self.eps = cfg.rms_norm_eps
        H = cfg.hidden_size
        wq2 = sd[p + "q_proj.weight"].float()
        if b == "qn_attn_gate_blocked_split":
            wq, wg = wq2.chunk(2, 0)
        else:
            per_head = wq2.view(self.nh, 2, self.hd, H)
            wq, wg = per_head[:, 0].reshape(-1, H), per_head[:, 1].reshape(-1, H)
        w = torch.cat((wq, wg, sd[p + "k_proj.weight"].float(), sd[p + "v_proj.weight"].float()), 0)
        if g_in is not None:
            w = w * g_in[None, :]
        self.w_qgkv = _P(w)
        self.gq = _P(_zc_gain(sd[p + "q_norm.weight"]))
        self.gk = _P(_zc_gain(sd[p + "k_norm.weight"]))
        self.w_o = _P(sd[p + "o_proj.weight"].float().t())
        self.scale = self.hd**-0.5

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q, gate, k, v = F.linear(x, self.w_qgkv).split((nq, nq, nk, nk), -1)
        q = _rms(q.view(B, S, self.nh, self.hd), self.gq, self.eps).transpose(1, 2)
        k = _rms(k.view(B, S, self.nkv, self.hd), self.gk, self.eps).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = k.repeat_interleave(self.g, 1), v.repeat_interleave(self.g, 1)
        if b == "sdpa_attention":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, -1) * torch.sigmoid(gate)
        out = ctx @ self.w_o
        _rec(self.pre.rstrip("."), out)
        return out


def _delta_recurrent(q, k, v, g, beta):
    """q, k (B, n, S, dk); v (B, n, S, dv); g, beta (B, n, S)"""
    B, n, S, dk = k.shape
    st = q.new_zeros(B, n, dk, v.shape[-1])
    outs = []
    for t in range(S):
        st = st * g[:, :, t, None, None].exp()
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bnkv,bnk->bnv", st, kt))
        st = st + kt[..., None] * u[..., None, :]
        outs.append(torch.einsum("bnkv,bnk->bnv", st, q[:, :, t]))
    return torch.stack(outs, 2)


def _delta_chunked(q, k, v, g, beta, C=CHUNK):
    """chunked WY form of the same recurrence.  Inside a chunk with local log-decay prefix G_t:
    u = (I + A)^-1 beta (v - e^G k S0),  A_ts = beta_t e^(G_t - G_s) k_t.k_s (s < t);
    o_t = e^G_t q_t S0 + sum_{s<=t} e^(G_t - G_s) (q_t.k_s) u_s;  S_end = e^G_C S0 + sum_s e^(G_C - G_s) k_s u_s^T."""
    B, n, S, dk = k.shape
    dv = v.shape[-1]
    pad = (-S) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (S + pad) // C
    q, k, v = (x.view(B, n, N, C, -1) for x in (q, k, v))
    g, beta = g.view(B, n, N, C), beta.view(B, n, N, C)
    G = g.cumsum(-1)
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool).tril(0)
    diff = G[..., :, None] - G[..., None, :]
    dec_strict = diff.masked_fill(~strict, float("-inf")).exp()
    dec_incl = diff.masked_fill(~incl, float("-inf")).exp()
    eye = torch.eye(C)
    st = q.new_zeros(B, n, dk, dv)
    outs = []
    for c in range(N):
        qc, kc, vc, Gc, bc = q[:, :, c], k[:, :, c], v[:, :, c], G[:, :, c], beta[:, :, c]
        A = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * dec_strict[:, :, c]
        rhs = bc[..., None] * (vc - Gc.exp()[..., None] * (kc @ st))
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        o = Gc.exp()[..., None] * (qc @ st) + ((qc @ kc.transpose(-1, -2)) * dec_incl[:, :, c]) @ u
        outs.append(o)
        last = Gc[..., -1:]
        st = last.exp()[..., None] * st + (kc * (last - Gc).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(outs, 2)[:, :, :S]


class GatedDeltaNet(nn.Module):
    def __init__(self, sd, p, cfg, g_in):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.r = self.nv // self.nk
        self.K = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        H = cfg.hidden_size
        kd, vd, nv = self.nk * self.dk, self.nv * self.dv, self.nv
        wqkvz = sd[p + "in_proj_qkvz.weight"].float()
        wba = sd[p + "in_proj_ba.weight"].float()
        if b == "qn_qkvz_flat_split":
            wq, wk, wv, wz = wqkvz.split((kd, kd, vd, vd), 0)
            wb, wa = wba.split((nv, nv), 0)
        else:
            grp = wqkvz.view(self.nk, 2 * self.dk + 2 * self.r * self.dv, H)
            wq, wk, wv, wz = (
                t.reshape(-1, H) for t in grp.split((self.dk, self.dk, self.r * self.dv, self.r * self.dv), 1)
            )
            gba = wba.view(self.nk, 2 * self.r, H)
            wb, wa = (t.reshape(-1, H) for t in gba.split((self.r, self.r), 1))
        w_in = torch.cat((wq, wk, wv, wz, wb, wa), 0).t()
        if g_in is not None:
            w_in = g_in[:, None] * w_in
        self.w_in = _P(w_in)
        self.conv = _P(sd[p + "conv1d.weight"].float()[:, 0, :].t())  # (K, C)
        A_log = sd[p + "A_log"].float()
        self.A_neg = _P(-A_log if b == "qn_decay_A_log_not_exp" else -A_log.exp())
        self.dt = _P(sd[p + "dt_bias"])
        self.gn = _P(sd[p + "norm.weight"])
        self.w_out = _P(sd[p + "out_proj.weight"].float().t())

    def _conv(self, x):
        """x (B, S, C) -> depthwise causal conv as a sum of shifted copies"""
        b = _bug()
        K, S = self.K, x.shape[1]
        if b == "qn_conv_not_causal":
            xp = F.pad(x, (0, 0, 0, K - 1))
        else:
            xp = F.pad(x, (0, 0, K - 1, 0))
        y = sum(xp[:, j : j + S] * self.conv[j] for j in range(K))
        return y if b == "qn_conv_no_silu" else F.silu(y)

    def forward(self, x, keep):
        b = _bug()
        B, S, _ = x.shape
        if b != "qn_pad_state_leak":
            x = torch.where(keep[..., None], x, torch.zeros((), dtype=x.dtype))
        kd, vd, nv = self.nk * self.dk, self.nv * self.dv, self.nv
        qkv, z, bb, a = (x @ self.w_in).split((2 * kd + vd, vd, nv, nv), -1)
        q, k, v = self._conv(qkv).split((kd, kd, vd), -1)
        q = _l2n(q.view(B, S, self.nk, self.dk)) * self.dk**-0.5
        k = _l2n(k.view(B, S, self.nk, self.dk))
        if b == "qn_gva_tiled_heads":
            q, k = q.repeat(1, 1, self.r, 1), k.repeat(1, 1, self.r, 1)
        else:
            q, k = q.repeat_interleave(self.r, 2), k.repeat_interleave(self.r, 2)
        v = v.view(B, S, self.nv, self.dv)
        beta = torch.sigmoid(bb)
        g = self.A_neg * F.softplus(a + self.dt)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
        if b == "delta_recurrent":
            o = _delta_recurrent(q, k, v, g, beta)
        else:
            o = _delta_chunked(q, k, v, g, beta)
        o = o.transpose(1, 2)  # (B, S, nv, dv)
        gate = z.view(B, S, self.nv, self.dv)
        act = torch.sigmoid(gate) if b == "qn_gated_norm_sigmoid" else F.silu(gate)
        o = _rms(o, self.gn, self.eps) * act
        out = o.reshape(B, S, -1) @ self.w_out
        _rec(self.pre.rstrip("."), out)
        return out


def _swiglu_cols(sd, p, g):
    wg = sd[p + "gate_proj.weight"].float().t()
    wu = sd[p + "up_proj.weight"].float().t()
    w = torch.cat((wu, wg), 1)
    if g is not None:
        w = g[:, None] * w
    return w, sd[p + "down_proj.weight"].float().t()


def _swiglu(x, w_gu, w_dn):
    up, gate = (x @ w_gu).chunk(2, -1)
    return (F.silu(gate) * up) @ w_dn


class DenseMLP(nn.Module):
    def __init__(self, sd, p, g):
        super().__init__()
        self.pre = p
        w_gu, w_dn = _swiglu_cols(sd, p, g)
        self.w_gu, self.w_dn = _P(w_gu), _P(w_dn)

    def forward(self, x):
        out = _swiglu(x, self.w_gu, self.w_dn)
        _rec(self.pre.rstrip("."), out)
        return out


class SparseMoE(nn.Module):
    def __init__(self, sd, p, cfg, g):
        super().__init__()
        self.pre = p
        self.k = cfg.num_experts_per_tok
        self.E = cfg.num_experts
        self.renorm = cfg.norm_topk_prob
        wr = sd[p + "gate.weight"].float().t()
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H): [gate | up]
        wg, wu = gu.chunk(2, 1)
        w_gu = torch.cat((wu, wg), 1).transpose(1, 2)  # (E, H, 2I) [up | gate]
        s_gu, s_dn = _swiglu_cols(sd, p + "shared_expert.", g)
        w_sg = sd[p + "shared_expert_gate.weight"].float().t()
        if g is not None:
            wr, w_gu, w_sg = g[:, None] * wr, g[None, :, None] * w_gu, g[:, None] * w_sg
        self.w_r, self.w_gu, self.w_sg = _P(wr), _P(w_gu), _P(w_sg)
        self.w_dn = _P(sd[p + "experts.down_proj"].float().transpose(1, 2))  # (E, I, H)
        self.s_gu, self.s_dn = _P(s_gu), _P(s_dn)

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        probs = torch.softmax(t @ self.w_r, -1)
        w, idx = probs.topk(self.k, -1)
        if self.renorm and b != "qn_topk_no_renorm":
            w = w / w.sum(-1, keepdim=True)
        if b == "moe_dense_all_experts":
            dense = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)
            up, gate = torch.einsum("th,ehi->eti", t, self.w_gu).chunk(2, -1)
            y = torch.einsum("eti,eih->eth", F.silu(gate) * up, self.w_dn)
            routed = torch.einsum("te,eth->th", dense, y)
        else:
            routed = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel() == 0:
                    continue
                y = _swiglu(t[tok], self.w_gu[e], self.w_dn[e])
                routed.index_add_(0, tok, y * w[tok, slot, None])
        shared = _swiglu(t, self.s_gu, self.s_dn)
        if b != "qn_shared_expert_ungated":
            shared = shared * torch.sigmoid(t @ self.w_sg)
        out = (routed + shared).view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        fold = _bug() == "norm_gain_folded"
        g1 = _zc_gain(sd[p + "input_layernorm.weight"])
        g2 = _zc_gain(sd[p + "post_attention_layernorm.weight"])
        self.g1 = None if fold else _P(g1)
        self.g2 = None if fold else _P(g2)
        self.kind = cfg.layer_types[i]
        if self.kind == "linear_attention":
            self.mixer = GatedDeltaNet(sd, p + "linear_attn.", cfg, g1 if fold else None)
        elif self.kind == "full_attention":
            self.mixer = FullAttention(sd, p + "self_attn.", cfg, g1 if fold else None)
        else:
            raise NotImplementedError(self.kind)
        sparse = i not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0
        if sparse:
            self.ffn = SparseMoE(sd, p + "mlp.", cfg, g2 if fold else None)
        else:
            self.ffn = DenseMLP(sd, p + "mlp.", g2 if fold else None)

    def forward(self, h, allowed, keep, cos, sin):
        x = _rms(h, self.g1, self.eps)
        if self.kind == "linear_attention":
            h = h + self.mixer(x, keep)
        else:
            h = h + self.mixer(x, allowed, cos, sin)
        h = h + self.ffn(_rms(h, self.g2, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class Qwen3NextPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        head = head.float()
        g_out = _zc_gain(sd["model.norm.weight"])
        fold = b == "norm_gain_folded"
        if fold:
            head = head * g_out[None, :]
        self.out = _P(head)
        self.g_out = None if fold else _P(g_out)
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = cfg.head_dim
        prf = rp.get("partial_rotary_factor", 1.0)
        rot = hd if b == "qn_rope_full_head_dim" else int(hd * prf)
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        i = torch.arange(S)
        causal = (i[None, :] <= i[:, None])[None, None]
        allowed = causal & keep[:, None, None, :]
        allowed = allowed | torch.eye(S, dtype=torch.bool)[None, None]  # fully padded query rows keep themselves
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            h = blk(h, allowed, keep, cos, sin)
        h = _rms(h, self.g_out, self.cfg.rms_norm_eps)
        if _bug() != "norm_gain_folded":
            _rec("model.norm", h)
        logits = F.linear(h, self.out)
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None]
        position_ids = position_ids.expand(B, S)
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Qwen3NextPort(state_dict, config).eval()
