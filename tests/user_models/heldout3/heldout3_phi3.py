"""A from-scratch Phi-3 in plain PyTorch.

Layout choices (mine, not Transformers'):
  * q/k/v are three separate projections `wq`, `wk`, `wv` (Transformers fuses them in `qkv_proj`);
  * the MLP has separate `w_gate` and `w_up` (Transformers fuses `gate_up_proj`), and keeps the down
    projection as a transposed matrix `w_down` [intermediate, hidden] used as `h @ w_down`;
  * RMSNorm's parameter is `scale`; the final norm is applied by a helper of the model;
  * RoPE reads a cos/sin table precomputed for all positions; attention runs on a flattened
    (batch * heads, seq, head_dim) layout with `torch.bmm`.
  * weights are loaded with `load_state_dict` from a renamed dict.

build(state_dict, config) -> PhiLM;  PhiLM.forward(input_ids, attention_mask=None, position_ids=None) -> logits
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from parity import tap
except Exception:  # pragma: no cover

    def tap(x, name, **kw):
        return x


BUG = os.environ.get("BUG", "")
TRACE = None


def _t(name, x):
    if TRACE is not None:
        TRACE[name] = x
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        if BUG == "rms_sum_not_mean":
            var = h.pow(2).sum(-1, keepdim=True)
        else:
            var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.scale * h.to(dt)


def rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        d = cfg.hidden_size
        self.wq = nn.Linear(d, self.nh * self.hd, bias=False)
        self.wk = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.wv = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.wo = nn.Linear(self.nh * self.hd, d, bias=False)

    def forward(self, x, x_raw, cos, sin, mask, li, shared):
        b, t, _ = x.shape
        H, KV, D = self.nh, self.nkv, self.hd
        q = _t(f"{li}.q", self.wq(x))
        k = _t(f"{li}.k", self.wk(x_raw if BUG == "k_from_unnormed" else x))
        v = _t(f"{li}.v", self.wv(x))
        q = q.view(b, t, H, D).transpose(1, 2)
        k = k.view(b, t, KV, D).transpose(1, 2)
        v = v.view(b, t, KV, D).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if BUG == "cross_layer_kv":
            # k/v computed once and shared by the following layers
            if "kv" in shared:
                k, v = shared["kv"]
            else:
                shared["kv"] = (k, v)
        q = tap(q, "q_rot")
        k = tap(k, "k_rot")
        rep = H // KV
        k = k[:, :, None].expand(b, KV, rep, t, D).reshape(b * H, t, D)
        v = v[:, :, None].expand(b, KV, rep, t, D).reshape(b * H, t, D)
        q = q.reshape(b * H, t, D)
        if BUG == "clean_sumorder":
            scores = torch.einsum("nqd,nkd->nqk", q, k) * (D**-0.5)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)) * (D**-0.5)
        # the (batch, t, t) mask, one copy per head of each batch row
        if BUG == "mask_flatten_order":
            m = mask.repeat(H, 1, 1)
        else:
            m = mask.repeat_interleave(H, dim=0)
        scores = scores + m
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if BUG == "probs_floor":
            probs = probs.clamp_min(1e-6)  # keeps log(probs) finite for the attention-entropy diagnostic
        ctx = torch.bmm(probs, v).view(b, H, t, D).transpose(1, 2).reshape(b, t, H * D)
        _t(f"{li}.ctx", ctx)
        return _t(f"{li}.attn", self.wo(ctx))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = nn.Linear(d, f, bias=False)
        self.w_up = nn.Linear(d, f, bias=False)
        self.w_down = nn.Parameter(torch.empty(f, d))  # [in, out]
        nn.init.normal_(self.w_down, std=0.02)

    def _ffn(self, x, li):
        g = _t(f"{li}.gate", self.w_gate(x))
        u = _t(f"{li}.up", self.w_up(x))
        if BUG == "swiglu_limit":
            # clamp from a shared SwiGLU helper (default limit 7.0)
            g = g.clamp(max=7.0)
            u = u.clamp(min=-7.0, max=7.0)
        h = _t(f"{li}.hid", u * F.silu(g))
        if BUG == "clean_sumorder":
            f = h.shape[-1] // 2
            return h[..., :f] @ self.w_down[:f] + h[..., f:] @ self.w_down[f:]
        return h @ self.w_down

    def forward(self, x, li):
        if BUG == "mlp_token_chunk_tail":
            # bounded memory: the MLP over chunks of 16 tokens
            c = 16
            t = x.shape[1]
            out = torch.zeros_like(x)
            for s in range(0, t // c * c, c):
                out[:, s : s + c] = self._ffn(x[:, s : s + c], li)
            return _t(f"{li}.ffn", out)
        return _t(f"{li}.ffn", self._ffn(x, li))


class DecoderBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # branch scale (MiniCPM-style depth scaling; 1.0 for Phi-3)
        if BUG == "residual_scale_depth":
            self.res_scale = getattr(cfg, "scale_depth", 1.4) / math.sqrt(cfg.num_hidden_layers)
        else:
            self.res_scale = 1.0

    def forward(self, x, cos, sin, mask, li, shared):
        a = self.attn(_t(f"{li}.ln1", self.norm1(x)), x, cos, sin, mask, li, shared)
        h = x + a * self.res_scale if self.res_scale != 1.0 else x + a
        n2 = self.norm2(x if BUG == "fused_add_norm_stale" else h)
        m = self.mlp(_t(f"{li}.ln2", n2), li)
        out = h + m * self.res_scale if self.res_scale != 1.0 else h + m
        return _t(f"{li}.out", out)


class PhiLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.num_hidden_layers)])
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_rope_table(self, dtype):
        cfg = self.cfg
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(torch.float32) / hd))
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).to(dtype)
        ang = pos[:, None] * inv.to(dtype)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos_t", ang.cos(), persistent=False)
        self.register_buffer("sin_t", ang.sin(), persistent=False)

    def _final_norm(self, x):
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        if BUG == "final_norm_clamp_eps":
            h = h * torch.rsqrt(var.clamp_min(self.ln_f.eps))
        else:
            h = h * torch.rsqrt(var + self.ln_f.eps)
        return self.ln_f.scale * h.to(x.dtype)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        x = self.embed(input_ids)
        if x.dtype != self.lm_head.weight.dtype:
            x = x.to(self.lm_head.weight.dtype)
        _t("emb", x)
        if BUG == "rope_pos_row0":
            cos, sin = self.cos_t[position_ids[0]][None], self.sin_t[position_ids[0]][None]
        else:
            cos, sin = self.cos_t[position_ids], self.sin_t[position_ids]
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None].expand(b, t, t)
        if attention_mask is not None:
            keep = keep & attention_mask.bool()[:, None, :]
        mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, torch.finfo(x.dtype).min)
        shared = {}
        for li, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, li, shared)
        x = _t("final", self._final_norm(x))
        return _t("head", self.lm_head(x))


def build(state_dict, config):
    sd = state_dict
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = PhiLM(config)
    H, KV = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    F_ = config.intermediate_size
    mine = {
        "embed.weight": sd["model.embed_tokens.weight"],
        "ln_f.scale": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    if BUG == "embed_bf16":
        mine["embed.weight"] = sd["model.embed_tokens.weight"].to(torch.bfloat16)  # halve the table's memory
    for i in range(config.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        qkv = sd[p + "self_attn.qkv_proj.weight"]
        if BUG == "qkv_group_interleaved":
            # [q heads of group g; k_g; v_g] for each kv group g
            rep = H // KV
            grp = qkv.view(KV, (rep + 2) * D, -1)
            wq = grp[:, : rep * D].reshape(H * D, -1)
            wk = grp[:, rep * D : (rep + 1) * D].reshape(KV * D, -1)
            wv = grp[:, (rep + 1) * D :].reshape(KV * D, -1)
        else:
            wq, wk, wv = qkv.split([H * D, KV * D, KV * D], dim=0)
        mine[m + "attn.wq.weight"] = wq
        mine[m + "attn.wk.weight"] = wk
        mine[m + "attn.wv.weight"] = wv
        if BUG == "wo_not_loaded":
            mine[m + "attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        else:
            mine[m + "attn.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        gu = sd[p + "mlp.gate_up_proj.weight"]
        if BUG == "gate_up_interleaved":
            g, u = gu[0::2], gu[1::2]
        else:
            g, u = gu[:F_], gu[F_:]
        mine[m + "mlp.w_gate.weight"] = g
        mine[m + "mlp.w_up.weight"] = u
        dn = sd[p + "mlp.down_proj.weight"]
        mine[m + "mlp.w_down"] = dn.reshape(F_, -1) if BUG == "down_view_not_t" else dn.t()
        mine[m + "norm1.scale"] = sd[p + "input_layernorm.weight"]
        mine[m + "norm2.scale"] = sd[p + "post_attention_layernorm.weight"]
    dtype = sd["lm_head.weight"].dtype
    model.to(dtype)
    model.load_state_dict(mine, strict=False)  # strict=False: the rope tables are not in the checkpoint
    model.make_rope_table(dtype)
    return model.eval()
