"""Hand-written plain-PyTorch port of Granite 4 MoE-hybrid (GraniteMoeHybridForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
- * token embedding times embedding_multiplier; untied lm_head, * logits DIVIDED by logits_scaling;
  final RMSNorm (plain gain, eps rms_norm_eps).
- pre-norm layers with * residual_multiplier on every branch:
    x = x + residual_multiplier * Mixer(RMSNorm_in(x))
    x = x + residual_multiplier * (MoE(n) + SharedMLP(n)),  n = RMSNorm_post(x)
- * mixer from config.layer_types: "linear_attention" = Mamba2, "full_attention" = attention.
  * attention: GQA, head_dim = hidden/heads, rotate-half RoPE (position_embedding_type "rope"), * softmax scale
    attention_multiplier (NOT 1/sqrt(head_dim)), causal + key-padding mask, no biases.
  * Mamba2: input zeroed at padding; in_proj (with bias, mamba_proj_bias) -> [z (d) | xBC (d + 2 G N) | dt (nh)];
    depthwise causal conv1d (with bias) + SiLU over xBC, result zeroed at padding again; split [x | B | C];
    dt = softplus(dt + dt_bias) clamped to time_step_limit, A = -exp(A_log) per head; per head state
    (head_dim x N), B/C shared per group (head h uses group h // (nh / G)):
      h = exp(dt A) h + dt x B^T;  y = h C + D x;
    * y * silu(z) THEN grouped RMSNorm (G groups over d, eps rms_norm_eps, gain w); out_proj (with bias).
- * MoE: router logits = x W_r; top-k (num_experts_per_tok) of the LOGITS, softmax over those k only;
  experts SwiGLU (intermediate_size), gate_up_proj rows = [gate | up]; * plus an always-on shared SwiGLU MLP
  (shared_intermediate_size, input_linear rows = [gate | up]).
Weight layout of this port (own names):
- wte (V, H) with embedding_multiplier folded in; wout (H, V) transposed lm_head with 1/logits_scaling folded in;
  ln_f (H,).
- per layer `h[i]`: ln1, ln2 (H,).
  attention: c_q (H, nq*hd) with attention_multiplier folded in (the softmax then takes q.k as is),
  c_kv (H, 2*nkv*hd) = [k | v] fused+transposed; c_proj (nq*hd, H) with residual_multiplier folded in.
  Mamba2: in_z (H, d), in_xbc (H, d + 2GN), in_dt (H, nh) (in_proj split, transposed) and their biases b_z, b_xbc,
  b_dt; conv_w (C, K) squeezed, conv_b (C,); dt_bias, A (= -exp(A_log)), D (nh,); gnorm (d,);
  out_w (d, H) and out_b (H,) with residual_multiplier folded into both.
  MoE: router (H, E) transposed; e_gate, e_up (E, H, I) split from gate_up_proj and transposed; e_down (E, I, H)
  transposed with residual_multiplier folded in; shared s_gate, s_up (H, Is), s_down (Is, H) with
  residual_multiplier folded in.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "gmh_attn_scale_sqrt",  # softmax scale 1/sqrt(head_dim) instead of config.attention_multiplier
    "gmh_res_mult_bias_unscaled",  # residual_multiplier folded into Mamba out_proj's weight but not into its bias
    "gmh_res_mult_mlp_only",  # residual_multiplier applied to the MoE/MLP branch only, not to the mixer branch
    "gmh_logits_scaling_multiplied",  # logits multiplied by logits_scaling instead of divided by it
    "gmh_embed_mult_missing",  # embedding_multiplier never applied
    "gmh_router_softmax_all",  # softmax over all experts, top-k weights taken without renormalising
    "gmh_expert_gate_up_swapped",  # experts' gate_up_proj halves read as [up | gate]
    "gmh_shared_mlp_missing",  # the always-on shared MLP never added to the MoE output
    "gmh_zxbcdt_order",  # in_proj output split as [xBC | z | dt] instead of [z | xBC | dt]
    "gmh_norm_before_gate",  # gated RMSNorm normalises y first and then multiplies by silu(z)
    "gmh_bc_swapped",  # conv output split as [x | C | B] instead of [x | B | C]
    "gmh_A_log_as_A",  # A = -A_log (the log read as the rate) instead of -exp(A_log)
    "gmh_in_proj_bias_missing",  # Mamba in_proj bias (mamba_proj_bias) dropped at load
    "gmh_pad_no_post_conv_mask",  # conv output not re-zeroed at padding (the conv bias leaks into the state)
]
PADDING_ONLY = {"gmh_pad_no_post_conv_mask"}
CLEAN = [
    "gmh_ssd_quadratic",  # Mamba2 as its quadratic (attention-like) SSD form, one masked decay matrix
    "gmh_runtime_multipliers",  # no folding: every Granite multiplier applied at runtime where Transformers does
    "gmh_sdpa",  # attention via F.scaled_dot_product_attention
    "gmh_dense_moe",  # every expert on every token, weighted by a dense (zero outside the top-k) gate matrix
    "gmh_router_masked_softmax",  # softmax over all logits with the non-chosen ones set to -inf
]


def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _Layer(nn.Module):
    pass


class GraniteMoeHybridPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        bug = BUG

        def g(k):
            return sd[k].detach().clone().float()

        self.eps = cfg.rms_norm_eps
        self.kinds = list(cfg.layer_types)
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // cfg.num_attention_heads
        self.rope = cfg.position_embedding_type == "rope"
        self.theta = cfg.rope_parameters["rope_theta"] if self.rope else None
        self.d = int(cfg.mamba_expand * cfg.hidden_size)
        self.nh, self.ph, self.N, self.G = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups
        self.dt_lim = tuple(cfg.time_step_limit) if cfg.time_step_limit is not None else (0.0, float("inf"))
        self.topk, self.E = cfg.num_experts_per_tok, cfg.num_local_experts
        self.m_emb, self.m_logit = cfg.embedding_multiplier, cfg.logits_scaling
        self.m_res, self.m_attn = cfg.residual_multiplier, cfg.attention_multiplier
        self.fold = bug != "gmh_runtime_multipliers"
        fold = self.fold
        rm = self.m_res if fold else 1.0
        emb_m = self.m_emb if fold and bug != "gmh_embed_mult_missing" else 1.0
        logit_m = (self.m_logit if bug == "gmh_logits_scaling_multiplied" else 1.0 / self.m_logit) if fold else 1.0
        self.wte = nn.Parameter(g("model.embed_tokens.weight") * emb_m)
        self.wout = nn.Parameter(g("lm_head.weight").t().contiguous() * logit_m)
        self.ln_f = nn.Parameter(g("model.norm.weight"))
        d, GN, nh = self.d, self.G * self.N, self.nh
        self.h = nn.ModuleList()
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}."
            lay = _Layer()
            lay.ln1 = nn.Parameter(g(p + "input_layernorm.weight"))
            lay.ln2 = nn.Parameter(g(p + "post_attention_layernorm.weight"))
            mix_rm = 1.0 if bug == "gmh_res_mult_mlp_only" else rm
            if kind == "full_attention":
                a = p + "self_attn."
                qs = 1.0
                if fold:
                    qs = 1.0 / math.sqrt(self.hd) if bug == "gmh_attn_scale_sqrt" else self.m_attn
                lay.c_q = nn.Parameter(g(a + "q_proj.weight").t().contiguous() * qs)
                lay.c_kv = nn.Parameter(torch.cat([g(a + "k_proj.weight"), g(a + "v_proj.weight")], 0).t().contiguous())
                lay.c_proj = nn.Parameter(g(a + "o_proj.weight").t().contiguous() * mix_rm)
            else:
                a = p + "mamba."
                w = g(a + "in_proj.weight")
                bias = g(a + "in_proj.bias") if a + "in_proj.bias" in sd else torch.zeros(w.shape[0])
                if bug == "gmh_in_proj_bias_missing":
                    bias = torch.zeros_like(bias)
                if bug == "gmh_zxbcdt_order":
                    sizes, names = [d + 2 * GN, d, nh], ["xbc", "z", "dt"]
                else:
                    sizes, names = [d, d + 2 * GN, nh], ["z", "xbc", "dt"]
                for nm, wp, bp in zip(names, w.split(sizes, 0), bias.split(sizes, 0)):
                    setattr(lay, "in_" + nm, nn.Parameter(wp.t().contiguous()))
                    setattr(lay, "b_" + nm, nn.Parameter(bp.clone()))
                lay.conv_w = nn.Parameter(g(a + "conv1d.weight").squeeze(1))
                lay.conv_b = nn.Parameter(g(a + "conv1d.bias") if a + "conv1d.bias" in sd else torch.zeros(d + 2 * GN))
                lay.dt_bias = nn.Parameter(g(a + "dt_bias"))
                lay.A = nn.Parameter(-g(a + "A_log") if bug == "gmh_A_log_as_A" else -g(a + "A_log").exp())
                lay.D = nn.Parameter(g(a + "D"))
                lay.gnorm = nn.Parameter(g(a + "norm.weight"))
                lay.out_w = nn.Parameter(g(a + "out_proj.weight").t().contiguous() * mix_rm)
                ob = g(a + "out_proj.bias") if a + "out_proj.bias" in sd else torch.zeros(cfg.hidden_size)
                lay.out_b = nn.Parameter(ob if bug == "gmh_res_mult_bias_unscaled" else ob * mix_rm)
            m = p + "block_sparse_moe."
            lay.router = nn.Parameter(g(m + "router.weight").t().contiguous())
            gu = g(m + "experts.gate_up_proj")  # (E, 2I, H)
            eg, eu = gu.chunk(2, 1)
            if bug == "gmh_expert_gate_up_swapped":
                eg, eu = eu, eg
            lay.e_gate = nn.Parameter(eg.transpose(1, 2).contiguous())
            lay.e_up = nn.Parameter(eu.transpose(1, 2).contiguous())
            lay.e_down = nn.Parameter(g(m + "experts.down_proj").transpose(1, 2).contiguous() * rm)
            sg, su = g(p + "shared_mlp.input_linear.weight").chunk(2, 0)
            lay.s_gate, lay.s_up = nn.Parameter(sg.t().contiguous()), nn.Parameter(su.t().contiguous())
            lay.s_down = nn.Parameter(g(p + "shared_mlp.output_linear.weight").t().contiguous() * rm)
            self.h.append(lay)

    # ---------------- attention ----------------
    def _attn(self, lay, x, pos, keep):
        bug = BUG
        B, T, _ = x.shape
        nq, nkv, hd = self.nq, self.nkv, self.hd
        q = (x @ lay.c_q).view(B, T, nq, hd).transpose(1, 2)
        k, v = (x @ lay.c_kv).split([nkv * hd, nkv * hd], -1)
        k = k.view(B, T, nkv, hd).transpose(1, 2)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        if self.rope:
            inv = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            ang = pos[:, None, :, None].float() * inv
            cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

            def rot(t):
                return t * cos + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * sin

            q, k = rot(q), rot(k)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = 1.0 if self.fold else self.m_attn
        if bug == "gmh_sdpa":
            eye = torch.eye(T, dtype=torch.bool)[None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=(keep | eye)[:, None], scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            s = s.masked_fill(~keep[:, None], torch.finfo(s.dtype).min)
            o = s.softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, T, nq * hd) @ lay.c_proj

    # ---------------- mamba2 ----------------
    def _mamba(self, lay, x, mask):
        bug = BUG
        B, T, _ = x.shape
        d, G, N, nh, ph = self.d, self.G, self.N, self.nh, self.ph
        if mask is not None:
            x = x * mask[:, :, None]
        z = x @ lay.in_z + lay.b_z
        xbc = x @ lay.in_xbc + lay.b_xbc
        dt = x @ lay.in_dt + lay.b_dt
        K = lay.conv_w.shape[1]
        xbc = F.conv1d(F.pad(xbc.transpose(1, 2), (K - 1, 0)), lay.conv_w[:, None], lay.conv_b, groups=xbc.shape[-1])
        xbc = F.silu(xbc.transpose(1, 2))
        if mask is not None and bug != "gmh_pad_no_post_conv_mask":
            xbc = xbc * mask[:, :, None]
        if bug == "gmh_bc_swapped":
            xs, Cm, Bm = xbc.split([d, G * N, G * N], -1)
        else:
            xs, Bm, Cm = xbc.split([d, G * N, G * N], -1)
        xs = xs.view(B, T, nh, ph)
        Bm = Bm.view(B, T, G, N).repeat_interleave(nh // G, 2)
        Cm = Cm.view(B, T, G, N).repeat_interleave(nh // G, 2)
        dt = F.softplus(dt + lay.dt_bias).clamp(self.dt_lim[0], self.dt_lim[1])
        if bug == "gmh_ssd_quadratic":
            la = (dt * lay.A).cumsum(1)  # (B, T, nh)
            seg = la[:, :, None, :] - la[:, None, :, :]  # (B, t, s, nh)
            low = torch.ones(T, T, dtype=torch.bool).tril()
            Lm = seg.masked_fill(~low[None, :, :, None], float("-inf")).exp()
            CB = torch.einsum("bthn,bshn->btsh", Cm, Bm)
            y = torch.einsum("btsh,bsh,bshp->bthp", CB * Lm, dt, xs)
        else:
            st = torch.zeros(B, nh, ph, N)
            ys = []
            for t in range(T):
                dA = torch.exp(dt[:, t] * lay.A)[:, :, None, None]
                st = st * dA + (dt[:, t, :, None] * xs[:, t])[..., None] * Bm[:, t, :, None, :]
                ys.append((st * Cm[:, t, :, None, :]).sum(-1))
            y = torch.stack(ys, 1)
        y = (y + lay.D[:, None] * xs).reshape(B, T, d)
        gate = F.silu(z)
        gw = lay.gnorm.view(G, d // G)
        if bug == "gmh_norm_before_gate":
            y = _rms(y.view(B, T, G, d // G), gw, self.eps).view(B, T, d) * gate
        else:
            y = _rms((y * gate).view(B, T, G, d // G), gw, self.eps).view(B, T, d)
        return y @ lay.out_w + lay.out_b

    # ---------------- MoE ----------------
    def _moe(self, lay, x):
        bug = BUG
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        logits = xf @ lay.router  # (n, E)
        top_l, top_i = logits.topk(self.topk, -1)
        if bug == "gmh_router_softmax_all":
            top_w = logits.softmax(-1).gather(-1, top_i)
        elif bug == "gmh_router_masked_softmax":
            masked = torch.full_like(logits, float("-inf")).scatter(-1, top_i, top_l)
            top_w = masked.softmax(-1).gather(-1, top_i)
        else:
            top_w = top_l.softmax(-1)
        out = torch.zeros_like(xf)
        if bug == "gmh_dense_moe":
            dense = torch.zeros_like(logits).scatter(-1, top_i, top_w)  # (n, E)
            hs = F.silu(torch.einsum("nh,ehi->eni", xf, lay.e_gate)) * torch.einsum("nh,ehi->eni", xf, lay.e_up)
            out = torch.einsum("eni,eih,ne->nh", hs, lay.e_down, dense)
        else:
            for e in range(self.E):
                tok, slot = torch.where(top_i == e)
                if tok.numel() == 0:
                    continue
                xe = xf[tok]
                ye = (F.silu(xe @ lay.e_gate[e]) * (xe @ lay.e_up[e])) @ lay.e_down[e]
                out.index_add_(0, tok, ye * top_w[tok, slot, None])
        if bug != "gmh_shared_mlp_missing":
            out = out + (F.silu(xf @ lay.s_gate) * (xf @ lay.s_up)) @ lay.s_down
        return out.view(B, T, H)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = BUG
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
        km = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        keep = torch.ones(T, T, dtype=torch.bool).tril()[None] & km[:, None, :]
        mask = None if attention_mask is None else km.float()
        x = self.wte[input_ids]
        if not self.fold:
            x = x * self.m_emb
        # runtime residual multipliers (the folded port has them inside the output projections)
        rm_mix = 1.0 if self.fold or bug == "gmh_res_mult_mlp_only" else self.m_res
        rm_mlp = 1.0 if self.fold else self.m_res
        for kind, lay in zip(self.kinds, self.h):
            n = _rms(x, lay.ln1, self.eps)
            mix = self._attn(lay, n, position_ids, keep) if kind == "full_attention" else self._mamba(lay, n, mask)
            x = x + rm_mix * mix
            x = x + rm_mlp * self._moe(lay, _rms(x, lay.ln2, self.eps))
        logits = _rms(x, self.ln_f, self.eps) @ self.wout
        if not self.fold:
            logits = logits / self.m_logit
        return logits.float()


def build(state_dict, config):
    return GraniteMoeHybridPort(state_dict, config).eval()
