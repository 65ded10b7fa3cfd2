"""A hand-written PyTorch port of OpenAI GPT (GPT-1, Transformers model type ``openai-gpt``).

Architecture (C = n_embd, H = n_head, D = C / H, F = 4 C, L = n_layer, V = vocab_size, P = n_positions):

    x_0 = E_tok[input_ids] + E_pos[position_ids]               (B, T, C)
          position_ids = arange(T) when not given (no offset); E_tok is NOT scaled by sqrt(C)
    for each of the L blocks (POST-LayerNorm, no LayerNorm before the first block, no final LayerNorm):
        q, k, v = x W_q + b_q, x W_k + b_k, x W_v + b_v          each (B, H, T, D); the checkpoint's fused
                  c_attn output is [Q | K | V], three contiguous C-wide blocks, head h at columns h*D:(h+1)*D
        s   = q k^T / sqrt(D)                                  (B, H, T, T), scaled by the HEAD size
        s   = s where j <= i else -1e4                         causal mask (GPT-1 uses w*b - 1e4*(1-b))
        s   = s + (1 - attention_mask[b, j]) * finfo.min        padding mask on the KEY axis
        a   = softmax(s, -1) v -> (B, T, H, D) -> (B, T, C)    heads merged h-major: index h*D + d
        a   = a W_o + b_o
        n   = LN_1(x + a)
        m   = gelu_tanh(n W_fc + b_fc) W_proj + b_proj          afn "gelu" is GPT's tanh approximation:
              gelu_tanh(u) = 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))
        x   = LN_2(n + m)                                      residual over the NORMALISED n
    LN(y) = (y - mean) / sqrt(biased_var + eps) * w + b,  eps = config.layer_norm_epsilon
    logits = x_L E_tok^T                                       (B, T, V), head tied to the token table, no bias

Weight layout (my own; ``build`` converts the Transformers state dict, whose Conv1D matrices are in x out):
    wte        (V, C)            token table, also the output head
    wpe        (P, C)            learned position table
    w_qkv      (L, 3, H, D, C)   stacked per layer, [q|k|v] then head then out-dim, nn.Linear style (out x in)
    b_qkv      (L, 3, H, D)
    w_o        (L, C, C)         attention output projection, out x in
    b_o        (L, C)
    w_fc       (L, F, C)         MLP up projection, out x in
    b_fc       (L, F)
    w_proj     (L, C, F)         MLP down projection, out x in
    b_proj     (L, C)
    ln         (L, 2, 2, C)      [ln_1 | ln_2] x [weight | bias]
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "quick_gelu",  # afn "gelu" implemented as CLIP's quick GELU u*sigmoid(1.702u) instead of GPT's tanh GELU
    "pre_ln",  # GPT-2 habit: LayerNorm before attention / MLP (pre-LN) instead of GPT-1's LN after each residual add
    "qkv_interleaved_split",  # fused c_attn read per head as [q,k,v] (NeoX/Bloom layout), not three contiguous C blocks
    "conv1d_not_transposed",  # attn c_proj Conv1D (in x out) weight used as nn.Linear (out x in); square, so no error
    "ln_unbiased_var",  # LayerNorm variance with torch.var's default unbiased (N-1) estimator instead of the biased one
    "pos_from_one",  # default position ids arange(1, T+1) (OPT/RoBERTa-style offset) instead of arange(T)
    "pos_ids_ignored",  # passed position_ids dropped, arange(T) always: left-padded rows get shifted positions
    "mask_on_query_axis",  # padding mask broadcast as (B,1,T,1) over queries instead of (B,1,1,T) over keys
    "causal_zero_fill",  # causal mask applied as w*b only (the -1e4*(1-b) term dropped): future scores 0, not excluded
    "mlp_residual_unnormed",  # post-LN block: second residual adds the MLP to x+a instead of to n = LN_1(x+a)
    "qkv_bias_dropped",  # c_attn bias never loaded (projections assumed bias-free, LLaMA style)
    "merge_heads_no_transpose",  # attention output (B,H,T,D) reshaped to (B,T,C) without moving the head axis first
    "embed_scale",  # token embeddings multiplied by sqrt(n_embd) (Vaswani/T5 style) before adding positions
    "lm_head_bf16",  # tied output head: final hidden and token table cast to bfloat16 for the logits matmul
]

PADDING_ONLY = [
    "pos_ids_ignored",
    "mask_on_query_axis",
]

CLEAN = [
    "split_qkv",  # three separate q/k/v projections instead of one fused (3,H,D,C) einsum
    "sdpa_additive",  # F.scaled_dot_product_attention with one combined finite additive (causal + padding) mask
    "online_softmax_chunks",  # flash-style loop over key chunks with a running max / running sum (online softmax)
    "gelu_sigmoid_form",  # tanh GELU via the identity 0.5 (1 + tanh z) = sigmoid(2 z)
    "layernorm_functional",  # F.layer_norm instead of the hand-written mean / biased variance / rsqrt
]


def _gelu(u):
    if BUG == "quick_gelu":
        return u * torch.sigmoid(1.702 * u)
    c = math.sqrt(2.0 / math.pi)
    z = c * (u + 0.044715 * u.pow(3))
    if BUG == "gelu_sigmoid_form":
        return u * torch.sigmoid(2.0 * z)
    return 0.5 * u * (1.0 + torch.tanh(z))


def _layer_norm(y, w, b, eps):
    if BUG == "layernorm_functional":
        return F.layer_norm(y, (y.shape[-1],), w, b, eps)
    mu = y.mean(-1, keepdim=True)
    if BUG == "ln_unbiased_var":
        var = y.var(-1, keepdim=True)
    else:
        var = (y - mu).pow(2).mean(-1, keepdim=True)
    return (y - mu) * torch.rsqrt(var + eps) * w + b


class GPT1Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        C, H, L = config.n_embd, config.n_head, config.n_layer
        D, Fh = C // H, 4 * C
        self.C, self.H, self.D, self.L = C, H, D, L
        self.eps = config.layer_norm_epsilon
        self.afn = config.afn
        self.wte = nn.Parameter(torch.zeros(config.vocab_size, C))
        self.wpe = nn.Parameter(torch.zeros(config.n_positions, C))
        self.w_qkv = nn.Parameter(torch.zeros(L, 3, H, D, C))
        self.b_qkv = nn.Parameter(torch.zeros(L, 3, H, D))
        self.w_o = nn.Parameter(torch.zeros(L, C, C))
        self.b_o = nn.Parameter(torch.zeros(L, C))
        self.w_fc = nn.Parameter(torch.zeros(L, Fh, C))
        self.b_fc = nn.Parameter(torch.zeros(L, Fh))
        self.w_proj = nn.Parameter(torch.zeros(L, C, Fh))
        self.b_proj = nn.Parameter(torch.zeros(L, C))
        self.ln = nn.Parameter(torch.zeros(L, 2, 2, C))

    # ---------------------------------------------------------------- attention
    def _masks(self, T, attention_mask, device):
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        pad = None
        if attention_mask is not None:
            keep = attention_mask.to(torch.float32)
            pad = (1.0 - keep) * torch.finfo(torch.float32).min  # (B, T)
            if BUG == "mask_on_query_axis":
                pad = pad[:, None, :, None]
            else:
                pad = pad[:, None, None, :]
        return causal, pad

    def _scores(self, q, k, causal, pad):
        kT = k.transpose(-1, -2)  # (B, H, D, T)
        s = q @ kT
        s = s / math.sqrt(q.size(-1))
        if BUG == "causal_zero_fill":
            s = s * causal
        else:
            s = torch.where(causal, s, torch.tensor(-1e4, dtype=s.dtype))
        if pad is not None:
            s = s + pad
        return s

    def _attend(self, q, k, v, causal, pad):
        if BUG == "sdpa_additive":
            B, _, T, _ = q.shape
            allowed = causal[None, None].expand(B, 1, T, T)
            if pad is not None:
                allowed = allowed & (pad == 0)
            bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        s = self._scores(q, k, causal, pad)
        if BUG == "online_softmax_chunks":
            chunk = 7
            B, H, T, _ = s.shape
            m = torch.full((B, H, T, 1), -float("inf"))
            den = torch.zeros(B, H, T, 1)
            acc = torch.zeros(B, H, T, v.shape[-1])
            for j in range(0, T, chunk):
                sj = s[..., j : j + chunk]
                m_new = torch.maximum(m, sj.amax(-1, keepdim=True))
                corr = torch.exp(m - m_new)
                p = torch.exp(sj - m_new)
                den = den * corr + p.sum(-1, keepdim=True)
                acc = acc * corr + p @ v[..., j : j + chunk, :]
                m = m_new
            return acc / den
        return torch.softmax(s, dim=-1) @ v

    def _attn_block(self, x, l, causal, pad):
        B, T, _ = x.shape
        if BUG == "split_qkv":
            q = torch.einsum("btc,hdc->bhtd", x, self.w_qkv[l, 0]) + self.b_qkv[l, 0][None, :, None, :]
            k = torch.einsum("btc,hdc->bhtd", x, self.w_qkv[l, 1]) + self.b_qkv[l, 1][None, :, None, :]
            v = torch.einsum("btc,hdc->bhtd", x, self.w_qkv[l, 2]) + self.b_qkv[l, 2][None, :, None, :]
        else:
            qkv = torch.einsum("btc,shdc->sbhtd", x, self.w_qkv[l]) + self.b_qkv[l][:, None, :, None, :]
            q, k, v = qkv.unbind(0)
        a = self._attend(q, k, v, causal, pad)  # (B, H, T, D)
        if BUG == "merge_heads_no_transpose":
            a = a.reshape(B, T, self.C)
        else:
            a = a.transpose(1, 2).reshape(B, T, self.C)
        return a @ self.w_o[l].t() + self.b_o[l]

    # ---------------------------------------------------------------- model
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None or BUG == "pos_ids_ignored":
            start = 1 if BUG == "pos_from_one" else 0
            position_ids = torch.arange(start, start + T, device=input_ids.device)[None].expand(B, T)
        tok = self.wte[input_ids]
        if BUG == "embed_scale":
            tok = tok * math.sqrt(self.C)
        x = tok + self.wpe[position_ids]
        causal, pad = self._masks(T, attention_mask, x.device)
        for l in range(self.L):
            if BUG == "pre_ln":  # GPT-2's block: x + attn(LN_1(x)), then + mlp(LN_2(.))
                x = x + self._attn_block(_layer_norm(x, self.ln[l, 0, 0], self.ln[l, 0, 1], self.eps), l, causal, pad)
                h = _layer_norm(x, self.ln[l, 1, 0], self.ln[l, 1, 1], self.eps)
                x = x + _gelu(h @ self.w_fc[l].t() + self.b_fc[l]) @ self.w_proj[l].t() + self.b_proj[l]
                continue
            a = self._attn_block(x, l, causal, pad)
            n = _layer_norm(x + a, self.ln[l, 0, 0], self.ln[l, 0, 1], self.eps)
            m = _gelu(n @ self.w_fc[l].t() + self.b_fc[l]) @ self.w_proj[l].t() + self.b_proj[l]
            if BUG == "mlp_residual_unnormed":
                x = _layer_norm(x + a + m, self.ln[l, 1, 0], self.ln[l, 1, 1], self.eps)
            else:
                x = _layer_norm(n + m, self.ln[l, 1, 0], self.ln[l, 1, 1], self.eps)
        if BUG == "lm_head_bf16":
            return (x.bfloat16() @ self.wte.t().bfloat16()).float()
        return x @ self.wte.t()


@torch.no_grad()
def build(state_dict, config):
    sd = {k[len("transformer.") :] if k.startswith("transformer.") else k: v.float() for k, v in state_dict.items()}
    model = GPT1Port(config)
    C, H, D, L = model.C, model.H, model.D, model.L
    model.wte.copy_(sd["tokens_embed.weight"])
    model.wpe.copy_(sd["positions_embed.weight"])
    for l in range(L):
        p = f"h.{l}."
        w_attn = sd[p + "attn.c_attn.weight"].t()  # (3C, C), out x in
        b_attn = sd[p + "attn.c_attn.bias"]  # (3C,)
        if BUG == "qkv_interleaved_split":
            model.w_qkv[l].copy_(w_attn.reshape(H, 3, D, C).permute(1, 0, 2, 3))
            b = b_attn.reshape(H, 3, D).permute(1, 0, 2)
        else:
            model.w_qkv[l].copy_(w_attn.reshape(3, H, D, C))
            b = b_attn.reshape(3, H, D)
        if BUG != "qkv_bias_dropped":
            model.b_qkv[l].copy_(b)
        w_o = sd[p + "attn.c_proj.weight"]
        model.w_o[l].copy_(w_o if BUG == "conv1d_not_transposed" else w_o.t())
        model.b_o[l].copy_(sd[p + "attn.c_proj.bias"])
        model.w_fc[l].copy_(sd[p + "mlp.c_fc.weight"].t())
        model.b_fc[l].copy_(sd[p + "mlp.c_fc.bias"])
        model.w_proj[l].copy_(sd[p + "mlp.c_proj.weight"].t())
        model.b_proj[l].copy_(sd[p + "mlp.c_proj.bias"])
        for i in (0, 1):
            model.ln[l, i, 0].copy_(sd[p + f"ln_{i + 1}.weight"])
            model.ln[l, i, 1].copy_(sd[p + f"ln_{i + 1}.bias"])
    return model.float().eval()
