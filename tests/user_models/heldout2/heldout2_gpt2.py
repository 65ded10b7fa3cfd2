# from-scratch GPT-2: Linear layers holding transposed Conv1D weights, separate q/k/v split from c_attn
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = ""  # the one injected bug: set by the test (tests/test_heldout2_faults.py)


def NEG(sc):
    return float("-inf") if BUG == "pad_neg_inf" else torch.finfo(sc.dtype).min


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class LN(nn.Module):
    def __init__(s, w, b, eps):
        super().__init__()
        s.gamma = nn.Parameter(w)
        s.beta = nn.Parameter(b)
        s.eps = eps

    def forward(s, x):
        mu = x.mean(-1, keepdim=True)
        if BUG == "ln_no_center":
            var = x.pow(2).mean(-1, keepdim=True)
            xc = x
        elif BUG == "ln_unbiased_var":
            xc = x - mu
            var = xc.var(-1, keepdim=True, unbiased=True)
        else:
            xc = x - mu
            var = xc.pow(2).mean(-1, keepdim=True)
        y = xc / torch.sqrt(var + s.eps)
        if BUG == "ln_bias_dropped":
            return y * s.gamma
        if BUG == "ln_bias_twice":
            return y * s.gamma + 2 * s.beta
        if BUG == "ln_bias_before_scale":
            return (y + s.beta) * s.gamma
        return y * s.gamma + s.beta


class Attn(nn.Module):
    def __init__(s, c, sd, p):
        super().__init__()
        d = c.n_embd
        s.nh = c.n_head
        s.hd = d // c.n_head
        W = sd.pop(p + "c_attn.weight")
        B = sd.pop(p + "c_attn.bias")  # Conv1D: [d, 3d]
        s.q = nn.Linear(d, d)
        s.k = nn.Linear(d, d)
        s.v = nn.Linear(d, d)
        Wq, Wk, Wv = W.t().split(d, 0)
        Bq, Bk, Bv = B.split(d, 0)
        if BUG == "conv1d_bias_split":
            Bq, Bk, Bv = Bv, Bq, Bk
        s.q.weight = nn.Parameter(Wq.contiguous())
        s.k.weight = nn.Parameter(Wk.contiguous())
        s.v.weight = nn.Parameter(Wv.contiguous())
        s.q.bias = nn.Parameter(Bq.contiguous())
        s.k.bias = nn.Parameter(Bk.contiguous())
        s.v.bias = nn.Parameter(Bv.contiguous())
        s.proj = nn.Linear(d, d)
        s.proj.weight = nn.Parameter(sd.pop(p + "c_proj.weight").t().contiguous())
        s.proj.bias = nn.Parameter(sd.pop(p + "c_proj.bias"))

    def forward(s, x, amask):
        b, t, d = x.shape
        q = s.q(x).view(b, t, s.nh, s.hd).transpose(1, 2)
        k = s.k(x).view(b, t, s.nh, s.hd).transpose(1, 2)
        v = s.v(x).view(b, t, s.nh, s.hd).transpose(1, 2)
        if BUG == "head_split_wrong":  # split as (nh, t) instead of (t, nh)
            q = s.q(x).view(b, s.nh, t, s.hd)
        sc = q @ k.transpose(-1, -2)
        if BUG == "scale_by_layer_idx":
            sc = sc / math.sqrt(s.hd) / 2.0
        else:
            sc = sc / math.sqrt(s.hd)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        if BUG == "mask_large_neg_before_scale":
            pass
        sc = sc.masked_fill(~causal, NEG(sc))
        if amask is not None and BUG != "mask_pad_through":
            sc = sc.masked_fill(amask[:, None, None, :] == 0, NEG(sc))
        pr = torch.softmax(sc, -1)
        o = (pr @ v).transpose(1, 2).reshape(b, t, d)
        if BUG == "proj_bias_missing":
            return F.linear(o, s.proj.weight)
        return s.proj(o)


class MLP(nn.Module):
    def __init__(s, c, sd, p):
        super().__init__()
        s.fc = nn.Linear(1, 1)
        s.fc.weight = nn.Parameter(sd.pop(p + "c_fc.weight").t().contiguous())
        s.fc.bias = nn.Parameter(sd.pop(p + "c_fc.bias"))
        s.out = nn.Linear(1, 1)
        s.out.weight = nn.Parameter(sd.pop(p + "c_proj.weight").t().contiguous())
        s.out.bias = nn.Parameter(sd.pop(p + "c_proj.bias"))

    def forward(s, x):
        h = s.fc(x)
        if BUG == "mlp_act_on_output":
            return gelu_tanh(s.out(h))
        h = h * torch.sigmoid(1.702 * h) if BUG == "quick_gelu" else gelu_tanh(h)
        if BUG == "down_bias_missing":
            return F.linear(h, s.out.weight)
        return s.out(h)


class Block(nn.Module):
    def __init__(s, c, sd, i):
        super().__init__()
        p = f"transformer.h.{i}."
        s.ln1 = LN(sd.pop(p + "ln_1.weight"), sd.pop(p + "ln_1.bias"), c.layer_norm_epsilon)
        s.ln2 = LN(sd.pop(p + "ln_2.weight"), sd.pop(p + "ln_2.bias"), c.layer_norm_epsilon)
        s.attn = Attn(c, sd, p + "attn.")
        s.mlp = MLP(c, sd, p + "mlp.")

    def forward(s, x, am):
        a = s.attn(s.ln1(x), am)
        if BUG == "residual_from_normed":
            h = s.ln1(x) + a
        else:
            h = x + a
        return h + s.mlp(s.ln2(h))


class GPT2(nn.Module):
    def __init__(s, sd, c):
        super().__init__()
        s.wte = nn.Embedding(1, 1)
        s.wte.weight = nn.Parameter(sd.pop("transformer.wte.weight"))
        s.wpe = nn.Embedding(1, 1)
        s.wpe.weight = nn.Parameter(sd.pop("transformer.wpe.weight"))
        sd.pop("lm_head.weight", None)
        s.h = nn.ModuleList([Block(c, sd, i) for i in range(c.n_layer)])
        s.ln_f = LN(sd.pop("transformer.ln_f.weight"), sd.pop("transformer.ln_f.bias"), c.layer_norm_epsilon)

    def forward(s, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        pos = position_ids if position_ids is not None else torch.arange(t)[None].expand(b, t)
        if BUG == "wpe_offset2":
            pos = pos + 2
        if BUG == "pos_ignores_position_ids":
            pos = torch.arange(t)[None].expand(b, t)  # fairseq/OPT-style offset carried over
        x = s.wte(input_ids)
        if BUG == "wpe_missing":
            pass
        elif BUG == "wpe_reversed":
            x = x + s.wpe(pos.flip(-1))
        else:
            x = x + s.wpe(pos)
        for blk in s.h:
            x = blk(x, attention_mask)
        if BUG == "ln_f_uses_ln1":
            x = s.h[0].ln1(x)
        else:
            x = s.ln_f(x)
        return x @ s.wte.weight.T


def build(sd, cfg):
    return GPT2(sd, cfg)
