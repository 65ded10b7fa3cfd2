"""Hand-written plain-PyTorch port of Ministral (MinistralForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head (config.tie_word_embeddings is False here);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps), two pre-norms per block:
        h = h + Attn(RMS_in(h));  h = h + MLP(RMS_post(h))
  - attention: GQA (num_key_value_heads < num_attention_heads), no biases,
    * explicit head_dim from the config (32 here, NOT hidden/heads = 16); scores scaled by head_dim**-0.5;
  - RoPE in the half-split (rotate_half / NeoX) form over the full head_dim, theta = rope_parameters["rope_theta"]
    (1000 here, not Llama's 10000); inverse frequencies computed over head_dim;
  * per-layer attention kind from config.layer_types (here [sliding, full, sliding, sliding]); a sliding layer lets
    query q see key k iff q - W < k <= q with W = config.sliding_window (7 here), the full layer is plain causal;
  - MLP: silu(gate(x)) * up(x) -> down, no biases;
  - final RMSNorm, then the head;
  - padding: HF-style 0/1 attention_mask masks keys in both the full and the sliding masks (float32-min fill);
    positions from position_ids (0..S-1 when absent, as HF does, even for left-padded rows).

Weight layout of this port (fused, (in, out) matrices applied as x @ w, own names):
  tok_embeddings (V, H); output (H, V) (the head, transposed); norm.g (H,);
  blocks[i].attn_norm.g / ffn_norm.g (H,);
  blocks[i].wqkv (H, (nh + 2 nkv) * hd): columns [Q heads | K heads | V heads], each head hd wide;
  blocks[i].wo (nh * hd, H);
  blocks[i].w13 (H, 2 I): columns [gate | up]; blocks[i].w2 (I, H).
  Each block has a plain attribute `window` (int, or None for a full-attention layer).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "mn_all_layers_sliding",  # Mistral template: sliding window on every layer, config.layer_types ignored
    "mn_no_sliding_window",  # Llama template: sliding window never applied, every layer plain causal
    "mn_window_one_key_long",  # window test written q - k <= W: W + 1 keys visible instead of W
    "mn_scale_hidden_over_heads",  # softmax scale from hidden_size // num_heads (16) instead of config.head_dim (32)
    "mn_rope_interleaved_pairs",  # RoPE rotates adjacent pairs (GPT-J style) instead of the half-split form
    "mn_rope_theta_llama_default",  # rope theta falls back to 10000 instead of rope_parameters["rope_theta"]
    "mn_head_tied_to_embedding",  # output head taken from the embedding table although tie_word_embeddings is False
    "mn_gqa_tiled_heads",  # kv heads expanded with repeat (tile): q head h reads kv head h % nkv, not h // groups
    "mn_w13_packed_swapped",  # gate_proj / up_proj packed into w13 in the wrong order: silu applied to the up branch
    "mn_wo_head_major_mixup",  # o_proj converted with the (hd, nh) column order instead of (nh, hd)
    "mn_residual_after_norm",  # residual stream taken from the normed input: h = RMS(h) + Attn(RMS(h))
    "mn_final_norm_skipped",  # final model.norm not applied before the head
    "mn_sliding_pad_mask_dropped",  # padding merged into the full-attention mask only; sliding layers ignore it
]
PADDING_ONLY = {"mn_sliding_pad_mask_dropped"}
CLEAN = [
    "sdpa_attention",  # F.scaled_dot_product_attention with a boolean mask instead of explicit softmax
    "scale_folded_into_q",  # head_dim**-0.5 folded into the Q columns of wqkv at load
    "norm_gain_folded",  # RMSNorm gains folded into the rows of wqkv / w13 / output at load, norms gain-free
    "rope_complex",  # Q/K head channels permuted at load to interleaved pairs; RoPE as a complex multiply
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


def _pair_perm(hd):
    """new channel 2i <- old i, new 2i+1 <- old i + hd/2"""
    return torch.stack((torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2), -1).flatten()


class RMS(nn.Module):
    def __init__(self, w, eps, gainless=False):
        super().__init__()
        self.g = None if gainless else _P(w)
        self.eps = eps

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if self.g is None else y * self.g


def _rope(x, cos, sin):
    """x (B, n, S, hd); cos/sin (B, S, hd/2)"""
    b = _bug()
    cos, sin = cos[:, None], sin[:, None]
    if b == "rope_complex":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    if b == "mn_rope_interleaved_pairs":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        kind = cfg.layer_types[i]
        if b == "mn_all_layers_sliding":
            kind = "sliding_attention"
        if b == "mn_no_sliding_window":
            kind = "full_attention"
        self.window = cfg.sliding_window if kind == "sliding_attention" else None
        fold = b == "norm_gain_folded"
        g_in = sd[p + "input_layernorm.weight"].float()
        g_post = sd[p + "post_attention_layernorm.weight"].float()
        self.attn_norm = RMS(g_in, cfg.rms_norm_eps, gainless=fold)
        self.ffn_norm = RMS(g_post, cfg.rms_norm_eps, gainless=fold)

        q = sd[p + "self_attn.q_proj.weight"].float().t()  # (H, nh*hd)
        k = sd[p + "self_attn.k_proj.weight"].float().t()
        v = sd[p + "self_attn.v_proj.weight"].float().t()
        if b == "rope_complex":
            perm = _pair_perm(self.hd)
            q = q.view(-1, self.nh, self.hd)[..., perm].reshape(q.shape)
            k = k.view(-1, self.nkv, self.hd)[..., perm].reshape(k.shape)
        self.scale = self.hd**-0.5
        if b == "mn_scale_hidden_over_heads":
            self.scale = (cfg.hidden_size // self.nh) ** -0.5
        if b == "scale_folded_into_q":
            q = q * self.scale
            self.scale = 1.0
        wqkv = torch.cat((q, k, v), 1)
        if fold:
            wqkv = g_in[:, None] * wqkv
        self.wqkv = _P(wqkv)
        o = sd[p + "self_attn.o_proj.weight"].float().t()  # (nh*hd, H)
        if b == "mn_wo_head_major_mixup":
            o = o.view(self.nh, self.hd, -1).transpose(0, 1).reshape(o.shape)
        self.wo = _P(o)

        gate = sd[p + "mlp.gate_proj.weight"].float().t()
        up = sd[p + "mlp.up_proj.weight"].float().t()
        w13 = torch.cat((up, gate) if b == "mn_w13_packed_swapped" else (gate, up), 1)
        if fold:
            w13 = g_post[:, None] * w13
        self.w13 = _P(w13)
        self.w2 = _P(sd[p + "mlp.down_proj.weight"].float().t())
        if cfg.hidden_act != "silu":
            raise NotImplementedError(cfg.hidden_act)

    def attn(self, x, masks, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        qkv = x @ self.wqkv
        q, k, v = qkv.split((nq, nk, nk), -1)
        if b not in ("rope_complex", "scale_folded_into_q", "norm_gain_folded"):
            _rec(self.pre + "self_attn.q_proj", q)
            _rec(self.pre + "self_attn.k_proj", k)
        if b != "norm_gain_folded":
            _rec(self.pre + "self_attn.v_proj", v)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        g = self.nh // self.nkv
        if b == "mn_gqa_tiled_heads":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        allowed = masks["sliding" if self.window is not None else "full"]
        if b == "sdpa_attention":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
            ctx = torch.softmax(s, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, -1) @ self.wo
        _rec(self.pre + "self_attn", out)
        return out

    def mlp(self, x):
        gate, up = (x @ self.w13).chunk(2, -1)
        out = (F.silu(gate) * up) @ self.w2
        _rec(self.pre + "mlp", out)
        return out

    def forward(self, h, masks, cos, sin):
        b = _bug()
        n = self.attn_norm(h)
        if b != "norm_gain_folded":
            _rec(self.pre + "input_layernorm", n)
        h = (n if b == "mn_residual_after_norm" else h) + self.attn(n, masks, cos, sin)
        n = self.ffn_norm(h)
        if b != "norm_gain_folded":
            _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.mlp(n)
        _rec(self.pre.rstrip("."), h)
        return h


class MinistralPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.tok_embeddings = _P(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings or b == "mn_head_tied_to_embedding":
            head = sd["model.embed_tokens.weight"]
        head = head.float().t()
        g_final = sd["model.norm.weight"].float()
        fold = b == "norm_gain_folded"
        if fold:
            head = g_final[:, None] * head
        self.output = _P(head)
        self.norm = RMS(g_final, cfg.rms_norm_eps, gainless=fold)
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        theta = 10000.0 if b == "mn_rope_theta_llama_default" else float(rp["rope_theta"])
        hd = self.blocks[0].hd
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _masks(self, keep):
        b = _bug()
        S = keep.shape[1]
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        causal = (ki <= qi)[None, None]
        W = self.cfg.sliding_window
        near = (qi - ki <= W) if b == "mn_window_one_key_long" else (qi - ki < W)
        pad = keep[:, None, None, :]
        full = causal & pad
        sliding = causal & near[None, None]
        if b != "mn_sliding_pad_mask_dropped":
            sliding = sliding & pad
        return {"full": full, "sliding": sliding.expand_as(full)}

    def _core(self, input_ids, keep, pos):
        b = _bug()
        masks = self._masks(keep)
        h = self.tok_embeddings[input_ids]
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            h = blk(h, masks, cos, sin)
        if b != "mn_final_norm_skipped":
            h = self.norm(h)
        if b != "norm_gain_folded":
            _rec("model.norm", h)
        logits = h @ self.output
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
    return MinistralPort(state_dict, config).eval()
