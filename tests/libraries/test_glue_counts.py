"""README's "check a <library> model" table says how many lines of glue each library takes: those
numbers are the glue files' (tests/libraries/glue_<library>.py). Runs without the libraries."""

from pathlib import Path

import pytest
from _libcheck import glue_lines

README = Path(__file__).resolve().parents[2] / "README.md"
LIBRARIES = {
    "litgpt": "litgpt",
    "torchtune": "torchtune",
    "transformer_lens": "TransformerLens",
    "llms_from_scratch": "llms-from-scratch",
}


@pytest.mark.parametrize("library", LIBRARIES)
def test_readme_glue_line_counts_are_the_glue_files(library):
    counts = glue_lines(library)
    row = next((line for line in README.read_text().splitlines() if line.startswith(f"| {LIBRARIES[library]} (")), None)
    assert row is not None, f"README has no row for {LIBRARIES[library]}"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"{min(counts.values())}–{max(counts.values())}", (cells[1], counts)
    listed = {f.strip("() ") for f in cells[2].split(",")}
    assert listed == set(counts), (listed, sorted(counts))
