"""From-scratch Gemma 3 text (my conventions: fused qkv, sandwich norms named attn_pre/attn_post/mlp_pre/mlp_post,
'w' params, (1+w) norms in f32, embedder * sqrt(d) rounded to dtype, tied head, final soft-cap)."""

import heldout_common as C
import torch
import torch.nn as nn
import torch.nn.functional as F
from heldout_common import bug, rms

import parity


class GNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.w = nn.Parameter(w)
        self.eps = eps

    def forward(self, x):
        return rms(x, self.w, self.eps, one_plus=True)


class Attn(nn.Module):
    def __init__(self, cfg, sd, p, sliding):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv = C.Lin(torch.cat([sd.pop(p + n + "_proj.weight") for n in "qkv"]))
        self.out = C.Lin(sd.pop(p + "o_proj.weight"))
        self.qn, self.kn = (
            GNorm(sd.pop(p + "q_norm.weight"), cfg.rms_norm_eps),
            GNorm(sd.pop(p + "k_norm.weight"), cfg.rms_norm_eps),
        )
        self.scale = self.hd**-0.5 if bug("ignore_query_pre_attn_scalar") else cfg.query_pre_attn_scalar**-0.5
        self.window = cfg.sliding_window if (sliding or bug("window_on_full_layer")) else None

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q = q.view(b, t, self.nh, self.hd)
        k = k.view(b, t, self.nkv, self.hd)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        if not bug("qk_norm_missing"):
            q, k = self.qn(q), self.kn(k)
        q = C.apply_rope(q.transpose(1, 2), cos, sin)
        k = C.apply_rope(k.transpose(1, 2), cos, sin)
        q = parity.tap(q, "q_rot")
        k = parity.tap(k, "k_rot")
        return self.out(C.attention(q, k, v, self.scale, window=self.window))


class GeGLU(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.gate = C.Lin(sd.pop(p + "gate_proj.weight"))
        self.up = C.Lin(sd.pop(p + "up_proj.weight"))
        self.down = C.Lin(sd.pop(p + "down_proj.weight"))

    def forward(self, x):
        g = self.gate(x)
        a = F.gelu(g) if bug("gelu_exact_not_tanh") else F.gelu(g, approximate="tanh")
        return self.down(a * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg, sd, i):
        super().__init__()
        p = f"model.layers.{i}."
        e = cfg.rms_norm_eps
        self.sliding = cfg.layer_types[i] == "sliding_attention"
        self.attn_pre = GNorm(sd.pop(p + "input_layernorm.weight"), e)
        self.attn = Attn(cfg, sd, p + "self_attn.", self.sliding)
        self.attn_post = GNorm(sd.pop(p + "post_attention_layernorm.weight"), e)
        self.mlp_pre = GNorm(sd.pop(p + "pre_feedforward_layernorm.weight"), e)
        self.mlp = GeGLU(sd, p + "mlp.")
        self.mlp_post = GNorm(sd.pop(p + "post_feedforward_layernorm.weight"), e)

    def forward(self, x, rope):
        cos, sin = rope["local" if self.sliding else "global"]
        if bug("post_norm_after_residual"):
            x = self.attn_post(x + self.attn(self.attn_pre(x), cos, sin))
        else:
            x = x + self.attn_post(self.attn(self.attn_pre(x), cos, sin))
        return x + self.mlp_post(self.mlp(self.mlp_pre(x)))


class Gemma3Text(nn.Module):
    def __init__(self, cfg, sd):
        super().__init__()
        self.cfg = cfg
        self.embedder = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embedder.weight = nn.Parameter(sd.pop("model.embed_tokens.weight"))
        self.head_w = None
        if bug("head_read_through_root_attribute"):  # clean: the tied head read through a second attribute
            self.head_w = self.embedder.weight
        # clean convention: table pre-multiplied by sqrt(d) (a copy), head keeps the original
        if bug("clean_embed_prescaled"):
            self.head_w = self.embedder.weight
            self.embedder = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embedder.weight = nn.Parameter(
                self.head_w.detach() * torch.tensor(cfg.hidden_size**0.5, dtype=self.head_w.dtype)
            )
        self.blocks = nn.ModuleList(Block(cfg, sd, i) for i in range(cfg.num_hidden_layers))
        self.final = GNorm(sd.pop("model.norm.weight"), cfg.rms_norm_eps)
        sd.pop("lm_head.weight", None)
        rp = cfg.rope_parameters
        self.theta_local = rp["sliding_attention"]["rope_theta"]
        self.theta_global = (
            self.theta_local if bug("global_rope_uses_local_theta") else rp["full_attention"]["rope_theta"]
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t)[None].expand(b, t)
        x = self.embedder(input_ids)
        if not bug("embed_scale_missing") and not bug("clean_embed_prescaled"):
            x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)
        hd = self.cfg.head_dim
        rope = {
            "local": C.rope_tables(position_ids, hd, self.theta_local, x.dtype),
            "global": C.rope_tables(position_ids, hd, self.theta_global, x.dtype),
        }
        for blk in self.blocks:
            x = blk(x, rope)
        x = self.final(x)
        logits = x @ (self.embedder.weight if self.head_w is None else self.head_w).T
        cap = self.cfg.final_logit_softcapping
        if cap is not None and not bug("softcap_missing"):
            logits = torch.tanh(logits) * cap if bug("softcap_formula") else torch.tanh(logits / cap) * cap
        return logits


def build(sd, cfg):
    return Gemma3Text(cfg, dict(sd)).eval()
