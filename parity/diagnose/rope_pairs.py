"""RoPE's pairs read in the other convention, the porting mistake one function makes. The reference's RoPE function
(a module-level ``apply_rotary_pos_emb*`` of its modeling code, called by name) is replaced, for one search pass,
by the same rotation over the other pairs:

* half-split pairs ``(i, i + d/2)`` (``rotate_half``, Llama's and most models') read as interleaved ``(2i, 2i + 1)``
  (GPT-J's ``rotate_every_two``), each pair turned by the table's frequency ``i``;
* interleaved pairs (DeepSeek's ``apply_rotary_pos_emb_interleave``, whose output is de-interleaved) read as
  half-split.

``cos`` and ``sin`` are Transformers' tables, ``cat(freqs, freqs)`` over the rotated width, unsqueezed at
``unsqueeze_dim`` to broadcast over the heads; dims past the tables' width pass through (partial rotary).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from parity.diagnose.scan_order import bound_arguments

#: the prefix of the reference's RoPE functions
PREFIX = "apply_rotary_pos_emb"
#: parity's own files: frames of the search's wrappers, passed over to find the calling line
_PARITY = str(Path(__file__).parent.parent)


def rope_functions(block: torch.nn.Module) -> list[tuple[str, str, Callable]]:
    """The RoPE functions the modeling code of ``block``'s class calls by name: ``(module name, global name,
    function)`` each."""
    module = sys.modules.get(type(block).__module__)
    if module is None:
        return []
    return [
        (module.__name__, name, value)
        for name, value in vars(module).items()
        if name.startswith(PREFIX) and callable(value) and not inspect.isclass(value)
    ]


def callers(module: str, name: str) -> list[int]:
    """The lines of ``module``'s source that call ``name`` (a RoPE function an attention and its indexer both call:
    each call may be the one a port got wrong)."""
    try:
        lines = inspect.getsource(sys.modules[module]).splitlines()
    except (KeyError, OSError, TypeError):
        return []
    call = f"{name}("
    return [i + 1 for i, text in enumerate(lines) if call in text and not text.lstrip().startswith("def ")]


def other_pairs(name: str, original: Callable, caller: tuple[str, int] | None = None) -> tuple[Callable, str]:
    """A replacement for ``original`` (``(q, k, cos, sin, ..., unsqueeze_dim=1) -> (q_embed, k_embed)``) rotating
    the other pairs, and the words saying so; with ``caller`` (file, line), only the calls from that line (the
    others run the original). The replacement raises TypeError when the call does not bind to the original's
    signature."""
    signature = inspect.signature(original)
    interleaved = "interleave" in name

    def rope(*args, **kwargs):
        if caller is not None:
            frame = sys._getframe(1)
            while frame.f_back is not None and frame.f_code.co_filename.startswith(_PARITY):  # the search's wrapper
                frame = frame.f_back
            if (frame.f_code.co_filename, frame.f_lineno) != caller:
                return original(*args, **kwargs)
        a = bound_arguments(signature, args, kwargs)
        dim = a.get("unsqueeze_dim", 1)
        cos, sin = a["cos"].unsqueeze(dim), a["sin"].unsqueeze(dim)
        turn = _half_split if interleaved else _interleaved
        return turn(a["q"], cos, sin), turn(a["k"], cos, sin)

    words = (
        "RoPE's pairs read half-split (i, i + d/2) in place of interleaved (2i, 2i + 1)"
        if interleaved
        else "RoPE's pairs read interleaved (2i, 2i + 1) in place of half-split (i, i + d/2)"
    )
    return rope, words


def _half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``'s first ``cos.shape[-1]`` dims rotated as pairs ``(i, i + d/2)``, the rest passed through."""
    d = cos.shape[-1]
    x_rot, rest = x[..., :d], x[..., d:]
    half = torch.cat([-x_rot[..., d // 2 :], x_rot[..., : d // 2]], dim=-1)
    return torch.cat([x_rot * cos + half * sin, rest], dim=-1).to(x.dtype)


def _interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``'s first ``cos.shape[-1]`` dims rotated as pairs ``(2i, 2i + 1)`` by frequency ``i`` (the table's first
    half), the rest passed through."""
    d = cos.shape[-1]
    c, s = cos[..., : d // 2], sin[..., : d // 2]
    even, odd = x[..., 0:d:2], x[..., 1:d:2]
    turned = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)
    return torch.cat([turned, x[..., d:]], dim=-1).to(x.dtype)
