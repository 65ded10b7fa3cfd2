"""Hand-written plain-PyTorch port of Gemma 3n's text decoder (Gemma3nForCausalLM, model_type gemma3n_text).

Architecture as this port implements it (all in float32; H = hidden_size, P = hidden_size_per_layer_input,
L = num_hidden_layers, n = altup_num_inputs, a = altup_active_idx, D = head_dim):
- rms(x, w) = x * (mean(x**2) + eps) ** -0.5 * w, over the last axis, eps = rms_norm_eps. Gemma 3n multiplies by
  w itself (NOT 1 + w as Gemma 1-3 do); the value norm has no weight at all: rms(x) = x * (mean(x**2) + eps)**-0.5.
- token embedding: e = E[ids] * sqrt(H).
- per-layer inputs ("PLE"): ids outside the per-layer table (id >= vocab_size_per_layer_input) look up row 0;
  t = E_ple[ids] * sqrt(P), viewed (B, T, L, P) (layer-major: layer l is columns l*P .. l*P+P-1);
  p = rms((e @ W_plm^T) * H**-0.5 viewed (B, T, L, P), w_plm_norm);   ple = (p + t) * 2**-0.5.
- AltUp streams: s_0 = e; s_i = (e @ A_i^T) * rms_nw(e) / sqrt(max(mean((e @ A_i^T)**2), 1e-5)), i = 1..n-1,
  where rms_nw(e) = mean(e**2) ** 0.5 (no eps): each extra stream rescaled to the magnitude of the embedding.
- decoder layer l (streams S of shape (n, B, T, H)):
    predict: m = tanh(W_router (rms(S_a, w_router_norm) / H));  C[i, j] = (W_pred m)[i * n + j];
             pred_i = S_i + sum_j C[i, j] S_j
    x = pred_a;  xn = rms(x, w_in)
    laurel = xn + rms(W_lr W_ll xn, w_laurel)                       (the LAuReL residual is on the NORMED input)
    attention on xn (below);  att = rms(attn(xn), w_post_attn)
    h = (x + att + laurel) / sqrt(2)
    ffn: g = W_gate rms(h, w_pre_ffw); if sparsity s_l > 0: g = relu(g - (mean(g) + std(g) * Phi^-1(s_l)))
         (std the biased one, over the features);  f = W_down (gelu_tanh(g) * W_up rms(h, w_pre_ffw))
    y = h + rms(f, w_post_ffw)
    correct: m' = tanh(W_router (rms(y, w_router_norm) / H));  c = W_corr m' + 1;
             out_i = pred_i + c_i * (y - pred_a)
    per-layer input: z = out_a * correct_output_scale (if altup_correct_scale);
             z = rms(W_pu (gelu_tanh(W_pg z) * ple[:, :, l]), w_post_ple);  out_i += z for i = 1..n-1
             (Transformers adds it to streams 1.., written [1:], whatever altup_active_idx is)
- attention: q = rms(view_heads(W_q xn + b_q), w_qn), k = rms(view_heads(W_k xn + b_k), w_kn),
  v = rms(view_heads(W_v xn + b_v)) (no weight); RoPE (half rotation) on q and k with theta from
  rope_parameters[layer_type]; NO 1/sqrt(D) score scale (scaling 1.0: q/k norms take its place); GQA (kv head
  = q head // (heads / kv_heads)); no logit softcap in attention. Mask: causal, padding on keys, and for
  sliding layers key j visible from query i only if i - j < sliding_window (index based); masked scores get
  float32's most negative value added (as Transformers does).
- KV sharing: the last num_kv_shared_layers layers compute no k/v; each reuses the (normed, rotated) k/v of the
  LAST earlier non-shared layer OF ITS OWN layer type (and keeps its own q, o and rope).
- end: u_0 = S_0, u_i = (S_i @ U_i^T) rescaled to the magnitude of S_0 (as for the streams above), mean over
  the n streams, rms(., w_final); logits = h @ E^T (tied head: the UNSCALED embedding);
  logits = cap * tanh(logits / cap), cap = final_logit_softcapping.
- positions: position_ids if given, else 0..T-1; attention_mask (B, T) of 1/0 (left padding) masks keys.

Weight layout of this port (own names; built from Transformers' tensors at load):
- tok.table (V, H) raw embedding (the sqrt(H) scale applied in forward); also the tied head.
- ple.table (Vp, L, P): per-layer embedding reshaped to (layer, feature) and pre-multiplied by sqrt(P);
  ple.proj_t (H, L*P) = per_layer_model_projection^T; ple.norm (P,).
- spread.proj_t (n-1, H, H): altup_projections stacked, each transposed; merge.proj_t likewise for the
  altup_unembed_projections; merge.norm (H,) = final norm.
- blocks[l]:
    norms (6, H) rows [input, post_attn, pre_ffw, post_ffw, post_laurel, post_ple];
    attn.wqkv_t (H, (Hq + 2 Hkv) D) = [q | k | v] fused and transposed, attn.bqkv fused bias (only q for a
    KV-sharing layer: attn.wq_t / attn.bq); attn.qk_norm (2, D) rows [q, k]; attn.wo_t (Hq D, H), attn.bo;
    ffn.wgu_t (H, 2 I) = [gate | up] fused and transposed, ffn.wd_t (I, H);
    laurel.wl_t (H, r), laurel.wr_t (r, H);
    mix.router_t (H, n), mix.router_norm (H,), mix.pred (n, n, n) = prediction_coefs^T viewed [k, i, j]
    (k the router output), mix.corr_t (n, n) = correction_coefs^T, mix.out_scale (H,);
    ple_gate_t (H, P), ple_up_t (P, H).
Debugging aid: set the module's TAP to a dict and a forward appends its intermediates there under the names above
(tok, ple.*, spread.i, rope.<type>.cos/sin, blocks.l.{xn, att, mix.*, attn.*, ffn.*, laurel.*, ple_*, out}, merge.*, head).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rmsnorm_one_plus_weight",  # the RMSNorm helper scales by (1 + w) as in Gemma 1-3, not by w (every weighted norm)
    "attn_scale_head_dim",  # attention scores multiplied by head_dim**-0.5; Gemma 3n's scaling is 1.0
    "v_norm_skipped",  # the weightless RMSNorm on the values (no tensor in the checkpoint) is never applied
    "ple_vocab_clamp",  # ids >= vocab_size_per_layer_input clamped to the last per-layer row instead of row 0
    "ple_reshape_transposed",  # per-layer table (Vp, L*P) viewed (Vp, P, L) and transposed: feature-major split
    "rope_local_theta_global",  # sliding layers take the full-attention rope_theta (1e6) instead of their own
    "sliding_window_off_by_one",  # sliding mask keeps i - j <= window: one key more than the window
    "kv_share_previous_layer",  # KV-sharing layers reuse the last non-shared layer's K/V whatever its layer type
    "altup_coefs_transposed",  # prediction coefficients loaded as C[j, i]: the (i, j) view of the flat coefs swapped
    "altup_router_scale_rsqrt",  # AltUp router input scaled by H**-0.5 instead of 1/H (router_input_scale)
    "laurel_residual_unnormed",  # LAuReL residual adds the un-normed stream x instead of the normed input xn
    "sparsity_std_unbiased",  # gaussian top-k cutoff uses torch.std's default (unbiased, N-1) instead of the biased std
    "head_scaled_embedding",  # embedding pre-scaled by sqrt(H) at load and the tied head reads that scaled table
    "sliding_mask_no_padding",  # sliding layers' mask built from causality + window only: padding keys visible
]
PADDING_ONLY = ["sliding_mask_no_padding"]
CLEAN = [
    "attn_sdpa",  # attention through F.scaled_dot_product_attention (scale=1.0, additive float mask, kv heads expanded)
    "rope_split_halves",  # RoPE written per half: [x1 cos - x2 sin, x2 cos + x1 sin] instead of x cos + rotate_half(x) sin
    "altup_loop",  # AltUp predict/correct as explicit loops over stream pairs instead of batched einsums
    "laurel_merged",  # LAuReL's two low-rank factors multiplied into one (H, H) matrix at call time
    "ple_lookup_per_layer",  # per-layer inputs gathered and combined inside each layer from its slice of the table
]


#: a debugging aid: set to a dict and every forward records its intermediates under this port's own names
TAP = None


def _bug(name):
    return BUG == name


def _tap(name, value):
    if TAP is not None:
        TAP.setdefault(name, []).append(value)
    return value


def rms(x, w, eps):
    """Gemma 3n RMSNorm: x * (mean(x^2) + eps)^-0.5 * w (w None: no weight)."""
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if w is None:
        return y
    if _bug("rmsnorm_one_plus_weight"):
        return y * (1.0 + w)
    return y * w


def rescale_to(x, target_rms):
    """x rescaled to the magnitude target_rms (mean square of x clamped at 1e-5)."""
    return x * target_rms / torch.sqrt(x.pow(2).mean(-1, keepdim=True).clamp(min=1e-5))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x (B, T, heads, D); cos/sin (B, T, D)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if BUG == "rope_split_halves":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        c, s = cos[..., :h], sin[..., :h]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return x * cos + rotate_half(x) * sin


class TokenEmbed(nn.Module):
    def __init__(self, weight, hidden):
        super().__init__()
        self.scale = math.sqrt(hidden)
        if _bug("head_scaled_embedding"):  # fold the scale into the table (and the tied head reads it)
            self.table = nn.Parameter(weight * self.scale, requires_grad=False)
            self.scale = 1.0
        else:
            self.table = nn.Parameter(weight.clone(), requires_grad=False)

    def forward(self, ids):
        return _tap("tok", self.table[ids] * self.scale)


class PerLayerEmbed(nn.Module):
    def __init__(self, table, proj, norm, n_layers, p, hidden, eps):
        super().__init__()
        vp = table.shape[0]
        if _bug("ple_reshape_transposed"):
            t = table.view(vp, p, n_layers).transpose(1, 2)
        else:
            t = table.view(vp, n_layers, p)
        self.table = nn.Parameter((t * math.sqrt(p)).contiguous(), requires_grad=False)
        self.proj_t = nn.Parameter(proj.t().contiguous(), requires_grad=False)
        self.norm = nn.Parameter(norm.clone(), requires_grad=False)
        self.n_layers, self.p, self.hidden, self.eps = n_layers, p, hidden, eps

    def lookup(self, ids):
        vp = self.table.shape[0]
        if _bug("ple_vocab_clamp"):
            ids = ids.clamp(0, vp - 1)
        else:
            ids = torch.where((ids >= 0) & (ids < vp), ids, torch.zeros_like(ids))
        return _tap("ple.lookup", self.table[ids])  # (B, T, L, P)

    def project(self, e):
        proj = _tap("ple.proj", e @ self.proj_t) * self.hidden**-0.5
        return _tap("ple.norm", rms(proj.view(*e.shape[:-1], self.n_layers, self.p), self.norm, self.eps))

    def forward(self, ids, e):
        return (self.project(e) + self.lookup(ids)) * (1.0 / math.sqrt(2.0))

    def layer_input(self, ids, e, layer):
        """The per-layer input of one layer only (the CLEAN ple_lookup_per_layer path)."""
        vp = self.table.shape[0]
        ids = torch.where((ids >= 0) & (ids < vp), ids, torch.zeros_like(ids))
        t = F.embedding(ids, self.table[:, layer, :])
        cols = self.proj_t[:, layer * self.p : (layer + 1) * self.p]
        proj = rms((e @ cols) * self.hidden**-0.5, self.norm, self.eps)
        return (proj + t) * (1.0 / math.sqrt(2.0))


class AltUpSpread(nn.Module):
    def __init__(self, projs):
        super().__init__()
        self.proj_t = nn.Parameter(torch.stack([w.t() for w in projs]), requires_grad=False)

    def forward(self, e):
        target = e.pow(2).mean(-1, keepdim=True) ** 0.5
        streams = [e] + [rescale_to(_tap(f"spread.{i}", e @ w), target) for i, w in enumerate(self.proj_t)]
        return torch.stack(streams, dim=0)


class AltUpMerge(nn.Module):
    def __init__(self, projs, norm, eps):
        super().__init__()
        self.proj_t = nn.Parameter(torch.stack([w.t() for w in projs]), requires_grad=False)
        self.norm = nn.Parameter(norm.clone(), requires_grad=False)
        self.eps = eps

    def forward(self, streams):
        target = streams[0].pow(2).mean(-1, keepdim=True) ** 0.5
        outs = [streams[0]]
        outs += [
            rescale_to(_tap(f"merge.{i}", s @ w), target) for i, (s, w) in enumerate(zip(streams[1:], self.proj_t))
        ]
        return _tap("merge.norm", rms(torch.stack(outs, dim=0).mean(0), self.norm, self.eps))


class AltUpMix(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        n = cfg.altup_num_inputs
        self.n, self.active, self.hidden, self.eps = n, cfg.altup_active_idx, cfg.hidden_size, cfg.rms_norm_eps
        self.router_t = nn.Parameter(sd[pre + "modality_router.weight"].t().contiguous(), requires_grad=False)
        self.router_norm = nn.Parameter(sd[pre + "router_norm.weight"].clone(), requires_grad=False)
        pred = sd[pre + "prediction_coefs.weight"].t().reshape(n, n, n)  # [k, i, j]
        if _bug("altup_coefs_transposed"):
            pred = pred.transpose(1, 2)
        self.pred = nn.Parameter(pred.contiguous(), requires_grad=False)
        self.corr_t = nn.Parameter(sd[pre + "correction_coefs.weight"].t().contiguous(), requires_grad=False)
        self.out_scale = nn.Parameter(sd[pre + "correct_output_scale"].clone(), requires_grad=False)
        self.use_out_scale = bool(cfg.altup_correct_scale)

    def route(self, x):
        scale = self.hidden**-0.5 if _bug("altup_router_scale_rsqrt") else 1.0 / self.hidden
        normed = _tap(self.name + ".router_norm", rms(x, self.router_norm, self.eps))
        return torch.tanh(_tap(self.name + ".router", (normed * scale) @ self.router_t))  # (B, T, n)

    def predict(self, streams):
        m = self.route(streams[self.active])
        coefs = _tap(self.name + ".pred_coefs", torch.einsum("btk,kij->btij", m, self.pred))
        if BUG == "altup_loop":
            out = []
            for i in range(self.n):
                acc = streams[i].clone()
                for j in range(self.n):
                    acc = acc + coefs[:, :, i, j, None] * streams[j]
                out.append(acc)
            return torch.stack(out, 0)
        return streams + torch.einsum("btij,jbth->ibth", coefs, streams)

    def correct(self, pred, y):
        c = _tap(self.name + ".corr_coefs", self.route(y) @ self.corr_t) + 1.0  # (B, T, n)
        innov = y - pred[self.active]
        if BUG == "altup_loop":
            return torch.stack([pred[i] + c[:, :, i, None] * innov for i in range(self.n)], 0)
        return pred + c.permute(2, 0, 1)[..., None] * innov[None]


class Laurel(nn.Module):
    def __init__(self, left, right):
        super().__init__()
        self.wl_t = nn.Parameter(left.t().contiguous(), requires_grad=False)
        self.wr_t = nn.Parameter(right.t().contiguous(), requires_grad=False)

    def forward(self, xn):
        if BUG == "laurel_merged":
            return xn @ (self.wl_t @ self.wr_t)
        return _tap(self.name + ".right", _tap(self.name + ".left", xn @ self.wl_t) @ self.wr_t)


class GatedFFN(nn.Module):
    def __init__(self, gate, up, down, sparsity):
        super().__init__()
        self.wgu_t = nn.Parameter(torch.cat([gate, up], 0).t().contiguous(), requires_grad=False)
        self.wd_t = nn.Parameter(down.t().contiguous(), requires_grad=False)
        self.inter = gate.shape[0]
        self.sparsity = float(sparsity)

    def forward(self, x):
        g, u = (x @ self.wgu_t).split(self.inter, dim=-1)
        _tap(self.name + ".gate", g), _tap(self.name + ".up", u)
        if self.sparsity > 0.0:
            p = torch.tensor(self.sparsity, dtype=torch.float32)
            mult = torch.erfinv(2 * p - 1) * math.sqrt(2)  # standard normal quantile Phi^-1(sparsity)
            std = g.std(-1, keepdim=True) if _bug("sparsity_std_unbiased") else g.std(-1, keepdim=True, unbiased=False)
            g = F.relu(g - (g.mean(-1, keepdim=True) + std * mult))
        return _tap(self.name + ".down", (_tap(self.name + ".act", F.gelu(g, approximate="tanh")) * u) @ self.wd_t)


class Attention(nn.Module):
    def __init__(self, sd, pre, cfg, shared):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.shared = shared

        def b(name, rows):
            return sd.get(pre + name + ".bias", torch.zeros(rows))

        if shared:
            self.wq_t = nn.Parameter(sd[pre + "q_proj.weight"].t().contiguous(), requires_grad=False)
            self.bq = nn.Parameter(b("q_proj", self.nh * self.d).clone(), requires_grad=False)
            self.qk_norm = nn.Parameter(
                torch.stack([sd[pre + "q_norm.weight"], torch.ones(self.d)]), requires_grad=False
            )
        else:
            w = torch.cat([sd[pre + f"{p}_proj.weight"] for p in "qkv"], 0)
            self.wqkv_t = nn.Parameter(w.t().contiguous(), requires_grad=False)
            bias = torch.cat(
                [b("q_proj", self.nh * self.d), b("k_proj", self.nkv * self.d), b("v_proj", self.nkv * self.d)]
            )
            self.bqkv = nn.Parameter(bias, requires_grad=False)
            self.qk_norm = nn.Parameter(
                torch.stack([sd[pre + "q_norm.weight"], sd[pre + "k_norm.weight"]]), requires_grad=False
            )
        self.wo_t = nn.Parameter(sd[pre + "o_proj.weight"].t().contiguous(), requires_grad=False)
        self.bo = nn.Parameter(b("o_proj", self.wo_t.shape[1]).clone(), requires_grad=False)

    def forward(self, xn, cos, sin, mask_add, shared_kv):
        B, T, _ = xn.shape
        if self.shared:
            q = _tap(self.name + ".q", xn @ self.wq_t + self.bq).view(B, T, self.nh, self.d)
            k, v = shared_kv
        else:
            qkv = xn @ self.wqkv_t + self.bqkv
            q, k, v = qkv.split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
            _tap(self.name + ".q", q), _tap(self.name + ".k", k), _tap(self.name + ".v", v)
            q = q.view(B, T, self.nh, self.d)
            k = _tap(self.name + ".k_normed", rms(k.view(B, T, self.nkv, self.d), self.qk_norm[1], self.eps))
            v = v.view(B, T, self.nkv, self.d)
            if not _bug("v_norm_skipped"):
                v = rms(v, None, self.eps)
            _tap(self.name + ".v_normed", v)
            k = apply_rope(k, cos, sin)
        q = apply_rope(_tap(self.name + ".q_normed", rms(q, self.qk_norm[0], self.eps)), cos, sin)
        kv_state = (k, v)

        rep = self.nh // self.nkv
        qh = q.transpose(1, 2)  # (B, nh, T, D)
        kh = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        scale = self.d**-0.5 if _bug("attn_scale_head_dim") else 1.0
        if BUG == "attn_sdpa":
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask_add[:, None], scale=scale)
        else:
            scores = (qh @ kh.transpose(-1, -2)) * scale + mask_add[:, None]
            o = torch.softmax(scores, dim=-1) @ vh
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.d)
        return _tap(self.name + ".out", o @ self.wo_t + self.bo), kv_state


class Block(nn.Module):
    def __init__(self, sd, layer, cfg, shared):
        super().__init__()
        pre = f"model.layers.{layer}."
        self.layer, self.eps = layer, cfg.rms_norm_eps
        self.kind = cfg.layer_types[layer]
        self.active = cfg.altup_active_idx
        names = [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "laurel.post_laurel_norm",
            "post_per_layer_input_norm",
        ]
        self.norms = nn.Parameter(torch.stack([sd[pre + k + ".weight"] for k in names]), requires_grad=False)
        self.attn = Attention(sd, pre + "self_attn.", cfg, shared)
        self.ffn = GatedFFN(
            sd[pre + "mlp.gate_proj.weight"],
            sd[pre + "mlp.up_proj.weight"],
            sd[pre + "mlp.down_proj.weight"],
            cfg.activation_sparsity_pattern[layer],
        )
        self.laurel = Laurel(sd[pre + "laurel.linear_left.weight"], sd[pre + "laurel.linear_right.weight"])
        self.mix = AltUpMix(sd, pre + "altup.", cfg)
        self.ple_gate_t = nn.Parameter(sd[pre + "per_layer_input_gate.weight"].t().contiguous(), requires_grad=False)
        self.ple_up_t = nn.Parameter(sd[pre + "per_layer_projection.weight"].t().contiguous(), requires_grad=False)
        self.name = f"blocks.{layer}"
        self.attn.name, self.ffn.name = self.name + ".attn", self.name + ".ffn"
        self.laurel.name, self.mix.name = self.name + ".laurel", self.name + ".mix"

    def forward(self, streams, cos, sin, mask_add, shared_kv, ple_in):
        w_in, w_pa, w_pf, w_pof, w_lau, w_ple = self.norms
        pred = self.mix.predict(streams)
        x = pred[self.active]
        xn = _tap(self.name + ".xn", rms(x, w_in, self.eps))
        lau = _tap(self.name + ".laurel.norm", rms(self.laurel(xn), w_lau, self.eps))
        lau = _tap(self.name + ".laurel.out", (x if _bug("laurel_residual_unnormed") else xn) + lau)
        att, kv_state = self.attn(xn, cos, sin, mask_add, shared_kv)
        att = _tap(self.name + ".att", rms(att, w_pa, self.eps))
        h = (x + att + lau) / math.sqrt(2.0)
        hn = _tap(self.name + ".pre_ffn", rms(h, w_pf, self.eps))
        y = h + _tap(self.name + ".post_ffn", rms(self.ffn(hn), w_pof, self.eps))
        out = self.mix.correct(pred, y)
        z = out[self.active]
        if self.mix.use_out_scale:
            z = _tap(self.name + ".scaled", z * self.mix.out_scale)
        z = _tap(self.name + ".ple_act", F.gelu(_tap(self.name + ".ple_gate", z @ self.ple_gate_t), approximate="tanh"))
        z = z * ple_in
        z = _tap(self.name + ".ple_norm", rms(_tap(self.name + ".ple_up", z @ self.ple_up_t), w_ple, self.eps))
        out = _tap(self.name + ".out", torch.cat([out[:1], out[1:] + z], dim=0))
        return out, kv_state


class Gemma3nPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        sd = {k: v.float() for k, v in sd.items()}
        L, H = cfg.num_hidden_layers, cfg.hidden_size
        self.n_layers, self.kinds = L, list(cfg.layer_types)
        self.window = cfg.sliding_window
        self.softcap = cfg.final_logit_softcapping
        self.head_dim = cfg.head_dim
        rp = cfg.rope_parameters
        self.theta = {k: float(rp[k]["rope_theta"]) for k in set(self.kinds)}
        if _bug("rope_local_theta_global"):
            self.theta = {k: float(rp["full_attention"]["rope_theta"]) for k in self.theta}

        # which layer's K/V each KV-sharing layer reuses (None: computes its own)
        first_shared = L - cfg.num_kv_shared_layers if cfg.num_kv_shared_layers else L
        self.kv_source = [None] * L
        for i in range(first_shared, L):
            if _bug("kv_share_previous_layer"):
                self.kv_source[i] = first_shared - 1
            else:
                self.kv_source[i] = max(j for j in range(first_shared) if self.kinds[j] == self.kinds[i])

        self.tok = TokenEmbed(sd["model.embed_tokens.weight"], H)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", True)) or "lm_head.weight" not in sd
        if not self.tied:
            self.head_t = nn.Parameter(sd["lm_head.weight"].t().contiguous(), requires_grad=False)
        self.ple = PerLayerEmbed(
            sd["model.embed_tokens_per_layer.weight"],
            sd["model.per_layer_model_projection.weight"],
            sd["model.per_layer_projection_norm.weight"],
            L,
            cfg.hidden_size_per_layer_input,
            H,
            cfg.rms_norm_eps,
        )
        n = cfg.altup_num_inputs
        self.spread = AltUpSpread([sd[f"model.altup_projections.{i}.weight"] for i in range(n - 1)])
        self.blocks = nn.ModuleList([Block(sd, i, cfg, self.kv_source[i] is not None) for i in range(L)])
        self.merge = AltUpMerge(
            [sd[f"model.altup_unembed_projections.{i}.weight"] for i in range(n - 1)],
            sd["model.norm.weight"],
            cfg.rms_norm_eps,
        )

    def rope(self, positions, kind):
        d = self.head_dim
        inv = 1.0 / (self.theta[kind] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        f = positions[..., None].float() * inv
        emb = torch.cat((f, f), dim=-1)
        return _tap(f"rope.{kind}.cos", emb.cos()), _tap(f"rope.{kind}.sin", emb.sin())

    def masks(self, attention_mask, B, T):
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        causal = (j <= i)[None].expand(B, T, T)
        keys = (
            attention_mask.bool()[:, None, :] if attention_mask is not None else torch.ones(B, 1, T, dtype=torch.bool)
        )
        w = self.window + 1 if _bug("sliding_window_off_by_one") else self.window
        window = (i - j < w)[None]
        neg = torch.finfo(torch.float32).min
        out = {}
        for kind in set(self.kinds):
            allowed = causal & keys
            if kind == "sliding_attention":
                allowed = (causal & window) if _bug("sliding_mask_no_padding") else (allowed & window)
            out[kind] = torch.zeros(B, T, T).masked_fill(~allowed, neg)
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        position_ids = position_ids.expand(B, T)
        e = self.tok(input_ids)
        per_layer = BUG == "ple_lookup_per_layer"
        ple = None if per_layer else self.ple(input_ids, e)
        streams = self.spread(e)
        ropes = {k: self.rope(position_ids, k) for k in set(self.kinds)}
        masks = self.masks(attention_mask, B, T)
        kv = {}
        for i, blk in enumerate(self.blocks):
            kind = self.kinds[i]
            ple_i = self.ple.layer_input(input_ids, e, i) if per_layer else ple[:, :, i]
            src = self.kv_source[i]
            streams, kv_state = blk(streams, *ropes[kind], masks[kind], kv.get(src), ple_i)
            if src is None:
                kv[i] = kv_state
        h = self.merge(streams)
        head_t = self.tok.table.t() if self.tied else self.head_t
        logits = _tap("head", h @ head_t)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def build(state_dict, config):
    return Gemma3nPort(state_dict, config).eval()
