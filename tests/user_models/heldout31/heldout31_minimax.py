"""Hand-written plain-PyTorch port of MiniMax-Text-01 (MiniMaxForCausalLM): lightning attention interleaved with
softmax attention, a sparse MoE on every layer, and scaled residuals.

Architecture as this port implements it:
- token embedding (no scaling); untied lm_head; final RMSNorm (gain * x / rms, eps = config.rms_norm_eps).
- decoder layer i (its kind from config.layer_types[i]); the residual is the NORMED stream:
    x = RMSNorm_in(h);  h = alpha_attn * x + beta_attn * Mixer(x)
    y = RMSNorm_post(h); h = alpha_mlp * y + beta_mlp * MoE(y)
  alpha/beta: linear_attn_{alpha,beta}_factor on lightning layers, full_attn_{alpha,beta}_factor on softmax
  layers, mlp_{alpha,beta}_factor after the MoE.
- lightning attention (layer_types "linear_attention"), nh = num_attention_heads heads of head_dim d, no RoPE:
    q, k, v = SiLU(x W_qkv) split per head (the fused projection is head-major: head h owns [q_h | k_h | v_h]);
    padding tokens have q, k, v zeroed (so they never enter the state);
    per head a decay slope s_h = 2^(-8/nh)^(h+1) * (1 - i/(L-1+1e-5) + 1e-5), i the GLOBAL layer index, L layers;
    o_t = sum_{j<=t} exp(-s_h (t-j)) (q_t . k_j) v_j   (no 1/sqrt(d) scale, no softmax, no normaliser),
    computed block-wise (config.block_size): intra-block masked decay matrix plus the carried (d x d) state,
    the query of block offset u seeing the state through exp(-s (u+1)), the state decayed by exp(-s n) per block
    of n tokens and fed with exp(-s (n-1-u)) k_u^T v_u;
    out = W_out( RMSNorm_{nh*d}(o) * sigmoid(x W_gate) ), the RMSNorm over all heads together with eps 1e-6
    (the module's own default, not config.rms_norm_eps).
- softmax attention (layer_types "full_attention"): GQA (query head h uses kv head h // (nq/nkv)), head_dim d
  from config, rotate-half RoPE (theta = config.rope_parameters["rope_theta"]), scores / sqrt(d), causal and
  padding mask (finfo.min, so a fully masked padding row averages its values), output projection.
- MoE (every layer): router softmax over num_local_experts, top num_experts_per_tok kept and renormalised to sum
  1; expert e: down_e(SiLU(gate_e x) * up_e x); no shared expert.
Weight layout of this port (own names):
- tok (V, H); head_t (H, V) = lm_head transposed; fin (H,).
- per layer `layers[i]`: n_in / n_post (H,) norm gains;
  lightning: wq / wk / wv (H, nh*d) each, de-interleaved from the head-major qkv_proj and transposed;
  w_gate (H, nh*d) transposed output_gate; w_out (nh*d, H) transposed out_proj; o_norm (nh*d,); slopes buffer
  (nh,) computed here (the checkpoint's decay buffers are not read);
  softmax: w_qkv (H, (nq + 2 nkv) d) = [q | k | v] fused and transposed; w_o (nq*d, H);
  MoE: w_route (H, E) transposed router; w_gate_e / w_up_e (E, H, I) split from gate_up_proj ([gate | up] rows)
  and transposed; w_down_e (E, I, H) transposed.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "minimax_qkv_blocked",  # lightning qkv_proj split as [Q all heads | K | V] blocks instead of head-major [q|k|v]
    "minimax_qkv_no_silu",  # SiLU on the lightning q/k/v projection skipped
    "minimax_lightning_rope",  # RoPE applied to lightning q/k too (only the softmax layers are rotary)
    "minimax_slope_exp_from_zero",  # decay slopes base**h for h = 0.. instead of base**(h+1)
    "minimax_slope_linear_index",  # slope layer factor uses the index among lightning layers, not the global index
    "minimax_query_decay_offset",  # block scan: query at block offset u reads the state with exp(-s u), not (u+1)
    "minimax_norm_per_head",  # lightning output RMSNorm taken per head over head_dim instead of over all heads
    "minimax_gate_before_norm",  # sigmoid output gate applied before the output RMSNorm instead of after it
    "minimax_lightning_pad_leak",  # padding tokens' q/k/v not zeroed, so they enter the lightning state
    "minimax_residual_prenorm",  # residuals taken from the un-normed stream (plain pre-norm) instead of the normed one
    "minimax_full_uses_linear_factors",  # softmax-attention layers read linear_attn_alpha/beta_factor
    "minimax_gate_up_swapped",  # experts' fused gate_up_proj split as [up | gate] at load
    "minimax_topk_not_renormed",  # top-k router probabilities used without renormalising to sum 1
    "minimax_gqa_kv_tiled",  # softmax attention: query head h uses kv head h % nkv (tiled) instead of h // n_rep
]
PADDING_ONLY = {"minimax_lightning_pad_leak"}
CLEAN = [
    "minimax_recurrent_scan",  # lightning attention as a token-by-token recurrence of the (d x d) state
    "minimax_parallel_decay",  # lightning attention as one masked (S x S) decay matrix, no blocks
    "minimax_sdpa",  # softmax attention through F.scaled_dot_product_attention with a float mask
    "minimax_dense_experts",  # every expert on every token, combined through a dense (N, E) weight matrix
    "minimax_topk_logits_softmax",  # top-k on router logits, softmax over the k kept logits
]


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class MiniMaxPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nq
        self.eps = cfg.rms_norm_eps
        self.theta = cfg.rope_parameters["rope_theta"]
        self.block = cfg.block_size
        self.E, self.topk = cfg.num_local_experts, cfg.num_experts_per_tok
        self.kinds = list(cfg.layer_types)
        self.n_layers = cfg.num_hidden_layers
        self.cfg = cfg
        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.fin = nn.Parameter(g("model.norm.weight"))
        nh, d, inter = self.nq, self.hd, cfg.intermediate_size
        self.layers = nn.ModuleList()
        n_linear = 0
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            L = nn.Module()
            L.kind = kind
            L.n_in = nn.Parameter(g(p + "input_layernorm.weight"))
            L.n_post = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            if kind == "linear_attention":
                w = g(a + "qkv_proj.weight")  # (nh * 3d, H)
                if BUG == "minimax_qkv_blocked":
                    wq, wk, wv = w.chunk(3, 0)
                else:
                    w = w.view(nh, 3, d, -1)
                    wq, wk, wv = (w[:, j].reshape(nh * d, -1) for j in range(3))
                L.wq, L.wk, L.wv = (nn.Parameter(t.t().contiguous()) for t in (wq, wk, wv))
                L.w_gate = nn.Parameter(g(a + "output_gate.weight").t().contiguous())
                L.w_out = nn.Parameter(g(a + "out_proj.weight").t().contiguous())
                L.o_norm = nn.Parameter(g(a + "norm.weight"))
                L.layer_pos = i
                L.linear_pos = n_linear
                n_linear += 1
                L.alpha, L.beta = cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor
            else:
                L.w_qkv = nn.Parameter(torch.cat([g(a + f"{n}_proj.weight") for n in "qkv"], 0).t().contiguous())
                L.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
                L.alpha, L.beta = cfg.full_attn_alpha_factor, cfg.full_attn_beta_factor
            m = p + "mlp."
            L.w_route = nn.Parameter(g(m + "gate.weight").t().contiguous())
            gu = g(m + "experts.gate_up_proj")  # (E, 2I, H)
            gate, up = gu[:, :inter], gu[:, inter:]
            if BUG == "minimax_gate_up_swapped":
                gate, up = up, gate
            L.w_gate_e = nn.Parameter(gate.transpose(1, 2).contiguous())
            L.w_up_e = nn.Parameter(up.transpose(1, 2).contiguous())
            L.w_down_e = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous())
            self.layers.append(L)

    # ---- lightning attention ----
    def _slopes(self, L):
        nh = self.nq
        base = 2.0 ** (-8.0 / nh)
        exps = torch.arange(nh, dtype=torch.float32)
        if BUG != "minimax_slope_exp_from_zero":
            exps = exps + 1
        idx = L.linear_pos if BUG == "minimax_slope_linear_index" else L.layer_pos
        factor = 1 - idx / (self.n_layers - 1 + 1e-5) + 1e-5
        return base**exps * factor  # (nh,)

    def _scan_blocks(self, q, k, v, s):
        B, nh, S, d = q.shape
        sv = s[:, None]  # (nh, 1)
        state = q.new_zeros(B, nh, d, d)
        outs = []
        for c0 in range(0, S, self.block):
            qc, kc, vc = q[:, :, c0 : c0 + self.block], k[:, :, c0 : c0 + self.block], v[:, :, c0 : c0 + self.block]
            n = qc.shape[2]
            u = torch.arange(n, dtype=torch.float32)
            gap = u[:, None] - u[None, :]
            dec = torch.exp(-sv[:, :, None] * gap.clamp(min=0)) * (gap >= 0)  # (nh, n, n)
            intra = ((qc @ kc.transpose(-1, -2)) * dec) @ vc
            qoff = u if BUG == "minimax_query_decay_offset" else u + 1
            inter = (qc * torch.exp(-sv * qoff)[..., None]) @ state
            outs.append(intra + inter)
            kdec = torch.exp(-sv * (n - 1 - u))[..., None]  # (nh, n, 1)
            state = state * torch.exp(-sv * n)[..., None] + (kc * kdec).transpose(-1, -2) @ vc
        return torch.cat(outs, 2)

    def _scan_recurrent(self, q, k, v, s):
        B, nh, S, d = q.shape
        r = torch.exp(-s)[:, None, None]
        state = q.new_zeros(B, nh, d, d)
        outs = []
        for t in range(S):
            state = r * state + k[:, :, t, :, None] * v[:, :, t, None, :]
            outs.append((q[:, :, t, None, :] @ state)[:, :, 0])
        return torch.stack(outs, 2)

    def _scan_parallel(self, q, k, v, s):
        S = q.shape[2]
        t = torch.arange(S, dtype=torch.float32)
        gap = t[:, None] - t[None, :]
        dec = torch.exp(-s[:, None, None] * gap.clamp(min=0)) * (gap >= 0)
        return ((q @ k.transpose(-1, -2)) * dec) @ v

    def _lightning(self, L, x, mask, pos):
        B, S, _ = x.shape
        nh, d = self.nq, self.hd
        q, k, v = x @ L.wq, x @ L.wk, x @ L.wv
        if BUG != "minimax_qkv_no_silu":
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        if BUG != "minimax_lightning_pad_leak":
            keep = mask[:, :, None].to(q.dtype)
            q, k, v = q * keep, k * keep, v * keep
        q, k, v = (t.view(B, S, nh, d).transpose(1, 2) for t in (q, k, v))
        if BUG == "minimax_lightning_rope":
            q, k = self._rope(q, pos), self._rope(k, pos)
        s = self._slopes(L)
        if BUG == "minimax_recurrent_scan":
            o = self._scan_recurrent(q, k, v, s)
        elif BUG == "minimax_parallel_decay":
            o = self._scan_parallel(q, k, v, s)
        else:
            o = self._scan_blocks(q, k, v, s)
        o = o.transpose(1, 2).reshape(B, S, nh * d)
        gate = torch.sigmoid(x @ L.w_gate)
        if BUG == "minimax_gate_before_norm":
            o = _rms(o * gate, L.o_norm, 1e-6)
        elif BUG == "minimax_norm_per_head":
            o = _rms(o.view(B, S, nh, d), L.o_norm.view(nh, d), 1e-6).reshape(B, S, nh * d) * gate
        else:
            o = _rms(o, L.o_norm, 1e-6) * gate
        return o @ L.w_out

    # ---- softmax attention ----
    def _rope(self, x, pos):  # x (B, h, S, d), pos (B, S)
        d = self.hd
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = pos[..., None].float() * inv
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    def _softmax_attn(self, L, x, pos, allowed):
        B, S, _ = x.shape
        nq, nkv, d = self.nq, self.nkv, self.hd
        q, k, v = (x @ L.w_qkv).split([nq * d, nkv * d, nkv * d], -1)
        q = self._rope(q.view(B, S, nq, d).transpose(1, 2), pos)
        k = self._rope(k.view(B, S, nkv, d).transpose(1, 2), pos)
        v = v.view(B, S, nkv, d).transpose(1, 2)
        rep = nq // nkv
        if BUG == "minimax_gqa_kv_tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        bias = torch.zeros(B, 1, S, S).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        if BUG == "minimax_sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            o = ((q @ k.transpose(-1, -2)) / math.sqrt(d) + bias).softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, S, nq * d) @ L.w_o

    # ---- MoE ----
    def _moe(self, L, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        N = t.shape[0]
        logits = t @ L.w_route  # (N, E)
        if BUG == "minimax_topk_logits_softmax":
            top, idx = logits.topk(self.topk, -1)
            w = top.softmax(-1)
        else:
            top, idx = logits.softmax(-1).topk(self.topk, -1)
            w = top if BUG == "minimax_topk_not_renormed" else top / top.sum(-1, keepdim=True)
        if BUG == "minimax_dense_experts":
            h = torch.einsum("nh,ehi->eni", t, L.w_gate_e)
            u = torch.einsum("nh,ehi->eni", t, L.w_up_e)
            y = torch.einsum("eni,eih->enh", F.silu(h) * u, L.w_down_e)  # (E, N, H)
            dense = torch.zeros(N, self.E).scatter(1, idx, w)
            return torch.einsum("ne,enh->nh", dense, y).view(B, S, H)
        out = torch.zeros_like(t)
        for e in range(self.E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            xe = t[tok]
            ye = (F.silu(xe @ L.w_gate_e[e]) * (xe @ L.w_up_e[e])) @ L.w_down_e[e]
            out.index_add_(0, tok, ye * w[tok, slot, None])
        return out.view(B, S, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        mask = attention_mask.bool()
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & mask[:, None, :]
        cfg = self.cfg
        h = self.tok[input_ids]
        for L in self.layers:
            x = _rms(h, L.n_in, self.eps)
            res = h if BUG == "minimax_residual_prenorm" else x
            alpha, beta = L.alpha, L.beta
            if L.kind == "linear_attention":
                a = self._lightning(L, x, mask, position_ids)
            else:
                a = self._softmax_attn(L, x, position_ids, allowed)
                if BUG == "minimax_full_uses_linear_factors":
                    alpha, beta = cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor
            h = alpha * res + beta * a
            y = _rms(h, L.n_post, self.eps)
            res = h if BUG == "minimax_residual_prenorm" else y
            h = cfg.mlp_alpha_factor * res + cfg.mlp_beta_factor * self._moe(L, y)
        return _rms(h, self.fin, self.eps) @ self.head_t


def build(state_dict, config):
    return MiniMaxPort(state_dict, config).eval()
