"""From-scratch Llama 3 (my conventions: fused wqkv, fused w13 gate|up, 'scale' norm params, tied head)."""

import heldout_common as C
import torch
import torch.nn as nn
import torch.nn.functional as F
from heldout_common import bug, rms

import parity


class Norm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.scale = w
        self.eps = eps

    def forward(self, x):
        return rms(x, self.scale, self.eps)


class Attn(nn.Module):
    def __init__(self, cfg, sd, p):
        super().__init__()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.nh
        wq = sd.pop(p + "q_proj.weight")
        if bug("q_weight_transposed"):
            wq = wq.T
        self.wqkv = C.Lin(torch.cat([wq, sd.pop(p + "k_proj.weight"), sd.pop(p + "v_proj.weight")]))
        wo = sd.pop(p + "o_proj.weight")
        if bug("o_weight_transposed"):
            wo = wo.T
        self.wo = C.Lin(wo, torch.full((cfg.hidden_size,), 0.02, dtype=wo.dtype) if bug("bias_added") else None)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        if bug("kv_split_order"):  # fused layout read as [q | v | k]
            k, v = v, k
        q = q.view(b, t, self.nh, self.hd).transpose(1, 2)
        k = k.view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        if not bug("rope_k_only"):
            q = C.apply_rope(q, cos, sin)
        k = C.apply_rope(k, cos, sin)
        q = parity.tap(q, "q_rot")
        k = parity.tap(k, "k_rot")
        scale = 1.0 / self.hd if bug("scale_1_over_d") else self.hd**-0.5
        c = C.attention(q, k, v, scale)
        return self.wo(c)


class FFN(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.w13 = C.Lin(torch.cat([sd.pop(p + "gate_proj.weight"), sd.pop(p + "up_proj.weight")]))
        self.w2 = C.Lin(sd.pop(p + "down_proj.weight"))

    def forward(self, x):
        g, u = self.w13(x).chunk(2, -1)
        if bug("gate_up_swapped"):
            g, u = u, g
        act = F.gelu(g) if bug("silu_as_gelu") else F.silu(g)
        return self.w2(act * u)


class Block(nn.Module):
    def __init__(self, cfg, sd, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.norm_a = Norm(
            nn.Parameter(sd.pop(p + "input_layernorm.weight")), 1e-6 if bug("eps_wrong") else cfg.rms_norm_eps
        )
        self.attn = Attn(cfg, sd, p + "self_attn.")
        self.norm_f = Norm(nn.Parameter(sd.pop(p + "post_attention_layernorm.weight")), cfg.rms_norm_eps)
        self.ffn = FFN(sd, p + "mlp.")

    def forward(self, x, cos, sin):
        if bug("post_norm_instead_of_pre"):  # OLMo-2 style norm after the sublayer, on a pre-norm model
            x = x + self.norm_a(self.attn(x, cos, sin))
            return x + self.norm_f(self.ffn(x))
        if bug("parallel_block"):  # GPT-J/Cohere habit: attn and ffn both read the block input
            return x + self.attn(self.norm_a(x), cos, sin) + self.ffn(self.norm_f(x))
        a = self.attn(self.norm_a(x), cos, sin)
        if bug("residual_missing"):
            x = a
        elif bug("residual_twice"):
            x = x + a + a
        else:
            x = x + a
        return x + self.ffn(self.norm_f(x))


class MyLlama(nn.Module):
    def __init__(self, cfg, sd):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.tok.weight = nn.Parameter(sd.pop("model.embed_tokens.weight"))
        self.blocks = nn.ModuleList(Block(cfg, sd, i) for i in range(cfg.num_hidden_layers))
        self.norm_out = Norm(nn.Parameter(sd.pop("model.norm.weight")), cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not bug("tie_missed_random_head"):
            self.head.weight = self.tok.weight
        sd.pop("lm_head.weight", None)
        self.theta = cfg.rope_parameters["rope_theta"]
        if bug("rope_theta_wrong"):
            self.theta = 10000.0

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t)[None].expand(b, t)
        if bug("pos_from_1"):
            position_ids = position_ids + 1
        x = self.tok(input_ids)
        if bug("extra_embed_scale"):
            x = x * self.cfg.hidden_size**0.5
        hd = self.cfg.hidden_size // self.cfg.num_attention_heads
        cos, sin = C.rope_tables(position_ids, hd, self.theta, x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        if not bug("final_norm_missing"):
            x = self.norm_out(x)
        return self.head(x)


def build(sd, cfg):
    return MyLlama(cfg, dict(sd)).eval()
