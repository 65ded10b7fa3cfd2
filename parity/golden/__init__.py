"""Golden traces: the reference's side of a check, stored for a runtime parity cannot hook.

``record`` writes a trace (:mod:`parity.golden.record`), ``read_trace`` reads one
(:mod:`parity.golden.trace_file`: the format, its manifest and JSON Schema), ``compare_dump`` /
``compare_model`` / ``verify`` judge a runtime's dump, a live model or the installed reference
against it (:mod:`parity.golden.verdict`). A dump's files and name map: :mod:`parity.golden.dumps`;
summaries instead of tensors for deep models: :mod:`parity.golden.summaries`.
"""

from parity.golden.dumps import NameRule, map_dump, read_dump, read_name_map
from parity.golden.record import record
from parity.golden.summaries import Summary, SummaryTrace, compare_summary, summarise
from parity.golden.trace_file import FORMAT, VERSION, GoldenTrace, TraceError, read_trace, trace_schema
from parity.golden.verdict import compare_dump, compare_model, judge, verify

__all__ = [
    "FORMAT",
    "VERSION",
    "GoldenTrace",
    "NameRule",
    "Summary",
    "SummaryTrace",
    "TraceError",
    "compare_dump",
    "compare_model",
    "compare_summary",
    "judge",
    "map_dump",
    "read_dump",
    "read_name_map",
    "read_trace",
    "record",
    "summarise",
    "trace_schema",
    "verify",
]
