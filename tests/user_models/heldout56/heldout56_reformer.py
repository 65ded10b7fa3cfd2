"""A from-scratch PyTorch port of Reformer's causal LM (``ReformerModelWithLMHead``, local attention only).

Architecture (as implemented here), for input ids ``(B, T)``, hidden size ``D``, ``H`` heads of size ``d``
(``config.attention_head_size``, so ``H*d`` need not equal ``D``), feed-forward size ``F``, vocabulary ``V``:

* Embeddings: ``e_t = E[id_t] + P[pos_t]``, with the *axial* position table ``P``: for
  ``axial_pos_shape = (S0, S1)`` and ``axial_pos_embds_dim = (D0, D1)`` (``D0 + D1 = D``),
  ``P[p] = concat(A0[p // S1], A1[p % S1])`` -- the two factor tables are broadcast to a ``(S0, S1, D0 + D1)``
  grid (row-major), concatenated on features (factor 0 first) and flattened so that position ``p`` is grid cell
  ``(p // S1, p % S1)``. ``pos_t`` is ``position_ids`` when given, else ``t``.
* Reversible residual stack (RevNet) with two streams, both starting at ``e``: ``X1 = X2 = e``; per layer
      ``X1 <- X1 + Attn(LN_a(X2))``            (Y1 = X1 + f(X2))
      ``X2 <- X2 + FFN(LN_f(X1_new))``         (Y2 = X2 + g(Y1))
  then ``h = LN_final(concat(X1, X2))`` over ``2D`` features and ``logits = h @ W_head + b_head``.
* Local (chunked) causal self-attention: ``q = x Wq``, ``k = x Wk`` (its own key projection, no shared QK),
  ``v = x Wv`` (no biases), split into ``H`` heads; keys are scaled ``k / sqrt(d)``. The sequence is cut into
  chunks of ``c = local_attn_chunk_length`` (padded at the end to a multiple of ``c``, padding keys masked);
  each chunk's queries attend to the keys/values of the ``local_num_chunks_before`` previous chunks (a cyclic
  roll along the chunk axis, so chunk 0 looks back at the *last* chunk) plus their own chunk
  (``local_num_chunks_after`` following ones, 0 for a decoder). The mask is built from *global* token indices:
  ``key_idx <= query_idx`` (which also removes chunk 0's wrapped look-back) and the key's attention-mask bit
  (also rolled with its chunk); masked scores are replaced by ``-1e9``; softmax; ``out = p v``; heads merged and
  ``out @ Wo`` (no bias). A sequence no longer than one chunk uses plain causal attention (no look-back).
* FFN: ``gelu_erf(x W1 + b1) W2 + b2`` (the config's chunked feed-forward is a no-op for chunk size 0).
* LayerNorms use ``config.layer_norm_eps``.

Weight layout (mine, converted in ``build``; all matrices stored transposed, in -> out):
    tok_emb   (V, D)                     word embeddings
    axial0    (S0, D0), axial1 (S1, D1)   the two axial factor tables (squeezed)
    ln_attn   (L, 2, D)                   per-layer [weight, bias] of the attention pre-norm
    w_qkv     (L, D, 3*H*d)               fused [q | k | v] projection
    w_out     (L, H*d, D)                 attention output projection
    ln_ffn    (L, 2, D)                   per-layer [weight, bias] of the feed-forward pre-norm
    w_ff1     (L, D, F), b_ff1 (L, F)
    w_ff2     (L, F, D), b_ff2 (L, D)
    ln_final  (2, 2D)                     [weight, bias] of the norm over the concatenated streams
    w_head    (2D, V), b_head (V,)        the LM head (``lm_head.decoder``; ``lm_head.bias`` is unused)
    pos_table (S0*S1, D)                  buffer: the precomputed axial table (used by the ``pos_table`` variant)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "axial_flatten_order",  # axial grid flattened column-major: position p -> (p % S0, p // S0) instead of (p // S1, p % S1)
    "position_ids_ignored",  # the given position_ids are dropped and arange(T) used for the axial encodings
    "mask_not_looked_back",  # the key padding mask is chunked but not rolled with the look-back chunk (uses the current chunk's bits)
    "lookback_wrong_direction",  # look-back chunk gathered with roll(-1): each chunk sees the next chunk (all causal-masked) instead of the previous
    "chunk_len_from_lsh",  # chunk length read from config.lsh_attn_chunk_length instead of local_attn_chunk_length
    "double_scale",  # keys scaled by 1/sqrt(d) and the scores again by 1/sqrt(d) (1/d overall)
    "causal_strict",  # causal mask uses key_idx < query_idx (gt), so a token cannot attend to itself
    "first_chunk_wraparound",  # causal mask built on in-window offsets, so chunk 0's wrapped look-back (the last chunk) stays visible
    "shared_qk",  # local attention given LSH's shared query-key: keys projected with the query weight
    "ffn_reads_old_stream",  # RevNet: the feed-forward reads LN(X1) from before the attention update (parallel, not Y1)
    "final_concat_order",  # the two streams concatenated as [X2, X1] before the final 2D LayerNorm and head
    "final_norm_per_stream",  # final LayerNorm applied to each stream separately (stats over D) instead of over 2D
    "mask_value_zero",  # the -1e9 mask value (a non-persistent buffer, absent from the checkpoint) left at 0: masked scores become 0, not -1e9
    "lm_head_bias_wrong",  # the loader takes the unused lm_head.bias instead of lm_head.decoder.bias
]

PADDING_ONLY = ["position_ids_ignored", "mask_not_looked_back"]

CLEAN = [
    "pos_table",  # axial encodings gathered from a table precomputed at build instead of from the two factors per call
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight
    "dense_banded",  # full T x T attention with a chunk-aligned band mask instead of chunking with look-back
    "sdpa_softmax",  # F.scaled_dot_product_attention with an additive -1e9 mask, scale on the scores not the keys
    "split_head",  # final norm with joint 2D stats, then the head as two per-stream matmuls summed (no concat)
]


def _bug():
    return BUG


class ReformerPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cfg = config
        D = config.hidden_size
        H = config.num_attention_heads
        d = config.attention_head_size
        L = config.num_hidden_layers
        Fd = config.feed_forward_size
        V = config.vocab_size
        S0, S1 = config.axial_pos_shape
        D0, D1 = config.axial_pos_embds_dim
        self.D, self.H, self.d, self.L = D, H, d, L
        self.S0, self.S1 = S0, S1
        self.eps = config.layer_norm_eps
        self.tok_emb = nn.Parameter(torch.zeros(V, D))
        self.axial0 = nn.Parameter(torch.zeros(S0, D0))
        self.axial1 = nn.Parameter(torch.zeros(S1, D1))
        self.ln_attn = nn.Parameter(torch.zeros(L, 2, D))
        self.w_qkv = nn.Parameter(torch.zeros(L, D, 3 * H * d))
        self.w_out = nn.Parameter(torch.zeros(L, H * d, D))
        self.ln_ffn = nn.Parameter(torch.zeros(L, 2, D))
        self.w_ff1 = nn.Parameter(torch.zeros(L, D, Fd))
        self.b_ff1 = nn.Parameter(torch.zeros(L, Fd))
        self.w_ff2 = nn.Parameter(torch.zeros(L, Fd, D))
        self.b_ff2 = nn.Parameter(torch.zeros(L, D))
        self.ln_final = nn.Parameter(torch.zeros(2, 2 * D))
        self.w_head = nn.Parameter(torch.zeros(2 * D, V))
        self.b_head = nn.Parameter(torch.zeros(V))
        self.register_buffer("pos_table", torch.zeros(S0 * S1, D), persistent=False)

    # ------------------------------------------------------------------ embeddings
    def _axial(self, pos):
        bug = _bug()
        if bug == "pos_table":
            return self.pos_table[pos]
        if bug == "axial_flatten_order":
            rows, cols = pos % self.S0, pos // self.S0
        else:
            rows, cols = pos // self.S1, pos % self.S1
        return torch.cat([self.axial0[rows], self.axial1[cols]], dim=-1)

    # ------------------------------------------------------------------ attention
    def _chunk_len(self):
        if _bug() == "chunk_len_from_lsh":
            return self.cfg.lsh_attn_chunk_length
        return self.cfg.local_attn_chunk_length

    def _mask_scores(self, scores, mask):
        fill = 0.0 if _bug() == "mask_value_zero" else -1e9
        return torch.where(mask, scores, torch.full((), fill, dtype=scores.dtype))

    def _attend(self, q, k, v, mask, scale_scores=1.0):
        """q (..., Tq, d), k/v (..., Tk, d) with k already scaled; mask broadcastable bool (..., Tq, Tk)."""
        bug = _bug()
        if bug == "sdpa_softmax":
            # undo the key scaling: sdpa scales the scores itself
            k = k * math.sqrt(self.d)
            add = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -1e9)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=1.0 / math.sqrt(self.d))
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale_scores
        scores = self._mask_scores(scores, mask)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        return torch.matmul(torch.exp(scores - lse), v)

    def _local_attention(self, q, k, v, key_ok):
        """q, k, v: (B, H, T, d) (k scaled); key_ok: (B, T) bool. Returns (B, H, T, d)."""
        bug = _bug()
        B, H, T, d = q.shape
        c = self._chunk_len()
        nb = self.cfg.local_num_chunks_before
        na = self.cfg.local_num_chunks_after
        scale = 1.0 / math.sqrt(d) if bug == "double_scale" else 1.0
        if bug == "dense_banded":
            i = torch.arange(T)[:, None]
            j = torch.arange(T)[None, :]
            if T <= c:
                band = j <= i
            else:
                lo = (i // c - nb) * c
                hi = (i // c + na + 1) * c
                band = (j >= lo) & (j < hi) & (j <= i)
            mask = band[None, None] & key_ok[:, None, None, :]
            return self._attend(q, k, v, mask, scale)
        n = -(-T // c)
        Tp = n * c
        if Tp != T:
            padz = (0, 0, 0, Tp - T)
            q, k, v = F.pad(q, padz), F.pad(k, padz), F.pad(v, padz)
            key_ok = F.pad(key_ok, (0, Tp - T), value=False)
        idx = torch.arange(Tp)
        if n == 1:  # no longer than one chunk: plain causal attention
            cmp = torch.gt if bug == "causal_strict" else torch.ge
            mask = cmp(idx[:, None], idx[None, :])[None, None] & key_ok[:, None, None, :]
            out = self._attend(q, k, v, mask, scale)
            return out[:, :, :T]
        qc = q.reshape(B, H, n, c, d)
        kc = k.reshape(B, H, n, c, d)
        vc = v.reshape(B, H, n, c, d)
        kidx = idx.view(n, c)
        okc = key_ok.view(B, n, c)
        sign = -1 if bug == "lookback_wrong_direction" else 1
        shifts = [sign * s for s in range(nb, 0, -1)] + [0] + [-s for s in range(1, na + 1)]

        def look(x, dim):
            return torch.cat([torch.roll(x, s, dims=dim) if s else x for s in shifts], dim=dim + 1)

        k_all = look(kc, 2)  # (B, H, n, W*c, d)
        v_all = look(vc, 2)
        kidx_all = look(kidx, 0)  # (n, W*c)
        if bug == "mask_not_looked_back":
            ok_all = torch.cat([okc] * len(shifts), dim=2)
        else:
            ok_all = look(okc, 1)  # (B, n, W*c)
        if bug == "first_chunk_wraparound":
            # offsets inside the (look-back + own chunk) window: slot j is visible if j <= nb*c + i
            qi = torch.arange(c)[:, None]
            kj = torch.arange(len(shifts) * c)[None, :]
            causal = (kj <= qi + nb * c)[None].expand(n, c, len(shifts) * c)
        else:
            cmp = torch.gt if bug == "causal_strict" else torch.ge
            causal = cmp(kidx[:, :, None], kidx_all[:, None, :])  # (n, c, W*c)
        mask = causal[None, None] & ok_all[:, None, :, None, :]
        out = self._attend(qc, k_all, v_all, mask, scale)
        return out.reshape(B, H, Tp, d)[:, :, :T]

    def _attention_block(self, i, x, key_ok):
        bug = _bug()
        B, T, _ = x.shape
        H, d = self.H, self.d
        hd = H * d
        h = F.layer_norm(x, (self.D,), self.ln_attn[i, 0], self.ln_attn[i, 1], self.eps)
        w = self.w_qkv[i]
        if bug == "split_qkv":
            q = h @ w[:, :hd]
            k = h @ w[:, hd : 2 * hd]
            v = h @ w[:, 2 * hd :]
        else:
            q, k, v = (h @ w).split(hd, dim=-1)
        if bug == "shared_qk":
            k = h @ w[:, :hd]

        def heads(t):
            return t.view(B, T, H, d).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        k = k / math.sqrt(d)
        o = self._local_attention(q, k, v, key_ok)
        o = o.transpose(1, 2).reshape(B, T, hd)
        return o @ self.w_out[i]

    def _ffn_block(self, i, x):
        h = F.layer_norm(x, (self.D,), self.ln_ffn[i, 0], self.ln_ffn[i, 1], self.eps)
        h = h @ self.w_ff1[i] + self.b_ff1[i]
        h = F.gelu(h)
        return h @ self.w_ff2[i] + self.b_ff2[i]

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        if position_ids is None or bug == "position_ids_ignored":
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        if attention_mask is None:
            key_ok = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        else:
            key_ok = attention_mask.to(torch.bool)
        e = self.tok_emb[input_ids] + self._axial(position_ids)
        x1, x2 = e, e
        for i in range(self.L):
            if bug == "ffn_reads_old_stream":
                a = self._attention_block(i, x2, key_ok)
                f = self._ffn_block(i, x1)
                x1, x2 = x1 + a, x2 + f
            else:
                x1 = x1 + self._attention_block(i, x2, key_ok)
                x2 = x2 + self._ffn_block(i, x1)
        wn, bn = self.ln_final[0], self.ln_final[1]
        D = self.D
        if bug == "split_head":
            both = torch.stack([x1, x2], dim=-2)  # (B, T, 2, D)
            mu = both.mean(dim=(-2, -1), keepdim=True)
            var = both.var(dim=(-2, -1), unbiased=False, keepdim=True)
            n = (both - mu) * torch.rsqrt(var + self.eps)
            y1 = n[..., 0, :] * wn[:D] + bn[:D]
            y2 = n[..., 1, :] * wn[D:] + bn[D:]
            return y1 @ self.w_head[:D] + y2 @ self.w_head[D:] + self.b_head
        if bug == "final_norm_per_stream":
            y = torch.cat(
                [
                    F.layer_norm(x1, (D,), wn[:D], bn[:D], self.eps),
                    F.layer_norm(x2, (D,), wn[D:], bn[D:], self.eps),
                ],
                dim=-1,
            )
        else:
            y = torch.cat([x2, x1] if bug == "final_concat_order" else [x1, x2], dim=-1)
            y = F.layer_norm(y, (2 * D,), wn, bn, self.eps)
        return y @ self.w_head + self.b_head


def build(state_dict, config):
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    model = ReformerPort(config)
    L = config.num_hidden_layers
    pre = "reformer."
    lay = pre + "encoder.layers.{}."

    def per_layer(name):
        return [sd[lay.format(i) + name] for i in range(L)]

    with torch.no_grad():
        model.tok_emb.copy_(sd[pre + "embeddings.word_embeddings.weight"])
        a0 = sd[pre + "embeddings.position_embeddings.weights.0"]  # (S0, 1, D0)
        a1 = sd[pre + "embeddings.position_embeddings.weights.1"]  # (1, S1, D1)
        model.axial0.copy_(a0.reshape(a0.shape[0], a0.shape[-1]))
        model.axial1.copy_(a1.reshape(a1.shape[1], a1.shape[-1]))
        S0, S1 = model.S0, model.S1
        p = torch.arange(S0 * S1)
        model.pos_table.copy_(torch.cat([model.axial0[p // S1], model.axial1[p % S1]], dim=-1))
        model.ln_attn.copy_(
            torch.stack(
                [
                    torch.stack([w, b])
                    for w, b in zip(per_layer("attention.layer_norm.weight"), per_layer("attention.layer_norm.bias"))
                ]
            )
        )
        q = per_layer("attention.self_attention.query.weight")
        k = per_layer("attention.self_attention.key.weight")
        v = per_layer("attention.self_attention.value.weight")
        model.w_qkv.copy_(torch.stack([torch.cat([qi, ki, vi], dim=0).t() for qi, ki, vi in zip(q, k, v)]))
        model.w_out.copy_(torch.stack([w.t() for w in per_layer("attention.output.dense.weight")]))
        model.ln_ffn.copy_(
            torch.stack(
                [
                    torch.stack([w, b])
                    for w, b in zip(
                        per_layer("feed_forward.layer_norm.weight"), per_layer("feed_forward.layer_norm.bias")
                    )
                ]
            )
        )
        model.w_ff1.copy_(torch.stack([w.t() for w in per_layer("feed_forward.dense.dense.weight")]))
        model.b_ff1.copy_(torch.stack(per_layer("feed_forward.dense.dense.bias")))
        model.w_ff2.copy_(torch.stack([w.t() for w in per_layer("feed_forward.output.dense.weight")]))
        model.b_ff2.copy_(torch.stack(per_layer("feed_forward.output.dense.bias")))
        model.ln_final.copy_(torch.stack([sd[pre + "encoder.layer_norm.weight"], sd[pre + "encoder.layer_norm.bias"]]))
        model.w_head.copy_(sd["lm_head.decoder.weight"].t())
        bias_key = "lm_head.bias" if BUG == "lm_head_bias_wrong" else "lm_head.decoder.bias"
        model.b_head.copy_(sd[bias_key])
    return model.float().eval()
