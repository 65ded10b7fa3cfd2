"""From-scratch Qwen3 (my conventions: Wq/Wk/Wv/Wo, per-head qnorm/knorm, (b,t,h,d) taps, untied lm_out)."""

import heldout_common as C
import torch
import torch.nn as nn
import torch.nn.functional as F
from heldout_common import bug, rms

import parity


class RMS(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.g = nn.Parameter(w)
        self.eps = eps

    def forward(self, x):
        w = self.g if x.shape[-1] == self.g.shape[0] else self.g.repeat(x.shape[-1] // self.g.shape[0])
        return rms(x, w, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, cfg, sd, p):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.Wq = C.Lin(sd.pop(p + "q_proj.weight"))
        self.Wk = C.Lin(sd.pop(p + "k_proj.weight"))
        self.Wv = C.Lin(sd.pop(p + "v_proj.weight"))
        self.Wo = C.Lin(sd.pop(p + "o_proj.weight"))
        qn, kn = sd.pop(p + "q_norm.weight"), sd.pop(p + "k_norm.weight")
        if bug("qk_norm_weights_swapped"):
            qn, kn = kn, qn
        self.qnorm, self.knorm = RMS(qn, cfg.rms_norm_eps), RMS(kn, cfg.rms_norm_eps)
        # bug: scale from hidden/heads instead of the config's explicit head_dim
        self.scale = (
            (cfg.hidden_size // cfg.num_attention_heads) ** -0.5
            if bug("scale_from_hidden_over_heads")
            else self.hd**-0.5
        )

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.Wq(x).view(b, t, self.nh, self.hd)
        k = self.Wk(x).view(b, t, self.nkv, self.hd)
        v = self.Wv(x).view(b, t, self.nkv, self.hd)
        if bug("qk_norm_whole_projection"):
            q = (
                F.rms_norm(q.reshape(b, t, -1), (self.nh * self.hd,), eps=self.qnorm.eps).view(b, t, self.nh, self.hd)
                * self.qnorm.g
            )
            k = (
                F.rms_norm(k.reshape(b, t, -1), (self.nkv * self.hd,), eps=self.knorm.eps).view(b, t, self.nkv, self.hd)
                * self.knorm.g
            )
        elif bug("qk_norm_whole_in_module"):  # OLMo-2 habit: norm over the whole projection (module called on it)
            q = self.qnorm(q.reshape(b, t, -1)).view(b, t, self.nh, self.hd)
            k = self.knorm(k.reshape(b, t, -1)).view(b, t, self.nkv, self.hd)
        elif not bug("qk_norm_after_rope") and not bug("qk_norm_missing"):
            q, k = self.qnorm(q), self.knorm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = C.apply_rope(q, cos, sin)
        k = C.apply_rope(k, cos, sin)
        if bug("qk_norm_after_rope"):
            q, k = self.qnorm(q), self.knorm(k)
        q = parity.tap(q.transpose(1, 2), "q_rot", layout="bshd").transpose(1, 2)
        k = parity.tap(k.transpose(1, 2), "k_rot", layout="bshd").transpose(1, 2)
        return self.Wo(C.attention(q, k, v, self.scale))


class MLP(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.fc_gate = C.Lin(sd.pop(p + "gate_proj.weight"))
        self.fc_up = C.Lin(sd.pop(p + "up_proj.weight"))
        self.fc_down = C.Lin(sd.pop(p + "down_proj.weight"))

    def forward(self, x):
        return self.fc_down(F.silu(self.fc_gate(x)) * self.fc_up(x))


class Layer(nn.Module):
    def __init__(self, cfg, sd, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre_attn = RMS(sd.pop(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        self.sa = SelfAttention(cfg, sd, p + "self_attn.")
        self.pre_mlp = RMS(sd.pop(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = MLP(sd, p + "mlp.")

    def forward(self, x, cos, sin):
        x = x + self.sa(self.pre_attn(x), cos, sin)
        return x + self.mlp(self.pre_mlp(x))


class Qwen3LM(nn.Module):
    def __init__(self, cfg, sd):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.emb.weight = nn.Parameter(sd.pop("model.embed_tokens.weight"))
        self.layers = nn.ModuleList(Layer(cfg, sd, i) for i in range(cfg.num_hidden_layers))
        self.ln_f = RMS(sd.pop("model.norm.weight"), cfg.rms_norm_eps)
        head = sd.pop("lm_head.weight")
        self.lm_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # bug: assumes tied embeddings (as the small Qwen3s) although this checkpoint is untied
        self.lm_out.weight = self.emb.weight if bug("untied_head_used_embedding") else nn.Parameter(head)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t)[None].expand(b, t)
        x = self.emb(input_ids)
        rot = self.cfg.head_dim // 2 if bug("rope_partial_half") else None
        cos, sin = C.rope_tables(position_ids, self.cfg.head_dim, self.cfg.rope_parameters["rope_theta"], x.dtype, rot)
        for L in self.layers:
            x = L(x, cos, sin)
        return self.lm_out(self.ln_f(x))


def build(sd, cfg):
    return Qwen3LM(cfg, dict(sd)).eval()
