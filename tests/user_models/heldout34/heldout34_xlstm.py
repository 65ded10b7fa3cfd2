"""Hand-written plain-PyTorch port of xLSTM (xLSTMForCausalLM, the mLSTM-only "xLSTM large" stack of xLSTM-7B).

Architecture as this port implements it:
- token embedding (no scaling); untied lm_head; final RMSNorm (weight only, eps = config.norm_eps);
  logits soft-capped: cap * tanh(logits / cap), cap = config.output_logit_soft_cap.
- RMSNorm here is  w * x / sqrt(mean(x^2) + norm_eps) (+ b when config.use_bias).
- every block (config.num_blocks of them, all alike), pre-norm:
    x = x + mLSTM(RMSNorm(x));  x = x + FFN(RMSNorm(x))
- mLSTM layer (nh = config.num_heads, NOT num_attention_heads; qk_dim = hidden * qk_dim_factor,
  v_dim = hidden * v_dim_factor, head dims dqk = qk_dim / nh, dv = v_dim / nh):
    q, k (qk_dim), v (v_dim), o (v_dim: output-gate pre-activation), i, f (nh each) = linear maps of the input;
    i, f soft-capped with cap = config.gate_soft_cap;
    per head, a matrix memory C (dqk x dv), a normaliser n (dqk) and a log-domain stabiliser m, all from zero:
      m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)
      a_t = exp(logsigmoid(f_t) + m_{t-1} - m_t),  b_t = exp(i_t - m_t)
      C_t = a_t C_{t-1} + b_t k_t v_t^T,           n_t = a_t n_{t-1} + b_t k_t
      q~ = q_t / sqrt(dqk);  h_t = (q~ C_t) / (max(|q~ . n_t|, exp(-m_t)) + config.eps)
    h is normalised per head by a LayerNorm over dv (mean-centred, biased variance, eps = norm_eps) with a
    per-channel affine over v_dim, then gated by sigmoid(o), then out_proj (v_dim -> hidden).
    (The denominator and the stabiliser m only set a per-(token, head) scale of h, which that head norm removes
    up to norm_eps; what must be exact is the relative weighting of the writes: a_t and b_t above.)
- FFN: SwiGLU  down(silu(gate(x)) * up(x)), width round_up(hidden * ffn_proj_factor, ffn_round_up_to_multiple_of).
- the model has no positions and no attention mask: padding tokens run through the recurrence like any other
  token (Transformers does the same), so position_ids and attention_mask are accepted and not used.
Weight layout of this port (own names):
- emb (V, H); head_t (H, V) = lm_head transposed; fin (H,).
- per block `blocks[i]`: n1_w / n1_b, n2_w / n2_b (H,) (biases zero when use_bias is off);
  w_in (H, 2 qk_dim + 2 v_dim + 2 nh) = [q | k | v | o | i | f] fused + transposed, b_in likewise;
  hn_w / hn_b (v_dim,) head-norm affine; w_out (v_dim, H) transposed, b_out (H,);
  w_gu (H, 2 F) = [gate | up] fused + transposed, b_gu (2 F,); w_dn (F, H) transposed, b_dn (H,).
Transformers' "fused" weight mode (qkv_opreact, ifgate_preact, proj_up_gate_z) is read too.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "xlstm_fgate_exp",  # forget gate taken as exp(f) (log gate = f) instead of sigmoid(f) (log gate = logsigmoid(f))
    "xlstm_igate_sigmoid",  # input gate taken as sigmoid(i) (log gate = logsigmoid(i)) instead of exp(i)
    "xlstm_gate_cap_logit_field",  # i / f gates soft-capped with output_logit_soft_cap instead of gate_soft_cap
    "xlstm_logit_cap_missing",  # final tanh soft cap of the logits never applied
    "xlstm_forget_unstabilized",  # decay of the old state is sigmoid(f) without the exp(m_{t-1} - m_t) rescale
    "xlstm_read_before_write",  # h_t read from the state before step t's update (C_{t-1}, n_{t-1}, m_{t-1})
    "xlstm_norm_eps_from_eps",  # RMSNorms and the head norm use config.eps (the mLSTM denominator's) not norm_eps
    "xlstm_headnorm_rms",  # per-head output norm done as RMSNorm (no mean subtraction) instead of LayerNorm
    "xlstm_headnorm_attn_heads",  # head norm groups sized by num_attention_heads (4) instead of num_heads (2)
    "xlstm_ogate_before_norm",  # sigmoid(o) gate applied to h before the per-head norm instead of after it
    "xlstm_v_o_swapped",  # loader fuses [q|k|o|v] but the forward splits [q|k|v|o]: value and output gate swapped
    "xlstm_heads_strided",  # q / k / v split into heads with the head index fastest (strided) instead of blocks
    "xlstm_norm_bias_dropped",  # RMSNorm biases (norm_mlstm / norm_ffn .bias, use_bias=True) never loaded
    "xlstm_pad_hidden_zeroed",  # block inputs multiplied by the attention mask (Mamba2 style); HF runs pads through
]
PADDING_ONLY = {"xlstm_pad_hidden_zeroed"}
CLEAN = [
    "xlstm_parallel",  # quadratic parallel form: decay matrix D from cumulative log forget gates, row-wise max
    "xlstm_chunkwise",  # chunkwise form (config.chunk_size): parallel inside a chunk, state carried between
    "xlstm_unstabilized_f64",  # un-stabilised recurrence in float64 (raw exp gates), exp(m) only for the eps term
    "xlstm_groupnorm",  # per-head LayerNorm through F.group_norm over (tokens, v_dim) with nh groups
    "xlstm_head_major_qkvo",  # w_in laid out head-major ([q_h | k_h | v_h | o_h] per head, then i | f)
]


def _rms(x, w, b, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w + b


def _cap(x, c):
    return c * torch.tanh(x / c)


class XLSTMPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        def gb(k, n):
            return g(k) if k in sd else torch.zeros(n)

        H = cfg.hidden_size
        self.nh = cfg.num_heads
        self.qk = int(H * cfg.qk_dim_factor)
        self.v = int(H * cfg.v_dim_factor)
        self.norm_eps = cfg.eps if BUG == "xlstm_norm_eps_from_eps" else cfg.norm_eps
        self.attn_heads = getattr(cfg, "num_attention_heads", None) or cfg.num_heads
        self.eps = cfg.eps
        self.gate_cap = cfg.gate_soft_cap
        self.logit_cap = cfg.output_logit_soft_cap
        self.chunk = cfg.chunk_size
        self.emb = nn.Parameter(g("backbone.embeddings.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("backbone.out_norm.weight"))
        self.fin_b = nn.Parameter(gb("backbone.out_norm.bias", H))
        nh, qk, v = self.nh, self.qk, self.v
        self.blocks = nn.ModuleList()
        for i in range(cfg.num_blocks):
            p = f"backbone.blocks.{i}."
            m = p + "mlstm_layer."
            f = p + "ffn."
            L = nn.Module()
            L.n1_w = nn.Parameter(g(p + "norm_mlstm.weight"))
            L.n2_w = nn.Parameter(g(p + "norm_ffn.weight"))
            if BUG == "xlstm_norm_bias_dropped":
                L.n1_b, L.n2_b = nn.Parameter(torch.zeros(H)), nn.Parameter(torch.zeros(H))
            else:
                L.n1_b = nn.Parameter(gb(p + "norm_mlstm.bias", H))
                L.n2_b = nn.Parameter(gb(p + "norm_ffn.bias", H))
            if m + "qkv_opreact.weight" in sd:  # Transformers' fused weight mode
                wq, wk, wv, wo = g(m + "qkv_opreact.weight").split([qk, qk, v, v], 0)
                bq, bk, bv, bo = gb(m + "qkv_opreact.bias", 2 * qk + 2 * v).split([qk, qk, v, v], 0)
                wi, wf = g(m + "ifgate_preact.weight").split([nh, nh], 0)
                bi, bf = g(m + "ifgate_preact.bias").split([nh, nh], 0)
            else:
                wq, wk, wv, wo = (g(m + n + ".weight") for n in ("q", "k", "v", "ogate_preact"))
                bq, bk = gb(m + "q.bias", qk), gb(m + "k.bias", qk)
                bv, bo = gb(m + "v.bias", v), gb(m + "ogate_preact.bias", v)
                wi, wf = g(m + "igate_preact.weight"), g(m + "fgate_preact.weight")
                bi, bf = g(m + "igate_preact.bias"), g(m + "fgate_preact.bias")
            if BUG == "xlstm_v_o_swapped":
                wv, wo, bv, bo = wo, wv, bo, bv
            if BUG == "xlstm_head_major_qkvo":  # per head h: rows of q_h, k_h, v_h, o_h
                ws = [t.chunk(nh, 0)[h] for h in range(nh) for t in (wq, wk, wv, wo)]
                bs = [t.chunk(nh, 0)[h] for h in range(nh) for t in (bq, bk, bv, bo)]
                w_in, b_in = torch.cat([*ws, wi, wf], 0), torch.cat([*bs, bi, bf], 0)
            else:
                w_in = torch.cat([wq, wk, wv, wo, wi, wf], 0)
                b_in = torch.cat([bq, bk, bv, bo, bi, bf], 0)
            L.w_in = nn.Parameter(w_in.t().contiguous())
            L.b_in = nn.Parameter(b_in)
            L.hn_w = nn.Parameter(g(m + "multihead_norm.weight"))
            L.hn_b = nn.Parameter(gb(m + "multihead_norm.bias", v))
            L.w_out = nn.Parameter(g(m + "out_proj.weight").t().contiguous())
            L.b_out = nn.Parameter(gb(m + "out_proj.bias", H))
            if f + "proj_up_gate_z.weight" in sd:
                w_gu = g(f + "proj_up_gate_z.weight")
                b_gu = gb(f + "proj_up_gate_z.bias", w_gu.shape[0])
            else:
                w_gu = torch.cat([g(f + "proj_up_gate.weight"), g(f + "proj_up.weight")], 0)
                n_up = w_gu.shape[0] // 2
                b_gu = torch.cat([gb(f + "proj_up_gate.bias", n_up), gb(f + "proj_up.bias", n_up)])
            L.w_gu = nn.Parameter(w_gu.t().contiguous())
            L.b_gu = nn.Parameter(b_gu)
            L.w_dn = nn.Parameter(g(f + "proj_down.weight").t().contiguous())
            L.b_dn = nn.Parameter(gb(f + "proj_down.bias", H))
            self.blocks.append(L)

    # ---- the mLSTM cell, several equivalent forms; q, k, v (B, nh, S, d); li, lf (B, nh, S) log-gates ----
    def _recurrent(self, q, k, v, li, lf):
        B, nh, S, dqk = q.shape
        dv = v.shape[-1]
        eps = self.eps
        C = q.new_zeros(B, nh, dqk, dv)
        n = q.new_zeros(B, nh, dqk)
        m = q.new_zeros(B, nh)
        q = q * dqk**-0.5
        out = []
        for t in range(S):
            qt = q[:, :, t]
            if BUG == "xlstm_read_before_write":
                num = (qt[..., None] * C).sum(-2)
                den = torch.maximum((qt * n).sum(-1).abs(), torch.exp(-m)) + eps
                out.append(num / den[..., None])
            m_new = torch.maximum(lf[..., t] + m, li[..., t])
            a = torch.exp(lf[..., t] if BUG == "xlstm_forget_unstabilized" else lf[..., t] + m - m_new)
            b = torch.exp(li[..., t] - m_new)
            kt = k[:, :, t]
            C = a[..., None, None] * C + b[..., None, None] * kt[..., :, None] * v[:, :, t, None, :]
            n = a[..., None] * n + b[..., None] * kt
            m = m_new
            if BUG == "xlstm_read_before_write":
                continue
            num = (qt[..., None] * C).sum(-2)
            qn = (qt * n).sum(-1)
            den = torch.maximum(qn.abs(), torch.exp(-m)) + eps
            out.append(num / den[..., None])
        return torch.stack(out, 2)

    def _parallel(self, q, k, v, li, lf):
        S, dqk = q.shape[-2:]
        cum = lf.cumsum(-1)  # (B, nh, S)
        logd = cum[..., :, None] - cum[..., None, :] + li[..., None, :]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        logd = logd.masked_fill(~causal, -math.inf)
        m = torch.maximum(cum, logd.amax(-1))  # cum: the zero initial state's term
        d = torch.exp(logd - m[..., None])
        s = (q @ k.transpose(-1, -2)) * dqk**-0.5 * d
        den = torch.maximum(s.sum(-1).abs(), torch.exp(-m)) + self.eps
        return (s @ v) / den[..., None]

    def _chunkwise(self, q, k, v, li, lf):
        B, nh, S, dqk = q.shape
        q = q * dqk**-0.5
        C = q.new_zeros(B, nh, dqk, v.shape[-1])
        n = q.new_zeros(B, nh, dqk)
        m = q.new_zeros(B, nh)
        out = []
        for a in range(0, S, self.chunk):
            sl = slice(a, min(a + self.chunk, S))
            qc, kc, vc, ic = q[:, :, sl], k[:, :, sl], v[:, :, sl], li[..., sl]
            L = qc.shape[2]
            bc = lf[..., sl].cumsum(-1)  # log decay from the chunk start, inclusive
            logd = (bc[..., :, None] - bc[..., None, :] + ic[..., None, :]).masked_fill(
                ~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf
            )
            inter = bc + m[..., None]  # the carried state's log weight at each position
            mt = torch.maximum(inter, logd.amax(-1))
            d = torch.exp(logd - mt[..., None])
            g = torch.exp(inter - mt)
            s = (qc @ kc.transpose(-1, -2)) * d
            num = s @ vc + g[..., None] * (qc @ C)
            qn = s.sum(-1) + g * (qc @ n[..., None])[..., 0]
            out.append(num / (torch.maximum(qn.abs(), torch.exp(-mt)) + self.eps)[..., None])
            # carry the state to the chunk end
            m_end = mt[..., -1]
            w = torch.exp(bc[..., -1:] - bc + ic - m_end[..., None])  # (B, nh, L)
            decay = torch.exp(bc[..., -1] + m - m_end)
            C = decay[..., None, None] * C + (kc * w[..., None]).transpose(-1, -2) @ vc
            n = decay[..., None] * n + (kc * w[..., None]).sum(-2)
            m = m_end
        return torch.cat(out, 2)

    def _unstabilized(self, q, k, v, li, lf):
        B, nh, S, dqk = q.shape
        q, k, v, li, lf = (t.double() for t in (q, k, v, li, lf))
        q = q * dqk**-0.5
        C = q.new_zeros(B, nh, dqk, v.shape[-1])
        n = q.new_zeros(B, nh, dqk)
        m = q.new_zeros(B, nh)
        out = []
        for t in range(S):
            fg, ig = torch.exp(lf[..., t]), torch.exp(li[..., t])
            C = fg[..., None, None] * C + ig[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
            n = fg[..., None] * n + ig[..., None] * k[:, :, t]
            m = torch.maximum(lf[..., t] + m, li[..., t])  # only for the eps term, which scales with exp(m)
            qt = q[:, :, t]
            num = (qt[..., None] * C).sum(-2)
            den = torch.clamp((qt * n).sum(-1).abs(), min=1.0) + self.eps * torch.exp(m)
            out.append(num / den[..., None])
        return torch.stack(out, 2).float()

    def _head_norm(self, L, h):  # h (B, S, nh, dv) -> (B, S, v_dim)
        B, S, nh, dv = h.shape
        if BUG == "xlstm_groupnorm":
            y = F.group_norm(h.reshape(B * S, nh * dv), nh, L.hn_w, L.hn_b, self.norm_eps)
            return y.view(B, S, nh * dv)
        if BUG == "xlstm_headnorm_attn_heads":
            h = h.reshape(B, S, self.attn_heads, -1)
        if BUG == "xlstm_headnorm_rms":
            y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        else:
            c = h - h.mean(-1, keepdim=True)
            y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return y.reshape(B, S, -1) * L.hn_w + L.hn_b

    def _mlstm(self, L, x):
        B, S, _ = x.shape
        nh, qk, v = self.nh, self.qk, self.v
        dqk, dv = qk // nh, v // nh
        z = x @ L.w_in + L.b_in
        proj, gates = z[..., : 2 * qk + 2 * v], z[..., 2 * qk + 2 * v :]
        if BUG == "xlstm_head_major_qkvo":
            per = proj.view(B, S, nh, 2 * dqk + 2 * dv).split([dqk, dqk, dv, dv], -1)
            q, k, vv = (t.transpose(1, 2) for t in per[:3])
            o = per[3].reshape(B, S, v)
        else:
            q, k, vv, o = proj.split([qk, qk, v, v], -1)
            if BUG == "xlstm_heads_strided":
                q, k, vv = (t.view(B, S, -1, nh).permute(0, 3, 1, 2) for t in (q, k, vv))
            else:
                q, k, vv = (t.view(B, S, nh, -1).transpose(1, 2) for t in (q, k, vv))
        cap = self.logit_cap if BUG == "xlstm_gate_cap_logit_field" else self.gate_cap
        ig, fg = _cap(gates, cap).transpose(1, 2).split([nh, nh], 1)  # (B, nh, S) each
        li = F.logsigmoid(ig) if BUG == "xlstm_igate_sigmoid" else ig
        lf = fg if BUG == "xlstm_fgate_exp" else F.logsigmoid(fg)
        if BUG == "xlstm_parallel":
            h = self._parallel(q, k, vv, li, lf)
        elif BUG == "xlstm_chunkwise":
            h = self._chunkwise(q, k, vv, li, lf)
        elif BUG == "xlstm_unstabilized_f64":
            h = self._unstabilized(q, k, vv, li, lf)
        else:
            h = self._recurrent(q, k, vv, li, lf)
        h = h.transpose(1, 2)  # (B, S, nh, dv)
        gate = torch.sigmoid(o)
        if BUG == "xlstm_ogate_before_norm":
            h = self._head_norm(L, h * gate.view(B, S, nh, dv))
        else:
            h = gate * self._head_norm(L, h)
        return h @ L.w_out + L.b_out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        x = self.emb[input_ids]
        keep = None
        if BUG == "xlstm_pad_hidden_zeroed" and attention_mask is not None:
            keep = attention_mask[..., None].to(x.dtype)
        for L in self.blocks:
            if keep is not None:
                x = x * keep
            x = x + self._mlstm(L, _rms(x, L.n1_w, L.n1_b, self.norm_eps))
            y = _rms(x, L.n2_w, L.n2_b, self.norm_eps)
            gt, up = (y @ L.w_gu + L.b_gu).chunk(2, -1)
            x = x + (F.silu(gt) * up) @ L.w_dn + L.b_dn
        logits = _rms(x, self.fin, self.fin_b, self.norm_eps) @ self.head_t
        if BUG == "xlstm_logit_cap_missing":
            return logits
        return _cap(logits, self.logit_cap)


def build(state_dict, config):
    return XLSTMPort(state_dict, config).eval()
