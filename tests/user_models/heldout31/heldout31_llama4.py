"""Hand-written plain-PyTorch port of the Llama 4 text model (Llama4ForCausalLM).

Architecture as this port implements it (what differs from Llama 3 is marked *):
- token embedding, no scaling; untied lm_head; final RMSNorm (gain * x / rms, eps = config.rms_norm_eps).
- decoder layer, pre-norm: h = h + Attn(RMSNorm(h)); h = h + FFN(RMSNorm(h)).
- attention: GQA (query head h reads kv head h // (nq / nkv)), head_dim = config.head_dim, no biases,
  scores scaled by head_dim ** -0.5 on every layer, explicit softmax.
  * layer kinds from config.no_rope_layers (a 1 means the layer USES RoPE):
    - RoPE layers: GPT-J style (interleaved) RoPE, pair (x[2i], x[2i+1]) rotated by pos * inv_freq[i], at the
      caller's position_ids; inv_freq with the Llama 3 frequency remap (rope_parameters: factor, low/high
      freq factors, original_max_position_embeddings); then * the "L2 norm" of q and k, which is an RMS norm
      without a gain (x / sqrt(mean(x^2) + rms_norm_eps)) over head_dim, when config.use_qk_norm;
      * chunked local attention (config.attention_chunk_size = C): a query sees the causal keys of its own
      chunk only, chunks counted from each row's first real token (left padding excluded);
    - NoPE layers: no rotary, no qk norm, full causal attention, and * attention temperature tuning: q at
      sequence index i (the absolute index in the batch row, 0..S-1, padding included, as the reference does;
      not the position id) is multiplied by 1 + attn_scale * log(1 + floor((i + 1) / floor_scale)).
- FFN: dense SwiGLU (intermediate_size_mlp) on the layers outside config.moe_layers; on the MoE layers:
  * router logits = x @ W_r; the top num_experts_per_tok experts are kept, each with weight sigmoid(logit)
    (no normalisation); * the weight scales the expert's INPUT: out = shared(x) + sum_k E_k(w_k * x), where
    every expert and the shared expert are SwiGLU MLPs of width intermediate_size.
Weight layout of this port (own names, not Transformers' tree):
- emb (V, H); head_t (H, V) = lm_head transposed; fin (H,).
- per layer `blocks[i]`: ln_a / ln_f norm gains (H,); wqkv (H, (nq + 2 nkv) hd) = [q | k | v] fused and
  transposed; wo (nq hd, H) transposed; flags use_rope / chunked / moe.
- dense layer: w_in (H, 2 Im) = [gate | up] fused + transposed, w_out (Im, H).
- MoE layer: w_route (H, E); per-expert Linear-style stacks w_gate / w_up (E, I, H) and w_down (E, H, I) (the
  reference's fused gate_up_proj (E, H, 2I) = [gate | up] along the last axis is split and transposed, its
  down_proj (E, I, H) transposed); shared expert sh_in (H, 2I) = [gate | up], sh_out (I, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "llama4_rope_rotate_half",  # RoPE as rotate-half (x_i, x_{i+d/2}) pairs on unpermuted HF q/k weights, not (2i, 2i+1)
    "llama4_rope_scaling_ignored",  # Llama 3 frequency remap (factor / low / high freq) skipped: plain theta ** -2i/d
    "llama4_nope_flag_inverted",  # no_rope_layers read as "1 = NoPE layer": rope, chunking, qk norm, temperature swapped
    "llama4_qk_norm_on_nope",  # the qk "L2 norm" also applied on NoPE layers (reference only normalises RoPE layers)
    "llama4_qk_norm_true_l2",  # qk norm taken literally as L2 (unit-length q, k) instead of the gainless RMS norm
    "llama4_temp_no_floor",  # temperature 1 + s * log1p((i + 1) / floor_scale): the floor is missing
    "llama4_temp_from_position_ids",  # temperature computed from position_ids, reference uses the absolute index
    "llama4_chunk_as_sliding_window",  # chunked attention done as a sliding window of C keys, not fixed C-blocks
    "llama4_chunk_ignores_left_padding",  # chunk id = column // C, not counted from the row's first real token
    "llama4_router_weight_on_output",  # sigmoid router weight multiplies the expert output, not its input
    "llama4_router_softmax",  # top-k router weights by softmax over the chosen logits (Mixtral style), not sigmoid
    "llama4_router_no_topk",  # sigmoid of every logit used, all experts contribute (the top-k selection skipped)
    "llama4_gate_up_swapped",  # fused gate_up_proj split as [up | gate] when loading
    "llama4_experts_not_transposed",  # gate_up_proj (E, H, 2I) taken as Linear-style (E, 2I, H): no transpose at load
]
PADDING_ONLY = {"llama4_temp_from_position_ids", "llama4_chunk_ignores_left_padding"}
CLEAN = [
    "llama4_sdpa",  # attention through F.scaled_dot_product_attention (GQA, float mask with finfo.min)
    "llama4_halfsplit_layout",  # q/k rows permuted per head at load (evens then odds), RoPE then done rotate-half
    "llama4_sigmoid_then_topk",  # sigmoid over all logits first, top-k of the probabilities (monotone: same choice)
    "llama4_dense_experts",  # every expert run on x * (scattered dense score, 0 off the top-k), batched bmm
    "llama4_chunk_by_position",  # chunk id taken as position_id // C (positions already count from the real start)
]


def _llama3_inv_freq(rp, hd):
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if rp.get("rope_type", "default") != "llama3" or BUG == "llama4_rope_scaling_ignored":
        return inv
    factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    ctx = rp["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # long wavelengths slowed by `factor`, short ones kept, the band between blended linearly in ctx / wavelen
    blend = ((ctx / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    out = blend * inv + (1.0 - blend) * inv / factor
    out = torch.where(wavelen < ctx / hi, inv, out)
    return torch.where(wavelen > ctx / lo, inv / factor, out)


class Llama4Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nq
        self.eps = cfg.rms_norm_eps
        self.chunk = cfg.attention_chunk_size
        self.qk_norm = cfg.use_qk_norm
        self.temp = cfg.attn_temperature_tuning
        self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale
        self.topk = cfg.num_experts_per_tok
        self.register_buffer("inv_freq", _llama3_inv_freq(cfg.rope_parameters, self.hd), persistent=False)
        self.emb = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("model.norm.weight"))
        hd = self.hd
        # per-head row order of q / k for the rotate-half form: even components first, then odd ones
        half_perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
        self.blocks = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, f = p + "self_attn.", p + "feed_forward."
            b = nn.Module()
            flag = bool(cfg.no_rope_layers[i])
            b.use_rope = (not flag) if BUG == "llama4_nope_flag_inverted" else flag
            b.chunked = b.use_rope and self.chunk is not None
            b.moe = i in cfg.moe_layers
            b.ln_a = nn.Parameter(g(p + "input_layernorm.weight"))
            b.ln_f = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            wq, wk, wv = g(a + "q_proj.weight"), g(a + "k_proj.weight"), g(a + "v_proj.weight")
            if BUG == "llama4_halfsplit_layout":
                wq = wq.view(self.nq, hd, -1)[:, half_perm].reshape(self.nq * hd, -1)
                wk = wk.view(self.nkv, hd, -1)[:, half_perm].reshape(self.nkv * hd, -1)
            b.wqkv = nn.Parameter(torch.cat([wq, wk, wv], 0).t().contiguous())
            b.wo = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            if b.moe:
                b.w_route = nn.Parameter(g(f + "router.weight").t().contiguous())
                gu = g(f + "experts.gate_up_proj")  # (E, H, 2I): x @ gu[e] gives [gate | up]
                gu_rows = gu if BUG == "llama4_experts_not_transposed" else gu.transpose(1, 2)  # (E, 2I, H)
                inter = gu_rows.shape[1] // 2
                gate, up = gu_rows[:, :inter], gu_rows[:, inter:]
                if BUG == "llama4_gate_up_swapped":
                    gate, up = up, gate
                b.w_gate = nn.Parameter(gate.contiguous())
                b.w_up = nn.Parameter(up.contiguous())
                b.w_down = nn.Parameter(g(f + "experts.down_proj").transpose(1, 2).contiguous())  # (E, H, I)
                s = f + "shared_expert."
                b.sh_in = nn.Parameter(torch.cat([g(s + "gate_proj.weight"), g(s + "up_proj.weight")], 0).t())
                b.sh_out = nn.Parameter(g(s + "down_proj.weight").t().contiguous())
            else:
                b.w_in = nn.Parameter(torch.cat([g(f + "gate_proj.weight"), g(f + "up_proj.weight")], 0).t())
                b.w_out = nn.Parameter(g(f + "down_proj.weight").t().contiguous())
            self.blocks.append(b)

    # ---- helpers ----
    def _rms(self, x, gain=None):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if gain is None else gain * y

    def _rope(self, x, cos, sin):  # x (B, S, h, hd); cos / sin (B, S, 1, hd/2)
        if BUG in ("llama4_halfsplit_layout", "llama4_rope_rotate_half"):
            x1, x2 = x.chunk(2, -1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
        xe, xo = x[..., 0::2], x[..., 1::2]
        return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), -1).flatten(-2)

    def _qk_norm(self, x):
        if BUG == "llama4_qk_norm_true_l2":
            return F.normalize(x, dim=-1, eps=self.eps)
        return self._rms(x)

    # ---- attention ----
    def _attn(self, b, x, cos, sin, allowed, position_ids):
        B, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q, k, v = (x @ b.wqkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        q, k, v = q.view(B, S, nq, hd), k.view(B, S, nkv, hd), v.view(B, S, nkv, hd)
        if b.use_rope:
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self.qk_norm and (b.use_rope or BUG == "llama4_qk_norm_on_nope"):
            q, k = self._qk_norm(q), self._qk_norm(k)
        if self.temp and not b.use_rope:
            if BUG == "llama4_temp_from_position_ids":
                idx = position_ids.float()
            else:
                idx = torch.arange(S, dtype=torch.float32)[None].expand(B, S)
            ratio = (idx + 1.0) / self.floor_scale
            if BUG != "llama4_temp_no_floor":
                ratio = ratio.floor()
            q = q * (1.0 + self.attn_scale * torch.log1p(ratio))[:, :, None, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        low = torch.finfo(torch.float32).min
        if BUG == "llama4_sdpa":
            bias = torch.zeros(allowed.shape).masked_fill(~allowed, low)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=hd**-0.5, enable_gqa=True)
        else:
            rep = nq // nkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            sc = (q @ k.transpose(-1, -2)) * hd**-0.5
            sc = sc.masked_fill(~allowed[:, None], low)
            o = sc.softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, S, nq * hd) @ b.wo

    # ---- feed-forward ----
    @staticmethod
    def _swiglu(x, w_in, w_out):
        gate, up = (x @ w_in).chunk(2, -1)
        return (F.silu(gate) * up) @ w_out

    def _moe(self, b, x):
        B, S, H = x.shape
        t = x.reshape(B * S, H)
        logits = t @ b.w_route  # (N, E)
        if BUG == "llama4_sigmoid_then_topk":
            w, idx = torch.sigmoid(logits).topk(self.topk, -1)
        elif BUG == "llama4_router_no_topk":
            w = torch.sigmoid(logits)
            idx = torch.arange(logits.shape[1]).expand_as(logits)
        else:
            top, idx = logits.topk(self.topk, -1)
            w = top.softmax(-1) if BUG == "llama4_router_softmax" else torch.sigmoid(top)
        if BUG == "llama4_dense_experts":
            dense = torch.zeros_like(logits).scatter(1, idx, w)  # (N, E)
            xin = t[None] * dense.t()[..., None]  # (E, N, H)
            h = F.silu(xin @ b.w_gate.transpose(1, 2)) * (xin @ b.w_up.transpose(1, 2))
            routed = (h @ b.w_down.transpose(1, 2)).sum(0)
        else:
            on_out = BUG == "llama4_router_weight_on_output"
            xin = t[:, None, :] if on_out else t[:, None, :] * w[..., None]  # (N, k, H)
            gate = torch.einsum("nkh,nkih->nki", xin, b.w_gate[idx])
            up = torch.einsum("nkh,nkih->nki", xin, b.w_up[idx])
            y = torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, b.w_down[idx])
            if on_out:
                y = y * w[..., None]
            routed = y.sum(1)
        return (self._swiglu(t, b.sh_in, b.sh_out) + routed).view(B, S, H)

    # ---- masks ----
    def _masks(self, attention_mask, position_ids, S):
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
        if self.chunk is None:
            return causal, causal
        col = torch.arange(S)[None]
        if BUG == "llama4_chunk_as_sliding_window":
            near = (col[:, :, None] - col[:, None, :]) < self.chunk
            return causal, causal & near
        if BUG == "llama4_chunk_by_position":
            cid = position_ids // self.chunk
        else:
            left = (attention_mask.cumsum(-1) == 0).sum(-1, keepdim=True)  # leading padding per row
            if BUG == "llama4_chunk_ignores_left_padding":
                left = torch.zeros_like(left)
            cid = torch.div(col - left, self.chunk, rounding_mode="floor")
        return causal, causal & (cid[:, :, None] == cid[:, None, :])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        position_ids = position_ids.expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        full, local = self._masks(attention_mask, position_ids, S)
        ang = position_ids[..., None].float() * self.inv_freq  # (B, S, hd/2)
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        h = self.emb[input_ids]
        for b in self.blocks:
            allowed = local if b.chunked else full
            h = h + self._attn(b, self._rms(h, b.ln_a), cos, sin, allowed, position_ids)
            x = self._rms(h, b.ln_f)
            h = h + (self._moe(b, x) if b.moe else self._swiglu(x, b.w_in, b.w_out))
        return self._rms(h, self.fin) @ self.head_t


def build(state_dict, config):
    return Llama4Port(state_dict, config).eval()
