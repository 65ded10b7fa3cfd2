"""One version number: the installed distribution's (``pyproject.toml``), read from its metadata;
the Transformers versions parity is tested with; and where a bug of parity's own is reported."""

from __future__ import annotations

import sys
from importlib import metadata

try:
    VERSION = metadata.version("parity")
except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    VERSION = "0+unknown"


#: the Transformers releases parity is tested with (pyproject.toml pins the same range): 5.x moved RoPE
#: settings per layer type, renamed cache arguments and added the attention, experts and conversion
#: interfaces parity records through, over several minor releases; 5.3.0 builds some families'
#: references otherwise and breaks their checks silently; 5.25.0 moves Qwen3.5's backward by one ulp
#: (its forward agrees): a release joins the range once the whole suite passes on it
TRANSFORMERS_TESTED = ("5.24", "5.25")


def transformers_problem() -> str | None:
    """Why the installed Transformers is outside :data:`TRANSFORMERS_TESTED` (one line naming it), or
    None. Read from its metadata: nothing is imported."""
    from packaging.version import InvalidVersion, Version

    low, high = TRANSFORMERS_TESTED
    try:
        installed = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return f"Transformers is not installed; parity compares with it: pip install 'transformers>={low},<{high}'"
    try:
        version = Version(installed)
    except InvalidVersion:
        return None  # a build that names itself oddly: judged by what it does
    if Version(low) <= Version(version.base_version) < Version(high):
        return None
    return (
        f"Transformers {installed} is installed; parity is tested with Transformers >={low},<{high} (the reference "
        f"it runs computes otherwise in other releases): pip install 'transformers>={low},<{high}'"
    )


def require_transformers() -> None:
    """Raise ParityError when the installed Transformers is outside the tested range."""
    from parity.util.errors import ParityError

    problem = transformers_problem()
    if problem is not None:
        raise ParityError(problem)


def issue_tracker() -> str:
    """The project's issue tracker (its ``Issues`` / ``Bug Tracker`` project URL), else where to find it."""
    try:
        urls = metadata.metadata("parity").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("issues", "bug tracker", "tracker", "bugs"):
            return url.strip()
    return "the issue tracker of the repository parity was installed from"


def bug_line() -> str:
    """One line for an internal error (exit 3): it is parity's bug, where to report it, and the versions to give."""
    versions = [f"parity {VERSION}"] + [
        f"{name} {getattr(sys.modules[name], '__version__', '?')}"
        for name in ("torch", "transformers")
        if name in sys.modules
    ]
    return (
        "parity: internal error (exit 3): this is a bug in parity, not a problem with your input; please report it "
        f"with the traceback above and the command line to {issue_tracker()} ({', '.join(versions)})"
    )
