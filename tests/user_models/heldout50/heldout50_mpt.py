"""A from-scratch PyTorch port of MPT (MosaicML Pretrained Transformer) as a causal LM.

Architecture (as implemented here)
----------------------------------
D = config.d_model, H = config.n_heads, hd = D // H, L = config.n_layers, V = config.vocab_size,
F = the MLP hidden width (read from the checkpoint's up projection: Transformers' MPT uses 4 * D whatever
``expansion_ratio`` says). No biases anywhere (``no_bias``); the LayerNorms have a weight and no bias.

    x_0 = E[input_ids]                                             (B, S, D)
    for each layer l:
        a   = LN(x; g1_l)                                          LayerNorm, eps = config.layer_norm_epsilon
        qkv = clamp(a @ Wqkv_l, -c, c)                             c = attn_config.clip_qkv (skipped when None)
        q, k, v = qkv split in three contiguous blocks of D, each (B, S, H, hd) -> (B, H, S, hd)
        s   = (q k^T) * scale + alibi                              scale = attn_config.softmax_scale or 1/sqrt(hd)
        alibi[h, i, j] = m_h * (j - (S - 1))                       (the last S columns of MPT's max_seq_len table;
                                                                   equal to -m_h (i - j) up to a per-row shift)
        m_h = 2 ** -((h + 1) * alibi_bias_max / H')                H' = next power of two >= H (heads reordered
                                                                   [1::2] + [::2] when H' != H)
        s[b, h, i, j] = finfo.min where j > i or attention_mask[b, j] == 0
        p   = softmax(s, -1);   o = (p v) merged back to (B, S, D)
        x   = x + o @ Wo_l
        x   = x + gelu(LN(x; g2_l) @ Wup_l) @ Wdown_l               exact (erf) GELU
    logits = LN(x; gf) @ Whead                                     Whead = lm_head (tied to E)

ALiBi carries all position information, so ``position_ids`` are not needed (as in Transformers' MPT); the
``alibi_relative`` clean variant builds the same bias from them.

Weight layout (mine, not Transformers' module tree)
---------------------------------------------------
All matrices are stored transposed, in -> out, and the per-layer tensors are stacked along a leading layer axis:
    tok_emb  (V, D)          <- transformer.wte.weight
    ln1      (L, D)          <- transformer.blocks.{l}.norm_1.weight
    ln2      (L, D)          <- transformer.blocks.{l}.norm_2.weight
    w_qkv    (L, D, 3D)      <- transformer.blocks.{l}.attn.Wqkv.weight^T   (columns: q | k | v)
    w_o      (L, D, D)       <- transformer.blocks.{l}.attn.out_proj.weight^T
    w_up     (L, D, F)       <- transformer.blocks.{l}.ffn.up_proj.weight^T
    w_down   (L, F, D)       <- transformer.blocks.{l}.ffn.down_proj.weight^T
    ln_f     (D,)            <- transformer.norm_f.weight
    w_head   (D, V)          <- lm_head.weight^T (wte.weight^T when absent: tied)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "scale_hidden_size",  # softmax scale 1/sqrt(d_model) (as the config doc says) instead of 1/sqrt(head_dim)
    "alibi_slope_offbyone",  # ALiBi exponents from arange(0, H) instead of arange(1, H + 1): head 0 gets slope 1
    "alibi_before_scale",  # ALiBi bias added to q.k before the softmax scale, so the bias is scaled too
    "clip_qkv_ignored",  # clip_qkv read from the top-level config (absent) instead of attn_config: no clamp
    "qkv_head_interleaved",  # fused Wqkv output split Bloom-style per head (H, 3, hd) instead of (3, H, hd)
    "causal_excludes_diag",  # causal mask triu(diagonal=0): a token cannot attend to itself
    "rmsnorm",  # "low_precision_layernorm" ported as an RMSNorm (no mean subtraction)
    "gelu_tanh",  # MLP activation uses the tanh approximation instead of exact erf GELU
    "mlp_stale_residual",  # MLP residual taken from the block input instead of the post-attention stream
    "out_proj_untransposed",  # out_proj weight converted without the transpose (square, so it loads silently)
    "merge_heads_no_transpose",  # attention output (B, H, S, hd) reshaped to (B, S, D) without moving heads back
    "layernorm_bf16",  # low_precision_layernorm taken literally: normalisation computed in bfloat16
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
    "pad_mask_right_aligned",  # padding mask rebuilt from lengths as if padding were on the right
]

PADDING_ONLY = [
    "pad_mask_query_axis",
    "pad_mask_right_aligned",
]

CLEAN = [
    "alibi_table_front",  # the max_seq_len ALiBi table sliced from its front: a per-row constant shift, softmax-invariant
    "alibi_relative",  # ALiBi as -m_h * (pos_i - pos_j) from position_ids (or arange): the translation-free form
    "split_qkv_weights",  # separate q/k/v matmuls with per-projection clamp instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with ALiBi + mask folded into one additive float mask
    "layernorm_manual",  # LayerNorm written out as (x - mean) * rsqrt(var + eps) * g
]


def _bug():
    return BUG


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _layer_norm(x, weight, eps):
    bug = _bug()
    if bug == "rmsnorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    if bug == "layernorm_bf16":
        y = F.layer_norm(x.to(torch.bfloat16), x.shape[-1:], weight.to(torch.bfloat16), None, eps)
        return y.to(x.dtype)
    if bug == "layernorm_manual":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + eps) * weight
    return F.layer_norm(x, x.shape[-1:], weight, None, eps)


def _alibi_slopes(n_heads, bias_max, device):
    bug = _bug()
    n2 = 2 ** math.ceil(math.log2(n_heads))
    if bug == "alibi_slope_offbyone":
        exps = torch.arange(0, n2, device=device, dtype=torch.float32)
    else:
        exps = torch.arange(1, n2 + 1, device=device, dtype=torch.float32)
    slopes = 1.0 / torch.pow(2.0, exps * (bias_max / n2))
    if n2 != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes  # (H,)


def _alibi_bias(slopes, seq_len, max_len, position_ids, device):
    """(B or 1, H, S, S) additive bias."""
    bug = _bug()
    H = slopes.shape[0]
    if bug == "alibi_relative":
        if position_ids is None:
            pos = torch.arange(seq_len, device=device)[None]
        else:
            pos = position_ids
        rel = (pos[:, :, None] - pos[:, None, :]).float()  # (B, S, S): i - j
        return -slopes.view(1, H, 1, 1) * rel[:, None]
    table_len = max(max_len, seq_len)
    table = torch.arange(1 - table_len, 1, device=device, dtype=torch.float32)  # (T,)
    table = slopes.view(H, 1) * table.view(1, table_len)  # (H, T)
    if bug == "alibi_table_front":
        cols = table[:, :seq_len]
    else:
        cols = table[:, table_len - seq_len :]
    return cols.view(1, H, 1, seq_len).expand(1, H, seq_len, seq_len)


def _allowed(attention_mask, B, S, device):
    """(B, 1, S, S) boolean: True where query i may attend key j."""
    bug = _bug()
    i = torch.arange(S, device=device)
    if bug == "causal_excludes_diag":
        causal = i[None, :] < i[:, None]
    else:
        causal = i[None, :] <= i[:, None]
    allowed = causal.view(1, 1, S, S).expand(B, 1, S, S)
    if attention_mask is not None:
        m = attention_mask.to(device).bool()
        if bug == "pad_mask_right_aligned":
            lengths = m.sum(-1)
            m = i[None, :] < lengths[:, None]
        if bug == "pad_mask_query_axis":
            allowed = allowed & m[:, None, :, None]
        else:
            allowed = allowed & m[:, None, None, :]
    return allowed


# ----------------------------------------------------------------------------------------------------------------
# model


class MptPort(nn.Module):
    def __init__(self, config, tok_emb, ln1, ln2, w_qkv, w_o, w_up, w_down, ln_f, w_head):
        super().__init__()
        self.d_model = config.d_model
        self.n_heads = config.n_heads
        self.head_dim = self.d_model // self.n_heads
        self.n_layers = config.n_layers
        self.eps = config.layer_norm_epsilon
        self.max_seq_len = config.max_seq_len
        attn = config.attn_config
        self._attn_cfg = attn
        self._config = config
        self.alibi = getattr(attn, "alibi", True)
        self.alibi_bias_max = getattr(attn, "alibi_bias_max", 8)
        self.softmax_scale = getattr(attn, "softmax_scale", None)
        self.tok_emb = nn.Parameter(tok_emb)
        self.ln1 = nn.Parameter(ln1)
        self.ln2 = nn.Parameter(ln2)
        self.w_qkv = nn.Parameter(w_qkv)
        self.w_o = nn.Parameter(w_o)
        self.w_up = nn.Parameter(w_up)
        self.w_down = nn.Parameter(w_down)
        self.ln_f = nn.Parameter(ln_f)
        self.w_head = nn.Parameter(w_head)

    def _clip(self):
        if _bug() == "clip_qkv_ignored":
            return getattr(self._config, "clip_qkv", None)
        return getattr(self._attn_cfg, "clip_qkv", None)

    def _scale(self):
        if self.softmax_scale is not None:
            return self.softmax_scale
        if _bug() == "scale_hidden_size":
            return 1.0 / math.sqrt(self.d_model)
        return 1.0 / math.sqrt(self.head_dim)

    def _qkv(self, a, l):
        bug = _bug()
        B, S, D = a.shape
        H, hd = self.n_heads, self.head_dim
        clip = self._clip()
        if bug == "split_qkv_weights":
            w = self.w_qkv[l]
            parts = []
            for t in range(3):
                p = a @ w[:, t * D : (t + 1) * D]
                if clip:
                    p = p.clamp(-clip, clip)
                parts.append(p.view(B, S, H, hd).transpose(1, 2))
            return parts
        qkv = a @ self.w_qkv[l]
        if clip:
            qkv = qkv.clamp(min=-clip, max=clip)
        if bug == "qkv_head_interleaved":
            qkv = qkv.view(B, S, H, 3, hd)
            q, k, v = qkv.unbind(3)
        else:
            qkv = qkv.view(B, S, 3, H, hd)
            q, k, v = qkv.unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attention(self, a, l, bias, allowed):
        bug = _bug()
        B, S, D = a.shape
        q, k, v = self._qkv(a, l)  # (B, H, S, hd)
        scale = self._scale()
        neg = torch.finfo(q.dtype).min
        if bug == "sdpa":
            add = torch.zeros(B, self.n_heads, S, S, dtype=q.dtype, device=q.device)
            if bias is not None:
                add = add + bias
            add = add.masked_fill(~allowed, neg)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale)
        else:
            if bug == "alibi_before_scale" and bias is not None:
                scores = (q @ k.transpose(-1, -2) + bias) * scale
            else:
                scores = (q @ k.transpose(-1, -2)) * scale
                if bias is not None:
                    scores = scores + bias
            scores = scores.masked_fill(~allowed, neg)
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            ctx = probs @ v  # (B, H, S, hd)
        if bug == "merge_heads_no_transpose":
            ctx = ctx.reshape(B, S, D)
        else:
            ctx = ctx.transpose(1, 2).reshape(B, S, D)
        w_o = self.w_o[l]
        if bug == "out_proj_untransposed":
            w_o = w_o.t()
        return ctx @ w_o

    def _mlp(self, h, l):
        u = h @ self.w_up[l]
        if _bug() == "gelu_tanh":
            u = F.gelu(u, approximate="tanh")
        else:
            u = F.gelu(u)
        return u @ self.w_down[l]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        dev = input_ids.device
        x = self.tok_emb[input_ids]
        allowed = _allowed(attention_mask, B, S, dev)
        bias = None
        if self.alibi:
            slopes = _alibi_slopes(self.n_heads, self.alibi_bias_max, dev)
            bias = _alibi_bias(slopes, S, self.max_seq_len, position_ids, dev).to(x.dtype)
        for l in range(self.n_layers):
            block_in = x
            x = x + self._attention(_layer_norm(x, self.ln1[l], self.eps), l, bias, allowed)
            residual = block_in if bug == "mlp_stale_residual" else x
            x = residual + self._mlp(_layer_norm(x, self.ln2[l], self.eps), l)
        x = _layer_norm(x, self.ln_f, self.eps)
        return x @ self.w_head


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    L = config.n_layers
    pre = "transformer."

    def per_layer(name, transpose=True):
        ts = [sd[f"{pre}blocks.{l}.{name}"] for l in range(L)]
        if transpose:
            ts = [t.t() for t in ts]
        return torch.stack([t.contiguous() for t in ts])

    tok_emb = sd[pre + "wte.weight"].clone()
    head = sd.get("lm_head.weight", tok_emb)
    model = MptPort(
        config,
        tok_emb=tok_emb,
        ln1=per_layer("norm_1.weight", transpose=False),
        ln2=per_layer("norm_2.weight", transpose=False),
        w_qkv=per_layer("attn.Wqkv.weight"),
        w_o=per_layer("attn.out_proj.weight"),
        w_up=per_layer("ffn.up_proj.weight"),
        w_down=per_layer("ffn.down_proj.weight"),
        ln_f=sd[pre + "norm_f.weight"].clone(),
        w_head=head.t().contiguous().clone(),
    )
    return model.float().eval()
