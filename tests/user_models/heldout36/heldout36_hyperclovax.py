"""Hand-written plain-PyTorch port of HyperCLOVA X (HyperCLOVAXForCausalLM, model_type "hyperclovax").

Architecture as this port implements it (everything in float32):
- LLaMA-style decoder with muP multipliers and Peri-Layer Normalization (an extra RMSNorm on each
  sub-layer's output).
- RMSNorm(x; w) = w * x / sqrt(mean(x**2, -1) + eps), eps = config.rms_norm_eps, the statistics in float32,
  the weight multiplied after the normalisation (plain w, not 1 + w).
- h_0 = E[ids] * embedding_multiplier        (embedding row gathered first, then scaled)
- block i (pre-norm + peri-norm):
      a   = Attn(RMSNorm(h; w_in))
      h   = h + residual_multiplier * RMSNorm(a; w_post1)          (post_norm1 on the branch output only)
      m   = MLP(RMSNorm(h; w_pre_mlp))
      h   = h + residual_multiplier * RMSNorm(m; w_post2)          (post_norm2 on the branch output only)
  with use_post_norm False the two peri-norms are the identity.
- Attn: q, k, v = x Wq + bq, x Wk + bk, x Wv + bv (attention_bias), head_dim = config.head_dim (may differ from
  hidden / heads); RoPE on q and k in the "rotate-half" (NeoX) layout: channel c pairs with c + head_dim / 2,
      inv_freq_j = theta ** (-2j / head_dim), angle = position * inv_freq_j,
      x' = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1];
  grouped-query attention: query head n uses kv head n // (heads / kv_heads) (repeat-interleave);
  scores = (q k^T) * attention_multiplier (the muP factor REPLACES 1/sqrt(head_dim)); causal mask (key j <= query
  i) and, with an attention_mask, padding keys masked (filled with the float32 minimum, so a fully masked padding
  query row is uniform instead of NaN); softmax in float32; out = concat_heads(P v) Wo + bo.
- positions: position_ids when given, else 0..T-1 (also with an attention mask, as Transformers does).
- MLP: (silu(x Wg + bg) * (x Wu + bu)) Wd + bd (mlp_bias).
- final: logits = RMSNorm(h; w_final) W_head^T * logits_scaling (MULTIPLIED, unlike Granite's divisor);
  the head is untied (tie_word_embeddings False).

Weight layout of this port (own names, built from Transformers' tensors at load time):
- tok_emb (V, H)                       <- model.embed_tokens.weight
- head_t (H, V)                        <- lm_head.weight, TRANSPOSED
- final_norm (H,)                      <- model.norm.weight
- inv_freq (head_dim / 2,) buffer      precomputed from rope_theta
- mup: dict of floats {emb, resid, attn, logits} (config multipliers, kept in the port's own dict)
- blocks[i]:
    norms (4, H) STACKED rows [pre_attn, post_attn, pre_mlp, post_mlp]  <- input_layernorm, post_norm1,
        post_attention_layernorm, post_norm2 (rows 1 and 3 are ones and unused when use_post_norm is False)
    wqkv_t (H, (n_q + 2 n_kv) * head_dim)   FUSED [q | k | v] and TRANSPOSED; bqkv fused [bq | bk | bv]
    wo_t (n_q * head_dim, H) TRANSPOSED; bo (H,)
    w13_t (H, 2 I)  FUSED [gate | up] and TRANSPOSED; b13 fused [bg | bu]
    w2_t (I, H) TRANSPOSED; b2 (H,)
  (the CLEAN variant "multipliers_folded" stores tok_emb * embedding_multiplier, head_t * logits_scaling and
  post-norm rows * residual_multiplier instead, and skips the three runtime multiplications.)
Debugging: set `model.trace = {}` before a call and the port records its intermediates there (emb_raw, emb,
rope_cos / rope_sin, per block "{i}.in_norm", q, k, v (before RoPE), attn_core, attn, post1, pre_mlp, gate, up,
act, mlp, post3, out; final_norm, head (logits before logits_scaling)).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "logits_scaling_divided",  # logits divided by logits_scaling (Granite's convention) instead of multiplied
    "embedding_multiplier_skipped",  # token embeddings not multiplied by embedding_multiplier
    "residual_multiplier_on_skip",  # residual_multiplier applied to the skip path, h = r * h + post_norm(out), not to out
    "attention_scale_head_dim",  # scores scaled by head_dim ** -0.5 instead of config.attention_multiplier
    "post_norm_on_residual_sum",  # peri-norm applied to the residual sum, h = norm(h + r * out) (post-LN), not to out
    "post_norms_swapped",  # loader maps post_norm1 -> post-MLP row and post_norm2 -> post-attention row of `norms`
    "rmsnorm_gemma_offset",  # RMSNorm scales by (1 + w) (Gemma convention) instead of w
    "rope_interleaved",  # RoPE rotates adjacent pairs (2j, 2j+1) (GPT-J layout) instead of (j, j + head_dim / 2)
    "gqa_heads_tiled",  # kv heads tiled (query head n uses kv head n % n_kv) instead of repeat-interleaved (n // rep)
    "qkv_split_kv_swapped",  # fused [q | k | v] output split with the k and v slices swapped
    "causal_mask_one_ahead",  # off-by-one causal mask: query i also sees key i + 1
    "lm_head_tied",  # head taken as the transposed embedding although tie_word_embeddings is False
    "padding_mask_ignored",  # attention_mask dropped: only the causal mask, padding keys are attended (padded only)
    "rope_angles_bf16",  # RoPE table (angles position * inv_freq, then cos / sin) computed in bfloat16, not float32
]
PADDING_ONLY = ["padding_mask_ignored"]
CLEAN = [
    "split_qkv",  # q, k, v from three matmuls on column slices of the fused weight instead of one fused matmul
    "sdpa_attention",  # F.scaled_dot_product_attention(scale=attention_multiplier) with a float mask, kv expanded
    "online_softmax",  # attention over key blocks of 8 with a running (max, sum, acc) (flash-style) softmax
    "rope_complex",  # RoPE as a complex multiply of (x[:d/2] + i x[d/2:]) by exp(i * angle)
    "multipliers_folded",  # embedding/logits multipliers folded into tok_emb/head_t, residual into post-norm rows
]


def _bug(name):
    return BUG == name


def rms_norm(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if _bug("rmsnorm_gemma_offset"):
        return (1.0 + w) * y
    return w * y


def rope_tables(positions, inv_freq):
    if _bug("rope_angles_bf16"):
        ang = positions[..., None].to(torch.bfloat16) * inv_freq.to(torch.bfloat16)
        return ang.cos().float(), ang.sin().float()
    else:
        ang = positions[..., None].float() * inv_freq  # (B, T, d/2), float32
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x (B, heads, T, d); cos/sin (B, T, d/2)."""
    cos, sin = cos[:, None], sin[:, None]
    d = x.shape[-1]
    if _bug("rope_interleaved"):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if _bug("rope_complex"):
        z = torch.complex(x[..., : d // 2].contiguous(), x[..., d // 2 :].contiguous())
        z = z * torch.complex(cos, sin)
        return torch.cat((z.real, z.imag), dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c = torch.cat((cos, cos), dim=-1)
    s = torch.cat((sin, sin), dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


class Block(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        g = lambda n: sd[p + n].float()
        H = cfg.hidden_size
        self.n_q, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.use_post_norm = bool(getattr(cfg, "use_post_norm", True))
        ones = torch.ones(H)
        post1 = g("post_norm1.weight") if self.use_post_norm else ones
        post2 = g("post_norm2.weight") if self.use_post_norm else ones
        if _bug("post_norms_swapped"):
            post1, post2 = post2, post1
        self.norms = nn.Parameter(
            torch.stack([g("input_layernorm.weight"), post1, g("post_attention_layernorm.weight"), post2])
        )
        wq, wk, wv = g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight")
        self.wqkv_t = nn.Parameter(torch.cat([wq, wk, wv], 0).t().contiguous())
        if cfg.attention_bias:
            bqkv = torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"), g("self_attn.v_proj.bias")])
            bo = g("self_attn.o_proj.bias")
        else:
            bqkv, bo = torch.zeros(self.wqkv_t.shape[1]), torch.zeros(H)
        self.bqkv = nn.Parameter(bqkv)
        self.wo_t = nn.Parameter(g("self_attn.o_proj.weight").t().contiguous())
        self.bo = nn.Parameter(bo)
        self.w13_t = nn.Parameter(torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")], 0).t().contiguous())
        self.w2_t = nn.Parameter(g("mlp.down_proj.weight").t().contiguous())
        I = self.w2_t.shape[0]
        if cfg.mlp_bias:
            b13 = torch.cat([g("mlp.gate_proj.bias"), g("mlp.up_proj.bias")])
            b2 = g("mlp.down_proj.bias")
        else:
            b13, b2 = torch.zeros(2 * I), torch.zeros(H)
        self.b13 = nn.Parameter(b13)
        self.b2 = nn.Parameter(b2)
        self.eps = cfg.rms_norm_eps
        self.folded = _bug("multipliers_folded")
        if self.folded:  # residual_multiplier folded into the post-norm rows (or the output projections) at load
            r = float(cfg.residual_multiplier)
            with torch.no_grad():
                if self.use_post_norm:
                    self.norms[1].mul_(r)
                    self.norms[3].mul_(r)
                else:
                    for t in (self.wo_t, self.bo, self.w2_t, self.b2):
                        t.mul_(r)

    # -- attention -------------------------------------------------------------------------------------------------
    def qkv(self, x):
        nq, nk = self.n_q * self.hd, self.n_kv * self.hd
        if _bug("split_qkv"):
            w, b = self.wqkv_t, self.bqkv
            q = x @ w[:, :nq] + b[:nq]
            k = x @ w[:, nq : nq + nk] + b[nq : nq + nk]
            v = x @ w[:, nq + nk :] + b[nq + nk :]
        else:
            y = x @ self.wqkv_t + self.bqkv
            q, k, v = y.split([nq, nk, nk], dim=-1)
        if _bug("qkv_split_kv_swapped"):
            k, v = v, k
        return q, k, v

    def attention(self, x, cos, sin, allowed, mult, rec):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        rec("q", q), rec("k", k), rec("v", v)
        q = q.view(B, T, self.n_q, self.hd).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_q // self.n_kv
        if _bug("gqa_heads_tiled"):
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = self.hd**-0.5 if _bug("attention_scale_head_dim") else mult["attn"]
        neg = torch.finfo(torch.float32).min
        if _bug("sdpa_attention"):
            bias = torch.zeros(allowed.shape).masked_fill(~allowed, neg)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        elif _bug("online_softmax"):
            o = self._online(q, k, v, allowed, scale, neg)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, neg)
            o = torch.softmax(s, dim=-1, dtype=torch.float32) @ v
        o = o.transpose(1, 2).reshape(B, T, self.n_q * self.hd)
        rec("attn_core", o)
        return o @ self.wo_t + self.bo

    @staticmethod
    def _online(q, k, v, allowed, scale, neg, block=8):
        B, Hh, T, _ = q.shape
        m = torch.full((B, Hh, T, 1), -math.inf)
        l = torch.zeros(B, Hh, T, 1)
        acc = torch.zeros(B, Hh, T, v.shape[-1])
        for s0 in range(0, k.shape[2], block):
            kb, vb = k[:, :, s0 : s0 + block], v[:, :, s0 : s0 + block]
            s = (q @ kb.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed[..., s0 : s0 + block], neg)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            corr = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ vb
            m = m_new
        return acc / l

    def mlp(self, x, rec):
        I = self.w2_t.shape[0]
        gu = x @ self.w13_t + self.b13
        gate, up = gu[..., :I], gu[..., I:]
        rec("gate", gate), rec("up", up)
        act = F.silu(gate)
        rec("act", act)
        return (act * up) @ self.w2_t + self.b2

    # -- block -----------------------------------------------------------------------------------------------------
    def _branch(self, h, out, row, mult, rec):
        """h + r * post_norm(out), with the peri-norm of `row` (identity without use_post_norm)."""
        r = 1.0 if self.folded else mult["resid"]  # folded: r lives in the post-norm row / output projection
        if not self.use_post_norm:
            return h + r * out
        w = self.norms[row]
        if _bug("residual_multiplier_on_skip"):
            n = rms_norm(out, w, self.eps)
            rec(f"post{row}", n)
            return r * h + n
        if _bug("post_norm_on_residual_sum"):
            n = rms_norm(h + r * out, w, self.eps)
            rec(f"post{row}", n)
            return n
        n = rms_norm(out, w, self.eps)
        rec(f"post{row}", n)
        return h + r * n

    def forward(self, h, cos, sin, allowed, mult, rec):
        x = rms_norm(h, self.norms[0], self.eps)
        rec("in_norm", x)
        a = self.attention(x, cos, sin, allowed, mult, rec)
        rec("attn", a)
        h = self._branch(h, a, 1, mult, rec)
        x = rms_norm(h, self.norms[2], self.eps)
        rec("pre_mlp", x)
        m = self.mlp(x, rec)
        rec("mlp", m)
        h = self._branch(h, m, 3, mult, rec)
        rec("out", h)
        return h


class HyperClovaXPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.mup = {
            "emb": float(cfg.embedding_multiplier),
            "resid": float(cfg.residual_multiplier),
            "attn": float(cfg.attention_multiplier if cfg.attention_multiplier is not None else cfg.head_dim**-0.5),
            "logits": float(cfg.logits_scaling),
        }
        self.tok_emb = nn.Parameter(sd["model.embed_tokens.weight"].float().clone())
        tied = bool(getattr(cfg, "tie_word_embeddings", False)) or "lm_head.weight" not in sd
        if tied or _bug("lm_head_tied"):
            self.head_t = nn.Parameter(self.tok_emb.detach().t().contiguous())
        else:
            self.head_t = nn.Parameter(sd["lm_head.weight"].float().t().contiguous())
        self.final_norm = nn.Parameter(sd["model.norm.weight"].float().clone())
        self.blocks = nn.ModuleList(Block(sd, f"model.layers.{i}.", cfg) for i in range(cfg.num_hidden_layers))
        rp = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        d = cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, d, 2).float() / d), persistent=False)
        self.folded = _bug("multipliers_folded")
        if self.folded:  # exact alternative: constants folded into the weights once, at load
            with torch.no_grad():
                self.tok_emb.mul_(self.mup["emb"])
                self.head_t.mul_(self.mup["logits"])
        self.trace = None  # a dict to record intermediates into (debugging)

    def _recorder(self, prefix):
        """Records intermediates under `prefix + key` into self.trace when it is a dict (debugging)."""
        tr = self.trace

        def rec(key, val):
            if tr is not None:
                tr[prefix + key] = val

        return rec

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        rec = self._recorder("")
        h = self.tok_emb[input_ids]
        rec("emb_raw", h)
        if not (self.folded or _bug("embedding_multiplier_skipped")):
            h = h * self.mup["emb"]
        rec("emb", h)
        if position_ids is None:
            position_ids = torch.arange(T).unsqueeze(0).expand(B, T)
        cos, sin = rope_tables(position_ids, self.inv_freq)
        rec("rope_cos", torch.cat((cos, cos), -1)), rec("rope_sin", torch.cat((sin, sin), -1))
        qi = torch.arange(T)[:, None]
        kj = torch.arange(T)[None, :]
        allowed = (kj <= qi + 1) if _bug("causal_mask_one_ahead") else (kj <= qi)
        allowed = allowed[None, None].expand(B, 1, T, T)
        if attention_mask is not None and not _bug("padding_mask_ignored"):
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        for i, blk in enumerate(self.blocks):
            h = blk(h, cos, sin, allowed, self.mup, self._recorder(f"{i}."))
        h = rms_norm(h, self.final_norm, self.eps)
        rec("final_norm", h)
        logits = h @ self.head_t
        rec("head", logits)
        if self.folded:
            return logits
        if _bug("logits_scaling_divided"):
            return logits / self.mup["logits"]
        return logits * self.mup["logits"]


def build(state_dict, config):
    return HyperClovaXPort(state_dict, config).eval()
