"""Hand-written plain-PyTorch port of an IBM Granite MoE (GraniteMoeForCausalLM) causal LM.

Architecture as this port implements it:
  * h0 = E[ids] * embedding_multiplier (E tied with the output head here, the head uses the UNSCALED E);
  * pre-norm blocks with RMSNorm, both residual branches scaled by residual_multiplier:
        h = h + residual_multiplier * Attn(RMS_1(h))
        h = h + residual_multiplier * MoE(RMS_2(h))
  * attention: Llama-style GQA with half-split (rotate_half) RoPE, no biases; the softmax scale is
    config.attention_multiplier itself (NOT head_dim**-0.5);
  * MoE: router logits r = x W_r^T over num_local_experts; the top-k logits are picked first and the
    softmax is taken over those k logits only; each chosen expert e computes
        (silu(x G_e) * (x U_e)) D_e   with gate G_e = first half, up U_e = second half of the fused
    HF gate_up_proj[e] (2I, H) rows, down_proj[e] (H, I); outputs are summed with the top-k weights;
  * logits = RMS_final(h) @ E^T / logits_scaling (a divisor, not a multiplier);
  * positions 0..S-1 for every row (HF does not skip left pads); padding enters through the key mask.

Weight layout of this port (own names, not the HF state-dict names):
  embed_table (V, H); stack[i].rms1.w / rms2.w (H,);
  stack[i].attn.q_t / k_t / v_t / o_t as (in, out) matrices;
  stack[i].moe.route.w_t (H, E);
  stack[i].moe.bank.w13 (E, H, 2I) = per-expert [gate | up] in (in, out) layout, stack[i].moe.bank.w2 (E, I, H);
  rms_f.w (H,); head_t (H, V) = E^T (own transposed copy).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "gm_logits_scaling_multiplied",  # logits multiplied by logits_scaling like the other Granite multipliers, instead of divided
    "gm_embed_multiplier_into_tied_head",  # embedding_multiplier folded into the embedding matrix at load, which is shared with the tied head
    "gm_attention_scale_sqrt_head_dim",  # Llama template softmax scale head_dim**-0.5; attention_multiplier ignored
    "gm_attention_multiplier_and_sqrt",  # attention_multiplier applied on top of the template's head_dim**-0.5 instead of replacing it
    "gm_residual_multiplier_on_skip",  # residual_multiplier applied to the skip path: h * m + f(h) instead of h + m * f(h)
    "gm_residual_multiplier_attn_only",  # residual_multiplier applied after attention only; the MoE branch is added unscaled
    "gm_router_softmax_before_topk",  # Mixtral/Qwen-MoE template: softmax over all experts, then top-k probabilities kept without renormalising
    "gm_gate_up_halves_swapped",  # loader splits the fused gate_up_proj rows as (up, gate) instead of (gate, up)
    "gm_gate_up_rows_interleaved",  # GPT-OSS style split: gate = even rows, up = odd rows of gate_up_proj, instead of first/second halves
    "gm_expert_down_untransposed",  # expert down_proj[e] (H, I) stored without the transpose into the (in, out) layout (square here, so it runs)
    "gm_router_reads_residual",  # router fed the residual stream h instead of the post_attention_layernorm output the experts get
    "gm_sdpa_is_causal_ignores_padding",  # F.scaled_dot_product_attention(is_causal=True) with the attention_mask never turned into a key mask
]
PADDING_ONLY = {"gm_sdpa_is_causal_ignores_padding"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a boolean causal & padding mask, scale=attention_multiplier
    "multipliers_folded",  # attention_multiplier folded into q, embedding_multiplier into a private embedding copy, 1/logits_scaling into the head
    "residual_multiplier_folded",  # residual_multiplier folded into o_proj and every expert's down matrix at load
    "dense_expert_mixture",  # every expert run on every token, combined with a dense (T, E) weight matrix zero outside the top-k
    "sorted_segment_dispatch",  # (token, slot) pairs sorted by expert and split by counts (ParallelExperts style), index_add back
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.w = _P(w)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


def _rotate_half(x, cos, sin):
    cos, sin = cos[:, None], sin[:, None]
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class SelfAttn(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        b = _bug()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.nh
        self.pre = pre
        if b == "gm_attention_scale_sqrt_head_dim":
            self.scale = self.hd**-0.5
        elif b == "gm_attention_multiplier_and_sqrt":
            self.scale = float(cfg.attention_multiplier) * self.hd**-0.5
        else:
            self.scale = float(cfg.attention_multiplier)
        wq = sd[pre + "q_proj.weight"]
        if b == "multipliers_folded":
            wq = wq * self.scale
            self.scale = 1.0
        wo = sd[pre + "o_proj.weight"]
        if b == "residual_multiplier_folded":
            wo = wo * float(cfg.residual_multiplier)
        self.q_t, self.k_t, self.v_t = _P(wq.t()), _P(sd[pre + "k_proj.weight"].t()), _P(sd[pre + "v_proj.weight"].t())
        self.o_t = _P(wo.t())
        self.bias = {n: sd.get(pre + n + "_proj.bias") for n in "qkvo"}

    def _lin(self, x, w, n):
        y = x @ w
        return y if self.bias[n] is None else y + self.bias[n]

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q, k, v = self._lin(x, self.q_t, "q"), self._lin(x, self.k_t, "k"), self._lin(x, self.v_t, "v")
        if b != "multipliers_folded":
            _rec(self.pre + "q_proj", q)
        _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = _rotate_half(q.view(B, S, nh, hd).transpose(1, 2), cos, sin)
        k = _rotate_half(k.view(B, S, nkv, hd).transpose(1, 2), cos, sin)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        g = nh // nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if b == "gm_sdpa_is_causal_ignores_padding":
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        elif b == "sdpa":
            ctx = torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale))
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = self._lin(ctx.transpose(1, 2).reshape(B, S, nh * hd), self.o_t, "o")
        if b != "residual_multiplier_folded":
            _rec(self.pre + "o_proj", out)
            _rec(self.pre.rstrip("."), out)
        return out


class Router(nn.Module):
    def __init__(self, w, k):
        super().__init__()
        self.w_t = _P(w.t())
        self.k = k

    def forward(self, x):
        """x (T, H) -> logits (T, E), top-k weights (T, k), top-k expert ids (T, k)"""
        logits = x @ self.w_t
        if _bug() == "gm_router_softmax_before_topk":
            wts, idx = torch.softmax(logits, -1).topk(self.k, -1)
        else:
            top, idx = logits.topk(self.k, -1)
            wts = torch.softmax(top, -1)
        return logits, wts, idx


class ExpertBank(nn.Module):
    def __init__(self, gate_up, down, res_mult):
        super().__init__()
        b = _bug()
        inter = gate_up.shape[1] // 2
        if b == "gm_gate_up_rows_interleaved":
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        elif b == "gm_gate_up_halves_swapped":
            up, gate = gate_up[:, :inter], gate_up[:, inter:]
        else:
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        self.I = inter
        self.w13 = _P(torch.cat((gate, up), 1).transpose(1, 2))  # (E, H, 2I)
        w2 = down if b == "gm_expert_down_untransposed" else down.transpose(1, 2)  # (E, I, H)
        if b == "residual_multiplier_folded":
            w2 = w2 * res_mult
        self.w2 = _P(w2)

    def ffn(self, e, x):
        g, u = (x @ self.w13[e]).split(self.I, -1)
        return (F.silu(g) * u) @ self.w2[e]

    def forward(self, x, wts, idx):
        b = _bug()
        T, H = x.shape
        E = self.w13.shape[0]
        if b == "dense_expert_mixture":
            dense = torch.zeros(T, E).scatter(1, idx, wts)  # (T, E)
            g, u = torch.einsum("th,ehf->etf", x, self.w13).split(self.I, -1)
            ys = torch.einsum("eti,eih->eth", F.silu(g) * u, self.w2)
            return torch.einsum("te,eth->th", dense, ys)
        out = torch.zeros(T, H)
        if b == "sorted_segment_dispatch":
            flat_e = idx.reshape(-1)
            order = flat_e.argsort(stable=True)
            tok = order // idx.shape[1]
            w = wts.reshape(-1)[order]
            counts = torch.bincount(flat_e, minlength=E).tolist()
            start = 0
            for e, c in enumerate(counts):
                if c:
                    t = tok[start : start + c]
                    out.index_add_(0, t, self.ffn(e, x[t]) * w[start : start + c, None])
                start += c
            return out
        for e in range(E):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, self.ffn(e, x[tok]) * wts[tok, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        self.route = Router(sd[pre + "router.weight"], cfg.num_experts_per_tok)
        self.bank = ExpertBank(
            sd[pre + "experts.gate_up_proj"], sd[pre + "experts.down_proj"], float(cfg.residual_multiplier)
        )
        self.pre = pre

    def forward(self, x, raw=None):
        B, S, H = x.shape
        flat = x.reshape(-1, H)
        r_in = raw.reshape(-1, H) if raw is not None else flat
        logits, wts, idx = self.route(r_in)
        _rec(self.pre + "router", logits)
        y = self.bank(flat, wts, idx)
        if _bug() != "residual_multiplier_folded":
            _rec(self.pre + "experts", y)
            _rec(self.pre.rstrip("."), y.view(B, S, H))
        return y.view(B, S, H)


class Layer(nn.Module):
    def __init__(self, sd, cfg, idx):
        super().__init__()
        pre = f"model.layers.{idx}."
        self.rms1 = RMSNorm(sd[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = SelfAttn(sd, pre + "self_attn.", cfg)
        self.rms2 = RMSNorm(sd[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.moe = MoE(sd, pre + "block_sparse_moe.", cfg)
        self.m = 1.0 if _bug() == "residual_multiplier_folded" else float(cfg.residual_multiplier)
        self.pre = pre

    def forward(self, h, allowed, cos, sin):
        b = _bug()
        m = self.m
        n = self.rms1(h)
        _rec(self.pre + "input_layernorm", n)
        a = self.attn(n, allowed, cos, sin)
        h = h * m + a if b == "gm_residual_multiplier_on_skip" else h + a * m
        n = self.rms2(h)
        _rec(self.pre + "post_attention_layernorm", n)
        f = self.moe(n, raw=h if b == "gm_router_reads_residual" else None)
        if b == "gm_residual_multiplier_on_skip":
            h = h * m + f
        elif b == "gm_residual_multiplier_attn_only":
            h = h + f
        else:
            h = h + f * m
        _rec(self.pre.rstrip("."), h)
        return h


class GraniteMoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        H = cfg.hidden_size
        hd = H // cfg.num_attention_heads
        theta = float(cfg.rope_parameters["rope_theta"])
        if cfg.rope_parameters.get("rope_type", "default") != "default":
            raise NotImplementedError(cfg.rope_parameters["rope_type"])
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)), persistent=False
        )
        emb = sd["model.embed_tokens.weight"]
        head = emb if cfg.tie_word_embeddings else sd["lm_head.weight"]
        self.emb_mult = float(cfg.embedding_multiplier)
        self.logit_div = float(cfg.logits_scaling)
        if b == "gm_embed_multiplier_into_tied_head" and cfg.tie_word_embeddings:
            emb = emb * self.emb_mult
            head = emb
            self.emb_mult = 1.0
        elif b == "multipliers_folded":
            emb = emb * self.emb_mult
            head = head / self.logit_div
            self.emb_mult, self.logit_div = 1.0, 1.0
        elif b == "gm_logits_scaling_multiplied":
            self.logit_div = 1.0 / self.logit_div
        self.embed_table = _P(emb)
        self.head_t = _P(head.t())
        self.stack = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.rms_f = RMSNorm(sd["model.norm.weight"], cfg.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None]
        position_ids = position_ids.expand(B, S)
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        h = self.embed_table[input_ids]
        if b not in ("multipliers_folded", "gm_embed_multiplier_into_tied_head"):
            _rec("model.embed_tokens", h)
        h = h * self.emb_mult
        ang = position_ids[..., None].float() * self.inv_freq
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos(), ang.sin()
        _rec("model.rotary_emb", cos)
        for layer in self.stack:
            h = layer(h, allowed, cos, sin)
        h = self.rms_f(h)
        _rec("model.norm", h)
        logits = h @ self.head_t
        if b != "multipliers_folded":
            _rec("lm_head", logits)
        return (logits / self.logit_div).float()


def build(state_dict, config):
    return GraniteMoePort(state_dict, config).eval()
