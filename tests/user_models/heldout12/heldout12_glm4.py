"""Hand-written plain-PyTorch port of a GLM-4 (Glm4ForCausalLM) causal LM.

Pre-norm decoder with GLM-4 sandwich norms (post_self_attn_layernorm on the attention output,
post_mlp_layernorm on the MLP output), qkv bias, partial interleaved RoPE (first rotary_dim
channels of each head, pairs (2i, 2i+1)), GQA, fused gate_up SwiGLU, untied head.
Projections are stored as (in, out) matrices under this file's own names.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "glm_silu_of_product",  # SwiGLU written as silu(gate * up) instead of silu(gate) * up
    "glm_partial_factor_applied_twice",  # rotary_dim computed from head_dim*partial_rotary_factor and the helper multiplies by the factor again (rotary_dim 4 instead of 8)
    "glm_qk_layer_scaling_not_undone",  # Megatron/ChatGLM apply_query_key_layer_scaling: q divided by layer_number but the coeff is never multiplied back before softmax
    "glm_pad_token_row_zeroed",  # embedding row config.pad_token_id zeroed at load (nn.Embedding padding_idx / fairseq habit) although the token occurs as real text
    "glm_post_attn_norm_on_residual_sum",  # sandwich post_self_attn_layernorm applied to (residual + attn) (post-LN) instead of to the attention output before the add; cf. ggml-org/llama.cpp#14939
    "glm_rmsnorm_normalize_missing_sqrt_dim",  # RMSNorm written as F.normalize(x) * w: the sqrt(hidden) factor that turns an L2 norm into an RMS is missing
    "glm_qk_bias_after_rope",  # fused-kernel habit: q/k projection bias added after the rotary embedding instead of before
    "glm_rmsnorm_weight_before_stats",  # RMSNorm gain multiplied into x before the mean-square statistic is taken
    "glm_rope_cache_sliced_by_batch_dim",  # ChatGLM seq-first rope cache sliced with x.shape[0] on batch-first tensors: every token gets the position of its batch index
    "glm_embedding_grad_shrink_as_scale",  # GLM-130B embedding gradient shrink (h*a + h.detach()*(1-a), a forward no-op) ported without the detach term: embeddings scaled by 0.1
    "glm_scale_folded_into_rope_table_misses_pass_dims",  # softmax scale folded into q's cos/sin table: only the rotary channels get scaled, the pass-through half does not
    "glm_left_to_right_pad_roll_back_same_sign",  # left-padded rows rolled to right padding for the kernel, outputs rolled back with the same shift instead of the opposite one
]
PADDING_ONLY = {"glm_left_to_right_pad_roll_back_same_sign"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with an additive mask, GQA heads expanded first
    "fused_qkv_transposed",  # q|k|v weights and biases re-packed at load into one (in, q+2kv) matrix, split at run time
    "rope_halfsplit_permuted",  # q/k rotary rows (weights AND biases) permuted at load to half-split order, NeoX rotate_half used
    "rmsnorm_functional",  # RMSNorm via torch.nn.functional.rms_norm
    "q_scale_folded",  # softmax scale folded into q weight and q bias at load
    "rope_complex",  # interleaved RoPE done as complex multiplication (view_as_complex)
    "right_pad_kernel",  # left padding rolled to right padding for the kernel and rolled back correctly
]

GRAD_SHRINK_ALPHA = 0.1


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, w, eps):
    b = _bug()
    if b == "rmsnorm_functional":
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    if b == "glm_rmsnorm_normalize_missing_sqrt_dim":
        return F.normalize(x, dim=-1) * w
    if b == "glm_rmsnorm_weight_before_stats":
        x = x * w
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotary_dim(head_dim, factor):
    return int(head_dim * factor)


def _halfsplit_perm(n_heads, hd, rd):
    """row order that turns interleaved rotary pairs (0,1),(2,3).. into halves [0,2,4..|1,3,5..] per head"""
    idx = []
    for h in range(n_heads):
        base = h * hd
        idx += (
            [base + i for i in range(0, rd, 2)]
            + [base + i for i in range(1, rd, 2)]
            + [base + i for i in range(rd, hd)]
        )
    return torch.tensor(idx)


class Layer(nn.Module):
    pass


class Glm4Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        H = self.H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.eps = cfg.rms_norm_eps
        rp = cfg.rope_parameters
        prf = rp.get("partial_rotary_factor", 1.0)
        rd = _rotary_dim(self.hd, prf)
        if b == "glm_partial_factor_applied_twice":
            rd = _rotary_dim(rd, prf)
        self.rd = rd
        inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
        self.register_buffer("inv_freq", inv, persistent=False)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float)
        ang = pos[:, None] * inv[None]
        self.register_buffer("cos_cached", ang.cos(), persistent=False)  # (max_pos, rd/2), seq-first like ChatGLM
        self.register_buffer("sin_cached", ang.sin(), persistent=False)
        self.scaling = self.hd**-0.5
        emb = sd["model.embed_tokens.weight"].clone()
        if b == "glm_pad_token_row_zeroed" and cfg.pad_token_id is not None:
            emb[cfg.pad_token_id] = 0
        self.emb = _P(emb)
        self.final_w = _P(sd["model.norm.weight"])
        self.head = _P(sd["lm_head.weight"].t())
        qperm = _halfsplit_perm(self.nh, self.hd, rd)
        kperm = _halfsplit_perm(self.nkv, self.hd, rd)
        self.kinv = torch.argsort(kperm)
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            L = Layer()
            L.idx = i
            L.n_in = _P(sd[p + "input_layernorm.weight"])
            L.n_post_attn = _P(sd[p + "post_self_attn_layernorm.weight"])
            L.n_pre_mlp = _P(sd[p + "post_attention_layernorm.weight"])
            L.n_post_mlp = _P(sd[p + "post_mlp_layernorm.weight"])
            wq, bq = sd[a + "q_proj.weight"], sd[a + "q_proj.bias"]
            wk, bk = sd[a + "k_proj.weight"], sd[a + "k_proj.bias"]
            wv, bv = sd[a + "v_proj.weight"], sd[a + "v_proj.bias"]
            if b == "rope_halfsplit_permuted":
                wq, bq, wk, bk = wq[qperm], bq[qperm], wk[kperm], bk[kperm]
            if b == "q_scale_folded":
                wq, bq = wq * self.scaling, bq * self.scaling
            if b == "fused_qkv_transposed":
                L.wqkv = _P(torch.cat((wq, wk, wv), 0).t())
                L.bqkv = _P(torch.cat((bq, bk, bv)))
            else:
                L.wq, L.bq, L.wk, L.bk, L.wv, L.bv = (_P(t) for t in (wq.t(), bq, wk.t(), bk, wv.t(), bv))
            L.wo = _P(sd[a + "o_proj.weight"].t())
            L.w_gu = _P(sd[p + "mlp.gate_up_proj.weight"].t())
            L.w_down = _P(sd[p + "mlp.down_proj.weight"].t())
            self.layers.append(L)

    # ---- rotary -------------------------------------------------------------------------------
    def _cos_sin(self, position_ids, x):
        if _bug() == "glm_rope_cache_sliced_by_batch_dim":
            n = x.shape[0]  # meant as seq length in the seq-first original
            return self.cos_cached[:n][:, None, None, :], self.sin_cached[:n][:, None, None, :]
        return self.cos_cached[position_ids][:, :, None, :], self.sin_cached[position_ids][:, :, None, :]

    def _rope(self, x, cos, sin):
        """x: (B, S, heads, hd); cos/sin broadcastable to (B, S, heads, rd/2)"""
        b = _bug()
        rd = self.rd
        xr, xp = x[..., :rd], x[..., rd:]
        if b == "rope_halfsplit_permuted":
            x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
        elif b == "rope_complex":
            z = torch.view_as_complex(xr.float().reshape(*xr.shape[:-1], rd // 2, 2).contiguous())
            rot = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))
            out = torch.view_as_real(z * rot).flatten(-2)
        else:
            x0, x1 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).flatten(-2)
        return torch.cat((out, xp), -1)

    # ---- attention ----------------------------------------------------------------------------
    def _attn(self, L, x, amask, position_ids, pre):
        b = _bug()
        B, S, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if b == "fused_qkv_transposed":
            q, k, v = (x @ L.wqkv + L.bqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        elif b == "glm_qk_bias_after_rope":
            q, k, v = x @ L.wq, x @ L.wk, x @ L.wv + L.bv
        else:
            q, k, v = x @ L.wq + L.bq, x @ L.wk + L.bk, x @ L.wv + L.bv
        _rec(pre + "k_proj", k[..., self.kinv] if b == "rope_halfsplit_permuted" else k)
        _rec(pre + "v_proj", v)
        q, k, v = q.view(B, S, nh, hd), k.view(B, S, nkv, hd), v.view(B, S, nkv, hd)
        cos, sin = self._cos_sin(position_ids, q)
        if b == "glm_scale_folded_into_rope_table_misses_pass_dims":
            q = self._rope(q, cos * self.scaling, sin * self.scaling)
        else:
            q = self._rope(q, cos, sin)
        k = self._rope(k, cos, sin)
        if b == "glm_qk_bias_after_rope":
            q = q + L.bq.view(nh, hd)
            k = k + L.bk.view(nkv, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = nh // nkv
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        if b in ("q_scale_folded", "glm_scale_folded_into_rope_table_misses_pass_dims"):
            scale = 1.0
        elif b == "glm_qk_layer_scaling_not_undone":
            scale = self.scaling / (L.idx + 1)  # coeff = layer_number, meant to be re-applied in softmax
        else:
            scale = self.scaling
        if b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=amask, scale=scale)
        else:
            s = (q @ k.transpose(-1, -2)) * scale + amask
            ctx = torch.softmax(s, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, nh * hd)
        out = ctx @ L.wo
        _rec(pre + "o_proj", out)
        _rec(pre.rstrip("."), out)
        return out

    def _core(self, input_ids, keep, position_ids):
        b = _bug()
        S = input_ids.shape[1]
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        amask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        h = self.emb[input_ids]
        if b == "glm_embedding_grad_shrink_as_scale":
            h = h * GRAD_SHRINK_ALPHA
        _rec("model.embed_tokens", h)
        for L in self.layers:
            p = f"model.layers.{L.idx}."
            res = h
            x = _rms(h, L.n_in, self.eps)
            _rec(p + "input_layernorm", x)
            a = self._attn(L, x, amask, position_ids, p + "self_attn.")
            if b == "glm_post_attn_norm_on_residual_sum":
                h = _rms(res + a, L.n_post_attn, self.eps)
            else:
                a = _rms(a, L.n_post_attn, self.eps)
                _rec(p + "post_self_attn_layernorm", a)
                h = res + a
            res = h
            x = _rms(h, L.n_pre_mlp, self.eps)
            _rec(p + "post_attention_layernorm", x)
            gu = x @ L.w_gu
            _rec(p + "mlp.gate_up_proj", gu)
            g, u = gu.chunk(2, -1)
            f = F.silu(g * u) if b == "glm_silu_of_product" else F.silu(g) * u
            f = f @ L.w_down
            _rec(p + "mlp.down_proj", f)
            _rec(p + "mlp", f)
            f = _rms(f, L.n_post_mlp, self.eps)
            _rec(p + "post_mlp_layernorm", f)
            h = res + f
            _rec(p.rstrip("."), h)
        h = _rms(h, self.final_w, self.eps)
        _rec("model.norm", h)
        return h @ self.head

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if b in ("right_pad_kernel", "glm_left_to_right_pad_roll_back_same_sign") and position_ids is None:
            # kernel wants right padding: move each row's real tokens to the front, run, move back
            n_pad = (~keep).sum(-1).tolist()
            ids = torch.stack([input_ids[r].roll(-n_pad[r]) for r in range(B)])
            kp = torch.stack([keep[r].roll(-n_pad[r]) for r in range(B)])
            saved = globals()["REC"]
            globals()["REC"] = None
            logits = self._core(ids, kp, torch.arange(S)[None].expand(B, S))
            globals()["REC"] = saved
            sign = -1 if b == "glm_left_to_right_pad_roll_back_same_sign" else 1
            logits = torch.stack([logits[r].roll(sign * n_pad[r], 0) for r in range(B)])
            _rec("lm_head", logits)
            return logits.float()
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        logits = self._core(input_ids, keep, position_ids)
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return Glm4Port(state_dict, config).eval()
