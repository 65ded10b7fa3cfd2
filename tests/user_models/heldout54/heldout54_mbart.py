"""A from-scratch PyTorch port of mBART's decoder used alone as a causal LM (Transformers' ``MBartForCausalLM``).

Architecture (config sizes: D = d_model, H = decoder_attention_heads, hd = D / H, F = decoder_ffn_dim,
L = decoder_layers, V = vocab_size, P = max_position_embeddings):

    x      = E[ids] * s  +  Pos[t]                  s = sqrt(D) if scale_embedding else 1     (B, T, D)
             t = 0 .. T-1: mBART's decoder numbers positions by their index in the sequence (plus any cache
             length); it does NOT count over real tokens and ignores a caller's position_ids. The checkpoint's
             position table has P + 2 rows, row t + 2 holding position t (the fairseq offset of 2).
    x      = LayerNorm_emb(x)                       (layernorm_embedding, eps 1e-5)
    for each of the L pre-norm layers:
        h      = LayerNorm_1(x)
        q,k,v  = h @ Wq + bq,  h @ Wk + bk,  h @ Wv + bv      each split into H heads of hd  -> (B, H, T, hd)
        a      = softmax(q k^T * hd^-0.5 + mask) v             mask: causal (key j <= query i) and key j not padding
        x      = x + (a merged back to (B, T, D)) @ Wo + bo
        h      = LayerNorm_2(x)
        x      = x + gelu_erf(h @ W1 + b1) @ W2 + b2            (activation_function "gelu": the exact, erf GELU)
    x      = LayerNorm_f(x)                          (the decoder's final layer_norm, which mBART adds to BART)
    logits = x @ E^T                                 (LM head tied to the token embeddings, no bias, no scale)

Weight layout (my own; ``build`` converts the Transformers state dict):
    tok          (V, D)          token embedding table, unscaled (also the tied LM head)
    pos          (P, D)          learned positions with the fairseq offset stripped: pos[t] = checkpoint row t + 2
    ln_emb       (2, D)          layernorm_embedding [weight; bias]
    ln_out       (2, D)          final decoder layer_norm [weight; bias]
    stacked over layers (leading dim L), every matrix stored in -> out (transposed from nn.Linear):
    qkv_w        (L, D, 3D)      fused [q | k | v] projections, columns q then k then v
    qkv_b        (L, 3D)
    o_w          (L, D, D)       out_proj
    o_b          (L, D)
    ln_attn      (L, 2, D)       self_attn_layer_norm [weight; bias]
    ln_ffn       (L, 2, D)       final_layer_norm of the layer [weight; bias]
    fc1_w (L, D, F), fc1_b (L, F), fc2_w (L, F, D), fc2_b (L, D)
The encoder-attention weights of the checkpoint (none in MBartForCausalLM with no cross-attention use) are ignored.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "embed_scale_on_sum",  # sqrt(d_model) multiplies (tokens + positions) instead of the token embeddings alone
    "pos_no_offset",  # learned positions read at row t of the checkpoint table, forgetting mBART's offset of 2
    "ln_emb_before_pos",  # layernorm_embedding applied to the token embeddings before the positions are added
    "no_final_layer_norm",  # BART template: the decoder's final layer_norm (mBART-only) is never applied
    "post_norm",  # BART-style post-norm layers (LayerNorm after each residual add) instead of mBART's pre-norm
    "gelu_tanh",  # activation_function "gelu" implemented with the tanh approximation instead of the exact erf GELU
    "scale_d_model",  # attention scores scaled by d_model ** -0.5 instead of head_dim ** -0.5
    "qkv_kvq_order",  # fuses projections in the checkpoint's declaration order (k, v, q) but splits them as q, k, v
    "head_split_axis",  # heads split as (hd, H) instead of (H, hd): each head takes every H-th channel
    "causal_off_by_one",  # causal mask built with tril(diagonal=1): each token also sees the next one
    "pad_mask_query_axis",  # padding mask broadcast over the query axis (B,1,T,1) instead of the key axis (B,1,1,T)
    "positions_over_real_tokens",  # fairseq/M2M100-style positions counted over non-padding tokens (mask cumsum)
    "lm_head_scaled",  # the tied LM head reuses the scaled embedding: logits multiplied by sqrt(d_model)
    "attn_probs_bf16",  # attention probabilities cast to bfloat16 before the product with V
]

PADDING_ONLY = [
    "pad_mask_query_axis",
    "positions_over_real_tokens",
]

CLEAN = [
    "drop_k_bias",  # k_proj bias dropped: q . b_k is constant along the key axis, so the softmax ignores it
    "fold_q_scale",  # head_dim ** -0.5 folded into the q weights and bias at build time, no score scaling
    "sdpa",  # attention by F.scaled_dot_product_attention with an additive float mask
    "fold_embed_scale",  # sqrt(d_model) folded into a pre-scaled lookup table; the head keeps the unscaled one
    "manual_layernorm",  # LayerNorm by hand: (x - mean) * rsqrt(biased var + eps) * w + b
]

LN_EPS = 1e-5


def _bug():
    return BUG


def _layer_norm(x, wb):
    if _bug() == "manual_layernorm":
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + LN_EPS) * wb[0] + wb[1]
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], LN_EPS)


def _gelu(x):
    if _bug() == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


class MBartCausalPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d = config.d_model
        self.n_heads = config.decoder_attention_heads
        self.head_dim = self.d // self.n_heads
        self.n_layers = config.decoder_layers
        self.ffn = config.decoder_ffn_dim
        self.vocab = config.vocab_size
        self.n_pos = config.max_position_embeddings
        self.pos_offset = 2
        self.embed_scale = math.sqrt(self.d) if config.scale_embedding else 1.0
        act = config.activation_function
        if act != "gelu":
            raise ValueError(f"this port implements activation_function 'gelu' only, not {act!r}")
        L, D, Fd = self.n_layers, self.d, self.ffn
        z = torch.zeros
        self.tok = nn.Parameter(z(self.vocab, D))
        self.pos = nn.Parameter(z(self.n_pos, D))
        self.pos_head_rows = nn.Parameter(z(self.pos_offset, D))  # the checkpoint's 2 offset rows, never read
        self.ln_emb = nn.Parameter(z(2, D))
        self.ln_out = nn.Parameter(z(2, D))
        self.qkv_w = nn.Parameter(z(L, D, 3 * D))
        self.qkv_b = nn.Parameter(z(L, 3 * D))
        self.o_w = nn.Parameter(z(L, D, D))
        self.o_b = nn.Parameter(z(L, D))
        self.ln_attn = nn.Parameter(z(L, 2, D))
        self.ln_ffn = nn.Parameter(z(L, 2, D))
        self.fc1_w = nn.Parameter(z(L, D, Fd))
        self.fc1_b = nn.Parameter(z(L, Fd))
        self.fc2_w = nn.Parameter(z(L, Fd, D))
        self.fc2_b = nn.Parameter(z(L, D))
        # build-time variants, filled by build
        self.tok_scaled = None

    # ---------------------------------------------------------------- embeddings
    def _positions(self, input_ids, attention_mask, position_ids):
        B, T = input_ids.shape
        if _bug() == "positions_over_real_tokens" and attention_mask is not None:
            m = attention_mask.long()
            return ((m.cumsum(-1) - 1) * m).clamp(min=0)
        # mBART's decoder ignores position_ids: positions are the sequence index (no cache here)
        return torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)

    def _embed(self, input_ids, attention_mask, position_ids):
        bug = _bug()
        t = self._positions(input_ids, attention_mask, position_ids)
        if bug == "pos_no_offset":
            full = torch.cat([self.pos_head_rows, self.pos], 0)
            p = full[t]
        else:
            p = self.pos[t]
        if bug == "fold_embed_scale" and self.tok_scaled is not None:
            e = self.tok_scaled[input_ids]
        else:
            e = self.tok[input_ids]
            if bug != "embed_scale_on_sum":
                e = e * self.embed_scale
        if bug == "embed_scale_on_sum":
            x = (e + p) * self.embed_scale
        elif bug == "ln_emb_before_pos":
            return _layer_norm(e, self.ln_emb) + p
        else:
            x = e + p
        return _layer_norm(x, self.ln_emb)

    # ---------------------------------------------------------------- attention
    def _mask(self, attention_mask, B, T, device):
        bug = _bug()
        neg = torch.finfo(torch.float32).min
        i = torch.arange(T, device=device)
        if bug == "causal_off_by_one":
            allowed = i[None, :] <= i[:, None] + 1
        else:
            allowed = i[None, :] <= i[:, None]  # key j <= query i
        allowed = allowed[None, None].expand(B, 1, T, T)
        if attention_mask is not None:
            keep = attention_mask.bool()
            if bug == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return torch.zeros(B, 1, T, T, device=device).masked_fill(~allowed, neg)

    def _split_heads(self, x):
        B, T, _ = x.shape
        if _bug() == "head_split_axis":
            return x.view(B, T, self.head_dim, self.n_heads).permute(0, 3, 1, 2)
        return x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

    def _attention(self, h, li, mask):
        bug = _bug()
        B, T, D = h.shape
        qkv = h @ self.qkv_w[li] + self.qkv_b[li]
        q, k, v = qkv.split(D, dim=-1)
        if bug == "drop_k_bias":
            k = h @ self.qkv_w[li][:, D : 2 * D]
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if bug == "fold_q_scale":
            scale = 1.0  # folded into q at build time
        elif bug == "scale_d_model":
            scale = D**-0.5
        else:
            scale = self.head_dim**-0.5
        if bug == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale + mask
            probs = torch.softmax(s, dim=-1)
            if bug == "attn_probs_bf16":
                probs = probs.to(torch.bfloat16).float()
            a = probs @ v
        a = a.transpose(1, 2).reshape(B, T, D)
        return a @ self.o_w[li] + self.o_b[li]

    def _ffn(self, h, li):
        return _gelu(h @ self.fc1_w[li] + self.fc1_b[li]) @ self.fc2_w[li] + self.fc2_b[li]

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        x = self._embed(input_ids, attention_mask, position_ids)
        mask = self._mask(attention_mask, B, T, x.device)
        for li in range(self.n_layers):
            if bug == "post_norm":
                x = _layer_norm(x + self._attention(x, li, mask), self.ln_attn[li])
                x = _layer_norm(x + self._ffn(x, li), self.ln_ffn[li])
            else:
                x = x + self._attention(_layer_norm(x, self.ln_attn[li]), li, mask)
                x = x + self._ffn(_layer_norm(x, self.ln_ffn[li]), li)
        if bug != "no_final_layer_norm":
            x = _layer_norm(x, self.ln_out)
        logits = x @ self.tok.t()
        if bug == "lm_head_scaled":
            logits = logits * self.embed_scale
        return logits


@torch.no_grad()
def build(state_dict, config):
    bug = _bug()
    sd = {k: v.float() for k, v in state_dict.items()}
    pre = "model.decoder."
    m = MBartCausalPort(config)
    L, D = m.n_layers, m.d

    def lin(name):  # nn.Linear weight (out, in) -> (in, out)
        return sd[name + ".weight"].t()

    def ln(name):
        return torch.stack([sd[name + ".weight"], sd[name + ".bias"]])

    tok = sd[pre + "embed_tokens.weight"]
    m.tok.copy_(tok)
    pos_full = sd[pre + "embed_positions.weight"]
    m.pos_head_rows.copy_(pos_full[: m.pos_offset])
    m.pos.copy_(pos_full[m.pos_offset : m.pos_offset + m.n_pos])
    m.ln_emb.copy_(ln(pre + "layernorm_embedding"))
    m.ln_out.copy_(ln(pre + "layer_norm"))
    for i in range(L):
        p = f"{pre}layers.{i}."
        if bug == "qkv_kvq_order":
            order = ("k_proj", "v_proj", "q_proj")  # the order the checkpoint declares them
        else:
            order = ("q_proj", "k_proj", "v_proj")
        ws = [lin(p + "self_attn." + n) for n in order]
        bs = [sd[p + "self_attn." + n + ".bias"] for n in order]
        if bug == "fold_q_scale":
            ws[0] = ws[0] * m.head_dim**-0.5
            bs[0] = bs[0] * m.head_dim**-0.5
        m.qkv_w[i].copy_(torch.cat(ws, dim=1))
        m.qkv_b[i].copy_(torch.cat(bs))
        m.o_w[i].copy_(lin(p + "self_attn.out_proj"))
        m.o_b[i].copy_(sd[p + "self_attn.out_proj.bias"])
        m.ln_attn[i].copy_(ln(p + "self_attn_layer_norm"))
        m.ln_ffn[i].copy_(ln(p + "final_layer_norm"))
        m.fc1_w[i].copy_(lin(p + "fc1"))
        m.fc1_b[i].copy_(sd[p + "fc1.bias"])
        m.fc2_w[i].copy_(lin(p + "fc2"))
        m.fc2_b[i].copy_(sd[p + "fc2.bias"])
    if bug == "fold_embed_scale":
        m.tok_scaled = tok * m.embed_scale
    return m.float().eval()
