"""Hand-written plain-PyTorch port of Hugging Face `MptForCausalLM` (heldout10 set).

Covers: token embedding (no positions), ALiBi position bias (slopes 2^-(8 h / H), bias
slope * (key - last)), fused Wqkv with clip_qkv clamp, bias-free LayerNorms, exact GELU MLP
(up/down, 4x), pre-LN residual blocks, final norm and a head tied to the embedding.

Conventions: weights are re-packed by `build` into my own flat dict (emb, L<i>.ln1 / qkv / o / ln2 /
up / down, lnf, head). `forward(input_ids, attention_mask=None, position_ids=None)` returns float32
logits (batch, seq, vocab); attention_mask is (batch, seq) with 0 for pads (left padding); MPT uses no
position ids (ALiBi is translation invariant), so position_ids is accepted and ignored.
`BUG` selects one porting mistake (read at build and forward time); when `REC` is a dict the
intermediates are stored under the matching Transformers module names.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "alibi_slopes_head_dim",  # slope exponent step computed as bias_max/head_dim instead of bias_max/n_heads - max-bias 8 misread (cf. paiml/aprender#2143, ALiBi slope-exponent formula error)
    "alibi_int_slopes",  # slopes cast to the int32 dtype of the distance arange -> all slopes 0, ALiBi silently gone
    "alibi_reorder_always",  # the non-power-of-two slope interleave [1::2]+[::2] applied for every head count
    "clip_int_value",  # clip_qkv read through int() (C++ style int hparam) -> clamp at 2 instead of 2.5
    "clip_after_out_proj",  # clamp applied to the attention output projection instead of to the fused qkv (cf. vllm-project/vllm#35523, clip_qkv applied at the wrong point)
    "clip_on_input",  # clamp applied to the normed hidden state entering Wqkv instead of Wqkv's output (cf. vllm-project/vllm#35523, clip_qkv applied at the wrong point)
    "low_precision_ln_bf16",  # 'low_precision_layernorm' reproduced by running the LayerNorms in bfloat16 (llm-foundry autocast semantics) while HF runs fp32
    "logit_scale_inv_sqrt_d",  # llm-foundry logit_scale='inv_sqrt_d_model' assumed although config.logit_scale is None
    "pad_mask_query_axis",  # padding mask broadcast over the query axis ([:, None, :, None]) instead of the key axis -> pad keys stay visible
    "residual_after_norm",  # attention residual taken from norm_1's output instead of the block input
    "loader_ffn_last_layer",  # loader loop reuses a stale layer variable: every block gets the last block's ffn weights
    "scores_bf16",  # attention scores q@k^T computed in bfloat16 (mixed-precision kernel) before the fp32 softmax
    "softmax_over_queries",  # attention softmax taken over the query axis (dim=-2) instead of the key axis
]
PADDING_ONLY = {"pad_mask_query_axis"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with the ALiBi + mask folded into a float mask
    "split_qkv",  # loader splits Wqkv into separate q/k/v matrices (clip applied to each projection)
    "alibi_relative",  # ALiBi as slope * (key - query) per row instead of slope * (key - last)
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().float().clone()


def _alibi_slopes(n_heads, head_dim, bias_max):
    bug = _bug()
    n2 = 2 ** math.ceil(math.log2(n_heads))
    denom = head_dim if bug == "alibi_slopes_head_dim" else n2
    expo = torch.arange(1, n2 + 1, dtype=torch.float32) * (bias_max / denom)
    slopes = torch.pow(2.0, -expo)
    if n2 != n_heads or bug == "alibi_reorder_always":
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


def _alibi(n_heads, head_dim, bias_max, L):
    bug = _bug()
    slopes = _alibi_slopes(n_heads, head_dim, bias_max)
    if bug == "alibi_int_slopes":
        dist = torch.arange(1 - L, 1, dtype=torch.int32)
        return (dist[None, None, :] * slopes.to(dist.dtype)[:, None, None]).float()  # (H, 1, L)
    if bug != "alibi_relative":
        dist = torch.arange(1 - L, 1, dtype=torch.float32)
        return slopes[:, None, None] * dist[None, None, :]
    pos = torch.arange(L, dtype=torch.float32)
    return slopes[:, None, None] * (pos[None, :] - pos[:, None])[None]  # (H, L, L)


def _ln(x, w):
    if _bug() == "low_precision_ln_bf16":
        return F.layer_norm(x.bfloat16(), (x.shape[-1],), w.bfloat16(), None, 1e-5).float()
    return F.layer_norm(x, (x.shape[-1],), w, None, 1e-5)


class MptPort(nn.Module):
    def __init__(self, params, cfg):
        super().__init__()
        self.p = params
        self.cfg = cfg

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        p, c = self.p, self.cfg
        B, L = input_ids.shape
        H, D = c["heads"], c["d"] // c["heads"]
        clip = c["clip"]
        if bug == "clip_int_value":
            clip = int(clip)
        x = p["emb"][input_ids]
        _rec("transformer.wte", x)

        causal = torch.ones(L, L, dtype=torch.bool).tril()
        allowed = causal[None, None]
        if attention_mask is not None:
            am = attention_mask.bool()
            if bug == "pad_mask_query_axis":
                allowed = allowed & am[:, None, :, None]
            else:
                allowed = allowed & am[:, None, None, :]
        alibi = _alibi(H, D, c["bias_max"], L)  # (H, 1|L, L)

        for i in range(c["layers"]):
            lp = p[f"L{i}"]
            pre = f"transformer.blocks.{i}"
            h = _ln(x, lp["ln1"])
            _rec(pre + ".norm_1", h)
            inp = h.clamp(-clip, clip) if bug == "clip_on_input" else h
            if bug == "split_qkv":
                q, k, v = (inp @ lp[n].T for n in ("wq", "wk", "wv"))
                _rec(pre + ".attn.Wqkv", torch.cat([q, k, v], -1))
                q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
            else:
                qkv = inp @ lp["qkv"].T
                _rec(pre + ".attn.Wqkv", qkv)
                if bug not in ("clip_after_out_proj", "clip_on_input"):
                    qkv = qkv.clamp(-clip, clip)
                q, k, v = qkv.split(c["d"], dim=-1)
            q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in (q, k, v))
            scale = 1.0 / math.sqrt(D)
            if bug == "sdpa":
                fmask = alibi.expand(B, H, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, scale=scale)
            else:
                if bug == "scores_bf16":
                    s = (q.bfloat16() @ k.bfloat16().transpose(-1, -2)).float() * scale
                else:
                    s = q @ k.transpose(-1, -2) * scale
                s = s + alibi
                s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
                probs = torch.softmax(s, dim=-2 if bug == "softmax_over_queries" else -1)
                ctx = probs @ v
            ctx = ctx.transpose(1, 2).reshape(B, L, H * D)
            a = ctx @ lp["o"].T
            if bug == "clip_after_out_proj":
                a = a.clamp(-clip, clip)
            _rec(pre + ".attn.out_proj", a)
            _rec(pre + ".attn", a)
            resid = h if bug == "residual_after_norm" else x
            x = resid + a
            h = _ln(x, lp["ln2"])
            _rec(pre + ".norm_2", h)
            u = h @ lp["up"].T
            _rec(pre + ".ffn.up_proj", u)
            u = F.gelu(u)
            _rec(pre + ".ffn.act", u)
            dn = u @ lp["down"].T
            _rec(pre + ".ffn.down_proj", dn)
            x = x + dn
            _rec(pre + ".ffn", x)
            _rec(pre, x)
        x = _ln(x, p["lnf"])
        _rec("transformer.norm_f", x)
        logits = x @ p["head"].T
        if bug == "logit_scale_inv_sqrt_d":
            logits = logits * (1.0 / math.sqrt(c["d"]))
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().float().clone() for k, v in state_dict.items()}
    ac = config.attn_config
    clip = ac.clip_qkv if hasattr(ac, "clip_qkv") else ac["clip_qkv"]
    bias_max = ac.alibi_bias_max if hasattr(ac, "alibi_bias_max") else ac.get("alibi_bias_max", 8)
    cfg = dict(
        d=config.d_model, heads=config.n_heads, layers=config.n_layers, clip=float(clip), bias_max=float(bias_max)
    )
    pref = "transformer."
    params = {"emb": sd[pref + "wte.weight"], "lnf": sd[pref + "norm_f.weight"]}
    params["head"] = sd.get("lm_head.weight", params["emb"])
    n = cfg["layers"]
    for i in range(n):
        b = f"{pref}blocks.{i}."
        j = n - 1 if bug == "loader_ffn_last_layer" else i
        lp = {
            "ln1": sd[b + "norm_1.weight"],
            "qkv": sd[b + "attn.Wqkv.weight"],
            "o": sd[b + "attn.out_proj.weight"],
            "ln2": sd[b + "norm_2.weight"],
            "up": sd[f"{pref}blocks.{j}.ffn.up_proj.weight"],
            "down": sd[f"{pref}blocks.{j}.ffn.down_proj.weight"],
        }
        if bug == "split_qkv":
            lp["wq"], lp["wk"], lp["wv"] = lp["qkv"].split(cfg["d"], dim=0)
        params[f"L{i}"] = lp
    return MptPort(params, cfg).eval()
