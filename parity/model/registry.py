"""Find families through the ``parity.pairs`` entry-point group.

The built-in families register there too (see pyproject.toml), so the engine never imports
``reference_pairs`` and a user's package adds a family the same way.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from parity.util.errors import ParityError

if TYPE_CHECKING:
    from parity.model.family import Family

GROUP = "parity.pairs"


def _load(ep) -> Family:
    from parity.model.family import Family

    try:
        family = ep.load()
    except ImportError as e:
        raise ParityError(f"family {ep.name} ({ep.value}) cannot be imported: {e}") from None
    if not isinstance(family, Family):
        raise ParityError(f"entry point {ep.name} = {ep.value} in group {GROUP} is not a parity.Family")
    return family


def family_names() -> list[str]:
    """Names of the registered families, without importing them."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def families() -> dict[str, Family]:
    """All registered families by name. Raises ParityError if one cannot be loaded."""
    return {ep.name: _load(ep) for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name)}


def get_family(name: str) -> Family:
    """The family called ``name``, importing only that one. Raises ParityError listing the known
    families if there is none."""
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            return _load(ep)
    known = family_names()
    raise ParityError(f"unknown family {name!r}; known families: {', '.join(known) or 'none installed'}")


def family_for_model_type(model_type: str, config=None) -> Family | None:
    """The registered family whose reference has this ``model_type``, or whose multimodal model does
    (``gemma4`` -> the gemma4 family, checked as its text model), or None. Where several families share
    the ``model_type`` (``llama``: Llama 2 and Llama 3), the one whose built-in configs are most like
    ``config`` (a Transformers config: its RoPE type, tying and other named choices, see
    :func:`config_likeness`), else the first by name. Families that cannot be imported are skipped
    here (``parity list`` reports them)."""
    found = []
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        try:
            family = _load(ep)
        except ParityError:
            continue
        if family.model_type == model_type or family.composite_for(model_type) is not None:
            found.append(family)
    if len(found) > 1 and config is not None:
        scores = [config_likeness(f, config) for f in found]
        return found[scores.index(max(scores))]
    return found[0] if found else None


def _choices(hf_config) -> set[tuple[str, str]]:
    """The named choices of a Transformers config: its fields whose values are words, flags or absent
    (not sizes), and the ``rope_type`` of its RoPE parameters (per layer type too)."""
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    out = set()
    for key, value in data.items():
        if key in ("transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path"):
            continue
        if value is None or isinstance(value, (str, bool)):
            out.add((key, repr(value)))
        elif key in ("rope_parameters", "rope_scaling") and isinstance(value, dict):
            for part in [value, *(v for v in value.values() if isinstance(v, dict))]:
                if "rope_type" in part:
                    out.add(("rope_type", repr(part["rope_type"])))
    return out


def config_likeness(family: Family, hf_config) -> int:
    """How many of ``hf_config``'s named choices (:func:`_choices`) one of the family's built-in
    configs makes too (the best of them): the evidence for which family a checkpoint is."""
    wanted = _choices(hf_config)
    best = 0
    for make in family.configs.values():
        try:
            mine = _choices(family.to_hf(make(None)))
        except Exception:  # a config that needs more than its defaults: no evidence either way
            continue
        best = max(best, len(wanted & mine))
    return best
