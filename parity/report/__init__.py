"""Report writers, registered by format name (see :func:`parity.report.result.register_writer`):
nodes.csv and result.json (tables.py), report.html (html.py), junit.xml (junit.py)."""

from parity.report.result import register_writer

register_writer("html", "report.html", "parity.report.html:write_html")
register_writer("csv", "nodes.csv", "parity.report.tables:write_csv")
register_writer("json", "result.json", "parity.report.tables:write_json")
register_writer("junit", "junit.xml", "parity.report.junit:write_junit")
