"""``parity.check_model``: check a model you wrote yourself against a Transformers reference.

    res = parity.check_model(ours=build, reference="olmo3:yarn")

parity builds (or loads) the reference, hands its state dict and Transformers config to your
``build(state_dict, hf_config) -> nn.Module`` (a loader that assigns or copies, your names, your
layout), traces every reference tensor into your model (:mod:`parity.coverage`), aligns your modules
to the reference's nodes by those weights (:mod:`parity.align`), and runs :func:`parity.check`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .align import Aligned, align
from .build import (
    Reference,
    build_reference,
    default_seq_len,
    make_reference,
    model_naming,
    one_line,
    outside_text_model,
    random_weights,
    read_weights,
    text_config_of,
)
from .check import check
from .coverage import loader_coverage
from .devices import Placement
from .errors import ConfigError, ParityError
from .facts import derive_facts, rope_problem_of, validate_facts
from .nodes import reference_nodes
from .pair import Pair
from .result import CheckResult


def _causal_lm_class(hf_config):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        raise ConfigError(f"no Transformers causal LM class for model_type {hf_config.model_type!r}") from None


def _config_from_dict(raw: dict, where: str):
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    if not model_type:
        raise ConfigError(f"{where} has no model_type")
    try:
        return AutoConfig.for_model(**raw)
    except Exception as e:  # an unknown model_type or a field its validators reject
        raise ConfigError(f"{where} rejected by Transformers ({model_type}): {rope_problem_of(e) or one_line(e)}") from None


def _validated(hf_config, where: str):
    facts = derive_facts(hf_config)
    problems = validate_facts(facts)
    if problems:
        raise ConfigError(f"{where}: {problems[0]}")
    return facts


def _by_design(ref: Reference) -> Reference:
    """``ref`` with its multimodal model's tensors outside the text model marked as unused by design
    (``build`` gets them all, with the whole config: a text model of yours need not hold them)."""
    if ref.model is not None and text_config_of(ref.hf_config) is not ref.hf_config:
        ref.by_design = outside_text_model(set(ref.model.state_dict()), ref.facts.text_model + ".", ref.state_dict)
    return ref


def resolve_reference(reference, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Reference, str]:
    """``(Reference, family name)`` for ``reference``: ``"family[:config]"`` (a registered family's
    reference with parity's random weights), a checkpoint directory, a config.json path (random
    weights), a Transformers ``PretrainedConfig`` (random weights) or ``PreTrainedModel`` (used as it
    is, in its own dtype). A multimodal one (Gemma 3/4 ``...ForConditionalGeneration``) is checked as
    its text model: its other tensors are unused by design. Raises ParityError (ConfigError,
    CheckpointError) naming the problem."""
    ref, family = _resolve_reference(reference, dtype, seed)
    return _by_design(ref), family


def _resolve_reference(reference, dtype: torch.dtype, seed: int) -> tuple[Reference, str]:
    from transformers import PretrainedConfig, PreTrainedModel

    from .registry import get_family

    if isinstance(reference, PreTrainedModel):
        model = reference.eval()
        facts = _validated(model.config, type(model).__name__)
        state_dict = dict(model.state_dict())
        return Reference(model, model.config, derive_facts(model.config, model), state_dict, type(model).__name__), facts.model_type
    if isinstance(reference, PretrainedConfig):
        hf_config = reference
        where = f"{type(reference).__name__}"
    elif isinstance(reference, (str, Path)) and Path(reference).is_dir():
        ckpt, state_dict, conversions = read_weights(reference, dtype, None)
        hf_config = _config_from_dict(ckpt.config, str(Path(reference) / "config.json"))
        _validated(hf_config, str(reference))
        state_dict, merged = model_naming(_causal_lm_class(hf_config), hf_config, state_dict)
        conversions = conversions + merged
        model = build_reference(_causal_lm_class(hf_config), hf_config, state_dict)
        ref = Reference(model, hf_config, derive_facts(model.config, model), state_dict, str(reference),
                        checkpoint=str(reference), checkpoint_hash=ckpt.content_hash(), conversions=conversions)
        return ref, hf_config.model_type
    elif isinstance(reference, (str, Path)) and (Path(reference).is_file() or str(reference).endswith(".json")):
        from .checkpoint import read_config

        hf_config = _config_from_dict(read_config(reference), str(reference))
        where = str(reference)
    elif isinstance(reference, str):
        name, _, config = reference.partition(":")
        family = get_family(name)
        return make_reference(family, config or None, dtype=dtype, seed=seed), family.name
    else:
        raise ParityError(
            f"reference must be 'family[:config]', a checkpoint folder, a config.json, a PretrainedConfig or a "
            f"PreTrainedModel, got {type(reference).__name__}"
        )
    _validated(hf_config, where)
    cls = _causal_lm_class(hf_config)
    state_dict = random_weights(cls, hf_config, seed, dtype, f"{hf_config.model_type} reference")
    model = build_reference(cls, hf_config, state_dict)
    return Reference(model, hf_config, derive_facts(model.config, model), state_dict, Path(str(where)).name), hf_config.model_type


def load_callable(spec: str) -> Callable:
    """``"package.module:build"`` or ``"path/to/file.py:build"`` -> the callable. Raises ParityError."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ParityError(f"--ours {spec!r} must be module:function or path/to/file.py:function")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).expanduser()
            if not path.is_file():
                raise ParityError(f"--ours: {path} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules.setdefault(path.stem, module)
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")  # the folder it runs in, as `python -c` would
            module = importlib.import_module(target)
    except ParityError:
        raise
    except Exception as e:  # ImportError, SyntaxError, anything the module raises on import
        raise ParityError(f"--ours: cannot import {target}: {type(e).__name__}: {one_line(e)}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ParityError(f"--ours: {target} has no attribute {attr!r}")
    return fn


def build_ours(ours, ref: Reference) -> nn.Module:
    """Call the user's ``build(state_dict, hf_config)`` (or take the module as it is). Raises
    ParityError when it raises, returns something else than an nn.Module, or leaves weights on the
    meta device."""
    if isinstance(ours, nn.Module):
        model = ours
    elif callable(ours):
        name = getattr(ours, "__qualname__", repr(ours))
        try:
            model = ours(ref.state_dict, ref.hf_config)
        except Exception as e:
            raise ParityError(f"build {name}(state_dict, hf_config) raised {type(e).__name__}: {one_line(e)}") from None
        if not isinstance(model, nn.Module):
            raise ParityError(f"build {name}(state_dict, hf_config) returned {type(model).__name__}, not a torch.nn.Module")
    else:
        raise ParityError(f"ours must be a build(state_dict, hf_config) callable or an nn.Module, got {type(ours).__name__}")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ParityError(f"your model still has {len(meta)} parameter(s) on the meta device ({', '.join(meta[:3])}): load them")
    return model.eval()


def build_user_pair(ours, reference="olmo3", *, dtype: torch.dtype = torch.float32, seed: int = 0,
                    node_map: dict[str, str] | None = None, cache_protocol=None, device=None,
                    device_map: str | None = None) -> Pair:
    """The Pair of a user's model and the reference, nodes aligned by shared weights. Raises
    ParityError for bad input (see :func:`check_model`)."""
    placement = Placement.of(device, device_map)
    ref, family = resolve_reference(reference, dtype, seed)
    if not placement.is_cpu:  # the reference on its device(s) first; build() then receives those tensors
        ref.model = placement.dispatch(ref.model, placement.plan(type(ref.model), ref.hf_config, dtype))
        on_device = ref.model.state_dict()
        ref.state_dict = {k: on_device.get(k, v) for k, v in ref.state_dict.items()}
    model = build_ours(ours, ref)
    if not placement.is_cpu:
        model = placement.dispatch(model)
    coverage = loader_coverage(model, ref.state_dict, ref.tied_keys, ref.conversions, by_design=ref.by_design)
    if coverage.unused:
        shown = ", ".join(coverage.unused[:4]) + (f", ... ({len(coverage.unused)} in all)" if len(coverage.unused) > 4 else "")
        raise ParityError(f"your model holds no copy of reference tensor(s) {shown}: build() left them unused")
    nodes, _ = reference_nodes(ref.model, ref.facts)
    probe = Pair(ours=model, reference=ref.model, nodes=nodes, facts=ref.facts, family=family, config_name=ref.config_name)
    specs, rows = align(ref.model, model, probe.nodes, coverage, ref.state_dict, ref.facts, node_map)
    if not any(r.ours is not None and not r.ours.startswith("tap:") for r in rows):
        reasons = "; ".join(f"{r.node}: {r.detail}" for r in rows[:3])
        raise ParityError(f"no node of the reference could be aligned to your model ({reasons}, ...)")
    return Pair(
        ours=model,
        reference=ref.model,
        nodes=specs,
        facts=ref.facts,
        family=family,
        config_name=ref.config_name,
        cfg={},
        dtype=dtype,
        seed=seed,
        checkpoint=ref.checkpoint,
        checkpoint_hash=ref.checkpoint_hash,
        default_seq_len=default_seq_len(ref.facts),
        state_dict=ref.state_dict,
        conversions=ref.conversions,
        tied_keys=ref.tied_keys,
        by_design=ref.by_design,
        alignment=rows,
        coverage=coverage,
        cache_protocol=cache_protocol,
        device=placement.label,
        **({"probe": f"the weights of {ref.config_name}"} if ref.checkpoint or isinstance(reference, torch.nn.Module) else {}),
    )


def check_model(
    ours,
    reference="olmo3",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    node_map: dict[str, str] | None = None,
    cache_protocol=None,
    device=None,
    device_map: str | None = None,
    **check_kwargs,
) -> CheckResult:
    """Check your own model against a Transformers reference, node by node.

    ``ours``: ``build(state_dict, hf_config) -> nn.Module`` (assigning or copying the reference's
    tensors, in any naming and layout: fused ``qkv``, Conv1D-style transposes), or an nn.Module that
    already holds the weights. ``reference``: ``"family[:config]"`` (e.g. ``"olmo3:yarn"``: a
    registered family's reference with parity's random weights), a checkpoint folder, a config.json,
    a ``PretrainedConfig`` or a ``PreTrainedModel``. ``node_map``: ``{reference node or glob: your
    module path}`` overrides of the automatic alignment. ``check_kwargs``: every option of
    :func:`parity.check` (``seq_len``, ``batch_size``, ``mode``, ``atol``, ``exact``, ``decode``...).
    ``cache_protocol``: how to run your model with its KV cache for ``decode=`` checks when its API is
    not ``new_cache()`` / ``forward(..., cache=)`` (a :class:`parity.decode.CacheProtocol`).
    ``device`` / ``device_map``: where both models run (see :func:`parity.build.build_pair`);
    ``build`` receives the reference's tensors already there.

    Functional nodes (after RoPE, scores, probabilities, context) need ``parity.tap(tensor, name)``
    in your forward; a node without a tap is ``untapped``: shown and counted, never a pass or a
    failure. ``result.alignment`` says how each reference node was found in your model.

    Raises:
        ParityError: ``build`` raised or returned something else than an nn.Module; your model
            leaves a reference tensor unused or keeps a parameter on the meta device; nothing could
            be aligned; a bad reference or bad check arguments (see :func:`parity.check`).
    """
    pair = build_user_pair(ours, reference, dtype=dtype, seed=seed, node_map=node_map, cache_protocol=cache_protocol,
                           device=device, device_map=device_map)
    return check(pair, **check_kwargs)


__all__ = ["Aligned", "build_user_pair", "check_model", "load_callable", "resolve_reference"]
