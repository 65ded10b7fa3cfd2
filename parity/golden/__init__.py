"""Golden traces: the reference's side of a check, stored for a runtime parity cannot hook.

``record`` writes a trace (:mod:`parity.golden.record`), ``read_trace`` reads one
(:mod:`parity.golden.trace_file`: the format, its manifest and JSON Schema), ``compare_dump`` /
``compare_model`` / ``verify`` judge a runtime's dump, a live model or the installed reference
against it (:mod:`parity.golden.verdict`). A dump's files, ``parity-dump.json`` and name maps (their
vocabulary: writes, reshape, permute, slice, select, scale, unavailable nodes): :mod:`parity.golden.dumps`;
what a dump must match (``parity trace show``): :mod:`parity.golden.show`; summaries instead of tensors
for deep models: :mod:`parity.golden.summaries`. Ready adapters for MLX and llama.cpp are
:mod:`parity.runtimes`.
"""

from parity.golden.dumps import (
    DumpInfo,
    NameMap,
    NameRule,
    apply_ops,
    map_dump,
    read_dump,
    read_dump_info,
    read_name_map,
    write_dump_info,
)
from parity.golden.record import record
from parity.golden.show import describe
from parity.golden.summaries import Summary, SummaryTrace, compare_summary, summarise
from parity.golden.trace_file import FORMAT, VERSION, GoldenTrace, TraceError, read_trace, trace_schema
from parity.golden.verdict import compare_dump, compare_model, judge, verify

__all__ = [
    "FORMAT",
    "VERSION",
    "DumpInfo",
    "GoldenTrace",
    "NameMap",
    "NameRule",
    "Summary",
    "SummaryTrace",
    "TraceError",
    "apply_ops",
    "compare_dump",
    "compare_model",
    "compare_summary",
    "describe",
    "judge",
    "map_dump",
    "read_dump",
    "read_dump_info",
    "read_name_map",
    "read_trace",
    "record",
    "summarise",
    "trace_schema",
    "verify",
    "write_dump_info",
]
