"""A from-scratch PyTorch port of BlenderbotSmall's decoder as a causal LM (BlenderbotSmallForCausalLM).

Architecture (as implemented here; D = d_model, H = decoder_attention_heads, hd = D / H, F = decoder_ffn_dim,
L = decoder_layers, V = vocab_size, P = max_position_embeddings, T = sequence length):

  Embeddings
    e_t   = E[input_ids]                                   (B, T, D)   token table E (V, D)
    e_t   = LayerNorm_emb(e_t)                              the embedding LayerNorm acts on the token
                                                            embeddings ONLY, before positions are added
    p     = Ppos[arange(T)]                                 (T, D)      learned table, no offset (unlike BART's +2);
                                                            positions always count 0..T-1 (a position_ids
                                                            argument is accepted and ignored, as the reference does)
    h     = e_t + p
    Note: config.scale_embedding (sqrt(D)) belongs to the token embeddings, but the installed Transformers'
    decoder does not multiply by it; since LayerNorm_emb follows directly, a scale there would only move eps.
    This port applies no scale.

  Decoder layer (post-norm, L times; the checkpoint's encoder_attn / encoder_attn_layer_norm are unused: no
  encoder, no cross-attention)
    q = (h Wq + bq) * hd^-0.5,  k = h Wk + bk,  v = h Wv + bv          split into H heads of hd
    s = q k^T  + mask;   mask = 0 where (key j <= query i) and attention_mask[b, j] == 1, else finfo.min
    a = softmax(s, -1) v  -> merge heads -> a Wo + bo
    h = LayerNorm_attn(h + a)
    f = gelu_erf(h W1 + b1) W2 + b2
    h = LayerNorm_ffn(h + f)
    (LayerNorm eps 1e-5, elementwise affine)

  Head
    logits = h E^T          (tied to the token table; the CausalLM has no final_logits_bias)

Weight layout (own names, stacked over layers, matrices stored in -> out, i.e. transposed w.r.t. nn.Linear):
    tok_emb   (V, D)          pos_table (P, D)          emb_norm (2, D)   [weight; bias]
    qkv_w     (L, D, 3D)      columns [q | k | v]        qkv_b (L, 3D)
    out_w     (L, D, D)       out_b (L, D)
    up_w      (L, D, F)       up_b (L, F)
    down_w    (L, F, D)       down_b (L, D)
    norms     (L, 3, 2, D)    [attn, ffn, cross] x [weight; bias]; "cross" is the checkpoint's
                              encoder_attn_layer_norm, kept but not used by the correct model
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "norm_after_positions",  # BART-style: layernorm_embedding applied to (tokens + positions) instead of tokens only
    "scale_after_norm",  # embed_scale sqrt(d_model) multiplied after layernorm_embedding, where it no longer cancels
    "bart_position_offset",  # BART's learned-position offset of 2 added to the position indices (BlenderbotSmall has none)
    "use_position_ids",  # positions taken from the passed position_ids; the reference always counts 0..T-1
    "scale_full_dim",  # query scaling d_model**-0.5 instead of head_dim**-0.5
    "fold_scale_weight_only",  # hd**-0.5 folded into q_proj's weight at load time but not into its bias
    "prenorm_layers",  # Blenderbot (large)-style pre-norm layers instead of BlenderbotSmall's post-norm
    "gelu_tanh",  # activation_function "gelu" ported as the tanh approximation instead of exact erf GELU
    "padmask_on_queries",  # padding mask broadcast over the query axis instead of the key axis
    "causal_diag",  # causal mask built with triu(diagonal=0): each token is barred from attending to itself
    "qkv_concat_order",  # fused qkv concatenated in the checkpoint's module order (k, v, q) but split as (q, k, v)
    "ffn_residual_prenorm",  # FFN residual taken from (h + attn) before self_attn_layer_norm instead of after it
    "encoder_attn_norm_applied",  # cross-attention skipped but its encoder_attn_layer_norm still applied
    "t5_tied_rescale",  # T5-style d_model**-0.5 rescale of the hidden state before the tied LM head
]

PADDING_ONLY = ["use_position_ids", "padmask_on_queries"]

CLEAN = [
    "fold_q_scale",  # hd**-0.5 folded into q_proj's weight AND bias at load time, scores left unscaled
    "drop_k_bias",  # k_proj bias dropped: q.bk is constant over keys and cancels in the softmax
    "fold_v_bias",  # v_proj bias folded into out_proj's bias (bo + bv Wo), as softmax rows sum to 1
    "sdpa",  # attention via F.scaled_dot_product_attention with an additive float mask
    "manual_layernorm",  # LayerNorm written out as mean / biased variance / rsqrt instead of F.layer_norm
]

_EPS = 1e-5


def _layer_norm(x, w, b):
    if BUG == "manual_layernorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + _EPS) * w + b
    return F.layer_norm(x, (x.shape[-1],), w, b, _EPS)


def _gelu(x):
    if BUG == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


def _attention_bias(attention_mask, batch, seq, device, dtype):
    """Additive mask (B, 1, T, T): 0 where allowed, finfo.min elsewhere."""
    diag = 0 if BUG == "causal_diag" else 1
    blocked = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=diag)
    allowed = (~blocked)[None, None].expand(batch, 1, seq, seq)
    if attention_mask is not None:
        keep = attention_mask.to(torch.bool)
        if BUG == "padmask_on_queries":
            allowed = allowed & keep[:, None, :, None]
        else:
            allowed = allowed & keep[:, None, None, :]
    bias = torch.zeros(batch, 1, seq, seq, dtype=dtype, device=device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


class BlenderbotSmallDecoderLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        D = config.d_model
        L = config.decoder_layers
        Fd = config.decoder_ffn_dim
        V = config.vocab_size
        P = config.max_position_embeddings
        self.d_model = D
        self.n_heads = config.decoder_attention_heads
        self.head_dim = D // self.n_heads
        self.n_layers = L
        self.tok_emb = nn.Parameter(torch.empty(V, D))
        self.pos_table = nn.Parameter(torch.empty(P, D))
        self.emb_norm = nn.Parameter(torch.empty(2, D))
        self.qkv_w = nn.Parameter(torch.empty(L, D, 3 * D))
        self.qkv_b = nn.Parameter(torch.empty(L, 3 * D))
        self.out_w = nn.Parameter(torch.empty(L, D, D))
        self.out_b = nn.Parameter(torch.empty(L, D))
        self.up_w = nn.Parameter(torch.empty(L, D, Fd))
        self.up_b = nn.Parameter(torch.empty(L, Fd))
        self.down_w = nn.Parameter(torch.empty(L, Fd, D))
        self.down_b = nn.Parameter(torch.empty(L, D))
        self.norms = nn.Parameter(torch.empty(L, 3, 2, D))
        # set by build: whether the query scaling already lives in the q weights
        self.q_prescaled = False

    # ---------------------------------------------------------------- attention
    def _attend(self, i, x, bias):
        B, T, D = x.shape
        H, hd = self.n_heads, self.head_dim
        qkv = x @ self.qkv_w[i]
        qb, kb, vb = self.qkv_b[i].split(D)
        q, k, v = qkv.split(D, dim=-1)
        q = q + qb
        if BUG != "drop_k_bias":
            k = k + kb
        if BUG != "fold_v_bias":
            v = v + vb
        q = q.view(B, T, H, hd).transpose(1, 2)
        k = k.view(B, T, H, hd).transpose(1, 2)
        v = v.view(B, T, H, hd).transpose(1, 2)
        if self.q_prescaled:
            scale = 1.0
        elif BUG == "scale_full_dim":
            scale = self.d_model**-0.5
        else:
            scale = hd**-0.5
        if BUG == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        else:
            s = torch.matmul(q * scale, k.transpose(-1, -2)) + bias
            a = torch.matmul(torch.softmax(s, dim=-1), v)
        a = a.transpose(1, 2).reshape(B, T, D)
        out_b = self.out_b[i]
        if BUG == "fold_v_bias":
            out_b = out_b + vb @ self.out_w[i]
        return a @ self.out_w[i] + out_b

    def _ffn(self, i, x):
        return _gelu(x @ self.up_w[i] + self.up_b[i]) @ self.down_w[i] + self.down_b[i]

    def _layer(self, i, h, bias):
        n_attn, n_ffn, n_cross = self.norms[i]
        if BUG == "prenorm_layers":
            h = h + self._attend(i, _layer_norm(h, n_attn[0], n_attn[1]), bias)
            return h + self._ffn(i, _layer_norm(h, n_ffn[0], n_ffn[1]))
        s = h + self._attend(i, h, bias)
        h = _layer_norm(s, n_attn[0], n_attn[1])
        if BUG == "encoder_attn_norm_applied":
            h = _layer_norm(h, n_cross[0], n_cross[1])
        residual = s if BUG == "ffn_residual_prenorm" else h
        return _layer_norm(residual + self._ffn(i, h), n_ffn[0], n_ffn[1])

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        dev = input_ids.device
        tok = self.tok_emb[input_ids]
        if BUG == "use_position_ids" and position_ids is not None:
            pos_idx = position_ids
        else:
            pos_idx = torch.arange(T, device=dev)[None].expand(B, T)
        if BUG == "bart_position_offset":
            pos_idx = pos_idx + 2
        pos = self.pos_table[pos_idx]
        if BUG == "norm_after_positions":
            h = _layer_norm(tok + pos, self.emb_norm[0], self.emb_norm[1])
        else:
            h = _layer_norm(tok, self.emb_norm[0], self.emb_norm[1])
            if BUG == "scale_after_norm":
                h = h * math.sqrt(self.d_model)
            h = h + pos
        bias = _attention_bias(attention_mask, B, T, dev, h.dtype)
        for i in range(self.n_layers):
            h = self._layer(i, h, bias)
        if BUG == "t5_tied_rescale":
            h = h * self.d_model**-0.5
        return h @ self.tok_emb.t()


def build(state_dict, config) -> nn.Module:
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    pre = "model.decoder."
    model = BlenderbotSmallDecoderLM(config)
    L = model.n_layers
    hd = model.head_dim

    def lin(name):  # nn.Linear weight (out, in) -> (in, out), bias
        return sd[name + ".weight"].t(), sd[name + ".bias"]

    def ln(name):
        return torch.stack([sd[name + ".weight"], sd[name + ".bias"]])

    fold = BUG in ("fold_q_scale", "fold_scale_weight_only")
    qkv_w, qkv_b, out_w, out_b, up_w, up_b, down_w, down_b, norms = ([] for _ in range(9))
    for i in range(L):
        p = f"{pre}layers.{i}."
        (qw, qb), (kw, kb), (vw, vb) = (lin(p + f"self_attn.{n}_proj") for n in "qkv")
        if fold:
            qw = qw * hd**-0.5
            if BUG == "fold_q_scale":
                qb = qb * hd**-0.5
        if BUG == "qkv_concat_order":
            qkv_w.append(torch.cat([kw, vw, qw], dim=1))
            qkv_b.append(torch.cat([kb, vb, qb]))
        else:
            qkv_w.append(torch.cat([qw, kw, vw], dim=1))
            qkv_b.append(torch.cat([qb, kb, vb]))
        ow, ob = lin(p + "self_attn.out_proj")
        out_w.append(ow)
        out_b.append(ob)
        w1, b1 = lin(p + "fc1")
        w2, b2 = lin(p + "fc2")
        up_w.append(w1)
        up_b.append(b1)
        down_w.append(w2)
        down_b.append(b2)
        norms.append(
            torch.stack([ln(p + "self_attn_layer_norm"), ln(p + "final_layer_norm"), ln(p + "encoder_attn_layer_norm")])
        )
    with torch.no_grad():
        model.tok_emb.copy_(sd[pre + "embed_tokens.weight"])
        model.pos_table.copy_(sd[pre + "embed_positions.weight"])
        model.emb_norm.copy_(ln(pre + "layernorm_embedding"))
        model.qkv_w.copy_(torch.stack(qkv_w))
        model.qkv_b.copy_(torch.stack(qkv_b))
        model.out_w.copy_(torch.stack(out_w))
        model.out_b.copy_(torch.stack(out_b))
        model.up_w.copy_(torch.stack(up_w))
        model.up_b.copy_(torch.stack(up_b))
        model.down_w.copy_(torch.stack(down_w))
        model.down_b.copy_(torch.stack(down_b))
        model.norms.copy_(torch.stack(norms))
    model.q_prescaled = fold
    return model.float().eval()
