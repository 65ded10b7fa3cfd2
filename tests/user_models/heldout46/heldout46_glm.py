"""A from-scratch PyTorch port of GLM (GLM-4 "glm" text decoder, ``GlmForCausalLM``).

Architecture as implemented (B batch, S sequence, D hidden, H query heads, K key/value heads, d head_dim,
r = int(d * partial_rotary_factor) rotary dims, I intermediate size, L layers, V vocab):

    x_0 = E[input_ids]                                              (B, S, D)
    for each layer l:
        a   = RMSNorm(x; g_attn[l], eps)         RMSNorm(x) = x * rsqrt(mean(x^2, -1) + eps) * g
        qkv = a @ Wqkv[l] + bqkv[l]                                 (B, S, (H + 2K) d)   (q, k, v all biased)
        q (B,H,S,d), k (B,K,S,d), v (B,K,S,d)
        RoPE on the first r dims of every q / k head only (the other d - r dims pass through), GLM's
        *interleaved* pairs: for pair i (dims 2i, 2i+1), theta_i = p * base^(-2i / r), p the position:
            y[2i]   = x[2i] cos(theta_i) - x[2i+1] sin(theta_i)
            y[2i+1] = x[2i+1] cos(theta_i) + x[2i] sin(theta_i)
        k, v repeated per group: query head h reads kv head h // (H / K)
        A = softmax(q k^T / sqrt(d) + mask) v     mask: causal and key padding, filled with finfo(float32).min
        x = x + concat_heads(A) @ Wo[l]                             (no bias on the output projection)
        m = RMSNorm(x; g_mlp[l], eps)
        x = x + (silu(m @ Wgate[l]) * (m @ Wup[l])) @ Wdown[l]
    logits = RMSNorm(x; g_final, eps) @ U                            (B, S, V)   (untied output matrix)

Weight layout (mine, not Transformers' module tree): every matrix is stored transposed (in -> out) and every
per-layer tensor is stacked over layers in one parameter with a leading L axis:
    tok_emb (V, D); wqkv (L, D, (H+2K) d) = [q | k | v] fused; bqkv (L, (H+2K) d); wo (L, H d, D);
    w_gate (L, D, I), w_up (L, D, I) (the checkpoint's fused gate_up_proj split in two, gate = first half);
    w_down (L, I, D); g_attn (L, D); g_mlp (L, D); g_final (D,); unembed (D, V).
``build`` converts the Transformers state dict to this layout.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_full_dim",  # partial_rotary_factor ignored: RoPE rotates all head_dim dims (frequencies over head_dim)
    "rope_neox",  # RoPE pairs dims (i, i + r/2) (NeoX rotate_half) instead of GLM's interleaved pairs (2i, 2i+1)
    "rope_cat_table",  # interleaved rotation fed the cat(freqs, freqs) cos/sin table without repeat_interleave
    "rope_freq_headdim",  # inverse-frequency exponent divided by head_dim instead of the rotary dim r
    "rope_pos_row0",  # cos/sin table built from position_ids[0] and broadcast over the whole batch
    "bias_after_rope",  # q/k projection bias added after the rotary embedding instead of before
    "gate_up_swapped",  # fused gate_up_proj split in the wrong order (silu applied to the up half)
    "gqa_tile",  # kv heads repeated tile-wise (h % K) instead of interleaved (h // (H/K))
    "qk_layer_scaling_unrestored",  # ChatGLM query_key_layer_scaling: scores divided by layer number, never multiplied back
    "mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
    "layernorm_not_rms",  # norms subtract the mean (ChatGLM rmsnorm=False LayerNorm path) instead of RMSNorm
    "tied_lm_head",  # tie_word_embeddings misread: logits use the input embedding instead of lm_head
    "glm4_sandwich_norm",  # Glm4 layout: post_attention_layernorm applied to the attn output, MLP input left unnormed
    "causal_diag_masked",  # causal mask off by one: triangle excludes the diagonal, a token cannot see itself
]

PADDING_ONLY = ["rope_pos_row0", "mask_query_axis"]

CLEAN = [
    "rope_neox_permuted",  # q/k rotary rows permuted at load to half-split order, then NeoX rotate_half
    "rope_complex",  # interleaved RoPE as a complex multiplication (view_as_complex * polar)
    "qk_layer_scaling",  # ChatGLM query_key_layer_scaling: q / (sqrt(d) * layer), scores * layer before softmax
    "norm_folded",  # RMSNorm gains folded into the following matrices (Wqkv, Wgate/Wup, unembed) at load
    "online_softmax",  # flash-style attention: keys in blocks of 8 with a running max and running sum
]


def _bug():
    return BUG


def _rope_dims(config):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rp = getattr(config, "rope_parameters", None) or {}
    prf = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return head_dim, int(head_dim * prf), float(theta)


class GlmPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.D = config.hidden_size
        self.H = config.num_attention_heads
        self.K = config.num_key_value_heads or config.num_attention_heads
        self.L = config.num_hidden_layers
        self.I = config.intermediate_size
        self.V = config.vocab_size
        self.eps = config.rms_norm_eps
        self.d, self.r, self.theta = _rope_dims(config)
        H, K, d, D, L, I, V = self.H, self.K, self.d, self.D, self.L, self.I, self.V
        self.tok_emb = nn.Parameter(torch.zeros(V, D))
        self.wqkv = nn.Parameter(torch.zeros(L, D, (H + 2 * K) * d))
        self.bqkv = nn.Parameter(torch.zeros(L, (H + 2 * K) * d))
        self.wo = nn.Parameter(torch.zeros(L, H * d, D))
        self.w_gate = nn.Parameter(torch.zeros(L, D, I))
        self.w_up = nn.Parameter(torch.zeros(L, D, I))
        self.w_down = nn.Parameter(torch.zeros(L, I, D))
        self.g_attn = nn.Parameter(torch.ones(L, D))
        self.g_mlp = nn.Parameter(torch.ones(L, D))
        self.g_final = nn.Parameter(torch.ones(D))
        self.unembed = nn.Parameter(torch.zeros(D, V))
        self.rope_permuted = False  # set by build for the rope_neox_permuted layout

    # ---- pieces -------------------------------------------------------------------------------------
    def norm(self, x, g):
        if _bug() == "layernorm_not_rms":
            x = x - x.mean(-1, keepdim=True)
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * g

    def rope_angles(self, position_ids):
        bug = _bug()
        r = self.d if bug == "rope_full_dim" else self.r
        denom = self.d if bug == "rope_freq_headdim" else r
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, r, 2, dtype=torch.float32) / denom))
        pos = position_ids.float()
        if bug == "rope_pos_row0":
            pos = pos[:1]
        return pos[..., None] * inv_freq  # (B or 1, S, r/2)

    def rope(self, x, ang):
        """x (B, n, S, d); ang (B, S, r'/2); rotates the first r' = 2 * ang.shape[-1] dims."""
        bug = _bug()
        r = 2 * ang.shape[-1]
        xr, xp = x[..., :r], x[..., r:]
        ang = ang[:, None]  # (B, 1, S, r/2)
        cos, sin = ang.cos(), ang.sin()
        if bug == "rope_neox" or (bug == "rope_neox_permuted" and self.rope_permuted):
            a, b = xr[..., : r // 2], xr[..., r // 2 :]
            y = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        elif bug == "rope_complex":
            xc = torch.view_as_complex(xr.reshape(*xr.shape[:-1], r // 2, 2).contiguous())
            y = torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang).to(xc.dtype)).flatten(-2)
        elif bug == "rope_cat_table":
            cos_t, sin_t = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            rot = torch.stack([-xr[..., 1::2], xr[..., 0::2]], dim=-1).flatten(-2)
            y = xr * cos_t + rot * sin_t
        else:
            x0, x1 = xr[..., 0::2], xr[..., 1::2]
            y = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)
        return torch.cat([y, xp], dim=-1)

    def attend(self, q, k, v, allowed, layer):
        """q (B,H,S,d), k/v (B,H,S,d) already repeated; allowed (B or 1, 1, S, S) bool."""
        bug = _bug()
        neg = torch.finfo(q.dtype).min
        scale = 1.0 / math.sqrt(self.d)
        if bug == "online_softmax":
            B, H, S, d = q.shape
            m = torch.full((B, H, S, 1), float("-inf"))
            l_ = torch.zeros(B, H, S, 1)
            acc = torch.zeros(B, H, S, d)
            for j in range(0, S, 8):
                s = (q @ k[:, :, j : j + 8].transpose(-1, -2)) * scale
                s = s.masked_fill(~allowed[..., j : j + 8], neg)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                corr = torch.exp(m - m_new)
                p = torch.exp(s - m_new)
                l_ = l_ * corr + p.sum(-1, keepdim=True)
                acc = acc * corr + p @ v[:, :, j : j + 8]
                m = m_new
            return acc / l_
        if bug in ("qk_layer_scaling", "qk_layer_scaling_unrestored"):
            coeff = float(layer + 1)
            s = (q / (math.sqrt(self.d) * coeff)) @ k.transpose(-1, -2)
            if bug == "qk_layer_scaling":
                s = s.float() * coeff
        else:
            s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed, neg)
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        return p @ v

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        H, K, d = self.H, self.K, self.d
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        ang = self.rope_angles(position_ids)

        diag = -1 if bug == "causal_diag_masked" else 0
        allowed = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril(diag)[None, None]
        if attention_mask is not None:
            keep = attention_mask.bool()
            if bug == "mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]

        x = self.tok_emb[input_ids]
        for l in range(self.L):
            a = self.norm(x, self.g_attn[l])
            if bug == "bias_after_rope":
                qkv = a @ self.wqkv[l]
            else:
                qkv = a @ self.wqkv[l] + self.bqkv[l]
            q, k, v = qkv.split([H * d, K * d, K * d], dim=-1)
            q = q.view(B, S, H, d).transpose(1, 2)
            k = k.view(B, S, K, d).transpose(1, 2)
            v = v.view(B, S, K, d).transpose(1, 2)
            q, k = self.rope(q, ang), self.rope(k, ang)
            if bug == "bias_after_rope":
                bq, bk, bv = self.bqkv[l].split([H * d, K * d, K * d])
                q = q + bq.view(1, H, 1, d)
                k = k + bk.view(1, K, 1, d)
                v = v + bv.view(1, K, 1, d)
            if bug == "gqa_tile":
                k, v = k.repeat(1, H // K, 1, 1), v.repeat(1, H // K, 1, 1)
            else:
                k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
            o = self.attend(q, k, v, allowed, l)
            o = o.transpose(1, 2).reshape(B, S, H * d) @ self.wo[l]
            if bug == "glm4_sandwich_norm":
                x = x + self.norm(o, self.g_mlp[l])
                m = x
            else:
                x = x + o
                m = self.norm(x, self.g_mlp[l])
            x = x + (F.silu(m @ self.w_gate[l]) * (m @ self.w_up[l])) @ self.w_down[l]
        return self.norm(x, self.g_final) @ self.unembed


def _rotary_perm(d, r):
    """Index order moving each head's interleaved rotary dims (0,1),(2,3),... to half-split (evens, odds)."""
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])


@torch.no_grad()
def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = GlmPort(config)
    H, K, d, L, I = model.H, model.K, model.d, model.L, model.I
    perm = _rotary_perm(d, model.r)

    def heads_perm(w, n):  # w (n*d, ...) rows grouped per head
        return w.view(n, d, *w.shape[1:])[:, perm].reshape(n * d, *w.shape[1:])

    model.tok_emb.copy_(sd["model.embed_tokens.weight"])
    for l in range(L):
        p = f"model.layers.{l}."
        wq, wk, wv = (sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        zq, zk, zv = (
            sd.get(p + f"self_attn.{n}_proj.bias", torch.zeros(w.shape[0])) for n, w in zip("qkv", (wq, wk, wv))
        )
        if bug == "rope_neox_permuted":
            wq, zq = heads_perm(wq, H), heads_perm(zq, H)
            wk, zk = heads_perm(wk, K), heads_perm(zk, K)
        model.wqkv[l].copy_(torch.cat([wq, wk, wv], 0).t())
        model.bqkv[l].copy_(torch.cat([zq, zk, zv], 0))
        model.wo[l].copy_(sd[p + "self_attn.o_proj.weight"].t())
        gu = sd[p + "mlp.gate_up_proj.weight"]  # (2I, D): [gate; up]
        gate, up = (gu[I:], gu[:I]) if bug == "gate_up_swapped" else (gu[:I], gu[I:])
        model.w_gate[l].copy_(gate.t())
        model.w_up[l].copy_(up.t())
        model.w_down[l].copy_(sd[p + "mlp.down_proj.weight"].t())
        model.g_attn[l].copy_(sd[p + "input_layernorm.weight"])
        model.g_mlp[l].copy_(sd[p + "post_attention_layernorm.weight"])
    model.g_final.copy_(sd["model.norm.weight"])
    if bug == "tied_lm_head" or "lm_head.weight" not in sd:
        model.unembed.copy_(sd["model.embed_tokens.weight"].t())
    else:
        model.unembed.copy_(sd["lm_head.weight"].t())
    model.rope_permuted = bug == "rope_neox_permuted"
    if bug == "norm_folded":
        model.wqkv.mul_(model.g_attn[:, :, None])
        model.w_gate.mul_(model.g_mlp[:, :, None])
        model.w_up.mul_(model.g_mlp[:, :, None])
        model.unembed.mul_(model.g_final[:, None])
        model.g_attn.fill_(1.0)
        model.g_mlp.fill_(1.0)
        model.g_final.fill_(1.0)
    return model.float().eval()
