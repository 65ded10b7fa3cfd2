"""Hand-written plain-PyTorch port of Doge (DogeForCausalLM), configured as the cross-domain MoE variant.

Architecture as this port implements it (what differs from Llama is marked *):
- token embedding, no scaling; untied lm_head; final RMSNorm (gain * x / rms, eps = config.rms_norm_eps).
- decoder layer, pre-norm with * learned per-channel residual gains:
    h = keep_attn * h + Attn(RMSNorm(h));  h = keep_ffn * h + CDMoE(RMSNorm(h))
  (keep_attn / keep_ffn are `input_residual` / `post_attention_residual`, they scale the residual, not the branch).
- attention: GQA, head_dim = hidden / heads, projections with biases (config.attention_bias);
  * per-head RMSNorm on q and k (over head_dim) before rotate-half RoPE (theta from config.rope_parameters);
  * dynamic mask attention: per kv head a key-wise bias dt = exp(A * softplus(v_flat @ W_dt + b_dt)) computed
    from the VALUE states (all kv heads flattened, (B, S, nkv*hd) -> (B, S, nkv)); the bias is added to the
    scaled scores of every query of that kv group (query head h uses kv head h // (nq / nkv)); masked
    (causal / padding) entries are set to finfo.min (not -inf, so a fully masked pad row averages all values);
  * when the key length exceeds keep_window_size, only the keep_window_size largest biases of each query row
    (after the causal / padding mask) stay, the rest are set to finfo.min.
- * CDMoE FFN (every layer): a shared SwiGLU MLP (intermediate_size) plus product-key routed experts:
  router logits (B, S, 2K), K = floor(sqrt(E)), are * reinterpreted in memory order as (2, B*S, K) (as the
  reference does: not a per-token split; this mixes tokens and batch rows); candidate expert i*K + j has score
  sx[i] + sy[j]; the top num_experts_per_tok are kept with softmax weights over those scores (renormalised if
  norm_topk_prob); expert e is a rank-1 "neuron": out += w * silu(down_embed[e] . x) * up_embed[e].
Weight layout of this port (own names):
- tok (V, H); head_t (H, V) = lm_head transposed; fin (H,).
- per layer `layers[i]`: g1 / g2 norm gains (H,); keep_attn / keep_ffn (H,);
  w_qkv (H, (nq + 2 nkv) hd) fused + transposed, b_qkv ((nq + 2 nkv) hd,); qg / kg (hd,);
  w_dt (nkv hd, nkv) transposed, b_dt (nkv,), decay (nkv,) = A; w_o (nq hd, H) transposed, b_o (H,);
  w_gu (H, 2I) = [gate | up] fused + transposed, w_dn (I, H); w_rt (H, 2K) router transposed;
  mem (E, 2, H): mem[:, 0] = down_embed (the expert's key), mem[:, 1] = up_embed (its value).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "doge_dt_from_keys",  # dynamic-mask bias computed from the (normed, rotated) key states instead of the values
    "doge_dt_no_softplus",  # dt = exp(A * x) without the softplus on the dt projection
    "doge_dt_no_exp",  # bias = A * softplus(x): the exp is missing
    "doge_dt_head_tiled",  # kv-head bias given to query head h as h % nkv (tiled) instead of h // n_rep
    "doge_window_skipped",  # keep_window_size top-k sparsification never applied
    "doge_window_before_mask",  # top-k window chosen over all keys before the causal / padding mask is applied
    "doge_residual_gain_on_branch",  # input_residual gain multiplies the attention output, not the residual
    "doge_ffn_residual_gain_missing",  # post_attention_residual gain dropped (plain residual after the MoE)
    "doge_router_per_token",  # router logits split per token (chunk of the last dim), not the (2, B*S, K) view
    "doge_expert_index_transposed",  # product-key expert id computed as j*K + i instead of i*K + j
    "doge_expert_no_act",  # SiLU missing on the expert key activation down_embed . x
    "doge_route_softmax_all",  # softmax over all K*K candidate scores, top-k probabilities then taken unrenormalised
    "doge_embed_tables_swapped",  # down_embed / up_embed swapped at load
    "doge_pad_rows_zeroed",  # fully masked (padding) query rows give zero instead of the mean value; leaks via router
]
PADDING_ONLY = {"doge_pad_rows_zeroed"}
CLEAN = [
    "doge_sdpa",  # attention through F.scaled_dot_product_attention with the float bias / mask
    "doge_two_stage_keys",  # product-key search as top-K per half, then top-k over the K*K sums
    "doge_dense_experts",  # all experts evaluated, combined through a dense scattered (N, E) weight matrix
    "doge_complex_rope",  # RoPE as complex multiplication of (x_i, x_{i+d/2}) pairs
    "doge_scale_in_qgain",  # 1/sqrt(hd) folded into the q norm gain, scores not scaled afterwards
]


def _rms(x, g, eps):
    x = x.float()
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class DogePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nq
        self.eps = cfg.rms_norm_eps
        self.theta = cfg.rope_parameters["rope_theta"]
        self.window = cfg.keep_window_size
        self.E = cfg.num_experts
        self.K = math.floor(math.sqrt(self.E))
        self.topk = cfg.num_experts_per_tok
        self.renorm = cfg.norm_topk_prob
        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("model.norm.weight"))
        bias = cfg.attention_bias
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            L = nn.Module()
            L.g1 = nn.Parameter(g(p + "input_layernorm.weight"))
            L.g2 = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            L.keep_attn = nn.Parameter(g(p + "input_residual"))
            L.keep_ffn = nn.Parameter(g(p + "post_attention_residual"))
            L.w_qkv = nn.Parameter(torch.cat([g(a + f"{n}_proj.weight") for n in "qkv"], 0).t().contiguous())
            nqkv = L.w_qkv.shape[1]
            L.b_qkv = nn.Parameter(torch.cat([g(a + f"{n}_proj.bias") for n in "qkv"]) if bias else torch.zeros(nqkv))
            L.qg = nn.Parameter(g(a + "q_norm.weight"))
            L.kg = nn.Parameter(g(a + "k_norm.weight"))
            L.w_dt = nn.Parameter(g(a + "dt_proj.weight").t().contiguous())
            L.b_dt = nn.Parameter(g(a + "dt_proj.bias") if bias else torch.zeros(self.nkv))
            L.decay = nn.Parameter(g(a + "A"))
            L.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            L.b_o = nn.Parameter(g(a + "o_proj.bias") if bias else torch.zeros(cfg.hidden_size))
            L.w_gu = nn.Parameter(torch.cat([g(m + "gate_proj.weight"), g(m + "up_proj.weight")], 0).t().contiguous())
            L.w_dn = nn.Parameter(g(m + "down_proj.weight").t().contiguous())
            L.w_rt = nn.Parameter(g(m + "router_gate.weight").t().contiguous())
            tables = [g(m + "down_embed.weight"), g(m + "up_embed.weight")]
            if BUG == "doge_embed_tables_swapped":
                tables = tables[::-1]
            L.mem = nn.Parameter(torch.stack(tables, 1))
            self.layers.append(L)

    # ---- rotary ----
    def _angles(self, pos):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        return pos[..., None].float() * inv  # (B, S, hd/2)

    def _rope(self, x, ang):  # x (B, h, S, hd)
        half = self.hd // 2
        if BUG == "doge_complex_rope":
            z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(ang), ang)[:, None]
            return torch.cat((z.real, z.imag), -1)
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    # ---- attention with the dynamic mask ----
    def _attn(self, L, x, ang, allowed):
        B, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q, k, v = (x @ L.w_qkv + L.b_qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        qg = L.qg * hd**-0.5 if BUG == "doge_scale_in_qgain" else L.qg
        q = _rms(q.view(B, S, nq, hd), qg, self.eps).transpose(1, 2)
        k = _rms(k.view(B, S, nkv, hd), L.kg, self.eps).transpose(1, 2)
        q, k = self._rope(q, ang), self._rope(k, ang)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        src = k if BUG == "doge_dt_from_keys" else v
        dt = src.transpose(1, 2).reshape(B, S, nkv * hd) @ L.w_dt + L.b_dt
        if BUG == "doge_dt_no_softplus":
            dt = torch.exp(L.decay * dt)
        elif BUG == "doge_dt_no_exp":
            dt = L.decay * F.softplus(dt)
        else:
            dt = torch.exp(L.decay * F.softplus(dt))
        low = torch.finfo(torch.float32).min
        bias = dt.transpose(1, 2)[:, :, None, :].expand(B, nkv, S, S)
        if BUG != "doge_window_before_mask":
            bias = bias.masked_fill(~allowed[:, None], low)
        if self.window < S and BUG != "doge_window_skipped":
            top = bias.topk(self.window, -1, sorted=False).indices
            keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, top, True)
            bias = bias.masked_fill(~keep, low)
        if BUG == "doge_window_before_mask":
            bias = bias.masked_fill(~allowed[:, None], low)
        rep = nq // nkv
        if BUG == "doge_dt_head_tiled":
            bias = bias.repeat(1, rep, 1, 1)
        else:
            bias = bias.repeat_interleave(rep, 1)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if BUG == "doge_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            sc = q @ k.transpose(-1, -2)
            if BUG != "doge_scale_in_qgain":
                sc = sc / math.sqrt(hd)
            o = (sc + bias).softmax(-1) @ v
        if BUG == "doge_pad_rows_zeroed":
            o = o * allowed.any(-1)[:, None, :, None]
        o = o.transpose(1, 2).reshape(B, S, nq * hd)
        return o @ L.w_o + L.b_o

    # ---- cross-domain MoE ----
    def _moe(self, L, x):
        B, S, H = x.shape
        N, K = B * S, self.K
        t = x.reshape(N, H)
        gt, up = (t @ L.w_gu).chunk(2, -1)
        shared = (F.silu(gt) * up) @ L.w_dn
        logits = t @ L.w_rt  # (N, 2K)
        if BUG == "doge_router_per_token":
            sx, sy = logits.chunk(2, -1)
        else:
            sx, sy = logits.reshape(2, N, K)  # memory-order reinterpretation, as the reference
        if BUG == "doge_two_stage_keys":
            vx, ix = sx.topk(K, -1)
            vy, iy = sy.topk(K, -1)
            cand = (vx[:, :, None] + vy[:, None, :]).reshape(N, K * K)
            cid = (ix[:, :, None] * K + iy[:, None, :]).reshape(N, K * K)
            score, pos = cand.topk(self.topk, -1)
            idx = cid.gather(1, pos)
        else:
            cand = (sx[:, :, None] + sy[:, None, :]).reshape(N, K * K)
            if BUG == "doge_expert_index_transposed":
                cand = (sx[:, None, :] + sy[:, :, None]).reshape(N, K * K)
            score, idx = cand.topk(self.topk, -1)
        if BUG == "doge_route_softmax_all":
            w = cand.softmax(-1).gather(1, idx)
        else:
            w = score.softmax(-1)
            if self.renorm:
                w = w / w.sum(-1, keepdim=True)
        keys, vals = L.mem[:, 0], L.mem[:, 1]
        if BUG == "doge_dense_experts":
            act = F.silu(t @ keys.t())  # (N, E)
            dense = torch.zeros(N, self.E).scatter(1, idx, w)
            routed = (act * dense) @ vals
        else:
            a = torch.einsum("nkh,nh->nk", keys[idx], t)
            a = a if BUG == "doge_expert_no_act" else F.silu(a)
            routed = torch.einsum("nk,nkh->nh", a * w, vals[idx])
        return (shared + routed).view(B, S, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
        ang = self._angles(position_ids)
        h = self.tok[input_ids]
        for L in self.layers:
            a = self._attn(L, _rms(h, L.g1, self.eps), ang, allowed)
            if BUG == "doge_residual_gain_on_branch":
                h = h + L.keep_attn * a
            else:
                h = L.keep_attn * h + a
            f = self._moe(L, _rms(h, L.g2, self.eps))
            h = (h if BUG == "doge_ffn_residual_gain_missing" else L.keep_ffn * h) + f
        return (_rms(h, self.fin, self.eps) @ self.head_t).float()


def build(state_dict, config):
    return DogePort(state_dict, config).eval()
