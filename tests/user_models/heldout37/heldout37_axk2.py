"""Hand-written plain-PyTorch port of SK Telecom's A.X-K2 (Transformers ``AXK2ForCausalLM``, model_type axk2).

A.X-K2 is DeepSeek-V3.2-like: MLA attention with a DSA ("lightning") indexer that keeps only the top-k keys per
query, DeepSeek-V3 sigmoid routing with a selection-only correction bias, and two A.X-specific additions: a
low-rank sigmoid-gated RMSNorm and a sigmoid output gate produced by a query projection that reads both the
normalised and the raw query latent.

Architecture as this port implements it (float32 throughout, B batch, S tokens, D hidden, H heads):
- x = emb[input_ids] (no scaling). Untied head: logits = RMSNorm_f(x) @ head_t.
- RMSNorm(x; w, eps) = w * (x * rsqrt(mean(x^2) + eps)). eps = config.rms_norm_eps for the block / final norms,
  but a FIXED 1e-6 for the two MLA latent norms (Transformers builds them without passing the config's eps).
- GatedNorm(x) = y * sigmoid(silu(y @ g1) @ g2), y = RMSNorm(x) (the gate reads the NORMED y); rank
  config.gated_norm_rank. It is the input norm of every layer and the post-attention norm of MoE ("sparse")
  layers; dense layers use a plain RMSNorm after attention.
- layer: x = x + Attn(GatedNorm_in(x));  x = x + FFN(Norm_post(x))  (FFN: SwiGLU MLP or MoE, config.mlp_layer_types).
- RoPE (yarn when rope_parameters says so): inv_freq over d_r = qk_rope_head_dim dims, blended between
  extrapolated and 1/factor interpolated frequencies by YaRN's linear ramp over [low, high] (truncated);
  cos/sin of angle = pos * inv_freq, both multiplied by attention_factor = mscale(f, mscale) / mscale(f, mscale_all_dim),
  mscale(f, m) = 0.1 m ln f + 1. Positions: position_ids if given, else 0..S-1.
- MLA: [q_c | c_kv | k_r] = h @ w_down + b_down (q_a_proj and kv_a_proj_with_mqa fused);
  q_res = RMSNorm(q_c, 1e-6); u = [q_res | q_c] (normed latent FIRST, then the raw one);
  per head: q_h = u @ w_q[h] (d_n nope dims then d_r rope dims), g_h = u @ w_g[h] (d_v);
  c = RMSNorm(c_kv, 1e-6); k_nope_h = c @ w_uk[h]^T, v_h = c @ w_uv[h]^T; the rope key k_r is ONE head shared by all.
  RoPE on q_rope / k_r is the INTERLEAVED (DeepSeek) one: pairs (x_{2i}, x_{2i+1}) rotate by angle i; the result
  is laid out [rotated evens | rotated odds] (as Transformers does; any layout shared by q and k is exact).
  scores = (q_h . k_h) * scale, scale = (d_n + d_r)^-0.5 * mscale(f, mscale_all_dim)^2 (yarn), plus the mask
  (causal, padding, and the indexer's top-k: keys not selected get finfo.min); softmax in float32;
  o = concat_h(P v_h) * sigmoid(g) (the gate is per head and channel); out = o @ w_o_t + b_o.
- DSA indexer (no softmax): qi = q_res @ ix_wq^T (n_i heads of d_i), ki = LayerNorm(h @ ix_wk^T; ix_kn[0], ix_kn[1],
  eps 1e-6) (one head). RoPE on the FIRST d_r dims of qi / ki, and here the NON-interleaved rotate-half form.
  I[t, s] = sum_j (h @ ix_wp^T)[t, j] n_i^-0.5 * relu(d_i^-0.5 qi_j[t] . ki[s]) + mask_ix[t, s]; the attention keeps the
  top min(index_topk, S) keys of each query. mask_ix = causal AND padding (finfo.min elsewhere).
- MoE: logits = h @ router_w^T (float32); s = sigmoid(logits); choice = s + router_bias (the bias only chooses);
  grouped (n_group set): a group's score is the sum of its 2 best choice values, the best topk_group groups stay,
  the others' choice values are set to 0.0; the top-k experts by choice; weights = s[topk], divided by their sum
  (+1e-20) when norm_topk_prob, times routed_scaling_factor. Expert e: down_e(silu(x gate_e) * (x up_e)).
  out = sum_k w_k expert_k(x) + SharedMLP(x) (shared intermediate = moe_intermediate_size * n_shared_experts).

Weight layout of this port (own names, per block ``blocks[i]``):
- emb (V, D); head_t (D, V) = lm_head transposed; final_norm (D,).
- in_norm: ``in_norm_w`` (D,), ``in_gate`` ParameterDict {down: (D, R) = fc1^T, up: (R, D) = fc2^T}.
- attention ``attn``: w_down (D, r_q + r_kv + d_r) = [q_a_proj ; kv_a_proj_with_mqa] fused and transposed, b_down
  fused bias; lat_norm_q (r_q,), lat_norm_kv (r_kv,); w_q (2 r_q, H (d_n + d_r)) and w_g (2 r_q, H d_v): the fused
  per-head [query | gate] q_gate_proj split per head and transposed; w_uk (H, d_n, r_kv) and w_uv (H, d_v, r_kv):
  kv_b_proj split per head; w_o_t (H d_v, D) transposed, b_o (D,); indexer: ix_wq (n_i d_i, r_q), ix_wk (d_i, D),
  ix_kn (2, d_i) = [LayerNorm weight ; bias] stacked, ix_wp (n_i, D).
- post norm: ``post_norm_w`` (D,) and for MoE layers ``post_gate`` like in_gate.
- dense FFN: w_gu (D, 2 I) = [gate | up] fused and transposed; w_dn (I, D) transposed.
- MoE FFN: router_w (E, D); buffer router_bias (E,); ex_gate / ex_up (E, D, I) = the fused gate_up_proj split and
  transposed; ex_down (E, I, D) transposed; shared w_gu / w_dn as the dense FFN.
Set ``model.taps = {}`` to record intermediates under this port's own names (for checking only).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "mla_rope_neox",  # MLA q/k rope applied rotate-half style (pairs i, i + d_r/2) instead of DeepSeek's interleaved pairs (2i, 2i+1)
    "q_gate_split_blocked",  # fused q_gate_proj split at load as [all heads' queries | all heads' gates] instead of per head [q_h | g_h]
    "q_gate_input_swapped",  # q_gate input concatenated as [raw q latent | normed q latent] instead of [normed | raw]
    "latent_norm_eps_config",  # q_a / kv_a latent RMSNorms built with config.rms_norm_eps instead of their fixed 1e-6
    "yarn_mscale_dropped",  # softmax scale left at qk_head_dim^-0.5: the yarn mscale(factor, mscale_all_dim)^2 factor is missing
    "gated_norm_gate_from_input",  # GatedRMSNorm gate MLP fed the un-normalised input x instead of the normed y
    "residual_after_norm",  # attention residual taken from the input norm's output instead of the block input
    "router_weights_biased",  # expert weights gathered from sigmoid + e_score_correction_bias (the choice scores) instead of sigmoid
    "router_softmax",  # router scores = softmax over experts (DeepSeek-V2 scoring) instead of a per-expert sigmoid
    "group_topk_max",  # group score = max of the group (DeepSeek-V2 style) instead of the sum of its top-2 choice scores
    "routed_scale_on_shared",  # routed_scaling_factor multiplies (routed + shared) instead of the routed weights only
    "indexer_k_rmsnorm",  # indexer key norm done as RMSNorm (weight only) instead of LayerNorm (mean removed, + bias)
    "indexer_self_excluded",  # indexer causal mask built with triu(diagonal=0): a query can never select its own token
    "indexer_pad_unmasked",  # indexer scores get the causal mask only (no padding): padding keys take top-k slots
]
PADDING_ONLY = ["indexer_pad_unmasked"]
CLEAN = [
    "mla_absorbed",  # MLA with kv_b absorbed: scores against the normed latent (q_nope W_uk), values as (P c) W_uv^T
    "rope_complex",  # interleaved rope as complex multiplication, result kept interleaved (same layout for q and k)
    "experts_dense",  # every expert run on every token, combined with a dense (tokens, experts) weight matrix
    "q_gate_split_input",  # q/gate projection as q_res @ W[:r_q] + q_c @ W[r_q:] instead of one matmul on [q_res | q_c]
    "attn_sparse_gather",  # attention over the gathered top-k keys of each query only, instead of a masked full softmax
]

NEG = torch.finfo(torch.float32).min


def _bug(name):
    return BUG == name


def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope_setup(cfg):
    """inv_freq (d_r/2,), the cos/sin factor and the softmax scale, from config.rope_parameters."""
    rp = dict(cfg.rope_parameters or {})
    d = cfg.qk_rope_head_dim
    base = rp.get("rope_theta", 10000.0)
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos, 1.0, scale
    if kind != "yarn":
        raise NotImplementedError(kind)
    factor = rp.get("factor")
    orig = rp["original_max_position_embeddings"]
    if factor is None:
        factor = cfg.max_position_embeddings / orig
    att = rp.get("attention_factor")
    m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if att is None:
        att = float(_mscale(factor, m) / _mscale(factor, m_all)) if (m and m_all) else _mscale(factor)
    b_fast = rp.get("beta_fast") or 32
    b_slow = rp.get("beta_slow") or 1

    def corr(rot):
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(b_fast), corr(b_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    if m_all and not _bug("yarn_mscale_dropped"):
        scale = scale * _mscale(rp["factor"], m_all) ** 2
    return inv, att, scale


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_interleaved(x, cos_h, sin_h):
    """DeepSeek pairs (2i, 2i+1) rotated by angle i; out = [rotated evens | rotated odds]. cos_h: (.., d_r/2)."""
    if _bug("mla_rope_neox"):  # rotate-half pairing (i, i + d_r/2)
        c, s = torch.cat((cos_h, cos_h), -1), torch.cat((sin_h, sin_h), -1)
        return x * c + _rotate_half(x) * s
    if BUG == "rope_complex":
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * torch.complex(cos_h, sin_h)).flatten(-2)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * cos_h - b * sin_h, b * cos_h + a * sin_h], dim=-1)


class _Ctx:
    pass


class Block(nn.Module):
    def __init__(self, sd, cfg, i, owner):
        super().__init__()
        p = f"model.layers.{i}."
        P = lambda t: nn.Parameter(t.detach().clone().float(), requires_grad=False)  # noqa: E731
        self.owner = [owner]
        self.i = i
        self.H, self.dn, self.dr, self.dv = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.rq, self.rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        self.eps = cfg.rms_norm_eps
        self.lat_eps = cfg.rms_norm_eps if _bug("latent_norm_eps_config") else 1e-6
        H, dn, dr, dv, rq = self.H, self.dn, self.dr, self.dv, self.rq
        dqk = dn + dr

        # input gated norm
        self.in_norm_w = P(sd[p + "input_layernorm.norm.weight"])
        self.in_gate = nn.ParameterDict(
            {
                "down": P(sd[p + "input_layernorm.mlp.fc1.weight"].t()),
                "up": P(sd[p + "input_layernorm.mlp.fc2.weight"].t()),
            }
        )

        # attention: fused down projections
        a = p + "self_attn."
        bias = cfg.attention_bias
        w_down = torch.cat([sd[a + "q_a_proj.weight"], sd[a + "kv_a_proj_with_mqa.weight"]], 0)
        self.w_down = P(w_down.t())
        if bias:
            self.b_down = P(torch.cat([sd[a + "q_a_proj.bias"], sd[a + "kv_a_proj_with_mqa.bias"]]))
        else:
            self.b_down = P(torch.zeros(w_down.shape[0]))
        self.lat_norm_q = P(sd[a + "q_a_layernorm.weight"])
        self.lat_norm_kv = P(sd[a + "kv_a_layernorm.weight"])
        wqg = sd[a + "q_gate_proj.weight"]  # (H (dqk + dv), 2 rq)
        if _bug("q_gate_split_blocked"):
            wq, wg = wqg[: H * dqk], wqg[H * dqk :]
        else:
            per_head = wqg.view(H, dqk + dv, 2 * rq)
            wq, wg = per_head[:, :dqk].reshape(H * dqk, 2 * rq), per_head[:, dqk:].reshape(H * dv, 2 * rq)
        self.w_q, self.w_g = P(wq.t()), P(wg.t())
        kvb = sd[a + "kv_b_proj.weight"].view(H, dn + dv, self.rkv)
        self.w_uk, self.w_uv = P(kvb[:, :dn]), P(kvb[:, dn:])
        self.w_o_t = P(sd[a + "o_proj.weight"].t())
        self.b_o = P(sd[a + "o_proj.bias"]) if bias else P(torch.zeros(cfg.hidden_size))
        # indexer
        ix = a + "indexer."
        self.ix_wq = P(sd[ix + "wq_b.weight"])
        self.ix_wk = P(sd[ix + "wk.weight"])
        self.ix_kn = P(torch.stack([sd[ix + "k_norm.weight"], sd[ix + "k_norm.bias"]]))
        self.ix_wp = P(sd[ix + "weights_proj.weight"])
        self.n_ix, self.d_ix, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk

        # post-attention norm and FFN
        self.sparse = cfg.mlp_layer_types[i] == "sparse"
        if self.sparse:
            self.post_norm_w = P(sd[p + "post_attention_layernorm.norm.weight"])
            self.post_gate = nn.ParameterDict(
                {
                    "down": P(sd[p + "post_attention_layernorm.mlp.fc1.weight"].t()),
                    "up": P(sd[p + "post_attention_layernorm.mlp.fc2.weight"].t()),
                }
            )
            m = p + "mlp."
            self.router_w = P(sd[m + "gate.weight"])
            self.register_buffer("router_bias", sd[m + "gate.e_score_correction_bias"].detach().clone().float())
            gu = sd[m + "experts.gate_up_proj"]  # (E, 2 I, D)
            inter = gu.shape[1] // 2
            self.ex_gate = P(gu[:, :inter].transpose(1, 2))
            self.ex_up = P(gu[:, inter:].transpose(1, 2))
            self.ex_down = P(sd[m + "experts.down_proj"].transpose(1, 2))
            self.w_gu = P(
                torch.cat([sd[m + "shared_experts.gate_proj.weight"], sd[m + "shared_experts.up_proj.weight"]]).t()
            )
            self.w_dn = P(sd[m + "shared_experts.down_proj.weight"].t())
            self.E, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
            self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
            self.norm_topk, self.rsf = cfg.norm_topk_prob, cfg.routed_scaling_factor
        else:
            self.post_norm_w = P(sd[p + "post_attention_layernorm.weight"])
            m = p + "mlp."
            self.w_gu = P(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]).t())
            self.w_dn = P(sd[m + "down_proj.weight"].t())

    def tap(self, name, t):
        taps = self.owner[0].taps
        if taps is not None:
            taps[f"L{self.i}.{name}"] = t.detach().clone()

    # ---- norms
    def gated_norm(self, x, w, gate, name):
        y = _rms(x, w, self.eps)
        self.tap(name + ".rms", y)
        g_in = x if _bug("gated_norm_gate_from_input") else y
        d = g_in @ gate["down"]
        self.tap(name + ".fc1", d)
        g = F.silu(d) @ gate["up"]
        self.tap(name + ".gate", g)
        out = y * torch.sigmoid(g)
        self.tap(name, out)
        return out

    # ---- indexer
    def indexer(self, h, q_res, ctx):
        B, S, _ = h.shape
        dr, D, n = self.dr, self.d_ix, self.n_ix
        q = F.linear(q_res, self.ix_wq)
        self.tap("idx.wq", q)
        q = q.view(B, S, n, D)
        q_rot, q_pass = torch.split(q, [dr, D - dr], dim=-1)
        k = F.linear(h, self.ix_wk)
        self.tap("idx.wk", k)
        if _bug("indexer_k_rmsnorm"):
            k = _rms(k, self.ix_kn[0], 1e-6)
        else:
            k = F.layer_norm(k, (D,), self.ix_kn[0], self.ix_kn[1], 1e-6)
        self.tap("idx.k_norm", k)
        k = k.unsqueeze(2)
        k_rot, k_pass = torch.split(k, [dr, D - dr], dim=-1)
        c, s = ctx.cos_full.unsqueeze(2), ctx.sin_full.unsqueeze(2)
        q_rot = q_rot * c + _rotate_half(q_rot) * s
        k_rot = k_rot * c + _rotate_half(k_rot) * s
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * D**-0.5
        scores = F.relu(scores)
        wts = F.linear(h, self.ix_wp)
        self.tap("idx.weights", wts)
        wts = wts.float() * n**-0.5
        index_scores = torch.matmul(wts.unsqueeze(-2), scores).squeeze(-2) + ctx.ix_mask
        top = index_scores.topk(min(self.topk, S), dim=-1).indices
        self.tap("idx.topk", top)
        return top

    # ---- attention
    def attention(self, h, ctx):
        B, S, _ = h.shape
        H, dn, dr, dv, rq, rkv = self.H, self.dn, self.dr, self.dv, self.rq, self.rkv
        down = h @ self.w_down + self.b_down
        q_c, c_kv, k_r = torch.split(down, [rq, rkv, dr], dim=-1)
        self.tap("attn.q_a", q_c)
        self.tap("attn.kv_a", torch.cat([c_kv, k_r], -1))
        q_res = _rms(q_c, self.lat_norm_q, self.lat_eps)
        self.tap("attn.q_a_norm", q_res)
        if BUG == "q_gate_split_input":
            q = q_res @ self.w_q[:rq] + q_c @ self.w_q[rq:]
            g = q_res @ self.w_g[:rq] + q_c @ self.w_g[rq:]
        else:
            u = torch.cat([q_c, q_res], -1) if _bug("q_gate_input_swapped") else torch.cat([q_res, q_c], -1)
            q, g = u @ self.w_q, u @ self.w_g
        self.tap("attn.q_gate", torch.cat([q.view(B, S, H, dn + dr), g.view(B, S, H, dv)], -1).reshape(B, S, -1))
        q = q.view(B, S, H, dn + dr).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [dn, dr], dim=-1)
        c = _rms(c_kv, self.lat_norm_kv, self.lat_eps)
        self.tap("attn.kv_a_norm", c)
        cos_h, sin_h = ctx.cos_half[:, None], ctx.sin_half[:, None]
        q_rot = _rope_interleaved(q_rot, cos_h, sin_h)
        k_rot = _rope_interleaved(k_r[:, None], cos_h, sin_h)  # (B, 1, S, dr)

        top = self.indexer(h, q_res, ctx)
        keep = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, top.long(), True)
        mask = ctx.attn_mask.masked_fill(~keep, NEG)  # (B, S, S)
        scale = ctx.scale

        if BUG == "mla_absorbed":
            q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope, self.w_uk)
            scores = (q_lat @ c[:, None].transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * scale
            p = F.softmax(scores + mask[:, None], dim=-1, dtype=torch.float32)
            o = torch.einsum("bhsr,hdr->bhsd", p @ c[:, None], self.w_uv)
        else:
            k_nope = torch.einsum("bsr,hdr->bhsd", c, self.w_uk)
            v = torch.einsum("bsr,hdr->bhsd", c, self.w_uv)
            self.tap("attn.kv_b", torch.cat([k_nope, v], -1).transpose(1, 2).reshape(B, S, -1))
            key = torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], -1)
            query = torch.cat([q_nope, q_rot], -1)
            if BUG == "attn_sparse_gather":
                ti = top.long()[:, None, :, :, None]  # (B, 1, S, K, 1)
                kg = torch.gather(key[:, :, None].expand(-1, -1, S, -1, -1), 3, ti.expand(-1, H, -1, -1, key.shape[-1]))
                vg = torch.gather(v[:, :, None].expand(-1, -1, S, -1, -1), 3, ti.expand(-1, H, -1, -1, dv))
                sc = (
                    torch.einsum("bhsd,bhskd->bhsk", query, kg) * scale
                    + torch.gather(ctx.attn_mask, -1, top.long())[:, None]
                )
                p = F.softmax(sc, dim=-1, dtype=torch.float32)
                o = torch.einsum("bhsk,bhskd->bhsd", p, vg)
            else:
                scores = (query @ key.transpose(-1, -2)) * scale + mask[:, None]
                p = F.softmax(scores, dim=-1, dtype=torch.float32)
                o = p @ v
        o = o.transpose(1, 2).reshape(B, S, H * dv)
        o = o * torch.sigmoid(g)
        out = o @ self.w_o_t + self.b_o
        self.tap("attn.o_proj", out)
        return out

    # ---- FFN
    def mlp(self, x, w_gu, w_dn):
        gate, up = (x @ w_gu).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w_dn

    def moe(self, x):
        B, S, D = x.shape
        h = x.reshape(-1, D)
        logits = F.linear(h.float(), self.router_w.float())
        s = logits.softmax(dim=-1) if _bug("router_softmax") else logits.sigmoid()
        choice = s + self.router_bias
        if self.n_group is not None:
            G = self.n_group
            grouped = choice.view(-1, G, self.E // G)
            if _bug("group_topk_max"):
                gs = grouped.max(dim=-1).values
            else:
                gs = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            gi = torch.topk(gs, k=self.topk_group, dim=-1, sorted=False)[1]
            gm = torch.zeros_like(gs).scatter_(1, gi, 1)
            sm = gm.unsqueeze(-1).expand(-1, G, self.E // G).reshape(-1, self.E)
            choice = choice.masked_fill(~sm.bool(), 0.0)
        idx = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
        w = (s + self.router_bias).gather(1, idx) if _bug("router_weights_biased") else s.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if not _bug("routed_scale_on_shared"):
            w = w * self.rsf
        self.tap("mlp.gate", torch.cat([logits, w, idx.float()], -1))
        if BUG == "experts_dense":
            dense_w = torch.zeros(h.shape[0], self.E).scatter(1, idx, w)
            a = torch.einsum("td,edi->eti", h, self.ex_gate)
            b = torch.einsum("td,edi->eti", h, self.ex_up)
            y = torch.einsum("eti,eid->etd", F.silu(a) * b, self.ex_down)
            routed = torch.einsum("te,etd->td", dense_w, y)
        else:
            routed = torch.zeros_like(h)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                xe = h[tok]
                y = (F.silu(xe @ self.ex_gate[e]) * (xe @ self.ex_up[e])) @ self.ex_down[e]
                routed.index_add_(0, tok, y * w[tok, slot, None])
        self.tap("mlp.experts", routed)
        shared = self.mlp(h, self.w_gu, self.w_dn)
        self.tap("mlp.shared", shared)
        out = routed + shared
        if _bug("routed_scale_on_shared"):
            out = out * self.rsf
        return out.view(B, S, D)

    def forward(self, x, ctx):
        h = self.gated_norm(x, self.in_norm_w, self.in_gate, "in_norm")
        a = self.attention(h, ctx)
        x = (h if _bug("residual_after_norm") else x) + a
        if self.sparse:
            h2 = self.gated_norm(x, self.post_norm_w, self.post_gate, "post_norm")
            f = self.moe(h2)
        else:
            h2 = _rms(x, self.post_norm_w, self.eps)
            self.tap("post_norm", h2)
            f = self.mlp(h2, self.w_gu, self.w_dn)
        self.tap("mlp", f)
        x = x + f
        self.tap("out", x)
        return x


class AXK2Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.taps = None
        self.emb = nn.Parameter(sd["model.embed_tokens.weight"].detach().clone().float(), requires_grad=False)
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        self.head_t = nn.Parameter(head.detach().t().contiguous().float(), requires_grad=False)
        self.final_norm = nn.Parameter(sd["model.norm.weight"].detach().clone().float(), requires_grad=False)
        self.eps = cfg.rms_norm_eps
        inv, att, scale = _rope_setup(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.att_factor, self.scale = att, scale
        self.blocks = nn.ModuleList([Block(sd, cfg, i, self) for i in range(cfg.num_hidden_layers)])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        x = F.embedding(input_ids, self.emb)
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        ang = position_ids[..., None].float() * self.inv_freq  # (B, S, dr/2)
        ctx = _Ctx()
        ctx.cos_half, ctx.sin_half = ang.cos() * self.att_factor, ang.sin() * self.att_factor
        full = torch.cat([ang, ang], -1)
        ctx.cos_full, ctx.sin_full = full.cos() * self.att_factor, full.sin() * self.att_factor
        ctx.scale = self.scale
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal[None].expand(B, S, S)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        ctx.attn_mask = torch.zeros(B, S, S).masked_fill(~allowed, NEG)
        # the indexer's own mask (DeepSeek reference style: triu(1) of the causal part, then padding)
        ix_causal = torch.full((S, S), NEG).triu(0 if _bug("indexer_self_excluded") else 1)
        ix_mask = ix_causal[None].expand(B, S, S)
        if attention_mask is not None and not _bug("indexer_pad_unmasked"):
            ix_mask = ix_mask.masked_fill(~attention_mask.bool()[:, None, :], NEG)
        ctx.ix_mask = ix_mask
        for blk in self.blocks:
            x = blk(x, ctx)
        x = _rms(x, self.final_norm, self.eps)
        if self.taps is not None:
            self.taps["final_norm"] = x.detach().clone()
        return (x @ self.head_t).float()


def build(state_dict, config):
    return AXK2Port(state_dict, config).eval()
