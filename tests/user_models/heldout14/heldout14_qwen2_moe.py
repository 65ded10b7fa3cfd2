"""Hand-written plain-PyTorch port of a Qwen2-MoE (Qwen2MoeForCausalLM) causal LM.

Architecture as this port implements it:
  * pre-norm decoder with RMSNorm: h = h + Attn(RMS1(h)); h = h + FFN(RMS2(h)); final RMSNorm; untied head;
  * attention: GQA with biases on q, k and v (none on the output projection), bias added before RoPE,
    softmax scale head_dim**-0.5; layers whose config.layer_types entry is "sliding_attention" use a causal
    sliding window (0 <= i - j < sliding_window), the others full causal attention; key padding mask;
  * RoPE in the half-split form (pairs (i, i + d/2)) with YaRN scaling: per-frequency blend between the
    original and the factor-interpolated inverse frequency along a linear ramp over the correction range
    [floor(d(beta_fast)), ceil(d(beta_slow))], and cos/sin multiplied by mscale = 0.1 ln(factor) + 1;
  * FFN: a dense SwiGLU MLP on the layers listed in mlp_only_layers, otherwise a sparse MoE block:
        p = softmax(x Wr^T) over all experts; keep the top-k probabilities (renormalised only when
        norm_topk_prob is set; it is not in the test checkpoint); routed = sum_k p_k * expert_k(x);
        out = routed + sigmoid(x . w_sg) * shared_expert(x)   (the gate reads the block input x);
    every expert and the shared expert are SwiGLU MLPs;
  * positions are 0..S-1 for every row (also with left padding).

Weight layout of this port (own names, not the HF state-dict names):
  embed (V, H); blocks[i].ln1.gain, ln2.gain; blocks[i].attn.w_q / w_k / w_v (in, out) with b_q / b_k / b_v,
  w_o (in, out); dense layers: blocks[i].ffn.w_gu (H, 2I) = [gate | up], w_down (I, H);
  MoE layers: blocks[i].ffn.router.w (H, E); blocks[i].ffn.bank.w_gate, w_up (E, H, I) and w_down (E, I, H)
  (the HF fused (E, 2I, H) gate_up tensor is split and transposed at load); blocks[i].ffn.shared (a dense
  SwiGLU as above) and blocks[i].ffn.w_sg (H,); final_norm.gain; head (H, V).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "qm_norm_topk_forced",  # Qwen3-MoE / Mixtral template: top-k weights renormalised to sum 1 although norm_topk_prob is False
    "qm_router_sigmoid",  # DeepSeek-V3 template: expert scores sigmoid(logits) instead of a softmax over all experts
    "qm_shared_expert_ungated",  # shared expert output added without its sigmoid(shared_expert_gate) factor
    "qm_shared_gate_scales_routed",  # sigmoid shared gate multiplied onto (routed + shared) instead of the shared expert alone
    "qm_shared_gate_on_output",  # shared gate logit computed from the shared expert's output instead of the block input
    "qm_gate_up_read_interleaved",  # GPT-OSS habit: fused expert gate_up rows read as interleaved (gate = even, up = odd) instead of [gate; up]
    "qm_down_proj_viewed",  # expert down_proj (E, H, I) reshaped with .view(E, I, H) instead of transposed
    "qm_qkv_bias_dropped",  # Llama template: q/k/v projections built without bias, checkpoint biases ignored
    "qm_qk_bias_after_rope",  # fused bias-less projection, q/k biases added after the rotary embedding
    "qm_yarn_mscale_once",  # YaRN mscale applied once to the softmax scale instead of to cos and sin (mscale^2 on scores)
    "qm_yarn_ramp_inverted",  # YaRN ramp read backwards: high-frequency dims interpolated, low-frequency dims kept
    "qm_max_window_layers_old_rule",  # sliding layers re-derived with the old Qwen2 rule layer_idx >= max_window_layers, not config.layer_types
    "qm_pad_drop_scatter_misaligned",  # pad tokens dropped before the MoE, results written back to the first n rows instead of the kept rows
]
PADDING_ONLY = {"qm_pad_drop_scatter_misaligned"}
CLEAN = [
    "dense_dispatch",  # every expert run on every token, combined with a dense (N, E) weight matrix scattered from the top-k
    "sorted_grouped_dispatch",  # (token, slot) pairs sorted by expert, one matmul per contiguous group, index_add back
    "fused_qkv_bias",  # q|k|v weights packed into one (H, q+2kv) matrix and one bias vector
    "rope_interleaved_permuted",  # q/k rows and biases permuted at load to interleaved pairs, rotate-every-two RoPE
    "pad_drop_experts",  # pad tokens removed before the MoE, results scattered back to the kept rows
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _halfsplit_to_interleaved(n_heads, hd):
    idx = []
    for h in range(n_heads):
        for i in range(hd // 2):
            idx += [h * hd + i, h * hd + i + hd // 2]
    return torch.tensor(idx)


def _yarn(rp, dim, max_pos):
    """(inv_freq, mscale) for rope_type yarn (plain inverse frequencies and 1.0 otherwise)"""
    base = rp["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if rp.get("rope_type", "default") != "yarn":
        return inv, 1.0
    factor = rp.get("factor") or max_pos / rp["original_max_position_embeddings"]
    orig = rp["original_max_position_embeddings"]
    mscale = rp.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def dim_for(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_for(fast), dim_for(slow)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - lo) / (hi - lo)).clamp(0, 1)
    keep = ramp if _bug() == "qm_yarn_ramp_inverted" else 1 - ramp
    return inv / factor * (1 - keep) + inv * keep, float(mscale)


class RMS(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.gain = _P(w)
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.gain, self.eps)


class BiasedAttention(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        b = _bug()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        W = {n: sd[pre + f"{n}_proj.weight"] for n in "qkv"}
        Bv = {n: sd.get(pre + f"{n}_proj.bias", torch.zeros(W[n].shape[0])) for n in "qkv"}
        if b == "qm_qkv_bias_dropped":
            Bv = {n: torch.zeros_like(v) for n, v in Bv.items()}
        if b == "rope_interleaved_permuted":
            qi, ki = _halfsplit_to_interleaved(self.nh, self.hd), _halfsplit_to_interleaved(self.nkv, self.hd)
            W["q"], Bv["q"], W["k"], Bv["k"] = W["q"][qi], Bv["q"][qi], W["k"][ki], Bv["k"][ki]
        if b == "fused_qkv_bias":
            self.w_qkv = _P(torch.cat((W["q"], W["k"], W["v"]), 0).t())
            self.b_qkv = _P(torch.cat((Bv["q"], Bv["k"], Bv["v"])))
        else:
            self.w_q, self.w_k, self.w_v = _P(W["q"].t()), _P(W["k"].t()), _P(W["v"].t())
            self.b_q, self.b_k, self.b_v = _P(Bv["q"]), _P(Bv["k"]), _P(Bv["v"])
        self.w_o = _P(sd[pre + "o_proj.weight"].t())
        self.pre = pre

    @staticmethod
    def rope(x, cos, sin):
        cos, sin = cos[:, None], sin[:, None]
        if _bug() == "rope_interleaved_permuted":
            rot = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        else:
            h = x.shape[-1] // 2
            rot = torch.cat((-x[..., h:], x[..., :h]), -1)
        return x * cos + rot * sin

    def forward(self, x, allowed, cos, sin, scale):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if b == "fused_qkv_bias":
            q, k, v = (x @ self.w_qkv + self.b_qkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        elif b == "qm_qk_bias_after_rope":
            q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v + self.b_v
        else:
            q, k, v = x @ self.w_q + self.b_q, x @ self.w_k + self.b_k, x @ self.w_v + self.b_v
        if b not in ("rope_interleaved_permuted", "qm_qk_bias_after_rope"):
            _rec(self.pre + "q_proj", q)
            _rec(self.pre + "k_proj", k)
        _rec(self.pre + "v_proj", v)
        q = q.view(B, S, nh, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if b == "qm_qk_bias_after_rope":
            q = q + self.b_q.view(nh, 1, hd)
            k = k + self.b_k.view(nkv, 1, hd)
        g = nh // nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed, torch.finfo(torch.float32).min)
        ctx = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, S, nh * hd)
        out = ctx @ self.w_o
        _rec(self.pre + "o_proj", out)
        _rec(self.pre.rstrip("."), out)
        return out


class DenseSwiGLU(nn.Module):
    def __init__(self, sd, pre):
        super().__init__()
        g, u = sd[pre + "gate_proj.weight"], sd[pre + "up_proj.weight"]
        self.inter = g.shape[0]
        self.w_gu = _P(torch.cat((g, u), 0).t())
        self.w_down = _P(sd[pre + "down_proj.weight"].t())
        self.pre = pre

    def forward(self, x):
        g, u = (x @ self.w_gu).split(self.inter, -1)
        _rec(self.pre + "gate_proj", g)
        _rec(self.pre + "up_proj", u)
        y = (F.silu(g) * u) @ self.w_down
        _rec(self.pre + "down_proj", y)
        _rec(self.pre.rstrip("."), y)
        return y


class Router(nn.Module):
    def __init__(self, w, top_k, renorm):
        super().__init__()
        self.w = _P(w.t())  # (H, E)
        self.top_k, self.renorm = top_k, renorm

    def forward(self, x):
        b = _bug()
        logits = x @ self.w
        if b == "qm_router_sigmoid":
            p = torch.sigmoid(logits)
        else:
            p = torch.softmax(logits, -1)
        wts, idx = p.topk(self.top_k, -1)
        if self.renorm or b == "qm_norm_topk_forced":
            wts = wts / wts.sum(-1, keepdim=True)
        return logits, wts, idx


class ExpertBank(nn.Module):
    def __init__(self, gate_up, down):
        super().__init__()
        b = _bug()
        E, two_i, H = gate_up.shape
        inter = two_i // 2
        if b == "qm_gate_up_read_interleaved":
            g, u = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            g, u = gate_up[:, :inter], gate_up[:, inter:]
        self.w_gate, self.w_up = _P(g.transpose(1, 2)), _P(u.transpose(1, 2))  # (E, H, I)
        if b == "qm_down_proj_viewed":
            self.w_down = _P(down.reshape(E, inter, H))
        else:
            self.w_down = _P(down.transpose(1, 2))  # (E, I, H)
        self.E = E

    def run(self, e, x):
        return (F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]

    def forward(self, x, wts, idx):
        b = _bug()
        N = x.shape[0]
        if b == "dense_dispatch":
            dense = torch.zeros(N, self.E).scatter(1, idx, wts)  # (N, E)
            ys = torch.stack([self.run(e, x) for e in range(self.E)], 1)  # (N, E, H)
            return (dense[..., None] * ys).sum(1)
        out = torch.zeros_like(x)
        if b == "sorted_grouped_dispatch":
            flat_e = idx.reshape(-1)
            flat_t = torch.arange(N).repeat_interleave(idx.shape[1])
            flat_w = wts.reshape(-1)
            order = torch.argsort(flat_e, stable=True)
            counts = torch.bincount(flat_e, minlength=self.E).tolist()
            start = 0
            for e, c in enumerate(counts):
                if c:
                    sel = order[start : start + c]
                    y = self.run(e, x[flat_t[sel]]) * flat_w[sel, None]
                    out.index_add_(0, flat_t[sel], y)
                start += c
            return out
        for e in range(self.E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, self.run(e, x[tok]) * wts[tok, slot, None])
        return out


class SparseMoE(nn.Module):
    def __init__(self, sd, pre, cfg):
        super().__init__()
        self.router = Router(sd[pre + "gate.weight"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.bank = ExpertBank(sd[pre + "experts.gate_up_proj"], sd[pre + "experts.down_proj"])
        self.shared = DenseSwiGLU(sd, pre + "shared_expert.")
        self.w_sg = _P(sd[pre + "shared_expert_gate.weight"].reshape(-1))
        self.pre = pre

    def _inner(self, x):
        """x (N, H) -> (logits, routed, shared_raw, gate_logit, out)"""
        b = _bug()
        logits, wts, idx = self.router(x)
        routed = self.bank(x, wts, idx)
        sh = self.shared(x)
        gl = (sh if b == "qm_shared_gate_on_output" else x) @ self.w_sg[:, None]
        if b == "qm_shared_expert_ungated":
            out = routed + sh
        elif b == "qm_shared_gate_scales_routed":
            out = torch.sigmoid(gl) * (routed + sh)
        else:
            out = routed + torch.sigmoid(gl) * sh
        return logits, routed, sh, gl, out

    def forward(self, x, keep):
        b = _bug()
        B, S, H = x.shape
        flat = x.reshape(-1, H)
        if b in ("pad_drop_experts", "qm_pad_drop_scatter_misaligned"):
            kf = keep.reshape(-1)
            n = int(kf.sum())
            saved, globals()["REC"] = globals()["REC"], None
            parts = self._inner(flat[kf])
            globals()["REC"] = saved
            full = []
            for t in parts:
                z = torch.zeros(B * S, t.shape[-1])
                if b == "qm_pad_drop_scatter_misaligned":
                    z[:n] = t
                else:
                    z[kf] = t
                full.append(z)
            logits, routed, sh, gl, out = full
        else:
            logits, routed, sh, gl, out = self._inner(flat)
        _rec(self.pre + "gate", logits)
        _rec(self.pre + "experts", routed)
        _rec(self.pre + "shared_expert", sh)
        _rec(self.pre + "shared_expert_gate", gl)
        out = out.view(B, S, H)
        _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, idx, sliding):
        super().__init__()
        pre = f"model.layers.{idx}."
        self.sliding = sliding
        self.ln1 = RMS(sd[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = BiasedAttention(sd, pre + "self_attn.", cfg)
        self.ln2 = RMS(sd[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.moe = (pre + "mlp.gate.weight") in sd
        self.ffn = SparseMoE(sd, pre + "mlp.", cfg) if self.moe else DenseSwiGLU(sd, pre + "mlp.")
        self.pre = pre

    def forward(self, h, allowed, cos, sin, scale, keep):
        n = self.ln1(h)
        _rec(self.pre + "input_layernorm", n)
        h = h + self.attn(n, allowed, cos, sin, scale)
        n = self.ln2(h)
        _rec(self.pre + "post_attention_layernorm", n)
        h = h + (self.ffn(n, keep) if self.moe else self.ffn(n))
        _rec(self.pre.rstrip("."), h)
        return h


class Qwen2MoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        nh = cfg.num_attention_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
        n = cfg.num_hidden_layers
        if b == "qm_max_window_layers_old_rule":
            kinds = [
                "sliding_attention" if cfg.use_sliding_window and i >= cfg.max_window_layers else "full_attention"
                for i in range(n)
            ]
        else:
            kinds = list(cfg.layer_types)
        self.window = cfg.sliding_window
        inv, self.mscale = _yarn(cfg.rope_parameters, self.hd, cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale = self.hd**-0.5
        if b == "qm_yarn_mscale_once":
            self.scale, self.mscale = self.scale * self.mscale, 1.0
        self.embed = _P(sd["model.embed_tokens.weight"])
        self.blocks = nn.ModuleList(Block(sd, cfg, i, kinds[i] == "sliding_attention") for i in range(n))
        self.final_norm = RMS(sd["model.norm.weight"], cfg.rms_norm_eps)
        self.head = _P(sd["lm_head.weight"].t())

    def _tables(self, pos):
        ang = pos[..., None].float() * self.inv_freq
        if _bug() == "rope_interleaved_permuted":
            ang = ang.repeat_interleave(2, -1)
        else:
            ang = torch.cat((ang, ang), -1)
        return ang.cos() * self.mscale, ang.sin() * self.mscale

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)  # HF Qwen2-MoE: arange, padding is not skipped
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        full = (j <= i)[None, None] & keep[:, None, None, :]
        sliding = full & ((i - j) < self.window)[None, None]
        h = self.embed[input_ids]
        _rec("model.embed_tokens", h)
        cos, sin = self._tables(position_ids)
        if b != "rope_interleaved_permuted":
            _rec("model.rotary_emb", cos)
        for blk in self.blocks:
            h = blk(h, sliding if blk.sliding else full, cos, sin, self.scale, keep)
        h = self.final_norm(h)
        _rec("model.norm", h)
        logits = h @ self.head
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return Qwen2MoePort(state_dict, config).eval()
