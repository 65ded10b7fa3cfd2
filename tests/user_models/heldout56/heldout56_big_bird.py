"""A hand-written PyTorch port of BigBird as a causal LM (``BigBirdForCausalLM``, attention_type='original_full').

Architecture (B batch, S sequence, H hidden, N heads, D = H / N head size, I intermediate, V vocab, L layers):

  Embeddings
    e   = W_tok[ids] * sqrt(H)            (only when config.rescale_embeddings; the word part alone is scaled)
        + W_type[0]                       (token types are all 0 for a causal LM)
        + W_pos[pos]                      (learned absolute; pos = position_ids, else 0..S-1)
    h_0 = LayerNorm(e; eps=config.layer_norm_eps)

  Each of the L post-norm (BERT-style) layers
    [q | k | v] = h @ W_qkv + b_qkv                          (B, S, 3H), then each split to (B, N, S, D)
    A   = softmax(q k^T / sqrt(D) + M)                       M: causal (key j <= query i) and key padding,
                                                             masked entries at float32 min
    c   = (A v) merged back to (B, S, H)                     head n owns columns n*D .. n*D+D-1
    a   = LayerNorm(c @ W_o + b_o + h)                       (post-norm: residual added before the norm)
    f   = gelu_new(a @ W_up + b_up) @ W_down + b_down        gelu_new(x) = x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))
    h'  = LayerNorm(f + a)

  LM head
    t      = LayerNorm(gelu_new(h_L @ W_t + b_t))
    logits = t @ W_tok^T + b_out                             (decoder tied to the UNSCALED word embeddings,
                                                              its own output-only bias)

  The pooler of the checkpoint (bert.pooler.*) plays no part in the logits and is not loaded.

Weight layout (all matrices stored in -> out, i.e. transposed from nn.Linear; per-layer tensors stacked on dim 0):
  tok_emb   (V, H)        word embeddings, unscaled (also the tied decoder)
  pos_emb   (P, H)        position embeddings
  type_emb  (T, H)        token-type embeddings
  emb_norm  (2, H)        [gamma; beta] of the embedding LayerNorm
  w_qkv     (L, H, 3H)    fused query | key | value;  b_qkv (L, 3H)
  w_o       (L, H, H)     attention output dense;     b_o   (L, H)
  norm_attn (L, 2, H)     [gamma; beta] after attention
  w_up      (L, H, I)     intermediate dense;         b_up  (L, I)
  w_down    (L, I, H)     output dense;               b_down (L, H)
  norm_ffn  (L, 2, H)     [gamma; beta] after the feed-forward
  w_head    (H, H)        head transform dense;       b_head (H)
  norm_head (2, H)        [gamma; beta] of the head transform's LayerNorm
  out_bias  (V)           output-only bias of the decoder (cls.predictions.bias)
  tok_emb_scaled (V, H)   buffer, sqrt(H) * tok_emb, built in build (used by the 'scaled_table' variant)
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "no_embed_rescale",  # config.rescale_embeddings ignored (BERT port): word embeddings not multiplied by sqrt(H)
    "tied_head_rescaled",  # sqrt(H) folded into the word table at load, and the tied LM decoder reuses the scaled table
    "attn_scale_inverted",  # score scale written as head_dim**-0.5 but used as a divisor: q.k * sqrt(D)
    "gelu_sigmoid_approx",  # hidden_act 'gelu_new' mapped to the sigmoid approximation x*sigmoid(1.702x)
    "ln_unbiased_var",  # hand-written LayerNorm uses the unbiased (N-1) variance
    "norm_before_residual",  # attention output: LayerNorm(dense(c)) + h instead of LayerNorm(dense(c) + h)
    "ffn_residual_layer_input",  # feed-forward residual adds the layer's input h, not the attention output a
    "causal_diag_off_by_one",  # causal mask keeps key < query instead of key <= query: a token cannot attend to itself
    "pad_mask_on_queries",  # padding mask broadcast along the query axis instead of the key axis
    "ignore_position_ids",  # given position_ids ignored, positions always 0..S-1 (wrong under left padding)
    "o_proj_not_transposed",  # attention output dense copied (out, in) into the in->out layout without .t()
    "lm_bias_dropped",  # tied decoder applied without its output-only bias cls.predictions.bias
    "head_split_transposed",  # heads split as (S, D, N) instead of (S, N, D): head n takes every N-th column
    "head_act_after_norm",  # LM head transform: LayerNorm then gelu_new instead of gelu_new then LayerNorm
]

PADDING_ONLY = [
    "pad_mask_on_queries",
    "ignore_position_ids",
]

CLEAN = [
    "split_qkv",  # three separate matmuls on slices of the fused weight instead of one fused qkv matmul
    "sdpa",  # F.scaled_dot_product_attention with the additive mask instead of explicit softmax(QK^T)V
    "scaled_table",  # precomputed sqrt(H)-scaled embedding table for input lookup; decoder keeps the unscaled one
    "manual_layernorm",  # hand-written LayerNorm (biased variance) instead of F.layer_norm
    "gelu_builtin_tanh",  # F.gelu(approximate='tanh') instead of the hand-written gelu_new formula
]


def _bug():
    return BUG


def gelu_new(x):
    b = _bug()
    if b == "gelu_sigmoid_approx":
        return x * torch.sigmoid(1.702 * x)
    if b == "gelu_builtin_tanh":
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def layer_norm(x, gb, eps):
    b = _bug()
    gamma, beta = gb[0], gb[1]
    if b in ("manual_layernorm", "ln_unbiased_var"):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=(b == "ln_unbiased_var"))
        return (x - mu) / torch.sqrt(var + eps) * gamma + beta
    return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)


class BigBirdCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        N = config.num_attention_heads
        L = config.num_hidden_layers
        I = config.intermediate_size
        V = config.vocab_size
        P = config.max_position_embeddings
        T = config.type_vocab_size
        self.H, self.N, self.D, self.L = H, N, H // N, L
        self.eps = config.layer_norm_eps
        self.rescale = bool(getattr(config, "rescale_embeddings", False))
        self.is_decoder = bool(getattr(config, "is_decoder", True))

        z = lambda *s: nn.Parameter(torch.zeros(*s))  # noqa: E731
        self.tok_emb = z(V, H)
        self.pos_emb = z(P, H)
        self.type_emb = z(T, H)
        self.emb_norm = z(2, H)
        self.w_qkv = z(L, H, 3 * H)
        self.b_qkv = z(L, 3 * H)
        self.w_o = z(L, H, H)
        self.b_o = z(L, H)
        self.norm_attn = z(L, 2, H)
        self.w_up = z(L, H, I)
        self.b_up = z(L, I)
        self.w_down = z(L, I, H)
        self.b_down = z(L, H)
        self.norm_ffn = z(L, 2, H)
        self.w_head = z(H, H)
        self.b_head = z(H)
        self.norm_head = z(2, H)
        self.out_bias = z(V)
        self.register_buffer("tok_emb_scaled", torch.zeros(V, H), persistent=False)

    # ---------------------------------------------------------------- embeddings
    def embed(self, input_ids, position_ids):
        b = _bug()
        B, S = input_ids.shape
        if b == "scaled_table" and self.rescale:
            x = self.tok_emb_scaled[input_ids]
        elif b == "tied_head_rescaled" and self.rescale:
            x = self.tok_emb[input_ids]  # the table itself was scaled in build
        else:
            x = self.tok_emb[input_ids]
            if self.rescale and b != "no_embed_rescale":
                x = x * (self.H**0.5)
        x = x + self.type_emb[torch.zeros(B, S, dtype=torch.long, device=input_ids.device)]
        if position_ids is None or b == "ignore_position_ids":
            position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
        x = x + self.pos_emb[position_ids]
        return layer_norm(x, self.emb_norm, self.eps)

    # ---------------------------------------------------------------- mask
    def additive_mask(self, attention_mask, B, S, device):
        b = _bug()
        i = torch.arange(S, device=device)
        if self.is_decoder:
            if b == "causal_diag_off_by_one":
                allowed = i[None, :] < i[:, None]
            else:
                allowed = i[None, :] <= i[:, None]  # (query, key)
        else:
            allowed = torch.ones(S, S, dtype=torch.bool, device=device)
        allowed = allowed[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            valid = attention_mask.to(torch.bool)
            if b == "pad_mask_on_queries":
                allowed = allowed & valid[:, None, :, None]
            else:
                allowed = allowed & valid[:, None, None, :]
        neg = torch.finfo(torch.float32).min
        return torch.zeros(B, 1, S, S, device=device).masked_fill(~allowed, neg)

    # ---------------------------------------------------------------- attention
    def split_heads(self, t):
        B, S, _ = t.shape
        if _bug() == "head_split_transposed":
            return t.view(B, S, self.D, self.N).permute(0, 3, 1, 2)
        return t.view(B, S, self.N, self.D).transpose(1, 2)

    def attention(self, h, l, mask):
        b = _bug()
        B, S, H = h.shape
        if b == "split_qkv":
            W, bias = self.w_qkv[l], self.b_qkv[l]
            q = h @ W[:, :H] + bias[:H]
            k = h @ W[:, H : 2 * H] + bias[H : 2 * H]
            v = h @ W[:, 2 * H :] + bias[2 * H :]
        else:
            q, k, v = (h @ self.w_qkv[l] + self.b_qkv[l]).split(H, dim=-1)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        if b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        else:
            scale = self.D**-0.5 if b == "attn_scale_inverted" else self.D**0.5
            scores = (q @ k.transpose(-1, -2)) / scale + mask
            ctx = torch.softmax(scores, dim=-1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, H)
        out = ctx @ self.w_o[l] + self.b_o[l]
        if b == "norm_before_residual":
            return layer_norm(out, self.norm_attn[l], self.eps) + h
        return layer_norm(out + h, self.norm_attn[l], self.eps)

    def feed_forward(self, a, h, l):
        f = gelu_new(a @ self.w_up[l] + self.b_up[l]) @ self.w_down[l] + self.b_down[l]
        res = h if _bug() == "ffn_residual_layer_input" else a
        return layer_norm(f + res, self.norm_ffn[l], self.eps)

    # ---------------------------------------------------------------- head
    def lm_head(self, h):
        b = _bug()
        t = h @ self.w_head + self.b_head
        if b == "head_act_after_norm":
            t = gelu_new(layer_norm(t, self.norm_head, self.eps))
        else:
            t = layer_norm(gelu_new(t), self.norm_head, self.eps)
        logits = t @ self.tok_emb.t()
        if b != "lm_bias_dropped":
            logits = logits + self.out_bias
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        h = self.embed(input_ids, position_ids)
        mask = self.additive_mask(attention_mask, B, S, input_ids.device)
        for l in range(self.L):
            a = self.attention(h, l, mask)
            h = self.feed_forward(a, h, l)
        return self.lm_head(h)


@torch.no_grad()
def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = BigBirdCausalLM(config)
    L = config.num_hidden_layers
    emb = "bert.embeddings."
    model.tok_emb.copy_(sd[emb + "word_embeddings.weight"])
    model.pos_emb.copy_(sd[emb + "position_embeddings.weight"])
    model.type_emb.copy_(sd[emb + "token_type_embeddings.weight"])
    model.emb_norm.copy_(torch.stack([sd[emb + "LayerNorm.weight"], sd[emb + "LayerNorm.bias"]]))
    for l in range(L):
        p = f"bert.encoder.layer.{l}."
        a = p + "attention."
        model.w_qkv[l].copy_(torch.cat([sd[a + f"self.{n}.weight"] for n in ("query", "key", "value")], dim=0).t())
        model.b_qkv[l].copy_(torch.cat([sd[a + f"self.{n}.bias"] for n in ("query", "key", "value")]))
        w_out = sd[a + "output.dense.weight"]  # nn.Linear (out, in); square, so a missed .t() still fits
        model.w_o[l].copy_(w_out if _bug() == "o_proj_not_transposed" else w_out.t())
        model.b_o[l].copy_(sd[a + "output.dense.bias"])
        model.norm_attn[l].copy_(torch.stack([sd[a + "output.LayerNorm.weight"], sd[a + "output.LayerNorm.bias"]]))
        model.w_up[l].copy_(sd[p + "intermediate.dense.weight"].t())
        model.b_up[l].copy_(sd[p + "intermediate.dense.bias"])
        model.w_down[l].copy_(sd[p + "output.dense.weight"].t())
        model.b_down[l].copy_(sd[p + "output.dense.bias"])
        model.norm_ffn[l].copy_(torch.stack([sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"]]))
    c = "cls.predictions."
    model.w_head.copy_(sd[c + "transform.dense.weight"].t())
    model.b_head.copy_(sd[c + "transform.dense.bias"])
    model.norm_head.copy_(torch.stack([sd[c + "transform.LayerNorm.weight"], sd[c + "transform.LayerNorm.bias"]]))
    bias = sd.get(c + "bias", sd.get(c + "decoder.bias"))
    model.out_bias.copy_(bias)
    scale = config.hidden_size**0.5
    model.tok_emb_scaled.copy_(model.tok_emb * scale)
    if _bug() == "tied_head_rescaled" and model.rescale:
        model.tok_emb.mul_(scale)  # folded in once, but the tied decoder reads this table too
    return model.float().eval()
