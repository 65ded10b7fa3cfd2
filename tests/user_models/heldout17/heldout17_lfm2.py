"""Hand-written plain-PyTorch port of LFM2 (Lfm2ForCausalLM), the Liquid hybrid short-conv / attention LM.

Architecture as this port implements it:
  * token embedding, NO norm on the input side; the checkpoint's "embedding_norm" is in fact the FINAL norm,
    applied after the last block, right before the (tied) output head;
  * RMSNorm with a plain gain: y = x / sqrt(mean(x^2) + eps) * w, eps = config.norm_eps;
  * per-layer operator from config.layer_types ("conv" or "full_attention"); every block is pre-norm:
        h = h + Op(operator_norm(h));  h = h + FFN(ffn_norm(h))
  * short-conv operator (gated depthwise causal convolution), L = config.conv_L_cache taps:
        x <- x * mask (left-padding positions zeroed first);  [B | C | X] = in_proj(x) (three H-wide chunks,
        in that order);  u = B * X;  v_t = sum_{j<L} k[:, j] * u_{t-L+1+j} (causal, zeros before the start,
        tap L-1 hits the current token, no activation);  y = out_proj(C * v); biases iff config.conv_bias;
  * attention operator: GQA, no biases, per-head RMSNorm with its own gain on q and k (q_layernorm /
    k_layernorm over head_dim) BEFORE RoPE; RoPE half-split (NeoX) over the full head_dim; scale head_dim**-0.5;
    causal mask + HF left-padding mask on keys;
  * FFN: SwiGLU w2(silu(w1 x) * w3 x), no biases (width already auto-adjusted in the checkpoint).

Weight layout of this port (own names, matrices stored (in, out)):
  embed (V, H) (also the head when tied, else head (H, V)); final_norm.w (H,);
  blocks[i].op_norm.w / ffn_norm.w (H,); blocks[i].ffn.w13 (H, 2I) = [w1 | w3]; blocks[i].ffn.w2 (I, H);
  conv blocks:  blocks[i].op.in_proj (H, 3H) = [B | C | X]; blocks[i].op.kernel (H, L); blocks[i].op.out_proj (H, H);
  attn blocks:  blocks[i].op.wq (H, nh*hd), wk / wv (H, nkv*hd), wo (nh*hd, H); q_gain / k_gain (hd,).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "lf_embedding_norm_at_input",  # "embedding_norm" applied to the embeddings (as its name says) instead of as the final norm
    "lf_conv_kernel_flipped",  # depthwise taps reversed (true convolution): tap 0 applied to the current token
    "lf_conv_tail_slice",  # conv padded L-1 on both sides and the LAST S outputs kept (decode-path slice): sees the future
    "lf_in_proj_chunk_order",  # in_proj output split as [B | X | C]: C and X swapped
    "lf_output_gate_before_conv",  # both gates applied before the conv: conv(C * B * X) instead of C * conv(B * X)
    "lf_conv_silu",  # Mamba habit: SiLU activation added after the short convolution
    "lf_qk_norm_after_rope",  # q/k layernorms applied after RoPE instead of before
    "lf_qk_norm_over_hidden",  # q/k RMS taken over the whole nh*hd projection (gain tiled) instead of per head
    "lf_w1_w3_swapped",  # feed_forward w1 / w3 swapped at load: SiLU applied to the up branch
    "lf_rmsnorm_gemma_offset",  # Gemma-style RMSNorm reused: scales by (1 + w) instead of w
    "lf_rope_interleaved",  # RoPE rotates adjacent pairs (2i, 2i+1) instead of half-split pairs (i, i+hd/2)
    "lf_conv_pad_not_zeroed",  # padded positions not zeroed before the conv: pad tokens leak into the first real tokens
    "lf_attn_pad_mask_dropped",  # attention layers use the causal mask only, left padding not masked
]
PADDING_ONLY = {"lf_conv_pad_not_zeroed", "lf_attn_pad_mask_dropped"}
CLEAN = [
    "conv_as_shifts",  # short conv written as a sum of L shifted, per-channel-scaled copies (no F.conv1d)
    "bx_swapped",  # B and X chunks of in_proj swapped at load: the product B * X is symmetric
    "ffn_norm_folded",  # ffn_norm gain folded into the rows of w13 at load, norm applied without a gain
    "rope_complex",  # q/k channels (and q/k gains) permuted to interleaved pairs at load, RoPE as a complex multiply
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


def _rms(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return y
    if _bug() == "lf_rmsnorm_gemma_offset":
        return y * (1.0 + w)
    return y * w


class Norm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.w = None if w is None else _P(w)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.w, self.eps)


class ShortConv(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        H = cfg.hidden_size
        self.H = H
        w = sd[p + "in_proj.weight"].float()  # (3H, H) rows [B; C; X]
        Bw, Cw, Xw = w[:H], w[H : 2 * H], w[2 * H :]
        bias = sd.get(p + "in_proj.bias")
        if bias is not None:
            Bb, Cb, Xb = bias.float()[:H], bias.float()[H : 2 * H], bias.float()[2 * H :]
        if b == "bx_swapped":
            Bw, Xw = Xw, Bw
            if bias is not None:
                Bb, Xb = Xb, Bb
        self.in_proj = _P(torch.cat((Bw, Cw, Xw), 0).t())
        self.in_bias = None if bias is None else _P(torch.cat((Bb, Cb, Xb)))
        self.kernel = _P(sd[p + "conv.weight"].float().squeeze(1))  # (H, L)
        cb = sd.get(p + "conv.bias")
        self.conv_bias = None if cb is None else _P(cb)
        self.out_proj = _P(sd[p + "out_proj.weight"].float().t())
        ob = sd.get(p + "out_proj.bias")
        self.out_bias = None if ob is None else _P(ob)
        self.pre = p

    def _conv(self, u):
        """u (B, S, H) -> causal depthwise conv along S"""
        b = _bug()
        S = u.shape[1]
        L = self.kernel.shape[1]
        k = self.kernel.flip(-1) if b == "lf_conv_kernel_flipped" else self.kernel
        if b == "conv_as_shifts":
            up = F.pad(u, (0, 0, L - 1, 0))
            out = sum(up[:, j : j + S] * k[:, j] for j in range(L))
            if self.conv_bias is not None:
                out = out + self.conv_bias
        else:
            full = F.conv1d(u.transpose(1, 2), k[:, None], self.conv_bias, padding=L - 1, groups=self.H)
            full = full[..., -S:] if b == "lf_conv_tail_slice" else full[..., :S]
            out = full.transpose(1, 2)
        if b == "lf_conv_silu":
            out = F.silu(out)
        return out

    def forward(self, x, keep, allowed, cos, sin):
        b = _bug()
        if keep is not None and b != "lf_conv_pad_not_zeroed":
            x = x * keep[..., None].to(x.dtype)
        z = x @ self.in_proj
        if self.in_bias is not None:
            z = z + self.in_bias
        H = self.H
        Bg, Cg, X = z[..., :H], z[..., H : 2 * H], z[..., 2 * H :]
        if b == "lf_in_proj_chunk_order":
            Cg, X = X, Cg
        if b == "lf_output_gate_before_conv":
            y = self._conv(Cg * Bg * X)
        else:
            y = Cg * self._conv(Bg * X)
        out = y @ self.out_proj
        if self.out_bias is not None:
            out = out + self.out_bias
        _rec(self.pre.rstrip("."), out)
        return out


def _pair_perm(hd):
    return torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], -1).flatten()


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, hd/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    if b == "lf_rope_interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        H = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.eps = cfg.norm_eps
        wq = sd[p + "q_proj.weight"].float().t()
        wk = sd[p + "k_proj.weight"].float().t()
        qg = sd[p + "q_layernorm.weight"].float()
        kg = sd[p + "k_layernorm.weight"].float()
        if b == "rope_complex":
            perm = _pair_perm(self.hd)
            wq = wq.view(H, self.nh, self.hd)[..., perm].reshape(H, -1)
            wk = wk.view(H, self.nkv, self.hd)[..., perm].reshape(H, -1)
            qg, kg = qg[perm], kg[perm]
        self.wq, self.wk = _P(wq), _P(wk)
        self.wv = _P(sd[p + "v_proj.weight"].float().t())
        self.wo = _P(sd[p + "out_proj.weight"].float().t())
        self.q_gain, self.k_gain = _P(qg), _P(kg)
        self.pre = p

    def _qk_norm(self, t, gain):
        """t (B, n, S, hd)"""
        if _bug() == "lf_qk_norm_over_hidden":
            B, n, S, d = t.shape
            flat = t.transpose(1, 2).reshape(B, S, n * d)
            return _rms(flat, gain.repeat(n), self.eps).view(B, S, n, d).transpose(1, 2)
        return _rms(t, gain, self.eps)

    def forward(self, x, keep, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        q = (x @ self.wq).view(B, S, self.nh, self.hd).transpose(1, 2)
        k = (x @ self.wk).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = (x @ self.wv).view(B, S, self.nkv, self.hd).transpose(1, 2)
        if b == "lf_qk_norm_after_rope":
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            q, k = self._qk_norm(q, self.q_gain), self._qk_norm(k, self.k_gain)
        else:
            q, k = self._qk_norm(q, self.q_gain), self._qk_norm(k, self.k_gain)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        g = self.nh // self.nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * self.hd**-0.5
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, S, -1)
        out = y @ self.wo
        _rec(self.pre.rstrip("."), out)
        return out


class SwiGLU(nn.Module):
    def __init__(self, sd, p, gain):
        super().__init__()
        w1 = sd[p + "w1.weight"].float().t()
        w3 = sd[p + "w3.weight"].float().t()
        if _bug() == "lf_w1_w3_swapped":
            w1, w3 = w3, w1
        w13 = torch.cat((w1, w3), 1)
        if gain is not None:
            w13 = w13 * gain.float()[:, None]
        self.w13 = _P(w13)
        self.w2 = _P(sd[p + "w2.weight"].float().t())
        self.I = w1.shape[1]

    def forward(self, x):
        h = x @ self.w13
        return (F.silu(h[..., : self.I]) * h[..., self.I :]) @ self.w2


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.is_attn = cfg.layer_types[i] != "conv"
        eps = cfg.norm_eps
        self.op_norm = Norm(sd[p + "operator_norm.weight"], eps)
        if self.is_attn:
            self.op = Attention(sd, p + "self_attn.", cfg)
        else:
            self.op = ShortConv(sd, p + "conv.", cfg)
        g = sd[p + "ffn_norm.weight"]
        folded = _bug() == "ffn_norm_folded"
        self.ffn_norm = Norm(None if folded else g, eps)
        self.ffn = SwiGLU(sd, p + "feed_forward.", g if folded else None)

    def forward(self, h, keep, allowed, cos, sin):
        h = h + self.op(self.op_norm(h), keep, allowed, cos, sin)
        h = h + self.ffn(self.ffn_norm(h))
        _rec(self.pre.rstrip("."), h)
        return h


class Lfm2Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = _P(sd["model.embed_tokens.weight"])
        if not cfg.tie_word_embeddings and "lm_head.weight" in sd:
            self.head = _P(sd["lm_head.weight"].float().t())
        else:
            self.head = None
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = Norm(sd["model.embedding_norm.weight"], cfg.norm_eps)
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if b != "lf_attn_pad_mask_dropped":
            allowed = allowed & keep[:, None, None, :]
        conv_keep = None if bool(keep.all()) else keep
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        h = self.embed[input_ids]
        if b == "lf_embedding_norm_at_input":
            h = self.final_norm(h)
        _rec("model.embed_tokens", h)
        for blk in self.blocks:
            h = blk(h, conv_keep, allowed, cos, sin)
        if b != "lf_embedding_norm_at_input":
            h = self.final_norm(h)
        _rec("model.embedding_norm", h)
        logits = h @ (self.embed.t() if self.head is None else self.head)
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
            logits = torch.zeros(B, S, self.cfg.vocab_size)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Lfm2Port(state_dict, config).eval()
