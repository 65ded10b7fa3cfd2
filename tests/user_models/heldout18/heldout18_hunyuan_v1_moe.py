"""Hand-written plain-PyTorch port of Hunyuan-MoE v1 (HunYuanMoEV1ForCausalLM, e.g. Hunyuan-A13B).

Architecture as this port implements it:
  * token embedding, output head tied to it (tie_word_embeddings = True here; lm_head.weight used when untied);
  * pre-norm blocks with plain RMSNorm  y = w * x / sqrt(mean(x^2) + eps):
        h = h + Attn(RMS_in(h));  h = h + MoE(RMS_post(h))
  * attention: GQA, explicit head_dim, no biases; RoPE (half-split / NeoX form) on q and k, and only AFTER RoPE a
    per-head RMSNorm over head_dim on q (query_layernorm) and on k (key_layernorm); scale head_dim**-0.5;
    causal + key-padding mask;
  * RoPE base with the fixed NTK-alpha stretch: config.rope_parameters {"rope_type": "dynamic", "alpha": a}
    means base' = theta * a ** (hd / (hd - 2)), static (independent of sequence length), no temperature;
  * MoE block = shared SwiGLU MLP (always on, weight 1) + routed experts:
        p = softmax(x @ Wr) over experts (float32); top-k of p with k = moe_topk[layer] (moe_topk may be a
        per-layer list); the k weights renormalised to sum to 1; each expert is SwiGLU  down(silu(gate x) * up x);
    the expert and shared outputs are summed.

Weight layout of this port (own names, Megatron-like grouped attention, Mixtral-paper expert names):
  embed (V, H); head (H, V); final_gain (H,);
  layers[i].in_gain / post_gain (H,);
  layers[i].attn.w_qkv (H, nkv, g + 2, hd): for kv group j, slots 0..g-1 are query heads j*g .. j*g+g-1,
      slot g is key head j, slot g+1 is value head j  (g = nh / nkv);
  layers[i].attn.w_o (nh, hd, H); layers[i].attn.q_gain / k_gain (hd,);
  layers[i].moe.router (H, E); layers[i].moe.w1 / w3 (E, H, I) = gate / up; layers[i].moe.w2 (E, I, H);
  layers[i].moe.s1 / s3 (H, Is) = shared gate / up; layers[i].moe.s2 (Is, H); layers[i].moe.top_k (int).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "hy_qk_norm_before_rope",  # query/key RMSNorm applied before RoPE (Qwen3/OLMo order); HF normalises the rotated q/k
    "hy_qk_norm_gain_one_plus",  # q/k norm gains applied as (1 + w) (zero-centred Gemma / Qwen3-Next convention)
    "hy_qk_norm_over_all_heads",  # q/k norm taken over the whole projection (all heads) with the head_dim gain tiled
    "hy_q_heads_strided_into_groups",  # load: query head h packed into kv group h % nkv instead of h // g
    "hy_router_no_renorm",  # top-k softmax probabilities used as-is, not renormalised to sum to 1
    "hy_router_sigmoid",  # router scores sigmoid(logits) (DeepSeek-V3 habit) instead of softmax before top-k
    "hy_router_softmax_seq_dim",  # HF's 2-D softmax(dim=1) copied onto (B, S, E) logits: normalised over positions
    "hy_topk_first_layer_for_all",  # per-layer moe_topk list collapsed to moe_topk[0] for every layer
    "hy_shared_mlp_dropped",  # shared_mlp weights never loaded / added: only routed experts contribute
    "hy_expert_gate_up_swapped",  # gate_up_proj split as [up | gate] instead of [gate | up]
    "hy_ntk_alpha_ignored",  # rope "dynamic" with factor 1.0 taken as plain dynamic NTK (no-op): alpha never applied
    "hy_ntk_alpha_exponent_dropped",  # NTK-alpha base written theta * alpha instead of theta * alpha ** (d / (d - 2))
    "hy_pad_mask_dropped",  # attention_mask ignored: causal mask only, left-pad keys visible
]
PADDING_ONLY = {"hy_pad_mask_dropped"}
CLEAN = [
    "router_logit_topk",  # top-k on raw logits, softmax over the k selected logits (== softmax, top-k, renormalise)
    "dense_all_experts",  # every expert run on every token, combined with a dense (N, E) routing-weight matrix
    "shared_as_extra_expert",  # shared MLP stacked as expert E with a constant routing weight of 1
    "rope_complex",  # q/k channels (and q/k norm gains) permuted at load to interleaved pairs; complex RoPE
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


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


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
        H = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.g = self.nh // self.nkv
        self.eps = cfg.rms_norm_eps
        q = sd[p + "q_proj.weight"].float().view(self.nh, self.hd, H)
        k = sd[p + "k_proj.weight"].float().view(self.nkv, self.hd, H)
        v = sd[p + "v_proj.weight"].float().view(self.nkv, self.hd, H)
        qg = sd[p + "query_layernorm.weight"].float()
        kg = sd[p + "key_layernorm.weight"].float()
        if b == "hy_qk_norm_gain_one_plus":
            qg, kg = 1.0 + qg, 1.0 + kg
        if b == "rope_complex":
            o = _pairs_order(self.hd)
            q, k, qg, kg = q[:, o], k[:, o], qg[o], kg[o]
        slots = []
        for j in range(self.nkv):
            if b == "hy_q_heads_strided_into_groups":
                heads = [q[h] for h in range(self.nh) if h % self.nkv == j]
            else:
                heads = [q[j * self.g + t] for t in range(self.g)]
            slots.append(torch.stack(heads + [k[j], v[j]]))  # (g + 2, hd, H)
        self.w_qkv = _P(torch.stack(slots).permute(3, 0, 1, 2))  # (H, nkv, g + 2, hd)
        self.w_o = _P(sd[p + "o_proj.weight"].float().t().reshape(self.nh, self.hd, H))
        self.q_gain, self.k_gain = _P(qg), _P(kg)

    def _qk_norm(self, x, gain):
        if _bug() == "hy_qk_norm_over_all_heads":
            B, n, S, hd = x.shape
            flat = x.transpose(1, 2).reshape(B, S, n * hd)
            flat = _rms(flat, self.eps) * gain.repeat(n)
            return flat.view(B, S, n, hd).transpose(1, 2)
        return _rms(x, self.eps) * gain

    def forward(self, x, allowed, ang):
        b = _bug()
        B, S, _ = x.shape
        t = torch.einsum("bsh,hjtd->bjtsd", x, self.w_qkv)  # (B, nkv, g + 2, S, hd)
        q = t[:, :, : self.g].reshape(B, self.nh, S, self.hd)
        k, v = t[:, :, self.g], t[:, :, self.g + 1]
        _rec(self.pre + "v_proj", v.transpose(1, 2).reshape(B, S, -1))
        if b == "hy_qk_norm_before_rope":
            q, k = self._qk_norm(q, self.q_gain), self._qk_norm(k, self.k_gain)
            q, k = _rope(q, ang), _rope(k, ang)
        else:
            q, k = _rope(q, ang), _rope(k, ang)
            q, k = self._qk_norm(q, self.q_gain), self._qk_norm(k, self.k_gain)
        k, v = k.repeat_interleave(self.g, 1), v.repeat_interleave(self.g, 1)
        s = (q @ k.transpose(-1, -2)) * self.hd**-0.5
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = torch.softmax(s, -1) @ v
        out = torch.einsum("bnsd,ndh->bsh", ctx, self.w_o)
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg, i):
        super().__init__()
        b = _bug()
        self.pre = p
        topk = cfg.moe_topk
        if isinstance(topk, (list, tuple)):
            topk = topk[0] if b == "hy_topk_first_layer_for_all" else topk[i]
        self.top_k = int(topk)
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        inter = gu.shape[1] // 2
        gate, up = gu[:, :inter], gu[:, inter:]
        if b == "hy_expert_gate_up_swapped":
            gate, up = up, gate
        w1, w3 = gate.transpose(1, 2), up.transpose(1, 2)  # (E, H, I)
        w2 = sd[p + "experts.down_proj"].float().transpose(1, 2)  # (E, I, H)
        self.E = w1.shape[0]
        s1 = sd[p + "shared_mlp.gate_proj.weight"].float().t()
        s3 = sd[p + "shared_mlp.up_proj.weight"].float().t()
        s2 = sd[p + "shared_mlp.down_proj.weight"].float().t()
        self.use_shared = b != "hy_shared_mlp_dropped"
        self.stacked_shared = b == "shared_as_extra_expert"
        if self.stacked_shared:
            if s1.shape[1] != w1.shape[2]:
                raise NotImplementedError("shared / expert intermediate sizes differ")
            w1, w3, w2 = torch.cat((w1, s1[None])), torch.cat((w3, s3[None])), torch.cat((w2, s2[None]))
        else:
            self.s1, self.s3, self.s2 = _P(s1), _P(s3), _P(s2)
        self.router = _P(sd[p + "gate.wg.weight"].float().t())
        self.w1, self.w3, self.w2 = _P(w1), _P(w3), _P(w2)

    def _route(self, x):
        """x (B, S, H) -> (idx (N, k), weight (N, k))"""
        b = _bug()
        logits = x.float() @ self.router  # (B, S, E)
        _rec(self.pre + "gate", logits.reshape(-1, self.E))
        if b == "router_logit_topk":
            top, idx = logits.reshape(-1, self.E).topk(self.top_k, -1)
            return idx, torch.softmax(top, -1)
        if b == "hy_router_sigmoid":
            probs = torch.sigmoid(logits)
        elif b == "hy_router_softmax_seq_dim":
            probs = torch.softmax(logits, dim=1)
        else:
            probs = torch.softmax(logits, dim=-1)
        w, idx = probs.reshape(-1, self.E).topk(self.top_k, -1)
        if b != "hy_router_no_renorm":
            w = w / w.sum(-1, keepdim=True)
        return idx, w

    def _expert(self, e, x):
        return (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        flat = x.reshape(-1, H)
        idx, w = self._route(x)
        if b == "dense_all_experts":
            dense = torch.zeros(flat.shape[0], self.E).scatter(1, idx, w)
            outs = torch.einsum("enh->neh", torch.stack([self._expert(e, flat) for e in range(self.E)]))
            out = torch.einsum("ne,neh->nh", dense, outs)
        else:
            out = torch.zeros_like(flat)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel():
                    out.index_add_(0, tok, self._expert(e, flat[tok]) * w[tok, slot, None])
        if self.stacked_shared:
            out = out + 1.0 * self._expert(self.E, flat)
        elif self.use_shared:
            out = out + (F.silu(flat @ self.s1) * (flat @ self.s3)) @ self.s2
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.in_gain = _P(sd[p + "input_layernorm.weight"])
        self.post_gain = _P(sd[p + "post_attention_layernorm.weight"])
        self.attn = Attn(sd, p + "self_attn.", cfg)
        self.moe = MoE(sd, p + "mlp.", cfg, i)

    def forward(self, h, allowed, ang):
        h = h + self.attn(_rms(h, self.eps) * self.in_gain, allowed, ang)
        h = h + self.moe(_rms(h, self.eps) * self.post_gain)
        _rec(self.pre.rstrip("."), h)
        return h


class HunYuanMoEPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.embed = _P(sd["model.embed_tokens.weight"])
        if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
            self.head = _P(sd["model.embed_tokens.weight"].float().t())
        else:
            self.head = _P(sd["lm_head.weight"].float().t())
        self.final_gain = _P(sd["model.norm.weight"])
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rp = dict(cfg.rope_parameters or {})
        theta = float(rp.get("rope_theta", 10000.0))
        kind = rp.get("rope_type", rp.get("type", "default"))
        alpha = rp.get("alpha")
        if kind == "dynamic" and alpha and b != "hy_ntk_alpha_ignored":
            if b == "hy_ntk_alpha_exponent_dropped":
                theta = theta * alpha
            else:
                theta = theta * alpha ** (hd / (hd - 2))
        elif kind not in ("default", "dynamic"):
            raise NotImplementedError(kind)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if _bug() != "hy_pad_mask_dropped":
            allowed = allowed & keep[:, None, None, :]
        h = self.embed[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        for layer in self.layers:
            h = layer(h, allowed, ang)
        h = _rms(h, self.cfg.rms_norm_eps) * self.final_gain
        _rec("model.norm", h)
        logits = h @ self.head
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
    return HunYuanMoEPort(state_dict, config).eval()
