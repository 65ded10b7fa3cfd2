"""Hand-written plain-PyTorch port of a DeepSeek-V3 style causal LM (MLA + grouped sigmoid MoE).

Weights are re-packed from the HF state_dict into this file's own layout:
q_down / q_up split into nope+rope parts per head, kv_a split into latent and
shared rope-key, kv_b split into per-head K_up / V_up, experts stacked (E, in, out).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "mla_q_a_norm_skipped",  # q_a_layernorm on the q LoRA bottleneck forgotten (only kv norm ported)
    "mla_kv_norm_over_rope",  # RMS statistics of kv_a_layernorm taken over latent+rope (norm before the split)
    "mla_scale_from_nope_dim",  # softmax scale 1/sqrt(qk_nope_head_dim) instead of 1/sqrt(nope+rope)
    "mla_mscale_hardcoded",  # YaRN mscale^2 (factor 40, mscale_all_dim 1) copied from the V3 release config although rope_scaling is None; cf. onnxruntime/mobius#548, NVIDIA/Megatron-LM#1429
    "mla_v_pad_slice_wrong_end",  # v zero-padded to q_head_dim for a kernel, output sliced [-v_head_dim:] instead of [:v_head_dim]; cf. ggml-org/llama.cpp#7325 (k/v head dim mixup)
    "mla_qk_concat_order_mismatch",  # q built as [rope, nope] but k as [nope, rope]
    "mla_rope_permute_q_only",  # interleaved->half-split permutation (for rotate_half) applied to q_b rope rows but not to kv_a rope rows
    "mla_absorbed_unnormed_latent",  # weight-absorbed path attends over the compressed kv before kv_a_layernorm
    "mla_absorbed_scale_from_latent_dim",  # absorbed path uses 1/sqrt(kv_lora_rank+rope) as scale; cf. ollama/ollama#13893
    "moe_bias_in_weights",  # e_score_correction_bias kept in the gating weights, not only in the selection; cf. vllm-project/vllm#11971, huggingface/transformers#41647
    "moe_group_score_max",  # group score = max expert score instead of sum of the top-2 in each group
    "moe_group_select_without_bias",  # group ranking uses raw sigmoid scores, correction bias only in the expert top-k
    "moe_group_mask_not_assigned",  # `scores.masked_fill(...)` result discarded (not in-place), so group limiting is a no-op
    "moe_scale_before_norm",  # routed_scaling_factor applied before top-k renormalisation (cancels out)
    "moe_scaling_on_shared",  # routed_scaling_factor applied to routed+shared sum instead of routed weights only
    "moe_weights_from_separate_topk",  # gate values taken from a separate topk of raw scores, paired by rank with the biased/grouped indices
]
PADDING_ONLY = set()
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with explicit scale and additive mask
    "absorbed",  # weight-absorbed MLA: q_nope @ W_UK, attention over the latent, W_UV after
    "rope_halfsplit_repack",  # rope rows of q_b and kv_a permuted to half-split layout, rotate_half applied
    "moe_dense_dispatch",  # every expert run on every token, combined through a sparse (T,E) gate matrix
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
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _silu_mlp(x, wg, wu, wd):
    return (F.silu(x @ wg) * (x @ wu)) @ wd


def _rope_interleaved(x, cos, sin):
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), -1).flatten(-2)


def _rope_halves(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Block(nn.Module):
    pass


class DeepseekPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        self.nh = nh = cfg.num_attention_heads
        self.dn = dn = cfg.qk_nope_head_dim
        self.dr = dr = cfg.qk_rope_head_dim
        self.dv = dv = cfg.v_head_dim
        self.r = r = cfg.kv_lora_rank
        self.eps = cfg.rms_norm_eps
        rp = getattr(cfg, "rope_parameters", None) or {}
        self.theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.halfsplit = b in ("rope_halfsplit_repack", "mla_rope_permute_q_only")
        perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
        self.tok = _P(sd["model.embed_tokens.weight"])
        self.final_norm = _P(sd["model.norm.weight"])
        self.head = _P(sd["lm_head.weight"].t())  # (H, V)
        self.blocks = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            blk = Block()
            blk.idx = i
            blk.n_attn = _P(sd[p + "input_layernorm.weight"])
            blk.n_mlp = _P(sd[p + "post_attention_layernorm.weight"])
            blk.q_down = _P(sd[a + "q_a_proj.weight"].t())
            blk.q_norm = _P(sd[a + "q_a_layernorm.weight"])
            q_up = sd[a + "q_b_proj.weight"].view(nh, dn + dr, -1)
            kv_a = sd[a + "kv_a_proj_with_mqa.weight"]
            k_rope_w = kv_a[r:]
            q_rope_w = q_up[:, dn:]
            if self.halfsplit:
                q_rope_w = q_rope_w[:, perm]
                if b != "mla_rope_permute_q_only":
                    k_rope_w = k_rope_w[perm]
            blk.q_up_nope = _P(q_up[:, :dn].permute(2, 0, 1))  # (qr, nh, dn)
            blk.q_up_rope = _P(q_rope_w.permute(2, 0, 1))  # (qr, nh, dr)
            blk.latent_down = _P(kv_a[:r].t())  # (H, r)
            blk.krope_down = _P(k_rope_w.t())  # (H, dr)
            blk.kv_norm = _P(sd[a + "kv_a_layernorm.weight"])
            kv_b = sd[a + "kv_b_proj.weight"].view(nh, dn + dv, r)
            blk.k_up = _P(kv_b[:, :dn])  # (nh, dn, r)
            blk.v_up = _P(kv_b[:, dn:])  # (nh, dv, r)
            blk.o = _P(sd[a + "o_proj.weight"].t())  # (nh*dv, H)
            m = p + "mlp."
            blk.moe = (m + "gate.weight") in sd
            if blk.moe:
                blk.router = _P(sd[m + "gate.weight"].t())  # (H, E)
                blk.router_bias = _P(sd[m + "gate.e_score_correction_bias"])
                gu = sd[m + "experts.gate_up_proj"]  # (E, 2I, H)
                inter = gu.shape[1] // 2
                blk.e_gate = _P(gu[:, :inter].transpose(1, 2))  # (E, H, I)
                blk.e_up = _P(gu[:, inter:].transpose(1, 2))
                blk.e_down = _P(sd[m + "experts.down_proj"].transpose(1, 2))  # (E, I, H)
                s = m + "shared_experts."
                blk.s_gate = _P(sd[s + "gate_proj.weight"].t())
                blk.s_up = _P(sd[s + "up_proj.weight"].t())
                blk.s_down = _P(sd[s + "down_proj.weight"].t())
            else:
                blk.d_gate = _P(sd[m + "gate_proj.weight"].t())
                blk.d_up = _P(sd[m + "up_proj.weight"].t())
                blk.d_down = _P(sd[m + "down_proj.weight"].t())
            self.blocks.append(blk)

    # ------------------------------------------------------------------ rope
    def _cos_sin(self, pos):
        dr = self.dr
        inv = 1.0 / (self.theta ** (torch.arange(0, dr, 2, dtype=torch.float32) / dr))
        ang = pos.float()[..., None] * inv  # (B,S,dr/2)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # (B,1,S,dr/2)
        if self.halfsplit:
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        return cos, sin

    def _rope(self, x, cs):
        cos, sin = cs
        if self.halfsplit:
            h = x.shape[-1] // 2
            return _rope_halves(x, cos[..., :h], sin[..., :h])
        return _rope_interleaved(x, cos, sin)

    # ------------------------------------------------------------- attention
    def _attn(self, blk, x, cs, amask, pre):
        b = _bug()
        B, S, _ = x.shape
        nh, dn, dr, dv = self.nh, self.dn, self.dr, self.dv
        cq = x @ blk.q_down
        _rec(pre + "q_a_proj", cq)
        if b != "mla_q_a_norm_skipped":
            cq = _rms(cq, blk.q_norm, self.eps)
        _rec(pre + "q_a_layernorm", cq)
        q_nope = torch.einsum("bsr,rhd->bhsd", cq, blk.q_up_nope)
        q_rope = torch.einsum("bsr,rhd->bhsd", cq, blk.q_up_rope)
        if not self.halfsplit:
            _rec(pre + "q_b_proj", torch.cat((q_nope, q_rope), -1).transpose(1, 2).reshape(B, S, -1))
        latent = x @ blk.latent_down
        k_rope = x @ blk.krope_down
        if not self.halfsplit:
            _rec(pre + "kv_a_proj_with_mqa", torch.cat((latent, k_rope), -1))
        if b == "mla_kv_norm_over_rope":
            var = torch.cat((latent, k_rope), -1).pow(2).mean(-1, keepdim=True)
            latent_n = blk.kv_norm * (latent * torch.rsqrt(var + self.eps))
        else:
            latent_n = _rms(latent, blk.kv_norm, self.eps)
        _rec(pre + "kv_a_layernorm", latent_n)
        q_rope = self._rope(q_rope, cs)
        k_rope = self._rope(k_rope[:, None], cs)  # (B,1,S,dr) shared by all heads

        scale = (dn + dr) ** -0.5
        if b == "mla_scale_from_nope_dim":
            scale = dn**-0.5
        if b == "mla_mscale_hardcoded":
            mscale = 0.1 * 1.0 * math.log(40.0) + 1.0
            scale = scale * mscale * mscale

        if b in ("absorbed", "mla_absorbed_unnormed_latent", "mla_absorbed_scale_from_latent_dim"):
            lat = latent if b == "mla_absorbed_unnormed_latent" else latent_n
            if b == "mla_absorbed_scale_from_latent_dim":
                scale = (self.r + dr) ** -0.5
            q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope, blk.k_up)
            scores = torch.einsum("bhsr,btr->bhst", q_lat, lat) + torch.einsum("bhsd,btd->bhst", q_rope, k_rope[:, 0])
            probs = torch.softmax(scores * scale + amask, -1)
            ctx_lat = torch.einsum("bhst,btr->bhsr", probs, lat)
            out = torch.einsum("bhsr,hdr->bhsd", ctx_lat, blk.v_up)
        else:
            k_nope = torch.einsum("bsr,hdr->bhsd", latent_n, blk.k_up)
            v = torch.einsum("bsr,hdr->bhsd", latent_n, blk.v_up)
            _rec(pre + "kv_b_proj", torch.cat((k_nope, v), -1).transpose(1, 2).reshape(B, S, -1))
            k_rope = k_rope.expand(B, nh, S, dr)
            if b == "mla_qk_concat_order_mismatch":
                q = torch.cat((q_rope, q_nope), -1)
            else:
                q = torch.cat((q_nope, q_rope), -1)
            k = torch.cat((k_nope, k_rope), -1)
            if b == "mla_v_pad_slice_wrong_end":
                v = F.pad(v, (0, dn + dr - dv))
            if b == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=amask, scale=scale)
            else:
                probs = torch.softmax((q @ k.transpose(-1, -2)) * scale + amask, -1)
                out = probs @ v
            if b == "mla_v_pad_slice_wrong_end":
                out = out[..., -dv:]
        out = out.transpose(1, 2).reshape(B, S, nh * dv) @ blk.o
        _rec(pre + "o_proj", out)
        _rec(pre.rstrip("."), out)
        return out

    # ------------------------------------------------------------------- moe
    def _moe(self, blk, x, pre):
        b = _bug()
        cfg = self.cfg
        B, S, H = x.shape
        xf = x.reshape(-1, H)
        T = xf.shape[0]
        E, K, G, TG = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        rsf = cfg.routed_scaling_factor
        logits = xf @ blk.router
        _rec(pre + "gate", logits)
        scores = torch.sigmoid(logits)
        choice = scores + blk.router_bias
        gsrc = scores if b == "moe_group_select_without_bias" else choice
        gv = gsrc.view(T, G, E // G)
        if b == "moe_group_score_max":
            gscore = gv.max(-1).values
        else:
            gscore = gv.topk(2, dim=-1).values.sum(-1)
        gidx = gscore.topk(TG, dim=-1).indices
        gmask = torch.zeros(T, G).scatter(1, gidx, 1.0)
        smask = gmask[:, :, None].expand(T, G, E // G).reshape(T, E).bool()
        if b == "moe_group_mask_not_assigned":
            choice.masked_fill(~smask, 0.0)
            masked = choice
        else:
            masked = choice.masked_fill(~smask, 0.0)
        idx = masked.topk(K, dim=-1).indices
        if b == "moe_bias_in_weights":
            w = choice.gather(1, idx)
        elif b == "moe_weights_from_separate_topk":
            w = scores.topk(K, dim=-1).values
        else:
            w = scores.gather(1, idx)
        if b == "moe_scale_before_norm":
            w = w * rsf
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        else:
            if cfg.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            if b != "moe_scaling_on_shared":
                w = w * rsf
        if b == "moe_dense_dispatch":
            comb = torch.zeros(T, E).scatter_add(1, idx, w)
            h = F.silu(torch.einsum("th,ehi->eti", xf, blk.e_gate)) * torch.einsum("th,ehi->eti", xf, blk.e_up)
            eo = torch.einsum("eti,eih->eth", h, blk.e_down)
            routed = torch.einsum("te,eth->th", comb, eo)
        else:
            routed = torch.zeros_like(xf)
            for e in range(E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                y = _silu_mlp(xf[tok], blk.e_gate[e], blk.e_up[e], blk.e_down[e])
                routed.index_add_(0, tok, y * w[tok, slot, None])
        _rec(pre + "experts", routed)
        shared = _silu_mlp(x, blk.s_gate, blk.s_up, blk.s_down)
        _rec(pre + "shared_experts", shared)
        out = routed.view(B, S, H) + shared
        if b == "moe_scaling_on_shared":
            out = out * rsf
        _rec(pre.rstrip("."), out)
        return out

    # --------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        amask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        cs = self._cos_sin(position_ids)
        h = self.tok[input_ids]
        _rec("model.embed_tokens", h)
        for blk in self.blocks:
            p = f"model.layers.{blk.idx}."
            x = _rms(h, blk.n_attn, self.eps)
            _rec(p + "input_layernorm", x)
            h = h + self._attn(blk, x, cs, amask, p + "self_attn.")
            x = _rms(h, blk.n_mlp, self.eps)
            _rec(p + "post_attention_layernorm", x)
            if blk.moe:
                h = h + self._moe(blk, x, p + "mlp.")
            else:
                y = _silu_mlp(x, blk.d_gate, blk.d_up, blk.d_down)
                _rec(p + "mlp", y)
                h = h + y
            _rec(p.rstrip("."), h)
        h = _rms(h, self.final_norm, self.eps)
        _rec("model.norm", h)
        logits = h @ self.head
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return DeepseekPort(state_dict, config).eval()
