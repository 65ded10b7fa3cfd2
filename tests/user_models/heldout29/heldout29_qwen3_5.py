"""Hand-written plain-PyTorch port of the Qwen3.5 text causal LM (Qwen3_5ForCausalLM, config Qwen3_5TextConfig).

Architecture as this port implements it (what differs from Llama is marked *):
- token embedding, untied lm_head; pre-norm layers  x = x + Mix(N1(x));  x = x + SwiGLU(N2(x)); final norm.
- * every RMSNorm of the residual stream and the attention q/k norms is "zero-centred": y = norm(x) * (1 + w)
  (eps rms_norm_eps); only the gated norm of the linear-attention output uses a plain gain w.
- * two mixer kinds, from config.layer_types:
  * "full_attention": GQA, head_dim from the config (not hidden/heads). * q_proj gives, PER HEAD, [query | gate]
    (2 head_dim values per head, interleaved by head). q and k get per-head zero-centred RMSNorm, then
    * partial rotate-half RoPE on the FIRST rot = head_dim * partial_rotary_factor dims only
    (inv_freq = theta^(-2i/rot)); softmax(q k^T / sqrt(head_dim)) with causal + key-padding mask;
    * output times sigmoid(gate) before o_proj.
  * "linear_attention" = Gated DeltaNet: padding positions of the layer input zeroed; in_proj_qkv -> depthwise
    causal conv1d (kernel linear_conv_kernel_dim, no bias) + SiLU -> split [q | k | v]
    (linear_num_key_heads heads of linear_key_head_dim for q and k, linear_num_value_heads of
    linear_value_head_dim for v); * each q/k head serves num_v/num_k CONSECUTIVE value heads;
    q, k L2-normalised per head (x * rsqrt(sum x^2 + 1e-6)), q times dk^-0.5;
    beta = sigmoid(in_proj_b x), log-decay g = -exp(A_log) * softplus(in_proj_a x + dt_bias);
    per value head, state S (dk x dv):  S <- exp(g) S;  d = beta (v - S^T k);  S <- S + k d^T;  o = S^T q.
    * output per head RMSNorm (gain w, eps rms_norm_eps) THEN times silu(z), z = in_proj_z x; out_proj.
Weight layout of this port (own names):
- tok (V, H); unemb (H, V) transposed lm_head; fnorm (H,) holding 1 + w (the offset folded at load).
- per layer `blocks[i]`: g1, g2 (H,) holding 1 + w; ffn_in (H, 2I) = [gate | up] fused+transposed; ffn_out (I, H).
  attention: wq (H, nq*hd) and wgate (H, nq*hd), the query and gate rows of q_proj de-interleaved per head,
  transposed; wkv (H, 2*nkv*hd) = [k | v] fused+transposed; qg, kg (hd,) holding 1 + w; wo (nq*hd, H).
  Gated DeltaNet: w_in (H, 2*Kd + Vd + Vd) = [q | k | v | z] fused+transposed; w_ba (H, 2*nv) = [b | a]
  transposed; conv (2*Kd + Vd, K) squeezed; decay_rate (nv,) = exp(A_log); dt_bias (nv,); onorm (dv,); wo (Vd, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "q35_norm_no_offset",  # zero-centred RMSNorm gains loaded as w instead of 1 + w (residual-stream and q/k norms)
    "q35_gated_norm_offset",  # linear-attention gated norm also given the 1 + w offset (its gain is a plain w)
    "q35_gate_halves",  # q_proj rows split as [all queries | all gates] instead of per head [query | gate]
    "q35_gate_silu",  # attention output gate silu(gate) instead of sigmoid(gate)
    "q35_rope_freq_headdim",  # partial RoPE inv_freq exponent divided by head_dim instead of the rotary dim
    "q35_rope_on_tail",  # partial RoPE applied to the LAST rot dims of each head instead of the first
    "q35_gdn_heads_tiled",  # q/k head h serves value heads h, h + nk, ... (tiled) instead of consecutive ones
    "q35_gdn_q_no_l2norm",  # queries of the delta rule not L2-normalised (keys are)
    "q35_gdn_q_scale_missing",  # queries of the delta rule not scaled by dk^-0.5
    "q35_gdn_read_before_decay",  # delta-rule prediction S^T k read from the state before this step's decay
    "q35_gdn_ba_swapped",  # in_proj_b and in_proj_a swapped when fusing w_ba (beta from a, decay from b)
    "q35_gdn_gate_before_norm",  # gated norm multiplies by silu(z) first and then normalises
    "q35_pad_no_input_mask",  # linear-attention input not zeroed at padding (padding leaks into conv and state)
    "q35_pad_mask_after_conv",  # padding zeroed after the conv instead of before it (padding leaks through the conv)
]
PADDING_ONLY = {"q35_pad_no_input_mask", "q35_pad_mask_after_conv"}
CLEAN = [
    "q35_sdpa",  # attention via F.scaled_dot_product_attention
    "q35_chunked",  # Gated DeltaNet in chunked form (chunks of 8, triangular solve within a chunk)
    "q35_offset_runtime",  # zero-centred gains kept as w, 1 + w computed at every call
    "q35_rope_complex",  # partial RoPE as complex multiplication of (x_i, x_{i + rot/2}) pairs
    "q35_conv_unfold",  # causal depthwise conv as an explicit sum of shifted inputs
]


def _rms(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class _Block(nn.Module):
    pass


class Qwen35Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        bug = BUG

        def g(k):
            return sd[k].detach().clone().float()

        self.eps = cfg.rms_norm_eps
        self.types = list(cfg.layer_types)
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.head_dim
        rp = cfg.rope_parameters
        self.theta = rp["rope_theta"]
        self.rot = int(self.hd * rp.get("partial_rotary_factor", 1.0))
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.runtime_off = bug == "q35_offset_runtime"

        def zc(k):  # zero-centred gain
            w = g(k)
            if self.runtime_off:
                return w
            return w if bug == "q35_norm_no_offset" else 1.0 + w

        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.unemb = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fnorm = nn.Parameter(zc("model.norm.weight"))
        self.blocks = nn.ModuleList()
        nq, hd = self.nq, self.hd
        for i, kind in enumerate(self.types):
            p = f"model.layers.{i}."
            b = _Block()
            b.g1 = nn.Parameter(zc(p + "input_layernorm.weight"))
            b.g2 = nn.Parameter(zc(p + "post_attention_layernorm.weight"))
            b.ffn_in = nn.Parameter(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")], 0).t())
            b.ffn_out = nn.Parameter(g(p + "mlp.down_proj.weight").t().contiguous())
            if kind == "full_attention":
                a = p + "self_attn."
                wqg = g(a + "q_proj.weight")
                if bug == "q35_gate_halves":
                    wq, wgate = wqg.chunk(2, 0)
                else:
                    wqg = wqg.view(nq, 2, hd, -1)
                    wq, wgate = wqg[:, 0].reshape(nq * hd, -1), wqg[:, 1].reshape(nq * hd, -1)
                b.wq = nn.Parameter(wq.t().contiguous())
                b.wgate = nn.Parameter(wgate.t().contiguous())
                b.wkv = nn.Parameter(torch.cat([g(a + "k_proj.weight"), g(a + "v_proj.weight")], 0).t().contiguous())
                b.wo = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
                b.qg = nn.Parameter(zc(a + "q_norm.weight"))
                b.kg = nn.Parameter(zc(a + "k_norm.weight"))
            else:
                a = p + "linear_attn."
                b.w_in = nn.Parameter(torch.cat([g(a + "in_proj_qkv.weight"), g(a + "in_proj_z.weight")], 0).t())
                wb, wa = g(a + "in_proj_b.weight"), g(a + "in_proj_a.weight")
                if bug == "q35_gdn_ba_swapped":
                    wb, wa = wa, wb
                b.w_ba = nn.Parameter(torch.cat([wb, wa], 0).t().contiguous())
                b.conv = nn.Parameter(g(a + "conv1d.weight").squeeze(1))
                b.decay_rate = nn.Parameter(g(a + "A_log").exp())
                b.dt_bias = nn.Parameter(g(a + "dt_bias"))
                ow = g(a + "norm.weight")
                b.onorm = nn.Parameter(1.0 + ow if bug == "q35_gated_norm_offset" else ow)
                b.wo = nn.Parameter(g(a + "out_proj.weight").t().contiguous())
            self.blocks.append(b)

    # ---------------- helpers ----------------
    def _gain(self, w):
        return 1.0 + w if self.runtime_off else w

    def _rope(self, x, pos):
        bug = BUG
        rot, hd = self.rot, self.hd
        denom = hd if bug == "q35_rope_freq_headdim" else rot
        inv = 1.0 / (self.theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / denom))
        ang = pos[:, None, :, None].float() * inv  # (B, 1, T, rot/2)
        if bug == "q35_rope_on_tail":
            xr, xp = x[..., hd - rot :], x[..., : hd - rot]
        else:
            xr, xp = x[..., :rot], x[..., rot:]
        if bug == "q35_rope_complex":
            c = torch.complex(xr[..., : rot // 2], xr[..., rot // 2 :]) * torch.polar(torch.ones_like(ang), ang)
            xr = torch.cat([c.real, c.imag], -1)
        else:
            cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
            half = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
            xr = xr * cos + half * sin
        if bug == "q35_rope_on_tail":
            return torch.cat([xp, xr], -1)
        return torch.cat([xr, xp], -1)

    # ---------------- attention ----------------
    def _attn(self, b, x, pos, keep):
        bug = BUG
        B, T, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q = (x @ b.wq).view(B, T, nq, hd)
        gate = x @ b.wgate
        k, v = (x @ b.wkv).split([nkv * hd, nkv * hd], -1)
        q = _rms(q, self._gain(b.qg), self.eps).transpose(1, 2)
        k = _rms(k.view(B, T, nkv, hd), self._gain(b.kg), self.eps).transpose(1, 2)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        q, k = self._rope(q, pos), self._rope(k, pos)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if bug == "q35_sdpa":
            eye = torch.eye(T, dtype=torch.bool)[None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=(keep | eye)[:, None])
        else:
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            s = s.masked_fill(~keep[:, None], torch.finfo(s.dtype).min)
            o = s.softmax(-1) @ v
        o = o.transpose(1, 2).reshape(B, T, nq * hd)
        o = o * (F.silu(gate) if bug == "q35_gate_silu" else torch.sigmoid(gate))
        return o @ b.wo

    # ---------------- gated deltanet ----------------
    def _gdn(self, b, x, mask):
        bug = BUG
        B, T, _ = x.shape
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        Kd, Vd = nk * dk, nv * dv
        if mask is not None and bug not in ("q35_pad_no_input_mask", "q35_pad_mask_after_conv"):
            x = x * mask[:, :, None]
        qkv, z = (x @ b.w_in).split([2 * Kd + Vd, Vd], -1)
        K = b.conv.shape[1]
        if bug == "q35_conv_unfold":
            xp = F.pad(qkv, (0, 0, K - 1, 0))
            qkv = sum(xp[:, j : j + T] * b.conv[:, j] for j in range(K))
        else:
            qkv = F.conv1d(F.pad(qkv.transpose(1, 2), (K - 1, 0)), b.conv[:, None], groups=qkv.shape[-1])
            qkv = qkv.transpose(1, 2)
        qkv = F.silu(qkv)
        if mask is not None and bug == "q35_pad_mask_after_conv":
            qkv = qkv * mask[:, :, None]
        q, k, v = qkv.split([Kd, Kd, Vd], -1)
        q, k, v = q.view(B, T, nk, dk), k.view(B, T, nk, dk), v.view(B, T, nv, dv)
        if bug == "q35_gdn_heads_tiled":
            q, k = q.repeat(1, 1, nv // nk, 1), k.repeat(1, 1, nv // nk, 1)
        else:
            q, k = q.repeat_interleave(nv // nk, 2), k.repeat_interleave(nv // nk, 2)
        if bug != "q35_gdn_q_no_l2norm":
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        if bug != "q35_gdn_q_scale_missing":
            q = q / math.sqrt(dk)
        bt, at = (x @ b.w_ba).split([nv, nv], -1)
        beta = torch.sigmoid(bt)
        logd = -b.decay_rate * F.softplus(at + b.dt_bias)  # (B, T, nv)
        if bug == "q35_chunked":
            o = self._delta_chunked(q, k, v, beta, logd, 8)
        else:
            S = torch.zeros(B, nv, dk, dv)
            outs = []
            for t in range(T):
                Sd = S * logd[:, t, :, None, None].exp()
                src = S if bug == "q35_gdn_read_before_decay" else Sd
                pred = torch.einsum("bhkv,bhk->bhv", src, k[:, t])
                d = beta[:, t, :, None] * (v[:, t] - pred)
                S = Sd + k[:, t, :, :, None] * d[:, :, None, :]
                outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
            o = torch.stack(outs, 1)  # (B, T, nv, dv)
        z = z.view(B, T, nv, dv)
        if bug == "q35_gdn_gate_before_norm":
            o = _rms(o * F.silu(z), b.onorm, self.eps)
        else:
            o = _rms(o, b.onorm, self.eps) * F.silu(z)
        return o.reshape(B, T, Vd) @ b.wo

    @staticmethod
    def _delta_chunked(q, k, v, beta, logd, C):
        # within a chunk (cumulative log-decay c_t, start state S0), with deltas d_s:
        #   d_t = beta_t (v_t - e^{c_t} S0^T k_t - sum_{s<t} e^{c_t - c_s} (k_t . k_s) d_s)
        #   o_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t . k_s) d_s
        B, T, H, dk = k.shape
        dv = v.shape[-1]
        S = torch.zeros(B, H, dk, dv)
        outs = []
        for s0 in range(0, T, C):
            sl = slice(s0, min(s0 + C, T))
            qc, kc, vc = (t[:, sl].transpose(1, 2) for t in (q, k, v))  # (B, H, L, d)
            bc = beta[:, sl].transpose(1, 2)  # (B, H, L)
            cc = logd[:, sl].transpose(1, 2).cumsum(-1)
            L = qc.shape[2]
            dec = (cc[..., :, None] - cc[..., None, :]).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -1e30)
            dec = dec.exp()
            strict = torch.ones(L, L).tril(-1)
            A = bc[..., None] * (kc @ kc.transpose(-1, -2)) * dec * strict
            rhs = bc[..., None] * (vc - cc.exp()[..., None] * (kc @ S))
            d = torch.linalg.solve_triangular(A + torch.eye(L), rhs, upper=False, unitriangular=True)
            o = cc.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * dec) @ d
            outs.append(o.transpose(1, 2))
            last = cc[..., -1:]
            S = last.exp()[..., None] * S + (kc * (last - cc).exp()[..., None]).transpose(-1, -2) @ d
        return torch.cat(outs, 1)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        km = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        keep = torch.ones(T, T, dtype=torch.bool).tril()[None] & km[:, None, :]
        mask = None if attention_mask is None else km.float()
        h = self.tok[input_ids]
        for kind, b in zip(self.types, self.blocks):
            n = _rms(h, self._gain(b.g1), self.eps)
            h = h + (self._attn(b, n, position_ids, keep) if kind == "full_attention" else self._gdn(b, n, mask))
            n = _rms(h, self._gain(b.g2), self.eps)
            gt, up = (n @ b.ffn_in).chunk(2, -1)
            h = h + (F.silu(gt) * up) @ b.ffn_out
        return (_rms(h, self._gain(self.fnorm), self.eps) @ self.unemb).float()


def build(state_dict, config):
    return Qwen35Port(state_dict, config).eval()
