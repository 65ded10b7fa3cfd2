"""Hand-written plain-PyTorch port of Falcon-H1 (FalconH1ForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
- * token embedding times embedding_multiplier; untied lm_head, * logits times lm_head_multiplier;
  final RMSNorm (final_layernorm).
- * every layer is "hybrid", attention and a Mamba2 mixer SIDE BY SIDE on the same normed input:
    n = RMSNorm(x);  x = x + ssm_out_multiplier * Mamba(n) + attention_out_multiplier * Attn(attention_in_multiplier * n)
    x = x + MLP(RMSNorm(x))   (pre_ff_layernorm)
- attention: GQA, head_dim = hidden/heads, rotate-half RoPE (rope_theta), * keys times key_multiplier,
  softmax(q k^T / sqrt(head_dim)), causal + key-padding mask, no biases.
- * Mamba2 mixer: input zeroed at padding, times ssm_in_multiplier; in_proj -> [z | x B C | dt], each slice
  * times its muP multiplier (ssm_multipliers = [z, x, B, C, dt]); depthwise causal conv1d (with bias) + SiLU
  over [x B C], result zeroed at padding again; dt = clamp(softplus(dt + dt_bias), time_step_limit),
  A = -exp(A_log) per head; per head state h (head_dim x d_state), B/C shared per group
  (head h uses group h // (heads / groups)):  h = exp(dt A) h + dt x B^T;  y = h C + D x;
  * output y * silu(z) THEN grouped RMSNorm (mamba_rms_norm, norm_before_gate=False, n_groups groups over
  d_ssm, eps rms_norm_eps); out_proj.
- * MLP: down(up(x) * silu(gate(x) * mlp_multipliers[0])) * mlp_multipliers[1].
Weight layout of this port (own names):
- embed (V, H) with embedding_multiplier folded in; unembed (H, V) transposed lm_head with
  lm_head_multiplier folded in; norm_f (H,).
- per layer `L[i]`: ln_in, ln_ff (H,); attn_qkv (H, (nq + 2 nkv) hd) fused+transposed with key_multiplier
  folded into the k columns; attn_out (nq hd, H) transposed with attention_out_multiplier folded in;
  ssm_in (H, 2 d_ssm + 2 G N + nh) transposed with the muP vector folded into its columns;
  conv_w (C, K) squeezed, conv_b (C,); dt_bias, A_neg (= -exp(A_log)), Dskip (nh,); ssm_norm (d_ssm,);
  ssm_out (d_ssm, H) transposed with ssm_out_multiplier folded in;
  mlp_gu (H, 2I) = [gate * mlp_multipliers[0] | up] fused, transposed; mlp_down (I, H) with mlp_multipliers[1].
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "fh_key_mult_twice",  # key_multiplier folded into k_proj at load AND applied again at runtime
    "fh_attn_in_mult_shared",  # attention_in_multiplier applied to the shared normed input (mamba gets it too)
    "fh_ssm_mult_zx_swapped",  # ssm_multipliers read as [x, z, ...]: z and x slices get each other's factor
    "fh_mup_dt_missing",  # dt slice's muP multiplier (ssm_multipliers[4]) left out
    "fh_lm_head_mult_missing",  # lm_head_multiplier never applied
    "fh_embed_mult_missing",  # embedding_multiplier never applied
    "fh_mlp_mult_after_act",  # gate multiplier applied after SiLU instead of before
    "fh_norm_before_gate",  # gated norm normalises first then gates (config says gate first)
    "fh_norm_one_group",  # gated RMSNorm statistics over all of d_ssm instead of per group
    "fh_dt_no_softplus",  # dt + dt_bias used without softplus
    "fh_D_missing",  # D skip connection (D * x) left out
    "fh_B_group_tiled",  # head h reads B/C group h % groups instead of h // (heads / groups)
    "fh_pad_no_post_conv_mask",  # conv output not re-zeroed at padding (conv bias leaks into the state)
]
PADDING_ONLY = {"fh_pad_no_post_conv_mask"}
CLEAN = [
    "fh_ssd_quadratic",  # Mamba2 as its quadratic (attention-like) SSD form, one masked decay matrix
    "fh_runtime_multipliers",  # no folding: every muP multiplier applied at runtime where Transformers does
    "fh_sdpa",  # attention via F.scaled_dot_product_attention
    "fh_conv_unfold",  # causal depthwise conv as an explicit sum of shifted inputs
    "fh_gqa_grouped",  # GQA without repeating kv: queries reshaped into (kv head, group) blocks
]


def _bug():
    return BUG


def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class FalconH1Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        g = lambda k: sd[k].detach().clone().float()
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // cfg.num_attention_heads
        self.theta = cfg.rope_parameters["rope_theta"]
        self.dssm = cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand * cfg.hidden_size)
        self.nh, self.ph, self.N, self.G = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups
        self.dt_lim = tuple(cfg.time_step_limit)
        self.m_emb, self.m_lm = cfg.embedding_multiplier, cfg.lm_head_multiplier
        self.m_key, self.m_ain, self.m_aout = (
            cfg.key_multiplier,
            cfg.attention_in_multiplier,
            cfg.attention_out_multiplier,
        )
        self.m_sin, self.m_sout = cfg.ssm_in_multiplier, cfg.ssm_out_multiplier
        self.m_gate, self.m_down = cfg.mlp_multipliers
        self.mup = self._mup_vector(cfg.ssm_multipliers)
        self.fold = _bug() != "fh_runtime_multipliers"
        fold = self.fold
        self.embed = nn.Parameter(g("model.embed_tokens.weight") * (self.m_emb if fold else 1.0))
        self.unembed = nn.Parameter(g("lm_head.weight").t().contiguous() * (self.m_lm if fold else 1.0))
        self.norm_f = nn.Parameter(g("model.final_layernorm.weight"))
        # (head counts read where each block needs them)
        self.L = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            l = nn.Module()
            l.ln_in = nn.Parameter(g(p + "input_layernorm.weight"))
            l.ln_ff = nn.Parameter(g(p + "pre_ff_layernorm.weight"))
            wk = g(p + "self_attn.k_proj.weight") * (self.m_key if fold else 1.0)
            l.attn_qkv = nn.Parameter(
                torch.cat([g(p + "self_attn.q_proj.weight"), wk, g(p + "self_attn.v_proj.weight")], 0).t().contiguous()
            )
            l.attn_out = nn.Parameter(
                g(p + "self_attn.o_proj.weight").t().contiguous() * (self.m_aout if fold else 1.0)
            )
            l.ssm_in = nn.Parameter(g(p + "mamba.in_proj.weight").t().contiguous() * (self.mup if fold else 1.0))
            l.conv_w = nn.Parameter(g(p + "mamba.conv1d.weight").squeeze(1))
            l.conv_b = nn.Parameter(g(p + "mamba.conv1d.bias"))
            l.dt_bias = nn.Parameter(g(p + "mamba.dt_bias"))
            l.A_neg = nn.Parameter(-g(p + "mamba.A_log").exp())
            l.Dskip = nn.Parameter(g(p + "mamba.D"))
            l.ssm_norm = nn.Parameter(g(p + "mamba.norm.weight"))
            l.ssm_out = nn.Parameter(g(p + "mamba.out_proj.weight").t().contiguous() * (self.m_sout if fold else 1.0))
            wg = g(p + "feed_forward.gate_proj.weight") * (
                self.m_gate if fold and _bug() != "fh_mlp_mult_after_act" else 1.0
            )
            l.mlp_gu = nn.Parameter(torch.cat([wg, g(p + "feed_forward.up_proj.weight")], 0).t().contiguous())
            l.mlp_down = nn.Parameter(
                g(p + "feed_forward.down_proj.weight").t().contiguous() * (self.m_down if fold else 1.0)
            )
            self.L.append(l)

    def _mup_vector(self, m):
        bug = _bug()
        m = list(m)
        if bug == "fh_ssm_mult_zx_swapped":
            m[0], m[1] = m[1], m[0]
        if bug == "fh_mup_dt_missing":
            m[4] = 1.0
        d, gn, nh = self.dssm, self.G * self.N, self.nh
        sizes = [d, d, gn, gn, nh]
        return torch.cat([torch.full((s,), float(f)) for s, f in zip(sizes, m)])

    # ---------------- attention ----------------
    def _attn(self, l, x, fr, keep):
        bug = _bug()
        B, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q, k, v = (x @ l.attn_qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        q = q.view(B, S, nq, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        if not self.fold or bug == "fh_key_mult_twice":
            k = k * self.m_key
        emb = torch.cat((fr, fr), -1)[:, None]
        rot = lambda t: t * emb.cos() + torch.cat((-t[..., hd // 2 :], t[..., : hd // 2]), -1) * emb.sin()
        q, k = rot(q), rot(k)
        rep = nq // nkv
        if bug == "fh_gqa_grouped":
            qg = q.view(B, nkv, rep, S, hd)
            sc = (qg @ k[:, :, None].transpose(-1, -2)) / math.sqrt(hd)
            sc = sc.masked_fill(~keep[:, None, None], torch.finfo(sc.dtype).min)
            o = (sc.softmax(-1) @ v[:, :, None]).view(B, nq, S, hd)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            if bug == "fh_sdpa":
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
            else:
                sc = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                sc = sc.masked_fill(~keep[:, None], torch.finfo(sc.dtype).min)
                o = sc.softmax(-1) @ v
        o = o.transpose(1, 2).reshape(B, S, nq * hd) @ l.attn_out
        return o if self.fold else o * self.m_aout

    # ---------------- mamba2 ----------------
    def _mamba(self, l, x, mask2d):
        bug = _bug()
        B, S, _ = x.shape
        d, G, N, nh, ph = self.dssm, self.G, self.N, self.nh, self.ph
        if mask2d is not None:
            x = x * mask2d[:, :, None]
        x = x * self.m_sin
        zxbcdt = x @ l.ssm_in
        if not self.fold:
            zxbcdt = zxbcdt * self.mup
        z, xbc, dt = zxbcdt.split([d, d + 2 * G * N, nh], -1)
        K = l.conv_w.shape[1]
        if bug == "fh_conv_unfold":
            xp = F.pad(xbc, (0, 0, K - 1, 0))
            xbc = sum(xp[:, j : j + S] * l.conv_w[:, j] for j in range(K)) + l.conv_b
        else:
            xbc = F.conv1d(xbc.transpose(1, 2), l.conv_w[:, None], l.conv_b, padding=K - 1, groups=xbc.shape[-1])[
                ..., :S
            ].transpose(1, 2)
        xbc = F.silu(xbc)
        if mask2d is not None and bug != "fh_pad_no_post_conv_mask":
            xbc = xbc * mask2d[:, :, None]
        xs, Bm, Cm = xbc.split([d, G * N, G * N], -1)
        xs = xs.view(B, S, nh, ph)
        Bm, Cm = Bm.view(B, S, G, N), Cm.view(B, S, G, N)
        if bug == "fh_B_group_tiled":
            Bm, Cm = Bm.repeat(1, 1, nh // G, 1), Cm.repeat(1, 1, nh // G, 1)
        else:
            Bm, Cm = Bm.repeat_interleave(nh // G, 2), Cm.repeat_interleave(nh // G, 2)
        dt = dt + l.dt_bias
        if bug != "fh_dt_no_softplus":
            dt = F.softplus(dt)
        dt = dt.clamp(self.dt_lim[0], self.dt_lim[1])
        if bug == "fh_ssd_quadratic":
            y = self._ssd(xs, dt, l.A_neg, Bm, Cm)
        else:
            st = torch.zeros(B, nh, ph, N)
            ys = []
            for t in range(S):
                dA = torch.exp(dt[:, t] * l.A_neg)[:, :, None, None]
                st = st * dA + (dt[:, t, :, None] * xs[:, t])[..., None] * Bm[:, t, :, None, :]
                ys.append((st * Cm[:, t, :, None, :]).sum(-1))
            y = torch.stack(ys, 1)
        if bug != "fh_D_missing":
            y = y + l.Dskip[:, None] * xs
        y = y.reshape(B, S, d)
        gate = F.silu(z)
        ng = 1 if bug == "fh_norm_one_group" else G
        if bug == "fh_norm_before_gate":
            y = _rms(y.view(B, S, ng, d // ng), l.ssm_norm.view(ng, d // ng), self.eps).view(B, S, d) * gate
        else:
            y = y * gate
            y = _rms(y.view(B, S, ng, d // ng), l.ssm_norm.view(ng, d // ng), self.eps).view(B, S, d)
        out = y @ l.ssm_out
        return out if self.fold else out * self.m_sout

    @staticmethod
    def _ssd(xs, dt, A, Bm, Cm):
        # y_t = sum_{s<=t} (C_t . B_s) exp(sum_{s<r<=t} dt_r A) dt_s x_s
        S = xs.shape[1]
        la = (dt * A).cumsum(1)  # (B, S, nh)
        seg = la[:, :, None, :] - la[:, None, :, :]  # (B, t, s, nh)
        low = torch.ones(S, S, dtype=torch.bool).tril()
        Lm = seg.masked_fill(~low[None, :, :, None], float("-inf")).exp()
        CB = torch.einsum("bthn,bshn->btsh", Cm, Bm)
        return torch.einsum("btsh,bsh,bshp->bthp", CB * Lm, dt, xs)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        km = torch.ones(B, S, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        keep = torch.ones(S, S, dtype=torch.bool).tril()[None] & km[:, None, :]
        mask2d = None if bool(km.all()) else km.float()
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        fr = position_ids[..., None].float() * inv
        h = self.embed[input_ids]
        if not self.fold:
            h = h * self.m_emb
        elif bug == "fh_embed_mult_missing":
            h = h / self.m_emb
        for l in self.L:
            n = _rms(h, l.ln_in, self.eps)
            if bug == "fh_attn_in_mult_shared":
                n = n * self.m_ain
                mix = self._mamba(l, n, mask2d) + self._attn(l, n, fr, keep)
            else:
                mix = self._mamba(l, n, mask2d) + self._attn(l, n * self.m_ain, fr, keep)
            h = h + mix
            n = _rms(h, l.ln_ff, self.eps)
            gt, up = (n @ l.mlp_gu).chunk(2, -1)
            if bug == "fh_mlp_mult_after_act":
                a = F.silu(gt) * self.m_gate
            else:
                a = F.silu(gt if self.fold else gt * self.m_gate)
            y = (up * a) @ l.mlp_down
            h = h + (y if self.fold else y * self.m_down)
        logits = _rms(h, self.norm_f, self.eps) @ self.unembed
        if not self.fold:
            logits = logits * self.m_lm
        elif bug == "fh_lm_head_mult_missing":
            logits = logits / self.m_lm
        return logits.float()


def build(state_dict, config):
    return FalconH1Port(state_dict, config).eval()
