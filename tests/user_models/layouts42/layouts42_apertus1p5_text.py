"""Hand-written plain-PyTorch port of the Apertus 1.5 text decoder (Apertus1p5TextForCausalLM).

Architecture as this port implements it:
- token embedding (no scaling); L pre-norm blocks; final RMSNorm; an untied LM head that may be pruned to the first
  `output_vocab_size` ids (the logits have the head's width, not the vocabulary's).
- block:  h = h + Attn(RMSNorm_a(h));  h = h + MLP(RMSNorm_f(h))   (RMSNorm: x / sqrt(mean(x^2) + eps) * g).
- Attn: q/k/v projections with biases (attention_bias), GQA (num_key_value_heads), per-head RMSNorm on q and on k
  (q_norm / k_norm, gains of size head_dim, before RoPE), RoPE in the rotate-half convention with llama3 frequency
  scaling (high frequencies kept, low ones divided by `factor`, a smooth ramp between), softmax(q k^T / sqrt(hd)),
  causal + padding mask, o_proj with bias.
- MLP: down(xIELU(up(x))) (no gate). xIELU with alpha_p = softplus(a_p), alpha_n = beta + softplus(a_n):
      x > 0:  alpha_p x^2 + beta x;     x <= 0:  alpha_n (expm1(min(x, eps)) - x) + beta x     (eps = -1e-6).
- positions: `position_ids`, else 0..S-1.  Padding queries may see themselves only (their outputs are never used).

Layouts (BUG selects one; every one is a correct port):
- "" (baseline): own names; q/k/v fused into one TRANSPOSED weight `wqkv` (H, (nh + 2 nkv) hd) = [q | k | v] applied
  as x @ W + b (fused bias); o / up / down / head transposed (x @ W); RoPE cos/sin tables for every position up to
  max_position_embeddings precomputed as buffers and gathered by position; xIELU's alpha_p / alpha_n stored already
  softplus'ed (`act_alpha` = [alpha_p, alpha_n]) with [beta, eps] in one buffer; explicit softmax, additive mask.
- ap_meta_complex_rope: q and k rows (and their biases and q/k norm gains) permuted to Meta's interleaved pair order
  (pair i = dims (2i, 2i+1)); RoPE as a complex multiplication by a precomputed `freqs_cis` table (Meta llama).
- ap_heads_einsum: a head axis on the weights: wq (nh, hd, H), wk / wv (nkv, hd, H), wo (nh, hd, H), biases (heads, hd);
  projections and the output as einsums; GQA by grouping the query heads (b, s, nkv, group, hd), no repeat of k/v.
- ap_megatron_qkv: Megatron-LM's fused linear_qkv, out x in (F.linear): per KV group g the rows
  [q heads of g | k_g | v_g]; MLP weights out x in as linear_fc1 / linear_fc2; xIELU with its raw parameters
  (softplus applied in the forward).
- ap_folded_norms: every RMSNorm gain folded into the next projection (attention norm into wqkv, FFN norm into up,
  final norm into the head); the 1/sqrt(hd) softmax scale folded into the q_norm gain.
- ap_sdpa_posmask: F.scaled_dot_product_attention with a boolean mask; positions always recomputed from the attention
  mask (cumsum - 1), as generate does, ignoring `position_ids`; k/v expanded with repeat_interleave.
- ap_padded_head: the decoder body returns the final hidden states, a separate head module holds the LM head padded
  with zero rows to a multiple of 64 ids (vLLM's ParallelLMHead) and slices the logits back; q/k norm gains stacked
  in one (2, hd) tensor.
- ap_stacked_layers: one tensor per kind stacked over the layers ((L, ...), transposed weights), indexed in a loop;
  both norm gains of a layer in one (L, 2, H) tensor; xIELU's raw parameters and beta/eps in one (L, 4) tensor.
- ap_functional_gemma_norms: one functional forward over a flat ParameterDict (nn.Linear's out x in layouts,
  separate q/k/v); every RMSNorm gain stored as (g - 1) and applied as (1 + w) (Gemma's convention).
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
    "ap_meta_complex_rope",  # Meta's interleaved q/k row order (biases, q/k norm gains too) + complex-number RoPE
    "ap_heads_einsum",  # weights with a head axis (heads, hd, H), einsum projections, grouped-query einsum attention
    "ap_megatron_qkv",  # Megatron per-KV-group fused [q.. | k | v] rows (out x in); xIELU from raw parameters
    "ap_folded_norms",  # RMSNorm gains folded into wqkv / up / head; softmax scale folded into the q_norm gain
    "ap_sdpa_posmask",  # SDPA with a boolean mask; positions recomputed from the attention mask (cumsum - 1)
    "ap_padded_head",  # body returns hidden states; separate head padded to a multiple of 64 rows, logits sliced
    "ap_stacked_layers",  # one (L, ...) tensor per weight kind, transposed, indexed in a loop; stacked gains
    "ap_functional_gemma_norms",  # one functional forward over a flat ParameterDict; norm gains stored as g - 1
]


# --------------------------------------------------------------------------------------------------- helpers
def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _inv_freq(config, dim):
    """RoPE inverse frequencies: plain, or with llama3's three-band scaling."""
    rp = dict(config.rope_parameters or {})
    base = rp.get("rope_theta", 10000.0)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rp.get("rope_type", "default") == "llama3":
        factor = rp["factor"]
        lo, hi = rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _xielu(x, alpha_p, alpha_n, beta, eps):
    """xIELU with effective (already softplus'ed) alphas."""
    return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + beta * x)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _positions(input_ids, position_ids):
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    return position_ids


def _keep(attention_mask, s, device):
    """bool (b or 1, 1, s, s): key j visible to query i (causal, not padding); a query always sees itself."""
    idx = torch.arange(s, device=device)
    keep = (idx[None, :] <= idx[:, None])[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.bool()[:, None, None, :]
    return keep | torch.eye(s, dtype=torch.bool, device=device)


def _additive(keep, dtype=torch.float32):
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def _meta_perm(n_heads, hd):
    """Row order turning HF's rotate-half head layout into Meta's interleaved one: meta[2i + j] = hf[j * hd/2 + i]."""
    return torch.arange(n_heads * hd).view(n_heads, 2, hd // 2).transpose(1, 2).reshape(-1)


class _Cfg:
    def __init__(self, sd, config):
        self.H = config.hidden_size
        self.nh = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.hd = _head_dim(config)
        self.L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.bias = "model.layers.0.self_attn.q_proj.bias" in sd
        self.max_pos = config.max_position_embeddings
        self.inv_freq = _inv_freq(config, self.hd)


def _get(sd, name, i=None):
    return sd[name if i is None else f"model.layers.{i}.{name}"].detach().float().clone()


def _bias(sd, c, i, name, rows):
    key = f"model.layers.{i}.self_attn.{name}.bias"
    return _get(sd, key) if key in sd else torch.zeros(rows)


def _act(sd, i):
    p = f"model.layers.{i}.mlp.act_fn."
    beta = _get(sd, p + "beta").reshape(()) if p + "beta" in sd else torch.tensor(0.5)
    eps = _get(sd, p + "eps").reshape(()) if p + "eps" in sd else torch.tensor(-1e-6)
    return _get(sd, p + "alpha_p").reshape(()), _get(sd, p + "alpha_n").reshape(()), beta, eps


def _head_weight(sd, config):
    if "lm_head.weight" in sd:
        return _get(sd, "lm_head.weight")
    return _get(sd, "model.embed_tokens.weight")


# ------------------------------------------------------------------------------------ module-tree ports
class _Block(nn.Module):
    def __init__(self, sd, c, i, variant):
        super().__init__()
        self.v, self.c = variant, c
        nh, nkv, hd, H = c.nh, c.nkv, c.hd, c.H
        wq, wk, wv = (_get(sd, f"self_attn.{n}_proj.weight", i) for n in "qkv")
        bq, bk, bv = (_bias(sd, c, i, f"{n}_proj", r) for n, r in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)))
        wo, bo = _get(sd, "self_attn.o_proj.weight", i), _bias(sd, c, i, "o_proj", H)
        gq, gk = _get(sd, "self_attn.q_norm.weight", i), _get(sd, "self_attn.k_norm.weight", i)
        ga, gf = _get(sd, "attention_layernorm.weight", i), _get(sd, "feedforward_layernorm.weight", i)
        wup, wdown = _get(sd, "mlp.up_proj.weight", i), _get(sd, "mlp.down_proj.weight", i)
        a_p, a_n, beta, eps = _act(sd, i)

        if variant == "ap_meta_complex_rope":
            pq, pk, pg = _meta_perm(nh, hd), _meta_perm(nkv, hd), _meta_perm(1, hd)
            wq, bq, wk, bk, gq, gk = wq[pq], bq[pq], wk[pk], bk[pk], gq[pg], gk[pg]
        if variant == "ap_folded_norms":
            wq, wk, wv, wup = wq * ga, wk * ga, wv * ga, wup * gf
            gq = gq * hd**-0.5

        if variant == "ap_heads_einsum":
            self.attn_gain, self.ffn_gain = nn.Parameter(ga), nn.Parameter(gf)
            self.wq = nn.Parameter(wq.view(nh, hd, H))
            self.wk = nn.Parameter(wk.view(nkv, hd, H))
            self.wv = nn.Parameter(wv.view(nkv, hd, H))
            self.bq, self.bk, self.bv = (nn.Parameter(b.view(-1, hd)) for b in (bq, bk, bv))
            self.wo = nn.Parameter(wo.t().reshape(nh, hd, H))
            self.bo = nn.Parameter(bo)
            self.q_gain, self.k_gain = nn.Parameter(gq), nn.Parameter(gk)
            self.w_up = nn.Parameter(wup.t().contiguous())
            self.w_down = nn.Parameter(wdown.t().contiguous())
        elif variant == "ap_megatron_qkv":
            g = nh // nkv
            rows = torch.cat([wq.view(nkv, g, hd, H), wk.view(nkv, 1, hd, H), wv.view(nkv, 1, hd, H)], 1)
            bias = torch.cat([bq.view(nkv, g, hd), bk.view(nkv, 1, hd), bv.view(nkv, 1, hd)], 1)
            self.input_layernorm = nn.Parameter(ga)
            self.linear_qkv = nn.Parameter(rows.reshape(-1, H))
            self.linear_qkv_bias = nn.Parameter(bias.reshape(-1))
            self.q_layernorm, self.k_layernorm = nn.Parameter(gq), nn.Parameter(gk)
            self.linear_proj = nn.Parameter(wo)
            self.linear_proj_bias = nn.Parameter(bo)
            self.pre_mlp_layernorm = nn.Parameter(gf)
            self.linear_fc1, self.linear_fc2 = nn.Parameter(wup), nn.Parameter(wdown)
            self.alpha_p, self.alpha_n = nn.Parameter(a_p.reshape(1)), nn.Parameter(a_n.reshape(1))
            self.register_buffer("beta", beta)
            self.register_buffer("eps", eps)
        else:
            if variant != "ap_folded_norms":
                self.attn_gain, self.ffn_gain = nn.Parameter(ga), nn.Parameter(gf)
            self.wqkv = nn.Parameter(torch.cat([wq, wk, wv], 0).t().contiguous())
            self.bqkv = nn.Parameter(torch.cat([bq, bk, bv]))
            if variant == "ap_padded_head":
                self.qk_gain = nn.Parameter(torch.stack([gq, gk]))
            else:
                self.q_gain, self.k_gain = nn.Parameter(gq), nn.Parameter(gk)
            self.wo = nn.Parameter(wo.t().contiguous())
            self.bo = nn.Parameter(bo)
            self.w_up = nn.Parameter(wup.t().contiguous())
            self.w_down = nn.Parameter(wdown.t().contiguous())
        if variant != "ap_megatron_qkv":
            self.act_alpha = nn.Parameter(torch.stack([F.softplus(a_p), beta + F.softplus(a_n)]))
            self.register_buffer("act_beta_eps", torch.stack([beta, eps]))

    # q, k in (b, s, heads, hd) -> rotated
    def _rope(self, q, k, rope):
        if self.v == "ap_meta_complex_rope":
            fc = rope[:, :, None, :]
            qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
            kc = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
            return torch.view_as_real(qc * fc).flatten(-2), torch.view_as_real(kc * fc).flatten(-2)
        cos, sin = rope[0][:, :, None, :], rope[1][:, :, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def forward(self, h, rope, keep):
        c, v = self.c, self.v
        b, s, _ = h.shape
        nh, nkv, hd = c.nh, c.nkv, c.hd
        g = nh // nkv
        if v == "ap_heads_einsum":
            x = _rms(h, c.eps) * self.attn_gain
            q = torch.einsum("bsh,ndh->bsnd", x, self.wq) + self.bq
            k = torch.einsum("bsh,ndh->bsnd", x, self.wk) + self.bk
            val = torch.einsum("bsh,ndh->bsnd", x, self.wv) + self.bv
            q, k = _rms(q, c.eps) * self.q_gain, _rms(k, c.eps) * self.k_gain
            q, k = self._rope(q, k, rope)
            q = q.view(b, s, nkv, g, hd)
            scores = torch.einsum("bqngd,bknd->bngqk", q, k) * hd**-0.5
            scores = scores + _additive(keep)[:, :, None]
            p = scores.softmax(-1)
            o = torch.einsum("bngqk,bknd->bqngd", p, val).reshape(b, s, nh, hd)
            h = h + torch.einsum("bsnd,ndh->bsh", o, self.wo) + self.bo
            x = _rms(h, c.eps) * self.ffn_gain
            y = _xielu(x @ self.w_up, self.act_alpha[0], self.act_alpha[1], *self.act_beta_eps)
            return h + y @ self.w_down
        if v == "ap_megatron_qkv":
            x = _rms(h, c.eps) * self.input_layernorm
            qkv = F.linear(x, self.linear_qkv, self.linear_qkv_bias).view(b, s, nkv, g + 2, hd)
            q = qkv[:, :, :, :g].reshape(b, s, nh, hd)
            k, val = qkv[:, :, :, g], qkv[:, :, :, g + 1]
            q, k = _rms(q, c.eps) * self.q_layernorm, _rms(k, c.eps) * self.k_layernorm
            q, k = self._rope(q, k, rope)
            o = _attend(q, k, val, keep, hd**-0.5)
            h = h + F.linear(o, self.linear_proj, self.linear_proj_bias)
            x = _rms(h, c.eps) * self.pre_mlp_layernorm
            an = self.beta + F.softplus(self.alpha_n)
            y = _xielu(F.linear(x, self.linear_fc1), F.softplus(self.alpha_p), an, self.beta, self.eps)
            return h + F.linear(y, self.linear_fc2)
        # fused transposed wqkv family
        x = _rms(h, c.eps)
        if v != "ap_folded_norms":
            x = x * self.attn_gain
        qkv = x @ self.wqkv + self.bqkv
        q, k, val = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
        q, k, val = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), val.view(b, s, nkv, hd)
        gq, gk = (self.qk_gain[0], self.qk_gain[1]) if v == "ap_padded_head" else (self.q_gain, self.k_gain)
        q, k = _rms(q, c.eps) * gq, _rms(k, c.eps) * gk
        q, k = self._rope(q, k, rope)
        if v == "ap_sdpa_posmask":
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2)
            kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, scale=hd**-0.5)
            o = o.transpose(1, 2).reshape(b, s, nh * hd)
        else:
            o = _attend(q, k, val, keep, 1.0 if v == "ap_folded_norms" else hd**-0.5)
        h = h + o @ self.wo + self.bo
        x = _rms(h, c.eps)
        if v != "ap_folded_norms":
            x = x * self.ffn_gain
        y = _xielu(x @ self.w_up, self.act_alpha[0], self.act_alpha[1], *self.act_beta_eps)
        return h + y @ self.w_down


def _attend(q, k, v, keep, scale):
    """Explicit softmax attention. q (b, s, nh, hd), k/v (b, s, nkv, hd) -> (b, s, nh * hd)."""
    b, s, nh, hd = q.shape
    g = nh // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) * scale + _additive(keep)
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, nh * hd)


class ApertusBody(nn.Module):
    """Embedding, blocks and final norm; returns the final hidden states (or logits when it owns the head)."""

    def __init__(self, sd, config, variant, with_head=True):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        self.v = variant
        self.tok_emb = nn.Parameter(_get(sd, "model.embed_tokens.weight"))
        self.blocks = nn.ModuleList([_Block(sd, c, i, variant) for i in range(c.L)])
        gn = _get(sd, "model.norm.weight")
        head = _head_weight(sd, config)
        if variant == "ap_folded_norms":
            head = head * gn
        else:
            self.final_gain = nn.Parameter(gn)
        if with_head:
            self.w_out = nn.Parameter(head.t().contiguous())
        t = torch.arange(c.max_pos, dtype=torch.float32)
        freqs = torch.outer(t, c.inv_freq)
        if variant == "ap_meta_complex_rope":
            self.freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # plain attribute, as Meta's llama
        else:
            emb = torch.cat([freqs, freqs], -1)
            self.register_buffer("rope_cos", emb.cos(), persistent=False)
            self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        s = input_ids.shape[1]
        if self.v == "ap_sdpa_posmask":
            am = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            position_ids = (am.long().cumsum(-1) - 1).clamp(min=0)
        pos = _positions(input_ids, position_ids)
        if self.v == "ap_meta_complex_rope":
            rope = self.freqs_cis.to(input_ids.device)[pos]
        else:
            rope = (self.rope_cos[pos], self.rope_sin[pos])
        keep = _keep(attention_mask, s, input_ids.device)
        h = F.embedding(input_ids, self.tok_emb)
        for blk in self.blocks:
            h = blk(h, rope, keep)
        h = _rms(h, self.c.eps)
        if self.v != "ap_folded_norms":
            h = h * self.final_gain
        if hasattr(self, "w_out"):
            return (h @ self.w_out).float()
        return h


class PaddedHead(nn.Module):
    def __init__(self, weight, multiple=64):
        super().__init__()
        self.n_out = weight.shape[0]
        rows = -(-self.n_out // multiple) * multiple
        padded = torch.zeros(rows, weight.shape[1])
        padded[: self.n_out] = weight
        self.weight = nn.Parameter(padded)

    def forward(self, h):
        return F.linear(h, self.weight)[..., : self.n_out]


class ApertusPaddedHeadLM(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.body = ApertusBody(sd, config, "ap_padded_head", with_head=False)
        self.head = PaddedHead(_head_weight(sd, config))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.body(input_ids, attention_mask, position_ids)).float()


# ------------------------------------------------------------------------------------ stacked layers
class ApertusStacked(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = self.c = _Cfg(sd, config)
        L, nh, nkv, hd = c.L, c.nh, c.nkv, c.hd
        per = lambda n: torch.stack([_get(sd, n, i) for i in range(L)])
        bias = lambda n, r: torch.stack([_bias(sd, c, i, n, r) for i in range(L)])
        self.embedding = nn.Parameter(_get(sd, "model.embed_tokens.weight"))
        self.W_qkv = nn.Parameter(
            torch.cat([per(f"self_attn.{n}_proj.weight") for n in "qkv"], 1).transpose(1, 2).contiguous()
        )
        self.b_qkv = nn.Parameter(
            torch.cat([bias("q_proj", nh * hd), bias("k_proj", nkv * hd), bias("v_proj", nkv * hd)], 1)
        )
        self.g_qk = nn.Parameter(torch.stack([per("self_attn.q_norm.weight"), per("self_attn.k_norm.weight")], 1))
        self.W_o = nn.Parameter(per("self_attn.o_proj.weight").transpose(1, 2).contiguous())
        self.b_o = nn.Parameter(bias("o_proj", c.H))
        self.g_norm = nn.Parameter(
            torch.stack([per("attention_layernorm.weight"), per("feedforward_layernorm.weight")], 1)
        )
        self.W_up = nn.Parameter(per("mlp.up_proj.weight").transpose(1, 2).contiguous())
        self.W_down = nn.Parameter(per("mlp.down_proj.weight").transpose(1, 2).contiguous())
        self.act = nn.Parameter(torch.stack([torch.stack(_act(sd, i)) for i in range(L)]))  # a_p, a_n, beta, eps
        self.g_final = nn.Parameter(_get(sd, "model.norm.weight"))
        self.W_head = nn.Parameter(_head_weight(sd, config).t().contiguous())
        inv = c.inv_freq
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        c = self.c
        b, s = input_ids.shape
        nh, nkv, hd = c.nh, c.nkv, c.hd
        pos = _positions(input_ids, position_ids).float()
        ang = pos[..., None] * self.inv_freq
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        keep = _keep(attention_mask, s, input_ids.device)
        h = self.embedding[input_ids]
        for i in range(c.L):
            x = _rms(h, c.eps) * self.g_norm[i, 0]
            q, k, v = (x @ self.W_qkv[i] + self.b_qkv[i]).split([nh * hd, nkv * hd, nkv * hd], -1)
            q = _rms(q.view(b, s, nh, hd), c.eps) * self.g_qk[i, 0]
            k = _rms(k.view(b, s, nkv, hd), c.eps) * self.g_qk[i, 1]
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            o = _attend(q, k, v.view(b, s, nkv, hd), keep, hd**-0.5)
            h = h + o @ self.W_o[i] + self.b_o[i]
            x = _rms(h, c.eps) * self.g_norm[i, 1]
            a_p, a_n, beta, eps = self.act[i]
            y = _xielu(x @ self.W_up[i], F.softplus(a_p), beta + F.softplus(a_n), beta, eps)
            h = h + y @ self.W_down[i]
        return ((_rms(h, c.eps) * self.g_final) @ self.W_head).float()


# ------------------------------------------------------------------------------------ functional port
def apertus_forward(P, meta, input_ids, attention_mask=None, position_ids=None):
    """One functional forward over a flat dict of tensors (gains stored as g - 1, weights out x in)."""
    b, s = input_ids.shape
    nh, nkv, hd, eps = meta["nh"], meta["nkv"], meta["hd"], meta["eps"]
    g = nh // nkv
    pos = _positions(input_ids, position_ids)
    ang = pos.float()[..., None] * P["rope_inv_freq"]
    cos, sin = ang.cos().repeat(1, 1, 2)[:, None], ang.sin().repeat(1, 1, 2)[:, None]
    keep = _keep(attention_mask, s, input_ids.device)
    bias = torch.zeros(keep.shape, device=input_ids.device).masked_fill(~keep, float("-inf"))
    h = F.embedding(input_ids, P["tok_embeddings"])
    for i in range(meta["L"]):
        p = f"l{i}_"
        x = _rms(h, eps) * (1 + P[p + "attn_norm"])
        q = F.linear(x, P[p + "wq"], P[p + "bq"]).view(b, s, nh, hd).transpose(1, 2)
        k = F.linear(x, P[p + "wk"], P[p + "bk"]).view(b, s, nkv, hd).transpose(1, 2)
        v = F.linear(x, P[p + "wv"], P[p + "bv"]).view(b, s, nkv, hd).transpose(1, 2)
        q, k = _rms(q, eps) * (1 + P[p + "q_norm"]), _rms(k, eps) * (1 + P[p + "k_norm"])
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k = k[:, :, None].expand(b, nkv, g, s, hd).reshape(b, nh, s, hd)
        v = v[:, :, None].expand(b, nkv, g, s, hd).reshape(b, nh, s, hd)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, nh * hd)
        h = h + F.linear(o, P[p + "wo"], P[p + "bo"])
        x = _rms(h, eps) * (1 + P[p + "ffn_norm"])
        a_p, a_n, beta, aeps = P[p + "xielu"]
        u = F.linear(x, P[p + "w_up"])
        u = _xielu(u, F.softplus(a_p), beta + F.softplus(a_n), beta, aeps)
        h = h + F.linear(u, P[p + "w_down"])
    h = _rms(h, eps) * (1 + P["norm"])
    return F.linear(h, P["output"]).float()


class ApertusFunctional(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        c = _Cfg(sd, config)
        self.meta = dict(nh=c.nh, nkv=c.nkv, hd=c.hd, eps=c.eps, L=c.L)
        P = {"tok_embeddings": _get(sd, "model.embed_tokens.weight"), "norm": _get(sd, "model.norm.weight") - 1}
        P["output"] = _head_weight(sd, config)
        for i in range(c.L):
            p = f"l{i}_"
            for n in "qkvo":
                P[p + f"w{n}"] = _get(sd, f"self_attn.{n}_proj.weight", i)
                rows = {"q": c.nh * c.hd, "o": c.H}.get(n, c.nkv * c.hd)
                P[p + f"b{n}"] = _bias(sd, c, i, f"{n}_proj", rows)
            P[p + "q_norm"] = _get(sd, "self_attn.q_norm.weight", i) - 1
            P[p + "k_norm"] = _get(sd, "self_attn.k_norm.weight", i) - 1
            P[p + "attn_norm"] = _get(sd, "attention_layernorm.weight", i) - 1
            P[p + "ffn_norm"] = _get(sd, "feedforward_layernorm.weight", i) - 1
            P[p + "w_up"] = _get(sd, "mlp.up_proj.weight", i)
            P[p + "w_down"] = _get(sd, "mlp.down_proj.weight", i)
            P[p + "xielu"] = torch.stack(_act(sd, i))
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in P.items()})
        self.register_buffer("rope_inv_freq", c.inv_freq, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        P = dict(self.params.items())
        P["rope_inv_freq"] = self.rope_inv_freq
        return apertus_forward(P, self.meta, input_ids, attention_mask, position_ids)


# ------------------------------------------------------------------------------------ entry point
def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN and variant not in BUGS:
        raise ValueError(f"unknown layout variant {variant!r}")
    with torch.no_grad():
        if variant == "ap_stacked_layers":
            model = ApertusStacked(state_dict, config)
        elif variant == "ap_functional_gemma_norms":
            model = ApertusFunctional(state_dict, config)
        elif variant == "ap_padded_head":
            model = ApertusPaddedHeadLM(state_dict, config)
        else:
            model = ApertusBody(state_dict, config, variant)
    return model.eval()
