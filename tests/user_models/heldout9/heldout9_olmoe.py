"""Hand-written plain-PyTorch port of OLMoE (transformers `OlmoeForCausalLM`).

Covers: token embedding (no scaling), pre-norm RMSNorm blocks, attention with
q_norm / k_norm RMSNorms over the *full* q and k projections (before the head
split), half-split RoPE on the given position_ids, 1/sqrt(head_dim) scaling, a
sparse mixture-of-experts MLP (softmax router in float32 over all experts, top-k,
no renormalisation when config.norm_topk_prob is False, SwiGLU experts), final
RMSNorm and an untied lm_head.

Conventions of this port (not the Transformers layout):
  * weights stored input-major ``W[in, out]``, applied as ``x @ W``;
  * experts kept as three einsum-ready stacks: ``eg`` / ``eu`` (E, hidden, inter)
    and ``ed`` (E, inter, hidden); the loader accepts either Transformers 5's
    fused ``mlp.experts.gate_up_proj`` (E, 2*inter, hidden) + ``down_proj``
    (E, hidden, inter) or the older per-expert ``experts.{e}.gate_proj`` linears;
  * the router weight is stored as ``router`` [hidden, E];
  * RoPE tables are (batch, seq, head_dim/2) cos/sin, applied to the two halves;
  * attention_mask (batch, seq): 0 for pads, left padding supported; position_ids
    used as given, else cumsum(mask)-1 with pads set to 1.

Bugs are switched on by the module global BUG (read at forward/build time).
When REC is a dict, intermediates are recorded under the Transformers module
names for the verifier.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "qk_norm_per_head",  # q/k RMSNorm statistics per head (Qwen3 style) instead of over the full projection (cf. lablup/mlxcel PR#317, vllm-metal PR#692)
    "qk_norm_after_rope",  # q/k norm applied after RoPE (norm weight no longer commutes with the rotation; cf. vllm-metal PR#692 norm placement kinds)
    "rope_partial",  # GPT-NeoX rotary_pct=0.25 default carried over: only a quarter of each head rotated
    "rope_dim_hidden",  # inv_freq exponent divided by hidden_size instead of head_dim
    "rope_positions_row0",  # cos/sin built from position_ids[0] and broadcast to the batch (cf. unsloth#3699 / PR#4078 shared positions under left padding)
    "pad_mask_after_softmax",  # padding applied by zeroing probabilities after softmax, without renormalising
    "router_on_residual",  # router fed the residual stream instead of the post_attention_layernorm output
    "router_sigmoid",  # DeepSeek-V3 template: sigmoid expert scores instead of a softmax over experts
    "norm_topk_prob_applied",  # top-k weights renormalised although norm_topk_prob is False (cf. lablup/mlxcel PR#391 OLMoE top-k softmax)
    "routing_weights_bf16",  # routing weights cast to bfloat16 before weighting expert outputs (cf. sglang#39351, sglang-jax#698)
    "route_weight_on_input",  # Llama-4 style: routing weight scales the expert input instead of its output
    "gate_up_interleaved",  # fused gate_up_proj read as interleaved rows (GPT-OSS layout) instead of [gate; up] halves (cf. ROCm/aiter PR#3871 GUGU vs GGUU)
    "experts_reshape_not_transpose",  # down_proj (E, hidden, inter) reshaped to (E, inter, hidden) instead of transposed (silent since inter == hidden)
    "experts_shared_across_layers",  # loader caches experts by expert index only: layer 0's experts reused in every layer
    "final_norm_suffix_match",  # loader finds the final norm with endswith('norm.weight') and takes the first hit: layer 0 q_norm (same shape)
]
PADDING_ONLY = {"rope_positions_row0", "pad_mask_after_softmax"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask
    "dense_experts",  # run all experts on all tokens, combine with a dense (tokens, E) weight matrix
    "complex_rope",  # RoPE as complex multiplication on (first half + i * second half)
]


def _rec(name, t):
    if isinstance(REC, dict):
        REC[name] = t.detach().clone()


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope_tables(pos, hd, theta, hidden):
    """cos/sin of shape (B, S, rot/2) where rot is the number of rotated dims."""
    bug = BUG
    rot = hd // 4 if bug == "rope_partial" else hd
    denom = hidden if bug == "rope_dim_hidden" else rot
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=pos.device) / denom))
    ang = pos.float()[..., None] * inv
    return ang.cos(), ang.sin(), ang


def _apply_rope(x, cos, sin, ang):
    """x: (B, nh, S, hd); tables (B, S, rot/2)."""
    half = cos.shape[-1]
    rot = 2 * half
    xr, xp = x[..., :rot], x[..., rot:]
    if BUG == "complex_rope":
        z = torch.complex(xr[..., :half], xr[..., half:])
        z = z * torch.polar(torch.ones_like(ang), ang)[:, None]
        out = torch.cat([z.real, z.imag], dim=-1)
    else:
        c, s = cos[:, None], sin[:, None]
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


class OlmoePort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.d = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.hd = self.d // self.nh
        self.eps = cfg.rms_norm_eps
        rp = getattr(cfg, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.E = cfg.num_experts
        self.k = cfg.num_experts_per_tok
        self.norm_topk = bool(cfg.norm_topk_prob)
        self.emb = nn.ParameterDict()
        self.layers = nn.ModuleList()
        self.final = nn.ParameterDict()

    # --------------------------------------------------------- attention
    def _attention(self, li, p, h, allowed, keymask, rope):
        bug = BUG
        B, S, _ = h.shape
        pre = f"model.layers.{li}.self_attn"
        q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
        _rec(pre + ".q_proj", q)
        _rec(pre + ".k_proj", k)
        _rec(pre + ".v_proj", v)
        heads = lambda t: t.view(B, S, self.nh, self.hd).transpose(1, 2)
        merge = lambda t: t.transpose(1, 2).reshape(B, S, self.d)
        if bug == "qk_norm_per_head":
            q = _rms(q.view(B, S, self.nh, self.hd), p["qn"].view(self.nh, self.hd), self.eps).reshape(B, S, self.d)
            k = _rms(k.view(B, S, self.nh, self.hd), p["kn"].view(self.nh, self.hd), self.eps).reshape(B, S, self.d)
        elif bug != "qk_norm_after_rope":
            q, k = _rms(q, p["qn"], self.eps), _rms(k, p["kn"], self.eps)
        if bug != "qk_norm_after_rope":
            _rec(pre + ".q_norm", q)
            _rec(pre + ".k_norm", k)
        q, k, v = heads(q), heads(k), heads(v)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        if bug == "qk_norm_after_rope":
            q = heads(_rms(merge(q), p["qn"], self.eps))
            k = heads(_rms(merge(k), p["kn"], self.eps))
            _rec(pre + ".q_norm", merge(q))
            _rec(pre + ".k_norm", merge(k))
        scale = self.hd**-0.5
        if bug == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            if bug == "pad_mask_after_softmax":
                causal_only = torch.ones(S, S, dtype=torch.bool, device=s.device).tril()
                s = s.masked_fill(~causal_only, torch.finfo(torch.float32).min)
                probs = torch.softmax(s, dim=-1) * keymask[:, None, None, :].float()
            else:
                s = s.masked_fill(~allowed, torch.finfo(torch.float32).min)
                probs = torch.softmax(s, dim=-1)
            ctx = probs @ v
        out = merge(ctx) @ p["o"]
        _rec(pre + ".o_proj", out)
        _rec(pre, out)
        return out

    # --------------------------------------------------------------- MoE
    def _moe(self, li, p, h, resid):
        bug = BUG
        B, S, D = h.shape
        pre = f"model.layers.{li}.mlp"
        x = h.reshape(-1, D)
        r_in = resid.reshape(-1, D) if bug == "router_on_residual" else x
        logits = r_in @ p["router"]  # (T, E)
        _rec(pre + ".gate", logits)
        if bug == "router_sigmoid":
            probs = torch.sigmoid(logits.float())
        else:
            probs = torch.softmax(logits.float(), dim=-1)
        topw, topi = probs.topk(self.k, dim=-1)
        if self.norm_topk or bug == "norm_topk_prob_applied":
            topw = topw / topw.sum(-1, keepdim=True)
        if bug == "routing_weights_bf16":
            topw = topw.bfloat16().float()
        topw = topw.to(x.dtype)

        def expert(e, xs):
            g = xs @ p["eg"][e]
            u = xs @ p["eu"][e]
            return (F.silu(g) * u) @ p["ed"][e]

        if bug == "dense_experts":
            dense_w = torch.zeros(x.shape[0], self.E, dtype=x.dtype).scatter(1, topi, topw)
            g = torch.einsum("td,edi->eti", x, p["eg"])
            u = torch.einsum("td,edi->eti", x, p["eu"])
            y = torch.einsum("eti,eid->etd", F.silu(g) * u, p["ed"])
            out = torch.einsum("etd,te->td", y, dense_w)
        else:
            out = torch.zeros_like(x)
            for e in range(self.E):
                tok, slot = torch.where(topi == e)
                if tok.numel() == 0:
                    continue
                w = topw[tok, slot, None]
                if bug == "route_weight_on_input":
                    y = expert(e, x[tok] * w)
                else:
                    y = expert(e, x[tok]) * w
                out.index_add_(0, tok, y)
        _rec(pre + ".experts", out)
        out = out.view(B, S, D)
        _rec(pre, out)
        return out

    # ------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = BUG
        B, S = input_ids.shape
        dev = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long, device=dev)
        keymask = attention_mask.bool()
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(~keymask, 1)
        position_ids = position_ids.expand(B, S)
        if bug == "rope_positions_row0":
            position_ids = position_ids[:1].expand(B, S)
        rope = _rope_tables(position_ids, self.hd, self.theta, self.d)
        if isinstance(REC, dict):  # Transformers layout: cat(cos, cos), unrotated dims -> cos 1
            c = rope[0]
            ones = torch.ones(*c.shape[:-1], self.hd - 2 * c.shape[-1], device=dev)
            _rec("model.rotary_emb", torch.cat([c, c, ones], dim=-1))
        causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
        allowed = causal[None, None] & keymask[:, None, None, :]

        x = self.emb["tok"][input_ids]
        _rec("model.embed_tokens", x)
        for li, p in enumerate(self.layers):
            pre = f"model.layers.{li}"
            h = _rms(x, p["n_attn"], self.eps)
            _rec(pre + ".input_layernorm", h)
            x = x + self._attention(li, p, h, allowed, keymask, rope)
            h = _rms(x, p["n_mlp"], self.eps)
            _rec(pre + ".post_attention_layernorm", h)
            x = x + self._moe(li, p, h, x)
            _rec(pre, x)
        x = _rms(x, self.final["n"], self.eps)
        _rec("model.norm", x)
        logits = x @ self.final["head"]
        _rec("lm_head", logits)
        return logits


def _load_experts(sd, pre, E, bug):
    """Return (eg, eu, ed) as (E, H, I), (E, H, I), (E, I, H) from either layout."""
    if pre + "mlp.experts.gate_up_proj" in sd:
        gu = sd[pre + "mlp.experts.gate_up_proj"]  # (E, 2I, H)
        dn = sd[pre + "mlp.experts.down_proj"]  # (E, H, I)
        inter = gu.shape[1] // 2
        if bug == "gate_up_interleaved":
            g, u = gu[:, 0::2], gu[:, 1::2]
        else:
            g, u = gu[:, :inter], gu[:, inter:]
        eg, eu = g.transpose(1, 2), u.transpose(1, 2)
        if bug == "experts_reshape_not_transpose":
            ed = dn.reshape(E, dn.shape[2], dn.shape[1])
        else:
            ed = dn.transpose(1, 2)
    else:  # older per-expert nn.Linear layout
        G = torch.stack([sd[f"{pre}mlp.experts.{e}.gate_proj.weight"] for e in range(E)])
        U = torch.stack([sd[f"{pre}mlp.experts.{e}.up_proj.weight"] for e in range(E)])
        Dn = torch.stack([sd[f"{pre}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        if bug == "gate_up_interleaved":
            GU = torch.cat([G, U], dim=1)
            G, U = GU[:, 0::2], GU[:, 1::2]
        eg, eu = G.transpose(1, 2), U.transpose(1, 2)
        ed = Dn.reshape(E, Dn.shape[2], Dn.shape[1]) if bug == "experts_reshape_not_transpose" else Dn.transpose(1, 2)
    return eg, eu, ed


def build(state_dict, config):
    bug = BUG
    sd = {k: v.detach().float().clone() for k, v in state_dict.items()}
    m = OlmoePort(config)
    P = lambda t: nn.Parameter(t.contiguous(), requires_grad=False)
    m.emb["tok"] = P(sd["model.embed_tokens.weight"])
    cache = {}
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        if bug == "experts_shared_across_layers" and cache:
            eg, eu, ed = cache["experts"]
        else:
            eg, eu, ed = _load_experts(sd, pre, config.num_experts, bug)
            cache["experts"] = (eg, eu, ed)
        p = nn.ParameterDict(
            {
                "n_attn": P(sd[pre + "input_layernorm.weight"]),
                "q": P(sd[a + "q_proj.weight"].t()),
                "k": P(sd[a + "k_proj.weight"].t()),
                "v": P(sd[a + "v_proj.weight"].t()),
                "o": P(sd[a + "o_proj.weight"].t()),
                "qn": P(sd[a + "q_norm.weight"]),
                "kn": P(sd[a + "k_norm.weight"]),
                "n_mlp": P(sd[pre + "post_attention_layernorm.weight"]),
                "router": P(sd[pre + "mlp.gate.weight"].t()),
                "eg": P(eg),
                "eu": P(eu),
                "ed": P(ed),
            }
        )
        m.layers.append(p)
    if bug == "final_norm_suffix_match":
        key = next(k for k in sd if k.endswith("norm.weight"))
    else:
        key = "model.norm.weight"
    m.final["n"] = P(sd[key])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    m.final["head"] = P(head.t())
    return m.eval()
