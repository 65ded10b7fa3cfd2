"""Hand-written plain-PyTorch port of a Cohere2 / Command-A style (Cohere2ForCausalLM) causal LM.

Architecture as this port implements it:
  * token embedding, tied with the output head; logits = (final_norm(h) @ E^T) * logit_scale;
  * every block is a *parallel* block with one LayerNorm (mean-subtracted, weight only, no bias):
        n = LN(h);  h = h + Attn(n) + MLP(n)
  * hybrid attention: layers marked "sliding_attention" in config.layer_types use a causal sliding window
    (key j visible from query i when 0 <= i - j < sliding_window) and rotary embeddings; the
    "full_attention" layers are global and use NO positional encoding at all;
  * RoPE is the interleaved (GPT-J) form: channel pairs (2i, 2i+1) of each head are rotated by angle
    pos * theta^(-2i/head_dim);
  * GQA attention with softmax scale head_dim**-0.5; SwiGLU MLP silu(gate) * up -> down;
  * positions are 0..S-1 for every row (also with left padding); padding only enters through the key mask.

Weight layout of this port (own names, not the HF state-dict names):
  tok_emb (V, H); blocks[i].norm.gain (H,); blocks[i].attn.w_q / w_k / w_v as (in, out) matrices,
  blocks[i].attn.w_out (in, out); blocks[i].ffn.w_in = [gate | up] fused as one (H, 2I) matrix,
  blocks[i].ffn.w_out (I, H); final_norm.gain (H,); unembed (H, V) = E^T (a separate transposed copy).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "co_rope_half_split",  # Llama template RoPE: rotate_half over (i, i + d/2) with cat(freqs, freqs) on an interleaved-pair checkpoint
    "co_rope_freqs_catted",  # pairs rotated interleaved (2i, 2i+1) but cos/sin tables still built Llama-style with cat(freqs, freqs)
    "co_rope_on_global_layers",  # RoPE applied on every layer; the global (NoPE) layers get rotated too
    "co_rope_on_global_only",  # rotary condition inverted: global layers rotated, sliding-window layers left without positions
    "co_gemma2_alternating_layers",  # layer kinds re-derived with the Gemma-2 rule (even layers sliding, odd global) instead of config.layer_types
    "co_window_inclusive",  # sliding window written i - j <= window: each query sees window + 1 keys
    "co_window_on_global_layers",  # one sliding-window mask built and passed to every layer, global layers windowed too
    "co_sliding_mask_drops_padding",  # sliding mask built as causal & window only; the padding mask is combined into the global mask only
    "co_rmsnorm_template",  # Llama RMSNorm used for the block/final norm: mean not subtracted
    "co_sequential_residual",  # Llama sequential block: MLP reads LN(h + attn) instead of the same LN(h) as attention
    "co_logit_scale_missing",  # logit_scale (config, 0.25 here) not applied to the lm_head output
    "co_gate_up_swapped_at_fuse",  # loader fuses [up, gate] into w_in while the runtime splits it as (gate, up)
]
PADDING_ONLY = {"co_sliding_mask_drops_padding"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask (causal & padding & window)
    "fused_parallel_in_proj",  # q|k|v|gate|up packed into one (H, q+2kv+2I) matrix: both branches read the same LN output
    "rope_halfsplit_permuted",  # q/k rows permuted at load so interleaved pairs become (i, i + d/2); half-split rotate_half RoPE
    "logit_scale_folded",  # logit_scale multiplied into the unembedding matrix at load
    "varlen_unpad",  # each row's real tokens run alone (positions from 0), results scattered back into the padded batch
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _pairs_to_halves(n_heads, hd):
    """row order that moves interleaved pair (2i, 2i+1) of each head to (i, i + hd/2)"""
    idx = []
    for h in range(n_heads):
        base = h * hd
        idx += [base + 2 * i for i in range(hd // 2)] + [base + 2 * i + 1 for i in range(hd // 2)]
    return torch.tensor(idx)


class MeanNorm(nn.Module):
    """LayerNorm without bias: (x - mean) / sqrt(var + eps) * gain"""

    def __init__(self, w, eps):
        super().__init__()
        self.gain = _P(w)
        self.eps = eps

    def forward(self, x):
        if _bug() == "co_rmsnorm_template":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        return xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain


class Rotary(nn.Module):
    def __init__(self, hd, theta):
        super().__init__()
        self.hd = hd
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)), persistent=False
        )

    def tables(self, pos):
        b = _bug()
        ang = pos[..., None].float() * self.inv_freq  # (B, S, hd/2)
        if b in ("co_rope_half_split", "co_rope_freqs_catted", "rope_halfsplit_permuted"):
            ang = torch.cat((ang, ang), -1)
        else:
            ang = ang.repeat_interleave(2, -1)
        return ang.cos(), ang.sin()

    @staticmethod
    def apply(x, cos, sin):
        """x (B, heads, S, hd); cos/sin (B, S, hd)"""
        cos, sin = cos[:, None], sin[:, None]
        if _bug() in ("co_rope_half_split", "rope_halfsplit_permuted"):
            h = x.shape[-1] // 2
            rot = torch.cat((-x[..., h:], x[..., :h]), -1)
        else:
            ev, od = x[..., 0::2], x[..., 1::2]
            rot = torch.stack((-od, ev), -1).flatten(-2)
        return x * cos + rot * sin


class SelfAttention(nn.Module):
    def __init__(self, sd, pre, cfg, idx, rope_here):
        super().__init__()
        b = _bug()
        self.idx = idx
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.nh
        self.rope_here = rope_here
        wq, wk, wv = sd[pre + "q_proj.weight"], sd[pre + "k_proj.weight"], sd[pre + "v_proj.weight"]
        if b == "rope_halfsplit_permuted":
            wq = wq[_pairs_to_halves(self.nh, self.hd)]
            wk = wk[_pairs_to_halves(self.nkv, self.hd)]
        self.w_q, self.w_k, self.w_v = _P(wq.t()), _P(wk.t()), _P(wv.t())
        self.w_out = _P(sd[pre + "o_proj.weight"].t())
        self.pre = pre

    def forward(self, x, allowed, cos, sin, qkv=None):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if qkv is None:
            q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v
        else:
            q, k, v = qkv
        if b != "rope_halfsplit_permuted":
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, nh, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        if self.rope_here:
            q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        g = nh // nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=hd**-0.5)
            # rows with no visible key (left pads) come back as NaN from SDPA: zero them, they are never read
            ctx = torch.nan_to_num(ctx)
        else:
            s = (q @ k.transpose(-1, -2)) * hd**-0.5
            s = s.masked_fill(~allowed, torch.finfo(torch.float32).min)
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nh * hd)
        out = ctx @ self.w_out
        _rec(self.pre + "o_proj", out)
        _rec(self.pre.rstrip("."), out)
        return out


class SwiGLU(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        g, u = sd[pre + "gate_proj.weight"], sd[pre + "up_proj.weight"]
        if _bug() == "co_gate_up_swapped_at_fuse":
            g, u = u, g
        self.inter = g.shape[0]
        self.w_in = _P(torch.cat((g, u), 0).t())
        self.w_out = _P(sd[pre + "down_proj.weight"].t())
        self.pre = pre

    def forward(self, x, gu=None):
        if gu is None:
            gu = x @ self.w_in
        g, u = gu.split(self.inter, -1)
        if _bug() != "co_gate_up_swapped_at_fuse":
            _rec(self.pre + "gate_proj", g)
            _rec(self.pre + "up_proj", u)
        y = (F.silu(g) * u) @ self.w_out
        _rec(self.pre + "down_proj", y)
        _rec(self.pre.rstrip("."), y)
        return y


class ParallelBlock(nn.Module):
    def __init__(self, sd, cfg, idx, sliding):
        super().__init__()
        b = _bug()
        pre = f"model.layers.{idx}."
        self.idx, self.sliding = idx, sliding
        if b == "co_rope_on_global_layers":
            rope_here = True
        elif b == "co_rope_on_global_only":
            rope_here = not sliding
        else:
            rope_here = sliding
        self.norm = MeanNorm(sd[pre + "input_layernorm.weight"], cfg.layer_norm_eps)
        self.attn = SelfAttention(sd, pre + "self_attn.", cfg, idx, rope_here)
        self.ffn = SwiGLU(sd, pre + "mlp.")
        if b == "fused_parallel_in_proj":
            a = self.attn
            self.w_fused = _P(torch.cat((a.w_q, a.w_k, a.w_v, self.ffn.w_in), 1))
            self.splits = [a.w_q.shape[1], a.w_k.shape[1], a.w_v.shape[1], self.ffn.w_in.shape[1]]
            del a.w_q, a.w_k, a.w_v, self.ffn.w_in
        self.pre = pre

    def forward(self, h, allowed, cos, sin):
        b = _bug()
        n = self.norm(h)
        _rec(self.pre + "input_layernorm", n)
        if b == "fused_parallel_in_proj":
            q, k, v, gu = (n @ self.w_fused).split(self.splits, -1)
            a = self.attn(n, allowed, cos, sin, qkv=(q, k, v))
            m = self.ffn(n, gu=gu)
        elif b == "co_sequential_residual":
            a = self.attn(n, allowed, cos, sin)
            m = self.ffn(self.norm(h + a))
        else:
            a = self.attn(n, allowed, cos, sin)
            m = self.ffn(n)
        out = h + a + m
        _rec(self.pre.rstrip("."), out)
        return out


class Cohere2Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        H = cfg.hidden_size
        self.hd = H // cfg.num_attention_heads
        self.window = cfg.sliding_window
        n = cfg.num_hidden_layers
        if b == "co_gemma2_alternating_layers":
            kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        else:
            kinds = list(cfg.layer_types)
        self.rotary = Rotary(self.hd, cfg.rope_parameters["rope_theta"])
        self.tok_emb = _P(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList(ParallelBlock(sd, cfg, i, kinds[i] == "sliding_attention") for i in range(n))
        self.final_norm = MeanNorm(sd["model.norm.weight"], cfg.layer_norm_eps)
        # tied head: the port keeps its own transposed copy of the embedding
        head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
        self.logit_scale = float(cfg.logit_scale)
        if b == "logit_scale_folded":
            self.unembed = _P(head.t() * self.logit_scale)
        else:
            self.unembed = _P(head.t())

    def _masks(self, keep, doc=None):
        b = _bug()
        S = keep.shape[1]
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        causal = j <= i
        if doc is not None:
            causal = causal & (doc[:, None] == doc[None, :])
        pad = keep[:, None, None, :]
        full = causal[None, None] & pad
        win = (i - j) <= self.window if b == "co_window_inclusive" else (i - j) < self.window
        if b == "co_sliding_mask_drops_padding":
            sliding = (causal & win)[None, None].expand_as(full)
        else:
            sliding = full & win[None, None]
        return full, sliding

    def _core(self, input_ids, keep, pos):
        b = _bug()
        full, sliding = self._masks(keep)
        h = self.tok_emb[input_ids]
        _rec("model.embed_tokens", h)
        cos, sin = self.rotary.tables(pos)
        if b not in ("co_rope_half_split", "co_rope_freqs_catted", "rope_halfsplit_permuted"):
            _rec("model.rotary_emb", cos)
        for blk in self.blocks:
            m = sliding if (blk.sliding or b == "co_window_on_global_layers") else full
            h = blk(h, m, cos, sin)
        h = self.final_norm(h)
        _rec("model.norm", h)
        logits = h @ self.unembed
        if b == "logit_scale_folded":
            return logits
        _rec("lm_head", logits)
        if b == "co_logit_scale_missing":
            return logits
        return logits * self.logit_scale

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)  # HF Cohere2: arange, padding is not skipped
        if b == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.unembed.shape[1])
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                n = ids.shape[1]
                logits[r, keep[r]] = self._core(ids, torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None])[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Cohere2Port(state_dict, config).eval()
