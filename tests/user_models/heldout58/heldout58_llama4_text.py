"""A from-scratch PyTorch port of Llama 4's text decoder (Transformers model type ``llama4_text``,
``Llama4ForCausalLM``), written from the architecture alone: plain torch, no Transformers code.

Architecture (sizes from the config: H = hidden_size, nh = num_attention_heads, nkv = num_key_value_heads,
d = head_dim, E = num_local_experts, I = intermediate_size, Im = intermediate_size_mlp, C = attention_chunk_size,
B batch, T sequence length):

    x_0 = Embed[input_ids]                                                       (B, T, H)
    for each layer l:
        h   = x + Attn_l(RMSNorm(x; g_attn))
        x'  = h + FFN_l(RMSNorm(h; g_ffn))
    logits = RMSNorm(x_L; g_final) @ W_unembed                                   (B, T, V)

  RMSNorm(x; g) = g * x / sqrt(mean(x^2, -1) + eps),  eps = rms_norm_eps.

  Layer kinds (read from the config):
    * use_rope_l = no_rope_layers[l] == 1  (1 means "this layer USES RoPE"; 0 means a NoPE layer);
      by default no_rope_layers[l] = int((l + 1) % no_rope_layer_interval != 0): every interval-th layer is NoPE.
    * layer_types[l]: "chunked_attention" on RoPE layers (when C is set), "full_attention" on NoPE layers.
    * MoE on the layers in moe_layers (= interleave_moe_layer_step-1, +step, ...), a dense SwiGLU MLP (Im) elsewhere.

  Attention (GQA, nh query heads share nkv key/value heads, head h reads kv head h // (nh / nkv)):
    q, k, v = x @ Wq, x @ Wk, x @ Wv  ->  (B, T, nh, d), (B, T, nkv, d), (B, T, nkv, d)
    RoPE layers:
      - RoPE as a complex product on ADJACENT pairs (2i, 2i+1) of each head:
            (q_2i + j q_2i+1) * exp(j * p * theta^(-2i/d)),  p = position_ids (arange when none);
      - use_qk_norm: a weightless RMS ("L2Norm") over d of q and k after RoPE: q / sqrt(mean(q^2) + eps).
    NoPE layers, attn_temperature_tuning:
      q *= 1 + attn_scale * log1p(floor((t + 1) / floor_scale)),  t = 0..T-1 the row index (not position_ids).
    scores = q k^T / sqrt(d) + mask;  out = softmax(scores) v;  Attn = out (B, T, nh*d) @ Wo.
    Masks (key j allowed for query i):  j <= i  and  attention_mask[b, j] == 1  and, on chunked layers,
      (j - lp_b) // C == (i - lp_b) // C  with lp_b the number of left-padding tokens of row b
      (chunks start at each row's first real token). Disallowed scores get float32 min (finite, like an
      additive mask) so fully masked padding rows stay finite.

  Dense FFN:  (silu(x Wg) * (x Wu)) Wd,  width Im.
  MoE FFN (per token x):
    logits_r = x @ Wr (E);  top-k of the logits;  s_e = sigmoid(logit_e) for a chosen e, 0 otherwise;
    routed   = sum_e  Expert_e(s_e * x)   (the score scales the expert INPUT);  Expert_e(y) = (silu(y Gg_e) * (y Gu_e)) Gd_e;
    FFN      = Shared(x) + routed,        Shared = SwiGLU of width I.

Weight layout (mine, converted from the checkpoint in ``build``; every matrix stored in -> out, i.e. transposed):
    embed        (V, H)                     token table
    unembed      (H, V)                     lm_head transposed
    final_norm   (H,)
    blocks[l]    (a ``_Block`` per layer):
        norm_attn, norm_ffn     (H,)
        qkv        (H, (nh + 2 nkv) d)      q | k | v fused along the output axis
        out        (nh d, H)
      dense layers:
        mlp_in     (H, 2 Im)                gate | up fused
        mlp_out    (Im, H)
      MoE layers:
        route      (H, E)
        ex_gate    (E, H, I)                the fused experts' gate_up_proj split into gate ...
        ex_up      (E, H, I)                ... and up halves (first half is the gate)
        ex_down    (E, I, H)
        sh_in      (H, 2 I)                 shared expert gate | up fused
        sh_out     (I, H)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_half_split",  # RoPE rotates dims (i, i + d/2) (rotate_half / NeoX style) instead of Llama 4's adjacent pairs (2i, 2i+1)
    "no_rope_flag_inverted",  # reads no_rope_layers[l] == 1 as "skip RoPE" (the field's name) when 1 means the layer USES RoPE
    "qk_norm_on_nope",  # applies the q/k L2Norm on every layer, NoPE layers included (it only exists on RoPE layers)
    "qk_norm_true_l2",  # qk "L2Norm" divides by the Euclidean norm sqrt(sum q^2) instead of the RMS sqrt(mean q^2): sqrt(d) too small
    "temp_off_by_one",  # temperature tuning uses floor(t / floor_scale) instead of floor((t + 1) / floor_scale)
    "temp_scales_k_too",  # temperature tuning multiplies both q and k, squaring the NoPE layers' temperature
    "chunk_as_sliding_window",  # chunked attention done as a sliding window of C keys instead of fixed non-overlapping chunks
    "chunk_ignores_left_padding",  # chunk boundaries counted from index 0, not from each row's first real token (left padding)
    "full_mask_drops_padding",  # the NoPE/full-attention layers get a plain causal mask; padding only merged into the chunked mask
    "gqa_tiled_heads",  # kv heads expanded with repeat (tiled: head h -> kv h % nkv) instead of repeat_interleave (h // groups)
    "router_softmax",  # routing weight = softmax over all expert logits (Mixtral style) instead of sigmoid of the chosen logit
    "score_on_expert_output",  # router score multiplies the expert's OUTPUT instead of scaling its input
    "gate_up_halves_swapped",  # build splits the experts' fused gate_up_proj as (up, gate) instead of (gate, up)
    "rope_angles_bf16",  # RoPE angle table p * inv_freq computed in bfloat16 instead of float32
]

PADDING_ONLY = [
    "chunk_ignores_left_padding",
    "full_mask_drops_padding",
]

CLEAN = [
    "qk_norm_before_rope",  # L2Norm applied before RoPE: a rotation preserves each head's RMS, so the order does not matter
    "sigmoid_then_topk",  # sigmoid of every router logit, then top-k of the probabilities (sigmoid is monotonic)
    "rope_complex",  # RoPE via torch complex numbers (view_as_complex * polar) instead of real cos/sin on even/odd lanes
    "sdpa_attention",  # attention through F.scaled_dot_product_attention with an additive float mask and scale=1/sqrt(d)
    "sparse_expert_loop",  # experts run per expert on their routed tokens only (index_add back) instead of dense bmm over all
]


def _bug():
    return BUG


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _qk_norm(x, eps):
    if _bug() == "qk_norm_true_l2":
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    return _rms(x, eps)


def _swiglu(x, w_in, w_out):
    gate, up = (x @ w_in).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_out


def _rope_angles(position_ids, head_dim, theta):
    """(B, T, d/2) angles p * theta^(-2i/d)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if _bug() == "rope_angles_bf16":
        return (position_ids.to(torch.bfloat16)[..., None] * inv_freq.to(torch.bfloat16)).float()
    return position_ids.float()[..., None] * inv_freq


def _apply_rope(x, angles):
    """x (B, T, n, d); angles (B, T, d/2)."""
    bug = _bug()
    if bug == "rope_half_split":
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, :, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, :, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], -1) * sin
    if bug == "rope_complex":
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rot = torch.polar(torch.ones_like(angles), angles)[:, :, None, :]
        return torch.view_as_real(xc * rot).flatten(3).type_as(x)
    cos = angles.cos()[:, :, None, :]
    sin = angles.sin()[:, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out_even = even * cos - odd * sin
    out_odd = even * sin + odd * cos
    return torch.stack([out_even, out_odd], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------------------------
# model


class _Block(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.idx = idx
        self.no_rope_flag = int(cfg.no_rope_layers[idx])
        self.chunked = cfg.layer_types[idx] == "chunked_attention"
        self.moe = idx in cfg.moe_layers
        self.norm_attn = nn.Parameter(torch.ones(H))
        self.norm_ffn = nn.Parameter(torch.ones(H))
        self.qkv = nn.Parameter(torch.zeros(H, (nh + 2 * nkv) * d))
        self.out = nn.Parameter(torch.zeros(nh * d, H))
        if self.moe:
            E, I = cfg.num_local_experts, cfg.intermediate_size
            self.route = nn.Parameter(torch.zeros(H, E))
            self.ex_gate = nn.Parameter(torch.zeros(E, H, I))
            self.ex_up = nn.Parameter(torch.zeros(E, H, I))
            self.ex_down = nn.Parameter(torch.zeros(E, I, H))
            self.sh_in = nn.Parameter(torch.zeros(H, 2 * I))
            self.sh_out = nn.Parameter(torch.zeros(I, H))
        else:
            Im = cfg.intermediate_size_mlp
            self.mlp_in = nn.Parameter(torch.zeros(H, 2 * Im))
            self.mlp_out = nn.Parameter(torch.zeros(Im, H))

    def use_rope(self):
        if _bug() == "no_rope_flag_inverted":
            return self.no_rope_flag == 0
        return self.no_rope_flag == 1


class Llama4TextPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.H = cfg.hidden_size
        self.d = cfg.head_dim
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.eps = cfg.rms_norm_eps
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 500000.0)))
        self.chunk = cfg.attention_chunk_size
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, self.H))
        self.unembed = nn.Parameter(torch.zeros(self.H, cfg.vocab_size))
        self.final_norm = nn.Parameter(torch.ones(self.H))
        self.blocks = nn.ModuleList([_Block(cfg, i) for i in range(cfg.num_hidden_layers)])

    # -- masks ---------------------------------------------------------------------------------------------------
    def _masks(self, attention_mask, B, T, device):
        """Boolean allowed-masks (B, 1, T, T) for full and chunked layers."""
        i = torch.arange(T, device=device)
        causal = (i[None, :] <= i[:, None])[None, None]  # (1,1,T,T)  [q, kv]
        if attention_mask is None:
            keep = torch.ones(B, T, dtype=torch.bool, device=device)
        else:
            keep = attention_mask.to(torch.bool)
        pad = keep[:, None, None, :]  # (B,1,1,T)
        lp = (keep.long().cumsum(-1) == 0).sum(-1)  # left padding per row
        bug = _bug()
        if bug == "chunk_ignores_left_padding":
            lp = torch.zeros_like(lp)
        rel = i[None, :] - lp[:, None]  # (B, T)
        C = self.chunk
        if bug == "chunk_as_sliding_window":
            chunk_ok = (i[:, None] - i[None, :] < C)[None, None]
        else:
            cq = torch.div(rel, C, rounding_mode="floor")
            chunk_ok = (cq[:, :, None] == cq[:, None, :])[:, None]  # (B,1,T,T)
        full = causal & pad
        if bug == "full_mask_drops_padding":
            full = causal.expand(B, 1, T, T)
        chunked = causal & pad & chunk_ok
        return full, chunked

    # -- attention -----------------------------------------------------------------------------------------------
    def _attention(self, blk, x, angles, allowed):
        B, T, _ = x.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        bug = _bug()
        q, k, v = (x @ blk.qkv).split([nh * d, nkv * d, nkv * d], dim=-1)
        q = q.view(B, T, nh, d)
        k = k.view(B, T, nkv, d)
        v = v.view(B, T, nkv, d)
        use_rope = blk.use_rope()
        has_qk_norm = self.cfg.use_qk_norm and (use_rope or bug == "qk_norm_on_nope")
        if use_rope:
            if has_qk_norm and bug == "qk_norm_before_rope":
                q, k = _qk_norm(q, self.eps), _qk_norm(k, self.eps)
                q, k = _apply_rope(q, angles), _apply_rope(k, angles)
            else:
                q, k = _apply_rope(q, angles), _apply_rope(k, angles)
                if has_qk_norm:
                    q, k = _qk_norm(q, self.eps), _qk_norm(k, self.eps)
        elif has_qk_norm:
            q, k = _qk_norm(q, self.eps), _qk_norm(k, self.eps)
        if self.cfg.attn_temperature_tuning and not use_rope:
            t = torch.arange(T, device=x.device, dtype=torch.float32)
            num = t if bug == "temp_off_by_one" else t + 1.0
            temp = torch.log1p(torch.floor(num / self.cfg.floor_scale)) * self.cfg.attn_scale + 1.0
            q = q * temp[None, :, None, None]
            if bug == "temp_scales_k_too":
                k = k * temp[None, :, None, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, n, T, d)
        groups = nh // nkv
        if bug == "gqa_tiled_heads":
            k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        neg = torch.finfo(q.dtype).min
        if bug == "sdpa_attention":
            bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, neg)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=d**-0.5)
        else:
            s = (q @ k.transpose(-1, -2)) * (d**-0.5)
            s = s.masked_fill(~allowed, neg)
            o = s.softmax(-1) @ v
        o = o.transpose(1, 2).reshape(B, T, nh * d)
        return o @ blk.out

    # -- feed-forward --------------------------------------------------------------------------------------------
    def _moe(self, blk, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, H)
        N = x.shape[0]
        E = blk.route.shape[1]
        k_top = self.cfg.num_experts_per_tok
        bug = _bug()
        logits = x @ blk.route  # (N, E)
        if bug == "sigmoid_then_topk":
            probs = torch.sigmoid(logits)
            val, idx = probs.topk(k_top, dim=-1)
            scores = torch.zeros_like(logits).scatter(1, idx, val)
        elif bug == "router_softmax":
            probs = logits.softmax(-1)
            val, idx = probs.topk(k_top, dim=-1)
            scores = torch.zeros_like(logits).scatter(1, idx, val)
        else:
            val, idx = logits.topk(k_top, dim=-1)
            scores = torch.zeros_like(logits).scatter(1, idx, torch.sigmoid(val))
        out = _swiglu(x, blk.sh_in, blk.sh_out)
        if bug == "sparse_expert_loop":
            routed = torch.zeros_like(x)
            for e in range(E):
                tok = (idx == e).any(-1).nonzero(as_tuple=True)[0]
                if tok.numel() == 0:
                    continue
                y = x[tok] * scores[tok, e : e + 1]
                h = F.silu(y @ blk.ex_gate[e]) * (y @ blk.ex_up[e])
                routed.index_add_(0, tok, h @ blk.ex_down[e])
            out = out + routed
        elif bug == "score_on_expert_output":
            xe = x[None].expand(E, N, shape[-1])
            h = F.silu(torch.bmm(xe, blk.ex_gate)) * torch.bmm(xe, blk.ex_up)
            y = torch.bmm(h, blk.ex_down)  # (E, N, H)
            out = out + (y * scores.t()[:, :, None]).sum(0)
        else:
            xe = x[None] * scores.t()[:, :, None]  # (E, N, H): each expert sees its score-scaled input
            h = F.silu(torch.bmm(xe, blk.ex_gate)) * torch.bmm(xe, blk.ex_up)
            out = out + torch.bmm(h, blk.ex_down).sum(0)
        return out.view(shape)

    # -- forward -------------------------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        elif position_ids.shape[0] != B:
            position_ids = position_ids.expand(B, T)
        angles = _rope_angles(position_ids, self.d, self.theta)
        full, chunked = self._masks(attention_mask, B, T, dev)
        x = self.embed[input_ids]
        for blk in self.blocks:
            allowed = chunked if blk.chunked else full
            h = _rms(x, self.eps) * blk.norm_attn
            x = x + self._attention(blk, h, angles, allowed)
            h = _rms(x, self.eps) * blk.norm_ffn
            if blk.moe:
                x = x + self._moe(blk, h)
            else:
                x = x + _swiglu(h, blk.mlp_in, blk.mlp_out)
        x = _rms(x, self.eps) * self.final_norm
        return x @ self.unembed


# ----------------------------------------------------------------------------------------------------------------
# loading


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    model = Llama4TextPort(config)  # head_dim: the config's (its __post_init__ fills it when unset)
    p = "model."

    def get(name):
        return sd[p + name]

    new = {
        "embed": get("embed_tokens.weight"),
        "final_norm": get("norm.weight"),
        "unembed": sd["lm_head.weight"].t() if "lm_head.weight" in sd else get("embed_tokens.weight").t(),
    }
    for i, blk in enumerate(model.blocks):
        L = f"layers.{i}."
        a = L + "self_attn."
        new[f"blocks.{i}.norm_attn"] = get(L + "input_layernorm.weight")
        new[f"blocks.{i}.norm_ffn"] = get(L + "post_attention_layernorm.weight")
        new[f"blocks.{i}.qkv"] = torch.cat(
            [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")], 0
        ).t()
        new[f"blocks.{i}.out"] = get(a + "o_proj.weight").t()
        f = L + "feed_forward."
        if blk.moe:
            gate_up = get(f + "experts.gate_up_proj")  # (E, H, 2I), gate first
            gate, up = gate_up.chunk(2, dim=-1)
            if _bug() == "gate_up_halves_swapped":
                gate, up = up, gate
            new[f"blocks.{i}.ex_gate"] = gate
            new[f"blocks.{i}.ex_up"] = up
            new[f"blocks.{i}.ex_down"] = get(f + "experts.down_proj")
            new[f"blocks.{i}.route"] = get(f + "router.weight").t()
            new[f"blocks.{i}.sh_in"] = torch.cat(
                [get(f + "shared_expert.gate_proj.weight"), get(f + "shared_expert.up_proj.weight")], 0
            ).t()
            new[f"blocks.{i}.sh_out"] = get(f + "shared_expert.down_proj.weight").t()
        else:
            new[f"blocks.{i}.mlp_in"] = torch.cat([get(f + "gate_proj.weight"), get(f + "up_proj.weight")], 0).t()
            new[f"blocks.{i}.mlp_out"] = get(f + "down_proj.weight").t()
    model.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=True)
    return model.float().eval()
