"""A check run: the stages strung together. :mod:`~parity.run.plan` validates the options against the
pair and builds the inputs; :mod:`~parity.run.stages` traces both models, compares, diagnoses and
analyses; :mod:`~parity.run.decode` drives both through their KV caches; :mod:`~parity.run.check`
is :func:`parity.check`. :mod:`~parity.run.memory` is the memory model the guard uses."""
