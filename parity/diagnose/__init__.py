"""Stage 4, diagnose: a typed hint about the cause of the first failing node.

:func:`~parity.diagnose.detectors.diagnose` tries the detectors of :data:`~parity.diagnose.detectors.DETECTORS`
in order on an :class:`~parity.diagnose.evidence.Evidence`; each lives with its topic: which tensor
feeds which (:mod:`~parity.diagnose.wiring`), norms, RoPE, masks and windows, scales, MoE, caches,
element-wise functions. :mod:`~parity.diagnose.profile` says where an error sits and what it does
to the logits; :mod:`~parity.diagnose.origin` where a compounded failure starts. The hint kinds are
:data:`parity.diagnose.hints.KINDS`."""
