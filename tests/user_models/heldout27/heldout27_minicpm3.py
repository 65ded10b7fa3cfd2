"""Hand-written plain-PyTorch port of MiniCPM3 (MiniCPM3ForCausalLM, OpenBMB).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding MULTIPLIED by config.scale_emb; output head TIED to the embedding (tie_word_embeddings);
  - Llama RMSNorm y = w * x / sqrt(mean(x^2) + eps): block pre-norms and final norm with config.rms_norm_eps;
  * muP residuals: h = h + (scale_depth / sqrt(num_hidden_layers)) * Attn(RMS_in(h)), same factor on the MLP branch;
  * final hidden DIVIDED by hidden_size / dim_model_base (config.logits_scaling) before the head;
  * MLA attention (DeepSeek-V2 style, num_key_value_heads == heads):
      q = q_b(RMS_qa(q_a(x))), per head [q_nope (qk_nope) | q_rope (qk_rope)];
      c = kv_a(x) = [latent (kv_lora) | k_rope (qk_rope, ONE head shared by all heads)];
      kv_b(RMS_kva(latent)) per head [k_nope_h | v_h];  k_h = [k_nope_h | rope(k_rope)];
      * q_a / kv_a norms use eps 1e-6 (Transformers builds them with the RMSNorm default, not config.rms_norm_eps);
      scores * (qk_nope + qk_rope)^-0.5 (NOT config.head_dim, which the config sets to qk_rope_head_dim);
  * RoPE only over the qk_rope channels, HALF-SPLIT (rotate_half) form, theta = rope_parameters["rope_theta"]
    (unlike DeepSeek-V2's interleaved pairs);
  - SwiGLU MLP down(silu(gate(x)) * up(x));
  - padding: HF-style 0/1 attention_mask masks keys (additive finfo.min, no NaN); position_ids as given, else 0..S-1.

Weight layout of this port (own names):
  tok (V, H) (also the head); g_out (H,);
  blocks[i].g1 / g2 (H,);
  attn.w_qa (H, q_lora) (in, out); attn.g_qa (q_lora,); attn.w_qb (q_lora, nh, nope + rope) (in, heads, out);
  attn.w_kva (H, kv_lora + rope) (in, out); attn.g_kva (kv_lora,);
  attn.w_uk (nh, nope, kv_lora), attn.w_uv (nh, vd, kv_lora)   (kv_b_proj split per head, F.linear layout);
  attn.w_o (nh vd, H) (in, out);
  mlp.w_gu (H, 2 I) (in, out) columns [gate | up]; mlp.w_dn (I, H) (in, out).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "mc_scale_emb_missing",  # embeddings not multiplied by config.scale_emb
    "mc_depth_no_sqrt",  # residual branches scaled by scale_depth, not scale_depth / sqrt(num_hidden_layers)
    "mc_depth_attn_only",  # muP residual factor applied to the attention branch only, MLP branch added plainly
    "mc_logit_scale_inverted",  # final hidden multiplied by hidden_size / dim_model_base instead of divided
    "mc_q_a_norm_skipped",  # loader drops q_a_layernorm: q_b applied straight to q_a(x) (tensor unused)
    "mc_kv_split_swapped",  # compressed kv read as [k_rope | latent] instead of [latent | k_rope]
    "mc_q_split_swapped",  # per-head query read as [q_rope | q_nope] instead of [q_nope | q_rope]
    "mc_scale_rope_dim",  # softmax scale from config.head_dim (= qk_rope_head_dim) instead of nope + rope
    "mc_kvb_blocks",  # kv_b output read as [all heads' k_nope | all heads' v] instead of per head [k_nope | v]
    "mc_rope_interleaved",  # DeepSeek-style interleaved RoPE pairs (2i, 2i+1) instead of half-split
    "mc_k_rope_unrotated",  # RoPE applied to q_rope only; the shared k_rope head left unrotated
    "mc_logit_scale_before_norm",  # 1 / logits_scaling applied before the final RMSNorm (which then undoes it)
    "mc_padding_mask_ignored",  # attention_mask unused: only the causal mask, pad keys are attended
]
PADDING_ONLY = {"mc_padding_mask_ignored"}
CLEAN = [
    "mc_sdpa",  # F.scaled_dot_product_attention with a boolean mask instead of the explicit softmax
    "mc_absorbed",  # MLA weight absorption: scores and values computed in the kv_lora latent space
    "mc_folded_scales",  # scale_emb, residual factor and 1 / logits_scaling folded into the weights at load
    "mc_rowwise",  # a padded batch run row by row on its real tokens only, with their own positions
    "mc_complex_rope",  # RoPE as a complex multiplication of (x_i, x_{i + d/2}) pairs
]


def _bug():
    return BUG


def _rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, cos, sin):
    # x (B, h, S, d); cos / sin (B, 1, S, d/2)
    b = _bug()
    if b == "mc_rope_interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.stack((r1, r2), -1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if b == "mc_complex_rope":
        z = torch.complex(x1, x2) * torch.complex(cos, sin)
        return torch.cat((z.real, z.imag), -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class _Attn(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        self.nh = cfg.num_attention_heads
        self.nope, self.rdim, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.lora = cfg.kv_lora_rank
        self.w_qa = nn.Parameter(sd[p + "q_a_proj.weight"].t().contiguous())
        if _bug() == "mc_q_a_norm_skipped":
            self.g_qa = None
        else:
            self.g_qa = nn.Parameter(sd[p + "q_a_layernorm.weight"].clone())
        qb = sd[p + "q_b_proj.weight"]  # (nh * (nope + rope), q_lora)
        self.w_qb = nn.Parameter(qb.t().reshape(qb.shape[1], self.nh, self.nope + self.rdim).contiguous())
        self.w_kva = nn.Parameter(sd[p + "kv_a_proj_with_mqa.weight"].t().contiguous())
        self.g_kva = nn.Parameter(sd[p + "kv_a_layernorm.weight"].clone())
        kvb = sd[p + "kv_b_proj.weight"]  # (nh * (nope + vd), lora)
        if _bug() == "mc_kvb_blocks":
            k_all, v_all = kvb.split([self.nh * self.nope, self.nh * self.vd], 0)
            uk, uv = k_all.reshape(self.nh, self.nope, -1), v_all.reshape(self.nh, self.vd, -1)
        else:
            per = kvb.reshape(self.nh, self.nope + self.vd, self.lora)
            uk, uv = per[:, : self.nope], per[:, self.nope :]
        self.w_uk = nn.Parameter(uk.contiguous())
        self.w_uv = nn.Parameter(uv.contiguous())
        self.w_o = nn.Parameter(sd[p + "o_proj.weight"].t().contiguous())
        qk = self.nope + self.rdim
        self.scale = (cfg.head_dim if _bug() == "mc_scale_rope_dim" else qk) ** -0.5
        self.eps_lat = 1e-6

    def forward(self, x, cos, sin, bias, keep):
        b = _bug()
        B, S, _ = x.shape
        qa = x @ self.w_qa
        if self.g_qa is not None:
            qa = _rms(qa, self.g_qa, self.eps_lat)
        q = torch.einsum("bsr,rhd->bhsd", qa, self.w_qb)
        if b == "mc_q_split_swapped":
            q_rope, q_nope = q.split([self.rdim, self.nope], -1)
        else:
            q_nope, q_rope = q.split([self.nope, self.rdim], -1)
        c = x @ self.w_kva
        if b == "mc_kv_split_swapped":
            k_rope, lat = c.split([self.rdim, self.lora], -1)
        else:
            lat, k_rope = c.split([self.lora, self.rdim], -1)
        lat = _rms(lat, self.g_kva, self.eps_lat)  # (B, S, lora)
        q_rope = _rope(q_rope, cos, sin)
        k_rope = k_rope[:, None]  # (B, 1, S, rope)
        if b != "mc_k_rope_unrotated":
            k_rope = _rope(k_rope, cos, sin)
        if b == "mc_absorbed":
            q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope, self.w_uk)
            scores = q_lat @ lat[:, None].transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)
            scores = scores * self.scale
            if bias is not None:
                scores = scores + bias
            pr = torch.softmax(scores, -1)
            o_lat = pr @ lat[:, None]  # (B, h, S, lora)
            o = torch.einsum("bhsr,hvr->bhsv", o_lat, self.w_uv)
        else:
            k_nope = torch.einsum("bsr,hdr->bhsd", lat, self.w_uk)
            v = torch.einsum("bsr,hvr->bhsv", lat, self.w_uv)
            k = torch.cat((k_nope, k_rope.expand(-1, self.nh, -1, -1)), -1)
            qq = torch.cat((q_nope, q_rope), -1)
            if b == "mc_sdpa":
                o = F.scaled_dot_product_attention(qq, k, v, attn_mask=keep, scale=self.scale)
            else:
                scores = (qq @ k.transpose(-1, -2)) * self.scale
                if bias is not None:
                    scores = scores + bias
                o = torch.softmax(scores, -1) @ v
        o = o.transpose(1, 2).reshape(B, S, self.nh * self.vd)
        return o @ self.w_o


class _MLP(nn.Module):
    def __init__(self, sd, p):
        super().__init__()
        self.w_gu = nn.Parameter(torch.cat((sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]), 0).t().contiguous())
        self.w_dn = nn.Parameter(sd[p + "down_proj.weight"].t().contiguous())

    def forward(self, x):
        g, u = (x @ self.w_gu).chunk(2, -1)
        return (F.silu(g) * u) @ self.w_dn


class _Block(nn.Module):
    def __init__(self, sd, i, cfg):
        super().__init__()
        p = f"model.layers.{i}."
        self.g1 = nn.Parameter(sd[p + "input_layernorm.weight"].clone())
        self.g2 = nn.Parameter(sd[p + "post_attention_layernorm.weight"].clone())
        self.attn = _Attn(sd, p + "self_attn.", cfg)
        self.mlp = _MLP(sd, p + "mlp.")


class MiniCPM3Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.tok = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        self.g_out = nn.Parameter(sd["model.norm.weight"].clone())
        self.blocks = nn.ModuleList(_Block(sd, i, cfg) for i in range(cfg.num_hidden_layers))
        L = cfg.num_hidden_layers
        self.res = cfg.scale_depth if _bug() == "mc_depth_no_sqrt" else cfg.scale_depth / math.sqrt(L)
        self.emb_scale = 1.0 if _bug() == "mc_scale_emb_missing" else float(cfg.scale_emb)
        ls = cfg.hidden_size / cfg.dim_model_base
        self.out_scale = ls if _bug() == "mc_logit_scale_inverted" else 1.0 / ls
        d = cfg.qk_rope_head_dim
        theta = cfg.rope_parameters["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d), False)
        self.folded = _bug() == "mc_folded_scales"
        if self.folded:  # fold every scalar into the weights once
            with torch.no_grad():
                self.tok_in = nn.Parameter(self.tok * self.emb_scale)
                self.head = nn.Parameter(self.tok * self.out_scale)
                for blk in self.blocks:
                    blk.attn.w_o.mul_(self.res)
                    blk.mlp.w_dn.mul_(self.res)

    def _run(self, ids, mask, pos):
        b = _bug()
        B, S = ids.shape
        x = self.tok_in[ids] if self.folded else self.tok[ids] * self.emb_scale
        if pos is None:
            pos = torch.arange(S, device=ids.device)[None].expand(B, S)
        ang = pos[:, None, :, None].float() * self.inv_freq  # (B, 1, S, d/2)
        cos, sin = ang.cos(), ang.sin()
        causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
        keep = causal[None, None].expand(B, 1, S, S)
        if mask is not None and b != "mc_padding_mask_ignored":
            keep = keep & mask.bool()[:, None, None, :]
        bias = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, torch.finfo(x.dtype).min)
        for blk in self.blocks:
            a = blk.attn(_rms(x, blk.g1, self.eps), cos, sin, bias, keep)
            x = x + (a if self.folded else a * self.res)
            m = blk.mlp(_rms(x, blk.g2, self.eps))
            if self.folded or b == "mc_depth_attn_only":
                x = x + m
            else:
                x = x + m * self.res
        if b == "mc_logit_scale_before_norm":
            return _rms(x * self.out_scale, self.g_out, self.eps) @ self.tok.t()
        x = _rms(x, self.g_out, self.eps)
        if self.folded:
            return x @ self.head.t()
        return (x * self.out_scale) @ self.tok.t()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if _bug() == "mc_rowwise" and attention_mask is not None:
            out = torch.zeros(*input_ids.shape, self.tok.shape[0])
            for r in range(input_ids.shape[0]):
                idx = attention_mask[r].bool().nonzero().squeeze(-1)
                pos = None if position_ids is None else position_ids[r : r + 1, idx]
                out[r, idx] = self._run(input_ids[r : r + 1, idx], None, pos)[0]
            return out
        return self._run(input_ids, attention_mask, position_ids).float()


def build(state_dict, config):
    return MiniCPM3Port(state_dict, config).eval()
