"""A from-scratch PyTorch port of XLM-RoBERTa-XL as a causal language model (``is_decoder=True``).

Architecture (D = hidden_size, H = num_attention_heads, d = D / H, I = intermediate_size, L = layers,
V = vocab_size, P = max_position_embeddings, p = pad_token_id, eps = layer_norm_eps):

Embeddings (no embedding LayerNorm, unlike RoBERTa):
    pos[b, t]  = given position_ids, else fairseq-style  cumsum(ids != p)[b, t] * (ids != p)[b, t] + p
                 (real tokens count from p + 1, padding tokens sit at position p)
    x0 = E_tok[ids] + E_type[0] + E_pos[pos]                                     (B, T, D)

L pre-LayerNorm blocks (l = 0..L-1):
    LN(z)  = (z - mean(z)) / sqrt(var_biased(z) + eps) * g + b                   (over the last axis)
    h      = LN_attn(x)
    q, k, v = split(h @ W_qkv + b_qkv)  each (B, T, D) -> (B, H, T, d)  (head-major channel split)
    s      = q k^T * d^-0.5 + M,  M = 0 where key j <= query i and key j is not padding, else -big
    a      = softmax(s, -1) v  -> (B, T, D)
    x      = x + a @ W_o + b_o
    y      = x + gelu(LN_ffn(x) @ W_up + b_up) @ W_down + b_down                 (gelu: exact erf form)
    x      = y
Final: x = LN_final(x)
LM head: logits = LN_head(gelu(x @ W_head + b_head)) @ E_tok^T + bias_out       (B, T, V)
    (the decoder matrix is tied to the word embeddings; its bias is the head's own ``lm_head.bias``)

Weight layout (own names, all matrices stored transposed, in -> out; per-layer tensors stacked on axis 0):
    tok_emb      (V, D)        word embeddings, also the tied decoder matrix
    pos_emb      (P, D)        position embeddings
    type_row     (D,)          token-type embedding row 0 (type_vocab_size = 1)
    norm_g/norm_b (L, 2, D)    per layer [attention LN, FFN LN] gain / shift
    w_qkv        (L, D, 3D)    fused [q | k | v] projection, in -> out
    b_qkv        (L, 3D)
    w_o, b_o     (L, D, D), (L, D)
    w_up, b_up   (L, D, I), (L, I)
    w_down, b_down (L, I, D), (L, D)
    final_g/final_b (D,)       encoder's closing LayerNorm
    head_w, head_b (D, D), (D,) LM head dense (in -> out)
    head_g/head_beta (D,)      LM head LayerNorm
    out_bias     (V,)          decoder bias
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "pos_offset_zero",  # positions computed from input_ids count from 0, dropping fairseq's padding_idx + 1 offset
    "ignore_position_ids",  # given position_ids ignored, positions always recomputed from input_ids (fairseq style)
    "no_type_embedding",  # token-type row 0 not added because type_vocab_size == 1 looked unused
    "final_ln_at_embeddings",  # encoder's closing LayerNorm applied RoBERTa-style to the embeddings instead of after the last block
    "attn_scale_hidden",  # attention scores scaled by hidden_size**-0.5 instead of head_dim**-0.5
    "head_split_transposed",  # channels split into heads as (d, H) instead of (H, d): view(..., d, H).transpose
    "qkv_fuse_order",  # loader fuses the projections as [q | v | k] while forward splits [q | k | v]
    "causal_peek_next",  # causal mask off by one (triu diagonal=2): each query also sees the next token
    "no_pad_mask",  # only the causal mask is built; attention_mask's left padding is ignored
    "softmax_bf16",  # attention probabilities computed / kept in bfloat16 before multiplying V
    "ffn_residual_normed",  # FFN residual adds the LayerNorm'd stream instead of the pre-norm attention output
    "ln_unbiased_var",  # hand-written LayerNorm uses the unbiased variance (torch.var default, / (D-1))
    "head_ln_before_gelu",  # LM head applies its LayerNorm before gelu (dense, LN, gelu) instead of after
    "no_head_bias",  # tied decoder treated as a bias-free projection of the word embeddings: lm_head.bias never added
]

PADDING_ONLY = ["ignore_position_ids", "no_pad_mask"]

CLEAN = [
    "split_qkv",  # three separate q / k / v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # torch's scaled_dot_product_attention with an additive float mask instead of the explicit softmax
    "pos_type_table",  # token-type row folded once into a precomputed position table (E_pos + E_type[0])
    "functional_layernorm",  # F.layer_norm instead of the hand-written mean / variance LayerNorm
    "prescale_query",  # q multiplied by d**-0.5 before q k^T instead of scaling the scores
]


def _layer_norm(x, g, b, eps):
    if BUG == "functional_layernorm":
        return F.layer_norm(x, (x.shape[-1],), g, b, eps)
    mu = x.mean(-1, keepdim=True)
    if BUG == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + eps) * g + b


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class XLMRobertaXLPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        D = config.hidden_size
        H = config.num_attention_heads
        I = config.intermediate_size
        L = config.num_hidden_layers
        V = config.vocab_size
        P = config.max_position_embeddings
        self.D, self.H, self.d, self.L = D, H, D // H, L
        self.eps = config.layer_norm_eps
        self.pad = config.pad_token_id
        self.tok_emb = nn.Parameter(torch.zeros(V, D))
        self.pos_emb = nn.Parameter(torch.zeros(P, D))
        self.type_row = nn.Parameter(torch.zeros(D))
        self.norm_g = nn.Parameter(torch.ones(L, 2, D))
        self.norm_b = nn.Parameter(torch.zeros(L, 2, D))
        self.w_qkv = nn.Parameter(torch.zeros(L, D, 3 * D))
        self.b_qkv = nn.Parameter(torch.zeros(L, 3 * D))
        self.w_o = nn.Parameter(torch.zeros(L, D, D))
        self.b_o = nn.Parameter(torch.zeros(L, D))
        self.w_up = nn.Parameter(torch.zeros(L, D, I))
        self.b_up = nn.Parameter(torch.zeros(L, I))
        self.w_down = nn.Parameter(torch.zeros(L, I, D))
        self.b_down = nn.Parameter(torch.zeros(L, D))
        self.final_g = nn.Parameter(torch.ones(D))
        self.final_b = nn.Parameter(torch.zeros(D))
        self.head_w = nn.Parameter(torch.zeros(D, D))
        self.head_b = nn.Parameter(torch.zeros(D))
        self.head_g = nn.Parameter(torch.ones(D))
        self.head_beta = nn.Parameter(torch.zeros(D))
        self.out_bias = nn.Parameter(torch.zeros(V))

    # ---- embeddings -------------------------------------------------------------------------------------------
    def _positions(self, input_ids, position_ids):
        if position_ids is not None and BUG != "ignore_position_ids":
            return position_ids
        not_pad = input_ids.ne(self.pad).long()
        if BUG == "pos_offset_zero":
            return (torch.cumsum(not_pad, 1) - 1).clamp(min=0) * not_pad
        return torch.cumsum(not_pad, 1) * not_pad + self.pad

    def _embed(self, input_ids, position_ids):
        pos = self._positions(input_ids, position_ids)
        if BUG == "pos_type_table":
            table = self.pos_emb + self.type_row
            return self.tok_emb[input_ids] + table[pos]
        x = self.tok_emb[input_ids]
        if BUG != "no_type_embedding":
            x = x + self.type_row
        return x + self.pos_emb[pos]

    # ---- attention ---------------------------------------------------------------------------------------------
    def _mask(self, attention_mask, B, T, device):
        """Additive (B, 1, T, T) mask: 0 where allowed, the float32 minimum elsewhere."""
        i = torch.arange(T, device=device)
        diag = 2 if BUG == "causal_peek_next" else 1
        blocked = (i[None, :] - i[:, None]) >= diag  # key index - query index
        blocked = blocked[None, None].expand(B, 1, T, T)
        if attention_mask is not None and BUG != "no_pad_mask":
            blocked = blocked | (attention_mask[:, None, None, :] == 0)
        return torch.zeros(B, 1, T, T, device=device).masked_fill(blocked, torch.finfo(torch.float32).min)

    def _heads(self, t):
        B, T, _ = t.shape
        if BUG == "head_split_transposed":
            return t.view(B, T, self.d, self.H).permute(0, 3, 1, 2)
        return t.view(B, T, self.H, self.d).transpose(1, 2)

    def _attention(self, l, h, mask):
        B, T, D = h.shape
        if BUG == "split_qkv":
            w, b = self.w_qkv[l], self.b_qkv[l]
            q = h @ w[:, :D] + b[:D]
            k = h @ w[:, D : 2 * D] + b[D : 2 * D]
            v = h @ w[:, 2 * D :] + b[2 * D :]
        else:
            q, k, v = (h @ self.w_qkv[l] + self.b_qkv[l]).split(D, dim=-1)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        scale = (self.D if BUG == "attn_scale_hidden" else self.d) ** -0.5
        if BUG == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            if BUG == "prescale_query":
                s = (q * scale) @ k.transpose(-1, -2)
            else:
                s = (q @ k.transpose(-1, -2)) * scale
            s = s + mask
            if BUG == "softmax_bf16":
                p = torch.softmax(s.to(torch.bfloat16), dim=-1)
                a = (p @ v.to(torch.bfloat16)).float()
            else:
                p = torch.softmax(s, dim=-1)
                a = p @ v
        a = a.transpose(1, 2).reshape(B, T, D)
        return a @ self.w_o[l] + self.b_o[l]

    # ---- model -------------------------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        x = self._embed(input_ids, position_ids)
        if BUG == "final_ln_at_embeddings":
            x = _layer_norm(x, self.final_g, self.final_b, self.eps)
        mask = self._mask(attention_mask, B, T, x.device)
        for l in range(self.L):
            h = _layer_norm(x, self.norm_g[l, 0], self.norm_b[l, 0], self.eps)
            x = x + self._attention(l, h, mask)
            h = _layer_norm(x, self.norm_g[l, 1], self.norm_b[l, 1], self.eps)
            f = _gelu(h @ self.w_up[l] + self.b_up[l]) @ self.w_down[l] + self.b_down[l]
            x = (h if BUG == "ffn_residual_normed" else x) + f
        if BUG != "final_ln_at_embeddings":
            x = _layer_norm(x, self.final_g, self.final_b, self.eps)
        y = x @ self.head_w + self.head_b
        if BUG == "head_ln_before_gelu":
            y = _gelu(_layer_norm(y, self.head_g, self.head_beta, self.eps))
        else:
            y = _layer_norm(_gelu(y), self.head_g, self.head_beta, self.eps)
        logits = y @ self.tok_emb.t()
        if BUG == "no_head_bias":
            return logits
        return logits + self.out_bias


@torch.no_grad()
def build(state_dict, config) -> nn.Module:
    model = XLMRobertaXLPort(config)
    sd = {k: v.float() for k, v in state_dict.items()}
    emb = "roberta.embeddings."
    model.tok_emb.copy_(sd[emb + "word_embeddings.weight"])
    model.pos_emb.copy_(sd[emb + "position_embeddings.weight"])
    model.type_row.copy_(sd[emb + "token_type_embeddings.weight"][0])
    order = ("query", "value", "key") if BUG == "qkv_fuse_order" else ("query", "key", "value")
    for l in range(config.num_hidden_layers):
        p = f"roberta.encoder.layer.{l}."
        model.norm_g[l, 0] = sd[p + "attention.self_attn_layer_norm.weight"]
        model.norm_b[l, 0] = sd[p + "attention.self_attn_layer_norm.bias"]
        model.norm_g[l, 1] = sd[p + "LayerNorm.weight"]
        model.norm_b[l, 1] = sd[p + "LayerNorm.bias"]
        model.w_qkv[l] = torch.cat([sd[p + f"attention.self.{n}.weight"] for n in order], 0).t()
        model.b_qkv[l] = torch.cat([sd[p + f"attention.self.{n}.bias"] for n in order], 0)
        model.w_o[l] = sd[p + "attention.output.dense.weight"].t()
        model.b_o[l] = sd[p + "attention.output.dense.bias"]
        model.w_up[l] = sd[p + "intermediate.dense.weight"].t()
        model.b_up[l] = sd[p + "intermediate.dense.bias"]
        model.w_down[l] = sd[p + "output.dense.weight"].t()
        model.b_down[l] = sd[p + "output.dense.bias"]
    model.final_g.copy_(sd["roberta.encoder.LayerNorm.weight"])
    model.final_b.copy_(sd["roberta.encoder.LayerNorm.bias"])
    model.head_w.copy_(sd["lm_head.dense.weight"].t())
    model.head_b.copy_(sd["lm_head.dense.bias"])
    model.head_g.copy_(sd["lm_head.layer_norm.weight"])
    model.head_beta.copy_(sd["lm_head.layer_norm.bias"])
    model.out_bias.copy_(sd["lm_head.bias"] if "lm_head.bias" in sd else sd["lm_head.decoder.bias"])
    return model.float().eval()
