"""A from-scratch PyTorch port of RoBERTa used as a causal LM (``RobertaForCausalLM``, ``is_decoder=True``).

Architecture (H = hidden_size, nh = num_attention_heads, d = H / nh, I = intermediate_size, V = vocab_size,
L = num_hidden_layers, p = pad_token_id, eps = layer_norm_eps; LN(x) = (x - mean) / sqrt(var_biased + eps) * g + b):

  positions   pos[b, t] = position_ids[b, t] when given, else the fairseq rule
              pos = cumsum(ids != p) * (ids != p) + p   (real tokens count from p + 1, pad tokens sit at p)
  embeddings  x0 = LN_emb(E_tok[ids] + E_type[0] + E_pos[pos])            (B, T, H), no sqrt(H) scaling
  each layer l (post-LN, BERT style):
              [q | k | v] = x W_qkv[l] + b_qkv[l]                        (B, T, 3H) -> each (B, nh, T, d)
              s = q k^T / sqrt(d) + M,  M[b, i, j] = 0 if j <= i and mask[b, j] = 1 else finfo.min
              a = softmax(s, -1) v  -> (B, T, H) (heads concatenated in head order)
              h = LN1(x + a W_o[l] + b_o[l])
              x = LN2(h + gelu_erf(h W_1[l] + b_1[l]) W_2[l] + b_2[l])
  LM head     z = LN_head(gelu_erf(x W_head + b_head));   logits = z E_tok^T + bias_out   (B, T, V)
              (the decoder is tied to the word embeddings and has its own bias, ``lm_head.bias``)

Weight layout (my own; all matrices stored transposed, in -> out, so y = x @ W + b):
  tok_emb   (V, H)            word embeddings, also the tied output projection
  pos_emb   (P, H)            learned absolute position embeddings (P = max_position_embeddings)
  type_emb  (T_type, H)       token-type embeddings (only row 0 is used)
  emb_ln    (2, H)            [gamma; beta] of the embedding LayerNorm
  w_qkv     (L, H, 3H)        per-layer fused query|key|value, columns [q(nh*d) | k(nh*d) | v(nh*d)]
  b_qkv     (L, 3H)
  w_o       (L, H, H)         attention output dense;     b_o (L, H)
  ln1       (L, 2, H)         attention-output LayerNorm [gamma; beta]
  w_1       (L, H, I)         FFN up;   b_1 (L, I)
  w_2       (L, I, H)         FFN down; b_2 (L, H)
  ln2       (L, 2, H)         FFN-output LayerNorm [gamma; beta]
  head_w    (H, H), head_b (H)  LM-head dense;  head_ln (2, H);  out_bias (V)
  buffer pos_type_table (P, H) = pos_emb + type_emb[0] (used by the CLEAN variant ``folded_pos_type_table``)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "position_offset",  # positions generated as arange(T) from 0, forgetting RoBERTa's padding_idx + 1 offset
    "token_type_dropped",  # token_type_embeddings skipped (type_vocab_size=1 looked unused) though row 0 is added
    "embed_scale_sqrt_d",  # word embeddings multiplied by sqrt(H) as in fairseq's TransformerEncoder (RoBERTa sets no_scale_embedding)
    "pre_ln",  # pre-LN residual x + f(LN(x)) instead of RoBERTa's post-LN LN(x + f(x))
    "ln_unbiased_var",  # LayerNorm variance computed with torch.var's default unbiased (N-1) estimator
    "ffn_bias_after_gelu",  # FFN up-projection bias added after the GELU (a bias-gelu fusion done in the wrong order)
    "head_ln_gelu_swap",  # LM head applies layer_norm before gelu (should be dense -> gelu -> layer_norm)
    "head_bias_dropped",  # tied decoder used without lm_head.bias (the bias lives outside the tied weight)
    "ln_names_swapped",  # loader matches "output.LayerNorm" by suffix: attention-output and FFN-output norms swapped
    "bidirectional",  # config.is_decoder ignored: encoder-style attention with no causal mask
    "qkv_interleave",  # fused QKV output split per head as [nh, 3, d] (Megatron interleave) though packed [3, nh, d]
    "wo_not_transposed",  # attention output dense loaded without transposing (square H x H, so the shape fits)
    "additive_mask_raw",  # the 0/1 attention_mask added to the scores as is, never turned into 0 / -inf
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
]

PADDING_ONLY = ["additive_mask_raw", "pad_mask_query_axis"]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on column slices of the fused weight
    "sdpa",  # F.scaled_dot_product_attention with the same additive float mask
    "manual_layernorm",  # LayerNorm written out: mean, biased variance, rsqrt
    "folded_pos_type_table",  # token-type row 0 folded into a precomputed position table (one gather)
    "head_loop",  # attention computed one head at a time in a Python loop
]


def _bug():
    return BUG


def _layer_norm(x, wb, eps):
    bug = _bug()
    if bug in ("manual_layernorm", "ln_unbiased_var"):
        mean = x.mean(-1, keepdim=True)
        if bug == "ln_unbiased_var":
            var = x.var(-1, keepdim=True)  # unbiased by default
        else:
            var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + eps) * wb[0] + wb[1]
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], eps)


class RobertaCausalPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        L = config.num_hidden_layers
        I = config.intermediate_size
        V = config.vocab_size
        P = config.max_position_embeddings
        self.H, self.L = H, L
        self.nh = config.num_attention_heads
        self.d = H // self.nh
        self.eps = config.layer_norm_eps
        self.pad = config.pad_token_id
        self.is_decoder = bool(getattr(config, "is_decoder", False))
        z = torch.zeros
        self.tok_emb = nn.Parameter(z(V, H))
        self.pos_emb = nn.Parameter(z(P, H))
        self.type_emb = nn.Parameter(z(config.type_vocab_size, H))
        self.emb_ln = nn.Parameter(z(2, H))
        self.w_qkv = nn.Parameter(z(L, H, 3 * H))
        self.b_qkv = nn.Parameter(z(L, 3 * H))
        self.w_o = nn.Parameter(z(L, H, H))
        self.b_o = nn.Parameter(z(L, H))
        self.ln1 = nn.Parameter(z(L, 2, H))
        self.w_1 = nn.Parameter(z(L, H, I))
        self.b_1 = nn.Parameter(z(L, I))
        self.w_2 = nn.Parameter(z(L, I, H))
        self.b_2 = nn.Parameter(z(L, H))
        self.ln2 = nn.Parameter(z(L, 2, H))
        self.head_w = nn.Parameter(z(H, H))
        self.head_b = nn.Parameter(z(H))
        self.head_ln = nn.Parameter(z(2, H))
        self.out_bias = nn.Parameter(z(V))
        self.register_buffer("pos_type_table", z(P, H), persistent=False)

    # ---------------------------------------------------------------- embeddings
    def _positions(self, input_ids, position_ids):
        bug = _bug()
        if position_ids is not None:
            return position_ids
        B, T = input_ids.shape
        if bug == "position_offset":
            return torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        keep = input_ids.ne(self.pad).long()
        return torch.cumsum(keep, dim=1) * keep + self.pad

    def _embed(self, input_ids, pos):
        bug = _bug()
        word = self.tok_emb[input_ids]
        if bug == "embed_scale_sqrt_d":
            word = word * math.sqrt(self.H)
        if bug == "folded_pos_type_table":
            x = word + self.pos_type_table[pos]
        else:
            x = word
            if bug != "token_type_dropped":
                x = x + self.type_emb[0]
            x = x + self.pos_emb[pos]
        return _layer_norm(x, self.emb_ln, self.eps)

    # ---------------------------------------------------------------- attention
    def _mask(self, attention_mask, B, T, device, dtype):
        bug = _bug()
        neg = torch.finfo(dtype).min
        i = torch.arange(T, device=device)
        if self.is_decoder and bug != "bidirectional":
            allowed = (i[None, :] <= i[:, None]).expand(B, T, T)  # [b, query, key]
        else:
            allowed = torch.ones(B, T, T, dtype=torch.bool, device=device)
        if attention_mask is None:
            return torch.zeros(B, 1, T, T, dtype=dtype, device=device).masked_fill(~allowed[:, None], neg)
        if bug == "additive_mask_raw":
            add = torch.zeros(B, T, T, dtype=dtype, device=device).masked_fill(~allowed, neg)
            return (add + attention_mask.to(dtype)[:, None, :])[:, None]
        if bug == "pad_mask_query_axis":
            allowed = allowed & attention_mask.bool()[:, :, None]
        else:
            allowed = allowed & attention_mask.bool()[:, None, :]
        return torch.zeros(B, 1, T, T, dtype=dtype, device=device).masked_fill(~allowed[:, None], neg)

    def _attention(self, x, l, mask):
        bug = _bug()
        B, T, H = x.shape
        nh, d = self.nh, self.d
        if bug == "split_qkv":
            W, b = self.w_qkv[l], self.b_qkv[l]
            q = x @ W[:, :H] + b[:H]
            k = x @ W[:, H : 2 * H] + b[H : 2 * H]
            v = x @ W[:, 2 * H :] + b[2 * H :]
        else:
            qkv = x @ self.w_qkv[l] + self.b_qkv[l]
            if bug == "qkv_interleave":
                qkv = qkv.view(B, T, nh, 3, d)
                q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
            else:
                q, k, v = qkv.split(H, dim=-1)
        q = q.reshape(B, T, nh, d).transpose(1, 2)
        k = k.reshape(B, T, nh, d).transpose(1, 2)
        v = v.reshape(B, T, nh, d).transpose(1, 2)
        scale = 1.0 / math.sqrt(d)
        if bug == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        elif bug == "head_loop":
            outs = []
            for h in range(nh):
                s = (q[:, h] @ k[:, h].transpose(-1, -2)) * scale + mask[:, 0]
                outs.append(torch.softmax(s, dim=-1) @ v[:, h])
            o = torch.stack(outs, dim=1)
        else:
            s = torch.matmul(q, k.transpose(-1, -2)) * scale + mask
            o = torch.matmul(torch.softmax(s, dim=-1), v)
        o = o.transpose(1, 2).reshape(B, T, H)
        return o @ self.w_o[l] + self.b_o[l]

    def _ffn(self, x, l):
        if _bug() == "ffn_bias_after_gelu":
            return (F.gelu(x @ self.w_1[l]) + self.b_1[l]) @ self.w_2[l] + self.b_2[l]
        return F.gelu(x @ self.w_1[l] + self.b_1[l]) @ self.w_2[l] + self.b_2[l]

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        pos = self._positions(input_ids, position_ids)
        x = self._embed(input_ids, pos)
        mask = self._mask(attention_mask, B, T, x.device, x.dtype)
        for l in range(self.L):
            if bug == "pre_ln":
                x = x + self._attention(_layer_norm(x, self.ln1[l], self.eps), l, mask)
                x = x + self._ffn(_layer_norm(x, self.ln2[l], self.eps), l)
            else:
                x = _layer_norm(x + self._attention(x, l, mask), self.ln1[l], self.eps)
                x = _layer_norm(x + self._ffn(x, l), self.ln2[l], self.eps)
        h = x @ self.head_w + self.head_b
        if bug == "head_ln_gelu_swap":
            h = F.gelu(_layer_norm(h, self.head_ln, self.eps))
        else:
            h = _layer_norm(F.gelu(h), self.head_ln, self.eps)
        logits = h @ self.tok_emb.t()
        if bug != "head_bias_dropped":
            logits = logits + self.out_bias
        return logits


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = RobertaCausalPort(config)
    L = config.num_hidden_layers
    pre = "roberta."
    e = pre + "embeddings."

    def lay(l, name):
        return sd[f"{pre}encoder.layer.{l}.{name}"]

    with torch.no_grad():
        model.tok_emb.copy_(sd[e + "word_embeddings.weight"])
        model.pos_emb.copy_(sd[e + "position_embeddings.weight"])
        model.type_emb.copy_(sd[e + "token_type_embeddings.weight"])
        model.emb_ln.copy_(torch.stack([sd[e + "LayerNorm.weight"], sd[e + "LayerNorm.bias"]]))
        for l in range(L):
            a = "attention.self."
            w = torch.cat([lay(l, a + n + ".weight") for n in ("query", "key", "value")], dim=0)  # (3H, H)
            model.w_qkv[l].copy_(w.t())
            model.b_qkv[l].copy_(torch.cat([lay(l, a + n + ".bias") for n in ("query", "key", "value")]))
            wo = lay(l, "attention.output.dense.weight")
            model.w_o[l].copy_(wo if BUG == "wo_not_transposed" else wo.t())
            model.b_o[l].copy_(lay(l, "attention.output.dense.bias"))
            n1, n2 = "attention.output.LayerNorm", "output.LayerNorm"
            if BUG == "ln_names_swapped":
                n1, n2 = n2, n1
            model.ln1[l].copy_(torch.stack([lay(l, n1 + ".weight"), lay(l, n1 + ".bias")]))
            model.w_1[l].copy_(lay(l, "intermediate.dense.weight").t())
            model.b_1[l].copy_(lay(l, "intermediate.dense.bias"))
            model.w_2[l].copy_(lay(l, "output.dense.weight").t())
            model.b_2[l].copy_(lay(l, "output.dense.bias"))
            model.ln2[l].copy_(torch.stack([lay(l, n2 + ".weight"), lay(l, n2 + ".bias")]))
        model.head_w.copy_(sd["lm_head.dense.weight"].t())
        model.head_b.copy_(sd["lm_head.dense.bias"])
        model.head_ln.copy_(torch.stack([sd["lm_head.layer_norm.weight"], sd["lm_head.layer_norm.bias"]]))
        bias = sd.get("lm_head.bias", sd.get("lm_head.decoder.bias"))
        model.out_bias.copy_(bias)
        model.pos_type_table.copy_(model.pos_emb + model.type_emb[0])
    return model.float().eval()
