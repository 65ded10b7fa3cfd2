"""Hand-written plain-PyTorch port of Hugging Face `GPTBigCodeForCausalLM` (StarCoder 1, heldout10 set).

Covers: token + learned absolute position embeddings, pre-LN blocks with biased LayerNorms,
multi-query attention (one shared K/V head) from a fused c_attn laid out [q (all heads); k; v],
gelu_pytorch_tanh MLP with biases, final LayerNorm and a head tied to the token embedding.

Conventions: `build` re-packs the HF state dict into my own names (tok, pos, blk[i] = n1w/n1b,
wq/bq, wk/bk, wv/bv (split at load time), wo/bo, n2w/n2b, w1/b1, w2/b2; fw/fb). `forward(input_ids,
attention_mask=None, position_ids=None)` returns float32 logits (batch, seq, vocab); attention_mask
is (batch, seq), 0 for pads (left padding); position_ids are used as given, otherwise derived from
the mask as cumsum-1 (pads set to 1). `BUG` selects one porting mistake (read at build and forward
time); when `REC` is a dict the intermediates are stored under the Transformers module names.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "kv_split_vk",  # MQA tail of c_attn read as [v; k] instead of [k; v]
    "mqa_repeat_interleave_features",  # shared K/V broadcast to heads with repeat_interleave on the feature axis then view -> scrambled per-head keys (cf. vllm-project/vllm#676, GPT-BigCode gibberish from a wrong KV-head count under multi_query)
    "mqa_flat_query_view",  # StarCoder bmm trick: q flattened (L*H) rows but scores viewed back as (H, L) instead of (L, H)
    "mqa_value_from_key_slice",  # copy-paste: value taken from the same c_attn slice as the key
    "wpe_from_end",  # learned position table sliced as wpe[-seq:] (ALiBi-table habit) instead of indexed by position
    "gelu_tanh_x_squared",  # hand-written tanh GELU with x**2 instead of x**3 in the cubic term
    "pad_probs_zeroed_after_softmax",  # padding applied by zeroing probabilities after softmax, no renormalisation
    "right_pad_mask_assumed",  # padding mask rebuilt from lengths assuming right padding (keys >= len masked) (cf. akanyaani/gpt-2-tensorflow2.0#35, padding mask only correct for right padding)
    "loader_layers_reversed",  # loader enumerates h.* in reverse (sorted by string descending), blocks run last-to-first
    "embeddings_fp16",  # wte/wpe stored as float16 by the converter (GGUF-style f16 token_embd) and upcast at run time
    "causal_diag_off_by_one",  # causal mask built with k < q (triu diagonal=0): tokens cannot attend to themselves
    "mask_fill_zero",  # cached mask_value initialised with zeros -> masked scores become 0 instead of -inf - modelled on the cached mask_value of older HF GPTBigCode code, no report
    "softmax_in_fp16",  # attention_softmax_in_fp32 ignored: scores and softmax run in float16
]
PADDING_ONLY = {"pad_probs_zeroed_after_softmax", "right_pad_mask_assumed"}
CLEAN = [
    "sdpa_expand_kv",  # SDPA with the single K/V head expanded to all heads
    "mqa_flat_bmm",  # StarCoder's (B, L*H, D) x (B, D, L) bmm trick done correctly
    "fused_c_attn",  # keep c_attn fused and split the projection output at run time
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().float().clone()


def _gelu_tanh(x):
    cube = x * x if _bug() == "gelu_tanh_x_squared" else x * x * x
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * cube)))


def _ln(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


class BigCodePort(nn.Module):
    def __init__(self, params, cfg):
        super().__init__()
        self.p = params
        self.cfg = cfg

    def _attention(self, q, k, v, allowed, mask):
        """q (B,L,H,D); k,v (B,L,D); allowed (B,1,L,L) bool. Returns (B,L,H*D)."""
        bug = _bug()
        B, L, H, D = q.shape
        scale = D**-0.5
        neg = torch.finfo(torch.float32).min
        if bug == "sdpa_expand_kv":
            ke = k[:, None].expand(B, H, L, D)
            ve = v[:, None].expand(B, H, L, D)
            ctx = F.scaled_dot_product_attention(q.transpose(1, 2), ke, ve, attn_mask=allowed, scale=scale)
            return ctx.transpose(1, 2).reshape(B, L, H * D)
        if bug in ("mqa_flat_bmm", "mqa_flat_query_view"):
            qf = q.reshape(B, L * H, D)  # rows ordered (l, h)
            s = torch.bmm(qf, k.transpose(1, 2)) * scale  # (B, L*H, L)
            if bug == "mqa_flat_bmm":
                s = s.view(B, L, H, L).transpose(1, 2)  # (B, H, L, L)
            else:
                s = s.view(B, H, L, L)
            s = s.masked_fill(~allowed, neg)
            pr = torch.softmax(s, -1)
            ctx = pr @ v[:, None]  # (B, H, L, D)
            return ctx.transpose(1, 2).reshape(B, L, H * D)
        if bug == "mqa_repeat_interleave_features":
            kh = k.repeat_interleave(H, dim=-1).view(B, L, H, D).transpose(1, 2)
            vh = v.repeat_interleave(H, dim=-1).view(B, L, H, D).transpose(1, 2)
        else:
            kh, vh = k[:, None], v[:, None]  # (B, 1, L, D) broadcast over heads
        qh = q.transpose(1, 2)
        if bug == "softmax_in_fp16":
            s = (qh.half() @ kh.half().transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, torch.finfo(torch.float16).min)
            pr = torch.softmax(s, -1).float()
        else:
            s = (qh @ kh.transpose(-1, -2)) * scale
            if bug == "pad_probs_zeroed_after_softmax":
                causal = torch.ones(L, L, dtype=torch.bool).tril()
                pr = torch.softmax(s.masked_fill(~causal, neg), -1)
                if mask is not None:
                    pr = pr * mask[:, None, None, :].to(pr.dtype)
            else:
                fill = 0.0 if bug == "mask_fill_zero" else neg
                pr = torch.softmax(s.masked_fill(~allowed, fill), -1)
        ctx = pr @ vh
        return ctx.transpose(1, 2).reshape(B, L, H * D)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = _bug()
        p, c = self.p, self.cfg
        B, L = input_ids.shape
        H, E = c["heads"], c["d"]
        D = E // H
        eps = c["eps"]
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            else:
                position_ids = torch.arange(L)[None].expand(B, L)
        tok = p["tok"][input_ids]
        _rec("transformer.wte", tok)
        if bug == "wpe_from_end":
            pos = p["pos"][-L:][None].expand(B, L, E)
        else:
            pos = p["pos"][position_ids]
        _rec("transformer.wpe", pos)
        x = tok + pos
        _rec("transformer.drop", x)

        if bug == "causal_diag_off_by_one":
            causal = torch.ones(L, L, dtype=torch.bool).tril(-1)
        else:
            causal = torch.ones(L, L, dtype=torch.bool).tril()
        allowed = causal[None, None].expand(B, 1, L, L)
        if attention_mask is not None:
            if bug == "right_pad_mask_assumed":
                lens = attention_mask.sum(-1)
                keyok = torch.arange(L)[None] < lens[:, None]
            else:
                keyok = attention_mask.bool()
            allowed = allowed & keyok[:, None, None, :]

        for i, bp in enumerate(p["blocks"]):
            pre = f"transformer.h.{i}"
            h = _ln(x, bp["n1w"], bp["n1b"], eps)
            _rec(pre + ".ln_1", h)
            if bug == "fused_c_attn":
                qkv = h @ bp["wqkv"].T + bp["bqkv"]
                q, k, v = qkv.split([E, D, D], dim=-1)
            else:
                q = h @ bp["wq"].T + bp["bq"]
                k = h @ bp["wk"].T + bp["bk"]
                v = h @ bp["wv"].T + bp["bv"]
            _rec(pre + ".attn.c_attn", torch.cat([q, k, v], -1))
            if bug == "kv_split_vk":
                k, v = v, k
            if bug == "mqa_value_from_key_slice":
                v = k
            ctx = self._attention(q.view(B, L, H, D), k, v, allowed, attention_mask)
            a = ctx @ bp["wo"].T + bp["bo"]
            _rec(pre + ".attn.c_proj", a)
            _rec(pre + ".attn", a)
            x = x + a
            h = _ln(x, bp["n2w"], bp["n2b"], eps)
            _rec(pre + ".ln_2", h)
            u = h @ bp["w1"].T + bp["b1"]
            _rec(pre + ".mlp.c_fc", u)
            u = _gelu_tanh(u)
            _rec(pre + ".mlp.act", u)
            m = u @ bp["w2"].T + bp["b2"]
            _rec(pre + ".mlp.c_proj", m)
            _rec(pre + ".mlp", m)
            x = x + m
            _rec(pre, x)
        x = _ln(x, p["fw"], p["fb"], eps)
        _rec("transformer.ln_f", x)
        logits = x @ p["tok"].T
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    bug = _bug()
    sd = {k: v.detach().float().clone() for k, v in state_dict.items()}
    E, H = config.n_embd, config.n_head
    D = E // H
    cfg = dict(d=E, heads=H, eps=config.layer_norm_epsilon)
    t = "transformer."
    tok, pos = sd[t + "wte.weight"], sd[t + "wpe.weight"]
    if bug == "embeddings_fp16":
        tok, pos = tok.half().float(), pos.half().float()
    params = {"tok": tok, "pos": pos, "fw": sd[t + "ln_f.weight"], "fb": sd[t + "ln_f.bias"]}
    idx = sorted({int(k.split(".")[2]) for k in sd if k.startswith(t + "h.")})
    if bug == "loader_layers_reversed":
        idx = idx[::-1]
    blocks = []
    for i in idx:
        b = f"{t}h.{i}."
        W, bias = sd[b + "attn.c_attn.weight"], sd[b + "attn.c_attn.bias"]
        wq, wk, wv = W.split([E, D, D], dim=0)
        bq, bk, bv = bias.split([E, D, D], dim=0)
        blocks.append(
            dict(
                n1w=sd[b + "ln_1.weight"],
                n1b=sd[b + "ln_1.bias"],
                wqkv=W,
                bqkv=bias,
                wq=wq,
                bq=bq,
                wk=wk,
                bk=bk,
                wv=wv,
                bv=bv,
                wo=sd[b + "attn.c_proj.weight"],
                bo=sd[b + "attn.c_proj.bias"],
                n2w=sd[b + "ln_2.weight"],
                n2b=sd[b + "ln_2.bias"],
                w1=sd[b + "mlp.c_fc.weight"],
                b1=sd[b + "mlp.c_fc.bias"],
                w2=sd[b + "mlp.c_proj.weight"],
                b2=sd[b + "mlp.c_proj.bias"],
            )
        )
    params["blocks"] = blocks
    return BigCodePort(params, cfg).eval()
