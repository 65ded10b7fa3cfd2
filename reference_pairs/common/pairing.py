"""The one build path every family shares: cfg or checkpoint -> one state dict -> both models.

A family supplies a :class:`FamilySpec` (its model class, loader, configs, node map and config
translation); :func:`build_pair` does the rest, so every family resolves configs, reads
checkpoints, seeds weights and shares storage the same way.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from parity.checkpoint import read_checkpoint, read_config
from parity.errors import ConfigError, LoaderError
from parity.pair import NodeSpec, Pair
from parity.resources import require

from .weights import random_state_dict


@dataclass(frozen=True)
class FamilySpec:
    """What a family contributes to :func:`build_pair`.

    ``configs``: name -> ``f(n_layers=None) -> cfg``. ``to_hf``: cfg -> Transformers config.
    ``from_hf``: Transformers config, dtype -> cfg (raises ConfigError on a field it cannot honour).
    ``load``: ``(model, cfg, state_dict) -> consumed keys``. ``nodes``: cfg -> NodeSpecs.
    ``default_seq_len``: cfg -> sequence length that exercises the config (past the window).
    ``check_cfg``: cfg -> list of notes for the user (may raise ConfigError).
    """

    name: str
    model_type: str
    reference_class: str
    config_class: str
    model_class: type[nn.Module]
    configs: Mapping[str, Callable[..., dict]]
    to_hf: Callable[[dict], object]
    from_hf: Callable[[object, torch.dtype], dict]
    load: Callable[[nn.Module, dict, Mapping[str, torch.Tensor]], dict]
    nodes: Callable[[dict], list[NodeSpec]]
    default_seq_len: Callable[[dict], int]
    check_cfg: Callable[[dict], list[str]] = lambda cfg: []

    def reference_cls(self):
        import transformers

        return getattr(transformers, self.reference_class)

    def config_cls(self):
        import transformers

        return getattr(transformers, self.config_class)


def resolve_cfg(spec: FamilySpec, config, dtype: torch.dtype, overrides: dict) -> dict:
    """A built-in name, a cfg dict or a path to a config.json -> a complete cfg in ``dtype``.

    ``n_layers`` in ``overrides`` picks the depth of built-in configs (layer types follow the
    family's pattern); any other override must be an existing cfg key. Raises ConfigError.
    """
    n_layers = overrides.get("n_layers")
    if isinstance(config, dict):
        cfg = copy.deepcopy(config)
    elif isinstance(config, (str, Path)) and str(config) in spec.configs:
        cfg = spec.configs[str(config)](n_layers)
    elif isinstance(config, (str, Path)) and (Path(config).is_file() or str(config).endswith(".json")):
        raw = read_config(config)
        if raw.get("model_type") != spec.model_type:
            raise ConfigError(f"{config} has model_type {raw.get('model_type')!r}, expected {spec.model_type!r}")
        cfg = spec.from_hf(_hf_config_from_dict(spec, raw), dtype)
    else:
        known = ", ".join(spec.configs)
        raise ConfigError(f"unknown {spec.name} config {config!r}; built-in configs: {known}, or a config.json path")
    for key, value in overrides.items():
        if key == "n_layers" and isinstance(config, (str, Path)) and str(config) in spec.configs:
            continue
        if key not in cfg:
            raise ConfigError(f"unknown cfg key {key!r} for {spec.name}")
        if key == "n_layers" and "layer_types" in cfg and "layer_types" not in overrides:
            if value > len(cfg["layer_types"]):
                raise ConfigError(f"n_layers {value} exceeds the {len(cfg['layer_types'])} layers of config {config}")
            cfg["layer_types"] = list(cfg["layer_types"][:value])  # the first n layers of a config.json
        cfg[key] = value
    if "layer_types" in cfg and len(cfg["layer_types"]) != cfg["n_layers"]:
        raise ConfigError(f"layer_types has {len(cfg['layer_types'])} entries but n_layers is {cfg['n_layers']}")
    cfg["dtype"] = dtype
    return cfg


def _hf_config_from_dict(spec: FamilySpec, raw: dict):
    config_cls = spec.config_cls()
    try:
        return config_cls.from_dict(raw)
    except Exception as e:  # its strict dataclass validators raise their own types: all mean bad input
        reason = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip().splitlines()
        raise ConfigError(f"config.json rejected by {config_cls.__name__}: {reason[0] if reason else type(e).__name__}") from None


#: cfg key -> Transformers config attribute, for the fields every decoder family shares
SHARED_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("context_length", "max_position_embeddings"),
    ("emb_dim", "hidden_size"),
    ("hidden_dim", "intermediate_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("tie_word_embeddings", "tie_word_embeddings"),
)


def shared_to_hf(cfg: dict) -> dict:
    """Keyword arguments of a Transformers config for the :data:`SHARED_FIELDS` of ``cfg``."""
    return {hf: cfg[ours] for ours, hf in SHARED_FIELDS}


def shared_from_hf(hc) -> dict:
    """The :data:`SHARED_FIELDS` of our cfg from a Transformers config (``head_dim`` defaults to
    ``hidden_size // num_attention_heads``, as the reference's attention computes it)."""
    cfg = {ours: getattr(hc, hf, None) for ours, hf in SHARED_FIELDS}
    cfg["head_dim"] = cfg["head_dim"] or hc.hidden_size // hc.num_attention_heads
    cfg["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    return cfg


def seq_len_past_window(cfg: dict) -> int:
    """Default sequence length: long enough to pass the sliding window (4x window, at least 16)
    while that stays small; 64 for real-size windows, where the check notes that the window is not
    exercised (the attention probabilities of 4096+ tokens would not fit in memory)."""
    window = cfg.get("sliding_window") or 4
    return max(16, 4 * window) if 4 * window <= 512 else 64


def config_name_of(config) -> str:
    """A built-in name as is, a config path as its file name, a cfg dict as "custom"."""
    return config if isinstance(config, str) else Path(config).name if isinstance(config, Path) else "custom"


def build_reference(spec: FamilySpec, hf_config, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """The Transformers model holding exactly ``state_dict``'s tensors (no copy).

    Built without weight initialisation (its parameters are assigned right away), then tied as
    its config says. Raises LoaderError if the reference rejects a key or lacks one.
    """
    from transformers.initialization import no_init_weights

    with no_init_weights():
        reference = spec.reference_cls()(hf_config)
    try:
        result = reference.load_state_dict(state_dict, strict=False, assign=True)
    except RuntimeError as e:  # size mismatches: the lines after the first name key and shapes
        reasons = "; ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip())
        raise LoaderError(f"{spec.reference_class} rejects the state dict: {reasons or e}") from None
    tied_targets = set(getattr(reference, "_tied_weights_keys", None) or {}) if hf_config.tie_word_embeddings else set()
    missing = [k for k in result.missing_keys if k not in tied_targets]
    if missing or result.unexpected_keys:
        raise LoaderError(
            f"{spec.reference_class} rejects the state dict: missing {', '.join(missing) or 'none'}; "
            f"unexpected {', '.join(result.unexpected_keys) or 'none'}"
        )
    if hf_config.tie_word_embeddings:
        reference.tie_weights()
    return reference.eval()


def build_pair(
    spec: FamilySpec,
    config=None,
    checkpoint: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides,
) -> Pair:
    """Build ours and the reference with identical, shared weights.

    From a config (built-in name, cfg dict or config.json path; default ``"tiny"``): seeded random
    weights in checkpoint naming, created once. From ``checkpoint`` (a Transformers-format
    directory): both models are built from its config.json and loaded from its safetensors files;
    ``config`` and ``overrides`` must then be absent. ``dtype`` is the compute dtype of both.

    Raises:
        ConfigError, CheckpointError, LoaderError: one line naming the key, file or field.
    """
    if checkpoint is not None:
        if config is not None or overrides:
            raise ConfigError("a checkpoint brings its own config.json; do not pass a config or overrides with it")
        ckpt = read_checkpoint(checkpoint, model_type=spec.model_type)
        hf_config = _hf_config_from_dict(spec, ckpt.config)
        cfg = spec.from_hf(hf_config, dtype)
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt.state_dict.items()}
        conversions = [
            f"{k}: {str(v.dtype).replace('torch.', '')} -> {str(dtype).replace('torch.', '')}"
            for k, v in ckpt.state_dict.items()
            if v.is_floating_point() and v.dtype != dtype
        ]
        config_name = str(Path(checkpoint))
    else:
        config = "tiny" if config is None else config
        cfg = resolve_cfg(spec, config, dtype, overrides)
        hf_config = spec.to_hf(cfg)
        with torch.device("meta"):
            shapes = {k: tuple(p.shape) for k, p in spec.reference_cls()(hf_config).named_parameters()}
        n_params = sum(math.prod(s) for s in shapes.values())
        require(
            n_params * torch.finfo(dtype).bits // 8,
            f"{spec.name} {config_name_of(config)} ({n_params / 1e9:.2f}B parameters in {str(dtype).replace('torch.', '')})",
            "build fewer layers (--layers / n_layers=)",
        )
        state_dict = random_state_dict(shapes, seed, dtype)
        conversions = []
        config_name = config_name_of(config)
    notes = spec.check_cfg(cfg)
    try:
        with torch.device("meta"):
            ours = spec.model_class(cfg)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{spec.model_class.__name__} rejects the config: {e}") from None
    loaded = spec.load(ours, cfg, state_dict)  # first: its errors name the checkpoint key
    reference = build_reference(spec, hf_config, state_dict)
    pair = Pair(
        ours=ours.eval(),
        reference=reference,
        cfg=cfg,
        nodes=spec.nodes(cfg),
        family=spec.name,
        config_name=config_name,
        dtype=dtype,
        seed=seed,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        default_seq_len=spec.default_seq_len(cfg),
        notes=notes,
        loaded_keys=loaded,
        checkpoint_hash=ckpt.content_hash() if checkpoint is not None else None,
        reference_cfg=spec.from_hf(reference.config, dtype),
        state_dict=state_dict,
        conversions=conversions,
        tied_keys=dict(reference._tied_weights_keys or {}) if hf_config.tie_word_embeddings else {},
    )
    return pair
