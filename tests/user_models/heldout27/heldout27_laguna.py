"""Hand-written plain-PyTorch port of Laguna (LagunaForCausalLM, Poolside).

Architecture as this port implements it (what differs from Llama is marked *):
  - token embedding, no scaling; untied output head; Llama RMSNorm y = w * x / sqrt(mean(x^2) + rms_norm_eps),
    two pre-norms per block, final norm:  h = h + Attn(RMS_in(h));  h = h + FFN(RMS_post(h));
  * PER-LAYER query head count (config.num_attention_heads_per_layer), head_dim from config.head_dim, a fixed
    num_key_value_heads: query head h reads kv head h // (nh_layer / nkv); scores * head_dim^-0.5;
  * per-head q / k RMSNorm (gain over head_dim) BEFORE RoPE;
  * per-layer attention kind from config.layer_types: "full_attention" (causal) or "sliding_attention" (causal AND
    key index > query index - sliding_window);
  * RoPE per layer type (config.rope_parameters[layer_type]): its own rope_theta and partial_rotary_factor: only the
    first int(head_dim * factor) channels of each q / k head rotated (half-split form), the rest passed through;
  * softplus OUTPUT GATE: g = softplus(g_proj(RMS_in(h))) one value per head (gating=True), multiplying that head's
    attention output before o_proj;
  * FFN from config.mlp_layer_types: "dense" SwiGLU (intermediate_size, layer 0 here) or "sparse" MoE:
      logits = x W_r^T in fp32, SOFTCAPPED: c * tanh(logits / c), c = moe_router_logit_softcapping;
      scores = sigmoid(logits); choice = scores + e_score_correction_bias; top-k by choice;
      weights = raw scores of the chosen experts renormalised to sum 1; routed output * moe_routed_scaling_factor;
      plus an always-on SwiGLU shared expert (shared_expert_intermediate_size), NOT scaled;
  - padding: HF-style 0/1 attention_mask masks keys in both full and sliding masks (additive finfo.min);
    position_ids as given, else 0..S-1.

Weight layout of this port (own names):
  tok (V, H); out (V, H) (F.linear layout); g_out (H,);
  blocks[i].g1 / g2 (H,);
  attn.w_qkvg (nh hd + 2 nkv hd + nh, H) F.linear layout, rows [q | k | v | g]; attn.qn / kn (hd,);
  attn.w_o (nh hd, H) (in, out);
  dense ffn.w_gu (H, 2 I) (in, out) columns [gate | up]; ffn.w_dn (I, H);
  moe.w_r (E, H); moe.e_bias (E,); moe.w_gu (E, H, 2 Ie) (in, out) columns [gate | up]; moe.w_dn (E, Ie, H);
  moe.shared: same layout as the dense FFN.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "lg_gate_sigmoid",  # output gate squashed with sigmoid instead of softplus
    "lg_gate_from_residual",  # gate computed from the un-normalised residual stream instead of RMS_in(h)
    "lg_kv_heads_tiled",  # query head h reads kv head h % nkv instead of h // (nh_layer / nkv)
    "lg_softcap_missing",  # router logits not softcapped (moe_router_logit_softcapping ignored)
    "lg_softcap_after_sigmoid",  # softcap applied to the sigmoid scores instead of the raw logits
    "lg_router_bias_in_weights",  # expert weights gathered from the bias-corrected choice scores
    "lg_routed_scale_on_shared",  # moe_routed_scaling_factor applied after adding the shared expert
    "lg_partial_rope_full",  # partial_rotary_factor ignored: full-attention layers rotate the whole head_dim
    "lg_rope_theta_single",  # one RoPE table: sliding layers use the full-attention rope parameters
    "lg_qk_norm_after_rope",  # q / k RMSNorm applied after RoPE instead of before
    "lg_window_off_by_one",  # sliding mask keeps key index >= q - window: window + 1 keys
    "lg_experts_gate_up_swapped",  # fused experts.gate_up_proj read as [up | gate] instead of [gate | up]
    "lg_sliding_pad_ignored",  # padding merged into the full-attention mask only; sliding layers see pad keys
]
PADDING_ONLY = {"lg_sliding_pad_ignored"}
CLEAN = [
    "lg_sdpa",  # attention via F.scaled_dot_product_attention with a boolean mask
    "lg_dense_experts",  # every expert run on every token, combined with a dense (T, E) weight matrix
    "lg_rowwise",  # a padded batch run row by row on its real tokens only, with their own positions
    "lg_gate_after_oproj",  # o_proj applied per head, each head's contribution then scaled by its gate and summed
    "lg_window_by_positions",  # sliding window from position_ids differences instead of indices (same for left pad)
]


def _bug():
    return BUG


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, cos, sin):
    rd = cos.shape[-1] * 2
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xp), -1)


class _SwiGLU(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.w_gu = nn.Parameter(torch.cat((sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]), 0).t().contiguous())
        self.w_dn = nn.Parameter(sd[p + "down_proj.weight"].t().contiguous())

    def forward(self, x):
        g, u = (x @ self.w_gu).chunk(2, -1)
        return (F.silu(g) * u) @ self.w_dn


class _Attn(nn.Module):
    def __init__(self, sd, p, cfg, nh, kind):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, cfg.num_key_value_heads, cfg.head_dim
        self.kind = kind
        self.eps = cfg.rms_norm_eps
        self.w_qkvg = nn.Parameter(
            torch.cat([sd[p + n + "_proj.weight"] for n in ("q", "k", "v", "g")], 0).contiguous()
        )
        self.qn = nn.Parameter(sd[p + "q_norm.weight"].clone())
        self.kn = nn.Parameter(sd[p + "k_norm.weight"].clone())
        self.w_o = nn.Parameter(sd[p + "o_proj.weight"].t().contiguous())

    def forward(self, h, resid, cos, sin, keep):
        b = _bug()
        B, S, _ = h.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q, k, v, g = F.linear(h, self.w_qkvg).split([nq, nk, nk, self.nh], -1)
        if b == "lg_gate_from_residual":
            g = F.linear(resid, self.w_qkvg[-self.nh :])
        q = q.view(B, S, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.nkv, self.hd).transpose(1, 2)
        if b == "lg_qk_norm_after_rope":
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            q, k = _rms(q, self.qn, self.eps), _rms(k, self.kn, self.eps)
        else:
            q, k = _rms(q, self.qn, self.eps), _rms(k, self.kn, self.eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.nh // self.nkv
        if b == "lg_kv_heads_tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if b == "lg_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            sc = (q @ k.transpose(-1, -2)) * self.hd**-0.5
            sc = sc + torch.zeros_like(sc).masked_fill(~keep, torch.finfo(sc.dtype).min)
            o = torch.softmax(sc, -1) @ v  # (B, nh, S, hd)
        gate = torch.sigmoid(g) if b == "lg_gate_sigmoid" else F.softplus(g)  # (B, S, nh)
        o = o.transpose(1, 2)  # (B, S, nh, hd)
        if b == "lg_gate_after_oproj":
            per_head = torch.einsum("bshd,hdo->bsho", o, self.w_o.view(self.nh, self.hd, -1))
            return (per_head * gate[..., None]).sum(2)
        return (o * gate[..., None]).reshape(B, S, nq) @ self.w_o


class _MoE(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.E, self.k = cfg.num_experts, cfg.num_experts_per_tok
        self.cap = float(cfg.moe_router_logit_softcapping)
        self.scale = float(cfg.moe_routed_scaling_factor)
        self.w_r = nn.Parameter(sd[p + "gate.weight"].clone())
        self.register_buffer("e_bias", sd[p + "gate.e_score_correction_bias"].clone())
        gu = sd[p + "experts.gate_up_proj"]  # (E, 2 Ie, H) rows [gate | up]
        if _bug() == "lg_experts_gate_up_swapped":
            gu = torch.cat(gu.chunk(2, 1)[::-1], 1)
        self.w_gu = nn.Parameter(gu.transpose(1, 2).contiguous())
        self.w_dn = nn.Parameter(sd[p + "experts.down_proj"].transpose(1, 2).contiguous())
        self.shared = _SwiGLU(sd, p + "shared_experts.")

    def _expert(self, x, e):
        g, u = (x @ self.w_gu[e]).chunk(2, -1)
        return (F.silu(g) * u) @ self.w_dn[e]

    def forward(self, h):
        b = _bug()
        shp = h.shape
        x = h.reshape(-1, shp[-1])
        logits = (x @ self.w_r.t()).float()
        if self.cap > 0 and b not in ("lg_softcap_missing", "lg_softcap_after_sigmoid"):
            logits = self.cap * torch.tanh(logits / self.cap)
        scores = torch.sigmoid(logits)
        if b == "lg_softcap_after_sigmoid":
            scores = self.cap * torch.tanh(scores / self.cap)
        choice = scores + self.e_bias
        idx = choice.topk(self.k, -1).indices
        wts = (choice if b == "lg_router_bias_in_weights" else scores).gather(1, idx)
        wts = wts / wts.sum(-1, keepdim=True)
        if b == "lg_dense_experts":
            dense = torch.zeros(x.shape[0], self.E).scatter_(1, idx, wts)
            g, u = torch.einsum("th,ehi->tei", x, self.w_gu).chunk(2, -1)
            routed = torch.einsum("tei,eih,te->th", F.silu(g) * u, self.w_dn, dense)
        else:
            routed = torch.zeros_like(x)
            for e in range(self.E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel():
                    routed.index_add_(0, tok, self._expert(x[tok], e) * wts[tok, slot, None])
        shared = self.shared(x)
        if b == "lg_routed_scale_on_shared":
            out = (routed + shared) * self.scale
        else:
            out = routed * self.scale + shared
        return out.view(shp)


class _Block(nn.Module):
    def __init__(self, sd, i, cfg):
        super().__init__()
        p = f"model.layers.{i}."
        self.kind = cfg.layer_types[i]
        self.g1 = nn.Parameter(sd[p + "input_layernorm.weight"].clone())
        self.g2 = nn.Parameter(sd[p + "post_attention_layernorm.weight"].clone())
        self.attn = _Attn(sd, p + "self_attn.", cfg, cfg.num_attention_heads_per_layer[i], self.kind)
        if cfg.mlp_layer_types[i] == "sparse":
            self.ffn = _MoE(sd, p + "mlp.", cfg)
        else:
            self.ffn = _SwiGLU(sd, p + "mlp.")


class LagunaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window
        self.tok = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.out = nn.Parameter(sd["lm_head.weight"].clone())
        self.g_out = nn.Parameter(sd["model.norm.weight"].clone())
        self.blocks = nn.ModuleList(_Block(sd, i, cfg) for i in range(cfg.num_hidden_layers))
        for kind in set(cfg.layer_types):
            rp = cfg.rope_parameters["full_attention" if _bug() == "lg_rope_theta_single" else kind]
            frac = rp.get("partial_rotary_factor", 1.0)
            if _bug() == "lg_partial_rope_full":
                frac = 1.0
            d = int(cfg.head_dim * frac)
            inv = 1.0 / rp["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
            self.register_buffer(f"inv_{kind}", inv, False)

    def _run(self, ids, mask, pos):
        b = _bug()
        B, S = ids.shape
        x = self.tok[ids]
        if pos is None:
            pos = torch.arange(S)[None].expand(B, S)
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        causal = (ki <= qi)[None, None].expand(B, 1, S, S)
        if b == "lg_window_by_positions":
            dist = pos[:, None, :, None] - pos[:, None, None, :]
            win = dist < self.window
        elif b == "lg_window_off_by_one":
            win = (ki >= qi - self.window)[None, None]
        else:
            win = (ki > qi - self.window)[None, None]
        padk = torch.ones(B, 1, 1, S, dtype=torch.bool) if mask is None else mask.bool()[:, None, None, :]
        keeps = {
            "full_attention": causal & padk,
            "sliding_attention": causal & win & (True if b == "lg_sliding_pad_ignored" else padk),
        }
        rope = {}
        for kind in keeps:
            ang = pos[:, None, :, None].float() * getattr(self, f"inv_{kind}")
            rope[kind] = (ang.cos(), ang.sin())
        for blk in self.blocks:
            h = _rms(x, blk.g1, self.eps)
            x = x + blk.attn(h, x, *rope[blk.kind], keeps[blk.kind])
            x = x + blk.ffn(_rms(x, blk.g2, self.eps))
        return _rms(x, self.g_out, self.eps) @ self.out.t()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if _bug() == "lg_rowwise" and attention_mask is not None:
            out = torch.zeros(*input_ids.shape, self.out.shape[0])
            for r in range(input_ids.shape[0]):
                idx = attention_mask[r].bool().nonzero().squeeze(-1)
                pos = None if position_ids is None else position_ids[r : r + 1, idx]
                out[r, idx] = self._run(input_ids[r : r + 1, idx], None, pos)[0]
            return out
        return self._run(input_ids, attention_mask, position_ids).float()


def build(state_dict, config):
    return LagunaPort(state_dict, config).eval()
