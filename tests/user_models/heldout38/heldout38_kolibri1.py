"""Hand-written plain-PyTorch port of Aleph Alpha's Kolibri-1 (Kolibri1ForCausalLM): a hybrid sliding/global
attention MoE decoder with "sandwich" RMSNorms, per-head QK-norm, RoPE on the sliding layers only (NoPE on the
global ones) and a sigmoid router with a selection-only correction bias plus an always-on shared expert.

Architecture as this port implements it (all in float32):
- rms(x; w) = w * x / sqrt(mean(x^2, last axis) + eps), eps = config.rms_norm_eps; the weight multiplies AFTER the
  normalisation (no "1 + w").
- h_0 = E[ids] (no embedding scaling); logits = rms(h_L; w_final) @ W_head^T (head untied from E).
- decoder layer i (layer type config.layer_types[i], "sliding_attention" or "full_attention"):
      a  = Attn_i(rms(h; w_attn_in))
      h  = h + rms(a; w_attn_out)                 (post-attention norm INSIDE the residual branch)
      m  = MoE_i(rms(h; w_ffn_in))
      h  = h + rms(m; w_ffn_out)                  (post-MoE norm over routed + shared output together)
  Transformers' names: w_attn_in = input_layernorm, w_attn_out = post_self_attn_layernorm,
  w_ffn_in = post_attention_layernorm (sic: the pre-MoE norm), w_ffn_out = post_mlp_layernorm.
- attention (GQA, nq = num_attention_heads query heads, nkv = num_key_value_heads, head_dim d = config.head_dim,
  which need not equal hidden / nq):
      q, k, v = x Wq^T, x Wk^T, x Wv^T split into heads of d
      q = rms_d(q; w_q), k = rms_d(k; w_k)        (QK-norm per head over d, BEFORE RoPE)
      sliding layers only: q, k = RoPE(q, k, positions), half-split ("rotate_half") convention,
          inv_freq_j = theta^(-2j/d), cos/sin of cat(pos * inv_freq, pos * inv_freq); global layers: no RoPE
      kv head of query head n is n // (nq / nkv) (repeat_interleave expansion)
      s = q k^T * d^-0.5 + mask, p = softmax(s) (float32), out = (p v) merged over heads, @ Wo^T
  mask: causal kv <= q; sliding layers also kv > q - window (window = config.sliding_window tokens, itself
  included); padded keys (attention_mask == 0) masked in both layer types; masked entries get finfo.min added.
  positions: position_ids if given, else 0..T-1.
- MoE (E = num_experts experts, top-k = num_experts_per_tok):
      l = x Wr^T (router logits, E per token)
      chosen = top-k of (l + b) with b = e_score_correction_bias (b is used for the CHOICE only)
      g = sigmoid(l[chosen]); if norm_topk_prob: g = g / sum(g)
      routed = sum_{e in chosen} g_e * (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T
      shared = (silu(x Sg^T) * (x Su^T)) Sd^T     (always on, no gate)
      MoE(x) = routed + shared

Weight layout of THIS port (own names; built from Transformers' tensors in build()):
- tok_emb (V, H); final_scale (H,); head_t (H, V) = lm_head.weight transposed; inv_freq buffer (d/2,) precomputed.
- blocks[i].norms (4, H): rows [attn_in, attn_out, ffn_in, ffn_out] stacked (see the name map above).
- blocks[i].attn.w_qkv_t (H, (nq + 2 nkv) d) = [Wq | Wk | Wv] fused and transposed;
  blocks[i].attn.w_o_t (nq d, H) transposed; blocks[i].attn.qk_scale (2, d) rows [q_norm, k_norm] stacked.
- blocks[i].moe.router_t (H, E) transposed; blocks[i].moe.sel_bias buffer (E,);
  blocks[i].moe.w_gate / w_up (E, H, I): gate_up_proj (E, 2I, H) split in halves [gate; up] and transposed;
  blocks[i].moe.w_down (E, I, H) transposed;
  blocks[i].moe.shared (a ParameterDict): "gate_up_t" (H, 2S) = [gate_proj | up_proj] fused and transposed,
  "down_t" (S, H) transposed.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "norm_names_swapped",  # load: post_attention_layernorm taken as the post-attention output norm and
    #   post_self_attn_layernorm as the pre-MoE norm (GLM-4 naming read literally): the two weights trade places
    "post_attn_norm_after_residual",  # post-attention norm applied to (h + attn) after the residual add, not to attn
    "shared_expert_after_post_norm",  # post-MoE norm applied to the routed output only; shared expert added after it
    "qk_norm_after_rope",  # per-head QK-norm applied after RoPE instead of before it
    "rope_on_global_layers",  # RoPE applied in every layer: the NoPE of the full-attention layers missed
    "rope_interleaved",  # RoPE rotates adjacent pairs (2j, 2j+1) (GPT-J / llama.cpp "normal" style), not halves
    "window_off_by_one",  # sliding window keeps kv >= q - window (window + 1 tokens) instead of kv > q - window
    "gqa_tiled",  # KV heads expanded by tiling (query head n uses kv head n % nkv) instead of repeat_interleave
    "scale_hidden_over_heads",  # attention scale from hidden_size // num_heads (16) instead of config.head_dim (32)
    "router_select_on_sigmoid",  # DeepSeek-V3 habit: top-k chosen on sigmoid(logits) + bias, not on logits + bias
    "router_bias_in_weights",  # correction bias also added to the gate values: sigmoid(l + b) instead of sigmoid(l)
    "topk_not_renormalised",  # norm_topk_prob ignored: the k sigmoid gates are not divided by their sum
    "gate_up_halves_swapped",  # load: fused gate_up_proj split as [up; gate] instead of [gate; up]
    "sliding_mask_no_padding",  # padding mask merged into the global layers' mask only, not the sliding layers'
]
PADDING_ONLY = ["sliding_mask_no_padding"]
CLEAN = [
    "clean_sdpa",  # attention through F.scaled_dot_product_attention (same additive mask, explicit scale)
    "clean_gqa_grouped",  # GQA without expanding K/V: queries reshaped to (B, nkv, group, T, d) and batched
    "clean_rope_complex",  # RoPE as a complex product: (first half + i * second half) * exp(i * pos * inv_freq)
    "clean_dense_moe",  # every expert run on every token, combined with a dense (tokens, E) gate matrix (0 off top-k)
    "clean_fold_norm",  # attn_in RMSNorm weight folded into the rows of w_qkv_t at load (unit-weight norm at run)
]


def _bug(name):
    return BUG == name


def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_half(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope_pairs(x, cos, sin):
    # adjacent-pair rotation; cos/sin of shape (..., d) = cat(f, f): use the first half, repeated per pair
    h = x.shape[-1] // 2
    c = cos[..., :h].repeat_interleave(2, dim=-1)
    s = sin[..., :h].repeat_interleave(2, dim=-1)
    xe, xo = x[..., 0::2], x[..., 1::2]
    rot = torch.stack((-xo, xe), dim=-1).flatten(-2)
    return x * c + rot * s


def _rope_complex(x, angles):
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h].double(), x[..., h:].double()) * torch.polar(
        torch.ones_like(angles, dtype=torch.float64), angles.double()
    )
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, nq, nkv, d, hidden, sliding, window, use_rope, eps, scale):
        super().__init__()
        self.nq, self.nkv, self.d = nq, nkv, d
        self.sliding, self.window, self.use_rope, self.eps, self.scale = sliding, window, use_rope, eps, scale
        self.w_qkv_t = nn.Parameter(torch.empty(hidden, (nq + 2 * nkv) * d))
        self.w_o_t = nn.Parameter(torch.empty(nq * d, hidden))
        self.qk_scale = nn.Parameter(torch.empty(2, d))

    def forward(self, x, cos, sin, angles, mask):
        b, t, _ = x.shape
        nq, nkv, d = self.nq, self.nkv, self.d
        qkv = x @ self.w_qkv_t
        q, k, v = qkv.split((nq * d, nkv * d, nkv * d), dim=-1)
        q = q.view(b, t, nq, d).transpose(1, 2)
        k = k.view(b, t, nkv, d).transpose(1, 2)
        v = v.view(b, t, nkv, d).transpose(1, 2)
        if not _bug("qk_norm_after_rope"):
            q = _rms(q, self.qk_scale[0], self.eps)
            k = _rms(k, self.qk_scale[1], self.eps)
        if self.use_rope:
            if _bug("rope_interleaved"):
                q, k = _rope_pairs(q, cos, sin), _rope_pairs(k, cos, sin)
            elif _bug("clean_rope_complex"):
                q, k = _rope_complex(q, angles), _rope_complex(k, angles)
            else:
                q, k = _rope_half(q, cos, sin), _rope_half(k, cos, sin)
        if _bug("qk_norm_after_rope"):
            q = _rms(q, self.qk_scale[0], self.eps)
            k = _rms(k, self.qk_scale[1], self.eps)
        g = nq // nkv
        if _bug("clean_gqa_grouped"):
            qg = q.view(b, nkv, g, t, d)
            s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * self.scale + mask.unsqueeze(1)
            p = torch.softmax(s, dim=-1, dtype=torch.float32)
            o = torch.matmul(p, v.unsqueeze(2)).reshape(b, nq, t, d)
        else:
            if _bug("gqa_tiled"):
                k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            else:
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            if _bug("clean_sdpa"):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            else:
                s = torch.matmul(q, k.transpose(-1, -2)) * self.scale + mask
                p = torch.softmax(s, dim=-1, dtype=torch.float32)
                o = torch.matmul(p, v)
        o = o.transpose(1, 2).reshape(b, t, nq * d)
        return o @ self.w_o_t


class MoE(nn.Module):
    def __init__(self, hidden, n_exp, top_k, inter, shared_inter, renorm):
        super().__init__()
        self.n_exp, self.top_k, self.renorm = n_exp, top_k, renorm
        self.router_t = nn.Parameter(torch.empty(hidden, n_exp))
        self.register_buffer("sel_bias", torch.zeros(n_exp))
        self.w_gate = nn.Parameter(torch.empty(n_exp, hidden, inter))
        self.w_up = nn.Parameter(torch.empty(n_exp, hidden, inter))
        self.w_down = nn.Parameter(torch.empty(n_exp, inter, hidden))
        self.shared = nn.ParameterDict(
            {
                "gate_up_t": nn.Parameter(torch.empty(hidden, 2 * shared_inter)),
                "down_t": nn.Parameter(torch.empty(shared_inter, hidden)),
            }
        )

    def shared_out(self, x):
        gate, up = (x @ self.shared["gate_up_t"]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.shared["down_t"]

    def route(self, x):
        x = x.reshape(-1, x.shape[-1])
        logits = x.float() @ self.router_t.float()
        if _bug("router_select_on_sigmoid"):
            chosen = torch.topk(torch.sigmoid(logits) + self.sel_bias, self.top_k, dim=-1).indices
        else:
            chosen = torch.topk(logits + self.sel_bias, self.top_k, dim=-1).indices
        if _bug("router_bias_in_weights"):
            gates = torch.sigmoid(logits + self.sel_bias).gather(1, chosen)
        else:
            gates = torch.sigmoid(logits.gather(1, chosen))
        if self.renorm:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return logits, gates, chosen

    def routed_out(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, gates, chosen = self.route(x)
        if _bug("clean_dense_moe"):
            dense = torch.zeros_like(logits).scatter(1, chosen, gates)  # (N, E)
            hg = torch.einsum("nh,ehi->eni", x, self.w_gate)
            hu = torch.einsum("nh,ehi->eni", x, self.w_up)
            y = torch.einsum("eni,eih->enh", F.silu(hg) * hu, self.w_down)
            out = torch.einsum("enh,ne->nh", y, dense)
            return out.reshape(shape)
        out = torch.zeros_like(x)
        for e in range(self.n_exp):
            rows, slot = torch.where(chosen == e)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            ye = (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
            out.index_add_(0, rows, ye * gates[rows, slot, None])
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, attn, moe, hidden, eps):
        super().__init__()
        self.attn, self.moe, self.eps = attn, moe, eps
        self.norms = nn.Parameter(torch.empty(4, hidden))

    def forward(self, h, cos, sin, angles, mask):
        w = self.norms
        if _bug("clean_fold_norm"):
            x = _rms(h, torch.ones_like(w[0]), self.eps)
        else:
            x = _rms(h, w[0], self.eps)
        a = self.attn(x, cos, sin, angles, mask)
        if _bug("post_attn_norm_after_residual"):
            h = _rms(h + a, w[1], self.eps)
        else:
            h = h + _rms(a, w[1], self.eps)
        x = _rms(h, w[2], self.eps)
        if _bug("shared_expert_after_post_norm"):
            h = h + _rms(self.moe.routed_out(x), w[3], self.eps) + self.moe.shared_out(x)
        else:
            h = h + _rms(self.moe.routed_out(x) + self.moe.shared_out(x), w[3], self.eps)
        return h


class Kolibri1Port(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config
        hidden, nq, nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        d = getattr(c, "head_dim", None) or hidden // nq
        self.eps = c.rms_norm_eps
        self.window = c.sliding_window
        self.layer_types = list(c.layer_types)
        theta = c.rope_parameters["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), False)
        scale = (hidden // nq) ** -0.5 if _bug("scale_hidden_over_heads") else d**-0.5
        renorm = bool(c.norm_topk_prob) and not _bug("topk_not_renormalised")
        blocks = []
        for i, kind in enumerate(self.layer_types):
            sliding = kind == "sliding_attention"
            use_rope = self.window is None or sliding or _bug("rope_on_global_layers")
            attn = Attention(nq, nkv, d, hidden, sliding, self.window, use_rope, self.eps, scale)
            moe = MoE(
                hidden,
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
                renorm,
            )
            blocks.append(Block(attn, moe, hidden, self.eps))
        self.blocks = nn.ModuleList(blocks)
        self.tok_emb = nn.Parameter(torch.empty(c.vocab_size, hidden))
        self.final_scale = nn.Parameter(torch.empty(hidden))
        self.head_t = nn.Parameter(torch.empty(hidden, c.vocab_size))

    def _mask(self, b, t, attention_mask, sliding, device):
        qi = torch.arange(t, device=device)[:, None]
        ki = torch.arange(t, device=device)[None, :]
        keep = (ki <= qi).expand(b, 1, t, t)
        if sliding and self.window is not None:
            if _bug("window_off_by_one"):
                keep = keep & (ki >= qi - self.window)
            else:
                keep = keep & (ki > qi - self.window)
        if attention_mask is not None and not (sliding and _bug("sliding_mask_no_padding")):
            keep = keep & attention_mask.bool()[:, None, None, :]
        neg = torch.finfo(torch.float32).min
        return torch.zeros(keep.shape, dtype=torch.float32, device=device).masked_fill(~keep, neg)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(t, device=dev)[None].expand(b, t)
        angles = position_ids[..., None].float() * self.inv_freq  # (B, T, d/2)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # (B, 1, T, d)
        angles = angles[:, None]
        masks = {
            "sliding_attention": self._mask(b, t, attention_mask, True, dev),
            "full_attention": self._mask(b, t, attention_mask, False, dev),
        }
        h = self.tok_emb[input_ids]
        for kind, blk in zip(self.layer_types, self.blocks):
            h = blk(h, cos, sin, angles, masks[kind])
        h = _rms(h, self.final_scale, self.eps)
        return (h @ self.head_t).float()


@torch.no_grad()
def build(state_dict, config):
    sd = {k: v.float() for k, v in state_dict.items()}
    model = Kolibri1Port(config)
    model.tok_emb.copy_(sd["model.embed_tokens.weight"])
    model.final_scale.copy_(sd["model.norm.weight"])
    model.head_t.copy_(sd["lm_head.weight"].t())
    for i, blk in enumerate(model.blocks):
        p = f"model.layers.{i}."
        attn_out, ffn_in = sd[p + "post_self_attn_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]
        if _bug("norm_names_swapped"):
            attn_out, ffn_in = ffn_in, attn_out
        attn_in = sd[p + "input_layernorm.weight"]
        blk.norms.copy_(torch.stack([attn_in, attn_out, ffn_in, sd[p + "post_mlp_layernorm.weight"]]))
        a = p + "self_attn."
        w_qkv = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]], dim=0).t()
        if _bug("clean_fold_norm"):
            w_qkv = attn_in[:, None] * w_qkv
        blk.attn.w_qkv_t.copy_(w_qkv)
        blk.attn.w_o_t.copy_(sd[a + "o_proj.weight"].t())
        blk.attn.qk_scale.copy_(torch.stack([sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]]))
        m = p + "mlp."
        blk.moe.router_t.copy_(sd[m + "gate.weight"].t())
        blk.moe.sel_bias.copy_(sd[m + "gate.e_score_correction_bias"])
        gate, up = sd[m + "experts.gate_up_proj"].chunk(2, dim=1)  # (E, I, H) each
        if _bug("gate_up_halves_swapped"):
            gate, up = up, gate
        blk.moe.w_gate.copy_(gate.transpose(1, 2))
        blk.moe.w_up.copy_(up.transpose(1, 2))
        blk.moe.w_down.copy_(sd[m + "experts.down_proj"].transpose(1, 2))
        s = m + "shared_experts."
        blk.moe.shared["gate_up_t"].copy_(torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]]).t())
        blk.moe.shared["down_t"].copy_(sd[s + "down_proj.weight"].t())
    return model.eval()
