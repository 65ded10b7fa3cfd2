"""Hand-written plain-PyTorch port of Helium (HeliumForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  token embedding (no scaling); untied output head (tie_word_embeddings False);
  RMSNorm y = x / sqrt(mean(x^2) + eps) * w with eps = rms_norm_eps (1e-8 by default), two pre-norms per block:
      h = h + Attn(RMS_in(h));  h = h + MLP(RMS_post(h));  final RMSNorm, then the head;
  attention: GQA (nh = 4, nkv = 2), explicit head_dim (nh * head_dim == hidden_size), scores scaled by head_dim**-0.5;
  * q/k/v projections carry biases when attention_bias is True (o_proj never has a bias);
  * RoPE in the INTERLEAVED (GPT-J) form: channel pairs (2i, 2i+1) are rotated by angle pos * inv_freq[i]
    (not Llama's half-split rotate_half); theta = rope_parameters["rope_theta"];
  MLP: silu(gate(x)) * up(x) -> down; * gate/up/down carry biases when mlp_bias is True;
  padding: HF-style attention_mask masks padded keys; positions from position_ids (0..S-1 when absent,
  also for left-padded rows).

Weight layout of this port (Meta / llama-reference style, own names, not the HF state-dict names):
  tok_embeddings (V, H); norm.weight (H,); output (V, H);
  layers[i].attention_norm.weight / ffn_norm.weight (H,);
  layers[i].attention.wqkv (H, (nh + 2 nkv) * hd) applied as x @ wqkv, rows of the output = [q | k | v];
  layers[i].attention.bqkv ((nh + 2 nkv) * hd,); layers[i].attention.wo (nh * hd, H) applied as x @ wo;
  layers[i].feed_forward.w13 (H, 2 I) with [:, :I] = gate (w1), [:, I:] = up (w3); b13 (2 I,);
  layers[i].feed_forward.w2 (I, H); b2 (H,).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "he_rope_half_split",  # Llama template kept: rotate_half (NeoX half-split) RoPE on an interleaved-pair checkpoint
    "he_inv_freq_no_step",  # inv_freq exponent built from arange(hd/2)/hd instead of arange(0, hd, 2)/hd
    "he_qkv_bias_dropped",  # attention_bias ignored: q/k/v biases not loaded into the fused projection
    "he_down_bias_dropped",  # mlp_bias honoured for gate/up only; down_proj bias forgotten
    "he_kv_split_swapped",  # fused wqkv sliced as [q | v | k]: keys and values exchanged
    "he_gqa_tiled",  # kv heads expanded with .repeat (tiled) instead of repeat_interleave
    "he_scale_hidden",  # scores scaled by hidden_size**-0.5 instead of head_dim**-0.5
    "he_gelu_act",  # hidden_act silu taken as GELU
    "he_gate_up_swapped",  # w13 packed as [up | gate]: SiLU applied to the up branch
    "he_norm_gain_offset",  # Gemma-style (1 + w) norm gain on a checkpoint that stores w directly
    "he_tied_head",  # head assumed tied to the embedding table (Helium checkpoints keep a separate lm_head)
    "he_final_norm_dropped",  # final RMSNorm skipped before the head
    "he_pad_mask_ignored",  # attention_mask never merged into the causal mask
]
PADDING_ONLY = {"he_pad_mask_ignored"}
CLEAN = [
    "rope_complex",  # interleaved pairs rotated as a complex multiply (view_as_complex, no channel permutation)
    "query_scale_folded",  # head_dim**-0.5 folded into the q rows (weight and bias) of wqkv at load
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask (pad queries see themselves)
    "gqa_grouped_einsum",  # queries reshaped to (nkv, group) and contracted against un-repeated k/v
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


def _get(sd, k, shape):
    t = sd.get(k)
    return torch.zeros(shape) if t is None else t.float()


class RMSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.weight = _P(w)
        self.eps = eps

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if _bug() == "he_norm_gain_offset":
            return y * (1.0 + self.weight)
        return y * self.weight


def _rope(x, cos, sin):
    """x (B, heads, S, hd); cos/sin (B, S, hd/2)"""
    b = _bug()
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        rot = torch.complex(cos, sin)[:, None]
        return torch.view_as_real(z * rot).flatten(-2)
    if b == "he_rope_half_split":
        c = torch.cat((cos, cos), -1)[:, None]
        s = torch.cat((sin, sin), -1)[:, None]
        h = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * s
    c, s = cos[:, None], sin[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        H = cfg.hidden_size
        q = sd[p + "q_proj.weight"].float()
        k = sd[p + "k_proj.weight"].float()
        v = sd[p + "v_proj.weight"].float()
        bq = _get(sd, p + "q_proj.bias", q.shape[0])
        bk = _get(sd, p + "k_proj.bias", k.shape[0])
        bv = _get(sd, p + "v_proj.bias", v.shape[0])
        if b == "he_qkv_bias_dropped":
            bq, bk, bv = torch.zeros_like(bq), torch.zeros_like(bk), torch.zeros_like(bv)
        self.scale = self.hd**-0.5
        if b == "he_scale_hidden":
            self.scale = H**-0.5
        if b == "query_scale_folded":
            q, bq = q * self.scale, bq * self.scale
            self.scale = 1.0
        self.wqkv = _P(torch.cat((q, k, v), 0).t())
        self.bqkv = _P(torch.cat((bq, bk, bv)))
        self.wo = _P(sd[p + "o_proj.weight"].float().t())

    def forward(self, x, allowed, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        qkv = x @ self.wqkv + self.bqkv
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q = qkv[..., :nq]
        if b == "he_kv_split_swapped":
            v, k = qkv[..., nq : nq + nk], qkv[..., nq + nk :]
        else:
            k, v = qkv[..., nq : nq + nk], qkv[..., nq + nk :]
        if b != "query_scale_folded":
            _rec(self.pre + "q_proj", q)
        _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.reshape(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.reshape(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        g = self.nh // self.nkv
        if b == "gqa_grouped_einsum":
            qg = q.view(B, self.nkv, g, S, self.hd)
            s = torch.einsum("bngqd,bnkd->bngqk", qg, k) * self.scale
            s = s.masked_fill(~allowed[:, :, None], torch.finfo(s.dtype).min)
            ctx = torch.einsum("bngqk,bnkd->bngqd", torch.softmax(s, -1), v).reshape(B, self.nh, S, self.hd)
        else:
            if b == "he_gqa_tiled":
                k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            else:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            if b == "sdpa_attention":
                eye = torch.eye(S, dtype=torch.bool)[None, None]
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | eye, scale=self.scale)
            else:
                s = (q @ k.transpose(-1, -2)) * self.scale
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
                ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.wo
        _rec(self.pre.rstrip("."), out)
        return out


class FeedForward(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        gate = sd[p + "gate_proj.weight"].float().t()
        up = sd[p + "up_proj.weight"].float().t()
        I = gate.shape[1]  # noqa: E741
        bg = _get(sd, p + "gate_proj.bias", I)
        bu = _get(sd, p + "up_proj.bias", I)
        if b == "he_gate_up_swapped":
            gate, up, bg, bu = up, gate, bu, bg
        self.w13 = _P(torch.cat((gate, up), 1))
        self.b13 = _P(torch.cat((bg, bu)))
        self.w2 = _P(sd[p + "down_proj.weight"].float().t())
        b2 = _get(sd, p + "down_proj.bias", cfg.hidden_size)
        if b == "he_down_bias_dropped":
            b2 = torch.zeros_like(b2)
        self.b2 = _P(b2)
        self.I = I
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)
        self.pre = p

    def forward(self, x):
        h = x @ self.w13 + self.b13
        gate, up = h[..., : self.I], h[..., self.I :]
        act = F.gelu(gate) if _bug() == "he_gelu_act" else F.silu(gate)
        out = (act * up) @ self.w2 + self.b2
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.attention_norm = RMSNorm(sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attention = Attention(sd, p + "self_attn.", cfg)
        self.ffn_norm = RMSNorm(sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.feed_forward = FeedForward(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, cos, sin):
        n = self.attention_norm(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attention(n, allowed, cos, sin)
        n = self.ffn_norm(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.feed_forward(n)
        _rec(self.pre.rstrip("."), h)
        return h


class HeliumPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok_embeddings = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings or b == "he_tied_head":
            head = sd["model.embed_tokens.weight"]
        self.output = _P(head)
        self.layers = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(sd["model.norm.weight"], cfg.rms_norm_eps)
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if b == "he_inv_freq_no_step":
            expo = torch.arange(hd // 2, dtype=torch.float) / hd
        else:
            expo = torch.arange(0, hd, 2, dtype=torch.float) / hd
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** expo)

    def _core(self, input_ids, keep, pos):
        b = _bug()
        S = input_ids.shape[1]
        causal = torch.tril(torch.ones(S, S, dtype=torch.bool))[None, None]
        allowed = causal if b == "he_pad_mask_ignored" else causal & keep[:, None, None, :]
        allowed = allowed.expand(input_ids.shape[0], 1, S, S)
        h = self.tok_embeddings[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for layer in self.layers:
            h = layer(h, allowed, cos, sin)
        if b != "he_final_norm_dropped":
            h = self.norm(h)
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
    return HeliumPort(state_dict, config).eval()
