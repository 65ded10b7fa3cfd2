"""Hand-written plain-PyTorch port of BitNet b1.58 (BitNetForCausalLM), unquantised (bf16/fp32 master weights).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding (no scaling); separate untied output head (tie_word_embeddings False);
  * pre-norm blocks with plain RMSNorm y = x / sqrt(mean(x^2) + eps) * w, eps = rms_norm_eps (1e-5):
        h = h + Attn(RMS_attn(h));  h = h + FFN(RMS_ffn(h))
  * attention: GQA (4 query heads, 2 KV heads, head_dim = hidden / heads = 16), no biases,
    scores = q.k / sqrt(head_dim), additive causal + key-padding mask, softmax, weighted sum of V;
  * * attention sub-norm: the concatenated head outputs (width hidden_size) go through an extra RMSNorm
    (attn_sub_norm) BEFORE the output projection: out = Wo(RMS_sub(concat_heads));
  * RoPE in the half-split (rotate_half / NeoX) form over the full head_dim, theta = rope_parameters["rope_theta"]
    (500000 for BitNet, not Llama's 10000);
  * * FFN: squared-ReLU gated unit relu(gate(x))^2 * up(x) (hidden_act "relu2", not SiLU), then
    an extra RMSNorm over the intermediate width (ffn_sub_norm) BEFORE the down projection:
        out = W2(RMS_ffn_sub(relu(x W1)^2 * (x W3)));
  * the weights are used as given (no ternary / absmean weight quantisation, no int8 activation quantisation:
    the HF model without a quantization_config runs plain linear layers);
  * padding: HF-style attention_mask masks keys (float32 min fill); positions from position_ids
    (0..S-1 when absent, also for left-padded rows, as HF does).

Weight layout of this port (bitnet.cpp / Meta-style names, "x @ W" orientation, not the HF state-dict names):
  tok_embeddings (V, H); output (V, H); norm.weight (H,);
  layers[i].attention_norm.weight (H,); layers[i].ffn_norm.weight (H,);
  layers[i].attention.wqkv (H, (nh + 2*nkv) * hd): columns [Q heads | K heads | V heads], each head hd
      contiguous channels in the HF half-split order;
  layers[i].attention.attn_sub_norm.weight (H,); layers[i].attention.wo (nh*hd, H);
  layers[i].feed_forward.w13 (H, 2*I): columns [gate | up];
  layers[i].feed_forward.ffn_sub_norm.weight (I,); layers[i].feed_forward.w2 (I, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "bn_relu2_as_silu",  # Llama template kept: SiLU gate instead of hidden_act "relu2"
    "bn_relu_not_squared",  # relu2 read as plain ReLU (square forgotten)
    "bn_attn_subnorm_dropped",  # attn_sub_norm weight loaded but never applied (Llama attention forward)
    "bn_attn_subnorm_after_o",  # attn_sub_norm applied to the o_proj output instead of before o_proj
    "bn_ffn_subnorm_on_gate",  # ffn_sub_norm applied to relu(gate)^2 only, before the multiply by up
    "bn_rope_theta_default",  # rope theta hard-coded to Llama's 10000 instead of rope_parameters["rope_theta"]
    "bn_rope_interleaved",  # GPT-J style rotation of adjacent pairs on weights that use the half-split layout
    "bn_gqa_tiled",  # KV heads expanded with repeat (tile) instead of repeat_interleave: query head h uses kv h % nkv
    "bn_qkv_split_order",  # fused wqkv split as [Q | V | K]: K and V swapped
    "bn_lm_head_tied",  # output head tied to the embedding table (tie_word_embeddings is False for BitNet)
    "bn_weight_ternary",  # absmean ternary weight quantisation applied at load to an unquantised HF checkpoint
    "bn_act_quant_int8",  # per-token absmax int8 activation quantisation before every projection (BitLinear)
    "bn_pad_mask_dropped",  # attention mask built from causality only; left-pad keys stay visible
]
PADDING_ONLY = {"bn_pad_mask_dropped"}
CLEAN = [
    "sdpa_gqa",  # F.scaled_dot_product_attention with a boolean mask and enable_gqa=True
    "subnorm_gain_folded",  # attn/ffn sub-norm gains folded into the rows of wo / w2 at load, norms run gain-free
    "final_norm_folded_head",  # final norm gain folded into the output head columns at load
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


def _ternary(w):
    s = 1.0 / w.abs().mean().clamp(min=1e-5)
    return (w * s).round().clamp(-1, 1) / s


def _aq(x):
    """per-token absmax int8 fake quantisation (only for the bn_act_quant_int8 bug)"""
    if _bug() != "bn_act_quant_int8":
        return x
    s = 127.0 / x.abs().amax(-1, keepdim=True).clamp(min=1e-5)
    return (x * s).round().clamp(-128, 127) / s


class RMSNorm(nn.Module):
    def __init__(self, w, eps, gain=True):
        super().__init__()
        self.weight = _P(w if gain else torch.ones_like(w))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x, cos, sin, ang):
    """x (B, heads, S, hd); cos/sin (B, S, hd) half-split; ang (B, S, hd/2)"""
    b = _bug()
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    if b == "bn_rope_interleaved":
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), -1) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        q = sd[p + "q_proj.weight"].float()
        k = sd[p + "k_proj.weight"].float()
        v = sd[p + "v_proj.weight"].float()
        if b == "rope_complex":
            order = _pairs_order(self.hd)
            q = q.view(self.nh, self.hd, -1)[:, order].reshape(q.shape)
            k = k.view(self.nkv, self.hd, -1)[:, order].reshape(k.shape)
        wqkv = torch.cat((q, k, v), 0).t()
        wo = sd[p + "o_proj.weight"].float().t()  # (nh*hd, H)
        g = sd[p + "attn_sub_norm.weight"].float()
        folded = b == "subnorm_gain_folded"
        if folded:
            wo = g[:, None] * wo
        if b == "bn_weight_ternary":
            wqkv, wo = _ternary(wqkv), _ternary(wo)
        self.wqkv = _P(wqkv)
        self.wo = _P(wo)
        self.attn_sub_norm = RMSNorm(g, cfg.rms_norm_eps, gain=not folded)
        self.scale = self.hd**-0.5

    def forward(self, x, allowed, rope):
        b = _bug()
        B, S, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        qkv = _aq(x) @ self.wqkv
        if b == "bn_qkv_split_order":
            q, v, k = qkv.split((nq, nk, nk), -1)
        else:
            q, k, v = qkv.split((nq, nk, nk), -1)
        if b != "rope_complex":
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, *rope), _rope(k, *rope)
        g = self.nh // self.nkv
        if b == "sdpa_gqa":
            eye = torch.eye(S, dtype=torch.bool)[None, None]
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | eye, scale=self.scale, enable_gqa=True)
        else:
            if b == "bn_gqa_tiled":
                k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            else:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nq)
        if b == "bn_attn_subnorm_after_o":
            out = self.attn_sub_norm(_aq(ctx) @ self.wo)
        else:
            if b != "bn_attn_subnorm_dropped":
                ctx = self.attn_sub_norm(ctx)
                if b != "subnorm_gain_folded":
                    _rec(self.pre + "attn_sub_norm", ctx)
            out = _aq(ctx) @ self.wo
        _rec(self.pre.rstrip("."), out)
        return out


class FeedForward(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        if cfg.hidden_act != "relu2":
            raise NotImplementedError(cfg.hidden_act)
        gate = sd[p + "gate_proj.weight"].float().t()
        up = sd[p + "up_proj.weight"].float().t()
        w2 = sd[p + "down_proj.weight"].float().t()  # (I, H)
        g = sd[p + "ffn_sub_norm.weight"].float()
        folded = b == "subnorm_gain_folded"
        if folded:
            w2 = g[:, None] * w2
        w13 = torch.cat((gate, up), 1)
        if b == "bn_weight_ternary":
            w13, w2 = _ternary(w13), _ternary(w2)
        self.w13 = _P(w13)
        self.w2 = _P(w2)
        self.ffn_sub_norm = RMSNorm(g, cfg.rms_norm_eps, gain=not folded)
        self.inter = gate.shape[1]

    def forward(self, x):
        b = _bug()
        gate, up = (_aq(x) @ self.w13).split(self.inter, -1)
        if b == "bn_relu2_as_silu":
            a = F.silu(gate)
        elif b == "bn_relu_not_squared":
            a = F.relu(gate)
        else:
            a = F.relu(gate).square()
        if b == "bn_ffn_subnorm_on_gate":
            y = self.ffn_sub_norm(a) * up
        else:
            y = self.ffn_sub_norm(a * up)
            if b != "subnorm_gain_folded":
                _rec(self.pre + "ffn_sub_norm", y)
        out = _aq(y) @ self.w2
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.attention_norm = RMSNorm(sd[p + "input_layernorm.weight"].float(), cfg.rms_norm_eps)
        self.attention = Attention(sd, p + "self_attn.", cfg)
        self.ffn_norm = RMSNorm(sd[p + "post_attention_layernorm.weight"].float(), cfg.rms_norm_eps)
        self.feed_forward = FeedForward(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, rope):
        n = self.attention_norm(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attention(n, allowed, rope)
        n = self.ffn_norm(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.feed_forward(n)
        _rec(self.pre.rstrip("."), h)
        return h


class BitNetPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok_embeddings = _P(sd["model.embed_tokens.weight"])
        tied = cfg.tie_word_embeddings or b == "bn_lm_head_tied" or "lm_head.weight" not in sd
        head = sd["model.embed_tokens.weight" if tied else "lm_head.weight"].float()
        nw = sd["model.norm.weight"].float()
        folded = b == "final_norm_folded_head"
        if folded:
            head = head * nw[None, :]
        self.output = _P(head)
        self.layers = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(nw, cfg.rms_norm_eps, gain=not folded)
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        theta = 10000.0 if b == "bn_rope_theta_default" else float(rp["rope_theta"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        allowed = (ki <= qi)[None, None]
        if b != "bn_pad_mask_dropped":
            allowed = allowed & keep[:, None, None, :]
        allowed = allowed.expand(input_ids.shape[0], 1, S, S)
        ang = pos[..., None].float() * self.inv_freq
        emb = torch.cat((ang, ang), -1)
        rope = (emb.cos(), emb.sin(), ang)
        h = self.tok_embeddings[input_ids]
        _rec("model.embed_tokens", h)
        for layer in self.layers:
            h = layer(h, allowed, rope)
        h = self.norm(h)
        if b != "final_norm_folded_head":
            _rec("model.norm", h)
        logits = h @ self.output.t()
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
    return BitNetPort(state_dict, config).eval()
