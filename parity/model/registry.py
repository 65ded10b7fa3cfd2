"""Find families through the ``parity.pairs`` entry-point group.

The built-in families register there too (see pyproject.toml), so the engine never imports
``reference_pairs`` and a user's package adds a family the same way.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from parity.model.family import Family
from parity.util.errors import ParityError

GROUP = "parity.pairs"


def _load(ep) -> Family:
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


def family_for_model_type(model_type: str) -> Family | None:
    """The registered family whose reference has this ``model_type`` (the first by name), or whose
    multimodal model does (``gemma4`` -> the gemma4 family, checked as its text model), or None.
    Families that cannot be imported are skipped here (``parity list`` reports them)."""
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        try:
            family = _load(ep)
        except ParityError:
            continue
        if family.model_type == model_type or family.composite_for(model_type) is not None:
            return family
    return None
