"""Hand-written plain-PyTorch port of the Inkling text decoder (InklingForCausalLM, model_type `inkling_text`).

Architecture as this port implements it (no rotary embedding anywhere; order inside a row is carried by short
causal convolutions and a learned relative-position bias, both counted on the row index):
- embedding: token table, then an RMSNorm over the embedding (gain * x / rms, eps = config.rms_norm_eps).
- "sconv" = depthwise causal convolution with a built-in residual: y[t] = x[t] + sum_s tap[s] * x'[t - s],
  s = 0..K-1 (K = config.conv_kernel_size), where x' is x with the padding positions zeroed (x itself, unmasked,
  is the residual). Four per layer: on the key projection, on the value projection, on the attention output
  (after o_proj) and on the MLP output.
- decoder layer: h = h + sconv_attn(Attn(RMSNorm(h)));  h = h + sconv_mlp(FFN(RMSNorm(h))).
- attention, per layer type (config.layer_types: "hybrid" = full causal, "hybrid_sliding" = sliding window):
  full layers use num_attention_heads / num_key_value_heads / head_dim, sliding layers the swa_* fields and a
  window of sliding_window_size keys (key j visible from query i when 0 <= i - j < window).
  q = q_proj(x); k = sconv_k(k_proj(x)); v = sconv_v(v_proj(x)); r = r_proj(x) (num_heads * d_rel);
  q and k RMS-normalised per head (own gains), score scale 1 / head_dim (not 1/sqrt: q, k are normalised);
  relative bias: R = r_head @ P, P (d_rel, extent), extent = rel_extent (full) or sliding_window_size (sliding);
  bias[h, i, j] = R[i, h, i - j] for 0 <= i - j < extent, else 0;
  full layers with log_scaling_n_floor set: tau_i = 1 + alpha * log(max((i + 1) / n_floor, 1)) (i the row index,
  as the reference counts it, also under left padding) multiplies the query and the bias;
  scores = q k^T / head_dim + bias, masked (causal, padding, window), softmax, GQA (query head h reads kv head
  h // (nq / nkv)), o_proj.
- FFN, per config.mlp_layer_types: "dense" = SwiGLU MLP times a learned scalar global_scale;
  "sparse" = MoE: router logits over n_routed + n_shared experts (routed first); the top-k routed experts are
  chosen on sigmoid(logit) + correction bias; the chosen routed logits and all shared logits are turned into
  weights sigmoid(l) / sum sigmoid(l) over those k + n_shared entries (the shared experts act as a sink), times
  route_scale * router global_scale; out = sum_k w_k E_k(x) + sum_j w_j S_j(x), every expert a SwiGLU.
- final RMSNorm, hidden divided by logits_mup_width_multiplier, untied lm_head.
Weight layout of this port (own names):
- tok (V, H); emb_g (H,); fin (H,); head_t (H, V) = lm_head transposed.
- per layer `layers[i]`: g_in / g_post (H,); w_in (H, nq hd + 2 nkv hd + nq d_rel) = [q | k | v | r] fused and
  transposed; qg / kg (hd,); kv_taps (K, 2 nkv hd): the k and v conv kernels side by side, row s the tap of lag s
  (the reference's conv1d kernel reversed in time); rel (extent, d_rel) = P transposed (row = distance);
  w_o (nq hd, H); attn_taps / mlp_taps (K, H) by lag;
  dense: w_gu (H, 2I) = [gate | up] transposed, w_dn (I, H), gs (1,);
  MoE: w_rt (H, E + ns) router transposed, cbias (E,), rgain (1,) router global_scale;
  ex_gu (E, H, 2I) = [gate | up] per expert transposed, ex_dn (E, I, H); sh_gu (ns, H, 2I), sh_dn (ns, I, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "inkling_attn_scale_rsqrt",  # scores scaled by 1/sqrt(head_dim) instead of 1/head_dim (q, k are RMS-normalised)
    "inkling_embed_norm_skipped",  # the RMSNorm on the token embedding is never applied
    "inkling_mup_applied_twice",  # final hidden divided by logits_mup_width_multiplier twice (once more at the head)
    "inkling_sconv_no_residual",  # short convolutions return conv(x) without adding their input back
    "inkling_sconv_taps_reversed",  # conv kernels loaded in the reference's time order, not reversed to lag order
    "inkling_k_norm_before_sconv",  # key RMSNorm applied to k_proj output before the key short conv, not after
    "inkling_rel_extent_clamped",  # relative bias beyond the extent takes the last column instead of being zero
    "inkling_rel_states_dim_order",  # r_proj output viewed as (d_rel, heads) instead of (heads, d_rel)
    "inkling_log_scale_bias_unscaled",  # log-scaling tau multiplies the query only, not the relative bias
    "inkling_router_bias_in_weights",  # correction bias added to the sigmoid scores used as combine weights too
    "inkling_no_shared_sink",  # routed weights normalised among themselves; shared experts get a raw sigmoid
    "inkling_expert_gate_up_swapped",  # fused expert gate_up_proj split as [up | gate] when loading
    "inkling_swa_window_from_rel_extent",  # sliding-window width read from config.rel_extent, not sliding_window_size
    "inkling_sconv_pad_not_masked",  # padding positions not zeroed before the short convs (left padding leaks)
]
PADDING_ONLY = {"inkling_sconv_pad_not_masked"}
CLEAN = [
    "inkling_sdpa",  # attention through F.scaled_dot_product_attention with the bias and mask as one float mask
    "inkling_conv1d",  # short convs as grouped F.conv1d with left padding (kernel re-reversed to time order)
    "inkling_dense_experts",  # every expert on every token, routed and shared combined through a dense weight matrix
    "inkling_rel_onehot",  # relative bias from a one-hot distance tensor contracted with P, no gather
    "inkling_tau_on_scores",  # log-scaling tau applied to the summed scores (q k^T / d + bias) instead of q and bias
]


def _rms(x, g, eps):
    x = x.float()
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _taps(w):
    """The reference's conv1d weight (C, 1, K), cross-correlation in time order, as (K, C) rows by lag."""
    w = w.squeeze(1)
    if BUG != "inkling_sconv_taps_reversed":
        w = w.flip(-1)
    return w.t().contiguous()


class InklingPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.eps = cfg.rms_norm_eps
        self.mup = cfg.logits_mup_width_multiplier
        self.n_floor = cfg.log_scaling_n_floor
        self.alpha = cfg.log_scaling_alpha
        self.E = cfg.n_routed_experts
        self.ns = cfg.n_shared_experts
        self.topk = cfg.num_experts_per_tok
        self.route_scale = cfg.route_scale
        self.unpadded = getattr(cfg, "unpadded_vocab_size", None)
        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.emb_g = nn.Parameter(g("model.embed_tokens.embed_norm.weight"))
        self.fin = nn.Parameter(g("model.norm.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            L = nn.Module()
            L.sliding = cfg.layer_types[i] == "hybrid_sliding"
            if L.sliding:
                L.nq, L.nkv, L.hd = cfg.swa_num_attention_heads, cfg.swa_num_key_value_heads, cfg.swa_head_dim
                L.window = cfg.sliding_window_size
            else:
                L.nq, L.nkv, L.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
                L.window = None
            L.g_in = nn.Parameter(g(p + "input_layernorm.weight"))
            L.g_post = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            parts = [g(a + f"{n}_proj.weight") for n in "qkvr"]
            L.w_in = nn.Parameter(torch.cat(parts, 0).t().contiguous())
            L.split = [t.shape[0] for t in parts]
            L.qg = nn.Parameter(g(a + "q_norm.weight"))
            L.kg = nn.Parameter(g(a + "k_norm.weight"))
            kv = torch.cat([g(a + "k_sconv.conv1d.weight"), g(a + "v_sconv.conv1d.weight")], 0)
            L.kv_taps = nn.Parameter(_taps(kv))
            L.rel = nn.Parameter(g(a + "rel_logits_proj.proj").t().contiguous())
            L.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            L.attn_taps = nn.Parameter(_taps(g(p + "attn_sconv.conv1d.weight")))
            L.mlp_taps = nn.Parameter(_taps(g(p + "mlp_sconv.conv1d.weight")))
            L.sparse = cfg.mlp_layer_types[i] == "sparse"
            if L.sparse:
                L.w_rt = nn.Parameter(g(m + "gate.weight").t().contiguous())
                L.cbias = nn.Parameter(g(m + "gate.e_score_correction_bias"))
                L.rgain = nn.Parameter(g(m + "gate.global_scale"))
                gu = g(m + "experts.gate_up_proj")  # (E, 2I, H), gate rows first
                gate, up = gu.chunk(2, 1)
                if BUG == "inkling_expert_gate_up_swapped":
                    gate, up = up, gate
                L.ex_gu = nn.Parameter(torch.cat([gate, up], 1).transpose(1, 2).contiguous())
                L.ex_dn = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous())
                sg, su = g(m + "shared_experts.gate_proj"), g(m + "shared_experts.up_proj")
                L.sh_gu = nn.Parameter(torch.cat([sg, su], 1).transpose(1, 2).contiguous())
                L.sh_dn = nn.Parameter(g(m + "shared_experts.down_proj").transpose(1, 2).contiguous())
            else:
                L.w_gu = nn.Parameter(
                    torch.cat([g(m + "gate_proj.weight"), g(m + "up_proj.weight")], 0).t().contiguous()
                )
                L.w_dn = nn.Parameter(g(m + "down_proj.weight").t().contiguous())
                L.gs = nn.Parameter(g(m + "global_scale"))
            self.layers.append(L)
        self.rel_extent_cfg = cfg.rel_extent

    # ---- short causal convolution with its residual ----
    def _sconv(self, x, taps, keep):
        x = x.float()
        xm = x if keep is None or BUG == "inkling_sconv_pad_not_masked" else x * keep[..., None]
        K, S = taps.shape[0], x.shape[1]
        if BUG == "inkling_conv1d":
            w = taps.flip(0).t()[:, None, :]  # (C, 1, K) time order
            y = F.conv1d(F.pad(xm.transpose(1, 2), (K - 1, 0)), w, groups=w.shape[0]).transpose(1, 2)
        else:
            y = torch.zeros_like(xm)
            for s in range(min(K, S)):
                y[:, s:] += taps[s] * xm[:, : S - s]
        return y if BUG == "inkling_sconv_no_residual" else x + y

    # ---- relative position bias (B, nq, S, S) ----
    def _rel_bias(self, L, r):
        S = r.shape[1]
        extent = L.rel.shape[0]
        idx = torch.arange(S)
        dist = idx[:, None] - idx[None, :]
        inside = (dist >= 0) & (dist < extent)
        if BUG == "inkling_rel_extent_clamped":
            inside = dist >= 0
        if BUG == "inkling_rel_onehot":
            onehot = F.one_hot(dist.clamp(0, extent - 1), extent).float() * inside[..., None]
            table = onehot @ L.rel  # (S, S, d_rel)
            return torch.einsum("bihd,ijd->bhij", r, table)
        logits = (r @ L.rel.t()).transpose(1, 2)  # (B, nq, S, extent)
        gi = dist.clamp(0, extent - 1)[None, None].expand(*logits.shape[:2], S, S)
        return logits.gather(-1, gi).masked_fill(~inside, 0.0)

    def _attn(self, L, x, keep):
        B, S, _ = x.shape
        nq, nkv, hd = L.nq, L.nkv, L.hd
        q, k, v, r = (x @ L.w_in).split(L.split, -1)
        if BUG == "inkling_k_norm_before_sconv":
            k = _rms(k.view(B, S, nkv, hd), L.kg, self.eps).reshape(B, S, nkv * hd)
        kv = self._sconv(torch.cat([k, v], -1), L.kv_taps, keep)
        k, v = kv.split([nkv * hd, nkv * hd], -1)
        q = _rms(q.view(B, S, nq, hd), L.qg, self.eps).transpose(1, 2)
        if BUG == "inkling_k_norm_before_sconv":
            k = k.view(B, S, nkv, hd).transpose(1, 2)
        else:
            k = _rms(k.view(B, S, nkv, hd), L.kg, self.eps).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        if BUG == "inkling_rel_states_dim_order":
            r = r.view(B, S, -1, nq).transpose(2, 3)
        else:
            r = r.view(B, S, nq, -1)
        bias = self._rel_bias(L, r)
        tau = None
        if not L.sliding and self.n_floor is not None:
            n = torch.arange(1, S + 1, dtype=torch.float32)
            tau = (1.0 + self.alpha * torch.log((n / self.n_floor).clamp(min=1.0))).view(1, 1, S, 1)
            if BUG != "inkling_tau_on_scores":
                q = q * tau
                if BUG != "inkling_log_scale_bias_unscaled":
                    bias = bias * tau
        # which keys each query sees: causal, not padding, inside the window
        i = torch.arange(S)
        dist = i[:, None] - i[None, :]
        allowed = dist >= 0
        if L.sliding:
            window = self.rel_extent_cfg if BUG == "inkling_swa_window_from_rel_extent" else L.window
            allowed = allowed & (dist < window)
        allowed = allowed[None, None]
        if keep is not None:
            allowed = allowed & keep.bool()[:, None, None, :]
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = 1.0 / math.sqrt(hd) if BUG == "inkling_attn_scale_rsqrt" else 1.0 / hd
        low = torch.finfo(torch.float32).min
        if BUG == "inkling_sdpa":
            mask = torch.where(allowed, bias, torch.full_like(bias, low))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            sc = (q @ k.transpose(-1, -2)) * scale + bias
            if BUG == "inkling_tau_on_scores" and tau is not None:
                sc = sc * tau
            o = sc.masked_fill(~allowed, low).softmax(-1) @ v
        o = o.transpose(1, 2).reshape(B, S, nq * hd)
        return o @ L.w_o

    # ---- feed-forward ----
    def _dense(self, L, x):
        gt, up = (x @ L.w_gu).chunk(2, -1)
        return ((F.silu(gt) * up) @ L.w_dn) * L.gs

    def _moe(self, L, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        N, E, ns = t.shape[0], self.E, self.ns
        logits = t @ L.w_rt  # (N, E + ns), routed columns first
        routed, shared = logits[:, :E], logits[:, E:]
        choice = routed.sigmoid() + L.cbias
        idx = choice.topk(self.topk, -1).indices
        s_r = routed.gather(1, idx).sigmoid()
        s_s = shared.sigmoid()
        if BUG == "inkling_router_bias_in_weights":
            s_r = s_r + L.cbias[idx]
        if BUG == "inkling_no_shared_sink":
            w_r = s_r / s_r.sum(-1, keepdim=True)
            w_s = s_s
        else:
            tot = s_r.sum(-1, keepdim=True) + s_s.sum(-1, keepdim=True)
            w_r, w_s = s_r / tot, s_s / tot
        gain = self.route_scale * L.rgain
        w_r, w_s = w_r * gain, w_s * gain

        def swiglu(h, gu, dn):  # h (..., H), gu (..., H, 2I), dn (..., I, H) batched over the leading dims
            a, b = (h.unsqueeze(-2) @ gu).squeeze(-2).chunk(2, -1)
            return ((F.silu(a) * b).unsqueeze(-2) @ dn).squeeze(-2)

        if BUG == "inkling_dense_experts":
            dense = torch.zeros(N, E).scatter(1, idx, w_r)
            wts = torch.cat([dense, w_s], 1)  # (N, E + ns)
            gu = torch.cat([L.ex_gu, L.sh_gu], 0)
            dn = torch.cat([L.ex_dn, L.sh_dn], 0)
            a, b = torch.einsum("nh,ehf->enf", t, gu).chunk(2, -1)
            outs = torch.einsum("enf,efh->enh", F.silu(a) * b, dn)
            out = torch.einsum("ne,enh->nh", wts, outs)
        else:
            out = torch.zeros_like(t)
            for e in range(E):
                tok_i, slot = torch.where(idx == e)
                if tok_i.numel():
                    y = swiglu(t[tok_i], L.ex_gu[e], L.ex_dn[e])
                    out.index_add_(0, tok_i, y * w_r[tok_i, slot, None])
            for j in range(ns):
                out = out + swiglu(t, L.sh_gu[j], L.sh_dn[j]) * w_s[:, j, None]
        return out.view(B, S, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        # position_ids are accepted for the common interface: Inkling has no rotary embedding, and its relative
        # bias and log-scaling count on the row index (as the reference does)
        keep = None
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            keep = attention_mask.float()
        h = self.tok[input_ids]
        if BUG != "inkling_embed_norm_skipped":
            h = _rms(h, self.emb_g, self.eps)
        for L in self.layers:
            a = self._attn(L, _rms(h, L.g_in, self.eps), keep)
            h = h + self._sconv(a, L.attn_taps, keep)
            x = _rms(h, L.g_post, self.eps)
            f = self._moe(L, x) if L.sparse else self._dense(L, x)
            h = h + self._sconv(f, L.mlp_taps, keep)
        h = _rms(h, self.fin, self.eps) / self.mup
        if BUG == "inkling_mup_applied_twice":
            h = h / self.mup
        logits = h @ self.head_t
        if self.unpadded is not None and self.unpadded < logits.shape[-1]:
            logits = logits[..., : self.unpadded]
        return logits


def build(state_dict, config):
    return InklingPort(state_dict, config).eval()
