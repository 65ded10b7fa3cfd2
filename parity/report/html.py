"""report.html: one self-contained file (inline CSS, no scripts or fonts from a network)."""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape

from .atomic import atomic_write
from .tables import result_dict

_env = Environment(loader=PackageLoader("parity.report", "templates"), autoescape=select_autoescape(["j2", "html"]))


def _fmt(value, spec: str = ".3g") -> str:
    return "" if value is None else format(value, spec)


_env.filters["fmt"] = _fmt


def render_html(result) -> str:
    return _env.get_template("report.html.j2").render(r=result, d=result_dict(result), bad=result.first_mismatch)


def write_html(result, path) -> Path:
    return atomic_write(path, render_html(result))
