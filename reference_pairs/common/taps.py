"""Taps: named points for tensors computed outside any module (post-RoPE q/k, scores, probabilities...)."""

from __future__ import annotations

from torch import nn


class Tap(nn.Identity):
    """Names a tensor that is computed outside any module (post-RoPE q/k, softmax output, ...).

    It returns its input unchanged; a forward hook on it sees the tensor and a forward pre-hook can
    replace it. With no hook registered the call costs one Python function call.
    """
