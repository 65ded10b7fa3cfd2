"""The tree is the design: stages are packages, imports only go down the floors docs/design.md draws,
and every import path the README shows a user still works."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / "parity"

#: the floors of docs/design.md, lowest first; a package imports only packages of lower floors
FLOORS = [
    {"util"},
    {"model", "record"},
    {"build", "compare"},
    {"diagnose", "report"},
    {"run"},
    {"user", "selftest", "testing"},
    {"golden", "gate", "runtimes"},
    {"cli", "__init__"},
    {"__main__"},
]
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}
#: imports within one floor that docs/design.md allows: the runtime adapters read traces and write dumps
BESIDE = {("runtimes", "golden")}


def _unit(module: str) -> str:
    """``parity.run.stages`` -> ``run``; ``parity`` (the package's own __init__) -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _runtime_imports(path: Path):
    """Every ``parity`` module a file imports at run time, at any depth (lazy imports included),
    leaving out ``if TYPE_CHECKING:`` blocks (annotations only)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("parity"):
            if node.module == "parity":
                yield from (f"parity.{a.name}" for a in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("parity"))


def _edges() -> set[tuple[str, str, str]]:
    edges = set()
    for path in PARITY.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        here = _unit(".".join(p for p in rel.parts if p != "__init__") or "parity")
        for target in _runtime_imports(path):
            there = _unit(target)
            if there != here and there in FLOOR:
                edges.add((here, there, str(path.relative_to(ROOT))))
    return edges


def test_every_package_of_the_engine_has_a_floor():
    units = {p.name for p in PARITY.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in PARITY.glob("*.py")}
    assert units <= set(FLOOR), f"not on any floor of docs/design.md: {sorted(units - set(FLOOR))}"


def test_imports_only_go_down_the_floors():
    upward = sorted(
        f"{where}: {a} (floor {FLOOR[a]}) imports {b} (floor {FLOOR[b]})"
        for a, b, where in _edges()
        if FLOOR[b] >= FLOOR[a] and (a, b) not in BESIDE
    )
    assert not upward, "\n".join(upward)


def test_no_module_imports_parity_relatively():
    """Absolute imports only: the floor a module reads from is visible on its import lines."""
    relative = [
        str(p.relative_to(ROOT))
        for p in PARITY.rglob("*.py")
        if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(ast.parse(p.read_text())))
    ]
    assert not relative


def _readme_imports() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```")[1::2]  # fenced blocks: their first line is the language
    code = "\n".join(b.split("\n", 1)[1] for b in blocks if b.split("\n", 1)[0].strip() in ("python", "py", ""))
    lines = re.findall(r"^\s*((?:from [\w.]+ import [\w, ]+)|(?:import [\w.]+))", code, flags=re.M)
    return sorted({line.strip() for line in lines if "parity" in line or "reference_pairs" in line})


@pytest.mark.parametrize("line", _readme_imports())
def test_every_import_the_readme_shows_works(line):
    exec(line, {})


@pytest.mark.parametrize(
    "path",
    [
        "parity.check",
        "parity.check_model",
        "parity.tap",
        "parity.CheckOptions",
        "parity.DecodePlan",
        "parity.CacheProtocol",
        "parity.testing.assert_parity",
        "parity.testing.assert_bit_exact",
        "parity.golden.record",
        "parity.golden.compare_dump",
        "parity.golden.compare_model",
        "parity.golden.verify",
        "parity.golden.read_trace",
        "reference_pairs.olmo3.build_pair",
        "reference_pairs.llama3.build_pair",
    ],
)
def test_public_names_resolve(path):
    module, _, name = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_the_public_api_names_one_version():
    import parity

    assert parity.__version__ == importlib.metadata.version("parity")
