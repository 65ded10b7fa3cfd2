"""Hand-written plain-PyTorch port of Hugging Face `PersimmonForCausalLM` (heldout10 set).

Covers: token embedding, pre-LN blocks with biased LayerNorms, fused query_key_value laid out per
head ([head][q|k|v][head_dim]) with bias, per-head q/k LayerNorm (weight and bias, over head_dim),
partial rotary embedding on the first rotary_ndims = head_dim * 0.5 dims (rotate-half pairing,
cos/sin = cat(freqs, freqs)), squared-ReLU MLP with biases, final LayerNorm and an untied head.

Conventions: `build` re-packs the HF state dict into my own names (embed, lay[i] = ln_in, qkv_w,
qkv_b, qn, kn, out, ln_post, up, down; ln_final, unembed). `forward(input_ids, attention_mask=None,
position_ids=None)` returns float32 logits (batch, seq, vocab); attention_mask (batch, seq) 0 for
pads (left padding); position_ids used as given, else cumsum(mask)-1 with pads set to 1.
`BUG` selects one porting mistake (read at build and forward time); when `REC` is a dict the
intermediates are stored under the Transformers module names.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "qk_ln_bias_dropped",  # q/k LayerNorm built with elementwise weight only, bias tensors never loaded
    "qk_ln_after_rope",  # q/k LayerNorm applied after the rotary embedding instead of before
    "relu2_square_before_relu",  # relu2 written as relu(x*x) (square first) -> negative pre-activations survive
    "partial_rotary_last_dims",  # partial rotary applied to the last rotary_ndims dims instead of the first
    "rope_freq_dim_head_dim",  # inv_freq exponent divided by head_dim instead of rotary_ndims
    "k_layernorm_uses_q_weights",  # loader maps k_layernorm to q_layernorm's tensors (copy-paste key name)
    "fused_qkv_3_inner",  # per-head fused block read as (head_dim, 3) instead of (3, head_dim)
    "rotate_half_sign",  # rotate_half returns cat(x2, -x1): rotation by -theta on both q and k
    "loader_qkv_bias_prev_layer",  # loader indexes biases[i-1]: layer 0 silently gets the last layer's qkv bias
    "relu2_fp16",  # relu2 square computed in float16 (fused half kernel) and upcast
    "pad_mask_batch0",  # padding mask of batch row 0 broadcast to every row
    "v_layernorm_applied",  # k_layernorm also applied to the value heads
    "rope_full_head_rotate_half",  # cos/sin padded to head_dim (1/0 on the pass dims) and rotate_half taken over the whole head
    "weights_bf16_roundtrip",  # loader casts all weights to bfloat16 (config torch_dtype) before running in fp32
]
PADDING_ONLY = {"pad_mask_batch0"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask
    "complex_rope",  # rotary via complex multiplication on (i, i + rot/2) pairs
    "split_qkv",  # loader de-interleaves the per-head fused weight into separate q/k/v matrices
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().float().clone()


def _ln(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _rot_half(x):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    if _bug() == "rotate_half_sign":
        return torch.cat([x2, -x1], -1)
    return torch.cat([-x2, x1], -1)


def _rope(x, pos, R, D, theta):
    """x (B, L, H, D); rotate the first R dims; pos (B, L)."""
    bug = _bug()
    denom = D if bug == "rope_freq_dim_head_dim" else R
    inv = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float32) / denom)
    ang = pos[..., None].float() * inv  # (B, L, R/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None]  # (B, L, 1, R)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None]
    if bug == "complex_rope":
        h = R // 2
        z = torch.complex(x[..., :h], x[..., h:R])
        z = z * torch.polar(torch.ones_like(ang), ang)[:, :, None]
        return torch.cat([z.real, z.imag, x[..., R:]], -1)
    if bug == "partial_rotary_last_dims":
        keep, rot = x[..., : D - R], x[..., D - R :]
        return torch.cat([keep, rot * cos + _rot_half(rot) * sin], -1)
    if bug == "rope_full_head_rotate_half":
        pad = x.shape[-1] - R
        cf = torch.cat([cos, torch.ones(*cos.shape[:-1], pad)], -1)
        sf = torch.cat([sin, torch.zeros(*sin.shape[:-1], pad)], -1)
        return x * cf + _rot_half(x) * sf
    rot, keep = x[..., :R], x[..., R:]
    return torch.cat([rot * cos + _rot_half(rot) * sin, keep], -1)


class PersimmonPort(nn.Module):
    def __init__(self, params, cfg):
        super().__init__()
        self.p = params
        self.cfg = cfg

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        p, c = self.p, self.cfg
        B, L = input_ids.shape
        H, E, eps = c["heads"], c["d"], c["eps"]
        D = E // H
        R = int(D * c["partial"])
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            else:
                position_ids = torch.arange(L)[None].expand(B, L)
        x = p["embed"][input_ids]
        _rec("model.embed_tokens", x)
        allowed = torch.ones(L, L, dtype=torch.bool).tril()[None, None].expand(B, 1, L, L)
        if attention_mask is not None:
            km = attention_mask.bool()
            if bug == "pad_mask_batch0":
                km = km[:1].expand(B, L)
            allowed = allowed & km[:, None, None, :]

        for i, lp in enumerate(p["lay"]):
            pre = f"model.layers.{i}"
            h = _ln(x, lp["ln_in_w"], lp["ln_in_b"], eps)
            _rec(pre + ".input_layernorm", h)
            if bug == "split_qkv":
                q = (h @ lp["wq"].T + lp["bq"]).view(B, L, H, D)
                k = (h @ lp["wk"].T + lp["bk"]).view(B, L, H, D)
                v = (h @ lp["wv"].T + lp["bv"]).view(B, L, H, D)
                _rec(pre + ".self_attn.query_key_value", torch.stack([q, k, v], 3).reshape(B, L, 3 * E))
            else:
                f = h @ lp["qkv_w"].T + lp["qkv_b"]
                _rec(pre + ".self_attn.query_key_value", f)
                if bug == "fused_qkv_3_inner":
                    f = f.view(B, L, H, D, 3)
                    q, k, v = f[..., 0], f[..., 1], f[..., 2]
                else:
                    f = f.view(B, L, H, 3, D)
                    q, k, v = f[..., 0, :], f[..., 1, :], f[..., 2, :]
            qb = None if bug == "qk_ln_bias_dropped" else lp["qn_b"]
            kb = None if bug == "qk_ln_bias_dropped" else lp["kn_b"]
            if bug == "qk_ln_after_rope":
                q = _rope(q, position_ids, R, D, c["theta"])
                k = _rope(k, position_ids, R, D, c["theta"])
            q = _ln(q, lp["qn_w"], qb, eps)
            k = _ln(k, lp["kn_w"], kb, eps)
            _rec(pre + ".self_attn.q_layernorm", q)
            _rec(pre + ".self_attn.k_layernorm", k)
            if bug == "v_layernorm_applied":
                v = _ln(v, lp["kn_w"], kb, eps)
            if bug != "qk_ln_after_rope":
                q = _rope(q, position_ids, R, D, c["theta"])
                k = _rope(k, position_ids, R, D, c["theta"])
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            if bug == "sdpa":
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=D**-0.5)
            else:
                s = (q @ k.transpose(-1, -2)) * D**-0.5
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
                ctx = torch.softmax(s, -1) @ v
            ctx = ctx.transpose(1, 2).reshape(B, L, E)
            a = ctx @ lp["out_w"].T + lp["out_b"]
            _rec(pre + ".self_attn.dense", a)
            _rec(pre + ".self_attn", a)
            x = x + a
            h = _ln(x, lp["ln_post_w"], lp["ln_post_b"], eps)
            _rec(pre + ".post_attention_layernorm", h)
            u = h @ lp["up_w"].T + lp["up_b"]
            _rec(pre + ".mlp.dense_h_to_4h", u)
            if bug == "relu2_square_before_relu":
                u = F.relu(u * u)
            elif bug == "relu2_fp16":
                r = F.relu(u).half()
                u = (r * r).float()
            else:
                u = F.relu(u).square()
            _rec(pre + ".mlp.act", u)
            m = u @ lp["down_w"].T + lp["down_b"]
            _rec(pre + ".mlp.dense_4h_to_h", m)
            _rec(pre + ".mlp", m)
            x = x + m
            _rec(pre, x)
        x = _ln(x, p["lnf_w"], p["lnf_b"], eps)
        _rec("model.final_layernorm", x)
        logits = x @ p["unembed"].T
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().float().clone() for k, v in state_dict.items()}
    if bug == "weights_bf16_roundtrip":
        sd = {k: v.bfloat16().float() for k, v in sd.items()}
    E, H = config.hidden_size, config.num_attention_heads
    D = E // H
    rp = getattr(config, "rope_parameters", None) or {}
    cfg = dict(
        d=E,
        heads=H,
        eps=config.layer_norm_eps,
        theta=float(rp.get("rope_theta", 10000.0)),
        partial=float(rp.get("partial_rotary_factor", 0.5)),
    )
    m = "model."
    n = config.num_hidden_layers
    lays = []
    for i in range(n):
        b = f"{m}layers.{i}."
        j = (i - 1) if bug == "loader_qkv_bias_prev_layer" else i  # python wraps -1 to the last layer
        j = j % n
        kn = "q_layernorm" if bug == "k_layernorm_uses_q_weights" else "k_layernorm"
        W = sd[b + "self_attn.query_key_value.weight"]
        bias = sd[f"{m}layers.{j}.self_attn.query_key_value.bias"]
        lp = dict(
            ln_in_w=sd[b + "input_layernorm.weight"],
            ln_in_b=sd[b + "input_layernorm.bias"],
            qkv_w=W,
            qkv_b=bias,
            qn_w=sd[b + "self_attn.q_layernorm.weight"],
            qn_b=sd[b + "self_attn.q_layernorm.bias"],
            kn_w=sd[b + f"self_attn.{kn}.weight"],
            kn_b=sd[b + f"self_attn.{kn}.bias"],
            out_w=sd[b + "self_attn.dense.weight"],
            out_b=sd[b + "self_attn.dense.bias"],
            ln_post_w=sd[b + "post_attention_layernorm.weight"],
            ln_post_b=sd[b + "post_attention_layernorm.bias"],
            up_w=sd[b + "mlp.dense_h_to_4h.weight"],
            up_b=sd[b + "mlp.dense_h_to_4h.bias"],
            down_w=sd[b + "mlp.dense_4h_to_h.weight"],
            down_b=sd[b + "mlp.dense_4h_to_h.bias"],
        )
        if bug == "split_qkv":
            Wh = W.view(H, 3, D, E)
            bh = bias.view(H, 3, D)
            lp["wq"], lp["wk"], lp["wv"] = (Wh[:, t].reshape(E, E) for t in range(3))
            lp["bq"], lp["bk"], lp["bv"] = (bh[:, t].reshape(E) for t in range(3))
        lays.append(lp)
    return PersimmonPort(
        dict(
            embed=sd[m + "embed_tokens.weight"],
            lay=lays,
            lnf_w=sd[m + "final_layernorm.weight"],
            lnf_b=sd[m + "final_layernorm.bias"],
            unembed=sd["lm_head.weight"],
        ),
        cfg,
    ).eval()
