"""Hand-written plain-PyTorch port of Jais-2 (Jais2ForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  token embedding (no scaling); separate untied lm_head (no bias);
  * standard LayerNorm WITH bias (mean-centred, eps = layer_norm_eps) instead of RMSNorm, for the two per-block
    pre-norms and the final norm;
  sequential pre-norm block: h = h + Attn(LN_1(h));  h = h + MLP(LN_2(h));
  attention: GQA, head_dim = hidden_size / num_heads (16 here), scale head_dim**-0.5, full causal attention in
    every layer;
    * biases on q, k, v AND o projections (attention_bias covers all four);
    RoPE in the half-split (rotate_half / NeoX) form over the full head_dim, * theta from
    rope_parameters["rope_theta"] (500000 here, not 10000);
  * MLP is NOT gated: down(relu(up(x))^2) (hidden_act "relu2" = squared ReLU), with biases on up and down
    (mlp_bias);
  final LayerNorm, then lm_head;
  padding: HF-style attention_mask masks keys; positions from position_ids (0..S-1 when absent).

Weight layout of this port (Megatron/GPT-2 style, own names, grouped fused QKV):
  wte (V, H); lm_head (V, H); ln_f.weight / ln_f.bias (H,);
  layers[i].ln_1.weight / .bias, layers[i].ln_2.weight / .bias (H,);
  layers[i].attn.c_attn_w (nkv, (rep + 2) * hd, H) and c_attn_b (nkv, (rep + 2) * hd): per kv group g the rows
    are [q heads g*rep .. g*rep+rep-1 | k head g | v head g] (rep = nh / nkv), applied as x @ W^T;
  layers[i].attn.c_proj_w (nh*hd, H) (in, out), layers[i].attn.c_proj_b (H,);
  layers[i].mlp.c_fc_w (H, I), c_fc_b (I,), c_proj_w (I, H), c_proj_b (H,)  (in, out).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "j2_relu_not_squared",  # relu2 read as plain ReLU (square dropped)
    "j2_gelu_act",  # Jais-1 habit: GELU activation in the MLP instead of squared ReLU
    "j2_rmsnorm_template",  # Llama template: RMSNorm (no mean subtraction, no bias) instead of LayerNorm
    "j2_ln_bias_dropped",  # LayerNorm bias not loaded (weight only)
    "j2_qkv_bias_dropped",  # Llama template: q/k/v projection biases dropped
    "j2_o_bias_dropped",  # Qwen2 template: q/k/v biases kept but o_proj bias dropped
    "j2_rope_interleaved",  # GPT-J interleaved-pair RoPE instead of rotate_half
    "j2_rope_theta_default",  # rope theta hard-coded 10000 instead of rope_parameters["rope_theta"]
    "j2_qkv_group_split_flat",  # grouped fused QKV split at run time as flat [Q | K | V] blocks
    "j2_parallel_residual",  # GPT-NeoX template: parallel residual h + attn(LN_1 h) + mlp(LN_2 h)
    "j2_head_tied_to_embedding",  # lm_head tied to the embedding table although tie_word_embeddings is False
    "j2_final_norm_missing",  # final ln_f not applied before the head
    "j2_pad_mask_ignored",  # attention_mask not merged into the causal mask: pad keys attended
]
PADDING_ONLY = {"j2_pad_mask_ignored"}
CLEAN = [
    "rope_complex",  # q/k rows (and biases) permuted at load to interleaved pairs; RoPE as a complex multiply
    "sdpa_enable_gqa",  # F.scaled_dot_product_attention with enable_gqa=True and a boolean mask
    "q_scale_folded",  # head_dim**-0.5 folded into the q rows (weights and bias) at load
    "mlp_bias_augmented",  # c_fc bias folded into an extra weight row, input augmented with a ones column
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


class LN(nn.Module):
    def __init__(self, sd, p, eps):
        super().__init__()
        self.weight = _P(sd[p + ".weight"])
        self.bias = _P(sd[p + ".bias"])
        self.eps = eps

    def forward(self, x):
        b = _bug()
        if b == "j2_rmsnorm_template":
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        if b == "j2_ln_bias_dropped":
            return F.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def _rope(x, cos, sin, ang):
    b = _bug()
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    if b == "j2_rope_interleaved":
        c = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, -1)
        s = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, -1)
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return x * c + rot * s
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class Attn(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rep = self.nh // self.nkv
        H = cfg.hidden_size

        def wb(n, heads):
            w = sd[p + n + ".weight"].float().view(heads, self.hd, H)
            bb = sd.get(p + n + ".bias")
            bb = torch.zeros(heads, self.hd) if bb is None else bb.float().view(heads, self.hd)
            return w, bb

        qw, qb = wb("q_proj", self.nh)
        kw, kb = wb("k_proj", self.nkv)
        vw, vb = wb("v_proj", self.nkv)
        if b == "j2_qkv_bias_dropped":
            qb, kb, vb = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
        if b == "rope_complex":
            order = _pairs_order(self.hd)
            qw, qb, kw, kb = qw[:, order], qb[:, order], kw[:, order], kb[:, order]
        self.scale = self.hd**-0.5
        if b == "q_scale_folded":
            qw, qb = qw * self.scale, qb * self.scale
            self.scale = 1.0
        qw = qw.view(self.nkv, self.rep, self.hd, H)
        qb = qb.view(self.nkv, self.rep, self.hd)
        w = torch.cat((qw, kw[:, None], vw[:, None]), 1)  # (nkv, rep+2, hd, H)
        bias = torch.cat((qb, kb[:, None], vb[:, None]), 1)
        self.c_attn_w = _P(w.reshape(self.nkv, (self.rep + 2) * self.hd, H))
        self.c_attn_b = _P(bias.reshape(self.nkv, (self.rep + 2) * self.hd))
        self.c_proj_w = _P(sd[p + "o_proj.weight"].float().t())
        ob = sd.get(p + "o_proj.bias")
        if ob is None or b == "j2_o_bias_dropped":
            ob = torch.zeros(H)
        self.c_proj_b = _P(ob)

    def forward(self, x, allowed, cos, sin, ang):
        b = _bug()
        B, S, H = x.shape
        hd, rep, nkv = self.hd, self.rep, self.nkv
        if b == "j2_qkv_group_split_flat":
            flat_w = self.c_attn_w.reshape(-1, H)
            flat_b = self.c_attn_b.reshape(-1)
            qkv = x @ flat_w.t() + flat_b
            q, k, v = torch.split(qkv, [self.nh * hd, nkv * hd, nkv * hd], -1)
            q = q.view(B, S, self.nh, hd).transpose(1, 2)
            k = k.view(B, S, nkv, hd).transpose(1, 2)
            v = v.view(B, S, nkv, hd).transpose(1, 2)
        else:
            qkv = torch.einsum("bsh,gnh->bsgn", x, self.c_attn_w) + self.c_attn_b
            qkv = qkv.view(B, S, nkv, rep + 2, hd)
            q = qkv[:, :, :, :rep].reshape(B, S, self.nh, hd).transpose(1, 2)
            k = qkv[:, :, :, rep].transpose(1, 2)
            v = qkv[:, :, :, rep + 1].transpose(1, 2)
        q, k = _rope(q, cos, sin, ang), _rope(k, cos, sin, ang)
        if b == "sdpa_enable_gqa":
            # a fully padded query row would have no visible key: let it see itself so SDPA cannot return NaN
            eye = torch.eye(S, dtype=torch.bool)[None, None]
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | eye, scale=self.scale, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.c_proj_w + self.c_proj_b
        _rec(self.pre.rstrip("."), out)
        return out


class MLP(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.pre = p
        if cfg.hidden_act != "relu2":
            raise NotImplementedError(cfg.hidden_act)
        w = sd[p + "up_proj.weight"].float().t()
        bb = sd.get(p + "up_proj.bias")
        bb = torch.zeros(w.shape[1]) if bb is None else bb.float()
        self.augmented = _bug() == "mlp_bias_augmented"
        if self.augmented:
            self.c_fc_w = _P(torch.cat((w, bb[None]), 0))  # (H + 1, I)
        else:
            self.c_fc_w = _P(w)
            self.c_fc_b = _P(bb)
        self.c_proj_w = _P(sd[p + "down_proj.weight"].float().t())
        db = sd.get(p + "down_proj.bias")
        self.c_proj_b = _P(torch.zeros(self.c_proj_w.shape[1]) if db is None else db)

    def forward(self, x):
        b = _bug()
        if self.augmented:
            u = torch.cat((x, torch.ones_like(x[..., :1])), -1) @ self.c_fc_w
        else:
            u = x @ self.c_fc_w + self.c_fc_b
        if b == "j2_relu_not_squared":
            a = F.relu(u)
        elif b == "j2_gelu_act":
            a = F.gelu(u)
        else:
            a = F.relu(u).square()
        out = a @ self.c_proj_w + self.c_proj_b
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        p = f"model.layers.{i}."
        self.pre = p
        self.ln_1 = LN(sd, p + "input_layernorm", cfg.layer_norm_eps)
        self.attn = Attn(sd, p + "self_attn.", cfg)
        self.ln_2 = LN(sd, p + "post_attention_layernorm", cfg.layer_norm_eps)
        self.mlp = MLP(sd, p + "mlp.", cfg)

    def forward(self, h, allowed, cos, sin, ang):
        n1 = self.ln_1(h)
        _rec(self.pre + "input_layernorm", n1)
        a = self.attn(n1, allowed, cos, sin, ang)
        if _bug() == "j2_parallel_residual":
            h = h + a + self.mlp(self.ln_2(h))
        else:
            h = h + a
            n2 = self.ln_2(h)
            _rec(self.pre + "post_attention_layernorm", n2)
            h = h + self.mlp(n2)
        _rec(self.pre.rstrip("."), h)
        return h


class Jais2Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.wte = _P(sd["model.embed_tokens.weight"])
        if cfg.tie_word_embeddings or b == "j2_head_tied_to_embedding":
            self.lm_head = _P(sd["model.embed_tokens.weight"])
        else:
            self.lm_head = _P(sd["lm_head.weight"])
        self.layers = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f = LN(sd, "model.norm", cfg.layer_norm_eps)
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        theta = 10000.0 if b == "j2_rope_theta_default" else float(rp["rope_theta"])
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _core(self, input_ids, keep, pos):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if _bug() == "j2_pad_mask_ignored":
            allowed = causal.expand(input_ids.shape[0], 1, S, S)
        else:
            allowed = causal & keep[:, None, None, :]
        h = self.wte[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq  # (B, S, hd/2)
        emb = torch.cat((ang, ang), -1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            h = layer(h, allowed, cos, sin, ang)
        if _bug() != "j2_final_norm_missing":
            h = self.ln_f(h)
        _rec("model.norm", h)
        logits = h @ self.lm_head.t()
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
    return Jais2Port(state_dict, config).eval()
