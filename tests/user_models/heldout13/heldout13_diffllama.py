"""Hand-written plain-PyTorch port of a DiffLlama (DiffLlamaForCausalLM) causal LM.

Llama pre-norm decoder whose attention is the differential transformer's:
per head pair (j, j + heads/2), out_j = A_j V - lambda * A_{j+heads/2} V with V = [v_a | v_b]
(the two halves of the KV heads side by side, 2*head_dim wide), lambda = exp(lq1.lk1) - exp(lq2.lk2)
+ lambda_init(layer), lambda_init = 0.8 - 0.6 exp(-0.3 * layer_idx); a weight-free RMS "sub-layer"
norm over the 2*head_dim channels and the (1 - lambda_init) scale. Projections stored as (in, out).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "dl_lambda_init_layer_from_one",  # paper's 1-based depth l plugged into 0.8 - 0.6*exp(-0.3*l) with l = layer_idx + 1 (the paper writes l - 1)
    "dl_lambda_init_constant",  # lambda_init fixed at 0.8 (the paper's constant alternative) instead of the per-layer schedule
    "dl_output_scale_missing",  # (1 - lambda_init) multiplier after the sub-layer norm left out
    "dl_lambda_init_not_added",  # lambda_full written exp(q1.k1) - exp(q2.k2): the + lambda_init term forgotten
    "dl_lambda_sum_of_exp",  # exp(lambda_q1 . lambda_k1) read as sum(exp(lambda_q1 * lambda_k1)): exponential taken per element before the sum
    "dl_subln_over_head_dim",  # sub-layer RMS norm statistics per head_dim half instead of over the 2*head_dim channels of each pair
    "dl_pairs_adjacent_heads",  # Microsoft reference layout: differential pairs taken as heads (2j, 2j+1) instead of (j, j + heads/2)
    "dl_lambda_params_sorted_zip",  # loader zips sorted(lambda_*) names (k1, k2, q1, q2) into the (q1, k1, q2, k2) slots
    "dl_merge_restores_head_order",  # pair outputs split back into head_dim halves and merged as heads (j | j + heads/2) instead of flattening (pair, 2*head_dim)
    "dl_scale_from_value_width",  # softmax scale 1/sqrt(2*head_dim) taken from the doubled value width
    "dl_diff_on_scores",  # difference taken on the pre-softmax scores, softmax(s1 - lambda*s2), instead of between the two softmax maps
    "dl_second_map_no_padding",  # two SDPA calls, the second written with is_causal=True and no attn_mask: the lambda-weighted map sees pad keys
]
PADDING_ONLY = {"dl_second_map_no_padding"}
CLEAN = [
    "sdpa",  # two F.scaled_dot_product_attention calls with the same additive mask
    "v_doubled",  # one attention call over a 2*head_dim value built as cat(v_a, v_b) per head
    "lambda_folded",  # lambda_full computed once at load time and stored as a constant per layer
    "subln_functional",  # sub-layer norm via torch.nn.functional.rms_norm over 2*head_dim, no weight
    "grouped_gqa",  # queries grouped (B, kv, groups, S, d) and contracted against un-repeated K/V
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
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


class Layer(nn.Module):
    pass


class DiffLlamaPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        H = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.eps = cfg.rms_norm_eps
        theta = cfg.rope_parameters["rope_theta"]
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float) / self.hd)), persistent=False
        )
        self.scaling = (2 * self.hd) ** -0.5 if b == "dl_scale_from_value_width" else self.hd**-0.5
        self.emb = _P(sd["model.embed_tokens.weight"])
        self.final_w = _P(sd["model.norm.weight"])
        self.head = _P(sd["lm_head.weight"].t())
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            a = pre + "self_attn."
            L = Layer()
            L.idx = i
            if b == "dl_lambda_init_constant":
                L.lambda_init = 0.8
            elif b == "dl_lambda_init_layer_from_one":
                L.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (i + 1))
            else:
                L.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * i)
            slots = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
            names = (
                sorted(k[len(a) :] for k in sd if k.startswith(a + "lambda_"))
                if b == "dl_lambda_params_sorted_zip"
                else slots
            )
            lam = {slot: sd[a + n] for slot, n in zip(slots, names)}
            if b == "lambda_folded":
                L.lam_full = float(
                    torch.exp((lam["lambda_q1"] * lam["lambda_k1"]).sum())
                    - torch.exp((lam["lambda_q2"] * lam["lambda_k2"]).sum())
                    + L.lambda_init
                )
            else:
                L.lq1, L.lk1, L.lq2, L.lk2 = (_P(lam[s]) for s in slots)
            L.wq, L.wk, L.wv = (_P(sd[a + f"{n}_proj.weight"].t()) for n in "qkv")
            L.wo = _P(sd[a + "o_proj.weight"].t())
            L.n_in = _P(sd[pre + "input_layernorm.weight"])
            L.n_post = _P(sd[pre + "post_attention_layernorm.weight"])
            L.w_gate = _P(sd[pre + "mlp.gate_proj.weight"].t())
            L.w_up = _P(sd[pre + "mlp.up_proj.weight"].t())
            L.w_down = _P(sd[pre + "mlp.down_proj.weight"].t())
            self.layers.append(L)

    def _rope(self, x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    def _lambda(self, L):
        b = _bug()
        if b == "lambda_folded":
            return L.lam_full
        if b == "dl_lambda_sum_of_exp":
            l1, l2 = torch.exp(L.lq1 * L.lk1).sum(), torch.exp(L.lq2 * L.lk2).sum()
        else:
            l1, l2 = torch.exp((L.lq1 * L.lk1).sum()), torch.exp((L.lq2 * L.lk2).sum())
        if b == "dl_lambda_init_not_added":
            return l1 - l2
        return l1 - l2 + L.lambda_init

    def _probs(self, q, k, amask):
        """q (B, nh, S, d), k (B, nkv, S, d) -> probs (B, nh, S, S)"""
        rep = self.nh // self.nkv
        s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * self.scaling + amask
        return torch.softmax(s, -1)

    def _attn(self, L, x, amask, causal_only, cos, sin, pre):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q, k, v = x @ L.wq, x @ L.wk, x @ L.wv
        _rec(pre + "q_proj", q)
        _rec(pre + "k_proj", k)
        _rec(pre + "v_proj", v)
        q = self._rope(q.view(B, S, nh, hd).transpose(1, 2), cos, sin)
        k = self._rope(k.view(B, S, nkv, hd).transpose(1, 2), cos, sin)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        va, vb = (t.repeat(1, 2, 1, 1) for t in v.chunk(2, dim=1))  # each (B, nkv, S, hd)
        rep = nh // nkv
        lam = self._lambda(L)
        if b == "dl_diff_on_scores":
            kr = k.repeat_interleave(rep, 1)
            s = (q @ kr.transpose(-1, -2)) * self.scaling
            vcat = torch.cat((va, vb), -1).repeat_interleave(rep, 1)  # (B, nh, S, 2hd)
            half = nh // 2
            p = torch.softmax(s[:, :half] - lam * s[:, half:] + amask, -1)
            out = (p @ vcat[:, :half]).transpose(1, 2)  # (B, S, nh/2, 2hd)
        else:
            if b == "v_doubled":
                vcat = torch.cat((va, vb), -1).repeat_interleave(rep, 1)
                o = (self._probs(q, k, amask) @ vcat).transpose(1, 2)  # (B, S, nh, 2hd)
            elif b == "sdpa":
                kr = k.repeat_interleave(rep, 1)
                o1 = F.scaled_dot_product_attention(
                    q, kr, va.repeat_interleave(rep, 1), attn_mask=amask, scale=self.scaling
                )
                o2 = F.scaled_dot_product_attention(
                    q, kr, vb.repeat_interleave(rep, 1), attn_mask=amask, scale=self.scaling
                )
                o = torch.cat((o1, o2), -1).transpose(1, 2)
            elif b == "grouped_gqa":
                qg = q.view(B, nkv, rep, S, hd)
                s = torch.einsum("bkgqd,bksd->bkgqs", qg, k) * self.scaling + amask[:, :, None]
                p = torch.softmax(s, -1)
                o1 = torch.einsum("bkgqs,bksd->bkgqd", p, va).reshape(B, nh, S, hd)
                o2 = torch.einsum("bkgqs,bksd->bkgqd", p, vb).reshape(B, nh, S, hd)
                o = torch.cat((o1, o2), -1).transpose(1, 2)
            else:
                p1 = self._probs(q, k, amask)
                p2 = self._probs(q, k, causal_only) if b == "dl_second_map_no_padding" else p1
                o1 = p1 @ va.repeat_interleave(rep, 1)
                o2 = p2 @ vb.repeat_interleave(rep, 1)
                o = torch.cat((o1, o2), -1).transpose(1, 2)  # (B, S, nh, 2hd)
            if b == "dl_pairs_adjacent_heads":
                a1, a2 = o[:, :, 0::2], o[:, :, 1::2]
            else:
                a1, a2 = o.chunk(2, dim=2)
            out = a1 - lam * a2  # (B, S, nh/2, 2hd)
        if b == "dl_subln_over_head_dim":
            out = _rms(out.unflatten(-1, (2, hd)), None, self.eps).flatten(-2)
        elif b == "subln_functional":
            out = F.rms_norm(out, (2 * hd,), eps=self.eps)
        else:
            out = _rms(out, None, self.eps)
        _rec(pre + "groupnorm", out)
        if b != "dl_output_scale_missing":
            out = (1 - L.lambda_init) * out
        if b == "dl_merge_restores_head_order":
            out = torch.cat((out[..., :hd], out[..., hd:]), dim=2)  # (B, S, nh, hd)
        out = out.reshape(B, S, nh * hd) @ L.wo
        _rec(pre + "o_proj", out)
        _rec(pre.rstrip("."), out)
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)  # HF DiffLlama: arange, not mask-derived
        neg = torch.finfo(torch.float32).min
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        amask = torch.zeros(B, 1, S, S).masked_fill(~(causal & keep[:, None, None, :]), neg)
        causal_only = torch.zeros(1, 1, S, S).masked_fill(~causal, neg)
        ang = position_ids[..., None].float() * self.inv_freq
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        _rec("model.rotary_emb", ang.cos())
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        for L in self.layers:
            p = f"model.layers.{L.idx}."
            x = _rms(h, L.n_in, self.eps)
            _rec(p + "input_layernorm", x)
            h = h + self._attn(L, x, amask, causal_only, cos, sin, p + "self_attn.")
            x = _rms(h, L.n_post, self.eps)
            _rec(p + "post_attention_layernorm", x)
            g, u = x @ L.w_gate, x @ L.w_up
            _rec(p + "mlp.gate_proj", g)
            _rec(p + "mlp.up_proj", u)
            f = (F.silu(g) * u) @ L.w_down
            _rec(p + "mlp.down_proj", f)
            _rec(p + "mlp", f)
            h = h + f
            _rec(p.rstrip("."), h)
        h = _rms(h, self.final_w, self.eps)
        _rec("model.norm", h)
        logits = h @ self.head
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return DiffLlamaPort(state_dict, config).eval()
