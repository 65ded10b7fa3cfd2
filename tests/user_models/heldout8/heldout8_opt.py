"""OPT causal LM, ported by hand to plain PyTorch (reference: Transformers' OPTForCausalLM).

What it covers: the pre-LayerNorm OPT decoder (do_layer_norm_before=True, word_embed_proj_dim ==
hidden_size, so no project_in/project_out), learned absolute position embeddings with OPT's
offset of 2, multi-head attention with biases whose query is scaled by head_dim**-0.5 right
after q_proj (scores are then *not* scaled again), a ReLU fc1/fc2 MLP, the decoder's
final_layer_norm and a head tied to the token embedding (no lm_head parameter of its own).

Conventions
- build(state_dict, config) takes a Transformers OPTForCausalLM state dict (in-memory names,
  "model.decoder.layers.0.self_attn.q_proj.weight", ...) and maps it onto this file's own
  module tree: OptLM.tok / .pos / .blocks[i] (OptBlock: .norm1, .attn (CausalSelfAttention:
  .wq .wk .wv .wo or .wqkv), .norm2, .ffn (ReluFFN: .inner .outer)) / .norm_out. The state
  dict's lm_head.weight is the tied embedding and is skipped, hence load_state_dict(strict=False).
- forward(input_ids, attention_mask=None, position_ids=None) -> logits (batch, seq, vocab).
  Positions: when position_ids is None they are derived from attention_mask exactly as OPT
  does it, cumsum(mask) * mask - 1 (pads become -1, i.e. embedding row 1 after the offset);
  given position_ids are used as they are (0-based, the offset of 2 is added here).
  attention_mask is (batch, seq) with 0 for pads; left padding is supported.
- The attention mask is additive: 0 where a query may read a key, finfo(float32).min elsewhere.
- Everything runs in float32 (softmax included).

Variants (module global BUG, read at build and call time): "" is the plain port, CLEAN lists
other correct conventions, BUGS lists single mistakes; PADDING_ONLY are the bugs that only
change anything when a row is left-padded. REC, when a dict, receives intermediate tensors
under the matching Transformers module names (for the verifier only).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "pos_no_offset",  # learned positions looked up at cumsum-1 with no +2 offset (Llama-style positions)
    "pos_offset_twice",  # fairseq make_positions (already padding_idx+1 based) plus OPT's +2 again
    "pos_arange",  # positions from arange(seq), ignoring the left padding in attention_mask
    "sdpa_default_scale",  # SDPA called without scale=1.0 although q was pre-scaled: scaled twice
    "scale_fold_misses_bias",  # head_dim**-0.5 folded into q_proj weight at load, bias left unscaled
    "gelu_mlp",  # fc1 activation GELU (GPT-2 habit) instead of config.activation_function relu
    "ln_before_reversed",  # do_layer_norm_before read the wrong way round: post-LN blocks, no final LN
    "final_ln_suffix_clash",  # loader matches "final_layer_norm" by suffix: layer MLP norms never loaded
    "residual_dropout_eval",  # F.dropout(p=config.dropout) without training=..., so active in eval
    "fairseq_embed_scale",  # token embeddings multiplied by sqrt(hidden) as in fairseq's default decoder
    "out_proj_bias_dropped",  # out_proj built with bias=False; strict=False hides the unused bias
    "proj_order_kvq",  # fused qkv concatenated in state-dict order, which for OPT is k, v, q
    "final_ln_every_layer",  # decoder final_layer_norm applied after every layer instead of once
    "softmax_half",  # attention softmax computed in float16 to save memory
    "mask_neg_inf",  # mask filled with -inf: fully masked pad rows give NaN that leaks through V
]
PADDING_ONLY = {"pos_arange", "mask_neg_inf"}
CLEAN = [
    "fused_qkv",  # q, k, v projections fused into one Linear and split after
    "sdpa",  # torch SDPA (math kernel) with scale=1.0 since the query is already scaled, same additive mask
    "scale_folded",  # head_dim**-0.5 folded into q_proj weight and bias at load time
]

POS_OFFSET = 2


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_heads, prefix, fused):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.scale = self.head_dim**-0.5
        self.prefix = prefix
        if fused:
            self.wqkv = nn.Linear(dim, 3 * dim)
        else:
            self.wq = nn.Linear(dim, dim)
            self.wk = nn.Linear(dim, dim)
            self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim, bias=(BUG != "out_proj_bias_dropped"))

    def _split(self, t):
        b, s, _ = t.shape
        return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, mask):
        b, s, d = x.shape
        if hasattr(self, "wqkv"):
            q, k, v = self.wqkv(x).split(d, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)

        if BUG in ("scale_folded", "scale_fold_misses_bias"):
            # the scale already sits in wq: record what q_proj alone would give
            _rec(self.prefix + ".q_proj", q / self.scale)
        else:
            _rec(self.prefix + ".q_proj", q)
            q = q * self.scale
        _rec(self.prefix + ".k_proj", k)
        _rec(self.prefix + ".v_proj", v)

        q, k, v = self._split(q), self._split(k), self._split(v)
        if BUG == "sdpa":
            # math kernel: same reductions as the eager path on every CPU
            with sdpa_kernel(SDPBackend.MATH):
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        elif BUG == "sdpa_default_scale":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = q @ k.transpose(-1, -2) + mask
            if BUG == "softmax_half":
                probs = torch.softmax(scores.half(), dim=-1).float()
            else:
                probs = torch.softmax(scores, dim=-1)
            ctx = probs @ v
        ctx = ctx.transpose(1, 2).reshape(b, s, d)
        out = self.wo(ctx)
        _rec(self.prefix + ".out_proj", out)
        _rec(self.prefix, out)
        return out


class ReluFFN(nn.Module):
    def __init__(self, dim, hidden, prefix):
        super().__init__()
        self.inner = nn.Linear(dim, hidden)
        self.outer = nn.Linear(hidden, dim)
        self.prefix = prefix

    def forward(self, x):
        h = self.inner(x)
        _rec(self.prefix + ".fc1", h)
        h = F.gelu(h) if BUG == "gelu_mlp" else F.relu(h)
        _rec(self.prefix + ".activation_fn", h)
        h = self.outer(h)
        _rec(self.prefix + ".fc2", h)
        return h


class OptBlock(nn.Module):
    def __init__(self, cfg, i, fused):
        super().__init__()
        d = cfg.hidden_size
        self.prefix = f"model.decoder.layers.{i}"
        self.norm1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, cfg.num_attention_heads, self.prefix + ".self_attn", fused)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = ReluFFN(d, cfg.ffn_dim, self.prefix)
        self.pre_norm = cfg.do_layer_norm_before
        if BUG == "ln_before_reversed":
            self.pre_norm = not cfg.do_layer_norm_before
        self.p_drop = cfg.dropout

    def forward(self, x, mask):
        p = self.prefix
        h = x
        if self.pre_norm:
            h = self.norm1(h)
            _rec(p + ".self_attn_layer_norm", h)
        a = self.attn(h, mask)
        if BUG == "residual_dropout_eval":
            a = F.dropout(a, p=self.p_drop)
        x = x + a
        if not self.pre_norm:
            x = self.norm1(x)
            _rec(p + ".self_attn_layer_norm", x)

        h = x
        if self.pre_norm:
            h = self.norm2(h)
            _rec(p + ".final_layer_norm", h)
        x = x + self.ffn(h)
        if not self.pre_norm:
            x = self.norm2(x)
            _rec(p + ".final_layer_norm", x)
        _rec(p, x)
        return x


class OptLM(nn.Module):
    def __init__(self, cfg, fused=False):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, d)
        self.pos = nn.Embedding(cfg.max_position_embeddings + POS_OFFSET, d)
        self.blocks = nn.ModuleList(OptBlock(cfg, i, fused) for i in range(cfg.num_hidden_layers))
        self.norm_out = nn.LayerNorm(d)
        self.final_norm = cfg.do_layer_norm_before
        if BUG == "ln_before_reversed":
            self.final_norm = not cfg.do_layer_norm_before

    def _positions(self, attention_mask, position_ids, b, s, device):
        if position_ids is not None:
            return position_ids.long() + POS_OFFSET
        if attention_mask is None:
            attention_mask = torch.ones(b, s, dtype=torch.long, device=device)
        m = attention_mask.long()
        if BUG == "pos_no_offset":
            return (m.cumsum(1) - 1).clamp(min=0)
        if BUG == "pos_offset_twice":
            padding_idx = 1
            return m.cumsum(1) * m + padding_idx + POS_OFFSET
        if BUG == "pos_arange":
            return torch.arange(s, device=device).expand(b, s) + POS_OFFSET
        return m.cumsum(1) * m - 1 + POS_OFFSET

    def _mask(self, attention_mask, b, s, device):
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        allowed = causal[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        fill = float("-inf") if BUG == "mask_neg_inf" else torch.finfo(torch.float32).min
        zero = torch.zeros((), device=device)
        return torch.where(allowed, zero, torch.tensor(fill, device=device))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, s = input_ids.shape
        dev = input_ids.device
        e = self.tok(input_ids)
        if BUG == "fairseq_embed_scale":
            e = e * math.sqrt(self.cfg.hidden_size)
        _rec("model.decoder.embed_tokens", e)
        pe = self.pos(self._positions(attention_mask, position_ids, b, s, dev))
        _rec("model.decoder.embed_positions", pe)
        x = e + pe
        mask = self._mask(attention_mask, b, s, dev)
        for blk in self.blocks:
            x = blk(x, mask)
            if BUG == "final_ln_every_layer":
                x = self.norm_out(x)
        if self.final_norm and BUG != "final_ln_every_layer":
            x = self.norm_out(x)
            _rec("model.decoder.final_layer_norm", x)
        logits = x @ self.tok.weight.T
        _rec("lm_head", logits)
        return logits


_LAYER_NAMES = {
    "self_attn.q_proj": "attn.wq",
    "self_attn.k_proj": "attn.wk",
    "self_attn.v_proj": "attn.wv",
    "self_attn.out_proj": "attn.wo",
    "self_attn_layer_norm": "norm1",
    "fc1": "ffn.inner",
    "fc2": "ffn.outer",
    "final_layer_norm": "norm2",
}
_TOP_NAMES = {
    "embed_tokens": "tok",
    "embed_positions": "pos",
    "final_layer_norm": "norm_out",
}


def _own_name(hf_name):
    """'model.decoder.layers.3.fc1.bias' -> 'blocks.3.ffn.inner.bias'."""
    if hf_name == "lm_head.weight":
        return None  # tied to the token embedding
    parts = hf_name.removeprefix("model.decoder.").split(".")
    module, leaf = ".".join(parts[:-1]), parts[-1]
    if BUG == "final_ln_suffix_clash" and module.endswith("final_layer_norm"):
        return "norm_out." + leaf
    if parts[0] == "layers":
        return f"blocks.{parts[1]}.{_LAYER_NAMES['.'.join(parts[2:-1])]}.{leaf}"
    return f"{_TOP_NAMES[module]}.{leaf}"


def build(state_dict, config):
    fused = BUG in ("fused_qkv", "proj_order_kvq")
    model = OptLM(config, fused=fused)
    own = {}
    for name, t in state_dict.items():
        target = _own_name(name)
        if target is not None:
            own[target] = t
    if fused:
        for i in range(config.num_hidden_layers):
            pre = f"model.decoder.layers.{i}.self_attn."
            for leaf in ("weight", "bias"):
                if BUG == "proj_order_kvq":
                    parts = [
                        t
                        for n, t in state_dict.items()
                        if n.startswith(pre) and n.endswith("_proj." + leaf) and "out_proj" not in n
                    ]
                else:
                    parts = [state_dict[pre + p + "_proj." + leaf] for p in ("q", "k", "v")]
                own[f"blocks.{i}.attn.wqkv.{leaf}"] = torch.cat(parts, dim=0)
                for p in ("wq", "wk", "wv"):
                    own.pop(f"blocks.{i}.attn.{p}.{leaf}")
    if BUG in ("scale_folded", "scale_fold_misses_bias"):
        scale = (config.hidden_size // config.num_attention_heads) ** -0.5
        for i in range(config.num_hidden_layers):
            own[f"blocks.{i}.attn.wq.weight"] = own[f"blocks.{i}.attn.wq.weight"] * scale
            if BUG == "scale_folded":
                own[f"blocks.{i}.attn.wq.bias"] = own[f"blocks.{i}.attn.wq.bias"] * scale
    model.load_state_dict(own, strict=False)  # lm_head is tied, not a parameter here
    return model.eval()
