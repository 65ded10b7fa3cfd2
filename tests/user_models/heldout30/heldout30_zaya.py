"""Hand-written plain-PyTorch port of ZAYA1 (ZayaForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
- * embedding followed by a learned affine: h = (emb + in_bias) * in_scale (folded into the input table here);
  final RMSNorm; * lm_head TIED to the raw embedding table, * with its own bias (config.lm_head_bias).
- decoder layer with * affine residual mixing (ZayaResidualScaling), twice per layer:
    r = (Attn(RMSNorm(h)) + bb) * bs + (h + sb) * ss;  h = (MoE(RMSNorm(r)) + bb') * bs' + (r + sb') * ss'
- * CCA attention projection (Compressed Convolutional Attention):
  * padding tokens of the (normed) input are zeroed first (2-D attention mask);
  q = x Wq + bq (nq heads), k = x Wk + bk (nkv heads);
  * q-residual = (q_h + k_{h // n_rep}) / 2 per query head; k-residual = mean of the q-residuals of its group;
  * [q | k] channels run through two causal convs (left zero-padding of (t0 - 1) + (t1 - 1)): a depthwise conv
    (kernel cca_time0, bias) then a per-head grouped conv (groups = nq + nkv, kernel cca_time1, bias), both
    PyTorch cross-correlations; q = conv_q + q-residual, k = conv_k + k-residual;
  * values: [v_current(x_t) | v_delayed(x_{t-1})] concatenated over the whole kv width and only then split
    into heads (v_delayed at t = 0 is v_proj_delayed(0) = its bias);
  * q / k L2-normalised per head to norm sqrt(head_dim), k then scaled by a learned per-kv-head temp;
  * partial rotate-half RoPE on the first head_dim * partial_rotary_factor dims, theta per layer type
    ("hybrid" 5e6, "hybrid_sliding" 1e4), scale 1/sqrt(head_dim), causal (+ sliding window on
    "hybrid_sliding" layers: key j visible from i iff i - window < j <= i), GQA.
- * MoE FFN (top-1, every layer): router state r = x Wd + bd, plus (layers > 0) * prev_r * eda_scale where
  prev_r is the previous layer's r (after its own addition: the chain is cumulative); router MLP
  RMSNorm -> GELU(fc1) -> GELU(fc2) -> logits over num_experts + 1 (the last is a compute-free skip expert);
  softmax probs, choice on probs + balancing_biases, weight = the chosen prob (not renormalised), 0 for the skip
  expert; SwiGLU experts.
Weight layout of this port (own names):
- tok_in (V, H) = (embed + in_bias) * in_scale; head_t (H, V) = raw embed transposed; head_b (V,); fin (H,).
- per layer `blocks[i]`: n1 / n2 (H,); w_qk (H, (nq + nkv) hd), b_qk fused + transposed; w_v (H, nkv hd) =
  [current | delayed] fused + transposed, b_v; dw (C, t0) depthwise taps, db (C,); gw (nq + nkv, hd_out, hd_in, t1)
  grouped taps per head, gb (C,); temp (nkv,); w_o (nq hd, H) transposed, b_o;
  mix_a / mix_f (4, H) rows = [branch_bias, branch_scale, skip_bias, skip_scale];
  w_rd (H, R), b_rd, eda (R,) (layers > 0), rn (R,), w_f1 / w_f2 (R, R) transposed, b_f1 / b_f2, w_ro (R, E+1);
  bal (E+1,) buffer; eg / eu (E, H, I) split + transposed from gate_up_proj, ed (E, I, H).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "zaya_value_halves_per_head",  # each value head split [current half | delayed half] instead of whole-width concat
    "zaya_value_not_delayed",  # v_proj_delayed read at the current token (no one-step shift)
    "zaya_delayed_first_zero",  # first token's delayed value set to 0 instead of v_proj_delayed(0) (= its bias)
    "zaya_key_residual_raw",  # key residual = raw key projection instead of the group mean of (q + k) / 2
    "zaya_conv_kernel_flipped",  # hand-written CCA convs apply the taps reversed (convolution, not correlation)
    "zaya_grouped_conv_transposed",  # per-head (hd x hd) grouped-conv blocks transposed at load
    "zaya_temp_missing",  # per-kv-head key temperature never applied after the L2 norm
    "zaya_rope_full_dim",  # RoPE over the whole head_dim instead of the first partial_rotary_factor part
    "zaya_rope_theta_one_for_all",  # sliding layers use the full layers' theta 5e6 instead of their 1e4
    "zaya_eda_not_chained",  # next layer's router gets down_proj(x) alone, not the cumulative EDA state
    "zaya_top1_renorm",  # top-1 router weight renormalised to 1 (expert output not scaled by its probability)
    "zaya_residual_scales_swapped",  # hidden_states_scale and residual_scale exchanged at load
    "zaya_tied_head_from_input_table",  # tied lm_head reads the input table that has the embedding affine folded in
    "zaya_conv_mask_ignored",  # padding tokens not zeroed before the CCA projection (leak via conv / delayed value)
]
PADDING_ONLY = {"zaya_conv_mask_ignored"}
CLEAN = [
    "zaya_sdpa",  # attention through F.scaled_dot_product_attention with a float mask
    "zaya_conv1d",  # the two CCA convs through F.conv1d (depthwise, then grouped) instead of tap loops
    "zaya_conv_merged",  # both convs composed at call time into one grouped conv of kernel t0 + t1 - 1
    "zaya_qknorm_rms",  # q/k normalised as x / rms(x) (same as sqrt(hd) * x / ||x||), temp folded into the queries
    "zaya_dense_moe",  # every expert run on every token, combined with a one-hot weight matrix
]


def _rms(x, g, eps):
    x = x.float()
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


class ZayaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        H = cfg.hidden_size
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.t0, self.t1 = cfg.cca_time0, cfg.cca_time1
        self.kinds = list(cfg.layer_types)
        self.window = cfg.sliding_window
        self.rope = {}
        for kind in set(self.kinds):
            rp = cfg.rope_parameters[kind]
            self.rope[kind] = (rp["rope_theta"], int(self.hd * rp.get("partial_rotary_factor", 1.0)))
        self.E = cfg.num_experts
        emb = g("model.embed_tokens.weight")
        self.tok_in = nn.Parameter((emb + g("model.input_hidden_states_bias")) * g("model.input_hidden_states_scale"))
        self.head_t = nn.Parameter(g("lm_head.weight").t().contiguous())
        self.head_b = nn.Parameter(g("lm_head.bias") if cfg.lm_head_bias else torch.zeros(cfg.vocab_size))
        self.fin = nn.Parameter(g("model.norm.weight"))
        ab = cfg.attention_bias
        self.blocks = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            c = a + "qkv_proj."
            r = p + "mlp.gate."
            b = nn.Module()
            b.n1 = nn.Parameter(g(p + "input_layernorm.weight"))
            b.n2 = nn.Parameter(g(p + "post_attention_layernorm.weight"))

            def lin(name, n_out, prefix=c):
                w = g(prefix + name + ".weight").t().contiguous()
                return w, (g(prefix + name + ".bias") if ab else torch.zeros(n_out))

            wq, bq = lin("q_proj", self.nq * self.hd)
            wk, bk = lin("k_proj", self.nkv * self.hd)
            wvc, bvc = lin("v_proj_current", self.nkv * self.hd // 2)
            wvd, bvd = lin("v_proj_delayed", self.nkv * self.hd // 2)
            b.w_qk, b.b_qk = nn.Parameter(torch.cat([wq, wk], 1)), nn.Parameter(torch.cat([bq, bk]))
            b.w_v, b.b_v = nn.Parameter(torch.cat([wvc, wvd], 1)), nn.Parameter(torch.cat([bvc, bvd]))
            b.dw = nn.Parameter(g(c + "conv_qk_depthwise.weight")[:, 0].contiguous())
            b.db = nn.Parameter(g(c + "conv_qk_depthwise.bias"))
            G = self.nq + self.nkv
            gw = g(c + "conv_qk_grouped.weight").view(G, self.hd, self.hd, self.t1)
            if BUG == "zaya_grouped_conv_transposed":
                gw = gw.transpose(1, 2)
            b.gw = nn.Parameter(gw.contiguous())
            b.gb = nn.Parameter(g(c + "conv_qk_grouped.bias"))
            b.temp = nn.Parameter(g(a + "qk_norm.temp"))
            b.w_o = nn.Parameter(g(a + "o_proj.weight").t().contiguous())
            b.b_o = nn.Parameter(g(a + "o_proj.bias") if ab else torch.zeros(H))
            order = ["hidden_states_bias", "hidden_states_scale", "residual_bias", "residual_scale"]
            if BUG == "zaya_residual_scales_swapped":
                order = ["hidden_states_bias", "residual_scale", "residual_bias", "hidden_states_scale"]
            b.mix_a = nn.Parameter(torch.stack([g(p + "post_attention_residual_scale." + n) for n in order]))
            b.mix_f = nn.Parameter(torch.stack([g(p + "post_mlp_residual_scale." + n) for n in order]))
            b.w_rd = nn.Parameter(g(r + "down_proj.weight").t().contiguous())
            b.b_rd = nn.Parameter(g(r + "down_proj.bias"))
            if i > 0:
                b.eda = nn.Parameter(g(r + "router_states_scale"))
            b.rn = nn.Parameter(g(r + "router_mlp.norm.weight"))
            b.w_f1 = nn.Parameter(g(r + "router_mlp.fc1.weight").t().contiguous())
            b.b_f1 = nn.Parameter(g(r + "router_mlp.fc1.bias"))
            b.w_f2 = nn.Parameter(g(r + "router_mlp.fc2.weight").t().contiguous())
            b.b_f2 = nn.Parameter(g(r + "router_mlp.fc2.bias"))
            b.w_ro = nn.Parameter(g(r + "router_mlp.out_proj.weight").t().contiguous())
            b.register_buffer("bal", g(r + "balancing_biases"))
            gu = g(p + "mlp.experts.gate_up_proj")  # (E, 2I, H)
            inter = gu.shape[1] // 2
            b.eg = nn.Parameter(gu[:, :inter].transpose(1, 2).contiguous())
            b.eu = nn.Parameter(gu[:, inter:].transpose(1, 2).contiguous())
            b.ed = nn.Parameter(g(p + "mlp.experts.down_proj").transpose(1, 2).contiguous())
            self.blocks.append(b)

    # ---- CCA convolutions: x (B, C, T + pad) -> (B, C, T) ----
    def _convs(self, b, x):
        C = x.shape[1]
        G, hd = self.nq + self.nkv, self.hd
        if BUG == "zaya_conv1d":
            y = F.conv1d(x, b.dw[:, None], b.db, groups=C)
            w2 = b.gw.reshape(C, hd, self.t1)
            return F.conv1d(y, w2, b.gb, groups=G)
        if BUG == "zaya_conv_merged":
            n = self.t0 + self.t1 - 1
            dw = b.dw.view(G, 1, hd, self.t0)
            merged = torch.zeros(G, hd, hd, n)
            for j2 in range(self.t1):
                for j1 in range(self.t0):
                    merged[..., j1 + j2] += b.gw[..., j2] * dw[..., j1]
            bias = b.gb + torch.einsum("goit,gi->go", b.gw, b.db.view(G, hd)).reshape(C)
            return F.conv1d(x, merged.reshape(C, hd, n), bias, groups=G)
        flip = BUG == "zaya_conv_kernel_flipped"
        n1 = x.shape[-1] - self.t0 + 1
        y = b.db[None, :, None].expand(x.shape[0], C, n1).clone()
        for j in range(self.t0):
            tap = b.dw[:, self.t0 - 1 - j] if flip else b.dw[:, j]
            y = y + tap[None, :, None] * x[..., j : j + n1]
        n2 = n1 - self.t1 + 1
        yg = y.view(y.shape[0], G, hd, n1)
        z = b.gb.view(1, G, hd, 1).expand(y.shape[0], G, hd, n2).clone()
        for j in range(self.t1):
            w = b.gw[..., self.t1 - 1 - j] if flip else b.gw[..., j]
            z = z + torch.einsum("goi,bgit->bgot", w, yg[..., j : j + n2])
        return z.reshape(y.shape[0], C, n2)

    def _attn(self, b, x, pos, kind, keep, pad):
        B, S, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        rep = nq // nkv
        if BUG != "zaya_conv_mask_ignored":
            x = x * pad[..., None]
        qk = x @ b.w_qk + b.b_qk
        q_lin, k_lin = qk.split([nq * hd, nkv * hd], -1)
        q_res = (q_lin.view(B, S, nq, hd) + k_lin.view(B, S, nkv, hd).repeat_interleave(rep, 2)) * 0.5
        if BUG == "zaya_key_residual_raw":
            k_res = k_lin.view(B, S, nkv, hd)
        else:
            k_res = q_res.view(B, S, nkv, rep, hd).mean(3)
        padded = F.pad(qk.transpose(1, 2), (self.t0 - 1 + self.t1 - 1, 0))
        conv = self._convs(b, padded).transpose(1, 2)
        q = conv[..., : nq * hd].reshape(B, S, nq, hd) + q_res
        k = conv[..., nq * hd :].reshape(B, S, nkv, hd) + k_res
        v = x @ b.w_v + b.b_v
        half = nkv * hd // 2
        v_cur, v_del = v[..., :half], v[..., half:]
        if BUG != "zaya_value_not_delayed":
            first = (
                torch.zeros_like(v_del[:, :1]) if BUG == "zaya_delayed_first_zero" else b.b_v[half:].expand(B, 1, half)
            )
            v_del = torch.cat([first, v_del[:, :-1]], 1)
        if BUG == "zaya_value_halves_per_head":
            v = torch.cat([v_cur.view(B, S, nkv, hd // 2), v_del.view(B, S, nkv, hd // 2)], -1)
        else:
            v = torch.cat([v_cur, v_del], -1).view(B, S, nkv, hd)
        temp = b.temp if BUG != "zaya_temp_missing" else torch.ones_like(b.temp)
        if BUG == "zaya_qknorm_rms":
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True)) * temp.repeat_interleave(rep)[:, None]
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True))
        else:
            tiny = torch.finfo(torch.float32).eps
            q = q * (math.sqrt(hd) / q.norm(dim=-1, keepdim=True).clamp_min(tiny))
            k = k * (math.sqrt(hd) / k.norm(dim=-1, keepdim=True).clamp_min(tiny)) * temp[:, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        theta, rot = self.rope[kind]
        if BUG == "zaya_rope_theta_one_for_all":
            theta = self.rope["hybrid"][0]
        if BUG == "zaya_rope_full_dim":
            rot = hd
        inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        ang = pos[..., None].float() * inv
        cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]

        def rope(t):
            return torch.cat((t[..., :rot] * cos + _rot_half(t[..., :rot]) * sin, t[..., rot:]), -1)

        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        low = torch.finfo(torch.float32).min
        if BUG == "zaya_sdpa":
            fmask = torch.zeros(keep.shape).masked_fill(~keep, low)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=fmask)
        else:
            sc = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            o = sc.masked_fill(~keep[:, None], low).softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, S, nq * hd) @ b.w_o + b.b_o

    def _moe(self, b, x, prev):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        r = t @ b.w_rd + b.b_rd
        if prev is not None:
            r_chain = r + prev * b.eda
        else:
            r_chain = r
        nxt = r if BUG == "zaya_eda_not_chained" else r_chain
        z = _rms(r_chain, b.rn, self.eps)
        z = F.gelu(z @ b.w_f1 + b.b_f1)
        z = F.gelu(z @ b.w_f2 + b.b_f2)
        probs = (z @ b.w_ro).softmax(-1)
        idx = (probs + b.bal).argmax(-1)
        w = probs.gather(1, idx[:, None])[:, 0]
        if BUG == "zaya_top1_renorm":
            w = torch.ones_like(w)
        w = w.masked_fill(idx == self.E, 0.0)
        if BUG == "zaya_dense_moe":
            onehot = F.one_hot(idx, self.E + 1)[:, : self.E].float() * w[:, None]
            hid = F.silu(torch.einsum("th,ehi->tei", t, b.eg)) * torch.einsum("th,ehi->tei", t, b.eu)
            out = torch.einsum("tei,eih,te->th", hid, b.ed, onehot)
        else:
            out = torch.zeros_like(t)
            for e in range(self.E):
                sel = (idx == e).nonzero(as_tuple=True)[0]
                if sel.numel():
                    xe = t[sel]
                    ye = (F.silu(xe @ b.eg[e]) * (xe @ b.eu[e])) @ b.ed[e]
                    out.index_add_(0, sel, ye * w[sel, None])
        return out.view(B, S, H), nxt

    @staticmethod
    def _mix(m, branch, skip):
        return (branch + m[0]) * m[1] + (skip + m[2]) * m[3]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        pad = attention_mask.float()
        i = torch.arange(S)
        causal = (i[None, :] <= i[:, None])[None] & attention_mask.bool()[:, None, :]
        sliding = causal & (i[None, :] > i[:, None] - self.window)[None]
        h = self.tok_in[input_ids]
        prev = None
        for kind, b in zip(self.kinds, self.blocks):
            keep = sliding if kind == "hybrid_sliding" else causal
            a = self._attn(b, _rms(h, b.n1, self.eps), position_ids, kind, keep, pad)
            h = self._mix(b.mix_a, a, h)
            f, prev = self._moe(b, _rms(h, b.n2, self.eps), prev)
            h = self._mix(b.mix_f, f, h)
        head = self.tok_in.t() if BUG == "zaya_tied_head_from_input_table" else self.head_t
        return (_rms(h, self.fin, self.eps) @ head + self.head_b).float()


def build(state_dict, config):
    return ZayaPort(state_dict, config).eval()
