"""From-scratch, functional PyTorch port of Nemotron (NemotronForCausalLM weights).

Conventions of this port
------------------------
* Weights live in one flat ``nn.ParameterDict`` with GGUF-like names
  (``token_embd``, ``blk{i}_attn_norm_w`` ...); the forward pass is written as plain
  functions over that dict (``layernorm1p``, ``attention`` with einsum, ``relu2_mlp``).
* LayerNorm1P: a LayerNorm with bias whose effective scale is ``1 + weight``
  (the checkpoint stores the zero-centred gamma).  Used for ``input_layernorm``,
  ``post_attention_layernorm`` and the final ``norm``.
* Attention: GQA (num_key_value_heads < num_attention_heads; query head h uses KV
  head h // group), no biases, scale 1/sqrt(head_dim).  Partial rotary: the first
  ``rotary_dim = head_dim * partial_rotary_factor`` channels of each head are rotated
  with NeoX rotate-half pairing (i, i + rotary_dim/2); the rest pass through.
* MLP: ``down(relu(up(x)) ** 2)`` -- squared ReLU, no gate, no biases.
* Untied ``output`` head without bias.
* Call: ``module(input_ids, attention_mask=None, position_ids=None)`` -> logits
  (batch, seq, vocab); left padding via ``attention_mask`` (0 = pad) and
  caller-supplied ``position_ids``.

``BUG`` selects the variant ("" reference, ``CLEAN`` equivalents, ``BUGS`` one mistake
each).  ``REC`` (dict) receives intermediate tensors under HF module names.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "ln1p_missing_post",  # post_attention_layernorm treated as a plain LayerNorm (weight used without +1)
    "ln1p_missing_final",  # final norm loaded into a plain LayerNorm (weight used without +1)
    "ln1p_twice",  # loader folds +1 into the weights AND the forward adds 1 again (scale 2 + w)
    "norm_bias_dropped",  # LayerNorm1P written without its bias term (RMS/llama-style template)
    "relu2_square_first",  # squared ReLU written as relu(x**2): square applied before the relu
    "relu_only",  # "relu2" mapped to a plain ReLU, the square forgotten
    "gated_mlp",  # llama template kept: down(act(up x) * up x), up_proj reused as gate
    "cos_sliced_from_full",  # cos/sin table built for the full head_dim, then sliced to rotary_dim
    "rope_padded_cos",  # cos/sin padded with 1/0 to head_dim and rotate_half taken over the whole head
    "o_proj_transposed",  # o_proj weight loaded transposed (Megatron/NeMo [in, out] layout assumed)
    "v_loaded_from_k",  # copy-paste in the loader: v_proj slot filled from k_proj.weight
    "residual_after_norm",  # residual taken after input_layernorm (x = ln(x) before saving the skip)
    "merge_heads_no_transpose",  # attention output kept as (B, H, T, D) and reshaped straight to (B, T, H*D)
    "mask_first_row",  # padding mask taken from batch row 0 and broadcast to every row
    "neg_inf_mask_nan",  # masks filled with -inf: fully masked pad query rows give NaN that leaks into keys/values
]
PADDING_ONLY = {"mask_first_row", "neg_inf_mask_nan"}
CLEAN = [
    "folded_norm",  # +1 folded into the stored weights at load time, forward uses the weight as is
    "grouped_gqa",  # queries grouped (B, T, KV, G, D) and contracted against un-repeated K/V
]

FOLD = BUG in ("folded_norm", "ln1p_twice")


def _rec(name, value):
    if isinstance(REC, dict):
        if isinstance(value, tuple):
            REC[name] = tuple(v.detach().clone() for v in value)
        else:
            REC[name] = value.detach().clone()


def layernorm1p(x, w, b, eps, plain=False):
    """LayerNorm with (1 + w) scale.  ``plain`` uses the weight as stored."""
    scale = w if (plain or FOLD) else 1.0 + w
    if BUG == "ln1p_twice":
        scale = 1.0 + scale
    if BUG == "norm_bias_dropped":
        b = None
    return F.layer_norm(x, (x.shape[-1],), scale, b, eps)


def relu2(x):
    if BUG == "relu2_square_first":
        return F.relu(x * x)
    if BUG == "relu_only":
        return F.relu(x)
    return F.relu(x).square()


def rope_tables(pos, head_dim, rotary_dim, theta):
    if BUG == "cos_sliced_from_full":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        ang = pos[..., None].float() * inv
        ang = torch.cat([ang, ang], -1)[..., :rotary_dim]
    else:
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        ang = pos[..., None].float() * inv
        ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_partial_rope(x, cos, sin):
    # x: (B, T, n, D); cos/sin: (B, T, r)
    r = cos.shape[-1]
    cos = cos[:, :, None, :]
    sin = sin[:, :, None, :]
    if BUG == "rope_padded_cos":
        D = x.shape[-1]
        cos = torch.cat([cos, cos.new_ones(*cos.shape[:-1], D - r)], -1)
        sin = torch.cat([sin, sin.new_zeros(*sin.shape[:-1], D - r)], -1)
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)


def attention(x, p, i, cfg, cos, sin, mask, pfx):
    B, T, _ = x.shape
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.head_dim
    G = H // KV
    q = x @ p[f"blk{i}_attn_q"].t()
    k = x @ p[f"blk{i}_attn_k"].t()
    v = x @ p[f"blk{i}_attn_v"].t()
    _rec(pfx + ".q_proj", q)
    _rec(pfx + ".k_proj", k)
    _rec(pfx + ".v_proj", v)
    q = apply_partial_rope(q.view(B, T, H, D), cos, sin)
    k = apply_partial_rope(k.view(B, T, KV, D), cos, sin)
    v = v.view(B, T, KV, D)
    scale = 1.0 / math.sqrt(D)
    if BUG == "grouped_gqa":
        qg = q.view(B, T, KV, G, D)
        s = torch.einsum("bqngd,bknd->bngqk", qg, k) * scale
        s = s + mask[:, :, None]
        pr = torch.softmax(s.float(), dim=-1).to(q.dtype)
        o = torch.einsum("bngqk,bknd->bqngd", pr, v).reshape(B, T, H * D)
    else:
        k = k.repeat_interleave(G, dim=2)
        v = v.repeat_interleave(G, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale + mask
        pr = torch.softmax(s.float(), dim=-1).to(q.dtype)
        if BUG == "merge_heads_no_transpose":
            o = torch.einsum("bhqk,bkhd->bhqd", pr, v).reshape(B, T, H * D)
        else:
            o = torch.einsum("bhqk,bkhd->bqhd", pr, v).reshape(B, T, H * D)
    o = o @ p[f"blk{i}_attn_output"].t()
    _rec(pfx + ".o_proj", o)
    _rec(pfx, o)
    return o


def relu2_mlp(x, p, i, pfx):
    u = x @ p[f"blk{i}_ffn_up"].t()
    _rec(pfx + ".up_proj", u)
    a = relu2(u)
    _rec(pfx + ".act_fn", a)
    if BUG == "gated_mlp":
        a = a * u
    y = a @ p[f"blk{i}_ffn_down"].t()
    _rec(pfx + ".down_proj", y)
    _rec(pfx, y)
    return y


def build_mask(attention_mask, B, T, dtype, device):
    fill = float("-inf") if BUG == "neg_inf_mask_nan" else torch.finfo(dtype).min
    ok = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if attention_mask is not None:
        am = attention_mask.bool()
        if BUG == "mask_first_row":
            am = am[:1].expand(B, T)
        ok = ok & am[:, None, None, :]
    m = torch.zeros(ok.shape, dtype=dtype, device=device)
    return m.masked_fill(~ok, fill)


class NemotronPort(nn.Module):
    def __init__(self, cfg, params):
        super().__init__()
        self.cfg = cfg
        self.p = nn.ParameterDict({k: nn.Parameter(v, requires_grad=False) for k, v in params.items()})
        self.rotary_dim = int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        self.theta = cfg.rope_parameters["rope_theta"]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        cfg, p = self.cfg, self.p
        B, T = input_ids.shape
        eps = cfg.norm_eps
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        x = F.embedding(input_ids, p["token_embd"])
        _rec("model.embed_tokens", x)
        cos, sin = rope_tables(position_ids, cfg.head_dim, self.rotary_dim, self.theta)
        _rec("model.rotary_emb", (cos, sin))
        mask = build_mask(attention_mask, B, T, x.dtype, x.device)
        for i in range(cfg.num_hidden_layers):
            pfx = f"model.layers.{i}"
            h = layernorm1p(x, p[f"blk{i}_attn_norm_w"], p[f"blk{i}_attn_norm_b"], eps)
            _rec(pfx + ".input_layernorm", h)
            if BUG == "residual_after_norm":
                x = h
            x = x + attention(h, p, i, cfg, cos, sin, mask, pfx + ".self_attn")
            h = layernorm1p(
                x, p[f"blk{i}_ffn_norm_w"], p[f"blk{i}_ffn_norm_b"], eps, plain=(BUG == "ln1p_missing_post")
            )
            _rec(pfx + ".post_attention_layernorm", h)
            x = x + relu2_mlp(h, p, i, pfx + ".mlp")
            _rec(pfx, x)
        x = layernorm1p(x, p["output_norm_w"], p["output_norm_b"], eps, plain=(BUG == "ln1p_missing_final"))
        _rec("model.norm", x)
        logits = x @ p["output"].t()
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    """Rename the HF Nemotron state dict into GGUF-like names and wrap it."""
    sd = {k: v.float() for k, v in state_dict.items()}

    def norm_w(key):
        w = sd[key].clone()
        return w + 1.0 if FOLD else w

    out = {"token_embd": sd["model.embed_tokens.weight"], "output": sd["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        s = f"model.layers.{i}."
        out[f"blk{i}_attn_norm_w"] = norm_w(s + "input_layernorm.weight")
        out[f"blk{i}_attn_norm_b"] = sd[s + "input_layernorm.bias"]
        out[f"blk{i}_ffn_norm_w"] = norm_w(s + "post_attention_layernorm.weight")
        out[f"blk{i}_ffn_norm_b"] = sd[s + "post_attention_layernorm.bias"]
        out[f"blk{i}_attn_q"] = sd[s + "self_attn.q_proj.weight"]
        out[f"blk{i}_attn_k"] = sd[s + "self_attn.k_proj.weight"]
        v_src = "self_attn.k_proj.weight" if BUG == "v_loaded_from_k" else "self_attn.v_proj.weight"
        out[f"blk{i}_attn_v"] = sd[s + v_src]
        o = sd[s + "self_attn.o_proj.weight"]
        out[f"blk{i}_attn_output"] = o.t().contiguous() if BUG == "o_proj_transposed" else o
        out[f"blk{i}_ffn_up"] = sd[s + "mlp.up_proj.weight"]
        out[f"blk{i}_ffn_down"] = sd[s + "mlp.down_proj.weight"]
    out["output_norm_w"] = norm_w("model.norm.weight")
    out["output_norm_b"] = sd["model.norm.bias"]
    return NemotronPort(config, out).eval()
