"""Hand-written plain-PyTorch port of the Qwen4-Exp text decoder (Qwen4ExpForCausalLM, `qwen4_exp_text`).

Architecture as this port implements it (what differs from a Llama-style decoder is marked *):
- token embedding, no scaling; untied lm_head. * There is no final RMSNorm and no per-layer input norms: the hidden
  state is hc = config.hc_count parallel residual streams (B, S, hc, H), all starting as copies of the embedding.
- * RMSNorms store their gain as an offset from one (y = x / rms(x) * (1 + w)); this port adds the one at load.
  Grouped norms (hyper-connections, PLE) normalise every stream over its own H features. The Gated DeltaNet output
  norm is the exception: its gain is applied as is (y = w * x / rms(x) * act(z)).
- * hyper-connection around every block (attention / DeltaNet, then MoE), and once more at the end:
    n = grouped_rmsnorm(streams)                                  (B, S, hc, H)
    mix = sigmoid(silu((n.flat @ W_down) / hc) @ W_up)            (B, S, hc, H), low rank hc_lowrank
    x = mean over streams of mix * n                              the block input (B, S, H)
    inj = 2 * sigmoid((n.flat @ W_inject) / hc)                   (B, S, hc)
    streams <- streams + inj[..., None] * block(x)                the RAW streams, not n
  The final mixer has no injection: its x feeds the lm_head.
- * Per-Layer Embedding (PLE) on the decoder layers of config.ple_layer_ids (one-indexed, linear layers only), added
  to the streams before the attention hyper-connection:
  hashed n-grams (orders 2..ngram_size, heads_per_ngram heads each): the context of token p is the previous tokens,
  cut at an end-of-sequence token (every token before an EOS reads as EOS; the sequence starts with EOS context;
  padding ids read as EOS); the n-gram id is XOR_i(prev_i * m_i) mod P_h + offset_h with odd SplitMix64 multipliers
  m_i (seeded by config.seed and the PLE ordinal, i.e. the index in ple_layer_ids) and per-head primes P_h (the
  successive primes from ngram_vocab_size_base on, counted over all PLE layers); the head embeddings are
  concatenated (E = ple_embed_dim). Then key = grouped_rmsnorm(E @ W_key) (hc streams), value = E @ W_value (H),
  q = grouped_rmsnorm(streams); gate = signed_sqrt(<key, q> / sqrt(H)) per stream; v = sigmoid(gate) * value;
  out = v + silu(dilated causal depthwise conv(grouped_rmsnorm(v)))  (kernel ple_conv_kernel_size, dilation
  ngram_size); padding positions zeroed before the conv.
- linear_attention layers: Gated DeltaNet. One projection gives q | k | v (through a causal depthwise conv of
  kernel linear_conv_kernel_dim + SiLU), z, b, a. beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
  * the linear_num_key_heads q/k heads are shared by consecutive groups of value heads (head h reads key head
  h // (nv / nk)); q, k L2-normalised (eps 1e-6), q scaled by dk^-0.5; per head S <- exp(g) S;
  S <- S + k (beta (v - S^T k))^T; o = S^T q. Output: gated RMSNorm per head with act = config.output_gate_type
  (falls back to hidden_act), then out_proj. Padding positions are zeroed at the layer input.
- indexed_attention layers: GQA with q/k per-head RMSNorm, * partial rotate-half RoPE (first head_dim *
  partial_rotary_factor dims, theta from rope_parameters), * a sigmoid output gate (q_proj gives, per head,
  [query | gate]), and * the QSA indexer restricting which keys every query may see:
    the query's visible keys (causal and not padding) are cut, from the first visible one, into blocks of
    indexer_compress_ratio tokens; every complete block's key = RMSNorm(mean of its raw index keys), rotated at the
    position of its first token; a block's score = sum over index heads of relu(q_idx . key) / sqrt(d_idx), q_idx
    RMS-normed and rotated at the query's position; the indexer_budget / compress_ratio best blocks are kept, plus
    every token of the trailing incomplete block (which holds the query itself).
  Attention then uses softmax(q k^T / sqrt(hd)) over the kept keys (masked entries at finfo.min).
- MoE on every layer: softmax router, top-k renormalised (norm_topk_prob), SwiGLU experts, plus a SwiGLU shared
  expert scaled by sigmoid(x @ w_shared_gate).

Weight layout of this port (own names; matrices stored (in, out) so activations multiply on the right):
- tok (V, H); head_t (H, V) = lm_head transposed.
- every hyper-connection (layers[i].hc_attn, layers[i].hc_mlp, hc_final): gain (hc, H) = 1 + hc_norm;
  w_in (hc H, r + hc) = [input_mix_weight_down | block_inject_weight] transposed and fused (r only for hc_final);
  w_up (r, hc H).
- attention: w_qkv (H, (nh + 2 nkv) hd) with the query rows taken per head out of q_proj and fused with k / v;
  w_gate (H, nh hd) the per-head gate rows of q_proj; w_o (nh hd, H); qg / kg (hd,) = 1 + q_norm / k_norm;
  indexer: w_iq (H, nih di), w_ik (H, di) split out of index_qk_proj; iqg / ikg (di,) = 1 + q/k_layernorm.
- DeltaNet: w_in (H, 2 nk dk + nv dv + nv dv + 2 nv) = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a] transposed;
  conv (C, K); neg_a (nv,) = -exp(A_log); dt_bias (nv,); onorm (dv,) as stored; w_out (nv dv, H).
- MoE: w_router (H, E); w1 / w3 (E, H, I) = gate / up halves of experts.gate_up_proj, transposed; w2 (E, I, H);
  shared: w_sgu (H, 2 Is) = [gate | up]; w_sd (Is, H); w_sg (H, 1).
- PLE: table (rows, E / heads); w_kv (E, hc H + H) = [key_proj | value_proj]; kgain / qgain / cgain (hc, H) =
  1 + norm_key / norm_query / norm_conv; pconv (hc H, K). The hash constants (multipliers, primes, offsets) are
  computed from the config, not read from the checkpoint.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "gdn_heads_tiled",  # DeltaNet q/k heads expanded to the value heads tiled (h % nk) instead of grouped (h // rep)
    "gdn_gate_act_hidden_act",  # DeltaNet output-gate activation read from hidden_act (silu), not output_gate_type
    "gdn_gated_norm_offset",  # the 1 + w offset of the other RMSNorms also added to the DeltaNet gated-norm weight
    "attn_q_gate_halves",  # q_proj split as [all queries | all gates] halves instead of per head [query | gate]
    "qsa_knorm_before_pool",  # indexer k_layernorm applied to every token key before the block mean, not after
    "qsa_tail_dropped",  # tokens of the trailing incomplete block (the query's own) not added to the selection
    "qsa_blocks_absolute",  # indexer blocks cut at row indices 0, R, 2R.. (padding counted), not from the 1st real one
    "hc_norm_ungrouped",  # hyper-connection RMSNorm taken over all hc * H features instead of per stream
    "hc_residual_normed",  # hyper-connection adds the block output to the normalised streams, not the raw ones
    "ple_no_eos_reset",  # n-gram context runs across an end-of-sequence token (no reset to EOS)
    "ple_pad_ids_kept",  # padding token ids left in the n-gram context instead of read as EOS
    "ple_conv_undilated",  # PLE short conv with dilation 1 instead of ngram_size
    "ple_hash_seed_layer_idx",  # hash multipliers seeded with the decoder layer index, not the PLE ordinal
    "moe_sigmoid_router",  # router scores taken with a sigmoid instead of a softmax over the experts
]
PADDING_ONLY = {"qsa_blocks_absolute", "ple_pad_ids_kept"}
CLEAN = [
    "sdpa",  # attention through F.scaled_dot_product_attention with an additive float mask
    "chunked_delta",  # gated delta rule in chunks of 8 (triangular solve inside a chunk) instead of token by token
    "dense_experts",  # every expert on every token, combined through a dense (N, E) routing matrix
    "complex_rope",  # RoPE as complex multiplication of the (x_i, x_{i + r/2}) pairs
    "ple_conv_shifts",  # PLE dilated conv written as a sum of shifted, per-channel scaled copies
]


# ---------------------------------------------------------------- helpers


def _rms(x, gain, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def _act(name):
    return {"silu": F.silu, "sigmoid": torch.sigmoid}[name]


_M64 = (1 << 64) - 1


def _mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _multipliers(vocab, n, ordinal, seed):
    bound = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + 10007 * ordinal
    return [2 * (_mix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & _M64) % bound) + 1 for i in range(n)]


def _primes_from(start, count, skip):
    """`count` successive primes >= start after skipping the first `skip` of them."""
    out, p = [], start - 1
    while len(out) < skip + count:
        p += 1
        if p >= 2 and all(p % d for d in range(2, math.isqrt(p) + 1)):
            out.append(p)
    return out[skip:]


# ---------------------------------------------------------------- the model


class Qwen4ExpPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        def p(t):
            return nn.Parameter(t.contiguous(), requires_grad=False)

        H = self.H = cfg.hidden_size
        self.V = cfg.vocab_size
        self.hc = cfg.hc_count
        self.r = cfg.hc_lowrank
        self.eps = cfg.rms_norm_eps
        self.types = list(cfg.layer_types)
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.head_dim
        rp = cfg.rope_parameters
        self.theta = rp["rope_theta"]
        self.rot = int(self.hd * rp.get("partial_rotary_factor", 1.0))
        self.nih, self.di = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio = cfg.indexer_compress_ratio
        self.keep_blocks = cfg.indexer_budget // cfg.indexer_compress_ratio
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.gate_act = cfg.hidden_act if BUG == "gdn_gate_act_hidden_act" else (cfg.output_gate_type or cfg.hidden_act)
        self.conv_act = cfg.hidden_act
        self.topk, self.renorm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.E = cfg.num_experts
        eos = cfg.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.ngram = cfg.ngram_size
        self.hpn = cfg.heads_per_ngram
        self.ple_k = cfg.ple_conv_kernel_size
        ple_ids = list(cfg.ple_layer_ids or [])

        self.tok = p(g("model.embed_tokens.weight"))
        self.head_t = p(g("lm_head.weight").t())

        def hyper(prefix, inject=True):
            m = nn.Module()
            m.gain = p((1.0 + g(prefix + "hc_norm.weight")).view(self.hc, H))
            down = g(prefix + "input_mix_weight_down.weight")
            if inject:
                down = torch.cat([down, g(prefix + "block_inject_weight.weight")], 0)
            m.w_in = p(down.t())
            m.w_up = p(g(prefix + "input_mix_weight_up.weight").t())
            return m

        self.hc_final = hyper("model.hyper_connection_mixer.", inject=False)
        self.layers = nn.ModuleList()
        for i, kind in enumerate(self.types):
            pre = f"model.layers.{i}."
            L = nn.Module()
            L.hc_attn = hyper(pre + "attn_hyper_connection.")
            L.hc_mlp = hyper(pre + "mlp_hyper_connection.")
            if kind == "linear_attention":
                a = pre + "linear_attn."
                L.w_in = p(torch.cat([g(a + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")], 0).t())
                L.conv = p(g(a + "conv1d.weight").squeeze(1))
                L.neg_a = p(-g(a + "A_log").exp())
                L.dt_bias = p(g(a + "dt_bias"))
                onorm = g(a + "norm.weight")
                L.onorm = p(1.0 + onorm if BUG == "gdn_gated_norm_offset" else onorm)
                L.w_out = p(g(a + "out_proj.weight").t())
            else:
                a = pre + "self_attn."
                qg = g(a + "q_proj.weight")  # (nh * 2 hd, H): per head [query rows | gate rows]
                if BUG == "attn_q_gate_halves":
                    wq, wg = qg[: self.nh * self.hd], qg[self.nh * self.hd :]
                else:
                    per_head = qg.view(self.nh, 2, self.hd, H)
                    wq, wg = per_head[:, 0].reshape(-1, H), per_head[:, 1].reshape(-1, H)
                L.w_qkv = p(torch.cat([wq, g(a + "k_proj.weight"), g(a + "v_proj.weight")], 0).t())
                L.w_gate = p(wg.t())
                L.w_o = p(g(a + "o_proj.weight").t())
                L.qg = p(1.0 + g(a + "q_norm.weight"))
                L.kg = p(1.0 + g(a + "k_norm.weight"))
                iqk = g(a + "indexer.index_qk_proj.weight")
                L.w_iq = p(iqk[: self.nih * self.di].t())
                L.w_ik = p(iqk[self.nih * self.di :].t())
                L.iqg = p(1.0 + g(a + "indexer.q_layernorm.weight"))
                L.ikg = p(1.0 + g(a + "indexer.k_layernorm.weight"))
            m = pre + "mlp."
            L.w_router = p(g(m + "gate.weight").t())
            gu = g(m + "experts.gate_up_proj")  # (E, 2I, H)
            inter = gu.shape[1] // 2
            L.w1 = p(gu[:, :inter].transpose(1, 2))
            L.w3 = p(gu[:, inter:].transpose(1, 2))
            L.w2 = p(g(m + "experts.down_proj").transpose(1, 2))
            L.w_sgu = p(
                torch.cat([g(m + "shared_expert.gate_proj.weight"), g(m + "shared_expert.up_proj.weight")], 0).t()
            )
            L.w_sd = p(g(m + "shared_expert.down_proj.weight").t())
            L.w_sg = p(g(m + "shared_expert_gate.weight").t())
            L.has_ple = (i + 1) in ple_ids
            if L.has_ple:
                q = pre + "ple."
                ordinal = ple_ids.index(i + 1)
                heads = (self.ngram - 1) * self.hpn
                seed_index = i if BUG == "ple_hash_seed_layer_idx" else ordinal
                L.register_buffer(
                    "mult", torch.tensor(_multipliers(self.V, self.ngram, seed_index, cfg.seed), dtype=torch.long)
                )
                sizes = _primes_from(cfg.ngram_vocab_size_base, heads, ordinal * heads)
                L.register_buffer("sizes", torch.tensor(sizes, dtype=torch.long))
                L.register_buffer("offsets", torch.tensor([0, *sizes[:-1]], dtype=torch.long).cumsum(0))
                L.table = p(g(q + "ple_embedding.ngram_embedding.weight"))
                L.w_kv = p(torch.cat([g(q + "key_proj.weight"), g(q + "value_proj.weight")], 0).t())
                L.kgain = p((1.0 + g(q + "norm_key.weight")).view(self.hc, H))
                L.qgain = p((1.0 + g(q + "norm_query.weight")).view(self.hc, H))
                L.cgain = p((1.0 + g(q + "norm_conv.weight")).view(self.hc, H))
                L.pconv = p(g(q + "conv1d.weight").squeeze(1))
            self.layers.append(L)

    # ---- rotary ----
    def _angles(self, pos):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.rot, 2, dtype=torch.float32) / self.rot))
        return pos[..., None].float() * inv  # (..., rot / 2)

    def _rope(self, x, ang):
        """x (..., d) with ang broadcastable to (..., rot / 2): rotate-half on the first rot dims."""
        half = self.rot // 2
        xr, rest = x[..., : self.rot], x[..., self.rot :]
        if BUG == "complex_rope":
            z = torch.complex(xr[..., :half], xr[..., half:]) * torch.polar(torch.ones_like(ang), ang)
            return torch.cat((z.real, z.imag, rest), -1)
        c, s = ang.cos(), ang.sin()
        x1, x2 = xr[..., :half], xr[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), -1)

    # ---- hyper-connections ----
    def _hc_norm(self, streams, gain):
        if BUG == "hc_norm_ungrouped":
            flat = streams.flatten(-2)
            return _rms(flat, gain.flatten(), self.eps).view_as(streams)
        return _rms(streams, gain, self.eps)

    def _hc_read(self, m, streams, inject=True):
        n = self._hc_norm(streams, m.gain)  # (B, S, hc, H)
        proj = n.flatten(-2) @ m.w_in
        low = proj[..., : self.r]
        mix = torch.sigmoid(F.silu(low / self.hc) @ m.w_up).view_as(n)
        x = (mix * n).mean(-2)
        if not inject:
            return x
        inj = 2.0 * torch.sigmoid(proj[..., self.r :] / self.hc)  # (B, S, hc)
        base = n if BUG == "hc_residual_normed" else streams
        return x, inj, base

    # ---- PLE ----
    def _ngram_ids(self, L, ids):
        B = ids.shape[0]
        hist = torch.cat([ids.new_full((B, self.ngram - 1), self.eos), ids], 1)
        prev = [hist]
        for s in range(1, self.ngram):
            shifted = torch.cat([hist.new_full((B, s), self.eos), hist[:, :-s]], 1)
            if s > 1 and BUG != "ple_no_eos_reset":  # context stops at an EOS: anything before it reads as EOS
                shifted = torch.where(prev[-1] == self.eos, self.eos, shifted)
            prev.append(shifted)
        prev = [t[:, self.ngram - 1 :] for t in prev]
        cols = []
        for order in range(2, self.ngram + 1):
            h = prev[0] * L.mult[0]
            for j in range(1, order):
                h = h ^ (prev[j] * L.mult[j])
            lo = (order - 2) * self.hpn
            sizes, offs = L.sizes[lo : lo + self.hpn], L.offsets[lo : lo + self.hpn]
            cols.append(h[..., None] % sizes + offs)
        return torch.cat(cols, -1)  # (B, S, heads)

    def _ple(self, L, streams, ids, valid):
        B, S = ids.shape
        emb = L.table[self._ngram_ids(L, ids)].flatten(-2)  # (B, S, E)
        kv = emb @ L.w_kv
        key = _rms(kv[..., : self.hc * self.H].view(B, S, self.hc, self.H), L.kgain, self.eps)
        value = kv[..., self.hc * self.H :]
        q = _rms(streams, L.qgain, self.eps)
        gate = (key * q).sum(-1) / math.sqrt(self.H)
        gate = gate.sign() * gate.abs().clamp_min(1e-6).sqrt()
        v = torch.sigmoid(gate)[..., None] * value[:, :, None, :]  # (B, S, hc, H)
        vn = _rms(v, L.cgain, self.eps)
        if valid is not None:
            m = valid[:, :, None, None].float()
            v, vn = v * m, vn * m
        x = vn.flatten(-2).transpose(1, 2)  # (B, C, S)
        dil = 1 if BUG == "ple_conv_undilated" else self.ngram
        K = self.ple_k
        if BUG == "ple_conv_shifts":
            y = torch.zeros_like(x)
            for j in range(K):
                lag = (K - 1 - j) * dil
                if lag < S:
                    y[..., lag:] += L.pconv[:, j : j + 1] * x[..., : S - lag]
        else:
            y = F.conv1d(F.pad(x, ((K - 1) * dil, 0)), L.pconv[:, None], groups=x.shape[1], dilation=dil)
        y = F.silu(y).transpose(1, 2).reshape(B, S, self.hc, self.H)
        return v + y

    # ---- Gated DeltaNet ----
    def _delta_scan(self, q, k, v, g, beta):
        """q, k (B, h, S, dk), v (B, h, S, dv), g / beta (B, h, S): outputs (B, h, S, dv)."""
        B, h, S, dk = k.shape
        state = q.new_zeros(B, h, dk, v.shape[-1])
        out = torch.empty_like(v)
        if BUG == "chunked_delta":
            C = 8
            for c0 in range(0, S, C):
                sl = slice(c0, min(c0 + C, S))
                qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
                cum = g[:, :, sl].cumsum(-1)  # (B, h, c)
                n = cum.shape[-1]
                causal = torch.ones(n, n, dtype=torch.bool).tril()
                decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
                a = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
                rhs = bc[..., None] * (vc - cum.exp()[..., None] * (kc @ state))
                eye = torch.eye(n)
                delta = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
                scores = (qc @ kc.transpose(-1, -2)) * decay
                out[:, :, sl] = cum.exp()[..., None] * (qc @ state) + scores @ delta
                tail = (cum[..., -1:] - cum).exp()  # (B, h, c)
                state = cum[..., -1].exp()[..., None, None] * state + (kc * tail[..., None]).transpose(-1, -2) @ delta
            return out
        for t in range(S):
            state = state * g[:, :, t].exp()[..., None, None]
            kt = k[:, :, t]
            err = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, kt)
            state = state + kt[..., :, None] * (beta[:, :, t, None] * err)[..., None, :]
            out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
        return out

    def _gdn(self, L, x, valid):
        B, S, _ = x.shape
        if valid is not None:
            x = x * valid[..., None].float()
        kd, vd = self.nk * self.dk, self.nv * self.dv
        proj = x @ L.w_in
        qkv, z, b, a = proj.split([2 * kd + vd, vd, self.nv, self.nv], -1)
        K = L.conv.shape[1]
        qkv = F.conv1d(F.pad(qkv.transpose(1, 2), (K - 1, 0)), L.conv[:, None], groups=qkv.shape[-1])
        qkv = _act(self.conv_act)(qkv).transpose(1, 2)
        q, k, v = qkv.split([kd, kd, vd], -1)
        rep = self.nv // self.nk
        q, k = q.view(B, S, self.nk, self.dk), k.view(B, S, self.nk, self.dk)
        if BUG == "gdn_heads_tiled":
            q, k = q.repeat(1, 1, rep, 1), k.repeat(1, 1, rep, 1)
        else:
            q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * self.dk**-0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        v = v.view(B, S, self.nv, self.dv)
        beta = torch.sigmoid(b)
        gdec = L.neg_a * F.softplus(a + L.dt_bias)
        o = self._delta_scan(*(t.transpose(1, 2) for t in (q, k, v, gdec, beta)))
        o = o.transpose(1, 2)  # (B, S, nv, dv)
        o = _rms(o, L.onorm, self.eps) * _act(self.gate_act)(z.view(B, S, self.nv, self.dv))
        return o.reshape(B, S, vd) @ L.w_out

    # ---- QSA indexer + gated attention ----
    def _select(self, L, x, ang, allowed):
        """Boolean (B, S, S) mask of the keys the indexer keeps for every query."""
        B, S, _ = x.shape
        R = self.ratio
        iq = _rms((x @ L.w_iq).view(B, S, self.nih, self.di), L.iqg, self.eps)
        iq = self._rope(iq, ang[:, :, None])
        ik = x @ L.w_ik  # (B, S, di), raw
        keep = torch.zeros(B, S, S, dtype=torch.bool)
        for b in range(B):
            for t in range(S):
                vis = allowed[b, t].nonzero().flatten()
                if BUG == "qsa_blocks_absolute":
                    nb = (t + 1) // R
                    blocks = torch.arange(nb * R).view(nb, R)
                    blocks = blocks[allowed[b, t][blocks].any(-1)]  # the chunks holding a visible token
                    nb = blocks.shape[0]
                    tail = torch.arange(nb and (int(blocks[-1, -1]) + 1), t + 1)
                    tail = tail[allowed[b, t][tail]]
                else:
                    nb = vis.numel() // R
                    blocks = vis[: nb * R].view(nb, R)
                    tail = vis[nb * R :]
                chosen = [] if BUG == "qsa_tail_dropped" else [tail]
                if nb > 0:
                    keys = ik[b][blocks]  # (nb, R, di)
                    if BUG == "qsa_knorm_before_pool":
                        pooled = _rms(keys, L.ikg, self.eps).mean(1)
                    elif BUG == "qsa_blocks_absolute":
                        w = allowed[b, t][blocks].float()
                        pooled = _rms((keys * w[..., None]).sum(1) / w.sum(1, keepdim=True), L.ikg, self.eps)
                    else:
                        pooled = _rms(keys.mean(1), L.ikg, self.eps)
                    first = blocks[:, 0]
                    if BUG == "qsa_blocks_absolute":
                        first = torch.stack([blk[allowed[b, t][blk]][0] for blk in blocks])
                    pooled = self._rope(pooled, ang[b, first])
                    score = torch.relu(iq[b, t] @ pooled.t()).sum(0) / math.sqrt(self.di)  # (nb,)
                    best = score.topk(min(self.keep_blocks, nb)).indices
                    chosen.append(blocks[best].flatten())
                if chosen:
                    keep[b, t, torch.cat(chosen)] = True
        return keep

    def _attn(self, L, x, ang, allowed):
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        allowed = allowed & self._select(L, x, ang, allowed)
        q, k, v = (x @ L.w_qkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = self._rope(_rms(q.view(B, S, nh, hd), L.qg, self.eps), ang[:, :, None]).transpose(1, 2)
        k = self._rope(_rms(k.view(B, S, nkv, hd), L.kg, self.eps), ang[:, :, None]).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        neg = torch.finfo(torch.float32).min
        if BUG == "sdpa":
            bias = torch.zeros(B, 1, S, S).masked_fill(~allowed[:, None], neg)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=hd**-0.5)
        else:
            sc = (q @ k.transpose(-1, -2)) * hd**-0.5
            sc = sc.masked_fill(~allowed[:, None], neg)
            o = sc.softmax(-1) @ v
        o = o.transpose(1, 2).reshape(B, S, nh * hd) * torch.sigmoid(x @ L.w_gate)
        return o @ L.w_o

    # ---- MoE ----
    def _moe(self, L, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        logits = t @ L.w_router
        probs = torch.sigmoid(logits) if BUG == "moe_sigmoid_router" else logits.softmax(-1)
        w, idx = probs.topk(self.topk, -1)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        if BUG == "dense_experts":
            dense = torch.zeros(t.shape[0], self.E).scatter(1, idx, w)
            for e in range(self.E):
                y = (F.silu(t @ L.w1[e]) * (t @ L.w3[e])) @ L.w2[e]
                out = out + dense[:, e : e + 1] * y
        else:
            for e in range(self.E):
                rows, slot = (idx == e).nonzero(as_tuple=True)
                if rows.numel():
                    xe = t[rows]
                    y = (F.silu(xe @ L.w1[e]) * (xe @ L.w3[e])) @ L.w2[e]
                    out.index_add_(0, rows, y * w[rows, slot, None])
        gs, us = (t @ L.w_sgu).chunk(2, -1)
        out = out + torch.sigmoid(t @ L.w_sg) * ((F.silu(gs) * us) @ L.w_sd)
        return out.view(B, S, H)

    # ---- forward ----
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        real = attention_mask.bool()
        valid = None if bool(real.all()) else real  # padding handling only where there is padding
        if position_ids is None:
            position_ids = torch.arange(S).expand(B, S)
        ple_ids = input_ids
        if valid is not None and BUG != "ple_pad_ids_kept":
            ple_ids = torch.where(valid, input_ids, self.eos)
        ang = self._angles(position_ids)  # (B, S, rot / 2)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal[None] & real[:, None, :]  # (B, S query, S key)

        streams = self.tok[input_ids][:, :, None, :].expand(B, S, self.hc, self.H)
        for L, kind in zip(self.layers, self.types):
            if L.has_ple:
                streams = streams + self._ple(L, streams, ple_ids, valid)
            x, inj, base = self._hc_read(L.hc_attn, streams)
            if kind == "linear_attention":
                y = self._gdn(L, x, valid)
            else:
                y = self._attn(L, x, ang, allowed)
            streams = base + inj[..., None] * y[:, :, None, :]
            x, inj, base = self._hc_read(L.hc_mlp, streams)
            streams = base + inj[..., None] * self._moe(L, x)[:, :, None, :]
        x = self._hc_read(self.hc_final, streams, inject=False)
        return x @ self.head_t


def build(state_dict, config):
    return Qwen4ExpPort(state_dict, config).eval()
