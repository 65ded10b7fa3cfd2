"""A from-scratch PyTorch port of the ModernBERT decoder (``modernbert-decoder``, causal LM).

Architecture (as implemented here; d = hidden_size, H = num_attention_heads, hd = d // H,
I = intermediate_size, L = num_hidden_layers, V = vocab_size, eps = norm_eps):

    LN(x; w, b)   = (x - mean(x)) / sqrt(var_biased(x) + eps) * w (+ b when norm_bias)   # true LayerNorm

    x_0 = LN_emb(E[ids])                                    (B, S, d)   embeddings are normalised
    for l in 0..L-1:
        h   = x                 if l == 0   (layer 0 has NO attention norm: Identity)
              LN_attn_l(x)      otherwise
        q, k, v = split(h @ Wqkv_l)                         (B, S, 3d) -> 3 x (B, H, S, hd)
        q, k = rope(q, theta_l), rope(k, theta_l)           NeoX "rotate_half" layout:
              inv_freq_j = theta_l ** (-2j / hd), j < hd/2;  ang = pos * inv_freq, duplicated [ang, ang]
              rope(x) = x * cos(ang) + rotate_half(x) * sin(ang),  rotate_half([a, b]) = [-b, a]
              theta_l = rope_parameters[layer_types[l]]["rope_theta"] (160000 global, 10000 local)
        s   = q k^T / sqrt(hd) + mask_l                     (B, H, S, S), softmax over keys in float32
              mask_l: causal (kv <= q), key padding (attention_mask == 0 -> min float),
                      and on "sliding_attention" layers a window over token INDICES:
                      kv > q - W, W = config.sliding_window = local_attention // 2
        x   = x + (softmax(s) v merged to (B, S, d)) @ Wo_l
        g   = LN_mlp_l(x) @ Wi_l                            (B, S, 2I) = [input | gate]
        x   = x + (gelu(input) * gate) @ Wo2_l              gelu = exact erf GELU ("gelu")
    y      = LN_final(x)
    y      = LN_head(gelu(y @ W_dense))                     prediction head: dense -> act -> norm
    logits = y @ E^T + b_dec                                tied decoder (decoder_bias=True)

Weight layout (mine, not Transformers' module tree; all matrices stored in -> out, i.e. transposed):
    tok_emb     (V, d)        token embedding, also the tied output matrix
    ln_emb      (d,)          embedding LayerNorm weight
    qkv         (L, d, 3d)    fused, stacked q|k|v projections; each third head-major (H, hd)
    attn_out    (L, d, d)     attention output projection (Wo)
    ln          (L, 2, d)     [attention-norm, mlp-norm] weights per layer; row [0, 0] is unused ones
    mlp_in      (L, d, 2I)    Wi, columns [input | gate]
    mlp_out     (L, I, d)     MLP output projection
    ln_final    (d,)          final norm weight
    head_dense  (d, d)        prediction-head dense
    ln_head     (d,)          prediction-head norm weight
    dec_bias    (V,)          decoder bias
    buffers: inv_freq (L, hd/2) per-layer RoPE inverse frequencies; is_sliding (L,) bool
    Optional biases (created only when the config asks for them): qkv_b (L, 3d), attn_out_b (L, d),
    mlp_in_b (L, 2I), mlp_out_b (L, d), ln_b (L, 2, d), ln_emb_b, ln_final_b, ln_head_b (d,),
    head_dense_b (d,); an untied output matrix ``unembed`` (V, d) when tie_word_embeddings is False.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_single_theta",  # every layer uses the full_attention rope_theta (160000), sliding layers should use 10000
    "window_full_local",  # sliding window taken as config.local_attention (16) instead of local_attention // 2 (8)
    "layer0_attn_norm",  # a LayerNorm (unit weight, not in the checkpoint) is applied before layer 0's attention, which is Identity
    "glu_act_on_gate",  # GELU applied to the second half of Wi's output ("gate") instead of the first ("input")
    "gelu_tanh",  # activation name "gelu" mapped to the tanh-approximate GELU (MLP and head); Transformers' "gelu" is exact erf
    "head_norm_before_act",  # prediction head does dense -> norm -> act instead of dense -> act -> norm
    "decoder_bias_dropped",  # tied output projection reuses the embedding but forgets decoder.bias
    "rmsnorm_for_layernorm",  # norms implemented as RMSNorm (no mean subtraction), misled by norm_eps' "rms" docstring
    "rope_interleaved",  # RoPE rotates adjacent pairs (GPT-J layout) instead of the two halves (rotate_half / NeoX)
    "attn_scale_hidden",  # attention scores scaled by 1/sqrt(hidden_size) instead of 1/sqrt(head_dim)
    "embed_norm_missing",  # the LayerNorm after the token embedding is skipped (llama-style embedding)
    "residual_after_norm",  # attention residual taken from the normed hidden state instead of the block input
    "qkv_fused_head_major",  # fused qkv output split as (H, 3, hd) per head instead of (3, H, hd) blocks
    "pad_mask_query_axis",  # padding mask broadcast over the query axis instead of the key axis
]

PADDING_ONLY = [
    "pad_mask_query_axis",
]

CLEAN = [
    "split_qkv",  # three separate matmuls on column slices of the fused qkv weight instead of one fused matmul
    "complex_rope",  # RoPE as a complex multiplication (a + ib) * e^{i ang} on the (first half, second half) pairs
    "sdpa_attention",  # attention through F.scaled_dot_product_attention with the same additive float mask
    "online_softmax",  # flash-style attention: key blocks with a running max / running sum (online softmax)
    "layernorm_manual",  # LayerNorm written out by hand (mean, biased variance, rsqrt) instead of F.layer_norm
]

_MIN = torch.finfo(torch.float32).min


def _bug():
    return BUG


def _gelu(x, name):
    if name == "gelu" and _bug() == "gelu_tanh":
        name = "gelu_pytorch_tanh"
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "silu" or name == "swish":
        return F.silu(x)
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unsupported activation {name}")


class ModernBertDecoderPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        H = config.num_attention_heads
        L = config.num_hidden_layers
        I = int(config.intermediate_size)
        V = config.vocab_size
        self.d, self.H, self.hd, self.L, self.I, self.V = d, H, d // H, L, I, V
        self.eps = config.norm_eps
        self.hidden_act = config.hidden_activation
        self.head_act = config.classifier_activation
        self.local_attention = config.local_attention
        self.sliding_window = config.sliding_window
        self.layer_types = list(config.layer_types)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.rope_parameters = config.rope_parameters

        P = lambda *s: nn.Parameter(torch.zeros(*s))  # noqa: E731
        self.tok_emb = P(V, d)
        self.ln_emb = P(d)
        self.qkv = P(L, d, 3 * d)
        self.attn_out = P(L, d, d)
        self.ln = P(L, 2, d)
        self.mlp_in = P(L, d, 2 * I)
        self.mlp_out = P(L, I, d)
        self.ln_final = P(d)
        self.head_dense = P(d, d)
        self.ln_head = P(d)
        self.dec_bias = P(V) if config.decoder_bias else None
        self.unembed = None if self.tied else P(V, d)
        self.qkv_b = P(L, 3 * d) if config.attention_bias else None
        self.attn_out_b = P(L, d) if config.attention_bias else None
        self.mlp_in_b = P(L, 2 * I) if config.mlp_bias else None
        self.mlp_out_b = P(L, d) if config.mlp_bias else None
        if config.norm_bias:
            self.ln_b = P(L, 2, d)
            self.ln_emb_b, self.ln_final_b, self.ln_head_b = P(d), P(d), P(d)
        else:
            self.ln_b = self.ln_emb_b = self.ln_final_b = self.ln_head_b = None
        self.head_dense_b = P(d) if config.classifier_bias else None

        self.register_buffer("inv_freq", self._inv_freqs(single_theta=False), persistent=False)
        self.register_buffer("inv_freq_global_only", self._inv_freqs(single_theta=True), persistent=False)
        self.register_buffer(
            "is_sliding", torch.tensor([t == "sliding_attention" for t in self.layer_types]), persistent=False
        )

    # ----------------------------------------------------------------- rope
    def _inv_freqs(self, single_theta):
        rows = []
        for t in self.layer_types:
            params = self.rope_parameters["full_attention" if single_theta else t]
            if params.get("rope_type", "default") != "default":
                raise NotImplementedError("only default RoPE is ported")
            theta = float(params["rope_theta"])
            exps = torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd
            rows.append(1.0 / theta**exps)
        return torch.stack(rows)

    def _rope(self, x, pos, l):
        """x (B, H, S, hd), pos (B, S) -> rotated x."""
        bug = _bug()
        inv = (self.inv_freq_global_only if bug == "rope_single_theta" else self.inv_freq)[l]
        ang = pos[..., None].float() * inv  # (B, S, hd/2)
        ang = ang[:, None]  # (B, 1, S, hd/2)
        half = self.hd // 2
        if bug == "rope_interleaved":
            xe, xo = x[..., 0::2], x[..., 1::2]
            c, s = ang.cos(), ang.sin()
            return torch.stack((xe * c - xo * s, xe * s + xo * c), dim=-1).flatten(-2)
        if bug == "complex_rope":
            z = torch.complex(x[..., :half].float(), x[..., half:].float())
            z = z * torch.polar(torch.ones_like(ang), ang)
            return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)
        emb = torch.cat((ang, ang), dim=-1)
        x1, x2 = x[..., :half], x[..., half:]
        rot = torch.cat((-x2, x1), dim=-1)
        return x * emb.cos() + rot * emb.sin()

    # ----------------------------------------------------------------- norms
    def _norm(self, x, w, b=None):
        bug = _bug()
        if bug == "rmsnorm_for_layernorm":
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w
            return y if b is None else y + b
        if bug == "layernorm_manual":
            mu = x.mean(-1, keepdim=True)
            xc = x - mu
            var = xc.pow(2).mean(-1, keepdim=True)
            y = xc * torch.rsqrt(var + self.eps) * w
            return y if b is None else y + b
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)

    # ----------------------------------------------------------------- masks
    def _masks(self, B, S, attention_mask, device):
        """Additive float masks (B, 1, S, S) for full and sliding layers."""
        bug = _bug()
        q = torch.arange(S, device=device)[:, None]
        kv = torch.arange(S, device=device)[None, :]
        allowed = (kv <= q)[None, None].expand(B, 1, S, S)
        if attention_mask is not None:
            keep = attention_mask.to(device).bool()
            if bug == "pad_mask_query_axis":
                allowed = allowed & keep[:, None, :, None]
            else:
                allowed = allowed & keep[:, None, None, :]
        window = self.local_attention if bug == "window_full_local" else self.sliding_window
        in_window = (kv > q - window)[None, None]
        zero = torch.zeros((), device=device)
        full = torch.where(allowed, zero, torch.tensor(_MIN, device=device))
        sliding = torch.where(allowed & in_window, zero, torch.tensor(_MIN, device=device))
        return full, sliding

    # ----------------------------------------------------------------- attention
    def _attend(self, q, k, v, mask):
        bug = _bug()
        scale = (self.d if bug == "attn_scale_hidden" else self.hd) ** -0.5
        if bug == "sdpa_attention":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if bug == "online_softmax":
            S = k.shape[-2]
            blk = 5
            m = torch.full(q.shape[:-1] + (1,), -math.inf, dtype=q.dtype, device=q.device)
            den = torch.zeros_like(m)
            acc = torch.zeros_like(q)
            for s0 in range(0, S, blk):
                sc = (q @ k[..., s0 : s0 + blk, :].transpose(-1, -2)) * scale + mask[..., s0 : s0 + blk]
                m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
                corr = torch.exp(m - m_new)
                p = torch.exp(sc - m_new)
                den = den * corr + p.sum(-1, keepdim=True)
                acc = acc * corr + p @ v[..., s0 : s0 + blk, :]
                m = m_new
            return acc / den
        scores = (q @ k.transpose(-1, -2)) * scale + mask
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return probs @ v

    def _attention(self, h, l, pos, mask):
        bug = _bug()
        B, S, d = h.shape
        H, hd = self.H, self.hd
        W = self.qkv[l]
        if bug == "split_qkv":
            q = h @ W[:, :d]
            k = h @ W[:, d : 2 * d]
            v = h @ W[:, 2 * d :]
            if self.qkv_b is not None:
                q, k, v = q + self.qkv_b[l, :d], k + self.qkv_b[l, d : 2 * d], v + self.qkv_b[l, 2 * d :]
            q, k, v = (t.view(B, S, H, hd).transpose(1, 2) for t in (q, k, v))
        else:
            qkv = h @ W
            if self.qkv_b is not None:
                qkv = qkv + self.qkv_b[l]
            if bug == "qkv_fused_head_major":
                qkv = qkv.view(B, S, H, 3, hd).permute(3, 0, 2, 1, 4)
            else:
                qkv = qkv.view(B, S, 3, H, hd).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        q = self._rope(q, pos, l)
        k = self._rope(k, pos, l)
        o = self._attend(q, k, v, mask)  # (B, H, S, hd)
        o = o.transpose(1, 2).reshape(B, S, d)
        o = o @ self.attn_out[l]
        if self.attn_out_b is not None:
            o = o + self.attn_out_b[l]
        return o

    def _mlp(self, h, l):
        bug = _bug()
        g = h @ self.mlp_in[l]
        if self.mlp_in_b is not None:
            g = g + self.mlp_in_b[l]
        inp, gate = g[..., : self.I], g[..., self.I :]
        if bug == "glu_act_on_gate":
            inp, gate = gate, inp
        y = (_gelu(inp, self.hidden_act) * gate) @ self.mlp_out[l]
        if self.mlp_out_b is not None:
            y = y + self.mlp_out_b[l]
        return y

    def _ln_b(self, l, i):
        return None if self.ln_b is None else self.ln_b[l, i]

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None].expand(B, S)
        full_mask, sliding_mask = self._masks(B, S, attention_mask, dev)

        x = self.tok_emb[input_ids]
        if bug != "embed_norm_missing":
            x = self._norm(x, self.ln_emb, self.ln_emb_b)

        for l in range(self.L):
            if l == 0:
                h = self._norm(x, torch.ones_like(self.ln[0, 0])) if bug == "layer0_attn_norm" else x
            else:
                h = self._norm(x, self.ln[l, 0], self._ln_b(l, 0))
            mask = sliding_mask if bool(self.is_sliding[l]) else full_mask
            res = h if bug == "residual_after_norm" else x
            x = res + self._attention(h, l, position_ids, mask)
            x = x + self._mlp(self._norm(x, self.ln[l, 1], self._ln_b(l, 1)), l)

        x = self._norm(x, self.ln_final, self.ln_final_b)
        y = x @ self.head_dense
        if self.head_dense_b is not None:
            y = y + self.head_dense_b
        if bug == "head_norm_before_act":
            y = _gelu(self._norm(y, self.ln_head, self.ln_head_b), self.head_act)
        else:
            y = self._norm(_gelu(y, self.head_act), self.ln_head, self.ln_head_b)
        out_w = self.tok_emb if self.unembed is None else self.unembed
        logits = y @ out_w.t()
        if self.dec_bias is not None and bug != "decoder_bias_dropped":
            logits = logits + self.dec_bias
        return logits


def build(state_dict, config) -> nn.Module:
    """Converts a Transformers ``ModernBertDecoderForCausalLM`` state dict into :class:`ModernBertDecoderPort`."""
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = ModernBertDecoderPort(config)
    L = model.L
    pre = "model."
    T = lambda k: sd[k].t()  # noqa: E731  (out, in) -> (in, out)
    with torch.no_grad():
        model.tok_emb.copy_(sd[pre + "embeddings.tok_embeddings.weight"])
        model.ln_emb.copy_(sd[pre + "embeddings.norm.weight"])
        for l in range(L):
            p = f"{pre}layers.{l}."
            model.qkv[l].copy_(
                torch.cat([T(p + "attn.q_proj.weight"), T(p + "attn.k_proj.weight"), T(p + "attn.v_proj.weight")], 1)
            )
            model.attn_out[l].copy_(T(p + "attn.Wo.weight"))
            if l == 0:
                model.ln[l, 0].fill_(1.0)
            else:
                model.ln[l, 0].copy_(sd[p + "attn_norm.weight"])
            model.ln[l, 1].copy_(sd[p + "mlp_norm.weight"])
            model.mlp_in[l].copy_(T(p + "mlp.Wi.weight"))
            model.mlp_out[l].copy_(T(p + "mlp.Wo.weight"))
            if model.qkv_b is not None:
                model.qkv_b[l].copy_(
                    torch.cat([sd[p + "attn.q_proj.bias"], sd[p + "attn.k_proj.bias"], sd[p + "attn.v_proj.bias"]])
                )
                model.attn_out_b[l].copy_(sd[p + "attn.Wo.bias"])
            if model.mlp_in_b is not None:
                model.mlp_in_b[l].copy_(sd[p + "mlp.Wi.bias"])
                model.mlp_out_b[l].copy_(sd[p + "mlp.Wo.bias"])
            if model.ln_b is not None:
                if l != 0:
                    model.ln_b[l, 0].copy_(sd[p + "attn_norm.bias"])
                model.ln_b[l, 1].copy_(sd[p + "mlp_norm.bias"])
        model.ln_final.copy_(sd[pre + "final_norm.weight"])
        model.head_dense.copy_(T("lm_head.dense.weight"))
        model.ln_head.copy_(sd["lm_head.norm.weight"])
        if model.ln_b is not None:
            model.ln_emb_b.copy_(sd[pre + "embeddings.norm.bias"])
            model.ln_final_b.copy_(sd[pre + "final_norm.bias"])
            model.ln_head_b.copy_(sd["lm_head.norm.bias"])
        if model.head_dense_b is not None:
            model.head_dense_b.copy_(sd["lm_head.dense.bias"])
        if model.dec_bias is not None:
            model.dec_bias.copy_(sd["decoder.bias"])
        if model.unembed is not None:
            model.unembed.copy_(sd["decoder.weight"])
    return model.float().eval()
