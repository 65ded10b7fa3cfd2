"""The one build path every family shares: config or checkpoint -> one state dict -> both models.

A cfg reaches our model only after a round trip through the reference's Transformers config
(``to_hf`` -> the config class's own validation -> :func:`~parity.model.derive.validate_facts` ->
``from_hf``), so a cfg dict, a config.json and a checkpoint are validated and normalised by the
same path (a ``beta_fast`` of 0 becomes Transformers' 32 on both sides, a zero width is refused
by name).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parity.build.checkpoint import read_checkpoint, read_config
from parity.build.probes import probe_weights
from parity.model.derive import COUNT_FIELDS, count_field_problems, derive_facts, rope_problem_of, validate_facts
from parity.model.facts import ArchFacts
from parity.model.family import Composite, Family
from parity.model.pair import Loading, Pair, PairSource
from parity.model.weights import apply_weight_table
from parity.util.devices import Placement
from parity.util.errors import CheckpointError, ConfigError, LoaderError, ParityError
from parity.util.resources import gib, require
from parity.util.text import one_line, summary
from parity.util.version import require_transformers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: compute dtypes both models can run in
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def default_seq_len(facts: ArchFacts) -> int:
    """Long enough to pass every sliding window (4x window, at least 16) while that stays small; 64
    for real-size windows, where the check notes that the window is not exercised. Past the first
    chunk boundary of linear-attention layers too (a quarter chunk into the second chunk)."""
    window = facts.sliding_window or 4
    length = max(16, 4 * window) if 4 * window <= 512 else 64
    return max(length, facts.chunk_size + facts.chunk_size // 4) if facts.chunk_size else length


def config_name_of(config) -> str:
    """A built-in name as is, a config path as its file name, a cfg dict as "custom"."""
    return config if isinstance(config, str) else Path(config).name if isinstance(config, Path) else "custom"


def _cfg_count_problem(family: Family, cfg: dict) -> str | None:
    """A cfg key holding no positive integer where the family's default config holds one (``n_heads: 0``
    behind a bare ``integer modulo by zero`` from the config class), or None."""
    try:
        default = family.configs[family.default_config]()
    except Exception:
        return None
    for key, value in cfg.items():
        expected = default.get(key)
        positive = isinstance(expected, int) and not isinstance(expected, bool) and expected > 0
        if positive and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"cfg key {key} is {value!r}; it must be a positive integer"
    return None


def _named(e: Exception, counts: Callable[[], str | None]) -> str:
    """The reason a config class gave, or the count field behind it: for a bare arithmetic or type
    error (``integer modulo by zero``, ``'>' not supported between str and int``, also when a
    validator wraps it) the field that holds no positive integer."""
    text = one_line(e)
    bare = isinstance(e, (ArithmeticError, TypeError)) or any(
        w in text for w in ("by zero", "not supported between", "unsupported operand", "must be tuple of ints")
    )
    return rope_problem_of(e) or (counts() if bare else None) or text


def to_reference_config(family: Family, cfg: dict):
    """Our cfg -> the Transformers config, through the config class's own validation. Raises ConfigError."""
    try:
        return family.to_hf(cfg)
    except ParityError:
        raise
    except Exception as e:  # KeyError, TypeError, ValueError, strict-dataclass validation errors
        reason = _named(e, lambda: _cfg_count_problem(family, cfg) or next(iter(count_field_problems(cfg)), None))
        raise ConfigError(f"{family.config_class} rejects the config: {reason}") from None


def config_from_dict(family: Family | Composite, raw: dict):
    """A config.json dict -> the Transformers config object. Raises ConfigError (one line)."""
    try:
        return family.config_cls().from_dict(raw)
    except Exception as e:  # its strict validators raise their own types: all mean bad input
        reason = _named(e, lambda: next(iter(count_field_problems(raw)), None))
        raise ConfigError(f"config.json rejected by {family.config_class}: {reason}") from None


def construct(reference_cls, hf_config) -> Any:
    """``reference_cls(hf_config)`` (under whatever device context the caller set), or ConfigError when
    a config the config class accepted cannot build the model (``head_dim: null`` where the model
    needs a number): one line naming the class, the reason, and the count fields left null."""
    try:
        return reference_cls(hf_config)
    except ParityError:
        raise
    except Exception as e:
        text = text_config_of(hf_config)
        null = [name for name in COUNT_FIELDS if name in vars(text) and vars(text)[name] is None]
        also = f" (null in the config: {', '.join(null)})" if null else ""
        raise ConfigError(
            f"{reference_cls.__name__} cannot be built from this config: {type(e).__name__}: {one_line(e)}{also}"
        ) from None


def validated(family: Family, hf_config, dtype: torch.dtype) -> tuple[dict, ArchFacts]:
    """``(cfg, facts)`` for a Transformers config, or ConfigError naming the first field that makes
    no sense (zero layers, heads not a multiple of KV heads, ...) or that our model cannot honour."""
    problems = count_field_problems(hf_config)
    problems = problems or validate_facts(derive_facts(hf_config))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"{family.name}: {problems[0]}{more}")
    facts = derive_facts(hf_config)
    return _from_hf(family, hf_config, dtype), facts


def _from_hf(family: Family, hf_config, dtype: torch.dtype) -> dict:
    """The family's cfg from a Transformers config; a config its mapping cannot read is a ConfigError."""
    try:
        return family.from_hf(hf_config, dtype)
    except ParityError:
        raise
    except Exception as e:
        raise ConfigError(f"{family.name} cannot read this config: {type(e).__name__}: {one_line(e)}") from None


def _truncate_layers(hf_config, n_layers: int) -> None:
    types = getattr(hf_config, "layer_types", None)
    if types is not None and n_layers > len(types):
        raise ConfigError(f"{n_layers} layers asked for, but the config's layer_types lists {len(types)}")
    hf_config.num_hidden_layers = n_layers
    if types is not None:
        hf_config.layer_types = list(types[:n_layers])  # the first n layers of a config.json


#: bytes a check holds per decoder layer besides its weights: both models' module and parameter
#: objects, their hooks, the layer's nodes and their results (measured on the tiny configs: 320 KiB a
#: layer with json reports, 410 KiB with the HTML one)
LAYER_OBJECTS = 384 * 1024
#: a config deeper than twice this is sized from two shallow copies of itself before any of it is built
SHALLOW = 4


def _parameter_count(reference_cls, hf_config) -> int:
    """Elements of ``reference_cls(hf_config)``'s parameters and persistent buffers (built on the meta device)."""
    with torch.device("meta"):
        model = construct(reference_cls, hf_config)
    buffers = dict(model.named_buffers())
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    shapes += [tuple(buffers[k].shape) for k in model.state_dict() if k in buffers]
    return sum(math.prod(s) for s in shapes)


def _shallow(hf_config, n_layers: int):
    shallow = copy.deepcopy(hf_config)
    target = text_config_of(shallow)
    _truncate_layers(target, n_layers)
    return shallow


def depth_of(hf_config) -> int:
    """Decoder layers of a (text or multimodal) Transformers config; 0 when it does not say."""
    layers = getattr(text_config_of(hf_config), "num_hidden_layers", None)
    return layers if isinstance(layers, int) and not isinstance(layers, bool) else 0


def require_model(
    reference_cls,
    hf_config,
    dtype: torch.dtype,
    what: str,
    weights: bool = True,
    shallow: Callable[[int], object] | None = None,
    layers: int | None = None,
) -> None:
    """Refuse, with the numbers and before any of it is built, a model that cannot fit in memory: its
    weights (``weights``: random ones are made; a checkpoint's are already mapped) and, per decoder
    layer, :data:`LAYER_OBJECTS`. A deep config (``--layers 1000000``) is sized from two shallow
    copies of itself (``shallow(n)``: the config at ``n`` layers; by default ``hf_config`` cut to its
    first ``n``), so refusing it costs a moment, not the hours building it would."""
    layers = depth_of(hf_config) if layers is None else layers
    if layers <= 2 * SHALLOW:
        return  # small: random_weights counts it exactly, on the meta device
    n_params = 0
    if weights:
        make = shallow or (lambda n: _shallow(hf_config, n))
        try:
            small, large = (_parameter_count(reference_cls, make(k)) for k in (SHALLOW, 2 * SHALLOW))
        except Exception:  # a config whose per-layer fields do not truncate: sized when built
            return
        n_params = small + (large - small) * (layers - SHALLOW) // SHALLOW
    objects = layers * LAYER_OBJECTS
    require(
        n_params * torch.finfo(dtype).bits // 8 + objects,
        f"{what} ({n_params / 1e9:.2f}B parameters in {str(dtype).replace('torch.', '')})" if weights else what,
        f"build fewer layers (--layers / n_layers=): besides the weights, its {layers} layers hold about "
        f"{gib(objects)} of modules, hooks and node results",
    )


def resolve_config(family: Family, config, dtype: torch.dtype, overrides: dict):
    """A built-in name, a cfg dict or a config.json path, with overrides -> ``(cfg, hf_config, facts)``.

    ``n_layers`` picks the depth (a built-in's layer pattern follows it; a config.json keeps its first
    N layers); any other override must be an existing cfg key. Raises ConfigError.
    """
    overrides = dict(overrides)
    n_layers = overrides.pop("n_layers", None)
    if n_layers is not None and (isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1):
        raise ConfigError(f"n_layers must be a positive integer, got {n_layers!r}")
    builtin = isinstance(config, str) and config in family.configs
    if builtin:
        if n_layers is not None and n_layers > 2 * SHALLOW:  # sized from shallow copies, before the deep one exists

            def shallow(n: int):
                return to_reference_config(family, {**family.configs[config](n), **overrides, "dtype": dtype})

            require_model(
                family.reference_cls(), None, dtype, f"{family.name} {config}", shallow=shallow, layers=n_layers
            )
        cfg = family.configs[config](n_layers)
    elif isinstance(config, dict):
        cfg = copy.deepcopy(config)
    elif isinstance(config, (str, Path)) and (Path(config).is_file() or str(config).endswith(".json")):
        raw = read_config(config)
        if raw.get("model_type") != family.model_type:
            multimodal = family.composite_for(raw.get("model_type")) is not None
            how = (
                " (a multimodal config: pass its checkpoint folder, or its text_config as a config.json)"
                if multimodal
                else ""
            )
            raise ConfigError(f"{config} has model_type {raw.get('model_type')!r}, expected {family.model_type!r}{how}")
        _refuse_text_config(raw, config)
        from_file = config_from_dict(family, raw)
        problems = count_field_problems(from_file)
        if problems:  # the words of every other path (validated): a cfg dict and its config.json say the same
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ConfigError(f"{family.name}: {problems[0]}{more}")
        cfg = _from_hf(family, from_file, dtype)
    else:
        known = ", ".join(family.configs)
        raise ConfigError(f"unknown {family.name} config {config!r}; built-in configs: {known}, or a config.json path")
    for key, value in overrides.items():
        if key not in cfg:
            raise ConfigError(
                f"unknown cfg key {key!r} for {family.name}; known keys: {', '.join(sorted(k for k in cfg if k != 'dtype'))}"
            )
        cfg[key] = value
    cfg.update(dtype=dtype)  # the compute dtype both models run in
    hf_config = to_reference_config(family, cfg)
    if n_layers is not None and not builtin:
        _truncate_layers(hf_config, n_layers)
    require_model(family.reference_cls(), hf_config, dtype, f"{family.name} {config_name_of(config)}")
    cfg, facts = validated(family, hf_config, dtype)
    return cfg, hf_config, facts


def build_reference(reference_cls, hf_config, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """The Transformers model holding exactly ``state_dict``'s tensors (no copy).

    Built without weight initialisation (its parameters are assigned right away), then tied as
    its config says. Raises LoaderError if the reference rejects a key or lacks one.
    """
    from transformers.initialization import no_init_weights

    name = reference_cls.__name__
    with no_init_weights():
        reference = construct(reference_cls, hf_config)
    try:
        result = reference.load_state_dict(state_dict, strict=False, assign=True)
    except RuntimeError as e:  # size mismatches: the lines after the first name key and shapes
        reasons = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        text = summary(reasons, what="tensors in all") if reasons else one_line(e)
        raise LoaderError(f"{name} rejects the state dict: {text}") from None
    tied_targets = set(tied_weights(reference)) if ties_embeddings(hf_config) else set()
    missing = [k for k in result.missing_keys if k not in tied_targets]
    if missing or result.unexpected_keys:
        raise LoaderError(
            f"{name} rejects the state dict: missing {_keys(missing)}; unexpected {_keys(list(result.unexpected_keys))}"
        )
    if ties_embeddings(hf_config):
        reference.tie_weights()
        _hold_loaded(reference, state_dict)
    return reference.eval()


def _hold_loaded(reference: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Give back to the reference's parameters the state dict's own tensors where tying swapped in equal copies
    (Transformers' ``tie_weights`` rewrites a tied head's ``bias.data``, ERNIE 4.5's): the alignment of a user's
    model follows the checkpoint's tensors by storage."""
    for name, param in reference.named_parameters(remove_duplicate=False):
        loaded = state_dict.get(name)
        if (
            loaded is not None
            and loaded.shape == param.shape
            and loaded.dtype == param.dtype
            and loaded.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
            and torch.equal(loaded, param.detach())
        ):
            param.data = loaded


def ties_embeddings(hf_config) -> bool:
    """Whether the config ties the output head to the embedding; a config without the field (Inkling's text
    config) ties nothing, as Transformers' ``tie_weights`` reads it."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _keys(keys: list[str], n: int = 5) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:n]) + (f", ... ({len(keys)} keys in all)" if len(keys) > n else "")


def _check_tensor_dtypes(state_dict: Mapping[str, torch.Tensor], where: str, config: dict | None = None) -> None:
    """Every checkpoint tensor must be floating point, but for a table the model itself holds as integers
    (DeepSeek V4's token-to-expert hash table ``tid2eid``, read from ``config``'s model on the meta device, by
    its last name: a checkpoint may name its modules otherwise, ``ffn`` for ``mlp``): both models compute in a
    float dtype, and an integer tensor where the model has a float one (a quantized checkpoint, a mis-saved
    norm) would fail deep in a loader with a message about shapes. Raises LoaderError naming the first such
    keys."""
    odd = [k for k, v in state_dict.items() if not v.is_floating_point()]
    if odd and config is not None:
        tables = {t.rsplit(".", 1)[-1] for t in _integer_tables(config)}
        odd = [k for k in odd if k.rsplit(".", 1)[-1] not in tables]
    odd = [f"{k} ({str(state_dict[k].dtype).replace('torch.', '')})" for k in odd]
    if odd:
        raise LoaderError(
            f"{where} holds tensors that are not floating point: {_keys(odd, 3)}; parity loads float32, bfloat16, "
            "float16 or float64 weights (a quantized checkpoint is not supported)"
        )


def _integer_tables(config: dict) -> set[str]:
    """The state dict keys the model of a checkpoint's ``config`` holds in an integer dtype (built on the meta
    device by its causal-LM class); none when it cannot be built (the refusal then names the tensors)."""
    from parity.build.reference import causal_lm_class, config_from_raw

    try:
        hf_config = config_from_raw(config, "config.json")
        with torch.device("meta"):
            model = construct(causal_lm_class(hf_config), hf_config)
    except Exception:  # an unknown or broken config: refused for its tensors, as before
        return set()
    return {k for k, v in model.state_dict().items() if not v.is_floating_point()}


def nonfinite_notes(state_dict: Mapping[str, torch.Tensor], chunk: int = 1 << 24) -> list[str]:
    """One note per checkpoint tensor holding NaN or Inf (first index and count).

    Such a checkpoint is still checked: a NaN that reaches a node is reported there as ``nonfinite``;
    one no token uses (an embedding row, say) changes no node, and this note is how it stays visible.
    """
    notes = []
    for key, tensor in state_dict.items():
        flat = tensor.detach().reshape(-1)
        count, first = 0, None
        for start in range(0, flat.numel(), chunk):  # bounded memory on real checkpoints
            bad = ~torch.isfinite(flat[start : start + chunk])
            n = int(bad.sum())
            if n and first is None:
                first = start + int(bad.nonzero()[0, 0])
            count += n
        if count:
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(tensor.shape)))
            notes.append(
                f"checkpoint tensor {key} holds {count} non-finite value{'s' if count != 1 else ''} (first at index "
                f"{index}); a node that reads one shows it as nonfinite, and the check passes only if none is read"
            )
    return notes


def load_ours(
    family: Family,
    model: nn.Module,
    cfg: dict,
    state_dict: Mapping[str, torch.Tensor],
    composite: Composite | None = None,
) -> dict[str, str]:
    """Our model loaded from the checkpoint-named state dict: the family's loader, else its table.

    From a multimodal checkpoint (``composite``; ``state_dict`` already without the parts outside the
    text model, see :func:`outside_text_model`) the table is read with its ``model.`` keys under the
    text model's prefix, so a missing or misnamed key is named as the checkpoint names it; a loader
    of the family's own gets the keys as a text-only checkpoint names them.
    """
    if composite is None:
        return (
            family.load(model, cfg, state_dict)
            if family.load is not None
            else apply_weight_table(model, state_dict, family.weights)
        )
    prefix = composite.text_prefix

    def as_text(key: str) -> str:
        return "model." + key[len(prefix) :] if key.startswith(prefix) else key

    if family.load is not None:
        by_text = {as_text(k): k for k in state_dict}
        loaded = family.load(model, cfg, {as_text(k): v for k, v in state_dict.items()})
        return {by_text.get(k, k): v for k, v in loaded.items()}
    table = {(prefix + k[len("model.") :] if k.startswith("model.") else k): v for k, v in family.weights.items()}
    return apply_weight_table(model, state_dict, table)


def _refuse_text_config(raw: dict, where) -> None:
    """A text model's config.json that also holds a ``text_config`` (its fields would be read from
    the nested one, silently): ConfigError naming it."""
    if "text_config" in raw:
        raise ConfigError(
            f"{where} has model_type {raw.get('model_type')!r}, a text model, but also a text_config: a multimodal "
            "config has its own model_type (gemma3, gemma4); drop text_config, or give the multimodal checkpoint"
        )


def _refuse_split_tie(hf_config, composite: Composite) -> None:
    """A multimodal config whose two ``tie_word_embeddings`` disagree: the multimodal model ties its
    head by its own, a text model by its text_config's, so the two sides would differ. ConfigError."""
    outer, text = ties_embeddings(hf_config), ties_embeddings(text_config_of(hf_config))
    if outer != text:
        raise ConfigError(
            f"config.json has tie_word_embeddings={outer} but text_config.tie_word_embeddings={text}: "
            f"{composite.reference_class} ties its head by the first, the text model by the second; make them agree"
        )


def text_config_of(hf_config):
    """The text config of a multimodal config (its ``text_config``), else the config itself."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def outside_text_model(expected, text_prefix: str, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Checkpoint key -> the module it belongs to (``model.vision_tower``, ``model.embed_audio``), for every
    key of ``state_dict`` that the multimodal reference holds (``expected``: its state dict's keys) outside
    its text model (``text_prefix``: ``model.language_model.``) and head: what a text-only check leaves
    unused by design. Keys the reference does not hold are not among them (our loader names those)."""
    parent = text_prefix.rstrip(".").rpartition(".")[0]
    lead = parent + "." if parent else ""

    def part(key: str) -> str:
        rest = key[len(lead) :] if key.startswith(lead) else key
        return lead + rest.partition(".")[0]

    return {
        k: part(k)
        for k in state_dict
        if k in expected and not k.startswith(text_prefix) and not k.startswith("lm_head.")
    }


def meta_keys(reference_cls, hf_config) -> set[str]:
    """The state dict keys of ``reference_cls(hf_config)``, built on the meta device."""
    with torch.device("meta"):
        return set(construct(reference_cls, hf_config).state_dict())


def _check_dtype(dtype) -> None:
    if dtype not in DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise ConfigError(f"dtype must be a floating-point torch dtype ({names}), got {dtype!r}")


@dataclass
class Reference:
    """The reference side of a pair, built alone: the Transformers model holding ``state_dict``'s
    tensors, its facts, and where it came from (``cfg``: the family's cfg, when built from one)."""

    model: nn.Module | None
    hf_config: PretrainedConfig
    facts: ArchFacts
    state_dict: dict
    config_name: str
    cfg: dict | None = None
    checkpoint: str | None = None
    checkpoint_hash: str | None = None
    conversions: list = field(default_factory=list)
    #: a multimodal checkpoint's model (``...ForConditionalGeneration``), when the checkpoint is one
    composite: Composite | None = None
    #: checkpoint key -> module, for the keys outside the text model (a multimodal checkpoint's towers)
    by_design: dict = field(default_factory=dict)
    #: what the checkpoint's reader says (a GGUF's float32 config values), shown as the pair's notes
    notes: list = field(default_factory=list)
    #: the checkpoint's tensors as its files name and lay them out, read again on demand, when the
    #: reference holds them otherwise (Transformers 5 fuses Mixtral's per-expert w1/w2/w3 on load):
    #: a user's loader written against the files asks for those names
    file_tensors: Callable[[], dict] | None = None
    #: key -> the tensor as the checkpoint holds it, for the tensors the reference's own forward rewrote in place
    #: when it first ran (RWKV's rescaled output weights: :mod:`parity.build.settle`)
    rewritten: dict = field(default_factory=dict)
    #: a user's build edits the tensors it is given in place: it is given copies (``check_model``'s builds)
    build_on_copies: bool = False

    @property
    def tied_keys(self) -> dict[str, str]:
        return tied_weights(self.model) if ties_embeddings(self.hf_config) else {}


def tied_weights(model) -> dict[str, str]:
    """A Transformers model's ties, target key -> source key: every tie its submodules declare, expanded
    (``all_tied_weights_keys``: Zamba2's shared blocks tied by prefix, each of their weights), else the model's own
    ``_tied_weights_keys`` (the head tied to the embedding)."""
    expanded = getattr(model, "all_tied_weights_keys", None)
    return dict(expanded or getattr(model, "_tied_weights_keys", None) or {})


def random_weights(reference_cls, hf_config, seed: int, dtype: torch.dtype, what: str) -> dict[str, torch.Tensor]:
    """Seeded random weights in checkpoint naming for ``reference_cls(hf_config)`` (shapes read on
    the meta device; the memory guard runs first): every parameter, then every persistent buffer
    (a checkpoint carries those too, e.g. Gemma 4's ``layer_scalar``)."""
    require_model(reference_cls, hf_config, dtype, what)  # a deep config: before it is built, even on meta
    with torch.device("meta"):
        model = construct(reference_cls, hf_config)
        shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
        buffers = dict(model.named_buffers())
        shapes.update({k: tuple(buffers[k].shape) for k in model.state_dict() if k in buffers})
    n_params = sum(math.prod(s) for s in shapes.values())
    require(
        n_params * torch.finfo(dtype).bits // 8,
        f"{what} ({n_params / 1e9:.2f}B parameters in {str(dtype).replace('torch.', '')})",
        "build fewer layers (--layers / n_layers=)",
    )
    return probe_weights(shapes, seed, dtype)


def model_naming(
    reference_cls, hf_config, state_dict: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state_dict`` in the reference model's own naming and layout, and one line per conversion.

    A checkpoint may be stored in another layout than the model holds its weights in: Transformers 5
    saves MoE experts one module per expert (``mlp.experts.3.gate_proj.weight``, the format of the
    released checkpoints) and fuses them into 3-D parameters when it loads them
    (``mlp.experts.gate_up_proj``); ``from_pretrained`` applies the model's checkpoint conversion
    mapping. This applies that same mapping (Transformers' own ``WeightConverter``/``WeightRenaming``
    list, its operations and key order), so both models, our loader and loader coverage see what a
    Transformers user's model holds. Renamed tensors keep their storage; merged ones are new (the
    per-expert originals are not kept). A model without a conversion mapping is returned unchanged.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # a Transformers without conversion mappings loads checkpoints as they are
        return state_dict, []
    with torch.device("meta"):
        model = construct(reference_cls, hf_config)
    mapping = get_model_conversion_mapping(model)
    if not mapping:
        return state_dict, []
    meta = model.state_dict()
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, tuple[WeightConverter, list[str]]] = {}
    moved: list[tuple[str, str]] = []
    for key in sorted(state_dict, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if renamed not in meta and key in meta:
            renamed, pattern = key, None
        if pattern is None:
            out[renamed] = state_dict[key]
            if renamed != key:
                moved.append((key, renamed))
            continue
        converter, sources = pending.setdefault(renamed, (copy.deepcopy(by_pattern[pattern]), []))  # one per target
        # transformers takes a loaded tensor here too (its synchronous path), though it hints Future only
        converter.add_tensor(renamed, key, pattern, state_dict[key])  # type: ignore[arg-type]
        sources.append(key)
    notes = []
    if moved:  # e.g. a Gemma 3 multimodal file's language_model.model.* read as model.language_model.*
        (first, to), n = moved[0], len(moved)
        notes.append(
            f"{first} -> {to}{f' and {n - 1} more keys' if n > 1 else ''}: renamed as from_pretrained renames "
            "them (Transformers' checkpoint conversion)"
        )
    for target, (converter, sources) in pending.items():
        converted = converter.convert(target, model=model, config=hf_config)
        for name, value in converted.items():
            out[name] = value[0] if isinstance(value, list) else value
        names = list(converted)
        shown = f"{sources[0]} .. {sources[-1]}" if len(sources) > 1 else sources[0]
        notes.append(
            f"{shown} ({len(sources)} tensors): merged into {', '.join(names)} (Transformers' checkpoint conversion)"
        )
    return out, notes


def read_weights(checkpoint, dtype: torch.dtype, model_type: str | tuple[str, ...] | None):
    """``(checkpoint, state dict in dtype, conversions)`` of a safetensors checkpoint directory, or of a
    GGUF file (or a folder holding one, :mod:`parity.build.gguf`: dequantized to ``dtype`` by Transformers)."""
    from parity.build.gguf import gguf_file, read_gguf

    gguf = gguf_file(checkpoint)
    if gguf is not None:
        types = (model_type,) if isinstance(model_type, str) else tuple(model_type or ())
        ckpt, lines = read_gguf(gguf, dtype, types)
        if types and ckpt.config.get("model_type") not in types:
            raise CheckpointError(
                f"{gguf} loads as model_type {ckpt.config.get('model_type')!r}, expected {' or '.join(map(repr, types))}"
            )
        return ckpt, ckpt.state_dict, lines
    ckpt = read_checkpoint(checkpoint, model_type=model_type)
    _check_tensor_dtypes(ckpt.state_dict, f"checkpoint {checkpoint}", ckpt.config)
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt.state_dict.items()}
    conversions = [
        f"{k}: {str(v.dtype).replace('torch.', '')} -> {str(dtype).replace('torch.', '')}"
        for k, v in ckpt.state_dict.items()
        if v.is_floating_point() and v.dtype != dtype
    ]
    return ckpt, state_dict, conversions


def as_reference_keys(reference_cls, hf_config, state_dict: dict) -> tuple[dict, list[str]]:
    """The checkpoint's tensors under the names the reference loads them by, as ``from_pretrained``
    reads a checkpoint: keys of a base-model checkpoint get the base-model prefix (GPT-2's released
    files say ``h.0.attn.c_attn.weight`` for ``transformer.h.0.attn.c_attn.weight``), and keys the
    reference declares ignorable (``_keys_to_ignore_on_load_unexpected``: GPT-2's old ``attn.bias``
    mask buffers) are left out. Same tensors, no copy. Returns the dict and one line per change."""
    with torch.device("meta"):
        expected = set(construct(reference_cls, hf_config).state_dict())
    prefix = getattr(reference_cls, "base_model_prefix", "") or ""
    ignorable = [re.compile(p) for p in getattr(reference_cls, "_keys_to_ignore_on_load_unexpected", None) or []]
    out, prefixed, ignored = {}, [], []
    for key, tensor in state_dict.items():
        if key not in expected and prefix and f"{prefix}.{key}" in expected:
            prefixed.append(key)
            key = f"{prefix}.{key}"
        elif key not in expected and any(p.search(key) for p in ignorable):
            ignored.append(key)
            continue
        out[key] = tensor
    lines = []
    if prefixed:
        lines.append(
            f"{len(prefixed)} keys without the base-model prefix ({prefixed[0]}, ...): read as {prefix}.<key>, "
            "as from_pretrained reads them"
        )
    if ignored:
        lines.append(f"{len(ignored)} keys the reference ignores on load ({_keys(ignored, 3)}): left out")
    return out, lines


def make_reference(
    family: Family,
    config=None,
    checkpoint: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides,
) -> Reference:
    """The reference of a family's pair, alone (see :func:`build_pair` for the arguments and errors)."""
    return _with_model(family, _source(family, config, checkpoint, dtype, seed, overrides))


def _with_model(family: Family, ref: Reference) -> Reference:
    """``ref`` (still without its model) with the Transformers model built over its state dict."""
    reference_cls = ref.composite.reference_cls() if ref.composite is not None else family.reference_cls()
    ref.model = build_reference(reference_cls, ref.hf_config, ref.state_dict)
    ref.facts = derive_facts(ref.model.config, ref.model)
    return ref


def _source(family: Family, config, checkpoint, dtype, seed, overrides) -> Reference:
    """Config, weights and facts of a family's reference, before its model is built."""
    require_transformers()
    _check_dtype(dtype)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be an integer in [0, 2^63), got {seed!r}")
    ckpt, composite, by_design = None, None, {}
    if checkpoint is not None:
        if config is not None or overrides:
            raise ConfigError("a checkpoint brings its own config.json; do not pass a config or overrides with it")
        types = (family.model_type,) + ((family.composite.model_type,) if family.composite is not None else ())
        ckpt, state_dict, conversions = read_weights(checkpoint, dtype, types)
        composite = family.composite_for(ckpt.config.get("model_type"))
        if composite is None:
            _refuse_text_config(ckpt.config, Path(checkpoint) / "config.json")
        reference_cls = composite.reference_cls() if composite is not None else family.reference_cls()
        hf_config = config_from_dict(composite or family, ckpt.config)
        require_model(reference_cls, hf_config, dtype, f"checkpoint {checkpoint}", weights=False)
        if composite is not None:
            _refuse_split_tie(hf_config, composite)
        cfg, facts = validated(family, text_config_of(hf_config), dtype)
        state_dict, renamed = as_reference_keys(reference_cls, hf_config, state_dict)
        conversions = renamed + conversions
        state_dict, merged = model_naming(reference_cls, hf_config, state_dict)
        conversions += merged
        if composite is not None:
            by_design = outside_text_model(meta_keys(reference_cls, hf_config), composite.text_prefix, state_dict)
        config_name = str(Path(checkpoint))
    else:
        config = family.default_config if config is None else config
        cfg, hf_config, facts = resolve_config(family, config, dtype, overrides)
        config_name = config_name_of(config)
        state_dict = random_weights(family.reference_cls(), hf_config, seed, dtype, f"{family.name} {config_name}")
        conversions = []
    return Reference(
        model=None,
        hf_config=hf_config,
        facts=facts,
        state_dict=state_dict,
        config_name=config_name,
        cfg=cfg,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        checkpoint_hash=ckpt.content_hash() if ckpt is not None else None,
        conversions=conversions,
        composite=composite,
        by_design=by_design,
        notes=list(ckpt.notes) if ckpt is not None else [],
    )


def build_pair(
    family: Family,
    config=None,
    checkpoint: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    reference_changes: dict | None = None,
    device=None,
    device_map: str | None = None,
    **overrides,
) -> Pair:
    """Build ours and the reference with identical, shared weights.

    From a config (built-in name, cfg dict or config.json path; default the family's default):
    seeded random weights in checkpoint naming, created once. From ``checkpoint`` (a
    Transformers-format directory): both models are built from its config.json and loaded from its
    safetensors files; ``config`` and ``overrides`` must then be absent. ``dtype`` is the compute
    dtype of both. ``reference_changes``: ``{cfg key: value}`` (dotted keys reach into dict values)
    applied to the reference's config only, ours keeping the config's values (what the sensitivity
    audit does: would parity see a port that got this field wrong?).

    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``) or ``device_map="auto"`` (through
    accelerate, spread over the GPUs): where the weights live and both forward passes run; the
    weights move there before either model is built, so they still exist once.

    Raises:
        ConfigError, CheckpointError, LoaderError: one line naming the key, file or field.
    """
    placement = Placement.of(device, device_map)
    ref = _source(family, config, checkpoint, dtype, seed, overrides)
    cfg = ref.cfg
    assert cfg is not None  # _source always sets it (validated / resolve_config)
    if reference_changes:
        from parity.model.fields import set_value

        if checkpoint is not None:
            raise ConfigError("reference_changes go with a config, not with a checkpoint")
        changed = cfg
        for key, value in reference_changes.items():
            changed = set_value(changed, key, value)
        ref = _source(family, changed, None, dtype, seed, {})
        ref.config_name = config_name_of(family.default_config if config is None else config)
    notes = list(family.notes(cfg)) if family.notes is not None else []
    if checkpoint is not None:  # after the cast: a float16 cast can overflow to inf; only what the nodes can read
        notes += ref.notes + nonfinite_notes({k: v for k, v in ref.state_dict.items() if k not in ref.by_design})
    plan = None
    if not placement.is_cpu:
        reference_cls = ref.composite.reference_cls() if ref.composite is not None else family.reference_cls()
        plan = placement.plan(reference_cls, ref.hf_config, dtype)
        ref.state_dict = placement.place(ref.state_dict, plan)
    try:
        with torch.device("meta"):
            ours = family.model_class(cfg)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"{getattr(family.model_class, '__name__', 'our model')} rejects the config: {one_line(e)}"
        ) from None
    text_weights = {k: v for k, v in ref.state_dict.items() if k not in ref.by_design}
    loaded = load_ours(family, ours, cfg, text_weights, ref.composite)  # first: its errors name the checkpoint key
    ref = _with_model(family, ref)
    assert ref.model is not None  # _with_model built it
    if not placement.is_cpu:
        ours, ref.model = placement.dispatch(ours), placement.dispatch(ref.model, plan)
    return Pair(
        ours=ours.eval(),
        reference=ref.model,
        nodes=family.node_specs(ref.facts),
        facts=ref.facts,
        dtype=dtype,
        source=PairSource(
            family=family.name,
            config_name=ref.config_name,
            cfg=cfg,
            reference_cfg=family.from_hf(text_config_of(ref.model.config), dtype),
            seed=seed,
            checkpoint=ref.checkpoint,
            checkpoint_hash=ref.checkpoint_hash,
            device=placement.label,
            **({"probe": f"checkpoint weights ({ref.checkpoint})"} if ref.checkpoint else {}),
        ),
        loading=Loading(
            state_dict=ref.state_dict,
            loaded_keys=loaded,
            conversions=ref.conversions,
            tied_keys=ref.tied_keys,
            by_design=ref.by_design,
        ),
        default_seq_len=default_seq_len(ref.facts),
        notes=notes,
        exact=dtype in family.exact_dtypes,
    )
