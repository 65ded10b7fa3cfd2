"""Hand-written plain-PyTorch port of CWM (CwmForCausalLM, Meta's Code World Model).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block (eps = rms_norm_eps):
        h = h + Attn(RMS_in(h));  h = h + SwiGLU(RMS_post(h))
  - attention: GQA (q head h reads kv head h // groups), no attention biases;
    * head_dim from config.head_dim (24 here), NOT hidden_size / heads (16 here); scores * head_dim**-0.5;
    * per-layer attention kind from config.layer_types: "full_attention" (causal) or "sliding_attention"
      (causal AND key index > query index - sliding_window, i.e. the current token plus the sliding_window - 1
      previous ones); windows count sequence slots, as HF's mask does; here layer_types =
      [sliding, full, sliding, sliding] (NOT the default "full every 4th layer starting at 0" pattern);
    * RoPE in the half-split (rotate_half) form over the full head_dim, with Llama-3 frequency scaling
      (rope_parameters: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
        wavelen = 2 pi / f;  wavelen < old / high_freq_factor: f kept;  wavelen > old / low_freq_factor: f / factor;
        otherwise f' = (1 - s) f / factor + s f  with s = (old / wavelen - low_freq_factor) / (high - low);
  * MLP: SwiGLU (silu(gate) * up -> down) with BIASES on gate/up/down (config.mlp_bias);
  - final RMSNorm, then the head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill) in BOTH the full and the sliding masks;
    positions 0..S-1 when absent.

Weight layout of this port (own names):
  tok (V, H); out (V, H) (F.linear layout); g_out (H,);
  blocks[i].g1 / g2 (H,);
  attn.w_qkv ((nh + 2 nkv) * hd, H) F.linear layout, rows PACKED PER KV GROUP (Megatron style): for kv head j:
      [q heads j*g .. j*g+g-1 | k_j | v_j], g = nh / nkv;  attn.w_o (H, nh * hd) F.linear layout;
  mlp.w_ug (H, 2 I) (in, out) columns [up | gate]; b_ug (2 I,); w_d (I, H); b_d (H,).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "cw_window_off_by_one",  # sliding mask keeps key index >= q - window: window + 1 tokens instead of window
    "cw_default_window_pattern",  # config.layer_types ignored: hard-coded "layer i full iff i % 4 == 0" pattern
    "cw_llama3_scaling_ignored",  # rope_type "llama3" ignored: plain default frequencies
    "cw_llama3_smooth_inverted",  # Llama-3 medium band blended the wrong way: s f / factor + (1 - s) f
    "cw_llama3_ctx_from_max_pos",  # Llama-3 old context length from max_position_embeddings, not original_max_...
    "cw_scale_hidden_over_heads",  # softmax scale (hidden_size / heads)**-0.5 instead of config.head_dim**-0.5
    "cw_mlp_bias_dropped",  # config.mlp_bias ignored: gate/up/down biases not loaded
    "cw_qkv_group_heads_tiled",  # group packing puts q heads j, j + nkv, ... with kv head j instead of j*g .. j*g+g-1
    "cw_kv_rows_swapped",  # k and v slices exchanged inside each packed kv group
    "cw_mlp_gate_up_swapped",  # gate_proj / up_proj placed into the [up | gate] columns the wrong way round
    "cw_norm_gain_offset",  # Gemma template: RMSNorm gain applied as (1 + w) instead of w
    "cw_rope_interleaved_pairs",  # RoPE rotates adjacent pairs (GPT-J style) instead of the half-split form
    "cw_sliding_mask_no_padding",  # padding only merged into the full-attention mask; sliding layers see pad keys
]
PADDING_ONLY = {"cw_sliding_mask_no_padding"}
CLEAN = [
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of explicit softmax
    "sliding_unfold",  # sliding layers gather each query's window of keys with unfold (S x window scores)
    "rope_complex",  # q/k channels of each head permuted at load to adjacent pairs; RoPE as a complex multiply
    "norm_gain_folded",  # block / final RMSNorm gains folded into the rows of the following weights at load
    "varlen_unpad",  # each row's real tokens run alone with their own position_ids, logits scattered back
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _norm(x, g, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if g is None:
        return y
    return y * (1.0 + g) if _bug() == "cw_norm_gain_offset" else y * g


def _to_pairs(d):
    """index list: new channel 2i <- old i, new 2i + 1 <- old i + d/2 (half-split -> adjacent pairs)"""
    h = d // 2
    return torch.stack((torch.arange(h), torch.arange(h) + h), -1).flatten()


def _llama3_inv_freq(cfg, rp, dim):
    b = _bug()
    base = float(rp["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if rp.get("rope_type", "default") == "default" or b == "cw_llama3_scaling_ignored":
        return inv
    if rp["rope_type"] != "llama3":
        raise NotImplementedError(rp["rope_type"])
    factor = float(rp["factor"])
    lo_f, hi_f = float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    old = cfg.max_position_embeddings if b == "cw_llama3_ctx_from_max_pos" else rp["original_max_position_embeddings"]
    lo_wl, hi_wl = old / lo_f, old / hi_f
    wl = 2 * math.pi / inv
    out = torch.where(wl > lo_wl, inv / factor, inv)
    s = (old / wl - lo_f) / (hi_f - lo_f)
    if b == "cw_llama3_smooth_inverted":
        smoothed = s * out / factor + (1 - s) * out
    else:
        smoothed = (1 - s) * out / factor + s * out
    medium = (wl >= hi_wl) & (wl <= lo_wl)
    return torch.where(medium, smoothed, out)


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, hd/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b == "rope_complex":
        z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    if b == "cw_rope_interleaved_pairs":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, sliding, g_in):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.g = self.nh // self.nkv
        self.window = cfg.sliding_window if sliding else None
        wq = sd[p + "q_proj.weight"].float().view(self.nh, self.hd, -1)
        wk = sd[p + "k_proj.weight"].float().view(self.nkv, self.hd, -1)
        wv = sd[p + "v_proj.weight"].float().view(self.nkv, self.hd, -1)
        if b == "rope_complex":
            perm = _to_pairs(self.hd)
            wq, wk = wq[:, perm], wk[:, perm]
        if b == "cw_kv_rows_swapped":
            wk, wv = wv, wk
        groups = []
        for j in range(self.nkv):
            if b == "cw_qkv_group_heads_tiled":
                qh = wq[j :: self.nkv]
            else:
                qh = wq[j * self.g : (j + 1) * self.g]
            groups.append(torch.cat((qh, wk[j : j + 1], wv[j : j + 1]), 0))  # (g + 2, hd, H)
        w_qkv = torch.cat(groups, 0).reshape(-1, wq.shape[-1])
        if g_in is not None:
            w_qkv = w_qkv * g_in[None, :]
        self.w_qkv = _P(w_qkv)
        self.w_o = _P(sd[p + "o_proj.weight"])
        self.scale = self.hd**-0.5
        if b == "cw_scale_hidden_over_heads":
            self.scale = (cfg.hidden_size // self.nh) ** -0.5

    def _unfold_attn(self, q, k, v, keep):
        """sliding layer: each query attends to its window of W slots (t - W + 1 .. t), gathered with unfold"""
        W = self.window
        kp = F.pad(k, (0, 0, W - 1, 0)).unfold(2, W, 1).transpose(-1, -2)  # (B, n, S, W, hd)
        vp = F.pad(v, (0, 0, W - 1, 0)).unfold(2, W, 1).transpose(-1, -2)
        slot_ok = F.pad(keep, (W - 1, 0), value=False).unfold(1, W, 1)  # (B, S, W)
        s = torch.einsum("bnsd,bnswd->bnsw", q, kp) * self.scale
        s = s.masked_fill(~slot_ok[:, None], torch.finfo(s.dtype).min)
        return torch.einsum("bnsw,bnswd->bnsd", torch.softmax(s, -1), vp)

    def forward(self, x, masks, keep, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        qkv = F.linear(x, self.w_qkv).view(B, S, self.nkv, self.g + 2, self.hd)
        q = qkv[:, :, :, : self.g].reshape(B, S, self.nh, self.hd).transpose(1, 2)
        k = qkv[:, :, :, self.g].transpose(1, 2)
        v = qkv[:, :, :, self.g + 1].transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = k.repeat_interleave(self.g, 1), v.repeat_interleave(self.g, 1)
        allowed = masks["sliding" if self.window else "full"]
        if b == "sliding_unfold" and self.window:
            ctx = self._unfold_attn(q, k, v, keep)
        elif b == "sdpa_attention":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = F.linear(ctx.transpose(1, 2).reshape(B, S, -1), self.w_o)
        _rec(self.pre.rstrip("."), out)
        return out


class MLP(nn.Module):
    def __init__(self, sd, p, cfg, g):
        super().__init__()
        b = _bug()
        self.pre = p
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        I = cfg.intermediate_size  # noqa: E741
        H = cfg.hidden_size
        use_bias = cfg.mlp_bias and b != "cw_mlp_bias_dropped"

        def _get(name, n):
            w = sd[p + name + ".weight"].float().t()
            bb = sd[p + name + ".bias"].float() if use_bias else torch.zeros(n)
            return w, bb

        wg, bg = _get("gate_proj", I)
        wu, bu = _get("up_proj", I)
        if b == "cw_mlp_gate_up_swapped":
            wg, bg, wu, bu = wu, bu, wg, bg
        w_ug = torch.cat((wu, wg), 1)
        if g is not None:
            w_ug = g[:, None] * w_ug
        self.w_ug, self.b_ug = _P(w_ug), _P(torch.cat((bu, bg)))
        wd, bd = _get("down_proj", H)
        self.w_d, self.b_d = _P(wd), _P(bd)

    def forward(self, x):
        up, gate = (x @ self.w_ug + self.b_ug).chunk(2, -1)
        out = (F.silu(gate) * up) @ self.w_d + self.b_d
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        fold = b == "norm_gain_folded"
        g1 = sd[p + "input_layernorm.weight"].float()
        g2 = sd[p + "post_attention_layernorm.weight"].float()
        self.g1 = None if fold else _P(g1)
        self.g2 = None if fold else _P(g2)
        if b == "cw_default_window_pattern":
            sliding = i % 4 != 0
        else:
            sliding = cfg.layer_types[i] == "sliding_attention"
        self.attn = Attention(sd, p + "self_attn.", cfg, sliding, g1 if fold else None)
        self.mlp = MLP(sd, p + "mlp.", cfg, g2 if fold else None)

    def forward(self, h, masks, keep, cos, sin):
        h = h + self.attn(_norm(h, self.g1, self.eps), masks, keep, cos, sin)
        h = h + self.mlp(_norm(h, self.g2, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class CwmPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        head = head.float()
        g_out = sd["model.norm.weight"].float()
        fold = b == "norm_gain_folded"
        if fold:
            head = head * g_out[None, :]
        self.out = _P(head)
        self.g_out = None if fold else _P(g_out)
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial_rotary_factor")
        self.inv_freq = _llama3_inv_freq(cfg, rp, hd)

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        i = torch.arange(S)
        causal = (i[None, :] <= i[:, None])[None, None]
        W = self.cfg.sliding_window or S
        if b == "cw_window_off_by_one":
            band = (i[None, :] >= i[:, None] - W)[None, None]
        else:
            band = (i[None, :] > i[:, None] - W)[None, None]
        pad = keep[:, None, None, :]
        masks = {"full": causal & pad, "sliding": causal & band}
        if b != "cw_sliding_mask_no_padding":
            masks["sliding"] = masks["sliding"] & pad
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            h = blk(h, masks, keep, cos, sin)
        h = _norm(h, self.g_out, self.cfg.rms_norm_eps)
        if b != "norm_gain_folded":
            _rec("model.norm", h)
        logits = F.linear(h, self.out)
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None]
        position_ids = position_ids.expand(B, S)
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.cfg.vocab_size, dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return CwmPort(state_dict, config).eval()
