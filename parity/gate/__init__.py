"""The CI gate: every family's CI cases (:mod:`~parity.gate.cases`) run and judged against a committed
baseline (:mod:`~parity.gate.baseline`), for the families of a project (:mod:`~parity.gate.project`),
as pytest tests (:mod:`~parity.gate.pytest_plugin`, :mod:`~parity.gate.pytest_gate`); :mod:`~parity.gate.run`
is the part that knows no pytest."""
