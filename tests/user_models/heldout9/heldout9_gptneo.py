"""Hand-written plain-PyTorch port of GPT-Neo (transformers `GPTNeoForCausalLM`).

Covers: token + learned absolute position embeddings, pre-LN blocks with affine
LayerNorms, attention alternating global / local (layer kinds come from
`config.attention_layers`, local = causal band of `config.window_size` keys counted
on sequence *indices*), raw q.k scores (GPT-Neo uses no 1/sqrt(d) scaling), q/k/v
without bias, out projection with bias, gelu_new MLP, final LayerNorm and a head
tied to the token embedding.

Conventions of this port (deliberately not the Transformers layout):
  * every weight is stored input-major, ``W[in, out]``, and applied as ``x @ W``;
  * parameters live in flat ``nn.ParameterDict``s per layer with short names
    (``q``, ``k``, ``v``, ``o``, ``o_b``, ``n1_w`` ...);
  * the mask is one boolean "may attend" tensor (batch, 1, q, k) built once per
    layer kind, filled with the float32 minimum before softmax;
  * attention_mask (batch, seq) uses 0 for pads, left padding supported;
    position_ids are used as given, else derived as cumsum(mask)-1 (pads -> 1).

Bugs are switched on by the module global BUG (read at forward/build time).
When REC is a dict, intermediates are recorded under the Transformers module
names (e.g. ``transformer.h.0.attn.attention``) for the verifier.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "local_global_order",  # attention_types expanded as [local, global]: every layer gets the other kind (cf. TensorRT-Model-Connect#660 GPT-Neo local/global layer handling)
    "local_blocked",  # local layers as block-local attention (mesh-tf local_attention_1d style) instead of a sliding band (cf. transformers#11320 / PR#13491 local attention rewrite)
    "window_hardcoded_256",  # window hard-coded to the released checkpoints' 256 instead of config.window_size (cf. transformers#10834, "last k=256 tokens")
    "scaled_scores",  # q.k scaled by 1/sqrt(head_dim) out of habit; GPT-Neo has no scaling (cf. transformers PR#10985 review on the mesh-tf scaling)
    "scores_half",  # q.k computed in float16; HF upcasts because Neo's unscaled scores are large (cf. transformers#11076 GPT-Neo fp16 overflow)
    "mask_fill_zero",  # masked scores filled with 0 instead of a large negative value (masked_fill(mask, 0))
    "softmax_dim_queries",  # softmax taken over the query axis (dim=-2) instead of the key axis
    "split_heads_dim_order",  # q/k/v split as (head_dim, heads) instead of (heads, head_dim)
    "out_bias_per_head",  # per-head out projection (TransformerLens-style W_O split) adds out_proj bias once per head
    "positions_ignore_given",  # position_ids argument ignored, arange used: wrong wpe rows under left padding (cf. transformers#24694 GPT-Neo left-padded generation)
    "pad_mask_query_axis",  # padding mask broadcast on the query axis instead of the key axis
    "ln2_loaded_from_ln1",  # loader copy-paste: ln_2 weight/bias taken from ln_1
    "ln_f_not_loaded",  # final LayerNorm key missed (prefix mismatch, strict=False load): stays at ones/zeros
    "tied_head_rescale",  # T5-style d_model**-0.5 rescale applied before the tied head (T5ForConditionalGeneration habit)
]
PADDING_ONLY = {"positions_ignore_given", "pad_mask_query_axis"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with boolean mask and scale=1.0
    "fused_qkv",  # q/k/v weights concatenated into one [in, 3*out] matmul
    "head_einsum",  # per-head out projection with einsum, bias added once
]


def _rec(name, t):
    if isinstance(REC, dict):
        REC[name] = t.detach().clone()


def _layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _expand_kinds(attention_types):
    kinds = []
    for pattern, times in attention_types:
        kinds += list(pattern) * times
    return kinds


class NeoPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.d = cfg.hidden_size
        self.nh = cfg.num_heads
        self.hd = self.d // self.nh
        self.eps = cfg.layer_norm_epsilon
        self.window = cfg.window_size
        self.kinds = _expand_kinds(cfg.attention_types)
        self.emb = nn.ParameterDict()
        self.layers = nn.ModuleList()
        self.final = nn.ParameterDict()

    # ------------------------------------------------------------------ mask
    def _allowed(self, kind, keymask, S, dev):
        bug = BUG
        i = torch.arange(S, device=dev)[:, None]
        j = torch.arange(S, device=dev)[None, :]
        ok = j <= i
        if kind == "local":
            win = 256 if bug == "window_hardcoded_256" else self.window
            if bug == "local_blocked":
                ok = ok & (torch.div(i, win, rounding_mode="floor") == torch.div(j, win, rounding_mode="floor"))
            else:
                ok = ok & (i - j < win)
        ok = ok[None, None]  # (1,1,S,S)
        if bug == "pad_mask_query_axis":
            return ok & keymask[:, None, :, None]
        return ok & keymask[:, None, None, :]

    # ------------------------------------------------------------- attention
    def _attention(self, li, p, h, allowed):
        bug = BUG
        B, S, _ = h.shape
        pre = f"transformer.h.{li}.attn.attention"
        if bug == "fused_qkv":
            qkv = h @ torch.cat([p["q"], p["k"], p["v"]], dim=1)
            q, k, v = qkv.split(self.d, dim=-1)
        else:
            q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
        _rec(pre + ".q_proj", q)
        _rec(pre + ".k_proj", k)
        _rec(pre + ".v_proj", v)

        def heads(t):
            if bug == "split_heads_dim_order":
                return t.view(B, S, self.hd, self.nh).permute(0, 3, 1, 2)
            return t.view(B, S, self.nh, self.hd).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        neg = torch.finfo(torch.float32).min
        if bug == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0)
        else:
            if bug == "scores_half":
                s = (q.half() @ k.half().transpose(-1, -2)).float()
            else:
                s = q @ k.transpose(-1, -2)
            if bug == "scaled_scores":
                s = s / math.sqrt(self.hd)
            if bug == "mask_fill_zero":
                s = s.masked_fill(~allowed, 0.0)
            else:
                s = s.masked_fill(~allowed, neg)
            probs = torch.softmax(s, dim=-2 if bug == "softmax_dim_queries" else -1)
            ctx = probs @ v  # (B, nh, S, hd)

        if bug in ("head_einsum", "out_bias_per_head"):
            wo = p["o"].view(self.nh, self.hd, self.d)
            per_head = torch.einsum("bnsh,nhd->bnsd", ctx, wo)
            if bug == "out_bias_per_head":
                out = (per_head + p["o_b"]).sum(1)
            else:
                out = per_head.sum(1) + p["o_b"]
        else:
            merged = ctx.transpose(1, 2).reshape(B, S, self.d)
            out = merged @ p["o"] + p["o_b"]
        _rec(pre + ".out_proj", out)
        _rec(pre, out)
        _rec(f"transformer.h.{li}.attn", out)
        return out

    # --------------------------------------------------------------- forward
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bug = BUG
        B, S = input_ids.shape
        dev = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long, device=dev)
        keymask = attention_mask.bool()
        if position_ids is None or bug == "positions_ignore_given":
            if bug == "positions_ignore_given":
                position_ids = torch.arange(S, device=dev)[None].expand(B, S)
            else:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids = position_ids.masked_fill(~keymask, 1)

        tok = self.emb["tok"][input_ids]
        pos = self.emb["pos"][position_ids]
        _rec("transformer.wte", tok)
        _rec("transformer.wpe", pos)
        x = tok + pos

        kinds = self.kinds[::-1] if bug == "local_global_order" else self.kinds
        masks = {k: self._allowed(k, keymask, S, dev) for k in set(kinds)}
        for li, p in enumerate(self.layers):
            pre = f"transformer.h.{li}"
            h = _layer_norm(x, p["n1_w"], p["n1_b"], self.eps)
            _rec(pre + ".ln_1", h)
            x = x + self._attention(li, p, h, masks[kinds[li]])
            h = _layer_norm(x, p["n2_w"], p["n2_b"], self.eps)
            _rec(pre + ".ln_2", h)
            a = h @ p["fc"] + p["fc_b"]
            _rec(pre + ".mlp.c_fc", a)
            a = _gelu_new(a)
            _rec(pre + ".mlp.act", a)
            m = a @ p["proj"] + p["proj_b"]
            _rec(pre + ".mlp.c_proj", m)
            _rec(pre + ".mlp", m)
            x = x + m
            _rec(pre, x)

        x = _layer_norm(x, self.final["n_w"], self.final["n_b"], self.eps)
        _rec("transformer.ln_f", x)
        if bug == "tied_head_rescale":
            x = x * self.d**-0.5
        logits = x @ self.final["head"]
        _rec("lm_head", logits)
        return logits


def build(state_dict, config):
    bug = BUG
    sd = {k: v.detach().float().clone() for k, v in state_dict.items()}
    m = NeoPort(config)
    P = lambda t: nn.Parameter(t.contiguous(), requires_grad=False)
    m.emb["tok"] = P(sd["transformer.wte.weight"])
    m.emb["pos"] = P(sd["transformer.wpe.weight"])
    for i in range(config.num_layers):
        pre = f"transformer.h.{i}."
        a = pre + "attn.attention."
        n2 = "ln_1" if bug == "ln2_loaded_from_ln1" else "ln_2"
        p = nn.ParameterDict(
            {
                "n1_w": P(sd[pre + "ln_1.weight"]),
                "n1_b": P(sd[pre + "ln_1.bias"]),
                "q": P(sd[a + "q_proj.weight"].t()),
                "k": P(sd[a + "k_proj.weight"].t()),
                "v": P(sd[a + "v_proj.weight"].t()),
                "o": P(sd[a + "out_proj.weight"].t()),
                "o_b": P(sd[a + "out_proj.bias"]),
                "n2_w": P(sd[pre + n2 + ".weight"]),
                "n2_b": P(sd[pre + n2 + ".bias"]),
                "fc": P(sd[pre + "mlp.c_fc.weight"].t()),
                "fc_b": P(sd[pre + "mlp.c_fc.bias"]),
                "proj": P(sd[pre + "mlp.c_proj.weight"].t()),
                "proj_b": P(sd[pre + "mlp.c_proj.bias"]),
            }
        )
        m.layers.append(p)
    if bug == "ln_f_not_loaded":
        m.final["n_w"] = P(torch.ones(config.hidden_size))
        m.final["n_b"] = P(torch.zeros(config.hidden_size))
    else:
        m.final["n_w"] = P(sd["transformer.ln_f.weight"])
        m.final["n_b"] = P(sd["transformer.ln_f.bias"])
    # tied head: always the token embedding, transposed to [d, vocab]
    m.final["head"] = P(sd["transformer.wte.weight"].t())
    return m.eval()
