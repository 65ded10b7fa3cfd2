"""StarCoder2 decoder from scratch: LayerNorm(+bias) pre-norm blocks, fused QKV projection,
GQA attention over a (batch*heads) layout with torch.bmm, sliding-window causal mask,
RoPE (NeoX halves), GELU(tanh) MLP with biases, output head tied or not per config.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "qkv_split_kv_swapped",
    "qkv_bias_q_only",
    "window_off_by_one",
    "window_ignored",
    "gelu_exact",
    "bmm_reshape_no_transpose",
    "mask_fill_zero",
    "ln2_bias_dropped",
    "o_bias_dropped",
    "lm_head_tied",
    "final_norm_missing",
    "rope_angles_bf16",
    "embed_scaled_sqrt_d",
    "residual_from_normed",
    "pad_right_assumed",
]
PADDING_ONLY = ["pad_right_assumed"]
CLEAN = ["clean_baddbmm", "clean_gelu_manual"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


def gelu_tanh(x):
    if BUG == "gelu_exact":
        return F.gelu(x)
    if BUG == "clean_gelu_manual":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    return F.gelu(x, approximate="tanh")


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or d // self.nh
        self.window = cfg.sliding_window
        self.ln_1 = nn.LayerNorm(d, eps=cfg.norm_epsilon)
        self.qkv = nn.Linear(d, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.use_bias)
        self.o = nn.Linear(self.nh * self.hd, d, bias=cfg.use_bias)
        self.ln_2 = nn.LayerNorm(d, eps=cfg.norm_epsilon)
        self.fc = nn.Linear(d, cfg.intermediate_size, bias=cfg.use_bias)
        self.proj = nn.Linear(cfg.intermediate_size, d, bias=cfg.use_bias)

    def to_bh(self, t, n):
        """(B, T, n*hd) -> (B*n, T, hd)"""
        B, T, _ = t.shape
        if BUG == "bmm_reshape_no_transpose":
            return t.reshape(B * n, T, self.hd)
        return t.view(B, T, n, self.hd).transpose(1, 2).reshape(B * n, T, self.hd)

    def attention(self, x, cos, sin, allowed, name):
        B, T, _ = x.shape
        fused = self.qkv(x)
        sizes = [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd]
        if BUG == "qkv_split_kv_swapped":
            q, v, k = fused.split(sizes, dim=-1)
        else:
            q, k, v = fused.split(sizes, dim=-1)
        _rec(name + ".q_proj", q)
        _rec(name + ".k_proj", k)
        _rec(name + ".v_proj", v)
        q, k, v = self.to_bh(q, self.nh), self.to_bh(k, self.nkv), self.to_bh(v, self.nkv)
        # rotary (cos/sin: (B, T, hd) -> per (batch*head))
        q = q * cos.repeat_interleave(self.nh, 0) + rotate_half(q) * sin.repeat_interleave(self.nh, 0)
        k = k * cos.repeat_interleave(self.nkv, 0) + rotate_half(k) * sin.repeat_interleave(self.nkv, 0)
        g = self.nh // self.nkv
        # (B*nkv, T, hd) -> (B*nh, T, hd): each kv head serves g consecutive query heads
        k = k.view(B, self.nkv, T, self.hd).repeat_interleave(g, dim=1).reshape(B * self.nh, T, self.hd)
        v = v.view(B, self.nkv, T, self.hd).repeat_interleave(g, dim=1).reshape(B * self.nh, T, self.hd)
        ok = allowed.repeat_interleave(self.nh, 0)  # (B*nh, T, T)
        scale = 1.0 / math.sqrt(self.hd)
        if BUG == "clean_baddbmm":
            bias = torch.zeros(ok.shape, dtype=q.dtype).masked_fill(~ok, torch.finfo(q.dtype).min)
            scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)) * scale
            fill = 0.0 if BUG == "mask_fill_zero" else torch.finfo(scores.dtype).min
            scores = scores.masked_fill(~ok, fill)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, v)  # (B*nh, T, hd)
        if BUG == "bmm_reshape_no_transpose":
            out = out.reshape(B, T, self.nh * self.hd)
        else:
            out = out.view(B, self.nh, T, self.hd).transpose(1, 2).reshape(B, T, self.nh * self.hd)
        out = self.o(out)
        _rec(name + ".o_proj", out)
        _rec(name, out)
        return out

    def forward(self, x, cos, sin, allowed, name):
        h = self.ln_1(x)
        _rec(name + ".input_layernorm", h)
        residual = h if BUG == "residual_from_normed" else x
        x = residual + self.attention(h, cos, sin, allowed, name + ".self_attn")
        h = self.ln_2(x)
        _rec(name + ".post_attention_layernorm", h)
        a = self.fc(h)
        _rec(name + ".mlp.c_fc", a)
        a = gelu_tanh(a)
        _rec(name + ".mlp.act", a)
        m = self.proj(a)
        _rec(name + ".mlp.c_proj", m)
        _rec(name + ".mlp", m)
        x = x + m
        _rec(name, x)
        return x


def rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat([-t[..., half:], t[..., :half]], dim=-1)


class StarCoder2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.theta = cfg.rope_parameters["rope_theta"]
        self.window = cfg.sliding_window

    def rope(self, pos):
        inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)
        if BUG == "rope_angles_bf16":
            ang = (pos[..., None].to(torch.bfloat16) * inv.to(torch.bfloat16)).float()
        else:
            ang = pos[..., None].float() * inv
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()

    def allowed(self, attention_mask, B, T):
        i = torch.arange(T)
        q, k = i[:, None], i[None, :]
        ok = k <= q
        if self.window is not None and BUG != "window_ignored":
            if BUG == "window_off_by_one":
                ok = ok & (q - k <= self.window)
            else:
                ok = ok & (q - k < self.window)
        ok = ok[None].expand(B, T, T)
        if attention_mask is not None:
            if BUG == "pad_right_assumed":
                lengths = attention_mask.sum(-1)
                keep = i[None, :] < lengths[:, None]
            else:
                keep = attention_mask.bool()
            ok = ok & keep[:, None, :]
        return ok

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T).expand(B, T)
        x = self.embed(input_ids)
        if BUG == "embed_scaled_sqrt_d":
            x = x * math.sqrt(x.shape[-1])
        _rec("model.embed_tokens", x)
        cos, sin = self.rope(position_ids)
        _rec("model.rotary_emb", cos)
        ok = self.allowed(attention_mask, B, T)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ok, f"model.layers.{i}")
        if BUG != "final_norm_missing":
            x = self.ln_f(x)
        _rec("model.norm", x)
        logits = self.lm_head(x)
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    model = StarCoder2(config)
    sd = state_dict
    own = {
        "embed.weight": sd["model.embed_tokens.weight"],
        "ln_f.weight": sd["model.norm.weight"],
        "ln_f.bias": sd["model.norm.bias"],
    }
    tied = config.tie_word_embeddings or "lm_head.weight" not in sd or BUG == "lm_head_tied"
    own["lm_head.weight"] = sd["model.embed_tokens.weight"] if tied else sd["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"layers.{i}."
        own[b + "qkv.weight"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
        if config.use_bias:
            qb = sd[p + "self_attn.q_proj.bias"]
            kb, vb = sd[p + "self_attn.k_proj.bias"], sd[p + "self_attn.v_proj.bias"]
            if BUG == "qkv_bias_q_only":
                kb, vb = torch.zeros_like(kb), torch.zeros_like(vb)
            own[b + "qkv.bias"] = torch.cat([qb, kb, vb], dim=0)
            own[b + "o.bias"] = sd[p + "self_attn.o_proj.bias"]
            if BUG == "o_bias_dropped":
                own[b + "o.bias"] = torch.zeros_like(own[b + "o.bias"])
            own[b + "fc.bias"] = sd[p + "mlp.c_fc.bias"]
            own[b + "proj.bias"] = sd[p + "mlp.c_proj.bias"]
        own[b + "o.weight"] = sd[p + "self_attn.o_proj.weight"]
        own[b + "fc.weight"] = sd[p + "mlp.c_fc.weight"]
        own[b + "proj.weight"] = sd[p + "mlp.c_proj.weight"]
        for mine, hf in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            own[b + mine + ".weight"] = sd[p + hf + ".weight"]
            own[b + mine + ".bias"] = sd[p + hf + ".bias"]
        if BUG == "ln2_bias_dropped":
            own[b + "ln_2.bias"] = torch.zeros_like(own[b + "ln_2.bias"])
    model.load_state_dict(own, strict=True)
    return model.eval()
