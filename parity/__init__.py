"""parity: where, exactly, does a from-scratch LLM stop agreeing with its Transformers reference?

    import parity
    from reference_pairs.olmo3 import build_pair
    res = parity.check(build_pair("tiny"))
    res.first_mismatch   # NodeResult | None
"""

from importlib import metadata as _metadata

from . import report  # noqa: F401  (registers the report writers)
from .check import check
from .compare import DEFAULT_TOLERANCES, NodeResult, first_divergence, first_mismatch
from .errors import CheckpointError, ConfigError, LoaderError, ParityError
from .facts import ArchFacts, derive_facts
from .family import Family, Node, NodeMap
from .hints import Hint
from .pair import NodeSpec, Pair
from .result import CheckResult
from .testing import assert_bit_exact, assert_parity
from .trace import tap
from .user_model import check_model

try:  # one version number: the installed distribution's (pyproject.toml)
    __version__ = _metadata.version("parity")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
__all__ = [
    "DEFAULT_TOLERANCES",
    "ArchFacts",
    "CheckResult",
    "CheckpointError",
    "ConfigError",
    "Family",
    "Hint",
    "LoaderError",
    "Node",
    "NodeMap",
    "NodeResult",
    "NodeSpec",
    "Pair",
    "ParityError",
    "assert_bit_exact",
    "assert_parity",
    "check",
    "check_model",
    "derive_facts",
    "first_divergence",
    "first_mismatch",
    "tap",
]
