"""A hand-written PyTorch port of TrOCR's decoder-only causal LM (Transformers' ``TrOCRForCausalLM``).

Architecture (as implemented here; no encoder hidden states, so no cross-attention runs)
------------------------------------------------------------------------------------------
Sizes: d = config.hidden_size (d_model), H = config.decoder_attention_heads, Dh = d / H,
F = config.decoder_ffn_dim, L = config.decoder_layers, V = config.vocab_size, P = config.max_position_embeddings.

Embeddings, for ids x of shape (B, T):
    pos_t   = t                       (t = 0 .. T-1, the same for every row: TrOCRForCausalLM does not forward
                                       ``position_ids`` to its decoder, so the caller's positions are ignored)
    e       = tok[x] * s + pos_table[pos_t + 2]
              s = sqrt(d) when config.scale_embedding else 1; the learned position table has P + 2 rows and is
              read with an offset of 2 (the fairseq/BART padding hack)
    h0      = LayerNorm_emb(e)        (config.layernorm_embedding)

Mask: additive (B, 1, T, T): 0 where key j <= query i and key j is not padding (attention_mask[b, j] == 1),
      finfo(float32).min elsewhere (the padding mask joins the causal one on the KEY axis).

Each of the L post-norm decoder layers, h of shape (B, T, d):
    q, k, v = h @ Wqkv + bqkv           (Wqkv: (d, 3d) in -> out, split in q | k | v order)
    q       = q * Dh**-0.5              (scaling applied after the bias, as Transformers does)
    heads   : (B, T, d) -> (B, H, T, Dh)   (d split as H blocks of Dh)
    a       = softmax(q k^T + mask) v  -> (B, T, d)
    h       = LayerNorm_attn(h + a @ Wo + bo)
    h       = LayerNorm_ffn(h + relu(h @ W1 + b1) @ W2 + b2)
LayerNorm(x) = (x - mean) / sqrt(biased var + 1e-5) * gamma + beta (nn.LayerNorm's default eps).

logits = h_L @ Wout, Wout: (d, V), no bias, NOT tied to the token embeddings (tie_word_embeddings=False).

Weight layout (differs from Transformers' module tree; ``build`` converts the checkpoint)
-----------------------------------------------------------------------------------------
    tok_emb          (V, d)                model.decoder.embed_tokens.weight
    pos_table        (P + 2, d)            model.decoder.embed_positions.weight (offset rows kept)
    emb_norm         (2, d)                [gamma; beta] of model.decoder.layernorm_embedding
    blocks[i].qkv_w  (d, 3d)               cat(q_proj.W^T, k_proj.W^T, v_proj.W^T, dim=1)
    blocks[i].qkv_b  (3d,)                 cat(q_proj.b, k_proj.b, v_proj.b)
    blocks[i].o_w    (d, d)                out_proj.W^T
    blocks[i].o_b    (d,)
    blocks[i].norms  (2, 2, d)             [[attn gamma, attn beta], [ffn gamma, ffn beta]]
                                           (self_attn_layer_norm, final_layer_norm)
    blocks[i].w1     (d, F), b1 (F,)       fc1 transposed
    blocks[i].w2     (F, d), b2 (d,)       fc2 transposed
    out_w            (d, V)                output_projection.weight^T
The unused cross-attention weights (encoder_attn, encoder_attn_layer_norm) are dropped.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "pos_no_offset",  # learned position table read at position t instead of t + 2 (the offset-2 hack forgotten)
    "use_position_ids",  # honours the caller's position_ids; TrOCRForCausalLM drops them and uses arange(T)
    "scale_after_pos",  # sqrt(d_model) applied to (token + position) instead of to the token embeddings only
    "no_embed_ln",  # layernorm_embedding skipped (config flag misread as off)
    "pre_norm",  # layers written pre-LN (norm before each sublayer) instead of TrOCR's post-LN
    "attn_scale_dmodel",  # attention scaled by d_model**-0.5 instead of head_dim**-0.5
    "qscale_before_bias",  # scaling folded into the q weight only; q bias left unscaled
    "head_split_axis",  # d_model split as (head_dim, heads) instead of (heads, head_dim)
    "causal_diag",  # causal mask built with triu(diagonal=0): each token also masks itself
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
    "ln_unbiased_var",  # hand-written LayerNorm uses the unbiased (n-1) variance
    "act_gelu",  # activation_function ignored: GELU used instead of ReLU
    "tied_output",  # output projection tied to embed_tokens although tie_word_embeddings=False
    "q_not_transposed",  # loader forgets to transpose the (square) q_proj matrix into in->out layout
]

PADDING_ONLY = [
    "use_position_ids",  # without padding no position_ids are passed
    "pad_mask_query_axis",  # without padding the padding mask is all ones
]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with the same additive mask and scale instead of manual softmax
    "pos_table_sliced",  # offset rows sliced off the position table once, then indexed by the raw position
    "qscale_folded",  # head_dim**-0.5 folded into both the q weight and the q bias before the matmul
    "ln_manual",  # hand-written LayerNorm (biased variance, eps 1e-5) instead of F.layer_norm
]

POS_OFFSET = 2
LN_EPS = 1e-5


def _layer_norm(x: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
    gamma, beta = gb[0], gb[1]
    if BUG in ("ln_manual", "ln_unbiased_var"):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=(BUG == "ln_unbiased_var"))
        return (x - mean) * torch.rsqrt(var + LN_EPS) * gamma + beta
    return F.layer_norm(x, (x.shape[-1],), gamma, beta, LN_EPS)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, act: str):
        super().__init__()
        self.d, self.heads, self.dh = d, heads, d // heads
        self.act = act
        self.qkv_w = nn.Parameter(torch.zeros(d, 3 * d))
        self.qkv_b = nn.Parameter(torch.zeros(3 * d))
        self.o_w = nn.Parameter(torch.zeros(d, d))
        self.o_b = nn.Parameter(torch.zeros(d))
        self.norms = nn.Parameter(torch.zeros(2, 2, d))
        self.w1 = nn.Parameter(torch.zeros(d, ffn))
        self.b1 = nn.Parameter(torch.zeros(ffn))
        self.w2 = nn.Parameter(torch.zeros(ffn, d))
        self.b2 = nn.Parameter(torch.zeros(d))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if BUG == "head_split_axis":
            return x.view(b, t, self.dh, self.heads).permute(0, 3, 1, 2)
        return x.view(b, t, self.heads, self.dh).transpose(1, 2)

    def attention(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        d = self.d
        scale = (d if BUG == "attn_scale_dmodel" else self.dh) ** -0.5
        w, bias = self.qkv_w, self.qkv_b
        if BUG in ("qscale_folded", "qscale_before_bias"):
            col = torch.ones(3 * d, dtype=w.dtype)
            col[:d] = scale
            w = w * col
            bias = bias * col if BUG == "qscale_folded" else bias
            scale = 1.0
        if BUG == "split_qkv":
            q = h @ w[:, :d] + bias[:d]
            k = h @ w[:, d : 2 * d] + bias[d : 2 * d]
            v = h @ w[:, 2 * d :] + bias[2 * d :]
        else:
            q, k, v = (h @ w + bias).split(d, dim=-1)
        q = q * scale
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if BUG == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        else:
            scores = q @ k.transpose(-1, -2) + mask
            out = torch.softmax(scores, dim=-1) @ v
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, d)
        return out @ self.o_w + self.o_b

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        x = h @ self.w1 + self.b1
        x = F.gelu(x) if BUG == "act_gelu" or self.act == "gelu" else torch.relu(x)
        return x @ self.w2 + self.b2

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if BUG == "pre_norm":
            h = h + self.attention(_layer_norm(h, self.norms[0]), mask)
            return h + self.ffn(_layer_norm(h, self.norms[1]))
        h = _layer_norm(h + self.attention(h, mask), self.norms[0])
        return _layer_norm(h + self.ffn(h), self.norms[1])


class TrOCRPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.d = d
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.use_emb_norm = bool(config.layernorm_embedding)
        self.tok_emb = nn.Parameter(torch.zeros(config.vocab_size, d))
        self.pos_table = nn.Parameter(torch.zeros(config.max_position_embeddings + POS_OFFSET, d))
        self.emb_norm = nn.Parameter(torch.zeros(2, d))
        self.blocks = nn.ModuleList(
            Block(d, config.decoder_attention_heads, config.decoder_ffn_dim, config.activation_function)
            for _ in range(config.decoder_layers)
        )
        self.out_w = nn.Parameter(torch.zeros(d, config.vocab_size))

    def _positions(self, input_ids, position_ids):
        b, t = input_ids.shape
        if BUG == "use_position_ids" and position_ids is not None:
            return position_ids.long()
        return torch.arange(t, device=input_ids.device).expand(b, t)

    def _pos_embed(self, pos: torch.Tensor) -> torch.Tensor:
        if BUG == "pos_table_sliced":
            return self.pos_table[POS_OFFSET:][pos]
        if BUG == "pos_no_offset":
            return self.pos_table[pos]
        return self.pos_table[pos + POS_OFFSET]

    def _mask(self, attention_mask, b: int, t: int, device) -> torch.Tensor:
        diag = -1 if BUG == "causal_diag" else 0
        allowed = torch.ones(t, t, dtype=torch.bool, device=device).tril(diag)[None].expand(b, t, t)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if BUG == "pad_mask_query_axis":
                allowed = allowed & keep[:, :, None]
            else:
                allowed = allowed & keep[:, None, :]
        neg = torch.finfo(torch.float32).min
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return torch.where(allowed, zero, torch.full((), neg, device=device))[:, None]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        tok = self.tok_emb[input_ids]
        pos = self._pos_embed(self._positions(input_ids, position_ids))
        if BUG == "scale_after_pos":
            h = (tok + pos) * self.embed_scale
        else:
            h = tok * self.embed_scale + pos
        if self.use_emb_norm and BUG != "no_embed_ln":
            h = _layer_norm(h, self.emb_norm)
        mask = self._mask(attention_mask, b, t, input_ids.device)
        for blk in self.blocks:
            h = blk(h, mask)
        return h @ self.out_w


@torch.no_grad()
def build(state_dict, config) -> nn.Module:
    sd = {k: v.float() for k, v in state_dict.items()}
    pre = "model.decoder."
    model = TrOCRPort(config)
    model.tok_emb.copy_(sd[pre + "embed_tokens.weight"])
    model.pos_table.copy_(sd[pre + "embed_positions.weight"])
    if config.layernorm_embedding:
        model.emb_norm.copy_(
            torch.stack([sd[pre + "layernorm_embedding.weight"], sd[pre + "layernorm_embedding.bias"]])
        )
    for i, blk in enumerate(model.blocks):
        p = f"{pre}layers.{i}."
        a = p + "self_attn."
        wq = sd[a + "q_proj.weight"]
        wq = wq if BUG == "q_not_transposed" else wq.t()
        blk.qkv_w.copy_(torch.cat([wq, sd[a + "k_proj.weight"].t(), sd[a + "v_proj.weight"].t()], dim=1))
        blk.qkv_b.copy_(torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]))
        blk.o_w.copy_(sd[a + "out_proj.weight"].t())
        blk.o_b.copy_(sd[a + "out_proj.bias"])
        blk.norms.copy_(
            torch.stack(
                [
                    torch.stack([sd[p + "self_attn_layer_norm.weight"], sd[p + "self_attn_layer_norm.bias"]]),
                    torch.stack([sd[p + "final_layer_norm.weight"], sd[p + "final_layer_norm.bias"]]),
                ]
            )
        )
        blk.w1.copy_(sd[p + "fc1.weight"].t())
        blk.b1.copy_(sd[p + "fc1.bias"])
        blk.w2.copy_(sd[p + "fc2.weight"].t())
        blk.b2.copy_(sd[p + "fc2.bias"])
    tied = BUG == "tied_output" or (
        getattr(config, "tie_word_embeddings", False) and "output_projection.weight" not in sd
    )
    model.out_w.copy_((sd[pre + "embed_tokens.weight"] if tied else sd["output_projection.weight"]).t())
    return model.float().eval()
