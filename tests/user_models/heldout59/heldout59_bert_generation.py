"""A hand-written PyTorch port of BertGenerationDecoder (model type ``bert-generation``), decoder-only use.

Architecture (B batch, S sequence, D hidden_size, H num_attention_heads, d = D / H, I intermediate_size,
V vocab_size, L num_hidden_layers, eps = layer_norm_eps):

  embeddings      pos = position_ids if given else arange(S)            (no token-type embeddings, no offset)
                  x0  = LN_emb(tok[input_ids] + pos_table[pos])          (B, S, D)
  each layer l    qkv = x @ Wqkv[l] + bqkv[l]                            (B, S, 3D) -> q, k, v (B, H, S, d)
                  s   = q k^T * d^-0.5 + M                               (B, H, S, S)
                        M = 0 where key j <= query i and key j is not padding, else finfo(float32).min
                  a   = softmax(s, -1) v  -> (B, S, H*d)  (heads merged back in head-major order)
                  h   = LN1[l](a @ Wo[l] + bo[l] + x)                    post-norm on the residual sum
                  f   = gelu_erf(h @ Wi[l] + bi[l]) @ Wf[l] + bf[l]
                  x   = LN2[l](f + h)                                    residual is the attention block's output
  LM head         logits = x @ Whead + bhead    (bhead is the checkpoint's lm_head.decoder.bias; the head is
                                                  untied from the word embeddings: tie_word_embeddings=False)
  LN(y) = (y - mean(y)) / sqrt(var_biased(y) + eps) * w + b, over the last axis.

Weight layout (all matrices stored transposed, in -> out, and stacked over layers):
  tok        (V, D)            word embedding table
  pos_table  (P, D)            learned absolute position table (P = max_position_embeddings)
  emb_ln     (2, D)            [weight; bias] of the embedding LayerNorm
  w_qkv      (L, D, 3D)        [Wq | Wk | Wv] fused along the output axis
  b_qkv      (L, 3D)
  w_o        (L, D, D),  b_o (L, D)
  ln1        (L, 2, D)         [weight; bias] of the attention-output LayerNorm
  w_in       (L, D, I),  b_in (L, I)
  w_out      (L, I, D),  b_out (L, D)
  ln2        (L, 2, D)         [weight; bias] of the FFN-output LayerNorm
  w_head     (D, V),  b_head (V)
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "lm_head_bias_key",  # loader takes the stray `lm_head.bias` instead of `lm_head.decoder.bias` (the one the head adds; untied here)
    "lm_head_tied",  # ignores tie_word_embeddings=False: the decoder weight is taken from the word embeddings
    "gelu_quick",  # hidden_act "gelu" (exact erf GELU) mapped to the fast sigmoid form x * sigmoid(1.702 x)
    "ln_unbiased_var",  # hand-written LayerNorm uses torch.var's default unbiased (N-1) variance
    "qkv_interleaved_split",  # block-fused [Q;K;V] output split per head as [q_h, k_h, v_h] (GPT-NeoX fused layout)
    "roberta_position_offset",  # positions shifted by pad_token_id + 1 as in RoBERTa; BertGeneration has no offset
    "ignore_position_ids",  # passed position_ids dropped, positions always arange(S) (wrong for left padding)
    "padding_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
    "causal_diagonal",  # causal mask built with triu(diagonal=0): each token is kept from attending itself
    "merge_heads_no_transpose",  # (B, H, S, d) reshaped straight to (B, S, D) without moving heads back
    "attn_out_untransposed",  # the square attention-output dense weight loaded without its transpose
    "ffn_residual_layer_input",  # FFN LayerNorm's residual is the layer input instead of the attention output
    "norm_before_residual",  # post-norm done as LN(sublayer) + residual instead of LN(sublayer + residual)
    "lm_head_bf16",  # LM-head matmul run in bfloat16 (hidden state and head weight downcast), cast back after
]

PADDING_ONLY = [
    "ignore_position_ids",
    "padding_mask_query_axis",
]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask instead of the explicit softmax
    "torch_layernorm",  # F.layer_norm instead of the hand-written mean/variance LayerNorm
    "onehot_embedding",  # token and position lookups as one-hot matmuls against the tables
    "per_head_loop",  # attention computed one head at a time in a Python loop, concatenated after
]


def _layer_norm(x, w, b, eps):
    if BUG == "torch_layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    mean = x.mean(-1, keepdim=True)
    if BUG == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * w + b


def _gelu(x):
    if BUG == "gelu_quick":
        return x * torch.sigmoid(1.702 * x)
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _allowed(seq, attention_mask, device):
    """Boolean (B or 1, 1, S, S): True where query i may attend key j."""
    i = torch.arange(seq, device=device)
    if BUG == "causal_diagonal":
        causal = ~torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=0)
    else:
        causal = i[None, :] <= i[:, None]
    allowed = causal[None, None]
    if attention_mask is not None:
        keep = attention_mask.to(torch.bool)
        if BUG == "padding_mask_query_axis":
            allowed = allowed & keep[:, None, :, None]
        else:
            allowed = allowed & keep[:, None, None, :]
    return allowed


def _attend(q, k, v, allowed, scale):
    """q, k, v (B, H, S, d); returns (B, H, S, d)."""
    if BUG == "sdpa":
        # a fully masked (padding) query row would give NaN in SDPA; let it see everything (never compared,
        # and no real token attends a padding position)
        dead = ~allowed.any(-1, keepdim=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | dead, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class BertGenerationPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = self.d // self.heads
        self.inter = config.intermediate_size
        self.layers = config.num_hidden_layers
        self.eps = config.layer_norm_eps
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        V, D, I, L, P = config.vocab_size, self.d, self.inter, self.layers, config.max_position_embeddings
        self.tok = nn.Parameter(torch.zeros(V, D))
        self.pos_table = nn.Parameter(torch.zeros(P, D))
        self.emb_ln = nn.Parameter(torch.zeros(2, D))
        self.w_qkv = nn.Parameter(torch.zeros(L, D, 3 * D))
        self.b_qkv = nn.Parameter(torch.zeros(L, 3 * D))
        self.w_o = nn.Parameter(torch.zeros(L, D, D))
        self.b_o = nn.Parameter(torch.zeros(L, D))
        self.ln1 = nn.Parameter(torch.zeros(L, 2, D))
        self.w_in = nn.Parameter(torch.zeros(L, D, I))
        self.b_in = nn.Parameter(torch.zeros(L, I))
        self.w_out = nn.Parameter(torch.zeros(L, I, D))
        self.b_out = nn.Parameter(torch.zeros(L, D))
        self.ln2 = nn.Parameter(torch.zeros(L, 2, D))
        self.w_head = nn.Parameter(torch.zeros(D, V))
        self.b_head = nn.Parameter(torch.zeros(V))

    # ------------------------------------------------------------------ embeddings
    def _lookup(self, table, idx):
        if BUG == "onehot_embedding":
            return F.one_hot(idx, table.shape[0]).to(table.dtype) @ table
        return table[idx]

    def embed(self, input_ids, position_ids):
        B, S = input_ids.shape
        if position_ids is None or BUG == "ignore_position_ids":
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        if BUG == "roberta_position_offset":
            position_ids = position_ids + self.pad_id + 1
        x = self._lookup(self.tok, input_ids) + self._lookup(self.pos_table, position_ids)
        return _layer_norm(x, self.emb_ln[0], self.emb_ln[1], self.eps)

    # ------------------------------------------------------------------ attention
    def attention(self, x, l, allowed):
        B, S, D = x.shape
        H, hd = self.heads, self.head_dim
        if BUG == "split_qkv":
            w, b = self.w_qkv[l], self.b_qkv[l]
            q = x @ w[:, :D] + b[:D]
            k = x @ w[:, D : 2 * D] + b[D : 2 * D]
            v = x @ w[:, 2 * D :] + b[2 * D :]
        elif BUG == "qkv_interleaved_split":
            q, k, v = (x @ self.w_qkv[l] + self.b_qkv[l]).view(B, S, H, 3 * hd).split(hd, dim=-1)
            q, k, v = (t.reshape(B, S, D) for t in (q, k, v))
        else:
            q, k, v = (x @ self.w_qkv[l] + self.b_qkv[l]).split(D, dim=-1)
        q, k, v = (t.view(B, S, H, hd).transpose(1, 2) for t in (q, k, v))
        scale = hd**-0.5
        if BUG == "per_head_loop":
            outs = [_attend(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], allowed, scale) for h in range(H)]
            a = torch.cat(outs, dim=1)
        else:
            a = _attend(q, k, v, allowed, scale)
        if BUG == "merge_heads_no_transpose":
            a = a.reshape(B, S, D)
        else:
            a = a.transpose(1, 2).reshape(B, S, D)
        return a @ self.w_o[l] + self.b_o[l]

    def _post_norm(self, sub, residual, ln):
        if BUG == "norm_before_residual":
            return _layer_norm(sub, ln[0], ln[1], self.eps) + residual
        return _layer_norm(sub + residual, ln[0], ln[1], self.eps)

    def layer(self, x, l, allowed):
        h = self._post_norm(self.attention(x, l, allowed), x, self.ln1[l])
        f = _gelu(h @ self.w_in[l] + self.b_in[l]) @ self.w_out[l] + self.b_out[l]
        residual = x if BUG == "ffn_residual_layer_input" else h
        return self._post_norm(f, residual, self.ln2[l])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        x = self.embed(input_ids, position_ids)
        allowed = _allowed(input_ids.shape[1], attention_mask, input_ids.device)
        for l in range(self.layers):
            x = self.layer(x, l, allowed)
        if BUG == "lm_head_bf16":
            return (x.to(torch.bfloat16) @ self.w_head.to(torch.bfloat16)).float() + self.b_head
        return x @ self.w_head + self.b_head


@torch.no_grad()
def build(state_dict, config):
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    model = BertGenerationPort(config)
    e = "bert.embeddings."
    model.tok.copy_(sd[e + "word_embeddings.weight"])
    model.pos_table.copy_(sd[e + "position_embeddings.weight"])
    model.emb_ln.copy_(torch.stack([sd[e + "LayerNorm.weight"], sd[e + "LayerNorm.bias"]]))
    for l in range(config.num_hidden_layers):
        p = f"bert.encoder.layer.{l}."
        a = p + "attention.self."
        model.w_qkv[l].copy_(torch.cat([sd[a + n + ".weight"].t() for n in ("query", "key", "value")], dim=1))
        model.b_qkv[l].copy_(torch.cat([sd[a + n + ".bias"] for n in ("query", "key", "value")]))
        wo = sd[p + "attention.output.dense.weight"]
        model.w_o[l].copy_(wo if BUG == "attn_out_untransposed" else wo.t())
        model.b_o[l].copy_(sd[p + "attention.output.dense.bias"])
        model.ln1[l].copy_(
            torch.stack([sd[p + "attention.output.LayerNorm.weight"], sd[p + "attention.output.LayerNorm.bias"]])
        )
        model.w_in[l].copy_(sd[p + "intermediate.dense.weight"].t())
        model.b_in[l].copy_(sd[p + "intermediate.dense.bias"])
        model.w_out[l].copy_(sd[p + "output.dense.weight"].t())
        model.b_out[l].copy_(sd[p + "output.dense.bias"])
        model.ln2[l].copy_(torch.stack([sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"]]))
    tied = getattr(config, "tie_word_embeddings", False) or BUG == "lm_head_tied"
    head_w = sd[e + "word_embeddings.weight"] if tied else sd["lm_head.decoder.weight"]
    model.w_head.copy_(head_w.t())
    if BUG == "lm_head_bias_key":
        head_b = sd["lm_head.bias"]
    else:
        head_b = sd.get("lm_head.decoder.bias", sd.get("lm_head.bias"))
    model.b_head.copy_(head_b)
    return model.float().eval()
