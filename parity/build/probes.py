"""Probes: the random weights and inputs a check runs on, chosen so that every config field changes
the output measurably. A field the probe never exercises is a fault the debugger cannot see (a
wrong RMSNorm eps passes on inputs whose every token has an RMS near 1), so each choice here exists
for a kind of field:

* **Token embeddings with per-token scales over five orders of magnitude** (row ``r`` of the
  embedding is N(0, 1) times ``10^e``, ``e`` cycling through -3, -2, -1, 0, 1 with the row index).
  A token whose hidden state has an RMS of 1e-3 makes ``eps`` dominate ``mean(x^2)`` in the norms
  that read it (RMSNorm / LayerNorm eps, eps inside vs outside the square root, the Q/K norms), and a
  token with RMS 10 makes a missing normalisation obvious. Random token ids hit every scale.
* **Learned position embeddings N(0, 0.01^2)** (GPT-2's ``wpe``): small beside the token scales, so
  the small-RMS tokens stay small after the positions are added (a unit-scale table would give every
  token an RMS near 1 and hide the eps again), yet a shifted or unloaded position table still changes
  every position.
* **Norm weights away from 1** (``1 + N(0, 0.1^2)``; also for ``(1 + w)`` norms, whose ``w`` is then
  away from 0): ``w`` vs ``1 + w`` and a swapped or unloaded norm weight change every output. Other
  1-D multipliers (a tensor whose own name says ``scale``/``scalar``, e.g. Gemma 4's per-layer
  ``layer_scalar``) are drawn the same way: near 1, so depth neither explodes nor vanishes, and
  not 1, so a multiplier left out shows.
* **Every tensor distinct** (one seeded generator, drawn in checkpoint order): two weights of the
  same shape never hold equal values, so swapped, duplicated or transposed loads show, and a user's
  model can be aligned to the reference by the values it holds.
* **Linear weights N(0, 1/in)** (unit-scale activations through depth, so nothing saturates or
  vanishes after a few layers) and biases N(0, 0.02^2).
* **Sequences past every window**: the default length passes every sliding window (4 x window, at
  least 16; see :func:`parity.build.builder.default_seq_len`), and ``--left-pad`` batches give rows whose
  queries see no real key, where masking bugs become NaN.

Drawn in float32, then cast to the compute dtype, so a float32 and a bfloat16 pair hold the same
weights up to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: exponents of the per-token embedding scales (10^e), cycled over the vocabulary
EMBEDDING_SCALE_EXPONENTS = (-3.0, -2.0, -1.0, 0.0, 1.0)


def token_scales(vocab_size: int) -> torch.Tensor:
    """``(vocab_size,)`` float32: the scale each token's embedding row is drawn with."""
    exponents = torch.tensor(EMBEDDING_SCALE_EXPONENTS)
    return torch.pow(10.0, exponents[torch.arange(vocab_size) % len(exponents)])


def probe_weights(
    shapes: Mapping[str, tuple[int, ...]], seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded probe weights in checkpoint naming (see the module docstring), created once and shared by
    both models. Keys are read for what a tensor is: ``embed`` (or GPT-2's ``wte``) in the name and 2-D
    is a token embedding (the first one; any other embedding table is N(0, 1)), ``wpe`` or
    ``position`` and 2-D a learned position table, ``norm`` (or GPT-2's ``ln_``) and 1-D a norm weight
    (``.bias`` excepted), 1-D with ``scal`` in its own name a multiplier (drawn like a norm weight),
    other 1-D tensors are biases, everything else a linear weight ``(out, in, ...)``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    scaled_embedding = False
    for name, shape in shapes.items():
        if (
            len(shape) == 1
            and not name.endswith(".bias")
            and ("norm" in name.lower() or "ln_" in name or "scal" in name.rsplit(".", 1)[-1])
        ):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = 0.02 * torch.randn(shape, generator=gen)
        elif len(shape) == 2 and ("wpe" in name or "position" in name):
            t = 0.01 * torch.randn(shape, generator=gen)
        elif len(shape) == 2 and ("embed" in name or "wte" in name):
            t = torch.randn(shape, generator=gen)
            if not scaled_embedding:  # the token embedding: per-token RMS over orders of magnitude
                t.mul_(token_scales(shape[0])[:, None])
                scaled_embedding = True
        else:
            t = torch.randn(shape, generator=gen).mul_(shape[-1] ** -0.5)  # in place: no second copy
        out[name] = t.to(dtype)
    return out
