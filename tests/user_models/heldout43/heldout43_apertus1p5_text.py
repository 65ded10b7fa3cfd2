"""Hand-written PyTorch port of Apertus 1.5's text decoder (``Apertus1p5TextForCausalLM``).

Architecture, as this port computes it (B batch, T tokens, D hidden, H query heads, G key/value heads,
d = D / H head size, I MLP width, V input vocabulary, Vo output vocabulary):

* Embedding: ``x = E[ids]`` with ``E`` of shape (V, D). No embedding scaling.
* L pre-norm decoder blocks, each
      ``x = x + Attn(RMSNorm_attn(x))``
      ``x = x + MLP(RMSNorm_ffn(x))``
  then a final ``RMSNorm_out`` and the LM head.
* RMSNorm(v) = g * v / sqrt(mean(v^2) + eps), eps = ``rms_norm_eps``, gain used as is (no ``1 + g`` offset),
  statistics in float32.
* Attention (GQA, with biases on q, k, v and o when ``attention_bias``):
      q = x Wq + bq -> (B, H, T, d);  k = x Wk + bk, v = x Wv + bv -> (B, G, T, d)
      QK-norm: q and k are RMS-normalised PER HEAD over their d features (own gains ``q_gain``/``k_gain``
      of size d), BEFORE the rotary embedding.
      RoPE, "rotate-half" (NeoX) pairing: feature j is paired with feature j + d/2, both at frequency
      inv_freq[j], j < d/2:  out_j = a cos - b sin,  out_{j+d/2} = b cos + a sin  (a = x_j, b = x_{j+d/2}).
      Query head h reads key/value head ``h // (H/G)`` (consecutive query heads share a kv head).
      scores = q k^T / sqrt(d); causal mask and, with an attention_mask, key padding mask (masked scores
      set to the float32 minimum, so a fully masked row stays finite); softmax in float32; out = P v,
      heads concatenated (head-major) -> Wo + bo.
* RoPE frequencies: llama3 scaling of inv_freq_j = theta^(-2j/d):  with wavelength w = 2 pi / inv_freq,
  L0 = original_max_position_embeddings, w_lo = L0 / low_freq_factor, w_hi = L0 / high_freq_factor:
      w < w_hi            -> inv_freq (unchanged)
      w > w_lo            -> inv_freq / factor
      otherwise           -> (1 - s) inv_freq / factor + s inv_freq,  s = (L0 / w - low) / (high - low)
  angles = position * inv_freq; positions are the given ``position_ids`` or 0..T-1. No attention scaling.
* MLP (NOT gated): ``down(xIELU(up(x)))``, no biases. xIELU with per-layer learned scalars:
      a_p = softplus(alpha_p),  a_n = beta + softplus(alpha_n)
      xIELU(x) = a_p x^2 + beta x                              for x > 0
               = a_n (expm1(min(x, eps)) - x) + beta x          for x <= 0
  (beta = 0.5 and eps = -1e-6 are buffers of the checkpoint, read from it.)
* LM head: its own (untied) matrix of Vo = ``output_vocab_size`` rows (the pruned text-only prefix of the
  vocabulary); the input embedding keeps all V rows. logits (B, T, Vo).

Weight layout of this port (own names; converted in ``build`` from the Transformers names):
    tok_emb      (V, D)                       model.embed_tokens.weight
    w_qkv        (L, D, (H + 2G) d)           q/k/v_proj.weight, fused along the output and TRANSPOSED
    b_qkv        (L, (H + 2G) d)              q/k/v_proj.bias, fused
    w_out        (L, H d, D)                  o_proj.weight transposed
    b_out        (L, D)                       o_proj.bias
    qk_gain      (L, 2, d)                    [q_norm.weight, k_norm.weight] stacked
    ln_gain      (L, 2, D)                    [attention_layernorm.weight, feedforward_layernorm.weight] stacked
    w_up         (L, D, I)                    mlp.up_proj.weight transposed
    w_down       (L, I, D)                    mlp.down_proj.weight transposed
    act          (L, 4)                       [alpha_p, alpha_n, beta, eps] of mlp.act_fn (raw, pre-softplus)
    out_gain     (D,)                         model.norm.weight
    head         (Vo, D)                      lm_head.weight
    inv_freq     (d/2,)  buffer               llama3-scaled rotary frequencies computed from the config
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "xielu_no_softplus",  # xIELU uses the raw alpha_p / alpha_n parameters instead of softplus(...) of them
    "xielu_alpha_n_no_beta",  # negative-branch coefficient is softplus(alpha_n), forgetting the "+ beta" offset
    "xielu_exp_not_expm1",  # negative branch uses exp(min(x, eps)) instead of expm1(min(x, eps))
    "qk_norm_after_rope",  # per-head q/k RMSNorm applied after the rotary embedding instead of before it
    "qk_norm_full_width",  # q/k RMS statistics taken over all heads at once instead of per head
    "rope_interleaved",  # GPT-J pairing (2j, 2j+1) instead of rotate-half pairing (j, j + d/2)
    "rope_no_llama3",  # plain theta^(-2j/d) frequencies, llama3 low/high frequency scaling ignored
    "llama3_smooth_swapped",  # llama3 medium band interpolates with s and (1 - s) swapped
    "gqa_tiled",  # query head h reads kv head h % G (tiled) instead of h // (H/G) (interleaved)
    "attn_no_scale",  # no 1/sqrt(d) on the scores ("QK-norm already bounds them")
    "norm_gain_offset",  # RMSNorm multiplies by (1 + g) (Gemma convention) instead of g
    "residual_from_normed",  # attention residual adds the normalised input instead of the raw stream
    "head_tied_to_embedding",  # LM head taken as the first Vo rows of the input embedding (tied), not lm_head
    "pad_mask_ignored",  # attention_mask dropped: only the causal mask, padded keys are attended
]

PADDING_ONLY = ["pad_mask_ignored"]

CLEAN = [
    "rope_complex",  # RoPE as complex multiplication of (x_j + i x_{j+d/2}) by exp(i angle)
    "attn_online_softmax",  # attention over key blocks of 8 with a running max / sum (flash-style)
    "xielu_factored",  # xIELU as beta*x + relu-part + negative-part with masks, beta*x factored out
    "fold_norm_gains",  # attention/ffn RMSNorm gains folded into the rows of w_qkv / w_up at build
    "scale_in_q_gain",  # 1/sqrt(d) folded into the q_norm gain at build, scores left unscaled
]


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def _rms(v, gain, eps):
    """RMS-normalise over the last dim, then multiply by gain (None: no gain)."""
    dtype = v.dtype
    v32 = v.float()
    v32 = v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)
    if gain is None:
        return v32.to(dtype)
    if BUG == "norm_gain_offset":
        return (1.0 + gain) * v32.to(dtype)
    return gain * v32.to(dtype)


def _llama3_inv_freq(rope, head_dim):
    theta = float(rope["rope_theta"])
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.get("rope_type", "default") != "llama3" or BUG == "rope_no_llama3":
        return inv.float()
    factor = float(rope["factor"])
    lo = float(rope["low_freq_factor"])
    hi = float(rope["high_freq_factor"])
    ctx = float(rope["original_max_position_embeddings"])
    wl_lo, wl_hi = ctx / lo, ctx / hi
    out = []
    for f in inv.tolist():
        wave = 2.0 * math.pi / f
        if wave < wl_hi:
            out.append(f)
        elif wave > wl_lo:
            out.append(f / factor)
        else:
            s = (ctx / wave - lo) / (hi - lo)
            if BUG == "llama3_smooth_swapped":
                out.append(s * f / factor + (1.0 - s) * f)
            else:
                out.append((1.0 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64).float()


def _rope(x, cos, sin):
    """x (B, h, T, d); cos/sin (B, T, d/2)."""
    cos = cos[:, None]
    sin = sin[:, None]
    half = x.shape[-1] // 2
    if BUG == "rope_interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        ra = a * cos - b * sin
        rb = b * cos + a * sin
        return torch.stack((ra, rb), dim=-1).flatten(-2)
    if BUG == "rope_complex":
        z = torch.complex(x[..., :half].float(), x[..., half:].float())
        r = z * torch.complex(cos.float(), sin.float())
        return torch.cat((r.real, r.imag), dim=-1).to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _xielu(x, p):
    ap_raw, an_raw, beta, eps = p[0], p[1], p[2], p[3]
    if BUG == "xielu_no_softplus":
        a_p = ap_raw
        a_n = beta + an_raw
    elif BUG == "xielu_alpha_n_no_beta":
        a_p = F.softplus(ap_raw)
        a_n = F.softplus(an_raw)
    else:
        a_p = F.softplus(ap_raw)
        a_n = beta + F.softplus(an_raw)
    if BUG == "xielu_factored":
        pos = (x > 0).to(x.dtype)
        xn = torch.clamp(x, max=0.0)
        neg_part = a_n * (torch.expm1(torch.minimum(xn, eps)) - xn)
        return beta * x + pos * (a_p * x * x) + (1.0 - pos) * neg_part
    em = torch.exp(torch.minimum(x, eps)) if BUG == "xielu_exp_not_expm1" else torch.expm1(torch.minimum(x, eps))
    return torch.where(x > 0, a_p * x * x + beta * x, (em - x) * a_n + beta * x)


# ----------------------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------------------


class ApertusText(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.D = cfg.hidden_size
        self.H = cfg.num_attention_heads
        self.G = cfg.num_key_value_heads or self.H
        self.d = getattr(cfg, "head_dim", None) or self.D // self.H
        self.L = cfg.num_hidden_layers
        self.I = cfg.intermediate_size
        self.V = cfg.vocab_size
        self.Vo = getattr(cfg, "output_vocab_size", None) or self.V
        self.eps = float(cfg.rms_norm_eps)
        self.use_bias = bool(getattr(cfg, "attention_bias", False))
        self.score_scale = self.d**-0.5
        qkv = (self.H + 2 * self.G) * self.d
        L, D, I, d = self.L, self.D, self.I, self.d
        self.tok_emb = nn.Parameter(torch.zeros(self.V, D))
        self.w_qkv = nn.Parameter(torch.zeros(L, D, qkv))
        self.b_qkv = nn.Parameter(torch.zeros(L, qkv))
        self.w_out = nn.Parameter(torch.zeros(L, self.H * d, D))
        self.b_out = nn.Parameter(torch.zeros(L, D))
        self.qk_gain = nn.Parameter(torch.ones(L, 2, d))
        self.ln_gain = nn.Parameter(torch.ones(L, 2, D))
        self.w_up = nn.Parameter(torch.zeros(L, D, I))
        self.w_down = nn.Parameter(torch.zeros(L, I, D))
        self.act = nn.Parameter(torch.zeros(L, 4))
        self.out_gain = nn.Parameter(torch.ones(D))
        self.head = nn.Parameter(torch.zeros(self.Vo, D))
        self.register_buffer("inv_freq", torch.zeros(d // 2), persistent=False)
        self.gains_folded = False

    # --- attention ------------------------------------------------------------------------------------
    def _attend(self, q, k, v, allowed, scale):
        """q (B, H, T, d); k, v (B, H, T, d) already expanded; allowed (B, 1, T, T) bool."""
        neg = torch.finfo(torch.float32).min
        if BUG == "attn_online_softmax":
            B, H, T, d = q.shape
            m = torch.full((B, H, T, 1), neg, dtype=torch.float32)
            s = torch.zeros(B, H, T, 1, dtype=torch.float32)
            acc = torch.zeros(B, H, T, d, dtype=torch.float32)
            for j in range(0, T, 8):
                sc = (q @ k[:, :, j : j + 8].transpose(-1, -2)).float() * scale
                sc = sc.masked_fill(~allowed[..., j : j + 8], neg)
                m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
                corr = torch.exp(m - m_new)
                p = torch.exp(sc - m_new)
                s = s * corr + p.sum(-1, keepdim=True)
                acc = acc * corr + p @ v[:, :, j : j + 8].float()
                m = m_new
            return (acc / s).to(q.dtype)
        sc = (q @ k.transpose(-1, -2)).float() * scale
        sc = sc.masked_fill(~allowed, neg)
        p = torch.softmax(sc, dim=-1).to(q.dtype)
        return p @ v

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        H, G, d, D = self.H, self.G, self.d, self.D
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        ang = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, d/2)
        cos, sin = ang.cos(), ang.sin()

        allowed = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None].expand(B, 1, T, T)
        if attention_mask is not None and BUG != "pad_mask_ignored":
            allowed = allowed & attention_mask.bool()[:, None, None, :]

        scale = self.score_scale
        if BUG == "attn_no_scale" or self.gains_folded == "scale":
            scale = 1.0

        rep = H // G
        if BUG == "gqa_tiled":
            kv_of_head = torch.arange(H, device=dev) % G
        else:
            kv_of_head = torch.arange(H, device=dev) // rep

        x = self.tok_emb[input_ids]
        for i in range(self.L):
            # ---- attention sublayer
            ln_a = None if self.gains_folded is True else self.ln_gain[i, 0]
            h = _rms(x, ln_a, self.eps)
            qkv = h @ self.w_qkv[i]
            if self.use_bias:
                qkv = qkv + self.b_qkv[i]
            q, k, v = qkv.split([H * d, G * d, G * d], dim=-1)
            if BUG == "qk_norm_full_width":
                q = _rms(q, self.qk_gain[i, 0].repeat(H), self.eps)
                k = _rms(k, self.qk_gain[i, 1].repeat(G), self.eps)
            q = q.view(B, T, H, d).transpose(1, 2)
            k = k.view(B, T, G, d).transpose(1, 2)
            v = v.view(B, T, G, d).transpose(1, 2)
            if BUG not in ("qk_norm_after_rope", "qk_norm_full_width"):
                q = _rms(q, self.qk_gain[i, 0], self.eps)
                k = _rms(k, self.qk_gain[i, 1], self.eps)
            q = _rope(q, cos, sin)
            k = _rope(k, cos, sin)
            if BUG == "qk_norm_after_rope":
                q = _rms(q, self.qk_gain[i, 0], self.eps)
                k = _rms(k, self.qk_gain[i, 1], self.eps)
            k = k[:, kv_of_head]
            v = v[:, kv_of_head]
            o = self._attend(q, k, v, allowed, scale)
            o = o.transpose(1, 2).reshape(B, T, H * d) @ self.w_out[i]
            if self.use_bias:
                o = o + self.b_out[i]
            x = (h if BUG == "residual_from_normed" else x) + o

            # ---- MLP sublayer
            ln_f = None if self.gains_folded is True else self.ln_gain[i, 1]
            h = _rms(x, ln_f, self.eps)
            u = h @ self.w_up[i]
            x = x + _xielu(u, self.act[i]) @ self.w_down[i]

        x = _rms(x, self.out_gain, self.eps)
        head = self.tok_emb[: self.Vo] if BUG == "head_tied_to_embedding" else self.head
        return x @ head.t()


# ----------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------


def build(state_dict, config):
    sd = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state_dict.items()}
    m = ApertusText(config)
    L = m.L

    def lay(i, name):
        return sd[f"layers.{i}.{name}"].float()

    with torch.no_grad():
        m.tok_emb.copy_(sd["embed_tokens.weight"])
        for i in range(L):
            wq, wk, wv = (
                lay(i, "self_attn.q_proj.weight"),
                lay(i, "self_attn.k_proj.weight"),
                lay(i, "self_attn.v_proj.weight"),
            )
            m.w_qkv[i].copy_(torch.cat([wq, wk, wv], dim=0).t())
            if m.use_bias:
                m.b_qkv[i].copy_(
                    torch.cat(
                        [
                            lay(i, "self_attn.q_proj.bias"),
                            lay(i, "self_attn.k_proj.bias"),
                            lay(i, "self_attn.v_proj.bias"),
                        ]
                    )
                )
                m.b_out[i].copy_(lay(i, "self_attn.o_proj.bias"))
            m.w_out[i].copy_(lay(i, "self_attn.o_proj.weight").t())
            m.qk_gain[i, 0].copy_(lay(i, "self_attn.q_norm.weight"))
            m.qk_gain[i, 1].copy_(lay(i, "self_attn.k_norm.weight"))
            m.ln_gain[i, 0].copy_(lay(i, "attention_layernorm.weight"))
            m.ln_gain[i, 1].copy_(lay(i, "feedforward_layernorm.weight"))
            m.w_up[i].copy_(lay(i, "mlp.up_proj.weight").t())
            m.w_down[i].copy_(lay(i, "mlp.down_proj.weight").t())
            m.act[i].copy_(
                torch.stack(
                    [
                        lay(i, "mlp.act_fn.alpha_p").reshape(()),
                        lay(i, "mlp.act_fn.alpha_n").reshape(()),
                        lay(i, "mlp.act_fn.beta").reshape(()),
                        lay(i, "mlp.act_fn.eps").reshape(()),
                    ]
                )
            )
        m.out_gain.copy_(sd["norm.weight"])
        head_key = "lm_head.weight" if "lm_head.weight" in sd else "embed_tokens.weight"
        m.head.copy_(sd[head_key][: m.Vo])
        m.inv_freq.copy_(_llama3_inv_freq(config.rope_parameters, m.d))

        if BUG == "fold_norm_gains":
            # W^T (g * x) == (diag(g) W^T) x : scale the input rows of the transposed matrices
            m.w_qkv.mul_(m.ln_gain[:, 0, :, None])
            m.w_up.mul_(m.ln_gain[:, 1, :, None])
            m.gains_folded = True
        elif BUG == "scale_in_q_gain":
            m.qk_gain[:, 0].mul_(m.d**-0.5)
            m.gains_folded = "scale"
    return m.float().eval()
