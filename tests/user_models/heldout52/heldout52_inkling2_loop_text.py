"""A from-scratch PyTorch port of Inkling-2 Loop (text), ``inkling2_loop_text`` / ``Inkling2LoopForCausalLM``.

Notation: B batch, S sequence, H hidden size, h query heads, g kv heads, d head dim, K conv taps,
E experts, I expert width, r loop gate rank, rms(x) = x / sqrt(mean(x^2) + eps) (unweighted), softcap_c(x) = c*tanh(x/c).

Embedding      x0 = rms(E[ids]) * w_emb_norm
Block states   a list (B, S, N, H) of "block" sources; a layer whose index is a multiple of
               n_layers_per_attn_res_block (a block boundary) appends its *input* to the list.
Block attention residual (BAR) with learned queries Q (n, H) over the sources [blocks..., partial]:
               src = rms(stack)  (B, S, N+1, H);   w = softmax_N(Q . src / sqrt(H));   out_n = sum_N w * src
               (keys and values are both the normalised sources; there is no projection)
Decoder layer (input hs):
    sliding:   a = BAR_attn(blocks, hs)[0] (hs itself at layer 0);   xq = xk = xv = rms(a) * w_ln
    full:      (aq, ak, av) = BAR_attn3(blocks, hs) (hs at layer 0); xq, xk, xv = rms(.) * w_ln_{q,k,v}
    loop pass > 1 (messages m_q, m_k, m_v, m_mlp): the attention inputs are first mixed with the messages by
               gate(x, m) = (1 - tanh(F z)) * x + tanh(M z) * m,  z = D [rms(x); rms(m)]   (D: 2H -> r, F,M: r -> H)
               (sliding: before the single input norm; full: before the q/k/v input norms)
    attention: q = clip(s_q * (xq Wq))       [heads (h, d); full layers: then * tau(pos)]
               k = clip(conv_k(xk Wk))       v = rms(conv_v(xv Wv))       per head
               clip(x) = x * min(1, thr / (|x| + 1e-6)),  tau(p) = 1 + alpha * log(max((p+1)/n_floor, 1))
               conv (sliding, static):  y_t = (sum_l c_l * x_{t-l} + x_t) / sqrt(K+1)
               conv (full, dynamic):    y_t = (sum_l (c_l + (xk Wdyn)_{t,head,l}) * x_{t-l} + x_t) / sqrt(2K+1)
               rel bias: r = clip_rel(s_r * (xq Wr)) [* tau(pos) in full layers];  bias[i, j] = (r_i P)[i - j]
                         for 0 <= i - j < extent (sliding: extent = sliding_window_size), else 0
               sink: one extra logit per query and head, (xq Ws), with a zero value
               logits = q k^T / sqrt(d) + bias + mask  (causal, sliding layers also i - j < window, padding)
               p = softmax([logits, sink])[:-1];  o = ((p v) * sigmoid(xq Wg)) Wo
    o = post_attn_conv(o)  (static conv, as above; padding rows zeroed before every conv)
    boundary: local blocks += [hs]; res = o   |  else: res = hs + o
    m = BAR_mlp(local blocks, res)[0]; (loop pass > 1: m = gate(m, m_mlp)); m = MoE(rms(m) * w_post_ln)
    out = res + post_mlp_conv(m)
MoE: s = sigmoid(x Wr); top-k of (s + bias); weights = s_top / sum(s_top) * route_scale;
     expert(x) = (softcap_4(g) * sigmoid(g) * softcap_25(u)) W2, [g | u] = x W13  (halves)
Loop: layers [ls, le) run loop_num_passes times. Pass p > 1 restarts from the pre-loop hidden states and
     block list; its messages for loop layer j are BAR with queries Qmsg[j] (4, H) over
     [blocks the previous pass appended after its first one..., previous pass output].
Head: logits = softcap_30(rms(BAR_final(blocks, h)[0]) * w_norm @ W_lm), unpadded_vocab_size columns.

Weight layout (my own; converted in ``build``):
  embed (V, H), embed_norm (H), final_query (1, H), final_norm (H), msg_query (n_loop, 4, H), lm_head_t (H, V_u)
  per layer (``layers[i]``):
    bar_attn (n, H) or None, bar_mlp (1, H), ln_attn (1 or 3, H) stacked input norms, ln_mlp (H)
    w_xq_t (H, h*d + h*d + h*d_rel + h): fused, transposed, query-side projection [q | out gate | rel | sink]
    w_kv_t (H, 2*g*d): fused, transposed [k | v]
    q_scale (h, d), rel_scale (h, d_rel), rel_proj (d_rel, extent), w_o_t (h*d, H)
    kv_taps (2, K, g*d): k and v conv taps in lag order (taps[l] weights the token l steps back)
    kv_dyn_t (2, H, g*K) (full layers only): the dynamic tap projections, transposed
    post_taps (2, K, H): post-attention and post-MLP conv taps, lag order
    router_t (H, E), router_bias (E), w13_t (E, H, 2I), w2_t (E, I, H)
    loop layers: gate_down_t (4, 2H, r), gate_up_t (4, r, 2H) = [forget | message], order q, k, v, mlp
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "conv_tap_order",  # static conv1d kernels (C, 1, K) copied into lag order without flipping: w[0] weights the current token
    "conv_scale_2k1",  # static short convs divided by sqrt(2K+1) (the dynamic conv's constant) instead of sqrt(K+1)
    "dyn_conv_static_no_transpose",  # dynamic conv static taps (K, C) reshaped to (C, K) instead of transposed
    "sliding_window_off_by_one",  # sliding mask keeps i - j <= window (window + 1 keys) instead of i - j < window
    "sink_scaled",  # attention sink logit concatenated before the 1/sqrt(d) scaling, so it is scaled as well
    "out_gate_after_proj",  # sigmoid output gate applied after the output projection instead of before it
    "block_append_output",  # at a block boundary the model appends the layer's output instead of its input to the block list
    "router_bias_in_weights",  # expert weights gathered from (scores + correction bias) instead of the raw scores
    "swiglu_capped_sigmoid",  # the SwiGLU sigmoid sees the softcapped gate instead of the raw gate
    "bar_values_unnormed",  # block attention residual mixes the raw block states (values) instead of the rms-normed ones
    "loop_message_blocks_off_by_one",  # messages read the previous pass's blocks from num_pre_loop_blocks, not +1 (keeps its first)
    "loop_block_states_not_reset",  # later loop passes keep the previous pass's block list instead of restarting from the pre-loop one
    "conv_mask_missing",  # padding positions not zeroed before the short convolutions (left padding leaks into real tokens)
    "log_scale_ignores_position_ids",  # log scaling tau computed from the column index instead of position_ids
]

PADDING_ONLY = ["conv_mask_missing", "log_scale_ignores_position_ids"]

CLEAN = [
    "conv_f_conv1d",  # short convolutions through F.conv1d (flipped taps, left zero padding) instead of a shift-and-sum loop
    "sink_lse_rescale",  # plain softmax, then the sink folded in as a factor sigmoid(logsumexp - sink)
    "moe_dense",  # every expert on every token, combined with a dense (tokens, E) routing weight matrix
    "rel_bias_toeplitz",  # relative bias from a precomputed (d_rel, S, S) Toeplitz table of the profiles, via einsum
    "gqa_grouped_query",  # GQA by grouping query heads (B, g, h/g, S, d) instead of repeating the kv heads
]


def _bug(name):
    return BUG == name


# ----------------------------------------------------------------------------------------------- helpers


def _rms(x, eps, weight=None):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _softcap(x, cap):
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def _clip(x, thr):
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    factor = (thr / (n + 1e-6)).clamp(max=1.0)
    return x * factor


def _shift(x, lag):
    """x (B, S, C) moved ``lag`` steps later along S, zeros in front."""
    if lag == 0:
        return x
    return F.pad(x, (0, 0, lag, 0))[:, : x.shape[1]]


def _static_conv(x, taps, mask, const):
    """x (B, S, C), taps (K, C) in lag order. (sum_l taps[l] * x_{t-l} + x_t) / sqrt(const)."""
    residual = x
    if mask is not None and not _bug("conv_mask_missing"):
        x = x * mask[:, :, None].to(x.dtype)
    K = taps.shape[0]
    if BUG == "conv_f_conv1d":
        C = x.shape[-1]
        kernel = taps.flip(0).t().unsqueeze(1)  # (C, 1, K), last tap = current token
        y = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), kernel, groups=C).transpose(1, 2)
    else:
        y = sum(_shift(x, l) * taps[l] for l in range(K))
    return (y + residual) / math.sqrt(const)


def _dynamic_conv(x, taps, dyn, nkv, mask):
    """x (B, S, C), taps (K, C) lag order, dyn (B, S, nkv, K) per-token taps shared within each kv head."""
    B, S, C = x.shape
    K = taps.shape[0]
    residual = x
    if mask is not None and not _bug("conv_mask_missing"):
        x = x * mask[:, :, None].to(x.dtype)
    if _bug("dyn_conv_static_no_transpose"):
        static = taps.reshape(C, K)
    else:
        static = taps.t()
    w = static.view(nkv, C // nkv, K) + dyn.view(B, S, nkv, 1, K)  # (B, S, nkv, d, K)
    w = w.reshape(B, S, C, K)
    if BUG == "conv_f_conv1d":
        xp = F.pad(x.transpose(1, 2), (K - 1, 0))  # (B, C, S+K-1)
        win = xp.unfold(-1, K, 1).flip(-1).transpose(1, 2)  # (B, S, C, K), [..., l] = l steps back
        y = (win * w).sum(-1)
    else:
        y = sum(_shift(x, l) * w[..., l] for l in range(K))
    return (y + residual) / math.sqrt(2 * K + 1)


def _bar(blocks, partial, query, eps=1e-6):
    """Block attention residual: blocks (B, S, N, H), partial (B, S, H), query (n, H) -> (B, S, n, H)."""
    raw = torch.cat([blocks, partial.unsqueeze(-2)], dim=-2).float()
    src = _rms(raw, eps)
    H = src.shape[-1]
    logits = torch.einsum("nh,bsmh->bsnm", query.float(), src) / math.sqrt(H)
    w = torch.softmax(logits, dim=-1)
    values = raw if _bug("bar_values_unnormed") else src
    return torch.einsum("bsnm,bsmh->bsnh", w, values)


def _message_gate(x, m, down_t, up_t, eps):
    z = torch.cat([_rms(x, eps), _rms(m, eps)], dim=-1) @ down_t
    fm = torch.tanh(z @ up_t)
    H = x.shape[-1]
    forget, msg = fm[..., :H], fm[..., H:]
    return (1 - forget) * x + msg * m


# ----------------------------------------------------------------------------------------------- model


class _Layer(nn.Module):
    pass


class Inkling2LoopPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config
        self.H = c.hidden_size
        self.eps = c.rms_norm_eps
        self.K = c.conv_kernel_size
        self.E = c.n_routed_experts
        self.top_k = c.num_experts_per_tok
        self.I = c.moe_intermediate_size
        self.route_scale = c.route_scale
        self.scoring = getattr(c, "scoring_func", "sigmoid")
        self.window = c.sliding_window_size
        self.alpha = c.log_scaling_alpha
        self.n_floor = c.log_scaling_n_floor
        self.qk_thr = c.qk_l2_clip_threshold
        self.rel_thr = c.rel_l2_clip_threshold
        self.d_rel = c.d_rel
        self.mlp_gate_cap = c.mlp_gate_softcap
        self.mlp_up_cap = c.mlp_up_softcap
        self.final_cap = c.final_logit_softcapping
        self.per_block = c.n_layers_per_attn_res_block
        self.loop_start = c.loop_layer_index_start
        self.loop_end = c.loop_layer_index_end
        self.passes = c.loop_num_passes
        self.layer_types = list(c.layer_types)
        self.layers = nn.ModuleList()

    # ------------------------------------------------------------------ attention pieces
    def _log_tau(self, position_ids):
        pos = position_ids.float()
        return 1.0 + self.alpha * torch.log(((pos + 1) / self.n_floor).clamp(min=1.0))

    def _rel_bias(self, L, r, S):
        """r (B, S, h, d_rel) -> bias (B, h, S, S)."""
        extent = L.rel_proj.shape[-1]
        i = torch.arange(S, device=r.device)
        dist = i[:, None] - i[None, :]
        valid = (dist >= 0) & (dist < extent)
        if BUG == "rel_bias_toeplitz":
            table = L.rel_proj[:, dist.clamp(0, extent - 1)] * valid  # (d_rel, S, S)
            return torch.einsum("bihd,dij->bhij", r, table)
        prof = (r @ L.rel_proj).permute(0, 2, 1, 3)  # (B, h, S, extent)
        idx = dist.clamp(0, extent - 1).expand(*prof.shape[:2], S, S)
        return prof.gather(-1, idx).masked_fill(~valid, 0.0)

    def _attention(self, L, xq, xk, xv, ctx):
        B, S, _ = xq.shape
        h, g, d = L.n_heads, L.n_kv, L.head_dim
        full = not L.sliding
        proj = xq @ L.w_xq_t
        o1, o2, o3 = h * d, 2 * h * d, 2 * h * d + h * self.d_rel
        q_lin, gate_lin, r_lin, sink = proj[..., :o1], proj[..., o1:o2], proj[..., o2:o3], proj[..., o3:]
        kv_dim = g * d
        if xk is xv:
            kv = xk @ L.w_kv_t
            k_lin, v_lin = kv[..., :kv_dim], kv[..., kv_dim:]
        else:
            k_lin, v_lin = xk @ L.w_kv_t[:, :kv_dim], xv @ L.w_kv_t[:, kv_dim:]

        q = _clip(q_lin.view(B, S, h, d) * L.q_scale, self.qk_thr)
        r = _clip(r_lin.view(B, S, h, self.d_rel) * L.rel_scale, self.rel_thr)
        if full:
            if _bug("log_scale_ignores_position_ids"):
                pos = torch.arange(S, device=xq.device)[None].expand(B, S)
            else:
                pos = ctx["position_ids"]
            tau = self._log_tau(pos)[..., None, None]
            q = q * tau
            r = r * tau

        mask = ctx["conv_mask"]
        if full:
            dk = (xk @ L.kv_dyn_t[0]).view(B, S, g, self.K)
            dv = (xv @ L.kv_dyn_t[1]).view(B, S, g, self.K)
            k_c = _dynamic_conv(k_lin, L.kv_taps[0], dk, g, mask)
            v_c = _dynamic_conv(v_lin, L.kv_taps[1], dv, g, mask)
        else:
            const = 2 * self.K + 1 if _bug("conv_scale_2k1") else self.K + 1
            k_c = _static_conv(k_lin, L.kv_taps[0], mask, const)
            v_c = _static_conv(v_lin, L.kv_taps[1], mask, const)
        k = _clip(k_c.view(B, S, g, d), self.qk_thr)
        v = _rms(v_c.view(B, S, g, d), self.eps)

        q = q.transpose(1, 2)  # (B, h, S, d)
        k = k.transpose(1, 2)  # (B, g, S, d)
        v = v.transpose(1, 2)
        bias = self._rel_bias(L, r, S)  # (B, h, S, S)
        allowed = ctx["allowed_sliding"] if L.sliding else ctx["allowed_full"]  # (B, S, S)
        sink = sink.transpose(1, 2).unsqueeze(-1)  # (B, h, S, 1)
        scale = d**-0.5
        neg = torch.finfo(torch.float32).min

        if BUG == "gqa_grouped_query":
            rep = h // g
            qg = q.reshape(B, g, rep, S, d)
            scores = torch.einsum("bgrid,bgjd->bgrij", qg, k).reshape(B, h, S, S)
        else:
            rep = h // g
            k_r = k.repeat_interleave(rep, dim=1)
            scores = q @ k_r.transpose(-1, -2)
        if _bug("sink_scaled"):
            cat = torch.cat([scores, sink], dim=-1) * scale
            scores, sink = cat[..., :-1], cat[..., -1:]
        else:
            scores = scores * scale
        scores = scores + bias
        scores = scores.masked_fill(~allowed[:, None], neg)

        if BUG == "sink_lse_rescale":
            p = torch.softmax(scores, dim=-1)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            p = p * torch.sigmoid(lse - sink)
        else:
            p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]

        if BUG == "gqa_grouped_query":
            out = torch.einsum("bgrij,bgjd->bgrid", p.reshape(B, g, rep, S, S), v).reshape(B, h, S, d)
        else:
            out = p @ v.repeat_interleave(rep, dim=1)
        out = out.transpose(1, 2).reshape(B, S, h * d)
        gate = torch.sigmoid(gate_lin)
        if _bug("out_gate_after_proj"):
            return (out @ L.w_o_t) * gate
        return (out * gate) @ L.w_o_t

    # ------------------------------------------------------------------ MoE
    def _moe(self, L, x):
        B, S, H = x.shape
        t = x.reshape(-1, H).float()
        logits = t @ L.router_t
        scores = torch.sigmoid(logits) if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores + L.router_bias
        idx = torch.topk(choice, self.top_k, dim=-1).indices
        src = choice if _bug("router_bias_in_weights") else scores
        w = src.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.route_scale

        def act(gu):
            gt, up = gu[..., : self.I], gu[..., self.I :]
            capped = _softcap(gt, self.mlp_gate_cap)
            sig = torch.sigmoid(capped if _bug("swiglu_capped_sigmoid") else gt)
            return capped * sig * _softcap(up, self.mlp_up_cap)

        if BUG == "moe_dense":
            dense = torch.zeros(t.shape[0], self.E, dtype=t.dtype, device=t.device).scatter(1, idx, w)
            gu = torch.einsum("th,ehf->etf", t, L.w13_t)
            y = torch.einsum("etf,efh->eth", act(gu), L.w2_t)
            out = torch.einsum("te,eth->th", dense, y)
        else:
            out = torch.zeros_like(t)
            for e in range(self.E):
                tok, slot = torch.where(idx == e)
                if tok.numel() == 0:
                    continue
                y = act(t[tok] @ L.w13_t[e]) @ L.w2_t[e]
                out.index_add_(0, tok, y * w[tok, slot, None])
        return out.view(B, S, H)

    # ------------------------------------------------------------------ decoder layer
    def _layer(self, L, hs, blocks, msgs, ctx):
        block_residual = hs
        mask = ctx["conv_mask"]
        if msgs is not None:
            m_q, m_k, m_v, m_mlp = msgs.unbind(-2)

        def gate(i, x, m):
            return _message_gate(x, m, L.gate_down_t[i], L.gate_up_t[i], self.eps)

        if L.sliding:
            a = hs if L.bar_attn is None else _bar(blocks, hs, L.bar_attn)[..., 0, :]
            if msgs is None:
                xq = xk = xv = _rms(a, self.eps, L.ln_attn[0])
            else:
                xq = _rms(gate(0, a, m_q), self.eps, L.ln_attn[0])
                xk = _rms(gate(1, a, m_k), self.eps, L.ln_attn[0])
                xv = _rms(gate(2, a, m_v), self.eps, L.ln_attn[0])
        else:
            if L.bar_attn is None:
                aq = ak = av = hs
            else:
                aq, ak, av = _bar(blocks, hs, L.bar_attn).unbind(-2)
            if msgs is not None:
                aq, ak, av = gate(0, aq, m_q), gate(1, ak, m_k), gate(2, av, m_v)
            xq = _rms(aq, self.eps, L.ln_attn[0])
            xk = _rms(ak, self.eps, L.ln_attn[1])
            xv = _rms(av, self.eps, L.ln_attn[2])

        o = self._attention(L, xq, xk, xv, ctx)
        const = 2 * self.K + 1 if _bug("conv_scale_2k1") else self.K + 1
        o = _static_conv(o, L.post_taps[0], mask, const)
        if L.boundary:
            blocks = torch.cat([blocks, block_residual.unsqueeze(-2)], dim=-2)
            residual = o
        else:
            residual = block_residual + o
        m = _bar(blocks, residual, L.bar_mlp)[..., 0, :]
        if msgs is not None:
            m = gate(3, m, m_mlp)
        m = self._moe(L, _rms(m, self.eps, L.ln_mlp))
        m = _static_conv(m, L.post_taps[1], mask, const)
        return residual + m

    def _run(self, idx, hs, blocks, msgs, ctx):
        L = self.layers[idx]
        new = self._layer(L, hs, blocks, msgs, ctx)
        if L.boundary:
            blocks = torch.cat([blocks, (new if _bug("block_append_output") else hs).unsqueeze(-2)], dim=-2)
        return new, blocks

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None].expand(B, S)
        else:
            position_ids = position_ids.expand(B, S)
        i = torch.arange(S, device=dev)
        causal = i[None, :] <= i[:, None]  # [q, k]
        window = (
            (i[:, None] - i[None, :]) <= self.window
            if _bug("sliding_window_off_by_one")
            else ((i[:, None] - i[None, :]) < self.window)
        )
        if attention_mask is None:
            keep = torch.ones(B, S, dtype=torch.bool, device=dev)
        else:
            keep = attention_mask.bool()
        allowed_full = causal[None] & keep[:, None, :]
        allowed_sliding = allowed_full & window[None]
        conv_mask = None
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            conv_mask = attention_mask.float()
        ctx = dict(
            position_ids=position_ids,
            allowed_full=allowed_full,
            allowed_sliding=allowed_sliding,
            conv_mask=conv_mask,
        )

        hs = _rms(self.embed[input_ids], self.eps, self.embed_norm)
        blocks = hs.new_zeros(B, S, 0, self.H)
        ls, le = self.loop_start, self.loop_end
        for idx in range(ls):
            hs, blocks = self._run(idx, hs, blocks, None, ctx)
        pre_hs, pre_blocks = hs, blocks
        n_pre = pre_blocks.shape[-2]
        for idx in range(ls, le):
            hs, blocks = self._run(idx, hs, blocks, None, ctx)
        for _ in range(1, self.passes):
            start = n_pre if _bug("loop_message_blocks_off_by_one") else n_pre + 1
            prev_blocks, prev_hs = blocks[..., start:, :], hs
            if _bug("loop_block_states_not_reset"):
                hs = pre_hs
            else:
                hs, blocks = pre_hs, pre_blocks
            for j, idx in enumerate(range(ls, le)):
                msgs = _bar(prev_blocks, prev_hs, self.msg_query[j])
                hs, blocks = self._run(idx, hs, blocks, msgs, ctx)
        for idx in range(le, len(self.layers)):
            hs, blocks = self._run(idx, hs, blocks, None, ctx)

        hs = _bar(blocks, hs, self.final_query)[..., 0, :]
        hs = _rms(hs, self.eps, self.final_norm)
        return _softcap(hs @ self.lm_head_t, self.final_cap)


# ----------------------------------------------------------------------------------------------- loading


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _conv_taps(w):
    """nn.Conv1d depthwise weight (C, 1, K), whose last tap weights the current token, -> (K, C) lag order."""
    w = w[:, 0, :]
    if _bug("conv_tap_order"):
        return w.t()
    return w.flip(-1).t()


def build(state_dict, config):
    sd = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state_dict.items()}
    model = Inkling2LoopPort(config)
    c = config
    model.embed = _p(sd["embed_tokens.weight"])
    model.embed_norm = _p(sd["embed_tokens.embed_norm.weight"])
    model.final_query = _p(sd["final_input.query"].view(-1, c.hidden_size))
    model.final_norm = _p(sd["norm.weight"])
    model.msg_query = _p(sd["message_input.query"])
    model.lm_head_t = _p(sd["lm_head.weight"][: c.unpadded_vocab_size].t())

    for i in range(c.num_hidden_layers):
        pre = f"layers.{i}."
        L = _Layer()
        L.sliding = c.layer_types[i] == "hybrid_sliding"
        L.loop = c.loop_layer_index_start <= i < c.loop_layer_index_end
        L.boundary = i % c.n_layers_per_attn_res_block == 0
        L.n_heads = c.swa_num_attention_heads if L.sliding else c.num_attention_heads
        L.n_kv = c.swa_num_key_value_heads if L.sliding else c.num_key_value_heads
        L.head_dim = c.swa_head_dim if L.sliding else c.head_dim
        q = sd.get(pre + "attention_input.query")
        L.bar_attn = None if q is None else _p(q.view(-1, c.hidden_size))
        L.bar_mlp = _p(sd[pre + "mlp_input.query"].view(-1, c.hidden_size))
        if L.sliding:
            L.ln_attn = _p(sd[pre + "input_layernorm.weight"][None])
        else:
            L.ln_attn = _p(torch.stack([sd[pre + f"{n}_input_layernorm.weight"] for n in "qkv"]))
        L.ln_mlp = _p(sd[pre + "post_attention_layernorm.weight"])
        a = pre + "self_attn."
        L.w_xq_t = _p(
            torch.cat(
                [
                    sd[a + "q_proj.linear.weight"],
                    sd[a + "o_proj.gate_proj.weight"],
                    sd[a + "relative_position_bias.linear.weight"],
                    sd[a + "sink_proj.weight"],
                ]
            ).t()
        )
        L.w_kv_t = _p(torch.cat([sd[a + "k_proj.linear.weight"], sd[a + "v_proj.linear.weight"]]).t())
        L.q_scale = _p(sd[a + "q_proj.norm.scale"])
        L.rel_scale = _p(sd[a + "relative_position_bias.norm.scale"])
        L.rel_proj = _p(sd[a + "relative_position_bias.proj"])
        L.w_o_t = _p(sd[a + "o_proj.linear.weight"].t())
        if L.sliding:
            L.kv_taps = _p(torch.stack([_conv_taps(sd[a + f"{n}_proj.sconv.conv1d.weight"]) for n in "kv"]))
        else:
            L.kv_taps = _p(torch.stack([sd[a + f"{n}_proj.sconv.static_weight"] for n in "kv"]))
            L.kv_dyn_t = _p(torch.stack([sd[a + f"{n}_proj.sconv.weight_proj.weight"].t() for n in "kv"]))
        L.post_taps = _p(
            torch.stack(
                [
                    _conv_taps(sd[pre + "post_attention_convolution.conv1d.weight"]),
                    _conv_taps(sd[pre + "post_mlp_convolution.conv1d.weight"]),
                ]
            )
        )
        L.router_t = _p(sd[pre + "mlp.gate.weight"].t())
        L.router_bias = _p(sd[pre + "mlp.gate.e_score_correction_bias"])
        L.w13_t = _p(sd[pre + "mlp.experts.gate_up_proj"].transpose(1, 2))
        L.w2_t = _p(sd[pre + "mlp.experts.down_proj"].transpose(1, 2))
        if L.loop:
            names = ["q", "k", "v", "mlp"]
            L.gate_down_t = _p(torch.stack([sd[pre + f"{n}_message_gate.down_proj.weight"].t() for n in names]))
            L.gate_up_t = _p(
                torch.stack(
                    [
                        torch.cat(
                            [
                                sd[pre + f"{n}_message_gate.forget_gate_proj.weight"],
                                sd[pre + f"{n}_message_gate.message_gate_proj.weight"],
                            ]
                        ).t()
                        for n in names
                    ]
                )
            )
        model.layers.append(L)
    return model.float().eval()
