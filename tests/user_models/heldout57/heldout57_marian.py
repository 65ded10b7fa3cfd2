"""A from-scratch PyTorch port of Marian's decoder-only causal LM (Transformers' ``MarianForCausalLM``).

Architecture (as implemented here; B batch, S sequence, D = d_model, H = decoder_attention_heads,
hd = D / H, F = decoder_ffn_dim, V = decoder/vocab size, P = max_position_embeddings, L = decoder_layers):

    positions   p_s = s                       (s = 0..S-1; Marian counts from the past length, it never
                                               derives positions from the padding mask or from position_ids)
    embeddings  h0  = E[ids] * sqrt(D)  +  T[p]     (sqrt(D) only when config.scale_embedding; T is the
                                               (P, D) sinusoidal table -- [sin | cos] halves, not interleaved --
                                               but it is a checkpoint tensor, so it is LOADED, never recomputed)
                no embedding LayerNorm, no position offset (unlike BART's learned table with its +2)
    each layer (post-norm, the cross-attention block is never run in the causal LM):
        q, k, v = x Wqkv + bqkv                    (B, S, 3D) -> 3 x (B, H, S, hd)
        q       = q * hd^-0.5                      (scaling applied after the bias)
        A       = softmax(q k^T + M) v             M: 0 where key j <= query i and key j is not padding,
                                                   else finfo(float32).min (causal AND padding mask)
        x       = LN_attn(x + A Wo + bo)
        x       = LN_ffn(x + swish(x W1 + b1) W2 + b2)      (activation from config.activation_function)
        LN(y)   = (y - mean) / sqrt(biased var + 1e-5) * g + b
    logits      = h_L E^T                      (LM head tied to the token embeddings; no final_logits_bias,
                                               no rescaling of h_L)

Weight layout (my own; ``build`` converts Transformers' state dict):
    tok_emb   (V, D)            token embeddings, also the LM head (used as h @ tok_emb.T)
    pos_table (P, D)            buffer: ``model.decoder.embed_positions.weight`` as stored
    w_qkv     (L, D, 3D)        stacked over layers, in -> out, columns [q | k | v]
    b_qkv     (L, 3D)
    w_o       (L, D, D)         in -> out
    b_o       (L, D)
    ln_attn   (L, 2, D)         [gain; bias] of self_attn_layer_norm
    w_up      (L, D, F)         fc1, in -> out
    b_up      (L, F)
    w_down    (L, F, D)         fc2, in -> out
    b_down    (L, D)
    ln_ffn    (L, 2, D)         [gain; bias] of final_layer_norm
The checkpoint's ``encoder_attn.*`` and ``encoder_attn_layer_norm.*`` tensors are unused (no encoder).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "recomputed_sin_table",  # rebuilds the sinusoidal table from the formula instead of loading the checkpoint's embed_positions.weight
    "bart_pos_offset",  # copies BART's learned-position offset: looks up the table at position + 2
    "embed_scale_after_pos",  # multiplies (tok + pos) by sqrt(d_model) instead of scaling the token embeddings alone
    "q_scale_before_bias",  # folds hd^-0.5 into the q weight only: q = (x Wq) * s + bq instead of (x Wq + bq) * s
    "scale_by_d_model",  # attention scaling d_model^-0.5 instead of head_dim^-0.5
    "gelu_activation",  # hard-codes BART's / MarianConfig's default gelu instead of config.activation_function (swish)
    "encoder_attn_ln_for_ffn",  # loader maps the layer's 2nd LayerNorm (encoder_attn_layer_norm) as the FFN norm instead of final_layer_norm
    "t5_tied_rescale",  # rescales the last hidden state by d_model^-0.5 before the tied LM head (T5's tie_word_embeddings rule)
    "pre_norm",  # runs the layer norms pre-sublayer (x + f(LN(x))) although Marian's decoder is post-norm
    "causal_off_by_one",  # causal mask built with triu(diagonal=0): a token cannot attend to itself
    "layernorm_unbiased_var",  # hand-written LayerNorm uses torch.var's unbiased (N-1) variance
    "heads_split_no_transpose",  # splits heads with view(B, H, S, hd) straight from (B, S, D), no transpose
    "padding_mask_ignored",  # only the causal mask is applied; the attention_mask's left padding is not joined into it
    "position_ids_honoured",  # uses position_ids / mask-cumsum positions, while Marian always uses arange(past, past + S)
]

PADDING_ONLY = [
    "padding_mask_ignored",
    "position_ids_honoured",
]

CLEAN = [
    "split_qkv",  # three separate q / k / v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with the same additive mask and scale instead of explicit softmax
    "scale_scores",  # scales the q k^T scores by hd^-0.5 instead of scaling q beforehand
    "manual_layernorm",  # LayerNorm written out by hand with the biased variance instead of F.layer_norm
    "per_head_loop",  # attention computed one head at a time in a Python loop, outputs concatenated
]


def _bug() -> str:
    return BUG


def _sinusoidal_table(n_pos: int, dim: int) -> torch.Tensor:
    """Marian's table: sin of every frequency in the first half, cos in the second (float64 then float32)."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    j = torch.arange(dim, dtype=torch.float64)
    angle = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out = torch.empty(n_pos, dim, dtype=torch.float64)
    out[:, :sentinel] = torch.sin(angle[:, 0::2])
    out[:, sentinel:] = torch.cos(angle[:, 1::2])
    return out.float()


def _layer_norm(x: torch.Tensor, gb: torch.Tensor, eps: float) -> torch.Tensor:
    bug = _bug()
    if bug == "layernorm_unbiased_var":
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True)  # unbiased by default
        return (x - mean) / torch.sqrt(var + eps) * gb[0] + gb[1]
    if bug == "manual_layernorm":
        mean = x.mean(-1, keepdim=True)
        xc = x - mean
        var = (xc * xc).mean(-1, keepdim=True)
        return xc * torch.rsqrt(var + eps) * gb[0] + gb[1]
    return F.layer_norm(x, (x.shape[-1],), gb[0], gb[1], eps)


def _activation(name: str):
    if _bug() == "gelu_activation":
        return F.gelu
    name = (name or "").lower()
    if name in ("swish", "silu"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "tanh":
        return torch.tanh
    raise ValueError(f"unsupported activation {name}")


class MarianCausalPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d = config.d_model
        self.h = config.decoder_attention_heads
        self.hd = self.d // self.h
        self.f = config.decoder_ffn_dim
        self.n_layers = config.decoder_layers
        self.vocab = getattr(config, "decoder_vocab_size", None) or config.vocab_size
        self.n_pos = config.max_position_embeddings
        self.scale_embedding = bool(config.scale_embedding)
        self.act_name = config.activation_function
        self.eps = 1e-5
        L, D, Fd = self.n_layers, self.d, self.f
        self.tok_emb = nn.Parameter(torch.zeros(self.vocab, D))
        self.register_buffer("pos_table", torch.zeros(self.n_pos, D))
        self.w_qkv = nn.Parameter(torch.zeros(L, D, 3 * D))
        self.b_qkv = nn.Parameter(torch.zeros(L, 3 * D))
        self.w_o = nn.Parameter(torch.zeros(L, D, D))
        self.b_o = nn.Parameter(torch.zeros(L, D))
        self.ln_attn = nn.Parameter(torch.zeros(L, 2, D))
        self.w_up = nn.Parameter(torch.zeros(L, D, Fd))
        self.b_up = nn.Parameter(torch.zeros(L, Fd))
        self.w_down = nn.Parameter(torch.zeros(L, Fd, D))
        self.b_down = nn.Parameter(torch.zeros(L, D))
        self.ln_ffn = nn.Parameter(torch.zeros(L, 2, D))

    # ----------------------------------------------------------------- masks and positions
    def _mask(self, attention_mask, B, S, device):
        """Additive (B, 1, S, S) mask: causal AND (key is not padding)."""
        bug = _bug()
        i = torch.arange(S, device=device)
        if bug == "causal_off_by_one":
            allowed = ~torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), diagonal=0)
        else:
            allowed = i[None, :] <= i[:, None]  # key j <= query i
        allowed = allowed[None, None].expand(B, 1, S, S)
        if attention_mask is not None and bug != "padding_mask_ignored":
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        neg = torch.finfo(torch.float32).min
        return torch.zeros(B, 1, S, S, device=device).masked_fill(~allowed, neg)

    def _positions(self, B, S, attention_mask, position_ids, device):
        bug = _bug()
        if bug == "position_ids_honoured":
            if position_ids is not None:
                return position_ids
            if attention_mask is not None:
                m = attention_mask.long()
                return (m.cumsum(-1) - 1).clamp(min=0)
        pos = torch.arange(S, device=device)[None].expand(B, S)  # past length is 0 (no cache)
        if bug == "bart_pos_offset":
            pos = pos + 2
        return pos

    # ----------------------------------------------------------------- attention
    def _attention(self, x, l, mask):
        bug = _bug()
        B, S, D = x.shape
        H, hd = self.h, self.hd
        scale = (D if bug == "scale_by_d_model" else hd) ** -0.5
        w, b = self.w_qkv[l], self.b_qkv[l]
        if bug == "split_qkv":
            q = x @ w[:, :D] + b[:D]
            k = x @ w[:, D : 2 * D] + b[D : 2 * D]
            v = x @ w[:, 2 * D :] + b[2 * D :]
        elif bug == "q_scale_before_bias":
            q = x @ (w[:, :D] * scale) + b[:D]
            k = x @ w[:, D : 2 * D] + b[D : 2 * D]
            v = x @ w[:, 2 * D :] + b[2 * D :]
        else:
            q, k, v = (x @ w + b).split(D, dim=-1)

        def heads(t):
            if bug == "heads_split_no_transpose":
                return t.reshape(B, H, S, hd)
            return t.view(B, S, H, hd).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        pre_scaled = bug not in ("scale_scores", "sdpa", "q_scale_before_bias")
        if pre_scaled:
            q = q * scale

        if bug == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        elif bug == "per_head_loop":
            outs = []
            for hh in range(H):
                s = q[:, hh] @ k[:, hh].transpose(-1, -2) + mask[:, 0]
                outs.append(torch.softmax(s, dim=-1) @ v[:, hh])
            out = torch.stack(outs, dim=1)
        else:
            scores = q @ k.transpose(-1, -2)
            if bug == "scale_scores":
                scores = scores * scale
            scores = scores + mask
            out = torch.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).reshape(B, S, D)
        return out @ self.w_o[l] + self.b_o[l]

    def _ffn(self, x, l):
        act = _activation(self.act_name)
        return act(x @ self.w_up[l] + self.b_up[l]) @ self.w_down[l] + self.b_down[l]

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        device = input_ids.device
        emb_scale = math.sqrt(self.d) if self.scale_embedding else 1.0

        pos = self._positions(B, S, attention_mask, position_ids, device)
        tok = self.tok_emb[input_ids]
        if bug == "embed_scale_after_pos":
            x = (tok + self.pos_table[pos]) * emb_scale
        else:
            x = tok * emb_scale + self.pos_table[pos]

        mask = self._mask(attention_mask, B, S, device)
        for l in range(self.n_layers):
            if bug == "pre_norm":
                x = x + self._attention(_layer_norm(x, self.ln_attn[l], self.eps), l, mask)
                x = x + self._ffn(_layer_norm(x, self.ln_ffn[l], self.eps), l)
            else:
                x = _layer_norm(x + self._attention(x, l, mask), self.ln_attn[l], self.eps)
                x = _layer_norm(x + self._ffn(x, l), self.ln_ffn[l], self.eps)

        if bug == "t5_tied_rescale":
            x = x * self.d**-0.5
        return x @ self.tok_emb.t()


def build(state_dict, config) -> nn.Module:
    bug = _bug()
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    p = "model.decoder."
    model = MarianCausalPort(config)
    L = model.n_layers

    def lin(name):  # (out, in) -> (in, out)
        return sd[name + ".weight"].t()

    w_qkv, b_qkv, w_o, b_o, ln_a, w_up, b_up, w_dn, b_dn, ln_f = ([] for _ in range(10))
    for l in range(L):
        a = f"{p}layers.{l}.self_attn."
        w_qkv.append(torch.cat([lin(a + "q_proj"), lin(a + "k_proj"), lin(a + "v_proj")], dim=1))
        b_qkv.append(torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]))
        w_o.append(lin(a + "out_proj"))
        b_o.append(sd[a + "out_proj.bias"])
        n1 = f"{p}layers.{l}.self_attn_layer_norm"
        n2 = f"{p}layers.{l}.final_layer_norm"
        if bug == "encoder_attn_ln_for_ffn":
            n2 = f"{p}layers.{l}.encoder_attn_layer_norm"
        ln_a.append(torch.stack([sd[n1 + ".weight"], sd[n1 + ".bias"]]))
        ln_f.append(torch.stack([sd[n2 + ".weight"], sd[n2 + ".bias"]]))
        w_up.append(lin(f"{p}layers.{l}.fc1"))
        b_up.append(sd[f"{p}layers.{l}.fc1.bias"])
        w_dn.append(lin(f"{p}layers.{l}.fc2"))
        b_dn.append(sd[f"{p}layers.{l}.fc2.bias"])

    with torch.no_grad():
        model.tok_emb.copy_(sd[p + "embed_tokens.weight"])
        table_key = p + "embed_positions.weight"
        if bug == "recomputed_sin_table" or table_key not in sd:
            model.pos_table.copy_(_sinusoidal_table(model.n_pos, model.d))
        else:
            model.pos_table.copy_(sd[table_key])
        model.w_qkv.copy_(torch.stack(w_qkv))
        model.b_qkv.copy_(torch.stack(b_qkv))
        model.w_o.copy_(torch.stack(w_o))
        model.b_o.copy_(torch.stack(b_o))
        model.ln_attn.copy_(torch.stack(ln_a))
        model.w_up.copy_(torch.stack(w_up))
        model.b_up.copy_(torch.stack(b_up))
        model.w_down.copy_(torch.stack(w_dn))
        model.b_down.copy_(torch.stack(b_dn))
        model.ln_ffn.copy_(torch.stack(ln_f))
    return model.float().eval()
