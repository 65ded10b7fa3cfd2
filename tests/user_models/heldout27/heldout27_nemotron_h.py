"""Hand-written plain-PyTorch port of Nemotron-H (NemotronHForCausalLM, NVIDIA hybrid Mamba2 / attention / MoE).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head; RMSNorm y = w * x / sqrt(mean(x^2) + layer_norm_epsilon);
  * ONE mixer per block, chosen by config.layers_block_type: h = h + Mixer(RMS(h)), one norm per block (no second
    residual inside a block); here [Mamba2 ("linear_attention"), MoE, attention ("full_attention"), MLP];
  * Mamba2 mixer (nh heads of hd, n_groups G, state N, I = nh hd):
      padded tokens zeroed before in_proj;  in_proj(x) = [z (I) | xBC (I + 2 G N) | dt (nh)];
      causal depthwise conv1d (kernel K, bias) over xBC, SiLU; padded tokens zeroed again; xBC = [x | B (G N) | C (G N)];
      dt = softplus(dt + dt_bias), clamped BELOW at config.time_step_min (Transformers' mixer uses
      (time_step_min, inf), NOT config.time_step_limit); A = -exp(A_log);
      head h reads B / C group h // (nh / G);  state S_h (hd, N):  S <- exp(dt A) S + dt x_t B_t^T;  y = S C_t + D x_t;
      gated GROUP RMSNorm: y * silu(z), RMS-normalised within each of G groups of I / G channels, times w; out_proj;
  * attention: plain GQA, NO positional encoding at all (no RoPE), scores * head_dim^-0.5;
  * MLP: down(relu(up(x))^2)  (relu2, no gate);
  * MoE: router logits in fp32, scores = sigmoid; choice = scores + e_score_correction_bias; group score = sum of
    the top-2 choice values of each of n_group groups, keep topk_group groups; top-k experts among them;
    weights = raw scores of the chosen experts, renormalised (+1e-20), times routed_scaling_factor;
    experts relu2 MLPs (no gate) + an always-on relu2 shared expert;
  - padding: HF-style 0/1 attention_mask masks attention keys (additive finfo.min) and zeroes the padded tokens'
    Mamba inputs (before in_proj and after the conv), so nothing of the padding enters the conv window or the state.
    Positions are unused (no RoPE).

Weight layout of this port (own names):
  tok (V, H); out (V, H) (F.linear layout); g_out (H,); blocks[i].g (H,);
  mamba: w_z (H, I), w_xbc (H, I + 2 G N), w_dt (H, nh) (all (in, out), split from in_proj);
         conv_w (C, K), conv_b (C,); dt_b (nh,); A (nh,) = -exp(A_log) precomputed; D (nh,); gn (I,); w_out (I, H);
  attention: w_qkv (nh hd + 2 nkv hd, H) F.linear layout rows [q | k | v]; w_o (nh hd, H) (in, out);
  MLP: w_up (H, I_mlp), w_dn (I_mlp, H) (in, out);
  MoE: w_r (E, H) fp32; e_bias (E,); w_up (E, H, Ie), w_dn (E, Ie, H) (in, out); s_up (H, Is), s_dn (Is, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "nh_dt_limit_from_config",  # dt clamped with config.time_step_limit (0, inf) instead of (time_step_min, inf)
    "nh_conv_no_silu",  # SiLU after the depthwise conv skipped
    "nh_norm_ungrouped",  # gated RMSNorm over all I channels instead of per group of I / n_groups
    "nh_gate_after_norm",  # silu(z) gate applied after the RMSNorm instead of before it
    "nh_D_skip_missing",  # D * x skip term left out of the SSM output
    "nh_groups_tiled",  # head h reads B / C group h % G instead of h // (nh / G)
    "nh_BC_swapped",  # xBC split read as [x | C | B] instead of [x | B | C]
    "nh_relu2_as_relu",  # MLP / expert activation relu instead of relu squared
    "nh_group_topk_ignored",  # router top-k over all experts, n_group / topk_group restriction ignored
    "nh_routed_scale_missing",  # routed_scaling_factor not applied to the expert weights
    "nh_bias_in_weights",  # expert weights gathered from the bias-corrected choice scores
    "nh_conv_pad_leak",  # padded tokens not zeroed before in_proj: their xBC enters the first real tokens' conv
    "nh_attn_pad_ignored",  # attention layers ignore attention_mask (causal only), pad keys attended
]
PADDING_ONLY = {"nh_conv_pad_leak", "nh_attn_pad_ignored"}
CLEAN = [
    "nh_ssd_quadratic",  # SSM computed in its quadratic ("attention") form over the whole sequence, no loop
    "nh_chunked",  # SSM in chunks of 5 (intra-chunk quadratic form + carried inter-chunk state)
    "nh_dense_experts",  # every expert run on every token, combined with a dense (T, E) weight matrix
    "nh_sdpa",  # attention via F.scaled_dot_product_attention with a boolean mask
    "nh_rowwise",  # a padded batch run row by row on its real tokens only
]


def _bug():
    return BUG


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _relu2(x):
    r = F.relu(x)
    return r if _bug() == "nh_relu2_as_relu" else r * r


class _Mamba(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.nh, self.hd, self.G, self.N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        self.I = self.nh * self.hd
        self.K = cfg.conv_kernel
        self.eps = cfg.layer_norm_epsilon
        self.dt_min = float(cfg.time_step_limit[0]) if _bug() == "nh_dt_limit_from_config" else cfg.time_step_min
        w = sd[p + "in_proj.weight"].t()
        conv_dim = self.I + 2 * self.G * self.N
        wz, wxbc, wdt = w.split([self.I, conv_dim, self.nh], 1)
        self.w_z, self.w_xbc, self.w_dt = (nn.Parameter(t.contiguous()) for t in (wz, wxbc, wdt))
        self.conv_w = nn.Parameter(sd[p + "conv1d.weight"][:, 0].clone())
        self.conv_b = nn.Parameter(sd[p + "conv1d.bias"].clone())
        self.dt_b = nn.Parameter(sd[p + "dt_bias"].clone())
        self.A = nn.Parameter(-torch.exp(sd[p + "A_log"].float()))
        self.D = nn.Parameter(sd[p + "D"].clone())
        self.gn = nn.Parameter(sd[p + "norm.weight"].clone())
        self.w_out = nn.Parameter(sd[p + "out_proj.weight"].t().contiguous())

    def _conv(self, u):  # u (B, S, C): causal depthwise conv, left zero padding
        S = u.shape[1]
        up = F.pad(u, (0, 0, self.K - 1, 0))
        out = self.conv_b.expand_as(u).clone()
        for k in range(self.K):
            out = out + up[:, k : k + S] * self.conv_w[:, k]
        return out

    def _scan_loop(self, x, dt, Bm, Cm):
        # x (B, S, nh, hd), dt (B, S, nh), Bm / Cm (B, S, nh, N)
        Bsz, S = x.shape[:2]
        st = x.new_zeros(Bsz, self.nh, self.hd, self.N)
        ys = []
        for t in range(S):
            dA = torch.exp(dt[:, t] * self.A)[..., None, None]
            st = st * dA + (dt[:, t, :, None] * x[:, t])[..., None] * Bm[:, t, :, None, :]
            ys.append(torch.einsum("bhpn,bhn->bhp", st, Cm[:, t]))
        return torch.stack(ys, 1)

    def _scan_quadratic(self, x, dt, Bm, Cm, st0=None):
        S = x.shape[1]
        a = dt * self.A  # (B, S, nh)
        cum = a.cumsum(1)
        seg = cum[:, :, None, :] - cum[:, None, :, :]  # (B, t, s, nh)
        tri = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        L = torch.exp(seg.masked_fill(~tri[None, :, :, None], float("-inf")))
        G = torch.einsum("bthn,bshn->btsh", Cm, Bm) * L
        y = torch.einsum("btsh,bsh,bshp->bthp", G, dt, x)
        if st0 is not None:
            y = y + torch.einsum("bthn,bhpn,bth->bthp", Cm, st0, torch.exp(cum))
        w_end = torch.exp(cum[:, -1:, :] - cum) * dt  # (B, S, nh)
        st = torch.einsum("bsh,bshp,bshn->bhpn", w_end, x, Bm)
        if st0 is not None:
            st = st + st0 * torch.exp(cum[:, -1])[..., None, None]
        return y, st

    def forward(self, h, pad):
        b = _bug()
        Bsz, S, _ = h.shape
        if pad is not None and b != "nh_conv_pad_leak":
            h = h * pad[:, :, None]
        z, xbc, dt = h @ self.w_z, h @ self.w_xbc, h @ self.w_dt
        xbc = self._conv(xbc)
        if b != "nh_conv_no_silu":
            xbc = F.silu(xbc)
        if pad is not None:
            xbc = xbc * pad[:, :, None]
        GN = self.G * self.N
        if b == "nh_BC_swapped":
            x, Cm, Bm = xbc.split([self.I, GN, GN], -1)
        else:
            x, Bm, Cm = xbc.split([self.I, GN, GN], -1)
        dt = F.softplus(dt + self.dt_b).clamp(min=self.dt_min)
        x = x.reshape(Bsz, S, self.nh, self.hd)
        Bm, Cm = Bm.reshape(Bsz, S, self.G, self.N), Cm.reshape(Bsz, S, self.G, self.N)
        rep = self.nh // self.G
        if b == "nh_groups_tiled":
            Bm, Cm = Bm.repeat(1, 1, rep, 1), Cm.repeat(1, 1, rep, 1)
        else:
            Bm, Cm = Bm.repeat_interleave(rep, 2), Cm.repeat_interleave(rep, 2)
        if b == "nh_ssd_quadratic":
            y, _ = self._scan_quadratic(x, dt, Bm, Cm)
        elif b == "nh_chunked":
            ys, st = [], None
            for s0 in range(0, S, 5):
                sl = slice(s0, s0 + 5)
                yc, st = self._scan_quadratic(x[:, sl], dt[:, sl], Bm[:, sl], Cm[:, sl], st)
                ys.append(yc)
            y = torch.cat(ys, 1)
        else:
            y = self._scan_loop(x, dt, Bm, Cm)
        if b != "nh_D_skip_missing":
            y = y + self.D[:, None] * x
        y = y.reshape(Bsz, S, self.I)
        gate = F.silu(z)
        if b != "nh_gate_after_norm":
            y = y * gate
        if b == "nh_norm_ungrouped":
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            yg = y.reshape(Bsz, S, self.G, self.I // self.G)
            y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(Bsz, S, self.I)
        y = self.gn * y
        if b == "nh_gate_after_norm":
            y = y * gate
        return y @ self.w_out


class _Attn(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.w_qkv = nn.Parameter(torch.cat([sd[p + n + "_proj.weight"] for n in ("q", "k", "v")], 0).contiguous())
        self.w_o = nn.Parameter(sd[p + "o_proj.weight"].t().contiguous())

    def forward(self, h, keep):
        Bsz, S, _ = h.shape
        q, k, v = F.linear(h, self.w_qkv).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q = q.view(Bsz, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(Bsz, S, self.nkv, self.hd).transpose(1, 2).repeat_interleave(self.nh // self.nkv, 1)
        v = v.view(Bsz, S, self.nkv, self.hd).transpose(1, 2).repeat_interleave(self.nh // self.nkv, 1)
        if _bug() == "nh_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            sc = (q @ k.transpose(-1, -2)) * self.hd**-0.5
            sc = sc.masked_fill(~keep, torch.finfo(sc.dtype).min)
            o = torch.softmax(sc, -1) @ v
        return o.transpose(1, 2).reshape(Bsz, S, -1) @ self.w_o


class _MLP(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.w_up = nn.Parameter(sd[p + "up_proj.weight"].t().contiguous())
        self.w_dn = nn.Parameter(sd[p + "down_proj.weight"].t().contiguous())

    def forward(self, h):
        return _relu2(h @ self.w_up) @ self.w_dn


class _MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.E, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.ng, self.tg = cfg.n_group, cfg.topk_group
        self.norm = cfg.norm_topk_prob
        self.scale = 1.0 if _bug() == "nh_routed_scale_missing" else float(cfg.routed_scaling_factor)
        self.w_r = nn.Parameter(sd[p + "gate.weight"].float().clone())
        self.register_buffer("e_bias", sd[p + "gate.e_score_correction_bias"].float().clone())
        self.w_up = nn.Parameter(sd[p + "experts.up_proj"].transpose(1, 2).contiguous())
        self.w_dn = nn.Parameter(sd[p + "experts.down_proj"].transpose(1, 2).contiguous())
        self.shared = _MLP(sd, p + "shared_experts.")

    def forward(self, h):
        b = _bug()
        shp = h.shape
        x = h.reshape(-1, shp[-1])
        scores = torch.sigmoid(x.float() @ self.w_r.t())
        choice = scores + self.e_bias
        if b != "nh_group_topk_ignored":
            grp = choice.view(-1, self.ng, self.E // self.ng).topk(2, -1).values.sum(-1)
            keep_g = torch.zeros_like(grp).scatter_(1, grp.topk(self.tg, -1).indices, 1.0).bool()
            keep_e = keep_g[:, :, None].expand(-1, -1, self.E // self.ng).reshape(-1, self.E)
            choice = choice.masked_fill(~keep_e, float("-inf"))
        idx = choice.topk(self.k, -1).indices
        wts = (choice if b == "nh_bias_in_weights" else scores).gather(1, idx)
        if self.norm:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * self.scale
        if b == "nh_dense_experts":
            dense = torch.zeros(x.shape[0], self.E).scatter_(1, idx, wts)
            hid = _relu2(torch.einsum("th,ehi->tei", x, self.w_up))
            out = torch.einsum("tei,eih,te->th", hid, self.w_dn, dense)
        else:
            out = torch.zeros_like(x)
            for e in range(self.E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                y = _relu2(x[tok] @ self.w_up[e]) @ self.w_dn[e]
                out.index_add_(0, tok, y * wts[tok, slot, None])
        return out.view(shp) + self.shared(h)


class NemotronHPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.eps = cfg.layer_norm_epsilon
        self.kinds = list(cfg.layers_block_type)
        self.tok = nn.Parameter(sd["model.embeddings.weight"].clone())
        self.out = nn.Parameter(sd["lm_head.weight"].clone())
        self.g_out = nn.Parameter(sd["model.norm_f.weight"].clone())
        self.blocks = nn.ModuleList()
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}.mixer."
            if kind == "linear_attention":
                m = _Mamba(sd, p, cfg)
            elif kind == "full_attention":
                m = _Attn(sd, p, cfg)
            elif kind == "moe":
                m = _MoE(sd, p, cfg)
            else:
                m = _MLP(sd, p)
            m.g = nn.Parameter(sd[f"model.layers.{i}.norm.weight"].clone())
            self.blocks.append(m)

    def _run(self, ids, mask):
        B, S = ids.shape
        x = self.tok[ids]
        keep = torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)
        pad = None
        if mask is not None:
            pad = mask.to(x.dtype)
            if _bug() != "nh_attn_pad_ignored":
                keep = keep & mask.bool()[:, None, None, :]
        for kind, m in zip(self.kinds, self.blocks):
            h = _rms(x, m.g, self.eps)
            if kind == "linear_attention":
                x = x + m(h, pad)
            elif kind == "full_attention":
                x = x + m(h, keep)
            else:
                x = x + m(h)
        return _rms(x, self.g_out, self.eps) @ self.out.t()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if _bug() == "nh_rowwise" and attention_mask is not None:
            out = torch.zeros(*input_ids.shape, self.out.shape[0])
            for r in range(input_ids.shape[0]):
                idx = attention_mask[r].bool().nonzero().squeeze(-1)
                out[r, idx] = self._run(input_ids[r : r + 1, idx], None)[0]
            return out
        return self._run(input_ids, attention_mask).float()


def build(state_dict, config):
    return NemotronHPort(state_dict, config).eval()
