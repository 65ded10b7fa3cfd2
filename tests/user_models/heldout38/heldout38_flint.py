"""Hand-written plain-PyTorch port of Flint (FlintForCausalLM, Transformers ``model_type`` "flint").

Architecture as this port implements it (float32 throughout):
- token embedding ``x = E[ids]`` (no scaling); untied head ``logits = RMSNorm_f(x) @ head_t``.
- RMSNorm(x; g, eps) = g * (x * rsqrt(mean(x**2, -1) + eps)), eps = config.rms_norm_eps, the weight g used
  as-is (no 1 + g), multiplied in float32 (GPT-OSS style norm).
- decoder block i, pre-norm residual:
      x = x + Attn_i(RMSNorm(x; g_in));   x = x + FFN_i(RMSNorm(x; g_post))
- Attn_i (GQA, nq query heads, nkv key/value heads, head dim D = config.head_dim, NOT hidden / heads):
      [q | k | v] = h @ W_qkv + b_qkv                       (attention_bias)
      q, k per head: q = RMSNorm_D(q; g_q), k = RMSNorm_D(k; g_k)   (QK-norm over the head dim only, before RoPE)
      layer type t_i = config.layer_types[i]:
        "sliding_attention": RoPE (rotate-half / NeoX convention, theta = rope_parameters["rope_theta"],
                             positions = position_ids) on q, k; key j visible to query i iff
                             i - W < j <= i (W = config.sliding_window tokens, the query included) and j not padding
        "full_attention":    no positional encoding at all (NoPE); key j visible iff j <= i and j not padding
      query head h reads key/value head h // (nq / nkv)
      s_ij = (q_i . k_j) * D**-0.5
      attention sink: one learned logit sink_h per query head joins the softmax and is dropped after it:
      p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sink_h));   out = (sum_j p_ij v_j) @ W_o + b_o
- FFN_i: dense SwiGLU for i in config.mlp_only_layers (or when (i + 1) % decoder_sparse_step != 0; the port
  tells the two kinds apart by the tensors the checkpoint holds for layer i):
      y = (silu(h @ W_g) * (h @ W_u)) @ W_d
  else a sparse MoE block with an ungated shared expert:
      r = sigmoid(h @ R)  (router in float32, no expert bias), (w, e) = topk(r, k = num_experts_per_tok),
      w = w / sum(w) if norm_topk_prob;
      y = sum_top-k w_e * [(silu(h @ G_e) * (h @ U_e)) @ Dn_e]  +  SwiGLU_shared(h)   (the shared expert always in full)
  Transformers' fused expert tensor gate_up_proj[e] (2I, H) holds [gate rows ; up rows] (first half gate).
Weight layout of this port (own names; all matrices stored as (in, out) so the forward is x @ W):
- ``tok_emb`` (V, H); ``out_gamma`` (H,); ``head_t`` (H, V) = lm_head.weight transposed.
- ``blocks[i]`` (``FlintBlock``):
    ``norm_gammas`` (2, H) = stacked [input_layernorm ; post_attention_layernorm];
    ``attn.w_qkv`` (H, (nq + 2 nkv) D) = [q_proj | k_proj | v_proj] fused and transposed, ``attn.b_qkv`` fused biases;
    ``attn.w_out`` (nq D, H) = o_proj transposed, ``attn.b_out``; ``attn.qk_gamma`` (2, D) = stacked [q_norm ; k_norm];
    ``attn.sink_logit`` (nq,) = sinks.
    dense FFN (``ffn`` = ``DenseFFN``): ``w_in`` (H, 2I) = [gate_proj | up_proj] fused and transposed, ``w_out`` (I, H).
    sparse FFN (``ffn`` = ``SparseFFN``): ``router_t`` (H, E) = gate.weight transposed;
      ``bank`` (ParameterDict) with ``gate`` (E, H, I) and ``up`` (E, H, I) = gate_up_proj split in halves and
      transposed, ``down`` (E, I, H) = down_proj transposed; ``shared`` = a ``DenseFFN`` for the shared expert.
- buffer ``inv_freq`` (D/2,) = theta ** (-2i / D) (not persistent).
``build`` reads the module-level ``BUG`` when it is called and the model keeps it; ``model.taps`` (None by default)
may be set to a dict to record per-layer intermediates (used by where_check.py).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_on_nope_layers",  # RoPE applied on every layer: the full-attention (NoPE) layers get rotary embeddings too
    "qk_norm_after_rope",  # per-head q/k RMSNorm applied after RoPE instead of before it (norm weight meets rotated dims)
    "sinks_dropped",  # attention sinks ignored: plain softmax over the keys (what an SDPA/flash port without sinks does)
    "sliding_window_off_by_one",  # sliding mask keeps j >= i - W (W + 1 keys) instead of j > i - W (W keys)
    "router_softmax",  # router scores softmax(logits) (Qwen3-MoE template) instead of sigmoid(logits)
    "topk_not_renormalized",  # norm_topk_prob ignored: the top-k sigmoid scores are used without dividing by their sum
    "routing_weight_on_input",  # expert weight multiplies the expert's input token (Llama-4 style) not its output
    "shared_expert_missing",  # the ungated shared expert is never added to the routed experts' sum
    "gate_up_interleaved",  # gate_up_proj split GPT-OSS style (gate = even rows, up = odd rows) instead of halves
    "gqa_heads_tiled",  # KV heads repeated as tile (query head h -> kv head h % nkv) instead of h // (nq / nkv)
    "rope_interleaved_pairs",  # RoPE rotates adjacent pairs (2i, 2i+1) (GPT-J style) instead of halves (i, i + D/2)
    "scale_from_hidden_size",  # softmax scale (hidden_size / num_heads)**-0.5 instead of config.head_dim**-0.5
    "layer_types_default_pattern",  # layer types rebuilt from the default pattern (full if i<2, i%4==1 or last), config.layer_types ignored
    "sliding_mask_without_padding",  # the sliding-window mask is built from the causal band alone: padding keys stay visible in sliding layers
]
PADDING_ONLY = {"sliding_mask_without_padding"}
CLEAN = [
    "clean_sink_sigmoid",  # sink applied after a plain softmax: p = softmax(s) * sigmoid(logsumexp(s) - sink)
    "clean_grouped_gqa",  # GQA without repeating K/V: q viewed as (B, nkv, nq/nkv, T, D) and matched per group
    "clean_dense_moe",  # every expert on every token, combined with a dense (tokens, experts) weight matrix (0 off top-k)
    "clean_rope_complex",  # RoPE as a complex multiplication of (x[:D/2] + i x[D/2:]) by exp(i * pos * inv_freq)
    "clean_banded_sliding",  # sliding layers computed on unfolded windows of W keys per query, not a full T x T matrix
]

NEG = torch.finfo(torch.float32).min


def _rms(x, gamma, eps):
    return gamma * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _swiglu(h, w_gate, w_up, w_down):
    return (F.silu(h @ w_gate) * (h @ w_up)) @ w_down


def _rope(x, cos, sin, bug):
    """x (B, heads, T, D); cos/sin (B, T, D/2)."""
    cos = cos[:, None]
    sin = sin[:, None]
    half = x.shape[-1] // 2
    if bug == "rope_interleaved_pairs":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x[..., :half], x[..., half:]
    if bug == "clean_rope_complex":
        z = torch.complex(x1, x2) * torch.complex(cos, sin)
        return torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _sink_softmax(scores, sink, bug):
    """scores (B, nq, T, K) already masked; sink (nq,)."""
    if bug == "sinks_dropped":
        return torch.softmax(scores, dim=-1)
    if bug == "clean_sink_sigmoid":
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        return torch.softmax(scores, dim=-1) * torch.sigmoid(lse - sink.view(1, -1, 1, 1))
    col = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, col), dim=-1), dim=-1)[..., :-1]


class DenseFFN(nn.Module):
    def __init__(self, gate_w, up_w, down_w):
        super().__init__()
        self.inter = gate_w.shape[0]
        self.w_in = nn.Parameter(torch.cat((gate_w, up_w), dim=0).t().contiguous())
        self.w_out = nn.Parameter(down_w.t().contiguous())

    def forward(self, h):
        g, u = (h @ self.w_in).split(self.inter, dim=-1)
        return (F.silu(g) * u) @ self.w_out


class SparseFFN(nn.Module):
    def __init__(self, sd, p, cfg, bug):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk = cfg.norm_topk_prob
        self.router_t = nn.Parameter(sd[p + "gate.weight"].float().t().contiguous())
        gu = sd[p + "experts.gate_up_proj"]  # (E, 2I, H)
        inter = gu.shape[1] // 2
        if bug == "gate_up_interleaved":
            g, u = gu[:, 0::2], gu[:, 1::2]
        else:
            g, u = gu[:, :inter], gu[:, inter:]
        self.bank = nn.ParameterDict(
            {
                "gate": nn.Parameter(g.transpose(1, 2).contiguous()),
                "up": nn.Parameter(u.transpose(1, 2).contiguous()),
                "down": nn.Parameter(sd[p + "experts.down_proj"].transpose(1, 2).contiguous()),
            }
        )
        self.shared = DenseFFN(
            sd[p + "shared_expert.gate_proj.weight"],
            sd[p + "shared_expert.up_proj.weight"],
            sd[p + "shared_expert.down_proj.weight"],
        )

    def route(self, flat, bug, taps=None):
        logits = flat.float() @ self.router_t
        scores = torch.softmax(logits, dim=-1) if bug == "router_softmax" else torch.sigmoid(logits)
        w, idx = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk and bug != "topk_not_renormalized":
            w = w / w.sum(dim=-1, keepdim=True)
        if taps is not None:
            taps["gate"] = (logits, w, idx)
        return w, idx

    def forward(self, h, bug, taps=None):
        shape = h.shape
        flat = h.reshape(-1, shape[-1])
        w, idx = self.route(flat, bug, taps)
        n_exp = self.bank["gate"].shape[0]
        if bug == "clean_dense_moe":
            dense_w = torch.zeros(flat.shape[0], n_exp, dtype=flat.dtype).scatter(1, idx, w)
            every = torch.stack(
                [_swiglu(flat, self.bank["gate"][e], self.bank["up"][e], self.bank["down"][e]) for e in range(n_exp)]
            )  # (E, N, H)
            routed = torch.einsum("ne,enh->nh", dense_w, every)
        else:
            routed = torch.zeros_like(flat)
            for e in range(n_exp):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel() == 0:
                    continue
                xin = flat[tok]
                we = w[tok, slot, None]
                if bug == "routing_weight_on_input":
                    xin = xin * we
                act = F.silu(xin @ self.bank["gate"][e])
                if taps is not None:
                    taps.setdefault("experts.act_fn", []).append(act)
                y = (act * (xin @ self.bank["up"][e])) @ self.bank["down"][e]
                if bug != "routing_weight_on_input":
                    y = y * we
                routed.index_add_(0, tok, y)
        if taps is not None:
            taps["experts"] = routed
        if bug == "shared_expert_missing":
            out = routed
        else:
            shared = self.shared(flat)
            if taps is not None:
                taps["shared_expert"] = shared
            out = routed + shared
        return out.reshape(shape)


class FlintAttn(nn.Module):
    def __init__(self, sd, p, cfg, sliding):
        super().__init__()
        self.nq = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.sliding = sliding
        self.hidden = cfg.hidden_size
        ws = [sd[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]
        self.w_qkv = nn.Parameter(torch.cat(ws, dim=0).t().contiguous())
        if cfg.attention_bias:
            self.b_qkv = nn.Parameter(torch.cat([sd[p + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")]))
            self.b_out = nn.Parameter(sd[p + "o_proj.bias"].clone())
        else:
            self.b_qkv = nn.Parameter(torch.zeros(self.w_qkv.shape[1]))
            self.b_out = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.w_out = nn.Parameter(sd[p + "o_proj.weight"].t().contiguous())
        self.qk_gamma = nn.Parameter(torch.stack((sd[p + "q_norm.weight"], sd[p + "k_norm.weight"])))
        self.sink_logit = nn.Parameter(sd[p + "sinks"].float().clone())

    def forward(self, h, masks, cos, sin, bug, taps=None):
        B, T, _ = h.shape
        nq, nkv, D = self.nq, self.nkv, self.hd
        qkv = h @ self.w_qkv + self.b_qkv
        q, k, v = qkv.split((nq * D, nkv * D, nkv * D), dim=-1)
        q = q.view(B, T, nq, D).transpose(1, 2)
        k = k.view(B, T, nkv, D).transpose(1, 2)
        v = v.view(B, T, nkv, D).transpose(1, 2)
        if taps is not None:
            taps["q_proj"], taps["k_proj"], taps["v_proj"] = q, k, v
        rotary = self.sliding or bug == "rope_on_nope_layers"
        if bug == "qk_norm_after_rope" and rotary:
            q, k = _rope(q, cos, sin, bug), _rope(k, cos, sin, bug)
            q, k = _rms(q, self.qk_gamma[0], self.eps), _rms(k, self.qk_gamma[1], self.eps)
            if taps is not None:
                taps["q_norm"], taps["k_norm"] = q, k
        else:
            q, k = _rms(q, self.qk_gamma[0], self.eps), _rms(k, self.qk_gamma[1], self.eps)
            if taps is not None:
                taps["q_norm"], taps["k_norm"] = q, k
            if rotary:
                q, k = _rope(q, cos, sin, bug), _rope(k, cos, sin, bug)
        scale = 1.0 / math.sqrt(self.hidden // nq if bug == "scale_from_hidden_size" else D)
        rep = nq // nkv
        if self.sliding and bug == "clean_banded_sliding":
            ctx = self._banded(q, k, v, masks["key_ok"], masks["window"], scale, bug)
        elif bug == "clean_grouped_gqa":
            qg = q.view(B, nkv, rep, T, D)
            s = torch.einsum("bgrtd,bgsd->bgrts", qg, k).reshape(B, nq, T, T) * scale
            s = s.masked_fill(~masks["sliding" if self.sliding else "full"][:, None], NEG)
            pr = _sink_softmax(s, self.sink_logit, bug)
            ctx = torch.einsum("bgrts,bgsd->bgrtd", pr.view(B, nkv, rep, T, T), v).reshape(B, nq, T, D)
        else:
            if bug == "gqa_heads_tiled":
                k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
            else:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~masks["sliding" if self.sliding else "full"][:, None], NEG)
            ctx = _sink_softmax(s, self.sink_logit, bug) @ v
        out = ctx.transpose(1, 2).reshape(B, T, nq * D) @ self.w_out + self.b_out
        if taps is not None:
            taps["o_proj"] = out
        return out

    def _banded(self, q, k, v, key_ok, W, scale, bug):
        B, nq, T, D = q.shape
        rep = nq // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        kw = F.pad(k, (0, 0, W - 1, 0)).unfold(2, W, 1)  # (B, nq, T, D, W): keys t-W+1 .. t
        vw = F.pad(v, (0, 0, W - 1, 0)).unfold(2, W, 1)
        ok = F.pad(key_ok, (W - 1, 0), value=False).unfold(1, W, 1)  # (B, T, W)
        s = torch.einsum("bhtd,bhtdw->bhtw", q, kw) * scale
        s = s.masked_fill(~ok[:, None], NEG)
        pr = _sink_softmax(s, self.sink_logit, bug)
        return torch.einsum("bhtw,bhtdw->bhtd", pr, vw)


class FlintBlock(nn.Module):
    def __init__(self, sd, i, cfg, sliding, bug):
        super().__init__()
        p = f"model.layers.{i}."
        self.eps = cfg.rms_norm_eps
        self.norm_gammas = nn.Parameter(
            torch.stack((sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]))
        )
        self.attn = FlintAttn(sd, p + "self_attn.", cfg, sliding)
        self.sparse = p + "mlp.experts.gate_up_proj" in sd
        if self.sparse:
            self.ffn = SparseFFN(sd, p + "mlp.", cfg, bug)
        else:
            self.ffn = DenseFFN(
                sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"], sd[p + "mlp.down_proj.weight"]
            )

    def forward(self, x, masks, cos, sin, bug, taps=None):
        h = _rms(x, self.norm_gammas[0], self.eps)
        if taps is not None:
            taps["input_layernorm"] = h
        a = self.attn(h, masks, cos, sin, bug, taps)
        x = x + a
        h = _rms(x, self.norm_gammas[1], self.eps)
        if taps is not None:
            taps["post_attention_layernorm"] = h
        f = self.ffn(h, bug, taps) if self.sparse else self.ffn(h)
        if taps is not None:
            taps["mlp"] = f
        x = x + f
        if taps is not None:
            taps["layer"] = x
        return x


class FlintPort(nn.Module):
    def __init__(self, sd, cfg, bug):
        super().__init__()
        self.bug = bug
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window
        n = cfg.num_hidden_layers
        if bug == "layer_types_default_pattern":
            types = ["full_attention" if i < 2 or i % 4 == 1 or i == n - 1 else "sliding_attention" for i in range(n)]
        else:
            types = list(cfg.layer_types)
        self.layer_types = types
        self.tok_emb = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.blocks = nn.ModuleList([FlintBlock(sd, i, cfg, types[i] == "sliding_attention", bug) for i in range(n)])
        self.out_gamma = nn.Parameter(sd["model.norm.weight"].clone())
        self.head_t = nn.Parameter(sd["lm_head.weight"].t().contiguous())
        theta = cfg.rope_parameters["rope_theta"]
        D = cfg.head_dim
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)), persistent=False
        )
        self.taps = None  # debugging aid: set to a dict to record per-layer intermediates

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = self.bug
        B, T = input_ids.shape
        dev = input_ids.device
        x = self.tok_emb[input_ids]
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        key_ok = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        i = torch.arange(T, device=dev)[:, None]
        j = torch.arange(T, device=dev)[None, :]
        causal = j <= i
        band = (j >= i - self.window) if bug == "sliding_window_off_by_one" else (j > i - self.window)
        full = causal[None] & key_ok[:, None, :]
        if bug == "sliding_mask_without_padding":
            sliding = (causal & band)[None].expand(B, T, T)
        else:
            sliding = full & band
        masks = {"full": full, "sliding": sliding, "key_ok": key_ok, "window": self.window}
        freqs = position_ids[..., None].float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        taps = self.taps
        if taps is not None:
            taps.clear()
            taps["embed_tokens"] = x
        for li, blk in enumerate(self.blocks):
            sub = {} if taps is not None else None
            x = blk(x, masks, cos, sin, bug, sub)
            if taps is not None:
                for key, val in sub.items():
                    taps[f"layers.{li}.{key}"] = val
        x = _rms(x, self.out_gamma, self.eps)
        if taps is not None:
            taps["norm"] = x
        return (x @ self.head_t).float()


def build(state_dict, config):
    sd = {k: v.detach().float() if v.is_floating_point() else v for k, v in state_dict.items()}
    return FlintPort(sd, config, BUG).eval()
