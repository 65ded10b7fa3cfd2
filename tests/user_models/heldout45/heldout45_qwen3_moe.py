"""A from-scratch PyTorch port of Qwen3-MoE (decoder-only causal LM with QK-norm and sparse top-k experts).

Architecture (per token sequence x of ids, length S, batch B; D = hidden_size, H = num_attention_heads,
K = num_key_value_heads, d = head_dim, E = num_experts, k = num_experts_per_tok, I = intermediate_size,
Im = moe_intermediate_size, eps = rms_norm_eps):

    h_0 = Embed[x]                                                     (B, S, D)
    for each layer l:
        a    = RMSNorm(h; w_in)                 RMSNorm(v; w) = w * v / sqrt(mean(v^2) + eps)
        q,k,v = a @ Wqkv  split into H*d | K*d | K*d, viewed as heads   q: (B, H, S, d), k/v: (B, K, S, d)
        q    = RMSNorm_d(q; w_qn), k = RMSNorm_d(k; w_kn)   (QK-norm over the head dim, one weight of size d
                                                              shared by every head) -- BEFORE RoPE
        q,k  = RoPE(q), RoPE(k)   NeoX "rotate-half" pairing (i, i + d/2):
                  inv_freq_i = theta^(-2i/d), i < d/2, theta = config.rope_parameters["rope_theta"]
                  angle = pos * inv_freq, cos/sin tables repeated twice along d
                  rope(x) = x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1]
        GQA: query head j reads kv head j // (H / K)
        s    = q k^T / sqrt(d), masked where key j > query i (causal) or key j is padding (attention_mask == 0)
        o    = softmax(s) v -> (B, S, H*d) -> @ Wo
        h    = h + o
        m    = RMSNorm(h; w_post)
        if l is a dense layer (l in mlp_only_layers, or (l+1) % decoder_sparse_step != 0, or E == 0):
            f = (silu(m Wg) * (m Wu)) Wd                                 (SwiGLU, width I)
        else (sparse MoE):
            p   = softmax(m Wr)                                          router probs over E experts
            top = top-k of p (values w, ids e); if norm_topk_prob: w = w / sum(w)
            f   = sum_j w_j * Expert_{e_j}(m),  Expert_e(m) = (silu(m G_e) * (m U_e)) Dn_e   (width Im)
        h    = h + f
    logits = RMSNorm(h; w_final) @ Wlm                                  (B, S, V)

Weight layout (ours, all matrices stored transposed: in -> out, so y = x @ W):
    embed                (V, D)
    lm_head_t            (D, V)               (the embedding's transpose when tie_word_embeddings)
    final_norm           (D,)
    blocks[l].attn_norm  (D,)                  input_layernorm
    blocks[l].ffn_norm   (D,)                  post_attention_layernorm
    blocks[l].wqkv_t     (D, (H + 2K) * d)     q_proj | k_proj | v_proj fused along the output axis
    blocks[l].wo_t       (H * d, D)
    blocks[l].qk_norm    (2, d)                row 0: q_norm, row 1: k_norm
    dense block:  blocks[l].w13_t (D, 2I)  = [gate | up],  blocks[l].w2_t (I, D)
    MoE block:    blocks[l].router_t (D, E),
                  blocks[l].w13 (E, D, 2Im)  = per expert [gate | up] (checkpoint gate_up_proj (E, 2Im, D) transposed),
                  blocks[l].w2  (E, Im, D)   (checkpoint down_proj (E, D, Im) transposed)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qk_norm_after_rope",  # q/k RMSNorm applied after RoPE instead of before it
    "qk_norm_full_width",  # q/k RMSNorm reduces over all heads (H*d, OLMo-2 style, weight tiled) instead of per head (d)
    "rope_interleaved",  # RoPE rotates adjacent pairs (2i, 2i+1) (GPT-J / llama.cpp NORM) instead of NeoX halves (i, i+d/2)
    "rope_theta_default",  # theta read as getattr(config, "rope_theta", 10000) - v5 keeps it in rope_parameters, so 1e4 not 1e6
    "no_topk_renorm",  # norm_topk_prob ignored (Qwen2-MoE default False): top-k probs not renormalised to sum 1
    "router_on_residual",  # router scores the un-normalised residual stream instead of post_attention_layernorm's output
    "expert_ids_sorted",  # top-k expert ids sorted ascending (for grouping) without permuting their weights alongside
    "gate_up_swapped",  # fused expert gate_up_proj split as [up | gate] instead of [gate | up]
    "down_reshape",  # expert down_proj (E, D, Im) converted with reshape(E, Im, D) instead of transpose(1, 2)
    "gqa_tile",  # kv heads expanded with repeat (tile: head j -> kv j % K) instead of repeat_interleave (j // (H/K))
    "causal_strict",  # causal mask off by one: tril(diagonal=-1), a token does not attend to itself
    "k_norm_from_q_norm",  # loader key typo: k_norm's weight taken from self_attn.q_norm.weight
    "pad_mask_query_axis",  # padding mask broadcast along the query axis instead of the key axis
    "q_prescale_before_norm",  # q scaled by d^-0.5 right after q_proj, then q_norm undoes it (attention unscaled)
]

PADDING_ONLY = ["pad_mask_query_axis"]

CLEAN = [
    "topk_then_softmax",  # softmax over the k selected router logits == renormalised top-k of the full softmax (norm_topk_prob)
    "weight_before_down",  # routing weight multiplied into the expert's Im-wide activation before down-projection (linear)
    "dense_experts",  # every expert run on every token, combined with a dense (T, E) weight matrix (zeros off top-k)
    "rope_complex",  # RoPE as complex multiplication of (x_i + i x_{i+d/2}) by exp(i * angle)
    "sdpa_attention",  # F.scaled_dot_product_attention with an additive float mask and explicitly expanded kv heads
]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg, moe: bool):
        super().__init__()
        D, H, K, d = cfg["D"], cfg["H"], cfg["K"], cfg["d"]
        self.moe = moe
        self.attn_norm = nn.Parameter(torch.ones(D))
        self.ffn_norm = nn.Parameter(torch.ones(D))
        self.wqkv_t = nn.Parameter(torch.zeros(D, (H + 2 * K) * d))
        self.wo_t = nn.Parameter(torch.zeros(H * d, D))
        self.qk_norm = nn.Parameter(torch.ones(2, d))
        if moe:
            E, Im = cfg["E"], cfg["Im"]
            self.router_t = nn.Parameter(torch.zeros(D, E))
            self.w13 = nn.Parameter(torch.zeros(E, D, 2 * Im))
            self.w2 = nn.Parameter(torch.zeros(E, Im, D))
        else:
            I = cfg["I"]
            self.w13_t = nn.Parameter(torch.zeros(D, 2 * I))
            self.w2_t = nn.Parameter(torch.zeros(I, D))


class Qwen3MoePort(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.num_attention_heads
        D = config.hidden_size
        d = getattr(config, "head_dim", None) or D // H
        self.cfg = dict(
            D=D,
            H=H,
            K=config.num_key_value_heads,
            d=d,
            I=config.intermediate_size,
            Im=config.moe_intermediate_size,
            E=config.num_experts,
            topk=config.num_experts_per_tok,
            norm_topk=bool(config.norm_topk_prob),
            eps=config.rms_norm_eps,
            V=config.vocab_size,
        )
        self.config = config
        mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
        step = config.decoder_sparse_step
        self.moe_layers = [
            (i not in mlp_only) and config.num_experts > 0 and (i + 1) % step == 0
            for i in range(config.num_hidden_layers)
        ]
        self.embed = nn.Parameter(torch.zeros(config.vocab_size, D))
        self.lm_head_t = nn.Parameter(torch.zeros(D, config.vocab_size))
        self.final_norm = nn.Parameter(torch.ones(D))
        self.blocks = nn.ModuleList([Block(self.cfg, m) for m in self.moe_layers])
        rp = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rp.get("rope_theta", 10000.0))

    # ---------------------------------------------------------------- rope
    def _rope_tables(self, positions, d):
        theta = self.rope_theta
        if BUG == "rope_theta_default":
            theta = float(getattr(self.config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # (d/2,)
        ang = positions[..., None].float() * inv_freq  # (B, S, d/2)
        return ang

    def _apply_rope(self, x, ang):
        # x: (B, h, S, d), ang: (B, S, d/2)
        ang = ang[:, None]
        if BUG == "rope_interleaved":
            cos, sin = ang.cos(), ang.sin()
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
            return out.flatten(-2)
        if BUG == "rope_complex":
            half = x.shape[-1] // 2
            z = torch.complex(x[..., :half], x[..., half:])
            r = z * torch.polar(torch.ones_like(ang), ang)
            return torch.cat((r.real, r.imag), dim=-1).to(x.dtype)
        emb = torch.cat((ang, ang), dim=-1)
        return x * emb.cos() + _rotate_half(x) * emb.sin()

    # ---------------------------------------------------------------- attention
    def _attention(self, blk, x, ang, allowed):
        c = self.cfg
        B, S, _ = x.shape
        H, K, d, eps = c["H"], c["K"], c["d"], c["eps"]
        qkv = x @ blk.wqkv_t
        q, k, v = qkv.split([H * d, K * d, K * d], dim=-1)
        scale = d**-0.5
        if BUG == "q_prescale_before_norm":
            q = q * scale
            scale = 1.0
        q = q.view(B, S, H, d)
        k = k.view(B, S, K, d)
        v = v.view(B, S, K, d).transpose(1, 2)
        qw, kw = blk.qk_norm[0], blk.qk_norm[1]

        def qk_norm(q, k):
            if BUG == "qk_norm_full_width":
                qf = q.transpose(1, 2).reshape(B, S, H * d)
                kf = k.transpose(1, 2).reshape(B, S, K * d)
                qf = _rms(qf, qw.repeat(H), eps)
                kf = _rms(kf, kw.repeat(K), eps)
                return qf.view(B, S, H, d).transpose(1, 2), kf.view(B, S, K, d).transpose(1, 2)
            return _rms(q, qw, eps), _rms(k, kw, eps)

        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, h, S, d)
        if BUG == "qk_norm_after_rope":
            q, k = self._apply_rope(q, ang), self._apply_rope(k, ang)
            q, k = qk_norm(q, k)
        else:
            q, k = qk_norm(q, k)
            q, k = self._apply_rope(q, ang), self._apply_rope(k, ang)

        rep = H // K
        if BUG == "gqa_tile":
            k = k.repeat(1, rep, 1, 1)
            v = v.repeat(1, rep, 1, 1)
        else:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)

        neg = torch.finfo(q.dtype).min
        if BUG == "sdpa_attention":
            bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, neg)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, neg)
            o = torch.softmax(s, dim=-1) @ v
        o = o.transpose(1, 2).reshape(B, S, H * d)
        return o @ blk.wo_t

    # ---------------------------------------------------------------- feed-forward
    def _dense_mlp(self, blk, m):
        g, u = (m @ blk.w13_t).chunk(2, dim=-1)
        return (F.silu(g) * u) @ blk.w2_t

    def _route(self, blk, r_in):
        c = self.cfg
        logits = r_in @ blk.router_t  # (T, E)
        norm_topk = c["norm_topk"]
        if BUG == "no_topk_renorm":
            norm_topk = bool(getattr(self.config, "norm_topk", False))
        if BUG == "topk_then_softmax" and norm_topk:
            top_logits, ids = torch.topk(logits, c["topk"], dim=-1)
            w = torch.softmax(top_logits, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1)
            w, ids = torch.topk(probs, c["topk"], dim=-1)
            if norm_topk:
                w = w / w.sum(dim=-1, keepdim=True)
        if BUG == "expert_ids_sorted":
            ids, _ = torch.sort(ids, dim=-1)
        return w, ids

    def _experts(self, blk, m, w, ids):
        c = self.cfg
        Im = c["Im"]
        if BUG == "dense_experts":
            T = m.shape[0]
            dense_w = torch.zeros(T, c["E"], dtype=m.dtype).scatter_add(1, ids, w)  # (T, E)
            gu = torch.einsum("td,edf->etf", m, blk.w13)  # (E, T, 2Im)
            h = F.silu(gu[..., :Im]) * gu[..., Im:]
            y = torch.einsum("eti,eid->etd", h, blk.w2)  # (E, T, D)
            return torch.einsum("te,etd->td", dense_w, y)
        w13 = blk.w13[ids]  # (T, k, D, 2Im)
        gu = torch.einsum("td,tkdf->tkf", m, w13)
        if BUG == "gate_up_swapped":
            u, g = gu[..., :Im], gu[..., Im:]
        else:
            g, u = gu[..., :Im], gu[..., Im:]
        h = F.silu(g) * u  # (T, k, Im)
        if BUG == "weight_before_down":
            h = h * w[..., None]
            return torch.einsum("tki,tkid->td", h, blk.w2[ids])
        y = torch.einsum("tki,tkid->tkd", h, blk.w2[ids])
        return (y * w[..., None]).sum(dim=1)

    def _moe(self, blk, m, residual):
        B, S, D = m.shape
        flat = m.reshape(-1, D)
        r_in = residual.reshape(-1, D) if BUG == "router_on_residual" else flat
        w, ids = self._route(blk, r_in)
        return self._experts(blk, flat, w, ids).view(B, S, D)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.cfg
        B, S = input_ids.shape
        dev = input_ids.device
        h = self.embed[input_ids]
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None].expand(B, S)
        ang = self._rope_tables(position_ids, c["d"])

        i = torch.arange(S, device=dev)
        if BUG == "causal_strict":
            causal = i[None, :] < i[:, None]
        else:
            causal = i[None, :] <= i[:, None]  # (S_q, S_k)
        allowed = causal[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if BUG == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]

        for blk in self.blocks:
            a = _rms(h, blk.attn_norm, c["eps"])
            h = h + self._attention(blk, a, ang, allowed)
            m = _rms(h, blk.ffn_norm, c["eps"])
            h = h + (self._moe(blk, m, h) if blk.moe else self._dense_mlp(blk, m))
        h = _rms(h, self.final_norm, c["eps"])
        return h @ self.lm_head_t


def build(state_dict, config) -> nn.Module:
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = Qwen3MoePort(config)
    with torch.no_grad():
        model.embed.copy_(sd["model.embed_tokens.weight"])
        if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in sd:
            model.lm_head_t.copy_(sd["model.embed_tokens.weight"].t())
        else:
            model.lm_head_t.copy_(sd["lm_head.weight"].t())
        model.final_norm.copy_(sd["model.norm.weight"])
        for i, blk in enumerate(model.blocks):
            p = f"model.layers.{i}."
            blk.attn_norm.copy_(sd[p + "input_layernorm.weight"])
            blk.ffn_norm.copy_(sd[p + "post_attention_layernorm.weight"])
            wq, wk, wv = (sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
            blk.wqkv_t.copy_(torch.cat([wq, wk, wv], dim=0).t())
            blk.wo_t.copy_(sd[p + "self_attn.o_proj.weight"].t())
            blk.qk_norm[0].copy_(sd[p + "self_attn.q_norm.weight"])
            k_key = "self_attn.q_norm.weight" if BUG == "k_norm_from_q_norm" else "self_attn.k_norm.weight"
            blk.qk_norm[1].copy_(sd[p + k_key])
            if blk.moe:
                blk.router_t.copy_(sd[p + "mlp.gate.weight"].t())
                blk.w13.copy_(sd[p + "mlp.experts.gate_up_proj"].transpose(1, 2))
                down = sd[p + "mlp.experts.down_proj"]  # (E, D, Im)
                E, D, Im = down.shape
                if BUG == "down_reshape":
                    blk.w2.copy_(down.reshape(E, Im, D))
                else:
                    blk.w2.copy_(down.transpose(1, 2))
            else:
                g = sd[p + "mlp.gate_proj.weight"]
                u = sd[p + "mlp.up_proj.weight"]
                blk.w13_t.copy_(torch.cat([g, u], dim=0).t())
                blk.w2_t.copy_(sd[p + "mlp.down_proj.weight"].t())
    return model.float().eval()
