"""A from-scratch PyTorch port of Gemma 3's text decoder (Transformers model type ``gemma3_text``,
``Gemma3ForCausalLM``), float32, no KV cache.

Architecture (B batch, T tokens, H = hidden_size, nq / nkv query / key-value heads, d = head_dim,
I = intermediate_size, L layers, V vocab):

    h_0 = E[ids] * sqrt(H)                                    (embedding scaled by the *normaliser* sqrt(H))
    for each layer l (type t_l = config.layer_types[l], "sliding_attention" or "full_attention"):
        x   = RMS(h, g_in)                                      RMS(x, g) = x / sqrt(mean(x^2) + eps) * (1 + g)
        q,k,v = x Wq, x Wk, x Wv                                (B, T, nq|nkv|nkv, d)
        q   = RMS_d(q, g_q);  k = RMS_d(k, g_k)                 per-head RMSNorm over d (QK-norm), before RoPE
        q,k = RoPE_t(q, pos), RoPE_t(k, pos)                    half-split ("NeoX") rotation, inv_freq per type:
              sliding: theta = 10_000, default;   full: theta = 1e6, "linear" -> inv_freq / factor (8)
        s   = q k^T * query_pre_attn_scalar^-0.5                (NOT head_dim^-0.5); GQA: query head j uses
                                                                kv head j // (nq / nkv)
              (optional tanh soft-cap of s by attn_logit_softcapping, None here)
        mask: causal, key not padding, and for sliding layers  q_idx - k_idx < sliding_window
        a   = softmax(s + mask) v  -> (B, T, nq*d) Wo
        h   = h + RMS(a, g_post_attn)                           "sandwich" norm: normed *before* the residual add
        x   = RMS(h, g_pre_ff)
        m   = (gelu_tanh(x Wg) * (x Wu)) Wd
        h   = h + RMS(m, g_post_ff)
    logits = RMS(h, g_final) E^T                                (tied lm_head; optional final tanh soft-cap)

Weight layout (my own, converted in ``build`` from the checkpoint's state dict):
    tok_table  (V, H)                    input embedding table (unscaled); also the output projection when tied
    out_table  (V, H) or absent          a separate lm_head only when the checkpoint's differs from the table
    wqkv       (L, H, (nq + 2 nkv) d)    stacked, transposed (in -> out) fused [q | k | v] projection
    wo         (L, nq d, H)              stacked, transposed output projection
    w_gate_up  (L, H, 2 I)               stacked, transposed fused [gate | up]
    w_down     (L, I, H)                 stacked, transposed down projection
    norms      (L, 4, H)                 raw RMSNorm weights g (the model uses 1 + g), rows
                                         [input, post_attention, pre_feedforward, post_feedforward]
    qk_norms   (L, 2, d)                 raw [q_norm, k_norm] weights
    final_norm (H,)
    buffers: inv_freq_<type> (d/2,) per layer type (inv_freq_scaled_<type>: the variant read by a bug), and
             cos_<type> / sin_<type> (max_position_embeddings, d) tables read by the "rope_table" variant.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qk_norm_plain_weight",  # q_norm / k_norm multiply by g instead of (1 + g) (copied from Qwen3's QK-norm)
    "scale_head_dim",  # attention scores scaled by head_dim**-0.5 instead of query_pre_attn_scalar**-0.5
    "prescaled_tied_embed",  # build bakes sqrt(H) into the tied table, so the lm_head logits are scaled by sqrt(H) too
    "rope_scaling_on_local",  # the full-attention "linear" factor is also applied to the sliding layers' RoPE
    "sliding_window_inclusive",  # off-by-one: sliding layers keep q_idx - k_idx <= window (window + 1 keys)
    "legacy_layer_pattern",  # layer types from the legacy sliding_window_pattern=6 rule, ignoring config.layer_types
    "gelu_exact",  # MLP uses exact (erf) GELU instead of gelu_pytorch_tanh (the tanh approximation)
    "llama_norm_names",  # loader maps post_attention_layernorm to the pre-FFN norm and pre_feedforward to post-attn
    "qk_norm_after_rope",  # QK RMSNorm applied after RoPE instead of before (the weight does not commute)
    "kv_heads_tiled",  # GQA repeats kv heads tiled (head j -> j % nkv) instead of interleaved (j // n_rep)
    "rope_interleaved",  # RoPE rotates adjacent pairs (2i, 2i+1) (GPT-J style) instead of the half-split pairs
    "sliding_mask_drops_padding",  # the sliding-window mask is built causal+window only, padding keys not masked
    "gemma2_softcap_default",  # final_logit_softcapping None read as Gemma 2's default 30.0 (tanh cap applied)
    "gate_up_swapped",  # fused gate_up split as [up | gate]: GELU applied to the up projection
]

PADDING_ONLY = ["sliding_mask_drops_padding"]

CLEAN = [
    "split_qkv",  # three separate matmuls on slices of the fused qkv weight instead of one fused matmul
    "sdpa",  # F.scaled_dot_product_attention with an additive float mask and explicit scale
    "complex_rope",  # RoPE as a complex multiply of (x1 + i x2) by exp(i pos inv_freq)
    "rope_table",  # cos/sin precomputed for all max_position_embeddings positions, gathered by position_ids
    "grouped_gqa",  # GQA by reshaping queries into (nkv, n_rep) groups instead of repeating k/v
]


def _bug():
    return BUG


def _rms(x, g, eps, plus_one=True):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1.0 + g.float()) if plus_one else g.float())


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x, freqs):
    """x: (B, n, T, d); freqs: (B, T, d/2) angles."""
    bug = _bug()
    if bug == "rope_interleaved":
        cos = freqs.cos().repeat_interleave(2, dim=-1)[:, None]
        sin = freqs.sin().repeat_interleave(2, dim=-1)[:, None]
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rot = torch.stack((-x_odd, x_even), dim=-1).flatten(-2)
        return x * cos + rot * sin
    if bug == "complex_rope":
        half = x.shape[-1] // 2
        xc = torch.complex(x[..., :half].contiguous(), x[..., half:].contiguous())
        rc = torch.complex(freqs.cos(), freqs.sin())[:, None]
        yc = xc * rc
        return torch.cat((yc.real, yc.imag), dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return x * emb.cos() + _rotate_half(x) * emb.sin()


def _apply_rope_table(x, cos, sin):
    """x: (B, n, T, d); cos/sin: (B, T, d) gathered from the precomputed table."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Gemma3TextPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.H = config.hidden_size
        self.L = config.num_hidden_layers
        self.nq = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or self.H // self.nq
        self.I = config.intermediate_size
        self.V = config.vocab_size
        self.eps = config.rms_norm_eps
        qkv_out = (self.nq + 2 * self.nkv) * self.d
        self.tok_table = nn.Parameter(torch.zeros(self.V, self.H))
        self.out_table = None
        self.wqkv = nn.Parameter(torch.zeros(self.L, self.H, qkv_out))
        self.wo = nn.Parameter(torch.zeros(self.L, self.nq * self.d, self.H))
        self.w_gate_up = nn.Parameter(torch.zeros(self.L, self.H, 2 * self.I))
        self.w_down = nn.Parameter(torch.zeros(self.L, self.I, self.H))
        self.norms = nn.Parameter(torch.zeros(self.L, 4, self.H))
        self.qk_norms = nn.Parameter(torch.zeros(self.L, 2, self.d))
        self.final_norm = nn.Parameter(torch.zeros(self.H))
        self.embed_prescaled = False
        for t in ("sliding_attention", "full_attention"):
            self.register_buffer(f"inv_freq_{t}", self._inv_freq(t, local_gets_factor=False), persistent=False)
            self.register_buffer(f"inv_freq_scaled_{t}", self._inv_freq(t, local_gets_factor=True), persistent=False)
            pos = torch.arange(config.max_position_embeddings, dtype=torch.float)
            ang = pos[:, None] * getattr(self, f"inv_freq_{t}")[None]
            emb = torch.cat((ang, ang), dim=-1)
            self.register_buffer(f"cos_{t}", emb.cos(), persistent=False)
            self.register_buffer(f"sin_{t}", emb.sin(), persistent=False)

    # ---- configuration helpers -------------------------------------------------------------------
    def _inv_freq(self, layer_type, local_gets_factor):
        params = self.config.rope_parameters
        p = params[layer_type] if layer_type in params else params
        base = p["rope_theta"]
        d = self.d
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        factor_src = p
        if local_gets_factor and layer_type == "sliding_attention":
            factor_src = params.get("full_attention", p)  # the scaling dict read for every layer
        if factor_src.get("rope_type", "default") == "linear":
            inv = inv / factor_src["factor"]
        return inv

    def _layer_types(self):
        if _bug() == "legacy_layer_pattern":
            pattern = getattr(self.config, "sliding_window_pattern", None) or getattr(
                self.config, "_sliding_window_pattern", 6
            )
            return ["sliding_attention" if bool((i + 1) % pattern) else "full_attention" for i in range(self.L)]
        return list(self.config.layer_types)

    def _scaling(self):
        if _bug() == "scale_head_dim":
            return self.d**-0.5
        return self.config.query_pre_attn_scalar**-0.5

    # ---- blocks ----------------------------------------------------------------------------------
    def _attention(self, l, x, rope, mask):
        """x: (B, T, H) normed; rope: per-layer rotation callable; mask: (B, T, T) bool, True = keep."""
        bug = _bug()
        B, T, _ = x.shape
        nq, nkv, d = self.nq, self.nkv, self.d
        w = self.wqkv[l]
        if bug == "split_qkv":
            q = x @ w[:, : nq * d]
            k = x @ w[:, nq * d : (nq + nkv) * d]
            v = x @ w[:, (nq + nkv) * d :]
        else:
            q, k, v = (x @ w).split([nq * d, nkv * d, nkv * d], dim=-1)
        q = q.view(B, T, nq, d).transpose(1, 2)
        k = k.view(B, T, nkv, d).transpose(1, 2)
        v = v.view(B, T, nkv, d).transpose(1, 2)

        plain = bug == "qk_norm_plain_weight"
        if bug == "qk_norm_after_rope":
            q, k = rope(q), rope(k)
            q = _rms(q, self.qk_norms[l, 0], self.eps)
            k = _rms(k, self.qk_norms[l, 1], self.eps)
        else:
            q = _rms(q, self.qk_norms[l, 0], self.eps, plus_one=not plain)
            k = _rms(k, self.qk_norms[l, 1], self.eps, plus_one=not plain)
            q, k = rope(q), rope(k)

        scale = self._scaling()
        n_rep = nq // nkv
        neg = torch.finfo(q.dtype).min
        softcap = getattr(self.config, "attn_logit_softcapping", None)

        if bug == "grouped_gqa":
            qg = q.view(B, nkv, n_rep, T, d)
            s = torch.einsum("bgrqd,bgkd->bgrqk", qg, k) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            s = s.masked_fill(~mask[:, None, None], neg)
            p = torch.softmax(s, dim=-1)
            o = torch.einsum("bgrqk,bgkd->bgrqd", p, v).reshape(B, nq, T, d)
        else:
            if bug == "kv_heads_tiled":
                k = k.repeat(1, n_rep, 1, 1)
                v = v.repeat(1, n_rep, 1, 1)
            else:
                k = k.repeat_interleave(n_rep, dim=1)
                v = v.repeat_interleave(n_rep, dim=1)
            if bug == "sdpa" and softcap is None:
                add = torch.zeros(B, 1, T, T, dtype=q.dtype).masked_fill(~mask[:, None], neg)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale)
            else:
                s = (q @ k.transpose(-1, -2)) * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                s = s.masked_fill(~mask[:, None], neg)
                p = torch.softmax(s, dim=-1)
                o = p @ v
        o = o.transpose(1, 2).reshape(B, T, nq * d)
        return o @ self.wo[l]

    def _mlp(self, l, x):
        gu = x @ self.w_gate_up[l]
        if _bug() == "gate_up_swapped":
            u, g = gu.split([self.I, self.I], dim=-1)
        else:
            g, u = gu.split([self.I, self.I], dim=-1)
        act = F.gelu(g) if _bug() == "gelu_exact" else F.gelu(g, approximate="tanh")
        return (act * u) @ self.w_down[l]

    def _masks(self, B, T, attention_mask, device):
        idx = torch.arange(T, device=device)
        causal = idx[None, :] <= idx[:, None]  # (q, k)
        delta = idx[:, None] - idx[None, :]
        W = self.config.sliding_window
        window = delta <= W if _bug() == "sliding_window_inclusive" else delta < W
        if attention_mask is None:
            key_ok = torch.ones(B, T, dtype=torch.bool, device=device)
        else:
            key_ok = attention_mask.to(device).bool()
        full = causal[None] & key_ok[:, None, :]
        if _bug() == "sliding_mask_drops_padding":
            sliding = (causal & window)[None].expand(B, T, T)
        else:
            sliding = full & window[None]
        return {"full_attention": full, "sliding_attention": sliding}

    def _ropes(self, position_ids):
        bug = _bug()
        ropes = {}
        for t in ("sliding_attention", "full_attention"):
            if bug == "rope_table":
                cos = getattr(self, f"cos_{t}")[position_ids]
                sin = getattr(self, f"sin_{t}")[position_ids]
                ropes[t] = lambda x, c=cos, s=sin: _apply_rope_table(x, c, s)
            else:
                name = f"inv_freq_scaled_{t}" if bug == "rope_scaling_on_local" else f"inv_freq_{t}"
                freqs = position_ids[..., None].float() * getattr(self, name)
                ropes[t] = lambda x, f=freqs: _apply_rope(x, f)
        return ropes

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        elif position_ids.shape[0] != B:
            position_ids = position_ids.expand(B, T)

        h = self.tok_table[input_ids]
        if not self.embed_prescaled:
            h = h * torch.tensor(self.H**0.5, dtype=h.dtype)

        masks = self._masks(B, T, attention_mask, dev)
        ropes = self._ropes(position_ids)
        types = self._layer_types()
        for l in range(self.L):
            t = types[l]
            x = _rms(h, self.norms[l, 0], self.eps)
            a = self._attention(l, x, ropes[t], masks[t])
            h = h + _rms(a, self.norms[l, 1], self.eps)
            x = _rms(h, self.norms[l, 2], self.eps)
            m = self._mlp(l, x)
            h = h + _rms(m, self.norms[l, 3], self.eps)

        h = _rms(h, self.final_norm, self.eps)
        table = self.out_table if self.out_table is not None else self.tok_table
        logits = h @ table.t()
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is None and _bug() == "gemma2_softcap_default":
            cap = 30.0
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = Gemma3TextPort(config)
    L = model.L
    pre = "model."
    with torch.no_grad():
        emb = sd[pre + "embed_tokens.weight"]
        tied = getattr(config, "tie_word_embeddings", True)
        lm = sd.get("lm_head.weight")
        if bug == "prescaled_tied_embed":
            # bake the normaliser into the table to save a multiply per token ... the tied head shares it
            model.tok_table.copy_(emb * (model.H**0.5))
            model.embed_prescaled = True
        else:
            model.tok_table.copy_(emb)
        if lm is not None and not (tied or torch.equal(lm, emb)):
            model.out_table = nn.Parameter(lm.clone())
        for l in range(L):
            p = f"{pre}layers.{l}."
            q = sd[p + "self_attn.q_proj.weight"]
            k = sd[p + "self_attn.k_proj.weight"]
            v = sd[p + "self_attn.v_proj.weight"]
            model.wqkv[l].copy_(torch.cat([q, k, v], dim=0).t())
            model.wo[l].copy_(sd[p + "self_attn.o_proj.weight"].t())
            g = sd[p + "mlp.gate_proj.weight"]
            u = sd[p + "mlp.up_proj.weight"]
            model.w_gate_up[l].copy_(torch.cat([g, u], dim=0).t())
            model.w_down[l].copy_(sd[p + "mlp.down_proj.weight"].t())
            names = [
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ]
            if bug == "llama_norm_names":
                # Llama's "post_attention_layernorm" is the norm *before* the MLP
                names = [
                    "input_layernorm",
                    "pre_feedforward_layernorm",
                    "post_attention_layernorm",
                    "post_feedforward_layernorm",
                ]
            for j, n in enumerate(names):
                model.norms[l, j].copy_(sd[p + n + ".weight"])
            model.qk_norms[l, 0].copy_(sd[p + "self_attn.q_norm.weight"])
            model.qk_norms[l, 1].copy_(sd[p + "self_attn.k_norm.weight"])
        model.final_norm.copy_(sd[pre + "norm.weight"])
    return model.float().eval()
