"""A hand-written PyTorch port of X-MOD (``XmodForCausalLM``) used as a causal decoder.

Architecture (post-norm, ``pre_norm=False``; D = hidden_size, H = num_attention_heads, hd = D / H,
I = intermediate_size, B = D // adapter_reduction_factor, L = num_hidden_layers, N = len(languages)):

  positions   p[b, t] = cumsum_t(ids != pad)[b, t] * (ids != pad)[b, t] + pad      (RoBERTa / fairseq
              positions, first real token at pad + 1, pad tokens at pad), unless ``position_ids`` is given,
              in which case it is used as is.
  embeddings  x = LN_emb(E_tok[ids] + E_type[0] + E_pos[p])                            (B, T, D)
  each layer  (post-norm)
      q, k, v = x Wq + bq, x Wk + bk, x Wv + bv   split into H heads of hd
      a       = softmax(q k^T / sqrt(hd) + mask) v,  mask = causal (is_decoder) + key padding
      h       = LN_attn(a Wo + bo + x)
      f       = gelu(h W1 + b1) W2 + b2 + h                 (exact erf GELU)
      z       = LN_adapter(f)                               (adapter_layer_norm; ln_before_adapter=True:
                                                             the adapter residual is taken AFTER this LN)
      f'      = gelu(z A1[lang] + c1[lang]) A2[lang] + c2[lang] + z
      x       = LN_out(f')                                  (the layer's output LayerNorm, post-norm)
      lang    = index of config.default_language in config.languages (no lang_ids are passed)
  head        y = LN_head(gelu(x Wd + bd));  logits = y E_tok^T + bias_vocab   (decoder tied to E_tok)
  every LN:   (v - mean) / sqrt(biased var + layer_norm_eps) * w + b

Weight layout (my own; all matrices stored transposed, in -> out, stacked over layers):
  tok_emb   (V, D)            the word embeddings, also the tied output projection
  pos_emb   (P, D)            position embeddings
  type_row  (D,)              row 0 of token_type_embeddings (type_vocab_size rows; only type 0 is used)
  emb_ln    (2, D)            [weight; bias] of the embedding LayerNorm
  wqkv      (L, D, 3D)        [Wq | Wk | Wv] fused, in -> out;     bqkv (L, 3D)
  wo        (L, D, D)         attention output projection, in->out; bo   (L, D)
  ln        (L, 3, 2, D)      per layer [attention LN, adapter LN, output LN] x [weight; bias]
  w1        (L, D, I), b1 (L, I); w2 (L, I, D), b2 (L, D)    the feed-forward
  a1        (L, N, D, B), c1 (L, N, B); a2 (L, N, B, D), c2 (L, N, D)   per-language adapters, N in
                                                                         config.languages order
  head_w    (D, D), head_b (D,), head_ln (2, D), vocab_bias (V,)

``BUG`` (module global, read at call time) selects one of ``BUGS`` (a porting mistake) or ``CLEAN`` (an
equivalent formulation); "" is the reference computation.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "pos_pad_idx_hardcoded",  # positions from input ids use fairseq/XLM-R's padding_idx=1 instead of config.pad_token_id
    "given_positions_offset",  # adds the RoBERTa padding_idx+1 offset to caller-supplied position_ids as well
    "type_emb_skipped",  # token_type embedding (type_vocab_size=1) assumed unused and not added to the embeddings
    "default_lang_first",  # with no lang_ids, runs the first language's adapter instead of config.default_language
    "adapter_residual_before_ln",  # ln_before_adapter misread: adapter residual taken before the adapter LayerNorm
    "adapter_uses_output_ln",  # normalises the adapter input with the layer's output LayerNorm, not adapter_layer_norm
    "output_ln_before_adapter",  # post-norm output LayerNorm applied to FFN+residual before the adapter, not after it
    "ffn_residual_pre_ln",  # FFN residual taken from the attention sum before the attention LayerNorm (pre/post-norm mixup)
    "adapter_act_relu",  # adapter bottleneck activation hard-coded to ReLU (AdapterHub default) instead of hidden_act gelu
    "head_ln_before_gelu",  # LM head applies its layer_norm before the gelu instead of dense -> gelu -> layer_norm
    "decoder_bias_dropped",  # tied LM decoder loaded as weight only: lm_head.bias (decoder.bias) never added to the logits
    "no_causal_mask",  # is_decoder ignored: bidirectional (encoder-style) self-attention, no causal mask
    "pad_mask_query_axis",  # the padding mask is broadcast over the query axis instead of the key axis
    "ln_unbiased_var",  # LayerNorm uses the unbiased (N-1) variance (torch.var default) instead of the biased one
]

PADDING_ONLY = [
    "given_positions_offset",
    "pad_mask_query_axis",
]

CLEAN = [
    "drop_key_bias",  # key bias omitted: q.bk is constant over keys for each query, softmax is shift-invariant
    "sdpa",  # F.scaled_dot_product_attention with an additive float mask instead of the explicit softmax
    "online_softmax",  # flash-style loop over key blocks with a running max / running denominator
    "adapter_onehot_mix",  # every language adapter run on all tokens, combined with one-hot language weights
    "fold_type_into_pos",  # precomputed table pos_emb + type_row instead of adding the token-type row separately
]


def _bug():
    return BUG


def _gelu(x):
    return F.gelu(x)


def _adapter_act(x):
    if _bug() == "adapter_act_relu":
        return F.relu(x)
    return F.gelu(x)


def _ln(x, wb, eps):
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=_bug() == "ln_unbiased_var")
    return (x - mean) * torch.rsqrt(var + eps) * wb[0] + wb[1]


class XmodPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        D = config.hidden_size
        L = config.num_hidden_layers
        I = config.intermediate_size
        N = len(config.languages)
        Bn = D // config.adapter_reduction_factor
        V = config.vocab_size
        P = config.max_position_embeddings
        self.D, self.H = D, config.num_attention_heads
        self.hd = D // self.H
        self.eps = config.layer_norm_eps
        self.pad = config.pad_token_id
        self.languages = [str(x) for x in config.languages]
        self.default_language = config.default_language
        self.is_decoder = bool(config.is_decoder)

        def p(*shape):
            return nn.Parameter(torch.zeros(*shape))

        self.tok_emb = p(V, D)
        self.pos_emb = p(P, D)
        self.type_row = p(D)
        self.emb_ln = p(2, D)
        self.wqkv = p(L, D, 3 * D)
        self.bqkv = p(L, 3 * D)
        self.wo = p(L, D, D)
        self.bo = p(L, D)
        self.ln = p(L, 3, 2, D)
        self.w1 = p(L, D, I)
        self.b1 = p(L, I)
        self.w2 = p(L, I, D)
        self.b2 = p(L, D)
        self.a1 = p(L, N, D, Bn)
        self.c1 = p(L, N, Bn)
        self.a2 = p(L, N, Bn, D)
        self.c2 = p(L, N, D)
        self.head_w = p(D, D)
        self.head_b = p(D)
        self.head_ln = p(2, D)
        self.vocab_bias = p(V)

    # ---------------------------------------------------------------- embeddings
    def _positions(self, input_ids, position_ids):
        bug = _bug()
        if position_ids is not None:
            if bug == "given_positions_offset":
                return position_ids + self.pad + 1
            return position_ids
        pad = 1 if bug == "pos_pad_idx_hardcoded" else self.pad
        m = input_ids.ne(pad).long()
        return torch.cumsum(m, dim=1) * m + pad

    def _embed(self, input_ids, position_ids):
        bug = _bug()
        pos = self._positions(input_ids, position_ids)
        x = self.tok_emb[input_ids]
        if bug == "fold_type_into_pos":
            table = self.pos_emb + self.type_row
            x = x + table[pos]
        else:
            if bug != "type_emb_skipped":
                x = x + self.type_row
            x = x + self.pos_emb[pos]
        return _ln(x, self.emb_ln, self.eps)

    # ---------------------------------------------------------------- attention
    def _mask(self, attention_mask, Bsz, T, device):
        """Boolean (Bsz, 1, T, T), True where a query may attend to a key."""
        bug = _bug()
        allowed = torch.ones(T, T, dtype=torch.bool, device=device)
        if self.is_decoder and bug != "no_causal_mask":
            allowed = torch.tril(allowed)
        allowed = allowed[None, None].expand(Bsz, 1, T, T)
        if attention_mask is not None:
            keep = attention_mask.bool()
            if bug == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return allowed

    def _attend(self, q, k, v, allowed):
        bug = _bug()
        scale = 1.0 / math.sqrt(self.hd)
        neg = torch.finfo(q.dtype).min
        if bug == "sdpa":
            add = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, neg)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale)
        if bug == "online_softmax":
            T = k.shape[2]
            blk = 8
            m_run = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
            l_run = torch.zeros_like(m_run)
            acc = torch.zeros_like(q)
            for s in range(0, T, blk):
                kb, vb = k[:, :, s : s + blk], v[:, :, s : s + blk]
                sc = (q @ kb.transpose(-1, -2)) * scale
                sc = sc.masked_fill(~allowed[..., s : s + blk], neg)
                m_new = torch.maximum(m_run, sc.amax(-1, keepdim=True))
                corr = torch.exp(m_run - m_new)
                pexp = torch.exp(sc - m_new)
                l_run = l_run * corr + pexp.sum(-1, keepdim=True)
                acc = acc * corr + pexp @ vb
                m_run = m_new
            return acc / l_run
        sc = (q @ k.transpose(-1, -2)) * scale
        sc = sc.masked_fill(~allowed, neg)
        return torch.softmax(sc, dim=-1) @ v

    # ---------------------------------------------------------------- adapters
    def _adapter(self, i, z, lang):
        bug = _bug()
        if bug == "adapter_onehot_mix":
            N = self.a1.shape[1]
            onehot = F.one_hot(lang, N).to(z.dtype)  # (Bsz, N)
            hid = _adapter_act(torch.einsum("btd,ndk->btnk", z, self.a1[i]) + self.c1[i])
            out = torch.einsum("btnk,nkd->btnd", hid, self.a2[i]) + self.c2[i]
            return torch.einsum("btnd,bn->btd", out, onehot)
        out = torch.zeros_like(z)
        for n in range(self.a1.shape[1]):
            sel = lang == n
            if sel.any():
                zz = z[sel]
                out[sel] = _adapter_act(zz @ self.a1[i, n] + self.c1[i, n]) @ self.a2[i, n] + self.c2[i, n]
        return out

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        Bsz, T = input_ids.shape
        D, H, hd = self.D, self.H, self.hd
        x = self._embed(input_ids, position_ids)
        allowed = self._mask(attention_mask, Bsz, T, input_ids.device)

        lang_name = self.languages[0] if bug == "default_lang_first" else self.default_language
        lang = torch.full((Bsz,), self.languages.index(lang_name), dtype=torch.long, device=input_ids.device)

        for i in range(self.wqkv.shape[0]):
            wqkv, bqkv = self.wqkv[i], self.bqkv[i]
            if bug == "drop_key_bias":
                bqkv = torch.cat([bqkv[:D], torch.zeros_like(bqkv[D : 2 * D]), bqkv[2 * D :]])
            qkv = x @ wqkv + bqkv
            q, k, v = qkv.split(D, dim=-1)
            q, k, v = (t.view(Bsz, T, H, hd).transpose(1, 2) for t in (q, k, v))
            a = self._attend(q, k, v, allowed).transpose(1, 2).reshape(Bsz, T, D)
            s = a @ self.wo[i] + self.bo[i] + x
            h = _ln(s, self.ln[i, 0], self.eps)

            f = _gelu(h @ self.w1[i] + self.b1[i]) @ self.w2[i] + self.b2[i]
            f = f + (s if bug == "ffn_residual_pre_ln" else h)
            if bug == "output_ln_before_adapter":
                f = _ln(f, self.ln[i, 2], self.eps)

            ad_ln = self.ln[i, 2] if bug == "adapter_uses_output_ln" else self.ln[i, 1]
            z = _ln(f, ad_ln, self.eps)
            res = f if bug == "adapter_residual_before_ln" else z
            out = self._adapter(i, z, lang) + res

            if bug == "output_ln_before_adapter":
                x = out
            else:
                x = _ln(out, self.ln[i, 2], self.eps)

        y = x @ self.head_w + self.head_b
        if bug == "head_ln_before_gelu":
            y = _gelu(_ln(y, self.head_ln, self.eps))
        else:
            y = _ln(_gelu(y), self.head_ln, self.eps)
        logits = y @ self.tok_emb.t()
        if bug == "decoder_bias_dropped":
            return logits
        return logits + self.vocab_bias


def build(state_dict, config) -> nn.Module:
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = XmodPort(config)
    L = config.num_hidden_layers
    langs = [str(x) for x in config.languages]
    pre = "roberta."
    emb = pre + "embeddings."

    def lnwb(prefix):
        return torch.stack([sd[prefix + ".weight"], sd[prefix + ".bias"]])

    new = {
        "tok_emb": sd[emb + "word_embeddings.weight"],
        "pos_emb": sd[emb + "position_embeddings.weight"],
        "type_row": sd[emb + "token_type_embeddings.weight"][0],
        "emb_ln": lnwb(emb + "LayerNorm"),
        "head_w": sd["lm_head.dense.weight"].t(),
        "head_b": sd["lm_head.dense.bias"],
        "head_ln": lnwb("lm_head.layer_norm"),
        "vocab_bias": sd.get("lm_head.decoder.bias", sd.get("lm_head.bias")),
    }
    per = {k: [] for k in ["wqkv", "bqkv", "wo", "bo", "ln", "w1", "b1", "w2", "b2", "a1", "c1", "a2", "c2"]}
    for i in range(L):
        lp = f"{pre}encoder.layer.{i}."
        att = lp + "attention.self."
        per["wqkv"].append(torch.cat([sd[att + n + ".weight"].t() for n in ("query", "key", "value")], dim=1))
        per["bqkv"].append(torch.cat([sd[att + n + ".bias"] for n in ("query", "key", "value")]))
        per["wo"].append(sd[lp + "attention.output.dense.weight"].t())
        per["bo"].append(sd[lp + "attention.output.dense.bias"])
        per["ln"].append(
            torch.stack(
                [
                    lnwb(lp + "attention.output.LayerNorm"),
                    lnwb(lp + "output.adapter_layer_norm"),
                    lnwb(lp + "output.LayerNorm"),
                ]
            )
        )
        per["w1"].append(sd[lp + "intermediate.dense.weight"].t())
        per["b1"].append(sd[lp + "intermediate.dense.bias"])
        per["w2"].append(sd[lp + "output.dense.weight"].t())
        per["b2"].append(sd[lp + "output.dense.bias"])
        ad = lp + "output.adapter_modules."
        per["a1"].append(torch.stack([sd[f"{ad}{g}.dense1.weight"].t() for g in langs]))
        per["c1"].append(torch.stack([sd[f"{ad}{g}.dense1.bias"] for g in langs]))
        per["a2"].append(torch.stack([sd[f"{ad}{g}.dense2.weight"].t() for g in langs]))
        per["c2"].append(torch.stack([sd[f"{ad}{g}.dense2.bias"] for g in langs]))
    for k, v in per.items():
        new[k] = torch.stack(v)
    model.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=True)
    return model.float().eval()
