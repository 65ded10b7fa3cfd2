"""The parity gate as pytest tests (collected when the plugin's gate is on: ``pytest --parity-gate``,
``parity_gate = true`` in the ini, or ``parity gate``, which runs pytest on this module).

``test_gate[<family>/<config>/<source>/<dtype>]`` runs and judges one case
(:meth:`parity.gate.run.GateRun.evaluate`); ``test_config_coverage[<family>]`` fails when a real config
of the family uses a feature no CI config exercises. A failing case's message is its summary (first
problem, and the nodes past their budget as one line); the full list and the HTML report go to a
report folder that the message names.
"""

from __future__ import annotations

import json

import pytest

from parity.gate.pytest_plugin import gate_run, reports_of


def pytest_generate_tests(metafunc):
    run = gate_run(metafunc.config)
    if "gate_case" in metafunc.fixturenames:
        metafunc.parametrize("gate_case", run.cases, ids=[case.id for case in run.cases])
    if "gate_family" in metafunc.fixturenames:
        metafunc.parametrize("gate_family", run.names)


def test_gate(gate_case, request):
    outcome = gate_run(request.config).evaluate(gate_case)
    if outcome.passed:
        return
    lines = outcome.summary()
    reports = reports_of(request.config)
    if reports.parent is not None and outcome.result is not None:
        problems = json.dumps(outcome.to_dict(), indent=2) + "\n"
        try:
            folder = reports.write(request.node.nodeid, [outcome.result], {"gate.json": problems})
            lines.append(f"every problem (gate.json) and the report: {folder}")
        except OSError as e:
            lines.append(f"the report could not be written: {e.strerror or e}")
    pytest.fail("\n".join(lines), pytrace=False)


def test_config_coverage(gate_family, request):
    holes = gate_run(request.config).config_holes(gate_family)
    if holes:
        pytest.fail("\n".join(holes), pytrace=False)
