"""Hand-written plain-PyTorch port of VaultGemma (VaultGemmaForCausalLM).

Architecture as this port implements it (what differs from Gemma 2 is marked *):
  * token embedding multiplied by sqrt(hidden_size) (normaliser computed in float32) before the first block;
    output head tied to the UNSCALED embedding table;
  * Gemma RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + w), the checkpoint stores w (zero-centred);
  * * only TWO norms per block, both pre-norms (no post-attention / post-feedforward sandwich norms of Gemma 2):
        h = h + Attn(RMS_in(h));  h = h + MLP(RMS_preffw(h))
  * attention: GQA, explicit head_dim (32 here, not hidden/heads = 16), no biases,
    scores = q.k * query_pre_attn_scalar**-0.5 (24 here, NOT head_dim), then tanh soft-capping
    cap * tanh(s / cap) with cap = attn_logit_softcapping (5.0 here), and only then the mask;
  * RoPE in the half-split (rotate_half / NeoX) form over the full head_dim, theta = rope_parameters["rope_theta"];
  * per-layer attention kind from config.layer_types (here [full, sliding, sliding, full], not Gemma 2's strict
    alternation); a sliding layer lets query q see key k iff q - W < k <= q (W = config.sliding_window keys);
  * MLP: gelu_pytorch_tanh(gate(x)) * up(x) -> down (GeGLU with the tanh approximation), no biases;
  * final logits soft-capped: cap * tanh(logits / cap), cap = final_logit_softcapping (15.0 here);
  * padding: HF-style attention_mask masks keys in BOTH the full and the sliding masks (float32 min fill);
    positions from position_ids (0..S-1 when absent).

Weight layout of this port (Gemma-JAX / Flax style, own names, not the HF state-dict names):
  embedder.input_embedding (V, H) (also the head); final_norm.scale (H,) = w;
  layers[i].pre_attention_norm.scale / pre_ffw_norm.scale (H,) = w (the +1 is added at run time);
  layers[i].attn.q_einsum (nh, H, hd); layers[i].attn.kv_einsum (2, nkv, H, hd) with [0] = K, [1] = V;
  layers[i].attn.attn_vec_einsum (nh, hd, H);
  layers[i].mlp.gating_einsum (2, H, I) with [0] = gate, [1] = up; layers[i].mlp.linear (I, H).
  All projections are applied through torch.einsum; each layer has a plain attribute `sliding` (bool).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "vg_norm_gain_no_offset",  # Llama RMSNorm reused: scales by w instead of (1 + w) on a zero-centred Gemma checkpoint
    "vg_embed_unscaled",  # embeddings not multiplied by sqrt(hidden_size) before the first block
    "vg_prescaled_table_tied_head",  # table pre-multiplied by sqrt(H) at load and that same tensor reused as the tied head (logits x 8)
    "vg_query_scale_head_dim",  # scores scaled by head_dim**-0.5 (32) instead of query_pre_attn_scalar**-0.5 (24)
    "vg_attn_softcap_dropped",  # SDPA-style attention path: attn_logit_softcapping never applied
    "vg_softcap_after_mask",  # soft-cap applied after masking: masked scores become -cap instead of ~-inf, future keys leak
    "vg_final_softcap_no_rescale",  # final soft-cap written tanh(logits / cap) without multiplying back by cap
    "vg_layer_types_parity",  # Gemma 2 template: sliding on even layer indices, config.layer_types ignored
    "vg_window_one_key_short",  # flash-attn window_size=(W-1, 0) convention reapplied on a q - k < W mask: only W - 1 keys visible
    "vg_gelu_exact",  # hidden_activation gelu_pytorch_tanh taken as exact erf GELU
    "vg_gate_up_swapped",  # gate_proj / up_proj packed into gating_einsum in the wrong order: GELU applied to the up branch
    "vg_sliding_pad_mask_dropped",  # padding merged into the full-attention mask only; sliding layers get causal + window only
]
PADDING_ONLY = {"vg_sliding_pad_mask_dropped"}
CLEAN = [
    "query_scale_folded",  # query_pre_attn_scalar**-0.5 folded into q_einsum at load, scores left unscaled
    "embed_prescaled",  # input table stored pre-multiplied by sqrt(H); the tied head keeps a separate unscaled copy
    "norm_plus_one_folded",  # norm scales stored as (1 + w) at load, applied as plain gains
    "rope_complex",  # head channels of q/k permuted at load to interleaved pairs; RoPE as a complex multiply
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


def _pairs_order(hd):
    """channel order that puts half-split pair (i, i + hd/2) at (2i, 2i+1)"""
    idx = []
    for i in range(hd // 2):
        idx += [i, hd // 2 + i]
    return torch.tensor(idx)


class GemmaNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        b = _bug()
        self.folded = b == "norm_plus_one_folded"
        self.plain = b == "vg_norm_gain_no_offset"
        self.scale = _P(1.0 + w.float() if self.folded else w)
        self.eps = eps

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.folded or self.plain:
            return y * self.scale
        return y * (1.0 + self.scale)


def _rope(x, ang):
    """x (B, heads, S, hd); ang (B, S, hd/2)"""
    if _bug() == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    emb = torch.cat((ang, ang), -1)[:, None]
    h = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * emb.sin()


class Attn(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        q = sd[p + "q_proj.weight"].float().view(self.nh, self.hd, H).transpose(1, 2)  # (nh, H, hd)
        k = sd[p + "k_proj.weight"].float().view(self.nkv, self.hd, H).transpose(1, 2)
        v = sd[p + "v_proj.weight"].float().view(self.nkv, self.hd, H).transpose(1, 2)
        if b == "rope_complex":
            order = _pairs_order(self.hd)
            q, k = q[..., order], k[..., order]
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        if b == "vg_query_scale_head_dim":
            self.scale = self.hd**-0.5
        if b == "query_scale_folded":
            q = q * self.scale
            self.scale = 1.0
        self.q_einsum = _P(q)
        self.kv_einsum = _P(torch.stack((k, v)))
        o = sd[p + "o_proj.weight"].float()  # (H, nh*hd)
        self.attn_vec_einsum = _P(o.t().reshape(self.nh, self.hd, H))
        self.cap = cfg.attn_logit_softcapping

    def forward(self, x, allowed, ang):
        b = _bug()
        B, S, _ = x.shape
        q = torch.einsum("bsh,nhd->bnsd", x, self.q_einsum)
        k = torch.einsum("bsh,nhd->bnsd", x, self.kv_einsum[0])
        v = torch.einsum("bsh,nhd->bnsd", x, self.kv_einsum[1])
        if b not in ("rope_complex", "query_scale_folded"):
            _rec(self.pre + "q_proj", q.transpose(1, 2).reshape(B, S, -1))
            _rec(self.pre + "k_proj", k.transpose(1, 2).reshape(B, S, -1))
        _rec(self.pre + "v_proj", v.transpose(1, 2).reshape(B, S, -1))
        q, k = _rope(q, ang), _rope(k, ang)
        g = self.nh // self.nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("bnqd,bnkd->bnqk", q, k) * self.scale
        fill = torch.finfo(s.dtype).min
        if b == "vg_softcap_after_mask":
            s = s.masked_fill(~allowed, fill)
        if self.cap is not None and b != "vg_attn_softcap_dropped":
            s = torch.tanh(s / self.cap) * self.cap
        if b != "vg_softcap_after_mask":
            s = s.masked_fill(~allowed, fill)
        ctx = torch.einsum("bnqk,bnkd->bnqd", torch.softmax(s, -1), v)
        out = torch.einsum("bnsd,ndh->bsh", ctx, self.attn_vec_einsum)
        _rec(self.pre.rstrip("."), out)
        return out


class GeGLU(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        gate = sd[p + "gate_proj.weight"].float().t()
        up = sd[p + "up_proj.weight"].float().t()
        pair = (up, gate) if _bug() == "vg_gate_up_swapped" else (gate, up)
        self.gating_einsum = _P(torch.stack(pair))
        self.linear = _P(sd[p + "down_proj.weight"].float().t())
        if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            raise NotImplementedError(cfg.hidden_activation)
        self.approx = "none" if _bug() == "vg_gelu_exact" else "tanh"
        self.pre = p

    def forward(self, x):
        gate = x @ self.gating_einsum[0]
        up = x @ self.gating_einsum[1]
        out = (F.gelu(gate, approximate=self.approx) * up) @ self.linear
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        if _bug() == "vg_layer_types_parity":
            self.sliding = i % 2 == 0
        else:
            self.sliding = cfg.layer_types[i] == "sliding_attention"
        self.pre_attention_norm = GemmaNorm(sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = Attn(sd, p + "self_attn.", cfg)
        self.pre_ffw_norm = GemmaNorm(sd[p + "pre_feedforward_layernorm.weight"], cfg.rms_norm_eps)
        self.mlp = GeGLU(sd, p + "mlp.", cfg)

    def forward(self, h, masks, ang):
        n = self.pre_attention_norm(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attn(n, masks["sliding" if self.sliding else "full"], ang)
        n = self.pre_ffw_norm(h)
        _rec(self.pre + "pre_feedforward_layernorm", n)
        h = h + self.mlp(n)
        _rec(self.pre.rstrip("."), h)
        return h


class VaultGemmaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        table = sd["model.embed_tokens.weight"].float()
        self.normalizer = torch.tensor(math.sqrt(cfg.hidden_size), dtype=torch.float32)
        self.embedder = nn.Module()
        self.prescaled = b in ("embed_prescaled", "vg_prescaled_table_tied_head")
        self.embedder.input_embedding = _P(table * self.normalizer if self.prescaled else table)
        if not cfg.tie_word_embeddings:
            self.embedder.output_embedding = _P(sd["lm_head.weight"])
        elif b == "embed_prescaled":
            self.embedder.output_embedding = _P(table)
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = GemmaNorm(sd["model.norm.weight"], cfg.rms_norm_eps)
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
        near = (qi - ki < W - 1) if b == "vg_window_one_key_short" else (qi - ki < W)
        pad = keep[:, None, None, :]
        full = causal & pad
        sliding = causal & near[None, None]
        if b != "vg_sliding_pad_mask_dropped":
            sliding = sliding & pad
        return {"full": full, "sliding": sliding.expand_as(full)}

    def _core(self, input_ids, keep, pos):
        b = _bug()
        masks = self._masks(keep)
        h = self.embedder.input_embedding[input_ids]
        if not self.prescaled and b != "vg_embed_unscaled":
            h = h * self.normalizer
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        for layer in self.layers:
            h = layer(h, masks, ang)
        h = self.final_norm(h)
        _rec("model.norm", h)
        head = getattr(self.embedder, "output_embedding", None)
        if head is None:
            head = self.embedder.input_embedding
        logits = h @ head.t()
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            if b == "vg_final_softcap_no_rescale":
                logits = torch.tanh(logits / cap)
            else:
                logits = torch.tanh(logits / cap) * cap
        _rec("lm_head", logits)
        return logits

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
    return VaultGemmaPort(state_dict, config).eval()
