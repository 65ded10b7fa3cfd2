"""Hand-written plain-PyTorch port of Jamba (JambaForCausalLM): a hybrid of Mamba-1 mixers and attention layers,
with mixture-of-experts MLPs on some layers.

Architecture as this port implements it:
- token embedding (no scaling); untied lm_head; final RMSNorm (gain * x / rms, eps = config.rms_norm_eps).
- layer i is an attention layer when i % attn_layer_period == attn_layer_offset, else a Mamba layer; its MLP is a
  sparse MoE when i % expert_layer_period == expert_layer_offset, else a dense SwiGLU MLP. Every layer is pre-norm:
    h = h + Mixer(RMSNorm(h));  h = h + FFN(RMSNorm(h))
- attention: GQA (head_dim = hidden / heads), no biases, and NO positional encoding at all (no RoPE: the Mamba layers
  carry the order); causal softmax(q k^T / sqrt(hd)) v with padded keys masked.
- Mamba mixer (d_inner = expand * hidden, N = d_state, R = dt_rank):
    x = x * pad_mask;  [u | z] = x W_in (+ b_in)
    u = silu(causal depthwise conv1d(u) + conv_bias);  u = u * pad_mask   (padding zeroed before conv and scan)
    [dt | B | C] = u W_x  (split R, N, N);  dt, B, C each pass an RMSNorm of their own (Jamba's addition)
    dt = softplus(dt W_dt + b_dt);  A = -exp(A_log)
    h_t = exp(dt_t A) * h_{t-1} + dt_t B_t u_t   (simplified Euler discretisation of B);  y_t = C_t . h_t
    y = (y + D * u) * silu(z);  out = y W_out (+ b_out)
- MoE: router softmax over all experts (float), the top num_experts_per_tok kept with their probabilities NOT
  renormalised; each expert is a SwiGLU MLP, its fused gate_up weight holds [gate; up].
Weight layout of this port (own names, all matrices stored input-major, i.e. transposed from nn.Linear):
- emb (V, H); head_t (H, V); fin (H,).
- layer `layers[i]`: n_mix / n_ff (H,) norm gains.
  Mamba: w_in (H, 2 Di) = [u | z]; b_in (2 Di,); taps (K, Di) conv kernel, taps[j] multiplies u[t - (K-1) + j];
  conv_b (Di,); w_x (Di, R + 2N); g_dt (R,), g_b (N,), g_c (N,); w_dt (R, Di), b_dt (Di,);
  A (Di, N) = -exp(A_log) precomputed at load; D (Di,); w_out (Di, H), b_out (H,).
  attention: w_qkv (H, (nq + 2 nkv) hd) fused; w_o (nq hd, H).
  dense MLP: w_gu (H, 2I) = [gate | up]; w_dn (I, H).  MoE: w_rt (H, E); e_gu (E, H, 2I) = [gate | up]; e_dn (E, I, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "jamba_no_ssm_norms",  # dt / B / C RMSNorms skipped (ported as a plain Mamba-1 mixer)
    "jamba_xproj_split_order",  # x_proj output split as [B, C, dt] instead of [dt, B, C]
    "jamba_A_no_exp",  # A taken as -A_log at load: the exp of A = -exp(A_log) is missing
    "jamba_dt_bias_twice",  # dt_proj bias added in the projection and again before the softplus
    "jamba_xz_swapped",  # in_proj halves swapped at load: first half used as the gate z, second as the input u
    "jamba_conv_taps_flipped",  # depthwise conv kernel reversed when converted to the port's tap layout
    "jamba_zoh_B",  # B discretised with zero-order hold ((exp(dt A) - 1) / A * B) instead of Mamba's dt * B
    "jamba_C_old_state",  # scan reads y_t = C_t . h_{t-1}: output taken before the state update
    "jamba_D_after_gate",  # D skip added after the silu(z) gate instead of before it
    "jamba_attn_rope",  # RoPE (theta 10000) applied to q / k in the attention layers, which have no RoPE
    "jamba_moe_renorm",  # top-k routing weights renormalised to sum 1 (Mixtral style); Jamba keeps them raw
    "jamba_expert_gate_up_swapped",  # experts' fused gate_up split as [up; gate] at load
    "jamba_pad_before_conv",  # padding not zeroed before in_proj / conv: pad embeddings leak into the conv window
    "jamba_pad_before_scan",  # padding not zeroed after the conv: silu(conv bias) at pads enters the SSM state
]
PADDING_ONLY = {"jamba_pad_before_conv", "jamba_pad_before_scan"}
CLEAN = [
    "jamba_sdpa",  # attention through F.scaled_dot_product_attention with the additive float mask
    "jamba_parallel_scan",  # SSM as a closed form: cumulative log-decay, (T, S) decay matrix, no recurrence
    "jamba_dense_experts",  # every expert evaluated, combined with a dense scattered (N, E) weight matrix
    "jamba_conv_unrolled",  # causal conv as an explicit sum over shifted taps instead of F.conv1d
    "jamba_norm_folded",  # pre-mixer / pre-FFN RMSNorm gains folded into the following projections at load
]


def _rms(x, g, eps):
    x = x.float()
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class JambaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.H = cfg.hidden_size
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = self.H // self.nq
        self.eps = cfg.rms_norm_eps
        self.topk = cfg.num_experts_per_tok
        self.R, self.N = cfg.mamba_dt_rank, cfg.mamba_d_state
        self.emb = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("model.final_layernorm.weight"))
        fold = BUG == "jamba_norm_folded"
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            L = nn.Module()
            L.attn = i % cfg.attn_layer_period == cfg.attn_layer_offset
            L.moe = i % cfg.expert_layer_period == cfg.expert_layer_offset
            n_mix, n_ff = g(p + "input_layernorm.weight"), g(p + "pre_ff_layernorm.weight")
            if L.attn:
                a = p + "self_attn."
                w_qkv = torch.cat([g(a + f"{n}_proj.weight") for n in "qkv"], 0).t()
                L.w_qkv = nn.Parameter((w_qkv * n_mix[:, None] if fold else w_qkv).contiguous())
                L.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            else:
                m = p + "mamba."
                w_in = g(m + "in_proj.weight")  # (2 Di, H): rows [u; z]
                di = w_in.shape[0] // 2
                b_in = g(m + "in_proj.bias") if m + "in_proj.bias" in sd else torch.zeros(2 * di)
                if BUG == "jamba_xz_swapped":
                    w_in, b_in = torch.cat([w_in[di:], w_in[:di]]), torch.cat([b_in[di:], b_in[:di]])
                w_in = w_in.t()
                L.w_in = nn.Parameter((w_in * n_mix[:, None] if fold else w_in).contiguous())
                L.b_in = nn.Parameter(b_in)
                taps = g(m + "conv1d.weight")[:, 0, :].t()  # (K, Di)
                if BUG == "jamba_conv_taps_flipped":
                    taps = taps.flip(0)
                L.taps = nn.Parameter(taps.contiguous())
                L.conv_b = nn.Parameter(g(m + "conv1d.bias") if m + "conv1d.bias" in sd else torch.zeros(di))
                L.w_x = nn.Parameter(g(m + "x_proj.weight").t().contiguous())
                L.g_dt = nn.Parameter(g(m + "dt_layernorm.weight"))
                L.g_b = nn.Parameter(g(m + "b_layernorm.weight"))
                L.g_c = nn.Parameter(g(m + "c_layernorm.weight"))
                L.w_dt = nn.Parameter(g(m + "dt_proj.weight").t().contiguous())
                L.b_dt = nn.Parameter(g(m + "dt_proj.bias"))
                a_log = g(m + "A_log")
                L.A = nn.Parameter(-a_log if BUG == "jamba_A_no_exp" else -torch.exp(a_log))
                L.D = nn.Parameter(g(m + "D"))
                L.w_out = nn.Parameter(g(m + "out_proj.weight").t().contiguous())
                L.b_out = nn.Parameter(g(m + "out_proj.bias") if m + "out_proj.bias" in sd else torch.zeros(self.H))
            f = p + "feed_forward."
            if L.moe:
                w_rt = g(f + "router.weight").t()
                e_gu = g(f + "experts.gate_up_proj")  # (E, 2I, H): rows [gate; up]
                if BUG == "jamba_expert_gate_up_swapped":
                    e_gu = torch.cat(e_gu.chunk(2, 1)[::-1], 1)
                e_gu = e_gu.transpose(1, 2)
                if fold:
                    w_rt, e_gu = w_rt * n_ff[:, None], e_gu * n_ff[None, :, None]
                L.w_rt = nn.Parameter(w_rt.contiguous())
                L.e_gu = nn.Parameter(e_gu.contiguous())
                L.e_dn = nn.Parameter(g(f + "experts.down_proj").transpose(1, 2).contiguous())
            else:
                w_gu = torch.cat([g(f + "gate_proj.weight"), g(f + "up_proj.weight")], 0).t()
                L.w_gu = nn.Parameter((w_gu * n_ff[:, None] if fold else w_gu).contiguous())
                L.w_dn = nn.Parameter(g(f + "down_proj.weight").t().contiguous())
            L.n_mix = nn.Parameter(torch.ones_like(n_mix) if fold else n_mix)
            L.n_ff = nn.Parameter(torch.ones_like(n_ff) if fold else n_ff)
            self.layers.append(L)

    # ---- attention (no positional encoding) ----
    def _rope(self, x, pos):
        half = self.hd // 2
        inv = 1.0 / (10000.0 ** (torch.arange(0, half, dtype=torch.float32) / half))
        ang = pos[..., None].float() * inv  # (B, S, hd/2)
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    def _attn(self, L, x, bias, pos):
        B, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q, k, v = (x @ L.w_qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        q = q.view(B, S, nq, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        if BUG == "jamba_attn_rope":
            q, k = self._rope(q, pos), self._rope(k, pos)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if BUG == "jamba_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
        else:
            sc = q @ k.transpose(-1, -2) / math.sqrt(hd) + bias[:, None]
            o = sc.softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, S, nq * hd) @ L.w_o

    # ---- Mamba mixer ----
    def _conv(self, L, u):  # u (B, S, Di), causal depthwise
        K = L.taps.shape[0]
        if BUG == "jamba_conv_unrolled":
            S = u.shape[1]
            up = F.pad(u, (0, 0, K - 1, 0))
            return sum(L.taps[j] * up[:, j : j + S] for j in range(K)) + L.conv_b
        w = L.taps.t()[:, None, :]  # (Di, 1, K)
        y = F.conv1d(u.transpose(1, 2), w, L.conv_b, padding=K - 1, groups=u.shape[-1])
        return y[..., : u.shape[1]].transpose(1, 2)

    def _scan(self, dA_log, dBu, C):  # (B, S, Di, N), (B, S, Di, N), (B, S, N) -> (B, S, Di)
        B, S, Di, N = dBu.shape
        if BUG == "jamba_parallel_scan":
            cum = dA_log.cumsum(1)  # (B, S, Di, N)
            diff = cum[:, :, None] - cum[:, None, :]  # (B, T, S, Di, N): log decay from s to t
            causal = torch.ones(S, S, dtype=torch.bool).tril()[None, :, :, None, None]
            decay = diff.masked_fill(~causal, float("-inf")).exp()
            h = (decay * dBu[:, None]).sum(2)  # (B, T, Di, N)
            return (h * C[:, :, None, :]).sum(-1)
        dA = dA_log.exp()
        h = torch.zeros(B, Di, N)
        ys = []
        for t in range(S):
            if BUG == "jamba_C_old_state":
                ys.append((h * C[:, t, None, :]).sum(-1))
            h = dA[:, t] * h + dBu[:, t]
            if BUG != "jamba_C_old_state":
                ys.append((h * C[:, t, None, :]).sum(-1))
        return torch.stack(ys, 1)

    def _mamba(self, L, x, m):
        di = L.D.shape[0]
        if BUG != "jamba_pad_before_conv":
            x = x * m
        u, z = (x @ L.w_in + L.b_in).split(di, -1)
        u = F.silu(self._conv(L, u))
        if BUG != "jamba_pad_before_scan":
            u = u * m
        R, N = self.R, self.N
        if BUG == "jamba_xproj_split_order":
            Bm, C, dt = (u @ L.w_x).split([N, N, R], -1)
        else:
            dt, Bm, C = (u @ L.w_x).split([R, N, N], -1)
        if BUG != "jamba_no_ssm_norms":
            dt, Bm, C = _rms(dt, L.g_dt, self.eps), _rms(Bm, L.g_b, self.eps), _rms(C, L.g_c, self.eps)
        dt = dt @ L.w_dt
        if BUG == "jamba_dt_bias_twice":
            dt = dt + L.b_dt
        dt = F.softplus(dt + L.b_dt)  # (B, S, Di)
        dA_log = dt[..., None] * L.A  # (B, S, Di, N)
        if BUG == "jamba_zoh_B":
            dB = (dA_log.exp() - 1) / L.A * Bm[:, :, None, :]
        else:
            dB = dt[..., None] * Bm[:, :, None, :]
        y = self._scan(dA_log, dB * u[..., None], C)
        if BUG == "jamba_D_after_gate":
            y = y * F.silu(z) + u * L.D
        else:
            y = (y + u * L.D) * F.silu(z)
        return y @ L.w_out + L.b_out

    # ---- feed-forward ----
    def _moe(self, L, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        probs = (t @ L.w_rt).softmax(-1)
        w, idx = probs.topk(self.topk, -1)
        if BUG == "jamba_moe_renorm":
            w = w / w.sum(-1, keepdim=True)
        E = L.e_gu.shape[0]
        if BUG == "jamba_dense_experts":
            gt, up = torch.einsum("nh,ehi->nei", t, L.e_gu).chunk(2, -1)
            outs = torch.einsum("nei,eih->neh", F.silu(gt) * up, L.e_dn)
            dense = torch.zeros(t.shape[0], E).scatter(1, idx, w)
            return (dense[..., None] * outs).sum(1).view(B, S, H)
        out = torch.zeros_like(t)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gt, up = (t[tok] @ L.e_gu[e]).chunk(2, -1)
            out.index_add_(0, tok, ((F.silu(gt) * up) @ L.e_dn[e]) * w[tok, slot, None])
        return out.view(B, S, H)

    def _mlp(self, L, x):
        gt, up = (x @ L.w_gu).chunk(2, -1)
        return (F.silu(gt) * up) @ L.w_dn

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        keep = attention_mask.bool()
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & keep[:, None, :]
        bias = torch.zeros(B, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
        m = keep.float()[..., None]
        h = self.emb[input_ids]
        for L in self.layers:
            x = _rms(h, L.n_mix, self.eps)
            h = h + (self._attn(L, x, bias, position_ids) if L.attn else self._mamba(L, x, m))
            x = _rms(h, L.n_ff, self.eps)
            h = h + (self._moe(L, x) if L.moe else self._mlp(L, x))
        return _rms(h, self.fin, self.eps) @ self.head_t


def build(state_dict, config):
    return JambaPort(state_dict, config).eval()
