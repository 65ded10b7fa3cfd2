"""GPT-J causal LM, a from-scratch port with ordinary nn.Module classes.

Attention is written out by hand (float32 upcast, additive causal mask buffer built once).
build(state_dict, config) -> module; module(input_ids, attention_mask=None, position_ids=None) -> logits
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "rotate_every_two_sign",  # rotate_every_two returns (x2, -x1) pairs instead of (-x2, x1)
    "sincos_tiled_not_interleaved",  # sin/cos duplicated with repeat (tile) instead of repeat_interleave
    "rotary_freq_denominator_head_dim",  # inv_freq exponent divided by head_dim instead of rotary_dim
    "rotary_on_value",  # rotary also applied to the value heads
    "causal_buffer_bottom_rows",  # max-positions mask buffer sliced [-T:, :T] instead of [:T, :T]
    "layernorm_bf16",  # LayerNorms computed in bfloat16
    "functional_dropout_in_eval",  # F.dropout(attn_probs, attn_pdrop) leaves training=True
    "mlp_reads_attn_output",  # parallel block: MLP fed the attention output instead of ln_1 output
    "residual_added_twice",  # parallel block: residual added twice
    "gelu_new_const_typo",  # gelu_new written with sqrt(2)/pi instead of sqrt(2/pi)
    "quick_gelu",  # x*sigmoid(1.702x) used for gelu_new
    "fc_out_from_fc_in_T",  # fc_out uses fc_in.weight transposed (loader key typo)
    "lm_head_bias_dropped",  # lm_head bias not applied
    "pad_mask_raw_01_added",  # 0/1 attention_mask added to the scores as-is
    "pad_neg_inf_nan",  # padding masked with -inf -> fully-masked pad rows give NaN that leaks
]
PADDING_ONLY = {"pad_mask_raw_01_added", "pad_neg_inf_nan"}
CLEAN = ["clean_complex_rotary", "clean_where_prescaled"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


def sinusoids(n_pos, rot, denom):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / denom))
    ang = torch.arange(n_pos, dtype=torch.float32)[:, None] * inv_freq[None]
    return ang.sin(), ang.cos()


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    if BUG == "rotate_every_two_sign":
        return torch.stack((x2, -x1), dim=-1).flatten(-2)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x, sin, cos):
    # x (B,T,H,rot); sin/cos (B,T,rot/2)
    if BUG == "clean_complex_rotary":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        r = torch.view_as_real(z * torch.complex(cos, sin)[:, :, None])
        return r.flatten(-2)
    if BUG == "sincos_tiled_not_interleaved":
        sin = sin.repeat(1, 1, 2)[:, :, None]
        cos = cos.repeat(1, 1, 2)[:, :, None]
    else:
        sin = sin.repeat_interleave(2, dim=-1)[:, :, None]
        cos = cos.repeat_interleave(2, dim=-1)[:, :, None]
    return x * cos + rotate_every_two(x) * sin


def layer_norm(mod, x):
    if BUG == "layernorm_bf16":
        return F.layer_norm(
            x.bfloat16(), mod.normalized_shape, mod.weight.bfloat16(), mod.bias.bfloat16(), mod.eps
        ).float()
    return mod(x)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        E = cfg.n_embd
        self.n_head = cfg.n_head
        self.head_dim = E // cfg.n_head
        self.rot = cfg.rotary_dim or self.head_dim
        self.attn_pdrop = cfg.attn_pdrop
        self.q_proj = nn.Linear(E, E, bias=False)
        self.k_proj = nn.Linear(E, E, bias=False)
        self.v_proj = nn.Linear(E, E, bias=False)
        self.out_proj = nn.Linear(E, E, bias=False)
        n = cfg.n_positions
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)
        self.register_buffer(
            "mask_add", torch.zeros(n, n).masked_fill(~causal, torch.finfo(torch.float32).min), persistent=False
        )
        s, c = sinusoids(n, self.rot, self.rot)
        self.register_buffer("sin_tab", s, persistent=False)
        self.register_buffer("cos_tab", c, persistent=False)
        self.name = ""

    def tables(self):
        if BUG == "rotary_freq_denominator_head_dim":
            return sinusoids(self.sin_tab.shape[0], self.rot, self.head_dim)
        return self.sin_tab, self.cos_tab

    def forward(self, x, position_ids, key_mask):
        B, T, E = x.shape
        H, D, R = self.n_head, self.head_dim, self.rot
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        _rec(self.name + ".q_proj", q)
        _rec(self.name + ".k_proj", k)
        _rec(self.name + ".v_proj", v)
        q, k, v = q.view(B, T, H, D), k.view(B, T, H, D), v.view(B, T, H, D)
        sin, cos = self.tables()
        sin, cos = sin[position_ids], cos[position_ids]
        q = torch.cat([apply_rotary(q[..., :R], sin, cos), q[..., R:]], dim=-1)
        k = torch.cat([apply_rotary(k[..., :R], sin, cos), k[..., R:]], dim=-1)
        if BUG == "rotary_on_value":
            v = torch.cat([apply_rotary(v[..., :R], sin, cos), v[..., R:]], dim=-1)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        qf, kf = q.float(), k.float()
        if BUG == "clean_where_prescaled":
            w = (qf / math.sqrt(D)) @ kf.transpose(-1, -2)
            allowed = self.causal[:T, :T][None, None]
            if key_mask is not None:
                allowed = allowed & key_mask[:, None, None, :].bool()
            w = w.masked_fill(~allowed, torch.finfo(w.dtype).min)
        else:
            w = qf @ kf.transpose(-1, -2)
            if BUG == "causal_buffer_bottom_rows":
                w = w + self.mask_add[-T:, :T]
            else:
                w = w + self.mask_add[:T, :T]
            w = w / math.sqrt(D)
            if key_mask is not None:
                if BUG == "pad_mask_raw_01_added":
                    w = w + key_mask[:, None, None, :].float()
                elif BUG == "pad_neg_inf_nan":
                    w = w.masked_fill(~key_mask[:, None, None, :].bool(), float("-inf"))
                    w = w.masked_fill(~self.causal[:T, :T], float("-inf"))
                else:
                    w = w + (1.0 - key_mask[:, None, None, :].float()) * torch.finfo(w.dtype).min
        p = torch.softmax(w, dim=-1).to(v.dtype)
        if BUG == "functional_dropout_in_eval":
            p = F.dropout(p, self.attn_pdrop)
        o = (p @ v).permute(0, 2, 1, 3).reshape(B, T, E)
        o = self.out_proj(o)
        _rec(self.name + ".out_proj", o)
        _rec(self.name, o)
        return o


def gelu_new(x):
    c = math.sqrt(2.0) / math.pi if BUG == "gelu_new_const_typo" else math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.fc_in = nn.Linear(cfg.n_embd, inner)
        self.fc_out = nn.Linear(inner, cfg.n_embd)
        self.name = ""

    def forward(self, x):
        h = self.fc_in(x)
        _rec(self.name + ".fc_in", h)
        h = (h * torch.sigmoid(1.702 * h)) if BUG == "quick_gelu" else gelu_new(h)
        _rec(self.name + ".act", h)
        if BUG == "fc_out_from_fc_in_T":
            h = F.linear(h, self.fc_in.weight.t(), self.fc_out.bias)
        else:
            h = self.fc_out(h)
        _rec(self.name + ".fc_out", h)
        _rec(self.name, h)
        return h


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.name = ""

    def forward(self, x, position_ids, key_mask):
        residual = x
        h = layer_norm(self.ln_1, x)
        _rec(self.name + ".ln_1", h)
        a = self.attn(h, position_ids, key_mask)
        m = self.mlp(a if BUG == "mlp_reads_attn_output" else h)
        out = a + m + residual
        if BUG == "residual_added_twice":
            out = out + residual
        _rec(self.name, out)
        return out


class GPTJPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.transformer.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.transformer.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=True)
        for i, b in enumerate(self.transformer.h):
            b.name = f"transformer.h.{i}"
            b.attn.name = b.name + ".attn"
            b.mlp.name = b.name + ".mlp"

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        x = self.transformer.wte(input_ids)
        _rec("transformer.wte", x)
        if REC is not None:  # HF's rotary_emb returns (sin, cos), each (B, T, rotary_dim/2)
            _rec("transformer.rotary_emb", self.transformer.h[0].attn.tables()[0][position_ids])
        for b in self.transformer.h:
            x = b(x, position_ids, attention_mask)
        x = layer_norm(self.transformer.ln_f, x)
        _rec("transformer.ln_f", x)
        if BUG == "lm_head_bias_dropped":
            logits = F.linear(x, self.lm_head.weight)
        else:
            logits = self.lm_head(x)
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    m = GPTJPort(config)
    m.load_state_dict(
        {k: v for k, v in state_dict.items() if not k.endswith((".attn.bias", ".masked_bias"))}, strict=True
    )
    return m.eval()
