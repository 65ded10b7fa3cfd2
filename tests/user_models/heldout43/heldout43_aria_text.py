"""Hand-written PyTorch port of the Aria text decoder (``aria_text``: Aria's MoE language model), logits only.

Architecture (as implemented here)
----------------------------------
Notation: B batch, T tokens, H = hidden_size, nh query heads, nkv key/value heads (GQA, nh % nkv == 0),
d = head_dim (config.head_dim, else H // nh), E = moe_num_experts, k = moe_topk, I = intermediate_size,
S = moe_num_shared_experts, V = vocab_size.

    x_0 = Emb[input_ids]                                              (B, T, H), no embedding scale
    for each of the L layers (pre-norm, two residual branches):
        a   = RMSNorm(x; g_attn)
        x   = x + Attn(a)
        m   = RMSNorm(x; g_ffn)
        x   = x + MoE(m)
    logits = RMSNorm(x; g_final) @ W_head^T                           untied head (tie_word_embeddings=False)

RMSNorm(x; g) = g * x / sqrt(mean(x^2, -1) + eps), eps = rms_norm_eps, the gain used as is (no 1 + g offset),
computed in float32.

Attention: q = a Wq^T + bq (nh*d), k = a Wk^T + bk (nkv*d), v = a Wv^T + bv (nkv*d); every projection has a bias
(attention_bias=True, the output projection too). Heads are contiguous blocks of d in the projection output.
RoPE on q and k, "rotate-half" (NeoX) pairing: dimension j is paired with j + d/2, j < d/2, with angle
pos * theta^(-2j/d), theta = rope_parameters["rope_theta"] (default rope type, full head dim, no scaling):
    out[j]       = x[j] cos - x[j + d/2] sin
    out[j + d/2] = x[j + d/2] cos + x[j] sin
GQA: query head h reads kv head h // (nh / nkv) (each kv head serves a contiguous group of query heads).
scores = q k^T / sqrt(d) + mask; softmax over keys (float32); out = softmax @ v, heads concatenated,
then o = out Wo^T + bo.
Mask: causal (key j visible to query i iff j <= i) AND key not padding (attention_mask[b, j] == 1). Masked
scores get the float32 minimum (not -inf), so a fully masked (padding) query row stays finite.
Positions: position_ids when given, else 0..T-1 for every row.

MoE block (per token, on m):
    router logits r = m Wr^T (E), no bias
    top-k experts chosen on the raw logits; weights w = softmax over the k selected logits only
    (= a softmax over all E renormalised on the chosen k)
    routed(m) = sum_{e in topk} w_e * Down_e( silu(m G_e) * (m U_e) )        (expert matrices, no bias)
    shared(m) = Down_s( act(m G_s^T) * (m U_s^T) ), one SwiGLU of width S*I, act = hidden_act (silu)
    MoE(m) = routed(m) + shared(m)          (no scaling of either part)

Checkpoint layout (Transformers): ``model.layers.N.mlp.experts.gate_up_proj`` is (E, H, 2I), stored
in -> out ("transposed" w.r.t. nn.Linear), the gate in the first I output columns, the up in the last I;
``experts.down_proj`` is (E, I, H), in -> out too. Everything else is nn.Linear (out, in).

Weight layout of this port (own names)
---------------------------------------
    tok_emb                      (V, H)               embedding table
    blocks[n].gains              (2, H)               stacked [attention-norm gain, ffn-norm gain]
    blocks[n].w_qkv              (H, nh*d + 2*nkv*d)  fused q|k|v, in -> out (transposed from the checkpoint)
    blocks[n].b_qkv              (nh*d + 2*nkv*d,)    fused q|k|v bias
    blocks[n].w_o                (nh*d, H)            in -> out
    blocks[n].b_o                (H,)
    blocks[n].w_router           (H, E)               in -> out
    blocks[n].w_gate             (E, H, I)            routed experts' gate, split from gate_up_proj
    blocks[n].w_up               (E, H, I)            routed experts' up
    blocks[n].w_down             (E, I, H)            routed experts' down (as the checkpoint)
    blocks[n].w_shared_in        (H, 2*S*I)           shared experts' fused gate|up, in -> out
    blocks[n].w_shared_out       (S*I, H)             shared experts' down, in -> out
    final_gain                   (H,)
    head                         (H, V)               lm_head transposed, in -> out
    inv_freq (buffer)            (d/2,)               theta^(-2j/d)

Selected by the module global ``BUG`` (read at call time): a bug of ``BUGS`` or a correct variant of ``CLEAN``.
"""

import math
import os

import torch
from torch import nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "router_full_softmax",  # expert weights = softmax over all E experts, taken at the top-k, not renormalised
    "router_prenorm_input",  # router scores the un-normed residual stream instead of the ffn-normed hidden
    "gate_up_swapped",  # routed experts' gate_up_proj split as (up, gate) instead of (gate, up)
    "gate_up_linear_layout",  # gate_up_proj read as nn.Linear (out, in): split along dim 1 and transposed
    "shared_expert_mean",  # shared-expert output divided by moe_num_shared_experts (averaged, not summed)
    "rope_interleaved",  # RoPE pairs (2j, 2j+1) (GPT-J style) instead of rotate-half (j, j + d/2)
    "rope_theta_default",  # RoPE base 10000 (the usual default) instead of config rope_theta (500)
    "attn_scale_headdim",  # attention scores scaled by 1/d instead of 1/sqrt(d)
    "gqa_tile",  # kv heads repeated as a tile (h % nkv) instead of grouped (h // group)
    "qkv_split_kv_swapped",  # fused qkv output split as q | v | k (k and v exchanged)
    "rmsnorm_offset",  # RMSNorm gain applied as (1 + g) (Gemma convention) instead of g
    "residual_from_normed",  # attention residual taken after input norm (x = norm(x) + attn(norm(x)))
    "pad_mask_queries",  # padding mask applied to the query rows instead of the key columns
    "pad_mask_additive_01",  # raw 0/1 attention_mask added to the scores instead of a large negative on pads
]

PADDING_ONLY = ["pad_mask_queries", "pad_mask_additive_01"]

CLEAN = [
    "router_softmax_renorm",  # softmax over all E, top-k, renormalise by the chosen sum (equal to top-k softmax)
    "shared_split_sum",  # shared SwiGLU run as S separate experts of width I, outputs summed
    "weight_before_down",  # routing weight applied to the expert's hidden before its (bias-free) down proj
    "rope_complex",  # RoPE as a complex multiply on (j, j + d/2) pairs
    "q_scale_folded",  # 1/sqrt(d) folded into the q weight and bias at build time
]


def _bug():
    return BUG


class Block(nn.Module):
    def __init__(self, H, nh, nkv, d, E, I, S):
        super().__init__()
        self.nh, self.nkv, self.d, self.E, self.I, self.S = nh, nkv, d, E, I, S
        qkv = (nh + 2 * nkv) * d
        self.gains = nn.Parameter(torch.ones(2, H))
        self.w_qkv = nn.Parameter(torch.zeros(H, qkv))
        self.b_qkv = nn.Parameter(torch.zeros(qkv))
        self.w_o = nn.Parameter(torch.zeros(nh * d, H))
        self.b_o = nn.Parameter(torch.zeros(H))
        self.w_router = nn.Parameter(torch.zeros(H, E))
        self.w_gate = nn.Parameter(torch.zeros(E, H, I))
        self.w_up = nn.Parameter(torch.zeros(E, H, I))
        self.w_down = nn.Parameter(torch.zeros(E, I, H))
        self.w_shared_in = nn.Parameter(torch.zeros(H, 2 * S * I))
        self.w_shared_out = nn.Parameter(torch.zeros(S * I, H))


def rms_norm(x, g, eps):
    bug = _bug()
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if bug == "rmsnorm_offset":
        return (1.0 + g) * y
    return g * y


def apply_rope(x, cos, sin):
    """x (B, nh, T, d); cos/sin (B, 1, T, d/2) of the angles pos * inv_freq."""
    bug = _bug()
    half = x.shape[-1] // 2
    if bug == "rope_interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        return torch.stack((r1, r2), dim=-1).flatten(-2)
    if bug == "rope_complex":
        z = torch.complex(x[..., :half].contiguous(), x[..., half:].contiguous())
        z = z * torch.complex(cos, sin)
        return torch.cat((z.real, z.imag), dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class AriaTextPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.H = config.hidden_size
        self.nh = config.num_attention_heads
        self.nkv = config.num_key_value_heads or self.nh
        self.d = getattr(config, "head_dim", None) or self.H // self.nh
        self.E = config.moe_num_experts
        self.k = config.moe_topk
        self.I = config.intermediate_size
        self.S = config.moe_num_shared_experts
        self.V = config.vocab_size
        self.L = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.act = config.hidden_act
        rp = getattr(config, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.tok_emb = nn.Parameter(torch.zeros(self.V, self.H))
        self.blocks = nn.ModuleList(
            Block(self.H, self.nh, self.nkv, self.d, self.E, self.I, self.S) for _ in range(self.L)
        )
        self.final_gain = nn.Parameter(torch.ones(self.H))
        self.head = nn.Parameter(torch.zeros(self.H, self.V))
        self.register_buffer("inv_freq", torch.zeros(self.d // 2), persistent=False)
        self.q_scale_folded = False

    # ---- helpers -------------------------------------------------------------------------------
    def _shared_act(self, x):
        if self.act == "silu":
            return F.silu(x)
        if self.act in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            return F.gelu(x, approximate="none" if self.act == "gelu" else "tanh")
        if self.act == "relu":
            return F.relu(x)
        raise ValueError(f"unsupported hidden_act {self.act}")

    def _attention(self, blk, a, cos, sin, add_mask):
        bug = _bug()
        B, T, _ = a.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        qkv = a @ blk.w_qkv + blk.b_qkv
        if bug == "qkv_split_kv_swapped":
            q, v, k = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        else:
            q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = q.view(B, T, nh, d).transpose(1, 2)
        k = k.view(B, T, nkv, d).transpose(1, 2)
        v = v.view(B, T, nkv, d).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        group = nh // nkv
        if bug == "gqa_tile":
            idx = torch.arange(nh) % nkv
        else:
            idx = torch.arange(nh) // group
        k = k[:, idx]
        v = v[:, idx]
        scores = q @ k.transpose(-1, -2)
        if not self.q_scale_folded:
            if bug == "attn_scale_headdim":
                scores = scores / d
            else:
                scores = scores / math.sqrt(d)
        scores = scores + add_mask
        p = torch.softmax(scores.float(), dim=-1)
        out = (p @ v).transpose(1, 2).reshape(B, T, nh * d)
        return out @ blk.w_o + blk.b_o

    def _moe(self, blk, m, x_res):
        bug = _bug()
        shape = m.shape
        h = m.reshape(-1, self.H)
        N = h.shape[0]
        router_in = x_res.reshape(-1, self.H) if bug == "router_prenorm_input" else h
        logits = router_in @ blk.w_router  # (N, E)
        if bug == "router_full_softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, chosen = probs.topk(self.k, dim=-1)
        elif bug == "router_softmax_renorm":
            probs = torch.softmax(logits, dim=-1)
            weights, chosen = probs.topk(self.k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
        else:
            top, chosen = logits.topk(self.k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        routed = torch.zeros_like(h)
        for e in range(self.E):
            tok, slot = torch.nonzero(chosen == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = h[tok]
            hid = F.silu(xe @ blk.w_gate[e]) * (xe @ blk.w_up[e])
            we = weights[tok, slot].unsqueeze(-1)
            if bug == "weight_before_down":
                ye = (hid * we) @ blk.w_down[e]
            else:
                ye = (hid @ blk.w_down[e]) * we
            routed.index_add_(0, tok, ye)
        SI = self.S * self.I
        gu = h @ blk.w_shared_in
        g, u = gu[:, :SI], gu[:, SI:]
        if bug == "shared_split_sum":
            shared = torch.zeros_like(h)
            for s in range(self.S):
                sl = slice(s * self.I, (s + 1) * self.I)
                shared = shared + (self._shared_act(g[:, sl]) * u[:, sl]) @ blk.w_shared_out[sl]
        else:
            shared = (self._shared_act(g) * u) @ blk.w_shared_out
        if bug == "shared_expert_mean":
            shared = shared / self.S
        return (routed + shared).view(shape)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, T = input_ids.shape
        dev = input_ids.device
        x = self.tok_emb[input_ids]
        if position_ids is None:
            position_ids = torch.arange(T, device=dev).unsqueeze(0).expand(B, T)
        inv_freq = self.inv_freq
        if bug == "rope_theta_default":
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.d, 2, dtype=torch.float32, device=dev) / self.d))
        ang = position_ids.float()[..., None] * inv_freq  # (B, T, d/2)
        cos = ang.cos()[:, None]
        sin = ang.sin()[:, None]

        neg = torch.finfo(torch.float32).min
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        allowed = causal[None, None].expand(B, 1, T, T)
        add_mask = None
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)
            if bug == "pad_mask_queries":
                allowed = allowed & keep[:, None, :, None]
            elif bug == "pad_mask_additive_01":
                add_mask = torch.zeros(B, 1, T, T, device=dev).masked_fill(~allowed, neg)
                add_mask = add_mask + attention_mask[:, None, None, :].float()
            else:
                allowed = allowed & keep[:, None, None, :]
        if add_mask is None:
            add_mask = torch.zeros(B, 1, T, T, device=dev).masked_fill(~allowed, neg)

        for blk in self.blocks:
            a = rms_norm(x, blk.gains[0], self.eps)
            res = a if bug == "residual_from_normed" else x
            x = res + self._attention(blk, a, cos, sin, add_mask)
            m = rms_norm(x, blk.gains[1], self.eps)
            x = x + self._moe(blk, m, x)
        x = rms_norm(x, self.final_gain, self.eps)
        return x @ self.head


@torch.no_grad()
def build(state_dict, config):
    bug = _bug()
    model = AriaTextPort(config)
    sd = {k: v.float() for k, v in state_dict.items()}
    p = "model."
    model.tok_emb.copy_(sd[p + "embed_tokens.weight"])
    model.final_gain.copy_(sd[p + "norm.weight"])
    head = sd.get("lm_head.weight", sd[p + "embed_tokens.weight"])
    model.head.copy_(head.t())
    d = model.d
    model.inv_freq.copy_(1.0 / (model.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))
    fold = bug == "q_scale_folded"
    model.q_scale_folded = fold
    I = model.I
    for n, blk in enumerate(model.blocks):
        lp = f"{p}layers.{n}."
        at = lp + "self_attn."
        wq, wk, wv = sd[at + "q_proj.weight"], sd[at + "k_proj.weight"], sd[at + "v_proj.weight"]
        zq = torch.zeros(wq.shape[0])
        zk = torch.zeros(wk.shape[0])
        bq = sd.get(at + "q_proj.bias", zq)
        bk = sd.get(at + "k_proj.bias", zk)
        bv = sd.get(at + "v_proj.bias", zk)
        if fold:
            s = 1.0 / math.sqrt(d)
            wq, bq = wq * s, bq * s
        blk.w_qkv.copy_(torch.cat([wq, wk, wv], dim=0).t())
        blk.b_qkv.copy_(torch.cat([bq, bk, bv]))
        blk.w_o.copy_(sd[at + "o_proj.weight"].t())
        blk.b_o.copy_(sd.get(at + "o_proj.bias", torch.zeros(model.H)))
        blk.gains.copy_(torch.stack([sd[lp + "input_layernorm.weight"], sd[lp + "post_attention_layernorm.weight"]]))
        mp = lp + "mlp."
        blk.w_router.copy_(sd[mp + "router.weight"].t())
        gate_up = sd[mp + "experts.gate_up_proj"]  # (E, H, 2I), in -> out
        if bug == "gate_up_linear_layout":
            # read as (E, 2I, H) out -> in: halves taken along dim 1, then transposed to in -> out
            gate, up = gate_up[:, :I, :].transpose(1, 2), gate_up[:, I:, :].transpose(1, 2)
        elif bug == "gate_up_swapped":
            up, gate = gate_up[..., :I], gate_up[..., I:]
        else:
            gate, up = gate_up[..., :I], gate_up[..., I:]
        blk.w_gate.copy_(gate)
        blk.w_up.copy_(up)
        blk.w_down.copy_(sd[mp + "experts.down_proj"])
        sh = mp + "shared_experts."
        blk.w_shared_in.copy_(torch.cat([sd[sh + "gate_proj.weight"], sd[sh + "up_proj.weight"]], dim=0).t())
        blk.w_shared_out.copy_(sd[sh + "down_proj.weight"].t())
    return model.float().eval()
