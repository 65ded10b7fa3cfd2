"""Hand-written plain-PyTorch port of Qwen3-MoE (Qwen3MoeForCausalLM), every variant a CORRECT port.

Architecture as this port implements it:
- token embedding (no scaling); untied head; final RMSNorm.  RMSNorm(x) = g * x / sqrt(mean(x^2) + eps).
- decoder layer i, pre-norm:  h = h + Attn(RMS_in(h));  h = h + FFN(RMS_post(h)).
- Attn: GQA with num_attention_heads query heads and num_key_value_heads kv heads of head_dim (head_dim is a config
  field, here != hidden / heads); per-head RMSNorm on q and on k over head_dim (q_norm / k_norm) BEFORE RoPE;
  RoPE (rope_theta, rotate-half pairing (i, i + d/2)); scale head_dim**-0.5; causal + key-padding mask; o_proj.
- FFN: layer i is a sparse MoE block unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (then a
  dense SwiGLU MLP of intermediate_size).  MoE: router logits = W_r x; p = softmax(logits) over all experts; top-k
  experts by p; if norm_topk_prob the k weights are renormalised to sum 1; each expert is a SwiGLU
  (down(silu(gate x) * up x)) of moe_intermediate_size; output = sum_k w_k expert_k(x).  No shared expert.
- positions: position_ids, else 0..T-1.

Layout variants (BUG selects one; "" is the baseline):
- "" (baseline): own module tree (blocks[i] with own names); every matrix stored transposed (in, out) and applied
  as x @ W; q/k/v fused into one wqkv_t (H, (nq + 2 nkv) hd) in [q | k | v] order; experts as 3-D tensors
  w13 (E, H, 2I) = [gate | up] transposed and w2 (E, I, H), run by a loop over the experts that got tokens with
  index_add; cos/sin tables for the whole max length precomputed as buffers and gathered by position; explicit
  softmax attention with an additive finfo.min mask.
- qwen3moe_meta_complex_rope: q/k rows of every head permuted to Meta's interleaved pair layout (2i, 2i+1) and the
  q_norm / k_norm gains permuted the same way; RoPE as complex multiplication with a precomputed freqs_cis table.
- qwen3moe_heads_axis_einsum: q/k/v/o weights with heads as a separate axis, (heads, head_dim, hidden), applied by
  einsum; GQA as a (kv_head, group) split of the query heads; SDPA with a boolean mask (diagonal kept so padded
  query rows are never empty).
- qwen3moe_expert_gather_interleaved: gate/up fused per expert with interleaved columns [g0, u0, g1, u1, ...]
  (E, H, 2I); a per-token gather of the chosen experts' weights (T, k, ...) and einsum; router as top-k over the
  raw logits then softmax over those k logits (equal to renormalised top-k softmax probabilities).
- qwen3moe_stacked_layers: one tensor per weight kind stacked over layers ((L, ...) for attention and norms,
  (L_moe, E, ...) for experts with separate w1 (gate) / w3 (up) / w2 (down), (L_dense, ...) for the dense MLP),
  kept in an nn.ParameterDict and indexed in a loop; q, k, v as three separate transposed matrices.
- qwen3moe_folded_gains: RMSNorm gains folded into the following projections (input norm into wqkv, post-attention
  norm into router, expert gate/up and dense gate/up, final norm into the head); the attention scale
  head_dim**-0.5 folded into the q_norm gain (q_norm follows q_proj, so it cannot go into q_proj); norms
  weightless.
- qwen3moe_functional_grouped_qkv: one functional forward reading a flat nn.ParameterDict; HF (out, in) orientation
  with F.linear; wqkv grouped per kv head (InternLM2 / Megatron layout: (nkv, group + 2, hd) =
  [q_{g,0}, .., q_{g,r-1}, k_g, v_g]); experts run by sorting the (token, slot) pairs by expert id and splitting
  by counts; attention with a boolean mask through torch.where.
- qwen3moe_kv_cache_decode: the sequence fed one token at a time through a preallocated KV cache (generation
  style); cos/sin computed on the fly per step from inv_freq; norm gains stored as (g - 1) and applied as
  (1 + w); each token's k experts run one by one.
- qwen3moe_backbone_head: a Backbone module (nn.ModuleDict containers) returning the final-normed hidden states and
  a separate LMHead module; positions recomputed from the attention mask as generation does (cumsum - 1, padding
  at 1), position_ids used only without a mask; cos/sin computed on the fly from inv_freq and applied to the two
  halves explicitly; MoE computed densely over all experts with the routing weights scattered into a (T, E)
  combine matrix; SDPA with an additive float mask and repeat_interleave for GQA.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = []
PADDING_ONLY = []
CLEAN = [
    "qwen3moe_meta_complex_rope",  # Meta-permuted q/k rows (+ permuted q/k norm gains), complex-number RoPE
    "qwen3moe_heads_axis_einsum",  # (heads, head_dim, hidden) weights + einsum, grouped GQA, SDPA boolean mask
    "qwen3moe_expert_gather_interleaved",  # interleaved gate/up, per-token expert weight gather, top-k-then-softmax
    "qwen3moe_stacked_layers",  # (L, ...) stacked weights per kind in a ParameterDict, separate w1/w3/w2 experts
    "qwen3moe_folded_gains",  # norm gains folded into next projections, attention scale folded into q_norm gain
    "qwen3moe_functional_grouped_qkv",  # functional forward over a dict, per-kv-group wqkv, sorted expert dispatch
    "qwen3moe_kv_cache_decode",  # token-by-token KV-cache decode, gains stored as g - 1, on-the-fly cos/sin
    "qwen3moe_backbone_head",  # backbone + separate head, positions from the mask, dense (T, E) combine MoE, SDPA
]


# ----------------------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------------------


def _conf(config):
    H = config.hidden_size
    nq = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or H // nq
    rope = getattr(config, "rope_parameters", None) or {}
    assert rope.get("rope_type", "default") == "default", "this port implements plain RoPE only"
    L = config.num_hidden_layers
    only = list(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    moe = [(i not in only) and config.num_experts > 0 and (i + 1) % step == 0 for i in range(L)]
    return dict(
        V=config.vocab_size,
        H=H,
        nq=nq,
        nkv=config.num_key_value_heads,
        hd=hd,
        L=L,
        E=config.num_experts,
        k=config.num_experts_per_tok,
        norm_topk=bool(config.norm_topk_prob),
        eps=config.rms_norm_eps,
        theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        maxpos=config.max_position_embeddings,
        moe=moe,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _linear(w):
    """An nn.Linear (no bias) holding w (out, in)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = _P(w)
    return lin


def _rms(x, g, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if g is None else g * y


def _inv_freq(c):
    hd = c["hd"]
    return 1.0 / (c["theta"] ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids.long()
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)


def _allowed(attention_mask, B, T, device):
    """(B, 1, T, T) boolean: causal and key not padding."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    allowed = causal[None, None].expand(B, 1, T, T)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed


def _additive(attention_mask, B, T, device):
    allowed = _allowed(attention_mask, B, T, device)
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _route_softmax_topk(logits, k, norm):
    p = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(p, k, dim=-1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w, idx


def _hf_gate_up(sd, pre):
    """HF (E, 2I, H) gate_up [gate; up] -> (gate (E, I, H), up (E, I, H)); down (E, H, I)."""
    gu = sd[pre + "mlp.experts.gate_up_proj"].float()
    I = gu.shape[1] // 2
    return gu[:, :I], gu[:, I:], sd[pre + "mlp.experts.down_proj"].float()


# ----------------------------------------------------------------------------------------------------------------
# baseline
# ----------------------------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        self.c = c
        self.is_moe = c["moe"][i]
        self.attn_gain = _P(sd[pre + "input_layernorm.weight"])
        self.ffn_gain = _P(sd[pre + "post_attention_layernorm.weight"])
        wqkv = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]], 0)
        self.wqkv_t = _P(wqkv.t())
        self.q_gain = _P(sd[a + "q_norm.weight"])
        self.k_gain = _P(sd[a + "k_norm.weight"])
        self.wo_t = _P(sd[a + "o_proj.weight"].t())
        if self.is_moe:
            g, u, d = _hf_gate_up(sd, pre)
            self.router_t = _P(sd[pre + "mlp.gate.weight"].t())
            self.w13 = _P(torch.cat([g, u], 1).transpose(1, 2))  # (E, H, 2I)
            self.w2 = _P(d.transpose(1, 2))  # (E, I, H)
        else:
            self.w13 = _P(torch.cat([sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]], 0).t())
            self.w2 = _P(sd[pre + "mlp.down_proj.weight"].t())

    def attn(self, x, cos, sin, mask):
        c = self.c
        B, T, _ = x.shape
        nq, nkv, hd = c["nq"], c["nkv"], c["hd"]
        qkv = x @ self.wqkv_t
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = _rms(q.view(B, T, nq, hd), self.q_gain, c["eps"]).transpose(1, 2)
        k = _rms(k.view(B, T, nkv, hd), self.k_gain, c["eps"]).transpose(1, 2)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        r = nq // nkv
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
        s = (q @ k.transpose(-1, -2)) * (hd**-0.5) + mask
        o = torch.softmax(s, dim=-1) @ v
        return o.transpose(1, 2).reshape(B, T, nq * hd) @ self.wo_t

    def ffn(self, x):
        if not self.is_moe:
            g, u = (x @ self.w13).chunk(2, dim=-1)
            return (F.silu(g) * u) @ self.w2
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        w, idx = _route_softmax_topk(xf @ self.router_t, c["k"], c["norm_topk"])
        out = torch.zeros_like(xf)
        for e in range(c["E"]):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            g, u = (xf[tok] @ self.w13[e]).chunk(2, dim=-1)
            y = (F.silu(g) * u) @ self.w2[e]
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out.view(B, T, H)

    def forward(self, h, cos, sin, mask):
        h = h + self.attn(_rms(h, self.attn_gain, self.c["eps"]), cos, sin, mask)
        return h + self.ffn(_rms(h, self.ffn_gain, self.c["eps"]))


class Qwen3MoeBaseline(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.tok_emb = _P(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList([_Block(sd, c, i) for i in range(c["L"])])
        self.final_gain = _P(sd["model.norm.weight"])
        head = sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"]
        self.head_t = _P(head.t())
        ang = torch.outer(torch.arange(c["maxpos"], dtype=torch.float), _inv_freq(c))
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("cos_table", ang.cos(), persistent=False)
        self.register_buffer("sin_table", ang.sin(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        pos = _positions(input_ids, position_ids)
        cos, sin = self.cos_table[pos][:, None], self.sin_table[pos][:, None]
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = self.tok_emb[input_ids]
        for blk in self.blocks:
            h = blk(h, cos, sin, mask)
        return (_rms(h, self.final_gain, self.c["eps"]) @ self.head_t).float()


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_meta_complex_rope
# ----------------------------------------------------------------------------------------------------------------


def _to_meta_rows(w, n_heads, hd):
    """HF rotate-half rows (i, i + d/2) -> Meta interleaved rows (2i, 2i + 1) per head (llama.cpp permute, inverted)."""
    shape = w.shape
    return w.reshape(n_heads, 2, hd // 2, *shape[1:]).transpose(1, 2).reshape(shape)


class _MetaAttention(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        nq, nkv, hd = c["nq"], c["nkv"], c["hd"]
        self.wq = nn.Linear(c["H"], nq * hd, bias=False)
        self.wk = nn.Linear(c["H"], nkv * hd, bias=False)
        self.wv = nn.Linear(c["H"], nkv * hd, bias=False)
        self.wo = nn.Linear(nq * hd, c["H"], bias=False)
        with torch.no_grad():
            self.wq.weight.copy_(_to_meta_rows(sd[a + "q_proj.weight"].float(), nq, hd))
            self.wk.weight.copy_(_to_meta_rows(sd[a + "k_proj.weight"].float(), nkv, hd))
            self.wv.weight.copy_(sd[a + "v_proj.weight"])
            self.wo.weight.copy_(sd[a + "o_proj.weight"])
        self.q_norm = _P(_to_meta_rows(sd[a + "q_norm.weight"].float(), 1, hd))
        self.k_norm = _P(_to_meta_rows(sd[a + "k_norm.weight"].float(), 1, hd))

    def forward(self, x, freqs_cis, mask):
        c = self.c
        B, T, _ = x.shape
        nq, nkv, hd = c["nq"], c["nkv"], c["hd"]
        q = _rms(self.wq(x).view(B, T, nq, hd), self.q_norm, c["eps"])
        k = _rms(self.wk(x).view(B, T, nkv, hd), self.k_norm, c["eps"])
        v = self.wv(x).view(B, T, nkv, hd)
        fc = freqs_cis[:, :, None, :]  # (B, T, 1, hd/2)
        q = torch.view_as_real(torch.view_as_complex(q.float().reshape(B, T, nq, hd // 2, 2)) * fc).flatten(3)
        k = torch.view_as_real(torch.view_as_complex(k.float().reshape(B, T, nkv, hd // 2, 2)) * fc).flatten(3)
        r = nq // nkv
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k[:, :, None].expand(B, nkv, r, T, hd).reshape(B, nq, T, hd)
        v = v[:, :, None].expand(B, nkv, r, T, hd).reshape(B, nq, T, hd)
        s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd) + mask
        o = torch.matmul(torch.softmax(s.float(), dim=-1), v)
        return self.wo(o.transpose(1, 2).reshape(B, T, nq * hd))


class _MetaFFN(nn.Module):
    """Mixtral-style names: per-expert w1 (gate), w3 (up), w2 (down) in nn.Linear orientation, stacked 3-D."""

    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        self.is_moe = c["moe"][i]
        if self.is_moe:
            g, u, d = _hf_gate_up(sd, pre)
            self.gate = nn.Linear(c["H"], c["E"], bias=False)
            with torch.no_grad():
                self.gate.weight.copy_(sd[pre + "mlp.gate.weight"])
            self.w1, self.w3, self.w2 = _P(g), _P(u), _P(d)
        else:
            self.w1 = _P(sd[pre + "mlp.gate_proj.weight"])
            self.w3 = _P(sd[pre + "mlp.up_proj.weight"])
            self.w2 = _P(sd[pre + "mlp.down_proj.weight"])

    def forward(self, x):
        if not self.is_moe:
            return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        w, idx = _route_softmax_topk(self.gate(xf), c["k"], c["norm_topk"])
        out = torch.zeros_like(xf)
        for e in range(c["E"]):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                xe = xf[tok]
                y = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
                out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
        return out.view(B, T, H)


class _MetaLayer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.attention_norm = _P(sd[f"model.layers.{i}.input_layernorm.weight"])
        self.ffn_norm = _P(sd[f"model.layers.{i}.post_attention_layernorm.weight"])
        self.attention = _MetaAttention(sd, c, i)
        self.feed_forward = _MetaFFN(sd, c, i)

    def forward(self, h, freqs_cis, mask):
        h = h + self.attention(_rms(h, self.attention_norm, self.c["eps"]), freqs_cis, mask)
        return h + self.feed_forward(_rms(h, self.ffn_norm, self.c["eps"]))


class Qwen3MoeMeta(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c["V"], c["H"])
        with torch.no_grad():
            self.tok_embeddings.weight.copy_(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList([_MetaLayer(sd, c, i) for i in range(c["L"])])
        self.norm = _P(sd["model.norm.weight"])
        self.output = nn.Linear(c["H"], c["V"], bias=False)
        with torch.no_grad():
            self.output.weight.copy_(sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"])
        ang = torch.outer(torch.arange(c["maxpos"], dtype=torch.float), _inv_freq(c))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        fc = self.freqs_cis[_positions(input_ids, position_ids)]
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, fc, mask)
        return self.output(_rms(h, self.norm, self.c["eps"])).float()


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_heads_axis_einsum
# ----------------------------------------------------------------------------------------------------------------


class _HeadsAttention(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        nq, nkv, hd, H = c["nq"], c["nkv"], c["hd"], c["H"]
        self.w_q = _P(sd[a + "q_proj.weight"].reshape(nq, hd, H))
        self.w_k = _P(sd[a + "k_proj.weight"].reshape(nkv, hd, H))
        self.w_v = _P(sd[a + "v_proj.weight"].reshape(nkv, hd, H))
        self.w_o = _P(sd[a + "o_proj.weight"].reshape(H, nq, hd).permute(1, 2, 0))  # (heads, head_dim, hidden)
        self.g_q = _P(sd[a + "q_norm.weight"])
        self.g_k = _P(sd[a + "k_norm.weight"])

    def forward(self, x, cos, sin, allowed):
        c = self.c
        B, T, _ = x.shape
        nq, nkv, hd = c["nq"], c["nkv"], c["hd"]
        r = nq // nkv
        q = _rms(torch.einsum("bth,ndh->bntd", x, self.w_q), self.g_q, c["eps"])
        k = _rms(torch.einsum("bth,ndh->bntd", x, self.w_k), self.g_k, c["eps"])
        v = torch.einsum("bth,ndh->bntd", x, self.w_v)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q = q.view(B, nkv, r, T, hd)  # query head h = g * r + j uses kv head g
        k = k[:, :, None].expand(B, nkv, r, T, hd)
        v = v[:, :, None].expand(B, nkv, r, T, hd)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, :, None])
        return torch.einsum("bgrtd,grdh->bth", o, self.w_o.view(nkv, r, hd, -1))


class _HeadsMoE(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        self.is_moe = c["moe"][i]
        if self.is_moe:
            g, u, d = _hf_gate_up(sd, pre)
            self.router = _P(sd[pre + "mlp.gate.weight"])  # (E, H)
            self.gate_proj = _P(g.transpose(1, 2))  # (E, H, I)
            self.up_proj = _P(u.transpose(1, 2))
            self.down_proj = _P(d.transpose(1, 2))  # (E, I, H)
        else:
            self.gate_proj = _P(sd[pre + "mlp.gate_proj.weight"].t())
            self.up_proj = _P(sd[pre + "mlp.up_proj.weight"].t())
            self.down_proj = _P(sd[pre + "mlp.down_proj.weight"].t())

    def forward(self, x):
        if not self.is_moe:
            return torch.einsum("bti,ih->bth", F.silu(x @ self.gate_proj) * (x @ self.up_proj), self.down_proj)
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        w, idx = _route_softmax_topk(torch.einsum("th,eh->te", xf, self.router), c["k"], c["norm_topk"])
        out = torch.zeros_like(xf)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            xe = xf[tok]
            y = torch.einsum("ni,ih->nh", F.silu(xe @ self.gate_proj[e]) * (xe @ self.up_proj[e]), self.down_proj[e])
            out.index_add_(0, tok, y * w[tok, slot][:, None])
        return out.view(B, T, H)


class _HeadsLayer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.pre_attn_norm = _P(sd[f"model.layers.{i}.input_layernorm.weight"])
        self.pre_mlp_norm = _P(sd[f"model.layers.{i}.post_attention_layernorm.weight"])
        self.mha = _HeadsAttention(sd, c, i)
        self.moe = _HeadsMoE(sd, c, i)

    def forward(self, h, cos, sin, allowed):
        h = h + self.mha(_rms(h, self.pre_attn_norm, self.c["eps"]), cos, sin, allowed)
        return h + self.moe(_rms(h, self.pre_mlp_norm, self.c["eps"]))


class Qwen3MoeHeads(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embedding = _P(sd["model.embed_tokens.weight"])
        self.decoder = nn.ModuleList([_HeadsLayer(sd, c, i) for i in range(c["L"])])
        self.out_norm = _P(sd["model.norm.weight"])
        self.unembed = _P((sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"]).t())  # (H, V)
        ang = torch.outer(torch.arange(c["maxpos"], dtype=torch.float), _inv_freq(c))
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        pos = _positions(input_ids, position_ids)
        cos, sin = self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]
        allowed = _allowed(attention_mask, B, T, input_ids.device)
        allowed = allowed | torch.eye(T, dtype=torch.bool, device=input_ids.device)  # never an empty row
        h = F.embedding(input_ids, self.embedding)
        for layer in self.decoder:
            h = layer(h, cos, sin, allowed)
        return torch.einsum("bth,hv->btv", _rms(h, self.out_norm, self.c["eps"]), self.unembed).float()


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_expert_gather_interleaved
# ----------------------------------------------------------------------------------------------------------------


class _GatherExperts(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        g, u, d = _hf_gate_up(sd, pre)
        E, I, H = g.shape
        self.router_w = _P(sd[pre + "mlp.gate.weight"].t())  # (H, E)
        self.gate_up = _P(torch.stack([g, u], dim=2).reshape(E, 2 * I, H).transpose(1, 2))  # (E, H, 2I) interleaved
        self.down = _P(d.transpose(1, 2))  # (E, I, H)

    def forward(self, x):
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        logits = xf @ self.router_w
        if c["norm_topk"]:
            top, idx = torch.topk(logits, c["k"], dim=-1)
            w = torch.softmax(top.float(), dim=-1)
        else:
            w, idx = _route_softmax_topk(logits, c["k"], False)
        hgu = torch.einsum("th,tkhf->tkf", xf, self.gate_up[idx])  # (T, k, 2I)
        act = F.silu(hgu[..., 0::2]) * hgu[..., 1::2]
        y = torch.einsum("tki,tkih->tkh", act, self.down[idx])
        return (y * w[..., None]).sum(1).view(B, T, H)


class _GatherDense(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}.mlp."
        g, u = sd[pre + "gate_proj.weight"].float(), sd[pre + "up_proj.weight"].float()
        self.gate_up = _P(torch.stack([g, u], dim=1).reshape(-1, g.shape[1]).t())  # interleaved (H, 2I)
        self.down = _P(sd[pre + "down_proj.weight"].t())

    def forward(self, x):
        hgu = x @ self.gate_up
        return (F.silu(hgu[..., 0::2]) * hgu[..., 1::2]) @ self.down


class _GatherLayer(_Block):
    def __init__(self, sd, c, i):
        super().__init__(sd, c, i)
        del self.w13, self.w2
        if hasattr(self, "router_t"):
            del self.router_t
        self.mlp = _GatherExperts(sd, c, i) if c["moe"][i] else _GatherDense(sd, c, i)

    def ffn(self, x):
        return self.mlp(x)


class Qwen3MoeGather(Qwen3MoeBaseline):
    def __init__(self, sd, c):
        super().__init__(sd, c)
        self.blocks = nn.ModuleList([_GatherLayer(sd, c, i) for i in range(c["L"])])


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_stacked_layers
# ----------------------------------------------------------------------------------------------------------------


class Qwen3MoeStacked(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        L = c["L"]
        lay = [f"model.layers.{i}." for i in range(L)]
        moe_ids = [i for i in range(L) if c["moe"][i]]
        dense_ids = [i for i in range(L) if not c["moe"][i]]
        self.slot = [moe_ids.index(i) if c["moe"][i] else dense_ids.index(i) for i in range(L)]

        def stack(fmt, ids=range(L), f=lambda t: t):
            return _P(torch.stack([f(sd[lay[i] + fmt].float()) for i in ids]))

        p = {
            "attn_norm": stack("input_layernorm.weight"),
            "mlp_norm": stack("post_attention_layernorm.weight"),
            "wq": stack("self_attn.q_proj.weight", f=lambda t: t.t()),
            "wk": stack("self_attn.k_proj.weight", f=lambda t: t.t()),
            "wv": stack("self_attn.v_proj.weight", f=lambda t: t.t()),
            "wo": stack("self_attn.o_proj.weight", f=lambda t: t.t()),
            "q_norm": stack("self_attn.q_norm.weight"),
            "k_norm": stack("self_attn.k_norm.weight"),
            "embed": _P(sd["model.embed_tokens.weight"]),
            "final_norm": _P(sd["model.norm.weight"]),
            "lm_head": _P(sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"]),
        }
        if moe_ids:
            g = [_hf_gate_up(sd, lay[i]) for i in moe_ids]
            p["router"] = stack("mlp.gate.weight", moe_ids, lambda t: t.t())  # (Lm, H, E)
            p["w1"] = _P(torch.stack([t[0].transpose(1, 2) for t in g]))  # (Lm, E, H, I)
            p["w3"] = _P(torch.stack([t[1].transpose(1, 2) for t in g]))
            p["w2"] = _P(torch.stack([t[2].transpose(1, 2) for t in g]))  # (Lm, E, I, H)
        if dense_ids:
            p["dense_w1"] = stack("mlp.gate_proj.weight", dense_ids, lambda t: t.t())
            p["dense_w3"] = stack("mlp.up_proj.weight", dense_ids, lambda t: t.t())
            p["dense_w2"] = stack("mlp.down_proj.weight", dense_ids, lambda t: t.t())
        for v in p.values():
            v.requires_grad_(False)
        self.params = nn.ParameterDict(p)
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c, p = self.c, self.params
        B, T = input_ids.shape
        nq, nkv, hd, eps = c["nq"], c["nkv"], c["hd"], c["eps"]
        r = nq // nkv
        ang = _positions(input_ids, position_ids).float()[..., None] * self.inv_freq
        ang = torch.cat([ang, ang], -1)[:, None]
        cos, sin = ang.cos(), ang.sin()
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = p["embed"][input_ids]
        for l in range(c["L"]):
            x = _rms(h, p["attn_norm"][l], eps)
            q = _rms((x @ p["wq"][l]).view(B, T, nq, hd), p["q_norm"][l], eps).transpose(1, 2)
            k = _rms((x @ p["wk"][l]).view(B, T, nkv, hd), p["k_norm"][l], eps).transpose(1, 2)
            v = (x @ p["wv"][l]).view(B, T, nkv, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
            a = torch.softmax(q @ k.transpose(-1, -2) * hd**-0.5 + mask, -1) @ v
            h = h + a.transpose(1, 2).reshape(B, T, -1) @ p["wo"][l]
            x = _rms(h, p["mlp_norm"][l], eps)
            s = self.slot[l]
            if c["moe"][l]:
                xf = x.reshape(B * T, -1)
                w, idx = _route_softmax_topk(xf @ p["router"][s], c["k"], c["norm_topk"])
                y = torch.zeros_like(xf)
                for e in range(c["E"]):
                    tok, slot = torch.where(idx == e)
                    if len(tok):
                        xe = xf[tok]
                        ye = (F.silu(xe @ p["w1"][s, e]) * (xe @ p["w3"][s, e])) @ p["w2"][s, e]
                        y.index_add_(0, tok, ye * w[tok, slot, None])
                h = h + y.view(B, T, -1)
            else:
                h = h + (F.silu(x @ p["dense_w1"][s]) * (x @ p["dense_w3"][s])) @ p["dense_w2"][s]
        return F.linear(_rms(h, p["final_norm"], eps), p["lm_head"]).float()


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_folded_gains
# ----------------------------------------------------------------------------------------------------------------


class _FoldedBlock(_Block):
    def __init__(self, sd, c, i):
        super().__init__(sd, c, i)
        pre = f"model.layers.{i}."
        g_in = sd[pre + "input_layernorm.weight"].float()
        g_post = sd[pre + "post_attention_layernorm.weight"].float()
        del self.attn_gain, self.ffn_gain
        with torch.no_grad():
            self.wqkv_t.mul_(g_in[:, None])  # (H, out): scale input rows
            self.q_gain.mul_(c["hd"] ** -0.5)  # attention scale carried by the q_norm gain
            self.w13.mul_(g_post[:, None])  # (E, H, 2I) or (H, 2I)
            if self.is_moe:
                self.router_t.mul_(g_post[:, None])

    def attn(self, x, cos, sin, mask):
        c = self.c
        B, T, _ = x.shape
        nq, nkv, hd = c["nq"], c["nkv"], c["hd"]
        q, k, v = (x @ self.wqkv_t).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = _rms(q.view(B, T, nq, hd), self.q_gain, c["eps"]).transpose(1, 2)
        k = _rms(k.view(B, T, nkv, hd), self.k_gain, c["eps"]).transpose(1, 2)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        r = nq // nkv
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        o = torch.softmax(q @ k.transpose(-1, -2) + mask, dim=-1) @ v  # no scale: folded into q_gain
        return o.transpose(1, 2).reshape(B, T, nq * hd) @ self.wo_t

    def forward(self, h, cos, sin, mask):
        h = h + self.attn(_rms(h, None, self.c["eps"]), cos, sin, mask)
        return h + self.ffn(_rms(h, None, self.c["eps"]))


class Qwen3MoeFolded(Qwen3MoeBaseline):
    def __init__(self, sd, c):
        super().__init__(sd, c)
        self.blocks = nn.ModuleList([_FoldedBlock(sd, c, i) for i in range(c["L"])])
        with torch.no_grad():
            self.head_t.mul_(self.final_gain[:, None])
        del self.final_gain

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        pos = _positions(input_ids, position_ids)
        cos, sin = self.cos_table[pos][:, None], self.sin_table[pos][:, None]
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = self.tok_emb[input_ids]
        for blk in self.blocks:
            h = blk(h, cos, sin, mask)
        return (_rms(h, None, self.c["eps"]) @ self.head_t).float()


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_functional_grouped_qkv
# ----------------------------------------------------------------------------------------------------------------


def _functional_forward(p, c, inv_freq, input_ids, attention_mask, position_ids):
    B, T = input_ids.shape
    nq, nkv, hd, eps = c["nq"], c["nkv"], c["hd"], c["eps"]
    r = nq // nkv
    ang = _positions(input_ids, position_ids).float()[..., None] * inv_freq
    ang = torch.cat([ang, ang], -1)[:, :, None]  # (B, T, 1, hd)
    cos, sin = ang.cos(), ang.sin()
    allowed = _allowed(attention_mask, B, T, input_ids.device)
    neg = torch.tensor(torch.finfo(torch.float32).min, device=input_ids.device)
    h = F.embedding(input_ids, p["tok_embeddings"])
    for l in range(c["L"]):
        x = _rms(h, p[f"l{l}_ln1"], eps)
        qkv = F.linear(x, p[f"l{l}_wqkv"]).view(B, T, nkv, r + 2, hd)
        q = qkv[:, :, :, :r].reshape(B, T, nq, hd)
        k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
        q = _rms(q, p[f"l{l}_qn"], eps)
        k = _rms(k, p[f"l{l}_kn"], eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        s = torch.where(allowed, torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd), neg)
        a = torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32), v)
        h = h + F.linear(a.transpose(1, 2).reshape(B, T, nq * hd), p[f"l{l}_wo"])
        x = _rms(h, p[f"l{l}_ln2"], eps)
        if c["moe"][l]:
            xf = x.reshape(B * T, -1)
            w, idx = _route_softmax_topk(F.linear(xf, p[f"l{l}_router"]), c["k"], c["norm_topk"])
            flat_e = idx.reshape(-1)
            order = torch.argsort(flat_e, stable=True)
            tok = order // c["k"]
            wts = w.reshape(-1)[order]
            counts = torch.bincount(flat_e, minlength=c["E"]).tolist()
            xs = xf[tok]
            outs = []
            for e, (xe, n) in enumerate(zip(xs.split(counts), counts)):
                if n == 0:
                    outs.append(xe.new_zeros(0, xf.shape[1]))
                    continue
                gu = F.linear(xe, p[f"l{l}_experts_w13"][e])
                g, u = gu.chunk(2, dim=-1)
                outs.append(F.linear(F.silu(g) * u, p[f"l{l}_experts_w2"][e]))
            y = torch.zeros_like(xf).index_add_(0, tok, torch.cat(outs) * wts[:, None])
            h = h + y.view(B, T, -1)
        else:
            g, u = F.linear(x, p[f"l{l}_w13"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, p[f"l{l}_w2"])
    return F.linear(_rms(h, p["norm"], eps), p["output"]).float()


class Qwen3MoeFunctional(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        nq, nkv, hd, H = c["nq"], c["nkv"], c["hd"], c["H"]
        r = nq // nkv
        p = {"tok_embeddings": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
        p["output"] = sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"]
        for l in range(c["L"]):
            pre = f"model.layers.{l}."
            a = pre + "self_attn."
            q = sd[a + "q_proj.weight"].reshape(nkv, r, hd, H)
            k = sd[a + "k_proj.weight"].reshape(nkv, 1, hd, H)
            v = sd[a + "v_proj.weight"].reshape(nkv, 1, hd, H)
            p[f"l{l}_wqkv"] = torch.cat([q, k, v], 1).reshape(-1, H)
            p[f"l{l}_wo"] = sd[a + "o_proj.weight"]
            p[f"l{l}_qn"] = sd[a + "q_norm.weight"]
            p[f"l{l}_kn"] = sd[a + "k_norm.weight"]
            p[f"l{l}_ln1"] = sd[pre + "input_layernorm.weight"]
            p[f"l{l}_ln2"] = sd[pre + "post_attention_layernorm.weight"]
            if c["moe"][l]:
                p[f"l{l}_router"] = sd[pre + "mlp.gate.weight"]
                p[f"l{l}_experts_w13"] = sd[pre + "mlp.experts.gate_up_proj"]  # (E, 2I, H)
                p[f"l{l}_experts_w2"] = sd[pre + "mlp.experts.down_proj"]  # (E, H, I)
            else:
                p[f"l{l}_w13"] = torch.cat([sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]])
                p[f"l{l}_w2"] = sd[pre + "mlp.down_proj.weight"]
        self.weights = nn.ParameterDict({n: _P(t) for n, t in p.items()})
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return _functional_forward(self.weights, self.c, self.inv_freq, input_ids, attention_mask, position_ids)


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_kv_cache_decode
# ----------------------------------------------------------------------------------------------------------------


class _OffsetRMSNorm(nn.Module):
    """Gain stored as (g - 1), applied as (1 + w) * x_hat."""

    def __init__(self, g, eps):
        super().__init__()
        self.weight = _P(g.float() - 1.0)
        self.eps = eps

    def forward(self, x):
        return (1.0 + self.weight) * _rms(x, None, self.eps)


class _CachedAttention(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        self.q_proj = _P(sd[a + "q_proj.weight"].t())
        self.kv_proj = _P(torch.cat([sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]).t())
        self.o_proj = _P(sd[a + "o_proj.weight"].t())
        self.q_norm = _OffsetRMSNorm(sd[a + "q_norm.weight"], c["eps"])
        self.k_norm = _OffsetRMSNorm(sd[a + "k_norm.weight"], c["eps"])

    def step(self, x, cos, sin, cache_k, cache_v, t, key_ok):
        """x (B, H) for token t; cache_k/v (B, nkv, Tmax, hd) written at t; key_ok (B, t + 1)."""
        c = self.c
        B = x.shape[0]
        nq, nkv, hd = c["nq"], c["nkv"], c["hd"]
        q = self.q_norm((x @ self.q_proj).view(B, nq, hd))
        k, v = (x @ self.kv_proj).view(B, 2, nkv, hd).unbind(1)
        k = self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache_k[:, :, t] = k
        cache_v[:, :, t] = v
        K, Vv = cache_k[:, :, : t + 1], cache_v[:, :, : t + 1]  # (B, nkv, t+1, hd)
        r = nq // nkv
        qg = q.view(B, nkv, r, hd)
        s = torch.einsum("bgrd,bgsd->bgrs", qg, K) * hd**-0.5
        s = s.masked_fill(~key_ok[:, None, None, :], torch.finfo(torch.float32).min)
        o = torch.einsum("bgrs,bgsd->bgrd", torch.softmax(s, -1), Vv)
        return o.reshape(B, nq * hd) @ self.o_proj


class _TokenMoE(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        self.is_moe = c["moe"][i]
        if self.is_moe:
            g, u, d = _hf_gate_up(sd, pre)
            self.router = _P(sd[pre + "mlp.gate.weight"].t())
            self.experts_gate = _P(g.transpose(1, 2))  # (E, H, I)
            self.experts_up = _P(u.transpose(1, 2))
            self.experts_down = _P(d.transpose(1, 2))  # (E, I, H)
        else:
            self.experts_gate = _P(sd[pre + "mlp.gate_proj.weight"].t())
            self.experts_up = _P(sd[pre + "mlp.up_proj.weight"].t())
            self.experts_down = _P(sd[pre + "mlp.down_proj.weight"].t())

    def forward(self, x):  # x (B, H): one token per row
        if not self.is_moe:
            return (F.silu(x @ self.experts_gate) * (x @ self.experts_up)) @ self.experts_down
        w, idx = _route_softmax_topk(x @ self.router, self.c["k"], self.c["norm_topk"])
        out = torch.zeros_like(x)
        for b in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[b, j])
                xb = x[b]
                y = (F.silu(xb @ self.experts_gate[e]) * (xb @ self.experts_up[e])) @ self.experts_down[e]
                out[b] += w[b, j] * y
        return out


class _CachedLayer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.ln_1 = _OffsetRMSNorm(sd[f"model.layers.{i}.input_layernorm.weight"], c["eps"])
        self.ln_2 = _OffsetRMSNorm(sd[f"model.layers.{i}.post_attention_layernorm.weight"], c["eps"])
        self.attn = _CachedAttention(sd, c, i)
        self.mlp = _TokenMoE(sd, c, i)


class Qwen3MoeCached(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.wte = _P(sd["model.embed_tokens.weight"])
        self.h = nn.ModuleList([_CachedLayer(sd, c, i) for i in range(c["L"])])
        self.ln_f = _OffsetRMSNorm(sd["model.norm.weight"], c["eps"])
        self.lm_head = _P((sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"]).t())
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        B, T = input_ids.shape
        if position_ids is None and attention_mask is not None:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            pos = _positions(input_ids, position_ids)
        valid = (
            torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
            if attention_mask is None
            else attention_mask.bool()
        )
        caches = [
            (self.wte.new_zeros(B, c["nkv"], T, c["hd"]), self.wte.new_zeros(B, c["nkv"], T, c["hd"]))
            for _ in range(c["L"])
        ]
        logits = []
        for t in range(T):
            ang = pos[:, t].float()[:, None] * self.inv_freq  # (B, hd/2)
            ang = torch.cat([ang, ang], -1)[:, None]  # (B, 1, hd)
            cos, sin = ang.cos(), ang.sin()
            x = self.wte[input_ids[:, t]]
            for l, layer in enumerate(self.h):
                ck, cv = caches[l]
                x = x + layer.attn.step(layer.ln_1(x), cos, sin, ck, cv, t, valid[:, : t + 1])
                x = x + layer.mlp(layer.ln_2(x))
            logits.append(self.ln_f(x) @ self.lm_head)
        return torch.stack(logits, 1).float()


# ----------------------------------------------------------------------------------------------------------------
# qwen3moe_backbone_head
# ----------------------------------------------------------------------------------------------------------------


class _BBAttention(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.c = c
        names = (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("dense", "o_proj"))
        self.proj = nn.ModuleDict({n: _linear(sd[a + hf + ".weight"]) for n, hf in names})
        self.norms = nn.ParameterDict({"query": _P(sd[a + "q_norm.weight"]), "key": _P(sd[a + "k_norm.weight"])})
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)

    def forward(self, x, pos, mask):
        c = self.c
        B, T, _ = x.shape
        nq, nkv, hd = c["nq"], c["nkv"], c["hd"]
        q = _rms(self.proj["query"](x).unflatten(-1, (nq, hd)), self.norms["query"], c["eps"]).transpose(1, 2)
        k = _rms(self.proj["key"](x).unflatten(-1, (nkv, hd)), self.norms["key"], c["eps"]).transpose(1, 2)
        v = self.proj["value"](x).unflatten(-1, (nkv, hd)).transpose(1, 2)
        f = pos[:, None, :, None].float() * self.inv_freq  # (B, 1, T, hd/2)
        cos, sin = f.cos(), f.sin()
        q1, q2 = q.chunk(2, -1)
        k1, k2 = k.chunk(2, -1)
        q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)
        k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1)
        r = nq // nkv
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)
        return self.proj["dense"](o.transpose(1, 2).flatten(2))


class _BBDenseMoE(nn.Module):
    """All experts on all tokens; routing weights scattered into a (T, E) combine matrix (zeros elsewhere)."""

    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}."
        self.c = c
        g, u, d = _hf_gate_up(sd, pre)
        self.router = _linear(sd[pre + "mlp.gate.weight"])
        self.experts = nn.ParameterDict({"gate": _P(g), "up": _P(u), "down": _P(d)})  # (E,I,H),(E,I,H),(E,H,I)

    def forward(self, x):
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        w, idx = _route_softmax_topk(self.router(xf), c["k"], c["norm_topk"])
        combine = xf.new_zeros(xf.shape[0], c["E"]).scatter(1, idx, w)  # (T, E)
        ex = self.experts
        hid = F.silu(torch.einsum("th,eih->tei", xf, ex["gate"])) * torch.einsum("th,eih->tei", xf, ex["up"])
        y = torch.einsum("tei,ehi->teh", hid, ex["down"])
        return torch.einsum("teh,te->th", y, combine).view(B, T, H)


class _BBMLP(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        pre = f"model.layers.{i}.mlp."
        self.fc = nn.ModuleDict({n: _linear(sd[pre + n + "_proj.weight"]) for n in ("gate", "up", "down")})

    def forward(self, x):
        return self.fc["down"](F.silu(self.fc["gate"](x)) * self.fc["up"](x))


class _BBLayer(nn.Module):
    def __init__(self, sd, c, i):
        super().__init__()
        self.c = c
        self.norms = nn.ParameterDict(
            {
                "attn": _P(sd[f"model.layers.{i}.input_layernorm.weight"]),
                "ffn": _P(sd[f"model.layers.{i}.post_attention_layernorm.weight"]),
            }
        )
        self.mixers = nn.ModuleDict(
            {"attn": _BBAttention(sd, c, i), "ffn": _BBDenseMoE(sd, c, i) if c["moe"][i] else _BBMLP(sd, c, i)}
        )

    def forward(self, h, pos, mask):
        h = h + self.mixers["attn"](_rms(h, self.norms["attn"], self.c["eps"]), pos, mask)
        return h + self.mixers["ffn"](_rms(h, self.norms["ffn"], self.c["eps"]))


class _Backbone(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["V"], c["H"], _weight=_P(sd["model.embed_tokens.weight"]))
        self.layers = nn.ModuleDict({str(i): _BBLayer(sd, c, i) for i in range(c["L"])})
        self.ln_out = _P(sd["model.norm.weight"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if attention_mask is not None:  # as generation builds them: padding at 1
            pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        else:
            pos = _positions(input_ids, position_ids)
        mask = _additive(attention_mask, B, T, input_ids.device)
        h = self.embed(input_ids)
        for i in range(self.c["L"]):
            h = self.layers[str(i)](h, pos, mask)
        return _rms(h, self.ln_out, self.c["eps"])


class _LMHead(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = _P(w)

    def forward(self, h):
        return F.linear(h, self.weight).float()


class Qwen3MoeBackboneHead(nn.Module):
    def __init__(self, sd, c):
        super().__init__()
        self.backbone = _Backbone(sd, c)
        self.head = _LMHead(sd["model.embed_tokens.weight"] if c["tied"] else sd["lm_head.weight"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.backbone(input_ids, attention_mask, position_ids))


# ----------------------------------------------------------------------------------------------------------------


_VARIANTS = {
    "": Qwen3MoeBaseline,
    "qwen3moe_meta_complex_rope": Qwen3MoeMeta,
    "qwen3moe_heads_axis_einsum": Qwen3MoeHeads,
    "qwen3moe_expert_gather_interleaved": Qwen3MoeGather,
    "qwen3moe_stacked_layers": Qwen3MoeStacked,
    "qwen3moe_folded_gains": Qwen3MoeFolded,
    "qwen3moe_functional_grouped_qkv": Qwen3MoeFunctional,
    "qwen3moe_kv_cache_decode": Qwen3MoeCached,
    "qwen3moe_backbone_head": Qwen3MoeBackboneHead,
}


def build(state_dict, config):
    if BUG not in _VARIANTS:
        raise ValueError(f"unknown layout variant {BUG!r}")
    c = _conf(config)
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    with torch.no_grad():
        model = _VARIANTS[BUG](sd, c)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
