# from-scratch Mistral, own conventions: fused wqkv, w13 as separate, 'g' for norm scale
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import parity

BUG = ""  # the one injected bug: set by the test (tests/test_heldout2_faults.py)


def NEG(sc):
    return float("-inf") if BUG == "pad_neg_inf" else torch.finfo(sc.dtype).min


class RMS(nn.Module):
    def __init__(s, w, eps):
        super().__init__()
        s.g = nn.Parameter(w)
        s.eps = eps

    def forward(s, x):
        xf = x.float()
        if BUG == "rms_axis_seq":
            return s.g * (xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + s.eps))
        if BUG == "rms_mean_not_sq":
            xf = xf / torch.sqrt(xf.mean(-1, keepdim=True).abs() + s.eps)
        else:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + s.eps)
        if BUG == "rms_no_weight":
            return xf
        return s.g * xf


def rope(x, pos, theta, d):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = pos[..., None].float() * inv  # b t d/2
    if BUG == "rope_cos_sin_swapped":
        cos, sin = torch.sin(ang), torch.cos(ang)
    else:
        cos, sin = torch.cos(ang), torch.sin(ang)
    cos = torch.cat([cos, cos], -1)[:, None]
    sin = torch.cat([sin, sin], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


class Attn(nn.Module):
    def __init__(s, c, sd, p, li):
        super().__init__()
        s.nh, s.nkv, s.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        s.win = c.sliding_window
        s.theta = c.rope_parameters["rope_theta"]
        s.li = li
        w = torch.cat([sd.pop(p + "q_proj.weight"), sd.pop(p + "k_proj.weight"), sd.pop(p + "v_proj.weight")], 0)
        s.wqkv = nn.Linear(c.hidden_size, w.shape[0], bias=False)
        s.wqkv.weight = nn.Parameter(w)
        s.wo = nn.Linear(s.nh * s.hd, c.hidden_size, bias=False)
        s.wo.weight = nn.Parameter(sd.pop(p + "o_proj.weight"))

    def forward(s, x, pos, amask, raw=None):
        b, t, _ = x.shape
        qkv = s.wqkv(x)
        if BUG == "kv_unnormed":
            qkv = torch.cat([qkv[..., : s.nh * s.hd], s.wqkv(raw)[..., s.nh * s.hd :]], -1)
        q, k, v = qkv.split([s.nh * s.hd, s.nkv * s.hd, s.nkv * s.hd], -1)
        if BUG == "v_scaled":
            v = v / math.sqrt(s.hd)
        if BUG == "rope_on_v":
            v = rope(v.view(b, t, s.nkv, s.hd).transpose(1, 2), pos, s.theta, s.hd).transpose(1, 2).reshape(b, t, -1)
        q = q.view(b, t, s.nh, s.hd).transpose(1, 2)
        k = k.view(b, t, s.nkv, s.hd).transpose(1, 2)
        v = v.view(b, t, s.nkv, s.hd).transpose(1, 2)
        q = parity.tap(rope(q, pos, s.theta, s.hd), "q_rot")
        k = parity.tap(
            rope(k, pos, s.theta, s.hd) if BUG != "rope_k_pos_zero" else rope(k, torch.zeros_like(pos), s.theta, s.hd),
            "k_rot",
        )
        rep = s.nh // s.nkv
        if BUG == "gqa_single_kv":
            k = k[:, :1].expand(-1, s.nh, -1, -1)
            v = v[:, :1].expand(-1, s.nh, -1, -1)
        elif BUG == "gqa_modulo":
            idx = torch.arange(s.nh) % s.nkv
            k = k[:, idx]
            v = v[:, idx]
        else:
            k = k.repeat_interleave(rep, 1)
            v = v.repeat_interleave(rep, 1)
        if BUG == "scores_bf16":
            sc = ((q.bfloat16() @ k.bfloat16().transpose(-1, -2)) / math.sqrt(s.hd)).float()
        else:
            sc = (q @ k.transpose(-1, -2)) / math.sqrt(s.hd)
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None]
        allowed = j <= i
        if BUG == "window_lt":  # keys with j < i-w masked, (j == i-w kept)
            allowed = allowed & (j >= i - s.win)
        elif BUG == "window_double":
            allowed = allowed & (j > i - 2 * s.win)
        elif BUG == "window_from_start":
            allowed = allowed & (j < s.win) | (j == i)
        elif BUG == "window_mask_value_zero":
            pass
        else:
            allowed = allowed & (j > i - s.win)
        if BUG == "window_mask_value_zero":
            causal = j <= i
            sc = sc.masked_fill(~causal, NEG(sc))
            sc = sc.masked_fill(causal & ~(j > i - s.win), 0.0)
        else:
            sc = sc.masked_fill(~allowed, NEG(sc))
        if amask is not None:
            if BUG == "pad_mask_inverted":
                amask = 1 - amask
            sc = sc.masked_fill(amask[:, None, None, :] == 0, NEG(sc))
        if BUG == "softmax_fp16":
            pr = torch.softmax(sc.half(), -1).float()
        else:
            pr = torch.softmax(sc, -1)
        if BUG == "softmax_plus_one":
            m = sc.amax(-1, keepdim=True)
            e = torch.exp(sc - m)
            pr = e / (e.sum(-1, keepdim=True) + torch.exp(-m))
        if BUG == "probs_renorm_sqrt":
            pr = pr.sqrt()
            pr = pr / pr.sum(-1, keepdim=True)
        pr = parity.tap(pr, "probs")
        o = pr @ v
        o = o.transpose(1, 2).reshape(b, t, s.nh * s.hd)
        if BUG == "o_proj_skipped":
            return o
        return s.wo(o)


class MLP(nn.Module):
    def __init__(s, c, sd, p):
        super().__init__()
        s.w1 = nn.Linear(1, 1, bias=False)
        s.w1.weight = nn.Parameter(sd.pop(p + "gate_proj.weight"))
        s.w3 = nn.Linear(1, 1, bias=False)
        s.w3.weight = nn.Parameter(sd.pop(p + "up_proj.weight"))
        s.w2 = nn.Linear(1, 1, bias=False)
        s.w2.weight = nn.Parameter(sd.pop(p + "down_proj.weight"))

    def forward(s, x):
        if BUG == "silu_on_up":
            return s.w2(s.w1(x) * F.silu(s.w3(x)))
        if BUG == "sigmoid_not_silu":
            return s.w2(torch.sigmoid(s.w1(x)) * s.w3(x))
        if BUG == "relu_sq":
            return s.w2(F.relu(s.w1(x)) ** 2 * s.w3(x))
        return s.w2(F.silu(s.w1(x)) * s.w3(x))


class Block(nn.Module):
    def __init__(s, c, sd, i):
        super().__init__()
        p = f"model.layers.{i}."
        s.n1 = RMS(sd.pop(p + "input_layernorm.weight"), c.rms_norm_eps)
        s.n2 = RMS(sd.pop(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
        s.att = Attn(c, sd, p + "self_attn.", i)
        s.ff = MLP(c, sd, p + "mlp.")

    def forward(s, x, pos, am):
        if BUG == "norm_swap_ln":
            x = x + s.att(s.n2(x), pos, am)
            return x + s.ff(s.n1(x))
        a = s.att(s.n1(x), pos, am, raw=x)
        if BUG == "resid_dropout":
            a = F.dropout(a, 0.1, training=True)
        x = x + a
        if BUG == "mlp_reads_attn_input":
            pass
        return x + s.ff(s.n2(x))


class Mistral(nn.Module):
    def __init__(s, sd, c):
        super().__init__()
        s.emb = nn.Embedding(1, 1)
        s.emb.weight = nn.Parameter(sd.pop("model.embed_tokens.weight"))
        s.blocks = nn.ModuleList([Block(c, sd, i) for i in range(c.num_hidden_layers)])
        s.norm = RMS(sd.pop("model.norm.weight"), c.rms_norm_eps)
        s.head = nn.Linear(1, 1, bias=False)
        s.head.weight = nn.Parameter(sd.pop("lm_head.weight"))

    def forward(s, input_ids, attention_mask=None, position_ids=None):
        ids = input_ids
        if BUG == "ids_shift":
            ids = (ids + 1) % s.emb.weight.shape[0]
        x = s.emb(ids)
        b, t = ids.shape
        pos = position_ids if position_ids is not None else torch.arange(t)[None].expand(b, t)
        order = list(s.blocks)
        if BUG == "layers_reversed":
            order = order[::-1]
        if BUG == "layer_skipped":
            order = order[:1]
        for blk in order:
            x = blk(x, pos, attention_mask)
        if BUG == "final_norm_layer0_w":
            x = s.blocks[0].n1.g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.norm.eps))
        else:
            x = s.norm(x)
        lg = x @ s.emb.weight.T if BUG == "head_tied_wrongly" else s.head(x)
        if BUG == "logits_temp":
            lg = lg / 0.7
        return lg


def build(sd, cfg):
    return Mistral(sd, cfg)
