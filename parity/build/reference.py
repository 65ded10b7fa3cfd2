"""The reference of a model that is not a family's: ``family[:config]``, a checkpoint folder, a
config.json, a Transformers config or model, built as :func:`parity.check_model` and golden traces
need it (random probe weights unless a checkpoint or a model is given)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
from torch import nn

from parity.build.builder import (
    Reference,
    build_reference,
    make_reference,
    model_naming,
    outside_text_model,
    random_weights,
    read_weights,
    require_model,
    text_config_of,
)
from parity.model.derive import count_field_problems, derive_facts, rope_problem_of, validate_facts
from parity.util.errors import CheckpointError, ConfigError, ParityError
from parity.util.text import one_line
from parity.util.version import require_transformers


def causal_lm_class(hf_config):
    """Transformers' causal LM class for ``hf_config``: the auto mapping's, else the ``<Name>ForCausalLM`` class
    the config's ``architectures`` names, else one of its model type's package, whose config class is this config's
    (Mistral 4's ``Mistral4ForCausalLM`` is in no causal LM mapping). Never remote code. Raises ConfigError when
    there is none."""
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        pass
    # the names the config lists, then the causal LM classes of the model type's own package (a config made
    # without architectures)
    named = [
        getattr(transformers, n, None) for n in getattr(hf_config, "architectures", None) or () if isinstance(n, str)
    ]
    try:
        package = importlib.import_module(f"transformers.models.{str(hf_config.model_type).replace('-', '_')}")
    except ImportError:
        package = None
    own = [getattr(package, n) for n in sorted(dir(package))] if package is not None else []
    # a composite model with no text-only causal LM runs text through its ...ForConditionalGeneration (GLM-5-Next)
    for suffix in ("ForCausalLM", "ForConditionalGeneration"):
        for cls in (*named, *own):
            if (
                isinstance(cls, type)
                and cls.__name__.endswith(suffix)
                and getattr(cls, "config_class", None) is type(hf_config)
            ):
                return cls
    raise ConfigError(f"no Transformers causal LM class for model_type {hf_config.model_type!r}")


#: how Transformers writes a float JSON cannot hold (``save_pretrained``'s ``{"__float__": "Infinity"}``)
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decoded_floats(value):
    """``value`` (parsed config.json) with Transformers' tagged floats (``{"__float__": "Infinity"}``, as
    ``save_pretrained`` writes Nemotron-H's ``time_step_limit``) read back as floats, at any depth."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[value["__float__"]]
        return {k: decoded_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decoded_floats(v) for v in value]
    return value


def config_from_raw(raw: dict, where: str):
    from transformers import AutoConfig

    raw = decoded_floats(raw)

    model_type = raw.get("model_type")
    if not model_type:
        raise ConfigError(f"{where} has no model_type")
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        import transformers

        remote = (
            "; its auto_map names remote code, which parity never runs (a reference must be an architecture "
            "Transformers implements)"
            if raw.get("auto_map")
            else ""
        )
        raise ConfigError(
            f"{where} has model_type {model_type!r}, which Transformers {transformers.__version__} does not "
            f"implement{remote}"
        )
    try:
        return AutoConfig.for_model(**raw)
    except Exception as e:  # an unknown model_type or a field its validators reject
        text = one_line(e)
        bare = isinstance(e, (ArithmeticError, TypeError)) or any(
            w in text for w in ("by zero", "not supported between", "unsupported operand", "must be tuple of ints")
        )
        counted = count_field_problems(raw) if bare else []
        reason = rope_problem_of(e) or next(iter(counted), None) or text
        raise ConfigError(f"{where} rejected by Transformers ({model_type}): {reason}") from None


def validated_facts(hf_config, where: str):
    problems = count_field_problems(hf_config)
    if problems:
        raise ConfigError(f"{where}: {problems[0]}")
    facts = derive_facts(hf_config)
    problems = validate_facts(facts)
    if problems:
        raise ConfigError(f"{where}: {problems[0]}")
    return facts


def mark_by_design(ref: Reference) -> Reference:
    """``ref`` with its multimodal model's tensors outside the text model marked as unused by design
    (``build`` gets them all, with the whole config: a text model of yours need not hold them)."""
    if ref.model is not None and text_config_of(ref.hf_config) is not ref.hf_config:
        ref.by_design = outside_text_model(set(ref.model.state_dict()), ref.facts.text_model + ".", ref.state_dict)
    return ref


def unread_rows(model: nn.Module) -> dict[str, range]:
    """Rows (over the leading axes) of the reference's stacked expert weights its forward never reads: the
    ``gate_up_proj`` blocks of experts past those that have a ``down_proj`` (LongCat-Flash stores every expert's
    block, its zero-compute identity experts' too, and computes only the routed ones)."""
    out = {}
    for path, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)) or gate_up.dim() != 3:
            continue
        if down.dim() == 3 and down.shape[0] < gate_up.shape[0]:
            per_expert = gate_up.shape[1]
            out[f"{path}.gate_up_proj"] = range(down.shape[0] * per_expert, gate_up.shape[0] * per_expert)
    return out


def _looks_like_path(text: str) -> bool:
    """A reference that is a path, not ``family[:config]``: it has a folder separator, starts with
    ``.`` or ``~``, or names a .json file (a missing folder is then reported missing, not as an
    unknown family)."""
    return "/" in text or os.sep in text or text.startswith((".", "~")) or text.endswith(".json")


def resolve_reference(reference, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Reference, str]:
    """``(Reference, family name)`` for ``reference``: ``"family[:config]"`` (a registered family's
    reference with parity's random weights), a checkpoint directory, a config.json path (random
    weights), a Transformers ``PretrainedConfig`` (random weights) or ``PreTrainedModel`` (used as it
    is, in its own dtype). A multimodal one (Gemma 3/4 ``...ForConditionalGeneration``) is checked as
    its text model: its other tensors are unused by design. Raises ParityError (ConfigError,
    CheckpointError) naming the problem."""
    ref, family = _resolve_reference(reference, dtype, seed)
    return mark_by_design(ref), family


def _resolve_reference(reference, dtype: torch.dtype, seed: int) -> tuple[Reference, str]:
    from transformers import PretrainedConfig, PreTrainedModel

    from parity.model.registry import get_family

    require_transformers()

    if isinstance(reference, PreTrainedModel):
        model = reference.eval()
        facts = validated_facts(model.config, type(model).__name__)
        state_dict = dict(model.state_dict())
        return Reference(
            model, model.config, derive_facts(model.config, model), state_dict, type(model).__name__
        ), facts.model_type
    if isinstance(reference, PretrainedConfig):
        hf_config = reference
        where = f"{type(reference).__name__}"
    elif isinstance(reference, (str, Path)) and (Path(reference).is_dir() or str(reference).lower().endswith(".gguf")):
        ckpt, state_dict, conversions = read_weights(reference, dtype, None)
        hf_config = config_from_raw(ckpt.config, str(Path(reference) / "config.json"))
        require_model(causal_lm_class(hf_config), hf_config, dtype, f"checkpoint {reference}", weights=False)
        validated_facts(hf_config, str(reference))
        file_keys = set(state_dict)
        state_dict, merged = model_naming(causal_lm_class(hf_config), hf_config, state_dict)
        conversions = conversions + merged
        renamed = file_keys != set(state_dict)
        model = build_reference(causal_lm_class(hf_config), hf_config, state_dict)
        ref = Reference(
            model,
            hf_config,
            derive_facts(model.config, model),
            state_dict,
            str(reference),
            checkpoint=str(reference),
            checkpoint_hash=ckpt.content_hash(),
            conversions=conversions,
            file_tensors=(lambda: read_weights(reference, dtype, None)[1]) if renamed else None,
        )
        return ref, hf_config.model_type
    elif isinstance(reference, (str, Path)) and (Path(reference).is_file() or str(reference).endswith(".json")):
        from parity.build.checkpoint import read_config

        hf_config = config_from_raw(read_config(reference), str(reference))
        where = str(reference)
    elif isinstance(reference, (str, Path)) and _looks_like_path(str(reference)):
        from parity.build.checkpoint import unreachable

        raise CheckpointError(
            unreachable(Path(reference), "reference")
            or f"reference {reference} is neither a checkpoint folder nor a config.json"
        )
    elif isinstance(reference, str):
        name, _, config = reference.partition(":")
        family = get_family(name)
        return make_reference(family, config or None, dtype=dtype, seed=seed), family.name
    else:
        raise ParityError(
            f"reference must be 'family[:config]', a checkpoint folder, a config.json, a PretrainedConfig or a "
            f"PreTrainedModel, got {type(reference).__name__}"
        )
    validated_facts(hf_config, where)
    cls = causal_lm_class(hf_config)
    state_dict = random_weights(cls, hf_config, seed, dtype, f"{hf_config.model_type} reference")
    model = build_reference(cls, hf_config, state_dict)
    return Reference(
        model, hf_config, derive_facts(model.config, model), state_dict, Path(str(where)).name
    ), hf_config.model_type
