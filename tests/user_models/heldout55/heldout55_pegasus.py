"""A from-scratch PyTorch port of the Pegasus decoder used alone as a causal LM (``PegasusForCausalLM``).

Architecture (as implemented here; D = d_model, H = decoder_attention_heads, hd = D // H,
F = decoder_ffn_dim, L = decoder_layers, P = max_position_embeddings, V = vocab_size):

    positions  p_t = t                      (0, 1, ..., T-1 for every row; Pegasus counts positions over the
                                             whole row, padding included, and ignores any ``position_ids``;
                                             no BART-style offset of 2)
    x_0        = E[ids] * s + PE[p]         s = sqrt(D) when config.scale_embedding else 1
                                             E: (V, D) token table; PE: (P, D) sinusoidal table as stored in
                                             the checkpoint (sin features in [:D/2], cos features in [D/2:],
                                             not interleaved) -- loaded, never recomputed
    per layer l (pre-norm):
        h   = LN(x; g1, b1)                  LayerNorm, biased variance, eps 1e-5
        q,k,v = h @ Wqkv + bqkv              Wqkv: (D, 3D), heads split as (H, hd) with the head index major
        a   = softmax(q k^T * hd^-0.5 + M)   M: causal + key padding, additive finfo.min
        x   = x + (a v) @ Wo + bo
        h   = LN(x; g2, b2)
        x   = x + act(h @ W1 + b1) @ W2 + b2  act = config.activation_function (relu here)
    y      = LN(x; gf, bf)                   the decoder's final layer_norm
    logits = y @ E^T                         lm_head tied to the (unscaled) token table, no bias
                                             (a ``final_logits_bias`` is added if the checkpoint has one)

The decoder layers' cross-attention (``encoder_attn*``) weights are unused without an encoder and not loaded.

Weight layout (own names, all matrices stored in -> out):
    tok_emb     (V, D)           model.decoder.embed_tokens.weight
    pos_table   (P, D) buffer    model.decoder.embed_positions.weight
    qkv_w       (L, D, 3D)       [q_proj | k_proj | v_proj].weight, transposed and concatenated on out
    qkv_b       (L, 3D)          [q_proj | k_proj | v_proj].bias
    o_w         (L, D, D)        out_proj.weight transposed;  o_b (L, D)
    ln_attn     (L, 2, D)        self_attn_layer_norm [weight; bias]
    ln_ffn      (L, 2, D)        final_layer_norm [weight; bias]
    up_w        (L, D, F)        fc1.weight transposed;  up_b (L, F)
    down_w      (L, F, D)        fc2.weight transposed;  down_b (L, D)
    ln_out      (2, D)           model.decoder.layer_norm [weight; bias]
    logit_bias  (V,) buffer      final_logits_bias if present, else zeros
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "scale_after_pos_add",  # sqrt(d_model) applied to (token + position) embeddings instead of to the tokens only
    "scale_field_misread",  # reads config "scale_embeddings" (misspelt, absent -> False): token embeddings never scaled
    "bart_pos_offset",  # BART/mBART's learned-position offset of 2 carried over: position t looks up row t + 2
    "use_given_position_ids",  # indexes the table with the caller's (padding-aware) position_ids; Pegasus uses 0..T-1
    "pos_table_deinterleaved",  # loader treats the stored table as XLM-interleaved (sin,cos,sin,cos) and "un-interleaves" it
    "tied_head_prescaled",  # sqrt(d_model) folded into the token table at load; the tied lm_head then sees it too
    "bart_post_norm",  # BART/mBART post-norm order (LayerNorm after the residual add) instead of Pegasus's pre-norm
    "q_bias_unscaled",  # hd^-0.5 folded into q_proj's weight only (fairseq-style); q_proj's bias left unscaled
    "scale_by_dmodel",  # attention scores scaled by d_model^-0.5 instead of head_dim^-0.5
    "head_split_interleaved",  # heads split as (hd, H) (head index minor) instead of (H, hd)
    "ln_unbiased_var",  # LayerNorm variance computed with Bessel's correction (torch.var default, / (D-1))
    "gelu_act_hardcoded",  # FFN activation hard-coded to gelu (BART's default) instead of config.activation_function
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
    "softmax_bf16",  # attention scores cast to bfloat16 before the softmax (probabilities rounded to bf16)
]

PADDING_ONLY = [
    "use_given_position_ids",  # the given positions equal 0..T-1 unless a row is left-padded
    "pad_mask_query_axis",  # without padding the mask is all ones
]

CLEAN = [
    "split_qkv",  # q, k, v from three separate matmuls on slices of the fused weight
    "sdpa",  # F.scaled_dot_product_attention with the same additive mask
    "manual_layernorm",  # LayerNorm written out: (x - mean) * rsqrt(biased var + eps) * g + b
    "prescaled_q",  # hd^-0.5 folded into q (weight and bias) before the dot product, none on the scores
    "scaled_input_table",  # a separate sqrt(d_model)-scaled copy of the table for the input; the head keeps the raw one
]


def _bug():
    return BUG


class PegasusCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d = config.d_model
        self.h = config.decoder_attention_heads
        self.hd = self.d // self.h
        self.f = config.decoder_ffn_dim
        self.n_layers = config.decoder_layers
        self.vocab = config.vocab_size
        self.n_pos = config.max_position_embeddings
        self.eps = 1e-5
        self.act_name = config.activation_function
        self.config = config
        L, D, Fd, V, P = self.n_layers, self.d, self.f, self.vocab, self.n_pos
        self.tok_emb = nn.Parameter(torch.zeros(V, D))
        self.register_buffer("pos_table", torch.zeros(P, D))
        self.qkv_w = nn.Parameter(torch.zeros(L, D, 3 * D))
        self.qkv_b = nn.Parameter(torch.zeros(L, 3 * D))
        self.o_w = nn.Parameter(torch.zeros(L, D, D))
        self.o_b = nn.Parameter(torch.zeros(L, D))
        self.ln_attn = nn.Parameter(torch.zeros(L, 2, D))
        self.ln_ffn = nn.Parameter(torch.zeros(L, 2, D))
        self.up_w = nn.Parameter(torch.zeros(L, D, Fd))
        self.up_b = nn.Parameter(torch.zeros(L, Fd))
        self.down_w = nn.Parameter(torch.zeros(L, Fd, D))
        self.down_b = nn.Parameter(torch.zeros(L, D))
        self.ln_out = nn.Parameter(torch.zeros(2, D))
        self.register_buffer("logit_bias", torch.zeros(V))

    # ------------------------------------------------------------------ pieces
    def embed_scale(self):
        bug = _bug()
        if bug == "scale_field_misread":
            flag = getattr(self.config, "scale_embeddings", False)
        else:
            flag = self.config.scale_embedding
        return math.sqrt(self.d) if flag else 1.0

    def layer_norm(self, x, gb):
        g, b = gb[0], gb[1]
        bug = _bug()
        if bug == "ln_unbiased_var":
            mean = x.mean(-1, keepdim=True)
            var = x.var(-1, keepdim=True)  # unbiased
            return (x - mean) / torch.sqrt(var + self.eps) * g + b
        if bug == "manual_layernorm":
            mean = x.mean(-1, keepdim=True)
            xc = x - mean
            var = (xc * xc).mean(-1, keepdim=True)
            return xc * torch.rsqrt(var + self.eps) * g + b
        return F.layer_norm(x, (self.d,), g, b, self.eps)

    def act(self, x):
        if _bug() == "gelu_act_hardcoded":
            return F.gelu(x)
        name = self.act_name
        if name == "relu":
            return F.relu(x)
        if name == "gelu":
            return F.gelu(x)
        if name in ("gelu_new", "gelu_pytorch_tanh"):
            return F.gelu(x, approximate="tanh")
        if name in ("silu", "swish"):
            return F.silu(x)
        if name == "tanh":
            return torch.tanh(x)
        raise ValueError(f"unsupported activation {name}")

    def split_heads(self, t):
        B, T, _ = t.shape
        if _bug() == "head_split_interleaved":
            return t.view(B, T, self.hd, self.h).permute(0, 3, 1, 2)
        return t.view(B, T, self.h, self.hd).transpose(1, 2)

    def attention(self, x, l, mask):
        bug = _bug()
        B, T, D = x.shape
        w, b = self.qkv_w[l], self.qkv_b[l]
        scale = self.hd**-0.5
        if bug == "scale_by_dmodel":
            scale = self.d**-0.5
        if bug == "split_qkv":
            q = x @ w[:, :D] + b[:D]
            k = x @ w[:, D : 2 * D] + b[D : 2 * D]
            v = x @ w[:, 2 * D :] + b[2 * D :]
        else:
            q, k, v = (x @ w + b).split(D, dim=-1)
        score_scale = scale
        if bug == "prescaled_q":
            q = x @ (w[:, :D] * scale) + b[:D] * scale
            score_scale = 1.0
        elif bug == "q_bias_unscaled":
            q = x @ (w[:, :D] * scale) + b[:D]
            score_scale = 1.0
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        if bug == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=score_scale)
        else:
            s = torch.matmul(q, k.transpose(-1, -2)) * score_scale + mask
            if bug == "softmax_bf16":
                p = torch.softmax(s.to(torch.bfloat16), dim=-1).float()
            else:
                p = torch.softmax(s, dim=-1)
            o = torch.matmul(p, v)
        o = o.transpose(1, 2).reshape(B, T, D)
        return o @ self.o_w[l] + self.o_b[l]

    def ffn(self, x, l):
        return self.act(x @ self.up_w[l] + self.up_b[l]) @ self.down_w[l] + self.down_b[l]

    def build_mask(self, attention_mask, B, T, dtype, device):
        neg = torch.finfo(dtype).min
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        allowed = causal[None, None].expand(B, 1, T, T)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if _bug() == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return torch.zeros(B, 1, T, T, dtype=dtype, device=device).masked_fill(~allowed, neg)

    def positions(self, input_ids, position_ids):
        B, T = input_ids.shape
        bug = _bug()
        if bug == "use_given_position_ids" and position_ids is not None:
            return position_ids
        pos = torch.arange(T, device=input_ids.device)
        if bug == "bart_pos_offset":
            pos = pos + 2
        return pos[None].expand(B, T)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        scale = self.embed_scale()
        if bug == "tied_head_prescaled":
            table = self.tok_emb * scale  # folded at load, shared with the head
            tok = table[input_ids]
            head = table
        elif bug == "scaled_input_table":
            table = self.tok_emb * scale
            tok = table[input_ids]
            head = self.tok_emb
        else:
            tok = self.tok_emb[input_ids] * scale
            head = self.tok_emb
        pos_table = self.pos_table
        if bug == "pos_table_deinterleaved":
            P, D = pos_table.shape
            pos_table = pos_table.view(P, D // 2, 2).transpose(1, 2).reshape(P, D)
        pe = pos_table[self.positions(input_ids, position_ids)]
        if bug == "scale_after_pos_add":
            x = (self.tok_emb[input_ids] + pe) * scale
        else:
            x = tok + pe
        mask = self.build_mask(attention_mask, B, T, x.dtype, x.device)
        for l in range(self.n_layers):
            if bug == "bart_post_norm":
                x = self.layer_norm(x + self.attention(x, l, mask), self.ln_attn[l])
                x = self.layer_norm(x + self.ffn(x, l), self.ln_ffn[l])
            else:
                x = x + self.attention(self.layer_norm(x, self.ln_attn[l]), l, mask)
                x = x + self.ffn(self.layer_norm(x, self.ln_ffn[l]), l)
        x = self.layer_norm(x, self.ln_out)
        return x @ head.t() + self.logit_bias


def build(state_dict, config):
    model = PegasusCausalLM(config)
    sd = {k: v.float() for k, v in state_dict.items()}
    p = "model.decoder."
    L = model.n_layers

    def lin(name):
        return sd[name + ".weight"].t(), sd[name + ".bias"]

    def ln(name):
        return torch.stack([sd[name + ".weight"], sd[name + ".bias"]])

    qkv_w, qkv_b, o_w, o_b, la, lf, uw, ub, dw, db = ([] for _ in range(10))
    for l in range(L):
        a = f"{p}layers.{l}."
        ws, bs = zip(*(lin(a + f"self_attn.{n}_proj") for n in ("q", "k", "v")))
        qkv_w.append(torch.cat(ws, dim=1))
        qkv_b.append(torch.cat(bs))
        w, b = lin(a + "self_attn.out_proj")
        o_w.append(w)
        o_b.append(b)
        la.append(ln(a + "self_attn_layer_norm"))
        lf.append(ln(a + "final_layer_norm"))
        w, b = lin(a + "fc1")
        uw.append(w)
        ub.append(b)
        w, b = lin(a + "fc2")
        dw.append(w)
        db.append(b)
    with torch.no_grad():
        model.tok_emb.copy_(sd[p + "embed_tokens.weight"])
        model.pos_table.copy_(sd[p + "embed_positions.weight"])
        model.qkv_w.copy_(torch.stack(qkv_w))
        model.qkv_b.copy_(torch.stack(qkv_b))
        model.o_w.copy_(torch.stack(o_w))
        model.o_b.copy_(torch.stack(o_b))
        model.ln_attn.copy_(torch.stack(la))
        model.ln_ffn.copy_(torch.stack(lf))
        model.up_w.copy_(torch.stack(uw))
        model.up_b.copy_(torch.stack(ub))
        model.down_w.copy_(torch.stack(dw))
        model.down_b.copy_(torch.stack(db))
        model.ln_out.copy_(ln(p + "layer_norm"))
        if "final_logits_bias" in sd:
            model.logit_bias.copy_(sd["final_logits_bias"].reshape(-1))
    return model.float().eval()
