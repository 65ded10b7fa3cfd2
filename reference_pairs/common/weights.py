"""Weight maps as data, one generic applier, and seeded random weights.

A family's loader is a table ``{checkpoint key template: our parameter path template}`` with
``{i}`` standing for the layer index (the litgpt convention). :func:`apply_weight_map` walks it
once, so missing keys, unused keys, shape mismatches and parameters never written all fall out
of the same pass and are reported by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from parity.errors import LoaderError


def expand_weight_map(template: Mapping[str, str], n_layers: int) -> dict[str, str]:
    """Expand ``{i}`` templates over ``range(n_layers)``; other entries are copied once."""
    expanded = {}
    for src, dst in template.items():
        if "{i}" in src:
            for i in range(n_layers):
                expanded[src.format(i=i)] = dst.format(i=i)
        else:
            expanded[src] = dst
    return expanded


def _set_parameter(model: nn.Module, path: str, tensor: torch.Tensor) -> None:
    module_path, _, leaf = path.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def apply_weight_map(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    weight_map: Mapping[str, str],
    *,
    tied: Mapping[str, tuple[str, str]] | None = None,
) -> dict[str, str]:
    """Assign ``state_dict[src]`` to ``model.<dst>`` for every entry of an expanded weight map.

    Tensors are wrapped, not copied, so a model loaded from the same state dict as another shares
    its storage. ``tied`` maps a checkpoint key to ``(our path, our source path)``: after loading,
    ``model.<our path>`` becomes the *same* ``nn.Parameter`` as ``model.<our source path>`` (e.g.
    ``{"lm_head.weight": ("out_head.weight", "tok_emb.weight")}``). The tied key may be absent
    (``save_pretrained`` drops it) or present (``state_dict()`` keeps it), but only with values
    identical to its source.

    Returns the map of consumed checkpoint keys to our paths.

    Raises:
        LoaderError: naming every missing key, unused key, shape mismatch (key, checkpoint shape,
            expected shape) and parameter of ours the map never writes.
    """
    tied = dict(tied or {})
    ours = dict(model.named_parameters(remove_duplicate=False))
    reverse = {dst: src for src, dst in weight_map.items()}
    problems = []
    missing = [src for src in weight_map if src not in state_dict]
    if missing:
        problems.append(f"missing checkpoint keys: {', '.join(missing)}")
    unknown = sorted(dst for dst in weight_map.values() if dst not in ours)
    if unknown:
        problems.append(f"weight map targets no parameter of ours: {', '.join(unknown)}")
    for src, dst in weight_map.items():
        if src in state_dict and dst in ours and tuple(state_dict[src].shape) != tuple(ours[dst].shape):
            problems.append(
                f"shape mismatch for {src}: checkpoint {tuple(state_dict[src].shape)}, "
                f"expected {tuple(ours[dst].shape)} ({dst})"
            )
    for key, (_, source) in tied.items():
        src = reverse.get(source)
        if key in state_dict and src in state_dict and not torch.equal(state_dict[key], state_dict[src]):
            problems.append(f"{key} differs from {src} although the config ties them")
    unused = [k for k in state_dict if k not in weight_map and k not in tied]
    if unused:
        problems.append(f"unused checkpoint keys: {', '.join(unused)}")
    written = set(weight_map.values()) | {dst for dst, _ in tied.values()}
    unwritten = sorted(p for p in ours if p not in written)
    if unwritten:
        problems.append(f"parameters of ours never written: {', '.join(unwritten)}")
    if problems:
        raise LoaderError("; ".join(problems))

    for src, dst in weight_map.items():
        _set_parameter(model, dst, state_dict[src])
    for dst, source in tied.values():
        module_path, _, leaf = dst.rpartition(".")
        setattr(model.get_submodule(module_path), leaf, model.get_parameter(source))
    return {**weight_map, **{k: dst for k, (dst, _) in tied.items() if k in state_dict}}


#: q/k/v/o biases of Transformers' standard attention (configs with ``attention_bias``)
ATTENTION_BIAS_MAP = {
    f"model.layers.{{i}}.self_attn.{hf}.bias": f"blocks.{{i}}.att.{ours}.bias"
    for hf, ours in [("q_proj", "W_query"), ("k_proj", "W_key"), ("v_proj", "W_value"), ("o_proj", "out_proj")]
}
HEAD_MAP = {"lm_head.weight": "out_head.weight"}
#: a tied head: no checkpoint tensor of its own, the embedding's Parameter itself
TIED_HEAD = {"lm_head.weight": ("out_head.weight", "tok_emb.weight")}


def load_by_table(model: nn.Module, cfg: dict, state_dict: Mapping[str, torch.Tensor], table: Mapping[str, str]) -> dict[str, str]:
    """Apply a family's weight table (``{i}`` templates) plus what the cfg adds: the attention
    biases when ``cfg["attention_bias"]``, ``lm_head`` when the head is untied, the tie when it is.

    Returns the consumed checkpoint keys -> our parameter paths; raises LoaderError as
    :func:`apply_weight_map` does.
    """
    template = dict(table)
    if cfg.get("attention_bias"):
        template.update(ATTENTION_BIAS_MAP)
    if not cfg["tie_word_embeddings"]:
        template.update(HEAD_MAP)
    tied = TIED_HEAD if cfg["tie_word_embeddings"] else None
    return apply_weight_map(model, state_dict, expand_weight_map(template, cfg["n_layers"]), tied=tied)


def random_state_dict(
    shapes: Mapping[str, tuple[int, ...]], seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded random weights in checkpoint naming, created once and shared by both models.

    Linear weights ``(out, in)`` get N(0, 1/in) so activations keep unit scale through depth;
    embeddings N(0, 1); norm weights ``1 + N(0, 0.1^2)`` (not all ones, so a norm-weight bug such
    as ``w`` vs ``1 + w`` is visible); biases N(0, 0.02^2). Drawn in float32, then cast.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1 and "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = 0.02 * torch.randn(shape, generator=gen)
        elif "embed" in name:
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen).mul_(shape[-1] ** -0.5)  # in place: no second copy
        out[name] = t.to(dtype)
    return out
