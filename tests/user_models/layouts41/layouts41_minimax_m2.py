"""Hand-written plain-PyTorch port of MiniMax-M2 (MiniMaxM2ForCausalLM).

Architecture as this port implements it:
- token embedding (no scaling), untied LM head, final RMSNorm.
- block i, pre-norm:  h = h + Attn(RMSNorm(h));  h = h + MoE(RMSNorm(h)).
- Attn: GQA (n_q heads, n_kv heads, head_dim d); q_norm / k_norm are RMSNorms over the WHOLE q (n_q * d) /
  k (n_kv * d) projection (not per head), applied before RoPE; partial RoPE on the first rotary_dim dims of every
  head (rotate-half pairing (i, i + r/2) in Transformers' layout); scale d^-0.5; causal + padding mask.
- MoE: router logits = W_r x; s = sigmoid(logits); the top-k experts are chosen on s + e_score_correction_bias, and
  weighted by s (the bias-free scores) renormalised to sum 1 over the chosen; each expert is SwiGLU
  down(silu(gate x) * up x).
- positions: position_ids if given, else 0..T-1.

Layouts (BUG selects one; every one is a correct port):
- baseline "": own module tree (tok_emb / blocks[i].attn / blocks[i].moe / head_t); q|k|v fused into one
  transposed matrix wqkv (H, (n_q + 2 n_kv) d) applied as x @ W; o transposed (n_q d, H); router transposed
  (H, E); experts stored transposed as (E, H, 2I) [gate | up] and (E, I, H), all experts computed densely with
  einsum and mixed by a dense (tokens, E) combine matrix (zero for unchosen experts); head transposed (H, V);
  explicit softmax attention with an additive float mask.
- mm_meta_rope_complex: Meta-style row permutation of q/k (rotary part of each head re-ordered to interleaved
  pairs (2i, 2i+1)), q_norm / k_norm gains permuted the same way, RoPE as complex multiplication by a precomputed
  complex freqs_cis buffer (max_position_embeddings long).
- mm_heads_axis_einsum: q/k/v/o as (heads, head_dim, hidden) tensors applied with einsum; GQA without repeating kv
  (queries reshaped to (kv_heads, group)); q_norm / k_norm gains stored as (heads, head_dim), RMS over both axes;
  boolean mask with masked_fill.
- mm_folded_norms_scale: RMSNorm gains folded into the next matrices (input norm -> wqkv, post-attention norm ->
  router and experts' gate/up, final norm -> head); the attention scale d^-0.5 folded into the q_norm gain.
- mm_stacked_layers: every per-layer weight stacked into one (n_layers, ...) Parameter per kind, indexed in the
  loop; separate wq / wk / wv; experts run by a per-expert loop over the tokens routed to it (index_add).
- mm_gather_interleaved_gu: experts' gate/up interleaved per channel (rows g0, u0, g1, u1, ...) stored (E, H, 2I),
  the chosen experts' weights gathered per token (tokens, k, H, 2I) and applied with einsum; routing weights
  recovered as topk(s + b).values - b[idx].
- mm_sdpa_tables_maskpos: nn.Linear modules in Transformers' (out, in) orientation under own names; cos/sin tables
  precomputed for the whole max length as buffers and indexed by position; positions derived from the attention
  mask (cumsum - 1) when a mask is given; scaled_dot_product_attention with a boolean mask and enable_gqa.
- mm_functional_dict: no submodules: one functional forward reading a plain dict of tensors (flat own names),
  the backbone returning the final hidden states and a separate LMHead module producing the logits.
- mm_megatron_grouped_qkv: Megatron-style GQA fused qkv, rows grouped per kv head [q heads of group g | k_g | v_g]
  in (out, in) orientation; norm gains in nn.ParameterList containers; cos/sin from inv_freq at call time.
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
    "mm_meta_rope_complex",  # Meta row permutation of q/k (+ q/k norm gains), complex freqs_cis RoPE buffer
    "mm_heads_axis_einsum",  # (heads, head_dim, hidden) weights + einsum, grouped GQA without repeat, bool mask
    "mm_folded_norms_scale",  # RMSNorm gains folded into next matrices, attention scale folded into q_norm gain
    "mm_stacked_layers",  # (n_layers, ...) stacked Parameters per kind; experts by per-expert loop + index_add
    "mm_gather_interleaved_gu",  # gate/up interleaved per channel, per-token gather of expert weights
    "mm_sdpa_tables_maskpos",  # SDPA + bool mask + enable_gqa, cos/sin tables buffers, positions from the mask
    "mm_functional_dict",  # plain dict of tensors + one functional forward, separate LM head module
    "mm_megatron_grouped_qkv",  # Megatron per-kv-group [q..|k|v] fused rows, ParameterList norm gains
]


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope_half(x, cos, sin, r):
    """x (b, n, t, d); cos/sin (b, t, r) (duplicated halves); rotates the first r dims."""
    cos, sin = cos[:, None], sin[:, None]
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat((xr * cos + _rotate_half(xr) * sin, xp), dim=-1)


def _positions(ids, attention_mask, position_ids, from_mask=False):
    b, t = ids.shape
    if from_mask and attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if position_ids is not None:
        return position_ids
    return torch.arange(t, device=ids.device)[None].expand(b, t)


def _keep_mask(attention_mask, b, t, device):
    """(b, 1, t, t) bool: causal and key not padding; a query always sees itself (padding rows stay finite)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    keep = causal[None].expand(b, t, t)
    if attention_mask is not None:
        eye = torch.eye(t, dtype=torch.bool, device=device)
        keep = keep & (attention_mask.bool()[:, None, :] | eye)
    return keep[:, None]


class _Cfg:
    def __init__(self, config):
        self.H = config.hidden_size
        self.nq = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or self.H // self.nq
        self.r = int(self.d * config.rope_parameters.get("partial_rotary_factor", 1.0))
        self.L = config.num_hidden_layers
        self.E = config.num_local_experts
        self.k = config.num_experts_per_tok
        self.I = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.maxpos = config.max_position_embeddings
        self.V = config.vocab_size


def _sd(state_dict, i, name):
    return state_dict[f"model.layers.{i}.{name}"].float()


# ----------------------------------------------------------------------------------------------------------------
# module-based port (all variants but the functional one)
# ----------------------------------------------------------------------------------------------------------------


class Attn(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        wq, wk, wv = (
            _sd(sd, i, "self_attn.q_proj.weight"),
            _sd(sd, i, "self_attn.k_proj.weight"),
            _sd(sd, i, "self_attn.v_proj.weight"),
        )
        wo = _sd(sd, i, "self_attn.o_proj.weight")
        gq, gk = _sd(sd, i, "self_attn.q_norm.weight"), _sd(sd, i, "self_attn.k_norm.weight")
        g_in = _sd(sd, i, "input_layernorm.weight")
        d, r = c.d, c.r
        if v == "mm_meta_rope_complex":
            half = r // 2
            perm = torch.tensor([j for p in range(half) for j in (p, p + half)] + list(range(r, d)))

            def permute(w, n):
                return w.view(n, d, -1)[:, perm].reshape(w.shape)

            wq, wk = permute(wq, c.nq), permute(wk, c.nkv)
            gq, gk = permute(gq[:, None], c.nq)[:, 0], permute(gk[:, None], c.nkv)[:, 0]
        if v == "mm_folded_norms_scale":
            gq = gq * d**-0.5
        if v == "mm_heads_axis_einsum":
            self.wq = nn.Parameter(wq.view(c.nq, d, c.H).clone())
            self.wk = nn.Parameter(wk.view(c.nkv, d, c.H).clone())
            self.wv = nn.Parameter(wv.view(c.nkv, d, c.H).clone())
            self.wo = nn.Parameter(wo.view(c.H, c.nq, d).permute(1, 2, 0).contiguous())  # (heads, d, H)
            self.q_gain = nn.Parameter(gq.view(c.nq, d).clone())
            self.k_gain = nn.Parameter(gk.view(c.nkv, d).clone())
        elif v == "mm_sdpa_tables_maskpos":
            self.q = nn.Linear(c.H, c.nq * d, bias=False)
            self.k = nn.Linear(c.H, c.nkv * d, bias=False)
            self.v_ = nn.Linear(c.H, c.nkv * d, bias=False)
            self.o = nn.Linear(c.nq * d, c.H, bias=False)
            for m, w in ((self.q, wq), (self.k, wk), (self.v_, wv), (self.o, wo)):
                m.weight.data.copy_(w)
            self.q_gain = nn.Parameter(gq.clone())
            self.k_gain = nn.Parameter(gk.clone())
        elif v == "mm_megatron_grouped_qkv":
            rep = c.nq // c.nkv
            rows = []
            for g in range(c.nkv):
                rows += [wq[g * rep * d : (g + 1) * rep * d], wk[g * d : (g + 1) * d], wv[g * d : (g + 1) * d]]
            self.query_key_value = nn.Parameter(torch.cat(rows, 0))
            self.dense = nn.Parameter(wo.clone())
            self.gains = nn.ParameterList([nn.Parameter(gq.clone()), nn.Parameter(gk.clone())])
        else:
            if v == "mm_folded_norms_scale":
                wq, wk, wv = wq * g_in, wk * g_in, wv * g_in
            self.wqkv = nn.Parameter(torch.cat([wq, wk, wv], 0).t().contiguous())
            self.wo_t = nn.Parameter(wo.t().contiguous())
            self.q_gain = nn.Parameter(gq.clone())
            self.k_gain = nn.Parameter(gk.clone())
        if v == "mm_meta_rope_complex":
            pos = torch.arange(c.maxpos, dtype=torch.float)
            freqs = torch.outer(pos, _inv_freq_from(c, r))
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        if v == "mm_sdpa_tables_maskpos":
            pos = torch.arange(c.maxpos, dtype=torch.float)
            freqs = torch.outer(pos, _inv_freq_from(c, r))
            emb = torch.cat((freqs, freqs), -1)
            self.register_buffer("cos_table", emb.cos(), persistent=False)
            self.register_buffer("sin_table", emb.sin(), persistent=False)
        if v not in ("mm_meta_rope_complex", "mm_sdpa_tables_maskpos"):
            self.register_buffer("inv_freq", _inv_freq_from(c, r), persistent=False)

    def forward(self, x, pos, keep):
        c, v, d, r = self.c, self.v, self.c.d, self.c.r
        b, t, _ = x.shape
        if v == "mm_heads_axis_einsum":
            q = torch.einsum("bth,ndh->bntd", x, self.wq)
            k = torch.einsum("bth,ndh->bntd", x, self.wk)
            val = torch.einsum("bth,ndh->bntd", x, self.wv)
            q = q * torch.rsqrt(q.pow(2).mean(dim=(1, 3), keepdim=True) + c.eps) * self.q_gain[None, :, None]
            k = k * torch.rsqrt(k.pow(2).mean(dim=(1, 3), keepdim=True) + c.eps) * self.k_gain[None, :, None]
            cos, sin = self._cos_sin(pos)
            q, k = _rope_half(q, cos, sin, r), _rope_half(k, cos, sin, r)
            rep = c.nq // c.nkv
            qg = q.view(b, c.nkv, rep, t, d)
            s = torch.einsum("bgrtd,bgsd->bgrts", qg, k) * d**-0.5
            s = s.masked_fill(~keep[:, :, None], float("-inf"))
            p = s.softmax(-1)
            o = torch.einsum("bgrts,bgsd->bgrtd", p, val).reshape(b, c.nq, t, d)
            return torch.einsum("bntd,ndh->bth", o, self.wo)
        if v == "mm_sdpa_tables_maskpos":
            q, k, val = self.q(x), self.k(x), self.v_(x)
        elif v == "mm_megatron_grouped_qkv":
            rep = c.nq // c.nkv
            mixed = F.linear(x, self.query_key_value).view(b, t, c.nkv, (rep + 2) * d)
            q, k, val = mixed.split([rep * d, d, d], dim=-1)
            q, k, val = q.reshape(b, t, -1), k.reshape(b, t, -1), val.reshape(b, t, -1)
        else:
            q, k, val = (x @ self.wqkv).split([c.nq * d, c.nkv * d, c.nkv * d], dim=-1)
        if v == "mm_megatron_grouped_qkv":
            q, k = _rms(q, c.eps) * self.gains[0], _rms(k, c.eps) * self.gains[1]
        else:
            q, k = _rms(q, c.eps) * self.q_gain, _rms(k, c.eps) * self.k_gain
        q = q.view(b, t, c.nq, d).transpose(1, 2)
        k = k.view(b, t, c.nkv, d).transpose(1, 2)
        val = val.view(b, t, c.nkv, d).transpose(1, 2)
        if v == "mm_meta_rope_complex":
            fc = self.freqs_cis[pos][:, None]  # (b, 1, t, r/2)

            def rot(z):
                zc = torch.view_as_complex(z[..., :r].float().reshape(*z.shape[:-1], r // 2, 2))
                return torch.cat((torch.view_as_real(zc * fc).flatten(-2), z[..., r:]), -1)

            q, k = rot(q), rot(k)
        else:
            cos, sin = self._cos_sin(pos)
            q, k = _rope_half(q, cos, sin, r), _rope_half(k, cos, sin, r)
        if v == "mm_sdpa_tables_maskpos":
            o = F.scaled_dot_product_attention(q, k, val, attn_mask=keep, enable_gqa=True)
            return self.o(o.transpose(1, 2).reshape(b, t, -1))
        rep = c.nq // c.nkv
        k, val = k.repeat_interleave(rep, dim=1), val.repeat_interleave(rep, dim=1)
        s = q @ k.transpose(-1, -2)
        if v != "mm_folded_norms_scale":
            s = s * d**-0.5
        s = s + torch.zeros_like(s).masked_fill(~keep, torch.finfo(s.dtype).min)
        o = (s.softmax(-1) @ val).transpose(1, 2).reshape(b, t, -1)
        if v == "mm_megatron_grouped_qkv":
            return F.linear(o, self.dense)
        return o @ self.wo_t

    def _cos_sin(self, pos):
        if self.v == "mm_sdpa_tables_maskpos":
            return self.cos_table[pos], self.sin_table[pos]
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos(), emb.sin()


def _inv_freq_from(c, r):
    return 1.0 / (c.theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))


def _route(logits, bias, k, recover=False):
    s = torch.sigmoid(logits.float())
    top = torch.topk(s + bias, k, dim=-1, sorted=False)
    idx = top.indices
    w = top.values - bias[idx] if recover else s.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True)


class MoE(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        wr = _sd(sd, i, "mlp.gate.weight")  # (E, H)
        bias = _sd(sd, i, "mlp.e_score_correction_bias")
        gu = _sd(sd, i, "mlp.experts.gate_up_proj")  # (E, 2I, H)
        dn = _sd(sd, i, "mlp.experts.down_proj")  # (E, H, I)
        if v == "mm_folded_norms_scale":
            g = _sd(sd, i, "post_attention_layernorm.weight")
            wr, gu = wr * g, gu * g
        if v == "mm_gather_interleaved_gu":
            gate, up = gu.chunk(2, dim=1)
            gu = torch.stack((gate, up), dim=2).reshape(gu.shape)  # rows g0, u0, g1, u1, ...
        self.router_t = nn.Parameter(wr.t().contiguous())
        self.register_buffer("choice_bias", bias.clone())
        self.w_gate_up = nn.Parameter(gu.transpose(1, 2).contiguous())  # (E, H, 2I)
        self.w_down = nn.Parameter(dn.transpose(1, 2).contiguous())  # (E, I, H)

    def forward(self, x):
        c, v = self.c, self.v
        shape = x.shape
        x = x.reshape(-1, c.H)
        idx, w = _route(x @ self.router_t, self.choice_bias, c.k, recover=v == "mm_gather_interleaved_gu")
        if v == "mm_gather_interleaved_gu":
            gu = torch.einsum("th,tkhf->tkf", x, self.w_gate_up[idx])
            h = F.silu(gu[..., 0::2]) * gu[..., 1::2]
            y = torch.einsum("tki,tkih->tkh", h, self.w_down[idx])
            return (y * w[..., None]).sum(1).view(shape)
        comb = torch.zeros(x.shape[0], c.E, dtype=x.dtype, device=x.device).scatter(1, idx, w.to(x.dtype))
        gu = torch.einsum("th,ehf->etf", x, self.w_gate_up)
        gate, up = gu.chunk(2, dim=-1)
        y = torch.einsum("eti,eih->eth", F.silu(gate) * up, self.w_down)
        return torch.einsum("te,eth->th", comb, y).view(shape)


class Block(nn.Module):
    def __init__(self, sd, i, c, v):
        super().__init__()
        self.c, self.v = c, v
        self.attn = Attn(sd, i, c, v)
        self.moe = MoE(sd, i, c, v)
        if v != "mm_folded_norms_scale":
            if v == "mm_megatron_grouped_qkv":
                self.norms = nn.ParameterList(
                    [
                        nn.Parameter(_sd(sd, i, "input_layernorm.weight").clone()),
                        nn.Parameter(_sd(sd, i, "post_attention_layernorm.weight").clone()),
                    ]
                )
            else:
                self.attn_norm = nn.Parameter(_sd(sd, i, "input_layernorm.weight").clone())
                self.moe_norm = nn.Parameter(_sd(sd, i, "post_attention_layernorm.weight").clone())

    def forward(self, h, pos, keep):
        c, v = self.c, self.v
        if v == "mm_folded_norms_scale":
            g1 = g2 = 1.0
        elif v == "mm_megatron_grouped_qkv":
            g1, g2 = self.norms[0], self.norms[1]
        else:
            g1, g2 = self.attn_norm, self.moe_norm
        h = h + self.attn(_rms(h, c.eps) * g1, pos, keep)
        return h + self.moe(_rms(h, c.eps) * g2)


class MiniMaxM2Port(nn.Module):
    def __init__(self, sd, config, v):
        super().__init__()
        c = self.c = _Cfg(config)
        c.theta = config.rope_parameters["rope_theta"]
        self.v = v
        self.tok_emb = nn.Parameter(sd["model.embed_tokens.weight"].float().clone())
        self.blocks = nn.ModuleList([Block(sd, i, c, v) for i in range(c.L)])
        head = sd["lm_head.weight"].float()
        gf = sd["model.norm.weight"].float()
        if v == "mm_folded_norms_scale":
            head = head * gf
        else:
            self.final_norm = nn.Parameter(gf.clone())
        self.head_t = nn.Parameter(head.t().contiguous())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c, v = self.c, self.v
        b, t = input_ids.shape
        pos = _positions(input_ids, attention_mask, position_ids, from_mask=v == "mm_sdpa_tables_maskpos")
        keep = _keep_mask(attention_mask, b, t, input_ids.device)
        h = self.tok_emb[input_ids]
        for blk in self.blocks:
            h = blk(h, pos, keep)
        h = _rms(h, c.eps)
        if v != "mm_folded_norms_scale":
            h = h * self.final_norm
        return (h @ self.head_t).float()


# ----------------------------------------------------------------------------------------------------------------
# stacked-layers port
# ----------------------------------------------------------------------------------------------------------------


class StackedPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = self.c = _Cfg(config)
        c.theta = config.rope_parameters["rope_theta"]
        L = range(c.L)

        def stack(name, f=lambda w: w):
            return nn.Parameter(torch.stack([f(_sd(sd, i, name)) for i in L]).contiguous())

        self.emb = nn.Parameter(sd["model.embed_tokens.weight"].float().clone())
        self.wq = stack("self_attn.q_proj.weight", lambda w: w.t())  # (L, H, nq d)
        self.wk = stack("self_attn.k_proj.weight", lambda w: w.t())
        self.wv = stack("self_attn.v_proj.weight", lambda w: w.t())
        self.wo = stack("self_attn.o_proj.weight", lambda w: w.t())
        self.q_norm = stack("self_attn.q_norm.weight")
        self.k_norm = stack("self_attn.k_norm.weight")
        self.ln1 = stack("input_layernorm.weight")
        self.ln2 = stack("post_attention_layernorm.weight")
        self.router = stack("mlp.gate.weight")  # (L, E, H)
        self.register_buffer("router_bias", torch.stack([_sd(sd, i, "mlp.e_score_correction_bias") for i in L]))
        self.w13 = stack("mlp.experts.gate_up_proj")  # (L, E, 2I, H)
        self.w2 = stack("mlp.experts.down_proj")  # (L, E, H, I)
        self.ln_f = nn.Parameter(sd["model.norm.weight"].float().clone())
        self.lm_head = nn.Parameter(sd["lm_head.weight"].float().clone())
        self.register_buffer("inv_freq", _inv_freq_from(c, c.r), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        b, t = input_ids.shape
        d, r = c.d, c.r
        pos = _positions(input_ids, attention_mask, position_ids)
        keep = _keep_mask(attention_mask, b, t, input_ids.device)
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        h = F.embedding(input_ids, self.emb)
        for i in range(c.L):
            x = _rms(h, c.eps) * self.ln1[i]
            q = (_rms(x @ self.wq[i], c.eps) * self.q_norm[i]).view(b, t, c.nq, d).transpose(1, 2)
            k = (_rms(x @ self.wk[i], c.eps) * self.k_norm[i]).view(b, t, c.nkv, d).transpose(1, 2)
            val = (x @ self.wv[i]).view(b, t, c.nkv, d).transpose(1, 2)
            q, k = _rope_half(q, cos, sin, r), _rope_half(k, cos, sin, r)
            rep = c.nq // c.nkv
            k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            s = s.masked_fill(~keep, float("-inf"))
            o = (s.softmax(-1) @ val).transpose(1, 2).reshape(b, t, -1)
            h = h + o @ self.wo[i]
            x = (_rms(h, c.eps) * self.ln2[i]).reshape(-1, c.H)
            idx, w = _route(F.linear(x, self.router[i]), self.router_bias[i], c.k)
            y = torch.zeros_like(x)
            for e in range(c.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                gate, up = F.linear(x[tok], self.w13[i, e]).chunk(2, -1)
                out = F.linear(F.silu(gate) * up, self.w2[i, e]) * w[tok, slot, None]
                y.index_add_(0, tok, out)
            h = h + y.view(b, t, c.H)
        h = _rms(h, c.eps) * self.ln_f
        return F.linear(h, self.lm_head).float()


# ----------------------------------------------------------------------------------------------------------------
# functional port: a plain dict of tensors, backbone + separate head module
# ----------------------------------------------------------------------------------------------------------------


def _functional_backbone(p, c, input_ids, attention_mask, position_ids):
    b, t = input_ids.shape
    d, r = c.d, c.r
    pos = _positions(input_ids, attention_mask, position_ids)
    keep = _keep_mask(attention_mask, b, t, input_ids.device)
    add = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    freqs = pos[..., None].float() * p["rope.inv_freq"]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    h = p["tok_embeddings"][input_ids]
    for i in range(c.L):
        x = _rms(h, c.eps) * p[f"l{i}.attention_norm"]
        q = _rms(F.linear(x, p[f"l{i}.wq"]), c.eps) * p[f"l{i}.q_norm"]
        k = _rms(F.linear(x, p[f"l{i}.wk"]), c.eps) * p[f"l{i}.k_norm"]
        val = F.linear(x, p[f"l{i}.wv"])
        q = _rope_half(q.view(b, t, c.nq, d).transpose(1, 2), cos, sin, r)
        k = _rope_half(k.view(b, t, c.nkv, d).transpose(1, 2), cos, sin, r)
        val = val.view(b, t, c.nkv, d).transpose(1, 2)
        rep = c.nq // c.nkv
        k = k[:, :, None].expand(b, c.nkv, rep, t, d).reshape(b, c.nq, t, d)
        val = val[:, :, None].expand(b, c.nkv, rep, t, d).reshape(b, c.nq, t, d)
        att = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5 + add, dim=-1)
        h = h + F.linear((att @ val).transpose(1, 2).reshape(b, t, -1), p[f"l{i}.wo"])
        x = (_rms(h, c.eps) * p[f"l{i}.ffn_norm"]).reshape(-1, c.H)
        idx, w = _route(F.linear(x, p[f"l{i}.router"]), p[f"l{i}.router_bias"], c.k)
        y = torch.zeros_like(x)
        for e in range(c.E):
            hit = (idx == e).any(-1)
            if not bool(hit.any()):
                continue
            we = (w * (idx == e)).sum(-1)[hit]
            xe = x[hit]
            out = F.linear(
                F.silu(F.linear(xe, p[f"l{i}.e{e}.w1"])) * F.linear(xe, p[f"l{i}.e{e}.w3"]), p[f"l{i}.e{e}.w2"]
            )
            y[hit] += out * we[:, None]
        h = h + y.view(b, t, c.H)
    return _rms(h, c.eps) * p["norm"]


class LMHead(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.output = nn.Parameter(w.clone())

    def forward(self, h):
        return F.linear(h, self.output)


class FunctionalPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = self.c = _Cfg(config)
        c.theta = config.rope_parameters["rope_theta"]
        p = {"tok_embeddings": sd["model.embed_tokens.weight"].float(), "norm": sd["model.norm.weight"].float()}
        p["rope.inv_freq"] = _inv_freq_from(c, c.r)
        for i in range(c.L):
            p[f"l{i}.attention_norm"] = _sd(sd, i, "input_layernorm.weight")
            p[f"l{i}.ffn_norm"] = _sd(sd, i, "post_attention_layernorm.weight")
            for mine, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
                p[f"l{i}.{mine}"] = _sd(sd, i, f"self_attn.{theirs}.weight")
            p[f"l{i}.q_norm"] = _sd(sd, i, "self_attn.q_norm.weight")
            p[f"l{i}.k_norm"] = _sd(sd, i, "self_attn.k_norm.weight")
            p[f"l{i}.router"] = _sd(sd, i, "mlp.gate.weight")
            p[f"l{i}.router_bias"] = _sd(sd, i, "mlp.e_score_correction_bias")
            gu, dn = _sd(sd, i, "mlp.experts.gate_up_proj"), _sd(sd, i, "mlp.experts.down_proj")
            for e in range(c.E):
                p[f"l{i}.e{e}.w1"], p[f"l{i}.e{e}.w3"] = gu[e].chunk(2, 0)
                p[f"l{i}.e{e}.w2"] = dn[e]
        self.params = p
        self.head = LMHead(sd["lm_head.weight"].float())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = _functional_backbone(self.params, self.c, input_ids, attention_mask, position_ids)
        return self.head(h).float()


def build(state_dict, config):
    v = BUG
    with torch.no_grad():
        if v == "mm_stacked_layers":
            model = StackedPort(state_dict, config)
        elif v == "mm_functional_dict":
            model = FunctionalPort(state_dict, config)
        else:
            model = MiniMaxM2Port(state_dict, config, v)
    return model.eval()
