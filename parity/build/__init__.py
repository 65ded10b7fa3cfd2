"""Stage 1, build: a Pair from a family and a config or checkpoint, both models on one copy of the weights.

:func:`build_pair` is the one build path of every family (:mod:`parity.build.builder`); a reference
that is not a family's (a checkpoint folder, a config.json, a Transformers config or model) is
built by :mod:`parity.build.reference`. Checkpoints are read through safetensors only
(:mod:`parity.build.checkpoint`); random weights are parity's probes (:mod:`parity.build.probes`);
:mod:`parity.build.coverage` judges what the loader made of the checkpoint.
"""

from parity.build.builder import DTYPES, build_pair

__all__ = ["DTYPES", "build_pair"]
