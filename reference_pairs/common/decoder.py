"""The decoder-only skeleton every family fills in: embeddings, blocks, final norm, output head.

A family subclasses :class:`DecoderModel`, builds its blocks from ``cfg`` and says how its cfg
maps to RoPE (``rope_parameters``); the skeleton computes the RoPE tables per forward (no buffers,
so the model can be built on the meta device and receive checkpoint tensors as Parameters) and
runs ``tok_emb -> blocks -> final_norm -> out_head``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .attention import soft_cap
from .cache import KVCache
from .rope import rope_cos_sin, rope_init


class TokenEmbedding(nn.Embedding):
    """Token ids ``(batch, seq)`` -> ``(batch, seq, emb_dim)``, optionally times ``scale``.

    Gemma multiplies by ``sqrt(emb_dim)`` rounded first to float32 and then to the model dtype
    (``Gemma3TextScaledWordEmbedding`` keeps it as a float32 tensor cast to the weight's dtype), so
    in bfloat16 the factor is ``bf16(sqrt(emb_dim))``, not the exact root.
    """

    def __init__(self, vocab_size: int, emb_dim: int, scale: float | None = None, dtype: torch.dtype | None = None):
        super().__init__(vocab_size, emb_dim, dtype=dtype)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=torch.float32).to(device=x.device, dtype=x.dtype)


class DecoderModel(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)`` in ``cfg["dtype"]``:

        x = tok_emb(ids) [+ pos_emb(positions)]
        x = block(x) for each block             # with its layer type's RoPE table
        logits = out_head(final_norm(x)) [* logit_scale] [-> cap * tanh(logits / cap)]

    ``cfg`` keys read here: ``vocab_size, emb_dim, n_layers, tie_word_embeddings, dtype`` (and
    ``context_length`` for learned positions and YaRN without a factor). Options:

    * ``emb_scale``: multiply the token embeddings (Gemma: ``emb_dim**0.5``);
    * ``learned_positions``: an absolute position embedding ``pos_emb`` of ``context_length`` rows (GPT-2);
    * ``logit_scale``: multiply the logits (Cohere: ``logit_scale``);
    * ``final_softcap``: soft-cap the logits (Gemma 2/3: ``final_logit_softcapping``);
    * ``rope_in_float32``: keep the cos/sin tables in float32 (OLMo 3's rotary embedding); by default
      they are rounded to the activation dtype, as most references return them.

    A tied head is the embedding's Parameter itself (``out_head.weight is tok_emb.weight``).
    Subclasses implement :meth:`rope_parameters`.
    """

    def __init__(
        self,
        cfg: dict,
        blocks: Iterable[nn.Module],
        final_norm: nn.Module,
        *,
        emb_scale: float | None = None,
        learned_positions: bool = False,
        logit_scale: float | None = None,
        final_softcap: float | None = None,
        rope_in_float32: bool = False,
    ):
        super().__init__()
        blocks = list(blocks)
        if len(blocks) != cfg["n_layers"]:
            raise ValueError(f"layer_types has {len(blocks)} entries for n_layers={cfg['n_layers']}")
        self.cfg = cfg
        dtype = cfg["dtype"]
        self.tok_emb = TokenEmbedding(cfg["vocab_size"], cfg["emb_dim"], scale=emb_scale, dtype=dtype)
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"], dtype=dtype) if learned_positions else None
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=dtype)
        if cfg["tie_word_embeddings"]:
            self.out_head.weight = self.tok_emb.weight
        self.logit_scale, self.final_softcap, self.rope_in_float32 = logit_scale, final_softcap, rope_in_float32
        for _, params, head_dim in self._layer_ropes():  # refuse what RoPE cannot compute now, not at a forward
            if params is not None:
                rope_init(params, head_dim, cfg.get("context_length"))

    def rope_parameters(self) -> dict[str, dict | None]:
        """``{layer_type: Transformers-5 rope dict, or None for no RoPE}`` from ``self.cfg`` (read at
        every forward, so an edited ``cfg`` takes effect)."""
        raise NotImplementedError

    def _layer_ropes(self) -> list[tuple[str, dict | None, int | None]]:
        """(layer type, rope dict or None, head_dim of its attention, None without RoPE) for each
        layer type present (a token mixer without RoPE, e.g. linear attention, need not have a head_dim)."""
        params, seen = self.rope_parameters(), {}
        for block in self.blocks:
            if block.layer_type not in seen:
                if block.layer_type not in params:
                    raise ValueError(f"rope_parameters has no entry for layer type {block.layer_type!r}")
                rope = params[block.layer_type]
                seen[block.layer_type] = (block.layer_type, rope, None if rope is None else block.att.head_dim)
        return list(seen.values())

    def rope_tables(self, positions: int | torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
        """``{layer_type: (cos, sin)}`` of shape ``(..., seq, rotary_dim // 2)`` for ``positions`` (a
        length: ``0 .. n - 1``; or ``(batch, seq)`` per-row positions), ``(None, None)`` for a layer
        type without RoPE. As the references do it:
        inverse frequencies on the CPU, angles and cos/sin in float32 on ``device``, then kept in float32
        or rounded to ``dtype`` (see ``rope_in_float32``). Computed per call: no buffers."""
        tables = {}
        for layer_type, params, head_dim in self._layer_ropes():
            if params is None:
                tables[layer_type] = (None, None)
                continue
            inv_freq, attention_factor = rope_init(params, head_dim, self.cfg.get("context_length"))
            cos, sin = rope_cos_sin(inv_freq.to(device), positions, attention_factor)
            table_dtype = torch.float32 if self.rope_in_float32 else dtype
            tables[layer_type] = (cos.to(table_dtype), sin.to(table_dtype))
        return tables

    def new_cache(self) -> KVCache:
        """An empty cache for this model, a layer per block by its layer type: keys and values (with the
        window of its attention), or a linear-attention layer's state."""
        return KVCache(
            [getattr(block.att, "sliding_window", None) for block in self.blocks],
            [block.layer_type for block in self.blocks],
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``attention_mask``: ``(batch, tokens so far)`` 1 for real tokens, 0 for padding (keys only are
        masked); ``position_ids``: ``(batch, seq)`` positions of this call's tokens (default: their
        sequence indices; a left-padded batch counts real tokens only, as generation does); ``cache``:
        a :meth:`new_cache` carried across calls (prefill, chunks, decode steps), or None."""
        x = self.tok_emb(input_ids)
        if position_ids is None:
            start = cache.seen if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        positions = position_ids.to(x.device)
        if self.pos_emb is not None:  # (batch, seq, emb_dim) as the reference's wpe(position_ids) gives it
            x = x + self.pos_emb(positions.expand(input_ids.shape))
        tables = self.rope_tables(positions, x.device, x.dtype)
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layers[i] if cache is not None else None
            x = block(x, *tables[block.layer_type], padding_mask=attention_mask, cache=layer_cache)
        logits = self.out_head(self.final_norm(x))
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:
            logits = soft_cap(logits, self.final_softcap)
        return logits
