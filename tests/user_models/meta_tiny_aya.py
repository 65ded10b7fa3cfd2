# Tiny Aya (Cohere 2) written in the style of Meta's llama reference model.
#
# Differences from llama, all taken from Cohere 2:
#   * parallel block: one norm feeds both attention and the MLP
#   * the norm is a bias-free LayerNorm (subtracts the mean), computed in float32
#   * RoPE only on sliding-window layers; full-attention layers have no positions
#   * logits are multiplied by logit_scale; embeddings are tied

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import parity


@dataclass
class ModelArgs:
    dim: int = 2048
    n_layers: int = 36
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 128
    hidden_dim: int = 11008
    vocab_size: int = 262144
    norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    sliding_window: int = 4096
    layer_types: list[str] = field(default_factory=list)
    logit_scale: float = 1.0
    tie_embeddings: bool = True


class LayerNorm(nn.Module):
    """LayerNorm with a weight and no bias, always computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).type_as(x)


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, device=None):
    # one complex rotation per (position, pair of dims)
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    t = torch.arange(end, device=device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64, (end, dim // 2)


def apply_rotary_emb(xq, xk, freqs_cis):
    # dims (2i, 2i+1) form one complex number -> interleaved RoPE
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]  # broadcast over batch and heads
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        self.use_rope = args.layer_types[layer_id] == "sliding_attention"

        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)

        if self.use_rope:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xq = parity.tap(xq, "q_rot", layout="bshd")  # (bs, seq, heads, hd): parity transposes
        xk = parity.tap(xk, "k_rot", layout="bshd")

        # GQA: kv head k serves query heads k*n_rep .. k*n_rep + n_rep - 1
        xk = torch.repeat_interleave(xk, self.n_rep, dim=2)
        xv = torch.repeat_interleave(xv, self.n_rep, dim=2)

        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))  # (bs, heads, seq, hd)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + mask
        scores = parity.tap(F.softmax(scores.float(), dim=-1).type_as(xq), "probs")
        out = torch.matmul(scores, xv)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = args.layer_types[layer_id]
        self.attention_norm = LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x, freqs_cis, mask):
        # parallel block: attention and MLP read the same normed input
        h = self.attention_norm(x)
        return x + self.attention(h, freqs_cis, mask) + self.feed_forward(h)


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, params) for i in range(params.n_layers))
        self.norm = LayerNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        if params.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _masks(self, attention_mask, seqlen, bsz, dtype, device):
        # boolean "may attend" masks, turned into additive masks with the dtype's min
        i = torch.arange(seqlen, device=device)[:, None]
        j = torch.arange(seqlen, device=device)[None, :]
        causal = j <= i
        sliding = causal & (j > i - self.params.sliding_window)
        if attention_mask is None:
            keys = torch.ones(bsz, seqlen, dtype=torch.bool, device=device)
        else:
            keys = attention_mask.to(device=device).bool()
        keys = keys[:, None, None, :]  # (bs, 1, 1, seq)
        neg = torch.finfo(dtype).min
        to_add = lambda ok: torch.zeros((), dtype=dtype, device=device).masked_fill(~ok, neg)
        return {
            "full_attention": to_add(causal & keys),
            "sliding_attention": to_add(sliding & keys),
        }

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None):
        bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = precompute_freqs_cis(self.params.head_dim, seqlen, self.params.rope_theta, device=h.device)
        masks = self._masks(attention_mask, seqlen, bsz, h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, freqs_cis, masks[layer.layer_type])
        h = self.norm(h)
        return self.output(h) * self.params.logit_scale


# ---------------------------------------------------------------- loading

# Transformers name -> our name ("{i}" is the layer index)
RENAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
}


def _rename(key: str) -> str | None:
    parts = key.split(".")
    if key.startswith("model.layers.") and len(parts) > 3:
        idx = parts[2]
        pattern = ".".join(parts[:2] + ["{i}"] + parts[3:])
        new = RENAMES.get(pattern)
        return new.format(i=idx) if new else None
    return RENAMES.get(key)


def build(state_dict, hf_config) -> nn.Module:
    c = hf_config
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    args = ModelArgs(
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        hidden_dim=c.intermediate_size,
        vocab_size=c.vocab_size,
        norm_eps=c.layer_norm_eps,
        rope_theta=float(theta),
        sliding_window=c.sliding_window,
        layer_types=list(c.layer_types),
        logit_scale=c.logit_scale,
        tie_embeddings=getattr(c, "tie_word_embeddings", True),
    )

    converted = {}
    for k, v in state_dict.items():
        new = _rename(k)
        if new is None:
            continue  # e.g. rotary inv_freq buffers
        if new == "output.weight" and args.tie_embeddings:
            continue  # tied: the embedding provides it
        converted[new] = v

    emb = converted["tok_embeddings.weight"]
    # build on the meta device, then adopt the checkpoint tensors (dtype follows them)
    with torch.device("meta"):
        model = Transformer(args)
    missing, unexpected = model.load_state_dict(converted, strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # re-tie after assign
        missing = [k for k in missing if k != "output.weight"]
    if missing or unexpected:
        raise RuntimeError(f"missing keys {missing}, unexpected keys {unexpected}")
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"weights not loaded: {still_meta}")
    return model.to(device=emb.device, dtype=emb.dtype).eval()
