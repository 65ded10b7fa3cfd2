"""A hand-written PyTorch port of the text path of Mistral Large 4 (`mistral_large4`,
Transformers' `MistralLarge4ForConditionalGeneration`): token embedding, the decoder stack, final RMSNorm,
`lm_head` and tanh logit soft-capping. The vision tower / projector are not ported (their keys are ignored).

Architecture (as implemented here; D = hidden_size, H = num_attention_heads, r = kv_lora_rank,
dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, Hi / Di = index_n_heads / index_head_dim):

  x_0 = E[input_ids]                                                   (B, S, D)
  per layer l:   h = RMSNorm(x) ;  x = x + Attn_l(h) ;  h = RMSNorm(x) ;  x = x + FFN_l(h)
  logits = c * tanh((RMSNorm(x) @ W_head) / c),  c = final_logit_softcapping

  RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)   (eps = rms_norm_eps)

  RoPE ("LeRoPE"): inv_freq_j = theta^(-2j/dr) * exp(alpha_j) (alpha learned, one per frequency), angle
  = pos * inv_freq. Rotation on INTERLEAVED pairs (x_{2j}, x_{2j+1}); the rotated pair halves are written
  de-interleaved ([rotated evens | rotated odds]) - a fixed permutation shared by q and k.
  A layer uses RoPE iff no_rope_layers[l] == 1 (smollm3 convention); a NoPE layer has dr_l = 0 and
  dn_l = dn + dr (its query/key are all "nope").

  Attention (MLA, no q-LoRA, DSA sparse top-k, KV sharing):
    q = h @ Wq -> per head [q_nope (dn_l) | q_rope (dr_l)]
    [c | k_rope] = h @ Wkv_a ; c = RMSNorm(c) (B, S, r) ; k_rope single-headed, rotated
    a layer whose kv_source_layers[l] != l has no Wkv_a: it reuses (c, rotated k_rope) of its source layer
    k_nope_h = c @ Wuk_h, v_h = c @ Wuv_h (per head, from kv_b_proj)
    q <- q * (s_h * log(pos + 1) + b_h)      (per head, per query-position "softmax scaling")
    scores = (q_nope . k_nope + q_rope . k_rope) / sqrt(dn + dr), mask = causal & padding & top-k
    out = softmax(scores) @ v -> (B, S, H*dv) @ Wo
  Indexer (layers with indexer_types[l] == "full"; "shared" layers reuse the previous layer's top-k):
    qi = LayerNorm(h) @ Wiq -> (B, S, Hi, Di), qi <- qi * (si_h * log(pos+1) + bi_h)
    ki = LayerNorm(h @ Wik) (B, S, Di); RoPE (interleaved) on the FIRST dr dims of qi and ki (if the layer
    uses RoPE); wi = h @ Wiw * Hi^-0.5 (B, S, Hi)
    I[b,s,t] = sum_h wi[b,s,h] * relu(qi[b,s,h] . ki[b,t] / sqrt(Di)), masked (causal & padding) to -big,
    top-k (index_topk) keys per query are the only keys the attention may see.

  FFN: layers < first_k_dense_replace: SwiGLU MLP  down(silu(gate(h)) * up(h)).
       others: MoE.  p = softmax(h @ Wr) (fp32), top-k experts (n_group = 1), weights = p_topk / sum p_topk
       * routed_scaling_factor; out = sum_k w_k * Expert_k(h) + SharedExpert(h) (both SwiGLU).

Weight layout (mine, converted in `build` from the Transformers state dict):
  - every matrix is stored TRANSPOSED (in -> out) so that y = x @ W;
  - `tok_emb` (V, D), `head_t` (D, V), `final_norm` (D,), `rope_alpha` (dr/2,), buffer `inv_freq` (dr/2,);
  - `blocks[l]` (a `_Block`):
      `norms` (2, D) stacked [attention-norm; ffn-norm]
      `wq_nope_t` (D, H*dn_l), `wq_rope_t` (D, H*dr_l)  (q_proj split by part instead of by head)
      `wkva_t` (D, r + dr_l), `kv_norm` (r,)            (only layers owning their KV)
      `w_uk` (H, r, dn_l), `w_uv` (H, r, dv)            (kv_b_proj split per head into key / value ups)
      `wo_t` (H*dv, D), `qscale` (2, H) [scale; bias]
      indexer ("full" layers): `ix_qnorm` (2, D) [w; b], `ix_wq_t` (D, Hi*Di),
      `ix_wkw_t` (D, Di + Hi) (wk and weights_proj fused), `ix_knorm` (2, Di) [w; b], `ix_qscale` (2, Hi)
      dense FFN: `w13_t` (D, 2I) [gate | up], `w2_t` (I, D)
      MoE FFN: `router_t` (D, E), `ex_w13` (E, D, 2I') [gate | up], `ex_w2` (E, I', D),
               `sh_w13_t` (D, 2Is) [gate | up], `sh_w2_t` (Is, D)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "scale_from_config_head_dim",  # attention scale uses config.head_dim (the config rewrites it to qk_rope_head_dim) instead of qk_nope+qk_rope
    "rope_half_split",  # MLA RoPE pairs (i, i+d/2) NeoX-style instead of Mistral/DeepSeek interleaved pairs (2i, 2i+1)
    "lerope_alpha_no_exp",  # LeRoPE: learned alpha multiplies inv_freq directly instead of exp(alpha)
    "qscale_log_pos_offbyone",  # query softmax-scaling uses log(max(pos, 1)) instead of log(pos + 1)
    "indexer_rope_on_tail",  # indexer rotates its LAST qk_rope_head_dim dims (MLA layout) instead of its first ones
    "indexer_relu_after_weighting",  # indexer ReLU applied to the head-weighted sum instead of per head before weighting
    "indexer_k_rmsnorm",  # indexer key norm done as RMSNorm (no centering, no bias) instead of LayerNorm
    "shared_indexer_dense",  # "shared" indexer layers attend densely instead of reusing the previous layer's top-k
    "kv_share_rerotate",  # KV-sharing layer applies RoPE again to the source layer's already rotated k_rope
    "kv_b_split_swapped",  # kv_b_proj rows per head read as [v | k_nope] instead of [k_nope | v]
    "router_sigmoid",  # router scores with sigmoid (DeepSeek-V3 template) instead of softmax
    "routed_scale_before_renorm",  # routed_scaling_factor applied before the top-k renormalisation (so it cancels)
    "gate_up_chunk_swapped",  # fused expert gate_up_proj chunked as (up, gate) instead of (gate, up)
    "indexer_causal_only",  # indexer masks only future keys, not padding: pad keys take top-k slots
]

PADDING_ONLY = ["indexer_causal_only"]

CLEAN = [
    "absorbed_mla",  # MLA with weight absorption: q_nope @ W_uk attends the latent c directly, W_uv after the softmax
    "rope_complex",  # RoPE as complex multiplication of interleaved pairs (interleaved output layout for q and k)
    "dense_experts",  # every expert on every token (batched einsum), combined with a dense scattered routing matrix
    "sdpa_attention",  # F.scaled_dot_product_attention with an additive float mask instead of explicit softmax
    "qscale_on_scores",  # per-(head, query) softmax scaling applied to the score rows instead of to the queries
]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin, half_split=False):
    """Rotate the last dim of x (size dr) by angles whose cos/sin have size dr/2 (broadcastable)."""
    if BUG == "rope_complex" and not half_split:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], x.shape[-1] // 2, 2).contiguous())
        rot = torch.complex(cos, sin)
        return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)
    if half_split:
        d = x.shape[-1] // 2
        x1, x2 = x[..., :d], x[..., d:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _log_pos(pos):
    if BUG == "qscale_log_pos_offbyone":
        return pos.float().clamp(min=1).log()
    return (pos + 1).float().log()


class _Block(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.idx = idx
        self.use_rope = bool(cfg.no_rope_layers[idx])
        self.dr = cfg.qk_rope_head_dim if self.use_rope else 0
        self.dn = cfg.qk_nope_head_dim + (0 if self.use_rope else cfg.qk_rope_head_dim)
        self.dv = cfg.v_head_dim
        self.r = cfg.kv_lora_rank
        self.H = H
        self.src = cfg.kv_source_layers[idx]
        self.owns_kv = self.src == idx
        self.full_indexer = cfg.indexer_types[idx] != "shared"
        self.sparse = cfg.mlp_layer_types[idx] == "sparse"
        z = torch.zeros
        self.norms = nn.Parameter(z(2, D))
        self.wq_nope_t = nn.Parameter(z(D, H * self.dn))
        self.wq_rope_t = nn.Parameter(z(D, H * self.dr))
        if self.owns_kv:
            self.wkva_t = nn.Parameter(z(D, self.r + self.dr))
            self.kv_norm = nn.Parameter(z(self.r))
        self.w_uk = nn.Parameter(z(H, self.r, self.dn))
        self.w_uv = nn.Parameter(z(H, self.r, self.dv))
        self.wo_t = nn.Parameter(z(H * self.dv, D))
        self.qscale = nn.Parameter(z(2, H))
        if self.full_indexer:
            Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            self.ix_qnorm = nn.Parameter(z(2, D))
            self.ix_wq_t = nn.Parameter(z(D, Hi * Di))
            self.ix_wkw_t = nn.Parameter(z(D, Di + Hi))
            self.ix_knorm = nn.Parameter(z(2, Di))
            self.ix_qscale = nn.Parameter(z(2, Hi))
        if self.sparse:
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            Is = cfg.moe_intermediate_size * cfg.n_shared_experts
            self.router_t = nn.Parameter(z(D, E))
            self.ex_w13 = nn.Parameter(z(E, D, 2 * I))
            self.ex_w2 = nn.Parameter(z(E, I, D))
            self.sh_w13_t = nn.Parameter(z(D, 2 * Is))
            self.sh_w2_t = nn.Parameter(z(Is, D))
        else:
            I = cfg.intermediate_size
            self.w13_t = nn.Parameter(z(D, 2 * I))
            self.w2_t = nn.Parameter(z(I, D))


class MistralLarge4Text(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.D = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.Hi, self.Di = cfg.index_n_heads, cfg.index_head_dim
        self.dr = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.k_exp = cfg.num_experts_per_tok
        self.rsf = cfg.routed_scaling_factor
        self.cap = cfg.final_logit_softcapping
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, self.dr, 2, dtype=torch.float32) / self.dr))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_alpha = nn.Parameter(torch.zeros(self.dr // 2))
        self.tok_emb = nn.Parameter(torch.zeros(cfg.vocab_size, self.D))
        self.blocks = nn.ModuleList([_Block(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.final_norm = nn.Parameter(torch.zeros(self.D))
        self.head_t = nn.Parameter(torch.zeros(self.D, cfg.vocab_size))

    # ---------------------------------------------------------------- pieces
    def _angles(self, pos):
        if BUG == "lerope_alpha_no_exp":
            freq = self.inv_freq * self.rope_alpha
        else:
            freq = self.inv_freq * self.rope_alpha.exp()
        ang = pos[..., None].float() * freq  # (B, S, dr/2)
        return ang.cos(), ang.sin()

    def _rot(self, x, cos, sin):
        return _rotate(x, cos, sin, half_split=BUG == "rope_half_split")

    def _indexer(self, blk, h, cos, sin, logpos, allowed, causal):
        B, S, _ = h.shape
        Hi, Di, dr = self.Hi, self.Di, self.dr
        qn = F.layer_norm(h, (self.D,), blk.ix_qnorm[0], blk.ix_qnorm[1], eps=1e-6)
        q = (qn @ blk.ix_wq_t).view(B, S, Hi, Di)
        f = blk.ix_qscale[0] * logpos[..., None] + blk.ix_qscale[1]  # (B, S, Hi)
        q = q * f[..., None]
        kw = h @ blk.ix_wkw_t
        k, w = kw[..., :Di], kw[..., Di:]
        if BUG == "indexer_k_rmsnorm":
            k = _rms(k, blk.ix_knorm[0], 1e-6)
        else:
            k = F.layer_norm(k, (Di,), blk.ix_knorm[0], blk.ix_knorm[1], eps=1e-6)
        if blk.use_rope:
            if BUG == "indexer_rope_on_tail":
                q = torch.cat([q[..., : Di - dr], self._rot(q[..., Di - dr :], cos[:, :, None], sin[:, :, None])], -1)
                k = torch.cat([k[..., : Di - dr], self._rot(k[..., Di - dr :], cos, sin)], -1)
            else:
                q = torch.cat([self._rot(q[..., :dr], cos[:, :, None], sin[:, :, None]), q[..., dr:]], -1)
                k = torch.cat([self._rot(k[..., :dr], cos, sin), k[..., dr:]], -1)
        scores = torch.einsum("bshd,btd->bsht", q, k) * Di**-0.5
        w = w * Hi**-0.5
        if BUG == "indexer_relu_after_weighting":
            idx = F.relu(torch.einsum("bsh,bsht->bst", w, scores))
        else:
            idx = torch.einsum("bsh,bsht->bst", w, F.relu(scores))
        mask = causal if BUG == "indexer_causal_only" else allowed
        idx = idx.masked_fill(~mask, torch.finfo(idx.dtype).min)
        top = idx.topk(min(self.topk, S), dim=-1).indices
        return torch.zeros(B, S, S, dtype=torch.bool, device=h.device).scatter(-1, top, True)

    def _attention(self, blk, h, cos, sin, logpos, allowed, causal, shared, prev_sel):
        B, S, _ = h.shape
        H, dn, dr, dv = blk.H, blk.dn, blk.dr, blk.dv
        qn = (h @ blk.wq_nope_t).view(B, S, H, dn).transpose(1, 2)  # (B, H, S, dn)
        qr = (h @ blk.wq_rope_t).view(B, S, H, dr).transpose(1, 2)  # (B, H, S, dr)
        if blk.owns_kv:
            ckv = h @ blk.wkva_t
            c = _rms(ckv[..., : blk.r], blk.kv_norm, self.eps)  # (B, S, r)
            kr = ckv[..., blk.r :][:, None]  # (B, 1, S, dr)
            if blk.use_rope:
                kr = self._rot(kr, cos[:, None], sin[:, None])
            shared[blk.idx] = (c, kr)
        else:
            c, kr = shared[blk.src]
            if blk.use_rope and BUG == "kv_share_rerotate":
                kr = self._rot(kr, cos[:, None], sin[:, None])
        if blk.use_rope:
            qr = self._rot(qr, cos[:, None], sin[:, None])

        # per-(head, query) softmax scaling factor
        f = (blk.qscale[0][None, :, None] * logpos[:, None, :] + blk.qscale[1][None, :, None])[..., None]  # (B,H,S,1)
        if BUG != "qscale_on_scores":
            qn, qr = qn * f, qr * f

        # DSA top-k selection
        if blk.full_indexer:
            sel = self._indexer(blk, h, cos, sin, logpos, allowed, causal)
        elif BUG == "shared_indexer_dense":
            sel = torch.ones_like(allowed)
        else:
            sel = prev_sel
        keep = (allowed & sel)[:, None]  # (B, 1, S, S)

        if BUG == "scale_from_config_head_dim":
            scale = self.cfg.head_dim**-0.5
        else:
            scale = self.qk_head_dim**-0.5
        neg = torch.finfo(h.dtype).min

        if BUG == "absorbed_mla":
            q_lat = torch.einsum("bhsn,hrn->bhsr", qn, blk.w_uk)
            scores = q_lat @ c[:, None].transpose(-1, -2)
            if dr:
                scores = scores + qr @ kr.transpose(-1, -2)
            p = torch.softmax((scores * scale).masked_fill(~keep, neg), dim=-1)
            o = torch.einsum("bhsr,hrv->bhsv", p @ c[:, None], blk.w_uv)
        else:
            k_nope = torch.einsum("btr,hrn->bhtn", c, blk.w_uk)
            v = torch.einsum("btr,hrv->bhtv", c, blk.w_uv)
            k = torch.cat([k_nope, kr.expand(B, H, S, dr)], dim=-1)
            q = torch.cat([qn, qr], dim=-1)
            if BUG == "sdpa_attention":
                bias = torch.zeros(keep.shape, dtype=h.dtype, device=h.device).masked_fill(~keep, neg)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
            else:
                scores = q @ k.transpose(-1, -2)
                if BUG == "qscale_on_scores":
                    scores = scores * f
                p = torch.softmax((scores * scale).masked_fill(~keep, neg), dim=-1)
                o = p @ v
        o = o.transpose(1, 2).reshape(B, S, H * dv)
        return o @ blk.wo_t, sel

    def _ffn(self, blk, h):
        if not blk.sparse:
            g, u = (h @ blk.w13_t).chunk(2, dim=-1)
            return (F.silu(g) * u) @ blk.w2_t
        shape = h.shape
        t = h.reshape(-1, shape[-1])
        logits = t.float() @ blk.router_t.float()
        probs = logits.sigmoid() if BUG == "router_sigmoid" else logits.softmax(-1)
        topv, topi = probs.topk(self.k_exp, dim=-1)
        if BUG == "routed_scale_before_renorm":
            topv = topv * self.rsf
            w = topv / (topv.sum(-1, keepdim=True) + 1e-20)
        else:
            w = topv / (topv.sum(-1, keepdim=True) + 1e-20) * self.rsf
        E = blk.ex_w13.shape[0]
        if BUG == "dense_experts":
            gu = torch.einsum("td,edi->tei", t, blk.ex_w13)
            g, u = gu.chunk(2, dim=-1)
            y = torch.einsum("tei,eid->ted", F.silu(g) * u, blk.ex_w2)
            comb = torch.zeros(t.shape[0], E, dtype=t.dtype, device=t.device).scatter(1, topi, w)
            out = torch.einsum("te,ted->td", comb, y)
        else:
            out = torch.zeros_like(t)
            for e in range(E):
                tok, slot = torch.where(topi == e)
                if tok.numel() == 0:
                    continue
                gu = t[tok] @ blk.ex_w13[e]
                if BUG == "gate_up_chunk_swapped":
                    u, g = gu.chunk(2, dim=-1)
                else:
                    g, u = gu.chunk(2, dim=-1)
                y = (F.silu(g) * u) @ blk.ex_w2[e]
                out.index_add_(0, tok, y * w[tok, slot, None])
        g, u = (t @ blk.sh_w13_t).chunk(2, dim=-1)
        out = out + (F.silu(g) * u) @ blk.sh_w2_t
        return out.view(shape)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        dev = input_ids.device
        x = self.tok_emb[input_ids]
        if position_ids is None:
            pos = torch.arange(S, device=dev)[None].expand(B, S)
        else:
            pos = position_ids.to(dev).expand(B, S)
        causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()[None].expand(B, S, S)
        allowed = causal
        if attention_mask is not None:
            allowed = causal & attention_mask.to(dev).bool()[:, None, :]
        cos, sin = self._angles(pos)
        logpos = _log_pos(pos)  # (B, S)
        shared, sel = {}, None
        for blk in self.blocks:
            h = _rms(x, blk.norms[0], self.eps)
            a, sel = self._attention(blk, h, cos, sin, logpos, allowed, causal, shared, sel)
            x = x + a
            h = _rms(x, blk.norms[1], self.eps)
            x = x + self._ffn(blk, h)
        x = _rms(x, self.final_norm, self.eps)
        logits = x @ self.head_t
        return self.cap * torch.tanh(logits / self.cap)


def build(state_dict, config):
    cfg = config.text_config if hasattr(config, "text_config") else config
    sd = {k: v.float() for k, v in state_dict.items()}
    pre = "model.language_model."
    model = MistralLarge4Text(cfg)
    H = cfg.num_attention_heads
    with torch.no_grad():
        model.tok_emb.copy_(sd[pre + "embed_tokens.weight"])
        model.final_norm.copy_(sd[pre + "norm.weight"])
        model.head_t.copy_(sd["lm_head.weight"].t())
        model.rope_alpha.copy_(sd[pre + "rotary_emb.alpha"])
        for i, blk in enumerate(model.blocks):
            p = f"{pre}layers.{i}."
            a = p + "self_attn."
            blk.norms.copy_(torch.stack([sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]]))
            wq = sd[a + "q_proj.weight"].view(H, blk.dn + blk.dr, -1)  # rows per head [nope | rope]
            D = wq.shape[-1]
            blk.wq_nope_t.copy_(wq[:, : blk.dn].reshape(H * blk.dn, D).t())
            blk.wq_rope_t.copy_(wq[:, blk.dn :].reshape(H * blk.dr, D).t())
            if blk.owns_kv:
                blk.wkva_t.copy_(sd[a + "kv_a_proj_with_mqa.weight"].t())
                blk.kv_norm.copy_(sd[a + "kv_a_layernorm.weight"])
            wkvb = sd[a + "kv_b_proj.weight"].view(H, blk.dn + blk.dv, blk.r)
            if BUG == "kv_b_split_swapped":
                wv, wk = wkvb[:, : blk.dv], wkvb[:, blk.dv :]
            else:
                wk, wv = wkvb[:, : blk.dn], wkvb[:, blk.dn :]
            blk.w_uk.copy_(wk.transpose(1, 2))
            blk.w_uv.copy_(wv.transpose(1, 2))
            blk.wo_t.copy_(sd[a + "o_proj.weight"].t())
            blk.qscale.copy_(torch.stack([sd[a + "softmax_scaling.scale"], sd[a + "softmax_scaling.bias"]]))
            if blk.full_indexer:
                x = a + "indexer."
                blk.ix_qnorm.copy_(torch.stack([sd[x + "q_input_norm.weight"], sd[x + "q_input_norm.bias"]]))
                blk.ix_wq_t.copy_(sd[x + "wq_b.weight"].t())
                blk.ix_wkw_t.copy_(torch.cat([sd[x + "wk.weight"], sd[x + "weights_proj.weight"]], 0).t())
                blk.ix_knorm.copy_(torch.stack([sd[x + "k_norm.weight"], sd[x + "k_norm.bias"]]))
                blk.ix_qscale.copy_(torch.stack([sd[x + "softmax_scaling.scale"], sd[x + "softmax_scaling.bias"]]))
            m = p + "mlp."
            if blk.sparse:
                blk.router_t.copy_(sd[m + "gate.weight"].t())
                blk.ex_w13.copy_(sd[m + "experts.gate_up_proj"].transpose(1, 2))
                blk.ex_w2.copy_(sd[m + "experts.down_proj"].transpose(1, 2))
                s = m + "shared_experts."
                blk.sh_w13_t.copy_(torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]], 0).t())
                blk.sh_w2_t.copy_(sd[s + "down_proj.weight"].t())
            else:
                blk.w13_t.copy_(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]], 0).t())
                blk.w2_t.copy_(sd[m + "down_proj.weight"].t())
    return model.float().eval()
