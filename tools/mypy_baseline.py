"""mypy over the engine, held to a baseline that only goes down.

``python tools/mypy_baseline.py`` runs mypy (configured in pyproject.toml) and fails when it reports
more errors than ``tools/mypy-baseline.txt`` allows; when it reports fewer, it says so and asks for
the baseline to be lowered (``--update`` writes the new count). Exit 0 at or under the baseline,
1 above it, 2 when mypy itself cannot run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BASELINE = Path(__file__).with_name("mypy-baseline.txt")


def main(argv: list[str]) -> int:
    run = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=BASELINE.parents[1])
    out = run.stdout + run.stderr
    if run.returncode not in (0, 1) or re.search(r"^(usage:|mypy: error)", out, re.M):
        print(out, end="")
        print("mypy could not run", file=sys.stderr)
        return 2
    errors = [line for line in out.splitlines() if ": error:" in line]
    allowed = int(BASELINE.read_text().split()[0])
    if "--update" in argv:
        BASELINE.write_text(f"{len(errors)}\n")
        print(f"mypy baseline: {allowed} -> {len(errors)} errors")
        return 0
    if len(errors) > allowed:
        print("\n".join(errors))
        print(
            f"mypy: {len(errors)} errors, more than the baseline's {allowed} (tools/mypy-baseline.txt): "
            "fix the new ones, never raise the baseline",
            file=sys.stderr,
        )
        return 1
    if len(errors) < allowed:
        print(
            f"mypy: {len(errors)} errors, under the baseline's {allowed}: lower it "
            "(python tools/mypy_baseline.py --update) so it keeps going down"
        )
    else:
        print(f"mypy: {len(errors)} errors, at the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
