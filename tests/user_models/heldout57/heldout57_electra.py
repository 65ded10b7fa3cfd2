"""A from-scratch PyTorch port of ELECTRA's generator used as a causal LM (``ElectraForCausalLM``, is_decoder=True).

Architecture (E = embedding_size, H = hidden_size, nh = num_attention_heads, hd = H / nh, I = intermediate_size,
L = num_hidden_layers, V = vocab_size; LN(x) = (x - mean) / sqrt(biased_var + layer_norm_eps) * g + b over the
last axis; gelu is the exact erf GELU, 0.5 x (1 + erf(x / sqrt 2))):

  embeddings (width E):
    pos   = position_ids if given, else arange(T)             (plain BERT positions, starting at 0)
    tt    = token_type_ids default: all zeros (HF gathers its zero buffer by position -> always type 0)
    e     = tok[input_ids] + typ[tt] + pos_table[pos]            (B, T, E)
    e     = LN_emb(e)
    x     = e @ Wp + bp                                          (B, T, H)   embeddings_project (E != H)
  each of L post-norm (BERT) layers:
    q, k, v = split(x @ Wqkv + bqkv)  into (B, nh, T, hd) each    (fused [q | k | v] along the output axis)
    s     = q k^T / sqrt(hd) + M                                  M: additive mask, 0 where allowed, finfo.min where
                                                                  not; allowed(i, j) = (j <= i) AND attention_mask[b, j]
    a     = softmax(s, -1) v  -> (B, T, H)
    x     = LN1(x + a @ Wo + bo)
    x     = LN2(x + gelu(x @ W1 + b1) @ W2 + b2)
  generator head:
    h      = LN_head(gelu(x @ Wg + bg))                           (B, T, E)
    logits = h @ Wlm + blm                                        (B, T, V)  (untied: tie_word_embeddings=False)

Weight layout (all matrices stored transposed, in -> out; per-layer tensors stacked on a leading L axis):
  tok (V, E), pos_table (P, E), typ (type_vocab, E), emb_norm (2, E) = [gain; bias]
  proj (E + 1, H): augmented matrix, rows 0..E-1 = Wp^T, last row = bias
  wqkv (L, H, 3H) = [Wq^T | Wk^T | Wv^T], bqkv (L, 3H)
  wo (L, H, H), bo (L, H), norm1 (L, 2, H)
  w1 (L, H, I), b1 (L, I), w2 (L, I, H), b2 (L, H), norm2 (L, 2, H)
  head_w (H, E), head_b (E), head_norm (2, E), lm_w (E, V), lm_b (V)
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "gelu_fast_approx",  # FFN maps hidden_act="gelu" to the sigmoid approximation x*sigmoid(1.702x), not the exact erf GELU
    "head_norm_before_act",  # generator head applies its LayerNorm before the GELU (HF: dense -> gelu -> LayerNorm)
    "embed_scale_sqrt",  # word embeddings multiplied by sqrt(embedding_size) (Marian/T5 scale_embedding); ELECTRA has no scale
    "token_type_skipped",  # no token_type_ids given -> token-type embedding left out (HF adds type-0's row)
    "position_offset",  # default positions start at pad_token_id + 1 (RoBERTa's scheme) instead of 0 as in BERT/ELECTRA
    "qkv_split_interleaved",  # fused QKV output split as per-head interleaved [q_h, k_h, v_h] (NeoX layout), not [q | k | v]
    "heads_transposed",  # hidden split into heads as (head_dim, heads) instead of (heads, head_dim)
    "lm_head_tied",  # generator_lm_head tied to word embeddings (the class's _tied_weights_keys) despite tie_word_embeddings=False
    "ffn_residual_input",  # FFN residual adds the layer's input instead of the attention block's normed output
    "pre_norm",  # LayerNorms applied pre-sublayer (GPT-2 style) instead of BERT's post-norm on the residual sum
    "causal_off_by_one",  # causal mask built with triu(diagonal=2): each token also sees the next one
    "ln_unbiased_var",  # hand-written LayerNorm uses the unbiased (N-1) variance instead of the biased one
    "lm_head_bf16",  # generator_lm_head run in bfloat16 (activations and weights downcast), the logits only upcast afterwards
    "raw_mask_added",  # the 0/1 padding mask added to the scores as-is instead of turned into 0 / finfo.min
]

PADDING_ONLY = ["raw_mask_added"]

CLEAN = [
    "drop_key_bias",  # key bias left out: it adds q.b_k, the same for every key of a query, which softmax ignores
    "fold_type_pos_table",  # type-0 row folded into the position table once (pos_table + typ[0]) and looked up together
    "fold_emb_ln_affine",  # embedding LN's gain/bias folded into embeddings_project: W' = diag(g) Wp, b' = b Wp + bp
    "online_softmax",  # attention over key blocks with a running max / running sum (flash-style), then normalised
    "sdpa",  # F.scaled_dot_product_attention with the same additive float mask
]


def _layer_norm(x, gb, eps):
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    if BUG == "ln_unbiased_var":
        var = xc.pow(2).sum(-1, keepdim=True) / (x.shape[-1] - 1)
    else:
        var = xc.pow(2).mean(-1, keepdim=True)
    return xc * torch.rsqrt(var + eps) * gb[0] + gb[1]


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_fast_approx(x):
    return x * torch.sigmoid(1.702 * x)


class ElectraGeneratorLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, H, I = config.embedding_size, config.hidden_size, config.intermediate_size
        L, V, P = config.num_hidden_layers, config.vocab_size, config.max_position_embeddings
        self.nh = config.num_attention_heads
        self.hd = H // self.nh
        self.eps = config.layer_norm_eps
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.has_proj = E != H
        z = lambda *s: nn.Parameter(torch.zeros(*s))  # noqa: E731
        self.tok = z(V, E)
        self.pos_table = z(P, E)
        self.typ = z(config.type_vocab_size, E)
        self.emb_norm = z(2, E)
        self.proj = z(E + 1, H) if self.has_proj else None
        self.wqkv, self.bqkv = z(L, H, 3 * H), z(L, 3 * H)
        self.wo, self.bo, self.norm1 = z(L, H, H), z(L, H), z(L, 2, H)
        self.w1, self.b1 = z(L, H, I), z(L, I)
        self.w2, self.b2, self.norm2 = z(L, I, H), z(L, H), z(L, 2, H)
        self.head_w, self.head_b, self.head_norm = z(H, E), z(E), z(2, E)
        self.lm_w, self.lm_b = z(E, V), z(V)
        self.L = L

    # ---------------------------------------------------------------- embeddings
    def embed(self, input_ids, position_ids):
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            start = self.pad_token_id + 1 if BUG == "position_offset" else 0
            position_ids = torch.arange(start, start + T, device=dev).unsqueeze(0).expand(B, T)
        if BUG == "fold_type_pos_table":
            table = self.pos_table + self.typ[0]
            e = self.tok[input_ids] + table[position_ids]
        else:
            e = self.tok[input_ids]
            if BUG == "embed_scale_sqrt":
                e = e * math.sqrt(self.tok.shape[1])
            if BUG != "token_type_skipped":
                e = e + self.typ[torch.zeros_like(input_ids)]
            e = e + self.pos_table[position_ids]
        if not self.has_proj:
            return _layer_norm(e, self.emb_norm, self.eps)
        W, b = self.proj[:-1], self.proj[-1]
        if BUG == "fold_emb_ln_affine":
            n = _layer_norm(
                e, torch.stack([torch.ones_like(self.emb_norm[0]), torch.zeros_like(self.emb_norm[1])]), self.eps
            )
            return n @ (self.emb_norm[0][:, None] * W) + (self.emb_norm[1] @ W + b)
        return _layer_norm(e, self.emb_norm, self.eps) @ W + b

    # ---------------------------------------------------------------- mask
    def additive_mask(self, attention_mask, B, T, dtype, dev):
        neg = torch.finfo(dtype).min
        diag = 2 if BUG == "causal_off_by_one" else 1
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=dev), diagonal=diag)
        allowed = (~future)[None, None].expand(B, 1, T, T)
        if attention_mask is not None and BUG == "raw_mask_added":
            causal = torch.zeros(B, 1, T, T, dtype=dtype, device=dev).masked_fill(~allowed, neg)
            return causal + attention_mask[:, None, None, :].to(dtype)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        return torch.zeros(B, 1, T, T, dtype=dtype, device=dev).masked_fill(~allowed, neg)

    # ---------------------------------------------------------------- attention
    def attend(self, q, k, v, mask):
        scale = 1.0 / math.sqrt(self.hd)
        if BUG == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if BUG == "online_softmax":
            T = k.shape[-2]
            blk = 5
            m = torch.full(q.shape[:-1] + (1,), -float("inf"), dtype=q.dtype, device=q.device)
            l = torch.zeros_like(m)  # noqa: E741
            acc = torch.zeros_like(q)
            for s0 in range(0, T, blk):
                s = (q @ k[..., s0 : s0 + blk, :].transpose(-1, -2)) * scale + mask[..., s0 : s0 + blk]
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                p = torch.exp(s - m_new)
                corr = torch.exp(m - m_new)
                l = l * corr + p.sum(-1, keepdim=True)  # noqa: E741
                acc = acc * corr + p @ v[..., s0 : s0 + blk, :]
                m = m_new
            return acc / l
        s = (q @ k.transpose(-1, -2)) * scale + mask
        return torch.softmax(s, dim=-1) @ v

    def self_attention(self, x, i, mask):
        B, T, H = x.shape
        nh, hd = self.nh, self.hd
        bqkv = self.bqkv[i]
        if BUG == "drop_key_bias":
            bqkv = torch.cat([bqkv[:H], torch.zeros_like(bqkv[H : 2 * H]), bqkv[2 * H :]])
        qkv = x @ self.wqkv[i] + bqkv  # (B, T, 3H)
        if BUG == "qkv_split_interleaved":
            q, k, v = qkv.view(B, T, nh, 3, hd).permute(3, 0, 2, 1, 4).unbind(0)
        elif BUG == "heads_transposed":
            q, k, v = qkv.view(B, T, 3, hd, nh).permute(2, 0, 4, 1, 3).unbind(0)
        else:
            q, k, v = qkv.view(B, T, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)
        a = self.attend(q, k, v, mask)  # (B, nh, T, hd)
        return a.transpose(1, 2).reshape(B, T, H) @ self.wo[i] + self.bo[i]

    def layer(self, x, i, mask):
        act = _gelu_fast_approx if BUG == "gelu_fast_approx" else _gelu
        if BUG == "pre_norm":
            x = x + self.self_attention(_layer_norm(x, self.norm1[i], self.eps), i, mask)
            h = _layer_norm(x, self.norm2[i], self.eps)
            return x + act(h @ self.w1[i] + self.b1[i]) @ self.w2[i] + self.b2[i]
        h = _layer_norm(x + self.self_attention(x, i, mask), self.norm1[i], self.eps)
        f = act(h @ self.w1[i] + self.b1[i]) @ self.w2[i] + self.b2[i]
        res = x if BUG == "ffn_residual_input" else h
        return _layer_norm(res + f, self.norm2[i], self.eps)

    # ---------------------------------------------------------------- head / forward
    def head(self, x):
        h = x @ self.head_w + self.head_b
        if BUG == "head_norm_before_act":
            h = _gelu(_layer_norm(h, self.head_norm, self.eps))
        else:
            h = _layer_norm(_gelu(h), self.head_norm, self.eps)
        lm_w = self.tok.t() if BUG == "lm_head_tied" else self.lm_w
        if BUG == "lm_head_bf16":
            return (h.bfloat16() @ lm_w.bfloat16() + self.lm_b.bfloat16()).float()
        return h @ lm_w + self.lm_b

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        x = self.embed(input_ids, position_ids)
        mask = self.additive_mask(attention_mask, B, T, x.dtype, x.device)
        for i in range(self.L):
            x = self.layer(x, i, mask)
        return self.head(x)


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    pre = "electra."
    model = ElectraGeneratorLM(config)
    L = config.num_hidden_layers
    lay = lambda i, name: sd[f"{pre}encoder.layer.{i}.{name}"]  # noqa: E731
    with torch.no_grad():
        model.tok.copy_(sd[pre + "embeddings.word_embeddings.weight"])
        model.pos_table.copy_(sd[pre + "embeddings.position_embeddings.weight"])
        model.typ.copy_(sd[pre + "embeddings.token_type_embeddings.weight"])
        model.emb_norm.copy_(
            torch.stack([sd[pre + "embeddings.LayerNorm.weight"], sd[pre + "embeddings.LayerNorm.bias"]])
        )
        if model.has_proj:
            model.proj.copy_(
                torch.cat([sd[pre + "embeddings_project.weight"].t(), sd[pre + "embeddings_project.bias"][None]])
            )
        for i in range(L):
            a = "attention.self."
            model.wqkv[i].copy_(torch.cat([lay(i, a + n + ".weight").t() for n in ("query", "key", "value")], 1))
            model.bqkv[i].copy_(torch.cat([lay(i, a + n + ".bias") for n in ("query", "key", "value")]))
            model.wo[i].copy_(lay(i, "attention.output.dense.weight").t())
            model.bo[i].copy_(lay(i, "attention.output.dense.bias"))
            model.norm1[i].copy_(
                torch.stack([lay(i, "attention.output.LayerNorm.weight"), lay(i, "attention.output.LayerNorm.bias")])
            )
            model.w1[i].copy_(lay(i, "intermediate.dense.weight").t())
            model.b1[i].copy_(lay(i, "intermediate.dense.bias"))
            model.w2[i].copy_(lay(i, "output.dense.weight").t())
            model.b2[i].copy_(lay(i, "output.dense.bias"))
            model.norm2[i].copy_(torch.stack([lay(i, "output.LayerNorm.weight"), lay(i, "output.LayerNorm.bias")]))
        model.head_w.copy_(sd["generator_predictions.dense.weight"].t())
        model.head_b.copy_(sd["generator_predictions.dense.bias"])
        model.head_norm.copy_(
            torch.stack([sd["generator_predictions.LayerNorm.weight"], sd["generator_predictions.LayerNorm.bias"]])
        )
        lm = sd.get("generator_lm_head.weight", sd[pre + "embeddings.word_embeddings.weight"])
        model.lm_w.copy_(lm.t())
        model.lm_b.copy_(sd["generator_lm_head.bias"])
    return model.float().eval()
