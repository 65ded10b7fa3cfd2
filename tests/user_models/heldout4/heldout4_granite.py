"""From-scratch Granite (user-style port). build(state_dict, hf_config) -> nn.Module."""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None  # verification aid: dict of intermediates keyed by reference module names


def _rec(name, x):
    if REC is not None:
        REC[name] = x.detach()
    return x


def rmsnorm(x, g, eps):
    xf = x.float()
    return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    ang = pos[:, None, :, None].float() * inv  # b,1,t,d/2
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def residual_mult(cfg):
    m = cfg.residual_multiplier
    if BUG == "resmul_from_emb_field":
        m = cfg.embedding_multiplier
    if BUG == "resmul_fp16":
        m = torch.tensor(m, dtype=torch.float16).item()
    return m


def attend(x, lw, cfg, pos, keymask, name):
    b, t, _ = x.shape
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    q, k, v = x @ lw["Wq"], x @ lw["Wk"], x @ lw["Wv"]  # my convention: weights stored (in, out)
    _rec(name + "q_proj", q), _rec(name + "k_proj", k), _rec(name + "v_proj", v)
    q = q.reshape(b, t, H, D).permute(0, 2, 1, 3)
    k = k.reshape(b, t, KV, D).permute(0, 2, 1, 3)
    v = v.reshape(b, t, KV, D).permute(0, 2, 1, 3)
    theta = cfg.rope_parameters["rope_theta"]
    q, k = rotary(q, pos, theta), rotary(k, pos, theta)
    q = q.reshape(b, KV, H // KV, t, D)  # grouped-query attention via a group axis
    scale = cfg.attention_multiplier
    if BUG == "attn_mult_inverted":
        scale = 1.0 / cfg.attention_multiplier
    if BUG == "attn_mult_and_sqrt":
        scale = cfg.attention_multiplier / math.sqrt(D)
    if BUG == "attn_mult_on_output":
        scale = 1.0 / math.sqrt(D)
    s = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = causal[None, None, None]
    if keymask is not None:
        allowed = allowed & keymask[:, None, None, None, :]
    s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    p = torch.softmax(s, -1)
    ctx = torch.einsum("bgrqk,bgkd->bgrqd", p, v).reshape(b, H, t, D).permute(0, 2, 1, 3).reshape(b, t, H * D)
    out = ctx @ lw["Wo"]
    _rec(name + "o_proj", out)
    if BUG == "attn_mult_on_output":
        out = out * cfg.attention_multiplier
    return _rec(name[:-1], out)


def swiglu(x, lw, name):
    gate, up = x @ lw["Wg"], x @ lw["Wu"]
    _rec(name + "gate_proj", gate), _rec(name + "up_proj", up)
    act = F.silu(gate) * up
    if BUG == "clean_sumorder":  # down projection summed over two halves of the intermediate
        n = act.shape[-1] // 2
        return _rec(name[:-1], _rec(name + "down_proj", act[..., n:] @ lw["Wd"][n:] + act[..., :n] @ lw["Wd"][:n]))
    return _rec(name[:-1], _rec(name + "down_proj", act @ lw["Wd"]))


class Granite(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(sd["model.embed_tokens.weight"])
        self.layer_w = nn.ModuleList()
        names = {
            "Wq": "self_attn.q_proj",
            "Wk": "self_attn.k_proj",
            "Wv": "self_attn.v_proj",
            "Wo": "self_attn.o_proj",
            "Wg": "mlp.gate_proj",
            "Wu": "mlp.up_proj",
            "Wd": "mlp.down_proj",
        }
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            d = nn.ParameterDict({k: nn.Parameter(sd[p + v + ".weight"].t()) for k, v in names.items()})
            d["ln_attn"] = nn.Parameter(sd[p + "input_layernorm.weight"])
            d["ln_mlp"] = nn.Parameter(sd[p + "post_attention_layernorm.weight"])
            self.layer_w.append(d)
        self.ln_f = nn.Parameter(sd["model.norm.weight"])
        self.unembed = nn.Parameter(sd["lm_head.weight"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        cfg = self.cfg
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t).expand(b, t)
        keymask = None
        if attention_mask is not None:
            keymask = attention_mask.bool()
            if BUG == "mask_row0_broadcast":
                keymask = keymask[:1].expand(b, t)
        e = _rec("model.embed_tokens", F.embedding(input_ids, self.wte))
        if BUG == "emb_mult_inverted":
            h = e / cfg.embedding_multiplier
        elif BUG == "emb_mult_twice":
            h = e * cfg.embedding_multiplier * cfg.embedding_multiplier
        else:
            h = e * cfg.embedding_multiplier
        eps = cfg.rms_norm_eps
        for i, lw in enumerate(self.layer_w):
            p = f"model.layers.{i}."
            rm = residual_mult(cfg)
            a = attend(
                _rec(p + "input_layernorm", rmsnorm(h, lw["ln_attn"], eps)),
                lw,
                cfg,
                position_ids,
                keymask,
                p + "self_attn.",
            )
            if BUG == "resmul_on_residual":
                h = h * rm + a
            elif BUG == "resmul_on_sum":
                h = (h + a) * rm
            else:
                h = h + a * rm
            f = swiglu(_rec(p + "post_attention_layernorm", rmsnorm(h, lw["ln_mlp"], eps)), lw, p + "mlp.")
            if BUG == "resmul_on_residual":
                h = h * rm + f
            elif BUG == "resmul_on_sum":
                h = (h + f) * rm
            elif BUG == "resmul_attn_only":
                h = h + f
            else:
                h = h + f * rm
            _rec(p[:-1], h)
        if BUG == "logits_scaling_before_norm":
            h = h / cfg.logits_scaling
        h = _rec("model.norm", rmsnorm(h, self.ln_f, eps))
        logits = _rec("lm_head", h @ self.unembed.t())
        if BUG == "logits_scaling_multiplied":
            logits = logits * cfg.logits_scaling
        elif BUG == "logits_from_emb_field":
            logits = logits / cfg.embedding_multiplier
        elif BUG != "logits_scaling_before_norm":
            logits = logits / cfg.logits_scaling
        return _rec("logits", logits)


def build(state_dict, config):
    return Granite(state_dict, config).eval()
