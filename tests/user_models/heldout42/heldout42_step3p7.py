"""Hand-written plain-PyTorch port of the Step3p7 (Step-3.7-Flash) text decoder, the language model that runs inside
Transformers' ``Step3p7ForConditionalGeneration`` (text only: no image inputs, the vision tower is not ported).

Architecture as this port implements it (all in float32):
- h = E[input_ids] (no embedding scale).
- RMSNorm (Gemma style, one helper for every norm): rms(x) = x * rsqrt(mean(x^2, -1) + eps) computed in float32,
  then multiplied by a gain g = 1 + w (the checkpoint stores w; this port stores 1 + w). eps = config.rms_norm_eps for
  every norm (block norms, per-head q/k norms, final norm).
- decoder layer i (pre-norm):  h = h + Attn_i(rms(h) * g_attn);  h = h + FFN_i(rms(h) * g_ffn).
- Attn_i, layer type t_i in {full_attention, sliding_attention} (config.layer_types):
    NH_i query heads (full: num_attention_heads, sliding: num_sliding_attention_heads; this port reads NH_i off the
    gate weight's rows), KV key/value heads, head size D = config.head_dim (NH_i * D != hidden_size in general).
    q = x Wq + bq, k = x Wk + bk, v = x Wv + bv, per head;  g = x Wg (no bias, one logit per query head).
    q = rms(q) * g_q, k = rms(k) * g_k, each over the D channels of one head (before RoPE).
    RoPE (rotate-half / NeoX layout) on the first R_t = int(D * partial_rotary_factor_t) channels of each head only,
    with inv_freq_j = theta_t^(-2j / R_t), j < R_t / 2, theta_t and partial_rotary_factor_t taken per layer type from
    config.rope_parameters[t]; angle = position_id * inv_freq (position_ids given, else 0..S-1):
        x[:R] -> x[:R] * cos + rotate_half(x[:R]) * sin,   x[R:] unchanged.
    GQA: query head h reads key/value head h // (NH_i / KV).
    scores = q k^T * s with s = query_pre_attn_scalar ** -0.5 (not D ** -0.5); softmax over allowed keys:
        causal (kv <= q), key not padding (attention_mask), and for sliding layers q - kv < sliding_window
        (window counted in token indices, W keys including the query itself).
    o_h = softmax(scores) v;  o_h *= sigmoid(g_h) (per-head output gate);  out = concat_h(o_h) Wo + bo.
- FFN_i, config.mlp_layer_types[i]:
    "dense":  SwiGLU with clamp, limit L = swiglu_limits_shared[i] (yes, the *shared* list, also for dense layers):
        a = min(silu(x Wg + bg), L);  u = clamp(x Wu + bu, -L, L);  out = (a * u) Wd + bd.
    "sparse" (MoE): shared expert (same SwiGLU, width share_expert_dim, limit swiglu_limits_shared[i]) plus routed:
        logits = x Wr^T (no bias);  p = sigmoid(logits);  choose top-k of p + b_corr (b_corr = e_score_correction_bias,
        used for the choice only);  weights w_k = p[idx_k] / sum_k p[idx_k];
        expert e: a = min(silu(x Gate_e), L_r), u = clamp(x Up_e, -L_r, L_r), y_e = (a * u) Down_e (no biases),
        L_r = swiglu_limits[i];  out = moe_router_scaling_factor * sum_k w_k y_{idx_k} + shared(x).
    A limit of None or 0.0 means "no clamp" (L = inf).
- logits = (rms(h) * g_final) W_head^T (untied head, lm_head.weight).

Weight layout of this port (own names; converted from Transformers' state dict at load):
- ``tok_emb`` (V, H);  ``head`` (V, H);  ``final_gain`` (H,) = 1 + norm.weight.
- ``blocks[i]`` (``Step3p7Block``):
    ``gains`` (2, H) = stacked [1 + input_layernorm.weight ; 1 + post_attention_layernorm.weight];
    ``qk_gain`` (2, D) = stacked [1 + q_norm.weight ; 1 + k_norm.weight];
    ``w_qkvg`` (H, NH*D + 2*KV*D + NH) = [q | k | v | g] projections fused and stored transposed (input-major);
    ``b_qkvg`` (NH*D + 2*KV*D + NH,) = [bq | bk | bv | 0] (the gate has no bias);
    ``w_out`` (NH*D, H) = o_proj.weight transposed;  ``b_out`` (H,);
    ``inv_freq`` buffer (R/2,) for this layer's type;
    dense FFN: ``ffn`` (``SwiGLU``) with ``w_in`` (H, 2I) = [gate | up] fused + transposed, ``b_in`` (2I,),
    ``w_down`` (I, H) transposed, ``b_down`` (H,);
    sparse FFN: ``shared`` (``SwiGLU`` as above), ``router`` (E, H), ``router_bias`` (E,),
    ``experts`` (``nn.ParameterDict``): ``gate`` (E, H, I) and ``up`` (E, H, I) = the fused gate_up_proj (E, 2I, H)
    split in halves [gate ; up] and transposed; ``down`` (E, I, H) = down_proj (E, H, I) transposed.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "norm_no_offset",  # every RMSNorm gain loaded as w instead of 1 + w (the Gemma-style +1 offset forgotten at load)
    "qk_norm_across_heads",  # q/k RMSNorm statistic taken over all heads' channels at once instead of per head
    "attn_scale_head_dim",  # softmax scale head_dim ** -0.5 instead of query_pre_attn_scalar ** -0.5
    "gqa_tiled",  # GQA key/value heads repeated tiled: query head h reads kv head h % KV instead of h // groups
    "window_off_by_one",  # sliding mask keeps q - kv <= sliding_window (W + 1 keys) instead of q - kv < W
    "rope_partial_ignored",  # partial_rotary_factor not read: RoPE over all D channels (inv_freq over D) everywhere
    "gate_on_residual",  # per-head output gate g = h Wg computed from the un-normed residual instead of rms(h) * g
    "router_softmax",  # router scores softmax(logits) instead of sigmoid(logits) (Mixtral habit)
    "router_bias_in_weights",  # correction bias added to the expert weights too (weights from p + b, not p)
    "routed_scale_on_shared",  # moe_router_scaling_factor applied to routed + shared sum instead of routed only
    "gate_up_swapped",  # fused expert gate_up_proj split as [up ; gate] instead of [gate ; up] at load
    "swiglu_limit_zero_clamps",  # a swiglu limit of 0.0 taken as a bound of 0 instead of "no clamp"
    "head_tied",  # output head taken from the token embedding (the class declares tied keys) although untied
    "sliding_pad_mask_dropped",  # sliding-window layers' mask built from causal + window only: padding keys visible
]
PADDING_ONLY = ["sliding_pad_mask_dropped"]
CLEAN = [
    "clean_dense_experts",  # every expert run on every token, mixed by a dense (tokens, E) weight matrix
    "clean_sdpa",  # attention by F.scaled_dot_product_attention with an additive float mask and explicit scale
    "clean_rope_complex",  # RoPE as complex multiplication of (x_j, x_{j + R/2}) pairs by exp(i * angle)
    "clean_windowed_attention",  # sliding layers: each query scores only its W-key band (unfold), not S x S
    "clean_norm_folded",  # RMSNorm gains folded into the following weights (qkvg, FFN inputs, router, head)
]


def _bug(name):
    return BUG == name


def _rms(x, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _limit(value):
    """The clamp bound of one swiglu_limits entry: None / 0.0 mean no clamp."""
    if _bug("swiglu_limit_zero_clamps"):
        return float("inf") if value is None else float(value)
    return float(value) if value else float("inf")


def _swiglu(gate, up, limit):
    gate = F.silu(gate).clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * up


class SwiGLU(nn.Module):
    """Dense MLP / shared expert: fused [gate | up] input projection, clamped SwiGLU, down projection."""

    def __init__(self, gate_w, gate_b, up_w, up_b, down_w, down_b, limit):
        super().__init__()
        self.inter = gate_w.shape[0]
        self.w_in = nn.Parameter(torch.cat([gate_w, up_w], 0).t().contiguous())
        self.b_in = nn.Parameter(torch.cat([gate_b, up_b], 0))
        self.w_down = nn.Parameter(down_w.t().contiguous())
        self.b_down = nn.Parameter(down_b.clone())
        self.limit = limit

    def forward(self, x, w_in=None, trace=None, key=""):
        gu = x @ (self.w_in if w_in is None else w_in) + self.b_in
        a = _swiglu(gu[..., : self.inter], gu[..., self.inter :], self.limit)
        out = a @ self.w_down + self.b_down
        if trace is not None:
            trace[key + ".gate_pre"], trace[key + ".up_pre"] = gu[..., : self.inter], gu[..., self.inter :]
            trace[key + ".out"] = out
        return out


class Step3p7Block(nn.Module):
    def __init__(self, sd, p, tc, i):
        super().__init__()
        offset = 0.0 if _bug("norm_no_offset") else 1.0
        self.eps = tc.rms_norm_eps
        self.kind = tc.layer_types[i]
        self.sliding = self.kind == "sliding_attention"
        self.window = tc.sliding_window
        a = p + "self_attn."
        wq, wk, wv, wg = (sd[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "g_proj"))
        self.D = tc.head_dim
        self.NH = wg.shape[0]  # one gate logit per query head
        self.KV = wk.shape[0] // self.D
        hid = wq.shape[1]

        def bias(name, n):
            return sd.get(name, torch.zeros(n))

        self.gains = nn.Parameter(
            torch.stack([sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]]) + offset
        )
        self.qk_gain = nn.Parameter(torch.stack([sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]]) + offset)
        self.w_qkvg = nn.Parameter(torch.cat([wq, wk, wv, wg], 0).t().contiguous())
        self.b_qkvg = nn.Parameter(
            torch.cat(
                [
                    bias(a + "q_proj.bias", wq.shape[0]),
                    bias(a + "k_proj.bias", wk.shape[0]),
                    bias(a + "v_proj.bias", wv.shape[0]),
                    torch.zeros(self.NH),
                ]
            )
        )
        self.w_out = nn.Parameter(sd[a + "o_proj.weight"].t().contiguous())
        self.b_out = nn.Parameter(bias(a + "o_proj.bias", hid))
        self.scale = (self.D**-0.5) if _bug("attn_scale_head_dim") else tc.query_pre_attn_scalar**-0.5

        rp = tc.rope_parameters[self.kind]
        factor = 1.0 if _bug("rope_partial_ignored") else rp.get("partial_rotary_factor", 1.0)
        rot = int(self.D * factor)
        inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        self.register_buffer("inv_freq", inv, persistent=False)

        m = p + "mlp."
        self.sparse = tc.mlp_layer_types[i] == "sparse"
        shared_limit = _limit(tc.swiglu_limits_shared[i] if tc.swiglu_limits_shared else None)

        def swiglu(q):
            w = [sd[q + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj")]
            b = [bias(q + n + ".bias", t.shape[0]) for n, t in zip(("gate_proj", "up_proj", "down_proj"), w)]
            return SwiGLU(w[0], b[0], w[1], b[1], w[2], b[2], shared_limit)

        if not self.sparse:
            self.ffn = swiglu(m)
            return
        self.shared = swiglu(m + "shared_experts.")
        self.router = nn.Parameter(sd[m + "gate.weight"].clone())
        self.router_bias = nn.Parameter(sd[m + "gate.e_score_correction_bias"].clone())
        self.top_k = tc.num_experts_per_tok
        self.routed_scale = tc.moe_router_scaling_factor
        self.expert_limit = _limit(tc.swiglu_limits[i] if tc.swiglu_limits else None)
        gate_up = sd[m + "experts.gate_up_proj"]  # (E, 2I, H)
        inter = gate_up.shape[1] // 2
        first, second = gate_up[:, :inter], gate_up[:, inter:]
        if _bug("gate_up_swapped"):
            first, second = second, first
        self.experts = nn.ParameterDict(
            {
                "gate": nn.Parameter(first.transpose(1, 2).contiguous()),
                "up": nn.Parameter(second.transpose(1, 2).contiguous()),
                "down": nn.Parameter(sd[m + "experts.down_proj"].transpose(1, 2).contiguous()),
            }
        )

    # ---- attention -------------------------------------------------------------------------------------------
    def rope(self, x, cos, sin):
        rot = cos.shape[-1]
        xr, xp = x[..., :rot], x[..., rot:]
        if BUG == "clean_rope_complex":
            half = rot // 2
            z = torch.view_as_complex(torch.stack([xr[..., :half], xr[..., half:]], -1).contiguous())
            ang = torch.complex(cos[..., :half].contiguous(), sin[..., :half].contiguous())  # exp(i * angle)
            z = torch.view_as_real(z * ang)
            xr = torch.cat([z[..., 0], z[..., 1]], -1)
        else:
            xr = xr * cos + _rotate_half(xr) * sin
        return torch.cat([xr, xp], -1)

    def allowed(self, pad, S, device):
        """(B, 1, S, S) bool: which keys each query may read."""
        qi = torch.arange(S, device=device)[:, None]
        ki = torch.arange(S, device=device)[None, :]
        ok = ki <= qi
        if self.sliding:
            ok = ok & ((qi - ki <= self.window) if _bug("window_off_by_one") else (qi - ki < self.window))
        ok = ok[None, None]
        if pad is not None and not (self.sliding and _bug("sliding_pad_mask_dropped")):
            ok = ok & pad[:, None, None, :]
        return ok

    def attention(self, h, x, pad, positions, trace, i, w_qkvg):
        B, S, _ = x.shape
        D, NH, KV = self.D, self.NH, self.KV
        proj = x @ w_qkvg + self.b_qkvg
        q, k, v, g = proj.split([NH * D, KV * D, KV * D, NH], -1)
        if trace is not None:
            trace[f"L{i}.q_proj"], trace[f"L{i}.k_proj"] = q, k
        if _bug("gate_on_residual"):
            g = h @ self.w_qkvg[:, -NH:]
        if _bug("qk_norm_across_heads"):
            q = _rms(q, self.eps).view(B, S, NH, D) * self.qk_gain[0]
            k = _rms(k, self.eps).view(B, S, KV, D) * self.qk_gain[1]
        else:
            q = _rms(q.view(B, S, NH, D), self.eps) * self.qk_gain[0]
            k = _rms(k.view(B, S, KV, D), self.eps) * self.qk_gain[1]
        v = v.view(B, S, KV, D)
        if trace is not None:
            trace[f"L{i}.q_normed"], trace[f"L{i}.k_normed"], trace[f"L{i}.gate_logits"] = q, k, g
            trace[f"L{i}.v"] = v
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]
        if trace is not None:
            trace[f"rope.{self.kind}"] = (emb.cos(), emb.sin())
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, D)
        groups = NH // KV
        if _bug("gqa_tiled"):
            k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
        else:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        neg = torch.finfo(q.dtype).min
        if self.sliding and BUG == "clean_windowed_attention":
            W = self.window
            kp = F.pad(k, (0, 0, W - 1, 0)).unfold(2, W, 1)  # (B, NH, S, D, W): keys t-W+1 .. t
            vp = F.pad(v, (0, 0, W - 1, 0)).unfold(2, W, 1)
            sc = torch.einsum("bhsd,bhsdw->bhsw", q, kp) * self.scale
            j = torch.arange(S, device=x.device)[:, None] - W + 1 + torch.arange(W, device=x.device)[None, :]
            ok = (j >= 0)[None, None]
            if pad is not None:
                ok = ok & pad[:, j.clamp(min=0)][:, None]
            att = torch.softmax(sc.masked_fill(~ok, neg), -1)
            o = torch.einsum("bhsw,bhsdw->bhsd", att, vp)
        elif BUG == "clean_sdpa":
            add = torch.zeros(B, 1, S, S).masked_fill(~self.allowed(pad, S, x.device), neg)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=self.scale)
        else:
            sc = (q @ k.transpose(-1, -2)) * self.scale
            att = torch.softmax(sc.masked_fill(~self.allowed(pad, S, x.device), neg), -1)
            o = att @ v
        o = o.transpose(1, 2) * torch.sigmoid(g)[..., None]  # (B, S, NH, D) * per-head gate
        out = o.reshape(B, S, NH * D) @ self.w_out + self.b_out
        if trace is not None:
            trace[f"L{i}.attn_core"], trace[f"L{i}.attn_out"] = o, out
        return out

    # ---- feed-forward ----------------------------------------------------------------------------------------
    def moe(self, x, trace, i, folded):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        shared = self.shared(t, folded.get("shared"), trace, f"L{i}.shared")
        logits = t @ (folded.get("router", self.router)).t()
        if _bug("router_softmax"):
            p = torch.softmax(logits.float(), -1)
        else:
            p = torch.sigmoid(logits.float())
        choice = p + self.router_bias
        idx = torch.topk(choice, self.top_k, -1, sorted=False).indices
        w = (choice if _bug("router_bias_in_weights") else p).gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        gate_w, up_w = folded.get("gate", self.experts["gate"]), folded.get("up", self.experts["up"])
        if trace is not None:
            trace[f"L{i}.expert_gate_pre"] = torch.einsum("th,tkhi->tki", t, gate_w[idx])
        if BUG == "clean_dense_experts":
            dense = torch.zeros(t.shape[0], p.shape[1]).scatter(1, idx, w)  # (T, E)
            a = _swiglu(torch.einsum("th,ehi->eti", t, gate_w), torch.einsum("th,ehi->eti", t, up_w), self.expert_limit)
            y = torch.einsum("eti,eih->eth", a, self.experts["down"])
            routed = torch.einsum("te,eth->th", dense, y)
        else:
            a = _swiglu(
                torch.einsum("th,tkhi->tki", t, gate_w[idx]),
                torch.einsum("th,tkhi->tki", t, up_w[idx]),
                self.expert_limit,
            )
            y = torch.einsum("tki,tkih->tkh", a, self.experts["down"][idx])
            routed = (y * w[..., None]).sum(1)
        if _bug("routed_scale_on_shared"):
            out = (routed + shared) * self.routed_scale
        else:
            out = routed * self.routed_scale + shared
        if trace is not None:
            trace[f"L{i}.shared"], trace[f"L{i}.router_logits"], trace[f"L{i}.router_w"] = shared, logits, w
            trace[f"L{i}.router_idx"], trace[f"L{i}.routed"] = idx, routed
        return out.view(B, S, H)

    def forward(self, h, pad, positions, trace=None, i=0):
        fold = BUG == "clean_norm_folded"
        folded = {}
        x = _rms(h, self.eps)
        if fold:
            w_qkvg = self.gains[0][:, None] * self.w_qkvg
        else:
            x, w_qkvg = x * self.gains[0], self.w_qkvg
        if trace is not None:
            trace[f"L{i}.attn_in"] = x if not fold else x * self.gains[0]
        h = h + self.attention(h, x, pad, positions, trace, i, w_qkvg)
        if trace is not None:
            trace[f"L{i}.mid"] = h
        x = _rms(h, self.eps)
        if fold:
            g1 = self.gains[1]
            if self.sparse:
                folded = {
                    "shared": g1[:, None] * self.shared.w_in,
                    "router": self.router * g1,
                    "gate": g1[None, :, None] * self.experts["gate"],
                    "up": g1[None, :, None] * self.experts["up"],
                }
            else:
                folded = {"ffn": g1[:, None] * self.ffn.w_in}
        else:
            x = x * self.gains[1]
        if trace is not None:
            trace[f"L{i}.ffn_in"] = x if not fold else x * self.gains[1]
        f = self.moe(x, trace, i, folded) if self.sparse else self.ffn(x, folded.get("ffn"), trace, f"L{i}.ffn")
        if trace is not None:
            trace[f"L{i}.ffn_out"] = f
        return h + f


class Step3p7Port(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        tc = getattr(config, "text_config", None) or config
        p = "model.language_model."
        if p + "embed_tokens.weight" not in sd:  # a text-only state dict
            p = "model."
        self.eps = tc.rms_norm_eps
        offset = 0.0 if _bug("norm_no_offset") else 1.0
        self.tok_emb = nn.Parameter(sd[p + "embed_tokens.weight"].clone())
        head = (
            sd[p + "embed_tokens.weight"]
            if _bug("head_tied")
            else sd.get("lm_head.weight", sd[p + "embed_tokens.weight"])
        )
        self.head = nn.Parameter(head.clone())
        self.final_gain = nn.Parameter(sd[p + "norm.weight"] + offset)
        self.blocks = nn.ModuleList([Step3p7Block(sd, f"{p}layers.{i}.", tc, i) for i in range(tc.num_hidden_layers)])
        self.trace = None  # set to a dict to record intermediates (debugging)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        trace = self.trace
        h = self.tok_emb[input_ids].float()
        if trace is not None:
            trace["emb"] = h
        pad = None if attention_mask is None else attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        for i, blk in enumerate(self.blocks):
            h = blk(h, pad, position_ids, trace, i)
            if trace is not None:
                trace[f"L{i}.out"] = h
        x = _rms(h, self.eps)
        if BUG == "clean_norm_folded":
            logits = x @ (self.head * self.final_gain).t()
        else:
            x = x * self.final_gain
            logits = x @ self.head.t()
        if trace is not None:
            trace["final_norm"] = x if BUG != "clean_norm_folded" else x * self.final_gain
            trace["logits"] = logits
        return logits.float()


def build(state_dict, config) -> nn.Module:
    with torch.no_grad():
        model = Step3p7Port(state_dict, config)
    return model.eval()
