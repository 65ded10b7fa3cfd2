"""Hand-written plain-PyTorch port of JetBrains' Mellum (MellumForCausalLM, Transformers model_type "mellum").

Architecture as this port implements it (float32 throughout, batch B, sequence T, hidden H):
- token embedding, no scaling; untied LM head; every norm is RMSNorm  rms(x) = x / sqrt(mean(x**2) + eps) * w  with
  eps = config.rms_norm_eps, the mean over the last axis, computed in float32.
- decoder layer i, pre-norm, two residual branches:
      h = h + Attn_i(rms(h; attn_norm_i))
      h = h + FFN_i(rms(h; ffn_norm_i))
  then the final rms(h; out_norm) and logits = h @ head_t.
- Attn_i (GQA, nq = num_attention_heads query heads, nkv = num_key_value_heads, d = config.head_dim, which need not
  be H / nq): [q | k | v] = x @ wqkv + bqkv (biases when attention_bias); per head, q = rms(q; q_norm) and
  k = rms(k; k_norm) over the head's d channels (QK-norm, before RoPE); RoPE in the rotate-half (NeoX) convention,
  angle pos * theta_type ** (-2j / d), j < d / 2, where theta_type is the rope_theta of THIS layer's type
  (config.rope_parameters["sliding_attention"] or ["full_attention"]); each kv head serves nq / nkv consecutive
  query heads; scores q.k * d ** -0.5; the mask allows key j for query i when j <= i, key j is not padding, and, on a
  "sliding_attention" layer, j > i - sliding_window (window of sliding_window tokens including the query itself,
  counted over sequence indices); softmax over keys; out = concat(heads) @ wo_t + bo.
  A query row whose keys are all masked (a padding query) gets the finite fill value on every key, as Transformers'
  eager path does; those rows never reach a real token.
- FFN_i by config.mlp_layer_types[i]:
  "dense":  (silu(x @ Wg) * (x @ Wu)) @ Wd with intermediate_size, Wg | Wu fused;
  "sparse": router p = softmax(x @ router_t) over num_experts (float32); top-k (num_experts_per_tok) of p, and when
            norm_topk_prob the k weights are divided by their sum; out = sum_k w_k * E_k(x), with
            E(x) = (silu(x @ Wg_e) * (x @ Wu_e)) @ Wd_e (moe_intermediate_size). No shared expert, no bias on the router.
- positions: position_ids when given, else 0..T-1; attention_mask (B, T) of 1/0 masks padded keys.
Weight layout of this port (own names; Transformers' names only read in `build`):
- tok_emb (V, H); out_norm (H,); head_t (H, V) = lm_head.weight transposed.
- blocks[i].norms (2, H): rows [attn_norm (input_layernorm), ffn_norm (post_attention_layernorm)] stacked.
- blocks[i].attn: wqkv (H, nq*d + 2*nkv*d) = [q_proj | k_proj | v_proj] fused and transposed; bqkv the fused biases;
  wo_t (nq*d, H) = o_proj transposed; bo (H,); qk_w (2, d) rows [q_norm, k_norm]; inv_freq buffer (d/2,) of the
  layer's own theta; window (int or None).
- blocks[i].ffn, dense: w_gu (H, 2I) = [gate_proj | up_proj] transposed; w_d (I, H) = down_proj transposed.
- blocks[i].ffn, sparse: router_t (H, E) = gate.weight transposed; w13 (E, H, 2I) = experts.gate_up_proj transposed
  per expert (columns [gate | up] as Transformers packs them); w2 (E, I, H) = experts.down_proj transposed.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "qk_norm_after_rope",  # q_norm / k_norm applied to the rotated q / k (after RoPE) instead of before it
    "qk_norm_across_heads",  # QK-norm RMS taken over all heads' channels at once (OLMo-2 style), not per head
    "swa_window_off_by_one",  # sliding mask keeps j >= i - sliding_window: sliding_window + 1 keys instead of sliding_window
    "rope_theta_full_everywhere",  # every layer uses the full_attention rope_theta (500000); the sliding one is never read
    "rope_interleaved",  # RoPE rotates adjacent pairs (2j, 2j+1) (GPT-J / llama.cpp "norm" mode) instead of rotate-half
    "gqa_kv_tiled",  # kv heads repeated by tiling (kv0, kv1, kv0, kv1) instead of repeat_interleave (kv0, kv0, kv1, kv1)
    "attn_scale_hidden_over_heads",  # softmax scale (hidden_size // num_attention_heads) ** -0.5 instead of head_dim ** -0.5
    "experts_gate_up_swapped",  # fused expert gate_up_proj split as [up | gate]: silu applied to the up half
    "router_topk_not_renormalized",  # norm_topk_prob ignored: top-k softmax probabilities used without dividing by their sum
    "router_weight_on_expert_input",  # routing weight multiplies the expert's input (Llama-4 style) instead of its output
    "o_proj_bias_dropped",  # attention_bias read as q/k/v only (Qwen2 style): o_proj.bias never loaded
    "embed_scaled_sqrt_hidden",  # embeddings multiplied by sqrt(hidden_size) (a Gemma-3 template's normaliser)
    "residual_from_normed",  # attention branch's residual taken after input_layernorm (h = rms(h) + Attn(rms(h)))
    "swa_mask_no_padding",  # sliding layers' mask built from causal + window only: padded keys stay visible there
]
PADDING_ONLY = {"swa_mask_no_padding"}
CLEAN = [
    "router_topk_logits_softmax",  # top-k on raw router logits, softmax over the k kept (== renormalised top-k of softmax)
    "experts_dense_all",  # every expert run on every token, combined with a (tokens, experts) weight matrix (zeros off top-k)
    "rope_complex",  # RoPE as complex multiplication of (x[:d/2] + i x[d/2:]) by exp(i pos theta)
    "attention_online_softmax",  # attention over key blocks of 8 with a running max / denominator (flash style)
    "norm_weight_folded",  # input/post-attention/final RMSNorm weights folded into the next matmul's rows at load
]


def _rms(x, w, eps):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class MellumAttention(nn.Module):
    def __init__(self, wqkv, bqkv, wo_t, bo, qk_w, theta, window, nq, nkv, d, hidden, eps):
        super().__init__()
        self.wqkv = nn.Parameter(wqkv)
        self.bqkv = nn.Parameter(bqkv)
        self.wo_t = nn.Parameter(wo_t)
        self.bo = nn.Parameter(bo)
        self.qk_w = nn.Parameter(qk_w)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.window = window
        self.nq, self.nkv, self.d, self.hidden, self.eps = nq, nkv, d, hidden, eps

    def _rope(self, x, pos):
        # x (B, n, T, d); pos (B, T)
        ang = pos[:, None, :, None].float() * self.inv_freq  # (B, 1, T, d/2)
        if BUG == "rope_interleaved":
            cos, sin = ang.cos(), ang.sin()
            xe, xo = x[..., 0::2], x[..., 1::2]
            return torch.stack((xe * cos - xo * sin, xo * cos + xe * sin), dim=-1).flatten(-2)
        if BUG == "rope_complex":
            h = self.d // 2
            xc = torch.complex(x[..., :h], x[..., h:]) * torch.polar(torch.ones_like(ang), ang)
            return torch.cat((xc.real, xc.imag), dim=-1)
        emb = torch.cat((ang, ang), dim=-1)
        return x * emb.cos() + _rotate_half(x) * emb.sin()

    def _qk_norm(self, x, w):
        if BUG == "qk_norm_across_heads":  # x (B, n, T, d): RMS over all n*d channels of a token
            B, n, T, d = x.shape
            flat = x.transpose(1, 2).reshape(B, T, n * d)
            flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
            return flat.reshape(B, T, n, d).transpose(1, 2) * w
        return _rms(x, w, self.eps)

    def mask(self, T, key_ok, device):
        i = torch.arange(T, device=device)
        allowed = (i[None, :] <= i[:, None])[None, None]  # (1, 1, Tq, Tk)
        if self.window is not None:
            if BUG == "swa_window_off_by_one":
                allowed = allowed & (i[None, :] >= i[:, None] - self.window)
            else:
                allowed = allowed & (i[None, :] > i[:, None] - self.window)
        if key_ok is not None and not (self.window is not None and BUG == "swa_mask_no_padding"):
            allowed = allowed & key_ok[:, None, None, :]
        return allowed

    def forward(self, x, pos, key_ok):
        B, T, _ = x.shape
        nq, nkv, d = self.nq, self.nkv, self.d
        qkv = x @ self.wqkv + self.bqkv
        q, k, v = qkv.split((nq * d, nkv * d, nkv * d), dim=-1)
        q = q.view(B, T, nq, d).transpose(1, 2)
        k = k.view(B, T, nkv, d).transpose(1, 2)
        v = v.view(B, T, nkv, d).transpose(1, 2)
        if BUG == "qk_norm_after_rope":
            q = self._qk_norm(self._rope(q, pos), self.qk_w[0])
            k = self._qk_norm(self._rope(k, pos), self.qk_w[1])
        else:
            q = self._rope(self._qk_norm(q, self.qk_w[0]), pos)
            k = self._rope(self._qk_norm(k, self.qk_w[1]), pos)
        g = nq // nkv
        if BUG == "gqa_kv_tiled":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scale = (self.hidden // nq) ** -0.5 if BUG == "attn_scale_hidden_over_heads" else d**-0.5
        allowed = self.mask(T, key_ok, x.device)
        fill = torch.finfo(torch.float32).min
        if BUG == "attention_online_softmax":
            out = self._online(q, k, v, allowed, scale, fill)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, fill)
            out = torch.softmax(s, dim=-1) @ v
        out = out.transpose(1, 2).reshape(B, T, nq * d)
        return out @ self.wo_t + self.bo

    @staticmethod
    def _online(q, k, v, allowed, scale, fill, block=8):
        T = k.shape[-2]
        m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype)
        den = torch.zeros_like(m)
        acc = torch.zeros_like(q)
        allowed = allowed.expand(q.shape[0], q.shape[1], -1, -1)
        for s0 in range(0, T, block):
            s = (q @ k[..., s0 : s0 + block, :].transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed[..., s0 : s0 + block], fill)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            c = torch.exp(m - m_new)
            den = den * c + p.sum(-1, keepdim=True)
            acc = acc * c + p @ v[..., s0 : s0 + block, :]
            m = m_new
        return acc / den


class DenseFFN(nn.Module):
    def __init__(self, w_gu, w_d):
        super().__init__()
        self.w_gu = nn.Parameter(w_gu)
        self.w_d = nn.Parameter(w_d)

    def forward(self, x):
        g, u = (x @ self.w_gu).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.w_d


class SparseFFN(nn.Module):
    def __init__(self, router_t, w13, w2, top_k, renorm):
        super().__init__()
        self.router_t = nn.Parameter(router_t)
        self.w13 = nn.Parameter(w13)
        self.w2 = nn.Parameter(w2)
        self.top_k, self.renorm = top_k, renorm

    def _expert(self, e, x):
        h = x @ self.w13[e]
        if BUG == "experts_gate_up_swapped":
            u, g = h.chunk(2, dim=-1)
        else:
            g, u = h.chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.w2[e]

    def route(self, x):
        logits = (x @ self.router_t).float()
        if BUG == "router_topk_logits_softmax" and self.renorm:
            top_l, idx = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top_l, dim=-1), idx
        probs = torch.softmax(logits, dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renorm and BUG != "router_topk_not_renormalized":
            w = w / w.sum(-1, keepdim=True)
        return w, idx

    def forward(self, x):
        B, T, H = x.shape
        xt = x.reshape(-1, H)
        w, idx = self.route(xt)
        E = self.w13.shape[0]
        if BUG == "experts_dense_all":
            dense_w = torch.zeros(xt.shape[0], E, dtype=w.dtype).scatter(1, idx, w)
            outs = torch.stack([self._expert(e, xt) for e in range(E)], dim=1)  # (N, E, H)
            return (dense_w[..., None] * outs).sum(1).reshape(B, T, H)
        out = torch.zeros_like(xt)
        for e in range(E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            we = w[tok, slot, None]
            if BUG == "router_weight_on_expert_input":
                y = self._expert(e, xt[tok] * we)
            else:
                y = self._expert(e, xt[tok]) * we
            out.index_add_(0, tok, y)
        return out.reshape(B, T, H)


class Block(nn.Module):
    def __init__(self, norms, attn, ffn, eps):
        super().__init__()
        self.norms = nn.Parameter(norms)
        self.attn = attn
        self.ffn = ffn
        self.eps = eps

    def forward(self, h, pos, key_ok):
        a = _rms(h, self.norms[0], self.eps)
        res = a if BUG == "residual_from_normed" else h
        h = res + self.attn(a, pos, key_ok)
        return h + self.ffn(_rms(h, self.norms[1], self.eps))


class MellumPort(nn.Module):
    def __init__(self, tok_emb, blocks, out_norm, head_t, eps):
        super().__init__()
        self.tok_emb = nn.Parameter(tok_emb)
        self.blocks = nn.ModuleList(blocks)
        self.out_norm = nn.Parameter(out_norm)
        self.head_t = nn.Parameter(head_t)
        self.eps = eps

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        h = self.tok_emb[input_ids]
        if BUG == "embed_scaled_sqrt_hidden":
            h = h * math.sqrt(h.shape[-1])
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        key_ok = None if attention_mask is None else attention_mask.bool()
        for blk in self.blocks:
            h = blk(h, position_ids, key_ok)
        return (_rms(h, self.out_norm, self.eps) @ self.head_t).float()


def _experts(sd, p, E):
    """Transformers' fused expert tensors, or (a loader on the files' names) the per-expert ones stacked."""
    if p + "experts.gate_up_proj" in sd:
        return sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"]
    gu = torch.stack(
        [torch.cat((sd[f"{p}experts.{e}.gate_proj.weight"], sd[f"{p}experts.{e}.up_proj.weight"]), 0) for e in range(E)]
    )
    dn = torch.stack([sd[f"{p}experts.{e}.down_proj.weight"] for e in range(E)])
    return gu, dn


@torch.no_grad()
def build(state_dict, config):
    sd = {k: v.detach().float().clone() for k, v in state_dict.items()}
    H, nq, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or H // nq
    eps = config.rms_norm_eps
    E = config.num_experts
    fold = BUG == "norm_weight_folded"
    blocks = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        n_attn, n_ffn = sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]
        wqkv = torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"], 0).t().contiguous()  # (H, out)
        if config.attention_bias:
            bqkv = torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"], 0)
            bo = sd[a + "o_proj.bias"]
        else:
            bqkv = torch.zeros(wqkv.shape[1])
            bo = torch.zeros(H)
        if BUG == "o_proj_bias_dropped":
            bo = torch.zeros(H)
        if fold:
            wqkv = wqkv * n_attn[:, None]
            n_attn = torch.ones_like(n_attn)
        kind = config.layer_types[i]
        theta_kind = "full_attention" if BUG == "rope_theta_full_everywhere" else kind
        theta = config.rope_parameters[theta_kind]["rope_theta"]
        window = config.sliding_window if kind == "sliding_attention" else None
        attn = MellumAttention(
            wqkv,
            bqkv,
            sd[a + "o_proj.weight"].t().contiguous(),
            bo,
            torch.stack((sd[a + "q_norm.weight"], sd[a + "k_norm.weight"])),
            theta,
            window,
            nq,
            nkv,
            d,
            H,
            eps,
        )
        m = p + "mlp."
        if config.mlp_layer_types[i] == "dense":
            w_gu = torch.cat((sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]), 0).t().contiguous()
            if fold:
                w_gu = w_gu * n_ffn[:, None]
            ffn = DenseFFN(w_gu, sd[m + "down_proj.weight"].t().contiguous())
        else:
            gu, dn = _experts(sd, m, E)
            router_t = sd[m + "gate.weight"].t().contiguous()
            w13 = gu.transpose(1, 2).contiguous()  # (E, H, 2I)
            if fold:
                router_t = router_t * n_ffn[:, None]
                w13 = w13 * n_ffn[None, :, None]
            ffn = SparseFFN(
                router_t, w13, dn.transpose(1, 2).contiguous(), config.num_experts_per_tok, config.norm_topk_prob
            )
        if fold:
            n_ffn = torch.ones_like(n_ffn)
        blocks.append(Block(torch.stack((n_attn, n_ffn)), attn, ffn, eps))
    out_norm = sd["model.norm.weight"]
    head = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]
    head_t = head.t().contiguous()
    if fold:
        head_t = head_t * out_norm[:, None]
        out_norm = torch.ones_like(out_norm)
    return MellumPort(sd["model.embed_tokens.weight"], blocks, out_norm, head_t, eps).eval()
