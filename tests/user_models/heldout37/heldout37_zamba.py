"""Hand-written plain-PyTorch port of Zamba (ZambaForCausalLM): a Mamba-1 stack with one shared
transformer block, no rotary or other positional encoding.

Architecture as this port implements it (H = hidden_size, E = embeddings, all float32):
- e = E[ids] (no scaling); h = e.  The untouched embeddings e are kept for every hybrid layer.
- RMSNorm(x; w) = w * x / sqrt(mean(x**2, -1) + rms_norm_eps)  (the weight multiplies after the normalisation).
- layer types from config.layers_block_type: "linear_attention" (mamba) and "hybrid".
  mamba layer:   h = h + Mamba(RMSNorm(h; w_in))
  hybrid layer:  t = Shared(h, e);  t = t @ P_i  (P_i = the layer's OWN `linear`, not shared);
                 h = h + Mamba(RMSNorm(h + t; w_in))     (t feeds the mamba input only, NOT the residual)
- Shared transformer block (ONE set of weights for all hybrid layers, no residual connections inside):
      x = RMSNorm(concat([h, e], -1); w_attn)  over 2H channels (hidden first, embeddings second)
      q, k, v = x @ Wq, x @ Wk, x @ Wv   (input 2H, head_dim d = attention_head_dim = 2H / n_heads)
      GQA: kv head j serves query heads j*g .. j*g+g-1 (g = n_heads / n_kv_heads, repeat_interleave)
      a = softmax(q k^T * (d / 2) ** -0.5 + mask) v,  then o = a @ Wo   (H out; note the d/2 in the scale)
      y = RMSNorm(o; w_ff);  Shared = (gelu(y @ Wg) * (y @ Wu)) @ Wd   (hidden_act, exact erf gelu)
  mask: causal, and keys where attention_mask == 0 are masked (additive finfo.min, so a fully masked padding
  query row stays finite).
- Mamba (multi-head Mamba-1, n_mamba_heads heads of hd = I / n_heads channels, I = mamba_expand * H):
      u = x * m  (m = attention_mask, padding positions zeroed; skipped when there is no mask)
      [xs | z] = u @ W_in + b_in   (Transformers' in_proj is INTERLEAVED: row 2c -> xs channel c, row 2c+1 -> z
                                    channel c; this port de-interleaves at load)
      xs = silu(causal depthwise conv_K(xs) + b_conv);  xs = xs * m (padding zeroed again after the conv)
      per head n (channels n*hd .. n*hd+hd-1 of xs and z):
          [dt_r | B | C] = xs_n @ X_n^T  (X_n: (R + 2N, hd), R = mamba_dt_rank, N = mamba_d_state)
          dt = softplus(dt_r @ T_n^T + dt_bias_n)     (bias before the softplus)
          A = -exp(A_log_n)
          s_t = exp(dt_t A) * s_{t-1} + dt_t B_t xs_t   (s_0 = 0, state (hd, N));  y_t = s_t C_t
          y = (y + D_n * xs_n) * silu(z_n)              (D skip before the gate)
      out = concat_heads(y) @ W_out + b_out
- final RMSNorm, logits = h @ E^T (tie_word_embeddings: lm_head is the embedding).
- position_ids are accepted and ignored (Zamba has no positional encoding; order comes from the conv, the scan and
  the causal mask).

Weight layout of this port (own names):
- `emb` (V, H); `norm_f` (H,).
- `shared` (one `SharedBlock`, loaded from the first hybrid layer's shared_transf only):
  `norm_attn` (2H,), `w_qkv` (2H, (nh + 2 nkv) d) = [q | k | v] fused + transposed, `w_o` (nh d, H) transposed,
  `norm_ff` (H,), `w_gate_up` (H, 2F) = [gate | up] fused + transposed, `w_down` (F, H) transposed.
- per layer `blocks[i]` (`MambaBlock`): `norm` (H,), `w_in` (H, 2I) de-interleaved to [xs | z] + transposed,
  `b_in` (2I,) de-interleaved, `conv_taps` (K, I) (tap k multiplies xs[t - (K - 1) + k]), `conv_b` (I,),
  `x_proj` (nh, hd, R + 2N) transposed per head, `dt_proj` (nh, hd, R), `dt_bias` (nh, hd),
  `A` (nh, hd, N) = -exp(A_log) precomputed, `D` (nh, hd), `w_out` (I, H) transposed, `b_out` (H,);
  hybrid layers also `w_link` (H, H) = their own `linear` transposed.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "zamba_inproj_halves",  # in_proj split as contiguous halves [xs | z] (Mamba-1 style) instead of de-interleaving rows 2c / 2c+1
    "zamba_attn_scale_head_dim",  # attention scaled by head_dim ** -0.5 instead of Zamba's (head_dim / 2) ** -0.5
    "zamba_concat_swapped",  # shared block input concatenated as [embeddings, hidden] instead of [hidden, embeddings]
    "zamba_link_into_residual",  # hybrid: the transformer output t is added to the residual too (h = h + t + Mamba(...))
    "zamba_dt_bias_after_softplus",  # dt = softplus(dt_r @ T^T) + dt_bias: the bias added after the softplus
    "zamba_A_log_no_exp",  # A precomputed at load as -A_log: the exp of A_log is missing
    "zamba_D_after_gate",  # D skip added after the gate: y * silu(z) + D * xs instead of (y + D * xs) * silu(z)
    "zamba_conv_shift",  # conv padded with K-2 zeros on the left and 1 on the right: window shifted one step into the future
    "zamba_xproj_reshape",  # per-head x_proj converted with reshape(nh, hd, R+2N) instead of transpose(1, 2)
    "zamba_concat_norm_halves",  # pre-attention RMSNorm computed separately over each H half instead of over all 2H
    "zamba_mlp_mamba_act",  # shared MLP uses hidden_mamba_act (silu) instead of hidden_act (gelu)
    "zamba_link_shared",  # every hybrid layer uses the first hybrid layer's `linear` (it is per layer, only the block is shared)
    "zamba_gqa_tiled",  # kv heads expanded with repeat (tile: head h -> kv h % nkv) instead of repeat_interleave
    "zamba_pad_conv_unmasked",  # padding zeroed before in_proj only: the conv output at padding positions is not re-zeroed
]
PADDING_ONLY = {"zamba_pad_conv_unmasked"}
CLEAN = [
    "zamba_parallel_scan",  # selective scan in closed form: s_t = sum_{j<=t} exp(cumA_t - cumA_j) dt_j B_j xs_j (masked L x L)
    "zamba_conv_shifted_sum",  # depthwise causal conv as a sum of K shifted copies of xs times the taps (no F.conv1d)
    "zamba_concat_free_attn",  # no concat: rms from both halves' sums of squares, q/k/v = (h-part) @ W_h + (e-part) @ W_e
    "zamba_attn_sdpa",  # attention through F.scaled_dot_product_attention (float additive mask, explicit scale)
    "zamba_norm_folded_head",  # final RMSNorm weight folded into the (tied) head: (h * r) @ (E * w_f)^T
]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class SharedBlock(nn.Module):
    """The shared attention + MLP block (one copy for all hybrid layers)."""

    def __init__(self, sd, prefix, cfg):
        super().__init__()
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.d = cfg.attention_head_dim
        self.eps = cfg.rms_norm_eps
        self.hidden_act = cfg.hidden_act
        self.mamba_act = cfg.hidden_mamba_act
        a = prefix + "self_attn."
        f = prefix + "feed_forward."
        self.norm_attn = nn.Parameter(sd[prefix + "input_layernorm.weight"].float().clone())
        w_qkv = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]], 0)
        self.w_qkv = nn.Parameter(w_qkv.float().t().contiguous())
        self.w_o = nn.Parameter(sd[a + "o_proj.weight"].float().t().contiguous())
        self.norm_ff = nn.Parameter(sd[prefix + "pre_ff_layernorm.weight"].float().clone())
        w_gu = torch.cat([sd[f + "gate_proj.weight"], sd[f + "up_proj.weight"]], 0)
        self.w_gate_up = nn.Parameter(w_gu.float().t().contiguous())
        self.w_down = nn.Parameter(sd[f + "down_proj.weight"].float().t().contiguous())

    def _act(self, x):
        name = self.mamba_act if BUG == "zamba_mlp_mamba_act" else self.hidden_act
        if name == "gelu":
            return F.gelu(x)
        if name in ("gelu_pytorch_tanh", "gelu_new"):
            return F.gelu(x, approximate="tanh")
        if name in ("silu", "swish"):
            return F.silu(x)
        if name == "relu":
            return F.relu(x)
        raise ValueError(f"unsupported activation {name}")

    def forward(self, h, e, bias, probe=None, tag=""):
        b, L, H = h.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        if BUG == "zamba_concat_free_attn":
            ss = h.pow(2).sum(-1, keepdim=True) + e.pow(2).sum(-1, keepdim=True)
            r = torch.rsqrt(ss / (2 * H) + self.eps)
            qkv = (h * r * self.norm_attn[:H]) @ self.w_qkv[:H] + (e * r * self.norm_attn[H:]) @ self.w_qkv[H:]
        else:
            x = torch.cat([e, h], -1) if BUG == "zamba_concat_swapped" else torch.cat([h, e], -1)
            if BUG == "zamba_concat_norm_halves":
                x = torch.cat(
                    [_rms(x[..., :H], self.norm_attn[:H], self.eps), _rms(x[..., H:], self.norm_attn[H:], self.eps)], -1
                )
            else:
                x = _rms(x, self.norm_attn, self.eps)
            if probe:
                probe(tag + "input_layernorm", x)
            qkv = x @ self.w_qkv
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], -1)
        if probe:
            probe(tag + "self_attn.q_proj", q)
            probe(tag + "self_attn.k_proj", k)
            probe(tag + "self_attn.v_proj", v)
        q = q.view(b, L, nh, d).transpose(1, 2)
        k = k.view(b, L, nkv, d).transpose(1, 2)
        v = v.view(b, L, nkv, d).transpose(1, 2)
        g = nh // nkv
        if BUG == "zamba_gqa_tiled":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scale = d**-0.5 if BUG == "zamba_attn_scale_head_dim" else (d / 2) ** -0.5
        if BUG == "zamba_attn_sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale + bias
            a = torch.softmax(s, dim=-1) @ v
        a = a.transpose(1, 2).reshape(b, L, nh * d)
        o = a @ self.w_o
        if probe:
            probe(tag + "self_attn.o_proj", o)
            probe(tag + "self_attn", o)
        y = _rms(o, self.norm_ff, self.eps)
        if probe:
            probe(tag + "pre_ff_layernorm", y)
        gate, up = (y @ self.w_gate_up).chunk(2, -1)
        if probe:
            probe(tag + "feed_forward.gate_proj", gate)
            probe(tag + "feed_forward.up_proj", up)
        act = self._act(gate)
        if probe:
            probe(tag + "feed_forward.act_fn", act)
        out = (act * up) @ self.w_down
        if probe:
            probe(tag + "feed_forward.down_proj", out)
            probe(tag + "feed_forward", out)
        return out


class MambaBlock(nn.Module):
    """One Zamba mamba layer (pre-norm, residual) with multi-head Mamba-1 mixer; hybrid layers keep their link."""

    def __init__(self, sd, prefix, cfg, hybrid, link_prefix):
        super().__init__()
        self.hybrid = hybrid
        self.eps = cfg.rms_norm_eps
        self.nh = cfg.n_mamba_heads
        self.I = cfg.mamba_expand * cfg.hidden_size
        self.hd = self.I // self.nh
        self.R = cfg.mamba_dt_rank
        self.N = cfg.mamba_d_state
        self.K = cfg.mamba_d_conv
        m = prefix + "mamba."
        self.norm = nn.Parameter(sd[prefix + "input_layernorm.weight"].float().clone())
        w_in = sd[m + "in_proj.weight"].float()
        b_in = sd.get(m + "in_proj.bias")
        b_in = torch.zeros(w_in.shape[0]) if b_in is None else b_in.float()
        if BUG == "zamba_inproj_halves":
            w_x, w_z = w_in[: self.I], w_in[self.I :]
            b_x, b_z = b_in[: self.I], b_in[self.I :]
        else:  # Transformers views the 2I outputs as (I, 2): even rows are xs, odd rows are the gate z
            w_x, w_z = w_in[0::2], w_in[1::2]
            b_x, b_z = b_in[0::2], b_in[1::2]
        self.w_in = nn.Parameter(torch.cat([w_x, w_z], 0).t().contiguous())
        self.b_in = nn.Parameter(torch.cat([b_x, b_z], 0).contiguous())
        self.conv_taps = nn.Parameter(sd[m + "conv1d.weight"].float()[:, 0, :].t().contiguous())
        cb = sd.get(m + "conv1d.bias")
        self.conv_b = nn.Parameter(torch.zeros(self.I) if cb is None else cb.float().clone())
        xp = sd[m + "x_proj_weight"].float()  # (nh, R + 2N, hd)
        if BUG == "zamba_xproj_reshape":
            xp = xp.reshape(self.nh, self.hd, self.R + 2 * self.N)
        else:
            xp = xp.transpose(1, 2)
        self.x_proj = nn.Parameter(xp.contiguous())
        self.dt_proj = nn.Parameter(sd[m + "dt_proj_weight"].float().clone())  # (nh, hd, R)
        self.dt_bias = nn.Parameter(sd[m + "dt_proj_bias"].float().clone())  # (nh, hd)
        a_log = sd[m + "A_log"].float()
        self.A = nn.Parameter(-a_log if BUG == "zamba_A_log_no_exp" else -torch.exp(a_log))
        self.D = nn.Parameter(sd[m + "D"].float().clone())
        self.w_out = nn.Parameter(sd[m + "out_proj.weight"].float().t().contiguous())
        bo = sd.get(m + "out_proj.bias")
        self.b_out = nn.Parameter(torch.zeros(cfg.hidden_size) if bo is None else bo.float().clone())
        if hybrid:
            self.w_link = nn.Parameter(sd[link_prefix + "linear.weight"].float().t().contiguous())

    def _conv(self, xs):
        # xs (b, L, I) -> causal depthwise conv, taps (K, I)
        b, L, I = xs.shape
        K = self.K
        if BUG == "zamba_conv_shifted_sum":
            xp = F.pad(xs, (0, 0, K - 1, 0))
            out = sum(xp[:, k : k + L] * self.conv_taps[k] for k in range(K))
            return out + self.conv_b
        left, right = (K - 2, 1) if BUG == "zamba_conv_shift" else (K - 1, 0)
        xt = F.pad(xs.transpose(1, 2), (left, right))
        w = self.conv_taps.t().unsqueeze(1)  # (I, 1, K)
        return F.conv1d(xt, w, self.conv_b, groups=I).transpose(1, 2)

    def _scan(self, x, dt, Bm, Cm):
        # x, dt: (b, nh, L, hd); Bm, Cm: (b, nh, L, N); A: (nh, hd, N) -> y (b, nh, L, hd)
        A = self.A
        if BUG == "zamba_parallel_scan":
            L = x.shape[2]
            la = dt.unsqueeze(-1) * A[:, None]  # (b, nh, L, hd, N), log of the per-step decay
            cum = la.cumsum(2)
            diff = cum.unsqueeze(3) - cum.unsqueeze(2)  # [t, j] = cum_t - cum_j  (b, nh, L, L, hd, N)
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            w = torch.where(causal[:, :, None, None], diff, torch.full_like(diff, -math.inf)).exp()
            u = (dt * x).unsqueeze(-1) * Bm.unsqueeze(3)  # (b, nh, L, hd, N): dt_j x_j B_j
            s = (w * u.unsqueeze(2)).sum(3)  # (b, nh, L, hd, N)
            return (s * Cm.unsqueeze(3)).sum(-1)
        b, nh, L, hd = x.shape
        s = x.new_zeros(b, nh, hd, self.N)
        ys = []
        for t in range(L):
            dA = torch.exp(dt[:, :, t, :, None] * A)
            s = dA * s + (dt[:, :, t] * x[:, :, t])[..., None] * Bm[:, :, t, None, :]
            ys.append((s * Cm[:, :, t, None, :]).sum(-1))
        return torch.stack(ys, 2)

    def mixer(self, u, mask, probe=None, tag=""):
        b, L, _ = u.shape
        nh, hd, I = self.nh, self.hd, self.I
        if mask is not None:
            u = u * mask[..., None]
        xz = u @ self.w_in + self.b_in
        if probe:  # Transformers' in_proj output interleaves xs and z
            probe(tag + "in_proj", torch.stack([xz[..., :I], xz[..., I:]], -1).reshape(b, L, 2 * I))
        xs, z = xz[..., :I], xz[..., I:]
        xs = F.silu(self._conv(xs))
        if mask is not None and BUG != "zamba_pad_conv_unmasked":
            xs = xs * mask[..., None]
        xh = xs.view(b, L, nh, hd).transpose(1, 2)  # (b, nh, L, hd)
        zh = z.view(b, L, nh, hd).transpose(1, 2)
        p = torch.einsum("bnld,ndk->bnlk", xh, self.x_proj)
        dt_r, Bm, Cm = p.split([self.R, self.N, self.N], -1)
        dt = torch.einsum("bnlr,ndr->bnld", dt_r, self.dt_proj)
        if BUG == "zamba_dt_bias_after_softplus":
            dt = F.softplus(dt) + self.dt_bias[:, None]
        else:
            dt = F.softplus(dt + self.dt_bias[:, None])
        y = self._scan(xh, dt, Bm, Cm)
        if BUG == "zamba_D_after_gate":
            y = y * F.silu(zh) + xh * self.D[:, None]
        else:
            y = (y + xh * self.D[:, None]) * F.silu(zh)
        y = y.transpose(1, 2).reshape(b, L, I)
        out = y @ self.w_out + self.b_out
        if probe:
            probe(tag + "out_proj", out)
            probe(tag.rstrip("."), out)
        return out


class ZambaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.emb = nn.Parameter(sd["model.embed_tokens.weight"].float().clone())
        self.norm_f = nn.Parameter(sd["model.final_layernorm.weight"].float().clone())
        types = list(cfg.layers_block_type)
        self.types = types
        hybrid_ids = [i for i, t in enumerate(types) if t == "hybrid"]
        self.shared = SharedBlock(sd, f"model.layers.{hybrid_ids[0]}.shared_transf.", cfg) if hybrid_ids else None
        blocks = []
        for i, t in enumerate(types):
            if t == "hybrid":
                src = hybrid_ids[0] if BUG == "zamba_link_shared" else i
                blocks.append(MambaBlock(sd, f"model.layers.{i}.mamba_decoder.", cfg, True, f"model.layers.{src}."))
            else:
                blocks.append(MambaBlock(sd, f"model.layers.{i}.", cfg, False, None))
        self.blocks = nn.ModuleList(blocks)
        self._probe = None  # debugging: a callable(name, tensor) given the Transformers-named intermediates

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        probe = self._probe
        b, L = input_ids.shape
        e = self.emb[input_ids]
        if probe:
            probe("model.embed_tokens", e)
        h = e
        causal = torch.ones(L, L, dtype=torch.bool, device=e.device).tril()
        allowed = causal[None, None]
        mask = None
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            allowed = allowed & keep[:, None, None, :]
            if not bool(keep.all()):
                mask = attention_mask.to(e.dtype)
        bias = torch.zeros(allowed.shape, dtype=e.dtype, device=e.device)
        bias = bias.masked_fill(~allowed, torch.finfo(e.dtype).min)
        for i, blk in enumerate(self.blocks):
            if blk.hybrid:
                pre = f"model.layers.{i}."
                t = self.shared(h, e, bias, probe, pre + "shared_transf.")
                if probe:
                    probe(pre + "shared_transf", t)
                t = t @ blk.w_link
                if probe:
                    probe(pre + "linear", t)
                u = h + t
                pre = pre + "mamba_decoder."
            else:
                t = None
                u = h
                pre = f"model.layers.{i}."
            n = _rms(u, blk.norm, self.eps)
            if probe:
                probe(pre + "input_layernorm", n)
            out = blk.mixer(n, mask, probe, pre + "mamba.")
            h = (u if BUG == "zamba_link_into_residual" else h) + out
            if probe:
                probe(pre.rstrip("."), h)
                if blk.hybrid:
                    probe(f"model.layers.{i}", h)
        if BUG == "zamba_norm_folded_head":
            r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * r) @ (self.emb * self.norm_f).t()
        h = _rms(h, self.norm_f, self.eps)
        if probe:
            probe("model.final_layernorm", h)
        return h @ self.emb.t()


def build(state_dict, config):
    return ZambaPort(state_dict, config).eval()
