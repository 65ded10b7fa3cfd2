"""Hand-written plain-PyTorch port of the Apertus 1.5 text backbone (Apertus1p5TextForCausalLM, model_type
"apertus1p5_text", the causal LM of the `apertus1p5` package).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding over the full (extended) vocabulary, no scaling;
  * the output head may be PRUNED: it has config.output_vocab_size rows (the ids 0..output_vocab_size - 1),
    fewer than the input vocabulary, and is never tied to the embedding here; logits are (B, S, head rows);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps) (eps = rms_norm_eps), two pre-norms per block, under the
    names attention_layernorm / feedforward_layernorm:
        h = h + Attn(RMS_attn(h));  h = h + MLP(RMS_ffn(h))
  - attention: GQA (q head h reads kv head h // groups), head_dim = hidden / heads, scores * head_dim**-0.5, causal;
    * config.attention_bias adds biases to q / k / v AND o_proj;
    * QK-norm: RMSNorm over each head's head_dim channels (gain (head_dim,)) on q and k, after the biases and
      BEFORE RoPE;
    * RoPE in the half-split (rotate_half) form over the full head_dim with Llama-3 frequency scaling
      (rope_parameters: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
        wavelen = 2 pi / f;  wavelen < old / high_freq_factor: f kept;  wavelen > old / low_freq_factor: f / factor;
        otherwise f' = (1 - s) f / factor + s f  with s = (old / wavelen - low_freq_factor) / (high - low);
  * MLP: NO gate: down(xIELU(up(x))), with the learned per-layer xIELU
        a_p = softplus(alpha_p),  a_n = beta + softplus(alpha_n)   (alpha_p / alpha_n are raw (1,) parameters,
                                                                     beta / eps are buffers, 0.5 / -1e-6)
        xIELU(x) = a_p x^2 + beta x                          for x > 0
                 = a_n (expm1(min(x, eps)) - x) + beta x     for x <= 0
  - final RMSNorm (model.norm), then the head;
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (own names):
  tok (V, H); head (Vout, H) F.linear layout; g_out (H,);
  blocks[i].g_attn / g_ffn (H,);
  attn.w_q (nh * hd, H) F.linear layout, attn.b_q (nh * hd,);
  attn.w_kv (2 nkv hd, H) F.linear layout with rows per kv head j INTERLEAVED: [k_j | v_j] for j = 0..nkv-1;
  attn.b_kv in the same order; attn.q_gain / k_gain (hd,); attn.w_o (H, nh * hd) F.linear layout, attn.b_o (H,);
  mlp.w_up (H, I) (in, out); mlp.w_down (I, H) (in, out);
  mlp.a_p / a_n: the EFFECTIVE xIELU slopes (softplus already applied, beta already added to a_n); mlp.beta, mlp.eps.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "ap_xielu_no_softplus",  # raw alpha_p / alpha_n used as the xIELU slopes (softplus reparametrisation forgotten)
    "ap_xielu_alpha_n_no_beta",  # negative-branch slope a_n = softplus(alpha_n), the + beta offset dropped
    "ap_xielu_alphas_swapped",  # alpha_p / alpha_n exchanged at load (positive branch uses the negative slope)
    "ap_xielu_elu_negative_branch",  # ELU template: negative branch a_n * expm1(x) + beta x, the - x term dropped
    "ap_qk_norm_after_rope",  # q/k norms applied after RoPE (the per-channel gains then hit rotated channels)
    "ap_qk_norm_full_width",  # q/k RMS statistic taken over the whole nh*hd projection instead of per head
    "ap_o_proj_bias_dropped",  # Qwen2 template: attention_bias taken to mean q/k/v only, o_proj bias ignored
    "ap_head_tied_to_embed",  # pruned head taken as the first output_vocab_size rows of the embedding (tied)
    "ap_llama3_scaling_ignored",  # rope_type "llama3" ignored: plain default frequencies
    "ap_llama3_freq_factors_swapped",  # low_freq_factor / high_freq_factor exchanged in the Llama-3 scaling
    "ap_gqa_tiled_heads",  # kv heads expanded with repeat (tile): q head h reads kv head h % nkv, not h // groups
    "ap_layernorms_swapped",  # attention_layernorm / feedforward_layernorm gains loaded into the wrong pre-norm
    "ap_mask_on_query_axis",  # padding applied on the query axis of the mask instead of the key axis
]
PADDING_ONLY = {"ap_mask_on_query_axis"}
CLEAN = [
    "rope_complex",  # q/k channels (rows, biases, qk-norm gains) permuted at load to adjacent pairs; complex multiply
    "scale_in_q_gain",  # softmax scale head_dim**-0.5 folded into the q-norm gain at load, scores unscaled
    "xielu_masked_sum",  # xIELU as beta x + a_p relu(x)^2 + a_n [x <= 0] (expm1(min(x, eps)) - x), no torch.where
    "norm_gain_folded",  # block / final RMSNorm gains folded into the columns of the following weights at load
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


def _to_pairs(d):
    """index list: new channel 2i <- old i, new 2i + 1 <- old i + d/2 (half-split -> adjacent pairs)"""
    h = d // 2
    return torch.stack((torch.arange(h), torch.arange(h) + h), -1).flatten()


def _llama3_inv_freq(rp, dim):
    b = _bug()
    base = float(rp["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if rp.get("rope_type", "default") == "default" or b == "ap_llama3_scaling_ignored":
        return inv
    if rp["rope_type"] != "llama3":
        raise NotImplementedError(rp["rope_type"])
    factor = float(rp["factor"])
    lo_f, hi_f = float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    if b == "ap_llama3_freq_factors_swapped":
        lo_f, hi_f = hi_f, lo_f
    old = rp["original_max_position_embeddings"]
    lo_wl, hi_wl = old / lo_f, old / hi_f
    wl = 2 * math.pi / inv
    out = torch.where(wl > lo_wl, inv / factor, inv)
    s = (old / wl - lo_f) / (hi_f - lo_f)
    smoothed = (1 - s) * out / factor + s * out
    medium = (wl >= hi_wl) & (wl <= lo_wl)
    return torch.where(medium, smoothed, out)


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, hd/2)"""
    cos, sin = cos[:, None], sin[:, None]
    if _bug() == "rope_complex":
        z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, g_in):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.g = self.nh // self.nkv
        self.eps = cfg.rms_norm_eps
        H = cfg.hidden_size
        bias = cfg.attention_bias

        def _get(name, n):
            w = sd[p + name + ".weight"].float().view(n, self.hd, H)
            bb = sd[p + name + ".bias"].float().view(n, self.hd) if bias else torch.zeros(n, self.hd)
            return w, bb

        wq, bq = _get("q_proj", self.nh)
        wk, bk = _get("k_proj", self.nkv)
        wv, bv = _get("v_proj", self.nkv)
        qg = sd[p + "q_norm.weight"].float()
        kg = sd[p + "k_norm.weight"].float()
        if b == "rope_complex":
            perm = _to_pairs(self.hd)
            wq, bq, wk, bk, qg, kg = wq[:, perm], bq[:, perm], wk[:, perm], bk[:, perm], qg[perm], kg[perm]
        if b == "scale_in_q_gain":
            qg = qg * self.hd**-0.5
        self.scale = 1.0 if b == "scale_in_q_gain" else self.hd**-0.5
        wkv = torch.stack((wk, wv), 1).reshape(2 * self.nkv * self.hd, H)
        bkv = torch.stack((bk, bv), 1).reshape(-1)
        wq = wq.reshape(-1, H)
        if g_in is not None:
            wq, wkv = wq * g_in[None, :], wkv * g_in[None, :]
        self.w_q, self.b_q = _P(wq), _P(bq.reshape(-1))
        self.w_kv, self.b_kv = _P(wkv), _P(bkv)
        self.q_gain, self.k_gain = _P(qg), _P(kg)
        self.w_o = _P(sd[p + "o_proj.weight"])
        bo = sd[p + "o_proj.bias"].float() if bias and b != "ap_o_proj_bias_dropped" else torch.zeros(H)
        self.b_o = _P(bo)

    def _qk_norm(self, x, g):
        """x (B, n, S, hd)"""
        if _bug() == "ap_qk_norm_full_width":
            B, n, S, hd = x.shape
            xt = x.transpose(1, 2).reshape(B, S, n * hd)
            y = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + self.eps)
            return y.view(B, S, n, hd).transpose(1, 2) * g
        return _norm(x, g, self.eps)

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        q = F.linear(x, self.w_q, self.b_q).view(B, S, self.nh, self.hd).transpose(1, 2)
        kv = F.linear(x, self.w_kv, self.b_kv).view(B, S, self.nkv, 2, self.hd)
        k, v = kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)
        if b == "ap_qk_norm_after_rope":
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            q, k = self._qk_norm(q, self.q_gain), self._qk_norm(k, self.k_gain)
        else:
            q, k = self._qk_norm(q, self.q_gain), self._qk_norm(k, self.k_gain)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if b == "ap_gqa_tiled_heads":
            k, v = k.repeat(1, self.g, 1, 1), v.repeat(1, self.g, 1, 1)
        else:
            k, v = k.repeat_interleave(self.g, 1), v.repeat_interleave(self.g, 1)
        s = (q @ k.transpose(-1, -2)) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = torch.softmax(s, -1) @ v
        out = F.linear(ctx.transpose(1, 2).reshape(B, S, -1), self.w_o, self.b_o)
        _rec(self.pre.rstrip("."), out)
        return out


class MLP(nn.Module):
    def __init__(self, sd, p, cfg, g_in):
        super().__init__()
        b = _bug()
        self.pre = p
        if cfg.hidden_act != "xielu":
            raise NotImplementedError(cfg.hidden_act)
        w_up = sd[p + "up_proj.weight"].float().t()
        if g_in is not None:
            w_up = g_in[:, None] * w_up
        self.w_up = _P(w_up)
        self.w_down = _P(sd[p + "down_proj.weight"].float().t())
        raw_p = sd[p + "act_fn.alpha_p"].float()
        raw_n = sd[p + "act_fn.alpha_n"].float()
        beta = sd[p + "act_fn.beta"].float()
        eps = sd[p + "act_fn.eps"].float()
        if b == "ap_xielu_alphas_swapped":
            raw_p, raw_n = raw_n, raw_p
        if b == "ap_xielu_no_softplus":
            a_p, a_n = raw_p, beta + raw_n
        elif b == "ap_xielu_alpha_n_no_beta":
            a_p, a_n = F.softplus(raw_p), F.softplus(raw_n)
        else:
            a_p, a_n = F.softplus(raw_p), beta + F.softplus(raw_n)
        self.a_p, self.a_n, self.beta, self.eps = _P(a_p), _P(a_n), _P(beta), _P(eps)

    def _act(self, x):
        b = _bug()
        if b == "xielu_masked_sum":
            neg = (x <= 0).to(x.dtype)
            neg_part = self.a_n * neg * (torch.expm1(torch.minimum(x, self.eps)) - x)
            return self.beta * x + self.a_p * F.relu(x).pow(2) + neg_part
        if b == "ap_xielu_elu_negative_branch":
            negb = self.a_n * torch.expm1(torch.minimum(x, self.eps)) + self.beta * x
        else:
            negb = self.a_n * (torch.expm1(torch.minimum(x, self.eps)) - x) + self.beta * x
        return torch.where(x > 0, self.a_p * x * x + self.beta * x, negb)

    def forward(self, x):
        out = self._act(x @ self.w_up) @ self.w_down
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
        ga = sd[p + "attention_layernorm.weight"].float()
        gf = sd[p + "feedforward_layernorm.weight"].float()
        if b == "ap_layernorms_swapped":
            ga, gf = gf, ga
        self.g_attn = None if fold else _P(ga)
        self.g_ffn = None if fold else _P(gf)
        self.attn = Attention(sd, p + "self_attn.", cfg, ga if fold else None)
        self.mlp = MLP(sd, p + "mlp.", cfg, gf if fold else None)

    def forward(self, h, allowed, cos, sin):
        h = h + self.attn(_norm(h, self.g_attn, self.eps), allowed, cos, sin)
        h = h + self.mlp(_norm(h, self.g_ffn, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class Apertus1p5Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok = _P(sd["model.embed_tokens.weight"])
        n_out = cfg.output_vocab_size or cfg.vocab_size
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings or b == "ap_head_tied_to_embed":
            head = sd["model.embed_tokens.weight"][:n_out]
        head = head.float()
        g_out = sd["model.norm.weight"].float()
        fold = b == "norm_gain_folded"
        if fold:
            head = head * g_out[None, :]
        self.head = _P(head)
        self.g_out = None if fold else _P(g_out)
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial_rotary_factor")
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = _llama3_inv_freq(rp, hd)

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if b == "ap_mask_on_query_axis":
            allowed = causal & keep[:, None, :, None]
        else:
            allowed = causal & keep[:, None, None, :]
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            h = blk(h, allowed, cos, sin)
        h = _norm(h, self.g_out, self.cfg.rms_norm_eps)
        if b != "norm_gain_folded":
            _rec("model.norm", h)
        logits = F.linear(h, self.head)
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
            logits = torch.zeros(B, S, self.head.shape[0], dtype=self.tok.dtype)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Apertus1p5Port(state_dict, config).eval()
