"""Hand-written plain-PyTorch port of nanochat (NanoChatForCausalLM).

Architecture as this port implements it:
  * every norm is a PARAMETER-FREE RMSNorm: y = x / sqrt(mean(x^2) + eps), eps = config.rms_norm_eps;
  * the token embedding is normalised right away (h = norm(wte[ids])) before the first block;
  * pre-norm blocks: h = h + Attn(norm(h)); h = h + MLP(norm(h)); final norm; untied lm_head (no bias);
  * attention: GQA (nh query heads over nkv key/value heads, repeat-interleaved), q/k/v/o biases when
    config.attention_bias; RoPE in half-split form over the full head_dim but rotating the OTHER way from
    Llama:   (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin),  angle = pos * theta ** (-2i / hd);
    then per-head QK-norm (parameter-free RMSNorm over head_dim) on q and k AFTER RoPE; scale head_dim**-0.5;
    causal mask plus HF left-padding mask on keys;
  * MLP: fc2(relu(fc1(x)) ** 2) (squared ReLU, "relu2"), no biases;
  * logits soft-capped: cap * tanh(logits / cap), cap = config.final_logit_softcapping.

Weight layout of this port (nanochat-repo style names, matrices stored (in, out)):
  wte (V, H); lm_head (H, V);
  blocks[i].attn.c_q (H, nh*hd), c_q_b (nh*hd,); c_k / c_v (H, nkv*hd), c_k_b / c_v_b (nkv*hd,);
  blocks[i].attn.c_proj (nh*hd, H), c_proj_b (H,)   (missing biases stored as zeros);
  blocks[i].mlp.c_fc (H, I); blocks[i].mlp.c_proj (I, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "nc_rope_llama_sign",  # Llama rotate_half reused: (x1 cos - x2 sin, x2 cos + x1 sin), rotation in the wrong direction
    "nc_rope_interleaved",  # RoPE rotates adjacent channel pairs (2i, 2i+1) instead of the half-split pairs (i, i+hd/2)
    "nc_embed_norm_missing",  # the extra norm right after the token embedding is left out
    "nc_relu_not_squared",  # hidden_act "relu2" taken as plain ReLU
    "nc_layernorm_not_rms",  # parameter-free norm written as F.layer_norm (mean-centred) instead of RMSNorm
    "nc_qk_norm_missing",  # QK-norm on queries/keys skipped
    "nc_qk_norm_across_heads",  # QK-norm RMS taken over the whole (nh*hd) projection instead of per head
    "nc_gqa_tiled",  # key/value heads expanded with .repeat (tiling 0,1,0,1) instead of repeat_interleave (0,0,1,1)
    "nc_attn_bias_dropped",  # upstream nanochat has no biases: config.attention_bias ignored, all attention biases dropped
    "nc_softcap_no_rescale",  # soft-cap written tanh(logits / cap) without multiplying back by cap
    "nc_softcap_hardcoded_15",  # soft-cap constant 15 copied from nanochat's gpt.py instead of config.final_logit_softcapping
    "nc_tied_head",  # wte reused as the output head although tie_word_embeddings is False
    "nc_pad_mask_dropped",  # left padding not masked out of the keys (causal mask only)
]
PADDING_ONLY = {"nc_pad_mask_dropped"}
CLEAN = [
    "rope_negated_angle",  # Llama-form rotation applied with negated angles (cos(-a), sin(-a)): same map as nanochat's
    "qk_norm_before_rope",  # QK-norm applied before RoPE: a parameter-free RMSNorm commutes with the rotation
    "fused_qkv",  # c_q / c_k / c_v fused into one (H, (nh + 2 nkv) hd) matrix and bias, split after the matmul
    "softcap_sigmoid",  # cap * tanh(x / cap) computed as cap * (2 * sigmoid(2 x / cap) - 1)
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


def _norm(x, eps):
    if _bug() == "nc_layernorm_not_rms":
        return F.layer_norm(x, x.shape[-1:], eps=eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, hd/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b == "nc_rope_interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    if b == "nc_rope_llama_sign":
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    if b == "rope_negated_angle":
        c, s = cos, -sin  # cos(-a), sin(-a)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1)


class CausalSelfAttention(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        H = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.eps = cfg.rms_norm_eps
        self.pre = p

        def lin(name, n_out):
            w = sd[p + name + ".weight"].float().t()
            bias = sd.get(p + name + ".bias")
            if bias is None or b == "nc_attn_bias_dropped":
                bias = torch.zeros(n_out)
            return w, bias.float()

        q, qb = lin("q_proj", self.nh * self.hd)
        k, kb = lin("k_proj", self.nkv * self.hd)
        v, vb = lin("v_proj", self.nkv * self.hd)
        self.fused = b == "fused_qkv"
        if self.fused:
            self.c_qkv = _P(torch.cat((q, k, v), 1))
            self.c_qkv_b = _P(torch.cat((qb, kb, vb)))
        else:
            self.c_q, self.c_q_b = _P(q), _P(qb)
            self.c_k, self.c_k_b = _P(k), _P(kb)
            self.c_v, self.c_v_b = _P(v), _P(vb)
        o, ob = lin("o_proj", H)
        self.c_proj, self.c_proj_b = _P(o), _P(ob)

    def _qk_norm(self, t):
        b = _bug()
        if b == "nc_qk_norm_missing":
            return t
        if b == "nc_qk_norm_across_heads":
            B, n, S, d = t.shape
            flat = t.transpose(1, 2).reshape(B, S, n * d)
            return _norm(flat, self.eps).view(B, S, n, d).transpose(1, 2)
        return _norm(t, self.eps)

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        if self.fused:
            qkv = x @ self.c_qkv + self.c_qkv_b
            q, k, v = qkv.split((self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd), -1)
        else:
            q = x @ self.c_q + self.c_q_b
            k = x @ self.c_k + self.c_k_b
            v = x @ self.c_v + self.c_v_b
        _rec(self.pre + "q_proj", q)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        if b == "qk_norm_before_rope":
            q, k = self._qk_norm(q), self._qk_norm(k)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        else:
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            q, k = self._qk_norm(q), self._qk_norm(k)
        g = self.nh // self.nkv
        if b == "nc_gqa_tiled":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        att = (q @ k.transpose(-1, -2)) * self.hd**-0.5
        att = att.masked_fill(~allowed, torch.finfo(att.dtype).min)
        y = (torch.softmax(att, -1) @ v).transpose(1, 2).reshape(B, S, -1)
        out = y @ self.c_proj + self.c_proj_b
        _rec(self.pre.rstrip("."), out)
        return out


class MLP(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        if cfg.hidden_act != "relu2":
            raise NotImplementedError(cfg.hidden_act)
        self.c_fc = _P(sd[p + "fc1.weight"].float().t())
        self.c_proj = _P(sd[p + "fc2.weight"].float().t())

    def forward(self, x):
        h = F.relu(x @ self.c_fc)
        if _bug() != "nc_relu_not_squared":
            h = h.square()
        return h @ self.c_proj


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.attn = CausalSelfAttention(sd, p + "self_attn.", cfg)
        self.mlp = MLP(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, cos, sin):
        h = h + self.attn(_norm(h, self.eps), allowed, cos, sin)
        h = h + self.mlp(_norm(h, self.eps))
        _rec(self.pre.rstrip("."), h)
        return h


class NanoChatPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.wte = _P(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        if b == "nc_tied_head" or "lm_head.weight" not in sd:
            self.lm_head = _P(sd["model.embed_tokens.weight"].float().t())
        else:
            self.lm_head = _P(sd["lm_head.weight"].float().t())
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self.softcap = cfg.final_logit_softcapping
        if b == "nc_softcap_hardcoded_15":
            self.softcap = 15.0

    def _core(self, idx, keep, pos):
        b = _bug()
        S = idx.shape[1]
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if b != "nc_pad_mask_dropped":
            allowed = allowed & keep[:, None, None, :]
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        h = self.wte[idx]
        if b != "nc_embed_norm_missing":
            h = _norm(h, self.eps)
        _rec("model.embed_tokens", h)
        for blk in self.blocks:
            h = blk(h, allowed, cos, sin)
        h = _norm(h, self.eps)
        _rec("model.norm", h)
        logits = h @ self.lm_head
        cap = self.softcap
        if cap is not None:
            if b == "nc_softcap_no_rescale":
                logits = torch.tanh(logits / cap)
            elif b == "softcap_sigmoid":
                logits = cap * (2.0 * torch.sigmoid(2.0 * logits / cap) - 1.0)
            else:
                logits = cap * torch.tanh(logits / cap)
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
    return NanoChatPort(state_dict, config).eval()
