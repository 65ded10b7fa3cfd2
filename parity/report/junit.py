"""junit.xml: one test case per family/config; the failure message is the first-mismatch line."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from .atomic import atomic_write


def junit_tree(results) -> ET.ElementTree:
    suite = ET.Element("testsuite", name="parity", tests=str(len(results)))
    failures = 0
    for result in results:
        meta = result.meta
        case = ET.SubElement(
            suite, "testcase", classname=f"parity.{meta['family']}", name=str(meta["config"]),
            time=str(meta.get("seconds", 0)),
        )
        if not result.passed:
            failures += 1
            bad = result.first_mismatch
            failure = ET.SubElement(case, "failure", message=bad.line(), type=bad.status)
            failure.text = result.verdict() + ("\nhint: " + bad.hint if bad.hint else "")
    suite.set("failures", str(failures))
    return ET.ElementTree(suite)


def write_junit(result_or_results, path) -> Path:
    results = result_or_results if isinstance(result_or_results, list) else [result_or_results]
    tree = junit_tree(results)
    ET.indent(tree)
    return atomic_write(path, ET.tostring(tree.getroot(), encoding="unicode", xml_declaration=True) + "\n")
