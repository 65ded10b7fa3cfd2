"""StableLM-2 style decoder written from the paper/config, with my own module names.

Pre-norm sequential block (LayerNorm with bias), attention with q/k/v biases, per-head
LayerNorm on q and k (no bias), NeoX-style rotary on the first 25% of each head,
SwiGLU MLP, untied output head. Attention goes through F.scaled_dot_product_attention.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "rope_full_head",
    "rope_last_slice",
    "rope_base_headdim",
    "rope_interleaved",
    "qk_norm_shared",
    "qk_norm_whole",
    "qk_norm_after_rope",
    "k_bias_unmapped",
    "parallel_residual",
    "ln2_from_input_ln",
    "final_norm_bias_unmapped",
    "sdpa_double_scale",
    "lm_head_tied",
    "mlp_gelu",
    "merge_heads_no_transpose",
    "pad_mask_dropped",
]
PADDING_ONLY = ["pad_mask_dropped"]
CLEAN = ["clean_manual_attention", "clean_qknorm_batched"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


class HeadNorms(nn.Module):
    """One LayerNorm (no bias) per head, applied to (B, H, T, D)."""

    def __init__(self, n_heads, head_dim, eps):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(head_dim, eps=eps, bias=False) for _ in range(n_heads)])
        self.eps = eps

    def forward(self, x):
        if BUG == "clean_qknorm_batched":
            w = torch.stack([n.weight for n in self.norms])[None, :, None, :]
            return F.layer_norm(x, x.shape[-1:], eps=self.eps) * w
        if BUG == "qk_norm_shared":
            return self.norms[0](x)
        if BUG == "qk_norm_whole":
            B, H, T, D = x.shape
            flat = x.transpose(1, 2).reshape(B, T, H * D)
            w = torch.cat([n.weight for n in self.norms])
            flat = F.layer_norm(flat, (H * D,), weight=w, eps=self.eps)
            return flat.view(B, T, H, D).transpose(1, 2)
        return torch.stack([norm(x[:, h]) for h, norm in enumerate(self.norms)], dim=1)


class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = d // self.nh
        self.rot = int(self.hd * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        self.wq = nn.Linear(d, self.nh * self.hd, bias=cfg.use_qkv_bias)
        self.wk = nn.Linear(d, self.nkv * self.hd, bias=cfg.use_qkv_bias)
        self.wv = nn.Linear(d, self.nkv * self.hd, bias=cfg.use_qkv_bias)
        self.wo = nn.Linear(d, d, bias=False)
        self.use_qk_norm = cfg.qk_layernorm
        if self.use_qk_norm:
            self.qn = HeadNorms(self.nh, self.hd, cfg.layer_norm_eps)
            self.kn = HeadNorms(self.nkv, self.hd, cfg.layer_norm_eps)

    def rope(self, x, cos, sin):
        rot = self.hd if BUG == "rope_full_head" else self.rot
        if BUG == "rope_last_slice":
            keep, xr = x[..., : self.hd - rot], x[..., self.hd - rot :]
        else:
            xr, keep = x[..., :rot], x[..., rot:]
        if BUG == "rope_interleaved":
            rotated = torch.stack([-xr[..., 1::2], xr[..., 0::2]], dim=-1).flatten(-2)
        else:
            rotated = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], dim=-1)
        xr = xr * cos[:, None] + rotated * sin[:, None]
        if BUG == "rope_last_slice":
            return torch.cat([keep, xr], dim=-1)
        return torch.cat([xr, keep], dim=-1)

    def forward(self, x, cos, sin, mask, name):
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        _rec(name + ".q_proj", q)
        _rec(name + ".k_proj", k)
        _rec(name + ".v_proj", v)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        if self.use_qk_norm and BUG != "qk_norm_after_rope":
            q, k = self.qn(q), self.kn(k)
            _rec(name + ".q_layernorm", q)
            _rec(name + ".k_layernorm", k)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if self.use_qk_norm and BUG == "qk_norm_after_rope":
            q, k = self.qn(q), self.kn(k)
            _rec(name + ".q_layernorm", q)
            _rec(name + ".k_layernorm", k)
        if BUG == "clean_manual_attention":
            g = self.nh // self.nkv
            kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            s = (q / math.sqrt(self.hd)) @ kk.transpose(-1, -2) + mask
            o = torch.softmax(s, dim=-1) @ vv
        elif BUG == "sdpa_double_scale":
            o = F.scaled_dot_product_attention(q / math.sqrt(self.hd), k, v, attn_mask=mask, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if BUG == "merge_heads_no_transpose":
            o = o.reshape(B, T, self.nh * self.hd)
        else:
            o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        o = self.wo(o)
        _rec(name + ".o_proj", o)
        _rec(name, o)
        return o


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, name):
        g, u = self.w_gate(x), self.w_up(x)
        _rec(name + ".gate_proj", g)
        _rec(name + ".up_proj", u)
        act = F.gelu(g) if BUG == "mlp_gelu" else F.silu(g)
        out = self.w_down(act * u)
        _rec(name + ".down_proj", out)
        _rec(name, out)
        return out


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin, mask, name):
        h = self.ln1(x)
        _rec(name + ".input_layernorm", h)
        a = self.attn(h, cos, sin, mask, name + ".self_attn")
        if BUG == "parallel_residual":
            return self._out(x + a + self.ffn(h, name + ".mlp"), name)
        x = x + a
        h2 = self.ln2(x)
        _rec(name + ".post_attention_layernorm", h2)
        return self._out(x + self.ffn(h2, name + ".mlp"), name)

    def _out(self, x, name):
        _rec(name, x)
        return x


class StableLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        hd = cfg.hidden_size // cfg.num_attention_heads
        self.rot = int(hd * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        self.hd = hd
        self.theta = cfg.rope_parameters["rope_theta"]

    def rope_tables(self, pos):
        rot = self.hd if BUG == "rope_full_head" else self.rot
        denom = self.hd if BUG == "rope_base_headdim" else rot
        inv = 1.0 / self.theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / denom)
        ang = pos[..., None].float() * inv
        if BUG == "rope_interleaved":
            ang = ang.repeat_interleave(2, dim=-1)
        else:
            ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()

    def make_mask(self, attention_mask, B, T, dtype):
        i = torch.arange(T)
        ok = (i[None, :] <= i[:, None])[None, None].expand(B, 1, T, T)
        if attention_mask is not None and BUG != "pad_mask_dropped":
            ok = ok & attention_mask.bool()[:, None, None, :]
        return torch.zeros(B, 1, T, T, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T).expand(B, T)
        x = self.tok_emb(input_ids)
        _rec("model.embed_tokens", x)
        cos, sin = self.rope_tables(position_ids)
        _rec("model.rotary_emb", cos)
        mask = self.make_mask(attention_mask, B, T, x.dtype)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, mask, f"model.layers.{i}")
        x = self.ln_f(x)
        _rec("model.norm", x)
        logits = self.head(x)
        _rec("lm_head", logits)
        return logits


def hf_to_mine(cfg):
    """List of (HF key, my key) pairs."""
    m = [
        ("model.embed_tokens.weight", "tok_emb.weight"),
        ("model.norm.weight", "ln_f.weight"),
        ("model.norm.bias", "ln_f.bias"),
    ]
    if BUG == "final_norm_bias_unmapped":
        m.remove(("model.norm.bias", "ln_f.bias"))
    if cfg.tie_word_embeddings or BUG == "lm_head_tied":
        m.append(("model.embed_tokens.weight", "head.weight"))
    else:
        m.append(("lm_head.weight", "head.weight"))
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        for hf, mine in [
            ("self_attn.q_proj", "attn.wq"),
            ("self_attn.k_proj", "attn.wk"),
            ("self_attn.v_proj", "attn.wv"),
        ]:
            m.append((p + hf + ".weight", b + mine + ".weight"))
            if BUG != "k_bias_unmapped" or hf != "self_attn.k_proj":
                m.append((p + hf + ".bias", b + mine + ".bias"))
        m.append((p + "self_attn.o_proj.weight", b + "attn.wo.weight"))
        for h in range(cfg.num_attention_heads):
            m.append((p + f"self_attn.q_layernorm.norms.{h}.weight", b + f"attn.qn.norms.{h}.weight"))
        for h in range(cfg.num_key_value_heads):
            m.append((p + f"self_attn.k_layernorm.norms.{h}.weight", b + f"attn.kn.norms.{h}.weight"))
        m.append((p + "mlp.gate_proj.weight", b + "ffn.w_gate.weight"))
        m.append((p + "mlp.up_proj.weight", b + "ffn.w_up.weight"))
        m.append((p + "mlp.down_proj.weight", b + "ffn.w_down.weight"))
        ln2_src = "input_layernorm" if BUG == "ln2_from_input_ln" else "post_attention_layernorm"
        for t in ("weight", "bias"):
            m.append((p + f"input_layernorm.{t}", b + f"ln1.{t}"))
            m.append((p + f"{ln2_src}.{t}", b + f"ln2.{t}"))
    return m


def build(state_dict, config):
    model = StableLM(config)
    own = {mine: state_dict[hf] for hf, mine in hf_to_mine(config) if hf in state_dict}
    missing, unexpected = model.load_state_dict(own, strict=False)
    assert not unexpected, unexpected
    with torch.no_grad():  # anything the mapping did not fill stays zero (deterministic)
        params = dict(model.named_parameters())
        for k in missing:
            params[k].zero_()
    return model.eval()
