"""A hand-written PyTorch port of Megatron-BERT as a causal LM (``MegatronBertForCausalLM``, ``is_decoder=True``).

Architecture (H = hidden_size, nh = num_attention_heads, d = H / nh, I = intermediate_size, V = vocab_size,
L = num_hidden_layers, B = batch, T = seq):

  embeddings (no embedding LayerNorm: Megatron moved it into the layers)
      x = E_tok[ids] + E_type[0] + E_pos[pos]                     (B, T, H)
      pos = position_ids if given, else 0..T-1                   (absolute, learned)
  L pre-norm blocks, for l = 1..L
      a = LN_attn(x)                                             (eps = config.layer_norm_eps)
      q, k, v = split(a @ Wqkv + bqkv)                           Wqkv: (H, 3H), columns [q | k | v], each (nh, d)
      s = q k^T / sqrt(d) + causal/padding mask                  (B, nh, T, T)
      x = x + (softmax(s) v merged to (B, T, H)) @ Wo + bo       residual from the UN-normalised x
      m = LN_mlp(x)
      x = x + gelu_erf(m @ Wup + bup) @ Wdown + bdown
  final encoder LayerNorm:  h = LN_f(x)
  lm head (cls.predictions):
      t = LN_head(gelu_erf(h @ Wt + bt))
      logits = t @ E_tok^T + b_out                               tied to the word embeddings, own bias (V,)

Mask: key j is visible to query i iff j <= i and attention_mask[b, j] == 1; masked scores are filled with the
dtype's most negative finite value (a fully masked padding row stays finite: uniform, never NaN).

Weight layout (mine, converted from the Transformers state dict in ``build``):
  tok_emb (V, H), pos_emb (P, H), type_row (H,)          -- only token type 0 is ever used
  stacked per-layer tensors, leading dim L, matrices stored transposed (in -> out):
      ln_attn_w/b (L, H), qkv_w (L, H, 3H), qkv_b (L, 3H), o_w (L, H, H), o_b (L, H),
      ln_mlp_w/b (L, H), up_w (L, H, I), up_b (L, I), down_w (L, I, H), down_b (L, H)
  lnf_w/b (H,); head_w (H, H) in -> out, head_b (H,), head_ln_w/b (H,); out_bias (V,)
  (the output projection reuses tok_emb; ``cls.predictions.decoder.bias`` is the same tensor as
  ``cls.predictions.bias`` in the checkpoint and is loaded once).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "post_ln",  # BERT-style post-LN: x = LN(x + sublayer(x)) in both blocks instead of Megatron's pre-norm
    "ln_swapped",  # loader maps attention.ln to the pre-MLP norm and layer.ln to the pre-attention norm (BERT naming)
    "mlp_residual_normed",  # MLP block's residual taken from LN_mlp(x) instead of the un-normalised x
    "ln_unbiased_var",  # hand-written LayerNorm uses the unbiased (N-1) variance (torch.var default)
    "no_token_type",  # type_vocab_size == 1 read as "no segments": token_type_embeddings[0] never added
    "head_ln_before_act",  # lm-head transform applies LayerNorm before the GELU instead of after
    "bias_twice",  # loader adds cls.predictions.bias and the (tied, identical) decoder.bias: output bias doubled
    "qk_layer_scaling",  # Megatron-LM query_key_layer_scaling half-ported: scores * layer_number (softmax coeff) kept, / layer_number dropped
    "qkv_interleaved",  # fused QKV split as Megatron-LM's per-head [nh, 3, d] layout, weights fused as [3, nh, d]
    "o_not_transposed",  # loader forgets to transpose the square attention output matrix into in -> out layout
    "heads_view_no_transpose",  # (B, T, H) viewed straight as (B, nh, T, d) instead of view(B, T, nh, d).transpose
    "bidirectional",  # config.is_decoder ignored: BERT encoder's bidirectional mask, no causal mask
    "roberta_positions",  # default positions start at pad_token_id + 1 (RoBERTa convention) instead of 0
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
]

PADDING_ONLY = [
    "pad_mask_query_axis",
]

CLEAN = [
    "additive_mask_1e4",  # BERT's old additive extended mask (0 / -10000) instead of masked_fill with finfo.min
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask (diagonal kept so padding rows stay finite)
    "folded_scale",  # 1/sqrt(d) folded into the query columns of qkv_w / qkv_b at build time
    "fold_final_ln_affine",  # final LN's weight/bias folded into the head dense (W diag(g), W b + b_t)
    "manual_layernorm",  # hand-written LayerNorm (biased variance, rsqrt) instead of F.layer_norm
]


def _bug():
    return globals().get("BUG", "") or ""


def _layer_norm(x, w, b, eps):
    bug = _bug()
    if bug in ("ln_unbiased_var", "manual_layernorm"):
        mu = x.mean(-1, keepdim=True)
        if bug == "ln_unbiased_var":
            var = x.var(-1, keepdim=True)  # unbiased by default
        else:
            var = (x - mu).pow(2).mean(-1, keepdim=True)
        y = (x - mu) * torch.rsqrt(var + eps)
        return y * w + b if w is not None else y
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _gelu(x):
    return F.gelu(x)  # hidden_act "gelu": the exact erf GELU


class MegatronBertPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        L = config.num_hidden_layers
        I = config.intermediate_size
        V = config.vocab_size
        P = config.max_position_embeddings
        self.H, self.L, self.I, self.V = H, L, I, V
        self.nh = config.num_attention_heads
        self.d = H // self.nh
        self.eps = config.layer_norm_eps
        self.is_decoder = bool(getattr(config, "is_decoder", False))
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.scale_folded = False
        self.final_ln_folded = False

        def p(*shape):
            return nn.Parameter(torch.zeros(*shape))

        self.tok_emb = p(V, H)
        self.pos_emb = p(P, H)
        self.type_row = p(H)
        self.ln_attn_w, self.ln_attn_b = p(L, H), p(L, H)
        self.qkv_w, self.qkv_b = p(L, H, 3 * H), p(L, 3 * H)
        self.o_w, self.o_b = p(L, H, H), p(L, H)
        self.ln_mlp_w, self.ln_mlp_b = p(L, H), p(L, H)
        self.up_w, self.up_b = p(L, H, I), p(L, I)
        self.down_w, self.down_b = p(L, I, H), p(L, H)
        self.lnf_w, self.lnf_b = p(H), p(H)
        self.head_w, self.head_b = p(H, H), p(H)
        self.head_ln_w, self.head_ln_b = p(H), p(H)
        self.out_bias = p(V)

    # ---------------------------------------------------------------- attention
    def _split_heads(self, t):
        B, T, _ = t.shape
        if _bug() == "heads_view_no_transpose":
            return t.reshape(B, self.nh, T, self.d)
        return t.view(B, T, self.nh, self.d).transpose(1, 2)

    def _attention(self, a, l, allowed):
        bug = _bug()
        B, T, H = a.shape
        qkv = a @ self.qkv_w[l] + self.qkv_b[l]  # (B, T, 3H)
        if bug == "qkv_interleaved":
            qkv = qkv.view(B, T, self.nh, 3, self.d)
            q, k, v = (qkv[:, :, :, i].reshape(B, T, H) for i in range(3))
        else:
            q, k, v = qkv.split(H, dim=-1)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)

        if bug == "sdpa":
            keep = allowed | torch.eye(T, dtype=torch.bool, device=a.device)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0 if self.scale_folded else None)
        else:
            s = q @ k.transpose(-1, -2)
            if not self.scale_folded:
                s = s / math.sqrt(self.d)
            if bug == "qk_layer_scaling":
                # Megatron-LM query_key_layer_scaling: norm_factor = sqrt(d) * layer_number and the fused softmax
                # multiplies by coeff = layer_number; the port keeps the softmax coeff but not the division
                s = s * float(l + 1)
            if bug == "additive_mask_1e4":
                s = s + (1.0 - allowed.to(s.dtype)) * -10000.0
            else:
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, dim=-1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, T, H)
        return ctx @ self.o_w[l] + self.o_b[l]

    def _mask(self, B, T, attention_mask, device):
        bug = _bug()
        idx = torch.arange(T, device=device)
        if self.is_decoder and bug != "bidirectional":
            causal = idx[None, :] <= idx[:, None]  # (Tq, Tk)
        else:
            causal = torch.ones(T, T, dtype=torch.bool, device=device)
        allowed = causal[None, None].expand(B, 1, T, T)
        if attention_mask is not None:
            m = attention_mask.to(torch.bool)
            if bug == "pad_mask_query_axis":
                allowed = allowed & m[:, None, :, None]
            else:
                allowed = allowed & m[:, None, None, :]
        return allowed

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            start = self.pad_token_id + 1 if bug == "roberta_positions" else 0
            position_ids = torch.arange(start, start + T, device=device)[None].expand(B, T)
        x = self.tok_emb[input_ids] + self.pos_emb[position_ids]
        if bug != "no_token_type":
            x = x + self.type_row  # token_type_ids are all 0

        allowed = self._mask(B, T, attention_mask, device)
        eps = self.eps
        for l in range(self.L):
            if bug == "post_ln":
                x = _layer_norm(x + self._attention(x, l, allowed), self.ln_attn_w[l], self.ln_attn_b[l], eps)
                h = _gelu(x @ self.up_w[l] + self.up_b[l]) @ self.down_w[l] + self.down_b[l]
                x = _layer_norm(x + h, self.ln_mlp_w[l], self.ln_mlp_b[l], eps)
                continue
            a = _layer_norm(x, self.ln_attn_w[l], self.ln_attn_b[l], eps)
            x = x + self._attention(a, l, allowed)
            m = _layer_norm(x, self.ln_mlp_w[l], self.ln_mlp_b[l], eps)
            h = _gelu(m @ self.up_w[l] + self.up_b[l]) @ self.down_w[l] + self.down_b[l]
            x = (m if bug == "mlp_residual_normed" else x) + h

        if self.final_ln_folded:
            h = _layer_norm(x, None, None, eps)
        else:
            h = _layer_norm(x, self.lnf_w, self.lnf_b, eps)
        t = h @ self.head_w + self.head_b
        if bug == "head_ln_before_act":
            t = _gelu(_layer_norm(t, self.head_ln_w, self.head_ln_b, eps))
        else:
            t = _layer_norm(_gelu(t), self.head_ln_w, self.head_ln_b, eps)
        return t @ self.tok_emb.t() + self.out_bias


@torch.no_grad()
def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    model = MegatronBertPort(config)
    L, H = model.L, model.H

    def g(name):
        return sd[name]

    pre = "bert.embeddings."
    model.tok_emb.copy_(g(pre + "word_embeddings.weight"))
    model.pos_emb.copy_(g(pre + "position_embeddings.weight"))
    model.type_row.copy_(g(pre + "token_type_embeddings.weight")[0])

    for l in range(L):
        lp = f"bert.encoder.layer.{l}."
        attn_ln, mlp_ln = lp + "attention.ln.", lp + "ln."
        if bug == "ln_swapped":
            attn_ln, mlp_ln = mlp_ln, attn_ln
        model.ln_attn_w[l].copy_(g(attn_ln + "weight"))
        model.ln_attn_b[l].copy_(g(attn_ln + "bias"))
        model.ln_mlp_w[l].copy_(g(mlp_ln + "weight"))
        model.ln_mlp_b[l].copy_(g(mlp_ln + "bias"))
        sp = lp + "attention.self."
        wq, wk, wv = (g(sp + n + ".weight") for n in ("query", "key", "value"))
        bq, bk, bv = (g(sp + n + ".bias") for n in ("query", "key", "value"))
        model.qkv_w[l].copy_(torch.cat([wq, wk, wv], dim=0).t())
        model.qkv_b[l].copy_(torch.cat([bq, bk, bv], dim=0))
        wo = g(lp + "attention.output.dense.weight")
        model.o_w[l].copy_(wo if bug == "o_not_transposed" else wo.t())
        model.o_b[l].copy_(g(lp + "attention.output.dense.bias"))
        model.up_w[l].copy_(g(lp + "intermediate.dense.weight").t())
        model.up_b[l].copy_(g(lp + "intermediate.dense.bias"))
        model.down_w[l].copy_(g(lp + "output.dense.weight").t())
        model.down_b[l].copy_(g(lp + "output.dense.bias"))

    model.lnf_w.copy_(g("bert.encoder.ln.weight"))
    model.lnf_b.copy_(g("bert.encoder.ln.bias"))
    hp = "cls.predictions."
    model.head_w.copy_(g(hp + "transform.dense.weight").t())
    model.head_b.copy_(g(hp + "transform.dense.bias"))
    model.head_ln_w.copy_(g(hp + "transform.LayerNorm.weight"))
    model.head_ln_b.copy_(g(hp + "transform.LayerNorm.bias"))
    out_bias = g(hp + "bias").clone()
    if bug == "bias_twice" and hp + "decoder.bias" in sd:
        out_bias = out_bias + g(hp + "decoder.bias")
    model.out_bias.copy_(out_bias)

    if bug == "folded_scale":
        s = 1.0 / math.sqrt(model.d)
        model.qkv_w[:, :, :H].mul_(s)
        model.qkv_b[:, :H].mul_(s)
        model.scale_folded = True
    if bug == "fold_final_ln_affine":
        # (n * g + b) @ Wt + bt == n @ (diag(g) Wt) + (b @ Wt + bt), Wt stored in -> out
        w_t = model.head_w.clone()
        model.head_b.copy_(model.lnf_b @ w_t + model.head_b)
        model.head_w.copy_(model.lnf_w[:, None] * w_t)
        model.final_ln_folded = True

    return model.float().eval()
