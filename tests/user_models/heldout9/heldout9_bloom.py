"""Hand-written plain-PyTorch port of BLOOM (transformers `BloomForCausalLM`).

Covers: token embedding followed by word_embeddings_layernorm, no position
embeddings (ALiBi), pre-LN blocks with affine LayerNorms and biases everywhere,
a fused query_key_value projection whose output is laid out per head as
(heads, 3, head_dim), 1/sqrt(head_dim) scaled scores plus ALiBi, BLOOM's tanh
GELU MLP (4*hidden), final LayerNorm, head tied to the token embedding.

ALiBi as in BLOOM: bias[b, h, j] = slope_h * pos_j with key positions
pos = (cumsum(mask) - 1) * mask (key-only form, relies on softmax shift
invariance); slopes are 2**(-8/n * (1..n)) for a power-of-two head count n, plus
the interleaved extra slopes for other counts.

Conventions of this port (not the Transformers layout):
  * weights stored input-major ``W[in, out]`` and applied as ``x @ W``;
  * the loader re-lays the fused per-head qkv weight into separate q / k / v
    matrices (``q``, ``k``, ``v`` and biases) in ``nn.ParameterDict``s;
  * attention_mask (batch, seq): 0 for pads, left padding supported; BLOOM has no
    position_ids (the argument is accepted and ignored).

Bugs are switched on by the module global BUG (read at forward/build time).
When REC is a dict, intermediates are recorded under the Transformers module
names for the verifier.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "alibi_sign",  # ALiBi added with the wrong sign: far keys favoured instead of penalised
    "alibi_slopes_reversed",  # slope list reversed across heads (head 0 gets the smallest slope)
    "alibi_slopes_from_zero",  # slope powers start at 0 instead of 1: slopes 1, 2^-2, 2^-4, 2^-6 (cf. paiml/aprender PR#2143 ALiBi slope exponent off by one)
    "alibi_scaled",  # ALiBi added before the 1/sqrt(head_dim) scaling, so it is scaled too (baddbmm beta/alpha mixed up)
    "alibi_on_query_axis",  # ALiBi broadcast along the query axis (shape (h, q, 1)): a row constant, i.e. no ALiBi at all
    "alibi_first_row_mask",  # ALiBi positions built from attention_mask[0] for the whole batch (cf. transformers#26380 padding changes BLOOM outputs)
    "alibi_batch_interleave",  # (batch*heads) slope layout built with repeat_interleave: heads mixed across rows when batch > 1 (cf. alpa-projects/alpa PR#727 BLOOM multi-batch mismatch)
    "qkv_split_flat",  # fused query_key_value split as [q; k; v] blocks instead of per head (heads, 3, head_dim) (cf. NVIDIA/apex#1131 fused-QKV head layout)
    "qkv_bias_split_flat",  # qkv weight re-laid per head correctly but the qkv bias split as [q; k; v] blocks
    "word_emb_ln_skipped",  # word_embeddings_layernorm not applied (BLOOM's extra embedding norm missed; cf. open_clip PR#150 discussion of BLOOM's embedding LN)
    "residual_post_ln",  # apply_residual_connection_post_layernorm misread: residual taken from the LayerNorm output
    "bias_gelu_order",  # Megatron fused bias-gelu unpacked wrongly: gelu(x W) + b instead of gelu(x W + b)
    "rowparallel_bias_per_shard",  # attention dense done as pretraining_tp row shards each adding the bias (cf. text-generation-inference#1036 BLOOM row-parallel bias added tp times)
    "probs_bf16",  # attention probabilities cast to bfloat16 before the value matmul (softmax-in-fp32 contract broken)
    "ln_swap_loader",  # loader swaps input_layernorm and post_attention_layernorm
]
PADDING_ONLY = {"alibi_first_row_mask", "alibi_batch_interleave"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a float mask carrying ALiBi
    "fused_runtime_split",  # keep the fused qkv weight and split the output per head at runtime
    "relative_alibi",  # paper form -slope*(i - j) (differs from BLOOM's key-only form by a row constant)
]


def _rec(name, t):
    if isinstance(REC, dict):
        REC[name] = t.detach().clone()


def _layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _bloom_gelu(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))


def alibi_slopes(n):
    """BLOOM / ALiBi slopes for n heads (power-of-two part + interleaved extras)."""
    from_zero = BUG == "alibi_slopes_from_zero"

    def geometric(m):
        start = 2.0 ** (-8.0 / m)
        return [start ** (i if from_zero else i + 1) for i in range(m)]

    p2 = 2 ** int(math.floor(math.log2(n)))
    slopes = geometric(p2)
    if p2 != n:
        slopes += geometric(2 * p2)[0::2][: n - p2]
    s = torch.tensor(slopes, dtype=torch.float32)
    if BUG == "alibi_slopes_reversed":
        s = s.flip(0)
    return s


class BloomPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.d = cfg.hidden_size
        self.nh = cfg.n_head
        self.hd = self.d // self.nh
        self.eps = cfg.layer_norm_epsilon
        self.tp = max(int(getattr(cfg, "pretraining_tp", 1) or 1), 2)
        self.post_ln_residual = bool(cfg.apply_residual_connection_post_layernorm)
        self.emb = nn.ParameterDict()
        self.layers = nn.ModuleList()
        self.final = nn.ParameterDict()

    # ------------------------------------------------------------- alibi
    def _alibi(self, mask):
        """Float bias (B, nh, S_q or 1, S_k) to add to the scaled scores."""
        bug = BUG
        B, S = mask.shape
        slopes = alibi_slopes(self.nh).to(mask.device)
        if bug == "alibi_batch_interleave":
            sl = slopes.repeat_interleave(B).view(B, self.nh)
        else:
            sl = slopes[None].expand(B, self.nh)
        src = mask[:1].expand(B, S) if bug == "alibi_first_row_mask" else mask
        pos = ((src.cumsum(-1) - 1) * src).float()  # (B, S)
        if bug == "relative_alibi":
            dist = pos[:, :, None] - pos[:, None, :]  # (B, q, k)
            return -sl[:, :, None, None] * dist[:, None]
        if bug == "alibi_on_query_axis":
            return sl[:, :, None, None] * pos[:, None, :, None]
        bias = sl[:, :, None, None] * pos[:, None, None, :]
        if bug == "alibi_sign":
            bias = -bias
        return bias

    # --------------------------------------------------------- attention
    def _attention(self, li, p, h, allowed, alibi):
        bug = BUG
        B, S, _ = h.shape
        pre = f"transformer.h.{li}.self_attention"
        if bug == "fused_runtime_split":
            fused = h @ p["qkv"] + p["qkv_b"]
            _rec(pre + ".query_key_value", fused)
            f = fused.view(B, S, self.nh, 3, self.hd)
            q, k, v = f[..., 0, :], f[..., 1, :], f[..., 2, :]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        else:
            q = h @ p["q"] + p["q_b"]
            k = h @ p["k"] + p["k_b"]
            v = h @ p["v"] + p["v_b"]
            heads = lambda t: t.view(B, S, self.nh, self.hd).transpose(1, 2)
            q, k, v = heads(q), heads(k), heads(v)
            fused = torch.stack([q, k, v], dim=3).transpose(1, 2).reshape(B, S, 3 * self.d)
            _rec(pre + ".query_key_value", fused)

        neg = torch.finfo(torch.float32).min
        scale = 1.0 / math.sqrt(self.hd)
        if bug == "sdpa":
            bias = alibi.expand(B, self.nh, S, S).masked_fill(~allowed, neg)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        else:
            if bug == "alibi_scaled":
                s = (q @ k.transpose(-1, -2) + alibi) * scale
            else:
                s = q @ k.transpose(-1, -2) * scale + alibi
            s = s.masked_fill(~allowed, neg)
            probs = torch.softmax(s, dim=-1)
            if bug == "probs_bf16":
                ctx = (probs.bfloat16() @ v.bfloat16()).float()
            else:
                ctx = probs @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, self.d)
        if bug == "rowparallel_bias_per_shard":
            out = 0
            for sl in torch.arange(self.d).chunk(self.tp):
                out = out + ctx[..., sl] @ p["o"][sl] + p["o_b"]
        else:
            out = ctx @ p["o"] + p["o_b"]
        _rec(pre + ".dense", out)
        return out

    # ------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = BUG
        B, S = input_ids.shape
        dev = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long, device=dev)
        mask = attention_mask.long()
        keymask = mask.bool()
        causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
        allowed = causal[None, None] & keymask[:, None, None, :]
        alibi = self._alibi(mask)

        x = self.emb["tok"][input_ids]
        _rec("transformer.word_embeddings", x)
        if bug != "word_emb_ln_skipped":
            x = _layer_norm(x, self.emb["n_w"], self.emb["n_b"], self.eps)
        _rec("transformer.word_embeddings_layernorm", x)

        post_ln_res = self.post_ln_residual or bug == "residual_post_ln"
        for li, p in enumerate(self.layers):
            pre = f"transformer.h.{li}"
            h = _layer_norm(x, p["n1_w"], p["n1_b"], self.eps)
            _rec(pre + ".input_layernorm", h)
            x = (h if post_ln_res else x) + self._attention(li, p, h, allowed, alibi)
            _rec(pre + ".self_attention", x)
            h = _layer_norm(x, p["n2_w"], p["n2_b"], self.eps)
            _rec(pre + ".post_attention_layernorm", h)
            if bug == "bias_gelu_order":
                a = h @ p["up"]
                _rec(pre + ".mlp.dense_h_to_4h", a + p["up_b"])
                a = _bloom_gelu(a) + p["up_b"]
            else:
                a = h @ p["up"] + p["up_b"]
                _rec(pre + ".mlp.dense_h_to_4h", a)
                a = _bloom_gelu(a)
            _rec(pre + ".mlp.gelu_impl", a)
            m = a @ p["down"] + p["down_b"]
            _rec(pre + ".mlp.dense_4h_to_h", m)
            x = (h if post_ln_res else x) + m
            _rec(pre + ".mlp", x)
            _rec(pre, x)

        x = _layer_norm(x, self.final["n_w"], self.final["n_b"], self.eps)
        _rec("transformer.ln_f", x)
        logits = x @ self.final["head"]
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    bug = BUG
    sd = {k: v.detach().float().clone() for k, v in state_dict.items()}
    m = BloomPort(config)
    P = lambda t: nn.Parameter(t.contiguous(), requires_grad=False)
    nh, d = config.n_head, config.hidden_size
    hd = d // nh
    m.emb["tok"] = P(sd["transformer.word_embeddings.weight"])
    m.emb["n_w"] = P(sd["transformer.word_embeddings_layernorm.weight"])
    m.emb["n_b"] = P(sd["transformer.word_embeddings_layernorm.bias"])
    for i in range(config.n_layer):
        pre = f"transformer.h.{i}."
        W = sd[pre + "self_attention.query_key_value.weight"]  # (nh*3*hd, d)
        b = sd[pre + "self_attention.query_key_value.bias"]
        if bug == "qkv_split_flat":
            wq, wk, wv = W.chunk(3, dim=0)
        else:
            Wh = W.view(nh, 3, hd, d)
            wq, wk, wv = (Wh[:, j].reshape(d, d) for j in range(3))
        if bug in ("qkv_split_flat", "qkv_bias_split_flat"):
            bq, bk, bv = b.chunk(3)
        else:
            bh = b.view(nh, 3, hd)
            bq, bk, bv = (bh[:, j].reshape(d) for j in range(3))
        n1, n2 = "input_layernorm", "post_attention_layernorm"
        if bug == "ln_swap_loader":
            n1, n2 = n2, n1
        p = nn.ParameterDict(
            {
                "n1_w": P(sd[pre + n1 + ".weight"]),
                "n1_b": P(sd[pre + n1 + ".bias"]),
                "q": P(wq.t()),
                "k": P(wk.t()),
                "v": P(wv.t()),
                "q_b": P(bq),
                "k_b": P(bk),
                "v_b": P(bv),
                "qkv": P(W.t()),
                "qkv_b": P(b),
                "o": P(sd[pre + "self_attention.dense.weight"].t()),
                "o_b": P(sd[pre + "self_attention.dense.bias"]),
                "n2_w": P(sd[pre + n2 + ".weight"]),
                "n2_b": P(sd[pre + n2 + ".bias"]),
                "up": P(sd[pre + "mlp.dense_h_to_4h.weight"].t()),
                "up_b": P(sd[pre + "mlp.dense_h_to_4h.bias"]),
                "down": P(sd[pre + "mlp.dense_4h_to_h.weight"].t()),
                "down_b": P(sd[pre + "mlp.dense_4h_to_h.bias"]),
            }
        )
        m.layers.append(p)
    m.final["n_w"] = P(sd["transformer.ln_f.weight"])
    m.final["n_b"] = P(sd["transformer.ln_f.bias"])
    m.final["head"] = P(sd["transformer.word_embeddings.weight"].t())  # tied
    return m.eval()
