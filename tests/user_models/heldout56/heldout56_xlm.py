"""A from-scratch PyTorch port of XLM as a causal language model (XLMWithLMHeadModel, ``causal=True``).

Architecture (D = emb_dim, H = n_heads, d = D / H, F = 4 D, L = n_layers, V = vocab_size):

  mask  m (B, S): ``attention_mask`` when given, else ``arange(S) < lengths`` with
        ``lengths = (input_ids != pad_index).sum(-1)`` (XLM's right-padding convention)
  pos   p (B, S): ``position_ids`` when given, else ``arange(S)`` (padding gets no offset)
  x0 = LN_emb(E_tok[ids] + E_pos[p] (+ E_lang[langs], only if langs are passed: never here)) * m[..., None]
  each layer l (post-norm):
        q, k, v = split(x W_qkv + b_qkv)        heads: (B, S, H, d) -> (B, H, S, d)
        scores  = (q / sqrt(d)) k^T              (the 1/sqrt(d) is folded into W_q and b_q at load)
        causal:  scores[i, j] = -inf for j > i   (XLM's causal mask ignores padding: padded keys,
                                                  zeroed hidden states, are still attended)
        a       = softmax(scores, fp32) v -> (B, S, D);  x = LN1(x + a W_o + b_o)
        x       = LN2(x + gelu_erf(x W_1 + b_1) W_2 + b_2) * m[..., None]
  logits = x E_tok^T + b_pred                    (prediction layer tied to the token embeddings)

Weight layout (own names; all matrices stored in -> out, layers stacked on a leading L axis):
  tok_emb   (V, D)        token embeddings, also the (tied) output projection
  pos_emb   (P, D)        learned position embeddings
  lang_emb  (n_langs, D)  language embeddings (buffer; unused without ``langs``)
  emb_norm  (2, D)        [weight; bias] of the embedding LayerNorm
  w_qkv     (L, D, 3D)    fused [q | k | v] projections, q columns pre-scaled by 1/sqrt(d)
  b_qkv     (L, 3D)       fused biases, q part pre-scaled by 1/sqrt(d)
  w_o, b_o  (L, D, D), (L, D)
  w_ff1, b_ff1 (L, D, F), (L, F);  w_ff2, b_ff2 (L, F, D), (L, D)
  norms     (L, 2, 2, D)  [layer][0: after attention (layer_norm1), 1: after FFN (layer_norm2)][weight, bias]
  pred_bias (V,)          bias of the prediction layer
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "attn_scale_emb_dim",  # scores scaled by 1/sqrt(emb_dim) instead of 1/sqrt(head_dim)
    "q_bias_unscaled",  # 1/sqrt(head_dim) folded into W_q at load but not into the q bias
    "gelu_sigmoid",  # gelu_activation=True is exact erf GELU, port uses the x*sigmoid(1.702x) approximation
    "pre_norm",  # layers written pre-LN (LN before attention / FFN) instead of XLM's post-LN
    "default_lang_emb",  # adds lang_embeddings[config.lang_id] when no langs are passed (reference adds none)
    "no_pred_bias",  # tied prediction layer written without its bias (pred_layer.proj.bias dropped)
    "pos_offset",  # RoBERTa-style position offset: positions start at pad_index + 1 instead of 0
    "non_causal",  # reads is_encoder=True as bidirectional, ignores config.causal
    "head_split_axis",  # heads split by viewing (B, S, D) as (B, H, S, d) instead of (B, S, H, d)->transpose
    "ffn_residual_pre_ln1",  # FFN residual taken from the layer input (before layer_norm1), not the normed x
    "ln_unbiased_var",  # hand-written LayerNorm uses the unbiased (N-1) variance
    "softmax_bf16",  # attention softmax computed in bfloat16 instead of float32
    "right_pad_lengths",  # hidden-state mask from lengths = mask.sum() (right padding) instead of the mask itself
    "causal_key_padding",  # also masks padded keys in attention; XLM's causal mask does not
]

PADDING_ONLY = ["right_pad_lengths", "causal_key_padding"]

CLEAN = [
    "split_qkv",  # three separate projections on slices of the fused weight instead of one fused matmul
    "drop_k_bias",  # key bias omitted: q.b_k is constant per query row and cancels in softmax
    "sdpa",  # F.scaled_dot_product_attention with a boolean causal mask instead of explicit softmax
    "manual_layernorm",  # LayerNorm written out (mean, biased variance, rsqrt) instead of F.layer_norm
    "scale_scores",  # unscaled q weights kept, 1/sqrt(head_dim) applied to the scores after QK^T
]


def _bug():
    return BUG


def _layer_norm(x, w, b, eps):
    bug = _bug()
    if bug == "ln_unbiased_var":
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True)  # unbiased (N-1)
        return (x - mu) * torch.rsqrt(var + eps) * w + b
    if bug == "manual_layernorm":
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = (xc * xc).mean(-1, keepdim=True)
        return xc * torch.rsqrt(var + eps) * w + b
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _gelu(x):
    if _bug() == "gelu_sigmoid":
        return x * torch.sigmoid(1.702 * x)
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class XLMCausalLM(nn.Module):
    def __init__(self, config, dims):
        super().__init__()
        V, D, P, NL, L, Fd = dims
        self.n_heads = config.n_heads
        self.head_dim = D // self.n_heads
        self.eps = config.layer_norm_eps
        self.pad_index = config.pad_index
        self.causal = bool(config.causal)
        self.is_encoder = bool(getattr(config, "is_encoder", True))
        self.lang_id = getattr(config, "lang_id", 0)
        self.n_layers = L
        self.scale_scores = False  # set by build for the "scale_scores" variant
        self.tok_emb = nn.Parameter(torch.empty(V, D))
        self.pos_emb = nn.Parameter(torch.empty(P, D))
        self.register_buffer("lang_emb", torch.zeros(max(NL, 1), D))
        self.has_lang = False
        self.emb_norm = nn.Parameter(torch.empty(2, D))
        self.w_qkv = nn.Parameter(torch.empty(L, D, 3 * D))
        self.b_qkv = nn.Parameter(torch.empty(L, 3 * D))
        self.w_o = nn.Parameter(torch.empty(L, D, D))
        self.b_o = nn.Parameter(torch.empty(L, D))
        self.w_ff1 = nn.Parameter(torch.empty(L, D, Fd))
        self.b_ff1 = nn.Parameter(torch.empty(L, Fd))
        self.w_ff2 = nn.Parameter(torch.empty(L, Fd, D))
        self.b_ff2 = nn.Parameter(torch.empty(L, D))
        self.norms = nn.Parameter(torch.empty(L, 2, 2, D))
        self.pred_bias = nn.Parameter(torch.empty(V))

    # ---------------------------------------------------------------- attention
    def _attention(self, x, l, mask):
        bug = _bug()
        B, S, D = x.shape
        H, d = self.n_heads, self.head_dim
        W, b = self.w_qkv[l], self.b_qkv[l]
        if bug == "split_qkv":
            q = x @ W[:, :D] + b[:D]
            k = x @ W[:, D : 2 * D] + b[D : 2 * D]
            v = x @ W[:, 2 * D :] + b[2 * D :]
        else:
            q, k, v = (x @ W + b).split(D, dim=-1)
        if bug == "drop_k_bias":
            k = x @ W[:, D : 2 * D]

        if bug == "head_split_axis":
            q, k, v = (t.reshape(B, H, S, d) for t in (q, k, v))
        else:
            q, k, v = (t.view(B, S, H, d).transpose(1, 2) for t in (q, k, v))

        # which keys each query may see: (B, S, S) boolean
        pos = torch.arange(S, device=x.device)
        if self.causal and bug != "non_causal":
            allowed = (pos[None, :] <= pos[:, None]).expand(B, S, S)
            if bug == "causal_key_padding":
                allowed = allowed & (mask[:, None, :] > 0)
        else:  # XLM's non-causal branch: the padding mask over keys
            allowed = (mask[:, None, :] > 0).expand(B, S, S)
        allowed = allowed[:, None]  # (B, 1, S, S)

        if bug == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0)
        else:
            scores = q @ k.transpose(-1, -2)
            if self.scale_scores:
                scores = scores / math.sqrt(d)
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            if bug == "softmax_bf16":
                probs = torch.softmax(scores.to(torch.bfloat16), dim=-1).to(scores.dtype)
            else:
                probs = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
            ctx = probs @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, D)
        return ctx @ self.w_o[l] + self.b_o[l]

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        dev = input_ids.device
        ar = torch.arange(S, device=dev)
        if attention_mask is None:
            lengths = (input_ids != self.pad_index).sum(-1)
            mask = (ar[None, :] < lengths[:, None]).float()
        elif bug == "right_pad_lengths":
            lengths = attention_mask.sum(-1)
            mask = (ar[None, :] < lengths[:, None]).float()
        else:
            mask = attention_mask.float()
        if position_ids is None:
            position_ids = ar[None, :].expand(B, S)
        if bug == "pos_offset":
            position_ids = position_ids + self.pad_index + 1

        x = self.tok_emb[input_ids] + self.pos_emb[position_ids]
        if bug == "default_lang_emb" and self.has_lang:
            x = x + self.lang_emb[self.lang_id]
        x = _layer_norm(x, self.emb_norm[0], self.emb_norm[1], self.eps)
        x = x * mask[..., None]

        for l in range(self.n_layers):
            n1w, n1b = self.norms[l, 0]
            n2w, n2b = self.norms[l, 1]
            if bug == "pre_norm":
                x = x + self._attention(_layer_norm(x, n1w, n1b, self.eps), l, mask)
                h = _layer_norm(x, n2w, n2b, self.eps)
                x = x + _gelu(h @ self.w_ff1[l] + self.b_ff1[l]) @ self.w_ff2[l] + self.b_ff2[l]
            else:
                resid = x + self._attention(x, l, mask)
                x = _layer_norm(resid, n1w, n1b, self.eps)
                ff = _gelu(x @ self.w_ff1[l] + self.b_ff1[l]) @ self.w_ff2[l] + self.b_ff2[l]
                if bug == "ffn_residual_pre_ln1":
                    x = _layer_norm(resid + ff, n2w, n2b, self.eps)
                else:
                    x = _layer_norm(x + ff, n2w, n2b, self.eps)
            x = x * mask[..., None]

        logits = x @ self.tok_emb.t()
        if bug != "no_pred_bias":
            logits = logits + self.pred_bias
        return logits


def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    p = "transformer."
    tok = sd[p + "embeddings.weight"]
    pos = sd[p + "position_embeddings.weight"]
    V, D = tok.shape
    L = config.n_layers
    H = config.n_heads
    d = D // H
    Fd = sd[p + "ffns.0.lin1.weight"].shape[0]
    lang = sd.get(p + "lang_embeddings.weight")
    NL = lang.shape[0] if lang is not None else 1
    model = XLMCausalLM(config, (V, D, pos.shape[0], NL, L, Fd))

    if bug == "scale_scores":
        qs_w = qs_b = 1.0
        model.scale_scores = True
    elif bug == "attn_scale_emb_dim":
        qs_w = qs_b = 1.0 / math.sqrt(D)
    elif bug == "q_bias_unscaled":
        qs_w, qs_b = 1.0 / math.sqrt(d), 1.0
    else:
        qs_w = qs_b = 1.0 / math.sqrt(d)

    def lin(name):
        return sd[name + ".weight"].t(), sd[name + ".bias"]  # (in, out), (out,)

    w_qkv, b_qkv, w_o, b_o, w1, b1, w2, b2, norms = ([] for _ in range(9))
    for l in range(L):
        a = f"{p}attentions.{l}."
        (wq, bq), (wk, bk), (wv, bv) = lin(a + "q_lin"), lin(a + "k_lin"), lin(a + "v_lin")
        w_qkv.append(torch.cat([wq * qs_w, wk, wv], dim=1))
        b_qkv.append(torch.cat([bq * qs_b, bk, bv]))
        wo, bo = lin(a + "out_lin")
        w_o.append(wo)
        b_o.append(bo)
        f1w, f1b = lin(f"{p}ffns.{l}.lin1")
        f2w, f2b = lin(f"{p}ffns.{l}.lin2")
        w1.append(f1w)
        b1.append(f1b)
        w2.append(f2w)
        b2.append(f2b)
        norms.append(
            torch.stack(
                [
                    torch.stack([sd[f"{p}layer_norm1.{l}.weight"], sd[f"{p}layer_norm1.{l}.bias"]]),
                    torch.stack([sd[f"{p}layer_norm2.{l}.weight"], sd[f"{p}layer_norm2.{l}.bias"]]),
                ]
            )
        )

    with torch.no_grad():
        model.tok_emb.copy_(tok)
        model.pos_emb.copy_(pos)
        if lang is not None and config.use_lang_emb and config.n_langs > 1:
            model.lang_emb.copy_(lang)
            model.has_lang = True
        model.emb_norm.copy_(torch.stack([sd[p + "layer_norm_emb.weight"], sd[p + "layer_norm_emb.bias"]]))
        model.w_qkv.copy_(torch.stack(w_qkv))
        model.b_qkv.copy_(torch.stack(b_qkv))
        model.w_o.copy_(torch.stack(w_o))
        model.b_o.copy_(torch.stack(b_o))
        model.w_ff1.copy_(torch.stack(w1))
        model.b_ff1.copy_(torch.stack(b1))
        model.w_ff2.copy_(torch.stack(w2))
        model.b_ff2.copy_(torch.stack(b2))
        model.norms.copy_(torch.stack(norms))
        model.pred_bias.copy_(sd["pred_layer.proj.bias"])
    return model.float().eval()
