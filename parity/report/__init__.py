"""Report writers: nodes.csv and result.json (tables.py), report.html (html.py), junit.xml (junit.py)."""
