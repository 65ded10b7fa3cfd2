"""From-scratch Gemma 2 (user-style port). build(state_dict, hf_config) -> nn.Module."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
NEG = torch.finfo(torch.float32).min
REC = None  # verification aid: dict of intermediates keyed by reference module names


def _rec(name, x):
    if REC is not None:
        REC[name] = x.detach()
    return x


def rms_scale(x, scale, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * scale).to(x.dtype)


def rope_cos_sin(pos, dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    ang = pos[..., None].float() * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos()[:, None], ang.sin()[:, None]


def apply_rope(x, cos, sin):
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


def soft_cap(x, cap):
    return torch.tanh(x / cap) * cap


def attention_probs(s):
    if BUG == "softmax_denom_eps":
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / (e.sum(-1, keepdim=True) + 1e-5)
    return torch.softmax(s.float(), -1).to(s.dtype)


class SelfAttn(nn.Module):
    def __init__(self, sd, pre, cfg, idx):
        super().__init__()
        self.idx, self.cfg = idx, cfg
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # my convention: one fused [q; k; v] projection
        self.w_qkv = nn.Parameter(
            torch.cat([sd[pre + "q_proj.weight"], sd[pre + "k_proj.weight"], sd[pre + "v_proj.weight"]], 0)
        )
        self.w_out = nn.Parameter(sd[pre + "o_proj.weight"])

    def is_sliding(self):
        if BUG == "sliding_wrong_parity":
            return self.idx % 2 == 1
        if BUG == "sliding_all_layers":
            return True
        return self.cfg.layer_types[self.idx] == "sliding_attention"

    def forward(self, x, cos, sin, pad):
        b, t, _ = x.shape
        cfg = self.cfg
        q, k, v = (x @ self.w_qkv.t()).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        pre = f"model.layers.{self.idx}.self_attn."
        _rec(pre + "q_proj", q), _rec(pre + "k_proj", k), _rec(pre + "v_proj", v)
        q = q.view(b, t, self.nh, self.hd).transpose(1, 2)
        k = k.view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

        scale = cfg.query_pre_attn_scalar**-0.5
        if BUG == "qscale_fp16":
            scale = float(torch.tensor(scale, dtype=torch.float16))
        cap = cfg.attn_logit_softcapping
        if BUG == "attn_cap_uses_final":
            cap = cfg.final_logit_softcapping
        if BUG == "softcap_sliding_only" and not self.is_sliding():
            cap = None

        # allowed[b, 1, i, j]
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        allowed = j <= i
        if self.is_sliding():
            allowed = allowed & (j > i - cfg.sliding_window)
        allowed = allowed[None, None]
        if pad is not None:
            if BUG == "mask_query_axis":
                allowed = allowed & pad[:, None, :, None]
            else:
                allowed = allowed & pad[:, None, None, :]

        s = (k @ q.transpose(-1, -2)) if BUG == "scores_k_qT" else (q @ k.transpose(-1, -2))
        if BUG == "softcap_before_scale":
            s = soft_cap(s, cap) * scale
            s = s.masked_fill(~allowed, NEG)
        elif BUG == "softcap_after_mask":
            s = (s * scale).masked_fill(~allowed, NEG)
            s = soft_cap(s, cap)
        else:
            s = s * scale
            if cap is not None:
                s = soft_cap(s, cap)
            s = s.masked_fill(~allowed, NEG)
        p = attention_probs(s)
        ctx = (p @ v).transpose(1, 2).reshape(b, t, self.nh * self.hd)
        return _rec(f"model.layers.{self.idx}.self_attn.o_proj", ctx @ self.w_out.t())


class FFN(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        self.pre = pre
        # my convention: fused [up; gate]
        self.w_up_gate = nn.Parameter(torch.cat([sd[pre + "up_proj.weight"], sd[pre + "gate_proj.weight"]], 0))
        self.w_down = nn.Parameter(sd[pre + "down_proj.weight"])

    def forward(self, x):
        up, gate = (x @ self.w_up_gate.t()).chunk(2, -1)
        if BUG == "clean_sumorder":  # down projection summed over two halves of the intermediate
            a = F.gelu(gate, approximate="tanh") * up
            n = a.shape[-1] // 2
            return _rec(
                self.pre + "down_proj", a[..., n:] @ self.w_down[:, n:].t() + a[..., :n] @ self.w_down[:, :n].t()
            )
        _rec(self.pre + "up_proj", up), _rec(self.pre + "gate_proj", gate)
        return _rec(self.pre + "down_proj", (F.gelu(gate, approximate="tanh") * up) @ self.w_down.t())


class Block(nn.Module):
    def __init__(self, sd, i, cfg):
        super().__init__()
        pre = f"model.layers.{i}."
        self.pre = pre
        self.eps = cfg.rms_norm_eps
        # my convention: norm scales stored as (1 + w)
        for mine, theirs in [
            ("s_in", "input_layernorm"),
            ("s_post_attn", "post_attention_layernorm"),
            ("s_pre_ffn", "pre_feedforward_layernorm"),
            ("s_post_ffn", "post_feedforward_layernorm"),
        ]:
            setattr(self, mine, nn.Parameter(1.0 + sd[pre + theirs + ".weight"]))
        self.attn = SelfAttn(sd, pre + "self_attn.", cfg, i)
        self.ffn = FFN(sd, pre + "mlp.")

    def forward(self, h, cos, sin, pad):
        p = self.pre
        a = self.attn(_rec(p + "input_layernorm", rms_scale(h, self.s_in, self.eps)), cos, sin, pad)
        h = h + _rec(p + "post_attention_layernorm", rms_scale(a, self.s_post_attn, self.eps))
        f = self.ffn(_rec(p + "pre_feedforward_layernorm", rms_scale(h, self.s_pre_ffn, self.eps)))
        return _rec(p[:-1], h + _rec(p + "post_feedforward_layernorm", rms_scale(f, self.s_post_ffn, self.eps)))


class MyGemma2(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Parameter(sd["model.embed_tokens.weight"])  # tied with the head
        self.blocks = nn.ModuleList([Block(sd, i, cfg) for i in range(cfg.num_hidden_layers)])
        self.s_final = nn.Parameter(1.0 + sd["model.norm.weight"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        cfg = self.cfg
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t)[None].expand(b, t)
        pad = attention_mask.bool() if attention_mask is not None else None
        h = _rec("model.embed_tokens", self.tok[input_ids] * torch.tensor(cfg.hidden_size**0.5, dtype=self.tok.dtype))
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_parameters["rope_theta"])
        for blk in self.blocks:
            h = blk(h, cos, sin, pad)
        h = _rec("model.norm", rms_scale(h, self.s_final, cfg.rms_norm_eps))
        cap = cfg.final_logit_softcapping
        if BUG == "final_cap_uses_attn":
            cap = cfg.attn_logit_softcapping
        if BUG == "final_cap_on_hidden":
            return _rec("logits", _rec("lm_head", soft_cap(h, cap) @ self.tok.t()))
        logits = _rec("lm_head", h @ self.tok.t())
        if BUG == "final_cap_last_token":
            return _rec("logits", torch.cat([logits[:, :-1], soft_cap(logits[:, -1:], cap)], 1))
        return _rec("logits", soft_cap(logits, cap))


def build(state_dict, config):
    return MyGemma2(state_dict, config).eval()
