"""The source text of a class or function, read once each: reading one parses its whole module (tens of
milliseconds), and the readers (which module reads which weight, which token a forward acts on) ask again for every
module of a model."""

from __future__ import annotations

import inspect

#: class or function -> its source text
_SOURCES: dict[object, str] = {}


def source_of(obj: object) -> str:
    """``obj``'s source text (a class, a function); "" where it has none (a builtin, code made at run time)."""
    if obj not in _SOURCES:
        try:
            _SOURCES[obj] = inspect.getsource(obj)  # type: ignore[arg-type]  # a class or a function, as said
        except (OSError, TypeError):
            _SOURCES[obj] = ""
    return _SOURCES[obj]
