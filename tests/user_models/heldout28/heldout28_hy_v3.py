"""Hand-written plain-PyTorch port of HunYuan v3 (HYV3ForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
- token embedding, no scaling; untied lm_head; final RMSNorm (eps = config.rms_norm_eps).
- pre-norm decoder layers: x + Attn(RMSNorm(x)); x + FFN(RMSNorm(x)).
- attention: GQA (num_key_value_heads), head_dim from config.head_dim, no biases;
  * per-head RMSNorm on q and on k (q_norm / k_norm over head_dim) right after the projections and
    BEFORE rotary embedding;
  rotate-half RoPE with * rope_theta from config.rope_parameters (default 11,158,840, not 10,000);
  softmax(q k^T / sqrt(head_dim)) with causal + key-padding mask.
- * FFN per layer from config.mlp_layer_types: "dense" = SwiGLU MLP (intermediate_size);
  "sparse" = MoE: * sigmoid router (fp32), * e_score_correction_bias added for the top-k CHOICE only,
  weights = sigmoid scores of the chosen experts, * renormalised to sum 1 (+1e-20) and then
  * multiplied by router_scaling_factor; SwiGLU experts (moe_intermediate_size) plus
  * one always-on shared SwiGLU expert (moe_intermediate_size * num_shared_experts) added unscaled.
Weight layout of this port (own names):
- emb (V, H); head_w (H, V) (transposed lm_head); final_gain (H,).
- per layer `blocks[i]`: ln1 / ln2 gains (H,); w_qkv (H, (nq + 2 nkv) * hd), fused and transposed;
  w_o (nq*hd, H) transposed; qn / kn (hd,) gains.
  dense: w_gu (H, 2I) = [gate | up] fused, transposed; w_d (I, H).
  sparse: router (H, E) transposed; corr (E,) correction bias; eg / eu (E, H, Im) and ed (E, Im, H)
  (experts' fused gate_up split into separate transposed gate and up stacks); sh_gu (H, 2Is), sh_d (Is, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "hy_qknorm_after_rope",  # q/k RMSNorm applied after RoPE instead of before
    "hy_qknorm_full_width",  # q/k norm statistics over all heads (whole projection) instead of per head
    "hy_rope_theta_default",  # RoPE base 10000 (Llama habit) instead of config rope_theta 11.16M
    "hy_rope_interleaved",  # RoPE rotates interleaved pairs (2i, 2i+1) instead of halves
    "hy_kv_repeat_tiled",  # GQA: query head h reads kv head h % n_kv instead of h // n_rep
    "hy_router_softmax",  # router scores with softmax instead of sigmoid
    "hy_bias_in_weights",  # correction bias kept in the expert weights (gathered from biased scores)
    "hy_no_renorm",  # top-k sigmoid weights not renormalised to sum 1
    "hy_no_route_scale",  # router_scaling_factor never applied
    "hy_scale_shared",  # router_scaling_factor applied to routed + shared sum
    "hy_gate_up_swapped",  # experts' fused gate_up split read as [up | gate] at load
    "hy_residual_normed",  # residual stream taken after input_layernorm
    "hy_pad_mask_off_by_one",  # key-padding mask shifted by one: last pad token stays visible
]
PADDING_ONLY = {"hy_pad_mask_off_by_one"}
CLEAN = [
    "hy_sdpa",  # attention through F.scaled_dot_product_attention with a boolean mask
    "hy_dense_moe",  # every expert run on every token, combined with a scattered (T, E) weight matrix
    "hy_complex_rope",  # RoPE as complex multiplication of (x_i, x_{i+d/2}) pairs
    "hy_split_qkv",  # separate q / k / v matmuls (slices of the fused weight)
    "hy_fold_norm_gain",  # input_layernorm gain folded into the fused qkv weight rows
]


def _bug():
    return BUG


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


class HyV3Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        g = lambda k: sd[k].detach().clone().float()
        self.H = cfg.hidden_size
        self.nq = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.theta = cfg.rope_parameters["rope_theta"]
        self.topk = cfg.num_experts_per_tok
        self.rscale = cfg.router_scaling_factor
        self.kinds = list(cfg.mlp_layer_types)
        self.emb = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_w = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.final_gain = nn.Parameter(g("model.norm.weight"))
        self.blocks = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            b = nn.Module()
            b.ln1 = nn.Parameter(g(p + "input_layernorm.weight"))
            b.ln2 = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            b.w_qkv = nn.Parameter(torch.cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0).t().contiguous())
            b.w_o = nn.Parameter(g(p + "self_attn.o_proj.weight").t().contiguous())
            b.qn = nn.Parameter(g(p + "self_attn.q_norm.weight"))
            b.kn = nn.Parameter(g(p + "self_attn.k_norm.weight"))
            if self.kinds[i] == "sparse":
                b.router = nn.Parameter(g(p + "mlp.gate.weight").t().contiguous())
                b.register_buffer("corr", g(p + "mlp.e_score_correction_bias"))
                gu = g(p + "mlp.experts.gate_up_proj")  # (E, 2I, H)
                I = gu.shape[1] // 2
                b.eg = nn.Parameter(gu[:, :I].transpose(1, 2).contiguous())
                b.eu = nn.Parameter(gu[:, I:].transpose(1, 2).contiguous())
                b.ed = nn.Parameter(g(p + "mlp.experts.down_proj").transpose(1, 2).contiguous())
                b.sh_gu = nn.Parameter(
                    torch.cat(
                        [g(p + "mlp.shared_experts.gate_proj.weight"), g(p + "mlp.shared_experts.up_proj.weight")], 0
                    )
                    .t()
                    .contiguous()
                )
                b.sh_d = nn.Parameter(g(p + "mlp.shared_experts.down_proj.weight").t().contiguous())
            else:
                b.w_gu = nn.Parameter(
                    torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")], 0).t().contiguous()
                )
                b.w_d = nn.Parameter(g(p + "mlp.down_proj.weight").t().contiguous())
            self.blocks.append(b)

    # ---- pieces ----
    def _rope(self, pos):
        bug = _bug()
        theta = 10000.0 if bug == "hy_rope_theta_default" else self.theta
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        fr = pos[..., None].float() * inv  # (B, S, hd/2)
        return fr

    def _apply_rope(self, x, fr):
        bug = _bug()
        # x (B, h, S, hd); fr (B, S, hd/2)
        if bug == "hy_rope_interleaved":
            c, s = fr.cos()[:, None], fr.sin()[:, None]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)
        if bug == "hy_complex_rope":
            h = self.hd // 2
            z = torch.complex(x[..., :h], x[..., h:]) * torch.polar(torch.ones_like(fr), fr)[:, None]
            return torch.cat((z.real, z.imag), -1)
        emb = torch.cat((fr, fr), -1)[:, None]
        return x * emb.cos() + _rot_half(x) * emb.sin()

    def _qknorm(self, x, w):
        if _bug() == "hy_qknorm_full_width":
            B, h, S, d = x.shape
            y = x.transpose(1, 2).reshape(B, S, h * d)
            y = _rms(y, w.repeat(h), self.eps)
            return y.view(B, S, h, d).transpose(1, 2)
        return _rms(x, w, self.eps)

    def _attn(self, b, x, fr, keep):
        bug = _bug()
        B, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        if bug == "hy_split_qkv":
            w = b.w_qkv
            q = x @ w[:, : nq * hd]
            k = x @ w[:, nq * hd : (nq + nkv) * hd]
            v = x @ w[:, (nq + nkv) * hd :]
        else:
            q, k, v = (x @ b.w_qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        q = q.view(B, S, nq, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        if bug == "hy_qknorm_after_rope":
            q, k = self._apply_rope(q, fr), self._apply_rope(k, fr)
            q, k = self._qknorm(q, b.qn), self._qknorm(k, b.kn)
        else:
            q, k = self._qknorm(q, b.qn), self._qknorm(k, b.kn)
            q, k = self._apply_rope(q, fr), self._apply_rope(k, fr)
        rep = nq // nkv
        if bug == "hy_kv_repeat_tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if bug == "hy_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        else:
            sc = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            sc = sc.masked_fill(~keep[:, None], torch.finfo(sc.dtype).min)
            o = sc.softmax(-1) @ v
        o = o.transpose(1, 2).reshape(B, S, nq * hd)
        return o @ b.w_o

    @staticmethod
    def _swiglu(x, w_gu, w_d):
        gt, up = (x @ w_gu).chunk(2, -1)
        return (F.silu(gt) * up) @ w_d

    def _moe(self, b, x):
        bug = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t.float() @ b.router
        scores = logits.softmax(-1) if bug == "hy_router_softmax" else logits.sigmoid()
        choice = scores + b.corr
        idx = choice.topk(self.topk, -1).indices
        wts = (choice if bug == "hy_bias_in_weights" else scores).gather(1, idx)
        if bug != "hy_no_renorm":
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        if bug not in ("hy_no_route_scale", "hy_scale_shared"):
            wts = wts * self.rscale
        eg, eu = (b.eu, b.eg) if bug == "hy_gate_up_swapped" else (b.eg, b.eu)
        E = eg.shape[0]
        if bug == "hy_dense_moe":
            full = torch.zeros(t.shape[0], E).scatter(1, idx, wts)
            hidden = F.silu(torch.einsum("th,ehi->tei", t, eg)) * torch.einsum("th,ehi->tei", t, eu)
            routed = torch.einsum("tei,eih,te->th", hidden, b.ed, full)
        else:
            routed = torch.zeros_like(t)
            for e in range(E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                xe = t[tok]
                ye = (F.silu(xe @ eg[e]) * (xe @ eu[e])) @ b.ed[e]
                routed.index_add_(0, tok, ye * wts[tok, slot, None])
        out = routed + self._swiglu(t, b.sh_gu, b.sh_d)
        if bug == "hy_scale_shared":
            out = out * self.rscale
        return out.view(B, S, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        km = attention_mask.bool()
        if bug == "hy_pad_mask_off_by_one":
            km = torch.cat([km[:, 1:], km[:, -1:]], 1)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        keep = causal[None] & km[:, None, :]
        fr = self._rope(position_ids)
        h = self.emb[input_ids]
        for i, b in enumerate(self.blocks):
            if bug == "hy_fold_norm_gain":
                xn = _rms(h, torch.ones_like(b.ln1), self.eps)
                wq = b.w_qkv * b.ln1[:, None]
                a = self._attn(_Folded(b, wq), xn, fr, keep)
            else:
                xn = _rms(h, b.ln1, self.eps)
                a = self._attn(b, xn, fr, keep)
            h = (xn if bug == "hy_residual_normed" else h) + a
            xn = _rms(h, b.ln2, self.eps)
            if self.kinds[i] == "sparse":
                h = h + self._moe(b, xn)
            else:
                h = h + self._swiglu(xn, b.w_gu, b.w_d)
        h = _rms(h, self.final_gain, self.eps)
        return (h @ self.head_w).float()


class _Folded:
    """A view of a block with a replaced fused qkv weight (norm gain folded in)."""

    def __init__(self, b, w_qkv):
        self._b, self.w_qkv = b, w_qkv

    def __getattr__(self, n):
        return getattr(self._b, n)


def build(state_dict, config):
    return HyV3Port(state_dict, config).eval()
