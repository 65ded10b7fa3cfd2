"""Hand-written plain-PyTorch port of HRM-Text (HrmTextForCausalLM), Sapient's hierarchical recurrent LM.

Architecture as this port implements it:
- x = embed(ids) * embedding_scale (config.embedding_scale; an explicit value, 1 / initializer_range only when unset).
- two transformer stacks of num_layers_per_stack pre-norm blocks each, a fast "low" stack L and a slow "high"
  stack H, run as a nested recurrence (no input re-injection: the embeddings only seed the high state):
      z_H = x;  z_L = z_L_init (a learned (hidden,) vector, broadcast over batch and sequence)
      for h in range(H_cycles):
          for l in range(L_cycles):  z_L = L(z_L + z_H)
          z_H = H(z_H + z_L)
      logits = lm_head(z_H)            (untied; no model-level final norm)
  (L_bp_cycles only routes gradients during training; it does not change the forward.)
- every RMSNorm is parameter-free: x * rsqrt(mean(x^2) + eps), eps = config.rms_norm_eps; each stack ends with one.
- block: h = h + Attn(norm(h)); h = h + SwiGLU(norm(h)) (down(silu(gate x) * up x), with biases if mlp_bias).
- attention: plain MHA (every head has its own k / v; config.num_key_value_heads is not used), head_dim from
  config.head_dim (not hidden / heads), scores scaled by head_dim^-0.5, rotate-half RoPE (theta from
  config.rope_parameters) on q and k, causal + key-padding additive mask (finfo.min), softmax in float32;
  the per-head output is multiplied by an elementwise sigmoid gate sigmoid(gate_proj(x)) before o_proj.
  (prefix-LM bidirectionality needs token_type_ids, which this port does not take: attention is causal.)
Weight layout of this port (own names):
- tok (V, H); z0 (H,) = z_L_init; head (V, H) = lm_head.
- stacks[0] = low (L_module), stacks[1] = high (H_module); per block:
  w_qkvg (4 * nh * hd, H) = [q; k; v; gate] row-fused, b_qkvg (4 * nh * hd,); w_o (H, nh * hd), b_o (H,);
  w_gu (2 I, H) = [gate; up] row-fused, b_gu (2 I,); w_d (H, I), b_d (H,).
  (the "hrm_transposed" variant stores every stack matrix transposed, (in, out), and multiplies x @ W.)
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "hrm_zl_init_zeros",  # loader skips z_L_init (it sits outside the stacks) and the low state starts from zeros
    "hrm_x_injection",  # low stack fed z_L + embeddings (paper-style input injection) instead of z_L + z_H
    "hrm_cycles_swapped",  # outer loop runs L_cycles times and inner loop H_cycles times (config fields swapped)
    "hrm_bp_cycles_as_steps",  # inner low-stack step count per H cycle taken from the (padded) L_bp_cycles list
    "hrm_stack_norm_skipped",  # the parameter-free RMSNorm closing each stack is not applied
    "hrm_stacks_swapped",  # loader maps H_module weights into the low stack and L_module into the high stack
    "hrm_gate_on_values",  # sigmoid gate multiplies the value states before attention, not the attention output
    "hrm_gate_head_layout",  # gate (B, S, nh*hd) viewed straight as (B, nh, S, hd) without the head transpose
    "hrm_scale_from_hidden",  # scores scaled by (hidden / heads)^-0.5 instead of config.head_dim^-0.5
    "hrm_embed_scale_sqrt",  # embeddings scaled by sqrt(hidden) (Gemma habit) instead of config.embedding_scale
    "hrm_mlp_gate_up_swapped",  # fused [gate; up] MLP weight split as [up; gate] at use
    "hrm_bidirectional",  # no causal mask (original HRM puzzle model / prefix-LM attention): only key padding kept
    "hrm_rms_eps_default",  # RMSNorm eps hard-coded to 1e-6 instead of config.rms_norm_eps
    "hrm_padding_mask_ignored",  # attention_mask dropped: causal mask only, real tokens attend to left padding
]
PADDING_ONLY = {"hrm_padding_mask_ignored"}
CLEAN = [
    "hrm_sdpa",  # attention via F.scaled_dot_product_attention with the same additive float mask
    "hrm_complex_rope",  # RoPE as complex multiplication of the (x_i, x_{i+hd/2}) pairs
    "hrm_transposed",  # every stack matrix stored transposed (in, out) at load, applied as x @ W
    "hrm_flat_schedule",  # the H/L recurrence unrolled into a precomputed flat list of stack calls
]


def _norm(x, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Block(nn.Module):
    def __init__(self, w_qkvg, b_qkvg, w_o, b_o, w_gu, b_gu, w_d, b_d):
        super().__init__()
        self.w_qkvg, self.w_o, self.w_gu, self.w_d = (nn.Parameter(t) for t in (w_qkvg, w_o, w_gu, w_d))
        # biases may be absent (attention_bias / mlp_bias False): keep None
        self.b_qkvg = None if b_qkvg is None else nn.Parameter(b_qkvg)
        self.b_o = None if b_o is None else nn.Parameter(b_o)
        self.b_gu = None if b_gu is None else nn.Parameter(b_gu)
        self.b_d = None if b_d is None else nn.Parameter(b_d)


class HrmTextPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        transposed = BUG == "hrm_transposed"

        def g(k):
            return sd[k].detach().clone().float()

        def opt(k):
            return g(k) if k in sd else None

        def mat(t):
            return t.t().contiguous() if transposed else t

        def cat(*ts):
            return None if ts[0] is None else torch.cat(ts, 0)

        self.hidden = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.inter = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.theta = cfg.rope_parameters["rope_theta"]
        self.h_cycles, self.l_cycles = cfg.H_cycles, cfg.L_cycles
        bp = list(cfg.L_bp_cycles or [2])
        self.bp_padded = [1] * max(0, cfg.H_cycles - len(bp)) + bp
        scale = cfg.embedding_scale
        self.emb_scale = float(scale if scale is not None else 1.0 / cfg.initializer_range)
        n_layers = cfg.num_layers_per_stack

        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        if BUG == "hrm_zl_init_zeros":
            self.z0 = nn.Parameter(torch.zeros(cfg.hidden_size))
        else:
            self.z0 = nn.Parameter(g("model.z_L_init"))
        self.head = nn.Parameter(g("lm_head.weight"))

        names = ("L_module", "H_module")
        if BUG == "hrm_stacks_swapped":
            names = names[::-1]
        stacks = []
        for stack in names:
            blocks = []
            for i in range(n_layers):
                p = f"model.{stack}.layers.{i}."
                a, m = p + "self_attn.", p + "mlp."
                qkvg = [a + n + "_proj." for n in ("q", "k", "v", "gate")]
                blocks.append(
                    _Block(
                        mat(cat(*(g(n + "weight") for n in qkvg))),
                        cat(*(opt(n + "bias") for n in qkvg)),
                        mat(g(a + "o_proj.weight")),
                        opt(a + "o_proj.bias"),
                        mat(cat(g(m + "gate_proj.weight"), g(m + "up_proj.weight"))),
                        cat(opt(m + "gate_proj.bias"), opt(m + "up_proj.bias")),
                        mat(g(m + "down_proj.weight")),
                        opt(m + "down_proj.bias"),
                    )
                )
            stacks.append(nn.ModuleList(blocks))
        self.stacks = nn.ModuleList(stacks)

    # ---- pieces -------------------------------------------------------------------------------------------------
    def _lin(self, x, w, b):
        y = x @ w if BUG == "hrm_transposed" else x @ w.t()
        return y if b is None else y + b

    def _eps(self):
        return 1e-6 if BUG == "hrm_rms_eps_default" else self.eps

    def _rope(self, position_ids):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = position_ids.float()[..., None] * inv  # (B, S, hd/2)
        return ang

    def _apply_rope(self, x, ang):
        # x (B, nh, S, hd); ang (B, S, hd/2)
        if BUG == "hrm_complex_rope":
            half = self.hd // 2
            xc = torch.complex(x[..., :half].float(), x[..., half:].float())
            rot = torch.polar(torch.ones_like(ang), ang)[:, None]
            y = xc * rot
            return torch.cat((y.real, y.imag), dim=-1).to(x.dtype)
        emb = torch.cat((ang, ang), dim=-1)[:, None]
        return x * emb.cos() + _rotate_half(x) * emb.sin()

    def _attn(self, blk, x, ang, mask):
        B, S, _ = x.shape
        nh, hd = self.nh, self.hd
        qkvg = self._lin(x, blk.w_qkvg, blk.b_qkvg)
        q, k, v, gate = qkvg.split(nh * hd, dim=-1)
        q, k, v = (t.view(B, S, nh, hd).transpose(1, 2) for t in (q, k, v))
        if BUG == "hrm_gate_head_layout":
            gate = gate.reshape(B, nh, S, hd)
        else:
            gate = gate.view(B, S, nh, hd).transpose(1, 2)
        q, k = self._apply_rope(q, ang), self._apply_rope(k, ang)
        if BUG == "hrm_gate_on_values":
            v = torch.sigmoid(gate) * v
        scale = (self.hidden // nh) ** -0.5 if BUG == "hrm_scale_from_hidden" else hd**-0.5
        if BUG == "hrm_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale + mask
            o = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        if BUG != "hrm_gate_on_values":
            o = torch.sigmoid(gate) * o
        o = o.transpose(1, 2).reshape(B, S, nh * hd)
        return self._lin(o, blk.w_o, blk.b_o)

    def _mlp(self, blk, x):
        gu = self._lin(x, blk.w_gu, blk.b_gu)
        gt, up = gu.split(self.inter, dim=-1)
        if BUG == "hrm_mlp_gate_up_swapped":
            gt, up = up, gt
        return self._lin(F.silu(gt) * up, blk.w_d, blk.b_d)

    def _stack(self, idx, h, ang, mask):
        eps = self._eps()
        for blk in self.stacks[idx]:
            h = h + self._attn(blk, _norm(h, eps), ang, mask)
            h = h + self._mlp(blk, _norm(h, eps))
        return h if BUG == "hrm_stack_norm_skipped" else _norm(h, eps)

    def _mask(self, attention_mask, B, S, dtype):
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        if BUG == "hrm_bidirectional":
            causal = torch.ones(S, S, dtype=torch.bool)
        allowed = causal[None].expand(B, S, S)
        if attention_mask is not None and BUG != "hrm_padding_mask_ignored":
            allowed = allowed & attention_mask.bool()[:, None, :]
        neg = torch.finfo(dtype).min
        return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~allowed[:, None], neg)

    def _schedule(self):
        """The recurrence as a flat list of stack calls: 0 = one low-stack step, 1 = the high-stack step."""
        plan = []
        for _ in range(self.h_cycles):
            plan += [0] * self.l_cycles + [1]
        return plan

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        elif position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, S)
        ang = self._rope(position_ids)
        x = self.tok[input_ids]
        emb_scale = math.sqrt(self.hidden) if BUG == "hrm_embed_scale_sqrt" else self.emb_scale
        x = x * emb_scale
        mask = self._mask(attention_mask, B, S, x.dtype)

        z_h = x
        z_l = self.z0.to(x.dtype).expand_as(x)
        if BUG == "hrm_flat_schedule":
            for step in self._schedule():
                if step == 0:
                    z_l = self._stack(0, z_l + z_h, ang, mask)
                else:
                    z_h = self._stack(1, z_h + z_l, ang, mask)
            return (z_h @ self.head.t()).float()

        outer, inner = self.h_cycles, self.l_cycles
        if BUG == "hrm_cycles_swapped":
            outer, inner = inner, outer
        for h in range(outer):
            steps = inner
            if BUG == "hrm_bp_cycles_as_steps":
                steps = self.bp_padded[h] if h < len(self.bp_padded) else 1
            for _ in range(steps):
                src = x if BUG == "hrm_x_injection" else z_h
                z_l = self._stack(0, z_l + src, ang, mask)
            z_h = self._stack(1, z_h + z_l, ang, mask)
        return (z_h @ self.head.t()).float()


def build(state_dict, config):
    return HrmTextPort(state_dict, config).eval()
