"""What a newcomer meets first: the README and docs link only files that exist, the command synopsis
lists every option, and running from the folder that holds the clone imports the real package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_point_only_at_files_that_exist(doc):
    text = doc.read_text()
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    paths = [
        t
        for t in re.findall(r"`([^`\s<>*]+/[^`\s<>*]*)`", _prose(text))
        if not t.startswith(("-", "http"))
        and not re.match(r"(step\d*|grad|causal|train)/", t)
        and re.search(r"\.\w+$|/$", t)
    ]
    for target in links:
        assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"
    for target in paths:
        assert (ROOT / target).exists(), f"{doc.name} names {target}, which does not exist"
    assert "DESIGN.md" not in text and "shared/" not in text


def test_readme_links_the_design_page():
    assert "](docs/design.md)" in (ROOT / "README.md").read_text()


def _options_in(line: str) -> set[str]:
    """The whole option tokens of a synopsis line (``--base`` is not in ``[--baseline FILE]``)."""
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w-])", line))


def test_readme_synopsis_lists_every_option():
    readme = (ROOT / "README.md").read_text()
    synopsis = readme[readme.index("## Commands") :].split("```")[1]
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        line = next((s for s in synopsis.split("\nparity ")[1:] if s.startswith(name)), None)
        assert line is not None, f"parity {name} is missing from the synopsis"
        listed = _options_in(line)
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in listed, f"parity {name} {option} is missing from the README synopsis"


def test_synopsis_check_matches_whole_option_tokens():
    """The rule above, on a line that lists --baseline only: --base is not in it."""
    listed = _options_in("gate [--baseline FILE] [--update-baseline]")
    assert "--base" not in listed and "--baseline" in listed and "--update-baseline" in listed
    assert "--update" not in listed


def _python(code: str, cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
