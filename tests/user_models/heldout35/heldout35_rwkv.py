"""Hand-written plain-PyTorch port of RWKV-4 (RwkvForCausalLM), no attention, no positions.

Architecture as this port implements it:
- token embedding (no scaling), then an extra LayerNorm `ln0` on the embeddings (block 0 only);
  untied head; final LayerNorm `ln_out` with LayerNorm's default eps 1e-5 (the block norms use
  config.layer_norm_epsilon).
- block i, pre-norm:  h = h + TimeMix(LN1(h));  h = h + ChannelMix(LN2(h)).
- token shift: prev(x)[t] = x[t - 1], zero at t = 0 (the model starts from a zero state); each branch shifts its
  own normed input.  lerp(x, m) = m * x + (1 - m) * prev(x), one learned m per channel and per projection.
- TimeMix: k = W_k lerp(x, m_k), v = W_v lerp(x, m_v), r = sigmoid(W_r lerp(x, m_r)); per channel the WKV
  recurrence with decay w = -exp(time_decay) (per step, in log space) and bonus u = time_first for the current
  token:
      y_t = (sum_{i<t} e^{(t-1-i) w + k_i} v_i + e^{u + k_t} v_t) / (sum_{i<t} e^{(t-1-i) w + k_i} + e^{u + k_t})
  (evaluated as a max-stabilised scan); out = W_o (r * y).
- ChannelMix: out = sigmoid(W_r' lerp(x, m_r')) * W_v' relu(W_k' lerp(x, m_k'))**2.
- inference rescaling (config.rescale_every = R > 0): W_o and W_v' of block i are divided by 2**(i // R) at load
  and the residual stream is halved after every block i with (i + 1) % R == 0 (as Transformers does in eval).
- the attention mask and position ids are accepted and ignored: Transformers' RWKV runs padding tokens through
  the recurrence like any other token, so a left-padded row's state includes its padding.
Weight layout of this port (own names):
- emb (V, H); ln0 / ln_out (2, H) = [weight; bias]; head_t (H, V) = head transposed.
- per block `blocks[i]`: ln1 / ln2 (2, H); att_mix (3, H) rows [key, value, receptance];
  w_kvr (H, 3A) = [key | value | receptance] fused + transposed; decay (A,) = -exp(time_decay) (precomputed);
  bonus (A,) = time_first; w_out (A, H) transposed and rescaled;
  ffn_mix (2, H) rows [key, receptance]; w_fk (H, I), w_fr (H, H), w_fv (I, H) transposed (w_fv rescaled).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rwkv_decay_no_exp",  # decay taken as -time_decay at load: the exp of the raw time_decay is missing
    "rwkv_bonus_skipped",  # current token weighted e^{k_t} in the WKV output: the time_first bonus u is not added
    "rwkv_state_before_output",  # WKV state updated with token t before y_t is read (past decayed once too often, no u)
    "rwkv_shift_future",  # time-mix token shift pads at the end and takes x[t + 1] instead of x[t - 1]
    "rwkv_mix_inverted",  # time-mix lerp as (1 - m) * x + m * prev(x): the mix weight put on the shifted token
    "rwkv_value_mix_from_key",  # time_mix_value loaded from time_mix_key (copy-paste of the key row)
    "rwkv_kv_split_swapped",  # fused [key | value | receptance] projection split as [value | key | receptance]
    "rwkv_ffn_relu_unsquared",  # channel-mix key activation relu(x) instead of relu(x) ** 2
    "rwkv_ffn_shift_zero",  # channel-mix previous-token input never filled: lerps towards zero (no token shift)
    "rwkv_pre_ln_skipped",  # the extra ln0 LayerNorm on the embeddings (block 0) is not applied
    "rwkv_rescale_weights_only",  # output weights divided by 2**(i // R) at load but the residual never halved
    "rwkv_ln_out_eps_config",  # final ln_out built with config.layer_norm_epsilon instead of LayerNorm's 1e-5
    "rwkv_head_tied",  # head taken as the (transposed) embedding although tie_word_embeddings is False
    "rwkv_pad_state_frozen",  # padding skipped: state not updated and token shift zeroed across pad positions
]
PADDING_ONLY = {"rwkv_pad_state_frozen"}
CLEAN = [
    "rwkv_parallel_wkv",  # WKV as a causal softmax over scores (t-1-i) w + k_i (and u + k_t on the diagonal)
    "rwkv_chunked_wkv",  # WKV in chunks of 8: softmax inside a chunk plus a carried (log-normaliser, mean) state
    "rwkv_normalized_state",  # scan keeping (log denominator, normalised numerator) instead of (num, den, max)
    "rwkv_fused_mix",  # token-shift lerp folded into the projection: [x | prev(x)] @ [m W ; (1 - m) W]
    "rwkv_eps_folded_rescale",  # no rescaling of weights / residual; each LayerNorm eps scaled by 4**(halvings) instead
]

LN_OUT_EPS = 1e-5  # Transformers builds ln_out with nn.LayerNorm's default eps


def _ln(x, p, eps):
    return F.layer_norm(x, (x.shape[-1],), p[0], p[1], eps)


def _prev(x, keep=None):
    """x[t - 1] (zero at t = 0); with `keep` (the padding bug), zero where the previous token is padding."""
    if BUG == "rwkv_shift_future":
        return F.pad(x[:, 1:], (0, 0, 0, 1))
    out = F.pad(x[:, :-1], (0, 0, 1, 0))
    if keep is not None:
        prev_keep = F.pad(keep[:, :-1], (1, 0), value=False)
        out = torch.where(prev_keep[..., None], out, torch.zeros_like(out))
    return out


def _wkv_scan(w, u, k, v, keep=None):
    """Max-stabilised recurrence: state (num, den) scaled by e^{-m}."""
    B, S, A = k.shape
    num = k.new_zeros(B, A)
    den = k.new_zeros(B, A)
    m = k.new_full((B, A), -1e38)
    ys = []
    for t in range(S):
        kt, vt = k[:, t], v[:, t]
        if BUG == "rwkv_state_before_output":
            top = torch.maximum(m + w, kt)
            a, b = torch.exp(m + w - top), torch.exp(kt - top)
            num, den, m = a * num + b * vt, a * den + b, top
            ys.append(num / den)
            continue
        cur = kt if BUG == "rwkv_bonus_skipped" else u + kt
        top = torch.maximum(m, cur)
        a, b = torch.exp(m - top), torch.exp(cur - top)
        ys.append((a * num + b * vt) / (a * den + b))
        top = torch.maximum(m + w, kt)
        a, b = torch.exp(m + w - top), torch.exp(kt - top)
        n2, d2 = a * num + b * vt, a * den + b
        if keep is not None:
            kt_ = keep[:, t, None]
            n2, d2, top = torch.where(kt_, n2, num), torch.where(kt_, d2, den), torch.where(kt_, top, m)
        num, den, m = n2, d2, top
    return torch.stack(ys, 1)


def _wkv_normalized(w, u, k, v):
    """Scan over (log of the denominator, numerator / denominator)."""
    B, S, A = k.shape
    logd = k.new_full((B, A), float("-inf"))
    mean = k.new_zeros(B, A)
    ys = []
    for t in range(S):
        kt, vt = k[:, t], v[:, t]
        lo = torch.logaddexp(logd, u + kt)
        ys.append(torch.exp(logd - lo) * mean + torch.exp(u + kt - lo) * vt)
        ln = torch.logaddexp(logd + w, kt)
        mean = torch.exp(logd + w - ln) * mean + torch.exp(kt - ln) * vt
        logd = ln
    return torch.stack(ys, 1)


def _wkv_parallel(w, u, k, v):
    """All outputs at once: y_t = softmax_i(score_{t,i}) . v over i <= t."""
    S = k.shape[1]
    t = torch.arange(S)
    lag = (t[:, None] - 1 - t[None, :]).to(k.dtype)  # (t, i)
    scores = lag[None, :, :, None] * w + k[:, None, :, :]  # (B, t, i, A)
    diag = torch.eye(S, dtype=torch.bool)[None, :, :, None]
    scores = torch.where(diag, (u + k)[:, None, :, :].expand_as(scores), scores)
    future = (t[None, :] > t[:, None])[None, :, :, None]
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("btia,bia->bta", torch.softmax(scores, dim=2), v)


def _wkv_chunked(w, u, k, v, chunk=8):
    """Chunks of `chunk` tokens; the past before a chunk is one virtual key (log-normaliser, weighted mean)."""
    B, S, A = k.shape
    logd = k.new_full((B, A), float("-inf"))
    mean = k.new_zeros(B, A)
    ys = []
    for c0 in range(0, S, chunk):
        kc, vc = k[:, c0 : c0 + chunk], v[:, c0 : c0 + chunk]
        C = kc.shape[1]
        j = torch.arange(C)
        lag = (j[:, None] - 1 - j[None, :]).to(k.dtype)
        sc = lag[None, :, :, None] * w + kc[:, None]
        sc = torch.where(torch.eye(C, dtype=torch.bool)[None, :, :, None], (u + kc)[:, None].expand_as(sc), sc)
        sc = sc.masked_fill((j[None, :] > j[:, None])[None, :, :, None], float("-inf"))
        past = (logd[:, None] + j.to(k.dtype)[None, :, None] * w)[:, :, None]  # (B, C, 1, A)
        sc = torch.cat([past, sc], 2)
        vals = torch.cat([mean[:, None].expand(B, C, A)[:, :, None], vc[:, None].expand(B, C, C, A)], 2)
        ys.append((torch.softmax(sc, 2) * vals).sum(2))
        # state after the chunk: past decayed C steps, chunk token i decayed (C - 1 - i) steps
        st = torch.cat([(logd + C * w)[:, None], (C - 1 - j).to(k.dtype)[None, :, None] * w + kc], 1)
        stv = torch.cat([mean[:, None], vc], 1)
        p = torch.softmax(st, 1)
        mean = (p * stv).sum(1)
        logd = torch.logsumexp(st, 1)
    return torch.cat(ys, 1)


class _Block(nn.Module):
    pass


class RwkvPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(name):
            return sd[name].detach().clone().float()

        self.eps = cfg.layer_norm_epsilon
        self.R = cfg.rescale_every
        self.L = cfg.num_hidden_layers
        self.emb = nn.Parameter(g("rwkv.embeddings.weight"))
        self.ln0 = nn.Parameter(torch.stack([g("rwkv.blocks.0.pre_ln.weight"), g("rwkv.blocks.0.pre_ln.bias")]))
        self.ln_out = nn.Parameter(torch.stack([g("rwkv.ln_out.weight"), g("rwkv.ln_out.bias")]))
        head = g("rwkv.embeddings.weight") if BUG == "rwkv_head_tied" else g("head.weight")
        self.head_t = nn.Parameter(head.t().contiguous())
        rescale = self.R > 0 and BUG != "rwkv_eps_folded_rescale"
        self.blocks = nn.ModuleList()
        for i in range(self.L):
            p = f"rwkv.blocks.{i}."
            a, f = p + "attention.", p + "feed_forward."
            blk = _Block()
            blk.ln1 = nn.Parameter(torch.stack([g(p + "ln1.weight"), g(p + "ln1.bias")]))
            blk.ln2 = nn.Parameter(torch.stack([g(p + "ln2.weight"), g(p + "ln2.bias")]))
            mv = "time_mix_key" if BUG == "rwkv_value_mix_from_key" else "time_mix_value"
            mix = torch.stack([g(a + n).reshape(-1) for n in ("time_mix_key", mv, "time_mix_receptance")])
            w_kvr = torch.cat([g(a + n + ".weight") for n in ("key", "value", "receptance")], 0).t()  # (H, 3A)
            if BUG == "rwkv_fused_mix":
                m3 = mix.repeat_interleave(w_kvr.shape[1] // 3, dim=0).t()  # (H, 3A): column j's mix per input
                blk.w_kvr2 = nn.Parameter(torch.cat([w_kvr * m3, w_kvr * (1 - m3)], 0).contiguous())
            else:
                blk.att_mix = nn.Parameter(mix)
                blk.w_kvr = nn.Parameter(w_kvr.contiguous())
            td = g(a + "time_decay")
            blk.decay = nn.Parameter(-td if BUG == "rwkv_decay_no_exp" else -torch.exp(td))
            blk.bonus = nn.Parameter(g(a + "time_first"))
            scale = 2.0 ** (i // self.R) if rescale else 1.0
            blk.w_out = nn.Parameter((g(a + "output.weight") / scale).t().contiguous())
            blk.ffn_mix = nn.Parameter(
                torch.stack([g(f + n).reshape(-1) for n in ("time_mix_key", "time_mix_receptance")])
            )
            blk.w_fk = nn.Parameter(g(f + "key.weight").t().contiguous())
            blk.w_fr = nn.Parameter(g(f + "receptance.weight").t().contiguous())
            blk.w_fv = nn.Parameter((g(f + "value.weight") / scale).t().contiguous())
            self.blocks.append(blk)

    def _time_mix(self, blk, x, keep):
        s = _prev(x, keep)
        if BUG == "rwkv_fused_mix":
            kvr = torch.cat([x, s], -1) @ blk.w_kvr2
            k, v, r = kvr.chunk(3, -1)
        else:
            m = blk.att_mix[:, None, None, :]  # (3, 1, 1, H)
            if BUG == "rwkv_mix_inverted":
                mixed = (1 - m) * x + m * s
            else:
                mixed = m * x + (1 - m) * s
            A = blk.w_kvr.shape[1] // 3
            wk, wv, wr = blk.w_kvr.split(A, 1)
            if BUG == "rwkv_kv_split_swapped":
                wv, wk, wr = blk.w_kvr.split(A, 1)
            k, v, r = mixed[0] @ wk, mixed[1] @ wv, mixed[2] @ wr
        r = torch.sigmoid(r)
        if BUG == "rwkv_parallel_wkv":
            y = _wkv_parallel(blk.decay, blk.bonus, k, v)
        elif BUG == "rwkv_chunked_wkv":
            y = _wkv_chunked(blk.decay, blk.bonus, k, v)
        elif BUG == "rwkv_normalized_state":
            y = _wkv_normalized(blk.decay, blk.bonus, k, v)
        else:
            y = _wkv_scan(blk.decay, blk.bonus, k, v, keep)
        return (r * y) @ blk.w_out

    def _channel_mix(self, blk, x, keep):
        s = torch.zeros_like(x) if BUG == "rwkv_ffn_shift_zero" else _prev(x, keep)
        mk, mr = blk.ffn_mix[0], blk.ffn_mix[1]
        xk = mk * x + (1 - mk) * s
        xr = mr * x + (1 - mr) * s
        hid = torch.relu(xk @ blk.w_fk)
        if BUG != "rwkv_ffn_relu_unsquared":
            hid = hid * hid
        return torch.sigmoid(xr @ blk.w_fr) * (hid @ blk.w_fv)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        keep = None
        if BUG == "rwkv_pad_state_frozen" and attention_mask is not None:
            keep = attention_mask.bool()
        folded = BUG == "rwkv_eps_folded_rescale" and self.R > 0
        h = self.emb[input_ids]
        if BUG != "rwkv_pre_ln_skipped":
            h = _ln(h, self.ln0, self.eps)
        for i, blk in enumerate(self.blocks):
            eps = self.eps * 4.0 ** (i // self.R) if folded else self.eps
            h = h + self._time_mix(blk, _ln(h, blk.ln1, eps), keep)
            h = h + self._channel_mix(blk, _ln(h, blk.ln2, eps), keep)
            if self.R > 0 and (i + 1) % self.R == 0 and not folded and BUG != "rwkv_rescale_weights_only":
                h = h / 2
        out_eps = self.eps if BUG == "rwkv_ln_out_eps_config" else LN_OUT_EPS
        if folded:
            out_eps = out_eps * 4.0 ** (self.L // self.R)
        return _ln(h, self.ln_out, out_eps) @ self.head_t


def build(state_dict, config):
    return RwkvPort(state_dict, config).eval()
