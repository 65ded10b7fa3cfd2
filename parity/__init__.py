"""parity: where, exactly, does a from-scratch LLM stop agreeing with its Transformers reference?

import parity
from reference_pairs.olmo3 import build_pair
res = parity.check(build_pair("tiny"))
res.first_mismatch   # NodeResult | None
"""

from typing import TYPE_CHECKING

from parity.util.errors import CheckpointError, ConfigError, LoaderError, ParityError
from parity.util.version import VERSION as __version__

if TYPE_CHECKING:
    from parity import report  # noqa: F401
    from parity.compare.results import NodeResult, first_divergence, first_mismatch
    from parity.compare.tolerances import DEFAULT_TOLERANCES
    from parity.diagnose.hints import Hint
    from parity.model.derive import derive_facts
    from parity.model.facts import ArchFacts
    from parity.model.family import Family, Node, NodeMap
    from parity.model.pair import NodeSpec, Pair
    from parity.record.hooks import tap
    from parity.report.result import CheckResult
    from parity.run.check import check
    from parity.run.decode import CacheProtocol
    from parity.run.options import CheckOptions, DecodePlan
    from parity.testing import assert_bit_exact, assert_parity
    from parity.user.check_model import check_model


#: the public API by module, imported on first use
_API = {
    "parity.compare.results": ("NodeResult", "first_divergence", "first_mismatch"),
    "parity.compare.tolerances": ("DEFAULT_TOLERANCES",),
    "parity.diagnose.hints": ("Hint",),
    "parity.model.derive": ("derive_facts",),
    "parity.model.facts": ("ArchFacts",),
    "parity.model.family": ("Family", "Node", "NodeMap"),
    "parity.model.pair": ("NodeSpec", "Pair"),
    "parity.record.hooks": ("tap",),
    "parity.report.result": ("CheckResult",),
    "parity.run.check": ("check",),
    "parity.run.decode": ("CacheProtocol",),
    "parity.run.options": ("CheckOptions", "DecodePlan"),
    "parity.testing": ("assert_bit_exact", "assert_parity"),
    "parity.user.check_model": ("check_model",),
}


def _load() -> None:
    """The public API, imported on first use: ``import parity`` alone (what the command line does
    before it has checked its options) costs no torch import, so a usage error is answered at once."""
    import importlib

    importlib.import_module("parity.report")  # registers the report writers
    for module, names in _API.items():
        loaded = importlib.import_module(module)
        globals().update({name: getattr(loaded, name) for name in names})


def __getattr__(name: str):
    if name.startswith("__") or name not in __all__:
        # a stage's package (parity.build, parity.report...) is an attribute once imported, as before
        raise AttributeError(f"module 'parity' has no attribute {name!r}")
    _load()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "DEFAULT_TOLERANCES",
    "ArchFacts",
    "CacheProtocol",
    "CheckOptions",
    "CheckResult",
    "CheckpointError",
    "ConfigError",
    "DecodePlan",
    "Family",
    "Hint",
    "LoaderError",
    "Node",
    "NodeMap",
    "NodeResult",
    "NodeSpec",
    "Pair",
    "ParityError",
    "__version__",
    "assert_bit_exact",
    "assert_parity",
    "check",
    "check_model",
    "derive_facts",
    "first_divergence",
    "first_mismatch",
    "tap",
]
