"""Hand-written plain-PyTorch port of Cohere Command-A MoE (Cohere2MoeForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  token embedding (no scaling); * output head tied to the embedding table (tie_word_embeddings);
  * Cohere LayerNorm when config.rms_norm_eps is None (the case here): y = w * (x - mean) / sqrt(var + eps),
    weight only, no bias, eps = layer_norm_eps, computed in float32 (an RMSNorm only if rms_norm_eps is set);
  * PARALLEL block with ONE norm: n = LN(h);  h = h + Attn(n) + FFN(n)  (no post-attention norm);
  attention: GQA, head_dim from config, no biases, scale head_dim**-0.5;
  * RoPE in the INTERLEAVED (GPT-J) form: channel pairs (2i, 2i+1) rotate together, theta from rope_parameters;
  * which layers get RoPE: sliding-window layers, plus the dense-prefix layers when
    prefix_dense_sliding_window_pattern == 1 ("force_rope"); full-attention MoE layers are NoPE;
  * layer kinds from config.layer_types, which HF builds as: the first_k_dense_replace dense-prefix layers with
    their own pattern (prefix_dense_sliding_window_pattern = 1 -> all full), then the remaining layers with
    sliding_window_pattern counted from the END of the prefix (here [full, sliding, full, sliding]);
    a sliding layer lets query q see key k iff q - W < k <= q (W = config.sliding_window);
  * FFN kind from config.mlp_layer_types: "dense" -> SwiGLU with prefix_dense_intermediate_size;
    "sparse" -> MoE:
      - router logits = x @ W_router (no bias); top-k on the LOGITS, then softmax over the k picked logits
        (expert_selection_fn = "softmax"; "sigmoid" -> sigmoid of the picked logits, renormalised if norm_topk_prob);
      - routed experts: SwiGLU with intermediate_size; HF packs gate_up_proj (E, 2*I, H) as [gate rows; up rows];
      - shared expert (SwiGLU, intermediate_size * num_shared_experts) combined with
        shared_expert_combination_strategy = "average": (routed + shared) / 2;
  final LayerNorm; * logits = (h @ E^T) * logit_scale (0.25 here);
  padding: HF-style attention_mask masks keys in both the full and the sliding masks; positions from
  position_ids (0..S-1 when absent).

Weight layout of this port (Flax/T5-style per-head einsum layout, own names):
  embedding.table (V, H); head (V, H) only when not tied (or when a scaled copy is kept); final_ln.weight (H,);
  layers[i].ln.weight (H,);
  layers[i].attn.wq (H, nh, hd); layers[i].attn.wkv (2, H, nkv, hd) with [0] = K, [1] = V; layers[i].attn.wo (nh, hd, H);
  dense layers: layers[i].ffn.wi_gate (H, I), wi_up (H, I), wo (I, H);
  MoE layers:   layers[i].ffn.router_kernel (H, E);
                layers[i].ffn.wi_gate (E, H, I), wi_up (E, H, I), wo (E, I, H)   (routed experts, unpacked);
                layers[i].ffn.shared_wi_gate (H, Is), shared_wi_up (H, Is), shared_wo (Is, H).
  Each layer has plain attributes `sliding` (bool), `rope` (bool) and `sparse` (bool).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "c2_sequential_residual",  # Llama-style sequential block: FFN reads LN(h + attn) instead of the shared parallel LN(h)
    "c2_rmsnorm_for_layernorm",  # RMSNorm used where rms_norm_eps is None: the mean is not subtracted
    "c2_rope_half_split",  # Llama rotate_half (NeoX half-split) RoPE instead of Cohere's interleaved pairs
    "c2_rope_all_layers",  # RoPE applied on the full-attention (NoPE) MoE layers too
    "c2_dense_prefix_nope",  # force_rope missed: the dense-prefix full-attention layer gets no RoPE
    "c2_logit_scale_dropped",  # logits not multiplied by config.logit_scale
    "c2_softmax_before_topk",  # softmax over all experts, then top-k of the probabilities without renormalising
    "c2_shared_sum",  # shared expert added to the routed output instead of averaged ((r + s) / 2)
    "c2_layer_types_no_prefix_offset",  # sliding pattern recomputed over absolute layer index, ignoring the dense prefix
    "c2_gate_up_swapped",  # packed gate_up_proj halves unpacked in the wrong order (up taken as gate)
    "c2_window_off_by_one",  # sliding window mask q - k <= W: W + 1 keys visible
    "c2_kv_repeat_tiled",  # GQA kv heads expanded with .repeat (tiled) instead of repeat_interleave
    "c2_pad_mask_on_queries",  # padding mask broadcast over the query axis instead of the key axis
]
PADDING_ONLY = {"c2_pad_mask_on_queries"}
CLEAN = [
    "rope_complex",  # interleaved RoPE done as a complex multiply on (2i, 2i+1) pairs (no permutation needed)
    "logit_scale_folded",  # logit_scale folded into a separate copy of the tied head at load
    "shared_half_folded",  # the 1/2 of the "average" strategy folded into routed wo and shared_wo at load
    "experts_gather_bmm",  # per-(token, slot) expert weights gathered and applied with a batched matmul
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


class CohereNorm(nn.Module):
    def __init__(self, w, cfg):
        super().__init__()
        self.weight = _P(w)
        self.rms = cfg.rms_norm_eps is not None or _bug() == "c2_rmsnorm_for_layernorm"
        self.eps = cfg.rms_norm_eps if cfg.rms_norm_eps is not None else cfg.layer_norm_eps

    def forward(self, x):
        x = x.float()
        if not self.rms:
            x = x - x.mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rope(x, ang):
    """x (B, heads, S, hd); ang (B, S, hd/2)"""
    b = _bug()
    if b == "rope_complex":
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    if b == "c2_rope_half_split":
        emb = torch.cat((ang, ang), -1)[:, None]
        h = x.shape[-1] // 2
        return x * emb.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * emb.sin()
    emb = ang.repeat_interleave(2, -1)[:, None]
    rot = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return x * emb.cos() + rot * emb.sin()


class Attn(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.pre = p
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.wq = _P(sd[p + "q_proj.weight"].float().t().reshape(H, self.nh, self.hd))
        k = sd[p + "k_proj.weight"].float().t().reshape(H, self.nkv, self.hd)
        v = sd[p + "v_proj.weight"].float().t().reshape(H, self.nkv, self.hd)
        self.wkv = _P(torch.stack((k, v)))
        self.wo = _P(sd[p + "o_proj.weight"].float().t().reshape(self.nh, self.hd, H))
        self.scale = self.hd**-0.5

    def forward(self, x, allowed, ang, rope):
        q = torch.einsum("bsh,hnd->bnsd", x, self.wq)
        k = torch.einsum("bsh,hnd->bnsd", x, self.wkv[0])
        v = torch.einsum("bsh,hnd->bnsd", x, self.wkv[1])
        if rope:
            q, k = _rope(q, ang), _rope(k, ang)
        rep = self.nh // self.nkv
        if _bug() == "c2_kv_repeat_tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("bnqd,bnkd->bnqk", q, k) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = torch.einsum("bnqk,bnkd->bnqd", torch.softmax(s, -1), v)
        out = torch.einsum("bnsd,ndh->bsh", ctx, self.wo)
        _rec(self.pre.rstrip("."), out)
        return out


class DenseFFN(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.pre = p
        self.wi_gate = _P(sd[p + "gate_proj.weight"].t())
        self.wi_up = _P(sd[p + "up_proj.weight"].t())
        self.wo = _P(sd[p + "down_proj.weight"].t())

    def forward(self, x):
        out = (F.silu(x @ self.wi_gate) * (x @ self.wi_up)) @ self.wo
        _rec(self.pre.rstrip("."), out)
        return out


class MoEFFN(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.k, self.E = cfg.num_experts_per_tok, cfg.num_experts
        self.fn, self.norm_topk = cfg.expert_selection_fn, cfg.norm_topk_prob
        self.router_kernel = _P(sd[p + "gate.weight"].float().t())
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        gate, up = gu.chunk(2, 1)
        if b == "c2_gate_up_swapped":
            gate, up = up, gate
        self.wi_gate = _P(gate.transpose(1, 2))
        self.wi_up = _P(up.transpose(1, 2))
        wo = sd[p + "experts.down_proj"].float().transpose(1, 2)  # (E, I, H)
        self.n_shared = cfg.num_shared_experts
        self.strategy = cfg.shared_expert_combination_strategy
        if b == "c2_shared_sum":
            self.strategy = "sum"
        if self.n_shared > 0:
            sp = p + "shared_experts."
            self.shared_wi_gate = _P(sd[sp + "gate_proj.weight"].t())
            self.shared_wi_up = _P(sd[sp + "up_proj.weight"].t())
            swo = sd[sp + "down_proj.weight"].float().t()
            if b == "shared_half_folded" and self.strategy == "average":
                wo, swo = wo * 0.5, swo * 0.5
                self.strategy = "sum"
            self.shared_wo = _P(swo)
        self.wo = _P(wo)

    def route(self, t):
        logits = t @ self.router_kernel
        if _bug() == "c2_softmax_before_topk":
            w, idx = torch.softmax(logits.float(), -1).topk(self.k, -1)
            return w, idx
        top, idx = logits.topk(self.k, -1)
        if self.fn == "softmax":
            w = torch.softmax(top.float(), -1)
        elif self.fn == "sigmoid":
            w = torch.sigmoid(top)
            if self.norm_topk:
                w = w / w.sum(-1, keepdim=True)
        else:
            raise NotImplementedError(self.fn)
        return w, idx

    def forward(self, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        w, idx = self.route(t)
        if _bug() == "experts_gather_bmm":
            T = t.shape[0]
            flat = idx.reshape(-1)  # (T*k,)
            xt = t.repeat_interleave(self.k, 0)[:, None]  # (T*k, 1, H)
            g = torch.bmm(xt, self.wi_gate[flat])
            u = torch.bmm(xt, self.wi_up[flat])
            y = torch.bmm(F.silu(g) * u, self.wo[flat])[:, 0]  # (T*k, H)
            routed = (y.view(T, self.k, H) * w[..., None]).sum(1)
        else:
            routed = torch.zeros_like(t)
            for e in idx.unique().tolist():
                tok, slot = (idx == e).nonzero(as_tuple=True)
                xe = t[tok]
                ye = (F.silu(xe @ self.wi_gate[e]) * (xe @ self.wi_up[e])) @ self.wo[e]
                routed.index_add_(0, tok, ye * w[tok, slot][:, None])
        out = routed
        if self.n_shared > 0:
            sh = (F.silu(t @ self.shared_wi_gate) * (t @ self.shared_wi_up)) @ self.shared_wo
            if self.strategy == "sum":
                out = routed + sh
            elif self.strategy == "average":
                out = (routed + sh) / 2
            else:
                raise NotImplementedError(self.strategy)
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        self.sparse = cfg.mlp_layer_types[i] == "sparse"
        if b == "c2_layer_types_no_prefix_offset":
            self.sliding = (i + 1) % cfg.sliding_window_pattern != 0
        else:
            self.sliding = cfg.layer_types[i] == "sliding_attention"
        force = (not self.sparse) and cfg.prefix_dense_sliding_window_pattern == 1
        if b == "c2_dense_prefix_nope":
            force = False
        self.rope = self.sliding or force or b == "c2_rope_all_layers"
        self.ln = CohereNorm(sd[p + "input_layernorm.weight"], cfg)
        self.attn = Attn(sd, p + "self_attn.", cfg)
        self.ffn = MoEFFN(sd, p + "mlp.", cfg) if self.sparse else DenseFFN(sd, p + "mlp.")

    def forward(self, h, masks, ang):
        n = self.ln(h)
        _rec(self.pre + "input_layernorm", n)
        a = self.attn(n, masks["sliding" if self.sliding else "full"], ang, self.rope)
        if _bug() == "c2_sequential_residual":
            h = h + a
            h = h + self.ffn(self.ln(h))
        else:
            h = h + a + self.ffn(n)
        _rec(self.pre.rstrip("."), h)
        return h


class Cohere2MoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.embedding = nn.Module()
        table = sd["model.embed_tokens.weight"].float()
        self.embedding.table = _P(table)
        head = table if cfg.tie_word_embeddings else sd["lm_head.weight"].float()
        self.logit_scale = float(cfg.logit_scale)
        if b == "c2_logit_scale_dropped":
            self.logit_scale = 1.0
        self.head_scaled = b == "logit_scale_folded"
        if self.head_scaled:
            self.head = _P(head * self.logit_scale)
            self.logit_scale = 1.0
        elif not cfg.tie_word_embeddings:
            self.head = _P(head)
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_ln = CohereNorm(sd["model.norm.weight"], cfg)
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _masks(self, keep):
        b = _bug()
        S = keep.shape[1]
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        causal = (ki <= qi)[None, None]
        W = self.cfg.sliding_window
        near = (qi - ki <= W) if b == "c2_window_off_by_one" else (qi - ki < W)
        pad = keep[:, None, :, None] if b == "c2_pad_mask_on_queries" else keep[:, None, None, :]
        full = causal & pad
        sliding = causal & near[None, None] & pad
        return {"full": full, "sliding": sliding}

    def _core(self, input_ids, keep, pos):
        masks = self._masks(keep)
        h = self.embedding.table[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        for layer in self.layers:
            h = layer(h, masks, ang)
        h = self.final_ln(h)
        _rec("model.norm", h)
        head = self.head if hasattr(self, "head") else self.embedding.table
        logits = h @ head.t()
        if not self.head_scaled:
            _rec("lm_head", logits)
        return logits * self.logit_scale

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
            logits = torch.zeros(B, S, self.cfg.vocab_size)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return Cohere2MoePort(state_dict, config).eval()
