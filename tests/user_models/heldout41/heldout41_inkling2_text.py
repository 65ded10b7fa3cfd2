"""Hand-written plain-PyTorch port of the Inkling-2 text model (Transformers `Inkling2ForCausalLM`,
model_type "inkling2_text"): hybrid sliding / full attention with attention sinks, a hidden-state conditioned
relative position bias, short convolutions on keys, values and both branch outputs, softcapped-SwiGLU MoE and
"block attention residuals" in place of a plain residual stream.

Architecture as this port implements it (everything in float32; H = hidden size, eps = config.rms_norm_eps):
- RMS(x; g) = g * x / sqrt(mean(x^2) + eps)  (weighted);  URMS_e(x) = x / sqrt(mean(x^2) + e)  (no weight).
- clip_t(v) = v * min(1, t / (|v|_2 + 1e-6)) over each head vector.
- logscale(v, p) = v * (1 + alpha * log(max((p + 1) / n_floor, 1))), p the token's position id
  (alpha = log_scaling_alpha, n_floor = log_scaling_n_floor); full-attention layers only.
- softcap_c(x) = c * tanh(x / c).
- embeddings: e = RMS(E[ids]; g_emb).
- block attention residual ("AttnRes") with a learned query vector w (H,) over the completed block states
  B_1..B_n and the running partial state P:  S = [B_1..B_n, P];  N = URMS_{1e-6}(S) (fixed eps 1e-6, NOT
  config eps);  a = softmax_j(<N_j, w> / sqrt(H));  out = sum_j a_j N_j  (the values are the NORMALISED states).
  A full layer uses three queries (its q, k and v inputs), every other AttnRes one.
- layer i (x = layer input, B = block states; "boundary" = i % n_layers_per_attn_res_block == 0):
      sliding:  h = RMS(AttnRes(B, x) if i > 0 else x; g_in);  a = SWA(h)
      full:     (xq, xk, xv) = AttnRes3(B, x) if i > 0 else (x, x, x);
                a = FullAttn(RMS(xq; g_q), RMS(xk; g_k), RMS(xv; g_v))
      a = SConv(a)                                               (post-attention short convolution)
      boundary: B <- B + [x];  P = a     (the residual stream restarts at a block boundary)
      else:     P = x + a
      y = SConv(MoE(RMS(AttnRes(B, P); g_post)))                 (post-MoE short convolution)
      layer output = P + y
- final: logits = softcap_{final_logit_softcapping}(RMS(AttnRes(B, x_last); g_final) @ W_head^T),
  W_head has unpadded_vocab_size rows.
- SConv (static depthwise causal conv, kernel K = conv_kernel_size, no bias):
      c_t = sum_{j<K} tap_j * m_{t-j} * x_{t-j}  (m: 1/0 padding mask, x_{<0} = 0);  out = (c + x) / sqrt(K + 1)
  (the un-masked input is the residual).
- DConv (dynamic conv of the full layers' keys / values, per kv head h):
      tap_{t,h,j} = static_j[h-slice] + (u_t @ W_dyn^T)[h * K + j],  u = the k (resp. v) projection's input;
      c_t = sum_j tap_{t,h,j} * m_{t-j} x_{t-j};  out = (c + x) / sqrt(2K + 1).
- attention (per layer kind: sliding uses swa_num_attention_heads / swa_num_key_value_heads / swa_head_dim,
  window W = sliding_window_size and relative extent R = W; full uses num_attention_heads / num_key_value_heads /
  head_dim, no window, R = rel_extent):
      q = clip_{t_qk}(s_q * (h_q W_q^T))   (s_q a per (head, dim) scale; full: then logscale)
      k = clip_{t_qk}(Conv(h_k W_k^T))     (sliding: SConv, full: DConv with u = h_k)
      v = URMS_eps(Conv(h_v W_v^T))         (per head; sliding SConv, full DConv with u = h_v)
      r = clip_{t_rel}(s_r * (h_q W_r^T))   (d_rel per head; full: then logscale);  rl = r @ P_rel  (R columns)
      bias[h, t, u] = rl[t, h, t - u] for 0 <= t - u < R, else 0   (t - u counted in token index)
      z = q.k / sqrt(head_dim) + bias + mask  (causal, sliding: t - u < W, padding keys off)
      sink_t = h_q W_sink^T (one logit per head and token, value zero):
      p = exp(z) / (sum exp(z) + exp(sink));  o = p @ v  (GQA: query head h reads kv head h // group)
      out = (o * sigmoid(h_q W_gate^T)) @ W_o^T
- MoE: logits = x W_router^T (fp32); s = sigmoid(logits); choice = top-k of (s + b_corr);
  weights = s[choice] / (sum s[choice] + 1e-20) * route_scale;
  expert e: (softcap_{gc}(g) * sigmoid(g) * softcap_{uc}(u)) W_down_e^T with g = x W_gate_e^T, u = x W_up_e^T
  (gc = mlp_gate_softcap, uc = mlp_up_softcap; the sigmoid sees the RAW gate).  No shared expert.

Weight layout of this port (own names, set at load):
- tok_emb (V, H); emb_gain (H,); out_gain (H,); out_mix (H,) = final AttnRes query; head_t (H, V_unpadded)
  = lm_head TRANSPOSED.
- per layer `layers[i]` (SlidingLayer / FullLayer):
  mix (n, H): the AttnRes queries STACKED: sliding [attn?, mlp], full [q, k, v (if i > 0), mlp];
  gains (n, H): the RMSNorm weights STACKED: sliding [in, post], full [q_in, k_in, v_in, post];
  post_taps (2, K, H): post-attention / post-MoE conv taps, FLIPPED to backward-distance order (tap 0 = current);
  sliding: w_in (Nq*D + 2*Nkv*D + Nq*D + Nq + Nq*d_rel, H) = [q (scale FOLDED in) | k | v | gate | sink | rel]
           FUSED; kv_taps (2, K, Nkv*D) flipped key / value conv taps;
  full: w_qside (Nq*D + Nq*D + Nq + Nq*d_rel, H) = [q (scale folded) | gate | sink | rel] fused,
        w_kside / w_vside (Nkv*D + Nkv*K, H) = [projection | dynamic-tap projection] fused,
        kv_static (2, K, Nkv*D) = the static taps of keys and values stacked;
  rel_scale (Nq, d_rel); rel_bank_t (R, d_rel) = relative bias profiles TRANSPOSED; w_o_t (Nq*D, H) transposed;
  router_t (H, E) transposed; router_bias (E,);
  w_gate / w_up (E, H, I) = gate_up_proj SPLIT and transposed;  w_down (E, I, H) transposed.
- BUG is read at build time (weight conversions, scaling constant, q-scale folding) and at call time (the rest).
- TRACE (debugging aid, off by default): a dict that collects intermediates under the names of the Transformers
  modules they correspond to (used by where_check.py).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "conv_taps_unflipped",  # static nn.Conv1d weights (last tap = current token) copied into the port's
    # backward-distance tap layout without flipping: every SConv weights the oldest token as the current one
    "dconv_scale_static_constant",  # dynamic (full-layer K/V) conv output divided by sqrt(K + 1), the static
    # conv's constant, instead of sqrt(2K + 1)
    "swa_window_off_by_one",  # sliding mask keeps keys with t - u <= W (W + 1 tokens) instead of t - u < W
    "full_kv_inputs_swapped",  # the full layer's three AttnRes outputs unpacked as (q, v, k): the key branch
    # reads the value mix and vice versa
    "value_norm_before_conv",  # the values' unweighted RMS norm applied to the projection BEFORE the short
    # convolution instead of after it
    "swa_scaling_full_head_dim",  # attention scale 1 / sqrt(config.head_dim) in every layer: the sliding layers'
    # swa_head_dim is ignored
    "swiglu_sigmoid_of_capped_gate",  # expert act silu(softcap(gate)) * softcap(up): the sigmoid sees the capped
    # gate instead of the raw one
    "router_weights_with_bias",  # expert weights gathered from s + e_score_correction_bias (the bias meant for
    # the choice only) before normalising
    "attnres_values_unnormed",  # block attention residual returns sum a_j S_j of the RAW states (only the keys
    # normalised) instead of the normalised ones
    "block_boundary_residual_kept",  # at a block boundary the layer input is still added to the attention output
    # (P = x + a) although the residual stream restarts there (and x is already stored as a block)
    "gqa_heads_modulo",  # query head h reads kv head h % num_kv_heads (repeat) instead of h // group
    # (repeat_interleave)
    "final_attnres_skipped",  # final norm applied to the last layer's output directly: the final block attention
    # residual over the stored blocks is skipped
    "conv_padding_unmasked",  # padding positions not zeroed before the short / dynamic convolutions: left
    # padding leaks into the first real tokens' keys, values and branch outputs
    "logscale_from_index",  # log scaling of the full layers' queries / relative states computed from the token
    # index (arange) instead of position_ids
]
PADDING_ONLY = ["conv_padding_unmasked", "logscale_from_index"]
CLEAN = [
    "clean_sink_lse",  # sinks without concatenation: softmax over keys times sigmoid(logsumexp(z) - sink)
    "clean_conv_conv1d",  # static short convolutions through F.conv1d (depthwise, flipped back) instead of
    # shift-and-add over the taps
    "clean_experts_dense",  # every expert on every token, combined through a dense (tokens, experts) matrix of
    # routing weights (zero where not chosen)
    "clean_qscale_unfolded",  # q head scale kept separate and multiplied after the projection instead of folded
    # into the projection's rows at load
    "clean_rel_distance_positions",  # relative distance t - u taken from position_ids (per batch row) instead of
    # the token index; identical on real tokens, padding keys are masked anyway
]


def _bug(name):
    return BUG == name


TRACE = None  # debugging aid: set to a dict to collect intermediates under the Transformers module they match


def _tap(name, t):
    if TRACE is not None and name is not None:
        TRACE[name] = t.detach().clone()
    return t


NEG = torch.finfo(torch.float32).min


def rms(x, gain, eps):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if gain is None else gain * x


def clip(v, t):
    n = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    return v * (t / (n + 1e-6)).clamp(max=1.0)


def softcap(x, c):
    return torch.tanh(x / c) * c


def shift(x, j):
    """x (b, s, c) delayed by j tokens along s, zeros in front."""
    if j == 0:
        return x
    return F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]


def attn_res(queries, blocks, partial, name=None):
    """Block attention residual: queries (n_q, H); blocks list of (b, s, H); returns a list of n_q (b, s, H)."""
    stacked = torch.stack(list(blocks) + [partial], dim=-2)  # (b, s, n, H)
    normed = _tap(name and name + ".norm", rms(stacked, None, 1e-6))
    logits = torch.einsum("bsnh,qh->bsqn", normed, queries) / math.sqrt(stacked.shape[-1])
    a = logits.softmax(-1)
    values = stacked if _bug("attnres_values_unnormed") else normed
    out = _tap(name, torch.einsum("bsqn,bsnh->bsqh", a, values))
    return list(out.unbind(-2))


def static_conv(x, taps, mask):
    """SConv: x (b, s, c), taps (K, c) in backward-distance order, mask (b, s) or None."""
    k = taps.shape[0]
    ctx = x if (mask is None or _bug("conv_padding_unmasked")) else x * mask[:, :, None]
    if BUG == "clean_conv_conv1d":
        w = taps.flip(0).t().unsqueeze(1)  # (c, 1, K), last tap = current token
        c = F.conv1d(ctx.transpose(1, 2), w, padding=k - 1, groups=x.shape[-1])[:, :, : x.shape[1]].transpose(1, 2)
    else:
        c = sum(taps[j] * shift(ctx, j) for j in range(k))
    return (c + x) / math.sqrt(k + 1)


def dynamic_conv(x, dyn, static, n_heads, mask):
    """DConv: x (b, s, c), dyn (b, s, n_heads * K) per-token taps, static (K, c)."""
    b, s, c = x.shape
    k = static.shape[0]
    d = c // n_heads
    dyn = dyn.view(b, s, n_heads, k).transpose(2, 3).unsqueeze(-1)  # (b, s, K, heads, 1)
    taps = static.view(k, n_heads, d) + dyn  # (b, s, K, heads, d)
    taps = taps.reshape(b, s, k, c)
    ctx = x if (mask is None or _bug("conv_padding_unmasked")) else x * mask[:, :, None]
    out = sum(taps[:, :, j] * shift(ctx, j) for j in range(k))
    denom = math.sqrt(k + 1) if _bug("dconv_scale_static_constant") else math.sqrt(2 * k + 1)
    return (out + x) / denom


def log_scale(v, scale):
    """v (b, s, heads, d), scale (b or 1, s)."""
    return v * scale[:, :, None, None]


class Attention(nn.Module):
    """Shared attention maths; the layers hold the weights."""

    def attend(self, q, k, v, bias, sink, mask4):
        # q (b, Nq, s, D), k / v (b, Nkv, s, D), bias (b, Nq, s, s), sink (b, Nq, s), mask4 (b, 1, s, s) additive
        group = q.shape[1] // k.shape[1]
        if _bug("gqa_heads_modulo"):
            k = k.repeat(1, group, 1, 1)
            v = v.repeat(1, group, 1, 1)
        else:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        z = (q @ k.transpose(-1, -2)) * self.scaling + bias + mask4
        if BUG == "clean_sink_lse":
            p = z.softmax(-1) * torch.sigmoid(torch.logsumexp(z, -1) - sink).unsqueeze(-1)
        else:
            p = torch.cat([z, sink.unsqueeze(-1)], dim=-1).softmax(-1)[..., :-1]
        o = p @ v  # (b, Nq, s, D)
        return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def rel_bias(self, r, dist):
        """r (b, s, Nq, d_rel) normalised relative states, dist (b or 1, s, s) -> bias (b, Nq, s, s)."""
        rl = r @ self.rel_bank_t.t()  # (b, s, Nq, R)
        extent = rl.shape[-1]
        rl = rl.permute(0, 2, 1, 3)  # (b, Nq, s, R)
        idx = dist.clamp(0, extent - 1).unsqueeze(1).expand(rl.shape[0], rl.shape[1], -1, -1)
        bias = rl.gather(-1, idx)
        outside = ((dist < 0) | (dist >= extent)).unsqueeze(1)
        return bias.masked_fill(outside, 0.0)


class SlidingLayer(Attention):
    def __init__(self, sd, p, cfg, i):
        super().__init__()
        self.nq, self.nkv, self.d = cfg.swa_num_attention_heads, cfg.swa_num_key_value_heads, cfg.swa_head_dim
        self.d_rel, self.eps, self.k = cfg.d_rel, cfg.rms_norm_eps, cfg.conv_kernel_size
        self.t_qk, self.t_rel = cfg.qk_l2_clip_threshold, cfg.rel_l2_clip_threshold
        self.window = cfg.sliding_window_size
        self.scaling = (cfg.head_dim if _bug("swa_scaling_full_head_dim") else self.d) ** -0.5
        self.has_attn_mix = i > 0
        self.name = p
        a = p + "self_attn."
        mix = ([sd[p + "attention_input.query"]] if i > 0 else []) + [sd[p + "mlp_input.query"]]
        self.mix = nn.Parameter(torch.stack(mix))
        self.gains = nn.Parameter(
            torch.stack([sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]])
        )
        self.post_taps = nn.Parameter(
            torch.stack(
                [
                    conv_taps(sd[p + "post_attention_convolution.conv1d.weight"]),
                    conv_taps(sd[p + "post_mlp_convolution.conv1d.weight"]),
                ]
            )
        )
        wq, qscale = sd[a + "q_proj.linear.weight"], sd[a + "q_proj.norm.scale"]
        self.unfolded = BUG == "clean_qscale_unfolded"
        if self.unfolded:
            self.q_scale = nn.Parameter(qscale.clone())
        else:
            wq = wq * qscale.reshape(-1, 1)
        self.w_in = nn.Parameter(
            torch.cat(
                [
                    wq,
                    sd[a + "k_proj.linear.weight"],
                    sd[a + "v_proj.linear.weight"],
                    sd[a + "o_proj.gate_proj.weight"],
                    sd[a + "sink_proj.weight"],
                    sd[a + "relative_position_bias.linear.weight"],
                ]
            )
        )
        self.kv_taps = nn.Parameter(
            torch.stack(
                [conv_taps(sd[a + "k_proj.sconv.conv1d.weight"]), conv_taps(sd[a + "v_proj.sconv.conv1d.weight"])]
            )
        )
        self.rel_scale = nn.Parameter(sd[a + "relative_position_bias.norm.scale"].clone())
        self.rel_bank_t = nn.Parameter(sd[a + "relative_position_bias.proj"].t().contiguous())
        self.w_o_t = nn.Parameter(sd[a + "o_proj.linear.weight"].t().contiguous())
        self.moe = MoE(sd, p + "mlp.", cfg)

    def attention(self, h, env):
        b, s, _ = h.shape
        nq, nkv, d = self.nq, self.nkv, self.d
        sizes = [nq * d, nkv * d, nkv * d, nq * d, nq, nq * self.d_rel]
        q, k, v, gate, sink, r = (h @ self.w_in.t()).split(sizes, dim=-1)
        a = self.name + "self_attn."
        for n, t in (
            ("k_proj.linear", k),
            ("v_proj.linear", v),
            ("relative_position_bias.linear", r),
            ("sink_proj", sink),
            ("o_proj.gate_proj", gate),
        ):
            _tap(a + n, t)
        q = q.view(b, s, nq, d)
        if self.unfolded:
            q = q * self.q_scale
        q = _tap(a + "q_proj", _tap(a + "q_proj.norm", clip(q, self.t_qk)))
        if _bug("value_norm_before_conv"):
            v = rms(v.view(b, s, nkv, d), None, self.eps).reshape(b, s, -1)
        k = _tap(a + "k_proj.sconv", static_conv(k, self.kv_taps[0], env["conv_mask"]))
        v = _tap(a + "v_proj.sconv", static_conv(v, self.kv_taps[1], env["conv_mask"]))
        k = _tap(a + "k_proj", _tap(a + "k_proj.norm", clip(k.view(b, s, nkv, d), self.t_qk)))
        v = v.view(b, s, nkv, d)
        if not _bug("value_norm_before_conv"):
            v = rms(v, None, self.eps)
        v = _tap(a + "v_proj", _tap(a + "v_proj.norm", v))
        r = _tap(a + "relative_position_bias.norm", clip(r.view(b, s, nq, self.d_rel) * self.rel_scale, self.t_rel))
        bias = self.rel_bias(r, env["dist"])
        _tap(a + "relative_position_bias", bias.transpose(1, 2))
        o = self.attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, sink.transpose(1, 2), env["mask_swa"]
        )
        o = (o * torch.sigmoid(gate)) @ self.w_o_t
        return _tap(a[:-1], _tap(a + "o_proj", _tap(a + "o_proj.linear", o)))

    def forward(self, x, blocks, boundary, env):
        h = attn_res(self.mix[:1], blocks, x, self.name + "attention_input")[0] if self.has_attn_mix else x
        a = self.attention(_tap(self.name + "input_layernorm", rms(h, self.gains[0], self.eps)), env)
        a = _tap(self.name + "post_attention_convolution", static_conv(a, self.post_taps[0], env["conv_mask"]))
        if boundary:
            blocks = blocks + [x]
            part = x + a if _bug("block_boundary_residual_kept") else a
        else:
            part = x + a
        m = attn_res(self.mix[-1:], blocks, part, self.name + "mlp_input")[0]
        y = self.moe(_tap(self.name + "post_attention_layernorm", rms(m, self.gains[-1], self.eps)))
        y = _tap(self.name + "post_mlp_convolution", static_conv(y, self.post_taps[1], env["conv_mask"]))
        return _tap(self.name[:-1], part + y)


class FullLayer(Attention):
    def __init__(self, sd, p, cfg, i):
        super().__init__()
        self.nq, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.d_rel, self.eps, self.k = cfg.d_rel, cfg.rms_norm_eps, cfg.conv_kernel_size
        self.t_qk, self.t_rel = cfg.qk_l2_clip_threshold, cfg.rel_l2_clip_threshold
        self.scaling = self.d**-0.5
        self.has_attn_mix = i > 0
        self.name = p
        a = p + "self_attn."
        mix = (list(sd[p + "attention_input.query"].reshape(3, -1)) if i > 0 else []) + [sd[p + "mlp_input.query"]]
        self.mix = nn.Parameter(torch.stack(mix))
        self.gains = nn.Parameter(
            torch.stack(
                [
                    sd[p + n + ".weight"]
                    for n in ("q_input_layernorm", "k_input_layernorm", "v_input_layernorm", "post_attention_layernorm")
                ]
            )
        )
        self.post_taps = nn.Parameter(
            torch.stack(
                [
                    conv_taps(sd[p + "post_attention_convolution.conv1d.weight"]),
                    conv_taps(sd[p + "post_mlp_convolution.conv1d.weight"]),
                ]
            )
        )
        wq, qscale = sd[a + "q_proj.linear.weight"], sd[a + "q_proj.norm.scale"]
        self.unfolded = BUG == "clean_qscale_unfolded"
        if self.unfolded:
            self.q_scale = nn.Parameter(qscale.clone())
        else:
            wq = wq * qscale.reshape(-1, 1)
        self.w_qside = nn.Parameter(
            torch.cat(
                [
                    wq,
                    sd[a + "o_proj.gate_proj.weight"],
                    sd[a + "sink_proj.weight"],
                    sd[a + "relative_position_bias.linear.weight"],
                ]
            )
        )
        self.w_kside = nn.Parameter(
            torch.cat([sd[a + "k_proj.linear.weight"], sd[a + "k_proj.sconv.weight_proj.weight"]])
        )
        self.w_vside = nn.Parameter(
            torch.cat([sd[a + "v_proj.linear.weight"], sd[a + "v_proj.sconv.weight_proj.weight"]])
        )
        self.kv_static = nn.Parameter(
            torch.stack([sd[a + "k_proj.sconv.static_weight"], sd[a + "v_proj.sconv.static_weight"]])
        )
        self.rel_scale = nn.Parameter(sd[a + "relative_position_bias.norm.scale"].clone())
        self.rel_bank_t = nn.Parameter(sd[a + "relative_position_bias.proj"].t().contiguous())
        self.w_o_t = nn.Parameter(sd[a + "o_proj.linear.weight"].t().contiguous())
        self.moe = MoE(sd, p + "mlp.", cfg)

    def attention(self, hq, hk, hv, env):
        b, s, _ = hq.shape
        nq, nkv, d = self.nq, self.nkv, self.d
        q, gate, sink, r = (hq @ self.w_qside.t()).split([nq * d, nq * d, nq, nq * self.d_rel], dim=-1)
        k, kdyn = (hk @ self.w_kside.t()).split([nkv * d, nkv * self.k], dim=-1)
        v, vdyn = (hv @ self.w_vside.t()).split([nkv * d, nkv * self.k], dim=-1)
        a = self.name + "self_attn."
        for n, t in (
            ("k_proj.linear", k),
            ("k_proj.sconv.weight_proj", kdyn),
            ("v_proj.linear", v),
            ("v_proj.sconv.weight_proj", vdyn),
            ("relative_position_bias.linear", r),
            ("sink_proj", sink),
            ("o_proj.gate_proj", gate),
        ):
            _tap(a + n, t)
        q = q.view(b, s, nq, d)
        if self.unfolded:
            q = q * self.q_scale
        q = _tap(a + "q_proj.norm.l2_clip", clip(q, self.t_qk))
        q = _tap(
            a + "q_proj", _tap(a + "q_proj.norm", _tap(a + "q_proj.norm.log_scale", log_scale(q, env["logscale"])))
        )
        if _bug("value_norm_before_conv"):
            v = rms(v.view(b, s, nkv, d), None, self.eps).reshape(b, s, -1)
        k = _tap(a + "k_proj.sconv", dynamic_conv(k, kdyn, self.kv_static[0], nkv, env["conv_mask"]))
        v = _tap(a + "v_proj.sconv", dynamic_conv(v, vdyn, self.kv_static[1], nkv, env["conv_mask"]))
        k = _tap(a + "k_proj", _tap(a + "k_proj.norm", clip(k.view(b, s, nkv, d), self.t_qk)))
        v = v.view(b, s, nkv, d)
        if not _bug("value_norm_before_conv"):
            v = rms(v, None, self.eps)
        v = _tap(a + "v_proj", _tap(a + "v_proj.norm", v))
        r = _tap(
            a + "relative_position_bias.norm.l2_clip", clip(r.view(b, s, nq, self.d_rel) * self.rel_scale, self.t_rel)
        )
        r = _tap(
            a + "relative_position_bias.norm",
            _tap(a + "relative_position_bias.norm.log_scale", log_scale(r, env["logscale"])),
        )
        bias = self.rel_bias(r, env["dist"])
        _tap(a + "relative_position_bias", bias.transpose(1, 2))
        o = self.attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, sink.transpose(1, 2), env["mask_full"]
        )
        o = (o * torch.sigmoid(gate)) @ self.w_o_t
        return _tap(a[:-1], _tap(a + "o_proj", _tap(a + "o_proj.linear", o)))

    def forward(self, x, blocks, boundary, env):
        if self.has_attn_mix:
            xq, xk, xv = attn_res(self.mix[:3], blocks, x, self.name + "attention_input")
            if _bug("full_kv_inputs_swapped"):
                xk, xv = xv, xk
        else:
            xq = xk = xv = x
        g = self.gains
        hq, hk, hv = (
            _tap(self.name + n + "_input_layernorm", rms(t, g[j], self.eps))
            for j, (n, t) in enumerate(zip("qkv", (xq, xk, xv)))
        )
        a = self.attention(hq, hk, hv, env)
        a = _tap(self.name + "post_attention_convolution", static_conv(a, self.post_taps[0], env["conv_mask"]))
        if boundary:
            blocks = blocks + [x]
            part = x + a if _bug("block_boundary_residual_kept") else a
        else:
            part = x + a
        m = attn_res(self.mix[-1:], blocks, part, self.name + "mlp_input")[0]
        y = self.moe(_tap(self.name + "post_attention_layernorm", rms(m, g[3], self.eps)))
        y = _tap(self.name + "post_mlp_convolution", static_conv(y, self.post_taps[1], env["conv_mask"]))
        return _tap(self.name[:-1], part + y)


def conv_taps(w):
    """nn.Conv1d depthwise weight (C, 1, K), last tap = current token -> (K, C), tap 0 = current token."""
    w = w[:, 0, :]
    if not _bug("conv_taps_unflipped"):
        w = w.flip(-1)
    return w.t().contiguous()


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        gate_up = sd[p + "experts.gate_up_proj"]  # (E, 2I, H)
        inter = gate_up.shape[1] // 2
        self.w_gate = nn.Parameter(gate_up[:, :inter].transpose(1, 2).contiguous())
        self.w_up = nn.Parameter(gate_up[:, inter:].transpose(1, 2).contiguous())
        self.w_down = nn.Parameter(sd[p + "experts.down_proj"].transpose(1, 2).contiguous())
        self.router_t = nn.Parameter(sd[p + "gate.weight"].t().contiguous())
        self.router_bias = nn.Parameter(sd[p + "gate.e_score_correction_bias"].clone())
        self.top_k, self.route_scale = cfg.num_experts_per_tok, cfg.route_scale
        self.gc, self.uc = cfg.mlp_gate_softcap, cfg.mlp_up_softcap
        self.name = p

    def act(self, g, u):
        if _bug("swiglu_sigmoid_of_capped_gate"):
            g = softcap(g, self.gc)
            return g * torch.sigmoid(g) * softcap(u, self.uc)
        return softcap(g, self.gc) * torch.sigmoid(g) * softcap(u, self.uc)

    def forward(self, x):
        b, s, h = x.shape
        t = x.reshape(-1, h)
        scores = torch.sigmoid(t @ self.router_t)
        _tap(self.name + "gate.score_fn", scores.view(b, s, -1))
        choice = torch.topk(scores + self.router_bias, self.top_k, dim=-1).indices
        src = scores + self.router_bias if _bug("router_weights_with_bias") else scores
        w = src.gather(1, choice)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        if TRACE is not None:
            _tap(self.name + "gate", torch.zeros_like(scores).scatter(1, choice, w).view(b, s, -1))
        out = torch.zeros_like(t)
        if BUG == "clean_experts_dense":
            dense = torch.zeros_like(scores).scatter(1, choice, w)  # (T, E)
            g = torch.einsum("th,ehi->eti", t, self.w_gate)
            u = torch.einsum("th,ehi->eti", t, self.w_up)
            y = torch.einsum("eti,eih->eth", self.act(g, u), self.w_down)
            out = torch.einsum("te,eth->th", dense, y)
        else:
            n_e, inter = self.w_gate.shape[0], self.w_gate.shape[-1]
            acts = {k: t.new_zeros(t.shape[0], n_e, inter) for k in ("", ".gate_softcap", ".up_softcap")}
            for e in range(n_e):
                tok, slot = torch.where(choice == e)
                if tok.numel() == 0:
                    continue
                xe = t[tok]
                g, u = xe @ self.w_gate[e], xe @ self.w_up[e]
                act = self.act(g, u)
                if TRACE is not None:
                    acts[""][tok, e] = act
                    acts[".gate_softcap"][tok, e] = softcap(g, self.gc)
                    acts[".up_softcap"][tok, e] = softcap(u, self.uc)
                ye = act @ self.w_down[e]
                out.index_add_(0, tok, ye * w[tok, slot, None])
            for k, v in acts.items():
                _tap(self.name + "experts.act_fn" + k, v.view(b, s, n_e, inter))
        _tap(self.name + "experts", out.view(b, s, h))
        return _tap(self.name[:-1], out.view(b, s, h))


class Inkling2Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        p = "model."
        self.tok_emb = nn.Parameter(sd[p + "embed_tokens.weight"].clone())
        self.emb_gain = nn.Parameter(sd[p + "embed_tokens.embed_norm.weight"].clone())
        self.out_gain = nn.Parameter(sd[p + "norm.weight"].clone())
        self.out_mix = nn.Parameter(sd[p + "final_input.query"].reshape(1, -1).clone())
        self.head_t = nn.Parameter(sd["lm_head.weight"].t().contiguous())
        self.layers = nn.ModuleList(
            (SlidingLayer if kind == "hybrid_sliding" else FullLayer)(sd, f"{p}layers.{i}.", cfg, i)
            for i, kind in enumerate(cfg.layer_types)
        )
        self.per_block = cfg.n_layers_per_attn_res_block

    def env(self, b, s, attention_mask, position_ids, device):
        cfg = self.cfg
        idx = torch.arange(s, device=device)
        if position_ids is None:
            position_ids = idx[None]
        pos_for_scale = idx[None] if _bug("logscale_from_index") else position_ids
        scale = 1.0 + cfg.log_scaling_alpha * torch.log(
            ((pos_for_scale + 1).float() / cfg.log_scaling_n_floor).clamp(min=1.0)
        )
        if BUG == "clean_rel_distance_positions":
            dist = position_ids[:, :, None] - position_ids[:, None, :]
        else:
            dist = (idx[:, None] - idx[None, :])[None]
        tok_dist = idx[:, None] - idx[None, :]
        causal = tok_dist >= 0
        lim = (
            (tok_dist <= cfg.sliding_window_size)
            if _bug("swa_window_off_by_one")
            else (tok_dist < cfg.sliding_window_size)
        )
        keep_full = causal[None].expand(b, s, s)
        keep_swa = (causal & lim)[None].expand(b, s, s)
        conv_mask = None
        if attention_mask is not None:
            key_ok = attention_mask.bool()[:, None, :]
            keep_full = keep_full & key_ok
            keep_swa = keep_swa & key_ok
            if not bool(attention_mask.bool().all()):
                conv_mask = attention_mask.float()
        zero = torch.zeros((), device=device)
        return {
            "logscale": scale,
            "dist": dist,
            "mask_full": torch.where(keep_full, zero, NEG)[:, None],
            "mask_swa": torch.where(keep_swa, zero, NEG)[:, None],
            "conv_mask": conv_mask,
        }

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        cfg = self.cfg
        b, s = input_ids.shape
        env = self.env(b, s, attention_mask, position_ids, input_ids.device)
        x = rms(self.tok_emb[input_ids], self.emb_gain, cfg.rms_norm_eps)
        _tap("model.embed_tokens", _tap("model.embed_tokens.embed_norm", x))
        blocks = []
        for i, layer in enumerate(self.layers):
            boundary = i % self.per_block == 0
            new = layer(x, blocks, boundary, env)
            if boundary:
                blocks = blocks + [x]
            x = new
        if not _bug("final_attnres_skipped"):
            x = attn_res(self.out_mix, blocks, x, "model.final_input")[0]
        else:
            _tap("model.final_input", x.unsqueeze(-2))  # what takes its place
        x = _tap("model.norm", rms(x, self.out_gain, cfg.rms_norm_eps))
        logits = _tap("lm_head", x @ self.head_t)
        return _tap("logit_softcap", softcap(logits, cfg.final_logit_softcapping)).float()


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    with torch.no_grad():
        model = Inkling2Port(sd, config)
    return model.eval()
