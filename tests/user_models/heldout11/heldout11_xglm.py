"""Hand-written plain-PyTorch port of an XGLM causal LM.

fairseq-style sinusoidal positions (offset 2, padding row zeroed), sqrt(d_model)
embedding scale, pre-LN decoder layers with fc1/fc2 gelu, final layer_norm, tied head.
Projections are stored as (in, out) matrices under this file's own names.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "xg_sinusoid_cos_first",  # table built as cat(cos, sin) instead of fairseq's cat(sin, cos)
    "xg_sinusoid_half_dim_denominator",  # frequency step log(1e4)/half_dim (tensor2tensor) instead of fairseq's /(half_dim-1)
    "xg_sinusoid_precedence",  # typo `math.log(10000) / half_dim - 1` (operator precedence) for the frequency step
    "xg_sinusoid_freq_index_from_one",  # frequency index arange(1, half+1) instead of arange(half)
    "xg_padding_row_after_offset",  # zeroes table row padding_idx+offset (a real position) instead of row padding_idx; cf. facebookresearch/fairseq#1100
    "xg_pos_table_indexed_by_token_ids",  # fairseq API confusion: the growing sinusoid table is indexed with input_ids instead of position ids
    "xg_embed_scale_after_pos_add",  # sqrt(d_model) applied to (token + position) instead of the token embedding only
    "xg_q_scale_folded_weight_not_bias",  # head_dim**-0.5 folded into q_proj weight but q_proj bias left unscaled
    "xg_scaling_on_v_copy_paste",  # copy-paste: value projection also multiplied by the q scaling
    "xg_kv_from_unnormed_residual",  # k/v projections fed the un-normalised residual (enc-dec template), q the normed input
    "xg_stale_residual_for_ffn",  # FFN residual taken from the layer input (residual variable not refreshed after attention)
    "xg_act_relu_fairseq_default",  # activation taken from fairseq transformer_lm default relu instead of config gelu
    "xg_key_padding_mask_from_pad_token_id",  # fairseq style key_padding_mask = input_ids.eq(config.pad_token_id) instead of attention_mask
]
PADDING_ONLY = {"xg_key_padding_mask_from_pad_token_id"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention, scale=1 after pre-scaling q
    "q_scale_folded",  # scaling folded into both q weight and q bias at build time
    "fused_qkv_repack",  # q,k,v re-packed into one fused (in, 3*out) matrix + bias and split at runtime
    "sinusoid_on_the_fly",  # position embedding computed analytically from positions (no table)
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _ln(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _freqs(half):
    b = _bug()
    if b == "xg_sinusoid_half_dim_denominator":
        step = math.log(10000) / half
    elif b == "xg_sinusoid_precedence":
        step = math.log(10000) / half - 1
    else:
        step = math.log(10000) / (half - 1)
    idx = torch.arange(1, half + 1) if b == "xg_sinusoid_freq_index_from_one" else torch.arange(half)
    return torch.exp(idx.float() * -step)


def _sin_table(n, d, padding_idx, offset):
    half = d // 2
    ang = torch.arange(n, dtype=torch.float32)[:, None] * _freqs(half)[None]
    if _bug() == "xg_sinusoid_cos_first":
        t = torch.cat((ang.cos(), ang.sin()), 1)
    else:
        t = torch.cat((ang.sin(), ang.cos()), 1)
    if d % 2:
        t = torch.cat((t, torch.zeros(n, 1)), 1)
    if padding_idx is not None:
        row = padding_idx + offset if _bug() == "xg_padding_row_after_offset" else padding_idx
        t[row] = 0
    return t


class Block(nn.Module):
    pass


class XGLMPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        d = self.d = cfg.d_model
        self.nh = cfg.attention_heads
        self.hd = d // self.nh
        self.scaling = self.hd**-0.5
        self.embed_scale = math.sqrt(d) if cfg.scale_embedding else 1.0
        self.offset = 2
        self.pad = cfg.pad_token_id
        self.tok = _P(sd["model.embed_tokens.weight"])  # also used as the tied head
        self.register_buffer(
            "pos_table",
            _sin_table(cfg.max_position_embeddings + self.offset, d, self.pad, self.offset),
            persistent=False,
        )
        self.lnf_w = _P(sd["model.layer_norm.weight"])
        self.lnf_b = _P(sd["model.layer_norm.bias"])
        self.blocks = nn.ModuleList()
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            blk = Block()
            blk.idx = i
            blk.ln1_w = _P(sd[p + "self_attn_layer_norm.weight"])
            blk.ln1_b = _P(sd[p + "self_attn_layer_norm.bias"])
            blk.ln2_w = _P(sd[p + "final_layer_norm.weight"])
            blk.ln2_b = _P(sd[p + "final_layer_norm.bias"])
            wq, bq = sd[a + "q_proj.weight"].t(), sd[a + "q_proj.bias"]
            if b in ("q_scale_folded", "xg_q_scale_folded_weight_not_bias"):
                wq = wq * self.scaling
                if b == "q_scale_folded":
                    bq = bq * self.scaling
            wk, bk = sd[a + "k_proj.weight"].t(), sd[a + "k_proj.bias"]
            wv, bv = sd[a + "v_proj.weight"].t(), sd[a + "v_proj.bias"]
            if b == "fused_qkv_repack":
                blk.wqkv = _P(torch.cat((wq, wk, wv), 1))
                blk.bqkv = _P(torch.cat((bq, bk, bv)))
            else:
                blk.wq, blk.bq, blk.wk, blk.bk, blk.wv, blk.bv = map(_P, (wq, bq, wk, bk, wv, bv))
            blk.wo = _P(sd[a + "out_proj.weight"].t())
            blk.bo = _P(sd[a + "out_proj.bias"])
            blk.w1 = _P(sd[p + "fc1.weight"].t())
            blk.b1 = _P(sd[p + "fc1.bias"])
            blk.w2 = _P(sd[p + "fc2.weight"].t())
            blk.b2 = _P(sd[p + "fc2.bias"])
            self.blocks.append(blk)

    def _positions(self, input_ids, position_ids):
        b = _bug()
        if b == "xg_pos_table_indexed_by_token_ids":
            idx = input_ids + self.offset
            n = int(idx.max()) + 1
            table = self.pos_table if n <= self.pos_table.shape[0] else _sin_table(n, self.d, self.pad, self.offset)
            return table[idx]
        idx = position_ids + self.offset
        if b == "sinusoid_on_the_fly":
            ang = (position_ids + self.offset).float()[..., None] * _freqs(self.d // 2)
            return torch.cat((ang.sin(), ang.cos()), -1)
        return self.pos_table[idx]

    def _attn(self, blk, xn, res, amask, pre):
        b = _bug()
        B, S, d = xn.shape
        nh, hd = self.nh, self.hd
        kv_in = res if b == "xg_kv_from_unnormed_residual" else xn
        if b == "fused_qkv_repack":
            q, k, v = (xn @ blk.wqkv + blk.bqkv).split(d, -1)
        else:
            q = xn @ blk.wq + blk.bq
            k = kv_in @ blk.wk + blk.bk
            v = kv_in @ blk.wv + blk.bv
        if b not in ("q_scale_folded", "xg_q_scale_folded_weight_not_bias"):
            q = q * self.scaling
        if b == "xg_scaling_on_v_copy_paste":
            v = v * self.scaling
        _rec(pre + "k_proj", k)
        _rec(pre + "v_proj", v)
        q, k, v = (t.view(B, S, nh, hd).transpose(1, 2) for t in (q, k, v))
        if b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=amask, scale=1.0)
        else:
            ctx = torch.softmax(q @ k.transpose(-1, -2) + amask, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, d)
        out = ctx @ blk.wo + blk.bo
        _rec(pre + "out_proj", out)
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
        if b == "xg_key_padding_mask_from_pad_token_id":
            keep = input_ids.ne(self.pad)
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        amask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        tok = self.tok[input_ids]
        pe = self._positions(input_ids, position_ids)
        if b == "xg_embed_scale_after_pos_add":
            _rec("model.embed_tokens", tok)
            h = (tok + pe) * self.embed_scale
        else:
            tok = tok * self.embed_scale
            _rec("model.embed_tokens", tok)
            h = tok + pe
        _rec("model.embed_positions", pe)
        for blk in self.blocks:
            p = f"model.layers.{blk.idx}."
            layer_in = h
            x = _ln(h, blk.ln1_w, blk.ln1_b)
            _rec(p + "self_attn_layer_norm", x)
            h = h + self._attn(blk, x, h, amask, p + "self_attn.")
            res = layer_in if b == "xg_stale_residual_for_ffn" else h
            x = _ln(h, blk.ln2_w, blk.ln2_b)
            _rec(p + "final_layer_norm", x)
            f = x @ blk.w1 + blk.b1
            _rec(p + "fc1", f)
            f = F.relu(f) if b == "xg_act_relu_fairseq_default" else F.gelu(f)
            f = f @ blk.w2 + blk.b2
            _rec(p + "fc2", f)
            h = res + f
            _rec(p.rstrip("."), h)
        h = _ln(h, self.lnf_w, self.lnf_b)
        _rec("model.layer_norm", h)
        logits = h @ self.tok.t()
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return XGLMPort(state_dict, config).eval()
