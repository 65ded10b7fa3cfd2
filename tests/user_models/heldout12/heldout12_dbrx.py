"""Hand-written plain-PyTorch port of a DBRX (DbrxForCausalLM) causal LM.

Pre-norm blocks with bias-free LayerNorms (norm_1 before attention, norm_2 before the MoE FFN),
fused Wqkv clamped to [-clip_qkv, clip_qkv] then split [q | k | v] (GQA, kv_n_heads), NeoX
half-split RoPE with rope_theta from the config, no projection biases.  MoE FFN: bias-free router,
softmax over all experts, top-k, weights divided by their p-norm (p = moe_normalize_expert_weights);
experts are stored in the checkpoint as 2-D stacks (E*F, hidden): w1 (gate) and v1 (up) used as
x @ w.T, w2 used as h @ w2.  Weights live under this file's own names.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "dbrx_expert_stack_expert_minor",  # (E*F, hidden) expert stacks unflattened as (F, E, hidden): rows assigned to experts round-robin
    "dbrx_moe_norm_default_p2",  # torch.norm(top_k_weights, dim=-1) with its default p=2 instead of p=moe_normalize_expert_weights (1); cf. databricks/megablocks#60
    "dbrx_norm_attn_norm_tuple_swapped",  # NormAttentionNorm's (residual, normed) return pair unpacked in the other order
    "dbrx_moe_scatter_assign_not_add",  # expert outputs written with out[token_idx] = y instead of index_add_: the later expert overwrites the earlier one
    "dbrx_routing_weight_first_slot",  # expert output weighted by top_k_weights[token, 0] (first slot) instead of the slot that picked this expert
    "dbrx_capacity_factor_token_drop",  # MegaBlocks/llm-foundry capacity factor 1 kept: tokens over an expert's capacity dropped (HF DBRX is dropless)
    "dbrx_moe_skip_pads_repad_prefix",  # pad tokens skipped in the MoE, results written back as a prefix of the flattened batch (right padding assumed)
    "dbrx_clip_as_softcap",  # clip_qkv implemented as a tanh soft-cap clip*tanh(x/clip) instead of a hard clamp
    "dbrx_topk_via_argsort_ascending",  # hand-written top-k argsort(probs)[..., :k] without descending=True: the k least likely experts chosen
    "dbrx_norm_affine_dropped",  # 'no_bias' read as 'no affine': LayerNorms built elementwise_affine=False, norm weights never loaded
    "dbrx_expert_input_sliced_not_gathered",  # expert input hidden[:n] (first n tokens) instead of hidden[token_idx]
    "dbrx_expert_loop_over_topk_range",  # expert loop `for e in range(top_k)` instead of range(num_experts): experts >= top_k never run
]
PADDING_ONLY = {"dbrx_moe_skip_pads_repad_prefix"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention(enable_gqa=True)
    "experts_3d_transposed",  # w1/v1 stored (E, hidden, F) and w2 (E, F, hidden) at load, plain x @ W
    "fused_w1v1",  # w1 and v1 fused per expert into one (E, hidden, 2F) gate|up matrix
    "layernorm_functional",  # F.layer_norm(weight=w, bias=None)
    "moe_dense_dispatch",  # every expert on every token, weighted by a scattered (T, E) routing matrix
    "qkv_split_at_load",  # Wqkv split into separate q/k/v matrices at load, clamp applied to each part
    "moe_skip_pads",  # pad tokens skipped in the MoE and results scattered back with masked_scatter
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _ln(x, w, eps=1e-5):
    if _bug() == "layernorm_functional":
        return F.layer_norm(x, (x.shape[-1],), w, None, eps)
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = (x - mu) * torch.rsqrt(var + eps)
    return y if w is None else y * w


class Block(nn.Module):
    pass


class DbrxPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        H = self.H = cfg.d_model
        self.nh = cfg.n_heads
        self.nkv = cfg.attn_config.kv_n_heads
        self.hd = H // self.nh
        self.clip = cfg.attn_config.clip_qkv
        fc = cfg.ffn_config
        self.E, self.Fd, self.top_k = fc.moe_num_experts, fc.ffn_hidden_size, fc.moe_top_k
        self.norm_p = fc.moe_normalize_expert_weights
        theta = cfg.rope_parameters["rope_theta"]
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float) / self.hd)), persistent=False
        )
        self.scaling = self.hd**-0.5
        no_affine = b == "dbrx_norm_affine_dropped"
        self.wte = _P(sd["transformer.wte.weight"])
        self.norm_f = None if no_affine else _P(sd["transformer.norm_f.weight"])
        self.head = _P(sd["lm_head.weight"].t())
        E, Fd = self.E, self.Fd
        self.blocks = nn.ModuleList()
        for i in range(cfg.n_layers):
            p = f"transformer.blocks.{i}."
            na = p + "norm_attn_norm."
            ff = p + "ffn."
            blk = Block()
            blk.idx = i
            blk.ln1 = None if no_affine else _P(sd[na + "norm_1.weight"])
            blk.ln2 = None if no_affine else _P(sd[na + "norm_2.weight"])
            wqkv = sd[na + "attn.Wqkv.weight"]
            if b == "qkv_split_at_load":
                wq, wk, wv = wqkv.split([H, self.nkv * self.hd, self.nkv * self.hd], 0)
                blk.wq, blk.wk, blk.wv = _P(wq.t()), _P(wk.t()), _P(wv.t())
            else:
                blk.wqkv = _P(wqkv.t())
            blk.wo = _P(sd[na + "attn.out_proj.weight"].t())
            blk.wr = _P(sd[ff + "router.layer.weight"].t())

            def unflat(t):
                if b == "dbrx_expert_stack_expert_minor":
                    return t.view(Fd, E, H).transpose(0, 1)
                return t.view(E, Fd, H)

            w1 = unflat(sd[ff + "experts.mlp.w1"])
            v1 = unflat(sd[ff + "experts.mlp.v1"])
            w2 = unflat(sd[ff + "experts.mlp.w2"])
            if b == "experts_3d_transposed":
                blk.w1t, blk.v1t, blk.w2 = _P(w1.transpose(1, 2)), _P(v1.transpose(1, 2)), _P(w2)
            elif b == "fused_w1v1":
                blk.w13 = _P(torch.cat((w1, v1), 1).transpose(1, 2))
                blk.w2 = _P(w2)
            else:
                blk.w1, blk.v1, blk.w2 = _P(w1), _P(v1), _P(w2)
            self.blocks.append(blk)

    def _clip(self, t):
        if self.clip is None:
            return t
        if _bug() == "dbrx_clip_as_softcap":
            return self.clip * torch.tanh(t / self.clip)
        return t.clamp(-self.clip, self.clip)

    @staticmethod
    def _rope(x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rot * sin

    def _attn(self, blk, x, amask, cos, sin, pre):
        b = _bug()
        B, S, H = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if b == "qkv_split_at_load":
            q, k, v = (self._clip(x @ w) for w in (blk.wq, blk.wk, blk.wv))
            _rec(pre + "Wqkv", torch.cat((x @ blk.wq, x @ blk.wk, x @ blk.wv), -1))
        else:
            qkv = x @ blk.wqkv
            _rec(pre + "Wqkv", qkv)
            q, k, v = self._clip(qkv).split([H, nkv * hd, nkv * hd], -1)
        q = q.view(B, S, nh, hd).transpose(1, 2)
        k = k.view(B, S, nkv, hd).transpose(1, 2)
        v = v.view(B, S, nkv, hd).transpose(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=amask, scale=self.scaling, enable_gqa=True)
        else:
            rep = nh // nkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            ctx = torch.softmax((q @ k.transpose(-1, -2)) * self.scaling + amask, -1) @ v
        out = ctx.transpose(1, 2).reshape(B, S, H) @ blk.wo
        _rec(pre + "out_proj", out)
        _rec(pre.rstrip("."), out)
        return out

    def _expert(self, blk, e, xs):
        if hasattr(blk, "w13"):
            g, u = (xs @ blk.w13[e]).chunk(2, -1)
        elif hasattr(blk, "w1t"):
            g, u = xs @ blk.w1t[e], xs @ blk.v1t[e]
        else:
            g, u = xs @ blk.w1[e].t(), xs @ blk.v1[e].t()
        return (F.silu(g) * u) @ blk.w2[e]

    def _moe_tokens(self, blk, t, pre):
        b = _bug()
        T = t.shape[0]
        logits = t @ blk.wr
        _rec(pre + "router", logits)
        probs = torch.softmax(logits, -1)
        if b == "dbrx_topk_via_argsort_ascending":
            idx = probs.argsort(-1)[..., : self.top_k]
            w = probs.gather(-1, idx)
        else:
            w, idx = probs.topk(self.top_k, -1)
        if self.norm_p is not None:
            if b == "dbrx_moe_norm_default_p2":
                w = w / torch.norm(w, dim=-1, keepdim=True)
            else:
                w = w / torch.norm(w, p=self.norm_p, dim=-1, keepdim=True)
        out = torch.zeros_like(t)
        if b == "moe_dense_dispatch":
            R = torch.zeros(T, self.E).scatter(-1, idx, w)
            for e in range(self.E):
                out = out + self._expert(blk, e, t) * R[:, e : e + 1]
            return out
        cap = math.ceil(T * self.top_k / self.E) if b == "dbrx_capacity_factor_token_drop" else None
        for e in range(self.top_k if b == "dbrx_expert_loop_over_topk_range" else self.E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            if cap is not None:
                tok, slot = tok[:cap], slot[:cap]
            xs = t[: tok.numel()] if b == "dbrx_expert_input_sliced_not_gathered" else t[tok]
            y = self._expert(blk, e, xs)
            ww = w[tok, 0, None] if b == "dbrx_routing_weight_first_slot" else w[tok, slot, None]
            if b == "dbrx_moe_scatter_assign_not_add":
                out[tok] = y * ww
            else:
                out.index_add_(0, tok, y * ww)
        return out

    def _ffn(self, blk, x, keep, pre):
        b = _bug()
        B, S, H = x.shape
        t = x.reshape(-1, H)
        if b in ("moe_skip_pads", "dbrx_moe_skip_pads_repad_prefix"):
            kf = keep.reshape(-1)
            y = self._moe_tokens(blk, t[kf], pre)
            if b == "moe_skip_pads":
                out = torch.zeros_like(t).masked_scatter(kf[:, None], y)
            else:
                out = torch.zeros_like(t)
                out[: y.shape[0]] = y
            _rec(pre + "router", t @ blk.wr)  # full router tap for comparison
        else:
            out = self._moe_tokens(blk, t, pre)
        _rec(pre + "experts", out)
        out = out.view(B, S, H)
        _rec(pre.rstrip("."), out)
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        keep = attention_mask.bool()
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        amask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        ang = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        h = self.wte[input_ids]
        _rec("transformer.wte", h)
        for blk in self.blocks:
            p = f"transformer.blocks.{blk.idx}."
            na = p + "norm_attn_norm."
            x = _ln(h, blk.ln1)
            _rec(na + "norm_1", x)
            h = h + self._attn(blk, x, amask, cos, sin, na + "attn.")
            resid, normed = h, _ln(h, blk.ln2)
            _rec(na + "norm_2", normed)
            _rec(na.rstrip("."), resid)
            if b == "dbrx_norm_attn_norm_tuple_swapped":
                resid, normed = normed, resid
            h = resid + self._ffn(blk, normed, keep, p + "ffn.")
            _rec(p.rstrip("."), h)
        h = _ln(h, self.norm_f)
        _rec("transformer.norm_f", h)
        logits = h @ self.head
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return DbrxPort(state_dict, config).eval()
