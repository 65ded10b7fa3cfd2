"""Hand-written plain-PyTorch port of a JetMoE (JetMoeForCausalLM) causal LM.

Pre-norm decoder. Attention is a mixture of attention heads (MoA): a top-k router picks k experts per
token; each chosen expert has its own query projection (hidden -> kv_heads*head_dim) and its own output
projection back to hidden, the k query groups are stacked as extra heads that share one k/v projection
(keys/values tiled over the k slots), expert outputs are gate-weighted, summed, plus a bias. The MLP is a
top-k MoE of SwiGLU experts plus a bias. Router: top-k on the logits, softmax over the k kept logits.
Experts are stored as (E, in, out) stacks under this file's own names; the head is tied to the embedding.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "jm_moa_gate_on_query",  # MoA gate multiplied into the expert query rows in map() instead of into the output rows in reduce()
    "jm_moa_reduce_gates_missing",  # MoA reduce(): expert output projections summed without the routing gates
    "jm_moa_map_scatter_by_token",  # map() copied from the MoE: query rows scattered with the token index (batch_index) instead of the (token, slot) index
    "jm_moa_reduce_without_sorted_gather",  # reduce(): attention rows fed to the output experts in (token, slot) order, the expert-sorted gather forgotten
    "jm_expert_weight_reshape_not_transpose",  # loader turns the (E, out, in) MoA query stack into (E, in, out) with reshape instead of transpose(1, 2)
    "jm_moe_gate_sigmoid",  # MoE gate computed as sigmoid of the kept logits (DeepSeek-V3 habit) instead of a softmax over them
    "jm_moe_router_from_moa",  # loader copy-paste: MLP router weight read from self_attention.experts.router (same shape)
    "jm_batch_index_div_num_experts",  # token index recovered as sorted_position // num_experts instead of // top_k
    "jm_rope_on_sorted_rows",  # RoPE applied inside map() to the expert-sorted query rows with positions in (token, slot) order
    "jm_moa_in_out_linear_swapped",  # 'input_linear'/'output_linear' read as the expert's input/output side of the attention: query experts from output_linear^T, output experts from input_linear^T
    "jm_gates_not_sorted",  # routing gates flattened in (token, slot) order while the expert rows are in sorted order: the sort permutation not applied to the gates
    "jm_slots_folded_into_batch",  # slots folded into the batch axis for the kernel as (b, slot) while keys, values and mask are repeated slot-major (slot, b)
]
PADDING_ONLY = {"jm_slots_folded_into_batch"}
CLEAN = [
    "dense_gather",  # every expert's projection computed for every token, the chosen ones gathered by index (no sorting)
    "softmax_topk_renorm",  # softmax over all logits, top-k, renormalised to sum 1 (equal to softmax over the kept logits)
    "expert_loop",  # loop over experts with torch.where on the top-k indices and index_add
    "sdpa",  # F.scaled_dot_product_attention with an additive mask, keys/values tiled over the slots
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


def _rot(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class Layer(nn.Module):
    pass


class JetMoePort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.H = cfg.hidden_size
        self.nkv = cfg.num_key_value_heads
        self.hd = cfg.kv_channels
        self.k = cfg.num_experts_per_tok
        self.E = cfg.num_local_experts
        self.layer_eps = 1e-6  # JetMoeRMSNorm default: the layer norms do not take config.rms_norm_eps
        self.final_eps = cfg.rms_norm_eps
        theta = cfg.rope_parameters["rope_theta"]
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float) / self.hd)), persistent=False
        )
        self.scaling = self.hd**-0.5
        self.emb = _P(sd["model.embed_tokens.weight"])
        self.final_w = _P(sd["model.norm.weight"])
        head = (
            sd["lm_head.weight"]
            if "lm_head.weight" in sd and not cfg.tie_word_embeddings
            else sd["model.embed_tokens.weight"]
        )
        self.head = _P(head.t())
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            a = pre + "self_attention."
            L = Layer()
            L.idx = i
            L.n_in = _P(sd[pre + "input_layernorm.weight"])
            L.n_post = _P(sd[pre + "post_attention_layernorm.weight"])
            wq, wo = (
                sd[a + "experts.input_linear.weight"],
                sd[a + "experts.output_linear.weight"],
            )  # (E, D, H), (E, H, D)
            if b == "jm_moa_in_out_linear_swapped":
                L.q_exp, L.o_exp = _P(wo), _P(wq)
            elif b == "jm_expert_weight_reshape_not_transpose":
                E, o, n = wq.shape
                L.q_exp, L.o_exp = _P(wq.reshape(E, n, o)), _P(wo.transpose(1, 2))
            else:
                L.q_exp, L.o_exp = _P(wq.transpose(1, 2)), _P(wo.transpose(1, 2))  # (E, H, D), (E, D, H)
            L.moa_router = _P(sd[a + "experts.router.layer.weight"].t())
            L.moa_bias = _P(sd[a + "experts.bias"])
            L.w_kv = _P(sd[a + "kv_proj.weight"].t())
            L.moe_in = _P(sd[pre + "mlp.input_linear.weight"].transpose(1, 2))  # (E, H, 2I)
            L.moe_out = _P(sd[pre + "mlp.output_linear.weight"].transpose(1, 2))  # (E, I, H)
            rk = a + "experts.router.layer.weight" if b == "jm_moe_router_from_moa" else pre + "mlp.router.layer.weight"
            L.moe_router = _P(sd[rk].t())
            L.moe_bias = _P(sd[pre + "mlp.bias"])
            self.layers.append(L)

    # ---- routing --------------------------------------------------------------------------
    def _route(self, x, w_router, name, moe=False):
        """x (T, H) -> dict with idx (T,k), gates (T,k), order (T*k,), tok (T*k,), sizes"""
        b = _bug()
        logits = x @ w_router
        if b == "softmax_topk_renorm":
            probs = torch.softmax(logits, -1)
            g, idx = probs.topk(self.k, -1)
            gates = g / g.sum(-1, keepdim=True)
        else:
            vals, idx = logits.topk(self.k, dim=1)
            gates = torch.sigmoid(vals) if (moe and b == "jm_moe_gate_sigmoid") else torch.softmax(vals, 1)
        flat = idx.flatten()
        _, order = flat.sort(0)
        div = self.E if b == "jm_batch_index_div_num_experts" else self.k
        tok = order.div(div, rounding_mode="trunc")
        sizes = torch.bincount(flat, minlength=self.E).tolist()
        sorted_gates = gates.flatten() if b == "jm_gates_not_sorted" else gates.flatten()[order]
        if b not in ("dense_gather", "expert_loop"):
            _rec(name, order)
        return dict(idx=idx, gates=gates, order=order, tok=tok, sizes=sizes, sgates=sorted_gates)

    def _experts(self, rows, W, sizes):
        out = []
        for e, part in enumerate(rows.split(sizes, 0)):
            out.append(part @ W[e])
        return torch.cat(out, 0)

    def _map(self, L, x, r, pos):
        """query rows for every (token, slot): (T, k, D)"""
        b = _bug()
        T = x.shape[0]
        D = L.q_exp.shape[-1]
        if b == "dense_gather":
            allq = torch.einsum("th,ehd->ted", x, L.q_exp)
            return allq.gather(1, r["idx"][..., None].expand(T, self.k, D))
        if b == "expert_loop":
            q = torch.zeros(T, self.k, D)
            for e in range(self.E):
                t, s = torch.where(r["idx"] == e)
                q[t, s] = x[t] @ L.q_exp[e]
            return q
        y = self._experts(x[r["tok"]], L.q_exp, r["sizes"])
        if b == "jm_moa_gate_on_query":
            y = y * r["sgates"][:, None]
        if b == "jm_rope_on_sorted_rows":
            p = pos.flatten().repeat_interleave(self.k)  # (token, slot) order, rows are expert-sorted
            ang = p[:, None].float() * self.inv_freq
            ang = torch.cat((ang, ang), -1)[:, None]
            y = _rot(y.view(-1, self.nkv, self.hd), ang.cos(), ang.sin()).flatten(1)
        dest = r["tok"] if b == "jm_moa_map_scatter_by_token" else r["order"]
        q = torch.zeros(T * self.k, D).index_add(0, dest, y)
        return q.view(T, self.k, D)

    def _reduce(self, L, ctx, r):
        """ctx (T, k, D) -> (T, H)"""
        b = _bug()
        T = ctx.shape[0]
        if b == "dense_gather":
            w = L.o_exp[r["idx"]]  # (T, k, D, H)
            y = torch.einsum("tkd,tkdh->tkh", ctx, w)
            return (y * r["gates"][..., None]).sum(1) + L.moa_bias
        if b == "expert_loop":
            out = torch.zeros(T, self.H)
            for e in range(self.E):
                t, s = torch.where(r["idx"] == e)
                out.index_add_(0, t, (ctx[t, s] @ L.o_exp[e]) * r["gates"][t, s][:, None])
            return out + L.moa_bias
        flat = ctx.reshape(T * self.k, -1)
        rows = flat if b == "jm_moa_reduce_without_sorted_gather" else flat[r["order"]]
        y = self._experts(rows, L.o_exp, r["sizes"])
        if b not in ("jm_moa_reduce_gates_missing", "jm_moa_gate_on_query"):
            y = y * r["sgates"][:, None]
        return torch.zeros(T, self.H).index_add(0, r["tok"], y) + L.moa_bias

    def _moe(self, L, x, p):
        b = _bug()
        B, S, H = x.shape
        xf = x.reshape(-1, H)
        T = xf.shape[0]
        r = self._route(xf, L.moe_router, p + "mlp.router", moe=True)
        if b in ("dense_gather", "expert_loop"):
            out = torch.zeros(T, H)
            for e in range(self.E):
                t, s = torch.where(r["idx"] == e)
                hmid = xf[t] @ L.moe_in[e]
                g, u = hmid.chunk(2, -1)
                out.index_add_(0, t, ((F.silu(g) * u) @ L.moe_out[e]) * r["gates"][t, s][:, None])
            return (out + L.moe_bias).view(B, S, H)
        hmid = self._experts(xf[r["tok"]], L.moe_in, r["sizes"])
        g, u = hmid.chunk(2, -1)
        y = self._experts(F.silu(g) * u, L.moe_out, r["sizes"]) * r["sgates"][:, None]
        return (torch.zeros(T, H).index_add(0, r["tok"], y) + L.moe_bias).view(B, S, H)

    # ---- attention --------------------------------------------------------------------------
    def _attn(self, L, x, amask, cos, sin, pos, pre):
        b = _bug()
        B, S, H = x.shape
        k_, nkv, hd = self.k, self.nkv, self.hd
        xf = x.reshape(-1, H)
        r = self._route(xf, L.moa_router, pre + "experts.router")
        q = self._map(L, xf, r, pos)  # (T, k, D)
        kv = x @ L.w_kv
        _rec(pre + "kv_proj", kv)
        kk, vv = kv.chunk(2, -1)
        q = q.view(B, S, k_ * nkv, hd).transpose(1, 2)
        kk = kk.view(B, S, nkv, hd).transpose(1, 2)
        vv = vv.view(B, S, nkv, hd).transpose(1, 2)
        if b != "jm_rope_on_sorted_rows":
            q = _rot(q, cos, sin)
        kk = _rot(kk, cos, sin)
        kk, vv = kk.repeat(1, k_, 1, 1), vv.repeat(1, k_, 1, 1)
        if b == "jm_slots_folded_into_batch":
            qb = q.view(B, k_, nkv, S, hd).reshape(B * k_, nkv, S, hd)  # (b, slot)
            kb = kk[:, :nkv].repeat(k_, 1, 1, 1)  # (slot, b)
            vb = vv[:, :nkv].repeat(k_, 1, 1, 1)
            mb = amask.repeat(k_, 1, 1, 1)
            pr = torch.softmax((qb @ kb.transpose(-1, -2)) * self.scaling + mb, -1)
            ctx = (pr @ vb).view(B, k_ * nkv, S, hd)
        elif b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, kk, vv, attn_mask=amask, scale=self.scaling)
        else:
            pr = torch.softmax((q @ kk.transpose(-1, -2)) * self.scaling + amask, -1)
            ctx = pr @ vv
        ctx = ctx.transpose(1, 2).reshape(B * S, k_, nkv * hd)
        out = self._reduce(L, ctx, r).view(B, S, H)
        _rec(pre.rstrip("."), out)
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)  # HF JetMoE: arange, not mask-derived
        causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        amask = torch.zeros(B, 1, S, S).masked_fill(~(causal & keep[:, None, None, :]), torch.finfo(torch.float32).min)
        ang = position_ids[..., None].float() * self.inv_freq
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        _rec("model.rotary_emb", ang.cos())
        h = self.emb[input_ids]
        _rec("model.embed_tokens", h)
        for L in self.layers:
            p = f"model.layers.{L.idx}."
            x = _rms(h, L.n_in, self.layer_eps)
            _rec(p + "input_layernorm", x)
            h = h + self._attn(L, x, amask, cos, sin, position_ids.expand(B, S), p + "self_attention.")
            x = _rms(h, L.n_post, self.layer_eps)
            _rec(p + "post_attention_layernorm", x)
            f = self._moe(L, x, p)
            _rec(p + "mlp", f)
            h = h + f
            _rec(p.rstrip("."), h)
        h = _rms(h, self.final_w, self.final_eps)
        _rec("model.norm", h)
        logits = h @ self.head
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return JetMoePort(state_dict, config).eval()
