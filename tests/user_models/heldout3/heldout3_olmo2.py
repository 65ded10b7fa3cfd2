"""A from-scratch OLMo 2 in plain PyTorch.

Layout choices (mine, not Transformers'):
  * projections `to_q`, `to_k`, `to_v`, `to_out`; Q/K norms `qn`, `kn` (over the whole projection);
    norms hold their weight as `w`;
  * the block is OLMo 2's "norm after each branch": x + post_attn(attn(x)), then + post_ff(ff(.));
  * attention is a flash-style loop over key chunks (online softmax), no (t, t) probability matrix;
  * a left-padded batch is unpadded: its real tokens are packed into one sequence (documents kept
    apart by the mask), run, and the logits scattered back to (batch, seq);
  * the final norm is a function applied with the model's `ln_out.w`.

build(state_dict, config) -> OlmoLM;  OlmoLM.forward(input_ids, attention_mask=None, position_ids=None) -> logits
"""

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
_PACK = None  # (batch, seq, flat indices of the real tokens) while a packed batch runs
CHUNK = 16
CLIP_QKV = 8.0


def _t(name, x):
    if TRACE is not None:
        rec = x
        if _PACK is not None:  # record in the caller's (batch, seq) layout
            b, t, idx = _PACK
            full = x.new_zeros((b * t,) + tuple(x.shape[2:]))
            full[idx] = x[0]
            rec = full.view((b, t) + tuple(x.shape[2:]))
        TRACE[name] = rec
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.w, self.eps)


def rms_norm(x, w, eps):
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h).to(dt)


def _rms_groups(x, w, eps, groups):
    # RMS statistic per group of features (one group per tensor-parallel shard)
    dt = x.dtype
    h = x.to(torch.float32)
    hs = h.view(*h.shape[:-1], groups, -1)
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
    return (w * hs.reshape(h.shape)).to(dt)


def rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def chunked_attention(q, k, v, scale, keep_fn, chunk):
    """softmax(q k^T * scale + mask) v over key chunks, with a running max and denominator."""
    b, h, t, d = q.shape
    neg = torch.finfo(q.dtype).min
    m = q.new_full((b, h, t, 1), neg)
    denom = q.new_zeros((b, h, t, 1))
    acc = q.new_zeros((b, h, t, d))
    for c0 in range(0, k.shape[2], chunk):
        kc, vc = k[:, :, c0 : c0 + chunk], v[:, :, c0 : c0 + chunk]
        s = torch.matmul(q, kc.transpose(2, 3)) * scale
        causal, other = keep_fn(c0, kc.shape[2])
        if BUG == "mult_causal_mask":
            s = s * causal.to(s.dtype)
            s = s.masked_fill(~other, neg)
        else:
            s = s.masked_fill(~(causal & other), neg)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        if BUG == "online_no_rescale":
            denom = denom + p.sum(-1, keepdim=True)
            acc = acc + torch.matmul(p, vc)
        else:
            alpha = torch.exp(m - m_new)
            denom = denom * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vc)
        m = m_new
    return acc / denom


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        d = cfg.hidden_size
        self.to_q = nn.Linear(d, self.nh * self.hd, bias=False)
        self.to_k = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.to_v = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.to_out = nn.Linear(self.nh * self.hd, d, bias=False)
        self.qn = RMSNorm(self.nh * self.hd, cfg.rms_norm_eps)
        self.kn = RMSNorm(self.nkv * self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, keep_fn, li, post_norm=None):
        b, t, _ = x.shape
        H, KV, D = self.nh, self.nkv, self.hd
        q = _t(f"{li}.q", self.to_q(x))
        k = _t(f"{li}.k", self.to_k(x))
        v = _t(f"{li}.v", self.to_v(x))
        if BUG == "clip_qkv":
            q, k, v = (z.clamp(-CLIP_QKV, CLIP_QKV) for z in (q, k, v))
        if BUG == "qknorm_tp_shard":
            q = _rms_groups(q, self.qn.w, self.qn.eps, 2)
            k = _rms_groups(k, self.kn.w, self.kn.eps, 2)
        elif BUG == "qknorm_joint":
            both = torch.cat([q, k], -1).to(torch.float32)
            r = torch.rsqrt(both.pow(2).mean(-1, keepdim=True) + self.qn.eps)
            q = (self.qn.w * (q.to(torch.float32) * r)).to(x.dtype)
            k = (self.kn.w * (k.to(torch.float32) * r)).to(x.dtype)
        else:
            q = self.qn(q)
            k = self.kn(k)
        if BUG == "knorm_on_v":
            v = self.kn(v)
        _t(f"{li}.qn", q)
        _t(f"{li}.kn", k)
        q = q.view(b, t, H, D).transpose(1, 2)
        k = k.view(b, t, KV, D).transpose(1, 2)
        v = v.view(b, t, KV, D).transpose(1, 2)
        q = tap(q * cos + rotate_half(q) * sin, "q_rot")
        k = tap(k * cos + rotate_half(k) * sin, "k_rot")
        rep = H // KV
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        chunk = 8 if BUG == "clean_sumorder" else CHUNK
        ctx = chunked_attention(q, k, v, D**-0.5, keep_fn, chunk)
        ctx = ctx.transpose(1, 2).reshape(b, t, H * D)
        _t(f"{li}.ctx", ctx)
        if BUG == "postnorm_before_oproj":
            ctx = post_norm(ctx)
        return _t(f"{li}.attn", self.to_out(ctx))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.fc_gate = nn.Linear(d, f, bias=False)
        self.fc_up = nn.Linear(d, f, bias=False)
        self.fc_down = nn.Linear(f, d, bias=False)

    def forward(self, x, li):
        g = _t(f"{li}.gate", (self.fc_up if BUG == "mlp_up_twice" else self.fc_gate)(x))
        u = _t(f"{li}.up", self.fc_up(x))
        if BUG == "silu_exp_clamp":
            # fp16-safe SiLU: keep exp() from overflowing
            h = g / (1 + torch.exp((-g).clamp(max=10.0))) * u
        else:
            h = F.silu(g) * u
        _t(f"{li}.hid", h)
        return _t(f"{li}.ffn", self.fc_down(h))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn = Attention(cfg)
        self.post_attn = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ff = FeedForward(cfg)
        self.post_ff = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, keep_fn, li):
        a = self.attn(x, cos, sin, keep_fn, li, post_norm=self.post_attn)
        if BUG == "postnorm_before_oproj":
            an = a
        elif BUG == "postnorm_on_sum":
            an = None
            h = _t(f"{li}.attn_n", self.post_attn(x + a))
        else:
            an = _t(f"{li}.attn_n", self.post_attn(a))
        if an is not None:
            h = x + an
        f = self.ff(an if BUG == "mlp_reads_branch" else h, li)
        if BUG == "postnorm_on_sum":
            return _t(f"{li}.out", _t(f"{li}.ffn_n", self.post_ff(h + f)))
        return _t(f"{li}.out", h + _t(f"{li}.ffn_n", self.post_ff(f)))


class OlmoLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.ln_out = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _final_norm(self, x):
        return rms_norm(x, self.ln_out.w, self.ln_out.eps)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        global _PACK
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        if attention_mask is not None:
            # unpad: all real tokens in one sequence, each row a document
            flat = attention_mask.reshape(-1).bool()
            idx = flat.nonzero().squeeze(-1)
            ids = input_ids.reshape(-1)[idx][None]
            pos = position_ids.reshape(-1)[idx][None]
            doc = torch.arange(b, device=idx.device).repeat_interleave(t)[idx][None]
            _PACK = (b, t, idx)
        else:
            ids, pos, doc = input_ids, position_ids, None
        try:
            logits = self._run(ids, pos, doc)
        finally:
            _PACK = None
        if attention_mask is None:
            return logits
        out = logits.new_zeros(b * t, logits.shape[-1])
        if BUG == "repad_wrong_side":
            lens = attention_mask.sum(-1)
            dest = torch.cat([r * t + torch.arange(int(n)) for r, n in enumerate(lens)])
        else:
            dest = idx
        out[dest] = logits[0]
        return out.view(b, t, -1)

    def _run(self, ids, pos, doc):
        n = ids.shape[1]
        x = _t("emb", self.wte(ids))
        freqs = pos[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
        qpos = torch.arange(n, device=ids.device)

        def keep_fn(c0, width):
            kpos = (0 if BUG == "chunk_mask_local_index" else c0) + torch.arange(width, device=ids.device)
            causal = (kpos[None, :] <= qpos[:, None])[None, None]
            if doc is None or BUG == "packed_no_doc_mask":
                other = torch.ones_like(causal)
            else:
                other = (doc[:, :, None] == doc[:, None, c0 : c0 + width])[:, None]
            return causal, other

        for li, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, keep_fn, li)
        x = _t("final", self._final_norm(x))
        if BUG == "head_fp16":
            # the 256-row head kept in half precision
            return _t("head", F.linear(x.to(torch.float16), self.head.weight.to(torch.float16)).to(x.dtype))
        return _t("head", self.head(x))


def build(state_dict, config):
    sd = state_dict
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = OlmoLM(config)
    P = lambda t: nn.Parameter(t, requires_grad=False)
    model.wte.weight = P(sd["model.embed_tokens.weight"])
    for i, blk in enumerate(model.blocks):
        p = f"model.layers.{i}."
        a = blk.attn
        a.to_q.weight = P(sd[p + "self_attn.q_proj.weight"])
        a.to_k.weight = P(sd[p + "self_attn.k_proj.weight"])
        a.to_v.weight = P(sd[p + "self_attn.v_proj.weight"])
        a.to_out.weight = P(sd[p + "self_attn.o_proj.weight"])
        a.qn.w = P(sd[p + "self_attn.q_norm.weight"])
        a.kn.w = P(sd[p + "self_attn.k_norm.weight"])
        blk.post_attn.w = P(sd[p + "post_attention_layernorm.weight"])
        blk.post_ff.w = P(sd[p + "post_feedforward_layernorm.weight"])
        blk.ff.fc_gate.weight = P(sd[p + "mlp.gate_proj.weight"])
        blk.ff.fc_up.weight = P(sd[p + "mlp.up_proj.weight"])
        blk.ff.fc_down.weight = P(sd[p + "mlp.down_proj.weight"])
    model.ln_out.w = P(sd["model.norm.weight"])
    model.head.weight = P(sd["lm_head.weight"])
    return model.eval()
