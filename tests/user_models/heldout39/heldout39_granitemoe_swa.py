"""Hand-written plain-PyTorch port of GraniteMoeSWA (GraniteMoeSWAForCausalLM, IBM's "granite-swash"):
Granite MoE with shared experts, per-layer sliding-window / full attention, per-layer RoPE bases (NoPE where the
base is 0) and a learnable per-head attention sink.

Architecture as this port implements it (all float32):
- h0 = E[ids] * embedding_multiplier  (untied embedding; no other scaling).
- per layer i (pre-norm, Granite residual scaling m = residual_multiplier):
      a = RMSNorm_in(h);   h = h + m * Attn_i(a)
      b = RMSNorm_post(h); h = h + m * (MoE(b) + SharedMLP(b))
  RMSNorm(x) = w * x / sqrt(mean(x^2) + rms_norm_eps), statistics in float32.
- Attn_i: q, k, v = a Wq + bq, a Wk + bk, a Wv + bv (biases when attention_bias), head_dim = hidden / heads,
  GQA (kv head j serves query heads j*g .. j*g+g-1, g = heads / kv_heads).
  RoPE with base theta_i = layer_rope_theta[i] (theta_i == 0: NoPE, no rotation; the global
  rope_parameters["rope_theta"] is then not used by any layer): inv_freq_j = theta^(-2j/d), angle = pos * inv_freq,
  rotate-half pairing (x_j, x_{j+d/2}): [x1 cos - x2 sin, x2 cos + x1 sin]; positions = position_ids, else 0..T-1.
  scores s = (q . k) * attention_multiplier (NOT 1/sqrt(d)); mask: causal, key not padding, and for
  layer_types[i] == "sliding_attention" also q - k < sliding_window (the query and the W-1 keys before it);
  masked scores set to finfo(float32).min.
  p = softmax(s); o_h = (p v) * sigmoid(logsumexp(s) - sink_h)  (the sink as an extra softmax logit:
  equivalently softmax over [s, sink] with the sink column dropped); out = concat_h(o_h) Wo + bo.
- MoE: router logits r = b Wr (no bias); top-k (num_experts_per_tok) of r, weights = softmax over the k chosen
  logits only; expert e: down_e(silu(gate_e b) * up_e b); MoE(b) = sum_k weight_k * expert_{idx_k}(b).
- SharedMLP (shared_intermediate_size > 0): out(silu(gate b) * up b), no biases.
- logits = RMSNorm_final(h) W_head / logits_scaling.
Weight layout of this port (own names; Transformers' in brackets):
- tok_emb (V, H) [embed_tokens]; out_norm (H,) [norm]; head_t (H, V) = lm_head transposed.
- blocks[i]: norms (2, H) = stacked [input_layernorm; post_attention_layernorm];
  qkv_t (H, (nh + 2 nkv) d) = [q_proj | k_proj | v_proj] fused and transposed, qkv_b the fused biases;
  o_t (nh d, H) = o_proj transposed, o_b; sink (nh,) [sinks];
  gate_t (H, E) = router transposed; w_gate, w_up (E, H, I) = gate_up_proj split in its [gate; up] halves and
  transposed; w_down (E, I, H) = down_proj transposed;
  sh_in_t (H, 2S) = shared input_linear transposed ([gate | up] columns); sh_out_t (S, H) = output_linear transposed;
  buffer inv_freq (d/2,) precomputed from the layer's own theta (absent for a NoPE layer); flags sliding / rope.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "attn_scale_rsqrt_head_dim",  # scores scaled by 1/sqrt(head_dim) instead of config.attention_multiplier
    "sink_dropped",  # the learned sink is never applied: plain softmax attention (no sigmoid(lse - sink) scale)
    "sink_sign_flipped",  # sink scale computed as sigmoid(sink - lse) instead of sigmoid(lse - sink)
    "window_off_by_one",  # sliding mask keeps q - k <= W (W + 1 keys) instead of q - k < W
    "layer_types_default_rule",  # sliding/full taken from the default rule (full iff i % 4 == 0), not config.layer_types
    "nope_falls_back_to_global_theta",  # layer_rope_theta 0 read as "unset": that layer gets RoPE at the global rope_theta
    "rope_interleaved",  # RoPE rotates adjacent pairs (x_2j, x_2j+1) (GPT-J style) instead of halves (x_j, x_j+d/2)
    "gqa_kv_tiled",  # kv heads repeated by tiling (query head h uses kv head h % nkv) instead of h // g
    "router_softmax_all_experts",  # softmax over all experts before top-k, chosen weights not renormalised
    "expert_gate_up_swapped",  # fused gate_up_proj split at load as [up; gate] instead of [gate; up]
    "shared_mlp_unnormed_input",  # shared MLP fed the residual stream instead of post_attention_layernorm's output
    "residual_multiplier_on_sum",  # attention residual scaled on the sum, (h + attn) * m, instead of h + m * attn
    "logits_scaling_multiplied",  # logits multiplied by logits_scaling instead of divided
    "sliding_mask_ignores_padding",  # sliding-window layers build causal+window mask without the padding mask
]
PADDING_ONLY = ["sliding_mask_ignores_padding"]
CLEAN = [
    "clean_sink_as_logit",  # sink as an extra softmax column [s | sink], that column dropped after the softmax
    "clean_dense_moe",  # every expert on every token, mixed with a dense (N, E) weight matrix (zeros off the top-k)
    "clean_rope_complex",  # RoPE as a complex product (x_j + i x_{j+d/2}) * exp(i pos inv_freq_j)
    "clean_window_unfold",  # sliding layers: each query gathers its own W keys (unfold over a left-padded K/V)
    "clean_folded_multipliers",  # embedding/residual multipliers and 1/logits_scaling folded into weights at load
]


def _bug():
    return BUG


# ----------------------------------------------------------------------------------------------- helpers


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rope_half(x, cos, sin):
    # x (b, h, t, d); cos/sin (b, t, d/2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rope_pairs(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None], sin[:, None]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


def _rope_complex(x, cos, sin):
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:])
    r = torch.complex(cos, sin)[:, None]
    out = z * r
    return torch.cat((out.real, out.imag), dim=-1)


# ----------------------------------------------------------------------------------------------- blocks


class Block(nn.Module):
    def __init__(self, sd, p, config, i, bug):
        super().__init__()
        H = config.hidden_size
        self.nh = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.d = H // self.nh
        self.eps = config.rms_norm_eps
        self.scale = config.attention_multiplier
        self.window = config.sliding_window
        self.top_k = config.num_experts_per_tok

        if bug == "layer_types_default_rule":
            self.sliding = i % 4 != 0
        else:
            self.sliding = config.layer_types[i] == "sliding_attention"
        theta = config.layer_rope_theta[i]
        if bug == "nope_falls_back_to_global_theta":
            theta = theta or config.rope_parameters["rope_theta"]
        self.rope = bool(theta)
        if self.rope:
            inv = 1.0 / (theta ** (torch.arange(0, self.d, 2, dtype=torch.float) / self.d))
            self.register_buffer("inv_freq", inv, persistent=False)

        m = config.residual_multiplier
        fold = bug == "clean_folded_multipliers"
        a = p + "self_attn."
        self.norms = nn.Parameter(
            torch.stack([sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]])
        )
        w = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]], 0)
        self.qkv_t = nn.Parameter(w.t().contiguous())
        if config.attention_bias:
            self.qkv_b = nn.Parameter(torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]))
            o_b = sd[a + "o_proj.bias"]
        else:
            self.qkv_b = nn.Parameter(torch.zeros(w.shape[0]))
            o_b = torch.zeros(H)
        self.o_t = nn.Parameter(sd[a + "o_proj.weight"].t().contiguous() * (m if fold else 1.0))
        self.o_b = nn.Parameter(o_b * (m if fold else 1.0))
        self.sink = nn.Parameter(sd[a + "sinks"].clone())

        e = p + "block_sparse_moe."
        self.gate_t = nn.Parameter(sd[e + "router.weight"].t().contiguous())
        gu = sd[e + "experts.gate_up_proj"]  # (E, 2I, H)
        I = gu.shape[1] // 2
        g, u = gu[:, :I], gu[:, I:]
        if bug == "expert_gate_up_swapped":
            g, u = u, g
        self.w_gate = nn.Parameter(g.transpose(1, 2).contiguous())
        self.w_up = nn.Parameter(u.transpose(1, 2).contiguous())
        self.w_down = nn.Parameter(sd[e + "experts.down_proj"].transpose(1, 2).contiguous() * (m if fold else 1.0))

        self.shared = config.shared_intermediate_size > 0
        if self.shared:
            self.sh_in_t = nn.Parameter(sd[p + "shared_mlp.input_linear.weight"].t().contiguous())
            self.sh_out_t = nn.Parameter(
                sd[p + "shared_mlp.output_linear.weight"].t().contiguous() * (m if fold else 1.0)
            )
        self.m = 1.0 if fold else m

    # ---------------------------------------------------------------- attention
    def _mask(self, T, pad, device):
        q = torch.arange(T, device=device)[:, None]
        k = torch.arange(T, device=device)[None, :]
        allowed = k <= q
        if self.sliding:
            if _bug() == "window_off_by_one":
                allowed = allowed & (q - k <= self.window)
            else:
                allowed = allowed & (q - k < self.window)
        allowed = allowed[None]  # (1, T, T)
        if pad is not None and not (self.sliding and _bug() == "sliding_mask_ignores_padding"):
            allowed = allowed & pad[:, None, :]
        return allowed[:, None]  # (b or 1, 1, T, T)

    def attn(self, x, cos, sin, pad):
        B, T, _ = x.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        qkv = x @ self.qkv_t + self.qkv_b
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = q.view(B, T, nh, d).transpose(1, 2)
        k = k.view(B, T, nkv, d).transpose(1, 2)
        v = v.view(B, T, nkv, d).transpose(1, 2)
        if self.rope:
            rot = _rope_half
            if _bug() == "rope_interleaved":
                rot = _rope_pairs
            elif _bug() == "clean_rope_complex":
                rot = _rope_complex
            q, k = rot(q, cos, sin), rot(k, cos, sin)
        g = nh // nkv
        if _bug() == "gqa_kv_tiled":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scale = 1.0 / math.sqrt(d) if _bug() == "attn_scale_rsqrt_head_dim" else self.scale
        neg = torch.finfo(torch.float32).min
        sink = self.sink.view(1, nh, 1)

        if self.sliding and _bug() == "clean_window_unfold":
            W = self.window
            kp = F.pad(k, (0, 0, W - 1, 0)).unfold(2, W, 1)  # (B, nh, T, d, W)
            vp = F.pad(v, (0, 0, W - 1, 0)).unfold(2, W, 1)
            s = torch.einsum("bhtd,bhtdw->bhtw", q, kp) * scale
            valid = torch.ones(B, T, dtype=torch.bool, device=x.device) if pad is None else pad
            valid = F.pad(valid, (W - 1, 0), value=False).unfold(1, W, 1)  # (B, T, W)
            s = s.masked_fill(~valid[:, None], neg)
            lse = torch.logsumexp(s, dim=-1)
            o = torch.einsum("bhtw,bhtdw->bhtd", torch.softmax(s, dim=-1), vp)
            o = o * torch.sigmoid(lse - sink)[..., None]
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~self._mask(T, pad, x.device), neg)
            if _bug() == "clean_sink_as_logit":
                col = sink[..., None].expand(B, nh, T, 1)
                pr = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
                o = pr @ v
            else:
                lse = torch.logsumexp(s, dim=-1)
                o = torch.softmax(s, dim=-1) @ v
                if _bug() == "sink_sign_flipped":
                    o = o * torch.sigmoid(sink - lse)[..., None]
                elif _bug() != "sink_dropped":
                    o = o * torch.sigmoid(lse - sink)[..., None]
        o = o.transpose(1, 2).reshape(B, T, nh * d)
        return o @ self.o_t + self.o_b

    # ---------------------------------------------------------------- MoE
    def moe(self, x):
        B, T, H = x.shape
        xs = x.reshape(-1, H)
        logits = xs @ self.gate_t  # (N, E)
        if _bug() == "router_softmax_all_experts":
            wts, idx = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        else:
            top, idx = logits.topk(self.top_k, dim=-1)
            wts = torch.softmax(top, dim=-1)
        if _bug() == "clean_dense_moe":
            dense = torch.zeros_like(logits).scatter(1, idx, wts)  # (N, E)
            h = F.silu(torch.einsum("nh,ehi->eni", xs, self.w_gate)) * torch.einsum("nh,ehi->eni", xs, self.w_up)
            y = torch.einsum("eni,eih->enh", h, self.w_down)
            out = torch.einsum("ne,enh->nh", dense, y)
        else:
            out = torch.zeros_like(xs)
            for e in range(self.w_gate.shape[0]):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                xe = xs[tok]
                he = F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])
                out.index_add_(0, tok, (he @ self.w_down[e]) * wts[tok, slot, None])
        return out.view(B, T, H)

    def shared_mlp(self, x):
        gu = x @ self.sh_in_t
        gt, up = gu.chunk(2, dim=-1)
        return (F.silu(gt) * up) @ self.sh_out_t

    def forward(self, h, cos, sin, pad):
        m = self.m
        a = _rms(h, self.norms[0], self.eps)
        att = self.attn(a, cos, sin, pad)
        if _bug() == "residual_multiplier_on_sum":
            h = (h + att) * m
        else:
            h = h + att * m
        b = _rms(h, self.norms[1], self.eps)
        f = self.moe(b)
        if self.shared:
            f = f + self.shared_mlp(h if _bug() == "shared_mlp_unnormed_input" else b)
        return h + f * m


class GraniteMoeSWAPort(nn.Module):
    def __init__(self, sd, config, bug):
        super().__init__()
        fold = bug == "clean_folded_multipliers"
        self.emb_mult = 1.0 if fold else config.embedding_multiplier
        self.logit_div = 1.0 if fold else config.logits_scaling
        self.eps = config.rms_norm_eps
        emb = sd["model.embed_tokens.weight"]
        self.tok_emb = nn.Parameter(emb * (config.embedding_multiplier if fold else 1.0))
        self.blocks = nn.ModuleList(
            [Block(sd, f"model.layers.{i}.", config, i, bug) for i in range(config.num_hidden_layers)]
        )
        self.out_norm = nn.Parameter(sd["model.norm.weight"].clone())
        head = sd["lm_head.weight"] if "lm_head.weight" in sd else emb
        self.head_t = nn.Parameter(head.t().contiguous() / (config.logits_scaling if fold else 1.0))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        h = F.embedding(input_ids, self.tok_emb) * self.emb_mult
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        position_ids = position_ids.expand(B, T)
        pad = None if attention_mask is None else attention_mask.bool()
        tables = {}
        for blk in self.blocks:
            cos = sin = None
            if blk.rope:
                key = float(blk.inv_freq[-1])
                if key not in tables:
                    ang = position_ids[..., None].float() * blk.inv_freq
                    tables[key] = (ang.cos(), ang.sin())
                cos, sin = tables[key]
            h = blk(h, cos, sin, pad)
        h = _rms(h, self.out_norm, self.eps)
        logits = h @ self.head_t
        if _bug() == "logits_scaling_multiplied":
            return logits * self.logit_div
        return logits / self.logit_div


def build(state_dict, config):
    return GraniteMoeSWAPort(state_dict, config, BUG).eval()
