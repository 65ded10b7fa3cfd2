"""parity: where, exactly, does a from-scratch LLM stop agreeing with its Transformers reference?

    import parity
    from reference_pairs.olmo3 import build_pair
    res = parity.check(build_pair("tiny"))
    res.first_mismatch   # NodeResult | None
"""

from .check import CheckResult, check
from .compare import DEFAULT_TOLERANCES, NodeResult, first_mismatch
from .errors import CheckpointError, ConfigError, LoaderError, ParityError
from .pair import Family, NodeSpec, Pair
from .testing import assert_parity

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_TOLERANCES",
    "CheckResult",
    "CheckpointError",
    "ConfigError",
    "Family",
    "LoaderError",
    "NodeResult",
    "NodeSpec",
    "Pair",
    "ParityError",
    "assert_parity",
    "check",
    "first_mismatch",
]
