"""A from-scratch Qwen2 in plain PyTorch.

Layout choices (mine, not Transformers'):
  * one fused `qkv` projection without bias; the q/k/v biases are kept per head
    (`bq` [heads, head_dim], `bk`/`bv` [kv_heads, head_dim]) and added after the head split;
  * one fused `w13` = [gate; up] and `w2` for the SwiGLU;
  * RMSNorm's parameter is called `g`;
  * attention and RoPE are plain functions.

build(state_dict, config) -> QwenLM;  QwenLM.forward(input_ids, attention_mask=None, position_ids=None) -> logits
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # optional: lets parity see q/k after RoPE
    from parity import tap
except Exception:  # pragma: no cover

    def tap(x, name, **kw):
        return x


BUG = os.environ.get("BUG", "")
TRACE = None  # debugging aid: set to a dict to record intermediate values


def _t(name, x):
    if TRACE is not None:
        TRACE[name] = x
    return x


# ----------------------------------------------------------------------------- pieces
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.g = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        if BUG == "rms_weight_before_norm":
            h = self.g * h
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        if BUG == "rms_weight_before_norm":
            return h.to(dt)
        return self.g * h.to(dt)


def rope_tables(position_ids, inv_freq, dtype):
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x, cos, sin):
    # x: (b, h, t, d); cos/sin: (b, t, d)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


LOG2E = 1.4427  # for the exp2 path below


def softmax_keys(scores):
    """Softmax over the keys, in float32."""
    if BUG == "exp2_log2e_rounded":
        # exp(x) == 2 ** (x * log2(e)), as fast attention kernels do it
        s = scores.float()
        s = (s - s.amax(-1, keepdim=True)) * LOG2E
        e = torch.exp2(s)
        return e / e.sum(-1, keepdim=True)
    if BUG == "softmax_max_qaxis":
        s = scores.float()
        e = torch.exp(s - s.amax(-2, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    return F.softmax(scores, dim=-1, dtype=torch.float32)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        d = cfg.hidden_size
        self.qkv = nn.Linear(d, (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.bq = nn.Parameter(torch.zeros(self.nh, self.hd))
        self.bk = nn.Parameter(torch.zeros(self.nkv, self.hd))
        self.bv = nn.Parameter(torch.zeros(self.nkv, self.hd))
        self.out = nn.Linear(self.nh * self.hd, d, bias=False)
        self.scale = self.hd**-0.5

    def forward(self, x, cos, sin, mask, key_keep, li):
        b, t, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        if BUG == "scale_fold_bias":
            # fold the softmax scale into the q rows of the projection (saves a multiply on the scores)
            w = torch.cat([self.qkv.weight[:nq] * self.scale, self.qkv.weight[nq:]], 0)
            qkv = F.linear(x, w)
        else:
            qkv = self.qkv(x)
        q, k, v = qkv.split([nq, nk, nk], dim=-1)
        q = q.view(b, t, self.nh, self.hd)
        k = k.view(b, t, self.nkv, self.hd)
        v = v.view(b, t, self.nkv, self.hd)
        if BUG != "v_bias_gqa_tile":
            v = v + self.bv
        if BUG != "bias_after_rope":
            q = q + self.bq
            k = k + self.bk
        _t(f"{li}.q", q.reshape(b, t, nq))
        _t(f"{li}.k", k.reshape(b, t, nk))
        _t(f"{li}.v", v.reshape(b, t, nk))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = rotate(q, cos, sin)
        k = rotate(k, cos, sin)
        if BUG == "bias_after_rope":
            q = q + self.bq[:, None]
            k = k + self.bk[:, None]
        q = tap(q, "q_rot")
        k = tap(k, "k_rot")
        # grouped-query attention: each kv head serves nh // nkv consecutive query heads
        rep = self.nh // self.nkv
        k = k[:, :, None].expand(b, self.nkv, rep, t, self.hd).reshape(b, self.nh, t, self.hd)
        v = v[:, :, None].expand(b, self.nkv, rep, t, self.hd).reshape(b, self.nh, t, self.hd)
        if BUG == "v_bias_gqa_tile":
            # v bias added once the kv heads are replicated to all query heads
            v = v + self.bv.repeat(rep, 1)[None, :, None, :]

        if BUG == "scale_fold_bias":
            scores = torch.matmul(q, k.transpose(2, 3))
        elif BUG == "clean_sumorder":
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = scores + mask
        if BUG == "pad_additive01" and key_keep is not None:
            # the 0/1 padding mask given to attention as a float mask
            scores = scores + key_keep[:, None, None, :].to(scores.dtype)
        probs = softmax_keys(scores).to(q.dtype)
        if BUG == "pad_mask_after_softmax" and key_keep is not None:
            probs = probs * key_keep[:, None, None, :].to(probs.dtype)
        if BUG == "clean_vbias_late":
            # the v bias commutes with attention: probabilities sum to one per row
            vv = v - self.bv.repeat_interleave(rep, 0)[None, :, None, :]
            ctx = torch.matmul(probs, vv) + self.bv.repeat_interleave(rep, 0)[None, :, None, :]
        elif BUG == "clean_sumorder":
            ctx = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        else:
            ctx = torch.matmul(probs, v)
        ctx = ctx.transpose(1, 2).reshape(b, t, nq)
        _t(f"{li}.ctx", ctx)
        if BUG == "clean_sumorder":
            # o-projection head by head, summed
            w = self.out.weight.view(-1, self.nh, self.hd)
            out = sum(F.linear(ctx[..., h * self.hd : (h + 1) * self.hd], w[:, h]) for h in range(self.nh))
        else:
            out = self.out(ctx)
        return _t(f"{li}.attn", out)


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, li):
        gu = self.w13(x)
        g, u = gu.split(self.inter, dim=-1)
        _t(f"{li}.gate", g)
        _t(f"{li}.up", u)
        if BUG == "mlp_up_dropped":
            h = F.silu(g)
        else:
            h = F.silu(g) * u
        _t(f"{li}.hid", h)
        if BUG == "mlp_chunk_tail":
            # memory saver: the down projection in chunks of the intermediate dimension
            c = 48
            out = None
            for i in range(self.inter // c):
                part = F.linear(h[..., i * c : (i + 1) * c], self.w2.weight[:, i * c : (i + 1) * c])
                out = part if out is None else out + part
        else:
            out = self.w2(h)
        return _t(f"{li}.ffn", out)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_attn = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mix = Attention(cfg)
        self.ln_mlp = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x, cos, sin, mask, key_keep, li):
        a = self.mix(_t(f"{li}.ln1", self.ln_attn(x)), cos, sin, mask, key_keep, li)
        h = x + a
        m = self.ffn(_t(f"{li}.ln2", self.ln_mlp(h)), li)
        if BUG == "stale_residual_mlp":
            return _t(f"{li}.out", x + m)
        out = h + m
        if BUG == "residual_bf16":
            out = out.to(torch.bfloat16).to(x.dtype)  # the stream kept in bf16 between blocks
        return _t(f"{li}.out", out)


class QwenLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if BUG == "layers_shared_instance":
            self.blocks = nn.ModuleList([Block(cfg)] * cfg.num_hidden_layers)
        else:
            self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm_out = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.unembed = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        x = _t("emb", self.tok(input_ids))
        cos, sin = rope_tables(position_ids, self.inv_freq, x.dtype)
        keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
        key_keep = None
        if attention_mask is not None:
            key_keep = attention_mask.bool()
            if BUG not in ("pad_additive01", "pad_mask_after_softmax"):
                keep = keep & key_keep[:, None, None, :]
        mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, torch.finfo(x.dtype).min)
        for li, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, mask, key_keep, li)
        if BUG == "final_norm_twice":
            x = self.norm_out(x)
        x = _t("final", self.norm_out(x))
        if BUG == "head_shards_swapped":
            # vocab-parallel head: two shards, gathered
            half = self.unembed.weight.shape[0] // 2
            parts = [F.linear(x, self.unembed.weight[:half]), F.linear(x, self.unembed.weight[half:])]
            logits = torch.cat(parts[::-1], dim=-1)
        else:
            logits = self.unembed(x)
        _t("head", logits)
        if BUG == "returns_log_softmax":
            return torch.log_softmax(logits.float(), dim=-1)
        return logits


# ----------------------------------------------------------------------------- loading
def build(state_dict, config):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = QwenLM(config)
    sd = state_dict
    P = lambda t: nn.Parameter(t, requires_grad=False)
    model.tok.weight = P(sd["model.embed_tokens.weight"])
    for i, blk in enumerate(model.blocks):
        p = f"model.layers.{i}."
        at = blk.mix
        at.qkv.weight = P(
            torch.cat(
                [
                    sd[p + "self_attn.q_proj.weight"],
                    sd[p + "self_attn.k_proj.weight"],
                    sd[p + "self_attn.v_proj.weight"],
                ],
                0,
            )
        )
        at.bq = P(sd[p + "self_attn.q_proj.bias"].view(at.nh, at.hd))
        at.bk = P(sd[p + "self_attn.k_proj.bias"].view(at.nkv, at.hd))
        at.bv = P(sd[p + "self_attn.v_proj.bias"].view(at.nkv, at.hd))
        at.out.weight = P(sd[p + "self_attn.o_proj.weight"])
        blk.ffn.w13.weight = P(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], 0))
        blk.ffn.w2.weight = P(sd[p + "mlp.down_proj.weight"])
        blk.ln_attn.g = P(sd[p + "input_layernorm.weight"])
        blk.ln_mlp.g = P(sd[p + "post_attention_layernorm.weight"])
    model.norm_out.g = P(sd["model.norm.weight"])
    model.unembed.weight = P(sd["lm_head.weight"])
    return model.eval()
