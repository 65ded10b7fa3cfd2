"""Hand-written plain-PyTorch port of Seed-OSS (SeedOssForCausalLM, ByteDance Seed-OSS-36B).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding (no scaling), untied output head;
  * pre-norm blocks with plain RMSNorm  y = w * x / sqrt(mean(x^2) + eps):
        h = h + Attn(RMS_in(h));  h = h + MLP(RMS_post(h))    (post_attention_layernorm is the pre-MLP norm)
  * attention: GQA with * an explicit head_dim (32 here, so nh * hd = 128 != hidden 64), scale head_dim**-0.5;
    * q, k, v projections WITH biases (attention_bias), the bias added before RoPE;
    * output projection with a bias too (attention_out_bias = True here), added once after the head sum;
    causal + key-padding mask, float32 softmax;
  * RoPE half-split (rotate_half / NeoX) over the full head_dim, * large theta from rope_parameters (1e7 here);
  * MLP: SwiGLU  down(silu(gate x) * up x), no biases; dropouts are inactive at inference.

Weight layout of this port (own names):
  tok_emb (V, H); head (V, H) applied with F.linear; final_gain (H,);
  layers[i].in_gain / post_gain (H,);
  layers[i].w_qkv ((nh + 2*nkv) * hd, H) fused in nn.Linear orientation, rows [q | k | v]; layers[i].b_qkv (same order);
  layers[i].wo (nh, hd, H) per-head einsum layout; layers[i].bo (H,);
  layers[i].w_gate_up (2*I, H) rows [gate | up]; layers[i].w_down (H, I).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "so_qkv_bias_dropped",  # Llama template reused: q/k/v biases never loaded (attention_bias ignored)
    "so_o_bias_per_head",  # o_proj bias added inside the per-head einsum, i.e. counted nh times
    "so_head_dim_from_hidden",  # head_dim derived as hidden / heads (16) instead of config.head_dim (32)
    "so_scale_hidden_over_heads",  # softmax scale (hidden / heads)**-0.5 instead of head_dim**-0.5
    "so_rope_theta_default",  # rope_theta read from a top-level attribute that is absent: falls back to 10000
    "so_qk_bias_after_rope",  # q/k biases added after the rotation (bias fused into the output of the RoPE kernel)
    "so_rope_interleaved",  # GPT-J interleaved-pair rotation applied to a half-split (NeoX) checkpoint
    "so_gate_up_swapped",  # gate_proj / up_proj packed in the wrong order: SiLU applied to the up branch
    "so_post_attn_norm_as_post_norm",  # post_attention_layernorm read as a sandwich norm on the attention output; MLP input unnormalised
    "so_kv_bias_swapped",  # fused bias concatenated [q | v | k] while the weight is [q | k | v]
    "so_gqa_kv_tiled",  # kv heads expanded with .repeat (tiling) instead of repeat_interleave
    "so_pad_mask_row0",  # written for batch 1: attention_mask[0] used as the key-padding mask of every row
]
PADDING_ONLY = {"so_pad_mask_row0"}
CLEAN = [
    "bias_as_ones_column",  # qkv bias stored as an extra weight column, inputs augmented with a constant 1
    "scale_folded_into_q",  # head_dim**-0.5 folded into the q rows and q bias at load, scores left unscaled
    "rope_complex",  # q/k rows and biases permuted at load to interleaved pairs; RoPE as a complex multiply
    "sdpa_gqa",  # F.scaled_dot_product_attention(enable_gqa=True) with a boolean mask (pad queries see themselves)
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
    b = _bug()
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    if b == "so_rope_interleaved":
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)
    emb = torch.cat((ang, ang), -1)[:, None]
    h = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * emb.sin()


class Layer(nn.Module):
    def __init__(self, sd, cfg, i, hd):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.hd = hd
        a = p + "self_attn."
        q, k, v = (sd[a + n + "_proj.weight"].float() for n in "qkv")
        zeros = lambda w: torch.zeros(w.shape[0])
        if b == "so_qkv_bias_dropped":
            bq, bk, bv = zeros(q), zeros(k), zeros(v)
        else:
            bq, bk, bv = (sd.get(a + n + "_proj.bias", None) for n in "qkv")
            bq, bk, bv = [zeros(w) if t is None else t.float() for t, w in ((bq, q), (bk, k), (bv, v))]
        self.nh, self.nkv = q.shape[0] // hd, k.shape[0] // hd
        if b == "rope_complex":
            oq = torch.cat([h * hd + _pairs_order(hd) for h in range(self.nh)])
            ok = torch.cat([h * hd + _pairs_order(hd) for h in range(self.nkv)])
            q, bq, k, bk = q[oq], bq[oq], k[ok], bk[ok]
        self.scale = hd**-0.5
        if b == "so_scale_hidden_over_heads":
            self.scale = (H // cfg.num_attention_heads) ** -0.5
        if b == "scale_folded_into_q":
            q, bq = q * self.scale, bq * self.scale
            self.scale = 1.0
        w = torch.cat((q, k, v), 0)
        bias = torch.cat((bq, bv, bk) if b == "so_kv_bias_swapped" else (bq, bk, bv), 0)
        self.augmented = b == "bias_as_ones_column"
        if self.augmented:
            self.w_qkv = _P(torch.cat((w, bias[:, None]), 1))
        else:
            self.w_qkv, self.b_qkv = _P(w), _P(bias)
        self.wo = _P(sd[a + "o_proj.weight"].float().t().reshape(self.nh, hd, H))
        ob = sd.get(a + "o_proj.bias")
        self.bo = _P(torch.zeros(H) if ob is None else ob)
        m = p + "mlp."
        gate, up = sd[m + "gate_proj.weight"].float(), sd[m + "up_proj.weight"].float()
        self.w_gate_up = _P(torch.cat((up, gate) if b == "so_gate_up_swapped" else (gate, up), 0))
        self.w_down = _P(sd[m + "down_proj.weight"])
        self.in_gain = _P(sd[p + "input_layernorm.weight"])
        self.post_gain = _P(sd[p + "post_attention_layernorm.weight"])
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)

    def attn(self, x, allowed, ang):
        b = _bug()
        B, S, _ = x.shape
        hd = self.hd
        nq, nk = self.nh * hd, self.nkv * hd
        if self.augmented:
            t = F.linear(torch.cat((x, torch.ones(B, S, 1)), -1), self.w_qkv)
        elif b == "so_qk_bias_after_rope":
            t = F.linear(x, self.w_qkv)
        else:
            t = F.linear(x, self.w_qkv, self.b_qkv)
        if b == "so_qk_bias_after_rope":
            t = t.clone()
            t[..., nq + nk :] += self.b_qkv[nq + nk :]
        q = t[..., :nq].view(B, S, self.nh, hd).transpose(1, 2)
        k = t[..., nq : nq + nk].view(B, S, self.nkv, hd).transpose(1, 2)
        v = t[..., nq + nk :].view(B, S, self.nkv, hd).transpose(1, 2)
        _rec(self.pre + "self_attn.v_proj", v.transpose(1, 2).reshape(B, S, -1))
        q, k = _rope(q, ang), _rope(k, ang)
        if b == "so_qk_bias_after_rope":
            q = q + self.b_qkv[:nq].view(self.nh, 1, hd)
            k = k + self.b_qkv[nq : nq + nk].view(self.nkv, 1, hd)
        g = self.nh // self.nkv
        if b == "sdpa_gqa":
            eye = torch.eye(S, dtype=torch.bool)[None, None]
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | eye, scale=self.scale, enable_gqa=True)
        else:
            if b == "so_gqa_kv_tiled":
                k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            else:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        if b == "so_o_bias_per_head":
            out = (torch.einsum("bnsd,ndh->bnsh", ctx, self.wo) + self.bo).sum(1)
        else:
            out = torch.einsum("bnsd,ndh->bsh", ctx, self.wo) + self.bo
        _rec(self.pre + "self_attn", out)
        return out

    def mlp(self, x):
        gate, up = F.linear(x, self.w_gate_up).chunk(2, -1)
        out = F.linear(F.silu(gate) * up, self.w_down)
        _rec(self.pre + "mlp", out)
        return out

    def forward(self, h, allowed, ang):
        if _bug() == "so_post_attn_norm_as_post_norm":
            h = h + _rms(self.attn(_rms(h, self.eps) * self.in_gain, allowed, ang), self.eps) * self.post_gain
            h = h + self.mlp(h)
        else:
            h = h + self.attn(_rms(h, self.eps) * self.in_gain, allowed, ang)
            h = h + self.mlp(_rms(h, self.eps) * self.post_gain)
        _rec(self.pre.rstrip("."), h)
        return h


class SeedOssPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if b == "so_head_dim_from_hidden":
            hd = cfg.hidden_size // cfg.num_attention_heads
        self.tok_emb = _P(sd["model.embed_tokens.weight"])
        if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
            self.head = _P(sd["model.embed_tokens.weight"])
        else:
            self.head = _P(sd["lm_head.weight"])
        self.final_gain = _P(sd["model.norm.weight"])
        self.layers = nn.ModuleList(Layer(sd, cfg, i, hd) for i in range(cfg.num_hidden_layers))
        rp = dict(cfg.rope_parameters or {})
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind != "default":
            raise NotImplementedError(kind)
        theta = float(rp.get("rope_theta", 10000.0))
        if b == "so_rope_theta_default":
            theta = float(getattr(cfg, "rope_theta", None) or 10000.0)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        if _bug() == "so_pad_mask_row0":
            keep = keep[:1].expand_as(keep)
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        h = self.tok_emb[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        for layer in self.layers:
            h = layer(h, allowed, ang)
        h = _rms(h, self.cfg.rms_norm_eps) * self.final_gain
        _rec("model.norm", h)
        logits = F.linear(h, self.head)
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
    return SeedOssPort(state_dict, config).eval()
