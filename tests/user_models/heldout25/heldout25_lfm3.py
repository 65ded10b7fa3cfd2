"""Hand-written plain-PyTorch port of LFM3 (Lfm3ForCausalLM, Liquid AI's hybrid conv / attention model).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; output head tied to the embedding table (config.tie_word_embeddings);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps) (eps = config.norm_eps);
  * SANDWICH norms (config.use_sandwich_norm): every sub-block output is RMS-normalised before the residual add:
        h = h + RMS_post_op(Mixer(RMS_op(h)));  h = h + RMS_post_ffn(FFN(RMS_ffn(h)))
  * hybrid stack, config.layer_types[i] in {"conv", "sliding_attention", "full_attention"} (here
    [conv, sliding, full, conv], NOT the default pattern);
  * short-conv mixer ("conv" layers), no biases (config.conv_bias is False here):
        n = RMS_op(h), padded positions ZEROED (attention_mask) before the input projection;
        [B | C | x] = in_proj(n);  u = B * x;
        z[t] = sum_{j=0}^{L-1} k_j * u[t - j]   (depthwise CAUSAL conv, L = config.conv_L_cache taps, zeros before t=0;
                                                 HF's Conv1d weight[:, 0, L-1-j] is the tap for lag j);
        out = out_proj(C * z);
  - attention mixer: GQA (q head h reads kv head h // groups), head_dim = config.head_dim (24; hidden / heads = 16),
    scores * head_dim**-0.5, causal, no biases;
    * per-head RMSNorm on q and k (q_norm / k_norm, gain (head_dim,)) BEFORE RoPE;
    * sliding_attention layers additionally keep only key index > query index - sliding_window (window counts
      sequence slots, as HF's mask does);
    * RoPE parameters PER LAYER TYPE (config.rope_parameters[layer_type]), half-split (rotate_half) form:
        sliding: "default", theta_s, all head_dim / 2 frequencies f_i = theta_s^(-2i / head_dim);
        full: "proportional", theta_f, partial_rotary_factor p: the first r = int(p * head_dim // 2) frequencies
          f_i = theta_f^(-2i / head_dim) (exponent over the FULL head_dim), the remaining head_dim / 2 - r are 0
          (those channel pairs are not rotated); all / rope factor (1 here); channel pairs stay (i, i + head_dim/2);
    * per-head sigmoid OUTPUT GATE (config.use_attention_gate): ctx_h *= sigmoid(g_proj(n))_h, with n the
      normalised layer input, before o_proj;
  - FFN: SwiGLU w2(silu(w1 x) * w3 x);
  * the final RMSNorm is HF's `model.embedding_norm`, applied AFTER the last layer, then the tied head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill) in both full and sliding masks and zeroes
    the conv inputs at padded positions; positions 0..S-1 when position_ids are absent.

Weight layout of this port (own names):
  emb (V, H); head (H, V) (in, out); g_final (H,);
  blocks[i].g_op / g_post_op / g_ffn / g_post_ffn (H,);
  conv blocks: w_in (H, 3H) (in, out) with columns reordered to [x | B | C]; taps (H, L), column j = tap for
      lag j (time-REVERSED w.r.t. HF's conv weight); w_out (H, H) F.linear layout;
  attention blocks: w_qkvg (H, nh hd + 2 nkv hd + nh) (in, out), columns [q | k | v | gate logits];
      q_gain / k_gain (hd,); w_o (nh hd, H) (in, out);
  FFN: w31 (2I, H) F.linear layout, rows [w3 (up) | w1 (gate)]; w2 (I, H) (in, out).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "l3_attn_gate_missing",  # LFM2 / Qwen3 template: use_attention_gate ignored, g_proj never applied
    "l3_attn_gate_tiled",  # per-head gate broadcast with repeat (tile): channel c gets head c % nh's gate, not c // hd
    "l3_attn_gate_from_residual",  # gate logits computed from the raw residual stream instead of RMS_op(h)
    "l3_sandwich_norm_skipped",  # LFM2 template: post_operator_norm / post_ffn_norm ignored
    "l3_sandwich_norm_after_residual",  # post norms applied after the residual add: h = RMS_post(h + out)
    "l3_rope_partial_contiguous",  # NeoX/GLM partial rotary: first 2r channels rotated as a half-split block (i, i + r)
    "l3_rope_freqs_over_rot_dim",  # proportional frequencies with exponent 2i / (2r) instead of 2i / head_dim
    "l3_rope_full_params_everywhere",  # one rotary table: the full-attention (proportional) RoPE used in sliding layers
    "l3_sliding_window_ignored",  # sliding_attention layers attend over the whole causal prefix
    "l3_conv_future_taps",  # conv output sliced from the wrong end ([-S:]): z[t] reads u[t .. t + L - 1]
    "l3_gqa_tiled_heads",  # kv heads expanded with repeat (tile): q head h reads kv head h % nkv, not h // groups
    "l3_mlp_w1_w3_swapped",  # w1 / w3 placed into the [up | gate] rows the wrong way round: silu on the up branch
    "l3_conv_pad_not_zeroed",  # padded positions not zeroed before in_proj: pad states leak into the conv window
]
PADDING_ONLY = {"l3_conv_pad_not_zeroed"}
CLEAN = [
    "conv_unfold",  # short conv as left-padded unfold windows contracted with the (time-ordered) taps by einsum
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of explicit softmax
    "gate_per_channel",  # g_proj columns repeated head_dim times at load: one sigmoid gate per ctx channel
    "norm_gain_folded",  # op / ffn / final RMSNorm gains folded into the rows of the following weights at load
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
    return y if g is None else y * g


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, r): channels [0, 2r) rotated as pairs (i, i + r), the rest passed through"""
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    x1, x2, xp = x[..., :r], x[..., r : 2 * r], x[..., 2 * r :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xp), -1)


def _inv_freq(rp, hd):
    b = _bug()
    theta = float(rp["rope_theta"])
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    if kind != "proportional":
        raise NotImplementedError(kind)
    r = int(rp.get("partial_rotary_factor", 1.0) * hd // 2)
    denom = 2 * r if b == "l3_rope_freqs_over_rot_dim" else hd
    inv = 1.0 / (theta ** (torch.arange(0, 2 * r, 2, dtype=torch.float) / denom))
    if b != "l3_rope_partial_contiguous":
        inv = torch.cat((inv, torch.zeros(hd // 2 - r)))
    return inv / float(rp.get("factor", 1.0))


class ShortConv(nn.Module):
    def __init__(self, sd, p, cfg, gain):
        super().__init__()
        self.pre = p
        H = cfg.hidden_size
        if cfg.conv_bias:
            raise NotImplementedError("conv_bias")
        w_in = sd[p + "in_proj.weight"].float()  # (3H, H) rows [B | C | x]
        wb, wc, wx = w_in[:H], w_in[H : 2 * H], w_in[2 * H :]
        w = torch.cat((wx, wb, wc), 0).t()  # (H, 3H) columns [x | B | C]
        if gain is not None:
            w = gain[:, None] * w
        self.w_in = _P(w)
        k = sd[p + "conv.weight"].float()[:, 0, :]  # (H, L), last column = current token
        self.taps = _P(k.flip(-1))  # (H, L), column j = lag j
        self.L = k.shape[1]
        self.w_out = _P(sd[p + "out_proj.weight"])

    def forward(self, n, keep):
        b = _bug()
        if b != "l3_conv_pad_not_zeroed":
            n = n * keep[..., None].to(n.dtype)
        x, Bg, Cg = (n @ self.w_in).chunk(3, -1)
        u = Bg * x  # (B, S, H)
        S, L = u.shape[1], self.L
        if b == "conv_unfold":
            win = F.pad(u, (0, 0, L - 1, 0)).unfold(1, L, 1)  # (B, S, H, L), last = current token
            z = torch.einsum("bshl,hl->bsh", win, self.taps.flip(-1))
        elif b == "l3_conv_future_taps":
            up = F.pad(u, (0, 0, 0, L - 1))
            z = sum(self.taps[:, j] * up[:, L - 1 - j : L - 1 - j + S] for j in range(L))
        else:
            z = torch.zeros_like(u)
            for j in range(L):
                z[:, j:] += self.taps[:, j] * u[:, : S - j]
        out = F.linear(Cg * z, self.w_out)
        _rec(self.pre.rstrip("."), out)
        return out


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, layer_type, gain):
        super().__init__()
        b = _bug()
        self.pre = p
        self.layer_type = layer_type
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.g = self.nh // self.nkv
        self.eps = cfg.norm_eps
        if cfg.attention_bias:
            raise NotImplementedError("attention_bias")
        wq = sd[p + "q_proj.weight"].float().t()
        wk = sd[p + "k_proj.weight"].float().t()
        wv = sd[p + "v_proj.weight"].float().t()
        self.use_gate = cfg.use_attention_gate and b != "l3_attn_gate_missing"
        parts = [wq, wk, wv]
        if self.use_gate:
            wg = sd[p + "g_proj.weight"].float().t()  # (H, nh)
            if b == "gate_per_channel":
                wg = wg.repeat_interleave(self.hd, 1)
            parts.append(wg)
        w = torch.cat(parts, 1)
        self.raw_gate = None
        if b == "l3_attn_gate_from_residual" and self.use_gate:
            self.raw_gate = _P(w[:, -self.nh :])
        if gain is not None:
            w = gain[:, None] * w
        self.w_qkvg = _P(w)
        self.q_gain = _P(sd[p + "q_norm.weight"])
        self.k_gain = _P(sd[p + "k_norm.weight"])
        self.w_o = _P(sd[p + "o_proj.weight"].float().t())
        self.scale = self.hd**-0.5

    def forward(self, n, h, masks, rope):
        b = _bug()
        B, S, _ = n.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        y = n @ self.w_qkvg
        q = y[..., :nq].view(B, S, self.nh, self.hd)
        k = y[..., nq : nq + nk].view(B, S, self.nkv, self.hd)
        v = y[..., nq + nk : nq + 2 * nk].view(B, S, self.nkv, self.hd).transpose(1, 2)
        q = _norm(q, self.q_gain, self.eps).transpose(1, 2)
        k = _norm(k, self.k_gain, self.eps).transpose(1, 2)
        rk = "full_attention" if b == "l3_rope_full_params_everywhere" else self.layer_type
        cos, sin = rope[rk]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if b == "l3_gqa_tiled_heads":
            k, v = k.repeat(1, self.g, 1, 1), v.repeat(1, self.g, 1, 1)
        else:
            k, v = k.repeat_interleave(self.g, 1), v.repeat_interleave(self.g, 1)
        allowed = masks[self.layer_type]
        if b == "sdpa_attention":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, -1)  # (B, S, nh * hd), head-major channels
        if self.use_gate:
            gl = y[..., nq + 2 * nk :] if self.raw_gate is None else h @ self.raw_gate
            gate = torch.sigmoid(gl)
            if b == "gate_per_channel":
                ctx = ctx * gate
            elif b == "l3_attn_gate_tiled":
                ctx = ctx * gate.repeat(1, 1, self.hd)
            else:
                ctx = (ctx.view(B, S, self.nh, self.hd) * gate[..., None]).reshape(B, S, -1)
        out = ctx @ self.w_o
        _rec(self.pre.rstrip("."), out)
        return out


class FFN(nn.Module):
    def __init__(self, sd, p, gain):
        super().__init__()
        b = _bug()
        self.pre = p
        w1, w3 = sd[p + "w1.weight"].float(), sd[p + "w3.weight"].float()
        if b == "l3_mlp_w1_w3_swapped":
            w1, w3 = w3, w1
        w = torch.cat((w3, w1), 0)
        if gain is not None:
            w = w * gain[None, :]
        self.w31 = _P(w)
        self.w2 = _P(sd[p + "w2.weight"].float().t())

    def forward(self, x):
        up, gate = F.linear(x, self.w31).chunk(2, -1)
        out = (F.silu(gate) * up) @ self.w2
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.norm_eps
        fold = b == "norm_gain_folded"
        g_op = sd[p + "operator_norm.weight"].float()
        g_ffn = sd[p + "ffn_norm.weight"].float()
        self.g_op = None if fold else _P(g_op)
        self.g_ffn = None if fold else _P(g_ffn)
        self.sandwich = cfg.use_sandwich_norm and b != "l3_sandwich_norm_skipped"
        if self.sandwich:
            self.g_post_op = _P(sd[p + "post_operator_norm.weight"])
            self.g_post_ffn = _P(sd[p + "post_ffn_norm.weight"])
        self.kind = cfg.layer_types[i]
        if self.kind == "conv":
            self.mixer = ShortConv(sd, p + "conv.", cfg, g_op if fold else None)
        else:
            self.mixer = Attention(sd, p + "self_attn.", cfg, self.kind, g_op if fold else None)
        self.ffn = FFN(sd, p + "feed_forward.", g_ffn if fold else None)

    def _add(self, h, out, g_post):
        if not self.sandwich:
            return h + out
        if _bug() == "l3_sandwich_norm_after_residual":
            return _norm(h + out, g_post, self.eps)
        return h + _norm(out, g_post, self.eps)

    def forward(self, h, keep, masks, rope):
        n = _norm(h, self.g_op, self.eps)
        if self.kind == "conv":
            out = self.mixer(n, keep)
        else:
            out = self.mixer(n, h, masks, rope)
        h = self._add(h, out, self.g_post_op if self.sandwich else None)
        out = self.ffn(_norm(h, self.g_ffn, self.eps))
        h = self._add(h, out, self.g_post_ffn if self.sandwich else None)
        _rec(self.pre.rstrip("."), h)
        return h


class Lfm3Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.emb = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = sd["model.embed_tokens.weight"]
        head = head.float().t()
        g_final = sd["model.embedding_norm.weight"].float()
        fold = b == "norm_gain_folded"
        if fold:
            head = g_final[:, None] * head
        self.head = _P(head)
        self.g_final = None if fold else _P(g_final)
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kinds = {k for k in cfg.layer_types if k != "conv"}
        if b == "l3_rope_full_params_everywhere":
            kinds.add("full_attention")
        self.inv_freq = {k: _inv_freq(cfg.rope_parameters[k], hd) for k in kinds}

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        i = torch.arange(S)
        causal = (i[None, :] <= i[:, None])[None, None]
        W = self.cfg.sliding_window or S
        band = (i[None, :] > i[:, None] - W)[None, None]
        pad = keep[:, None, None, :]
        masks = {"full_attention": causal & pad, "sliding_attention": causal & band & pad}
        if b == "l3_sliding_window_ignored":
            masks["sliding_attention"] = causal & pad
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        rope = {}
        for k, inv in self.inv_freq.items():
            ang = pos[..., None].float() * inv
            rope[k] = (ang.cos(), ang.sin())
        for blk in self.blocks:
            h = blk(h, keep, masks, rope)
        h = _norm(h, self.g_final, self.cfg.norm_eps)
        if b != "norm_gain_folded":
            _rec("model.embedding_norm", h)
        logits = h @ self.head
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
            logits = torch.zeros(B, S, self.head.shape[1], dtype=self.emb.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Lfm3Port(state_dict, config).eval()
