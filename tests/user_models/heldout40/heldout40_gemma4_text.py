"""Hand-written plain-PyTorch port of the Gemma 4 text decoder (Gemma4ForCausalLM, model_type gemma4_text).

Architecture as this port implements it (all in float32):
- RMSNorm(x; w) = x * (mean(x**2) + eps) ** -0.5 * w over the last axis, eps = config.rms_norm_eps.  Gemma 4
  multiplies by w itself (NOT by 1 + w as Gemma 1-3 did).  RMSNorm0(x) is the same without a weight.
- embedding: e = E[ids] * sqrt(H).  The output head is tied: logits = c * tanh((RMSNorm(h; w_final) @ E^T) / c),
  c = config.final_logit_softcapping (no sqrt(H) on the head).
- per-layer embeddings (PLE), P = hidden_size_per_layer_input, L layers:
      tok[l]  = E_ple[ids] (packed as (V, L * P), layer-major) [..., l * P:(l + 1) * P] * sqrt(P)
      ctx[l]  = RMSNorm((e @ W_pm^T * H ** -0.5)[..., l * P:(l + 1) * P]; w_ple_norm)   (e is the *scaled* embedding)
      ple[l]  = (ctx[l] + tok[l]) * 2 ** -0.5
- decoder layer i ("sandwich" norms, every norm below has its own weight):
      h  = h + RMSNorm(Attn(RMSNorm(h; in)); post_attn)
      r  = h
      d  = RMSNorm(MLP(RMSNorm(r; pre_ffn)); post_ffn_1)                      dense branch
      m  = RMSNorm(MoE(RMSNorm(r; pre_ffn_2), route(r)); post_ffn_2)          expert branch (fed the raw residual r)
      h  = r + RMSNorm(d + m; post_ffn)
      h  = h + RMSNorm(W_pp (gelu_tanh(W_pg h) * ple[i]); post_ple)
      h  = h * layer_scalar[i]                                               (the whole stream, residual included)
- MLP(x) = W_down (gelu_tanh(W_gate x) * W_up x); the kv-shared layers' MLP is twice as wide (use_double_wide_mlp).
- router (on the raw residual r): z = (RMSNorm0(r) * router.scale * H ** -0.5) @ W_r^T; p = softmax(z) (fp32);
  top-k of p, renormalised to sum 1, then multiplied by per_expert_scale[expert id].
  expert e: W_d[e] (gelu_tanh(x W_g[e]) * x W_u[e]), gate/up from the fused gate_up_proj rows [gate | up];
  MoE(x) = sum_k weight_k * expert_{idx_k}(x).
- attention, per layer type (layer_types): sliding layers use head_dim, num_key_value_heads, default RoPE
  (theta_s) and a window of W = sliding_window keys (key j visible from query i iff i - W < j <= i); full layers use
  the global head dim, num_global_key_value_heads and "proportional" RoPE.  With biases (attention_bias):
      q = RMSNorm(W_q x + b_q per head; q_norm), then RoPE
      k = RMSNorm(W_k x + b_k per head; k_norm), then RoPE
      v = RMSNorm0(W_v x + b_v per head)   -- full layers with attention_k_eq_v: v = RMSNorm0(W_k x + b_k), i.e.
          the RAW key projection (before k_norm and RoPE) is reused as the value.
      scores = q k^T * 1.0 (no 1/sqrt(d): q/k norms take its place), + mask, softmax in fp32; GQA: query head h
      reads kv head h // (n_q / n_kv); out = W_o concat_heads + b_o.
  KV sharing: the last num_kv_shared_layers layers have no k/v weights; each reuses the (normed, roped) K and V of
  the last earlier non-shared layer of the same type (its own q, mask and RoPE type).
- RoPE (rotate-half layout, pairs (j, j + d/2)): default: inv_freq_j = theta ** (-2j / d), j < d/2; proportional:
  the first n = int(partial_rotary_factor * d // 2) frequencies are theta ** (-2j / d) (exponent over the FULL head
  dim), the other d/2 - n are 0 (no rotation), all divided by rope "factor".  angle = position * inv_freq.
- masks: causal (+ window for sliding layers) AND the (batch, seq) padding mask on keys; disallowed scores get
  finfo.min (a fully masked padding row stays finite).  position_ids default to arange(seq).

Weight layout of this port (own names; made at load time by `build`):
- tok_emb (V, H) = E * sqrt(H) (embedding scale precomputed); head_t (H, V) = E^T (tied head, transposed, unscaled).
- ple_tab (L, V, P) = the packed PLE table split per layer and pre-multiplied by sqrt(P);
  ple_proj_t (H, L * P) = W_pm^T * H ** -0.5 (scale folded); ple_norm (P,); final_norm (H,).
- blocks[i]:
  norms (8, H) stacked rows [in, post_attn, pre_ffn, post_ffn, post_ffn_1, post_ffn_2, pre_ffn_2, post_ple];
  qn (d,), kn (d,) (kn absent on kv-shared layers);
  w_qkv (H, n_q d + n_kv d [+ n_kv d]) = [W_q | W_k | W_v]^T fused and transposed (no W_v with k_eq_v; only W_q on
  kv-shared layers), b_qkv likewise; w_o (n_q d, H) transposed, b_o (H,);
  w_gu (H, 2 I) = [W_gate | W_up]^T fused; w_dn (I, H);
  w_rt (H, E) = (W_r * router.scale * H ** -0.5)^T (router scale folded in); ex_scale (E,);
  ex_g, ex_u (E, H, Im) = the fused gate_up_proj split into gate and up and transposed; ex_d (E, Im, H);
  w_pg (H, P), w_pp (P, H) transposed; scalar (1,) buffer = layer_scalar.
- buffers inv_freq_sliding_attention (d_s/2,), inv_freq_full_attention (d_f/2,): RoPE frequencies computed from
  config.rope_parameters (not stored in the checkpoint).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "norm_one_plus_weight",  # loader stores every RMSNorm weight as 1 + w (the Gemma 1-3 convention) instead of w
    "attn_scale_inv_sqrt_d",  # attention scores multiplied by head_dim ** -0.5; Gemma 4's scaling is 1.0 (QK norms)
    "v_norm_skipped",  # the weightless RMSNorm on the values (v_norm) is not applied
    "k_eq_v_from_normed_key",  # k_eq_v layers take v from the key AFTER k_norm and RoPE instead of the raw k projection
    "rope_partial_ignored",  # proportional RoPE's partial_rotary_factor ignored: all d/2 frequencies of the full layers rotate
    "sliding_window_off_by_one",  # sliding mask keeps W + 1 keys (i - W <= j) instead of W (i - W < j)
    "gqa_tiled_heads",  # GQA maps query head h to kv head h % n_kv (tiled) instead of h // (n_q / n_kv) (repeat_interleave)
    "final_softcap_skipped",  # final_logit_softcapping ignored (as in a Gemma 3 port): raw logits, no c * tanh(x / c)
    "per_expert_scale_by_slot",  # per_expert_scale indexed by the top-k slot (0..k-1) instead of the chosen expert id
    "experts_gate_up_swapped",  # fused experts gate_up_proj split as [up | gate] instead of [gate | up]
    "ple_unpack_transposed",  # packed PLE table (V, L*P) unpacked as (V, P, L) instead of (V, L, P) at load
    "tied_head_prescaled",  # tied head taken from the sqrt(H)-prescaled embedding table: logits * sqrt(H) before softcap
    "gelu_exact",  # hidden_activation gelu_pytorch_tanh computed as the exact erf GELU
    "sliding_pad_mask_dropped",  # padding mask combined into the full-attention mask only; sliding layers attend to pads
]
PADDING_ONLY = ["sliding_pad_mask_dropped"]
CLEAN = [
    "router_softmax_topk",  # top-k on the router logits, softmax over the k chosen logits (= renormalised top-k probs)
    "attn_online_softmax",  # attention over key blocks of 8 with a running max / denominator (flash-style)
    "rope_complex",  # RoPE as a complex multiplication of (x_j + i x_{j+d/2}) by e^{i angle}
    "experts_dense_mix",  # every expert on every token, mixed with a dense (tokens, experts) weight matrix (0 if unchosen)
    "qkv_split",  # three separate q / k / v matmuls on column slices of the fused weight instead of one
]


# --------------------------------------------------------------------------------------------------------------
# helpers


def _rms(x, w=None, eps=1e-6):
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return y if w is None else y * w


def _act(x):
    if BUG == "gelu_exact":
        return F.gelu(x)
    return F.gelu(x, approximate="tanh")


def _inv_freq(params, d):
    theta = float(params["rope_theta"])
    if params.get("rope_type", "default") == "proportional":
        n = int(params.get("partial_rotary_factor", 1.0) * d // 2)
        if BUG == "rope_partial_ignored":
            n = d // 2
        inv = 1.0 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / d)
        inv = torch.cat([inv, torch.zeros(d // 2 - n)])
        return inv / float(params.get("factor", 1.0))
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def _rope(x, ang):
    """x (B, T, n, d); ang (B, T, d/2)."""
    h = x.shape[-1] // 2
    if BUG == "rope_complex":
        z = torch.complex(x[..., :h], x[..., h:]) * torch.polar(torch.ones_like(ang), ang)[:, :, None, :]
        return torch.cat([z.real, z.imag], dim=-1)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None, :]
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


def _attend(q, k, v, allowed):
    """q (B, nq, T, d); k, v (B, nkv, T, d); allowed (B, 1, T, T) bool."""
    nq, nkv = q.shape[1], k.shape[1]
    if BUG == "gqa_tiled_heads":
        idx = torch.arange(nq) % nkv
    else:
        idx = torch.arange(nq) // (nq // nkv)
    k, v = k[:, idx], v[:, idx]
    scale = q.shape[-1] ** -0.5 if BUG == "attn_scale_inv_sqrt_d" else 1.0
    if BUG == "attn_online_softmax":
        T = k.shape[2]
        m = torch.full(q.shape[:-1] + (1,), -math.inf)
        den = torch.zeros_like(m)
        acc = torch.zeros_like(q)
        for s in range(0, T, 8):
            sc = (q @ k[:, :, s : s + 8].transpose(-1, -2)) * scale
            sc = sc.masked_fill(~allowed[..., s : s + 8], -math.inf)
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(sc - m_safe)
            corr = torch.exp(m - m_safe)
            den = den * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v[:, :, s : s + 8]
            m = m_new
        return acc / den.clamp_min(1e-30)
    sc = (q @ k.transpose(-1, -2)) * scale
    sc = sc.masked_fill(~allowed, torch.finfo(sc.dtype).min)
    return torch.softmax(sc, dim=-1) @ v


# --------------------------------------------------------------------------------------------------------------
# modules


class Block(nn.Module):
    def __init__(self, sd, p, cfg, i, norm_w):
        super().__init__()
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.kind = cfg.layer_types[i]
        self.nq = cfg.num_attention_heads
        self.top_k = cfg.top_k_experts
        wq = sd[p + "self_attn.q_proj.weight"]
        self.d = wq.shape[0] // self.nq
        self.shared = (p + "self_attn.k_proj.weight") not in sd
        self.k_eq_v = False
        names = ["q"]
        if not self.shared:
            names.append("k")
            self.k_eq_v = (p + "self_attn.v_proj.weight") not in sd
            if not self.k_eq_v:
                names.append("v")
        ws = [sd[f"{p}self_attn.{n}_proj.weight"] for n in names]
        bs = [sd.get(f"{p}self_attn.{n}_proj.bias", torch.zeros(w.shape[0])) for n, w in zip(names, ws)]
        self.sizes = [w.shape[0] for w in ws]
        self.nkv = self.sizes[1] // self.d if not self.shared else None
        self.w_qkv = nn.Parameter(torch.cat(ws, 0).t().contiguous())
        self.b_qkv = nn.Parameter(torch.cat(bs, 0))
        self.w_o = nn.Parameter(sd[p + "self_attn.o_proj.weight"].t().contiguous())
        self.b_o = nn.Parameter(sd.get(p + "self_attn.o_proj.bias", torch.zeros(H)))
        self.qn = nn.Parameter(norm_w(sd[p + "self_attn.q_norm.weight"]))
        if not self.shared:
            self.kn = nn.Parameter(norm_w(sd[p + "self_attn.k_norm.weight"]))
        rows = [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
            "post_per_layer_input_norm",
        ]
        self.norms = nn.Parameter(torch.stack([norm_w(sd[f"{p}{r}.weight"]) for r in rows]))
        # dense MLP
        self.w_gu = nn.Parameter(
            torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], 0).t().contiguous()
        )
        self.w_dn = nn.Parameter(sd[p + "mlp.down_proj.weight"].t().contiguous())
        # router and experts
        self.w_rt = nn.Parameter((sd[p + "router.proj.weight"] * sd[p + "router.scale"] * H**-0.5).t().contiguous())
        self.ex_scale = nn.Parameter(sd[p + "router.per_expert_scale"].clone())
        gu = sd[p + "experts.gate_up_proj"]  # (E, 2 Im, H)
        gate, up = gu.chunk(2, dim=1)
        if BUG == "experts_gate_up_swapped":
            gate, up = up, gate
        self.ex_g = nn.Parameter(gate.transpose(1, 2).contiguous())
        self.ex_u = nn.Parameter(up.transpose(1, 2).contiguous())
        self.ex_d = nn.Parameter(sd[p + "experts.down_proj"].transpose(1, 2).contiguous())
        # per-layer input
        self.w_pg = nn.Parameter(sd[p + "per_layer_input_gate.weight"].t().contiguous())
        self.w_pp = nn.Parameter(sd[p + "per_layer_projection.weight"].t().contiguous())
        self.register_buffer("scalar", sd.get(p + "layer_scalar", torch.ones(1)).clone())

    def n(self, x, row):
        return _rms(x, self.norms[row], self.eps)

    def project(self, x):
        """[q, k, v] (or fewer: see w_qkv) projections, each (B, T, n * d)."""
        if BUG == "qkv_split":
            parts, o = [], 0
            for s in self.sizes:
                parts.append(x @ self.w_qkv[:, o : o + s] + self.b_qkv[o : o + s])
                o += s
            return parts
        return list((x @ self.w_qkv + self.b_qkv).split(self.sizes, dim=-1))

    def attn(self, x, ang, allowed, kv_store):
        B, T, _ = x.shape
        d = self.d
        parts = self.project(x)
        q = _rope(_rms(parts[0].view(B, T, -1, d), self.qn, self.eps), ang)
        if self.shared:
            k, v = kv_store[self.kind]
        else:
            k_raw = parts[1].view(B, T, -1, d)
            k = _rope(_rms(k_raw, self.kn, self.eps), ang)
            if self.k_eq_v:
                v_raw = k if BUG == "k_eq_v_from_normed_key" else k_raw
            else:
                v_raw = parts[2].view(B, T, -1, d)
            v = v_raw if BUG == "v_norm_skipped" else _rms(v_raw, None, self.eps)
            kv_store[self.kind] = (k, v)
        o = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed)
        return o.transpose(1, 2).reshape(B, T, -1) @ self.w_o + self.b_o

    def mlp(self, x):
        g, u = (x @ self.w_gu).chunk(2, dim=-1)
        return (_act(g) * u) @ self.w_dn

    def route(self, r):
        """r: the raw residual (N, H) -> (weights, expert ids), both (N, k)."""
        z = _rms(r, None, self.eps) @ self.w_rt
        if BUG == "router_softmax_topk":
            zk, idx = torch.topk(z, self.top_k, dim=-1)
            w = torch.softmax(zk, dim=-1)
        else:
            probs = torch.softmax(z, dim=-1)
            w, idx = torch.topk(probs, self.top_k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
        if BUG == "per_expert_scale_by_slot":
            w = w * self.ex_scale[torch.arange(self.top_k)]
        else:
            w = w * self.ex_scale[idx]
        return w, idx

    def experts(self, x, w, idx):
        """x: the pre_ffn_2-normed residual (N, H); sum over the k chosen experts, weighted."""
        E = self.ex_g.shape[0]
        if BUG == "experts_dense_mix":
            dense = torch.zeros(x.shape[0], E).scatter(1, idx, w)  # (N, E)
            hid = _act(torch.einsum("nh,ehi->eni", x, self.ex_g)) * torch.einsum("nh,ehi->eni", x, self.ex_u)
            out = torch.einsum("eni,eih->enh", hid, self.ex_d)
            return torch.einsum("enh,ne->nh", out, dense)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            ye = (_act(xe @ self.ex_g[e]) * (xe @ self.ex_u[e])) @ self.ex_d[e]
            out.index_add_(0, tok, ye * w[tok, slot, None])
        return out

    def forward(self, h, ple, ang, allowed, kv_store):
        h = h + self.n(self.attn(self.n(h, 0), ang, allowed, kv_store), 1)
        r = h
        dense = self.n(self.mlp(self.n(r, 2)), 4)
        flat = r.reshape(-1, r.shape[-1])
        w, idx = self.route(flat)
        experts = self.experts(self.n(flat, 6), w, idx).view_as(r)
        h = r + self.n(dense + self.n(experts, 5), 3)
        h = h + self.n(self.per_layer_branch(h, ple), 7)
        return h * self.scalar

    def per_layer_branch(self, h, ple):
        return (_act(h @ self.w_pg) * ple) @ self.w_pp


class Gemma4TextPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        sd = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in sd.items()}
        H = cfg.hidden_size
        L = cfg.num_hidden_layers
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.layer_types = list(cfg.layer_types)
        self.window = cfg.sliding_window
        self.softcap = cfg.final_logit_softcapping

        def norm_w(w):
            return (1.0 + w) if BUG == "norm_one_plus_weight" else w.clone()

        emb = sd["embed_tokens.weight"]
        self.tok_emb = nn.Parameter(emb * H**0.5)
        head = sd.get("lm_head.weight", emb) if not cfg.tie_word_embeddings else emb
        self.head_t = nn.Parameter((self.tok_emb.data if BUG == "tied_head_prescaled" else head).t().contiguous())
        self.final_norm = nn.Parameter(norm_w(sd["norm.weight"]))

        P = cfg.hidden_size_per_layer_input
        self.P = P
        packed = sd["embed_tokens_per_layer.weight"]  # (V_ple, L * P)
        if BUG == "ple_unpack_transposed":
            tab = packed.view(packed.shape[0], P, L).permute(2, 0, 1)
        else:
            tab = packed.view(packed.shape[0], L, P).permute(1, 0, 2)
        self.ple_tab = nn.Parameter(tab.contiguous() * P**0.5)  # (L, V, P)
        self.ple_proj_t = nn.Parameter((sd["per_layer_model_projection.weight"] * H**-0.5).t().contiguous())
        self.ple_norm = nn.Parameter(norm_w(sd["per_layer_projection_norm.weight"]))

        self.blocks = nn.ModuleList([Block(sd, f"layers.{i}.", cfg, i, norm_w) for i in range(L)])
        head_dims = {}
        for b in self.blocks:
            head_dims[b.kind] = b.d
        for kind, d in head_dims.items():
            self.register_buffer(f"inv_freq_{kind}", _inv_freq(cfg.rope_parameters[kind], d), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        L = len(self.blocks)
        if position_ids is None:
            position_ids = torch.arange(T).unsqueeze(0).expand(B, T)
        h = self.tok_emb[input_ids]

        tok = self.ple_tab[:, input_ids].permute(1, 2, 0, 3)  # (B, T, L, P)
        ctx = _rms((h @ self.ple_proj_t).view(B, T, L, self.P), self.ple_norm, self.eps)
        ple = (ctx + tok) * 2.0**-0.5

        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        causal = j <= i
        if BUG == "sliding_window_off_by_one":
            band = j >= i - self.window
        else:
            band = j > i - self.window
        keys = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        keys = keys[:, None, None, :]
        full = causal[None, None] & keys
        sliding = causal[None, None] & band[None, None]
        if BUG != "sliding_pad_mask_dropped":
            sliding = sliding & keys
        masks = {"full_attention": full, "sliding_attention": sliding}
        angles = {k: position_ids[..., None].float() * getattr(self, f"inv_freq_{k}") for k in set(self.layer_types)}

        kv_store = {}
        for li, blk in enumerate(self.blocks):
            h = blk(h, ple[:, :, li], angles[blk.kind], masks[blk.kind], kv_store)
        h = _rms(h, self.final_norm, self.eps)
        logits = h @ self.head_t
        if self.softcap is not None and BUG != "final_softcap_skipped":
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


def build(state_dict, config):
    with torch.no_grad():
        model = Gemma4TextPort({k: v.detach().float() for k, v in state_dict.items()}, config)
    return model.eval()
