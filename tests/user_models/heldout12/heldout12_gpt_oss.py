"""Hand-written plain-PyTorch port of a GPT-OSS (GptOssForCausalLM) causal LM.

Pre-norm decoder; attention with per-head learned sinks (an extra softmax column with no value),
layers alternating sliding-window / full attention per config.layer_types, YaRN RoPE (NeoX
half-split pairs, attention factor on cos/sin), GQA, biases on q/k/v/o.  MoE MLP: router with bias,
top-k of the logits then softmax over the k values; experts with gate/up interleaved in the
(E, hidden, 2*I) gate_up_proj, clamped SwiGLU gate*sigmoid(alpha*gate)*(up+1), expert biases.
Weights live under this file's own names; dense projections are stored as (in, out) matrices.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "oss_sink_logit_scaled",  # sink logit multiplied by the 1/sqrt(head_dim) softmax scale as if it were a q.k score
    "oss_sink_rescale_sign",  # log-sum-exp sink rescale written sigmoid(sink - lse) instead of sigmoid(lse - sink)
    "oss_sink_dropped_on_sliding_layers",  # sliding-window kernel path has no s_aux argument: sinks only applied on full-attention layers; cf. sgl-project/sglang#30050
    "oss_yarn_mscale_in_softmax_scale_once",  # YaRN attention factor multiplied once into the softmax scale (DeepSeek habit) instead of into cos and sin (factor squared on q.k)
    "oss_yarn_blend_inverted",  # YaRN ramp used the wrong way round: high-frequency dims interpolated, low-frequency dims extrapolated
    "oss_yarn_as_linear_scaling",  # rope_type yarn treated as linear position interpolation: every frequency divided by factor, no attention factor
    "oss_yarn_correction_range_uses_max_position",  # YaRN correction range computed with max_position_embeddings instead of original_max_position_embeddings
    "oss_router_bias_only_in_selection",  # DeepSeek-V3 template: router bias used to pick experts, softmax weights taken from the unbiased logits
    "oss_swiglu_gate_clamp_both_sides",  # gate clamped to [-limit, limit] like up; the reference clamps the gate from above only; cf. PrimeIntellect-ai/prime-rl#2365
    "oss_swiglu_up_plus_one_missing",  # GPT-OSS SwiGLU (up + 1) * glu written as the usual up * glu; cf. sgl-project/sglang#39939
    "oss_swiglu_clamp_after_activation",  # swiglu_limit clamp applied to the activated gate instead of to the gate pre-activation
    "oss_down_bias_outside_routing_weight",  # expert down_proj bias added after the routing weight multiply (bias added unweighted per selected expert)
    "oss_gate_up_bias_not_deinterleaved",  # gate/up de-interleaved at load for a split kernel, but the gate_up bias split as halves [:I], [I:]
    "oss_topk_from_release_default",  # top-k read from the OpenAI config name experts_per_token with the release default 4 instead of num_experts_per_tok
    "oss_sink_pad_column_wrong_side",  # key-padding vector extended for the sink column with F.pad on the left: keys shifted one place, first real key masked
]
PADDING_ONLY = {"oss_sink_pad_column_wrong_side"}
CLEAN = [
    "sink_lse_rescale",  # sinks applied as out * sigmoid(lse - sink) after a plain softmax (flash-attention style)
    "gate_up_deinterleaved",  # gate/up columns (weights and bias) de-interleaved into two matrices at load
    "moe_dense_dispatch",  # every expert run on every token, weighted by a scattered (T, E) routing matrix
    "router_masked_softmax",  # softmax over all logits with non-top-k entries set to -inf
    "rope_complex",  # half-split RoPE via complex multiplication
    "expert_down_transposed",  # expert down_proj stored (E, hidden, I) at load and applied with F.linear
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def yarn_inv_freq(cfg, dim):
    """returns (inv_freq, attention_factor)"""
    b = _bug()
    rp = cfg.rope_parameters
    base = rp["rope_theta"]
    if rp.get("rope_type", "default") != "yarn":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    factor = rp["factor"]
    orig = rp["original_max_position_embeddings"]
    if b == "oss_yarn_correction_range_uses_max_position":
        orig = cfg.max_position_embeddings
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1
    attn_factor = rp.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)
    if b == "oss_yarn_as_linear_scaling":
        return inter, 1.0

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    w_extra = 1 - ramp
    if b == "oss_yarn_blend_inverted":
        w_extra = ramp
    return inter * (1 - w_extra) + extra * w_extra, attn_factor


class Layer(nn.Module):
    pass


class GptOssPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        H = self.H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.eps = cfg.rms_norm_eps
        self.E = cfg.num_local_experts
        self.I = cfg.intermediate_size
        self.top_k = (
            getattr(cfg, "experts_per_token", 4) if b == "oss_topk_from_release_default" else cfg.num_experts_per_tok
        )
        self.alpha = cfg.swiglu_alpha
        self.limit = cfg.swiglu_limit
        self.window = cfg.sliding_window
        self.scaling = self.hd**-0.5
        inv, self.attn_factor = yarn_inv_freq(cfg, self.hd)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.emb = _P(sd["model.embed_tokens.weight"])
        self.final_w = _P(sd["model.norm.weight"])
        self.head = _P(sd["lm_head.weight"].t())
        split = b in ("gate_up_deinterleaved", "oss_gate_up_bias_not_deinterleaved")
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            L = Layer()
            L.idx = i
            L.sliding = cfg.layer_types[i] == "sliding_attention"
            L.n1 = _P(sd[p + "input_layernorm.weight"])
            L.n2 = _P(sd[p + "post_attention_layernorm.weight"])
            for nm in ("q", "k", "v", "o"):
                setattr(L, "w" + nm, _P(sd[a + nm + "_proj.weight"].t()))
                setattr(L, "b" + nm, _P(sd[a + nm + "_proj.bias"]))
            L.sinks = _P(sd[a + "sinks"])
            L.wr = _P(sd[m + "router.weight"].t())
            L.br = _P(sd[m + "router.bias"])
            gu, gub = sd[m + "experts.gate_up_proj"], sd[m + "experts.gate_up_proj_bias"]
            if split:
                L.wg, L.wu = _P(gu[..., 0::2]), _P(gu[..., 1::2])
                if b == "oss_gate_up_bias_not_deinterleaved":
                    L.bg, L.bu = _P(gub[..., : self.I]), _P(gub[..., self.I :])
                else:
                    L.bg, L.bu = _P(gub[..., 0::2]), _P(gub[..., 1::2])
            else:
                L.wgu, L.bgu = _P(gu), _P(gub)
            dn = sd[m + "experts.down_proj"]
            L.wd = _P(dn.transpose(1, 2) if b == "expert_down_transposed" else dn)
            L.bd = _P(sd[m + "experts.down_proj_bias"])
            self.layers.append(L)

    def _rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        if _bug() == "rope_complex":
            z = torch.complex(x[..., :half], x[..., half:])
            z = z * torch.complex(cos, sin)
            return torch.cat((z.real, z.imag), -1)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    def _attn(self, L, x, masks, cos, sin, pre):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q = (x @ L.wq + L.bq).view(B, S, nh, hd).transpose(1, 2)
        k = x @ L.wk + L.bk
        v = x @ L.wv + L.bv
        _rec(pre + "k_proj", k)
        _rec(pre + "v_proj", v)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = self.scaling * (self.attn_factor if b == "oss_yarn_mscale_in_softmax_scale_once" else 1.0)
        scores = (q @ k.transpose(-1, -2)) * scale
        amask, amask_ext = masks["sliding" if L.sliding else "full"]
        use_sink = not (b == "oss_sink_dropped_on_sliding_layers" and L.sliding)
        sink = L.sinks.view(1, nh, 1, 1)
        if b == "oss_sink_logit_scaled":
            sink = sink * self.scaling
        if not use_sink:
            probs = torch.softmax(scores + amask, -1)
            ctx = probs @ v
        elif b in ("sink_lse_rescale", "oss_sink_rescale_sign"):
            s = scores + amask
            lse = torch.logsumexp(s, -1, keepdim=True)
            ctx = torch.softmax(s, -1) @ v
            g = torch.sigmoid(sink - lse) if b == "oss_sink_rescale_sign" else torch.sigmoid(lse - sink)
            ctx = ctx * g
        else:
            comb = torch.cat((scores, sink.expand(B, nh, S, 1)), -1) + amask_ext
            comb = comb - comb.max(-1, keepdim=True).values
            probs = torch.softmax(comb, -1)[..., :-1]
            ctx = probs @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nh * hd)
        out = ctx @ L.wo + L.bo
        _rec(pre + "o_proj", out)
        _rec(pre.rstrip("."), out)
        return out

    def _glu(self, gate, up):
        b = _bug()
        lim, al = self.limit, self.alpha
        if b == "oss_swiglu_gate_clamp_both_sides":
            gate = gate.clamp(-lim, lim)
        elif b != "oss_swiglu_clamp_after_activation":
            gate = gate.clamp(max=lim)
        up = up.clamp(-lim, lim)
        glu = gate * torch.sigmoid(gate * al)
        if b == "oss_swiglu_clamp_after_activation":
            glu = glu.clamp(max=lim)
        if b == "oss_swiglu_up_plus_one_missing":
            return up * glu
        return (up + 1) * glu

    def _expert(self, L, e, xs):
        b = _bug()
        if hasattr(L, "wg"):
            gate = xs @ L.wg[e] + L.bg[e]
            up = xs @ L.wu[e] + L.bu[e]
        else:
            gu = xs @ L.wgu[e] + L.bgu[e]
            gate, up = gu[..., 0::2], gu[..., 1::2]
        y = self._glu(gate, up)
        if b == "expert_down_transposed":
            return F.linear(y, L.wd[e])
        return y @ L.wd[e]

    def _moe(self, L, x, pre):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t @ L.wr + L.br
        _rec(pre + "router", logits)
        if b == "oss_router_bias_only_in_selection":
            _, idx = logits.topk(self.top_k, -1)
            w = torch.softmax((t @ L.wr).gather(-1, idx), -1)
        elif b == "router_masked_softmax":
            _, idx = logits.topk(self.top_k, -1)
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, idx, True)
            full = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
            w = full.gather(-1, idx)
        else:
            val, idx = logits.topk(self.top_k, -1)
            w = torch.softmax(val, -1)
        out = torch.zeros_like(t)
        if b == "moe_dense_dispatch":
            R = torch.zeros(t.shape[0], self.E).scatter(-1, idx, w)
            for e in range(self.E):
                out = out + (self._expert(L, e, t) + L.bd[e]) * R[:, e : e + 1]
        else:
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                y = self._expert(L, e, t[tok])
                if b == "oss_down_bias_outside_routing_weight":
                    y = y * w[tok, slot, None] + L.bd[e]
                else:
                    y = (y + L.bd[e]) * w[tok, slot, None]
                out.index_add_(0, tok, y)
        _rec(pre + "experts", out)
        out = out.view(B, S, H)
        _rec(pre.rstrip("."), out)
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        keep = attention_mask.bool()
        qi = torch.arange(S)[:, None]
        ki = torch.arange(S)[None, :]
        causal = ki <= qi
        band = causal & (qi - ki < self.window)
        neg = torch.finfo(torch.float32).min
        keep_ext = F.pad(keep, (1, 0) if b == "oss_sink_pad_column_wrong_side" else (0, 1), value=True)
        masks = {}
        for name, allowed in (("full", causal), ("sliding", band)):
            al = allowed[None, None] & keep[:, None, None, :]
            al_ext = (
                torch.cat((allowed, torch.ones(S, 1, dtype=torch.bool)), 1)[None, None] & keep_ext[:, None, None, :]
            )
            masks[name] = (
                torch.zeros(al.shape).masked_fill(~al, neg),
                torch.zeros(al_ext.shape).masked_fill(~al_ext, neg),
            )
        ang = position_ids[..., None].float() * self.inv_freq
        af = 1.0 if b == "oss_yarn_mscale_in_softmax_scale_once" else self.attn_factor
        cos = (ang.cos() * af)[:, None]
        sin = (ang.sin() * af)[:, None]
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        for L in self.layers:
            p = f"model.layers.{L.idx}."
            x = _rms(h, L.n1, self.eps)
            _rec(p + "input_layernorm", x)
            h = h + self._attn(L, x, masks, cos, sin, p + "self_attn.")
            x = _rms(h, L.n2, self.eps)
            _rec(p + "post_attention_layernorm", x)
            h = h + self._moe(L, x, p + "mlp.")
            _rec(p.rstrip("."), h)
        h = _rms(h, self.final_w, self.eps)
        _rec("model.norm", h)
        logits = h @ self.head
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return GptOssPort(state_dict, config).eval()
