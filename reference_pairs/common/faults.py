"""Fault injections shared by families (GQA head expansion, norm swaps...). Each mutates one pair's
own objects only; see :class:`parity.selftest.faults.Fault`."""

from __future__ import annotations

import torch
from torch import nn

from parity.model.pair import Pair
from parity.selftest.faults import Fault

from .norms import RMSNorm


def to_half_split_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved q/k rows (RoPE pairs ``2i, 2i + 1``) -> Transformers' half-split rows (``i,
    i + d/2``), grouping rows in ``n_heads`` heads: the permute of ``convert_llama_weights_to_hf.py``."""
    out, d_in = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(out, d_in)


def to_interleaved_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_half_split_rows`: Transformers' q/k rows back in Meta's layout."""
    out, d_in = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, d_in).transpose(1, 2).reshape(out, d_in)


def expand_kv_with_repeat(pair: Pair) -> None:
    """K/V heads tiled ``[K0, K1, K0, K1]`` (``repeat``) instead of ``[K0, K0, K1, K1]`` (onnx #7274)."""
    for block in pair.ours.blocks:
        att = block.att
        if hasattr(att, "expand_kv"):  # softmax attention layers only (not a linear-attention layer)
            att.expand_kv = lambda t, g=att.group_size: t.repeat(1, g, 1, 1)


class PerHeadRMSNorm(nn.Module):
    """A whole-projection RMSNorm's weight applied per head: each head normalised on its own."""

    def __init__(self, whole: RMSNorm, head_dim: int):
        super().__init__()
        self.weight, self.eps, self.head_dim = whole.weight, whole.eps, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.float().unflatten(-1, (-1, self.head_dim))
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * heads.flatten(-2)).to(x.dtype)


class WholeProjectionRMSNorm(nn.Module):
    """A per-head RMSNorm's weight applied after normalising every head of a token together (the
    whole projection, OLMo's way) instead of each head on its own: input ``(..., heads, head_dim)``."""

    def __init__(self, per_head: RMSNorm):
        super().__init__()
        self.weight, self.eps, self.cast_first = per_head.weight, per_head.eps, per_head.cast_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean((-2, -1), keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype) if self.cast_first else (self.weight * normed).to(x.dtype)


def rms_instead_of(norm: nn.Module) -> RMSNorm:
    """An RMSNorm with ``norm``'s weight and eps (a LayerNorm re-implemented without mean subtraction)."""
    replacement = RMSNorm(norm.weight.shape[0], eps=norm.eps)
    replacement.weight = norm.weight
    return replacement


def untie_head(pair: Pair) -> None:
    """The output head as its own, never loaded Parameter (tinygrad #13796)."""
    head = pair.ours.out_head
    gen = torch.Generator().manual_seed(1234)
    fresh = torch.randn(head.weight.shape, generator=gen) * head.weight.shape[1] ** -0.5
    head.weight = nn.Parameter(fresh.to(head.weight.dtype), requires_grad=False)


def mask_with_neg_inf(pair: Pair) -> None:
    """Masked scores filled with -inf: a query row with no real key (left padding) becomes NaN (unsloth #9848)."""
    for block in pair.ours.blocks:
        if hasattr(block.att, "mask_scores"):
            block.att.mask_scores = lambda scores, allowed: scores.masked_fill(~allowed, float("-inf"))


#: the padded batch F10 needs: rows after the first start with 5 padding tokens
LEFT_PADDED = (("batch_size", 3), ("left_pad", 5))


# --- catalogue entries every family with that part has (one per handed case) -------------------------


def gate_up_swapped(layer: int = 1, config: str = "tiny") -> Fault:
    """A gated MLP's gate and up weights swapped in ``layer`` of ours (each module holds the other's
    weight): found at that layer's gate_proj, ``swapped_weights``."""

    def inject(pair: Pair) -> None:
        ff = pair.ours.blocks[layer].ff
        ff.fc1.weight, ff.fc2.weight = ff.fc2.weight, ff.fc1.weight

    return Fault(
        "gate-up-swapped",
        f"gate and up weights swapped in layer {layer}",
        config,
        inject,
        f"model.layers.{layer}.mlp.gate_proj",
        "swapped_weights",
        scope=f"model.layers.{layer}.mlp",
    )


def f07_repeat_kv(attention: str, config: str = "tiny", layer: int | str = 0, scope: str = "*") -> Fault:
    """F07: K/V heads tiled instead of repeat-interleaved, first seen at ``attention``'s ``scores``
    (``attention`` a template with ``{}`` for the layer: ``model.layers.{}.self_attn``)."""
    return Fault(
        "F07",
        "K/V heads expanded with repeat instead of repeat_interleave",
        config,
        expand_kv_with_repeat,
        f"{attention.format(layer)}.scores",
        "head_mapping",
        scope=attention.format(scope),
        source="onnx #7274",
    )


def f08_untied_head(config: str = "tiny", why: str = "") -> Fault:
    """F08: the output head its own Parameter, never loaded or tied (``why``: what the family's real
    models do, said in the description)."""
    return Fault(
        "F08",
        "output head its own Parameter, never loaded or tied" + (f" ({why})" if why else ""),
        config,
        untie_head,
        "lm_head",
        "untied_head",
        source="tinygrad #13796",
    )


def f10_masked_neg_inf(attention: str, config: str = "tiny", layer: int | str = 0, scope: str = "*") -> Fault:
    """F10: masked scores filled with -inf, so a left-padded row with no real key gives NaN at
    ``attention``'s ``probs`` (a padded batch)."""
    return Fault(
        "F10",
        "masked scores filled with -inf: fully masked (left-pad) query rows give NaN",
        config,
        mask_with_neg_inf,
        f"{attention.format(layer)}.probs",
        "nonfinite",
        scope=f"{attention.format(scope)}.probs",
        source="unsloth #9848",
        check_kwargs=LEFT_PADDED,
    )


# --- KV-cache faults (decode checks) ----------------------------------------------------------------


def _patch_new_cache(pair: Pair, patch_layer) -> None:
    """Make ``pair.ours.new_cache()`` hand out caches whose layers ``patch_layer(i, layer)`` altered."""
    make = pair.ours.new_cache

    def new_cache():
        cache = make()
        for i, layer in enumerate(cache.layers):
            patch_layer(i, layer)
        return cache

    pair.ours.new_cache = new_cache


def sliding_cache_trimmed_as_if_one_token(pair: Pair) -> None:
    """A sliding layer's cache keeps ``window - 1`` plus ``S - 1`` tokens when ``S`` arrive at once: the
    trim is computed as if one token had come (mlx-lm #1914)."""

    def patch(i, layer):
        if layer.window is None:
            return

        def update(keys, values, layer=layer):
            arriving = keys.shape[-2]
            first = layer.seen - layer.held
            layer.seen += arriving
            if layer.keys is not None:
                keys, values = torch.cat([layer.keys, keys], -2), torch.cat([layer.values, values], -2)
            n = min(keys.shape[-2], layer.window - 1 + arriving - 1)
            layer.keys, layer.values = keys[:, :, keys.shape[-2] - n :], values[:, :, values.shape[-2] - n :]
            return keys, values, first

        layer.update = update

    _patch_new_cache(pair, patch)


def cached_positions_off_by_one(first_layer: int):
    """From layer ``first_layer`` up, once the cache holds tokens, RoPE rotates the new tokens one
    position too far (a position counter read after an earlier layer advanced it)."""

    def inject(pair: Pair) -> None:
        model = pair.ours
        tables = model.rope_tables

        for block in list(model.blocks)[first_layer:]:
            forward = block.forward

            def shifted(x, cos=None, sin=None, padding_mask=None, cache=None, _forward=forward, _block=block):
                if cache is not None and cache.seen > 0 and cos is not None:
                    positions = model._parity_positions + 1
                    cos, sin = tables(positions, x.device, cos.dtype)[_block.layer_type]
                return _forward(x, cos, sin, padding_mask, cache)

            block.forward = shifted

        def remember(module, args, kwargs):
            ids = args[0] if args else kwargs["input_ids"]
            cache = kwargs.get("cache")
            positions = kwargs.get("position_ids")
            if positions is None:
                start = cache.seen if cache is not None else 0
                positions = torch.arange(start, start + ids.shape[1])
            model._parity_positions = positions

        model.register_forward_pre_hook(remember, with_kwargs=True)

    return inject


def cached_mask_sees_one_ahead(pair: Pair) -> None:
    """With a cache, each query of a chunk may also see the next key of its chunk (a decode-time mask
    built one slot wide)."""
    for block in pair.ours.blocks:
        att = block.att
        masked = att.mask_scores

        def mask_scores(scores, allowed, _masked=masked):
            if scores.shape[-1] > scores.shape[-2]:  # keys from earlier steps: a cached step
                allowed = allowed | torch.nn.functional.pad(allowed, (1, 0))[..., :-1]
            return _masked(scores, allowed)

        att.mask_scores = mask_scores


#: the decode schedule the cached faults run on: prefill 12 in chunks of 4, then 4 decode steps
DECODE = (("decode", "12:4x4"),)


# --- training faults (backward checks: the forward agrees, training does not) -------------------------

#: the options a training fault is checked with
BACKWARD = (("backward", True),)


def detach_in_rope(layer: int = 0):
    """The queries detached as RoPE rotates them in one layer (``rotate(q.detach(), ...)``; told from the
    keys by their head count, so a GQA layer): the forward is the same, but ``W_query`` and everything
    before it get no gradient through the attention scores."""

    def inject(pair: Pair) -> None:
        att = pair.ours.blocks[layer].att
        rotate = att.rotate

        def detached(t, cos, sin, **rope):
            return rotate(t.detach() if t.shape[1] == att.n_heads else t, cos, sin, **rope)

        att.rotate = detached

    return inject


def untied_embedding_copy(pair: Pair) -> None:
    """The output head a copy of the tied embedding (equal values, its own Parameter): the forward is
    the same, each copy gets the gradient of its own use only (as seen in a public Llama 3.2 port)."""
    head = pair.ours.out_head
    head.weight = nn.Parameter(pair.ours.tok_emb.weight.detach().clone())


def in_place_after_product(layer: int = 0):
    """The up projection's output zeroed in place after the gated product read it (a scratch buffer
    reused): the forward is the same, the product's backward reads the overwritten tensor."""

    def inject(pair: Pair) -> None:
        ff = pair.ours.blocks[layer].ff

        def forward(x: torch.Tensor) -> torch.Tensor:
            up = ff.fc2(x)
            hidden = ff.act(ff.fc1(x)) * up
            up.zero_()
            return ff.fc3(hidden)

        ff.forward = forward

    return inject


def dropout_in_forward(layer: int = 0, p: float = 0.1):
    """A dropout probability written into one MLP's forward (``F.dropout(h, 0.1, self.training)``):
    eval mode is exact, train mode drops activations parity cannot switch off."""

    def inject(pair: Pair) -> None:
        ff = pair.ours.blocks[layer].ff

        def forward(x: torch.Tensor) -> torch.Tensor:
            hidden = torch.nn.functional.dropout(ff.act(ff.fc1(x)), p, ff.training)
            return ff.fc3(hidden * ff.fc2(x))

        ff.forward = forward

    return inject


def _own_loss(loss):
    """Ours' forward takes ``labels`` and returns ``(loss(logits, labels, input_ids), logits)``."""

    def inject(pair: Pair) -> None:
        forward = pair.ours.forward

        def with_loss(input_ids, attention_mask=None, position_ids=None, cache=None, labels=None):
            logits = forward(input_ids, attention_mask, position_ids, cache)
            if labels is None:
                return logits
            return loss(logits, labels, input_ids), logits

        pair.ours.forward = with_loss

    return inject


def _loss_over_padding(logits, labels, input_ids):
    targets = torch.where(labels == -100, input_ids, labels)[:, 1:]  # -100 replaced by the padding's ids
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, targets.reshape(-1))


def _labels_not_shifted(logits, labels, input_ids):
    flat = logits.float().reshape(-1, logits.shape[-1])  # position t against token t: no shift
    return torch.nn.functional.cross_entropy(flat, labels.reshape(-1), ignore_index=-100)


#: ours computes its own loss over padding too (its -100 labels replaced by the padding's token ids)
loss_over_padding = _own_loss(_loss_over_padding)
#: ours computes its own loss with the labels not shifted (position t trained toward token t)
labels_not_shifted = _own_loss(_labels_not_shifted)


def training_faults(attention: str, mlp: str, *, tied: bool = False, layer: int = 0, config: str = "tiny") -> tuple:
    """The training faults of a family whose blocks are ``blocks[i].att`` (with ``rotate``) and
    ``blocks[i].ff`` (a :class:`~reference_pairs.common.mlp.GatedMLP`): ``attention``/``mlp`` name the
    reference's modules (``{}`` for the layer); ``tied``: the config ties the head (the untied-copy fault)."""
    faults = [
        Fault(
            "bw-detach-rope",
            "the queries detached as RoPE rotates them in one layer (training only: the forward agrees)",
            config,
            detach_in_rope(layer),
            f"grad/{attention.format(layer)}.q_rot",
            "detached",
            check_kwargs=BACKWARD,
        ),
        Fault(
            "bw-in-place",
            "the up projection's output zeroed in place after the gated product read it (a reused buffer)",
            config,
            in_place_after_product(layer),
            f"grad/{mlp.format(layer)}.up_proj",
            "in_place",
            check_kwargs=BACKWARD,
        ),
        Fault(
            "bw-dropout",
            "dropout p=0.1 written into one MLP's forward: train mode drops activations",
            config,
            dropout_in_forward(layer),
            "train/logits",
            "dropout",
            check_kwargs=BACKWARD,
        ),
        Fault(
            "bw-loss-over-padding",
            "ours' own loss counts the padding positions (labels -100 replaced by token ids)",
            config,
            loss_over_padding,
            "loss",
            "loss_mask",
            check_kwargs=BACKWARD + LEFT_PADDED,
        ),
        Fault(
            "bw-labels-not-shifted",
            "ours' own loss compares logits[t] with labels[t] (the labels never shifted)",
            config,
            labels_not_shifted,
            "loss",
            "label_shift",
            check_kwargs=BACKWARD,
        ),
    ]
    if tied:
        faults.append(
            Fault(
                "bw-untied-copy",
                "the output head a copy of the tied embedding, its own Parameter",
                config,
                untied_embedding_copy,
                "grad/model.embed_tokens.weight",
                "untied_copy",
                source="a public Llama 3.2 port",
                check_kwargs=BACKWARD,
            )
        )
    return tuple(faults)
