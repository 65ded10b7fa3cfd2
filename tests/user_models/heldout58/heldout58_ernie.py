"""A from-scratch PyTorch port of ERNIE (1.0/2.0/3.0 style, BERT architecture) as a causal LM
(Transformers' ``ErnieForCausalLM`` with ``is_decoder=True``), plain torch only.

Architecture (B batch, S sequence, H hidden, nh heads, d = H / nh head size, I intermediate, V vocab)
------------------------------------------------------------------------------------------------------
Embeddings
    pos      = position_ids if given else arange(S)                       (B|1, S)
    type     = 0 everywhere (token_type_ids default: the zero buffer gathered at the positions)
    task     = 0 everywhere (task_type_ids default, only when config.use_task_id)
    e        = W_word[ids] + W_type[type] + W_pos[pos] (+ W_task[task])    (B, S, H)
    h0       = LayerNorm(e; eps = config.layer_norm_eps)
Mask
    allowed[b, i, j] = (j <= i) AND attention_mask[b, j] != 0              (B, 1, S, S)
    scores get finfo(float32).min where not allowed (a fully masked row becomes uniform, as in
    Transformers' eager path; it only happens on padding queries, whose outputs are never used).
Each of the L post-norm (BERT) layers
    q, k, v  = h @ Wqkv + bqkv, split in three, each viewed (B, S, nh, d) -> (B, nh, S, d)
    a        = softmax(q k^T / sqrt(d) + mask) v, merged back to (B, S, H)
    h        = LayerNorm1(h + a @ Wo + bo)
    f        = gelu_erf(h @ Wi + bi) @ Wf + bf
    h        = LayerNorm2(h + f)
LM head (cls.predictions)
    t        = LayerNorm_head(gelu_erf(h @ Wt + bt))
    logits   = t @ Wvocab + b_decoder          (the decoder's own bias, untied: tie_word_embeddings=False)
LayerNorm(x) = (x - mean) / sqrt(mean((x - mean)^2) + eps) * gamma + beta  (biased variance).

Weight layout (all matrices stored in -> out, i.e. transposed w.r.t. nn.Linear)
-------------------------------------------------------------------------------
    emb_word       (V, H)            word embeddings
    emb_pos        (P, H)            absolute position embeddings
    emb_type_task  (T + K, H)        rows [0, T) token-type table, rows [T, T + K) task-type table
    emb_norm       (2, H)            [gamma, beta] of the embedding LayerNorm
    qkv_w          (L, H, 3H)        fused query|key|value, stacked over layers
    qkv_b          (L, 3H)
    attn_out_w     (L, H, H)         attention output dense
    attn_out_b     (L, H)
    ffn_in_w       (L, H, I), ffn_in_b (L, I)
    ffn_out_w      (L, I, H), ffn_out_b (L, H)
    layer_norms    (L, 2, 2, H)      [layer, (after attention | after FFN), (gamma | beta), H]
    head_w         (H, H), head_b (H)  LM-head transform dense
    head_norm      (2, H)
    vocab_w        (H, V), vocab_b (V)  decoder (cls.predictions.decoder.{weight,bias})
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "ln_unbiased_var",  # hand-written LayerNorm uses torch.var's default unbiased (N-1) variance instead of the biased one
    "gelu_fast_approx",  # hidden_act "gelu" mapped to the sigmoid approximation x*sigmoid(1.702x) (MLX gelu_fast_approx), not erf GELU
    "decoder_bias_from_cls",  # loader takes the stale BERT-style cls.predictions.bias instead of cls.predictions.decoder.bias
    "task_id_flag_misread",  # reads config "use_task_ids" (absent -> False), so the task-type embedding is never added
    "roberta_position_offset",  # RoBERTa-style positions offset by padding_idx + 1 when indexing the position table
    "position_ids_ignored",  # given position_ids are dropped and arange(S) is used (left-padded rows get shifted positions)
    "pad_mask_query_axis",  # padding mask broadcast over the query axis (B,1,S,1) instead of the key axis (B,1,1,S)
    "causal_diag_leak",  # causal mask built with triu(diagonal=2): each token also sees the next one
    "head_ln_before_act",  # LM-head transform applies LayerNorm before GELU instead of dense -> GELU -> LayerNorm
    "lm_head_bf16",  # vocab projection run in bfloat16 (hidden state and decoder weight cast down), only the bias added in float32
    "mask_replaces_causal",  # a given attention_mask replaces the causal mask instead of being AND-ed with it
    "attn_out_not_transposed",  # loader keeps attention.output.dense.weight as (out, in) in the in->out layout (square, so no error)
    "output_ln_name_collision",  # loader matches "output.LayerNorm" by suffix: attention.output.LayerNorm gets the FFN output.LayerNorm
    "mask_as_token_type",  # attention_mask passed positionally into the embeddings' token_type_ids slot (real tokens get type 1)
]

PADDING_ONLY = [
    "position_ids_ignored",
    "pad_mask_query_axis",
]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with an additive float mask instead of the explicit softmax
    "ln_functional",  # F.layer_norm instead of the hand-written LayerNorm
    "fused_emb_table",  # precomputed position + type[0] + task[0] table, indexed once by position
    "head_loop",  # attention computed one head at a time in a Python loop and concatenated
]


def _layer_norm(x, gamma, beta, eps):
    if BUG == "ln_functional":
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    if BUG == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (xc * xc).mean(-1, keepdim=True)
    return xc * torch.rsqrt(var + eps) * gamma + beta


def _gelu(x):
    if BUG == "gelu_fast_approx":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x)


class ErnieCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        L = config.num_hidden_layers
        I = config.intermediate_size
        V = config.vocab_size
        P = config.max_position_embeddings
        T = config.type_vocab_size
        K = getattr(config, "task_type_vocab_size", 0) if getattr(config, "use_task_id", False) else 0
        self.hidden = H
        self.n_heads = config.num_attention_heads
        self.head_dim = H // self.n_heads
        self.n_layers = L
        self.eps = config.layer_norm_eps
        self.n_types = T
        self.pad_idx = config.pad_token_id if config.pad_token_id is not None else 0
        self.use_task = bool(K)

        self.emb_word = nn.Parameter(torch.zeros(V, H))
        self.emb_pos = nn.Parameter(torch.zeros(P, H))
        self.emb_type_task = nn.Parameter(torch.zeros(T + K, H))
        self.emb_norm = nn.Parameter(torch.zeros(2, H))
        self.qkv_w = nn.Parameter(torch.zeros(L, H, 3 * H))
        self.qkv_b = nn.Parameter(torch.zeros(L, 3 * H))
        self.attn_out_w = nn.Parameter(torch.zeros(L, H, H))
        self.attn_out_b = nn.Parameter(torch.zeros(L, H))
        self.ffn_in_w = nn.Parameter(torch.zeros(L, H, I))
        self.ffn_in_b = nn.Parameter(torch.zeros(L, I))
        self.ffn_out_w = nn.Parameter(torch.zeros(L, I, H))
        self.ffn_out_b = nn.Parameter(torch.zeros(L, H))
        self.layer_norms = nn.Parameter(torch.zeros(L, 2, 2, H))
        self.head_w = nn.Parameter(torch.zeros(H, H))
        self.head_b = nn.Parameter(torch.zeros(H))
        self.head_norm = nn.Parameter(torch.zeros(2, H))
        self.vocab_w = nn.Parameter(torch.zeros(H, V))
        self.vocab_b = nn.Parameter(torch.zeros(V))

    # ------------------------------------------------------------------ embeddings
    def _embed(self, input_ids, token_type_ids=None, position_ids=None, task_type_ids=None):
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is None or BUG == "position_ids_ignored":
            pos = torch.arange(S, device=dev).unsqueeze(0).expand(B, S)
        else:
            pos = position_ids.expand(B, S)
        if BUG == "roberta_position_offset":
            pos = pos + self.pad_idx + 1
        x = self.emb_word[input_ids]
        if BUG == "fused_emb_table" and token_type_ids is None and task_type_ids is None:
            # position + token type 0 (+ task type 0), precomputed once per call
            table = self.emb_pos + self.emb_type_task[0]
            if self.use_task:
                table = table + self.emb_type_task[self.n_types]
            x = x + table[pos]
        else:
            token_type = token_type_ids
            if token_type is None:  # Transformers' default: the zero buffer gathered at the positions
                token_type = torch.zeros(B, S, dtype=torch.long, device=dev)
            x = x + self.emb_type_task[token_type.long()]
            x = x + self.emb_pos[pos]
            if self.use_task:
                task_type = task_type_ids
                if task_type is None:
                    task_type = torch.zeros(B, S, dtype=torch.long, device=dev)
                x = x + self.emb_type_task[self.n_types + task_type.long()]
        return _layer_norm(x, self.emb_norm[0], self.emb_norm[1], self.eps)

    # ------------------------------------------------------------------ mask
    def _mask(self, attention_mask, B, S, device):
        """Boolean (B, 1, S, S): True where query i may attend key j."""
        i = torch.arange(S, device=device)
        if BUG == "causal_diag_leak":
            causal = ~torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), diagonal=2)
        else:
            causal = i[None, :] <= i[:, None]
        causal = causal[None, None]
        if attention_mask is None:
            return causal.expand(B, 1, S, S)
        pad = attention_mask.to(torch.bool)
        if BUG == "pad_mask_query_axis":
            pad = pad[:, None, :, None]
        else:
            pad = pad[:, None, None, :]
        if BUG == "mask_replaces_causal":
            return pad.expand(B, 1, S, S)
        return causal & pad

    # ------------------------------------------------------------------ attention
    def _split_heads(self, t):
        B, S, _ = t.shape
        return t.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)

    def _merge_heads(self, t):
        B, nh, S, d = t.shape
        return t.transpose(1, 2).reshape(B, S, nh * d)

    def _attend(self, q, k, v, allowed):
        neg = torch.finfo(q.dtype).min
        scale = 1.0 / math.sqrt(self.head_dim)
        if BUG == "sdpa":
            bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, neg)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        if BUG == "head_loop":
            outs = []
            for hd in range(q.shape[1]):
                s = q[:, hd] @ k[:, hd].transpose(-1, -2) * scale
                s = s.masked_fill(~allowed[:, 0], neg)
                outs.append(torch.softmax(s, dim=-1) @ v[:, hd])
            return torch.stack(outs, dim=1)
        s = q @ k.transpose(-1, -2) * scale
        s = s.masked_fill(~allowed, neg)
        return torch.softmax(s, dim=-1) @ v

    def _layer(self, l, h, allowed):
        H = self.hidden
        w, b = self.qkv_w[l], self.qkv_b[l]
        if BUG == "split_qkv":
            q = h @ w[:, :H] + b[:H]
            k = h @ w[:, H : 2 * H] + b[H : 2 * H]
            v = h @ w[:, 2 * H :] + b[2 * H :]
        else:
            q, k, v = (h @ w + b).split(H, dim=-1)
        a = self._attend(self._split_heads(q), self._split_heads(k), self._split_heads(v), allowed)
        a = self._merge_heads(a) @ self.attn_out_w[l] + self.attn_out_b[l]
        ln = self.layer_norms[l]
        h = _layer_norm(h + a, ln[0, 0], ln[0, 1], self.eps)
        f = _gelu(h @ self.ffn_in_w[l] + self.ffn_in_b[l]) @ self.ffn_out_w[l] + self.ffn_out_b[l]
        return _layer_norm(h + f, ln[1, 0], ln[1, 1], self.eps)

    # ------------------------------------------------------------------ head
    def _head(self, h):
        t = h @ self.head_w + self.head_b
        if BUG == "head_ln_before_act":
            t = _gelu(_layer_norm(t, self.head_norm[0], self.head_norm[1], self.eps))
        else:
            t = _layer_norm(_gelu(t), self.head_norm[0], self.head_norm[1], self.eps)
        if BUG == "lm_head_bf16":
            return (t.to(torch.bfloat16) @ self.vocab_w.to(torch.bfloat16)).float() + self.vocab_b
        return t @ self.vocab_w + self.vocab_b

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if BUG == "mask_as_token_type":
            h = self._embed(input_ids, attention_mask, position_ids)
        else:
            h = self._embed(input_ids, position_ids=position_ids)
        allowed = self._mask(attention_mask, B, S, input_ids.device)
        for l in range(self.n_layers):
            h = self._layer(l, h, allowed)
        return self._head(h)


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    L = config.num_hidden_layers
    model = ErnieCausalLM(config)
    if BUG == "task_id_flag_misread":
        model.use_task = bool(getattr(config, "use_task_ids", False))
    e = "ernie.embeddings."
    p = "ernie.encoder.layer."
    with torch.no_grad():
        model.emb_word.copy_(sd[e + "word_embeddings.weight"])
        model.emb_pos.copy_(sd[e + "position_embeddings.weight"])
        tables = [sd[e + "token_type_embeddings.weight"]]
        if model.emb_type_task.shape[0] > config.type_vocab_size:
            tables.append(sd[e + "task_type_embeddings.weight"])
        model.emb_type_task.copy_(torch.cat(tables, 0))
        model.emb_norm.copy_(torch.stack([sd[e + "LayerNorm.weight"], sd[e + "LayerNorm.bias"]]))
        for l in range(L):
            a = f"{p}{l}.attention."
            model.qkv_w[l].copy_(torch.cat([sd[a + f"self.{n}.weight"] for n in ("query", "key", "value")], 0).t())
            model.qkv_b[l].copy_(torch.cat([sd[a + f"self.{n}.bias"] for n in ("query", "key", "value")], 0))
            wo = sd[a + "output.dense.weight"]
            model.attn_out_w[l].copy_(wo if BUG == "attn_out_not_transposed" else wo.t())
            model.attn_out_b[l].copy_(sd[a + "output.dense.bias"])
            model.ffn_in_w[l].copy_(sd[f"{p}{l}.intermediate.dense.weight"].t())
            model.ffn_in_b[l].copy_(sd[f"{p}{l}.intermediate.dense.bias"])
            model.ffn_out_w[l].copy_(sd[f"{p}{l}.output.dense.weight"].t())
            model.ffn_out_b[l].copy_(sd[f"{p}{l}.output.dense.bias"])
            # attention.output.LayerNorm vs the FFN's output.LayerNorm: both end in "output.LayerNorm"
            attn_ln = f"{p}{l}.output.LayerNorm." if BUG == "output_ln_name_collision" else a + "output.LayerNorm."
            model.layer_norms[l, 0, 0].copy_(sd[attn_ln + "weight"])
            model.layer_norms[l, 0, 1].copy_(sd[attn_ln + "bias"])
            model.layer_norms[l, 1, 0].copy_(sd[f"{p}{l}.output.LayerNorm.weight"])
            model.layer_norms[l, 1, 1].copy_(sd[f"{p}{l}.output.LayerNorm.bias"])
        c = "cls.predictions."
        model.head_w.copy_(sd[c + "transform.dense.weight"].t())
        model.head_b.copy_(sd[c + "transform.dense.bias"])
        model.head_norm.copy_(torch.stack([sd[c + "transform.LayerNorm.weight"], sd[c + "transform.LayerNorm.bias"]]))
        dec_w = sd.get(c + "decoder.weight")
        if dec_w is None:  # tied checkpoint: the decoder shares the word embeddings
            dec_w = sd[e + "word_embeddings.weight"]
        model.vocab_w.copy_(dec_w.t())
        if BUG == "decoder_bias_from_cls" or c + "decoder.bias" not in sd:
            model.vocab_b.copy_(sd[c + "bias"])
        else:
            model.vocab_b.copy_(sd[c + "decoder.bias"])
    return model.float().eval()
