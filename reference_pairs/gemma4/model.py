"""Gemma 4 dense text model from scratch (E2B, E4B; Google DeepMind, "Gemma 4", 2026, and the book's
standalone notebook; Gemma 3n introduced per-layer inputs and KV sharing).

A Gemma 3 sandwich-norm decoder (embeddings times ``sqrt(emb_dim)`` rounded to the model dtype,
GeGLU, sliding and full layers with their own RoPE, final logit soft-cap, tied head) with:

* plain ``w`` RMSNorm weights (``Gemma4RMSNorm``), not Gemma 3's ``1 + w``;
* per-head Q/K RMSNorm and a weightless RMSNorm on the values; attention scale 1.0;
* per-layer head_dim: full layers use ``global_head_dim`` (512 where sliding layers use 256);
* "proportional" RoPE on full layers: ``theta^(-2i/head_dim)`` for the first
  ``partial_rotary_factor * head_dim / 2`` pairs ``(i, i + head_dim/2)``, zero frequency (no
  rotation) for the rest; default RoPE on sliding layers;
* per-layer inputs: a second embedding table (``vocab_size_per_layer_input`` rows of
  ``n_layers * hidden_size_per_layer_input``, times ``sqrt(hidden_size_per_layer_input)``) plus a
  projection of the embeddings (times ``emb_dim ** -0.5``, RMS-normalised per layer), summed and
  scaled by ``1/sqrt(2)``; layer ``i`` gets slice ``i``, and after its feed-forward network adds
  ``N(proj(gelu(gate(h)) * per_layer_input))`` to the residual stream;
* KV sharing: the last ``num_kv_shared_layers`` layers compute no keys or values; each attends to
  those of the last earlier layer of its own type (``kv_source``), and uses a feed-forward network
  twice as wide when ``use_double_wide_mlp``;
* ``attention_k_eq_v``: full layers use their raw key projection as values (``num_global_kv_heads``
  KV heads);
* each layer's output times a learned scalar (``layer_scalar``).

``cfg`` keys: ``vocab_size, vocab_size_per_layer_input, context_length, emb_dim, n_heads,
n_kv_heads, num_global_kv_heads (None: n_kv_heads), n_layers, hidden_dim, head_dim,
global_head_dim, hidden_activation, rms_norm_eps, sliding_window, layer_types, rope_local_base,
rope_base, rope_global_type ("proportional" | "default"), rope_global_partial_rotary_factor,
hidden_size_per_layer_input (0: none), num_kv_shared_layers, use_double_wide_mlp,
attention_k_eq_v, final_logit_softcap (None: none), attention_bias, tie_word_embeddings, dtype``.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..common.attention import GroupedQueryAttention, soft_cap
from ..common.blocks import SandwichBlock
from ..common.cache import KVCache
from ..common.decoder import DecoderModel, TokenEmbedding
from ..common.layer_types import FULL, SLIDING
from ..common.mlp import GatedMLP, get_activation
from ..common.norms import RMSNorm


def rope_parameters(cfg: dict) -> dict[str, dict]:
    """Transformers-5 rope dict per layer type: default RoPE on sliding layers, proportional (partial)
    RoPE on full layers."""
    full = {"rope_type": cfg["rope_global_type"], "rope_theta": cfg["rope_base"]}
    if cfg["rope_global_type"] == "proportional":
        full["partial_rotary_factor"] = cfg["rope_global_partial_rotary_factor"]
    return {SLIDING: {"rope_type": "default", "rope_theta": cfg["rope_local_base"]}, FULL: full}


def kv_sources(cfg: dict) -> dict[int, int]:
    """``{layer: the layer whose keys and values it reads}`` for the last ``num_kv_shared_layers``
    layers: the last earlier layer of the same type (that layer keeps its K/V for them)."""
    n, types = cfg["n_layers"], cfg["layer_types"]
    first = n - cfg["num_kv_shared_layers"]
    producers = {t: i for i, t in enumerate(types[:first])}
    return {i: producers[types[i]] for i in range(first, n)}


class Gemma4Block(SandwichBlock):
    """Gemma 4's decoder layer: the sandwich block (its attention reading ``shared_kv`` where it
    shares another layer's), then the per-layer input branch, then times ``layer_scalar``::

        h = sandwich(x)
        h = h + post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(h)) * per_layer_input))
        y = h * layer_scalar

    ``kv_source``: the index of the layer whose keys and values this one reads (None: its own).
    """

    def __init__(self, cfg: dict, att: GroupedQueryAttention, ff: nn.Module, layer_type: str, kv_source: int | None):
        norm = partial(RMSNorm, cfg["emb_dim"], eps=cfg["rms_norm_eps"], power=True, dtype=cfg["dtype"])
        super().__init__(att, ff, norm, layer_type)
        self.kv_source = kv_source
        width, dtype = cfg["hidden_size_per_layer_input"], cfg["dtype"]
        if width:
            self.act = get_activation(cfg["hidden_activation"])
            self.per_layer_input_gate = nn.Linear(cfg["emb_dim"], width, bias=False, dtype=dtype)
            self.per_layer_projection = nn.Linear(width, cfg["emb_dim"], bias=False, dtype=dtype)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype))

    def forward(
        self, x, cos=None, sin=None, padding_mask=None, cache=None, per_layer_input=None, shared_kv=None
    ) -> torch.Tensor:
        x = super().forward(x, cos, sin, padding_mask, cache, shared_kv=shared_kv)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


def transformer_block(cfg: dict, index: int, sources: dict[int, int]) -> Gemma4Block:
    """Layer ``index``: its type decides the window, head_dim, RoPE and (with K = V) KV heads; KV
    sharing decides whether it projects keys and values and how wide its FFN is."""
    layer_type, dtype, emb_dim = cfg["layer_types"][index], cfg["dtype"], cfg["emb_dim"]
    full, shared = layer_type == FULL, index in sources
    k_eq_v = cfg["attention_k_eq_v"] and full  # K = V full layers have their own KV head count
    norm = partial(RMSNorm, eps=cfg["rms_norm_eps"], power=True, dtype=dtype)
    att = GroupedQueryAttention(
        emb_dim,
        cfg["n_heads"],
        (k_eq_v and cfg["num_global_kv_heads"]) or cfg["n_kv_heads"],
        cfg["global_head_dim"] if full else cfg["head_dim"],
        scale=1.0,
        qk_norm="head",
        norm=norm,
        v_norm=partial(norm, weight=False),
        k_eq_v=k_eq_v and not shared,
        kv_shared=shared,
        keep_kv=index in sources.values(),
        sliding_window=None if full else cfg["sliding_window"],
        bias=cfg["attention_bias"],
        dtype=dtype,
    )
    wide = 2 if cfg["use_double_wide_mlp"] and shared else 1
    ff = GatedMLP(emb_dim, cfg["hidden_dim"] * wide, activation=cfg["hidden_activation"], dtype=dtype)
    return Gemma4Block(cfg, att, ff, layer_type, sources.get(index))


class Gemma4Model(DecoderModel):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``."""

    def __init__(self, cfg: dict):
        sources = kv_sources(cfg)
        blocks = [transformer_block(cfg, i, sources) for i in range(cfg["n_layers"])]
        dtype, eps, width = cfg["dtype"], cfg["rms_norm_eps"], cfg["hidden_size_per_layer_input"]
        final_norm = RMSNorm(cfg["emb_dim"], eps=eps, power=True, dtype=dtype)
        super().__init__(
            cfg, blocks, final_norm, emb_scale=cfg["emb_dim"] ** 0.5, final_softcap=cfg["final_logit_softcap"]
        )
        if width:
            packed = cfg["n_layers"] * width
            self.embed_tokens_per_layer = TokenEmbedding(
                cfg["vocab_size_per_layer_input"], packed, scale=width**0.5, dtype=dtype
            )
            self.per_layer_model_projection = nn.Linear(cfg["emb_dim"], packed, bias=False, dtype=dtype)
            self.per_layer_projection_norm = RMSNorm(width, eps=eps, power=True, dtype=dtype)

    def rope_parameters(self) -> dict[str, dict]:
        return rope_parameters(self.cfg)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, n_layers, width)``: ``(N(proj(x) / sqrt(emb_dim)) + E_pl(ids)) / sqrt(2)``, the
        projection of the (scaled) token embeddings ``x`` normalised per layer, plus the per-layer
        embedding of each token (``get_per_layer_inputs`` and ``project_per_layer_inputs``)."""
        per_layer = (self.cfg["n_layers"], self.cfg["hidden_size_per_layer_input"])
        tokens = self.embed_tokens_per_layer(input_ids).unflatten(-1, per_layer)
        context = self.per_layer_model_projection(x) * self.cfg["emb_dim"] ** -0.5
        context = self.per_layer_projection_norm(context.unflatten(-1, per_layer))
        return (context + tokens) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """As :meth:`DecoderModel.forward`, with each block's per-layer input and shared keys and values
        (with a cache, a KV-shared layer reads its source layer's keys after that layer's update and
        keeps none of its own, as ``Gemma4TextAttention`` reads the shared cache layer)."""
        x = self.tok_emb(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x) if self.cfg["hidden_size_per_layer_input"] else None
        if position_ids is None:
            start = cache.seen if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        positions = position_ids.to(x.device)
        tables = self.rope_tables(positions, x.device, x.dtype)
        for i, block in enumerate(self.blocks):
            shared = None if block.kv_source is None else self.blocks[block.kv_source].att.kv
            layer_cache = cache.layers[i] if cache is not None and block.kv_source is None else None
            x = block(
                x,
                *tables[block.layer_type],
                padding_mask=attention_mask,
                cache=layer_cache,
                per_layer_input=None if per_layer is None else per_layer[:, :, i],
                shared_kv=shared,
            )
        for block in self.blocks:
            block.att.kv = None  # kept only for this forward's consumers
        logits = self.out_head(self.final_norm(x))
        return logits if self.final_softcap is None else soft_cap(logits, self.final_softcap)
