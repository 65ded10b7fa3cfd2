"""Stage 3, compare: each node of ours against the reference's, element by element.

:mod:`~parity.compare.metrics` measures two tensors (:class:`~parity.compare.metrics.Metrics`);
:mod:`~parity.compare.tolerances` says which ``(atol, rtol)`` a node gets; :mod:`~parity.compare.results`
turns both into a :class:`~parity.compare.results.NodeResult` per node, in the reference's execution
order, and finds the first mismatch."""
