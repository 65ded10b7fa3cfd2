"""A hand-written PyTorch port of BioGPT (Transformers ``BioGptForCausalLM``), float32, no cache.

Architecture (D = hidden_size, H = num_attention_heads, d = D / H, F = intermediate_size, V = vocab_size,
P = max_position_embeddings, B = batch, T = sequence length):

    x_0   = sqrt(D) * E[ids] + Pos[position_ids + 2]              (B, T, D)
            E: (V, D) token table, scaled by sqrt(D) when config.scale_embedding, else by 1;
            Pos: (P + 2, D) learned positions; the "+ 2" is BioGPT's fairseq padding offset.
            position_ids default to arange(T) (also when a mask is given); given ones are used as they are.
    per layer l (pre-LayerNorm blocks):
        h    = LN(x; g1, b1)                                     LN(x) = (x - mean) / sqrt(var_biased + 1e-5) * g + b
        q, k, v = split(h @ W_qkv + b_qkv)                       W_qkv: (D, 3D), columns [q | k | v]
        each viewed (B, T, H, d) -> (B, H, T, d)
        s    = q k^T / sqrt(d) + mask                            mask: causal (key j <= query i) and key not padding
        a    = softmax(s, keys) v  -> (B, T, D)                  (heads concatenated back in order)
        x    = x + a @ W_o + b_o                                  W_o: (D, D)
        h    = LN(x; g2, b2)
        x    = x + gelu_erf(h @ W_up + b_up) @ W_down + b_down    W_up: (D, F), W_down: (F, D)
    y      = LN(x; g_out, b_out)
    logits = y @ E^T                                              (tied, unscaled table; untied: own head)

Note: Transformers builds every LayerNorm as nn.LayerNorm(D) with the default eps 1e-5 (it does not read
config.layer_norm_eps), so 1e-5 is used here too.

Weight layout (my own; converted from the checkpoint in ``build``):
    tok_table      (V, D)           biogpt.embed_tokens.weight (unscaled)
    pos_table      (P + 2, D)       biogpt.embed_positions.weight (offset rows kept)
    blocks[l].norm1  (2, D)         stacked [gamma; beta] of self_attn_layer_norm
    blocks[l].w_qkv  (D, 3D)        [q_proj.W^T | k_proj.W^T | v_proj.W^T]   (in -> out)
    blocks[l].b_qkv  (3D,)          [q_proj.b | k_proj.b | v_proj.b]
    blocks[l].w_o    (D, D)         out_proj.W^T
    blocks[l].b_o    (D,)
    blocks[l].norm2  (2, D)         stacked [gamma; beta] of final_layer_norm (the FFN pre-norm)
    blocks[l].w_up   (D, F), b_up (F,)      fc1 (transposed)
    blocks[l].w_down (F, D), b_down (D,)    fc2 (transposed)
    norm_out       (2, D)           stacked [gamma; beta] of biogpt.layer_norm
    head           (V, D)           only when the embeddings are not tied (output_projection.weight)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "no_pos_offset",  # learned positions looked up at position_ids instead of position_ids + 2 (fairseq offset dropped)
    "embed_scale_head_dim",  # embedding scale sqrt(head_dim) instead of sqrt(hidden_size)
    "scale_after_pos",  # sqrt(D) applied to (token + position) instead of to the token embedding only
    "tied_head_scaled",  # tied LM head multiplies by the embedding scale too (reuses the scaled lookup)
    "gelu_tanh",  # FFN uses tanh-approximate GELU instead of exact erf GELU (hidden_act "gelu")
    "attn_scale_hidden",  # attention scores scaled by 1/sqrt(hidden_size) instead of 1/sqrt(head_dim)
    "post_norm_ffn",  # FFN block post-norm (LN after the residual add) instead of pre-norm (normalize_before)
    "head_split_transposed",  # q/k/v heads split as (d, H) instead of (H, d): each head gets strided channels
    "causal_off_by_one",  # causal mask built with diagonal=1: each token also sees the next token
    "pad_mask_query_axis",  # padding mask applied along the query axis instead of the key axis
    "final_norm_from_layer",  # final LayerNorm loaded from the last layer's final_layer_norm (fairseq name clash)
    "ln_unbiased_var",  # LayerNorm variance with Bessel's correction (torch.var default) instead of biased
    "ignore_position_ids",  # given position_ids ignored, positions taken as arange(T) (wrong for left padding)
    "out_proj_not_transposed",  # square out_proj weight copied as-is into the in->out layout (no transpose)
]

PADDING_ONLY = [
    "pad_mask_query_axis",
    "ignore_position_ids",
]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on column slices of the fused weight instead of one fused matmul
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of the manual softmax
    "pos_table_shifted",  # position table sliced past the 2 offset rows, indexed by raw position ids
    "functional_layernorm",  # F.layer_norm instead of the hand-written mean/variance LayerNorm
    "prescaled_embedding",  # token table multiplied by sqrt(D) before the lookup instead of after
]

LN_EPS = 1e-5  # nn.LayerNorm's default, which Transformers' BioGPT uses for every norm
POS_OFFSET = 2  # BioGPT's learned-position offset


def layer_norm(x, gb):
    """LayerNorm over the last axis with stacked [gamma; beta]."""
    if BUG == "functional_layernorm":
        return F.layer_norm(x, (x.shape[-1],), gb[0], gb[1], LN_EPS)
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    if BUG == "ln_unbiased_var":
        var = x.var(-1, keepdim=True)
    else:
        var = (xc * xc).mean(-1, keepdim=True)
    return xc * torch.rsqrt(var + LN_EPS) * gb[0] + gb[1]


class Block(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.norm1 = nn.Parameter(torch.zeros(2, d_model))
        self.w_qkv = nn.Parameter(torch.zeros(d_model, 3 * d_model))
        self.b_qkv = nn.Parameter(torch.zeros(3 * d_model))
        self.w_o = nn.Parameter(torch.zeros(d_model, d_model))
        self.b_o = nn.Parameter(torch.zeros(d_model))
        self.norm2 = nn.Parameter(torch.zeros(2, d_model))
        self.w_up = nn.Parameter(torch.zeros(d_model, d_ff))
        self.b_up = nn.Parameter(torch.zeros(d_ff))
        self.w_down = nn.Parameter(torch.zeros(d_ff, d_model))
        self.b_down = nn.Parameter(torch.zeros(d_model))

    def _heads(self, t):
        b, s, _ = t.shape
        if BUG == "head_split_transposed":
            return t.view(b, s, self.head_dim, self.n_heads).permute(0, 3, 1, 2)
        return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

    def _merge(self, t):
        b, _, s, _ = t.shape
        if BUG == "head_split_transposed":
            return t.permute(0, 2, 3, 1).reshape(b, s, -1)
        return t.transpose(1, 2).reshape(b, s, -1)

    def attention(self, h, allowed):
        d_model = h.shape[-1]
        if BUG == "split_qkv":
            q = h @ self.w_qkv[:, :d_model] + self.b_qkv[:d_model]
            k = h @ self.w_qkv[:, d_model : 2 * d_model] + self.b_qkv[d_model : 2 * d_model]
            v = h @ self.w_qkv[:, 2 * d_model :] + self.b_qkv[2 * d_model :]
        else:
            q, k, v = (h @ self.w_qkv + self.b_qkv).split(d_model, dim=-1)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if BUG == "attn_scale_hidden":
            scale = 1.0 / math.sqrt(d_model)
        else:
            scale = 1.0 / math.sqrt(self.head_dim)
        if BUG == "sdpa_attention":
            # a fully masked row (a padding query) would give NaN here: let it see every key (never compared)
            allowed = allowed | ~allowed.any(-1, keepdim=True)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        else:
            scores = (q @ k.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            out = torch.softmax(scores, dim=-1) @ v
        return self._merge(out) @ self.w_o + self.b_o

    def forward(self, x, allowed):
        x = x + self.attention(layer_norm(x, self.norm1), allowed)
        if BUG == "post_norm_ffn":
            return layer_norm(x + self.ffn(x), self.norm2)
        return x + self.ffn(layer_norm(x, self.norm2))

    def ffn(self, h):
        u = h @ self.w_up + self.b_up
        u = F.gelu(u, approximate="tanh") if BUG == "gelu_tanh" else F.gelu(u)
        return u @ self.w_down + self.b_down


class BioGptPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.d_model = d
        self.n_heads = config.num_attention_heads
        self.scale_embedding = bool(getattr(config, "scale_embedding", True))
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.tok_table = nn.Parameter(torch.zeros(config.vocab_size, d))
        self.pos_table = nn.Parameter(torch.zeros(config.max_position_embeddings + POS_OFFSET, d))
        self.blocks = nn.ModuleList(
            Block(d, config.num_attention_heads, config.intermediate_size) for _ in range(config.num_hidden_layers)
        )
        self.norm_out = nn.Parameter(torch.zeros(2, d))
        if not self.tied:
            self.head = nn.Parameter(torch.zeros(config.vocab_size, d))

    def embed_scale(self):
        if not self.scale_embedding:
            return 1.0
        if BUG == "embed_scale_head_dim":
            return math.sqrt(self.d_model // self.n_heads)
        return math.sqrt(self.d_model)

    def build_mask(self, attention_mask, b, t, device):
        """Boolean (B, 1, T, T): True where query i may attend to key j."""
        i = torch.arange(t, device=device)
        if BUG == "causal_off_by_one":
            causal = torch.ones(t, t, dtype=torch.bool, device=device).tril(diagonal=1)
        else:
            causal = i[None, :] <= i[:, None]
        allowed = causal[None, None].expand(b, 1, t, t)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if BUG == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return allowed

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        device = input_ids.device
        scale = self.embed_scale()
        if BUG == "prescaled_embedding":
            tok = (self.tok_table * scale)[input_ids]
        else:
            tok = self.tok_table[input_ids]
            if BUG != "scale_after_pos":
                tok = tok * scale

        if position_ids is None or BUG == "ignore_position_ids":
            position_ids = torch.arange(t, device=device)[None].expand(b, t)
        if BUG == "pos_table_shifted":
            pos = self.pos_table[POS_OFFSET:][position_ids]
        elif BUG == "no_pos_offset":
            pos = self.pos_table[position_ids]
        else:
            pos = self.pos_table[position_ids + POS_OFFSET]
        x = tok + pos
        if BUG == "scale_after_pos":
            x = x * scale

        allowed = self.build_mask(attention_mask, b, t, device)
        for block in self.blocks:
            x = block(x, allowed)
        y = layer_norm(x, self.norm_out)

        if self.tied:
            w = self.tok_table * scale if BUG == "tied_head_scaled" else self.tok_table
        else:
            w = self.head
        return y @ w.t()


def build(state_dict, config):
    sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
    model = BioGptPort(config)
    n_layers = config.num_hidden_layers

    def g(name):
        return sd[name].detach().float()

    def norm(prefix):
        return torch.stack([g(prefix + ".weight"), g(prefix + ".bias")])

    with torch.no_grad():
        model.tok_table.copy_(g("biogpt.embed_tokens.weight"))
        model.pos_table.copy_(g("biogpt.embed_positions.weight"))
        for i, blk in enumerate(model.blocks):
            p = f"biogpt.layers.{i}."
            blk.norm1.copy_(norm(p + "self_attn_layer_norm"))
            blk.w_qkv.copy_(torch.cat([g(p + f"self_attn.{n}_proj.weight").t() for n in ("q", "k", "v")], dim=1))
            blk.b_qkv.copy_(torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]))
            w_o = g(p + "self_attn.out_proj.weight")
            blk.w_o.copy_(w_o if BUG == "out_proj_not_transposed" else w_o.t())
            blk.b_o.copy_(g(p + "self_attn.out_proj.bias"))
            blk.norm2.copy_(norm(p + "final_layer_norm"))
            blk.w_up.copy_(g(p + "fc1.weight").t())
            blk.b_up.copy_(g(p + "fc1.bias"))
            blk.w_down.copy_(g(p + "fc2.weight").t())
            blk.b_down.copy_(g(p + "fc2.bias"))
        if BUG == "final_norm_from_layer":
            model.norm_out.copy_(norm(f"biogpt.layers.{n_layers - 1}.final_layer_norm"))
        else:
            model.norm_out.copy_(norm("biogpt.layer_norm"))
        if not model.tied:
            model.head.copy_(g("output_projection.weight"))
    return model.float().eval()
