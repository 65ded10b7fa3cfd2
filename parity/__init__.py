"""parity: where, exactly, does a from-scratch LLM stop agreeing with its Transformers reference?

import parity
from reference_pairs.olmo3 import build_pair
res = parity.check(build_pair("tiny"))
res.first_mismatch   # NodeResult | None
"""

from parity import report  # noqa: F401  (registers the report writers)
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
from parity.util.errors import CheckpointError, ConfigError, LoaderError, ParityError
from parity.util.version import VERSION as __version__

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
