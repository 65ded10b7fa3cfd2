"""A from-scratch PyTorch port of RoFormer as a causal LM (``RoFormerForCausalLM``, ``is_decoder=True``).

Architecture (B batch, S sequence, E = embedding_size, H = hidden_size, nh heads, d = H / nh, I = intermediate_size,
V = vocab_size, L layers; every LayerNorm is post-norm, eps = config.layer_norm_eps):

  embeddings:  e = LN_emb(W_tok[ids] + t0)                        (B, S, E)   t0 = token-type-0 row
               x = e @ P + p                                       (B, S, H)   (embeddings projection, E != H)
  rotary table: T = the checkpoint's frozen ``embed_positions`` table (max_pos, d); its first half holds the
               "sin" features s_i, its second half the "cos" features c_i (i < d/2). Positions are always
               0..S-1 (Transformers' RoFormer ignores ``position_ids``; the padded row is not shifted).
               Pairs are interleaved (GPT-J style): for a head vector z and position m
                   z'[2i]   = z[2i]   * c_i(m) - z[2i+1] * s_i(m)
                   z'[2i+1] = z[2i+1] * c_i(m) + z[2i]   * s_i(m)
  each layer:  q, k, v = x @ Wqkv + bqkv, split in three and into nh heads of d   (B, nh, S, d)
               q, k  rotated at their positions; v rotated too (config.rotary_value = True)
               A = softmax(q k^T / sqrt(d) + M)  with M = causal (j <= i) and key padding, additive finfo.min
               a = merge_heads(A v) @ Wo + bo
               h = LN_1(x + a)
               x = LN_2(h + gelu_erf(h @ Wup + bup) @ Wdown + bdown)
  lm head:     y = LN_head(gelu_erf(x @ Wt + bt))                  (B, S, E)
               logits = y @ W_tok^T + b_out                        (B, S, V)   (decoder tied to W_tok)

Weight layout (my own, converted in ``build``): all matrices stored transposed, (in, out); per-layer weights
stacked on a leading layer axis; q/k/v fused; each LayerNorm's weight and bias stacked as one (2, n) tensor:
  tok (V, E); type0 (E,); ln_emb (2, E); proj_w (E, H); proj_b (H,)
  rope_sin, rope_cos (max_pos, d/2) buffers (the checkpoint table's two halves)
  wqkv (L, H, 3H); bqkv (L, 3H); wo (L, H, H); bo (L, H); ln_attn (L, 2, H)
  wup (L, H, I); bup (L, I); wdown (L, I, H); bdown (L, H); ln_ffn (L, 2, H)
  head_w (H, E); head_b (E,); ln_head (2, E); out_bias (V,)
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_neox_halves",  # rotary pairs taken as (i, i + d/2) halves (NeoX rotate_half) instead of RoFormer's interleaved (2i, 2i+1)
    "rope_value_skipped",  # config.rotary_value ignored: the rotary embedding is applied to q and k but not to v
    "rope_sin_cos_swapped",  # the position table's halves read as (cos, sin) instead of (sin, cos)
    "rope_pos_from_one",  # rotary positions counted from 1 instead of 0 (only visible because v is rotated too)
    "attn_scale_hidden",  # scores divided by sqrt(hidden_size) instead of sqrt(head_dim)
    "ln_unbiased_var",  # hand-written LayerNorm uses the unbiased (n-1) variance
    "ffn_residual_block_input",  # FFN residual adds the layer's input x instead of the attention block's output h
    "pre_norm",  # LayerNorms applied before each sub-block (pre-LN) instead of after the residual add (post-LN)
    "token_type_dropped",  # the token-type-0 embedding row is not added (type_vocab_size=1 treated as unused)
    "head_ln_before_act",  # lm head transform runs dense -> LayerNorm -> gelu instead of dense -> gelu -> LayerNorm
    "lm_bias_dropped",  # the tied decoder's own output bias (cls.predictions.bias) is left out
    "bidirectional",  # config.is_decoder ignored: no causal mask (RoFormer treated as the usual encoder)
    "pad_mask_query_axis",  # the padding mask is broadcast over the query axis instead of the key axis
    "heads_transposed",  # head split reshapes to (S, d, nh) instead of (S, nh, d), grouping strided features per head
]

PADDING_ONLY = ["pad_mask_query_axis"]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight instead of one fused matmul
    "complex_rope",  # rotary applied as a complex multiplication (z0 + i z1) * (c + i s) over interleaved pairs
    "sdpa",  # attention by F.scaled_dot_product_attention with the same additive mask
    "ln_functional",  # LayerNorms by F.layer_norm instead of the hand-written mean / variance form
    "per_head_loop",  # attention computed head by head in a Python loop, then concatenated
]


def _ln(x, wb, eps):
    if BUG != "ln_functional":
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=(BUG == "ln_unbiased_var"))
        return (x - mean) / torch.sqrt(var + eps) * wb[0] + wb[1]
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], eps)


def _act(x):
    return F.gelu(x)  # hidden_act "gelu": the exact erf form


def _rope(z, sin, cos):
    """z (B, nh, S, d); sin, cos (S, d/2): interleaved pairs (2i, 2i+1) rotated by angle i."""
    if BUG == "rope_neox_halves":
        half = z.shape[-1] // 2
        c = torch.cat([cos, cos], -1)
        s = torch.cat([sin, sin], -1)
        rot = torch.cat([-z[..., half:], z[..., :half]], -1)
        return z * c + rot * s
    if BUG == "complex_rope":
        zc = torch.view_as_complex(z.reshape(*z.shape[:-1], -1, 2).contiguous())
        r = torch.complex(cos, sin)
        return torch.view_as_real(zc * r).reshape(z.shape)
    c = torch.repeat_interleave(cos, 2, dim=-1)
    s = torch.repeat_interleave(sin, 2, dim=-1)
    rot = torch.stack([-z[..., 1::2], z[..., 0::2]], dim=-1).reshape(z.shape)
    return z * c + rot * s


class RoFormerCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        V, E, H = config.vocab_size, config.embedding_size, config.hidden_size
        I, L, nh = config.intermediate_size, config.num_hidden_layers, config.num_attention_heads
        self.nh, self.d, self.H, self.L = nh, H // nh, H, L
        self.eps = config.layer_norm_eps
        P = config.max_position_embeddings
        z = lambda *s: nn.Parameter(torch.zeros(*s))  # noqa: E731
        self.tok, self.type0, self.ln_emb = z(V, E), z(E), z(2, E)
        self.proj_w, self.proj_b = z(E, H), z(H)
        self.register_buffer("rope_sin", torch.zeros(P, self.d // 2))
        self.register_buffer("rope_cos", torch.zeros(P, self.d // 2))
        self.wqkv, self.bqkv = z(L, H, 3 * H), z(L, 3 * H)
        self.wo, self.bo, self.ln_attn = z(L, H, H), z(L, H), z(L, 2, H)
        self.wup, self.bup, self.wdown, self.bdown = z(L, H, I), z(L, I), z(L, I, H), z(L, H)
        self.ln_ffn = z(L, 2, H)
        self.head_w, self.head_b, self.ln_head, self.out_bias = z(H, E), z(E), z(2, E), z(V)

    # ---- attention -------------------------------------------------------------------------------------------
    def _split(self, t):
        B, S, _ = t.shape
        if BUG == "heads_transposed":
            return t.view(B, S, self.d, self.nh).permute(0, 3, 1, 2)
        return t.view(B, S, self.nh, self.d).transpose(1, 2)

    def _merge(self, t):
        B, _, S, _ = t.shape
        if BUG == "heads_transposed":
            return t.permute(0, 2, 3, 1).reshape(B, S, self.H)
        return t.transpose(1, 2).reshape(B, S, self.H)

    def _attention(self, x, i, sin, cos, bias):
        H = self.H
        if BUG == "split_qkv":
            w, b = self.wqkv[i], self.bqkv[i]
            q = x @ w[:, :H] + b[:H]
            k = x @ w[:, H : 2 * H] + b[H : 2 * H]
            v = x @ w[:, 2 * H :] + b[2 * H :]
        else:
            q, k, v = (x @ self.wqkv[i] + self.bqkv[i]).split(H, dim=-1)
        q, k, v = self._split(q), self._split(k), self._split(v)
        q, k = _rope(q, sin, cos), _rope(k, sin, cos)
        if BUG != "rope_value_skipped" and self.config.rotary_value:
            v = _rope(v, sin, cos)
        scale = math.sqrt(H if BUG == "attn_scale_hidden" else self.d)
        if BUG == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0 / scale)
        elif BUG == "per_head_loop":
            outs = []
            for h in range(self.nh):
                s = q[:, h] @ k[:, h].transpose(-1, -2) / scale + bias[:, 0]
                outs.append(torch.softmax(s, dim=-1) @ v[:, h])
            ctx = torch.stack(outs, dim=1)
        else:
            scores = q @ k.transpose(-1, -2) / scale + bias
            ctx = torch.softmax(scores, dim=-1) @ v
        return self._merge(ctx) @ self.wo[i] + self.bo[i]

    def _mask(self, attention_mask, B, S, device):
        allowed = torch.ones(S, S, dtype=torch.bool, device=device)
        if self.config.is_decoder and BUG != "bidirectional":
            allowed = torch.tril(allowed)
        allowed = allowed[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            keep = attention_mask.to(device=device).bool()
            if BUG == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
        return bias.masked_fill(~allowed, torch.finfo(torch.float32).min)

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        # position_ids is accepted but, as in Transformers' RoFormer, the rotary positions are 0..S-1.
        B, S = input_ids.shape
        dev = input_ids.device
        e = self.tok[input_ids]
        if BUG != "token_type_dropped":
            e = e + self.type0
        e = _ln(e, self.ln_emb, self.eps)
        x = e @ self.proj_w + self.proj_b

        pos = torch.arange(S, device=dev) + (1 if BUG == "rope_pos_from_one" else 0)
        sin, cos = self.rope_sin[pos], self.rope_cos[pos]
        if BUG == "rope_sin_cos_swapped":
            sin, cos = cos, sin
        bias = self._mask(attention_mask, B, S, dev)

        for i in range(self.L):
            if BUG == "pre_norm":
                x = x + self._attention(_ln(x, self.ln_attn[i], self.eps), i, sin, cos, bias)
                h = _ln(x, self.ln_ffn[i], self.eps)
                x = x + _act(h @ self.wup[i] + self.bup[i]) @ self.wdown[i] + self.bdown[i]
                continue
            h = _ln(x + self._attention(x, i, sin, cos, bias), self.ln_attn[i], self.eps)
            f = _act(h @ self.wup[i] + self.bup[i]) @ self.wdown[i] + self.bdown[i]
            x = _ln((x if BUG == "ffn_residual_block_input" else h) + f, self.ln_ffn[i], self.eps)

        y = x @ self.head_w + self.head_b
        if BUG == "head_ln_before_act":
            y = _act(_ln(y, self.ln_head, self.eps))
        else:
            y = _ln(_act(y), self.ln_head, self.eps)
        logits = y @ self.tok.t()
        if BUG != "lm_bias_dropped":
            logits = logits + self.out_bias
        return logits


def build(state_dict, config) -> nn.Module:
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    m = RoFormerCausalLM(config)
    L = config.num_hidden_layers
    p = "roformer."
    lay = lambda i, n: sd[f"{p}encoder.layer.{i}.{n}"]  # noqa: E731
    stack = lambda f: torch.stack([f(i) for i in range(L)])  # noqa: E731
    ln = lambda pre: torch.stack([sd[pre + ".weight"], sd[pre + ".bias"]])  # noqa: E731
    half = m.d // 2
    table = sd[f"{p}encoder.embed_positions.weight"]
    new = {
        "tok": sd[f"{p}embeddings.word_embeddings.weight"],
        "type0": sd[f"{p}embeddings.token_type_embeddings.weight"][0],
        "ln_emb": ln(f"{p}embeddings.LayerNorm"),
        "proj_w": sd[f"{p}embeddings_project.weight"].t(),
        "proj_b": sd[f"{p}embeddings_project.bias"],
        "rope_sin": table[:, :half],
        "rope_cos": table[:, half:],
        "wqkv": stack(
            lambda i: torch.cat([lay(i, f"attention.self.{n}.weight") for n in ("query", "key", "value")]).t()
        ),
        "bqkv": stack(lambda i: torch.cat([lay(i, f"attention.self.{n}.bias") for n in ("query", "key", "value")])),
        "wo": stack(lambda i: lay(i, "attention.output.dense.weight").t()),
        "bo": stack(lambda i: lay(i, "attention.output.dense.bias")),
        "ln_attn": stack(lambda i: ln(f"{p}encoder.layer.{i}.attention.output.LayerNorm")),
        "wup": stack(lambda i: lay(i, "intermediate.dense.weight").t()),
        "bup": stack(lambda i: lay(i, "intermediate.dense.bias")),
        "wdown": stack(lambda i: lay(i, "output.dense.weight").t()),
        "bdown": stack(lambda i: lay(i, "output.dense.bias")),
        "ln_ffn": stack(lambda i: ln(f"{p}encoder.layer.{i}.output.LayerNorm")),
        "head_w": sd["cls.predictions.transform.dense.weight"].t(),
        "head_b": sd["cls.predictions.transform.dense.bias"],
        "ln_head": ln("cls.predictions.transform.LayerNorm"),
        "out_bias": sd["cls.predictions.bias"],
    }
    m.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=True)
    return m.float().eval()
