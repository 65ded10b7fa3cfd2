"""Hand-written plain-PyTorch port of a Hunyuan dense V1 (HunYuanDenseV1ForCausalLM) causal LM.

Architecture as this port implements it:
  * token embedding (untied, separate lm_head); pre-norm decoder blocks with RMSNorm (weight only):
        h = h + Attn(RMS_in(h));  h = h + MLP(RMS_post(h));  logits = RMS_final(h) @ W_head^T
  * attention: GQA (num_key_value_heads < num_attention_heads, key/value head j serves the query heads
    j*g .. j*g+g-1), explicit head_dim (may differ from hidden/heads), biases on q/k/v/o when
    config.attention_bias; softmax scale head_dim**-0.5;
  * rotary embedding in the half-split (rotate_half) form on the full head_dim, applied to q and k FIRST;
    THEN a per-head RMSNorm over head_dim (query_layernorm / key_layernorm, each with its own gain);
  * RoPE frequencies: rope_type "default" -> theta; Hunyuan's "dynamic" with a fixed alpha is a static
    NTK-alpha stretch of the base: base = theta * alpha ** (head_dim / (head_dim - 2)),
    inv_freq_i = base ** (-2i / head_dim);
  * SwiGLU MLP silu(gate) * up -> down (no biases);
  * positions are 0..S-1 for every row, also with left padding (HF does not skip pads here); padding only
    enters through the key mask. Because the q/k norms come after the rotation, a shift of every position
    in a row is NOT a no-op for this model.

Weight layout of this port (own names, not the HF state-dict names):
  tok_table (V, H); blocks[i].norm_a.gain / norm_b.gain (H,);
  blocks[i].attn.wq / wk / wv stored as (in, out) matrices with bq / bk / bv (out,),
  blocks[i].attn.wo (nh*hd, H) with bo (H,); blocks[i].attn.q_gain / k_gain (hd,);
  blocks[i].ffn.w_gu = [gate | up] fused as one (H, 2I) matrix, blocks[i].ffn.w_dn (I, H);
  norm_out.gain (H,); head_t (H, V) = lm_head.weight^T.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "hy_qk_norm_before_rope",  # Qwen3/OLMo template order: query/key RMSNorm applied before the rotary embedding instead of after it
    "hy_ntk_alpha_ignored",  # rope_type "dynamic" treated as HF dynamic-NTK (a no-op below max_position_embeddings): plain theta, alpha unused
    "hy_ntk_alpha_base_linear",  # NTK-alpha base written theta * alpha: the alpha ** (d / (d - 2)) exponent dropped
    "hy_ntk_alpha_dim_from_hidden",  # alpha exponent d / (d - 2) evaluated with hidden_size // heads (16) instead of config.head_dim (24)
    "hy_key_norm_from_query_gain",  # loader reads self_attn.query_layernorm.weight for both the query and the key gain
    "hy_qk_norm_across_heads",  # q/k RMS taken over the whole flat projection (all heads at once) with the head_dim gain tiled per head
    "hy_rope_interleaved_pairs",  # GPT-J / GLM style RoPE: pairs (2i, 2i+1) rotated on a half-split (rotate_half) checkpoint
    "hy_gqa_tiled_heads",  # key/value heads expanded with repeat (tile): query head h reads kv head h % n_kv instead of h // group
    "hy_o_proj_bias_dropped",  # Qwen2 template: attention_bias honoured on q/k/v only, o_proj bias never loaded
    "hy_scale_from_hidden_heads",  # softmax scale computed as (hidden_size / num_heads) ** -0.5 instead of head_dim ** -0.5
    "hy_block_norms_swapped",  # loader maps input_layernorm to the pre-MLP norm and post_attention_layernorm to the pre-attention norm
    "hy_positions_from_mask",  # positions re-derived as cumsum(attention_mask) - 1 (generate() style); HF uses 0..S-1 for every row
]
PADDING_ONLY = {"hy_positions_from_mask"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with an additive float mask
    "qkv_fused",  # q|k|v weights and biases concatenated into one (H, (nh + 2 nkv) * hd) projection
    "rope_interleaved_permuted",  # q/k rows, biases and q/k norm gains permuted to (i, i + d/2) -> (2i, 2i+1); RoPE as a complex multiply of (2i, 2i+1) pairs
    "key_gain_folded_into_query",  # key gain * query gain * softmax scale folded into one query-side gain; key norm gain-free
    "varlen_unpad",  # each row's real tokens run alone with their original positions, scattered back into the batch
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _halves_to_pairs(n_heads, hd):
    """row order that moves channel i / i + hd/2 of each head to 2i / 2i + 1"""
    idx = []
    for h in range(n_heads):
        base = h * hd
        for i in range(hd // 2):
            idx += [base + i, base + i + hd // 2]
    return torch.tensor(idx)


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMS(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.gain = _P(w)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.eps) * self.gain


class Rope(nn.Module):
    """half-split rotary tables (cos, sin) of width head_dim"""

    def __init__(self, cfg):
        super().__init__()
        b = _bug()
        hd = cfg.head_dim
        rp = cfg.rope_parameters
        theta = float(rp["rope_theta"])
        kind = rp.get("rope_type", "default")
        # the NTK-alpha exponent uses head_dim
        dim = cfg.hidden_size // cfg.num_attention_heads if b == "hy_ntk_alpha_dim_from_hidden" else hd
        if kind == "dynamic" and rp.get("alpha"):
            alpha = float(rp["alpha"])
            if b == "hy_ntk_alpha_ignored":
                base = theta
            elif b == "hy_ntk_alpha_base_linear":
                base = theta * alpha
            else:
                base = theta * alpha ** (dim / (dim - 2))
        elif kind == "default":
            base = theta
        else:
            raise NotImplementedError(f"rope_type {kind}")
        inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, pos):
        ang = pos[..., None].float() * self.inv_freq  # (B, S, hd/2)
        if _bug() in ("hy_rope_interleaved_pairs", "rope_interleaved_permuted"):
            ang = ang.repeat_interleave(2, -1)
        else:
            ang = torch.cat((ang, ang), -1)
        return ang.cos(), ang.sin()


def _rotate(x, cos, sin):
    """x (B, heads, S, hd); cos / sin (B, S, hd)"""
    cos, sin = cos[:, None], sin[:, None]
    if _bug() == "rope_interleaved_permuted":
        # channels (2i, 2i+1) as one complex number, multiplied by e^{i * angle_i}
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        rot = torch.complex(cos[..., 0::2], sin[..., 0::2])
        return torch.view_as_real(z * rot).flatten(-2)
    if _bug() == "hy_rope_interleaved_pairs":
        ev, od = x[..., 0::2], x[..., 1::2]
        rot = torch.stack((-od, ev), -1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        b = _bug()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.pre = pre
        H = cfg.hidden_size

        def get(n, bias=True):
            w = sd[pre + n + ".weight"]
            bb = sd.get(pre + n + ".bias") if bias else None
            if bb is None:
                bb = torch.zeros(w.shape[0])
            return w, bb

        wq, bq = get("q_proj")
        wk, bk = get("k_proj")
        wv, bv = get("v_proj")
        wo, bo = get("o_proj", bias=b != "hy_o_proj_bias_dropped")
        gq = sd[pre + "query_layernorm.weight"]
        gk = sd[pre + ("query_layernorm.weight" if b == "hy_key_norm_from_query_gain" else "key_layernorm.weight")]
        if b == "rope_interleaved_permuted":
            pq, pk, pg = (
                _halves_to_pairs(self.nh, self.hd),
                _halves_to_pairs(self.nkv, self.hd),
                _halves_to_pairs(1, self.hd),
            )
            wq, bq, wk, bk = wq[pq], bq[pq], wk[pk], bk[pk]
            gq, gk = gq[pg], gk[pg]
        if b == "hy_scale_from_hidden_heads":
            self.scale = (H / self.nh) ** -0.5
        else:
            self.scale = self.hd**-0.5
        if b == "key_gain_folded_into_query":
            gq = gq * gk * self.scale
            gk = torch.ones_like(gk)
        self.q_gain, self.k_gain = _P(gq), _P(gk)
        if b == "qkv_fused":
            self.w_qkv = _P(torch.cat((wq, wk, wv), 0).t())
            self.b_qkv = _P(torch.cat((bq, bk, bv), 0))
            self.split = [wq.shape[0], wk.shape[0], wv.shape[0]]
        else:
            self.wq, self.wk, self.wv = _P(wq.t()), _P(wk.t()), _P(wv.t())
            self.bq, self.bk, self.bv = _P(bq), _P(bk), _P(bv)
        self.wo, self.bo = _P(wo.t()), _P(bo)

    def _norm(self, x, gain):
        if _bug() == "hy_qk_norm_across_heads":
            B, n, S, d = x.shape
            flat = x.transpose(1, 2).reshape(B, S, n * d)
            flat = _rms(flat, self.eps) * gain.repeat(n)
            return flat.view(B, S, n, d).transpose(1, 2)
        return _rms(x, self.eps) * gain

    def forward(self, x, add_mask, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if b == "qkv_fused":
            q, k, v = (x @ self.w_qkv + self.b_qkv).split(self.split, -1)
        else:
            q, k, v = x @ self.wq + self.bq, x @ self.wk + self.bk, x @ self.wv + self.bv
        if b != "rope_interleaved_permuted":
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, nh, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        if b == "hy_qk_norm_before_rope":
            q, k = self._norm(q, self.q_gain), self._norm(k, self.k_gain)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        else:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            q, k = self._norm(q, self.q_gain), self._norm(k, self.k_gain)
        if b not in ("rope_interleaved_permuted", "key_gain_folded_into_query"):
            _rec(self.pre + "query_layernorm", q)
            _rec(self.pre + "key_layernorm", k)
        g = nh // nkv
        if b == "hy_gqa_tiled_heads":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scale = 1.0 if b == "key_gain_folded_into_query" else self.scale
        if b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=add_mask, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale + add_mask
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nh * hd)
        out = ctx @ self.wo + self.bo
        _rec(self.pre + "o_proj", out)
        _rec(self.pre.rstrip("."), out)
        return out


class GatedMLP(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        g, u = sd[pre + "gate_proj.weight"], sd[pre + "up_proj.weight"]
        self.inter = g.shape[0]
        self.w_gu = _P(torch.cat((g, u), 0).t())
        self.w_dn = _P(sd[pre + "down_proj.weight"].t())
        self.pre = pre

    def forward(self, x):
        g, u = (x @ self.w_gu).split(self.inter, -1)
        _rec(self.pre + "gate_proj", g)
        _rec(self.pre + "up_proj", u)
        y = (F.silu(g) * u) @ self.w_dn
        _rec(self.pre + "down_proj", y)
        _rec(self.pre.rstrip("."), y)
        return y


class Block(nn.Module):
    def __init__(self, sd, cfg, idx):
        super().__init__()
        pre = f"model.layers.{idx}."
        na, nb = "input_layernorm", "post_attention_layernorm"
        if _bug() == "hy_block_norms_swapped":
            na, nb = nb, na
        self.norm_a = RMS(sd[pre + na + ".weight"], cfg.rms_norm_eps)
        self.attn = Attention(sd, pre + "self_attn.", cfg)
        self.norm_b = RMS(sd[pre + nb + ".weight"], cfg.rms_norm_eps)
        self.ffn = GatedMLP(sd, pre + "mlp.")
        self.pre = pre

    def forward(self, h, add_mask, cos, sin):
        n = self.norm_a(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attn(n, add_mask, cos, sin)
        n = self.norm_b(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.ffn(n)
        _rec(self.pre.rstrip("."), h)
        return h


class HunyuanDensePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_table = _P(sd["model.embed_tokens.weight"])
        self.rope = Rope(cfg)
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm_out = RMS(sd["model.norm.weight"], cfg.rms_norm_eps)
        head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
        self.head_t = _P(head.t())

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal[None, None] & keep[:, None, None, :]
        add_mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        h = self.tok_table[input_ids]
        _rec("model.embed_tokens", h)
        cos, sin = self.rope(pos)
        if b not in ("hy_rope_interleaved_pairs", "rope_interleaved_permuted"):
            _rec("model.rotary_emb", cos)
        for blk in self.blocks:
            h = blk(h, add_mask, cos, sin)
        h = self.norm_out(h)
        _rec("model.norm", h)
        logits = h @ self.head_t
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            if b == "hy_positions_from_mask":
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(S)[None].expand(B, S)
        position_ids = position_ids.expand(B, S)
        if b == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.head_t.shape[1])
            for r in range(B):
                sel = keep[r]
                ids = input_ids[r][sel][None]
                n = ids.shape[1]
                logits[r, sel] = self._core(ids, torch.ones(1, n, dtype=torch.bool), position_ids[r][sel][None])[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return HunyuanDensePort(state_dict, config).eval()
