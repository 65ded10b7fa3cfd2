"""Hand-written plain-PyTorch port of Dory (DoryForCausalLM, NVIDIA's nGPT-style looped decoder).

Architecture as this port implements it (what differs from a Llama-like model is marked *):
- * every "norm" is a parameter-free L2 projection onto the unit sphere: l2(x) = x * rsqrt(sum(x^2) + 1e-6)
  (a sum over the channels, not a mean: unit norm, not unit RMS).
- token embedding, no scaling; untied lm_head with * a learned per-token logit gain:
  logits = (l2(h) @ W_head^T) * logit_scale / initializer_range.
- * depth recurrence: layers [0, n_in) run once (input section); inp = l2(h); then the recurrent section
  [n_in, n_in + n_rec) runs n_recurrent_loops times, each pass starting from h = l2(h) + inp (the input section's
  output re-injected); then the output section (last n_out layers) runs once; final l2.
- * decoder layer (Gemma2-style sandwich on the sphere, interpolating residual):
    x = l2(h);  a = l2(Attn(x));  h = x + |lambda_1 * s| * (a - x)
    y = l2(h);  m = l2(MLP(y));   h = y + |lambda_2 * s| * (m - y)        s = ngpt_alpha_init / initializer_range
- attention: GQA (kv head of query head j is j // (nq / nkv)), head_dim from config, no biases;
  * q and k are L2-normalised per head, then rotate-half RoPE whose theta depends on the layer type
    (config.rope_parameters[layer_type]); * q is then multiplied per (head, channel) by (sqk * sqrt(hd) / init)^2;
  scores scaled by 1/sqrt(hd); causal mask, plus a sliding window of `sliding_window` keys (kv > q - window) on
  "sliding_attention" layers; masked entries set to finfo.min (a fully masked padding row averages all values);
  * the head outputs (B, S, nq*hd) are gated by sigmoid(x @ W_g * (s_gate * hidden^0.25 / init)^2), then
  * L2-normalised over all nq*hd channels together (attn_sub_norm), then o_proj.
- MLP: * gate = x @ W_gate * suv_gate * sqrt(hidden), up = x @ W_up * suv_up * sqrt(hidden);
  * l2(silu(gate) * up) @ W_down.
Weight layout of this port (own names; projection matrices stored transposed, (in, out)):
- emb (V, H); head_t (H, V) = lm_head.weight^T; head_gain (V,) = logit_scale / initializer_range.
- per layer `blocks[i]`: w_q (H, nq hd); w_kv (H, 2 nkv hd) = [k | v]; w_g (H, nq hd) = attention gate_proj;
  w_o (nq hd, H); q_gain (nq, 1, hd) = (sqk * sqrt(hd) / init)^2; g_gain (nq hd,) = (s_gate * H^0.25 / init)^2;
  w_gu (H, 2I) = [gate | up]; gu_gain (2I,) = [suv_gate | suv_up] * sqrt(H); w_dn (I, H);
  rate_attn / rate_mlp (H,) = |lambda_1 * s|, |lambda_2 * s|.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "dory_qk_rms_norm",  # q/k normalised to unit RMS (mean over head_dim) instead of unit L2 norm (sum)
    "dory_sqk_not_squared",  # query gain sqk * sqrt(hd) / init used as-is, not squared
    "dory_sqk_before_rope",  # per-channel query gain applied before RoPE instead of after it
    "dory_softmax_scale_dropped",  # no 1/sqrt(head_dim) on the scores (taking unit q/k times sqk as the full scale)
    "dory_sub_norm_per_head",  # attn_sub_norm taken over each head's head_dim channels, not over all nq*hd together
    "dory_gate_from_residual",  # attention gate_proj fed the raw residual stream h instead of l2(h)
    "dory_s_gate_scale_sqrt",  # s_gate scale uses hidden_size**0.5 instead of hidden_size**0.25
    "dory_suv_scale_intermediate",  # suv scale read as sqrt(intermediate_size) instead of sqrt(hidden_size)
    "dory_gate_up_swapped",  # fused MLP weight concatenated [up | gate] but split as [gate | up] at load
    "dory_lambda_no_abs",  # residual interpolation rate lambda * s used signed (the abs() dropped)
    "dory_loop_no_reinject",  # recurrent passes restart from l2(h) alone: the input section's output not re-added
    "dory_lm_head_tied",  # lm_head taken from embed_tokens (tied) although the checkpoint has its own lm_head
    "dory_rope_theta_single",  # every layer uses the sliding layers' rope theta, full-attention layers too
    "dory_sliding_pad_mask_dropped",  # sliding-window layers build their mask without the padding mask
]
PADDING_ONLY = {"dory_sliding_pad_mask_dropped"}
CLEAN = [
    "dory_sdpa",  # attention through F.scaled_dot_product_attention with an additive float mask
    "dory_fused_qkvg",  # q, k, v and the attention gate in one fused (H, (2 nq + 2 nkv) hd) matrix
    "dory_complex_rope",  # RoPE as complex multiplication of (x_i, x_{i+hd/2}) pairs
    "dory_folded_gains",  # gate / suv / logit gains folded into the columns of w_g, w_gu and head_t at load
    "dory_lerp_residual",  # interpolating residual through torch.lerp, loop re-injection as one fused add
]


def _l2(x, mean=False, eps=1e-6):
    """Projection onto the unit sphere (``mean``: unit RMS instead, for the q/k-norm bug)."""
    x = x.float()
    ss = x.pow(2).mean(-1, keepdim=True) if mean else x.pow(2).sum(-1, keepdim=True)
    return x * torch.rsqrt(ss + eps)


class DoryPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        H = cfg.hidden_size
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nq
        self.inter = cfg.intermediate_size
        init = cfg.initializer_range
        self.types = list(cfg.layer_types)
        self.window = cfg.sliding_window
        self.thetas = {t: cfg.rope_parameters[t]["rope_theta"] for t in set(self.types)}
        self.n_in, self.n_rec, self.n_out = cfg.n_input_layers, cfg.n_recurrent_layers, cfg.n_output_layers
        self.loops = cfg.n_recurrent_loops
        self.n_layers = cfg.num_hidden_layers

        self.emb = nn.Parameter(g("model.embed_tokens.weight"))
        head = g("model.embed_tokens.weight") if BUG == "dory_lm_head_tied" else g("lm_head.weight")
        self.head_t = nn.Parameter(head.t().contiguous())
        self.head_gain = nn.Parameter(g("lm_head.logit_scale") / init)

        rate_s = cfg.ngpt_alpha_init / init
        q_s = self.hd**0.5 / init
        g_s = (H**0.5 if BUG == "dory_s_gate_scale_sqrt" else H**0.25) / init
        suv_s = (self.inter if BUG == "dory_suv_scale_intermediate" else H) ** 0.5
        self.blocks = nn.ModuleList()
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            B = nn.Module()
            B.w_q = nn.Parameter(g(a + "q_proj.weight").t().contiguous())
            B.w_kv = nn.Parameter(torch.cat([g(a + "k_proj.weight"), g(a + "v_proj.weight")], 0).t().contiguous())
            B.w_g = nn.Parameter(g(a + "gate_proj.weight").t().contiguous())
            B.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            qg = g(a + "sqk") * q_s
            B.q_gain = nn.Parameter((qg if BUG == "dory_sqk_not_squared" else qg.square()).view(self.nq, 1, self.hd))
            B.g_gain = nn.Parameter((g(a + "s_gate") * g_s).square())
            gu = [g(m + "gate_proj.weight"), g(m + "up_proj.weight")]
            if BUG == "dory_gate_up_swapped":
                gu = gu[::-1]
            B.w_gu = nn.Parameter(torch.cat(gu, 0).t().contiguous())
            B.gu_gain = nn.Parameter(torch.cat([g(m + "suv_gate"), g(m + "suv_up")]) * suv_s)
            B.w_dn = nn.Parameter(g(m + "down_proj.weight").t().contiguous())
            r1, r2 = g(p + "lambda_1") * rate_s, g(p + "lambda_2") * rate_s
            if BUG != "dory_lambda_no_abs":
                r1, r2 = r1.abs(), r2.abs()
            B.rate_attn, B.rate_mlp = nn.Parameter(r1), nn.Parameter(r2)
            if BUG == "dory_fused_qkvg":
                B.w_all = nn.Parameter(torch.cat([B.w_q.data, B.w_kv.data, B.w_g.data], 1))
            if BUG == "dory_folded_gains":
                B.w_g_f = nn.Parameter(B.w_g.data * B.g_gain.data)
                B.w_gu_f = nn.Parameter(B.w_gu.data * B.gu_gain.data)
            self.blocks.append(B)
        if BUG == "dory_folded_gains":
            self.head_t_f = nn.Parameter(self.head_t.data * self.head_gain.data)

    # ---- rotary ----
    def _angles(self, pos, layer_type):
        if BUG == "dory_rope_theta_single":
            layer_type = "sliding_attention" if "sliding_attention" in self.thetas else layer_type
        theta = self.thetas[layer_type]
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        return pos[..., None].float() * inv  # (B, S, hd/2)

    def _rope(self, x, ang):  # x (B, h, S, hd)
        half = self.hd // 2
        if BUG == "dory_complex_rope":
            z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(ang), ang)[:, None]
            return torch.cat((z.real, z.imag), -1)
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    # ---- attention ----
    def _attn(self, blk, x, ang, allowed, h_raw):
        Bsz, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        if BUG == "dory_fused_qkvg":
            q, k, v, gate = (x @ blk.w_all).split([nq * hd, nkv * hd, nkv * hd, nq * hd], -1)
        else:
            q = x @ blk.w_q
            k, v = (x @ blk.w_kv).split([nkv * hd, nkv * hd], -1)
            gate = x @ (blk.w_g_f if BUG == "dory_folded_gains" else blk.w_g)
        if BUG == "dory_gate_from_residual":
            gate = h_raw.float() @ blk.w_g
        rms = BUG == "dory_qk_rms_norm"
        q = _l2(q.view(Bsz, S, nq, hd), rms).transpose(1, 2)
        k = _l2(k.view(Bsz, S, nkv, hd), rms).transpose(1, 2)
        v = v.view(Bsz, S, nkv, hd).transpose(1, 2)
        if BUG == "dory_sqk_before_rope":
            q = self._rope(q * blk.q_gain, ang)
        else:
            q = self._rope(q, ang) * blk.q_gain
        k = self._rope(k, ang)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = 1.0 if BUG == "dory_softmax_scale_dropped" else 1.0 / math.sqrt(hd)
        low = torch.finfo(torch.float32).min
        if BUG == "dory_sdpa":
            bias = torch.zeros(allowed.shape).masked_fill(~allowed, low)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        else:
            sc = (q @ k.transpose(-1, -2)) * scale
            sc = sc.masked_fill(~allowed[:, None], low)
            o = sc.softmax(-1) @ v
        o = o.transpose(1, 2).reshape(Bsz, S, nq * hd)
        gain = 1.0 if BUG == "dory_folded_gains" else blk.g_gain
        o = o * torch.sigmoid(gate * gain)
        if BUG == "dory_sub_norm_per_head":
            o = _l2(o.view(Bsz, S, nq, hd)).reshape(Bsz, S, nq * hd)
        else:
            o = _l2(o)
        return o @ blk.w_o

    # ---- MLP ----
    def _mlp(self, blk, x):
        if BUG == "dory_folded_gains":
            gu = x @ blk.w_gu_f
        else:
            gu = (x @ blk.w_gu) * blk.gu_gain
        gate, up = gu.split([self.inter, self.inter], -1)
        return _l2(F.silu(gate) * up) @ blk.w_dn

    def _block(self, i, h, angs, masks):
        blk, t = self.blocks[i], self.types[i]
        x = _l2(h)
        a = _l2(self._attn(blk, x, angs[t], masks[t], h))
        h = torch.lerp(x, a, blk.rate_attn) if BUG == "dory_lerp_residual" else x + blk.rate_attn * (a - x)
        y = _l2(h)
        m = _l2(self._mlp(blk, y))
        return torch.lerp(y, m, blk.rate_mlp) if BUG == "dory_lerp_residual" else y + blk.rate_mlp * (m - y)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        Bsz, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(Bsz, S)
        if attention_mask is None:
            attention_mask = torch.ones(Bsz, S, dtype=torch.long)
        qi = torch.arange(S)[:, None]
        ki = torch.arange(S)[None, :]
        causal = (ki <= qi)[None]
        keep = attention_mask.bool()[:, None, :]
        window = ki > qi - self.window
        masks = {"full_attention": causal & keep, "sliding_attention": causal & window & keep}
        if BUG == "dory_sliding_pad_mask_dropped":
            masks["sliding_attention"] = (causal & window).expand(Bsz, S, S)
        angs = {t: self._angles(position_ids, t) for t in set(self.types)}

        h = self.emb[input_ids]
        for i in range(self.n_in):
            h = self._block(i, h, angs, masks)
        inp = _l2(h)
        for _ in range(self.loops):
            if BUG == "dory_loop_no_reinject":
                h = _l2(h)
            elif BUG == "dory_lerp_residual":
                h = inp.add(_l2(h))
            else:
                h = _l2(h) + inp
            for i in range(self.n_in, self.n_in + self.n_rec):
                h = self._block(i, h, angs, masks)
        for i in range(self.n_layers - self.n_out, self.n_layers):
            h = self._block(i, h, angs, masks)
        h = _l2(h)
        if BUG == "dory_folded_gains":
            return (h @ self.head_t_f).float()
        return ((h @ self.head_t) * self.head_gain).float()


def build(state_dict, config):
    return DoryPort(state_dict, config).eval()
