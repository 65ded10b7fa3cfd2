"""Hand-written plain-PyTorch port of OLMo Hybrid (OlmoHybridForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
- token embedding, untied lm_head, final RMSNorm (plain gain w, eps rms_norm_eps).
- * two layer kinds, from config.layer_types, with DIFFERENT norm placements:
  * "full_attention" layers are OLMo-2 style POST-norm: no input norm;
      x = x + RMSNorm_pa(Attn(x));  x = x + RMSNorm_pf(SwiGLU(x)).
    Attention: GQA, head_dim = hidden/heads; * q_norm / k_norm are RMSNorms over the WHOLE q (nq*hd) and k
    (nkv*hd) projections (not per head), applied before splitting heads; full rotate-half RoPE (rope_theta);
    softmax(q k^T / sqrt(hd)), causal + key-padding mask; o_proj.
  * "linear_attention" layers are pre-norm:  x = x + GDN(RMSNorm_in(x));  x = x + SwiGLU(RMSNorm_pa(x)).
    * Gated DeltaNet: padding positions of the layer input zeroed; separate q/k/v projections
    (linear_num_key_heads x linear_key_head_dim for q and k, linear_num_value_heads x linear_value_head_dim for v),
    concatenated [q|k|v] -> depthwise causal conv1d (no bias) + SiLU; each q/k head serves num_v/num_k
    CONSECUTIVE value heads; q, k L2-normalised per head (x * rsqrt(sum x^2 + 1e-6)), q times dk^-0.5;
    * beta = 2 * sigmoid(b_proj x) (linear_allow_neg_eigval), log-decay g = -exp(A_log) * softplus(a_proj x + dt_bias);
    per value head, state S (dk x dv):  S <- exp(g) S;  d = beta (v - S^T k);  S <- S + k d^T;  o = S^T q.
    * output per head RMSNorm (gain w, eps 1e-5 fixed) times silu(g_proj x); o_proj.
  * attention layers only get RoPE; linear layers have no positions.
Weight layout of this port (own names):
- emb (V, H); unemb (H, V) transposed lm_head; final_gain (H,).
- per layer `layers[i]`: mlp_w13 (H, 2I) = [gate | up] fused+transposed; mlp_w2 (I, H).
  attention: w_qkv (H, nq*hd + 2*nkv*hd) fused+transposed; q_gain (nq*hd,), k_gain (nkv*hd,); w_o (nq*hd, H);
  post_attn_gain, post_mlp_gain (H,).
  linear: pre_mix_gain, pre_mlp_gain (H,); w_qkv (H, 2*Kd + Vd) = [q | k | v] fused+transposed (the conv's channel
  order); conv (2*Kd + Vd, K) squeezed; w_gate (H, Vd) = g_proj transposed; w_ab (H, 2*nv) = [a | b] transposed;
  rate (nv,) = exp(A_log); dt_bias (nv,); out_gain (dv,); w_o (Vd, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "oh_attn_prenorm",  # attention layers run Llama-style pre-norm (post_attention_layernorm on the input, not output)
    "oh_post_norms_swapped",  # attention layers' post_attention and post_feedforward gains swapped at load
    "oh_qk_norm_per_head",  # q/k RMSNorm statistics per head (Qwen3-style) instead of over the whole projection
    "oh_rope_skipped",  # attention treated as NoPE (no rotary) although the config has rope_theta
    "oh_beta_no_neg_eigval",  # beta = sigmoid(b) without the factor 2 of linear_allow_neg_eigval
    "oh_gdn_heads_tiled",  # q/k head h serves value heads h, h + nk, ... (tiled) instead of consecutive ones
    "oh_gdn_gate_sigmoid",  # output gate sigmoid(g_proj x) instead of silu(g_proj x)
    "oh_gdn_k_no_l2norm",  # keys of the delta rule not L2-normalised (queries are)
    "oh_gdn_dt_bias_missing",  # dt_bias left out of the decay's softplus
    "oh_gdn_norm_all_heads",  # output RMSNorm statistics over all value heads together instead of per head
    "oh_gdn_decay_after_update",  # state decayed after the delta update instead of before it
    "oh_linear_mlp_postnorm",  # linear layers' MLP norm applied to the MLP output (post-norm) instead of its input
    "oh_pad_no_input_mask",  # linear-attention input not zeroed at padding (padding leaks into conv and state)
    "oh_pad_key_mask_ignored",  # attention mask is causal only, the key-padding mask dropped
]
PADDING_ONLY = {"oh_pad_no_input_mask", "oh_pad_key_mask_ignored"}
CLEAN = [
    "oh_sdpa",  # attention via F.scaled_dot_product_attention
    "oh_chunked",  # Gated DeltaNet in chunked form (chunks of 8, triangular solve within a chunk)
    "oh_rope_interleaved",  # q/k rows (and their norm gains) permuted per head at load, GPT-J interleaved RoPE
    "oh_beta_tanh",  # beta = 2 sigmoid(b) computed as 1 + tanh(b / 2)
    "oh_gqa_grouped",  # GQA without repeating kv: queries reshaped into (kv head, group) blocks
]


def _rms(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class _Layer(nn.Module):
    pass


class OlmoHybridPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        bug = BUG

        def g(k):
            return sd[k].detach().clone().float()

        self.eps = cfg.rms_norm_eps
        self.kinds = list(cfg.layer_types)
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rp = cfg.rope_parameters or {}
        self.theta = rp.get("rope_theta")
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.neg_eig = cfg.linear_allow_neg_eigval
        self.emb = nn.Parameter(g("model.embed_tokens.weight"))
        self.unemb = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.final_gain = nn.Parameter(g("model.norm.weight"))
        hd = self.hd
        # per-head permutation (i, i + hd/2) -> adjacent pairs, for the interleaved-RoPE variant
        perm = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], -1).reshape(-1)
        self.layers = nn.ModuleList()
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}."
            lay = _Layer()
            lay.mlp_w13 = nn.Parameter(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")], 0).t())
            lay.mlp_w2 = nn.Parameter(g(p + "mlp.down_proj.weight").t().contiguous())
            if kind == "full_attention":
                a = p + "self_attn."
                wq, wk = g(a + "q_proj.weight"), g(a + "k_proj.weight")
                qg, kg = g(a + "q_norm.weight"), g(a + "k_norm.weight")
                if bug == "oh_rope_interleaved":
                    wq = wq.view(self.nq, hd, -1)[:, perm].reshape(self.nq * hd, -1)
                    wk = wk.view(self.nkv, hd, -1)[:, perm].reshape(self.nkv * hd, -1)
                    qg = qg.view(self.nq, hd)[:, perm].reshape(-1)
                    kg = kg.view(self.nkv, hd)[:, perm].reshape(-1)
                lay.w_qkv = nn.Parameter(torch.cat([wq, wk, g(a + "v_proj.weight")], 0).t().contiguous())
                lay.q_gain, lay.k_gain = nn.Parameter(qg), nn.Parameter(kg)
                lay.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
                pa, pf = g(p + "post_attention_layernorm.weight"), g(p + "post_feedforward_layernorm.weight")
                if bug == "oh_post_norms_swapped":
                    pa, pf = pf, pa
                lay.post_attn_gain, lay.post_mlp_gain = nn.Parameter(pa), nn.Parameter(pf)
            else:
                a = p + "linear_attn."
                lay.pre_mix_gain = nn.Parameter(g(p + "input_layernorm.weight"))
                lay.pre_mlp_gain = nn.Parameter(g(p + "post_attention_layernorm.weight"))
                lay.w_qkv = nn.Parameter(
                    torch.cat([g(a + "q_proj.weight"), g(a + "k_proj.weight"), g(a + "v_proj.weight")], 0).t()
                )
                lay.conv = nn.Parameter(g(a + "conv1d.weight").squeeze(1))
                lay.w_gate = nn.Parameter(g(a + "g_proj.weight").t().contiguous())
                lay.w_ab = nn.Parameter(torch.cat([g(a + "a_proj.weight"), g(a + "b_proj.weight")], 0).t().contiguous())
                lay.rate = nn.Parameter(g(a + "A_log").exp())
                lay.dt_bias = nn.Parameter(g(a + "dt_bias"))
                lay.out_gain = nn.Parameter(g(a + "o_norm.weight"))
                lay.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            self.layers.append(lay)

    # ---------------- attention ----------------
    def _rope(self, x, pos):
        bug = BUG
        hd = self.hd
        inv = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = pos[:, None, :, None].float() * inv  # (B, 1, T, hd/2)
        if bug == "oh_rope_interleaved":
            x1, x2 = x[..., 0::2], x[..., 1::2]
            c, s = ang.cos(), ang.sin()
            return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    def _attn(self, lay, x, pos, keep):
        bug = BUG
        B, T, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q, k, v = (x @ lay.w_qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        if bug == "oh_qk_norm_per_head":
            q = _rms(q.view(B, T, nq, hd), lay.q_gain.view(nq, hd), self.eps)
            k = _rms(k.view(B, T, nkv, hd), lay.k_gain.view(nkv, hd), self.eps)
        else:
            q, k = _rms(q, lay.q_gain, self.eps), _rms(k, lay.k_gain, self.eps)
        q = q.reshape(B, T, nq, hd).transpose(1, 2)
        k = k.reshape(B, T, nkv, hd).transpose(1, 2)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        if self.theta is not None and bug != "oh_rope_skipped":
            q, k = self._rope(q, pos), self._rope(k, pos)
        rep = nq // nkv
        if bug == "oh_gqa_grouped":
            s = (q.view(B, nkv, rep, T, hd) @ k[:, :, None].transpose(-1, -2)) / math.sqrt(hd)
            s = s.masked_fill(~keep[:, None, None], torch.finfo(s.dtype).min)
            o = (s.softmax(-1) @ v[:, :, None]).view(B, nq, T, hd)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            if bug == "oh_sdpa":
                eye = torch.eye(T, dtype=torch.bool)[None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=(keep | eye)[:, None])
            else:
                s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                s = s.masked_fill(~keep[:, None], torch.finfo(s.dtype).min)
                o = s.softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, T, nq * hd) @ lay.w_o

    # ---------------- gated deltanet ----------------
    def _gdn(self, lay, x, mask):
        bug = BUG
        B, T, _ = x.shape
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        Kd, Vd = nk * dk, nv * dv
        if mask is not None and bug != "oh_pad_no_input_mask":
            x = x * mask[:, :, None]
        qkv = x @ lay.w_qkv
        K = lay.conv.shape[1]
        qkv = F.conv1d(F.pad(qkv.transpose(1, 2), (K - 1, 0)), lay.conv[:, None], groups=qkv.shape[-1])
        qkv = F.silu(qkv.transpose(1, 2))
        q, k, v = qkv.split([Kd, Kd, Vd], -1)
        q, k, v = q.view(B, T, nk, dk), k.view(B, T, nk, dk), v.view(B, T, nv, dv)
        if bug == "oh_gdn_heads_tiled":
            q, k = q.repeat(1, 1, nv // nk, 1), k.repeat(1, 1, nv // nk, 1)
        else:
            q, k = q.repeat_interleave(nv // nk, 2), k.repeat_interleave(nv // nk, 2)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
        if bug != "oh_gdn_k_no_l2norm":
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        at, bt = (x @ lay.w_ab).split([nv, nv], -1)
        if bug == "oh_beta_tanh":
            beta = 1.0 + torch.tanh(bt / 2) if self.neg_eig else torch.sigmoid(bt)
        else:
            beta = torch.sigmoid(bt)
            if self.neg_eig and bug != "oh_beta_no_neg_eigval":
                beta = beta * 2.0
        dtb = 0.0 if bug == "oh_gdn_dt_bias_missing" else lay.dt_bias
        logd = -lay.rate * F.softplus(at + dtb)  # (B, T, nv)
        if bug == "oh_chunked":
            o = self._delta_chunked(q, k, v, beta, logd, 8)
        else:
            S = torch.zeros(B, nv, dk, dv)
            outs = []
            for t in range(T):
                dec = logd[:, t, :, None, None].exp()
                if bug == "oh_gdn_decay_after_update":
                    d = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
                    S = (S + k[:, t, :, :, None] * d[:, :, None, :]) * dec
                else:
                    S = S * dec
                    d = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
                    S = S + k[:, t, :, :, None] * d[:, :, None, :]
                outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
            o = torch.stack(outs, 1)  # (B, T, nv, dv)
        gate = (x @ lay.w_gate).view(B, T, nv, dv)
        act = torch.sigmoid(gate) if bug == "oh_gdn_gate_sigmoid" else F.silu(gate)
        if bug == "oh_gdn_norm_all_heads":
            o = _rms(o.reshape(B, T, Vd), lay.out_gain.repeat(nv), 1e-5).view(B, T, nv, dv) * act
        else:
            o = _rms(o, lay.out_gain, 1e-5) * act
        return o.reshape(B, T, Vd) @ lay.w_o

    @staticmethod
    def _delta_chunked(q, k, v, beta, logd, C):
        # within a chunk (cumulative log-decay c_t, start state S0), with deltas d_s:
        #   d_t = beta_t (v_t - e^{c_t} S0^T k_t - sum_{s<t} e^{c_t - c_s} (k_t . k_s) d_s)
        #   o_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t . k_s) d_s
        B, T, H, dk = k.shape
        S = torch.zeros(B, H, dk, v.shape[-1])
        outs = []
        for s0 in range(0, T, C):
            sl = slice(s0, min(s0 + C, T))
            qc, kc, vc = (t[:, sl].transpose(1, 2) for t in (q, k, v))
            bc = beta[:, sl].transpose(1, 2)
            cc = logd[:, sl].transpose(1, 2).cumsum(-1)
            L = qc.shape[2]
            low = torch.ones(L, L, dtype=torch.bool).tril()
            dec = (cc[..., :, None] - cc[..., None, :]).masked_fill(~low, -1e30).exp()
            A = bc[..., None] * (kc @ kc.transpose(-1, -2)) * dec * torch.ones(L, L).tril(-1)
            rhs = bc[..., None] * (vc - cc.exp()[..., None] * (kc @ S))
            d = torch.linalg.solve_triangular(A + torch.eye(L), rhs, upper=False, unitriangular=True)
            outs.append((cc.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * dec) @ d).transpose(1, 2))
            last = cc[..., -1:]
            S = last.exp()[..., None] * S + (kc * (last - cc).exp()[..., None]).transpose(-1, -2) @ d
        return torch.cat(outs, 1)

    def _mlp(self, lay, x):
        gt, up = (x @ lay.mlp_w13).chunk(2, -1)
        return (F.silu(gt) * up) @ lay.mlp_w2

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = BUG
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        km = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        keep = torch.ones(T, T, dtype=torch.bool).tril()[None]
        if bug != "oh_pad_key_mask_ignored":
            keep = keep & km[:, None, :]
        mask = None if attention_mask is None else km.float()
        h = self.emb[input_ids]
        for kind, lay in zip(self.kinds, self.layers):
            if kind == "full_attention":
                if bug == "oh_attn_prenorm":
                    h = h + self._attn(lay, _rms(h, lay.post_attn_gain, self.eps), position_ids, keep)
                else:
                    h = h + _rms(self._attn(lay, h, position_ids, keep), lay.post_attn_gain, self.eps)
                h = h + _rms(self._mlp(lay, h), lay.post_mlp_gain, self.eps)
            else:
                h = h + self._gdn(lay, _rms(h, lay.pre_mix_gain, self.eps), mask)
                if bug == "oh_linear_mlp_postnorm":
                    h = h + _rms(self._mlp(lay, h), lay.pre_mlp_gain, self.eps)
                else:
                    h = h + self._mlp(lay, _rms(h, lay.pre_mlp_gain, self.eps))
        return (_rms(h, self.final_gain, self.eps) @ self.unemb).float()


def build(state_dict, config):
    return OlmoHybridPort(state_dict, config).eval()
