"""A from-scratch PyTorch port of A.X-K1 (``axk1``): an MLA + DeepSeek-V3-style MoE decoder.

Architecture (B batch, T tokens, H hidden, nH heads, r = qk_rope_head_dim, n = qk_nope_head_dim,
dv = v_head_dim, Lq = q_lora_rank, L = kv_lora_rank, E routed experts, G = n_group):

    h_0 = Embed[input_ids]                                                        (B, T, H)
    for each layer:
        a   = RMSNorm(h; attn_norm)
        -- Multi-head Latent Attention (query LoRA always on) --
        cq  = RMSNorm(a @ Wq_a; q_norm, eps=1e-6)                                  (B, T, Lq)
        q   = cq @ Wq_b  -> per head [q_nope (n) | q_rope (r)]
        ckv = a @ Wkv_a  -> [c (L) | k_rope (r)] ; c = RMSNorm(c; kv_norm, eps=1e-6)
        k_nope_h = c @ Wk_b[h] (n),  v_h = c @ Wv_b[h] (dv);  k_rope is shared by all heads
        RoPE (YaRN inv_freq, cos/sin times the YaRN attention factor
              mscale(factor, mscale) / mscale(factor, mscale_all_dim)) on q_rope, k_rope.
              The checkpoint's rope dims are *interleaved* pairs (x0,x1),(x2,x3),...; build permutes
              the rope output columns of Wq_b / Wkv_a to the half-split layout [evens | odds], so a
              plain rotate-half RoPE is applied at runtime (identical scores: q and k share the
              permutation).
        s   = (q_nope.k_nope + q_rope.k_rope) * qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2
        s  += causal & key-padding mask (finfo.min),  P = softmax(s),  o = (P @ v) @ Wo
        h   = h + o
        m   = RMSNorm(h; mlp_norm)
        -- dense layer (mlp_layer_types[i] == "dense") --
        h   = h + (silu(m @ Wg) * (m @ Wu)) @ Wd
        -- sparse layer --
        p   = sigmoid(m @ Wr)                                        router scores (T, E)
        pc  = p + e_score_correction_bias                            (choice only)
        group score = sum of the top-2 pc in each of G contiguous groups; keep topk_group groups;
        top-k experts by pc among the kept groups; weights w = p[top-k] / sum(p[top-k]) * routed_scaling_factor
        y   = sum_k w_k * Expert_k(m) + SharedExpert(m)
        h   = h + RMSNorm(y; post_mlp_norm)        (A.X-K1's extra norm on the MoE block output)
    logits = RMSNorm(h; final_norm) @ W_lm

Weight layout (all matrices stored in -> out, i.e. transposed w.r.t. nn.Linear):
    tok_emb (V, H); lm_head_t (H, V); final_norm (H,)
    blocks[i]: attn_norm (H,), mlp_norm (H,)
        wq_a (H, Lq), q_norm (Lq,), wq_nope (Lq, nH, n), wq_rope (Lq, nH, r) [rope cols de-interleaved]
        wkv_a (H, L + r) [rope cols de-interleaved], kv_norm (L,)
        wk_b (L, nH, n), wv_b (L, nH, dv)        (kv_b_proj split per head into key / value parts)
        wo (nH*dv, H)
        dense: w_gate_up (H, 2I) fused [gate | up], w_down (I, H)
        sparse: router (H, E), router_bias (E,) buffer,
                ex_gate (E, H, Im), ex_up (E, H, Im), ex_down (E, Im, H)   (stacked per expert)
                sh_gate_up (H, 2*Is) fused, sh_down (Is, H), post_mlp_norm (H,)
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_not_deinterleaved",  # ignores rope_interleave: rotate-half RoPE applied to the checkpoint's interleaved rope dims
    "mscale_once",  # softmax scale multiplied by YaRN mscale(factor, mscale_all_dim) once instead of squared
    "yarn_no_truncate",  # YaRN correction range bounds left fractional (truncate defaults to True: floor/ceil them)
    "rope_dim_qk_head_dim",  # rotary inv_freq exponent uses qk_head_dim (nope+rope) instead of qk_rope_head_dim
    "kv_a_split_order",  # kv_a_proj_with_mqa output split as [k_rope | latent] instead of [latent | k_rope]
    "kv_b_split_layout",  # kv_b_proj rows read as [all heads' k_nope | all heads' v] instead of per head [k_nope_h | v_h]
    "post_mlp_norm_after_residual",  # post_mlp_layernorm applied after the residual add instead of on the MoE output
    "router_weights_with_bias",  # expert weights gathered from bias-corrected scores instead of raw sigmoid scores
    "group_score_max",  # group score is the max expert score (DeepSeek-V2) instead of the sum of the top-2
    "scaling_before_norm",  # routed_scaling_factor applied before the top-k renormalisation (so it cancels)
    "softmax_router",  # router scores by softmax (DeepSeek-V2 scoring) instead of sigmoid
    "expert_gate_up_swap",  # packed experts gate_up_proj split as [up | gate] instead of [gate | up]
    "yarn_attn_factor_ignores_mscale",  # cos/sin attention factor taken as mscale(factor) ignoring the mscale / mscale_all_dim ratio
    "pad_mask_query_axis",  # padding mask applied along the query axis instead of the key axis
]

PADDING_ONLY = ["pad_mask_query_axis"]

CLEAN = [
    "rope_interleaved_runtime",  # keep the checkpoint's interleaved rope columns, rotate adjacent pairs at runtime
    "mla_absorbed",  # MLA weight absorption: scores and values computed in the compressed latent space
    "sdpa",  # F.scaled_dot_product_attention with an additive mask and explicit scale
    "dense_experts",  # every expert run on every token, combined with a scattered (T, E) weight matrix
    "rope_table",  # cos/sin precomputed for all max_position_embeddings positions and indexed by position_ids
]


def _bug():
    return BUG


def _rms(x, w, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def _get_mscale(scale, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config):
    """YaRN inverse frequencies, cos/sin attention factor and softmax scale."""
    bug = _bug()
    rp = config.rope_parameters
    base = rp["rope_theta"]
    dim = config.qk_rope_head_dim
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    exp_dim = qk_head_dim if bug == "rope_dim_qk_head_dim" else dim
    rope_type = rp.get("rope_type", "default")
    scale = qk_head_dim**-0.5
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / exp_dim)
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0, scale
    factor = rp["factor"]
    orig = rp.get("original_max_position_embeddings") or config.max_position_embeddings
    mscale = rp.get("mscale")
    mscale_all_dim = rp.get("mscale_all_dim")
    attn_factor = rp.get("attention_factor")
    if attn_factor is None:
        if mscale and mscale_all_dim and bug != "yarn_attn_factor_ignores_mscale":
            attn_factor = _get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim)
        else:
            attn_factor = _get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True) and bug != "yarn_no_truncate":
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)
    inv_freq = inter * ramp + extra * (1 - ramp)
    if mscale_all_dim:
        m = _get_mscale(factor, mscale_all_dim)
        scale = scale * (m if bug == "mscale_once" else m * m)
    return inv_freq, float(attn_factor), scale


class Block(nn.Module):
    def __init__(self, config, sparse):
        super().__init__()
        H = config.hidden_size
        nH = config.num_attention_heads
        self.nH = nH
        self.n = config.qk_nope_head_dim
        self.r = config.qk_rope_head_dim
        self.dv = config.v_head_dim
        self.L = config.kv_lora_rank
        self.Lq = config.q_lora_rank
        self.eps = config.rms_norm_eps
        self.sparse = sparse
        P = lambda *s: nn.Parameter(torch.zeros(*s))  # noqa: E731
        self.attn_norm = P(H)
        self.mlp_norm = P(H)
        self.wq_a = P(H, self.Lq)
        self.q_norm = P(self.Lq)
        self.wq_nope = P(self.Lq, nH, self.n)
        self.wq_rope = P(self.Lq, nH, self.r)
        self.wkv_a = P(H, self.L + self.r)
        self.kv_norm = P(self.L)
        self.wk_b = P(self.L, nH, self.n)
        self.wv_b = P(self.L, nH, self.dv)
        self.wo = P(nH * self.dv, H)
        if sparse:
            E, Im = config.n_routed_experts, config.moe_intermediate_size
            Is = config.moe_intermediate_size * config.n_shared_experts
            self.E = E
            self.top_k = config.num_experts_per_tok
            self.G = config.n_group
            self.topk_group = config.topk_group
            self.norm_topk = config.norm_topk_prob
            self.rsf = config.routed_scaling_factor
            self.router = P(H, E)
            self.register_buffer("router_bias", torch.zeros(E))
            self.ex_gate = P(E, H, Im)
            self.ex_up = P(E, H, Im)
            self.ex_down = P(E, Im, H)
            self.sh_gate_up = P(H, 2 * Is)
            self.sh_down = P(Is, H)
            self.post_mlp_norm = P(H)
        else:
            I = config.intermediate_size  # noqa: E741
            self.w_gate_up = P(H, 2 * I)
            self.w_down = P(I, H)

    # ---------------- attention ----------------
    @staticmethod
    def _rope(x, cos, sin):
        """x (..., r) in half-split layout [evens | odds]; cos/sin (..., r/2)."""
        bug = _bug()
        if bug == "rope_interleaved_runtime":
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def attention(self, a, cos, sin, mask_add, scale):
        bug = _bug()
        B, T, _ = a.shape
        cq = _rms(a @ self.wq_a, self.q_norm, 1e-6)
        q_nope = torch.einsum("btl,lhd->bhtd", cq, self.wq_nope)
        q_rope = torch.einsum("btl,lhd->bhtd", cq, self.wq_rope)
        ckv = a @ self.wkv_a
        if bug == "kv_a_split_order":
            k_rope, c = ckv.split([self.r, self.L], dim=-1)
        else:
            c, k_rope = ckv.split([self.L, self.r], dim=-1)
        c = _rms(c, self.kv_norm, 1e-6)
        cs, sn = cos[:, None], sin[:, None]  # (B, 1, T, r/2)
        q_rope = self._rope(q_rope, cs, sn)
        k_rope = self._rope(k_rope[:, None], cs, sn)  # (B, 1, T, r)
        if bug == "mla_absorbed":
            q_lat = torch.einsum("bhtd,lhd->bhtl", q_nope, self.wk_b)
            s = torch.einsum("bhtl,bsl->bhts", q_lat, c) + q_rope @ k_rope.transpose(-1, -2)
            s = s * scale + mask_add
            p = torch.softmax(s, dim=-1)
            o_lat = torch.einsum("bhts,bsl->bhtl", p, c)
            o = torch.einsum("bhtl,lhd->bthd", o_lat, self.wv_b)
        else:
            k_nope = torch.einsum("btl,lhd->bhtd", c, self.wk_b)
            v = torch.einsum("btl,lhd->bhtd", c, self.wv_b)
            q = torch.cat((q_nope, q_rope), dim=-1)
            k = torch.cat((k_nope, k_rope.expand(-1, self.nH, -1, -1)), dim=-1)
            if bug == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_add, scale=scale)
            else:
                s = (q @ k.transpose(-1, -2)) * scale + mask_add
                o = torch.softmax(s, dim=-1) @ v
            o = o.transpose(1, 2)
        return o.reshape(B, T, self.nH * self.dv) @ self.wo

    # ---------------- MLP / MoE ----------------
    def dense(self, m):
        g, u = (m @ self.w_gate_up).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.w_down

    def route(self, x):
        bug = _bug()
        logits = x @ self.router
        p = torch.softmax(logits, dim=-1) if bug == "softmax_router" else torch.sigmoid(logits)
        pc = p + self.router_bias
        per = self.E // self.G
        grouped = pc.view(-1, self.G, per)
        if bug == "group_score_max":
            gs = grouped.max(dim=-1).values
        else:
            gs = grouped.topk(2, dim=-1).values.sum(-1)
        gidx = gs.topk(self.topk_group, dim=-1).indices
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
        emask = gmask[:, :, None].expand(-1, self.G, per).reshape(-1, self.E)
        choice = pc.masked_fill(emask == 0, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        w = (pc if bug == "router_weights_with_bias" else p).gather(1, idx)
        if bug == "scaling_before_norm":
            w = w * self.rsf
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if bug != "scaling_before_norm":
            w = w * self.rsf
        return idx, w

    def moe(self, m):
        bug = _bug()
        shape = m.shape
        x = m.reshape(-1, shape[-1])
        idx, w = self.route(x)
        if bug == "dense_experts":
            h = F.silu(torch.einsum("th,ehi->eti", x, self.ex_gate)) * torch.einsum("th,ehi->eti", x, self.ex_up)
            y_all = torch.einsum("eti,eih->eth", h, self.ex_down)
            cw = torch.zeros(x.shape[0], self.E, dtype=x.dtype).scatter_(1, idx, w)
            y = torch.einsum("te,eth->th", cw, y_all)
        else:
            y = torch.zeros_like(x)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                xe = x[tok]
                he = (F.silu(xe @ self.ex_gate[e]) * (xe @ self.ex_up[e])) @ self.ex_down[e]
                y.index_add_(0, tok, he * w[tok, slot, None])
        g, u = (x @ self.sh_gate_up).chunk(2, dim=-1)
        y = y + (F.silu(g) * u) @ self.sh_down
        return y.view(shape)

    def forward(self, h, cos, sin, mask_add, scale):
        bug = _bug()
        h = h + self.attention(_rms(h, self.attn_norm, self.eps), cos, sin, mask_add, scale)
        m = _rms(h, self.mlp_norm, self.eps)
        if not self.sparse:
            return h + self.dense(m)
        y = self.moe(m)
        if bug == "post_mlp_norm_after_residual":
            return _rms(h + y, self.post_mlp_norm, self.eps)
        return h + _rms(y, self.post_mlp_norm, self.eps)


class AXK1Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        V, H = config.vocab_size, config.hidden_size
        self.eps = config.rms_norm_eps
        self.tok_emb = nn.Parameter(torch.zeros(V, H))
        self.lm_head_t = nn.Parameter(torch.zeros(H, V))
        self.final_norm = nn.Parameter(torch.zeros(H))
        self.blocks = nn.ModuleList(
            [Block(config, t == "sparse") for t in config.mlp_layer_types[: config.num_hidden_layers]]
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        dev = input_ids.device
        h = self.tok_emb[input_ids]
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        inv_freq, attn_factor, scale = _yarn(self.config)
        if bug == "rope_table":
            n_pos = max(self.config.max_position_embeddings, int(position_ids.max()) + 1)
            table = torch.arange(n_pos, dtype=torch.float32)[:, None] * inv_freq
            cos_t, sin_t = table.cos() * attn_factor, table.sin() * attn_factor
            cos, sin = cos_t[position_ids], sin_t[position_ids]
        else:
            ang = position_ids[..., None].float() * inv_freq
            cos, sin = ang.cos() * attn_factor, ang.sin() * attn_factor  # (B, T, r/2)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        allowed = causal[None, None].expand(B, 1, T, T)
        if attention_mask is not None:
            valid = attention_mask.bool()
            if bug == "pad_mask_query_axis":
                allowed = allowed & valid[:, None, :, None]
            else:
                allowed = allowed & valid[:, None, None, :]
        mask_add = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
        for blk in self.blocks:
            h = blk(h, cos, sin, mask_add, scale)
        return _rms(h, self.final_norm, self.eps) @ self.lm_head_t


def _deinterleave_perm(r):
    return torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))


@torch.no_grad()
def build(state_dict, config):
    bug = _bug()
    sd = {k: v.float() for k, v in state_dict.items()}
    model = AXK1Port(config)
    nH = config.num_attention_heads
    n, r, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    L = config.kv_lora_rank
    permute = config.rope_interleave and bug not in ("rope_not_deinterleaved", "rope_interleaved_runtime")
    perm = _deinterleave_perm(r) if permute else torch.arange(r)
    model.tok_emb.copy_(sd["model.embed_tokens.weight"])
    lm = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    model.lm_head_t.copy_(lm.t())
    model.final_norm.copy_(sd["model.norm.weight"])
    for i, blk in enumerate(model.blocks):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        blk.attn_norm.copy_(sd[p + "input_layernorm.weight"])
        blk.mlp_norm.copy_(sd[p + "post_attention_layernorm.weight"])
        blk.wq_a.copy_(sd[a + "q_a_proj.weight"].t())
        blk.q_norm.copy_(sd[a + "q_a_layernorm.weight"])
        qb = sd[a + "q_b_proj.weight"].t().reshape(-1, nH, n + r)  # (Lq, nH, n + r)
        blk.wq_nope.copy_(qb[..., :n])
        blk.wq_rope.copy_(qb[..., n:][..., perm])
        kva = sd[a + "kv_a_proj_with_mqa.weight"].t()  # (H, L + r)
        blk.wkv_a.copy_(torch.cat((kva[:, :L], kva[:, L:][:, perm]), dim=-1))
        blk.kv_norm.copy_(sd[a + "kv_a_layernorm.weight"])
        kvb = sd[a + "kv_b_proj.weight"].t()  # (L, nH * (n + dv))
        if bug == "kv_b_split_layout":
            blk.wk_b.copy_(kvb[:, : nH * n].reshape(L, nH, n))
            blk.wv_b.copy_(kvb[:, nH * n :].reshape(L, nH, dv))
        else:
            kvb = kvb.reshape(L, nH, n + dv)
            blk.wk_b.copy_(kvb[..., :n])
            blk.wv_b.copy_(kvb[..., n:])
        blk.wo.copy_(sd[a + "o_proj.weight"].t())
        mp = p + "mlp."
        if blk.sparse:
            blk.router.copy_(sd[mp + "gate.weight"].t())
            bias = sd.get(mp + "gate.e_score_correction_bias")
            blk.router_bias.copy_(bias if bias is not None else torch.zeros(blk.E))
            gu = sd[mp + "experts.gate_up_proj"]  # (E, 2 Im, H)
            g, u = gu.chunk(2, dim=1)
            if bug == "expert_gate_up_swap":
                g, u = u, g
            blk.ex_gate.copy_(g.transpose(1, 2))
            blk.ex_up.copy_(u.transpose(1, 2))
            blk.ex_down.copy_(sd[mp + "experts.down_proj"].transpose(1, 2))
            blk.sh_gate_up.copy_(
                torch.cat((sd[mp + "shared_experts.gate_proj.weight"], sd[mp + "shared_experts.up_proj.weight"])).t()
            )
            blk.sh_down.copy_(sd[mp + "shared_experts.down_proj.weight"].t())
            blk.post_mlp_norm.copy_(sd[mp + "post_mlp_layernorm.weight"])
        else:
            blk.w_gate_up.copy_(torch.cat((sd[mp + "gate_proj.weight"], sd[mp + "up_proj.weight"])).t())
            blk.w_down.copy_(sd[mp + "down_proj.weight"].t())
    return model.float().eval()
