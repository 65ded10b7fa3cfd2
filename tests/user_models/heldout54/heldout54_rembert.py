"""A hand-written PyTorch port of RemBERT as a causal LM (Transformers' ``RemBertForCausalLM``, ``is_decoder=True``).

Architecture (sizes from the config: V = vocab_size, P = max_position_embeddings, T = type_vocab_size,
E = input_embedding_size, H = hidden_size, nh = num_attention_heads, d = H / nh, I = intermediate_size,
Eo = output_embedding_size, L = num_hidden_layers, eps = layer_norm_eps):

  decoupled input embeddings (width E, not H):
      e   = tok[ids] + typ[0] + pos[positions]                                  (B, S, E)
      e   = LayerNorm_E(e)                                                        (eps)
      x   = e @ W_in + b_in                                                       (B, S, H)   E -> H projection
  positions: ``position_ids`` when given, else 0..S-1 (no padding offset, no cumsum).

  L post-LN (BERT-style) blocks:
      [q | k | v] = x @ W_qkv + b_qkv, each split into nh heads of width d         (B, nh, S, d)
      s   = q k^T / sqrt(d) + mask,  mask = min_float where key j > query i (causal) or key j is padding
      a   = softmax_j(s) v, heads merged back to (B, S, H)
      x   = LayerNorm_H(x + a @ W_o + b_o)
      f   = gelu_erf(x @ W_up + b_up) @ W_down + b_down                             (exact erf GELU, hidden_act "gelu")
      x   = LayerNorm_H(x + f)

  untied, decoupled LM head (width Eo):
      y      = LayerNorm_Eo(gelu_erf(x @ W_head + b_head))
      logits = y @ W_out + b_out                                                  (B, S, V)

Weight layout (my own; every matrix stored transposed, in -> out; per-layer tensors stacked on a leading L axis;
every LayerNorm stored as one (2, n) tensor: row 0 the gain, row 1 the shift):
  tok (V, E), pos (P, E), typ (T, E), emb_ln (2, E), w_in (E, H), b_in (H,)
  qkv_w (L, H, 3H) with columns [q | k | v] (each head-major), qkv_b (L, 3H)
  o_w (L, H, H), o_b (L, H), ln_attn (L, 2, H)
  up_w (L, H, I), up_b (L, I), down_w (L, I, H), down_b (L, H), ln_ffn (L, 2, H)
  head_w (H, Eo), head_b (Eo,), head_ln (2, Eo), out_w (Eo, V), out_b (V,)
``build`` converts the Transformers checkpoint's state dict (its names) into this layout.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "embed_scale_sqrt_dim",  # mBART/T5 habit: token embeddings multiplied by sqrt(input_embedding_size); RemBERT does not scale them
    "roberta_position_offset",  # XLM-R/RoBERTa habit: positions offset by pad_token_id + 1; RemBERT's positions start at 0
    "ignore_position_ids",  # forward drops the given position_ids and always uses 0..S-1 (left padding shifts positions)
    "pad_mask_on_queries",  # padding mask broadcast as (B,1,S,1): masks padded queries instead of padded keys
    "type_emb_skipped",  # token-type embedding row 0 not added (type_vocab_size == 1 assumed to be a no-op)
    "qkv_interleaved_split",  # fused QKV output reshaped as (nh, 3, d) per token instead of (3, nh, d)
    "causal_excludes_self",  # causal mask off by one: triu(diagonal=0) masks the diagonal, a token cannot see itself
    "ffn_quick_gelu",  # FFN hidden_act "gelu" mapped to quick_gelu x*sigmoid(1.702x) (CLIP's table) instead of exact erf GELU
    "head_ln_before_act",  # LM head applies its LayerNorm before the activation (dense -> LN -> gelu) instead of after
    "ffn_residual_from_layer_input",  # FFN residual adds the block's input instead of the attention sub-block's output
    "o_proj_not_transposed",  # loader forgets to transpose the square attention output matrix (in->out layout)
    "ln_key_collision",  # loader's "output.LayerNorm" test matches first, so the attention LayerNorm is never loaded
    "lm_bias_not_loaded",  # loader reads BERT's "cls.predictions.bias" (absent) and leaves the decoder bias at zero
    "residual_bf16",  # hidden states stored in bfloat16 between layers (half-precision residual stream cast in the wrong place)
]

PADDING_ONLY = ["ignore_position_ids", "pad_mask_on_queries"]

CLEAN = [
    "split_qkv",  # three separate q/k/v matmuls on slices of the fused weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with the same additive float mask instead of the explicit softmax
    "prescale_q",  # q multiplied by 1/sqrt(d) before q k^T instead of scaling the scores afterwards
    "fold_type_pos_table",  # precomputed table pos + typ[0] looked up once instead of adding the two rows
    "fold_head_ln_affine",  # head LayerNorm's gain/shift folded into the decoder (diag(g) W_out, beta W_out + b_out)
]


def _ln(x, wb, eps):
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], eps)


class RemBertPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        V, P, T = config.vocab_size, config.max_position_embeddings, config.type_vocab_size
        E, H, I = config.input_embedding_size, config.hidden_size, config.intermediate_size
        Eo, L = config.output_embedding_size, config.num_hidden_layers
        self.nh = config.num_attention_heads
        self.d = H // self.nh
        self.eps = config.layer_norm_eps
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.emb_size = E
        self.n_layers = L

        def z(*shape):
            return nn.Parameter(torch.zeros(*shape))

        def ln(*lead, n):
            t = torch.zeros(*lead, 2, n)
            t[..., 0, :] = 1.0
            return nn.Parameter(t)

        self.tok, self.pos, self.typ = z(V, E), z(P, E), z(T, E)
        self.emb_ln = ln(n=E)
        self.w_in, self.b_in = z(E, H), z(H)
        self.qkv_w, self.qkv_b = z(L, H, 3 * H), z(L, 3 * H)
        self.o_w, self.o_b = z(L, H, H), z(L, H)
        self.ln_attn = ln(L, n=H)
        self.up_w, self.up_b = z(L, H, I), z(L, I)
        self.down_w, self.down_b = z(L, I, H), z(L, H)
        self.ln_ffn = ln(L, n=H)
        self.head_w, self.head_b = z(H, Eo), z(Eo)
        self.head_ln = ln(n=Eo)
        self.out_w, self.out_b = z(Eo, V), z(V)

    # ---- pieces -------------------------------------------------------------------------------------------
    def embed(self, input_ids, position_ids):
        B, S = input_ids.shape
        if position_ids is None or BUG == "ignore_position_ids":
            position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
        if BUG == "roberta_position_offset":
            position_ids = position_ids + self.pad_token_id + 1
        e = self.tok[input_ids]
        if BUG == "embed_scale_sqrt_dim":
            e = e * math.sqrt(self.emb_size)
        if BUG == "fold_type_pos_table":
            table = self.pos + self.typ[0]
            e = e + table[position_ids]
        else:
            if BUG != "type_emb_skipped":
                e = e + self.typ[0]
            e = e + self.pos[position_ids]
        e = _ln(e, self.emb_ln, self.eps)
        return e @ self.w_in + self.b_in

    def mask_bias(self, attention_mask, B, S, device, dtype):
        neg = torch.finfo(dtype).min
        i = torch.arange(S, device=device)
        if BUG == "causal_excludes_self":
            allowed = i[None, :] < i[:, None]
        else:
            allowed = i[None, :] <= i[:, None]  # key j <= query i
        allowed = allowed[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if BUG == "pad_mask_on_queries":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        return torch.where(
            allowed, torch.zeros((), dtype=dtype, device=device), torch.full((), neg, dtype=dtype, device=device)
        )

    def attention(self, x, l, bias):
        B, S, H = x.shape
        nh, d = self.nh, self.d
        if BUG == "split_qkv":
            w, b = self.qkv_w[l], self.qkv_b[l]
            q = x @ w[:, :H] + b[:H]
            k = x @ w[:, H : 2 * H] + b[H : 2 * H]
            v = x @ w[:, 2 * H :] + b[2 * H :]
            q, k, v = (t.view(B, S, nh, d).transpose(1, 2) for t in (q, k, v))
        else:
            qkv = x @ self.qkv_w[l] + self.qkv_b[l]
            if BUG == "qkv_interleaved_split":
                qkv = qkv.view(B, S, nh, 3, d).permute(3, 0, 2, 1, 4)
            else:
                qkv = qkv.view(B, S, 3, nh, d).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        scale = 1.0 / math.sqrt(d)
        if BUG == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        else:
            if BUG == "prescale_q":
                s = (q * scale) @ k.transpose(-1, -2)
            else:
                s = (q @ k.transpose(-1, -2)) * scale
            p = torch.softmax(s + bias, dim=-1)
            ctx = p @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, H)
        return ctx @ self.o_w[l] + self.o_b[l]

    def ffn(self, x, l):
        h = x @ self.up_w[l] + self.up_b[l]
        h = h * torch.sigmoid(1.702 * h) if BUG == "ffn_quick_gelu" else F.gelu(h)
        return h @ self.down_w[l] + self.down_b[l]

    def head(self, x):
        y = x @ self.head_w + self.head_b
        if BUG == "head_ln_before_act":
            y = F.gelu(_ln(y, self.head_ln, self.eps))
        elif BUG == "fold_head_ln_affine":
            y = F.layer_norm(F.gelu(y), (y.shape[-1],), None, None, self.eps)
            w = self.head_ln[0][:, None] * self.out_w
            b = self.head_ln[1] @ self.out_w + self.out_b
            return y @ w + b
        else:
            y = _ln(F.gelu(y), self.head_ln, self.eps)
        return y @ self.out_w + self.out_b

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        x = self.embed(input_ids, position_ids)
        bias = self.mask_bias(attention_mask, B, S, x.device, x.dtype)
        for l in range(self.n_layers):
            a = self.ln_attn[l]
            h_in = x
            x = _ln(x + self.attention(x, l, bias), a, self.eps)
            res = h_in if BUG == "ffn_residual_from_layer_input" else x
            x = _ln(res + self.ffn(x, l), self.ln_ffn[l], self.eps)
            if BUG == "residual_bf16":
                x = x.to(torch.bfloat16).to(torch.float32)
        return self.head(x)


@torch.no_grad()
def build(state_dict, config):
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    m = RemBertPort(config)
    H = config.hidden_size
    pre = "rembert.embeddings."
    m.tok.copy_(sd[pre + "word_embeddings.weight"])
    m.pos.copy_(sd[pre + "position_embeddings.weight"])
    m.typ.copy_(sd[pre + "token_type_embeddings.weight"])
    m.emb_ln[0].copy_(sd[pre + "LayerNorm.weight"])
    m.emb_ln[1].copy_(sd[pre + "LayerNorm.bias"])
    m.w_in.copy_(sd["rembert.encoder.embedding_hidden_mapping_in.weight"].t())
    m.b_in.copy_(sd["rembert.encoder.embedding_hidden_mapping_in.bias"])

    for key, t in sd.items():
        if not key.startswith("rembert.encoder.layer."):
            continue
        rest = key[len("rembert.encoder.layer.") :]
        idx, name = rest.split(".", 1)
        l = int(idx)
        col = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
        mod, kind = name.rsplit(".", 1)
        if mod in col:
            c = col[mod]
            if kind == "weight":
                m.qkv_w[l, :, c * H : (c + 1) * H].copy_(t.t())
            else:
                m.qkv_b[l, c * H : (c + 1) * H].copy_(t)
        elif mod == "attention.output.dense":
            if kind == "weight":
                m.o_w[l].copy_(t if BUG == "o_proj_not_transposed" else t.t())
            else:
                m.o_b[l].copy_(t)
        elif BUG == "ln_key_collision" and "output.LayerNorm" in mod:
            m.ln_ffn[l, 0 if kind == "weight" else 1].copy_(t)
        elif mod == "attention.output.LayerNorm":
            m.ln_attn[l, 0 if kind == "weight" else 1].copy_(t)
        elif mod == "intermediate.dense":
            (m.up_w[l] if kind == "weight" else m.up_b[l]).copy_(t.t() if kind == "weight" else t)
        elif mod == "output.dense":
            (m.down_w[l] if kind == "weight" else m.down_b[l]).copy_(t.t() if kind == "weight" else t)
        elif mod == "output.LayerNorm":
            m.ln_ffn[l, 0 if kind == "weight" else 1].copy_(t)
        else:
            raise KeyError(key)

    p = "cls.predictions."
    m.head_w.copy_(sd[p + "dense.weight"].t())
    m.head_b.copy_(sd[p + "dense.bias"])
    m.head_ln[0].copy_(sd[p + "LayerNorm.weight"])
    m.head_ln[1].copy_(sd[p + "LayerNorm.bias"])
    m.out_w.copy_(sd[p + "decoder.weight"].t())
    if BUG == "lm_bias_not_loaded":
        m.out_b.copy_(sd.get(p + "bias", torch.zeros(config.vocab_size)))
    else:
        m.out_b.copy_(sd[p + "decoder.bias"])
    return m.float().eval()
