"""Hand-written plain-PyTorch port of AFMoE / Arcee Trinity (AfmoeForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding multiplied by sqrt(hidden_size) before the first block when config.mup_enabled (muP input
    scaling); output head is a separate (untied) lm_head matrix;
  RMSNorm y = w * x / sqrt(mean(x^2) + eps) (plain gain w, no +1), computed in float32;
  * FOUR norms per block ("sandwich" / dual normalisation):
        h = h + RMS_attn_out(Attn(RMS_in(h)));  h = h + RMS_ffn_out(FFN(RMS_ffn_in(h)))
    (HF names: input_layernorm, post_attention_layernorm (applied to the attention OUTPUT, not before the MLP),
    pre_mlp_layernorm, post_mlp_layernorm);
  * attention: GQA, explicit head_dim (32 here, not hidden/heads = 16), no biases, scale head_dim**-0.5;
    * per-head RMSNorm on q and k (q_norm / k_norm over head_dim) BEFORE RoPE;
    * RoPE (half-split / NeoX rotate_half form, theta = rope_parameters["rope_theta"]) ONLY on sliding-window
      layers; full-attention layers use no positional encoding at all (NoPE);
    * gated output: ctx (concatenated heads) multiplied by sigmoid(gate_proj(x)) before o_proj;
  * layer kinds from config.layer_types (built from global_attn_every_n_layers: every n-th layer, counting from 1,
    is full attention; here n = 2 -> [sliding, full, sliding, full]); a sliding layer lets query q see key k iff
    q - W < k <= q (W = config.sliding_window);
  * FFN: the first config.num_dense_layers blocks use a dense SwiGLU MLP (intermediate_size); the others a MoE:
      - router: scores = sigmoid(x @ W_router) in float32;
      - selection: top-k of (scores + expert_bias) -- the bias only steers WHICH experts are picked;
      - weights: the UNBIASED sigmoid scores of the picked experts, renormalised to sum 1 (+1e-20),
        then multiplied by route_scale (2.5 here);
      - routed experts: SwiGLU with moe_intermediate_size; HF packs them as gate_up_proj (E, 2*I, H) with the
        gate in the first I rows and up in the last I rows;
      - one always-on shared expert (SwiGLU, moe_intermediate_size * num_shared_experts), simply ADDED;
  final RMSNorm, then lm_head;
  padding: HF-style attention_mask masks keys in both the full and the sliding masks; positions from
  position_ids (0..S-1 when absent, also for left-padded rows).

Weight layout of this port (torchtitan-like, own names, matrices stored (in, out) and applied as x @ W):
  tok_embeddings (V, H); output (V, H); norm (H,);
  layers[i].attention_norm / attn_out_norm / ffn_norm / ffn_out_norm (H,);
  layers[i].attention.wqkvg (H, (2*nh + 2*nkv) * hd) = [q | k | v | gate] column blocks, heads contiguous;
  layers[i].attention.q_norm / k_norm (hd,); layers[i].attention.wo (nh*hd, H);
  dense blocks: layers[i].feed_forward.w13 (H, 2*I) = [gate | up]; layers[i].feed_forward.w2 (I, H);
  MoE blocks: layers[i].moe.router (H, E); layers[i].moe.expert_bias (E,);
              layers[i].moe.w13 (E, H, 2*Ie) = [gate | up]; layers[i].moe.w2 (E, Ie, H);
              layers[i].moe.shared_w13 (H, 2*Is) = [gate | up]; layers[i].moe.shared_w2 (Is, H).
  Each layer has plain attributes `sliding` (bool) and `use_rope` (bool).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "af_mup_scale_missing",  # mup_enabled ignored: embeddings not multiplied by sqrt(hidden_size)
    "af_llama_norm_naming",  # Llama naming: post_attention_layernorm used as the pre-MLP norm, attn output added un-normed, pre_mlp_layernorm unused
    "af_rope_all_layers",  # RoPE applied on the full-attention (NoPE) layers too
    "af_layer_types_offbyone",  # full layers recomputed as i % n == 0 instead of (i + 1) % n == 0 (config.layer_types ignored)
    "af_qk_norm_after_rope",  # q_norm / k_norm applied after the rotary embedding instead of before
    "af_attn_gate_silu",  # attention output gate uses silu(gate) instead of sigmoid(gate)
    "af_router_softmax",  # router scores from softmax over experts instead of sigmoid
    "af_bias_in_weights",  # expert_bias added to the scores used as combine weights, not only for selection
    "af_bias_not_in_selection",  # expert_bias dropped: top-k taken on the raw sigmoid scores
    "af_route_scale_before_norm",  # route_scale multiplied in before the top-k renormalisation, so it cancels
    "af_gate_up_interleaved",  # packed gate_up_proj split as interleaved rows (0::2 / 1::2) instead of halves
    "af_scale_hidden_over_heads",  # attention scale from hidden_size // num_heads (16) instead of config.head_dim (32)
    "af_sliding_pad_mask_dropped",  # padding merged into the full-attention mask only; sliding layers see pad keys
]
PADDING_ONLY = {"af_sliding_pad_mask_dropped"}
CLEAN = [
    "sdpa_enable_gqa",  # F.scaled_dot_product_attention with enable_gqa=True and an additive float mask
    "experts_dense_bmm",  # every expert run on every token with one bmm, combined through a dense (T, E) weight matrix
    "route_scale_folded",  # route_scale folded into the routed experts' w2 at load
    "embed_mup_folded",  # sqrt(hidden_size) folded into the (untied) input embedding table at load
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


def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Norm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.weight = _P(w)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


def _rotate(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class Attention(nn.Module):
    def __init__(self, sd, p, cfg, use_rope):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.head_dim
        self.use_rope = use_rope
        w = [sd[p + n + ".weight"].float().t() for n in ("q_proj", "k_proj", "v_proj", "gate_proj")]
        self.wqkvg = _P(torch.cat(w, 1))
        self.wo = _P(sd[p + "o_proj.weight"].float().t())
        self.q_norm = _P(sd[p + "q_norm.weight"])
        self.k_norm = _P(sd[p + "k_norm.weight"])
        self.eps = cfg.rms_norm_eps
        hd_for_scale = cfg.hidden_size // cfg.num_attention_heads if b == "af_scale_hidden_over_heads" else self.hd
        self.scale = hd_for_scale**-0.5

    def forward(self, x, bias, cos, sin):
        b = _bug()
        B, S, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q, k, v, g = torch.split(x @ self.wqkvg, [nq, nk, nk, nq], -1)
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        rope = self.use_rope
        if b != "af_qk_norm_after_rope":
            q, k = _rms(q, self.q_norm, self.eps), _rms(k, self.k_norm, self.eps)
        if rope:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if b == "af_qk_norm_after_rope":
            q, k = _rms(q, self.q_norm, self.eps), _rms(k, self.k_norm, self.eps)
        if b == "sdpa_enable_gqa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale, enable_gqa=True)
        else:
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale + bias
            ctx = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s.float(), -1), v)
        ctx = ctx.transpose(1, 2).reshape(B, S, -1)
        gate = F.silu(g) if b == "af_attn_gate_silu" else torch.sigmoid(g)
        out = (ctx * gate) @ self.wo
        _rec(self.pre.rstrip("."), out)
        return out


class DenseFFN(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.pre = p
        self.w13 = _P(torch.cat((sd[p + "gate_proj.weight"].t(), sd[p + "up_proj.weight"].t()), 1))
        self.w2 = _P(sd[p + "down_proj.weight"].t())

    def forward(self, x):
        g, u = (x @ self.w13).chunk(2, -1)
        out = (F.silu(g) * u) @ self.w2
        _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        b = _bug()
        self.pre = p
        self.k = cfg.num_experts_per_tok
        self.E = cfg.num_experts
        self.route_scale = float(cfg.route_scale)
        self.router = _P(sd[p + "router.gate.weight"].float().t())
        self.expert_bias = _P(sd[p + "expert_bias"])
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        if b == "af_gate_up_interleaved":
            gate, up = gu[:, 0::2], gu[:, 1::2]
        else:
            gate, up = gu.chunk(2, 1)
        self.w13 = _P(torch.cat((gate, up), 1).transpose(1, 2))  # (E, H, 2I)
        w2 = sd[p + "experts.down_proj"].float().transpose(1, 2)  # (E, I, H)
        if b == "route_scale_folded":
            w2 = w2 * self.route_scale
            self.route_scale = 1.0
        self.w2 = _P(w2)
        sp = p + "shared_experts."
        self.shared_w13 = _P(torch.cat((sd[sp + "gate_proj.weight"].t(), sd[sp + "up_proj.weight"].t()), 1))
        self.shared_w2 = _P(sd[sp + "down_proj.weight"].t())

    def route(self, x):
        b = _bug()
        logits = x.float() @ self.router
        scores = torch.softmax(logits, -1) if b == "af_router_softmax" else torch.sigmoid(logits)
        sel_scores = scores if b == "af_bias_not_in_selection" else scores + self.expert_bias
        idx = sel_scores.topk(self.k, -1).indices
        w = (sel_scores if b == "af_bias_in_weights" else scores).gather(-1, idx)
        if b == "af_route_scale_before_norm":
            w = w * self.route_scale
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        else:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * self.route_scale
        return w, idx

    def forward(self, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        w, idx = self.route(t)
        if _bug() == "experts_dense_bmm":
            dense = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)  # (T, E)
            gu = torch.bmm(t.unsqueeze(0).expand(self.E, -1, -1), self.w13)  # (E, T, 2I)
            g, u = gu.chunk(2, -1)
            y = torch.bmm(F.silu(g) * u, self.w2)  # (E, T, H)
            routed = torch.einsum("te,eth->th", dense, y)
        else:
            routed = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                g, u = (t[tok] @ self.w13[e]).chunk(2, -1)
                y = (F.silu(g) * u) @ self.w2[e]
                routed.index_add_(0, tok, y * w[tok, slot, None])
        g, u = (t @ self.shared_w13).chunk(2, -1)
        shared = (F.silu(g) * u) @ self.shared_w2
        out = (routed + shared).view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        if b == "af_layer_types_offbyone":
            self.sliding = i % cfg.global_attn_every_n_layers != 0
        else:
            self.sliding = cfg.layer_types[i] == "sliding_attention"
        self.use_rope = self.sliding or b == "af_rope_all_layers"
        eps = cfg.rms_norm_eps
        self.attention_norm = Norm(sd[p + "input_layernorm.weight"], eps)
        self.attn_out_norm = Norm(sd[p + "post_attention_layernorm.weight"], eps)
        self.ffn_norm = Norm(sd[p + "pre_mlp_layernorm.weight"], eps)
        self.ffn_out_norm = Norm(sd[p + "post_mlp_layernorm.weight"], eps)
        self.attention = Attention(sd, p + "self_attn.", cfg, self.use_rope)
        if i >= cfg.num_dense_layers:
            self.moe = MoE(sd, p + "mlp.", cfg)
        else:
            self.feed_forward = DenseFFN(sd, p + "mlp.")

    def forward(self, h, masks, cos, sin):
        b = _bug()
        a = self.attention(self.attention_norm(h), masks["sliding" if self.sliding else "full"], cos, sin)
        if b == "af_llama_norm_naming":
            h = h + a
            n = self.attn_out_norm(h)
        else:
            h = h + self.attn_out_norm(a)
            n = self.ffn_norm(h)
        f = self.moe(n) if hasattr(self, "moe") else self.feed_forward(n)
        h = h + self.ffn_out_norm(f)
        _rec(self.pre.rstrip("."), h)
        return h


class AfmoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.mup = bool(cfg.mup_enabled) and b != "af_mup_scale_missing"
        table = sd["model.embed_tokens.weight"].float()
        self.folded = b == "embed_mup_folded" and self.mup
        self.tok_embeddings = _P(table * math.sqrt(cfg.hidden_size) if self.folded else table)
        head = sd.get("lm_head.weight", table) if not cfg.tie_word_embeddings else table
        self.output = _P(head)
        self.layers = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(sd["model.norm.weight"], cfg.rms_norm_eps)
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _masks(self, keep):
        b = _bug()
        S = keep.shape[1]
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        causal = (ki <= qi)[None, None]
        near = (qi - ki < self.cfg.sliding_window)[None, None]
        pad = keep[:, None, None, :]
        full = causal & pad
        sliding = causal & near
        if b != "af_sliding_pad_mask_dropped":
            sliding = sliding & pad
        sliding = sliding.expand_as(full)
        fill = torch.finfo(torch.float32).min
        to_bias = lambda m: torch.zeros(m.shape).masked_fill(~m, fill)
        return {"full": to_bias(full), "sliding": to_bias(sliding)}

    def _core(self, input_ids, keep, pos):
        masks = self._masks(keep)
        h = self.tok_embeddings[input_ids]
        if not self.folded:
            _rec("model.embed_tokens", h)
            if self.mup:
                h = h * (self.cfg.hidden_size**0.5)
        ang = pos[..., None].float() * self.inv_freq
        emb = torch.cat((ang, ang), -1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            h = layer(h, masks, cos, sin)
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
    return AfmoePort(state_dict, config).eval()
