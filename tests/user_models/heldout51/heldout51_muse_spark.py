"""A from-scratch PyTorch port of the text path of Muse Spark (``muse_spark``, ``MuseSparkForConditionalGeneration``).

Architecture (text path only; D = hidden_size, H = num_attention_heads, G = num_key_value_heads, d = head_dim,
I = intermediate_size, M = moe_hidden_size, F = moe_intermediate_size, E = num_local_experts, K = top-k,
V = vocab_size; rms(x) = sqrt(mean(x^2, -1) + eps)):

  embedding       h0 = e / rms(e),  e = Emb[ids]                              (weightless norm, eps = rms_norm_eps)
  decoder layer i (x -> y):
    a   = centered_norm(x) = x / rms(x) * (1 + w_in)                          (eps = rms_norm_eps)
    q   = a Wq  (B,S,H,d),  k = a Wk, v = a Wv  (B,S,G,d)
    q   = q / rms(q) * qk_scale_factor ;  k = k / rms(k)                     (weightless QK-norm over d)
    RoPE (half-split "rotate_half" pairing, global rope_theta) on q, k only where layer_rope_theta[i] != 0
    p   = softmax(q k^T / sqrt(d) + mask)  with GQA (query head j uses kv head j // (H/G)); the mask is causal,
          + key padding, + for "sliding_attention" layers a window: key index > query index - sliding_window
    o   = p v  (B,S,H,d);  o = o / rms(o) per head (weightless, eps = rms_norm_eps); flattened to (B,S,H*d)
    o   = (o * sigmoid(a Wgate)) Wo
    o   = o / rms(o)                                                          (weightless, eps = post_norm_eps)
    x1  = alpha * x + beta * o,  w = g_attn / residual_gate_temperature, beta = sigmoid(w),
          alpha = sqrt(max(sigmoid(-w) * (1 + beta), 1e-3))
    b   = centered_norm(x1) (weight w_pre_ff)
    dense layer :  f = (silu(b Wg) * (b Wu)) Wd
    sparse layer:  router  r = sigmoid(output_multiplier * b Wr)  (E),   choice = r + e_score_correction_bias,
                   top-K indices by choice, weights = r[top] / (sum r[top] + 1e-15) * routed_scaling_factor
                   z = centered_norm(b Wpool)  (M)
                   f = (sum_top weight_e * input_scaled_norm(expert_e(z))) Wunpool,
                   expert_e(z) = (silu(z Wg_e) * (z Wu_e)) Wd_e  (M -> F -> M)
    f   = input_scaled_norm(f) = u / rms(u), u = f * (1 + w_post_ff)           (eps = post_norm_eps)
    y   = alpha' * x1 + beta' * f   (second residual gate, g_ff)
  final           h = h / rms(h) * w_final  (plain weight, eps = rms_norm_eps)
  logits          l = h W_lm ;  l = T * tanh(output_multiplier * l / T),  T = final_logit_softcapping

Weight layout (my own; every matrix stored in -> out, i.e. ``x @ W``):
  ``embed``                    (V, D)
  ``blocks[i].w_qkvg``          (D, H*d + 2*G*d + H*d): [q | k | v | attention output gate] fused column-wise
  ``blocks[i].w_o``             (H*d, D)
  ``blocks[i].norm_scales``     (2, D): effective scales (1 + w) of input_layernorm and pre_feedforward_layernorm
  ``blocks[i].post_ff_scale``   (D,): effective scale (1 + w) of post_feedforward_layernorm
  ``blocks[i].res_gates``       (2, D): raw residual gate parameters [post-attention, post-feed-forward]
  ``blocks[i].res_coef``        (2, 2, D) buffer: precomputed [alpha, beta] of each residual gate (CLEAN variant)
  dense  ``blocks[i].w_gu``     (D, 2*I): [gate | up];  ``blocks[i].w_down`` (I, D)
  sparse ``blocks[i].w_router`` (D, E);  ``router_bias`` (E,);  ``w_pool`` (D, M);  ``pool_scale`` (M,) = 1 + w;
         ``w_gate`` / ``w_up`` (E, M, F) split from the fused gate_up_proj (first F rows gate, last F rows up);
         ``w_edown`` (E, F, M);  ``expert_norm_scale`` (M,) = 1 + w;  ``w_unpool`` (M, D)
  ``final_scale`` (D,),  ``w_lm`` (D, V)
The vision / audio keys of the checkpoint are ignored.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "qk_scale_replaces_softmax_scale",  # treats qk_scale_factor as the whole softmax scale: drops the 1/sqrt(head_dim)
    "centered_norm_no_plus_one",  # loader keeps the centered norms' raw weight w as scale instead of (1 + w)
    "input_scaled_norm_order",  # post-FFN / post-expert norm normalizes then scales, instead of scale-then-normalize
    "residual_gate_temperature_mul",  # residual gate multiplies by residual_gate_temperature instead of dividing
    "router_no_output_multiplier",  # router logits not scaled by output_multiplier (applied to the LM logits only)
    "router_bias_in_weights",  # expert weights gathered from the bias-corrected scores instead of the raw sigmoid
    "post_expert_norm_after_combine",  # post_expert_norm applied once to the weighted sum instead of per expert
    "gate_up_interleaved",  # fused gate_up_proj split as interleaved rows (even=gate, odd=up) instead of halves
    "sliding_window_off_by_one",  # sliding window keeps key >= q - window (window + 1 tokens) instead of > q - window
    "rope_on_nope_layers",  # RoPE applied on every layer, ignoring layer_rope_theta == 0 (NoPE layers)
    "o_norm_over_all_heads",  # weightless o_norm taken over the flattened H*d instead of per head (head_dim)
    "softcap_multiplier_order",  # output_multiplier applied after the tanh softcap instead of before it
    "attn_gate_from_residual",  # attention output gate fed the un-normed layer input instead of the normed one
    "pad_mask_query_axis",  # padding mask applied on the query axis instead of the key axis
]

PADDING_ONLY = ["pad_mask_query_axis"]

CLEAN = [
    "rope_then_qknorm",  # RoPE before the weightless QK-norm and qk scale (a rotation keeps the RMS)
    "sdpa_attention",  # F.scaled_dot_product_attention on repeat_interleave'd kv instead of the grouped einsum
    "dense_moe",  # every expert on every token, combined by a dense (tokens, E) weight matrix zero off the top-k
    "precomputed_residual_gates",  # residual gate alpha/beta read from a table precomputed in build
    "rope_complex",  # RoPE as a complex multiplication of (x[:d/2] + i x[d/2:]) by exp(i theta)
]


def _bug():
    return BUG


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _input_scaled_norm(x, scale, eps):
    if _bug() == "input_scaled_norm_order":
        return _rms(x, eps) * scale
    return _rms(x * scale, eps)


def _gate_coefs(g, temperature):
    if _bug() == "residual_gate_temperature_mul":
        w = g * temperature
    else:
        w = g / temperature
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
    return alpha, beta


class Block(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        D, H, G, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.idx = idx
        self.H, self.G, self.d = H, G, d
        self.sliding = cfg.layer_types[idx] == "sliding_attention"
        self.window = cfg.sliding_window
        self.use_rope = bool(cfg.layer_rope_theta[idx])
        self.sparse = cfg.mlp_layer_types[idx] == "sparse"
        self.eps = cfg.rms_norm_eps
        self.post_eps = cfg.post_norm_eps
        self.qk_scale = cfg.qk_scale_factor
        self.temperature = cfg.residual_gate_temperature
        self.w_qkvg = nn.Parameter(torch.zeros(D, 2 * H * d + 2 * G * d))
        self.w_o = nn.Parameter(torch.zeros(H * d, D))
        self.norm_scales = nn.Parameter(torch.ones(2, D))
        self.post_ff_scale = nn.Parameter(torch.ones(D))
        self.res_gates = nn.Parameter(torch.zeros(2, D))
        self.register_buffer("res_coef", torch.zeros(2, 2, D))
        if self.sparse:
            E, M, Fi = cfg.num_local_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
            self.top_k = cfg.num_experts_per_tok
            self.router_mult = cfg.output_multiplier
            self.routed_scale = cfg.routed_scaling_factor
            self.w_router = nn.Parameter(torch.zeros(D, E))
            self.register_buffer("router_bias", torch.zeros(E))
            self.w_pool = nn.Parameter(torch.zeros(D, M))
            self.pool_scale = nn.Parameter(torch.ones(M))
            self.w_gate = nn.Parameter(torch.zeros(E, M, Fi))
            self.w_up = nn.Parameter(torch.zeros(E, M, Fi))
            self.w_edown = nn.Parameter(torch.zeros(E, Fi, M))
            self.expert_norm_scale = nn.Parameter(torch.ones(M))
            self.w_unpool = nn.Parameter(torch.zeros(M, D))
        else:
            self.inter = cfg.intermediate_size
            self.w_gu = nn.Parameter(torch.zeros(D, 2 * cfg.intermediate_size))
            self.w_down = nn.Parameter(torch.zeros(cfg.intermediate_size, D))

    # --- residual gate -------------------------------------------------------------------------------------------
    def _gate(self, which, residual, h):
        if _bug() == "precomputed_residual_gates":
            alpha, beta = self.res_coef[which, 0], self.res_coef[which, 1]
        else:
            alpha, beta = _gate_coefs(self.res_gates[which], self.temperature)
        return alpha * residual + beta * h

    # --- attention -----------------------------------------------------------------------------------------------
    def _rope(self, x, cos, sin):
        # x (B, S, heads, d); cos / sin (B, S, d/2)
        half = self.d // 2
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        if _bug() == "rope_complex":
            z = torch.complex(x[..., :half], x[..., half:]) * torch.complex(c, s)
            return torch.cat((z.real, z.imag), dim=-1)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def attention(self, a, x_raw, cos, sin, allowed):
        B, S, _ = a.shape
        H, G, d = self.H, self.G, self.d
        proj = a @ self.w_qkvg
        q, k, v, gate = proj.split([H * d, G * d, G * d, H * d], dim=-1)
        if _bug() == "attn_gate_from_residual":
            gate = x_raw @ self.w_qkvg[:, -H * d :]
        q = q.view(B, S, H, d)
        k = k.view(B, S, G, d)
        v = v.view(B, S, G, d)
        rope = self.use_rope or _bug() == "rope_on_nope_layers"
        if _bug() == "rope_then_qknorm":
            if rope:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            q = _rms(q, self.eps) * self.qk_scale
            k = _rms(k, self.eps)
        else:
            q = _rms(q, self.eps) * self.qk_scale
            k = _rms(k, self.eps)
            if rope:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        scale = 1.0 if _bug() == "qk_scale_replaces_softmax_scale" else 1.0 / math.sqrt(d)
        bias = torch.zeros(allowed.shape, dtype=a.dtype).masked_fill(~allowed, torch.finfo(a.dtype).min)  # (B,S,S)
        if _bug() == "sdpa_attention":
            rep = H // G
            qh = q.transpose(1, 2)
            kh = k.transpose(1, 2).repeat_interleave(rep, dim=1)
            vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias[:, None], scale=scale)
            o = o.transpose(1, 2)  # (B,S,H,d)
        else:
            # grouped: query heads (g, r) with g the kv head, r = 0..H/G-1
            qg = q.view(B, S, G, H // G, d)
            scores = torch.einsum("bqgrd,bkgd->bgrqk", qg, k) * scale + bias[:, None, None]
            p = torch.softmax(scores.float(), dim=-1).to(a.dtype)
            o = torch.einsum("bgrqk,bkgd->bqgrd", p, v).reshape(B, S, H, d)
        if _bug() == "o_norm_over_all_heads":
            o = _rms(o.reshape(B, S, H * d), self.eps)
        else:
            o = _rms(o, self.eps).reshape(B, S, H * d)
        o = o * torch.sigmoid(gate)
        return o @ self.w_o

    # --- feed-forward --------------------------------------------------------------------------------------------
    def dense_mlp(self, b):
        g, u = (b @ self.w_gu).split(self.inter, dim=-1)
        return (F.silu(g) * u) @ self.w_down

    def route(self, b):
        logits = b @ self.w_router
        if _bug() != "router_no_output_multiplier":
            logits = logits * self.router_mult
        scores = torch.sigmoid(logits)
        choice = scores + self.router_bias
        idx = torch.topk(choice, self.top_k, dim=-1).indices
        src = choice if _bug() == "router_bias_in_weights" else scores
        w = src.gather(-1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-15) * self.routed_scale
        return idx, w

    def moe(self, b):
        shape = b.shape
        t = b.reshape(-1, shape[-1])
        idx, w = self.route(t)
        z = _rms(t @ self.w_pool, self.eps) * self.pool_scale
        E = self.w_gate.shape[0]
        if _bug() == "dense_moe":
            dense_w = torch.zeros(t.shape[0], E, dtype=t.dtype).scatter(1, idx, w)  # (T, E)
            g = torch.einsum("tm,emf->etf", z, self.w_gate)
            u = torch.einsum("tm,emf->etf", z, self.w_up)
            y = torch.einsum("etf,efm->etm", F.silu(g) * u, self.w_edown)
            y = _input_scaled_norm(y, self.expert_norm_scale, self.post_eps)
            out = torch.einsum("te,etm->tm", dense_w, y)
        else:
            out = torch.zeros_like(z)
            for e in range(E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel() == 0:
                    continue
                ze = z[tok]
                y = (F.silu(ze @ self.w_gate[e]) * (ze @ self.w_up[e])) @ self.w_edown[e]
                if _bug() != "post_expert_norm_after_combine":
                    y = _input_scaled_norm(y, self.expert_norm_scale, self.post_eps)
                out.index_add_(0, tok, y * w[tok, slot, None])
            if _bug() == "post_expert_norm_after_combine":
                out = _input_scaled_norm(out, self.expert_norm_scale, self.post_eps)
        return (out @ self.w_unpool).view(shape)

    def forward(self, x, cos, sin, allowed):
        a = _rms(x, self.eps) * self.norm_scales[0]
        o = self.attention(a, x, cos, sin, allowed)
        o = _rms(o, self.post_eps)
        x = self._gate(0, x, o)
        b = _rms(x, self.eps) * self.norm_scales[1]
        f = self.moe(b) if self.sparse else self.dense_mlp(b)
        f = _input_scaled_norm(f, self.post_ff_scale, self.post_eps)
        return self._gate(1, x, f)


class MuseSparkText(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.w_lm = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.vocab_size))
        d = cfg.head_dim
        theta = cfg.rope_parameters["rope_theta"]  # Transformers uses the global theta; layer_rope_theta only gates
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.window = cfg.sliding_window
        self.mult = cfg.output_multiplier
        self.softcap = cfg.final_logit_softcapping

    def _allowed(self, B, S, attention_mask, sliding):
        qi = torch.arange(S)[:, None]
        ki = torch.arange(S)[None, :]
        ok = ki <= qi
        if sliding:
            if _bug() == "sliding_window_off_by_one":
                ok = ok & (ki >= qi - self.window)
            else:
                ok = ok & (ki > qi - self.window)
        ok = ok[None].expand(B, S, S)
        if attention_mask is not None:
            pad = attention_mask.bool()
            if _bug() == "pad_mask_query_axis":
                ok = ok & pad[:, :, None]
            else:
                ok = ok & pad[:, None, :]
        return ok

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        h = _rms(self.embed[input_ids], self.eps)
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        ang = position_ids[..., None].float() * self.inv_freq  # (B,S,d/2)
        cos, sin = ang.cos(), ang.sin()
        masks = {s: self._allowed(B, S, attention_mask, s) for s in (False, True)}
        for blk in self.blocks:
            h = blk(h, cos, sin, masks[blk.sliding])
        h = _rms(h, self.eps) * self.final_scale
        logits = h @ self.w_lm
        T = self.softcap
        if _bug() == "softcap_multiplier_order":
            return self.mult * (T * torch.tanh(logits / T))
        return T * torch.tanh(logits * self.mult / T)


def build(state_dict, config):
    cfg = config.text_config
    model = MuseSparkText(cfg)
    p = "model.language_model."
    sd = {k[len(p) :]: v.float() for k, v in state_dict.items() if k.startswith(p)}
    bug = _bug()

    def centered(w):
        return w.clone() if bug == "centered_norm_no_plus_one" else 1.0 + w

    with torch.no_grad():
        model.embed.copy_(sd["embed_tokens.weight"])
        model.final_scale.copy_(sd["norm.weight"])
        model.w_lm.copy_(state_dict["lm_head.weight"].float().t())
        for i, blk in enumerate(model.blocks):
            L = f"layers.{i}."
            a = L + "self_attn."
            blk.w_qkvg.copy_(
                torch.cat([sd[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "gate_proj")], 0).t()
            )
            blk.w_o.copy_(sd[a + "o_proj.weight"].t())
            blk.norm_scales.copy_(
                torch.stack(
                    [centered(sd[L + "input_layernorm.weight"]), centered(sd[L + "pre_feedforward_layernorm.weight"])]
                )
            )
            blk.post_ff_scale.copy_(1.0 + sd[L + "post_feedforward_layernorm.weight"])
            gates = torch.stack(
                [sd[L + "post_attention_residual_gate.gate"], sd[L + "post_feedforward_residual_gate.gate"]]
            )
            blk.res_gates.copy_(gates)
            for j in range(2):
                w = gates[j] / cfg.residual_gate_temperature
                blk.res_coef[j, 0] = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + torch.sigmoid(w)), min=1e-3))
                blk.res_coef[j, 1] = torch.sigmoid(w)
            m = L + "mlp."
            if blk.sparse:
                blk.w_router.copy_(sd[m + "gate.weight"].t())
                blk.router_bias.copy_(sd[m + "gate.e_score_correction_bias"])
                blk.w_pool.copy_(sd[m + "pre_expert_proj.weight"].t())
                blk.pool_scale.copy_(centered(sd[m + "pre_expert_norm.weight"]))
                gu = sd[m + "experts.gate_up_proj"]  # (E, 2F, M)
                Fi = gu.shape[1] // 2
                if bug == "gate_up_interleaved":
                    g, u = gu[:, 0::2], gu[:, 1::2]
                else:
                    g, u = gu[:, :Fi], gu[:, Fi:]
                blk.w_gate.copy_(g.transpose(1, 2))
                blk.w_up.copy_(u.transpose(1, 2))
                blk.w_edown.copy_(sd[m + "experts.down_proj"].transpose(1, 2))
                blk.expert_norm_scale.copy_(1.0 + sd[m + "experts.post_expert_norm.weight"])
                blk.w_unpool.copy_(sd[m + "post_expert_proj.weight"].t())
            else:
                blk.w_gu.copy_(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]], 0).t())
                blk.w_down.copy_(sd[m + "down_proj.weight"].t())
    return model.float().eval()
