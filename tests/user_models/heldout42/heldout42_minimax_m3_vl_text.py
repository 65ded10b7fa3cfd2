"""Hand-written plain-PyTorch port of MiniMax-M3's text decoder (MiniMaxM3VLForCausalLM, model_type
minimax_m3_vl_text): GQA attention with per-head Gemma QK-norm and partial RoPE, on some layers restricted by a
"lightning indexer" block selection, and per layer either a dense SwiGLU-OAI MLP or a sigmoid-routed MoE with a
shared expert.

Architecture as this port implements it (all float32):
- x = E[ids] (no embedding scale).  RMSNorm(x; s) = x * rsqrt(mean(x^2) + eps) * s, eps = config.rms_norm_eps, and
  every norm is Gemma-style: s = 1 + w (w the stored, zero-centred weight; the +1 is folded at load).
- layer i, pre-norm:  h = h + Attn_i(RMSNorm(h; s_in));  h = h + MLP_i(RMSNorm(h; s_post)).
  Final: logits = RMSNorm(h; s_final) @ W_head^T (untied head).
- positions p = position_ids (arange when None).  RoPE on the first rd = int(head_dim * partial_rotary_factor)
  channels of a head (rope_parameters' factor; the config's rotary_dim field is not what Transformers reads),
  half-split (NeoX) pairing (c, c + rd/2), inv_freq_j = theta^(-2j/rd), angle = p * inv_freq; the other
  head_dim - rd channels pass through.
- attention (every layer): q = W_q x, k = W_k x, v = W_v x split into heads (head_dim = config.head_dim, which
  need not be hidden/heads); q and k each RMS-normalised PER HEAD over head_dim with their own 1 + w scale,
  THEN rotated; scores = q k^T * head_dim^-0.5 + M; softmax in float32; out = W_o concat_heads(P v).  GQA:
  query head j reads KV head j // (heads / kv_heads).  M is additive: 0 where allowed, finfo(float32).min
  elsewhere (a row with nothing allowed therefore averages all values uniformly, as Transformers' eager does).
  Dense layers ("full_attention"): allowed = causal over slots (key slot <= query slot) and key not padding.
- sparse layers ("minimax_m3_sparse"), the lightning indexer, on the same normed input x:
  iq = RMSNorm_head(W_iq x) (index_n_heads heads of index_head_dim), ik = RMSNorm(W_ik x) (one shared head),
  both rotated with the same tables cut to min(rd, index_head_dim) channels;
  S[b, g, t, j] = iq[t] . ik[j] (no scale), set to -inf where key SLOT j > position p_t (positions against slots,
  as Transformers does it); pooled per block of index_block_size keys by max -> B[b, g, t, blk];
  the local blocks q_blk - l (l < index_local_blocks, q_blk = p_t // block_size, clamped at 0) forced to +inf;
  keep the top index_topk_blocks blocks whose score is not -inf.  Indexer head g's selection is given to query
  heads g * (heads / index_n_heads) ... (repeat-interleave, i.e. one selection per KV group); the attention's
  allowed set = selected-block keys AND the dense layers' causal/padding rule.
- dense MLP (dense_intermediate_size) and shared expert (shared_intermediate_size):
  g = W_g x, u = W_u x; g <- min(g, L); u <- clamp(u, -L, L) (L = swiglu_limit);
  y = W_d ((u + 1) * g * sigmoid(alpha * g)) (alpha = swiglu_alpha).
- MoE: r = W_r x; s = sigmoid(r); choose top num_experts_per_tok of s + b (b = e_score_correction_bias, for the
  choice only); weights = s of the chosen, renormalised to sum 1; y = routed_scaling_factor * sum_k w_k E_k(x)
  + Shared(x), each expert E_k the same SwiGLU-OAI MLP (intermediate_size).

Weight layout of this port (own names, all made at load time):
- emb (V, H); head_t (H, V) = lm_head transposed; final_scale (H,) = 1 + model.norm.weight.
- per block `blocks[i]`: norm_scale (2, H) = [1 + input_layernorm; 1 + post_attention_layernorm] stacked;
  w_qkv_t (H, (nq + 2 nk) d) = [q | k | v] fused and transposed; qk_scale (2, d) = [1 + q_norm; 1 + k_norm];
  w_o_t (nq d, H) transposed.
  sparse layers: w_idx_t (H, n_idx di + di) = [indexer q | indexer k] fused and transposed;
  idx_scale (2, di) = [1 + indexer q_norm; 1 + indexer k_norm].
  dense MLP `ffn`: w_gate_t, w_up_t (H, I) split from the fused gate_up_proj (first half gate, second half up)
  and transposed; w_down_t (I, H).
  MoE: `router` a ParameterDict {weight_t (H, E), choice_bias (E,)}; `experts` with w_gate, w_up (E, H, I)
  split from gate_up_proj (E, 2I, H) and transposed per expert, w_down (E, I, H); `shared` as the dense MLP.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qk_norm_across_heads",  # attention q/k RMS statistic taken over all heads of a token (MiniMax-M2's full-width QK-norm) instead of per head
    "final_norm_no_offset",  # final norm scale loaded as w instead of 1 + w (the Gemma-style +1 forgotten for model.norm only)
    "rope_full_head",  # partial_rotary_factor ignored: RoPE tables built over the whole head_dim, every channel rotated
    "attn_scale_from_hidden",  # softmax scale (hidden_size / num_heads)^-0.5 = 16^-0.5 instead of head_dim^-0.5 = 24^-0.5
    "glu_alpha_from_hidden_act",  # SwiGLU-OAI gate activation taken from config.hidden_act ("silu"): g * sigmoid(g), swiglu_alpha unused
    "experts_gate_up_interleaved",  # experts' fused gate_up split GPT-OSS style (gate = rows 0::2, up = rows 1::2) instead of two halves
    "experts_up_no_offset",  # routed experts compute up * glu instead of (up + 1) * glu (dense MLP and shared expert correct)
    "router_softmax",  # router scores softmax(logits) (Mixtral style) instead of sigmoid(logits), for choice and weights
    "router_bias_in_weights",  # combine weights gathered from sigmoid + e_score_correction_bias, not from the unbiased sigmoid
    "routed_scale_after_shared",  # routed_scaling_factor applied to routed + shared sum instead of to the routed part only
    "indexer_local_off_by_one",  # local blocks taken as q_blk - 1 - l (the blocks strictly before the query's) instead of q_blk - l
    "indexer_heads_tiled",  # indexer head selection expanded to query heads by tiling (head j gets g = j % n_idx) not repeat-interleave
    "indexer_no_future_mask",  # indexer scores of future keys not set to -inf: future blocks compete for (and waste) top-k slots
    "indexer_slot_positions",  # indexer ignores position_ids: q_blk and the future-key test use the query's slot index
]
PADDING_ONLY = ["indexer_slot_positions"]
CLEAN = [
    "attn_online_softmax",  # attention over keys in chunks of 8 with a running max / running sum (flash-style)
    "experts_dense_all",  # every expert on every token, combined with a dense (tokens, experts) weight matrix
    "rope_complex",  # RoPE as a complex product (a + ib) * e^{i angle} on the half-split pairs
    "norm_folded_into_proj",  # 1 + w of input/post-attention norms folded into the following projections' rows
    "indexer_rank_select",  # block max via scatter_reduce over key // block_size; top-k by pairwise rank counting
]


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x, cos, sin, ang):
    """x (B, heads, S, D); cos/sin/ang (B, 1, S, r): rotate the first r channels (half-split pairs)."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    if BUG == "rope_complex":
        h = r // 2
        z = torch.complex(xr[..., :h], xr[..., h:]) * torch.polar(torch.ones_like(ang[..., :h]), ang[..., :h])
        out = torch.cat((z.real, z.imag), dim=-1)
    else:
        out = xr * cos + _rotate_half(xr) * sin
    return torch.cat((out, xp), dim=-1)


def _oai_glu(g, u, limit, alpha, up_offset=1.0):
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    if BUG == "glu_alpha_from_hidden_act":
        act = g * torch.sigmoid(g)
    else:
        act = g * torch.sigmoid(alpha * g)
    return (u + up_offset) * act


class DenseFFN(nn.Module):
    def __init__(self, fused_gate_up, down, limit, alpha):
        super().__init__()
        inter = fused_gate_up.shape[0] // 2
        self.w_gate_t = nn.Parameter(fused_gate_up[:inter].t().contiguous())
        self.w_up_t = nn.Parameter(fused_gate_up[inter:].t().contiguous())
        self.w_down_t = nn.Parameter(down.t().contiguous())
        self.limit, self.alpha = limit, alpha

    def forward(self, x, in_scale=None):
        wg, wu = self.w_gate_t, self.w_up_t
        if in_scale is not None:  # norm_folded_into_proj: the norm's scale lives in the rows
            wg, wu = in_scale[:, None] * wg, in_scale[:, None] * wu
        return _oai_glu(x @ wg, x @ wu, self.limit, self.alpha) @ self.w_down_t


class Experts(nn.Module):
    def __init__(self, gate_up, down, limit, alpha):
        super().__init__()
        inter = gate_up.shape[1] // 2
        if BUG == "experts_gate_up_interleaved":
            g, u = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            g, u = gate_up[:, :inter], gate_up[:, inter:]
        self.w_gate = nn.Parameter(g.transpose(1, 2).contiguous())  # (E, H, I)
        self.w_up = nn.Parameter(u.transpose(1, 2).contiguous())
        self.w_down = nn.Parameter(down.transpose(1, 2).contiguous())  # (E, I, H)
        self.limit, self.alpha = limit, alpha

    def _expert(self, x, e, in_scale):
        wg, wu = self.w_gate[e], self.w_up[e]
        if in_scale is not None:
            wg, wu = in_scale[:, None] * wg, in_scale[:, None] * wu
        off = 0.0 if BUG == "experts_up_no_offset" else 1.0
        return _oai_glu(x @ wg, x @ wu, self.limit, self.alpha, off) @ self.w_down[e]

    def forward(self, x, idx, w, in_scale=None):
        n_exp = self.w_gate.shape[0]
        if BUG == "experts_dense_all":
            dense_w = torch.zeros(x.shape[0], n_exp, dtype=x.dtype).scatter_add_(1, idx, w)
            outs = torch.stack([self._expert(x, e, in_scale) for e in range(n_exp)], dim=1)  # (T, E, H)
            return (dense_w[..., None] * outs).sum(1)
        out = torch.zeros_like(x)
        for e in range(n_exp):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, self._expert(x[tok], e, in_scale) * w[tok, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        lim, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.router = nn.ParameterDict(
            {
                "weight_t": nn.Parameter(sd[p + "gate.weight"].t().contiguous()),
                "choice_bias": nn.Parameter(sd[p + "gate.e_score_correction_bias"].clone()),
            }
        )
        self.experts = Experts(sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"], lim, alpha)
        self.shared = DenseFFN(
            sd[p + "shared_experts.gate_up_proj.weight"], sd[p + "shared_experts.down_proj.weight"], lim, alpha
        )
        self.top_k = cfg.num_experts_per_tok
        self.scale = cfg.routed_scaling_factor

    def forward(self, x, in_scale=None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        shared = self.shared(x, in_scale)
        wr = self.router["weight_t"] if in_scale is None else in_scale[:, None] * self.router["weight_t"]
        logits = x @ wr
        probs = logits.softmax(-1) if BUG == "router_softmax" else torch.sigmoid(logits)
        choice = probs + self.router["choice_bias"]
        idx = torch.topk(choice, self.top_k, dim=-1).indices
        w = (choice if BUG == "router_bias_in_weights" else probs).gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        routed = self.experts(x, idx, w, in_scale)
        if BUG == "routed_scale_after_shared":
            y = (routed + shared) * self.scale
        else:
            y = routed * self.scale + shared
        return y.reshape(shape)


class Block(nn.Module):
    def __init__(self, sd, i, cfg):
        super().__init__()
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.n_q, self.n_kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.norm_scale = nn.Parameter(
            1.0 + torch.stack([sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]])
        )
        self.w_qkv_t = nn.Parameter(
            torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]).t().contiguous()
        )
        self.qk_scale = nn.Parameter(1.0 + torch.stack([sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]]))
        self.w_o_t = nn.Parameter(sd[a + "o_proj.weight"].t().contiguous())
        self.sparse = cfg.layer_types[i] == "minimax_m3_sparse"
        if self.sparse:
            ix = a + "indexer."
            self.w_idx_t = nn.Parameter(
                torch.cat([sd[ix + "q_proj.weight"], sd[ix + "k_proj.weight"]]).t().contiguous()
            )
            self.idx_scale = nn.Parameter(1.0 + torch.stack([sd[ix + "q_norm.weight"], sd[ix + "k_norm.weight"]]))
            self.n_idx, self.d_idx = cfg.index_n_heads, cfg.index_head_dim
            self.block, self.topk, self.local = cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks
        if cfg.mlp_layer_types[i] == "sparse":
            self.mlp = MoE(sd, p + "mlp.", cfg)
        else:
            self.mlp = DenseFFN(
                sd[p + "mlp.gate_up_proj.weight"], sd[p + "mlp.down_proj.weight"], cfg.swiglu_limit, cfg.swiglu_alpha
            )
        if BUG == "attn_scale_from_hidden":
            self.scaling = (cfg.hidden_size // cfg.num_attention_heads) ** -0.5
        else:
            self.scaling = self.d**-0.5

    # ---- lightning indexer: which key blocks each query (per KV group) may read
    def _select(self, x, rope, pos, in_scale):
        B, S, _ = x.shape
        cos, sin, ang = (t[..., : self.d_idx] for t in rope)
        w = self.w_idx_t if in_scale is None else in_scale[:, None] * self.w_idx_t
        qk = x @ w
        iq = qk[..., : self.n_idx * self.d_idx].view(B, S, self.n_idx, self.d_idx)
        ik = qk[..., self.n_idx * self.d_idx :].view(B, S, 1, self.d_idx)
        iq = (_rms(iq, self.eps) * self.idx_scale[0]).transpose(1, 2)
        ik = (_rms(ik, self.eps) * self.idx_scale[1]).transpose(1, 2)
        iq, ik = _rope(iq, cos, sin, ang), _rope(ik, cos, sin, ang)
        scores = iq @ ik.transpose(-1, -2)  # (B, G, S, S)
        qpos = torch.arange(S).expand(B, S) if BUG == "indexer_slot_positions" else pos
        slots = torch.arange(S)
        if BUG != "indexer_no_future_mask":
            scores = scores.masked_fill(slots[None, None, None, :] > qpos[:, None, :, None], float("-inf"))
        nb = -(-S // self.block)
        if BUG == "indexer_rank_select":
            blk_of_key = (slots // self.block).expand_as(scores)
            bs = torch.full((*scores.shape[:-1], nb), float("-inf"))
            bs = bs.scatter_reduce(-1, blk_of_key, scores, reduce="amax", include_self=True)
        else:
            bs = F.pad(scores, (0, nb * self.block - S), value=float("-inf"))
            bs = bs.view(B, self.n_idx, S, nb, self.block).amax(-1)
        q_blk = qpos // self.block
        off = 1 if BUG == "indexer_local_off_by_one" else 0
        local = (q_blk[..., None] - off - torch.arange(self.local)).clamp(min=0)  # (B, S, L)
        bs = bs.scatter(-1, local[:, None].expand(-1, self.n_idx, -1, -1), float("inf"))
        k = min(self.topk, nb)
        if BUG == "indexer_rank_select":
            a, b = bs[..., :, None], bs[..., None, :]  # rank of block m: blocks strictly better, ties to lower index
            lower = torch.arange(nb)[None, :] < torch.arange(nb)[:, None]
            rank = ((b > a) | ((b == a) & lower)).sum(-1)
            keep = (rank < k) & (bs > float("-inf"))
        else:
            val, ind = bs.topk(k, dim=-1)
            keep = torch.zeros_like(bs, dtype=torch.bool).scatter(-1, ind, val > float("-inf"))
        return keep  # (B, G, S, num_blocks): the blocks each indexer head (KV group) keeps

    def _head_norm(self, t, which):
        """Gemma QK-norm of t (B, S, heads, d), statistic per head; which 0 = q, 1 = k."""
        if BUG == "qk_norm_across_heads":
            B, S, n, d = t.shape
            return _rms(t.reshape(B, S, n * d), self.eps).view(B, S, n, d) * self.qk_scale[which]
        return _rms(t, self.eps) * self.qk_scale[which]

    def attention(self, x, rope, pos, allowed, in_scale):
        B, S, _ = x.shape
        w = self.w_qkv_t if in_scale is None else in_scale[:, None] * self.w_qkv_t
        qkv = x @ w
        nq, nk, d = self.n_q * self.d, self.n_kv * self.d, self.d
        q = qkv[..., :nq].view(B, S, self.n_q, d)
        k = qkv[..., nq : nq + nk].view(B, S, self.n_kv, d)
        v = qkv[..., nq + nk :].view(B, S, self.n_kv, d).transpose(1, 2)
        q, k = self._head_norm(q, 0), self._head_norm(k, 1)
        q, k = _rope(q.transpose(1, 2), *rope), _rope(k.transpose(1, 2), *rope)
        rep = self.n_q // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.sparse:
            keep = self._select(x, rope, pos, in_scale).repeat_interleave(self.block, dim=-1)[..., :S]  # over keys
            if BUG == "indexer_heads_tiled":
                keep = keep.repeat(1, self.n_q // self.n_idx, 1, 1)
            else:
                keep = keep.repeat_interleave(self.n_q // self.n_idx, dim=1)
            allowed = allowed & keep
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        if BUG == "attn_online_softmax":
            out = self._online(q, k, v, bias)
        else:
            p = torch.softmax(q @ k.transpose(-1, -2) * self.scaling + bias, dim=-1)
            out = p @ v
        return out.transpose(1, 2).reshape(B, S, -1) @ self.w_o_t

    def _online(self, q, k, v, bias, chunk=8):
        m = torch.full(q.shape[:-1] + (1,), float("-inf"))
        den = torch.zeros_like(m)
        acc = torch.zeros_like(q)
        for s in range(0, k.shape[2], chunk):
            sc = q @ k[:, :, s : s + chunk].transpose(-1, -2) * self.scaling + bias[..., s : s + chunk]
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            corr = torch.exp(m - m_new)
            e = torch.exp(sc - m_new)
            den = den * corr + e.sum(-1, keepdim=True)
            acc = acc * corr + e @ v[:, :, s : s + chunk]
            m = m_new
        return acc / den

    def forward(self, h, rope, pos, allowed):
        fold = BUG == "norm_folded_into_proj"
        s_in, s_post = self.norm_scale[0], self.norm_scale[1]
        x = _rms(h, self.eps) if fold else _rms(h, self.eps) * s_in
        h = h + self.attention(x, rope, pos, allowed, s_in if fold else None)
        x = _rms(h, self.eps) if fold else _rms(h, self.eps) * s_post
        return h + self.mlp(x, s_post if fold else None)


class MiniMaxM3Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.emb = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.head_t = nn.Parameter(sd["lm_head.weight"].t().contiguous())
        w = sd["model.norm.weight"]
        self.final_scale = nn.Parameter(w.clone() if BUG == "final_norm_no_offset" else 1.0 + w)
        self.blocks = nn.ModuleList([Block(sd, i, cfg) for i in range(cfg.num_hidden_layers)])
        self.eps = cfg.rms_norm_eps
        rp = cfg.rope_parameters
        self.theta = rp["rope_theta"]
        self.head_dim = cfg.head_dim
        self.partial = rp.get("partial_rotary_factor", 1.0)

    def _rope_tables(self, pos):
        rd = self.head_dim if BUG == "rope_full_head" else int(self.head_dim * self.partial)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
        ang = pos[..., None].float() * inv_freq
        ang = torch.cat((ang, ang), dim=-1)[:, None]  # (B, 1, S, rd)
        return ang.cos(), ang.sin(), ang

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        h = self.emb[input_ids]
        pos = torch.arange(S).expand(B, S) if position_ids is None else position_ids.expand(B, S)
        rope = self._rope_tables(pos)
        slots = torch.arange(S)
        allowed = (slots[None, :] <= slots[:, None])[None, None]  # (1, 1, S, S) causal over slots
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        allowed = allowed.expand(B, 1, S, S)
        for blk in self.blocks:
            h = blk(h, rope, pos, allowed)
        return (self.final_norm(h) @ self.head_t).float()

    def final_norm(self, h):
        return _rms(h, self.eps) * self.final_scale


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    return MiniMaxM3Port(sd, config).eval()
