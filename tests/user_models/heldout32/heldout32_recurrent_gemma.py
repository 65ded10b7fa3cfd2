"""Hand-written plain-PyTorch port of RecurrentGemma / Griffin (RecurrentGemmaForCausalLM).

Architecture as this port implements it:
- token embedding times sqrt(hidden_size) *rounded to bfloat16* (the reference keeps that constant in bf16);
  the lm_head is the embedding matrix (tied); logits are soft-capped: cap * tanh(logits / cap),
  cap = config.logits_soft_cap.
- RMSNorm Gemma style: x / sqrt(mean(x^2) + eps) * (1 + w); this port folds the "+1" into the gain at load.
- residual block (every layer):  h = h + Temporal(Norm(h));  h = h + MLP(Norm(h)).
  The temporal block of layer i is config.block_types[i % len(block_types)] ("recurrent" or "attention").
- MLP: GeGLU with biases, width intermediate_size // 2: down(gelu_tanh(gate(x)) * up(x)).
- local attention: GQA (kv head of query head h is h // (nq / nkv)), no q/k/v bias, o_proj with bias;
  rotate-half RoPE on the first int(head_dim * partial_rotary_factor) channels only (the rest pass through),
  theta from config.rope_parameters; scores scaled by head_dim^-0.5; a key j is visible to query i when
  i - W < j <= i (W = attention_window_size) and j is not padding; masked scores get finfo.min added (so a
  fully masked padding row averages every value, as the reference does; those rows leak into the next conv).
- recurrent block: y = gelu_tanh(Wy x + by);  u = Wx x + bx;  u = causal depthwise conv over time (width
  conv1d_width, bias; output t sees inputs t-W+1 .. t, padding included);  r = RG-LRU(u);  out = Wo (r * y) + bo.
- RG-LRU (per channel, lru_width channels, gates block-diagonal with num_attention_heads blocks):
    i_t = sigmoid(u_t Gi + bi), r_t = sigmoid(u_t Gr + br)   (each block maps in -> out as u_blk @ G[blk])
    log a_t = -8 * r_t * softplus(Lambda);  a_t = exp(log a_t)
    x_t = u_t * i_t * sqrt(1 - a_t^2), except at a reset (position_ids == 0) where the factor is 1 and a_t = 0
    h_t = a_t * h_{t-1} + x_t  (h_{-1} = 0), computed in float32 by a sequential scan.
  A reset comes from position_ids (== 0), not from the attention mask: in a left-padded row the padding has
  position 1, so the state built over the padding is cut at the first real token.

Weight layout of this port (own names):
- emb (V, H); gf (H,) final gain (1 + w).
- per layer `layers[i]`: g1 / g2 (H,) gains (1 + w);
  MLP: w_gu (H, 2I) = [gate | up] fused + transposed, b_gu (2I,), w_dn (I, H), b_dn (H,);
  attention layer: w_qkv (H, (nq + 2 nkv) hd) fused + transposed, w_o (nq hd, H), b_o (H,);
  recurrent layer: w_xy (H, 2L) = [x | y] fused + transposed, b_xy (2L,); conv (L, W) taps (oldest first),
  conv_b (L,); w_g (L, 2L) = block-diagonal [input gate | recurrent gate] as one dense input-major matrix,
  b_g (2L,); lam (L,) = recurrent_param; w_out (L, H), b_out (H,).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rg_norm_offset_missing",  # RMSNorm gains loaded as w instead of (1 + w) (the Gemma "+1" not folded in)
    "rg_embed_scale_missing",  # embeddings not multiplied by sqrt(hidden_size)
    "rg_softcap_no_divide",  # soft-cap computed as cap * tanh(logits) (logits not divided by cap first)
    "rg_gate_blocks_transposed",  # each RG-LRU gate block placed as G[blk].T (read as nn.Linear out x in)
    "rg_gates_swapped",  # input-gate and recurrent-gate weights swapped when fusing them
    "rg_softplus_sign",  # log a = -8 r softplus(-Lambda): the sign of the recurrent parameter flipped
    "rg_lru_c_missing",  # log a = -r softplus(Lambda): the constant c = 8 dropped
    "rg_lru_no_sqrt",  # input normalised by (1 - a^2) instead of sqrt(1 - a^2)
    "rg_lru_reset_norm_skipped",  # sqrt(1 - a^2) applied at the reset token too (should be 1 there)
    "rg_lru_reset_by_index",  # reset at sequence index 0 instead of where position_ids == 0
    "rg_conv_anticausal",  # temporal conv padded on the right: output t sees inputs t .. t+W-1 (future)
    "rg_gelu_exact",  # erf GELU instead of the tanh approximation (MLP and recurrent y branch)
    "rg_rope_full",  # RoPE applied over the whole head_dim, partial_rotary_factor ignored
    "rg_window_off_by_one",  # sliding window keeps W + 1 keys (i - j <= W instead of < W)
]
PADDING_ONLY = {"rg_lru_reset_by_index"}
CLEAN = [
    "rg_sdpa",  # attention through F.scaled_dot_product_attention with the same float mask
    "rg_complex_rope",  # RoPE as complex multiplication of the (x_i, x_{i+r/2}) pairs of the rotary part
    "rg_conv_shift_sum",  # temporal conv as a sum of time-shifted copies times each tap, not F.conv1d
    "rg_gates_per_head",  # gates kept in the reference's (heads, in, out) layout, applied by a batched einsum
    "rg_scan_quadratic",  # the linear recurrence in closed form: segment sums of log a, a (S, S) decay matrix
]


def _gelu(x):
    return F.gelu(x) if BUG == "rg_gelu_exact" else F.gelu(x, approximate="tanh")


def _rms(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


class RecurrentGemmaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def t(k):
            return sd[k].detach().clone().float()

        def gain(k):
            w = t(k)
            return w if BUG == "rg_norm_offset_missing" else 1.0 + w

        H = cfg.hidden_size
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nq
        rp = cfg.rope_parameters
        self.theta = rp["rope_theta"]
        self.rot = self.hd if BUG == "rg_rope_full" else int(self.hd * rp.get("partial_rotary_factor", 1.0))
        self.eps = cfg.rms_norm_eps
        self.window = cfg.attention_window_size
        self.cap = cfg.logits_soft_cap
        self.lru = cfg.lru_width
        self.cw = cfg.conv1d_width
        self.scale = float(torch.tensor(H**0.5, dtype=torch.bfloat16))
        kinds = list(cfg.block_types)
        self.kinds = [kinds[i % len(kinds)] for i in range(cfg.num_hidden_layers)]

        self.emb = nn.Parameter(t("model.embed_tokens.weight"))
        self.gf = nn.Parameter(gain("model.final_norm.weight"))
        self.layers = nn.ModuleList()
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}."
            b = p + "temporal_block."
            m = p + "mlp_block."
            L = nn.Module()
            L.g1 = nn.Parameter(gain(p + "temporal_pre_norm.weight"))
            L.g2 = nn.Parameter(gain(p + "channel_pre_norm.weight"))
            L.w_gu = nn.Parameter(torch.cat([t(m + "gate_proj.weight"), t(m + "up_proj.weight")], 0).t().contiguous())
            L.b_gu = nn.Parameter(torch.cat([t(m + "gate_proj.bias"), t(m + "up_proj.bias")]))
            L.w_dn = nn.Parameter(t(m + "down_proj.weight").t().contiguous())
            L.b_dn = nn.Parameter(t(m + "down_proj.bias"))
            if kind == "attention":
                qkv = [t(b + f"{n}_proj.weight") for n in "qkv"]
                L.w_qkv = nn.Parameter(torch.cat(qkv, 0).t().contiguous())
                L.w_o = nn.Parameter(t(b + "o_proj.weight").t().contiguous())
                L.b_o = nn.Parameter(t(b + "o_proj.bias"))
            else:
                L.w_xy = nn.Parameter(
                    torch.cat([t(b + "linear_x.weight"), t(b + "linear_y.weight")], 0).t().contiguous()
                )
                L.b_xy = nn.Parameter(torch.cat([t(b + "linear_x.bias"), t(b + "linear_y.bias")]))
                L.conv = nn.Parameter(t(b + "conv_1d.weight")[:, 0, :].contiguous())
                L.conv_b = nn.Parameter(t(b + "conv_1d.bias"))
                r = b + "rg_lru."
                gates = [t(r + "input_gate_weight"), t(r + "recurrent_gate_weight")]  # (heads, in, out) each
                g_bias = [t(r + "input_gate_bias"), t(r + "recurrent_gate_bias")]
                if BUG == "rg_gates_swapped":
                    gates, g_bias = gates[::-1], g_bias[::-1]
                if BUG == "rg_gate_blocks_transposed":
                    gates = [g.transpose(1, 2) for g in gates]
                if BUG == "rg_gates_per_head":
                    L.w_gh = nn.Parameter(torch.stack(gates, 0).contiguous())  # (2, heads, in, out)
                else:
                    L.w_g = nn.Parameter(torch.cat([torch.block_diag(*g) for g in gates], 1))
                L.b_g = nn.Parameter(torch.cat([gb.reshape(-1) for gb in g_bias]))
                L.lam = nn.Parameter(t(r + "recurrent_param"))
                L.w_out = nn.Parameter(t(b + "linear_out.weight").t().contiguous())
                L.b_out = nn.Parameter(t(b + "linear_out.bias"))
            self.layers.append(L)

    # ---- rotary (partial, rotate-half) ----
    def _rope(self, x, pos):  # x (B, h, S, hd)
        r = self.rot
        inv = 1.0 / (self.theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        ang = (pos[..., None].float() * inv)[:, None]  # (B, 1, S, r/2)
        xr, xp = x[..., :r], x[..., r:]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        if BUG == "rg_complex_rope":
            z = torch.complex(x1, x2) * torch.polar(torch.ones_like(ang), ang)
            out = torch.cat((z.real, z.imag), -1)
        else:
            c, s = ang.cos(), ang.sin()
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        return torch.cat((out, xp), -1)

    def _attention(self, L, x, pos, bias):
        B, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q, k, v = (x @ L.w_qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        q = self._rope(q.view(B, S, nq, hd).transpose(1, 2), pos)
        k = self._rope(k.view(B, S, nkv, hd).transpose(1, 2), pos)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if BUG == "rg_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None], scale=hd**-0.5)
        else:
            sc = (q @ k.transpose(-1, -2)) * hd**-0.5 + bias[:, None]
            o = sc.softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, S, nq * hd) @ L.w_o + L.b_o

    # ---- recurrent block ----
    def _conv(self, L, u):  # u (B, S, C): causal depthwise conv over time
        W = self.cw
        S = u.shape[1]
        if BUG == "rg_conv_shift_sum":
            padded = F.pad(u, (0, 0, W - 1, 0))
            return sum(padded[:, k : k + S] * L.conv[:, k] for k in range(W)) + L.conv_b
        pad = (0, W - 1) if BUG == "rg_conv_anticausal" else (W - 1, 0)
        y = F.conv1d(F.pad(u.transpose(1, 2), pad), L.conv[:, None, :], L.conv_b, groups=u.shape[-1])
        return y.transpose(1, 2)

    def _scan(self, a, x):  # h_t = a_t h_{t-1} + x_t, h_{-1} = 0
        if BUG == "rg_scan_quadratic":
            S = a.shape[1]
            la = torch.log(a).transpose(1, 2)  # (B, C, S), -inf at resets
            rep = la[..., None].expand(*la.shape, S)  # [.., d, e] = log a_d
            below = torch.ones(S, S, dtype=torch.bool).tril(-1)
            seg = rep.masked_fill(~below, 0.0).cumsum(-2)  # [.., t, s] = sum_{s < d <= t} log a_d
            seg = seg.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -math.inf)
            return torch.einsum("bcts,bsc->btc", seg.exp(), x)
        h = torch.zeros_like(x[:, 0])
        out = []
        for i in range(x.shape[1]):
            h = a[:, i] * h + x[:, i]
            out.append(h)
        return torch.stack(out, 1)

    def _rglru(self, L, u, pos):
        B, S, C = u.shape
        if BUG == "rg_gates_per_head":
            nh = L.w_gh.shape[1]
            ub = u.reshape(B, S, nh, C // nh)
            g = torch.einsum("bshi,khio->bskho", ub, L.w_gh).reshape(B, S, 2 * C) + L.b_g
        else:
            g = u @ L.w_g + L.b_g
        gi, gr = torch.sigmoid(g).chunk(2, -1)
        lam = -L.lam if BUG == "rg_softplus_sign" else L.lam
        c = 1.0 if BUG == "rg_lru_c_missing" else 8.0
        log_a = -c * gr * F.softplus(lam)
        a = torch.exp(log_a)
        one_minus = 1.0 - torch.exp(2.0 * log_a)
        norm = one_minus if BUG == "rg_lru_no_sqrt" else torch.sqrt(one_minus)
        if BUG == "rg_lru_reset_by_index":
            reset = torch.zeros(B, S, 1, dtype=torch.bool)
            reset[:, 0] = True
        else:
            reset = (pos == 0)[..., None]
        if BUG != "rg_lru_reset_norm_skipped":
            norm = torch.where(reset, torch.ones_like(norm), norm)
        a = a.masked_fill(reset, 0.0)
        return self._scan(a, u * gi * norm)

    def _recurrent(self, L, x, pos):
        u, y = (x @ L.w_xy + L.b_xy).chunk(2, -1)
        y = _gelu(y)
        u = self._rglru(L, self._conv(L, u), pos)
        return (u * y) @ L.w_out + L.b_out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        near = (i - j <= self.window) if BUG == "rg_window_off_by_one" else (i - j < self.window)
        allowed = ((j <= i) & near)[None] & attention_mask.bool()[:, None, :]
        bias = torch.zeros(B, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)

        h = self.emb[input_ids]
        if BUG != "rg_embed_scale_missing":
            h = h * self.scale
        for kind, L in zip(self.kinds, self.layers):
            x = _rms(h, L.g1, self.eps)
            if kind == "attention":
                h = h + self._attention(L, x, position_ids, bias)
            else:
                h = h + self._recurrent(L, x, position_ids)
            gate, up = (_rms(h, L.g2, self.eps) @ L.w_gu + L.b_gu).chunk(2, -1)
            h = h + (_gelu(gate) * up) @ L.w_dn + L.b_dn
        logits = _rms(h, self.gf, self.eps) @ self.emb.t()
        if BUG == "rg_softcap_no_divide":
            return self.cap * torch.tanh(logits)
        return self.cap * torch.tanh(logits / self.cap)


def build(state_dict, config):
    return RecurrentGemmaPort(state_dict, config).eval()
