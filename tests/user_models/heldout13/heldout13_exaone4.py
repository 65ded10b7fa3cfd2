"""Hand-written plain-PyTorch port of an EXAONE 4.0 (Exaone4ForCausalLM) causal LM.

Post-norm decoder as HF implements it: h = h + post_attention_layernorm(attn(h)),
h = h + post_feedforward_layernorm(mlp(h)) (no input norm), per-head QK RMSNorm before RoPE,
hybrid layers: sliding-window layers use RoPE (llama3-scaled), global layers use no positional
encoding at all. GQA, SwiGLU MLP, untied head. Weights stored as (in, out) matrices under this
file's own names; gate and up fused into one matrix.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "ex_rope_on_global_layers",  # llama template: RoPE applied on every layer, the global (NoPE) layers get rotated too
    "ex_layer_pattern_zero_based",  # layer types re-derived from sliding_window_pattern with i % p == 0 -> global, so layer 0 is global and the last layer sliding
    "ex_window_on_global_layers",  # one sliding-window mask built and passed to every layer, global layers windowed too
    "ex_qk_norm_after_rope",  # q_norm/k_norm applied after the rotary embedding instead of before it
    "ex_qk_norm_over_flat_heads",  # OLMo-2 template: QK-norm statistics over the whole flattened projection (heads*head_dim), weight tiled per head
    "ex_llama3_rope_scaling_ignored",  # rope_type llama3 not handled: plain inv_freq used, the frequency scaling dropped
    "ex_llama3_low_high_factor_swapped",  # llama3 rope: low_freq_factor and high_freq_factor read into each other's slot
    "ex_spurious_qk_permute_at_load",  # Meta->HF q/k row permutation (convert_llama_weights permute) applied again to an HF checkpoint already in half-split layout
    "ex_post_attn_norm_before_o_proj",  # post_attention_layernorm applied to the attention context before o_proj (sub-LN placement) instead of to o_proj's output
    "ex_qk_norm_scale_dropped",  # softmax scale dropped because 'QK-norm already normalises q and k' (scale 1 instead of head_dim**-0.5)
    "ex_window_keeps_first_token",  # StreamingLLM habit: sliding layers always keep token 0 visible as an attention sink
    "ex_varlen_pack_without_doc_mask",  # padded batch packed into one varlen sequence (positions restart per row) but attended with a plain causal mask: rows see earlier rows
]
PADDING_ONLY = {"ex_varlen_pack_without_doc_mask"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with an additive mask (causal & padding & window), GQA expanded
    "fused_qkv_transposed",  # q|k|v re-packed at load into one (in, q+2kv) matrix, split at run time
    "rope_interleaved_permuted",  # q/k rows AND q_norm/k_norm weights permuted at load to interleaved pairs, rotate-every-two RoPE
    "varlen_unpad",  # each row's real tokens run alone (positions from 0), results scattered back into the padded batch
    "rope_complex",  # RoPE as complex multiplication over (i, i + d/2) pairs
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _llama3_inv_freq(rp, dim, swap=False, ignore=False):
    base = rp["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if ignore or rp.get("rope_type", "default") != "llama3":
        return inv
    factor = rp["factor"]
    lo, hi = rp["low_freq_factor"], rp["high_freq_factor"]
    if swap:
        lo, hi = hi, lo
    old = rp["original_max_position_embeddings"]
    lo_wl, hi_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    out = torch.where(wl > lo_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wl < hi_wl) * ~(wl > lo_wl)
    return torch.where(medium, smoothed, out)


def _halfsplit_to_interleaved(n_heads, hd):
    """row order putting half-split pair (i, i+hd/2) at (2i, 2i+1) within each head"""
    idx = []
    for h in range(n_heads):
        for i in range(hd // 2):
            idx += [h * hd + i, h * hd + i + hd // 2]
    return torch.tensor(idx)


def _meta_permute(w, n_heads, hd):
    """convert_llama_weights_to_hf permute: interleaved -> half-split (applied once too often)"""
    dim2 = w.shape[1]
    return w.view(n_heads, hd // 2, 2, dim2).transpose(1, 2).reshape(n_heads * hd, dim2)


class Layer(nn.Module):
    pass


class Exaone4Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        H = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window
        n = cfg.num_hidden_layers
        if b == "ex_layer_pattern_zero_based":
            p = cfg.sliding_window_pattern
            self.types = ["full_attention" if i % p == 0 else "sliding_attention" for i in range(n)]
        else:
            self.types = list(cfg.layer_types)
        inv = _llama3_inv_freq(
            cfg.rope_parameters,
            self.hd,
            swap=b == "ex_llama3_low_high_factor_swapped",
            ignore=b == "ex_llama3_rope_scaling_ignored",
        )
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scaling = 1.0 if b == "ex_qk_norm_scale_dropped" else self.hd**-0.5
        self.emb = _P(sd["model.embed_tokens.weight"])
        self.final_w = _P(sd["model.norm.weight"])
        self.head = _P(sd["lm_head.weight"].t())
        qi = _halfsplit_to_interleaved(self.nh, self.hd)
        ki = _halfsplit_to_interleaved(self.nkv, self.hd)
        ni = _halfsplit_to_interleaved(1, self.hd)
        self.layers = nn.ModuleList()
        for i in range(n):
            pre = f"model.layers.{i}."
            a = pre + "self_attn."
            L = Layer()
            L.idx = i
            L.sliding = self.types[i] == "sliding_attention"
            wq, wk, wv = sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]
            qn, kn = sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]
            if b == "ex_spurious_qk_permute_at_load":
                wq, wk = _meta_permute(wq, self.nh, self.hd), _meta_permute(wk, self.nkv, self.hd)
            if b == "rope_interleaved_permuted":
                wq, wk, qn, kn = wq[qi], wk[ki], qn[ni], kn[ni]
            if b == "fused_qkv_transposed":
                L.wqkv = _P(torch.cat((wq, wk, wv), 0).t())
            else:
                L.wq, L.wk, L.wv = _P(wq.t()), _P(wk.t()), _P(wv.t())
            L.qn, L.kn = _P(qn), _P(kn)
            L.wo = _P(sd[a + "o_proj.weight"].t())
            L.n_attn = _P(sd[pre + "post_attention_layernorm.weight"])
            L.n_ff = _P(sd[pre + "post_feedforward_layernorm.weight"])
            L.w_gu = _P(torch.cat((sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]), 0).t())
            L.w_down = _P(sd[pre + "mlp.down_proj.weight"].t())
            self.layers.append(L)

    # ---- rotary ---------------------------------------------------------------------------
    def _cos_sin(self, pos):
        ang = pos[..., None].float() * self.inv_freq  # (B, S, hd/2)
        if _bug() == "rope_interleaved_permuted":
            ang = ang.repeat_interleave(2, -1)
        elif _bug() != "rope_complex":
            ang = torch.cat((ang, ang), -1)
        return ang.cos(), ang.sin()

    def _rope(self, x, cos, sin):
        """x: (B, heads, S, hd); cos/sin (B, S, *)"""
        b = _bug()
        cos, sin = cos[:, None], sin[:, None]
        if b == "rope_interleaved_permuted":
            x0, x1 = x[..., 0::2], x[..., 1::2]
            rot = torch.stack((-x1, x0), -1).flatten(-2)
            return x * cos + rot * sin
        if b == "rope_complex":
            h = x.shape[-1] // 2
            z = torch.complex(x[..., :h], x[..., h:]) * torch.complex(cos, sin)
            return torch.cat((z.real, z.imag), -1)
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    def _qknorm(self, x, w, heads):
        if _bug() == "ex_qk_norm_over_flat_heads":
            B, nh, S, hd = x.shape
            flat = x.transpose(1, 2).reshape(B, S, nh * hd)
            flat = _rms(flat, w.repeat(nh), self.eps)
            return flat.view(B, S, nh, hd).transpose(1, 2)
        return _rms(x, w, self.eps)

    # ---- attention ------------------------------------------------------------------------
    def _attn(self, L, x, allowed, cos, sin, pre):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if b == "fused_qkv_transposed":
            q, k, v = (x @ L.wqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        else:
            q, k, v = x @ L.wq, x @ L.wk, x @ L.wv
        if b not in ("rope_interleaved_permuted", "ex_spurious_qk_permute_at_load"):
            _rec(pre + "q_proj", q)
            _rec(pre + "k_proj", k)
        _rec(pre + "v_proj", v)
        q = q.view(B, S, nh, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        use_rope = L.sliding or self.window is None or b == "ex_rope_on_global_layers"
        if b == "ex_qk_norm_after_rope" and use_rope:
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        q, k = self._qknorm(q, L.qn, nh), self._qknorm(k, L.kn, nkv)
        if b not in ("rope_interleaved_permuted", "ex_spurious_qk_permute_at_load", "ex_qk_norm_after_rope"):
            _rec(pre + "q_norm", q)
            _rec(pre + "k_norm", k)
        if use_rope and b != "ex_qk_norm_after_rope":
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if b == "sdpa":
            am = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=am, scale=self.scaling)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scaling
            s = s.masked_fill(~allowed, torch.finfo(torch.float32).min)
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nh * hd)
        if b == "ex_post_attn_norm_before_o_proj":
            out = _rms(ctx, L.n_attn, self.eps) @ L.wo
            _rec(pre + "o_proj", out)
            return out
        out = ctx @ L.wo
        _rec(pre + "o_proj", out)
        _rec(pre.rstrip("."), out)
        return _rms(out, L.n_attn, self.eps)

    def _masks(self, keep, pos_idx, doc=None):
        """keep: (B, S) bool; pos_idx: (S,) index used for causal/window distances; doc: (S,) doc id or None"""
        b = _bug()
        i, j = pos_idx[:, None], pos_idx[None, :]
        causal = j <= i
        if doc is not None:
            causal = causal & (doc[:, None] == doc[None, :])
        full = causal[None, None] & keep[:, None, None, :]
        win = (i - j) < self.window
        if b == "ex_window_keeps_first_token":
            win = win | (j == 0)
        sliding = full & win[None, None]
        return full, sliding

    def _core(self, input_ids, keep, position_ids, doc=None, rec=True):
        b = _bug()
        S = input_ids.shape[1]
        full, sliding = self._masks(keep, torch.arange(S), doc)
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        cos, sin = self._cos_sin(position_ids)
        if b not in ("rope_interleaved_permuted", "rope_complex"):
            _rec("model.rotary_emb", cos)
        for L in self.layers:
            p = f"model.layers.{L.idx}."
            m = sliding if (L.sliding or b == "ex_window_on_global_layers") else full
            a = self._attn(L, h, m, cos, sin, p + "self_attn.")
            if b != "ex_post_attn_norm_before_o_proj":
                _rec(p + "post_attention_layernorm", a)
            h = h + a
            gu = h @ L.w_gu
            g, u = gu.chunk(2, -1)
            _rec(p + "mlp.gate_proj", g)
            _rec(p + "mlp.up_proj", u)
            f = (F.silu(g) * u) @ L.w_down
            _rec(p + "mlp.down_proj", f)
            _rec(p + "mlp", f)
            f = _rms(f, L.n_ff, self.eps)
            _rec(p + "post_feedforward_layernorm", f)
            h = h + f
            _rec(p.rstrip("."), h)
        h = _rms(h, self.final_w, self.eps)
        _rec("model.norm", h)
        return h @ self.head

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)  # HF EXAONE 4: arange, not mask-derived
        if b in ("varlen_unpad", "ex_varlen_pack_without_doc_mask"):
            saved = globals()["REC"]
            globals()["REC"] = None
            lens = keep.sum(-1).tolist()
            ids = torch.cat([input_ids[r][keep[r]] for r in range(B)])[None]
            pos = torch.cat([torch.arange(n) for n in lens])[None]
            doc = torch.cat([torch.full((n,), r) for r, n in enumerate(lens)])
            if b == "ex_varlen_pack_without_doc_mask":
                doc = None
            # one packed row; distances along the packed index, documents separated by doc ids
            packed = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos, doc)[0]
            globals()["REC"] = saved
            logits = torch.zeros(B, S, packed.shape[-1])
            off = 0
            for r in range(B):
                logits[r, keep[r]] = packed[off : off + lens[r]]
                off += lens[r]
            _rec("lm_head", logits)
            return logits.float()
        logits = self._core(input_ids, keep, position_ids)
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return Exaone4Port(state_dict, config).eval()
