"""Gemma (Gemma 1) causal LM, ported by hand to plain PyTorch (reference: Transformers'
GemmaForCausalLM).

What it covers: token embeddings multiplied by sqrt(hidden_size) (the normalizer, a float32
scalar here, 8.0 for hidden 64), pre-norm decoder blocks with RMSNorm computed in float32 and
scaled by (1 + w), multi-query attention (num_key_value_heads = 1) with an explicit head_dim
(32, not hidden / heads = 16), half-split ("rotate_half") RoPE with config.rope_parameters
["rope_theta"], scores scaled by head_dim**-0.5, a GeGLU MLP gelu_tanh(gate) * up, the final
RMSNorm and an lm_head tied to the *unscaled* token embedding.

Conventions
- build(state_dict, config) takes a Transformers GemmaForCausalLM state dict (in-memory names)
  and maps it onto this file's own layout with a table (own name -> Transformers name):
  GemmaLM.embed, .blocks[i] (GemmaBlock, one flat module holding both the attention and the MLP
  weights: .attn_norm .wq .wk .wv .wo .mlp_norm .w_gate .w_up .w_down; attention is the method
  GemmaBlock.attend, the MLP GemmaBlock.feed_forward), .final_norm. lm_head.weight in the state
  dict is the tied embedding and is not loaded separately (load_state_dict(strict=False)).
- forward(input_ids, attention_mask=None, position_ids=None) -> logits (batch, seq, vocab).
  attention_mask is (batch, seq) with 0 for pads (left padding supported); position_ids are
  used as given (the verifier passes cumsum(mask) - 1 with pads set to 1); when None they are
  derived the same way from attention_mask, or are arange(seq) without a mask.
- Additive attention mask: 0 where allowed, finfo(float32).min elsewhere; softmax in float32.
- Everything runs in float32.

Variants (module global BUG): "" is the plain port, CLEAN lists other correct conventions, BUGS
single mistakes, PADDING_ONLY those that only show with a left-padded row. REC, when a dict,
receives intermediate tensors under the matching Transformers module names (verifier only).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "embed_scale_missing",  # sqrt(hidden_size) normalizer on the embeddings left out
    "embed_scale_on_head_input",  # normalizer applied to the hidden state before lm_head, not to the embeddings
    "tied_head_folded_scale",  # normalizer folded into the embedding at load and the head tied to that scaled copy
    "embed_scale_twice",  # normalizer folded into the embedding weights and also multiplied at run time
    "head_dim_from_hidden",  # head_dim taken as hidden_size // num_heads (16) instead of config.head_dim (32)
    "scale_from_hidden_over_heads",  # attention scale (hidden/heads)**-0.5 instead of head_dim**-0.5
    "geglu_swapped",  # GeGLU as gelu(up) * gate: gate_proj and up_proj roles exchanged
    "final_softcap_default",  # code shared with Gemma 2: final logit soft-capping 30 applied to Gemma 1
    "attn_softcap_default",  # code shared with Gemma 2: attention-score soft-capping 50 applied to Gemma 1
    "norm_plus_one_twice",  # loader adds 1 to norm weights (GGUF-converter habit) while the norm also uses 1 + w
    "v_from_k_loader",  # name table typo: v weight read from the k_proj tensor (both 32 x 64 under MQA)
    "rmsnorm_as_layernorm",  # RMSNorm written with the mean subtracted first (LayerNorm without bias)
    "post_attn_norm_gemma2_semantics",  # post_attention_layernorm applied to the attention output (Gemma 2 sandwich), MLP unnormed
    "rope_positions_row0",  # cos/sin built from position_ids[0] and broadcast to the batch (scalar-offset RoPE)
    "mask_from_positions",  # mask built as key_pos <= query_pos only; pads (position 1) become visible
    "linear_default_bias",  # projections built with nn.Linear's default bias=True; strict=False leaves random biases
]
PADDING_ONLY = {"rope_positions_row0", "mask_from_positions"}
CLEAN = [
    "complex_rope",  # RoPE as a complex multiplication over (i, i + head_dim/2) pairs
    "scale_folded",  # normalizer folded into the embedding weights at load; head keeps the unscaled copy
    "norm_functional",  # RMSNorm via torch.nn.functional.rms_norm with weight 1 + w in float32
]


def _rec(name, t):
    if REC is not None:
        REC[name] = t.detach().clone()


def rms_norm(x, w, eps):
    if BUG == "norm_functional":
        y = F.rms_norm(x.float(), (x.shape[-1],), weight=1.0 + w.float(), eps=eps)
        return y.to(x.dtype)
    xf = x.float()
    if BUG == "rmsnorm_as_layernorm":
        xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class GemmaBlock(nn.Module):
    """One decoder layer: RMSNorm -> MQA attention -> residual, RMSNorm -> GeGLU -> residual."""

    def __init__(self, cfg, i, head_dim):
        super().__init__()
        d = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = head_dim**-0.5
        if BUG == "scale_from_hidden_over_heads":
            self.scale = (d // self.n_heads) ** -0.5
        self.name = f"model.layers.{i}"
        bias = BUG == "linear_default_bias"
        hd = cfg.head_dim  # projection widths as stored in the checkpoint
        self.attn_norm = nn.Parameter(torch.zeros(d))
        self.wq = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.wk = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.wv = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.wo = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.mlp_norm = nn.Parameter(torch.zeros(d))
        self.w_gate = nn.Linear(d, cfg.intermediate_size, bias=bias)
        self.w_up = nn.Linear(d, cfg.intermediate_size, bias=bias)
        self.w_down = nn.Linear(cfg.intermediate_size, d, bias=bias)

    @staticmethod
    def _rope(t, rope):
        if BUG == "complex_rope":
            h = t.shape[-1] // 2
            z = torch.complex(t[..., :h].contiguous(), t[..., h:].contiguous()) * rope["cis"][:, None]
            return torch.cat((z.real, z.imag), dim=-1)
        return t * rope["cos"][:, None] + rotate_half(t) * rope["sin"][:, None]

    def attend(self, x, rope, mask):
        b, s, _ = x.shape
        n = self.name + ".self_attn"
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        _rec(n + ".q_proj", q)
        _rec(n + ".k_proj", k)
        _rec(n + ".v_proj", v)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, rope), self._rope(k, rope)
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if BUG == "attn_softcap_default":
            scores = 50.0 * torch.tanh(scores / 50.0)
        probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32)
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        out = self.wo(ctx)
        _rec(n + ".o_proj", out)
        _rec(n, out)
        return out

    def feed_forward(self, x):
        n = self.name + ".mlp"
        g, u = self.w_gate(x), self.w_up(x)
        _rec(n + ".gate_proj", g)
        _rec(n + ".up_proj", u)
        if BUG == "geglu_swapped":
            g, u = u, g
        a = F.gelu(g, approximate="tanh")
        _rec(n + ".act_fn", a)
        out = self.w_down(a * u)
        _rec(n + ".down_proj", out)
        _rec(n, out)
        return out

    def forward(self, x, rope, mask):
        h = rms_norm(x, self.attn_norm, self.eps)
        _rec(self.name + ".input_layernorm", h)
        a = self.attend(h, rope, mask)
        if BUG == "post_attn_norm_gemma2_semantics":
            a = rms_norm(a, self.mlp_norm, self.eps)
            _rec(self.name + ".post_attention_layernorm", a)
            x = x + a
            x = x + self.feed_forward(x)
        else:
            x = x + a
            h = rms_norm(x, self.mlp_norm, self.eps)
            _rec(self.name + ".post_attention_layernorm", h)
            x = x + self.feed_forward(h)
        _rec(self.name, x)
        return x


class GemmaLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        head_dim = cfg.head_dim
        if BUG == "head_dim_from_hidden":
            head_dim = d // cfg.num_attention_heads
        self.head_dim = head_dim
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.blocks = nn.ModuleList(GemmaBlock(cfg, i, head_dim) for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.Parameter(torch.zeros(d))
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        # the head reads the unscaled embedding: when the normalizer is folded into
        # embed.weight at load time, build() keeps the raw table here for the head
        self.register_buffer("head_weight", torch.zeros(cfg.vocab_size, d), persistent=False)
        self.normalizer = torch.tensor(math.sqrt(d), dtype=torch.float32)

    def _positions(self, attention_mask, position_ids, b, s, dev):
        if position_ids is not None:
            return position_ids
        if attention_mask is None:
            return torch.arange(s, device=dev)[None].expand(b, s)
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.masked_fill(attention_mask == 0, 1)

    def _mask(self, attention_mask, pos, b, s, dev):
        if BUG == "mask_from_positions":
            allowed = (pos[:, None, :] <= pos[:, :, None])[:, None]
        else:
            allowed = torch.ones(s, s, dtype=torch.bool, device=dev).tril()[None, None]
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, None, :]
        neg = torch.tensor(torch.finfo(torch.float32).min, device=dev)
        return torch.where(allowed, torch.zeros((), device=dev), neg)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, s = input_ids.shape
        dev = input_ids.device
        x = self.embed(input_ids)
        if BUG not in ("embed_scale_missing", "embed_scale_on_head_input", "scale_folded", "tied_head_folded_scale"):
            x = x * self.normalizer.to(x.dtype)
        _rec("model.embed_tokens", x)

        pos = self._positions(attention_mask, position_ids, b, s, dev)
        rope_pos = pos[:1] if BUG == "rope_positions_row0" else pos
        freqs = rope_pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = {"cos": emb.cos(), "sin": emb.sin()}
        if BUG == "complex_rope":
            rope["cis"] = torch.complex(freqs.cos(), freqs.sin())
        _rec("model.rotary_emb", rope["cos"])
        mask = self._mask(attention_mask, pos, b, s, dev)

        for blk in self.blocks:
            x = blk(x, rope, mask)
        x = rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)
        _rec("model.norm", x)
        if BUG == "embed_scale_on_head_input":
            x = x * self.normalizer
        if BUG == "scale_folded":
            logits = x @ self.head_weight.T
        else:
            logits = x @ self.embed.weight.T
        if BUG == "final_softcap_default":
            logits = 30.0 * torch.tanh(logits / 30.0)
        _rec("lm_head", logits)
        return logits


# own parameter name (inside blocks.{i}) -> Transformers name (inside model.layers.{i})
_LAYER_SOURCES = {
    "attn_norm": "input_layernorm.weight",
    "wq.weight": "self_attn.q_proj.weight",
    "wk.weight": "self_attn.k_proj.weight",
    "wv.weight": "self_attn.v_proj.weight",
    "wo.weight": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate.weight": "mlp.gate_proj.weight",
    "w_up.weight": "mlp.up_proj.weight",
    "w_down.weight": "mlp.down_proj.weight",
}


def build(state_dict, config):
    model = GemmaLM(config)
    sources = dict(_LAYER_SOURCES)
    if BUG == "v_from_k_loader":
        sources["wv.weight"] = "self_attn.k_proj.weight"
    own = {"embed.weight": state_dict["model.embed_tokens.weight"], "final_norm": state_dict["model.norm.weight"]}
    for i in range(config.num_hidden_layers):
        for mine, theirs in sources.items():
            own[f"blocks.{i}.{mine}"] = state_dict[f"model.layers.{i}.{theirs}"]
    if BUG == "norm_plus_one_twice":
        for k in list(own):
            if k.endswith("norm"):
                own[k] = own[k] + 1.0
    if BUG in ("scale_folded", "tied_head_folded_scale", "embed_scale_twice"):
        raw = own["embed.weight"]
        own["embed.weight"] = raw * math.sqrt(config.hidden_size)
        model.head_weight.copy_(raw)
    # lm_head.weight is tied to the embedding; Linear biases (if any) have no source
    model.load_state_dict(own, strict=False)
    return model.eval()
