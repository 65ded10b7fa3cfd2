"""Hand-written plain-PyTorch port of SmolLM3 (SmolLM3ForCausalLM).

Architecture as this port implements it:
  * token embedding, no scaling; output head tied to the embedding when config.tie_word_embeddings
    (logits = RMS_final(h) @ E^T), otherwise a separate head matrix;
  * pre-norm Llama-style blocks, RMSNorm with the gain used as-is (eps = config.rms_norm_eps):
        h = h + Attn(RMS_attn(h));  h = h + SwiGLU(RMS_ffn(h))
  * GQA attention (num_key_value_heads < num_attention_heads; query head j uses KV head j // (nh / nkv)),
    softmax scale head_dim**-0.5, biases on q/k/v/o when config.attention_bias, on the MLP when config.mlp_bias;
  * NoPE layers: config.no_rope_layers[i] is a per-layer FLAG, 1 = this layer uses RoPE, 0 = NoPE (no rotary
    at all on q/k).  When the list is absent, Transformers derives it as int((i + 1) % no_rope_layer_interval != 0),
    i.e. every interval-th layer counted from 1 is NoPE (interval 3 here -> flags [1, 1, 0, 1], layer 2 is NoPE);
  * RoPE (where used) in the half-split (rotate_half / NeoX) form over the full head_dim,
    inv_freq = theta^(-2i/head_dim), theta = config.rope_parameters["rope_theta"] (5e4 here);
  * sliding-window attention only when config.use_sliding_window and config.layer_types[i] == "sliding_attention"
    (Transformers marks the NoPE layers as sliding then); key k is visible to query q iff q - W < k <= q
    (W = config.sliding_window keys including the query itself);
  * padding: HF-style attention_mask (1 real / 0 pad, left padding) masks KEYS; masked scores are filled with the
    float32 minimum; positions are taken from position_ids (0..S-1 when absent).

Weight layout of this port (own names, not the HF state-dict names):
  tok_emb (V, H); final_norm.scale (H,); out_proj (V, H) only when the head is untied;
  blocks[i].attn_norm.scale / ffn_norm.scale (H,);
  blocks[i].wqkv: ONE fused, TRANSPOSED matrix (H, (nh + 2 nkv) * hd) = [Wq^T | Wk^T | Wv^T], used as x @ wqkv,
      with bqkv ((nh + 2 nkv) * hd,) in the same [q | k | v] order;
  blocks[i].wo (nh * hd, H) transposed, bo (H,);
  blocks[i].w13 (H, 2 I) = [W_gate^T | W_up^T] fused and transposed, b13 (2 I,) when mlp_bias;
  blocks[i].w2 (I, H) transposed down projection, b2 (H,) when mlp_bias.
  Each block also carries plain attributes use_rope (bool) and window (int or None).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "sm_nope_flags_inverted",  # no_rope_layers read as "1 = NoPE" (the name suggests it): RoPE only on layer 2, NoPE elsewhere
    "sm_nope_interval_zero_based",  # NoPE layers recomputed from no_rope_layer_interval as i % interval == 0 (layers 0, 3) instead of (i + 1) % interval == 0 (layer 2)
    "sm_rope_every_layer",  # Llama template: RoPE applied in every layer, the NoPE flags are never read
    "sm_rope_theta_attr_fallback",  # theta read as getattr(config, "rope_theta", 10000.0); v5 keeps it in rope_parameters, so 1e4 is used instead of 5e4
    "sm_sliding_all_layers",  # use_sliding_window taken as a global switch: the 7-token window is applied to every layer, layer_types ignored
    "sm_sliding_type_string",  # window applied only when layer_types[i] == "sliding" (the value is "sliding_attention"): window never applied
    "sm_window_one_extra_key",  # sliding window admits q - k <= W (W + 1 keys) instead of q - k < W
    "sm_gqa_tiled_kv",  # KV heads expanded with .repeat (query head j uses KV head j % nkv) instead of repeat_interleave (j // group)
    "sm_fused_kv_swapped",  # loader fuses [q | v | k] into wqkv while forward splits it as [q | k | v]
    "sm_o_bias_dropped",  # Qwen2 template: attention_bias honoured for q/k/v only, the o_proj bias is dropped
    "sm_llama_permute_qk",  # loader runs the Meta->HF q/k row permutation on an already-HF checkpoint (scrambles RoPE pairs)
    "sm_pad_mask_on_queries",  # padding mask broadcast on the query axis ([:, None, :, None]) instead of the key axis: real tokens attend to pads
]
PADDING_ONLY = {"sm_pad_mask_on_queries"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with a boolean mask; NaN rows of pad queries zeroed
    "gqa_grouped_einsum",  # queries reshaped to (B, nkv, group, S, hd) and contracted against the un-expanded KV heads
    "rope_complex_pairs",  # q/k rows permuted at load so half-split pairs (i, i + hd/2) become (2i, 2i+1); RoPE as a complex multiply
    "norm_gain_folded",  # RMSNorm gains folded into the rows of wqkv / w13 and into an (untied) head copy at load
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


def _meta_permute(w, n_heads):
    """Meta -> HF conversion permute (interleaved pairs -> halves) from convert_llama_weights_to_hf; w (out, ...)"""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def _halves_to_pairs(n_heads, hd):
    """row order that moves half-split pair (i, i + hd/2) of each head to positions (2i, 2i+1)"""
    idx = []
    for h in range(n_heads):
        for i in range(hd // 2):
            idx += [h * hd + i, h * hd + hd // 2 + i]
    return torch.tensor(idx)


def _rope_flags(cfg):
    b = _bug()
    n = cfg.num_hidden_layers
    if b == "sm_rope_every_layer":
        return [True] * n
    if b == "sm_nope_interval_zero_based":
        return [i % cfg.no_rope_layer_interval != 0 for i in range(n)]
    flags = cfg.no_rope_layers
    if flags is None:
        flags = [int((i + 1) % cfg.no_rope_layer_interval != 0) for i in range(n)]
    flags = [bool(f) for f in flags[:n]]
    if b == "sm_nope_flags_inverted":
        flags = [not f for f in flags]
    return flags


def _window(cfg, i):
    b = _bug()
    if not cfg.use_sliding_window or cfg.sliding_window is None:
        return None
    if b == "sm_sliding_all_layers":
        return cfg.sliding_window
    kinds = cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers
    want = "sliding" if b == "sm_sliding_type_string" else "sliding_attention"
    return cfg.sliding_window if kinds[i] == want else None


class Norm(nn.Module):
    def __init__(self, w, eps, fold):
        super().__init__()
        self.fold = fold  # gain lives in the next matrix
        if not fold:
            self.scale = _P(w)
        self.eps = eps

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if self.fold else y * self.scale


class Rotary:
    def __init__(self, cfg, hd):
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        if _bug() == "sm_rope_theta_attr_fallback":
            theta = getattr(cfg, "rope_theta", 10000.0)
        else:
            theta = rp["rope_theta"]
        self.inv_freq = 1.0 / (float(theta) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def angles(self, pos):
        return pos[..., None].float() * self.inv_freq  # (B, S, hd/2)


def _apply_rope(x, ang):
    """x (B, heads, S, hd); ang (B, S, hd/2)"""
    if _bug() == "rope_complex_pairs":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
    emb = torch.cat((ang, ang), -1)[:, None]
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * emb.cos() + rot * emb.sin()


class Block(nn.Module):
    def __init__(self, sd, cfg, i, use_rope):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.use_rope = use_rope
        self.window = _window(cfg, i)
        fold = b == "norm_gain_folded"
        g_attn = sd[p + "input_layernorm.weight"].float()
        g_ffn = sd[p + "post_attention_layernorm.weight"].float()
        self.attn_norm = Norm(g_attn, cfg.rms_norm_eps, fold)
        self.ffn_norm = Norm(g_ffn, cfg.rms_norm_eps, fold)

        def lin(name):
            w = sd[p + name + ".weight"].float()
            bias = sd.get(p + name + ".bias")
            return w, (bias.float() if bias is not None else torch.zeros(w.shape[0]))

        (qw, qb), (kw, kb), (vw, vb) = lin("self_attn.q_proj"), lin("self_attn.k_proj"), lin("self_attn.v_proj")
        if b == "sm_llama_permute_qk":
            qw, qb = _meta_permute(qw, self.nh), _meta_permute(qb, self.nh)
            kw, kb = _meta_permute(kw, self.nkv), _meta_permute(kb, self.nkv)
        if b == "rope_complex_pairs":
            pq, pk = _halves_to_pairs(self.nh, self.hd), _halves_to_pairs(self.nkv, self.hd)
            qw, qb, kw, kb = qw[pq], qb[pq], kw[pk], kb[pk]
        order = [(qw, qb), (vw, vb), (kw, kb)] if b == "sm_fused_kv_swapped" else [(qw, qb), (kw, kb), (vw, vb)]
        wqkv = torch.cat([w for w, _ in order], 0).t()  # (H, out)
        if fold:
            wqkv = wqkv * g_attn[:, None]
        self.wqkv = _P(wqkv)
        self.bqkv = _P(torch.cat([bb for _, bb in order], 0))
        ow, ob = lin("self_attn.o_proj")
        if b == "sm_o_bias_dropped":
            ob = torch.zeros_like(ob)
        self.wo, self.bo = _P(ow.t()), _P(ob)

        (gw, gb), (uw, ub), (dw, db) = lin("mlp.gate_proj"), lin("mlp.up_proj"), lin("mlp.down_proj")
        w13 = torch.cat((gw, uw), 0).t()
        if fold:
            w13 = w13 * g_ffn[:, None]
        self.w13, self.b13 = _P(w13), _P(torch.cat((gb, ub)))
        self.w2, self.b2 = _P(dw.t()), _P(db)
        self.inter = gw.shape[0]

    def attention(self, x, allowed, ang):
        b = _bug()
        B, S, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        qkv = x @ self.wqkv + self.bqkv
        q, k, v = qkv.split((nq, nk, nk), -1)
        if b not in ("rope_complex_pairs", "sm_llama_permute_qk", "sm_fused_kv_swapped"):
            _rec(self.pre + "self_attn.q_proj", q)
            _rec(self.pre + "self_attn.k_proj", k)
            _rec(self.pre + "self_attn.v_proj", v)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        if self.use_rope:
            q, k = _apply_rope(q, ang), _apply_rope(k, ang)
        g = self.nh // self.nkv
        scale = self.hd**-0.5
        if b == "gqa_grouped_einsum":
            qg = q.view(B, self.nkv, g, S, self.hd)
            s = torch.einsum("bngqd,bnkd->bngqk", qg, k) * scale
            s = s.masked_fill(~allowed[:, :, None], torch.finfo(s.dtype).min)
            ctx = torch.einsum("bngqk,bnkd->bngqd", torch.softmax(s, -1), v).reshape(B, self.nh, S, self.hd)
        else:
            if b == "sm_gqa_tiled_kv":
                k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            else:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            if b == "sdpa":
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
                ctx = torch.nan_to_num(ctx)
            else:
                s = (q @ k.transpose(-1, -2)) * scale
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
                ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nq)
        out = ctx @ self.wo + self.bo
        _rec(self.pre + "self_attn", out)
        return out

    def ffn(self, x):
        gu = x @ self.w13 + self.b13
        gate, up = gu[..., : self.inter], gu[..., self.inter :]
        out = (F.silu(gate) * up) @ self.w2 + self.b2
        _rec(self.pre + "mlp", out)
        return out

    def forward(self, h, masks, ang):
        allowed = masks[self.window]
        n = self.attn_norm(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attention(n, allowed, ang)
        n = self.ffn_norm(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + self.ffn(n)
        _rec(self.pre.rstrip("."), h)
        return h


class SmolLM3Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        fold = _bug() == "norm_gain_folded"
        self.tok_emb = _P(sd["model.embed_tokens.weight"])
        head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
        g_final = sd["model.norm.weight"].float()
        self.tied = cfg.tie_word_embeddings and not fold
        if not self.tied:
            self.out_proj = _P(head.float() * g_final[None, :] if fold else head)
        self.final_norm = Norm(g_final, cfg.rms_norm_eps, fold)
        flags = _rope_flags(cfg)
        self.blocks = nn.ModuleList(Block(sd, cfg, i, flags[i]) for i in range(cfg.num_hidden_layers))
        hd = self.blocks[0].hd
        self.rotary = Rotary(cfg, hd)

    def _masks(self, keep):
        b = _bug()
        S = keep.shape[1]
        qi = torch.arange(S)[:, None]
        ki = torch.arange(S)[None, :]
        causal = ki <= qi
        if b == "sm_pad_mask_on_queries":
            pad = keep[:, None, :, None]
        else:
            pad = keep[:, None, None, :]
        masks = {None: causal[None, None] & pad}
        for blk in self.blocks:
            w = blk.window
            if w is not None and w not in masks:
                near = (qi - ki <= w) if b == "sm_window_one_extra_key" else (qi - ki < w)
                masks[w] = (causal & near)[None, None] & pad
        return masks

    def _core(self, input_ids, keep, pos):
        masks = self._masks(keep)
        h = self.tok_emb[input_ids]
        _rec("model.embed_tokens", h)
        ang = self.rotary.angles(pos)
        for blk in self.blocks:
            h = blk(h, masks, ang)
        h = self.final_norm(h)
        _rec("model.norm", h)
        logits = h @ (self.tok_emb if self.tied else self.out_proj).t()
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
            V = self.tok_emb.shape[0] if self.tied else self.out_proj.shape[0]
            logits = torch.zeros(B, S, V)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return SmolLM3Port(state_dict, config).eval()
