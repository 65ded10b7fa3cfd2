"""From-scratch GPT-NeoX / Pythia (user-style port). build(state_dict, hf_config) -> nn.Module."""

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


def layer_norm(x, gamma, beta, eps, inplace=False):
    mu = x.mean(-1, keepdim=True)
    if inplace:
        xc = x.sub_(mu)  # "saves a copy"
    else:
        xc = x - mu
    var = xc.pow(2).mean(-1, keepdim=True)
    return xc * torch.rsqrt(var + eps) * gamma + beta


class Rotary:
    def __init__(self, head_size, pct, base):
        self.nd = int(head_size * pct)
        self.inv = 1.0 / (base ** (torch.arange(0, self.nd, 2, dtype=torch.int64).float() / self.nd))

    def __call__(self, x, pos):
        ang = pos[:, None, :, None].float() * self.inv
        ang = torch.cat([ang, ang], -1)
        xr, xp = x[..., : self.nd], x[..., self.nd :]
        h = self.nd // 2
        rot = torch.cat([-xr[..., h:], xr[..., :h]], -1)
        return torch.cat([xr * ang.cos() + rot * ang.sin(), xp], -1)


class Attention(nn.Module):
    def __init__(self, sd, pre, cfg, idx):
        super().__init__()
        self.pre, self.idx = pre, idx
        self.H = cfg.num_attention_heads
        self.D = cfg.hidden_size // self.H
        W = sd[pre + "query_key_value.weight"].view(self.H, 3, self.D, cfg.hidden_size)
        B = sd[pre + "query_key_value.bias"].view(self.H, 3, self.D)
        # my convention: three separate projections, de-interleaved from NeoX's per-head layout
        self.to_q, self.to_k, self.to_v = (nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(3))
        for j, lin in enumerate([self.to_q, self.to_k, self.to_v]):
            lin.weight = nn.Parameter(W[:, j].reshape(-1, cfg.hidden_size).clone())
            lin.bias = nn.Parameter(B[:, j].reshape(-1).clone())
        self.proj_w = nn.Parameter(sd[pre + "dense.weight"])
        self.proj_b = nn.Parameter(sd[pre + "dense.bias"])
        self.rope = Rotary(
            self.D, cfg.rope_parameters.get("partial_rotary_factor", 1.0), cfg.rope_parameters["rope_theta"]
        )

    def forward(self, x, pos, pad_bias):
        b, t, _ = x.shape
        H, D = self.H, self.D
        q, k, v = (f(x).view(b, t, H, D) for f in (self.to_q, self.to_k, self.to_v))
        _rec(self.pre + "query_key_value", torch.stack([q, k, v], 3).reshape(b, t, 3 * H * D))
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = self.rope(q, pos), self.rope(k, pos)
        if BUG == "scores_k_qT":
            s = (k @ q.transpose(-1, -2)) / (D**0.5)
        else:
            s = (q @ k.transpose(-1, -2)) / (D**0.5)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        s = s.masked_fill(~causal, torch.finfo(s.dtype).min)
        if pad_bias is not None and not (BUG == "mask_first_layer_only" and self.idx > 0):
            s = s + pad_bias
        if BUG == "softmax_denom_eps":
            e = torch.exp(s - s.amax(-1, keepdim=True))
            p = e / (e.sum(-1, keepdim=True) + 1e-5)
        else:
            p = torch.softmax(s, -1)
        ctx = p @ (k if BUG == "probs_times_k" else v)
        ctx = ctx.transpose(1, 2).reshape(b, t, H * D)
        if BUG == "dense_bias_on_input":
            return _rec(self.pre + "dense", F.linear(ctx + self.proj_b, self.proj_w))
        return _rec(self.pre + "dense", F.linear(ctx, self.proj_w, self.proj_b))


class MLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.pre = pre
        self.fc_in = nn.Linear(1, 1)
        self.fc_in.weight = nn.Parameter(sd[pre + "dense_h_to_4h.weight"])
        self.fc_in.bias = nn.Parameter(sd[pre + "dense_h_to_4h.bias"])
        self.fc_out = nn.Linear(1, 1)
        self.fc_out.weight = nn.Parameter(sd[pre + "dense_4h_to_h.weight"])
        self.fc_out.bias = nn.Parameter(sd[pre + "dense_4h_to_h.bias"])

    def forward(self, x):
        if BUG == "mlp_bias_after_gelu":
            a = _rec(self.pre + "dense_h_to_4h", F.linear(x, self.fc_in.weight) + self.fc_in.bias)
            a = F.gelu(F.linear(x, self.fc_in.weight)) + self.fc_in.bias
        else:
            a = F.gelu(_rec(self.pre + "dense_h_to_4h", self.fc_in(x)))
        _rec(self.pre + "act", a)
        out = _rec(self.pre + "dense_4h_to_h", self.fc_out(a))
        if BUG == "gelu_after_fc_out":
            out = F.gelu(out)
        return _rec(self.pre[:-1], out)


class NeoXLayer(nn.Module):
    def __init__(self, sd, i, cfg):
        super().__init__()
        pre = f"gpt_neox.layers.{i}."
        self.pre, self.eps = pre, cfg.layer_norm_eps
        self.ln1_g = nn.Parameter(sd[pre + "input_layernorm.weight"])
        self.ln1_b = nn.Parameter(sd[pre + "input_layernorm.bias"])
        self.ln2_g = nn.Parameter(sd[pre + "post_attention_layernorm.weight"])
        self.ln2_b = nn.Parameter(sd[pre + "post_attention_layernorm.bias"])
        self.attn = Attention(sd, pre + "attention.", cfg, i)
        self.mlp = MLP(sd, pre + "mlp.")

    def forward(self, x, pos, pad_bias):
        p = self.pre
        n1 = _rec(
            p + "input_layernorm", layer_norm(x, self.ln1_g, self.ln1_b, self.eps, inplace=BUG == "ln_inplace_center")
        )
        a = _rec(p + "attention", self.attn(n1, pos, pad_bias))
        if BUG == "mlp_reads_ln1":
            n2 = n1
        elif BUG == "mlp_reads_attn_out":
            n2 = layer_norm(a, self.ln2_g, self.ln2_b, self.eps)
        else:
            n2 = layer_norm(x, self.ln2_g, self.ln2_b, self.eps)
        _rec(p + "post_attention_layernorm", n2)
        m = self.mlp(n2)
        if BUG == "clean_sumorder":
            return _rec(p[:-1], (m + a) + x)
        return _rec(p[:-1], x + a + m)  # parallel residual


class MyNeoX(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Parameter(sd["gpt_neox.embed_in.weight"])
        self.layers = nn.ModuleList([NeoXLayer(sd, i, cfg) for i in range(cfg.num_hidden_layers)])
        self.lnf_g = nn.Parameter(sd["gpt_neox.final_layer_norm.weight"])
        self.lnf_b = nn.Parameter(sd["gpt_neox.final_layer_norm.bias"])
        self.head = nn.Parameter(sd["lm_head.weight"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t)[None].expand(b, t)
        pad_bias = None
        if attention_mask is not None:
            m = attention_mask.to(torch.uint8 if BUG == "mask_uint8_wrap" else torch.int64)
            pad_bias = ((m - 1).float() * 1e9)[:, None, None, :]
        x = _rec("gpt_neox.embed_in", F.embedding(input_ids, self.emb))
        for layer in self.layers:
            x = layer(x, position_ids, pad_bias)
        x = _rec("gpt_neox.final_layer_norm", layer_norm(x, self.lnf_g, self.lnf_b, self.cfg.layer_norm_eps))
        return _rec("logits", _rec("lm_head", x @ self.head.t()))


def build(state_dict, config):
    return MyNeoX(state_dict, config).eval()
