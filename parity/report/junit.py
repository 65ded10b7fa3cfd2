"""junit.xml: one test case per family/config; the failure message is the first-mismatch line.

Layout (what Jenkins, GitLab, GitHub test reporters and Azure read)::

    <testsuites name="parity" tests failures errors time>
      <testsuite name="parity" tests failures errors skipped time timestamp>
        <properties> torch, transformers versions </properties>
        <testcase classname="parity.<family>" name="<config>" time="<seconds>">
          <failure message="<first mismatch line>" type="<status>"> verdict, hint, notes </failure>
          <system-out> verdict, run facts </system-out>
        </testcase>

Two runs of the same family/config in one file (say float32 and bfloat16) get the dtype and
sequence length appended to the name (and a count, if even those agree), so every test case name
is unique.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from parity.util.files import atomic_write

#: characters XML 1.0 cannot hold at all (a name or message with them would make the file unreadable)
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def xml_text(value) -> str:
    """``value`` as text XML 1.0 can hold (characters it cannot are replaced by U+FFFD)."""
    return _NOT_XML.sub("\ufffd", str(value))


def _case_name(meta: dict, duplicate: bool) -> str:
    name = str(meta.get("config"))
    if duplicate:
        name += f" [{meta.get('dtype')}, seq {meta.get('seq_len')}]"
    return name


def _run_facts(meta: dict) -> str:
    versions = meta.get("versions") or {}
    facts = [
        f"family {meta.get('family')}, config {meta.get('config')}, dtype {meta.get('dtype')}, "
        f"seq_len {meta.get('seq_len')}, batch {meta.get('batch_size')}, seed {meta.get('seed')}, mode {meta.get('mode')}",
        f"checkpoint {meta.get('checkpoint') or 'none (random weights)'}"
        + (f" sha256 {meta['checkpoint_sha256']}" if meta.get("checkpoint_sha256") else ""),
        f"torch {versions.get('torch')}, transformers {versions.get('transformers')}, time {meta.get('time')}",
    ]
    return "\n".join(facts)


def junit_tree(results) -> ET.ElementTree[ET.Element]:
    """The JUnit XML tree for one or more CheckResults (see the module docstring)."""
    seen = Counter((r.meta.get("family"), str(r.meta.get("config"))) for r in results)
    total_time = sum(float(r.meta.get("seconds") or 0) for r in results)
    failures = sum(not r.passed for r in results)
    counts: dict[str, Any] = {
        "tests": str(len(results)),
        "failures": str(failures),
        "errors": "0",
        "time": f"{total_time:.3f}",
    }
    root = ET.Element("testsuites", name="parity", **counts)
    suite = ET.SubElement(root, "testsuite", name="parity", skipped="0", **counts)
    if results:
        suite.set("timestamp", xml_text(results[0].meta.get("time", "")))
        versions = results[0].meta.get("versions") or {}
        props = ET.SubElement(suite, "properties")
        for key in ("torch", "transformers"):
            if key in versions:
                ET.SubElement(props, "property", name=key, value=xml_text(versions[key]))
    used: Counter = Counter()
    for result in results:
        meta = result.meta
        name = _case_name(meta, seen[(meta.get("family"), str(meta.get("config")))] > 1)
        used[(meta.get("family"), name)] += 1
        if used[(meta.get("family"), name)] > 1:
            name += f" #{used[(meta.get('family'), name)]}"
        case = ET.SubElement(
            suite,
            "testcase",
            classname=xml_text(f"parity.{meta.get('family')}"),
            name=xml_text(name),
            time=f"{float(meta.get('seconds') or 0):.3f}",
        )
        if not result.passed:
            bad = result.first_mismatch
            if bad is not None:
                failure = ET.SubElement(case, "failure", message=xml_text(bad.line()), type=xml_text(bad.status))
            else:  # every node agrees, yet the run fails (loader coverage gaps): the verdict says why
                failure = ET.SubElement(case, "failure", message=xml_text(result.verdict()), type="coverage")
            body = [result.verdict()]
            if bad is not None and bad.hint is not None:
                body.append(f"hint ({bad.hint.kind}): {bad.hint.text}")
            body += ["note: " + n for n in result.notes]
            failure.text = xml_text("\n".join(body))
        out = ET.SubElement(case, "system-out")
        out.text = xml_text(result.verdict() + "\n" + _run_facts(meta))
    return ET.ElementTree(root)


def write_junit(result_or_results, path) -> Path:
    """Write junit.xml for one CheckResult or a list of them (one test case each)."""
    results = list(result_or_results) if isinstance(result_or_results, (list, tuple)) else [result_or_results]
    tree = junit_tree(results)
    ET.indent(tree)
    return atomic_write(path, ET.tostring(tree.getroot(), encoding="unicode", xml_declaration=True) + "\n")
