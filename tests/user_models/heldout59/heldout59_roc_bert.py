"""A from-scratch PyTorch port of RoCBert as a causal LM (``RoCBertForCausalLM``, ``is_decoder=True``).

Architecture (as implemented here), for input ids ``x`` of shape (B, T), hidden size H, heads N, head dim
d = H / N, intermediate size I, vocabulary V:

Embeddings (``concat_input=True``, shape and pronunciation enabled, called with input ids only):
    The shape / pronunciation ids are not given, so they default to all-zero ids (id 0 = pad_token_id; the
    rows at that index are trained / random weights, NOT zero vectors).
        w   = E_word[x]                         (B, T, H)
        s   = E_shape[0]                        (Ds,)  broadcast over (B, T)
        p   = E_pron[0]                         (Dp,)  broadcast over (B, T)
        u   = concat(w, s, p) @ M + m           (B, T, H)   -- concat order: word, shape, pronunciation
        e   = u + E_type[0] + E_pos[pos]        token types default to 0; pos = arange(T) unless given
        h0  = LayerNorm_emb(e)                  eps = config.layer_norm_eps
    Position ids: ``position_ids`` when given, else 0..T-1 (absolute learned table, no offset).

Encoder layer l (BERT post-norm), L = num_hidden_layers:
        q, k, v = split(h @ Wqkv + bqkv) into blocks [q | k | v], each (B, T, H) -> (B, N, T, d)
        a   = softmax(q k^T / sqrt(d) + mask) v          mask: causal (j <= i) AND key j not padding
        h'  = LayerNorm_1(h + a @ Wo + bo)
        f   = gelu_erf(h' @ Wup + bup) @ Wdown + bdown
        h   = LayerNorm_2(h' + f)
    Masked entries are filled with finfo(float32).min (finite), so fully masked padding rows stay finite.

LM head (cls.predictions, untied from the word embeddings here):
        t = LayerNorm_head(gelu_erf(h @ Wt + bt))
        logits = t @ Wdec + bdec        (bdec = cls.predictions.decoder.bias)

Weight layout (my own; every matrix stored in -> out, i.e. transposed w.r.t. nn.Linear):
    emb_word   (V, H)           word table
    emb_shape  (Vs, Ds)         shape table
    emb_pron   (Vp, Dp)         pronunciation table
    map_w      (H + Ds + Dp, H) map_inputs_layer, rows ordered word | shape | pronunciation
    map_b      (H,)
    emb_pos    (P, H)           learned absolute positions
    emb_type   (Tt, H)          token-type table
    emb_ln     (2, H)           [gamma, beta] of the embedding LayerNorm
    qkv_w      (L, H, 3H)       fused query|key|value, stacked over layers
    qkv_b      (L, 3H)
    o_w        (L, H, H), o_b (L, H)
    ln         (L, 2, 2, H)     [layer][0: after attention, 1: after FFN][gamma, beta]
    up_w       (L, H, I), up_b (L, I)
    down_w     (L, I, H), down_b (L, H)
    head_w     (H, H), head_b (H,), head_ln (2, H)
    dec_w      (H, V), dec_b (V,)
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "side_concat_order",  # concatenates pronunciation before shape, misaligning the map_inputs_layer's input columns
    "pad_row_zero",  # assumes the padding_idx rows are zero: drops the default (id 0) shape/pronunciation embeddings
    "pos_before_map",  # adds position and token-type embeddings to the word vector BEFORE map_inputs_layer (non-concat order)
    "concat_average",  # divides the normalised embedding by 1 + #side inputs (the concat_input=False averaging) though concat_input=True
    "roberta_positions",  # default positions start at pad_token_id + 1 (RoBERTa offset) instead of 0
    "ignore_position_ids",  # ignores the passed position_ids and always uses arange(T)
    "softmax_query_axis",  # normalises the attention scores over the query axis (dim -2) instead of the key axis
    "map_no_bias",  # builds map_inputs_layer as a bias-free projection: its bias is never loaded / added
    "bidirectional",  # ignores config.is_decoder: no causal mask, only the padding mask
    "pad_mask_query_axis",  # applies the padding mask over the query axis instead of the key axis
    "qkv_interleaved_split",  # splits the fused QKV output per head as (N, 3, d) instead of as [q | k | v] blocks
    "ffn_residual_from_input",  # FFN residual adds the layer input instead of the attention block's output
    "head_ln_before_act",  # LM-head transform applies LayerNorm before the activation (dense -> LN -> gelu)
    "head_bias_from_predictions",  # loads cls.predictions.bias (stale when untied) instead of decoder.bias
]

PADDING_ONLY = ["ignore_position_ids", "pad_mask_query_axis"]

CLEAN = [
    "fold_side_embeds",  # folds the constant shape/pronunciation (id 0) contributions into the map bias
    "premapped_word_table",  # precomputes E_word @ M_word as a (V, H) table and looks it up directly
    "sdpa_attention",  # uses F.scaled_dot_product_attention with an additive float mask
    "per_head_loop",  # computes attention one head at a time in a Python loop with split weights
    "manual_layernorm",  # LayerNorm written out by hand (mean, biased variance, rsqrt)
]


def _bug():
    return BUG


def _layer_norm(x, gamma, beta, eps):
    if _bug() == "manual_layernorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + eps) * gamma + beta
    return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)


def _gelu(x):
    return F.gelu(x)  # hidden_act="gelu": exact erf GELU


class RocBertPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.H = H
        self.N = config.num_attention_heads
        self.d = H // self.N
        self.L = config.num_hidden_layers
        self.I = config.intermediate_size
        self.V = config.vocab_size
        self.eps = config.layer_norm_eps
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.is_decoder = bool(config.is_decoder)
        self.enable_shape = bool(config.enable_shape)
        self.enable_pron = bool(config.enable_pronunciation)
        self.Ds = config.shape_embed_dim if self.enable_shape else 0
        self.Dp = config.pronunciation_embed_dim if self.enable_pron else 0
        if not config.concat_input:
            raise NotImplementedError("this port implements concat_input=True only")
        L, I, V = self.L, self.I, self.V
        z = torch.zeros
        self.emb_word = nn.Parameter(z(V, H))
        self.emb_shape = nn.Parameter(z(config.shape_vocab_size, config.shape_embed_dim))
        self.emb_pron = nn.Parameter(z(config.pronunciation_vocab_size, config.pronunciation_embed_dim))
        self.map_w = nn.Parameter(z(H + self.Ds + self.Dp, H))
        self.map_b = nn.Parameter(z(H))
        self.emb_pos = nn.Parameter(z(config.max_position_embeddings, H))
        self.emb_type = nn.Parameter(z(config.type_vocab_size, H))
        self.emb_ln = nn.Parameter(z(2, H))
        self.qkv_w = nn.Parameter(z(L, H, 3 * H))
        self.qkv_b = nn.Parameter(z(L, 3 * H))
        self.o_w = nn.Parameter(z(L, H, H))
        self.o_b = nn.Parameter(z(L, H))
        self.ln = nn.Parameter(z(L, 2, 2, H))
        self.up_w = nn.Parameter(z(L, H, I))
        self.up_b = nn.Parameter(z(L, I))
        self.down_w = nn.Parameter(z(L, I, H))
        self.down_b = nn.Parameter(z(L, H))
        self.head_w = nn.Parameter(z(H, H))
        self.head_b = nn.Parameter(z(H))
        self.head_ln = nn.Parameter(z(2, H))
        self.dec_w = nn.Parameter(z(H, V))
        self.dec_b = nn.Parameter(z(V))

    # ------------------------------------------------------------------ embeddings
    def _side_ids(self, B, T, device):
        return torch.zeros(B, T, dtype=torch.long, device=device)

    def embed(self, input_ids, position_ids):
        bug = _bug()
        B, T = input_ids.shape
        dev = input_ids.device
        H = self.H
        if position_ids is None or bug == "ignore_position_ids":
            start = self.pad_id + 1 if bug == "roberta_positions" else 0
            position_ids = torch.arange(start, start + T, device=dev).unsqueeze(0).expand(B, T)
        pos = self.emb_pos[position_ids]
        typ = self.emb_type[torch.zeros_like(position_ids)]

        Mw = self.map_w[:H]
        Ms = self.map_w[H : H + self.Ds]
        Mp = self.map_w[H + self.Ds :]

        if bug == "premapped_word_table":
            u = (self.emb_word @ Mw)[input_ids]
        else:
            w = self.emb_word[input_ids]
            if bug == "pos_before_map":
                w = w + pos + typ
            u = w @ Mw

        if bug == "fold_side_embeds":
            bias = self.map_b.clone()
            if self.enable_shape:
                bias = bias + self.emb_shape[0] @ Ms
            if self.enable_pron:
                bias = bias + self.emb_pron[0] @ Mp
            u = u + bias
        else:
            side = []
            sid = self._side_ids(B, T, dev)
            if self.enable_shape:
                s = self.emb_shape[sid]
                if bug == "pad_row_zero":
                    s = torch.zeros_like(s)
                side.append(s)
            if self.enable_pron:
                p = self.emb_pron[sid]
                if bug == "pad_row_zero":
                    p = torch.zeros_like(p)
                side.append(p)
            if bug == "side_concat_order":
                side = side[::-1]
            if side:
                u = u + torch.cat(side, -1) @ self.map_w[H:]
            if bug != "map_no_bias":
                u = u + self.map_b

        if bug != "pos_before_map":
            u = u + typ + pos
        h0 = _layer_norm(u, self.emb_ln[0], self.emb_ln[1], self.eps)
        if bug == "concat_average":
            h0 = h0 / (1 + int(self.enable_shape) + int(self.enable_pron))
        return h0

    # ------------------------------------------------------------------ attention
    def allowed_mask(self, attention_mask, B, T, device):
        """Boolean (B, 1, T, T): True where query i may attend key j."""
        bug = _bug()
        allowed = torch.ones(B, 1, T, T, dtype=torch.bool, device=device)
        if self.is_decoder and bug != "bidirectional":
            allowed = allowed & torch.tril(torch.ones(T, T, dtype=torch.bool, device=device))
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if bug == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return allowed

    def attention(self, h, l, allowed):
        bug = _bug()
        B, T, H = h.shape
        N, d = self.N, self.d
        scale = 1.0 / math.sqrt(d)
        neg = torch.finfo(h.dtype).min

        if bug == "per_head_loop":
            outs = []
            for n in range(N):
                sl = slice(n * d, (n + 1) * d)
                q = h @ self.qkv_w[l, :, sl] + self.qkv_b[l, sl]
                k = h @ self.qkv_w[l, :, H + n * d : H + (n + 1) * d] + self.qkv_b[l, H + n * d : H + (n + 1) * d]
                v = (
                    h @ self.qkv_w[l, :, 2 * H + n * d : 2 * H + (n + 1) * d]
                    + self.qkv_b[l, 2 * H + n * d : 2 * H + (n + 1) * d]
                )
                s = (q @ k.transpose(-1, -2)) * scale
                s = s.masked_fill(~allowed[:, 0], neg)
                outs.append(torch.softmax(s, -1) @ v)
            return torch.cat(outs, -1)

        qkv = h @ self.qkv_w[l] + self.qkv_b[l]  # (B, T, 3H)
        if bug == "qkv_interleaved_split":
            q, k, v = qkv.view(B, T, N, 3, d).unbind(3)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        else:
            q, k, v = (t.reshape(B, T, N, d).transpose(1, 2) for t in qkv.split(H, -1))

        if bug == "sdpa_attention":
            add = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill(~allowed, neg)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, neg)
            o = torch.softmax(s, -2 if bug == "softmax_query_axis" else -1) @ v
        return o.transpose(1, 2).reshape(B, T, H)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        h = self.embed(input_ids, position_ids)
        allowed = self.allowed_mask(attention_mask, B, T, h.device)
        for l in range(self.L):
            a = self.attention(h, l, allowed) @ self.o_w[l] + self.o_b[l]
            h1 = _layer_norm(h + a, self.ln[l, 0, 0], self.ln[l, 0, 1], self.eps)
            f = _gelu(h1 @ self.up_w[l] + self.up_b[l]) @ self.down_w[l] + self.down_b[l]
            res = h if bug == "ffn_residual_from_input" else h1
            h = _layer_norm(res + f, self.ln[l, 1, 0], self.ln[l, 1, 1], self.eps)
        t = h @ self.head_w + self.head_b
        if bug == "head_ln_before_act":
            t = _gelu(_layer_norm(t, self.head_ln[0], self.head_ln[1], self.eps))
        else:
            t = _layer_norm(_gelu(t), self.head_ln[0], self.head_ln[1], self.eps)
        return t @ self.dec_w + self.dec_b


@torch.no_grad()
def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    pre = "roc_bert."
    m = RocBertPort(config)
    H, L = m.H, m.L

    def g(k):
        return sd[k]

    e = pre + "embeddings."
    m.emb_word.copy_(g(e + "word_embeddings.weight"))
    m.emb_shape.copy_(g(e + "shape_embed.weight"))
    m.emb_pron.copy_(g(e + "pronunciation_embed.weight"))
    m.map_w.copy_(g(e + "map_inputs_layer.weight").t())
    m.map_b.copy_(g(e + "map_inputs_layer.bias"))
    m.emb_pos.copy_(g(e + "position_embeddings.weight"))
    m.emb_type.copy_(g(e + "token_type_embeddings.weight"))
    m.emb_ln.copy_(torch.stack([g(e + "LayerNorm.weight"), g(e + "LayerNorm.bias")]))

    for l in range(L):
        p = f"{pre}encoder.layer.{l}."
        a = p + "attention.self."
        m.qkv_w[l].copy_(torch.cat([g(a + n + ".weight").t() for n in ("query", "key", "value")], 1))
        m.qkv_b[l].copy_(torch.cat([g(a + n + ".bias") for n in ("query", "key", "value")]))
        m.o_w[l].copy_(g(p + "attention.output.dense.weight").t())
        m.o_b[l].copy_(g(p + "attention.output.dense.bias"))
        m.ln[l, 0, 0].copy_(g(p + "attention.output.LayerNorm.weight"))
        m.ln[l, 0, 1].copy_(g(p + "attention.output.LayerNorm.bias"))
        m.up_w[l].copy_(g(p + "intermediate.dense.weight").t())
        m.up_b[l].copy_(g(p + "intermediate.dense.bias"))
        m.down_w[l].copy_(g(p + "output.dense.weight").t())
        m.down_b[l].copy_(g(p + "output.dense.bias"))
        m.ln[l, 1, 0].copy_(g(p + "output.LayerNorm.weight"))
        m.ln[l, 1, 1].copy_(g(p + "output.LayerNorm.bias"))

    c = "cls.predictions."
    m.head_w.copy_(g(c + "transform.dense.weight").t())
    m.head_b.copy_(g(c + "transform.dense.bias"))
    m.head_ln.copy_(torch.stack([g(c + "transform.LayerNorm.weight"), g(c + "transform.LayerNorm.bias")]))
    m.dec_w.copy_(g(c + "decoder.weight").t())
    if bug == "head_bias_from_predictions":
        m.dec_b.copy_(g(c + "bias"))
    else:
        m.dec_b.copy_(g(c + "decoder.bias") if (c + "decoder.bias") in sd else g(c + "bias"))
    return m.float().eval()
