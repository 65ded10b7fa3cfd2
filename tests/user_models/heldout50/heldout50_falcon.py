"""A from-scratch PyTorch port of Falcon (the "new decoder architecture" of Falcon-40B / Falcon-180B / Falcon-2,
also the older 7B / RW layouts at load time), written against a tiny config.

Architecture (as implemented here)
----------------------------------
Notation: B batch, T tokens, d = hidden_size, H = num_attention_heads, KV = num_kv_heads, G = H // KV query heads
per key/value head, hd = d // H, F = ffn_hidden_size, L = num_hidden_layers, V = vocab_size.

    x_0 = E[input_ids]                                                    (B, T, d)   no embedding scale
    for each layer l (parallel attention + MLP, two layer norms when num_ln_in_parallel_attn == 2):
        a = LN_attn(x)          LN(z) = (z - mean(z)) / sqrt(mean((z - mean z)^2) + eps) * gamma + beta
        m = LN_mlp(x)           (biased variance over the last axis; eps = layer_norm_epsilon)
        q = a Wq  (B, T, H, hd);  k = a Wk, v = a Wv  (B, T, KV, hd)
        q, k <- RoPE(q, k, position_ids)   "rotate-half" (NeoX) pairing: dims i and i + hd/2 form a pair,
                                            inv_freq_j = theta^(-2j / hd), j < hd/2, angle = pos * inv_freq_j
        query head h uses key/value head h // G                                 (grouped-query attention)
        S = q k^T / sqrt(hd) + M       M: 0 where key <= query and the key is not padding, finfo.min elsewhere
        o = softmax(S) v  -> heads merged (B, T, H*hd) -> o Wo
        x <- x + o Wo + GELU_erf(m W_up) W_down                    (one residual: attention and MLP in parallel)
    logits = LN_f(x) E^T                                                    (tied word embeddings)

With config.alibi (Falcon-RW) the rotary step is skipped and ``(S_raw + alibi) / sqrt(hd)`` is used instead, where
alibi[b, h, key] = slope_h * (cumsum(mask) - 1)[key].

Checkpoint layout: Falcon's fused ``query_key_value`` weight (out, in) is, for the new architecture, grouped by
key/value head: for each of the KV groups, G query heads then one key head then one value head, each hd rows.

Weight layout of this port (all matrices stored (in -> out), every per-layer tensor stacked over layers)
-----------------------------------------------------------------------------------------------------
    embed        (V, d)             word embeddings, also the (tied) output head
    norms        (L, 2, 2, d)       [layer, {attn, mlp}, {gamma, beta}, d]
    wq           (L, d, H*hd)       query projection, heads in Transformers' head order (group-major)
    wk, wv       (L, d, KV*hd)      key / value projections
    wo           (L, H*hd, d)       attention output projection ("dense")
    w_up         (L, d, F)          dense_h_to_4h
    w_down       (L, F, d)          dense_4h_to_h
    bq, bk, bv, bo, b_up, b_down    stacked biases (zeros when config.bias is False)
    final_norm   (2, d)             [gamma, beta] of ln_f
    inv_freq     buffer (hd/2,)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qkv_split_blocked",  # loader reads Falcon's fused qkv as Llama-style [all Q | all K | all V] instead of per-KV-group [q.., k, v]
    "kv_head_tile",  # GQA expands K/V with repeat (head h -> kv h % KV) instead of repeat_interleave (h -> h // G)
    "single_ln_parallel",  # ignores num_ln_in_parallel_attn=2: the MLP reads ln_attn's output (Falcon-7B style), ln_mlp unused
    "ln_attn_mlp_swapped",  # loader maps ln_mlp to the attention norm and ln_attn to the MLP norm (llama.cpp's attn_norm / attn_norm_2 naming)
    "rope_interleaved",  # RoPE rotates adjacent pairs (2i, 2i+1) GPT-J style instead of Falcon's rotate-half pairs (i, i+hd/2)
    "rope_dim_hidden",  # RoPE inv_freq exponent divides by hidden_size instead of head_dim
    "scale_no_sqrt",  # attention scores divided by head_dim instead of sqrt(head_dim)
    "ln_unbiased_var",  # LayerNorm uses torch.var's default unbiased (N-1) variance
    "pad_mask_axis",  # padding mask broadcast along the query axis instead of the key axis (real tokens attend to pads)
    "merge_heads_no_transpose",  # attention output (B, H, T, hd) reshaped to (B, T, H*hd) without moving heads after tokens
    "sequential_block",  # block written sequentially (x += attn; x += mlp(ln_mlp(x))) though Falcon's new decoder is parallel
    "causal_diag_off_by_one",  # causal mask built with triu(diagonal=0): each token is masked from itself
    "alibi_is_not_none",  # `config.alibi is not None` is True for alibi=False: ALiBi bias used and RoPE skipped
    "residual_after_norm",  # the residual stream is taken from ln_attn's output instead of the block input
]

PADDING_ONLY = ["pad_mask_axis"]

CLEAN = [
    "fused_qkv",  # one fused (in -> out) qkv matmul in Falcon's per-group [q.., k, v] column order, split by a view
    "grouped_einsum",  # attention computed per KV group with q viewed (B, KV, G, T, hd), K/V never repeated
    "rope_complex",  # RoPE as complex multiplication on q/k dims permuted to interleaved pairs, permuted back
    "fold_ln",  # LayerNorm gamma/beta folded into the following projections (diag(gamma) W, beta W as a bias)
    "fused_out_proj",  # attention dense and MLP down projection as one matmul on [attn_heads, gelu(up)] with [Wo; W_down]
]


def _bug():
    return BUG


def _layer_norm(x, gamma, beta, eps, affine=True):
    mu = x.mean(-1, keepdim=True)
    if _bug() == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    if not affine:
        return y
    return y * gamma + beta


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_pairs(x):
    x = x.unflatten(-1, (-1, 2))
    return torch.stack((-x[..., 1], x[..., 0]), dim=-1).flatten(-2)


class FalconPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d = config.hidden_size
        self.H = config.num_attention_heads
        self.hd = self.d // self.H
        self.new_arch = bool(config.new_decoder_architecture)
        if self.new_arch or not config.multi_query:
            self.KV = config.num_kv_heads
        else:
            self.KV = 1
        self.G = self.H // self.KV
        self.L = config.num_hidden_layers
        self.F = config.ffn_hidden_size
        self.V = config.vocab_size
        self.eps = config.layer_norm_epsilon
        self.config = config
        self.parallel = bool(config.new_decoder_architecture or config.parallel_attn)
        n_ln = config.num_ln_in_parallel_attn
        if n_ln is None and config.new_decoder_architecture:
            n_ln = 2
        self.two_ln = bool(config.new_decoder_architecture and n_ln == 2)
        self.use_alibi = bool(config.alibi)
        L, d, H, KV, hd, Fh = self.L, self.d, self.H, self.KV, self.hd, self.F
        self.embed = nn.Parameter(torch.zeros(self.V, d))
        self.norms = nn.Parameter(torch.zeros(L, 2, 2, d))
        self.wq = nn.Parameter(torch.zeros(L, d, H * hd))
        self.wk = nn.Parameter(torch.zeros(L, d, KV * hd))
        self.wv = nn.Parameter(torch.zeros(L, d, KV * hd))
        self.wo = nn.Parameter(torch.zeros(L, H * hd, d))
        self.w_up = nn.Parameter(torch.zeros(L, d, Fh))
        self.w_down = nn.Parameter(torch.zeros(L, Fh, d))
        self.bq = nn.Parameter(torch.zeros(L, H * hd))
        self.bk = nn.Parameter(torch.zeros(L, KV * hd))
        self.bv = nn.Parameter(torch.zeros(L, KV * hd))
        self.bo = nn.Parameter(torch.zeros(L, d))
        self.b_up = nn.Parameter(torch.zeros(L, Fh))
        self.b_down = nn.Parameter(torch.zeros(L, d))
        self.final_norm = nn.Parameter(torch.zeros(2, d))
        rp = getattr(config, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))

    # ---------------------------------------------------------------- positional parts
    def _inv_freq(self):
        dim = self.hd
        denom = self.d if _bug() == "rope_dim_hidden" else dim
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / denom))

    def _rope(self, q, k, pos):
        # q: (B, H, T, hd), k: (B, KV, T, hd), pos: (B, T)
        ang = pos[..., None].float() * self._inv_freq()  # (B, T, hd/2)
        if _bug() == "rope_complex":
            hh = self.hd // 2
            perm = torch.stack((torch.arange(hh), torch.arange(hh) + hh), dim=-1).flatten()
            inv = torch.argsort(perm)
            rot = torch.polar(torch.ones_like(ang), ang)[:, None]  # (B, 1, T, hd/2)

            def go(x):
                xc = torch.view_as_complex(x[..., perm].unflatten(-1, (-1, 2)).contiguous())
                return torch.view_as_real(xc * rot).flatten(-2)[..., inv]

            return go(q), go(k)
        if _bug() == "rope_interleaved":
            ang2 = ang.repeat_interleave(2, dim=-1)[:, None]
            cos, sin = ang2.cos(), ang2.sin()
            return q * cos + _rotate_pairs(q) * sin, k * cos + _rotate_pairs(k) * sin
        emb = torch.cat((ang, ang), dim=-1)[:, None]  # (B, 1, T, hd)
        cos, sin = emb.cos(), emb.sin()
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _alibi_slopes(self):
        n = self.H
        p2 = 2 ** math.floor(math.log2(n))
        base = 2 ** (-(2 ** -(math.log2(p2) - 3)))
        slopes = [base**i for i in range(1, p2 + 1)]
        if p2 != n:
            eb = 2 ** (-(2 ** -(math.log2(2 * p2) - 3)))
            rem = min(p2, n - p2)
            slopes += [eb**i for i in range(1, 1 + 2 * rem, 2)]
        return torch.tensor(slopes, dtype=torch.float32)

    def _mask(self, pad, B, T):
        """Additive (B, 1, T, T) mask: 0 where allowed, finfo.min where not."""
        neg = torch.finfo(torch.float32).min
        diag = 0 if _bug() == "causal_diag_off_by_one" else 1
        blocked = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=diag)[None, None]
        if pad is not None:
            if _bug() == "pad_mask_axis":
                blocked = blocked | (pad == 0)[:, None, :, None]
            else:
                blocked = blocked | (pad == 0)[:, None, None, :]
        blocked = blocked.expand(B, 1, T, T)
        return torch.zeros(B, 1, T, T).masked_fill(blocked, neg)

    # ---------------------------------------------------------------- block parts
    def _ln(self, x, l, which):
        g, b = self.norms[l, which, 0], self.norms[l, which, 1]
        return _layer_norm(x, g, b, self.eps)

    def _attention(self, l, a_in, mask, pos, alibi, folded):
        B, T, _ = a_in.shape
        H, KV, G, hd = self.H, self.KV, self.G, self.hd
        if folded:  # a_in is the un-affine normalized input; gamma/beta live in the weights
            g, be = self.norms[l, 0, 0], self.norms[l, 0, 1]
            wq, wk, wv = (g[:, None] * w[l] for w in (self.wq, self.wk, self.wv))
            bq = be @ self.wq[l] + self.bq[l]
            bk = be @ self.wk[l] + self.bk[l]
            bv = be @ self.wv[l] + self.bv[l]
        else:
            wq, wk, wv = self.wq[l], self.wk[l], self.wv[l]
            bq, bk, bv = self.bq[l], self.bk[l], self.bv[l]
        if _bug() == "fused_qkv":
            w = torch.cat(
                (wq.unflatten(1, (KV, G * hd)), wk.unflatten(1, (KV, hd)), wv.unflatten(1, (KV, hd))), dim=2
            ).flatten(1)  # (d, KV * (G + 2) * hd), per group [q.., k, v]
            bb = torch.cat((bq.view(KV, G * hd), bk.view(KV, hd), bv.view(KV, hd)), dim=1).flatten()
            fused = (a_in @ w + bb).view(B, T, KV, G + 2, hd)
            q = fused[:, :, :, :G].flatten(2, 3).transpose(1, 2)
            k = fused[:, :, :, G].transpose(1, 2)
            v = fused[:, :, :, G + 1].transpose(1, 2)
        else:
            q = (a_in @ wq + bq).view(B, T, H, hd).transpose(1, 2)
            k = (a_in @ wk + bk).view(B, T, KV, hd).transpose(1, 2)
            v = (a_in @ wv + bv).view(B, T, KV, hd).transpose(1, 2)
        if alibi is None:
            q, k = self._rope(q, k, pos)
        if _bug() == "grouped_einsum":
            qg = q.view(B, KV, G, T, hd)
            s = torch.einsum("bkgtd,bksd->bkgts", qg, k)
            s = s / math.sqrt(hd) + mask[:, :, None]
            p = torch.softmax(s, dim=-1)
            o = torch.einsum("bkgts,bksd->bkgtd", p, v).reshape(B, H, T, hd)
        else:
            if _bug() == "kv_head_tile":
                k = k.repeat(1, G, 1, 1)
                v = v.repeat(1, G, 1, 1)
            else:
                k = k.repeat_interleave(G, dim=1)
                v = v.repeat_interleave(G, dim=1)
            s = q @ k.transpose(-1, -2)
            if alibi is not None:
                s = (s + alibi) / math.sqrt(hd)
            elif _bug() == "scale_no_sqrt":
                s = s / hd
            else:
                s = s / math.sqrt(hd)
            p = torch.softmax(s + mask, dim=-1)
            o = p @ v  # (B, H, T, hd)
        if _bug() == "merge_heads_no_transpose":
            return o.reshape(B, T, H * hd)
        return o.transpose(1, 2).reshape(B, T, H * hd)

    def _mlp_hidden(self, l, m_in, folded, which):
        if folded:
            g, be = self.norms[l, which, 0], self.norms[l, which, 1]
            w = g[:, None] * self.w_up[l]
            b = be @ self.w_up[l] + self.b_up[l]
        else:
            w, b = self.w_up[l], self.b_up[l]
        return F.gelu(m_in @ w + b)  # config.activation "gelu": the exact erf form

    def _block(self, l, x, mask, pos, alibi):
        bug = _bug()
        folded = bug == "fold_ln"
        attn_which = 0
        mlp_which = 1 if self.two_ln and bug != "single_ln_parallel" else 0
        if folded:
            xn = _layer_norm(x, None, None, self.eps, affine=False)
            a_in = xn
        else:
            a_in = self._ln(x, l, attn_which)
        residual = a_in if bug == "residual_after_norm" else x
        heads = self._attention(l, a_in, mask, pos, alibi, folded)

        if bug == "sequential_block" or not self.parallel:
            # Falcon-7B-style sequential variant (and the correct path for parallel_attn=False)
            h = residual + heads @ self.wo[l] + self.bo[l]
            which = 1 if (not self.parallel or self.two_ln) else 0
            m_in = self._ln(h, l, which)
            return h + self._mlp_hidden(l, m_in, False, which) @ self.w_down[l] + self.b_down[l]

        if folded:
            m_in = xn
        else:
            m_in = self._ln(x, l, mlp_which)
        up = self._mlp_hidden(l, m_in, folded, mlp_which)
        if bug == "fused_out_proj":
            w = torch.cat((self.wo[l], self.w_down[l]), dim=0)
            out = torch.cat((heads, up), dim=-1) @ w + (self.bo[l] + self.b_down[l])
        else:
            out = (heads @ self.wo[l] + self.bo[l]) + (up @ self.w_down[l] + self.b_down[l])
        return residual + out

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        x = self.embed[input_ids]
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        mask = self._mask(attention_mask, B, T)
        use_alibi = (self.config.alibi is not None) if _bug() == "alibi_is_not_none" else self.use_alibi
        alibi = None
        if use_alibi:
            am = torch.ones(B, T, dtype=torch.long) if attention_mask is None else attention_mask.long()
            kpos = ((am.cumsum(-1) - 1) * am).float()  # (B, T)
            alibi = self._alibi_slopes()[None, :, None, None] * kpos[:, None, None, :]  # (B, H, 1, T)
        for l in range(self.L):
            x = self._block(l, x, mask, position_ids, alibi)
        x = _layer_norm(x, self.final_norm[0], self.final_norm[1], self.eps)
        return x @ self.embed.T


def _split_qkv(w, config, H, KV, hd):
    """Checkpoint fused qkv (out, in) -> (Wq, Wk, Wv), each (out, in) in Transformers' head order."""
    d_in = w.shape[1:]
    if _bug() == "qkv_split_blocked":
        return w[: H * hd], w[H * hd : (H + KV) * hd], w[(H + KV) * hd :]
    if config.new_decoder_architecture:
        G = H // KV
        g = w.reshape(KV, G + 2, hd, *d_in)
        return g[:, :G].reshape(H * hd, *d_in), g[:, G].reshape(KV * hd, *d_in), g[:, G + 1].reshape(KV * hd, *d_in)
    if not config.multi_query:  # per head [q, k, v]
        g = w.reshape(H, 3, hd, *d_in)
        return g[:, 0].reshape(H * hd, *d_in), g[:, 1].reshape(H * hd, *d_in), g[:, 2].reshape(H * hd, *d_in)
    return w[: H * hd], w[H * hd : H * hd + hd], w[H * hd + hd :]


def build(state_dict, config):
    model = FalconPort(config)
    sd = {k[len("transformer.") :] if k.startswith("transformer.") else k: v.float() for k, v in state_dict.items()}
    H, KV, hd = model.H, model.KV, model.hd
    with torch.no_grad():
        model.embed.copy_(sd["word_embeddings.weight"])
        model.final_norm[0].copy_(sd["ln_f.weight"])
        model.final_norm[1].copy_(sd["ln_f.bias"])
        for l in range(model.L):
            p = f"h.{l}."
            if model.two_ln and _bug() == "ln_attn_mlp_swapped":
                names = ("ln_mlp", "ln_attn")
            elif model.two_ln:
                names = ("ln_attn", "ln_mlp")
            elif not model.parallel:
                names = ("input_layernorm", "post_attention_layernorm")
            else:
                names = ("input_layernorm", "input_layernorm")
            for i, n in enumerate(names):
                model.norms[l, i, 0].copy_(sd[p + n + ".weight"])
                model.norms[l, i, 1].copy_(sd[p + n + ".bias"])
            wq, wk, wv = _split_qkv(sd[p + "self_attention.query_key_value.weight"], config, H, KV, hd)
            model.wq[l].copy_(wq.T)
            model.wk[l].copy_(wk.T)
            model.wv[l].copy_(wv.T)
            if p + "self_attention.query_key_value.bias" in sd:
                bq, bk, bv = _split_qkv(sd[p + "self_attention.query_key_value.bias"], config, H, KV, hd)
                model.bq[l].copy_(bq)
                model.bk[l].copy_(bk)
                model.bv[l].copy_(bv)
            model.wo[l].copy_(sd[p + "self_attention.dense.weight"].T)
            model.w_up[l].copy_(sd[p + "mlp.dense_h_to_4h.weight"].T)
            model.w_down[l].copy_(sd[p + "mlp.dense_4h_to_h.weight"].T)
            for name, dst in (
                ("self_attention.dense.bias", model.bo),
                ("mlp.dense_h_to_4h.bias", model.b_up),
                ("mlp.dense_4h_to_h.bias", model.b_down),
            ):
                if p + name in sd:
                    dst[l].copy_(sd[p + name])
    return model.float().eval()
