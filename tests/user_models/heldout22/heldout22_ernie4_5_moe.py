"""Hand-written plain-PyTorch port of ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; * output head tied to the embedding table AND carrying a bias (use_bias);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block:
        h = h + Attn(RMS_in(h));  h = h + FFN(RMS_post(h))
  - attention: GQA, head_dim = hidden / heads, scores scaled by head_dim**-0.5;
    * q/k/v/o projections all carry biases (config.use_bias);
  * RoPE on INTERLEAVED pairs (x0, x1), (x2, x3), ... over the full head_dim (GLM style, not rotate_half),
    theta = rope_parameters["rope_theta"]; computed in float32;
  * FFN kind per layer: MoE iff (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index,
    otherwise a dense SwiGLU MLP (with biases);
  * MoE block: router logits = x @ Wr (float32, no bias); p = softmax(logits);
    top-k experts chosen on p + e_score_correction_bias, but mixing weights are the UNBIASED p of the chosen experts,
    renormalised by max(sum, moe_norm_min); routed experts are bias-free SwiGLU of width moe_intermediate_size;
    * shared experts: one SwiGLU (with biases) of width moe_intermediate_size * moe_num_shared_experts, always added;
  - final RMSNorm, then head (+ head bias);
  - padding: HF-style 0/1 attention_mask masks keys (float32-min fill); positions 0..S-1 when absent.

Weight layout of this port (own names):
  wte (V, H) (also the head), head_bias (V,); ln_f (H,);
  layers[i].ln1 / ln2 (H,);
  layers[i].attn.qkv_w (nkv * (g + 2) * hd, H) and qkv_b: a grouped fused projection applied with F.linear, rows
      ordered per kv group j: [the g query heads of group j | key head j | value head j] (g = heads / kv heads);
  layers[i].attn.o_w (H, nh * hd), o_b (H,);
  dense / shared SwiGLU: gu_w (2 I, H) rows [gate | up], gu_b (2 I,), dn_w (H, I), dn_b (H,)  (F.linear layout);
  MoE: router_w (H, E) applied as x @ w; score_bias (E,);
      expert_w_in (E, H, 2 I') with gate/up INTERLEAVED along the last axis (column 2j = gate j, 2j+1 = up j),
      expert_w_out (E, I', H), both applied as x @ w.
  RoPE is applied as a complex multiply on adjacent channel pairs.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "er_rope_half_split",  # Llama template: rotate_half RoPE on (i, i + hd/2) pairs instead of interleaved pairs
    "er_rope_theta_hardcoded",  # theta hard-coded to the released checkpoints' 500000 instead of rope_parameters
    "er_score_bias_ignored",  # top-k chosen on the raw softmax probabilities: e_score_correction_bias never used
    "er_score_bias_in_weights",  # mixing weights gathered from the bias-corrected scores instead of the raw probs
    "er_bias_on_logits",  # correction bias added to the router logits before the softmax (changes choice and weights)
    "er_topk_not_renormalised",  # chosen probabilities used as-is, never divided by their sum
    "er_shared_experts_dropped",  # shared-expert SwiGLU never added to the MoE output
    "er_shared_width_one_expert",  # moe_num_shared_experts ignored: shared MLP truncated to moe_intermediate_size
    "er_expert_gate_up_interleaved",  # HF gate_up_proj (2I, H) read as interleaved rows instead of [gate | up] halves
    "er_qkv_llama_split",  # grouped fused qkv output split as [all Q | all K | all V] blocks
    "er_attn_bias_dropped",  # use_bias ignored in attention: q/k/v/o biases dropped
    "er_head_bias_dropped",  # lm_head bias dropped (tied weight reused, bias forgotten)
    "er_pad_mask_ignored",  # attention_mask not applied: causal mask only, pad keys visible
]
PADDING_ONLY = {"er_pad_mask_ignored"}
CLEAN = [
    "rope_rotate_half",  # Q/K channels (and biases) permuted at load to half-split order; RoPE via rotate_half
    "experts_dense",  # every expert computed for every token, combined with a dense (T, E) weight matrix
    "v_bias_folded_into_o",  # v bias dropped and o_b += Wo @ repeat(b_v) (softmax rows sum to 1)
    "renorm_as_topk_softmax",  # renormalised weights computed as softmax over the chosen experts' logits
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


def _half_perm(hd):
    """new channel i <- old 2i, new i + hd/2 <- old 2i+1 (interleaved pairs -> half split)"""
    return torch.cat((torch.arange(0, hd, 2), torch.arange(1, hd, 2)))


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, hd/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b in ("rope_rotate_half", "er_rope_half_split"):
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)


class SwiGLU(nn.Module):
    def __init__(self, sd, p, width=None):
        super().__init__()
        g, u = sd[p + "gate_proj.weight"].float(), sd[p + "up_proj.weight"].float()
        gb, ub = sd[p + "gate_proj.bias"].float(), sd[p + "up_proj.bias"].float()
        d, db = sd[p + "down_proj.weight"].float(), sd[p + "down_proj.bias"].float()
        if width is not None:
            g, u, gb, ub, d = g[:width], u[:width], gb[:width], ub[:width], d[:, :width]
        self.gu_w, self.gu_b = _P(torch.cat((g, u))), _P(torch.cat((gb, ub)))
        self.dn_w, self.dn_b = _P(d), _P(db)

    def forward(self, x):
        gate, up = F.linear(x, self.gu_w, self.gu_b).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.dn_w, self.dn_b)


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.k = cfg.moe_k
        self.norm_min = cfg.moe_norm_min
        self.router_w = _P(sd[p + "gate.weight"].float().t())
        self.score_bias = _P(sd[p + "gate.moe_statics.e_score_correction_bias"].float().reshape(-1))
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        E, I2, H = gu.shape
        I = I2 // 2  # noqa: E741
        if b == "er_expert_gate_up_interleaved":
            gate, up = gu[:, 0::2], gu[:, 1::2]
        else:
            gate, up = gu[:, :I], gu[:, I:]
        w_in = torch.stack((gate.transpose(1, 2), up.transpose(1, 2)), -1).reshape(E, H, 2 * I)
        self.expert_w_in = _P(w_in)
        self.expert_w_out = _P(sd[p + "experts.down_proj"].float().transpose(1, 2))  # (E, I, H)
        self.E = E
        self.shared = None
        if cfg.moe_num_shared_experts:
            width = cfg.moe_intermediate_size if b == "er_shared_width_one_expert" else None
            self.shared = SwiGLU(sd, p + "shared_experts.", width)

    def _expert(self, x, e):
        gu = x @ self.expert_w_in[e]
        return (F.silu(gu[..., 0::2]) * gu[..., 1::2]) @ self.expert_w_out[e]

    def forward(self, x):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t @ self.router_w
        if b == "er_bias_on_logits":
            logits = logits + self.score_bias
        probs = torch.softmax(logits, -1)
        choice = probs if b in ("er_score_bias_ignored", "er_bias_on_logits") else probs + self.score_bias
        idx = torch.topk(choice, self.k, -1).indices
        src = choice if b == "er_score_bias_in_weights" else probs
        w = src.gather(1, idx)
        if b == "renorm_as_topk_softmax":
            w = torch.softmax(logits.gather(1, idx), -1)
        elif b != "er_topk_not_renormalised":
            w = w / w.sum(-1, keepdim=True).clamp(min=self.norm_min)
        out = torch.zeros_like(t)
        if b == "experts_dense":
            dense = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)
            for e in range(self.E):
                out = out + dense[:, e : e + 1] * self._expert(t, e)
        else:
            for e in range(self.E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel():
                    out.index_add_(0, tok, self._expert(t[tok], e) * w[tok, slot, None])
        if self.shared is not None and b != "er_shared_experts_dropped":
            out = out + self.shared(t)
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Attn(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.g = self.nh // self.nkv
        H = cfg.hidden_size
        hd, g = self.hd, self.g
        nobias = b == "er_attn_bias_dropped"

        def wb(n):
            w = sd[p + n + ".weight"].float()
            bb = sd[p + n + ".bias"].float()
            return w, (torch.zeros_like(bb) if nobias else bb)

        (qw, qb), (kw, kb), (vw, vb), (ow, ob) = wb("q_proj"), wb("k_proj"), wb("v_proj"), wb("o_proj")
        if b == "rope_rotate_half":
            perm = _half_perm(hd)
            qw, qb = qw.view(self.nh, hd, H)[:, perm].reshape(-1, H), qb.view(self.nh, hd)[:, perm].reshape(-1)
            kw, kb = kw.view(self.nkv, hd, H)[:, perm].reshape(-1, H), kb.view(self.nkv, hd)[:, perm].reshape(-1)
        if b == "v_bias_folded_into_o":
            ob = ob + ow @ vb.view(self.nkv, 1, hd).expand(self.nkv, g, hd).reshape(-1)
            vb = torch.zeros_like(vb)
        w = torch.cat((qw.view(self.nkv, g * hd, H), kw.view(self.nkv, hd, H), vw.view(self.nkv, hd, H)), 1)
        bias = torch.cat((qb.view(self.nkv, g * hd), kb.view(self.nkv, hd), vb.view(self.nkv, hd)), 1)
        self.qkv_w, self.qkv_b = _P(w.reshape(-1, H)), _P(bias.reshape(-1))
        self.o_w, self.o_b = _P(ow), _P(ob)
        self.scale = hd**-0.5

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        hd, g = self.hd, self.g
        y = F.linear(x, self.qkv_w, self.qkv_b)
        if b == "er_qkv_llama_split":
            q, k, v = y.split((self.nh * hd, self.nkv * hd, self.nkv * hd), -1)
            q = q.view(B, S, self.nh, hd)
            k, v = k.view(B, S, self.nkv, hd), v.view(B, S, self.nkv, hd)
        else:
            y = y.view(B, S, self.nkv, g + 2, hd)
            q = y[:, :, :, :g].reshape(B, S, self.nh, hd)
            k, v = y[:, :, :, g], y[:, :, :, g + 1]
        if b not in ("rope_rotate_half", "er_attn_bias_dropped"):
            _rec(self.pre + "q_proj", q.reshape(B, S, -1))
            _rec(self.pre + "k_proj", k.reshape(B, S, -1))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, S, -1)
        out = F.linear(ctx, self.o_w, self.o_b)
        _rec(self.pre.rstrip("."), out)
        return out


class Layer(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.eps = cfg.rms_norm_eps
        self.ln1 = _P(sd[p + "input_layernorm.weight"])
        self.ln2 = _P(sd[p + "post_attention_layernorm.weight"])
        self.attn = Attn(sd, p + "self_attn.", cfg)
        is_moe = (i + 1) % cfg.moe_layer_interval == 0 and cfg.moe_layer_start_index <= i <= cfg.moe_layer_end_index
        self.ffn = MoE(sd, p + "mlp.", cfg) if is_moe else SwiGLU(sd, p + "mlp.")

    def forward(self, h, allowed, cos, sin):
        n = _rms(h, self.ln1, self.eps)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attn(n, allowed, cos, sin)
        n = _rms(h, self.ln2, self.eps)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.ffn(n)
        _rec(self.pre.rstrip("."), h)
        return h


class ErnieMoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.wte = _P(sd["model.embed_tokens.weight"])
        if not cfg.tie_word_embeddings and "lm_head.weight" in sd:
            self.head_w = _P(sd["lm_head.weight"])
        hb = sd.get("lm_head.bias")
        if hb is not None and b != "er_head_bias_dropped":
            self.head_bias = _P(hb)
        self.ln_f = _P(sd["model.norm.weight"])
        self.layers = nn.ModuleList(Layer(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        theta = 500000.0 if b == "er_rope_theta_hardcoded" else float(rp["rope_theta"])
        hd = self.layers[0].attn.hd
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        allowed = causal if _bug() == "er_pad_mask_ignored" else causal & keep[:, None, None, :]
        h = self.wte[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for layer in self.layers:
            h = layer(h, allowed, cos, sin)
        h = _rms(h, self.ln_f, self.cfg.rms_norm_eps)
        _rec("model.norm", h)
        head = getattr(self, "head_w", None)
        logits = h @ (self.wte if head is None else head).t()
        if hasattr(self, "head_bias"):
            logits = logits + self.head_bias
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
    return ErnieMoePort(state_dict, config).eval()
